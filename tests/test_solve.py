"""Pure-tier tests of planner.core.split.solve: exactness against brute force, hand cases, baselines, purity."""

from __future__ import annotations

import itertools
import math
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from plan_factory import ADAMW, assert_fit_limits_agree, memory_layout, predicted, solved

from planner.core.levers.casts import compiled_casts
from planner.core.levers.links import NodeLinks, boundary_crosses, boundary_links
from planner.core.levers.recompute import checkpoint_units, recompute_cost, selective_cost
from planner.core.split import solve as solve_mod
from planner.core.split.baselines import param_balanced, uniform_layers
from planner.core.split.cuts import Split
from planner.core.split.solve import policy_options
from planner.core.split.stage_model import (
    Partition,
    evaluate,
    stage_costs,
    stage_memories,
    stage_memory_bytes,
    stage_memory_parts,
    stage_time_parts,
)
from planner.core.step.schedules import in_flight_per_stage
from planner.errors import InfeasibleError
from planner.schema.costs import BlockCost, LinkCost, OptimizerSpec

FREE = LinkCost(name="free", latency_s=0.0, bandwidth_Bps=1.0)  # with cut_bytes=0: no communication
SGD = OptimizerSpec(name="sgd")
SCHEDULES = ("gpipe", "1f1b")  # the single-stage-per-rank schedules solve derives in-flight counts for


def blk(
    i: int,
    f: float,
    b: float = 0.0,
    *,
    params: int = 0,
    param_bytes: int = 0,
    act: int = 0,
    cut: int = 0,
    legal: bool = True,
    layer: bool = True,
    fc: float | None = None,
    bc: float | None = None,
) -> BlockCost:
    return BlockCost(
        fwd_cold_s=fc,
        bwd_cold_s=bc,
        name=f"b{i}",
        first_node=f"n{i}a",
        last_node=f"n{i}b",
        fwd_s=f,
        bwd_s=b,
        params=params,
        param_bytes=param_bytes,
        activation_bytes=act,
        cut_bytes=cut,
        cut_tensors=1,
        cut_legal=legal,
        is_layer=layer,
    )


def times(ts: list[float], **kw: object) -> list[BlockCost]:
    return [blk(i, t, **kw) for i, t in enumerate(ts)]  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Brute force
# ---------------------------------------------------------------------------------------------


def one_pipeline_bytes(
    blocks: Sequence[BlockCost], s: int, e: int, t: int, optimizer: OptimizerSpec, mode: str, m: int
) -> int:
    """``stage_memory_bytes`` of one pipeline (no replicas, one pass a step), whose gradients are freed
    between steps: none before a stage's first backward (``MemoryParts.peak``)."""
    return stage_memory_parts(blocks, s, e, optimizer, mode, m).peak(t, fresh_grads=True)


def brute(
    blocks: list[BlockCost],
    p: int,
    link: LinkCost,
    schedule: str,
    m: int,
    optimizer: OptimizerSpec,
    limit: int | None,
    recompute: str = "never",
    in_flight: Sequence[int] | None = None,
) -> list[tuple[tuple[int, ...], float, float]]:
    """Every feasible partition as (starts, bottleneck, sum of stage costs).

    Each stage takes the first option of its policy that fits: "never", "selective" and "full"
    allow only themselves ("always" is "full"); "auto" tries them in that order.
    """
    n = len(blocks)
    if p > n or (in_flight is None and schedule == "1f1b" and m < p):
        return []
    infl = in_flight_per_stage(schedule, p, m) if in_flight is None else list(in_flight)
    try:
        options = policy_options(recompute, schedule)
    except InfeasibleError:  # selective under a zero-bubble schedule: nothing can run
        return []
    cuts = [c for c in range(1, n) if blocks[c - 1].cut_legal]
    cap = math.inf if limit is None else limit
    out = []
    for combo in itertools.combinations(cuts, p - 1):
        starts = (0, *combo)
        ends = list(starts[1:]) + [n]
        flags = []
        for k, (s, e) in enumerate(zip(starts, ends)):
            fit = [r for r in options if one_pipeline_bytes(blocks, s, e, infl[k], optimizer, r, m) <= cap]
            flags.append(fit[0] if fit else None)
        if None in flags:
            continue
        costs = stage_costs(blocks, Split(starts=starts, recompute=tuple(flags)), link, schedule)
        out.append((starts, max(costs), sum(costs)))
    return out


# Times on a 0.01 grid and bandwidths that give comm times on a 0.001 grid: distinct partitions then
# differ by far more than the solver's 1e-9 tie tolerance, so "optimal" and "tied" mean the same
# thing to the solver and to brute force. (Free floats made hypothesis find partitions 8e-9 s apart,
# which the solver rightly treats as a tie and the strict brute force did not.)
time_st = st.integers(0, 500).map(lambda x: x / 100)


@st.composite
def instances(
    draw: st.DrawFn,
) -> tuple[list[BlockCost], int, LinkCost, str, int, OptimizerSpec, int | None, str]:
    n = draw(st.integers(1, 9))
    blocks = [
        blk(
            i,
            draw(time_st),
            draw(time_st),
            params=draw(st.integers(0, 50)),
            param_bytes=draw(st.integers(0, 200)),
            act=draw(st.integers(0, 100)),
            cut=draw(st.integers(0, 100)),
            legal=draw(st.booleans()) or draw(st.booleans()),  # 75 % legal
            fc=draw(st.one_of(st.none(), time_st)),  # cold starts, measured or not
            bc=draw(st.one_of(st.none(), time_st)),
        )
        for i in range(n)
    ]
    # selective checkpointing's kept bytes and recomputation, measured or not
    blocks = [
        b.model_copy(
            update={
                "selective_bytes": draw(st.one_of(st.none(), st.integers(0, b.activation_bytes))),
                "selective_recompute_s": draw(st.one_of(st.none(), time_st)),
                "bwd_temp_bytes": draw(st.one_of(st.none(), st.integers(0, 100))),
                # of the activations, autocast's weight copies (0: an fp32 plan)
                "weight_cast_bytes": min(b.activation_bytes, draw(st.sampled_from([0, 0, 30, 150]))),
            }
        )
        for b in blocks
    ]
    blocks[-1] = blocks[-1].model_copy(update={"loss_temp_bytes": draw(st.one_of(st.none(), st.integers(0, 300)))})
    p = draw(st.integers(1, n))
    link = LinkCost(
        name="l",
        latency_s=draw(st.sampled_from([0.0, 0.25, 1.0])),
        bandwidth_Bps=draw(st.sampled_from([10.0, 100.0, 1000.0])),
    )
    schedule = draw(st.sampled_from(SCHEDULES))
    m = draw(st.integers(1, 10))
    optimizer = draw(st.sampled_from([SGD, OptimizerSpec()]))
    limit = draw(st.one_of(st.none(), st.integers(0, 4000)))
    recompute = draw(st.sampled_from(["never", "auto", "always", "selective"]))
    return blocks, p, link, schedule, m, optimizer, limit, recompute


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(inst=instances())
def test_solve_matches_brute_force(
    inst: tuple[list[BlockCost], int, LinkCost, str, int, OptimizerSpec, int | None, str],
) -> None:
    blocks, p, link, schedule, m, optimizer, limit, recompute = inst
    feasible = brute(blocks, p, link, schedule, m, optimizer, limit, recompute)
    if not feasible:
        with pytest.raises(InfeasibleError) as err:
            solved(
                blocks,
                p,
                link,
                schedule=schedule,
                n_microbatches=m,
                optimizer=optimizer,
                memory_limit_bytes=limit,
                recompute=recompute,
            )
        msg = str(err.value)
        if "smallest stage count that fits is" in msg:
            q = int(msg.split("smallest stage count that fits is ")[1].split(":")[0])
            assert q > p and brute(blocks, q, link, schedule, m, optimizer, limit, recompute)
            for smaller in range(p + 1, q):
                if schedule == "gpipe" or m >= smaller:
                    assert not brute(blocks, smaller, link, schedule, m, optimizer, limit, recompute)
        return
    part = solved(
        blocks,
        p,
        link,
        schedule=schedule,
        n_microbatches=m,
        optimizer=optimizer,
        memory_limit_bytes=limit,
        recompute=recompute,
    )
    opt = min(b for _, b, _ in feasible)
    assert math.isclose(part.bottleneck_s, opt, rel_tol=1e-9, abs_tol=1e-12)
    optimal = [(s, b, c) for s, b, c in feasible if b <= opt + 1e-9 * max(1.0, opt)]
    assert part.starts in [s for s, _, _ in optimal]
    best_sum = min(c for _, _, c in optimal)
    ours_sum = sum(stage_costs(blocks, part, link))
    assert math.isclose(ours_sum, best_sum, rel_tol=1e-9, abs_tol=1e-12)
    tied = sorted(s for s, _, c in optimal if c <= best_sum + 1e-9 * max(1.0, best_sum))
    assert part.starts == tied[0]
    if limit is not None:
        assert max(stage_memories(blocks, part, schedule=schedule, n_microbatches=m, optimizer=optimizer)) <= limit


# ---------------------------------------------------------------------------------------------
# The O(p n^2) reference: the solver as it was before the block-range search, verbatim
# ---------------------------------------------------------------------------------------------

