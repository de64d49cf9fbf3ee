"""Pure-tier tests of planner.core.step.simulate (and planner.core.step.schedules without torch)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from planner.core.step.schedules import (
    SCHEDULES,
    Action,
    action_order,
    check_schedule,
    in_flight_per_stage,
    live_at_first_backward,
    peak_in_flight,
    peak_live_bytes,
    prefix_states,
    rank_orders,
    rank_states,
    stage_ranks,
    stages_per_rank_options,
)
from planner.core.step.simulate import Durations, Event, StageTimes, Traffic, simulate, simulate_step
from planner.errors import InfeasibleError

SINGLE = ("gpipe", "1f1b")
LOOPED = ("interleaved-1f1b", "looped-bfs")
SPLIT = ("interleaved-zb", "zbv", "dualpipev")


def _equal(p: int, f: float, b: float) -> list[Durations]:
    return [(f, b)] * p


def _runnable(schedule: str, p: int, m: int, v: int) -> bool:
    try:
        check_schedule(schedule, p, m, v)
    except InfeasibleError:
        return False
    return True


@pytest.mark.parametrize("schedule", SINGLE)
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("m", [5, 6, 8, 11])
def test_equal_stages_match_megatron_formula(schedule: str, p: int, m: int) -> None:
    # Narayanan et al. 2021 Eq. 1: (m + p - 1)(t_f + t_b); GPipe §2.3 bubble (p-1)/(m+p-1).
    res = simulate(_equal(p, 1.0, 2.0), schedule, m)
    assert res.step_time_s == (m + p - 1) * 3.0
    assert res.bubble_fraction == (p - 1) / (m + p - 1)
    assert res.busy_s == [m * 3.0] * p
    assert len(res.events) == 2 * m * p


@pytest.mark.parametrize("schedule", LOOPED)
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("v", [1, 2, 3])
@pytest.mark.parametrize("extra", [0, 1, 3, 7])
def test_equal_stages_match_interleaved_formula(schedule: str, p: int, v: int, extra: int) -> None:
    # Narayanan et al. 2021 §2.2.2: with v stages per rank of t_f + t_b each, the step takes
    # (m v + p - 1)(t_f + t_b): the bubble (p - 1)(t_f + t_b) is 1/v of one-stage-per-rank 1F1B's
    # (p - 1) v (t_f + t_b). It holds for m >= p (fewer microbatches cannot fill the loop).
    m = p + extra
    assume_runnable = _runnable(schedule, p, m, v)
    if not assume_runnable:
        pytest.skip("torch refuses this microbatch count")
    res = simulate(_equal(p * v, 1.0, 2.0), schedule, m, stages_per_rank=v)
    assert res.step_time_s == (m * v + p - 1) * 3.0
    assert res.bubble_fraction == (p - 1) / (m * v + p - 1)
    assert len(res.events) == 2 * m * p * v


@pytest.mark.parametrize("schedule", SPLIT)
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("extra", [0, 1, 4])
def test_zero_bubble_when_f_equals_i_equals_w(schedule: str, p: int, extra: int) -> None:
    # Qi et al. 2023: with F = I = W the zero-bubble schedules fill every slot after the first
    # forwards reach the last rank, so each rank idles only the (p - 1) F that precede its first
    # action on the way down (ZB-V's bubble (p - 1)(T_F + T_B - 2 T_W) is 0 beyond that fill).
    v = stages_per_rank_options(schedule, 2)[-1]
    m = 2 * p + extra
    if not _runnable(schedule, p, m, v):
        pytest.skip("torch refuses this microbatch count")
    res = simulate([StageTimes(1.0, 2.0, 1.0, 1.0)] * (p * v), schedule, m, stages_per_rank=v)
    assert res.step_time_s == m * v * 3.0 + (p - 1) * 1.0
    assert max(res.bubble_s) == (p - 1) * 1.0
    # every action of the split: F, I and W per microbatch and stage (DualPipeV runs some full B)
    kinds = {e.kind for e in res.events}
    assert {"F", "W"} <= kinds


def test_zbv_beats_1f1b_on_the_same_work() -> None:
    # Same total work per rank (two half-size stages vs one): ZB-V's bubble (p - 1) F vs 1F1B's (p - 1)(F + B).
    p, m = 4, 8
    one = simulate([(2.0, 4.0)] * p, "1f1b", m)
    zbv = simulate([StageTimes(1.0, 2.0, 1.0, 1.0)] * (2 * p), "zbv", m, stages_per_rank=2)
    assert one.step_time_s == (m + p - 1) * 6.0
    assert zbv.step_time_s == m * 6.0 + (p - 1) * 1.0
    assert zbv.step_time_s < one.step_time_s


@pytest.mark.parametrize("schedule", SINGLE)
def test_one_stage(schedule: str) -> None:
    res = simulate(_equal(1, 1.5, 2.5), schedule, 7)
    assert res.step_time_s == 7 * 4.0
    assert res.bubble_fraction == 0.0
    assert res.peak_in_flight == [7 if schedule == "gpipe" else 1]
    assert res.bubble_s == [0.0]


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
    with pytest.raises(InfeasibleError, match="exactly 2 stages on every rank"):
        simulate(_equal(2, 1.0, 1.0), "zbv", 4)
    with pytest.raises(InfeasibleError, match="do not split into 2 stages per rank"):
        simulate(_equal(3, 1.0, 1.0), "interleaved-1f1b", 4, stages_per_rank=2)
    with pytest.raises(InfeasibleError, match="dualpipev on 2 ranks"):
        simulate(_equal(4, 1.0, 1.0), "dualpipev", 3, stages_per_rank=2)
    with pytest.raises(InfeasibleError, match="multiple of its number of rounds"):
        simulate(_equal(4, 1.0, 1.0), "interleaved-1f1b", 5, stages_per_rank=2)


def _kinds(order: list[Action]) -> list[tuple[str, int]]:
    return [(a.kind, a.microbatch) for a in order]


def test_schedule_orders_pure() -> None:
    assert _kinds(action_order("1f1b", 3, 4)[0]) == [
        ("F", 0),
        ("F", 1),
        ("F", 2),
        ("B", 0),
        ("F", 3),
        ("B", 1),
        ("B", 2),
        ("B", 3),
    ]
    assert _kinds(action_order("1f1b", 3, 4)[2]) == [
        ("F", 0),
        ("B", 0),
        ("F", 1),
        ("B", 1),
        ("F", 2),
        ("B", 2),
        ("F", 3),
        ("B", 3),
    ]
    assert in_flight_per_stage("1f1b", 4, 6) == [4, 3, 2, 1]
    assert in_flight_per_stage("gpipe", 4, 3) == [3, 3, 3, 3]
    # Interleaved 1F1B, 2 ranks x 2 stages, 4 microbatches (torch's ScheduleInterleaved1F1B, checked
    # against torch in test_schedules_torch): rank 0 holds stages 0 and 2.
    assert [f"{a.stage}{a.kind}{a.microbatch}" for a in action_order("interleaved-1f1b", 2, 4, 2)[0]] == (
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3".split()
    )


def test_placements() -> None:
    assert stage_ranks("1f1b", 4, 1) == [0, 1, 2, 3]
    assert stage_ranks("interleaved-1f1b", 2, 3) == [0, 1, 0, 1, 0, 1]
    assert stage_ranks("zbv", 3, 2) == [0, 1, 2, 2, 1, 0]
    assert stage_ranks("dualpipev", 2, 2) == [0, 1, 1, 0]
    with pytest.raises(InfeasibleError, match="one stage per rank"):
        stage_ranks("gpipe", 2, 2)


def test_peak_live_bytes_of_a_rank_with_two_stages() -> None:
    # rank 0 of interleaved 1F1B (above): stage 0 holds 10 bytes per live microbatch, stage 2 holds 1.
    order = action_order("interleaved-1f1b", 2, 4, 2)[0]
    assert peak_in_flight(order) == {0: 4, 2: 2}
    # after 0F0 0F1 2F0 2F1 0F2: 3 x 10 + 2 x 1; then 2B0 0F3: 4 x 10 + 1 = 41 is the peak
    assert peak_live_bytes(order, {0: 10, 2: 1}) == 41
    assert peak_live_bytes(order, {0: 10, 2: 1}) < 4 * 10 + 2 * 1  # less than the sum of the stage peaks
    # with gradients from each stage's first backward on: stage 2's (7) from 2B0, so 41 + 7; stage
    # 0's (5) from 0B0, after which it holds at most 3 live: 3 x 10 + 5 + 7 + stage 2's live
    assert peak_live_bytes(order, {0: 10, 2: 1}, {0: 5, 2: 7}) == 48
    # a share made after a stage's last backward (an FSDP stage unit's reduce-scatter): stage 2's 100
    # comes after 2B3, when stage 0 still holds microbatches 2 and 3 (2 x 10) and both stages'
    # gradients (12); stage 0's own share after 0B3, the last action, beside nothing live
    assert [(a.stage, a.kind, a.microbatch) for a in order[-3:]] == [(2, "B", 3), (0, "B", 2), (0, "B", 3)]
    assert peak_live_bytes(order, {0: 10, 2: 1}, {0: 5, 2: 7}, {2: 100}) == 2 * 10 + 12 + 100
    assert peak_live_bytes(order, {0: 10, 2: 1}, {0: 5, 2: 7}, {0: 100}) == 12 + 100


def _walked_peak(order, per_mb, grads, reduced):  # type: ignore[no-untyped-def]
    """peak_live_bytes by its definition: the running sum after every action of the order."""
    last = {a.stage: i for i, a in enumerate(order) if a.kind in ("B", "W")}
    live = peak = 0
    seen: set[int] = set()
    for i, a in enumerate(order):
        if a.kind == "F":
            live += per_mb.get(a.stage, 0)
        elif a.kind in ("B", "W"):
            live -= per_mb.get(a.stage, 0)
            if a.stage not in seen:
                seen.add(a.stage)
                live += grads.get(a.stage, 0)
            if last[a.stage] == i:
                live += reduced.get(a.stage, 0)
        peak = max(peak, live)
    return peak


@settings(max_examples=150)
@given(
    schedule=st.sampled_from(SCHEDULES),
    p=st.integers(1, 5),
    m=st.integers(1, 12),
    v=st.integers(1, 3),
    sizes=st.lists(st.integers(0, 1000), min_size=45, max_size=45),
)
def test_peak_from_the_distinct_states_is_the_walked_peak(schedule, p, m, v, sizes) -> None:  # type: ignore[no-untyped-def]
    # rank_states keeps each rank's distinct states, not its order: the peak over them is the walk's
    assume(_runnable(schedule, p, m, v))
    n = len(stage_ranks(schedule, p, v))
    per_mb, grads, reduced = ({s: sizes[k * 15 + s] for s in range(n)} for k in range(3))
    for order, states in zip(rank_orders(schedule, p, m, v), rank_states(schedule, p, m, v)):
        want = _walked_peak(order, per_mb, grads, reduced)
        assert peak_live_bytes(states, per_mb, grads, reduced) == want == peak_live_bytes(order, per_mb, grads, reduced)
        assert len(states.counts) <= len(order) + 1


def test_a_long_order_has_few_distinct_states() -> None:
    # 1F1B at m 512 on 16 ranks: 1,024 actions a rank, at most 4 (p + 1) distinct states
    for order, states in zip(rank_orders("1f1b", 16, 512), rank_states("1f1b", 16, 512)):
        assert len(order) == 1024 and len(states.counts) <= 4 * 17
    # one row per distinct state, in the order the walk meets them: live microbatches, whether the
    # first backward ran, whether the last did
    assert prefix_states(rank_orders("gpipe", 2, 3)[0]).counts.tolist() == [
        [0, 0, 0],
        [1, 0, 0],
        [2, 0, 0],
        [3, 0, 0],
        [2, 1, 0],
        [1, 1, 0],
        [0, 1, 1],
    ]
    # a rank with two stages (interleaved 1F1B, 2 ranks x 2 stages, 4 microbatches): six columns
    two = prefix_states(rank_orders("interleaved-1f1b", 2, 4, 2)[0])
    assert two.stages == (0, 2) and two.counts.shape[1] == 6 and two.counts[0].tolist() == [0] * 6
    assert two.counts[-1].tolist() == [0, 0, 1, 1, 1, 1]


@settings(max_examples=100)
@given(
    schedule=st.sampled_from(SCHEDULES),
    p=st.integers(1, 4),
    m=st.integers(1, 10),
    v=st.integers(1, 3),
    sizes=st.lists(st.integers(-1000, 1000), min_size=36, max_size=36),
)
def test_a_negative_byte_count_takes_the_peak_over_every_state(schedule, p, m, v, sizes) -> None:  # type: ignore[no-untyped-def]
    # the front holds the peak only for non-negative counts: with a negative one every state is read
    assume(_runnable(schedule, p, m, v))
    n = len(stage_ranks(schedule, p, v))
    per_mb, grads, reduced = ({s: sizes[k * 12 + s] for s in range(n)} for k in range(3))
    for order, states in zip(rank_orders(schedule, p, m, v), rank_states(schedule, p, m, v)):
        assert peak_live_bytes(states, per_mb, grads, reduced) == _walked_peak(order, per_mb, grads, reduced)


def test_gradients_come_with_one_microbatch_fewer_where_every_forward_comes_first() -> None:
    # GPipe: 3 x 5 live before the first backward, then 2 x 5 with the gradients (8)
    assert peak_live_bytes(action_order("gpipe", 2, 3)[0], {0: 5}, {0: 8}) == 18
    assert peak_live_bytes(action_order("gpipe", 2, 3)[0], {0: 5}, {0: 4}) == 15
    # 1F1B, rank 0 of 2 with 4 microbatches: after a backward its warm-up's 2 live come back
    assert peak_live_bytes(action_order("1f1b", 2, 4)[0], {0: 5}, {0: 4}) == 14
    # 1F1B with as many microbatches as the first rank's warm-up: all forwards first there
    assert peak_live_bytes(action_order("1f1b", 2, 2)[0], {0: 5}, {0: 4}) == 10
    assert peak_live_bytes(action_order("1f1b", 2, 2)[1], {1: 5}, {1: 4}) == 9


times = st.one_of(st.integers(0, 4).map(float), st.floats(0.0, 3.0, allow_nan=False))
stage_times_st = st.tuples(times, times)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(
    p=st.integers(1, 4),
    v=st.integers(1, 3),
    m=st.integers(1, 9),
    schedule=st.sampled_from(SCHEDULES),
    data=st.data(),
)
def test_simulation_bounds(p: int, v: int, m: int, schedule: str, data: st.DataObject) -> None:
    v = v if v in stages_per_rank_options(schedule, 3) else stages_per_rank_options(schedule, 3)[0]
    assume(_runnable(schedule, p, m, v))
    stages = data.draw(st.lists(st.tuples(times, times, times), min_size=p * v, max_size=p * v))
    timed = [StageTimes(f, i + w, i, w) for f, i, w in stages]
    res = simulate(timed, schedule, m, stages_per_rank=v)
    tol = 1e-9 * max(1.0, res.step_time_s)
    assert res.step_time_s + tol >= max(res.busy_s)
    # One microbatch's chain: forward down every stage, then the input gradient back up every stage.
    split = schedule in SPLIT
    chain = sum(t.f + (t.i if split and t.i is not None else t.b) for t in timed)
    assert res.step_time_s + tol >= chain
    assert res.peak_in_flight == in_flight_per_stage(schedule, p, m, v)
    assert 0.0 <= res.bubble_fraction <= 1.0  # 0 when every time is 0 (no capacity to waste)
    ranks = stage_ranks(schedule, p, v)
    # every (stage, microbatch) runs its forward once and its whole backward once, on its own rank
    for s in range(p * v):
        mine = [e for e in res.events if e.stage == s]
        assert all(e.rank == ranks[s] for e in mine)
        assert sorted(e.microbatch for e in mine if e.kind == "F") == list(range(m))
        full = sorted(e.microbatch for e in mine if e.kind == "B")
        inp = sorted(e.microbatch for e in mine if e.kind == "I")
        wgt = sorted(e.microbatch for e in mine if e.kind == "W")
        assert sorted(full + inp) == list(range(m)) and inp == wgt
    # dependencies: a forward after the previous stage's, an input gradient after the next stage's
    end = {(e.kind, e.stage, e.microbatch): e.end_s for e in res.events}
    for e in res.events:
        if e.kind == "F" and e.stage > 0:
            assert e.start_s + tol >= end[("F", e.stage - 1, e.microbatch)]
        if e.kind in ("B", "I") and e.stage < p * v - 1:
            nxt = end.get(("B", e.stage + 1, e.microbatch), end.get(("I", e.stage + 1, e.microbatch)))
            assert nxt is not None and e.start_s + tol >= nxt
    # Each rank runs its actions in the schedule's order, never two at once.
    for rank in range(p):
        evs = [e for e in res.events if e.rank == rank]
        expected = [(a.stage, a.kind, a.microbatch) for a in action_order(schedule, p, m, v)[rank]]
        assert [
            (e.stage, e.kind, e.microbatch) for e in sorted(evs, key=lambda e: (e.start_s, e.end_s))
        ] == expected or all(e.end_s == e.start_s for e in evs)
        evs = sorted(evs, key=lambda e: (e.start_s, e.end_s))
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


def test_ranks_sharing_a_processor_compete_for_compute_not_for_waits() -> None:
    """Two ranks on one processor, GPipe, m = 2; F = 3 s (1 of it a wait), B = 5 s (1 a wait).

    By hand: rank 0 computes F0 alone (t = 2) and waits (t = 3); F1 on rank 0 and F0 on rank 1
    then compute 2 s each at half speed (t = 7) and wait (t = 8); rank 1 computes F1 alone (t = 10,
    wait to 11) and B0 alone (t = 15, 16); B0 on rank 0 and B1 on rank 1 compute 4 s each at half
    speed (t = 24, wait to 25); rank 0's B1 alone: 29, wait to 30. With the waits counted as
    compute (msg = 0) every overlap stretches them too: 32 s."""
    waits = [StageTimes(3.0, 5.0, msg=1.0), StageTimes(3.0, 5.0, msg=1.0)]
    assert simulate(waits, "gpipe", 2, slots=1).step_time_s == pytest.approx(30.0)
    assert simulate([StageTimes(3.0, 5.0)] * 2, "gpipe", 2, slots=1).step_time_s == pytest.approx(32.0)
    # with a processor per rank the waits change nothing: the plain makespan, (m + p - 1)(F + B)
    assert simulate(waits, "gpipe", 2).step_time_s == pytest.approx(24.0)
    assert simulate(waits, "gpipe", 2, slots=2).step_time_s == pytest.approx(24.0)


def test_a_link_cpu_share_sets_the_wait_of_each_action() -> None:
    """``stage_times`` splits each action's message time by the link's ``cpu_share``."""
    from planner.core.step.predict import stage_times
    from planner.schema.plan import StagePlan

    st = StagePlan(
        index=0, rank=0, start=0, end=1, first_block="a", last_block="a", split_node=None, params=1,
        fwd_s=1.0, bwd_s=2.0, comm_s=0.5, time_s=3.5, opt_s=0.0, recompute=False, activation_bytes=0,
        in_flight=1, memory_bytes=0,
    )  # fmt: skip
    assert stage_times([st])[0] == StageTimes(1.25, 2.25, None, None, 0.0)
    assert stage_times([st], cpu_share=0.6)[0].msg == pytest.approx(0.1)
    assert stage_times([st], cpu_share=0.0)[0].msg == pytest.approx(0.25)


def _reference_in_flight(schedule: str, p: int, m: int, v: int) -> list[int]:
    """The in-flight counts read off freshly built orders, one rank at a time (no cache, no closed form)."""
    out = [0] * (p * v)
    for rank in range(p):
        order = [a for a in action_order(schedule, p, m, v)[rank]]
        for stage, peak in peak_in_flight(order).items():
            out[stage] = peak
    return [max(1, x) for x in out]


def _small_shapes(schedule: str) -> Iterator[tuple[int, int, int]]:
    """Every shape (ranks, microbatches, stages per rank) of ``schedule`` torch runs, up to 6 ranks,
    12 microbatches and 4 stages per rank."""
    for p in range(1, 7):
        for m in range(1, 13):
            for v in stages_per_rank_options(schedule, 4):
                if _runnable(schedule, p, m, v):
                    yield p, m, v


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_in_flight_closed_forms_and_cache_match_the_orders(schedule: str) -> None:
    # every small shape: GPipe's m and 1F1B's min(m, p - i) are exact, and cached answers are fresh copies
    for p, m, v in _small_shapes(schedule):
        expected = _reference_in_flight(schedule, p, m, v)
        got = in_flight_per_stage(schedule, p, m, v)
        assert got == expected, (schedule, p, m, v)
        got.append(-1)  # a caller's list is its own
        assert in_flight_per_stage(schedule, p, m, v) == expected
        assert [list(o) for o in rank_orders(schedule, p, m, v)] == action_order(schedule, p, m, v)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_live_at_first_backward_matches_the_orders(schedule: str) -> None:
    """Per rank, the fewest microbatches any of its stages holds at the rank's first backward: the
    closed forms (GPipe and looped breadth-first: m; 1F1B: its warm-up; the interleaved schedules: their
    warm-up dealt to the chunks) and the counts read off the orders agree with the orders walked
    afresh, and never exceed the stages' in-flight peaks."""
    for p, m, v in _small_shapes(schedule):
        got = live_at_first_backward(schedule, p, m, v)
        peaks = in_flight_per_stage(schedule, p, m, v)
        for rank, order in enumerate(action_order(schedule, p, m, v)):
            first = next(k for k, a in enumerate(order) if a.kind != "F")
            stages = {a.stage for a in order}
            done = [sum(1 for a in order[:first] if a.stage == s) for s in stages]
            assert got[rank] == min(done) >= 1, (schedule, p, m, v, rank)
            assert got[rank] <= min(peaks[s] for s in stages)


