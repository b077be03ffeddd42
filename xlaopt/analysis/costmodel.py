"""Cost-model primitives: compute by a roofline, collectives by algorithm over link levels.

Pure Python (no JAX): the same functions price an analytic description of a training step
(`xlaopt.analysis.calibrate`) and, later, the collectives read from compiled HLO.

- Compute: matmul FLOPs run at the dtype's datasheet peak times an efficiency that grows with
  the size of the matmul, e = matmul_max * x / (x + matmul_half_flops), x the per-GPU FLOPs of
  one matmul (small matmuls cannot fill the GPU and pay fixed launch/tail costs). Memory-bound
  work (elementwise ops, the optimizer update) runs at the HBM bandwidth.
- Collectives: ring all-gather / reduce-scatter of an array of V bytes over n ranks take
  (n-1) latency steps and move (n-1)/n * V per rank; all-reduce is both (twice that); a
  double binary tree all-reduce takes 2*ceil(log2 n) latency steps and 2V/W, so it wins only for
  small, latency-bound messages. A group that spans nodes runs hierarchically: inside each node
  over NVLink, then across nodes between same-rank GPUs, each with its own NIC (rail-aligned, as
  in DGX systems), on 1/(members per node) of the data. The achieved fraction of a link's
  bandwidth is one efficiency per link kind (NVLink vs network).
- Point-to-point sends (pipeline stages): one latency plus bytes / achieved bandwidth.

Volumes follow the scaling-book convention used in `xlaopt.analysis.hlo`: V is the size of the whole
array (all-gather result, reduce-scatter operand, all-reduce operand).
"""
from __future__ import annotations

import dataclasses
import math

from xlaopt.analysis.topology import SIMULATED_CPU, LinkLevel, Topology

COLLECTIVE_KINDS = ("all-gather", "reduce-scatter", "all-reduce")


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """The cost model's free parameters: achieved fractions of datasheet figures.

    matmul_max: fraction of the dense peak a large matmul reaches on Hopper and newer GPUs.
    matmul_max_ampere: the same on Ampere (A100). Separate because the A100 sustains a larger
      share of its lower peak: Hopper's and Blackwell's peaks assume clocks their power limits do
      not hold under dense matmuls, and they have half the A100's HBM bytes per FLOP.
    matmul_half_flops: per-GPU FLOPs of one matmul at which it reaches half its maximum (small
      matmuls cannot fill the GPU and pay fixed launch and tail costs).
    attention: fraction of the bf16 peak fused (flash) attention reaches, forward and backward:
      a kernel written for the GPU it runs on (cuDNN's, Transformer Engine's, FlashAttention-3 on
      Hopper; any flash kernel on Ampere).
    attention_flash2: the same for FlashAttention-2 (PyTorch SDPA's flash backend) on Hopper and
      newer, which it runs without their warpgroup matmuls and tensor-memory copies: about half
      the rate (forward at 24 x 4,608 x 128 on an H100, SDPA 329 TFLOP/s against cuDNN's 631,
      pytorch/pytorch#142132). See `attention_for`.
    nvlink: fraction of the per-direction NVLink bandwidth a collective inside a node achieves.
    network: fraction of the per-GPU NIC bandwidth a collective across nodes achieves.
    """
    matmul_max: float
    matmul_max_ampere: float
    matmul_half_flops: float
    attention: float
    attention_flash2: float
    nvlink: float
    network: float

    def __post_init__(self):
        for name in ("matmul_max", "matmul_max_ampere", "attention", "attention_flash2", "nvlink", "network"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"Efficiency.{name}={value} must be in (0, 1]")
        if self.matmul_half_flops < 0:
            raise ValueError(f"Efficiency.matmul_half_flops={self.matmul_half_flops} must be >= 0")

    def matmul_max_for(self, device_name: str) -> float:
        """The large-matmul fraction of peak for a device (by its topology name)."""
        return self.matmul_max_ampere if "A100" in device_name else self.matmul_max

    def attention_for(self, kernel: str, device_name: str) -> Efficiency:
        """These efficiencies with `attention` the fraction `kernel` (one of ATTENTION_KERNELS)
        reaches on the device (by its topology name): FlashAttention-2's own on Hopper and newer,
        `attention` elsewhere (on Ampere it is the native kernel)."""
        if kernel not in ATTENTION_KERNELS:
            raise ValueError(f"attention kernel {kernel!r}; use one of {', '.join(ATTENTION_KERNELS)}")
        if kernel == "flash2" and "A100" not in device_name:
            return dataclasses.replace(self, attention=self.attention_flash2)
        return self


