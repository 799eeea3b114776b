"""Accelerate's constants (`accelerate.utils.constants`), with the same values: the file names
of Hugging Face model files, for scripts that look for or write them (mpaccel's own checkpoints
are HDF5, docs/checkpoint-format.md), and the distributed types whose collectives go through
torch.distributed."""

WEIGHTS_NAME = "pytorch_model.bin"
WEIGHTS_INDEX_NAME = f"{WEIGHTS_NAME}.index.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = f"{SAFE_WEIGHTS_NAME}.index.json"
SAFE_WEIGHTS_PATTERN_NAME = "model{suffix}.safetensors"
PROFILE_PATTERN_NAME = "profile_{suffix}.json"

# DistributedType values (strings, as Accelerate compares `distributed_type.value`)
CUDA_DISTRIBUTED_TYPES = ["DEEPSPEED", "MULTI_GPU", "FSDP", "MEGATRON_LM", "TP"]
TORCH_DISTRIBUTED_OPERATION_TYPES = [
    *CUDA_DISTRIBUTED_TYPES,
    "MULTI_NPU",
    "MULTI_MLU",
    "MULTI_SDAA",
    "MULTI_MUSA",
    "MULTI_XPU",
    "MULTI_CPU",
    "MULTI_HPU",
    "MULTI_NEURON",
]

# FSDP's option names, as Accelerate lists them for its plugin and transformers' TrainingArguments
# checks `fsdp=` and `fsdp_config` against (mpaccel's plugin accepts FULL_SHARD and HYBRID_SHARD,
# docs/training.md).
FSDP_SHARDING_STRATEGY = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD",
                          "HYBRID_SHARD_ZERO2"]
FSDP_AUTO_WRAP_POLICY = ["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"]
FSDP_BACKWARD_PREFETCH = ["BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"]
FSDP_STATE_DICT_TYPE = ["FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT"]
FSDP2_STATE_DICT_TYPE = ["SHARDED_STATE_DICT", "FULL_STATE_DICT"]
FSDP2_PYTORCH_VERSION = "2.6.0"
FSDP_MODEL_NAME = "pytorch_model_fsdp"