def _reference_run(
    times: list[StageTimes], orders: list[list[Action]], traffic: Traffic | None = None
) -> tuple[list[Event], list[float], float]:
    """The simulator's event loop as it was before it ran a precomputed program (the reference); with
    ``traffic``, each rank's gathers back to back from 0 in the order its own list first names its
    stages, and the rank held for a stage's reduction after the stage's m-th ``B`` or ``W``."""
    p, n_stages = len(orders), len(times)
    end: dict[tuple[str, int, int], float] = {}
    next_idx = [0] * p
    free_at = [0.0] * p
    busy = [0.0] * p
    ready = [0.0] * n_stages
    grads = [0] * n_stages
    m = sum(1 for a in orders[0] if a.kind == "F") // max(1, len({a.stage for a in orders[0]}))
    if traffic is not None:
        for order in orders:
            clock = 0.0
            for s in dict.fromkeys(a.stage for a in order):
                clock += traffic.gather[s]
                ready[s] = clock
    events: list[Event] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        for rank in range(p):
            while next_idx[rank] < len(orders[rank]):
                a = orders[rank][next_idx[rank]]
                if a.kind == "F":
                    deps = [("F", a.stage - 1, a.microbatch)] if a.stage > 0 else []
                elif a.kind == "W":
                    deps = [("G", a.stage, a.microbatch)]
                else:
                    deps = [("F", a.stage, a.microbatch)]
                    deps += [("G", a.stage + 1, a.microbatch)] if a.stage < n_stages - 1 else []
                if any(d not in end for d in deps):
                    break
                start = max([free_at[rank], ready[a.stage]] + [end[d] for d in deps])
                dur = times[a.stage].of(a.kind)
                finish = start + dur
                if a.kind != "W":
                    end[("F" if a.kind == "F" else "G", a.stage, a.microbatch)] = finish
                free_at[rank] = finish
                grads[a.stage] += a.kind in "BW"
                if traffic is not None and a.kind in "BW" and grads[a.stage] == m:
                    free_at[rank] += traffic.reduce[a.stage]
                busy[rank] += dur
                events.append(
                    Event(rank=rank, stage=a.stage, kind=a.kind, microbatch=a.microbatch, start_s=start, end_s=finish)
                )
                next_idx[rank] += 1
                remaining -= 1
    return events, busy, max(free_at)


