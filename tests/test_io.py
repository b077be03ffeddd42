"""The one direct-I/O reader (`xlaopt.io.direct.DirectFile`) that checkpoint restores and shard
reads share: the same bytes with and without O_DIRECT, whatever the offset and length, and the
fallbacks to plain reads when the filesystem refuses O_DIRECT at open or on a read (simulated
here by refusing reads on the descriptors opened with O_DIRECT, so the test means the same on
a filesystem that has O_DIRECT and on one, tmpfs say, that has not)."""
import errno
import os

import numpy as np
import pytest

from xlaopt.checkpoint import CheckpointError
from xlaopt.checkpoint.reader import _read_chunk
from xlaopt.io import direct as direct_mod
from xlaopt.io.direct import DirectFile, ShortRead
from xlaopt.io.hostmem import PAGE

SIZE = 3 * (1 << 20) + 1234


@pytest.fixture
def data_file(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, SIZE, dtype=np.uint8)
    path = tmp_path / "blob"
    path.write_bytes(data.tobytes())
    return path, data


@pytest.fixture
def refusing(monkeypatch):
    """O_DIRECT opens 'succeed' (without the flag, so any filesystem takes them) and every read on
    such a descriptor fails with EINVAL, as on a filesystem that takes O_DIRECT at open only."""
    refused: set[int] = set()
    real_open, real_preadv = os.open, os.preadv

    def open_(path, flags, *args):
        fd = real_open(path, flags & ~getattr(os, "O_DIRECT", 0), *args)
        if flags & getattr(os, "O_DIRECT", 0):
            refused.add(fd)
        return fd

    def preadv(fd, buffers, offset):
        if fd in refused:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset)

    if not getattr(os, "O_DIRECT", 0):
        pytest.skip("no O_DIRECT on this platform")
    monkeypatch.setattr(direct_mod.os, "open", open_)
    monkeypatch.setattr(direct_mod.os, "preadv", preadv)
    return refused


@pytest.mark.parametrize("direct", [True, False])
def test_pread_returns_the_bytes_asked_for_in_an_aligned_buffer(data_file, direct):
    path, data = data_file
    with DirectFile(path, direct) as f:
        assert f.size() == SIZE
        for offset, length in ((0, SIZE), (1, 10), (PAGE - 3, 2 * PAGE + 7), (SIZE - 5, 5), (12345, 1 << 20)):
            got, buf = f.pread(offset, length)
            assert buf.ctypes.data % PAGE == 0 and np.shares_memory(got, buf)
            np.testing.assert_array_equal(got, data[offset:offset + length])
            again, same = f.pread(offset, length, buf)  # a buffer large enough is reused
            assert same is buf
            np.testing.assert_array_equal(again, data[offset:offset + length])


def test_small_reads_go_through_the_page_cache(data_file, refusing):
    path, data = data_file
    with DirectFile(path, min_direct_bytes=1 << 20) as f:
        assert f.direct
        np.testing.assert_array_equal(f.pread(100, 4096)[0], data[100:4196])
        assert f.direct  # the refusing O_DIRECT descriptor was not used for a small read
        np.testing.assert_array_equal(f.pread(0, 2 << 20)[0], data[:2 << 20])
        assert not f.direct  # a large one was, was refused, and the file switched to plain reads


def test_a_refused_direct_read_falls_back_to_plain_reads(data_file, refusing):
    path, data = data_file
    with DirectFile(path) as f:
        assert f.direct
        got, _ = f.pread(7, SIZE - 7)
        np.testing.assert_array_equal(got, data[7:])
        assert not f.direct and f.fd not in refusing
        np.testing.assert_array_equal(f.pread(0, 10)[0], data[:10])


def test_a_refused_read_into_callers_memory_falls_back_for_that_read_only(data_file, refusing):
    path, data = data_file
    dest = np.empty(1 << 20, np.uint8)
    with DirectFile(path) as f:
        f.pread_into(PAGE, dest)
        np.testing.assert_array_equal(dest, data[PAGE:PAGE + len(dest)])
        assert f.direct  # the refusal may be this memory's: the file keeps O_DIRECT


def test_direct_refused_at_open_reads_plainly(data_file, monkeypatch):
    path, data = data_file
    real_open = os.open

    def open_(p, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(p, flags, *args)

    monkeypatch.setattr(direct_mod.os, "open", open_)
    with DirectFile(path) as f:
        assert not f.direct
        np.testing.assert_array_equal(f.pread(3, 100)[0], data[3:103])


def test_reads_past_the_end_raise_short_read(data_file):
    path, _ = data_file
    with DirectFile(path) as f:
        with pytest.raises(ShortRead) as e:
            f.pread(SIZE - 10, 20)
        assert e.value.missing == 10 and e.value.offset == SIZE
        with pytest.raises(ShortRead):
            f.pread_into(SIZE - 10, np.empty(20, np.uint8))


def test_checkpoint_chunk_read_falls_back_too(tmp_path, refusing):
    import google_crc32c

    values = np.arange(3000, dtype=np.float32)
    path = tmp_path / "chunk"
    path.write_bytes(values.tobytes() + google_crc32c.value(values.tobytes()).to_bytes(4, "little"))
    got = _read_chunk(path, "w", values.shape, values.dtype)
    np.testing.assert_array_equal(got, values)
    assert got.ctypes.data % PAGE == 0
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(CheckpointError, match="holds 12003 bytes, a chunk needs 12004"):
        _read_chunk(path, "w", values.shape, values.dtype)
