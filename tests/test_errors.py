"""mpaccel's warning categories and its one HINT formatter."""

from __future__ import annotations

import types
import warnings

import pytest
import torch

import mpaccel
from mpaccel import discovery, preemption, training
from mpaccel.errors import MpaccelError, MpaccelRuntimeWarning, MpaccelWarning, with_hint


def test_with_hint_puts_the_hint_on_its_own_line_or_after_a_space():
    assert with_hint("it broke", "fix it.") == "it broke\nHINT: fix it."
    assert with_hint("it broke.", "fix it.", " ") == "it broke. HINT: fix it."
    assert with_hint("it broke", None) == "it broke"
    assert str(MpaccelError("it broke", "fix it.")) == with_hint("it broke", "fix it.")


def test_one_filter_takes_every_mpaccel_warning(monkeypatch):
    """The category users filter by: each kind of warning site, turned into an error by one
    filter on MpaccelWarning, and the runtime ones still RuntimeWarnings."""
    launch = types.SimpleNamespace(
        info=types.SimpleNamespace(is_main_process=True), warnings=("a launch note",)
    )
    monkeypatch.setattr(training, "_warned_fp16_on_cpu", False)
    sites = [
        (lambda: discovery.emit_warnings(launch), MpaccelRuntimeWarning),
        (lambda: preemption.requeue({}), MpaccelRuntimeWarning),
        (lambda: training.warn_fp16_on_cpu("fp16", torch.device("cpu")), MpaccelWarning),
    ]
    for site, category in sites:
        with warnings.catch_warnings():
            warnings.simplefilter("error", mpaccel.MpaccelWarning)
            with pytest.raises(category) as caught:
                site()
        assert isinstance(caught.value, UserWarning)
        assert isinstance(caught.value, RuntimeWarning) == (category is MpaccelRuntimeWarning)


def test_a_settings_mismatch_keeps_its_message_and_hint_when_pickled():
    # mpi4py pickles exceptions; rank 0 alone aborts for it (no failing rank: they disagree)
    import pickle

    from mpaccel.errors import CollectiveError, ConfigurationError, SettingsMismatchError

    error = SettingsMismatchError("Accelerator(): the ranks were given ...", "set it.", "here")
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.message, copy.hint, copy.operation, copy.failures) == (
        error.message, error.hint, "here", {}
    )
    assert isinstance(copy, ConfigurationError) and isinstance(copy, CollectiveError)
    assert str(copy) == with_hint(error.message, "set it.")
