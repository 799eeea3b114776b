"""Gradient accumulation: Accelerator(gradient_accumulation_steps=N) and the
accelerator.accumulate(model) block sum the gradients of N batches (without all-reducing
them in between) before each optimizer step; the scheduler steps with the optimizer.

    mpiexec -n 2 python gradient_accumulation.py --gradient_accumulation_steps 2 --batch_size 8

Accumulating 2 batches of 8 per process trains the same model as batches of 16 without
accumulation (the same samples per optimizer step): compare the last lines of the two runs.
Accelerate's calls only: with `accelerate` in the mpaccel import lines it is an Accelerate
script.
"""

import argparse

import torch
from toy import Accuracy, TinyClassifier, get_dataloaders, linear_schedule, weights_digest

from mpaccel import Accelerator
from mpaccel.utils import set_seed


def training_function(config, args):
    accelerator = Accelerator(
        cpu=args.cpu,
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
    )
    set_seed(config["seed"])
    train_dataloader, eval_dataloader = get_dataloaders(accelerator, config["batch_size"])
    model = TinyClassifier().to(accelerator.device)
    # Plain SGD: the update is linear in the gradient, so the two runs above match closely.
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
    steps = len(train_dataloader) * config["num_epochs"] // args.gradient_accumulation_steps
    lr_scheduler = linear_schedule(optimizer, 2, steps)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    metric = Accuracy()

    for epoch in range(config["num_epochs"]):
        model.train()
        for batch in train_dataloader:
            with accelerator.accumulate(model):
                outputs = model(**batch)
                accelerator.backward(outputs.loss)  # scaled by 1/N inside accumulate()
                optimizer.step()  # a no-op until the N-th batch
                lr_scheduler.step()
                optimizer.zero_grad()
        model.eval()
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
            metric.add_batch(predictions=predictions, references=references)
        accelerator.print(f"epoch {epoch}:", metric.compute())
    accelerator.print(f"final weights digest: {weights_digest(model):.9f}")
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mixed_precision", default=None, choices=["no", "fp16", "bf16"])
    parser.add_argument("--cpu", action="store_true", help="train on the CPU even with a GPU")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=8, help="per process and batch")
    parser.add_argument("--num_epochs", type=int, default=3)
    args = parser.parse_args()
    config = {"lr": 0.2, "num_epochs": args.num_epochs, "seed": 42, "batch_size": args.batch_size}
    training_function(config, args)


if __name__ == "__main__":
    main()
