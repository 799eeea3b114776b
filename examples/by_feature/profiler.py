"""Profiling with accelerator.profile(): torch.profiler around the training loop, configured
with ProfileKwargs; each process prints nothing but the main one's table, and with
--output_trace_dir each process writes its Chrome trace (profile_<rank>.json: open it in
https://ui.perfetto.dev or chrome://tracing).

    mpiexec -n 2 python profiler.py --record_shapes --output_trace_dir traces

Accelerate's calls only: with `accelerate` in the mpaccel import lines it is an Accelerate
script.
"""

import argparse

import torch
from toy import Accuracy, TinyClassifier, get_dataloaders, linear_schedule

from mpaccel import Accelerator, ProfileKwargs
from mpaccel.utils import set_seed


def training_function(config, args):
    profile_kwargs = ProfileKwargs(
        record_shapes=args.record_shapes,
        profile_memory=args.profile_memory,
        with_flops=args.with_flops,
        output_trace_dir=args.output_trace_dir,
    )
    accelerator = Accelerator(
        cpu=args.cpu, mixed_precision=args.mixed_precision, kwargs_handlers=[profile_kwargs]
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
        with accelerator.profile() as prof:
            for batch in train_dataloader:
                with accelerator.accumulate(model):
                    outputs = model(**batch)
                    accelerator.backward(outputs.loss)
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad()
        sort_by = "self_cpu_time_total" if accelerator.device.type == "cpu" else (
            f"self_{accelerator.device.type}_time_total")
        accelerator.print(prof.key_averages().table(sort_by=sort_by, row_limit=8))
        model.eval()
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
            metric.add_batch(predictions=predictions, references=references)
        accelerator.print(f"epoch {epoch}:", metric.compute())
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mixed_precision", default=None, choices=["no", "fp16", "bf16"])
    parser.add_argument("--cpu", action="store_true", help="train on the CPU even with a GPU")
    parser.add_argument("--record_shapes", action="store_true")
    parser.add_argument("--profile_memory", action="store_true")
    parser.add_argument("--with_flops", action="store_true")
    parser.add_argument("--output_trace_dir", default=None)
    parser.add_argument("--num_epochs", type=int, default=1)
    args = parser.parse_args()
    config = {"lr": 1e-2, "num_epochs": args.num_epochs, "seed": 42, "batch_size": 16}
    training_function(config, args)


if __name__ == "__main__":
    main()
