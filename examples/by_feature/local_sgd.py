"""LocalSGD: each process takes --local_sgd_steps optimizer steps on its own (no gradient
all-reduce), then the processes average their models; fewer, larger communications.

    mpiexec -n 2 python local_sgd.py --local_sgd_steps 8

At the end every process holds the same averaged model: the script gathers each one's
weights digest and says whether they agree. Accelerate's calls only: with `accelerate` in the
mpaccel import lines it is an Accelerate script.
"""

import argparse

import torch
from toy import Accuracy, TinyClassifier, get_dataloaders, linear_schedule, weights_digest

from mpaccel import Accelerator
from mpaccel.local_sgd import LocalSGD
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
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])
    lr_scheduler = linear_schedule(optimizer, 10, len(train_dataloader) * config["num_epochs"])
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    metric = Accuracy()

    for epoch in range(config["num_epochs"]):
        model.train()
        with LocalSGD(
            accelerator=accelerator,
            model=model,
            local_sgd_steps=args.local_sgd_steps,
            enabled=args.local_sgd_steps is not None,
        ) as local_sgd:
            for batch in train_dataloader:
                with accelerator.accumulate(model):
                    outputs = model(**batch)
                    accelerator.backward(outputs.loss)
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad()
                    local_sgd.step()  # averages the models every local_sgd_steps calls
        model.eval()
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
            metric.add_batch(predictions=predictions, references=references)
        accelerator.print(f"epoch {epoch}:", metric.compute())

    digests = accelerator.gather(torch.tensor([weights_digest(model)], dtype=torch.float64))
    accelerator.print(f"models agree across processes: {bool((digests == digests[0]).all())}")
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mixed_precision", default=None, choices=["no", "fp16", "bf16"])
    parser.add_argument("--cpu", action="store_true", help="train on the CPU even with a GPU")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--local_sgd_steps", type=int, default=8)
    parser.add_argument("--num_epochs", type=int, default=3)
    args = parser.parse_args()
    config = {"lr": 1e-2, "num_epochs": args.num_epochs, "seed": 42, "batch_size": 16}
    training_function(config, args)


if __name__ == "__main__":
    main()
