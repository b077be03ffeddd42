"""The store loader: every sample once per epoch, packed within budget, exact resume,
also onto a different process count."""
import dataclasses
import json

import numpy as np
import pytest

from xlaopt.data.batch import BatchShape
from xlaopt.data.loader import BatchPacker, Loader, LoaderError, LoaderState, best_fill, split_budget
from xlaopt.data.store import SampleStore, StoreWriter
from xlaopt.data.synthetic_cosmos import CosmosSamples

SHAPE = BatchShape(4, 51, 93)


@pytest.fixture(scope="module")
def store(tiny_config, tmp_path_factory):
    gen, rng = CosmosSamples(tiny_config, 0), np.random.default_rng(2)
    path = tmp_path_factory.mktemp("loader") / "store"
    StoreWriter(path, gen.widths(), shard_bytes=128 << 10).add_all(gen.draw(rng) for _ in range(400)).close()
    return SampleStore(path)


def _plans(planner, state, n):
    plans = []
    for _ in range(n):
        rows, state = planner.plan(state)
        plans.append(rows)
    return plans, state


def test_no_sample_lost_or_repeated_and_rows_within_budget(store):
    """Placed samples plus those still waiting are exactly the stream consumed so far."""
    lengths = store.lengths()
    planner = BatchPacker(lengths, SHAPE, seed=0)
    state, placed = LoaderState(), []
    while state.epoch < 2:
        rows, state = planner.plan(state)
        for row in rows:
            assert lengths[row, 0].sum() <= SHAPE.text_len and lengths[row, 1].sum() <= SHAPE.gen_len
            placed.extend(row)
    perms = [np.random.default_rng([0, e]).permutation(len(lengths)) for e in range(state.epoch + 1)]
    stream = np.concatenate(perms[:-1] + [perms[-1][: state.cursor]])
    assert sorted(placed + list(state.waiting)) == sorted(stream.tolist())
    assert len(placed) > 2 * len(lengths) - 100  # and the waiting line stays short


def test_padding_within_3_percent_on_the_synthetic_mix(tiny_config):
    """The default row (144 tokens, split by the mean lengths) over a whole epoch of the mix."""
    gen, rng = CosmosSamples(tiny_config, 0), np.random.default_rng(4)
    lengths = np.array([(s.n_text, s.n_gen) for s in (gen.draw(rng) for _ in range(4000))], np.int64)
    shape = BatchShape(8, *split_budget(144, *lengths.mean(axis=0)))
    planner, state, real, batches = BatchPacker(lengths, shape, seed=0), LoaderState(), 0, 0
    while state.epoch < 1:
        rows, state = planner.plan(state)
        real, batches = real + sum(int(lengths[row].sum()) for row in rows), batches + 1
    assert 1 - real / (batches * shape.tokens) <= 0.03


def test_the_head_of_the_waiting_line_goes_next(store):
    """So no sample waits forever: the oldest waiting sample is in the very next batch."""
    planner, state = BatchPacker(store.lengths(), SHAPE, seed=1), LoaderState()
    for _ in range(60):
        head = state.waiting[:1]
        rows, state = planner.plan(state)
        assert set(head) <= {i for row in rows for i in row}


def test_best_fill_fills_exactly_within_room_and_prefers_earlier():
    need = np.array([[5, 40], [5, 40], [3, 10], [2, 10], [4, 7], [1, 1]])
    picked = best_fill(need, np.array([10, 60]))
    assert need[picked].sum(axis=0).tolist() == [10, 60] and picked.tolist() == [0, 2, 3]
    assert best_fill(need, np.array([0, 0])).tolist() == []
    assert best_fill(need[:0], np.array([10, 60])).tolist() == []
    # A room too large for the exact table is narrowed (and if need be coarsened), never overfilled.
    rng = np.random.default_rng(0)
    many = np.stack([rng.integers(1, 40, 300), rng.integers(0, 400, 300)], axis=1)
    for room in ([500, 7000], [3, 9000], [9000, 3]):
        picked = best_fill(many, np.array(room), max_cells=1 << 10)
        assert (many[picked].sum(axis=0) <= room).all() and len(set(picked.tolist())) == len(picked)


def test_resume_mid_epoch_gives_the_same_sequence(store, tiny_config):
    uninterrupted = Loader(store, tiny_config, SHAPE, seed=5)
    reference = [next(uninterrupted) for _ in range(8)]
    uninterrupted.close()
    first = Loader(store, tiny_config, SHAPE, seed=5)
    for _ in range(3):
        next(first)
    saved = LoaderState.from_json(first.state().to_json())  # as it travels in a checkpoint
    first.close()
    resumed = Loader(store, tiny_config, SHAPE, seed=5, state=saved)
    for k in range(3, 8):
        batch = next(resumed)
        for name in batch:
            np.testing.assert_array_equal(batch[name], reference[k][name], err_msg=f"batch {k} {name}")
    resumed.close()


