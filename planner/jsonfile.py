"""Writing and reading the planner's JSON documents (plan.json, run.json). Pure: no torch."""

from __future__ import annotations

from pathlib import Path


def write_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, so a failure never leaves half a file.

    Args:
        path: destination file.
        text: the whole content.
    """
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(p)
