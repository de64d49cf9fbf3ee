"""Pure discrete-event simulation of one pipeline-parallel training step.

Pure module: never imports torch. One stage per rank; each rank runs its actions strictly in the
order ``planner.core.schedules.action_order`` gives (the order torch's schedule executes), one at a time.

Timing model, per stage ``i`` and microbatch ``mb``:

* ``F(i, mb)`` occupies rank ``i`` for its forward duration (compute + its messages) and may start
  once ``F(i-1, mb)`` ended.
* ``B(i, mb)`` occupies rank ``i`` for its backward duration and may start once ``F(i, mb)`` ended
  and, unless ``i`` is the last stage, ``B(i+1, mb)`` ended.

Communication time is folded into the action that performs it (torch's single-stage schedules wait
on their receives and sends inside the action), so a dependency is met the instant its producer ends.
An action starts at ``max(rank free, dependencies met)``. With equal stages and no communication this
reproduces Megatron's step time ``(m + p - 1)(t_f + t_b)`` (Narayanan et al. 2021, Eq. 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from planner.core.schedules import action_order, peak_in_flight
from planner.errors import InfeasibleError

Durations = tuple[float, float]
"""Seconds one forward action and one backward action occupy a rank, messages included."""


class Event(BaseModel):
    """One action as the simulation placed it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int
    kind: str = Field(description="'F' or 'B'.")
    microbatch: int
    start_s: float
    end_s: float


