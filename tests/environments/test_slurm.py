"""The Slurm templates and mpaccel's Slurm support on a real Slurm: a private two-node cluster
brought up by slurm/cluster.sh (root and apt-get needed: elsewhere skipped with the reason, and
under CI, where they must run, a failure)."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import pytest

from mpaccel import envvars

pytestmark = [pytest.mark.mpi(size=1), pytest.mark.slow, pytest.mark.launches, pytest.mark.slurm]
ROOT = pathlib.Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "slurm" / "cluster.sh"
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
TRAIN_ARGS = ["--epochs", "4", "--train-samples", "2000", "--target-accuracy", "2",
              "--patience", "99"]


@pytest.fixture(scope="module")
def slurm_env():
    up = subprocess.run(["bash", str(CLUSTER), "up", "--nodes", "2"], capture_output=True,
                        text=True, timeout=600)
    if up.returncode == 77:
        reason = f"no private Slurm cluster here: {up.stderr.strip()}"
        if envvars.get("ci"):
            pytest.fail(reason)
        pytest.skip(reason)
    assert up.returncode == 0, up.stderr
    exports = subprocess.run(["bash", str(CLUSTER), "env"], capture_output=True, text=True,
                             check=True).stdout
    extra = dict(re.findall(r"export (\w+)=['\"]?([^'\"\n]*)['\"]?", exports))
    # Jobs inherit this environment: the same Python (with mpaccel, mpi4py and MPICH) as the tests.
    extra["PATH"] = f"{pathlib.Path(sys.executable).parent}:{envvars.child_environment()['PATH']}"
    env = envvars.child_environment(extra)
    # Jobs need not know which test set the cluster up; and the environment's size alone can
    # trip an MPICH/Slurm pmi2 bug in MPI_Init (docs/slurm.md): this variable's ~70 characters
    # did, every time, on the machine that found it.
    env.pop("PYTEST_CURRENT_TEST", None)
    yield env
    subprocess.run(["bash", str(CLUSTER), "down"], capture_output=True, timeout=120)


def _run(env, *command, timeout=120):
    return subprocess.run(list(command), env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


# Slurm's pmi2 plugin reads at most 1024 bytes of a PMI-1 request; MPICH's UCX netmod sends its
# node's addresses in segments whose encoded length depends on uninitialised padding, now and
# then longer, and MPI_Init then aborts or hangs before mpaccel runs (docs/slurm.md). What it
# hits depends on the processes' memory, which any change of environment shifts: each attempt
# runs with a padding variable of another length, and a test that hits it every time is an
# xfail naming the bug, never a pass.
PMI2_GARBLED = "mpi/pmi2: value not properly terminated in client request"
ATTEMPTS = 3


class Pmi2Garbled(Exception):
    pass


def _attempt_env(env, attempt):
    return {**env, "MPACCEL_TEST_PADDING": "x" * (37 * attempt)}


def _retrying(action):
    """action(attempt) until it does not raise Pmi2Garbled, at most ATTEMPTS times."""
    for attempt in range(ATTEMPTS):
        try:
            return action(attempt)
        except Pmi2Garbled as exc:
            last = exc
    pytest.xfail(f"MPI_Init hit the MPICH/Slurm pmi2 request-length bug in all {ATTEMPTS} "
                 f"attempts (docs/slurm.md): {last}")


def _srun(env, *args, timeout=120):
    """srun ARGS (ending a step as soon as one task fails), retried on the pmi2 bug."""
    def once(attempt):
        command = ["srun", "--kill-on-bad-exit=1", *args]
        try:
            run = _run(_attempt_env(env, attempt), *command, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            stderr = exc.stderr or b""
            text = stderr.decode(errors="replace") if isinstance(stderr, bytes) else stderr
            if PMI2_GARBLED in text:
                raise Pmi2Garbled(f"srun timed out after {timeout} s") from exc
            raise
        if run.returncode != 0 and PMI2_GARBLED in run.stderr:
            raise Pmi2Garbled(f"srun exited {run.returncode}")
        return run
    return _retrying(once)


def _submit(env, tmp_path, template, *args, options=()):
    out = tmp_path / "%x-%j.out"
    result = _run(env, "sbatch", "--parsable", f"--output={out}", *options,
                  str(ROOT / "slurm" / template), *args)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().split(";")[0]


def _job(env, job_id) -> dict[str, str]:
    text = _run(env, "scontrol", "show", "job", "-o", job_id).stdout
    return dict(re.findall(r"(\w+)=(\S*)", text))


def _wait(env, job_id, timeout=240, until=TERMINAL, output=None) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    cancelled = False
    while time.monotonic() < deadline:
        info = _job(env, job_id)
        if output is not None and PMI2_GARBLED in _output(output, job_id):
            if info.get("JobState") in TERMINAL:
                raise Pmi2Garbled(f"job {job_id} ended {info.get('JobState')}")
            if not cancelled:  # its tasks may hang in MPI_Init
                cancelled = _run(env, "scancel", job_id).returncode == 0
        if info.get("JobState") in until:
            return info
        time.sleep(0.5)
    state = _job(env, job_id).get("JobState")
    _run(env, "scancel", job_id)
    pytest.fail(f"job {job_id} still {state} after {timeout} s\n{_evidence(env, job_id, output)}")


def _evidence(env, job_id, output) -> str:
    """The job's output and what the Slurm daemons logged about it (the cluster is restarted,
    and its logs truncated, by the next test session)."""
    base = job_id.split("_")[0]
    parts = [] if output is None else [f"--- job output ---\n{_output(output, job_id)}"]
    log_dir = pathlib.Path(env.get("MPACCEL_SLURM_DIR", "/nonexistent")) / "log"
    for log in sorted(log_dir.glob("*.log")):
        lines = [line for line in log.read_text(errors="replace").splitlines() if base in line]
        parts.append(f"--- {log.name} (lines naming {base}) ---\n" + "\n".join(lines[-30:]))
    return "\n".join(parts)


def _output(tmp_path, job_id) -> str:
    return "".join(p.read_text() for p in tmp_path.glob(f"*-{job_id}.out"))


def test_srun_layout_on_two_nodes(slurm_env):
    probe = ("from mpaccel import PartialState; s = PartialState(); "
             "print(s.process_index, s.local_process_index, s.node_index, s.num_nodes, "
             "s.num_processes, flush=True)")
    run = _srun(slurm_env, "--mpi=pmi2", "-N", "2", "--ntasks-per-node=2", "python", "-c", probe)
    assert run.returncode == 0, run.stderr
    rows = sorted(tuple(map(int, line.split())) for line in run.stdout.splitlines())
    assert rows == [(0, 0, 0, 2, 4), (1, 1, 0, 2, 4), (2, 0, 1, 2, 4), (3, 1, 1, 2, 4)]


def test_hybrid_shard_trains_across_the_nodes(slurm_env):
    # (which ranks make each mesh group: test_hybrid_shard_save_state_..., below)
    run = _srun(slurm_env, "--mpi=pmi2", "-N", "2", "--ntasks-per-node=2", "python",
                "examples/train_fsdp.py", "--hybrid", "--epochs", "2", "--samples", "512",
                timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "mesh (2, 2) ('dp_replicate', 'dp_shard')" in run.stdout, run.stdout
    # accelerator.print: once per node
    losses = dict(re.findall(r"epoch (\d) loss ([\d.]+)", run.stdout))
    assert len(losses) == 2 and float(losses["1"]) < float(losses["0"]), run.stdout
    assert run.stdout.count("full state dict: 30 tensors, 110400 values") == 1, run.stdout


HSDP_CHECKPOINT = """
import sys
import numpy as np, torch
from mpaccel import Accelerator
from mpaccel.utils import FullyShardedDataParallelPlugin as P

