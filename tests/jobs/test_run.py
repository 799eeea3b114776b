"""`mpaccel run`: libraries built on Accelerate, unmodified, on mpaccel. transformers' Trainer
and TRL's SFTTrainer under `mpiexec -n 2 mpaccel run` against one process with the same global
batch (tests/jobs/hf_training.py: tiny GPT-2 built locally, no Hub, no network), refusals of
names mpaccel lacks, and the version checks with the real Accelerate out of sight.

Three training jobs (one process, two ranks DDP, two ranks FSDP2), each doing several things
and shared by the tests through module fixtures; ~35 s of wall time on an idle 2-core machine.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
import torch

from mpaccel.testing import run_mpi

pytestmark = [pytest.mark.mpi(size=1), pytest.mark.launches, pytest.mark.mpi_timeout(600)]

JOB = Path(__file__).parent / "hf_training.py"
ROOT = Path(__file__).resolve().parents[2]
MISSING = [name for name in ("transformers", "trl", "datasets")
           if importlib.util.find_spec(name) is None]
needs_hf = pytest.mark.skipif(
    bool(MISSING), reason=f"needs {', '.join(MISSING)} (`pip install -e .[dev]`)")
# Offline: nothing here may reach the Hub; caches stay in the test's directory.
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def _train(directory: Path, n: int, *mode: str) -> tuple[dict, object, Path]:
    per_device = str(8 // n)  # the same global batch at every world size
    env = {**OFFLINE, "HF_HOME": str(directory / "hf")}
    run = run_mpi(["-m", "mpaccel", "run", str(JOB), str(directory), per_device, *mode],
                  n=n, timeout=300, env=env)
    run.check()
    return json.loads((directory / "result.json").read_text()), run, directory


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("one"), 1)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("ddp"), 2)


@pytest.fixture(scope="module")
def two_ranks_fsdp(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("fsdp"), 2, "fsdp")


def _losses(steps: dict, first: int = 1) -> list[float]:
    return [steps[key][0] for key in sorted(steps, key=int) if int(key) >= first]


def _saved(job: tuple[dict, object, Path]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    result, _, directory = job
    assert "model.safetensors" in result["trainer"]["saved"]
    return load_file(directory / "trainer" / "final" / "model.safetensors")


def _check_trainer(mine: dict, reference: dict, wrapper: str) -> None:
    assert mine["world"] == 2 and reference["world"] == 1
    assert mine["wrapped"] == wrapper
    assert len(mine["steps"]) == 10
    assert _losses(mine["steps"]) == pytest.approx(_losses(reference["steps"]), abs=1e-5)
    norms = [mine["steps"][k][1] for k in sorted(mine["steps"], key=int)]
    expected = [reference["steps"][k][1] for k in sorted(reference["steps"], key=int)]
    assert norms == pytest.approx(expected, rel=1e-5)  # the whole batch's gradient
    assert mine["eval_loss"] == pytest.approx(reference["eval_loss"], abs=1e-5)
    assert mine["predictions"] == [8, 16, 64]  # every sample predicted once
    # the resumed Trainer, started from checkpoint-5, repeats steps 6-10
    assert _losses(mine["resumed"], 6) == pytest.approx(_losses(mine["steps"], 6), abs=1e-6)


@needs_hf
def test_trainer_under_mpiexec_equals_one_process_and_resumes(one_process, two_ranks):
    """evaluate, 10 steps of DDP, save, predict, resume from step 5: every step's loss and
    gradient norm are those of one process with the same global batch."""
    (reference, *_), (mine, *_) = one_process, two_ranks
    _check_trainer(mine["trainer"], reference["trainer"], "DistributedDataParallel")


@needs_hf
def test_trainer_under_fsdp2_equals_one_process_and_resumes(one_process, two_ranks_fsdp):
    (reference, *_), (mine, *_) = one_process, two_ranks_fsdp
    _check_trainer(mine["trainer"], reference["trainer"], "FSDPGPT2LMHeadModel")


@needs_hf
def test_the_saved_models_are_the_same_at_every_world_size(
    one_process, two_ranks, two_ranks_fsdp
):
    """Trainer.save_model after 10 steps: the same weights in model.safetensors from one
    process, DDP and FSDP2 (gathered whole)."""
    reference, ddp, fsdp = (_saved(job) for job in (one_process, two_ranks, two_ranks_fsdp))
    assert ddp.keys() == reference.keys() == fsdp.keys()  # the tied alias stored once
    for saved in (ddp, fsdp):
        for key in reference:
            torch.testing.assert_close(saved[key], reference[key], rtol=1e-4, atol=1e-5)


@needs_hf
def test_sft_trainer_under_mpiexec_equals_one_process(one_process, two_ranks):
    (reference, *_), (mine, *_) = one_process, two_ranks
    assert mine["sft"]["world"] == 2 and len(mine["sft"]["steps"]) == 6
    assert _losses(mine["sft"]["steps"]) == pytest.approx(
        _losses(reference["sft"]["steps"]), abs=1e-4)


@needs_hf
def test_the_main_process_alone_says_what_run_did(two_ranks):
    _, run, _ = two_ranks
    said = "mpaccel run: `accelerate` is mpaccel"
    assert run.stderr[0].count(said) == 1
    assert said not in run.stderr[1]


REFUSALS = """
import json, sys

