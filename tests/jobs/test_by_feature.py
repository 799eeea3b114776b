"""The examples/by_feature scripts (Accelerate's by_feature topics, written with Accelerate's
calls), run as a user would under a real mpiexec -n 2; each test checks the script's point:
the resumed run ends where the uninterrupted one did, the early stop is agreed, every
evaluation sample is counted once, and so on."""

from __future__ import annotations

import ast
import importlib.util
import json
import pathlib
import re

import pytest

from mpaccel import envvars
from mpaccel.testing import run_mpi

pytestmark = [pytest.mark.mpi(size=1), pytest.mark.launches]  # each test starts its own mpiexec
BY_FEATURE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "by_feature"
TIMEOUT = 180


def _run(script: str, *args: str, n: int = 2, env: dict[str, str] | None = None) -> str:
    """Rank 0's output of the script, which must end with exit code 0 on every rank."""
    run = run_mpi([str(BY_FEATURE / script), *args], n=n, timeout=TIMEOUT, env=env).check()
    return run.stdout[0]


def _epochs(out: str, label: str = "epoch") -> dict[str, dict]:
    """{'0': {'accuracy': ..., 'f1': ..., 'samples': ...}, ...} from 'epoch 0: {...}' lines."""
    found = re.findall(rf"^{label} (\d+): (\{{.*\}})$", out, re.M)
    return {number: ast.literal_eval(metrics) for number, metrics in found}


def _digest(out: str) -> float:
    return float(re.search(r"final weights digest: (\S+)", out).group(1))


@pytest.mark.parametrize("stateful", [
    False,
    pytest.param(True, marks=[pytest.mark.slow, pytest.mark.skipif(
        importlib.util.find_spec("torchdata") is None, reason="torchdata is not installed")]),
])
def test_checkpointing_resumes_mid_epoch_where_the_run_stood(tmp_path, stateful):
    extra = ["--use_stateful_dataloader"] if stateful else []
    whole = _run("checkpointing.py", "--checkpointing_steps", "10",
                 "--output_dir", str(tmp_path / "a"), *extra)
    # 512 samples, 2 processes x 16: 16 steps an epoch, 48 in all
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [
        "step_10", "step_20", "step_30", "step_40"]
    # step 20 is batch 4 of epoch 1
    resumed = _run("checkpointing.py", "--resume_from_checkpoint", str(tmp_path / "a/step_20"),
                   "--output_dir", str(tmp_path / "b"), *extra)
    assert "Resumed from checkpoint" in resumed
    assert list(_epochs(resumed)) == ["1", "2"]
    assert _epochs(resumed) == {k: v for k, v in _epochs(whole).items() if k != "0"}
    assert _digest(resumed) == _digest(whole)  # the same model, bit for bit at 2 processes
    assert _epochs(whole)["2"]["accuracy"] > 0.8  # and it learnt


def test_memory_retries_with_smaller_batches_on_every_process():
    out = _run("memory.py", "--starting_batch_size", "64", "--device_capacity", "50",
               "--num_epochs", "1")
    # 0.9 times the previous size after each out-of-memory error, until one fits
    assert re.findall(r"trying batch size (\d+)", out) == ["64", "57", "51", "45"]
    assert "trained with batch size 45" in out
    assert _epochs(out)["0"]["samples"] == 203


def test_automatic_gradient_accumulation_keeps_the_observed_batch():
    out = _run("automatic_gradient_accumulation.py", "--batch_size", "64",
               "--device_capacity", "20", "--num_epochs", "1")
    assert re.findall(r"batch size (\d+) x (\d+) accumulation steps", out) == [
        ("64", "1"), ("32", "2"), ("16", "4")]
    assert _epochs(out)["0"]["samples"] == 203


def test_local_sgd_ends_with_one_model():
    out = _run("local_sgd.py", "--local_sgd_steps", "4", "--num_epochs", "2")
    assert "models agree across processes: True" in out
    assert _epochs(out)["1"]["accuracy"] > 0.8


def test_ddp_comm_hook_compresses_the_gradients():
    plain = _run("ddp_comm_hook.py", "--ddp_comm_hook", "no", "--num_epochs", "1")
    fp16 = _run("ddp_comm_hook.py", "--ddp_comm_hook", "fp16", "--num_epochs", "1")
    for out in (plain, fp16):
        assert "models agree across processes: True" in out
    # fp16 gradients round differently: a slightly different model, not a different training
    assert _digest(plain) != _digest(fp16)
    assert abs(_digest(plain) - _digest(fp16)) < 1e-2


