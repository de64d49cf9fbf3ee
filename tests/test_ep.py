"""Expert parallelism in planning: what the runner refuses (``ep_refusal``), one expert-parallel rank's
block costs (``planner.core.levers.experts.at_degree``), the request's checks, and ``planner plan
--ep`` end to end (CPU, meta device)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from planner.core.levers.experts import all_to_all_s, at_degree, ep_refusal, group_link
from planner.core.levers.hardware import get_hardware, link_cost
from planner.core.levers.links import NodeLinks
from planner.core.levers.microbatch import blocks_at
from planner.errors import PlannerError
from planner.schema.costs import BlockCost, LinkCost, OptimizerSpec
from planner.schema.request import MOE_IMBALANCE, PlanRequest
from planner.schema.shares import ExpertShare

ROOT = Path(__file__).resolve().parent.parent
LINK = LinkCost(name="test", latency_s=1e-3, bandwidth_Bps=1e9)
EXPERTS = {"layers.0.experts": 8, "layers.1.experts": 8}


def _block(share: ExpertShare | None) -> BlockCost:
    return BlockCost(
        name="layers.0",
        first_node="a",
        last_node="b",
        fwd_s=0.01,
        bwd_s=0.02,
        bwd_input_s=0.012,
        bwd_weight_s=0.008,
        params=1_000,
        param_bytes=4_000,
        activation_bytes=10_000,
        cut_bytes=100,
        cut_tensors=1,
        cut_legal=True,
        is_layer=True,
        opt_s=0.004,
        grad_s=0.002,
        experts=share,
    )


@pytest.mark.parametrize(
    ("ep", "experts", "kw", "want"),
    [
        (1, {}, {}, None),
        (2, EXPERTS, {}, None),
        (2, {}, {}, "--ep 2: the model has no experts to shard"),
        (3, EXPERTS, {"dp": 6}, "--ep 3 does not divide the 8 experts of layers.0.experts"),
        (4, EXPERTS, {"dp": 2}, "--ep 4 does not divide the 2 data-parallel replicas"),
        (2, EXPERTS, {"tp": 2}, None),
        (2, EXPERTS, {"tp": 2, "dp": 1}, None),  # one replica's two tensor-parallel ranks
        (4, EXPERTS, {"tp": 2, "dp": 1}, "--ep 4 covers 2 replica(s) (2 x 2 tensor-parallel ranks), which do not"),
        (2, EXPERTS, {"tp": 4}, "--ep 2 is no multiple of --tp 4: an expert-parallel group spans the"),
        (8, EXPERTS, {"tp": 2, "dp": 2}, "--ep 8 covers 4 replica(s) (4 x 2 tensor-parallel ranks), which do not"),
        (4, EXPERTS, {"tp": 2, "dp": 6, "dp_mode": "hsdp", "dp_shard": 3}, "--ep 4 covers 2 replicas, which do not"),
        (2, EXPERTS, {"tp": 2, "sequence": True}, "does not run with sequence parallelism yet; give --no-sequence"),
        (2, EXPERTS, {"dp_mode": "fsdp"}, None),
        (2, EXPERTS, {"dp_mode": "hsdp", "dp_shard": 2}, None),
        (2, EXPERTS, {"dp": 6, "dp_mode": "hsdp", "dp_shard": 3}, "--ep 2 does not divide the 3 replicas of each HSDP"),
    ],
)
def test_what_expert_parallelism_does_not_run_is_one_line(ep: int, experts: dict, kw: dict, want: str | None) -> None:
    args = {"dp": 4, "tp": 1, "dp_mode": "ddp", **kw}
    got = ep_refusal(ep, experts, **args)
    assert (got is None) if want is None else (got is not None and want in got and "\n" not in got), got


def test_one_expert_parallel_ranks_block_exactly() -> None:
    # 2 layers, 800 of the block's 1,000 parameters experts, 2 MB of rows routed per microbatch
    share = ExpertShare(layers=2, experts=8, params=800, param_bytes=3_200, dispatch_bytes=2_000_000)
    (got,) = at_degree([_block(share)], 4, LINK, 4)
    # per layer: 1 MB, 3/4 of it to the 3 others, 3 latencies; dispatch + combine, both ways
    a2a = 3 * 1e-3 + 0.75 * 1_000_000 / 1e9
    assert all_to_all_s(1_000_000, 4, 4, LINK) == pytest.approx(a2a)
    assert got.params == 200 + 200 and got.param_bytes == 800 + 800
    assert got.fsdp_sharded() == (1_000, 4_000)  # FSDP shards the experts over dp / 4: every expert's 1 / dp
    assert got.fwd_s == pytest.approx(0.01 + 4 * a2a) and got.bwd_s == pytest.approx(0.02 + 4 * a2a)
    assert got.bwd_input_s == pytest.approx(0.012 + 4 * a2a) and got.bwd_weight_s == 0.008
    assert got.opt_s == pytest.approx(0.004 * 1_600 / 4_000) and got.grad_s == pytest.approx(0.002 * 0.4)
    assert got.activation_bytes == 10_000  # an even spread: as many rows received as routed
    assert got.bwd_temp_bytes == 2 * 1_000_000  # a layer's send and receive buffers, one layer at a time
    dense = _block(None)
    assert at_degree([dense], 4, LINK, 4) == [dense] and at_degree([_block(share)], 1, LINK, 1) == [_block(share)]


def test_the_experts_are_gathered_and_reduced_over_the_replicas_holding_the_same_ones() -> None:
    from planner.core.levers.data_parallel import rank_reduce_s, stage_traffic
    from planner.core.levers.experts import by_group, held_experts
    from planner.schema.plan import StagePlan

    share = ExpertShare(layers=2, experts=8, params=800, param_bytes=3_200, dispatch_bytes=2_000_000)
    (got,) = at_degree([_block(share)], 4, LINK, 4)
    # the rank holds 200 dense + 200 expert parameters (800 + 800 B): its experts go over dp / 4
    assert held_experts(got) == (200, 800, 4) and held_experts(_block(share)) == (0, 0, 1)
    assert by_group([got]) == (800, 800, 4) and by_group([_block(share)]) == (4_000, 0, 1)
    assert by_group([got], wide=True) == (800, 800, 4)  # fp32 already: the gradients are as wide
    stage = StagePlan(
        index=0, rank=0, start=0, end=1, first_block="b", last_block="b", split_node=None, params=400,
        fwd_s=0.0, bwd_s=0.0, comm_s=0.0, time_s=0.0, opt_s=0.0, recompute=False, activation_bytes=0,
        in_flight=1, memory_bytes=0,
    )  # fmt: skip

    def ring(nbytes: int, group: int) -> float:  # alpha-beta, as _ring_s
        return (group - 1) * 1e-3 + (group - 1) / group * nbytes / 1e9

    def allreduce(nbytes: int, group: int) -> float:  # a tree's latencies, a ring's bytes
        return 2 * math.ceil(math.log2(group)) * 1e-3 + 2 * (group - 1) / group * nbytes / 1e9

    gathers, reduces = stage_traffic([got], [stage], [LINK], 8)
    assert gathers == [pytest.approx(ring(800, 8) + ring(800, 2))]
    assert reduces == [pytest.approx(ring(800, 8) + ring(800, 2))]
    (fsdp,) = rank_reduce_s([got], [stage], [LINK], 8, "fsdp")
    assert fsdp == pytest.approx(2 * (ring(800, 8) + ring(800, 2)))
    (ddp,) = rank_reduce_s([got], [stage], [LINK], 8, "ddp")
    assert ddp == pytest.approx(allreduce(800, 8) + allreduce(800, 2))
    # every replica its own expert group (dp = ep): the experts are reduced by no one
    (alone,) = rank_reduce_s([got], [stage], [LINK], 4, "ddp")
    assert alone == pytest.approx(allreduce(800, 4))


def test_under_hsdp_the_experts_reduce_inside_their_shard_group_then_over_the_groups() -> None:
    from planner.core.levers.data_parallel import stage_traffic
    from planner.core.levers.hsdp import rank_hsdp_s
    from planner.schema.plan import StagePlan

    share = ExpertShare(layers=2, experts=8, params=800, param_bytes=3_200, dispatch_bytes=2_000_000)
    (got,) = at_degree([_block(share)], 2, LINK, 2)  # a rank holds 200 dense and 400 expert parameters, 4 B each
    stage = StagePlan(
        index=0, rank=0, start=0, end=1, first_block="b", last_block="b", split_node=None, params=500,
        fwd_s=0.0, bwd_s=0.0, comm_s=0.0, time_s=0.0, opt_s=0.0, recompute=False, activation_bytes=0,
        in_flight=1, memory_bytes=0,
    )  # fmt: skip

    def ring(nbytes: float, group: int) -> float:
        return (group - 1) * 1e-3 + (group - 1) / group * nbytes / 1e9 if group > 1 else 0.0

    def allreduce(nbytes: float, group: int) -> float:
        return 2 * math.ceil(math.log2(group)) * 1e-3 + 2 * (group - 1) / group * nbytes / 1e9

    # dp 16 in 4 groups of 4: the dense 800 B over the 4 of a group then 200 B over the groups; the
    # rank's 1,600 B of experts over the 2 replicas of its group holding them, then 800 B over the groups
    (seconds,) = rank_hsdp_s([got], [stage], [LINK], [LINK], 4, 4)
    dense = 2 * ring(800, 4) + allreduce(800 / 4, 4)
    experts = 2 * ring(1_600, 2) + allreduce(1_600 / 2, 4)
    assert seconds == pytest.approx(dense + experts)
    gathers, reduces = stage_traffic([got], [stage], [LINK], 4, [LINK], 4)
    assert gathers == [pytest.approx(ring(800, 4) + ring(1_600, 2))]
    assert reduces == [pytest.approx(ring(800, 4) + ring(1_600, 2) + allreduce(200, 4) + allreduce(800, 4))]


def test_hsdp_with_ep_plans_shard_groups_that_hold_whole_expert_groups(tmp_path: Path) -> None:
    # 16 GPUs, 4 a node, pipeline-outermost: a node holds 4 consecutive replicas, so HSDP's groups are
    # 4 (node-local), each holding 2 expert groups of 2; --ep 4 of --dp-shard 2 is refused
    pytest.importorskip("transformers")
    options = dict(gpu_type="h100", gpus=16, gpus_per_node=4, batch_size=32, dp=16, tp=1)
    plan = _plan(tmp_path, "models/hf/mixtral.py", ep=2, dp_mode="hsdp", **options)
    assert (plan.dp_mode, plan.dp_shard, plan.ep, plan.pp_outer) == ("hsdp", 4, 2, True)
    assert "hsdp in groups of 4" in plan.choice
    with pytest.raises(PlannerError, match=r"--ep 4 covers 4 replicas, which do not divide --dp-shard 2"):
        _plan(tmp_path, "models/hf/mixtral.py", ep=4, dp_mode="hsdp", dp_shard=2, **options)


# Two layers of 8 experts, estimated: the roofline's expert GEMM seconds per degree (the busiest rank's)
SHARE = ExpertShare(
    layers=2,
    experts=8,
    params=800,
    param_bytes=3_200,
    dispatch_bytes=2_000_000,
    token_bytes=1_000_000,  # top 2
    rows=1_000,
    flops_fwd=4e5,
    saved_bytes=3_000,
    gemm_s={1: 0.004, 2: 0.003, 4: 0.0025, 8: 0.002},
    imbalance={2: 1.1, 4: 1.2, 8: 1.3},
)


def test_the_busiest_rank_computes_its_experts_at_their_degree_and_waits_on_the_imbalance() -> None:
    # the busiest rank's GEMM seconds at degree 4, and 1.2 x the rows
    share = SHARE
    (got,) = at_degree([_block(share)], 4, LINK, 4)
    a2a = all_to_all_s(1.2 * 1_000_000, 4, 4, LINK)  # each layer's exchange waits for the busiest rank
    gemm = 0.0025 - 0.004  # its 2 experts on 4x the rows each: faster than 8 experts on few rows
    assert got.fwd_s == pytest.approx(0.01 + 4 * a2a + gemm) and got.bwd_s == pytest.approx(0.02 + 4 * a2a + 2 * gemm)
    assert got.bwd_input_s == pytest.approx(0.012 + 4 * a2a + gemm) and got.bwd_weight_s == pytest.approx(0.008 + gemm)
    assert got.activation_bytes == 10_000 + round(0.2 * 3_000)
    assert got.bwd_temp_bytes == round(2 * 1.2 * 1_000_000)  # one layer's send and receive buffers at a time
    # measured costs (no roofline): the experts' FLOP share of the measured forward grows with the imbalance
    measured = share.model_copy(update={"gemm_s": {}})
    block = _block(measured).model_copy(update={"flops_fwd": 1e6})
    (m,) = at_degree([block], 4, LINK, 4)
    assert m.fwd_s == pytest.approx(0.01 + 4 * a2a + 0.2 * 0.01 * 0.4)
    # a degree the table does not list takes the largest listed below it, at its own imbalance
    sparse = share.model_copy(update={"gemm_s": {1: 0.004, 2: 0.003}})
    (s4,) = at_degree([_block(sparse)], 4, LINK, 4)
    assert s4.fwd_s == pytest.approx(0.01 + 4 * a2a + 0.003 * 1.2 / 1.1 - 0.004)  # at degree 4's imbalance


def test_a_ranks_imbalance_follows_from_the_routers_loads_or_the_busiest_experts() -> None:
    from planner.costs.experts import rank_imbalance, spread_imbalance

    # layer 1: experts 4,0,2,2 rows; layer 2: even. Two ranks: 4 | 4 and 2 | 2; four: the busiest 4 of a mean 2
    loads = [[4, 0, 2, 2], [1, 1, 1, 1]]
    assert rank_imbalance(loads, 1) == 1.0 and rank_imbalance(loads, 2) == 1.0
    assert rank_imbalance(loads, 4) == pytest.approx((4 + 1) / (2 + 1))
    assert rank_imbalance([[0, 0]], 2) == 1.0  # no rows: nothing to wait on
    # the busiest expert's excess over the square root of the experts a rank holds
    assert spread_imbalance(1.52, 256, 64) == pytest.approx(1.26)  # 4 experts a rank: half the excess
    assert spread_imbalance(1.52, 8, 8) == pytest.approx(1.52) and spread_imbalance(1.52, 8, 1) == 1.0


def test_expert_gemms_read_their_weights_once_per_rank() -> None:
    from planner.capture.ep_plan import ExpertLayer
    from planner.costs.experts import expert_gemm_s

    hw = get_hardware("h100")
    peak = hw.peak("bf16")
    bw = hw.memory_Bps * hw.memory_efficiency
    # a DeepSeek-V3-shaped layer: 256 experts of (4096 x 7168) in and (7168 x 2048) out, 32,768 rows (4,096 x top 8)
    layer = ExpertLayer("mlp.experts", 256, 0, 0, ((4096, 7168), (7168, 2048)))
    rows = 4096 * 8

    def expected(ep: int) -> float:
        local, per = 256 // ep, rows * ep // 256
        total = 0.0
        for a, b in layer.matrices:
            compute = 2.0 * rows * a * b / (peak * hw.gemm_efficiency(per, a, b))
            memory = (rows * (a + b) + local * a * b) * 2 / bw
            total += max(compute, memory, hw.op_overhead_s)
        return total

    for ep in (1, 8, 64):
        assert expert_gemm_s(hw, peak, layer, rows, ep, 2) == pytest.approx(expected(ep))
    # unsplit, 128 rows an expert: the weights' bytes bound it; at ep 64 a rank reads 1/64 of them
    assert expected(1) > 2 * expected(64)
    assert (rows * (4096 + 7168 + 7168 + 2048) + 256 * (4096 * 7168 + 7168 * 2048)) * 2 / bw == pytest.approx(
        expected(1)
    )


def test_the_rows_routed_grow_with_the_microbatch() -> None:
    share = ExpertShare(layers=1, experts=8, params=800, param_bytes=3_200, dispatch_bytes=1_000)
    (twice,) = blocks_at([_block(share)], 2, 4, 0.0)
    assert twice.experts is not None and twice.experts.dispatch_bytes == 2_000 and twice.experts.params == 800
    timed = share.model_copy(update={"rows": 10, "flops_fwd": 100.0, "saved_bytes": 30, "gemm_s": {1: 0.5, 2: 0.25}})
    (grown,) = blocks_at([_block(timed)], 2, 4, 0.5)  # times: 0.5 + 0.5 x 2
    assert grown.experts is not None and (grown.experts.rows, grown.experts.saved_bytes) == (20, 60)
    assert grown.experts.flops_fwd == 200.0 and grown.experts.gemm_s == {1: 0.75, 2: 0.375}


def test_a_group_over_the_tensor_parallel_ranks_routes_a_slice_each_and_gathers_the_rest() -> None:
    from planner.core.levers.experts import by_group, held_experts
    from planner.core.levers.tensor_parallel import allgather_s

    share = SHARE
    tp_link = LINK.model_copy(update={"name": "nvlink", "bandwidth_Bps": 4 * LINK.bandwidth_Bps})
    # ep 4 over 2 replicas x 2 tensor-parallel ranks: each rank holds 2 of 8 experts and routes half its
    # replica's tokens, as many rows per expert as ep 2 on half its experts, at ep 4's imbalance
    (got,) = at_degree([_block(share)], 4, LINK, 4, tp=2, tp_link=tp_link)
    a2a = all_to_all_s(1.2 * 1_000_000 / 2, 4, 4, LINK)
    gather = allgather_s(500_000, 2, tp_link)  # one layer's tokens, each way
    gemm = 0.003 * 1.2 / 1.1 / 2 - 0.004
    assert got.fwd_s == pytest.approx(0.01 + 4 * a2a + 2 * gather + gemm)
    assert got.bwd_s == pytest.approx(0.02 + 4 * a2a + 2 * gather + 2 * gemm)
    assert got.bwd_weight_s == pytest.approx(0.008 + gemm)  # the weight gradients exchange nothing
    assert got.activation_bytes == 10_000 + round((1.2 / 2 - 1) * 3_000)  # the slice's rows only
    assert got.bwd_temp_bytes == round(2 * 1.2 * 1_000_000 / 2)
    assert (got.params, got.param_bytes) == (200 + 200, 800 + 800)  # 1/4 of the experts, the rest whole
    # FSDP shards the rest over dp and the experts over dp x 2 (every rank holds its own): of the whole
    assert (got.fsdp_params, got.fsdp_param_bytes) == (200 + 400, 800 + 1_600)
    assert held_experts(got) == (200, 800, 2)  # its experts; their group covers 2 replicas
    assert by_group([got]) == (800, 800, 2)
    # the same degree without tensor parallelism: every token, 4 replicas, no gather
    (alone,) = at_degree([_block(share)], 4, LINK, 4)
    assert held_experts(alone) == (200, 800, 4) and alone.fwd_s > got.fwd_s - 2 * gather
    # what selective checkpointing keeps shrinks by its share of the activations (tensor parallelism split
    # it so), never below nothing: 1,000 of 10,000 keep 1,200 x 0.1 less
    (kept,) = at_degree(
        [_block(share).model_copy(update={"selective_bytes": 1_000})], 4, LINK, 4, tp=2, tp_link=tp_link
    )
    assert kept.selective_bytes == 1_000 - 120
    (few,) = at_degree([_block(share).model_copy(update={"activation_bytes": 900})], 4, LINK, 4, tp=2, tp_link=tp_link)
    assert few.activation_bytes == 0  # saved_bytes larger than the block's: nothing left, not less than nothing
    # measured costs: the experts' FLOP share of the forward at 1.2 / 2 of the rows
    block = _block(share.model_copy(update={"gemm_s": {}})).model_copy(update={"flops_fwd": 1e6})
    (m,) = at_degree([block], 4, LINK, 4, tp=2, tp_link=tp_link)
    assert m.fwd_s == pytest.approx(0.01 + 4 * a2a + 2 * gather + (1.2 / 2 - 1) * 0.01 * 0.4)


def test_an_expert_group_of_consecutive_ranks_crosses_nodes_once_it_outgrows_one() -> None:
    # pipeline-outermost: a group's ranks are consecutive (its replicas' tensor-parallel ranks with them)
    hw = get_hardware("h100")
    intra, inter = link_cost(hw, intra_node=True), link_cost(hw, intra_node=False)
    links = NodeLinks(**intra.model_dump(), inter=inter, gpus_per_node=8, n_ranks=4)
    assert group_link(links, 8)[1] == 8 and group_link(links, 8)[0].name == intra.name  # one node
    assert group_link(links, 4)[1] == 4 and group_link(links, 4)[0].name == intra.name
    assert group_link(links, 16) == (inter, 8)  # two nodes, 8 ranks on each
    assert group_link(links, 64) == (inter, 8)
    assert group_link(LINK, 4) == (LINK, 4)  # one link: every rank on it
    # NCCL's all-to-all: over the cards, slower than inside a node
    assert all_to_all_s(2**26, 8, 2, inter) > all_to_all_s(2**26, 8, 8, intra) > 0


def test_an_all_to_all_across_nodes_sends_from_every_ranks_own_card() -> None:
    # 64 ranks, 8 a node: each sends 56/64 of its rows to other nodes from its own 400 Gb/s card, whatever
    # an H800's NVLink (8 links) holds its ring channels to; 8 a node is no slower than 1 a node
    rows = 32768 * 7168 * 2
    for name in ("h100", "h800"):
        hw = get_hardware(name)
        inter = link_cost(hw, intra_node=False)
        assert inter.nccl is not None and inter.nccl.nic_Bps == 50e9
        eight, one = all_to_all_s(rows, 64, 8, inter), all_to_all_s(rows, 64, 1, inter)
        assert eight == pytest.approx(56 / 64 * rows / 50e9, rel=0.01) and eight < one
        assert one == pytest.approx(63 / 64 * rows / 50e9, rel=0.01)


def test_expert_parallel_layouts_lay_their_ranks_out_pipeline_outermost() -> None:
    from planner.core.layout.inputs import Layout
    from planner.core.levers.data_parallel import dp_group_links, layout_links

    hw = get_hardware("h100")
    intra, inter = link_cost(hw, intra_node=True), link_cost(hw, intra_node=False)
    links = NodeLinks(**intra.model_dump(), inter=inter, gpus_per_node=8, n_ranks=4)
    assert not Layout("1f1b", 4, 8, dp=8).pp_outer and Layout("1f1b", 4, 8, dp=8, ep=8).pp_outer
    # 8 replicas of 4 pipeline ranks on 4 nodes: replicas outermost, a replica fills half a node and its
    # boundaries stay inside; pipeline-outermost, a pipeline rank's 8 replicas fill a node
    outer = layout_links(links, 4, 8, 1, pp_outer=True)
    inner = layout_links(links, 4, 8, 1)
    assert isinstance(outer, NodeLinks) and isinstance(inner, NodeLinks)
    assert [outer.node_of(k, 1) for k in range(8)] == [1] * 8 and [inner.node_of(k, 1) for k in range(8)] == [
        0,
        0,
        1,
        1,
        2,
        2,
        3,
        3,
    ]
    assert not inner.crosses(0, 1) and outer.crosses(0, 1)  # the pipeline's boundaries cross nodes instead
    assert {x.name for x in dp_group_links(outer, 4, 8)} == {intra.name}  # the replicas reduce inside a node
    assert all(x.name != intra.name for x in dp_group_links(inner, 4, 8))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"dp": 1}, r"--ep 2 shards the experts over 2 replicas, but --dp 1 is no multiple of 2; give --dp 2"),
        ({"gpus": 8, "dp": 1, "tp": 2, "ep": 4}, r"over 2 replicas \(x 2 tensor-parallel ranks\), but --dp 1 is no"),
        ({"gpus": 8, "tp": 4}, r"--ep 2 is no multiple of --tp 4: an expert-parallel group spans the tensor-parallel"),
        (
            {"gpus": 8, "dp": 2, "tp": 2, "sequence_parallel": True},
            r"--ep 2: expert parallelism does not run with --sequence-parallel yet; give --no-sequence-parallel",
        ),
        (
            {"gpus": 8, "dp": 8, "dp_mode": "hsdp", "dp_shard": 2, "ep": 4},
            r"--ep 4 covers 4 replicas, which do not divide --dp-shard 2: each",
        ),
        ({"dp": "auto", "gpus": 3}, r"--ep 2 does not divide --gpus 3"),
        ({"dp": "auto", "ep": 4, "batch_size": 2}, r"no replica count tried \(1, 2: those that split the batch of 2"),
    ],
)
def test_the_request_refuses_what_ep_does_not_run_with(options: dict, message: str) -> None:
    values = {"model_file": ROOT / "models" / "hf" / "mixtral.py", "gpus": 4, "ep": 2, **options}
    with pytest.raises(PlannerError, match=message):
        PlanRequest.build(**values)


def _plan(tmp_path: Path, model: str, **options: object):  # type: ignore[no-untyped-def]
    from planner.api import make_plan

    values = {"model_file": ROOT / model, "size": "tiny", "gpus": 4, "batch_size": 8, "output": tmp_path / "p.json"}
    return make_plan(PlanRequest.build(**{**values, "progress": False, **options}))


def test_planner_plan_ep_shards_the_experts_and_searches_what_runs(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    whole = _plan(tmp_path, "models/hf/mixtral.py", gpu_type="h100", dp=2, dp_mode="ddp", tp=1, recompute="never")
    plan = _plan(tmp_path, "models/hf/mixtral.py", gpu_type="h100", dp=2, ep=2)
    assert plan.ep == 2 and plan.dp == 2 and plan.tp == 1 and plan.dp_mode == "ddp"
    assert plan.experts == {f"model.layers.{i}.mlp.experts": 4 for i in range(2)}
    # one rank holds half of each layer's experts, and pays the all-to-alls (its share records the whole layer)
    unsplit = {b.name: b for b in whole.blocks}
    assert sum(b.experts is not None for b in plan.blocks) == 2
    for b in plan.blocks:
        w = unsplit[b.name]
        if b.experts is None:
            assert (b.params, b.fwd_s) == (w.params, w.fwd_s)
            continue
        assert b.params == w.params - b.experts.params // 2 and b.experts.params == 4 * 3 * 64 * 128
        # the busiest rank receives MOE_IMBALANCE x the mean rows (no router runs on meta) and saves as much more;
        # each routed row is saved at each expert GEMM's input and output: gate_up (256 x 64), down (64 x 128), bf16
        share = b.experts
        two = round(1 + (MOE_IMBALANCE - 1) / 2**0.5, 4)  # 2 of the 4 experts on a rank (spread_imbalance)
        assert share.imbalance == {2: two, 4: MOE_IMBALANCE} and set(share.gemm_s) == {1, 2, 4}
        assert share.saved_bytes == share.rows * (256 + 64 + 64 + 128) * 2
        assert share.flops_fwd == 2 * share.rows * (256 * 64 + 64 * 128)
        assert b.activation_bytes == w.activation_bytes + round((two - 1) * share.saved_bytes)
        assert b.fwd_s > w.fwd_s
    assert plan.model.fingerprint != whole.model.fingerprint  # traced with the experts' calls recorded
    from planner.report.tables import experts_line

    line = experts_line(plan)
    assert line.startswith("experts: 2 mixture-of-experts layers of 4 experts (model.layers.0.mlp.experts ... ")
    assert "sharded over 2 consecutive replicas (ep 2)" in line and f"the busiest rank {two:.2f}x the mean rows" in line
    assert experts_line(whole).endswith("every rank holds all the experts of its stages' layers")
    # pipeline-outermost: replicas of a pipeline rank (an expert group) on consecutive ranks
    assert plan.pp_outer and not whole.pp_outer
    for rank in range(plan.world_size):
        assert plan.global_rank(plan.replica_of(rank), plan.pp_rank_of(rank)) == rank
    p, dp = plan.n_ranks, plan.dp
    assert [plan.global_rank(k, 0) for k in range(dp)] == list(range(dp))
    assert [plan.global_rank(0, r) for r in range(p)] == [r * dp for r in range(p)]
    from planner.report.tables import layout_line

    assert p == 2 and "pipeline rank 0's replicas = ranks 0-1, pipeline rank 1's replicas = ranks 2-3" in layout_line(
        plan
    )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0.5, r"^--moe-imbalance 0\.5: Input should be greater than or equal to 1$"),
        (float("inf"), r"^--moe-imbalance inf: Input should be a finite number$"),
    ],
)
def test_a_moe_imbalance_below_one_or_infinite_is_one_line(value: float, message: str) -> None:
    values = {"model_file": ROOT / "models" / "hf" / "mixtral.py", "gpus": 4, "dp": 2, "ep": 2}
    with pytest.raises(PlannerError, match=message):
        PlanRequest.build(**values, moe_imbalance=value)
    assert PlanRequest.build(**values, moe_imbalance=1.5).moe_imbalance == 1.5
    assert PlanRequest.build(**values).moe_imbalance == "auto"


def test_ep_on_a_dense_model_or_an_odd_count_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(PlannerError, match=r"--ep 2: the model has no experts to shard"):
        _plan(tmp_path, "models/llama.py", gpu_type="h100", dp=2, ep=2)
    pytest.importorskip("transformers")
    with pytest.raises(PlannerError, match=r"^--ep 4 does not divide the 6 experts of model\.layers\.0\.mlp\.experts$"):
        _plan(tmp_path, "models/hf/mixtral.py", gpu_type="h100", dp=4, ep=4, overrides={"n_experts": 6})


def test_the_rows_routed_are_read_off_the_trace_or_one_forward_alike() -> None:
    import torch

    from planner.capture.ep_plan import resolve_experts
    from planner.capture.load import load_model_file
    from planner.capture.trace import trace_model
    from planner.costs.experts import ExpertCosting, Routed, routed_rows, traced_rows, with_expert_shares

    pytest.importorskip("transformers")
    mf = load_model_file(ROOT / "models" / "hf" / "mixtral.py", "tiny")
    model = mf.build(seed=0)
    inputs, _ = mf.batch(3, seed=0)
    experts = resolve_experts(mf, model)
    names = list(experts.counts)
    rows = routed_rows(model, inputs, experts.counts)  # real weights: the experts run, the router's choices counted
    for name in names:  # 3 sequences of 32 tokens, top 2, width 64; every row counted at its expert
        assert (rows[name].rows, rows[name].width, rows[name].tokens) == (3 * 32 * 2, 64, 3 * 32)
        assert rows[name].loads is not None and len(rows[name].loads) == 4 and sum(rows[name].loads) == 3 * 32 * 2
    shapes = {
        name: Routed(3 * 32 * 2, 64, tokens=3 * 32) for name in names
    }  # a trace carries the shapes, not the choices
    traced = trace_model(model, inputs, methods=("export",), experts=tuple(names))
    assert traced_rows(traced) == shapes
    assert traced_rows(trace_model(model, inputs, methods=("export",))) == {}  # no calls recorded
    fixture = load_model_file(ROOT / "tests" / "fixtures" / "moe_file.py", "tiny")
    small = fixture.build(seed=0)
    x, _ = fixture.batch(2, seed=0)
    assert routed_rows(small, x, {"layers.0.moe.experts": 4})["layers.0.moe.experts"].rows == 2 * 8 * 2
    with torch.device("meta"):  # on meta the experts never run: the shapes alone
        on_meta = fixture.build(seed=0)
    every = resolve_experts(fixture, on_meta).counts
    meta_rows = routed_rows(on_meta, tuple(t.to("meta") for t in x), every)
    assert len(every) > 1 and meta_rows == {name: Routed(2 * 8 * 2, 16, tokens=2 * 8) for name in every}
    with pytest.raises(PlannerError, match=r"the experts module layers\.0\.norm is not called as experts"):
        routed_rows(small, x, {"layers.0.norm": 4})
    # the shares: the experts' parameters, the rows in the activations' dtype (bf16: 2 bytes), the router's
    # imbalance at each degree (ranks hold consecutive experts)
    block = _block(None).model_copy(update={"name": "model.layers.0", "params": 200_000, "param_bytes": 400_000})
    (shared,) = with_expert_shares([block], experts, rows, ExpertCosting(act_bytes=2))
    loads = rows["model.layers.0.mlp.experts"].loads
    assert loads is not None
    assert (
        shared.experts
        == ExpertShare(
            layers=1,
            experts=4,
            params=98_304,
            param_bytes=196_608,
            dispatch_bytes=3 * 32 * 2 * 64 * 2,
            rows=192,
            token_bytes=3 * 32 * 64 * 2,  # each token once, whatever its top 2
            flops_fwd=2 * 192 * (256 * 64 + 64 * 128),
            saved_bytes=192 * (256 + 64 + 64 + 128) * 2,
            imbalance={2: round(max(sum(loads[:2]), sum(loads[2:])) / 96, 4), 4: round(max(loads) / 48, 4)},
        )
    )
    given = with_expert_shares([block], experts, rows, ExpertCosting(act_bytes=2, imbalance=1.5))[0].experts
    # given: the busiest expert's; a rank of 2 experts' excess is 1 / sqrt(2) of it (measured costs: no roofline)
    assert given is not None and given.imbalance == {2: round(1 + 0.5 / 2**0.5, 4), 4: 1.5} and given.gemm_s == {}
    assert torch.is_grad_enabled()  # the forward ran without autograd and left it on


def test_a_limit_ddp_replicas_miss_is_met_by_fsdp_with_the_experts_sharded(tmp_path: Path) -> None:
    # dp 4, ep 2: DDP holds 5.5 MB a rank, FSDP 3.6 MB (each rank's experts over the 2 replicas holding
    # them, the rest over all 4). Under a 4.8 MB limit --dp-mode auto takes FSDP with ep 2, as it runs
    pytest.importorskip("transformers")
    options = dict(gpu_type="h100", gpus=4, batch_size=16, dp=4, ep=2, tp=1, recompute="never")
    ddp = _plan(tmp_path, "models/hf/mixtral.py", dp_mode="ddp", **options)
    fsdp = _plan(tmp_path, "models/hf/mixtral.py", dp_mode="fsdp", **options)
    assert fsdp.prediction.max_memory_bytes < 0.0045 * 2**30 < ddp.prediction.max_memory_bytes
    auto = _plan(tmp_path, "models/hf/mixtral.py", dp_mode="auto", memory_limit_gib=0.0045, **options)
    assert (auto.dp_mode, auto.ep) == ("fsdp", 2) and auto.prediction.max_memory_bytes <= 0.0045 * 2**30
    held = [b for b in auto.blocks if b.experts is not None]
    assert held and all(b.fsdp_sharded()[0] > b.params for b in held)  # FSDP shards every expert's share
    assert auto.prediction.max_memory_bytes == fsdp.prediction.max_memory_bytes


def test_ep_auto_tries_the_divisors_of_the_experts_that_divide_the_ranks() -> None:
    from planner.core.levers.experts import expert_degrees

    def with_experts(n: int) -> BlockCost:
        return _block(ExpertShare(layers=1, experts=n, params=8, param_bytes=32, dispatch_bytes=64))

    assert expert_degrees([with_experts(8), _block(None)], 64) == (1, 2, 4, 8)
    assert expert_degrees([with_experts(60), with_experts(60)], 32) == (1, 2, 4)  # 60's divisors dividing 32
    assert expert_degrees([with_experts(8), with_experts(6)], 64) == (1, 2)  # the layers' common divisors
    assert expert_degrees([_block(None)], 64) == (1,)


def test_ep_auto_shards_the_experts_where_only_that_fits(tmp_path: Path) -> None:
    # every replica holds its whole stage (DDP, pipeline of 1): 6.9 MB a rank with the experts whole,
    # 4.5 MB with them over 4 replicas; under a 6 MB limit only sharding fits, and the search says so
    pytest.importorskip("transformers")
    options = dict(gpu_type="h100", gpus=4, batch_size=16, dp=4, dp_mode="ddp", tp=1, recompute="never")
    plan = _plan(tmp_path, "models/hf/mixtral.py", ep="auto", memory_limit_gib=0.0056, **options)
    assert plan.ep in (2, 4) and plan.prediction.max_memory_bytes <= 0.0056 * 2**30
    assert plan.model.expert_calls and "expert-parallel degree" in plan.choice and f"ep={plan.ep}" in plan.choice
    # compiled too (the exchanges run eagerly inside the compiled stages)
    compiled = _plan(tmp_path, "models/hf/mixtral.py", ep="auto", memory_limit_gib=0.0056, compile=True, **options)
    assert compiled.compile and compiled.ep in (2, 4)
    # without the limit the unsharded layout is as fast and kept; the trace still records the calls,
    # so the run traces as the plan did whatever ep it chose
    free = _plan(tmp_path, "models/hf/mixtral.py", ep="auto", **options)
    assert free.model.expert_calls and {c.ep for c in free.search} >= {1}
    dense = _plan(tmp_path, "models/llama.py", ep="auto", gpu_type="h100", gpus=4, batch_size=16, dp=4)
    assert dense.ep == 1 and not dense.model.expert_calls and "expert-parallel" not in dense.choice


def test_a_model_traced_by_module_boundaries_cannot_shard_its_experts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # no graph, no place to dispatch in: --ep K is one line, --ep auto keeps the experts whole
    import planner.capture.trace as trace

    def refuse(*args: object) -> None:
        raise RuntimeError("not traceable here")

    monkeypatch.setattr(trace, "TRACERS", {"fx": refuse, "export": refuse})
    with pytest.raises(PlannerError, match=r"^--ep 2: the model was traced by modules, which does not show"):
        _plan(tmp_path, "tests/fixtures/moe_file.py", size=None, gpus=2, dp=2, ep=2)
    plan = _plan(tmp_path, "tests/fixtures/moe_file.py", size=None, gpus=2, dp=2, ep="auto")
    assert plan.ep == 1 and plan.model.trace_method == "modules" and not plan.model.expert_calls


def test_an_expert_parallel_plan_refreshes_to_itself(tmp_path: Path) -> None:
    # pipeline-outermost: pipeline rank 0's 4 replicas fill node 0, rank 1's node 1, so the boundary
    # crosses nodes; the figures recomputed from the plan's blocks (planner report, export, run) must
    # lay the ranks out so too (they once took the replicas-outermost order and found it "edited")
    pytest.importorskip("transformers")
    from planner.core.step.predict import plan_layout, refresh

    options = dict(gpu_type="h100", gpus=8, gpus_per_node=4, batch_size=16, dp=4, ep=2, tp=1)
    for mode in ("ddp", "fsdp"):
        plan = _plan(tmp_path, "models/hf/mixtral.py", dp_mode=mode, **options)
        assert plan.n_ranks == 2 and plan.pp_outer and plan_layout(plan).pp_outer
        fresh, notes = refresh(plan)
        assert notes == [] and fresh.prediction == plan.prediction, notes


def test_tensor_and_expert_parallelism_are_searched_together(tmp_path: Path) -> None:
    # the attention split over tp ranks, each expert group spanning them (the experts whole, each rank
    # routing its slice of the tokens), without sequence parallelism (not run with ep yet): a given
    # --tp 2 --ep 2 / --ep 4 plans so, with one replica too, and auto tries them
    from planner.report.tables import experts_line

    pytest.importorskip("transformers")
    options = dict(gpu_type="h100", gpus=8, gpus_per_node=8, batch_size=16)
    given = _plan(tmp_path, "models/hf/mixtral.py", tp=2, ep=2, dp=2, **options)
    assert (given.tp, given.ep, given.dp, given.sequence_parallel, given.pp_outer) == (2, 2, 2, False, True)
    assert "sharded over 2 consecutive ranks (ep 2: 1 replica(s) x 2 tensor-parallel ranks" in experts_line(given)
    wide = _plan(tmp_path, "models/hf/mixtral.py", tp=2, ep=4, dp=2, **options)
    assert (wide.ep, wide.ep_replicas) == (4, 2)
    alone = _plan(tmp_path, "models/hf/mixtral.py", tp=2, ep=2, dp=1, **options)  # pipeline only, experts split
    assert (alone.dp, alone.n_ranks, alone.ep) == (1, 4, 2)
    # a rank routes half the tokens: the experts' rows (and their GEMMs) halve against the group over replicas
    over = {b.name: b for b in given.blocks}
    assert all(b.experts is None or b.experts.token_bytes * 2 == b.experts.dispatch_bytes for b in over.values())
    # the experts' grouped GEMMs are whole work tensor parallelism leaves alone (flop_counter has no formula
    # for them: counted by their FLOPs, not their outputs' elements): about 2/3 of a layer's, split only by ep
    for b in over.values():
        if b.experts is not None:
            assert b.tp is not None and 0.2 < b.tp.sharded_compute < 0.5, b.tp.sharded_compute
    searched = _plan(tmp_path, "models/hf/mixtral.py", tp="auto", ep="auto", dp="auto", **options)
    assert any(c.tp > 1 and c.ep > 1 for c in searched.search), [(c.tp, c.ep) for c in searched.search]
    assert not any(c.ep > 1 and c.sequence_parallel for c in searched.search)
    assert all(c.ep % c.tp == 0 for c in searched.search if c.ep > 1)


def test_ddp_buckets_leave_the_experts_to_an_all_reduce_after_the_backward() -> None:
    """Under DDP the runner leaves a rank's experts out of DDP's buckets and all-reduces their
    gradients over the dp / ep replicas holding them once the backward is done
    (``planner.run.gradients``): the buckets carry the dense gradients only, and the step (and the
    stage's exposed communication) pays the experts' all-reduce after the pass, over their group,
    nothing hidden."""
    from planner.core.layout.inputs import Layout
    from planner.core.levers.data_parallel import ddp_stage_overlap, dp_group_links, experts_after_s, group_allreduce_s
    from planner.core.levers.overlap import buckets
    from planner.core.split.cuts import Split
    from planner.core.step.predict import predict
    from planner.schema.plan import StagePlan

    hw = get_hardware("h100")
    intra = link_cost(hw, intra_node=True)
    share = ExpertShare(layers=1, experts=8, params=800_000_000, param_bytes=3_200_000_000, dispatch_bytes=2**20)
    big = _block(share).model_copy(update={"params": 1_000_000_000, "param_bytes": 4_000_000_000})
    (held,) = at_degree([big], 4, intra, 4)  # 200 M dense and 200 M expert parameters a rank, fp32
    stage = StagePlan(
        index=0, rank=0, start=0, end=1, first_block="b", last_block="b", split_node=None, params=400_000_000,
        fwd_s=0.0, bwd_s=1.0, comm_s=0.0, time_s=0.0, opt_s=0.0, recompute=False, activation_bytes=0,
        in_flight=1, memory_bytes=0,
    )  # fmt: skip
    (one,) = ddp_stage_overlap([held], [stage], [intra], 8)
    dense = sum(group_allreduce_s(nbytes, 8, intra) for nbytes, _ in buckets([800_000_000]))
    assert one.traffic_s == pytest.approx(dense)  # the dense 200 M only, in DDP's buckets
    # the experts' 200 M over the 8 / 4 = 2 replicas holding them
    assert experts_after_s([held], [stage], [intra], 8) == [pytest.approx(group_allreduce_s(800_000_000, 2, intra))]
    assert experts_after_s([big], [stage], [intra], 8) == [0.0]  # no expert parallelism: DDP's own
    links = NodeLinks(**intra.model_dump(), inter=link_cost(hw, intra_node=False), gpus_per_node=8, n_ranks=1)
    layout = Layout("1f1b", 1, 2, dp=8, ep=4)
    (expert_stage,), with_experts = predict([held], Split(starts=(0,)), links, layout, OptimizerSpec(name="sgd"))
    # the same block with its dense part alone: the same buckets and compute, no experts to reduce
    alone = held.model_copy(update={"experts": None, "params": 200_000_000, "param_bytes": 800_000_000})
    (dense_stage,), dense_only = predict(
        [alone], Split(starts=(0,)), links, replace(layout, ep=1), OptimizerSpec(name="sgd")
    )
    (group,) = dp_group_links(links, 1, 8)
    after = group_allreduce_s(800_000_000, 2, group)
    assert after > 0 and with_experts.dp_reduce_s == pytest.approx(dense_only.dp_reduce_s + after, rel=1e-9)
    # the stage's own figures show it too: exposed, nothing hidden
    assert expert_stage.comm_exposed_s == pytest.approx(dense_stage.comm_exposed_s + after, rel=1e-9)
    assert expert_stage.comm_hidden_s == pytest.approx(dense_stage.comm_hidden_s, rel=1e-9)


def test_expert_groups_cover_ep_over_tp_replicas_and_must_tile_them() -> None:
    from planner.schema.counts import expert_groups_fit, group_replicas

    assert [group_replicas(ep, 1) for ep in (1, 2, 8)] == [1, 2, 8]  # tp 1: ep replicas
    assert [group_replicas(ep, 2) for ep in (2, 4, 8)] == [1, 2, 4]  # a group spans both tp ranks
    assert expert_groups_fit(4, 2, 2) and expert_groups_fit(2, 2, 1) and expert_groups_fit(8, 1, 16)
    assert not expert_groups_fit(2, 4, 8)  # tp 4 does not divide ep 2
    assert not expert_groups_fit(8, 2, 6)  # 4 replicas a group do not tile 6


def test_measured_costs_reused_for_other_microbatches_route_as_costs_made_for_them() -> None:
    # the routed rows are counted at the size the blocks were measured at (ProfileInfo.microbatch_size):
    # costs reused for a request of smaller microbatches (bench/common.plan_on_costs) then share out their
    # experts' rows as costs measured at that size do; counted at the request's size they were put on
    # blocks 4x its size and scaled down with them (a quarter of the rows, of the dispatched bytes)
    from planner.api import expert_blocks, measured_costs
    from planner.capture.ep_plan import resolve_experts
    from planner.capture.load import load_model_file

    model_file = ROOT / "models" / "hf" / "mixtral.py"
    pytest.importorskip("transformers")
    mf = load_model_file(model_file, "tiny")
    common = dict(model_file=model_file, size="tiny", gpus=2, dp=2, ep=2, batch_size=16, repeats=1, warmup=0)
    big = PlanRequest.build(**common, microbatches=2, progress=False)  # 4 samples a microbatch
    small = PlanRequest.build(**common, microbatches=8, progress=False)  # 1
    assert (big.microbatch_size, small.microbatch_size) == (4, 1)
    shares = []
    for request, measured in ((small, big), (small, small)):
        costs = measured_costs(mf, measured, 1, None)
        experts = resolve_experts(mf, costs.traced.model)
        blocks = expert_blocks(mf, request, costs, costs.blocks, experts)
        blocks = blocks_at(blocks, costs.profile.microbatch_size or 1, 1, 0.0)
        shares.append([b.experts for b in blocks if b.experts is not None])
    reused, made = shares
    assert made and len(reused) == len(made)
    for got, want in zip(reused, made, strict=True):
        assert got is not None and want is not None
        assert abs(got.rows - want.rows) <= 1 and abs(got.dispatch_bytes - want.dispatch_bytes) <= 1