_Allowed = Callable[[int, int, int], bool]  # (start, end, stage index) -> stage may be placed
_StageCost = Callable[[int, int, int], float]  # (start, end, stage index) -> cost (inf: not allowed)
_REL_EPS = 1e-9


def _tol(x: float) -> float:
    return _REL_EPS * max(1.0, abs(x))


def _reference_dp(
    n: int,
    n_stages: int,
    legal_cut: Sequence[bool],
    primary: _StageCost,
    secondary: _StageCost,
    allowed: _Allowed,
    latest: bool = False,
) -> tuple[int, ...] | None:
    """Exact partition of ``n`` items into ``n_stages`` contiguous non-empty stages, O(p n^2).

    Minimises max ``primary[s][e]`` over stages; among partitions within ``_REL_EPS`` of that optimum,
    minimises the sum of ``secondary[s][e]``; among those, returns the lexicographically smallest
    starts (largest with ``latest``).
    """
    p = n_stages
    inf = math.inf

    def ends(k: int, s: int) -> range:
        # Stage k must leave at least one item for each later stage; the last stage ends at n.
        if k == p - 1:
            return range(n, n + 1)
        return range(s + 1, n - (p - 1 - k) + 1)

    def ok_end(k: int, e: int) -> bool:
        return k == p - 1 or legal_cut[e]

    # Pass 1: best[e] = smallest bottleneck covering [0, e) with stages 0..k.
    best = [inf] * (n + 1)
    for e in ends(0, 0):
        if ok_end(0, e) and allowed(0, e, 0):
            best[e] = primary(0, e, 0)
    for k in range(1, p):
        cur = [inf] * (n + 1)
        for s in range(k, n):
            if best[s] == inf:
                continue
            bs = best[s]
            for e in ends(k, s):
                if not ok_end(k, e):
                    continue
                c = primary(s, e, k)
                v = c if c > bs else bs
                if v < cur[e] and allowed(s, e, k):
                    cur[e] = v
        best = cur
    opt = best[n]
    if opt == inf:
        return None
    thr = opt + _tol(opt)

    # Pass 2: suffix DP. suf[k][s] = least sum of secondary covering [s, n) with stages k..p-1,
    # every stage's primary within the optimum bottleneck.
    suf: list[list[float]] = [[inf] * (n + 1) for _ in range(p + 1)]
    suf[p][n] = 0.0
    for k in range(p - 1, -1, -1):
        starts_k = range(0, 1) if k == 0 else range(k, n)
        for s in starts_k:
            if k > 0 and not legal_cut[s]:
                continue
            m = inf
            for e in ends(k, s):
                nxt = suf[k + 1][e]
                if nxt == inf or not ok_end(k, e) or primary(s, e, k) > thr:
                    continue
                v = secondary(s, e, k) + nxt
                if v < m and allowed(s, e, k):
                    m = v
            suf[k][s] = m
    # Forward reconstruction: the smallest (largest with ``latest``) next start achieving the minimum
    # sum gives the lexicographically smallest (largest) starts.
    starts = [0]
    s = 0
    for k in range(p - 1):
        target = suf[k][s]
        for e in reversed(ends(k, s)) if latest else ends(k, s):
            nxt = suf[k + 1][e]
            if nxt == inf or not ok_end(k, e) or primary(s, e, k) > thr or not allowed(s, e, k):
                continue
            if secondary(s, e, k) + nxt <= target + _tol(target):
                starts.append(e)
                s = e
                break
        else:
            raise RuntimeError("partition DP reconstruction failed (planner bug)")
    return tuple(starts)


def _reference_cost_matrix(
    blocks: Sequence[BlockCost],
    link: LinkCost,
    link_out: LinkCost | None = None,
    cross_in: bool = True,
    cross_out: bool = True,
) -> list[list[float]]:
    """Stage costs ``[s][e]`` with messages in over ``link`` and out over ``link_out`` (default: the
    same); a boundary inside one rank (``cross_in`` / ``cross_out`` False) costs nothing."""
    n = len(blocks)
    out = link_out or link
    pre = [0.0]
    for b in blocks:
        pre.append(pre[-1] + b.fwd_s + b.bwd_s)
    # the receiver of a boundary starts cold: the first block's forward after it, the last block's
    # backward before it
    send_in = [0.0] + [
        2 * link.send_s(blocks[s - 1].cut_bytes) + (blocks[s].fwd_cold_s or 0.0) if cross_in else 0.0
        for s in range(1, n)
    ]
    send_out = (
        [0.0]
        + [
            2 * out.send_s(blocks[e - 1].cut_bytes) + (blocks[e - 1].bwd_cold_s or 0.0) if cross_out else 0.0
            for e in range(1, n)
        ]
        + [0.0]
    )
    mat = [[math.inf] * (n + 1) for _ in range(n + 1)]
    for s in range(n):
        for e in range(s + 1, n + 1):
            mat[s][e] = (pre[e] - pre[s]) + send_in[s] + send_out[e]
    return mat


def _legal_starts(blocks: Sequence[BlockCost]) -> list[bool]:
    """``legal[c]``: a stage may start at block c (a cut after block c - 1 is legal), 1 <= c < n."""
    return [False] + [b.cut_legal for b in blocks[:-1]] + [False]


def _reference_choice(
    blocks: Sequence[BlockCost], optimizer: OptimizerSpec, limit: float, options: Sequence[str], m: int
) -> Callable[[int, int, int], str | None]:
    """How stage [s, e) holding t live microbatches recomputes (the first of the policy's modes that
    fits), or None when none fits, from the public memory formula (``one_pipeline_bytes``)."""

    def choice(s: int, e: int, t: int) -> str | None:
        for option in options:
            if one_pipeline_bytes(blocks, s, e, t, optimizer, option, m) <= limit:
                return option
        return None

    return choice


def _reference_solve(
    blocks: Sequence[BlockCost],
    n_stages: int,
    link: LinkCost | Sequence[LinkCost],
    *,
    schedule: str = "1f1b",
    n_microbatches: int,
    optimizer: OptimizerSpec = ADAMW,
    memory_limit_bytes: int | None = None,
    recompute: str = "auto",
    in_flight: Sequence[int] | None = None,
) -> Partition | None:
    """The exact split on the O(p n^2) programme, each stage's memory by ``stage_memory_bytes``:
    None when no split fits the memory limit.

    Raises:
        InfeasibleError: the schedule refuses these numbers (its own check, ``in_flight_per_stage``).
    """
    infl = list(in_flight) if in_flight is not None else in_flight_per_stage(schedule, n_stages, n_microbatches)
    n = len(blocks)
    # stage k's messages go in over boundary k - 1's link and out over boundary k's
    links = boundary_links(link, n_stages, schedule)
    edge = [links[0] if links else FREE, *links, links[-1] if links else FREE]
    crosses = [True, *boundary_crosses(n_stages, schedule), True]
    plains = [_reference_cost_matrix(blocks, edge[k], edge[k + 1], crosses[k], crosses[k + 1]) for k in range(n_stages)]
    extra = {"full": [0.0], "selective": [0.0], "fwd": [0.0], "never": [0.0] * (len(blocks) + 1)}
    for i, b in enumerate(blocks):
        # a block whose end is no legal cut shares its region with the next: it re-runs in full
        extra["full"].append(extra["full"][-1] + (recompute_cost(b) if b.cut_legal or i == n - 1 else b.fwd_s))
        extra["selective"].append(extra["selective"][-1] + selective_cost(b))
        extra["fwd"].append(extra["fwd"][-1] + b.fwd_s)  # "stage": every block's forward but the last's
    limit = memory_limit_bytes if memory_limit_bytes is not None else math.inf
    mode = "never" if memory_limit_bytes is None and recompute == "auto" else recompute
    fit = _reference_choice(blocks, optimizer, limit, policy_options(mode, schedule), n_microbatches)

    def choice(s: int, e: int, k: int) -> str | None:
        return fit(s, e, infl[k])

    def cost(s: int, e: int, k: int) -> float:
        c = choice(s, e, k)
        if c is None:
            return math.inf
        if c == "stage":  # one region: all but the last block re-run whole, the last up to its last saved tensor
            return plains[k][s][e] + ((extra["fwd"][e - 1] - extra["fwd"][s]) + recompute_cost(blocks[e - 1]))
        rerun = extra[c]
        return plains[k][s][e] + (rerun[e] - rerun[s] if c != "never" else 0.0)

    allowed: _Allowed = lambda s, e, k: choice(s, e, k) is not None  # noqa: E731
    starts = _reference_dp(n, n_stages, _legal_starts(blocks), cost, cost, allowed)
    if starts is None:
        return None
    ends = [*starts[1:], n]
    flags = [choice(s, e, k) or "never" for k, (s, e) in enumerate(zip(starts, ends))]
    return evaluate(blocks, Split(starts=tuple(starts), recompute=tuple(flags)), link, schedule)


def _too_few_cuts(blocks: Sequence[BlockCost], n_stages: int) -> bool:
    return n_stages > len(blocks) or sum(_legal_starts(blocks)) < n_stages - 1


