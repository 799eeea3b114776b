"""Accelerate's names for features mpaccel does not have (DeepSpeed, Megatron-LM, FP8, Big Model
Inference, the launcher's internals, ...): why, and what to use instead. The one source of these
reasons: mpaccel/__init__.py, utils/ and state.py resolve the names here on first use (module
`__getattr__`), accelerator.py and state.py put the members on their classes, and
scripts/compat_table.py reads them for docs/compatibility.md.

A class or function resolves to a placeholder that imports, and raises ConfigurationError with
the reason and a HINT when called: a script that imports DummyOptim and uses it only under
DeepSpeed runs. A constant keeps Accelerate's value (plain data: a file name, a version). A
member attribute has the value Accelerate's has with the feature off (fp8_enabled is False), or
raises AttributeError with the HINT where Accelerate's has no value to give.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .config import SHARD_INSTEAD, Refused
from .errors import ConfigurationError, refused, with_hint


@dataclass(frozen=True)
class Reason:
    why: str  # a clause: why mpaccel does not have what the name is for
    instead: str  # the HINT: what to use


_DEEPSPEED = Reason(
    "mpaccel does not drive DeepSpeed (its engine, config files and ZeRO wrappers)",
    "create a torch.optim optimizer and scheduler and " + SHARD_INSTEAD,
)
_MEGATRON = Reason("mpaccel does not drive Megatron-LM", SHARD_INSTEAD)
_FSDP = Reason(
    "an internal of Accelerate's FSDP integration (how its prepare() wraps and loads models); "
    "mpaccel drives FSDP2 with code of its own (mpaccel/strategy/fully_sharded.py)",
    "Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(...)) and prepare(); "
    "get_state_dict(model) for the full state dict; save_state/load_state, save_model and "
    "save_fsdp_model/load_fsdp_model/merge_fsdp_weights for checkpoints (docs/training.md).",
)
_FP8 = Reason(
    "FP8 training (TransformerEngine, MS-AMP, torchao) needs FP8-capable GPUs and their "
    "libraries; mpaccel refuses mixed_precision='fp8'",
    "mixed_precision='bf16'.",
)
_PARALLELISM = Reason(
    "mpaccel parallelises with DistributedDataParallel, FSDP2 (1-D, or HSDP's 2-D mesh) and "
    "tensor parallelism on an N-D mesh (ParallelismConfig's tp_size, context parallelism on "
    "GPUs); it drives no sequence or pipeline parallelism",
    "for a model that does not fit one device, Accelerator(fsdp_plugin="
    "FullyShardedDataParallelPlugin(...)), with ParallelismConfig(dp_replicate_size=..., "
    "dp_shard_size=..., tp_size=...) (docs/training.md).",
)
_BIG_MODEL = Reason(
    "Big Model Inference (device maps, CPU/disk offload, quantized loading) spreads one "
    "process's model over its devices; it is not data-parallel training",
    "accelerate's own big_modeling in that process (it starts no processes), "
    "`with torch.device('meta'):` for empty weights, or FullyShardedDataParallelPlugin (FSDP2) "
    "to train a model too big for one device.",
)
_LAUNCHER = Reason(
    "machinery of `accelerate launch` and its config files: mpaccel jobs are started by "
    "mpiexec, srun or python and read the launcher's variables once, in one table "
    "(mpaccel.envvars)",
    "`mpiexec -n N python script.py` (docs/launching.md).",
)
_ENV_PATCHING = Reason(
    "mpaccel snapshots the environment once, before MPI_Init, so a later change of a variable "
    "does not reach it",
    "set variables for the launch (`mpiexec -x NAME=value`, `srun --export`).",
)
_XLA = Reason("mpaccel runs on CPUs and CUDA GPUs, not TPUs (XLA)", "Accelerate on TPUs.")
_PICKLE_LAYOUT = Reason(
    "a file name of Accelerate's checkpoint layout (torch.save pickles): mpaccel writes one "
    "HDF5 checkpoint with an index and no pickle (docs/checkpoint-format.md)",
    "save_state/load_state, `mpaccel ckpt export` for safetensors.",
)
_SAVE_LOAD = Reason(
    "torch.save/torch.load on the main process pickle, and mpaccel never writes or reads "
    "pickles",
    "Accelerator.save(obj, f) (the main process writes; safe_serialization=True for "
    "safetensors) and save_state/load_state.",
)
_SHARED_DICT = Reason(
    "Accelerate's storage of the shared state (thread-local for XLA's spawned threads): "
    "mpaccel runs one process per rank and keeps the state in a class dict",
    "PartialState(), AcceleratorState().",
)
_INTERNAL = Reason("a no-op Accelerate's state.py uses internally", "nothing: drop the call.")
_TRIGGER = Reason(
    "the tensor behind Accelerate's set_trigger: mpaccel's trigger is an MPI allreduce on a "
    "Python bool",
    "set_trigger() / check_trigger().",
)
_PROFILING = Reason(
    "the torch versions Accelerate needs to profile Intel XPU and MTIA devices: mpaccel runs on "
    "CPUs and CUDA GPUs",
    "ProfileKwargs on CPUs and CUDA GPUs.",
)


def _each(names: str, reason: Reason) -> dict[str, Reason]:
    return dict.fromkeys(names.split(), reason)


# mpaccel's module -> Accelerate's name in it -> why mpaccel refuses it.
MODULE_NAMES: dict[str, dict[str, Reason]] = {
    "mpaccel": {
        **_each("prepare_pippy", _PARALLELISM),
        **_each(
            "infer_auto_device_map load_checkpoint_in_model cpu_offload cpu_offload_with_hook "
            "disk_offload dispatch_model init_empty_weights init_on_device "
            "load_checkpoint_and_dispatch",
            _BIG_MODEL,
        ),
        **_each("debug_launcher notebook_launcher", _LAUNCHER),
    },
    "mpaccel.utils": {
        **_each(
            "DeepSpeedEngineWrapper DeepSpeedOptimizerWrapper DeepSpeedSchedulerWrapper "
            "DeepSpeedSequenceParallelConfig DummyOptim DummyScheduler HfDeepSpeedConfig "
            "GatheredParameters deepspeed_required get_active_deepspeed_plugin "
            "map_pytorch_optim_to_deepspeed prepare_deepspeed_cmd_env compile_regions_deepspeed",
            _DEEPSPEED,
        ),
        **_each(
            "AbstractTrainStep BertTrainStep GPTTrainStep T5TrainStep MegatronEngine "
            "MegatronLMDummyDataLoader MegatronLMDummyScheduler MegatronLMOptimizerWrapper "
            "MegatronLMSchedulerWrapper add_model_config_to_megatron_parser "
            "avg_losses_across_data_parallel_group gather_across_data_parallel_groups "
            "megatron_lm_initialize megatron_lm_prepare_data_loader "
            "megatron_lm_prepare_model_optimizer_scheduler megatron_lm_prepare_optimizer "
            "megatron_lm_prepare_scheduler",
            _MEGATRON,
        ),
        **_each(
            "disable_fsdp_ram_efficient_loading enable_fsdp_ram_efficient_loading "
            "fsdp2_apply_ac fsdp2_canonicalize_names fsdp2_load_full_state_dict "
            "fsdp2_prepare_model fsdp2_switch_optimizer_parameters get_fsdp2_grad_scaler "
            "compile_regions_fsdp2 model_has_dtensor get_module_children_bottom_up",
            _FSDP,
        ),
        **_each(
            "AORecipeKwargs FP8RecipeKwargs MSAMPRecipeKwargs TERecipeKwargs "
            "apply_fp8_autowrap check_cuda_fp8_capability contextual_fp8_autocast "
            "convert_model convert_model_to_fp8_ao filter_first_and_last_linear_layers "
            "has_ao_layers has_transformer_engine_layers torchao_required",
            _FP8,
        ),
        **_each("get_model_tp_size", _PARALLELISM),
        **_each(
            "infer_auto_device_map load_checkpoint_in_model align_module_device "
            "BnbQuantizationConfig load_and_quantize_model calculate_maximum_sizes "
            "check_device_map check_tied_parameters_in_config "
            "check_tied_parameters_on_same_device compute_module_sizes get_balanced_memory "
            "get_max_memory has_4bit_bnb_layers has_offloaded_params "
            "OffloadedWeightsLoader PrefixedDataset load_offloaded_weight "
            "load_offloaded_weights offload_state_dict offload_weight save_offload_index "
            "set_module_tensor_to_device named_module_tensors find_tied_parameters "
            "retie_parameters ensure_weights_retied id_tensor_storage dtype_byte_size "
            "convert_file_size_to_int CustomDtype extract_submodules_state_dict "
            "load_state_dict clean_state_dict_for_safetensors",
            _BIG_MODEL,
        ),
        **_each(
            "PrepareForLaunch prepare_multi_gpu_env prepare_simple_launcher_cmd_env "
            "prepare_sagemager_args_inputs write_basic_config TORCH_LAUNCH_PARAMS "
            "convert_dict_to_env_variables purge_accelerate_environment "
            "get_cpu_distributed_information is_port_in_use parse_flag_from_env "
            "parse_choice_from_env get_int_from_env str_to_bool get_current_device_type "
            "check_os_kernel set_numa_affinity get_gpu_info check_cuda_p2p_ib_support",
            _LAUNCHER,
        ),
        **_each("clear_environment patch_environment", _ENV_PATCHING),
        **_each("install_xla prepare_tpu", _XLA),
        **_each(
            "MODEL_NAME OPTIMIZER_NAME RNG_STATE_NAME SAMPLER_NAME SCALER_NAME SCHEDULER_NAME "
            "WEIGHTS_PATTERN_NAME SAFE_MODEL_NAME",
            _PICKLE_LAYOUT,
        ),
        **_each("save load", _SAVE_LOAD),
        **_each(
            "MITA_PROFILING_AVAILABLE_PYTORCH_VERSION XPU_PROFILING_AVAILABLE_PYTORCH_VERSION",
            _PROFILING,
        ),
    },
    "mpaccel.state": {
        **_each("SharedDict ThreadLocalSharedDict", _SHARED_DICT),
        **_each("do_nothing", _INTERNAL),
    },
}

_TEST_UTILS = Reason(
    "Accelerate's own test helpers (its test scripts, markers and launch wrappers) test "
    "Accelerate",
    "mpaccel's pytest plugin and mpaccel.testing.run_mpi (docs/testing.md).",
)
_WRAPPERS = Reason(
    "a module of Accelerate's internals; mpaccel has its own behind Accelerator.prepare()",
    "Accelerator.prepare() and the names Accelerate exports from `accelerate` and "
    "`accelerate.utils` (docs/compatibility.md).",
)

# Accelerate's modules that mpaccel does not have (by the mpaccel path they would take): why.
# `mpaccel run` refuses an import of one with this reason (mpaccel/accelerate_alias.py).
MODULES: dict[str, Reason] = {
    **_each("mpaccel.test_utils", _TEST_UTILS),
    **_each("mpaccel.utils.megatron_lm", _MEGATRON),
    **_each("mpaccel.utils.ao mpaccel.utils.transformer_engine", _FP8),
    **_each("mpaccel.inference", _PARALLELISM),
    **_each("mpaccel.utils.bnb mpaccel.utils.offload", _BIG_MODEL),
    **_each(
        "mpaccel.launchers mpaccel.utils.launch mpaccel.utils.environment "
        "mpaccel.commands.accelerate_cli mpaccel.commands.estimate mpaccel.commands.merge "
        "mpaccel.commands.menu mpaccel.commands.test mpaccel.commands.to_fsdp2 "
        "mpaccel.commands.tpu mpaccel.commands.utils",
        _LAUNCHER,
    ),
    **_each("mpaccel.utils.torch_xla", _XLA),
    **_each(
        "mpaccel.checkpointing mpaccel.optimizer mpaccel.scheduler mpaccel.memory_utils "
        "mpaccel.utils.rich mpaccel.utils.tqdm",
        _WRAPPERS,
    ),
}


def module_reason(module: str) -> Reason | None:
    """Why mpaccel lacks `module` (or the package it is in), None when it is not listed."""
    parts = module.split(".")
    for end in range(len(parts), 1, -1):
        reason = MODULES.get(".".join(parts[:end]))
        if reason is not None:
            return reason
    return None


# The constants: Accelerate's values, plain data a script may format into a path or compare
# (the reason above says why mpaccel does not use them).
VALUES: dict[str, object] = {
    "MODEL_NAME": "pytorch_model",
    "OPTIMIZER_NAME": "optimizer",
    "RNG_STATE_NAME": "random_states",
    "SAMPLER_NAME": "sampler",
    "SCALER_NAME": "scaler.pt",
    "SCHEDULER_NAME": "scheduler",
    "WEIGHTS_PATTERN_NAME": "pytorch_model{suffix}.bin",
    "SAFE_MODEL_NAME": "model",
    "TORCH_LAUNCH_PARAMS": [
        "nnodes", "nproc_per_node", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf",
        "standalone", "max_restarts", "monitor_interval", "start_method", "role",
        "module", "m", "no_python", "run_path", "log_dir", "r", "redirects", "t", "tee",
        "node_rank", "master_addr", "master_port",
    ],
    "MITA_PROFILING_AVAILABLE_PYTORCH_VERSION": "2.1.0",
    "XPU_PROFILING_AVAILABLE_PYTORCH_VERSION": "2.4.0",
}

# Accelerate's decorators: what they wrap refuses when called, not the decoration itself (a
# script defines its DeepSpeed helpers at import time and calls them only under DeepSpeed).
_DECORATORS = frozenset({"deepspeed_required", "torchao_required"})


@dataclass(frozen=True)
class Member:
    """A member of Accelerate's Accelerator/AcceleratorState for a feature mpaccel lacks.
    kind: 'method' (refuses when called), 'value' (a read-only attribute with the value that
    says the feature is off, which here it always is), 'attribute' (reading it raises
    AttributeError with the HINT: Accelerate's has no value to give without the feature)."""

    reason: Reason
    kind: str
    value: Any = None


MEMBERS: dict[str, dict[str, Member]] = {
    "Accelerator": {
        "deepspeed_config": Member(_DEEPSPEED, "attribute"),
        "deepspeed_engine_wrapped": Member(_DEEPSPEED, "value", None),
        "deepspeed_ulysses_dl_adapter": Member(_DEEPSPEED, "method"),
        **{name: Member(_FP8, "value", None) for name in (
            "ao_recipe_handler", "te_recipe_handler", "msamp_recipe_handler",
            "fp8_recipe_handler")},
        **{name: Member(_FP8, "value", False) for name in (
            "fp8_enabled", "has_fp8_handler", "delayed_fp8_autocast")},
        # Accelerate's FP8BackendType.NO, a str enum equal to "NO"
        "fp8_backend": Member(_FP8, "value", "NO"),
        "flag_tensor": Member(_TRIGGER, "attribute"),
    },
    "AcceleratorState": {"downcast_bfloat": Member(_XLA, "value", False)},
}


def _refusal(path: str, reason: Reason) -> tuple[str, str]:
    return f"{path} cannot be used: {reason.why}", reason.instead


def _raiser(path: str, reason: Reason) -> Callable[..., Any]:
    message, hint = _refusal(path + "()", reason)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        del args, kwargs
        raise ConfigurationError(message, hint)

    return refused(message, hint)(refuse)


def _decorator(path: str, reason: Reason) -> Callable[..., Any]:
    message, hint = _refusal(f"a function decorated with @{path}", reason)

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        def refuse(*args: Any, **kwargs: Any) -> Any:
            del args, kwargs
            raise ConfigurationError(message, hint)

        return refuse

    return refused(message, hint)(decorate)


def _placeholder(module: str, name: str, reason: Reason) -> Any:
    path = f"{module}.{name}"
    if name in VALUES:
        return VALUES[name]
    if name[0].isupper():  # a class: a subclass of the refused plugins' base
        message, hint = _refusal(path + "(...)", reason)
        namespace = {"_message": classmethod(lambda cls: message), "_hint": hint,
                     "__module__": module, "__qualname__": name,
                     "__doc__": with_hint(f"Refused: {reason.why}.", hint)}
        return type(name, (Refused,), namespace)
    maker = _decorator if name in _DECORATORS else _raiser
    obj = maker(path, reason)
    obj.__name__ = obj.__qualname__ = name
    obj.__module__ = module
    obj.__doc__ = with_hint(f"Refused: {reason.why}.", reason.instead)
    return obj


def _home(name: str) -> str:
    """The module a name's placeholder belongs to: mpaccel.utils where Accelerate has it in
    both `accelerate` and `accelerate.utils` (as Accelerate's, both are the same object)."""
    return next(module for module, names in reversed(MODULE_NAMES.items()) if name in names)


@functools.cache
def _resolved(module: str, name: str) -> Any:
    return _placeholder(module, name, MODULE_NAMES[module][name])


def resolve(module: str, name: str) -> Any:
    """The module `__getattr__` of mpaccel, mpaccel.utils and mpaccel.state: the placeholder
    of one of Accelerate's names listed here, an AttributeError for any other name."""
    if name not in MODULE_NAMES.get(module, ()):
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    return _resolved(_home(name), name)


def _member(cls_name: str, name: str, member: Member) -> Any:
    path = f"{cls_name}.{name}"
    if member.kind == "method":
        method = _raiser(path, member.reason)
        method.__name__ = name
        method.__qualname__ = path
        return method
    if member.kind == "value":
        value = member.value

        def read(self: Any) -> Any:
            return value

        read.__name__ = read.__qualname__ = name
        read.__doc__ = f"Always {value!r}: {member.reason.why}."
        return property(read)
    message, hint = _refusal(path, member.reason)

    def missing(self: Any) -> Any:
        raise AttributeError(with_hint(message, hint), name=name, obj=self)

    return property(refused(message, hint)(missing))


def install_members(cls: type) -> None:
    """Put Accelerate's members listed in MEMBERS for `cls` on it (called once, where the class
    is defined): only these names, so any other missing attribute stays an AttributeError."""
    for name, member in MEMBERS[cls.__name__].items():
        obj = _member(cls.__name__, name, member)
        setattr(cls, name, obj)
        if isinstance(obj, property):  # as the class statement does: errors name the property
            obj.__set_name__(cls, name)  # type: ignore[attr-defined]  # (typeshed lacks it)


def notes() -> dict[str, str]:
    """For scripts/compat_table.py, by Accelerate's `group.name`: what each name with a value
    (a constant, a member attribute) gives and why."""
    out: dict[str, str] = {}
    for module, names in MODULE_NAMES.items():
        for name, reason in names.items():
            if name in VALUES:
                out[f"accelerate{module[len('mpaccel'):]}.{name}"] = (
                    f"Accelerate's value, which mpaccel does not use: {reason.why}; instead: "
                    f"{reason.instead}")
    for cls_name, members in MEMBERS.items():
        for name, member in members.items():
            if member.kind == "value":
                out[f"{cls_name}.{name}"] = f"always {member.value!r}: {member.reason.why}"
    return out
