"""Run Accelerate's own scripts against mpaccel: `install()` makes `import accelerate` and
`accelerate.X` resolve to `mpaccel` and `mpaccel.X` (the same module objects, so a script and
mpaccel share one state), and `accelerate.test_utils` to this package's small equivalent of
Accelerate's helpers. The scripts themselves are read from an installed Accelerate
(`script_path`), which is never imported. Test-only: nothing here ships with mpaccel."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import logging
import pkgutil
import sys
import types
from pathlib import Path

# The release whose scripts the test job runs (the specification mpaccel follows).
ACCELERATE_VERSION = "1.15.0"
_OWN_TEST_UTILS = __name__ + ".test_utils"


def _target(name: str) -> str:
    """The module `accelerate...` stands for."""
    rest = name[len("accelerate"):]
    if rest == ".test_utils" or rest.startswith(".test_utils."):
        return _OWN_TEST_UTILS + rest[len(".test_utils"):]
    return "mpaccel" + rest


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finder and loader of `accelerate` and `accelerate.*`. The loader puts the real module in
    sys.modules during exec_module, which the import system honours: the real module keeps its
    own `__spec__` (rewriting it would make mpaccel's lazy relative imports warn)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "accelerate" and not fullname.startswith("accelerate."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        return types.ModuleType(spec.name)  # a placeholder, replaced in exec_module

    def exec_module(self, module):
        name = module.__name__
        try:
            real = importlib.import_module(_target(name))
        except ModuleNotFoundError as exc:
            raise ModuleNotFoundError(
                f"{name!r} stands for {_target(name)!r}, which does not exist: {exc}; HINT: "
                "mpaccel has no such module (see docs/compatibility.md)",
                name=name,
            ) from exc
        sys.modules[name] = real


_FINDER = _Alias()


def install() -> None:
    """Make `accelerate` resolve to mpaccel in this process (idempotent). Refuses when the real
    Accelerate was imported already: the two would then coexist and the script would mix them."""
    loaded = sys.modules.get("accelerate")
    if loaded is not None and loaded.__name__ != "mpaccel":
        raise RuntimeError(
            f"the real accelerate is imported already ({loaded!r}); HINT: call install() first"
        )
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    # Accelerate's modules log to loggers named after them, created when they are imported; a
    # script that looks one up (loggerDict["accelerate.accelerator"]) gets mpaccel's module's.
    import mpaccel

    for module in pkgutil.iter_modules(mpaccel.__path__):
        logging.root.manager.loggerDict.setdefault(
            f"accelerate.{module.name}", logging.getLogger(f"mpaccel.{module.name}")
        )


def installed_accelerate() -> tuple[str | None, Path | None]:
    """(version, package directory) of the installed Accelerate distribution, without importing
    it; (None, None) when it is not installed."""
    try:
        dist = importlib.metadata.distribution("accelerate")
    except importlib.metadata.PackageNotFoundError:
        return None, None
    return dist.version, Path(str(dist.locate_file("accelerate")))


def script_path(relative: str) -> Path:
    """The path of Accelerate's `test_utils/scripts/RELATIVE` in the installed distribution."""
    version, package = installed_accelerate()
    if package is None:
        raise FileNotFoundError(
            f"accelerate is not installed; HINT: pip install accelerate=={ACCELERATE_VERSION}"
        )
    path = package / "test_utils" / "scripts" / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} is not in accelerate {version}")
    return path
