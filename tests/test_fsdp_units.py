"""Tier 1 (pure): FSDP block by block (``--fsdp-units block``): its memory and traffic by hand, the
solver's fit against the scalar model, the search's choice between stage and block units, the plan
field and the torchtitan export.
"""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from plan_factory import MB, block, memory_layout

from planner.core.assemble import Origin, assemble_plan
from planner.core.layout.inputs import Layout, asked_of
from planner.core.levers.data_parallel import block_fsdp_s
from planner.core.levers.recompute import checkpoint_units
from planner.core.split.cuts import Split
from planner.core.split.solve import _MemoryModel
from planner.core.split.stage_model import MemoryParts, stage_memory_bytes, stage_memory_parts
from planner.core.split.stage_plans import rank_memory_bytes
from planner.core.step.predict import predict
from planner.core.step.schedules import in_flight_per_stage, rank_orders, stage_ranks
from planner.errors import InfeasibleError, PlanFileError
from planner.report.export import export_plan
from planner.report.tables import layout_line
from planner.schema.costs import BlockCost, LinkCost, OptimizerSpec
from planner.schema.plan import ModelRef, Plan, ProfileInfo
from planner.schema.request import PlanRequest

ADAMW = OptimizerSpec()
QUARTER = MB // 4  # fp32 parameters of one MiB
LINK = LinkCost(name="l", latency_s=1e-3, bandwidth_Bps=MB * 1000.0)  # 1 ms + 1 MiB per ms
REF = ModelRef(path="m.py", size=None, config={}, file_digest="0" * 16, fingerprint="f" * 16, trace_method="fx", seed=0)
CPU = ProfileInfo(device="cpu", backend="gloo", threads=1, torch_version="2.13.0", hostname="t", warmup=0, repeats=0)
GPU = ProfileInfo(device="cuda", backend="nccl", threads=1, torch_version="2.13.0", hostname="t", warmup=0, repeats=0)


def _layers(n: int = 4, params: int = QUARTER, fwd_ms: float = 10, bwd_ms: float = 20) -> list[BlockCost]:
    return [block(f"layers.{i}", fwd_ms, bwd_ms, params) for i in range(n)]


def _plan(blocks: list[BlockCost], *, limit: int | None = None, profile: ProfileInfo = CPU, **request: object) -> Plan:
    """A plan from hand-made costs, profiled at the request's own microbatch size."""
    req = PlanRequest.build(model_file="m.py", **request)
    profile = profile.model_copy(
        update={"microbatch_size": req.microbatch_size, "min_microbatch_size": req.microbatch_size}
    )
    return assemble_plan(asked_of(req, limit), blocks, LINK, Origin(REF, profile, "2026-11-26T00:00:00+00:00"))


def _blockwise(blocks: list[BlockCost], start: int, end: int, in_flight: int, *, shard: int) -> int:
    """A stage's peak under FSDP block by block, one microbatch per step."""
    return stage_memory_parts(blocks, start, end, ADAMW, "never", 1, shard, per_block=True).peak(in_flight)


# ------------------------------------------------------------------------------------------------
# Memory and traffic, exact
# ------------------------------------------------------------------------------------------------


def test_block_units_hold_three_units_unsharded_instead_of_the_stage_twice() -> None:
    blocks = _layers()  # 4 x 1 MiB of fp32 parameters, 1 MiB of activations each, one stage
    # static: (2 x 4 MiB weights and grads + 8 MiB AdamW moments) / 4 = 4 MiB; 1 live microbatch's
    # 4 MiB of activations; unsharded: the unit computing, the next one and the unit's gradients,
    # 3 x 1 MiB; the step's 8 MiB of AdamW temporaries / 4 = 2 MiB (below the rest)
    assert _blockwise(blocks, 0, 4, 1, shard=4) == (4 + 4 + 3) * MB
    # per stage: the whole stage's parameters and gradients unsharded, 2 x 4 MiB
    assert stage_memory_bytes(blocks, 0, 4, 1, ADAMW, n_microbatches=1, shard=4) == (4 + 4 + 8) * MB
    # a block whose end is no legal cut shares its unit with the next one: the largest unit is 2 MiB
    joined = [blocks[0].model_copy(update={"cut_legal": False}), *blocks[1:]]
    assert checkpoint_units(joined, 0, 4) == [(0, 2), (2, 3), (3, 4)]
    assert _blockwise(joined, 0, 4, 1, shard=4) == (4 + 4 + 6) * MB
    # without replicas there is nothing to shard: per_block changes nothing
    assert _blockwise(blocks, 0, 4, 1, shard=1) == stage_memory_bytes(blocks, 0, 4, 1, ADAMW)


