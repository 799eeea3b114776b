"""Trackers that write files on the main process's machine: TensorBoard, Aim, DVCLive.
Each library is imported in `start()`, so that naming a class needs no package."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from typing import Any

from .base import GeneralTracker, number, on_main_process, skipped


def _hparam(value: Any) -> Any:
    """A value TensorBoard's add_hparams takes: numbers (one-element tensors too), strings and
    bools as they are; anything else (lists, enums, nested dicts) as its str, where
    add_hparams would raise."""
    converted = number(value)
    if converted is not None:
        return converted
    return value if isinstance(value, str) else str(value)


class TensorBoardTracker(GeneralTracker):
    """TensorBoard's SummaryWriter (torch.utils.tensorboard, else tensorboardX) writing to
    `<logging_dir>/<run_name>`; `**kwargs` go to SummaryWriter."""

    name = "tensorboard"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name
        self.logging_dir_param = logging_dir
        self.logging_dir = os.path.join(os.fspath(logging_dir), run_name)
        self.init_kwargs = kwargs
        self.writer: Any = None

    @on_main_process
    def start(self) -> None:
        try:
            from torch.utils import tensorboard
        except ImportError:  # torch's needs the tensorboard package; tensorboardX stands alone
            import tensorboardX as tensorboard  # type: ignore[no-redef]
        self.writer = tensorboard.SummaryWriter(self.logging_dir, **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.writer

    @on_main_process
    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        """The HPARAMS tab (add_hparams: None values are left out, values it cannot show are
        shown as text), and `<logging_dir>/<time>/hparams.yml` as Accelerate writes it (its
        text is JSON, which YAML readers read)."""
        self.writer.add_hparams(
            {key: _hparam(v) for key, v in values.items() if v is not None}, metric_dict={}
        )
        self.writer.flush()
        directory = os.path.join(self.logging_dir, str(time.time()))
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "hparams.yml"), "w") as out:
            json.dump(dict(values), out, indent=2, default=str, ensure_ascii=False)
            out.write("\n")

    @on_main_process
    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Numbers (one-element tensors and numpy scalars too) as scalars, strings as text,
        dicts of numbers as grouped scalars; anything else is skipped with a warning."""
        for key, value in values.items():
            scalar = number(value)
            # each value read once (.item() of a GPU tensor waits for the device)
            group = (
                {str(k): number(v) for k, v in value.items()}
                if isinstance(value, Mapping)
                else None
            )
            if scalar is not None:
                self.writer.add_scalar(key, scalar, global_step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif group is not None and None not in group.values():
                self.writer.add_scalars(key, group, global_step=step, **kwargs)
            else:
                skipped("tensorboard", key, value, "numbers, strings and dicts of numbers")
        self.writer.flush()

    @on_main_process
    def log_images(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Batches of images (N x C x H x W arrays or tensors), one per key."""
        for key, images in values.items():
            self.writer.add_images(key, images, global_step=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        self.writer.close()


class AimTracker(GeneralTracker):
    """An Aim run in the repository at `logging_dir`; `**kwargs` go to aim.Run."""

    name = "aim"
    requires_logging_directory = True

    def __init__(
        self, run_name: str, logging_dir: str | os.PathLike[str] | None = ".", **kwargs: Any
    ) -> None:
        super().__init__()
        self.run_name = run_name
        self.aim_repo_path = logging_dir
        self.init_kwargs = kwargs
        self.writer: Any = None

    @on_main_process
    def start(self) -> None:
        from aim import Run

        self.writer = Run(repo=self.aim_repo_path, **self.init_kwargs)
        self.writer.name = self.run_name

    @property
    def tracker(self) -> Any:
        return self.writer

    @on_main_process
    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        self.writer["hparams"] = dict(values)

    @on_main_process
    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Each value tracked under its key (`**kwargs` go to Run.track)."""
        for key, value in values.items():
            self.writer.track(value, name=key, step=step, **kwargs)

    @on_main_process
    def log_images(
        self,
        values: Mapping[str, Any],
        step: int | None = None,
        kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """Images (or (image, caption) pairs); `kwargs={"aim_image": {...}, "track": {...}}`."""
        import aim

        image_kwargs = dict((kwargs or {}).get("aim_image", {}))
        track_kwargs = dict((kwargs or {}).get("track", {}))
        for key, value in values.items():
            image, caption = value if isinstance(value, tuple) else (value, "")
            picture = aim.Image(image, caption=caption, **image_kwargs)
            self.writer.track(picture, name=key, step=step, **track_kwargs)

    @on_main_process
    def finish(self) -> None:
        self.writer.close()


class DVCLiveTracker(GeneralTracker):
    """A dvclive.Live (`live=` an existing one); `run_name` is ignored, `**kwargs` go to Live
    (`dir=` where it writes)."""

    name = "dvclive"
    requires_logging_directory = False

    def __init__(self, run_name: str | None = None, live: Any = None, **kwargs: Any) -> None:
        super().__init__()
        self.live = live
        self.init_kwargs = kwargs

    @on_main_process
    def start(self) -> None:
        if self.live is None:
            from dvclive import Live

            self.live = Live(**self.init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.live

    @on_main_process
    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        self.live.log_params(dict(values))

    @on_main_process
    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Numbers as metrics at `step` (then the next step, as Accelerate does)."""
        from dvclive.plots import Metric

        if step is not None:
            self.live.step = step
        for key, value in values.items():
            scalar = number(value)
            if scalar is not None:
                self.live.log_metric(key, scalar, **kwargs)
            elif Metric.could_log(value):
                self.live.log_metric(key, value, **kwargs)
            else:
                skipped("dvclive", key, value, "numbers")
        self.live.next_step()

    @on_main_process
    def finish(self) -> None:
        self.live.end()
