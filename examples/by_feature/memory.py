"""find_executable_batch_size: start from a large batch and, each time a batch does not fit
in memory, start the training over with a smaller one, on every process together.

    mpiexec -n 2 python memory.py --starting_batch_size 128 --device_capacity 40

A CPU job seldom runs out of memory, so to show the retry this script pretends the device
holds at most --device_capacity samples per batch: a larger batch raises the error torch's
CPU allocator raises when memory runs out. Accelerate's calls only: with `accelerate` in the
two mpaccel import lines it is an Accelerate script.
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
    metric = Accuracy()

    # The decorated function builds everything that depends on the batch size: each attempt
    # starts over with fresh objects. It is called without its batch_size argument.
    @find_executable_batch_size(starting_batch_size=config["batch_size"])
    def inner_training_loop(batch_size):
        nonlocal accelerator  # the accelerator of the failed attempt is reused
        accelerator.free_memory()  # drop what the failed attempt prepared
        set_seed(config["seed"])
        accelerator.print(f"trying batch size {batch_size}")
        model = TinyClassifier().to(accelerator.device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])
        train_dataloader, eval_dataloader = get_dataloaders(accelerator, batch_size)
        lr_scheduler = linear_schedule(optimizer, 10, len(train_dataloader) * config["num_epochs"])
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
            model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
        )
        for epoch in range(config["num_epochs"]):
            model.train()
            for batch in train_dataloader:
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
        accelerator.print(f"trained with batch size {batch_size}")

    inner_training_loop()
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mixed_precision", default=None, choices=["no", "fp16", "bf16"])
    parser.add_argument("--cpu", action="store_true", help="train on the CPU even with a GPU")
    parser.add_argument("--starting_batch_size", type=int, default=128)
    parser.add_argument("--device_capacity", type=int, default=None,
                        help="pretend a batch of more samples than this does not fit")
    parser.add_argument("--num_epochs", type=int, default=2)
    args = parser.parse_args()
    config = {"lr": 1e-2, "num_epochs": args.num_epochs, "seed": 42,
              "batch_size": args.starting_batch_size}
    training_function(config, args)


if __name__ == "__main__":
    main()
