"""Option values that pass a type check but cannot work: refused with the user's value in its units. Pure.

(``too_few_blocks`` words the same kind of refusal where the model is needed to know it: more pipeline
ranks than the model has blocks.)

``--memory-limit`` is in GiB: 1e-12 GiB is under one byte, so the search would divide by a zero-byte
limit, and 1e30 GiB is no device's. ``--timeout`` bounds every wait on another rank: under a few
seconds a healthy rank that joins the group late, saves a checkpoint or runs its memory-tracked step
is taken for a hung one. Each is a pydantic before-validator (``MemoryLimitGiB``, ``TimeoutSeconds``)
on the request's field, so the command line, a config file and the Python API are refused alike,
before anything is profiled or started; values of the wrong type or not finite are left to the
field's own checks.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import AllowInfNan, BeforeValidator

MAX_MEMORY_LIMIT_GIB = 2**30
"""An exbibyte: far past any device, and keeps the limit a finite byte count (``int(gib * 2**30)``)."""
MIN_TIMEOUT_S = 5.0
"""The shortest ``--timeout`` that lets a healthy run through: the ranks join the process group as the
forkserver starts them one by one, and a rank's first step, its memory-tracked step or a checkpoint
save keeps the next rank waiting a second or more on a busy machine (a tiny GPT's tracked step took
0.9-1.2 s on 2 CPU cores)."""


def _number(value: Any) -> float | None:
    """``value`` as a finite float when it is a number (or the text of one), else None."""
    if isinstance(value, bool):
        return None
    try:
        number = float(value.strip()) if isinstance(value, str) else float(value)
    except (TypeError, ValueError, OverflowError):  # not a number, or an integer past a float
        return None
    return number if math.isfinite(number) else None


def check_memory_limit_gib(value: Any) -> Any:
    """Refuse a ``--memory-limit`` under one byte or past an exbibyte; return any other value unchanged.

    Args:
        value: the limit in GiB, as given.

    Returns:
        ``value`` (the field's own checks then run on it).

    Raises:
        ValueError: a positive limit that rounds to 0 bytes, or one over ``MAX_MEMORY_LIMIT_GIB``.
    """
    gib = _number(value)
    if gib is None or gib <= 0:  # zero, negative, nan or not a number: the field's own message
        return value
    if gib > MAX_MEMORY_LIMIT_GIB:  # first: past 2**994 GiB the byte count is no float (int() overflows)
        raise ValueError(
            f"{gib:g} GiB is past any device (at most {MAX_MEMORY_LIMIT_GIB} GiB, an exbibyte); "
            "give the per-rank limit in GiB, e.g. --memory-limit 80, or leave it out for the GPU's memory"
        )
    if gib * 2**30 < 1:
        raise ValueError(
            f"{gib:g} GiB is {gib * 2**30:.2g} bytes, under one byte (the limit is in GiB); "
            "give the per-rank limit in GiB, e.g. --memory-limit 80 for 80 GiB"
        )
    return value


def check_timeout_s(value: Any) -> Any:
    """Refuse a positive ``--timeout`` under ``MIN_TIMEOUT_S``; return any other value unchanged.

    Args:
        value: the timeout in seconds, as given.

    Returns:
        ``value`` (the field's own checks then run on it).

    Raises:
        ValueError: a timeout too short for a healthy run.
    """
    seconds = _number(value)
    if seconds is not None and 0 < seconds < MIN_TIMEOUT_S:
        raise ValueError(
            f"{seconds:g} s is too short to tell a hung rank from a busy one (joining the group, a checkpoint "
            "save or a memory-tracked step keeps another rank waiting a second or more); "
            f"give --timeout {MIN_TIMEOUT_S:g} or more (default 300)"
        )
    return value


MemoryLimitGiB = Annotated[float, AllowInfNan(False), BeforeValidator(check_memory_limit_gib)]
"""``PlanRequest.memory_limit_gib``'s type: a float in GiB, a value under one byte or past an exbibyte refused."""
TimeoutSeconds = Annotated[float, AllowInfNan(False), BeforeValidator(check_timeout_s)]
"""``RunRequest.timeout_s``'s type: a float in seconds, one under ``MIN_TIMEOUT_S`` refused."""


def too_few_blocks(gpus: int, tp: int | str, dp: int | str, pp: int, names: list[str]) -> str:
    """Why a model of ``names`` blocks cannot fill ``pp`` pipeline ranks, in the user's own options.

    The message names the ``--gpus`` the user typed (not the pipeline ranks left after tensor
    parallelism and replicas, which it once called "--gpus 8" for --gpus 16 --tp 2), and the most
    GPUs that fit: one block per pipeline rank times the ranks beside each (tp x replicas, the
    replicas the batch allows where --dp is searched).

    Args:
        gpus: ``--gpus``.
        tp: ``--tp`` (a degree or "auto").
        dp: ``--dp`` (a count or "auto").
        pp: the fewest pipeline ranks any mesh tried leaves.
        names: the model's block names.

    Returns:
        The message.
    """
    shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
    beside = gpus // pp  # tensor-parallel ranks x replicas on each pipeline rank
    if beside == 1:
        return f"--gpus {gpus}: the model has only {len(names)} blocks ({shown}); use at most {len(names)}"
    given = f"--gpus {gpus}" + (f" --tp {tp}" if tp not in (1, "auto") else "") + (f" --dp {dp}" if dp != 1 else "")
    return (
        f"{given}: {pp} pipeline ranks of {beside} GPUs each (tensor-parallel ranks x replicas), but the model has "
        f"only {len(names)} blocks ({shown}); use at most --gpus {len(names) * beside}"
    )
