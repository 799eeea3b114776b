"""The settings every rank must share, compared once in Accelerator() and, for the FSDP units a
model is cut into, in prepare(): one error on every rank naming the setting, its values and
the ranks. The same bodies run at size 1 and under mpiexec; a launched job covers settings
that reach one rank only through its environment."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from mpaccel import Accelerator
from mpaccel.errors import ConfigurationError, SettingsMismatchError
from mpaccel.shared_settings import HINT, Setting, canonical, compare, mismatch, of_state
from mpaccel.state import is_initialized
from mpaccel.testing import run_mpi
from mpaccel.utils import FullyShardedDataParallelPlugin


def test_settings_the_same_everywhere_pass(state):
    settings = [Setting("mixed_precision", "'no'", "here"), Setting("x", "1", "there")]
    compare(state.comm, settings, "a test")  # nothing raised, on every rank


@pytest.mark.mpi(min_size=2)
def test_a_setting_that_differs_on_one_rank_is_one_error_on_every_rank(state):
    odd = state.process_index == 1
    settings = [Setting("same", "1", "nowhere"), Setting("odd", canonical(odd), "ODD_VAR")]
    with pytest.raises(SettingsMismatchError) as caught:
        compare(state.comm, settings, "a test")
    others = [r for r in range(state.num_processes) if r != 1]
    where = "rank 0" if others == [0] else "ranks " + ", ".join(map(str, others))
    assert caught.value.message == (
        f"a test: the ranks were given different settings:\n  odd (ODD_VAR): False on {where}; "
        "True on rank 1"
    )
    assert caught.value.hint == HINT and isinstance(caught.value, ConfigurationError)
    assert caught.value.failures == {}  # nobody failed: they disagree (rank 0 alone aborts)
    # the communicator is still in step: the next collective works
    assert state.comm.allreduce(1, "sum") == state.num_processes


@pytest.mark.mpi(min_size=2)
def test_fsdp_min_num_params_from_one_ranks_environment(state, monkeypatch):
    # It aborted the job in gloo at prepare() ("Received data size doesn't match expected size").
    if state.process_index == 1:
        monkeypatch.setenv("FSDP_MIN_NUM_PARAMS", "100")
    with pytest.raises(SettingsMismatchError) as caught:
        Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(auto_wrap_policy="size_based_wrap"))
    named = ("\n  fsdp_plugin.min_num_params (FullyShardedDataParallelPlugin(min_num_params=...) "
             "or FSDP_MIN_NUM_PARAMS): 0 on rank")
    assert named in caught.value.message, caught.value.message
    assert caught.value.message.endswith("; 100 on rank 1"), caught.value.message
    assert not is_initialized()  # nothing was set up: the mesh is built after the comparison


@pytest.mark.mpi(min_size=2)
def test_gradient_accumulation_steps_that_differ(state):
    with pytest.raises(SettingsMismatchError, match=r"gradient_accumulation_steps .*: 1 on rank"):
        Accelerator(gradient_accumulation_steps=1 if state.process_index != 1 else 4)


@pytest.mark.mpi(min_size=2)
def test_a_second_accelerator_compares_its_own_settings(state):
    Accelerator()
    with pytest.raises(SettingsMismatchError, match=r"dataloader_config.even_batches"):
        Accelerator(even_batches=state.process_index != 1)


@pytest.mark.mpi(min_size=2)
def test_a_second_accelerator_asking_one_rank_for_another_precision(state):
    # The refusal to switch mixed precision was raised on rank 1 alone; the others went on.
    Accelerator()
    said = r"mixed_precision .*: 'no' on ranks? 0.*; 'bf16' on rank 1"
    with pytest.raises(SettingsMismatchError, match=said):
        Accelerator(mixed_precision="bf16" if state.process_index == 1 else None)


def test_canonical_text_holds_no_addresses():
    plugin = FullyShardedDataParallelPlugin(
        auto_wrap_policy=lambda module: False, ignored_modules=[torch.nn.Linear(1, 1)],
        mixed_precision_policy="bf16",
    )  # fmt: skip
    settings = of_state(plugin, None, "bf16")
    text = "\n".join(s.value for s in settings)
    assert "0x" not in text, text
    values = {s.name: s.value for s in settings}
    assert values["fsdp_plugin.auto_wrap_policy"] == (
        f"{__name__}.test_canonical_text_holds_no_addresses.<locals>.<lambda>"
    )
    assert values["fsdp_plugin.ignored_modules"] == (
        "[Linear(in_features=1, out_features=1, bias=True)]"
    )
    assert "param_dtype=torch.bfloat16" in values["fsdp_plugin.mixed_precision_policy"]


def test_a_setting_absent_on_some_ranks_is_named_only_when_nothing_else_differs():
    ddp = [Setting("distributed type", "DDP", "ACCELERATE_USE_FSDP")]
    fsdp = [Setting("distributed type", "FSDP", "ACCELERATE_USE_FSDP"),
            Setting("fsdp_plugin.min_num_params", "0", "FSDP_MIN_NUM_PARAMS")]  # fmt: skip
    error = mismatch([ddp, fsdp, ddp], "Accelerator()")
    assert error is not None
    assert error.message.splitlines()[1:] == [
        "  distributed type (ACCELERATE_USE_FSDP): DDP on ranks 0, 2; FSDP on rank 1"
    ]
    extra = mismatch([ddp, [*ddp, Setting("y", "1", "Y")]], "w")
    assert extra is not None and extra.message.splitlines()[1:] == [
        "  y (Y): (not set) on rank 0; 1 on rank 1"
    ]
    assert mismatch([ddp, ddp], "w") is None


# -- a job whose ranks see different environments --------------------------------------------

# Rank 1 is started with every variable of PLANTED; each case gives it back one of them (on
# rank 0 there is nothing to give back), so the ranks differ in that one setting only.
_JOB = """
    import json, os, torch
    from mpaccel import Accelerator
    from mpaccel.errors import SettingsMismatchError
    from mpaccel.testing import reset_state
    from mpaccel.utils import FullyShardedDataParallelPlugin as Plugin, ParallelismConfig

    PLANTED = ["ACCELERATE_USE_FSDP", "FSDP_MIN_NUM_PARAMS", "FSDP_AUTO_WRAP_POLICY",
               "MPACCEL_MIXED_PRECISION", "PARALLELISM_CONFIG_DP_SHARD_SIZE", "WRAP_ABOVE"]
    planted = {name: os.environ.pop(name) for name in PLANTED if name in os.environ}

    def wrap_policy(module):  # decides by this rank's environment: only prepare() can tell
        limit = int(os.environ.get("WRAP_ABOVE", "0"))
        return isinstance(module, torch.nn.Linear) and module.out_features > limit

    def units():
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
        model = Accelerator(fsdp_plugin=Plugin(auto_wrap_policy=wrap_policy)).prepare(model)
        model(torch.ones(2, 4)).sum().backward()  # where the units meet in gloo

    CASES = {
        "ACCELERATE_USE_FSDP": lambda: Accelerator(),
        "FSDP_MIN_NUM_PARAMS": lambda: Accelerator(
            fsdp_plugin=Plugin(auto_wrap_policy="size_based_wrap")),
        "FSDP_AUTO_WRAP_POLICY": lambda: Accelerator(fsdp_plugin=Plugin()),
        "MPACCEL_MIXED_PRECISION": lambda: Accelerator(),
        "PARALLELISM_CONFIG_DP_SHARD_SIZE": lambda: Accelerator(
            fsdp_plugin=Plugin(), parallelism_config=ParallelismConfig()),
        "WRAP_ABOVE": units,
    }
    for name, case in CASES.items():
        if name in planted:
            os.environ[name] = planted[name]
        try:
            case()
            print(json.dumps([name, None]), flush=True)
        except SettingsMismatchError as exc:
            print(json.dumps([name, str(exc)]), flush=True)
        os.environ.pop(name, None)
        reset_state()
    os.environ["ACCELERATE_USE_FSDP"] = planted.get("ACCELERATE_USE_FSDP", "false")
    Accelerator()  # uncaught: every rank ends with it
