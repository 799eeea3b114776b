"""`is_*_available()` with Accelerate's names and meanings, answered for this machine: a package
counts when it is importable and installed (its distribution metadata exists), a device when torch
reports one. Nothing here imports an optional package unless a device check needs its torch
extension. Unlike Accelerate's, no answer depends on an ACCELERATE_* environment variable."""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import operator
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.torch_version import TorchVersion

_OPERATIONS: dict[str, Callable[[Any, Any], bool]] = {
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
    "<=": operator.le,
    "<": operator.lt,
}


def compare_versions(library_or_version: Any, operation: str, requirement_version: str) -> bool:
    """Not collective. Whether `library_or_version` `operation` `requirement_version` holds,
    compared as versions (PEP 440).

    Args:
        library_or_version: an installed distribution's name (its version is looked up), or
            a version.
        operation: ">", ">=", "==", "!=", "<=" or "<".
        requirement_version: the version to compare with.

    Raises:
        ValueError: for another `operation`.
        importlib.metadata.PackageNotFoundError: for a name that is not installed.
    """
    if operation not in _OPERATIONS:
        raise ValueError(f"operation must be one of {list(_OPERATIONS)}, got {operation!r}")
    found = str(library_or_version)
    if isinstance(library_or_version, str) and not found[:1].isdigit():
        found = importlib.metadata.version(library_or_version)
    # TorchVersion compares by PEP 440 (with torch's vendored `packaging`), against strings too.
    return _OPERATIONS[operation](TorchVersion(found), requirement_version)


def is_torch_version(operation: str, version: str) -> bool:
    """Not collective. Whether the installed torch's version compares so with `version`, e.g.
    is_torch_version(">=", "2.4").

    Args:
        operation: ">", ">=", "==", "!=", "<=" or "<".
        version: the version to compare with.
    """
    return compare_versions(torch.__version__, operation, version)


@functools.cache
def _installed(module: str, *distributions: str) -> bool:
    """`module` can be imported and one of `distributions` (default: the module's name) is
    installed: a directory that happens to bear the name does not count."""
    try:
        if importlib.util.find_spec(module) is None:
            return False
    except (ImportError, ValueError):
        return False
    for name in distributions or (module,):
        try:
            importlib.metadata.metadata(name)
            return True
        except importlib.metadata.PackageNotFoundError:
            continue
    return False


def _version_at_least(distribution: str, minimum: str) -> bool:
    return compare_versions(distribution, ">=", minimum)


# -- packages -------------------------------------------------------------------------------------


def is_aim_available() -> bool:
    """Not collective. Whether aim, below 4.0, is installed."""
    return _installed("aim") and compare_versions("aim", "<", "4.0.0")


def is_amdsmi_available() -> bool:
    """Not collective. Whether amdsmi is installed."""
    return _installed("amdsmi")


def is_boto3_available() -> bool:
    """Not collective. Whether boto3 is installed."""
    return _installed("boto3")


def is_clearml_available() -> bool:
    """Not collective. Whether clearml is installed."""
    return _installed("clearml")


def is_comet_ml_available() -> bool:
    """Not collective. Whether comet_ml is installed."""
    return _installed("comet_ml")


def is_datasets_available() -> bool:
    """Not collective. Whether datasets is installed."""
    return _installed("datasets")


def is_deepspeed_available() -> bool:
    """Not collective. Whether deepspeed is installed (mpaccel does not drive it)."""
    return _installed("deepspeed")


def is_dvclive_available() -> bool:
    """Not collective. Whether dvclive is installed."""
    return _installed("dvclive")


def is_import_timer_available() -> bool:
    """Not collective. Whether import_timer is installed."""
    return _installed("import_timer")


def is_lomo_available() -> bool:
    """Not collective. Whether lomo_optim is installed."""
    return _installed("lomo_optim")


def is_matplotlib_available() -> bool:
    """Not collective. Whether matplotlib is installed."""
    return _installed("matplotlib")


