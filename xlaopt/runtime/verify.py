"""Sharded equals single-device: one gradient computation on a mesh against one device.

Both runs build the same program (same seed, same batch, same noise key) and differ only
in the mesh. Both start from the same parameters, the model's initial ones made once a process
on one device and placed on each program's shardings (`initial_params`): the comparison is of
the step, and a sharded init making the same parameters bit for bit is a test of its own
(tests/test_verify.py). Tolerances come from the compute dtype's rounding, because partitioning
legitimately reorders sums (tensor-parallel partial sums, cross-shard gradient
reductions) and nothing else:
  float32 (default): loss within 1e-5 relative and every gradient leaf within 1e-4 in
    relative L2 norm. That is ~100-800 ulps (eps = 1.2e-7) of slack for reordered sums
    of 10^3-10^4 terms (measured: 0 and ~3e-6 on cosmos3-tiny), while a partitioning bug
    (a missing or doubled reduction, a dropped or misplaced shard) moves a gradient by
    1/8 or more on an 8-way mesh.
  bfloat16: 4 eps (1.6e-2) for the loss and 16 eps (6.2e-2) for gradients, since every
    activation is rounded to 8 bits of mantissa on both sides (measured ~2e-4 and ~3e-2);
    this only catches gross errors, which is why float32 is the default.
  float16: compared to the float32 program on one device, not to float16 on one device: both
    float16 runs would share a loss-scaling error (gradients not unscaled, or underflowed to
    zero by too small a scale), which only a reference without scaling exposes. The first
    step is compared, its loss scaled by `loss_scale_init` as a fresh run's is. Tolerances
    are 4 eps (2.0e-3) for the loss and 16 eps (7.8e-3) for gradients, eps = 2^-11 (float16's
    unit roundoff), since every activation is rounded to 11 bits of mantissa on the float16
    side only. Measured on data=2,fsdp=2,tensor=2 and fsdp=4,tensor=2, loss relative and worst
    gradient: cosmos3-tiny 1.4e-5 and 3.2e-3 (its 2-layer test size 2.3e-5 and 2.0e-3),
    llama-tiny 1.1e-6 and 2.2e-3; about the same on one device (2.1e-3 for both), so the
    rounding, not the partitioning, sets them. Too small a scale fails: with loss_scale_init =
    2^-10 gradients underflow and differ by 2.07 (llama-tiny) and 0.57 (cosmos3-tiny).
  fp8 matmuls (`matmuls="fp8"`, compared to the same fp8 program on one device): rounding to
    fp8 is a step function, so the few values that partitioning's reordered sums move across a
    rounding boundary move by a whole fp8 step (1/8 of the value in E4M3, 1/4 in E5M2), and
    layer after layer those moves compound; each run is still within fp8's rounding of the
    exact product. The loss, a mean over every token, moves little: 2^-8 relative. A gradient
    leaf is allowed one E5M2 step, 2^-2 in relative L2 norm: the partitioning bugs above move it
    by 1/8 or more on an 8-way mesh, and an fp8 scaling bug (a scale missing or applied twice)
    by a factor. Measured on llama-tiny (4 layers, float32 compute) with tensor=2 and
    data=2,tensor=2: loss 7e-6, worst gradient 0.136; data=2 alone (no reordered matmul sum)
    3e-7.
  grad_reduce_dtype=bfloat16 (the accumulated gradients cross data rounded to bf16): compared
    under bfloat16's tolerances whatever the compute dtype, each gradient being rounded to bf16
    once. Measured on llama-tiny in float32, data=4,tensor=2, 2 micro-batches: worst gradient
    2.4e-3 (8.9e-7 reduced in float32); a missing or doubled reduction is still off by 1/4 or more.
  grad_accumulate_dtype=bfloat16 (each micro-batch's gradients added to a bf16 sum): the same,
    the sum rounded to bf16 once a micro-batch.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from xlaopt.compile import compile_program
from xlaopt.families import family_of
from xlaopt.mesh import MeshSpec
from xlaopt.program import TrainProgram

TOLERANCES = {  # dtype -> (loss relative, gradient relative L2)
    "float32": (1e-5, 1e-4),
    "bfloat16": (4 * 2.0**-8, 16 * 2.0**-8),
    "float16": (4 * 2.0**-11, 16 * 2.0**-11),
    "fp8": (2.0**-8, 2.0**-2),  # matmuls="fp8", any compute dtype (see the module docstring)
}
# Compute dtypes whose single-device reference runs in another dtype (see the module docstring).
REFERENCE_DTYPES = {"float16": "float32"}


def tolerance_key(execution) -> str:
    """The TOLERANCES entry an execution config is compared under. Gradients reduced over data in
    bfloat16 are each rounded to it once, so a float32 step is compared as a bfloat16 one."""
    if execution.matmuls == "fp8":
        return "fp8"
    if execution.compute_dtype == "float32" and "bfloat16" in (execution.grad_reduce_dtype,
                                                                 execution.grad_accumulate_dtype):
        return "bfloat16"
    return execution.compute_dtype


def reference_program(program: TrainProgram) -> TrainProgram:
    """The single-device program `program` is compared to, before the pass pipeline: the same
    program on one device, in float32 where `program` computes in float16, its layers scanned
    where `program` pipelines them (so the pipeline's own code is checked, not compared with
    itself)."""
    execution = program.execution
    if execution.compute_dtype in REFERENCE_DTYPES:
        execution = dataclasses.replace(execution, compute_dtype=REFERENCE_DTYPES[execution.compute_dtype])
    if execution.layer_stack == "pipeline":
        execution = dataclasses.replace(execution, layer_stack="scan", pipeline_microbatches=0)
    # One device reduces nothing over data; its gradients are summed as exactly as it can.
    execution = dataclasses.replace(execution, grad_reduce_dtype="float32", grad_accumulate_dtype="float32")
    return program.replace(mesh=MeshSpec(), shardings=None, execution=execution)


def initial_params(program: TrainProgram):
    """The model's initial parameters for `program`'s seed (host arrays), as its reference's init
    makes them on one device; computed once a process for every program sharing the model,
    settings and reference execution, so the programs compared with each other compile one init."""
    reference = reference_program(program)
    return _initial_params(TrainProgram(reference.model, settings=reference.settings, execution=reference.execution,
                                        target=reference.target))


@functools.lru_cache(maxsize=8)
def _initial_params(program: TrainProgram):
    key = jax.random.key(program.settings.seed)
    return jax.tree.map(np.asarray, compile_program(program).init(jax.random.fold_in(key, 0)).params)


def one_step_grads(program: TrainProgram):
    """The first step's (loss, gradients) of `program`, from `initial_params` placed on its shardings."""
    compiled = compile_program(program)
    key = jax.random.key(program.settings.seed)
    params = jax.device_put(initial_params(program), compiled.state_shardings.params)
    batch = family_of(program.model).synthetic(program.model, program.settings.batch, program.settings.seed).batch(0)
    loss, _, grads = compiled.grads(params, compiled.put_batch(batch), jax.random.fold_in(key, 1))
    return float(loss), jax.tree.map(np.asarray, grads)


def compare(sharded: tuple, reference: tuple, dtype: str) -> dict:
    (loss, grads), (ref_loss, ref_grads) = sharded, reference
    rel = jax.tree.map(lambda g, r: _rel_l2(g, r), grads, ref_grads)
    flat = jax.tree_util.tree_flatten_with_path(rel)[0]
    worst_path, worst = max(flat, key=lambda kv: kv[1])
    loss_tol, grad_tol = TOLERANCES[dtype]
    loss_diff = abs(loss - ref_loss)
    return {
        "loss": loss, "reference_loss": ref_loss,
        "max_abs_diff_loss": loss_diff,
        "max_rel_diff_grads": worst,
        "worst_grad": jax.tree_util.keystr(worst_path),
        "loss_tolerance": loss_tol * max(abs(ref_loss), 1.0),
        "grad_tolerance": grad_tol,
        "ok": bool(loss_diff <= loss_tol * max(abs(ref_loss), 1.0) and worst <= grad_tol),
    }


def _rel_l2(g: np.ndarray, r: np.ndarray) -> float:
    diff = float(np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-30))
    # An overflowed gradient (inf or nan) is the worst difference there is; nan would compare
    # as neither worse nor better than a finite one.
    return diff if np.isfinite(diff) else float("inf")
