"""Accelerate's names for features mpaccel lacks (mpaccel/absent_names.py) import at Accelerate's
paths, and using one raises mpaccel's error with the reason and a HINT; every other missing name
stays a plain AttributeError, and introspection (import *, hasattr, pickle) is unchanged."""

from __future__ import annotations

import importlib
import pickle
import textwrap
import warnings

import pytest
import torch

from mpaccel import absent_names
from mpaccel.accelerator import Accelerator
from mpaccel.errors import REFUSED, ConfigurationError, MpaccelWarning
from mpaccel.state import AcceleratorState
from mpaccel.testing import run_mpi

MODULE_NAMES = [(module, name) for module, names in absent_names.MODULE_NAMES.items()
                for name in names]
MEMBERS = [(cls, name) for cls, names in absent_names.MEMBERS.items() for name in names]


def _raises_the_refusal(call, path, reason):
    with pytest.raises(ConfigurationError) as caught:
        call()
    assert path in caught.value.message and reason.why in caught.value.message
    assert caught.value.hint == reason.instead
    assert str(caught.value).endswith(f"HINT: {reason.instead}")
    return caught.value


@pytest.mark.parametrize(("module", "name"), MODULE_NAMES)
def test_each_name_imports_and_refuses_when_used(module, name):
    namespace: dict = {}
    exec(f"from {module} import {name}", namespace)  # a script's import line
    obj = namespace[name]
    found = importlib.import_module(module)
    assert getattr(found, name) is obj  # one object, as pickle and `is` checks need
    assert name not in found.__all__
    reason = absent_names.MODULE_NAMES[module][name]
    if name in absent_names.VALUES:  # plain data, Accelerate's value
        assert obj == absent_names.VALUES[name] and not callable(obj)
        return
    assert pickle.loads(pickle.dumps(obj)) is obj
    assert reason.why in obj.__doc__ and reason.instead in obj.__doc__
    message, hint = getattr(obj, REFUSED)  # what docs/compatibility.md quotes
    if name in ("deepspeed_required", "torchao_required"):  # the decorated function refuses
        def helper() -> None: ...

        decorated = obj(helper)
        assert decorated.__name__ == "helper"
        error = _raises_the_refusal(decorated, name, reason)
    elif isinstance(obj, type):
        error = _raises_the_refusal(lambda: obj(torch.nn.Linear(1, 1), lr=0.1), f"{name}(...)",
                                    reason)
    else:
        error = _raises_the_refusal(lambda: obj(torch.nn.Linear(1, 1)), f"{name}()", reason)
    assert (error.message, error.hint) == (message, hint)


def test_a_name_at_two_paths_is_one_object():
    """As in Accelerate, `accelerate.init_empty_weights is accelerate.utils...`."""
    import mpaccel.utils

    names = absent_names.MODULE_NAMES
    both = set(names["mpaccel"]) & set(names["mpaccel.utils"])
    assert both == {"infer_auto_device_map", "load_checkpoint_in_model"}
    for name in both:
        assert getattr(mpaccel, name) is getattr(mpaccel.utils, name)
        assert getattr(mpaccel, name).__module__ == "mpaccel.utils"


@pytest.mark.parametrize("module", list(absent_names.MODULE_NAMES))
def test_other_missing_names_stay_plain_errors(module):
    found = importlib.import_module(module)
    for name in ("no_such_name", "__wrapped__", "__path__" if module == "mpaccel.state" else
                 "__no_such_dunder__"):
        assert not hasattr(found, name)
        with pytest.raises(AttributeError, match=f"^module '{module}' has no attribute"):
            getattr(found, name)
    with pytest.raises(ImportError, match="cannot import name 'no_such_name'"):
        exec(f"from {module} import no_such_name", {})
    star: dict = {}
    exec(f"from {module} import *", star)
    assert not set(star) & set(absent_names.MODULE_NAMES[module])  # import * brings none of them
    assert not set(dir(found)) & set(absent_names.MODULE_NAMES[module])


