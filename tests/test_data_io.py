"""The shard-file read path: the same bytes as tensorstore, and loud, named failures."""
import dataclasses
import os
import re

import numpy as np
import pytest
import tensorstore as ts

from xlaopt.benchmarks.data_io import format_io_table, run_io
from xlaopt.data.batch import BatchShape, cosmos3_batch_spec
from xlaopt.data.loader import RESOLUTION_SHIFT, BatchPacker, Loader, LoaderState
from xlaopt.data.packing import fill_row, logit_normal_sigma
from xlaopt.data.shard_reader import ShardError, ShardReader
from xlaopt.data.store import SampleStore, StoreError, StoreWriter
from xlaopt.data.synthetic_cosmos import CosmosSamples
from xlaopt.data.synthetic_video import make_video_store
from xlaopt.io.direct import open_for_reading
from xlaopt.io.hostmem import BufferPool, aligned_empty
from xlaopt.io.zarr3 import array_spec, open_spec


@pytest.fixture(scope="module")
def mixed_store(tmp_path_factory, tiny_config):
    """Every modality, text-only samples too, over several shards."""
    gen, rng = CosmosSamples(tiny_config, 0), np.random.default_rng(2)
    path = tmp_path_factory.mktemp("mixed") / "store"
    StoreWriter(path, gen.widths(), shard_bytes=48 << 10).add_all(gen.draw(rng) for _ in range(300)).close()
    return path


@pytest.fixture()
def video_store(tmp_path, tiny_config):
    """Clips of up to 20,000 tokens x 32 channels (over 1 MiB each, so the store reads them with
    the shard reader): each spans several 2048-row inner chunks."""
    make_video_store(tmp_path / "video", samples=6, tokens_per_clip=20_000, config=tiny_config, shard_bytes=1 << 20)
    return tmp_path / "video"


def _same(a, b):
    assert (a.modality, tuple(a.grid), a.domain, a.n_clean, a.fps) == (b.modality, tuple(b.grid), b.domain,
                                                                        b.n_clean, b.fps)
    assert a.text.dtype == b.text.dtype and a.text.tobytes() == b.text.tobytes()
    if a.latents is None:
        assert b.latents is None
    else:
        assert a.latents.shape == b.latents.shape and a.latents.tobytes() == b.latents.tobytes()


def test_samples_equal_tensorstore_reads(mixed_store):
    plain, direct = SampleStore(mixed_store, direct=False), SampleStore(mixed_store)
    try:
        assert len(plain.manifest["shards"]) > 2
        ids = np.random.default_rng(0).permutation(len(plain))
        for batch in np.array_split(ids, 10):
            for a, b in zip(plain.read_many(batch), direct.read_many(batch)):
                _same(a, b)
    finally:
        direct.close()


def test_row_ranges_equal_tensorstore_reads(video_store):
    array = video_store / "shard-00000" / "video"
    want = ts.open(open_spec(array)).result()
    rows = want.shape[0]
    rng = np.random.default_rng(0)
    ranges = [(0, rows), (0, 1), (2047, 2049), (2048, 4096), (rows - 1, rows), (5, 5)]
    ranges += [tuple(sorted(rng.integers(0, rows + 1, 2))) for _ in range(20)]
    with ShardReader(threads=3, piece_bytes=300 << 10) as reader:  # pieces of two inner chunks
        for start, stop in ranges:
            got = reader.read(array, start, stop).result()
            assert got.tobytes() == want[start:stop].read().result().tobytes(), (start, stop)
        # Into rows of a wider, zeroed batch: only those rows and columns change.
        batch = np.zeros((2, 5000, 48), np.float32)
        reader.read(array, 100, 4100, out=batch[1, 500:4500, :32]).result()
        np.testing.assert_array_equal(batch[1, 500:4500, :32], want[100:4100].read().result())
        assert not batch[0].any() and not batch[1, :500].any() and not batch[1, 4500:].any()
        assert not batch[1, :, 32:].any()
        with pytest.raises(ShardError, match="outside"):
            reader.read(array, 0, rows + 1)


def test_arrays_of_several_shard_files(tmp_path):
    """Rows spread over several files (the layout allows it; the store writes one per array)."""
    data = np.arange(1000 * 6, dtype=np.int64).reshape(1000, 6)
    spec = array_spec(tmp_path / "a", data.shape, "int64", chunk=[256, 6], inner=[64, 6])
    ts.open(spec).result().write(data).result()
    assert len(list((tmp_path / "a" / "c").iterdir())) == 4
    with ShardReader(threads=2, piece_bytes=2 << 10) as reader:
        for start, stop in [(0, 1000), (250, 530), (255, 257), (999, 1000)]:
            np.testing.assert_array_equal(reader.read(tmp_path / "a", start, stop).result(), data[start:stop])


