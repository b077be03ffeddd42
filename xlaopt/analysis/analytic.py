"""Price one optimizer step of a decoder LLM analytically, from the cost-model primitives.

For layouts xlaopt does not compile (pipeline stages, context parallel rings, a framework's own
overlap scheme), the step is built up per layer and per micro-batch on one GPU:

- compute: forward linear matmuls (fp8 peak for fp8 runs), causal attention (bf16), elementwise
  traffic (and fp8 casts) at HBM bandwidth, the residual stream's (norms, residual adds) split
  over the tensor ranks only with sequence parallelism; backward = 2x forward (2.5x for flash attention);
  recomputation as the source runs it; the LM head and loss on the last stage;
- FSDP: per layer, all-gather parameters for forward and again for backward, reduce-scatter
  gradients in backward, each within the shard group (the `fsdp` ranks and the context ranks
  inside them) and overlapped with that layer's compute (exposed = max(0, comm - compute)); the
  first layer's gather of each micro-batch cannot be prefetched;
- HSDP (`fsdp` > 1 and `dp` > 1): the shard group above, replicated over `dp` replica groups; each
  rank's gradient shard (1/shard of its parameters) is all-reduced over its replica group once per
  step, overlapped with one micro-batch's backward (the shards accumulate over micro-batches and
  are reduced across replicas after the last, as FSDP2's `set_requires_all_reduce` allows);
  optimizer state is sharded over the shard group only;
- data parallel with a sharded optimizer (Megatron's distributed optimizer): one gradient
  reduce-scatter and one parameter all-gather per step, overlapped with one micro-batch where the
  framework does so; plain data parallel: one all-reduce at the end of the step;
- tensor parallel: per layer, 2 all-gathers + 2 reduce-scatters of the activations forward
  (sequence parallel), the same backward, exposed unless the framework overlaps them with the
  layer's matmuls; without sequence parallel, 2 all-reduces each way;
- context parallel: a ring passes K and V (cp - 1) times per layer forward, twice that backward
  and again wherever the attention forward is recomputed, overlapped with the attention kernel;
  or Ulysses (`Software.context_parallel="ulysses"`): all-to-alls turn q, k, v to head-split
  whole rows and the output back, forward, again where the attention is recomputed, and their
  gradients backward, each priced as a reduce-scatter of its bytes (each rank keeps 1/cp) and
  overlapped with the attention of the other head groups;
- pipeline: (m + (pp - 1) / v) micro-batch times of the slowest stage (v virtual stages per rank),
  plus one activation send forward and one gradient send backward per micro-batch exposed
  (Megatron's 1F1B, the head and loss on the last stage); xlaopt's SPMD loop
  (`xlaopt.models.pipeline`, `Software.pipeline="spmd"`) runs v m + pp - 1 ticks each way of
  1 / v of a stage's layers (the same bubble as interleaved 1F1B), with a send after every
  tick, and the embedding, head and loss outside the stages on each stage's share of the rows,
  so they are off the pipeline's critical path and out of its bubble; its 1F1B loop
  (`xlaopt.models.pipeline_1f1b`, `Software.pipeline="spmd-1f1b"`) runs v m + v pp + pp - 2
  ticks of 1 / v of a stage's layers with a send each way after every one, and the head and loss
  on the last stage, one micro-batch a tick, as Megatron's 1F1B and interleaved 1F1B do; its
  bubble is (pp - 1) / v micro-batch times of a stage without the head, which runs in none of the
  bubble's ticks (Megatron's is priced by the last stage's, head included);
- optimizer: AdamW reads and writes ~30 bytes per parameter it owns, memory-bound;
- frozen parameters (`DecoderShape.frozen_*`, Cosmos 3's reasoner under `--trainable generator`):
  the backward, its recomputation and its tensor-parallel collectives run on the trained tokens'
  share only (the attention's on the trained queries' share), FSDP gathers and reduces only the
  trained weights in backward, the head runs forward only when frozen, and the gradient sync and
  the optimizer cover the trained parameters. (A frozen tower's keys and values that a trained one
  attends to are recomputed under recomputation: left out, a few percent of a layer.)

Ranks are laid out tensor innermost, then context, then data, then pipeline (Megatron's order),
so a tensor group sits inside a node and pipeline neighbours are furthest apart. Within data, the
FSDP shard ranks are inner and the HSDP replicas outer, so a shard group of 8 on 8-GPU nodes is
one node and its replica group spans the network.
"""
from __future__ import annotations

