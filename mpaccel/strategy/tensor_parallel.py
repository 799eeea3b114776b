"""Tensor (and context) parallelism on an N-D mesh, composed with a data-parallel strategy: a
model's layers split over mesh['tp'] (torch's parallelize_module, from a plan handed to
mpaccel or the model's own; or already, by transformers' tp_plan), its other parameters
replicated on mesh['tp'], then FSDP2 over the data-parallel dimensions (2-D FSDP+TP, 3-D
HSDP+TP) or nothing more (pure TP). The ranks of one tp/cp group read the same batches.

With strategy/fully_sharded.py the only module that imports torch's tensor-parallel APIs,
inside its functions."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .. import distributed
from ..comm import agreement
from ..config.parallelism import PLAN_STYLES
from ..errors import CollectiveError, ConfigurationError
from .base import Strategy
from .data_parallel import DataParallel
from .fully_sharded import (
    FullySharded,
    OptimizerState,
    SummedGradients,
    clip_grad_norm_,
    fsdp_module,
    full_state_dict,
    has_meta_tensors,
    optimizers_following,
    structure,
    tied_aliases,
)
from .mesh import build_nd_mesh

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: the module types torch's ColwiseParallel and RowwiseParallel split (others raise
#: NotImplementedError inside parallelize_module, after other modules were split)
LINEAR_OR_EMBEDDING: tuple[type[torch.nn.Module], ...] = (torch.nn.Linear, torch.nn.Embedding)


@dataclass(frozen=True)
class PlanStyle:
    """How mpaccel applies one style name of a tensor-parallel plan: torch's ParallelStyle
    `kind` (one of PLAN_STYLES), its input and output replicated where `replicated_input` /
    `replicated_output` say so (torch's defaults shard a rowwise input and a colwise output
    along the last dimension), on modules of the types `modules`."""

    kind: str
    replicated_input: bool = False
    replicated_output: bool = False
    modules: tuple[type[torch.nn.Module], ...] = LINEAR_OR_EMBEDDING

    def build(self) -> Any:
        """Not collective. torch's ParallelStyle for it."""
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            SequenceParallel,
        )

        if self.kind == "sequence_parallel":
            return SequenceParallel()
        layouts: dict[str, Any] = {}
        if self.replicated_input:
            layouts["input_layouts"] = Replicate()
        if self.replicated_output:
            layouts["output_layouts"] = Replicate()
        return (ColwiseParallel if self.kind == "colwise" else RowwiseParallel)(**layouts)


#: mpaccel's style names: torch's ParallelStyles as they are (SequenceParallel takes any module)
STYLES = {
    kind: PlanStyle(kind, modules=(torch.nn.Module,) if kind == "sequence_parallel"
                    else LINEAR_OR_EMBEDDING)
    for kind in PLAN_STYLES
}  # fmt: skip
#: transformers' style names (its models' `_tp_plan` and `config.base_model_tp_plan`; its
#: distributed/tensor_parallel.py registers them) that torch's styles express: a colwise layer
#: whose output is gathered, a rowwise layer whose input arrives whole, and an embedding split
#: by vocabulary (rowwise, the ranks' lookups summed) or by hidden features (colwise, gathered)
STYLE_ALIASES = {
    "colwise_rep": PlanStyle("colwise", replicated_output=True),
    "colwise_gather_output": PlanStyle("colwise", replicated_output=True),
    "rowwise_rep": PlanStyle("rowwise", replicated_input=True),
    "rowwise_split_input": PlanStyle("rowwise", replicated_input=True),
    "embedding_rowwise": PlanStyle("rowwise", replicated_input=True,
                                   modules=(torch.nn.Embedding,)),
    "embedding_colwise": PlanStyle("colwise", replicated_output=True,
                                   modules=(torch.nn.Embedding,)),
}  # fmt: skip
#: transformers' styles that torch's ParallelStyles do not express, and what each does
TRANSFORMERS_ONLY = {
    "unit_colwise": "splits attention heads, replicating them when there are fewer than ranks",
    "unit_rowwise": "splits an attention output projection by unit_colwise's whole heads",
    "packed_colwise": "splits fused weights (gate and up in one) part by part",
    "packed_rowwise": "the rowwise side of packed_colwise's fused weights",
    "replicated_with_grad_allreduce": "sums the gradients of a norm that sees only this "
    "rank's heads",
    "mla_kv_a_proj": "all-reduces the gradient of the rotary slice of an MLA projection",
    "all_reduce": "all-reduces a module's partial output (mixture-of-experts blocks)",
    "moe_tp_experts": "splits every expert of a mixture-of-experts layer",
    "local_params": "runs a module on the local parts of parameters other entries split",
    "replicate": "keeps a parameter whole on every rank (mpaccel does that for every "
    "parameter a plan leaves out)",
}

