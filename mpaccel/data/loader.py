"""What every prepared dataloader shares (`PreparedLoader`, the base of data/sharded.py's
DataLoaderShard and data/dispatch.py's DataLoaderDispatcher): the DataLoader inside, the epoch
and position of the pass, device placement, the random generators synchronised as each pass
starts, and the position a checkpoint keeps (`state_dict`, checked field by field on load).
Also what is read off any DataLoader, prepared or not: its sampler (Accelerate's
`get_sampler`) and the options a rebuilt one keeps."""

from __future__ import annotations

import warnings
from collections.abc import Generator, Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader

from ..device import send_to_device
from ..errors import MpaccelRuntimeWarning
from ..rng import check_rng_types, rng_kind, synchronize_with
from .samplers import GeneratorReplay, Shares

__all__ = ["PreparedLoader", "get_sampler", "loader_options"]


class PreparedLoader:
    """What both prepared loaders share: the DataLoader inside (`base_dataloader`, which
    answers for any other attribute), the epoch and position of the pass, device placement,
    the random generators synchronised at the start of each pass, and `state_dict()`.

    Subclasses give `_pass(skip)`: the pass's (batch, is_last) pairs after its first `skip`
    batches. `remainder`: real samples in the last global round (0: it is full; -1: unknown).
    """

    def __init__(
        self,
        dataloader: DataLoader,
        sharding: Shares,
        dataset: Any,
        device: torch.device | None,
        gradient_state: Any,
        non_blocking: bool = False,
        rng_types: list[str] | None = None,
        replay: GeneratorReplay | None = None,
    ) -> None:
        self.base_dataloader: Any = dataloader  # a DataLoader, or torchdata's StatefulDataLoader
        self.sharding = sharding
        self.batch_sampler = dataloader.batch_sampler
        self.dataset = dataset
        self.device = device
        self.gradient_state = gradient_state
        self.non_blocking = non_blocking
        self.replay = replay
        self.synchronized_generator = replay.generator if replay is not None else None
        kinds = [rng_kind(kind) for kind in rng_types or ()]
        if replay is None:  # no generator of the user's to keep in step
            kinds = [kind for kind in kinds if kind != "generator"]
        self.rng_types = check_rng_types(kinds, self.synchronized_generator)
        self.use_stateful_dataloader = hasattr(dataloader, "load_state_dict")
        self._base_state: dict[str, Any] | None = None  # the stateful loader's, at the last batch
        self._base_resumes = False  # load_state_dict gave the stateful loader its state
        self.end_of_dataloader = False
        self.iteration = 0  # the epoch of the pass under way, or of the next one
        self._started = False  # a pass of `iteration` has begun: the next pass moves on
        self._skip = 0  # batches the next pass skips (skip_first_batches, or load_state)
        self._skip_counted = False  # ... and len() counts them (skip_first_batches only)
        self._skipped = 0  # batches the pass under way skipped, as len() counts them
        self._epoch_seen: int | None = None  # load_state: every batch of this epoch was seen
        self.batches_yielded = 0
        length = self.total_dataset_length
        total = self.total_batch_size
        self.remainder = -1
        if length is not None and total is not None and not sharding.drop_last:
            self.remainder = length % total

    def __getattr__(self, name: str) -> Any:
        # Anything else a script reads from its loader (num_workers, collate_fn, pin_memory...)
        # is the DataLoader's inside, as in Accelerate.
        if name == "base_dataloader":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.base_dataloader, name)

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        # isinstance(loader, torch.utils.data.DataLoader) holds, as for Accelerate's prepared
        # loaders: code that checks it (a trainer choosing its path) takes this for a DataLoader.
        # type(loader) is still the prepared class, and isinstance(loader, DataLoaderShard) holds.
        base = self.__dict__.get("base_dataloader")
        return type(self) if base is None else type(base)

    def __reduce_ex__(self, protocol: Any) -> tuple:
        # pickle's own way would check __class__ against the real class, and refuse.
        return (_new_loader, (type(self),), self.__dict__)

    def _total_length(self) -> int:
        return len(self.base_dataloader)

    def __len__(self) -> int:
        pending = self._skip if self._skip_counted else 0
        return self._total_length() - (pending or self._skipped)

    @property
    def total_batch_size(self) -> int | None:
        """Samples in one global round (None when the batch size is not known)."""
        return self.sharding.total_batch_size

    @property
    def batch_size(self) -> int | None:
        """Samples per batch on this process (None when not known)."""
        return self.sharding.process_batch_size

    @property
    def total_dataset_length(self) -> int | None:
        try:
            return len(self.dataset)
        except TypeError:
            return None

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass use `epoch`'s order (the same on every rank); a dataset with
        `set_epoch` (an iterable one, typically) is told the epoch too."""
        self.iteration = int(epoch)
        self._started = False
        self._tell_epoch()

    def _tell_epoch(self) -> None:
        sampler = self.get_sampler()
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.iteration)
        # The loader's dataset: the user's map-style one, or the IterableDatasetShard (which
        # passes the epoch on to the user's iterable dataset).
        dataset = self.base_dataloader.dataset
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(self.iteration)

    def get_sampler(self) -> Any:
        """The sampler that draws the order (None for an iterable dataset)."""
        return self.sharding.sampler

    def skip_first_batches(self, num_batches: int) -> None:
        """Make the next pass start after its first `num_batches` batches (resuming); len()
        counts the batches that pass gives until it has run to its end."""
        self._skip, self._skip_counted = int(num_batches), True
        self._base_resumes = False

    def _resume_at(self, num_batches: int) -> None:
        """load_state: the next pass starts after `num_batches` batches, as with
        skip_first_batches, but len() stays the whole epoch's: Accelerate's load_state leaves
        loaders alone, and scripts written for it work out where to resume from len(loader)."""
        self._skip, self._skip_counted = int(num_batches), False

    # -- the position, for checkpoints ------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Not collective. Where this rank's loader stands: the epoch and, mid-epoch, the batches
        it gave; with use_stateful_dataloader, the StatefulDataLoader's own state as of the
        last batch given ("dataloader"). A pass whose last batch is out counts as over."""
        # Every loader whose pass is under way counts (two loaders zipped, an auxiliary one
        # advanced with next()), not only the latest started. A pass whose last batch is out
        # has only to return: saved as over, so that the resumed run moves on to the next
        # epoch, unless the script asks for that same epoch again with set_epoch (its epoch
        # counter was saved too): then the pass is empty ("epoch_seen").
        running = self in getattr(self.gradient_state, "dataloader_references", ())
        mid_epoch = running and not self.end_of_dataloader
        state: dict[str, Any] = {
            "iteration": self.iteration,
            "started": self._started,
            "mid_epoch": mid_epoch,
            "epoch_seen": running and self.end_of_dataloader,
            "batches_yielded": self.batches_yielded if mid_epoch else 0,
            "total_batch_size": self.total_batch_size,
            "num_processes": self.sharding.num_processes,
        }
        if self.use_stateful_dataloader:
            base = self._base_state if running else None
            state["dataloader"] = base if base is not None else self.base_dataloader.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Not collective. Resume from `state_dict()`: mid-epoch, the next pass replays the saved
        epoch from the batch after the last one given (at another number of processes, from
        the first sample not yet consumed); between passes, the next pass moves on. Every field
        is checked first: a state this loader cannot take (ValueError) changes nothing."""
        position = _checked_position(state, self.sharding.num_processes)
        saved_world = position["num_processes"]
        base = state.get("dataloader")
        same_world = saved_world == self.sharding.num_processes
        mid_epoch = position["mid_epoch"]
        inside = mid_epoch and self.use_stateful_dataloader and base is not None and same_world
        skip = self._rescaled(position, saved_world) if mid_epoch and not inside else None
        if inside:
            self.base_dataloader.load_state_dict(base)
        # Between passes the next one moves on from the saved epoch; mid-epoch it replays the
        # saved epoch (minus what was seen). From here on, plain assignments.
        self.iteration = position["iteration"]
        self._started = position["started"] and not mid_epoch
        self._epoch_seen = self.iteration if position["epoch_seen"] else None
        self._base_resumes = False
        # The state says where the next pass starts, and nothing else does: no skip left from
        # before (an earlier load_state_dict, skip_first_batches), so that loading the
        # state_dict() taken before a load gives the loader back as it was.
        self._resume_at(skip or 0)
        if inside:
            # The loader inside resumes by itself: the pass only counts the batches given.
            self._base_resumes = True
            self.batches_yielded = position["batches_yielded"]

    def _rescaled(self, state: dict[str, Any], saved_world: int) -> int:
        batches = int(state["batches_yielded"])
        world = self.sharding.num_processes
        if saved_world == world:
            return batches
        saved_total, total = state["total_batch_size"], self.total_batch_size
        if saved_total is None or total is None:  # batches of no fixed size: count batches
            consumed, unit, what = batches * saved_world, world, "batches"
        else:
            consumed, unit, what = batches * saved_total, total, "samples"
        batches, rest = divmod(consumed, unit)
        if rest:
            warnings.warn(
                f"resuming at another world size: {consumed} {what} were consumed, not a whole "
                f"number of the new global batch ({unit} {what}); "
                f"{rest} {what} of the epoch will be seen twice",
                MpaccelRuntimeWarning,
                stacklevel=3,
            )
        return batches

    # -- iterating --------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        # Every pass is a new epoch, whether the last one ran to its end or was left early (a
        # break after K steps, a peek): otherwise a loop that stops each epoch early would see
        # the same batches every epoch. set_epoch() and load_state() say which epoch comes next.
        if self._started:
            self.iteration += 1
        self._started = True
        # Saved while this epoch's last batch was out, and resumed into the same epoch (a loop
        # that calls set_epoch(epoch) with its own, checkpointed, epoch counter): nothing is left.
        seen, self._epoch_seen = self._epoch_seen == self.iteration, None
        self._tell_epoch()
        skip, counted = self._skip, self._skip_counted
        self._skip, self._skip_counted = 0, False
        self._skipped = skip if counted else 0
        if self._base_resumes:  # the stateful loader inside starts where it was
            self._base_resumes = False
        else:
            self.batches_yielded = skip
        self._base_state = None
        self.gradient_state._add_dataloader(self)
        self.end_of_dataloader = False
        try:
            if seen:
                self.end_of_dataloader = True
                return
            batches = self._pass(skip)
            try:
                for current, last in batches:
                    self.end_of_dataloader = last
                    self.batches_yielded += 1
                    if self.device is not None:
                        current = send_to_device(current, self.device, self.non_blocking)
                    yield current
            finally:
                batches.close()  # left early: the pass's own clean-up runs now
            self.end_of_dataloader = True
            self._skipped = 0  # the resumed pass is over: len() counts whole passes again
        finally:
            self.gradient_state._remove_dataloader(self)

    def _pass(self, skip: int) -> Generator[tuple[Any, bool], None, None]:
        raise NotImplementedError

    def _synchronize(self) -> None:
        """Collective when there is anything to synchronise: rank 0's states of `rng_types`
        (the user's generator, torch's...) on every rank, as each pass starts."""
        if self.rng_types:
            from ..state import PartialState

            synchronize_with(PartialState().comm, self.rng_types, self.synchronized_generator)

    def _snapshot(self) -> None:
        """With a StatefulDataLoader inside: its state now (call it right after fetching the
        batch about to be given, before fetching the next one)."""
        if self.use_stateful_dataloader:
            self._base_state = self.base_dataloader.state_dict()


_REQUIRED = object()


def _field(state: dict[str, Any], key: str, kind: str, default: Any = _REQUIRED) -> Any:
    """state[key], checked: kind "flag" (a bool), "count" (an int >= 0) or "count or None"."""
    value = state.get(key, default)
    if value is _REQUIRED:
        raise ValueError(f"it has no {key!r}")
    if kind == "flag":
        ok = isinstance(value, bool)
    else:
        ok = (value is None and kind == "count or None") or (type(value) is int and value >= 0)
    if not ok:
        raise ValueError(f"{key}={value!r} is not a {kind}")
    return value


def _checked_position(state: Any, world: int) -> dict[str, Any]:
    """The fields of a loader's state_dict() (as a checkpoint holds it), each checked; a
    crafted or damaged one is refused with ValueError naming the field. Checkpoints written
    before "started", "epoch_seen" and "num_processes" were recorded take their defaults."""
    if not isinstance(state, dict):
        raise ValueError(f"the position is a {type(state).__name__}, not a dict")
    mid_epoch = _field(state, "mid_epoch", "flag")
    return {
        "iteration": _field(state, "iteration", "count"),
        "started": _field(state, "started", "flag", False),
        "mid_epoch": mid_epoch,
        "epoch_seen": _field(state, "epoch_seen", "flag", False),
        "batches_yielded": _field(state, "batches_yielded", "count") if mid_epoch else 0,
        "total_batch_size": _field(state, "total_batch_size", "count or None", None),
        "num_processes": _field(state, "num_processes", "count", world) or world,
    }


def _new_loader(cls: type) -> Any:
    """An empty prepared loader of class `cls`, for unpickling (its __dict__ comes after)."""
    return object.__new__(cls)


def get_sampler(dataloader: DataLoader) -> Any:
    """The sampler that draws `dataloader`'s order: of its batch sampler, or of the batch
    sampler given as `sampler` (a prepared loader's own answer for a prepared one)."""
    if issubclass(type(dataloader), PreparedLoader):
        return dataloader.get_sampler()  # type: ignore[attr-defined]
    if isinstance(dataloader.sampler, BatchSampler):
        return getattr(dataloader.sampler, "sampler", None)
    return getattr(dataloader.batch_sampler, "sampler", None)


def loader_options(dataloader: DataLoader) -> dict[str, Any]:
    """The options of `dataloader` a rebuilt one keeps (workers, collate_fn, pin_memory...)."""
    kwargs = {name: getattr(dataloader, name) for name in _COPIED if hasattr(dataloader, name)}
    if kwargs.get("num_workers", 0) == 0:
        kwargs.pop("prefetch_factor", None)
        kwargs.pop("persistent_workers", None)
    return kwargs


_COPIED = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)
