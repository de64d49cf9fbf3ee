"""Tier 3: expert parallelism in ``planner run`` (``Plan.ep``): each mixture-of-experts layer's experts
sharded over replicas, real gloo processes on CPU against the unsplit model: losses and global
gradient norms (clipping on) equal within 1e-4; checkpoints keyed by the unsplit names, resumed
under another ``ep``.

Plans are built by the test factory with ``ep`` given, not chosen by the planner.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from run_factory import MODELS, ROOT, assert_resumes_under, plan_with_starts  # noqa: E402
from test_run_tp import _run_and_compare  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "moe_file.py"
EP2: dict = dict(schedule="1f1b", n_microbatches=2, optimizer="sgd", lr=0.5, grad_clip=0.5, dp=2, ep=2)


@pytest.mark.multiprocess
@pytest.mark.parametrize("model", ["mixtral", "qwen_moe", "file"])
def test_ep2_pp2_matches_the_unsplit_model(tmp_path: Path, model: str) -> None:
    # 2 replicas x 2 pipeline ranks: each pipeline rank's experts split over its two replicas, every
    # token sent to its experts' rank and back; a shared expert (Qwen2-MoE) and the routers replicate
    if model != "file":
        pytest.importorskip("transformers")
    path = FIXTURE if model == "file" else MODELS / "hf" / f"{model}.py"
    plan = plan_with_starts(path, [0, 2 if model == "file" else 3], **EP2)  # a layer of experts on each rank
    assert plan.world_size == 4 and len(plan.experts) == 2
    held = [
        [n for n in plan.experts if any(n.startswith(f"{b.name}.") for b in plan.blocks[s.start : s.end])]
        for s in plan.stages
    ]
    assert [len(h) for h in held] == [1, 1], held
    got, want = _run_and_compare(plan, tmp_path, save_checkpoints=False)
    print(model, "ep2 pp2", got.losses, want.losses, got.grad_norms, want.grad_norms)


@pytest.mark.multiprocess
def test_ep2_with_stages_that_recompute_matches_the_unsplit_model(tmp_path: Path) -> None:
    # a checkpointed block's forward runs its all-to-alls again in backward, on every rank of the group
    # in the same order: full checkpointing on one pipeline rank, selective on the other
    pytest.importorskip("transformers")
    plan = plan_with_starts(MODELS / "hf" / "mixtral.py", [0, 3], **EP2)
    stages = [s.model_copy(update={"recompute": m}) for s, m in zip(plan.stages, ("full", "selective"))]
    got, want = _run_and_compare(plan.model_copy(update={"stages": stages}), tmp_path, save_checkpoints=False)
    print("mixtral ep2 pp2 recomputing", got.losses, want.losses, got.grad_norms, want.grad_norms)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("model", "schedule"), [("file", "zbv"), ("mixtral", "dualpipev"), ("qwen_moe", "interleaved-zb")]
)
def test_ep2_under_the_zero_bubble_schedules_matches_the_unsplit_model(
    tmp_path: Path, model: str, schedule: str
) -> None:
    # a two-part backward: each exchange's backward runs with the input gradients, both ranks of the group
    # taking their steps in the same order (2 stages on each of 2 ranks)
    if model != "file":
        pytest.importorskip("transformers")
    path = FIXTURE if model == "file" else MODELS / "hf" / f"{model}.py"
    starts = [0, 1, 2, 3] if model == "file" else [0, 3, 4, 5]
    plan = plan_with_starts(path, starts, **{**EP2, "schedule": schedule, "n_microbatches": 4, "stages_per_rank": 2})
    assert plan.world_size == 4 and plan.stages_per_rank == 2
    if model == "mixtral":  # checkpointed: the input-gradient step recomputes the forward, exchanges and all
        plan = plan.model_copy(update={"stages": [s.model_copy(update={"recompute": "full"}) for s in plan.stages]})
    got, want = _run_and_compare(plan, tmp_path, save_checkpoints=False)
    print(model, schedule, got.losses, want.losses, got.grad_norms, want.grad_norms)


# mixture-of-experts families taken as their config.json gives them (tiny): GPT-OSS's experts carry biases
# (gate_up_proj_bias, down_proj_bias: sharded with their weights by expert) beside attention sinks and
# sliding windows; DeepSeek-V3's first layer is dense, the rest route over groups beside a shared expert,
# under multi-head latent attention
CONFIGS: dict = {
    "gpt_oss": (
        "GptOssConfig",
        dict(intermediate_size=64, num_local_experts=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
        2,
        [0, 3],
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(
            first_k_dense_replace=1,
            n_routed_experts=4,
            n_group=1,
            topk_group=1,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
        ),
        3,
        [0, 4],
    ),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_ep2_on_a_config_json_family_matches_the_unsplit_model(tmp_path: Path, family: str) -> None:
    transformers = pytest.importorskip("transformers")
    cls, options, layers, starts = CONFIGS[family]
    config = getattr(transformers, cls)(
        num_hidden_layers=layers,
        hidden_size=64,
        num_experts_per_tok=2,
        vocab_size=512,
        architectures=[cls.replace("Config", "ForCausalLM")],
        **options,
    )
    config.to_json_file(tmp_path / "config.json")
    plan = plan_with_starts(tmp_path / "config.json", starts, size=None, overrides={"seq_len": 32}, **EP2)
    experts = {f"model.layers.{i}.mlp.experts": 4 for i in range(layers - 2, layers)}
    assert plan.experts == experts and plan.pp_outer  # a layer of experts on each pipeline rank
    got, want = _run_and_compare(plan, tmp_path, save_checkpoints=False)
    print(family, "ep2 pp2", got.losses, want.losses, got.grad_norms, want.grad_norms)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("dp", "starts", "units"),
    [(4, [0], "block"), (4, [0], "stage"), (2, [0, 2], "block"), (2, [0, 2], "stage")],
    ids=["dp4-pp1-block", "dp4-pp1-stage", "dp2-pp2-block", "dp2-pp2-stage"],
)
def test_ep2_under_fsdp_matches_the_unsplit_model(tmp_path: Path, dp: int, starts: list[int], units: str) -> None:
    # the dense weights sharded over all the replicas, each rank's experts over the replicas holding the
    # same ones: 2 of them (dp 4: the expert's rows reduce-scattered and divided by 4, not 2), or 1
    # (dp 2: FSDP's group of one, whose division torch 2.13 would otherwise make twice)
    schedule = "1f1b" if len(starts) > 1 else "gpipe"
    options = {"schedule": schedule, "dp": dp, "dp_mode": "fsdp", "fsdp_units": units}
    plan = plan_with_starts(FIXTURE, starts, **{**EP2, **options, "optimizer": "adamw", "lr": 1e-2, "grad_clip": 0.05})
    got, want = _run_and_compare(plan, tmp_path, save_checkpoints=False)
    print("fsdp ep2", dp, units, got.losses, want.losses, got.grad_norms, want.grad_norms)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("dp", "shard", "starts", "units"),
    [(4, 2, [0], "stage"), (8, 4, [0], "block"), (4, 2, [0, 2], "block")],
    ids=["dp4-groups-of-2-stage", "dp8-groups-of-4-block", "dp4-groups-of-2-pp2-block"],
)
def test_ep2_under_hsdp_matches_the_unsplit_model(
    tmp_path: Path, dp: int, shard: int, starts: list[int], units: str
) -> None:
    # an expert group (2 replicas) inside each shard group: a rank's experts sharded over the shard / 2
    # replicas of its group holding them (a group of one at shard 2, whose division torch 2.13 would
    # make twice on gloo; of two at shard 4), then all-reduced over the groups, the rest over the shard
    # group; up to 8 gloo ranks
    schedule = "1f1b" if len(starts) > 1 else "gpipe"
    options = {"schedule": schedule, "dp": dp, "dp_mode": "hsdp", "dp_shard": shard, "fsdp_units": units}
    plan = plan_with_starts(
        FIXTURE, starts, **{**EP2, **options, "batch_size": 16, "optimizer": "adamw", "lr": 1e-2, "grad_clip": 0.05}
    )
    got, want = _run_and_compare(plan, tmp_path, save_checkpoints=False)
    print("hsdp ep2", dp, shard, units, got.losses, want.losses, got.grad_norms, want.grad_norms)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("starts", "options"),
    [
        ([0], {"dp_mode": "ddp"}),
        ([0], {"dp_mode": "fsdp"}),
        ([0, 3], {"dp_mode": "ddp", "schedule": "1f1b"}),
        ([0], {"dp": 4, "batch_size": 16, "dp_mode": "hsdp", "dp_shard": 2, "fsdp_units": "block"}),
        ([0], {"dp_mode": "ddp", "ep": 4}),
        ([0], {"dp_mode": "fsdp", "ep": 4, "fsdp_units": "block"}),
        ([0], {"dp": 4, "batch_size": 16, "dp_mode": "hsdp", "dp_shard": 2, "ep": 4}),
        ([0, 3], {"dp": 1, "schedule": "1f1b"}),
    ],
    ids=["ddp", "fsdp", "ddp-pp2", "hsdp", "ddp-ep4", "fsdp-ep4", "hsdp-ep4", "one-replica-pp2"],
)
def test_mixtral_ep_over_tp2_matches_the_unsplit_model(tmp_path: Path, starts: list[int], options: dict) -> None:
    # the attention split over 2 tensor-parallel ranks, each expert group spanning them (ep 2: one
    # replica's two; ep 4: two replicas'; with one replica, the pipeline's): each tensor-parallel rank
    # routes its half of its replica's tokens and gathers the other's results (4-8 ranks)
    pytest.importorskip("transformers")
    plan = plan_with_starts(MODELS / "hf" / "mixtral.py", starts, **{**EP2, "schedule": "gpipe", "tp": 2, **options})
    assert plan.tp == 2 and plan.ep == options.get("ep", 2) and plan.pp_outer
    assert plan.ep_replicas == plan.ep // 2
    got, want = _run_and_compare(plan, tmp_path, save_checkpoints=False)
    print("mixtral tp2 ep", options, got.losses, want.losses, got.grad_norms, want.grad_norms)


@pytest.mark.multiprocess
def test_a_checkpoint_of_tp2_fsdp_ep4_resumes_on_a_pipeline_without_tp(tmp_path: Path) -> None:
    # written by expert groups over 2 replicas x 2 tensor-parallel ranks, read by groups of 2 replicas
    pytest.importorskip("transformers")
    common = {**EP2, "optimizer": "adamw", "lr": 1e-2, "dp_mode": "fsdp"}
    writer = plan_with_starts(MODELS / "hf" / "mixtral.py", [0], **{**common, "schedule": "gpipe", "tp": 2, "ep": 4})
    reader = plan_with_starts(MODELS / "hf" / "mixtral.py", [0, 3], **common)
    assert_resumes_under(writer, reader, tmp_path)


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_compiled_stages_with_ep2_match_the_unsplit_model(tmp_path: Path, mode: str) -> None:
    # torch.compile takes each stage; the exchanges run eagerly inside it (their sizes are the router's
    # counts: ExpertDispatch.forward is excluded from compilation)
    plan = plan_with_starts(FIXTURE, [0, 2], **{**EP2, "dp_mode": mode}).model_copy(update={"compile": True})
    got, want = _run_and_compare(plan, tmp_path, save_checkpoints=False)
    print("compiled ep2", mode, got.losses, want.losses, got.grad_norms, want.grad_norms)


@pytest.mark.multiprocess
def test_mixtral_ep2_under_fsdp_block_units_matches_the_unsplit_model(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    plan = plan_with_starts(MODELS / "hf" / "mixtral.py", [0, 3], **{**EP2, "dp_mode": "fsdp", "fsdp_units": "block"})
    got, want = _run_and_compare(plan, tmp_path, save_checkpoints=False)
    print("mixtral fsdp ep2", got.losses, want.losses, got.grad_norms, want.grad_norms)


@pytest.mark.multiprocess
@pytest.mark.parametrize("direction", ["fsdp-ep2-to-ddp-ep1", "ddp-ep1-to-fsdp-ep2", "hsdp-ep2-to-ddp-ep1"])
def test_a_checkpoint_resumes_between_fsdp_expert_shards_and_whole_experts(tmp_path: Path, direction: str) -> None:
    # under FSDP an expert parameter's shard is a piece of the (ep, edp) mesh's whole-layer tensor;
    # under HSDP of the (ep, dp_replicate, edp_shard) mesh's, replicated over the groups
    common = {**EP2, "schedule": "gpipe", "dp": 4, "optimizer": "adamw", "lr": 1e-2}
    mode = {"dp_mode": "fsdp"} if "fsdp" in direction else {"dp": 8, "batch_size": 16, "dp_mode": "hsdp", "dp_shard": 4}
    sharded = plan_with_starts(FIXTURE, [0], **{**common, **mode, "fsdp_units": "block"})
    whole = plan_with_starts(FIXTURE, [0], **{**common, "batch_size": sharded.batch_size, "ep": 1})
    writer, reader = (whole, sharded) if direction.startswith("ddp") else (sharded, whole)
    assert_resumes_under(writer, reader, tmp_path)


def _chunks(checkpoint: Path, key: str) -> int:
    """How many pieces a checkpoint stores a tensor in (torch.distributed.checkpoint's metadata)."""
    import torch.distributed.checkpoint as dcp

    return len(dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata[key].chunks)


@pytest.mark.multiprocess
@pytest.mark.parametrize("direction", ["ep2-to-ep1", "ep1-to-ep2"])
def test_a_checkpoint_keyed_by_the_unsplit_names_resumes_across_a_change_of_ep(tmp_path: Path, direction: str) -> None:
    # the experts are saved as the whole layer's tensor, each expert once (a piece per expert-parallel
    # rank: the other group's copies are the same pieces), so a run of another ep reads its share back
    sharded = plan_with_starts(FIXTURE, [0, 2], **{**EP2, "optimizer": "adamw", "lr": 1e-2})
    whole = plan_with_starts(FIXTURE, [0, 2], **{**EP2, "optimizer": "adamw", "lr": 1e-2, "ep": 1})
    writer, reader = (sharded, whole) if direction == "ep2-to-ep1" else (whole, sharded)
    assert_resumes_under(writer, reader, tmp_path)
    last = max((tmp_path / "ckpt").glob("step_*"))  # the reader's, after its resumed steps
    name = "layers.0.moe.experts.w_in"
    assert _chunks(last, f"model.{name}") == _chunks(last, f"optim.{name}.exp_avg") == (2 if reader.ep == 2 else 1)


def test_what_the_runner_does_not_run_with_ep_is_refused_before_any_process(tmp_path: Path) -> None:
    from planner.errors import PlanFileError
    from planner.run.model import check_runnable

    pytest.importorskip("transformers")
    plan = plan_with_starts(MODELS / "hf" / "mixtral.py", [0], **{**EP2, "schedule": "gpipe", "tp": 2})
    plan = plan.model_copy(update={"sequence_parallel": True})
    with pytest.raises(
        PlanFileError, match=r"the plan cannot run: --ep 2: expert parallelism does not run with sequence"
    ):
        check_runnable(plan)


@pytest.mark.multiprocess
def test_planner_plan_ep_then_run_trains_like_the_unsplit_model(tmp_path: Path) -> None:
    # measured here: the plan's trace records the experts' calls as the run's does (the fingerprints agree)
    pytest.importorskip("transformers")
    from planner.api import make_plan
    from planner.schema.request import PlanRequest

    request = PlanRequest.build(
        model_file=MODELS / "hf" / "qwen_moe.py",
        size="tiny",
        gpus=4,
        dp=2,
        ep=2,
        batch_size=8,
        optimizer={"name": "sgd", "lr": 0.5, "grad_clip": 0.5},
        output=tmp_path / "plan.json",
        progress=False,
    )
    plan = make_plan(request)
    assert plan.ep == 2 and plan.n_ranks == 2
    _run_and_compare(plan, tmp_path, steps=2, save_checkpoints=False)


@pytest.mark.multiprocess
def test_planner_plan_fsdp_with_ep_then_run_trains_like_the_unsplit_model(tmp_path: Path) -> None:
    from planner.api import make_plan
    from planner.schema.request import PlanRequest

    request = PlanRequest.build(
        model_file=FIXTURE,
        gpus=4,
        dp=4,
        ep=2,
        dp_mode="fsdp",
        batch_size=8,
        optimizer={"name": "adamw", "lr": 1e-2, "grad_clip": 0.05},
        output=tmp_path / "plan.json",
        progress=False,
    )
    plan = make_plan(request)
    assert (plan.dp, plan.ep, plan.dp_mode, plan.n_ranks) == (4, 2, "fsdp", 1)
    _run_and_compare(plan, tmp_path, steps=2, save_checkpoints=False)


@pytest.mark.multiprocess
def test_a_plan_of_ep_auto_runs_whatever_ep_it_chose(tmp_path: Path) -> None:
    # the planner's trace recorded the experts' calls (ModelRef.expert_calls), so the run's trace does
    # too and the fingerprints agree, also where the search kept the experts whole
    from planner.api import make_plan
    from planner.schema.request import PlanRequest

    request = PlanRequest.build(
        model_file=FIXTURE,
        gpus=2,
        dp=2,
        ep="auto",
        batch_size=8,
        optimizer={"name": "sgd", "lr": 0.5, "grad_clip": 0.1},
        output=tmp_path / "plan.json",
        progress=False,
    )
    plan = make_plan(request)
    assert plan.model.expert_calls and "expert-parallel degree" in plan.choice
    _run_and_compare(plan, tmp_path, steps=2, save_checkpoints=False)


def test_the_launch_line_names_the_expert_groups() -> None:
    from planner.run.launch import launch_line

    plan = plan_with_starts(FIXTURE, [0, 2], **EP2)
    assert "2 microbatches, experts sharded over 2 ranks, backend gloo" in launch_line(plan, 4)
    assert "experts" not in launch_line(plan_with_starts(FIXTURE, [0, 2], **{**EP2, "ep": 1}), 4)


@pytest.mark.multiprocess
def test_qwen_moe_ep_over_tp2_with_its_shared_expert_matches_the_unsplit_model(tmp_path: Path) -> None:
    # the gated shared expert (every token, whole on each rank: transformers' plan leaves it so) beside the
    # routed experts, whose group spans the 2 tensor-parallel ranks: each routes half the tokens (4 ranks)
    pytest.importorskip("transformers")
    plan = plan_with_starts(MODELS / "hf" / "qwen_moe.py", [0], **{**EP2, "schedule": "gpipe", "tp": 2})
    assert plan.tp == 2 and plan.ep == 2 and plan.ep_replicas == 1
    got, want = _run_and_compare(plan, tmp_path, save_checkpoints=False)
    print("qwen-moe tp2 ep2", got.losses, want.losses, got.grad_norms, want.grad_norms)
