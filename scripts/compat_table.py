"""The table of docs/compatibility.md: every public name of Accelerate's `accelerate`,
`accelerate.utils`, `accelerate.state` and of its Accelerator, PartialState, AcceleratorState and
GradientState, looked up at the same path in mpaccel and classified.

Run it with a Python where both `accelerate` (1.15) and mpaccel import:

    PYTHONPATH=. python scripts/compat_table.py                 # print the table
    PYTHONPATH=. python scripts/compat_table.py --write docs/compatibility.md
    PYTHONPATH=. python scripts/compat_table.py --check docs/compatibility.md  # exit 1 if stale

A name is `supported` (the same signature, by compare_signatures.compare, and no note),
`differs` (the signature difference found, and the hand-kept note of scripts/compat_notes.py
DIFFERS where behaviour differs, or compat_notes.KEPT for a constant or attribute kept with
Accelerate's value), `refused` (mpaccel has it only to refuse it with a HINT: it carries
mpaccel.errors.REFUSED, set by mpaccel.errors.refused; mpaccel/absent_names.py holds the reasons) or
`missing` (a gap: compat_notes.MISSING says where it would go). --check fails on a missing name
without a note.
"""

from __future__ import annotations

import argparse
import ast
import enum
import importlib
import importlib.util
import inspect
import logging
import re
import sys
import textwrap
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import compat_notes
from compare_signatures import CLASSES, _classes, _raw, compare

MODULES = ("accelerate", "accelerate.utils", "accelerate.state")
BEGIN, END = "<!-- compat-table:begin -->", "<!-- compat-table:end -->"
# Accelerate's AcceleratorState copies PartialState's attributes into itself (mpaccel's forwards
# to them): the names a script reaches through `accelerator.state` include those.
TAKES_ATTRIBUTES_OF = {"AcceleratorState": "PartialState"}
STATUSES = ("supported", "differs", "refused", "missing")


class _InstanceAttribute:
    """An attribute assigned on instances (`self.name = ...`): no object to inspect."""

    def __repr__(self) -> str:
        return "<instance attribute>"


INSTANCE_ATTRIBUTE = _InstanceAttribute()


@dataclass(frozen=True)
class Row:
    group: str
    name: str
    status: str  # one of STATUSES
    detail: str  # the difference, the refusal, or why it is absent


# -- which names are public ----------------------------------------------------------------------


def _top_level_bindings(module: types.ModuleType) -> dict[str, str | None]:
    """Names the module's source binds at top level (under `if`/`try` too, whether or not that
    branch ran here): name -> the module it is imported from (None for a definition)."""
    package = module.__name__ if hasattr(module, "__path__") else module.__package__
    out: dict[str, str | None] = {}

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                for block in (node.body, node.orelse, node.finalbody):
                    visit(block)
                for handler in node.handlers:
                    visit(handler.body)
            elif isinstance(node, ast.ImportFrom):
                source = importlib.util.resolve_name(
                    "." * node.level + (node.module or ""), package or ""
                )
                for alias in node.names:
                    out.setdefault(alias.asname or alias.name, source)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    out.setdefault(alias.asname or alias.name.partition(".")[0], alias.name)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out[node.name] = None
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name):
                        out.setdefault(target.id, None)

    visit(ast.parse(inspect.getsource(module)).body)
    return out


def _is_module(dotted: str) -> bool:
    try:
        return importlib.util.find_spec(dotted) is not None
    except ModuleNotFoundError:  # the parent is a module, not a package
        return False


def public_module_names(module: types.ModuleType) -> list[str]:
    """The rule: names without a leading underscore that the module's source binds at top level,
    where a package's `__init__` counts what it imports from its own package (re-exporting is
    its purpose) and a plain module only what it defines itself (its imports are its
    implementation); modules and loggers are never counted."""
    root = module.__name__.partition(".")[0]
    is_package = hasattr(module, "__path__")
    names = []
    for name, source in _top_level_bindings(module).items():
        if name.startswith("_"):
            continue
        if source is not None:
            own = source == root or source.startswith(root + ".")
            if not (is_package and own) or _is_module(f"{source}.{name}"):
                continue  # a plain module's import, a foreign one, or a submodule
        value = getattr(module, name, None)
        if isinstance(value, (types.ModuleType, logging.Logger, logging.LoggerAdapter)):
            continue
        names.append(name)
    return sorted(names)


