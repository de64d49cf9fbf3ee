"""A stack of wide residual MLP blocks with a large classification head: written for the cost bench.

Differs in shape from every model in ``models/``: no attention, no embedding (float features
in), every block the same wide feed-forward (4x expansion), and a head whose output layer holds
as many parameters as several blocks, so the last stage is heavy in parameters, optimizer step and
loss but light in saved activations.

Config keys: dim, n_blocks, expand, n_classes, seq_len, seed.

Sizes:

* ``tiny``: dim 128, 8 blocks, 4,000 classes (1.6 M parameters).
* ``bench``: dim 512, 16 blocks, 16,000 classes (41.8 M parameters), the shape of issue 11's MLP case.

Data: ``make_batch`` draws features (B, seq_len, dim) and class ids (B, seq_len);
``train_batches`` labels each position by a fixed random projection of its features, so the task
is learnable.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    """Pre-norm residual MLP: x + W2 gelu(W1 norm(x))."""

    def __init__(self, dim: int, expand: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, expand * dim)
        self.down = nn.Linear(expand * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class MLPStack(nn.Module):
    def __init__(self, dim: int, n_blocks: int, expand: int, n_classes: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, expand) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


SIZES: dict[str, dict] = {
    "tiny": dict(dim=128, n_blocks=8, expand=4, n_classes=4000, seq_len=8),
    "bench": dict(dim=512, n_blocks=16, expand=4, n_classes=16000, seq_len=8),
}


def build_model(dim: int = 128, n_blocks: int = 8, expand: int = 4, n_classes: int = 4000, **_ignored) -> nn.Module:
    return MLPStack(dim, n_blocks, expand, n_classes)


def make_batch(batch_size: int, dim: int = 128, n_classes: int = 4000, seq_len: int = 8, **_ignored):
    x = torch.randn(batch_size, seq_len, dim)
    y = torch.randint(0, n_classes, (batch_size, seq_len))
    return (x,), y


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, 1), target.flatten())


def train_batches(
    batch_size: int, dim: int = 128, n_classes: int = 4000, seq_len: int = 8, seed: int = 0, **_ignored
) -> Iterator[tuple[tuple, torch.Tensor]]:
    """Infinite stream: the label of a position is the argmax of a fixed random projection of it."""
    g = torch.Generator().manual_seed(int(seed))
    teacher = torch.randn(dim, n_classes, generator=g)
    while True:
        x = torch.randn(batch_size, seq_len, dim, generator=g)
        yield (x,), (x @ teacher).argmax(-1)
