"""Checkpoints as Hugging Face tooling and Accelerate scripts expect them (issue 21): the
safetensors layout of save_model, saves by the main process alone, a directory per rank, and
load_state on a directory Accelerate wrote. The bodies run at size 1 and under mpiexec -n 2."""

from __future__ import annotations

import json
import os
import tempfile
import warnings

import pytest
import torch

from mpaccel import Accelerator
from mpaccel.testing import reset_state

safetensors_torch = pytest.importorskip("safetensors.torch")


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.Linear(64, 4)
    )


def _read_safetensors(directory):
    found = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            found.update(safetensors_torch.load_file(os.path.join(directory, name)))
    return found


@pytest.mark.parametrize("limit", ["10GB", "10KB"])
def test_save_model_writes_the_hugging_face_layout(mpi_tmp_path, comm, limit):
    reset_state()
    acc = Accelerator()
    model = acc.prepare(_model())
    target = mpi_tmp_path / "model"
    acc.save_model(model, target, max_shard_size=limit)
    acc.wait_for_everyone()
    state = acc.unwrap_model(model).state_dict()
    huggingface_hub = pytest.importorskip("huggingface_hub")
    split = huggingface_hub.split_torch_state_dict_into_shards(
        state, filename_pattern="model{suffix}.safetensors", max_shard_size=limit
    )
    files = sorted(n for n in os.listdir(target) if not n.startswith("."))
    if split.is_sharded:
        assert files == sorted([*split.filename_to_tensors, "model.safetensors.index.json"])
        index = json.loads((target / "model.safetensors.index.json").read_text())
        assert index["weight_map"] == split.tensor_to_filename
        assert index["metadata"]["total_size"] == split.metadata["total_size"]
    else:
        assert files == ["model.safetensors"]
    loaded = _read_safetensors(target)
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    # and Accelerate's own loader takes it
    accelerate_utils = pytest.importorskip("accelerate.utils")
    fresh = _model(seed=1)
    accelerate_utils.load_checkpoint_in_model(fresh, str(target))
    assert all(torch.equal(v, state[k]) for k, v in fresh.state_dict().items())


def test_save_model_hdf5_stays_selectable(mpi_tmp_path):
    from mpaccel.checkpoint import load_model_state

    reset_state()
    acc = Accelerator()
    model = acc.prepare(_model())
    acc.save_model(model, mpi_tmp_path / "h5", safe_serialization=False)
    assert (mpi_tmp_path / "h5" / "model.index.json").exists()
    assert not list((mpi_tmp_path / "h5").glob("*.safetensors"))
    loaded = load_model_state(mpi_tmp_path / "h5")
    state = acc.unwrap_model(model).state_dict()
    assert all(torch.equal(loaded[k], state[k]) for k in state)


def test_a_directory_per_rank_uses_rank_0s(comm):
    reset_state()
    acc = Accelerator()
    model = acc.prepare(_model())
    with tempfile.TemporaryDirectory() as mine:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            acc.save_state(mine)
            saved = {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            acc.load_state(mine)
        named = [str(w.message) for w in caught if "different directories" in str(w.message)]
        if acc.num_processes > 1:
            # one for the save, one for the load; rank 0 names every rank that passed another
            # path, the others name themselves
            assert [m.split(":")[0] for m in named] == ["save_state", "load_state"], named
            assert all(f"rank {max(1, acc.process_index)} passed" in m for m in named), named
            written = os.path.exists(os.path.join(mine, "state.index.json"))
            assert written == acc.is_main_process
        else:
            assert named == []
        assert all(torch.equal(v, saved[k])
                   for k, v in acc.unwrap_model(model).state_dict().items())
        acc.wait_for_everyone()  # rank 0's directory outlives the others' loads
