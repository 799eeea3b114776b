"""DDP communication hooks: compress the gradients DistributedDataParallel all-reduces (fp16,
bf16), or approximate them (PowerSGD), chosen with DistributedDataParallelKwargs.

    mpiexec -n 2 python ddp_comm_hook.py --ddp_comm_hook fp16
    mpiexec -n 2 python ddp_comm_hook.py --ddp_comm_hook power_sgd --ddp_comm_wrapper bf16

Accelerate's calls only: with `accelerate` in the mpaccel import lines it is an Accelerate
script.
"""

import argparse

import torch
from toy import Accuracy, TinyClassifier, get_dataloaders, linear_schedule, weights_digest

from mpaccel import Accelerator, DDPCommunicationHookType, DistributedDataParallelKwargs
from mpaccel.utils import set_seed


def training_function(config, args):
    ddp_kwargs = DistributedDataParallelKwargs(
        comm_hook=DDPCommunicationHookType(args.ddp_comm_hook),
        comm_wrapper=DDPCommunicationHookType(args.ddp_comm_wrapper),
    )
    accelerator = Accelerator(
        cpu=args.cpu, mixed_precision=args.mixed_precision, kwargs_handlers=[ddp_kwargs]
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
        for batch in train_dataloader:
            with accelerator.accumulate(model):
                outputs = model(**batch)
                accelerator.backward(outputs.loss)  # the hook runs in DDP's all-reduce here
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
        accelerator.print(f"epoch {epoch}:", metric.compute())

    # Every process applied the same (compressed) gradients: the models stay identical.
    digests = accelerator.gather(torch.tensor([weights_digest(model)], dtype=torch.float64))
    accelerator.print(f"models agree across processes: {bool((digests == digests[0]).all())}")
    accelerator.print(f"final weights digest: {weights_digest(model):.12f}")
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mixed_precision", default=None, choices=["no", "fp16", "bf16"])
    parser.add_argument("--cpu", action="store_true", help="train on the CPU even with a GPU")
    parser.add_argument("--ddp_comm_hook", default="no",
                        choices=["no", "fp16", "bf16", "power_sgd", "batched_power_sgd"])
    parser.add_argument("--ddp_comm_wrapper", default="no", choices=["no", "fp16", "bf16"])
    parser.add_argument("--num_epochs", type=int, default=3)
    args = parser.parse_args()
    config = {"lr": 1e-2, "num_epochs": args.num_epochs, "seed": 42, "batch_size": 16}
    training_function(config, args)


if __name__ == "__main__":
    main()