def assert_agrees_with_reference(
    blocks: Sequence[BlockCost], p: int, link: LinkCost | Sequence[LinkCost], kw: dict[str, Any]
) -> None:
    """``solve`` returns the reference's very partition, and refuses exactly what the reference
    cannot split. When nothing fits and the message names the smallest stage count that would,
    the reference splits the model into that many stages and into none of the counts between."""
    ours = outcome(solved, blocks, p, link, **kw)
    if _too_few_cuts(blocks, p):
        assert isinstance(ours, tuple) and ours[0] == "InfeasibleError", ours
        return
    try:
        ref = _reference_solve(blocks, p, link, **kw)
    except InfeasibleError as e:  # the schedule refuses the numbers: both say so in its words
        assert ours == ("InfeasibleError", str(e))
        return
    if ref is not None:
        assert repr(ours) == repr(ref)
        return
    assert isinstance(ours, tuple) and ours[0] == "InfeasibleError", ours
    assert "--memory-limit" in ours[1]
    named = re.search(r"the smallest stage count that fits is (\d+)", ours[1])
    if named is None:
        return
    q = int(named.group(1))
    assert kw.get("in_flight") is None and p < q and not _too_few_cuts(blocks, q)
    assert _reference_solve(blocks, q, FREE, **kw) is not None
    for r in range(p + 1, q):
        if _too_few_cuts(blocks, r):
            continue
        try:
            assert _reference_solve(blocks, r, FREE, **kw) is None
        except InfeasibleError:
            continue  # the schedule refuses r stages (1F1B: fewer microbatches than stages)


def _reference_param_balanced(blocks: Sequence[BlockCost], n_stages: int, link: LinkCost) -> Partition:
    if _too_few_cuts(blocks, n_stages):
        raise InfeasibleError("too few blocks or legal cuts")
    n = len(blocks)
    pre = [0]
    for b in blocks:
        pre.append(pre[-1] + b.params)
    params = [[float(pre[e] - pre[s]) if e > s else math.inf for e in range(n + 1)] for s in range(n + 1)]
    cost: _StageCost = lambda s, e, k: params[s][e]  # noqa: E731
    starts = _reference_dp(n, n_stages, _legal_starts(blocks), cost, cost, lambda s, e, k: True, latest=True)
    assert starts is not None
    return evaluate(blocks, Split(starts=tuple(starts)), link)


def outcome(fn: Callable[..., Partition], *args: object, **kw: object) -> Partition | tuple[str, str]:
    """The partition, or the error's type and message: what two solvers must agree on."""
    try:
        return fn(*args, **kw)
    except (InfeasibleError, RuntimeError) as err:
        return type(err).__name__, str(err)


# ---------------------------------------------------------------------------------------------
# The block-range search against the O(p n^2) reference
# ---------------------------------------------------------------------------------------------

Request = tuple[list[BlockCost], int, LinkCost, dict[str, Any]]


@st.composite
def requests(draw: st.DrawFn, ties: bool) -> Request:
    """A random ``solve`` request, keyword arguments included.

    With ``ties`` every time and message cost is a small integer, so many partitions share the
    bottleneck and the sum and the tie-breaks decide; otherwise costs are free floats, where the two
    solvers must agree to the last bit of every sum they compare.
    """
    n = draw(st.integers(1, 11))
    secs = st.integers(0, 3).map(float) if ties else st.floats(0.0, 5.0, allow_nan=False, allow_infinity=False)
    blocks = [
        BlockCost(
            name=f"b{i}",
            first_node=f"n{i}a",
            last_node=f"n{i}b",
            fwd_s=draw(secs),
            bwd_s=draw(secs),
            recompute_s=draw(st.one_of(st.none(), secs)),
            selective_recompute_s=draw(st.one_of(st.none(), secs)),
            selective_bytes=draw(st.one_of(st.none(), st.integers(0, 100))),
            bwd_temp_bytes=draw(st.one_of(st.none(), st.integers(0, 100))),
            params=draw(st.integers(0, 50)),
            param_bytes=draw(st.integers(0, 200)),
            activation_bytes=draw(st.integers(0, 100)),
            cut_bytes=draw(st.integers(0, 3) if ties else st.integers(0, 100)),
            cut_tensors=1,
            output_bytes=draw(st.integers(0, 100)) if i == n - 1 else 0,
            loss_temp_bytes=draw(st.one_of(st.none(), st.integers(0, 300))) if i == n - 1 else None,
            cut_legal=draw(st.booleans()) or draw(st.booleans()),  # 75 % legal
            is_layer=True,
        )
        for i in range(n)
    ]
    p = draw(st.integers(1, n))
    if ties:
        link = LinkCost(name="l", latency_s=float(draw(st.integers(0, 2))), bandwidth_Bps=1.0)
    else:
        link = LinkCost(
            name="l",
            latency_s=draw(st.sampled_from([0.0, 0.013, 0.25, 1.0])),
            bandwidth_Bps=draw(st.sampled_from([7.3, 10.0, 100.0, 1000.0])),
        )
    m = draw(st.integers(1, 10))
    kw: dict[str, Any] = {
        "schedule": draw(st.sampled_from(SCHEDULES)),
        "n_microbatches": m,
        "optimizer": draw(st.sampled_from([SGD, OptimizerSpec()])),
        "memory_limit_bytes": draw(st.one_of(st.none(), st.integers(0, 4000))),
        "recompute": draw(st.sampled_from(["never", "auto", "always", "selective", "full", "stage"])),
    }
    if draw(st.integers(0, 3)) == 0:  # explicit counts, as a schedule with several stages per rank gives
        kw["in_flight"] = draw(st.lists(st.integers(0, 6), min_size=p, max_size=p))
        if p % 2 == 0 and draw(st.booleans()):  # a V: the turn between stages p/2 - 1 and p/2 stays on one rank
            kw["schedule"] = draw(st.sampled_from(["zbv", "dualpipev"]))
    return blocks, p, link, kw


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(req=requests(ties=False))
def test_solve_matches_reference_dp(req: Request) -> None:
    blocks, p, link, kw = req
    assert_agrees_with_reference(blocks, p, link, kw)


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(req=requests(ties=True))
def test_solve_matches_reference_dp_with_ties(req: Request) -> None:
    blocks, p, link, kw = req
    assert_agrees_with_reference(blocks, p, link, kw)


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(req=requests(ties=True))
def test_solve_with_in_flight_matches_brute_force(req: Request) -> None:
    blocks, p, link, kw = req
    infl = kw.get("in_flight") or [kw["n_microbatches"]] * p
    kw = {**kw, "in_flight": infl}
    _solve_as_brute_force(blocks, p, link, kw)


def _solve_as_brute_force(blocks: list[BlockCost], p: int, link: LinkCost, kw: dict[str, Any]) -> None:
    """``solve`` with explicit ``in_flight`` against ``brute``: it refuses exactly when nothing fits,
    else finds the optimal bottleneck and picks the least total cost among the splits that reach it,
    then the smallest starts."""
    args = (kw["schedule"], kw["n_microbatches"], kw["optimizer"], kw["memory_limit_bytes"], kw["recompute"])
    feasible = brute(blocks, p, link, *args, in_flight=kw["in_flight"])
    if not feasible:
        with pytest.raises(InfeasibleError):
            solved(blocks, p, link, **kw)
        return
    part = solved(blocks, p, link, **kw)
    opt = min(b for _, b, _ in feasible)
    assert math.isclose(part.bottleneck_s, opt, rel_tol=1e-9, abs_tol=1e-12)
    optimal = [(s, c) for s, b, c in feasible if b <= opt + 1e-9 * max(1.0, opt)]
    best_sum = min(c for _, c in optimal)  # costs on a grid: ties are exact, so the tolerance changes nothing
    assert part.starts == min(s for s, c in optimal if c <= best_sum + 1e-9 * max(1.0, best_sum))


def test_each_recompute_mode_reruns_what_its_regions_rerun() -> None:
    # block by block each region re-runs up to its last saved tensor (recompute_s, selective_recompute_s);
    # one region over the stage re-runs every block but the last whole (later blocks need their outputs)
    rec, sel = [0.5, 1.0, 0.25], [0.125, 0.25, 0.375]
    blocks = [
        b.model_copy(update={"recompute_s": r, "selective_recompute_s": q})
        for b, r, q in zip(times([1.0, 2.0, 4.0], b=8.0), rec, sel)
    ]
    backward = {mode: stage_time_parts(blocks, 0, 3, FREE, mode)[1] for mode in ("never", "selective", "full", "stage")}
    assert backward == {"never": 24.0, "selective": 24.75, "full": 25.75, "stage": 27.25}
    assert stage_time_parts(blocks, 1, 2, FREE, "stage")[1] == stage_time_parts(blocks, 1, 2, FREE, "full")[1] == 9.0
    # block 0's end is no legal cut: it shares its region with block 1 and re-runs in full under full mode
    merged = [blocks[0].model_copy(update={"cut_legal": False}), *blocks[1:]]
    assert stage_time_parts(merged, 0, 3, FREE, "full")[1] == 24.0 + 1.0 + 1.0 + 0.25
    assert stage_time_parts(merged, 0, 3, FREE, "selective")[1] == backward["selective"]


@pytest.mark.parametrize("field", ["recompute_s", "bwd_input_s", "bwd_weight_s", "opt_s"])
def test_infinite_costs_are_refused_by_the_schema(field: str) -> None:
    # The solver's windows rely on finite costs: the schema never lets an infinite one in.
    with pytest.raises(ValueError):
        BlockCost.model_validate({**blk(0, 1.0).model_dump(), field: math.inf})
    with pytest.raises(ValueError):
        LinkCost(name="l", latency_s=math.inf, bandwidth_Bps=10.0)


