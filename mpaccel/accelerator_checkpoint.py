"""The Accelerator's checkpoint methods: save/save_model, save_state/load_state and their
hooks, registered objects, async saves and Slurm preemption. A mixin of Accelerator
(accelerator.py); `_Host` lists what it uses of the Accelerator, so this module needs
nothing from accelerator.py. The methods hand what they hold to checkpoint/ (api.py, and
TrainingState.from_prepared in training.py), which decides who saves, the directory, the
format and which entries are sharded."""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any, Protocol

import torch
from torch.utils.hooks import RemovableHandle

from . import checkpoint, distributed, preemption
from .comm import agreement
from .config import ProjectConfiguration
from .data.loader import PreparedLoader
from .errors import ConfigurationError
from .state import AcceleratorState, PartialState
from .training import AcceleratedOptimizer, AcceleratedScheduler


class _Host(Protocol):
    """What CheckpointMethods use of the Accelerator they are mixed into."""

    step: int
    state: AcceleratorState
    scaler: Any
    project_configuration: ProjectConfiguration
    _preemption: preemption.Preemption | None
    _async_saver: checkpoint.AsyncSaver
    _save_model_state_pre_hook: OrderedDict[int, Callable]
    _load_model_state_pre_hook: OrderedDict[int, Callable]
    _custom_objects: list[Any]
    _models: list[torch.nn.Module]
    _optimizers: list[AcceleratedOptimizer]
    _schedulers: list[AcceleratedScheduler]
    _dataloaders: list[PreparedLoader]

    @property
    def _partial(self) -> PartialState: ...
    @property
    def sync_gradients(self) -> bool: ...
    @property
    def project_dir(self) -> str | None: ...
    @property
    def is_main_process(self) -> bool: ...
    @property
    def process_index(self) -> int: ...
    @property
    def local_process_index(self) -> int: ...

    def print(self, *args: Any, **kwargs: Any) -> None: ...
    def wait_for_everyone(self, timeout: float | timedelta | None = ...) -> None: ...
    def unwrap_model(
        self, model: torch.nn.Module, keep_fp32_wrapper: bool = ...,
        keep_torch_compile: bool = ...,
    ) -> Any: ...
    def get_state_dict(
        self, model: torch.nn.Module, unwrap: bool = ..., *, all_ranks: bool = ...
    ) -> dict[str, Any]: ...
    def _run_pre_hooks(
        self, hooks: Iterable[Callable], arguments: tuple, listed: list, what: str,
        comm: Any = ...,
    ) -> list[torch.nn.Module]: ...
    def _checkpoint_objects(
        self, models: list[torch.nn.Module], gradients: bool, loading: bool = ...
    ) -> checkpoint.TrainingState: ...
    def save_state(
        self, output_dir: str | None = ..., safe_serialization: bool = ..., *,
        async_save: bool = ..., **save_model_func_kwargs: Any,
    ) -> str: ...
    def wait_for_checkpoint(self) -> None: ...


