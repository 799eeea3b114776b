"""The top-level package: its public names load on first use, and importing it (or the
pytest plugin) does not import torch."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import mpaccel

INIT = Path(mpaccel.__file__)


def _typed_imports() -> dict[str, str]:
    """name -> module of the imports under `if typing.TYPE_CHECKING:` in mpaccel/__init__.py."""
    tree = ast.parse(INIT.read_text())
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "typing.TYPE_CHECKING":
            for statement in node.body:
                assert isinstance(statement, ast.ImportFrom), ast.unparse(statement)
                for alias in statement.names:
                    names[alias.asname or alias.name] = "." * statement.level + (
                        statement.module or "")
    return names


def test_type_checkers_and_run_time_see_the_same_names_from_the_same_modules():
    typed = _typed_imports()
    assert sorted(typed) == sorted(set(mpaccel.__all__) - {"__version__"})
    for name, module in typed.items():
        expected = getattr(importlib.import_module(module, "mpaccel"), name)
        assert getattr(mpaccel, name) is expected, name


def test_star_import_gives_every_public_name():
    namespace: dict[str, object] = {}
    exec("from mpaccel import *", namespace)
    assert set(mpaccel.__all__) <= set(namespace)


def test_unknown_and_private_names_are_attribute_errors():
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        mpaccel.no_such_name  # noqa: B018
    with pytest.raises(AttributeError):
        mpaccel._no_such_module  # noqa: B018


@pytest.mark.mpi(size=1)
@pytest.mark.launches  # a python of its own
@pytest.mark.parametrize("module", ["mpaccel", "mpaccel.testing.plugin"])
def test_importing_the_tools_does_not_import_torch(module):
    # torch is most of a rank's start-up (1.5 s of CPU each on these machines), which a
    # pytest run under mpiexec whose tests use no tensors need not pay.
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m.startswith('torch')))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]", run.stdout
