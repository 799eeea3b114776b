"""Checkpoints across whole jobs: another world size, a job killed in the middle of a save,
a full disk. Driven from the size-1 pass with real mpiexec runs."""

from __future__ import annotations

import ctypes
import os
import random
import select
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from mpaccel import envvars
from mpaccel.checkpoint import CheckpointReader, checkpoints_in, latest_checkpoint
from mpaccel.testing import run_mpi
from mpaccel.testing.launch import (
    kill_alive,
    kill_ranks,
    mpiexec_command,
    rank_pids,
    wait_gone,
)

pytestmark = [pytest.mark.mpi(size=1), pytest.mark.launches]

COMMON = """
import sys, torch
from torch.utils.data import DataLoader, TensorDataset
from mpaccel import Accelerator
from mpaccel.utils import ProjectConfiguration

def build(**kwargs):
    acc = Accelerator(**kwargs)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    data = TensorDataset(torch.randn(96, 8, generator=torch.Generator().manual_seed(1)),
                         torch.randn(96, 1, generator=torch.Generator().manual_seed(2)))
    loader = DataLoader(data, batch_size=24 // acc.num_processes)
    return (acc, *acc.prepare(model, opt, sched, loader))

def digest(acc, model):
    total = sum(p.double().sum().item() for p in acc.unwrap_model(model).parameters())
    return repr(round(total, 10))
"""


