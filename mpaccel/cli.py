"""The `mpaccel` command: `mpaccel env` prints a plain-text report to paste into a bug report;
`mpaccel slurm template NAME` prints a job script; `mpaccel run SCRIPT` runs a program with
`accelerate` resolved to mpaccel; `mpaccel --version`.

`collect_env_facts()` gathers the facts (collective under mpiexec/srun), `render_env_report()`
turns them into text (pure, pinned by golden files).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import re
import shlex
import sys
from collections import Counter
from collections.abc import Sequence
from typing import Any, Callable

from . import envvars
from ._version import __version__
from .device import select_device
from .discovery import discover, import_mpi
from .environments import SlurmFacts, detect_launcher
from .environments.slurm_facts import runs_text
from .errors import MpaccelError

Facts = dict[str, Any]

NO_MPI_HINT = (
    "`pip install mpich` (or `pip install mpaccel[mpich]`), or point mpi4py at the cluster's "
    "MPI: MPI4PY_LIBMPI=/path/to/libmpi.so (`module load` the MPI your mpiexec belongs to)"
)
_LIBMPI_FILE = re.compile(r"/lib(mpi|mpich|mpi_\w+)\.(so|dylib)[.\d]*$")
# Column headers of the rank table; a row's key is the header in lower_snake_case.
_RANK_COLUMNS = ("rank", "host", "local rank", "node", "pid", "CUDA_VISIBLE_DEVICES", "device")


# -- gathering -----------------------------------------------------------------------------------


def _loaded_libmpi() -> str | None:
    """The libmpi file(s) this process has mapped (Linux only: mpi4py does not say)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if _LIBMPI_FILE.search(line.rstrip())}
    except OSError:
        return None
    return ", ".join(sorted(paths)) or None


def _mpi_facts(env: envvars.Snapshot) -> Facts:
    facts: Facts = {"MPI4PY_LIBMPI": envvars.get("mpi4py_libmpi", env)}
    try:  # without MPI_Init: discover() first checks that this launcher suits the library
        MPI = import_mpi()
    except (ImportError, RuntimeError) as exc:  # no mpi4py, or no libmpi it can load
        return {**facts, "error": str(exc)}
    import mpi4py

    major, minor = MPI.Get_version()
    return {
        **facts,
        "library": " ".join(MPI.Get_library_version().strip().splitlines()[0].split()),
        "standard": f"{major}.{minor}",
        "mpi4py": mpi4py.__version__,
        "extension": os.path.basename(getattr(MPI, "__file__", "") or "") or None,
        "libmpi": _loaded_libmpi(),
        "config": {k: str(v) for k, v in mpi4py.get_config().items()},
    }


def _torch_facts() -> Facts:
    try:
        import torch
    except ImportError as exc:
        return {"error": str(exc)}
    cuda = torch.cuda.is_available()
    try:  # a tuple (2, 26, 2) on torch 2.x; CPU-only builds have no NCCL bindings at all
        nccl: str | None = ".".join(map(str, torch.cuda.nccl.version()))
    except (AttributeError, RuntimeError, TypeError):
        nccl = None
    from .distributed import gloo_available

    return {
        "version": torch.__version__,
        "cuda_build": torch.version.cuda,
        "cuda_available": cuda,
        "device_count": torch.cuda.device_count() if cuda else 0,
        "nccl": nccl,
        "gloo": gloo_available(),
    }


def _h5py_facts() -> Facts:
    try:
        import h5py
    except ImportError as exc:
        return {"error": str(exc)}
    version = h5py.version
    return {"version": version.version, "hdf5": version.hdf5_version, "mpi": h5py.get_config().mpi}


def _version_of(module: str) -> str:
    try:
        return str(__import__(module).__version__)
    except ImportError as exc:
        return f"not importable ({exc})"


def _device_of(env: envvars.Snapshot, torch_facts: Facts, local_rank: int, local_size: int) -> str:
    cpu = envvars.get_bool("use_cpu", False, env)
    cuda, count = bool(torch_facts.get("cuda_available")), int(torch_facts.get("device_count", 0))
    return select_device(cpu, cuda, count, local_rank, local_size)


