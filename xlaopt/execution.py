"""How a training program executes, apart from what it computes.

The model config says what the model is (its shapes and its mathematics); `ExecutionConfig`
says how one step runs: the precision policy, recomputation, the attention implementation, how
the layer stack runs and how many micro-batches a step accumulates. Passes rewrite it freely:
a checkpoint resumes under any execution config (the parameters and the data are the same),
while a different model or data is refused.

Precision: the model computes in `compute_dtype` (its linear projections in fp8 with
`matmuls="fp8"`); master weights, gradients and the optimizer state are fp32 whatever it is,
except where `grad_accumulate_dtype` has a step's gradients summed over its micro-batches in bf16.
float16 also scales the loss dynamically (`xlaopt.loss_scale`), starting at `loss_scale_init`
and doubling after `loss_scale_growth_interval` finite steps in a row; bfloat16 and float32
have float32's exponent range, need no scaling and ignore both.
"""
from __future__ import annotations

import dataclasses
import math
from typing import get_type_hints

from xlaopt.errors import UserError
from xlaopt.models.attention import ATTENTION, AttentionSpec
from xlaopt.models.cudnn_attention import MAX_SEGMENTS
from xlaopt.models.fp8 import MATMULS
from xlaopt.models.pipeline import check_schedule
from xlaopt.models.registry import parse_assignments
from xlaopt.models.remat import REMAT_POLICIES
from xlaopt.models.stack import STRATEGIES, StackSpec

# Compute dtypes of the precision policy; master weights and optimizer state are always fp32.
DTYPES = ("bfloat16", "float16", "float32")
TARGETS = ("cpu", "gpu")
GRAD_DTYPES = ("float32", "bfloat16")  # gradients reduced and accumulated in
# The attention each target runs fast: cuDNN's fused kernel is the only fast one on a GPU; on the
# CPU, dense (the same pairs as any other, without a fused kernel to do better).
TARGET_ATTENTION = {"cpu": "dense", "gpu": "cudnn"}


def target_attention(target: str, splits_sequence: bool = False) -> str:
    """The attention the planner runs on `target`, what a program built for it runs unless told
    otherwise, and what `analyze` reports against. jax 0.10.2's cuDNN attention refuses a split
    sequence that Ulysses cannot hand it whole (`program.cudnn_takes_sequence`): such a layout
    (`splits_sequence`) keeps dense."""
    return "dense" if splits_sequence else TARGET_ATTENTION[target]


