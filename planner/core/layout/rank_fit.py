"""A layout's split whose every rank fits the per-rank memory limit, with several stages per rank.

The solver caps each stage's memory alone. With one stage per rank the cap is the limit. With ``v``
stages per rank the share ``limit / v`` is sure to fit a rank (each of its stages peaks below it),
but it is too tight where a rank's stages differ (an embedding's stage beside layers) or do not
peak at once (``planner.core.split.stage_plans.rank_memory_bytes``): it hides splits that fit, or makes them
recompute where the rank has room. Where the share's split fails or recomputes, ``rank_split``
therefore also solves under the whole limit and under caps bisected between the share and the
limit and, where none of those fits, raises the recomputation of the whole limit's split on the
ranks still over (``_escalate``); it lays out every split so made (its ranks' peaks,
``planner.core.split.stage_plans.laid_out``), times those whose rank peak fits and keeps the fastest.

Pure module: never imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from planner.core.layout.inputs import Constraints, Layout
from planner.core.levers.links import Links
from planner.core.levers.partial_recompute import Peaks, fewest_recomputed
from planner.core.split.cuts import Split
from planner.core.split.solve import policy_options, solve
from planner.core.split.solve_engine import legal_starts
from planner.core.split.stage_plans import LaidOut, StageMemo, laid_out
from planner.core.step.predict import timed
from planner.core.step.schedules import in_flight_per_stage, placement
from planner.errors import InfeasibleError
from planner.schema.costs import BlockCost, split_recompute
from planner.schema.plan import Prediction, StagePlan

RELAX_STEPS = 4
"""Bisection steps between the per-stage share ``limit / v`` and the whole limit."""

Predicted = tuple[list[StagePlan], Prediction]


def rank_split(
    blocks: Sequence[BlockCost], link: Links, layout: Layout, constraints: Constraints, slots: float | None
) -> Predicted:
    """The solver's split of ``layout``, its stages' memory capped so that every rank fits, predicted.

    One stage per rank (or no limit): the solver's split under the limit. ``v`` stages per rank:
    the split under the share ``limit / v``; where that fails, or recomputes under ``--recompute
    auto``, also the split under the whole limit as a stage's cap and, where its rank peak is over,
    splits under caps bisected between the two (``RELAX_STEPS``) and, where none fits, that split
    with more recomputation on its ranks that are over (``_escalate``, under ``auto``). The fastest whose rank peak fits
    wins (ties: the first tried, the share's); when none fits, the one needing the least memory
    (its prediction says how much).

    Args:
        blocks: per-block costs at the layout's microbatch size.
        link: the links of the layout's ranks.
        layout: the schedule, pipeline ranks, microbatches, stages per rank, replicas.
        constraints: the optimizer, the per-rank memory limit and the recompute policy.
        slots: ranks that compute at once (``planner.core.step.predict.predict``).

    Returns:
        The stages and the prediction of the split chosen.

    Raises:
        InfeasibleError: the solver finds no split, even with the whole limit as a stage's cap
            (its reason, naming the stages the layout needs).
    """
    limit, v = constraints.memory_limit_bytes, layout.stages_per_rank
    if limit is None or v == 1:
        return timed(_solved(blocks, link, layout, constraints, limit), blocks, layout, slots)
    # the splits under the caps below share most of their stages: each stage is laid out, and each
    # recomputing stage's peaks counted, once for all of them (the same figures, computed once)
    memo = _Memo()
    tried: list[LaidOut] = []
    try:
        tried.append(_solved(blocks, link, layout, constraints, limit // v, memo))
    except InfeasibleError:
        pass
    # relaxed only where the share may cost speed: it fits nothing, or it made "auto" recompute (an
    # explicit mode recomputes as asked, whatever the cap)
    if not tried or (constraints.recompute == "auto" and tried[0].split.recompute):
        _relax(blocks, link, layout, constraints, tried, memo)
    # only a split that fits can be chosen, and only its step decides: the rest are never timed, nor
    # is a split a smaller cap found again (the same figures: the first is kept on a tie anyway)
    fitting: list[Predicted] = []
    seen: set[tuple[tuple[int, ...], tuple[str, ...]]] = set()
    for t in tried:
        key = (t.split.starts, t.split.recompute)
        if t.max_memory_bytes <= limit and key not in seen:
            seen.add(key)
            fitting.append(timed(t, blocks, layout, slots))
    if fitting:
        return min(fitting, key=lambda t: t[1].step_time_s)
    return timed(min(tried, key=lambda t: t.max_memory_bytes), blocks, layout, slots)


def _relax(
    blocks: Sequence[BlockCost],
    link: Links,
    layout: Layout,
    constraints: Constraints,
    tried: list[LaidOut],
    memo: _Memo,
) -> None:
    """Add to ``tried`` the split under the whole limit as a stage's cap and, where its rank peak is
    over, the splits under caps bisected down towards ``limit / v``; where none of them fits, the
    whole limit's split with its over-limit ranks recomputing more (``_escalate``).

    Raises:
        InfeasibleError: no split under the whole limit, and none in ``tried``.
    """
    limit = constraints.memory_limit_bytes
    assert limit is not None
    try:
        whole = _solved(blocks, link, layout, constraints, limit, memo)
    except InfeasibleError:
        if tried:
            return
        raise
    tried.append(whole)
    if whole.max_memory_bytes <= limit:
        return
    lo, hi = limit // layout.stages_per_rank, limit
    for _ in range(RELAX_STEPS):
        cap = (lo + hi) // 2
        try:
            got = _solved(blocks, link, layout, constraints, cap, memo)
        except InfeasibleError:
            lo = cap  # the stages need a larger cap
            continue
        tried.append(got)
        if got.max_memory_bytes <= limit:
            lo = cap
        else:
            hi = cap
    if not any(t.max_memory_bytes <= limit for t in tried):
        # no cap fits a rank: recompute more where the whole limit's split is over
        tried.append(_escalate(blocks, link, layout, constraints, whole, memo.stages))


def _escalate(
    blocks: Sequence[BlockCost],
    link: Links,
    layout: Layout,
    constraints: Constraints,
    start: LaidOut,
    memo: StageMemo | None = None,
) -> LaidOut:
    """Under ``--recompute auto``, ``start`` (a split over the limit) with more recomputed: on every
    rank over the limit, the stage holding the most live activations moves one mode up (never, then
    selective where the schedule allows it, then full; a partial "mode:k" to its whole mode), again
    until every rank fits or no stage on an over-limit rank can recompute more.

    Returns:
        The split so recomputed, laid out (``start`` itself under another policy).
    """
    limit = constraints.memory_limit_bytes
    if constraints.recompute != "auto" or limit is None:
        return start
    ladder = [m for m in policy_options("auto", layout.schedule) if m in ("never", "selective", "full")]
    laid = start
    flags = laid.split.flags
    while laid.max_memory_bytes > limit:
        over = {r for r, b in enumerate(laid.rank_memory) if b > limit}
        raised = False
        for r in sorted(over):
            ups = [(st, up) for st in laid.stages if st.rank == r and (up := _next_mode(flags[st.index], ladder))]
            if not ups:
                continue
            top, up = max(ups, key=lambda su: (su[0].activation_bytes * su[0].in_flight, -su[0].index))
            flags[top.index] = up
            raised = True
        if not raised:
            break
        laid = laid_out(
            blocks, Split(starts=laid.split.starts, recompute=tuple(flags)), link, layout, constraints.optimizer, memo
        )
    return laid


def _next_mode(flag: str, ladder: Sequence[str]) -> str | None:
    """The recompute value one step up ``ladder`` from ``flag`` ("mode:k" goes to its whole mode;
    None: at the top, or "stage")."""
    mode, count = split_recompute(flag)
    if mode not in ladder:
        return None
    if count is not None:
        return mode
    k = ladder.index(mode)
    return ladder[k + 1] if k + 1 < len(ladder) else None


def _solved(
    blocks: Sequence[BlockCost],
    link: Links,
    layout: Layout,
    constraints: Constraints,
    cap: int | None,
    memo: _Memo | None = None,
) -> LaidOut:
    """The solver's split with every stage's memory under ``cap`` (None: no cap), its recomputing
    stages narrowed to their fewest regions, laid out on the ranks (not yet timed); ``memo`` keeps
    the stages and peaks of the other caps' splits of the layout.

    Raises:
        InfeasibleError: no split fits ``cap``; with several stages per rank the message names the
            stages the layout needs instead of the ranks.
    """
    pp, v = layout.pp, layout.stages_per_rank
    per_stage = replace(constraints, memory_limit_bytes=cap)
    # the counts given explicitly: the solver's error then names what does not fit this layout,
    # instead of searching other stage counts the layout does not allow
    in_flight = in_flight_per_stage(layout.schedule, pp, layout.n_microbatches, v)
    try:
        split = solve(blocks, link, layout, per_stage, in_flight)
    except InfeasibleError as e:
        if v == 1:
            raise
        # the solver counts stages, which the user asked for as --gpus x --stages-per-rank
        most = most_stages(blocks)
        if pp * v > most:
            raise InfeasibleError(too_many_stages(layout.schedule, pp, v, most)) from None
        raise InfeasibleError(
            f"{layout.schedule} with {v} stages per rank needs {pp * v} stages: {e}".replace(
                f"--gpus {pp * v}", f"{pp * v} stages"
            )
        ) from None
    split = fewest_recomputed(blocks, split, link, layout, per_stage, in_flight, memo.peaks if memo else None)
    return laid_out(blocks, split, link, layout, constraints.optimizer, memo.stages if memo else None)


def most_stages(blocks: Sequence[BlockCost]) -> int:
    """The most stages the blocks can be split into: one block each at most, cut where cuts are legal."""
    return min(len(blocks), sum(legal_starts(blocks)) + 1)


def too_many_stages(schedule: str, pp: int, v: int, most: int) -> str:
    """The error of a layout with more stages than the model's blocks allow, and what to change: the
    stages per rank (a V schedule has two, always), or the pipeline ranks.

    Args:
        schedule: the layout's schedule.
        pp: its pipeline ranks.
        v: its stages per rank.
        most: the most stages the blocks allow (``most_stages``).

    Returns:
        The message.
    """
    per_rank, ranks = most // pp, most // v
    hints = [f"--stages-per-rank {per_rank}" + _or_fewer(per_rank)] if placement(schedule) != "v" and per_rank else []
    hints += [f"{ranks} pipeline rank{'s' if ranks > 1 else ''}" + _or_fewer(ranks)] if ranks else []
    hints = hints or ["a schedule of one stage per rank"]
    return (
        f"{schedule} with {v} stages per rank needs {pp * v} stages, more than the {most} the model's blocks "
        f"allow (one stage per block at most, cut where a cut is legal); use "
        + ", ".join(hints)
        + ", or split the model into finer blocks"
    )


def _or_fewer(n: int) -> str:
    return " or fewer" if n > 1 else ""


@dataclass
class _Memo:
    """What the splits of one layout under several caps share (``rank_split``): the stages laid out
    (``StageMemo``) and each recomputing stage's peaks by region count (``fewest_recomputed``)."""

    stages: StageMemo = field(default_factory=StageMemo)
    peaks: Peaks = field(default_factory=dict)


__all__ = ["RELAX_STEPS", "most_stages", "rank_split", "too_many_stages"]