def _instance_attributes(cls: type) -> set[str]:
    """Public names a class's methods assign on `self`, and the instance attributes it
    annotates, over its bases too."""
    out: set[str] = set()
    for base in cls.__mro__:
        if base is object:
            continue
        out.update(getattr(base, "__annotations__", {}))
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(base)))
        except (OSError, TypeError):
            continue
        for node in ast.walk(tree):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = list(node.targets)
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                targets = [node.target]
            for target in targets:
                for leaf in ast.walk(target):
                    if (
                        isinstance(leaf, ast.Attribute)
                        and isinstance(leaf.value, ast.Name)
                        and leaf.value.id == "self"
                    ):
                        out.add(leaf.attr)
    return {name for name in out if not name.startswith("_")}


def public_class_members(classes: dict[str, type], name: str) -> dict[str, Any]:
    """name -> raw member (as found in the class __dict__) or INSTANCE_ATTRIBUTE."""
    cls = classes[name]
    attributes = _instance_attributes(cls)
    if name in TAKES_ATTRIBUTES_OF:
        attributes |= _instance_attributes(classes[TAKES_ATTRIBUTES_OF[name]])
    out: dict[str, Any] = dict.fromkeys(attributes, INSTANCE_ATTRIBUTE)
    for member in dir(cls):
        if not member.startswith("_"):
            raw = _raw(cls, member)
            if raw is not None:
                out[member] = raw
    return out


# -- classifying ---------------------------------------------------------------------------------


def refusal(raw: Any) -> tuple[str, str] | None:
    """(message, hint) when mpaccel refuses this name (mpaccel.errors.REFUSED is on it)."""
    from mpaccel.errors import REFUSED

    if isinstance(raw, property):
        raw = raw.fget
    elif isinstance(raw, (staticmethod, classmethod)):
        raw = raw.__func__
    marker = getattr(raw, REFUSED, None)
    return tuple(marker) if marker else None  # type: ignore[return-value]


def _plain_value(value: Any) -> bool:
    return isinstance(value, (str, int, float, bool, tuple, list, dict, frozenset, set))


def difference(theirs: Any, ours: Any) -> str:
    """What differs between Accelerate's object and mpaccel's, '' when nothing does."""
    if isinstance(theirs, type) and issubclass(theirs, enum.Enum):
        if not (isinstance(ours, type) and issubclass(ours, enum.Enum)):
            return "not an Enum here"
        lacking = [m.value for m in theirs if m.value not in {o.value for o in ours}]
        return f"lacks members {lacking}" if lacking else ""
    attribute = _attribute_difference(theirs, ours)
    if attribute is not None:
        return attribute
    if _plain_value(theirs) or _plain_value(ours):
        return "" if theirs == ours else f"value {ours!r} (Accelerate: {theirs!r})"
    return compare(theirs, ours)


def _attribute_difference(theirs: Any, ours: Any) -> str | None:
    """Between an instance attribute and a property what matters is whether a script can
    assign it; None when neither side is an instance attribute."""
    if INSTANCE_ATTRIBUTE not in (theirs, ours):
        return None
    if theirs is ours:
        return ""
    other = ours if theirs is INSTANCE_ATTRIBUTE else theirs
    if not isinstance(other, property):
        return compare(theirs, ours)
    if theirs is INSTANCE_ATTRIBUTE and other.fset is None:
        return "read-only here (Accelerate: an attribute scripts could assign)"
    return ""  # Accelerate's property, an attribute here: read and assigned alike


def classify(group: str, name: str, theirs: Any, ours: Any, found: bool) -> Row:
    key = f"{group}.{name}"
    if not found:
        return Row(group, name, "missing", compat_notes.MISSING.get(key, ""))
    refused = refusal(ours)
    if refused:
        message, hint = refused
        return Row(group, name, "refused", f"{message}; HINT: {hint}" if hint else message)
    parts = [difference(theirs, ours) if theirs is not None else "",
             compat_notes.DIFFERS.get(key), compat_notes.KEPT.get(key)]
    detail = ". ".join(p for p in parts if p)
    return Row(group, name, "differs" if detail else "supported", detail)


def _module_rows(group: str) -> list[Row]:
    theirs = importlib.import_module(group)
    ours = importlib.import_module("mpaccel" + group[len("accelerate"):])
    rows = []
    for name in public_module_names(theirs):
        found = hasattr(ours, name)
        rows.append(classify(group, name, getattr(theirs, name, None), getattr(ours, name, None),
                             found))
    return rows


