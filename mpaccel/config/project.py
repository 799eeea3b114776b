"""`ProjectConfiguration`: where checkpoints and logs go, and how many checkpoints are kept
(Accelerator(project_config=...))."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigurationError
from .kwargs import KwargsHandler


@dataclass
class ProjectConfiguration(KwargsHandler):
    """Where checkpoints go, and how many are kept."""

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False

    def __post_init__(self) -> None:
        if self.logging_dir is None:
            self.logging_dir = self.project_dir
        if self.total_limit is not None and self.total_limit < 1:
            raise ConfigurationError(
                f"ProjectConfiguration(total_limit={self.total_limit!r}) must be >= 1 or None"
            )

    def set_directories(self, project_dir: str | None = None) -> None:
        self.project_dir = project_dir
        if self.logging_dir is None:
            self.logging_dir = project_dir
