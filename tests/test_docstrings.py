"""The public Accelerate-named API documents itself as Accelerate's does in the user's editor: a
first line that says whether the call is collective ("Collective..." / "Not collective..."), then
a Google-style `Args:` section naming each parameter (and only those)."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import mpaccel.local_sgd
import mpaccel.ops
import mpaccel.preemption
import mpaccel.tracking.base
import mpaccel.tracking.registry
import mpaccel.utils
from mpaccel.accelerator import Accelerator
from mpaccel.state import AcceleratorState, GradientState, PartialState

FIRST_LINE = re.compile(r"(Collective|Not collective)\b")
ENTRY = re.compile(r"\s*(\*{0,2}\w+)(?: \([^)]*\))?:")

# A class whose methods are checked; extend it as their Args: sections are written.
CLASSES = [
    PartialState,
    AcceleratorState,
    GradientState,
    Accelerator,
]


def methods(cls: type) -> Iterator[tuple[str, Callable[..., Any]]]:
    """The public methods `cls` and its mpaccel bases define. A function put on a class from
    another module (Accelerate's members mpaccel refuses, installed on the class) is a refusal,
    not API, and is left out; so are properties (no parameters)."""
    seen: set[str] = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("mpaccel"):
            continue
        for name, member in vars(klass).items():
            if name.startswith("_") or name in seen:
                continue
            seen.add(name)
            function = getattr(member, "__func__", member)  # staticmethod, classmethod
            if inspect.isfunction(function) and function.__module__ == klass.__module__:
                yield f"{cls.__name__}.{name}", function


def utils_functions() -> Iterator[tuple[str, Callable[..., Any]]]:
    """The functions `mpaccel.utils` exports that mpaccel defines (not torch's, not tqdm's),
    cached ones (functools.cache) included."""
    for name in sorted(dir(mpaccel.utils)):
        function = inspect.unwrap(getattr(mpaccel.utils, name))
        if (
            not name.startswith("_")
            and inspect.isfunction(function)
            and function.__module__.startswith("mpaccel")
        ):
            yield f"mpaccel.utils.{name}", function


# Modules whose public functions and classes are checked whole (the tracker classes of
# tracking/files.py and tracking/services.py are not yet).
MODULES = [
    mpaccel.local_sgd,
    mpaccel.ops,
    mpaccel.preemption,
    mpaccel.tracking.base,
    mpaccel.tracking.registry,
]


def module_api(module: Any) -> Iterator[tuple[str, Callable[..., Any], str | None]]:
    """(name, function, None) for the public functions `module` defines, and for the public
    methods of its classes; (name, constructor, class docstring) for those of its classes."""
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj):
            yield f"{module.__name__}.{name}", obj, None
        elif inspect.isclass(obj) and not issubclass(obj, BaseException):
            for qualname, method in methods(obj):
                yield f"{module.__name__}.{qualname}", method, None
            if "__init__" in vars(obj):
                yield f"{module.__name__}.{name}()", obj.__init__, inspect.getdoc(obj) or ""


def parameters(function: Callable[..., Any]) -> list[str]:
    """The names an `Args:` section must give: `*args` and `**kwargs` with their stars; a
    parameter named with an underscore is mpaccel's own (Accelerator -> AcceleratorState)."""
    names = []
    for parameter in inspect.signature(function).parameters.values():
        if parameter.name in ("self", "cls") or parameter.name.startswith("_"):
            continue
        stars = {parameter.VAR_POSITIONAL: "*", parameter.VAR_KEYWORD: "**"}
        names.append(stars.get(parameter.kind, "") + parameter.name)
    return names


def documented(doc: str) -> list[str] | None:
    """The names the `Args:` section of `doc` gives, None without one."""
    lines = doc.splitlines()
    if "Args:" not in (line.strip() for line in lines):
        return None
    start = [line.strip() for line in lines].index("Args:")
    indent = len(lines[start]) - len(lines[start].lstrip())
    names = []
    for line in lines[start + 1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break  # the next section
        match = ENTRY.match(line)
        if match and len(line) - len(line.lstrip()) == indent + 4:
            names.append(match.group(1))
    return names


def problems(qualname: str, function: Callable[..., Any], doc: str | None = None) -> list[str]:
    """What `function`'s docstring lacks; or, given `doc` (a class's, for its constructor),
    what that lacks but the first line (a class's says what it is; its Args: are the
    constructor's)."""
    found = []
    if doc is None:
        doc = inspect.getdoc(function) or ""
        if not FIRST_LINE.match(doc):
            found.append(f"{qualname}: the first line does not say Collective / Not collective")
    wanted = parameters(function)
    if not wanted:
        return found
    names = documented(doc)
    if names is None:
        found.append(f"{qualname}: no Args: section for {wanted}")
    elif sorted(names) != sorted(wanted):
        found.append(f"{qualname}: Args: names {names}, the signature {wanted}")
    return found


@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: cls.__name__)
def test_state_methods_say_collective_and_name_their_args(cls: type) -> None:
    found = [p for name, method in methods(cls) for p in problems(name, method)]
    # The constructor's arguments are in the class docstring, as Accelerate's are.
    found += problems(f"{cls.__name__}()", cls.__init__, inspect.getdoc(cls) or "")
    assert not found, "\n".join(found)


def test_utils_functions_say_collective_and_name_their_args() -> None:
    found = [p for name, function in utils_functions() for p in problems(name, function)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("module", MODULES, ids=lambda module: module.__name__)
def test_module_api_says_collective_and_names_its_args(module: Any) -> None:
    found = [p for name, function, doc in module_api(module) for p in problems(name, function, doc)]
    assert not found, "\n".join(found)


def test_the_checks_find_what_they_check() -> None:
    """The collections are not empty and the parser reads a Google-style section."""
    assert dict(methods(PartialState))["PartialState.wait_for_everyone"]
    assert "mpaccel.utils.gather" in dict(utils_functions())
    assert "mpaccel.utils.is_xpu_available" in dict(utils_functions())  # cached
    api = {name: doc for name, _, doc in module_api(mpaccel.preemption)}
    assert "mpaccel.preemption.Preemption.check" in api and "mpaccel.preemption.Preemption()" in api
    assert "Accelerator.backward" in dict(methods(Accelerator))
    assert "Accelerator.deepspeed_ulysses_dl_adapter" not in dict(methods(Accelerator))

    def example(tensor: Any, *args: Any, dim: int = 0, **kwargs: Any) -> None:
        """Not collective. Text.

        Args:
            tensor (`torch.Tensor`): one, and
                more text: with a colon.
            *args: positional.
            dim: a dimension.
            **kwargs: keywords.

        Returns:
            value: not an argument.
        """

    assert problems("example", example) == []
    assert documented(inspect.getdoc(example) or "") == ["tensor", "*args", "dim", "**kwargs"]
    example.__doc__ = "Collective. No section."
    assert problems("example", example) == [
        "example: no Args: section for ['tensor', '*args', 'dim', '**kwargs']"
    ]