@st.composite
def param_instances(draw: st.DrawFn) -> tuple[list[BlockCost], int]:
    n = draw(st.integers(1, 11))
    params = st.integers(0, 3) if draw(st.booleans()) else st.integers(0, 10**15)
    blocks = [blk(i, 1.0, params=draw(params), legal=draw(st.booleans()) or draw(st.booleans())) for i in range(n)]
    return blocks, draw(st.integers(1, n))


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(inst=param_instances())
def test_param_balanced_matches_reference_dp_and_brute_force(inst: tuple[list[BlockCost], int]) -> None:
    blocks, p = inst
    ours = outcome(param_balanced, blocks, p, FREE)
    if _too_few_cuts(blocks, p):
        assert isinstance(ours, tuple) and ours[0] == "InfeasibleError"
    else:
        assert repr(ours) == repr(_reference_param_balanced(blocks, p, FREE))
    n = len(blocks)
    cuts = [c for c in range(1, n) if blocks[c - 1].cut_legal]
    splits = [(0, *combo) for combo in itertools.combinations(cuts, p - 1)]
    if not splits:
        assert isinstance(ours, tuple)
        return
    assert isinstance(ours, Partition)

    def worst(starts: tuple[int, ...]) -> float:
        ends = list(starts[1:]) + [n]
        return max(float(sum(b.params for b in blocks[s:e])) for s, e in zip(starts, ends))

    opt = min(worst(s) for s in splits)
    # every split has the same total, so the least-sum tie-break is moot: the largest starts win
    assert ours.starts == max(s for s in splits if worst(s) <= opt + 1e-9 * max(1.0, opt))


@st.composite
def memory_instances(draw: st.DrawFn) -> tuple[list[BlockCost], int, int, OptimizerSpec, str, list[int]]:
    """Blocks whose byte counts may be huge (beyond int64 once multiplied), a limit and counts."""
    n = draw(st.integers(1, 7))
    scale = draw(st.sampled_from([1, 2**40, 2**62]))
    bytes_st = st.integers(0, 200).map(lambda x: x * scale)
    blocks = [
        BlockCost(
            name=f"b{i}",
            first_node=f"n{i}a",
            last_node=f"n{i}b",
            fwd_s=1.0,
            bwd_s=1.0,
            params=draw(st.integers(0, 50)) * scale,
            param_bytes=draw(bytes_st),
            activation_bytes=draw(bytes_st),
            cut_bytes=draw(bytes_st),
            cut_tensors=1,
            output_bytes=draw(bytes_st),
            selective_bytes=draw(st.one_of(st.none(), bytes_st)),
            bwd_temp_bytes=draw(st.one_of(st.none(), bytes_st)),
            loss_bytes=draw(st.one_of(st.none(), bytes_st)) if i == n - 1 else None,
            loss_temp_bytes=draw(st.one_of(st.none(), bytes_st)) if i == n - 1 else None,
            cut_legal=draw(st.booleans()) or draw(st.booleans()),  # regions of one block or several
            is_layer=True,
        )
        for i in range(n)
    ]
    # of the activations, autocast's weight copies (or none)
    blocks = [b.model_copy(update={"weight_cast_bytes": min(b.activation_bytes, draw(bytes_st))}) for b in blocks]
    if draw(st.booleans()):  # what FSDP shards beyond what a rank holds (expert parallelism's whole experts)
        blocks = [
            b.model_copy(update={"fsdp_params": b.params * k, "fsdp_param_bytes": b.param_bytes * k})
            for b, k in zip(blocks, draw(st.lists(st.integers(1, 8), min_size=n, max_size=n)))
        ]
    limit = draw(st.integers(-5, 6000)) * scale
    infl = draw(st.lists(st.integers(0, 9), min_size=1, max_size=4))
    return (
        blocks,
        limit,
        draw(st.integers(1, 9)),
        draw(st.sampled_from([SGD, OptimizerSpec()])),
        draw(st.sampled_from(["never", "auto", "always", "selective"])),
        infl,
    )


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(inst=memory_instances(), shard=st.sampled_from([1, 1, 2, 3]), per_block=st.booleans(), fresh=st.booleans())
def test_vector_memory_check_matches_scalar(
    inst: tuple[list[BlockCost], int, int, OptimizerSpec, str, list[int]], shard: int, per_block: bool, fresh: bool
) -> None:
    # The search turns each stage's fit into in-flight thresholds on arrays (int64, or Python
    # integers past int64) and bounds the fitting ends per start; both must agree with _MemoryModel
    # (stage_memory_bytes) for every stage and count, including fp32-master flips that make memory
    # shrink as a stage grows, sharded by FSDP per stage or block by block, with the gradients
    # freed between steps (none before a stage's first backward) or kept.
    blocks, limit, m, optimizer, mode, infl = inst
    n = len(blocks)
    mem = solve_mod._MemoryModel(
        blocks, optimizer, limit, mode, memory_layout(m, shard, per_block and shard > 1, fresh)
    )
    link = LinkCost(name="l", latency_s=0.0, bandwidth_Bps=1.0)
    arrays = solve_mod._Arrays(blocks, link, mem, mode, infl)
    legal = _legal_starts(blocks)
    heads = [s for s in range(n) if s == 0 or legal[s]]  # stages start and end at legal cuts
    pairs = [(s, e) for s in heads for e in range(s + 1, n + 1) if e == n or legal[e]]
    assert_fit_limits_agree(mem, arrays, pairs, infl)


def test_in_flight_keyword() -> None:
    # 100 activation bytes per block and microbatch, as test_memory_uses_in_flight_of_each_stage.
    blocks = times([1, 1, 1, 1], act=100)
    kw: dict[str, Any] = {"n_microbatches": 4, "memory_limit_bytes": 350, "recompute": "never"}
    derived = solved(blocks, 2, FREE, schedule="1f1b", **kw)
    assert solved(blocks, 2, FREE, schedule="1f1b", in_flight=[2, 1], **kw) == derived
    # counts reversed: now the last stage holds 2 and must be the short one
    assert solved(blocks, 2, FREE, in_flight=[1, 2], **kw).starts == (0, 3)
    # the counts replace the schedule's, so its own checks do not apply (1F1B would need m >= 3)
    assert solved(blocks, 3, FREE, schedule="1f1b", n_microbatches=1, in_flight=[1, 1, 1]).starts == (0, 1, 2)
    with pytest.raises(InfeasibleError, match="in_flight has 3 entries for 2 stages"):
        solved(blocks, 2, FREE, n_microbatches=4, in_flight=[1, 1, 1])
    with pytest.raises(InfeasibleError, match="expected whole numbers >= 0"):
        solved(blocks, 2, FREE, n_microbatches=4, in_flight=[1, -1])
    with pytest.raises(InfeasibleError, match="need at least one microbatch"):
        solved(blocks, 2, FREE, n_microbatches=0, in_flight=[1, 1])
    # Nothing fits: no search over other stage counts (the counts are the caller's); the message names
    # a block with the fewest live microbatches any stage it can be on holds, or says the split fails.
    with pytest.raises(InfeasibleError, match=r"block 'b0' alone needs 400 bytes .* 4 microbatch\(es\)"):
        solved(blocks, 2, FREE, in_flight=[4, 2], **kw)
    with pytest.raises(InfeasibleError, match=r"no split into 2 stages fits with \[3, 3\] microbatches in flight"):
        solved(blocks, 2, FREE, n_microbatches=4, memory_limit_bytes=399, recompute="never", in_flight=[3, 3])


@pytest.mark.slow
def test_memory_error_search_matches_reference() -> None:
    # The smallest-stage-count search (GPipe: one count per layer, 1F1B: up to m) and its fallbacks.
    link = LinkCost(name="l", latency_s=1e-3, bandwidth_Bps=1e9)
    rng = np.random.default_rng(7)
    blocks = [
        blk(i, float(rng.uniform(0.5, 1.5)), 0.01, param_bytes=int(rng.integers(50, 150)), act=20, cut=8)
        for i in range(40)
    ]
    for schedule, m, limit in [
        ("gpipe", 4, 900),
        ("gpipe", 4, 300),
        ("gpipe", 4, 10),
        ("1f1b", 12, 900),
        ("1f1b", 6, 900),
        ("1f1b", 12, 10),
    ]:
        kw: dict[str, Any] = {"schedule": schedule, "n_microbatches": m, "memory_limit_bytes": limit}
        kw["optimizer"] = SGD
        assert isinstance(outcome(solved, blocks, 3, link, **kw), tuple)  # nothing fits
        assert_agrees_with_reference(blocks, 3, link, kw)


