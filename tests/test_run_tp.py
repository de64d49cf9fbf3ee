"""Tier 3: tensor parallelism inside pipeline stages (``Plan.tp``, ``tp_plan``), real gloo processes
on CPU against the unsplit model: losses and global gradient norms (clipping on) equal within 1e-4.

Plans are built by the test factory with ``tp`` and ``tp_plan`` given, not chosen by the planner.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from run_factory import MODELS, assert_close, plan_with_starts, saved  # noqa: E402

from planner.run import run_plan, train_reference  # noqa: E402
from planner.schema.run_request import RunRequest  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures"


# two pipeline ranks of two tensor-parallel ranks, a learning rate and clipping that show any difference
TP2_1F1B: dict = dict(schedule="1f1b", n_microbatches=2, optimizer="sgd", lr=0.5, grad_clip=0.5, tp=2)


def _run_and_compare(plan, tmp_path: Path, steps: int = 3, **request: object):  # type: ignore[no-untyped-def]
    path = saved(plan, tmp_path)
    got = run_plan(plan, RunRequest(plan_file=path, steps=steps, echo=False, **request))  # type: ignore[arg-type]
    want = train_reference(plan, path, steps)
    assert_close(got.losses, want.losses, "loss")
    assert_close(got.grad_norms, want.grad_norms, "grad norm")
    clip = plan.optimizer.grad_clip
    assert clip is not None and all(g > clip for g in got.grad_norms), "clipping never happened"
    return got, want


@pytest.mark.multiprocess
@pytest.mark.parametrize("cut_share", [2, 1], ids=["scattered", "whole"])
def test_llama_tp2_pp2_matches_unsplit_model(tmp_path: Path, cut_share: int) -> None:
    # scattered: each tp rank sends half of the boundary and the receivers all-gather (run.boundary);
    # whole: a plan made before scattering, every tp rank sends all of it
    plan = plan_with_starts(MODELS / "llama.py", [0, 3], **TP2_1F1B, cut_share=cut_share)
    assert plan.world_size == 4
    got, want = _run_and_compare(plan, tmp_path, save_checkpoints=False)
    assert [s.stage for s in got.stages] == [0, 1]  # one tp rank per pipeline rank reports
    print("llama tp2 pp2", cut_share, got.losses, want.losses, got.grad_norms, want.grad_norms)


@pytest.mark.multiprocess
def test_llama_reference_attention_code_tp2_pp2_matches_unsplit_model(tmp_path: Path) -> None:
    # attention_code="reference": the complex RoPE and repeat_kv on each rank's local heads (1 kv head
    # of tiny's 2 per tensor-parallel rank, copied to its 2 query heads)
    plan = plan_with_starts(MODELS / "llama.py", [0, 3], **TP2_1F1B, overrides={"attention_code": "reference"})
    assert plan.model.config["attention_code"] == "reference"
    got, want = _run_and_compare(plan, tmp_path, save_checkpoints=False)
    print("llama reference code tp2 pp2", got.losses, want.losses)


def llama_zbv_tp2():  # type: ignore[no-untyped-def]
    """Llama tiny on 2 pipeline ranks in a V (zbv, 4 stages), each split over 2 tensor-parallel ranks."""
    return plan_with_starts(
        MODELS / "llama.py",
        [0, 2, 3, 5],
        schedule="zbv",
        stages_per_rank=2,
        n_microbatches=4,
        optimizer="sgd",
        lr=0.5,
        grad_clip=0.5,
        tp=2,
    )


@pytest.mark.multiprocess
def test_llama_tp2_zbv_scatters_between_ranks_and_hands_over_inside_one(tmp_path: Path) -> None:
    # V placement on 2 pipeline ranks: stages 1 and 2 share rank 1 (handed over whole in memory), the
    # other boundaries cross ranks as 1/2 pieces; the two-part backward's input gradient passes the scatter
    plan = llama_zbv_tp2()
    assert plan.world_size == 4
    got, want = _run_and_compare(plan, tmp_path, save_checkpoints=False)
    print("llama tp2 zbv", got.losses, want.losses, got.grad_norms, want.grad_norms)


def test_boundary_scatter_pieces_only_what_crosses_ranks_and_divides() -> None:
    from planner.run.boundary import boundary_scatter, sent_examples

    plan = plan_with_starts(
        MODELS / "llama.py", [0, 2, 3, 5], schedule="zbv", stages_per_rank=2, n_microbatches=4, tp=2
    )
    hidden = torch.randn(2, 16, 64, requires_grad=True)
    odd = torch.zeros(3, dtype=torch.long)  # 3 elements: two ranks cannot split them
    first, second, third, last = plan.stages
    one = boundary_scatter(plan, first, (odd,), (hidden, odd), "group", 1)
    assert one is not None and (one.tp, one.index, one.gather_in, one.scatter_out) == (2, 1, (None,), (True, False))
    ins, outs = sent_examples(one, (odd,), (hidden, odd))
    assert ins == (odd,) and outs[1] is odd
    assert outs[0].shape == (2 * 16 * 64 // 2,) and outs[0].requires_grad and outs[0].dtype == hidden.dtype
    # stage 1 -> 2 stays on rank 1 (the turn of the V): stage 1 only gathers, stage 2 only scatters
    two = boundary_scatter(plan, second, (hidden,), (hidden,), "group", 0)
    assert two is not None and (two.gather_in, two.scatter_out) == ((hidden.shape,), (False,))
    three = boundary_scatter(plan, third, (hidden,), (hidden,), "group", 0)
    assert three is not None and (three.gather_in, three.scatter_out) == ((None,), (True,))
    four = boundary_scatter(plan, last, (hidden,), (torch.zeros(()),), "group", 0)
    assert four is not None and (four.gather_in, four.scatter_out) == ((hidden.shape,), (False,))
    # a plan made before scattering (cut_share 1), or without tensor parallelism, sends everything whole
    old = plan_with_starts(MODELS / "llama.py", [0, 3], schedule="1f1b", n_microbatches=2, tp=2, cut_share=1)
    assert boundary_scatter(old, old.stages[0], (odd,), (hidden,), "group", 0) is None
    flat = plan_with_starts(MODELS / "llama.py", [0, 3], schedule="1f1b", n_microbatches=2)
    assert boundary_scatter(flat, flat.stages[1], (hidden,), (hidden,), None, 0) is None


@pytest.mark.multiprocess
def test_scatter_and_gather_are_exact_both_ways_on_two_processes() -> None:
    spawn_pair(_scatter_gather_rank)


def spawn_pair(fn: Callable[[int, int], None], n: int = 2) -> None:
    """Run ``fn(rank, port)`` in ``n`` spawned processes (two by default) over a TCPStore this process
    serves at ``port``.

    The server lives here, as ``planner run``'s launcher holds its ranks' store, until every rank
    has exited: a rank that served the store took it down while its peer's store client and gloo
    threads still ran. The server also picks its own free port, so no probe port can be taken by
    another test between the probe and the bind. Each rank ends as ``spawned`` ends it.
    """
    import datetime

    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    try:
        spawned(fn, (server.port,), n)
    finally:
        del server


def spawned(fn: Callable[..., None], args: tuple, n: int) -> None:
    """``torch.multiprocessing.spawn(fn, args, n)``, each process leaving by ``os._exit(0)`` once
    ``fn`` has returned (a failure still raises here with its traceback).

    Why not the interpreter's own exit: a gloo worker thread that has just finished a collective
    drops its tensors after the caller has its result; where the rank's last collective is its last
    step, a loaded machine can reach interpreter finalization first, and a thread taking the GIL
    then is ended by ``pthread_exit``, which C++ turns into ``terminate called without an active
    exception`` (SIGABRT) although every check passed. CI met it three times in these tests;
    ``_exit`` after a flush leaves nothing to finalize. (torch's attempt at an exit-time destroy,
    pytorch/pytorch#179291, was abandoned.)
    """
    import torch.multiprocessing as mp

    mp.spawn(_then_exit, args=(fn, args), nprocs=n, join=True)


def _then_exit(rank: int, fn: Callable[..., None], args: tuple) -> None:
    import os
    import sys

    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextmanager
def gloo_pair(rank: int, port: int, n: int = 2) -> Iterator[None]:
    """One of ``n`` gloo processes (``spawn_pair``): one thread, a process group over the parent's
    TCPStore at ``port``, left before the process ends."""
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, n, False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=n)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _scatter_gather_rank(rank: int, port: int) -> None:
    import torch.distributed as dist

    from planner.run.boundary import BoundaryScatter

    with gloo_pair(rank, port):
        torch.manual_seed(0)  # both ranks hold the same whole tensor, as tensor-parallel ranks do
        x = torch.randn(3, 4, requires_grad=True)
        w = torch.randn(3, 4)
        send = BoundaryScatter(dist.group.WORLD, 2, rank, (), (True,))
        piece = send.scatter(x)
        assert isinstance(piece, torch.Tensor) and piece.shape == (6,)
        assert torch.equal(piece, x.detach().reshape(-1)[6 * rank : 6 * rank + 6])
        recv = BoundaryScatter(dist.group.WORLD, 2, rank, (x.shape,), ())
        (whole,) = recv.gather((piece.detach().requires_grad_(),))
        assert torch.equal(whole, x.detach())
        # the gradient: the receiver's pieces of a gradient both ranks share, gathered by the sender
        (received,) = recv.gather((piece,))
        (received * w).sum().backward()
        assert x.grad is not None and torch.equal(x.grad, w)  # not summed over the two ranks


@pytest.mark.multiprocess
def test_a_gathered_head_of_uneven_rows_is_exact_on_two_processes() -> None:
    spawn_pair(_gathered_head_rank)


def _gathered_head_rank(rank: int, port: int) -> None:
    """colwise_rep over 2 ranks of a head with 5 output rows (3 and 2): the whole logits on both ranks,
    the input's and the weight's gradients those of the unsplit head."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from planner.run.tensor_shard import shard_stage, sharded_over_tp

    with gloo_pair(rank, port):
        torch.manual_seed(0)
        stage = nn.ModuleDict({"norm": nn.LayerNorm(8), "head": nn.Linear(8, 5, bias=True)})
        whole = nn.ModuleDict({"norm": nn.LayerNorm(8), "head": nn.Linear(8, 5, bias=True)})
        whole.load_state_dict(stage.state_dict())
        x = torch.randn(3, 4, 8)
        x_whole = x.clone().requires_grad_()
        x.requires_grad_()
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        assert shard_stage(stage, mesh, {"head": "colwise_rep"}) == {"head": "colwise_rep"}
        got = stage["head"](stage["norm"](x))
        want = whole["head"](whole["norm"](x_whole))
        assert type(got) is torch.Tensor and got.shape == (3, 4, 5) and torch.allclose(got, want, atol=1e-6)
        weight = stage["head"].weight
        assert sharded_over_tp(weight) and weight.to_local().shape == ((3, 8) if rank == 0 else (2, 8))
        got.square().sum().backward()
        want.square().sum().backward()
        assert x.grad is not None and x_whole.grad is not None and torch.allclose(x.grad, x_whole.grad, atol=1e-6)
        assert weight.grad is not None and whole["head"].weight.grad is not None
        assert torch.allclose(weight.grad.full_tensor(), whole["head"].weight.grad, atol=1e-6)


def test_an_embedding_width_the_degree_does_not_divide_is_refused_before_launch() -> None:
    from torch import nn

    from planner.errors import PlanFileError
    from planner.run.tensor_shard import check_tp_split

    stage = nn.ModuleDict({"emb": nn.Embedding(10, 6)})  # 10 rows: uneven rows alone would not matter
    assert check_tp_split(stage, {"emb": "colwise_rep"}, 3) == {"emb": "colwise_rep"}
    with pytest.raises(PlanFileError, match=r"splits emb colwise_rep over 4 ranks, but its embedding width 6 is"):
        check_tp_split(stage, {"emb": "colwise_rep"}, 4)


@pytest.mark.multiprocess
def test_an_embedding_split_by_width_is_exact_on_two_processes() -> None:
    spawn_pair(_embedding_rank)


def _embedding_rank(rank: int, port: int) -> None:
    """colwise_rep on an nn.Embedding over 2 ranks: each holds half of every vector, the lookups are
    the unsplit embedding's on both ranks, the weight's gradient its gradient. And why the planner
    splits the width even where a plan says embedding_rowwise: torch 2.13's RowwiseParallel on an
    embedding gives tp times the lookups (if this part fails, torch has fixed it and the vocabulary
    split could be run as declared)."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    from planner.run.tensor_shard import check_tp_split, shard_stage, sharded_over_tp

    with gloo_pair(rank, port):
        torch.manual_seed(0)
        stage = nn.ModuleDict({"emb": nn.Embedding(16, 8), "norm": nn.LayerNorm(8)})
        whole = nn.ModuleDict({"emb": nn.Embedding(16, 8), "norm": nn.LayerNorm(8)})
        whole.load_state_dict(stage.state_dict())
        ids = torch.tensor([[1, 9, 3, 12], [0, 15, 7, 8]])
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        assert check_tp_split(stage, {"emb": "colwise_rep"}, 2) == {"emb": "colwise_rep"}
        assert shard_stage(stage, mesh, {"emb": "colwise_rep"}) == {"emb": "colwise_rep"}
        got = stage["norm"](stage["emb"](ids))
        want = whole["norm"](whole["emb"](ids))
        assert type(got) is torch.Tensor and torch.allclose(got, want, atol=1e-6)
        weight = stage["emb"].weight
        assert sharded_over_tp(weight) and weight.to_local().shape == (16, 4)
        got.square().sum().backward()
        want.square().sum().backward()
        assert weight.grad is not None and whole["emb"].weight.grad is not None
        assert torch.allclose(weight.grad.full_tensor(), whole["emb"].weight.grad, atol=1e-6)
        rows = nn.Embedding(16, 8)
        rows.load_state_dict(whole["emb"].state_dict())
        parallelize_module(rows, mesh, RowwiseParallel())
        try:  # torch 2.13: the lookups summed twice over, or (these ids) a size mismatch inside its op
            wrong = not torch.allclose(rows(ids), whole["emb"](ids), atol=1e-6)
        except RuntimeError:
            wrong = True
        assert wrong


@pytest.mark.multiprocess
def test_tied_embedding_and_head_across_pipeline_ranks_tp2(tmp_path: Path) -> None:
    # stage 0: the embedding; stage 1: both layers (split colwise then rowwise) and the head tied to it
    tp_plan = {"layers.0": "colwise", "layers.1": "rowwise"}
    plan = plan_with_starts(
        FIXTURES / "tied.py", [0, 1], schedule="gpipe", optimizer="sgd", lr=0.5, grad_clip=0.05, tp=2, tp_plan=tp_plan
    )
    assert len(plan.ties) == 1
    got, want = _run_and_compare(plan, tmp_path, save_checkpoints=False)
    print("tied tp2 pp2", got.losses, want.losses, got.grad_norms, want.grad_norms)


def _dp2_tp2(dp_mode: str, fsdp_units: str, model: Path = MODELS / "llama.py"):  # type: ignore[no-untyped-def]
    """``model`` (Llama tiny) as one pipeline rank split over 2 tensor-parallel ranks, 2 replicas of it."""
    return plan_with_starts(
        model,
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


@pytest.mark.multiprocess
@pytest.mark.parametrize(("dp_mode", "fsdp_units"), [("ddp", "stage"), ("fsdp", "stage"), ("fsdp", "block")])
def test_two_replicas_of_a_tp2_stage_match_one_process(tmp_path: Path, dp_mode: str, fsdp_units: str) -> None:
    # ddp: averaged by the gradient finisher (DDP does not reduce DTensors); fsdp: 2-D (dp, tp) DTensors,
    # the stage one FSDP unit or every block its own
    plan = _dp2_tp2(dp_mode, fsdp_units)
    assert (plan.dp, plan.n_ranks, plan.tp, plan.world_size) == (2, 1, 2, 4)
    got, want = _run_and_compare(plan, tmp_path, save_checkpoints=False)
    assert got.replicas == 2
    print("llama dp2 tp2", dp_mode, got.losses, want.losses, got.grad_norms, want.grad_norms)


@pytest.mark.multiprocess
def test_bf16_fsdp_over_tp2_stages_gathers_bf16_dtensors_and_matches_its_reference(tmp_path: Path) -> None:
    # FSDP's mixed precision (bf16 gathers, fp32 reduce-scatter: run.wrappers.fsdp_policy) on 2-D
    # (dp, tp) DTensors, block units; the reference computes with bf16 weights and fp32 gradient sums
    plan = _dp2_tp2("fsdp", "block")
    plan = plan.model_copy(update={"profile": plan.profile.model_copy(update={"autocast": "bf16"})})
    got, want = _run_and_compare(plan, tmp_path, save_checkpoints=False)
    # measured: within 6e-5 of that reference, and about 1.4e-3 apart from fp32 weights under autocast
    # (the same plan under DDP) by step 3: the reference the run matches is the one computing as it does
    ddp = train_reference(plan.model_copy(update={"dp_mode": "ddp"}), saved(plan, tmp_path), 3)
    assert got.grad_norms[-1] != pytest.approx(ddp.grad_norms[-1], rel=5e-4)


@pytest.mark.multiprocess
def test_a_tp2_pp2_checkpoint_resumes_as_pp2_and_exports_full_weights(tmp_path: Path) -> None:
    from planner.run.checkpoint import save_weights, step_dir

    # a vocabulary of 511: the head (colwise_rep) is split unevenly, 256 and 255 rows, as DTensor shards it
    common = dict(schedule="1f1b", n_microbatches=2, optimizer="adamw", grad_clip=0.5, overrides={"vocab_size": 511})
    tp_plan = plan_with_starts(MODELS / "llama.py", [0, 3], tp=2, **common)  # type: ignore[arg-type]
    pp_plan = plan_with_starts(MODELS / "llama.py", [0, 3], **common)  # type: ignore[arg-type]
    ckpt = tmp_path / "ckpt"
    tp_path = saved(tp_plan, tmp_path)
    whole = run_plan(pp_plan, RunRequest(plan_file=tp_path, steps=4, save_checkpoints=False, echo=False))
    run_plan(tp_plan, RunRequest(plan_file=tp_path, steps=2, checkpoint_dir=ckpt, echo=False))
    # the checkpoint holds full tensors under the unsplit names: they load into the unsplit model
    used, step, _ = save_weights(tp_path, step_dir(ckpt, 2), tmp_path / "model.pt")
    state = torch.load(tmp_path / "model.pt")
    assert step == 2 and state["layers.0.attention.wq.weight"].shape == (64, 64)
    assert state["output.weight"].shape == (511, 64)
    # resumed without tensor parallelism, from the sharded checkpoint, it continues the same run
    resumed = run_plan(pp_plan, RunRequest(plan_file=tp_path, steps=4, checkpoint_dir=ckpt, resume=True, echo=False))
    assert resumed.first_step == 3
    assert_close(resumed.losses, whole.losses[2:], "loss")
    assert_close(resumed.grad_norms, whole.grad_norms[2:], "grad norm")
    print("resume tp2pp2 -> pp2", resumed.losses, whole.losses[2:], resumed.grad_norms, whole.grad_norms[2:])


@pytest.mark.multiprocess
def test_hugging_face_llama_tp2_pp2_matches_unsplit_model(tmp_path: Path) -> None:
    # traced by torch.export: its stages are cut from the graph exported again at one tp rank's sizes
    # (grouped-query attention expands a constant number of key/value heads), the linear calls made
    # modules for torch's styles; the config's own tensor-parallel plan (base_model_tp_plan); the input
    # embedding tied to the head across the two pipeline ranks
    pytest.importorskip("transformers")
    plan = plan_with_starts(MODELS / "hf" / "llama.py", [0, 3], size="tiny-tied", **TP2_1F1B)
    assert plan.model.trace_method == "export" and plan.world_size == 4
    assert plan.tp_plan["model.layers.*.self_attn.k_proj"] == "colwise" and len(plan.ties) == 1
    got, want = _run_and_compare(plan, tmp_path, save_checkpoints=False)
    print("hf llama tp2 pp2", got.losses, want.losses, got.grad_norms, want.grad_norms)


@pytest.mark.multiprocess
def test_hugging_face_llama_with_its_head_split_tp2_pp2_matches_unsplit_model(tmp_path: Path) -> None:
    # untied: the model's own _tp_plan splits lm_head too (colwise_gather_output, read as colwise_rep):
    # in the export graph its call is made a module at full size (its logits are gathered whole)
    pytest.importorskip("transformers")
    plan = plan_with_starts(MODELS / "hf" / "llama.py", [0, 3], size="tiny", **TP2_1F1B)
    assert plan.tp_plan["lm_head"] == "colwise_rep" and not plan.ties
    got, want = _run_and_compare(plan, tmp_path, save_checkpoints=False)
    print("hf llama head split tp2 pp2", got.losses, want.losses, got.grad_norms, want.grad_norms)


@pytest.mark.multiprocess
@pytest.mark.parametrize("model", ["mixtral.py", "qwen_moe.py"])
def test_a_mixture_of_experts_model_tp2_pp2_splits_attention_keeps_experts_whole_and_matches(
    tmp_path: Path, model: str
) -> None:
    # transformers 5 styles the experts' grouped weights "packed_colwise" / "rowwise" and the module
    # "moe_tp_experts", which torch's styles cannot split: those entries are dropped, the attention (and
    # Qwen2-MoE's ... nothing else: its dense-MLP patterns match no layer of an all-experts config) splits
    pytest.importorskip("transformers")
    plan = plan_with_starts(MODELS / "hf" / model, [0, 2], size="tiny", **TP2_1F1B)
    assert plan.tp_plan["model.layers.*.self_attn.o_proj"] == "rowwise"
    assert not any("experts" in k or "mlp" in k for k in plan.tp_plan), plan.tp_plan
    assert plan.experts == {f"model.layers.{i}.mlp.experts": 4 if model == "mixtral.py" else 8 for i in range(2)}
    got, want = _run_and_compare(plan, tmp_path, save_checkpoints=False)
    print(model, "tp2 pp2", got.losses, want.losses, got.grad_norms, want.grad_norms)


def test_an_export_graph_that_bakes_full_widths_is_refused_before_launch(tmp_path: Path) -> None:
    # a model whose forward reshapes with its full head count cannot run one tp rank's shards: one line
    pytest.importorskip("transformers")
    from planner.errors import PlanFileError

    hf_plan = {"model.layers.*.mlp.gate_proj": "colwise"}  # gate split, up whole: silu(gate) * up cannot multiply
    plan = plan_with_starts(MODELS / "hf" / "llama.py", [0, 4], n_microbatches=2, tp=2, tp_plan=hf_plan)
    assert plan.model.trace_method == "export"
    with pytest.raises(PlanFileError, match="does not trace with its tp_plan layers split 2 ways"):
        run_plan(plan, RunRequest(plan_file=saved(plan, tmp_path), steps=1, echo=False))


def test_tp_plan_patterns_match_one_name_part_per_star() -> None:
    from torch import nn

    from planner.capture.tp_plan import match
    from planner.errors import PlanFileError
    from planner.run.tensor_shard import check_tp_split, tp_styles

    assert match("layers.*.attention.wq", "layers.0.attention.wq")
    assert not match("layers.*.attention.wq", "layers.0.1.attention.wq")
    assert not match("layers.*.attention.wq", "model.layers.0.attention.wq")
    model = nn.Sequential()
    model.add_module("up", nn.Linear(4, 6))
    model.add_module("down", nn.Linear(6, 4))
    assert tp_styles(model, {"up": "colwise", "down": "rowwise"}) == {"up": "colwise", "down": "rowwise"}
    assert check_tp_split(model, {"up": "colwise", "down": "rowwise"}, 2)
    with pytest.raises(PlanFileError, match="output width 6 is not a multiple of 4"):
        check_tp_split(model, {"up": "colwise"}, 4)
    with pytest.raises(PlanFileError, match="style 'diagonal'"):
        tp_styles(model, {"up": "diagonal"})


def test_sharding_on_a_one_rank_mesh_keeps_the_stage_exact(tmp_path: Path) -> None:
    import datetime

    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from planner.run.tensor_shard import norm_counted, shard_stage, sharded_over_tp

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4), nn.LayerNorm(4))
    x = torch.randn(3, 4)
    want = model(x)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(60))
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        assert shard_stage(model, mesh, {"0": "colwise", "2": "rowwise"}) == {"0": "colwise", "2": "rowwise"}
        got = model(x)
        assert type(got) is torch.Tensor and torch.allclose(got, want)  # plain, full activations leave the stage
        assert sharded_over_tp(model[0].weight) and sharded_over_tp(model[2].weight)
        assert not sharded_over_tp(model[2].bias)  # rowwise bias: replicated
        params = list(model.parameters())
        assert norm_counted(params, 1) == [model[0].weight, model[0].bias, model[2].weight]
        assert norm_counted(params, 0) == params
    finally:
        dist.destroy_process_group()


def test_an_exported_graph_is_made_shardable_at_one_tp_ranks_sizes() -> None:
    # HF Llama tiny: 4 heads of 16, 2 key/value heads; at tp 2 a rank holds 2 heads and 1 key/value head
    pytest.importorskip("transformers")
    from torch import fx, nn

    from planner.capture.load import load_model_file
    from planner.capture.tp_plan import resolve_tp_plan
    from planner.capture.trace import trace_model
    from planner.run.tensor_shard import check_tp_split, shardable_trace

    mf = load_model_file(MODELS / "hf" / "llama.py", "tiny")
    model = mf.build()
    inputs = mf.batch(2)[0]
    traced = trace_model(model, inputs, methods=("export",))
    plan = resolve_tp_plan(mf, model).plan
    before = {n: p.clone() for n, p in model.named_parameters()}
    split = shardable_trace(traced, model, inputs, plan, 2)
    assert [n.name for n in split.gm.graph.nodes] == [n.name for n in traced.gm.graph.nodes]
    calls = [n for n in split.gm.graph.nodes if n.op == "call_module" and n.target != "_guards_fn"]  # export's own
    assert len(calls) == 7 * 4 + 2 and {str(n.target).rsplit(".", 1)[-1] for n in calls} == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "lm_head",  # the model's own _tp_plan: untied, split with its logits gathered
        "embed_tokens",  # and its embedding_rowwise, split by width (planner.capture.tp_plan)
    }
    emb = split.gm.get_submodule("model.embed_tokens")
    assert isinstance(emb, nn.Embedding) and emb.weight.shape == (512, 64)  # gathered whole: the full size
    head = split.gm.get_submodule("lm_head")
    assert isinstance(head, nn.Linear) and head.weight.shape == (512, 64)  # the graph keeps its full size
    q = split.gm.get_submodule("model.layers.0.self_attn.q_proj")
    assert isinstance(q, nn.Linear) and q.weight.shape == (64, 64)  # the full weight, the trace's own object
    assert q.weight is dict(traced.gm.named_parameters())["model.layers.0.self_attn.q_proj.weight"]
    # the grouped-query expansion as one tp rank computes it: 1 key/value head repeated twice
    expands = [
        n.args[1] for n in split.gm.graph.nodes if n.target is torch.ops.aten.expand.default and len(n.args[1]) == 5
    ]
    whole = [
        n.args[1] for n in traced.gm.graph.nodes if n.target is torch.ops.aten.expand.default and len(n.args[1]) == 5
    ]
    assert expands and all(e[1] == 1 and w[1] == 2 for e, w in zip(expands, whole))
    assert isinstance(split.gm, fx.GraphModule) and split.blocks == traced.blocks
    for name, p in model.named_parameters():  # the model is not touched
        assert torch.equal(p, before[name]), name
    # the stage modules now hold the planned layers as modules: checked as an fx trace's are
    assert check_tp_split(split.gm, plan, 2)["lm_head"] == "colwise_rep"
    assert shardable_trace(traced, model, inputs, plan, 1) is traced


def test_launch_line_names_the_tensor_parallel_split_only_when_there_is_one() -> None:
    from planner.run.launch import launch_line

    split = plan_with_starts(MODELS / "llama.py", [0, 2], tp=2)
    assert launch_line(split, 4).startswith(
        "launching 4 ranks (4 per node, 2 stages, gpipe, 4 microbatches, each stage split over 2 tensor-parallel "
        "ranks, backend gloo, "
    )
    whole = plan_with_starts(MODELS / "llama.py", [0, 2])
    assert "tensor-parallel" not in launch_line(whole, 2)
    assert launch_line(whole, 2).startswith("launching 2 ranks (2 per node, 2 stages, gpipe, 4 microbatches, backend")
    both = split.model_copy(update={"cp": 2, "cp_attention": "ring", "sequence_parallel": True})
    assert launch_line(both, 8).startswith(
        "launching 8 ranks (8 per node, 2 stages, gpipe, 4 microbatches, each stage split over 2 tensor-parallel "
        "ranks with sequence parallelism, each sequence split over 2 context-parallel ranks (ring), backend gloo, "
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize("vocab", [512, 511], ids=["even", "uneven"])
def test_loss_parallel_tp2_pp2_matches_unsplit_model(tmp_path: Path, vocab: int) -> None:
    # the head's logits stay split over the two tp ranks (511: 256 and 255 columns, as DTensor shards
    # them) and the model file's cross-entropy runs on them under torch's loss_parallel, its backward too
    plan = plan_with_starts(MODELS / "llama.py", [0, 3], **TP2_1F1B, overrides={"vocab_size": vocab})
    plan = plan.model_copy(update={"loss_parallel": True})
    got, want = _run_and_compare(plan, tmp_path, save_checkpoints=False)
    print("llama tp2 pp2 loss parallel", vocab, got.losses, want.losses, got.grad_norms, want.grad_norms)


@pytest.mark.multiprocess
def test_loss_parallel_on_a_hugging_face_head_and_fsdp_replicas_matches_unsplit_model(tmp_path: Path) -> None:
    # one pipeline rank (the head in the only stage), 2 FSDP replicas of 2 tp ranks; transformers'
    # lm_head split colwise_gather_output by the config's own plan, its logits left split
    pytest.importorskip("transformers")
    plan = _dp2_tp2("fsdp", "stage", MODELS / "hf" / "llama.py").model_copy(update={"loss_parallel": True})
    got, want = _run_and_compare(plan, tmp_path, save_checkpoints=False)
    print("hf llama fsdp2 tp2 loss parallel", got.losses, want.losses, got.grad_norms, want.grad_norms)


@pytest.mark.multiprocess
def test_a_split_head_and_its_loss_are_exact_on_two_processes() -> None:
    spawn_pair(_split_head_rank)


def _split_head_rank(rank: int, port: int) -> None:
    """Loss parallelism over 2 ranks of a head with 5 output columns (3 and 2): the logits stay a
    DTensor split along the last dimension, each rank holding its columns only; the cross-entropy on
    them (torch's loss_parallel) equals the unsplit one, and so do the gradients. A loss that
    loss_parallel refuses (label smoothing) is one line naming the option, not a traceback."""
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    from planner.errors import PlanFileError
    from planner.run.tensor_shard import parallel_loss, shard_stage

    def ce(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.flatten(0, 1), target.flatten())

    with gloo_pair(rank, port):
        torch.manual_seed(0)
        stage = nn.ModuleDict({"head": nn.Linear(8, 5, bias=False)})
        whole = nn.ModuleDict({"head": nn.Linear(8, 5, bias=False)})
        whole.load_state_dict(stage.state_dict())
        x = torch.randn(3, 4, 8)
        target = torch.randint(0, 5, (3, 4))
        x_whole = x.clone().requires_grad_()
        x.requires_grad_()
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        shard_stage(stage, mesh, {"head": "colwise_rep"}, loss=True)
        logits = stage["head"](x)
        assert isinstance(logits, DTensor) and logits.placements == (Shard(2),)  # the last of 3 dimensions
        assert logits.shape == (3, 4, 5) and logits.to_local().shape == ((3, 4, 3) if rank == 0 else (3, 4, 2))
        with loss_parallel():
            got = parallel_loss(ce)(logits, target)
            assert type(got) is torch.Tensor and got.dim() == 0
            got.backward()
        want = ce(whole["head"](x_whole), target)
        want.backward()
        assert torch.allclose(got, want, atol=1e-6)
        assert x.grad is not None and x_whole.grad is not None and torch.allclose(x.grad, x_whole.grad, atol=1e-6)
        grad = stage["head"].weight.grad
        assert grad is not None and whole["head"].weight.grad is not None
        assert torch.allclose(grad.full_tensor(), whole["head"].weight.grad, atol=1e-6)

        def smoothed(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(out.flatten(0, 1), target.flatten(), label_smoothing=0.1)

        with loss_parallel(), pytest.raises(PlanFileError, match="re-plan without --loss-parallel") as caught:
            parallel_loss(smoothed)(stage["head"](x), target)
        assert "\n" not in str(caught.value)


@pytest.mark.multiprocess
def test_a_loss_that_loss_parallel_cannot_run_stops_the_run_in_one_line(tmp_path: Path) -> None:
    # the same plan trains without loss parallelism; with it, the head's split logits reach the loss
    # (a DTensor: label smoothing is refused) and the run stops with the option to leave out
    from planner.errors import PlannerError

    plan = plan_with_starts(FIXTURES / "smoothed_llama.py", [0, 3], **TP2_1F1B)
    path = saved(plan, tmp_path)
    plain = run_plan(plan, RunRequest(plan_file=path, steps=1, echo=False, save_checkpoints=False))
    assert len(plain.losses) == 1
    split = plan.model_copy(update={"loss_parallel": True})
    path = saved(split, tmp_path)
    with pytest.raises(PlannerError, match="re-plan without --loss-parallel") as caught:
        run_plan(split, RunRequest(plan_file=path, steps=1, echo=False, save_checkpoints=False))
    print(caught.value)


@pytest.mark.multiprocess
def test_loss_parallel_with_zbv_sequence_parallelism_and_recomputation_matches_unsplit_model(tmp_path: Path) -> None:
    # the zero-bubble schedule's input backward detaches the loss it gets (a copy, not the DTensor's
    # local view); sequence parallelism gathers the head's input; the last stage recomputes its blocks
    plan = llama_zbv_tp2()
    stages = [s.model_copy(update={"recompute": "full" if s.index == 3 else "never"}) for s in plan.stages]
    plan = plan.model_copy(update={"loss_parallel": True, "sequence_parallel": True, "stages": stages})
    got, want = _run_and_compare(plan, tmp_path, save_checkpoints=False)
    print("llama zbv sp tp2 loss parallel", got.losses, want.losses, got.grad_norms, want.grad_norms)
