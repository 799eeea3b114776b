"""mpaccel/accelerate_alias.py: `accelerate` and `accelerate.X` as mpaccel's modules, the
`accelerate` distribution it reports, and the refusal of a module mpaccel lacks. In this
process, with any real Accelerate set aside for the test (tests/jobs/test_run.py runs programs)."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
import types

import pytest

import mpaccel
from mpaccel import accelerate_alias

pytestmark = pytest.mark.mpi(size=1)  # no communication: one process says all

# What transformers 5 and TRL 1.16 import from Accelerate (issue 28, item 5), at its paths.
LIBRARY_NAMES = [
    ("utils.modeling", "clean_device_map"),
    ("utils.modeling", "get_max_layer_size"),
    ("hooks", "add_hook_to_module"),
    ("hooks", "remove_hook_from_module"),
    ("hooks", "remove_hook_from_submodules"),
    ("hooks", "AlignDevicesHook"),
    ("parallelism_config", "ParallelismConfig"),
    ("utils.constants", "FSDP_SHARDING_STRATEGY"),
    ("utils.constants", "FSDP_AUTO_WRAP_POLICY"),
    ("utils.deepspeed", "HfDeepSpeedConfig"),
    ("big_modeling", "check_device_map"),
    ("commands.config", "default_config_file"),
    ("commands.config", "load_config_from_file"),
    ("commands.launch", "launch_command"),
    ("commands.launch", "launch_command_parser"),
    ("commands.env", "env_command"),
    ("utils.versions", "is_torch_version"),
    ("utils.fsdp_utils", "get_parameters_from_modules"),
    ("utils.fsdp_utils", "save_fsdp_model"),
    ("utils.memory", "release_memory"),
    ("utils.imports", "is_bf16_available"),
    ("logging", "get_logger"),
    ("state", "PartialState"),
]


@pytest.fixture
def alias():
    """The alias installed; a real Accelerate imported before is set aside, then restored."""
    aside = {name: sys.modules.pop(name) for name in list(sys.modules)
             if name == "accelerate" or name.startswith("accelerate.")}
    accelerate_alias.install()
    try:
        yield
    finally:
        accelerate_alias.uninstall()
        sys.modules.update(aside)


def test_accelerate_is_mpaccel_module_by_module(alias):
    import accelerate
    import accelerate.utils.modeling
    from accelerate.hooks import AlignDevicesHook
    from accelerate.state import PartialState

    assert accelerate is mpaccel
    assert accelerate.utils.modeling is importlib.import_module("mpaccel.utils.modeling")
    assert AlignDevicesHook is importlib.import_module("mpaccel.hooks").AlignDevicesHook
    assert PartialState is mpaccel.PartialState  # one state for the library and the script
    assert importlib.util.find_spec("accelerate") is not None


@pytest.mark.parametrize(("module", "name"), LIBRARY_NAMES)
def test_the_names_libraries_import_are_at_accelerates_paths(alias, module, name):
    assert hasattr(importlib.import_module(f"accelerate.{module}"), name)


def test_the_distribution_is_the_accelerate_release_mpaccel_follows(alias):
    assert importlib.metadata.version("accelerate") == accelerate_alias.ACCELERATE_VERSION
    meta = importlib.metadata.metadata("accelerate")
    assert meta["Name"] == "accelerate" and "mpaccel" in meta["Summary"]
    assert importlib.metadata.version("torch")  # other distributions are found as before


def test_a_module_mpaccel_lacks_is_refused_with_its_reason(alias):
    with pytest.raises(ModuleNotFoundError, match="does not drive Megatron-LM") as known:
        import accelerate.utils.megatron_lm  # noqa: F401
    assert "\nHINT: " in str(known.value) and known.value.name == "accelerate.utils.megatron_lm"
    with pytest.raises(ModuleNotFoundError, match=r"docs/compatibility\.md") as unknown:
        importlib.import_module("accelerate.no_such_module")
    assert "mpaccel.no_such_module, which mpaccel does not have" in str(unknown.value)


def test_a_refused_name_is_the_placeholder_of_a_direct_import(alias):
    from accelerate.utils import DummyOptim

    assert DummyOptim is mpaccel.utils.DummyOptim


def test_install_refuses_once_the_real_accelerate_is_imported(monkeypatch):
    monkeypatch.setitem(sys.modules, "accelerate", types.ModuleType("accelerate"))
    with pytest.raises(RuntimeError, match="the real accelerate is imported already"):
        accelerate_alias.install()
    assert not accelerate_alias.installed()


def test_uninstall_gives_accelerate_back_to_sys_path(alias):
    import accelerate  # noqa: F401

    accelerate_alias.uninstall()
    assert "accelerate" not in sys.modules
    spec = importlib.util.find_spec("accelerate")
    assert spec is None or spec.origin is None or "mpaccel" not in spec.origin
    accelerate_alias.install()  # for the fixture to undo