class SimResult(BaseModel):
    """Outcome of simulating one training step."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    step_time_s: float = Field(description="Makespan of one step.")
    bubble_fraction: float = Field(description="1 - total busy time / (n_ranks * makespan).")
    busy_s: list[float] = Field(description="Busy time per rank.")
    peak_in_flight: list[int] = Field(description="Peak microbatches with F done and B pending, per rank.")
    events: list[Event] = Field(description="Every action, sorted by start time then rank.")


def _duration(st: Durations, kind: str) -> float:
    """Seconds one action of ``kind`` occupies its rank (communication included)."""
    return st[0] if kind == "F" else st[1]


def simulate(stages: Sequence[Durations], schedule: str, n_microbatches: int, slots: float | None = None) -> SimResult:
    """Simulate one training step of a pipeline with one stage per rank.

    Args:
        stages: per stage, stage 0 first (one rank each), the seconds ``(F, B)`` one forward
            and one backward action occupy its rank, messages included.
        schedule: "gpipe" or "1f1b" (see ``planner.core.schedules``).
        n_microbatches: microbatches per step.
        slots: how many ranks can compute at full speed at once: None (every rank has its own
            device) or, for CPU ranks sharing a machine, cores / threads per rank. With fewer
            slots than busy ranks, the busy ranks share the processors equally (processor
            sharing), as the OS scheduler time-slices the processes.

    Returns:
        The step's makespan, bubble fraction, per-rank busy time and peak in-flight count, and
        every event.

    Raises:
        InfeasibleError: no stages, or a schedule/microbatch request torch would refuse.
        RuntimeError: the action orders deadlock (a bug in the schedule orders, never user input).
    """
    p = len(stages)
    if p == 0:
        raise InfeasibleError("stages is empty; expected at least one stage; pass one (F, B) duration pair per stage.")
    orders = action_order(schedule, p, n_microbatches)
    if slots is not None and slots < p:
        return _simulate_shared(stages, orders, slots)

    end: dict[tuple[str, int, int], float] = {}  # (kind, stage, microbatch) -> end time
    next_idx = [0] * p
    free_at = [0.0] * p
    busy = [0.0] * p
    events: list[Event] = []
    remaining = sum(len(o) for o in orders)

    while remaining:
        progressed = False
        for rank in range(p):
            # Advance this rank as far as its dependencies allow; the start time of an action depends
            # only on its producers' end times and this rank's previous action, so the order in
            # which ranks are advanced does not change the result.
            while next_idx[rank] < len(orders[rank]):
                kind, mb = orders[rank][next_idx[rank]]
                deps = _deps(kind, rank, mb, p)
                if any(d not in end for d in deps):
                    break
                start = max([free_at[rank]] + [end[d] for d in deps])
                dur = _duration(stages[rank], kind)
                finish = start + dur
                end[(kind, rank, mb)] = finish
                free_at[rank] = finish
                busy[rank] += dur
                events.append(Event(rank=rank, kind=kind, microbatch=mb, start_s=start, end_s=finish))
                next_idx[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: orders[r][next_idx[r]] for r in range(p) if next_idx[r] < len(orders[r])}
            raise RuntimeError(f"pipeline simulation deadlocked; next actions per rank: {stuck} (planner bug)")

    makespan = max(free_at)
    # idle / capacity rather than 1 - busy / capacity: for integer-valued times both numerator and
    # denominator are exact, so equal stages give exactly (p-1)/(m+p-1) (GPipe paper §2.3).
    capacity = p * makespan
    bubble = (capacity - sum(busy)) / capacity if capacity > 0 else 0.0
    events.sort(key=lambda e: (e.start_s, e.rank))
    return SimResult(
        step_time_s=makespan,
        bubble_fraction=bubble,
        busy_s=busy,
        peak_in_flight=[peak_in_flight(o) for o in orders],
        events=events,
    )


def _deps(kind: str, rank: int, mb: int, p: int) -> list[tuple[str, int, int]]:
    """The actions (kind, stage, microbatch) that must end before this one may start."""
    if kind == "F":
        return [("F", rank - 1, mb)] if rank > 0 else []
    return [("F", rank, mb)] + ([("B", rank + 1, mb)] if rank < p - 1 else [])


def _simulate_shared(stages: Sequence[Durations], orders: list[list[tuple[str, int]]], slots: float) -> SimResult:
    """The step when ranks share ``slots`` processors: every running action progresses at rate
    ``min(1, slots / running)`` (a fluid processor-sharing model of the OS scheduler)."""
    p = len(stages)
    end: dict[tuple[str, int, int], float] = {}
    next_idx = [0] * p
    running: dict[int, list[Any]] = {}  # rank -> [kind, microbatch, start, work left]
    busy = [0.0] * p
    events: list[Event] = []
    now = 0.0
    while running or any(next_idx[r] < len(orders[r]) for r in range(p)):
        for rank in range(p):
            if rank in running or next_idx[rank] >= len(orders[rank]):
                continue
            kind, mb = orders[rank][next_idx[rank]]
            if all(d in end for d in _deps(kind, rank, mb, p)):
                running[rank] = [kind, mb, now, _duration(stages[rank], kind)]
                next_idx[rank] += 1
        if not running:
            stuck = {r: orders[r][next_idx[r]] for r in range(p) if next_idx[r] < len(orders[r])}
            raise RuntimeError(f"pipeline simulation deadlocked; next actions per rank: {stuck} (planner bug)")
        rate = min(1.0, slots / len(running))
        step = min(r[3] for r in running.values()) / rate
        now += step
        for rank in list(running):
            kind, mb, start, left = running[rank]
            left -= step * rate
            if left <= 1e-12 * max(1.0, now):
                dur = _duration(stages[rank], kind)
                end[(kind, rank, mb)] = now
                busy[rank] += dur
                events.append(Event(rank=rank, kind=kind, microbatch=mb, start_s=start, end_s=now))
                del running[rank]
            else:
                running[rank][3] = left
    capacity = p * now
    bubble = max(0.0, (capacity - sum(busy)) / capacity) if capacity > 0 else 0.0
    events.sort(key=lambda e: (e.start_s, e.rank))
    return SimResult(
        step_time_s=now,
        bubble_fraction=bubble,
        busy_s=busy,
        peak_in_flight=[peak_in_flight(o) for o in orders],
        events=events,
    )