def test_2000_blocks_64_stages_complete() -> None:
    # The scale the search is built for (timings: bench/solver_scaling.py, docs/solver_scaling.md).
    rng = np.random.default_rng(0)
    link = LinkCost(name="l", latency_s=1e-4, bandwidth_Bps=1e10)
    blocks = [
        blk(i, float(f), float(2 * f), param_bytes=10**6, act=10**5, cut=4096, legal=bool(i % 5))
        for i, f in enumerate(rng.uniform(0.5, 1.5, 2000) * 1e-3)
    ]
    free = solved(blocks, 64, link, n_microbatches=64)
    assert len(free.starts) == 64
    limited = solved(blocks, 64, link, n_microbatches=64, memory_limit_bytes=2 * 10**8, recompute="never")
    assert max(stage_memories(blocks, limited, schedule="1f1b", n_microbatches=64)) <= 2 * 10**8
    assert limited.bottleneck_s >= free.bottleneck_s
    with pytest.raises(InfeasibleError, match="smallest stage count that fits is"):
        solved(blocks, 64, link, n_microbatches=64, memory_limit_bytes=10**8, schedule="gpipe", recompute="never")


# ---------------------------------------------------------------------------------------------
# Hand cases
# ---------------------------------------------------------------------------------------------


def test_even_split() -> None:
    assert solved(times([1, 1, 1, 1]), 2, FREE, n_microbatches=4) == Partition(starts=(0, 2), bottleneck_s=2.0)


def test_heavy_first_block() -> None:
    assert solved(times([4, 1, 1, 1, 1]), 2, FREE, n_microbatches=4) == Partition(starts=(0, 1), bottleneck_s=4.0)


def test_equal_bottleneck_prefers_smallest_starts() -> None:
    # (0,1): max(1, 3) = 3; (0,2): max(3, 1) = 3; same total -> lexicographically smallest.
    assert solved(times([1, 2, 1]), 2, FREE, n_microbatches=2).starts == (0, 1)


def test_equal_bottleneck_prefers_less_communication() -> None:
    # link 10 B/s, no latency: cut after b0 costs 0.1 s per message, after b1 0.5 s, after b2 0.1 s.
    link = LinkCost(name="slow", latency_s=0.0, bandwidth_Bps=10.0)
    blocks = [blk(0, 4.0, cut=1), blk(1, 1.0, cut=5), blk(2, 1.0, cut=1), blk(3, 1.0, cut=0)]
    # (0,1,2): 4.2, 2.2, 3.0 (sum 9.4); (0,1,3): 4.2, 2.4, 1.2 (sum 7.8): same bottleneck 4.2.
    part = solved(blocks, 3, link, n_microbatches=4)
    assert part.starts == (0, 1, 3)
    assert math.isclose(part.bottleneck_s, 4.2)
    assert [round(c, 12) for c in stage_costs(blocks, Split(starts=(0, 1, 3)), link)] == [4.2, 2.4, 1.2]
    assert math.isclose(stage_time_parts(blocks, 1, 3, link)[2], 0.2)  # per direction; gradients pay the same


def test_big_head_beats_uniform_layers() -> None:
    # embedding (1 s, not a layer) + 8 layers (1 s) + vocabulary head (4 s, not a layer), 2 stages.
    blocks = [blk(0, 1.0, layer=False)] + [blk(i, 1.0) for i in range(1, 9)] + [blk(9, 4.0, layer=False)]
    uni = uniform_layers(blocks, 2, FREE)
    assert uni == Partition(starts=(0, 5), bottleneck_s=8.0)  # 1 + 4 layers | 4 layers + head
    best = solved(blocks, 2, FREE, n_microbatches=8)
    # (0,6): 6 | 7 and (0,7): 7 | 6 tie at 7 with equal sums -> smallest starts.
    assert best == Partition(starts=(0, 6), bottleneck_s=7.0)


def test_illegal_cut_forces_other_split() -> None:
    blocks = times([1, 1, 1, 1])
    blocks[1] = blk(1, 1.0, legal=False)  # no cut between b1 and b2
    assert solved(blocks, 2, FREE, n_microbatches=2) == Partition(starts=(0, 1), bottleneck_s=3.0)
    with pytest.raises(InfeasibleError, match="not legal"):
        evaluate(blocks, Split(starts=(0, 2)), FREE)


def test_too_few_legal_cuts_or_blocks() -> None:
    blocks = [blk(0, 1.0, legal=False), blk(1, 1.0, legal=False), blk(2, 1.0)]
    with pytest.raises(InfeasibleError, match="only 0 legal cut"):
        solved(blocks, 2, FREE, n_microbatches=2)
    with pytest.raises(InfeasibleError, match="is more than the model's 3 blocks"):
        solved(blocks, 4, FREE, n_microbatches=4)
    with pytest.raises(InfeasibleError, match="needs at least one microbatch per stage"):
        solved(times([1, 1, 1]), 3, FREE, n_microbatches=2, schedule="1f1b")


def test_memory_limit_forces_split_and_names_stage_count() -> None:
    # sgd: params + grads = 2 * 100 = 200 bytes per block; limit 400 -> at most 2 blocks per stage.
    blocks = times([3, 1, 1, 1], param_bytes=100)
    assert solved(blocks, 2, FREE, n_microbatches=1, schedule="gpipe", optimizer=SGD).starts == (0, 1)
    limited = solved(blocks, 2, FREE, n_microbatches=1, schedule="gpipe", optimizer=SGD, memory_limit_bytes=400)
    assert limited == Partition(starts=(0, 2), bottleneck_s=4.0)
    with pytest.raises(InfeasibleError, match="smallest stage count that fits is 2"):
        solved(blocks, 1, FREE, n_microbatches=1, schedule="gpipe", optimizer=SGD, memory_limit_bytes=400)
    with pytest.raises(InfeasibleError, match="block 'b0' alone needs 200 bytes"):
        solved(blocks, 1, FREE, n_microbatches=1, schedule="gpipe", optimizer=SGD, memory_limit_bytes=150)


def test_memory_uses_in_flight_of_each_stage() -> None:
    # 100 activation bytes per block and microbatch; 1F1B, p=2, m=4: stage 0 holds 2, stage 1 holds 1.
    blocks = times([1, 1, 1, 1], act=100)
    part = solved(blocks, 2, FREE, n_microbatches=4, schedule="1f1b", memory_limit_bytes=350, recompute="never")
    assert part == Partition(starts=(0, 1), bottleneck_s=3.0)  # (0,2) would need 400 on stage 0
    assert stage_memories(blocks, part, schedule="1f1b", n_microbatches=4) == [200, 300]
    # GPipe keeps all 4 microbatches on every stage: even one block needs 400.
    with pytest.raises(InfeasibleError, match="alone needs 400 bytes"):
        solved(blocks, 2, FREE, n_microbatches=4, schedule="gpipe", memory_limit_bytes=350, recompute="never")


def test_recompute_auto_makes_a_plan_fit() -> None:
    # GPipe, p=2, m=4, 100 activation bytes per block and microbatch, 10-byte cuts. Without
    # recomputation one block alone holds 4 x 100 = 400 > 300. Checkpointing every block (full), a
    # stage keeps each block's 10-byte input and its 10-byte cached output per live microbatch, plus
    # one block's activations being rebuilt: stage [0,2) needs 4*(0+10+10) + 10 (output grad) + 100
    # + 4*10 (receive buffers) = 230, stage [2,4) 4*(10+10+0) + 0 + 100 + 4*10 = 220.
    blocks = [b.model_copy(update={"recompute_s": b.fwd_s}) for b in times([1, 1, 1, 1], act=100, cut=10)]
    part = solved(blocks, 2, FREE, n_microbatches=4, schedule="gpipe", memory_limit_bytes=300)
    assert part.starts == (0, 2) and part.recompute == ("full", "full")
    # 2 blocks x (forward 1 + forward again in backward 1) + the 10-byte boundary each way at 1 B/s.
    assert part.bottleneck_s == 4.0 + 20.0
    assert stage_memories(blocks, part, schedule="gpipe", n_microbatches=4) == [
        230,
        220,
    ]
    # Only the stage that does not fit recomputes: 1F1B keeps 2 microbatches on stage 0, 1 on stage 1.
    part = solved(blocks, 2, FREE, n_microbatches=4, schedule="1f1b", memory_limit_bytes=300)
    assert part.starts == (0, 2) and part.recompute == ("full", "never")
    # Without a limit nothing recomputes; "full" (or its old name "always") recomputes everywhere.
    assert solved(blocks, 2, FREE, n_microbatches=4).recompute == ()
    assert solved(blocks, 2, FREE, n_microbatches=4, recompute="full").recompute == ("full", "full")
    assert solved(blocks, 2, FREE, n_microbatches=4, recompute="always").recompute == ("full", "full")


def test_auto_takes_selective_checkpointing_where_it_fits() -> None:
    # As above, but each block keeps 30 of its 100 bytes under selective checkpointing and recomputes
    # for 0.25 s instead of 1. GPipe stage [0,2) selectively: 4*(0+10 inputs + 60 kept + 10 output)
    # + 10 + 70 rebuilt + 40 buffers = 440; stage [2,4): 4*(20 + 60) + 0 + 70 + 40 = 430.
    kept = {"recompute_s": 1.0, "selective_bytes": 30, "selective_recompute_s": 0.25}
    blocks = [b.model_copy(update=kept) for b in times([1, 1, 1, 1], act=100, cut=10)]
    part = solved(blocks, 2, FREE, n_microbatches=4, schedule="gpipe", memory_limit_bytes=450)
    assert part.starts == (0, 2) and part.recompute == ("selective", "selective")
    assert part.bottleneck_s == 2 * (1.0 + 0.25) + 20.0
    assert stage_memories(blocks, part, schedule="gpipe", n_microbatches=4) == [
        440,
        430,
    ]
    # Below 430 selective does not fit: full checkpointing, at the full recomputation's cost.
    part = solved(blocks, 2, FREE, n_microbatches=4, schedule="gpipe", memory_limit_bytes=400)
    assert part.recompute == ("full", "full") and part.bottleneck_s == 2 * (1.0 + 1.0) + 20.0
    # Forced selective where it does not fit: nothing fits.
    with pytest.raises(InfeasibleError, match="memory-limit"):
        solved(blocks, 2, FREE, n_microbatches=4, schedule="gpipe", memory_limit_bytes=400, recompute="selective")


