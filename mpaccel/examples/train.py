"""Train a small classifier with mpaccel, on data generated on the spot (no downloads).

    mpiexec -n 4 python -m mpaccel.examples.train
    srun --mpi=pmi2 -n 8 python -m mpaccel.examples.train --epochs 20
    python -m mpaccel.examples.train              # one process
    mpiexec -n 4 python examples/train.py         # the same, from a checkout

Shows: prepare(), gradient accumulation, clipping, a progress bar on the main process only (a
live bar at a terminal, also under mpiexec; plain lines in a batch log), logging with
get_logger, evaluation with gather_for_metrics (each validation sample counted exactly once),
and early stopping agreed across processes with set_trigger()/check_trigger().

With --project-dir it checkpoints (HDF5, rotated) and resumes from the latest checkpoint; with
--preemptible it also stops cleanly on SIGUSR1/SIGTERM (Slurm's --signal, preemption, wall time):
checkpoint at the next step, requeue the job, exit; the requeued job resumes where it stopped.
"""

from __future__ import annotations

import argparse
import logging
import math
import time
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from mpaccel import Accelerator
from mpaccel.checkpoint import latest_checkpoint
from mpaccel.logging import get_logger
from mpaccel.utils import ProjectConfiguration, tqdm

logger = get_logger(__name__)


def progress_bar(batches: Iterable[Any], **kwargs: Any) -> Any:
    """mpaccel's tqdm (main process only), or the batches as they are without the tqdm
    package (`pip install mpaccel[examples]`)."""
    try:
        return tqdm(batches, **kwargs)
    except ImportError:
        return batches


def spirals(n: int, seed: int, noise: float = 0.25) -> TensorDataset:
    """Two interleaved spirals in 2-D, lifted to 16 features: learnable, not trivially so."""
    g = torch.Generator().manual_seed(seed)
    label = torch.randint(0, 2, (n,), generator=g)
    t = torch.rand(n, generator=g) * 3 * math.pi
    angle = t + label * math.pi
    xy = torch.stack([t * torch.cos(angle), t * torch.sin(angle)], dim=1) / (3 * math.pi)
    xy = xy + noise * torch.randn(n, 2, generator=g) / 3
    lift = torch.randn(2, 14, generator=torch.Generator().manual_seed(0))
    return TensorDataset(torch.cat([xy, torch.sin(3 * xy @ lift)], dim=1), label)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--accumulation", type=int, default=2, help="micro-batches per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--mixed-precision", default="no", choices=["no", "bf16", "fp16"])
    p.add_argument("--train-samples", type=int, default=8000)
    p.add_argument("--val-samples", type=int, default=1001, help="odd on purpose: uneven shards")
    p.add_argument("--patience", type=int, default=4, help="epochs without improvement")
    p.add_argument("--target-accuracy", type=float, default=0.97, help="stop early once reached")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--project-dir", help="checkpoint here (checkpoints/checkpoint_N) and resume")
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps; 0: once per epoch")
    p.add_argument("--keep", type=int, default=2, help="checkpoints kept")
    p.add_argument(
        "--preemptible",
        action="store_true",
        help="on SIGUSR1/SIGTERM: checkpoint, requeue the Slurm job, exit",
    )
    p.add_argument(
        "--step-delay",
        type=float,
        default=0.0,
        help="seconds of sleep per step "
        "(to make a short run last long enough to be preempted in tests)",
    )
    return p.parse_args()


class Progress:
    """Where the loop is, saved with every checkpoint (register_for_checkpointing)."""

    def __init__(self) -> None:
        self.epoch, self.step, self.best, self.stale = 0, 0, math.inf, 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "step": self.step, "best": self.best, "stale": self.stale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.step = state["epoch"], state["step"]
        self.best, self.stale = state["best"], state["stale"]