"""

_PLANTED = {
    "ACCELERATE_USE_FSDP": ("true", "distributed type", "DDP on rank 0; FSDP on rank 1"),
    "FSDP_MIN_NUM_PARAMS": ("100", "fsdp_plugin.min_num_params", "0 on rank 0; 100 on rank 1"),
    "FSDP_AUTO_WRAP_POLICY": (
        "size_based_wrap", "fsdp_plugin.auto_wrap_policy",
        "FSDPAutoWrapPolicy.NO_WRAP on rank 0; FSDPAutoWrapPolicy.SIZE_BASED_WRAP on rank 1",
    ),
    "MPACCEL_MIXED_PRECISION": ("bf16", "mixed_precision", "'no' on rank 0; 'bf16' on rank 1"),
    "PARALLELISM_CONFIG_DP_SHARD_SIZE": (
        "2", "parallelism_config.dp_shard_size", "1 on rank 0; 2 on rank 1",
    ),
    "WRAP_ABOVE": ("4", "the model's FSDP units", "['0', '1'] on rank 0; ['0'] on rank 1"),
}  # fmt: skip


@pytest.mark.mpi(size=1)
@pytest.mark.launches
def test_settings_from_one_ranks_environment_fail_every_rank_at_once(tmp_path):
    # ACCELERATE_USE_FSDP on rank 1 only waited 62 s and ended in a raw gloo error; a wrap
    # policy or FSDP_MIN_NUM_PARAMS on one rank aborted the job in gloo (SIGABRT, "Received
    # data size doesn't match expected size").
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(_JOB))
    planted = [f"{name}={value}" for name, (value, _, _) in _PLANTED.items()]
    run = run_mpi([str(script)], n=2, timeout=90, rank_prefix={1: ["env", *planted]})
    assert not run.timed_out and run.returncode != 0, run.describe()
    outcomes = [[json.loads(line) for line in out.splitlines()] for out in run.stdout]
    assert outcomes[0] == outcomes[1], run.describe()  # the same error on every rank
    assert [name for name, _ in outcomes[0]] == list(_PLANTED), run.describe()
    for name, message in outcomes[0]:
        _, setting, values = _PLANTED[name]
        where = "prepare()" if name == "WRAP_ABOVE" else "Accelerator()"
        assert message is not None, (name, run.describe())
        assert message.startswith(f"{where}: the ranks were given different settings:\n"), message
        assert f"\n  {setting} (" in message and f"): {values}" in message, message
        assert message.endswith(f"\nHINT: {HINT}"), message
    # Uncaught, it ends the job, no timeout: every rank has the error, and rank 0 alone
    # aborts the job with it (docs/architecture.md), so its stderr is the one that holds it
    # (the others may be ended before they print).
    err = run.stderr[0]
    assert "SettingsMismatchError: Accelerator(): the ranks were given different settings" \
        in err, run.describe()
    assert "distributed type (Accelerator(fsdp_plugin=...) or MPACCEL_USE_FSDP or " \
        "ACCELERATE_USE_FSDP): DDP on rank 0; FSDP on rank 1" in err, run.describe()
