"""Process control with mpaccel: run with `mpiexec -n 4 python examples/process_control.py`
(or `srun --mpi=pmi2 -n 4 python ...`, or plain `python ...` for one process)."""

from __future__ import annotations

import time

from mpaccel import Accelerator


def main() -> None:
    accelerator = Accelerator()
    rank, size = accelerator.process_index, accelerator.num_processes

    # Everyone reports where they are: one line per process, in whatever order they arrive.
    print(
        f"process {rank}/{size}: local {accelerator.local_process_index}, node "
        f"{accelerator.node_index}/{accelerator.num_nodes}, device {accelerator.device}",
        flush=True,
    )
    accelerator.wait_for_everyone()

    # Once per node, and once in the whole job.
    accelerator.print(
        f"{accelerator.distributed_type}: {size} process(es) on {accelerator.num_nodes} node(s)"
    )

    @accelerator.on_main_process
    def announce(text: str) -> None:
        print(text, flush=True)

    announce("main process: preparing the shared data first")
    with accelerator.main_process_first():
        # The main process 'downloads'; the others enter only after it has left the block.
        if accelerator.is_main_process:
            time.sleep(0.2)
        prepared = [f"sample-{i}" for i in range(10)]

    # Distributed inference style: each process takes its share of the prompts.
    with accelerator.split_between_processes(prepared, apply_padding=True) as mine:
        print(f"process {rank} works on {mine}", flush=True)

    # Early stopping agreed across processes: the last process raises the flag at step 3.
    for step in range(10):
        if accelerator.is_last_process and step == 3:
            accelerator.set_trigger()
        if accelerator.check_trigger():
            announce(f"stopping at step {step}: a process asked for it")
            break

    accelerator.wait_for_everyone()
    announce("done")


if __name__ == "__main__":
    main()
