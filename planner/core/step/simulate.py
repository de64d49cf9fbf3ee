"""Pure discrete-event simulation of one pipeline-parallel training step, for every schedule.

Pure module: never imports torch. Each rank runs its compute actions strictly in the order
``planner.core.step.schedules.action_order`` gives (the order torch's schedule executes), one at a time;
a rank may hold several stages (interleaved, looped and V-shaped schedules).

Timing model, per stage ``s`` and microbatch ``mb`` (S stages in all):

* ``F(s, mb)`` may start once ``F(s-1, mb)`` ended.
* the input gradient, ``B(s, mb)`` or ``I(s, mb)``, may start once ``F(s, mb)`` ended and, unless
  ``s`` is the last stage, the input gradient of stage ``s+1`` for ``mb`` (its ``B`` or ``I``) ended.
* ``W(s, mb)`` (the weight gradient of a two-part backward) may start once ``I(s, mb)`` ended.

Communication time is folded into the action that performs it (a forward carries its activation
messages, a backward their gradients), so a dependency is met the instant its producer ends. An
action starts at ``max(rank free, dependencies met)``. With equal stages and no communication this
reproduces Megatron's step time ``(m + p - 1)(t_f + t_b)`` for GPipe and 1F1B (Narayanan et al.
2021, Eq. 1) and the interleaved schedule's ``(m + (p - 1)/v)(t_f + t_b)`` with v stages per rank
(ibid. §2.2.2); ZB-V reaches a zero bubble when F = I = W (Qi et al. 2023).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from planner.core.step.schedules import Action, in_flight_per_stage, rank_orders
from planner.errors import InfeasibleError


class StageTimes(NamedTuple):
    """Seconds one action of a stage occupies its rank, messages included.

    ``i`` and ``w`` are the two halves of a two-part backward (zero-bubble schedules); None when
    unknown, in which case each is half of ``b`` (the input and weight gradients of a linear
    layer cost the same FLOPs).
    """

    f: float
    b: float
    i: float | None = None
    w: float | None = None
    msg: float = 0.0  # of f, b and i: message time spent waiting, not computing (LinkCost.cpu_share)

    def compute(self, kind: str) -> float:
        """Seconds of an action of ``kind`` that need a processor (all but its messages)."""
        total = self.of(kind)
        return total if kind == "W" else max(0.0, total - self.msg)

    def of(self, kind: str) -> float:
        """Seconds of an action of ``kind`` ("F", "B", "I" or "W")."""
        if kind == "F":
            return self.f
        if kind == "B":
            return self.b
        if kind == "I":
            return self.i if self.i is not None else self.b / 2
        return self.w if self.w is not None else self.b / 2


Durations = tuple[float, float]
"""(F, B) seconds of a stage: accepted wherever ``StageTimes`` is, for schedules without a two-part backward."""


class Traffic(NamedTuple):
    """FSDP's collectives of every stage (stage units: ``fully_shard`` per stage), placed on the
    timeline as torch runs them; seconds per stage, stage 0 first.

    ``gather``: the all-gather of the stage's parameters. Every rank issues its stages' gathers when
    the pass starts, in the order it first computes them, one after another on its collective stream
    (the runner's prefetch: ``planner.torch_compat.gather_each_stage_once``,
    ``planner.run.wrappers.prefetch_gathers``); a stage computes once its gather is done.
    ``reduce``: the reduce-scatter of its gradients (and, under HSDP, the all-reduce of the shard over
    the groups), which torch's ``REDUCE_GRAD`` issues right after the stage's last backward (its
    last ``B`` or ``W``); FSDP then makes the rank's compute stream wait for it
    (``_root_post_backward_final_callback``), so the rank computes nothing meanwhile, but a rank
    waiting for a neighbour loses nothing to it.
    """

    gather: Sequence[float]
    reduce: Sequence[float]


class Event(BaseModel):
    """One action as the simulation placed it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int
    stage: int = Field(default=-1, description="Global stage index (-1: not recorded).")
    kind: str = Field(description="'F', 'B', 'I' or 'W'.")
    microbatch: int
    start_s: float
    end_s: float


