"""Experiment trackers, each through its own library, offline or on a local store (no network):
hyperparameters and metrics are read back from what the library wrote. Trackers run on the
main process only; the same bodies run at size 1 and under mpiexec -n 2/4. A tracker whose
package is missing is skipped with the reason (the dev extra installs the ones CI runs)."""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import json
import sqlite3
import struct
import sys
import time
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from mpaccel import distributed, tracking
from mpaccel.errors import ConfigurationError, MpaccelWarning
from mpaccel.tracking import GeneralTracker
from mpaccel.utils import LoggerType
from tests.conftest import accelerator

CONFIG = {"lr": 0.1, "optimizer": "adam"}
HISTORY = [(1, 0.5), (2, 0.25)]


def _needs(package: str) -> None:
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"the {package} package is not installed (pip install {package})")


# -- each library: how to keep it local, and how to read back what it wrote ------------------
# setup(monkeypatch, directory) -> init_kwargs; live(tracker object) -> what can only be read
# while the run is open; read(directory, live) -> (config, [(step, loss)]); runs(directory).


def _leveldb_records(path: str) -> list[bytes]:
    """The records of a LevelDB-log file (the format of wandb's .wandb run files): 7-byte
    file header, 32 KiB blocks of (crc32, length, type) + data; FIRST/MIDDLE/LAST joined."""
    data = Path(path).read_bytes()
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            records.append(pending)
            pending = b""
    return records


def _wandb_setup(monkeypatch, directory):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    return {"dir": str(directory)}


def _wandb_read(directory, live):
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(f"{directory}/wandb/offline-run-*/run-*.wandb")
    # run.finish() can return before wandb's service process has written the whole file
    # (1 read in 6 came back empty): wait for the run's closing record.
    deadline = time.monotonic() + 60
    while True:
        records = [wandb_internal_pb2.Record.FromString(raw) for raw in _leveldb_records(path)]
        kinds = [record.WhichOneof("record_type") for record in records]
        if "exit" in kinds or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    config, history = {}, []
    for record, kind in zip(records, kinds):
        if kind in ("config", "history"):
            items = record.config.update if kind == "config" else record.history.item
            values = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
            if kind == "config":
                config.update(values)
            else:
                history.append((values["_step"], values["loss"]))
    return config, history


def _mlflow_uri(directory):
    return f"file://{directory}/mlruns"


def _mlflow_setup(monkeypatch, directory):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", _mlflow_uri(directory))
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for the opt-in
    return {}


def _mlflow_runs(directory):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=_mlflow_uri(directory))
    experiment = client.get_experiment_by_name("proj")
    return [] if experiment is None else client.search_runs([experiment.experiment_id])


def _mlflow_read(directory, live):
    from mlflow import MlflowClient

    (run,) = _mlflow_runs(directory)
    client = MlflowClient(tracking_uri=_mlflow_uri(directory))
    history = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")]
    return run.data.params, history


def _aim_live(run):
    (loss,) = [m for m in run.metrics() if m.name == "loss"]
    return run["hparams"], [(step, values[0]) for step, values in loss.data.items()]


def _aim_runs(directory):
    from aim import Repo

    return Repo.from_path(str(directory)).list_all_runs()


def _comet_setup(monkeypatch, directory):
    monkeypatch.setenv("COMET_OFFLINE_DIRECTORY", str(directory / "comet"))
    return {"online": False}


def _comet_read(directory, live):
    (archive,) = glob.glob(f"{directory}/comet/*.zip")
    config, history = {}, []
    with zipfile.ZipFile(archive) as zipped:
        for line in zipped.read("messages.json").decode().splitlines():
            message = json.loads(line)
            payload = message["payload"]
            if message["type"] == "parameter_msg" and payload["param"]["source"] == "manual":
                config[payload["param"]["paramName"]] = payload["param"]["paramValue"]
            elif message["type"] == "metric_msg" and payload["metric"]["metricName"] == "loss":
                history.append((payload["metric"]["step"], payload["metric"]["metricValue"]))
    return config, history


