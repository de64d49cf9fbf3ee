"""Writing and reading the planner's JSON documents (plan.json, run.json). Pure: no torch."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, TypeVar

from pydantic import BaseModel, ValidationError

from planner.errors import PlanFileError
from planner.schema.outputs import document_kind, looks_like_python, unsafe_target

M = TypeVar("M", bound=BaseModel)


def _umask() -> int:
    """The process's umask, read without changing it where the system allows."""
    try:  # Linux ≥ 4.7: reading it here leaves no window in which other threads see another umask
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _new_mode(path: Path) -> int:
    """Permissions for the file about to replace ``path``: the old file's, or what a plain open would give.

    ``mkstemp`` creates 0600 files; without this a plan would become unreadable to the group.
    """
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return 0o666 & ~_umask()


def _sync_folder(folder: Path) -> None:
    """Make the rename itself durable; best effort (some file systems cannot fsync a folder)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_atomic(path: str | Path, content: str | bytes | Callable[[BinaryIO], None], option: str = "-o") -> None:
    """Write ``content`` to ``path`` through a temporary file, so a failure never leaves half a file.

    The text goes to a uniquely named temporary file in the same folder (``.NAME.XXXX.tmp``), is
    fsynced, then renamed over ``path``: readers see the old file or the new one, never a mix. On
    any failure, an interrupt included, the temporary file is removed and the old file is intact.
    A symbolic link or anything that is not a regular file (a folder, ``/dev/null``, a fifo) is
    refused, even when the caller did not run ``outputs.check_output`` first.

    Args:
        path: destination file.
        content: the whole text (written as UTF-8), the whole bytes (a rank's failure record), or
            a function that writes the bytes to the open binary file it is given (a picture's
            renderer).
        option: the command-line option that named ``path``, for messages.

    Raises:
        PlanFileError: the destination is a link or not a regular file, or the file cannot be
            written (missing folder, no permission, disk full).
    """
    p = Path(path)
    reason = unsafe_target(p)
    if reason is not None:
        raise PlanFileError(f"cannot write {path}: it {reason}; choose a writable path with {option}")
    tmp: str | None = None
    try:
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), _new_mode(p))
            if isinstance(content, str):
                f.write(content.encode("utf-8"))
            elif isinstance(content, bytes):
                f.write(content)
            else:
                content(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
        tmp = None  # renamed: nothing left to clean up
    except BaseException as e:  # an interrupt too: never leave a temporary file behind
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if isinstance(e, OSError):
            raise PlanFileError(f"cannot write {path}: {e.strerror or e}; choose a writable path with {option}") from e
        raise
    _sync_folder(p.parent)


def _other_document(raw: dict[str, object], source: str, what: str, fix: str) -> str:
    """Why ``raw`` is recognisably not a ``what``, with the fix: another of the planner's documents (a
    run result given to `planner run`), or a Hugging Face model config ("format version None" said
    nothing of either). Empty when it may be a ``what`` of another version or a damaged one."""
    kind = document_kind(raw)
    if kind is not None and kind != what:
        return f"{source} is a {kind}, not a {what}; {fix}"
    if "version" not in raw and ("architectures" in raw or "model_type" in raw):
        return f"{source} is a Hugging Face model config, not a {what}; plan it first: planner plan {source} --gpus N"
    return ""


def parse_versioned(text: str, model: type[M], version: int, source: str, what: str, fix: str) -> M:
    """Parse a versioned JSON document into a pydantic model, with one-line errors.

    Args:
        text: the JSON text.
        model: the pydantic class to validate with.
        version: the ``version`` field this planner reads.
        source: where the text came from (a path), for messages.
        what: what the document is ("plan", "run result", "calibration"), for messages.
        fix: how to make a good one, appended to every message.

    Returns:
        The validated document.

    Raises:
        PlanFileError: not JSON (or nested too deeply, or an integer too long, to read), another
            version, or invalid — naming the first problem.
    """
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        if looks_like_python(Path(source).name, text):  # `planner run model.py`: the file comes before its plan
            raise PlanFileError(
                f"{source} is a Python file (a model file?), not a {what}; a model file is planned first: "
                f"planner plan {source} --gpus N -o plan.json"
            ) from e
        raise PlanFileError(f"{source} is not JSON ({e}); {fix}") from e
    except RecursionError as e:  # json's decoder recurses once per nesting level
        raise PlanFileError(f"{source} is not a {what}: its JSON is nested too deeply to read; {fix}") from e
    except ValueError as e:  # int() refuses integers past sys.get_int_max_str_digits() (4300 by default)
        digits = sys.get_int_max_str_digits()
        raise PlanFileError(f"{source} is not a {what}: it holds an integer of more than {digits} digits; {fix}") from e
    if not isinstance(raw, dict):
        raise PlanFileError(f"{source} is not a {what} (expected a JSON object); {fix}")
    other = _other_document(raw, source, what, fix)
    if other:
        raise PlanFileError(other)
    if raw.get("version") != version:
        raise PlanFileError(
            f"{source} is {what} format version {raw.get('version')!r}; this planner reads version {version}; {fix}"
        )
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        # A key from the file may hold a line break: quote such keys so the message stays one line.
        where = ".".join(str(p) if str(p).isprintable() else repr(p) for p in first["loc"]) or "(top level)"
        raise PlanFileError(
            f"{source} is not a valid {what}: {where}: {first['msg']} ({e.error_count()} problem(s)); {fix}"
        ) from e


def read_text(path: str | Path, what: str, fix: str) -> str:
    """Read a document, turning a missing or unreadable file into a one-line PlanFileError.

    Args:
        path: the file.
        what: what the document is, for the message.
        fix: how to make one, appended to the message.

    Returns:
        The file's text.

    Raises:
        PlanFileError: the file cannot be read, or is not UTF-8 text.
    """
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise PlanFileError(f"cannot read {what} {path}: {e.strerror}; {fix}") from e
    except UnicodeDecodeError as e:  # the planner writes UTF-8: this is not one of its documents
        raise PlanFileError(
            f"{path} is not a {what}: byte {e.start} is not UTF-8 text ({e.object[e.start : e.start + 1]!r}); {fix}"
        ) from e
    except ValueError as e:  # a NUL character in the path: the OS cannot even look it up
        raise PlanFileError(f"cannot read {what} {path!r}: {e}; {fix}") from e
