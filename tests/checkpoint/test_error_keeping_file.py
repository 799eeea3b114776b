"""HDF5 writes through ErrorKeepingFile: a write that fails at any point (ENOSPC here) is raised
once, in Python, after HDF5 closed the file; HDF5 itself never sees the error. The same for the
checkpoint writer as a whole (HDF5's metadata through the sink, the data through rawio)."""

from __future__ import annotations

import dataclasses
import errno
import os
import threading

import h5py
import numpy as np
import pytest

from mpaccel.checkpoint import rawio
from mpaccel.checkpoint import reader as reader_module
from mpaccel.checkpoint import writer as writer_module
from mpaccel.checkpoint.index import CheckpointIndex, TensorEntry
from mpaccel.checkpoint.writer import ErrorKeepingFile
from mpaccel.errors import CheckpointError

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


BIG = {**ARRAYS, "model/big": np.arange(300_000, dtype=np.float32)}  # several rawio pieces


def _write_checkpoint_file(path):
    """The checkpoint writer: HDF5's metadata through the sink, the data through rawio.
    Returns the index entries and the file's size."""
    return writer_module.write_h5(str(path), BIG, {k: str(a.dtype) for k, a in BIG.items()})


# (writer, the arrays it writes); rawio's pieces made small so that BIG takes several
WRITERS = {"sink": (_write, ARRAYS), "checkpoint": (_write_checkpoint_file, BIG)}


@pytest.fixture(params=sorted(WRITERS))
def writer(request, monkeypatch):
    monkeypatch.setattr(rawio, "PIECE", 64 << 10)
    return request.param, *WRITERS[request.param]


def test_a_file_written_through_the_sink_reads_back_identically(tmp_path, writer):
    _, write, arrays = writer
    write(tmp_path / "ok.h5")
    assert not os.path.exists(tmp_path / "ok.h5.partial")
    with h5py.File(tmp_path / "ok.h5", "r") as f:
        for key, array in arrays.items():
            np.testing.assert_array_equal(f[key][()], array)
            assert f[key].attrs["torch_dtype"] == str(array.dtype)


def test_checkpoint_entries_hold_the_checksums(monkeypatch, tmp_path):
    monkeypatch.setattr(rawio, "PIECE", 64 << 10)
    entries, size = _write_checkpoint_file(tmp_path / "sums.h5")
    for key, array in BIG.items():
        assert entries[key].xxh3 == writer_module.checksum(array), key
    assert size == os.path.getsize(tmp_path / "sums.h5")
    with h5py.File(tmp_path / "sums.h5", "r") as f:  # the index says where HDF5 put the data
        for key in BIG:  # 0-d ones included: HDF5 writes those itself
            assert entries[key].offset == f[key].id.get_offset(), key


def test_enospc_at_every_write_is_raised_after_a_clean_close(monkeypatch, tmp_path, writer):
    name, write, _ = writer
    calls = []
    real = os.pwrite

    def counting(fd, data, offset):
        calls.append(offset)
        return real(fd, data, offset)

    monkeypatch.setattr(writer_module.os, "pwrite", counting)
    write(tmp_path / "count.h5")
    total = len(calls)
    # superblock/metadata and the raw data go through separate writes (several pieces for BIG)
    assert total >= (3 if name == "sink" else 6)
    for failing in range(total):
        seen = []
        lock = threading.Lock()

        def full_disk(fd, data, offset, failing=failing, seen=seen, lock=lock):
            with lock:  # the checkpoint writer writes data on several threads
                seen.append(offset)
                fail = len(seen) > failing
            if fail:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(fd, data, offset)

        monkeypatch.setattr(writer_module.os, "pwrite", full_disk)
        path = tmp_path / f"fail-{failing}.h5"
        with pytest.raises(OSError) as info:
            write(path)
        assert info.value.errno == errno.ENOSPC
        assert str(path) in str(info.value) and "No space left" in str(info.value)
        if name == "sink":
            assert len(seen) == failing + 1  # after the first failure nothing more is attempted
        else:
            assert not path.exists()  # never renamed into place
    monkeypatch.setattr(writer_module.os, "pwrite", real)


