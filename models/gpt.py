"""GPT-style decoder from the ``torch.distributed.pipelining`` tutorial.

Source: PyTorch tutorial "Introduction to Distributed Pipeline Parallelism"
(https://pytorch.org/tutorials/intermediate/pipelining_tutorial.html).  The
tutorial defines a ``ModelArgs`` dataclass (dim, n_layers, n_heads,
vocab_size) and a ``Transformer`` made of

* ``tok_embeddings``: ``nn.Embedding(vocab_size, dim)``
* ``layers``: ``nn.ModuleDict`` of ``nn.TransformerDecoderLayer(dim, n_heads)``,
  each called as ``h = layer(h, h)`` (self-attention + "cross"-attention on
  itself, no causal mask -- exactly as in the tutorial)
* ``norm``: ``nn.LayerNorm(dim)``
* ``output``: ``nn.Linear(dim, vocab_size)``; forward returns float logits.

Deviations from the tutorial (both deliberate):

* The decoder layers are built with ``batch_first=True``.  The tutorial feeds
  ``(batch, seq)`` tokens into seq-first layers, which makes attention mix the
  *batch* dimension; that would make microbatch losses differ from the
  full-batch loss, which the planner relies on.  Parameter count is identical.
* ``ffn_dim`` (``dim_feedforward``) is a config key.  The tutorial uses the
  PyTorch default 2048 (kept for ``tutorial``); ``tiny`` uses 4 * dim.

Config keys: dim, n_layers, n_heads, vocab_size, seq_len, dropout, ffn_dim,
seed.

Sizes:

* ``tiny``: dim 64, 4 layers, 4 heads, vocab 512, seq_len 32, ffn 256,
  dropout 0.0 (333,184 params).
* ``tutorial``: dim 512, 8 layers, 8 heads, vocab 10000, seq_len 500,
  ffn 2048, dropout 0.1 (as in the tutorial; 43,883,280 params).

Tensor parallelism: ``tp_plan`` splits each layer's feed-forward (linear1 by columns, linear2 by
rows); the packed attention stays whole.

Data: ``make_batch`` gives uniformly random tokens and targets (the tutorial
does the same).  ``train_batches`` yields a learnable synthetic stream: token
sequences from a fixed random "successor" rule (with probability 0.9 the next
token is ``perm[token]``, otherwise uniform), targets = the next token.
"""

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelArgs:
    dim: int = 512
    n_layers: int = 8
    n_heads: int = 8
    vocab_size: int = 10000
    dropout: float = 0.1
    ffn_dim: int = 2048


class Transformer(nn.Module):
    def __init__(self, model_args: ModelArgs):
        super().__init__()
        self.tok_embeddings = nn.Embedding(model_args.vocab_size, model_args.dim)
        # ModuleDict so that deleting layers (as the tutorial does when
        # splitting into stages) keeps FQNs stable.
        self.layers = nn.ModuleDict()
        for layer_id in range(model_args.n_layers):
            self.layers[str(layer_id)] = nn.TransformerDecoderLayer(
                model_args.dim,
                model_args.n_heads,
                dim_feedforward=model_args.ffn_dim,
                dropout=model_args.dropout,
                batch_first=True,
            )
        self.norm = nn.LayerNorm(model_args.dim)
        self.output = nn.Linear(model_args.dim, model_args.vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, h)
        h = self.norm(h)
        return self.output(h).float()


SIZES: dict[str, dict] = {
    "tiny": dict(dim=64, n_layers=4, n_heads=4, vocab_size=512, seq_len=32, ffn_dim=256, dropout=0.0),
    "tutorial": dict(dim=512, n_layers=8, n_heads=8, vocab_size=10000, seq_len=500, ffn_dim=2048, dropout=0.1),
}

# Tensor parallelism: the feed-forward of every decoder layer only (linear1 split by output columns,
# linear2 by input rows: one all-reduce forward, one backward). nn.MultiheadAttention packs q, k, v in
# one in_proj_weight and reshapes with its own num_heads, so torch's ColwiseParallel cannot split it;
# the attention stays whole on every tensor-parallel rank. Keys: module-name patterns ('*' matches
# one name part); values: torch's ColwiseParallel / RowwiseParallel.
tp_plan: dict[str, str] = {
    "layers.*.linear1": "colwise",
    "layers.*.linear2": "rowwise",
}


def build_model(
    dim: int = 512,
    n_layers: int = 8,
    n_heads: int = 8,
    vocab_size: int = 10000,
    dropout: float = 0.1,
    ffn_dim: int = 2048,
    **_ignored,
) -> nn.Module:
    return Transformer(
        ModelArgs(dim=dim, n_layers=n_layers, n_heads=n_heads, vocab_size=vocab_size, dropout=dropout, ffn_dim=ffn_dim)
    )


def make_batch(batch_size: int, vocab_size: int = 10000, seq_len: int = 500, **_ignored) -> tuple[tuple, torch.Tensor]:
    x = torch.randint(0, vocab_size, (batch_size, seq_len))
    y = torch.randint(0, vocab_size, (batch_size, seq_len))
    return (x,), y


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def train_batches(
    batch_size: int, vocab_size: int = 10000, seq_len: int = 500, seed: int = 0, **_ignored
) -> Iterator[tuple[tuple, torch.Tensor]]:
    """Infinite deterministic stream from a fixed random successor rule."""
    g = torch.Generator().manual_seed(int(seed))
    perm = torch.randperm(vocab_size, generator=g)
    while True:
        seq = torch.empty(batch_size, seq_len + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(0, vocab_size, (batch_size,), generator=g)
        follow = torch.rand(batch_size, seq_len, generator=g) < 0.9
        noise = torch.randint(0, vocab_size, (batch_size, seq_len), generator=g)
        for t in range(seq_len):
            seq[:, t + 1] = torch.where(follow[:, t], perm[seq[:, t]], noise[:, t])
        yield (seq[:, :-1].contiguous(),), seq[:, 1:].contiguous()
