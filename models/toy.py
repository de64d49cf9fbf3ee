"""Two-layer toy model of the PyTorch model-parallel tutorial.

Source: PyTorch tutorial "Single-Machine Model Parallel Best Practices"
(``intermediate/model_parallel_tutorial``) and the DDP tutorial's ``ToyModel``:
``net1 = nn.Linear(10, 10)``, ``relu = nn.ReLU()``, ``net2 = nn.Linear(10, 5)``,
trained with ``nn.MSELoss`` on random inputs/targets.

Config keys: in_features, hidden, out_features, seed.

Sizes:

* ``tiny``: the tutorial's 10 -> 10 -> 5 (165 params).
* ``wide``: 1024 -> 4096 -> 1024 (8,393,728 params).

Data: ``make_batch`` = randn inputs (B, in) and randn targets (B, out) as in
the tutorial.  ``train_batches`` = a learnable regression: targets from a
fixed random linear "teacher" (seeded from ``seed``) plus 0.1 noise.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F


class ToyModel(nn.Module):
    def __init__(self, in_features: int = 10, hidden: int = 10, out_features: int = 5):
        super().__init__()
        self.net1 = nn.Linear(in_features, hidden)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(hidden, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


SIZES: dict[str, dict] = {
    "tiny": dict(in_features=10, hidden=10, out_features=5),
    "wide": dict(in_features=1024, hidden=4096, out_features=1024),
}


def build_model(in_features: int = 10, hidden: int = 10, out_features: int = 5, **_ignored) -> nn.Module:
    return ToyModel(in_features, hidden, out_features)


def make_batch(batch_size: int, in_features: int = 10, out_features: int = 5, **_ignored) -> tuple[tuple, torch.Tensor]:
    x = torch.randn(batch_size, in_features)
    y = torch.randn(batch_size, out_features)
    return (x,), y


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)  # mean reduction


def train_batches(
    batch_size: int, in_features: int = 10, out_features: int = 5, seed: int = 0, **_ignored
) -> Iterator[tuple[tuple, torch.Tensor]]:
    """Infinite deterministic regression stream from a fixed linear teacher."""
    g = torch.Generator().manual_seed(int(seed))
    w = torch.randn(in_features, out_features, generator=g) / in_features**0.5
    b = torch.randn(out_features, generator=g)
    while True:
        x = torch.randn(batch_size, in_features, generator=g)
        y = x @ w + b + 0.1 * torch.randn(batch_size, out_features, generator=g)
        yield (x,), y
