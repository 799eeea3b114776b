"""HDF5 checkpoints: save_model, save_state/load_state, automatic naming and rotation, async saves.

Every function taking an accelerator is collective. See docs/checkpoint-format.md for the files.
"""

from __future__ import annotations

import atexit
import os
import re
import sys
import threading
import warnings
from typing import Any

from ..errors import MpaccelRuntimeWarning
from ..logging import get_logger
from . import rawio
from .format import CheckpointCollectiveError, CheckpointError, flatten, parse_size, unflatten
from .reader import CheckpointReader
from .storage import delete_checkpoint, write_checkpoint
from .training_state import (
    Rollback,
    apply_states,
    apply_tensors,
    collect,
    finish,
    model_state,
    read_back,
)

MODEL_STEM = "model"
STATE_STEM = "state"
_CHECKPOINT_DIR = re.compile(r"^checkpoint_(\d+)$")
logger = get_logger(__name__)

__all__ = [
    "AsyncSaver",
    "CheckpointCollectiveError",
    "CheckpointError",
    "CheckpointReader",
    "checkpoints_in",
    "latest_checkpoint",
    "load_model_state",
    "load_state",
    "save_model",
    "save_state",
]


def save_model(
    accelerator: Any, model: Any, save_directory: str, max_shard_size: Any, comm: Any = None
) -> dict:
    """The unwrapped model's state_dict as HDF5 shards of at most `max_shard_size`, written by
    different ranks in parallel (shard i by rank i mod N), plus `model.index.json`. Collective
    over `comm` (the accelerator's by default; a NullComm: one rank saving alone)."""
    comm = accelerator._partial.comm if comm is None else comm
    try:
        limit = parse_size(max_shard_size)
    except ValueError as exc:
        raise CheckpointError(str(exc), "for example max_shard_size='10GB' or '500MB'.") from exc
    state = model_state(accelerator, model, comm)
    index = write_checkpoint(
        comm,
        os.fspath(save_directory),
        MODEL_STEM,
        {"model": state},
        max_shard_bytes=limit,
        metadata={"kind": "model"},
    )
    return index


def load_model_state(directory: str) -> dict:
    """Not collective: the state_dict saved by save_model (checksums verified)."""
    with CheckpointReader(os.fspath(directory), MODEL_STEM) as reader:
        return reader.component("model")


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
    deletions) older than the newest complete checkpoint. Returns the paths deleted."""
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
            "Deleting what interrupted saves or deletions left (no index): "
            + ", ".join(os.path.basename(path) for path in debris)
        )
    if old:
        logger.info(
            f"Deleting {len(old)} checkpoint(s) to keep total_limit={total_limit}: "
            + ", ".join(os.path.basename(path) for path in old)
        )
    for path in [*debris, *old]:  # oldest first
        delete_checkpoint(path, STATE_STEM)
    return [*debris, *old]


def _rotate(comm: Any, rotation: tuple[str, int | None], room: bool, what: str) -> None:
    """Collective: rotate() on rank 0 (the checkpoints are on a file system every rank sees),
    under the collective timeout; every rank raises if it fails."""
    error = None
    if comm.rank == 0:
        try:
            rawio.within(
                rawio.stall_limit(comm.default_timeout), what, lambda: rotate(*rotation, room)
            )
        except Exception as exc:
            error = exc
    comm.agree(error, what + " (removing old checkpoints)", kind=CheckpointCollectiveError)


def _resolve_output(accelerator: Any, output_dir: str | None) -> str:
    config = accelerator.project_configuration
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


def _snapshot(trees: dict[str, Any]) -> dict[str, Any]:
    """{component: tree} deep-copied, every tensor cloned to host memory (for a save in the
    background), tied tensors once (so the copies stay tied, and are stored once). Errors name
    the component and key, as a synchronous save's do."""
    out = {}
    for component, tree in trees.items():
        document, tensors = flatten(tree, component)
        copies: dict[str, Any] = {}

        def load(name: str, kind: str, tensors: dict[str, Any] = tensors,
                 copies: dict[str, Any] = copies) -> Any:
            if name not in copies:
                value = tensors[name]
                copies[name] = (value.copy() if kind == "numpy"
                                else value.detach().to("cpu", copy=True))
            return copies[name]

        out[component] = unflatten(document, load)
    return out


