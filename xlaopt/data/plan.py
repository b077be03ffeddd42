"""Pack a global batch from sample lengths alone, as the store loader would: for pricing a mix
(how full rows are, what each row holds) without reading or even making latents."""
from __future__ import annotations

import dataclasses

import numpy as np

from xlaopt.data.batch import BatchShape
from xlaopt.data.loader import BatchPacker, LoaderState
from xlaopt.errors import UserError

# (n_text, n_gen, modality, n_clean) of one sample in a row
Placed = tuple[int, int, int, int]


@dataclasses.dataclass(frozen=True)
class PackedPlan:
    shape: BatchShape
    rows: tuple[tuple[Placed, ...], ...]  # per row, its samples in packing order
    state: LoaderState  # the loader's state after this batch: plan the next one from it

    def _tokens(self, column: int) -> int:
        return sum(s[column] for row in self.rows for s in row)

    @property
    def text_fill(self) -> float:
        return self._tokens(0) / (self.shape.batch_size * self.shape.text_len)

    @property
    def gen_fill(self) -> float:
        return self._tokens(1) / max(self.shape.batch_size * self.shape.gen_len, 1)

    @property
    def fill(self) -> float:
        """Real tokens over the batch's slots, text and generator together."""
        return (self._tokens(0) + self._tokens(1)) / self.shape.tokens


def plan_batch(lengths: np.ndarray, shape: BatchShape, seed: int = 0, state: LoaderState | None = None,
               skip_oversize: bool = False, balance_groups: int = 1) -> PackedPlan:
    """The rows of the global batch the loader packs next (the first, without `state`) from
    `lengths`, int [samples, 4] columns (modality, n_text, n_gen, n_clean) as `Mix.lengths`
    gives them. The budget checks and their messages are the loader's (`BatchPacker`), and so is the
    balancing of rows over `balance_groups` groups."""
    lengths = np.asarray(lengths)
    if lengths.ndim != 2 or lengths.shape[1] != 4 or not len(lengths):
        raise UserError(f"lengths of shape {lengths.shape}: need [samples >= 1, 4] columns (modality, n_text, "
                        f"n_gen, n_clean), e.g. from Mix.lengths")
    planner = BatchPacker(lengths[:, 1:3].astype(np.int64), shape, seed, skip_oversize, balance_groups)
    ids, state = planner.plan(state or LoaderState())
    rows = tuple(tuple((int(lengths[i, 1]), int(lengths[i, 2]), int(lengths[i, 0]), int(lengths[i, 3])) for i in row)
                 for row in ids)
    return PackedPlan(shape, rows, state)
