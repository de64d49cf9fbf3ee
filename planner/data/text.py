"""Reading a text corpus, tokenising it and building the vocabulary (``planner run --data``).

Three tokenizers, as the PyTorch tutorials used them:

* ``char``: one token per character; the vocabulary is the training split's characters, most
  frequent first, ties by code point.
* ``byte``: one token per UTF-8 byte, ids 0..255; no vocabulary to build.
* ``word``: torchtext's ``basic_english`` rules (lower-case, punctuation split off, ``;`` ``:`` and
  double quotes dropped, whitespace split), each line ending in ``<eos>`` as the word-level
  language-model example did; the vocabulary is the training split's words, most frequent first,
  ties alphabetical.

``char`` and ``word`` vocabularies keep ``<unk>`` as id 0 and the ``V - 1`` most frequent entries,
V being the model's vocabulary size; rarer ones (and anything only the eval split holds) read as
``<unk>``. The split is made on the token stream before the vocabulary is built, so the held-out
text never chooses ids. Everything here is deterministic: the same corpus gives the same ids on
every rank and every run.

The heavy loops run in numpy (characters, bytes) or C-level dict and str methods (words), once per
process and linear in the corpus size.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from planner.errors import DataError

TOKENIZERS: tuple[str, ...] = ("char", "byte", "word")
UNK = "<unk>"
EOS = "<eos>"
BYTE_VOCAB = 256
# The repository's own corpus: models/data/shakespeare.txt, two folders above this package.
DEFAULT_CORPUS = Path(__file__).resolve().parents[2] / "models" / "data" / "shakespeare.txt"
VOCAB_FORMAT = "planner-vocab"
VOCAB_VERSION = 1

# torchtext's basic_english rules, in its order (applied after lower-casing). "\s+" -> " " is left
# out: str.split() does that per line, and applying it here would also eat the line breaks.
_BASIC_ENGLISH = [
    (re.compile(pattern), replacement)
    for pattern, replacement in [
        (r"\'", " '  "),
        (r"\"", ""),
        (r"\.", " . "),
        (r"<br \/>", " "),
        (r",", " , "),
        (r"\(", " ( "),
        (r"\)", " ) "),
        (r"\!", " ! "),
        (r"\?", " ? "),
        (r"\;", " "),
        (r"\:", " "),
    ]
]
# Word tokenising runs at about 25 MB/s on one core here: a smaller corpus is done in a couple of
# seconds, before a progress bar would tell anyone anything. Characters and bytes are vectorised.
_PROGRESS_CHARS = 50 << 20
_CHUNK_CHARS = 1 << 20


@dataclass(frozen=True)
class Corpus:
    """A corpus read into memory.

    Attributes:
        name: the path as it is shown in messages.
        files: the files read, in order.
        text: their text, joined (a newline added after a file that does not end in one when
            another file follows).
    """

    name: str
    files: tuple[Path, ...]
    text: str


def corpus_files(path: str | Path | None) -> tuple[str, tuple[Path, ...]]:
    """The files ``--data`` names: one file, or a folder's ``.txt`` files in sorted name order.

    Args:
        path: a file, a folder, or None for the repository's ``models/data/shakespeare.txt``.

    Returns:
        (the name to show, the files).

    Raises:
        DataError: the path does not exist, or a folder holds no ``.txt`` file.
    """
    p = DEFAULT_CORPUS if path is None else Path(path)
    name = str(p)
    if p.is_dir():
        files = tuple(sorted((f for f in p.iterdir() if f.suffix == ".txt" and f.is_file()), key=lambda f: f.name))
        if not files:
            raise DataError(
                f"--data {name}: the folder holds no .txt files; put the corpus in files ending in .txt "
                "(read in sorted name order) or give one text file"
            )
        return name, files
    if not p.is_file():
        raise DataError(f"--data {name}: no such file or folder; give a UTF-8 text file or a folder of .txt files")
    return name, (p,)


def _decode(raw: bytes, path: Path) -> str:
    """UTF-8 text of one file; a byte that is not UTF-8 is named by its offset."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"--data {path}: not UTF-8 text: byte 0x{raw[e.start]:02x} at byte offset {e.start} ({e.reason}); "
            "convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        ) from None


