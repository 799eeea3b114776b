"""checkpoint/files.py, the one way checkpoints' files are opened, written and removed: never
through a link, never blocking on a FIFO or a device, sizes bounded; and the saver and rotation,
which use it, touch nothing outside the checkpoint directory (issue 27, items 1, 2 and 4)."""

from __future__ import annotations

import hashlib
import json
import os
import tracemalloc
import warnings
from pathlib import Path

import pytest
import torch

from mpaccel import PartialState
from mpaccel.checkpoint import (
    CheckpointCollectiveError,
    CheckpointError,
    TrainingState,
    load_state,
    save_state,
)
from mpaccel.checkpoint.files import (
    open_directory,
    read_bounded,
    read_regular,
    remove_tree,
    replace_file,
)
from mpaccel.checkpoint.format import INDEX_DIGEST, index_digest
from mpaccel.checkpoint.naming import rotate
from mpaccel.errors import MpaccelRuntimeWarning
from mpaccel.utils import ProjectConfiguration
from tests.checkpoint.sharded.test_save_load import build

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


def _rewrite(path: Path, change) -> None:
    """Change the index at `path` and give it a matching checksum (a crafted index, not a
    corrupted one: only the checks of its fields can stop it)."""
    document = json.loads(path.read_text())
    change(document)
    document.pop(INDEX_DIGEST, None)
    document[INDEX_DIGEST] = index_digest(document)
    path.write_text(json.dumps(document, indent=1))


def _sharded(seed: int) -> TrainingState:
    return TrainingState(sharded={"model": build(seed)})


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


# --- the saver (items 1 and 2) ----------------------------------------------------------------


def test_a_save_never_writes_where_a_crafted_index_points(group, mpi_tmp_path):
    """Issue 27, item 1: a state index whose `metadata.sharded` is "/../../outside/x" (and a
    sharded index of that save id, a `sharded.` directory to walk through) made the saver's
    "keep the committed part aside" step write outside/x.index.json. The save is now refused
    on every rank, as a load refuses that index, and nothing outside changes."""
    ckpt, outside = mpi_tmp_path / "ckpt", mpi_tmp_path / "outside"
    save_state(group, _sharded(0), str(ckpt))
    if group.rank == 0:
        crafted = "/../../outside/x"
        _rewrite(ckpt / "state.index.json",
                 lambda d: d["metadata"].__setitem__("sharded", crafted))
        _rewrite(ckpt / "sharded.index.json", lambda d: d.__setitem__("save_id", crafted))
        (ckpt / "sharded.").mkdir()
        outside.mkdir()
    group.barrier()
    before = _tree(mpi_tmp_path)
    with pytest.raises(CheckpointCollectiveError, match=r"metadata\['sharded'\] is '/\.\./"):
        save_state(group, _sharded(1), str(ckpt))
    group.barrier()
    assert _tree(mpi_tmp_path) == before  # nothing created or removed, inside or outside
    assert os.listdir(outside) == []
    group.barrier()


@pytest.mark.parametrize("kind", ["link to /dev/zero", "FIFO"])
def test_a_save_over_an_index_that_is_no_regular_file_neither_grows_nor_blocks(
        group, mpi_tmp_path, kind):
    """Issue 27, item 2: with state.index.json a link to /dev/zero, rank 0 grew past 3 GB in
    6 s; a FIFO blocked the save for the whole collective timeout. The saver now opens it as
    the readers do: refused at once, unread, on every rank; the committed checkpoint stays
    loadable once the index is put back."""
    ckpt = mpi_tmp_path / "ckpt"
    save_state(group, _sharded(0), str(ckpt))
    index = ckpt / "state.index.json"
    if group.rank == 0:
        os.rename(index, ckpt / "kept")
        if kind == "FIFO":
            os.mkfifo(index)
        else:
            os.symlink("/dev/zero", index)
    group.barrier()
    before = _tree(mpi_tmp_path)
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointCollectiveError,
                           match="a symbolic link" if kind != "FIFO" else "a FIFO"):
            save_state(group, _sharded(1), str(ckpt))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"the save took {peak >> 20} MiB"
    group.barrier()
    assert _tree(mpi_tmp_path) == before
    group.barrier()
    if group.rank == 0:
        os.remove(index)
        os.rename(ckpt / "kept", index)
    group.barrier()
    objects = _sharded(2)
    load_state(group, objects, str(ckpt))
    expected = _sharded(0).sharded["model"].state_dict()
    for key, value in objects.sharded["model"].state_dict().items():
        assert torch.equal(value.full_tensor(), expected[key].full_tensor()), key


# --- rotation (item 4) ------------------------------------------------------------------------


def _plain(seed: int) -> TrainingState:
    torch.manual_seed(seed)
    return TrainingState(models={"model_0": torch.nn.Linear(3, 2)})


def test_rotation_unlinks_a_linked_checkpoint_and_leaves_its_target_alone(mpi_tmp_path):
    """Issue 27, item 5: with checkpoints/checkpoint_0 a link to a checkpoint outside the
    project and total_limit=2, rotation removed the outside checkpoint's state.index.json
    (its commit). Now the link is unlinked, with a warning, and the outside checkpoint is
    untouched and loads."""
    comm = PartialState().comm
    outside, project = mpi_tmp_path / "outside", mpi_tmp_path / "project"
    save_state(comm, _plain(0), str(outside / "precious"))
    if comm.rank == 0:
        (project / "checkpoints").mkdir(parents=True)
        os.symlink(outside / "precious", project / "checkpoints" / "checkpoint_0")
    comm.barrier()
    before = _tree(outside)
    config = ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True,
                                  total_limit=2, iteration=1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for seed in (1, 2):
            save_state(comm, _plain(seed), None, project=config)
    assert sorted(os.listdir(project / "checkpoints")) == ["checkpoint_1", "checkpoint_2"]
    assert _tree(outside) == before
    if comm.rank == 0:  # rotation runs there
        assert any(issubclass(w.category, MpaccelRuntimeWarning)
                   and "is a symbolic link" in str(w.message) for w in seen), seen
    objects = _plain(3)
    load_state(comm, objects, str(outside / "precious"))
    assert torch.equal(objects.models["model_0"].weight, _plain(0).models["model_0"].weight)
    comm.barrier()


@pytest.mark.mpi(size=1)  # rotate() runs on one rank
def test_rotation_does_not_delete_through_a_linked_checkpoints_directory(tmp_path):
    outside = tmp_path / "outside"
    for n in range(3):
        (outside / f"checkpoint_{n}").mkdir(parents=True)
        (outside / f"checkpoint_{n}" / "state.index.json").write_text("{}")
    (tmp_path / "project").mkdir()
    os.symlink(outside, tmp_path / "project" / "checkpoints")
    before = _tree(outside)
    with pytest.warns(MpaccelRuntimeWarning, match="is a symbolic link"):
        assert rotate(str(tmp_path / "project"), 1) == []
    assert _tree(outside) == before
