"""Tier 3: FP8 training (``--dtype fp8``: torchao's float8 linear layers, emulated on the CPU), real gloo
processes against the same converted model trained unsplit: losses and global gradient norms
(clipping on) equal within 1e-4, as tests/test_run_tp.py checks tensor parallelism."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchao")

from run_factory import MODELS, plan_with_starts  # noqa: E402
from test_run_tp import _run_and_compare as compare_with_unsplit  # noqa: E402

FP8: dict = dict(schedule="1f1b", n_microbatches=2, optimizer="sgd", lr=0.5, grad_clip=0.5)


def _float8(plan, recipe: str = "tensorwise", autocast: str | None = None):  # type: ignore[no-untyped-def]
    """The plan trained in float8: its layers as the planner chooses them for a CPU plan."""
    from planner.capture.load import load_model_file
    from planner.capture.trace import trace_model
    from planner.costs.model_costs import float8_linears

    mf = load_model_file(Path(plan.model.path), plan.model.size)
    inputs, _ = mf.batch(2, seed=0)
    traced = trace_model(mf.build(0), inputs)
    f8 = float8_linears("fp8" if recipe == "tensorwise" else "fp8-rowwise", traced, small_filter=False)
    assert f8 is not None and f8.converted > 0
    profile = plan.profile.model_copy(update={"float8": f8, "autocast": autocast})
    return plan.model_copy(update={"profile": profile})


def _run_and_compare(plan, tmp_path: Path):  # type: ignore[no-untyped-def]
    return compare_with_unsplit(plan, tmp_path, save_checkpoints=False)


@pytest.mark.multiprocess
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_llama_fp8_pp2_matches_the_converted_model_unsplit(tmp_path: Path, recipe: str) -> None:
    plan = _float8(plan_with_starts(MODELS / "llama.py", [0, 3], **FP8), recipe)
    assert plan.profile.float8 is not None
    assert plan.profile.float8.converted == 28 and list(plan.profile.float8.kept) == ["output"]
    got, want = _run_and_compare(plan, tmp_path)
    print("llama fp8 pp2", recipe, got.losses, want.losses, got.grad_norms, want.grad_norms)


@pytest.mark.multiprocess
def test_llama_fp8_rowwise_cp2_matches_the_converted_model_unsplit(tmp_path: Path) -> None:
    # rowwise scales are per token (and per output channel): a rank's chunk of the sequence scales as the
    # whole sequence does, so context parallelism trains the same model; the float8 layers see plain chunks
    plan = _float8(plan_with_starts(MODELS / "llama.py", [0, 3], **FP8), "rowwise").model_copy(update={"cp": 2})
    got, want = _run_and_compare(plan, tmp_path)
    print("llama fp8 rowwise cp2", got.losses, want.losses, got.grad_norms, want.grad_norms)


@pytest.mark.multiprocess
def test_fp8_tensorwise_cp2_scales_each_chunk_on_its_own(tmp_path: Path) -> None:
    # tensorwise scales a whole tensor by its largest magnitude: each context-parallel rank takes its own
    # chunk's (as torchtitan's context parallelism with Float8 does), so the run is the unsplit model's
    # within float8's rounding of those scales, not to 1e-4
    from run_factory import saved

    from planner.run import run_plan, train_reference
    from planner.schema.run_request import RunRequest

    plan = _float8(plan_with_starts(MODELS / "llama.py", [0, 3], **FP8)).model_copy(update={"cp": 2})
    path = saved(plan, tmp_path)
    got = run_plan(plan, RunRequest(plan_file=path, steps=3, echo=False, save_checkpoints=False))
    want = train_reference(plan, path, 3)
    assert got.losses == pytest.approx(want.losses, rel=2e-3)
    assert got.grad_norms == pytest.approx(want.grad_norms, rel=2e-3)


@pytest.mark.multiprocess
def test_hugging_face_llama_fp8_pp2_under_autocast_matches_unsplit(tmp_path: Path) -> None:
    # a torch.export graph: its aten.linear calls become modules before they convert; the rest in bf16
    pytest.importorskip("transformers")
    plan = _float8(plan_with_starts(MODELS / "hf" / "llama.py", [0, 3], **FP8), autocast="bf16")
    assert plan.model.trace_method == "export"
    got, want = _run_and_compare(plan, tmp_path)
    print("hf llama fp8 pp2", got.losses, want.losses, got.grad_norms, want.grad_norms)


@pytest.mark.multiprocess
@pytest.mark.parametrize("dp_mode", ["fsdp", "ddp"])
def test_fp8_with_replicas_matches_unsplit(tmp_path: Path, dp_mode: str) -> None:
    # FSDP shards the float8 layers' weights (torchtitan's order: convert, then fully_shard)
    plan = _float8(plan_with_starts(MODELS / "llama.py", [0, 3], dp=2, dp_mode=dp_mode, **FP8))
    assert plan.world_size == 4
    got, want = _run_and_compare(plan, tmp_path)
    print("llama fp8 dp2", dp_mode, got.losses, want.losses, got.grad_norms, want.grad_norms)


@pytest.mark.multiprocess
def test_fp8_under_hsdp_matches_unsplit(tmp_path: Path) -> None:
    # shard groups of 2 of 4 replicas: the weights gathered in float8 inside a group, their precomputed
    # scales reduced over the shard group alone (a replicate group holds the same shards)
    plan = _float8(plan_with_starts(MODELS / "llama.py", [0], dp=4, dp_mode="hsdp", dp_shard=2, **FP8))
    assert plan.world_size == 4
    got, want = _run_and_compare(plan, tmp_path)
    print("llama fp8 hsdp", got.losses, want.losses, got.grad_norms, want.grad_norms)


@pytest.mark.multiprocess
def test_fp8_with_tp2_matches_unsplit(tmp_path: Path) -> None:
    # torch's column- and row-wise styles shard the float8 layers' weights; the casts' scales are the whole
    # tensor's (torchao reduces a DTensor's largest magnitude over its shards)
    plan = _float8(plan_with_starts(MODELS / "llama.py", [0, 3], tp=2, **FP8))
    assert plan.world_size == 4
    got, want = _run_and_compare(plan, tmp_path)
    print("llama fp8 tp2", got.losses, want.losses, got.grad_norms, want.grad_norms)


def _fp8_capable() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(0) >= (8, 9)


@pytest.mark.cuda
@pytest.mark.skipif(not _fp8_capable(), reason="needs a GPU with FP8 tensor cores (compute capability 8.9+)")
def test_real_float8_gemms_on_a_gpu_train_close_to_the_emulation(tmp_path: Path) -> None:
    # the runner's non-emulated path: torch._scaled_mm on the FP8 tensor cores, one GPU (nccl, one rank);
    # its losses near the unsplit emulation on the CPU (the GEMMs accumulate otherwise: not the 1e-4 of the CPU)
    from run_factory import saved

    from planner.capture.float8 import emulated
    from planner.run import run_plan, train_reference
    from planner.schema.run_request import RunRequest

    assert not emulated(torch.device("cuda", 0))
    plan = _float8(plan_with_starts(MODELS / "llama.py", [0], backend="nccl", **FP8), autocast="bf16")
    path = saved(plan, tmp_path)
    got = run_plan(plan, RunRequest(plan_file=path, steps=3, save_checkpoints=False))
    want = train_reference(plan, path, 3)
    for g, w in zip(got.losses, want.losses):
        assert g == pytest.approx(w, rel=2e-2)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.is_available() and _fp8_capable(), reason="checks a GPU without FP8 tensor cores")
def test_a_gpu_without_fp8_tensor_cores_is_refused_in_one_line() -> None:
    from planner.capture.float8 import emulated
    from planner.errors import PlannerError

    with pytest.raises(PlannerError, match=r"--dtype fp8 needs FP8 tensor cores \(compute capability 8.9"):
        emulated(torch.device("cuda", 0))


@pytest.mark.multiprocess
def test_hugging_face_llama_fp8_with_tp2_matches_unsplit(tmp_path: Path) -> None:
    # a torch.export graph under tensor parallelism: its planned layers become nn.Linear modules at one rank's
    # sizes (the shardable trace), the others' aten.linear calls modules too, then all convert and shard.
    # Rowwise: its power-of-two scales do not move with the last bits that a row-wise layer's partial sums
    # reduced in another order change; a tensorwise scale does, and amplifies them (1.5e-4 at step 2 here)
    pytest.importorskip("transformers")
    plan = _float8(plan_with_starts(MODELS / "hf" / "llama.py", [0, 3], tp=2, **FP8), "rowwise")
    assert plan.model.trace_method == "export" and plan.world_size == 4
    got, want = _run_and_compare(plan, tmp_path)
    print("hf llama fp8 tp2", got.losses, want.losses, got.grad_norms, want.grad_norms)


def _precompute_rank(rank: int, port: int) -> None:
    """One of two FSDP replicas of a float8 plan (``planner.pipeline``): after the optimizer step every
    float8 weight holds its scale for the next gather, the whole weight's, set in one all-reduce."""
    from test_run_tp import gloo_pair

    import planner
    from planner.capture.float8 import float8_modules
    from planner.capture.load import load_model_file

    with gloo_pair(rank, port):
        plan = _float8(plan_with_starts(MODELS / "llama.py", [0], dp=2, dp_mode="fsdp", **FP8))
        mf = load_model_file(Path(plan.model.path), plan.model.size)
        inputs, target = mf.batch(plan.batch_size, seed=0)
        pipe = planner.pipeline(plan, mf.build(0), inputs)
        layers = [m for module in pipe.modules for m in float8_modules(module)]
        assert len(layers) == plan.profile.float8.converted

        def scales() -> list[float | None]:
            got = [getattr(m.weight._local_tensor, "_precomputed_scale", None) for m in layers]
            return [None if s is None else float(s) for s in got]

        assert set(scales()) == {None}  # before any step each gather reduces its own scale
        rows = slice(pipe.replica * pipe.batch_size, (pipe.replica + 1) * pipe.batch_size)
        mine = tuple(x[rows] for x in inputs) if isinstance(inputs, tuple) else inputs[rows]
        pipe.step(mine, target[rows])
        pipe.finish_grads()
        pipe._built.optimizer.step()  # the runner's optimizer: its hook precomputes
        e4m3 = torch.finfo(torch.float8_e4m3fn).max
        want = [e4m3 / float(m.weight.full_tensor().abs().max()) for m in layers]
        assert scales() == pytest.approx(want, rel=1e-6)
        for m in layers:  # a script's own optimizer: the pipeline's method does the same
            m.weight._local_tensor._precomputed_scale = None
        pipe.precompute_float8_scales()
        assert scales() == pytest.approx(want, rel=1e-6)


@pytest.mark.multiprocess
def test_fsdp_float8_scales_are_precomputed_after_the_optimizer_step() -> None:
    from test_run_tp import spawn_pair

    spawn_pair(_precompute_rank)
