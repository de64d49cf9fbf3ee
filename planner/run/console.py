"""What a run prints: lines flushed at once (the ranks and the launcher share one terminal) and
the progress line of every step.
"""

from __future__ import annotations


def print_flushed(line: str) -> None:
    """Print ``line`` and flush it: worker processes and the launcher write to the same terminal.

    Args:
        line: the text, without a newline.
    """
    print(line, flush=True)


def step_line(step: int, steps: int, loss: float, seconds: float, note: str = "") -> str:
    """The progress line printed after every step.

    Args:
        step: the 1-based step.
        steps: the run's steps (sets the width of the counter).
        loss: the step's mean microbatch loss.
        seconds: the step's wall time.
        note: why the step's time is untypical ("" when it is not).

    Returns:
        e.g. ``step  2/20  loss 4.0069  12.3 ms``.
    """
    width = len(str(steps))
    return f"step {step:>{width}}/{steps}  loss {loss:.4f}  {seconds * 1e3:.1f} ms" + (f"  ({note})" if note else "")


def step_note(step: int, memory_step: int | None) -> str:
    """Why a step's time is not typical: the first sets the schedule up, one runs under MemTracker.

    Args:
        step: the 1-based step.
        memory_step: the memory-tracked step (None: none).

    Returns:
        The note for ``step_line`` ("" for a typical step).
    """
    if step == memory_step:
        return "memory tracked, not timed"
    if step == 1:
        return "set-up, not timed"
    return ""
