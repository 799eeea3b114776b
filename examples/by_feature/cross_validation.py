"""Cross validation: train one model per fold of the training set (stratified k-fold), check
each on its held-out fold, and average the folds' predictions on the test set; between folds
accelerator.free_memory() lets go of the previous fold's prepared objects.

    mpiexec -n 2 python cross_validation.py --num_folds 3

Accelerate's calls only: with `accelerate` in the mpaccel import lines it is an Accelerate
script.
"""

import argparse

import torch
from torch.utils.data import DataLoader, Subset
from toy import EVAL_BATCH_SIZE, Accuracy, TinyClassifier, get_datasets, linear_schedule

from mpaccel import Accelerator
from mpaccel.utils import set_seed


def stratified_folds(labels, num_folds):
    """(train indices, held-out indices) of each fold; each class is dealt out evenly."""
    fold_of = torch.empty(len(labels), dtype=torch.long)
    for label in labels.unique():
        where = (labels == label).nonzero().flatten()
        fold_of[where] = torch.arange(len(where)) % num_folds
    everything = torch.arange(len(labels))
    return [(everything[fold_of != k].tolist(), everything[fold_of == k].tolist())
            for k in range(num_folds)]


def get_fold_dataloaders(accelerator, train_set, test_set, train_idxs, valid_idxs, batch_size):
    with accelerator.main_process_first():
        train, valid = Subset(train_set, train_idxs), Subset(train_set, valid_idxs)
    return (
        DataLoader(train, shuffle=True, batch_size=batch_size),
        DataLoader(valid, shuffle=False, batch_size=EVAL_BATCH_SIZE),
        DataLoader(test_set, shuffle=False, batch_size=EVAL_BATCH_SIZE),
    )


def training_function(config, args):
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    set_seed(config["seed"])
    train_set, test_set = get_datasets()
    metric = Accuracy()
    test_predictions, test_references = [], []

    folds = stratified_folds(train_set.labels, args.num_folds)
    for fold, (train_idxs, valid_idxs) in enumerate(folds):
        train_dataloader, eval_dataloader, test_dataloader = get_fold_dataloaders(
            accelerator, train_set, test_set, train_idxs, valid_idxs, config["batch_size"]
        )
        model = TinyClassifier().to(accelerator.device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])
        lr_scheduler = linear_schedule(optimizer, 10, len(train_dataloader) * config["num_epochs"])
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
            model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
        )
        test_dataloader = accelerator.prepare(test_dataloader)
        for epoch in range(config["num_epochs"]):
            model.train()
            for batch in train_dataloader:
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
            accelerator.print(f"fold {fold} epoch {epoch}:", metric.compute())

        # This fold's model on the test set: its probabilities, every test sample once.
        fold_predictions = []
        for batch in test_dataloader:
            with torch.no_grad():
                outputs = model(**batch)
            probabilities, references = accelerator.gather_for_metrics(
                (outputs.logits.softmax(dim=-1), batch["labels"])
            )
            fold_predictions.append(probabilities.cpu())
            if fold == 0:
                test_references.append(references.cpu())
        test_predictions.append(torch.cat(fold_predictions))
        model, optimizer = accelerator.free_memory(model, optimizer)

    # The folds vote: their probabilities averaged.
    averaged = torch.stack(test_predictions).mean(dim=0)
    metric.add_batch(predictions=averaged.argmax(dim=-1), references=torch.cat(test_references))
    accelerator.print(f"{args.num_folds} folds averaged, on the test set:", metric.compute())
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mixed_precision", default=None, choices=["no", "fp16", "bf16"])
    parser.add_argument("--cpu", action="store_true", help="train on the CPU even with a GPU")
    parser.add_argument("--num_folds", type=int, default=3)
    parser.add_argument("--num_epochs", type=int, default=2)
    args = parser.parse_args()
    config = {"lr": 1e-2, "num_epochs": args.num_epochs, "seed": 42, "batch_size": 16}
    training_function(config, args)


if __name__ == "__main__":
    main()
