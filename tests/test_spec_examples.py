"""The examples of the Accelerate documents that specify mpaccel (shared/seeds), with `mpaccel`
in place of `accelerate`, at size 1 and N."""

from __future__ import annotations

import inspect
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import mpaccel
from mpaccel import Accelerator, AcceleratorState, GradientState, PartialState
from mpaccel.state import AcceleratorState as AcceleratorStateFromState
from mpaccel.state import PartialState as PartialStateFromState
from mpaccel.utils import GradientAccumulationPlugin, InitProcessGroupKwargs


def test_names_and_module_paths():
    assert mpaccel.PartialState is PartialStateFromState
    assert AcceleratorStateFromState is AcceleratorState
    for name in ("destroy_process_group", "local_main_process_first", "main_process_first",
                 "on_last_process", "on_local_main_process", "on_local_process",
                 "on_main_process", "on_process", "set_device", "split_between_processes",
                 "wait_for_everyone"):
        assert callable(getattr(PartialState, name)), name
    # Listed on the class itself, with the documents' signatures (not only reachable on an
    # instance): help() and inspect.signature work on them.
    documented = {
        "destroy_process_group": "(self, group: 'Any' = None) -> 'None'",
        "get_deepspeed_plugin": "(self, name: 'str') -> 'Any'",
        "local_main_process_first": "(self)",
        "main_process_first": "(self)",
        "select_deepspeed_plugin": "(self, name: 'str | None' = None) -> 'None'",
        "split_between_processes": "(self, inputs: 'Any', apply_padding: 'bool' = False)",
    }
    for name, signature in documented.items():
        method = AcceleratorState.__dict__.get(name)
        assert callable(method), name
        assert str(inspect.signature(method)).startswith(signature), (name, signature)


def test_partial_state_with_init_process_group_kwargs(comm):
    kwargs = InitProcessGroupKwargs(timeout=600).to_kwargs()
    state = PartialState(**kwargs)
    for attribute in ("device", "distributed_type", "local_process_index", "mixed_precision",
                      "num_processes", "process_index", "is_last_process", "is_main_process",
                      "is_local_main_process", "debug"):
        getattr(state, attribute)
    assert AcceleratorState().initialized
    gs = GradientState()
    for attribute in ("end_of_dataloader", "remainder", "sync_gradients", "active_dataloader",
                      "dataloader_references", "num_steps", "adjust_scheduler",
                      "sync_with_dataloader", "is_xla_gradients_synced"):
        getattr(gs, attribute)


def test_wait_for_everyone_example(capsys, comm):
    state = PartialState()
    if state.is_main_process:
        time.sleep(0.2)
    else:
        print("I'm waiting for the main process to finish its sleep...")
    state.wait_for_everyone()
    print("Everyone is here")
    assert capsys.readouterr().out.endswith("Everyone is here\n")


def test_decorator_examples(capsys, comm):
    state = PartialState()

    @state.on_last_process
    def print_something():
        print(f"Printed on process {state.process_index}")

    @state.on_main_process
    def print_main():
        print("This will be printed by process 0 only.")

    @state.on_process(process_index=comm.size - 1)
    def print_index():
        print(f"Printed on process {state.process_index}")

    accelerator = Accelerator()

    @accelerator.on_local_process(local_process_index=0)
    def print_local():
        print(f"Printed on process {accelerator.local_process_index}")

    @accelerator.on_local_process(local_process_idx=0)
    def do_my_thing():
        print("Something done on process index 0 on each server")

    for f in (print_something, print_main, print_index, print_local, do_my_thing):
        f()
    out = capsys.readouterr().out
    last = comm.rank == comm.size - 1
    assert (f"Printed on process {comm.rank}\n" * 2 in out) == last
    assert ("process 0 only" in out) == (comm.rank == 0)
    assert ("on each server" in out) == accelerator.is_local_main_process


def test_split_between_processes_example(comm):
    state = PartialState()
    with state.split_between_processes(["A", "B", "C"]) as inputs:
        if comm.size == 2:
            assert inputs == [["A", "B"], ["C"]][comm.rank]
    with state.split_between_processes(["A", "B", "C"], apply_padding=True) as inputs:
        if comm.size == 2:
            assert inputs == [["A", "B"], ["C", "C"]][comm.rank]


def test_main_process_first_examples(comm):
    accelerator = Accelerator()
    with accelerator.main_process_first():
        print(f"This will be printed by process {accelerator.process_index}")
    state = PartialState()
    with state.local_main_process_first():
        print(f"This will be printed by process {state.local_process_index}")


def test_quick_adaptation_and_accumulation_example(mpi_tmp_path, comm):
    plugin = GradientAccumulationPlugin(num_steps=2)
    accelerator = Accelerator(gradient_accumulation_plugin=plugin)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    training_dataloader = DataLoader(data, batch_size=4)
    model, optimizer, training_dataloader, scheduler = accelerator.prepare(
        model, optimizer, training_dataloader, scheduler)
    for input, labels in training_dataloader:  # the document names them so
        with accelerator.accumulate(model):
            predictions = model(input)
            loss = torch.nn.functional.mse_loss(predictions, labels)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            accelerator.clip_grad_value_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    all_predictions = accelerator.gather(predictions)
    assert all_predictions.shape[0] == predictions.shape[0] * comm.size
    accelerator.print("My thing I want to print!")
    accelerator.wait_for_everyone()
    accelerator.save_model(model, mpi_tmp_path / "save_directory", max_shard_size="1GB",
                           safe_serialization=True)
    unwrapped_model = accelerator.unwrap_model(model)
    accelerator.save(unwrapped_model.state_dict(), mpi_tmp_path / "weights.pth")
    accelerator.wait_for_everyone()
    with accelerator.main_process_first():
        state = torch.load(mpi_tmp_path / "weights.pth")
        unwrapped_model.load_state_dict(state)


def test_early_stopping_example(comm):
    accelerator = Accelerator()
    stopped_at = None
    for step in range(5):
        loss = torch.tensor(1.0 / (step + 1))
        if accelerator.is_last_process and loss < 0.4:  # should_do_early_stopping(loss)
            accelerator.set_trigger()
        if accelerator.check_trigger():
            stopped_at = step
            break
    assert stopped_at == 2
