"""The settings every rank must share (distributed type, mixed precision, the FSDP plugin, the
mesh, gradient accumulation, how loaders deal out batches, DDP's arguments), compared across
ranks where they are resolved: one all-reduce of a digest in `Accelerator()`. Settings that
differ are one SettingsMismatchError (a ConfigurationError) on every rank, naming each setting,
its values and the ranks holding each, instead of an abort in gloo or a timeout later on."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

from . import envvars
from .comm import Comm
from .errors import SettingsMismatchError


class Setting(NamedTuple):
    """One resolved setting: `name` in the user's words, `value` as canonical text (the same
    text on every rank for the same value), `source` where it is set. (A tuple: Accelerator()
    makes some 20 to 30 of them; a frozen dataclass took twice as long.)"""

    name: str
    value: str
    source: str


HINT = (
    "every rank must see the same environment and configuration. Look for a variable set on "
    "some ranks only (an `export` inside `if [ \"$SLURM_PROCID\" ... ]`, a per-node shell "
    "profile, `mpiexec -n 1 env X=... : ...`) or a setting computed from the rank or the host; "
    "set it for the whole job instead (export it before srun or mpiexec, or `mpiexec -genv`)."
)

# (field, variable of mpaccel.envvars that sets it when the field is None)
_FSDP_FIELDS = (
    ("sharding_strategy", "fsdp_sharding_strategy"),
    ("reshard_after_forward", "fsdp_reshard_after_forward"),
    ("mixed_precision_policy", None),
    ("auto_wrap_policy", "fsdp_auto_wrap_policy"),
    ("transformer_cls_names_to_wrap", "fsdp_transformer_cls_to_wrap"),
    ("min_num_params", "fsdp_min_num_params"),
    ("cpu_offload", "fsdp_offload_params"),
    ("ignored_modules", "fsdp_ignored_modules"),
    ("state_dict_type", "fsdp_state_dict_type"),
    ("activation_checkpointing", "fsdp_activation_checkpointing"),
    ("cpu_ram_efficient_loading", "fsdp_cpu_ram_efficient_loading"),
)
_LOADER_FIELDS = ("split_batches", "dispatch_batches", "even_batches", "use_seedable_sampler",
                  "data_seed")  # fmt: skip
_ACCUMULATION_FIELDS = ("sync_with_dataloader", "sync_each_batch")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_SHOWN = 160  # characters of a value in the error


def canonical(value: Any) -> str:
    """Not collective. `value` as text that is the same on every rank for the same setting:
    no memory addresses (a callable is its qualified name, a module its class), containers
    item by item, dataclasses (torch's MixedPrecisionPolicy) field by field."""
    if isinstance(value, enum.Enum):  # before str: mpaccel's enums are strings too
        return f"{type(value).__name__}.{value.name}"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(canonical(v) for v in value) + "]"
    if isinstance(value, dict):
        items = sorted((canonical(k), canonical(v)) for k, v in value.items())
        return "{" + ", ".join(f"{k}: {v}" for k, v in items) + "}"
    if isinstance(value, re.Pattern):
        return f"re.compile({value.pattern!r})"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = ", ".join(
            f"{f.name}={canonical(getattr(value, f.name))}" for f in dataclasses.fields(value)
        )
        return f"{type(value).__name__}({fields})"
    if isinstance(value, type) or (callable(value) and hasattr(value, "__qualname__")):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    if type(value).__module__.startswith("torch") and type(value).__name__ == "dtype":
        return str(value)
    text = repr(value)
    return f"<{type(value).__qualname__}>" if _ADDRESS.search(text) else text


def _variables(logical: str | None) -> str:
    return "" if logical is None else " or ".join(envvars.VARIABLES[logical].names)


def of_state(fsdp_plugin: Any, parallelism_config: Any, mixed_precision: str) -> list[Setting]:
    """Not collective. What AcceleratorState resolved: FSDP or DDP, mixed precision, every
    field of the FSDP plugin (after its FSDP_* variables) and the mesh's shape."""
    settings = [
        Setting(
            "distributed type",
            "FSDP" if fsdp_plugin is not None else "DDP",
            f"Accelerator(fsdp_plugin=...) or {_variables('use_fsdp')}",
        ),
        Setting(
            "mixed_precision",
            canonical(mixed_precision),
            f"Accelerator(mixed_precision=...) or {_variables('mixed_precision')}",
        ),
    ]
    if fsdp_plugin is not None:
        for field, logical in _FSDP_FIELDS:
            variable = _variables(logical)
            settings.append(Setting(
                f"fsdp_plugin.{field}",
                canonical(getattr(fsdp_plugin, field, None)),
                f"FullyShardedDataParallelPlugin({field}=...)"
                + (f" or {variable}" if variable else ""),
            ))  # fmt: skip
    if parallelism_config is not None:
        for field in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size"):
            settings.append(Setting(
                f"parallelism_config.{field}",
                canonical(getattr(parallelism_config, field)),
                f"ParallelismConfig({field}=...) or {_variables(field)}",
            ))  # fmt: skip
    return settings


def of_accelerator(
    gradient_accumulation_plugin: Any,
    dataloader_config: Any,
    ddp_kwargs: Any,
    rng_types: Sequence[str],
) -> list[Setting]:
    """Not collective. What Accelerator() adds: gradient accumulation (when gradients are
    all-reduced), how prepared loaders deal out batches (how many collectives an epoch has),
    DDP's arguments (its buckets) and the RNGs synchronised at each epoch."""
    settings = [
        Setting(
            "gradient_accumulation_steps",
            canonical(gradient_accumulation_plugin.num_steps or 1),
            "Accelerator(gradient_accumulation_steps=...) or GradientAccumulationPlugin",
        ),
        *(
            Setting(
                f"gradient_accumulation_plugin.{field}",
                canonical(getattr(gradient_accumulation_plugin, field)),
                f"GradientAccumulationPlugin({field}=...)",
            )
            for field in _ACCUMULATION_FIELDS
        ),
        *(
            Setting(
                f"dataloader_config.{field}",
                canonical(getattr(dataloader_config, field)),
                f"DataLoaderConfiguration({field}=...) or Accelerator({field}=...)",
            )
            for field in _LOADER_FIELDS
        ),
        Setting("rng_types", canonical(list(rng_types)), "Accelerator(rng_types=...)"),
    ]
    if ddp_kwargs is not None:
        settings += [
            Setting(
                f"DistributedDataParallelKwargs.{f.name}",
                canonical(getattr(ddp_kwargs, f.name)),
                "Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(...)])",
            )
            for f in dataclasses.fields(ddp_kwargs)
        ]
    return settings


def _digest(settings: Sequence[Setting]) -> int:
    """62 bits of a hash of the settings (a non-negative int64)."""
    text = "\n".join(f"{s.name}={s.value}" for s in settings).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big") >> 2


def compare(comm: Comm, settings: Sequence[Setting], what: str) -> None:
    """Collective: every rank calls this with the settings it resolved. Returns when they are
    the same on every rank; else raises the same SettingsMismatchError on every rank, naming
    each setting that differs, its values and the ranks holding each.

    Two MPI all-reduces of an int (the maximum and the minimum of each rank's 62-bit digest of
    its settings: equal only when every rank has the same digest), a few microseconds each;
    every rank sees the same two results, so every rank sees a difference or none does.
    Settings that differ are missed only when their digests collide (odds of 1 in 2**62).
    Only when they differ does an all-gather of the settings follow, to name them."""
    mine = _digest(settings)
    if comm.allreduce(mine, "max", what) == comm.allreduce(mine, "min", what):
        return
    error = mismatch(comm.allgather(list(settings), what), what)
    if error is not None:  # always: equal settings have equal digests
        raise error


def mismatch(everyone: Sequence[Sequence[Setting]], what: str) -> SettingsMismatchError | None:
    """Not collective (every rank calls it on the same gathered settings, so every rank gets
    the same answer). The error naming each setting whose values differ between ranks, value
    by value with its ranks, for `everyone` (each rank's settings, in rank order); None when
    they are the same."""
    values = [{s.name: s for s in mine} for mine in everyone]
    names = list(dict.fromkeys(s.name for mine in everyone for s in mine))
    shared = [n for n in names if all(n in v for v in values)]
    # A setting some ranks lack (the FSDP fields where some ranks train with DDP) says more
    # than the difference that made it absent only when nothing else differs.
    differing = [n for n in shared if len({v[n].value for v in values}) > 1] or [
        n for n in names if n not in shared
    ]
    if not differing:
        return None
    lines = [f"{what}: the ranks were given different settings:"]
    for name in differing:
        held: dict[str, list[int]] = {}
        for rank, mine in enumerate(values):
            held.setdefault(mine[name].value if name in mine else "(not set)", []).append(rank)
        source = next(v[name].source for v in values if name in v)
        parts = [f"{_cut(value)} on {_ranks(ranks)}" for value, ranks in held.items()]
        lines.append(f"  {name} ({source}): {'; '.join(parts)}")
    return SettingsMismatchError("\n".join(lines), HINT, what)


def _cut(text: str) -> str:
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8
                                               else "")
    return f"rank {shown}" if len(ranks) == 1 else f"ranks {shown}"


def of_units(model: Any, units: Sequence[Any]) -> Setting:
    """Not collective. The FSDP units prepare() cuts `model` into (`units`, the submodules the
    wrap policy chose, by qualified name), which a callable auto_wrap_policy or the model's
    _no_split_modules decide only then."""
    chosen = {id(m) for m in units}
    names = [name or "(root)" for name, m in model.named_modules() if id(m) in chosen]
    return Setting("the model's FSDP units", canonical(names),
                   "FullyShardedDataParallelPlugin(auto_wrap_policy=...) applied to the model")
