"""The search's pruning is exact: on random small problems, the search that rules layouts out by their
floors (``planner.core.layout.bounds``) finds the same winner as the search that evaluates every
layout, and every candidate within the pruning threshold with the same figures."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from plan_factory import LINK, MB, block

import planner.core.layout.pending as pending_module
import planner.core.layout.search as search_module
from planner.core.layout.inputs import Cluster, Constraints, Scaling, SearchSpace
from planner.core.layout.search import TIE, _evaluate_all, _rank
from planner.schema.costs import BlockCost, OptimizerSpec


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
    with pytest.MonkeyPatch.context() as mp:  # floors of nothing: every layout is evaluated
        mp.setattr(pending_module, "floors", lambda *a, **k: (0.0, 0))
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
    evaluated, floors = search_module.evaluated, pending_module.floors

    def full_floors(*a: Any, **k: Any) -> Any:
        return floors(*a, **{**k, "read_orders": True})

    for run, full in enumerate((False, True)):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(search_module, "evaluated", lambda task, run=run: seen[run].append(task[2]) or evaluated(task))
            if full:  # every floor read off the orders when the layout is enumerated
                mp.setattr(pending_module, "floors", full_floors)
                mp.setattr(pending_module, "LIVE_CLOSED_FORMS", tuple(search_module.SCHEDULES))
            outcome = _evaluate_all(blocks, cluster, space, constraints, scaling)
        if not full:
            quick = outcome
    assert seen[0] == seen[1]
    assert [_key(c) for c in quick.results] == [_key(c) for c in outcome.results]
    assert (quick.evaluated, quick.pruned, quick.layouts) == (outcome.evaluated, outcome.pruned, outcome.layouts)