# half of the examples with FSDP traffic
@settings(max_examples=300, deadline=None)
@given(
    p=st.integers(1, 5),
    v=st.integers(1, 3),
    m=st.integers(1, 10),
    schedule=st.sampled_from(SCHEDULES),
    data=st.data(),
)
def test_program_simulation_is_bit_identical_to_the_event_loop(
    p: int, v: int, m: int, schedule: str, data: st.DataObject
) -> None:
    v = v if v in stages_per_rank_options(schedule, 3) else stages_per_rank_options(schedule, 3)[0]
    assume(_runnable(schedule, p, m, v))
    floats = st.floats(0.0, 10.0, allow_nan=False)
    split = st.one_of(st.none(), floats)
    stages = data.draw(st.lists(st.tuples(floats, floats, split, split), min_size=p * v, max_size=p * v))
    timed = [StageTimes(f, b, i, w) for f, b, i, w in stages]
    per_stage = st.lists(floats, min_size=p * v, max_size=p * v)
    # FSDP's stage-unit traffic (simulate.Traffic) or none
    traffic = data.draw(st.one_of(st.none(), st.builds(Traffic, per_stage, per_stage)))
    events, busy, makespan = _reference_run(timed, action_order(schedule, p, m, v), traffic)
    events.sort(key=lambda e: (e.start_s, e.rank))
    res = simulate(timed, schedule, m, stages_per_rank=v, traffic=traffic)
    assert (res.events, res.busy_s, res.step_time_s) == (events, busy, makespan)
    assert simulate_step(timed, schedule, m, stages_per_rank=v, traffic=traffic)[0] == makespan
    if traffic is None:
        assert simulate_step(timed, schedule, m, stages_per_rank=v) == (res.step_time_s, res.bubble_fraction)
        return
    # traffic only adds, and none of it is the same as no traffic
    assert makespan >= simulate_step(timed, schedule, m, stages_per_rank=v)[0]
    none = Traffic([0.0] * (p * v), [0.0] * (p * v))
    assert simulate_step(timed, schedule, m, stages_per_rank=v, traffic=none) == simulate_step(
        timed, schedule, m, stages_per_rank=v
    )


