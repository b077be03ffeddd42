"""The batch a price is for: the layout of its rows (which sample each slot holds), without its
latents. From the family's synthetic stream by default, or packed from a sample mix or a store as
the loader packs them (`xlaopt.data.plan`)."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from xlaopt.data.batch import BatchShape
from xlaopt.program import TrainProgram


@dataclasses.dataclass(frozen=True, eq=False)
class PricedBatch:
    source: str  # where the rows come from, for the report
    shape: BatchShape
    arrays: dict[str, np.ndarray]  # the batch contract's layout arrays (segment ids, modality, noise mask)


def synthetic_batch(program: TrainProgram) -> PricedBatch:
    from xlaopt.families import family_of

    family = family_of(program.model)
    shape = program.settings.batch
    arrays = family.synthetic(program.model, shape, program.settings.seed).batch(0)
    return PricedBatch(f"{program.model.family} synthetic stream, batch 0", shape, arrays)


def cosmos3_layout(shape: BatchShape, rows: Sequence[Sequence[tuple[int, int, int, int]]]) -> dict[str, np.ndarray]:
    """The layout arrays of Cosmos 3 rows of samples given as (n_text, n_gen, modality, n_clean),
    laid out as `xlaopt.data.packing.fill_row` lays them: samples in order from the start of each
    region, segment ids from 1, padding (segment 0) after."""
    B, T, V = shape.batch_size, shape.text_len, shape.gen_len
    if len(rows) != B:
        raise ValueError(f"{len(rows)} rows for a batch of {B}")
    text_seg, gen_seg = np.zeros((B, T), np.int32), np.zeros((B, V), np.int32)
    modality, noisy = np.zeros((B, V), np.int32), np.zeros((B, V), bool)
    for r, samples in enumerate(rows):
        t = g = 0
        for segment, (n_text, n_gen, m, n_clean) in enumerate(samples, start=1):
            if t + n_text > T or g + n_gen > V:
                raise ValueError(f"row {r}: its samples need more than ({T}, {V}) text and generator tokens")
            text_seg[r, t:t + n_text] = segment
            gen_seg[r, g:g + n_gen] = segment
            modality[r, g:g + n_gen] = m
            noisy[r, g + n_clean:g + n_gen] = True
            t, g = t + n_text, g + n_gen
    return {"text_segment_ids_BT": text_seg, "gen_segment_ids_BV": gen_seg, "gen_modality_BV": modality,
            "gen_noisy_BV": noisy}
