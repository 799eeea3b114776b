"""`accelerate` as another name of mpaccel, for `mpaccel run`: once `install()` ran, `import
accelerate` gives the module `mpaccel` and `accelerate.X` gives `mpaccel.X` (the same module
objects, so a library built on Accelerate and the script share one state), and
`importlib.metadata` reports an `accelerate` distribution of the release mpaccel mirrors, so the
libraries' version checks pass whether or not the real Accelerate is installed.

A module mpaccel lacks is refused at import with a HINT (ModuleNotFoundError); a name mpaccel
lacks inside a module it has resolves as in a direct import of mpaccel (mpaccel/absent_names.py).
"""

from __future__ import annotations

import email.message
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import logging
import os
import pkgutil
import sys
import types
from collections.abc import Iterable, Sequence
from typing import Any

from . import absent_names
from .errors import with_hint

# The Accelerate release whose API mpaccel follows (docs/compatibility.md): what
# importlib.metadata.version("accelerate") answers under `mpaccel run`.
ACCELERATE_VERSION = "1.15.0"
NAME = "accelerate"


def target(name: str) -> str:
    """The mpaccel module that `accelerate[.X]` stands for."""
    return "mpaccel" + name[len(NAME):]


def _is_alias(name: str) -> bool:
    return name == NAME or name.startswith(NAME + ".")


class _AccelerateDistribution(importlib.metadata.Distribution):
    """The metadata of an `accelerate` distribution at ACCELERATE_VERSION, provided by mpaccel."""

    def read_text(self, filename: str) -> str | None:
        if filename in ("METADATA", "PKG-INFO"):
            meta = email.message.Message()
            meta["Metadata-Version"] = "2.1"
            meta["Name"] = NAME
            meta["Version"] = ACCELERATE_VERSION
            meta["Summary"] = "provided by mpaccel (`mpaccel run`): accelerate is mpaccel here"
            return meta.as_string()
        if filename == "top_level.txt":
            return NAME + "\n"
        return None

    def locate_file(self, path: Any) -> Any:
        from pathlib import Path

        return Path(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) / str(path)


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finder and loader of `accelerate` and `accelerate.*`, and finder of its distribution.
    The loader puts mpaccel's module in sys.modules during exec_module, which the import system
    honours; the module keeps its own `__spec__`."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target_: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not _is_alias(fullname):
            return None
        real = target(fullname)
        if real not in sys.modules and importlib.util.find_spec(real) is None:
            raise ModuleNotFoundError(missing_module_message(fullname), name=fullname)
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return types.ModuleType(spec.name)  # a placeholder, replaced in exec_module

    def exec_module(self, module: types.ModuleType) -> None:
        sys.modules[module.__name__] = importlib.import_module(target(module.__name__))

    def find_distributions(
        self, context: Any = None
    ) -> Iterable[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)  # None: every distribution
        if name is None or name.replace("-", "_").lower() == NAME:
            return [_AccelerateDistribution()]
        return []


def missing_module_message(name: str) -> str:
    """Why `accelerate` module `name` cannot be imported under `mpaccel run`, with the HINT."""
    reason = absent_names.module_reason(target(name))
    if reason is not None:
        return with_hint(f"{name} cannot be used: {reason.why}", reason.instead)
    return with_hint(
        f"{name} stands for {target(name)}, which mpaccel does not have",
        "docs/compatibility.md lists Accelerate's names and mpaccel's; docs/huggingface.md says "
        "what `mpaccel run` provides. To run with the real Accelerate, use `accelerate launch`.",
    )


_FINDER = _Alias()


def installed() -> bool:
    """install() ran in this process."""
    return _FINDER in sys.meta_path


def install() -> None:
    """Make `accelerate` resolve to mpaccel in this process (idempotent). Not collective.

    Refuses (RuntimeError) when the real Accelerate was imported already: the two would then
    coexist and a library would mix them."""
    loaded = sys.modules.get(NAME)
    if loaded is not None and loaded.__name__ != "mpaccel":
        raise RuntimeError(with_hint(
            f"the real accelerate is imported already ({loaded!r})",
            "install the alias before anything imports accelerate (`mpaccel run SCRIPT`)",
        ))
    if installed():
        return
    sys.meta_path.insert(0, _FINDER)
    # Accelerate's modules log to loggers named after them; a library that configures one
    # (`logging.getLogger("accelerate.accelerator")`) reaches mpaccel's module's.
    import mpaccel

    loggers = logging.root.manager.loggerDict
    for module in pkgutil.iter_modules(mpaccel.__path__):
        name = f"{NAME}.{module.name}"
        if name not in loggers:
            loggers[name] = logging.getLogger(f"mpaccel.{module.name}")
            _LOGGERS.append(name)


_LOGGERS: list[str] = []  # the logger names install() added


def uninstall() -> None:
    """Undo install(): `accelerate` is looked up on sys.path again (for tests)."""
    while installed():
        sys.meta_path.remove(_FINDER)
    for name in [name for name in sys.modules if _is_alias(name)]:
        if sys.modules[name].__name__.startswith("mpaccel"):
            del sys.modules[name]
    while _LOGGERS:
        logging.root.manager.loggerDict.pop(_LOGGERS.pop(), None)