def main() -> None:
    # Without a handler, logger.info() goes nowhere. get_logger's records are emitted by the
    # main process only (unless main_process_only=False) and carry "[RANK r]".
    logging.basicConfig(
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        level=logging.INFO,
    )
    args = parse_args()
    config = None
    if args.project_dir:
        config = ProjectConfiguration(
            project_dir=args.project_dir, automatic_checkpoint_naming=True, total_limit=args.keep
        )
    accelerator = Accelerator(
        gradient_accumulation_steps=args.accumulation,
        mixed_precision=args.mixed_precision,
        project_config=config,
    )
    if args.preemptible:
        accelerator.handle_preemption()  # SIGUSR1/SIGTERM are recorded, acted on below
    torch.manual_seed(args.seed)  # same seed everywhere: same shuffles, same init on rank 0
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 128),
        torch.nn.GELU(),
        torch.nn.Linear(128, 128),
        torch.nn.GELU(),
        torch.nn.Linear(128, 2),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    train = DataLoader(
        spirals(args.train_samples, seed=1), batch_size=args.batch_size, shuffle=True
    )
    val = DataLoader(spirals(args.val_samples, seed=2), batch_size=args.batch_size)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, T_max=args.epochs * len(train) // args.accumulation
    )
    model, optimizer, train, val, scheduler = accelerator.prepare(
        model, optimizer, train, val, scheduler
    )
    accelerator.print(
        f"{accelerator.num_processes} process(es) on {accelerator.num_nodes} node(s), "
        f"device {accelerator.device}, {len(train)} batches of {args.batch_size} per process "
        f"per epoch, {args.accumulation} per optimizer step"
    )

    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if args.project_dir and latest_checkpoint(args.project_dir):
        accelerator.load_state()  # the latest complete checkpoint: weights, optimizer, RNG, data
        accelerator.print(
            f"resumed at epoch {progress.epoch}, step {progress.step} "
            f"(restart {accelerator.restart_count})"
        )

    logger.info("training with %s", vars(args))
    start, samples = time.perf_counter(), 0
    for epoch in range(progress.epoch, args.epochs):
        epoch_start = time.perf_counter()
        progress.epoch = epoch
        model.train()
        train.set_epoch(epoch)  # after a resume: the same order, minus the batches already seen
        # On the main process: a bar redrawn in place where the user's terminal can be reached
        # (also through mpiexec), a plain line every 10% in a batch log; MPACCEL_PROGRESS
        # chooses otherwise (bar, lines, off).
        bar = progress_bar(train, desc=f"epoch {epoch}", leave=False)
        for x, y in bar:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.cross_entropy(model(x), y)
                if not torch.isfinite(loss):  # any rank can stop everyone, at the next check
                    accelerator.set_trigger()
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            samples += x.shape[0]
            progress.step += 1
            if bar is not train and accelerator.is_main_process:
                bar.set_postfix(loss=f"{loss.item():.4f}")
            if args.step_delay:
                time.sleep(args.step_delay)
            if args.preemptible and accelerator.should_stop():
                accelerator.print(
                    f"{accelerator.preempted or 'a signal'} received: stopping "
                    f"at epoch {epoch}, step {progress.step}"
                )
                accelerator.checkpoint_and_exit()  # every rank saves; rank 0 requeues; exit 0
            if (
                args.project_dir
                and args.checkpoint_every
                and (progress.step % args.checkpoint_every == 0)
            ):
                accelerator.save_state()
        if accelerator.check_trigger():
            accelerator.print("a process saw a non-finite loss: stopping")
            break

        model.eval()
        correct = total = 0
        loss_sum = 0.0
        with torch.no_grad():
            for x, y in val:
                logits = model(x)
                losses = torch.nn.functional.cross_entropy(logits, y, reduction="none")
                # per sample, so that the duplicates even_batches added are dropped here too
                preds, labels, losses = accelerator.gather_for_metrics(
                    (logits.argmax(-1), y, losses)
                )
                correct += (preds == labels).sum().item()
                total += labels.numel()
                loss_sum += losses.sum().item()
        val_loss = loss_sum / total
        accuracy = correct / total
        logger.info(
            "epoch %d took %.1f s, learning rate now %.2e",
            epoch,
            time.perf_counter() - epoch_start,
            scheduler.get_last_lr()[0],
        )
        accelerator.print(
            f"epoch {epoch:3d}  val_loss {val_loss:.4f}  accuracy {accuracy:.4f}"
            f"  ({total} validation samples)"
        )
        assert total == args.val_samples  # gather_for_metrics dropped the padding duplicates

        # Early stopping: decided on the main process, obeyed everywhere.
        progress.stale = 0 if val_loss < progress.best - 1e-4 else progress.stale + 1
        progress.best = min(progress.best, val_loss)
        progress.epoch = epoch + 1
        if args.project_dir and not args.checkpoint_every:
            accelerator.save_state()
        if accelerator.is_main_process and (
            progress.stale >= args.patience or accuracy >= args.target_accuracy
        ):
            accelerator.set_trigger()
        if accelerator.check_trigger():
            accelerator.print(f"early stop after epoch {epoch}: accuracy {accuracy:.4f}")
            break

    elapsed = time.perf_counter() - start
    throughput = accelerator.reduce(torch.tensor(float(samples)), "sum").item() / elapsed
    accelerator.print(f"done in {elapsed:.1f} s, {throughput:.0f} training samples/s overall")
    weights = accelerator.unwrap_model(model).parameters()
    digest = sum(p.detach().double().sum().item() for p in weights)
    accelerator.print(f"final parameter digest {digest:.10f} after {progress.step} steps")
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
