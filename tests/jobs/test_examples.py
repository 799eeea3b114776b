"""The examples, run as a user would: under a real mpiexec, and as plain python."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

from mpaccel import envvars
from mpaccel.testing import run_mpi

pytestmark = [pytest.mark.mpi(size=1), pytest.mark.launches]
EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("n", [1, 4])
def test_train_example(n):
    run = run_mpi(
        [str(EXAMPLES / "train.py"), "--epochs", "3", "--train-samples", "2000"], n=n, timeout=300
    ).check()
    out = run.stdout[0]
    epochs = re.findall(
        r"epoch\s+\d+\s+val_loss ([\d.]+)\s+accuracy ([\d.]+)\s+\((\d+) validation", out
    )
    assert len(epochs) == 3, out
    assert all(samples == "1001" for _, _, samples in epochs)  # gather_for_metrics: exact count
    assert float(epochs[-1][0]) < float(epochs[0][0])  # it learns
    assert f"{n} process(es)" in out and "done in" in out
    assert all(other.strip() == "" for other in run.stdout[1:]), run.describe()
    # a log file, not a terminal: the progress bar as plain lines, and the logger's lines
    # (logging.basicConfig in the example; they went nowhere without a handler)
    err = run.stderr[0]
    assert "\r" not in err and re.search(r"^epoch 2: 100% \d+/\d+ \[", err, re.M), err
    assert re.search(r"INFO mpaccel.examples.train: \[RANK 0\] epoch 2 took", err), err
    assert all("epoch" not in other for other in run.stderr[1:]), run.describe()


def test_train_example_shows_a_live_bar_at_the_terminal_of_mpiexec(tmp_path):
    # mpiexec gives the ranks pipes; the bar is drawn for the terminal mpiexec writes to
    from tests.utils.test_progress import _in_terminal, _launch

    argv, env = _launch(2, EXAMPLES / "train.py")
    # --step-delay: on an idle machine the 32 steps after the first take less than tqdm's
    # mininterval (0.1 s), and the bar is never redrawn with progress before it is cleared
    text = _in_terminal([*argv, "--epochs", "1", "--train-samples", "2000", "--step-delay",
                         "0.02"], env, columns=90)
    frames = [f for f in text.split("\r") if f.startswith("epoch 0:")]
    assert len(frames) >= 3 and any("█" in f and len(f) == 90 for f in frames), repr(text)
    assert "[RANK 0] epoch 0 took" in text and "[RANK 1]" not in text


def test_train_example_as_plain_python(tmp_path):
    # no launcher at all: `python examples/train.py`, a world of one
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / "train.py"), "--epochs", "1", "--train-samples", "1000"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env=envvars.child_environment(),
    )
    assert run.returncode == 0, run.stderr
    assert "1 process(es)" in run.stdout and "(1001 validation samples)" in run.stdout


def test_train_example_stops_early():
    run = run_mpi(
        [
            str(EXAMPLES / "train.py"),
            "--epochs",
            "30",
            "--train-samples",
            "2000",
            "--target-accuracy",
            "0.5",
        ],
        n=2,
        timeout=300,
    ).check()
    assert "early stop after epoch 0" in run.stdout[0]


def test_train_fsdp_example_shards_unevenly_over_a_hybrid_mesh():
    # n=3: 3 does not divide the model's rows (uneven shards); one node: a (1, 3) mesh
    run = run_mpi(
        [str(EXAMPLES / "train_fsdp.py"), "--epochs", "2", "--samples", "384", "--hybrid"],
        n=3,
        timeout=300,
    ).check()
    out = run.stdout[0]
    assert "3 process(es), mesh (1, 3) ('dp_replicate', 'dp_shard'); 110400 parameters" in out
    local = int(re.search(r"(\d+) on rank 0", out).group(1))
    assert 110400 / 3 <= local < 110400 / 2  # rank 0's share: a third, rounded up per tensor
    losses = [float(v) for v in re.findall(r"epoch \d loss ([\d.]+)", out)]
    assert len(losses) == 2 and losses[1] < losses[0], out  # it learns
    assert "full state dict: 30 tensors, 110400 values" in out
    assert all(other.strip() == "" for other in run.stdout[1:]), run.describe()
    assert re.search(r"^epoch 1: 100% ", run.stderr[0], re.M), run.stderr[0]  # the bar, rank 0
    assert all("epoch" not in other for other in run.stderr[1:]), run.describe()


def test_process_control_example():
    run = run_mpi([str(EXAMPLES / "process_control.py")], n=4, timeout=120).check()
    everything = "".join(run.stdout)
    for rank in range(4):
        assert f"process {rank}/4: local {rank}, node 0/1" in everything
    assert "stopping at step 3" in run.stdout[0]
    assert run.stdout[0].count("MULTI_CPU: 4 process(es)") == 1


def test_nd_parallel_example_trains_tp_inside_fsdp_and_saves(tmp_path):
    # once, at tp 2 x dp_shard 2, a few steps (the --tp-size 4 layout is run by hand: docs)
    ckpt = tmp_path / "ckpt"
    run = run_mpi(
        [str(EXAMPLES / "nd_parallel.py"), *"--tp-size 2 --dp-shard-size 2 --steps 8".split(),
         *"--log-every 4 --output-dir".split(), str(ckpt)],
        n=4,
        timeout=300,
    ).check()
    out = run.stdout[0]
    assert "4 process(es), mesh (2, 2) ('dp_shard', 'tp')" in out, out
    losses = [float(v) for v in re.findall(r"^step \d+ loss ([\d.]+)$", out, re.M)]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.3, out  # it learns
    assert all(other.strip() == "" for other in run.stdout[1:]), run.describe()
    assert re.search(r"^train: 100% 8/8 ", run.stderr[0], re.M), run.stderr[0]  # the bar, rank 0
    assert all("train:" not in other for other in run.stderr[1:]), run.describe()
    # the checkpoint: each rank's shard files, committed by their indexes
    names = sorted(p.name for p in ckpt.iterdir())
    assert {"state.index.json", "sharded.index.json"} <= set(names), names
    assert sum(name.endswith(".h5") for name in names) == 8, names
    assert f"checkpoint {ckpt}: 10 files" in out
