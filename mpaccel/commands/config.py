"""Accelerate's `accelerate.commands.config`: where `accelerate config` writes its file and how
to read it. mpaccel reads no such file (a job's settings come from its launcher and the
Accelerator's arguments); environment reports (`transformers env`, `trl env`) that show the file
still can, and they get it as written."""

from __future__ import annotations

import json
import os
from typing import Any

from ..errors import ConfigurationError

# Accelerate's default place (its HF_HOME / XDG_CACHE_HOME overrides aside: mpaccel never reads
# the file for itself, so it reads none of their variables either).
default_config_file = os.path.join(
    os.path.expanduser("~"), ".cache", "huggingface", "accelerate", "default_config.yaml"
)


class ConfigFile:
    """The settings `accelerate config` wrote, as read (`to_dict()`); mpaccel applies none."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = settings

    def to_dict(self) -> dict[str, Any]:
        return dict(self.settings)


def load_config_from_file(config_file: str | None = None) -> ConfigFile:
    """The settings in `config_file` (default: default_config_file), a JSON or YAML file. Not
    collective."""
    path = os.fspath(config_file or default_config_file)
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
        if path.endswith(".json"):
            settings = json.loads(text)
        else:
            import yaml

            settings = yaml.safe_load(text)
    except (OSError, ValueError, ImportError) as exc:
        raise ConfigurationError(
            f"cannot read the Accelerate config file {path!r}: {exc}",
            "mpaccel needs no config file: its jobs take their settings from mpiexec/srun and "
            "the Accelerator's arguments (docs/huggingface.md).",
        ) from exc
    return ConfigFile(settings if isinstance(settings, dict) else {})


__all__ = ["default_config_file", "load_config_from_file"]
