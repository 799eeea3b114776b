"""Accelerate's `accelerate.commands.env`: `accelerate env` is `mpaccel env` here."""

from __future__ import annotations

import argparse
from typing import Any


def env_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The parser of the `env` command (a sub-command of `subparsers` when given)."""
    description = "Print mpaccel's report of the MPI, launcher, Slurm and library setup."
    if subparsers is not None:
        parser: argparse.ArgumentParser = subparsers.add_parser("env", description=description)
    else:
        parser = argparse.ArgumentParser("mpaccel env", description=description)
    parser.add_argument("--config_file", default=None, help="ignored: mpaccel has no config file")
    parser.set_defaults(func=env_command)
    return parser


def env_command(args: argparse.Namespace | None = None) -> int:
    """Collective under mpiexec/srun (it runs `mpaccel env`): rank 0 prints the report."""
    del args
    from ..cli import main

    return main(["env"])


__all__ = ["env_command", "env_command_parser"]
