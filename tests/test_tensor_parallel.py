"""Tensor parallelism in the pure core: one tp rank's costs (exact), the degrees a model allows, the
search over (tp, pp, dp, m) against brute force, and the report's lines for a 3-D plan."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from plan_factory import ADAMW, LINK, MB, block

from planner.core.assemble import Origin, assemble_plan
from planner.core.layout.inputs import Cluster, Constraints, Layout, Scaling, SearchSpace, asked_of
from planner.core.layout.search import (
    TIE,
    _max_stages_per_rank,
    evaluate_modes,
    replica_microbatches,
    search,
)
from planner.core.levers.microbatch import blocks_at
from planner.core.levers.tensor_parallel import allowed_degrees, allreduce_s, at_degree, block_degree_limit
from planner.core.split.stage_model import stage_memory_parts, stage_time_parts
from planner.core.step.schedules import SCHEDULES, stages_per_rank_options
from planner.errors import InfeasibleError
from planner.report.tables import layout_line, render, search_table
from planner.schema.costs import BlockCost, LinkCost
from planner.schema.plan import ModelRef, ProfileInfo
from planner.schema.request import PlanRequest
from planner.schema.shares import TensorParallelShare

TP_PLAN = {"layers.*.w1": "colwise", "layers.*.w2": "rowwise"}


def share(
    params: int, *, compute: float = 0.9, act: int = MB // 2, reduce_bytes: int = MB, divisor: int = 64
) -> TensorParallelShare:
    """A layer whose matrices hold ``params`` (fp32) of its parameters and ``compute`` of its work."""
    return TensorParallelShare(
        sharded_params=params,
        sharded_param_bytes=4 * params,
        sharded_compute=compute,
        sharded_activation_bytes=act,
        fwd_allreduce_bytes=reduce_bytes,
        bwd_allreduce_bytes=reduce_bytes,
        fwd_allreduces=1,
        bwd_allreduces=1,
        divisor=divisor,
    )


def layer(name: str, fwd_ms: float, bwd_ms: float, params: int, **kw: object) -> BlockCost:
    return block(name, fwd_ms, bwd_ms, params).model_copy(update={"tp": share(params * 4 // 5, **kw)})  # type: ignore[arg-type]


def test_allreduce_is_a_ring_with_log_latency() -> None:
    link = LinkCost(name="nvlink", latency_s=1e-5, bandwidth_Bps=1e9)
    # 2 all-reduces of 8 MB in all over 4 ranks: 2 x log2(4) latencies, 2 (4-1)/4 of the bytes each way
    assert allreduce_s(8e6, 2, 4, link) == pytest.approx(2 * 2 * 1e-5 + 1.5 * 8e6 / 1e9, rel=1e-12)
    assert allreduce_s(8e6, 2, 1, link) == 0.0
    assert allreduce_s(8e6, 0, 8, link) == 0.0
    # 3 ranks: ceil(log2 3) = 2 latencies
    assert allreduce_s(0.0, 1, 3, link) == pytest.approx(2e-5, rel=1e-12)


def test_a_split_never_takes_a_block_below_its_hosts_dispatch() -> None:
    # 10 ms forward of which the host spends 8 ms issuing operators (an estimate for a GPU), 20 ms backward
    # with 6 ms: at t = 2 the work halves to 5.5 / 11 ms, but each rank issues as many operators
    b = layer("layers.0", 10, 20, 1000, compute=0.9).model_copy(
        update={
            "host_fwd_s": 0.008,
            "host_bwd_s": 0.006,
            "bwd_input_s": 0.012,
            "bwd_weight_s": 0.008,
            "recompute_s": 0.005,
        }
    )
    (one,) = at_degree([b], 2, LINK)
    compute = 0.1 + 0.9 / 2
    assert one.fwd_s == pytest.approx(0.008 + 0.001, rel=1e-12)  # the host's 8 ms, then the all-reduce
    assert one.bwd_s == pytest.approx(0.020 * compute + 0.001, rel=1e-12)  # 11 ms of work: above its 6
    assert one.bwd_input_s == pytest.approx(0.012 * compute + 0.001, rel=1e-12)  # 6.6 ms over its 3.6
    assert one.recompute_s == pytest.approx(0.004 + 0.5 * 0.001, rel=1e-12)  # half the forward: half its host
    (host,) = at_degree([b.model_copy(update={"host_bwd_s": 0.018})], 2, LINK)
    assert host.bwd_input_s == pytest.approx(0.018 * 0.6 + 0.001, rel=1e-12)  # its share of the host's time
    assert host.bwd_weight_s == pytest.approx(0.018 * 0.4, rel=1e-12)


def test_a_gathered_heads_logits_are_all_gathered_in_forward_only() -> None:
    # a colwise_rep head: 2 MB of logits gathered over 4 ranks, (4-1)/4 x 2 MB = 1.5 ms on LINK, in
    # forward only (its backward slices the gradient); its input gradient all-reduced as a colwise one's
    head = block("output", 10, 20, 1000).model_copy(
        update={
            "tp": share(1000, compute=1.0, reduce_bytes=MB, divisor=0).model_copy(
                update={"fwd_allreduce_bytes": 0, "fwd_allreduces": 0, "fwd_allgather_bytes": 2 * MB}
            )
        }
    )
    (one,) = at_degree([head], 4, LINK)
    assert one.fwd_s == pytest.approx(0.010 / 4 + 0.0015, rel=1e-12)
    assert one.bwd_s == pytest.approx(0.020 / 4 + 1.5 * 0.001, rel=1e-12)  # 2 (4-1)/4 x 1 MB
    assert allowed_degrees([head], [1, 2, 3, 4, 8]) == [1, 2, 3, 4, 8]  # divisor 0: any degree
    assert block_degree_limit([head, layer("layers.0", 1, 1, 100, divisor=8)]) == 8


def test_loss_parallelism_leaves_the_heads_logits_split_and_divides_its_loss() -> None:
    # the last block: a colwise_rep head with 2 MB of logits over 1,024 rows and the loss (4 of its 10 ms
    # forward, saving 1 MB of its 3 MB, 4 MB of backward temporaries); half its work split
    head = block("output", 10, 20, 1000, act_mb=3).model_copy(
        update={
            "output_bytes": 2 * MB,
            "loss_s": 0.004,
            "loss_bytes": MB,
            "loss_temp_bytes": 4 * MB,
            "tp": share(1000, compute=0.5, reduce_bytes=MB, divisor=0).model_copy(
                update={
                    "fwd_allreduce_bytes": 0,
                    "fwd_allreduces": 0,
                    "fwd_allgather_bytes": 2 * MB,
                    "head_allgather_bytes": 2 * MB,
                    "head_rows": 1024,
                }
            ),
        }
    )
    compute = 0.5 + 0.5 / 4
    (gathered,) = at_degree([head], 4, LINK)
    # the loss whole on every rank (the logits gathered), its backward as long; the 2 MB gathered: 1.5 ms
    whole = 0.004 * (1 - compute)
    assert gathered.fwd_s == pytest.approx(0.010 * compute + whole + 0.0015, rel=1e-12)
    assert gathered.bwd_s == pytest.approx(0.020 * compute + whole + 0.0015, rel=1e-12)
    assert (gathered.output_bytes, gathered.loss_bytes, gathered.loss_temp_bytes) == (2 * MB, MB, 4 * MB)
    (split,) = at_degree([head], 4, LINK, loss=True)
    # no gather; three all-reduces of one fp32 value a row (max, sum of exponentials, target logit);
    # the loss's 4 ms at 1/4, in forward and as long again in backward
    reduces = allreduce_s(3 * 4 * 1024, 3, 4, LINK)
    assert reduces == pytest.approx(1.5 * 12 * 1024 / MB * 1e-3, rel=1e-12)
    quarter = 0.004 * (0.25 - compute)
    assert split.fwd_s == pytest.approx(0.010 * compute + quarter + reduces, rel=1e-12)
    assert split.bwd_s == pytest.approx(0.020 * compute + quarter + 0.0015, rel=1e-12)  # its input's all-reduce
    assert split.loss_s == pytest.approx(0.001, rel=1e-12)
    assert (split.output_bytes, split.loss_bytes, split.loss_temp_bytes) == (MB // 2, MB // 4, MB)
    # the split activations (half a MB at 1/4) and 3/4 of the loss's MB less
    assert gathered.activation_bytes - split.activation_bytes == MB - MB // 4
    assert split.activation_bytes == 3 * MB - MB // 2 + MB // 8 - (MB - MB // 4)
    # a head whose block does not make the model's output (no output bytes) stays gathered
    (inner,) = at_degree([head.model_copy(update={"output_bytes": 0})], 4, LINK, loss=True)
    assert inner.fwd_s == pytest.approx(gathered.fwd_s, rel=1e-12) and inner.loss_bytes == MB


def test_at_degree_splits_compute_memory_and_adds_the_all_reduces() -> None:
    b = layer("layers.0", 10, 20, 1000, compute=0.9).model_copy(
        update={"bwd_input_s": 0.012, "bwd_weight_s": 0.008, "recompute_s": 0.010, "opt_s": 0.004, "grad_s": 0.002}
    )
    (one,) = at_degree([b], 2, LINK)
    # LINK: no latency, 1 MB per ms; each all-reduce moves 2 (2-1)/2 x 1 MB = 1 MB: 1 ms
    compute = 0.1 + 0.9 / 2
    assert one.fwd_s == pytest.approx(0.010 * compute + 0.001, rel=1e-12)
    assert one.bwd_s == pytest.approx(0.020 * compute + 0.001, rel=1e-12)
    assert one.bwd_input_s == pytest.approx(0.012 * compute + 0.001, rel=1e-12)  # the input gradient's all-reduce
    assert one.bwd_weight_s == pytest.approx(0.008 * compute, rel=1e-12)
    assert one.recompute_s == pytest.approx(0.010 * compute + 0.001, rel=1e-12)  # the forward runs again
    # a recomputation that stops early (at the block's last saved tensor) re-runs its share of the all-reduces
    (early,) = at_degree([b.model_copy(update={"recompute_s": 0.004})], 2, LINK)
    assert early.recompute_s == pytest.approx(0.004 * compute + 0.4 * 0.001, rel=1e-12)
    assert (one.params, one.param_bytes) == (200 + 400, 800 + 1600)
    assert one.activation_bytes == MB // 2 + MB // 4
    assert one.opt_s == pytest.approx(0.004 * 0.6, rel=1e-12) and one.grad_s == pytest.approx(0.002 * 0.6, rel=1e-12)
    assert (one.flops_fwd, one.cut_bytes) == (b.flops_fwd, b.cut_bytes)  # the model's work and its cut stay whole
    # the boundary after it is scattered: each rank sends half of its 1 MB and all-gathers the other
    # half, (2-1)/2 x 1 MB = 0.5 ms on LINK
    assert (one.cut_share, one.sent_bytes) == (2, MB // 2)
    assert one.cut_gather_s == pytest.approx(0.0005, rel=1e-12)
    whole = block("norm", 1, 1, 10, cut_mb=3)
    assert at_degree([whole, b], 1, LINK)[1] is b
    (held,) = at_degree([whole], 8, LINK)  # a block without a share is held whole; only its message is scattered
    assert held.model_dump(exclude={"cut_share", "cut_gather_s"}) == whole.model_dump(
        exclude={"cut_share", "cut_gather_s"}
    )
    # eight ranks: 3 MB / 8 each; the ring gathers 7/8 of 3 MB (2.625 ms) after 3 latencies (none on LINK)
    assert (held.cut_share, held.sent_bytes) == (8, 3 * MB // 8)
    assert held.cut_gather_s == pytest.approx(0.002625, rel=1e-12)
    assert (whole.cut_share, whole.sent_bytes, whole.cut_gather_s) == (1, 3 * MB, 0.0)


def test_scattered_boundaries_shrink_messages_and_buffers_but_not_the_kept_input() -> None:
    """A stage's messages carry one rank's piece plus half of each all-gather (charged half each
    way); its receive buffers and kept output are pieces; a stage recomputed as one region keeps
    the whole gathered input."""
    blocks = [
        layer(f"layers.{i}", 10, 20, 1000, compute=0.9).model_copy(update={"cut_bytes": 4 * MB}) for i in range(3)
    ]
    four = at_degree(blocks, 4, LINK)
    # each way: 1 MB in and 1 MB out at 1 MB/ms, plus half of two gathers of 3/4 x 4 MB (3 ms each)
    assert stage_time_parts(four, 1, 2, LINK)[2] == pytest.approx(0.001 + 0.001 + 0.0015 + 0.0015, rel=1e-12)
    assert stage_time_parts(four, 1, 2, LINK, wait_in=False, wait_out=False)[2] == 0.0  # inside one rank
    m = 5
    whole = stage_memory_parts(blocks, 1, 2, ADAMW, "stage", n_microbatches=m)
    split = stage_memory_parts(four, 1, 2, ADAMW, "stage", n_microbatches=m)
    static = lambda b: 2 * b.param_bytes + ADAMW.state_bytes(b.params, b.param_bytes)  # noqa: E731
    assert whole.fixed - static(blocks[1]) == m * 8 * MB  # a 4 MB buffer each way per microbatch
    assert split.fixed - static(four[1]) == m * 2 * MB  # one rank's 1 MB piece each way
    assert split.per_microbatch - whole.per_microbatch == -3 * MB  # the kept output is the piece
    kept = stage_memory_parts(four, 1, 2, ADAMW, "stage")
    assert kept.per_microbatch == 4 * MB + MB  # the whole gathered input and the output's piece


def test_slowdown_stretches_the_split_part_only() -> None:
    b = layer("layers.0", 10, 20, 1000, compute=0.9)
    assert b.tp is not None
    slow = b.model_copy(update={"tp": b.tp.model_copy(update={"slowdown": {2: 1.5, 4: 2.0}})})
    (two,) = at_degree([slow], 2, LINK)
    (eight,) = at_degree([slow], 8, LINK)
    # the split 0.9 takes 1.5 x its 1/2 at degree 2; degree 8 is not listed: degree 4's 2.0 answers
    assert two.fwd_s == 0.010 * (0.1 + 0.9 / 2 * 1.5) + 0.001
    # LINK: no latency, 1 MB per ms; the ring moves 2 (8-1)/8 x 1 MB
    assert eight.fwd_s == pytest.approx(0.010 * (0.1 + 0.9 / 8 * 2.0) + 2 * 7 / 8 * 0.001, rel=1e-12)
    assert two.bwd_s == 0.020 * (0.1 + 0.9 / 2 * 1.5) + 0.001
    assert at_degree([b], 2, LINK)[0].fwd_s == 0.010 * (0.1 + 0.9 / 2) + 0.001  # no slowdown: linear
    assert slow.tp is not None and slow.tp.slowdown_at(1) == 1.0 and slow.tp.slowdown_at(3) == 1.5
    # JSON keys are strings: the degrees come back as ints
    again = BlockCost.model_validate_json(slow.model_dump_json())
    assert again == slow and again.tp is not None and again.tp.slowdown == {2: 1.5, 4: 2.0}
    with pytest.raises(ValueError):
        b.tp.model_validate({**b.tp.model_dump(), "slowdown": {2: 0.0}})


def test_degrees_are_the_node_options_the_split_sizes_allow() -> None:
    blocks = [
        block("embed", 1, 1, 10),
        layer("layers.0", 1, 1, 100, divisor=64),
        layer("layers.1", 1, 1, 100, divisor=24),
    ]
    assert block_degree_limit(blocks) == 8
    assert allowed_degrees(blocks, [1, 2, 4, 8, 16]) == [1, 2, 4, 8]
    assert allowed_degrees(blocks, [1, 3]) == [1]
    assert allowed_degrees([block("a", 1, 1, 1)], [1, 2, 4]) == [1]
    assert block_degree_limit([block("a", 1, 1, 1)]) is None


def _origin() -> Origin:
    ref = ModelRef(
        path="m.py", size=None, config={}, file_digest="0" * 16, fingerprint="f" * 16, trace_method="fx", seed=0
    )
    profile = ProfileInfo(
        device="cpu", backend="gloo", threads=1, torch_version="2.13.0", hostname="t", warmup=0, repeats=0
    )
    return Origin(ref, profile, "2026-11-25T00:00:00+00:00")


def _model() -> list[BlockCost]:
    return (
        [block("embed", 1, 1, 1000, layer=False)]
        + [layer(f"layers.{i}", 40, 80, 50_000) for i in range(4)]
        + [block("output", 2, 4, 1000, layer=False)]
    )


def test_a_forced_degree_gives_a_three_dimensional_plan_and_report() -> None:
    request = PlanRequest.build(model_file="m.py", gpus=8, tp=2, dp=2, batch_size=16, schedule="1f1b")
    plan = assemble_plan(asked_of(request, None), _model(), LINK, _origin(), tp_plan=TP_PLAN)
    assert (plan.tp, plan.dp, plan.n_ranks, plan.world_size) == (2, 2, 2, 8)
    assert plan.tp_plan == TP_PLAN
    assert all(c.tp == 2 for c in plan.search)
    # one tp rank's stages: each layer computes 0.1 + 0.9 / 2 of itself, plus 1 ms per all-reduce of 1 MB,
    # all at the profiled microbatch size and scaled to the chosen one (no fixed share, no latency)
    r = plan.microbatch_size / request.microbatch_size
    assert plan.blocks[1].fwd_s == pytest.approx((0.040 * 0.55 + 0.001) * r, rel=1e-12)
    assert plan.blocks[1].flops_fwd == _model()[1].flops_fwd
    assert layout_line(plan).startswith(
        "layout: 2 replicas x 2 stages x tp 2 (dp x pp x tp) on 8 ranks; replica 0 = ranks 0-3, replica 1 = ranks 4-7; "
        "each pipeline rank split over 2 consecutive ranks of one node by the model's tp plan (1 colwise, 1 rowwise patterns)"
    )
    assert "tp 2" in render(plan)
    header = search_table(plan).splitlines()[0].split()
    assert header[:4] == ["schedule", "tp", "pp", "m"]


def test_tp_auto_keeps_degree_one_for_a_model_without_a_plan_and_refuses_a_forced_one() -> None:
    plain = [b.model_copy(update={"tp": None}) for b in _model()]
    auto = PlanRequest.build(model_file="m.py", gpus=4, batch_size=16)
    plan = assemble_plan(asked_of(auto, None), plain, LINK, _origin())
    assert plan.tp == 1 and plan.tp_plan == {}
    forced = PlanRequest.build(model_file="m.py", gpus=4, tp=2, batch_size=16)
    with pytest.raises(InfeasibleError, match="declares no tensor-parallel plan"):
        assemble_plan(asked_of(forced, None), plain, LINK, _origin())
    with pytest.raises(InfeasibleError, match="does not divide the model's split sizes"):
        odd = [b.model_copy(update={"tp": share(100, divisor=3)}) if b.tp else b for b in _model()]
        assemble_plan(asked_of(forced, None), odd, LINK, _origin(), tp_plan=TP_PLAN)


def test_tensor_parallelism_wins_when_the_pipeline_would_mostly_wait() -> None:
    # 4 ranks, 4 microbatches: pp 4 idles (p-1)/(m+p-1) = 3/7 of its time; tp 2 x pp 2 idles 1/5 and
    # pays 1 ms per all-reduce on 22 ms of work per layer: it must win, and tp 4 (pp 1) too little split work
    request = PlanRequest.build(
        model_file="m.py", gpus=4, batch_size=4, microbatches=4, schedule="1f1b", gpu_type="h100"
    )
    plan = assemble_plan(asked_of(request, None), _model(), LINK, _origin(), tp_plan=TP_PLAN)
    tried = {c.tp for c in plan.search}
    assert plan.tp > 1 and tried >= {plan.tp}
    for candidate in plan.search:
        assert candidate.step_time_s >= plan.prediction.step_time_s * (1 - 1e-9)


# --- the search against brute force over (tp, pp, dp, m) on small problems ---------------------------


@st.composite
def problems(draw: st.DrawFn) -> tuple[list[BlockCost], int, int, int | None]:
    n = draw(st.integers(3, 7))
    blocks: list[BlockCost] = []
    for i in range(n):
        fwd = draw(st.integers(1, 30))
        params = draw(st.integers(0, 4)) * 100_000
        b = block(f"b{i}", fwd, fwd * draw(st.sampled_from([1, 2, 3])), params, act_mb=draw(st.integers(0, 4)))
        if draw(st.booleans()) and params:
            b = b.model_copy(
                update={
                    "tp": share(
                        params * draw(st.sampled_from([1, 2, 4])) // 4,
                        compute=draw(st.sampled_from([0.5, 0.8, 0.95])),
                        act=b.activation_bytes // 2,
                        reduce_bytes=draw(st.integers(0, 4)) * MB // 4,
                        divisor=draw(st.sampled_from([2, 4, 8])),
                    )
                }
            )
        blocks.append(b)
    world = draw(st.sampled_from([2, 4]))
    batch = draw(st.sampled_from([4, 8]))
    limit = draw(st.sampled_from([None, None, 4 * MB, 8 * MB, 16 * MB]))
    return blocks, world, batch, limit


def _brute_force(
    blocks: list[BlockCost], cluster: Cluster, space: SearchSpace, constraints: Constraints
) -> float | None:
    """The least predicted step that fits over every (tp, pp, dp, m, schedule, v), each solved exactly."""
    best: float | None = None
    legal = sum(1 for b in blocks[:-1] if b.cut_legal) + 1
    for tp in allowed_degrees(blocks, space.degrees):
        for dp in space.replicas:
            if cluster.world_size % (tp * dp):
                continue
            pp = cluster.world_size // (tp * dp)
            if pp > legal:
                continue
            for m in replica_microbatches(space.batch_size, dp, None, 1):
                sized = at_degree(blocks_at(blocks, 1, space.batch_size // (dp * m), 0.0), tp, cluster.link)  # type: ignore[arg-type]
                names = ["gpipe", "1f1b"] if pp == 1 else list(SCHEDULES)  # as the search tries one rank
                for name in names:
                    for v in stages_per_rank_options(name, _max_stages_per_rank(blocks, pp)):
                        layout = Layout(name, pp, m, v, dp, "auto", tp)
                        try:
                            choice = evaluate_modes(sized, cluster, layout, constraints)
                        except InfeasibleError:
                            continue
                        if choice.fits and (best is None or choice.prediction.step_time_s < best):
                            best = choice.prediction.step_time_s
    return best


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_search_finds_the_brute_force_optimum_over_tp_pp_dp_and_m(
    problem: tuple[list[BlockCost], int, int, int | None],
) -> None:
    blocks, world, batch, limit = problem
    degrees = tuple(d for d in (1, 2, 4) if world % d == 0)
    replicas = tuple(d for d in (1, 2, 4) if world % d == 0 and batch % d == 0)
    cluster = Cluster(world, LINK, None)
    space = SearchSpace(batch, "auto", None, None, replicas, "auto", degrees)
    constraints = Constraints(ADAMW, limit, "auto")
    best = _brute_force(blocks, cluster, space, constraints)
    open_space = replace(space, degrees=tuple(allowed_degrees(blocks, degrees)))
    try:
        chosen, _, _ = search(blocks, cluster, open_space, constraints, Scaling(1, 0.0, 1))
    except InfeasibleError as e:
        assert best is None, f"the search found nothing ({e}) where brute force fits {best}"
        assert limit is not None and "closest" in str(e) or "alone needs" in str(e) or "more than" in str(e)
        return
    assert best is not None and chosen.fits
    # refine may improve on the exact split of the best layout, never lose to it
    assert chosen.prediction.step_time_s <= best * (1 + TIE) + 1e-12
    if limit is not None:
        assert chosen.prediction.max_memory_bytes <= limit
    assert math.isfinite(chosen.prediction.step_time_s)


def test_tp_auto_is_searched_for_gpu_estimates_and_given_for_measured_plans() -> None:
    # estimated for GPUs: the divisors of a node's ranks that divide --gpus; measured here: 1 unless given
    assert PlanRequest.build(model_file="m.py", gpus=16, gpu_type="h100").tp_options == [1, 2, 4, 8]
    assert PlanRequest.build(model_file="m.py", gpus=12, gpu_type="h100", gpus_per_node=8).tp_options == [1, 2, 4]
    assert PlanRequest.build(model_file="m.py", gpus=4).tp_options == [1]
    assert PlanRequest.build(model_file="m.py", gpus=4, tp=2).tp_options == [2]


def test_sequence_parallelism_splits_the_sequence_bytes_and_swaps_all_reduces_for_rings() -> None:
    from planner.schema.shares import SequenceShare

    seq = SequenceShare(
        activation_bytes=MB,  # of the 2 MB saved whole (norms' inputs)
        compute=0.05,
        gather_bytes=2 * MB,  # two distinct column-wise inputs, sequence shards
        gathers=2,
        regather_bytes=MB,  # one layer keeps its input as the shard and gathers it again in backward
        regathers=1,
        param_grad_bytes=MB // 4,  # the norms' weights, all-reduced
        param_grads=2,
        cut_share=1.0,
    )
    tp_share = share(800, compute=0.9, act=MB, reduce_bytes=MB).model_copy(
        update={"unsplit_activation_bytes": 2 * MB, "sequence": seq}
    )
    b = block("l", 10, 20, 1000, act_mb=4).model_copy(update={"tp": tp_share})
    (plain,) = at_degree([b], 4, LINK)
    (split,) = at_degree([b], 4, LINK, sequence=True)
    # without: 0.1 of the work whole, one all-reduce of 1 MB each way (2 x 3/4 ms); 4 - 1 + 1/4 MB saved
    assert plain.fwd_s == pytest.approx(10e-3 * (0.1 + 0.9 / 4) + 1.5e-3, rel=1e-12)
    assert plain.activation_bytes == 4 * MB - MB + MB // 4
    assert plain.cut_gather_s == pytest.approx(0.75e-3, rel=1e-12)
    # with: the sequence part's work on 1/4 too; forward: the row-wise output reduce-scattered and the
    # two inputs gathered, 3/4 of 3 MB; backward: the same rings, the kept shard gathered again (3/4 of
    # 1 MB) and the norms' 1/4 MB all-reduced
    compute = 0.05 + 0.9 / 4 + 0.05 / 4
    assert split.fwd_s == pytest.approx(10e-3 * compute + 2.25e-3, rel=1e-12)
    assert split.bwd_s == pytest.approx(20e-3 * compute + 2.25e-3 + 0.75e-3 + 2 * 0.75 * 0.25e-3, rel=1e-12)
    # the 1 MB saved of sequence shards split 4 ways besides the split layers' 1 MB
    assert split.activation_bytes == 4 * MB - MB + MB // 4 - MB + MB // 4
    # the boundary's sequence shards gathered before they leave and on arrival: one more all-gather
    assert split.cut_gather_s == pytest.approx(1.5e-3, rel=1e-12)
    # and a checkpoint region starting after it keeps the shards of its input: 1/4 of the 1 MB
    assert (plain.kept_cut_bytes, split.kept_cut_bytes) == (MB, MB // 4)
    # a two-part backward (zero-bubble): the input pass holds the rings and the re-gather, the weight pass
    # gathers again (it unpacks the same saved input) and all-reduces the norms' gradients; the kept
    # 1 MB of column-wise inputs is whole again (3/4 MB more) while a weight gradient runs
    parts = {"bwd_input_s": 12e-3, "bwd_weight_s": 8e-3, "bwd_temp_bytes": MB}
    kept = seq.model_copy(update={"column_bytes": MB})
    zb = b.model_copy(update={**parts, "tp": tp_share.model_copy(update={"sequence": kept})})
    (zb_split,) = at_degree([zb], 4, LINK, sequence=True)
    assert zb_split.bwd_input_s == pytest.approx(12e-3 * compute + 2.25e-3 + 0.75e-3, rel=1e-12)
    assert zb_split.bwd_weight_s == pytest.approx(8e-3 * compute + 0.75e-3 + 0.375e-3, rel=1e-12)
    assert zb_split.bwd_temp_bytes == math.ceil(MB * (2.5 / 4)) + MB - MB // 4
    # a block without a sequence share is unchanged by the flag
    bare = b.model_copy(update={"tp": share(800, compute=0.9, act=MB, reduce_bytes=MB)})
    assert at_degree([bare], 4, LINK, sequence=True) == at_degree([bare], 4, LINK)