def test_two_processes_then_one(store, tiny_config):
    single = Loader(store, tiny_config, SHAPE, seed=7)
    reference = [next(single) for _ in range(6)]
    single.close()
    halves = [Loader(store, tiny_config, SHAPE, seed=7, process_index=p, process_count=2) for p in (0, 1)]
    for k in range(3):
        parts = [next(h) for h in halves]
        for name in parts[0]:
            axis = 1 if name.endswith(("_3BT", "_3BV")) else 0
            np.testing.assert_array_equal(np.concatenate([p[name] for p in parts], axis=axis), reference[k][name])
    assert halves[0].state() == halves[1].state()
    state = halves[0].state()
    for h in halves:
        h.close()
    one = Loader(store, tiny_config, SHAPE, seed=7, state=state)
    for k in range(3, 6):
        np.testing.assert_array_equal(next(one)["gen_x0_BVC"], reference[k]["gen_x0_BVC"])
    one.close()


def test_oversize_samples_error_or_counted_skip(store, tiny_config):
    small = dataclasses.replace(SHAPE, gen_len=20)
    with pytest.raises(LoaderError, match="more than a row holds"):
        BatchPacker(store.lengths(), small, seed=0)
    planner = BatchPacker(store.lengths(), small, seed=0, skip_oversize=True)
    _, state = _plans(planner, LoaderState(), 5)
    assert state.skipped > 0


def test_budget_split_follows_the_lengths(store):
    stats = store.manifest["stats"]
    text, gen = split_budget(144, stats["text_tokens"]["mean"], stats["gen_tokens"]["mean"])
    assert text + gen == 144 and abs(text / 144 - stats["text_tokens"]["mean"] / stats["tokens"]["mean"]) < 0.01


def test_train_reads_the_store(store, tmp_path):
    from xlaopt.cli import main

    out = tmp_path / "train.json"
    rc = main(["train", "--model", "cosmos3-tiny", "--set", "num_layers=1", "--mesh", "data=2", "--steps", "3",
               "--data", str(store.dir), "--no-progress", "--json", str(out)])
    result = json.loads(out.read_text())
    assert rc == 0 and result["data"]["store"] == str(store.dir) and result["data"]["state"]["batches"] == 3
    stats = store.manifest["stats"]
    from xlaopt.families import FAMILIES

    default = FAMILIES["cosmos3"].default_batch(None)  # Cosmos 3 rows do not depend on the config
    row = default.text_len + default.gen_len
    assert result["batch"]["text_len"] == split_budget(row, stats["text_tokens"]["mean"], stats["gen_tokens"]["mean"])[0]
    assert 0 <= result["padding_fraction"] < 0.25


def test_train_stops_on_oversize_samples_or_skips_them_when_asked(store, tmp_path, capsys):
    from xlaopt.cli import main

    args = ["train", "--model", "cosmos3-tiny", "--set", "num_layers=1", "--steps", "2", "--data", str(store.dir),
            "--batch-size", "2", "--text-len", "16", "--gen-len", "20", "--no-progress"]
    assert main(args) == 2  # before anything compiles
    err = capsys.readouterr().err
    assert "more than a row holds (16, 20)" in err and "--skip-oversize" in err
    assert main(args + ["--skip-oversize", "--json", str(tmp_path / "out.json")]) == 0
    assert "samples longer than a row" in capsys.readouterr().out
    assert json.loads((tmp_path / "out.json").read_text())["data"]["state"]["skipped"] > 0


def test_rows_balanced_over_groups_for_attention_work():
    """Rows go to the batch's shards so each shard's attention work is near equal (the step waits
    for the busiest device); the rows themselves, and the loader state after them, are the same."""
    from xlaopt.data.loader import attention_pairs, balance_rows

    costs = [100.0, 1.0, 90.0, 2.0, 80.0, 3.0]
    order = balance_rows(costs, 3)
    assert sorted(order) == list(range(6))
    loads = [sum(costs[i] for i in order[k:k + 2]) for k in (0, 2, 4)]
    assert sorted(loads) == [83.0, 92.0, 101.0]  # the heaviest rows each with a light one: the least maximum
    assert balance_rows(costs, 1) == list(range(6))
    assert attention_pairs(np.array([[3, 4], [2, 0]])) == 3 * 4 / 2 + 4 * 7 + 2 * 3 / 2
    rng = np.random.default_rng(0)
    lengths = np.stack([rng.integers(1, 12, 400), rng.integers(0, 60, 400)], axis=1)
    shape = BatchShape(8, 24, 96)
    plain, _ = BatchPacker(lengths, shape, seed=0).plan(LoaderState())
    balanced, state = BatchPacker(lengths, shape, seed=0, balance_groups=4).plan(LoaderState())
    assert sorted(map(tuple, balanced)) == sorted(map(tuple, plain))
    assert state == BatchPacker(lengths, shape, seed=0).plan(LoaderState())[1]
    work = lambda rows: [sum(attention_pairs(lengths[r]) for r in rows[k:k + 2]) for k in range(0, 8, 2)]
    assert max(work(balanced)) <= max(work(plain))
    with pytest.raises(LoaderError, match="3 row groups"):
        BatchPacker(lengths, shape, seed=0, balance_groups=3)
