"""Hugging Face ``transformers.Qwen2ForCausalLM`` (the Mistral/Qwen family), built from a config.

Grouped-query attention with biases on the query/key/value projections, SwiGLU MLPs, RMSNorm,
and (as the small Qwen2 models do) the input embedding tied to the output head. The model is
called as it is and returns a ``CausalLMOutputWithPast``; the planner hands ``loss_fn`` its logits.

Needs ``pip install transformers`` (the ``hf`` extra).

Config keys: n_layers, dim, n_heads, n_kv_heads, ffn_dim, vocab_size, seq_len, tied.

Sizes:

* ``tiny``: 4 layers, width 64, 4 heads (2 key/value heads), vocabulary 512, 32 tokens, tied.
* ``0.5b``: Qwen2-0.5B (24 layers, width 896, 14 heads, 2 key/value heads, tied; 494 M parameters).
* ``7b``: Qwen2-7B (28 layers, width 3584, 28 heads, 4 key/value heads, untied; 7.6 B parameters).

Data: random token ids; the target is the next token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SIZES: dict[str, dict] = {
    "tiny": dict(n_layers=4, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=172, vocab_size=512, seq_len=32, tied=True),
    "0.5b": dict(
        n_layers=24, dim=896, n_heads=14, n_kv_heads=2, ffn_dim=4864, vocab_size=151936, seq_len=4096, tied=True
    ),
    "7b": dict(
        n_layers=28, dim=3584, n_heads=28, n_kv_heads=4, ffn_dim=18944, vocab_size=152064, seq_len=4096, tied=False
    ),
}


def build_model(
    n_layers=4, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=172, vocab_size=512, seq_len=32, tied=True, **_ignored
):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        num_hidden_layers=n_layers,
        hidden_size=dim,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        intermediate_size=ffn_dim,
        vocab_size=vocab_size,
        max_position_embeddings=seq_len,
        tie_word_embeddings=tied,
        bos_token_id=0,
        eos_token_id=0,
    )
    return Qwen2ForCausalLM(config)


def make_batch(batch_size, vocab_size=512, seq_len=32, **_ignored):
    tokens = torch.randint(0, vocab_size, (batch_size, seq_len + 1))
    return (tokens[:, :-1],), tokens[:, 1:]


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))