def is_megatron_lm_available() -> bool:
    """Not collective. Whether megatron-core 0.8.0 or later is installed (not driven here)."""
    return _installed("megatron", "megatron-core") and _version_at_least("megatron-core", "0.8.0")


def is_mlflow_available() -> bool:
    """Not collective. Whether mlflow (or mlflow-skinny) is installed."""
    return _installed("mlflow", "mlflow", "mlflow-skinny")


def is_msamp_available() -> bool:
    """Not collective. Whether MS-AMP is installed."""
    return _installed("msamp", "ms-amp")


def is_pandas_available() -> bool:
    """Not collective. Whether pandas is installed."""
    return _installed("pandas")


def is_peft_available() -> bool:
    """Not collective. Whether peft is installed."""
    return _installed("peft")


def is_pynvml_available() -> bool:
    """Not collective. Whether pynvml (or nvidia-ml-py) is installed."""
    return _installed("pynvml", "pynvml", "nvidia-ml-py")


def is_pytest_available() -> bool:
    """Not collective. Whether pytest is installed."""
    return _installed("pytest")


def is_rich_available() -> bool:
    """Not collective. Whether rich is installed."""
    return _installed("rich")


def is_sagemaker_available() -> bool:
    """Not collective. Whether sagemaker is installed."""
    return _installed("sagemaker")


def is_schedulefree_available() -> bool:
    """Not collective. Whether schedulefree is installed."""
    return _installed("schedulefree")


def is_swanlab_available() -> bool:
    """Not collective. Whether swanlab is installed."""
    return _installed("swanlab")


def is_tensorboard_available() -> bool:
    """Not collective. Whether tensorboard or tensorboardX is installed."""
    return _installed("tensorboard") or _installed("tensorboardX")


def is_timm_available() -> bool:
    """Not collective. Whether timm is installed."""
    return _installed("timm")


def is_torchao_available() -> bool:
    """Not collective. Whether torchao 0.6.1 or later is installed."""
    return _installed("torchao") and _version_at_least("torchao", "0.6.1")


def is_torchdata_available() -> bool:
    """Not collective. Whether torchdata is installed."""
    return _installed("torchdata")


def is_torchdata_stateful_dataloader_available() -> bool:
    """Not collective. Whether torchdata 0.8.0 or later (with StatefulDataLoader) is installed."""
    return _installed("torchdata") and _version_at_least("torchdata", "0.8.0")


def is_torchvision_available() -> bool:
    """Not collective. Whether torchvision is installed."""
    return _installed("torchvision")


def is_tqdm_available() -> bool:
    """Not collective. Whether tqdm is installed."""
    return _installed("tqdm")


def is_trackio_available() -> bool:
    """Not collective. Whether trackio is installed (on Python 3.10 or later)."""
    return sys.version_info >= (3, 10) and _installed("trackio")


def is_transformer_engine_available() -> bool:
    """Not collective. Whether Transformer Engine is installed (Intel's on Gaudi)."""
    if is_hpu_available():
        return _installed("intel_transformer_engine", "intel-transformer-engine")
    return _installed("transformer_engine", "transformer-engine")


def is_transformer_engine_mxfp8_available() -> bool:
    """Not collective. Whether Transformer Engine is installed and this GPU supports MXFP8."""
    if not _installed("transformer_engine", "transformer-engine"):
        return False
    from transformer_engine.pytorch.fp8 import check_mxfp8_support

    return bool(check_mxfp8_support()[0])


def is_transformers_available() -> bool:
    """Not collective. Whether transformers is installed."""
    return _installed("transformers")


def is_triton_available() -> bool:
    """Not collective. Whether triton is installed (triton-xpu on Intel GPUs)."""
    if is_xpu_available():
        return _installed("triton", "triton-xpu")
    return _installed("triton")


def is_wandb_available() -> bool:
    """Not collective. Whether wandb is installed."""
    return _installed("wandb")


