"""docs/compatibility.md's name-by-name table is what scripts/compat_table.py makes of the
installed Accelerate 1.15 and this mpaccel, and every missing name has a note. Needs
`pip install accelerate==1.15.0` (the dev extra has it): skipped with the reason where it is
missing, a failure under CI. The script runs in a subprocess of its own: it imports the real
Accelerate, which must not meet tests/jobs/accelerate_shim's import hook."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mpaccel import envvars
from mpaccel.config import DeepSpeedPlugin, MegatronLMPlugin
from mpaccel.errors import REFUSED, ConfigurationError, refused

# introspection, in a python of its own: nothing to run on several ranks
pytestmark = [pytest.mark.mpi(size=1), pytest.mark.launches]

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "compat_table.py"
DOC = ROOT / "docs" / "compatibility.md"
ACCELERATE_VERSION = "1.15.0"


@pytest.fixture(scope="module")
def accelerate_installed() -> None:
    try:
        version = importlib.metadata.version("accelerate")
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version != ACCELERATE_VERSION:
        reason = (f"the compatibility table is made from accelerate=={ACCELERATE_VERSION} "
                  f"({'accelerate ' + version if version else 'no accelerate'} here); "
                  f"pip install accelerate=={ACCELERATE_VERSION}")
        if envvars.get("ci"):
            pytest.fail(reason)
        pytest.skip(reason)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")]).rstrip(os.pathsep)}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=240, check=False)


def test_the_table_in_the_docs_is_what_the_script_makes(accelerate_installed):
    result = _run("--check", str(DOC))
    assert result.returncode == 0, (
        f"{result.stdout}{result.stderr}\nregenerate: PYTHONPATH=. python scripts/compat_table.py "
        f"--write docs/compatibility.md, and give every missing name a note in "
        f"scripts/compat_notes.py"
    )


def test_a_stale_table_fails_the_check(accelerate_installed, tmp_path):
    """The check compares the whole section: a row changed by hand is found."""
    text = DOC.read_text()
    row = "| `DeepSpeedPlugin` | refused |"
    assert row in text
    stale = tmp_path / "compatibility.md"
    stale.write_text(text.replace(row, "| `DeepSpeedPlugin` | supported |", 1))
    result = _run("--check", str(stale))
    assert result.returncode == 1
    assert "is stale" in result.stdout


def test_the_table_classifies_names_by_what_mpaccel_does(accelerate_installed):
    """A few rows whose status comes from each source: the signature, the refusal marker, the
    notes."""
    table = _run().stdout
    assert "| `DeepSpeedPlugin` | refused | mpaccel does not drive DeepSpeed" in table
    assert "| `InitProcessGroupKwargs` | differs | backend=None (Accelerate: 'nccl')" in table
    refused = table.split("### `accelerate.utils`")[1].split("Refused, each with")[1]
    assert "`DummyOptim`, `DummyScheduler`" in refused.split("###")[0]
    assert "| `MODEL_NAME` | differs | Accelerate's value, which mpaccel does not use" in table
    assert "| `fp8_enabled` | differs | read-only here" in table
    assert "Absent" not in table  # every name Accelerate has is in mpaccel, if only to refuse
    supported = table.split("### `Accelerator (members)`")[1].split("###")[0]
    assert "`unwrap_model`" in supported.split("| name |")[0]  # keep_torch_compile= now


@pytest.mark.parametrize("plugin", [DeepSpeedPlugin, MegatronLMPlugin])
def test_a_refused_name_raises_what_its_marker_says(plugin):
    """The table quotes the marker: it must be the error the name raises."""
    message, hint = getattr(plugin, REFUSED)
    with pytest.raises(ConfigurationError) as caught:
        plugin(zero_stage=2)
    assert (caught.value.message, caught.value.hint) == (message, hint)
    assert hint and plugin.__name__ in message


def test_refused_marks_without_changing_the_object():
    def profile_memory() -> None:
        raise ConfigurationError("no", "use the other one")

    marked = refused("no", "use the other one")(profile_memory)
    assert marked is profile_memory
    assert getattr(marked, REFUSED) == ("no", "use the other one")


def test_the_check_names_a_missing_name_without_a_note_and_a_stale_note(monkeypatch):
    """The rules of --check on rows made up here (no Accelerate needed)."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import compat_notes
    import compat_table

    monkeypatch.setattr(compat_notes, "KEPT", {"accelerate.utils.KEPT_NAME": "data; instead"})
    monkeypatch.setattr(compat_notes, "MISSING", {"Accelerator.later": "not yet"})
    monkeypatch.setattr(compat_notes, "DIFFERS", {})
    rows = [
        compat_table.classify("accelerate.utils", "KEPT_NAME", "x", "x", found=True),
        compat_table.classify("Accelerator", "later", None, None, found=False),
        compat_table.classify("Accelerator", "forgotten", None, None, found=False),
    ]
    assert [row.status for row in rows] == ["differs", "missing", "missing"]
    assert rows[0].detail == "data; instead"
    assert compat_table.note_problems(rows) == [
        "Accelerator.forgotten: missing, and not in compat_notes.MISSING (add it, refuse it "
        "in mpaccel/absent_names.py with a reason, or say where it would go)"
    ]
    rows[1] = compat_table.Row("Accelerator", "later", "supported", "")
    assert compat_table.note_problems(rows)[1] == (
        "Accelerator.later: noted as missing but supported"
    )


def test_the_refused_names_of_the_package_are_listed_by_their_reason(accelerate_installed):
    """mpaccel/absent_names.py's placeholders are `refused`, grouped under their shared reason and
    HINT; a constant kept with Accelerate's value must equal it (else the row says so)."""
    from mpaccel import absent_names

    table = _run().stdout
    for module, names in absent_names.MODULE_NAMES.items():
        section = table.split(f"### `accelerate{module[len('mpaccel'):]}`\n")[1].split("###")[0]
        for name, reason in names.items():
            if name in absent_names.VALUES:
                assert f"| `{name}` | differs | Accelerate's value, which" in section
            else:
                line = next(x for x in section.splitlines() if f"`{name}`" in x)
                assert line.startswith("- ") and line.endswith(
                    f": {reason.why}; HINT: {reason.instead}"), line
