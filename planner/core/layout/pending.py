"""The search's queue: layouts waiting to be solved, with the floors their costs alone give, and the
next of them evaluated together where a pool of worker processes is given.

Pure module: never imports torch, nor starts a process (``planner.workers`` does, at the edge).
``planner.core.layout.search`` orders the layouts by their step floor and takes each one's result in
that order; a ``Pool`` only changes where the evaluations run.
"""

from __future__ import annotations

import heapq
import pickle
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from planner.core.layout.bounds import BlockTotals, block_totals, floors
from planner.core.layout.candidate import Choice, Outpaced, evaluate_modes, rank_blocks, unlimited_step
from planner.core.layout.fsdp_bounds import FsdpFloor, fsdp_traffic
from planner.core.layout.inputs import Cluster, Constraints, Layout, Scaling, SearchSpace
from planner.core.layout.passes import one_pass_settles
from planner.core.step.schedules import LIVE_CLOSED_FORMS, ZERO_BUBBLE
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


class Parcel:
    """A list of block costs as a task carries it to a worker process: pickled once, however many
    tasks carry it (a search hands out thousands of layouts over a few dozen lists of ~100 KB each,
    and pickling them was a tenth of the search process's own time); the worker unpickles the list.

    Args:
        blocks: the list.
    """

    def __init__(self, blocks: list[BlockCost]) -> None:
        self.blocks = blocks
        self._data: bytes | None = None

    def __reduce__(self) -> tuple[Callable[[bytes], Any], tuple[bytes]]:
        if self._data is None:
            self._data = pickle.dumps(self.blocks, protocol=pickle.HIGHEST_PROTOCOL)
        return pickle.loads, (self._data,)


@dataclass(frozen=True)
class Pending:
    """A layout not yet solved, with what its costs alone say: a lower bound on its step and on the
    memory its busiest rank needs, whatever the split; with ``totals``, a quick step floor, raised
    to the full one (``planner.core.layout.bounds.floors`` reading the schedule's orders) only when
    the search comes to it (with ``traffic``, the FSDP collectives' floor it took)."""

    layout: Layout
    blocks: list[BlockCost]
    step_floor_s: float
    memory_floor: int
    totals: BlockTotals | None = None
    traffic: Mapping[str, FsdpFloor] | None = None
    parcel: Parcel | None = None  # ``blocks`` as a worker's task carries them (None: as they are)


def pending_layout(
    blocks: Sequence[BlockCost],
    cluster: Cluster,
    layout: Layout,
    space: SearchSpace,
    scaling: Scaling,
    constraints: Constraints,
    cache: dict[tuple[float, int, bool, int, int, str], Sized],
) -> Pending:
    """``layout`` with its costs at its microbatch size (kept in ``cache``) and its floors.

    Args:
        blocks: per-block costs at microbatch size ``scaling.size0``.
        cluster: the links and the ranks that compute at once.
        layout: the layout.
        space: the batch.
        scaling: how the costs carry over to other microbatch sizes.
        constraints: the optimizer, the memory limit and the recompute policy.
        cache: the costs by a rank's share of a microbatch, degree, sequence split, expert and
            context-parallel degree, added to.

    Returns:
        The pending layout.
    """
    size = layout.rank_share(space.batch_size)
    # (loss parallelism needs no place in it: one search runs it at every tp > 1 with cp 1)
    key = (size, layout.tp, layout.sequence, layout.ep, layout.cp, layout.cp_attention)
    if key not in cache:
        shares = rank_blocks(blocks, layout, cluster.link, scaling, space.batch_size)
        # FSDP's collectives read the parameters alone, the same at every microbatch size: their
        # floors are shared by the costs of one degree, sequence split and expert degree
        alike = next((entry for k, entry in cache.items() if k[1:] == key[1:]), None)
        cache[key] = Sized(shares, traffic=alike.traffic if alike is not None else {}, parcel=Parcel(shares))
    entry = cache[key]
    sums = layout.schedule in ZERO_BUBBLE, layout.gather_bytes  # (whether the backward is split, width)
    if sums not in entry.totals:  # the floors' sums over 1,000 blocks: once per costs, not per layout
        entry.totals[sums] = block_totals(entry.blocks, *sums, constraints.optimizer)
    mesh = (layout.pp, layout.dp, layout.dp_shard, layout.dp_mode, layout.gather_bytes)
    if mesh not in entry.traffic:  # FSDP's collectives on these ranks: once per replica layout and degrees
        entry.traffic[mesh] = fsdp_traffic(entry.blocks, cluster.link, layout, cluster.slots)
    traffic = entry.traffic[mesh]
    # the quick floor: where the schedule's live microbatches have no closed form, its orders are
    # built only for the layouts the search comes to (``full_floor``), a few of thousands
    step, memory = floors(
        entry.blocks,
        layout,
        constraints.optimizer,
        entry.totals[sums],
        limit=constraints.memory_limit_bytes,
        recompute=constraints.recompute,
        read_orders=False,
        traffic=traffic,
    )
    quick = constraints.memory_limit_bytes is not None and layout.schedule not in LIVE_CLOSED_FORMS
    return Pending(layout, entry.blocks, step, memory, entry.totals[sums] if quick else None, traffic, entry.parcel)


