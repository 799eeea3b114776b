"""Saving twice into the same directory (save_state(d) then save_state(d)): a rank killed during
the second save leaves the first loadable, FSDP (sharded part + state index, two commits) and
ordinary alike; once the second is committed, the first's files are gone."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent('''
    import json, os, signal, sys
    import numpy as np, torch
    sys.path.insert(0, ROOT_DIR)
    from tests.strategy.test_fsdp import GLOBAL_BATCH, Tiny, _data, _plugin
    from torch.utils.data import DataLoader
    from mpaccel import Accelerator
    from mpaccel.checkpoint import api, writer
    from mpaccel.checkpoint.sharded import save as sharded
    from mpaccel.testing import reset_state

    kind, where, mode, directory = sys.argv[1:5]
    target = os.path.join(directory, "ckpt")
    reference = os.path.join(directory, "reference.npz")

    def prepared(seed):
        reset_state()
        acc = Accelerator(fsdp_plugin=_plugin()) if kind == "fsdp" else Accelerator()
        model = Tiny(seed=seed)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        loader = DataLoader(_data(), batch_size=GLOBAL_BATCH // acc.num_processes)
        return acc, *acc.prepare(model, opt, loader)

    def steps(acc, model, opt, loader, count):
        for i, (x, y) in enumerate(loader):
            if i >= count:
                break
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()

    def full(acc, model, opt):
        whole = lambda v: v.full_tensor() if hasattr(v, "full_tensor") else v
        out = {f"model/{k}": whole(v).detach().clone()
               for k, v in acc.unwrap_model(model).state_dict().items()}
        for pid, state in opt.state_dict()["state"].items():
            out.update({f"optim/{pid}.{k}": whole(v).clone() for k, v in state.items()})
        return out

    def kill():
        os.kill(os.getpid(), signal.SIGKILL)

    if mode == "crash":
        acc, model, opt, loader = prepared(1)
        steps(acc, model, opt, loader, 2)
        acc.save_state(target)
        saved = full(acc, model, opt)
        if acc.is_main_process:
            np.savez(reference, **{k: v.numpy() for k, v in saved.items()})
        steps(acc, model, opt, loader, 1)
        if where == "rows" and acc.process_index == 1:  # its file written, nothing committed
            module = sharded if kind == "fsdp" else writer
            name = "_write_rank_file" if kind == "fsdp" else "write_h5"
            original = getattr(module, name)
            setattr(module, name, lambda *a: (original(*a), kill()))
        if where == "between" and acc.is_main_process:  # the sharded part committed, not the state
            api.write_checkpoint = lambda *a, **k: kill()
        acc.save_state(target)
        print("not killed", flush=True)
    else:
        expected = {k: torch.from_numpy(v) for k, v in np.load(reference).items()}
        acc, model, opt, loader = prepared(7)
        acc.load_state(target)
        got = full(acc, model, opt)
        assert got.keys() == expected.keys()
        for key in got:
            torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0, msg=key)
        print("loaded the first save", flush=True)
        # saving again over the survivor completes, and leaves one save's files
        steps(acc, model, opt, loader, 1)
        acc.save_state(target)
        now = full(acc, model, opt)
        acc.wait_for_everyone()
        names = sorted(os.listdir(target))
        state = json.load(open(os.path.join(target, "state.index.json")))
        ids = {n.split("-")[1] for n in names if n.endswith(".h5")}
        assert ids == {state["save_id"]} | ({state["metadata"]["sharded"]} if kind == "fsdp"
                                            else set()), names
        assert all(n.endswith((".h5", ".index.json")) for n in names), names
        assert len([n for n in names if n.endswith(".index.json")]) == (
            2 if kind == "fsdp" else 1), names
        acc, model, opt, loader = prepared(7)
        acc.load_state(target)
        got = full(acc, model, opt)
        for key in got:
            torch.testing.assert_close(got[key], now[key], rtol=0, atol=0, msg=key)
        print("loaded the third save", flush=True)
''')


@pytest.mark.launches
@pytest.mark.mpi(size=1)  # nests mpiexec
@pytest.mark.mpi_timeout(900)
@pytest.mark.parametrize(("kind", "where"),
                         [("fsdp", "between"), ("fsdp", "rows"), ("plain", "rows")])
def test_a_rank_killed_in_a_second_save_into_the_directory_leaves_the_first(
        tmp_path: Path, kind: str, where: str):
    from mpaccel.testing import run_mpi

    script = tmp_path / "job.py"
    script.write_text(SCRIPT.replace("ROOT_DIR", repr(str(Path(__file__).parents[2]))))
    run = run_mpi([str(script), kind, where, "crash", str(tmp_path)], n=2, timeout=300)
    assert run.returncode != 0 and not run.timed_out, run.describe()
    assert "not killed" not in run.stdout[0] + run.stdout[1], run.describe()
    names = os.listdir(tmp_path / "ckpt")
    if where == "between":  # it got to the window between the two commits
        import json

        sharded = json.loads((tmp_path / "ckpt" / "sharded.index.json").read_text())
        state = json.loads((tmp_path / "ckpt" / "state.index.json").read_text())
        assert sharded["save_id"] != state["metadata"]["sharded"], names
    run = run_mpi([str(script), kind, where, "load", str(tmp_path)], n=2, timeout=300).check()
    assert "loaded the first save" in run.stdout[0], run.describe()
    assert "loaded the third save" in run.stdout[0], run.describe()
