"""Pure-tier tests of planner.core.simulate (and planner.core.schedules without torch)."""

from __future__ import annotations

import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from planner.core.schedules import SCHEDULES, action_order, peak_in_flight
from planner.core.simulate import Durations, simulate
from planner.errors import InfeasibleError


def _equal(p: int, f: float, b: float) -> list[Durations]:
    return [(f, b)] * p


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("m", [5, 6, 8, 11])
def test_equal_stages_match_megatron_formula(schedule: str, p: int, m: int) -> None:
    # Narayanan et al. 2021 Eq. 1: (m + p - 1)(t_f + t_b); GPipe §2.3 bubble (p-1)/(m+p-1).
    res = simulate(_equal(p, 1.0, 2.0), schedule, m)
    assert res.step_time_s == (m + p - 1) * 3.0
    assert res.bubble_fraction == (p - 1) / (m + p - 1)
    assert res.busy_s == [m * 3.0] * p
    assert len(res.events) == 2 * m * p


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_one_stage(schedule: str) -> None:
    res = simulate(_equal(1, 1.5, 2.5), schedule, 7)
    assert res.step_time_s == 7 * 4.0
    assert res.bubble_fraction == 0.0
    assert res.peak_in_flight == [7 if schedule == "gpipe" else 1]


def _unbalanced() -> list[Durations]:
    return [
        (1.0 + 0.5, 2.0 + 0.0),  # forward 1 + message 0.5, backward 2
        (2.0, 3.0),
    ]


def test_unbalanced_1f1b_by_hand() -> None:
    # rank0: F0[0,1.5] F1[1.5,3] B0[6.5,8.5] F2[8.5,10] B1[11.5,13.5] B2[16.5,18.5]
    # rank1: F0[1.5,3.5] B0[3.5,6.5] F1[6.5,8.5] B1[8.5,11.5] F2[11.5,13.5] B2[13.5,16.5]
    res = simulate(_unbalanced(), "1f1b", 3)
    assert res.step_time_s == 18.5
    assert res.busy_s == [10.5, 15.0]
    assert res.bubble_fraction == (37.0 - 25.5) / 37.0
    assert res.peak_in_flight == [2, 1]
    by_key = {(e.rank, e.kind, e.microbatch): (e.start_s, e.end_s) for e in res.events}
    assert by_key[(0, "B", 0)] == (6.5, 8.5)
    assert by_key[(0, "F", 2)] == (8.5, 10.0)
    assert by_key[(0, "B", 1)] == (11.5, 13.5)
    assert by_key[(1, "F", 1)] == (6.5, 8.5)
    assert by_key[(1, "F", 2)] == (11.5, 13.5)
    assert by_key[(1, "B", 2)] == (13.5, 16.5)


def test_unbalanced_gpipe_by_hand() -> None:
    # rank1 forwards end at 7.5, then B0[7.5,10.5] B1[10.5,13.5] B2[13.5,16.5];
    # rank0 backwards B0[10.5,12.5] B1[13.5,15.5] B2[16.5,18.5].
    res = simulate(_unbalanced(), "gpipe", 3)
    assert res.step_time_s == 18.5
    assert res.peak_in_flight == [3, 3]
    by_key = {(e.rank, e.kind, e.microbatch): (e.start_s, e.end_s) for e in res.events}
    assert by_key[(1, "B", 0)] == (7.5, 10.5)
    assert by_key[(0, "B", 1)] == (13.5, 15.5)


def test_rejects_bad_requests() -> None:
    with pytest.raises(InfeasibleError, match="needs at least one microbatch per stage"):
        simulate(_equal(4, 1.0, 1.0), "1f1b", 3)
    with pytest.raises(InfeasibleError, match="not supported"):
        simulate(_equal(2, 1.0, 1.0), "zb-v", 4)
    with pytest.raises(InfeasibleError, match="stages is empty"):
        simulate([], "gpipe", 4)


def test_schedule_orders_pure() -> None:
    assert action_order("1f1b", 3, 4)[0] == [
        ("F", 0),
        ("F", 1),
        ("F", 2),
        ("B", 0),
        ("F", 3),
        ("B", 1),
        ("B", 2),
        ("B", 3),
    ]
    assert action_order("1f1b", 3, 4)[2] == [
        ("F", 0),
        ("B", 0),
        ("F", 1),
        ("B", 1),
        ("F", 2),
        ("B", 2),
        ("F", 3),
        ("B", 3),
    ]
    assert [peak_in_flight(o) for o in action_order("1f1b", 4, 6)] == [4, 3, 2, 1]
    assert [peak_in_flight(o) for o in action_order("gpipe", 4, 3)] == [3, 3, 3, 3]


