"""Llama-3-style decoder (Meta's reference ``llama3/model.py``, training form).

Source: Meta's reference implementation (https://github.com/meta-llama/llama3, ``llama/model.py``)
and the Llama 3 paper (Dubey et al. 2024, Table 3).  The model is

* ``tok_embeddings``: ``nn.Embedding(vocab_size, dim)``
* ``layers``: ``nn.ModuleList`` of ``TransformerBlock``; each block is
  ``h = x + attention(attention_norm(x))``, ``out = h + feed_forward(ffn_norm(h))`` with

  - ``RMSNorm`` (computed in fp32, cast back, times a learned weight; eps 1e-5 as in Llama 3),
  - ``Attention``: ``wq`` (dim -> n_heads * head_dim), ``wk``/``wv`` (dim -> n_kv_heads * head_dim:
    grouped-query attention, n_kv_heads < n_heads), rotary position embeddings on q and k, causal
    ``F.scaled_dot_product_attention(..., is_causal=True, enable_gqa=True)``, ``wo``; no biases,
  - ``FeedForward`` (SwiGLU): ``w2(silu(w1(x)) * w3(x))`` with hidden size
    ``multiple_of * ceil(int(ffn_dim_multiplier * int(2 * 4 * dim / 3)) / multiple_of)``
    (14336 for 8B, 28672 for 70B), no biases,
* ``norm``: ``RMSNorm(dim)``
* ``output``: ``nn.Linear(dim, vocab_size, bias=False)`` (untied); forward returns fp32 logits.

Deviations from the reference (deliberate, none changes a parameter or the maths):

* Training form: no KV cache and no ``start_pos``; the mask is ``is_causal=True`` inside SDPA.
* Rotary embeddings use precomputed real ``cos``/``sin`` buffers (seq_len x head_dim / 2, fp32,
  non-persistent) instead of ``torch.polar`` complex numbers; the rotation of the (even, odd)
  pairs is the same as the reference's complex product.  The tables are sliced with
  ``torch.narrow`` so that ``torch.fx.symbolic_trace`` can follow them (fx records buffers as
  ``get_attr`` nodes; Python slicing with a traced length fails).  Every ``Attention`` holds its
  own reference to one shared table (no copy while on one device), so each pipeline stage owns
  what it reads and only the hidden state crosses a cut.
* GQA uses SDPA's ``enable_gqa=True`` instead of ``repeat_kv`` (no materialised copies of k, v).

``attention_code="reference"`` (``--set attention_code=reference``) takes back the last two: the
rotation as the reference's complex product (``view_as_complex(x.float()) * freqs_cis``) and k, v
copied to every query head (``repeat_kv``) before SDPA, as Meta's reference and torchtitan's Llama
(pytorch/torchtitan ``torchtitan/models/llama/model.py`` at 9dec370, Dec 2024) run them. The same
maths and parameters (tests/test_llama.py checks the two codes agree); its kernels differ: the complex
product runs three elementwise kernels where the real rotation runs nine, the copies of k and v are more
memory traffic, and context parallelism gathers the repeated keys and values. It is there so that a
plan of a run of that code charges what that code does (docs/published_runs.md's torchtitan rows).

Config keys: dim, n_layers, n_heads, n_kv_heads, vocab_size, ffn_dim_multiplier, multiple_of,
rope_theta, seq_len, seed, attention_code ("planner", the default, or "reference") (norm_eps is
accepted too, default 1e-5).

Sizes:

* ``tiny``: dim 64, 4 layers, 4 heads, 2 kv heads, vocab 512, seq_len 32 (trains on a CPU in
  seconds).
* ``8b``: Llama 3 8B (dim 4096, 32 layers, 32 heads, 8 kv heads, vocab 128256, ffn multiplier
  1.3, multiple_of 1024, rope_theta 500000, seq_len 8192): 8,030,261,248 parameters.
* ``70b``: Llama 3 70B (dim 8192, 80 layers, 64 heads, 8 kv heads, vocab 128256, ffn multiplier
  1.3, multiple_of 4096, rope_theta 500000, seq_len 8192): 70,553,706,496 parameters.
* ``405b``: Llama 3.1 405B (dim 16384, 126 layers, 128 heads, 8 kv heads, vocab 128256, ffn
  multiplier 1.2, multiple_of 4096 (FFN 53248), rope_theta 500000, seq_len 8192).

Tensor parallelism: ``tp_plan`` shards q, k, v, w1, w3 by columns and wo, w2 by rows (Megatron's
split), the output head by vocabulary rows with its logits all-gathered and the input embedding by
its width with its lookups all-gathered (both ``colwise_rep``); the
attention reshapes to ``-1`` heads so a rank runs its n_heads / tp heads. The degree must divide
n_kv_heads (8 for the published sizes).

Build the large sizes on the meta device (``with torch.device("meta"): build_model(**SIZES["70b"])``)
to plan them without allocating weights.

Data: ``make_batch`` gives uniformly random tokens and their next-token targets (the inputs shifted
by one).  ``train_batches`` yields a learnable synthetic stream: token sequences from a fixed random
"successor" rule (with probability 0.9 the next token is ``perm[token]``, otherwise uniform),
targets = the next token (as ``models/gpt.py``).
"""

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = 128256
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    seq_len: int = 8192
    attention_code: str = "planner"  # or "reference": Meta's / torchtitan's complex RoPE and repeat_kv


