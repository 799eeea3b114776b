"""Job-script templates shipped as package data, printed by `mpaccel slurm template NAME`.

Each template's second line says what it is for, before a colon; `@TRAIN@` stands for the
training command (`python -m mpaccel.examples.train` unless the user names a script or module).
"""

from __future__ import annotations

from importlib import resources

PLACEHOLDER = "@TRAIN@"
DEFAULT_COMMAND = "python -m mpaccel.examples.train"


def _folder(kind: str) -> resources.abc.Traversable:
    return resources.files(__name__).joinpath(kind)


def names(kind: str = "slurm") -> list[str]:
    """The templates of `kind`, by name (file name without its suffix), sorted."""
    return sorted(
        entry.name.rsplit(".", 1)[0]
        for entry in _folder(kind).iterdir()
        if entry.name.endswith(".sbatch")
    )


def text(name: str, kind: str = "slurm") -> str:
    """The template as shipped, placeholder included; KeyError for an unknown name."""
    if name not in names(kind):
        raise KeyError(name)
    return _folder(kind).joinpath(f"{name}.sbatch").read_text(encoding="utf-8")


def summary(name: str, kind: str = "slurm") -> str:
    """What the template is for: its second line up to the colon ("One node, 4 tasks")."""
    return text(name, kind).splitlines()[1].lstrip("# ").split(":", 1)[0]


def render(name: str, command: str = DEFAULT_COMMAND, kind: str = "slurm") -> str:
    """The template with `command` as the training command."""
    return text(name, kind).replace(PLACEHOLDER, command)