@dataclasses.dataclass(frozen=True)
class ExecutionConfig:
    compute_dtype: str = "bfloat16"
    # "fp8": the linear projections' matmuls in fp8 with per-tensor current scaling
    # (`xlaopt.models.fp8`), the rest in compute_dtype; fast only on a GPU with fp8 (Hopper on).
    matmuls: str = "compute"
    remat: str = "none"  # a policy of `xlaopt.models.remat.REMAT_POLICIES`
    attention: str = "dense"  # an implementation of `xlaopt.models.attention.ATTENTION`
    attention_block: int = 512  # keys per block of the blockwise attention
    attention_max_segments: int = MAX_SEGMENTS  # attention=cudnn: samples a row may hold (a static shape of the step)
    layer_stack: str = "scan"  # a strategy of `xlaopt.models.stack.STRATEGIES`
    micro_batches: int = 1  # gradient accumulation: the batch is split into this many along its rows
    # layer_stack=pipeline: the micro-batches each accumulation step's rows are cut into for the
    # pipeline's stages (0: one per stage; else a multiple of the stages)
    pipeline_microbatches: int = 0
    pipeline_schedule: str = "gpipe"  # layer_stack=pipeline: `xlaopt.models.pipeline.SCHEDULES`
    # layer_stack=pipeline: virtual stages, each stage's layers cut into this many chunks that a
    # micro-batch visits in rounds of the ring (MaxText's circular pipeline): a V times smaller bubble
    pipeline_virtual_stages: int = 1
    # layer_stack=pipeline: each stage's FSDP-split weights gathered once a step (and their
    # gradients reduce-scattered once) instead of at every tick; costs the stage's whole weights
    pipeline_weights_once: bool = False
    # The optimizer state (AdamW's moments) split over `data` as well, each replica updating its
    # share: ZeRO-1, Megatron's distributed optimizer (`xlaopt.sharding.over_data`); the updated
    # parameters are all-gathered back onto every replica.
    sharded_optimizer: bool = False
    # The dtype the data-parallel gradients cross `data` in where xlaopt reduces them itself, once a
    # step after the micro-batch loop manual over data (`xlaopt.transforms.micro_batches`) or after
    # a 1F1B pipeline's ticks (`xlaopt.models.pipeline_1f1b`): bfloat16 sends half float32's bytes,
    # as Megatron-Core does by default (grad_reduce_in_fp32=False). Elsewhere XLA's partitioner
    # places the reduction, and bfloat16 is refused with the reason
    # (`xlaopt.step.why_not_reduced_by_xlaopt`).
    grad_reduce_dtype: str = "float32"
    # The dtype the gradients are summed in over a step's micro-batches (the micro-batch loop's
    # accumulators, a 1F1B pipeline's ticks'); widened to float32 for the optimizer after the last.
    # bfloat16 is what Megatron-Core does where it reduces in bf16: its grad buffer, in the dtype it
    # reduces in, is the one its weight-gradient GEMMs accumulate into (`grad_dtype = torch.float
    # if grad_reduce_in_fp32 else param.dtype`, distributed_data_parallel.py). Each micro-batch's
    # sum is rounded to bf16: with m micro-batches a gradient moves by up to about m bf16 steps.
    # Refused where the step accumulates nothing (`xlaopt.step.why_not_accumulated_by_xlaopt`).
    grad_accumulate_dtype: str = "float32"
    # The weights the loss reads once, through a cast to the compute dtype, cast once a step before
    # the micro-batch loop instead of at every micro-batch (`xlaopt.transforms.cast_once`): the same
    # numbers, less memory traffic and a narrower gradient buffer. Off only to compare.
    cast_weights_once: bool = True
    # What each micro-batch's gradient computes from the weights alone (fp8's quantization of each
    # weight and the transposes its backward GEMMs read) run once a step, before the micro-batch
    # loop, as Transformer Engine caches a step's fp8 weights (`xlaopt.transforms.weights_once`):
    # the same numbers, the fp8 weights held across the loop. Not where the step recomputes
    # (`xlaopt.step._holding` says why). Off only to compare.
    weights_work_once: bool = True
    # float16 only (see the module docstring): the first step's loss scale, a power of two, and
    # how many finite steps in a row double it.
    loss_scale_init: float = 2.0**15
    loss_scale_growth_interval: int = 2000

    def __post_init__(self):
        choices = {"compute_dtype": DTYPES, "matmuls": MATMULS, "remat": REMAT_POLICIES, "attention": ATTENTION,
                   "layer_stack": STRATEGIES, "grad_reduce_dtype": GRAD_DTYPES,
                   "grad_accumulate_dtype": GRAD_DTYPES}
        for field, valid in choices.items():
            if getattr(self, field) not in valid:
                raise UserError(f"execution setting {field}={getattr(self, field)!r}; use one of {', '.join(valid)}")
        for field in ("attention_block", "attention_max_segments", "micro_batches", "loss_scale_growth_interval",
                      "pipeline_virtual_stages"):
            if getattr(self, field) < 1:
                raise UserError(f"execution setting {field}={getattr(self, field)} must be at least 1")
        try:
            check_schedule(self.pipeline_schedule)
        except ValueError as e:
            raise UserError(f"execution setting pipeline_schedule: {e}") from None
        if self.pipeline_microbatches < 0:
            raise UserError(f"execution setting pipeline_microbatches={self.pipeline_microbatches} must be 0 (one "
                            f"per stage) or a positive multiple of the mesh's stages")
        init = self.loss_scale_init
        # fp32 holds powers of two from 2^-126 to 2^127 exactly; the scaled loss is fp32.
        if not (math.isfinite(init) and init > 0 and math.frexp(init)[0] == 0.5 and -126 <= math.log2(init) <= 127):
            raise UserError(f"execution setting loss_scale_init={init!r} must be a power of two between 2^-126 and "
                            f"2^127 (e.g. {2.0**15:g} = 2^15): scaling by a power of two rounds nothing, so the "
                            f"fp16 step computes the same numbers as unscaled wherever they stay in range")

    @property
    def stack(self) -> StackSpec:
        return StackSpec(self.layer_stack, self.remat, self.pipeline_microbatches, self.pipeline_weights_once,
                         self.pipeline_virtual_stages, self.pipeline_schedule)

    @property
    def attention_spec(self) -> AttentionSpec:
        return AttentionSpec(self.attention, self.attention_block, self.attention_max_segments)

    def check_batch(self, batch_size: int) -> None:
        if batch_size % self.micro_batches:
            raise UserError(f"execution setting micro_batches={self.micro_batches} does not divide the batch of "
                            f"{batch_size} rows; pick a divisor of {batch_size}")


def parse_execution(items: list[str] | tuple[str, ...], base: ExecutionConfig | None = None) -> ExecutionConfig:
    """`key=value` strings (the CLI's `--exec`) applied to `base`, typed by the fields."""
    changes = parse_assignments(items, get_type_hints(ExecutionConfig), "--exec", "execution setting",
                                "--exec remat=full")
    return dataclasses.replace(base or ExecutionConfig(), **changes)
