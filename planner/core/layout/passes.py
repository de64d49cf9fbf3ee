"""Gradient accumulation in the search: the layouts that run a one-pass layout's step in several
passes (``accumulation_options``) and which of them are worth searching beside it (``retried_passes``).

Pure module: never imports torch. ``planner.core.layout.search`` queues what these return.
"""

from __future__ import annotations

from dataclasses import replace

from planner.core.layout.candidate import Choice
from planner.core.layout.inputs import Layout, SearchSpace
from planner.schema.counts import divisors


def accumulation_options(layout: Layout, space: SearchSpace, min_size: int) -> list[Layout]:
    """The layouts that run the step of one-pass ``layout`` in several passes (``--accumulation auto``).

    With the microbatch count open, the same microbatches (the same size, so the same costs and
    step floor) in k > 1 passes of ``m / k``, each at least one microbatch per pipeline rank; with
    ``--microbatches`` fixed, k passes of that many microbatches, k times smaller (down to
    ``min_size``). None with one pipeline rank (its microbatches already are gradient accumulation:
    more passes only cost time) or a fixed pass count.

    Args:
        layout: a one-pass layout of the search.
        space: what the search covers (the batch, what is fixed).
        min_size: the smallest microbatch allowed.

    Returns:
        The layouts, fewest passes first.
    """
    if space.accumulation is not None or layout.pp == 1 or layout.accumulation != 1:
        return []
    m, replica = layout.n_microbatches, space.batch_size // layout.data_replicas
    if space.n_microbatches is None:
        return [replace(layout, n_microbatches=m // k, accumulation=k) for k in divisors(m)[1:] if m // k >= layout.pp]
    return [
        replace(layout, accumulation=k)
        for k in divisors(replica // m)[1:]
        if replica // (m * k) >= min_size and m * k <= replica
    ]


def one_pass_settles(choice: Choice, asked: Layout) -> bool:
    """Whether the search keeps ``choice``, evaluated for one-pass layout ``asked``, as a one pass that
    fits: it fits in the data-parallel mode asked for, or in DDP where the mode was left open. One that
    fits only under FSDP where DDP was open does not settle: its runs in several passes, in which DDP may
    fit, are searched as for a one pass that does not fit (``retried_passes`` gets no ``choice``).

    Args:
        choice: the one-pass layout as evaluated (its data-parallel mode the one chosen).
        asked: the layout as the search enumerated it (its data-parallel mode possibly "auto").

    Returns:
        True where the one pass settles the question of more passes by itself.
    """
    return choice.fits and (choice.layout.dp_mode == "ddp" or asked.dp_mode != "auto")


def retried_passes(
    layout: Layout, space: SearchSpace, min_size: int, choice: Choice | None, free: float | None, tie: float
) -> tuple[list[Layout], float | None]:
    """The layouts in several passes of one-pass ``layout`` worth searching beside it, and the step
    floor they get (``--accumulation auto``).

    Where the one pass does not fit (``choice`` None), all of ``accumulation_options``, each at its own
    floor. Where it fits, they are worth it only if the memory limit shaped that pass: its step
    without the limit (``free``, ``planner.core.layout.candidate.unlimited_step``) is faster beyond
    ``tie`` (the limit unbalanced its split or made it recompute, which lighter passes may not need).
    None of them is then faster than that unlimited step (each pass pays the pipeline's warm-up and
    drain, and lighter microbatches run no faster per sample), so it is their floor. Where the limit
    did not shape it, one pass is never slower than they are: there are none.

    Args:
        layout: a one-pass layout of the search.
        space: what the search covers (the batch, what is fixed).
        min_size: the smallest microbatch allowed.
        choice: the layout as evaluated, where it fits (None: it does not).
        free: its step without the memory limit (None: not timed, or no split without it either).
        tie: the relative margin within which two steps are equally fast.

    Returns:
        The layouts, fewest passes first, and the floor they get (None: their own).
    """
    options = accumulation_options(layout, space, min_size)
    if choice is None:
        return options, None
    if free is None or free >= choice.prediction.step_time_s * (1 - tie):
        return [], None
    return options, free


def one_pass_of(layout: Layout, other: Layout) -> bool:
    """Whether ``other`` is the one-pass layout that ``layout``, in several passes, was retried from
    (``accumulation_options``: the same layout but for its passes and microbatch count)."""
    if layout.accumulation == 1 or other.accumulation != 1:
        return False
    return replace(other, n_microbatches=layout.n_microbatches, accumulation=layout.accumulation) == layout


__all__ = ["accumulation_options", "one_pass_of", "one_pass_settles", "retried_passes"]