mode, directory = sys.argv[1], sys.argv[2]
hybrid = mode != "load-plain"
acc = Accelerator(fsdp_plugin=P(sharding_strategy="HYBRID_SHARD") if hybrid else None)
torch.manual_seed(7 if mode.startswith("load") else 1)
model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
model, opt = acc.prepare(model, opt)
whole = lambda v: v.full_tensor() if hasattr(v, "full_tensor") else v

def full():
    out = {f"model/{k}": whole(v).detach().clone() for k, v in model.state_dict().items()}
    for pid, state in opt.state_dict()["state"].items():
        out.update({f"optim/{pid}.{k}": whole(v).clone() for k, v in state.items()})
    return out

if mode == "save":
    g = torch.Generator().manual_seed(acc.process_index)  # each rank its own batches
    for _ in range(3):
        x = torch.randn(5, 4, generator=g)
        acc.backward(model(x).square().mean())
        opt.step()
        opt.zero_grad()
    acc.save_state(directory + "/ckpt")
    saved = full()
    if acc.is_main_process:
        np.savez(directory + "/reference.npz", **{k: v.numpy() for k, v in saved.items()})
    print("saved", acc.num_processes, tuple(acc.torch_device_mesh.mesh.shape), flush=True)
    mesh = acc.torch_device_mesh
    print("mesh", acc.process_index, mesh["dp_shard"].mesh.tolist(),
          mesh["dp_replicate"].mesh.tolist(), tuple(model[0].weight.to_local().shape), flush=True)
