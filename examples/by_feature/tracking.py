"""Experiment tracking: Accelerator(log_with="all", project_dir=...) logs to every tracker
whose package is installed (TensorBoard, wandb, mlflow, ...), from the main process only;
init_trackers() records the run's configuration, accelerator.log() the metrics of each epoch.

    mpiexec -n 2 python tracking.py --with_tracking --project_dir runs
    tensorboard --logdir runs

Accelerate's calls only: with `accelerate` in the mpaccel import lines it is an Accelerate
script.
"""

import argparse
import os

import torch
from toy import Accuracy, TinyClassifier, get_dataloaders, linear_schedule

from mpaccel import Accelerator
from mpaccel.utils import set_seed


def training_function(config, args):
    if args.with_tracking:
        accelerator = Accelerator(
            cpu=args.cpu, mixed_precision=args.mixed_precision, log_with="all",
            project_dir=args.project_dir,
        )
    else:
        accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    set_seed(config["seed"])
    train_dataloader, eval_dataloader = get_dataloaders(accelerator, config["batch_size"])
    model = TinyClassifier().to(accelerator.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])
    lr_scheduler = linear_schedule(optimizer, 10, len(train_dataloader) * config["num_epochs"])
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    metric = Accuracy()

    if args.with_tracking:
        # The run is named after this file; every tracker records the configuration.
        run = os.path.splitext(os.path.basename(__file__))[0]
        accelerator.init_trackers(run, config)

    for epoch in range(config["num_epochs"]):
        model.train()
        total_loss = 0.0
        for batch in train_dataloader:
            outputs = model(**batch)
            total_loss += outputs.loss.detach().float()
            accelerator.backward(outputs.loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        model.eval()
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
            metric.add_batch(predictions=predictions, references=references)
        eval_metric = metric.compute()
        accelerator.print(f"epoch {epoch}:", eval_metric)
        if args.with_tracking:
            accelerator.log(
                {
                    "accuracy": eval_metric["accuracy"],
                    "f1": eval_metric["f1"],
                    "train_loss": total_loss.item() / len(train_dataloader),
                    "epoch": epoch,
                },
                step=epoch,
            )
    accelerator.end_training()  # flushes and closes the trackers


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mixed_precision", default=None, choices=["no", "fp16", "bf16"])
    parser.add_argument("--cpu", action="store_true", help="train on the CPU even with a GPU")
    parser.add_argument("--with_tracking", action="store_true")
    parser.add_argument("--project_dir", default="logs", help="where the trackers write")
    parser.add_argument("--num_epochs", type=int, default=3)
    args = parser.parse_args()
    config = {"lr": 1e-2, "num_epochs": args.num_epochs, "seed": 42, "batch_size": 16}
    training_function(config, args)


if __name__ == "__main__":
    main()