# The fused attention kernels a run's step may use (`Efficiency.attention_for`): "cudnn" for
# the kernels written for the GPU they run on (cuDNN's fused attention, which Transformer Engine
# and xlaopt's `attention=cudnn` call; FlashAttention-3), "flash2" for FlashAttention-2.
ATTENTION_KERNELS = ("cudnn", "flash2")


# Fitted by `xlaopt.analysis.calibrate.fit`: Nelder-Mead from `calibrate.FIT_START` (restarted from its best
# point until a restart gains nothing), minimising the mean |log(predicted / measured)| over all 11 rows of
# xlaopt/analysis/published_runs.csv (MaxText R01; TorchTitan R05, R06, R08; NeMo R11, R12,
# R13; Megatron-Bridge R14, R16; Megatron-LM R21; LLM Foundry R23), every row weighted equally and
# priced by `xlaopt.analysis.analytic.price_step`; nvlink and network fitted as one value (the rows cannot
# separate them, see `efficiency_fit._FRACTIONS`); rounded to 3 significant figures.
# `xlaopt calibrate --fit` redoes this fit and prints the literal below; last redone
# 2026-12-06, when TorchTitan's FlashAttention-2 got its own fraction (`attention_flash2`) and
# the fit restarted its simplex until it stopped gaining (`efficiency_fit.minimise`): mean |log|
# 0.0267 against the earlier values' 0.0515. tests/test_calibrate.py refits and checks these
# values; `xlaopt calibrate` prints the per-row and leave-one-out errors. Do not retune
# against single rows: other published runs are held out to test these values.
FITTED = Efficiency(matmul_max=0.612, matmul_max_ampere=0.792, matmul_half_flops=9.34e+10, attention=0.348,
                    attention_flash2=0.166, nvlink=0.827, network=0.827)


# Fused attention's forward at head dim 128 over long non-causal rows, as a fraction of the bf16 peak:
#   Hopper     FlashAttention-3 (the reference's kernel on sm90): 620.7 TFLOP/s on H100 SXM at
#              1 x 16 heads x 16,384 x 128 (pytorch/benchmark PR #2391's table), of 989: 0.628;
#   Blackwell  cuDNN-class fused attention (the reference's sm100 kernels, NATTEN's FMHA and then
#              cuDNN): FlashAttention-4's paper reaches 1,613 TFLOP/s on B200, "up to 1.3x over
#              cuDNN 9.13", so cuDNN at about 1,240 of 2,250: 0.55 (derived, not measured here).
FORWARD_ATTENTION = {"H100": 0.628, "H200": 0.628, "B200": 0.55}


def forward_attention_fraction(device_name: str, eff: Efficiency) -> float:
    """The forward attention fraction for a device by its name; the training fit's elsewhere."""
    return next((f for key, f in FORWARD_ATTENTION.items() if key in device_name), eff.attention)


def serving_efficiency(topology) -> Efficiency:
    """`efficiency_for(topology)` for a serving step, whose fused attention runs forward only."""
    eff = efficiency_for(topology)
    return dataclasses.replace(eff, attention=forward_attention_fraction(topology.device.name, eff))


def efficiency_for(topology) -> Efficiency:
    """FITTED for GPUs; for simulated CPU devices, measured on this host (the GPU fit says nothing
    about XLA's CPU kernels): large matmuls reach the measured peak by definition (matmul_max 1);
    `matmul_half_flops` from a 128^3 matmul's measured fraction of it (the FLOPs at which a matmul
    reaches half, on the curve e = f / (f + half)); attention (dense matmuls and a softmax on the
    CPU) at that small matmul's fraction; copies between simulated devices at the link's full rate."""
    from xlaopt.analysis.topology import SIMULATED_CPU

    if topology.device.name != SIMULATED_CPU:
        return FITTED
    from xlaopt.analysis.cpu_peak import measure_small_matmul_fraction

    flops, fraction = measure_small_matmul_fraction()
    return Efficiency(matmul_max=1.0, matmul_max_ampere=1.0, matmul_half_flops=flops * (1 / fraction - 1),
                      attention=max(fraction, 1e-3), attention_flash2=max(fraction, 1e-3), nvlink=1.0, network=1.0)


# --- compute -----------------------------------------------------------------------------

