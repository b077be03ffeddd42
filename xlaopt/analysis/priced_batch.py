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


def whole_rows_batch(program: TrainProgram) -> PricedBatch:
    """A decoder's batch of one document per row, its whole sequence: causal attention across the
    row, as the published runs' frameworks train by default (and as the analytic model prices)."""
    from xlaopt.errors import UserError
    from xlaopt.families import family_of

    if family_of(program.model).segment_keys != ("segment_ids_BT",):
        raise UserError(f"whole-row batches are a decoder's; {program.model.name} is priced on its synthetic stream")
    shape = program.settings.batch
    rows, seq = shape.batch_size, shape.text_len
    arrays = {"tokens_BT": np.zeros((rows, seq), np.int32), "segment_ids_BT": np.ones((rows, seq), np.int32),
              "positions_BT": np.broadcast_to(np.arange(seq, dtype=np.int32), (rows, seq)).copy()}
    return PricedBatch("one document per row", shape, arrays)


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


def packed_batch(program: TrainProgram, shapes: np.ndarray, source: str, skip_oversize: bool = False) -> PricedBatch:
    """The first global batch the loader packs from samples of these shapes (int [n, 4]: modality,
    n_text, n_gen, n_clean), laid out for the program's rows."""
    from xlaopt.data.plan import plan_batch
    from xlaopt.errors import UserError
    from xlaopt.families import family_of
    from xlaopt.sharding import row_groups

    if not family_of(program.model).packs_samples:
        raise UserError(f"{source}: sample mixes and stores hold Cosmos 3 samples; {program.model.name} is priced "
                        f"on its synthetic stream (drop --mix/--data)")
    shape = program.settings.batch
    plan = plan_batch(shapes, shape, program.settings.seed, skip_oversize=skip_oversize,
                      balance_groups=row_groups(program))
    return PricedBatch(f"{source}, packed as the loader packs its first batch", shape, cosmos3_layout(shape, plan.rows))


def mix_batch(program: TrainProgram, name: str, skip_oversize: bool = False) -> PricedBatch:
    """`packed_batch` of a named mix (`xlaopt.data.mixes`), from enough sampled shapes that the
    loader's window (twice a batch) never runs dry."""
    from xlaopt.data.mixes import get_mix

    mix, seed, shape = get_mix(name), program.settings.seed, program.settings.batch
    pilot = mix.lengths(10_000, seed)
    mean_tokens = max(float(pilot[:, 1:3].sum(axis=1).mean()), 1.0)
    samples = max(10_000, int(np.ceil(8 * shape.tokens / mean_tokens)))
    return packed_batch(program, mix.lengths(samples, seed), f"mix {name}", skip_oversize)


def store_batch(program: TrainProgram, directory: str, skip_oversize: bool = False) -> PricedBatch:
    """`packed_batch` of a sample store's samples (its shard indexes only)."""
    from xlaopt.data.store import SampleStore

    return packed_batch(program, SampleStore(directory).shapes(), f"store {directory}", skip_oversize)
