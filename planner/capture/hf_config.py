"""A Hugging Face ``config.json`` as a model file: ``planner plan path/to/config.json`` (or its folder).

``load_model_file`` serves this module as the model file of a ``.json`` path, its config holding
``hf_config`` (the file) and any ``--set`` keys: ``seq_len`` (tokens per sample; default the
config's ``max_position_embeddings``, at most 512) and any field of the Hugging Face config
(``--set num_hidden_layers=2``). The class named in ``architectures`` is built from the config with
fresh weights (nothing is downloaded), on the meta device for ``--gpu-type``; its own tied weights
and tensor-parallel plan (``base_model_tp_plan``) come with it.

Batches are random token ids from the config's vocabulary: next-token targets for causal language
models, token targets for masked language models, decoder inputs and targets for encoder-decoders,
class labels for sequence classification.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from planner.errors import ModelFileError

DEFAULT_SEQ_LEN = 512
"""Tokens per sample unless ``--set seq_len=N`` (or the config's shorter ``max_position_embeddings``)."""


@functools.lru_cache(maxsize=8)
def _config(hf_config: str, overrides: str = "{}") -> Any:
    """The Hugging Face config of the file, with ``--set`` fields replaced.

    Raises:
        ModelFileError: no transformers, a file transformers cannot read, or one without a model type.
    """
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ModelFileError(
            f"{Path(hf_config).name}: planning a Hugging Face config needs transformers (pip install 'planner[hf]')"
        ) from None
    try:
        config = AutoConfig.from_pretrained(hf_config, local_files_only=True)
    except (ValueError, OSError, KeyError) as e:
        text = " ".join(str(e).split())[:200]
        raise ModelFileError(
            f"{Path(hf_config).name}: transformers cannot read it as a model config ({text}); give a model's "
            'config.json (with "model_type" and "architectures")'
        ) from None
    for key, value in json.loads(overrides).items():  # (JSON: a hashable key for the cache)
        setattr(config, key, value)
    return config


def _architecture(config: Any, hf_config: str) -> type[nn.Module]:
    """The model class ``architectures`` names, from the installed transformers.

    Raises:
        ModelFileError: no architecture named, or one this transformers lacks.
    """
    import transformers

    names = list(getattr(config, "architectures", None) or [])
    if not names:
        raise ModelFileError(
            f'{Path(hf_config).name} names no "architectures"; add the class to build, e.g. '
            '"architectures": ["LlamaForCausalLM"]'
        )
    cls = getattr(transformers, names[0], None)
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise ModelFileError(
            f"{Path(hf_config).name} names architecture {names[0]!r}, which transformers {transformers.__version__} "
            "does not have; upgrade transformers or write a model file that builds it"
        )
    return cls


def _split(config: dict[str, Any]) -> tuple[str, int | None, str]:
    """(the config file, --set seq_len or None, the other --set keys as Hugging Face config fields, JSON)."""
    rest = {k: v for k, v in config.items() if k not in ("hf_config", "seq_len")}
    seq = config.get("seq_len")
    return str(config["hf_config"]), int(seq) if seq is not None else None, json.dumps(rest, sort_keys=True)


def _seq_len(hf: Any, seq: int | None) -> int:
    if seq is not None:
        return seq
    limit = getattr(hf, "max_position_embeddings", None) or getattr(hf, "n_positions", None) or DEFAULT_SEQ_LEN
    return min(int(limit), DEFAULT_SEQ_LEN)


def build_model(**config: Any) -> nn.Module:
    """The config's architecture with fresh weights (under the caller's device context: meta for
    ``--gpu-type``).

    Raises:
        ModelFileError: as ``_config`` and ``_architecture``.
    """
    path, _seq, overrides = _split(config)
    hf = _config(path, overrides)
    return _architecture(hf, path)(hf)


def make_batch(batch_size: int, **config: Any) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Random token ids of the config's vocabulary and the targets its architecture trains on."""
    path, seq, overrides = _split(config)
    hf = _config(path, overrides)
    n, vocab = _seq_len(hf, seq), int(hf.vocab_size)
    arch = (getattr(hf, "architectures", None) or [""])[0]
    low = min(2, vocab - 1)  # clear of the usual pad / special ids 0 and 1
    if getattr(hf, "is_encoder_decoder", False):
        source = torch.randint(low, vocab, (batch_size, n))
        target = torch.randint(low, vocab, (batch_size, n + 1))
        return {"input_ids": source, "decoder_input_ids": target[:, :-1]}, target[:, 1:]
    tokens = torch.randint(low, vocab, (batch_size, n + 1))
    inputs = {"input_ids": tokens[:, :-1]}
    if arch.endswith("ForSequenceClassification"):
        return inputs, torch.randint(0, int(getattr(hf, "num_labels", 2)), (batch_size,))
    if arch.endswith("ForMaskedLM"):
        return inputs, tokens[:, :-1].clone()
    return inputs, tokens[:, 1:]


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dimension (in fp32), ignoring targets of -100."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]).float(), target.reshape(-1), ignore_index=-100)