def test_gradients_freed_between_steps_come_with_one_microbatch_fewer() -> None:
    blocks = _layers()  # 4 x 1 MiB of fp32 parameters, 1 MiB of activations each, one stage
    # FSDP over 4 block by block, 2 microbatches: fixed 4 MiB (the share of weights, gradients and
    # moments), 4 MiB per live microbatch, 3 x 1 MiB unsharded; the gradients: a 1 MiB share + the unit's 1 MiB
    parts = stage_memory_parts(blocks, 0, 4, ADAMW, "never", 2, 4, per_block=True)
    assert parts.grads == 2 * MB
    assert parts.peak(2) == (4 + 2 * 4 + 3) * MB  # kept (several passes a step): both live, with them
    # freed between steps, both live (GPipe): before the first backward without the gradients, after
    # it one microbatch fewer with them: max(2 x 4, 4 + 2) on top of 4 - 2 + 3
    assert parts.peak(2, fresh_grads=True) == (4 - 2 + 2 * 4 + 3) * MB
    # fewer live than microbatches (1F1B after its warm-up): a backward came first, the gradients are there
    assert parts.peak(1, fresh_grads=True) == parts.peak(1) == (4 + 4 + 3) * MB
    # one replica, 3 microbatches: weights + gradients 8 MiB, moments 8 MiB; the gradients (4 MiB) only
    # with 2 live: max(3 x 4, 2 x 4 + 4, the step's 8 MiB of temporaries + 4) on top of 16 - 4
    one = stage_memory_parts(blocks, 0, 4, ADAMW, "never", 3)
    assert one.grads == 4 * MB
    assert one.peak(3) == (16 + 3 * 4) * MB
    assert one.peak(3, fresh_grads=True) == (16 - 4 + 12) * MB


