"""Token streams as batches in the model's own format: batchify, bptt windows, sharding, resume.

The layout is the PyTorch language-model tutorials' ``batchify``: the training stream is cut into
``global_rows`` equal rows (row r is the r-th contiguous piece of the text), and step i takes the
window ``[i*T, i*T + T)`` of every row as inputs and the same window shifted by one token as
targets. Row r of step i+1 continues row r of step i. Replica k of ``replicas`` gets rows
``[k*R, (k+1)*R)`` with ``R = global_rows / replicas``, so all replicas together see exactly the
global batch, and its i-th batch is step i on every replica.

The per-replica stream is a torchdata ``StatefulDataLoader`` over the step windows (a map-style
dataset whose items are already batches), so a run can save where it is and resume at the exact
next batch. Every epoch restarts at token 0: the same windows in the same order.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from planner.data.text import TOKENIZERS, Vocab, check_tokenizer, encode, read_corpus, split_point
from planner.errors import DataError

STATE_FORMAT = "planner-text-batches"
STATE_VERSION = 1
_NOT_AN_LM = (
    "--data reads text for token-id language models (a (batch, seq_len) tensor of token ids in, the next "
    "token at every position as the target); without --data, planner run trains on the model file's own "
    "train_batches/make_batch stream"
)
# Input names whose tensor is a mask or a segment id, never the token ids (Hugging Face's names).
_MASK_WORDS = ("mask", "token_type")


def _shown(value: Any) -> str:
    """A value as messages show it: a tensor's dtype and shape, else its type."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')} {tuple(value.shape)}"
    return type(value).__name__


def _is_ids(value: Any) -> bool:
    """An integer (not bool) tensor of shape (n, T): what a batch of token ids looks like."""
    return (
        isinstance(value, torch.Tensor)
        and value.dim() == 2
        and not value.dtype.is_floating_point
        and not value.dtype.is_complex
        and value.dtype != torch.bool
    )


def _is_mask_name(key: str | int) -> bool:
    return isinstance(key, str) and any(word in key for word in _MASK_WORDS)