import dataclasses

from xlaopt.analysis import costmodel as cm
from xlaopt.analysis.decoder_shape import DecoderShape
from xlaopt.analysis.topology import Topology
from xlaopt.models import remat

_BF16_BYTES = 2
# AdamW on fp32 master weights: read param, grad, m, v (16 B), write param, m, v (12 B),
# write the bf16 compute copy (2 B).
_ADAMW_BYTES_PER_PARAM = 30
# Cross-entropy over the logits (fp32): write logits, read them for the softmax, write and read
# the gradient: ~4 passes of 4 bytes.
_LOSS_BYTES_PER_LOGIT = 16


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """Parallel degrees and batch split of a run. `fsdp` > 1 shards parameters per layer over
    `fsdp` ranks; `dp` is data parallel with replicated parameters. Both > 1 is HSDP: parameters
    sharded within each group of `fsdp` ranks, replicated over `dp` such groups."""
    dp: int
    fsdp: int
    tp: int
    pp: int
    cp: int
    global_batch: int  # sequences per optimizer step
    seq_len: int
    micro_batch: int = 1  # sequences per micro-batch per data rank
    virtual_stages: int = 1  # interleaved pipeline chunks per rank

    @property
    def data(self) -> int:
        return max(self.dp, 1) * max(self.fsdp, 1)

    @property
    def shard_ranks(self) -> int:
        """Ranks one copy of the parameters (and, FSDP or HSDP, of the optimizer state) is
        sharded over: the FSDP group with the context ranks inside it."""
        return max(self.fsdp, 1) * self.cp

    @property
    def num_devices(self) -> int:
        return self.data * self.tp * self.pp * self.cp

    @property
    def micro_batches(self) -> float:
        """Micro-batches per optimizer step per pipeline."""
        return self.global_batch / (self.data * self.micro_batch)


@dataclasses.dataclass(frozen=True)
class Software:
    """How the framework that ran the step behaves, where it changes the price."""
    fused_elementwise: bool = True  # compiled / fused kernels, not eager PyTorch
    recompute: str = "none"  # one of RECOMPUTE; what each recomputes is `recompute_fractions`
    sequence_parallel: bool = True  # TP collectives are AG/RS (else all-reduce)
    tp_overlap: bool = False  # TP collectives overlapped with the layer's matmuls
    dp_overlap: bool = True  # gradient reduce / parameter gather overlapped with a micro-batch
    sharded_optimizer: bool = True  # optimizer state sharded over the data ranks
    param_gather_bytes: int = 2  # bytes per parameter all-gathered (FSDP / distributed optimizer)
    grad_reduce_bytes: int = 2  # bytes per gradient element reduced
    fp8_linear: bool = False  # linear layers in fp8, the rest in bf16
    # How pipeline stages run (pp > 1): "megatron" (1F1B or interleaved, the embedding on the
    # first stage and the head and loss on the last), "spmd" (xlaopt's GPipe loop) or
    # "spmd-1f1b" (xlaopt's 1F1B loop; module docstring).
    pipeline: str = "megatron"
    pipeline_weights_once: bool = False  # spmd with FSDP: each stage's weights gathered once a step
    context_parallel: str = "ring"  # "ring" (K/V passed round the context ranks) or "ulysses" (all-to-all)
    attention_kernel: str = "cudnn"  # one of costmodel.ATTENTION_KERNELS: its fraction of peak

    PIPELINES = ("megatron", "spmd", "spmd-1f1b")

    # "selective-op": TorchTitan's per-op SAC; "selective-megatron": Megatron's selective
    # recomputation (Korthikanti et al. 2022), the core attention only; "dots": JAX's
    # `dots_saveable` (xlaopt's remat=dots), matmul outputs kept, the rest recomputed. Besides
    # these, every named policy of `xlaopt.models.remat` (MaxText's among them), priced from the
    # activations it saves.
    RECOMPUTE = ("none", "full", "selective-op", "selective-megatron", "dots")

    def __post_init__(self):
        if self.attention_kernel not in cm.ATTENTION_KERNELS:
            raise ValueError(f"attention_kernel={self.attention_kernel!r}; use one of {cm.ATTENTION_KERNELS}")
        if self.context_parallel not in ("ring", "ulysses"):
            raise ValueError(f"context_parallel={self.context_parallel!r}; use 'ring' or 'ulysses'")
        if self.pipeline not in self.PIPELINES:
            raise ValueError(f"pipeline={self.pipeline!r}; use one of {self.PIPELINES}")
        if not priced_recompute(self.recompute):
            names = (*self.RECOMPUTE, *(n for n in remat.REMAT_POLICIES if priced_recompute(n)))
            raise ValueError(f"recompute={self.recompute!r}; use one of {names}")


