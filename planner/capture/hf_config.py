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

import difflib
import functools
import inspect
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
    except Exception as e:  # noqa: BLE001 - any reader or validator failure (huggingface_hub's strict
        # dataclass errors are no ValueError) means: not a config this transformers builds
        raise ModelFileError(
            f"{Path(hf_config).name}: transformers cannot read it as a model config ({_reason(e)}); give a model's "
            'config.json (with "model_type" and "architectures")'
        ) from None
    for key, value in json.loads(overrides).items():  # (JSON: a hashable key for the cache)
        _check_field(config, key, hf_config)
        try:
            setattr(config, key, value)
        except Exception as e:  # noqa: BLE001 - a config class validating its fields on assignment
            raise ModelFileError(
                f"--set {key}={value!r}: {type(config).__name__} refuses it ({_reason(e)}); give a value it takes"
            ) from None
    return config


def _reason(error: BaseException, limit: int = 200) -> str:
    """An exception's text on one line, cut at a word (not mid-word) when longer than ``limit``."""
    text = " ".join(str(error).split()) or type(error).__name__
    if len(text) <= limit:
        return text
    return text[:limit].rsplit(" ", 1)[0] + " ..."


def _fields(config: Any) -> set[str]:
    """The names ``--set`` may replace on a Hugging Face config: its fields (as saved), its
    constructor's parameters, its aliases (``attribute_map``: GPT-2's ``hidden_size`` is ``n_embd``)
    and its settable properties (``num_labels``); never a private name or a method."""
    cls = type(config)
    names = set(config.to_dict()) | set(getattr(cls, "attribute_map", None) or {})
    try:
        params = list(inspect.signature(cls.__init__).parameters.values())
    except (TypeError, ValueError):  # a constructor without a signature: the saved fields say enough
        params = []
    names |= {q.name for q in params if q.kind in (q.POSITIONAL_OR_KEYWORD, q.KEYWORD_ONLY)}
    for name in dir(cls):
        attr = inspect.getattr_static(cls, name, None)
        if isinstance(attr, property) and attr.fset is not None:
            names.add(name)
    return {n for n in names if not n.startswith("_") and n != "self"}


def _check_field(config: Any, key: str, hf_config: str) -> None:
    """Refuse a ``--set`` key the config's class does not know: ``setattr`` would take any name and the
    model, built from the known fields only, would be the unchanged one (a misspelt ``hidden_sise``).

    Raises:
        ModelFileError: the key is no field of the config, with the closest field names.
    """
    known = _fields(config)
    if key in known:
        return
    shown = key if key.isprintable() else repr(key)  # one line, whatever the key holds
    close = difflib.get_close_matches(key, sorted(known | {"seq_len"}), n=3)
    hint = f"did you mean {' or '.join(close)}?" if close else "give one of its fields (as in its config.json)"
    raise ModelFileError(
        f"--set {shown}: {Path(hf_config).name} is a transformers {type(config).__name__}, which has no field "
        f"{key!r}; {hint} (--set takes seq_len or a field of the config)"
    )


def _architecture(config: Any, hf_config: str) -> type[nn.Module]:
    """The model class ``architectures`` names, from the installed transformers.

    Raises:
        ModelFileError: no architecture named, or one this transformers lacks.
    """
    import transformers

    named = getattr(config, "architectures", None)
    if isinstance(named, str):  # list("LlamaForCausalLM")[0] was 'L'
        raise ModelFileError(
            f'{Path(hf_config).name}: "architectures" is the string {named!r}, not a list of class names; write '
            f'"architectures": [{json.dumps(named)}]'
        )
    names = list(named or [])
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


def check_config(config: dict[str, Any]) -> None:
    """Read the config file and apply its ``--set`` keys once, when the file is loaded: a key the
    config does not know, or a file transformers cannot read, is then refused in its own line before
    any work (at the first build it would read as an error of ``build_model``).

    Args:
        config: the model file's config (``hf_config`` and the ``--set`` keys).

    Raises:
        ModelFileError: as ``_config`` and ``_architecture``.
    """
    path, _seq, overrides = _split(config)
    _architecture(_config(path, overrides), path)  # the class too: at the first build, an error of build_model


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
