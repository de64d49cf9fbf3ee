"""Tier 1 (pure): ranks on several nodes (``--gpus-per-node``): only boundaries between nodes use the
inter-node link, in the solver, the prediction and the plan file."""

from __future__ import annotations

import pytest
from plan_factory import block, predicted

from planner.core.assemble import Origin, assemble_plan
from planner.core.layout.inputs import asked_of
from planner.core.levers.hardware import get_hardware, link_cost, node_links
from planner.core.levers.links import NodeLinks
from planner.core.step.predict import plan_links, refresh, with_links
from planner.errors import PlannerError
from planner.schema.costs import BlockCost, LinkCost, OptimizerSpec
from planner.schema.plan import ModelRef, Plan, ProfileInfo
from planner.schema.request import PlanRequest

H100 = get_hardware("h100")
INTRA, INTER = link_cost(H100, intra_node=True), link_cost(H100, intra_node=False)


def _blocks() -> list[BlockCost]:
    # 8 equal layers whose boundaries carry 64 MB: the inter-node link (35 GB/s) costs ~2 ms a message
    return [block("embed", 1, 1, 1000, layer=False, cut_mb=64)] + [
        block(f"layers.{i}", 10, 20, 5000, cut_mb=64) for i in range(8)
    ]


def _plan(link: LinkCost, gpus: int = 4, schedule: str = "1f1b") -> Plan:
    request = PlanRequest.build(
        model_file="m.py", gpus=gpus, schedule=schedule, batch_size=16, microbatches=8, gpu_type="h100"
    )
    plan = assemble_plan(
        asked_of(request, None),
        _blocks(),
        link,
        Origin(
            ModelRef(
                path="m.py", size=None, config={}, file_digest="0" * 16, fingerprint="f" * 16, trace_method="fx", seed=0
            ),
            ProfileInfo(
                device="cuda", backend="nccl", threads=1, torch_version="2.13.0", hostname="t", warmup=0, repeats=0
            ),
            "2026-11-21T00:00:00+00:00",
        ),
    )
    return with_links(plan, link)


def test_node_links_of_the_hardware() -> None:
    links = node_links(H100, 64, 8)
    assert isinstance(links, NodeLinks) and links.intra() == INTRA and links.inter == INTER
    assert (links.gpus_per_node, links.n_ranks) == (8, 64)


def test_one_node_plans_as_the_intra_link_and_one_gpu_per_node_as_the_inter_link() -> None:
    one_node, alone = _plan(node_links(H100, 4, 8)), _plan(node_links(H100, 4, 1))
    assert one_node.prediction == _plan(INTRA).prediction and one_node.stages == _plan(INTRA).stages
    # --multi-node (every rank its own node) is the old all-inter-node plan, all-reduce latency included
    assert alone.prediction == _plan(INTER).prediction and alone.stages == _plan(INTER).stages


def test_only_the_boundary_between_nodes_pays_the_inter_node_link() -> None:
    plan = _plan(node_links(H100, 4, 2))  # ranks 0, 1 on node 0; 2, 3 on node 1
    mb = 64 * 2**20
    starts = [s.start for s in plan.stages]
    stages, _ = predicted(plan.blocks, starts, plan_links(plan), "1f1b", 8, OptimizerSpec())
    # per microbatch, both ways; the middle boundary (stage 1 -> 2) is the only one between nodes
    assert stages[0].comm_s == pytest.approx(2 * INTRA.send_s(mb))
    assert stages[1].comm_s == pytest.approx(2 * (INTRA.send_s(mb) + INTER.send_s(mb)))
    assert stages[2].comm_s == pytest.approx(2 * (INTER.send_s(mb) + INTRA.send_s(mb)))
    assert stages[3].comm_s == pytest.approx(2 * INTRA.send_s(mb))
    assert plan.stages == stages


def test_the_plan_records_both_links_and_reloads_to_the_same_figures() -> None:
    plan = _plan(node_links(H100, 4, 2), schedule="interleaved-1f1b")
    assert type(plan.link) is LinkCost and plan.link == INTRA
    assert plan.inter_node_link == INTER and plan.gpus_per_node == 2
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert refresh(again) == (again, [])  # the per-boundary figures are redone exactly
    flat = again.model_copy(update={"inter_node_link": None, "gpus_per_node": None})
    assert refresh(flat)[1]  # read as one link, the figures would differ: the fields matter
    old = {k: v for k, v in plan.model_dump().items() if k not in ("inter_node_link", "gpus_per_node")}
    assert Plan.model_validate(old).inter_node_link is None  # plans from before load (one link)


def test_request_option_and_its_alias() -> None:
    base = {"model_file": "m.py", "gpus": 16, "gpu_type": "h100"}
    assert PlanRequest.build(**base).ranks_per_node == 8
    assert PlanRequest.build(**base, gpus_per_node=4).ranks_per_node == 4
    assert PlanRequest.build(**base, multi_node=True).ranks_per_node == 1
    assert PlanRequest.build(**base, multi_node=True, gpus_per_node=1).ranks_per_node == 1
    with pytest.raises(PlannerError, match="--multi-node means --gpus-per-node 1"):
        PlanRequest.build(**base, multi_node=True, gpus_per_node=8)
    with pytest.raises(PlannerError, match="--gpus-per-node applies to estimated costs only"):
        PlanRequest.build(model_file="m.py", gpus=2, gpus_per_node=2)
    with pytest.raises(PlannerError, match="--gpus-per-node 0"):
        PlanRequest.build(**base, gpus_per_node=0)


def test_attention_kernel_is_an_option_of_gpu_estimates_only() -> None:
    assert (
        PlanRequest.build(model_file="m.py", gpus=2, gpu_type="h100", attention_kernel="flash").attention_kernel
        == "flash"
    )
    for gpu_type in (None, "cpu"):
        with pytest.raises(PlannerError, match="--attention-kernel applies to --gpu-type estimates of GPUs only"):
            PlanRequest.build(model_file="m.py", gpus=2, gpu_type=gpu_type, attention_kernel="flash")


def test_intra_node_link_keeps_every_link_field() -> None:
    """A plan stores a ``NodeLinks``' intra-node link as a plain ``LinkCost``: nothing of it is lost."""
    from planner.core.levers.links import NodeLinks
    from planner.schema.costs import LinkCost

    intra = LinkCost(name="cpu", latency_s=1e-3, bandwidth_Bps=2e9, cpu_share=0.6)
    inter = LinkCost(name="net", latency_s=2e-5, bandwidth_Bps=5e10)
    links = NodeLinks(**intra.model_dump(), inter=inter, gpus_per_node=2, n_ranks=4)
    assert links.intra() == intra and type(links.intra()) is LinkCost
