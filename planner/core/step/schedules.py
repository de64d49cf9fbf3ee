"""Pure action lists of every pipeline schedule of torch 2.13, and where each stage lives.

Pure module: never imports torch. For each schedule this module reproduces, action for action, the
compute actions a rank executes in one training step:

* ``gpipe`` / ``1f1b``: what ``ScheduleGPipe`` / ``Schedule1F1B._step_microbatches`` run (one stage
  per rank);
* ``interleaved-1f1b``, ``looped-bfs``, ``interleaved-zb``, ``zbv``, ``dualpipev``: the
  ``pipeline_order`` that ``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS``,
  ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` compute
  in ``_calculate_single_rank_operations`` (torch's ``_PipelineScheduleRuntime`` runs those compute
  actions in that order and only inserts communication between them), with the idle slots
  (``None``) left out.

DualPipeV's ``OVERLAP_F_B`` action is listed as its two sub-actions, forward first: torch 2.13
runs them one after the other (``_PipelineScheduleRuntime._step_microbatches``) unless a custom
overlap function is registered, which the planner does not do.

``tests/test_schedules_torch.py`` checks every list against the installed torch.

Action kinds: ``F`` forward, ``B`` full backward, ``I`` backward for the inputs only, ``W``
backward for the weights only (the zero-bubble split; Qi et al. 2023, arXiv:2401.10241).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Literal, NamedTuple

import numpy as np
import numpy.typing as npt

from planner.core.heap import bulk_allocation
from planner.errors import InfeasibleError
from planner.schema.names import SCHEDULES, TORCH_NAMES, ZERO_BUBBLE, schedule_name

__all__ = [
    "SCHEDULES",
    "ZERO_BUBBLE",
    "TORCH_NAMES",
    "Action",
    "action_order",
    "check_schedule",
    "rank_orders",
    "schedule_name",
    "stage_ranks",
]

ORDERS_CACHED = 16
"""The action orders of this many shapes (schedule, p, m, v) are kept (``rank_orders``): the search
solves, predicts and polishes one shape many times, and an order of p ranks x m microbatches is
rebuilt in O(p m v). Few, since one shape of 64 ranks x 512 microbatches holds some 65k actions."""

IN_FLIGHT_CACHED = 4096
"""The in-flight counts of this many shapes are kept (``in_flight_per_stage``): one int per stage each."""

STATES_CACHED = 256
"""Shapes whose ranks' distinct prefix states are kept (``rank_states``): a few to a few hundred rows a rank."""


Placement = Literal["single", "loop", "v"]


class Action(NamedTuple):
    """One compute action of a rank."""

    stage: int
    kind: str  # "F", "B", "I" or "W"
    microbatch: int


def placement(schedule: str) -> Placement:
    """How a schedule places stages on ranks: one each, looped (stage s on rank s mod p) or V-shaped."""
    if schedule in ("gpipe", "1f1b"):
        return "single"
    if schedule in ("zbv", "dualpipev"):
        return "v"
    return "loop"


def stages_per_rank_options(schedule: str, max_v: int) -> list[int]:
    """The stage counts per rank a schedule can run with, up to ``max_v``."""
    style = placement(schedule)
    if style == "single":
        return [1]
    if style == "v":
        return [2] if max_v >= 2 else []
    return list(range(1, max_v + 1))


def stage_ranks(schedule: str, n_ranks: int, stages_per_rank: int) -> list[int]:
    """The rank of every stage (index = stage).

    Looped placement puts stage s on rank s mod p (Megatron's interleaving; torch's default
    ``stage_index_to_group_rank``); the V placement of ZB-V and DualPipeV puts stages r and
    2p - 1 - r on rank r (torch's ``generate_stage_to_rank_mapping(style="v")``).

    Raises:
        InfeasibleError: a stage count per rank the schedule cannot run (see ``check_schedule``).
    """
    check_placement(schedule, n_ranks, stages_per_rank)
    n = n_ranks * stages_per_rank
    if placement(schedule) == "v":
        return [s if s < n_ranks else n - 1 - s for s in range(n)]
    return [s % n_ranks for s in range(n)]


