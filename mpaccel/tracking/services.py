"""Trackers whose library talks to a service (or keeps an offline copy for it): Weights &
Biases, MLflow, Comet, ClearML, SwanLab, Trackio. Offline modes and local stores are each
library's own settings (WANDB_MODE=offline, a file: or sqlite: MLFLOW_TRACKING_URI, ...): see
docs/tracking.md. Each library is imported in `start()`, so that naming a class needs none."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .. import envvars
from ..errors import ConfigurationError
from .base import GeneralTracker, number, numbers_only, on_main_process, skipped


class _RunTracker(GeneralTracker):
    """A library whose `init(project=...)` returns a run with `.log(values, step=)` and
    `.finish()`: wandb, swanlab, trackio. Accelerate runs them with main_process_only False
    (a tracker built by hand may run on every process; the Accelerator starts it on one)."""

    requires_logging_directory = False
    main_process_only = False
    module = ""

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.init_kwargs = kwargs
        self.run: Any = None

    def _library(self) -> Any:
        return __import__(self.module)

    @on_main_process
    def start(self) -> None:
        self.run = self._library().init(project=self.run_name, **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.run

    @on_main_process
    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        self.run.config.update(dict(values))

    @on_main_process
    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """`values` as they are to the run's log (`**kwargs` too)."""
        self.run.log(dict(values), step=step, **kwargs)

    @on_main_process
    def log_images(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Lists of images (arrays or PIL images), one list per key."""
        image = self._library().Image
        for key, images in values.items():
            self.log({key: [image(i) for i in images]}, step=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        self.run.finish()


class WandBTracker(_RunTracker):
    """A Weights & Biases run, `wandb.init(project=run_name, **kwargs)`."""

    name = "wandb"
    module = "wandb"

    @on_main_process
    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        self.run.config.update(dict(values), allow_val_change=True)

    @on_main_process
    def log_table(
        self,
        table_name: str,
        columns: list[str] | None = None,
        data: list[list[Any]] | None = None,
        dataframe: Any = None,
        step: int | None = None,
        **kwargs: Any,
    ) -> None:
        """A wandb.Table from `columns` and `data`, or from `dataframe`."""
        import wandb

        header: Any = columns
        table = wandb.Table(columns=header, data=data, dataframe=dataframe)
        self.log({table_name: table}, step=step, **kwargs)


class SwanLabTracker(_RunTracker):
    """A SwanLab run, `swanlab.init(project=run_name, **kwargs)`."""

    name = "swanlab"
    module = "swanlab"

    @on_main_process
    def start(self) -> None:
        super().start()
        self.run.config["FRAMEWORK"] = "mpaccel"  # Accelerate records itself there too


class TrackioTracker(_RunTracker):
    """A Trackio run, `trackio.init(project=run_name, **kwargs)` (local by default)."""

    name = "trackio"
    module = "trackio"


def _tags(tags: Mapping[str, Any] | str | None) -> dict[str, Any] | None:
    """MLflow tags as a dict: a string is decoded as a JSON object, as Accelerate does."""
    if not isinstance(tags, str):
        return None if tags is None else dict(tags)
    try:
        return envvars.JsonObject().parse(tags)
    except ValueError as exc:
        raise ConfigurationError(
            f"MLflowTracker(tags={tags!r}): the text is not a JSON object",
            'pass a dict, or a JSON object as text: tags=\'{"team": "nlp"}\'.',
        ) from exc


class MLflowTracker(GeneralTracker):
    """An MLflow run in the experiment `experiment_name` (created with `logging_dir` as its
    artifact location if new). As in Accelerate, MLFLOW_EXPERIMENT_NAME, MLFLOW_RUN_ID (resume
    that run), MLFLOW_TAGS (a JSON object) and MLFLOW_NESTED_RUN (a boolean) take precedence
    over the arguments; `tags` may be a JSON string too. The store is MLflow's own setting
    (MLFLOW_TRACKING_URI)."""

    name = "mlflow"
    requires_logging_directory = False

    def __init__(
        self,
        experiment_name: str | None = None,
        logging_dir: str | os.PathLike[str] | None = None,
        run_id: str | None = None,
        tags: dict[str, Any] | str | None = None,
        nested_run: bool | None = False,
        run_name: str | None = None,
        description: str | None = None,
    ) -> None:
        super().__init__()
        self.experiment_name = envvars.get("mlflow_experiment_name") or experiment_name
        self.logging_dir = None if logging_dir is None else os.fspath(logging_dir)
        self.run_id = envvars.get("mlflow_run_id") or run_id
        from_env = envvars.get_json("mlflow_tags")
        self.tags = from_env if from_env is not None else _tags(tags)
        self.nested_run = envvars.get_bool("mlflow_nested_run", bool(nested_run))
        self.run_name = run_name
        self.description = description
        self.active_run: Any = None

    @on_main_process
    def start(self) -> None:
        import mlflow

        found = mlflow.search_experiments(filter_string=f"name = '{self.experiment_name}'")
        if found:
            experiment_id = found[0].experiment_id
        else:
            experiment_id = mlflow.create_experiment(
                name=str(self.experiment_name), artifact_location=self.logging_dir, tags=self.tags
            )
        self.active_run = mlflow.start_run(
            run_id=self.run_id,
            experiment_id=experiment_id,
            run_name=self.run_name,
            nested=self.nested_run,
            tags=self.tags,
            description=self.description,
        )

    @property
    def tracker(self) -> Any:
        return self.active_run

    @on_main_process
    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        """As parameters, in batches of MLflow's limit; a value longer than MLflow takes is
        skipped with a warning."""
        import mlflow
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        params = []
        for key, value in values.items():
            if len(str(value)) > MAX_PARAM_VAL_LENGTH:
                skipped("mlflow", key, value, f"parameters of at most {MAX_PARAM_VAL_LENGTH} chars")
            else:
                params.append((key, value))
        for first in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
            mlflow.log_params(dict(params[first : first + MAX_PARAMS_TAGS_PER_BATCH]))

    @on_main_process
    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Numbers (one-element tensors too) as metrics; anything else is skipped with a
        warning (MLflow's metrics are numbers)."""
        import mlflow

        mlflow.log_metrics(numbers_only("mlflow", values), step=step, **kwargs)

    @on_main_process
    def log_figure(self, figure: Any, artifact_file: str, **save_kwargs: Any) -> None:
        import mlflow

        mlflow.log_figure(figure=figure, artifact_file=artifact_file, **save_kwargs)

    @on_main_process
    def log_artifacts(self, local_dir: str, artifact_path: str | None = None) -> None:
        import mlflow

        mlflow.log_artifacts(local_dir=local_dir, artifact_path=artifact_path)

    @on_main_process
    def log_artifact(self, local_path: str, artifact_path: str | None = None) -> None:
        import mlflow

        mlflow.log_artifact(local_path=local_path, artifact_path=artifact_path)

    @on_main_process
    def finish(self) -> None:
        import mlflow

        mlflow.end_run()


class CometMLTracker(GeneralTracker):
    """A Comet experiment, `comet_ml.start(project_name=run_name, **kwargs)` (`online=False`
    keeps it offline)."""

    name = "comet_ml"
    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.init_kwargs = kwargs
        self.writer: Any = None

    @on_main_process
    def start(self) -> None:
        import comet_ml

        begin = getattr(comet_ml, "start", None) or comet_ml.Experiment  # before 3.41: no start
        self.writer = begin(project_name=self.run_name, **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.writer

    @on_main_process
    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        self.writer.log_parameters(dict(values))

    @on_main_process
    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Numbers as metrics, strings as "other" values, dicts as groups of metrics."""
        if step is not None:
            self.writer.set_step(step)
        for key, value in values.items():
            scalar = number(value)
            if scalar is not None:
                self.writer.log_metric(key, scalar, step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.log_other(key, value, **kwargs)
            elif isinstance(value, Mapping):
                self.writer.log_metrics(dict(value), step=step, **kwargs)
            else:
                skipped("comet_ml", key, value, "numbers, strings and dicts of numbers")

    @on_main_process
    def finish(self) -> None:
        self.writer.end()


class ClearMLTracker(GeneralTracker):
    """A ClearML task, `Task.init(project_name=..., task_name=..., **kwargs)`, or the task
    already running (then `finish` leaves it open). As in Accelerate, each name is the one in
    `kwargs`, else CLEARML_PROJECT / CLEARML_TASK, else `run_name`."""

    name = "clearml"
    requires_logging_directory = False

    def __init__(self, run_name: str | None = None, **kwargs: Any) -> None:
        super().__init__()
        self.user_provided_run_name = run_name
        self._initialized_externally = False
        self.init_kwargs = kwargs
        self.task: Any = None

    @on_main_process
    def start(self) -> None:
        from clearml import Task

        current: Any = Task.current_task()
        if current is not None:
            self._initialized_externally = True
            self.task = current
            return
        self.task = Task.init(**self.task_arguments())

    def task_arguments(self) -> dict[str, Any]:
        """The keyword arguments `start()` gives `Task.init` when no task is running."""
        arguments = dict(self.init_kwargs)
        name = self.user_provided_run_name
        arguments.setdefault("project_name", envvars.get("clearml_project") or name)
        arguments.setdefault("task_name", envvars.get("clearml_task") or name)
        return arguments

    @property
    def tracker(self) -> Any:
        return self.task

    @on_main_process
    def store_init_configuration(self, values: Mapping[str, Any]) -> Any:
        return self.task.connect_configuration(dict(values))

    @on_main_process
    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Numbers: as single values without `step`, as scalars at `step` with it (an eval_,
        test_ or train_ prefix names the series, else "train")."""
        logger = self.task.get_logger()
        for key, value in numbers_only("clearml", values).items():
            if step is None:
                logger.report_single_value(name=key, value=value, **kwargs)
            else:
                title, series = self._get_title_series(key)
                logger.report_scalar(
                    title=title, series=series, value=value, iteration=step, **kwargs
                )

    @on_main_process
    def log_images(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        logger = self.task.get_logger()
        for key, image in values.items():
            title, series = self._get_title_series(key)
            logger.report_image(title=title, series=series, iteration=step, image=image, **kwargs)

    @on_main_process
    def log_table(
        self,
        table_name: str,
        columns: list[str] | None = None,
        data: list[list[Any]] | None = None,
        dataframe: Any = None,
        step: int | None = None,
        **kwargs: Any,
    ) -> None:
        """A table from `dataframe`, or from `data` (with `columns` as its first row)."""
        table = dataframe
        if table is None:
            if data is None:
                raise ValueError("ClearMLTracker.log_table needs data= or dataframe=")
            table = [columns, *data] if columns else data
        title, series = self._get_title_series(table_name)
        self.task.get_logger().report_table(
            title=title, series=series, table_plot=table, iteration=step, **kwargs
        )

    @on_main_process
    def finish(self) -> None:
        if self.task is not None and not self._initialized_externally:
            self.task.close()

    @staticmethod
    def _get_title_series(name: str) -> tuple[str, str]:
        for prefix in ("eval", "test", "train"):
            if name.startswith(prefix + "_"):
                return name[len(prefix) + 1 :], prefix
        return name, "train"
