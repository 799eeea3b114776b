"""Hand-kept notes of docs/compatibility.md's table (scripts/compat_table.py), keyed by
`group.name` as the table groups them ("accelerate.utils.gather", "Accelerator.save_state").

DIFFERS: a name mpaccel has whose behaviour differs from Accelerate's, in one sentence (the
    signature differences are found by the script; this says what it cannot see).
ABSENT: a name mpaccel deliberately does not have: why, and what to use instead.
MISSING: a name mpaccel should have and does not yet: where it would go. Each one is a gap to
    close (or to move to ABSENT with a reason); compat_table.py --check fails on a missing name
    that is in neither dict, and on a note whose name is no longer absent or missing.
"""

from __future__ import annotations

U = "accelerate.utils."
A = "accelerate."


def _each(prefixes: tuple[str, ...], names: str, note: str) -> dict[str, str]:
    """The same note for every name (whitespace-separated) under each prefix."""
    return {prefix + name: note for prefix in prefixes for name in names.split()}


DIFFERS: dict[str, str] = {
    **_each(
        (A, U),
        "InitProcessGroupKwargs",
        "backend=None picks NCCL for CUDA devices and gloo on CPU (Accelerate's default "
        "'nccl' needs GPUs); init_method=None brokers the rendezvous over MPI",
    ),
    **_each(
        (U,),
        "TorchDynamoPlugin",
        "the ACCELERATE_DYNAMO_* variables are not read; with use_regional_compilation=True, "
        "unwrap_model gives the compiled copy of your module where Accelerate's gives DDP's "
        "(docs/training.md)",
    ),
    A + "Accelerator": (
        "mixed_precision='fp16' on CPU autocasts to float16 with a GradScaler and warns once, "
        "where Accelerate trains in float32 (docs/training.md)"
    ),
    "Accelerator.get_state_dict": (
        "a compiled model's keys have no `_orig_mod.` prefix (Accelerate's keep it)"
    ),
    "Accelerator.save_state": (
        "writes mpaccel's HDF5 checkpoint, no pickle (docs/checkpoint-format.md); what a "
        "save-state pre-hook changes inside a `weights` entry is not saved"
    ),
    "Accelerator.init_trackers": (
        "a tracker whose package is missing is a warning (Accelerate logs at debug level); "
        "one that needs a logging directory without one is refused here, not at "
        "Accelerator(...) (docs/tracking.md)"
    ),
    U + "pad_input_tensors": (
        "grows `dim` to the next multiple of num_processes, a size that divides is kept "
        "(Accelerate's formula agrees on its tested cases but gives 8 rows on 4 processes 10, "
        "6 gives 9, and always grows dimension 0)"
    ),
    **{
        U + name: (
            "writes and reads mpaccel's sharded HDF5 checkpoints (each rank its own rows, "
            "loadable at any world size) under Accelerate's directory names, not DCP's files; "
            "adapter_only=True and merge_fsdp_weights(safe_serialization=False) are refused "
            "(docs/training.md)"
        )
        for name in ("save_fsdp_model", "load_fsdp_model", "save_fsdp_optimizer",
                     "load_fsdp_optimizer", "merge_fsdp_weights")
    },
    U + "get_grad_scaler": (
        "a GradScaler for this process's device type: a working CPU scaler on CPUs "
        "(Accelerate's is a CUDA scaler that disables itself there)"
    ),
    U + "get_mixed_precision_context_manager": (
        "native_amp=True with mixed_precision='no' is a null context (Accelerate's autocasts "
        "to the device's default dtype)"
    ),
    "Accelerator.prepare_data_loader": (
        "the prepared loader's batch_size is this process's (Accelerate's is None unless the "
        "dataset is iterable) (docs/training.md)"
    ),
}

