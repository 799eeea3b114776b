"""The checkpoint entry points, each in its collective steps: save_model / load_model_state,
save_state / load_state.

They decide what the Accelerator's methods only pass on: who writes a save (every rank
together, or one rank alone: who_saves), the one directory the ranks use (agree_directory),
the format of a model (safetensors or HDF5, whole tensors or each rank's rows: decided once, in
save_model, from the model's own tensors), and which layout a directory to load holds (mpaccel's
or Accelerate's). The functions taking a `comm` are collective. They take the objects to save by
name (TrainingState), never the Accelerator that holds them. Where a checkpoint goes is
naming.py's; writer.py writes the files, reader.py reads them (docs/checkpoint-format.md).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import torch

from .. import envvars
from ..comm import Comm, NullComm, agreement
from ..comm.presence import ALONE, COLLECTIVE, OTHERS
from ..config import ProjectConfiguration
from ..errors import (
    CheckpointCollectiveError,
    CheckpointError,
    MpaccelRuntimeWarning,
    StalledIOError,
)
from . import accelerate_layout, rawio
from .async_save import AsyncSaver, snapshot, threads_ok
from .format import parse_size
from .naming import (
    MODEL_STEM,
    STATE_STEM,
    latest_checkpoint,
    resolve_input,
    resolve_output,
    rotate_together,
)
from .reader import CheckpointReader
from .safetensors import save_rows, save_safetensors, tied_aliases, warn_untied
from .sharded import state as sharded_state
from .training import (
    Rollback,
    TrainingState,
    apply_states,
    apply_tensors,
    collect,
    finish,
    holds_dtensors,
    model_load_options,
    model_state,
    read_back,
)
from .writer import write_checkpoint

# Seconds a save waits for ranks that are computing (ranks waiting in a collective answer at
# once). Long enough that ranks all calling a save, but some late under load, still save
# together; only a rank alone while the others compute pays it.
DEFAULT_WAIT = 10.0


def solo_wait() -> float:
    """Seconds a save waits for the other ranks before saving alone (MPACCEL_SOLO_SAVE_WAIT)."""
    value = envvars.get_float("solo_save_wait")
    return DEFAULT_WAIT if value is None else value


def who_saves(comm: Any, what: str, directory: Any, wait: float | None = None) -> str:
    """Not collective. COLLECTIVE, ALONE or OTHERS for the save `what` into `directory` (None:
    the automatic one). At size 1 (a NullComm) always COLLECTIVE."""
    presence = getattr(comm, "presence", None)
    if comm.size == 1 or presence is None:
        return COLLECTIVE
    key = f"{what}:{os.path.abspath(os.fspath(directory)) if directory is not None else ''}"
    return str(presence.who(key, solo_wait() if wait is None else wait))


def agree_directory(comm: Any, path: Any, what: str, fact: Any = None) -> tuple[str, Any]:
    """Collective: (rank 0's directory, rank 0's `fact` about it), one all-gather. Ranks that
    passed another path warn, naming it and rank 0's (rank 0 warns naming every such rank):
    Accelerate writes the shared files from the main process into its directory, so rank 0's
    is the one that holds the checkpoint."""
    mine = os.path.abspath(os.fspath(path))
    everyone = comm.allgather((mine, fact), what)
    chosen, chosen_fact = everyone[0]
    others = {rank: p for rank, (p, _) in enumerate(everyone) if p != chosen}
    if others and (comm.rank == 0 or comm.rank in others):
        shown = others if comm.rank == 0 else {comm.rank: mine}
        listed = ", ".join(f"rank {rank} passed {p!r}" for rank, p in sorted(shown.items()))
        warnings.warn(
            f"{what}: the ranks passed different directories ({listed}; rank 0 passed "
            f"{chosen!r}): every rank uses rank 0's. Pass the same directory on every rank "
            "(on a file system they all see).",
            MpaccelRuntimeWarning,
            stacklevel=4,
        )
    return (os.fspath(path) if not others else chosen), chosen_fact


def save_model(
    comm: Comm,
    module: torch.nn.Module,
    save_directory: Any,
    max_shard_size: Any = "10GB",
    *,
    safe_serialization: bool = False,
) -> None:
    """Collective when every rank calls it; also callable by one rank alone, which then writes
    everything (who_saves; docs/checkpoint-format.md, "Saving from one rank"). The (unwrapped)
    module's state_dict in shards of at most `max_shard_size`, written by different ranks in
    parallel (shard i by rank i mod N): with `safe_serialization` Hugging Face's safetensors
    layout (safetensors.py), otherwise mpaccel's HDF5 shards + `model.index.json`. A module
    holding DTensors (fully sharded) is written the same way, each rank writing its own rows of
    the full tensors in place (no rank gathers a tensor)."""
    who = who_saves(comm, "save_model", save_directory)
    if who == OTHERS:
        return
    if who == ALONE:
        comm = NullComm(default_timeout=comm.default_timeout)
    directory = os.fspath(save_directory)
    sharded = holds_dtensors(module)  # the one choice of format the rest follows
    if safe_serialization:
        state = model_state(comm, module)
        if not sharded:
            save_safetensors(comm, state, directory, max_shard_size)
            return
        aliases = tied_aliases(module) & state.keys()  # stored once, as unsharded
        if aliases:
            warn_untied(sorted(aliases), stacklevel=3)
            state = {k: v for k, v in state.items() if k not in aliases}
        save_rows(comm, state, directory, max_shard_size)
        return
    try:
        limit = parse_size(max_shard_size)
    except ValueError as exc:
        raise CheckpointError(str(exc), "for example max_shard_size='10GB' or '500MB'.") from exc
    if sharded:
        from .sharded.export import export_full

        export_full(comm, directory, module.state_dict(), limit)
        return
    write_checkpoint(
        comm,
        directory,
        MODEL_STEM,
        {"model": model_state(comm, module)},
        max_shard_bytes=limit,
        metadata={"kind": "model"},
    )


def load_model_state(directory: str) -> dict:
    """Not collective: the state_dict saved by save_model (checksums verified)."""
    with CheckpointReader(os.fspath(directory), MODEL_STEM) as reader:
        return reader.component("model")


def save_state(
    comm: Comm,
    objects: TrainingState,
    output_dir: Any = None,
    *,
    project: ProjectConfiguration | None = None,
    saver: AsyncSaver | None = None,
    async_save: bool = False,
    before: Callable[[Comm, str], TrainingState] | None = None,
) -> str:
    """Collective when every rank calls it; also callable by one rank alone, which then writes
    everything it holds (who_saves; docs/checkpoint-format.md, "Saving from one rank"), unless
    `objects` holds sharded ones (each rank's rows: every rank must save). Save `objects` (and
    each rank's RNG states) as a checkpoint committed atomically, in `output_dir` (rank 0's,
    when the ranks pass different ones: agree_directory) or, with
    `project.automatic_checkpoint_naming`, the next numbered directory of `project.project_dir`
    (older ones rotated: `total_limit`; then `project.iteration` moves on). `async_save`:
    snapshot to host memory and write in the background thread of `saver` (which a second save,
    and load_state, wait for); a rank saving alone writes synchronously. `before(comm,
    directory)`, once the saving ranks and the directory are known (the directory is "" if it
    cannot be named; the save then reports why), gives the objects to save instead (the
    Accelerator's pre-hooks, which may leave models out). Returns the directory."""
    config = project if project is not None else ProjectConfiguration()
    who = who_saves(comm, "save_state", output_dir)
    if who != COLLECTIVE and objects.sharded:
        raise CheckpointError(
            (f"rank(s) {[r for r in range(comm.size) if r != comm.rank]} did not join the "
             f"save: only rank {comm.rank} is saving" if who == ALONE else
             f"rank {comm.rank} came to save_state after another rank began it alone")
            + ": a sharded (FSDP) checkpoint holds the rows each rank owns, so every rank "
            "saves its own",
            "call save_state on every rank (not under `if accelerator.is_main_process:`); "
            "it writes each file once.",
        )
    if who == OTHERS:  # another rank wrote it alone
        if config.automatic_checkpoint_naming:
            config.iteration += 1
        return os.fspath(output_dir) if output_dir is not None else ""
    if who == ALONE:
        comm = NullComm(default_timeout=comm.default_timeout)
        async_save = False  # the background writer's communicator spans every rank
    elif output_dir is not None:
        output_dir, _ = agree_directory(comm, output_dir, "save_state")
    elif config.automatic_checkpoint_naming:
        # saves by the main process alone advanced its number only: follow rank 0's
        config.iteration = comm.bcast(config.iteration, what="save_state (its number)")
    if before is not None:
        directory = ""
        try:  # an error here is the checkpoint's to report, collectively, below
            directory = resolve_output(config, output_dir)
        except Exception:
            pass
        objects = before(comm, directory)
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
    rows = (sharded_state.collect(comm, objects, _saving(directory), copy=async_save)
            if objects.sharded else None)

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
        extra = sharded_state.write(comm, directory, rows) if rows is not None else {}
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


def load_state(
    comm: Comm,
    objects: TrainingState,
    input_dir: Any = None,
    *,
    project: ProjectConfiguration | None = None,
    saver: AsyncSaver | None = None,
    model_options: dict[str, Any] | None = None,
    node_share: tuple[int, int] = (0, 1),
    allow_pickle: bool | None = None,
    before: Callable[[Comm, str | None], TrainingState] | None = None,
) -> str:
    """Collective. Give `objects` the states of the checkpoint in `input_dir` (rank 0's, when
    the ranks pass different ones: agree_directory; None: the latest complete one of
    `project`, whose iteration then follows it), all or nothing on every rank. A directory
    that Accelerate's save_state wrote loads through accelerate_layout.py (its pickles only
    with `allow_pickle`). `model_options` go to the models' load_state_dict (strict, assign).
    `node_share`: (index, count) of this rank among the ranks of its node, which read the
    same files through one page cache: each verifies 1/count of the checksums. `before(comm,
    directory)`, once the directory is agreed (None: no checkpoint found), gives the objects
    to load instead (the Accelerator's pre-hooks). A failed load drops the state that loading
    created in the `sharded` objects (their `undo()`). Returns the directory."""
    config = project if project is not None else ProjectConfiguration()
    accelerate_dir = False
    if input_dir is not None:
        input_dir, accelerate_dir = agree_directory(
            comm, input_dir, "load_state", accelerate_layout.recognise(os.fspath(input_dir))
        )
    if before is not None:
        directory = input_dir
        if directory is None and config.project_dir is not None:
            latest = latest_checkpoint(config.project_dir)
            directory = latest[1] if latest is not None else None
        objects = before(comm, directory)
    try:
        if accelerate_dir:
            if saver is not None:
                saver.wait()
            accelerate_layout.load_accelerate_state(
                comm, objects, input_dir, allow_pickle=allow_pickle,
                model_options=model_options or {},
            )
            return input_dir
        return _load_mpaccel(comm, objects, input_dir, config, saver, model_options, node_share)
    except BaseException:  # a fresh optimizer is fresh again
        for obj in objects.sharded.values():
            undo = getattr(obj, "undo", None)
            if undo is not None:
                undo()
        raise


def _load_mpaccel(
    comm: Comm,
    objects: TrainingState,
    input_dir: str | None,
    config: ProjectConfiguration,
    saver: AsyncSaver | None,
    options: dict[str, Any] | None,
    node_share: tuple[int, int],
) -> str:
    """load_state() of a directory that mpaccel wrote."""
    model_options = model_load_options(options)
    if saver is not None:
        saver.wait()
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
    if objects.sharded or sharded_state.SAVE_ID in reader.index.metadata:
        with agreement(comm, what, kind=CheckpointCollectiveError, cleanup=close):
            rows = sharded_state.ShardedLoad(objects, reader)
    if rows is not None and rows.targets:
        with agreement(comm, what, kind=CheckpointCollectiveError, cleanup=close,
                       passing=(CheckpointCollectiveError,)):
            rows.read(comm, what, limit, strict)
        objects = rows.rest
    loaded = _load(comm, objects, reader, what, limit, strict, node_share, model_options, rows)
    if number is not None:
        config.iteration = number + 1
    for note in loaded.notes if comm.rank == 0 else []:
        warnings.warn(note, MpaccelRuntimeWarning, stacklevel=4)
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
    rows: sharded_state.ShardedLoad | None,
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
            abandoned = isinstance(exc, StalledIOError) or not isinstance(exc, Exception)
            raise

    def fill() -> None:
        filled.append("the models' and optimizers' tensors read in place")
        io(lambda: reader.fill(loaded.held, follow=node_share[0] > 0))

    def fill_rows(rows: sharded_state.ShardedLoad) -> None:
        filled.append(f"the tensors of {', '.join(rows.names())} read in place")
        io(rows.fill)

    try:
        with agreement(comm, what, kind=CheckpointCollectiveError):
            loaded = io(lambda: read_back(objects, reader, comm.rank, comm.size, strict))
        with agreement(comm, what, kind=CheckpointCollectiveError):
            apply_states(objects, loaded, reader, rollback)
        with agreement(comm, what, kind=CheckpointCollectiveError):
            apply_tensors(objects, loaded, reader, rollback, fill, model_options)
        if rows is not None and rows.targets:
            with agreement(comm, what + " (reading the sharded state in place)",
                           kind=CheckpointCollectiveError):
                fill_rows(rows)
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
                stacklevel=5,
            )
        raise
    finally:
        if not abandoned:
            reader.close()
            if rows is not None:
                rows.close()
    finish(loaded)
    return loaded
