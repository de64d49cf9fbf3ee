"""The search's queue: layouts waiting to be solved, with the floors their costs alone give, and the
next of them evaluated together where a pool of worker processes is given.

Pure module: never imports torch, nor starts a process (``planner.workers`` does, at the edge).
``planner.core.layout.search`` orders the layouts by their step floor and takes each one's result in
that order; a ``Pool`` only changes where the evaluations run.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from planner.core.layout.candidate import Choice, evaluate_modes
from planner.core.layout.inputs import Cluster, Constraints, Layout
from planner.errors import InfeasibleError
from planner.schema.costs import BlockCost

A = TypeVar("A")
R = TypeVar("R")


class Pool(Protocol):
    """Runs many calls of one pure function, maybe in other processes (``planner.workers.SearchPool``,
    ``planner plan --jobs``). A layout's evaluation depends on its arguments alone, so where and in
    which order the calls run changes nothing the search finds."""

    def width(self) -> int:
        """How many evaluations are worth handing over at once now (1: each is run here, when needed)."""
        ...

    def map(self, fn: Callable[[A], R], items: Sequence[A]) -> list[R]:
        """``[fn(x) for x in items]``, in order."""
        ...


@dataclass(frozen=True)
class Pending:
    """A layout not yet solved, with what its costs alone say: a lower bound on its step and on the
    memory its busiest rank needs, whatever the split."""

    layout: Layout
    blocks: list[BlockCost]
    step_floor_s: float
    memory_floor: int


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
    ready: dict[int, Choice | InfeasibleError],
    limit: int | None,
    bound: float | None,
    width: int,
) -> list[int]:
    """Up to ``width`` layouts the search would solve next, in its order: the heap's smallest step
    floors (the ``i``-th smallest of a binary heap lies in its first ``2^i - 1`` entries), less those
    evaluated already, with a memory floor over ``limit`` or a step floor over ``bound`` (the
    slowest that could still tie the best found). A later fit may still rule some of them out: they
    are then evaluated for nothing, never counted.

    Args:
        heap: the search's heap of (step floor, index into ``pending``).
        pending: the layouts.
        ready: the results evaluated ahead so far, by index.
        limit: the memory limit (None: none).
        bound: the step floor past which the search stops (None: nothing fits yet).
        width: the most to return.

    Returns:
        Indices into ``pending``, in the search's order.
    """
    if width <= 0:
        return []
    top = heapq.nsmallest(2 * width, heap[: 2 ** (2 * width) - 1])
    keep = [
        j
        for _, j in top
        if j not in ready
        and (limit is None or pending[j].memory_floor <= limit)
        and (bound is None or pending[j].step_floor_s <= bound)
    ]
    return keep[:width]


__all__ = ["Pending", "Pool", "ahead", "evaluated"]