class CheckpointMethods:
    """Checkpoints and preemption: Accelerator's methods for them."""

    _preemption: preemption.Preemption | None  # set by Accelerator.__init__ (type checker)

    def save(self: _Host, obj: Any, f: Any, safe_serialization: bool = False) -> None:
        """torch.save (or safetensors) on the main process only; others do nothing."""
        if not self.is_main_process:
            return
        if safe_serialization:
            try:
                from safetensors.torch import save_file
            except ImportError as exc:
                raise ConfigurationError(
                    "safe_serialization=True needs the safetensors package",
                    "pip install safetensors",
                ) from exc
            save_file(obj, f)
        else:
            torch.save(obj, f)

    # -- checkpoints -----------------------------------------------------------------------------

    def save_model(
        self: _Host,
        model: torch.nn.Module,
        save_directory: str,
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """Collective when every rank calls it; also callable by one rank alone (`if
        accelerator.is_main_process:`), which then writes everything (docs/checkpoint-format.md,
        "Saving from one rank"). The unwrapped model's weights in shards of at most
        `max_shard_size`, written in parallel (shard i by rank i mod N): with
        `safe_serialization=True` (Accelerate's default) as `model.safetensors`, or
        `model-0000i-of-0000N.safetensors` + `model.safetensors.index.json`, Hugging Face's
        layout; with `safe_serialization=False` as mpaccel's HDF5 shards + `model.index.json`
        (never a pickle; read back with `mpaccel.checkpoint.load_model_state(dir)`). Under FSDP
        every rank must call it: each writes its own rows of the full tensors into the same
        files, at their offsets (no rank gathers a tensor)."""
        checkpoint.save_model(
            self._partial.comm, self.unwrap_model(model), save_directory, max_shard_size,
            safe_serialization=safe_serialization,
        )

    def register_for_checkpointing(self: _Host, *objects: Any) -> None:
        """Include objects with state_dict()/load_state_dict() in save_state/load_state."""
        bad = [
            o for o in objects if not (hasattr(o, "state_dict") and hasattr(o, "load_state_dict"))
        ]
        if bad:
            raise TypeError(
                f"register_for_checkpointing needs objects with state_dict() and "
                f"load_state_dict(); {[type(o).__name__ for o in bad]} lack them"
            )
        self._custom_objects.extend(objects)

    def register_save_state_pre_hook(self: _Host, hook: Callable[..., None]) -> RemovableHandle:
        """Call `hook(models, weights, output_dir)` in save_state() before anything is written,
        on every rank, in the order registered: `models` are the prepared models, `weights`
        their state_dicts (as prepared: with DDP's `module.` prefix), `output_dir` the
        checkpoint's directory (created). A hook that saves a model its own way removes its
        entry from `weights` (`weights.pop()`): that model is then left out of the checkpoint
        (its hook must load it: register_load_state_pre_hook). Returns a handle whose
        remove() unregisters the hook."""
        handle = RemovableHandle(self._save_model_state_pre_hook)
        self._save_model_state_pre_hook[handle.id] = hook
        return handle

    def register_load_state_pre_hook(self: _Host, hook: Callable[..., None]) -> RemovableHandle:
        """Call `hook(models, input_dir)` in load_state() before anything is read, on every
        rank, in the order registered: a hook that loads a model its own way removes it from
        `models`, which load_state() then leaves alone. Returns a removable handle."""
        handle = RemovableHandle(self._load_model_state_pre_hook)
        self._load_model_state_pre_hook[handle.id] = hook
        return handle

    def _run_pre_hooks(
        self: _Host, hooks: Iterable[Callable], arguments: tuple, listed: list, what: str,
        comm: Any = None,
    ) -> list[torch.nn.Module]:
        """Collective. Call the `hooks` with `arguments` (of which `listed` is the list the
        hooks may shorten, one entry per prepared model); returns the models whose entries
        remain, the same on every rank (a hook failing on any rank fails every rank)."""
        entries = list(listed)
        comm = self._partial.comm if comm is None else comm  # a NullComm: a save by one rank
        with agreement(comm, what):
            for hook in hooks:
                hook(*arguments)
        kept = [i for i, entry in enumerate(entries) if any(entry is e for e in listed)]
        everyone = comm.allgather(kept, what)
        if any(k != kept for k in everyone):
            raise ConfigurationError(
                f"{what}: the hooks removed different models on different ranks "
                f"({dict(enumerate(everyone))}: indices of the models kept)",
                "the hooks must remove the same entries on every rank.",
            )
        return [self._models[i] for i in kept]

    def _checkpoint_objects(
        self: _Host, models: list[torch.nn.Module], gradients: bool, loading: bool = False
    ) -> checkpoint.TrainingState:
        """What save_state/load_state hand the checkpoint, under the names of its entries:
        `models` (what the pre-hooks left), then everything else prepared or registered;
        with `gradients`, the models' gradients per rank. Fully sharded models and their
        optimizers are `sharded` entries (each rank stores its rows; their gradients too, as
        rows: checkpoint/sharded/state.py). `loading`: a fresh optimizer over shards gets its
        state created to load into."""
        return checkpoint.TrainingState.from_prepared(
            [self.unwrap_model(model) for model in models],
            self._optimizers,
            self._schedulers,
            self._dataloaders,
            scaler=self.scaler,
            custom=self._custom_objects,
            step=_AccumulationStep(self),
            gradients=gradients,
            loading=loading,
            optimizer_state=_sharded_optimizer_state,
        )

    def save_state(
        self: _Host,
        output_dir: str | None = None,
        safe_serialization: bool = True,
        *,
        async_save: bool = False,
        **save_model_func_kwargs: Any,
    ) -> str:
        """Collective when every rank calls it; also callable by one rank alone, which then
        writes everything it holds (docs/checkpoint-format.md, "Saving from one rank").
        Models, optimizers, schedulers, grad scaler, registered objects, and each
        rank's RNG states and dataloader positions, as an HDF5 checkpoint committed atomically.
        Ranks that pass different directories use rank 0's (with a warning).
        With ProjectConfiguration(automatic_checkpoint_naming=True) the directory is
        project_dir/checkpoints/checkpoint_<n> and old ones are rotated (total_limit).
        async_save=True (keyword only) snapshots to host memory and writes in the background;
        see wait_for_checkpoint(). Returns the directory. HDF5 holds no pickles, so
        `safe_serialization` (Accelerate's choice of safetensors over pickle) is always
        honoured; `save_model_func_kwargs` (Accelerate passes them to DeepSpeed) are ignored.
        Hooks of register_save_state_pre_hook run first."""
        del safe_serialization, save_model_func_kwargs
        # Saved mid-accumulation: each rank's gradients summed so far are part of the state.
        gradients = not self.sync_gradients

        def run_hooks(comm: Any, directory: str) -> checkpoint.TrainingState:
            if directory:
                try:  # an error here is the checkpoint's to report, collectively
                    os.makedirs(directory, exist_ok=True)
                except Exception:
                    pass
            weights = [self.get_state_dict(m, unwrap=False) for m in self._models]
            models = self._run_pre_hooks(
                list(self._save_model_state_pre_hook.values()),
                (self._models, weights, directory),
                weights,
                "save_state (pre-hooks)",
                comm,
            )
            return self._checkpoint_objects(models, gradients)

        return checkpoint.save_state(
            self._partial.comm,
            self._checkpoint_objects(self._models, gradients),
            output_dir,
            project=self.project_configuration,
            saver=self._async_saver,
            async_save=async_save,
            before=run_hooks if self._save_model_state_pre_hook else None,
        )

    def load_state(
        self: _Host,
        input_dir: str | None = None,
        load_kwargs: dict[str, Any] | None = None,
        *,
        allow_pickle: bool | None = None,
        **load_model_func_kwargs: Any,
    ) -> str:
        """Collective. Restore what save_state wrote (the latest complete checkpoint when
        input_dir is None and automatic naming is on). Works at another world size: shared
        state loads anywhere; per-rank RNG states are then skipped, with a warning. Ranks that
        pass different directories use rank 0's (with a warning).

        A directory written by Hugging Face Accelerate's save_state is recognised: its
        safetensors model weights load; its pickles (`optimizer.bin`, `scheduler.bin`,
        `pytorch_model.bin`, `random_states_<rank>.pkl`, ...) only with `allow_pickle=True`
        (keyword only) or MPACCEL_ALLOW_PICKLE=1, for a directory you trust; otherwise an
        error names them, before anything changes. That load is all or nothing on every rank
        too (checkpoint/accelerate_layout.py).

        `load_model_func_kwargs` go to the models' load_state_dict (`strict=False`: keys may
        be missing or extra; `assign`). `load_kwargs` (Accelerate's options for torch.load) is
        accepted and has nothing to act on. Hooks of register_load_state_pre_hook run first."""
        del load_kwargs

        def run_hooks(comm: Any, directory: str | None) -> checkpoint.TrainingState:
            listed = list(self._models)
            models = self._run_pre_hooks(
                list(self._load_model_state_pre_hook.values()),
                (listed, directory),
                listed,
                "load_state (pre-hooks)",
                comm,
            )
            return self._checkpoint_objects(models, gradients=True, loading=True)

        return checkpoint.load_state(
            self._partial.comm,
            self._checkpoint_objects(self._models, gradients=True, loading=True),
            input_dir,
            project=self.project_configuration,
            saver=self._async_saver,
            model_options=load_model_func_kwargs,
            node_share=(self.local_process_index, self._partial.local_num_processes),
            allow_pickle=allow_pickle,
            before=run_hooks if self._load_model_state_pre_hook else None,
        )

    def wait_for_checkpoint(self: _Host) -> None:
        """Collective in effect: block until an async save is committed (re-raises its error)."""
        self._async_saver.wait()

    # -- preemption (Slurm) ----------------------------------------------------------------------

    def handle_preemption(
        self: _Host, signals: Any = preemption.DEFAULT_SIGNALS, requeue: bool = True
    ) -> None:
        """Not collective. From now on SIGUSR1/SIGTERM (Slurm's --signal, preemption, the
        wall-time limit) are only recorded; the loop then asks should_stop() at step
        boundaries and calls checkpoint_and_exit(). `requeue`: put the job back in the queue."""
        if self._preemption is not None:
            self._preemption.uninstall()
        self._preemption = preemption.Preemption(signals, requeue)
        self._preemption.install()

    def should_stop(self: _Host) -> bool:
        """Collective: True on every rank once any rank received a preemption signal, at the
        first optimizer-step boundary from then on (mid-accumulation it waits for the step, so
        the checkpoint holds no half-accumulated gradients). One MPI all-reduce of an int;
        False without one when handle_preemption() was not called."""
        if self._preemption is None:
            return False
        return self._preemption.check(self._partial.comm) and self.sync_gradients

    @property
    def preempted(self: _Host) -> str | None:
        """The signal that stopped the job ('SIGUSR1', ...), None if none arrived here."""
        return None if self._preemption is None else self._preemption.signal_name

    def checkpoint_and_exit(self: _Host, output_dir: str | None = None, exit_code: int = 0) -> None:
        """Collective: save_state() (committed, even if async saves are pending), then rank 0
        requeues the Slurm job if handle_preemption(requeue=True), then every rank exits."""
        directory = self.save_state(output_dir)
        self.wait_for_checkpoint()
        # Finish MPI before requeueing: the requeue kills this job step at once, and MPI
        # processes killed mid-run leave shared-memory segments that the restarted job (same
        # job and step id, hence the same segment names under MPICH) would trip over.
        self.wait_for_everyone()
        distributed.destroy_process_group()
        self._partial.comm.finalize()
        requeued = False
        if self.is_main_process and self._preemption is not None and self._preemption.requeue:
            requeued = preemption.requeue()
        self.print(
            f"mpaccel: checkpoint {directory} committed"
            + ("; job requeued" if requeued else "")
            + "; exiting"
        )
        preemption.exit_cleanly(exit_code)

    @property
    def restart_count(self: _Host) -> int:
        """SLURM_RESTART_COUNT: 0 on the first run, n after n requeues."""
        return preemption.restart_count()

    @property
    def save_iteration(self: _Host) -> int:
        return self.project_configuration.iteration


class _AccumulationStep:
    """The Accelerator's micro-batch count, as a checkpoint holds it (entry "accelerator")."""

    def __init__(self, accelerator: _Host) -> None:
        self._accelerator = accelerator

    def state_dict(self) -> dict[str, int]:
        return {"step": self._accelerator.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        step = state.get("step") if isinstance(state, dict) else None
        if type(step) is not int or step < 0:
            raise ValueError(f"it holds the step {step!r}, not a count")
        self._accelerator.step = step


def _sharded_optimizer_state(optimizer: Any, create: bool) -> Any:
    """An optimizer over a fully sharded model's parameters, as its checkpoint entry."""
    from . import fsdp  # called only for fully sharded models (see fsdp.py's docstring)

    return fsdp.OptimizerState(optimizer, create=create)