def check_placement(schedule: str, n_ranks: int, stages_per_rank: int) -> None:
    """Refuse a stage count per rank the schedule's torch class refuses.

    Raises:
        InfeasibleError: unknown schedule, p < 1, v < 1, v != 1 for GPipe/1F1B, v != 2 for ZB-V/DualPipeV.
    """
    if schedule not in SCHEDULES:
        raise InfeasibleError(
            f"schedule {schedule!r} is not supported; expected one of {', '.join(SCHEDULES)}; pick one of those."
        )
    if n_ranks < 1:
        raise InfeasibleError(f"--gpus {n_ranks}: need at least one stage; use --gpus 1 or more")
    if stages_per_rank < 1:
        raise InfeasibleError(f"--stages-per-rank {stages_per_rank}: need at least one; use 1 or more")
    style = placement(schedule)
    if style == "single" and stages_per_rank != 1:
        raise InfeasibleError(
            f"--stages-per-rank {stages_per_rank} does not work with --schedule {schedule} (one stage per rank); "
            "use --stages-per-rank 1, or --schedule interleaved-1f1b / looped-bfs / interleaved-zb for several"
        )
    if style == "v" and stages_per_rank != 2:
        raise InfeasibleError(
            f"--stages-per-rank {stages_per_rank} does not work with --schedule {schedule}: its V shape puts "
            "exactly 2 stages on every rank; use --stages-per-rank 2"
        )