def ring_dominates(gathered: Pending, ring: Pending) -> bool:
    """Whether a context-parallel layout by ring attention costs no more time than by the all-gather in
    any block (its sends all hidden behind attention, say): it keeps less for backward, so the
    all-gather's layout cannot be the faster that fits, and the search leaves it out.

    Args:
        gathered: the layout by the all-gather.
        ring: the same layout by ring attention.

    Returns:
        Whether ring attention is at least as fast in every block's forward, backward and recomputation.
    """
    return all(
        r.fwd_s <= g.fwd_s and r.bwd_s <= g.bwd_s and (r.recompute_s or 0.0) <= (g.recompute_s or 0.0)
        for r, g in zip(ring.blocks, gathered.blocks, strict=True)
    )


def full_floor(item: Pending, constraints: Constraints) -> Pending:
    """``item`` with its full step floor (``floors`` reading the schedule's orders), no longer quick.

    Args:
        item: a layout with a quick floor (``totals`` kept).
        constraints: the memory limit and the recompute policy it was floored under.

    Returns:
        The layout with its full floor.
    """
    assert item.totals is not None
    step, _ = floors(
        item.blocks,
        item.layout,
        constraints.optimizer,
        item.totals,
        limit=constraints.memory_limit_bytes,
        recompute=constraints.recompute,
        traffic=item.traffic,
    )
    return replace(item, step_floor_s=max(step, item.step_floor_s), totals=None)


@dataclass
class Sized:
    """Block costs at one microbatch size, tensor-parallel degree, sequence split and expert degree,
    the sums their floors take (by whether the schedule splits its backward, and the gathered width)
    and FSDP's collectives' floors (by pipeline ranks, replicas, shard groups, mode and gathered dtype)."""

    blocks: list[BlockCost]
    totals: dict[tuple[bool, int], BlockTotals] = field(default_factory=dict)
    traffic: dict[tuple[int, int, int, str, int], dict[str, FsdpFloor]] = field(default_factory=dict)
    parcel: Parcel | None = None  # ``blocks`` as the workers' tasks carry them


Task = tuple[Sequence[BlockCost], Cluster, Layout, Constraints, bool, float | None]
"""``evaluated``'s task: ``evaluate_modes``' arguments, whether to time the layout without the limit
too, and ``evaluate_modes``' bound."""


