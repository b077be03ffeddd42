"""Context parallel attention, Ulysses style: where the context axis splits the sequence, each
attention turns its sequence-split queries, keys and values into head-split ones with one
all-to-all each, attends over the whole sequence with its share of the heads, and turns the
output back with another all-to-all.

XLA's partitioner meets a sequence-split attention by gathering the keys and values over the
context ranks, and the implementation then sees only its own queries. Here the attention (any
implementation, by `models.attention`'s wrapper seam) runs in a `shard_map` over the context
axis (and the axes that split the heads, so each tensor rank moves only its own) on whole rows:
each rank holds every token of `kv_heads / context` key-value heads (and their query heads,
which are contiguous under grouped-query attention). The heads are cut into `chunks`
groups whose all-to-alls and attentions are independent, so a GPU schedule can move one group's
all-to-all under another group's attention. The mask's per-token facts (segment, tower, position)
are gathered whole: a few integers a token.

Fits where each tensor rank's query heads split over the context ranks. Where its key-value heads
are fewer than the context ranks (or do not split over them), each is repeated r times first, so
that every context rank gets whole (repeated) kv heads and the query heads that read them (GQA's
groups stay contiguous: q head h reads repeated kv head h // (H / (N r))); the repeat's gradient
sums the copies back. `ulysses_split` says which (r, chunks) a layout takes.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, ClassVar

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from xlaopt.models.attention import attention_through
from xlaopt.models.layers import batch_mesh_axes, head_axes_among, rows_split_over
from xlaopt.models.masks import Tokens
from xlaopt.transforms import GradTransform


def ulysses_split(heads: int, kv_heads: int, tensor: int, context: int, chunks: int = 2) -> tuple[int, int] | None:
    """(kv repeat r, head groups) for Ulysses on a tensor rank's heads over `context` ranks, or
    None where its query heads do not split (or r would split a GQA group): r the least that
    makes the rank's kv heads split over context x groups, groups `chunks` where that divides, else 1."""
    h, n = heads // tensor, kv_heads // tensor
    if n == 0 or h % context:
        return None
    repeat = context // math.gcd(n, context)
    if (h // n) % repeat:
        return None
    groups = next((c for c in (chunks, 1) if (n * repeat) % (context * c) == 0 and h % (context * c) == 0), 0)
    return (repeat, groups) if groups else None


@dataclasses.dataclass(frozen=True)
class UlyssesAttentionTransform(GradTransform):
    name: ClassVar[str] = "ulysses-attention"
    axis: str  # the mesh axis that splits the sequence (context)
    chunks: int = 2  # head groups whose all-to-alls and attentions are independent
    kv_repeat: int = 1  # each kv head repeated so that every context rank gets whole ones

    def attend(self, attend: Callable, q_BLHK, k_BSNK, v_BSNK, q_tokens: Tokens, k_tokens: Tokens):
        axis, chunks, repeat = self.axis, self.chunks, self.kv_repeat
        # Manual over the rows' axes too: left automatic, XLA's partitioner met the all-to-alls'
        # transposes by gathering every row to every device (cosmos3-nano on data=2,fsdp=16,
        # context=4: 2.6 TB a step over data,fsdp, a 106 s step against 30 s without context).
        manual = set(jax.sharding.get_abstract_mesh().manual_axes)
        rows = tuple(a for a in batch_mesh_axes() if a not in manual and a != axis)
        # Inside a pipeline stage manual over the axis already (`models.pipeline`), each device
        # holds its chunk: the all-to-alls run on it as they are.
        split = None if axis in manual else axis
        seq = PartitionSpec(rows or None, split)
        # Manual over the axes that split the heads too: left automatic, the all-to-alls' split of
        # the heads met the layout's and XLA's partitioner gathered every head over `tensor`
        # first (calibration row N11, 8 x 268 MB all-to-alls over InfiniBand a tick).
        mesh = jax.sharding.get_abstract_mesh()
        heads = head_axes_among([a for a in mesh.axis_names if a not in manual and a != axis], q_BLHK, k_BSNK)
        qkv = PartitionSpec(rows or None, split, heads or None)

        def local(q, k, v, qt, kt):
            whole = lambda t: Tokens(*(jax.lax.all_gather(a, axis, axis=1, tiled=True) for a in t))  # noqa: E731
            qt, kt = whole(qt), whole(kt)
            if repeat > 1:
                k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)
            N, H = k.shape[2], q.shape[2]
            n, h = N // chunks, H // chunks
            to_heads = lambda x: jax.lax.all_to_all(x, axis, 2, 1, tiled=True)  # noqa: E731  seq -> heads
            to_seq = lambda x: jax.lax.all_to_all(x, axis, 1, 2, tiled=True)  # noqa: E731  heads -> seq
            with rows_split_over(()):  # this device's rows, whole: nothing left for the attention to split
                outs = [to_seq(attend(to_heads(q[:, :, g * h:(g + 1) * h]), to_heads(k[:, :, g * n:(g + 1) * n]),
                                      to_heads(v[:, :, g * n:(g + 1) * n]), qt, kt))
                        for g in range(chunks)]
            return jnp.concatenate(outs, axis=2)

        names = {*rows, *([split] if split else []), *heads}
        if not names:
            return local(q_BLHK, k_BSNK, v_BSNK, q_tokens, k_tokens)
        tokens = Tokens(seq, seq, seq)
        # Unchecked: segment attention's own VJP inside knows nothing of varying axes; every input
        # and the output are split over the axis, so nothing replicated needs the check.
        return jax.shard_map(local, in_specs=(qkv, qkv, qkv, tokens, tokens), out_specs=qkv,
                             axis_names=names, check_vma=False)(q_BLHK, k_BSNK, v_BSNK, q_tokens, k_tokens)

    def apply(self, grad_fn: Callable) -> Callable:
        def wrapped(params, batch, key):
            with attention_through(self.attend, sequence_axis=self.axis):
                return grad_fn(params, batch, key)
        return wrapped
