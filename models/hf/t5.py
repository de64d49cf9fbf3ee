"""Hugging Face ``transformers.T5ForConditionalGeneration``: an encoder-decoder, built from a config.

The encoder stack and the decoder stack are split like any chain of blocks; the encoder's output,
which every decoder layer's cross-attention reads, travels from stage to stage with the decoder's
hidden state. The decoder keeps a config of its own, whose key/value cache the planner switches off
as it does the top one's (a cache object is no tensor and torch.export cannot return it).

Needs ``pip install transformers`` (the ``hf`` extra).

Config keys: vocab_size, d_model, d_ff, num_layers, num_heads, seq_len, dropout.

Sizes:

* ``tiny``: 2 encoder and 2 decoder layers, width 32, 4 heads, vocabulary 128, 16 tokens each side.
* ``small``: t5-small (6 + 6 layers, width 512, 8 heads, FFN 2048, vocabulary 32128: 60.5 M parameters),
  512 tokens each side.

Data: random source token ids, and a random target sequence; the decoder reads the target shifted
right (``decoder_input_ids``) and predicts the next target token (teacher forcing, as T5 trains).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SIZES: dict[str, dict] = {
    "tiny": dict(vocab_size=128, d_model=32, d_ff=64, num_layers=2, num_heads=4, seq_len=16, dropout=0.0),
    "small": dict(vocab_size=32128, d_model=512, d_ff=2048, num_layers=6, num_heads=8, seq_len=512, dropout=0.1),
}


def build_model(vocab_size=128, d_model=32, d_ff=64, num_layers=2, num_heads=4, seq_len=16, dropout=0.0, **_ignored):
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=vocab_size,
        d_model=d_model,
        d_kv=d_model // num_heads,
        d_ff=d_ff,
        num_layers=num_layers,
        num_decoder_layers=num_layers,
        num_heads=num_heads,
        dropout_rate=dropout,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return T5ForConditionalGeneration(config)


def make_batch(batch_size, vocab_size=128, seq_len=16, **_ignored):
    source = torch.randint(2, vocab_size, (batch_size, seq_len))
    target = torch.randint(2, vocab_size, (batch_size, seq_len + 1))
    return {"input_ids": source, "decoder_input_ids": target[:, :-1]}, target[:, 1:]


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))