_NO_DEEPSPEED = (
    "DeepSpeed integration: mpaccel does not drive DeepSpeed (DeepSpeedPlugin is refused). "
    "Instead: DistributedDataParallel through prepare(), mixed_precision='bf16'"
)
_NO_MEGATRON = (
    "Megatron-LM integration: mpaccel does not drive Megatron-LM (MegatronLMPlugin is refused). "
    "Instead: DistributedDataParallel through prepare()"
)
_NO_FSDP = (
    "Accelerate's internals of its FSDP integration (how prepare() wraps and loads models): "
    "mpaccel drives FSDP2 through Accelerator(fsdp_plugin=...) and prepare() with code of its "
    "own (mpaccel/fsdp.py). Instead: prepare(); get_state_dict(model) for the full state dict; "
    "save_state/load_state, save_model and save_fsdp_model/load_fsdp_model/merge_fsdp_weights "
    "for checkpoints"
)
_NO_FP8 = (
    "FP8 training (TransformerEngine, MS-AMP, torchao) needs FP8-capable GPUs and their "
    "libraries; mpaccel refuses mixed_precision='fp8'. Instead: mixed_precision='bf16'"
)
_NO_PARALLELISM = (
    "tensor/context/pipeline parallelism: mpaccel does not build device meshes "
    "(ParallelismConfig and TorchTensorParallelPlugin are refused). Instead: data parallelism "
    "through prepare()"
)
_NO_BIG_MODEL = (
    "Big Model Inference (device maps, CPU/disk offload, quantized loading): one process "
    "spreading a model over its devices, not a data-parallel training feature. Instead: "
    "accelerate's own big_modeling in that process (it starts no processes), or "
    "`with torch.device('meta'):` for empty weights"
)
_NO_LAUNCHER = (
    "machinery of `accelerate launch` and its config files: mpaccel jobs are started by "
    "mpiexec, srun or python and read the launcher's variables in one table (mpaccel._env). "
    "Instead: `mpiexec -n N python script.py` (docs/launching.md)"
)
_NO_ENV_PATCHING = (
    "os.environ context managers: mpaccel snapshots the environment once, before MPI_Init, so "
    "a later change does not reach it. Instead: set variables for the launch "
    "(`mpiexec -x NAME=value`, `srun --export`)"
)
_NO_XLA = "TPU/XLA support: mpaccel runs on CPUs and CUDA GPUs. Instead: Accelerate on TPUs"
_NO_PICKLE_LAYOUT = (
    "file names of Accelerate's checkpoint layout (torch.save pickles): mpaccel writes one "
    "HDF5 checkpoint with an index and no pickle (docs/checkpoint-format.md). Instead: "
    "save_state/load_state, `mpaccel ckpt export` for safetensors"
)