def test_zero_bubble_schedules_never_checkpoint_selectively() -> None:
    # their two-part backward runs a stage's backward twice, which torch's selective checkpointing refuses
    kept = {"recompute_s": 1.0, "selective_bytes": 30, "selective_recompute_s": 0.25}
    blocks = [b.model_copy(update=kept) for b in times([1, 1, 1, 1], act=100, cut=10)]
    with pytest.raises(InfeasibleError, match="--recompute selective cannot run under --schedule zbv"):
        solved(blocks, 2, FREE, n_microbatches=4, schedule="zbv", recompute="selective")
    # auto skips it there: where selective would fit under 1F1B, zero-bubble takes full
    one = solved(blocks, 2, FREE, n_microbatches=4, schedule="1f1b", memory_limit_bytes=290)
    zero = solved(blocks, 2, FREE, n_microbatches=4, schedule="interleaved-zb", memory_limit_bytes=290)
    assert "selective" in one.recompute and "selective" not in zero.recompute


def test_checkpoint_regions_follow_the_legal_cuts() -> None:
    # A block whose end is no legal cut shares its checkpoint region with the next: blocks 0 and 1
    # are one region of 200 bytes, rebuilt at once; block 2 another (its input: block 1's cut).
    blocks = times([1, 1, 1], act=100, cut=10)
    blocks[0] = blocks[0].model_copy(update={"cut_legal": False})
    assert checkpoint_units(blocks, 0, 3) == [(0, 2), (2, 3)]
    # one live microbatch: inputs 0 + 10, + 0 output; one region rebuilt: 200
    assert stage_memory_bytes(blocks, 0, 3, 1, SGD, "full") == 10 + 200
    assert stage_memory_bytes(blocks, 0, 3, 1, SGD, "never") == 300


def test_stage_memory_formula() -> None:
    blocks = [
        blk(0, 1.0, params=10, param_bytes=40, act=3, cut=7),
        blk(1, 1.0, params=20, param_bytes=80, act=5, cut=11),
        blk(2, 1.0, cut=13),
    ]
    # adamw, fp32, stage [0,2), 4 in flight, m = 1:
    #   static   = (40+80) * 2 (weights + grads) + 30 * 8 (two fp32 moments)  = 480
    #   buffers  = m * (0 in (first stage) + 11 out)                          = 11
    #   pipeline = 4 * ((3+5) activations + 11 cached output) + 11 its grad   = 87
    #   step     = 30 * 8 (AdamW's two fp32 temporaries)                      = 240
    assert stage_memory_bytes(blocks, 0, 2, 4, OptimizerSpec()) == 480 + 11 + max(87, 240)
    assert stage_memory_bytes(blocks, 0, 2, 4, OptimizerSpec(), n_microbatches=8) == 480 + 88 + max(87, 240)
    # last stage [1,3) with SGD (no state, no temporaries), 1 in flight: 80 * 2 + 7 in + 1 * 5
    assert stage_memory_bytes(blocks, 1, 3, 1, SGD) == 160 + 7 + 5
    # the last stage keeps the model output per live microbatch (output_bytes of the last block)
    with_output = blocks[:2] + [blocks[2].model_copy(update={"output_bytes": 100})]
    assert stage_memory_bytes(with_output, 1, 3, 2, SGD) == 160 + 7 + 2 * (5 + 100) + 100


def test_autocast_weight_copies_are_held_once_not_per_microbatch() -> None:
    # the runner's one autocast cache per step: a stage holds its weights' bf16 copies once while the
    # pipeline runs, whatever its live microbatches, and as much again in their gradients at the end of
    # each backward (torch runs the cached copies' nodes last); all freed by the optimizer step
    blocks = [
        # activations 3 and 5 besides the copies (20, 40), as test_stage_memory_formula
        blk(0, 1.0, params=10, param_bytes=40, act=23, cut=7).model_copy(update={"weight_cast_bytes": 20}),
        blk(1, 1.0, params=20, param_bytes=80, act=45, cut=11).model_copy(update={"weight_cast_bytes": 40}),
        blk(2, 1.0, cut=13),
    ]
    # as test_stage_memory_formula, the pipeline term 4 * (8 + 11) + 11, + 2 * 60 copies and their
    # gradients (4 live: shared); SGD has no step term
    assert stage_memory_bytes(blocks, 0, 2, 4, SGD) == 240 + 11 + 87 + 120
    assert stage_memory_bytes(blocks, 0, 2, 3, SGD) == 240 + 11 + 3 * 19 + 11 + 120
    # one or two live: each microbatch its own copies (sharing would hold 2 sets anyway)
    assert stage_memory_bytes(blocks, 0, 2, 2, SGD) == 240 + 11 + 2 * 19 + 11 + 2 * 60
    assert stage_memory_bytes(blocks, 0, 2, 1, SGD) == 240 + 11 + 19 + 11 + 60
    # FSDP never shares them (it reduce-scatters a block's gradients before a shared copy's arrive):
    # a set per live microbatch, beside the sharded state (120 of 240) and the unsharded weights and
    # gradients while the pipeline runs (240)
    assert stage_memory_bytes(blocks, 0, 2, 4, SGD, shard=2) == 120 + 11 + 87 + 240 + 4 * 60
    # AdamW's step temporaries (240) outweigh the pipeline with its copies (207): the copies are gone by then
    assert stage_memory_bytes(blocks, 0, 2, 4, OptimizerSpec()) == 480 + 11 + max(87 + 120, 240)
    # a compiled stage casts in its graph on every call: the copies are held per live microbatch
    compiled = compiled_casts(blocks)
    assert [b.activation_bytes for b in compiled] == [23, 45, 0]
    assert [b.weight_cast_bytes for b in compiled] == [0, 0, 0]
    assert compiled[2] is blocks[2]
    assert stage_memory_bytes(compiled, 0, 2, 4, SGD) == 240 + 11 + 4 * (68 + 11) + 11
    # a recomputing stage drops its copies with its regions' activations, as it never shares them
    for mode in ("full", "selective", "stage", "full:1"):
        assert stage_memory_bytes(blocks, 0, 2, 4, SGD, mode) == stage_memory_bytes(compiled, 0, 2, 4, SGD, mode)


def test_a_compiled_layout_holds_copies_per_microbatch_but_an_fsdp_one_none() -> None:
    from plan_factory import LINK, layout_of

    from planner.core.layout.candidate import evaluate_choice
    from planner.core.layout.inputs import Cluster, Constraints

    blocks = [blk(i, 1.0, params=20, param_bytes=80, act=45, cut=11) for i in range(4)]
    blocks = [b.model_copy(update={"weight_cast_bytes": 40}) for b in blocks]
    compiled = Constraints(SGD, None, "never", compiled=True)
    ddp = evaluate_choice(blocks, Cluster(2, LINK), layout_of("1f1b", 2, 4), compiled)
    fsdp = evaluate_choice(blocks, Cluster(4, LINK), layout_of("1f1b", 2, 4, shard=2), compiled)
    # compiled without FSDP: the copies stay in the activations, none to share
    assert [(b.activation_bytes, b.weight_cast_bytes) for b in ddp.blocks] == [(45, 0)] * 4
    # FSDP gathers the weights cast already: no copies, compiled or not
    assert [(b.activation_bytes, b.weight_cast_bytes) for b in fsdp.blocks] == [(5, 0)] * 4
    eager = evaluate_choice(blocks, Cluster(2, LINK), layout_of("1f1b", 2, 4), Constraints(SGD, None, "never"))
    assert [(b.activation_bytes, b.weight_cast_bytes) for b in eager.blocks] == [(45, 40)] * 4


def test_stage_memory_mixed_precision_keeps_fp32_master() -> None:
    # bf16 parameters (2 B each): weights 2 + grads 2 + fp32 master 4 + two fp32 moments 8 = 16 B per
    # parameter, ZeRO's "2 + 2 + 12"; AdamW's step adds two fp32 temporaries (8 B).
    blocks = [blk(0, 1.0, params=1000, param_bytes=2000), blk(1, 1.0)]
    assert stage_memory_bytes(blocks, 0, 1, 0, OptimizerSpec()) == 16 * 1000 + 8 * 1000
    assert stage_memory_bytes(blocks, 0, 1, 0, SGD) == 8 * 1000


# ---------------------------------------------------------------------------------------------
# Baselines
# ---------------------------------------------------------------------------------------------