def matmul_efficiency(flops_per_matmul: float, matmul_max: float, half_flops: float) -> float:
    """Fraction of peak a matmul of `flops_per_matmul` (on one GPU) achieves:
    matmul_max * x / (x + half_flops)."""
    x = max(flops_per_matmul, 0.0)
    return matmul_max * x / (x + half_flops) if x > 0 else 0.0


def matmul_time_s(flops: float, peak_flops_per_s: float, flops_per_matmul: float, matmul_max: float,
                  half_flops: float) -> float:
    """Time of `flops` of matmuls, each of `flops_per_matmul`, on a device of the given peak."""
    if flops <= 0:
        return 0.0
    return flops / (peak_flops_per_s * matmul_efficiency(flops_per_matmul, matmul_max, half_flops))


def attention_time_s(flops: float, bf16_peak_flops_per_s: float, eff: Efficiency) -> float:
    """Fused attention: a fixed fraction of the bf16 peak (its matmuls are large; its softmax and
    the recomputation inside the backward kernel are what keep it below a plain matmul)."""
    return max(flops, 0.0) / (bf16_peak_flops_per_s * eff.attention)


def memory_time_s(bytes_moved: float, hbm_bytes_per_s: float) -> float:
    """Memory-bound time: bytes read plus written, at the HBM bandwidth."""
    return max(bytes_moved, 0.0) / hbm_bytes_per_s


def roofline_time_s(flops: float, bytes_moved: float, peak_flops_per_s: float, hbm_bytes_per_s: float,
                    compute_efficiency: float = 1.0) -> float:
    """One op: bound by whichever of compute and memory traffic takes longer."""
    return max(flops / (peak_flops_per_s * compute_efficiency), bytes_moved / hbm_bytes_per_s)


# --- collectives -------------------------------------------------------------------------

def ring_time_s(kind: str, volume_bytes: float, n: int, level: LinkLevel, link_eff: float) -> float:
    """A ring collective over n ranks on one link level (V = whole-array bytes)."""
    _check_kind(kind)
    if n <= 1 or volume_bytes <= 0:
        return 0.0
    one_pass = (n - 1) * level.latency_s + (n - 1) / n * volume_bytes / (level.bytes_per_s * link_eff)
    return 2 * one_pass if kind == "all-reduce" else one_pass


def tree_all_reduce_time_s(volume_bytes: float, n: int, level: LinkLevel, link_eff: float) -> float:
    """Double binary tree all-reduce: log-depth latency, 2V/W bandwidth term."""
    if n <= 1 or volume_bytes <= 0:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * level.latency_s + 2 * volume_bytes / (level.bytes_per_s * link_eff)


@dataclasses.dataclass(frozen=True)
class GroupSpan:
    """How a group of ranks sits on the machine: `per_node` members in each of `nodes` nodes."""
    per_node: int
    nodes: int

    @property
    def size(self) -> int:
        return self.per_node * self.nodes


