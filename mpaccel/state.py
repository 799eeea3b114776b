"""PartialState, AcceleratorState and GradientState: shared-state classes, as Accelerate has them.

All instances of a class share one dictionary, filled by the first instantiation. PartialState
holds the process's facts and process control; discovery (MPI, Slurm) happens in its first
instantiation, once per process, and survives `_reset_state()`, as does the torch process group.
AcceleratorState adds the training configuration, GradientState gradient accumulation.
Resetting only forgets the configuration, so tests can build a fresh state cheaply.

One concept despite its length: the state Accelerate's users reach as `state`. The three classes
share one mechanism (a shared dictionary, its reset, pickling as the process's own, the error
after a reset), and AcceleratorState answers PartialState's facts, so they live together.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from . import absent_names, distributed, envvars, lifecycle, shared_settings, strategy
from .comm import Comm, agreement
from .config import (
    SHARD_INSTEAD,
    GradientAccumulationPlugin,
    InitProcessGroupKwargs,
    TorchDynamoPlugin,
    as_timedelta,
)
from .device import check_gpus_not_shared, current_device
from .discovery import DEFAULT_TIMEOUT, Discovery, discover_once
from .enums import DistributedType
from .environments import ProcessInfo
from .errors import CollectiveError, ConfigurationError
from .split import split_inputs

__all__ = ["AcceleratorState", "GradientState", "PartialState"]

def _limit_threads(found: Discovery) -> None:
    # N ranks on a node each running cores-many intra-op threads thrash; torchrun sets
    # OMP_NUM_THREADS=1. Share the cores instead, unless the user chose: ranks bound to CPUs of
    # their own keep them all, ranks that may all run anywhere split the node (discovery).
    if found.info.local_num_processes > 1 and envvars.get("omp_num_threads") is None:
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
            use_cpu = envvars.get_bool("use_cpu", False)
            env_timeout = envvars.get_float("timeout")
            debug = envvars.get_bool("debug", False)
        except ConfigurationError as exc:  # raised on every rank: none waits in MPI_Init
            discover_once(DEFAULT_TIMEOUT, exc)
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
        found = discover_once(default_timeout)
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
        return AcceleratorState._shared_state.get("_mixed_precision", "no")

    @property
    def default_device(self) -> torch.device:
        return self.device

    def set_device(self) -> None:
        """Not collective. Makes this process's device the current CUDA device (no-op on CPU)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    # -- process control -----------------------------------------------------------------------

    def wait_for_everyone(self, timeout: float | timedelta | None = None) -> None:
        """Collective: every rank must call it. Returns once all ranks have arrived.

        Runs over MPI on the host (no GPU sync). Signals are handled while waiting.

        Args:
            timeout: how long to wait, in seconds or as a timedelta; None: the state's
                (30 min unless InitProcessGroupKwargs(timeout=) or MPACCEL_TIMEOUT say
                otherwise).

        Raises:
            CollectiveTimeoutError: after `timeout`, naming the ranks that never arrived.
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
        """Not collective. A context manager that yields this process's contiguous share of
        `inputs`: shares differ in length by at most one, the first processes taking the extra
        items; a process past the end gets an empty share.

        Args:
            inputs: a list, tuple, tensor, numpy array or datasets.Dataset, or a dict of those
                (nested or not; every leaf of the same length, split with the same bounds).
            apply_padding: fill shorter shares up with the last item, so that every process
                holds as many items (drop the extras after gathering).

        Raises:
            ValueError: for a dict whose leaves differ in length.
        """
        yield split_inputs(inputs, self.process_index, self.num_processes, apply_padding)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """Not collective. print() on the local main process only: once per node.

        Args:
            *args: what print() prints.
            **kwargs: print()'s keywords (sep=, end=, file=, flush=).
        """
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
        """Not collective (the process is checked at each call). Decorator: the function runs on
        the main process only; elsewhere the call returns None.

        Args:
            function: the function to decorate.
        """
        return self._run_if(function, lambda: self.is_main_process)

    def on_local_main_process(self, function: Callable | None = None) -> Callable:
        """Not collective (the process is checked at each call). Decorator: the function runs on
        each node's local main process only; elsewhere the call returns None.

        Args:
            function: the function to decorate.
        """
        return self._run_if(function, lambda: self.is_local_main_process)

    def on_last_process(self, function: Callable | None = None) -> Callable:
        """Not collective (the process is checked at each call). Decorator: the function runs on
        the last process only; elsewhere the call returns None.

        Args:
            function: the function to decorate.
        """
        return self._run_if(function, lambda: self.is_last_process)

    def on_process(
        self, function: Callable | int | None = None, process_index: int | None = None
    ) -> Callable:
        """Not collective (the process is checked at each call). Decorator: the function runs on
        the process with global index `process_index`; elsewhere the call returns None.

        In a job of one process it runs whatever the index, as Accelerate does when not
        distributed: a script written for N processes does all its work as plain `python`.

        Args:
            function: the function to decorate; or the index itself, as in
                `@state.on_process(1)`; or None, as in `@state.on_process(process_index=1)`.
            process_index: the global index of the process that runs it.

        Raises:
            ConfigurationError: without an index, or with one that is not an int >= 0.
        """
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
        """Not collective (the process is checked at each call). Decorator: the function runs on
        the process with this local index on every node (in a job of one process, whatever the
        index, as on_process); elsewhere the call returns None.

        Args:
            function: the function to decorate; or the index itself, as in
                `@state.on_local_process(0)`; or None, with the index as a keyword.
            local_process_index: the index, on its node, of the process that runs it.
            local_process_idx: the same, under the other name Accelerate's guides use.

        Raises:
            ConfigurationError: without an index, or with one that is not an int >= 0.
        """
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
        """Not collective (it waits for no other rank), though every rank of the group should
        call it before it exits. Destroys the process group; a no-op when there is none.

        Args:
            group: the torch.distributed group to destroy; None: the default group (then the
                state's `backend` becomes None).
        """
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


_MIXED_PRECISION = ("no", "fp16", "bf16", "fp8")
_ENGINES = {
    "deepspeed_plugin": "DeepSpeed",
    "torch_tp_plugin": "Accelerate's TorchTensorParallelPlugin (here tensor parallelism is "
    "ParallelismConfig(tp_size=...))",
    "megatron_lm_plugin": "Megatron-LM",
}


def _partials(name: str) -> property:
    """A read-only property that is PartialState's of that name (the process's PartialState,
    so that it still answers after AcceleratorState._reset_state(), as Accelerate's does)."""
    return property(lambda self: getattr(PartialState(), name), doc=f"PartialState.{name}")


class AcceleratorState:
    """PartialState plus the training configuration (mixed precision, plugins). Shared state.

    Process facts and process control are PartialState's, reached through this object.
    `dynamo_plugin` is the TorchDynamoPlugin prepared models are compiled with. With an
    `fsdp_plugin` (or ACCELERATE_USE_FSDP=true) models are fully sharded: `distributed_type` is
    FSDP and `device_mesh` the mesh they are sharded over (built collectively here; its shape
    from `parallelism_config`, else from the nodes for HYBRID_SHARD). `strategy` is how models
    are parallelised (mpaccel.strategy), picked here once. The plugins of engines
    mpaccel does not drive (DeepSpeed, Megatron-LM, tensor parallelism) must be None: anything
    else is a ConfigurationError.

    Args:
        mixed_precision: "no", "fp16" or "bf16" (or a PrecisionType); None: the variable
            MPACCEL_MIXED_PRECISION or ACCELERATE_MIXED_PRECISION, else "no". Once set,
            another value is a ConfigurationError until _reset_state().
        cpu: run on the CPU even when GPUs are visible (PartialState's).
        dynamo_plugin: the TorchDynamoPlugin prepared models are compiled with; None: the
            default one.
        deepspeed_plugin: must be None.
        fsdp_plugin: a FullyShardedDataParallelPlugin to shard models with.
        torch_tp_plugin: must be None.
        megatron_lm_plugin: must be None.
        parallelism_config: a ParallelismConfig: the N-D mesh (data-parallel, tensor and
            context parallelism) the strategy is chosen and built from.
        **kwargs: PartialState's: InitProcessGroupKwargs' backend, init_method, timeout.
    """

    _shared_state: dict[str, Any] = {}

    def __init__(
        self,
        mixed_precision: str | None = None,
        cpu: bool = False,
        dynamo_plugin: Any = None,
        deepspeed_plugin: Any = None,
        fsdp_plugin: Any = None,
        torch_tp_plugin: Any = None,
        megatron_lm_plugin: Any = None,
        parallelism_config: Any = None,
        _from_accelerator: bool = False,
        _settings: Sequence[shared_settings.Setting] = (),
        **kwargs: Any,
    ) -> None:
        self.__dict__ = self._shared_state
        for name, plugin in (
            ("deepspeed_plugin", deepspeed_plugin),
            ("torch_tp_plugin", torch_tp_plugin),
            ("megatron_lm_plugin", megatron_lm_plugin),
        ):
            if plugin is not None:
                raise ConfigurationError(
                    f"mpaccel does not drive {_ENGINES[name]}; got {name}={plugin!r}",
                    f"drop {name}= and {SHARD_INSTEAD}",
                )
        explicit_fsdp = fsdp_plugin
        try:  # the variable's error names it; raised on every rank (PartialState.__init__)
            requested = mixed_precision or envvars.get_choice("mixed_precision")
            fsdp_plugin = strategy.choose_plugin(fsdp_plugin, parallelism_config)
        except ConfigurationError as exc:
            discover_once(DEFAULT_TIMEOUT, exc)
            raise
        if requested is not None:
            requested = str(getattr(requested, "value", requested)).lower()
            if requested not in _MIXED_PRECISION:
                raise ConfigurationError(
                    f"mixed_precision={mixed_precision!r} is not one of {_MIXED_PRECISION}"
                )
            if requested == "fp8":
                raise ConfigurationError(
                    "mixed_precision='fp8' needs Transformer Engine / MS-AMP on recent GPUs, "
                    "which mpaccel does not drive",
                    "use 'bf16' or 'fp16'.",
                )
        partial = PartialState(cpu, **kwargs)
        if self.initialized:
            current = self.__dict__.get("fsdp_plugin")
            if _from_accelerator:  # Accelerator() is collective; what it asks may differ by rank
                resolved = shared_settings.of_state(
                    current if explicit_fsdp is None else explicit_fsdp,
                    self.__dict__.get("parallelism_config"),
                    requested or self._mixed_precision,
                )  # first, so that the refusals below are every rank's or none's
                shared_settings.compare(partial.comm, [*resolved, *_settings], "Accelerator()")
            if requested is not None and requested != self._mixed_precision:
                raise ConfigurationError(
                    f"AcceleratorState was already initialised with "
                    f"mixed_precision={self._mixed_precision!r} and cannot switch to "
                    f"{requested!r}",
                    "create the Accelerator once, or call AcceleratorState._reset_state() first.",
                )
            if explicit_fsdp is not None and explicit_fsdp is not current:
                raise ConfigurationError(
                    "AcceleratorState was already initialised "
                    + ("without an fsdp_plugin" if current is None else "with another fsdp_plugin"),
                    "create the Accelerator once, or call AcceleratorState._reset_state() first.",
                )
            if _from_accelerator:
                self._from_accelerator = True
            return
        mixed = requested or "no"
        if fsdp_plugin is not None and mixed in ("bf16", "fp16"):
            fsdp_plugin.set_mixed_precision(mixed)
        if _from_accelerator:  # before the mesh: building it is collective for FSDP ranks only
            resolved = shared_settings.of_state(fsdp_plugin, parallelism_config, mixed)
            shared_settings.compare(partial.comm, [*resolved, *_settings], "Accelerator()")
        chosen = strategy.build(partial, fsdp_plugin, parallelism_config)
        if chosen.distributed_type is not None:
            self.distributed_type = chosen.distributed_type
        self._partial = partial
        self._mixed_precision: str = mixed
        self.dynamo_plugin = dynamo_plugin if dynamo_plugin is not None else TorchDynamoPlugin()
        self.deepspeed_plugins: dict[str, Any] = {}
        self.fsdp_plugin = fsdp_plugin
        self.torch_tp_plugin = None
        self.megatron_lm_plugin = None
        self.parallelism_config = parallelism_config
        self.strategy = chosen  # how models are parallelised: the Accelerator asks it
        self.device_mesh = chosen.mesh  # FSDP's mesh; None without FSDP
        self._from_accelerator = _from_accelerator

    def __getattr__(self, name: str) -> Any:
        # Only reached for names this class lacks: the process facts and process control
        # (PartialState's), or anything once the state was reset.
        if name.startswith("__"):
            raise AttributeError(name)
        partial = self.__dict__.get("_partial")
        if partial is None:
            raise _missing("AcceleratorState", name, _ACCELERATOR_ATTRIBUTES)
        if name in _PARTIAL_ATTRIBUTES or hasattr(PartialState, name):
            return getattr(partial, name)
        raise _missing("AcceleratorState", name, _ACCELERATOR_ATTRIBUTES)

    def __reduce__(self) -> tuple[Any, ...]:
        # As PartialState's: the unpickled object is this process's shared state.
        return (_shared_instance, (AcceleratorState,))

    @property
    def is_fsdp2(self) -> bool:
        """Whether models are fully sharded (mpaccel's FSDP is always torch's FSDP2)."""
        return self.__dict__.get("fsdp_plugin") is not None

    # The process-control methods and facts Accelerate's AcceleratorState has are defined here,
    # so that the class has them (help, inspect.signature, hasattr on the class); the rest of
    # PartialState's surface is reached through __getattr__. As Accelerate's, they ask the
    # process's PartialState, not this state's: they keep working after _reset_state() (its
    # scripts reset, then call accelerator.is_local_main_process or state.destroy_process_group).
    def wait_for_everyone(self, timeout: float | timedelta | None = None) -> None:
        """Collective: every rank must call it; see PartialState.wait_for_everyone.

        Args:
            timeout: how long to wait, in seconds or as a timedelta; None: the state's.
        """
        PartialState().wait_for_everyone(timeout)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """Not collective. print() on the local main process only; see PartialState.print.

        Args:
            *args: what print() prints.
            **kwargs: print()'s keywords.
        """
        PartialState().print(*args, **kwargs)

    use_distributed = _partials("use_distributed")
    is_main_process = _partials("is_main_process")
    is_local_main_process = _partials("is_local_main_process")
    is_last_process = _partials("is_last_process")
    fork_launched = _partials("fork_launched")

    def destroy_process_group(self, group: Any = None) -> None:
        """Not collective; see PartialState.destroy_process_group.

        Args:
            group: the torch.distributed group to destroy; None: the default group.
        """
        PartialState().destroy_process_group(group)

    def main_process_first(self) -> AbstractContextManager[None]:
        """Collective; see PartialState.main_process_first."""
        return PartialState().main_process_first()

    def local_main_process_first(self) -> AbstractContextManager[None]:
        """Collective; see PartialState.local_main_process_first."""
        return PartialState().local_main_process_first()

    def split_between_processes(
        self, inputs: Any, apply_padding: bool = False
    ) -> AbstractContextManager[Any]:
        """Not collective; see PartialState.split_between_processes.

        Args:
            inputs: a list, tuple, tensor, numpy array or datasets.Dataset, or a dict of those.
            apply_padding: fill shorter shares up with the last item.
        """
        return PartialState().split_between_processes(inputs, apply_padding)

    @property
    def initialized(self) -> bool:
        return self._shared_state != {}

    @property
    def mixed_precision(self) -> str:
        return self._mixed_precision

    @property
    def deepspeed_plugin(self) -> Any:
        return None

    def get_deepspeed_plugin(self, name: str) -> Any:
        """Not collective. The DeepSpeed plugin registered under `name`.

        Args:
            name: the plugin's name.

        Raises:
            ConfigurationError: always, as mpaccel does not drive DeepSpeed and registers none.
        """
        try:
            return self.deepspeed_plugins[name]
        except KeyError:
            raise ConfigurationError(
                f"no DeepSpeed plugin named {name!r}: mpaccel does not drive DeepSpeed"
            ) from None

    def select_deepspeed_plugin(self, name: str | None = None) -> None:
        """Not collective. Activates the DeepSpeed plugin `name`.

        Args:
            name: the plugin's name.

        Raises:
            ConfigurationError: always, as mpaccel does not drive DeepSpeed and registers none.
        """
        self.get_deepspeed_plugin(name)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return repr(self._partial) + f"Mixed precision type: {self.mixed_precision}\n"

    @staticmethod
    def _reset_state(reset_partial_state: bool = False) -> None:
        AcceleratorState._shared_state.clear()
        if reset_partial_state:
            PartialState._reset_state()


# What a set-up AcceleratorState holds: named in the error after a reset (with PartialState's).
_ACCELERATOR_ATTRIBUTES = _PARTIAL_ATTRIBUTES | {
    "_partial",
    "_mixed_precision",
    "_from_accelerator",
    "dynamo_plugin",
    "deepspeed_plugins",
    "fsdp_plugin",
    "torch_tp_plugin",
    "megatron_lm_plugin",
    "parallelism_config",
    "device_mesh",
    "strategy",
    "num_processes",
    "process_index",
    "local_process_index",
    "is_main_process",
    "is_local_main_process",
    "use_distributed",
}


def is_initialized() -> bool:
    """AcceleratorState exists in this process (an Accelerator or AcceleratorState was made, and
    not reset): AcceleratorState().initialized without creating one. Not collective."""
    return AcceleratorState._shared_state != {}


class GradientState:
    """Gradient synchronisation state for accumulation (shared state). Not collective.

    Args:
        gradient_accumulation_plugin: its settings (num_steps, adjust_scheduler,
            sync_with_dataloader, sync_each_batch) replace the state's; None keeps them.
    """

    _shared_state: dict[str, Any] = {}

    def __init__(self, gradient_accumulation_plugin: GradientAccumulationPlugin | None = None):
        self.__dict__ = self._shared_state
        if not self.initialized:
            self.sync_gradients = True
            self.active_dataloader = None
            self.dataloader_references: list[Any] = [None]
            self.plugin_kwargs: dict[str, Any] = {}
            self._is_xla_gradients_synced = False
        if gradient_accumulation_plugin is not None:
            self.plugin_kwargs = {
                "num_steps": gradient_accumulation_plugin.num_steps or 1,
                "adjust_scheduler": gradient_accumulation_plugin.adjust_scheduler,
                "sync_with_dataloader": gradient_accumulation_plugin.sync_with_dataloader,
                "sync_each_batch": gradient_accumulation_plugin.sync_each_batch,
            }

    def __reduce__(self) -> tuple[Any, ...]:
        # As PartialState's: the unpickled object is this process's shared state.
        return (_shared_instance, (GradientState,))

    @property
    def initialized(self) -> bool:
        return self._shared_state != {}

    @property
    def num_steps(self) -> int:
        return self.plugin_kwargs.get("num_steps", 1)

    @property
    def adjust_scheduler(self) -> bool:
        return self.plugin_kwargs.get("adjust_scheduler", False)

    @property
    def sync_with_dataloader(self) -> bool:
        return self.plugin_kwargs.get("sync_with_dataloader", True)

    @property
    def sync_each_batch(self) -> bool:
        return self.plugin_kwargs.get("sync_each_batch", False)

    @property
    def in_dataloader(self) -> bool:
        return self.active_dataloader is not None

    @property
    def end_of_dataloader(self) -> bool:
        if not self.in_dataloader:
            return False
        return bool(getattr(self.active_dataloader, "end_of_dataloader", False))

    @property
    def remainder(self) -> int:
        if not self.in_dataloader:
            return -1
        return int(getattr(self.active_dataloader, "remainder", -1))

    @property
    def is_xla_gradients_synced(self) -> bool:
        """Always False: mpaccel has no XLA path (kept for code that reads it)."""
        return self._is_xla_gradients_synced

    @is_xla_gradients_synced.setter
    def is_xla_gradients_synced(self, value: bool) -> None:
        self._is_xla_gradients_synced = value

    def _set_sync_gradients(self, sync_gradients: bool) -> None:
        self.sync_gradients = sync_gradients

    def _add_dataloader(self, dataloader: Any) -> None:
        self.active_dataloader = dataloader
        self.dataloader_references.append(dataloader)

    def _remove_dataloader(self, dataloader: Any) -> None:
        # A pass left paused (a peek, a break) ends when its iterator is collected, which may
        # be after the state was reset (and not set up again yet): then there is nothing to do.
        references = self.__dict__.get("dataloader_references")
        if references is None:
            return
        if dataloader in references:
            references.remove(dataloader)
        self.active_dataloader = references[-1]

    def __repr__(self) -> str:
        return (
            f"Sync Gradients: {self.sync_gradients}\n"
            f"At end of current dataloader: {self.end_of_dataloader}\n"
            f"Extra samples added: {self.remainder}\n"
            f"Gradient accumulation plugin: {self.plugin_kwargs}\n"
        )

    @staticmethod
    def _reset_state() -> None:
        GradientState._shared_state.clear()


# Accelerate's names for features mpaccel lacks: refusals with a HINT (mpaccel/absent_names.py).
absent_names.install_members(AcceleratorState)

if not TYPE_CHECKING:  # type checkers keep reporting these names as absent

    def __getattr__(name: str) -> Any:
        return absent_names.resolve(__name__, name)
