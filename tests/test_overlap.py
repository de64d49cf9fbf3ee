"""Tier 1 (pure): overlap as FSDP2 and DDP run it (``planner.core.levers.overlap``): hand-computed
timelines, the properties every timeline keeps, and the prediction's use of them on GPU links.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from plan_factory import MB, block

from planner.core.assemble import Origin, assemble_plan
from planner.core.layout.inputs import asked_of
from planner.core.levers.data_parallel import (
    block_fsdp_s,
    block_fsdp_stages,
    ddp_follows,
    ddp_stage_overlap,
    dp_group_links,
)
from planner.core.levers.hardware import get_hardware, node_links
from planner.core.levers.overlap import (
    COMPUTE_SLOWDOWN,
    DDP_BUCKET_BYTES,
    DDP_FIRST_BUCKET_BYTES,
    NONE,
    Overlap,
    bucketed,
    buckets,
    charged_s,
    fsdp_unit_pass,
    prefetched,
    spread,
)
from planner.core.step.simulate import StageTimes, Traffic, simulate_step, simulate_traffic
from planner.report.tables import stage_table
from planner.schema.costs import LinkCost
from planner.schema.plan import ModelRef, Plan, ProfileInfo
from planner.schema.request import PlanRequest

QUARTER = MB // 4  # fp32 parameters of one MiB
REF = ModelRef(path="m.py", size=None, config={}, file_digest="0" * 16, fingerprint="f" * 16, trace_method="fx", seed=0)
GPU = ProfileInfo(device="cuda", backend="nccl", threads=1, torch_version="2.13.0", hostname="t", warmup=0, repeats=0)
CPU = GPU.model_copy(update={"device": "cpu", "backend": "gloo", "cores": 8})
H100 = get_hardware("h100")

times = st.lists(st.floats(min_value=0.0, max_value=10.0, allow_nan=False), min_size=1, max_size=8)


# ------------------------------------------------------------------------------------------------
# FSDP2's prefetch one unit ahead, by hand
# ------------------------------------------------------------------------------------------------


def test_a_gather_hides_only_behind_the_unit_before_it() -> None:
    # 3 units, gathers 1, 2, 3 and compute 1.5, 1, 4: the first gather waits whole (1), the second
    # outlasts unit 0's compute by 0.5, the third unit 1's by 2: 3.5 exposed of 6
    got = prefetched([1.0, 2.0, 3.0], [1.5, 1.0, 4.0])
    assert got == Overlap(6.0, 3.5)
    assert got.hidden_s == 2.5
    # the rank's whole compute (6.5 s) would have "hidden" all but the first gather: 1 exposed


def test_without_reductions_exposed_is_the_first_gather_plus_each_excess() -> None:
    rng = random.Random(0)
    for _ in range(500):
        n = rng.randint(1, 7)
        g = [rng.choice([0.0, rng.uniform(0, 3)]) for _ in range(n)]
        c = [rng.choice([0.0, rng.uniform(0, 3)]) for _ in range(n)]
        want = g[0] + sum(max(0.0, g[i + 1] - c[i]) for i in range(n - 1))
        assert prefetched(g, c).exposed_s == pytest.approx(want, abs=1e-12)


def test_the_last_reduce_scatter_is_exposed_and_the_rest_hide() -> None:
    # backward over 3 units: gathers 1, compute 2, reduce-scatters 1 each. Stream: g0 [0, 1];
    # g1 [1, 2]; r0 [3, 4]; g2 [4, 5]; r1 [5, 6]; r2 [7, 8]; compute [1, 3], [3, 5], [5, 7]: the
    # end is 8, 2 s past the 6 s of compute (the first gather and the last reduce-scatter)
    assert prefetched([1.0, 1.0, 1.0], [2.0, 2.0, 2.0], [1.0, 1.0, 1.0]) == Overlap(6.0, 2.0)


def test_a_gather_queues_behind_the_reduce_scatter_issued_before_it() -> None:
    # gathers 1, 0.5, 2; compute 1 each; unit 0 reduce-scatters for 2 s. g0 [0, 1]; g1 [1, 1.5];
    # r0 issued at 2 runs [2, 4]; g2, issued when unit 1 starts (2), waits for it: [4, 6]; unit 2
    # computes [6, 7]: 4 s exposed (2 if the gather could pass the reduce-scatter)
    assert prefetched([1.0, 0.5, 2.0], [1.0, 1.0, 1.0], [2.0, 0.0, 0.0]) == Overlap(5.5, 4.0)


def test_a_microbatch_is_a_forward_then_a_backward_in_reverse() -> None:
    gathers, fwd, bwd, reduces = [1.0, 2.0, 3.0], [1.5, 1.0, 4.0], [3.0, 2.0, 8.0], [0.5, 0.5, 0.5]
    both = fsdp_unit_pass(gathers, fwd, bwd, reduces)
    ahead = prefetched(gathers, fwd)
    back = prefetched([3.0, 2.0, 1.0], [8.0, 2.0, 3.0], [0.5, 0.5, 0.5])
    assert both == Overlap(ahead.traffic_s + back.traffic_s, ahead.exposed_s + back.exposed_s)
    # backward: g2 [0, 3]; g1 [3, 5]; r2 [11, 11.5]; g0 [11.5, 12.5]; r1 [13, 13.5]; r0 [16, 16.5]:
    # compute [3, 11], [11, 13], [13, 16]: 0.5 past the 13 s
    assert back == Overlap(7.5, 3.5)


def test_degenerate_timelines() -> None:
    assert prefetched([], []) == NONE
    assert prefetched([2.0], [5.0], [1.0]) == Overlap(3.0, 3.0)  # one unit: nothing to hide behind
    assert prefetched([1.0, 1.0], [0.0, 0.0], [1.0, 1.0]) == Overlap(4.0, 4.0)  # no compute
    assert prefetched([0.0, 0.0], [1.0, 1.0]) == NONE  # nothing gathered (one replica)
    with pytest.raises(ValueError):
        prefetched([1.0], [1.0, 2.0])


@settings(max_examples=300, deadline=None)
@given(times, st.data())
def test_exposed_lies_between_the_first_gather_and_the_traffic(compute: list[float], data: st.DataObject) -> None:
    n = len(compute)
    g = data.draw(st.lists(st.floats(min_value=0.0, max_value=10.0), min_size=n, max_size=n))
    r = data.draw(st.lists(st.floats(min_value=0.0, max_value=10.0), min_size=n, max_size=n))
    got = prefetched(g, compute, r)
    assert got.exposed_s >= g[0] - 1e-9
    assert got.exposed_s <= got.traffic_s + 1e-9
    assert got.exposed_s >= r[-1] - 1e-9  # the last unit's reduction follows all of the compute


@settings(max_examples=300, deadline=None)
@given(times, st.data(), st.floats(min_value=0.05, max_value=1.0))
def test_faster_links_never_expose_more(compute: list[float], data: st.DataObject, k: float) -> None:
    n = len(compute)
    g = data.draw(st.lists(st.floats(min_value=0.0, max_value=10.0), min_size=n, max_size=n))
    r = data.draw(st.lists(st.floats(min_value=0.0, max_value=10.0), min_size=n, max_size=n))
    slow = prefetched(g, compute, r)
    fast = prefetched([k * x for x in g], compute, [k * x for x in r])
    assert fast.exposed_s <= slow.exposed_s + 1e-9


def test_the_slowdown_is_charged_on_what_hides() -> None:
    assert charged_s(Overlap(10.0, 3.0), COMPUTE_SLOWDOWN) == pytest.approx(3.0 + 0.189 * 7.0, rel=1e-15)
    assert charged_s(Overlap(10.0, 3.0), 0.0) == 3.0
    assert COMPUTE_SLOWDOWN == 0.189  # Lee et al. 2025 (arXiv 2507.03114): the mean they measured


def test_spread_keeps_the_total() -> None:
    assert spread(6.0, [1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert spread(12.0, [1.0, 2.0, 3.0]) == [2.0, 4.0, 6.0]
    assert spread(3.0, [0.0, 0.0, 0.0]) == [1.0, 1.0, 1.0]
    assert spread(3.0, []) == []


# ------------------------------------------------------------------------------------------------
# DDP's buckets
# ------------------------------------------------------------------------------------------------


def test_buckets_are_one_mib_then_twenty_five() -> None:
    assert (DDP_FIRST_BUCKET_BYTES, DDP_BUCKET_BYTES) == (MB, 25 * MB)
    got = buckets([0.5 * MB, 30 * MB, 1 * MB])
    assert got == [(1 * MB, 1), (25 * MB, 1), (5.5 * MB, 2)]
    assert buckets([]) == []
    assert buckets([0.0, 0.0]) == []


def test_the_last_bucket_waits_and_the_others_hide() -> None:
    # two 1 MiB gradients, 2 s of backward each, 0.5 s an all-reduce of a MiB: the first bucket
    # runs [2, 2.5] beside the second's backward, the last [4, 4.5] after it: 0.5 exposed of 1
    got = bucketed([MB, MB], [2.0, 2.0], lambda n: 0.5 * n / MB)
    assert got == Overlap(1.0, 0.5)
    # a slow link: the first all-reduce [2, 5] outlasts the backward, the second queues [5, 8]
    assert bucketed([MB, MB], [2.0, 2.0], lambda n: 3.0 * n / MB) == Overlap(6.0, 4.0)


@settings(max_examples=200, deadline=None)
@given(times, st.data())
def test_bucketed_exposes_at_least_the_last_bucket(compute: list[float], data: st.DataObject) -> None:
    n = len(compute)
    grads = data.draw(st.lists(st.floats(min_value=0.0, max_value=60.0 * MB), min_size=n, max_size=n))

    def cost(nbytes: float) -> float:
        return 1e-4 + nbytes / (10 * MB)

    got = bucketed(grads, compute, cost)
    made = buckets(grads)
    assert got.traffic_s == pytest.approx(sum(cost(b) for b, _ in made), rel=1e-12)
    assert got.exposed_s <= got.traffic_s + 1e-9
    if made:
        assert got.exposed_s >= cost(made[-1][0]) - 1e-9
    assert sum(b for b, _ in made) == pytest.approx(sum(grads), rel=1e-12)


def test_ddp_reduces_itself_only_where_the_runner_lets_it() -> None:
    assert ddp_follows("1f1b", 1, 1)
    assert not ddp_follows("zbv", 1, 1)  # weight gradients past DDP's hooks
    assert not ddp_follows("1f1b", 2, 1)  # DTensor parameters
    assert not ddp_follows("1f1b", 1, 2)  # several passes: averaged once, after the last


# ------------------------------------------------------------------------------------------------
# The levers and the prediction
# ------------------------------------------------------------------------------------------------


def _gpu_plan(blocks: list, *, gpus: int, profile: ProfileInfo = GPU, **request: object) -> Plan:
    req = PlanRequest.build(model_file="m.py", gpus=gpus, **request)
    profile = profile.model_copy(
        update={"microbatch_size": req.microbatch_size, "min_microbatch_size": req.microbatch_size}
    )
    link = node_links(H100, gpus, 8)
    return assemble_plan(asked_of(req, None), blocks, link, Origin(REF, profile, "2026-12-03T00:00:00+00:00"))


def test_one_replica_has_nothing_to_overlap() -> None:
    blocks = [block(f"layers.{i}", 10, 20, QUARTER) for i in range(4)]
    stages = _gpu_plan(blocks, gpus=2).stages
    link = LinkCost(name="l", latency_s=0.0, bandwidth_Bps=1e9)
    assert block_fsdp_stages(blocks, stages, [link] * 2, 1) == [NONE] * len(stages)
    assert ddp_stage_overlap(blocks, stages, [link] * 2, 1) == [NONE] * len(stages)


def test_block_units_on_a_gpu_hide_a_gather_only_behind_the_unit_before() -> None:
    # 8 layers of 1 MiB, FSDP block by block over 4 H100s of one node: the step charges each rank m x
    # (exposed + COMPUTE_SLOWDOWN x hidden) of its stages' unit timelines, no longer the rank's whole compute
    blocks = [block(f"layers.{i}", 1, 2, QUARTER) for i in range(8)]
    plan = _gpu_plan(blocks, gpus=4, dp=4, dp_mode="fsdp", fsdp_units="block", batch_size=4, microbatches=1)
    assert (plan.fsdp_units, plan.n_ranks, plan.dp) == ("block", 1, 4)
    links = dp_group_links(node_links(H100, 4, 8), 1, 4)
    per = block_fsdp_stages(plan.blocks, plan.stages, links, 4)
    want = plan.n_microbatches * charged_s(per[0], COMPUTE_SLOWDOWN)
    assert plan.prediction.dp_reduce_s == pytest.approx(want, rel=1e-12)
    # the old charge (first gathers wait, the rest behind the whole rank's compute) was less
    assert plan.prediction.dp_reduce_s > block_fsdp_s(plan.blocks, plan.stages, links, 4, plan.n_microbatches)[0]
    stage = plan.stages[0]
    assert stage.comm_hidden_s == pytest.approx(plan.n_microbatches * per[0].hidden_s, rel=1e-12)
    assert stage.comm_exposed_s == pytest.approx(plan.n_microbatches * per[0].exposed_s, rel=1e-12)


def test_every_stage_reports_its_communication_and_cpu_hides_none() -> None:
    blocks = [block(f"layers.{i}", 10, 20, QUARTER) for i in range(4)]
    kw: dict[str, object] = dict(gpus=4, dp=2, dp_mode="ddp", batch_size=16, microbatches=2, schedule="1f1b")
    gpu = _gpu_plan(blocks, **kw)
    cpu = _gpu_plan(blocks, profile=CPU, **kw)
    for plan in (gpu, cpu):
        for s in plan.stages:
            assert s.comm_hidden_s is not None and s.comm_exposed_s is not None
            assert s.comm_exposed_s >= plan.n_microbatches * s.comm_s - 1e-15  # the pipeline's messages
    assert all(s.comm_hidden_s == 0.0 for s in cpu.stages)
    assert any(s.comm_hidden_s > 0.0 for s in gpu.stages)  # DDP's first buckets, behind the backward
    # what a stage reports hidden and exposed is all of its collectives: DDP's buckets of its gradients
    links = dp_group_links(node_links(H100, 4, 8), 2, 2)
    for s, one in zip(gpu.stages, ddp_stage_overlap(gpu.blocks, gpu.stages, links, 2)):
        assert s.comm_hidden_s + s.comm_exposed_s == pytest.approx(
            one.traffic_s + gpu.n_microbatches * s.comm_s, rel=1e-12
        )


def test_the_stage_table_shows_hidden_and_exposed_per_step() -> None:
    blocks = [block(f"layers.{i}", 10, 20, QUARTER) for i in range(4)]
    plan = _gpu_plan(blocks, gpus=4, dp=2, dp_mode="ddp", batch_size=16, microbatches=2, schedule="1f1b")
    text = stage_table(plan)
    assert "hidden ms/step" in text and "exposed ms/step" in text
    first = text.splitlines()[2].split()
    s = plan.stages[0]
    assert first[-2:] == [f"{s.comm_hidden_s * 1e3:.2f}", f"{s.comm_exposed_s * 1e3:.2f}"]
    # a plan written before the fields: no such columns
    old = plan.model_copy(
        update={"stages": [x.model_copy(update={"comm_hidden_s": None, "comm_exposed_s": None}) for x in plan.stages]}
    )
    assert "hidden ms/step" not in stage_table(old)
    assert Plan.from_json(old.to_json()).stages[0].comm_hidden_s is None


def test_the_simulator_says_how_long_each_stage_waited_for_its_gather() -> None:
    # two stages on two ranks, GPipe, 2 microbatches of F = 1, B = 2: rank 0 waits its whole 0.5 s
    # gather; rank 1's gather (also 0.5 s from the start) is done long before its first forward (at 1)
    stages = [StageTimes(1.0, 2.0), StageTimes(1.0, 2.0)]
    traffic = Traffic(gather=[0.5, 0.5], reduce=[1.0, 1.0])
    makespan, waits = simulate_traffic(stages, "gpipe", 2, 1, traffic)
    assert waits == [0.5, 0.0]
    assert makespan == simulate_step(stages, "gpipe", 2, traffic=traffic)[0]
    # rank 0: F 0.5-1.5, 1.5-2.5; rank 1: F 1.5-2.5, 2.5-3.5, B 3.5-5.5, 5.5-7.5, its reduce-scatter
    # to 8.5; rank 0: B 5.5-7.5, 7.5-9.5 (each after rank 1's), its reduce-scatter to 10.5
    assert makespan == 10.5
