"""What each of Accelerate's scripts calls in its main(), one statement per function, for
`run.py --each`: executed in the script's namespace after a state reset, on the world sizes
where main() makes that call (`when`, an expression of the world size `n`). A few calls that
main() makes on GPUs only are CPU-applicable and listed too, to show where mpaccel stands."""

from __future__ import annotations

from typing import NamedTuple


class Call(NamedTuple):
    name: str  # no spaces: run.py's report is "OUTCOME NAME ..."
    statement: str
    when: str = "True"  # an expression of n, the number of processes: else not applicable
    xfail: str = "False"  # an expression of n: expected to fail there, for `reason`
    reason: str = ""
    hangs: bool = False  # when it fails, the other ranks wait for it: not run where xfail


# Accelerate 1.15 fails this one itself at 4 processes (measured under `accelerate launch
# --multi_gpu --num_processes 4` on CPU): 2 rows give ranks 2 and 3 an empty share, and the
# script expects the last row there; mpaccel gives Accelerate's shares (docs/process-control.md).
SPLIT_TENSOR_REASON = (
    "Accelerate 1.15 fails its own test_split_between_processes_tensor at n > 2 "
    "(ranks past 2 rows get an empty share, as in mpaccel; the script expects the last row)"
)

# (split_batches, dispatch_batches, sync_each_batch), as main() loops over them
_FLAGS = [f"({a},{b},{c})" for a in (True, False) for b in (True, False) for c in (True, False)]
_TWO = "n == 2"  # test_distributed_data_loop's create_accelerator() asserts two processes

CALLS: dict[str, list[Call]] = {
    "test_ops.py": [
        Call(name, f"{name}(PartialState())")
        for name in (
            "test_gather", "test_gather_object", "test_gather_non_contiguous", "test_broadcast",
            "test_pad_across_processes", "test_reduce_sum", "test_reduce_mean",
            "test_reduce_max", "test_op_checker", "test_copy_tensor_to_devices",
        )
    ],
    "test_sync.py": [
        Call("test_dataloader_break", "test_dataloader_break()"),
        Call("test_noop_sync", "test_noop_sync(Accelerator())", "n == 1"),
        Call("test_distributed_sync", "test_distributed_sync(Accelerator())", "n > 1"),
        Call("test_distributed_sync_multiple_fwd",
             "test_distributed_sync_multiple_fwd(Accelerator())", "n > 1"),
        # main() runs the variants on GPUs only (not MULTI_CPU): they apply to CPU ranks too.
        *[Call(f"test_gradient_accumulation{flags}", f"test_gradient_accumulation{flags}", "n > 1")
          for flags in _FLAGS],
        Call("test_gradient_accumulation_with_opt_and_scheduler()",
             "test_gradient_accumulation_with_opt_and_scheduler()"),
        *[Call(f"test_gradient_accumulation_with_opt_and_scheduler{flags}",
               f"test_gradient_accumulation_with_opt_and_scheduler{flags}", "n > 1")
          for flags in _FLAGS[:-1]],
    ],
    "test_script.py": [
        *[Call(name, f"{name}()") for name in (
            "init_state_check", "process_execution_check", "test_split_between_processes_list",
            "test_split_between_processes_nested_dict",
        )],
        Call("test_split_between_processes_tensor", "test_split_between_processes_tensor()",
             xfail="n > 2", reason=SPLIT_TENSOR_REASON, hangs=True),
        *[Call(name, f"{name}()") for name in (
            "test_split_between_processes_evenly", "rng_sync_check", "dl_preparation_check",
            "central_dl_preparation_check", "custom_sampler_check", "check_seedable_sampler",
            "check_seedable_sampler_with_data_seed",
        )],
        Call("check_seedable_sampler_in_batch_sampler_shard",
             "check_seedable_sampler_in_batch_sampler_shard()", "n > 1"),
        Call("training_check(use_seedable_sampler=False)",
             "training_check(use_seedable_sampler=False)"),
        Call("training_check(use_seedable_sampler=True)",
             "training_check(use_seedable_sampler=True)"),
        Call("test_trigger", "test_trigger()"),
        Call("test_reinstantiated_state", "test_reinstantiated_state()"),
    ],
    "test_distributed_data_loop.py": [
        *[Call(name, f"create_accelerator(); {name}()", _TWO) for name in (
            "test_default_ensures_even_batch_sizes", "test_can_disable_even_batches",
            "test_can_join_uneven_inputs", "test_join_can_override_even_batches",
            "test_join_can_override_for_mixed_type_dataloaders",
            "test_join_raises_warning_for_iterable_when_overriding_even_batches",
        )],
        Call("test_join_raises_warning_for_non_ddp_distributed",
             "accelerator = create_accelerator()\n"
             "original = accelerator.state.distributed_type\n"
             "accelerator.state.distributed_type = DistributedType.FSDP\n"
             "try:\n    test_join_raises_warning_for_non_ddp_distributed(accelerator)\n"
             "finally:\n    accelerator.state.distributed_type = original", _TWO),
        Call("test_pickle_accelerator", "create_accelerator(); test_pickle_accelerator()", _TWO),
        Call("test_data_loader(shuffle=False)",
             "test_data_loader(DataLoader(DummyDataset(), shuffle=False, batch_size=BATCH_SIZE,"
             " num_workers=NUM_WORKERS), create_accelerator())", _TWO),
        Call("test_data_loader(shuffle=True)",
             "test_data_loader(DataLoader(DummyDataset(), shuffle=True, batch_size=BATCH_SIZE,"
             " num_workers=NUM_WORKERS), create_accelerator())", _TWO),
        Call("test_data_loader(batch_sampler=)",
             "test_data_loader(DataLoader(DummyDataset(), batch_sampler=BatchSampler("
             "RandomSampler(DummyDataset()), batch_size=BATCH_SIZE, drop_last=False),"
             " num_workers=NUM_WORKERS), create_accelerator())", _TWO),
        Call("test_data_loader(sampler=BatchSampler)",
             "test_data_loader(DataLoader(DummyDataset(), sampler=BatchSampler(RandomSampler("
             "DummyDataset()), batch_size=BATCH_SIZE, drop_last=False), batch_size=None,"
             " collate_fn=default_collate, num_workers=NUM_WORKERS), create_accelerator())",
             _TWO),
        Call("test_stateful_dataloader", "test_stateful_dataloader(create_accelerator())", _TWO),
        Call("test_stateful_dataloader_save_state",
             "test_stateful_dataloader_save_state(create_accelerator())", _TWO),
    ],
    "external_deps/test_metrics.py": [
        *[Call(f"test_torch_metrics(split_batches={split},dispatch_batches={dispatch},99)",
               "test_torch_metrics(Accelerator(dataloader_config=DataLoaderConfiguration("
               f"split_batches={split}, dispatch_batches={dispatch})), 99)")
          for split in (True, False) for dispatch in (True, False)],
        Call("test_torch_metrics(512)", "test_torch_metrics(Accelerator(), 512)"),
        Call("test_gather_for_metrics_drop_last", "test_gather_for_metrics_drop_last()"),
        # main() runs these two on GPUs only; they apply to CPU ranks too.
        Call("test_gather_for_metrics_with_iterable_dataset",
             "test_gather_for_metrics_with_iterable_dataset()"),
        Call("test_gather_for_metrics_with_non_tensor_objects_iterable_dataset",
             "test_gather_for_metrics_with_non_tensor_objects_iterable_dataset()"),
    ],
}
