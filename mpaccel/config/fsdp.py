"""Fully sharded data parallelism's configuration, with Accelerate's names:
FullyShardedDataParallelPlugin (FSDP2 only) and its enums (the mesh's shape is
config/parallelism.py's ParallelismConfig). Unset fields take Accelerate's FSDP_* variables,
read through mpaccel.envvars."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import envvars
from ..enums import NamedEnum
from ..errors import ConfigurationError, MpaccelWarning
from .kwargs import KwargsHandler


class FSDPShardingStrategy(NamedEnum):
    """Accelerate's FSDP_SHARDING_STRATEGY names. Under FSDP2, FULL_SHARD and SHARD_GRAD_OP shard
    over every rank (SHARD_GRAD_OP keeps parameters gathered between forward and backward);
    the HYBRID ones shard within each node and replicate across nodes. NO_SHARD is DDP."""

    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    NO_SHARD = "NO_SHARD"
    HYBRID_SHARD = "HYBRID_SHARD"
    HYBRID_SHARD_ZERO2 = "HYBRID_SHARD_ZERO2"


class FSDPStateDictType(NamedEnum):
    """What save_state writes for a sharded model: its shards, or whole tensors (FSDP2 has no
    LOCAL_STATE_DICT)."""

    SHARDED_STATE_DICT = "SHARDED_STATE_DICT"
    FULL_STATE_DICT = "FULL_STATE_DICT"


class FSDPAutoWrapPolicy(NamedEnum):
    """Which submodules become FSDP units of their own (the root always is one)."""

    TRANSFORMER_BASED_WRAP = "TRANSFORMER_BASED_WRAP"
    SIZE_BASED_WRAP = "SIZE_BASED_WRAP"
    NO_WRAP = "NO_WRAP"


# Accelerate accepts FSDP1's integer codes (torch's ShardingStrategy / StateDictType values).
_STRATEGY_CODES = dict(enumerate(FSDPShardingStrategy, start=1))
_STATE_DICT_CODES = {1: "FULL_STATE_DICT", 2: "LOCAL_STATE_DICT", 3: "SHARDED_STATE_DICT"}
_DTYPE_NAMES = {
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "float16": "float16", "half": "float16",
    "fp32": "float32", "float32": "float32", "float": "float32",
}  # fmt: skip
_POLICY_KEYS = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
# FSDP1's fields: accepted (Accelerate's configs carry them), without effect under FSDP2.
_FSDP1_ONLY = ("backward_prefetch", "use_orig_params", "sync_module_states", "param_init_fn")


def _named(value: Any) -> str:
    """An enum member (ours or torch's), or a string, as an upper-case name."""
    name = getattr(value, "name", None)
    return str(name if isinstance(name, str) else value).strip().upper()


def _dtype(value: Any, where: str) -> Any:
    import torch

    if value is None or isinstance(value, torch.dtype):
        return value
    name = _DTYPE_NAMES.get(str(value).strip().lower())
    if name is None:
        raise ConfigurationError(
            f"FullyShardedDataParallelPlugin(mixed_precision_policy=...): {where}={value!r} is "
            "not a floating-point dtype",
            "use torch.bfloat16, torch.float16, torch.float32 or 'bf16', 'fp16', 'fp32'.",
        )
    return getattr(torch, name)


@dataclass(frozen=True)
class PrecisionPolicy:
    """The fields of torch's MixedPrecisionPolicy, as the plugin holds them: the FullySharded
    strategy builds torch's from it (strategy/fully_sharded.py), so that configuring imports no
    torch.distributed."""

    param_dtype: Any = None
    reduce_dtype: Any = None
    output_dtype: Any = None
    cast_forward_inputs: bool = True


def _policy(value: Any) -> PrecisionPolicy | None:
    """The PrecisionPolicy of a policy (torch's or ours), a dict of its fields, or one dtype
    for all."""
    if value is None:
        return None
    if all(hasattr(value, key) for key in _POLICY_KEYS):  # torch's own (or a look-alike)
        fields = {key: getattr(value, key) for key in _POLICY_KEYS}
    elif isinstance(value, dict):
        unknown = sorted(set(value) - set(_POLICY_KEYS))
        if unknown:
            hint = f"its keys are {list(_POLICY_KEYS)}"
            if "buffer_dtype" in unknown:
                hint += " (FSDP2 keeps buffers in their own dtype: drop buffer_dtype)"
            raise ConfigurationError(
                f"FullyShardedDataParallelPlugin(mixed_precision_policy=...) has unknown key(s) "
                f"{unknown}",
                hint + ".",
            )
        fields = dict(value)
    else:
        dtype = _dtype(value, "mixed_precision_policy")
        fields = {"param_dtype": dtype, "reduce_dtype": dtype, "output_dtype": dtype}
    for key in ("param_dtype", "reduce_dtype", "output_dtype"):
        fields[key] = _dtype(fields.get(key), key)
    fields["cast_forward_inputs"] = bool(fields.get("cast_forward_inputs", True))
    return PrecisionPolicy(**fields)


@dataclass
class FullyShardedDataParallelPlugin(KwargsHandler):
    """Fully sharded data parallelism (torch's FSDP2, `fully_shard`): `Accelerator(fsdp_plugin=
    FullyShardedDataParallelPlugin(...))`. Accelerate's fields, in its order; see docs/training.md.

    fsdp_version: 2 (1 is refused). sharding_strategy: FSDPShardingStrategy or its name;
    HYBRID_SHARD shards within each node and replicates across nodes. reshard_after_forward:
    free gathered parameters after forward (default True; SHARD_GRAD_OP means False).
    mixed_precision_policy: torch's MixedPrecisionPolicy, a dict of its fields, or one dtype
    ('bf16'); None follows `Accelerator(mixed_precision=...)`. auto_wrap_policy:
    'transformer_based_wrap' (with transformer_cls_names_to_wrap, else the model's
    `_no_split_modules`), 'size_based_wrap' (with min_num_params), 'no_wrap', or a callable
    `policy(module) -> bool` (torch's FSDP1 policies too). cpu_offload: keep parameters,
    gradients and optimizer state in CPU memory (a GPU option). ignored_modules: modules (or a
    regex of their names) left whole and unmanaged. state_dict_type: SHARDED_STATE_DICT or
    FULL_STATE_DICT. activation_checkpointing: recompute each wrapped block's activations in
    backward (activation_checkpointing_offload=True, which also moves them to host memory, is
    refused). cpu_ram_efficient_loading: rank 0 alone holds real weights, the other ranks'
    model may be on the meta device; prepare() sends each rank its shard. forward_methods
    (mpaccel's): names of model methods that FSDP treats as forward passes, gathering the
    parameters before them, besides `generate`, registered wherever the model has one.
    Fields set to None take Accelerate's FSDP_* variables. FSDP1's fields are accepted and
    have no effect (a warning says so); forward_prefetch is refused. The plugin keeps
    mixed_precision_policy as a PrecisionPolicy (torch's fields; FullySharded builds torch's).
    """

    fsdp_version: int | None = None
    sharding_strategy: Any = None
    reshard_after_forward: Any = None
    backward_prefetch: Any = None
    mixed_precision_policy: Any = None
    auto_wrap_policy: Any = None
    cpu_offload: Any = None
    ignored_modules: Any = None
    state_dict_type: Any = None
    state_dict_config: Any = None
    optim_state_dict_config: Any = None
    limit_all_gathers: bool = True
    use_orig_params: bool | None = None
    param_init_fn: Callable | None = None
    sync_module_states: bool | None = None
    forward_prefetch: bool | None = None
    activation_checkpointing: bool | None = None
    activation_checkpointing_offload: bool | None = None
    cpu_ram_efficient_loading: bool | None = None
    transformer_cls_names_to_wrap: list[str] | None = None
    min_num_params: int | None = None
    forward_methods: list[str] | None = None

    def __post_init__(self) -> None:
        version = self.fsdp_version if self.fsdp_version is not None else envvars.get_int(
            "fsdp_version"
        )
        if version is None:
            version = 2
        if isinstance(version, str) and version.strip().isdigit():
            version = int(version)
        if version != 2:
            source = (
                "" if self.fsdp_version is not None else f" (from FSDP_VERSION={version!r})"
            )
            raise ConfigurationError(
                f"FullyShardedDataParallelPlugin(fsdp_version={version!r}){source}: mpaccel "
                "drives FSDP2 (torch's fully_shard) only",
                ("pass fsdp_version=2, or leave it unset" if not source else
                 "set FSDP_VERSION=2 (accelerate config: fsdp_version: 2), or unset it")
                + "; the other fields keep Accelerate's meanings (docs/training.md).",
            )
        self.fsdp_version = 2
        self._drop_fsdp1_fields()
        self.sharding_strategy = self._strategy()
        self.reshard_after_forward = self._reshard()
        self.set_state_dict_type()
        self._wrap_policy()
        self.cpu_offload = self._cpu_offload()
        self.activation_checkpointing = self._flag(
            "activation_checkpointing", "fsdp_activation_checkpointing"
        )
        if self.activation_checkpointing_offload:
            raise ConfigurationError(
                "FullyShardedDataParallelPlugin(activation_checkpointing_offload=True): mpaccel "
                "does not move checkpointed activations to host memory",
                "drop it; activation_checkpointing=True alone recomputes them in backward.",
            )
        self.cpu_ram_efficient_loading = self._flag(
            "cpu_ram_efficient_loading", "fsdp_cpu_ram_efficient_loading"
        )
        self.mixed_precision_policy = _policy(self.mixed_precision_policy)
        self.forward_methods = self._forward_methods()
        if self.ignored_modules is None:
            self.ignored_modules = envvars.get("fsdp_ignored_modules")
        if self.ignored_modules is not None and not isinstance(self.ignored_modules, str):
            self.ignored_modules = list(self.ignored_modules)

    # -- normalisation, field by field ---------------------------------------------------------

    def _forward_methods(self) -> list[str]:
        value = self.forward_methods
        names = [value] if isinstance(value, str) else value or []
        if not isinstance(names, (list, tuple)) or not all(
            isinstance(name, str) and name.isidentifier() for name in names
        ):
            raise ConfigurationError(
                f"FullyShardedDataParallelPlugin(forward_methods={value!r}) must be method names",
                "pass a list of the names of the model's methods that run it as forward does, "
                "e.g. forward_methods=['score'] ('generate' is registered by itself).",
            )
        return list(names)

    def _drop_fsdp1_fields(self) -> None:
        if self.forward_prefetch:
            raise ConfigurationError(
                "FullyShardedDataParallelPlugin(forward_prefetch=True) is FSDP1's; FSDP2 has no "
                "forward prefetch switch",
                "drop forward_prefetch (FSDP2 overlaps its all-gathers by itself).",
            )
        self.forward_prefetch = None
        if isinstance(self.backward_prefetch, str) and _named(self.backward_prefetch) == (
            "NO_PREFETCH"
        ):
            self.backward_prefetch = None
        ignored = [name for name in _FSDP1_ONLY if getattr(self, name) is not None]
        if ignored:
            warnings.warn(
                f"FullyShardedDataParallelPlugin: {ignored} are FSDP1 settings and have no "
                "effect under FSDP2 (set to None)",
                MpaccelWarning,
                stacklevel=4,
            )
        for name in ignored:
            setattr(self, name, None)

    def _strategy(self) -> FSDPShardingStrategy | None:
        value = self.sharding_strategy
        if value is None:
            value = envvars.get_choice("fsdp_sharding_strategy")
            if value is None:
                return None
        if isinstance(value, int) and not isinstance(value, bool) and value in _STRATEGY_CODES:
            value = _STRATEGY_CODES[value]
        name = _named(value)
        if name.isdigit() and int(name) in _STRATEGY_CODES:
            name = _STRATEGY_CODES[int(name)].value
        if name not in FSDPShardingStrategy:
            raise ConfigurationError(
                f"FullyShardedDataParallelPlugin(sharding_strategy={value!r}) is not a sharding "
                "strategy",
                f"use one of {FSDPShardingStrategy.list()} (HYBRID_SHARD: shard within each "
                "node, replicate across nodes).",
            )
        strategy = FSDPShardingStrategy(name)
        if strategy is FSDPShardingStrategy.NO_SHARD:
            raise ConfigurationError(
                "FullyShardedDataParallelPlugin(sharding_strategy='NO_SHARD') shards nothing: "
                "it is DistributedDataParallel",
                "drop fsdp_plugin (mpaccel trains with DDP by default), or pick FULL_SHARD or "
                "HYBRID_SHARD.",
            )
        return strategy

    def _reshard(self) -> bool:
        value = self.reshard_after_forward
        if value is None:
            value = envvars.get_bool("fsdp_reshard_after_forward", True) if envvars.is_set(
                "fsdp_reshard_after_forward"
            ) else self.sharding_strategy not in (
                FSDPShardingStrategy.SHARD_GRAD_OP,
                FSDPShardingStrategy.HYBRID_SHARD_ZERO2,
            )
        if isinstance(value, str):
            try:
                value = envvars.Flag().parse(value)
            except ValueError:
                pass
        if not isinstance(value, bool):
            raise ConfigurationError(
                f"FullyShardedDataParallelPlugin(reshard_after_forward={value!r}) must be a bool "
                "under FSDP2",
                "use True (free gathered parameters after forward) or False (keep them until "
                "backward); put FSDP1's strategy names in sharding_strategy.",
            )
        return value

    def set_state_dict_type(self, state_dict_type: Any = None) -> None:
        """Set (or normalise) state_dict_type: a name, FSDPStateDictType or torch's
        StateDictType; None keeps the field, else FSDP_STATE_DICT_TYPE, else
        SHARDED_STATE_DICT."""
        value = state_dict_type if state_dict_type is not None else self.state_dict_type
        if value is None:
            value = envvars.get_choice("fsdp_state_dict_type") or "SHARDED_STATE_DICT"
        name = _named(value)
        if name.isdigit():
            name = _STATE_DICT_CODES.get(int(name), name)
        if name not in FSDPStateDictType:
            raise ConfigurationError(
                f"FullyShardedDataParallelPlugin(state_dict_type={value!r}) is not a state dict "
                "type of FSDP2",
                f"use one of {FSDPStateDictType.list()} (FSDP2 has no LOCAL_STATE_DICT).",
            )
        self.state_dict_type = FSDPStateDictType(name)

    def _wrap_policy(self) -> None:
        value = self.auto_wrap_policy
        if value is None:
            value = envvars.get_choice("fsdp_auto_wrap_policy") or "no_wrap"
        if callable(value) and getattr(value, "__name__", "") in (
            "transformer_auto_wrap_policy",
            "size_based_auto_wrap_policy",
        ):  # torch's functions themselves, as Accelerate's plugin stores them
            value = value.__name__.replace("_auto_wrap_policy", "_wrap").replace(
                "transformer", "transformer_based"
            )
        if callable(value):
            self.auto_wrap_policy = value
            return
        name = _named(value)
        if name not in FSDPAutoWrapPolicy:
            raise ConfigurationError(
                f"FullyShardedDataParallelPlugin(auto_wrap_policy={value!r}) is not a wrap policy",
                f"use one of {[p.lower() for p in FSDPAutoWrapPolicy.list()]} or a callable "
                "policy(module) -> bool.",
            )
        self.auto_wrap_policy = FSDPAutoWrapPolicy(name)
        if self.auto_wrap_policy is FSDPAutoWrapPolicy.TRANSFORMER_BASED_WRAP:
            names: Any = self.transformer_cls_names_to_wrap
            if names is None:
                names = envvars.get("fsdp_transformer_cls_to_wrap")
            if isinstance(names, str):
                names = [n.strip() for n in names.split(",") if n.strip()]
            self.transformer_cls_names_to_wrap = None if names is None else list(names)
        elif self.auto_wrap_policy is FSDPAutoWrapPolicy.SIZE_BASED_WRAP:
            count = self.min_num_params
            if count is None:
                count = envvars.get_int("fsdp_min_num_params") or 0
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ConfigurationError(
                    f"FullyShardedDataParallelPlugin(min_num_params={count!r}) must be an int "
                    ">= 0",
                    "for example min_num_params=1_000_000: modules with more parameters become "
                    "FSDP units of their own.",
                )
            self.min_num_params = count

    def _cpu_offload(self) -> Any:
        value = self.cpu_offload
        if value is None:
            return envvars.get_bool("fsdp_offload_params", False)
        if isinstance(value, bool) or type(value).__name__ in ("CPUOffloadPolicy", "OffloadPolicy"):
            return value
        offload = getattr(value, "offload_params", None)  # FSDP1's CPUOffload
        if isinstance(offload, bool):
            return offload
        raise ConfigurationError(
            f"FullyShardedDataParallelPlugin(cpu_offload={value!r}) is not an offload setting",
            "use True/False or torch.distributed.fsdp.CPUOffloadPolicy().",
        )

    def _flag(self, field_name: str, logical: str) -> bool:
        value = getattr(self, field_name)
        if value is None:
            return envvars.get_bool(logical, False)
        if not isinstance(value, bool):
            raise ConfigurationError(
                f"FullyShardedDataParallelPlugin({field_name}={value!r}) must be a bool"
            )
        return value

    # -- what the rest of mpaccel asks ---------------------------------------------------------

    @property
    def hybrid(self) -> bool:
        """Shard within each node and replicate across nodes (HYBRID_SHARD*)."""
        return self.sharding_strategy in (
            FSDPShardingStrategy.HYBRID_SHARD,
            FSDPShardingStrategy.HYBRID_SHARD_ZERO2,
        )

    @property
    def offloads(self) -> bool:
        """Whether cpu_offload asks for parameters in CPU memory."""
        return self.cpu_offload is True or type(self.cpu_offload).__name__ == "CPUOffloadPolicy"

    def set_mixed_precision(
        self, mixed_precision: Any, buffer_autocast: bool = False, override: bool = False
    ) -> None:
        """Use `mixed_precision` ('bf16', 'fp16', 'fp32' or a dtype) for parameters, gradient
        reduction and outputs, unless a policy is set already (`override`: replace it).
        `buffer_autocast` (FSDP1's buffer dtype) has nothing to act on under FSDP2."""
        del buffer_autocast
        if override or self.mixed_precision_policy is None:
            self.mixed_precision_policy = _policy(mixed_precision)
