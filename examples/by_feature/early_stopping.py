"""Early stopping across processes: a process that wants to stop calls set_trigger(), and
check_trigger() tells every process at the same step (it is True everywhere once any process
set it), so that they all leave the loop together and none waits in a collective for the
others.

    mpiexec -n 2 python early_stopping.py --patience 3

Here each process watches its own training loss and asks to stop when it has not improved
for --patience steps: the first process to lose patience stops them all. Accelerate's calls
only: with `accelerate` in the mpaccel import lines it is an Accelerate script.
"""

import argparse

import torch
from toy import Accuracy, TinyClassifier, get_dataloaders, linear_schedule

from mpaccel import Accelerator
from mpaccel.utils import set_seed


class EarlyStoppingCallback:
    """True once the loss has not dropped by min_delta below its lowest for `patience` calls."""

    def __init__(self, min_delta=0.0, patience=5):
        self.min_delta, self.patience = min_delta, patience
        self.lowest_loss, self.bad_calls = float("inf"), 0

    def check_early_stopping(self, loss):
        if self.lowest_loss - loss >= self.min_delta:
            self.lowest_loss, self.bad_calls = loss, 0
        else:
            self.bad_calls += 1
        return self.bad_calls >= self.patience


def training_function(config, args):
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
    callback = EarlyStoppingCallback(patience=args.patience)

    stopped = False
    for epoch in range(config["num_epochs"]):
        model.train()
        for step, batch in enumerate(train_dataloader):
            outputs = model(**batch)
            accelerator.backward(outputs.loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            if callback.check_early_stopping(outputs.loss.item()):
                accelerator.set_trigger()  # this process wants to stop
            if accelerator.check_trigger():  # collective: True on every process, or on none
                print(f"process {accelerator.process_index} stops at epoch {epoch} step {step}")
                stopped = True
                break
        model.eval()
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
            metric.add_batch(predictions=predictions, references=references)
        accelerator.print(f"epoch {epoch}:", metric.compute())
        if stopped:
            break
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mixed_precision", default=None, choices=["no", "fp16", "bf16"])
    parser.add_argument("--cpu", action="store_true", help="train on the CPU even with a GPU")
    parser.add_argument("--patience", type=int, default=5, help="steps without improvement")
    parser.add_argument("--num_epochs", type=int, default=10)
    args = parser.parse_args()
    config = {"lr": 1e-2, "num_epochs": args.num_epochs, "seed": 42, "batch_size": 16}
    training_function(config, args)


if __name__ == "__main__":
    main()
