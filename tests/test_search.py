"""Pure-tier tests of the joint search (planner.core.layout.search) and per-rank memory (planner.core.step.predict)."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from plan_factory import LINK, MB, big_head_blocks, block, plan_of_blocks, predicted, searched

from planner.core.layout.inputs import Cluster, Constraints, Layout
from planner.core.layout.search import TIE, evaluate_choice, microbatch_options, refine
from planner.core.levers.microbatch import blocks_at
from planner.core.split.cuts import Split
from planner.core.split.stage_model import stage_memories
from planner.core.step.schedules import SCHEDULES, placement
from planner.errors import InfeasibleError
from planner.schema.costs import BlockCost, OptimizerSpec

ADAMW = OptimizerSpec()


def _search(blocks: list[BlockCost], **kw: object) -> tuple:
    args: dict[str, object] = dict(
        n_ranks=2,
        batch_size=16,
        size0=4,
        fixed_fraction=0.0,
        schedule="auto",
        n_microbatches=None,
        stages_per_rank=None,
        optimizer=ADAMW,
        memory_limit_bytes=None,
        recompute="auto",
        slots=None,
    )
    args.update(kw)
    return searched(blocks, LINK, **args)  # type: ignore[arg-type]


def test_blocks_at_scales_times_affinely_and_bytes_linearly() -> None:
    b = big_head_blocks()[1].model_copy(update={"bwd_input_s": 0.012, "bwd_weight_s": 0.008, "recompute_s": 0.01})
    (half,) = blocks_at([b], 8, 4, fixed_fraction=0.25)
    # t(4) = t(8) * (0.25 + 0.75 * 4 / 8) = 0.625 t(8)
    assert half.fwd_s == pytest.approx(0.625 * b.fwd_s) and half.bwd_s == pytest.approx(0.625 * b.bwd_s)
    assert half.bwd_input_s == pytest.approx(0.625 * 0.012) and half.recompute_s == pytest.approx(0.625 * 0.01)
    assert half.activation_bytes == b.activation_bytes // 2 and half.cut_bytes == b.cut_bytes // 2
    assert (half.params, half.param_bytes, half.opt_s) == (b.params, b.param_bytes, b.opt_s)
    assert blocks_at([b], 8, 8, 0.5) == [b]


def test_microbatch_options() -> None:
    assert microbatch_options(16, None) == [1, 2, 4, 8, 16]
    assert microbatch_options(64, None) == [1, 2, 4, 8, 16, 32, 64]  # down to one sample per microbatch
    assert microbatch_options(16, None, min_size=4) == [1, 2, 4]  # never below the smallest that ran
    assert microbatch_options(16, 4) == [4]


def test_search_returns_the_fastest_candidate_that_fits(every_layout_solved: None) -> None:
    blocks = big_head_blocks() + [block(f"extra.{i}", 10, 20, 5000) for i in range(4)]
    chosen, ranked, note = _search(blocks)
    fitting = [c for c in ranked if c.fits]
    assert ranked[0] is chosen
    assert chosen.prediction.step_time_s <= min(c.prediction.step_time_s for c in fitting) * (1 + TIE)
    assert chosen.fits
    tried = {(c.layout.schedule, c.layout.n_microbatches, c.layout.stages_per_rank) for c in ranked}
    assert {s for s, _, _ in tried} == set(SCHEDULES)  # every schedule was tried
    assert {v for s, _, v in tried if placement(s) == "v"} == {2}
    assert {v for s, _, v in tried if placement(s) == "single"} == {1}
    assert chosen.layout.schedule in note and f"m={chosen.layout.n_microbatches}" in note


def test_a_tie_goes_to_the_candidate_with_less_memory() -> None:
    # Two equal stages, m = 4: GPipe and 1F1B take the same time, 1F1B holds fewer microbatches.
    # (All of the backward is input gradient, so splitting off W gains the zero-bubble ones nothing.)
    blocks = [
        block(f"layers.{i}", 10, 20, 1000, act_mb=8).model_copy(update={"bwd_input_s": 0.02, "bwd_weight_s": 0.0})
        for i in range(4)
    ]
    chosen, ranked, note = _search(blocks, n_microbatches=4, stages_per_rank=1)
    fastest = min(c.prediction.step_time_s for c in ranked)
    tied = [c for c in ranked if c.prediction.step_time_s <= fastest * (1 + TIE)]
    assert {"gpipe", "1f1b"} <= {c.layout.schedule for c in tied}
    assert chosen.prediction.max_memory_bytes == min(c.prediction.max_memory_bytes for c in tied)
    assert chosen.layout.schedule != "gpipe" and "tied with" in note


def test_search_with_everything_fixed_evaluates_one_candidate() -> None:
    chosen, ranked, _ = _search(big_head_blocks(), schedule="1f1b", n_microbatches=4, stages_per_rank=1)
    assert len(ranked) == 1 and (
        chosen.layout.schedule,
        chosen.layout.n_microbatches,
        chosen.layout.stages_per_rank,
    ) == ("1f1b", 4, 1)
    # the same split and figures as planning 1F1B at m = 4 directly
    plan = plan_of_blocks(big_head_blocks())
    assert chosen.prediction == plan.prediction


def test_search_on_one_rank_is_plain_gradient_accumulation() -> None:
    chosen, ranked, _ = _search(big_head_blocks(), n_ranks=1)
    # every schedule is the same accumulation at one speed: GPipe (all forwards first) and 1F1B (one
    # microbatch's activations held) are the two memory profiles worth trying
    assert {c.layout.schedule for c in ranked} == {"gpipe", "1f1b"}
    for m in {c.layout.n_microbatches for c in ranked}:
        gpipe, one_f = (
            next(c for c in ranked if c.layout.schedule == s and c.layout.n_microbatches == m)
            for s in ("gpipe", "1f1b")
        )
        assert gpipe.prediction.step_time_s == pytest.approx(one_f.prediction.step_time_s, rel=1e-12)
        assert one_f.prediction.max_memory_bytes <= gpipe.prediction.max_memory_bytes


@pytest.mark.parametrize(
    ("schedule", "v", "ranks", "message"),
    [
        # a V schedule's two stages a rank on 3 blocks: said, not "no schedule was given"
        ("zbv", None, 2, r"zbv with 2 stages per rank needs 4 stages, more than the 3 .*; use 1 pipeline rank, or"),
        ("dualpipev", None, 2, r"needs 4 stages, more than the 3 .*; use 1 pipeline rank, or split"),
        # a stage count per rank given: fewer of them is the first remedy, with the ranks as given
        (
            "interleaved-1f1b",
            2,
            2,
            r"interleaved-1f1b with 2 stages per rank needs 4 stages, .*; use --stages-per-rank 1, 1 pipeline rank, or",
        ),
        ("looped-bfs", 3, 1, r"needs 3 stages, more than the 2 .*; use --stages-per-rank 2 or fewer, or split"),
        ("zbv", None, 1, r"needs 2 stages, more than the 1 .*; use a schedule of one stage per rank, or split"),
    ],
)
def test_more_stages_than_blocks_names_the_remedies(schedule: str, v: int | None, ranks: int, message: str) -> None:
    blocks = big_head_blocks()[: {"looped-bfs": 2}.get(schedule, 3 if ranks > 1 else 1)]
    with pytest.raises(InfeasibleError, match=message):
        _search(blocks, n_ranks=ranks, schedule=schedule, stages_per_rank=v, n_microbatches=4)


def test_search_respects_the_memory_limit_and_says_when_nothing_fits() -> None:
    blocks = big_head_blocks()
    free, _, _ = _search(blocks)
    limit = int(free.prediction.max_memory_bytes * 0.9)
    limited, ranked, _ = _search(blocks, memory_limit_bytes=limit)
    assert limited.prediction.max_memory_bytes <= limit
    assert all(c.prediction.max_memory_bytes <= limit for c in ranked if c.fits)
    with pytest.raises(InfeasibleError, match="memory"):
        _search(blocks, memory_limit_bytes=1 * MB, recompute="never")


def test_refine_only_accepts_a_faster_split_that_fits() -> None:
    blocks = [block(f"b{i}", 1 + (i % 3), 2 + (i % 5), 100) for i in range(12)]
    cluster, constraints = Cluster(3, LINK), Constraints(ADAMW, None, "never")
    start = evaluate_choice(blocks, cluster, Layout("1f1b", 3, 6), constraints)
    polished = refine(start, cluster, constraints)
    assert polished.prediction.step_time_s <= start.prediction.step_time_s
    # a local optimum: no single-cut move improves it further
    again = refine(polished, cluster, constraints)
    assert again.prediction == polished.prediction


@settings(max_examples=40, deadline=None)
@given(
    raw=st.lists(st.tuples(st.integers(1, 9), st.integers(1, 9), st.integers(0, 5)), min_size=6, max_size=10),
    schedule=st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b"]),
    dp=st.sampled_from([(1, "ddp"), (2, "fsdp")]),
    picks=st.lists(st.integers(0, 10_000), min_size=1, max_size=8),
)
def test_a_stage_memo_predicts_every_split_as_a_fresh_prediction(
    raw: list, schedule: str, dp: tuple[int, str], picks: list[int]
) -> None:
    # refine lays out many splits of one layout through one StageMemo: each must come out exactly
    # as laid out afresh, whatever splits came before it (and a memo bound to other blocks restarts)
    from planner.core.split.stage_model import Partition
    from planner.core.split.stage_plans import StageMemo

    blocks = [block(f"b{i}", f, b, 1000, act_mb=a) for i, (f, b, a) in enumerate(raw)]
    v = 2 if schedule == "interleaved-1f1b" else 1
    layout = Layout(schedule, 2, 4, v, dp=dp[0], dp_mode=dp[1])
    cluster, constraints = Cluster(2 * dp[0], LINK), Constraints(ADAMW, None, "never")
    every = [(0, *c) for c in itertools.combinations(range(1, len(blocks)), 2 * v - 1)]
    # one split, then others that share its stages at other places (a stage's index matters too)
    splits = [every[k % len(every)] for k in picks] + ([(0, 1, 2, 3), (0, 2, 3, 4)] if v == 2 else [(0, 3), (0, 2)])
    memo = StageMemo()
    other = [block(f"o{i}", 1, 1, 10) for i in range(len(blocks))]
    for starts in splits + splits[:1]:
        trial = Partition(starts=tuple(starts), bottleneck_s=0.0, recompute=())
        fresh = evaluate_choice(blocks, cluster, layout, constraints, trial)
        kept = evaluate_choice(blocks, cluster, layout, constraints, trial, memo)
        assert kept.prediction == fresh.prediction and kept.stages == fresh.stages
    assert memo.stages  # it was kept between the splits
    # the same memo on other blocks: laid out from those, not from the stages it held
    alien = evaluate_choice(other, cluster, layout, constraints, trial, memo)
    assert alien.prediction == evaluate_choice(other, cluster, layout, constraints, trial).prediction


@pytest.mark.parametrize(
    ("starts", "message"),
    [((0, 2), "is not legal"), ((0, 3, 3), "is invalid for 4 blocks"), ((1, 2), "is invalid for 4 blocks")],
)
def test_a_split_off_the_legal_cuts_is_refused_before_it_is_laid_out(starts: tuple, message: str) -> None:
    """``laid_out`` checks the split first (legal cuts, non-empty stages): the error names the cut."""
    from planner.core.step.predict import predict

    blocks = [block(f"b{i}", 1, 2, 1000) for i in range(4)]
    blocks[1] = blocks[1].model_copy(update={"cut_legal": False})  # no cut after b1
    layout = Layout("1f1b" if len(starts) == 2 else "gpipe", len(starts), 4, 1)
    with pytest.raises(InfeasibleError, match=message):
        predict(blocks, Split(starts=tuple(starts)), LINK, layout, ADAMW)


blocks_st = st.lists(
    st.tuples(st.integers(1, 9), st.integers(1, 9), st.integers(0, 5), st.integers(0, 3), st.integers(1, 3)),
    min_size=4,
    max_size=9,
)


@settings(max_examples=60, deadline=None)
@given(raw=blocks_st, m=st.integers(1, 6))
def test_rank_memory_equals_stage_memory_with_one_stage_per_rank(raw: list, m: int) -> None:
    blocks = [block(f"b{i}", f, b, p * 1000, act_mb=a, cut_mb=c) for i, (f, b, p, a, c) in enumerate(raw)]
    starts = [0, len(blocks) // 2]
    for schedule in ("gpipe", "1f1b"):
        if schedule == "1f1b" and m < 2:
            continue
        stages, pred = predicted(blocks, starts, LINK, schedule, m, ADAMW)
        per_stage = stage_memories(
            blocks, Split(starts=tuple(starts)), schedule=schedule, n_microbatches=m, optimizer=ADAMW
        )
        assert [s.memory_bytes for s in stages] == per_stage
        assert pred.max_memory_bytes == max(per_stage)


@settings(max_examples=60, deadline=None)
@given(raw=blocks_st, m=st.integers(2, 6))
def test_rank_memory_with_two_stages_is_at_most_the_sum_of_their_peaks(raw: list, m: int) -> None:
    blocks = [block(f"b{i}", f, b, p * 1000, act_mb=a, cut_mb=c) for i, (f, b, p, a, c) in enumerate(raw)]
    n = len(blocks)
    starts = [0, n // 4, n // 2, 3 * n // 4]
    if len(set(starts)) < 4 or 0 in starts[1:]:
        return
    for schedule in ("interleaved-1f1b", "looped-bfs", "zbv"):
        try:
            stages, pred = predicted(blocks, starts, LINK, schedule, m, ADAMW, stages_per_rank=2)
        except InfeasibleError:
            continue
        for r, mem in enumerate(pred.rank_memory_bytes):
            mine = [s.memory_bytes for s in stages if s.rank == r]
            # the rank holds both stages' weights, and at the moment either stage peaks, at least that
            # stage's activations: no less than either stage alone, no more than both peaks at once
            assert max(mine) <= mem <= sum(mine)
        assert pred.max_memory_bytes == max(pred.rank_memory_bytes)
        assert math.isfinite(pred.step_time_s)


def test_the_first_stage_runs_its_whole_backward_as_w() -> None:
    # torch 2.13's PipelineStage skips I on the first stage and runs the full backward as its W.
    blocks = [
        block(f"layers.{i}", 10, 20, 1000).model_copy(update={"bwd_input_s": 0.012, "bwd_weight_s": 0.008})
        for i in range(4)
    ]
    stages, _ = predicted(blocks, [0, 2], LINK, "interleaved-zb", 4, ADAMW)
    assert (stages[0].bwd_input_s, stages[0].bwd_weight_s) == (0.0, stages[0].bwd_s)
    assert stages[1].bwd_input_s == pytest.approx(0.024) and stages[1].bwd_weight_s == pytest.approx(0.016)


def test_a_runner_up_that_polishes_faster_than_the_polished_winner_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    # the solver's least-bottleneck splits rank the layouts; polishing moves each by a few percent, so
    # the runners-up within REFINE_MARGIN are polished too and the fastest polished one wins
    from types import SimpleNamespace

    from planner.core.layout import search as search_module

    def choice(step: float, fits: bool = True) -> SimpleNamespace:
        return SimpleNamespace(prediction=SimpleNamespace(step_time_s=step), fits=fits, layout=Layout("1f1b", 2, 4))

    winner, close, unfit, far = choice(1.00), choice(1.01), choice(1.01, fits=False), choice(1.20)
    polished = {id(winner): choice(0.99), id(close): choice(0.95), id(unfit): choice(0.5), id(far): choice(0.5)}
    monkeypatch.setattr(search_module, "_polish", lambda c, cluster, constraints: (polished[id(c)], ""))
    best, shown, beaten, _ = search_module._polished_best(winner, [winner, close, unfit, far], None, None)  # type: ignore[arg-type]
    assert best is close and shown is polished[id(close)]  # far is beyond the margin, unfit never runs
    assert beaten == (winner, polished[id(winner)])  # the line compares both polished
    # within TIE the ranked winner stays (it has the least memory, the fewer replicas, the simpler schedule)
    polished[id(close)] = choice(0.99 * (1 - search_module.TIE / 2))
    best, shown, beaten, _ = search_module._polished_best(winner, [winner, close, unfit, far], None, None)  # type: ignore[arg-type]
    assert best is winner and shown is polished[id(winner)] and beaten is None