def _clearml_setup(monkeypatch, directory):
    monkeypatch.setenv("CLEARML_OFFLINE_MODE", "1")
    monkeypatch.setenv("CLEARML_CACHE_DIR", str(directory / "clearml"))
    monkeypatch.setenv("HOME", str(directory))  # ~/.clearml: its session file
    frameworks = ("matplotlib", "tensorflow", "tensorboard", "pytorch", "xgboost", "scikit",
                  "fastai", "lightgbm", "hydra", "tfdefines", "joblib", "megengine",
                  "catboost", "gradio")
    return {  # no repository scan of the test session's checkout (minutes), no patching
        "auto_connect_frameworks": {"detect_repository": False, **dict.fromkeys(frameworks, False)},
        "auto_connect_arg_parser": False,
        "auto_connect_streams": False,
        "auto_resource_monitoring": False,
    }


def _clearml_read(directory, live):
    folder = Path(live)
    task = json.loads((folder / "task.json").read_text())
    text = task["configuration"]["General"]["value"]
    config = dict(line.split(" = ", 1) for line in text.splitlines())
    config = {k: json.loads(v) for k, v in config.items()}
    events = json.loads("[" + (folder / "metrics.jsonl").read_text().replace("]\n[", ",")[1:])
    history = [(e["iter"], e["value"]) for e in events if e.get("metric") == "loss"]
    return config, history


def _dvclive_read(directory, live):
    import yaml

    base = directory / "dvclive"
    config = yaml.safe_load((base / "params.yaml").read_text())
    rows = (base / "plots" / "metrics" / "loss.tsv").read_text().splitlines()[1:]
    history = [(int(step), float(value)) for step, value in (row.split("\t") for row in rows)]
    return config, history


def _swanlab_read(directory, live):
    import yaml
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    (run_dir,) = glob.glob(f"{directory}/swanlab/run-*")
    text = (Path(run_dir) / "files" / "config.yaml").read_text()
    config = {k: v["value"] for k, v in yaml.safe_load(text).items()}
    reader = DataStoreReader()
    reader.open(glob.glob(f"{run_dir}/run-*.swanlab")[0])
    history = []
    for raw in reader:
        record = Record()
        record.ParseFromString(raw)
        if record.HasField("scalar") and record.scalar.key == "loss":
            history.append((record.scalar.step, record.scalar.value.number))
    reader.close()
    return config, history


def _trackio_setup(monkeypatch, directory):
    monkeypatch.setenv("TRACKIO_DIR", str(directory / "trackio"))
    return {"auto_log_cpu": False}


def _trackio_read(directory, live):
    with contextlib.closing(sqlite3.connect(directory / "trackio" / "proj.db")) as db:
        ((config,),) = db.execute("SELECT config FROM configs").fetchall()
        rows = db.execute("SELECT step, metrics FROM metrics ORDER BY step").fetchall()
    return json.loads(config), [(step, json.loads(values)["loss"]) for step, values in rows]


def _tensorboard_read(directory, live):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    run_dir = directory / "proj"
    events = EventAccumulator(str(run_dir))
    events.Reload()
    history = [(e.step, e.value) for e in events.Scalars("loss")]
    (yml,) = run_dir.glob("*/hparams.yml")  # Accelerate's copy of the configuration
    config = json.loads(yml.read_text())
    # add_hparams writes the HPARAMS tab's session into a directory of its own
    (session,) = [p for p in run_dir.iterdir() if p.is_dir() and p != yml.parent]
    tab = EventAccumulator(str(session))
    tab.Reload()
    content = tab.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    shown = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert shown["lr"].number_value == 0.1 and shown["optimizer"].string_value == "adam"
    return config, history