class SimResult(BaseModel):
    """Outcome of simulating one training step."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    step_time_s: float = Field(description="Makespan of one step.")
    bubble_fraction: float = Field(description="1 - total busy time / (n_ranks * makespan).")
    busy_s: list[float] = Field(description="Busy time per rank.")
    bubble_s: list[float] = Field(default_factory=list, description="Idle time per rank within the makespan.")
    peak_in_flight: list[int] = Field(description="Peak microbatches holding activations, per stage.")
    events: list[Event] = Field(description="Every action, sorted by start time then rank.")


def simulate(
    stages: Sequence[StageTimes | Durations],
    schedule: str,
    n_microbatches: int,
    slots: float | None = None,
    stages_per_rank: int = 1,
    traffic: Traffic | None = None,
) -> SimResult:
    """Simulate one training step of a pipeline.

    Args:
        stages: per stage, stage 0 first, the seconds its actions occupy its rank, messages
            included (``StageTimes`` or an ``(F, B)`` pair).
        schedule: one of ``planner.core.step.schedules.SCHEDULES``.
        n_microbatches: microbatches per step.
        slots: how many ranks can compute at full speed at once: None (every rank has its own
            device) or, for CPU ranks sharing a machine, cores / threads per rank. With fewer
            slots than busy ranks, the busy ranks share the processors equally (processor
            sharing), as the OS scheduler time-slices the processes; the message part of an
            action that only waits (``StageTimes.msg``) runs at full speed, taking no processor.
        stages_per_rank: stages on every rank (``len(stages)`` must be a multiple of it).
        traffic: FSDP's per-stage collectives to place on the timeline (``Traffic``; None: none).
            Only with a device per rank (``slots`` None or at least the ranks).

    Returns:
        The step's makespan, bubble fraction, per-rank busy and idle time, per-stage peak
        in-flight count, and every event.

    Raises:
        InfeasibleError: no stages, a stage count that is not ranks x stages_per_rank, a
            schedule/microbatch request torch would refuse, or traffic on shared processors.
        RuntimeError: the action orders deadlock (a bug in the schedule orders, never user input).
    """
    times, p = _checked(stages, stages_per_rank, traffic, slots)
    orders = rank_orders(schedule, p, n_microbatches, stages_per_rank)
    if slots is not None and slots < p:
        events, busy, makespan = _run_shared(times, orders, slots)
    else:
        program = _program(schedule, p, n_microbatches, stages_per_rank)
        events, busy, makespan = _run(times, program, p, n_microbatches, events=True, traffic=traffic)
    events.sort(key=lambda e: (e.start_s, e.rank))
    return SimResult(
        step_time_s=makespan,
        bubble_fraction=_bubble(busy, p, makespan),
        busy_s=busy,
        bubble_s=[makespan - b for b in busy],
        peak_in_flight=in_flight_per_stage(schedule, p, n_microbatches, stages_per_rank),
        events=events,
    )


def simulate_step(
    stages: Sequence[StageTimes | Durations],
    schedule: str,
    n_microbatches: int,
    slots: float | None = None,
    stages_per_rank: int = 1,
    traffic: Traffic | None = None,
) -> tuple[float, float]:
    """``simulate``'s makespan and bubble fraction alone, the same floats, without recording the
    events (what the search needs of the thousands of steps it predicts).

    Raises:
        InfeasibleError: as ``simulate``.
    """
    times, p = _checked(stages, stages_per_rank, traffic, slots)
    if slots is not None and slots < p:
        _, busy, makespan = _run_shared(times, rank_orders(schedule, p, n_microbatches, stages_per_rank), slots)
    else:
        program = _program(schedule, p, n_microbatches, stages_per_rank)
        _, busy, makespan = _run(times, program, p, n_microbatches, events=False, traffic=traffic)
    return makespan, _bubble(busy, p, makespan)


def simulate_traffic(
    stages: Sequence[StageTimes | Durations],
    schedule: str,
    n_microbatches: int,
    stages_per_rank: int,
    traffic: Traffic,
) -> tuple[float, list[float]]:
    """``simulate_step``'s makespan with FSDP's stage-unit ``traffic`` on the timeline, and how long
    each stage's actions waited for its gather beyond when they could otherwise have started (the
    part of the gather its rank did not hide behind other work; ``Traffic``).

    Args:
        stages: per stage, the seconds its actions occupy its rank.
        schedule: one of ``planner.core.step.schedules.SCHEDULES``.
        n_microbatches: microbatches per step.
        stages_per_rank: stages on every rank.
        traffic: the stages' collectives.

    Returns:
        The makespan and the gather waits, seconds per stage.

    Raises:
        InfeasibleError: as ``simulate``.
    """
    times, p = _checked(stages, stages_per_rank, traffic)
    program = _program(schedule, p, n_microbatches, stages_per_rank)
    waits = [0.0] * len(times)
    _, _, makespan = _run(times, program, p, n_microbatches, events=False, traffic=traffic, waits=waits)
    return makespan, waits


def _checked(
    stages: Sequence[StageTimes | Durations],
    stages_per_rank: int,
    traffic: Traffic | None = None,
    slots: float | None = None,
) -> tuple[list[StageTimes], int]:
    """The stages as ``StageTimes``, and the ranks they make (``traffic``, if any, checked against them)."""
    if not stages:
        raise InfeasibleError("stages is empty; expected at least one stage; pass one (F, B) duration pair per stage.")
    if stages_per_rank < 1 or len(stages) % stages_per_rank:
        raise InfeasibleError(
            f"{len(stages)} stages do not split into {stages_per_rank} stages per rank; "
            "give ranks x stages-per-rank stages"
        )
    times = [st if isinstance(st, StageTimes) else StageTimes(*st) for st in stages]
    p = len(times) // stages_per_rank
    if traffic is not None:
        if len(traffic.gather) != len(times) or len(traffic.reduce) != len(times):
            raise InfeasibleError(
                f"traffic for {len(traffic.gather)} / {len(traffic.reduce)} stages; expected {len(times)}"
            )
        if slots is not None and slots < p:
            raise InfeasibleError("FSDP traffic on the timeline needs a device per rank (slots None)")
    return times, p


def _bubble(busy: Sequence[float], p: int, makespan: float) -> float:
    # idle / capacity rather than 1 - busy / capacity: for integer-valued times both numerator and
    # denominator are exact, so equal stages give exactly (p-1)/(m+p-1) (GPipe paper §2.3).
    capacity = p * makespan
    return max(0.0, (capacity - sum(busy)) / capacity) if capacity > 0 else 0.0


Key = tuple[str, int, int]  # ("F" | "G", stage, microbatch); "G": the input gradient (B or I) is done


def _deps(a: Action, n_stages: int) -> list[Key]:
    """The producers that must end before action ``a`` may start."""
    if a.kind == "F":
        return [("F", a.stage - 1, a.microbatch)] if a.stage > 0 else []
    if a.kind == "W":
        return [("G", a.stage, a.microbatch)]
    deps: list[Key] = [("F", a.stage, a.microbatch)]
    if a.stage < n_stages - 1:
        deps.append(("G", a.stage + 1, a.microbatch))
    return deps


def _produces(a: Action) -> Key | None:
    if a.kind == "F":
        return ("F", a.stage, a.microbatch)
    if a.kind in ("B", "I"):
        return ("G", a.stage, a.microbatch)
    return None


def _stuck(orders: Sequence[Sequence[Action]], next_idx: list[int]) -> RuntimeError:
    stuck = {r: orders[r][next_idx[r]] for r in range(len(orders)) if next_idx[r] < len(orders[r])}
    return RuntimeError(f"pipeline simulation deadlocked; next actions per rank: {stuck} (planner bug)")


KINDS = "FBIW"
"""Action kinds by their code in a ``_program`` (an index into a stage's four durations)."""

PROGRAM_ACTIONS_CACHED = 4_000_000
"""The programs of the last shapes used are kept (``_program``) while their actions number at most
this many together (about 30 bytes each: some 120 MB; a search meets hundreds of shapes, and one
of 48 ranks x 432 microbatches x 2 stages each holds 124,416 actions, 1.6 s to build)."""


class _Program(NamedTuple):
    """The actions of a shape in an order the step can be timed in (``_program``), column by column
    (compact arrays rather than a tuple per action: a search keeps hundreds of thousands of them).

    Attributes:
        rank: each action's rank.
        duration: where its duration is: stage x 4 + kind code (``KINDS``).
        dep1: the end-time slot it waits for (-1: none).
        dep2: the second one (-1: none).
        sets: the slot it sets (-1: none).
        stage: its stage.
        microbatch: its microbatch.
        kind: its kind, one letter each.
        last: 1 where it is its stage's last weight-gradient action (the m-th ``B`` or ``W``: torch's
            ``REDUCE_GRAD`` follows it).
    """

    rank: array[int]
    duration: array[int]
    dep1: array[int]
    dep2: array[int]
    sets: array[int]
    stage: array[int]
    microbatch: array[int]
    kind: str
    last: bytes


class _Programs:
    """The programs of the shapes used last, kept while their actions number at most ``budget``."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.kept: OrderedDict[tuple[str, int, int, int], _Program] = OrderedDict()
        self.actions = 0

    def get(self, schedule: str, p: int, m: int, v: int) -> _Program:
        key = (schedule, p, m, v)
        program = self.kept.get(key)
        if program is not None:
            self.kept.move_to_end(key)
            return program
        program = _build_program(schedule, p, m, v)
        self.kept[key] = program
        self.actions += len(program.kind)
        while self.actions > self.budget and len(self.kept) > 1:
            _, old = self.kept.popitem(last=False)
            self.actions -= len(old.kind)
        return program

    def clear(self) -> None:
        self.kept.clear()
        self.actions = 0


_PROGRAMS = _Programs(PROGRAM_ACTIONS_CACHED)


def _program(schedule: str, p: int, m: int, v: int) -> _Program:
    """Every action of a shape in an order the step can be timed in: each after the actions it
    depends on and after the one before it on its rank, as integer slots (kept for the shapes used
    last: ``PROGRAM_ACTIONS_CACHED``).

    The order is the one in which the sweep over the ranks (each rank advanced as far as its
    dependencies allow, rank 0 first, until every action ran) meets them; it depends on the shape
    alone, not on the times, so it is computed once per shape. An action's start depends only on
    its producers' ends and its rank's previous action, so any such order gives the same floats.

    Raises:
        InfeasibleError: a request torch would refuse.
        RuntimeError: the action orders deadlock (a bug in the schedule orders, never user input).
    """
    return _PROGRAMS.get(schedule, p, m, v)


def _build_program(schedule: str, p: int, m: int, v: int) -> _Program:
    """``_program`` built afresh."""
    return _sweep(rank_orders(schedule, p, m, v), p * v, m)


def _sweep(orders: tuple[tuple[Action, ...], ...], n_stages: int, m: int) -> _Program:
    """``_program``'s sweep over the ranks (each action's slots worked out once, before it)."""
    coded = [[_coded(a, n_stages, m) for a in order] for order in orders]
    done = bytearray(2 * n_stages * m)  # the slots: "F" ends, then "G" (input gradient) ends
    next_idx = [0] * len(orders)
    grads_left = [m] * n_stages  # B or W actions to come per stage
    columns: tuple[array[int], ...] = tuple(array("i") for _ in range(7))
    ranks, durations, deps1, deps2, sets_, stages, microbatches = columns
    kinds: list[str] = []
    last = bytearray()
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for rank, order in enumerate(orders):
            codes, i = coded[rank], next_idx[rank]
            while i < len(order):
                dep1, dep2, sets, duration = codes[i]
                if (dep1 >= 0 and not done[dep1]) or (dep2 >= 0 and not done[dep2]):
                    break
                if sets >= 0:
                    done[sets] = 1
                a = order[i]
                if a.kind in "BW":
                    grads_left[a.stage] -= 1
                ranks.append(rank)
                durations.append(duration)
                deps1.append(dep1)
                deps2.append(dep2)
                sets_.append(sets)
                stages.append(a.stage)
                microbatches.append(a.microbatch)
                kinds.append(a.kind)
                last.append(a.kind in "BW" and not grads_left[a.stage])
                i += 1
            if i > next_idx[rank]:
                remaining -= i - next_idx[rank]
                next_idx[rank] = i
                progressed = True
        if not progressed:
            raise _stuck([list(o) for o in orders], next_idx)
    return _Program(ranks, durations, deps1, deps2, sets_, stages, microbatches, "".join(kinds), bytes(last))


def _coded(a: Action, n_stages: int, m: int) -> tuple[int, int, int, int]:
    """An action's two dependency slots, the slot it sets (-1: none) and its duration's index: the
    rules of ``_deps`` and ``_produces`` written out as slots (slot of ("F", s, mb): s m + mb; of
    ("G", s, mb): the same after every "F"), as it runs once per action of every shape (the two
    agree on every action: tests/test_simulate.py)."""
    s, mb, grads = a.stage, a.microbatch, n_stages * m
    duration = 4 * s + KINDS.index(a.kind)
    if a.kind == "F":
        return ((s - 1) * m + mb if s > 0 else -1), -1, s * m + mb, duration
    if a.kind == "W":
        return grads + s * m + mb, -1, -1, duration
    after = grads + (s + 1) * m + mb if s < n_stages - 1 else -1
    return s * m + mb, after, grads + s * m + mb, duration


def _run(
    times: list[StageTimes],
    program: _Program,
    p: int,
    n_microbatches: int,
    *,
    events: bool,
    traffic: Traffic | None = None,
    waits: list[float] | None = None,
) -> tuple[list[Event], list[float], float]:
    """Every rank has its own processor: each action starts when its rank is free and its
    producers ended (the latest of those), and ends its duration later. With ``traffic`` a stage
    computes once its gather is done, and its rank is held for its reduce-scatter after its last
    weight-gradient action (``Traffic``); ``waits`` (one per stage), if given, gains how long each
    action waited for its stage's gather alone."""
    durations = [t.of(kind) for t in times for kind in KINDS]
    end = [0.0] * (2 * len(times) * n_microbatches)  # the slots of _program
    free_at = [0.0] * p
    busy = [0.0] * p
    out: list[Event] = []
    ready = _gathered(program, traffic.gather, p) if traffic is not None else None
    columns = (program.rank, program.duration, program.dep1, program.dep2, program.sets, program.stage, program.last)
    for k, (rank, duration, dep1, dep2, sets, stage, last) in enumerate(zip(*columns, strict=True)):
        # max(free, *deps): the first of equal values, as the builtin max keeps
        start = free_at[rank]
        if dep1 >= 0 and end[dep1] > start:
            start = end[dep1]
        if dep2 >= 0 and end[dep2] > start:
            start = end[dep2]
        if ready is not None and ready[stage] > start:
            if waits is not None:
                waits[stage] += ready[stage] - start
            start = ready[stage]
        dur = durations[duration]
        finish = start + dur
        if sets >= 0:
            end[sets] = finish
        free_at[rank] = finish
        if last and traffic is not None:
            free_at[rank] = finish + traffic.reduce[stage]
        busy[rank] += dur
        if events:
            kind, microbatch = program.kind[k], program.microbatch[k]
            out.append(Event(rank=rank, stage=stage, kind=kind, microbatch=microbatch, start_s=start, end_s=finish))
    return out, busy, max(free_at)


