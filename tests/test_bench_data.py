"""`xlaopt bench data` on a tiny configuration: the result's structure, the same budget for
both contenders, and Grain's batches being exactly the rows the xlaopt row builder makes."""
import numpy as np
import pytest

pytest.importorskip("grain")

from xlaopt.benchmarks import data as bench  # noqa: E402
from xlaopt.data.batch import BatchShape, cosmos3_batch_spec  # noqa: E402
from xlaopt.data.loader import RESOLUTION_SHIFT  # noqa: E402
from xlaopt.data.packing import fill_row, logit_normal_sigma  # noqa: E402
from xlaopt.data.synthetic_store import make_store  # noqa: E402
from xlaopt.families import FAMILIES  # noqa: E402
from xlaopt.models.registry import get_config  # noqa: E402

SHAPE = BatchShape(4, 51, 93)
SMALL_MODEL = {"num_layers": 1, "d_model": 64, "mlp_dim": 128}  # compiles in seconds, on one device


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench-data") / "store"
    make_store(path, get_config(bench.MODEL), 600)
    return path


def test_grain_batches_are_what_the_row_builder_makes(store_dir, tiny_config):
    source = bench.StoreSource(store_dir, tiny_config, seed=3)
    it = iter(bench.grain_dataset(source, SHAPE, seed=3))
    try:
        for _ in range(2):
            batch, ids = next(it)
            expected = {k: np.zeros(s, d) for k, (s, d, _) in cosmos3_batch_spec(tiny_config, SHAPE).items()}
            for r, row in enumerate(ids):
                sigmas = [logit_normal_sigma(np.random.default_rng([3, 0, 1, i]), RESOLUTION_SHIFT) for i in row]
                fill_row(expected, r, source.store.read_many(row), sigmas, tiny_config)
            assert batch.keys() == expected.keys()
            for name in expected:
                assert batch[name].dtype == expected[name].dtype, name
                np.testing.assert_array_equal(batch[name], expected[name], err_msg=name)
    finally:
        it.close()


def test_bench_runs_both_contenders_on_one_budget(store_dir):
    steps, lines = 2, []
    result = bench.run(str(store_dir), steps=steps, repeats=1, progress=lines.append, read_batches=2,
                       mesh="", settings=SMALL_MODEL, batch_size=4, disk_probe_mb=16)
    budget = result["tokens_per_step_budget"]
    default = FAMILIES["cosmos3"].default_batch(None)  # the row length `xlaopt train --data` uses
    assert budget == 4 * (result["batch"]["text_len"] + result["batch"]["gen_len"]) == 4 * (default.text_len
                                                                                            + default.gen_len)
    for name in ("xlaopt", "grain"):
        r = result[name]
        for key in ("tokens_per_s", "padding_fraction", "p99_next_s", "data_wait_fraction"):
            assert np.isfinite(r[key]) and r[key] >= 0, (name, key)
        assert r["budget_tokens"] == steps * budget and 0 < r["real_tokens"] <= r["budget_tokens"]
        assert r["padding_fraction"] == pytest.approx(1 - r["real_tokens"] / r["budget_tokens"])
        assert 0 <= r["data_wait_fraction"] < 1
        alone = r["alone"]  # the loader with no training: its own throughput on the same budget
        assert alone["tokens_per_s"] > 0 and alone["MBps"] > 0 and 0 <= alone["padding_fraction"] < 1
    assert result["ratios"]["loader_alone_tokens_per_s_xlaopt_vs_grain"] == pytest.approx(
        result["xlaopt"]["alone"]["tokens_per_s"] / result["grain"]["alone"]["tokens_per_s"])
    for key in ("disk_read_cold_MBps", "loader_read_cold_MBps", "loader_read_warm_MBps", "step_latency_s"):
        assert result[key] > 0
    assert isinstance(result["loader_io_bound"], bool) and len(result["rounds"]["xlaopt"]) == 1
    table = bench.format_table(result)
    assert "xlaopt" in table and "grain" in table and lines