def test_short_writes_are_completed(monkeypatch, tmp_path, writer):
    _, write, arrays = writer
    real = os.pwrite
    monkeypatch.setattr(
        writer_module.os, "pwrite", lambda fd, data, offset: real(fd, data[:1000], offset)
    )
    write(tmp_path / "short.h5")
    monkeypatch.setattr(writer_module.os, "pwrite", real)
    with h5py.File(tmp_path / "short.h5", "r") as f:
        for key, array in arrays.items():
            np.testing.assert_array_equal(f[key][()], array)


def _reader_for(path, entries, size=None):
    """A CheckpointReader over one file written by _write_checkpoint_file, without an index
    file. With the file's `size` the index vouches for the entries' offsets (reads at them,
    without HDF5); without, everything goes through h5py's metadata, as for a file whose size
    is not the one the index recorded."""
    reader = reader_module.CheckpointReader.__new__(reader_module.CheckpointReader)
    reader.directory, reader.stem, reader.node_share = str(path.parent), "t", (0, 1)
    sizes = {} if size is None else {path.name: size}
    reader.index = CheckpointIndex(format_version=1, world_size=1, metadata={}, components={},
                                   tensors=entries, shards=(), per_rank=(), file_sizes=sizes,
                                   sliced={})
    reader._ordinal = {key: i for i, key in enumerate(sorted(entries))}
    reader._reset_files()
    return reader


@pytest.fixture(params=["at the index's offsets", "through HDF5"])
def vouched(request):
    """Read tests run both ways: the index vouches for the offsets, or it does not."""
    return request.param == "at the index's offsets"


def test_reads_fill_given_arrays_in_place_piece_by_piece(monkeypatch, tmp_path, vouched):
    monkeypatch.setattr(rawio, "PIECE", 64 << 10)
    path = tmp_path / "read.h5"
    entries, size = _write_checkpoint_file(path)
    destinations = {key: np.zeros_like(array) for key, array in BIG.items()}
    events, real_read, real_file = [], rawio.read_arrays, reader_module.CheckpointReader._file

    def reading(tasks, *args, **kwargs):
        events.append(sorted(t.key for t in tasks))
        return real_read(tasks, *args, **kwargs)

    def opening(self, name):
        events.append("hdf5")
        return real_file(self, name)

    monkeypatch.setattr(rawio, "read_arrays", reading)
    monkeypatch.setattr(reader_module.CheckpointReader, "_file", opening)
    with _reader_for(path, entries, size if vouched else None) as reader:
        got = reader.read_arrays(
            [(key, entries[key], destinations[key], True) for key in BIG]
            + [("model/weight", entries["model/weight"], np.zeros(3), True)]  # wrong shape: new
        )
    if vouched:  # HDF5 is not even opened: its metadata reads are small reads all over the
        # file, each a wait on the disk before the data streams
        assert [set(e) for e in events] == [set(BIG)]
    else:
        assert events[0] == "hdf5" and set(events[-1]) == set(BIG)
    for key, array in BIG.items():
        np.testing.assert_array_equal(got[key], array)
    for key in BIG:
        if key != "model/weight":
            assert got[key] is destinations[key], key


def test_a_file_of_another_size_than_the_index_says_is_read_through_hdf5(tmp_path):
    """h5repack and friends move the data: the recorded offsets are no longer trusted."""
    path = tmp_path / "moved.h5"
    entries, size = _write_checkpoint_file(path)
    with h5py.File(path, "a") as f:  # another tool adds to the file
        f.create_dataset("extra", data=np.arange(1000.0))
    assert os.path.getsize(path) != size
    with _reader_for(path, entries, size) as reader:
        got = reader.read_arrays([(key, entries[key], None, True) for key in BIG])
        assert "model/big" in reader._files[path.name]  # HDF5 told where the data is
    for key, array in BIG.items():
        np.testing.assert_array_equal(got[key], array)


