"""Hugging Face ``transformers.LlamaForCausalLM``, built from a config (no weights are downloaded).

Called with keyword inputs as Hugging Face models are (``input_ids`` and ``attention_mask``: the
batch is a dict, bound to ``forward``'s parameters by name). ``70b`` is Llama 3 70B's config: plan
it without its 140 GB of weights on the meta device, for GPUs you do not have::

    planner plan models/hf/llama.py --size 70b --gpu-type h100 --gpus 64 -b 64

Needs ``pip install transformers`` (the ``hf`` extra).

Config keys: n_layers, dim, n_heads, n_kv_heads, ffn_dim, vocab_size, seq_len, tied, rope_theta.

Sizes:

* ``tiny``: 4 layers, width 64, 4 heads (2 key/value heads), vocabulary 512, 32 tokens.
* ``tiny-tied``: the same with the input embedding tied to the head (as Llama 3.2 1B and 3B are).
* ``1b``: Llama 3.2 1B (16 layers, width 2048, tied embeddings, 1.24 B parameters).
* ``8b``: Llama 3 8B (32 layers, width 4096, 8.03 B parameters).
* ``70b``: Llama 3 70B (80 layers, width 8192, 70.6 B parameters).

Data: random token ids, each sequence ending in ``seq_len // 8`` padding tokens (``attention_mask`` 0
there); the target is the next token, -100 (ignored) on padding. Every sequence has the same number
of real tokens, so the token-mean loss is also a mean over samples, which the pipeline relies on (it
averages the microbatch losses).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SIZES: dict[str, dict] = {
    "tiny": dict(n_layers=4, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=172, vocab_size=512, seq_len=32, tied=False),
    "tiny-tied": dict(n_layers=4, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=172, vocab_size=512, seq_len=32, tied=True),
    "1b": dict(
        n_layers=16, dim=2048, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab_size=128256, seq_len=8192, tied=True
    ),
    "8b": dict(
        n_layers=32, dim=4096, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256, seq_len=8192, tied=False
    ),
    "70b": dict(
        n_layers=80, dim=8192, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=128256, seq_len=8192, tied=False
    ),
}


def build_model(
    n_layers=4,
    dim=64,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=172,
    vocab_size=512,
    seq_len=32,
    tied=False,
    rope_theta=500000.0,
    **_ignored,
):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=n_layers,
        hidden_size=dim,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        intermediate_size=ffn_dim,
        vocab_size=vocab_size,
        max_position_embeddings=seq_len,
        tie_word_embeddings=tied,
        rope_theta=rope_theta,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config)


def make_batch(batch_size, vocab_size=512, seq_len=32, **_ignored):
    tokens = torch.randint(1, vocab_size, (batch_size, seq_len + 1))
    mask = torch.ones(batch_size, seq_len, dtype=torch.long)
    mask[:, seq_len - seq_len // 8 :] = 0  # the same padding on every sequence: see the module docstring
    target = tokens[:, 1:].masked_fill(mask == 0, -100)
    return {"input_ids": tokens[:, :-1], "attention_mask": mask}, target


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1), ignore_index=-100)
