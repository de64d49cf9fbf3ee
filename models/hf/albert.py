"""Hugging Face ``transformers.AlbertForMaskedLM``: one encoder layer applied to every block.

ALBERT shares its parameters across layers: a single ``AlbertLayer`` (in
``albert.encoder.albert_layer_groups.0``) runs ``n_layers`` times. The planner makes each application
a block of its own (``albert.encoder.albert_layer_groups.0``, ``...#2``, ``...#3``, ...), so the
encoder splits like any stack of layers; every stage that applies the layer holds a copy of its
weights, which the plan records as a tie and `planner run` keeps identical (gradients summed over
the copies, as for tied embeddings). The MLM decoder is also tied to the word embeddings.

Needs ``pip install transformers`` (the ``hf`` extra).

Config keys: n_layers, dim, embedding_dim, n_heads, ffn_dim, vocab_size, seq_len, mask_prob.

Sizes:

* ``tiny``: 4 applications of the layer, width 64, embeddings 32, 4 heads, vocabulary 512, 32 tokens.
* ``base``: ALBERT-base (12 applications, width 768, embeddings 128, 12 heads, vocabulary 30000,
  512 tokens; 11.2 M parameters).

Data: as ``models/hf/bert_mlm.py``: the same number of masked positions per sequence, the target
there and -100 (ignored) elsewhere, so the token-mean loss is a mean over samples.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SIZES: dict[str, dict] = {
    "tiny": dict(n_layers=4, dim=64, embedding_dim=32, n_heads=4, ffn_dim=256, vocab_size=512, seq_len=32),
    "base": dict(n_layers=12, dim=768, embedding_dim=128, n_heads=12, ffn_dim=3072, vocab_size=30000, seq_len=512),
}
MASK_ID = 1


def build_model(n_layers=4, dim=64, embedding_dim=32, n_heads=4, ffn_dim=256, vocab_size=512, seq_len=32, **_ignored):
    from transformers import AlbertConfig, AlbertForMaskedLM

    config = AlbertConfig(
        num_hidden_layers=n_layers,
        hidden_size=dim,
        embedding_size=embedding_dim,
        num_attention_heads=n_heads,
        intermediate_size=ffn_dim,
        vocab_size=vocab_size,
        max_position_embeddings=seq_len,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout_prob=0.0,
        pad_token_id=0,
    )
    return AlbertForMaskedLM(config)


def make_batch(batch_size, vocab_size=512, seq_len=32, mask_prob=0.15, **_ignored):
    tokens = torch.randint(2, vocab_size, (batch_size, seq_len))
    n_masked = max(1, round(mask_prob * seq_len))
    masked = torch.rand(batch_size, seq_len).argsort(dim=1)[:, :n_masked]  # n_masked positions per sequence
    is_masked = torch.zeros(batch_size, seq_len, dtype=torch.bool).scatter_(1, masked, True)
    target = tokens.masked_fill(~is_masked, -100)
    inputs = {
        "input_ids": tokens.masked_fill(is_masked, MASK_ID),
        "attention_mask": torch.ones(batch_size, seq_len, dtype=torch.long),
        "token_type_ids": torch.zeros(batch_size, seq_len, dtype=torch.long),
    }
    return inputs, target


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100)