def _problem(exc: Exception) -> Facts:
    return {"message": getattr(exc, "message", str(exc)), "hint": getattr(exc, "hint", None)}


def collect_env_facts() -> Facts:
    """Collective: every process of the job must call this (it runs process discovery).

    Returns the same shape on every rank; `facts["rank"]` says whose they are, and only rank 0
    holds every rank's row (others hold an empty list).
    """
    env = envvars.snapshot()  # before mpi4py initialises MPI, which may consume launcher variables
    unread = "not read: see the launch problem above"
    facts: Facts = {
        "mpaccel": __version__,
        "python": f"{platform.python_version()} ({platform.python_implementation()}, "
        f"{sys.executable})",
        "platform": platform.platform(),
        "launcher": {"name": unread, "expected": None},
        "slurm": {"error": unread},
        "launch_problem": None,
        "warnings": [],
        "ranks": [],
        "rank": envvars.rank_before_init(env) or 0,
        "torch": _torch_facts(),
        "mpi": _mpi_facts(env),
    }
    discovery = None
    timeout, problem = 300.0, None
    try:  # a malformed launcher variable is a launch problem to report, not a crash of the report
        # with the library known, as discover() decides: another MPI's variables left over
        launcher = detect_launcher(env, facts["mpi"].get("library"))
        facts["launcher"] = {"name": launcher.name, "expected": launcher.expected_world_size()}
        slurm = SlurmFacts.from_env(env)
        facts["slurm"] = dataclasses.asdict(slurm) if slurm.in_job else None
        timeout = envvars.get_float("timeout", env) or timeout
    except MpaccelError as exc:  # discover() raises it on every rank: none waits for this one
        problem = exc
    try:
        discovery = discover(timeout, env=env, problem=problem)
    except MpaccelError as exc:
        facts["launch_problem"] = _problem(exc)
    except RuntimeError as exc:  # mpi4py 4 raises this, not ImportError, for a bad libmpi
        if "error" not in facts["mpi"]:
            raise
        message = f"mpi4py cannot load an MPI library: {exc}"
        facts["launch_problem"] = {"message": message, "hint": NO_MPI_HINT}
    if discovery is not None:
        info = discovery.info
        row = {
            "rank": info.process_index,
            "host": info.hostname,
            "local_rank": info.local_process_index,
            "node": info.node_index,
            "pid": os.getpid(),
            "cuda_visible_devices": envvars.get("cuda_visible_devices", env),
            "device": _device_of(
                env, facts["torch"], info.local_process_index, info.local_num_processes
            ),
        }
        rows = discovery.comm.allgather(row, what="mpaccel env")
        facts["rank"] = info.process_index
        facts["ranks"] = rows if info.is_main_process else []
        facts["warnings"] = list(discovery.warnings)
    facts["mesh"] = mesh_facts(facts["ranks"], env) if facts["ranks"] else None
    facts["h5py"] = _h5py_facts()
    facts["numpy"] = _version_of("numpy")
    facts["hostlist"] = _version_of("hostlist")
    return facts


def mesh_facts(rows: Sequence[Facts], env: envvars.Snapshot) -> list[str] | None:
    """Not collective. The N-D mesh the PARALLELISM_CONFIG_* variables of `env` ask for, laid
    out over the ranks of `rows` (`mpaccel env`'s) as the Accelerator lays it out (with an FSDP
    plugin), with the hosts of each group; None when no size variable is set; the error's text
    (and HINT) for a layout the Accelerator would refuse."""
    from .config.parallelism import ParallelismConfig
    from .strategy.layout import lay_out, resolve_sizes

    names = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size")
    if not any(envvars.is_set(name, env) for name in names):
        return None
    try:
        given: dict[str, Any] = {
            name: envvars.get_size(name, env) if name != "cp_size" else envvars.get_int(name, env)
            for name in names
        }
        config = ParallelismConfig(**given)
        nodes_of = [(int(r["node"]), int(r["local_rank"])) for r in rows]
        hosts = [str(r["host"]) for r in rows]
        counts = list(Counter(node for node, _ in nodes_of).values())
        sizes = resolve_sizes(config.sizes(), len(rows), len(counts), min(counts))
        config.set_sizes(sizes)
        keep = ("dp_shard",) if sizes["dp_shard"] == 1 and sizes["cp"] == 1 else ()
        layout = lay_out(
            sizes, nodes_of, hosts, keep=keep,
            across_nodes=envvars.get_bool("tp_across_nodes", False, env),
        )  # fmt: skip
    except MpaccelError as exc:
        return [f"not possible: {exc}"]
    return layout.describe()


