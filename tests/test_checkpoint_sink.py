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


def _reader_for(path, entries):
    """A CheckpointReader over one file written by _write_checkpoint_file, without an index."""
    reader = storage.CheckpointReader.__new__(storage.CheckpointReader)
    reader.directory, reader.stem, reader.verify_share = str(path.parent), "t", (0, 1)
    reader.index = {"tensors": entries, "per_rank": [], "components": {}}
    reader._ordinal = {key: i for i, key in enumerate(sorted(entries))}
    reader._files = {}
    return reader


def test_reads_fill_given_arrays_in_place_piece_by_piece(monkeypatch, tmp_path):
    monkeypatch.setattr(rawio, "PIECE", 64 << 10)
    path = tmp_path / "read.h5"
    entries = _write_checkpoint_file(path)
    destinations = {key: np.zeros_like(array) for key, array in BIG.items()}
    with _reader_for(path, entries) as reader:
        got = reader.read_arrays(
            [(key, entries[key], destinations[key], True) for key in BIG]
            + [("model/weight", entries["model/weight"], np.zeros(3), True)]  # wrong shape: new
        )
    for key, array in BIG.items():
        np.testing.assert_array_equal(got[key], array)
    for key in BIG:
        if key != "model/weight":
            assert got[key] is destinations[key], key


def test_a_corrupted_piece_and_a_truncated_file_are_named_errors(monkeypatch, tmp_path):
    monkeypatch.setattr(rawio, "PIECE", 64 << 10)
    path = tmp_path / "bad.h5"
    entries = _write_checkpoint_file(path)
    with h5py.File(path, "r") as f:
        offset = f["model/big"].id.get_offset()
    with open(path, "r+b") as raw:  # one byte in the third piece of model/big
        raw.seek(offset + 2 * (64 << 10) + 5)
        byte = raw.read(1)
        raw.seek(offset + 2 * (64 << 10) + 5)
        raw.write(bytes([byte[0] ^ 1]))
    with _reader_for(path, entries) as reader:
        with pytest.raises(storage.CheckpointError, match="checksum mismatch for 'model/big'"):
            reader.read_array("model/big", entries["model/big"])
        np.testing.assert_array_equal(  # unverified, the other tensors read fine
            reader.read_array("model/weight", entries["model/weight"]), BIG["model/weight"]
        )
    with _reader_for(path, entries) as reader:
        reader.read_array("model/weight", entries["model/weight"])  # the file is open now
        os.truncate(path, offset + 100_000)  # and then shrinks under the reader
        with pytest.raises(storage.CheckpointError, match=r"model/big.*truncated") as info:
            reader.read_array("model/big", entries["model/big"])
        assert str(path) in str(info.value)
    with pytest.raises(storage.CheckpointError, match="cannot open checkpoint file"):
        with _reader_for(path, entries) as reader:  # HDF5 itself sees it at open
            reader.read_array("model/big", entries["model/big"])


def test_a_destination_that_cannot_take_the_bytes_gets_a_new_array(tmp_path):
    path = tmp_path / "dest.h5"
    entries = _write_checkpoint_file(path)
    weight = entries["model/weight"]
    strided = np.zeros((200, 300), dtype=np.float32).T  # right shape, not C-contiguous
    frozen = np.zeros((300, 200), dtype=np.float32)
    frozen.flags.writeable = False
    with _reader_for(path, entries) as reader:
        for dest in (strided, frozen, np.zeros((300, 200), dtype=np.float64)):
            got = reader.read_arrays([("model/weight", weight, dest, True)])["model/weight"]
            assert got is not dest
            np.testing.assert_array_equal(got, BIG["model/weight"])
    assert not strided.any() and not frozen.any()


def test_uninitialized_lazy_parameters_are_not_read_into():
    import torch

    lazy = torch.nn.LazyLinear(4)
    entry = {"dtype": "float32", "shape": [4, 3]}
    assert storage._writable_view(lazy.weight, entry) is None
    assert storage._writable_view(torch.zeros(3, 4).t(), entry) is None  # not contiguous
    assert storage._writable_view(torch.zeros(4, 3), entry) is not None
