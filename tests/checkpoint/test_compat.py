"""Checkpoints as Hugging Face tooling and Accelerate scripts expect them (issue 21): the
safetensors layout of save_model, saves by the main process alone, a directory per rank, and
load_state on a directory Accelerate wrote. The bodies run at size 1 and under mpiexec -n 2."""

from __future__ import annotations

import copy
import fcntl
import hashlib
import importlib.metadata
import json
import os
import pathlib
import random
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings

import numpy as np
import pytest
import torch

from mpaccel import Accelerator, CollectiveError, PartialState
from mpaccel.comm import agreement
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


_ACCELERATE_SAVES = textwrap.dedent("""
    import json, os, sys, torch
    from accelerate import Accelerator
    from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel
    root = sys.argv[1]
    acc = Accelerator(cpu=True)

    def mlp():
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                   torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))

    def batch(step):
        return torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(step))

    def loss(model, step):
        if isinstance(model, torch.nn.Sequential):
            return model(torch.ones(2, 32)).sum()
        ids = batch(step)
        return model(input_ids=ids, labels=ids).loss

    def save(name, model):
        torch.manual_seed(0)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1 if name == "mlp" else 0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        model, opt, sched = acc.prepare(model, opt, sched)
        loss(model, 0).backward()
        opt.step(); sched.step(); opt.zero_grad()
        path = os.path.join(root, name)
        acc.save_state(path)
        torch.save(model.state_dict(), path + ".expected")
        torch.save(opt.state_dict(), path + ".opt")
        after = []  # how training goes on from the checkpoint
        for step in (1, 2):
            value = loss(model, step)
            after.append(value.item())
            value.backward(); opt.step(); opt.zero_grad()
        with open(path + ".losses", "w") as f:
            json.dump(after, f)
        acc._models.clear(); acc._optimizers.clear(); acc._schedulers.clear()

    save("mlp", mlp())
    quiet = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    save("gpt2", GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64,
                                            n_positions=16, **quiet)))
    save("bert", BertForMaskedLM(BertConfig(
        num_hidden_layers=1, num_attention_heads=2, hidden_size=16, intermediate_size=32,
        vocab_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)))
""")