def priced_recompute(recompute: str) -> bool:
    """Whether `recompute` is a kind of `Software.RECOMPUTE` or a named policy of `xlaopt.models.remat`."""
    policy = remat.REMAT_POLICIES.get(recompute)
    return recompute in Software.RECOMPUTE or (policy is not None and policy.saves is not None)


@dataclasses.dataclass(frozen=True)
class StepBreakdown:
    """Seconds per optimizer step on the slowest GPU, by cause."""
    compute_s: float  # all micro-batches through the slowest stage, exposed comm excluded
    pipeline_bubble_s: float
    tp_exposed_s: float
    cp_exposed_s: float
    fsdp_exposed_s: float
    dp_exposed_s: float
    pp_send_s: float
    optimizer_s: float

    @property
    def step_time_s(self) -> float:
        return sum(getattr(self, f.name) for f in dataclasses.fields(self))


def recompute_fractions(shape: DecoderShape, recompute: str) -> tuple[float, float, float]:
    """(linear, attention, elementwise) forward fractions recomputed in backward. The model has
    no memory part: a policy's price here is only the compute it redoes."""
    if recompute == "full":
        return 1.0, 1.0, 1.0
    if recompute == "selective-op":
        # TorchTitan's per-op policy saves matmul outputs except every second mm (k, o, MLP up
        # for SwiGLU), saves SDPA, recomputes the elementwise ops.
        weights = shape.layer_matmuls()
        return sum(weights[1::2]) / sum(weights), 0.0, 1.0
    if recompute == "selective-megatron":
        # Megatron-Core checkpoints the core attention (QK^T, softmax, dropout, attention over V)
        # whatever its kernel: with flash attention that saves almost no memory (the kernel keeps
        # only its output and softmax statistics) but the kernel's forward still runs again
        # before its backward, on top of the QK^T the flash backward redoes anyway. Norms,
        # activations and linears are kept, so nothing else reruns and, with sequence
        # parallelism, no TP collective repeats (the core attention sits between the gathered
        # QKV and the row-parallel output projection).
        return 0.0, 1.0, 0.0
    if recompute == "dots":
        # dots_saveable keeps what `dot_general` produced; a fused attention kernel (cuDNN's custom
        # call) is not one, so its forward reruns with the elementwise ops.
        return 0.0, 1.0, 1.0
    if recompute in Software.RECOMPUTE:  # none
        return 0.0, 0.0, 0.0
    return _named_fractions(shape, remat.REMAT_POLICIES[recompute].saves)


def _named_fractions(shape: DecoderShape, saves: frozenset[str]) -> tuple[float, float, float]:
    """A named policy's fractions from what it saves: each projection whose output the backward
    reads and the policy does not save runs again (the MLP's down projection never: its output
    only joins the residual sum); the attention runs again unless its output is saved (its
    internals never are; a flash kernel's backward redoes them anyway, as in the un-recomputed
    price); the elementwise work runs again unless the norms' and the activation's outputs are
    saved (Megatron's selective)."""
    mlp = (remat.MLP_GATE, remat.MLP_UP) if shape.mlp == "swiglu" else (remat.MLP_IN,)
    read = (remat.QUERY, remat.KEY, remat.VALUE, remat.OUT, *mlp)
    weights = shape.layer_matmuls()  # in call order: q, k, v, o, the MLP's inputs, its down projection
    linear = sum(w for name, w in zip(read, weights) if name not in saves) / sum(weights)
    attention = 0.0 if remat.CONTEXT in saves else 1.0
    elementwise = 0.0 if {remat.ATTENTION_NORM, remat.MLP_NORM, remat.MLP_HIDDEN} <= saves else 1.0
    return linear, attention, elementwise


