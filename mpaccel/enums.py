"""Accelerate's string enums (DistributedType, PrecisionType, LoggerType, ...): members that
compare and print as their values. mpaccel.utils re-exports them."""

from __future__ import annotations

import enum


class _NamedEnumMeta(enum.EnumMeta):
    """`"fp16" in PrecisionType` answers by value (Python 3.11's Enum raises TypeError)."""

    def __contains__(cls, item: object) -> bool:
        try:
            cls(item)
        except ValueError:
            return False
        return True


class NamedEnum(str, enum.Enum, metaclass=_NamedEnumMeta):
    """A string enum that prints as its value (as Accelerate's enums do)."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def list(cls) -> list[str]:
        """Every value, as Accelerate's `Enum.list()`."""
        return [str(member) for member in cls]


class LoggerType(NamedEnum):
    """Tracker names, as Accelerate spells them, for `Accelerator(log_with=...)` (which of
    them mpaccel can start: docs/training.md, "Experiment trackers")."""

    ALL = "all"
    AIM = "aim"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    TRACKIO = "trackio"
    COMETML = "comet_ml"
    MLFLOW = "mlflow"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"


class DistributedType(NamedEnum):
    """Kinds of distributed set-up, every member Accelerate has. mpaccel itself produces NO,
    MULTI_CPU (gloo) and MULTI_GPU (NCCL); the other names exist so code comparing against them
    keeps working."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"


class PrecisionType(NamedEnum):
    """Values of `mixed_precision` (mpaccel refuses FP8: see the training docs)."""

    NO = "no"
    FP8 = "fp8"
    FP16 = "fp16"
    BF16 = "bf16"


class RNGType(NamedEnum):
    """Random generators, as Accelerate names them for `Accelerator(rng_types=...)`."""

    TORCH = "torch"
    CUDA = "cuda"
    MLU = "mlu"
    SDAA = "sdaa"
    MUSA = "musa"
    NPU = "npu"
    XLA = "xla"
    XPU = "xpu"
    HPU = "hpu"
    NEURON = "neuron"
    GENERATOR = "generator"


class DynamoBackend(NamedEnum):
    """torch.compile backends, as Accelerate names them (`Accelerator(dynamo_backend=...)`):
    the lower-cased value is torch's backend name; NO compiles nothing."""

    NO = "NO"
    EAGER = "EAGER"
    AOT_EAGER = "AOT_EAGER"
    INDUCTOR = "INDUCTOR"
    AOT_TS_NVFUSER = "AOT_TS_NVFUSER"
    NVPRIMS_NVFUSER = "NVPRIMS_NVFUSER"
    CUDAGRAPHS = "CUDAGRAPHS"
    OFI = "OFI"
    FX2TRT = "FX2TRT"
    ONNXRT = "ONNXRT"
    TENSORRT = "TENSORRT"
    AOT_TORCHXLA_TRACE_ONCE = "AOT_TORCHXLA_TRACE_ONCE"
    TORCHXLA_TRACE_ONCE = "TORCHXLA_TRACE_ONCE"
    TVM = "TVM"
    HPU_BACKEND = "HPU_BACKEND"
    NEURON = "NEURON"


class DDPCommunicationHookType(NamedEnum):
    """DDP communication hooks (torch.distributed.algorithms.ddp_comm_hooks) for
    `DistributedDataParallelKwargs(comm_hook=..., comm_wrapper=...)`."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


class ComputeEnvironment(NamedEnum):
    """Where Accelerate's `accelerate config` says the job runs (kept for code naming it)."""

    LOCAL_MACHINE = "LOCAL_MACHINE"
    AMAZON_SAGEMAKER = "AMAZON_SAGEMAKER"


class SageMakerDistributedType(NamedEnum):
    """SageMaker's kinds of parallelism (kept for code naming them; mpaccel has no SageMaker
    launcher)."""

    NO = "NO"
    DATA_PARALLEL = "DATA_PARALLEL"
    MODEL_PARALLEL = "MODEL_PARALLEL"
