"""What Accelerate's test scripts import from `accelerate.test_utils`, written for mpaccel."""

from .testing import are_the_same_tensors, assert_exception, torch_device
from .training import RegressionDataset, RegressionModel

__all__ = [
    "RegressionDataset",
    "RegressionModel",
    "are_the_same_tensors",
    "assert_exception",
    "torch_device",
]
