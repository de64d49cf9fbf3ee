"""Hugging Face ``transformers.BertForMaskedLM``: a BERT-style encoder with its masked-LM head.

The encoder-stack language model as Hugging Face builds it: keyword inputs (``input_ids``,
``attention_mask``, ``token_type_ids``), a ``MaskedLMOutput`` result whose ``logits`` the planner
hands to ``loss_fn``, and the MLM decoder tied to the word embeddings (BERT's default), so a
two-stage plan holds the embedding on stage 0 and a tied copy on the last stage.

Needs ``pip install transformers`` (the ``hf`` extra).

Config keys: n_layers, dim, n_heads, ffn_dim, vocab_size, seq_len, mask_prob.

Sizes:

* ``tiny``: 4 layers, width 64, 4 heads, vocabulary 512, 32 tokens.
* ``base``: BERT-base (12 layers, width 768, 12 heads, vocabulary 30522, 512 tokens; 110 M).

Data: random token ids; in each sequence the same number of positions (``mask_prob`` of them) is
replaced by the [MASK] id 1 and is the target there, -100 (ignored) elsewhere. The same count per
sequence keeps the token-mean loss a mean over samples, which the pipeline relies on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SIZES: dict[str, dict] = {
    "tiny": dict(n_layers=4, dim=64, n_heads=4, ffn_dim=256, vocab_size=512, seq_len=32),
    "base": dict(n_layers=12, dim=768, n_heads=12, ffn_dim=3072, vocab_size=30522, seq_len=512),
}
MASK_ID = 1


def build_model(n_layers=4, dim=64, n_heads=4, ffn_dim=256, vocab_size=512, seq_len=32, **_ignored):
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        num_hidden_layers=n_layers,
        hidden_size=dim,
        num_attention_heads=n_heads,
        intermediate_size=ffn_dim,
        vocab_size=vocab_size,
        max_position_embeddings=seq_len,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=0,
    )
    return BertForMaskedLM(config)


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