def read_corpus(path: str | Path | None) -> Corpus:
    """Read a corpus (see ``corpus_files``) as one text.

    Args:
        path: a file, a folder of ``.txt`` files, or None for the default corpus.

    Returns:
        The corpus.

    Raises:
        DataError: a missing path, a folder without ``.txt`` files, a file that cannot be read or
            is not UTF-8, or a corpus with no text at all.
    """
    name, files = corpus_files(path)
    parts: list[str] = []
    for f in files:
        try:
            raw = f.read_bytes()
        except OSError as e:
            raise DataError(
                f"--data {f}: cannot read it ({e.strerror or e}); check the path and its permissions"
            ) from e
        text = _decode(raw, f)
        # Files are joined as lines: one file's last line must not run into the next file's first.
        if parts and parts[-1] and not parts[-1].endswith("\n"):
            parts[-1] += "\n"
        parts.append(text)
    text = "".join(parts)  # one join: linear in the corpus size
    if not text:
        what = "the file is empty" if len(files) == 1 and Path(name) == files[0] else "all its .txt files are empty"
        raise DataError(f"--data {name}: {what}; give a corpus with some text")
    return Corpus(name=name, files=files, text=text)


@dataclass(frozen=True)
class Vocab:
    """A tokenizer's id table.

    Attributes:
        tokenizer: one of ``TOKENIZERS``.
        tokens: id -> token for ``char`` and ``word`` (``tokens[0]`` is ``<unk>``); empty for
            ``byte``, whose ids are the byte values.
        folded: how many token types of the training split did not fit the model's vocabulary
            and read as ``<unk>``.
    """

    tokenizer: str
    tokens: tuple[str, ...]
    folded: int = 0

    @property
    def size(self) -> int:
        """Number of ids: every id is below it."""
        return BYTE_VOCAB if self.tokenizer == "byte" else len(self.tokens)

    def save(self, path: str | Path) -> None:
        """Write the vocabulary as JSON, atomically (a temporary file renamed over ``path``).

        Several ranks may write the same file at once: each renames its own complete temporary
        file, and all of them hold the same text, so readers never see half a file.

        Args:
            path: destination (its folder is created if missing).

        Raises:
            DataError: the file cannot be written.
        """
        doc = {
            "format": VOCAB_FORMAT,
            "version": VOCAB_VERSION,
            "tokenizer": self.tokenizer,
            "size": self.size,
            "folded": self.folded,
            "tokens": list(self.tokens),
        }
        _write_atomic(Path(path), json.dumps(doc, ensure_ascii=False, indent=0) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Vocab:
        """Read a vocabulary that ``save`` wrote.

        Args:
            path: the JSON file.

        Returns:
            The vocabulary.

        Raises:
            DataError: the file cannot be read or is not a vocabulary of this format.
        """
        fix = "delete it to build the vocabulary again from the corpus, or give the vocab.json of the run"
        try:
            doc = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise DataError(f"vocabulary file {path}: cannot read it as JSON ({e}); {fix}") from e
        if not isinstance(doc, dict) or doc.get("format") != VOCAB_FORMAT or doc.get("version") != VOCAB_VERSION:
            raise DataError(f"vocabulary file {path}: not a {VOCAB_FORMAT} version {VOCAB_VERSION} document; {fix}")
        tokenizer, tokens, folded = doc.get("tokenizer"), doc.get("tokens"), doc.get("folded", 0)
        if tokenizer not in TOKENIZERS or not isinstance(tokens, list) or not isinstance(folded, int):
            raise DataError(f"vocabulary file {path}: bad tokenizer, tokens or folded field; {fix}")
        if tokenizer != "byte" and not _valid_tokens(tokenizer, tokens):
            raise DataError(
                f"vocabulary file {path}: its tokens must be distinct strings starting with {UNK!r}"
                f"{' and single characters' if tokenizer == 'char' else ''}; {fix}"
            )
        return cls(tokenizer=tokenizer, tokens=tuple(tokens) if tokenizer != "byte" else (), folded=folded)


def _valid_tokens(tokenizer: str, tokens: list[Any]) -> bool:
    if not tokens or tokens[0] != UNK or not all(isinstance(t, str) for t in tokens):
        return False
    if tokenizer == "char" and not all(len(t) == 1 for t in tokens[1:]):
        return False
    return len(set(tokens)) == len(tokens)


def _write_atomic(path: Path, text: str) -> None:
    """Write ``text`` through a uniquely named temporary file in the same folder, then rename it."""
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600 files; a vocabulary is no secret
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        raise DataError(
            f"vocabulary file {path}: cannot write it ({e.strerror or e}); give a writable checkpoint folder"
        ) from e
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def check_tokenizer(tokenizer: str, vocab_size: int) -> None:
    """Refuse a tokenizer name that does not exist or does not fit the model's vocabulary.

    Args:
        tokenizer: the ``--tokenizer`` value.
        vocab_size: the model's vocabulary size V (its output's last dimension).

    Raises:
        DataError: an unknown tokenizer, V < 2, or ``byte`` with V < 256.
    """
    if tokenizer not in TOKENIZERS:
        raise DataError(f"--tokenizer {tokenizer!r}: not a tokenizer; expected one of {', '.join(TOKENIZERS)}")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
        raise DataError(
            f"vocabulary size {vocab_size!r}: expected an integer of at least 2 (<unk> and one token); "
            "pass the model's output size (the logits' last dimension)"
        )
    if tokenizer == "byte" and vocab_size < BYTE_VOCAB:
        raise DataError(
            f"--tokenizer byte needs a model vocabulary of at least {BYTE_VOCAB} (one id per byte value) but the "
            f"model's is {vocab_size}; use --tokenizer char or word, or a model with a larger vocabulary"
        )


def split_point(n_tokens: int, eval_fraction: float) -> int:
    """How many tokens train: the last ``floor(n_tokens * eval_fraction)`` are held out.

    Args:
        n_tokens: length of the whole token stream.
        eval_fraction: the share held out, in (0, 1).

    Returns:
        The number of training tokens (the first ones).
    """
    # rounded first: 100 * 0.29 is 28.999999999999996 in floating point, and the split must say 29
    return n_tokens - math.floor(round(n_tokens * eval_fraction, 9))


def _normalise(text: str) -> str:
    text = text.lower()
    for pattern, replacement in _BASIC_ENGLISH:
        text = pattern.sub(replacement, text)
    return text


def _line_chunks(text: str) -> Iterator[str]:
    """The text in pieces of about ``_CHUNK_CHARS`` that end at a line break (so no line is cut)."""
    start = 0
    while start < len(text):
        end = text.find("\n", min(start + _CHUNK_CHARS, len(text)))
        end = len(text) if end < 0 else end + 1
        yield text[start:end]
        start = end


def _word_stream(text: str) -> tuple[list[str], np.ndarray]:
    """Tokenise into words with ``<eos>`` after every line (blank ones too).

    Returns:
        (the distinct words in first-seen order, each token's index in that list). Indexing as
        we go keeps memory at 4 bytes per token instead of one string object per token.
    """
    index: defaultdict[str, int] = defaultdict()
    index.default_factory = index.__len__  # a new word gets the next index, in C
    pieces: list[np.ndarray] = []
    # disable=None: a bar for a large corpus, and only on a terminal (not in a captured log)
    small = len(text) < _PROGRESS_CHARS
    with tqdm(total=len(text), desc="tokenising", unit="char", unit_scale=True, disable=True if small else None) as bar:
        for chunk in _line_chunks(text):
            words: list[str] = []
            # Lines as str.splitlines sees them; the rules act on characters, never across lines.
            for line in _normalise(chunk).splitlines():
                words.extend(line.split())
                words.append(EOS)
            pieces.append(np.fromiter(map(index.__getitem__, words), dtype=np.int32, count=len(words)))
            bar.update(len(chunk))
    return list(index), np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)


