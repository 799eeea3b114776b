"""Checkpoints as Hugging Face tooling and Accelerate scripts expect them (issue 21): the
safetensors layout of save_model, saves by the main process alone, a directory per rank, and
load_state on a directory Accelerate wrote. The bodies run at size 1 and under mpiexec -n 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings

import pytest
import torch

from mpaccel import Accelerator, CollectiveError
from mpaccel.testing import reset_state, run_mpi
from mpaccel.utils import ProjectConfiguration

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


def test_main_process_alone_saves_the_same_result(mpi_tmp_path, comm):
    reset_state()
    acc = Accelerator()
    model = acc.prepare(_model())
    optimizer = acc.prepare(torch.optim.AdamW(model.parameters()))
    model(torch.ones(2, 32)).sum().backward()
    optimizer.step()
    acc.save_model(model, mpi_tmp_path / "together", max_shard_size="10KB")
    if acc.is_main_process:
        acc.save_model(model, mpi_tmp_path / "alone", max_shard_size="10KB")
        acc.save_state(mpi_tmp_path / "state-alone")
        acc.save(acc.unwrap_model(model).state_dict(), mpi_tmp_path / "weights.pt")
    acc.wait_for_everyone()  # the others went on to this collective: nobody hangs
    together = _read_safetensors(mpi_tmp_path / "together")
    alone = _read_safetensors(mpi_tmp_path / "alone")
    assert sorted(os.listdir(mpi_tmp_path / "together")) == sorted(
        os.listdir(mpi_tmp_path / "alone"))
    assert together.keys() == alone.keys()
    assert all(torch.equal(together[k], alone[k]) for k in together)
    # the state saved by one rank loads on every rank
    saved = {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # written by 1 process: RNG states stay (documented)
        acc.load_state(mpi_tmp_path / "state-alone")
    assert all(torch.equal(v, saved[k]) for k, v in acc.unwrap_model(model).state_dict().items())
    acc.wait_for_everyone()


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


_ACCELERATE_SAVE = textwrap.dedent("""
    import sys, torch
    from accelerate import Accelerator
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    model, opt, sched = acc.prepare(model, opt, sched)
    model(torch.ones(2, 32)).sum().backward()
    opt.step(); sched.step()
    acc.save_state(sys.argv[1])
    torch.save(model.state_dict(), sys.argv[1] + ".expected")
    torch.save(opt.state_dict(), sys.argv[1] + ".opt")
