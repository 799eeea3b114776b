"""The checkpoint entry points: save_model / load_model_state, save_state / load_state.

The functions taking a `comm` are collective. They take the objects to save by name
(TrainingState: models, optimizers, other Statefuls), never the Accelerator that holds them.
Where a checkpoint goes (automatic naming, rotation) is naming.py's; the files are written by
storage.py and read by reader.py (docs/checkpoint-format.md).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..comm import Comm, agreement
from ..config import ProjectConfiguration
from ..errors import MpaccelRuntimeWarning
from . import rawio, sharded_state
from .async_save import AsyncSaver, snapshot, threads_ok
from .format import CheckpointCollectiveError, CheckpointError, parse_size
from .naming import (
    MODEL_STEM,
    STATE_STEM,
    resolve_input,
    resolve_output,
    rotate_together,
)
from .reader import CheckpointReader
from .stateful import TrainingState
from .storage import write_checkpoint
from .training_state import (
    Rollback,
    apply_states,
    apply_tensors,
    collect,
    finish,
    model_state,
    read_back,
)


def save_model(
    comm: Comm, module: torch.nn.Module, save_directory: str, max_shard_size: Any
) -> dict:
    """Collective. The (unwrapped) module's state_dict as HDF5 shards of at most
    `max_shard_size`, written by different ranks in parallel (shard i by rank i mod N), plus
    `model.index.json`. A fully sharded module's full tensors are written the same way, each
    rank writing its own rows of them in place (no rank gathers a tensor: export_full)."""
    try:
        limit = parse_size(max_shard_size)
    except ValueError as exc:
        raise CheckpointError(str(exc), "for example max_shard_size='10GB' or '500MB'.") from exc
    # no DTensor exists unless torch.distributed.tensor was imported (FSDP), and importing
    # it here would change a gloo teardown race (see mpaccel/fsdp.py's docstring)
    tensors = sys.modules.get("torch.distributed.tensor")
    state = module.state_dict()
    if tensors is not None and any(isinstance(v, tensors.DTensor) for v in state.values()):
        from .sharded_export import export_full

        return export_full(comm, os.fspath(save_directory), state, limit)
    state = model_state(comm, module)
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


def save_state(
    comm: Comm,
    objects: TrainingState,
    output_dir: str | None,
    *,
    project: ProjectConfiguration | None = None,
    saver: AsyncSaver | None = None,
    async_save: bool = False,
) -> str:
    """Collective. Save `objects` (and each rank's RNG states) as a checkpoint committed
    atomically, in `output_dir` or, with `project.automatic_checkpoint_naming`, the next
    numbered directory of `project.project_dir` (older ones rotated: `total_limit`; then
    `project.iteration` moves on). `async_save`: snapshot to host memory and write in the
    background thread of `saver` (which a second save, and load_state, wait for). Returns
    the directory."""
    config = project if project is not None else ProjectConfiguration()
    if saver is not None:
        saver.wait()  # a second save waits for the first
    if async_save and saver is None:
        raise TypeError("save_state(async_save=True) needs an AsyncSaver (saver=)")
    if async_save and not threads_ok():
        warnings.warn(
            "async_save needs MPI_THREAD_MULTIPLE; saving synchronously",
            MpaccelRuntimeWarning,
            stacklevel=3,
        )
        async_save = False
    with agreement(comm, _saving(output_dir), kind=CheckpointCollectiveError):
        directory = resolve_output(config, output_dir)
    with agreement(comm, _saving(directory), kind=CheckpointCollectiveError):
        shared, per_rank = collect(comm, objects)
        if async_save:  # copies in host memory: training may change the originals meanwhile
            shared, per_rank = snapshot(shared), snapshot(per_rank)
    # each rank's own rows of the sharded objects (a copy of the local rows only, if async)
    rows = sharded_state.collect(comm, objects, _saving(directory), copy=async_save)

    # what the writer needs of the configuration, as it is now: in the background it would
    # read the next save's number (and whatever the caller changes meanwhile)
    metadata = {"kind": "state", "iteration": config.iteration}
    rotation = None
    if config.automatic_checkpoint_naming:
        assert config.project_dir is not None  # resolve_output() refused it
        rotation = (config.project_dir, config.total_limit)

    def write(comm: Comm) -> None:
        # Rotation deletes the oldest checkpoints before the new one is written (room for it,
        # as in Accelerate: a crash meanwhile leaves total_limit - 1, never more than the
        # limit), keeping the newest; then, once it is committed, whatever is over the limit
        # (total_limit=1: the previous one only goes once the new one is committed).
        if rotation is not None:
            rotate_together(comm, rotation, True, f"saving checkpoint {directory!r}")
        # the sharded part first: the state index, committed last, names it
        extra = sharded_state.write(comm, directory, rows)
        write_checkpoint(comm, directory, STATE_STEM, shared, per_rank,
                         metadata={**metadata, **extra})
        if rotation is not None:
            rotate_together(comm, rotation, False, f"saving checkpoint {directory!r}")

    if saver is not None and async_save:
        background = saver.comm_for(comm)
        saver.start(lambda: write(background))
    else:
        write(comm)
    if config.automatic_checkpoint_naming:
        config.iteration += 1
    return directory


def _saving(target: str | None) -> str:
    named = f"checkpoint {target!r}" if target else "a checkpoint"
    return f"saving {named} (collecting the state)"


MODEL_LOAD_OPTIONS = ("strict", "assign")  # what torch's Module.load_state_dict takes


def load_state(
    comm: Comm,
    objects: TrainingState,
    input_dir: str | None,
    *,
    project: ProjectConfiguration | None = None,
    saver: AsyncSaver | None = None,
    model_options: dict[str, Any] | None = None,
    node_share: tuple[int, int] = (0, 1),
) -> str:
    """Collective. Give `objects` the states of the checkpoint in `input_dir` (None: the
    latest complete one of `project`, whose iteration then follows it), all or nothing on
    every rank. `model_options` go to the models' load_state_dict (strict, assign).
    `node_share`: (index, count) of this rank among the ranks of its node, which read the
    same files through one page cache: each verifies 1/count of the checksums. Returns the
    directory."""
    model_options = dict(model_options or {})
    unknown = sorted(set(model_options) - set(MODEL_LOAD_OPTIONS))
    if unknown:
        raise TypeError(
            f"load_state() got unexpected keyword argument(s) {unknown}: the keywords it passes "
            f"on to the models' load_state_dict are {list(MODEL_LOAD_OPTIONS)}"
        )
    if saver is not None:
        saver.wait()
    config = project if project is not None else ProjectConfiguration()
    limit = rawio.stall_limit(comm.default_timeout)
    strict = bool(model_options.get("strict", True))
    named = os.fspath(input_dir) if input_dir is not None else None  # for the messages
    with agreement(comm, f"loading checkpoint {named!r}", kind=CheckpointCollectiveError):
        number, named = rawio.within(
            limit, "opening a checkpoint", lambda: resolve_input(config, named)
        )
    opened: list[CheckpointReader] = []

    def close() -> None:  # this rank opened it; another one could not
        for reader in opened:
            reader.close()

    what = f"loading checkpoint {named!r}"
    with agreement(comm, what, kind=CheckpointCollectiveError, cleanup=close):
        opened.append(rawio.within(limit, "opening a checkpoint",
                                   lambda: CheckpointReader(named or "", STATE_STEM, node_share)))
    reader = opened[0]
    # the objects that go through rows (sharded ones, or held in the sharded part): checked
    # and verified first, changing nothing; applied with the rest, under the same rollback
    rows: sharded_state.ShardedLoad | None = None
    with agreement(comm, what, kind=CheckpointCollectiveError, cleanup=close):
        rows = sharded_state.ShardedLoad(objects, reader)
    if rows.targets:
        with agreement(comm, what, kind=CheckpointCollectiveError, cleanup=close,
                       passing=(CheckpointCollectiveError,)):
            rows.read(comm, what, limit, strict)
        objects = rows.rest
    loaded = _load(comm, objects, reader, what, limit, strict, node_share, model_options, rows)
    if number is not None:
        config.iteration = number + 1
    for note in loaded.notes if comm.rank == 0 else []:
        warnings.warn(note, MpaccelRuntimeWarning, stacklevel=3)
    return named or ""


def _load(
    comm: Comm,
    objects: TrainingState,
    reader: CheckpointReader,
    what: str,
    limit: float,
    strict: bool,
    node_share: tuple[int, int],
    model_options: dict[str, Any],
    rows: sharded_state.ShardedLoad,
) -> Any:
    """load_state() once every rank opened the checkpoint and `rows` verified the objects that
    go through rows; closes the reader and rows' readers."""
    # All or nothing, on every rank. (1) read, verify and check everything, changing nothing
    # (the tensors that models and optimizers take in place are only verified in the files;
    # `rows` did the same for its objects already); all ranks agree. (2) hand their states to
    # the other Statefuls (schedulers, the scaler, registered objects, loader positions: their
    # own code may refuse them); all ranks agree. (3) read the tensors held back in (1) into
    # the models and optimizers, then their load_state_dict; all ranks agree. (4) the same for
    # the objects of `rows` (sharded ones); all ranks agree. (5) set the RNG states (1)
    # checked. A failure in (1) changed nothing; in (2) to (4), on any rank, every rank gives
    # every object back the state it had (Rollback), all but the tensors read in place in (3)
    # and (4): the warning, on every rank, names them.
    rollback = Rollback()
    abandoned = False  # a thread left in the kernel may still use the reader's files
    filled: list[str] = []  # what was read in place, for the warning

    def io(work: Callable[[], Any]) -> Any:
        nonlocal abandoned
        try:
            return rawio.within(limit, what, work)
        except BaseException as exc:  # given up on, or interrupted: its thread may run on
            abandoned = isinstance(exc, rawio.StalledIOError) or not isinstance(exc, Exception)
            raise

    def fill() -> None:
        filled.append("the models' and optimizers' tensors read in place")
        io(lambda: reader.fill(loaded.held, follow=node_share[0] > 0))

    def fill_rows() -> None:
        filled.append(f"the tensors of {', '.join(rows.names())} read in place")
        io(rows.fill)

    try:
        with agreement(comm, what, kind=CheckpointCollectiveError):
            loaded = io(lambda: read_back(objects, reader, comm.rank, comm.size, strict))
        with agreement(comm, what, kind=CheckpointCollectiveError):
            apply_states(objects, loaded, reader, rollback)
        with agreement(comm, what, kind=CheckpointCollectiveError):
            apply_tensors(objects, loaded, reader, rollback, fill, model_options)
        if rows.targets:
            with agreement(comm, what + " (reading the sharded state in place)",
                           kind=CheckpointCollectiveError):
                fill_rows()
            with agreement(comm, what + " (handing over the sharded state)",
                           kind=CheckpointCollectiveError):
                rows.hand_over(rollback, model_options)
    except BaseException:
        problems = rollback.run()
        if filled:
            problems.append(
                f"{' and '.join(filled)} (they hold the checkpoint's bytes, some of them "
                "perhaps: load a checkpoint again)"
            )
        if problems:
            warnings.warn(
                f"{what} failed, and not everything could be given back the state it had: "
                + "; ".join(problems),
                MpaccelRuntimeWarning,
                stacklevel=4,
            )
        raise
    finally:
        if not abandoned:
            reader.close()
            rows.close()
    finish(loaded)
    return loaded
