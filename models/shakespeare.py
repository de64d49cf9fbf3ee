"""Character-level Shakespeare transformer (Karpathy, "Let's build GPT").

Source: Andrej Karpathy, "Let's build GPT: from scratch, in code, spelled
out" (nanoGPT lecture, ``gpt.py``).  Token + position embeddings, a
``blocks = nn.Sequential(*[Block(...)])`` stack where each Block is

    x = x + MultiHeadAttention(ln1(x))     # heads = nn.ModuleList of Head
    x = x + FeedForward(ln2(x))            # Linear(C, 4C) -> ReLU -> Linear -> Dropout

with causal masking through a registered ``tril`` buffer, then ``ln_f`` and
``lm_head``.  ``forward(idx)`` returns logits (B, T, vocab) (the lecture's
forward also took ``targets`` and returned the loss; here the loss lives in
``loss_fn``).

Vocabulary: the fixed 65-character set of tiny-shakespeare (``CHARS``), so
``vocab_size`` is known without reading data; unknown characters map to ' '.

Config keys: vocab_size (65), n_embd, n_head, n_layer, block_size, dropout,
seed, data_path.

Sizes:

* ``tiny``: n_embd 64, 4 heads, 4 layers, block_size 32, dropout 0
  (209,729 params).
* ``tutorial``: n_embd 384, 6 heads, 6 layers, block_size 256, dropout 0.2 --
  the lecture's final model (10,788,929 params).

Data: ``data_path`` (default ``data/shakespeare.txt`` next to this file, a
public-domain selection of sonnets and speeches).  ``train_batches`` yields
random (seeded) windows (B, block_size) with targets shifted by one.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

DEFAULT_DATA_PATH = Path(__file__).resolve().parent / "data" / "shakespeare.txt"
CHARS = "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
assert len(CHARS) == 65
STOI = {ch: i for i, ch in enumerate(CHARS)}
ITOS = {i: ch for i, ch in enumerate(CHARS)}


def encode(text: str) -> list[int]:
    space = STOI[" "]
    return [STOI.get(c, space) for c in text]


def decode(ids) -> str:
    return "".join(ITOS.get(int(i), " ") for i in ids)


class Head(nn.Module):
    """One head of causal self-attention."""

    def __init__(self, n_embd: int, head_size: int, block_size: int, dropout: float):
        super().__init__()
        self.key = nn.Linear(n_embd, head_size, bias=False)
        self.query = nn.Linear(n_embd, head_size, bias=False)
        self.value = nn.Linear(n_embd, head_size, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(block_size, block_size)))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        k = self.key(x)
        q = self.query(x)
        wei = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5
        # == self.tril[:T, :T]; torch.narrow so fx can trace the symbolic T
        tril = torch.narrow(torch.narrow(self.tril, 0, 0, T), 1, 0, T)
        wei = wei.masked_fill(tril == 0, float("-inf"))
        wei = F.softmax(wei, dim=-1)
        wei = self.dropout(wei)
        v = self.value(x)
        return wei @ v


class MultiHeadAttention(nn.Module):
    def __init__(self, n_embd: int, num_heads: int, head_size: int, block_size: int, dropout: float):
        super().__init__()
        self.heads = nn.ModuleList([Head(n_embd, head_size, block_size, dropout) for _ in range(num_heads)])
        self.proj = nn.Linear(head_size * num_heads, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.cat([h(x) for h in self.heads], dim=-1)
        return self.dropout(self.proj(out))


class FeedForward(nn.Module):
    def __init__(self, n_embd: int, dropout: float):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd),
            nn.ReLU(),
            nn.Linear(4 * n_embd, n_embd),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int, dropout: float):
        super().__init__()
        head_size = n_embd // n_head
        self.sa = MultiHeadAttention(n_embd, n_head, head_size, block_size, dropout)
        self.ffwd = FeedForward(n_embd, dropout)
        self.ln1 = nn.LayerNorm(n_embd)
        self.ln2 = nn.LayerNorm(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.sa(self.ln1(x))
        x = x + self.ffwd(self.ln2(x))
        return x


class GPTLanguageModel(nn.Module):
    def __init__(
        self,
        vocab_size: int = 65,
        n_embd: int = 384,
        n_head: int = 6,
        n_layer: int = 6,
        block_size: int = 256,
        dropout: float = 0.2,
    ):
        super().__init__()
        self.token_embedding_table = nn.Embedding(vocab_size, n_embd)
        self.position_embedding_table = nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(*[Block(n_embd, n_head, block_size, dropout) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        tok_emb = self.token_embedding_table(idx)  # (B, T, C)
        pos_emb = self.position_embedding_table(torch.arange(T, device=idx.device))
        x = tok_emb + pos_emb
        x = self.blocks(x)
        x = self.ln_f(x)
        return self.lm_head(x)  # (B, T, vocab)


SIZES: dict[str, dict] = {
    "tiny": dict(vocab_size=65, n_embd=64, n_head=4, n_layer=4, block_size=32, dropout=0.0),
    "tutorial": dict(vocab_size=65, n_embd=384, n_head=6, n_layer=6, block_size=256, dropout=0.2),
}


def build_model(
    vocab_size: int = 65,
    n_embd: int = 384,
    n_head: int = 6,
    n_layer: int = 6,
    block_size: int = 256,
    dropout: float = 0.2,
    **_ignored,
) -> nn.Module:
    return GPTLanguageModel(vocab_size, n_embd, n_head, n_layer, block_size, dropout)


def make_batch(batch_size: int, vocab_size: int = 65, block_size: int = 256, **_ignored) -> tuple[tuple, torch.Tensor]:
    x = torch.randint(0, vocab_size, (batch_size, block_size))
    y = torch.randint(0, vocab_size, (batch_size, block_size))
    return (x,), y


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    B, T, C = output.shape
    return F.cross_entropy(output.reshape(B * T, C), target.reshape(B * T))


@lru_cache(maxsize=8)
def _load(path: str, mtime: float) -> torch.Tensor:
    with open(path, encoding="utf-8", errors="replace") as f:
        return torch.tensor(encode(f.read()), dtype=torch.long)


def load_data(data_path: str | None = None) -> torch.Tensor:
    path = DEFAULT_DATA_PATH if data_path is None else Path(data_path)
    if not path.is_file():
        raise FileNotFoundError(f"shakespeare: data file not found: {path}")
    return _load(str(path), path.stat().st_mtime)


def train_batches(
    batch_size: int,
    block_size: int = 256,
    vocab_size: int = 65,
    data_path: str | None = None,
    seed: int = 0,
    **_ignored,
) -> Iterator[tuple[tuple, torch.Tensor]]:
    """Infinite stream of random windows (seeded by ``seed``), as in get_batch."""
    data = load_data(data_path)
    if vocab_size < len(CHARS):
        data = data.clamp(max=vocab_size - 1)
    if data.numel() <= block_size + 1:
        raise ValueError(
            f"shakespeare: data has {data.numel()} chars, need more than block_size + 1 = {block_size + 1}"
        )
    g = torch.Generator().manual_seed(int(seed))
    offs = torch.arange(block_size)
    while True:
        ix = torch.randint(data.numel() - block_size - 1, (batch_size,), generator=g)
        x = data[ix[:, None] + offs]
        y = data[ix[:, None] + offs + 1]
        yield (x,), y
