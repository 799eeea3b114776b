"""checkpoint/files.py, the one way checkpoints' files are opened, written and removed: never
through a link, never blocking on a FIFO or a device, sizes bounded."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from mpaccel.checkpoint import CheckpointError
from mpaccel.checkpoint.files import (
    open_directory,
    read_bounded,
    read_regular,
    remove_tree,
    replace_file,
)

pytestmark = pytest.mark.mpi_timeout(300)


def _tree(root: Path) -> dict[str, str]:
    """Every entry under `root` (links not followed): a link's target, a file's digest."""
    out = {}
    for base, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(base, name)
            if os.path.islink(path):
                out[path] = "link to " + os.readlink(path)
            elif os.path.isfile(path):
                with open(path, "rb") as f:
                    out[path] = hashlib.sha256(f.read()).hexdigest()
            elif os.path.isdir(path):
                out[path] = "directory"
            else:
                out[path] = "other"
    return out


# --- the API ----------------------------------------------------------------------------------


@pytest.mark.mpi(size=1)  # one process's I/O: nothing more to see at other sizes
def test_reads_refuse_links_fifos_and_devices_and_bound_their_size(tmp_path):
    (tmp_path / "outside").write_bytes(b"secret")
    (tmp_path / "d").mkdir()
    os.symlink(tmp_path / "outside", tmp_path / "d" / "link")
    os.mkfifo(tmp_path / "d" / "fifo")
    (tmp_path / "d" / "big").write_bytes(b"x" * 100)
    (tmp_path / "d" / "ok").write_bytes(b"y" * 10)
    for name, kind in (("link", "a symbolic link"), ("fifo", "a FIFO")):
        with pytest.raises(CheckpointError, match=kind):
            read_bounded(str(tmp_path / "d" / name), 1000)
    with pytest.raises(CheckpointError, match="a character device"):
        read_bounded("/dev/zero", 1000)
    with pytest.raises(CheckpointError, match="holds 100 bytes, more than an index may"):
        read_bounded(str(tmp_path / "d" / "big"), 99, "an index")
    fd = open_directory(str(tmp_path / "d"))
    try:
        assert read_regular(fd, str(tmp_path / "d"), "ok", 10) == b"y" * 10
        with pytest.raises(CheckpointError, match="not a plain file name"):
            read_regular(fd, str(tmp_path / "d"), "../outside", 1000)
    finally:
        os.close(fd)


@pytest.mark.mpi(size=1)
def test_writes_and_removals_never_go_through_a_link(tmp_path):
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "victim").write_bytes(b"keep me")
    (tmp_path / "d").mkdir()
    # a planted temp file name that points outside: replaced, not written through
    os.symlink(tmp_path / "outside" / "victim", tmp_path / "d" / "new.partial")
    fd = open_directory(str(tmp_path / "d"))
    try:
        replace_file(fd, str(tmp_path / "d"), "new", b"data")
    finally:
        os.close(fd)
    assert (tmp_path / "d" / "new").read_bytes() == b"data"
    assert not (tmp_path / "d" / "new").is_symlink()
    assert (tmp_path / "outside" / "victim").read_bytes() == b"keep me"
    # a link to a directory is unlinked, its target kept; a directory goes with what it holds,
    # links inside it unlinked, never followed
    os.symlink(tmp_path / "outside", tmp_path / "d" / "linked")
    (tmp_path / "d" / "real").mkdir()
    os.symlink(tmp_path / "outside", tmp_path / "d" / "real" / "inner")
    before = _tree(tmp_path / "outside")
    assert remove_tree(str(tmp_path / "d"), "linked") == "link"
    assert remove_tree(str(tmp_path / "d"), "real") == "directory"
    assert remove_tree(str(tmp_path / "d"), "real") == "missing"
    assert remove_tree(str(tmp_path / "d"), "new") == "other"
    assert sorted(os.listdir(tmp_path / "d")) == ["new"]
    assert _tree(tmp_path / "outside") == before
