"""Accelerate's `accelerate.commands.launch`: its parser, and a launch_command that refuses to
start processes and names the command line that does (mpaccel's jobs are started by mpiexec or
srun, every rank running `mpaccel run SCRIPT`)."""

from __future__ import annotations

import argparse
import shlex
from typing import Any

from ..errors import ConfigurationError


def launch_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """A parser of `accelerate launch [OPTIONS] SCRIPT [ARGS...]` for launch_command: the
    script, its arguments, -m, --num_processes and --config_file (Accelerate's other options
    are usage errors: they configure launches mpaccel does not make)."""
    description = "Run a script on every rank: `mpiexec -n N mpaccel run SCRIPT [ARGS...]`."
    if subparsers is not None:
        parser: argparse.ArgumentParser = subparsers.add_parser("launch", description=description)
    else:
        parser = argparse.ArgumentParser("accelerate launch", description=description)
    parser.add_argument("--num_processes", type=int, default=None)
    parser.add_argument("--config_file", default=None)
    parser.add_argument("-m", "--module", action="store_true")
    parser.add_argument("training_script")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
    parser.set_defaults(func=launch_command)
    return parser


def launch_command(args: argparse.Namespace) -> None:
    """Refuses (ConfigurationError): mpaccel starts no processes. The HINT is the command line
    that runs the same script on every rank."""
    n = args.num_processes or "N"
    script = ["-m", args.training_script] if args.module else [args.training_script]
    command = shlex.join(["mpiexec", "-n", str(n), "mpaccel", "run", *script,
                          *args.training_script_args])
    raise ConfigurationError(
        "`accelerate launch` cannot be used under mpaccel: mpaccel starts no processes; "
        "mpiexec or srun starts them, and every rank runs the script",
        f"`{command}` (or `srun ... mpaccel run ...`, docs/huggingface.md).",
    )


__all__ = ["launch_command", "launch_command_parser"]