CASES = {  # name: (package, setup, live, read, runs)
    "tensorboard": ("tensorboard", None, None, _tensorboard_read,
                    lambda d: list((d / "proj").glob("events.out.tfevents.*"))),
    "wandb": ("wandb", _wandb_setup, None, _wandb_read,
              lambda d: glob.glob(f"{d}/wandb/offline-run-*")),
    "mlflow": ("mlflow", _mlflow_setup, None, _mlflow_read, _mlflow_runs),
    "aim": ("aim", lambda mp, d: {"system_tracking_interval": None}, _aim_live,
            lambda d, live: live, _aim_runs),
    "comet_ml": ("comet_ml", _comet_setup, None, _comet_read,
                 lambda d: glob.glob(f"{d}/comet/*.zip")),
    "clearml": ("clearml", _clearml_setup, lambda task: task.get_offline_mode_folder(),
                _clearml_read, lambda d: glob.glob(f"{d}/clearml/offline/offline-*.zip")),
    "dvclive": ("dvclive", lambda mp, d: {"dir": str(d / "dvclive"), "save_dvc_exp": False},
                None, _dvclive_read, lambda d: glob.glob(f"{d}/dvclive/params.yaml")),
    "swanlab": ("swanlab", lambda mp, d: {"mode": "offline", "log_dir": str(d / "swanlab")},
                None, _swanlab_read, lambda d: glob.glob(f"{d}/swanlab/run-*")),
    "trackio": ("trackio", _trackio_setup, None, _trackio_read,
                lambda d: glob.glob(f"{d}/trackio/*.db")),
}


# At most 2 ranks: the library logs on the main process alone, and what N ranks add is each
# rank importing it (wandb: 33 s of the -n 4 stage on 2 cores); 2 ranks show the others quiet.
@pytest.mark.mpi(max_size=2)
@pytest.mark.parametrize("name", list(CASES))
def test_tracker_records_hparams_and_metrics_through_its_library(
    name, comm, mpi_tmp_path, monkeypatch
):
    package, setup, live, read, runs = CASES[name]
    _needs(package)
    directory = mpi_tmp_path
    # Some libraries write beside the script too (dvclive runs `dvc init` in the enclosing git
    # repository): the test's directory, not the checkout the tests run from.
    monkeypatch.chdir(directory)
    init_kwargs = setup(monkeypatch, directory) if setup else {}
    acc = accelerator(log_with=name, project_dir=str(directory))
    assert acc.log_with == [name]
    acc.init_trackers("proj", config=CONFIG, init_kwargs={name: init_kwargs})
    acc.log({"loss": 0.5}, step=1)
    acc.log({"loss": 0.25}, step=2)
    tracker, unwrapped = acc.get_tracker(name), acc.get_tracker(name, unwrap=True)
    opened = live(unwrapped) if live and acc.is_main_process else None
    acc.end_training()
    assert not distributed.is_initialized()
    if acc.is_main_process:
        assert type(tracker) is tracking.LOGGER_TYPE_TO_CLASS[name] and tracker.name == name
        assert unwrapped is tracker.tracker and unwrapped is not None
        config, history = read(directory, opened)
        assert {k: str(v) for k, v in config.items() if k in CONFIG} == {
            k: str(v) for k, v in CONFIG.items()
        }
        assert history == HISTORY
    else:  # nothing started here: a blank tracker, whatever is asked
        assert type(tracker) is GeneralTracker and type(unwrapped) is GeneralTracker
        tracker.log({"loss": 1.0}, step=3)
    comm.Barrier()
    if acc.is_main_process:
        assert len(runs(directory)) == 1  # the other processes started none


def test_a_tracker_whose_package_is_missing_is_left_out_with_a_warning(comm, monkeypatch):
    # Accelerate warns and trains on; a hard error stopped scripts naming wandb on machines
    # without it. None in sys.modules blocks an import: wandb is missing for this test.
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setattr(tracking.registry, "_warned", set())
    recorder = _Recorder()
    for attempt in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            acc = accelerator(log_with=["wandb", recorder, LoggerType.WANDB])
        said = [w for w in caught if "wandb" in str(w.message)]
        if comm.rank == 0 and attempt == 0:
            assert len(said) == 1 and "HINT: pip install wandb" in str(said[0].message)
            assert issubclass(said[0].category, MpaccelWarning)  # a UserWarning too
        else:  # on the main process only, once per name
            assert said == []
        assert acc.log_with == [recorder]
    acc.init_trackers("run", config={"lr": 0.1})
    acc.log({"loss": 1.0}, step=1)
    assert isinstance(acc.get_tracker("recorder"), GeneralTracker)
    acc.end_training()
    assert recorder.calls == ([("config", {"lr": 0.1}), ("log", {"loss": 1.0}, 1, {}),
                               ("finish",)] if comm.rank == 0 else [])