else:
    # a fresh optimizer has no state to load into yet: give it some, then load over it
    acc.backward(model(torch.ones(1, 4)).sum())
    opt.step()
    opt.zero_grad()
    acc.load_state(directory + "/ckpt")
    expected = np.load(directory + "/reference.npz")
    got = full()
    assert sorted(got) == sorted(expected.files), (sorted(got), expected.files)
    for key in got:
        assert np.array_equal(got[key].numpy(), expected[key]), key
    print("equal", acc.process_index, acc.num_processes, flush=True)
"""


def test_hybrid_shard_save_state_loads_at_one_process_and_at_two_by_two(slurm_env, tmp_path):
    # saved by 2 nodes x 2 tasks under HYBRID_SHARD (each node's first replica writes the rows);
    # loaded by the same layout, and by one process (HSDP of one, and plain): the same state
    script = tmp_path / "hsdp_checkpoint.py"
    script.write_text(HSDP_CHECKPOINT)
    layout = ("--mpi=pmi2", "-N", "2", "--ntasks-per-node=2")
    run = _srun(slurm_env, *layout, "python", str(script), "save", str(tmp_path), timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "saved 4 (2, 2)" in run.stdout, run.stdout
    # HYBRID_SHARD shards within each node (ranks 0,1 | 2,3) and replicates across them
    # (0,2 | 1,3), from discovery's node facts: nothing here names the layout
    rows = sorted(line.split(" ", 2)[1:] for line in run.stdout.splitlines()
                  if line.startswith("mesh "))
    assert rows == [["0", "[0, 1] [0, 2] (3, 4)"], ["1", "[0, 1] [1, 3] (3, 4)"],
                    ["2", "[2, 3] [0, 2] (3, 4)"], ["3", "[2, 3] [1, 3] (3, 4)"]], run.stdout
    import json

    index = json.loads((tmp_path / "ckpt" / "sharded.index.json").read_text())
    slices = index["sliced"]["model_0/0.weight"]["slices"]
    assert [(p["start"], p["stop"]) for p in slices] == [(0, 3), (3, 6)]  # one replica's rows
    run = _srun(slurm_env, *layout, "python", str(script), "load", str(tmp_path), timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(re.findall(r"equal \d 4", run.stdout)) == [f"equal {r} 4" for r in range(4)]
    for mode in ("load", "load-plain"):
        run = _srun(slurm_env, "--mpi=pmi2", "-N", "1", "-n", "1", "python", str(script), mode,
                    str(tmp_path), timeout=240)
        assert run.returncode == 0, run.stderr[-3000:]
        assert "equal 0 1" in run.stdout, run.stdout


def test_ofi_with_the_progress_thread_trains_across_two_nodes(slurm_env):
    # The way round the pmi2 bug that docs/slurm.md gives: MPICH's libfabric netmod (its address
    # fits in one short PMI request) and mpaccel's progress thread (without it this run hung).
    env = {**slurm_env, "MPIR_CVAR_CH4_NETMOD": "ofi", "MPACCEL_MPI_PROGRESS": "1"}
    run = _run(env, "srun", "--kill-on-bad-exit=1", "--mpi=pmi2", "-N", "2",
               "--ntasks-per-node=1", "python", "examples/train.py", "--epochs", "2",
               "--train-samples", "2000", timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("2 process(es) on 2 node(s)") == 2  # once per node
    assert run.stdout.count("done in") == 2, run.stdout


def test_srun_without_mpi_plugin_fails_fast_with_hint(slurm_env):
    start = time.monotonic()
    run = _run(slurm_env, "srun", "--mpi=none", "-n", "2", "python", "-c",
               "from mpaccel import PartialState; PartialState()")
    assert run.returncode != 0
    assert "silent singletons" in run.stderr and "srun --mpi=pmi2" in run.stderr
    assert time.monotonic() - start < 60


def test_procid_expanded_by_the_batch_shell(slurm_env, tmp_path):
    # Double quotes: the batch shell expands $SLURM_PROCID (to 0) before srun starts the tasks.
    script = tmp_path / "bad.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        'srun --mpi=pmi2 -n 2 bash -c "SLURM_PROCID=$SLURM_PROCID python -c '
        "'from mpaccel import PartialState; PartialState()'\"\n"
    )
    result = _run(slurm_env, "sbatch", "--parsable", "-n", "2",
                  f"--output={tmp_path}/%x-%j.out", str(script))
    job = result.stdout.strip()
    info = _wait(slurm_env, job, output=tmp_path)
    assert info["JobState"] == "FAILED"
    text = _output(tmp_path, job)
    assert "SLURM_PROCID repeats" in text and "single quotes" in text


@pytest.mark.parametrize(("template", "expect"), [
    ("single_node.sbatch", "4 process(es) on 1 node(s)"),
    ("multi_node.sbatch", "4 process(es) on 2 node(s)"),
])
def test_templates_run_the_example(slurm_env, tmp_path, template, expect):
    def once(attempt):
        job = _submit(_attempt_env(slurm_env, attempt), tmp_path, template, "--epochs", "2",
                      "--train-samples", "2000")
        return job, _wait(slurm_env, job, output=tmp_path)
    job, info = _retrying(once)
    text = _output(tmp_path, job)
    assert info["JobState"] == "COMPLETED", text
    assert expect in text and "final parameter digest" in text


def test_array_sweep(slurm_env, tmp_path):
    def once(attempt):
        shutil.rmtree(tmp_path / "sweep", ignore_errors=True)
        job = _submit(_attempt_env(slurm_env, attempt), tmp_path, "array.sbatch", "--epochs",
                      "1", "--train-samples", "1000",
                      options=["--array=0-1", f"--output={tmp_path}/%x-%A_%a.out",
                               f"--export=ALL,SWEEP_DIR={tmp_path}/sweep"])
        for task in ("0", "1"):
            info = _wait(slurm_env, f"{job}_{task}", output=tmp_path)
            assert info["JobState"] == "COMPLETED"
        return job
    job = _retrying(once)
    outputs = [p.read_text() for p in sorted(tmp_path.glob(f"*-{job}_*.out"))]
    assert len(outputs) == 2 and all("final parameter digest" in o for o in outputs)
    assert "lr 1e-3" in outputs[0] and "lr 3e-3" in outputs[1]
    assert sorted(os.listdir(tmp_path / "sweep")) == ["lr-1e-3", "lr-3e-3"]


def test_preemption_checkpoints_requeues_and_resumes_exactly(slurm_env, tmp_path):
    # The uninterrupted run, same arguments, same number of processes.
    reference = _srun(slurm_env, "--mpi=pmi2", "-n", "2", "python", "examples/train.py",
                      *TRAIN_ARGS, timeout=300)
    assert reference.returncode == 0, reference.stderr
    expected = re.search(r"final parameter digest (\S+) after (\d+) steps", reference.stdout)
    assert expected

    project = tmp_path / "project"
    job = _submit(slurm_env, tmp_path, "preemptible.sbatch", *TRAIN_ARGS, "--step-delay", "0.05",
                  options=["--ntasks=2", f"--export=ALL,PROJECT_DIR={project}"])
    deadline = time.monotonic() + 120
    while "epoch   0" not in _output(tmp_path, job):  # training is under way
        assert time.monotonic() < deadline, _output(tmp_path, job)
        assert _job(slurm_env, job).get("JobState") in ("PENDING", "RUNNING", "CONFIGURING")
        time.sleep(0.2)
    signalled = _run(slurm_env, "scancel", "--signal=USR1", job)
    assert signalled.returncode == 0, signalled.stderr
    info = _wait(slurm_env, job, timeout=300, output=tmp_path,
                 until={"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"})
    text = _output(tmp_path, job)
    assert info["JobState"] == "COMPLETED", text
    assert int(info.get("Restarts", "0")) == 1, text
    assert "SIGUSR1 received: stopping" in text and "job requeued" in text
    assert "resumed at epoch" in text and "(restart 1)" in text
    assert f"final parameter digest {expected.group(1)} after {expected.group(2)} steps" in text
    assert os.path.isdir(project / "checkpoints")


def test_known_pmi2_bug_is_told_apart_and_cancelled(slurm_env, tmp_path):
    # A job showing the bug's mark is cancelled at once (its tasks may hang in MPI_Init) and
    # reported as the bug; a job failing otherwise is not.
    script = tmp_path / "garbled.sbatch"
    script.write_text(f"#!/bin/bash\necho 'slurmstepd-n1: error: {PMI2_GARBLED}' >&2\nsleep 300\n")
    job = _submit(slurm_env, tmp_path, str(script))
    start = time.monotonic()
    with pytest.raises(Pmi2Garbled):
        _wait(slurm_env, job, output=tmp_path)
    assert time.monotonic() - start < 60
    assert _job(slurm_env, job).get("JobState") == "CANCELLED"

    plain = tmp_path / "fails.sbatch"
    plain.write_text("#!/bin/bash\necho 'some other error' >&2\nexit 3\n")
    info = _wait(slurm_env, _submit(slurm_env, tmp_path, str(plain)), output=tmp_path)
    assert info["JobState"] == "FAILED"
