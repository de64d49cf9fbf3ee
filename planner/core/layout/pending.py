"""The search's queue: layouts waiting to be solved, with the floors their costs alone give, and the
next of them evaluated together where a pool of worker processes is given.

Pure module: never imports torch, nor starts a process (``planner.workers`` does, at the edge).
``planner.core.layout.search`` orders the layouts by their step floor and takes each one's result in
that order; a ``Pool`` only changes where the evaluations run.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from planner.core.layout.bounds import BlockTotals
from planner.core.layout.candidate import Choice, evaluate_modes
from planner.core.layout.inputs import Cluster, Constraints, Layout
from planner.errors import InfeasibleError
from planner.schema.costs import BlockCost


class Pool(Protocol):
    """Runs calls of a pure function in other processes (``planner.workers.SearchPool``, ``planner
    plan --jobs``): each submitted for a ticket, its result taken by that ticket. A layout's
    evaluation depends on its arguments alone, so where and in which order the calls run changes
    nothing the search finds."""

    def width(self) -> int:
        """How many calls are worth keeping submitted ahead now (1: none, each is run here when needed)."""
        ...

    def submit(self, fn: Callable[[Any], Any], arg: object) -> int:
        """Start ``fn(arg)`` when a worker is free; its ticket."""
        ...

    def take(self, ticket: int) -> Any:
        """The result of the call of ``ticket``, once it is done (what it raised, raised)."""
        ...

    def discard(self, tickets: Iterable[int]) -> None:
        """Calls whose results will not be taken: not started where they wait, not kept where they run."""
        ...


@dataclass(frozen=True)
class Pending:
    """A layout not yet solved, with what its costs alone say: a lower bound on its step and on the
    memory its busiest rank needs, whatever the split; with ``totals``, a quick step floor, raised
    to the full one (``planner.core.layout.bounds.floors`` reading the schedule's orders) only when
    the search comes to it."""

    layout: Layout
    blocks: list[BlockCost]
    step_floor_s: float
    memory_floor: int
    totals: BlockTotals | None = None


def evaluated(task: tuple[Sequence[BlockCost], Cluster, Layout, Constraints]) -> Choice | InfeasibleError:
    """``evaluate_modes`` of one layout (blocks, cluster, layout, constraints), its refusal returned
    rather than raised, so that a pool hands it back like a result.

    Args:
        task: ``evaluate_modes``' arguments.

    Returns:
        The evaluated candidate, or why no split of the layout runs.
    """
    try:
        return evaluate_modes(*task)
    except InfeasibleError as e:
        return e


def ahead(
    heap: list[tuple[float, int]],
    pending: Sequence[Pending],
    submitted: dict[int, int],
    limit: int | None,
    bound: float | None,
    width: int,
) -> list[int]:
    """The layouts among the next ``width`` the search will take (the heap's smallest step floors:
    the ``i``-th smallest of a binary heap lies in its first ``2^i - 1`` entries) that it would solve
    and that are not submitted yet: a memory floor within ``limit``, a step floor within ``bound``
    (the slowest that could still tie the best found). A later fit may still rule some of them out:
    they are then evaluated for nothing, never counted.

    Args:
        heap: the search's heap of (step floor, index into ``pending``).
        pending: the layouts.
        submitted: the indices handed to the pool already (their tickets).
        limit: the memory limit (None: none).
        bound: the step floor past which the search stops (None: nothing fits yet).
        width: how far ahead to look.

    Returns:
        Indices into ``pending``, in the search's order.
    """
    if width <= 0:
        return []
    return [
        j
        for _, j in heapq.nsmallest(width, heap[: 2**width - 1])
        if j not in submitted
        and (limit is None or pending[j].memory_floor <= limit)
        and (bound is None or pending[j].step_floor_s <= bound)
    ]


__all__ = ["Pending", "Pool", "ahead", "evaluated"]
