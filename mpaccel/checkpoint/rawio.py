"""Moving tensor bytes between memory and the data regions of checkpoint HDF5 files.

HDF5 lays the file out (superblock, object headers, one contiguous, early-allocated extent per
dataset) and mpaccel moves the bytes itself, with plain pwrite/preadv at the extents' offsets:

- Writes run on a few threads in 64 MiB pieces, and after each piece the kernel is told to start
  writing it back (sync_file_range WRITE on Linux). The disk is busy while the next piece is
  copied into the page cache, so the final fsync waits for the tail only. On this machine's
  disk that beats dd conv=fdatasync itself (which writes, then waits), and the earlier
  write-through-HDF5-then-fsync by 1.4x (figures in docs/benchmarks.md).
- Reads run in file order straight into their destination (an existing tensor when there is
  one: no fresh memory, no second copy), on the process's share of the node's cores (a
  WILLNEED prefetcher running ahead of them was measured and was slower). Checksums are computed
  on a thread of their own as tensors complete, so the readers keep the disk busy. When the
  ranks of a node all read the same bytes (a collective load), only the first waits on the
  disk; the others copy from the page cache behind it (preadv_following).

The files stay ordinary HDF5: h5py, h5ls and h5dump read them like any other.

Every thread here is a daemon, and a phase of I/O can be run under within(): a file system that
stops answering (a hung network mount) then ends the phase with an error after a deadline, and the
thread stuck in the kernel is left behind without keeping the interpreter from exiting. The
deadline (within(), Watch, stall_limit) lives here too: every phase of checkpoint I/O runs
under it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from .. import envvars
from ..errors import StalledIOError

T = TypeVar("T")

PIECE = 64 << 20  # bytes per pwrite/preadv call and per writeback request
WRITEBACK_MIN = 1 << 20  # smaller pieces are left to the kernel's own writeback (merged)
FOLLOW_POLL = 0.002  # seconds a following reader sleeps once it has caught up with the cache
FOLLOW_PATIENCE = 0.05  # ... and after this long without progress it reads from the disk itself


def io_threads() -> int:
    """Threads per process for checkpoint data I/O: MPACCEL_IO_THREADS, else this process's
    share of the node's cores as torch uses it (mpaccel sets torch's threads to cores / ranks
    per node), at most 4. Measured here: 2 threads at 1 rank per 2 cores, 1 thread at 4."""
    threads = envvars.get_int("io_threads")  # the table takes 1 to 1024
    if threads is None:
        return max(1, min(4, torch.get_num_threads()))
    return threads


@functools.cache
def _writeback_starter() -> Callable[[int, int, int], None]:
    """sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE) from the C library on Linux,
    else a no-op. Asynchronous; errors surface in the final fsync.

    libc is opened by name, on first use: ctypes.CDLL(None) (the whole process's symbols) at
    import time broke MPI_Init under srun --mpi=pmi2 with UCX (shared-memory error, then hang)."""
    function = None
    if sys.platform.startswith("linux"):
        for name in ("libc.so.6", "libc.so"):
            try:
                function = ctypes.CDLL(name, use_errno=True).sync_file_range
                break
            except (OSError, AttributeError):
                continue
    if function is None:
        return lambda fd, offset, nbytes: None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    write = 2  # SYNC_FILE_RANGE_WRITE

    def start(fd: int, offset: int, nbytes: int) -> None:
        function(fd, offset, nbytes, write)  # ctypes releases the GIL around the call

    return start


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    _writeback_starter()(fd, offset, nbytes)


def byte_view(array: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array (0-d included), writable if the array is."""
    return array.reshape(-1).data.cast("B")


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):  # pwrite may write less than asked
        done += os.pwrite(fd, view[done:], offset + done)


def preadv_all(fd: int, view: memoryview, offset: int) -> int:
    """Fill `view` from `offset`; returns the bytes read (fewer only at the end of the file)."""
    done = 0
    while done < len(view):
        count = os.preadv(fd, [view[done:]], offset + done)
        if count == 0:
            break
        done += count
    return done


_nowait_reads = hasattr(os, "RWF_NOWAIT")  # cleared once the kernel refuses buffered NOWAIT


def _preadv_nowait(fd: int, view: memoryview, offset: int) -> int | None:
    """preadv2 with RWF_NOWAIT: the bytes copied from the page cache (0 at end of file), -1
    where the first of them is not cached, None where the kernel refuses such reads (then it is
    not asked again)."""
    global _nowait_reads
    if not _nowait_reads:
        return None
    try:
        return os.preadv(fd, [view], offset, os.RWF_NOWAIT)
    except BlockingIOError:
        return -1
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        _nowait_reads = False
        return None