# -- rendering -----------------------------------------------------------------------------------


def _text(value: Any, missing: str = "-") -> str:
    if value is None or value == "" or (isinstance(value, (list, tuple)) and not value):
        return missing
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value))
    return str(value)


def _section(title: str, rows: Sequence[tuple[str, Any]] = (), lines: Sequence[str] = ()) -> str:
    body = [f"{label:<21}{_text(value)}" for label, value in rows] + list(lines)
    return "\n".join([title, "-" * len(title), *body])


def _table(rows: Sequence[Facts]) -> list[str]:
    keys = [header.lower().replace(" ", "_") for header in _RANK_COLUMNS]
    cells = [list(_RANK_COLUMNS)] + [[_text(row.get(key)) for key in keys] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(_RANK_COLUMNS))]
    return ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in cells]


def _layout_section(facts: Facts) -> str:
    rows = facts.get("ranks") or []
    if facts.get("launch_problem"):
        return _section("ranks", lines=["not available: see the launch problem above"])
    nodes = len({row["node"] for row in rows})
    title = f"ranks ({len(rows)} process{'es' if len(rows) != 1 else ''} on {nodes} node"
    title += "s)" if nodes != 1 else ")"
    notes = [f"note: {text}" for text in facts.get("warnings") or []]
    return _section(title, lines=[*_table(rows), *notes])


def _mpi_section(mpi: Facts) -> str:
    rows = [("MPI4PY_LIBMPI", mpi["MPI4PY_LIBMPI"])] if mpi.get("MPI4PY_LIBMPI") else []
    if "error" in mpi:
        lines = [f"mpi4py cannot load an MPI library: {mpi['error']}", f"HINT: {NO_MPI_HINT}"]
        return _section("MPI", rows, lines)
    config = ", ".join(f"{k}={v}" for k, v in sorted(mpi.get("config", {}).items()))
    rows = [
        ("library", mpi.get("library")),
        ("MPI standard", mpi.get("standard")),
        ("mpi4py", mpi.get("mpi4py")),
        ("mpi4py extension", mpi.get("extension")),
        ("libmpi loaded", _text(mpi.get("libmpi"), "not discoverable on this platform")),
        ("mpi4py build config", config or "none recorded (binary wheel)"),
        *rows,
    ]
    return _section("MPI", rows)


def _slurm_section(slurm: Facts | None) -> str:
    if slurm is None:
        return _section("Slurm", lines=["not in a Slurm job"])
    if "error" in slurm:
        return _section("Slurm", lines=[f"SLURM_* variables {slurm['error']}"])
    array = None
    if slurm.get("array_job_id"):
        array = f"{slurm['array_job_id']}_{_text(slurm.get('array_task_id'), '?')}"
    nodelist = slurm.get("job_nodelist") or []
    rows = [
        ("job id", slurm.get("job_id")),
        ("array (job_task)", array),
        ("step id", _text(slurm.get("step_id"), "- (batch shell, not an srun step)")),
        ("ntasks", slurm.get("ntasks")),
        ("step tasks", slurm.get("step_num_tasks")),
        (f"nodelist ({len(nodelist)})", nodelist),
    ]
    if list(slurm.get("nodelist") or []) != list(nodelist):
        rows.append((f"step nodelist ({len(slurm['nodelist'])})", slurm["nodelist"]))
    rows += [
        ("tasks per node", runs_text(slurm.get("tasks_per_node") or ())),
        ("restart count", slurm.get("restart_count")),
        ("mpi type", _text(slurm.get("mpi_type"), "- (SLURM_MPI_TYPE unset)")),
    ]
    return _section("Slurm", rows)


