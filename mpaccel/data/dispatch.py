"""`DataLoaderDispatcher` (dispatch_batches=True): rank 0 alone reads the dataloader and sends
every rank its part of each global batch over MPI, with one scatter per batch (the control
plane: batches are host tensors until each rank moves its part to its device)."""

from __future__ import annotations

import itertools
import pickle
import traceback
from collections.abc import Callable, Generator, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from .. import tree
from ..errors import CollectiveError, RankFailure, with_hint
from ..split import share_bounds
from .loader import PreparedLoader
from .samplers import GeneratorReplay, Shares

__all__ = ["DataLoaderDispatcher", "concatenate_batches", "slice_batch"]


def concatenate_batches(batches: list[Any]) -> Any:
    """Batches of the same structure (tensors, or lists, tuples and mappings of them) put
    together along their first dimension."""

    def join(first: Any, *others: Any) -> Any:
        if not isinstance(first, torch.Tensor):
            raise TypeError(with_hint(
                f"dispatch_batches can only dispatch batches of tensors (or lists, tuples and "
                f"dicts of them), got a {type(first).__name__}: {first!r}",
                "return tensors from collate_fn, or pass dispatch_batches=False.",
            ))
        try:
            return torch.cat([first, *others], dim=0)
        except RuntimeError as exc:
            shapes = [tuple(b.shape) for b in (first, *others)]
            raise ValueError(with_hint(
                f"dispatch_batches cannot put together batches of shapes {shapes}: {exc}",
                "with dispatch_batches=True rank 0 joins the batches of one round into "
                "one; give them the same shape past the first dimension (pad them in "
                "collate_fn), pass split_batches=True (rank 0 then cuts each batch alone), or "
                "dispatch_batches=False (each rank reads its own batches).",
            )) from exc

    return tree.zip_map(join, *batches)


def slice_batch(
    data: Any,
    tensor_slice: slice,
    process_index: int | None = None,
    num_processes: int | None = None,
) -> Any:
    """The default `slice_fn_for_dispatch`: `tensor_slice` of every tensor of `data` (lists,
    tuples and mappings rebuilt with their types; anything else kept as it is)."""
    return tree.map(lambda v: v[tensor_slice] if isinstance(v, torch.Tensor) else v, data)


class _Array:
    """A CPU tensor sent as a numpy array: numpy pickles its bytes directly, torch through its
    serialiser (measured: pickling the parts took as long as reading them)."""

    __slots__ = ("array",)

    def __init__(self, array: Any) -> None:
        self.array = array


