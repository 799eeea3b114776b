"""`mpaccel env`: the report format pinned by golden files, and the command run for real at size 1,
under mpiexec -n 2, and after a launch mistake."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from mpaccel import envvars
from mpaccel.cli import main, render_env_report
from mpaccel.environments import SlurmFacts
from mpaccel.testing import run_mpi

GOLDEN = Path(__file__).parent / "golden"


def _common(**overrides):
    facts = {
        "mpaccel": "0.1.0",
        "python": "3.11.7 (CPython, /opt/venv/bin/python)",
        "platform": "Linux-5.14.0-x86_64-with-glibc2.34",
        "launch_problem": None,
        "warnings": [],
        "rank": 0,
        "mpi": {
            "MPI4PY_LIBMPI": None,
            "library": "MPICH Version: 5.0.2",
            "standard": "5.0",
            "mpi4py": "4.1.2",
            "extension": "MPI.mpich.cpython-311-x86_64-linux-gnu.so",
            "libmpi": "/opt/venv/lib/libmpi.so.12",
            "config": {},
        },
        "torch": {
            "version": "2.13.0+cu126",
            "cuda_build": "12.6",
            "cuda_available": True,
            "device_count": 2,
            "nccl": "2.26.2",
            "gloo": True,
        },
        "h5py": {"version": "3.16.0", "hdf5": "2.0.0", "mpi": False},
        "numpy": "2.4.6",
        "hostlist": "2.3.0",
    }
    facts.update(overrides)
    return facts


def _row(rank, host, local, node, pid, visible, device):
    return {
        "rank": rank,
        "host": host,
        "local_rank": local,
        "node": node,
        "pid": pid,
        "cuda_visible_devices": visible,
        "device": device,
    }


def two_nodes_in_slurm():
    env = {
        "SLURM_JOB_ID": "812345",
        "SLURM_ARRAY_JOB_ID": "812340",
        "SLURM_ARRAY_TASK_ID": "5",
        "SLURM_STEP_ID": "0",
        "SLURM_NTASKS": "4",
        "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_STEP_NODELIST": "gpu[07-08]",
        "SLURM_TASKS_PER_NODE": "2(x2)",
        "SLURM_RESTART_COUNT": "1",
        "SLURM_MPI_TYPE": "pmi2",
    }
    return _common(
        launcher={"name": "Slurm srun", "expected": 4},
        warnings=["the job has 8 task slot(s) but this step runs 4 process(es)"],
        slurm=dataclasses.asdict(SlurmFacts.from_env(env)),
        ranks=[
            _row(0, "gpu07", 0, 0, 40211, "0,1", "cuda:0"),
            _row(1, "gpu07", 1, 0, 40212, "0,1", "cuda:1"),
            _row(2, "gpu08", 0, 1, 51877, "0,1", "cuda:0"),
            _row(3, "gpu08", 1, 1, 51878, "0,1", "cuda:1"),
        ],
    )


def single_without_slurm():
    return _common(
        launcher={"name": "single process (no launcher)", "expected": 1},
        slurm=None,
        ranks=[_row(0, "laptop", 0, 0, 4242, None, "cpu")],
        torch={
            "version": "2.13.0+cpu",
            "cuda_build": None,
            "cuda_available": False,
            "device_count": 0,
            "nccl": None,
            "gloo": True,
        },
    )


def launch_problem_without_libmpi():
    return _common(
        launcher={"name": "Open MPI mpirun", "expected": 4},
        slurm=None,
        ranks=[],
        launch_problem={
            "message": "Open MPI mpirun started 4 processes but mpi4py cannot load an MPI "
            "library: cannot load MPI library",
            "hint": "install one into the environment (`pip install mpich`), or point mpi4py at "
            "the cluster's: MPI4PY_LIBMPI=/path/to/libmpi.so.",
        },
        mpi={"MPI4PY_LIBMPI": "/nowhere/libmpi.so", "error": "cannot load MPI library"},
        h5py={"error": "No module named 'h5py'"},
    )


@pytest.mark.parametrize(
    "name, facts",
    [
        ("env_report.txt", two_nodes_in_slurm),
        ("env_single.txt", single_without_slurm),
        ("env_launch_problem.txt", launch_problem_without_libmpi),
    ],
)
def test_report_matches_golden_file(name, facts):
    # On an intended format change, edit the golden file by hand and review the diff.
    assert render_env_report(facts()) == (GOLDEN / name).read_text()


def _python_m_mpaccel(*args, extra_env=None):
    return subprocess.run(
        [sys.executable, "-m", "mpaccel", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=envvars.child_environment(extra_env),
    )


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "env" in capsys.readouterr().err


@pytest.mark.mpi(size=1)
@pytest.mark.launches
def test_env_at_size_one():
    import torch

    run = _python_m_mpaccel("env")
    assert run.returncode == 0, run.stderr
    assert "single process (no launcher)" in run.stdout
    assert f"torch                {torch.__version__}" in run.stdout
    assert "ranks (1 process on 1 node)" in run.stdout
    assert "launch problem" not in run.stdout


@pytest.mark.mpi(size=1)
@pytest.mark.launches
def test_env_under_mpiexec_prints_one_table_on_rank_zero():
    run = run_mpi(["-m", "mpaccel", "env"], n=2, timeout=120).check()
    out = run.stdout[0]
    assert "ranks (2 processes on 1 node)" in out
    table = out.split("ranks (2 processes on 1 node)")[1].split("\n\n")[0].splitlines()[2:]
    assert [line.split()[0] for line in table] == ["rank", "0", "1"]
    assert len({line.split()[4] for line in table[1:]}) == 2  # two different pids
    assert run.stdout[1] == ""


@pytest.mark.mpi(size=1)
@pytest.mark.launches
def test_env_names_the_launcher_of_the_library_not_a_leftover_one():
    # An Open MPI variable left over in hydra's ranks: the report said "Open MPI mpirun, 4",
    # while its own warning (and PartialState) said hydra started 2.
    run = run_mpi(["-m", "mpaccel", "env"], n=2, timeout=120,
                  env={"OMPI_COMM_WORLD_SIZE": "4"}).check()
    launcher = run.stdout[0].split("launcher\n--------\n")[1].split("\n\n")[0]
    assert "MPICH hydra mpiexec" in launcher and "Open MPI" not in launcher, launcher
    assert launcher.splitlines()[1].split()[-1] == "2", launcher


@pytest.mark.mpi(size=1)
@pytest.mark.launches
def test_launch_mistake_is_reported_with_exit_1():
    # The Open MPI launcher says 4 processes; mpi4py loads MPICH, which sees a world of 1.
    run = _python_m_mpaccel("env", extra_env={"OMPI_COMM_WORLD_SIZE": "4"})
    assert run.returncode == 1, run.stdout + run.stderr
    problem = run.stdout.split("launch problem\n--------------\n")[1].split("\n\n")[0]
    assert "silent singletons" in problem
    assert "HINT:" in problem and "MPI4PY_LIBMPI" in problem
    assert "MPICH Version" in run.stdout  # the rest of the report is still there


@pytest.mark.mpi(size=1)
@pytest.mark.launches
def test_pmix_launch_of_mpich_is_reported_not_aborted():
    # What Open MPI's mpirun gives each process (measured): mpi4py loading the pip MPICH there
    # must not reach MPI_Init (it aborts with "unsupported PMI version PMIx", no report at all).
    run = _python_m_mpaccel("env", extra_env={
        "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0", "PMIX_RANK": "0",
        "PMIX_NAMESPACE": "prterun-vm-18091@1", "PRTE_LAUNCHED": "1"})
    assert run.returncode == 1, run.stdout + run.stderr
    problem = run.stdout.split("launch problem\n--------------\n")[1].split("\n\n")[0]
    assert "a PMIx launcher started this process" in problem
    assert "HINT:" in problem and "MPI4PY_LIBMPI=libmpi.so.40" in problem
    assert "MPICH Version" in run.stdout


@pytest.mark.mpi(size=1)
@pytest.mark.launches
def test_unloadable_mpi_library_is_reported():
    # With no launcher, a job without MPI still runs as one process: the report says why MPI
    # is missing, and the launch itself is not a problem.
    run = _python_m_mpaccel("env", extra_env={"MPI4PY_LIBMPI": "/nonexistent/libmpi.so"})
    assert run.returncode == 0, run.stdout + run.stderr
    mpi = run.stdout.split("MPI\n---\n")[1].split("\n\n")[0]
    assert "MPI4PY_LIBMPI        /nonexistent/libmpi.so" in mpi
    assert "mpi4py cannot load an MPI library" in mpi
    assert "HINT: `pip install mpich`" in mpi
    assert "launch problem" not in run.stdout
    # Under a launcher that started 4 processes, the same is a launch problem.
    run = _python_m_mpaccel("env", extra_env={"MPI4PY_LIBMPI": "/nonexistent/libmpi.so",
                                              "OMPI_COMM_WORLD_SIZE": "4"})
    assert run.returncode == 1, run.stdout + run.stderr
    assert "launch problem" in run.stdout and "cannot load an MPI library" in run.stdout


# -- mpaccel --version, mpaccel slurm template -----------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = ["array", "gpu", "multi_node", "preemptible", "single_node"]


def test_version(capsys):
    from mpaccel import __version__

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"mpaccel {__version__}\n"


@pytest.mark.parametrize("name", TEMPLATES)
def test_slurm_template_matches_golden_file(name, capsys):
    # On an intended change, edit mpaccel/templates/slurm/, regenerate the golden file and
    # slurm/ (docs/slurm.md says how) and review the diff.
    assert main(["slurm", "template", name]) == 0
    text = capsys.readouterr().out
    assert text == (GOLDEN / "slurm" / f"{name}.sbatch").read_text()
    assert "python -m mpaccel.examples.train" in text and "# module load " in text


@pytest.mark.parametrize("name", TEMPLATES)
def test_the_checkouts_slurm_scripts_are_the_templates_running_examples_train(name, capsys):
    assert main(["slurm", "template", name, "--script", "examples/train.py"]) == 0
    assert capsys.readouterr().out == (ROOT / "slurm" / f"{name}.sbatch").read_text()


def test_slurm_template_list_and_mistakes(capsys):
    assert main(["slurm", "template", "--list"]) == 0
    assert capsys.readouterr().out == (GOLDEN / "slurm" / "template_list.txt").read_text()
    assert main(["slurm", "template", "single"]) == 2
    err = capsys.readouterr().err
    assert "no template named 'single'" in err and "single_node" in err and "HINT" in err
    assert main(["slurm", "template"]) == 2 and "--list" in capsys.readouterr().err
    assert main(["slurm"]) == 2 and "template" in capsys.readouterr().err


def test_slurm_template_runs_the_script_or_module_named(capsys):
    main(["slurm", "template", "single_node", "--script", "my dir/train.py"])
    assert "--kill-on-bad-exit=1 python 'my dir/train.py' \"$@\"\n" in capsys.readouterr().out
    main(["slurm", "template", "array", "--module", "project.train"])
    assert "python -m project.train \\\n    --lr" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["slurm", "template", "gpu", "--script", "a.py", "--module", "b"])


@pytest.mark.mpi(size=1)
def test_rendered_templates_are_valid_bash(tmp_path, capsys):
    for name in TEMPLATES:
        main(["slurm", "template", name])
        path = tmp_path / f"{name}.sbatch"
        path.write_text(capsys.readouterr().out)
        check = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr


@pytest.mark.mpi(size=1)
@pytest.mark.launches
def test_the_wheel_ships_the_templates_and_the_example(tmp_path):
    # `pip install mpaccel` must bring what `mpaccel slurm template` prints and what it runs.
    # Built from a copy: setuptools leaves build/ and *.egg-info in the tree it builds.
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "*.egg-info", "__pycache__", ".*_cache"))
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(source)],
        capture_output=True, text=True, timeout=300, env=envvars.child_environment(),
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = tmp_path.glob("mpaccel-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert {f"mpaccel/templates/slurm/{name}.sbatch" for name in TEMPLATES} <= names
    assert {"mpaccel/examples/__init__.py", "mpaccel/examples/train.py"} <= names
