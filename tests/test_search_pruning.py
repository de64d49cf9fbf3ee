"""The search's pruning is exact: on random small problems, the search that rules layouts out by their
floors (``planner.core.layout.bounds``) finds the same winner as the search that evaluates every
layout, and every candidate within the pruning threshold with the same figures."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
from conftest import solve_every_layout
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from plan_factory import LINK, MB, block

import planner.core.layout.pending as pending_module
import planner.core.layout.search as search_module
from planner.core.layout.candidate import Outpaced
from planner.core.layout.inputs import Cluster, Constraints, Scaling, SearchSpace
from planner.core.layout.search import TIE, _evaluate_all, _rank
from planner.schema.costs import BlockCost, LinkCost, OptimizerSpec

SLOW = LinkCost(name="slow", latency_s=1e-5, bandwidth_Bps=1e8)  # 100 MB/s: FSDP's gathers dominate


def _blocks(raw: list[tuple[int, int, int, int, int]]) -> list[BlockCost]:
    return [
        block(f"l{i}", fwd, bwd, params * 100_000, act_mb=act, cut_mb=cut)
        for i, (fwd, bwd, params, act, cut) in enumerate(raw)
    ]


def _key(c: Any) -> tuple[Any, ...]:
    """A candidate's layout, split and figures."""
    p = c.prediction
    return (c.layout, p.starts, p.recompute, p.step_time_s, p.max_memory_bytes, c.fits)


def _search_inputs(problem: tuple[Any, ...]) -> tuple[list[BlockCost], Cluster, SearchSpace, Constraints, Scaling]:
    """A ``PROBLEM``'s blocks, cluster, search space, constraints and scaling."""
    raw, ranks, batch, limit_mb, recompute, replicas = problem
    space = SearchSpace(batch, "auto", None, None, replicas, "auto")
    constraints = Constraints(OptimizerSpec(), None if limit_mb is None else limit_mb * MB, recompute)
    return _blocks(raw), Cluster(ranks, LINK), space, constraints, Scaling(1, 0.1, 1)


PROBLEM = st.tuples(
    st.lists(
        st.tuples(st.integers(1, 30), st.integers(1, 60), st.integers(0, 8), st.integers(1, 16), st.integers(1, 4)),
        min_size=3,
        max_size=7,
    ),
    st.sampled_from([2, 4]),  # ranks
    st.sampled_from([4, 8, 16]),  # batch
    st.sampled_from([None, 40, 80, 160]),  # memory limit, MB
    st.sampled_from(["never", "auto"]),
    st.sampled_from([(1,), (1, 2)]),  # replica counts
)


@pytest.mark.slow
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(PROBLEM)
def test_pruning_keeps_the_winner_and_every_candidate_that_could_tie(problem: tuple[Any, ...]) -> None:
    blocks, cluster, space, constraints, scaling = _search_inputs(problem)
    pruned = _evaluate_all(blocks, cluster, space, constraints, scaling)
    with pytest.MonkeyPatch.context() as mp:  # floors of nothing, nothing outpaced: every layout is evaluated
        solve_every_layout(mp)
        every = _evaluate_all(blocks, cluster, space, constraints, scaling)
    assert every.pruned == 0
    fitting = [c for c in every.results if c.fits]
    if not fitting:
        assert not any(c.fits for c in pruned.results)
        return
    best, _ = _rank(every.results, every.errors)
    mine, _ = _rank(pruned.results, pruned.errors)
    assert _key(mine) == _key(best)
    # every fitting candidate that could tie with the winner was evaluated, with the same figures
    threshold = best.prediction.step_time_s * (1 + TIE)
    close = {_key(c) for c in fitting if c.prediction.step_time_s <= threshold}
    assert close <= {_key(c) for c in pruned.results}
    # and nothing the pruned search evaluated differs from the exhaustive search's evaluation
    assert {_key(c) for c in pruned.results} <= {_key(c) for c in every.results}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(PROBLEM)