def test_chunks_out_of_order_on_disk(tmp_path):
    """The index, not the file order, places each inner chunk (tensorstore may write them in any order)."""
    import google_crc32c

    data = np.arange(640 * 4, dtype=np.float32).reshape(640, 4)
    ts.open(array_spec(tmp_path / "a", data.shape, "float32", inner=[64, 4])).result().write(data).result()
    path = tmp_path / "a" / "c" / "0" / "0"
    raw = path.read_bytes()
    index = np.frombuffer(raw[-(16 * 10 + 4):-4], "<u8").reshape(10, 2)
    chunks = [raw[o:o + n] for o, n in index]
    order = [3, 1, 0, 2, 9, 8, 4, 5, 7, 6]  # the order they lie in the new file
    body, new_index = b"", np.zeros_like(index)
    for k in order:
        new_index[k] = (len(body), len(chunks[k]))
        body += chunks[k]
    index_bytes = new_index.astype("<u8").tobytes()
    path.write_bytes(body + index_bytes + google_crc32c.value(index_bytes).to_bytes(4, "little"))
    np.testing.assert_array_equal(ts.open(open_spec(tmp_path / "a")).result().read().result(), data)
    with ShardReader(threads=2, piece_bytes=3 << 10) as reader:
        for start, stop in [(0, 640), (60, 300), (130, 131), (500, 640)]:
            np.testing.assert_array_equal(reader.read(tmp_path / "a", start, stop).result(), data[start:stop])