def is_tensor_parallel(model: torch.nn.Module) -> bool:
    """Not collective. Whether any parameter of `model` is a DTensor (split or replicated over a
    mesh: transformers' tp_plan, or a prepare() with tensor parallelism)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def check_context_parallel(device: torch.device, cp_size: int) -> None:
    """Not collective. cp_size > 1 needs CUDA: torch has no CPU implementation of context
    parallel attention (measured with torch 2.13: NotImplementedError for
    aten._scaled_dot_product_flash_attention_for_cpu in the first forward)."""
    if cp_size > 1 and device.type != "cuda":
        raise ConfigurationError(
            f"ParallelismConfig(cp_size={cp_size}) on {device.type!r}: torch has no CPU "
            "implementation of context parallel attention (its context_parallel fails with "
            "NotImplementedError for aten._scaled_dot_product_flash_attention_for_cpu)",
            "run context parallelism on GPUs, or leave cp_size at 1 and split the model with "
            "tp_size / dp_shard_size.",
        )


def model_plan(model: torch.nn.Module, given: Mapping[str, str] | None) -> dict[str, str]:
    """Not collective. The tensor-parallel plan for `model`: `given` (TorchTensorParallelConfig's
    tp_plan), else the model's `_tp_plan`, else its config's `base_model_tp_plan`
    (transformers' attributes); {} if none."""
    if given:
        return dict(given)
    own = getattr(model, "_tp_plan", None)
    if isinstance(own, Mapping) and own:
        return dict(own)
    config_plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    return dict(config_plan) if isinstance(config_plan, Mapping) else {}


def _pattern(key: str) -> re.Pattern[str]:
    # transformers' plans: '*' stands for one name segment (a layer's index)
    return re.compile(".".join("[^.]+" if part == "*" else re.escape(part)
                               for part in key.split(".")))  # fmt: skip


def expand_plan(model: torch.nn.Module, plan: Mapping[str, str]) -> dict[str, str]:
    """Not collective. `plan`'s patterns matched against the module names of `model` (also
    relative to its base model, `model.base_model_prefix`, as transformers' base_model_tp_plan
    names them): module name -> style. A style mpaccel does not know, or a pattern matching no
    module, is a ConfigurationError."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    names = [name for name, _ in model.named_modules() if name]
    out: dict[str, str] = {}
    for key, style in plan.items():
        style_of(key, style)
        pattern = _pattern(key)
        matched = [
            n for n in names
            if pattern.fullmatch(n) or (prefix and n.startswith(prefix + ".")
                                        and pattern.fullmatch(n[len(prefix) + 1:]))
        ]  # fmt: skip
        if not matched:
            shown = ", ".join(names[:12]) + (" ..." if len(names) > 12 else "")
            raise ConfigurationError(
                f"tensor-parallel plan key {key!r} matches no module of {type(model).__name__} "
                f"(its modules: {shown})",
                "name modules as model.named_modules() does, '*' for one segment "
                "('layers.*.mlp.up').",
            )
        for name in matched:
            out[name] = plan[key]
    return out


def style_of(key: str, name: str) -> PlanStyle:
    """Not collective. How mpaccel applies the style `name` of the plan entry `key`; a name
    it does not know is a ConfigurationError."""
    found = STYLES.get(name) or STYLE_ALIASES.get(name)
    if found is not None:
        return found
    known = f"mpaccel applies the styles {list(STYLES)} and transformers' {list(STYLE_ALIASES)}"
    if name in TRANSFORMERS_ONLY:
        raise ConfigurationError(
            f"tensor-parallel plan {{{key!r}: {name!r}}}: transformers' style {name!r} "
            f"({TRANSFORMERS_ONLY[name]}) has no torch ParallelStyle; {known}",
            "let transformers split the model: from_pretrained(..., tp_plan='auto', "
            "device_mesh=accelerator.torch_device_mesh['tp']) (prepare() takes its DTensor "
            "parameters as they are), or pass TorchTensorParallelConfig(tp_plan=...) with "
            "the styles above only.",
        )
    raise ConfigurationError(
        f"tensor-parallel plan {{{key!r}: {name!r}}}: {known}",
        "use 'colwise' for a layer whose output features are split, 'rowwise' for the "
        "one after it, 'sequence_parallel' for norms between them.",
    )


def check_plan_fits(model: torch.nn.Module, plan: Mapping[str, str]) -> None:
    """Not collective. Every module `plan` (expand_plan's: module name -> style) names is of a
    type its style splits, before anything is split: torch's colwise and rowwise styles take
    nn.Linear and nn.Embedding only, and would fail half-way through parallelize_module. A
    module that does not fit is a ConfigurationError naming each."""
    modules = dict(model.named_modules())
    misfits = []
    for name, style in plan.items():
        fits = style_of(name, style).modules
        if not isinstance(modules[name], fits):
            types = " or ".join(f"nn.{t.__name__}" for t in fits)
            misfits.append(f"{name!r} ({type(modules[name]).__name__}: {style!r} splits {types})")
    if misfits:
        raise ConfigurationError(
            f"the tensor-parallel plan names modules its styles cannot split: {', '.join(misfits)}",
            "give 'colwise' and 'rowwise' to Linear and Embedding layers only; leave the other "
            "modules out of the plan (mpaccel replicates their parameters on every tp rank).",
        )


def check_splittable(model: torch.nn.Module) -> None:
    """Not collective. A model with tensors on the meta device has no weights to split (nor
    to send from rank 0): a ConfigurationError."""
    if has_meta_tensors(model):
        raise ConfigurationError(
            f"the model given to prepare() ({type(model).__name__}) has tensors on the meta "
            "device: there are no weights to split over the tp ranks",
            "create the model with real weights on every rank (prepare() starts every rank "
            "from rank 0's).",
        )


def model_digest(model: torch.nn.Module, arrived: bool, plan: Mapping[str, str]) -> str:
    """Not collective. A digest of the model's state names, shapes and dtypes, whether it
    arrived split, and its expanded plan: the ranks compare it before splitting, as a rank
    that split other modules would leave the others waiting in parallelize_module."""
    facts = (structure(model), arrived, sorted(plan.items()))
    return hashlib.sha1(repr(facts).encode()).hexdigest()


def _to_replicate(value: Any, mesh: DeviceMesh) -> Any:
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
        return DTensor.from_local(value, mesh, [Replicate()], run_check=False)
    return value


def _to_local(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, (list, tuple)):
        return type(value)(_to_local(v) for v in value) if not hasattr(value, "_fields") else (
            type(value)(*(_to_local(v) for v in value)))
    if isinstance(value, dict):
        return {k: _to_local(v) for k, v in value.items()}
    return value


def replicate_rest(model: torch.nn.Module, mesh: DeviceMesh) -> int:
    """Not collective. Every parameter of `model` that is no DTensor becomes one replicated on
    `mesh` (the tp mesh), as Accelerate does before FSDP2: every tp rank holds it whole and
    computes the same gradient. Its module then takes tensors in and gives plain tensors out
    (forward hooks), so that the model around it keeps calling it with plain tensors. Returns
    how many parameters were replicated."""
    from torch.distributed.tensor import DTensor

    count = 0
    for module in model.modules():
        plain = [(n, p) for n, p in module.named_parameters(recurse=False)
                 if not isinstance(p, DTensor)]  # fmt: skip
        if not plain:
            continue
        for name, param in plain:
            replicated = torch.nn.Parameter(_to_replicate(param.data, mesh),
                                            requires_grad=param.requires_grad)  # fmt: skip
            module.register_parameter(name, replicated)
            count += 1

        def into(_module: Any, args: Any, kwargs: Any) -> Any:
            return (tuple(_to_replicate(a, mesh) for a in args),
                    {k: _to_replicate(v, mesh) for k, v in kwargs.items()})  # fmt: skip

        def out(_module: Any, _args: Any, output: Any) -> Any:
            return _to_local(output)

        module.register_forward_pre_hook(into, with_kwargs=True)
        module.register_forward_hook(out)
    return count


def broadcast_plain(model: torch.nn.Module) -> None:
    """Collective: every rank's parameters and buffers that are no DTensors become rank 0's,
    in place, before the plan splits them (each tp rank then takes its part of one model)."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if not isinstance(tensor, DTensor):
                distributed.broadcast(tensor.data, 0)


class HeldGradients:
    """The gradients of a pure tensor-parallel model, as each rank holds them (`p.grad`, a
    DTensor like its parameter: nothing synchronises them later), as a Stateful of the
    sharded part of a checkpoint. `keys`: the gradients a load expects (those the checkpoint
    holds); load_state_dict() sets `p.grad`, restorer() undoes it after a failed load."""

    def __init__(self, module: torch.nn.Module, keys: list[str] | None = None) -> None:
        self.module = module
        self.keys = keys

    def _params(self) -> dict[str, Any]:
        return {name: p for name, p in self.module.named_parameters() if p.requires_grad}

    def state_dict(self) -> dict[str, Any]:
        params = self._params()
        if self.keys is not None:  # targets of a load, split like the parameters
            return {key: torch.zeros_like(params[key]).detach() for key in self.keys}
        return {name: p.grad.detach() for name, p in params.items() if p.grad is not None}

    def restorer(self) -> Any:
        """A callable that gives the model back the `.grad`s it holds now."""
        grads = [(p, p.grad) for p in self._params().values()]

        def restore() -> None:
            for p, grad in grads:
                p.grad = grad

        return restore

    def load_state_dict(self, state: dict[str, Any]) -> None:
        params = self._params()
        for key, value in state.items():
            params[key].grad = value


class TensorParallel(Strategy):
    """Tensor (and context) parallelism over the N-D mesh of `parallelism_config`, composed
    with FullySharded over its data-parallel dimensions (given an FSDP `plugin`), or with
    nothing when every data-parallel size is 1 (pure TP). Creating it is collective (the
    mesh)."""

    def __init__(self, partial: Any, plugin: Any, parallelism_config: Any) -> None:
        check_context_parallel(partial.device, parallelism_config.cp_size)
        self.config = parallelism_config
        self.mesh = build_nd_mesh(partial, parallelism_config, fsdp=plugin is not None)
        super().__init__(partial)  # after the mesh: a world of one got its backend there
        names = tuple(self.mesh.mesh_dim_names) if self.mesh is not None else ()
        self.tp_mesh = self.mesh["tp"] if "tp" in names else None
        self.inner: Strategy = (
            FullySharded(partial, plugin, parallelism_config, mesh=self.mesh)
            if plugin is not None else DataParallel(partial)
        )  # fmt: skip
        self.distributed_type = self.inner.distributed_type
        handler = parallelism_config.tp_handler
        self.plan = getattr(handler, "tp_plan", None)

    @property
    def data_parallel_size(self) -> int:
        """The tp/cp groups: each reads its own batches."""
        return int(self.config.data_parallel_size)

    @property
    def data_parallel_rank(self) -> int:
        """This rank's index along the flattened 'dp' dimension (0 without one)."""
        if self.mesh is None or self.data_parallel_size == 1:
            return 0
        return int(self.mesh["dp"].get_local_rank())

    @property
    def reports_metrics(self) -> bool:
        """The first rank of each tp/cp group: the one whose samples gather_for_metrics keeps."""
        return all(
            self.mesh_rank(dim) == 0 for dim in ("tp", "cp")
            if self.mesh is not None and dim in (self.mesh.mesh_dim_names or ())
        )  # fmt: skip

    def is_prepared(self, model: torch.nn.Module) -> bool:
        """Not collective. The inner strategy's answer (a model FSDP2 sharded already)."""
        return self.inner.is_prepared(model)

    def joins_uneven_inputs(self, distributed_type: Any) -> bool:
        """Not collective. Never: torch's Join answers a DDP model's all-reduces, and nothing
        wraps a tensor-parallel model in DDP (not delegated: a pure-TP strategy holds
        DataParallel, which would say yes)."""
        del distributed_type
        return False

    def place(self, model: torch.nn.Module, placement: bool) -> torch.nn.Module:
        """Collective: every rank, its copy of one model. Split over mesh['tp'] (a model that
        arrives with DTensor parameters is taken as it is; another by its plan), the other
        parameters replicated on mesh['tp'], then the inner strategy's place (fully_shard over
        the data-parallel dimensions). A missing or bad plan (a pattern matching no module, a
        style mpaccel does not apply, or one that does not fit its module's type), a model on
        the meta device, or models or plans that differ between ranks are one error on every
        rank, raised before anything is split."""
        from torch.distributed.tensor.parallel import parallelize_module

        arrived = False
        plan: dict[str, str] = {}
        with agreement(self.comm, "preparing a tensor-parallel model", passing=(CollectiveError,)):
            check_splittable(model)
            arrived = is_tensor_parallel(model)
            if not arrived and self.tp_mesh is not None:
                given = model_plan(model, self.plan)
                if not given:
                    raise ConfigurationError(
                        f"tp_size={self.config.tp_size}, but {type(model).__name__} arrives "
                        "without DTensor parameters and there is no tensor-parallel plan",
                        "pass ParallelismConfig(tp_handler=TorchTensorParallelConfig(tp_plan="
                        "{'layers.*.up': 'colwise', 'layers.*.down': 'rowwise'})), give the "
                        "model a _tp_plan, or load it with transformers' from_pretrained(..., "
                        "tp_plan='auto', device_mesh=accelerator.torch_device_mesh['tp']).",
                    )
                plan = expand_plan(model, given)
                check_plan_fits(model, plan)  # here, before any module is split
            plugin = getattr(self.inner, "plugin", None)
            if plugin is not None and plugin.cpu_ram_efficient_loading:
                raise ConfigurationError(
                    "cpu_ram_efficient_loading with tensor parallelism: mpaccel sends rank 0's "
                    "whole weights to FSDP2's shards only",
                    "leave cpu_ram_efficient_loading off with tp_size > 1.",
                )
        digests = self.comm.allgather(model_digest(model, arrived, plan),
                                      what="comparing the models to split")  # fmt: skip
        odd = [rank for rank, digest in enumerate(digests) if digest != digests[0]]
        if odd:  # raised alike on every rank: each compares the same gathered digests
            raise ConfigurationError(
                f"the model given to prepare() differs between ranks: ranks {odd} hold a model "
                "with other parameter names, shapes or dtypes, or another tensor-parallel plan, "
                "than rank 0's",
                "build the same model on every rank and give every rank the same tp_plan.",
            )
        if placement:
            model = model.to(self.device)
        broadcast_plain(model)
        if self.tp_mesh is not None:
            if plan:
                styles = {n: style_of(n, s).build() for n, s in plan.items()}
                parallelize_module(model, self.tp_mesh, styles)
            replicate_rest(model, self.tp_mesh)
        return self.inner.place(model, placement)

    def wrap(self, model: torch.nn.Module, ddp_handler: Any = None) -> torch.nn.Module:
        """Not collective. Nothing wraps a tensor-parallel model (no DDP around DTensors);
        FSDP2 synchronises its data-parallel gradients."""
        del ddp_handler
        return model

    @contextmanager
    def optimizers_follow(
        self, models: list[torch.nn.Module], optimizers: list[Any], prepared: Iterable[Any]
    ) -> Iterator[None]:
        """Not collective. The optimizers hold placeholders while the models are split and
        sharded, then the new (DTensor) parameters, by name."""
        with optimizers_following(models, optimizers, prepared):
            yield

    def no_sync(self, model: torch.nn.Module) -> AbstractContextManager[None]:
        """Not collective. The inner strategy's (FSDP2 keeps gradients local); a null context
        for pure TP, which has no data-parallel gradients to synchronise."""
        return self.inner.no_sync(model)

    def clip_grad_norm_(
        self, parameters: Any, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Collective: the whole model's norm, each DTensor gradient's reduced over its mesh
        (tp and dp)."""
        return clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def full_state_dict(self, model: torch.nn.Module, everywhere: bool) -> dict[str, Any]:
        """Collective. Whole tensors gathered from the tp (and dp) parts."""
        return full_state_dict(model, everywhere=everywhere)

    def sharded_state_dict(self, model: torch.nn.Module) -> dict[str, Any]:
        """Not collective. The inner strategy's: the model's state as this rank holds it (its
        DTensors: parts along tp, and dp under FSDP2)."""
        return self.inner.sharded_state_dict(model)

    def is_sharded(self, model: torch.nn.Module) -> bool:
        """Not collective. Whether `model` holds DTensors (split over tp, or sharded by the
        inner FSDP2)."""
        return is_tensor_parallel(model) or self.inner.is_sharded(model)

    def tied_aliases(self, model: torch.nn.Module) -> set[str]:
        """Not collective. The later names of each tied parameter of a model holding DTensors
        (its state dict shows them apart, as FSDP2's does); else the inner strategy's."""
        return tied_aliases(model) if is_tensor_parallel(model) else self.inner.tied_aliases(model)

    def check_savable(self, model: torch.nn.Module) -> None:
        """Not collective. The inner strategy's answer: a tensor-parallel model is saved as
        N-D blocks (save_state) or whole tensors written part by part (save_model)."""
        self.inner.check_savable(model)

    def checkpoint_entries(
        self, models: Mapping[str, torch.nn.Module], optimizers: Mapping[str, Any], loading: bool
    ) -> dict[str, Any]:
        """Not collective. The models holding DTensors (split over tp, sharded by the inner
        FSDP2, or both: each rank saves its N-D block of every tensor) and, if there is one,
        every optimizer (prepare() built them all over those DTensors) as an OptimizerState."""
        entries: dict[str, Any] = {n: m for n, m in models.items() if self.is_sharded(m)}
        if entries:
            entries.update({n: OptimizerState(o, create=loading) for n, o in optimizers.items()})
        return entries

    def summed_gradients(self, model: torch.nn.Module, keys: list[str] | None) -> Any:
        """Not collective to build; its state_dict() is collective over the model's mesh
        under FSDP2. With FSDP2 (TP x FSDP2), the inner strategy's SummedGradients, which
        averages FSDP's pending gradients over the data-parallel dims only; for pure TP, the
        gradients as each rank holds them (HeldGradients: nothing is pending)."""
        if fsdp_module(model) is not None:
            return SummedGradients(model, keys)
        return HeldGradients(model, keys)

    def context_parallel(
        self, buffers: list[Any], buffer_seq_dims: list[int], no_restore_buffers: set[Any]
    ) -> AbstractContextManager[Any]:
        """Not collective to enter; the attention inside is, over mesh['cp']. torch's
        context_parallel over mesh['cp'] (CUDA only: the strategy refuses cp_size > 1
        elsewhere), with the cp_handler's rotate method; a null context without cp."""
        names = tuple(self.mesh.mesh_dim_names or ()) if self.mesh is not None else ()
        if "cp" not in names:
            return nullcontext()
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import set_rotate_method

        set_rotate_method(self.config.cp_handler.cp_comm_strategy)
        return context_parallel(
            self.mesh["cp"], buffers=buffers, buffer_seq_dims=buffer_seq_dims,
            no_restore_buffers=no_restore_buffers,
        )  # fmt: skip
