"""Tiers 1 and 2: context parallelism (``--cp``) as the planner costs and plans it: the exchange of keys
and values charged per attention block, the mesh's replicas, what the request refuses in one line.
The runner's equality with the unsplit model: tests/test_run_cp.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from plan_factory import block

from planner.core.levers.context_parallel import at_context, context_link
from planner.core.levers.links import NodeLinks
from planner.core.levers.microbatch import blocks_at
from planner.core.levers.tensor_parallel import allgather_s
from planner.errors import PlannerError
from planner.schema.costs import BlockCost, LinkCost
from planner.schema.request import PlanRequest

ROOT = Path(__file__).resolve().parents[1]
LINK = LinkCost(name="test", latency_s=1e-3, bandwidth_Bps=1e9)


def _block(kv_bytes: int) -> BlockCost:
    """An attention block: 10 ms forward, 20 ms backward (12 input, 8 weight), 5,000 bytes saved."""
    return block("attn", 10, 20, 10).model_copy(
        update={
            "bwd_input_s": 0.012,
            "bwd_weight_s": 0.008,
            "recompute_s": 0.010,
            "selective_bytes": 1000,
            "activation_bytes": 5000,
            "cut_bytes": 100,
            "kv_bytes": kv_bytes,
        }
    )


def test_a_context_parallel_rank_pays_the_gather_and_holds_the_gathered_keys_and_values() -> None:
    # 2,000 bytes of keys and values at the rank's share; tp 2: its heads' 1,000; cp 4 gathers 4,000:
    # a ring of 3 / 4 of them and ceil(log2 4) = 2 latencies, forward (and again when recomputed); the
    # reduce-scatter of their gradients in the input gradient's pass; 3 other ranks' chunks saved
    block = _block(2000)
    (got,) = at_context([block], cp=4, tp=2, link=LINK)
    move = 2 * 1e-3 + 0.75 * 4000 / 1e9
    assert got.fwd_s == pytest.approx(0.010 + move, rel=1e-12)
    assert got.bwd_s == pytest.approx(0.020 + move, rel=1e-12)
    assert got.bwd_input_s == pytest.approx(0.012 + move, rel=1e-12)
    assert got.bwd_weight_s == block.bwd_weight_s
    assert got.recompute_s == pytest.approx(0.010 + move, rel=1e-12)
    assert got.activation_bytes == 5000 + 3000 and got.selective_bytes == 1000 + 3000
    assert allgather_s(4000, 4, LINK) == pytest.approx(move, rel=1e-12)


def test_a_ring_hides_each_steps_send_behind_that_steps_attention() -> None:
    # tp 2, cp 4: the rank's own chunk of its heads is 1,000 bytes, a send 1 ms + 1 us; its attention
    # 2.4 ms forward and 4.8 ms backward for its heads (of 4.8 / 9.6 ms for every head), a quarter a step:
    # forward 3 steps of (1.001 - 0.6) ms exposed; backward 3 steps of 2 sends beside 1.2 ms, and the
    # gradients' last step home, unhidden; nothing saved beyond the rank's own chunk
    block = _block(2000).model_copy(update={"attention_s": (0.0048, 0.0096)})
    (got,) = at_context([block], cp=4, tp=2, link=LINK, ring=True)
    send = 1e-3 + 1000 / 1e9
    assert got.fwd_s == pytest.approx(0.010 + 3 * (send - 0.0006), rel=1e-12)
    assert got.bwd_s == pytest.approx(0.020 + 3 * (2 * send - 0.0012) + send, rel=1e-12)
    assert got.bwd_input_s == pytest.approx(0.012 + 3 * (2 * send - 0.0012) + send, rel=1e-12)
    assert got.recompute_s == pytest.approx(got.fwd_s, rel=1e-12)
    assert got.activation_bytes == block.activation_bytes and got.selective_bytes == block.selective_bytes
    # attention long enough to hide every send: only the last step home shows; unknown attention hides nothing
    (hidden,) = at_context([block.model_copy(update={"attention_s": (1.0, 2.0)})], cp=4, tp=2, link=LINK, ring=True)
    assert hidden.fwd_s == block.fwd_s and hidden.bwd_s == pytest.approx(0.020 + send, rel=1e-12)
    (blind,) = at_context([_block(2000)], cp=4, tp=2, link=LINK, ring=True)
    assert blind.fwd_s == pytest.approx(0.010 + 3 * send, rel=1e-12)


def test_the_search_leaves_out_the_gather_where_a_ring_is_as_fast_in_every_block() -> None:
    from planner.core.layout.inputs import Layout
    from planner.core.layout.pending import Pending, ring_dominates

    def pending(*blocks: BlockCost) -> Pending:
        return Pending(Layout("1f1b", 1, 1), list(blocks), 0.0, 0)

    slow, fast = _block(2000), _block(2000).model_copy(update={"fwd_s": 0.009})
    assert ring_dominates(pending(slow, slow), pending(fast, slow))
    assert not ring_dominates(pending(fast, slow), pending(slow, slow))  # the gather faster somewhere: both kept


def test_masked_attention_also_swaps_its_queries_and_output_between_mirrored_blocks() -> None:
    # 1,600 bytes of queries, tp 2: 800 a rank, sent to the ranks computing their blocks and the output
    # back (2 all-to-alls of 3 / 4 of them, 3 latencies each, over 4 ranks on the link), forward and backward
    block = _block(2000).model_copy(update={"q_bytes": 1600})
    (got,) = at_context([block], cp=4, tp=2, link=LINK)
    (plain,) = at_context([_block(2000)], cp=4, tp=2, link=LINK)
    swaps = 2 * (3 * 1e-3 + 0.75 * 800 / 1e9)
    assert got.fwd_s == pytest.approx(plain.fwd_s + swaps, rel=1e-12)
    assert got.bwd_input_s == pytest.approx(plain.bwd_input_s + swaps, rel=1e-12)
    assert got.activation_bytes == plain.activation_bytes


def test_blocks_without_attention_or_cp_1_are_left_alone() -> None:
    dense = _block(0)
    assert at_context([dense], cp=8, tp=1, link=LINK)[0] is dense
    attn = _block(2000)
    assert at_context([attn], cp=1, tp=1, link=LINK)[0] is attn


def test_the_keys_and_values_follow_a_ranks_share_of_the_microbatch() -> None:
    # cp 4: a rank computes a quarter of every sequence, a quarter of its keys and values
    (got,) = blocks_at([_block(4000)], 8, 8 / 4, 0.0)
    assert got.kv_bytes == 1000 and got.fwd_s == pytest.approx(0.0025)


def test_a_context_parallel_group_crosses_nodes_once_its_replicas_do() -> None:
    intra = LinkCost(name="nvlink", latency_s=1e-6, bandwidth_Bps=300e9)
    inter = LinkCost(name="ib", latency_s=1e-5, bandwidth_Bps=25e9)
    node = NodeLinks(**intra.model_dump(), inter=inter, gpus_per_node=8, n_ranks=1, replicas=1, tp=1)
    # tp 8 fills a node: the group's replicas sit on different nodes (the Llama 3 long-context layout)
    assert context_link(node, 16, 128, 8, 16).name != intra.name
    # pp 1, tp 2: 4 replicas of one pipeline rank on one node
    assert context_link(node, 1, 4, 2, 4).name == intra.name
    assert context_link(LINK, 2, 4, 1, 2) is LINK


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"cp": 3}, r"^--cp 3 does not divide --gpus 4$"),
        ({"dp": 2, "tp": 1, "gpus": 4, "cp": 4}, r"--dp 2 x --tp 1 x --cp 4 does not divide --gpus 4"),
        (
            {"ep": 4, "dp": 1, "gpus": 8},
            r"^--ep 4 shards the experts over 4 replicas, but --dp 1 x --cp 2 is no multiple",
        ),
        # with --cp auto the replica counts wait for the search, but what ep does not run with is still said
        (
            {"cp": "auto", "ep": 2, "tp": 2, "dp": 2, "gpus": 8, "sequence_parallel": True},
            r"^--ep 2: expert parallelism does not run with --sequence-parallel yet",
        ),
        (
            {"gpus": 8, "dp": 2, "dp_mode": "hsdp", "dp_shard": 3},
            r"^--dp-shard 3 must divide --dp 2 x --cp 2 into at least two groups",
        ),
        ({"gpus": 8, "dp": 2, "dp_mode": "hsdp", "dp_shard": 4}, r"^--dp-shard 4 must divide --dp 2 x --cp 2"),
    ],
)
def test_the_request_refuses_what_cp_does_not_run_with(options: dict, message: str) -> None:
    values = {"model_file": ROOT / "models" / "llama.py", "gpus": 4, "cp": 2, **options}
    with pytest.raises(PlannerError, match=message):
        PlanRequest.build(**values)


def _plan(tmp_path: Path, **options: object):  # type: ignore[no-untyped-def]
    from planner.api import make_plan

    values = {"model_file": ROOT / "models" / "llama.py", "size": "tiny", "gpus": 4, "batch_size": 8}
    return make_plan(PlanRequest.build(**{**values, "output": tmp_path / "p.json", "progress": False, **options}))


def test_planner_plan_cp_splits_the_sequence_over_replicas(tmp_path: Path) -> None:
    # estimated for H100s: the costs are deterministic, the attention blocks' keys and values known;
    # beside it the same pipeline of 2 ranks without context parallelism, its microbatches of 4 whole rows
    options = {"gpu_type": "h100", "dp": 1, "tp": 1, "schedule": "1f1b", "recompute": "never", "microbatches": 2}
    whole = _plan(tmp_path, **{**options, "gpus": 2})
    plan = _plan(tmp_path, **options, cp=2)
    assert (plan.dp, plan.cp, plan.replicas, plan.n_ranks, plan.world_size) == (1, 2, 2, 2, 4)
    assert plan.microbatch_size == whole.microbatch_size == 4  # a replica's rows, whole sequences
    # the tiny Llama: 4 layers, each attention reading keys and values of 2 kv heads x 16 dims x 32 positions
    assert sorted(b.kv_bytes for b in whole.blocks if b.kv_bytes) == [4 * 2 * 16 * 32 * 2 * 2] * 4  # 4 rows, bf16
    assert sorted(b.q_bytes for b in whole.blocks if b.q_bytes) == [4 * 4 * 16 * 32 * 2] * 4  # 4 query heads, causal
    for b, w in zip(plan.blocks, whole.blocks, strict=True):
        # a rank's share: 4 rows of half the sequence, what 2 whole rows cost (the estimate's law is linear
        # here), and the exchange of keys and values where there is attention
        assert b.kv_bytes == w.kv_bytes // 2 and b.q_bytes == w.q_bytes // 2 and b.cut_bytes == w.cut_bytes // 2
        if w.kv_bytes:
            assert b.fwd_s > w.fwd_s / 2 and b.activation_bytes > w.activation_bytes / 2
        else:
            own, was = b.activation_bytes - b.weight_cast_bytes, w.activation_bytes - w.weight_cast_bytes
            assert b.fwd_s == pytest.approx(w.fwd_s / 2) and own == pytest.approx(was / 2, abs=1)  # casts: whole
    assert "cp=2" in plan.choice and "dp=1" in plan.choice
    from planner.report.tables import context_line, layout_line

    assert "each sequence split into 2 chunks over 2 consecutive replicas (dp 1 x cp 2" in context_line(plan)
    assert layout_line(plan).startswith("layout: 2 replicas x 2 stages (dp x pp) on 4 ranks")
    assert context_line(whole) == ""


def test_cp_with_sequence_parallelism_plans_each_chunk_split_again_over_the_tp_ranks(tmp_path: Path) -> None:
    # cp 2 x tp 2: with sequence parallelism the norms' and residuals' activations are a tp rank's slice of
    # its chunk; "auto" searches both and the job file names it
    options = {"gpu_type": "h100", "dp": 1, "tp": 2, "cp": 2, "schedule": "1f1b", "recompute": "never"}
    split = _plan(tmp_path, **options, sequence_parallel=True)
    whole = _plan(tmp_path, **options, sequence_parallel=False)
    assert (split.cp, split.tp, split.sequence_parallel, whole.sequence_parallel) == (2, 2, True, False)
    assert "cp=2, tp=2 with sequence parallelism" in split.choice
    assert split.prediction.max_memory_bytes < whole.prediction.max_memory_bytes
    assert sum(b.activation_bytes for b in split.blocks) < sum(b.activation_bytes for b in whole.blocks)
    # the search's rows say the degree and method; the plan's own row is found among them by it
    from planner.core.layout.robust import chosen_row
    from planner.report.tables import search_table

    searched = _plan(tmp_path, **{**options, "cp": "auto", "tp": 2, "gpus": 8}, sequence_parallel=True)
    assert searched.cp > 1 and all(c.sequence_parallel and c.cp > 1 for c in searched.search)
    row = searched.search[chosen_row(searched)]
    assert (row.cp, row.cp_attention) == (searched.cp, searched.cp_attention)
    assert search_table(searched).splitlines()[0].split()[:4] == ["schedule", "tp", "pp", "cp"]


def test_cp_under_hsdp_shards_inside_groups_of_the_dp_x_cp_replicas(tmp_path: Path) -> None:
    # --dp 1 --cp 4 --dp-shard 2: the replicas are the 4 chunks' ranks, sharded in 2 groups of 2
    from planner.report.export import export_plan
    from planner.report.renames import ExportError
    from planner.report.tables import layout_line

    options = {"dp": 1, "tp": 1, "gpus": 8, "dp_mode": "hsdp", "dp_shard": 2, "schedule": "1f1b"}
    plan = _plan(tmp_path, **options, cp=4)
    assert (plan.dp, plan.cp, plan.replicas, plan.dp_mode, plan.shard_size, plan.n_ranks) == (1, 4, 4, "hsdp", 2, 2)
    assert "inside 2 groups of 2 consecutive replicas" in layout_line(plan)
    # torchtitan shards over whole context-parallel groups: groups of 2 split the 4 chunks' ranks
    with pytest.raises(ExportError, match="shard groups of 2 replicas split context-parallel groups of 4"):
        export_plan(plan, "torchtitan")
    whole = _plan(tmp_path, **{**options, "dp": 4, "dp_shard": 4}, cp=2)  # 8 replicas: 2 groups of 2 x cp 2
    text = export_plan(whole, "torchtitan")
    for field in ("data_parallel_shard_degree=2", "context_parallel_degree=2", "data_parallel_replicate_degree=2"):
        assert field in text


def test_cp_with_expert_parallelism_groups_a_replicas_chunks(tmp_path: Path) -> None:
    # --dp 1 --cp 2 --ep 2: the expert group is the two chunks' ranks of each pipeline rank; the trace
    # records the experts' calls, which the runner dispatches from each rank's own tokens
    options = {"model_file": ROOT / "tests" / "fixtures" / "moe_file.py", "size": None, "repeats": 1, "warmup": 0}
    plan = _plan(tmp_path, **options, gpus=4, dp=1, tp=1, cp=2, ep=2, schedule="1f1b")
    assert (plan.dp, plan.cp, plan.ep, plan.replicas, plan.n_ranks) == (1, 2, 2, 2, 2)
    assert plan.pp_outer and plan.model.expert_calls and plan.experts
    assert "ep=2, cp=2" in plan.choice


def test_long_sequences_choose_ring_attention_and_the_plan_says_so(tmp_path: Path) -> None:
    # 8,192 positions: each step's attention outlasts its send, so the ring hides its traffic and holds
    # less; with the method given, the plan takes it; a plan of cp 1 records the gather
    options = {"gpu_type": "h100", "dp": 1, "tp": 1, "cp": 2, "schedule": "1f1b", "microbatches": 2}
    long = {"overrides": {"seq_len": 8192}}
    plan = _plan(tmp_path, **options, **long)
    assert plan.cp_attention == "ring" and "cp=2 (ring attention)" in plan.choice
    assert all(b.attention_s[0] > 0 and b.attention_s[1] > b.attention_s[0] for b in plan.blocks if b.kv_bytes)
    gathered = _plan(tmp_path, **options, **long, cp_attention="all-gather")
    assert gathered.cp_attention == "all-gather"
    assert plan.prediction.step_time_s < gathered.prediction.step_time_s
    assert plan.prediction.max_memory_bytes < gathered.prediction.max_memory_bytes
    from planner.report.tables import context_line

    assert "passed around the group's ring a chunk at a time" in context_line(plan)
    assert "all-gathered over the group" in context_line(gathered)
    with pytest.raises(ValueError, match="cp_attention ring with cp 1"):
        type(plan).model_validate({**plan.model_dump(), "cp": 1})


def test_cp_compiles_graphs_torch_fx_traces_and_refuses_torch_export_ones(tmp_path: Path) -> None:
    options = {"gpu_type": "h100", "dp": 1, "tp": 1, "cp": 2, "compile": True}
    assert _plan(tmp_path, **options).compile
    pytest.importorskip("transformers")
    with pytest.raises(
        PlannerError, match=r"^--cp 2 with --compile: context parallelism runs compiled on graphs torch.fx"
    ):
        _plan(tmp_path, **options, model_file=ROOT / "models" / "hf" / "llama.py", size=None)


def test_a_sequence_that_does_not_split_into_cp_chunks_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(PlannerError, match=r"^--cp 2: the sequence has 34 positions, which do not split into 4 equal"):
        _plan(tmp_path, gpu_type="h100", cp=2, overrides={"seq_len": 34})


def test_features_are_no_sequence_to_split(tmp_path: Path) -> None:
    # the toy MLP's [batch, 16] float input would have passed for 16 positions: each rank's first layer
    # was given half the features it contracts, and the run failed deep in a backward
    with pytest.raises(PlannerError, match=r"^context parallelism \(--cp\) splits dimension 1 .* no such dimension"):
        _plan(tmp_path, model_file=ROOT / "models" / "toy.py", gpu_type="h100", cp=2, overrides={"in_features": 16})


def test_attention_inside_a_module_torch_fx_keeps_whole_is_refused_cp(tmp_path: Path) -> None:
    # the encoder LM's nn.TransformerEncoderLayer is one call_module node under torch.fx: no
    # scaled_dot_product_attention call for the ring to replace, so each rank would attend over its
    # own chunk only (it planned, and would have trained wrongly)
    with pytest.raises(PlannerError, match=r"^--cp 2: .* but module '1' \(TransformerEncoderLayer; 4 such\) runs nn"):
        _plan(tmp_path, model_file=ROOT / "models" / "encoder_lm.py", gpu_type="h100", cp=2)


def test_cp_auto_tries_the_degrees_that_divide_the_ranks_and_the_sequence(tmp_path: Path) -> None:
    from planner.core.assemble import AUTO_CP_LIMIT, context_degrees
    from planner.core.layout.inputs import asked_of

    asked = asked_of(PlanRequest.build(model_file=ROOT / "models" / "llama.py", gpus=48, cp="auto"), None)
    attention, dense = [_block(100)], [_block(0)]
    assert context_degrees(attention, 48, 96, asked) == (1, 2, 3, 4, 6, 8, 12, 16, 24)  # divisors of 48 and 96
    assert context_degrees(attention, 64, 8192, asked)[-1] == AUTO_CP_LIMIT == 32
    assert context_degrees(dense, 48, 96, asked) == (1,)  # no attention a graph trace saw
    assert context_degrees(attention, 48, None, asked) == (1,)  # no token ids: no sequence known
    plan = _plan(tmp_path, gpu_type="h100", cp="auto", dp="auto")
    assert "context-parallel degree" in plan.choice and plan.world_size == 4
    assert PlanRequest.build(model_file=ROOT / "models" / "llama.py", gpus=6, cp="auto").cp == "auto"


def test_a_measured_plan_counts_attention_from_the_traced_graph(tmp_path: Path) -> None:
    # measured here (no --gpu-type): the graph's attention calls give the bytes; the tiny Llama's 4 query
    # heads read as many bytes as its 2 key and 2 value heads, and its calls are causal
    plan = _plan(tmp_path, cp=2, dp=1, tp=1, schedule="gpipe", microbatches=1, repeats=1, warmup=0)
    attention = [b for b in plan.blocks if b.kv_bytes]
    assert len(attention) == 4 and all(b.q_bytes == b.kv_bytes for b in attention)
    assert plan.cp == 2 and plan.profile.device == "cpu"


def test_a_context_parallel_plan_exports_its_degree(tmp_path: Path) -> None:
    from planner.report.export import export_plan
    from planner.report.renames import ExportError

    plan = _plan(tmp_path, gpu_type="h100", dp=1, tp=1, cp=2, dp_mode="fsdp", schedule="1f1b", microbatches=2)
    megatron = export_plan(plan, "megatron")
    assert "--context-parallel-size 2" in megatron and "--cp-comm-type allgather" in megatron
    titan = export_plan(plan, "torchtitan")
    # FSDP over the 2 context-parallel ranks: torchtitan's dp_shard 1 x cp 2
    assert "context_parallel_degree=2" in titan and "data_parallel_shard_degree=1" in titan
    assert 'context_parallel_rotate_method = "allgather"' in export_plan(plan, "torchtitan-toml")
    ring = plan.model_copy(update={"cp_attention": "ring"})
    assert "--cp-comm-type p2p" in export_plan(ring, "megatron")
    assert 'context_parallel_rotate_method = "alltoall"' in export_plan(ring, "torchtitan-toml")
    with pytest.raises(ExportError, match=r"^DeepSpeed's PipelineModule splits no sequence over ranks"):
        export_plan(plan, "deepspeed")