@dataclasses.dataclass(frozen=True)
class _Layer:
    """One layer and one micro-batch on one GPU: compute times and what the collectives need."""
    tokens: float  # per GPU per micro-batch
    lin_s: float  # linear matmuls, forward
    att_s: float  # attention, forward
    fwd_s: float
    bwd_s: float  # recomputation included
    r_lin: float  # fraction of the linear forward recomputed in backward
    r_att: float  # fraction of the attention forward recomputed in backward
    act_bytes: float  # one activation (tokens x d_model, bf16)
    trained: float = 1.0  # share of the tokens whose backward runs (frozen parameters: fewer)


def _layer(shape: DecoderShape, layout: Parallelism, topology: Topology, software: Software,
           eff: cm.Efficiency) -> _Layer:
    """Forward and backward compute of one layer for one micro-batch."""
    dev = topology.device
    bf16_peak = dev.peak_flops["bfloat16"]
    linear_peak = dev.peak_flops["float8"] if software.fp8_linear else bf16_peak
    tp, cp = layout.tp, layout.cp
    tokens = layout.micro_batch * layout.seq_len / cp  # per GPU per micro-batch
    n_matmuls = 4  # qkv, out, MLP up (+gate), MLP down: the launches a layer's linear FLOPs split into
    lin_f = shape.linear_forward_flops(tokens) / tp
    att_f = shape.attention_forward_flops(layout.micro_batch, layout.seq_len) / (tp * cp)
    mm_max = eff.matmul_max_for(dev.name)
    lin_s = cm.matmul_time_s(lin_f, linear_peak, lin_f / n_matmuls, mm_max, eff.matmul_half_flops)
    att_s = cm.attention_time_s(att_f, bf16_peak, eff)
    residual = shape.residual_stream_bytes_per_token(software.fused_elementwise)
    elem_fwd_bytes = (shape.elementwise_forward_bytes_per_token(software.fused_elementwise) - residual) * tokens / tp \
        + residual * tokens / (tp if software.sequence_parallel else 1)
    if software.fp8_linear:  # activations and gradients per token, weights (and transposes) per micro-batch
        cast_bytes = shape.fp8_cast_bytes_per_token() * tokens / tp + 3 * 2 * shape.layer_params / tp
    else:
        cast_bytes = 0.0
    elem_s = cm.memory_time_s(elem_fwd_bytes, dev.hbm_bytes_per_s)
    cast_s = cm.memory_time_s(cast_bytes, dev.hbm_bytes_per_s)  # a third forward, two thirds backward
    r_lin, r_att, r_elem = recompute_fractions(shape, software.recompute)
    fwd_s = lin_s + att_s + elem_s + cast_s / 3
    # Backward: 2x forward for the linears and elementwise ops; 2.5x for flash attention, whose
    # backward recomputes QK^T (5 matmuls against 2).
    trained, trained_att = 1.0 - shape.frozen_tokens, 1.0 - shape.frozen_attention
    bwd_s = (trained * (2 * (lin_s + elem_s) + 2 * cast_s / 3 + r_lin * lin_s + r_elem * elem_s)
             + trained_att * (2.5 + r_att) * att_s)
    return _Layer(tokens, lin_s, att_s, fwd_s, bwd_s, r_lin, r_att, tokens * shape.d_model * _BF16_BYTES, trained)


def _tp_exposed(layer: _Layer, layout: Parallelism, topology: Topology, software: Software, eff: cm.Efficiency) -> float:
    """Tensor-parallel collectives of one layer and micro-batch left exposed."""
    tp_span = cm.group_span(layout.tp, 1, topology.devices_per_node)
    # A pair is the AG + RS (sequence parallel) or the all-reduce (not) around one of the two
    # sub-blocks (attention, MLP): 2 pairs forward, 2 backward, 2 more when the forward is redone.
    if software.sequence_parallel:
        tp_pair = (cm.collective_time_s("all-gather", layer.act_bytes, tp_span, topology, eff)
                   + cm.collective_time_s("reduce-scatter", layer.act_bytes, tp_span, topology, eff))
    else:
        tp_pair = cm.collective_time_s("all-reduce", layer.act_bytes, tp_span, topology, eff)
    tp_fwd = 2 * tp_pair
    tp_bwd = layer.trained * (2 * tp_pair + (2 * tp_pair if layer.r_lin >= 1.0 else 0.0))
    if software.tp_overlap:
        return cm.exposed_s(tp_fwd, layer.lin_s) + cm.exposed_s(tp_bwd, 2 * layer.lin_s + layer.r_lin * layer.lin_s)
    return tp_fwd + tp_bwd


