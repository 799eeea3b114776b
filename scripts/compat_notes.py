"""Hand-kept notes of docs/compatibility.md's table (scripts/compat_table.py), keyed by
`group.name` as the table groups them ("accelerate.utils.gather", "Accelerator.save_state").

DIFFERS: a name mpaccel has whose behaviour differs from Accelerate's, in one sentence (the
    signature differences are found by the script; this says what it cannot see).
KEPT: a name mpaccel has only for Accelerate's scripts to import (mpaccel/absent_names.py says why
    and what to use instead).
MISSING: a name mpaccel should have and does not yet: where it would go. Each one is a gap to
    close (or to refuse in mpaccel/absent_names.py with a reason); compat_table.py --check fails on
    a missing name without a note, and on a note whose name is no longer missing.
"""

from __future__ import annotations

from mpaccel import absent_names

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
            "adapter_only=True saves a PEFT model's adapter alone (other models whole, as "
            "Accelerate); merge_fsdp_weights(safe_serialization=False) is refused "
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

# Names mpaccel has only to refuse them (they import; using one raises a HINT) or to give
# Accelerate's value: their reasons live in the package, the one source (mpaccel/absent_names.py).
# The table quotes a refusal from the name's marker (mpaccel.errors.REFUSED) and a value's note
# from here, by `group.name`.
KEPT: dict[str, str] = absent_names.notes()

# Gaps: names to add where the note says (Accelerate's scripts or common training scripts use
# them, and nothing about MPI stands in their way).
MISSING: dict[str, str] = {}
