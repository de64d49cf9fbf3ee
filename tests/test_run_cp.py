"""Tier 3: context parallelism (``Plan.cp``), real gloo processes on CPU against the unsplit model:
losses and global gradient norms (clipping on) equal within 1e-4, as tests/test_run_tp.py checks
tensor parallelism."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from run_factory import MODELS, plan_with_starts  # noqa: E402
from test_run_tp import _run_and_compare as compare_with_unsplit  # noqa: E402

CP2: dict = dict(schedule="1f1b", n_microbatches=2, optimizer="sgd", lr=0.5, grad_clip=0.5)


def _context(plan, cp: int = 2, attention: str = "all-gather"):  # type: ignore[no-untyped-def]
    return plan.model_copy(update={"cp": cp, "cp_attention": attention})


def _run_and_compare(plan, tmp_path: Path):  # type: ignore[no-untyped-def]
    return compare_with_unsplit(plan, tmp_path, save_checkpoints=False)


@pytest.mark.multiprocess
def test_llama_cp2_pp2_matches_unsplit_model(tmp_path: Path) -> None:
    # rotary positions follow the chunks: the cos / sin tables are sliced at the whole length
    plan = _context(plan_with_starts(MODELS / "llama.py", [0, 3], **CP2))
    assert plan.world_size == 4
    got, want = _run_and_compare(plan, tmp_path)
    print("llama cp2 pp2", got.losses, want.losses, got.grad_norms, want.grad_norms)


@pytest.mark.multiprocess
def test_llama_cp2_pp2_by_ring_attention_matches_unsplit_model(tmp_path: Path) -> None:
    # the keys and values passed around the ring, their gradients summed on the way home
    plan = _context(plan_with_starts(MODELS / "llama.py", [0, 3], **CP2), attention="ring")
    got, want = _run_and_compare(plan, tmp_path)
    print("llama cp2 pp2 ring", got.losses, want.losses, got.grad_norms, want.grad_norms)


@pytest.mark.multiprocess
def test_llama_cp2_pp2_compiled_matches_unsplit_model(tmp_path: Path) -> None:
    # torch.compile takes each stage with the mode's hooks inside it; the ring's sends run eagerly between
    # graphs (the gather's path compiles alike: checked once by hand, 45 s a run on this machine)
    plan = _context(plan_with_starts(MODELS / "llama.py", [0, 3], **CP2), attention="ring")
    got, want = _run_and_compare(plan.model_copy(update={"compile": True}), tmp_path)
    print("llama cp2 pp2 compiled ring", got.losses, want.losses, got.grad_norms, want.grad_norms)


@pytest.mark.multiprocess
@pytest.mark.parametrize("attention", ["all-gather", "ring"])
def test_hugging_face_llama_cp2_pp2_matches_unsplit_model(tmp_path: Path, attention: str) -> None:
    # a torch.export graph, its sizes baked in: DTensors keep the global shapes the graph was made for,
    # and the positions transformers makes with arange (cache_position) are the whole sequence's
    pytest.importorskip("transformers")
    plan = _context(plan_with_starts(MODELS / "hf" / "llama.py", [0, 3], **CP2), attention=attention)
    assert plan.model.trace_method == "export"
    got, want = _run_and_compare(plan, tmp_path)
    print("hf llama cp2 pp2", got.losses, want.losses, got.grad_norms, want.grad_norms)


@pytest.mark.multiprocess
@pytest.mark.parametrize("attention", ["all-gather", "ring"])
def test_cp2_with_tp2_matches_unsplit_model(tmp_path: Path, attention: str) -> None:
    # each tensor-parallel rank gathers (or rings) its own heads' keys and values over its context-parallel group
    plan = _context(plan_with_starts(MODELS / "llama.py", [0], tp=2, **CP2), attention=attention)
    assert plan.world_size == 4
    got, want = _run_and_compare(plan, tmp_path)
    print("llama cp2 tp2", got.losses, want.losses, got.grad_norms, want.grad_norms)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("dp_mode", "recompute", "attention"),
    [("fsdp", "full", "all-gather"), ("ddp", "stage", "all-gather"), ("fsdp", "full", "ring")],
)
def test_cp2_under_fsdp_and_recomputation_matches_unsplit_model(
    tmp_path: Path, dp_mode: str, recompute: str, attention: str
) -> None:
    # FSDP shards over the two context-parallel ranks (torchtitan's dp_shard_cp); a checkpoint region
    # re-runs its forward in backward, under the mode again (a ring passes its chunks around again)
    plan = plan_with_starts(MODELS / "llama.py", [0, 3], **CP2)
    stages = [s.model_copy(update={"recompute": recompute}) for s in plan.stages]
    plan = _context(plan.model_copy(update={"stages": stages, "dp_mode": dp_mode}), attention=attention)
    got, want = _run_and_compare(plan, tmp_path)
    print("llama cp2", dp_mode, recompute, attention, got.losses, want.losses, got.grad_norms, want.grad_norms)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("cp", "seq_len"), [(4, 32), (3, 48)])
def test_mirrored_blocks_over_more_ranks_match_unsplit_model(tmp_path: Path, cp: int, seq_len: int) -> None:
    # 4 ranks: every rank computes blocks held by two others; 3 ranks: rank 2 computes both of rank 1's blocks
    plan = _context(plan_with_starts(MODELS / "llama.py", [0], overrides={"seq_len": seq_len}, **CP2), cp=cp)
    assert plan.world_size == cp
    got, want = _run_and_compare(plan, tmp_path)
    print("llama cp", cp, got.losses, want.losses, got.grad_norms, want.grad_norms)


def test_mirrored_blocks_give_every_rank_the_same_causal_work() -> None:
    from planner.run.context_shard import Mirrored

    for size in range(1, 9):
        ranks = [Mirrored(r, size) for r in range(size)]
        computed = sorted(b for m in ranks for b in m.computed)
        assert computed == list(range(2 * size))  # every block's queries once
        assert all(m.owner(b) == m.rank for m in ranks for b in m.computed)
        # block g's queries see (g + 1/2) blocks of keys under a causal mask: each rank's two sum to 2 x size
        assert {sum(b + 0.5 for b in m.computed) for m in ranks} == {float(2 * size)}
        assert Mirrored(0, size).positions(3, torch.device("cpu")).tolist() == [0, 1, 2] + [
            3 * (2 * size - 1) + i for i in range(3)
        ]


@pytest.mark.multiprocess
@pytest.mark.parametrize("attention", ["all-gather", "ring"])
def test_cp2_with_tp2_and_sequence_parallelism_matches_unsplit_model(tmp_path: Path, attention: str) -> None:
    # each context-parallel chunk split again over the tensor-parallel ranks between a row-wise and the
    # next column-wise layer: the chunks' DTensors on the (cp, tp) mesh
    plan = _context(plan_with_starts(MODELS / "llama.py", [0], tp=2, **CP2), attention=attention)
    plan = plan.model_copy(update={"sequence_parallel": True})
    got, want = _run_and_compare(plan, tmp_path)
    print("llama cp2 tp2 sp", attention, got.losses, want.losses, got.grad_norms, want.grad_norms)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("dp_mode", "recompute", "attention"), [("ddp", "never", "all-gather"), ("fsdp", "full", "ring")]
)
def test_pp2_cp2_tp2_with_sequence_parallelism_matches_unsplit_model(
    tmp_path: Path, dp_mode: str, recompute: str, attention: str
) -> None:
    # 8 ranks: the sequence shards cross the pipeline's cut gathered over the tp ranks and are cut again
    # on arrival; a checkpoint region re-gathers in backward; FSDP shards over the two chunks' ranks
    plan = plan_with_starts(MODELS / "llama.py", [0, 3], tp=2, **CP2)
    stages = [s.model_copy(update={"recompute": recompute}) for s in plan.stages]
    plan = plan.model_copy(update={"stages": stages, "dp_mode": dp_mode, "sequence_parallel": True})
    plan = _context(plan, attention=attention)
    assert plan.world_size == 8
    got, want = _run_and_compare(plan, tmp_path)
    print("llama pp2 cp2 tp2 sp", dp_mode, recompute, got.losses, want.losses, got.grad_norms, want.grad_norms)


@pytest.mark.multiprocess
def test_hugging_face_llama_cp2_tp2_with_sequence_parallelism_matches_unsplit_model(tmp_path: Path) -> None:
    # a torch.export graph: transformers' own tensor-parallel plan, its sizes baked in
    pytest.importorskip("transformers")
    plan = _context(plan_with_starts(MODELS / "hf" / "llama.py", [0], tp=2, **CP2))
    plan = plan.model_copy(update={"sequence_parallel": True})
    got, want = _run_and_compare(plan, tmp_path)
    print("hf llama cp2 tp2 sp", got.losses, want.losses, got.grad_norms, want.grad_norms)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("dp", "cp", "fsdp_units"), [(2, 2, "stage"), (1, 4, "block")])
def test_cp_under_hsdp_matches_unsplit_model(tmp_path: Path, dp: int, cp: int, fsdp_units: str) -> None:
    # HSDP over the dp x cp replicas in shard groups of 2: a whole context-parallel group per shard group
    # (torchtitan's dp_shard x cp), or a group of 4 chunks split over two shard groups (replicated across)
    plan = plan_with_starts(MODELS / "llama.py", [0], dp=dp, **CP2)
    hsdp = {"dp_mode": "hsdp", "dp_shard": 2, "fsdp_units": fsdp_units, "cp": cp}
    plan = type(plan).model_validate({**plan.model_dump(), **hsdp})  # validated: dp_shard divides dp x cp
    assert (plan.world_size, plan.replicas, plan.shard_size) == (4, 4, 2)
    got, want = _run_and_compare(plan, tmp_path)
    print("llama hsdp dp", dp, "cp", cp, got.losses, want.losses, got.grad_norms, want.grad_norms)


@pytest.mark.multiprocess
@pytest.mark.parametrize("model", ["mixtral", "qwen_moe", "file"])
def test_moe_cp2_pp2_matches_unsplit_model(tmp_path: Path, model: str) -> None:
    # a mixture-of-experts layer's experts run on the rank's own tokens (their call one module of the
    # graph, its inputs and output unwrapped and wrapped again); the routers run on the chunks
    if model != "file":
        pytest.importorskip("transformers")
    path = MODELS.parent / "tests" / "fixtures" / "moe_file.py" if model == "file" else MODELS / "hf" / f"{model}.py"
    plan = plan_with_starts(path, [0, 2 if model == "file" else 3], expert_calls=True, **CP2)
    plan = _context(plan)
    assert plan.world_size == 4 and plan.model.expert_calls and plan.experts
    got, want = _run_and_compare(plan, tmp_path)
    print(model, "cp2 pp2", got.losses, want.losses, got.grad_norms, want.grad_norms)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("model", "dp", "ep", "dp_mode", "starts"),
    [("mixtral", 1, 2, "ddp", [0, 3]), ("qwen_moe", 2, 4, "fsdp", [0]), ("file", 2, 2, "ddp", [0])],
)
def test_cp2_with_expert_parallelism_matches_unsplit_model(
    tmp_path: Path, model: str, dp: int, ep: int, dp_mode: str, starts: list[int]
) -> None:
    # the expert groups are consecutive replicas of the dp x cp: a data-parallel replica's two chunks
    # (ep 2), or every chunk of both replicas (ep 4, FSDP over the ranks holding the same experts); each
    # rank dispatches its own chunk's tokens
    if model != "file":
        pytest.importorskip("transformers")
    path = MODELS.parent / "tests" / "fixtures" / "moe_file.py" if model == "file" else MODELS / "hf" / f"{model}.py"
    plan = plan_with_starts(path, starts, dp=dp * 2, ep=ep, dp_mode=dp_mode, **CP2)
    plan = type(plan).model_validate({**plan.model_dump(), "dp": dp, "cp": 2})
    assert plan.world_size == 4 and plan.replicas == 2 * dp and plan.pp_outer
    got, want = _run_and_compare(plan, tmp_path)
    print(model, "cp2 ep", ep, "dp", dp, got.losses, want.losses, got.grad_norms, want.grad_norms)


@pytest.mark.multiprocess
def test_a_layer_under_cp_saves_what_the_sequence_share_says_on_four_processes() -> None:
    # the model's claim on the runner's own code: under cp 2 x tp 2, sequence parallelism saves a quarter
    # of the layer's sequence share (the chunk is half the sequence, and the tp ranks hold half of it)
    from test_run_tp import spawn_pair

    spawn_pair(_cp_saved_bytes_rank, 4)


def _cp_saved_bytes_rank(rank: int, port: int) -> None:
    from test_run_sp import _saved_bytes
    from test_run_tp import gloo_pair
    from torch.distributed.device_mesh import init_device_mesh

    from planner.capture.load import load_model_file
    from planner.capture.stage import stage_module
    from planner.capture.trace import trace_model
    from planner.costs.tensor_parallel import tensor_parallel_shares
    from planner.run.context_shard import SequenceShards, around_sharded, install
    from planner.run.tensor_shard import shard_stage, tp_styles

    with gloo_pair(rank, port, 4):
        mf = load_model_file(MODELS / "llama.py", "tiny")
        tp_plan = mf.module.tp_plan
        inputs, _ = mf.batch(2)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
        seq = tensor_parallel_shares(trace_model(mf.build(), inputs), inputs, tp_plan)["layers.1"].sequence
        assert seq is not None and seq.activation_bytes > 0
        torch.manual_seed(0)
        whole = torch.randn(2, 32, 64)
        x = whole[:, 16 * mesh["cp"].get_local_rank() :][:, :16].clone().requires_grad_()  # this rank's chunk

        def layer(sequence: bool):  # type: ignore[no-untyped-def]
            torch.manual_seed(0)
            traced = trace_model(mf.build(), inputs)
            k = [b.name for b in traced.blocks].index("layers.1")
            stage = stage_module(traced, k, k + 1)
            shards = SequenceShards(mesh, mesh["tp"], [True]) if sequence else None
            state = install(stage, [stage], mesh["cp"], ([True], [True]), sequence=shards)
            shard_stage(stage, mesh["tp"], tp_plan, sequence=sequence)
            around_sharded(state, [stage.get_submodule(n) for n in tp_styles(stage, tp_plan)])
            return stage, state

        plain, want = _saved_bytes(layer(False)[0], x)
        stage, state = layer(True)
        sequence, got = _saved_bytes(stage, x, state)
        assert plain - sequence == seq.activation_bytes // 4, (plain, sequence, seq.activation_bytes)
        torch.testing.assert_close(got, want)