def _ranked_vocab(tokenizer: str, types: list[str], counts: np.ndarray, vocab_size: int) -> Vocab:
    """``<unk>`` then the ``vocab_size - 1`` most frequent types with a training count, ties by string."""
    seen = [(-int(c), t) for t, c in zip(types, counts) if c > 0 and t != UNK]
    seen.sort()  # most frequent first; equal counts in code-point order (alphabetical)
    kept = [t for _, t in seen[: vocab_size - 1]]
    return Vocab(tokenizer=tokenizer, tokens=(UNK, *kept), folded=len(seen) - len(kept))


def _char_ids(text: str, eval_fraction: float, vocab_size: int, vocab: Vocab | None) -> tuple[np.ndarray, Vocab]:
    points = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")  # one code point per character
    if vocab is None:
        counts = np.bincount(points[: split_point(len(points), eval_fraction)])
        present = np.flatnonzero(counts)
        vocab = _ranked_vocab("char", [chr(c) for c in present], counts[present], vocab_size)
    codes = np.array([ord(t) for t in vocab.tokens[1:]], dtype=np.int64)
    lookup = np.zeros(max(int(points.max()), int(codes.max(initial=0))) + 1, dtype=np.int32)
    lookup[codes] = np.arange(1, len(codes) + 1, dtype=np.int32)  # every other code point stays <unk> = 0
    return lookup[points], vocab