def _cp_exposed(layer: _Layer, shape: DecoderShape, layout: Parallelism, topology: Topology, software: Software,
                eff: cm.Efficiency) -> float:
    """The context-parallel K/V ring (or Ulysses' all-to-alls) of one layer and micro-batch, behind
    its attention."""
    tp, cp = layout.tp, layout.cp
    cp_span = cm.group_span(cp, tp, topology.devices_per_node)
    kv_bytes = layer.tokens * 2 * shape.kv_heads * shape.head_dim * _BF16_BYTES / tp
    if software.context_parallel == "ulysses" and cp > 1:
        qo_bytes = layer.tokens * 2 * shape.heads * shape.head_dim * _BF16_BYTES / tp
        a2a = cm.collective_time_s("reduce-scatter", kv_bytes + qo_bytes, cp_span, topology, eff)
        return (1 + layer.r_att) * cm.exposed_s(a2a, layer.att_s) + cm.exposed_s(a2a, 2.5 * layer.att_s)
    cp_send = (cp - 1) * cm.send_time_s(kv_bytes, *_level(topology, cp_span, eff)) if cp > 1 else 0.0
    # A recomputed attention forward runs its ring again (the ring lives inside the attention).
    return ((1 + layer.r_att) * cm.exposed_s(cp_send, layer.att_s)
            + cm.exposed_s(2 * cp_send, 2 * layer.att_s))


def _fsdp_exposed(layer: _Layer, shape: DecoderShape, layout: Parallelism, topology: Topology, software: Software,
                  eff: cm.Efficiency) -> tuple[float, float]:
    """FSDP per layer and micro-batch: (exposed gather + scatter time, the first layer's gather,
    which cannot be prefetched)."""
    if layout.fsdp <= 1:
        return 0.0, 0.0
    # Within the shard group only: with HSDP the replicas (dp) sit outside it and take no part.
    shard_span = cm.group_span(layout.shard_ranks, layout.tp, topology.devices_per_node)
    ag = cm.collective_time_s("all-gather", shape.layer_params / layout.tp * software.param_gather_bytes,
                              shard_span, topology, eff)
    trained = shape.trained_layer_params / layout.tp  # the backward gathers and reduces these only
    ag_bwd = cm.collective_time_s("all-gather", trained * software.param_gather_bytes, shard_span, topology, eff)
    rs = cm.collective_time_s("reduce-scatter", trained * software.grad_reduce_bytes, shard_span, topology, eff)
    return cm.exposed_s(ag, layer.fwd_s) + cm.exposed_s(ag_bwd + rs, layer.bwd_s), ag


def _fsdp_once_s(shape: DecoderShape, layers_per_stage: float, layout: Parallelism, topology: Topology,
                 software: Software, eff: cm.Efficiency) -> float:
    """A stage's FSDP weights gathered once before its ticks and their gradients reduce-scattered
    once after them (`pipeline_weights_once`): nothing of the stage runs beside either."""
    shard_span = cm.group_span(layout.shard_ranks, layout.tp, topology.devices_per_node)
    stage_params = layers_per_stage * shape.layer_params / layout.tp
    stage_trained = layers_per_stage * shape.trained_layer_params / layout.tp
    return (cm.collective_time_s("all-gather", stage_params * software.param_gather_bytes, shard_span, topology, eff)
            + cm.collective_time_s("reduce-scatter", stage_trained * software.grad_reduce_bytes, shard_span,
                                   topology, eff))


def _head_s(layer: _Layer, shape: DecoderShape, layout: Parallelism, topology: Topology, eff: cm.Efficiency) -> float:
    """The LM head and loss, forward and backward (forward only when the head is frozen), on the
    last stage (every GPU without pipelining), in bf16."""
    dev = topology.device
    head_f = shape.head_forward_flops(layer.tokens) / layout.tp
    mm_max = eff.matmul_max_for(dev.name)
    passes = 1 if shape.frozen_head else 3
    return passes * cm.matmul_time_s(head_f, dev.peak_flops["bfloat16"], head_f, mm_max, eff.matmul_half_flops) + \
        cm.memory_time_s(_LOSS_BYTES_PER_LOGIT * layer.tokens * shape.vocab / layout.tp, dev.hbm_bytes_per_s)