def evaluated(task: Task) -> tuple[Choice | InfeasibleError | Outpaced, float | None]:
    """``evaluate_modes`` of one layout (blocks, cluster, layout, constraints, and the step it must
    beat to matter, the task's last item), its refusal or its deferral returned rather than raised,
    so that a pool hands it back like a result; and where asked (the task's fifth item) and it
    settles as a one pass that fits (``one_pass_settles``: where the search reads it), its step
    without the memory limit (``unlimited_step``: whether its runs in several passes are worth
    searching), computed here so that a pool's workers do it beside the rest.

    Args:
        task: ``evaluate_modes``' arguments, whether to time the layout without the limit too, and
            ``evaluate_modes``' ``bound`` (None: none).

    Returns:
        The evaluated candidate, why no split of the layout runs, or that it cannot beat the bound
        (``Outpaced``: the least step it could still take); and its unlimited step (None where not
        asked, or as ``unlimited_step`` says).
    """
    blocks, cluster, layout, constraints, unlimited, bound = task
    try:
        choice = evaluate_modes(blocks, cluster, layout, constraints, bound)
    except (InfeasibleError, Outpaced) as e:
        return e, None
    settled = unlimited and one_pass_settles(choice, layout)
    return choice, unlimited_step(blocks, cluster, choice, constraints) if settled else None


def evaluated_apart(task: Task) -> tuple[Choice | InfeasibleError | Outpaced, float | None]:
    """``evaluated`` in a worker process: a choice whose blocks are the task's own (no data-parallel
    mode or compilation derived others from them, as DDP's are) comes back without them, which the
    search then puts back (``taken``): they are most of its bytes, and the search's own process
    unpickles every answer."""
    got, free = evaluated(task)
    given = task[0]
    if isinstance(got, Choice) and len(got.blocks) == len(given) and all(a is b for a, b in zip(got.blocks, given)):
        got = replace(got, blocks=[])
    return got, free


def taken(
    k: int,
    pending: Sequence[Pending],
    heap: list[tuple[float, int]],
    submitted: dict[int, int],
    task: Callable[[Pending, float | None], Task],
    pool: Pool | None,
    limit: int | None,
    bound: float | None,
) -> tuple[Choice | InfeasibleError | Outpaced, float | None]:
    """Layout ``k``'s ``evaluated``: here, without a pool (or one of one worker that has not been
    handed it); else by the pool, which is first handed it (unless it has it already) and the
    layouts next in line that the search would solve (``ahead``), so that its workers stay busy.

    Args:
        k: the layout's index into ``pending``.
        pending: the layouts.
        heap: the search's heap of (step floor, index into ``pending``).
        submitted: the indices handed to the pool already (their tickets), ``k``'s taken out.
        task: ``evaluated``'s task of a layout under a bound.
        pool: the worker processes (None: none).
        limit: the memory limit (None: none).
        bound: the step floor past which the search stops (None: nothing fits yet), each task's.

    Returns:
        What ``evaluated`` returns for layout ``k``.
    """
    width = pool.width() if pool is not None else 1
    if pool is None or (width <= 1 and k not in submitted):
        return evaluated(task(pending[k], bound))
    for j in [k] * (k not in submitted) + ahead(heap, pending, submitted, limit, bound, width - 1):
        blocks, *rest = task(pending[j], bound)
        parcel = pending[j].parcel  # the blocks, pickled once for every task that carries them
        submitted[j] = pool.submit(evaluated_apart, (parcel if parcel is not None else blocks, *rest))
    got: tuple[Choice | InfeasibleError | Outpaced, float | None] = pool.take(submitted.pop(k))
    choice, free = got
    if isinstance(choice, Choice) and not choice.blocks:  # sent back without the task's blocks
        return replace(choice, blocks=list(pending[k].blocks)), free
    return got


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


__all__ = [
    "Parcel",
    "Pending",
    "Pool",
    "Sized",
    "Task",
    "ahead",
    "evaluated",
    "evaluated_apart",
    "full_floor",
    "pending_layout",
    "taken",
]