def test_all_is_every_installed_tracker(comm, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    installed = [n for n in tracking.LOGGER_TYPE_TO_CLASS if tracking.is_available(n)]
    assert "wandb" not in installed
    acc = accelerator(log_with=LoggerType.ALL)
    assert acc.log_with == installed == tracking.get_available_trackers()  # Accelerate's order
    if importlib.util.find_spec("tensorboard"):
        assert "tensorboard" in installed
    recorder = _Recorder()
    assert accelerator(log_with=["all", recorder]).log_with == [recorder, *installed]


def test_unknown_names_are_an_error_naming_the_known_ones(comm):
    with pytest.raises(ConfigurationError, match=r"unknown tracker\(s\) \['wandbb'\].*'mlflow'"):
        accelerator(log_with=["tensorboard", "wandbb"])


def test_a_registered_tracker_class_is_built_by_name(comm, monkeypatch):
    monkeypatch.setattr(tracking.registry, "LOGGER_TYPE_TO_CLASS",
                        dict(tracking.LOGGER_TYPE_TO_CLASS))
    built = []

    class Named(_Recorder):
        name = "named"

        def __init__(self, run_name, **kwargs):
            super().__init__()
            built.append((run_name, kwargs))

    tracking.register_tracker_class(Named)
    acc = accelerator(log_with="named")
    acc.init_trackers("proj", init_kwargs={"named": {"tag": "x"}})
    assert built == ([("proj", {"tag": "x"})] if comm.rank == 0 else [])
    with pytest.raises(ValueError, match="GeneralTracker subclass"):
        tracking.register_tracker_class(object)
    acc.end_training()


def test_a_tracker_writing_files_needs_a_logging_dir_on_every_rank(comm):
    _needs("tensorboard")
    acc = accelerator(log_with="tensorboard")
    with pytest.raises(ConfigurationError, match=r"\['tensorboard'\] write files"):
        acc.init_trackers("run")  # every rank raises: none is left waiting for rank 0


class _Recorder(GeneralTracker):
    name = "recorder"
    requires_logging_directory = False

    def __init__(self):
        super().__init__()
        self.calls = []

    @property
    def tracker(self):
        return self.calls

    def store_init_configuration(self, values):
        self.calls.append(("config", dict(values)))

    def log(self, values, step=None, **kwargs):
        self.calls.append(("log", dict(values), step, kwargs))

    def finish(self):
        self.calls.append(("finish",))


def test_a_tracker_class_without_its_attributes_is_refused():
    class Nameless(GeneralTracker):
        pass

    with pytest.raises(NotImplementedError, match="name and requires_logging_directory"):
        Nameless()


def test_on_main_process_follows_the_trackers_main_process_only(comm):
    accelerator()

    class Counter(_Recorder):
        @tracking.on_main_process
        def log(self, values, step=None, **kwargs):
            super().log(values, step)

    everywhere, main_only = Counter(), Counter()
    everywhere.main_process_only = False
    for counter in (everywhere, main_only):
        counter.log({"x": 1})
    assert len(everywhere.calls) == 1
    assert len(main_only.calls) == (1 if comm.rank == 0 else 0)


def test_tensorboard_converts_tensors_and_skips_what_it_cannot_log(comm, mpi_tmp_path):
    _needs("tensorboard")
    acc = accelerator(log_with="tensorboard", project_dir=str(mpi_tmp_path))
    acc.init_trackers("run", config={"lr": torch.tensor(0.5), "sizes": [1, 2], "none": None})
    acc.log({"loss": 0.5, "note": "ok", "parts": {"a": 1.0, "b": 2.0}}, step=1)
    # one-element tensors and numpy scalars are numbers; what cannot be logged is skipped with
    # a warning (raising, on the main process only, would end the whole job)
    with pytest.warns(RuntimeWarning, match="cannot log 'vector'") if acc.is_main_process \
            else contextlib.nullcontext():
        acc.log(
            {"loss": torch.tensor(0.25), "lr": np.float32(0.5), "vector": torch.ones(3)}, step=2
        )
    writer = acc.get_tracker("tensorboard", unwrap=True)
    acc.end_training()
    if acc.is_main_process:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(writer.log_dir)
        events.Reload()
        assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 0.5), (2, 0.25)]
        assert [(e.step, e.value) for e in events.Scalars("lr")] == [(2, 0.5)]
        assert writer.file_writer is None  # end_training closed it
        (yml,) = Path(writer.log_dir).glob("*/hparams.yml")
        assert json.loads(yml.read_text()) == {"lr": "tensor(0.5000)", "sizes": [1, 2],
                                               "none": None}


