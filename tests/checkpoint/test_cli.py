"""`mpaccel ckpt ls|verify|export` on real checkpoints (one process)."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from mpaccel import Accelerator, AcceleratorState

pytestmark = [pytest.mark.mpi(size=1), pytest.mark.launches]
DEADLINE = 30  # seconds any command may take


# `mpaccel ckpt ...` run by a driver process that imports mpaccel once and forks a child per
# command (as `python -m mpaccel ckpt ...` would run it: mpaccel.cli.main, its exit code, its
# stdout and stderr, an uncaught exception printed as Python does), killed after DEADLINE.
_DRIVER = r"""
import json, os, sys, tempfile, time, traceback
from mpaccel.cli import main
for line in sys.stdin:
    argv, deadline = json.loads(line)
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    end = time.monotonic() + deadline
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done or time.monotonic() > end:
            break
        time.sleep(0.01)
    hung = not done
    if hung:
        os.kill(pid, 9)
        _, status, usage = os.wait4(pid, 0)
    out.seek(0)
    err.seek(0)
    reply = [os.waitstatus_to_exitcode(status), out.read(), err.read(), usage.ru_maxrss << 10, hung]
    print(json.dumps(reply), flush=True)
"""


class Commands:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", _DRIVER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def run(self, *args: str) -> tuple[int, str, str, int]:
        """(exit code, stdout, stderr, peak memory in bytes) of `mpaccel ckpt ARGS`."""
        self.proc.stdin.write(json.dumps([["ckpt", *args], DEADLINE]) + "\n")
        self.proc.stdin.flush()
        code, out, err, peak, hung = json.loads(self.proc.stdout.readline())
        assert not hung, f"mpaccel ckpt {' '.join(args)} hangs"
        return code, out, err, peak

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "mpaccel", "ckpt", *args], capture_output=True,
                          text=True, timeout=120)


@pytest.fixture
def saved(tmp_path):
    AcceleratorState._reset_state(True)
    acc = Accelerator()
    torch.manual_seed(0)
    model = acc.prepare(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)))
    acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    acc.save_state(tmp_path / "state")
    acc.save_model(model, tmp_path / "model", max_shard_size="60B", safe_serialization=False)
    yield tmp_path, acc.unwrap_model(model).state_dict()
    AcceleratorState._reset_state(True)


def test_ls(saved):
    root, _ = saved
    run = _cli("ls", str(root / "model"))
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert "model checkpoint, format 1, written by 1 process(es)" in lines[0]
    weight = next(line for line in lines if line.startswith("model/0.weight"))
    assert weight.split()[1:4] == ["float32", "3x4", "48"]
    assert weight.split()[-1].startswith("model-") and weight.endswith(".h5")
    assert lines[-1] == "4 tensors, 92 B in 2 shard(s)"  # 48 + 12 + 24 + 8 bytes, 60 B shards
    state = _cli("ls", str(root / "state"))
    lines = state.stdout.splitlines()
    assert any(line.startswith("model_0/1.bias ") for line in lines)
    rng = next(line for line in lines if line.startswith("rank 0: rng/torch "))
    assert rng.split()[3:5] == ["uint8", "5056"] and rng.endswith("-rank00000.h5")
    assert lines[-1].endswith("per-rank tensors in 1 per-rank file(s)"), lines[-1]


def test_verify_detects_a_flipped_byte(saved):
    root, _ = saved
    assert _cli("verify", str(root / "state")).returncode == 0
    from tests.checkpoint.test_api import _corrupt_one_byte

    _corrupt_one_byte(str(root / "state"))
    run = _cli("verify", str(root / "state"))
    assert run.returncode == 1
    assert "checksum mismatch" in run.stderr and "FAILED" in run.stdout


def test_verify_detects_an_edited_index(saved):
    root, _ = saved
    index = root / "state" / "state.index.json"
    index.write_text(index.read_text().replace('"lr": 0.1', '"lr": 0.3', 1))
    run = _cli("verify", str(root / "state"))
    assert run.returncode == 1 and "does not match its checksum" in run.stderr, run.stderr


def test_export_to_safetensors(saved, tmp_path):
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    root, state = saved
    out = tmp_path / "weights.safetensors"
    run = _cli("export", str(root / "model"), "--to", "safetensors", "--output", str(out))
    assert run.returncode == 0, run.stderr
    loaded = load_file(str(out))
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    run = _cli("export", str(root / "state"), "--output", str(tmp_path / "s.safetensors"))
    assert run.returncode == 0 and "model_0" in run.stdout


def test_export_names_the_keys_safetensors_cannot_hold(tmp_path):
    pytest.importorskip("safetensors")

    class WithExtra(torch.nn.Linear):
        def get_extra_state(self):
            return {"calibration": 3}

        def set_extra_state(self, state):
            pass

    AcceleratorState._reset_state(True)
    acc = Accelerator()
    acc.save_model(WithExtra(2, 2), tmp_path / "model", safe_serialization=False)
    run = _cli("export", str(tmp_path / "model"), "--output", str(tmp_path / "w.safetensors"))
    assert run.returncode == 1
    assert "1 key(s) hold other values ('_extra_state')" in run.stderr, run.stderr
    assert "HINT" in run.stderr
    AcceleratorState._reset_state(True)


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    run = _cli("ls", str(tmp_path))
    assert run.returncode == 1 and "holds no committed checkpoint" in run.stderr


def test_ls_into_a_closed_pipe_stops_quietly(saved):
    # `mpaccel ckpt ls DIR | head -1`: the reader goes away; a BrokenPipeError traceback then
    # buried the listing's first lines.
    root, _ = saved
    proc = subprocess.Popen([sys.executable, "-m", "mpaccel", "ckpt", "ls", str(root / "state")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # before anything is written: every write meets a closed pipe
    stderr = proc.stderr.read()
    assert proc.wait(timeout=120) == 1
    assert stderr == ""


def test_ls_and_export_of_tied_weights(tmp_path):
    """Tied weights are stored once: ls shows which keys share the dataset; export writes both
    keys (safetensors refuses tensors that share memory, and a strict load_state_dict needs
    both)."""
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    from tests.checkpoint.test_api import _Tied

    AcceleratorState._reset_state(True)
    acc = Accelerator()
    torch.manual_seed(0)
    model = _Tied(tie=True)
    acc.save_model(model, tmp_path / "model", safe_serialization=False)
    run = _cli("ls", str(tmp_path / "model"))
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert [line.split()[0] for line in lines[2:-2]] == ["model/emb.weight"], lines
    assert lines[-2] == "stored once for several keys: model/emb.weight (emb.weight, head.weight)"
    assert lines[-1] == "1 tensors, 3.1 KiB in 1 shard(s)"
    out = tmp_path / "w.safetensors"
    run = _cli("export", str(tmp_path / "model"), "--output", str(out))
    assert run.returncode == 0, run.stderr
    loaded = load_file(str(out))
    assert loaded.keys() == {"emb.weight", "head.weight"}
    fresh = _Tied(tie=False)
    fresh.load_state_dict(loaded)
    assert torch.equal(fresh.head.weight, model.head.weight)
    AcceleratorState._reset_state(True)


@pytest.fixture
def commands():
    driver = Commands()
    yield driver
    driver.close()


def test_verify_of_shards_with_damaged_hdf5_metadata_says_one_line(tmp_path, commands):
    """48 shards, each with one byte of HDF5's own metadata (superblock, object headers, heaps:
    anything but the tensors' data) changed: `ckpt verify` exits 0 with every tensor verified
    (a byte HDF5 does not use) or 1 with a first line naming the file, never a traceback (a
    damaged object header raised KeyError out of h5py)."""
    AcceleratorState._reset_state(True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    Accelerator().save_model(model, tmp_path / "good", safe_serialization=False)
    AcceleratorState._reset_state(True)
    index = json.loads((tmp_path / "good" / "model.index.json").read_text())
    shard = index["shards"][0]
    size = (tmp_path / "good" / shard).stat().st_size
    data = {i for e in index["tensors"].values()
            for i in range(e["offset"], e["offset"] + e["nbytes"])}
    metadata = [i for i in range(size) if i not in data]
    rng = random.Random(18)
    outcomes = {0: 0, 1: 0}
    for case, position in enumerate(sorted(rng.sample(metadata, 48))):
        directory = tmp_path / f"fuzz{case}"
        shutil.copytree(tmp_path / "good", directory)
        with open(directory / shard, "r+b") as f:
            f.seek(position)
            byte = f.read(1)[0]
            f.seek(position)
            f.write(bytes([byte ^ rng.randrange(1, 256)]))
        code, out, err, _ = commands.run("verify", str(directory))
        where = f"byte {position} of {size}: exit {code}\n{out}{err}"
        assert "Traceback" not in err and code in (0, 1), where
        outcomes[code] += 1
        if code == 0:
            assert out.strip() == f"{directory}: 4 of 4 tensors verified", where
        else:
            assert str(directory / shard) in err.splitlines()[0], where
        shutil.rmtree(directory)
    assert outcomes[1] >= 8, outcomes  # (11 here: HDF5 leaves much of its metadata unused)


def test_export_refuses_numpy_values_in_the_model_state(tmp_path):
    """A numpy array or scalar in the model's state (a get_extra_state() returning one) is named
    as a key safetensors cannot hold (it ended in AttributeError: no 'untyped_storage')."""
    pytest.importorskip("safetensors")

    class WithArray(torch.nn.Linear):
        def __init__(self, extra):
            super().__init__(2, 2)
            self.extra = extra

        def get_extra_state(self):
            return self.extra

        def set_extra_state(self, state):
            pass

    for extra in (np.arange(3.0), np.float32(1.5)):
        AcceleratorState._reset_state(True)
        shutil.rmtree(tmp_path / "model", ignore_errors=True)
        Accelerator().save_model(WithArray(extra), tmp_path / "model", safe_serialization=False)
        run = _cli("export", str(tmp_path / "model"), "--output", str(tmp_path / "w.safetensors"))
        assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
        assert "1 key(s) hold other values ('_extra_state')" in run.stderr, run.stderr
    AcceleratorState._reset_state(True)
