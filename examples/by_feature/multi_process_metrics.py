"""Metrics over several processes: each process evaluates its share of the evaluation set,
and gather_for_metrics() collects the predictions of all of them, dropping the samples that
were repeated to give every process a full last batch: each sample counted exactly once.

    mpiexec -n 2 python multi_process_metrics.py

The evaluation set has 203 samples (not a multiple of 2 processes x 32): the script also does
it by hand, with gather() and cutting the last batch, as Accelerate's example shows, and
checks that the references come back as the dataset's labels, in order. Accelerate's calls
only: with `accelerate` in the mpaccel import lines it is an Accelerate script.
"""

import argparse

import torch
from toy import Accuracy, TinyClassifier, get_dataloaders, linear_schedule

from mpaccel import Accelerator
from mpaccel.utils import set_seed


def training_function(config, args):
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    set_seed(config["seed"])
    train_dataloader, eval_dataloader = get_dataloaders(accelerator, config["batch_size"])
    labels = eval_dataloader.dataset.labels  # before prepare(): the whole evaluation set
    model = TinyClassifier().to(accelerator.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])
    lr_scheduler = linear_schedule(optimizer, 10, len(train_dataloader) * config["num_epochs"])
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    metric, by_hand = Accuracy(), Accuracy()

    for epoch in range(config["num_epochs"]):
        model.train()
        for batch in train_dataloader:
            outputs = model(**batch)
            accelerator.backward(outputs.loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()

        model.eval()
        samples_seen, seen_references = 0, []
        for step, batch in enumerate(eval_dataloader):
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            # The simple way: repeated samples are dropped for you.
            kept = accelerator.gather_for_metrics((predictions, batch["labels"]))
            metric.add_batch(predictions=kept[0], references=kept[1])
            seen_references.append(kept[1].cpu())
            # By hand: gather everything, and cut the last batch to the dataset's length.
            predictions, references = accelerator.gather((predictions, batch["labels"]))
            if accelerator.use_distributed:
                if step == len(eval_dataloader) - 1:
                    predictions = predictions[: len(eval_dataloader.dataset) - samples_seen]
                    references = references[: len(eval_dataloader.dataset) - samples_seen]
                else:
                    samples_seen += references.shape[0]
            by_hand.add_batch(predictions=predictions, references=references)
        eval_metric = metric.compute()
        accelerator.print(f"epoch {epoch}:", eval_metric)
        accelerator.print(f"  the same by hand: {by_hand.compute() == eval_metric}; each sample "
                          f"once, in order: {torch.equal(torch.cat(seen_references), labels)}")
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mixed_precision", default=None, choices=["no", "fp16", "bf16"])
    parser.add_argument("--cpu", action="store_true", help="train on the CPU even with a GPU")
    parser.add_argument("--num_epochs", type=int, default=2)
    args = parser.parse_args()
    config = {"lr": 1e-2, "num_epochs": args.num_epochs, "seed": 42, "batch_size": 16}
    training_function(config, args)


if __name__ == "__main__":
    main()
