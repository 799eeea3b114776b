"""PartialState: the process's facts and process control, a shared-state class as Accelerate
has it. Discovery (MPI, Slurm) happens here, once per process, and survives `_reset_state()`, as
does the torch process group; resetting only forgets the configuration."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch

from . import _env, distributed, lifecycle
from .comm import Comm, agreement
from .config import (
    InitProcessGroupKwargs,
    as_timedelta,
)
from .device import check_gpus_not_shared, current_device
from .discovery import Discovery, discover, emit_warnings
from .enums import DistributedType
from .environments import ProcessInfo
from .errors import CollectiveError, ConfigurationError, MpaccelError
from .split import split_inputs

# AcceleratorState's shared dictionary (state.py), kept here so that PartialState can answer
# mixed_precision without importing the training layer above it.
TRAINING_STATE: dict[str, Any] = {}

DEFAULT_TIMEOUT = 1800.0  # seconds, like torch.distributed's default; MPACCEL_TIMEOUT overrides

_discovery: Discovery | None = None


def _discover(timeout: float, problem: MpaccelError | None = None) -> Discovery:
    """The job's Discovery, made once (collective the first time). `problem`: this rank's own
    error, raised on every rank once MPI is up (see discover)."""
    global _discovery
    if _discovery is None:
        _discovery = discover(timeout, problem=problem)
        emit_warnings(_discovery)
    elif problem is not None:
        raise problem
    return _discovery


def _limit_threads(found: Discovery) -> None:
    # N ranks on a node each running cores-many intra-op threads thrash; torchrun sets
    # OMP_NUM_THREADS=1. Share the cores instead, unless the user chose: ranks bound to CPUs of
    # their own keep them all, ranks that may all run anywhere split the node (discovery).
    if found.info.local_num_processes > 1 and _env.get("omp_num_threads") is None:
        torch.set_num_threads(found.cpu_share)


_PROCESS_GROUP_KEYS = {"backend", "init_method", "timeout"}


def _shared_instance(cls: Any) -> Any:
    """Unpickling a state object: an instance sharing this process's state, as a new
    `cls()` would, without setting anything up (see __reduce__)."""
    instance = cls.__new__(cls)
    instance.__dict__ = cls._shared_state
    return instance


def _missing(cls_name: str, name: str, known: frozenset[str]) -> AttributeError:
    """The AttributeError for `name`, which the shared state of `cls_name` lacks: for what the
    state holds once set up, the likely cause (a reset) and its cure."""
    if name in known:
        return AttributeError(
            f"`{cls_name}` object has no attribute `{name}`. This happens if "
            f"`{cls_name}._reset_state()` was called and an `Accelerator` or `PartialState` was "
            f"not reinitialized.\nHINT: create the Accelerator (or PartialState) again after "
            f"resetting the state, and use the objects it prepares."
        )
    return AttributeError(f"'{cls_name}' object has no attribute '{name}'")


class PartialState:
    """Where this process sits in the job, and process control (barriers, ordering, decorators).

    Shared state: the first `PartialState()` in a process discovers the job (collective: every
    process must create it) and later instances share the result.

    Args:
        cpu: run on the CPU even when GPUs are visible.
        **kwargs: `InitProcessGroupKwargs(...).to_kwargs()`: backend, init_method, timeout.
    """

    _shared_state: dict[str, Any] = {}
    # Set together, at the end of the first __init__ (annotations only: no class attributes).
    _cpu: bool
    _discovery: Discovery
    process_info: ProcessInfo
    comm: Comm
    default_timeout: float
    device: torch.device
    debug: bool
    fork_launched: bool
    distributed_type: DistributedType
    backend: str | None

    def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
        self.__dict__ = self._shared_state
        unknown = set(kwargs) - _PROCESS_GROUP_KEYS
        if unknown:
            raise TypeError(
                f"PartialState got unexpected keyword argument(s) {sorted(unknown)}; it takes "
                f"cpu and the InitProcessGroupKwargs fields {sorted(_PROCESS_GROUP_KEYS)}"
            )
        try:
            use_cpu = _env.get_bool("use_cpu", False)
            env_timeout = _env.get_float("timeout")
            debug = _env.get_bool("debug", False)
        except ConfigurationError as exc:  # raised on every rank: none waits in MPI_Init
            _discover(DEFAULT_TIMEOUT, exc)
            raise
        cpu = bool(cpu) or use_cpu
        if self.initialized:
            self._check_same(cpu)
            return
        pg = InitProcessGroupKwargs(**kwargs)
        # One deadline for mpaccel's own collectives and for torch.distributed's (store,
        # gloo/NCCL): InitProcessGroupKwargs(timeout=), else MPACCEL_TIMEOUT, else 30 min.
        timeout = pg.timeout or (timedelta(seconds=env_timeout) if env_timeout else None)
        default_timeout = timeout.total_seconds() if timeout else DEFAULT_TIMEOUT
        found = _discover(default_timeout)
        found.comm.set_default_timeout(default_timeout)
        info = found.info
        # Everything is computed before anything is shared: a failure here (a launch error,
        # a GPU shared by two ranks) leaves the state uninitialised, not half-built.
        device = current_device(cpu, info.local_process_index, info.local_num_processes)
        if info.num_processes > 1:
            check_gpus_not_shared(found.comm, info.hostname, device)
        if info.num_processes == 1:
            distributed_type = DistributedType.NO
        elif device.type == "cuda":
            distributed_type = DistributedType.MULTI_GPU
        else:
            distributed_type = DistributedType.MULTI_CPU
        _limit_threads(found)
        # Always given: left to torch, NCCL's default is 10 min (gloo's 30), not this deadline.
        backend = distributed.init_process_group(
            found.comm, info, device, pg.backend, pg.init_method,
            timedelta(seconds=default_timeout),
        )
        self.__dict__.update(
            _cpu=cpu,
            _discovery=found,
            process_info=info,
            comm=found.comm,
            default_timeout=default_timeout,
            device=device,
            debug=debug,
            fork_launched=False,
            distributed_type=distributed_type,
            backend=backend,
        )
        # After init_process_group: torch wraps sys.excepthook there and buffers its output.
        lifecycle.install_abort_hook(
            info.process_index, info.num_processes, info.hostname, self.comm.abort
        )

    def __getattr__(self, name: str) -> Any:
        # Only reached for names the instance and the class lack: after _reset_state().
        raise _missing("PartialState", name, _PARTIAL_ATTRIBUTES)

    def __reduce__(self) -> tuple[Any, ...]:
        # The state is the process's (MPI handles, the process group): a pickled PartialState
        # unpickles as this process's shared state, not as a copy of another's.
        return (_shared_instance, (PartialState,))

    def _check_same(self, cpu: bool) -> None:
        if cpu and self.device.type != "cpu":
            raise ConfigurationError(
                f"the state was already initialised on {self.device}; cpu=True cannot move it",
                "pass cpu=True to the first PartialState()/Accelerator() of the script.",
            )

    def __repr__(self) -> str:
        if not self.initialized:
            return "PartialState(uninitialised)"
        return (
            f"Distributed environment: {self.distributed_type}\n"
            f"Num processes: {self.num_processes}\n"
            f"Process index: {self.process_index}\n"
            f"Local process index: {self.local_process_index}\n"
            f"Node index: {self.node_index} of {self.num_nodes}\n"
            f"Device: {self.device}\n"
            f"Launcher: {self._discovery.launcher.name}\n"
        )

    @staticmethod
    def _reset_state() -> None:
        """Forget the configuration (tests). Discovery and the process group are kept."""
        PartialState._shared_state.clear()

    # -- facts ---------------------------------------------------------------------------------

    @property
    def initialized(self) -> bool:
        return self._shared_state != {}

    @property
    def num_processes(self) -> int:
        return self.process_info.num_processes

    @property
    def process_index(self) -> int:
        return self.process_info.process_index

    @property
    def local_process_index(self) -> int:
        return self.process_info.local_process_index

    @property
    def local_num_processes(self) -> int:
        return self.process_info.local_num_processes

    @property
    def node_index(self) -> int:
        return self.process_info.node_index

    @property
    def num_nodes(self) -> int:
        return self.process_info.num_nodes

    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

    @property
    def is_main_process(self) -> bool:
        return self.process_info.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self.process_info.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        return self.process_info.is_last_process

    @property
    def mixed_precision(self) -> str:
        return TRAINING_STATE.get("_mixed_precision", "no")

    @property
    def default_device(self) -> torch.device:
        return self.device

    def set_device(self) -> None:
        """Make this process's device the current CUDA device (no-op on CPU)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    # -- process control -----------------------------------------------------------------------

    def wait_for_everyone(self, timeout: float | timedelta | None = None) -> None:
        """Collective: every rank must call it. Returns once all ranks have arrived.

        Runs over MPI on the host (no GPU sync). After `timeout` (default: the state's, 30 min
        unless InitProcessGroupKwargs(timeout=) or MPACCEL_TIMEOUT say otherwise) it raises
        CollectiveTimeoutError naming the ranks that never arrived. Signals are handled while
        waiting.
        """
        limit = as_timedelta(timeout)
        self.comm.barrier("wait_for_everyone", None if limit is None else limit.total_seconds())

    @contextmanager
    def _goes_first(self, is_main: bool, what: str) -> Iterator[None]:
        # Two gates. A gate is an agreement: if the side that ran first failed, everyone raises
        # the same CollectiveError instead of the others going ahead or waiting forever.
        if not is_main:
            self.comm.agree(None, what)
        # A CollectiveError from the block was agreed on every rank already (a nested gate
        # failed: the others learnt it at the gate they were waiting in), or a peer is gone:
        # another agreement would meet nobody, or another gate, on the other ranks.
        with agreement(self.comm, what, passing=(CollectiveError,)):
            yield
        if is_main:
            self.comm.agree(None, what)

    @contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Collective. The main process runs the block first; the others enter after it leaves.

        If the block fails on any rank, every rank raises the same CollectiveError.
        """
        with self._goes_first(self.is_main_process, "main_process_first"):
            yield

    @contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """Collective. Each node's local main process runs the block first, then the others."""
        with self._goes_first(self.is_local_main_process, "local_main_process_first"):
            yield

    @contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """Not collective. Yields this process's contiguous share of `inputs` (list, tuple, dict
        of those, tensor, numpy array, datasets.Dataset); see `mpaccel.split.split_inputs`."""
        yield split_inputs(inputs, self.process_index, self.num_processes, apply_padding)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """print() on the local main process only: once per node."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    # -- decorators (not collective; the check happens at call time) ---------------------------

    def _run_if(self, function: Callable | None, condition: Callable[[], bool]) -> Callable:
        if function is None:
            return functools.partial(self._run_if, condition=condition)

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if condition():
                return function(*args, **kwargs)
            return None

        return wrapper

    def on_main_process(self, function: Callable | None = None) -> Callable:
        """Decorator: run the function on the main process only (elsewhere it returns None)."""
        return self._run_if(function, lambda: self.is_main_process)

    def on_local_main_process(self, function: Callable | None = None) -> Callable:
        """Decorator: run the function on each node's local main process only."""
        return self._run_if(function, lambda: self.is_local_main_process)

    def on_last_process(self, function: Callable | None = None) -> Callable:
        """Decorator: run the function on the last process only."""
        return self._run_if(function, lambda: self.is_last_process)

    def on_process(
        self, function: Callable | int | None = None, process_index: int | None = None
    ) -> Callable:
        """Decorator: run the function on the process with global index `process_index`.

        In a job of one process it runs whatever the index, as Accelerate does when not
        distributed: a script written for N processes does all its work as plain `python`."""
        if isinstance(function, int) and not isinstance(function, bool):
            function, process_index = None, function
        index = _required_index(process_index, "on_process", "process_index")
        return self._run_if(
            function,  # type: ignore[arg-type]
            lambda: self.process_index == index or self.num_processes == 1,
        )

    def on_local_process(
        self,
        function: Callable | int | None = None,
        local_process_index: int | None = None,
        *,
        local_process_idx: int | None = None,
    ) -> Callable:
        """Decorator: run the function on the process with this local index on every node (in a
        job of one process, whatever the index, as on_process).

        `local_process_idx=` is accepted as an alias (Accelerate's guides use both)."""
        if isinstance(function, int) and not isinstance(function, bool):
            function, local_process_index = None, function
        if local_process_index is None:
            local_process_index = local_process_idx
        index = _required_index(local_process_index, "on_local_process", "local_process_index")
        return self._run_if(
            function,  # type: ignore[arg-type]
            lambda: self.local_process_index == index or self.num_processes == 1,
        )

    def destroy_process_group(self, group: Any = None) -> None:
        """Destroy `group`, or the default torch.distributed group when None."""
        distributed.destroy_process_group(group)
        if group is None:
            self._shared_state["backend"] = None


_PARTIAL_ATTRIBUTES = frozenset(PartialState.__annotations__)


def _required_index(value: int | None, method: str, name: str) -> int:
    if value is None or isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(
            f"{method}() needs {name}=<int >= 0>, got {value!r}",
            f"use it as @state.{method}({name}=0).",
        )
    return value