def _pp_send_s(layer: _Layer, stage_weights: float, layout: Parallelism, topology: Topology, software: Software,
               eff: cm.Efficiency) -> float:
    """Pipeline sends: one activation forward and one gradient backward per micro-batch (per
    tick in the SPMD loops, whose next tick waits on each: GPipe's V m + pp - 1 ticks each way
    with V virtual stages, 1F1B's V m + V pp + pp - 2). The SPMD loops with V > 1 also reorder each stage's weights (`stage_weights`
    parameters a device holds, fp32) into round order before the ticks and their gradients back
    after them: all but the 1 / pp of the chunks a stage keeps cross to another stage."""
    if layout.pp <= 1:
        return 0.0
    m, v = layout.micro_batches, layout.virtual_stages
    spmd = software.pipeline in ("spmd", "spmd-1f1b")
    ticks = {"spmd": v * m + layout.pp - 1, "spmd-1f1b": v * m + v * layout.pp + layout.pp - 2}
    sends = ticks.get(software.pipeline, m)
    pp_span = cm.group_span(layout.pp, layout.tp * layout.cp * layout.data, topology.devices_per_node)
    level, link_eff = _level(topology, pp_span, eff)
    send_bytes = layer.act_bytes / (layout.tp if software.sequence_parallel else 1)
    reorder_bytes = 4.0 * stage_weights * (1 - 1 / layout.pp) if spmd and layout.virtual_stages > 1 else 0.0
    return sends * 2 * cm.send_time_s(send_bytes, level, link_eff) + 2 * cm.send_time_s(reorder_bytes, level, link_eff)


def _dp_exposed(layer: _Layer, layers_per_stage: float, params_per_gpu: float, layout: Parallelism,
                topology: Topology, software: Software, eff: cm.Efficiency) -> float:
    """Data-parallel gradient sync once per step (FSDP's runs per layer instead): a reduce-scatter
    and a parameter all-gather with a sharded optimizer, else one all-reduce; with HSDP, the
    all-reduce of each rank's gradient shard over its replica group. Overlapped with one
    micro-batch's backward and forward where the framework does so."""
    if layout.fsdp > 1:
        return _hsdp_replica_exposed(layer, layers_per_stage, params_per_gpu, layout, topology, software, eff)
    if layout.data * layout.cp <= 1:
        return 0.0
    span = cm.group_span(layout.data * layout.cp, layout.tp, topology.devices_per_node)
    if software.sharded_optimizer:
        rs = cm.collective_time_s("reduce-scatter", params_per_gpu * software.grad_reduce_bytes, span, topology, eff)
        ag = cm.collective_time_s("all-gather", params_per_gpu * software.param_gather_bytes, span, topology, eff)
    else:
        rs = cm.collective_time_s("all-reduce", params_per_gpu * software.grad_reduce_bytes, span, topology, eff)
        ag = 0.0
    if not software.dp_overlap:
        return rs + ag
    one_mb_bwd = layers_per_stage * layer.bwd_s / layout.virtual_stages
    one_mb_fwd = layers_per_stage * layer.fwd_s / layout.virtual_stages
    return cm.exposed_s(rs, one_mb_bwd) + cm.exposed_s(ag, one_mb_fwd)


def _hsdp_replica_exposed(layer: _Layer, layers_per_stage: float, params_per_gpu: float, layout: Parallelism,
                          topology: Topology, software: Software, eff: cm.Efficiency) -> float:
    """HSDP's hierarchical reduction: each rank all-reduces its gradient shard (1/shard of its
    parameters; the shard group reduce-scattered the rest away) with the same shard on the other
    replicas, once per step; none with pure FSDP (one replica)."""
    if layout.dp <= 1:
        return 0.0
    # Replicas are `shard_ranks` groups of `tp` ranks apart: outside the shard group in rank order.
    replica_span = cm.group_span(layout.dp, layout.tp * layout.shard_ranks, topology.devices_per_node)
    shard_grad_bytes = params_per_gpu / layout.shard_ranks * software.grad_reduce_bytes
    ar = cm.collective_time_s("all-reduce", shard_grad_bytes, replica_span, topology, eff)
    if not software.dp_overlap:
        return ar
    return cm.exposed_s(ar, layers_per_stage * layer.bwd_s / layout.virtual_stages)


