"""The tensorstore sample store: exact round trip, an open layout, and loud failures."""
import json
import pathlib

import numpy as np
import pytest
import tensorstore as ts

from xlaopt.cli import main
from xlaopt.data.sample import Sample, SampleError
from xlaopt.data.store import SampleStore, StoreError, StoreWriter
from xlaopt.data.synthetic_cosmos import CosmosSamples
from xlaopt.models.cosmos3 import VIDEO


@pytest.fixture(scope="module")
def samples(tiny_config):
    gen, rng = CosmosSamples(tiny_config, 0), np.random.default_rng(1)
    return gen, [gen.draw(rng) for _ in range(600)]


@pytest.fixture()
def store_dir(tmp_path, samples):
    gen, drawn = samples
    StoreWriter(tmp_path / "store", gen.widths(), shard_bytes=64 << 10).add_all(drawn).close()
    return tmp_path / "store"


def test_round_trip_is_exact_across_shards(store_dir, samples):
    _, drawn = samples
    store = SampleStore(store_dir)
    assert len(store) == len(drawn) and len(store.manifest["shards"]) > 1
    for i in range(len(drawn)):
        got, want = store.read(i), drawn[i]
        np.testing.assert_array_equal(got.text, want.text)
        assert (got.modality, got.grid, got.domain, got.n_clean) == (want.modality, tuple(want.grid), want.domain, want.n_clean)
        if want.latents is None:
            assert got.latents is None
        else:
            np.testing.assert_array_equal(got.latents, want.latents)
    stats = store.manifest["stats"]
    assert sum(stats["modalities"].values()) == len(drawn)
    assert stats["gen_tokens"]["max"] == max(s.n_gen for s in drawn)


def test_layout_is_plain_zarr3(store_dir, samples):
    """The arrays open with tensorstore alone, from the documented layout."""
    _, drawn = samples
    manifest = json.loads((store_dir / "manifest.json").read_text())
    first = manifest["shards"][0]["name"]
    index = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(store_dir / first / "index")}}).result()
    text = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(store_dir / first / "text")}}).result()
    t0, t1 = index[0, :2].read().result()
    np.testing.assert_array_equal(text[t0:t1].read().result(), drawn[0].text)


def _data_file(store_dir: pathlib.Path, array: str) -> pathlib.Path:
    files = [p for p in (store_dir / "shard-00000" / array).rglob("*") if p.is_file() and p.name != "zarr.json"]
    assert len(files) == 1
    return files[0]


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_shard_names_the_file(store_dir, samples, damage):
    _, drawn = samples
    path = _data_file(store_dir, "video")
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 3] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=r"cannot read shard-00000/video: .*(Digest mismatch|shard)"):
        for i in range(len(drawn)):
            if drawn[i].modality == VIDEO:
                SampleStore(store_dir).read(i)


def test_bad_stores_and_samples_are_refused(tmp_path, samples):
    gen, drawn = samples
    with pytest.raises(StoreError, match="does not exist"):
        SampleStore(tmp_path / "missing")
    (tmp_path / "half").mkdir()
    with pytest.raises(StoreError, match="no manifest.json"):
        SampleStore(tmp_path / "half")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "manifest.json").write_text(json.dumps({"format": "orbax"}))
    with pytest.raises(StoreError, match="expected 'xlaopt-sample-store'"):
        SampleStore(tmp_path / "foreign")
    (tmp_path / "old").mkdir()  # format 2 kept each latent chunk's crc32c inline: written again
    (tmp_path / "old" / "manifest.json").write_text(json.dumps({"format": "xlaopt-sample-store", "version": 2}))
    with pytest.raises(StoreError, match="version 2, expected 'xlaopt-sample-store' version 3; .*xlaopt data make"):
        SampleStore(tmp_path / "old")
    with pytest.raises(StoreError, match="no samples were written"):
        StoreWriter(tmp_path / "empty", gen.widths()).close()
    video = next(s for s in drawn if s.modality == VIDEO)
    wrong_grid = Sample(video.text, VIDEO, video.latents, (9, 9, 9))
    with pytest.raises(SampleError, match=r"grid \(9, 9, 9\) holds 729 tokens but the latents hold"):
        StoreWriter(tmp_path / "w", gen.widths()).add(wrong_grid)


def test_shard_paths_stay_inside_the_store(store_dir):
    manifest = json.loads((store_dir / "manifest.json").read_text())
    manifest["shards"][0]["name"] = "../../etc"
    (store_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match="is not a shard of this directory"):
        SampleStore(store_dir)


def test_cli_make_and_stats(tmp_path, capsys):
    out = tmp_path / "stats.json"
    assert main(["data", "make", str(tmp_path / "s"), "--samples", "300"]) == 0
    assert main(["data", "stats", str(tmp_path / "s"), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["num_samples"] == 300
    assert main(["data", "make", str(tmp_path / "s")]) == 2
    assert "already holds a sample store" in capsys.readouterr().err
