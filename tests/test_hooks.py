"""mpaccel.hooks (Accelerate's `accelerate.hooks`): hooks around a module's forward, attached
and removed in place, chained, and AlignDevicesHook's moves."""

from __future__ import annotations

import pytest
import torch

from mpaccel.errors import ConfigurationError
from mpaccel.hooks import (
    AlignDevicesHook,
    ModelHook,
    SequentialHook,
    add_hook_to_module,
    remove_hook_from_module,
    remove_hook_from_submodules,
)

pytestmark = pytest.mark.mpi(size=1)  # no communication: one process says all


class Scale(ModelHook):
    """Doubles the input, adds `shift` to the output; counts its calls."""

    def __init__(self, shift: float = 0.0) -> None:
        self.shift, self.calls = shift, []

    def init_hook(self, module):
        self.calls.append("init")
        return module

    def pre_forward(self, module, *args, **kwargs):
        self.calls.append("pre")
        return (args[0] * 2, *args[1:]), kwargs

    def post_forward(self, module, output):
        self.calls.append("post")
        return output + self.shift

    def detach_hook(self, module):
        self.calls.append("detach")
        return module


def _linear() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def test_a_hook_runs_around_the_forward_until_removed():
    layer, x = _linear(), torch.ones(1, 3)
    plain = layer(x)
    hook = Scale(shift=1.0)
    assert add_hook_to_module(layer, hook) is layer
    assert layer._hf_hook is hook  # Accelerate's attribute, which libraries test for
    torch.testing.assert_close(layer(x), layer._old_forward(2 * x) + 1.0)
    assert hook.calls == ["init", "pre", "post"]
    remove_hook_from_module(layer)
    assert hook.calls[-1] == "detach"
    assert not hasattr(layer, "_hf_hook") and not hasattr(layer, "_old_forward")
    assert "forward" not in vars(layer)  # the class's own forward again
    torch.testing.assert_close(layer(x), plain)


def test_a_second_hook_replaces_or_with_append_follows_the_first():
    layer, x = _linear(), torch.ones(1, 3)
    add_hook_to_module(layer, Scale(shift=1.0))
    add_hook_to_module(layer, Scale(shift=5.0))  # replaces: the forward is wrapped once
    torch.testing.assert_close(layer(x), layer._old_forward(2 * x) + 5.0)
    add_hook_to_module(layer, Scale(shift=10.0), append=True)
    assert isinstance(layer._hf_hook, SequentialHook)
    torch.testing.assert_close(layer(x), layer._old_forward(4 * x) + 15.0)


def test_remove_hooks_from_submodules_and_a_no_grad_hook():
    model = torch.nn.Sequential(_linear(), torch.nn.Linear(2, 2))
    no_grad = ModelHook()
    no_grad.no_grad = True
    add_hook_to_module(model[0], no_grad)
    add_hook_to_module(model[1], Scale())
    assert not model[0](torch.ones(1, 3)).requires_grad
    remove_hook_from_submodules(model)
    assert all(not hasattr(m, "_hf_hook") for m in model)
    assert model(torch.ones(1, 3)).requires_grad


def test_align_devices_hook_moves_the_module_and_its_inputs():
    layer = _linear()
    hook = AlignDevicesHook(execution_device="meta", io_same_device=True)
    add_hook_to_module(layer, hook)
    assert layer.weight.device.type == "meta"  # moved when attached
    args, kwargs = hook.pre_forward(layer, torch.ones(1, 3), scale=torch.ones(1))
    assert args[0].device.type == "meta" and kwargs["scale"].device.type == "meta"
    assert hook.input_device == torch.device("cpu")  # where the output goes back to
    out = hook.post_forward(layer, torch.zeros(1))
    assert out.device.type == "cpu"


def test_align_devices_hook_refuses_offloading_with_the_hint():
    with pytest.raises(ConfigurationError, match="HINT: ") as refused:
        AlignDevicesHook(execution_device="cpu", offload=True)
    assert "Big Model Inference" in str(refused.value)
