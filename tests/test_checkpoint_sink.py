"""HDF5 writes through ErrorKeepingFile: a write that fails at any point (ENOSPC here) is raised
once, in Python, after HDF5 closed the file; HDF5 itself never sees the error. The same for the
checkpoint writer as a whole (HDF5's metadata through the sink, the data through rawio)."""

from __future__ import annotations

import errno
import os
import threading

import h5py
import numpy as np
import pytest

from mpaccel.checkpoint import rawio, storage
from mpaccel.checkpoint import sink as sink_module
from mpaccel.checkpoint.sink import ErrorKeepingFile

pytestmark = pytest.mark.mpi(size=1)

ARRAYS = {
    "model/weight": np.arange(60_000, dtype=np.float32).reshape(300, 200),
    "model/bias": np.linspace(0, 1, 200, dtype=np.float64),
    "optimizer/step": np.array(7, dtype=np.int64),
}


def _write(path):
    """Write ARRAYS as the checkpoint writer does; returns the number of pwrite calls."""
    sink = ErrorKeepingFile(str(path))
    try:
        with h5py.File(sink, "w", libver="latest") as f:
            for key, array in ARRAYS.items():
                ds = f.create_dataset(key, shape=array.shape, dtype=array.dtype)
                ds.write_direct(array)
                ds.attrs["torch_dtype"] = str(array.dtype)
        sink.finish()
    finally:
        sink.close()


def _count_writes(monkeypatch, tmp_path) -> int:
    calls = []
    real = os.pwrite

    def counting(fd, data, offset):
        calls.append(offset)
        return real(fd, data, offset)

    monkeypatch.setattr(sink_module.os, "pwrite", counting)
    _write(tmp_path / "count.h5")
    monkeypatch.setattr(sink_module.os, "pwrite", real)
    return len(calls)


def test_a_file_written_through_the_sink_reads_back_identically(tmp_path):
    _write(tmp_path / "ok.h5")
    with h5py.File(tmp_path / "ok.h5", "r") as f:
        for key, array in ARRAYS.items():
            np.testing.assert_array_equal(f[key][()], array)
            assert f[key].attrs["torch_dtype"] == str(array.dtype)


def test_enospc_at_every_write_is_raised_after_a_clean_close(monkeypatch, tmp_path):
    total = _count_writes(monkeypatch, tmp_path)
    assert total >= 3  # superblock/metadata and the raw data go through separate writes
    real = os.pwrite
    for failing in range(total):
        seen = []

        def full_disk(fd, data, offset, failing=failing, seen=seen):
            seen.append(offset)
            if len(seen) > failing:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(fd, data, offset)

        monkeypatch.setattr(sink_module.os, "pwrite", full_disk)
        path = tmp_path / f"fail-{failing}.h5"
        with pytest.raises(OSError) as info:
            _write(path)
        assert info.value.errno == errno.ENOSPC
        assert str(path) in str(info.value) and "No space left" in str(info.value)
        assert len(seen) == failing + 1  # after the first failure nothing more is attempted
    monkeypatch.setattr(sink_module.os, "pwrite", real)


def test_short_writes_are_completed(monkeypatch, tmp_path):
    real = os.pwrite
    monkeypatch.setattr(
        sink_module.os, "pwrite", lambda fd, data, offset: real(fd, data[:1000], offset)
    )
    _write(tmp_path / "short.h5")
    monkeypatch.setattr(sink_module.os, "pwrite", real)
    with h5py.File(tmp_path / "short.h5", "r") as f:
        np.testing.assert_array_equal(f["model/weight"][()], ARRAYS["model/weight"])


BIG = {**ARRAYS, "model/big": np.arange(300_000, dtype=np.float32)}  # several rawio pieces


def _write_checkpoint_file(path):
    return storage._write_h5(str(path), BIG, {k: str(a.dtype) for k, a in BIG.items()})


def test_checkpoint_files_read_back_identically_with_their_checksums(monkeypatch, tmp_path):
    monkeypatch.setattr(rawio, "PIECE", 64 << 10)
    entries = _write_checkpoint_file(tmp_path / "ok.h5")
    assert not os.path.exists(tmp_path / "ok.h5.partial")
    with h5py.File(tmp_path / "ok.h5", "r") as f:
        for key, array in BIG.items():
            np.testing.assert_array_equal(f[key][()], array)
            assert entries[key]["xxh3"] == storage.checksum(array)


def test_enospc_anywhere_in_a_checkpoint_file_is_one_clean_error(monkeypatch, tmp_path):
    monkeypatch.setattr(rawio, "PIECE", 64 << 10)
    calls = []
    real = os.pwrite

    def counting(fd, data, offset):
        calls.append(offset)
        return real(fd, data, offset)

    monkeypatch.setattr(sink_module.os, "pwrite", counting)
    _write_checkpoint_file(tmp_path / "count.h5")
    total = len(calls)
    assert total >= 6  # HDF5's metadata and several data pieces
    for failing in range(total):
        seen = []
        lock = threading.Lock()

        def full_disk(fd, data, offset, failing=failing, seen=seen, lock=lock):
            with lock:
                seen.append(offset)
                fail = len(seen) > failing
            if fail:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(fd, data, offset)

        monkeypatch.setattr(sink_module.os, "pwrite", full_disk)
        path = tmp_path / f"fail-{failing}.h5"
        with pytest.raises(OSError) as info:
            _write_checkpoint_file(path)
        assert info.value.errno == errno.ENOSPC
        assert f"{path}.partial" in str(info.value) and "No space left" in str(info.value)
        assert not path.exists()  # never renamed into place
    monkeypatch.setattr(sink_module.os, "pwrite", real)


def test_short_checkpoint_writes_are_completed(monkeypatch, tmp_path):
    real = os.pwrite
    monkeypatch.setattr(
        sink_module.os, "pwrite", lambda fd, data, offset: real(fd, data[:1000], offset)
    )
    _write_checkpoint_file(tmp_path / "short.h5")
    monkeypatch.setattr(sink_module.os, "pwrite", real)
    with h5py.File(tmp_path / "short.h5", "r") as f:
        np.testing.assert_array_equal(f["model/big"][()], BIG["model/big"])