def test_quick_floors_raised_when_reached_evaluate_what_full_floors_do(problem: tuple[Any, ...]) -> None:
    """The search enumerates layouts with quick floors (no action orders read) and raises each to its
    full floor when it comes to it: the same layouts evaluated in the same order, the same results,
    as full floors computed for every layout up front."""
    blocks, cluster, space, constraints, scaling = _search_inputs(problem)
    seen: list[list[Any]] = [[], []]
    evaluated, floors = pending_module.evaluated, pending_module.floors

    def full_floors(*a: Any, **k: Any) -> Any:
        return floors(*a, **{**k, "read_orders": True})

    for run, full in enumerate((False, True)):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(pending_module, "evaluated", lambda task, run=run: seen[run].append(task[2]) or evaluated(task))
            if full:  # every floor read off the orders when the layout is enumerated
                mp.setattr(pending_module, "floors", full_floors)
                mp.setattr(pending_module, "LIVE_CLOSED_FORMS", tuple(search_module.SCHEDULES))
            outcome = _evaluate_all(blocks, cluster, space, constraints, scaling)
        if not full:
            quick = outcome
    assert seen[0] == seen[1]
    assert [_key(c) for c in quick.results] == [_key(c) for c in outcome.results]
    assert (quick.evaluated, quick.pruned, quick.layouts) == (outcome.evaluated, outcome.pruned, outcome.layouts)


# Larger weights over a slower link, FSDP's units and the passes open: layouts whose stage units do not
# fit fall back to block units, whose gathers every microbatch make them slow (``Outpaced``).
FSDP_PROBLEM = st.tuples(
    st.lists(
        st.tuples(st.integers(1, 30), st.integers(1, 60), st.integers(10, 400), st.integers(1, 64), st.integers(1, 4)),
        min_size=4,
        max_size=9,
    ),
    st.sampled_from([4, 8]),  # ranks
    st.sampled_from([16, 32]),  # batch
    st.sampled_from([1.0, 2.0, 4.0]),  # memory limit, in shares of the weights' fp32 bytes a rank
    st.sampled_from([(2,), (2, 4), (1, 2, 4)]),  # replica counts
)


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(FSDP_PROBLEM)
def test_layouts_put_back_as_outpaced_leave_the_winner(problem: tuple[Any, ...]) -> None:
    """A layout that cannot beat the best step found (``Outpaced``: FSDP's stage units do not fit and its
    block units' floor is slower) is put back in line unsolved, its runs in several passes queued:
    the same winner as the search that solves every layout, and nothing evaluated differently."""
    raw, ranks, batch, share, replicas = problem
    blocks = _blocks(raw)
    limit = int(sum(b.param_bytes for b in blocks) * share * 4 / ranks)
    space = SearchSpace(batch, "auto", None, None, replicas, "auto", fsdp_units="auto", accumulation=None)
    constraints = Constraints(OptimizerSpec(), limit, "auto")
    cluster, scaling = Cluster(ranks, SLOW), Scaling(1, 0.1, 1)
    pruned = _evaluate_all(blocks, cluster, space, constraints, scaling)
    with pytest.MonkeyPatch.context() as mp:
        solve_every_layout(mp)
        every = _evaluate_all(blocks, cluster, space, constraints, scaling)
    if not any(c.fits for c in every.results):
        assert not any(c.fits for c in pruned.results)
        return
    assert _key(_rank(pruned.results, pruned.errors)[0]) == _key(_rank(every.results, every.errors)[0])
    assert {_key(c) for c in pruned.results} <= {_key(c) for c in every.results}