def _library_section(facts: Facts) -> str:
    torch, h5py = facts.get("torch", {}), facts.get("h5py", {})
    rows: list[tuple[str, Any]] = []
    if "error" in torch:
        rows.append(("torch", f"not importable ({torch['error']})"))
    else:
        rows += [
            ("torch", torch.get("version")),
            ("CUDA (build)", _text(torch.get("cuda_build"), "none (CPU-only build)")),
            ("CUDA available", torch.get("cuda_available")),
            ("CUDA devices", torch.get("device_count")),
            ("NCCL", _text(torch.get("nccl"), "not available")),
            ("gloo", torch.get("gloo")),
        ]
    if "error" in h5py:
        rows.append(("h5py", f"not importable ({h5py['error']})"))
    else:
        rows += [("h5py", h5py["version"]), ("HDF5", h5py["hdf5"]), ("h5py MPI", h5py["mpi"])]
    rows += [("numpy", facts.get("numpy")), ("python-hostlist", facts.get("hostlist"))]
    return _section("libraries", rows)


def render_env_report(facts: Facts) -> str:
    """The report text for `facts` (as `collect_env_facts()` returns them on rank 0). Pure."""
    launcher = facts.get("launcher", {})
    about = [(k, facts.get(k.lower())) for k in ("mpaccel", "Python", "platform")]
    sections = [_section("mpaccel env", about)]
    problem = facts.get("launch_problem")
    if problem:
        hint = [f"HINT: {problem['hint']}"] if problem.get("hint") else []
        sections.append(_section("launch problem", lines=[problem["message"], *hint]))
    expected = _text(launcher.get("expected"), "- (the launcher does not say)")
    launcher_rows = [("detected", launcher.get("name")), ("expected processes", expected)]
    sections += [
        _mpi_section(facts.get("mpi", {})),
        _section("launcher", launcher_rows),
        _layout_section(facts),
        *([_section("mesh (PARALLELISM_CONFIG_*)", lines=facts["mesh"])]
          if facts.get("mesh") else []),
        _slurm_section(facts.get("slurm")),
        _library_section(facts),
    ]
    return "\n\n".join(sections) + "\n"


# -- command line --------------------------------------------------------------------------------


def _run_env(args: argparse.Namespace) -> int:
    facts = collect_env_facts()
    if facts["rank"] == 0:
        sys.stdout.write(render_env_report(facts))
        sys.stdout.flush()
    return 1 if facts["launch_problem"] else 0


def _run_slurm_template(args: argparse.Namespace) -> int:
    from . import templates

    available = templates.names("slurm")
    if args.list:
        width = max(map(len, available))
        for name in available:
            sys.stdout.write(f"{name:<{width}}  {templates.summary(name)}\n")
        return 0
    if args.name not in available:
        given = "which one?" if args.name is None else f"no template named {args.name!r};"
        sys.stderr.write(
            f"mpaccel slurm template: {given} the templates are {', '.join(available)}\n"
            "HINT: `mpaccel slurm template --list` says what each is for; "
            "`mpaccel slurm template single_node > job.sbatch` writes one.\n"
        )
        return 2
    if args.script is not None:
        command = f"python {shlex.quote(args.script)}"
    elif args.module is not None:
        command = f"python -m {shlex.quote(args.module)}"
    else:
        command = templates.DEFAULT_COMMAND
    sys.stdout.write(templates.render(args.name, command))
    return 0


_RUN_USAGE = "usage: mpaccel run [-h] (SCRIPT | -m MODULE) [ARGS...]\n"