def _class_rows(group: str, theirs: dict[str, type], ours: dict[str, type]) -> list[Row]:
    a, b = public_class_members(theirs, group), public_class_members(ours, group)
    if group in TAKES_ATTRIBUTES_OF:
        # mpaccel's AcceleratorState answers what it lacks from PartialState (its __getattr__)
        b = {**public_class_members(ours, TAKES_ATTRIBUTES_OF[group]), **b}
    rows = []
    for name in sorted(a):
        their, our = a[name], b.get(name)
        rows.append(classify(group, name, their, our, name in b))
    return rows


def collect() -> list[Row]:
    rows = [row for group in MODULES for row in _module_rows(group)]
    theirs, ours = _classes("accelerate"), _classes("mpaccel")
    for group in CLASSES:
        rows += _class_rows(group, theirs, ours)
    return rows


def note_problems(rows: list[Row]) -> list[str]:
    """Missing names without a reason, and notes that no longer fit."""
    status = {f"{row.group}.{row.name}": row.status for row in rows}
    problems = [
        f"{key}: missing, and not in compat_notes.MISSING (add it, refuse it in "
        f"mpaccel/absent_names.py with a reason, or say where it would go)"
        for key, value in status.items()
        if value == "missing" and key not in compat_notes.MISSING
    ]
    for notes, expected in ((compat_notes.MISSING, "missing"), (compat_notes.KEPT, "differs")):
        for key in notes:
            if status.get(key) != expected:
                problems.append(f"{key}: noted as {expected} but {status.get(key, 'not a name')}")
    for key in compat_notes.DIFFERS:
        if status.get(key) not in ("differs", "supported"):
            problems.append(f"{key}: in compat_notes.DIFFERS but {status.get(key, 'not a name')}")
    return problems


# -- rendering -----------------------------------------------------------------------------------


# A refusal of mpaccel/absent_names.py names the name, then gives the reason its group shares.
_PLACEHOLDER = re.compile(r"^.*? cannot be used: ")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(rows: list[Row]) -> str:
    out: list[str] = []
    for group in (*MODULES, *CLASSES):
        mine = [row for row in rows if row.group == group]
        counts = {s: sum(row.status == s for row in mine) for s in STATUSES}
        title = group if group in MODULES else f"{group} (members)"
        out += [
            f"### `{title}`",
            "",
            f"{len(mine)} names: {counts['supported']} supported, "
            f"{counts['differs']} differ, {counts['refused']} refused, "
            f"{counts['missing']} missing.",
            "",
        ]
        same = [f"`{row.name}`" for row in mine if row.status == "supported"]
        if same:
            out += ["Supported as in Accelerate: " + ", ".join(same) + ".", ""]
        placeholders: dict[str, list[str]] = {}  # mpaccel/absent_names.py's, by reason
        for row in mine:
            if row.status == "refused" and _PLACEHOLDER.match(row.detail):
                placeholders.setdefault(_PLACEHOLDER.sub("", row.detail), []).append(row.name)
        listed = {name for names in placeholders.values() for name in names}
        others = [row for row in mine if row.status != "supported" and row.name not in listed]
        if others:
            out += ["| name | mpaccel | what |", "|---|---|---|"]
            out += [f"| `{r.name}` | {r.status} | {_cell(r.detail)} |" for r in others]
            out.append("")
        if placeholders:
            out += ["Refused, each with the reason and HINT below (the name imports; using it "
                    "raises them):", ""]
            for why, names in placeholders.items():
                out.append(f"- {', '.join(f'`{n}`' for n in names)}: {why}")
            out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def splice(document: str, table: str) -> str:
    """The document with the text between BEGIN and END replaced by the table."""
    head, begin, rest = document.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise SystemExit(f"the document has no {BEGIN} ... {END} section")
    return f"{head}{BEGIN}\n{table}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", metavar="DOC", type=Path, help="replace DOC's table")
    action.add_argument("--check", metavar="DOC", type=Path,
                        help="exit 1 when DOC's table is stale or a missing name has no reason")
    args = parser.parse_args(argv)
    rows = collect()
    table = render(rows)
    if args.write:
        args.write.write_text(splice(args.write.read_text(), table))
    elif args.check:
        problems = note_problems(rows)
        document = args.check.read_text()
        if splice(document, table) != document:
            problems.insert(0, f"{args.check} is stale: run scripts/compat_table.py --write "
                               f"{args.check}")
        print("\n".join(problems))
        return 1 if problems else 0
    else:
        print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
