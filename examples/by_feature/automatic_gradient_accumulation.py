"""Automatic gradient accumulation: keep the batch the training was designed for (here 64
samples per process and step) when it does not fit in memory. find_executable_batch_size
finds a batch that fits, and gradient accumulation makes up the difference:
64 = fitting batch x accelerator.gradient_accumulation_steps.

    mpiexec -n 2 python automatic_gradient_accumulation.py --batch_size 64 --device_capacity 20

A CPU job seldom runs out of memory, so this script pretends the device holds at most
--device_capacity samples per batch (toy.pretend_the_batch_fits). Accelerate's calls only: with
`accelerate` in the mpaccel import lines it is an Accelerate script.
"""

import argparse

import torch
from toy import (
    Accuracy,
    TinyClassifier,
    get_dataloaders,
    linear_schedule,
    pretend_the_batch_fits,
)

from mpaccel import Accelerator, find_executable_batch_size
from mpaccel.utils import set_seed


def training_function(config, args):
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    observed_batch_size = config["batch_size"]
    metric = Accuracy()

    # Halve the batch on each out-of-memory error, so that it keeps dividing the observed one.
    tried = [observed_batch_size]

    def halve():
        tried.append(tried[-1] // 2)
        return tried[-1]

    @find_executable_batch_size(starting_batch_size=observed_batch_size, reduce_batch_size_fn=halve)
    def inner_training_loop(batch_size):
        nonlocal accelerator
        accelerator.gradient_accumulation_steps = observed_batch_size // batch_size
        accelerator.free_memory()
        set_seed(config["seed"])
        accelerator.print(
            f"batch size {batch_size} x {accelerator.gradient_accumulation_steps} "
            "accumulation steps"
        )
        model = TinyClassifier().to(accelerator.device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])
        train_dataloader, eval_dataloader = get_dataloaders(accelerator, batch_size)
        lr_scheduler = linear_schedule(optimizer, 2, len(train_dataloader) * config["num_epochs"])
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
            model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
        )
        for epoch in range(config["num_epochs"]):
            model.train()
            for batch in train_dataloader:
                with accelerator.accumulate(model):
                    pretend_the_batch_fits(len(batch["labels"]), args.device_capacity)
                    outputs = model(**batch)
                    accelerator.backward(outputs.loss)
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad()
            model.eval()
            for batch in eval_dataloader:
                with torch.no_grad():
                    outputs = model(**batch)
                predictions = outputs.logits.argmax(dim=-1)
                predictions, references = accelerator.gather_for_metrics(
                    (predictions, batch["labels"])
                )
                metric.add_batch(predictions=predictions, references=references)
            accelerator.print(f"epoch {epoch}:", metric.compute())

    inner_training_loop()
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mixed_precision", default=None, choices=["no", "fp16", "bf16"])
    parser.add_argument("--cpu", action="store_true", help="train on the CPU even with a GPU")
    parser.add_argument("--batch_size", type=int, default=64, help="per process and step")
    parser.add_argument("--device_capacity", type=int, default=None,
                        help="pretend a batch of more samples than this does not fit")
    parser.add_argument("--num_epochs", type=int, default=2)
    args = parser.parse_args()
    config = {"lr": 1e-2, "num_epochs": args.num_epochs, "seed": 42, "batch_size": args.batch_size}
    training_function(config, args)


if __name__ == "__main__":
    main()
