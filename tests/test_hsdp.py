"""Tier 1 (pure, CLI runs): HSDP (``--dp-mode hsdp``): FSDP inside groups of ``--dp-shard`` replicas,
the groups' gradients all-reduced.

Its shard-group size (given, or as many replicas as share a node), the links its two groups cross
(against a brute force over placements), its memory (FSDP's at the group's size) and traffic by
hand, the search recording it, the plan's checks, the report and the torchtitan export, and every
mistake as one line.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from plan_factory import LINK, MB, block

from cli import main
from planner.core.assemble import Origin, assemble_plan
from planner.core.layout.inputs import Cluster, Layout, SearchSpace, asked_of, replica_mode
from planner.core.levers.data_parallel import block_fsdp_s, layout_links, shard_of
from planner.core.levers.hardware import get_hardware, link_cost, node_links
from planner.core.levers.hsdp import hsdp_links, hsdp_reduce_s, hsdp_shard
from planner.core.levers.links import NodeLinks
from planner.core.levers.overlap import COMPUTE_SLOWDOWN
from planner.core.split.cuts import Split
from planner.core.step.predict import predict, refresh, with_links
from planner.errors import InfeasibleError
from planner.report.export import export_plan
from planner.report.tables import layout_line
from planner.schema.costs import BlockCost, LinkCost, OptimizerSpec
from planner.schema.plan import ModelRef, Plan, ProfileInfo
from planner.schema.request import PlanRequest

ROOT = Path(__file__).resolve().parents[1]
ADAMW = OptimizerSpec()
QUARTER = MB // 4  # fp32 parameters of one MiB
H100 = get_hardware("h100")
REF = ModelRef(path="m.py", size=None, config={}, file_digest="0" * 16, fingerprint="f" * 16, trace_method="fx", seed=0)
CPU = ProfileInfo(device="cpu", backend="gloo", threads=1, torch_version="2.13.0", hostname="t", warmup=0, repeats=0)
GPU = ProfileInfo(device="cuda", backend="nccl", threads=1, torch_version="2.13.0", hostname="t", warmup=0, repeats=0)


def _layers(n: int = 4) -> list[BlockCost]:
    return [block(f"layers.{i}", 10, 20, QUARTER) for i in range(n)]


def _plan(
    *,
    gpus: int,
    dp: int | str,
    link: LinkCost = LINK,
    profile: ProfileInfo = CPU,
    n_blocks: int = 4,
    dp_mode: str = "hsdp",
    limit: int | None = None,
    **kw: object,
) -> Plan:
    request = PlanRequest.build(
        model_file="m.py", gpus=gpus, dp=dp, dp_mode=dp_mode, batch_size=16, schedule="gpipe", **kw
    )
    profile = profile.model_copy(
        update={"microbatch_size": request.microbatch_size, "min_microbatch_size": request.microbatch_size}
    )
    plan = assemble_plan(
        asked_of(request, limit), _layers(n_blocks), link, Origin(REF, profile, "2026-11-26T00:00:00+00:00")
    )
    return with_links(plan, link)


def test_auto_groups_lie_on_one_node_where_any_do() -> None:
    # 12 replicas of 1 rank on nodes of 8: groups of 6 would straddle nodes 0 and 1; groups of 4 do not
    assert hsdp_shard(12, 1, 8) == 4
    # replicas of 3 ranks on nodes of 8: no group of 2 stays on a node (ranks 6-11 cross): the largest that fits
    assert hsdp_shard(4, 3, 8) == 2
    for dp in range(2, 25):
        for width in (1, 2, 3, 4, 8):
            for node in (1, 2, 4, 8, 16):
                size = hsdp_shard(dp, width, node)
                assert dp % size == 0 and (size == 1 or size * width <= node)
                whole = [d for d in range(2, dp + 1) if dp % d == 0 and d * width <= node and node % (d * width) == 0]
                if whole:  # a node-aligned group exists: the one taken is at least as large and node-local
                    assert size >= max(whole)
                    assert all(
                        k * size * width // node == ((k + 1) * size * width - 1) // node for k in range(dp // size)
                    )


def test_the_shard_count_and_the_group_size() -> None:
    assert (shard_of(8, "ddp"), shard_of(8, "fsdp"), shard_of(8, "hsdp", 2)) == (1, 8, 2)
    with pytest.raises(InfeasibleError, match="do not divide 8 replicas"):
        shard_of(8, "hsdp", 3)
    # as many replicas of 2 ranks as a node of 8 holds: 4; of 8 ranks: 1 (the node is one replica)
    assert hsdp_shard(16, 2, 8) == 4 and hsdp_shard(16, 8, 8) == 1
    # room for 4, but groups must divide the 6 replicas, and groups of 3 (6 ranks) would straddle nodes
    assert hsdp_shard(6, 2, 8) == 2 and hsdp_shard(6, 2, 12) == 6 and hsdp_shard(6, 2, 6) == 3
    assert hsdp_shard(8, 2, 8, asked=2) == 2 and hsdp_shard(8, 2, 8, asked=3) == 0


def test_shard_groups_on_a_node_replicate_groups_across_nodes() -> None:
    intra, inter = link_cost(H100, intra_node=True), link_cost(H100, intra_node=False)
    # 8 replicas of 2 pipeline ranks on nodes of 8: groups of 4 replicas fill one node each
    assert hsdp_links(node_links(H100, 2, 8), 2, 8, 4) == ([intra] * 2, [inter] * 2)
    # groups of 2 replicas of 8 ranks span two nodes
    assert hsdp_links(node_links(H100, 8, 8), 8, 4, 2) == ([inter] * 8, [inter] * 8)
    # one link (a CPU plan): both groups use it
    assert hsdp_links(LINK, 2, 4, 2) == ([LINK] * 2, [LINK] * 2)


def test_group_links_match_a_brute_force_over_every_placement() -> None:
    intra, inter = link_cost(H100, intra_node=True), link_cost(H100, intra_node=False)
    for per_node in (1, 2, 4, 8):
        for dp in (2, 4, 6, 8, 12):
            for pp in (1, 2, 3):
                for tp in (1, 2):
                    if per_node % tp:
                        continue
                    placed = layout_links(node_links(H100, pp, per_node), pp, dp, tp)
                    assert isinstance(placed, NodeLinks)
                    for shard in [s for s in range(1, dp + 1) if dp % s == 0]:
                        shards = [range(k * shard, (k + 1) * shard) for k in range(dp // shard)]
                        copies = [range(j, dp, shard) for j in range(shard)]

                        def one_node(groups: list[range], r: int) -> LinkCost:
                            # NVLink when every group is on one node; else the network with the
                            # ranks a node of the node with the fewest members, in the slowest group
                            nodes = [[placed.node_of(k, r) for k in g] for g in groups]  # noqa: B023
                            if all(len(set(n)) == 1 for n in nodes):
                                return intra
                            local = min(min(n.count(x) for x in set(n)) for n in nodes if len(set(n)) > 1)
                            if local == 1:
                                return inter
                            return inter.model_copy(
                                update={"name": f"h100-inter x{local} ranks a node", "local_ranks": local}
                            )

                        want = ([one_node(shards, r) for r in range(pp)], [one_node(copies, r) for r in range(pp)])
                        assert hsdp_links(placed, pp, dp, shard) == want, (per_node, dp, pp, tp, shard)


def test_memory_is_fsdps_over_the_group_and_traffic_two_levels_by_hand() -> None:
    blocks = _layers()  # 4 MiB of parameters on the one pipeline rank
    hsdp = Layout("gpipe", 1, 2, 1, dp=4, dp_mode="hsdp", dp_shard=2)
    _, got = predict(blocks, Split(starts=(0,)), LINK, hsdp, ADAMW)
    _, fsdp2 = predict(blocks, Split(starts=(0,)), LINK, Layout("gpipe", 1, 2, 1, dp=2, dp_mode="fsdp"), ADAMW)
    _, fsdp4 = predict(blocks, Split(starts=(0,)), LINK, Layout("gpipe", 1, 2, 1, dp=4, dp_mode="fsdp"), ADAMW)
    # the state is sharded over the group of 2, as FSDP over 2 replicas shards it
    assert got.max_memory_bytes == fsdp2.max_memory_bytes > fsdp4.max_memory_bytes
    # inside the group: gather + reduce-scatter of 1/2 x 4 MiB at 1 MiB/ms = 2 x 2 ms; then the
    # 2 MiB shard all-reduced over the 2 groups: 2 x 1/2 x 2 MiB = 2 ms
    assert got.dp_reduce_s == pytest.approx(6e-3, rel=1e-12)
    assert hsdp_reduce_s(4 * MB, 2, 2, LINK, LINK) == pytest.approx(6e-3, rel=1e-12)
    assert fsdp4.dp_reduce_s == pytest.approx(2 * 3e-3, rel=1e-12)  # 3/4 x 4 MiB twice


def test_block_units_all_reduce_each_units_shard_every_microbatch() -> None:
    blocks = _layers()
    stages, _ = predict(
        blocks, Split(starts=(0,)), LINK, Layout("gpipe", 1, 2, 1, dp=4, dp_mode="hsdp", dp_shard=2), ADAMW
    )
    # per microbatch (2) and unit (4 of 1 MiB): two gathers and a reduce-scatter of 1/2 MiB
    # (3 x 0.5 ms), then the unit's 1/2 MiB shard all-reduced over 2 groups (0.5 ms)
    got = block_fsdp_s(blocks, stages, [LINK], 2, 2, False, [LINK], 2)
    assert got == pytest.approx([2 * 4 * (1.5e-3 + 0.5e-3)], rel=1e-12)
    assert block_fsdp_s(blocks, stages, [LINK], 2, 2, False) == pytest.approx([2 * 4 * 1.5e-3], rel=1e-12)


def test_the_search_records_hsdp_and_its_groups() -> None:
    plan = _plan(gpus=4, dp=4, dp_shard=2, fsdp_units="stage")
    assert (plan.dp_mode, plan.dp_shard, plan.shard_size, plan.n_ranks) == ("hsdp", 2, 2, 1)
    assert plan.prediction.dp_reduce_s == pytest.approx(6e-3, rel=1e-12)
    assert all(c.dp_mode == "hsdp" and c.dp_shard == 2 for c in plan.search)
    assert "dp=4 (hsdp in groups of 2)" in plan.choice
    assert refresh(Plan.from_json(plan.to_json()))[1] == []  # re-predicted to itself
    line = layout_line(plan)
    assert "HSDP (parameters, gradients and optimizer state sharded 2 ways inside 2 groups of 2" in line


def test_auto_groups_fill_a_node_and_cross_nodes_only_to_all_reduce() -> None:
    intra, inter = link_cost(H100, intra_node=True), link_cost(H100, intra_node=False)
    # 16 GPUs, 8 per node, 8 replicas of 2 pipeline ranks: 4 replicas share a node
    plan = _plan(gpus=16, dp=8, link=node_links(H100, 2, 8), profile=GPU, n_blocks=8, fsdp_units="stage")
    assert (plan.dp_mode, plan.dp_shard, plan.n_ranks) == ("hsdp", 4, 2)
    held = [sum(b.param_bytes for b in plan.blocks[s.start : s.end]) for s in plan.stages]
    # on devices each stage's gather and reduction are placed inside the pass (simulate.Traffic):
    # what they add is at most the whole of the busiest rank's, charged after the pipeline before,
    # plus the slowdown of the compute its hidden gathers ran beside (planner.core.levers.overlap)
    whole = max(hsdp_reduce_s(n, 4, 2, intra, inter) for n in held)
    assert 0 < plan.prediction.dp_reduce_s <= whole * (1 + COMPUTE_SLOWDOWN)
    assert layout_line(plan).endswith(
        f"after its last backward: {plan.prediction.dp_reduce_s * 1e3:.2f} ms/step not hidden by the pipeline, or lost to the slowdown of the compute beside it) "
        "over h100-inter, h100-intra"
    )


def test_auto_takes_hsdp_across_nodes_where_ddp_does_not_fit_and_it_is_faster_than_fsdp() -> None:
    kw = dict(gpus=16, dp=8, link=node_links(H100, 2, 8), profile=GPU, n_blocks=8, fsdp_units="stage")
    hsdp = _plan(**kw)  # type: ignore[arg-type]
    fsdp = _plan(dp_mode="fsdp", **kw)  # type: ignore[arg-type]
    ddp = _plan(dp_mode="ddp", **{**kw, "fsdp_units": "auto"})  # type: ignore[arg-type]
    assert fsdp.prediction.max_memory_bytes < hsdp.prediction.max_memory_bytes < ddp.prediction.max_memory_bytes
    assert hsdp.prediction.step_time_s < fsdp.prediction.step_time_s
    # DDP does not fit, HSDP just does: auto takes it, with its groups of one node's 4 replicas
    auto = _plan(dp_mode="auto", limit=hsdp.prediction.max_memory_bytes, **kw)  # type: ignore[arg-type]
    assert (auto.dp_mode, auto.dp_shard) == ("hsdp", 4)
    assert auto.prediction == hsdp.prediction
    # a byte less and only FSDP fits
    tight = _plan(dp_mode="auto", limit=hsdp.prediction.max_memory_bytes - 1, **kw)  # type: ignore[arg-type]
    assert (tight.dp_mode, tight.dp_shard) == ("fsdp", None)
    # on one machine (no node links) auto never tries HSDP: FSDP's groups already share the node
    alone = _plan(gpus=4, dp=4, dp_mode="fsdp", fsdp_units="stage")
    local = _plan(gpus=4, dp=4, dp_mode="auto", fsdp_units="stage", limit=alone.prediction.max_memory_bytes)
    assert (local.dp_mode, local.prediction) == ("fsdp", alone.prediction)


def test_one_group_of_every_replica_is_recorded_as_fsdp_and_said() -> None:
    plan = _plan(gpus=4, dp=4)  # a CPU plan: one machine holds every replica
    assert (plan.dp_mode, plan.dp_shard) == ("fsdp", None)
    assert "--dp-mode hsdp: one machine (the plan has no node links" in plan.choice
    assert "holds all 4 replicas of 1 rank(s) each, so the one shard group is fsdp" in plan.choice


def test_hsdp_asked_where_one_replica_fills_a_node_takes_the_smallest_groups() -> None:
    # 4 replicas of 8 ranks on nodes of 8: no two replicas share a node; groups of 2 (across 2 nodes)
    plan = _plan(gpus=32, dp=4, link=node_links(H100, 8, 8), profile=GPU, n_blocks=8, fsdp_units="stage")
    assert (plan.dp_mode, plan.dp_shard, plan.n_ranks) == ("hsdp", 2, 8)


def test_auto_replicas_skip_counts_the_groups_do_not_divide() -> None:
    # 2 replicas cannot form groups of 4; 4 form one (fsdp); 8 form two
    space = SearchSpace(16, "gpipe", replicas=(1, 2, 4, 8), dp_mode="hsdp", dp_shard=4)
    cluster = Cluster(world_size=8, link=LINK)
    assert [replica_mode(cluster, space, dp, 8 // dp) for dp in (1, 2, 4, 8)] == [
        ("ddp", 0),
        ("hsdp", -1),
        ("fsdp", 0),
        ("hsdp", 4),
    ]
    plan = _plan(gpus=8, dp="auto", dp_shard=4, n_blocks=8)
    # what the search solved (the rest ruled out by their step floor) is among those
    rows = {(c.dp, c.dp_mode, c.dp_shard) for c in plan.search}
    assert rows and rows <= {(1, "ddp", None), (4, "fsdp", None), (8, "hsdp", 4)}


def test_a_plan_checks_its_groups() -> None:
    plan = _plan(gpus=4, dp=4, dp_shard=2)
    data = plan.model_dump(mode="json")
    for update, message in [
        ({"dp_shard": None}, "hsdp needs dp_shard"),
        ({"dp_shard": 3}, "dp_shard 3 must divide dp 4"),
        ({"dp_shard": 4}, "dp_shard 4 must divide dp 4 into several groups"),
        ({"dp_mode": "fsdp"}, "dp_mode fsdp with dp_shard 2"),
    ]:
        with pytest.raises(ValueError, match=message):
            Plan.model_validate({**data, **update})


def test_torchtitan_export_gives_both_degrees() -> None:
    text = export_plan(_plan(gpus=4, dp=4, dp_shard=2), "torchtitan-toml")
    assert "data_parallel_replicate_degree = 2" in text and "data_parallel_shard_degree = 2" in text
    fsdp = export_plan(_plan(gpus=4, dp=4), "torchtitan-toml")
    assert "data_parallel_replicate_degree = 1" in fsdp and "data_parallel_shard_degree = 4" in fsdp


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--dp", "4", "--dp-shard", "2"], "error: --dp-shard 2 sizes HSDP's shard groups, but --dp-mode is auto"),
        (
            ["--dp", "4", "--dp-mode", "hsdp", "--dp-shard", "3"],
            "error: --dp-shard 3 must divide --dp 4 into at least two groups",
        ),
        (["--dp", "4", "--dp-mode", "hsdp", "--dp-shard", "4"], "error: --dp-shard 4 must divide --dp 4"),
        (["--dp", "4", "--dp-mode", "hsdp", "--dp-shard", "1"], "error: --dp-shard 1: a shard group needs at least 2"),
        (["--dp", "4", "--dp-mode", "hsdp", "--dp-shard", "x"], "error: --dp-shard"),
        (["--dp-mode", "hsdp", "--dp-shard", "2"], "error: --dp-shard 2 groups replicas, but --dp is 1"),
    ],
)
def test_plan_command_hsdp_mistakes_are_one_line(args: list[str], message: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(
        main, ["plan", str(ROOT / "models" / "toy.py"), "--gpus", "4", *args, "-o", str(tmp_path / "p.json"), "-q"]
    )
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1 and message in result.output, result.output


def test_plan_help_explains_hsdp() -> None:
    text = " ".join(CliRunner().invoke(main, ["plan", "--help"]).output.split())
    assert "--dp-mode [auto|ddp|fsdp|hsdp]" in text and "hsdp (fully_shard on a 2-D mesh" in text
    assert "--dp-shard K|AUTO Under --dp-mode hsdp, the replicas of each shard group" in text