def test_a_stage_units_gradient_share_comes_after_its_last_backward() -> None:
    blocks = _layers()  # 4 x 1 MiB of fp32 parameters, 1 MiB of activations each, one stage
    # FSDP over 4, the stage one unit, 2 microbatches: fixed (4 + 4 + 8) / 4 = 4 MiB, 4 MiB a live
    # microbatch, the unsharded 4 MiB weights + 4 MiB gradient sums; the gradients: the 1 MiB share
    # (made by the reduce-scatter after the last backward) + the 4 MiB unsharded sums
    parts = stage_memory_parts(blocks, 0, 4, ADAMW, "never", 2, 4)
    assert (parts.fixed, parts.per_microbatch, parts.once, parts.grads, parts.reduced) == (
        4 * MB,
        4 * MB,
        8 * MB,
        5 * MB,
        MB,
    )
    # kept between steps: everything at once, 4 + 2 x 4 + 8
    assert parts.peak(2) == 20 * MB
    # GPipe, gradients new every step: 2 live without any gradient (4 - 5 + 8 + 8 = 15), then 1 live
    # with the unsharded sums but not the share (4 - 5 + 4 + 8 + 4 = 15), then the reduce-scatter:
    # no activation, the sums and the share (4 - 5 + 8 + 5 = 12)
    assert parts.peak(2, fresh_grads=True) == 15 * MB
    # 1F1B with one live: the sums are there after the first backward, the share is not: 4 - 1 + 4 + 8
    assert parts.peak(1, fresh_grads=True) == 15 * MB == parts.peak(1) - MB
    # block by block the share is made during the backward, unit by unit: counted from the first
    assert stage_memory_parts(blocks, 0, 4, ADAMW, "never", 2, 4, per_block=True).reduced == 0
    # a bf16 stage (2-byte parameters): the share is of the fp32 gradient sums, 4 N / 4
    narrow = [b.model_copy(update={"param_bytes": b.param_bytes // 2}) for b in blocks]
    assert stage_memory_parts(narrow, 0, 4, ADAMW, "never", 2, 4).reduced == MB


@settings(max_examples=300, deadline=None)
@given(
    schedule=st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zbv"]),
    p=st.integers(1, 4),
    m=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
def test_the_ranks_order_counts_the_share_as_the_closed_form(schedule: str, p: int, m: int, seed: int) -> None:
    # the peak read off each rank's action order (each stage's gradients from its first backward, its
    # share from its last) is MemoryParts.peak's closed form with one stage per rank (GPipe, 1F1B),
    # and at most the sum of the stages' peaks with several
    v = 1 if schedule in ("gpipe", "1f1b") else 2
    try:
        orders = rank_orders(schedule, p, m, v)
        in_flight = in_flight_per_stage(schedule, p, m, v)
    except InfeasibleError:
        return
    ranks = stage_ranks(schedule, p, v)
    rng = random.Random(seed)
    parts = []
    for _ in range(p * v):
        grads = rng.randint(0, 100)
        parts.append(
            MemoryParts(
                fixed=grads + rng.randint(0, 200),
                per_microbatch=rng.randint(0, 100),
                once=rng.randint(0, 100),
                step=rng.randint(0, 300),
                grads=grads,
                microbatches=m,
                reduced=rng.randint(0, grads),
            )
        )
    # what rank_memory_bytes reads of a stage when given its parts
    stages = [SimpleNamespace(index=k, rank=ranks[k], in_flight=in_flight[k]) for k in range(p * v)]
    layout = Layout(schedule, p, m, v, dp=2, dp_mode="fsdp")
    assert layout.fresh_grads
    for rank in range(p):
        got = rank_memory_bytes([], stages, orders[rank], rank, ADAMW, layout, parts)  # type: ignore[arg-type]
        closed = sum(parts[k].peak(in_flight[k], fresh_grads=True) for k in range(p * v) if ranks[k] == rank)
        assert got == closed if v == 1 else got <= closed, (schedule, p, m, rank)


def test_a_rank_holds_one_backward_transients_at_a_time() -> None:
    """Two stages on a rank (interleaved 1F1B, 2 ranks, 2 stages each), nothing kept per microbatch:
    the rank holds both stages' weights and their unsharded copies, but only one backward's output
    gradient, rebuilt region and temporaries at a time (``MemoryParts.transient``), the larger."""
    parts = [
        MemoryParts(fixed=10, per_microbatch=0, once=70, step=0, microbatches=2, transient=50),
        MemoryParts(fixed=1, per_microbatch=0, once=1, step=0, microbatches=2, transient=1),
        MemoryParts(fixed=20, per_microbatch=0, once=40, step=0, microbatches=2, transient=30),
        MemoryParts(fixed=1, per_microbatch=0, once=1, step=0, microbatches=2, transient=1),
    ]
    ranks, in_flight = stage_ranks("interleaved-1f1b", 2, 2), in_flight_per_stage("interleaved-1f1b", 2, 2, 2)
    stages = [SimpleNamespace(index=k, rank=ranks[k], in_flight=in_flight[k]) for k in range(4)]
    layout = Layout("interleaved-1f1b", 2, 2, 2)
    order = rank_orders("interleaved-1f1b", 2, 2, 2)[0]
    # weights 10 + 20, what stays of once 20 + 10, one backward's 50 (the sum would be 140)
    assert rank_memory_bytes([], stages, order, 0, ADAMW, layout, parts) == 110  # type: ignore[arg-type]


def test_block_traffic_is_hidden_behind_compute_except_the_first_gathers() -> None:
    blocks = _layers()
    layout = Layout("gpipe", 1, 2, 1, dp=4, dp_mode="fsdp", fsdp_units="block")
    stages, pred = predict(blocks, Split(starts=(0,)), LINK, layout, ADAMW)
    # one ring of a 1 MiB unit among 4 replicas: 3 steps of 1 ms + 3/4 MiB at 1 MiB/ms = 3.75 ms; per
    # microbatch 4 units x 3 rings = 45 ms, below the stage's 120 ms of compute: only the first
    # gather of each forward and of each backward waits, 2 x 3.75 ms per microbatch
    assert pred.dp_reduce_s == pytest.approx(2 * 2 * 3.75e-3, rel=1e-12)
    assert block_fsdp_s(blocks, stages, [LINK], 4, 2, overlap=False) == pytest.approx([2 * 12 * 3.75e-3], rel=1e-12)
    # compute too short to hide it: 0.2 ms per block, 1.6 ms per step; the rest of 90 ms shows
    quick = _layers(fwd_ms=0.1, bwd_ms=0.1)
    stages, pred = predict(quick, Split(starts=(0,)), LINK, layout, ADAMW)
    assert pred.dp_reduce_s == pytest.approx(15e-3 + (90e-3 - 15e-3 - 1.6e-3), rel=1e-9)
    # per stage: one gather and one reduce-scatter of the 4 MiB stage per pass, 2 x (3 + 3) ms
    _, whole = predict(blocks, Split(starts=(0,)), LINK, Layout("gpipe", 1, 2, 1, dp=4, dp_mode="fsdp"), ADAMW)
    assert whole.dp_reduce_s == pytest.approx(12e-3, rel=1e-12)


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(0, 400), st.integers(0, 300), st.booleans()), min_size=1, max_size=8),
    shard=st.integers(2, 5),
    t=st.integers(0, 6),
    m=st.integers(1, 6),
    mode=st.sampled_from(["never", "selective", "full", "stage"]),
    fresh=st.booleans(),
)
def test_the_solvers_memory_model_is_the_stage_formula(
    sizes: list[tuple[int, int, bool]], shard: int, t: int, m: int, mode: str, fresh: bool
) -> None:
    # the solver's O(1) sums (largest unit by range maxima) against stage_memory_bytes, every stage
    blocks = [
        BlockCost(
            name=f"b{i}",
            first_node=f"b{i}a",
            last_node=f"b{i}b",
            fwd_s=0.0,
            bwd_s=0.0,
            params=p // 4,
            param_bytes=p,
            activation_bytes=a,
            cut_bytes=7,
            cut_tensors=1,
            cut_legal=legal,
            output_bytes=5,
            is_layer=True,
        )
        for i, (p, a, legal) in enumerate(sizes)
    ]
    n = len(blocks)
    layout = memory_layout(m, shard, per_block=True, fresh=fresh)
    mem = _MemoryModel(blocks, ADAMW, float("inf"), mode, layout)
    heads = [0] + [c for c in range(1, n) if blocks[c - 1].cut_legal]
    for s in heads:
        for e in [x for x in heads if x > s] + [n]:
            want = stage_memory_parts(blocks, s, e, ADAMW, mode, m, shard, True).peak(t, fresh)
            assert mem.bytes(s, e, t, mode) == want, (s, e)


# ------------------------------------------------------------------------------------------------
# The search
# ------------------------------------------------------------------------------------------------


def test_auto_takes_block_units_where_a_stage_gathered_whole_does_not_fit() -> None:
    # 8 layers of 64 MiB of parameters over 4 replicas: the sharded state is 512 MiB a rank; gathered
    # whole the stage adds 1 GiB, block by block 192 MiB
    blocks = _layers(8, 16 * MB)
    kw = dict(gpus=4, dp=4, dp_mode="fsdp", batch_size=4, microbatches=1)
    plan = _plan(blocks, limit=2**30, **kw)
    assert (plan.dp_mode, plan.fsdp_units) == ("fsdp", "block")
    assert plan.prediction.max_memory_bytes <= 2**30
    assert plan.stages[0].memory_bytes == _blockwise(plan.blocks, 0, 8, 1, shard=4)
    assert "fsdp per block" in plan.choice
    assert "FSDP block by block" in layout_line(plan)
    with pytest.raises(InfeasibleError, match=r"needs 1\.\d+ GiB"):
        _plan(blocks, limit=2**30, fsdp_units="stage", **kw)
    # no limit, ranks sharing CPU cores (no overlap): gathering every microbatch is slower, the stage wins
    roomy = _plan(blocks, **kw)
    assert roomy.fsdp_units == "stage"
    forced = _plan(blocks, fsdp_units="block", **kw)
    assert forced.fsdp_units == "block" and forced.prediction.step_time_s > roomy.prediction.step_time_s
    # DDP, or one replica, never records block units
    assert _plan(blocks, gpus=4, dp=4, dp_mode="ddp", batch_size=4, microbatches=1).fsdp_units == "stage"


def test_on_gpus_block_units_win_when_their_traffic_hides() -> None:
    # a GPU profile (no shared cores): with compute long enough to hide the per-microbatch gathers,
    # block units wait only for the first gathers, less than the stage's gather and reduce-scatter
    blocks = _layers(8, QUARTER, fwd_ms=100, bwd_ms=200)
    plan = _plan(blocks, profile=GPU, gpus=4, dp=4, dp_mode="fsdp", batch_size=4, microbatches=1)
    assert plan.fsdp_units == "block"


# ------------------------------------------------------------------------------------------------
# The plan file and the export
# ------------------------------------------------------------------------------------------------


def test_block_units_need_fsdp_and_old_plans_read_as_stage_units() -> None:
    plan = _plan(_layers(), gpus=4, dp=4, dp_mode="fsdp", fsdp_units="block", batch_size=4, microbatches=1)
    raw = json.loads(plan.model_dump_json())
    assert raw["fsdp_units"] == "block"
    assert Plan.from_json(json.dumps(raw)) == plan
    with pytest.raises(PlanFileError, match="fsdp_units is block under ddp"):
        Plan.from_json(json.dumps({**raw, "dp_mode": "ddp"}))
    del raw["fsdp_units"]
    assert Plan.from_json(json.dumps(raw)).fsdp_units == "stage"  # plans before the field ran so


def test_torchtitan_export_reshards_after_forward_for_block_units() -> None:
    kw = dict(gpus=4, dp=4, dp_mode="fsdp", batch_size=4, microbatches=1)
    block_plan = _plan(_layers(), fsdp_units="block", **kw)
    stage_plan = _plan(_layers(), fsdp_units="stage", **kw)
    assert 'fsdp_reshard_after_forward = "always"' in export_plan(block_plan, "torchtitan-toml")
    assert 'fsdp_reshard_after_forward = "never"' in export_plan(stage_plan, "torchtitan-toml")
    text = export_plan(block_plan, "torchtitan")
    assert 'fsdp_reshard_after_forward="always"' in text and "sharded block by block" in text
    pytest.importorskip("torchtitan")
    namespace: dict = {}
    exec(text, namespace)  # torchtitan's own ParallelismConfig takes the field
    assert namespace["parallelism"].fsdp_reshard_after_forward == "always"
