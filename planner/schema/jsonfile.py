"""Writing and reading the planner's JSON documents (plan.json, run.json). Pure: no torch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from planner.errors import PlanFileError

M = TypeVar("M", bound=BaseModel)


def write_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, so a failure never leaves half a file.

    Args:
        path: destination file.
        text: the whole content.

    Raises:
        PlanFileError: the file cannot be written (missing folder, no permission, disk full).
    """
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    try:
        tmp.write_text(text)
        tmp.replace(p)
    except OSError as e:
        raise PlanFileError(f"cannot write {path}: {e.strerror}; choose a writable path with -o") from e


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
        PlanFileError: not JSON, another version, or invalid — naming the first problem.
    """
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanFileError(f"{source} is not JSON ({e}); {fix}") from e
    if not isinstance(raw, dict):
        raise PlanFileError(f"{source} is not a {what} (expected a JSON object); {fix}")
    if raw.get("version") != version:
        raise PlanFileError(
            f"{source} is {what} format version {raw.get('version')!r}; this planner reads version {version}; {fix}"
        )
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
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
        PlanFileError: the file cannot be read.
    """
    try:
        return Path(path).read_text()
    except OSError as e:
        raise PlanFileError(f"cannot read {what} {path}: {e.strerror}; {fix}") from e