def check_schedule(schedule: str, n_ranks: int, n_microbatches: int, stages_per_rank: int = 1) -> None:
    """Reject requests torch's schedules cannot run: the one place this rule lives (the planner checks it
    before profiling, the runner before launching, ``action_order`` always).

    Args:
        schedule: one of ``SCHEDULES``.
        n_ranks: pipeline ranks p.
        n_microbatches: microbatches per step m.
        stages_per_rank: stages on every rank v.

    Raises:
        InfeasibleError: unknown schedule, p < 1, m < 1, a stage count per rank the schedule cannot
            run, or a microbatch count its torch class refuses in ``__init__``: 1F1B needs m >= p,
            DualPipeV m >= 2p, the interleaved ones m a multiple of max(1, m // p) (torch's
            "number of rounds").
    """
    check_placement(schedule, n_ranks, stages_per_rank)
    m, p = n_microbatches, n_ranks
    if m < 1:
        raise InfeasibleError(f"--microbatches {m}: need at least one microbatch; use -m 1 or more")
    # torch's Schedule1F1B.__init__ raises ValueError when n_microbatches < num_stages.
    if schedule == "1f1b" and m < p:
        raise InfeasibleError(
            f"--microbatches {m} is too small for --schedule 1f1b with {p} stages: "
            f"torch's Schedule1F1B needs at least one microbatch per stage; use -m {p} or more, "
            "fewer --gpus, or --schedule gpipe"
        )
    if schedule == "dualpipev" and m < 2 * p:
        raise InfeasibleError(
            f"--microbatches {m} is too small for --schedule dualpipev on {p} ranks: torch's ScheduleDualPipeV "
            f"needs at least one microbatch per stage ({2 * p} stages); use -m {2 * p} or more, or --schedule zbv"
        )
    if schedule in ("interleaved-1f1b", "interleaved-zb"):
        rounds = max(1, m // p)
        if m % rounds:
            raise InfeasibleError(
                f"--microbatches {m} does not work with --schedule {schedule} on {p} ranks: torch needs m to be a "
                f"multiple of its number of rounds max(1, m // p) = {rounds}; use -m {rounds * p} or another "
                f"multiple of {p}"
            )


def action_order(schedule: str, n_ranks: int, n_microbatches: int, stages_per_rank: int = 1) -> list[list[Action]]:
    """Per-rank order of the compute actions of one training step.

    GPipe (``ScheduleGPipe._step_microbatches``): every rank runs F0..F(m-1), then B0..B(m-1).

    1F1B (``Schedule1F1B._step_microbatches``): stage ``i`` (0-based) first runs
    ``w = min(m, p - i)`` warm-up forwards, then alternates "1B1F" (B first) until all forwards
    are issued, then drains the remaining backwards (Narayanan et al. 2021 §2.2.1).

    The others follow their torch class's ``_calculate_single_rank_operations`` (see the module
    docstring); the functions below name the class they copy.

    Args:
        schedule: one of ``SCHEDULES``.
        n_ranks: pipeline ranks p.
        n_microbatches: microbatches per step m.
        stages_per_rank: stages on every rank v (1 for GPipe/1F1B, 2 for ZB-V/DualPipeV).

    Returns:
        ``orders[r]`` is the list of actions rank ``r`` runs, in order. Stage indices are global
        (0 .. p*v - 1); ``stage_ranks`` says which rank holds each.

    Raises:
        InfeasibleError: a request torch would refuse (see ``check_schedule``).
    """
    return [list(order) for order in rank_orders(schedule, n_ranks, n_microbatches, stages_per_rank)]


@lru_cache(maxsize=ORDERS_CACHED)
def rank_orders(
    schedule: str, n_ranks: int, n_microbatches: int, stages_per_rank: int = 1
) -> tuple[tuple[Action, ...], ...]:
    """``action_order`` as immutable tuples, built once per shape and shared (the last
    ``ORDERS_CACHED`` shapes are kept): for callers that only read the orders.

    Raises:
        InfeasibleError: a request torch would refuse (see ``check_schedule``; never cached).
    """
    check_schedule(schedule, n_ranks, n_microbatches, stages_per_rank)
    p, m, v = n_ranks, n_microbatches, stages_per_rank
    build: dict[str, Callable[[int], list[Action]]] = {
        "gpipe": lambda r: _gpipe(r, m),
        "1f1b": lambda r: _one_f_one_b(r, p, m),
        "looped-bfs": lambda r: _looped_bfs(r, p, m, v),
        "interleaved-1f1b": lambda r: _interleaved(r, p, m, v, zero_bubble=False),
        "interleaved-zb": lambda r: _interleaved(r, p, m, v, zero_bubble=True),
        "zbv": lambda r: _zbv(r, p, m),
        "dualpipev": lambda r: _dualpipev(r, p, m),
    }
    with bulk_allocation():
        return tuple(tuple(build[schedule](r)) for r in range(p))


def _gpipe(rank: int, m: int) -> list[Action]:
    return [Action(rank, "F", mb) for mb in range(m)] + [Action(rank, "B", mb) for mb in range(m)]


def _one_f_one_b(rank: int, p: int, m: int) -> list[Action]:
    warmup = min(m, p - rank)
    order = [Action(rank, "F", mb) for mb in range(warmup)]
    fwd, bwd = warmup, 0
    # "1B1F" steady state exactly as torch: B first, then F while forwards remain.
    while True:
        order.append(Action(rank, "B", bwd))
        bwd += 1
        if fwd == m:
            break
        order.append(Action(rank, "F", fwd))
        fwd += 1
    order.extend(Action(rank, "B", mb) for mb in range(bwd, m))
    return order


def _looped_bfs(rank: int, p: int, m: int, v: int) -> list[Action]:
    """``ScheduleLoopedBFS``: every local stage's forwards in stage order, then the backwards of the
    local stages in reverse, each over the microbatches in reverse."""
    local = range(rank, p * v, p)
    order = [Action(s, "F", mb) for s in local for mb in range(m)]
    order += [Action(s, "B", mb) for s in reversed(local) for mb in reversed(range(m))]
    return order


def _interleaved_warmup(rank: int, p: int, m: int, v: int, zero_bubble: bool) -> tuple[int, int]:
    """The interleaved schedules' microbatches per round of a stage chunk and rank ``rank``'s warm-up
    forwards (torch's ``_get_warmup_ops``: one fewer factor of the ranks after it under zero bubble)."""
    per_round = m // max(1, m // p)
    factor = 1 if zero_bubble else 2
    return per_round, min((v - 1) * per_round + factor * (p - 1 - rank), m * v)


def _interleaved(rank: int, p: int, m: int, v: int, *, zero_bubble: bool) -> list[Action]:
    """``ScheduleInterleaved1F1B`` (``zero_bubble=False``) and ``ScheduleInterleavedZeroBubble``: the
    warm-up count of ``_get_warmup_ops`` and the phases of ``_get_1f1b_rank_ops``."""
    per_round, warmup = _interleaved_warmup(rank, p, m, v, zero_bubble)
    total = m * v  # forwards of this rank = backwards of this rank
    fwd_bwd = total - warmup

    def fwd_stage(step: int) -> int:
        return ((step // per_round) % v) * p + rank

    def bwd_stage(step: int) -> int:
        return (v - 1 - ((step - warmup) // per_round) % v) * p + rank

    next_mb: dict[tuple[str, int], int] = defaultdict(int)

    def act(stage: int, kind: str) -> Action:
        mb = next_mb[(kind, stage)]
        next_mb[(kind, stage)] = mb + 1
        return Action(stage, kind, mb)

    back = "I" if zero_bubble else "B"
    order: list[Action] = []
    backward_ops: list[int] = []
    weights_done = 0
    n_1f1b = rank  # zero bubble: the first ``rank`` backwards of the steady state keep W waiting

    def maybe_weight(op: int) -> None:
        nonlocal weights_done
        if zero_bubble and op - warmup >= n_1f1b:
            order.append(act(bwd_stage(backward_ops[weights_done]), "W"))
            weights_done += 1

    for op in range(warmup + fwd_bwd + warmup):
        if op < warmup:
            order.append(act(fwd_stage(op), "F"))
        elif op < warmup + fwd_bwd:
            order.append(act(fwd_stage(op), "F"))
            order.append(act(bwd_stage(op), back))
            backward_ops.append(op)
            maybe_weight(op)
        else:
            order.append(act(bwd_stage(op), back))
            backward_ops.append(op)
            maybe_weight(op)
    while zero_bubble and weights_done < len(backward_ops):
        order.append(act(bwd_stage(backward_ops[weights_done]), "W"))
        weights_done += 1
    return order


def _zbv(rank: int, p: int, m: int) -> list[Action]:
    """``ScheduleZBVZeroBubble._calculate_single_rank_operations`` (microbatches >= m dropped, as torch does)."""
    n_micro = max(2 * p - 1, m)
    c0, c1 = rank, 2 * p - 1 - rank
    f0 = f1 = b0 = b1 = 0
    order: list[Action] = []
    for _ in range(2 * (p - rank) - 1):
        order.append(Action(c0, "F", f0))
        f0 += 1
    for _ in range(rank):
        order += [Action(c1, "F", f1), Action(c0, "F", f0 + 0)]
        f1 += 1
        f0 += 1
    for _ in range(p - rank):
        order += [Action(c1, "F", f1), Action(c1, "I", b1), Action(c1, "W", b1)]
        f1 += 1
        b1 += 1
    while f1 < f0 or f0 < n_micro:
        if f0 < n_micro:
            order.append(Action(c0, "F", f0))
            f0 += 1
        order += [Action(c0, "I", b0), Action(c0, "W", b0)]
        b0 += 1
        order += [Action(c1, "F", f1), Action(c1, "I", b1), Action(c1, "W", b1)]
        f1 += 1
        b1 += 1
    w0, w1 = b0, b1
    for _ in range(rank):
        order += [Action(c0, "I", b0), Action(c1, "I", b1)]
        b0 += 1
        b1 += 1
    for _ in range(p - rank):
        order += [Action(c0, "I", b0), Action(c0, "W", w0)]
        b0 += 1
        w0 += 1
    while w1 < b1:
        order.append(Action(c1, "W", w1))
        w1 += 1
    while w0 < b0:
        order.append(Action(c0, "W", w0))
        w0 += 1
    return [a for a in order if a.microbatch < m]


def _dualpipev(rank: int, p: int, m: int) -> list[Action]:
    """``ScheduleDualPipeV._calculate_single_rank_operations``, each overlapped F&B as F then B."""
    s0, s1 = rank, 2 * p - 1 - rank
    counters: dict[tuple[int, str], int] = defaultdict(int)
    weights: list[tuple[int, int]] = []
    order: list[Action] = []

    def add(stage: int, kind: str) -> None:
        # A full backward uses (and advances) the I counter and the W counter, as torch does.
        key = (stage, "I" if kind == "B" else kind)
        mb = counters[key]
        order.append(Action(stage, kind, mb))
        if kind == "B":
            counters[(stage, "I")] += 1
            counters[(stage, "W")] += 1
        else:
            if kind == "I":
                weights.append((stage, mb))
            counters[key] = mb + 1

    def overlap(f_stage: int, b_stage: int) -> None:
        order.append(Action(f_stage, "F", counters[(f_stage, "F")]))
        order.append(Action(b_stage, "B", counters[(b_stage, "I")]))
        counters[(f_stage, "F")] += 1
        counters[(b_stage, "I")] += 1
        counters[(b_stage, "W")] += 1

    def pending_weight() -> None:
        if weights:
            stage, mb = weights.pop(0)
            order.append(Action(stage, "W", mb))
            counters[(stage, "W")] += 1

    for _ in range((p - rank - 1) * 2):
        add(s0, "F")
    for _ in range(rank + 1):
        add(s0, "F")
        add(s1, "F")
    for _ in range(p - rank - 1):
        add(s1, "I")
        pending_weight()
        add(s1, "F")
    for i in range(m - 2 * p + rank + 1):
        if i == 0 and rank == p - 1:
            add(s0, "F")
            add(s1, "B")
        else:
            overlap(s0, s1)
        overlap(s1, s0)
    for _ in range(p - rank - 1):
        add(s1, "B")
        overlap(s1, s0)
    zero_bubble = False
    steps6 = rank + 1
    for i in range(steps6):
        if i == steps6 // 2 and rank % 2 == 1:
            zero_bubble = True
        add(s1, "I" if zero_bubble else "B")
        if i == steps6 // 2 and rank % 2 == 0:
            zero_bubble = True
        add(s0, "I" if zero_bubble else "B")
    for _ in range(p - rank - 1):
        pending_weight()
        add(s0, "I" if zero_bubble else "B")
    for _ in range(rank + 1):
        pending_weight()
    return order


def peak_in_flight(order_for_rank: Sequence[Action]) -> dict[int, int]:
    """Peak number of microbatches holding activations on each stage of a rank.

    A microbatch holds its activations on a stage from its forward until its backward has
    finished with them: the full backward ``B``, or for a two-part backward the weight part ``W``
    (torch keeps the tensors the weight gradient needs until then). This is how many
    microbatches' activations the stage holds at once (GPipe: m on every stage; 1F1B:
    min(m, p - i) on stage i, Narayanan et al. 2021).

    Args:
        order_for_rank: one rank's action order, as returned by ``action_order``.

    Returns:
        stage -> the maximum, over prefixes of the order, of its live microbatches.

    Raises:
        ValueError: an action kind other than F, B, I or W.
    """
    live: dict[int, int] = defaultdict(int)
    peak: dict[int, int] = defaultdict(int)
    for a in order_for_rank:
        if a.kind == "F":
            live[a.stage] += 1
            peak[a.stage] = max(peak[a.stage], live[a.stage])
        elif a.kind in ("B", "W"):
            live[a.stage] -= 1
        elif a.kind != "I":
            raise ValueError(f"action kind {a.kind!r} is invalid; expected 'F', 'B', 'I' or 'W'.")
    return dict(peak)


def peak_live_bytes(
    order_for_rank: Sequence[Action] | RankStates,
    bytes_per_microbatch: dict[int, int],
    grads: dict[int, int] | None = None,
    reduced: dict[int, int] | None = None,
) -> int:
    """Peak bytes a rank's live microbatches hold, with the gradients that appear during the run: the
    most, over prefixes of its order, of the sum over its stages of live microbatches x that stage's
    bytes per microbatch, plus ``grads[stage]`` for each stage whose first backward (``B`` or ``W``:
    where its weight gradients appear, and its first activations are freed) has run, plus
    ``reduced[stage]`` for each stage whose last backward has run (an FSDP stage unit's sharded
    gradients, which its reduce-scatter makes then).

    With several stages per rank the stages' peaks need not coincide, so this is at most (and often
    less than) the sum of the per-stage peaks. A stage whose every forward comes before its first
    backward (GPipe) never holds all its microbatches and its gradients at once.

    Args:
        order_for_rank: one rank's action order, or its ``RankStates`` (``rank_states``: the same
            peak, without walking the order again).
        bytes_per_microbatch: stage -> bytes one live microbatch holds on it.
        grads: stage -> its gradient bytes, counted from its first backward on (None: none).
        reduced: stage -> gradient bytes counted from its last backward on (None: none).

    Returns:
        Peak bytes.
    """
    grads, reduced = grads or {}, reduced or {}
    ranked = order_for_rank if isinstance(order_for_rank, RankStates) else prefix_states(order_for_rank)
    stages = ranked.stages
    if not stages:
        return 0
    weights = np.array(
        [bytes_per_microbatch.get(s, 0) for s in stages]
        + [grads.get(s, 0) for s in stages]
        + [reduced.get(s, 0) for s in stages]
    )
    # one product over the rank's distinct states (a few hundred at most): the sum at each, in integers
    peak: int = (ranked.counts @ weights).max().item()
    return peak


class RankStates(NamedTuple):
    """The distinct states a rank's order passes through (``prefix_states``): its stages, ascending,
    and one row per state, the empty prefix's first, of per-stage counts: live microbatches, then
    whether its first backward has run (0 / 1), then whether its last has (``3 x len(stages)``
    columns, int64). A peak of a sum linear in the state is one product over the rows, where the
    order passes through up to thousands of actions."""

    stages: tuple[int, ...]
    counts: npt.NDArray[np.int64]


def prefix_states(order: Sequence[Action]) -> RankStates:
    """The distinct states ``order`` passes through, so that ``peak_live_bytes`` takes the most of
    a sum linear in the state over a few states instead of walking the order: a long order repeats
    its steady state (1F1B at m 512 has 1,024 actions and at most 4 (p + 1) states).

    Raises:
        ValueError: an action kind other than F, B, I or W.
    """
    stages = tuple(sorted({a.stage for a in order}))
    index = {s: k for k, s in enumerate(stages)}
    kinds = [a.kind for a in order]
    for kind in kinds:
        if kind not in ("F", "B", "I", "W"):
            raise ValueError(f"action kind {kind!r} is invalid; expected 'F', 'B', 'I' or 'W'.")
    n, k = len(order), len(stages)
    column = np.fromiter((index[a.stage] for a in order), dtype=np.intp, count=n)
    row = np.arange(1, n + 1)  # after action i: row i + 1 (row 0: the empty prefix)
    backward = np.fromiter((kind in ("B", "W") for kind in kinds), dtype=bool, count=n)
    # each row's change: live microbatches per stage, then from which row on a stage has run its
    # first backward, then its last; the counts are their running sums
    change = np.zeros((n + 1, 3 * k), dtype=np.int64)
    change[row, column] = np.fromiter((kind == "F" for kind in kinds), dtype=np.int64, count=n) - backward
    rows, cols = row[backward], column[backward]
    first = np.full(k, n + 1)
    np.minimum.at(first, cols, rows)
    last = np.zeros(k, dtype=np.intp)
    np.maximum.at(last, cols, rows)
    ran = np.flatnonzero(first <= n)
    change[first[ran], k + ran] = 1
    change[last[ran], 2 * k + ran] = 1
    counts = np.cumsum(change, axis=0)
    # distinct rows, kept in the order the walk first meets them
    _, at = np.unique(counts, axis=0, return_index=True)
    return RankStates(stages, counts[np.sort(at)])


@lru_cache(maxsize=STATES_CACHED)
def rank_states(schedule: str, n_ranks: int, n_microbatches: int, stages_per_rank: int = 1) -> tuple[RankStates, ...]:
    """Every rank's ``prefix_states`` under a schedule, computed once per shape and kept (the last
    ``STATES_CACHED``: a few states a rank, where ``rank_orders`` keeps only a few shapes' orders).

    Raises:
        InfeasibleError: the schedule cannot run with these numbers (see ``check_schedule``).
    """
    return tuple(prefix_states(order) for order in rank_orders(schedule, n_ranks, n_microbatches, stages_per_rank))


def in_flight_per_stage(schedule: str, n_ranks: int, n_microbatches: int, stages_per_rank: int = 1) -> list[int]:
    """Peak live microbatches of every stage (index = global stage) under a schedule.

    GPipe holds all m microbatches on every stage and 1F1B ``min(m, p - i)`` on stage i (its
    warm-up); the other schedules' counts are read off their action orders (``in_flight_of``).
    Computed once per shape (the last ``IN_FLIGHT_CACHED`` are kept).

    Raises:
        InfeasibleError: the schedule cannot run with these numbers (see ``check_schedule``).
    """
    return list(_in_flight(schedule, n_ranks, n_microbatches, stages_per_rank))


@lru_cache(maxsize=IN_FLIGHT_CACHED)
def _in_flight(schedule: str, p: int, m: int, v: int) -> tuple[int, ...]:
    check_schedule(schedule, p, m, v)
    # closed forms, exact (tests/test_simulate.py checks them against the orders over every small shape)
    if schedule == "gpipe":
        return (m,) * p
    if schedule == "1f1b":
        return tuple(min(m, p - i) for i in range(p))
    return tuple(in_flight_of(rank_orders(schedule, p, m, v), p * v))


def _interleaved_live(p: int, m: int, v: int, zero_bubble: bool) -> tuple[int, ...]:
    """``live_at_first_backward`` of ``_interleaved``: a rank's forwards before its first backward are
    its warm-up (``_interleaved_warmup``) and, where a steady state follows, that state's first
    forward; forward step ``s`` runs stage chunk ``(s // per_round) % v``, so a chunk has run
    ``per_round`` forwards a whole cycle of ``v`` chunks and what the last partial cycle deals it;
    the fewest over the rank's ``v`` chunks."""
    out = []
    for r in range(p):
        per_round, warmup = _interleaved_warmup(r, p, m, v, zero_bubble)
        forwards = warmup + (1 if warmup < m * v else 0)
        cycles, rest = divmod(forwards, per_round * v)
        out.append(min(cycles * per_round + min(per_round, max(0, rest - j * per_round)) for j in range(v)))
    return tuple(out)


_LIVE_CLOSED: dict[str, Callable[[int, int, int], tuple[int, ...]]] = {
    "gpipe": lambda p, m, v: (m,) * p,  # every forward before the first backward
    "looped-bfs": lambda p, m, v: (m,) * p,
    "1f1b": lambda p, m, v: tuple(min(m, p - r) for r in range(p)),  # its warm-up
    "interleaved-1f1b": lambda p, m, v: _interleaved_live(p, m, v, zero_bubble=False),
    "interleaved-zb": lambda p, m, v: _interleaved_live(p, m, v, zero_bubble=True),
}
LIVE_CLOSED_FORMS = tuple(_LIVE_CLOSED)
"""The schedules whose ``live_at_first_backward`` is a closed form; the others' orders are built."""


def live_at_first_backward(
    schedule: str, n_ranks: int, n_microbatches: int, stages_per_rank: int = 1
) -> tuple[int, ...]:
    """Per rank, the fewest microbatches any of its stages holds when the rank starts its first
    backward: the forwards each stage has run by then (none freed yet), at least one (that
    backward's microbatch has gone through every stage of the rank before it). GPipe and looped
    breadth-first hold all m; 1F1B its warm-up, ``min(m, p - r)``; the interleaved schedules their
    warm-up and first steady forward dealt to the chunks (``_interleaved_live``); ZB-V and DualPipeV
    are read off their action orders. Computed once per shape (the last ``IN_FLIGHT_CACHED`` are kept).

    Raises:
        InfeasibleError: the schedule cannot run with these numbers (see ``check_schedule``).
    """
    return _live_at_first_backward(schedule, n_ranks, n_microbatches, stages_per_rank)


@lru_cache(maxsize=IN_FLIGHT_CACHED)
def _live_at_first_backward(schedule: str, p: int, m: int, v: int) -> tuple[int, ...]:
    check_schedule(schedule, p, m, v)
    # closed forms, exact (tests/test_simulate.py checks them against the orders over small shapes)
    if schedule in _LIVE_CLOSED:
        return _LIVE_CLOSED[schedule](p, m, v)
    out = []
    for order in action_order(schedule, p, m, v):  # (not rank_orders: its few cached shapes are the solver's)
        done = dict.fromkeys({a.stage for a in order}, 0)
        for a in order:
            if a.kind != "F":
                break
            done[a.stage] += 1
        out.append(min(done.values()))
    return tuple(out)


def in_flight_of(orders: Sequence[Sequence[Action]], n_stages: int) -> list[int]:
    """Peak live microbatches of every stage from the ranks' action orders (``action_order``), for a
    caller that has the orders already (at least 1 each: a stage always holds the microbatch it runs)."""
    out = [0] * n_stages
    for order in orders:
        for stage, peak in peak_in_flight(order).items():
            out[stage] = peak
    return [max(1, x) for x in out]
