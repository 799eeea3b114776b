"""accelerator.profile(): torch.profiler around a block on every rank, each in a fresh job.

These ran inside the pytest ranks until 2026-11-26. In the mpich -n 4 stage, after some 800
tests in the same processes, torch's profiler crashed there twice in four CI runs (an abort
in prepare_trace, a segmentation fault in key_averages); 1800 profiled sessions in one process
under load and three whole -n 4 stages outside CI never did. A job per world size is what a
user runs, and a crash there fails this test alone instead of a whole stage."""

from __future__ import annotations

import json
import textwrap

import pytest

from mpaccel.testing import run_mpi

pytestmark = [pytest.mark.mpi(size=1), pytest.mark.launches]  # each test starts its own mpiexec

_SCRIPT = textwrap.dedent("""
    import json, os, sys

    import torch

    from mpaccel import Accelerator
    from mpaccel.utils import PROFILE_PATTERN_NAME, ProfileKwargs, constants

    out = sys.argv[1]
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    traces = os.path.join(out, "traces")
    acc = Accelerator(kwargs_handlers=[ProfileKwargs(activities=["cpu"],
                                                     output_trace_dir=traces)])
    model = acc.prepare(model)
    rank = acc.process_index
    result = {}

    # the Accelerator's handler: one trace per rank, named by PROFILE_PATTERN_NAME
    with acc.profile() as prof:
        model(torch.randn(2, 8)).sum().backward()
    result["table_has_addmm"] = any("addmm" in e.key for e in prof.key_averages())
    acc.wait_for_everyone()
    result["traces"] = sorted(os.listdir(traces))
    with open(os.path.join(traces, PROFILE_PATTERN_NAME.format(suffix=rank))) as f:
        events = json.load(f)["traceEvents"]
    result["trace_has_addmm"] = any("addmm" in e.get("name", "") for e in events)

    # PROFILE_PATTERN_NAME changed: profile() formats the current value
    constants.PROFILE_PATTERN_NAME = "trace-of-rank-{suffix}.json"
    renamed = os.path.join(out, "renamed")
    with acc.profile(ProfileKwargs(activities=["cpu"], output_trace_dir=renamed)):
        torch.ones(3).sum()
    acc.wait_for_everyone()
    result["renamed"] = sorted(os.listdir(renamed))

    # a handler for one block overrides the Accelerator's; on_trace_ready runs on every rank
    # at the end of each active cycle
    ready = []
    handler = ProfileKwargs(
        activities=["cpu"],
        schedule_option={"wait": 1, "warmup": 1, "active": 1},
        on_trace_ready=lambda p: ready.append(p.step_num),
        record_shapes=True,
    )
    with acc.profile(handler) as prof:
        for _ in range(4):
            model(torch.randn(2, 8)).sum().backward()
            prof.step()
    result["ready"] = ready
    print("RESULT", json.dumps(result), flush=True)
""")


def test_profile_traces_names_and_schedule_on_every_rank(tmp_path):
    # Two processes: each rank's file name and schedule come from its own rank, so a third and
    # fourth rank ask nothing new (the run at 4 cost 19 s of CPU, twice the run at 2).
    n = 2
    script = tmp_path / "profile_ranks.py"
    script.write_text(_SCRIPT)
    run = run_mpi([str(script), str(tmp_path / "out")], n=n, timeout=180).check()
    for rank, out in enumerate(run.stdout):
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        assert len(lines) == 1, run.describe()
        result = json.loads(lines[0][len("RESULT "):])
        assert result["table_has_addmm"] and result["trace_has_addmm"], (rank, result)
        assert result["traces"] == sorted(f"profile_{r}.json" for r in range(n))
        assert result["renamed"] == sorted(f"trace-of-rank-{r}.json" for r in range(n))
        assert result["ready"] == [3], (rank, result)  # after wait, warmup and the active step