ATTENTION_CODES = ("planner", "reference")


def ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """SwiGLU hidden size, exactly as Meta's ``FeedForward.__init__`` (hidden_dim = 4 * dim first)."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, (seq_len, head_dim // 2) fp32 (reference ``precompute_freqs_cis``)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), freqs)
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the (even, odd) pairs of the last dimension of x (b, s, heads, head_dim) by the angles.

    Same as the reference's ``view_as_complex(x) * freqs_cis``: (x0 + i x1)(cos + i sin).
    Shapes are read with ``size()`` and indices are constants so that fx can trace it.
    """
    b, s, h, d = x.size(0), x.size(1), x.size(2), x.size(3)
    pairs = x.float().reshape(b, s, h, d // 2, 2)
    x0 = pairs[..., 0]
    x1 = pairs[..., 1]
    cos = cos.reshape(1, s, 1, d // 2)
    sin = sin.reshape(1, s, 1, d // 2)
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(3).type_as(x)


def apply_rope_complex(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rope`` as the reference writes it: the (even, odd) pairs of x as complex numbers times
    ``cos + i sin`` (its ``freqs_cis``), one complex product (``attention_code="reference"``)."""
    b, s, h, d = x.size(0), x.size(1), x.size(2), x.size(3)
    pairs = torch.view_as_complex(x.float().reshape(b, s, h, d // 2, 2))
    # the tables may have been cast with the model (bf16), which torch.complex does not take
    freqs_cis = torch.complex(cos.float(), sin.float()).reshape(1, s, 1, d // 2)
    return torch.view_as_real(pairs * freqs_cis).flatten(3).type_as(x)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """x (b, s, kv heads, head_dim) with each head copied ``n_rep`` times in a row (the reference's
    ``repeat_kv``: the copies are materialised)."""
    b, s, h, d = x.size(0), x.size(1), x.size(2), x.size(3)
    return x[:, :, :, None, :].expand(b, s, h, n_rep, d).reshape(b, s, h * n_rep, d)


class RMSNorm(nn.Module):
    """Root-mean-square norm in fp32 with a learned scale (reference ``RMSNorm``)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, cos: torch.Tensor, sin: torch.Tensor):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads or args.n_heads
        self.head_dim = args.dim // args.n_heads
        if args.attention_code not in ATTENTION_CODES:
            raise ValueError(
                f"attention_code={args.attention_code!r}: expected 'planner' (real RoPE, SDPA's enable_gqa) "
                "or 'reference' (complex RoPE and repeat_kv, as Meta's reference and torchtitan)"
            )
        self.reference = args.attention_code == "reference"
        self.wq = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False)
        # Not persistent: derived from the config, never part of a checkpoint.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.size(0), x.size(1)
        # -1 heads, not n_heads: under tensor parallelism wq/wk/wv are split by output columns, so a
        # rank holds n_heads / tp of the heads (as torchtitan's Attention does).
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        cos = torch.narrow(self.rope_cos, 0, 0, s)
        sin = torch.narrow(self.rope_sin, 0, 0, s)
        if self.reference:
            q = apply_rope_complex(q, cos, sin)
            k = apply_rope_complex(k, cos, sin)
            # n_heads / n_kv_heads query heads per kv head, the same on every tensor-parallel rank
            k = repeat_kv(k, self.n_heads // self.n_kv_heads)
            v = repeat_kv(v, self.n_heads // self.n_kv_heads)
        else:
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
        # SDPA wants (b, heads, s, head_dim); enable_gqa shares each kv head among
        # n_heads / n_kv_heads query heads without copying k and v.
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            enable_gqa=not self.reference and self.n_kv_heads != self.n_heads,
        )
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs, cos: torch.Tensor, sin: torch.Tensor):
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args, cos, sin)
        self.feed_forward = FeedForward(args.dim, ffn_hidden_dim(args.dim, args.multiple_of, args.ffn_dim_multiplier))
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        if args.dim % args.n_heads:
            raise ValueError(f"dim={args.dim} must be a multiple of n_heads={args.n_heads}")
        n_kv = args.n_kv_heads or args.n_heads
        if args.n_heads % n_kv:
            raise ValueError(f"n_heads={args.n_heads} must be a multiple of n_kv_heads={n_kv}")
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        cos, sin = rope_tables(args.dim // args.n_heads, args.seq_len, args.rope_theta)
        self.layers = nn.ModuleList(TransformerBlock(i, args, cos, sin) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # A module set to None is held by another pipeline stage (torchtitan's split prunes them so).
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers:
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h).float() if self.output is not None else h


_LLAMA3 = dict(vocab_size=128256, ffn_dim_multiplier=1.3, rope_theta=500000.0, seq_len=8192)

SIZES: dict[str, dict] = {
    "tiny": dict(
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=512,
        ffn_dim_multiplier=1.0,
        multiple_of=32,
        rope_theta=10000.0,
        seq_len=32,
    ),
    "8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, multiple_of=1024, **_LLAMA3),
    "70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, multiple_of=4096, **_LLAMA3),
    "405b": dict(
        dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, multiple_of=4096, **_LLAMA3 | {"ffn_dim_multiplier": 1.2}
    ),
}

# Tensor parallelism (Megatron's split, as torchtitan's ``parallelize_llama`` applies it): q, k, v and
# the SwiGLU's w1, w3 split by output columns, wo and w2 by input rows, so each layer needs one
# all-reduce after attention and one after the feed-forward (and two in the backward). Norms stay
# whole on every tensor-parallel rank. Keys are module-name patterns ('*' matches one name part),
# values torch's ColwiseParallel / RowwiseParallel.
tp_plan: dict[str, str] = {
    # the input embedding by its width, each rank's slice of the looked-up vectors gathered whole
    # (torchtitan shards it too: at 128,256 x 16,384 it is 2.1B parameters, five 405B layers' worth)
    "tok_embeddings": "colwise_rep",
    "layers.*.attention.wq": "colwise",
    "layers.*.attention.wk": "colwise",
    "layers.*.attention.wv": "colwise",
    "layers.*.attention.wo": "rowwise",
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w3": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
    # the output head by vocabulary rows, its logits gathered whole for the loss (Megatron and torchtitan
    # shard it too: at 128,256 logits it is 2/3 of a 405B layer's matrix work)
    "output": "colwise_rep",
}


def build_model(
    dim: int = 64,
    n_layers: int = 4,
    n_heads: int = 4,
    n_kv_heads: int | None = 2,
    vocab_size: int = 512,
    ffn_dim_multiplier: float | None = 1.0,
    multiple_of: int = 32,
    rope_theta: float = 10000.0,
    seq_len: int = 32,
    norm_eps: float = 1e-5,
    attention_code: str = "planner",
    **_ignored,
) -> nn.Module:
    return Transformer(
        ModelArgs(
            dim=dim,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            vocab_size=vocab_size,
            multiple_of=multiple_of,
            ffn_dim_multiplier=ffn_dim_multiplier,
            norm_eps=norm_eps,
            rope_theta=rope_theta,
            seq_len=seq_len,
            attention_code=attention_code,
        )
    )


def make_batch(batch_size: int, vocab_size: int = 512, seq_len: int = 32, **_ignored) -> tuple[tuple, torch.Tensor]:
    """Random tokens and their next-token targets (one extra token drawn, then shifted)."""
    seq = torch.randint(0, vocab_size, (batch_size, seq_len + 1))
    return (seq[:, :-1].contiguous(),), seq[:, 1:].contiguous()


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def train_batches(
    batch_size: int, vocab_size: int = 512, seq_len: int = 32, seed: int = 0, **_ignored
) -> Iterator[tuple[tuple, torch.Tensor]]:
    """Infinite deterministic stream from a fixed random successor rule (as models/gpt.py)."""
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