ABSENT: dict[str, str] = {
    **_each(
        (U,),
        "DeepSpeedEngineWrapper DeepSpeedOptimizerWrapper DeepSpeedSchedulerWrapper "
        "DeepSpeedSequenceParallelConfig DummyOptim DummyScheduler HfDeepSpeedConfig "
        "GatheredParameters deepspeed_required get_active_deepspeed_plugin "
        "map_pytorch_optim_to_deepspeed prepare_deepspeed_cmd_env compile_regions_deepspeed",
        _NO_DEEPSPEED,
    ),
    **_each(
        ("Accelerator.",),
        "deepspeed_config deepspeed_engine_wrapped deepspeed_ulysses_dl_adapter",
        _NO_DEEPSPEED,
    ),
    **_each(
        (U,),
        "AbstractTrainStep BertTrainStep GPTTrainStep T5TrainStep MegatronEngine "
        "MegatronLMDummyDataLoader MegatronLMDummyScheduler MegatronLMOptimizerWrapper "
        "MegatronLMSchedulerWrapper add_model_config_to_megatron_parser "
        "avg_losses_across_data_parallel_group gather_across_data_parallel_groups "
        "megatron_lm_initialize megatron_lm_prepare_data_loader "
        "megatron_lm_prepare_model_optimizer_scheduler megatron_lm_prepare_optimizer "
        "megatron_lm_prepare_scheduler",
        _NO_MEGATRON,
    ),
    **_each(
        (U,),
        "disable_fsdp_ram_efficient_loading enable_fsdp_ram_efficient_loading fsdp2_apply_ac "
        "fsdp2_canonicalize_names fsdp2_load_full_state_dict fsdp2_prepare_model "
        "fsdp2_switch_optimizer_parameters get_fsdp2_grad_scaler "
        "compile_regions_fsdp2 model_has_dtensor get_module_children_bottom_up",
        _NO_FSDP,
    ),
    **_each(
        (U,),
        "AORecipeKwargs FP8RecipeKwargs MSAMPRecipeKwargs TERecipeKwargs apply_fp8_autowrap "
        "check_cuda_fp8_capability contextual_fp8_autocast convert_model "
        "convert_model_to_fp8_ao filter_first_and_last_linear_layers has_ao_layers "
        "has_transformer_engine_layers torchao_required",
        _NO_FP8,
    ),
    **_each(
        ("Accelerator.",),
        "ao_recipe_handler te_recipe_handler msamp_recipe_handler fp8_recipe_handler "
        "fp8_backend fp8_enabled has_fp8_handler delayed_fp8_autocast",
        _NO_FP8,
    ),
    **_each(
        (U,),
        "TorchContextParallelConfig TorchTensorParallelConfig get_model_tp_size",
        _NO_PARALLELISM,
    ),
    **_each(("Accelerator.",), "maybe_context_parallel", _NO_PARALLELISM),
    **_each((A,), "prepare_pippy", _NO_PARALLELISM),
    **_each(
        (A, U),
        "infer_auto_device_map load_checkpoint_in_model",
        _NO_BIG_MODEL,
    ),
    **_each(
        (A,),
        "cpu_offload cpu_offload_with_hook disk_offload dispatch_model init_empty_weights "
        "init_on_device load_checkpoint_and_dispatch",
        _NO_BIG_MODEL,
    ),
    **_each(
        (U,),
        "align_module_device BnbQuantizationConfig load_and_quantize_model "
        "calculate_maximum_sizes check_device_map check_tied_parameters_in_config "
        "check_tied_parameters_on_same_device compute_module_sizes get_balanced_memory "
        "get_max_layer_size get_max_memory has_4bit_bnb_layers has_offloaded_params "
        "OffloadedWeightsLoader PrefixedDataset load_offloaded_weight load_offloaded_weights "
        "offload_state_dict offload_weight save_offload_index set_module_tensor_to_device "
        "named_module_tensors find_tied_parameters retie_parameters ensure_weights_retied "
        "id_tensor_storage dtype_byte_size convert_file_size_to_int CustomDtype "
        "extract_submodules_state_dict load_state_dict clean_state_dict_for_safetensors",
        _NO_BIG_MODEL,
    ),
    **_each((A,), "debug_launcher notebook_launcher", _NO_LAUNCHER),
    **_each(
        (U,),
        "PrepareForLaunch prepare_multi_gpu_env prepare_simple_launcher_cmd_env "
        "prepare_sagemager_args_inputs write_basic_config TORCH_LAUNCH_PARAMS "
        "convert_dict_to_env_variables purge_accelerate_environment "
        "get_cpu_distributed_information is_port_in_use parse_flag_from_env "
        "parse_choice_from_env get_int_from_env str_to_bool get_current_device_type "
        "check_os_kernel set_numa_affinity get_gpu_info check_cuda_p2p_ib_support",
        _NO_LAUNCHER,
    ),
    **_each((U,), "clear_environment patch_environment", _NO_ENV_PATCHING),
    **_each((U,), "install_xla prepare_tpu", _NO_XLA),
    **_each(("AcceleratorState.",), "downcast_bfloat", _NO_XLA),
    **_each(
        (U,),
        "MODEL_NAME OPTIMIZER_NAME RNG_STATE_NAME SAMPLER_NAME SCALER_NAME SCHEDULER_NAME "
        "WEIGHTS_PATTERN_NAME SAFE_MODEL_NAME",
        _NO_PICKLE_LAYOUT,
    ),
    **_each(
        (U,),
        "save load",
        "torch.save/torch.load on the main process: pickles, which mpaccel never writes or "
        "reads. Instead: Accelerator.save(obj, f) (the main process writes; "
        "safe_serialization=True for safetensors) and save_state/load_state",
    ),
    **_each(
        ("accelerate.state.",),
        "SharedDict ThreadLocalSharedDict",
        "Accelerate's storage of the shared state (thread-local for XLA's spawned threads): "
        "mpaccel runs one process per rank and keeps the state in a class dict. Instead: "
        "PartialState(), AcceleratorState()",
    ),
    **_each(
        ("accelerate.state.",),
        "do_nothing",
        "a no-op Accelerate's state.py uses internally; not for scripts",
    ),
    **_each(
        ("Accelerator.",),
        "flag_tensor",
        "the tensor behind Accelerate's set_trigger: mpaccel's trigger is an MPI allreduce "
        "on a Python bool. Instead: set_trigger() / check_trigger()",
    ),
    **_each(
        (U,),
        "MITA_PROFILING_AVAILABLE_PYTORCH_VERSION XPU_PROFILING_AVAILABLE_PYTORCH_VERSION",
        "torch versions for Intel XPU/MTIA profiling: mpaccel runs on CPUs and CUDA GPUs",
    ),
}

# Gaps: names to add where the note says (Accelerate's scripts or common training scripts use
# them, and nothing about MPI stands in their way).
MISSING: dict[str, str] = {}