def test_programs_are_kept_while_their_actions_fit_the_budget() -> None:
    """The programs of the shapes used last are kept by their actions (a search meets hundreds of
    shapes, some of 100,000 actions): the least recently used go first; one too large is still
    built and kept alone; a kept program is the one built, column for column."""
    from planner.core.step.simulate import _build_program, _Programs

    kept = _Programs(budget=2 * 4 * 8 + 2 * 2 * 8)  # a 1f1b of 4 x 8 and one of 2 x 8 (2 actions each)
    a, b = kept.get("1f1b", 4, 8, 1), kept.get("1f1b", 2, 8, 1)
    assert a == _build_program("1f1b", 4, 8, 1) and len(a.kind) == 64 and kept.actions == 96
    assert kept.get("1f1b", 4, 8, 1) is a  # used again: now the most recent
    c = kept.get("gpipe", 2, 4, 1)  # 16 more actions: the least recently used (b) goes
    assert list(kept.kept) == [("1f1b", 4, 8, 1), ("gpipe", 2, 4, 1)] and kept.actions == 80
    assert kept.get("1f1b", 2, 8, 1) is not b and kept.get("gpipe", 2, 4, 1) is c
    big = kept.get("zbv", 8, 16, 2)  # over the budget alone: kept alone
    assert list(kept.kept) == [("zbv", 8, 16, 2)] and kept.actions == len(big.kind) == 3 * 8 * 16 * 2


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_program_slots_state_the_dependency_rules(schedule: str) -> None:
    """``_coded`` (the slots a simulator program runs on) says what ``_deps`` / ``_produces`` say, for
    every action of every schedule on small shapes."""
    from planner.core.step.simulate import _coded, _deps, _produces

    for p in (1, 2, 3, 4):
        for v in stages_per_rank_options(schedule, 3):
            for m in (1, 2, 4, 5, 8):
                try:
                    check_schedule(schedule, p, m, v)
                except InfeasibleError:
                    continue
                n = p * v

                def slot(key: tuple[str, int, int], n: int = n, m: int = m) -> int:
                    kind, stage, mb = key
                    return (n * m if kind == "G" else 0) + stage * m + mb

                for order in rank_orders(schedule, p, m, v):
                    for a in order:
                        deps = [slot(k) for k in _deps(a, n)] + [-1, -1]
                        made = _produces(a)
                        want = (deps[0], deps[1], -1 if made is None else slot(made))
                        assert _coded(a, n, m)[:3] == want, (schedule, p, v, m, a)