def _word_ids(text: str, eval_fraction: float, vocab_size: int, vocab: Vocab | None) -> tuple[np.ndarray, Vocab]:
    types, stream = _word_stream(text)
    if vocab is None:
        counts = np.bincount(stream[: split_point(len(stream), eval_fraction)], minlength=len(types))
        vocab = _ranked_vocab("word", types, counts, vocab_size)
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    lookup = np.array([ids.get(t, 0) for t in types], dtype=np.int32)
    return lookup[stream], vocab


def encode(
    text: str, tokenizer: str, vocab_size: int, eval_fraction: float, vocab: Vocab | None = None
) -> tuple[np.ndarray, Vocab]:
    """Tokenise a whole corpus into ids, building the vocabulary from its training split.

    Args:
        text: the corpus.
        tokenizer: one of ``TOKENIZERS``.
        vocab_size: the model's vocabulary size V: a hard cap on the ids.
        eval_fraction: the share of the token stream held out (its end); the vocabulary is built
            from the rest only.
        vocab: a vocabulary to use instead of building one (a resumed run's ``vocab.json``).

    Returns:
        (the ids of every token, int32, all below ``vocab.size``; the vocabulary used).

    Raises:
        DataError: an unknown tokenizer, V too small for it, or a given vocabulary of another
            tokenizer or larger than V.
    """
    check_tokenizer(tokenizer, vocab_size)
    if vocab is not None and vocab.tokenizer != tokenizer:
        raise DataError(
            f"the vocabulary file is for --tokenizer {vocab.tokenizer}, not {tokenizer}; use --tokenizer "
            f"{vocab.tokenizer} to resume with it, or start a run in a new checkpoint folder"
        )
    if vocab is not None and vocab.size > vocab_size:
        raise DataError(
            f"the vocabulary file has {vocab.size} ids but the model's vocabulary is {vocab_size}; "
            "resume with the model the vocabulary was built for, or start a run in a new checkpoint folder"
        )
    if tokenizer == "byte":
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32), Vocab("byte", ())

    if tokenizer == "char":
        return _char_ids(text, eval_fraction, vocab_size, vocab)
    return _word_ids(text, eval_fraction, vocab_size, vocab)
