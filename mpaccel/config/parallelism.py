"""The N-D parallel layout, with Accelerate's names: ParallelismConfig (how many ranks each of
data-parallel replication, data-parallel sharding, context and tensor parallelism spans) and
its handlers (TorchTensorParallelConfig, which also carries mpaccel's tensor-parallel plan, and
TorchContextParallelConfig). Unset sizes take Accelerate's PARALLELISM_CONFIG_* variables, read
through mpaccel.envvars; "auto" sizes are chosen from the job's nodes (strategy/layout.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .. import envvars
from ..errors import ConfigurationError
from .kwargs import KwargsHandler

AUTO = "auto"
#: the styles a tensor-parallel plan names (torch's ParallelStyles; transformers' plans also
#: say "colwise_gather_output", "rowwise_split_input", "embedding_rowwise", ..., which
#: strategy/tensor_parallel.py maps to these where torch expresses them)
PLAN_STYLES = ("colwise", "rowwise", "sequence_parallel")
#: the mesh dimensions in Accelerate's order (it also knows "sp", DeepSpeed's, refused here)
DIM_ORDER = ("dp_replicate", "dp_shard", "cp", "tp")


@dataclass
class TorchTensorParallelConfig(KwargsHandler):
    """Accelerate's tensor-parallel handler (`ParallelismConfig(tp_handler=...)`), plus the
    plan mpaccel applies to a plain torch model in prepare(): `tp_plan` maps module-name
    patterns (`layers.*.attn.q`, `*` one name segment, as transformers' `base_model_tp_plan`
    writes them) to "colwise", "rowwise" or "sequence_parallel" (and the names transformers
    gives the variants torch expresses: strategy/tensor_parallel.py's STYLE_ALIASES).
    None: the model's own plan (`model._tp_plan`, else `model.config.base_model_tp_plan`), if
    it has one. A model whose parameters are DTensors already (transformers'
    `from_pretrained(tp_plan="auto", device_mesh=...)`) is used as it is.

    Args:
        enable_async_tp: Accelerate's; async TP is not supported there either (ignored).
        tp_plan: module-name pattern -> style; see above.
    """

    enable_async_tp: bool = False
    tp_plan: dict[str, str] | None = None

    def __post_init__(self) -> None:
        if self.tp_plan is None:
            return
        if not isinstance(self.tp_plan, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.tp_plan.items()
        ):
            raise ConfigurationError(
                f"TorchTensorParallelConfig(tp_plan={self.tp_plan!r}) must map module-name "
                "patterns to style names",
                "for example tp_plan={'layers.*.up': 'colwise', 'layers.*.down': 'rowwise'}.",
            )
        self.tp_plan = dict(self.tp_plan)


@dataclass
class TorchContextParallelConfig(KwargsHandler):
    """Accelerate's context-parallel handler: how the cp ranks exchange keys and values
    ("allgather" or "alltoall"; PARALLELISM_CONFIG_CP_COMM_STRATEGY, else "allgather").

    Args:
        cp_comm_strategy: "allgather" or "alltoall".
    """

    cp_comm_strategy: str | None = None

    def __post_init__(self) -> None:
        if self.cp_comm_strategy is None:
            self.cp_comm_strategy = envvars.get_choice("cp_comm_strategy") or "allgather"
        if self.cp_comm_strategy not in ("allgather", "alltoall"):
            raise ConfigurationError(
                f"TorchContextParallelConfig(cp_comm_strategy={self.cp_comm_strategy!r}) is "
                "not a context-parallel strategy",
                "use 'allgather' or 'alltoall'.",
            )


def _size(name: str, value: Any, autos: bool) -> int | str:
    if isinstance(value, str) and value.strip().lower() == AUTO and autos:
        return AUTO
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        allowed = " or 'auto'" if autos else ""
        raise ConfigurationError(
            f"ParallelismConfig({name}={value!r}) must be an int >= 1{allowed}",
            f"give {name} a number of processes{allowed} (docs/training.md, 'N-D parallelism').",
        )
    return value


@dataclass
class ParallelismConfig(KwargsHandler):
    """How the ranks are laid out, with Accelerate's fields and checks (`Accelerator(
    parallelism_config=...)`): `dp_replicate_size` replicas, each sharding the model over
    `dp_shard_size` ranks (FSDP2; HSDP when both are > 1), `cp_size` ranks splitting each
    sequence (context parallelism, CUDA only) and `tp_size` ranks splitting each layer (tensor
    parallelism). The product is the number of processes. The ranks of one tp (and cp) group
    are consecutive and on one node (strategy/layout.py checks it against the nodes).

    mpaccel's addition: a size may be "auto" (or its PARALLELISM_CONFIG_* variable "auto"),
    chosen from the nodes when the Accelerator is built: tp the ranks per node (divided by
    cp_size), dp_replicate the number of nodes when the ranks left per node allow dp_shard >
    1, dp_shard what remains.

    Args:
        dp_replicate_size: data-parallel replicas (HSDP's replicate dimension); default 1.
        dp_shard_size: ranks each replica is sharded over (FSDP2); default 1.
        tp_size: tensor-parallel ranks; default 1.
        cp_size: context-parallel ranks (needs CUDA); default 1.
        cp_backend: "torch".
        sp_size: DeepSpeed's sequence parallelism: must be 1 (mpaccel does not drive
            DeepSpeed).
        sp_backend: "deepspeed".
        tp_handler: a TorchTensorParallelConfig (mpaccel's carries the tp_plan).
        cp_handler: a TorchContextParallelConfig.
        sp_handler: must be None.
    """

    dp_replicate_size: Any = None
    dp_shard_size: Any = None
    tp_size: Any = None
    cp_size: Any = None
    cp_backend: str | None = None
    sp_size: Any = None
    sp_backend: str | None = None
    tp_handler: Any = None
    cp_handler: Any = None
    sp_handler: Any = None
    #: the DeviceMesh built from this layout (Accelerate's attribute; set by the Accelerator)
    device_mesh: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("dp_replicate_size", "dp_shard_size", "tp_size"):
            value = getattr(self, name)
            if value is None:
                value = envvars.get_size(name)
            setattr(self, name, _size(name, 1 if value is None else value, autos=True))
        for name in ("cp_size", "sp_size"):
            value = getattr(self, name)
            if value is None:
                value = envvars.get_int(name)
            setattr(self, name, _size(name, 1 if value is None else value, autos=False))
        if self.cp_backend is None:
            self.cp_backend = envvars.get_choice("cp_backend") or "torch"
        if self.sp_backend is None:
            self.sp_backend = envvars.get_choice("sp_backend") or "deepspeed"
        if self.cp_backend != "torch":
            raise ConfigurationError(
                f"ParallelismConfig(cp_backend={self.cp_backend!r}): cp_backend must be one "
                "of ['torch']",
                "leave cp_backend unset ('torch').",
            )
        if self.sp_backend != "deepspeed":
            raise ConfigurationError(
                f"ParallelismConfig(sp_backend={self.sp_backend!r}): sp_backend must be one "
                "of ['deepspeed']",
                "leave sp_backend unset.",
            )
        if self.sp_size != 1 or self.sp_handler is not None:
            raise ConfigurationError(
                f"ParallelismConfig(sp_size={self.sp_size!r}): sequence parallelism is "
                "DeepSpeed's (ALST/Ulysses), which mpaccel does not drive",
                "leave sp_size at 1; split long sequences with cp_size (context parallelism, "
                "on GPUs) or shard the model with tp_size / dp_shard_size.",
            )
        if self.tp_handler is None and self.tp_size != 1:
            self.tp_handler = TorchTensorParallelConfig()
        if self.tp_handler is not None and not isinstance(
            self.tp_handler, TorchTensorParallelConfig
        ):
            raise ConfigurationError(
                f"ParallelismConfig(tp_handler={self.tp_handler!r}) must be a "
                "TorchTensorParallelConfig",
                "build it with mpaccel.utils.TorchTensorParallelConfig(tp_plan=...).",
            )
        if self.cp_size > 1:
            if self.cp_handler is None:
                self.cp_handler = TorchContextParallelConfig()
            elif not isinstance(self.cp_handler, TorchContextParallelConfig):
                raise ConfigurationError(
                    f"ParallelismConfig's cp_backend='torch' requires TorchContextParallelConfig, "
                    f"but cp_handler was set to {type(self.cp_handler)}",
                    "pass cp_handler=TorchContextParallelConfig(...), or leave it None.",
                )
        if not self.has_auto:
            self.check_composition()

    def check_composition(self) -> None:
        """Not collective. Accelerate's refusal of tensor or context parallelism beside pure
        replication (dp_replicate_size > 1 with dp_shard_size 1): compose them with FSDP2."""
        if (
            (self.tp_size > 1 or self.cp_size > 1)
            and self.dp_replicate_size > 1
            and self.dp_shard_size == 1
        ):
            raise ConfigurationError(
                f"ParallelismConfig(dp_replicate_size={self.dp_replicate_size}, dp_shard_size=1, "
                f"tp_size={self.tp_size}, cp_size={self.cp_size}): tensor/context parallelism "
                "(tp/cp_size > 1) cannot be used with pure data parallelism (dp_replicate_size "
                "> 1 and dp_shard_size == 1)",
                "set dp_shard_size > 1 and dp_replicate_size == 1 to compose FSDP + TP/CP for "
                "2D parallel, or dp_replicate_size > 1 and dp_shard_size > 1 for HSDP + TP/CP "
                "(3D).",
            )

    # -- sizes chosen from the nodes ------------------------------------------------------------

    @property
    def has_auto(self) -> bool:
        """Whether a size is still "auto" (the Accelerator resolves it from the nodes)."""
        return AUTO in (self.dp_replicate_size, self.dp_shard_size, self.tp_size)

    def sizes(self) -> dict[str, Any]:
        """Not collective. The size of each dimension of DIM_ORDER, "auto" where unresolved."""
        return {
            "dp_replicate": self.dp_replicate_size,
            "dp_shard": self.dp_shard_size,
            "cp": self.cp_size,
            "tp": self.tp_size,
        }

    def set_sizes(self, sizes: dict[str, int]) -> None:
        """Not collective. Fix the sizes (resolved "auto" ones, from strategy/layout.py)."""
        for name, value in sizes.items():
            setattr(self, f"{name}_size", int(value))
        if self.tp_size > 1 and self.tp_handler is None:
            self.tp_handler = TorchTensorParallelConfig()
        self.check_composition()

    def _int(self, name: str) -> int:
        value = getattr(self, f"{name}_size")
        if value == AUTO:
            raise ConfigurationError(
                f"ParallelismConfig({name}_size='auto') is chosen when the Accelerator is built",
                "read the sizes from accelerator.parallelism_config after Accelerator(...).",
            )
        return int(value)

    # -- Accelerate's properties ----------------------------------------------------------------

    @property
    def total_size(self) -> int:
        """The product of every size: the number of processes the layout spans."""
        return self.data_parallel_size * self.non_data_parallel_size

    @property
    def data_parallel_size(self) -> int:
        """dp_replicate_size * dp_shard_size: how many different batches one step reads."""
        return self._int("dp_replicate") * self._int("dp_shard")

    @property
    def non_data_parallel_size(self) -> int:
        """tp_size * cp_size * sp_size: the ranks that read the same batches."""
        return self._int("tp") * self._int("cp") * self._int("sp")

    @property
    def dp_replicate_enabled(self) -> bool:
        return self._int("dp_replicate") > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self._int("dp_shard") > 1

    @property
    def tp_enabled(self) -> bool:
        return self._int("tp") > 1

    @property
    def cp_enabled(self) -> bool:
        return self._int("cp") > 1

    @property
    def sp_enabled(self) -> bool:
        return False

    @property
    def dp_dim_names(self) -> list[str]:
        """The enabled dimensions data parallelism spans (flattened into mesh 'dp')."""
        return [n for n in ("dp_replicate", "dp_shard") if getattr(self, f"{n}_enabled")]

    @property
    def non_dp_dim_names(self) -> list[str]:
        """The enabled dimensions whose ranks read the same batches."""
        return [n for n in ("tp", "cp") if getattr(self, f"{n}_enabled")]

    @property
    def dp_shard_cp_dim_names(self) -> list[str]:
        """The enabled dimensions FSDP shards over (flattened into mesh 'dp_shard_cp')."""
        return [n for n in ("dp_shard", "cp") if getattr(self, f"{n}_enabled")]

    @property
    def dp_cp_dim_names(self) -> list[str]:
        """The enabled dimensions a loss is averaged over (flattened into mesh 'dp_cp')."""
        return [n for n in ("dp_replicate", "dp_shard", "cp") if getattr(self, f"{n}_enabled")]

    @property
    def fsdp_dim_names(self) -> list[str]:
        """The mesh dimensions FSDP2 is applied over: 'dp_replicate' (if enabled), then
        'dp_shard_cp'."""
        return ["dp_replicate"] * self.dp_replicate_enabled + ["dp_shard_cp"]

    @property
    def active_mesh_dims(self) -> list[str]:
        """Every enabled dimension."""
        return self.dp_dim_names + self.non_dp_dim_names

    def get_device_mesh(self, device_type: str | None = None) -> Any:
        """Not collective. The DeviceMesh the Accelerator built for this layout (Accelerate's
        method; mpaccel builds the mesh from the nodes in Accelerator(), strategy/mesh.py)."""
        if self.device_mesh is None:
            raise ConfigurationError(
                "ParallelismConfig.get_device_mesh(): no mesh was built for this layout yet",
                "pass the config to Accelerator(parallelism_config=...) and use "
                "accelerator.torch_device_mesh.",
            )
        if device_type is not None and self.device_mesh.device_type != device_type:
            raise ConfigurationError(
                f"the device_mesh was built for {self.device_mesh.device_type!r}, not "
                f"{device_type!r}"
            )
        return self.device_mesh

    def to_json(self) -> dict[str, Any]:
        """Not collective. The fields, handlers as dicts (the mesh left out)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name == "device_mesh":
                continue
            value = getattr(self, f.name)
            is_handler = dataclasses.is_dataclass(value) and not isinstance(value, type)
            out[f.name] = dataclasses.asdict(value) if is_handler else value
        return out
