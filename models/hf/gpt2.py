"""Hugging Face ``transformers.GPT2LMHeadModel``, built from a config (no weights are downloaded).

A model file as a user brings one: the model is transformers' own class, called as it is, and it
returns a ``CausalLMOutputWithCrossAttentions``; the planner hands ``loss_fn`` its ``logits``. The
input embedding and the output head are one tensor (``tie_word_embeddings``, GPT-2's default), so
a plan that puts ``transformer.wte`` and ``lm_head`` on different stages records the tie and the
runner keeps the two copies equal (docs/architecture.md, "Tied weights").

Needs ``pip install transformers`` (the ``hf`` extra).

Config keys: n_layer, n_embd, n_head, vocab_size, seq_len, dropout.

Sizes:

* ``tiny``: 4 layers, width 64, 4 heads, vocabulary 512, 32 tokens (about 0.23 M parameters).
* ``small``: GPT-2 small, 12 layers, width 768, 12 heads, vocabulary 50257, 1024 tokens (124 M).

Data: random token ids; the target is the next token (the input shifted left), as GPT-2 trains.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SIZES: dict[str, dict] = {
    "tiny": dict(n_layer=4, n_embd=64, n_head=4, vocab_size=512, seq_len=32, dropout=0.0),
    "small": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, seq_len=1024, dropout=0.1),
}


def build_model(n_layer=4, n_embd=64, n_head=4, vocab_size=512, seq_len=32, dropout=0.0, **_ignored):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        vocab_size=vocab_size,
        n_positions=seq_len,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
    )
    return GPT2LMHeadModel(config)


def make_batch(batch_size, vocab_size=512, seq_len=32, **_ignored):
    tokens = torch.randint(0, vocab_size, (batch_size, seq_len + 1))
    return (tokens[:, :-1],), tokens[:, 1:]


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
