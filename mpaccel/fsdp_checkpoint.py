"""Accelerate's FSDP checkpoint helpers (save_fsdp_model, load_fsdp_model, save_fsdp_optimizer,
load_fsdp_optimizer, merge_fsdp_weights) over mpaccel's sharded HDF5 checkpoints: each rank
writes and reads only its own rows (docs/checkpoint-format.md, "Sharded checkpoints").

Accelerate writes DCP directories (`pytorch_model_fsdp_<i>/`, `optimizer_<i>/`) under
`output_dir`; these write sharded mpaccel checkpoints under the same names. All but
merge_fsdp_weights are collective."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from .checkpoint import CheckpointError
from .checkpoint.files import remove_tree
from .checkpoint.sharded.load import load_sharded, read_full
from .checkpoint.sharded.save import save_sharded
from .state import PartialState
from .strategy.fully_sharded import OptimizerState


def _model_dir(output_dir: str, index: int) -> str:
    return os.path.join(os.fspath(output_dir), f"pytorch_model_fsdp_{index}")


def _optimizer_dir(output_dir: str, index: int) -> str:
    return os.path.join(os.fspath(output_dir), f"optimizer_{index}")


def _is_peft(module: torch.nn.Module) -> bool:
    # utils.modeling.is_peft_model asks the same, one layer up, importing peft (~4 s); a model
    # can only be a PeftModel where peft was imported already.
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(module, peft.PeftModel)


def _model_state(module: torch.nn.Module, adapter_only: bool) -> tuple[dict[str, Any], bool]:
    """(the state to save or load, whether it is the adapter's alone). adapter_only has
    Accelerate's meaning: the trainable parameters of a PEFT model; ignored for other models
    (transformers' Trainer passes it for every model)."""
    state = module.state_dict()
    if not (adapter_only and _is_peft(module)):
        return state, False
    trainable = {name for name, p in module.named_parameters() if p.requires_grad}
    return {k: v for k, v in state.items() if k in trainable}, True


def save_fsdp_model(fsdp_plugin: Any, accelerator: Any, model: torch.nn.Module,
                    output_dir: str, model_index: int = 0, adapter_only: bool = False,
                    use_dcp: bool = True) -> None:
    """Collective: every rank must call it. Saves the model's state as each rank's rows, in
    output_dir/pytorch_model_fsdp_<model_index> (the layout is always sharded).

    Args:
        fsdp_plugin: Accelerate's; accepted and unused.
        accelerator: the Accelerator that prepared `model` (it unwraps it).
        model: the prepared model.
        output_dir: the directory the checkpoint's directory is made in.
        model_index: which model of the script this is (the directory's suffix).
        adapter_only: for a PEFT model, its trainable (adapter) parameters alone; other
            models are saved whole.
        use_dcp: Accelerate's; accepted and unused.
    """
    del fsdp_plugin, use_dcp
    module = accelerator.unwrap_model(model)
    state, _ = _model_state(module, adapter_only)
    save_sharded(PartialState().comm, _model_dir(output_dir, model_index), {"model": state})


def load_fsdp_model(fsdp_plugin: Any, accelerator: Any, model: torch.nn.Module, input_dir: str,
                    model_index: int = 0, adapter_only: bool = False,
                    use_dcp: bool = True) -> None:
    """Collective: every rank must call it. Loads what save_fsdp_model wrote, at any world size
    (each rank reads its rows).

    Args:
        fsdp_plugin: Accelerate's; accepted and unused.
        accelerator: the Accelerator that prepared `model` (it unwraps it).
        model: the prepared model, loaded in place.
        input_dir: the directory save_fsdp_model was given, or the
            pytorch_model_fsdp_<model_index> directory itself.
        model_index: which model of the script this is (the directory's suffix).
        adapter_only: for a PEFT model, load its trainable (adapter) parameters alone.
        use_dcp: Accelerate's; accepted and unused.
    """
    del fsdp_plugin, use_dcp
    module = accelerator.unwrap_model(model)
    directory = _model_dir(input_dir, model_index)
    directory = directory if os.path.isdir(directory) else os.fspath(input_dir)
    state, adapters = _model_state(module, adapter_only)
    loaded = load_sharded(PartialState().comm, directory, {"model": state})
    module.load_state_dict(loaded["model"], strict=not adapters)


def save_fsdp_optimizer(fsdp_plugin: Any, accelerator: Any, optimizer: Any,
                        model: torch.nn.Module, output_dir: str, optimizer_index: int = 0,
                        use_dcp: bool = True) -> None:
    """Collective: every rank must call it. Saves the optimizer's state as each rank's rows, in
    output_dir/optimizer_<optimizer_index>.

    Args:
        fsdp_plugin: Accelerate's; accepted and unused.
        accelerator: Accelerate's; accepted and unused.
        optimizer: the prepared optimizer.
        model: Accelerate's; accepted and unused.
        output_dir: the directory the checkpoint's directory is made in.
        optimizer_index: which optimizer of the script this is (the directory's suffix).
        use_dcp: Accelerate's; accepted and unused.
    """
    del fsdp_plugin, accelerator, model, use_dcp
    save_sharded(PartialState().comm, _optimizer_dir(output_dir, optimizer_index),
                 {"optimizer": optimizer.state_dict()})


def load_fsdp_optimizer(fsdp_plugin: Any, accelerator: Any, optimizer: Any,
                        model: torch.nn.Module, input_dir: str, optimizer_index: int = 0,
                        adapter_only: bool = False, use_dcp: bool = True) -> None:
    """Collective: every rank must call it. Loads what save_fsdp_optimizer wrote; an optimizer
    that has not stepped gets its state created first (its shards then receive their rows),
    and dropped again if the load fails.

    Args:
        fsdp_plugin: Accelerate's; accepted and unused.
        accelerator: Accelerate's; accepted and unused.
        optimizer: the prepared optimizer, loaded in place.
        model: Accelerate's; accepted and unused.
        input_dir: the directory save_fsdp_optimizer was given, or the
            optimizer_<optimizer_index> directory itself.
        optimizer_index: which optimizer of the script this is (the directory's suffix).
        adapter_only: changes nothing: the optimizer holds the trainable parameters alone
            either way.
        use_dcp: Accelerate's; accepted and unused.
    """
    del fsdp_plugin, accelerator, model, adapter_only, use_dcp
    directory = _optimizer_dir(input_dir, optimizer_index)
    directory = directory if os.path.isdir(directory) else os.fspath(input_dir)
    stateful = OptimizerState(optimizer, create=True)
    try:
        loaded = load_sharded(PartialState().comm, directory,
                              {"optimizer": stateful.state_dict()})
        stateful.load_state_dict(loaded["optimizer"])
    except BaseException:
        stateful.undo()
        raise


def merge_fsdp_weights(checkpoint_dir: str, output_path: str, safe_serialization: bool = True,
                       remove_checkpoint_dir: bool = False) -> str:
    """Not collective (run it in one process). Joins the rows of a save_fsdp_model checkpoint
    into whole tensors, written to output_path/model.safetensors.

    Args:
        checkpoint_dir: the checkpoint: a pytorch_model_fsdp_<i> directory, or the directory
            holding pytorch_model_fsdp_0.
        output_path: the directory model.safetensors is written in (made if missing).
        safe_serialization: must be True: False, which would write a pickle, is refused.
        remove_checkpoint_dir: delete the checkpoint's directory afterwards.

    Returns:
        The path of the written file.

    Raises:
        CheckpointError: for safe_serialization=False.
    """
    if not safe_serialization:
        raise CheckpointError(
            "merge_fsdp_weights(safe_serialization=False) would write a pickle, which mpaccel "
            "never writes",
            "leave safe_serialization=True (model.safetensors).",
        )
    directory = os.fspath(checkpoint_dir)
    nested = _model_dir(directory, 0)
    if not os.path.exists(os.path.join(directory, "sharded.index.json")) and os.path.isdir(nested):
        directory = nested
    from safetensors.torch import save_file

    state = read_full(directory, "sharded", "model")
    os.makedirs(output_path, exist_ok=True)
    path = os.path.join(output_path, "model.safetensors")
    save_file({k: v.contiguous() for k, v in state.items()}, path, metadata={"format": "pt"})
    if remove_checkpoint_dir:  # never through a link: a link goes, its target stays
        remove_tree(*os.path.split(os.path.abspath(directory)))
    return path
