"""Where checkpoints go: the file stems, automatic naming (project_dir/checkpoints/checkpoint_N),
finding the latest complete checkpoint, and rotation (total_limit)."""

from __future__ import annotations

import logging
import os
import re
import warnings

from ..comm import Comm, agreement
from ..config import ProjectConfiguration
from ..errors import CheckpointCollectiveError, CheckpointError, MpaccelRuntimeWarning
from . import rawio
from .writer import delete_checkpoint

MODEL_STEM = "model"  # save_model: model.index.json
STATE_STEM = "state"  # save_state: state.index.json (its presence makes a checkpoint complete)
_CHECKPOINT_DIR = re.compile(r"^checkpoint_(\d+)$")
# Named, not __name__: rotation's messages have always come from "mpaccel.checkpoint", the
# logger users (and tests) set the level of; moving the code here must not rename it. A plain
# logger, not the facade's get_logger (checkpoint/ sits below it): rotate() runs on rank 0
# alone, and says so as Accelerate's adapter would ("[RANK 0] ").
logger = logging.getLogger("mpaccel.checkpoint")


def checkpoints_in(project_dir: str) -> list[tuple[int, str, bool]]:
    """(number, path, complete) of project_dir/checkpoints/checkpoint_N, oldest first."""
    root = os.path.join(project_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _CHECKPOINT_DIR.match(name)
        if match:
            path = os.path.join(root, name)
            complete = os.path.isfile(os.path.join(path, f"{STATE_STEM}.index.json"))
            found.append((int(match.group(1)), path, complete))
    return sorted(found)


def latest_checkpoint(project_dir: str) -> tuple[int, str] | None:
    complete = [(n, path) for n, path, ok in checkpoints_in(project_dir) if ok]
    return complete[-1] if complete else None


def rotate(project_dir: str, total_limit: int | None, room: bool = False) -> list[str]:
    """Keep the `total_limit` newest complete checkpoints, or one fewer with `room` (before a
    save, to make room for it, as Accelerate does), but never fewer than one: the newest
    complete checkpoint is never removed. Also drops debris (interrupted saves, interrupted
    deletions) older than the newest complete checkpoint. Returns the paths deleted. Nothing
    is deleted through a link: a `checkpoint_N` that is one is unlinked (its target left
    alone), a `checkpoints` that is one is not rotated; each with a warning."""
    root = os.path.join(project_dir, "checkpoints")
    if os.path.islink(root):
        _warn(f"{root!r} is a symbolic link: old checkpoints are not deleted through it "
              "(rotation removes nothing outside the project directory)")
        return []
    found = checkpoints_in(project_dir)
    complete = [entry for entry in found if entry[2]]
    if not complete:
        return []
    newest = complete[-1][0]
    debris = [path for n, path, ok in found if not ok and n < newest]
    old: list[str] = []
    if total_limit is not None:
        keep = max(1, total_limit - 1 if room else total_limit)
        old = [path for _, path, _ in complete[: max(0, len(complete) - keep)]]
    if debris:
        logger.info(
            "[RANK 0] Deleting what interrupted saves or deletions left (no index): "
            + ", ".join(os.path.basename(path) for path in debris)
        )
    if old:
        logger.info(
            f"[RANK 0] Deleting {len(old)} checkpoint(s) to keep total_limit={total_limit}: "
            + ", ".join(os.path.basename(path) for path in old)
        )
    for path in [*debris, *old]:  # oldest first
        target = os.readlink(path) if os.path.islink(path) else None
        what = delete_checkpoint(path, STATE_STEM)
        if what == "link":
            _warn(f"{path!r} is a symbolic link (to {target!r}): rotation unlinked it and left "
                  "the checkpoint it points to alone")
        elif what == "other":
            _warn(f"{path!r} is not a directory: rotation left it alone")
    return [*debris, *old]


def _warn(message: str) -> None:
    warnings.warn(message, MpaccelRuntimeWarning, stacklevel=3)


def rotate_together(
    comm: Comm, rotation: tuple[str, int | None], room: bool, what: str
) -> None:
    """Collective: rotate() on rank 0 (the checkpoints are on a file system every rank sees),
    under the collective timeout; every rank raises if it fails."""
    with agreement(comm, what + " (removing old checkpoints)", kind=CheckpointCollectiveError):
        if comm.rank == 0:
            rawio.within(
                rawio.stall_limit(comm.default_timeout), what, lambda: rotate(*rotation, room)
            )


def resolve_output(config: ProjectConfiguration, output_dir: str | None) -> str:
    """Not collective: the directory save_state(output_dir) writes, with automatic naming
    project_dir/checkpoints/checkpoint_<iteration> (refused below the newest one there)."""
    if config.automatic_checkpoint_naming:
        if config.project_dir is None:
            raise CheckpointError(
                "automatic_checkpoint_naming needs ProjectConfiguration(project_dir=...)"
            )
        newest = latest_checkpoint(config.project_dir)
        if newest is not None and newest[0] >= config.iteration:
            # Writing below the newest would overwrite a checkpoint, or be the first one that
            # rotation (oldest number first) deletes.
            raise CheckpointError(
                f"{config.project_dir!r} already holds checkpoint_{newest[0]}; this run would "
                f"save checkpoint_{config.iteration}",
                "call accelerator.load_state() first to resume (it continues the numbering), "
                f"set ProjectConfiguration(iteration={newest[0] + 1}) to continue without "
                "resuming, or use another project_dir.",
            )
        return os.path.join(config.project_dir, "checkpoints", f"checkpoint_{config.iteration}")
    if output_dir is None:
        raise CheckpointError(
            "save_state() needs an output_dir",
            "pass one, or use Accelerator(project_config=ProjectConfiguration(project_dir=..., "
            "automatic_checkpoint_naming=True)).",
        )
    return os.fspath(output_dir)


def resolve_input(config: ProjectConfiguration, input_dir: str | None) -> tuple[int | None, str]:
    """Not collective: (number or None, directory) of the checkpoint load_state(input_dir)
    reads: with no input_dir, the latest complete one of the project (automatic naming)."""
    if input_dir is not None:
        return None, os.fspath(input_dir)
    if not (config.automatic_checkpoint_naming and config.project_dir):
        raise CheckpointError(
            "load_state() needs an input_dir",
            "pass one, or use ProjectConfiguration(automatic_checkpoint_naming=True) so "
            "load_state() finds the latest complete checkpoint.",
        )
    latest = latest_checkpoint(config.project_dir)
    if latest is None:
        root = os.path.join(config.project_dir, "checkpoints")
        raise CheckpointError(f"no complete checkpoint under {root!r}")
    return latest