def is_bnb_available(min_version: str | None = None) -> bool:
    """Not collective. Whether bitsandbytes is installed.

    Args:
        min_version: the oldest version that counts; None: any.
    """
    if not _installed("bitsandbytes"):
        return False
    return min_version is None or _version_at_least("bitsandbytes", min_version)


def is_4bit_bnb_available() -> bool:
    """Not collective. Whether bitsandbytes 0.39.0 or later (4-bit) is installed."""
    return is_bnb_available("0.39.0")


def is_8bit_bnb_available() -> bool:
    """Not collective. Whether bitsandbytes 0.37.2 or later (8-bit) is installed."""
    return is_bnb_available("0.37.2")


def is_bitsandbytes_multi_backend_available() -> bool:
    """Not collective. Whether bitsandbytes is installed with its multi-backend feature."""
    if not is_bnb_available():
        return False
    import bitsandbytes

    return "multi_backend" in getattr(bitsandbytes, "features", set())


def is_fp8_available() -> bool:
    """Not collective. Whether an FP8 library (MS-AMP, Transformer Engine, torchao) is
    installed; mpaccel itself refuses mixed_precision='fp8'."""
    return is_msamp_available() or is_transformer_engine_available() or is_torchao_available()


# -- torch features and devices -----------------------------------------------------------------


def is_torch_distributed_available() -> bool:
    """Not collective. Whether torch was built with torch.distributed."""
    return torch.distributed.is_available()


def is_xccl_available() -> bool:
    """Not collective. Whether torch.distributed has Intel's XCCL backend."""
    check = getattr(torch.distributed.distributed_c10d, "is_xccl_available", None)
    return bool(check()) if check is not None and is_torch_distributed_available() else False


def is_weights_only_available() -> bool:
    """Not collective. Whether torch.load takes weights_only= safely (torch 2.4 or later)."""
    return is_torch_version(">=", "2.4.0")


def is_pippy_available() -> bool:
    """Not collective. Whether torch's pipeline parallelism is there (torch 2.4 or later)."""
    return is_torch_version(">=", "2.4.0")


def is_numpy_available(min_version: str = "1.25.0") -> bool:
    """Not collective. Whether numpy `min_version` or later is installed.

    Args:
        min_version: the oldest version that counts.
    """
    return _installed("numpy") and _version_at_least("numpy", min_version)


def is_cuda_available() -> bool:
    """Not collective. Whether torch sees a CUDA (or ROCm) GPU."""
    return torch.cuda.is_available()


def is_rocm_available() -> bool:
    """Not collective. Whether torch is a ROCm build and sees an AMD GPU."""
    return torch.version.hip is not None and torch.cuda.is_available()


def is_mps_available(min_version: str = "1.12") -> bool:
    """Not collective. Whether torch (`min_version` or later) is built with, and sees, Apple's
    MPS backend.

    Args:
        min_version: the oldest torch version that counts.
    """
    backend = torch.backends.mps
    return is_torch_version(">=", min_version) and backend.is_available() and backend.is_built()


def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    """Not collective. Whether torch_xla is installed (and, if asked, runs on a TPU or a GPU).

    Args:
        check_is_tpu: also require that torch_xla's device is a TPU.
        check_is_gpu: also require that torch_xla's device is a GPU.

    Raises:
        ValueError: when both checks are asked for.
    """
    if check_is_tpu and check_is_gpu:
        raise ValueError("check_is_tpu and check_is_gpu cannot both be True")
    if not _installed("torch_xla"):
        return False
    if not (check_is_tpu or check_is_gpu):
        return True
    import torch_xla.runtime

    kind = torch_xla.runtime.device_type()
    return kind == "TPU" if check_is_tpu else kind in ("GPU", "CUDA")


def _extension_device(extension: str | None, attribute: str, check_device: bool) -> bool:
    """A device reached through `torch.<attribute>`, added by the torch extension `extension`
    (None: in torch itself) if that is installed and imports."""
    if extension is not None:
        if importlib.util.find_spec(extension) is None:
            return False
        try:
            importlib.import_module(extension)
        except Exception:  # extensions fail to import on machines without their device
            return False
    module = getattr(torch, attribute, None)
    if module is None:
        return False
    try:
        if check_device:
            module.device_count()  # raises RuntimeError when no such device is present
        return bool(module.is_available())
    except RuntimeError:
        return False


