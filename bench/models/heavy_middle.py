"""Light layers around one heavy layer in the middle, with a skip connection over it: written for the cost bench.

Differs in shape from every model in ``models/``: the block costs are far from uniform (the middle
block costs as much as all the others together), and a skip connection from before the heavy layer
to after it means two tensors cross the cuts around it, so a split there sends more than one
activation.

Config keys: dim, n_light, heavy_expand, out_dim, seq_len, seed.

Sizes:

* ``tiny``: dim 128, 3 light layers either side, a 32x-wide middle (1.16 M parameters).
* ``bench``: dim 256, 6 light layers either side, a 48x-wide middle (7.13 M parameters).

Data: ``make_batch`` draws inputs (B, seq_len, dim) and regression targets (B, seq_len, out_dim);
``train_batches`` makes the targets a fixed random linear map of the inputs plus noise.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F


class Light(nn.Module):
    """One narrow layer: x + tanh(W norm(x))."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.proj(self.norm(x)))


class Heavy(nn.Module):
    """The expensive middle layer: a very wide feed-forward."""

    def __init__(self, dim: int, expand: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, expand * dim)
        self.down = nn.Linear(expand * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.up(x)))


class HeavyMiddle(nn.Module):
    def __init__(self, dim: int, n_light: int, heavy_expand: int, out_dim: int) -> None:
        super().__init__()
        self.before = nn.ModuleList(Light(dim) for _ in range(n_light))
        self.heavy = Heavy(dim, heavy_expand)
        self.after = nn.ModuleList(Light(dim) for _ in range(n_light))
        self.out = nn.Linear(dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.before:
            x = layer(x)
        skip = x
        x = self.heavy(x)
        x = x + skip
        for layer in self.after:
            x = layer(x)
        return self.out(x)


SIZES: dict[str, dict] = {
    "tiny": dict(dim=128, n_light=3, heavy_expand=32, out_dim=64, seq_len=16),
    "bench": dict(dim=256, n_light=6, heavy_expand=48, out_dim=128, seq_len=32),
}


def build_model(dim: int = 128, n_light: int = 3, heavy_expand: int = 32, out_dim: int = 64, **_ignored) -> nn.Module:
    return HeavyMiddle(dim, n_light, heavy_expand, out_dim)


def make_batch(batch_size: int, dim: int = 128, out_dim: int = 64, seq_len: int = 16, **_ignored):
    return (torch.randn(batch_size, seq_len, dim),), torch.randn(batch_size, seq_len, out_dim)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


def train_batches(
    batch_size: int, dim: int = 128, out_dim: int = 64, seq_len: int = 16, seed: int = 0, **_ignored
) -> Iterator[tuple[tuple, torch.Tensor]]:
    """Infinite stream of a learnable regression: a fixed random linear teacher plus 0.1 noise."""
    g = torch.Generator().manual_seed(int(seed))
    w = torch.randn(dim, out_dim, generator=g) / dim**0.5
    while True:
        x = torch.randn(batch_size, seq_len, dim, generator=g)
        yield (x,), x @ w + 0.1 * torch.randn(batch_size, seq_len, out_dim, generator=g)