def test_fsdp_traffic_by_hand() -> None:
    """GPipe, 2 ranks, 2 microbatches, F 1 s, B 2 s; each stage gathers for 0.5 s and reduce-scatters
    for 1 s. Rank 0 gathers before its first forward (0.5 s lost); rank 1 gathers while it waits for
    its first activation (at 1.5 s), reduce-scatters at 7.5 s while rank 0 still computes, and rank 0
    ends its last backward at 9.5 s and its reduction at 10.5 s: 1.5 s more than the 9 s pipeline."""
    stages = [StageTimes(1.0, 2.0)] * 2
    traffic = Traffic(gather=[0.5, 0.5], reduce=[1.0, 1.0])
    res = simulate(stages, "gpipe", 2, traffic=traffic)
    assert res.step_time_s == 10.5
    assert [(e.rank, e.kind, e.start_s) for e in res.events if e.microbatch == 0 and e.kind == "F"] == [
        (0, "F", 0.5),
        (1, "F", 1.5),
    ]
    assert simulate_step(stages, "gpipe", 2, traffic=traffic)[0] == 10.5
    # interleaved, 2 ranks x 2 stages, m 4: rank 1 ends its last backward (stage 1's) at 25 s while
    # rank 0 computes until 27 s, so a 1 s reduction of stage 1 costs nothing; one of stage 0's does
    looped = [StageTimes(1.0, 2.0)] * 4
    assert simulate(looped, "interleaved-1f1b", 4, stages_per_rank=2).step_time_s == 27.0
    hidden = Traffic([0.0] * 4, [0.0, 1.0, 0.0, 0.0])
    assert simulate(looped, "interleaved-1f1b", 4, stages_per_rank=2, traffic=hidden).step_time_s == 27.0
    shown = Traffic([0.0] * 4, [1.0, 0.0, 0.0, 0.0])
    assert simulate(looped, "interleaved-1f1b", 4, stages_per_rank=2, traffic=shown).step_time_s == 28.0
    with pytest.raises(InfeasibleError, match="device per rank"):
        simulate(stages, "gpipe", 2, slots=1, traffic=traffic)
    with pytest.raises(InfeasibleError, match="expected 2"):
        simulate(stages, "gpipe", 2, traffic=Traffic([0.5], [1.0]))
