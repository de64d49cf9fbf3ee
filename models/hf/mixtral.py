"""Hugging Face ``transformers.MixtralForCausalLM``: a mixture-of-experts decoder, built from a config.

Each layer's feed-forward is ``n_experts`` SwiGLU experts of which a router picks ``top_k`` per token;
transformers runs them as grouped GEMMs (``aten._grouped_mm``), which the planner's estimate charges
the FLOPs of the routed rows (every token through ``top_k`` experts), and whose memory holds every
expert's weights, gradients and optimizer state. Plan the real size on the meta device, for GPUs you
do not have::

    planner plan models/hf/mixtral.py --size 8x7b --gpu-type h100 --gpus 32 -b 64

Needs ``pip install transformers`` (the ``hf`` extra).

Config keys: n_layers, dim, n_heads, n_kv_heads, ffn_dim, n_experts, top_k, vocab_size, seq_len.

Sizes:

* ``tiny``: 2 layers, width 64, 4 heads (2 key/value heads), 4 experts of width 128, top 2,
  vocabulary 512, 32 tokens.
* ``8x7b``: Mixtral 8x7B (32 layers, width 4096, 8 experts of width 14336, top 2, vocabulary 32000,
  46.7 B parameters of which 12.9 B are active per token).

Data: random token ids, each sequence ending in ``seq_len // 8`` padding tokens (``attention_mask`` 0
there); the target is the next token, -100 (ignored) on padding (as ``models/hf/llama.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SIZES: dict[str, dict] = {
    "tiny": dict(
        n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128, n_experts=4, top_k=2, vocab_size=512, seq_len=32
    ),
    "8x7b": dict(
        n_layers=32,
        dim=4096,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        n_experts=8,
        top_k=2,
        vocab_size=32000,
        seq_len=4096,
    ),
}


def build_model(
    n_layers=2,
    dim=64,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=128,
    n_experts=4,
    top_k=2,
    vocab_size=512,
    seq_len=32,
    **_ignored,
):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        num_hidden_layers=n_layers,
        hidden_size=dim,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        intermediate_size=ffn_dim,
        num_local_experts=n_experts,
        num_experts_per_tok=top_k,
        vocab_size=vocab_size,
        max_position_embeddings=seq_len,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return MixtralForCausalLM(config)


def make_batch(batch_size, vocab_size=512, seq_len=32, **_ignored):
    tokens = torch.randint(1, vocab_size, (batch_size, seq_len + 1))
    mask = torch.ones(batch_size, seq_len, dtype=torch.long)
    mask[:, seq_len - seq_len // 8 :] = 0  # the same padding on every sequence (models/hf/llama.py)
    target = tokens[:, 1:].masked_fill(mask == 0, -100)
    return {"input_ids": tokens[:, :-1], "attention_mask": mask}, target


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1), ignore_index=-100)