def _to_wire(data: Any) -> Any:
    def leaf(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.device.type == "cpu":
            try:
                return _Array(value.detach().numpy())
            except (TypeError, RuntimeError):  # bfloat16 and other dtypes numpy lacks
                return value
        return value

    return tree.map(leaf, data)


def _from_wire(data: Any) -> Any:
    return tree.map(lambda v: torch.from_numpy(v.array) if isinstance(v, _Array) else v, data)


def _rows(data: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor."""
    if isinstance(data, torch.Tensor):
        if data.dim() == 0:
            raise ValueError(with_hint(
                f"dispatch_batches cannot cut a batch that is a 0-d tensor ({data!r}) into parts",
                "a loader with batch_size=None must yield whole batches to be dispatched; "
                "or pass dispatch_batches=False.",
            ))
        return int(data.shape[0])
    if isinstance(data, Mapping):
        values = list(data.values())
    elif isinstance(data, (list, tuple)):
        values = list(data)
    else:
        values = []
    for value in values:
        try:
            return _rows(value)
        except LookupError:
            continue
    raise LookupError(f"no tensor in the batch {data!r} to cut into parts")


class Window(Sampler[Any]):
    """The batches (or items) of `batches` but those of [head, head + skip) of one pass: a
    resumed pass on rank 0 loads its first round (whose samples complete the last one) and then
    goes on after the rounds already given, without loading those."""

    def __init__(self, batches: Any) -> None:
        self.batches = batches
        self.head = 0
        self.skip = 0

    def __iter__(self) -> Iterator[Any]:
        # Read now, not at the first batch: the loader resets them once its pass has started.
        iterator = iter(self.batches)
        head = itertools.islice(iterator, self.head)
        return itertools.chain(head, itertools.islice(iterator, self.skip, None))

    def __len__(self) -> int:
        return len(self.batches)


class DataLoaderDispatcher(PreparedLoader):
    """A prepared dataloader that only rank 0 reads (dispatch_batches=True). Each global batch,
    N of the loader's batches put together (one batch with split_batches=True), is cut into N
    equal parts with `slice_fn` and rank r receives part r. The last global batch, when its
    samples do not divide evenly, is completed with the epoch's first samples and every rank
    gets ceil(m / N) of them; `remainder` then says how many are real (gather_for_metrics drops
    the rest). Every rank gets the same number of batches (even_batches does not apply, as in
    Accelerate).

    Collective: every rank iterates it, one scatter per batch. An exception while rank 0 reads
    (in the dataset, collate_fn, or joining batches of different shapes) is raised on every
    rank as the same CollectiveError naming rank 0."""

    def __init__(
        self,
        dataloader: DataLoader,
        sharding: Shares,
        dataset: Any,
        device: torch.device | None,
        gradient_state: Any,
        non_blocking: bool = False,
        replay: GeneratorReplay | None = None,
        slice_fn: Callable[..., Any] | None = None,
        window: Window | None = None,
        order_sampler: Any = None,
    ) -> None:
        super().__init__(
            dataloader, sharding, dataset, device, gradient_state, non_blocking, None, replay
        )
        self.split_batches = sharding.split_batches
        self.slice_fn = slice_batch if slice_fn is None else slice_fn
        self._window = window
        self._order_sampler = order_sampler
        if window is not None and dataloader.batch_sampler is window:
            self.batch_sampler = window.batches  # the loader's own batch sampler, as given
        self.remainder = -1  # known at the last batch of each pass

    def get_sampler(self) -> Any:
        return self._order_sampler

    def _total_length(self) -> int:
        whole = len(self.base_dataloader)
        n = self.sharding.num_processes
        if self.split_batches:
            return whole
        if self.sharding.drop_last:
            return whole // n
        return -(-whole // n)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.use_stateful_dataloader and self.sharding.process_index != 0:
            state["dataloader"] = None  # only rank 0 reads: its loader's state is the one
        return state

    def _pass(self, skip: int) -> Generator[tuple[Any, bool], None, None]:
        from ..state import PartialState

        comm = PartialState().comm
        what = "dispatch_batches (rank 0 reads the next batch)"
        rounds = self._rounds(skip, comm.size) if comm.rank == 0 else None
        try:
            while True:
                messages: list[Any] | None = None
                error: Exception | None = None
                if rounds is not None:
                    try:
                        messages = self._messages(next(rounds, None), comm.size)
                    except Exception as exc:  # sent to every rank, raised everywhere alike
                        error = exc
                        host = comm.hosts[0] if comm.hosts else "?"
                        lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
                        failure = RankFailure(0, host, type(exc).__name__, str(exc), "".join(lines))
                        messages = [("error", failure)] * comm.size
                message = comm.scatter(messages, 0, what)
                if isinstance(message, bytes):
                    message = _from_wire(pickle.loads(message))
                if message[0] == "error":
                    raise CollectiveError(
                        what,
                        {0: message[1]},
                        "rank 0 reads every rank's batches (dispatch_batches=True): the cause is "
                        "in its traceback (CollectiveError.tracebacks()); dispatch_batches=False "
                        "lets each rank read its own.",
                    ) from error
                if message[0] == "end":
                    return
                _, part, last, remainder = message
                if last:
                    self.remainder = remainder
                yield part, last
                if last:
                    return
        finally:
            if rounds is not None:
                rounds.close()

    @staticmethod
    def _messages(item: tuple[list[Any], bool, int] | None, n: int) -> list[Any]:
        """Rank 0: what each rank receives. The other ranks' parts are pickled here, where a
        failure (an object pickle cannot take) is still rank 0's to report to everyone."""
        if item is None:
            return [("end",)] * n
        parts, last, remainder = item
        wire = [
            pickle.dumps(("batch", _to_wire(part), last, remainder), pickle.HIGHEST_PROTOCOL)
            for part in parts[1:]
        ]
        return [("batch", parts[0], last, remainder), *wire]

    def _rounds(self, skip: int, n: int) -> Generator[tuple[list[Any], bool, int], None, None]:
        """Rank 0: each global batch's N parts, whether it is the last, and its remainder."""
        per_round = 1 if self.split_batches else n
        head = per_round if skip and not self.sharding.drop_last else 0
        if self.replay is not None:
            self.replay.begin(self.iteration)
        try:
            if self._window is not None:  # left out as index lists: none of them is loaded
                self._window.head, self._window.skip = head, skip * per_round - head
                try:
                    iterator = iter(self.base_dataloader)
                finally:
                    self._window.head = self._window.skip = 0
                skipped = 0
            else:  # a stream: read to get past what was given
                iterator = iter(self.base_dataloader)
                skipped = skip * per_round - head
            first = None
            if head:  # the epoch's first samples, to complete its last batch as before
                first = self._head(self._join(list(itertools.islice(iterator, per_round))), n)
            for _ in range(skipped):
                next(iterator, None)
            pending = list(itertools.islice(iterator, per_round))
            while pending:
                if len(pending) < per_round and self.sharding.drop_last:
                    return  # an incomplete last round is dropped, like the incomplete batch
                batch = self._join(pending)
                if first is None:
                    first = self._head(batch, n)
                self._snapshot()
                upcoming = list(itertools.islice(iterator, per_round))
                parts, remainder = self._deal(batch, first, not upcoming, n)
                yield parts, not upcoming, remainder
                pending = upcoming
        finally:
            if self.replay is not None:
                self.replay.end(self.iteration)

    @staticmethod
    def _join(batches: list[Any]) -> Any:
        return batches[0] if len(batches) == 1 else concatenate_batches(batches)

    def _head(self, batch: Any, n: int) -> Any:
        return self.slice_fn(batch, slice(0, n), process_index=0, num_processes=n)

    def _deal(self, batch: Any, first: Any, last: bool, n: int) -> tuple[list[Any], int]:
        """The N parts of a global batch, and its remainder: the real samples of the last one
        when it is not full (0 when it is, or the batch is not the last)."""
        rows = _rows(batch)
        total = self.sharding.total_batch_size
        remainder = rows if last and total is not None and rows != total else 0
        if rows % n and last and not self.sharding.drop_last:
            # Completed with the epoch's first samples: every rank gets ceil(rows / N).
            per = rows // n + 1
            if not _rows(first):
                raise ValueError("dispatch_batches: the epoch's first batch is empty")
            while _rows(batch) < per * n:
                batch = concatenate_batches([batch, first])
            bounds = [(r * per, (r + 1) * per) for r in range(n)]
            remainder = rows
        else:
            # Within the epoch a batch of another size (batches of varying size) is dealt
            # whole, the first ranks taking one sample more (Accelerate would drop the extra).
            bounds = [share_bounds(rows, r, n) for r in range(n)]
        parts = [
            self.slice_fn(batch, slice(start, end), process_index=r, num_processes=n)
            for r, (start, end) in enumerate(bounds)
        ]
        return parts, remainder
