"""How each framework that ran a published row runs a step, where it changes the price: its
fused kernels, overlap, reduction dtypes and attention kernel, and the recomputation its
`act_ckpt` cell names. From a row to the `analytic.Software` it is priced with
(`software_for`); `xlaopt.analysis.calibrate` reads the rows.
"""
from __future__ import annotations

from xlaopt.analysis.analytic import Software, priced_recompute
from xlaopt.models import remat

# What an empty act_ckpt cell (the source does not say) is priced as: no recomputation, the
# default of Megatron-Core (recompute_granularity None) and of PyTorch without checkpoint
# wrappers, and what NeMo's published Llama 3 configs run. One value for every row, whatever its
# framework or model, reported on each row that gets it.
RECOMPUTE_DEFAULT = "none"

# How each framework runs a step (first match on the lower-cased framework column).
# Reduction dtypes: TorchTitan reduces gradients in fp32 (its FSDP mixed-precision default);
# MaxText keeps fp32 weights and gathers them as such; Megatron-Core / NeMo reduce in bf16 and
# overlap TP communication (tp_comm_overlap) and the distributed optimizer's reduce / gather;
# 2021 Megatron-LM had neither sequence parallel nor a distributed optimizer and all-reduced
# fp32 gradients after the pipeline flush; LLM Foundry runs FSDP in pure bf16, eager PyTorch.
# Attention kernels (`costmodel.ATTENTION_KERNELS`): TorchTitan's SDPA ran FlashAttention-2 on
# Hopper through 2025 (PyTorch kept cuDNN's backend opt-in after 2.5, pytorch/pytorch#138522 and
# #142132; TorchTitan's own backend list put cuDNN first on sm100 only, models/attention.py
# `_init_backend`, until it put it first everywhere late in 2025: a later TorchTitan row would
# need "cudnn"). The others run cuDNN's fused attention (Transformer Engine's; MaxText's
# `attention=cudnn_flash_te`) or are on Ampere, where the kernel is not told apart. 2021
# Megatron-LM's attention was unfused (batched GEMMs and a fused softmax), priced as the fused
# kernel: attention is under 1% of R21's FLOPs.
FRAMEWORKS = (
    ("maxtext", dict(fused_elementwise=True, param_gather_bytes=4, grad_reduce_bytes=4)),
    ("torchtitan", dict(fused_elementwise=None, param_gather_bytes=2, grad_reduce_bytes=4, tp_overlap=None,
                        attention_kernel="flash2")),
    ("megatron-lm (sc21", dict(sequence_parallel=False, sharded_optimizer=False, dp_overlap=False,
                                grad_reduce_bytes=4)),
    ("nemo", dict(tp_overlap=True)),
    ("megatron", dict(tp_overlap=True)),
    ("llm foundry", dict(fused_elementwise=False)),
)

# How a JAX framework's published runs had XLA compile the step, where the compiled GPU method
# (`calibrate_gpu`) can do the same: (framework, XLA flags, layers unrolled). MaxText's GPU script for
# R01 (MaxText/configs/a3/llama_2_7b/1vm.sh at efb6d9e) sets these, among them XLA's memory-pressure
# rematerialization off, and runs its layers unrolled (`scan_layers=false`). Its other flags are gone
# from jax 0.10.2's XLA ("No such compile option": the async-collective switches, now always on,
# xla_gpu_simplify_all_fp_conversions, xla_gpu_graph_level, xla_gpu_enable_triton_softmax_fusion).
COMPILED_AS = (
    ("maxtext", {"xla_gpu_enable_latency_hiding_scheduler": True, "xla_gpu_enable_triton_gemm": False,
                 "xla_gpu_enable_highest_priority_async_stream": True,
                 "xla_gpu_all_reduce_combine_threshold_bytes": 134217728,
                 "xla_gpu_all_gather_combine_threshold_bytes": 134217728,
                 "xla_gpu_reduce_scatter_combine_threshold_bytes": 67108864,
                 "xla_gpu_enable_pipelined_all_gather": True, "xla_gpu_enable_pipelined_reduce_scatter": True,
                 "xla_gpu_enable_pipelined_all_reduce": True, "xla_gpu_enable_while_loop_double_buffering": True,
                 "xla_gpu_enable_all_gather_combine_by_dim": False,
                 "xla_gpu_enable_reduce_scatter_combine_by_dim": False,
                 "xla_disable_hlo_passes": "rematerialization"}, True),
)


def compiled_as(run) -> tuple[dict, bool]:
    """(XLA flags, layers unrolled) of the row's framework's own compile (`COMPILED_AS`); ({}, False)
    for a framework that is not XLA's."""
    fw = run.framework.lower()
    return next(((dict(flags), unrolled) for key, flags, unrolled in COMPILED_AS if key in fw), ({}, False))


# What a bare "selective" act_ckpt means, for frameworks where the word names one policy: in
# Megatron-LM and Megatron-Core (and so NeMo and Megatron-Bridge) it is the core-attention
# recomputation of Korthikanti et al. 2022 (recompute_granularity "selective", recompute_modules
# ["core_attn"]). Elsewhere it names a family (TorchTitan: per-op or every n-th layer), so the
# cell must say which, e.g. "selective (per-op)".
SELECTIVE_MEANS = (("nemo", "selective-megatron"), ("megatron", "selective-megatron"))


def software_for(run) -> Software | str:
    """The traits of a `calibrate.Run`'s framework, with the row's recomputation and precision; a
    string says why not. A framework not in `FRAMEWORKS` gets `Software`'s defaults (fused kernels, no TP overlap,
    overlapped data-parallel sync, sharded optimizer, bf16 gathers and reductions)."""
    fw = run.framework.lower()
    traits = next((dict(t) for key, t in FRAMEWORKS if key in fw), {})
    if traits.get("fused_elementwise", True) is None:  # TorchTitan: eager unless compiled
        traits["fused_elementwise"] = "compile" in fw
    if traits.get("tp_overlap", False) is None:
        traits["tp_overlap"] = "async" in fw
    recompute = recompute_for(run)
    if not priced_recompute(recompute):  # why it cannot be priced
        return recompute
    return Software(recompute=recompute, fp8_linear=run.precision.lower().startswith("fp8"), **traits)


def recompute_for(run) -> str:
    """The `Software.recompute` policy the row's act_ckpt cell names (`RECOMPUTE_DEFAULT` when
    empty), or why it cannot be priced."""
    ckpt = run.act_ckpt.lower()
    if not ckpt:
        return RECOMPUTE_DEFAULT
    if ckpt in ("none", "false"):
        return "none"
    if ckpt.startswith("full") or ckpt == "remat=full":
        return "full"
    if "per-op" in ckpt:
        return "selective-op"
    named = ckpt.removeprefix("remat=").strip()  # a policy by name (MaxText's remat_policy among them)
    policy = remat.REMAT_POLICIES.get(named)
    if policy is not None and policy.saves is not None:
        return named
    if "core attention" in ckpt or "core_attn" in ckpt:
        return "selective-megatron"
    if "selective" in ckpt:
        fw = run.framework.lower()
        meaning = next((policy for key, policy in SELECTIVE_MEANS if key in fw), None)
        if meaning is not None:
            return meaning
        return (f"act_ckpt {run.act_ckpt!r} on {run.framework!r}: which ops are recomputed is not stated "
                f"(say e.g. 'selective (per-op)' or 'selective (core attention)')")
    return f"act_ckpt {run.act_ckpt!r} not modelled"