out = {}
try:
    from accelerate.utils import DummyOptim
    DummyOptim(None)
except Exception as exc:
    out["DummyOptim"] = [type(exc).__name__, str(exc)]
try:
    import accelerate.utils.megatron_lm  # noqa: F401
except ImportError as exc:
    out["megatron_lm"] = [type(exc).__name__, str(exc)]
try:
    from accelerate import no_such_name  # noqa: F401
except ImportError as exc:
    out["no_such_name"] = [type(exc).__name__, str(exc)]
import accelerate, accelerate.utils.modeling
out["same"] = accelerate.__name__ == "mpaccel" and accelerate.utils.modeling.__name__ == (
    "mpaccel.utils.modeling")
out["argv"] = sys.argv
print(json.dumps(out))
"""


def test_run_refuses_an_absent_name_with_the_hint_of_a_direct_import(tmp_path):
    """Run as `mpaccel run -m MODULE ARGS`: the program's arguments are its own."""
    import mpaccel.utils
    from mpaccel.errors import ConfigurationError

    (tmp_path / "refusals.py").write_text(textwrap.dedent(REFUSALS))
    env = {**os.environ, **OFFLINE, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    done = subprocess.run([sys.executable, "-m", "mpaccel", "run", "-m", "refusals", "--x", "-m"],
                          env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    with pytest.raises(ConfigurationError) as direct:
        mpaccel.utils.DummyOptim(None)
    assert out["DummyOptim"] == ["ConfigurationError", str(direct.value)]
    assert "HINT: " in out["DummyOptim"][1]
    kind, message = out["megatron_lm"]
    assert kind == "ModuleNotFoundError" and "does not drive Megatron-LM" in message
    assert "HINT: " in message
    assert out["no_such_name"][0] == "ImportError" and "no_such_name" in out["no_such_name"][1]
    assert out["same"] is True
    assert out["argv"] == [str(tmp_path / "refusals.py"), "--x", "-m"]


VERSION_CHECK = """
import importlib.util, json, sys

if importlib.util.find_spec("accelerate") is None:  # without `mpaccel run`: hidden indeed
    print(json.dumps({"hidden": True}))
    sys.exit(0)
import importlib.metadata
from transformers.utils import import_utils

print(json.dumps({
    "version": importlib.metadata.version("accelerate"),
    "available": import_utils.is_accelerate_available(),
    "at_least": import_utils.is_accelerate_available("1.12.0"),
    "module": importlib.import_module("accelerate").__name__,
}))
"""


@needs_hf
def test_version_checks_pass_with_the_real_accelerate_out_of_sight(tmp_path):
    """`python -S` (no site-packages, no .pth files) with a PYTHONPATH of mpaccel and a copy of
    site-packages (symbolic links) without Accelerate: the job sees the environment of a
    machine where Accelerate was never installed."""
    site = Path(sysconfig.get_paths()["purelib"])
    visible = tmp_path / "site"
    visible.mkdir()
    for entry in site.iterdir():
        if not entry.name.lower().startswith(("accelerate", "__editable__", "mpaccel")):
            (visible / entry.name).symlink_to(entry)
    script = tmp_path / "check.py"
    script.write_text(textwrap.dedent(VERSION_CHECK))
    env = {**os.environ, **OFFLINE, "PYTHONPATH": os.pathsep.join([str(ROOT), str(visible)])}

    def run(*args: str) -> dict:
        done = subprocess.run([sys.executable, "-S", *args, str(script)], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.splitlines()[-1])

    assert run() == {"hidden": True}
    assert run("-m", "mpaccel", "run") == {
        "version": "1.15.0", "available": True, "at_least": True, "module": "mpaccel"}