class AsyncSaver:
    """Writes checkpoints in a background thread on its own communicator, one at a time."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._comm: Any = None
        self._exit_hook = False

    def comm_for(self, accelerator: Any) -> Any:
        if self._comm is None:  # collective, the first time: every rank saves together
            comm = accelerator._partial.comm
            if comm.size == 1:
                self._comm = comm
            else:
                from ..comm import MPIComm

                self._comm = MPIComm(comm.mpi_comm, comm.default_timeout, interruptible=False)
                # it waits beside the training thread: sleep at once, never spin or yield
                self._comm.spin_seconds = self._comm.yield_seconds = 0.0
                self._comm.hosts = comm.hosts
        return self._comm

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, target: Any) -> None:
        def run() -> None:
            try:
                target()
            except BaseException as exc:
                self._error = exc

        self._thread = threading.Thread(target=run, name="mpaccel-async-save")
        if not self._exit_hook:
            # A script may end right after save_state(async_save=True). The save must still be
            # committed, and it needs the thread pools of rawio, which refuse new work once
            # the interpreter shuts down: so wait in a hook of threading's shutdown, which runs
            # (last registered, first run) before concurrent.futures' own and before atexit
            # (MPI is finalized there, after this).
            register = getattr(threading, "_register_atexit", None)
            (register or atexit.register)(self._finish_at_exit)
            self._exit_hook = True
        self._thread.start()

    def _finish_at_exit(self) -> None:
        try:
            self.wait()
        except BaseException as exc:
            # Every rank has the same error (the save's collectives agree on it). The process
            # must not end with status 0 as if the checkpoint were there.
            print(
                f"mpaccel: the background save_state(async_save=True) failed and the script "
                f"ended without wait_for_checkpoint(): {type(exc).__name__}: {exc}",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)

    def wait(self) -> None:
        """Block until the background save is committed; re-raise its error here."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error


def _threads_ok() -> bool:
    try:
        from mpi4py import MPI
    except ImportError:
        return True
    return MPI.Query_thread() >= MPI.THREAD_MULTIPLE


def save_state(
    accelerator: Any, output_dir: str | None, async_save: bool, comm: Any = None
) -> str:
    """Collective over `comm` (the accelerator's by default; a NullComm: one rank saving alone,
    synchronously)."""
    saver: AsyncSaver = accelerator._async_saver
    saver.wait()  # a second save waits for the first
    config = accelerator.project_configuration
    if comm is None:
        comm = accelerator._partial.comm
    elif comm is not accelerator._partial.comm:
        async_save = False  # the background writer's communicator spans every rank
    if async_save and not _threads_ok():
        warnings.warn(
            "async_save needs MPI_THREAD_MULTIPLE; saving synchronously",
            MpaccelRuntimeWarning,
            stacklevel=3,
        )
        async_save = False
    error: BaseException | None = None
    directory = ""
    shared: dict[str, Any] = {}
    per_rank: dict[str, Any] = {}
    try:
        directory = _resolve_output(accelerator, output_dir)
        shared, per_rank = collect(accelerator, comm)
        if async_save:  # copies in host memory: training may change the originals meanwhile
            shared, per_rank = _snapshot(shared), _snapshot(per_rank)
    except Exception as exc:
        error = exc
    target = directory or output_dir
    named = f"checkpoint {target!r}" if target else "a checkpoint"
    comm.agree(error, f"saving {named} (collecting the state)", kind=CheckpointCollectiveError)

    # what the writer needs of the configuration, as it is now: in the background it would
    # read the next save's number (and whatever the caller changes meanwhile)
    metadata = {"kind": "state", "iteration": config.iteration}
    rotation = None
    if config.automatic_checkpoint_naming:
        rotation = (config.project_dir, config.total_limit)

    def write(comm: Any) -> None:
        # Rotation deletes the oldest checkpoints before the new one is written (room for it,
        # as in Accelerate: a crash meanwhile leaves total_limit - 1, never more than the
        # limit), keeping the newest; then, once it is committed, whatever is over the limit
        # (total_limit=1: the previous one only goes once the new one is committed).
        if rotation is not None:
            _rotate(comm, rotation, True, f"saving checkpoint {directory!r}")
        write_checkpoint(comm, directory, STATE_STEM, shared, per_rank, metadata=metadata)
        if rotation is not None:
            _rotate(comm, rotation, False, f"saving checkpoint {directory!r}")

    if async_save:
        background = saver.comm_for(accelerator)
        saver.start(lambda: write(background))
    else:
        write(comm)
    if config.automatic_checkpoint_naming:
        config.iteration += 1
    return directory