def test_a_slow_fsdp_fallback_is_put_back_unsolved() -> None:
    """Four ranks, two replicas or four, four blocks of 28 to 150 MB over a 100 MB/s link, the limit
    four times a rank's share of the weights: some layout of the search is ``Outpaced`` (its stage
    units do not fit, its block units could not beat the best step), and the search still picks what
    solving every layout picks."""
    blocks = _blocks([(18, 55, 78, 38, 4), (5, 35, 70, 40, 2), (4, 38, 302, 25, 3), (4, 36, 374, 9, 1)])
    limit = int(sum(b.param_bytes for b in blocks) * 4.0 * 4 / 4)
    space = SearchSpace(32, "auto", None, None, (2, 4), "auto", fsdp_units="auto", accumulation=None)
    constraints = Constraints(OptimizerSpec(), limit, "auto")
    cluster, scaling = Cluster(4, SLOW), Scaling(1, 0.1, 1)
    outpaced: list[float] = []
    real = pending_module.evaluated

    def watched(task: Any) -> Any:
        got = real(task)
        if isinstance(got[0], Outpaced):
            outpaced.append(got[0].floor_s)
        return got

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pending_module, "evaluated", watched)
        pruned = _evaluate_all(blocks, cluster, space, constraints, scaling)
    with pytest.MonkeyPatch.context() as mp:
        solve_every_layout(mp)
        every = _evaluate_all(blocks, cluster, space, constraints, scaling)
    assert outpaced, "no layout of this problem was outpaced: it no longer tests what it says"
    assert _key(_rank(pruned.results, pruned.errors)[0]) == _key(_rank(every.results, every.errors)[0])


class _PicklingPool:
    """A pool that runs each call here, but as a worker process would see it: the call and its
    result each through pickle (``planner.workers`` sends both so)."""

    def __init__(self) -> None:
        self.calls: dict[int, bytes] = {}
        self.tickets = 0
        self.answers: list[Any] = []  # every result as it came back, before the search read it

    def width(self) -> int:
        return 3

    def submit(self, fn: Any, arg: object) -> int:
        self.tickets += 1
        self.calls[self.tickets] = pickle.dumps((fn, arg))
        return self.tickets

    def take(self, ticket: int) -> Any:
        fn, arg = pickle.loads(self.calls.pop(ticket))
        self.answers.append(pickle.loads(pickle.dumps(fn(arg))))
        return self.answers[-1]

    def discard(self, tickets: Any) -> None:
        for t in tickets:
            self.calls.pop(t, None)


def test_blocks_travel_to_workers_once_and_come_back_only_where_derived() -> None:
    """A task carries its blocks as a ``Parcel``, pickled once for every task that carries the same
    list; a choice whose blocks are the task's own (DDP's) comes back without them, one whose mode
    derived others (FSDP's gathered weights) with them; the search puts the former back and finds
    exactly what it finds without a pool."""
    raw = _blocks([(18, 55, 78, 38, 4), (5, 35, 70, 40, 2), (4, 38, 302, 25, 3), (4, 36, 374, 9, 1)])
    # autocast's weight copies among the activations: FSDP's stages hold none, so its blocks are derived anew
    blocks = [b.model_copy(update={"weight_cast_bytes": b.activation_bytes // 4}) for b in raw]
    limit = int(sum(b.param_bytes for b in blocks) * 4.0 * 4 / 4)  # FSDP fits some layouts DDP does not
    space = SearchSpace(32, "auto", None, None, (1, 2, 4), "auto", fsdp_units="auto", accumulation=None)
    constraints = Constraints(OptimizerSpec(), limit, "auto")
    cluster, scaling = Cluster(4, LINK), Scaling(1, 0.1, 1)
    parcel = pending_module.Parcel(blocks)
    assert pickle.loads(pickle.dumps(parcel)) == blocks
    data = parcel._data
    pickle.dumps((parcel, parcel))
    assert parcel._data is data  # pickled once
    alone = _evaluate_all(blocks, cluster, space, constraints, scaling)
    pool = _PicklingPool()
    pooled = _evaluate_all(blocks, cluster, space, constraints, scaling, pool=pool)
    assert [_key(c) for c in pooled.results] == [_key(c) for c in alone.results]
    assert [c.blocks for c in pooled.results] == [c.blocks for c in alone.results]
    choices = [a for a, _ in pool.answers if hasattr(a, "blocks")]
    assert any(not c.blocks and c.layout.dp_mode == "ddp" for c in choices)
    assert any(c.blocks and c.layout.dp_mode == "fsdp" for c in choices)
    assert all(c.blocks or c.layout.dp_mode == "ddp" for c in choices)