def test_mlflow_logs_numbers_and_skips_the_rest(comm, mpi_tmp_path, monkeypatch):
    _needs("mlflow")
    _mlflow_setup(monkeypatch, mpi_tmp_path)
    acc = accelerator(log_with="mlflow")
    acc.init_trackers("proj", config={f"p{i}": i for i in range(150)})  # > 100: batched
    context = pytest.warns(RuntimeWarning, match="mlflow cannot log 'note'") \
        if acc.is_main_process else contextlib.nullcontext()
    with context:
        acc.log({"loss": torch.tensor(0.5), "note": "text"}, step=1)
    acc.end_training()
    if acc.is_main_process:
        (run,) = _mlflow_runs(mpi_tmp_path)
        assert len(run.data.params) == 150 and run.data.metrics == {"loss": 0.5}


def test_trackers_log_on_the_main_process_and_end_training(comm):
    recorder = _Recorder()
    acc = accelerator(log_with=[recorder])
    acc.init_trackers("run", config={"lr": 0.1})
    acc.log({"loss": 1.5}, step=3, log_kwargs={"recorder": {"flush": True}, "other": {"x": 1}})
    tracker = acc.get_tracker("recorder")
    if acc.is_main_process:
        assert tracker is recorder and acc.get_tracker("recorder", unwrap=True) is recorder.calls
        with pytest.raises(ConfigurationError, match="no tracker named 'wandb'"):
            acc.get_tracker("wandb")
    else:  # a blank one: the same code runs everywhere
        assert tracker is not recorder
        tracker.log({"loss": 0.0}, step=0)
    acc.end_training()
    assert not distributed.is_initialized()
    expected = [("config", {"lr": 0.1}), ("log", {"loss": 1.5}, 3, {"flush": True}), ("finish",)]
    assert recorder.calls == (expected if acc.is_main_process else [])


def test_get_tracker_without_running_trackers_is_blank_everywhere(comm):
    # Accelerate's answer when nothing runs (log_with named a missing package, say)
    acc = accelerator()
    acc.init_trackers("run")
    assert type(acc.get_tracker("wandb", unwrap=True)) is GeneralTracker
    acc.end_training()


# -- the variables Accelerate's trackers read (mpaccel.envvars's tracker rows) -------------------


@pytest.mark.mpi(max_size=2)  # as the test above: mlflow logs on the main process alone
def test_mlflow_variables_take_precedence_over_the_arguments(comm, mpi_tmp_path, monkeypatch):
    """MLFLOW_EXPERIMENT_NAME, MLFLOW_TAGS and MLFLOW_NESTED_RUN over init_kwargs, as in
    Accelerate: the run lands in the variable's experiment, with its tags, nested in the run
    the script already has open."""
    _needs("mlflow")
    import mlflow
    from mlflow import MlflowClient

    _mlflow_setup(monkeypatch, mpi_tmp_path)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    monkeypatch.setenv("MLFLOW_TAGS", '{"team": "env", "stage": "1"}')
    monkeypatch.setenv("MLFLOW_NESTED_RUN", "true")
    acc = accelerator(log_with="mlflow")
    parent = mlflow.start_run(run_name="sweep") if acc.is_main_process else None
    try:
        acc.init_trackers("proj", init_kwargs={"mlflow": {"tags": {"team": "argument"},
                                                          "nested_run": False}})
        acc.log({"loss": 0.5}, step=1)
        acc.end_training()
    finally:
        if parent is not None:
            mlflow.end_run()
    if acc.is_main_process:
        client = MlflowClient(tracking_uri=_mlflow_uri(mpi_tmp_path))
        assert client.get_experiment_by_name("proj") is None
        experiment = client.get_experiment_by_name("from-env")
        runs = client.search_runs([experiment.experiment_id], "tags.team = 'env'")
        (run,) = runs
        assert run.data.tags["stage"] == "1" and run.data.metrics == {"loss": 0.5}
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id