def test_verify_reports_an_offset_that_hdf5_contradicts(tmp_path):
    path = tmp_path / "lie.h5"
    entries, size = _write_checkpoint_file(path)
    big = entries["model/big"]
    entries["model/big"] = dataclasses.replace(big, offset=big.offset + 8)
    with _reader_for(path, entries, size) as reader:
        problems = reader.verify()
    assert len(problems) == 1 and "HDF5 has 'model/big' at offset" in problems[0], problems


def test_a_corrupted_piece_and_a_truncated_file_are_named_errors(monkeypatch, tmp_path, vouched):
    monkeypatch.setattr(rawio, "PIECE", 64 << 10)
    path = tmp_path / "bad.h5"
    entries, size = _write_checkpoint_file(path)
    size = size if vouched else None
    with h5py.File(path, "r") as f:
        offset = f["model/big"].id.get_offset()
    with open(path, "r+b") as raw:  # one byte in the third piece of model/big
        raw.seek(offset + 2 * (64 << 10) + 5)
        byte = raw.read(1)
        raw.seek(offset + 2 * (64 << 10) + 5)
        raw.write(bytes([byte[0] ^ 1]))
    with _reader_for(path, entries, size) as reader:
        with pytest.raises(CheckpointError, match="checksum mismatch for 'model/big'"):
            reader.read_array("model/big", entries["model/big"])
        np.testing.assert_array_equal(  # unverified, the other tensors read fine
            reader.read_array("model/weight", entries["model/weight"]), BIG["model/weight"]
        )
    with _reader_for(path, entries, size) as reader:
        reader.read_array("model/weight", entries["model/weight"])  # the file is open now
        os.truncate(path, offset + 100_000)  # and then shrinks under the reader
        with pytest.raises(CheckpointError, match=r"model/big.*truncated") as info:
            reader.read_array("model/big", entries["model/big"])
        assert str(path) in str(info.value)
    with pytest.raises(CheckpointError, match="cannot open checkpoint file"):
        with _reader_for(path, entries, size) as reader:  # HDF5 itself sees it at open
            reader.read_array("model/big", entries["model/big"])


def test_a_destination_that_cannot_take_the_bytes_gets_a_new_array(tmp_path, vouched):
    path = tmp_path / "dest.h5"
    entries, size = _write_checkpoint_file(path)
    weight = entries["model/weight"]
    strided = np.zeros((200, 300), dtype=np.float32).T  # right shape, not C-contiguous
    frozen = np.zeros((300, 200), dtype=np.float32)
    frozen.flags.writeable = False
    with _reader_for(path, entries, size if vouched else None) as reader:
        for dest in (strided, frozen, np.zeros((300, 200), dtype=np.float64)):
            got = reader.read_arrays([("model/weight", weight, dest, True)])["model/weight"]
            assert got is not dest
            np.testing.assert_array_equal(got, BIG["model/weight"])
    assert not strided.any() and not frozen.any()