def _hf_model(name):
    """The model of the checkpoint `name` that _ACCELERATE_SAVES wrote, built afresh."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(7)  # other weights than the checkpoint's
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    return transformers.BertForMaskedLM(transformers.BertConfig(
        num_hidden_layers=1, num_attention_heads=2, hidden_size=16, intermediate_size=32,
        vocab_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))


def _hf_loss(model, step):
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(step))
    return model(input_ids=ids, labels=ids).loss


@pytest.fixture(scope="module")
def accelerate_saves(comm, tmp_path_factory):
    """Checkpoints written by the real Accelerate's save_state (one process, in a process of
    its own, started by rank 0): `mlp`, `gpt2` (tied head), `bert` (tied decoder weight
    and bias), each after one training step, with `.expected` (its model's state_dict), `.opt`
    (its optimizer's) and `.losses` (the losses of the next two steps) beside it. In rank 0's
    own directory: tests copy them into their shared one (_copied).

    Written once per CI run, not once per pytest process: MPACCEL_TEST_CACHE (set by
    scripts/test-matrix.sh for every stage) names a directory the stages and xdist workers
    share, under a key of the script and the versions that wrote it; without it, once per
    pytest run (the workers' common temporary directory)."""
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    shared = os.environ.get("MPACCEL_TEST_CACHE") or tmp_path_factory.getbasetemp().parent
    versions = [importlib.metadata.version(name) for name in ("accelerate", "transformers")]
    key = hashlib.sha256("\0".join([_ACCELERATE_SAVES, torch.__version__, *versions])
                         .encode()).hexdigest()[:16]
    cache = pathlib.Path(shared) / f"accelerate-saves-{key}"
    # mpaccel's communicator: the others wait without spinning on the cores the save needs
    with agreement(PartialState().comm, "writing checkpoints with Accelerate"):
        if comm.Get_rank() == 0:
            _write_once(cache)
    return cache


def _write_once(cache: pathlib.Path) -> None:
    """Accelerate's checkpoints into `cache`, unless a process sharing it wrote them already
    (an exclusive lock beside it; the directory appears whole, by a rename)."""
    cache.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{cache}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if cache.is_dir():
            return
        partial = pathlib.Path(tempfile.mkdtemp(dir=cache.parent, prefix=f"{cache.name}."))
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PMI_", "MPI_", "OMPI_", "PMIX_", "HYDRA", "MPIR_"))}
        run = subprocess.run([sys.executable, "-c", _ACCELERATE_SAVES, str(partial)], env=env,
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        partial.rename(cache)


def _copied(accelerate_saves, name, mpi_tmp_path, comm, change=None, ranks=True):
    """Rank 0 copies Accelerate's checkpoint `name` (and the files beside it) into the test's
    shared directory, then does change(path, last rank) to it; every rank gets the path once
    it is done. Accelerate ran as one process; with `ranks`, at N ranks its
    random_states_0.pkl is copied to random_states_<r>.pkl for every rank r: what Accelerate
    writes at N processes whose RNGs were seeded alike."""
    path = mpi_tmp_path / name
    with agreement(PartialState().comm, f"copying {name}"):
        if comm.Get_rank() == 0:
            shutil.copytree(accelerate_saves / name, path)
            for extra in accelerate_saves.glob(f"{name}.*"):
                shutil.copy(extra, mpi_tmp_path / extra.name)
            for rank in range(1, comm.Get_size() if ranks else 1):
                shutil.copy(path / "random_states_0.pkl", path / f"random_states_{rank}.pkl")
            if change is not None:
                change(path, comm.Get_size() - 1)
    return path


def test_load_state_of_an_accelerate_checkpoint(accelerate_saves, mpi_tmp_path, comm):
    path = _copied(accelerate_saves, "mlp", mpi_tmp_path, comm, ranks=False)
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
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc.load_state(path, allow_pickle=True)
    # saved by one process: at N > 1 ranks the RNG states stay, the main process says so
    other_size = [w for w in caught if "holds the random states of 1 process and is loaded by"
                  in str(w.message)]
    assert len(other_size) == (acc.num_processes > 1 and acc.is_main_process), caught
    assert all(torch.equal(v, expected[k])
               for k, v in acc.unwrap_model(model).state_dict().items())
    saved_opt = torch.load(str(path) + ".opt", weights_only=False)
    assert opt.state_dict()["state"][0]["step"] == saved_opt["state"][0]["step"]
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], saved_opt["state"][0]["exp_avg"])
    assert sched.state_dict()["last_epoch"] == 1


def _prepared(name):
    """A fresh mpaccel Accelerator and the model `name` (mlp, gpt2, bert: built afresh, other
    weights than the checkpoint's), AdamW and StepLR, prepared, and its loss at a step."""
    reset_state()
    acc = Accelerator()
    model = _model(seed=5) if name == "mlp" else _hf_model(name)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    loss = (lambda step: model(torch.ones(2, 32)).sum()) if name == "mlp" else (
        lambda step: _hf_loss(model, step))
    return acc, model, opt, sched, loss


def _tied_groups(module):
    """Names of the parameters that are one tensor, as the model ties them."""
    groups: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return sorted(names for names in groups.values() if len(names) > 1)


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_an_accelerate_save_of_a_tied_model_loads_and_continues(
    accelerate_saves, mpi_tmp_path, comm, name
):
    """Accelerate's saver drops tied aliases (GPT-2's lm_head.weight, BERT's decoder weight
    and bias); the model ties them itself, so they are not missing: the load takes every
    tensor, the optimizer, scheduler, step and RNG states, and training goes on as it went on
    under Accelerate."""
    path = _copied(accelerate_saves, name, mpi_tmp_path, comm)
    saved = safetensors_torch.load_file(path / "model.safetensors")
    acc, model, opt, sched, loss_at = _prepared(name)
    inner = acc.unwrap_model(model)
    tied = _tied_groups(inner)
    assert tied and all(sum(n in saved for n in names) == 1 for names in tied), (tied, list(saved))
    acc.load_state(path, allow_pickle=True)
    expected = torch.load(str(path) + ".expected")
    assert inner.state_dict().keys() == expected.keys()
    assert all(torch.equal(v, expected[k]) for k, v in inner.state_dict().items())
    assert _tied_groups(inner) == tied  # still one tensor each
    saved_opt = torch.load(str(path) + ".opt", weights_only=False)
    assert opt.state_dict()["state"].keys() == saved_opt["state"].keys()
    assert all(torch.equal(opt.state_dict()["state"][i]["exp_avg"], s["exp_avg"])
               for i, s in saved_opt["state"].items())
    assert sched.state_dict()["last_epoch"] == 1
    states = torch.load(path / "random_states_0.pkl", weights_only=False)
    assert torch.equal(torch.get_rng_state(), states["torch_manual_seed"])
    assert acc.step == states["step"]
    losses = []
    for step in (1, 2):  # the same batch on every rank: the steps of one process
        loss = loss_at(step)
        losses.append(loss.item())
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    expected_losses = json.loads((mpi_tmp_path / f"{name}.losses").read_text())
    assert losses == pytest.approx(expected_losses, rel=1e-5, abs=1e-6)


def test_assign_keeps_tied_names_tied(accelerate_saves, mpi_tmp_path, comm):
    """load_state(..., assign=True) gives each key a Parameter of its own (torch's
    load_state_dict): the names the model tied are one tensor again afterwards."""
    path = _copied(accelerate_saves, "gpt2", mpi_tmp_path, comm)
    reset_state()
    acc = Accelerator()
    inner = acc.unwrap_model(acc.prepare(_hf_model("gpt2")))  # the weights only: no pickle
    tied = _tied_groups(inner)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the random_states files are pickles, not read
        acc.load_state(path, assign=True)
    expected = torch.load(str(path) + ".expected")
    assert all(torch.equal(v, expected[k]) for k, v in inner.state_dict().items())
    assert _tied_groups(inner) == tied
    assert inner.lm_head.weight is inner.transformer.wte.weight


def _everything(acc, model, opt, sched):
    """What a load may change, as values: model, optimizer, scheduler, step, RNG states."""
    return copy.deepcopy({
        "model": acc.unwrap_model(model).state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "step": acc.step,
        "rng": (torch.get_rng_state(), random.getstate(), np.random.get_state()),
    })


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def _trained_once(name):
    """Prepared (_prepared), then one step of its own: the optimizer has state, the scheduler
    and the RNGs moved, all of it different from the checkpoint's."""
    acc, model, opt, sched, loss_at = _prepared(name)
    acc.backward(loss_at(5))
    opt.step()
    sched.step()
    opt.zero_grad()
    torch.rand(3)
    return acc, model, opt, sched


def _rewrite_model(edit):
    """A change that rewrites model.safetensors after edit(tensors, key), `key` the first of
    its tensors (by name): not tied to any other."""
    def change(path, last):
        tensors = safetensors_torch.load_file(path / "model.safetensors")
        edit(tensors, min(tensors))
        safetensors_torch.save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return change


def _longer(tensor):
    return torch.zeros(tensor.shape[0] + 1, *tensor.shape[1:])


_HOSTILE = {
    # what is done to the checkpoint, what the error says (`key`: the first tensor's name),
    # on which ranks it fails ("all"; "last": the last rank, the only one that reads
    # random_states_<last>.pkl)
    "an extra key": (_rewrite_model(lambda t, key: t.update(extra=torch.zeros(3))),
                     r"unexpected keys \['extra'\]", "all"),
    "a wrong shape": (_rewrite_model(lambda t, key: t.update({key: _longer(t[key])})),
                      r"other shapes: {key}: \[\d+\] in the checkpoint, \[\d+\] here", "all"),
    "a wrong dtype": (_rewrite_model(lambda t, key: t.update({key: t[key].to(torch.int64)})),
                      r"{key}: torch\.int64 in the checkpoint, torch\.float32 here", "all"),
    "a missing tensor": (_rewrite_model(lambda t, key: t.pop(key)),
                         r"missing keys \['{key}'\]", "all"),
    "a truncated random_states file": (
        lambda path, last: _truncate(path / f"random_states_{last}.pkl"),
        r"random_states_\d+\.pkl", "last"),
    "a step that is not a count on the last rank": (  # refused once the rest was handed over
        lambda path, last: _edit_pickle(path / f"random_states_{last}.pkl", step=-1),
        r"holds the step -1, not a count", "last"),
    "a FIFO named model.safetensors": (
        lambda path, last: _replace(path / "model.safetensors", os.mkfifo), r"is a FIFO", "all"),
    "a link named model.safetensors": (
        lambda path, last: _replace(path / "model.safetensors", lambda p: os.symlink(
            path.parent / "outside.safetensors", p)), r"is a symbolic link", "all"),
}
_FIRST_KEY = {"mlp": "0.bias", "gpt2": "transformer.h.0.attn.c_attn.bias"}


def _edit_pickle(path, **changes):
    state = torch.load(path, weights_only=False)
    state.update(changes)
    torch.save(state, path)


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _replace(path, make):
    """`path` replaced by what make(path) creates; the file it was is kept outside the
    checkpoint, as outside.safetensors (a link points there)."""
    os.replace(path, path.parent.parent / "outside.safetensors")
    make(path)


@pytest.mark.mpi_timeout(120)  # a FIFO opened for reading waits for a writer forever
@pytest.mark.parametrize("name", ["mlp", "gpt2"])
@pytest.mark.parametrize("case", list(_HOSTILE))
def test_a_refused_accelerate_load_changes_nothing(
    accelerate_saves, mpi_tmp_path, comm, case, name
):
    """Everything is read and checked on every rank, the ranks agree, then anything is applied:
    a refused load leaves the model, optimizer, scheduler, step and RNG states as they were,
    on every rank, and every rank raises the same error naming the failing rank(s)."""
    change, message, failing = _HOSTILE[case]
    path = _copied(accelerate_saves, name, mpi_tmp_path, comm, change)
    acc, model, opt, sched = _trained_once(name)
    before = _everything(acc, model, opt, sched)
    with pytest.raises(CollectiveError, match=message.format(key=re.escape(_FIRST_KEY[name]))) \
            as info:
        acc.load_state(path, allow_pickle=True)
    ranks = list(range(comm.Get_size())) if failing == "all" else [comm.Get_size() - 1]
    assert info.value.failed_ranks == ranks, str(info.value)
    assert len(set(comm.allgather(str(info.value)))) == 1  # the same error on every rank
    assert _same(before, _everything(acc, model, opt, sched)), case


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
