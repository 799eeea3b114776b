"""`accelerate.test_utils.training`: a noisy line y = a*x + b and a two-parameter model of it."""

from __future__ import annotations

import numpy as np
import torch


class RegressionDataset:
    """`length` samples {"x", "y"} of y = a*x + b + noise; seed=None draws fresh data."""

    def __init__(self, a: float = 2, b: float = 3, length: int = 64, seed: int | None = None):
        rng = np.random.default_rng(seed)
        self.length = length
        self.x = rng.normal(size=(length,)).astype(np.float32)
        noise = rng.normal(scale=0.1, size=(length,)).astype(np.float32)
        self.y = a * self.x + b + noise

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict[str, np.float32]:
        return {"x": self.x[i], "y": self.y[i]}


class RegressionModel(torch.nn.Module):
    """y = a*x + b with scalar parameters a and b."""

    def __init__(self, a: float = 0, b: float = 0, double_output: bool = False):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(float(a)))
        self.b = torch.nn.Parameter(torch.tensor(float(b)))
        self.first_batch = True

    def forward(self, x: torch.Tensor | None = None) -> torch.Tensor:
        self.first_batch = False
        return x * self.a + self.b
