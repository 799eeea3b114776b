"""Plain `python script.py`: one process, an MPI singleton."""

from __future__ import annotations

from .base import Launcher


class SingleProcess(Launcher):
    name = "single process (no launcher)"

    @classmethod
    def detect(cls, env):
        return True

    def expected_world_size(self):
        return 1
