"""What each layer keeps for the backward pass, per token, as the program's own jaxpr says.

The planner's memory formula (`price.memory_parts`) counts a layer's activations from the
model's shape. That is exact where the recomputation policy keeps only matmul outputs or the
layer input, but without recomputation JAX's autodiff keeps more than the matmul outputs: the
rotated queries and keys, the attention's own residuals, the MLP activation's coefficients
(`layers._swiglu`; RMSNorm keeps only its input, `layers.rms_norm`). Since 2026-12-06 that is
46 bytes a token a layer per d_model on llama3-8b and cosmos3-nano in bf16; it was 79 and 84
while autodiff also kept the norms' fp32 values and every elementwise output of the MLP. So the
planner traces the program's loss under each policy (the residuals of its vjp, as
`jax.ad_checkpoint.print_saved_residuals` lists them; abstract shapes: nothing is compiled or
allocated) and takes the bytes the layer stack saves per token, unsharded.

Per token: the residuals of a batch one row longer less those of the batch (the weights' cast
copies, which the stack also saves, are the same in both and cancel), over the row's tokens and
the layers. A residual belongs to the stack when its leading dimension is the layer count; the
two batches are longer than that, so no batch dimension passes for it.
"""
from __future__ import annotations

import dataclasses
import functools

import jax

from xlaopt.errors import UserError
from xlaopt.mesh import MeshSpec
from xlaopt.program import TrainProgram

# Traced where the formula is not exact; a named policy saves exactly its set (the layer input
# and the activations it names: tests/test_remat.py), which the formula counts.
POLICIES = ("none", "dots", "full")


@functools.lru_cache(maxsize=16)
def _stack_bytes(program: TrainProgram, remat: str, rows: int) -> int:
    from xlaopt import step
    from xlaopt.families import family_of

    b = dataclasses.replace(program.settings.batch, batch_size=rows)
    p = program.replace(settings=dataclasses.replace(program.settings, batch=b),
                        execution=dataclasses.replace(program.execution, remat=remat, micro_batches=1),
                        shardings=None)
    params, _ = step.abstract_params_with_axes(p)
    (model, family_loss), family, key = step.model_loss(p), family_of(p.model), jax.random.key(0)
    loss = lambda w, x: family_loss(model, w, family.with_draws(x, key), key)[0]  # noqa: E731
    # The residuals are the leaves of the vjp closure; those that are the inputs themselves are
    # not saved activations.
    closed = jax.make_jaxpr(lambda w, x: jax.tree.leaves(jax.vjp(loss, w, x)[1]))(params, step.abstract_batch(p))
    inputs = {id(v) for v in closed.jaxpr.invars}
    saved = {id(v): v.aval for v in closed.jaxpr.outvars if id(v) not in inputs}  # each once
    layers = p.model.num_layers
    return sum(a.size * a.dtype.itemsize for a in saved.values() if a.ndim >= 3 and a.shape[0] == layers)


def saved_bytes_per_token_layer(program: TrainProgram, compute_dtype: str, matmuls: str = "compute",
                                policies: tuple[str, ...] = POLICIES) -> dict[str, float]:
    """{remat policy: bytes one layer saves per token of a row, unsharded}, in `compute_dtype`
    with the projections' matmuls in `matmuls` (fp8 saves their inputs in fp8), for each of
    `policies` (the planner's by default); cached per (model, row shape, execution)."""
    if not hasattr(program.model, "num_layers"):
        raise UserError(f"{program.model.name} has no layer stack whose residuals could be traced")
    base = program.replace(mesh=MeshSpec(), shardings=None,
                           execution=dataclasses.replace(program.execution, compute_dtype=compute_dtype,
                                                         matmuls=matmuls))
    b, rows = base.settings.batch, base.model.num_layers + 1
    per_row = lambda remat: _stack_bytes(base, remat, rows + 1) - _stack_bytes(base, remat, rows)  # noqa: E731
    return {r: per_row(r) / ((b.text_len + b.gen_len) * base.model.num_layers) for r in policies}