def test_deferred_reads_check_the_file_and_leave_the_destinations_alone(
    monkeypatch, tmp_path, vouched
):
    """read_arrays(defer=...): destinations taken in place are not written, their bytes are
    verified in the file (a corrupted one is an error, the destination untouched); fill()
    reads them in afterwards, checked again (a file changed in between is an error)."""
    monkeypatch.setattr(rawio, "PIECE", 64 << 10)
    monkeypatch.setattr(rawio, "STREAM_PIECE", 48 << 10)  # several pieces, not aligned to PIECE
    path = tmp_path / "deferred.h5"
    entries, size = _write_checkpoint_file(path)
    size = size if vouched else None
    keys = sorted(BIG)

    def destinations():
        return {key: np.full_like(BIG[key], 7) for key in keys}

    with _reader_for(path, entries, size) as reader:
        held, dest = reader_module.Deferred(), destinations()
        got = reader.read_arrays([(k, entries[k], dest[k], True) for k in keys], defer=held)
        for key in keys:
            assert got[key] is dest[key] and (dest[key] == 7).all(), key
        reader.fill(held)
        for key in keys:
            np.testing.assert_array_equal(dest[key], BIG[key])
    with h5py.File(path, "r") as f:
        offset = f["model/big"].id.get_offset()
    with open(path, "r+b") as raw:  # one byte in the middle of model/big
        raw.seek(offset + (500 << 10))
        byte = raw.read(1)
        raw.seek(offset + (500 << 10))
        raw.write(bytes([byte[0] ^ 1]))
    with _reader_for(path, entries, size) as reader:
        held, dest = reader_module.Deferred(), destinations()
        with pytest.raises(CheckpointError, match="checksum mismatch for 'model/big'"):
            reader.read_arrays([(k, entries[k], dest[k], True) for k in keys], defer=held)
        assert all((dest[key] == 7).all() for key in keys)
    with open(path, "r+b") as raw:  # repaired; checked; then changed again before the fill
        raw.seek(offset + (500 << 10))
        raw.write(byte)
    with _reader_for(path, entries, size) as reader:
        held, dest = reader_module.Deferred(), destinations()
        reader.read_arrays([(k, entries[k], dest[k], True) for k in keys], defer=held)
        with open(path, "r+b") as raw:
            raw.seek(offset + (500 << 10))
            raw.write(bytes([byte[0] ^ 1]))
        with pytest.raises(CheckpointError, match="checksum mismatch for 'model/big'"):
            reader.fill(held)


# A write lease (fcntl F_SETLEASE) held by another process: opening the file blocks in the
# kernel until the lease is given up, or /proc/sys/fs/lease-break-time (45 s) runs out.
LEASE_HOLDER = """
import fcntl, os, signal, sys
signal.signal(signal.SIGIO, signal.SIG_IGN)
fd = os.open(sys.argv[1], os.O_WRONLY)
fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
print("leased", flush=True)
sys.stdin.read()
"""

GIVEN_UP = """
import sys
from mpaccel.checkpoint import rawio, reader
from mpaccel.checkpoint.index import CheckpointIndex, TensorEntry
from mpaccel.errors import StalledIOError
entries = {"model/big": TensorEntry(sys.argv[2], "float32", (300000,), 1200000, "0",
                                    int(sys.argv[3]))}
r = reader.CheckpointReader.__new__(reader.CheckpointReader)
r.directory, r.stem, r.node_share = sys.argv[1], "t", (0, 1)
r.index = CheckpointIndex(format_version=1, world_size=1, metadata={}, components={},
                          tensors=entries, shards=(), per_rank=(),
                          file_sizes={sys.argv[2]: int(sys.argv[4])}, sliced={})
r._reset_files()
try:
    rawio.within(1.0, "reading", lambda: r.read_arrays([("model/big", entries["model/big"],
                                                        None, True)]))
except StalledIOError as exc:
    print(exc.message, flush=True)
"""