def _optimizer_s(params_per_gpu: float, layout: Parallelism, topology: Topology, software: Software) -> float:
    """AdamW over the parameters this GPU owns (its share when the optimizer state is sharded):
    FSDP and HSDP shard it over the shard group (HSDP replicates it over dp), a sharded optimizer
    without FSDP over every data rank."""
    if layout.fsdp > 1:
        shards = layout.shard_ranks
    elif software.sharded_optimizer:
        shards = layout.data * layout.cp
    else:
        shards = 1
    return cm.memory_time_s(_ADAMW_BYTES_PER_PARAM * params_per_gpu / shards, topology.device.hbm_bytes_per_s)


def price_step(shape: DecoderShape, layout: Parallelism, topology: Topology, software: Software,
               eff: cm.Efficiency) -> StepBreakdown:
    """Seconds of one optimizer step, by cause (see the module docstring for the model)."""
    eff = eff.attention_for(software.attention_kernel, topology.device.name)
    # One layer, one micro-batch: compute, and the tensor, context and FSDP collectives left exposed.
    layer = _layer(shape, layout, topology, software, eff)
    tp_exp = _tp_exposed(layer, layout, topology, software, eff)
    cp_exp = _cp_exposed(layer, shape, layout, topology, software, eff)
    fsdp_exp_layer, fsdp_first = _fsdp_exposed(layer, shape, layout, topology, software, eff)

    # Stages, micro-batches, the pipeline.
    spmd = layout.pp > 1 and software.pipeline in ("spmd", "spmd-1f1b")
    head_outside = layout.pp > 1 and software.pipeline == "spmd"  # GPipe's loop: on every stage's rows, after it
    layers_per_stage = shape.layers / layout.pp
    m = layout.micro_batches
    head_s = _head_s(layer, shape, layout, topology, eff)
    fsdp_once = 0.0
    if spmd and software.pipeline_weights_once and layout.fsdp > 1:
        fsdp_once = _fsdp_once_s(shape, layers_per_stage, layout, topology, software, eff)
        fsdp_exp_layer, fsdp_first = 0.0, 0.0
    # The SPMD GPipe loop runs the head on its share of the rows after the stages (1/pp of m
    # micro-batches'); 1F1B, like Megatron, on the last stage, each micro-batch in its tick.
    stage_compute_s = layers_per_stage * (layer.fwd_s + layer.bwd_s) + (0.0 if head_outside else head_s)
    stage_exposed_s = layers_per_stage * (tp_exp + cp_exp + fsdp_exp_layer) + fsdp_first
    stage_mb_s = stage_compute_s + stage_exposed_s
    # 1F1B's lockstep ticks run the head once a micro-batch and in none of the bubble's ticks
    # (`PipelineSchedule.taken_at`); Megatron's bubble is priced by its slowest, last stage.
    bubble_stage_s = stage_mb_s - (head_s if software.pipeline == "spmd-1f1b" else 0.0)
    bubble_s = (layout.pp - 1) / layout.virtual_stages * bubble_stage_s if layout.pp > 1 else 0.0

    # Data-parallel gradient sync and the optimizer, once per step. The SPMD loop keeps the
    # embedding and head whole on every stage; Megatron puts them on the first and last.
    # What the gradient sync and the optimizer cover: the trained parameters.
    embedding_params = shape.trained_embedding_params / (1 if spmd else min(layout.pp, 2))
    stage_params = layers_per_stage * shape.trained_layer_params + embedding_params
    params_per_gpu = stage_params / layout.tp

    return StepBreakdown(
        compute_s=m * stage_compute_s + (m * head_s / layout.pp if head_outside else 0.0),
        pipeline_bubble_s=bubble_s,
        tp_exposed_s=m * layers_per_stage * tp_exp,
        cp_exposed_s=m * layers_per_stage * cp_exp,
        fsdp_exposed_s=m * (layers_per_stage * fsdp_exp_layer + fsdp_first) + fsdp_once,
        dp_exposed_s=_dp_exposed(layer, layers_per_stage, params_per_gpu, layout, topology, software, eff),
        pp_send_s=_pp_send_s(layer, layers_per_stage * shape.layer_params / (layout.tp * max(layout.fsdp, 1)), layout, topology,
                             software, eff),
        optimizer_s=_optimizer_s(params_per_gpu, layout, topology, software),
    )


def _level(topology: Topology, span: cm.GroupSpan, eff: cm.Efficiency):
    """The link level a point-to-point transfer within `span` crosses, and its efficiency."""
    if span.nodes > 1:
        return topology.levels[-1], eff.network
    return topology.levels[0], eff.nvlink