times = st.one_of(st.integers(0, 4).map(float), st.floats(0.0, 3.0, allow_nan=False))
stage_times_st = st.tuples(times, times)


@settings(max_examples=150, deadline=None)
@given(
    stages=st.lists(stage_times_st, min_size=1, max_size=5), m=st.integers(1, 8), schedule=st.sampled_from(SCHEDULES)
)
def test_simulation_bounds(stages: list[Durations], m: int, schedule: str) -> None:
    p = len(stages)
    assume(schedule == "gpipe" or m >= p)
    res = simulate(stages, schedule, m)
    tol = 1e-9 * max(1.0, res.step_time_s)
    assert res.step_time_s + tol >= max(res.busy_s)
    # One microbatch's chain: forward down every stage, then backward up every stage.
    chain = sum(f + b for f, b in stages)
    assert res.step_time_s + tol >= chain
    assert res.peak_in_flight == [peak_in_flight(o) for o in action_order(schedule, p, m)]
    assert 0.0 <= res.bubble_fraction <= 1.0  # 0 when every time is 0 (no capacity to waste)
    # Each rank runs its actions in the schedule's order, never two at once.
    for rank in range(p):
        evs = sorted((e for e in res.events if e.rank == rank), key=lambda e: (e.start_s, e.end_s))
        for a, b in zip(evs, evs[1:]):
            assert a.end_s <= b.start_s + tol


@settings(max_examples=100, deadline=None)
@given(stage=stage_times_st, p=st.integers(1, 5), extra=st.integers(0, 5))
def test_gpipe_equals_1f1b_on_equal_stages(stage: Durations, p: int, extra: int) -> None:
    # Narayanan et al. 2021 §2.2: 1F1B has the same bubble as GPipe; with equal stages both take (m+p-1)(t_f+t_b).
    m = p + extra
    g = simulate([stage] * p, "gpipe", m)
    o = simulate([stage] * p, "1f1b", m)
    assert math.isclose(g.step_time_s, o.step_time_s, rel_tol=1e-9, abs_tol=1e-12)
    per_mb = stage[0] + stage[1]
    assert math.isclose(g.step_time_s, (m + p - 1) * per_mb, rel_tol=1e-9, abs_tol=1e-12)


def test_shared_processors_slow_busy_ranks_down() -> None:
    # Two equal stages on ONE processor (slots=1): whenever both ranks are busy each runs at half
    # speed. GPipe p=2, m=2, f=1, b=2, no comm: 2 ranks x 2 microbatches x 3 s = 12 s of work on one
    # processor, which is never idle (some action is always ready), so the step takes exactly 12 s.
    st = [(1.0, 2.0)] * 2
    shared = simulate(st, "gpipe", 2, slots=1)
    assert shared.step_time_s == pytest.approx(12.0)
    # With a processor per rank the textbook (m + p - 1)(f + b) = 9 s holds.
    assert simulate(st, "gpipe", 2).step_time_s == pytest.approx(9.0)
    assert simulate(st, "gpipe", 2, slots=2).step_time_s == pytest.approx(9.0)


@settings(max_examples=100, deadline=None)
@given(
    p=st.integers(1, 5),
    m=st.integers(1, 6),
    f=st.integers(1, 5),
    b=st.integers(1, 5),
    slots=st.sampled_from([1.0, 1.5, 2.0]),
)
def test_shared_step_bounded_by_work_and_by_dedicated(p: int, m: int, f: int, b: int, slots: float) -> None:
    st_ = [(float(f), float(b))] * p
    for schedule in ("gpipe", "1f1b"):
        if schedule == "1f1b" and m < p:
            continue
        dedicated = simulate(st_, schedule, m).step_time_s
        shared = simulate(st_, schedule, m, slots=slots).step_time_s
        work = p * m * (f + b)
        assert shared >= dedicated - 1e-9  # sharing never speeds anything up
        assert shared >= work / min(slots, p) - 1e-9  # the processors cannot do more than slots x time
        assert shared <= dedicated * max(1.0, p / slots) + 1e-9  # nor slow anything by more than p / slots
