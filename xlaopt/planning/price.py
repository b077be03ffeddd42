"""A candidate's analytic price: step time from `xlaopt.analysis.analytic` (the calibrated
model every published run is priced with) and memory per device from what the step holds.

Software, as xlaopt's programs run: XLA fuses elementwise work; tensor parallelism all-reduces
the activations, or with sequence parallelism reduce-scatters them onto the sequence shards and
gathers the normed input back (the norms and residual adds then run on 1/tp of the tokens);
on the GPU target FSDP's gathers
and reductions overlap the layers (XLA's async collectives; the CPU target overlaps nothing);
parameters are gathered and gradients reduced in fp32 (the master weights are cast to the compute
dtype after the gather), with fp8 matmuls the weights gathered in fp8 (cast on their shards);
pure data parallel replicates the optimizer state.

Memory per device (the peak of the step, as XLA's `memory_analysis` counts it):
  state      fp32 parameters and AdamW's two moments: 12 B x params / (fsdp x tp);
  gradients  fp32, the same shards: 4 B x params / (fsdp x tp);
  weights    the compute-dtype copy of two layers in flight (FSDP prefetch): 2 x 2 B x layer params / tp,
             whole when not FSDP-sharded (the cast copy of the whole model); 1 B with fp8 matmuls;
  saved      what each layer keeps for backward, per token: `remat=full` its input (d), `dots` the
             matmul outputs, `none` every activation, a named policy its input and the activations
             it names, times the layers and the micro-batch's tokens; with sequence parallelism the
             residual stream's (the layer input, the output projections' results) 1/tp of it;
             traced from the program's jaxpr where the planner has it (`residuals`: without
             recomputation autodiff keeps ~2x what the shape's formula counts), the formula
             saying how tensor parallelism divides it;
  working    one layer's activations while it runs backward (the formula's: recomputed or read
             back, the elementwise work between its matmuls fused) and its MLP input gradients,
             plus the logits in fp32 and their gradient (text tokens x vocab / tp; XLA computes
             the fp32 gradient in the logits' place, and the head's matmuls read a compute-dtype
             copy: 6 B a logit), plus dense attention's fp32 logits.
Frozen parameters (`--trainable`) hold their fp32 values only (no moments, no gradient), and the
frozen tokens save for backward only what a trained tower reads of them: their layer input where
the policy recomputes (a frozen tower's keys and values are recomputed from it), else those keys
and values.
With pipeline stages (xlaopt's SPMD loop) a stage holds its layers' share of the state and the
embedding and head whole; it saves for backward what every one of its M + P - 1 ticks saved; the
logits are those of its share of the rows; and its input and output buffers hold every micro-batch.
"""
from __future__ import annotations

import dataclasses

from xlaopt.analysis import analytic, costmodel as cm
from xlaopt.analysis.topology import Topology
from xlaopt.data.batch import BatchShape
from xlaopt.models import remat
from xlaopt.planning.space import Candidate
from xlaopt.transforms.ulysses_attention import ulysses_split


@dataclasses.dataclass(frozen=True)
class AnalyticPrice:
    step_time_s: float
    breakdown: analytic.StepBreakdown
    memory_bytes: float
    memory_parts: dict


def software(candidate: Candidate, target: str, heads: int, kv_heads: int) -> analytic.Software:
    """How xlaopt's program of `candidate` runs (`heads`, `kv_heads`: the model's, which decide
    whether the ulysses-attention pass takes context parallel)."""
    fp8 = candidate.matmuls == "fp8"
    ulysses = candidate.cp > 1 and ulysses_split(heads, kv_heads, candidate.tp, candidate.cp) is not None
    # fp8 weights are quantized on their shards (the scale is a max over all of them) and
    # gathered in fp8: XLA moves the cast before the all-gather (f8e4m3fn all-gathers in the
    # GPU-target HLO).
    return analytic.Software(fused_elementwise=True, recompute=candidate.remat,
                             sequence_parallel=candidate.sequence_parallel,
                             tp_overlap=False, dp_overlap=target == "gpu", sharded_optimizer=candidate.sharded_optimizer,
                             param_gather_bytes=1 if fp8 else 4, grad_reduce_bytes=4, fp8_linear=fp8,
                             pipeline="spmd-1f1b" if candidate.schedule == "1f1b" else "spmd",
                             pipeline_weights_once=candidate.weights_once,
                             context_parallel="ulysses" if ulysses else "ring")