def test_profiler_writes_one_trace_per_process(tmp_path):
    out = _run("profiler.py", "--record_shapes", "--output_trace_dir", str(tmp_path))
    # The main process's table: its 8 costliest ops by self CPU time. Which ops those are
    # depends on the load (under CI's, gloo's all-reduce and copies pushed aten::addmm out of
    # it once; another time DDP's forward, the loader and AdamW left one aten:: row in it),
    # so the table is checked for 8 rows with one aten:: op, and the traces for addmm.
    assert "Self CPU time total" in out, out
    rows = re.findall(r"^\s*\S.*\s(\d+)\s*$", out, re.M)  # each ends with its # of Calls
    assert len(rows) >= 8 and re.search(r"^\s*aten::\w+ ", out, re.M), out
    for rank in (0, 1):
        trace = json.loads((tmp_path / f"profile_{rank}.json").read_text())
        assert any(e.get("name") == "aten::addmm" for e in trace["traceEvents"])


def test_tracking_logs_every_epoch_to_tensorboard(tmp_path):
    if importlib.util.find_spec("tensorboard") is None:
        reason = "tensorboard is not installed"
        if envvars.get("ci"):
            pytest.fail(reason)
        pytest.skip(reason)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # log_with="all" starts every installed tracker: wandb offline, MLflow in a local store
    offline = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true",
               "MLFLOW_TRACKING_URI": (tmp_path / "mlruns").as_uri(),
               "MLFLOW_ALLOW_FILE_STORE": "true"}
    out = _run("tracking.py", "--with_tracking", "--project_dir", str(tmp_path), env=offline)
    scalars: dict[str, list[tuple[int, float]]] = {}
    for events in tmp_path.rglob("events.out.tfevents.*"):
        reader = EventAccumulator(str(events))
        reader.Reload()
        for tag in reader.Tags()["scalars"]:
            scalars[tag] = [(e.step, e.value) for e in reader.Scalars(tag)]
    assert {"accuracy", "f1", "train_loss", "epoch"} <= set(scalars), scalars
    accuracies = {str(step): value for step, value in scalars["accuracy"]}
    assert accuracies == pytest.approx({k: v["accuracy"] for k, v in _epochs(out).items()})
    assert [step for step, _ in scalars["epoch"]] == [0, 1, 2]


def test_early_stopping_stops_every_process_at_the_same_step():
    out = run_mpi([str(BY_FEATURE / "early_stopping.py"), "--patience", "3"], n=2,
                  timeout=TIMEOUT).check().stdout
    stops = [re.findall(r"process (\d) stops at epoch (\d+) step (\d+)", o) for o in out]
    assert [s[0][0] for s in stops] == ["0", "1"]
    assert stops[0][0][1:] == stops[1][0][1:]  # the same epoch and step on both
    epoch = int(stops[0][0][1])
    assert list(_epochs(out[0])) == [str(e) for e in range(epoch + 1)]
    assert epoch < 9  # of 10: it did stop early


def test_gradient_accumulation_matches_a_larger_batch():
    accumulated = _run("gradient_accumulation.py", "--gradient_accumulation_steps", "2",
                       "--batch_size", "8")
    larger = _run("gradient_accumulation.py", "--gradient_accumulation_steps", "1",
                  "--batch_size", "16")
    # The same 32 samples per optimizer step: the same model, up to float32 rounding
    assert _digest(accumulated) == pytest.approx(_digest(larger), abs=1e-5)
    assert _epochs(accumulated)["2"] == _epochs(larger)["2"]


def test_multi_process_metrics_count_each_sample_once():
    out = _run("multi_process_metrics.py")
    assert [m["samples"] for m in _epochs(out).values()] == [203, 203]
    assert out.count("the same by hand: True; each sample once, in order: True") == 2


def test_cross_validation_averages_the_folds_on_the_test_set():
    out = _run("cross_validation.py", "--num_folds", "3", "--num_epochs", "1")
    held_out = [ast.literal_eval(m)["samples"]
                for m in re.findall(r"^fold \d epoch 0: (\{.*\})$", out, re.M)]
    assert sum(held_out) == 512 and max(held_out) - min(held_out) <= 3  # each held out once
    final = ast.literal_eval(re.search(r"3 folds averaged, on the test set: (\{.*\})", out)[1])
    assert final["samples"] == 203 and final["accuracy"] > 0.8