@pytest.mark.parametrize("damage", ["flip data", "flip index", "truncate", "delete"])
def test_damage_names_the_file(video_store, damage):
    path = video_store / "shard-00000" / "video" / "c" / "0" / "0"
    data = bytearray(path.read_bytes())
    if damage == "flip data":
        data[len(data) // 3] ^= 0xFF
    elif damage == "flip index":
        data[-10] ^= 0x01
    elif damage == "truncate":
        data = data[: len(data) // 2]
    if damage == "delete":
        path.unlink()
    else:
        path.write_bytes(bytes(data))
    reason = {"flip data": "crc32c mismatch in inner chunk", "flip index": "crc32c mismatch in the shard index",
              "truncate": "crc32c mismatch in the shard index", "delete": "is missing"}[damage]
    store = SampleStore(video_store)
    try:
        where = f"cannot read shard-00000/video: shard file {path}" + (" " if damage == "delete" else ": ")
        with pytest.raises(StoreError, match=re.escape(where + reason)):
            store.read_many(range(len(store)))
    finally:
        store.close()


def test_clips_go_from_the_disk_straight_into_an_aligned_destination(video_store):
    """Latent inner chunks are bare bytes (their crc32c in a side array), so the whole chunks of
    a clip go from the disk straight into its destination when file offset and address agree
    modulo 512 bytes (clips here are multiples of 3,600 rows of 128 bytes), and are checked
    there; a destination off that grid takes the copy path. Same bytes either way, and damage
    in a chunk read straight into place still fails, naming the file."""
    want = SampleStore(video_store, direct=False).read_many(range(6))
    path = video_store / "shard-00000" / "video" / "c" / "0" / "0"
    fd, direct_io = open_for_reading(path)  # tmpfs, say, has no O_DIRECT: then every read is copied
    os.close(fd)
    buf = aligned_empty((20_000 + 1, 32), np.float32)
    reader = ShardReader()
    store = SampleStore(video_store, reader=reader)
    try:
        for i, sample in enumerate(want):
            for shift in (0, 1):  # one row: 128 bytes off the grid
                dest = buf[shift:shift + len(sample.latents)]
                dest[...] = np.nan
                before = reader.stats["direct_bytes"]
                got = store.start_many([i], [dest]).result()[0]
                assert np.shares_memory(got.latents, dest)
                np.testing.assert_array_equal(dest, sample.latents)
                direct = reader.stats["direct_bytes"] - before
                assert (direct >= 1 << 20) if (direct_io and shift == 0) else direct == 0, (i, shift, direct)
        index = store._shard_index("shard-00000")
        first = int(index[0, 2])  # clip 0's first row; damage a byte 5000 rows in, a whole inner chunk
    finally:
        store.close()
    data = bytearray(path.read_bytes())
    data[(first + 5000) * 32 * 4] ^= 0xFF
    path.write_bytes(bytes(data))
    for direct in (True, False):
        store = SampleStore(video_store, direct=direct)
        try:
            with pytest.raises(StoreError, match="crc32c mismatch in inner chunk 2"):
                store.start_many([0], [buf[:len(want[0].latents)]]).result()
        finally:
            store.close()


def _expected_batches(store_dir, config, shape, count):
    """What the loader must deliver: its planner's rows packed the plain way (tensorstore reads,
    latents copied into a zeroed batch)."""
    plain = SampleStore(store_dir, direct=False)
    planner, state, batches = BatchPacker(plain.lengths(), shape, 0), LoaderState(), []
    for _ in range(count):
        rows, state = planner.plan(state)
        out = {k: np.zeros(s, d) for k, (s, d, _) in cosmos3_batch_spec(config, shape).items()}
        for r, row in enumerate(rows):
            sigmas = [logit_normal_sigma(np.random.default_rng([0, state.epoch, 1, i]), RESOLUTION_SHIFT) for i in row]
            fill_row(out, r, plain.read_many(row), sigmas, config)
        batches.append(out)
    return batches


def test_loader_reads_clips_into_their_place(video_store, tiny_config, monkeypatch):
    """Clips read straight into reused (dirty: here NaN-filled) batch buffers, several batches
    ahead: the same batches, padding zeros included, as the plain packer's. Rows are wider than
    the store's latents (zero columns) and longer than most clips (zero padding)."""
    monkeypatch.setattr(BufferPool, "empty", lambda self, shape, dtype: np.full(shape, np.nan, dtype))
    store = SampleStore(video_store)
    lengths = store.lengths()
    shape = BatchShape(1, int(lengths[:, 0].max()), int(lengths[:, 1].max()) + 100)
    config = dataclasses.replace(tiny_config, action_dim=48)  # the generator reads 48 > 32 video channels
    assert config.generator_in_dim == 48
    count = 2 * len(store) + 1  # over two epochs: every buffer is reused at least once
    loader = Loader(store, config, shape, read_ahead=3)
    try:
        for k, want in enumerate(_expected_batches(video_store, config, shape, count)):
            got = next(loader)
            for name in want:
                assert got[name].dtype == want[name].dtype, name
                np.testing.assert_array_equal(got[name], want[name], err_msg=f"batch {k}: {name}")
    finally:
        loader.close()
        store.close()


def test_loader_delivers_the_good_batches_before_a_damaged_clip(video_store, tiny_config):
    """A corrupted clip fails its own batch, naming the file; the batches before it, whose
    reads ran alongside, arrive intact."""
    lengths = SampleStore(video_store, direct=False).lengths()
    shape = BatchShape(1, int(lengths[:, 0].max()), int(lengths[:, 1].max()))
    planner, state, order = BatchPacker(lengths, shape, 0), LoaderState(), []
    for _ in range(len(lengths)):
        rows, state = planner.plan(state)
        order.append(rows[0])
    victim = order[3][0]  # the clip of the fourth batch
    store = SampleStore(video_store)
    k = int(np.searchsorted(store._starts, victim, side="right") - 1)  # its shard, and its first latent row
    shard, index = store._shards[k], store._shard_index(store._shards[k])
    row = int(index[victim - store._starts[k], 2])
    path = video_store / shard / "video" / "c" / "0" / "0"
    data = bytearray(path.read_bytes())
    data[(row + 4096) * 32 * 4] ^= 0xFF  # 4096 rows in (clips hold 10-20k): an inner chunk of this clip only
    path.write_bytes(bytes(data))
    loader = Loader(store, tiny_config, shape, read_ahead=3)
    try:
        for want in _expected_batches(video_store, tiny_config, shape, 3):
            np.testing.assert_array_equal(next(loader)["gen_x0_BVC"], want["gen_x0_BVC"])
        with pytest.raises(StoreError, match=re.escape(f"shard file {path}: crc32c mismatch")):
            next(loader)
    finally:
        loader.close()
        store.close()


def test_io_bench_runs_and_reports(tmp_path, tiny_config):
    result = run_io(repeats=1, progress=lambda *_: None, samples=12, tokens_per_clip=3000, config=tiny_config,
                    scratch_dir=tmp_path, warmup=1)
    assert result["pass_batches"] > result["warmup_batches"] == 1
    for key in ("disk_read_cold_MBps", "disk_read_cold_parallel_MBps", "loader_read_cold_MBps",
                "loader_read_cold_with_start_MBps", "loader_tensorstore_read_cold_MBps", "read_many_cold_MBps",
                "read_many_tensorstore_cold_MBps", "loader_start_s"):
        assert result[key] > 0 and len(result["rounds"][key]) == 1
    # Every planned batch's payload was delivered: the store's samples, read once each at most.
    assert 0 < result["pass_payload_bytes"] <= result["store_bytes"] and result["ratios"]["loader_read_vs_disk"] > 0
    assert "Loader (steady, first 1 batches not counted) / disk cold read" in format_io_table(result)
    assert not list(tmp_path.iterdir())  # the scratch store is gone
    # Run from a test, the benchmark evicts its own files, never the whole host's page cache (even as root).
    assert result["page_cache"].startswith("posix_fadvise")