def node_share(accelerator: Any) -> tuple[int, int]:
    """(index, count) of this rank among the ranks of its node (as discovery found them): they
    read the same files through one page cache, so each verifies 1/count of the checksums."""
    state = accelerator._partial
    return state.local_process_index, state.process_info.local_num_processes


MODEL_LOAD_OPTIONS = ("strict", "assign")  # what torch's Module.load_state_dict takes


def load_state(
    accelerator: Any, input_dir: str | None, model_options: dict[str, Any] | None = None
) -> str:
    model_options = dict(model_options or {})
    unknown = sorted(set(model_options) - set(MODEL_LOAD_OPTIONS))
    if unknown:
        raise TypeError(
            f"load_state() got unexpected keyword argument(s) {unknown}: the keywords it passes "
            f"on to the models' load_state_dict are {list(MODEL_LOAD_OPTIONS)}"
        )
    accelerator._async_saver.wait()
    config = accelerator.project_configuration
    comm = accelerator._partial.comm
    limit = rawio.stall_limit(comm.default_timeout)
    share = node_share(accelerator)
    strict = bool(model_options.get("strict", True))
    named = [os.fspath(input_dir) if input_dir is not None else None]  # for the messages

    def open_checkpoint() -> tuple[int | None, CheckpointReader]:
        if input_dir is None:
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
            number, named[0] = latest
        else:
            number = None
        return number, CheckpointReader(named[0] or "", STATE_STEM, share)

    error: BaseException | None = None
    try:
        number, reader = rawio.within(limit, "opening a checkpoint", open_checkpoint)
    except Exception as exc:
        error = exc
    what = f"loading checkpoint {named[0]!r}"
    try:
        comm.agree(error, what, kind=CheckpointCollectiveError)
    except BaseException:
        if error is None:  # this rank opened it; another one could not
            reader.close()
        raise
    # All or nothing, on every rank. (1) read, verify and check everything, changing nothing
    # (the tensors that models and optimizers take in place are only verified in the files);
    # all ranks agree. (2) hand their states to the schedulers, the scaler and the registered
    # objects (whose own code may refuse them); all ranks agree. (3) read the tensors held back
    # in (1) into the models and optimizers, then their load_state_dict; all ranks agree. (4)
    # assign what (1) checked (RNG states, loader positions, step). A failure in (1) changed
    # nothing; in (2) or (3), on any rank, every rank gives every object back the state it had
    # (Rollback), all but the tensors read in place in (3): the warning says so.
    rollback = Rollback()
    abandoned = False  # a thread left in the kernel may still use the reader's files
    filled = False

    def io(work: Any) -> Any:
        nonlocal abandoned
        try:
            return rawio.within(limit, what, work)
        except BaseException as exc:  # given up on, or interrupted: its thread may run on
            abandoned = isinstance(exc, rawio.StalledIOError) or not isinstance(exc, Exception)
            raise

    def fill() -> None:
        nonlocal filled
        filled = True
        io(lambda: reader.fill(loaded.held, follow=share[0] > 0))

    try:
        try:
            loaded = io(lambda: read_back(accelerator, reader, comm.rank, strict))
        except Exception as exc:
            error = exc
        comm.agree(error, what, kind=CheckpointCollectiveError)
        try:
            apply_states(accelerator, loaded, reader, rollback)
        except Exception as exc:
            error = exc
        comm.agree(error, what, kind=CheckpointCollectiveError)
        try:
            apply_tensors(accelerator, loaded, reader, rollback, fill, model_options)
        except Exception as exc:
            error = exc
        comm.agree(error, what, kind=CheckpointCollectiveError)
    except BaseException:
        problems = rollback.run()
        if filled:
            problems.append(
                "the models' and optimizers' tensors read in place (they hold the checkpoint's "
                "bytes, some of them perhaps: load a checkpoint again)"
            )
        if problems:
            warnings.warn(
                f"{what} failed, and not everything could be given back the state it had: "
                + "; ".join(problems),
                MpaccelRuntimeWarning,
                stacklevel=3,
            )
        raise
    finally:
        if not abandoned:
            reader.close()
    finish(accelerator, loaded)
    if number is not None:
        config.iteration = number + 1
    for note in loaded.notes if accelerator.is_main_process else []:
        warnings.warn(note, MpaccelRuntimeWarning, stacklevel=3)
    for warning in loaded.warnings:
        warnings.warn(warning, MpaccelRuntimeWarning, stacklevel=3)
    return named[0] or ""
