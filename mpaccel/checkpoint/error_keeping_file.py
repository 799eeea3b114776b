"""A file object for h5py's file-object driver that never reports an I/O error to HDF5.

HDF5 does not survive a failed write well: after ENOSPC its close fails, h5py's destructors retry
the close later from inside unrelated code, and deallocating the file's remaining objects can
crash the process (seen here on a full tmpfs). Here HDF5 always sees success; the first OSError
is kept and raised in plain Python once HDF5 has closed the file, which is then thrown away.
"""

from __future__ import annotations

import os
from typing import Any

_REMEMBERED = 1 << 20  # after a failure, writes up to this size are kept for HDF5 to read back


class ErrorKeepingFile:
    """Binary read/write file at `path` (created or truncated), positioned like io.RawIOBase.

    Not thread-safe; one HDF5 file at a time, as h5py requires of file objects anyway."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.error: OSError | None = None
        self._pos = 0
        # Metadata written after a failure, kept so that HDF5 reading it back finds it and
        # closes normally. Raw data is not kept: HDF5 does not read it while writing.
        self._kept: dict[int, bytes] = {}

    # -- the methods h5py's file-object driver calls --------------------------------------------
    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_SET:
            self._pos = offset
        elif whence == os.SEEK_CUR:
            self._pos += offset
        else:
            self._pos = os.fstat(self.fd).st_size + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        size = len(view)
        if self.error is None:
            try:
                done = 0
                while done < size:  # pwrite may write less than asked
                    done += os.pwrite(self.fd, view[done:], self._pos + done)
            except OSError as exc:
                self.error = exc
        if self.error is not None and size <= _REMEMBERED:
            self._kept[self._pos] = bytes(view)
        self._pos += size
        return size

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        kept = self._kept.get(self._pos)
        if kept is not None and len(kept) >= len(view):
            view[:] = kept[: len(view)]
            count = len(view)
        else:
            try:
                count = os.preadv(self.fd, [view], self._pos)
            except OSError as exc:
                self.error = self.error or exc
                count = 0  # h5py fills what was not read with zeros
        self._pos += count
        return count

    def read(self, size: int = -1) -> bytes:
        if size < 0:
            size = max(0, os.fstat(self.fd).st_size - self._pos)
        buffer = bytearray(size)
        return bytes(buffer[: self.readinto(buffer)])

    def truncate(self, size: int | None = None) -> int:
        size = self._pos if size is None else size
        if self.error is None:
            try:
                os.ftruncate(self.fd, size)
            except OSError as exc:
                self.error = exc
        return size

    def flush(self) -> None:
        pass  # nothing is buffered: every write went to the kernel

    # -- for the checkpoint writer ---------------------------------------------------------------
    def check(self) -> None:
        """Raise the first I/O error HDF5's writes met (call once HDF5 closed the file)."""
        if self.error is not None:
            raise OSError(self.error.errno, self.error.strerror, self.path)

    def finish(self) -> None:
        """After HDF5 closed the file: raise the kept error, else fsync. Closes the descriptor."""
        try:
            self.check()
            os.fsync(self.fd)
        finally:
            self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