def test_io_that_stops_answering_is_given_up_named_and_left_behind(tmp_path):
    """A read whose open() blocks in the kernel (the file is leased by another process):
    within() gives up after its limit, naming the file, and the process can still exit (the
    thread left blocked is a daemon)."""
    import subprocess
    import sys

    path = tmp_path / "leased.h5"
    entries, size = _write_checkpoint_file(path)
    holder = subprocess.Popen([sys.executable, "-c", LEASE_HOLDER, str(path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "leased"
        run = subprocess.run(
            [sys.executable, "-c", GIVEN_UP, str(tmp_path), path.name,
             str(entries["model/big"].offset), str(size)],
            capture_output=True, text=True, timeout=30,
        )
        assert holder.poll() is None, "the lease was given up before the reader ended"
    finally:
        holder.stdin.close()
        holder.wait(30)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("reading: no checkpoint I/O of this process ended for 1 s "
                                 f"(under way: opening {str(path)!r})"), run.stdout


def test_uninitialized_lazy_parameters_are_not_read_into():
    import torch

    from mpaccel.checkpoint import reader

    lazy = torch.nn.LazyLinear(4)
    entry = TensorEntry("w.h5", "float32", (4, 3), 48, "0" * 16, 0)
    assert reader.writable_view(lazy.weight, entry) is None
    assert reader.writable_view(torch.zeros(3, 4).t(), entry) is None  # not contiguous
    assert reader.writable_view(torch.zeros(4, 3), entry) is not None


# -- reading behind another reader (the non-first ranks of a node in a collective load) ---------

needs_nowait = pytest.mark.skipif(
    not hasattr(os, "RWF_NOWAIT"), reason="preadv2 with RWF_NOWAIT is Linux-only"
)


@pytest.fixture
def cold_file(tmp_path):
    """32 MiB of random bytes, fsynced and dropped from the page cache; (path, bytes)."""
    data = np.random.default_rng(5).integers(0, 256, 32 << 20, dtype=np.uint8).tobytes()
    path = tmp_path / "cold.bin"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if hasattr(os, "RWF_NOWAIT"):
            try:  # the last page: is it really out of the page cache?
                os.preadv(fd, [bytearray(4096)], len(data) - 4096, os.RWF_NOWAIT)
                pytest.skip("this file system keeps the file in memory (POSIX_FADV_DONTNEED)")
            except BlockingIOError:
                pass
    finally:
        os.close(fd)
    return path, data


class _Sleeps:
    def __init__(self):
        self.count = 0
        self.first = threading.Event()

    def sleep(self, seconds):
        self.count += 1
        self.first.set()
        threading.Event().wait(seconds)


@needs_nowait
def test_a_following_read_copies_from_the_page_cache_and_sleeps_instead_of_reading(
    monkeypatch, cold_file
):
    path, data = cold_file
    monkeypatch.setattr(rawio, "FOLLOW_PATIENCE", 60.0)  # never give up on the leader here
    sleeps = _Sleeps()
    monkeypatch.setattr(rawio, "time", sleeps)
    blocking = []
    real = rawio.preadv_all
    monkeypatch.setattr(
        rawio, "preadv_all", lambda fd, view, off: blocking.append(len(view)) or real(fd, view, off)
    )
    out = bytearray(len(data))
    fd = os.open(path, os.O_RDONLY)
    try:
        got = []
        follower = threading.Thread(
            target=lambda: got.append(rawio.preadv_following(fd, memoryview(out), 0))
        )
        follower.start()
        # the file is cold: the follower finds nothing to copy and sleeps (however late the
        # thread starts), and only then the node's first rank reads the disk
        assert sleeps.first.wait(30), "the follower never slept"
        with open(path, "rb", buffering=0) as leader:
            while leader.read(1 << 20):
                pass
        follower.join(30)
        assert not follower.is_alive()
    finally:
        os.close(fd)
    assert got == [len(data)] and out == data
    assert not any(blocking), f"the follower read from the disk itself: {blocking}"


def _failing_nowait_reads(monkeypatch, error):
    """os.preadv raising `error` for RWF_NOWAIT reads (others go through); returns the offsets
    of the RWF_NOWAIT reads tried."""
    real, tried = os.preadv, []

    def preadv(fd, buffers, offset, flags=0):
        if flags & os.RWF_NOWAIT:
            tried.append(offset)
            raise error
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    return tried


@needs_nowait
def test_a_following_read_with_nobody_ahead_reads_the_disk_after_its_patience(
    monkeypatch, cold_file
):
    path, data = cold_file
    monkeypatch.setattr(rawio, "FOLLOW_PATIENCE", 0.02)
    attempts = _failing_nowait_reads(monkeypatch, BlockingIOError(errno.EAGAIN, "would block"))
    out = bytearray(len(data) + 100)  # longer than the file: the count says where it ended
    fd = os.open(path, os.O_RDONLY)
    try:
        assert rawio.preadv_following(fd, memoryview(out), 0) == len(data)
    finally:
        os.close(fd)
    assert out[: len(data)] == data
    assert len(attempts) >= 2 and set(attempts) == {0}


@needs_nowait
def test_where_buffered_nowait_reads_are_refused_following_reads_are_plain_reads(
    monkeypatch, tmp_path
):
    monkeypatch.setattr(rawio, "_nowait_reads", True)
    refused = _failing_nowait_reads(monkeypatch, OSError(errno.EOPNOTSUPP, "Not supported"))
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(256)) * 1000)
    fd = os.open(path, os.O_RDONLY)
    try:
        for offset in (0, 1000):
            out = bytearray(50_000)
            assert rawio.preadv_following(fd, memoryview(out), offset) == 50_000
            assert out == path.read_bytes()[offset : offset + 50_000]
    finally:
        os.close(fd)
    assert refused == [0], "tried once, then never again"
    assert rawio._nowait_reads is False


@needs_nowait
def test_a_cold_read_from_a_local_disk_takes_one_thread_a_cached_one_several(
    monkeypatch, cold_file
):
    path, data = cold_file
    monkeypatch.setattr(rawio, "io_threads", lambda: 3)
    used = []
    real_run_all = rawio._run_all

    def run_all(threads, *args):
        used.append(threads)
        return real_run_all(threads, *args)

    monkeypatch.setattr(rawio, "_run_all", run_all)
    fd = os.open(path, os.O_RDONLY)
    try:
        out = np.empty(len(data), dtype=np.uint8)
        tasks = [rawio.ReadTask("cold", str(path), fd, 0, out, None)]
        # said explicitly: io_threads() (which reads the variable; replaced here) decides, and
        # nothing is probed (a probe may start the kernel's readahead: the file would not be
        # cold any more)
        monkeypatch.setenv("MPACCEL_IO_THREADS", "2")
        assert rawio.read_threads(tasks) == 3
        monkeypatch.delenv("MPACCEL_IO_THREADS")
        rawio.read_arrays(tasks, lambda task, exc: exc)
        assert out.tobytes() == data
        # the readers' threads
        assert used[-1] == (1 if rawio._on_local_disk(fd) else 3)
        assert rawio.read_threads(tasks) == 3  # now it is in the page cache
    finally:
        os.close(fd)


def _entry(file: str, offset: int | None, nbytes: int) -> TensorEntry:
    return TensorEntry(file, "uint8", (nbytes,), nbytes, "0" * 16, offset)


def test_checksum_owners_split_bytes_not_tensors():
    # One large matrix first in the file, then many small vectors: by count, the reader owning
    # the matrix would hash ~all of the bytes; by bytes, the shares are even within a tensor.
    entries = {"a/big": _entry("s0.h5", 0, 600)}
    entries.update({f"b/v{i:02d}": _entry("s0.h5", 600 + 20 * i, 20) for i in range(30)})
    entries["c/next"] = _entry("s1.h5", 0, 400)
    total = sum(e.nbytes for e in entries.values())
    for count in (1, 2, 3, 4):
        owners = reader_module.checksum_owners(entries, count)
        assert set(owners) == set(entries) and set(owners.values()) <= set(range(count))
        order = sorted(entries, key=lambda k: (entries[k].file, entries[k].offset))
        assert [owners[k] for k in order] == sorted(owners[k] for k in order)  # runs
        shares = [sum(e.nbytes for k, e in entries.items() if owners[k] == r)
                  for r in range(count)]
        assert all(abs(share - total / count) <= 600 for share in shares), shares
    assert reader_module.checksum_owners(entries, 2)["a/big"] == 0
    assert reader_module.checksum_owners(entries, 2)["c/next"] == 1
    empty = {"x": _entry("s0.h5", None, 0)}
    assert reader_module.checksum_owners(empty, 4) == {"x": 0}
