"""The repository's commit-msg hook (.githooks/commit-msg, installed by `make setup`)."""

import pathlib
import subprocess

import pytest

HOOK = pathlib.Path(__file__).resolve().parents[1] / ".githooks" / "commit-msg"


def run_hook(tmp_path: pathlib.Path, message: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "COMMIT_EDITMSG"
    path.write_text(message)
    command = ["bash", str(HOOK), str(path)]
    return subprocess.run(command, capture_output=True, text=True, timeout=30)


@pytest.mark.mpi(size=1)
@pytest.mark.parametrize(
    "message, accepted",
    [
        ("checkpoint: refuse links in rotation\n\nsymptom, cause, measurement\n", True),
        ("x" * 72 + "\n\nbody\n", True),
        ("x" * 73 + "\n\nbody\n", False),
        ("checkpoint: a subject\nand a body without the blank line\n", False),
        ("# a comment git strips\ncheckpoint: a subject\n\nbody\n", True),
        ("Merge branch 'a-long-branch-name-that-goes-on' into the main branch of it\n", True),
    ],
)
def test_the_hook_keeps_subjects_within_72_characters(tmp_path, message, accepted):
    result = run_hook(tmp_path, message)
    assert (result.returncode == 0) == accepted, result.stderr
    if not accepted:
        assert "commit-msg:" in result.stderr
