"""The small stand-ins the by_feature examples share, in place of Accelerate's MRPC + BERT: a
generated sentence-pair-like classification task, a tiny model with a transformers-style
output, a linear learning-rate schedule and an accuracy/F1 metric. No downloads, no
transformers/datasets/evaluate: every example runs on a laptop CPU in seconds."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.utils.data import DataLoader, Dataset

FEATURES = 16
TRAIN_SAMPLES = 512
EVAL_SAMPLES = 203  # odd on purpose: the last batch is short and shards are uneven
EVAL_BATCH_SIZE = 32


class PairDataset(Dataset):
    """`length` samples {"x": 16 features, "labels": 0 or 1}; the label is a noisy, non-linear
    function of the features, drawn from `seed` (the same data on every process)."""

    def __init__(self, length: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(length, FEATURES, generator=g)
        direction = torch.randn(FEATURES, generator=torch.Generator().manual_seed(0))
        score = torch.tanh(self.x @ direction) + 0.3 * torch.randn(length, generator=g)
        self.labels = (score > 0).long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.labels[i]}


def get_datasets() -> tuple[PairDataset, PairDataset]:
    return PairDataset(TRAIN_SAMPLES, seed=1), PairDataset(EVAL_SAMPLES, seed=2)


def get_dataloaders(accelerator, batch_size: int = 16) -> tuple[DataLoader, DataLoader]:
    """Train (shuffled) and evaluation loaders, as Accelerate's examples build them for MRPC."""
    # Accelerate's examples tokenize under main_process_first (the main process fills the
    # cache, the others read it); generating is cheap, but the call is the same.
    with accelerator.main_process_first():
        train, evaluation = get_datasets()
    return (
        DataLoader(train, shuffle=True, batch_size=batch_size),
        DataLoader(evaluation, shuffle=False, batch_size=EVAL_BATCH_SIZE),
    )


class Output(NamedTuple):
    loss: torch.Tensor
    logits: torch.Tensor


class TinyClassifier(torch.nn.Module):
    """Two layers; `model(**batch)` returns `.loss` and `.logits`, as a transformers model."""

    def __init__(self, hidden: int = 32):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2)
        )

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> Output:
        logits = self.net(x)
        return Output(torch.nn.functional.cross_entropy(logits, labels), logits)


def linear_schedule(optimizer, num_warmup_steps: int, num_training_steps: int):
    """transformers' get_linear_schedule_with_warmup, in torch: up, then down to 0."""

    def factor(step: int) -> float:
        if step < num_warmup_steps:
            return (step + 1) / (num_warmup_steps + 1)
        left = num_training_steps - step
        return max(0.0, left / max(1, num_training_steps - num_warmup_steps))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class Accuracy:
    """evaluate's GLUE/MRPC metric, in short: add_batch() as predictions come, then compute()."""

    def __init__(self):
        self.predictions: list[torch.Tensor] = []
        self.references: list[torch.Tensor] = []

    def add_batch(self, predictions: torch.Tensor, references: torch.Tensor) -> None:
        self.predictions.append(predictions.cpu())
        self.references.append(references.cpu())

    def compute(self) -> dict[str, float]:
        p, r = torch.cat(self.predictions), torch.cat(self.references)
        self.predictions, self.references = [], []
        true_pos = int(((p == 1) & (r == 1)).sum())
        f1 = 2 * true_pos / max(1, int((p == 1).sum()) + int((r == 1).sum()))
        return {"accuracy": round(float((p == r).float().mean()), 6), "f1": round(f1, 6),
                "samples": len(r)}


def pretend_the_batch_fits(batch_size: int, capacity: int | None) -> None:
    """Raise the error torch's CPU allocator raises when memory runs out, for a batch larger
    than `capacity` samples: what a GPU does when the batch is too large, shown on a CPU."""
    if capacity is not None and batch_size > capacity:
        raise RuntimeError(
            "DefaultCPUAllocator: can't allocate memory: "
            f"a batch of {batch_size} samples needs more than this device has"
        )


def weights_digest(model: torch.nn.Module) -> float:
    """One number summing the parameters (float64): equal digests, equal models (in practice)."""
    return float(sum(p.detach().double().sum() * (i + 1) for i, p in enumerate(model.parameters())))
