"""How a training program executes, apart from what it computes.

The model config says what the model is (its shapes and its mathematics); `ExecutionConfig`
says how one step runs: the precision policy, recomputation, the attention implementation, how
the layer stack runs and how many micro-batches a step accumulates. Passes rewrite it freely:
a checkpoint resumes under any execution config (the parameters and the data are the same),
while a different model or data is refused.
"""
from __future__ import annotations

import dataclasses
from typing import get_type_hints

from xlaopt.errors import UserError
from xlaopt.models.attention import ATTENTION, AttentionSpec
from xlaopt.models.cudnn_attention import MAX_SEGMENTS
from xlaopt.models.registry import parse_assignments
from xlaopt.models.stack import REMAT_POLICIES, STRATEGIES, StackSpec

# Compute dtypes of the precision policy; master weights and optimizer state are always fp32.
DTYPES = ("bfloat16", "float32")
TARGETS = ("cpu", "gpu")


@dataclasses.dataclass(frozen=True)
class ExecutionConfig:
    compute_dtype: str = "bfloat16"
    remat: str = "none"  # a policy of `xlaopt.models.stack.REMAT_POLICIES`
    attention: str = "dense"  # an implementation of `xlaopt.models.attention.ATTENTION`
    attention_block: int = 512  # keys per block of the blockwise attention
    attention_max_segments: int = MAX_SEGMENTS  # attention=cudnn: samples a row may hold (a static shape of the step)
    layer_stack: str = "scan"  # a strategy of `xlaopt.models.stack.STRATEGIES`
    micro_batches: int = 1  # gradient accumulation: the batch is split into this many along its rows

    def __post_init__(self):
        choices = {"compute_dtype": DTYPES, "remat": REMAT_POLICIES, "attention": ATTENTION,
                   "layer_stack": STRATEGIES}
        for field, valid in choices.items():
            if getattr(self, field) not in valid:
                raise UserError(f"execution setting {field}={getattr(self, field)!r}; use one of {', '.join(valid)}")
        for field in ("attention_block", "attention_max_segments", "micro_batches"):
            if getattr(self, field) < 1:
                raise UserError(f"execution setting {field}={getattr(self, field)} must be at least 1")

    @property
    def stack(self) -> StackSpec:
        return StackSpec(self.layer_stack, self.remat)

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