def group_span(size: int, stride: int, devices_per_node: int) -> GroupSpan:
    """The span of a mesh axis of `size` whose neighbours are `stride` ranks apart, with ranks
    numbered node-major (ranks 0..devices_per_node-1 on node 0, and so on)."""
    if size <= 1:
        return GroupSpan(1, 1)
    if stride >= devices_per_node:
        return GroupSpan(1, size)
    per_node = min(size, max(1, devices_per_node // stride))
    return GroupSpan(per_node, math.ceil(size / per_node))


def collective_time_s(kind: str, volume_bytes: float, span: GroupSpan, topology: Topology,
                      eff: Efficiency) -> float:
    """A collective over a group on the topology: a ring inside one node, hierarchical across
    nodes (intra-node pass on V, inter-node pass on V / per_node); all-reduce takes the faster
    of that and a tree, as NCCL's tuner does."""
    _check_kind(kind)
    if span.size <= 1 or volume_bytes <= 0:
        return 0.0
    inner, outer = topology.levels[0], topology.levels[-1]
    if span.nodes == 1:
        ring = ring_time_s(kind, volume_bytes, span.per_node, inner, eff.nvlink)
        tree = tree_all_reduce_time_s(volume_bytes, span.per_node, inner, eff.nvlink)
    else:
        ring = (ring_time_s(kind, volume_bytes, span.per_node, inner, eff.nvlink)
                + ring_time_s(kind, volume_bytes / span.per_node, span.nodes, outer, eff.network))
        tree = (ring_time_s(kind, volume_bytes, span.per_node, inner, eff.nvlink)
                + tree_all_reduce_time_s(volume_bytes / span.per_node, span.nodes, outer, eff.network))
    return min(ring, tree) if kind == "all-reduce" else ring


# XLA's own all-reduce kernels (jax 0.10.2's XLA, `CollectiveKernelThunk`): run instead of NCCL when
# the program is compiled with `ALL_REDUCE_KERNELS_OPTION`, for a single array of bf16 or f32 (a sum)
# over at most 8 GPUs of one host with peer access. Each GPU copies its input into a buffer its peers
# can read; one-shot (to 256 KiB): after a barrier every GPU reads all its peers' inputs over NVLink
# and sums them, then a closing barrier; two-shot (to 2 MiB): every GPU sums its 1/n slice from all
# peers, a barrier, then reads the other slices' sums. XLA annotates each eligible all-reduce with
# its strategy (`kernel_strategy` in the backend config) whether or not the option is set; the option
# decides at run time. Checked on the installed plugin by tests/test_all_reduce_kernels.py.
ALL_REDUCE_KERNELS_OPTION = "xla_gpu_unsupported_use_all_reduce_one_shot_kernel"
ONE_SHOT_MAX_BYTES, TWO_SHOT_MAX_BYTES, KERNEL_MAX_RANKS = 256 * 1024, 2 * 1024 * 1024, 8


def kernel_strategy(volume_bytes: float, span: GroupSpan) -> str | None:
    """"one-shot" or "two-shot" where XLA runs its own kernel for an all-reduce of this size over
    this group (with `ALL_REDUCE_KERNELS_OPTION` set), else None (NCCL)."""
    if span.nodes != 1 or not 1 < span.per_node <= KERNEL_MAX_RANKS or volume_bytes <= 0:
        return None
    if volume_bytes <= ONE_SHOT_MAX_BYTES:
        return "one-shot"
    return "two-shot" if volume_bytes <= TWO_SHOT_MAX_BYTES else None


def kernel_all_reduce_time_s(strategy: str, volume_bytes: float, n: int, level: LinkLevel, link_eff: float,
                             hbm_bytes_per_s: float) -> float:
    """One of XLA's all-reduce kernels: the input copied to the peer-readable buffer (HBM), one
    latency a barrier, and the bytes each GPU reads from its peers over NVLink."""
    if n <= 1 or volume_bytes <= 0:
        return 0.0
    bandwidth = level.bytes_per_s * link_eff
    copy = 2 * volume_bytes / hbm_bytes_per_s
    if strategy == "one-shot":
        return 2 * level.latency_s + (n - 1) * volume_bytes / bandwidth + copy
    if strategy == "two-shot":
        return 3 * level.latency_s + 2 * (n - 1) / n * volume_bytes / bandwidth + copy
    raise ValueError(f"all-reduce kernel strategy {strategy!r}; use 'one-shot' or 'two-shot'")


def serving_all_reduce_time_s(volume_bytes: float, span: GroupSpan, topology: Topology, eff: Efficiency) -> float:
    """An all-reduce of a serving step, compiled with `ALL_REDUCE_KERNELS_OPTION`: XLA's kernel
    where it runs one, else NCCL's algorithms (and on simulated CPU devices, which have neither)."""
    strategy = kernel_strategy(volume_bytes, span) if topology.device.name != SIMULATED_CPU else None
    if strategy is None:
        return collective_time_s("all-reduce", volume_bytes, span, topology, eff)
    return kernel_time_on(strategy, volume_bytes, span, topology, eff)


def kernel_time_on(strategy: str, volume_bytes: float, span: GroupSpan, topology: Topology, eff: Efficiency) -> float:
    """`kernel_all_reduce_time_s` over a group of one host's GPUs on `topology`."""
    return kernel_all_reduce_time_s(strategy, volume_bytes, span.per_node, topology.levels[0], eff.nvlink,
                                    topology.device.hbm_bytes_per_s)


def send_time_s(volume_bytes: float, level: LinkLevel, link_eff: float) -> float:
    """A point-to-point send (pipeline stage to stage)."""
    if volume_bytes <= 0:
        return 0.0
    return level.latency_s + volume_bytes / (level.bytes_per_s * link_eff)


def exposed_s(comm_s: float, overlapping_compute_s: float) -> float:
    """Communication left on the critical path when it overlaps `overlapping_compute_s`."""
    return max(0.0, comm_s - overlapping_compute_s)


def _check_kind(kind: str) -> None:
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"collective kind {kind!r}; use one of {COLLECTIVE_KINDS}")