@functools.cache
def is_xpu_available(check_device: bool = False) -> bool:
    """Not collective. Whether torch (newer than 2.6) has Intel's XPU backend available
    (cached).

    Args:
        check_device: also require that a device is present (device_count() succeeds).
    """
    if is_torch_version("<=", "2.6"):
        return False
    return _extension_device(None, "xpu", check_device)


@functools.cache
def is_npu_available(check_device: bool = False) -> bool:
    """Not collective. Whether the torch_npu extension is installed and sees Ascend NPUs
    (cached).

    Args:
        check_device: also require that a device is present (device_count() succeeds).
    """
    return _extension_device("torch_npu", "npu", check_device)


@functools.cache
def is_mlu_available(check_device: bool = False) -> bool:
    """Not collective. Whether the torch_mlu extension is installed and sees Cambricon MLUs
    (cached).

    Args:
        check_device: also require that a device is present (device_count() succeeds).
    """
    return _extension_device("torch_mlu", "mlu", check_device)


@functools.cache
def is_musa_available(check_device: bool = False) -> bool:
    """Not collective. Whether the torch_musa extension is installed and sees Moore Threads GPUs
    (cached).

    Args:
        check_device: also require that a device is present (device_count() succeeds).
    """
    return _extension_device("torch_musa", "musa", check_device)


@functools.cache
def is_sdaa_available(check_device: bool = False) -> bool:
    """Not collective. Whether the torch_sdaa extension is installed and sees SDAA devices
    (cached).

    Args:
        check_device: also require that a device is present (device_count() succeeds).
    """
    return _extension_device("torch_sdaa", "sdaa", check_device)


@functools.cache
def is_neuron_available(check_device: bool = False) -> bool:
    """Not collective. Whether the torch_neuronx extension is installed and sees AWS Neuron devices
    (cached).

    Args:
        check_device: also require that a device is present (device_count() succeeds).
    """
    return _extension_device("torch_neuronx", "neuron", check_device)


@functools.cache
def is_hpu_available(init_hccl: bool = False) -> bool:
    """Not collective. Whether Habana's torch extension is installed and sees an HPU (cached).

    Args:
        init_hccl: also import Habana's HCCL process-group backend.
    """
    if importlib.util.find_spec("habana_frameworks") is None:
        return False
    if importlib.util.find_spec("habana_frameworks.torch") is None:
        return False
    importlib.import_module("habana_frameworks.torch")
    if init_hccl:
        importlib.import_module("habana_frameworks.torch.distributed.hccl")
    return _extension_device(None, "hpu", False)


def is_habana_gaudi1() -> bool:
    """Not collective. Whether the HPU is a first-generation Habana Gaudi."""
    if not is_hpu_available():
        return False
    import habana_frameworks.torch.utils.experimental as htexp

    return bool(htexp._get_device_type() == htexp.synDeviceType.synDeviceGaudi)


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """Not collective. Whether bf16 works on this machine's accelerator (always on CPU).

    Args:
        ignore_tpu: on a TPU, answer False.
    """
    if is_torch_xla_available(check_is_tpu=True):
        return not ignore_tpu
    if is_cuda_available():
        return bool(torch.cuda.is_bf16_supported())
    if is_mlu_available():
        return bool(torch.mlu.is_bf16_supported())  # type: ignore[attr-defined]
    if is_xpu_available():
        return bool(torch.xpu.is_bf16_supported())
    if is_mps_available():
        return bool(torch.backends.mps.is_macos_or_newer(14, 0))
    return True


def is_fp16_available() -> bool:
    """Not collective. Whether fp16 is supported (everywhere but Habana Gaudi 1). On CPU
    mpaccel autocasts to float16 where Accelerate stays in float32: see docs/training.md."""
    return not is_habana_gaudi1()