def _write(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(textwrap.dedent(COMMON) + textwrap.dedent(body))
    return str(path)


def test_save_at_four_load_at_one_and_two(tmp_path):
    saver = _write(tmp_path, "save.py", """
        acc, model, opt, sched, loader = build()
        for step, (x, y) in enumerate(loader):
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step(); sched.step(); opt.zero_grad()
            if step == 1:
                acc.save_state(sys.argv[1])
                print(digest(acc, model), sched.get_last_lr()[0])
                break
    """)
    loader_script = _write(tmp_path, "load.py", """
        import warnings
        warnings.simplefilter("always")
        acc, model, opt, sched, loader = build()
        acc.load_state(sys.argv[1])
        batches = sum(1 for _ in loader)   # the rest of the interrupted epoch
        print(digest(acc, model), sched.get_last_lr()[0], batches)
    """)
    target = str(tmp_path / "ckpt")
    saved = run_mpi([saver, target], n=4, timeout=180).check()
    digest, lr = saved.stdout[0].split()
    assert all(out.split() == [digest, lr] for out in saved.stdout)
    with CheckpointReader(target, "state") as reader:
        assert reader.world_size == 4 and reader.verify() == []
    # The loads only read: one job per size, both at once (each spends much of its time
    # starting up and waiting on the other ranks, which one after another summed).
    sizes = (1, 2)
    with ThreadPoolExecutor(len(sizes)) as pool:
        runs = list(pool.map(lambda n: run_mpi([loader_script, target], n=n, timeout=180), sizes))
    for run in runs:
        run.check()
        # two global batches of 24 of 96 were consumed: two of four remain, whatever n is
        assert run.stdout[0].split() == [digest, lr, "2"], run.describe()
        assert "per-process RNG states were not" in run.stderr[0]


CRASH_JOB = """
    import os
    acc = Accelerator(project_config=ProjectConfiguration(
        project_dir=sys.argv[1], automatic_checkpoint_naming=True, total_limit=3))
    big = acc.prepare(torch.nn.Linear(2048, 2048))   # 16 MiB of weights: a save takes a while
    inner = acc.unwrap_model(big)
    for i in range(1000):
        with torch.no_grad():
            inner.weight.fill_(float(i)); inner.bias.fill_(float(i))
        acc.save_state()
        print("saved", i, flush=True)
"""


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.13, 0.31])
def test_job_killed_during_save_leaves_last_checkpoint_loadable(tmp_path, delay):
    script = _write(tmp_path, "crash.py", CRASH_JOB)
    project = tmp_path / "project"
    outdir = tmp_path / "out"
    outdir.mkdir()
    argv, extra = mpiexec_command(2)
    proc = subprocess.Popen(
        [*argv, sys.executable, "-m", "mpaccel.testing.rankio", str(outdir), script, str(project)],
        env=envvars.child_environment(extra), start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while "saved 2" not in _read(outdir / "rank-0.out"):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("the job ended or stalled before its third save:\n"
                            + _read(outdir / "rank-0.err") + _read(outdir / "rank-1.err"))
            time.sleep(0.01)
        time.sleep(delay)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        # MPICH puts each rank in a session of its own, out of reach of the group kill: its proxy
        # kills them a moment later. Kill them now and wait until they are gone, so that no
        # writer still runs while the checkpoint is read, and none runs into later tests.
        left_running = wait_gone(kill_ranks(outdir), 30)
    assert len(rank_pids(outdir)) == 2 and left_running == [], left_running
    latest = latest_checkpoint(str(project))
    assert latest is not None
    number, path = latest
    with CheckpointReader(path, "state") as reader:
        assert reader.verify() == []
        weight = reader.component("model_0")["weight"]
    assert torch.all(weight == float(number))  # the checkpoint is whole, not half old/half new
    # anything newer is debris without an index, never taken for a checkpoint
    newer = [d for d in os.listdir(project / "checkpoints") if int(d.split("_")[1]) > number]
    for name in newer:
        assert not os.path.exists(project / "checkpoints" / name / "state.index.json")


def _read(path) -> str:
    return path.read_text() if path.exists() else ""


@pytest.fixture
def tiny_disk(tmp_path):
    mount = tmp_path / "tiny"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        if envvars.get("ci"):
            pytest.fail(f"cannot mount a tmpfs in CI: {result.stderr}")
        pytest.skip(f"needs root to mount a small tmpfs: {result.stderr.strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def test_disk_full_is_an_error_on_every_rank(tmp_path, tiny_disk):
    script = _write(tmp_path, "full.py", """
        from mpaccel import CollectiveError
        acc = Accelerator()
        model = acc.prepare(torch.nn.Linear(256, 1024))   # 1 MiB: does not fit in 256 KiB
        try:
            acc.save_model(model, sys.argv[1], max_shard_size="300KB", safe_serialization=False)
        except CollectiveError as exc:
            print("raised", exc.failed_ranks, "No space left" in str(exc))
    """)
    run = run_mpi([script, str(tiny_disk / "model")], n=2, timeout=120).check()
    assert run.stdout[0].split("raised")[1].strip().endswith("True")
    assert run.stdout[0] == run.stdout[1]
    leftovers = os.listdir(tiny_disk / "model") if (tiny_disk / "model").exists() else []
    assert leftovers == [], leftovers  # no partial shard, no index


@pytest.mark.parametrize("n", [1, 2])
def test_a_script_ending_right_after_an_async_save_commits_it(tmp_path, n):
    script = _write(tmp_path, "async_end.py", """
        acc = Accelerator()
        model = acc.prepare(torch.nn.Linear(1024, 2048))   # 8 MiB: the save outlives the script
        with torch.no_grad():
            acc.unwrap_model(model).weight.fill_(3.0)
        acc.save_state(sys.argv[1], async_save=True)
        if len(sys.argv) > 2:                              # a save that fails, never waited for
            acc.save_state(sys.argv[2], async_save=True)
        print("ended", flush=True)
    """)
    target = tmp_path / "ckpt"
    run = run_mpi([script, str(target)], n=n, timeout=180).check()
    assert list(run.stdout) == ["ended\n"] * n, run.describe()
    with CheckpointReader(str(target), "state") as reader:
        assert reader.verify() == []
        assert reader.component("model_0")["weight"].eq(3.0).all()
    # A failing background save that the script never waited for: every rank says so on stderr
    # and exits non-zero, instead of ending with status 0 as if the checkpoint were there.
    (tmp_path / "afile").write_text("x")
    run = run_mpi([script, str(tmp_path / "ok"), str(tmp_path / "afile" / "ckpt")], n=n,
                  timeout=180)
    assert run.returncode != 0, run.describe()
    assert "the background save_state(async_save=True) failed" in "".join(run.stderr), (
        run.describe()
    )
    assert (tmp_path / "ok" / "state.index.json").exists()  # the first one was committed


def test_batches_of_no_fixed_size_resume_at_another_world_size(tmp_path):
    # A batch sampler without a batch_size: the position is counted in global batches. Saved at
    # n=2 after one round (global batches 0 and 1), loaded at n=1: the rest are batches 2..5.
    body = """
        from mpaccel.utils import ProjectConfiguration
        BATCHES = [[0, 1, 2], [3, 4], [5, 6, 7, 8], [9], [10, 11], [12]]
        acc = Accelerator()
        data = TensorDataset(torch.arange(13))
        loader = acc.prepare(DataLoader(data, batch_sampler=BATCHES))
        if sys.argv[2] == "save":
            for (x,) in loader:
                acc.save_state(sys.argv[1])
                break
        else:
            acc.load_state(sys.argv[1])
            print([x.tolist() for (x,) in loader])
    """
    script = _write(tmp_path, "variable.py", body)
    run_mpi([script, str(tmp_path / "ckpt"), "save"], n=2, timeout=180).check()
    run = run_mpi([script, str(tmp_path / "ckpt"), "load"], n=1, timeout=180).check()
    assert run.stdout[0].strip() == "[[5, 6, 7, 8], [9], [10, 11], [12]]", run.describe()


# -- a rank whose file system stops answering ------------------------------------------------------

# Holds a write lease on a file (fcntl F_SETLEASE): another process that opens it then blocks in
# open(2), inside the kernel, until the lease is given up (or /proc/sys/fs/lease-break-time,
# 45 s by default, runs out), as on a network file system that stopped answering. The reader's
# own code path runs as it is: nothing in mpaccel is replaced.
LEASE_HOLDER = """
import fcntl, os, signal, sys
signal.signal(signal.SIGIO, signal.SIG_IGN)  # told that someone waits: keep the lease anyway
fd = os.open(sys.argv[1], os.O_WRONLY)
fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
print("leased", flush=True)
sys.stdin.read()  # until the test closes our stdin
"""

HUNG = """
    from mpaccel import CollectiveError
    acc, model, opt, sched, loader = build()
    before = digest(acc, model)
    try:
        if sys.argv[2] == "save":
            acc.save_state(sys.argv[1])
        else:
            acc.load_state(sys.argv[1])
        print("done", flush=True)
    except CollectiveError as exc:
        text = str(exc)
        print("failed", exc.failed_ranks, before == digest(acc, model),
              "no checkpoint I/O of this process ended" in text, sys.argv[3] in text, flush=True)
"""


@pytest.mark.parametrize("n", [1, 2])
def test_a_rank_whose_file_system_hangs_fails_the_load_under_the_timeout(tmp_path, n):
    """The last rank's open() of its own file blocks in the kernel: that rank reports it after
    the collective timeout (less a margin), naming the file, and every rank raises the same
    error naming that rank, the model as it was. It hung in open() (killed after 45 s), the
    other ranks timed out in the next collective without a word about the file."""
    script = _write(tmp_path, "hung.py", HUNG)
    target = tmp_path / "ckpt"
    stuck = n - 1
    name = f"rank{stuck:05d}.h5"
    run_mpi([script, str(target), "save", name], n=n, timeout=180).check()
    rank_file = next(target.glob(f"state-*-{name}"))
    holder = subprocess.Popen([sys.executable, "-c", LEASE_HOLDER, str(rank_file)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "leased"
        run = run_mpi([script, str(target), "load", name], n=n, timeout=120,
                      env={"MPACCEL_TIMEOUT": "8"})
    finally:
        holder.stdin.close()
        holder.wait(30)
    assert run.returncode == 0, run.describe()
    assert [out.split() for out in run.stdout] == [
        ["failed", f"[{stuck}]", "True", "True", "True"]] * n, run.describe()


@pytest.fixture
def freezable_disk(tmp_path):
    """An ext4 file system of its own (a loop device) that the test can freeze (fsfreeze):
    every write to it then blocks in the kernel until it is thawed."""
    image, mount = tmp_path / "disk.img", tmp_path / "disk"
    mount.mkdir()
    with open(image, "wb") as f:
        f.truncate(64 << 20)
    steps = [["mkfs.ext4", "-q", str(image)], ["mount", "-o", "loop", str(image), str(mount)]]
    for step in steps:
        result = subprocess.run(step, capture_output=True, text=True)
        if result.returncode != 0:
            if envvars.get("ci"):
                pytest.fail(f"cannot make a loop file system in CI: {result.stderr}")
            pytest.skip(f"needs root and loop devices: {' '.join(step)}: {result.stderr}")
    yield mount
    subprocess.run(["fsfreeze", "-u", str(mount)], capture_output=True)
    subprocess.run(["umount", str(mount)], check=False)


def test_a_rank_whose_file_system_hangs_fails_the_save_under_the_timeout(
    tmp_path, freezable_disk
):
    """Rank 0 creates the checkpoint's directory on a file system that stopped answering: it
    reports after the collective timeout (less a margin) and every rank raises naming it. It
    hung in mkdir() until the file system came back, the others timed out in the next
    collective and aborted the job."""
    script = _write(tmp_path, "hung.py", HUNG)
    target = freezable_disk / "ckpt"
    outdir = tmp_path / "out"
    outdir.mkdir()
    argv, extra = mpiexec_command(2)
    subprocess.run(["fsfreeze", "-f", str(freezable_disk)], check=True)
    try:
        proc = subprocess.Popen(
            [*argv, sys.executable, "-m", "mpaccel.testing.rankio", str(outdir), script,
             str(target), "save", repr(str(target))],
            env=envvars.child_environment({**extra, "MPACCEL_TIMEOUT": "8"}),
            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        # A rank whose thread is held in the kernel cannot exit until the file system thaws:
        # wait for what the ranks print, then thaw, then for the job to end.
        deadline = time.monotonic() + 120
        outputs = [outdir / f"rank-{r}.out" for r in range(2)]
        while not all(_read(o).strip() for o in outputs) and proc.poll() is None:
            assert time.monotonic() < deadline, "the save never ended"
            time.sleep(0.05)
    finally:
        subprocess.run(["fsfreeze", "-u", str(freezable_disk)], capture_output=True)
    try:
        proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        wait_gone(kill_ranks(outdir), 30)
    assert [_read(o).split() for o in outputs] == [["failed", "[0]", "True", "True", "True"]] * 2, (
        _read(outdir / "rank-0.err") + _read(outdir / "rank-1.err"))


# -- killed during rotation ------------------------------------------------------------------------

ROTATION_JOB = """
    import os, uuid
    limit, files, async_save = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "async"
    acc = Accelerator(project_config=ProjectConfiguration(
        project_dir=sys.argv[1], automatic_checkpoint_naming=True, total_limit=limit))
    model = acc.prepare(torch.nn.Linear(64, 64))
    inner = acc.unwrap_model(model)
    for i in range(100000):
        with torch.no_grad():
            inner.weight.fill_(float(i)); inner.bias.fill_(float(i))
        directory = acc.save_state(async_save=async_save)
        acc.wait_for_checkpoint()
        if acc.is_main_process:
            # files of the user's own beside the state (samples, a config...): rotation deletes
            # them with the checkpoint, which makes deleting one take a while
            for _ in range(files):
                open(os.path.join(directory, uuid.uuid4().hex), "w").close()
        acc.wait_for_everyone()
        print("saved", i, flush=True)
"""


def _first_deletion_in(directory, timeout):
    """Wait until something in `directory` is deleted (inotify): True, or False after
    `timeout` seconds. Only watches: the job's own code runs as it is."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = libc.inotify_init1(os.O_NONBLOCK)
    if fd < 0:
        pytest.skip(f"inotify: {os.strerror(ctypes.get_errno())}")
    try:
        if libc.inotify_add_watch(fd, os.fsencode(directory), 0x200 | 0x400) < 0:  # DELETE(_SELF)
            return True  # gone already
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


def test_a_job_killed_during_rotation_keeps_every_complete_checkpoint_loadable(tmp_path):
    """total_limit=3, n=2, sync and async saves in a loop, kill -9 of every rank or of rank 0
    alone (the one that rotates): a third of the trials at a random moment of the loop, the
    others at a random moment just after rotation began deleting the oldest checkpoint. Each
    time, every checkpoint that checkpoints_in() calls complete verifies and holds its own
    step, the newest one is the one latest_checkpoint() names, and 2 or 3 of them remain.
    Rotation deleted a checkpoint's files in directory order (a kill in the middle left an
    index naming a shard that was gone, still called complete), and only once the new one was
    committed (a kill meanwhile left 4)."""
    limit = 3
    script = _write(tmp_path, "rotate.py", ROTATION_JOB)
    seed = time.time_ns()
    rng = random.Random(seed)
    argv, extra = mpiexec_command(2)
    budget = time.monotonic() + 15  # at least 5 trials, more while 15 s last
    trials = 0
    while trials < 5 or time.monotonic() < budget:
        project, outdir = tmp_path / f"project{trials}", tmp_path / f"out{trials}"
        outdir.mkdir()
        mode = "async" if trials % 4 >= 2 else "sync"
        in_rotation = trials % 3 != 2
        trial = f"trial {trials} ({mode}, {'in rotation' if in_rotation else 'any time'}, " \
                f"seed {seed})"
        proc = subprocess.Popen(
            [*argv, sys.executable, "-m", "mpaccel.testing.rankio", str(outdir), script,
             str(project), str(limit), "300", mode],
            env=envvars.child_environment(extra), start_new_session=True,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 120
            while f"saved {limit}" not in _read(outdir / "rank-0.out"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"{trial}: the job ended or stalled before its checkpoints "
                                "were made:\n" + _read(outdir / "rank-0.err")
                                + _read(outdir / "rank-1.err"))
                time.sleep(0.01)
            if in_rotation:
                oldest = next(p for _, p, ok in checkpoints_in(str(project)) if ok)
                assert _first_deletion_in(oldest, 60), f"{trial}: {oldest} never rotated"
                time.sleep(rng.uniform(0.0, 0.008))
            else:
                time.sleep(rng.uniform(0.0, 0.4))
        finally:
            # The ranks themselves, at once (each is in a session of its own: a kill of the
            # launcher's group reaches them only through its proxy, a moment later).
            ranks = rank_pids(outdir)
            if rng.random() < 0.5:  # rank 0 alone: the one that rotates
                pid, start = map(int, _read(outdir / "rank-0.pid").split())
                ranks = {pid: start}
            kill_alive(ranks)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            left_running = wait_gone(kill_ranks(outdir), 30)
        assert left_running == [], left_running
        complete = [(n, path) for n, path, ok in checkpoints_in(str(project)) if ok]
        for number, path in complete:
            with CheckpointReader(path, "state") as reader:
                assert reader.verify() == [], (trial, path)
                assert torch.all(reader.component("model_0")["weight"] == float(number)), trial
        assert limit - 1 <= len(complete) <= limit, (trial, complete)
        assert latest_checkpoint(str(project)) == complete[-1], trial
        trials += 1