def _gathered(program: _Program, gather: Sequence[float], p: int) -> list[float]:
    """When each stage's gather is done: every rank's gathers back to back from the pass's start, in
    the order the rank first computes its stages (``Traffic``)."""
    ready = [-1.0] * len(gather)
    clock = [0.0] * p
    for rank, s in zip(program.rank, program.stage, strict=True):
        if ready[s] < 0:
            clock[rank] += gather[s]
            ready[s] = clock[rank]
    return ready


def _run_shared(
    times: list[StageTimes], orders: Sequence[Sequence[Action]], slots: float
) -> tuple[list[Event], list[float], float]:
    """Ranks share ``slots`` processors: every computing action progresses at rate
    ``min(1, slots / computing)`` (a fluid processor-sharing model of the OS scheduler). An
    action computes first, then waits out its messages (``StageTimes.msg``) at full rate: a rank
    waiting on a link takes no processor from the others."""
    p, n_stages = len(orders), len(times)
    end: dict[Key, float] = {}
    next_idx = [0] * p
    running: dict[int, list[Any]] = {}  # rank -> [action, start, compute left, message left]
    busy = [0.0] * p
    events: list[Event] = []
    now = 0.0
    while running or any(next_idx[r] < len(orders[r]) for r in range(p)):
        for rank in range(p):
            if rank in running or next_idx[rank] >= len(orders[rank]):
                continue
            a = orders[rank][next_idx[rank]]
            if all(d in end for d in _deps(a, n_stages)):
                work = times[a.stage].compute(a.kind)
                running[rank] = [a, now, work, times[a.stage].of(a.kind) - work]
                next_idx[rank] += 1
        if not running:
            raise _stuck(orders, next_idx)
        computing = sum(1 for r in running.values() if r[2] > 0)
        rate = min(1.0, slots / computing) if computing else 1.0
        step = min(r[2] / rate if r[2] > 0 else r[3] for r in running.values())
        now += step
        for rank in list(running):
            a, start, left, wait = running[rank]
            if left > 0:
                left = max(0.0, left - step * rate)
                if left <= 1e-12 * max(1.0, now):
                    left = 0.0
            else:
                wait -= step
            if left == 0.0 and wait <= 1e-12 * max(1.0, now):
                key = _produces(a)
                if key is not None:
                    end[key] = now
                busy[rank] += times[a.stage].of(a.kind)
                events.append(
                    Event(rank=rank, stage=a.stage, kind=a.kind, microbatch=a.microbatch, start_s=start, end_s=now)
                )
                del running[rank]
            else:
                running[rank][2:] = [left, wait]
    return events, busy, now
