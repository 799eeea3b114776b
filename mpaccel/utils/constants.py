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
