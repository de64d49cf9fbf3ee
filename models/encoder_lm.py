"""Encoder-stack language model of the PyTorch "Pipe" tutorial.

Source: PyTorch tutorial "Training Transformer models using Pipeline
Parallelism" (``intermediate/pipeline_tutorial``, torch.distributed.pipeline
.sync.Pipe, now removed from PyTorch).  The tutorial builds

    module_list = [Encoder(ntokens, emsize, dropout),
                   *[nn.TransformerEncoderLayer(emsize, nhead, nhid, dropout)
                     for _ in range(nlayers)],
                   Decoder(ntokens, emsize)]
    model = nn.Sequential(*module_list)

with ``Encoder`` = ``nn.Embedding`` scaled by ``sqrt(emsize)`` followed by a
sin/cos ``PositionalEncoding`` (buffer + dropout) and ``Decoder`` =
``nn.Linear(emsize, ntokens)``.  This file builds exactly that
``nn.Sequential`` (children ``0`` = Encoder, ``1..nlayers`` = encoder layers,
``nlayers+1`` = Decoder).

Deviations from the tutorial:

* Layers use ``batch_first=True`` and the model takes/returns batch-first
  tensors (the tutorial was seq-first and transposed inside Encoder/Decoder).
* The tutorial's causal ``src_mask`` is omitted so the ``nn.Sequential`` stays
  single-input.  Consequently every position can attend to the whole window
  (including the next token), so language-model loss on ``train_batches`` can
  fall far below what a causal model would reach; for planning/benchmarking
  purposes the compute is the same.

Data: torchtext is not used.  A plain-Python ``basic_english`` tokenizer (same
normalisation rules as torchtext's) and a frequency vocabulary (``<unk>`` = 0,
then the ``ntokens - 1`` most frequent words) are built from ``data_path``
(default: ``data/shakespeare.txt`` next to this file; the tutorial used
WikiText-2).  ``train_batches`` batchifies the token stream like the tutorial
(``batch_size`` parallel columns) and yields consecutive ``seq_len`` (bptt)
windows, inputs and targets shifted by one, cycling forever.

Config keys: ntokens, emsize, nhid, nlayers, nhead, dropout, seq_len, seed,
data_path.

Sizes:

* ``tiny``: ntokens 1000, emsize 64, nhid 128, 4 layers, 4 heads, seq_len 32,
  dropout 0 (262,888 params).
* ``tutorial`` / ``paper``: ntokens 28782 (WikiText-2 vocab), emsize 4096,
  nhid 4096, 12 layers, 16 heads, dropout 0.2, seq_len 35 -- the tutorial's
  ~1.4 B-parameter model (1,444,261,998 params).  Build it on the meta device.
* ``bigvocab``: ntokens 32000, emsize 256, nhid 512, 8 layers, 4 heads,
  seq_len 64, dropout 0 (20,632,832 params) -- CPU-runnable; the output
  layer dominates compute (fwd+bwd of batch 4 ~0.4 s on one core).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

DEFAULT_DATA_PATH = Path(__file__).resolve().parent / "data" / "shakespeare.txt"


# --------------------------------------------------------------------------
# model (as in the tutorial)
# --------------------------------------------------------------------------
class PositionalEncoding(nn.Module):
    def __init__(self, d_model: int, dropout: float = 0.1, max_len: int = 5000):
        super().__init__()
        self.dropout = nn.Dropout(p=dropout)
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len, dtype=torch.float).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe.unsqueeze(0))  # (1, max_len, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, S, D)
        # torch.narrow (not slicing) so fx can trace a symbolic length
        x = x + torch.narrow(self.pe, 1, 0, x.size(1))
        return self.dropout(x)


class Encoder(nn.Module):
    def __init__(self, ntoken: int, ninp: int, dropout: float = 0.5, max_len: int = 5000):
        super().__init__()
        self.pos_encoder = PositionalEncoding(ninp, dropout, max_len)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.ninp = ninp
        self.init_weights()

    def init_weights(self) -> None:
        initrange = 0.1
        nn.init.uniform_(self.encoder.weight, -initrange, initrange)

    def forward(self, src: torch.Tensor) -> torch.Tensor:  # src: (B, S)
        src = self.encoder(src) * math.sqrt(self.ninp)
        return self.pos_encoder(src)


class Decoder(nn.Module):
    def __init__(self, ntoken: int, ninp: int):
        super().__init__()
        self.decoder = nn.Linear(ninp, ntoken)
        self.init_weights()

    def init_weights(self) -> None:
        initrange = 0.1
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:  # (B, S, D) -> (B, S, V)
        return self.decoder(inp)


SIZES: dict[str, dict] = {
    "tiny": dict(ntokens=1000, emsize=64, nhid=128, nlayers=4, nhead=4, dropout=0.0, seq_len=32),
    "tutorial": dict(ntokens=28782, emsize=4096, nhid=4096, nlayers=12, nhead=16, dropout=0.2, seq_len=35),
    "bigvocab": dict(ntokens=32000, emsize=256, nhid=512, nlayers=8, nhead=4, dropout=0.0, seq_len=64),
}
SIZES["paper"] = dict(SIZES["tutorial"])


def build_model(
    ntokens: int = 28782,
    emsize: int = 4096,
    nhid: int = 4096,
    nlayers: int = 12,
    nhead: int = 16,
    dropout: float = 0.2,
    seq_len: int = 35,
    **_ignored,
) -> nn.Module:
    max_len = max(5000, int(seq_len))
    module_list: list[nn.Module] = [Encoder(ntokens, emsize, dropout, max_len)]
    for _ in range(nlayers):
        module_list.append(nn.TransformerEncoderLayer(emsize, nhead, nhid, dropout, batch_first=True))
    module_list.append(Decoder(ntokens, emsize))
    return nn.Sequential(*module_list)


def make_batch(batch_size: int, ntokens: int = 28782, seq_len: int = 35, **_ignored) -> tuple[tuple, torch.Tensor]:
    x = torch.randint(0, ntokens, (batch_size, seq_len))
    y = torch.randint(0, ntokens, (batch_size, seq_len))
    return (x,), y


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


# --------------------------------------------------------------------------
# data: torchtext-free basic_english tokenizer + vocab
# --------------------------------------------------------------------------
_PATTERNS = [r"\'", r"\"", r"\.", r"<br \/>", r",", r"\(", r"\)", r"\!", r"\?", r"\;", r"\:", r"\s+"]
_REPLACEMENTS = [" '  ", "", " . ", " ", " , ", " ( ", " ) ", " ! ", " ? ", " ", " ", " "]
_PATTERNS_DICT = [(re.compile(p), r) for p, r in zip(_PATTERNS, _REPLACEMENTS)]


def basic_english(line: str) -> list[str]:
    """Same normalisation as ``torchtext.data.get_tokenizer("basic_english")``."""
    line = line.lower()
    for pattern_re, replaced_str in _PATTERNS_DICT:
        line = pattern_re.sub(replaced_str, line)
    return line.split()


def build_vocab(tokens: list[str], max_size: int) -> dict[str, int]:
    """``<unk>`` = 0, then the ``max_size - 1`` most frequent tokens
    (ties broken by first occurrence, so the result is deterministic)."""
    counts = Counter(tokens)
    ordered = sorted(counts.items(), key=lambda kv: -kv[1])  # stable sort
    vocab = {"<unk>": 0}
    for word, _ in ordered[: max(0, max_size - 1)]:
        if word not in vocab:
            vocab[word] = len(vocab)
    return vocab


def _resolve(data_path: str | None) -> Path:
    path = DEFAULT_DATA_PATH if data_path is None else Path(data_path)
    if not path.is_file():
        raise FileNotFoundError(f"encoder_lm: data file not found: {path}")
    return path


@lru_cache(maxsize=8)
def _load_ids(path: str, ntokens: int, mtime: float) -> torch.Tensor:
    with open(path, encoding="utf-8", errors="replace") as f:
        tokens = [t for line in f for t in basic_english(line)]
    vocab = build_vocab(tokens, ntokens)
    return torch.tensor([vocab.get(t, 0) for t in tokens], dtype=torch.long)


def load_token_ids(data_path: str | None = None, ntokens: int = 28782) -> torch.Tensor:
    path = _resolve(data_path)
    return _load_ids(str(path), int(ntokens), path.stat().st_mtime)


def train_batches(
    batch_size: int, ntokens: int = 28782, seq_len: int = 35, data_path: str | None = None, seed: int = 0, **_ignored
) -> Iterator[tuple[tuple, torch.Tensor]]:
    """Tutorial-style batchify + bptt windows over ``data_path``, forever.

    ``seed`` rotates the start offset of the stream (seed 0 = tutorial order).
    """
    ids = load_token_ids(data_path, ntokens)
    ncol = ids.numel() // batch_size
    if ncol < seq_len + 1:
        raise ValueError(
            f"encoder_lm: data too small for batch {batch_size} x seq_len {seq_len} ({ids.numel()} tokens)"
        )
    data = ids[: ncol * batch_size].view(batch_size, ncol)
    starts = list(range(0, ncol - seq_len, seq_len))
    shift = int(seed) % len(starts)
    starts = starts[shift:] + starts[:shift]
    while True:
        for i in starts:
            x = data[:, i : i + seq_len].clone()
            y = data[:, i + 1 : i + 1 + seq_len].clone()
            yield (x,), y