def preadv_following(fd: int, view: memoryview, offset: int) -> int:
    """preadv_all for a process that trails another one reading the same bytes of the same file
    on this node (the node's first rank, during a collective load): copy only what is already in
    the page cache (preadv2 with RWF_NOWAIT), and sleep when caught up, rather than wait on the
    disk. One process then drives the disk, the others copy behind it and sleep, rather than all
    of them queuing on the same pages and waking at once to copy them (figures in
    docs/benchmarks.md).

    After FOLLOW_PATIENCE without progress (nobody else is reading these bytes) it reads the rest
    of `view` with a blocking read. Where buffered RWF_NOWAIT reads are not supported (not Linux,
    old kernels, some file systems) it is preadv_all."""
    done = 0
    waited = 0.0
    while done < len(view):
        count = _preadv_nowait(fd, view[done:], offset + done)
        if count is None:
            break
        if count == 0:
            return done  # end of file
        if count > 0:
            done += count
            waited = 0.0
        elif waited >= FOLLOW_PATIENCE:
            break
        else:
            time.sleep(FOLLOW_POLL)
            waited += FOLLOW_POLL
    return done + preadv_all(fd, view[done:], offset + done)


def _on_local_disk(fd: int) -> bool:
    """The file lives on a block device of this machine (ext4, xfs... on a disk), not on a
    network or parallel file system (NFS, Lustre, GPFS have no block device of their own). File
    systems that report no device of their own (btrfs, overlayfs) count as not local: their
    reads keep io_threads(), as before this distinction was made."""
    dev = os.fstat(fd).st_dev
    return os.path.exists(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")


def _cached(fd: int, offset: int) -> bool | None:
    """Is the byte at `offset` in the page cache? None where the kernel cannot tell. A miss
    may start the kernel's readahead there, which the read that follows wants anyway."""
    try:
        count = _preadv_nowait(fd, memoryview(bytearray(1)), offset)
    except OSError:
        return None
    return None if count is None else count == 1


def read_threads(tasks: Sequence[ReadTask]) -> int:
    """Threads to read `tasks` (in file order) with: MPACCEL_IO_THREADS where set, and
    io_threads() where copying from the page cache is the work; one where a local disk is. A
    disk streams best to one sequential reader, which leaves the other cores to the checksums
    (docs/benchmarks.md, "Since 49583d9 a process reads with one thread"). Network and parallel
    file systems keep io_threads(): they want several requests in flight."""
    if not tasks or envvars.get_int("io_threads") is not None:
        return io_threads()
    first, last = tasks[0], tasks[-1]
    if _cached(first.fd, first.offset) is False or _cached(last.fd, last.offset) is False:
        return 1 if _on_local_disk(first.fd) else io_threads()
    return io_threads()


def _pieces(nbytes: int) -> list[tuple[int, int]]:
    return [(start, min(PIECE, nbytes - start)) for start in range(0, nbytes, PIECE)]


# -- threads ----------------------------------------------------------------------------------


class _FirstError:
    """The first exception raised by any worker; the others stop at their next piece."""

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self._lock = threading.Lock()

    def keep(self, error: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = error

    def raise_if_any(self) -> None:
        if self.error is not None:
            raise self.error


_END = object()


def _run_all(
    threads: int, name: str, work: Callable[[Any], None], items: Iterable, failed: _FirstError
) -> None:
    """work(item) for every item, taken in order by `threads` daemon threads (work keeps its
    errors in `failed`); returns once they are done. Interrupted (Ctrl-C, or any exception
    here), the items not started are dropped and the running ones stop at their next piece.
    Daemons: a thread that a hung file system holds in the kernel must not keep the interpreter
    from exiting once within() gave up on it (a pool's threads are joined at exit)."""
    pending = iter(items)
    lock = threading.Lock()

    def run() -> None:
        while failed.error is None:
            with lock:
                item = next(pending, _END)
            if item is _END:
                return
            work(item)

    workers = [
        threading.Thread(target=run, name=f"{name}-{i}", daemon=True) for i in range(threads)
    ]
    for worker in workers:
        worker.start()
    try:
        for worker in workers:
            worker.join()
    except BaseException as exc:
        failed.keep(exc)
        raise


def write_arrays(
    fd: int,
    path: str,
    regions: Sequence[tuple[str, int, np.ndarray]],
    digest: Callable[[np.ndarray], str],
    threads: int | None = None,
) -> dict[str, str]:
    """Write each (key, offset, array) at its offset of `fd`, fsync, and return {key: digest}.

    Raises OSError naming `path` and the key being written (ENOSPC, EIO...)."""
    threads = threads or io_threads()
    failed = _FirstError()
    watch = current_watch()

    def put(task: tuple[str, int, np.ndarray, int, int]) -> None:
        key, offset, array, start, size = task
        if failed.error is not None or watch.cancelled:
            return
        try:
            with watch.doing(f"writing {path!r}"):
                pwrite_all(fd, byte_view(array)[start : start + size], offset + start)
                if size >= WRITEBACK_MIN:
                    start_writeback(fd, offset + start, size)
        except OSError as exc:
            failed.keep(OSError(exc.errno, f"{exc.strerror} (writing {key!r})", path))
        except Exception as exc:
            failed.keep(exc)

    tasks = [
        (key, offset, array, start, size)
        for key, offset, array in regions
        for start, size in _pieces(array.nbytes)
    ]
    _run_all(threads, "mpaccel-write", put, tasks, failed)
    failed.raise_if_any()
    watch.check()

    def sync() -> None:
        try:
            with watch.doing(f"syncing {path!r}"):
                os.fsync(fd)
        except OSError as exc:
            failed.keep(OSError(exc.errno, exc.strerror, path))

    # checksums while the tail of the data goes to the disk
    syncing = threading.Thread(target=sync, name="mpaccel-fsync", daemon=True)
    syncing.start()
    digests: dict[str, str] = {}

    def hash_one(region: tuple[str, int, np.ndarray]) -> None:
        try:
            digests[region[0]] = digest(region[2])
        except Exception as exc:
            failed.keep(exc)

    _run_all(max(1, threads - 1), "mpaccel-digest", hash_one, regions, failed)
    syncing.join()
    failed.raise_if_any()
    return {key: digests[key] for key, _, _ in regions}


def page_cache_room() -> int | None:
    """Bytes the kernel says it could give without swapping (MemAvailable: free memory and the
    page cache it can reclaim), None where it does not say (not Linux)."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class ReadTask:
    """One tensor to read from (fd, offset). Into `out` (C-contiguous, writable, not empty):
    `check(out)` runs once it is complete (checksum, may raise). Or, with `out` None, only
    checked: its `nbytes` bytes stream through a small buffer into `digest()` (a new hasher:
    xxh3, or anything with update() and hexdigest()), and `check(hexdigest())` runs at the
    end; nothing else is written."""

    __slots__ = (
        "_left", "_lock", "check", "digest", "fd", "key", "nbytes", "offset", "out", "path"
    )

    def __init__(
        self,
        key: str,
        path: str,
        fd: int,
        offset: int,
        out: np.ndarray | None,
        check: Any,
        nbytes: int = 0,
        digest: Callable[[], Any] | None = None,
    ) -> None:
        self.key, self.path, self.fd, self.offset, self.out = key, path, fd, offset, out
        self.check, self.digest = check, digest
        self.nbytes = out.nbytes if out is not None else nbytes
        self._left = len(_pieces(self.nbytes)) if out is not None else 1
        self._lock = threading.Lock()

    def piece_done(self) -> bool:
        with self._lock:
            self._left -= 1
            return self._left == 0


STREAM_PIECE = 8 << 20  # bytes per read of a tensor that is only checked (a reused buffer)


def read_arrays(
    tasks: Sequence[ReadTask],
    error: Callable[[ReadTask, BaseException], BaseException],
    threads: int | None = None,
    follow: bool = False,
) -> None:
    """Fill every task's (non-empty) array, pieces on `threads` threads in file order, and run
    its check on a thread of its own once it is complete. A failed read stops the others; a failed
    check does not (every array is filled with the file's bytes, whatever the checks find).
    Tasks that are only checked (`out` None) are streamed whole by one thread each, in their
    place in file order. The first failure, turned into an exception by `error(task, exc)`, is
    raised at the end. `follow`: another process of this node is reading the same bytes now
    (preadv_following; not for tasks only checked)."""
    read = preadv_following if follow else preadv_all
    watch = current_watch()
    watch.check()
    failed, rejected = _FirstError(), _FirstError()
    ordered = sorted(tasks, key=lambda t: (t.path, t.offset))
    threads = threads or read_threads(ordered)
    pieces = [
        (t, start, size)
        for t in ordered
        for start, size in (_pieces(t.nbytes) if t.out is not None else [(0, t.nbytes)])
    ]
    checks: queue.SimpleQueue = queue.SimpleQueue()
    buffers = threading.local()  # one streaming buffer per reader thread

    def read_piece(task: ReadTask, view: memoryview, offset: int) -> None:
        with watch.doing(f"reading {task.path!r}"):
            # a checked-only task is this process's share of the node's checks: nobody else
            # reads those bytes now, there is no one to follow
            count = (read if task.out is not None else preadv_all)(task.fd, view, offset)
        if count < len(view):
            raise OSError(f"the file ends before the data of {task.key!r} (truncated)")

    def stream(task: ReadTask) -> Any:
        """The task's bytes, through this thread's buffer, into a hasher: its hexdigest()
        (None when stopped early)."""
        if getattr(buffers, "view", None) is None:
            buffers.view = memoryview(bytearray(STREAM_PIECE))
        assert task.digest is not None
        hasher = task.digest()
        for start, size in [(s, min(STREAM_PIECE, task.nbytes - s))
                            for s in range(0, task.nbytes, STREAM_PIECE)]:
            if failed.error is not None or watch.cancelled:
                return None
            view = buffers.view[:size]
            read_piece(task, view, task.offset + start)
            hasher.update(view)
        return hasher.hexdigest()

    def get(item: tuple[ReadTask, int, int]) -> None:
        task, start, size = item
        if failed.error is not None or watch.cancelled:
            return
        try:
            if task.out is None:
                digest = stream(task)
                if digest is not None and task.check is not None:
                    checks.put((task, digest))
                return
            read_piece(task, byte_view(task.out)[start : start + size], task.offset + start)
        except Exception as exc:
            failed.keep(error(task, exc))
            return
        if task.piece_done() and task.check is not None:
            checks.put((task, task.out))  # the readers go on reading meanwhile

    def verify_all() -> None:
        while True:
            item = checks.get()
            if item is None:
                return
            task, what = item
            try:
                task.check(what)
            except Exception as exc:
                rejected.keep(error(task, exc))

    verifier = threading.Thread(target=verify_all, name="mpaccel-verify", daemon=True)
    verifier.start()
    try:
        _run_all(threads, "mpaccel-read", get, pieces, failed)
    finally:
        checks.put(None)
        verifier.join()
    failed.raise_if_any()
    rejected.raise_if_any()




class Watch:
    """One phase of checkpoint I/O run by within(): when an operation of it last ended, which
    ones are under way, and whether its caller gave up on it (`cancelled`: start nothing new)."""

    def __init__(self) -> None:
        self.last = time.monotonic()
        self.cancelled = False
        self._doing: dict[int, str] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def doing(self, what: str) -> Iterator[None]:
        """Around one operation that may block: an open, a piece read or written, an fsync."""
        ident = threading.get_ident()
        with self._lock:
            self._doing[ident] = what
        try:
            yield
        finally:
            with self._lock:
                self._doing.pop(ident, None)
            self.last = time.monotonic()

    def under_way(self) -> list[str]:
        with self._lock:
            return sorted(set(self._doing.values()))

    def check(self) -> None:
        """Raise in a thread that within() gave up on, before it changes anything more."""
        if self.cancelled:
            raise StalledIOError("this phase of I/O was given up (see within())")


_local = threading.local()


def current_watch() -> Watch:
    """The Watch of the within() phase this thread runs (outside any: a fresh one)."""
    watch = getattr(_local, "watch", None)
    return watch if watch is not None else Watch()


def stall_limit(timeout: float) -> float:
    """within()'s limit for a phase between two collectives of `timeout` seconds: a little less,
    so that a rank whose file system hangs reports in the next collective before the ranks
    already waiting there give up on it (they would name it too, but it would hang on)."""
    return timeout - min(0.1 * timeout, 30.0)


def within(limit: float, what: str, work: Callable[[], T]) -> T:
    """work() on a thread of its own; returns its result or raises its exception. When none of
    its operations (Watch.doing(): rawio's reads and writes, piece by piece, count) has ended for
    `limit` seconds, raises StalledIOError naming what was under way, and cancels the phase: its
    threads, blocked in the kernel on a file system that stopped answering, cannot be
    interrupted and are left behind (daemons: they do not keep the interpreter from exiting).
    Interrupted here (Ctrl-C), it cancels the phase too. Not collective: the caller agrees."""
    watch = Watch()
    outcome: list[tuple[bool, Any]] = []

    def run() -> None:
        _local.watch = watch
        try:
            outcome.append((True, work()))
        except BaseException as exc:
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name="mpaccel-io", daemon=True)
    thread.start()
    try:
        while not outcome:
            idle = time.monotonic() - watch.last
            if idle >= limit:
                break
            thread.join(min(limit - idle, 1.0))
        else:
            ok, value = outcome[0]
            if ok:
                return value
            raise value
    finally:
        if not outcome:
            watch.cancelled = True
    raise StalledIOError(
        f"{what}: no checkpoint I/O of this process ended for {limit:g} s (under way: "
        f"{'; '.join(watch.under_way()) or 'no read or write of its own: an open, a listing'})",
        "the file system stopped answering (a hung network mount, a file held by another "
        "process's lease, a frozen file system). The thread waiting on it cannot be interrupted "
        "and is left behind: end the job. If the storage is merely this slow, raise the "
        "collective timeout (MPACCEL_TIMEOUT=<seconds> or InitProcessGroupKwargs(timeout=...)).",
    )
