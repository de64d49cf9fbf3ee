"""Hugging Face ``transformers.Qwen2MoeForCausalLM``: fine-grained experts plus a shared expert, from a config.

Each layer's feed-forward is ``n_experts`` small SwiGLU experts of which a router picks ``top_k`` per
token, beside one shared expert every token goes through (gated); transformers runs the routed experts
as grouped GEMMs, which the planner's estimate charges the FLOPs of the routed rows. Plan the real
size on the meta device::

    planner plan models/hf/qwen_moe.py --size a2.7b --gpu-type h100 --gpus 8 -b 64

Needs ``pip install transformers`` (the ``hf`` extra).

Config keys: n_layers, dim, n_heads, n_kv_heads, expert_dim, shared_dim, n_experts, top_k, vocab_size,
seq_len.

Sizes:

* ``tiny``: 2 layers, width 64, 4 heads, 8 experts of width 32 (top 2), a shared expert of width 64,
  vocabulary 512, 32 tokens.
* ``a2.7b``: Qwen1.5-MoE-A2.7B (24 layers, width 2048, 60 experts of width 1408, top 4, a shared
  expert of width 5632, vocabulary 151936: 14.3 B parameters, 2.7 B active per token).

Data: random token ids, each sequence ending in ``seq_len // 8`` padding tokens (``attention_mask`` 0
there); the target is the next token, -100 (ignored) on padding (as ``models/hf/llama.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SIZES: dict[str, dict] = {
    "tiny": dict(
        n_layers=2,
        dim=64,
        n_heads=4,
        n_kv_heads=4,
        expert_dim=32,
        shared_dim=64,
        n_experts=8,
        top_k=2,
        vocab_size=512,
        seq_len=32,
    ),
    "a2.7b": dict(
        n_layers=24,
        dim=2048,
        n_heads=16,
        n_kv_heads=16,
        expert_dim=1408,
        shared_dim=5632,
        n_experts=60,
        top_k=4,
        vocab_size=151936,
        seq_len=4096,
    ),
}


def build_model(
    n_layers=2,
    dim=64,
    n_heads=4,
    n_kv_heads=4,
    expert_dim=32,
    shared_dim=64,
    n_experts=8,
    top_k=2,
    vocab_size=512,
    seq_len=32,
    **_ignored,
):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        num_hidden_layers=n_layers,
        hidden_size=dim,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        intermediate_size=shared_dim,
        moe_intermediate_size=expert_dim,
        shared_expert_intermediate_size=shared_dim,
        num_experts=n_experts,
        num_experts_per_tok=top_k,
        decoder_sparse_step=1,
        norm_topk_prob=False,
        vocab_size=vocab_size,
        max_position_embeddings=seq_len,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return Qwen2MoeForCausalLM(config)


def make_batch(batch_size, vocab_size=512, seq_len=32, **_ignored):
    tokens = torch.randint(1, vocab_size, (batch_size, seq_len + 1))
    mask = torch.ones(batch_size, seq_len, dtype=torch.long)
    mask[:, seq_len - seq_len // 8 :] = 0  # the same padding on every sequence (models/hf/llama.py)
    target = tokens[:, 1:].masked_fill(mask == 0, -100)
    return {"input_ids": tokens[:, :-1], "attention_mask": mask}, target


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1), ignore_index=-100)
