"""Several stages per rank under a memory limit: the split is made to fit each rank, not each
stage's share of it (planner.core.layout.rank_fit)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from plan_factory import LINK, block

from planner.core.layout.candidate import evaluate_choice
from planner.core.layout.inputs import Cluster, Constraints, Layout
from planner.core.layout.rank_fit import rank_split
from planner.core.split.cuts import Split
from planner.core.split.solve import solve
from planner.core.step.predict import predict
from planner.core.step.schedules import in_flight_per_stage
from planner.errors import InfeasibleError
from planner.schema.costs import BlockCost, OptimizerSpec

ADAMW = OptimizerSpec()
LAYOUT = Layout("interleaved-1f1b", 2, 4, 2)  # 2 ranks x 2 stages, 4 microbatches


def _embedding_and_layers() -> list[BlockCost]:
    """A heavy embedding (many parameters, no activations) and six equal layers."""
    return [block("embed", 1, 1, 40_000, layer=False, act_mb=0)] + [
        block(f"layers.{i}", 10, 20, 1000, act_mb=4) for i in range(6)
    ]


def test_a_rank_fits_where_the_per_stage_share_does_not() -> None:
    blocks = _embedding_and_layers()
    # the limit: what rank 0 needs with the embedding alone in stage 0, nothing recomputed
    starts = [0, 1, 3, 5]
    _, given_split = predict(blocks, Split(starts=tuple(starts)), LINK, LAYOUT, ADAMW)
    limit = given_split.max_memory_bytes
    # the embedding's stage alone is over half of it: the share hides every split
    share = Constraints(ADAMW, limit // 2, "never")
    with pytest.raises(InfeasibleError, match="too small"):
        solve(blocks, LINK, LAYOUT, share)
    choice = evaluate_choice(blocks, Cluster(2, LINK), LAYOUT, Constraints(ADAMW, limit, "never"))
    assert choice.fits
    assert choice.prediction.max_memory_bytes <= limit
    assert choice.prediction.step_time_s <= given_split.step_time_s


def test_a_rank_over_the_limit_recomputes_on_its_own_stages() -> None:
    blocks = _embedding_and_layers()
    _, plain = predict(blocks, Split(starts=(0, 1, 3, 5)), LINK, LAYOUT, ADAMW)
    _, recomputed = predict(
        blocks, Split(starts=(0, 1, 3, 5), recompute=("never", "full", "full", "full")), LINK, LAYOUT, ADAMW
    )
    # between the two: only recomputing layers fits, and the share (half) fits no stage holding the embedding
    limit = (plain.max_memory_bytes + recomputed.max_memory_bytes) // 2
    assert recomputed.max_memory_bytes <= limit < plain.max_memory_bytes
    _, pred = rank_split(blocks, LINK, LAYOUT, Constraints(ADAMW, limit, "auto"), None)
    assert pred.max_memory_bytes <= limit
    assert any(r != "never" for r in pred.recompute)
    assert pred.step_time_s <= recomputed.step_time_s
    # the prediction is the split's own: redoing it gives the same figures
    _, again = predict(blocks, Split.of(pred), LINK, LAYOUT, ADAMW)
    assert again == pred


def test_one_stage_per_rank_is_the_solver_under_the_limit() -> None:
    blocks = _embedding_and_layers()
    layout = Layout("1f1b", 2, 4)
    limit = 10**9
    stages, pred = rank_split(blocks, LINK, layout, Constraints(ADAMW, limit, "auto"), None)
    split = solve(blocks, LINK, layout, Constraints(ADAMW, limit, "auto"))
    assert pred.starts == tuple(split.starts)


raw_blocks = st.lists(
    st.tuples(st.integers(1, 9), st.integers(1, 9), st.integers(0, 5), st.integers(0, 4), st.integers(1, 3)),
    min_size=5,
    max_size=6,
)


@settings(max_examples=20, deadline=None)
@given(raw=raw_blocks, heavy=st.booleans(), m=st.sampled_from([2, 4]), pick=st.floats(0.0, 1.0))
def test_never_worse_than_the_share_and_always_verified(raw: list, heavy: bool, m: int, pick: float) -> None:
    """Against brute force over every split and per-stage mode (never, full, stage), which picks the
    limit: the split chosen fits by its own prediction, is at least as fast as the share's split
    where that fits, and no faster than the fastest split recomputing nothing (recomputation only
    adds to a stage's time, so no split with any modes beats it).
    """
    blocks = [
        block(f"b{i}", f, b, p * 1000 * (8 if heavy and i == 0 else 1), act_mb=a, cut_mb=c)
        for i, (f, b, p, a, c) in enumerate(raw)
    ]
    layout = Layout("interleaved-1f1b", 2, m, 2)
    in_flight = in_flight_per_stage("interleaved-1f1b", 2, m, 2)
    runs = []
    for cuts in itertools.combinations(range(1, len(blocks)), 3):
        for modes in itertools.product(["never", "full", "stage"], repeat=4):
            _, pr = predict(blocks, Split(starts=(0, *cuts), recompute=modes), LINK, layout, ADAMW)
            runs.append((pr.step_time_s, pr.max_memory_bytes, set(modes) == {"never"}))
    needs = sorted(mem for _, mem, _ in runs)
    limit = needs[int(pick * (len(needs) - 1))]
    fastest = min(s for s, _, plain in runs if plain)
    constraints = Constraints(ADAMW, limit, "auto")
    try:  # the per-stage share alone, as the search had it
        split = solve(blocks, LINK, layout, Constraints(ADAMW, limit // 2, "auto"), in_flight)
        _, share = predict(blocks, split, LINK, layout, ADAMW)
    except InfeasibleError:
        share = None
    try:
        _, pred = rank_split(blocks, LINK, layout, constraints, None)
    except InfeasibleError:
        assert share is None
        return
    if pred.max_memory_bytes > limit:
        assert share is None or share.max_memory_bytes > limit
        return
    _, again = predict(blocks, Split.of(pred), LINK, layout, ADAMW)
    assert again.max_memory_bytes <= limit
    assert pred.step_time_s >= fastest * (1 - 1e-9)
    if share is not None:
        assert pred.step_time_s <= share.step_time_s * (1 + 1e-9)