@pytest.mark.parametrize(("cls", "name"), MEMBERS)
def test_each_member_refuses_or_says_the_feature_is_off(accelerator, cls, name):
    member = absent_names.MEMBERS[cls][name]
    obj = accelerator if cls == "Accelerator" else accelerator.state
    path = f"{cls}.{name}"
    if member.kind == "value":  # Accelerate's with the feature off: `if accelerator.fp8_enabled`
        assert getattr(obj, name) == member.value and hasattr(obj, name)
        with pytest.raises(AttributeError, match=f"property '{name}' .* has no setter"):
            setattr(obj, name, member.value)
    elif member.kind == "attribute":  # hasattr answers False, the message has the HINT
        assert not hasattr(obj, name)
        with pytest.raises(AttributeError) as caught:
            getattr(obj, name)
        assert str(caught.value) == (f"{path} cannot be used: {member.reason.why}\n"
                                     f"HINT: {member.reason.instead}")
    else:
        _raises_the_refusal(lambda: getattr(obj, name)(None, None), f"{path}()", member.reason)


def test_other_missing_members_stay_plain_errors(accelerator):
    with pytest.raises(AttributeError, match=r"^'Accelerator' object has no attribute 'fp9'$"):
        accelerator.fp9  # noqa: B018
    assert not hasattr(accelerator, "fp9_enabled")
    with pytest.raises(AttributeError, match="AcceleratorState"):
        accelerator.state.downcast_float16  # noqa: B018
    # the members are on the classes, not on instances: nothing else changed
    assert set(absent_names.MEMBERS["Accelerator"]) <= set(vars(Accelerator))
    assert not set(absent_names.MEMBERS["Accelerator"]) & set(vars(accelerator))
    assert "downcast_bfloat" in vars(AcceleratorState)
    assert pickle.loads(pickle.dumps(accelerator)).fp8_enabled is False


def test_maybe_context_parallel_has_no_effect_as_accelerates_without_it(accelerator):
    """Accelerate's does nothing (and warns once) unless cp_size > 1 (GPUs only in mpaccel):
    a script that wraps every step in it runs."""
    import mpaccel.accelerator as parallelism

    parallelism._warned_no_context_parallel = False
    batch = torch.arange(12.0).reshape(2, 6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with accelerator.maybe_context_parallel(buffers=[batch], buffer_seq_dims=[1],
                                                    no_restore_buffers={batch}):
                assert batch.shape == (2, 6)
    assert torch.equal(batch, torch.arange(12.0).reshape(2, 6))
    assert [w.category for w in caught] == [MpaccelWarning]
    assert "no effect" in str(caught[0].message) and caught[0].filename == __file__


# The import block of Accelerate's examples/by_feature/deepspeed_with_config_support.py, and
# its use of the DeepSpeed names: only when DeepSpeed's config defines the optimizer.
_SCRIPT = textwrap.dedent("""
    import torch

    from mpaccel import Accelerator, DistributedType
    from mpaccel.logging import get_logger
    from mpaccel.utils import DummyOptim, DummyScheduler, set_seed

    logger = get_logger(__name__)
    accelerator = Accelerator()
    set_seed(42)
    model = torch.nn.Linear(4, 1)
    plugin = accelerator.state.deepspeed_plugin
    optimizer_cls = (torch.optim.AdamW if plugin is None or "optimizer" not in
                     plugin.deepspeed_config else DummyOptim)
    optimizer = optimizer_cls(model.parameters(), lr=0.1)
    if plugin is None or "scheduler" not in plugin.deepspeed_config:
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    else:
        scheduler = DummyScheduler(optimizer, total_num_steps=1, warmup_num_steps=0)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    loss = model(torch.ones(2, 4)).sum()
    accelerator.backward(loss)
    optimizer.step()
    scheduler.step()
    assert accelerator.distributed_type != DistributedType.DEEPSPEED
    print(f"rank {accelerator.process_index} of {accelerator.num_processes} trained")
    try:
        DummyOptim(model.parameters(), lr=0.1)
    except ValueError as exc:
        print(f"DummyOptim: {exc}")
""")


@pytest.mark.mpi(size=1)
@pytest.mark.launches
@pytest.mark.parametrize("n", [1, 2])
def test_a_script_importing_deepspeed_names_runs_past_the_import(tmp_path, n):
    script = tmp_path / "deepspeed_with_config_support.py"
    script.write_text(_SCRIPT)
    run = run_mpi([str(script)], n=n, timeout=240).check()
    for rank, out in enumerate(run.stdout):
        assert f"rank {rank} of {n} trained" in out, run.describe()
        assert "DummyOptim: mpaccel.utils.DummyOptim(...) cannot be used" in out
        assert "HINT: create a torch.optim optimizer" in out
