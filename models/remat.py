"""Recomputation policies: what a layer keeps for its backward pass, by name.

The transformer block names its activations with `jax.ad_checkpoint.checkpoint_name` (the names
below, MaxText's spelling where MaxText has one), and a policy is the set of names it saves; a
layer under `jax.checkpoint` with that policy keeps those and its input, and recomputes the rest
in the backward pass. Two policies are JAX's own rules instead of a set (`dots`,
`dots_no_batch`), and `none` keeps everything (no `jax.checkpoint` at all).

The named policies are the published recipes, so that a published run's recomputation compiles
as it ran:
  MaxText     (`remat_policy`; decoders' `get_remat_policy`) minimal, minimal_with_context (its
              deprecated alias minimal_flash), save_dot_with_context_except_mlp,
              save_dot_except_mlpwi, save_dot_except_mlp, save_qkv_proj, save_out_proj, full;
  Megatron    selective recomputation (Korthikanti et al. 2022): the core attention recomputed,
              every other activation a backward reads kept: the norms' outputs, q, k, v, the
              attention's output, the output projection's (the next norm's input is the residual
              sum with it), the MLP's input projections and its activation's output;
  TorchTitan  per-op selective checkpointing: every matmul's and the attention's output saved
              except every second matmul of a layer (k, out and the MLP's up projection, in the
              order q, k, v, out, gate, up, down), elementwise ops recomputed.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax

# The names a block gives its activations.
ATTENTION_NORM = "attention_norm"  # the pre-attention norm's output, the q/k/v projections' input
QUERY, KEY, VALUE = "query_proj", "key_proj", "value_proj"  # the projections' outputs, before norm and rope
CONTEXT = "context"  # the attention's output, the output projection's input
OUT = "out_proj"  # the output projection's output, before the residual
MLP_NORM = "mlp_norm"
MLP_GATE, MLP_UP = "mlpwi_0", "mlpwi_1"  # a gated MLP's input projections (gate: the activation's)
MLP_IN = "mlpwi"  # an ungated MLP's one input projection
MLP_HIDDEN = "mlp_hidden"  # the activation's output, the down projection's input
MLP_OUT = "mlpwo"
NAMES = (ATTENTION_NORM, QUERY, KEY, VALUE, CONTEXT, OUT, MLP_NORM, MLP_GATE, MLP_UP, MLP_IN, MLP_HIDDEN, MLP_OUT)

_QKV = (QUERY, KEY, VALUE)
_MLP_PROJECTIONS = (MLP_GATE, MLP_UP, MLP_IN, MLP_OUT)


@dataclasses.dataclass(frozen=True)
class RematPolicy:
    """`saves`: the names a layer keeps (besides its input), or None where `rule` (one of JAX's
    `jax.checkpoint_policies`, by name) decides instead; `checkpointed`: False only for `none`."""
    name: str
    summary: str
    saves: frozenset[str] | None = frozenset()
    rule: str | None = None
    checkpointed: bool = True

    def __post_init__(self):
        unknown = set(self.saves or ()) - set(NAMES)
        if unknown:
            raise ValueError(f"remat policy {self.name!r} saves names no block gives: {sorted(unknown)}")

    def jax_policy(self) -> Callable | None:
        """The `policy` for `jax.checkpoint`."""
        if self.rule is not None:
            return getattr(jax.checkpoint_policies, self.rule)
        if not self.saves:
            return jax.checkpoint_policies.nothing_saveable
        return jax.checkpoint_policies.save_only_these_names(*sorted(self.saves))


def _saving(name: str, summary: str, *names: str) -> RematPolicy:
    return RematPolicy(name, summary, frozenset(names))


_MINIMAL = (*_QKV, OUT, *_MLP_PROJECTIONS)
REMAT_POLICIES: dict[str, RematPolicy] = {p.name: p for p in (
    RematPolicy("none", "keep every activation", saves=None, checkpointed=False),
    _saving("full", "keep only each layer's input; recompute the layer"),
    RematPolicy("dots", "keep every matmul's output (JAX's dots_saveable)", saves=None, rule="dots_saveable"),
    RematPolicy("dots_no_batch", "keep the matmuls without batch dimensions: weights x activations, not "
                "the attention's (JAX's dots_with_no_batch_dims_saveable)", saves=None,
                rule="dots_with_no_batch_dims_saveable"),
    _saving("minimal", "MaxText: every projection's output", *_MINIMAL),
    _saving("minimal_with_context", "MaxText: every projection's output and the attention's", *_MINIMAL, CONTEXT),
    _saving("minimal_flash", "MaxText's deprecated name for minimal_with_context", *_MINIMAL, CONTEXT),
    _saving("save_dot_with_context_except_mlp", "MaxText: q, k, v, the attention's output and the output "
            "projection's", *_QKV, CONTEXT, OUT),
    _saving("save_dot_except_mlpwi", "MaxText: q, k, v, the output projection's and the MLP's down projection's",
            *_QKV, OUT, MLP_OUT),
    _saving("save_dot_except_mlp", "MaxText: q, k, v and the output projection's", *_QKV, OUT),
    _saving("save_qkv_proj", "MaxText: q, k and v", *_QKV),
    _saving("save_out_proj", "MaxText: the output projection's output", OUT),
    _saving("selective_megatron", "Megatron's selective recomputation: recompute the core attention, keep "
            "what else a backward reads", ATTENTION_NORM, *_QKV, CONTEXT, OUT, MLP_NORM, MLP_GATE, MLP_UP,
            MLP_IN, MLP_HIDDEN),
    _saving("selective_op", "TorchTitan's per-op policy: matmul and attention outputs except every second "
            "matmul (k, out, up)", QUERY, VALUE, CONTEXT, MLP_GATE, MLP_IN, MLP_OUT),
)}