def analytic_layout(candidate: Candidate, batch: BatchShape) -> analytic.Parallelism:
    rows_per_micro_batch = batch.batch_size // (candidate.data * candidate.micro_batches)
    return analytic.Parallelism(dp=candidate.dp, fsdp=candidate.fsdp, tp=candidate.tp, pp=candidate.pp,
                                cp=candidate.cp, global_batch=batch.batch_size,
                                seq_len=batch.text_len + batch.gen_len, micro_batch=max(rows_per_micro_batch, 1),
                                virtual_stages=candidate.virtual_stages)


def price(candidate: Candidate, shape: analytic.DecoderShape, batch: BatchShape, topology: Topology, target: str,
          dense_attention: bool, eff: cm.Efficiency = cm.FITTED, traced: dict[str, float] | None = None) -> AnalyticPrice:
    layout = analytic_layout(candidate, batch)
    breakdown = analytic.price_step(shape, layout, topology, software(candidate, target, shape.heads, shape.kv_heads), eff)
    parts = memory_parts(candidate, shape, batch, dense_attention, traced)
    return AnalyticPrice(breakdown.step_time_s, breakdown, sum(parts.values()), parts)


def saved_per_token_layer(shape: analytic.DecoderShape, tp: int, compute: int,
                          sequence_parallel: bool = False) -> dict[str, float]:
    """Bytes one layer keeps per token for backward, by remat policy, from the shape: the
    attention block (input, norm, q, k, v, attention out, o) and the MLP (norm, up (+gate),
    activation, down) in the compute dtype; `dots` (and `dots_no_batch`: the attention's own
    dots are counted apart) the matmul outputs; `full` the layer input; a named policy the layer
    input and the named activations it saves that the backward reads (`named_elements`). With
    sequence parallelism the residual stream (the layer input, the o and down projections'
    results) is split over the tensor ranks; the norms' outputs are gathered whole."""
    d, dh = shape.d_model, shape.head_dim
    heads, kv, ffn = shape.heads / tp, shape.kv_heads / tp, shape.ffn / tp
    stream = d / tp if sequence_parallel else d  # one residual-stream activation's share
    mlp_matrices = 3 if shape.mlp == "swiglu" else 2
    every = compute * (stream + d + heads * dh + 2 * kv * dh + heads * dh + stream + mlp_matrices * ffn + ffn + stream)
    dots = compute * (heads * dh + 2 * kv * dh + stream + (mlp_matrices - 1) * ffn + stream)
    saved = {"none": every, "dots": dots, "dots_no_batch": dots, "full": compute * stream}
    elements = named_elements(shape, tp, sequence_parallel)
    for name, policy in remat.REMAT_POLICIES.items():
        if policy.saves is not None:
            saved[name] = compute * (stream + sum(elements.get(n, 0.0) for n in policy.saves))
    return saved


def named_elements(shape: analytic.DecoderShape, tp: int, sequence_parallel: bool = False) -> dict[str, float]:
    """Elements per token of each named activation a layer's backward reads (`xlaopt.models.remat`;
    the MLP's output is not one), on one of `tp` tensor ranks: the norms' outputs whole on each
    (gathered for the projections), the attention output projection's result split with
    sequence parallelism."""
    d, dh = shape.d_model, shape.head_dim
    heads, kv, ffn = shape.heads / tp, shape.kv_heads / tp, shape.ffn / tp
    mlp_in = {remat.MLP_GATE: ffn, remat.MLP_UP: ffn} if shape.mlp == "swiglu" else {remat.MLP_IN: ffn}
    return {remat.ATTENTION_NORM: d, remat.QUERY: heads * dh, remat.KEY: kv * dh, remat.VALUE: kv * dh,
            remat.CONTEXT: heads * dh, remat.OUT: d / tp if sequence_parallel else d, remat.MLP_NORM: d,
            **mlp_in, remat.MLP_HIDDEN: ffn}