def _run_program(program: list[str]) -> int:
    """`mpaccel run [-m MODULE | SCRIPT] [ARGS...]` on every rank: the program runs in this
    process as `python SCRIPT ARGS` would, with `accelerate` resolved to mpaccel. Read by hand,
    not by argparse: every argument after SCRIPT or MODULE is the program's (`--help` too)."""
    import runpy

    from . import accelerate_alias

    if program[:1] in (["-h"], ["--help"]):
        build_parser().parse_args(["run", "--help"])  # prints the help and exits 0
    module = program[1] if program[:1] == ["-m"] and len(program) > 1 else None
    if module is None and (not program or program[0].startswith("-")):
        given = f"unknown option {program[0]!r}" if program else "which script?"
        sys.stderr.write(f"{_RUN_USAGE}mpaccel run: {given}\nHINT: `mpaccel run train.py "
                         "--lr 1e-4`, `mpaccel run -m my_package.train`\n")
        return 2
    accelerate_alias.install()
    if (envvars.rank_before_init() or 0) == 0:
        sys.stderr.write(
            f"mpaccel run: `accelerate` is mpaccel {__version__} in this process (Accelerate "
            f"{accelerate_alias.ACCELERATE_VERSION}'s API; names mpaccel lacks are refused "
            "with a HINT: docs/huggingface.md)\n"
        )
        sys.stderr.flush()
    if module is not None:
        sys.argv = [module, *program[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(program)
        sys.path[0] = os.path.dirname(os.path.abspath(program[0]))
        runpy.run_path(program[0], run_name="__main__")
    return 0


def _add_run_command(commands: Any) -> None:
    run = commands.add_parser(
        "run",
        help="run a program with `accelerate` resolved to mpaccel (Trainer, TRL, ...)",
        description="Run SCRIPT (or -m MODULE) with its ARGS as `python` would, with `import "
        "accelerate` and every `accelerate.X` resolved to mpaccel, so that libraries built on "
        "Accelerate (transformers' Trainer, TRL) use mpaccel unmodified. Start it on every rank: "
        "`mpiexec -n 4 mpaccel run train.py --epochs 3`, `srun mpaccel run train.py`.",
    )
    run.usage = _RUN_USAGE[len("usage: "):].strip()
    run.add_argument("-m", dest="module", metavar="MODULE", help="run library module MODULE")
    run.add_argument("program", nargs="?", metavar="SCRIPT", help="the script to run")
    run.add_argument("args", nargs="*", metavar="ARGS", help="the arguments of the program")


def _add_slurm_commands(commands: Any) -> None:
    slurm = commands.add_parser(
        "slurm", help="Slurm job scripts", description="Slurm job scripts."
    )
    slurm_commands = slurm.add_subparsers(dest="slurm_command", metavar="COMMAND")
    template = slurm_commands.add_parser(
        "template",
        help="print a job script to edit and submit (`mpaccel slurm template --list`)",
        description="Print a Slurm job script to edit and submit: "
        "`mpaccel slurm template single_node > job.sbatch && sbatch job.sbatch --epochs 20`. "
        "It runs the example that ships with mpaccel (python -m mpaccel.examples.train) "
        "unless --script or --module names yours; the script's own arguments follow sbatch's.",
    )
    template.add_argument("name", nargs="?", help="the template (see --list)")
    template.add_argument("--list", action="store_true", help="list the templates and exit")
    which = template.add_mutually_exclusive_group()
    which.add_argument("--script", metavar="PATH", help="run `python PATH` (your script)")
    which.add_argument("--module", metavar="MODULE", help="run `python -m MODULE`")
    template.set_defaults(run=_run_slurm_template)
    slurm.set_defaults(run=lambda args: _usage(slurm))


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mpaccel", description="Tools for PyTorch jobs run with mpaccel."
    )
    parser.add_argument("--version", action="version", version=f"mpaccel {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    env = commands.add_parser(
        "env",
        help="print a report of the MPI, launcher, Slurm and library setup (for bug reports)",
        description="Print a report for bug reports. Under mpiexec/srun run it on every rank "
        "(`mpiexec -n 4 mpaccel env`): rank 0 prints the table of all ranks.",
    )
    env.set_defaults(run=_run_env)
    from .checkpoint.cli import add_commands

    add_commands(commands)
    _add_slurm_commands(commands)
    _add_run_command(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:
        return _run_program(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    run: Callable[[argparse.Namespace], int] | None = getattr(args, "run", None)
    if run is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return run(args)
    except BrokenPipeError:
        # `mpaccel ckpt ls DIR | head`: the reader has gone; stop quietly, as other tools do
        # (stdout to /dev/null, so that flushing it at exit does not raise again).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
