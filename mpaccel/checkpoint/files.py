"""The one way mpaccel opens, writes and removes what it finds in a checkpoint directory, for
readers and savers alike: never through a symbolic link, never blocking on a FIFO or a device,
regular files only, reads bounded in size.

API (not collective; each call is one process's I/O):
  open_directory(path) -> fd                       a directory, to open names relative to it
  open_regular(dir_fd, directory, name) -> fd      a regular file of that directory, checked
  read_regular(dir_fd, directory, name, limit)     its bytes, at most `limit` of them
  read_bounded(path, limit) -> bytearray           the same by path (its directory opened first)
  entry_exists(dir_fd, name) -> bool               an entry of any kind, links not followed
  replace_file(dir_fd, directory, name, data)      write `data` as `name`, atomically and synced
  remove_tree(parent, name) -> str                 remove a directory entry without following
                                                   a link (a link goes, its target stays)
Failures are CheckpointErrors naming the path; FileNotFoundError where a file does not exist."""

from __future__ import annotations

import errno
import os
import shutil
import stat

from ..errors import CheckpointError
from .index_check import plain_name

# O_NONBLOCK: opening a FIFO for reading would wait for a writer forever. On a regular file it
# changes nothing but one thing: a lease another process holds (a file server's) makes the open
# fail with EWOULDBLOCK instead of waiting for the lease to be broken; see open_regular.
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
DIRECTORY_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
_DAMAGED = "the file was damaged or crafted; restore it from a copy, or load another checkpoint."
_CHUNK = 4 << 20


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _refuse(path: str, mode: int) -> CheckpointError:
    kind = _kind(mode)
    hint = "checkpoint files are read only as regular files of the checkpoint directory."
    if stat.S_ISLNK(mode):
        hint = ("links are not followed (a checkpoint must not read outside its directory): "
                "copy the file it points to into the directory.")
    return CheckpointError(f"{path!r} is {kind}, not a regular file", hint)


def open_directory(path: str) -> int:
    """A descriptor of the directory `path` (links in the path itself are the caller's to
    choose: they are followed), to open its files relative to it, so that they are the files
    in it whatever its path comes to name meanwhile."""
    try:
        return os.open(path, DIRECTORY_FLAGS)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise CheckpointError(f"cannot open the directory {path!r}: {exc}") from exc


def open_regular(dir_fd: int, directory: str, name: str) -> int:
    """A descriptor of `name` in the directory open as `dir_fd`, checked to be a regular file on
    the directory's file system, opened without following a link and without blocking.

    `name` must be a plain file name (no directory part). Its kind is looked at (lstat) before
    it is opened, so a device is never opened, and again (fstat) once it is, in case it was
    replaced meanwhile. FileNotFoundError where it does not exist."""
    path = os.path.join(directory, name)
    if not plain_name(name):
        raise CheckpointError(f"{path!r}: {name!r} is not a plain file name", _DAMAGED)
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
        if not stat.S_ISREG(mode):
            raise _refuse(path, mode)
        try:
            fd = os.open(name, _OPEN_FLAGS | os.O_NONBLOCK, dir_fd=dir_fd)
        except BlockingIOError:
            # A regular file under another process's lease (a FIFO opens at once without a
            # writer): wait for the kernel to break the lease, as any reader would. Collective
            # loads run this under the I/O deadline (rawio.within), which ends a wait that
            # never does.
            fd = os.open(name, _OPEN_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # replaced by a link since the lstat
            raise _refuse(path, stat.S_IFLNK) from exc
        raise CheckpointError(f"cannot open checkpoint file {path!r}: {exc}") from exc
    try:
        found, home = os.fstat(fd), os.fstat(dir_fd)
        if not stat.S_ISREG(found.st_mode):
            raise _refuse(path, found.st_mode)
        if found.st_dev != home.st_dev:
            raise CheckpointError(
                f"{path!r} lies on another file system than its directory (a mount)",
                "checkpoint files are read only from the checkpoint directory's own file system.",
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(dir_fd: int, directory: str, name: str, limit: int,
                 what: str = "such a file") -> bytearray:
    """The bytes of `name` (open_regular), refused if it holds more than `limit` bytes (also
    when it grows while being read): never more than `limit` bytes of memory. `what` names
    the kind of file in the error ("an index")."""
    path = os.path.join(directory, name)
    fd = open_regular(dir_fd, directory, name)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise CheckpointError(
                f"{path!r} holds {size} bytes, more than {what} may ({limit})", _DAMAGED
            )
        data = bytearray()
        while True:
            chunk = os.read(fd, min(_CHUNK, limit + 1 - len(data)))
            if not chunk:
                return data
            data += chunk
            if len(data) > limit:
                raise CheckpointError(f"{path!r} holds more than {limit} bytes", _DAMAGED)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path!r}: {exc}") from exc
    finally:
        os.close(fd)


def read_bounded(path: str, limit: int, what: str = "such a file") -> bytearray:
    """The bytes of the regular file `path`, at most `limit` of them (read_regular): its last
    component is not followed if it is a link, and a FIFO or a device is refused unread."""
    directory, name = os.path.split(os.fspath(path))
    dir_fd = open_directory(directory or ".")
    try:
        return read_regular(dir_fd, directory, name, limit, what)
    finally:
        os.close(dir_fd)


def entry_exists(dir_fd: int, name: str) -> bool:
    """An entry `name` of any kind in the directory open as `dir_fd` (a link is not followed:
    a dangling one exists too)."""
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def descriptor_path(fd: int) -> str:
    """A path that opens the very file `fd` is open on (for HDF5, which opens by name)."""
    return f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else f"/dev/fd/{fd}"


def replace_file(dir_fd: int, directory: str, name: str, data: bytes | bytearray) -> None:
    """Put `data` in the directory as `name`, atomically: a new temporary file `name`.partial
    (created, never opened through a link or over another file), fsynced, renamed over `name`
    (a link there is replaced, its target untouched), then the directory fsynced."""
    if not plain_name(name):
        raise CheckpointError(f"{os.path.join(directory, name)!r}: not a plain file name")
    temp = f"{name}.partial"
    try:  # left by an interrupted write (or crafted: a link is unlinked, never followed)
        os.unlink(temp, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(temp, flags, 0o644, dir_fd=dir_fd)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(temp, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        raise
    os.fsync(dir_fd)


def remove_tree(parent: str, name: str) -> str:
    """Remove the entry `name` of the directory `parent` without following a link: a link (to
    a directory or anything else) is unlinked, its target untouched; a directory is removed
    with everything under it, links inside it unlinked, never followed. Returns what was
    there: "link", "directory", "missing" or, left alone, "other" (a file, a FIFO...)."""
    if not plain_name(name):
        raise CheckpointError(f"{os.path.join(parent, name)!r}: not a plain file name")
    dir_fd = open_directory(parent)
    try:
        try:
            mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            return "missing"
        if stat.S_ISLNK(mode):
            os.unlink(name, dir_fd=dir_fd)
            os.fsync(dir_fd)
            return "link"
        if not stat.S_ISDIR(mode):
            return "other"
        # rmtree relative to dir_fd walks by descriptors: a link met inside is unlinked, and a
        # link swapped in for `name` meanwhile is refused (its errors are ignored: what is left
        # has no index, and the next rotation takes it)
        shutil.rmtree(name, ignore_errors=True, dir_fd=dir_fd)
        return "directory"
    finally:
        os.close(dir_fd)