def test_uniform_layers_uneven() -> None:
    # 7 layers over 3 stages: 3, 2, 2 (extra layers to the earliest stages, as torchtitan).
    assert uniform_layers(times([1] * 7), 3, FREE).starts == (0, 3, 5)
    # with a leading embedding and a trailing head (non-layers): layers are blocks 1..7.
    blocks = [blk(0, 1.0, layer=False)] + [blk(i, 1.0) for i in range(1, 8)] + [blk(8, 1.0, layer=False)]
    part = uniform_layers(blocks, 3, FREE)
    assert part == Partition(starts=(0, 4, 6), bottleneck_s=4.0)


def test_uniform_layers_non_layer_stays_with_preceding_layer() -> None:
    blocks = [blk(0, 1.0), blk(1, 1.0), blk(2, 1.0, layer=False), blk(3, 1.0), blk(4, 1.0)]
    assert uniform_layers(blocks, 2, FREE).starts == (0, 3)


def test_uniform_layers_moves_illegal_cut_to_nearest_legal() -> None:
    blocks = times([1] * 6)
    blocks[2] = blk(2, 1.0, legal=False)  # target start 3 is illegal; 2 and 4 are both 1 away
    assert uniform_layers(blocks, 2, FREE).starts == (0, 2)
    blocks[1] = blk(1, 1.0, legal=False)  # now only 4 is 1 away
    assert uniform_layers(blocks, 2, FREE).starts == (0, 4)
    with pytest.raises(InfeasibleError, match="layer blocks"):
        uniform_layers(times([1, 1], layer=False), 2, FREE)


def test_param_balanced() -> None:
    blocks = [blk(i, 1.0, params=p) for i, p in enumerate([10, 1, 1, 1, 1, 1, 10])]
    part = param_balanced(blocks, 3, FREE)
    assert part == Partition(starts=(0, 1, 6), bottleneck_s=5.0)  # params 10 | 5 | 10
    # all equal: max 3 params per stage; ties fill the earlier stages first (DeepSpeed's greedy probe).
    assert param_balanced(times([1] * 7, params=1), 3, FREE).starts == (0, 3, 6)
    # an illegal cut is respected: after block 0 is not cuttable.
    blocks[0] = blk(0, 1.0, params=10, legal=False)
    assert param_balanced(blocks, 3, FREE).starts == (0, 2, 6)  # 11 | 4 | 10


# ---------------------------------------------------------------------------------------------
# Scale and purity
# ---------------------------------------------------------------------------------------------


def test_large_instance() -> None:
    link = LinkCost(name="l", latency_s=1e-3, bandwidth_Bps=1e9)
    blocks = [blk(i, 0.001 * (1 + i % 7), 0.002, param_bytes=1000, act=500, cut=4096) for i in range(90)]
    part = solved(blocks, 64, link, n_microbatches=64, memory_limit_bytes=10**6)
    assert len(part.starts) == 64
    assert part == _reference_solve(blocks, 64, link, n_microbatches=64, memory_limit_bytes=10**6)
    assert len(solved(blocks, 30, link, n_microbatches=64, memory_limit_bytes=10**6).starts) == 30


def test_pure_modules_do_not_import_torch() -> None:
    code = "import planner.core.split.solve, planner.core.step.simulate, planner.core.step.schedules, planner.schema.costs, sys; assert 'torch' not in sys.modules"
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr


def test_unknown_recompute_cost_is_charged_as_the_whole_forward() -> None:
    # recompute_s None (not measured): a recomputing stage pays its blocks' forward again in backward.
    blocks = times([1, 1, 1, 1], act=100, cut=10)
    assert all(b.recompute_s is None for b in blocks)
    always = solved(blocks, 2, FREE, n_microbatches=4, recompute="always")
    never = solved(blocks, 2, FREE, n_microbatches=4, recompute="never")
    assert always.recompute == ("full", "full")
    fwd = sum(b.fwd_s for b in blocks[: always.starts[1]])
    assert always.bottleneck_s == pytest.approx(never.bottleneck_s + fwd)


# ---------------------------------------------------------------------------------------------
# A link per boundary (ranks on several nodes): against the reference and brute force
# ---------------------------------------------------------------------------------------------


@st.composite
def mixed_requests(draw: st.DrawFn, ties: bool) -> Request:
    """A ``requests`` instance whose boundaries each take one of two links (intra- and inter-node)."""
    blocks, p, link, kw = draw(requests(ties=ties))
    if ties:
        slow = LinkCost(name="inter", latency_s=float(draw(st.integers(0, 3))), bandwidth_Bps=0.5)
    else:
        slow = LinkCost(name="inter", latency_s=draw(st.sampled_from([0.0, 0.02, 0.5, 2.0])), bandwidth_Bps=3.7)
    links = [slow if draw(st.booleans()) else link for _ in range(p - 1)]
    return blocks, p, links, kw  # type: ignore[return-value]


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(req=mixed_requests(ties=False))
def test_solve_with_a_link_per_boundary_matches_reference_dp(req: Request) -> None:
    blocks, p, links, kw = req
    assert_agrees_with_reference(blocks, p, links, kw)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(req=mixed_requests(ties=True))
def test_solve_with_a_link_per_boundary_matches_brute_force(req: Request) -> None:
    blocks, p, links, kw = req
    infl = kw.get("in_flight") or [kw["n_microbatches"]] * p
    kw = {**kw, "in_flight": infl}
    args = (kw["schedule"], kw["n_microbatches"], kw["optimizer"], kw["memory_limit_bytes"], kw["recompute"])
    feasible = brute(blocks, p, links, *args, in_flight=infl)  # type: ignore[arg-type]
    if not feasible:
        with pytest.raises(InfeasibleError):
            solved(blocks, p, links, **kw)
        return
    part = solved(blocks, p, links, **kw)
    opt = min(b for _, b, _ in feasible)
    assert part.bottleneck_s == pytest.approx(opt, rel=1e-9, abs=1e-12)
    optimal = [(s, c) for s, b, c in feasible if b <= opt + 1e-9 * max(1.0, opt)]
    best_sum = min(c for _, c in optimal)
    assert part.starts == min(s for s, c in optimal if c <= best_sum + 1e-9 * max(1.0, best_sum))


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(req=requests(ties=False))
def test_one_link_per_boundary_gives_the_single_link_result(req: Request) -> None:
    blocks, p, link, kw = req
    assert repr(outcome(solved, blocks, p, [link] * (p - 1), **kw)) == repr(outcome(solved, blocks, p, link, **kw))


INTRA = LinkCost(name="intra", latency_s=1e-5, bandwidth_Bps=3e11)
INTER = LinkCost(name="inter", latency_s=2e-5, bandwidth_Bps=3.5e10)


def _nodes(gpus_per_node: int, n_ranks: int) -> NodeLinks:
    return NodeLinks(**INTRA.model_dump(), inter=INTER, gpus_per_node=gpus_per_node, n_ranks=n_ranks)


def test_node_links_follow_the_schedules_placement() -> None:
    i, x = INTRA, INTER
    four = _nodes(2, 4)  # ranks 0, 1 on node 0; 2, 3 on node 1
    assert boundary_links(four, 4, "1f1b") == [i, x, i]
    # looped: stage s on rank s mod 4, so the wrap from rank 3 back to rank 0 crosses nodes too
    assert boundary_links(four, 8, "interleaved-1f1b") == [i, x, i, x, i, x, i]
    assert boundary_links(four, 8, None) == [i, x, i, x, i, x, i]
    # V: rank r holds stages r and 7 - r; the turn on rank 3 stays on node 1
    assert boundary_links(four, 8, "zbv") == [i, x, i, i, i, x, i]
    assert boundary_links(_nodes(8, 4), 4, "gpipe") == [i, i, i]  # one node
    assert boundary_links(_nodes(1, 4), 4, "gpipe") == [x, x, x]  # --multi-node: every rank its own node
    assert boundary_links(_nodes(8, 64), 64, "1f1b").count(x) == 7  # 64 H100 = 8 nodes
    with pytest.raises(InfeasibleError, match="2 links for 4 stages"):
        boundary_links([i, x], 4)


def test_solve_with_node_links_equals_solve_with_their_boundary_list() -> None:
    blocks = times([1.0, 2.0, 1.5, 1.0, 2.5, 0.5, 1.0, 1.0], b=1.0, cut=10**9)
    for schedule, v in (("1f1b", 1), ("interleaved-1f1b", 2), ("zbv", 2)):
        links = _nodes(2, 4)
        infl = in_flight_per_stage(schedule, 4, 8, v)
        listed = boundary_links(links, 4 * v, schedule)
        want = solved(blocks, 4 * v, listed, schedule=schedule, in_flight=infl, n_microbatches=8)
        got = solved(blocks, 4 * v, links, schedule=schedule, in_flight=infl, n_microbatches=8)
        assert got == want
        # the inter-node boundaries are the slow ones: their stages pay more for the same bytes
        costs = stage_costs(blocks, got, links, schedule=schedule)
        assert max(costs) == got.bottleneck_s