@dataclass(frozen=True)
class TokenBatchFormat:
    """How a token-id language model's batch is laid out, read from one example batch.

    Attributes:
        keys: the inputs' names (a dict batch) or positions (a tuple or list batch), in order.
        roles: per input: ``ids`` (the token ids), ``ones`` (a mask: text windows hold no padding),
            ``zeros`` (segment ids such as ``token_type_ids``) or ``as-is`` (a non-tensor, passed on).
        dtypes: per input, the tensor dtype to produce (None for ``as-is``).
        constants: per input, the example's value where the role is ``as-is``.
        container: ``dict``, ``tuple`` or ``list``: the example's type of inputs.
        seq_len: T, the window length.
        target_dtype: the target's dtype.
        flat_target: whether the target is flattened to (n*T,) rather than (n, T).
    """

    keys: tuple[str | int, ...]
    roles: tuple[str, ...]
    dtypes: tuple[torch.dtype | None, ...]
    constants: tuple[Any, ...]
    container: type
    seq_len: int
    target_dtype: torch.dtype
    flat_target: bool

    def batch(self, ids: torch.Tensor, targets: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """One batch in the model's format.

        Args:
            ids: token ids, (rows, T).
            targets: the next token of every position, (rows, T).

        Returns:
            (inputs as the model takes them, target).
        """
        rows = ids.shape[0]
        values: list[Any] = []
        for role, dtype, constant in zip(self.roles, self.dtypes, self.constants):
            if role == "ids":
                values.append(ids.to(dtype))
            elif role == "ones":
                values.append(torch.ones(rows, self.seq_len, dtype=dtype))
            elif role == "zeros":
                values.append(torch.zeros(rows, self.seq_len, dtype=dtype))
            else:
                values.append(constant)
        target = targets.to(self.target_dtype)
        if self.flat_target:
            target = target.reshape(-1)
        inputs: Any = dict(zip(self.keys, values)) if self.container is dict else self.container(values)
        return inputs, target


def token_batch_format(example: tuple[Any, torch.Tensor]) -> TokenBatchFormat:
    """Recognise a token-id language model from one example batch (``make_batch(n)``).

    The token ids are ``input_ids`` in a dict batch, else the first integer (n, T) input that is
    not named as a mask. Every other tensor input must be an (n, T) mask or segment-id tensor of
    zeros and ones: one that is all zeros in the example (or is named ``token_type_ids``) is filled
    with zeros, any other with ones. The target holds integer ids, (n, T) or flattened (n*T,).

    Args:
        example: ``(inputs, target)``, the inputs a tuple or list of positional values or a dict
            of keyword ones.

    Returns:
        The format, with T.

    Raises:
        DataError: the batch is not a token-id language model's (no integer (n, T) input, float
            inputs, several id tensors, a target of another shape), or it is a masked language
            model's (targets ignored at positions the model reads).
    """
    if not (isinstance(example, tuple | list) and len(example) == 2 and isinstance(example[1], torch.Tensor)):
        raise DataError(f"the model's example batch is {_shown(example)}, not (inputs, target tensor); {_NOT_AN_LM}")
    inputs, target = example
    items: list[tuple[str | int, Any]]
    if isinstance(inputs, Mapping):
        items = list(inputs.items())
    elif isinstance(inputs, tuple | list):
        items = list(enumerate(inputs))
    else:
        raise DataError(f"the model's inputs are {_shown(inputs)}, not a tuple or dict; {_NOT_AN_LM}")
    takes = ", ".join(f"{k if isinstance(k, str) else 'input ' + str(k)}: {_shown(v)}" for k, v in items)
    id_key = _id_key(items, takes)
    ids = dict(items)[id_key]
    n, seq_len = int(ids.shape[0]), int(ids.shape[1])
    roles = tuple(_role(key, value, id_key, ids, takes) for key, value in items)
    flat = _check_target(target, n, seq_len, takes)
    _refuse_masked_lm(items, roles, target.reshape(n, seq_len))
    return TokenBatchFormat(
        keys=tuple(k for k, _ in items),
        roles=roles,
        dtypes=tuple(v.dtype if isinstance(v, torch.Tensor) else None for _, v in items),
        constants=tuple(None if isinstance(v, torch.Tensor) else v for _, v in items),
        container=dict if isinstance(inputs, Mapping) else type(inputs),
        seq_len=seq_len,
        target_dtype=target.dtype,
        flat_target=flat,
    )


def _id_key(items: list[tuple[str | int, Any]], takes: str) -> str | int:
    """Which input holds the token ids."""
    named = dict(items)
    if "input_ids" in named:
        if not _is_ids(named["input_ids"]):
            raise DataError(
                f"the model's input_ids is {_shown(named['input_ids'])}, not an integer (batch, seq_len) tensor; "
                f"{_NOT_AN_LM}"
            )
        return "input_ids"
    for key, value in items:
        if _is_ids(value) and not _is_mask_name(key):
            return key
    raise DataError(f"the model takes {takes}: no integer (batch, seq_len) tensor of token ids; {_NOT_AN_LM}")


def _role(key: str | int, value: Any, id_key: str | int, ids: torch.Tensor, takes: str) -> str:
    """What to put in one input of a text batch: the ids, a mask of ones, zeros, or the value as it is."""
    if key == id_key:
        return "ids"
    if not isinstance(value, torch.Tensor):
        return "as-is"  # a constant such as a skipped parameter's None
    name = key if isinstance(key, str) else f"input {key}"
    if value.dtype.is_floating_point or value.dtype.is_complex or value.shape != ids.shape:
        raise DataError(f"the model takes {takes}: {name} is neither the token ids nor a mask of them; {_NOT_AN_LM}")
    if not bool(((value == 0) | (value == 1)).all()):
        raise DataError(
            f"the model takes {takes}: several token-id tensors ({name} besides the ids), as an encoder-decoder "
            f"or a model with position ids does; {_NOT_AN_LM}"
        )
    if key == "token_type_ids" or (not _is_mask_name(key) and not bool(value.any())):
        return "zeros"
    return "ones"


def _check_target(target: torch.Tensor, n: int, seq_len: int, takes: str) -> bool:
    """Whether the target is flat (n*T,); refuse any other target than next-token ids."""
    integer = not (target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool)
    if integer and tuple(target.shape) in ((n, seq_len), (n * seq_len,)):
        return target.dim() == 1
    raise DataError(
        f"the model takes {takes} and its target is {_shown(target)}; a language model's target is one token id per "
        f"input position, ({n}, {seq_len}) or flattened ({n * seq_len},); {_NOT_AN_LM}"
    )


def _refuse_masked_lm(items: list[tuple[str | int, Any]], roles: tuple[str, ...], target: torch.Tensor) -> None:
    """Refuse a model whose own targets are ignored (negative, -100) at positions it reads."""
    read = torch.ones(target.shape, dtype=torch.bool)
    for (_, value), role in zip(items, roles):
        if role == "ones":
            read &= value != 0  # an attention mask's zeros are padding: an ignored target there is fine
    ignored = int(((target < 0) & read).sum())
    if ignored:
        raise DataError(
            f"the model's own targets are ignored (-100) at {ignored} of {int(read.sum())} positions it reads, as a "
            "masked language model's are (BERT predicts only the tokens hidden behind [MASK]); next-token windows "
            "would ask it for the next token at every position while its encoder sees that very token in the "
            f"input, so it would learn to copy; {_NOT_AN_LM}"
        )


def batchify(ids: torch.Tensor, rows: int) -> torch.Tensor:
    """Cut a token stream into ``rows`` equal rows, as the tutorials' ``batchify`` did.

    Args:
        ids: the stream, 1-D.
        rows: how many rows (the global batch size in samples).

    Returns:
        A (rows, len(ids) // rows) view: row r is the r-th contiguous piece; the tail that does
        not fill a whole column is dropped.
    """
    length = ids.numel() // rows
    return ids[: rows * length].view(rows, length)


class StepWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Map-style dataset of step windows over batchified rows: item i is step i's batch.

    Args:
        rows: the batchified stream, (rows, column length).
        seq_len: T.
    """

    def __init__(self, rows: torch.Tensor, seq_len: int) -> None:
        self.rows = rows
        self.seq_len = seq_len
        # step i needs tokens up to i*T + T (the last target): the column holds (length - 1) // T steps
        self.steps = (rows.shape[1] - 1) // seq_len

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= step < self.steps:
            raise IndexError(f"step {step} is not in 0..{self.steps - 1}")
        start = step * self.seq_len
        # clones: a caller may change its batch in place; the corpus must stay as it is
        inputs = self.rows[:, start : start + self.seq_len].clone()
        targets = self.rows[:, start + 1 : start + 1 + self.seq_len].clone()
        return inputs, targets


def _check_layout(global_rows: int, replica: int, replicas: int, eval_fraction: float) -> None:
    for name, value, least in (("global_rows", global_rows, 1), ("replicas", replicas, 1), ("replica", replica, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise DataError(f"{name} {value!r}: expected an integer of at least {least}")
    if replica >= replicas:
        raise DataError(f"replica {replica}: expected 0..{replicas - 1} (there are {replicas} replicas)")
    if global_rows % replicas:
        raise DataError(
            f"global batch {global_rows} does not split over {replicas} data-parallel replicas; choose a batch size "
            f"that is a multiple of {replicas}"
        )
    if not (isinstance(eval_fraction, int | float) and 0 < eval_fraction < 1):
        raise DataError(f"eval fraction {eval_fraction!r}: expected a number between 0 and 1 (e.g. 0.1)")


class TextBatches:
    """A text corpus as an endless, resumable stream of batches in the model's own format.

    Args:
        path: a UTF-8 text file, a folder of ``.txt`` files (sorted name order), or None for the
            repository's ``models/data/shakespeare.txt``.
        example: an example batch of the model, ``make_batch(n)``: gives the format and T.
        vocab_size: the model's vocabulary size V (its output's last dimension): every id is below it.
        global_rows: the global batch size in samples (rows of every step's batch).
        replica: this data-parallel replica, 0..replicas-1.
        replicas: the number of data-parallel replicas; must divide ``global_rows``.
        tokenizer: ``char``, ``byte`` or ``word``.
        eval_fraction: the share of the token stream (its end) held out for evaluation.
        vocab_file: when it exists, the vocabulary is read from it; when given and absent, the
            vocabulary built here is written to it (atomically, once every check has passed).

    Raises:
        DataError: for every mistake in the corpus, the options or the model's batch format.
    """

    def __init__(
        self,
        path: str | Path | None,
        *,
        example: tuple[Any, torch.Tensor],
        vocab_size: int,
        global_rows: int,
        replica: int = 0,
        replicas: int = 1,
        tokenizer: str = "char",
        eval_fraction: float = 0.1,
        vocab_file: str | Path | None = None,
    ) -> None:
        _check_layout(global_rows, replica, replicas, eval_fraction)
        check_tokenizer(tokenizer, vocab_size)
        self.format = token_batch_format(example)
        self.seq_len = self.format.seq_len
        corpus = read_corpus(path)
        self._corpus, self._files, self._tokenizer = corpus.name, len(corpus.files), tokenizer
        # A resumed run (or a later evaluation) must map text to the ids the model was trained on.
        loaded = Vocab.load(vocab_file) if vocab_file is not None and Path(vocab_file).exists() else None
        self._vocab_from = str(vocab_file) if loaded is not None else None
        ids, self.vocab = encode(corpus.text, tokenizer, vocab_size, eval_fraction, loaded)
        self.vocab_size = self.vocab.size
        self.train_tokens = split_point(len(ids), eval_fraction)
        self.eval_tokens = len(ids) - self.train_tokens
        self._eval_fraction, self._global_rows = eval_fraction, global_rows
        for split, count in (("training", self.train_tokens), ("eval", self.eval_tokens)):
            self._check_length(split, count)
        # Written only once every check passed: a stream refused leaves no vocabulary behind, which a
        # later stream of another tokenizer would otherwise be refused for.
        if vocab_file is not None and loaded is None:
            self.vocab.save(vocab_file)
        stream = torch.from_numpy(ids)
        local = slice(replica * global_rows // replicas, (replica + 1) * global_rows // replicas)
        self._local_rows = local
        self._train = StepWindows(batchify(stream[: self.train_tokens], global_rows)[local], self.seq_len)
        self._eval = StepWindows(batchify(stream[self.train_tokens :], global_rows)[local], self.seq_len)
        self.steps_per_epoch = len(self._train)
        self.eval_steps = len(self._eval)
        # Identifies the training stream, so a state saved for another corpus, tokenizer, vocabulary
        # or batch shape is refused instead of silently resuming somewhere else.
        self._stream_id = {
            "tokens": hashlib.blake2b(np.ascontiguousarray(ids[: self.train_tokens]).data, digest_size=16).hexdigest(),
            "global_rows": global_rows,
            "seq_len": self.seq_len,
        }
        with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, deprecated in torch 2.13
            warnings.filterwarnings("ignore", message=".*set_vital.*")
            self._loader = StatefulDataLoader(self._train, batch_size=None, num_workers=0, shuffle=False)
        self._epoch = 0

    def _check_length(self, split: str, count: int) -> None:
        need = self._global_rows * (self.seq_len + 1)
        if count >= need:
            return
        if split == "eval":
            where = f"the eval split (the last {self._eval_fraction * 100:g}% of the token stream)"
            fixes = "a longer corpus, a larger eval fraction or a smaller batch"
        else:
            where, fixes = "the training split", "a longer corpus or a smaller batch"
        raise DataError(
            f"--data {self._corpus}: corpus too short: {where} has {count} {self._tokenizer} tokens but one batch of "
            f"{self._global_rows} rows x (seq_len {self.seq_len} + 1 for the shifted target) needs {need}; give {fixes}"
        )

    def __iter__(self) -> Iterator[tuple[Any, torch.Tensor]]:
        """Batches in the model's format, forever, from where the stream stands.

        A new iterator continues where the last one stopped (or where ``load_state_dict`` put the
        stream); use one iterator at a time.

        Returns:
            An iterator of ``(inputs, target)``: this replica's rows of step i, i = 0, 1, ...
        """
        # iter() on a StatefulDataLoader restarts its epoch unless a state was loaded: load the
        # current one, so that a second iter() continues the stream instead of replaying it.
        self._loader.load_state_dict(self._loader.state_dict())
        while True:
            for inputs, targets in self._loader:
                yield self.format.batch(inputs, targets)
            self._epoch += 1

    def state_dict(self) -> dict[str, Any]:
        """Where the stream stands: the loader's own state, the epoch count and the stream's identity.

        The state is the same on every replica (it counts steps, not rows), so one copy serves all
        of them, and also a resumed run with another number of replicas but the same global batch.

        Returns:
            A dict of plain values (torch.save and JSON both keep it).
        """
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "epoch": self._epoch,
            "loader": self._loader.state_dict(),
            "stream": dict(self._stream_id),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the exact next batch of the stream that saved ``state``.

        Args:
            state: what ``state_dict`` returned.

        Raises:
            DataError: the state is not a text-batches state, or was saved for another training
                stream (corpus, tokenizer, vocabulary, global batch or seq_len differ).
        """
        if (
            not isinstance(state, Mapping)
            or state.get("format") != STATE_FORMAT
            or state.get("version") != STATE_VERSION
        ):
            raise DataError(
                f"the data state is not a {STATE_FORMAT} version {STATE_VERSION} state; resume from a checkpoint "
                "that a --data run wrote"
            )
        if state.get("stream") != self._stream_id:
            saved, now = state.get("stream"), self._stream_id
            changed = [k for k in now if not isinstance(saved, Mapping) or saved.get(k) != now[k]]
            what = {
                "tokens": "the text's training tokens (--data, --tokenizer or --eval-fraction)",
                "global_rows": "the global batch",
                "seq_len": "the sequence length",
            }
            raise DataError(
                f"the checkpoint's data stream is not this one: {', '.join(what.get(k, k) for k in changed)} "
                "changed since it was saved; resume with the same --data, --tokenizer, --eval-fraction and batch "
                "size (and the run's vocab.json)"
            )
        self._epoch = int(state["epoch"])
        self._loader.load_state_dict(dict(state["loader"]))

    def eval_batches(self, max_batches: int | None = None) -> Iterator[tuple[Any, torch.Tensor]]:
        """The held-out split's windows, in order, in the model's format (rows sharded as in training).

        Args:
            max_batches: stop after this many (None: all ``eval_steps`` of them).

        Returns:
            An iterator of ``(inputs, target)``; the same batches on every call.
        """
        count = self.eval_steps if max_batches is None else min(max_batches, self.eval_steps)
        for step in range(count):
            yield self.format.batch(*self._eval[step])

    def describe(self) -> str:
        """One line: corpus, tokenizer, vocabulary (and folded types), train/eval tokens, steps per epoch."""
        files = f" ({self._files} files)" if self._files > 1 else ""
        if self._tokenizer == "byte":
            vocab = "256 byte ids"
        else:
            source = f", read from {self._vocab_from}" if self._vocab_from else ""
            vocab = f"vocabulary {self.vocab_size} ({self.vocab.folded} rarer types folded into <unk>{source})"
        return (
            f"data {self._corpus}{files}: {self._tokenizer} tokens, {vocab}; {self.train_tokens} train / "
            f"{self.eval_tokens} eval tokens; {self.steps_per_epoch} steps per epoch of {self._global_rows} rows x "
            f"{self.seq_len} tokens (rows {self._local_rows.start}-{self._local_rows.stop - 1} here), {self.eval_steps} eval {'batches' if self.eval_steps != 1 else 'batch'}"
        )


__all__ = ["TOKENIZERS", "StepWindows", "TextBatches", "TokenBatchFormat", "batchify", "token_batch_format"]