def memory_parts(c: Candidate, shape: analytic.DecoderShape, batch: BatchShape, dense_attention: bool,
                 traced: dict[str, float] | None = None) -> dict:
    """Bytes per device by part (see the module docstring). `traced`: what the program's jaxpr
    saves per token and layer by policy, unsharded (`residuals.saved_bytes_per_token_layer`);
    the shape's formula then only says how tensor parallelism divides it."""
    compute = 4 if c.compute_dtype == "float32" else 2
    # A stage holds its share of the layers and the embedding and head whole (`analytic`'s "spmd").
    layers = shape.layers // c.pp
    params = layers * shape.layer_params + shape.embedding_params
    trained = layers * shape.trained_layer_params + shape.trained_embedding_params
    shards = c.fsdp * c.tp
    rows = batch.batch_size // (c.data * c.micro_batches)
    row_len = batch.text_len + batch.gen_len
    tokens = rows * row_len / c.cp  # this device's tokens in one micro-batch
    # GPipe's loop keeps every tick's saves to its backward (`PipelineSchedule.saved_ticks`, each
    # tick 1 / V of the stage's layers), and the head runs after it on the stage's share of all
    # micro-batches' rows; 1F1B's keeps min(V M, 2VP - 1) chunks' (min(M, 2P - 1) micro-batches'
    # without virtual stages) and runs the head on one micro-batch a tick.
    gpipe = c.pp > 1 and c.schedule != "1f1b"
    v = c.virtual_stages
    held = (c.micro_batches + (c.pp - 1) / v if gpipe else
            min(v * c.micro_batches, 2 * v * c.pp - 1) / v if c.pp > 1 else 1)
    head_tokens = tokens * c.micro_batches / c.pp if gpipe else tokens
    formula = saved_per_token_layer(shape, c.tp, compute, c.sequence_parallel)
    saved = formula
    if traced is not None:
        whole = saved_per_token_layer(shape, 1, compute)
        saved = {**formula, **{r: traced[r] * formula[r] / whole[r] for r in traced}}
    frozen_saves = formula["full"] if c.remat != "none" else compute * 2 * shape.kv_heads * shape.head_dim / c.tp
    saved_per_token = (1 - shape.frozen_tokens) * saved[c.remat] + shape.frozen_tokens * frozen_saves
    # While one layer runs backward: its activations as matmuls consume them (recomputed or
    # saved, XLA fuses the elementwise work between) and the MLP input gradients beside them.
    mlp_inputs = 2 if shape.mlp == "swiglu" else 1
    layer_working = formula["none"] + compute * mlp_inputs * shape.ffn / c.tp
    logits_fraction = getattr(shape, "text_fraction", 1.0)
    heads = shape.heads / c.tp
    attention_logits = 4.0 * rows * heads * (row_len / c.cp) * row_len if dense_attention else 0.0
    weight = 1 if c.matmuls == "fp8" else compute  # the projections read an fp8 copy
    in_flight = layers if c.weights_once else 2  # FSDP: the stage's layers gathered at once, or two prefetched
    weights = in_flight * weight * shape.layer_params / c.tp if c.fsdp > 1 else weight * params / c.tp
    parts = {
        # fp32 weights, and AdamW's two moments (split over the replicas too under ZeRO-1)
        "state": (4.0 * params + 8.0 * trained / (c.dp if c.sharded_optimizer else 1)) / shards,
        "gradients": 4.0 * trained / shards,
        "weights": float(weights),
        "saved": saved_per_token * tokens * layers * held,
        "working": (layer_working * tokens + (4.0 + compute) * head_tokens * logits_fraction * shape.vocab / c.tp
                    + attention_logits),
    }
    if c.pp > 1:  # the stage's input and output, all micro-batches of them (and between GPipe's rounds, stage 0's)
        buffers = 3.0 if gpipe and c.virtual_stages > 1 else 2.0
        parts["pipeline_buffers"] = buffers * compute * shape.d_model * tokens * c.micro_batches
    return parts