def test_a_cold_start_is_charged_to_the_stage_that_waits_and_moves_the_split() -> None:
    """Blocks of 3, 1, 1, 3 s balance as 2 + 2 at 4 s a stage; when the third block starts 1.5 s
    slower after a wait, a stage starting there costs 5.5 s and the 1 + 3 split (5 s) wins."""
    warm = times([3.0, 1.0, 1.0, 3.0])
    assert solved(warm, 2, FREE, schedule="gpipe", n_microbatches=2, optimizer=SGD).starts == (0, 2)
    cold = [blk(i, t, fc=1.5 if i == 2 else 0.0, bc=0.0) for i, t in enumerate([3.0, 1.0, 1.0, 3.0])]
    assert stage_costs(cold, Split(starts=(0, 2)), FREE) == [4.0, 5.5]
    part = solved(cold, 2, FREE, schedule="gpipe", n_microbatches=2, optimizer=SGD)
    assert part.starts == (0, 1) and part.bottleneck_s == 5.0
    # only the receiving end pays: the first stage's forward and the last stage's backward never wait
    edges = [blk(i, 1.0, 1.0, fc=0.5, bc=0.25) for i in range(3)]
    assert stage_time_parts(edges, 0, 1, FREE)[:2] == (1.0, 1.25)  # waits for its gradient
    assert stage_time_parts(edges, 1, 2, FREE)[:2] == (1.5, 1.25)  # waits both ways
    assert stage_time_parts(edges, 2, 3, FREE)[:2] == (1.5, 1.0)  # waits for its activations
    assert stage_time_parts(edges, 1, 2, FREE, wait_in=False, wait_out=False)[:2] == (1.0, 1.0)  # a V's turn


def test_the_turn_of_a_v_costs_the_solver_what_it_costs_the_prediction() -> None:
    """ZB-V runs stages 1 and 2 of 4 on rank 1: that boundary sends nothing and nobody waits on it.
    The solver's stage costs charge it neither a message nor a cold start, as the prediction's stage
    plans do; under 1F1B every boundary joins two ranks and pays both."""

    link = LinkCost(name="l", latency_s=0.5, bandwidth_Bps=1e9)  # 0.5 s a message (no bytes cross)
    blocks = [blk(i, 1.0, 1.0, fc=0.25, bc=0.125) for i in range(4)]
    # stage = fwd (+ 0.25 cold if it receives activations) + bwd (+ 0.125 cold if it receives a
    # gradient) + 2 x 0.5 per boundary it sends or receives over
    assert stage_costs(blocks, Split(starts=(0, 1, 2, 3)), link, schedule="1f1b") == [3.125, 4.375, 4.375, 3.25]
    assert stage_costs(blocks, Split(starts=(0, 1, 2, 3)), link, schedule="zbv") == [3.125, 3.25, 3.125, 3.25]
    assert boundary_crosses(4, "zbv") == [True, False, True]
    assert boundary_crosses(2, "interleaved-1f1b", stages_per_rank=2) == [False]  # one rank runs both
    for schedule, v in (("1f1b", 1), ("zbv", 2)):
        stages, _ = predicted(blocks, (0, 1, 2, 3), link, schedule, 4, SGD, stages_per_rank=v)
        planned = [s.time_s for s in stages]  # fwd + bwd + comm_s (both directions)
        assert planned == stage_costs(blocks, Split(starts=(0, 1, 2, 3)), link, schedule=schedule)
        part = solved(blocks, 4, link, schedule=schedule, in_flight=[1] * 4, n_microbatches=4, optimizer=SGD)
        assert part.bottleneck_s == max(planned)


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(inst=instances(), v_schedule=st.sampled_from(["zbv", "dualpipev"]))
def test_solve_under_a_v_matches_brute_force(
    inst: tuple[list[BlockCost], int, LinkCost, str, int, OptimizerSpec, int | None, str], v_schedule: str
) -> None:
    """With the turn of the V free of messages and cold starts, the search still finds brute force's
    optimum (least total cost among the tied, then the smallest starts)."""
    blocks, p, link, _, m, optimizer, limit, recompute = inst
    assume(p % 2 == 0)
    kw: dict[str, Any] = {"schedule": v_schedule, "n_microbatches": m, "optimizer": optimizer}
    kw |= {"memory_limit_bytes": limit, "recompute": recompute, "in_flight": [m] * p}
    _solve_as_brute_force(blocks, p, link, kw)


def test_stage_plans_charge_cold_starts_only_across_ranks() -> None:
    """Under ZB-V the stages either side of the V's turn run on one rank: nothing is received there,
    so neither starts cold; every boundary between ranks charges its receiver."""

    blocks = [blk(i, 1.0, 1.0, fc=0.5, bc=0.25) for i in range(4)]
    stages, _ = predicted(blocks, (0, 1, 2, 3), FREE, "zbv", 4, SGD, stages_per_rank=2)
    assert [s.rank for s in stages] == [0, 1, 1, 0]
    assert [s.fwd_s for s in stages] == [1.0, 1.5, 1.0, 1.5]  # stage 2 follows stage 1 on rank 1
    assert [s.bwd_s for s in stages] == [1.25, 1.0, 1.25, 1.0]  # stage 1's gradient comes from rank 1 itself
    looped, _ = predicted(blocks, (0, 1, 2, 3), FREE, "1f1b", 4, SGD)
    assert [s.fwd_s for s in looped] == [1.0, 1.5, 1.5, 1.5]
    assert [s.bwd_s for s in looped] == [1.25, 1.25, 1.25, 1.0]


@settings(max_examples=150, deadline=None)
@given(
    instances(),
    st.sampled_from([1, 2, 4]),
    st.sampled_from([1, 3]),
    st.booleans(),
    st.sampled_from([1, 2]),
    st.one_of(st.none(), st.integers(0, 50)),
)
def test_prediction_reads_stage_memory_off_prefix_sums_exactly(
    inst: Any, cut_share: int, m: int, per_block: bool, shard: int, opt_temp: int | None
) -> None:
    """``predict``'s stage memory (the blocks' prefix sums) equals ``stage_memory_parts`` (block by
    block) for every stage, recompute mode, tensor-parallel piece, FSDP sharding and optimizer
    temporaries, measured or not; partial recomputation ("mode:k") takes the block-by-block path."""
    from planner.core.split.stage_model import stage_memory_parts
    from planner.core.split.stage_plans import _memory_parts

    blocks, *_ = inst
    blocks = [
        b.model_copy(update={"cut_share": cut_share, "opt_temp_bytes": opt_temp if i % 2 else None})
        for i, b in enumerate(blocks)
    ]
    layout = memory_layout(m, shard, per_block=per_block)
    n = len(blocks)
    heads = [0] + [c for c in range(1, n) if blocks[c - 1].cut_legal]  # the stages a split can have
    for s in heads:
        for e in [x for x in heads if x > s] + [n]:
            for mode in (False, True, "never", "selective", "full", "stage", "full:1", "selective:1"):
                want = stage_memory_parts(blocks, s, e, ADAMW, mode, m, layout.shard, layout.per_block)
                assert _memory_parts(blocks, s, e, ADAMW, mode, layout) == want, (s, e, mode)


# ---------------------------------------------------------------------------------------------
# The memory-only test that ends a search nothing fits after one pass
# ---------------------------------------------------------------------------------------------


def _counting_ranges(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Record the cap of every range pass ``solve`` makes."""
    caps: list[float] = []
    original = solve_mod._Arrays.ranges

    def counted(self: Any, cap: float) -> Any:
        caps.append(cap)
        return original(self, cap)

    monkeypatch.setattr(solve_mod._Arrays, "ranges", counted)
    return caps


def test_a_limit_nothing_fits_is_refused_after_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    # 8 blocks of 1 MiB of activations each into 4 stages, none recomputing, GPipe keeping all 4
    # microbatches on every stage: some stage holds 2 blocks, 8 MiB, over the 7 MiB limit. Without
    # the memory-only test the search doubles its cap from the first guess until the ranges are
    # every stage that fits, a pass each; with it, the first pass that finds nothing ends it
    blocks = [blk(i, 1.0 + (i % 3), 1.0, act=2**20) for i in range(8)]
    limit = 7 * 2**20
    assert not brute(blocks, 4, FREE, "gpipe", 4, SGD, limit, "never")
    caps = _counting_ranges(monkeypatch)
    with pytest.raises(InfeasibleError, match="too small"):
        solved(
            blocks,
            4,
            FREE,
            schedule="gpipe",
            n_microbatches=4,
            optimizer=SGD,
            memory_limit_bytes=limit,
            recompute="never",
        )
    assert len(caps) == 1 and math.isfinite(caps[0])


def test_a_limit_some_split_fits_still_doubles_to_the_optimum(monkeypatch: pytest.MonkeyPatch) -> None:
    # memory allows, none recomputing, only the split of 2 blocks a stage, whose first stage (two 8 s blocks) costs
    # more than the first cap (the average stage plus the largest block, about 12 s): that pass finds
    # no partition, the memory-only test says one fits, and the doubled cap finds it
    ts = [8.0, 8.0, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01]
    blocks = [blk(i, t, 0.0, act=2**20) for i, t in enumerate(ts)]
    limit = 2 * 4 * 2**20
    caps = _counting_ranges(monkeypatch)
    part = solved(
        blocks, 4, FREE, schedule="gpipe", n_microbatches=4, optimizer=SGD, memory_limit_bytes=limit, recompute="never"
    )
    best = min(brute(blocks, 4, FREE, "gpipe", 4, SGD, limit, "never"), key=lambda f: (f[1], f[2], f[0]))
    assert tuple(part.starts) == best[0] == (0, 2, 4, 6)
    assert caps[1] == 2 * caps[0] < 2 * best[1]  # the first cap found nothing and did not end the search
