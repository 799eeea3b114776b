"""Checkpointing: save_state() every N steps or every epoch, and resume from any checkpoint,
in the middle of an epoch included (load_state, then skip_first_batches).

    mpiexec -n 2 python checkpointing.py --checkpointing_steps 10 --output_dir ckpt
    mpiexec -n 2 python checkpointing.py --resume_from_checkpoint ckpt/step_20

The resumed run ends with the same model as the run that was never interrupted (the same last
line). Accelerate's calls only: with `accelerate` in the two mpaccel import lines it is an
Accelerate script.
"""

import argparse
import os

import torch
from toy import Accuracy, TinyClassifier, get_dataloaders, linear_schedule, weights_digest

from mpaccel import Accelerator, DataLoaderConfiguration
from mpaccel.utils import set_seed


def training_function(config, args):
    dataloader_config = DataLoaderConfiguration(
        use_stateful_dataloader=args.use_stateful_dataloader
    )
    accelerator = Accelerator(
        cpu=args.cpu, mixed_precision=args.mixed_precision, dataloader_config=dataloader_config
    )
    checkpointing_steps = args.checkpointing_steps
    if checkpointing_steps is not None and checkpointing_steps.isdigit():
        checkpointing_steps = int(checkpointing_steps)
    elif checkpointing_steps not in (None, "epoch"):
        raise ValueError(
            f"--checkpointing_steps must be a number or 'epoch', not {checkpointing_steps!r}"
        )

    set_seed(config["seed"])
    train_dataloader, eval_dataloader = get_dataloaders(accelerator, config["batch_size"])
    model = TinyClassifier().to(accelerator.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])
    lr_scheduler = linear_schedule(optimizer, 10, len(train_dataloader) * config["num_epochs"])
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    metric = Accuracy()

    overall_step, starting_epoch, resume_step = 0, 0, None
    if args.resume_from_checkpoint:
        accelerator.print(f"Resumed from checkpoint: {args.resume_from_checkpoint}")
        accelerator.load_state(args.resume_from_checkpoint)
        name = os.path.basename(os.path.normpath(args.resume_from_checkpoint))
        if name.startswith("epoch_"):  # saved at the end of that epoch
            starting_epoch = int(name[len("epoch_"):]) + 1
            overall_step = starting_epoch * len(train_dataloader)
        else:  # saved after that many steps: maybe in the middle of an epoch
            overall_step = int(name[len("step_"):])
            starting_epoch, resume_step = divmod(overall_step, len(train_dataloader))

    for epoch in range(starting_epoch, config["num_epochs"]):
        model.train()
        active_dataloader = train_dataloader
        if epoch == starting_epoch and resume_step and not args.use_stateful_dataloader:
            # A stateful loader got its position back from load_state(); a plain one skips.
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        for batch in active_dataloader:
            outputs = model(**batch)
            accelerator.backward(outputs.loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            overall_step += 1
            if isinstance(checkpointing_steps, int) and overall_step % checkpointing_steps == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"step_{overall_step}"))

        model.eval()
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
            metric.add_batch(predictions=predictions, references=references)
        accelerator.print(f"epoch {epoch}:", metric.compute())
        if checkpointing_steps == "epoch":
            accelerator.save_state(os.path.join(args.output_dir, f"epoch_{epoch}"))

    accelerator.print(f"final weights digest: {weights_digest(model):.12f}")
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mixed_precision", default=None, choices=["no", "fp16", "bf16"])
    parser.add_argument("--cpu", action="store_true", help="train on the CPU even with a GPU")
    parser.add_argument("--checkpointing_steps", default=None,
                        help="save every N steps (a number), or 'epoch' at each epoch's end")
    parser.add_argument("--output_dir", default=".", help="where the checkpoints go")
    parser.add_argument("--resume_from_checkpoint", default=None, help="a checkpoint to resume")
    parser.add_argument("--use_stateful_dataloader", action="store_true",
                        help="torchdata's StatefulDataLoader: load_state restores its position")
    parser.add_argument("--num_epochs", type=int, default=3)
    args = parser.parse_args()
    config = {"lr": 1e-2, "num_epochs": args.num_epochs, "seed": 42, "batch_size": 16}
    training_function(config, args)


if __name__ == "__main__":
    main()
