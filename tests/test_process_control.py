"""Accelerate's process-control API. Every test body here runs at size 1 (plain pytest) and under
mpiexec -n 2 / -n 4 through the mpaccel pytest plugin."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import numpy as np
import pytest
import torch

from mpaccel import (
    Accelerator,
    AcceleratorState,
    CollectiveError,
    CollectiveTimeoutError,
    DistributedType,
    GradientState,
    PartialState,
)
from mpaccel.errors import ConfigurationError
from mpaccel.split import share_bounds
from mpaccel.state import PartialState as PartialStateFromModule
from mpaccel.utils import GradientAccumulationPlugin, InitProcessGroupKwargs, gather_object

# Also run under Open MPI's mpiexec (docs/testing.md, "Which stage runs what").
pytestmark = pytest.mark.openmpi


def test_module_paths_are_accelerates():
    assert PartialStateFromModule is PartialState
    from mpaccel.state import AcceleratorState as A
    from mpaccel.state import GradientState as G

    assert (A, G) == (AcceleratorState, GradientState)


def test_documented_attributes(state, comm):
    assert state.num_processes == comm.size
    assert state.process_index == comm.rank
    assert 0 <= state.local_process_index < state.local_num_processes
    assert state.is_main_process == (comm.rank == 0)
    assert state.is_last_process == (comm.rank == comm.size - 1)
    assert state.is_local_main_process == (state.local_process_index == 0)
    assert state.device == torch.device("cpu")
    assert state.mixed_precision == "no"
    assert state.debug is False
    assert state.use_distributed == (comm.size > 1)
    expected = DistributedType.NO if comm.size == 1 else DistributedType.MULTI_CPU
    assert state.distributed_type == expected
    assert torch.distributed.is_initialized() == (comm.size > 1)
    # layout facts agree across ranks
    layouts = comm.allgather((state.node_index, state.local_process_index, state.num_nodes))
    assert sorted(i for n, i, _ in layouts if n == state.node_index) == list(
        range(state.local_num_processes)
    )


def test_shared_state(state):
    again = PartialState()
    assert again.__dict__ is state.__dict__
    assert again.process_index == state.process_index
    PartialState._reset_state()
    assert not state.initialized  # every instance sees the reset
    fresh = PartialState()
    assert fresh.initialized and state.initialized and state.process_index == fresh.process_index


def test_unknown_kwarg_is_rejected(state):
    with pytest.raises(TypeError, match="bogus"):
        PartialState(bogus=1)


def test_init_process_group_kwargs(comm):
    AcceleratorState._reset_state(True)
    kwargs = InitProcessGroupKwargs(timeout=timedelta(seconds=77)).to_kwargs()
    assert kwargs == {"timeout": timedelta(seconds=77)}
    state = PartialState(**kwargs)
    assert state.default_timeout == 77
    AcceleratorState._reset_state(True)
    with pytest.raises(AttributeError, match="no field 'timeot'"):
        InitProcessGroupKwargs().timeot = 3  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="positive"):
        InitProcessGroupKwargs(timeout=-1)


def test_one_timeout_for_mpaccel_and_torch_distributed(comm, monkeypatch):
    """MPACCEL_TIMEOUT (or InitProcessGroupKwargs(timeout=), which wins) is the deadline of
    mpaccel's collectives and of the torch.distributed process group alike; without either,
    mpaccel's default (1800 s) is handed to torch too (NCCL's own default is 10 min)."""
    from mpaccel import distributed

    given = []
    real = distributed.init_process_group

    def spy(*args, **kwargs):
        given.append(args[5] if len(args) > 5 else kwargs.get("timeout"))
        return real(*args, **kwargs)

    monkeypatch.setattr(distributed, "init_process_group", spy)
    cases = [
        ({"MPACCEL_TIMEOUT": "55"}, {}, 55),
        ({"MPACCEL_TIMEOUT": "55"}, {"timeout": timedelta(seconds=66)}, 66),
        ({}, {}, None),
    ]
    for env, kwargs, seconds in cases:
        monkeypatch.delenv("MPACCEL_TIMEOUT", raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        AcceleratorState._reset_state(True)
        state = PartialState(**InitProcessGroupKwargs(**kwargs).to_kwargs())
        expected = timedelta(seconds=seconds or 1800)
        assert given[-1] == expected, (env, kwargs)
        assert state.default_timeout == (seconds or 1800)
    AcceleratorState._reset_state(True)


def test_accelerator_state_and_mixed_precision(comm):
    AcceleratorState._reset_state(True)
    acc_state = AcceleratorState(mixed_precision="bf16")
    assert acc_state.initialized
    assert acc_state.mixed_precision == "bf16"
    assert PartialState().mixed_precision == "bf16"
    assert acc_state.process_index == comm.rank  # delegated to PartialState
    with pytest.raises(ConfigurationError, match="cannot switch"):
        AcceleratorState(mixed_precision="fp16")
    with pytest.raises(ConfigurationError, match="not one of"):
        AcceleratorState._reset_state()
        AcceleratorState(mixed_precision="fp32")
    with pytest.raises(ConfigurationError, match="DeepSpeed"):
        AcceleratorState().get_deepspeed_plugin("default")
    AcceleratorState._reset_state(True)


def test_gradient_state_fields():
    GradientState._reset_state()
    gs = GradientState(GradientAccumulationPlugin(num_steps=4, adjust_scheduler=False))
    assert gs.num_steps == 4 and gs.adjust_scheduler is False
    assert gs.sync_with_dataloader is True and gs.sync_each_batch is False
    assert gs.sync_gradients is True
    assert gs.end_of_dataloader is False and gs.remainder == -1
    assert gs.active_dataloader is None and gs.dataloader_references == [None]
    assert gs.is_xla_gradients_synced is False
    assert GradientState().num_steps == 4  # shared

    class Loader:
        end_of_dataloader = True
        remainder = 3

    loader = Loader()
    gs._add_dataloader(loader)
    assert gs.in_dataloader and gs.end_of_dataloader and gs.remainder == 3
    gs._remove_dataloader(loader)
    assert not gs.in_dataloader
    GradientState._reset_state()


def test_accumulation_arguments_are_exclusive():
    with pytest.raises(ValueError, match="either"):
        Accelerator(
            gradient_accumulation_steps=2,
            gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2),
        )


def test_accelerator_exposes_state(accelerator, comm):
    assert accelerator.process_index == comm.rank
    assert accelerator.num_processes == comm.size
    assert accelerator.device == torch.device("cpu")
    assert accelerator.is_main_process == (comm.rank == 0)
    assert accelerator.state.initialized
    assert isinstance(accelerator.gradient_state, GradientState)
    assert accelerator.gradient_accumulation_steps == 1


def test_decorators(accelerator, comm):
    calls = []

    @accelerator.on_main_process
    def main_only():
        calls.append("main")
        return "ran"

    @accelerator.on_local_main_process
    def local_main_only():
        calls.append("local")

    @accelerator.on_last_process
    def last_only():
        calls.append("last")

    @accelerator.on_process(process_index=comm.size - 1)
    def on_last_index():
        calls.append("index")

    @accelerator.on_local_process(local_process_idx=0)
    def on_local_zero():
        calls.append("local0")

    @accelerator.on_local_process(local_process_index=0)
    def on_local_zero_long():
        calls.append("local0b")

    @accelerator.on_main_process()
    def with_parentheses():
        calls.append("paren")

    result = main_only()
    local_main_only()
    last_only()
    on_last_index()
    on_local_zero()
    on_local_zero_long()
    with_parentheses()
    expected = []
    if comm.rank == 0:
        expected.append("main")
    if accelerator.is_local_main_process:
        expected.append("local")
    if comm.rank == comm.size - 1:
        expected += ["last", "index"]
    if accelerator.local_process_index == 0:
        expected += ["local0", "local0b"]
    if comm.rank == 0:
        expected.append("paren")
    assert calls == expected
    assert result == ("ran" if comm.rank == 0 else None)
    assert main_only.__name__ == "main_only"
    with pytest.raises(ConfigurationError, match="process_index"):
        accelerator.on_process()


def test_state_decorators_too(state, comm):
    @state.on_process(process_index=0)
    def first():
        return state.process_index

    assert first() == (0 if comm.rank == 0 else None)


def test_index_decorators_at_size_one_run_whatever_the_index(state, comm):
    # As Accelerate does when not distributed, so that a script written for N processes runs
    # all of its work as plain `python`; at size N an index no rank has runs nowhere.
    @state.on_process(process_index=3)
    def third():
        return "ran"

    @state.on_local_process(local_process_index=5)
    def fifth_local():
        return "ran"

    @state.on_process(process_index=comm.size)
    def beyond():
        return "ran"

    alone = comm.size == 1
    assert third() == ("ran" if alone or comm.rank == 3 else None)
    assert fifth_local() == ("ran" if alone or state.local_process_index == 5 else None)
    assert comm.allgather(beyond()) == (["ran"] if alone else [None] * comm.size)


def test_print_once_per_node(accelerator, capsys):
    accelerator.print("hello", "node")
    out = capsys.readouterr().out
    assert out == ("hello node\n" if accelerator.is_local_main_process else "")


def _log_path(mpi_tmp_path):
    return mpi_tmp_path / "order.log"


def _append(path, text):
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{text}\n".encode())
    finally:
        os.close(fd)


@pytest.mark.parametrize("local", [False, True], ids=["main", "local_main"])
def test_goes_first_ordering(accelerator, mpi_tmp_path, comm, local):
    log = _log_path(mpi_tmp_path)
    first = accelerator.is_local_main_process if local else accelerator.is_main_process
    block = accelerator.local_main_process_first if local else accelerator.main_process_first
    with block():
        _append(log, f"enter {int(first)}")
        if first:
            time.sleep(0.3)  # the others must still wait
        _append(log, f"exit {int(first)}")
    accelerator.wait_for_everyone()
    lines = log.read_text().splitlines()
    n_first = comm.allreduce(int(first))
    assert len(lines) == 2 * comm.size
    # every "first" process enters and leaves before any other process enters
    assert sorted(lines[: 2 * n_first]) == ["enter 1"] * n_first + ["exit 1"] * n_first
    assert all(line.endswith(" 0") for line in lines[2 * n_first :])


def test_failure_in_main_process_first_is_collective(accelerator, comm):
    with pytest.raises(CollectiveError) as info:
        with accelerator.main_process_first():
            if accelerator.is_main_process:
                raise FileNotFoundError("weights.pth")
    assert info.value.failed_ranks == [0]
    assert "FileNotFoundError: weights.pth" in str(info.value)
    accelerator.wait_for_everyone()  # still in step afterwards


def test_failure_after_main_in_main_process_first(accelerator, comm):
    with pytest.raises(CollectiveError) as info:
        with accelerator.main_process_first():
            if accelerator.is_last_process:
                raise KeyError("tokenizer")
    assert info.value.failed_ranks == [comm.size - 1]


@pytest.mark.parametrize("failing", ["first", "last"])
def test_failure_in_nested_goes_first_blocks_is_collective(accelerator, comm, failing):
    """A library's local_main_process_first inside the user's main_process_first: the inner
    gate's error, agreed on every rank already, was agreed again by the outer block on the
    ranks still inside it; the others had left, so some ranks got a CollectiveMismatchError
    (naming no one who failed) and the communicator was left unusable."""
    bad = 0 if failing == "first" else comm.size - 1
    with pytest.raises(CollectiveError) as info:
        with accelerator.main_process_first():
            with accelerator.local_main_process_first():
                if accelerator.process_index == bad:
                    raise FileNotFoundError("vocab.json")
    assert info.value.failed_ranks == [bad]
    assert "FileNotFoundError: vocab.json" in str(info.value)
    accelerator.wait_for_everyone()  # still in step afterwards


def test_triggers(accelerator, comm):
    assert accelerator.check_trigger() is False
    if comm.rank == comm.size - 1:
        accelerator.set_trigger()
    assert accelerator.check_trigger() is True
    assert accelerator.check_trigger() is False  # reset everywhere after being seen
    for _ in range(3):
        accelerator.set_trigger()
    assert accelerator.check_trigger() is True
    assert accelerator.check_trigger() is False


def test_wait_for_everyone(accelerator, comm):
    if accelerator.is_main_process:
        time.sleep(0.2)
    start = time.monotonic()
    accelerator.wait_for_everyone()
    waited = time.monotonic() - start
    if comm.size > 1 and not accelerator.is_main_process:
        assert waited > 0.1
    accelerator.wait_for_everyone(timeout=timedelta(seconds=30))


@pytest.mark.mpi(min_size=2)
def test_timeout_names_the_missing_rank(state, comm):
    late = comm.size - 1
    if comm.rank == late:
        time.sleep(2.5)
        state.wait_for_everyone()  # completes: the others' barrier requests are still posted
        return
    with pytest.raises(CollectiveTimeoutError) as info:
        state.wait_for_everyone(timeout=1.0)
    assert info.value.missing == [late]
    assert info.value.arrived == [r for r in range(comm.size) if r != late]
    assert f"rank(s) {late} (" in str(info.value) and "HINT" in str(info.value)


@pytest.mark.mpi(min_size=2)
def test_signal_handled_while_waiting(state, comm):
    if comm.rank == 0:
        seen = []
        previous = signal.signal(signal.SIGALRM, lambda *_: seen.append(time.monotonic()))
        try:
            start = time.monotonic()
            signal.setitimer(signal.ITIMER_REAL, 0.3)
            state.wait_for_everyone()
            end = time.monotonic()
        finally:
            signal.signal(signal.SIGALRM, previous)
        assert seen, "the handler never ran"
        assert seen[0] - start < 0.9 < end - start  # ran during the wait, not after it
    else:
        time.sleep(1.2)
        state.wait_for_everyone()


@pytest.mark.parametrize(
    ("inputs", "shares"),
    [
        (
            ["A", "B", "C"],
            {1: [["A", "B", "C"]], 2: [["A", "B"], ["C"]], 4: [["A"], ["B"], ["C"], []]},
        ),
        (
            tuple("ABCDE"),
            {
                1: [tuple("ABCDE")],
                2: [tuple("ABC"), tuple("DE")],
                4: [("A", "B"), ("C",), ("D",), ("E",)],
            },
        ),
    ],
)
def test_split_between_processes_sequences(state, comm, inputs, shares):
    with state.split_between_processes(inputs) as mine:
        assert mine == shares[comm.size][comm.rank]


def test_split_padding_repeats_last_input(state, comm):
    n, r = comm.size, comm.rank
    per = -(-3 // n)

    def expected(items):  # this rank's share, then the input's last element up to `per`
        start, end = share_bounds(len(items), r, n)
        return list(items[start:end]) + [items[-1]] * (per - (end - start))

    with state.split_between_processes(["A", "B", "C"], apply_padding=True) as mine:
        assert mine == expected(["A", "B", "C"])
    with state.split_between_processes(("A", "B", "C"), apply_padding=True) as mine:
        assert isinstance(mine, tuple) and list(mine) == expected(("A", "B", "C"))
    with state.split_between_processes(np.array([1, 2, 3]), apply_padding=True) as mine:
        assert mine.tolist() == expected([1, 2, 3])
    with state.split_between_processes({"k": [1, 2, 3], "v": ("x", "y", "z")},
                                       apply_padding=True) as mine:
        assert mine["k"] == expected([1, 2, 3]) and list(mine["v"]) == expected(("x", "y", "z"))


def test_split_a_datasets_dataset_by_rows(state, comm):
    """A datasets.Dataset is split by rows (its select()), not sliced: slicing one gives a dict
    of columns, and its `shape` is (rows, columns)."""
    datasets = pytest.importorskip("datasets")
    n, r = comm.size, comm.rank
    data = datasets.Dataset.from_list([{"k": v} for v in range(2 * n + 1)])
    start, end = share_bounds(len(data), r, n)
    with state.split_between_processes(data) as mine:
        assert isinstance(mine, datasets.Dataset) and list(mine["k"]) == list(range(start, end))
    with state.split_between_processes(data, apply_padding=True) as mine:
        assert len(mine) == -(-len(data) // n)


def test_split_tensors_arrays_and_dicts(state, comm):
    n, r = comm.size, comm.rank
    tensor = torch.arange(10).reshape(5, 2)
    array = np.arange(5)
    with state.split_between_processes(tensor, apply_padding=True) as t:
        assert t.shape == (-(-5 // n), 2)
        rows = comm.allgather(t)
    for rank, rows_of_rank in enumerate(rows):
        start, end = share_bounds(5, rank, n)
        assert torch.equal(rows_of_rank[: end - start], tensor[start:end])
        assert all(torch.equal(row, tensor[-1]) for row in rows_of_rank[end - start :])
    with state.split_between_processes(array) as a:
        assert np.concatenate(comm.allgather(a)).tolist() == list(range(5))
    data = {"x": [1, 2, 3, 4], "y": torch.tensor([5, 6, 7, 8])}
    with state.split_between_processes(data) as d:
        per = 4 // n
        assert d["x"] == [1, 2, 3, 4][r * per : (r + 1) * per]
        assert d["y"].tolist() == [5, 6, 7, 8][r * per : (r + 1) * per]
    with pytest.raises(ValueError, match="same length"):
        with state.split_between_processes({"x": [1, 2], "y": [1]}):
            pass
    # a mapping keeps its type (a batch object with .to(), an OrderedDict)
    import collections

    class Batch(dict):
        pass

    for kind in (Batch, collections.OrderedDict):
        with state.split_between_processes(kind(x=[1, 2, 3, 4])) as mine:
            assert type(mine) is kind and mine["x"] == d["x"]
    # indices split alongside, padded too (docs/process-control.md), to drop repeats later
    items = [f"p{i}" for i in range(5)]
    with state.split_between_processes({"i": range(5), "x": items}, apply_padding=True) as mine:
        assert len(mine["i"]) == len(mine["x"]) == -(-5 // n)
        pairs = gather_object(list(zip(mine["i"], mine["x"])))  # an mpaccel collective
    assert dict(pairs) == dict(enumerate(items))
    with state.split_between_processes([]) as empty:
        assert empty == []


def test_split_nested_dicts_leaf_by_leaf(state, comm):
    # Accelerate recurses into nested dicts; here they ended in "unhashable type: 'slice'"
    n, r = comm.size, comm.rank
    data = {"a": {"x": list(range(8)), "y": torch.arange(8)}, "b": tuple("abcdefgh")}
    start, end = share_bounds(8, r, n)
    with state.split_between_processes(data) as mine:
        assert mine["a"]["x"] == list(range(8))[start:end]
        assert mine["a"]["y"].tolist() == list(range(start, end))
        assert mine["b"] == tuple("abcdefgh")[start:end]
    assert data["a"]["x"] == list(range(8))  # the input is left as it was
    per = -(-5 // n)
    with state.split_between_processes({"o": {"i": list(range(5))}}, apply_padding=True) as mine:
        start, end = share_bounds(5, r, n)
        assert mine == {"o": {"i": list(range(start, end)) + [4] * (per - (end - start))}}
    with pytest.raises(ValueError, match=r"every leaf\) to have the same length, got "
                                         r"inputs\['a'\]\['x'\]: 2, inputs\['b'\]: 3"):
        with state.split_between_processes({"a": {"x": [1, 2]}, "b": [1, 2, 3]}):
            pass
    with state.split_between_processes({}) as nothing:
        assert nothing == {}


@pytest.mark.parametrize(
    ("make", "said", "use"),
    [
        (lambda: {"b", "a", "c"}, "cannot split a set: it has no order that is the same on every "
         "process", "pass sorted(inputs)"),
        (lambda: frozenset("abc"), "cannot split a frozenset: it has no order", "sorted(inputs)"),
        (lambda: {"a": 1}.keys(), "cannot split a dict_keys: it has no order", "sorted(inputs)"),
        (lambda: {"a": 1}.items(), "cannot split a dict_items: it has no order", "sorted(inputs)"),
        (lambda: {"a": 1}.values(), "cannot split a dict_values view: it cannot be sliced",
         "pass list(d.values())"),
        (lambda: (x for x in "abc"), "cannot split a generator: it has no length, can be read "
         "only once, and may yield in another order", "pass list(inputs), or sorted(inputs)"),
        (lambda: {"k": {"a", "b"}}, "cannot split a set: it has no order", "sorted(inputs)"),
        (lambda: 42, "cannot split a int\nHINT: pass a list, tuple", "(nested) dict of those"),
    ],
    ids=["set", "frozenset", "keys", "items", "values", "generator", "set-in-dict", "int"],
)
def test_split_refuses_unordered_inputs_saying_why_and_what_to_use(state, make, said, use):
    # 'set' object is not subscriptable before: now why (order differs between processes) and
    # what to pass instead, at every size alike (Accelerate hands every rank the whole set)
    with pytest.raises(TypeError) as info:
        with state.split_between_processes(make()):
            pass
    message = str(info.value)
    assert said in message and "\nHINT: " in message and use in message


# What Accelerate 1.15 gives at n=4 for 2 rows (run under `accelerate launch --multi_gpu
# --num_processes 4` on CPU): empty shares past the input's end, the last row with padding.
@pytest.mark.mpi(size=4)
@pytest.mark.parametrize("apply_padding", [False, True])
def test_split_fewer_rows_than_ranks_as_accelerate(state, comm, apply_padding):
    r = comm.rank
    rows = [[0, 1], [2, 3]][r] if r < 2 else ([[2, 3]] if apply_padding else [])
    rows = [rows] if r < 2 else rows
    with state.split_between_processes(torch.tensor([[0, 1], [2, 3]]),
                                       apply_padding=apply_padding) as mine:
        assert mine.tolist() == rows and mine.shape[1:] == (2,)
    items = [10, 11][r : r + 1] if r < 2 else ([11] if apply_padding else [])
    with state.split_between_processes([10, 11], apply_padding=apply_padding) as mine:
        assert mine == items
    with state.split_between_processes((10, 11), apply_padding=apply_padding) as mine:
        assert mine == tuple(items)  # (Accelerate's tuples fail with padding: a TypeError)
    with state.split_between_processes({"a": [1, 2], "c": torch.tensor([1, 2])},
                                       apply_padding=apply_padding) as mine:
        assert mine["a"] == [x - 9 for x in items] and mine["c"].tolist() == mine["a"]


def test_destroy_process_group_is_safe(comm):
    AcceleratorState._reset_state(True)
    state = PartialState()
    state.destroy_process_group()
    assert not torch.distributed.is_initialized()
    AcceleratorState._reset_state(True)
    state = PartialState()  # a new group comes up over MPI again
    assert torch.distributed.is_initialized() == (comm.size > 1)
    if comm.size > 1:
        t = torch.ones(1)
        torch.distributed.all_reduce(t)
        assert t.item() == comm.size
    AcceleratorState._reset_state(True)