def test_mlflow_run_id_resumes_that_run_whatever_the_argument(comm, mpi_tmp_path, monkeypatch):
    _needs("mlflow")
    from mlflow import MlflowClient

    _mlflow_setup(monkeypatch, mpi_tmp_path)
    acc = accelerator(log_with="mlflow")
    if acc.is_main_process:
        client = MlflowClient(tracking_uri=_mlflow_uri(mpi_tmp_path))
        earlier = client.create_run(client.create_experiment("proj")).info.run_id
        client.set_terminated(earlier)
        monkeypatch.setenv("MLFLOW_RUN_ID", earlier)
    acc.init_trackers("proj", init_kwargs={"mlflow": {"run_id": "0" * 32}})
    acc.log({"loss": 0.25}, step=2)
    acc.end_training()
    if acc.is_main_process:
        (run,) = _mlflow_runs(mpi_tmp_path)
        assert run.info.run_id == earlier and run.data.metrics == {"loss": 0.25}


def test_mlflow_tags_as_json_text_and_flags_as_booleans(monkeypatch):
    """What the tracker makes of the variables and of a JSON string argument; MLflow itself
    is not needed to build the tracker (it is imported by start())."""
    monkeypatch.delenv("MLFLOW_TAGS", raising=False)
    monkeypatch.delenv("MLFLOW_NESTED_RUN", raising=False)
    tracker = tracking.MLflowTracker("proj", tags='{"a": "b"}', nested_run=True)
    assert tracker.tags == {"a": "b"} and tracker.nested_run is True
    monkeypatch.setenv("MLFLOW_NESTED_RUN", "false")  # Accelerate would nest: "false" is text
    monkeypatch.setenv("MLFLOW_TAGS", '{"x": 1}')
    tracker = tracking.MLflowTracker("proj", tags={"a": "b"}, nested_run=True)
    assert tracker.tags == {"x": 1} and tracker.nested_run is False
    with pytest.raises(ConfigurationError, match=r"tags='\[1\]'.*not a JSON object"):
        monkeypatch.delenv("MLFLOW_TAGS")
        tracking.MLflowTracker("proj", tags="[1]")


@pytest.mark.parametrize("value", ["{oops", "[1, 2]", '"text"', "[" * 60_000, "{" * 70_000])
def test_a_bad_mlflow_tags_variable_is_refused_at_start_up_by_name(value):
    from mpaccel import envvars

    with pytest.raises(ConfigurationError, match=r"^environment variable MLFLOW_TAGS=.* is not "
                       r"a JSON object.*\nHINT: set MLFLOW_TAGS .*docs/tracking.md") as caught:
        envvars.check({"MLFLOW_TAGS": value})
    assert len(str(caught.value)) < 600  # a long value is quoted shortened
    with pytest.raises(ConfigurationError, match="MLFLOW_NESTED_RUN='sometimes' is not a boolean"):
        envvars.check({"MLFLOW_NESTED_RUN": "sometimes"})


def test_clearml_names_come_from_kwargs_then_variables_then_run_name(monkeypatch):
    """ClearML's package is not installed here: this checks the arguments start() gives
    Task.init, not ClearML itself."""
    monkeypatch.delenv("CLEARML_PROJECT", raising=False)
    monkeypatch.delenv("CLEARML_TASK", raising=False)
    tracker = tracking.ClearMLTracker("run", tags=["t"])
    assert tracker.task_arguments() == {"project_name": "run", "task_name": "run", "tags": ["t"]}
    monkeypatch.setenv("CLEARML_PROJECT", "project-env")
    monkeypatch.setenv("CLEARML_TASK", "task-env")
    assert tracker.task_arguments() == {
        "project_name": "project-env", "task_name": "task-env", "tags": ["t"]
    }
    tracker = tracking.ClearMLTracker("run", task_name="task-kwarg")
    assert tracker.task_arguments() == {"project_name": "project-env", "task_name": "task-kwarg"}