""")


def _accelerate_checkpoint(path, comm):
    """A checkpoint written by the real Accelerate, in a process of its own (rank 0)."""
    pytest.importorskip("accelerate")
    if comm.Get_rank() == 0:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PMI_", "MPI_", "OMPI_", "PMIX_", "HYDRA", "MPIR_"))}
        subprocess.run([sys.executable, "-c", _ACCELERATE_SAVE, str(path)], check=True,
                       env=env, timeout=240)
    comm.Barrier()


def test_load_state_of_an_accelerate_checkpoint(mpi_tmp_path, comm):
    path = mpi_tmp_path / "accelerate"
    _accelerate_checkpoint(path, comm)
    assert (path / "model.safetensors").exists() and (path / "optimizer.bin").exists()

    def prepared():
        reset_state()
        acc = Accelerator()
        model = _model(seed=5)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1)
        return acc, *acc.prepare(model, opt, sched)

    expected = torch.load(str(path) + ".expected")
    # weights only: the safetensors file loads without any pickle
    reset_state()
    acc = Accelerator()
    model = acc.prepare(_model(seed=5))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc.load_state(path)
    # Accelerate ran as one process: only rank 0 has a random_states file, not read
    skipped = [w for w in caught if "random_states_0.pkl is a pickle and is not read" in str(
        w.message)]
    assert len(skipped) == (1 if acc.is_main_process else 0), [str(w.message) for w in caught]
    assert all(torch.equal(v, expected[k])
               for k, v in acc.unwrap_model(model).state_dict().items())
    # with an optimizer: its optimizer.bin is a pickle, refused unless allowed
    acc, model, opt, sched = prepared()
    before = {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}
    with pytest.raises(CollectiveError, match=r"written by Hugging Face Accelerate.*optimizer\.bin"
                       r"(.|\n)*allow_pickle=True"):
        acc.load_state(path)
    assert all(torch.equal(v, before[k])
               for k, v in acc.unwrap_model(model).state_dict().items())  # nothing changed
    acc, model, opt, sched = prepared()
    acc.load_state(path, allow_pickle=True)
    assert all(torch.equal(v, expected[k])
               for k, v in acc.unwrap_model(model).state_dict().items())
    saved_opt = torch.load(str(path) + ".opt", weights_only=False)
    assert opt.state_dict()["state"][0]["step"] == saved_opt["state"][0]["step"]
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], saved_opt["state"][0]["exp_avg"])
    assert sched.state_dict()["last_epoch"] == 1


def test_a_rank_alone_while_the_others_compute(mpi_tmp_path, monkeypatch):
    """The others are busy (not in a collective): the save waits MPACCEL_SOLO_SAVE_WAIT for
    them, then writes alone; ranks that come late to the same save find it written."""
    monkeypatch.setenv("MPACCEL_SOLO_SAVE_WAIT", "0.3")
    reset_state()
    acc = Accelerator()
    model = acc.prepare(_model())
    if acc.is_main_process:
        acc.save_model(model, mpi_tmp_path / "alone")
    else:
        time.sleep(1.0)  # computing
    acc.wait_for_everyone()
    # every rank calls, rank 0 on time, the others over the wait late: written once, by rank 0
    if not acc.is_main_process:
        time.sleep(1.0)
    acc.save_model(model, mpi_tmp_path / "late")
    acc.wait_for_everyone()
    acc.save_state(mpi_tmp_path / "state")  # on time: together, each rank its own RNG state
    state = acc.unwrap_model(model).state_dict()
    for name in ("alone", "late"):
        loaded = safetensors_torch.load_file(mpi_tmp_path / name / "model.safetensors")
        assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k])
                                                     for k in state)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc.load_state(mpi_tmp_path / "state")
    assert not [w for w in caught if "processes" in str(w.message)], caught  # same world size
    acc.wait_for_everyone()


SOLO_SCRIPT = """
import sys
import torch
from mpaccel import Accelerator
acc = Accelerator()
model = acc.prepare(torch.nn.Linear(4, 4))
optimizer = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
if acc.is_main_process:
    acc.save_model(model, sys.argv[1] + "/model")
    acc.save_state(sys.argv[1] + "/state")
    acc.save(acc.unwrap_model(model).state_dict(), sys.argv[1] + "/weights.pt")
if sys.argv[2] == "wait":
    acc.wait_for_everyone()
print("reached the end", flush=True)
"""


@pytest.mark.mpi(size=1)  # each run starts its own mpiexec
@pytest.mark.launches
@pytest.mark.parametrize("then", ["wait", "end"])
def test_the_main_process_idiom_runs_to_the_end(tmp_path, then):
    script = tmp_path / "job.py"
    script.write_text(SOLO_SCRIPT)
    run = run_mpi([str(script), str(tmp_path), then], n=2, timeout=120)
    assert run.returncode == 0 and all("reached the end" in out for out in run.stdout), \
        run.describe()
    assert "unusable" not in "".join(run.stderr), run.describe()
    assert (tmp_path / "model" / "model.safetensors").exists()
    assert (tmp_path / "state" / "state.index.json").exists()
    assert (tmp_path / "weights.pt").exists()


def test_automatic_naming_after_a_save_by_the_main_process(mpi_tmp_path):
    reset_state()
    config = ProjectConfiguration(project_dir=str(mpi_tmp_path), automatic_checkpoint_naming=True)
    acc = Accelerator(project_config=config)
    acc.prepare(_model())
    if acc.is_main_process:
        acc.save_state()  # checkpoint_0, by rank 0 alone: only its number advanced
    acc.wait_for_everyone()
    acc.save_state()  # every rank: rank 0's number, checkpoint_1
    acc.wait_for_everyone()
    assert sorted(os.listdir(mpi_tmp_path / "checkpoints")) == ["checkpoint_0", "checkpoint_1"]
    assert acc.project_configuration.iteration == 2
