"""No underscore name crosses a module boundary in mpaccel/: a module's private names are its
own, and every module others import has a public name (no `from . import _x`)."""

from __future__ import annotations

import ast
from pathlib import Path

import mpaccel

PACKAGE = Path(mpaccel.__file__).parent


def _is_module(package: Path, name: str) -> bool:
    return (package / f"{name}.py").exists() or (package / name / "__init__.py").exists()


def _target(path: Path, node: ast.ImportFrom) -> Path | None:
    """The directory of the package that `from <node.module> import ...` names, if mpaccel's."""
    if node.level:
        base = path.parent
        for _ in range(node.level - 1):
            base = base.parent
    elif node.module and node.module.split(".")[0] == "mpaccel":
        base = PACKAGE.parent
    else:
        return None
    for part in (node.module or "").split(".") if node.module else []:
        base = base / part
    return base


def crossings() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        modules: set[str] = set()  # local names bound to mpaccel modules
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            target = _target(path, node)
            if target is None:
                continue
            for alias in node.names:
                if _is_module(target, alias.name):
                    modules.add(alias.asname or alias.name)
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: imports "
                                 f"{alias.name} from {'.' * node.level}{node.module or ''}")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in modules and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: uses "
                             f"{node.value.id}.{node.attr}")
    return found


def test_no_underscore_name_crosses_a_module_boundary():
    found = crossings()
    assert not found, "private names used outside their module:\n" + "\n".join(found)
