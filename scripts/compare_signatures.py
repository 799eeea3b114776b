"""Compare the public methods and properties of Accelerate's Accelerator, PartialState,
AcceleratorState and GradientState with mpaccel's, by inspect.signature.

Run it with a Python that has both packages importable (Accelerate need not work there, only
import), e.g. a venv of its own with `pip install accelerate==1.15.0` and mpaccel on PYTHONPATH:

    PYTHONPATH=. venv/bin/python scripts/compare_signatures.py           # differences only
    PYTHONPATH=. venv/bin/python scripts/compare_signatures.py --all     # every member
    PYTHONPATH=. venv/bin/python scripts/compare_signatures.py --markdown  # a docs table

A difference in parameter names, order, kinds or defaults is reported; extra trailing
parameters with defaults on mpaccel's side (keyword-only or positional) are compatible and
shown as such.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from typing import Any

CLASSES = ("Accelerator", "PartialState", "AcceleratorState", "GradientState")


def _classes(package: str) -> dict[str, type]:
    top = __import__(package)
    state = __import__(f"{package}.state", fromlist=["state"])
    return {
        "Accelerator": top.Accelerator,
        "PartialState": state.PartialState,
        "AcceleratorState": state.AcceleratorState,
        "GradientState": state.GradientState,
    }


def _raw(cls: type, name: str) -> Any:
    for base in cls.__mro__:
        if name in base.__dict__:
            return base.__dict__[name]
    return None


def _members(cls: type) -> dict[str, Any]:
    out = {}
    for name in dir(cls):
        if name.startswith("_") and name not in ("__init__", "_reset_state"):
            continue
        raw = _raw(cls, name)
        if raw is not None:
            out[name] = raw
    return out


def _describe(raw: Any) -> tuple[str, inspect.Signature | None]:
    if isinstance(raw, property):
        return "property" + (" (settable)" if raw.fset is not None else ""), None
    kind = "staticmethod" if isinstance(raw, staticmethod) else (
        "classmethod" if isinstance(raw, classmethod) else "method"
    )
    function = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    function = inspect.unwrap(function)  # Accelerate's @on_main_process wrappers
    if not callable(function):
        return "attribute", None
    try:
        return kind, inspect.signature(function)
    except (TypeError, ValueError):
        return kind, None


def _params(signature: inspect.Signature) -> list[inspect.Parameter]:
    return [p for p in signature.parameters.values() if p.name not in ("self", "cls")]


def _default(p: inspect.Parameter) -> str:
    if p.default is inspect.Parameter.empty:
        return ""
    if inspect.isfunction(p.default) or inspect.isclass(p.default):
        # each package's own is_torch_tensor: the same default when it has the same name
        return p.default.__qualname__
    return repr(p.default)


def compare(theirs: Any, ours: Any) -> str:
    """'' when compatible, else what differs."""
    their_kind, their_sig = _describe(theirs)
    our_kind, our_sig = _describe(ours)
    if their_kind.split()[0] != our_kind.split()[0]:
        return f"{our_kind} here, {their_kind} in Accelerate"
    if their_sig is None or our_sig is None:
        return ""
    a, b = _params(their_sig), _params(our_sig)
    if [p.kind for p in a] == [inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]:
        return ""  # a wrapper without functools.wraps (Accelerate's @on_main_process): unknown
    problems = []
    for i, p in enumerate(a):
        if p.kind is p.VAR_KEYWORD:
            if not any(q.kind is q.VAR_KEYWORD for q in b):
                problems.append(f"no **{p.name}")
            continue
        if p.kind is p.VAR_POSITIONAL:
            if not any(q.kind is q.VAR_POSITIONAL for q in b):
                problems.append(f"no *{p.name}")
            continue
        match = [q for q in b if q.name == p.name]
        if not match:
            problems.append(f"missing {p.name!r}")
            continue
        q = match[0]
        positional = p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        if positional and (i >= len(b) or b[i].name != p.name):
            problems.append(f"{p.name!r} at another position")
        theirs_default, ours_default = _default(p), _default(q)
        # a default where Accelerate requires the argument accepts every call it accepts
        sentinel = "object at 0x" in theirs_default  # object(): "not passed", any default fits
        if theirs_default and theirs_default != ours_default and not sentinel:
            problems.append(
                f"{p.name}={ours_default or '<required>'} (Accelerate: {theirs_default})"
            )
    their_names = {p.name for p in a}
    for q in b:
        if q.name not in their_names and q.kind not in (q.VAR_KEYWORD, q.VAR_POSITIONAL):
            if q.default is inspect.Parameter.empty:
                problems.append(f"extra required {q.name!r}")
    return "; ".join(problems)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="list matching members too")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = parser.parse_args(argv)
    theirs, ours = _classes("accelerate"), _classes("mpaccel")
    rows = []
    for cls in CLASSES:
        a, b = _members(theirs[cls]), _members(ours[cls])
        for name in sorted(a):
            if name not in b:
                rows.append((cls, name, "missing"))
                continue
            diff = compare(a[name], b[name])
            if diff or args.all:
                rows.append((cls, name, diff or "same"))
        if args.all:
            rows += [(cls, name, "mpaccel only") for name in sorted(set(b) - set(a))]
    if args.markdown:
        print("| class | member | mpaccel |\n|---|---|---|")
        for row in rows:
            print("| " + " | ".join(f"`{row[0]}`|`{row[1]}`|{row[2]}".split("|")) + " |")
    else:
        for cls, name, note in rows:
            print(f"{cls}.{name}: {note}")
    return 1 if any(note not in ("same", "mpaccel only") for _, _, note in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
