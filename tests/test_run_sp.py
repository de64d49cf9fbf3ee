"""Tier 3: sequence parallelism with tensor parallelism (``Plan.sequence_parallel``), real gloo
processes on CPU against the unsplit model: losses and global gradient norms (clipping on) equal
within 1e-4, as tests/test_run_tp.py checks tensor parallelism alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from run_factory import MODELS, plan_with_starts  # noqa: E402
from test_run_tp import _run_and_compare as compare_with_unsplit  # noqa: E402
from test_run_tp import llama_zbv_tp2  # noqa: E402

SP2: dict = dict(schedule="1f1b", n_microbatches=2, optimizer="sgd", lr=0.5, grad_clip=0.5, tp=2)


def _sequence(plan):  # type: ignore[no-untyped-def]
    return plan.model_copy(update={"sequence_parallel": True})


def _run_and_compare(plan, tmp_path: Path):  # type: ignore[no-untyped-def]
    return compare_with_unsplit(plan, tmp_path, save_checkpoints=False)


@pytest.mark.multiprocess
def test_llama_sp_tp2_pp2_matches_unsplit_model(tmp_path: Path) -> None:
    # the hidden state crossing the boundary after block 2 is a sequence shard on both sides
    plan = _sequence(plan_with_starts(MODELS / "llama.py", [0, 3], **SP2))
    got, want = _run_and_compare(plan, tmp_path)
    print("llama sp tp2 pp2", got.losses, want.losses, got.grad_norms, want.grad_norms)


@pytest.mark.multiprocess
@pytest.mark.parametrize("size", ["tiny", "tiny-tied"])
def test_hugging_face_llama_sp_tp2_pp2_matches_unsplit_model(tmp_path: Path, size: str) -> None:
    # a torch.export graph, its sizes baked in: DTensors keep the global shapes the graph was made for;
    # tied, the head is held whole and reads the final norm's shards (its weight's gradient all-reduced)
    pytest.importorskip("transformers")
    plan = _sequence(plan_with_starts(MODELS / "hf" / "llama.py", [0, 3], size=size, **SP2))
    assert plan.model.trace_method == "export"
    got, want = _run_and_compare(plan, tmp_path)
    print("hf llama sp tp2 pp2", got.losses, want.losses, got.grad_norms, want.grad_norms)


@pytest.mark.multiprocess
@pytest.mark.parametrize("recompute", ["full", "selective", "stage"])
def test_recomputed_sp_stages_match_unsplit_model(tmp_path: Path, recompute: str) -> None:
    # a checkpoint region re-runs its forward in backward, outside the stage's forward: under the mode again
    plan = _sequence(plan_with_starts(MODELS / "llama.py", [0, 3], **SP2))
    stages = [s.model_copy(update={"recompute": recompute}) for s in plan.stages]
    plan = plan.model_copy(update={"stages": stages})
    got, want = _run_and_compare(plan, tmp_path)
    print("llama sp recompute", recompute, got.losses, want.losses, got.grad_norms, want.grad_norms)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("dp_mode", "fsdp_units"), [("ddp", "stage"), ("fsdp", "block")])
def test_two_replicas_of_an_sp_tp2_stage_match_one_process(tmp_path: Path, dp_mode: str, fsdp_units: str) -> None:
    plan = plan_with_starts(
        MODELS / "llama.py",
        [0],
        schedule="gpipe",
        n_microbatches=2,
        optimizer="adamw",
        grad_clip=0.5,
        dp=2,
        tp=2,
        dp_mode=dp_mode,
        fsdp_units=fsdp_units,
    )
    got, want = _run_and_compare(_sequence(plan), tmp_path)
    assert got.replicas == 2
    print("llama sp dp2 tp2", dp_mode, got.losses, want.losses, got.grad_norms, want.grad_norms)


@pytest.mark.multiprocess
def test_sp_tp2_zbv_splits_the_backward_and_matches(tmp_path: Path) -> None:
    plan = llama_zbv_tp2()
    got, want = _run_and_compare(_sequence(plan), tmp_path)
    print("llama sp zbv", got.losses, want.losses, got.grad_norms, want.grad_norms)


@pytest.mark.multiprocess
def test_a_layer_saves_what_the_sequence_share_says_on_two_processes() -> None:
    # the model's claim, checked on the runner's own code: with sequence parallelism a llama layer
    # saves (1 - 1/2) of its sequence share's bytes less than without, on each of 2 tp ranks
    from test_run_tp import spawn_pair

    spawn_pair(_saved_bytes_rank)


def _saved_bytes(stage, x, split=None) -> tuple[int, torch.Tensor]:  # type: ignore[no-untyped-def]
    """Bytes autograd keeps of one forward of ``stage`` (parameters aside), and the input's gradient
    of the output's sum. With ``split`` (a ``SequenceSplit``) its own saved-tensor hooks are the
    innermost: their packed values are counted (a kept shard as the shard)."""
    from torch.distributed.tensor import DTensor

    def ptr(t):  # type: ignore[no-untyped-def]
        return (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()

    params = {ptr(p).data_ptr() for p in stage.parameters()}
    seen: dict[int, int] = {}

    def note(t):  # type: ignore[no-untyped-def]
        kept = getattr(t, "shard", t)  # a _Regather keeps its shard
        storage = ptr(kept)
        if storage.data_ptr() not in params:
            seen.setdefault(storage.data_ptr(), storage.nbytes())

    if split is not None:
        pack = split.saved.pack

        def counting(t):  # type: ignore[no-untyped-def]
            packed = pack(t)
            note(packed)
            return packed

        split.saved.pack = counting
        out = stage(x)
    else:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (note(t), t)[1], lambda t: t):
            out = stage(x)
    x.grad = None
    out = out.full_tensor() if isinstance(out, DTensor) else out
    out.pow(2).sum().backward()
    return sum(seen.values()), x.grad.clone()


def _saved_bytes_rank(rank: int, port: int) -> None:
    from test_run_tp import gloo_pair
    from torch.distributed.device_mesh import init_device_mesh

    from planner.capture.load import load_model_file
    from planner.capture.stage import stage_module
    from planner.capture.trace import trace_model
    from planner.costs.tensor_parallel import tensor_parallel_shares
    from planner.run.sequence_shard import install
    from planner.run.tensor_shard import shard_stage, tp_styles

    with gloo_pair(rank, port):
        mf = load_model_file(MODELS / "llama.py", "tiny")
        tp_plan = mf.module.tp_plan
        inputs, _ = mf.batch(2)
        torch.manual_seed(0)
        traced = trace_model(mf.build(), inputs)
        k = [b.name for b in traced.blocks].index("layers.1")
        share = tensor_parallel_shares(traced, inputs, tp_plan)["layers.1"]
        seq = share.sequence
        assert seq is not None and seq.activation_bytes > 0
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        x = torch.randn(2, 32, 64, requires_grad=True)
        whole = stage_module(traced, k, k + 1)
        shard_stage(whole, mesh, tp_plan)
        plain, want = _saved_bytes(whole, x)
        traced = trace_model(mf.build(), inputs)
        split = stage_module(traced, k, k + 1)
        columns = [split.get_submodule(n) for n, s in tp_styles(split, tp_plan).items() if s == "colwise"]
        state = install(split, [split], columns, mesh, [True])
        shard_stage(split, mesh, tp_plan, sequence=True)
        sequence, got = _saved_bytes(split, x, state)
        assert plain - sequence == seq.activation_bytes // 2, (plain, sequence, seq.activation_bytes)
        torch.testing.assert_close(got, want)  # the kept shards gathered again in backward: the same gradient
        # backward all-gathers what the share charges: the two row-wise outputs' gradients, one re-gather
        # per gathered input (q, k, v share one, w1 and w3 another), the stage input's gradient
        from torch.distributed.tensor.debug import CommDebugMode

        out = split(x)
        with CommDebugMode() as comm:
            out.pow(2).sum().backward()
        gathers = sum(n for op, n in comm.get_comm_counts().items() if "all_gather" in str(op))
        assert gathers == share.fwd_allreduces + seq.regathers + 1 == 5, comm.get_comm_counts()


def test_a_model_whose_shards_reach_attention_left_whole_is_refused(tmp_path: Path) -> None:
    # gpt.py splits only its feed-forward: the next layer's attention, whole, would run on sequence
    # shards (it mixes positions); planned, the one line names the block and the operator
    from planner.api import make_plan as plan_model
    from planner.errors import ModelFileError
    from planner.schema.request import PlanRequest

    base = dict(gpus=4, tp=2, batch_size=8, output=tmp_path / "plan.json", progress=False)
    request = PlanRequest.build(model_file=MODELS / "gpt.py", size="tiny", sequence_parallel=True, **base)
    with pytest.raises(ModelFileError, match=r"block layers\.\d+ runs aten\._scaled_dot_product.*token by token"):
        plan_model(request)
    plan = plan_model(PlanRequest.build(model_file=MODELS / "llama.py", size="tiny", sequence_parallel=True, **base))
    assert plan.tp == 2 and plan.sequence_parallel


@pytest.mark.multiprocess
def test_an_sp_checkpoint_resumes_without_tensor_parallelism(tmp_path: Path) -> None:
    # sequence parallelism leaves the parameters as tensor parallelism shards them (norms whole):
    # its checkpoint, keyed by the unsplit model's names, resumes as a plain pp 2 run
    from run_factory import assert_close, saved

    from planner.run import run_plan
    from planner.schema.run_request import RunRequest

    common = dict(schedule="1f1b", n_microbatches=2, optimizer="adamw", grad_clip=0.5)
    split = _sequence(plan_with_starts(MODELS / "llama.py", [0, 3], tp=2, **common))  # type: ignore[arg-type]
    whole = plan_with_starts(MODELS / "llama.py", [0, 3], **common)  # type: ignore[arg-type]
    ckpt, path = tmp_path / "ckpt", saved(split, tmp_path)
    want = run_plan(whole, RunRequest(plan_file=path, steps=4, save_checkpoints=False, echo=False))
    run_plan(split, RunRequest(plan_file=path, steps=2, checkpoint_dir=ckpt, echo=False))
    got = run_plan(whole, RunRequest(plan_file=path, steps=4, checkpoint_dir=ckpt, resume=True, echo=False))
    assert got.first_step == 3
    assert_close(got.losses, want.losses[2:], "loss")
    assert_close(got.grad_norms, want.grad_norms[2:], "grad norm")


def test_a_forward_whose_first_hook_fails_leaves_the_split_usable() -> None:
    # FSDP's gather (a hook before the split's own) raising, an out-of-memory retried: the split's
    # always-called exit hook must not leave, nor the next forward run without, the mode
    import datetime

    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from planner.run.sequence_shard import install
    from planner.run.tensor_shard import shard_stage

    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.LayerNorm(8), nn.Linear(8, 8))
    x = torch.randn(2, 6, 8)
    want = layer(x)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(60))
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        plan = {"0": "colwise", "2": "rowwise", "4": "colwise_rep"}
        split = install(layer, [layer], [layer[0], layer[4]], mesh, [False])
        shard_stage(layer, mesh, plan, sequence=True)
        failures = [RuntimeError("out of memory")]

        def gather(module: nn.Module, args: tuple) -> None:
            if failures:
                raise failures.pop()

        layer.register_forward_pre_hook(gather, prepend=True)
        with pytest.raises(RuntimeError, match="out of memory"):
            layer(x)
        assert split.depth == 0 and split.mode is None and split.saved.saving is None
        got = layer(x)
        assert type(got) is torch.Tensor and torch.allclose(got, want, atol=1e-6)
        got.sum().backward()  # the kept shards gathered again
        assert split.depth == 0 and split.saved.last is None
    finally:
        dist.destroy_process_group()


def test_tp_auto_leaves_sequence_parallelism_out_where_it_cannot_run(tmp_path: Path) -> None:
    from planner.api import make_plan as plan_model
    from planner.schema.request import PlanRequest

    request = PlanRequest.build(
        model_file=MODELS / "gpt.py",
        size="tiny",
        gpus=4,
        gpu_type="h100",  # degrees 1, 2 and 4 tried (this CPU's ranks share its cores: tp 1 only)
        tp="auto",
        batch_size=8,
        sequence_parallel=True,
        output=tmp_path / "plan.json",
        progress=False,
    )
    plan = plan_model(request)
    assert not plan.sequence_parallel
    assert "sequence parallelism: none, block layers.1 runs aten." in plan.choice  # its attention
