"""Tier-3 tests of the runner: real multi-process gloo pipelines on CPU against the unsplit model.

Plans are assembled here directly (no CLI, no profiling): the runner only reads the stage ranges,
the model reference and the run settings, so block costs and predictions are plausible made-up
numbers. The fingerprint and block names come from tracing the model exactly as the planner does.
"""

from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from run_factory import MODELS, REL, ROOT, assert_close, plan_with_starts, run_report, saved, stage_report  # noqa: E402

from planner.capture.load import load_model_file  # noqa: E402
from planner.capture.stage import build_stage_module  # noqa: E402
from planner.capture.trace import trace_model  # noqa: E402
from planner.core.step.schedules import action_order  # noqa: E402
from planner.errors import PlanFileError, PlannerError, TraceError  # noqa: E402
from planner.report.compare import measured_events  # noqa: E402
from planner.run import RunResult, run_plan, train_reference  # noqa: E402
from planner.run.loop import RankResult, run_result  # noqa: E402
from planner.schema.costs import OptimizerSpec  # noqa: E402
from planner.schema.result import MEMORY_CATEGORIES, MemoryMeasure, StageMeasure  # noqa: E402
from planner.schema.run_request import RunRequest  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures"
HF = MODELS / "hf"
try:
    import transformers  # noqa: F401

    NEEDS_HF = pytest.mark.skipif(False, reason="")
except ImportError:  # the dev extra installs it
    NEEDS_HF = pytest.mark.skip(reason="needs transformers (pip install -e .[dev])")


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the runner tries to start worker processes."""
    import torch.distributed.launcher.api as launcher

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("elastic_launch was called")

    monkeypatch.setattr(launcher, "elastic_launch", refuse)


# (model file, stage starts, schedule, n_microbatches, optimizer, grad_clip, stages per rank). Clip thresholds sit
# below every step's global norm for these models, so clipping happens in every step. SGD makes
# the clipping visible in the losses (AdamW nearly cancels a uniform gradient scale).
CASES = [
    pytest.param(MODELS / "gpt.py", [0, 3], "gpipe", 4, "sgd", 0.5, 1, id="gpt-2stages-gpipe"),
    pytest.param(MODELS / "gpt.py", [0, 2, 4, 5], "1f1b", 4, "adamw", 0.5, 1, id="gpt-4stages-1f1b-adamw"),
    pytest.param(MODELS / "shakespeare.py", [0, 4], "1f1b", 2, "sgd", 0.5, 1, id="shakespeare-2stages-1f1b"),
    # cut after block 0 sends the token embeddings AND the integer position ids (torch.arange)
    pytest.param(MODELS / "shakespeare.py", [0, 1, 3, 6], "gpipe", 2, "sgd", 0.5, 1, id="shakespeare-4stages-gpipe"),
    # two tensors cross every middle cut; the middle stage passes the skip tensor through unchanged
    pytest.param(FIXTURES / "skip.py", [0, 2, 4], "1f1b", 4, "sgd", 0.05, 1, id="skip-3stages-1f1b"),
    # every schedule with several stages per rank, 2 ranks x 2 stages (looped placement: rank 0 runs
    # stages 0 and 2; V placement: rank 0 runs stages 0 and 3 and computes the loss)
    pytest.param(MODELS / "gpt.py", [0, 2, 4, 5], "interleaved-1f1b", 4, "sgd", 0.5, 2, id="gpt-2x2-interleaved-1f1b"),
    pytest.param(MODELS / "gpt.py", [0, 2, 4, 5], "looped-bfs", 4, "sgd", 0.5, 2, id="gpt-2x2-looped-bfs"),
    pytest.param(MODELS / "gpt.py", [0, 2, 4, 5], "interleaved-zb", 4, "sgd", 0.5, 2, id="gpt-2x2-interleaved-zb"),
    pytest.param(MODELS / "gpt.py", [0, 2, 4, 5], "zbv", 4, "adamw", 0.5, 2, id="gpt-2x2-zbv-adamw"),
    pytest.param(
        MODELS / "shakespeare.py", [0, 1, 3, 6], "dualpipev", 4, "sgd", 0.5, 2, id="shakespeare-2x2-dualpipev"
    ),
    # every stage output is a view (torch's input-only backward fails on those unless copied)
    pytest.param(FIXTURES / "view_out.py", [0, 1, 3, 4], "zbv", 4, "sgd", 0.05, 2, id="view-out-2x2-zbv"),
    # one stage per rank under a multi-stage schedule class
    pytest.param(MODELS / "gpt.py", [0, 3], "interleaved-zb", 2, "sgd", 0.5, 1, id="gpt-2x1-interleaved-zb"),
    # tied input embedding and head: a copy on each rank, gradients summed across them
    pytest.param(FIXTURES / "tied.py", [0, 2], "1f1b", 4, "sgd", 0.05, 1, id="tied-2stages-1f1b"),
    pytest.param(
        FIXTURES / "tied.py", [0, 1, 2, 3], "interleaved-1f1b", 4, "adamw", 0.05, 2, id="tied-2x2-interleaved"
    ),
    # V placement: embedding (stage 0) and head (stage 3) on rank 0 share the one parameter
    pytest.param(FIXTURES / "tied.py", [0, 1, 2, 3], "zbv", 4, "sgd", 0.05, 2, id="tied-2x2-zbv-one-rank"),
    # frozen parameters (a fine-tuned model's embedding, one bias): no gradient, and no hook of the
    # memory-tracked last step on them; under the split backward too
    pytest.param(FIXTURES / "frozen.py", [0, 2], "1f1b", 4, "adamw", 0.05, 1, id="frozen-2stages-1f1b"),
    pytest.param(FIXTURES / "frozen.py", [0, 1, 2, 4], "zbv", 4, "adamw", 0.05, 2, id="frozen-2x2-zbv"),
    # a stage with no parameters (the toy's ReLU) only relays activations: no optimizer on its rank
    pytest.param(MODELS / "toy.py", [0, 1, 2], "1f1b", 4, "sgd", 0.05, 1, id="toy-3stages-parameterless-middle"),
    # no tracer follows its data-dependent layers: stages are chains of its block modules
    pytest.param(FIXTURES / "guarded.py", [0, 3], "1f1b", 4, "adamw", 0.05, 1, id="module-chain-2stages-1f1b"),
    # Hugging Face models as they are: ModelOutput results, keyword inputs with a padding mask, ties
    pytest.param(HF / "gpt2.py", [0, 5], "gpipe", 4, "adamw", 0.5, 1, marks=NEEDS_HF, id="hf-gpt2-tied-2stages-gpipe"),
    pytest.param(
        HF / "llama.py", [0, 2, 5, 7], "interleaved-1f1b", 4, "adamw", 0.5, 2, marks=NEEDS_HF, id="hf-llama-2x2-kwargs"
    ),
    pytest.param(HF / "bert_mlm.py", [0, 3], "1f1b", 4, "adamw", 0.5, 1, marks=NEEDS_HF, id="hf-bert-mlm-tied-1f1b"),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("model", "starts", "schedule", "m", "optimizer", "clip", "v"), CASES)
def test_pipeline_matches_unsplit_model(
    model: Path,
    starts: list[int],
    schedule: str,
    m: int,
    optimizer: str,
    clip: float,
    v: int,
    tmp_path: Path,
    capfd: pytest.CaptureFixture,
) -> None:
    steps = 3
    lr = 0.5 if optimizer == "sgd" else 1e-3
    plan = plan_with_starts(
        model,
        starts,
        schedule=schedule,
        n_microbatches=m,
        optimizer=optimizer,
        lr=lr,
        grad_clip=clip,
        stages_per_rank=v,
    )
    path = saved(plan, tmp_path)
    t0 = time.perf_counter()
    got = run_plan(plan, RunRequest(plan_file=path, steps=steps))
    elapsed = time.perf_counter() - t0
    out = capfd.readouterr().out
    want = train_reference(plan, path, steps)

    assert got.mode == "pipeline" and got.n_stages == len(starts) and got.schedule == schedule
    assert_close(got.losses, want.losses, "loss")
    # The global norm is the whole model's gradient norm: equal norms before clipping in every
    # step means the pipeline's gradients (summed over stages) match the unsplit model's.
    assert_close(got.grad_norms, want.grad_norms, "grad norm")
    assert all(g > clip for g in got.grad_norms), "clip threshold too high: clipping never happened"
    if optimizer == "sgd":
        no_clip = OptimizerSpec(name="sgd", lr=lr, grad_clip=None)
        unclipped = train_reference(plan.model_copy(update={"optimizer": no_clip}), path, steps)
        assert unclipped.losses[1] != pytest.approx(want.losses[1], rel=10 * REL), "clipping changed nothing"

    assert len(got.step_times_s) == steps and all(t > 0 for t in got.step_times_s)
    n_ranks = len(starts) // v
    assert [len(ts) for ts in got.rank_step_times_s] == [steps] * n_ranks
    assert got.threads == [1] * n_ranks
    # every stage measured, on the rank the plan placed it, with its actions of one step timed
    assert [(st.stage, st.rank if st.rank is not None else st.stage) for st in got.stages] == [
        (s.index, s.rank) for s in plan.stages
    ]
    for st in got.stages:
        kinds = [k for k, *_ in st.timeline]
        assert kinds.count("F") == m and kinds.count("B") + kinds.count("I") == m, (st.stage, kinds)
        assert kinds.count("I") == kinds.count("W")
    # the measured timeline has every action of the step, each on its rank, in the schedule's order
    events = measured_events(plan, got)
    orders = action_order(schedule, n_ranks, m, v)
    for rank, order in enumerate(orders):
        ran = [(e.stage, e.microbatch) for e in events if e.rank == rank]
        assert ran == [(a.stage, a.microbatch) for a in order], rank
    assert all(b > 10 * 2**20 for b in got.peak_rss_bytes)
    assert out.count("\nstep ") + out.startswith("step ") == steps
    assert f"step {steps}/{steps}  loss {got.losses[-1]:.4f}" in out
    print(f"{len(starts)}-stage {schedule} run of {model.name}: {elapsed:.1f} s")


def test_fingerprint_mismatch_raises_before_launch(tmp_path: Path, no_launch: None) -> None:
    plan = plan_with_starts(MODELS / "gpt.py", [0, 3])
    edited = plan.model_copy(update={"model": plan.model.model_copy(update={"fingerprint": "0123456789abcdef"})})
    with pytest.raises(
        PlanFileError,
        match=r"different model structure \(fingerprint 0123456789abcdef, the model now gives "
        + plan.model.fingerprint,
    ):
        run_plan(edited, RunRequest(plan_file=saved(edited, tmp_path), steps=2))


def test_a_fingerprint_mismatch_says_what_differs(tmp_path: Path, no_launch: None) -> None:
    plan = plan_with_starts(MODELS / "gpt.py", [0, 3])
    names = [b.name for b in plan.blocks]
    # the model file now builds one layer less than the plan was made for
    fewer = plan.model.model_copy(
        update={"config": {**plan.model.config, "n_layers": plan.model.config["n_layers"] - 1}}
    )
    edited = plan.model_copy(update={"model": fewer})
    with pytest.raises(
        PlanFileError,
        match=rf"{len(names)} blocks in the plan, {len(names) - 1} now; block 4 is 'layers.3' in the plan, 'norm' now",
    ):
        run_plan(edited, RunRequest(plan_file=saved(edited, tmp_path), steps=2))
    renamed = plan.model_copy(update={"model": plan.model.model_copy(update={"fingerprint": "0123456789abcdef"})})
    with pytest.raises(PlanFileError, match=rf"the same {len(names)} blocks, with other operators or parameter shapes"):
        run_plan(renamed, RunRequest(plan_file=saved(renamed, tmp_path), steps=2))


def test_a_module_boundary_plan_whose_blocks_are_no_chain_is_refused_before_launch(
    tmp_path: Path, no_launch: None
) -> None:
    # `planner plan` refuses such a model; a plan file made another way (or before) is refused here
    plan = plan_with_starts(FIXTURES / "hf_style.py", [0, 3], batch_size=4, n_microbatches=2)
    assert plan.model.trace_method == "modules"
    with pytest.raises(TraceError, match="cannot run as a chain of stages: model.layers.0 takes 2 tensors"):
        run_plan(plan, RunRequest(plan_file=saved(plan, tmp_path), steps=2))


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has the GPUs nccl needs")
def test_nccl_without_gpus_is_rejected(tmp_path: Path, no_launch: None) -> None:
    plan = plan_with_starts(MODELS / "gpt.py", [0, 3], backend="nccl")
    with pytest.raises(PlannerError, match="nccl needs one GPU per rank"):
        run_plan(plan, RunRequest(plan_file=saved(plan, tmp_path), steps=2))


def test_1f1b_with_too_few_microbatches_is_rejected(tmp_path: Path, no_launch: None) -> None:
    plan = plan_with_starts(MODELS / "gpt.py", [0, 2, 4, 5], schedule="1f1b", n_microbatches=2)
    with pytest.raises(PlannerError, match="--microbatches 2 is too small for --schedule 1f1b with 4 stages"):
        run_plan(plan, RunRequest(plan_file=saved(plan, tmp_path), steps=2))


@pytest.mark.slow
def test_one_stage_plan_trains_in_process(tmp_path: Path, no_launch: None, capsys: pytest.CaptureFixture) -> None:
    plan = plan_with_starts(MODELS / "shakespeare.py", [0], n_microbatches=2, grad_clip=0.5)
    path = saved(plan, tmp_path)
    got = run_plan(plan, RunRequest(plan_file=path, steps=3))
    want = train_reference(plan, path, 3)
    assert got.mode == "local" and got.n_stages == 1 and got.n_microbatches == 2
    # Two accumulated microbatches give the full-batch step.
    assert_close(got.losses, want.losses, "loss")
    assert got.losses[-1] < got.losses[0]
    assert "step 3/3  loss" in capsys.readouterr().out


@pytest.mark.multiprocess
def test_worker_error_comes_back_as_one_message(tmp_path: Path) -> None:
    # the first batch is good (the parent checks it before launching), the second fails on the ranks
    src = (MODELS / "toy.py").read_text() + (
        "\n\ndef train_batches(batch_size, **config):\n    yield make_batch(batch_size)\n"
        "    raise ValueError('no data today')\n"
    )
    model = tmp_path / "broken.py"
    model.write_text(src)
    plan = plan_with_starts(model, [0, 2], n_microbatches=2, batch_size=4)
    with pytest.raises(
        PlannerError, match=r"^rank \d failed: broken.py: train_batches\(\) raised ValueError: no data today"
    ):
        run_plan(plan, RunRequest(plan_file=saved(plan, tmp_path), steps=2, echo=False))


def test_run_result_round_trips_without_torch(tmp_path: Path) -> None:
    cats = {c: 1000 + k for k, c in enumerate(MEMORY_CATEGORIES)} | {"Total": 7021}
    memory = MemoryMeasure(source="memtracker", step=2, peak_bytes=7021, peak_by_category=cats, end_by_category=cats)
    stages = [
        stage_report(
            i,
            fwd_s=0.01,
            bwd_s=0.02,
            loss_s=0.001 * i,
            p2p_s=0.003,
            reduce_s=0.0004,
            clip_s=0.0005,
            optimizer_s=0.006,
            step_s=0.1,
            fwd_times_s=[[0.01, 0.011], [0.01, 0.012]],
            bwd_times_s=[[0.02, 0.021], [0.02, 0.022]],
            memory=memory if i else None,
        )
        for i in range(2)
    ]
    result = run_report(
        stages=stages,
        step_times_s=[0.2, 0.1],
        plan_path="/tmp/plan.json",
        losses=[2.0, 1.5],
        grad_norms=[3.0, 2.0],
        rank_step_times_s=[[0.2, 0.1], [0.19, 0.1]],
        median_step_s=0.1,
        peak_rss_bytes=[1 << 28, 1 << 28],
        predicted_step_s=0.09,
        memory_step=2,
        timed_steps=[1],
    )
    path = tmp_path / "run.json"
    result.save(path)
    assert RunResult.load(path) == result
    raw = json.loads(path.read_text())
    assert raw["losses"] == [2.0, 1.5] and raw["stages"][1]["memory"]["end_by_category"]["Gradient"] == 1002
    code = "import sys; import planner.schema.result; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    path.write_text(path.read_text().replace('"version": 2', '"version": 1'))
    with pytest.raises(PlanFileError, match="run result format version 1; this planner reads version 2"):
        RunResult.load(path)


@pytest.mark.multiprocess
def test_pipeline_run_measures_every_stage(tmp_path: Path) -> None:
    """Per-stage compute, optimizer and p2p times, and memory by category, from a real 2-rank run."""
    from planner.report.compare import compare_table

    steps, m = 3, 4
    plan = plan_with_starts(MODELS / "gpt.py", [0, 3], schedule="1f1b", n_microbatches=m)
    path = saved(plan, tmp_path)
    got = run_plan(plan, RunRequest(plan_file=path, steps=steps, echo=False))
    # Step 1 pays for the schedule's set-up, step 3 ran under the memory tracker: medians use step 2.
    assert got.memory_step == steps and got.timed_steps == [2]
    assert got.median_step_s == got.step_times_s[1] and got.plan_path == str(path.resolve())

    mf = load_model_file(MODELS / "gpt.py", "tiny")
    traced = trace_model(mf.build(0), mf.batch(plan.microbatch_size, seed=0)[0])
    assert [s.stage for s in got.stages] == [0, 1]
    for s, st in zip(got.stages, plan.stages):
        assert (s.first_block, s.last_block) == (st.first_block, st.last_block)
        assert [len(row) for row in s.fwd_times_s] == [m] * steps and [len(row) for row in s.bwd_times_s] == [m] * steps
        assert all(t > 0 for row in s.fwd_times_s + s.bwd_times_s for t in row)
        assert s.fwd_s > 0 and s.bwd_s > 0 and s.optimizer_s > 0 and s.p2p_s > 0 and s.reduce_s > 0
        assert s.clip_s >= s.reduce_s and s.step_s >= m * (s.fwd_s + s.bwd_s) * 0.5
        assert (s.loss_s > 0) == (st.index == 1)  # only the last stage computes the loss
        # every block timed where it ran: the stage's blocks in order, their times within the stage's
        assert [b.name for b in s.blocks] == [b.name for b in plan.blocks[st.start : st.end]]
        assert all(b.fwd_s > 0 and b.bwd_s > 0 for b in s.blocks)
        assert s.fwd_overhead_s >= 0 and s.bwd_overhead_s >= 0
        assert sum(b.fwd_s for b in s.blocks) < 1.5 * s.fwd_s and sum(b.bwd_s for b in s.blocks) < 1.5 * s.bwd_s
        params = list(build_stage_module(traced, st.start, st.end).parameters())
        numel = sum(p.numel() for p in params)
        mem = s.memory
        assert mem is not None and mem.source == "memtracker" and mem.step == steps
        assert set(mem.peak_by_category) == set(mem.end_by_category) == {*MEMORY_CATEGORIES, "Total"}
        # fp32: exactly 4 bytes per parameter, and after the step a gradient for every one.
        assert mem.end_by_category["Parameter"] == mem.peak_by_category["Parameter"] == 4 * numel
        assert mem.end_by_category["Gradient"] == 4 * numel
        # AdamW: two fp32 moments per parameter + one fp32 ``step`` scalar per parameter tensor.
        assert mem.end_by_category["Optstate"] == 8 * numel + 4 * len(params)
        # Receive buffers, one per microbatch: activations into stage 1, their gradients into stage 0.
        assert mem.end_by_category["Other"] == m * traced.cuts[2].nbytes
        assert mem.peak_by_category["Activation"] > 0
        assert mem.peak_bytes == mem.peak_by_category["Total"] >= mem.end_by_category["Total"]

    again = tmp_path / "run.json"
    got.save(again)
    assert RunResult.load(again) == got
    table = compare_table(plan, got)
    assert "tok_embeddings .. layers.1" in table and "\nstep " in table


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_nccl_pipeline_matches_unsplit_model(tmp_path: Path) -> None:
    plan = plan_with_starts(MODELS / "gpt.py", [0, 3], schedule="1f1b", backend="nccl", grad_clip=0.5)
    path = saved(plan, tmp_path)
    got = run_plan(plan, RunRequest(plan_file=path, steps=3))
    want = train_reference(plan, path, 3)  # on CPU: cuda and CPU kernels differ in the last bits
    for g, w in zip(got.losses, want.losses):
        assert g == pytest.approx(w, rel=1e-3)


def test_a_tie_the_plan_does_not_record_is_refused_naming_both_parameters(tmp_path: Path, no_launch: None) -> None:
    plan = plan_with_starts(FIXTURES / "tied.py", [0, 2], record_ties=False)  # as plans made before ties were served
    with pytest.raises(
        PlanFileError,
        match=r"parameter emb.weight \(also named head.weight\) is read by emb on stage 0 and by head on stage 1 "
        r"\(tied weights\), but the plan records no such tie",
    ):
        run_plan(plan, RunRequest(plan_file=saved(plan, tmp_path), steps=2))


def test_nodes_must_divide_stages(tmp_path: Path, no_launch: None) -> None:
    plan = plan_with_starts(MODELS / "gpt.py", [0, 2, 4])
    path = saved(plan, tmp_path)
    with pytest.raises(PlannerError, match="3 ranks cannot be spread evenly over 2 node"):
        run_plan(plan, RunRequest(plan_file=path, steps=2, nnodes=2, rdzv_endpoint="localhost:29400"))
    plan2 = plan_with_starts(MODELS / "gpt.py", [0, 3])
    with pytest.raises(PlannerError, match="needs --rdzv-endpoint"):
        RunRequest.build(plan_file=saved(plan2, tmp_path), steps=2, nnodes=2)  # refused before any plan is read


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["full", "selective", "stage", "full:2", "selective:2"])
def test_recomputing_stage_matches_unsplit_model(tmp_path: Path, mode: str) -> None:
    # Activation checkpointing of a stage, block by block (the plan's recompute mode), changes
    # memory, not results; so does checkpointing only the stage's first blocks ("full:2").
    plan = plan_with_starts(
        MODELS / "gpt.py", [0, 3], schedule="1f1b", n_microbatches=4, optimizer="sgd", lr=0.5, grad_clip=0.5
    )
    stages = [plan.stages[0].model_copy(update={"recompute": mode}), plan.stages[1]]
    plan = plan.model_copy(update={"stages": stages})
    path = saved(plan, tmp_path)
    got = run_plan(plan, RunRequest(plan_file=path, steps=3, echo=False))
    want = train_reference(plan, path, 3)
    assert_close(got.losses, want.losses, "loss")
    assert_close(got.grad_norms, want.grad_norms, "grad norm")
    # Recomputing, stage 0 keeps per microbatch only its blocks' inputs (and, selectively, their
    # matmul and attention outputs): its activation peak is well under 1F1B's two microbatches in flight.
    plain_plan = plan.model_copy(update={"stages": [stages[0].model_copy(update={"recompute": "never"}), stages[1]]})
    plain = run_plan(plain_plan, RunRequest(plan_file=saved(plain_plan, tmp_path), steps=3, echo=False))
    assert_close(plain.losses, got.losses, "loss")
    with_recompute, without = got.stages[0].memory, plain.stages[0].memory
    assert with_recompute is not None and without is not None
    # (selective keeps the matmul outputs, most of a small GPT's activations: less, not a quarter less)
    most = 1.0 if mode.startswith("selective") or ":" in mode else 0.75
    assert with_recompute.peak_by_category["Activation"] < most * without.peak_by_category["Activation"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["interleaved-zb", "zbv"])
def test_checkpointed_stages_train_like_the_unsplit_model_under_split_backward(tmp_path: Path, schedule: str) -> None:
    # The recompute modes that can run there on one plan, under the zero-bubble schedules (their
    # input-only backward runs the regions' recomputation apart from the weight gradients), with a
    # tied output layer whose copies sit on the first and the last stage. (Selective checkpointing
    # cannot: torch allows it one backward per region; refused, see below.)
    example = ROOT / "examples" / "train_with_plan.py"
    plan = plan_with_starts(example, [0, 2, 4, 6], schedule=schedule, stages_per_rank=2, batch_size=8, n_microbatches=4)
    modes = ["full", "stage", "never", "full:1"]  # the last stage recomputes its first block only
    plan = plan.model_copy(update={"stages": [s.model_copy(update={"recompute": modes[s.index]}) for s in plan.stages]})
    path = saved(plan, tmp_path)
    got = run_plan(plan, RunRequest(plan_file=path, steps=2, echo=False))
    want = train_reference(plan, path, 2)
    assert_close(got.losses, want.losses, "loss")
    assert_close(got.grad_norms, want.grad_norms, "grad norm")


def test_selective_checkpointing_under_a_split_backward_is_refused_before_launch(
    tmp_path: Path, no_launch: None
) -> None:
    # torch's selective checkpointing allows one backward per region; zero-bubble schedules run two
    plan = plan_with_starts(MODELS / "gpt.py", [0, 2, 4, 5], schedule="zbv", stages_per_rank=2, n_microbatches=2)
    plan = plan.model_copy(update={"stages": [s.model_copy(update={"recompute": "selective"}) for s in plan.stages]})
    with pytest.raises(PlanFileError, match=r"stage\(s\) 0, 1, 2, 3 checkpoint selectively under --schedule zbv"):
        run_plan(plan, RunRequest(plan_file=saved(plan, tmp_path), steps=1, echo=False))
    # so does a stage that checkpoints only its first block selectively
    modes = ["never", "selective:1", "never", "never"]
    plan = plan.model_copy(update={"stages": [s.model_copy(update={"recompute": modes[s.index]}) for s in plan.stages]})
    with pytest.raises(PlanFileError, match=r"stage\(s\) 1 checkpoint selectively under --schedule zbv"):
        run_plan(plan, RunRequest(plan_file=saved(plan, tmp_path), steps=1, echo=False))


@pytest.mark.slow
def test_a_model_file_edited_since_planning_is_named_in_a_warning(tmp_path: Path) -> None:
    model = tmp_path / "gpt.py"
    model.write_text((MODELS / "gpt.py").read_text())
    plan = plan_with_starts(model, [0])  # one stage: trains in this process, fast
    path = saved(plan, tmp_path)
    lines: list[str] = []
    run_plan(plan, RunRequest(plan_file=path, steps=1, echo=False), print_fn=lines.append)
    assert not any("changed since it was planned" in line for line in lines)
    model.write_text(model.read_text() + "\n# edited after planning\n")
    lines.clear()
    run_plan(plan, RunRequest(plan_file=path, steps=1, echo=False), print_fn=lines.append)
    warnings = [line for line in lines if "changed since it was planned" in line]
    assert len(warnings) == 1 and str(model) in warnings[0] and plan.model.file_digest in warnings[0]
    assert "its text changed" in warnings[0]  # a comment: no contract function changed
    model.write_text(
        model.read_text() + "\n\ndef loss_fn(output, target):\n"
        "    return torch.nn.functional.cross_entropy(output.flatten(0, 1), target.flatten()) * 2\n"
    )
    lines.clear()
    run_plan(plan, RunRequest(plan_file=path, steps=1, echo=False), print_fn=lines.append)
    warnings = [line for line in lines if "changed since it was planned" in line]
    assert len(warnings) == 1 and "(loss_fn changed;" in warnings[0], warnings


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        # make_batch returning a row more than asked: planning refuses it; so does run, before any rank starts
        (
            (
                "    x = torch.randint(0, vocab_size, (batch_size, seq_len))\n    y = torch.randint(0, vocab_size, (batch_size, seq_len))",
                "    x = torch.randint(0, vocab_size, (batch_size + 1, seq_len))\n    y = torch.randint(0, vocab_size, (batch_size + 1, seq_len))",
            ),
            "make_batch(2) returned tensors whose first dimension is [3], not 2",
        ),
        # a loss edited to sum over the batch: the pipeline's mean of microbatch losses would train on sums
        (
            ("target.reshape(-1))\n", "target.reshape(-1), reduction='sum')\n"),
            "loss_fn() sums over the batch instead of averaging",
        ),
    ],
)
def test_a_contract_broken_since_planning_is_refused_before_training(
    tmp_path: Path, edit: tuple[str, str], message: str
) -> None:
    model = tmp_path / "gpt.py"
    text = (MODELS / "gpt.py").read_text()
    model.write_text(text)
    plan = plan_with_starts(model, [0])
    path = saved(plan, tmp_path)
    assert edit[0] in text
    model.write_text(text.replace(edit[0], edit[1], 1))
    lines: list[str] = []
    with pytest.raises(PlannerError, match=re.escape(message)):
        run_plan(plan, RunRequest(plan_file=path, steps=1, echo=False), print_fn=lines.append)
    assert len(lines) == 1 and "changed since it was planned" in lines[0]  # the warning, and no step


def _rank(
    rank: int, times: tuple[float, ...], losses: tuple[float, ...] = (), stages: tuple[int, ...] | None = None
) -> RankResult:
    return RankResult(
        rank=rank,
        losses=losses,
        grad_norms=(3.0, 2.0, 1.0),
        times=times,
        threads=1,
        peak_rss_bytes=1 << 28,
        memory_step=3,
        measures=tuple(_measure(s, len(times)) for s in (stages if stages is not None else (rank,))),
    )


def _measure(stage: int, steps: int) -> StageMeasure:
    return stage_report(
        stage,
        fwd_s=0.01,
        bwd_s=0.02,
        p2p_s=0.003,
        optimizer_s=0.006,
        step_s=0.1,
        fwd_times_s=[[0.01]] * steps,
        bwd_times_s=[[0.02]] * steps,
    )


def test_run_result_is_assembled_from_rank_results(tmp_path: Path) -> None:
    plan = plan_with_starts(MODELS / "gpt.py", [0, 3])
    ranks = [_rank(1, (0.5, 0.2, 0.9), losses=(2.0, 1.5, 1.2)), _rank(0, (0.6, 0.1, 0.8))]
    # A worker's result travels back to the launcher pickled.
    assert pickle.loads(pickle.dumps(ranks[0])) == ranks[0]
    got = run_result(plan, ranks, mode="pipeline", plan_path=tmp_path / "plan.json")
    assert got.mode == "pipeline" and got.n_stages == 2 and got.backend == "gloo" and got.n_microbatches == 4
    assert got.step_times_s == [0.6, 0.2, 0.9]  # the slowest rank, step by step
    assert got.rank_step_times_s == [[0.6, 0.1, 0.8], [0.5, 0.2, 0.9]]  # ordered by rank
    assert got.losses == [2.0, 1.5, 1.2] and got.grad_norms == [3.0, 2.0, 1.0]
    assert got.timed_steps == [2] and got.median_step_s == 0.2 and got.memory_step == 3
    assert [s.stage for s in got.stages] == [0, 1] and got.plan_path == str((tmp_path / "plan.json").resolve())
    # This node ran only the first rank (multi-node): no losses here.
    assert run_result(plan, ranks[1:], mode="pipeline").losses == []
    local = run_result(plan, [_rank(0, (0.3, 0.2, 0.4), losses=(2.0, 1.0, 0.5))], mode="local", n_microbatches=1)
    assert local.mode == "local" and local.n_stages == 1 and local.backend == "none" and local.n_microbatches == 1
    assert local.losses == [2.0, 1.0, 0.5] and local.step_times_s == [0.3, 0.2, 0.4] and local.plan_path is None
    with pytest.raises(ValueError, match="at least one rank"):
        run_result(plan, [], mode="pipeline")


def test_run_result_of_a_v_placement_takes_losses_from_rank_0() -> None:
    # ZB-V on 2 ranks: rank 0 runs stages 0 and 3 (the last: it computes the loss), rank 1 stages 1 and 2.
    plan = plan_with_starts(MODELS / "gpt.py", [0, 2, 4, 5], schedule="zbv", stages_per_rank=2)
    assert [s.rank for s in plan.stages] == [0, 1, 1, 0] and plan.n_ranks == 2 and plan.stages_per_rank == 2
    ranks = [
        _rank(1, (0.5, 0.2, 0.9), stages=(1, 2)),
        _rank(0, (0.6, 0.1, 0.8), losses=(2.0, 1.5, 1.2), stages=(0, 3)),
    ]
    got = run_result(plan, ranks, mode="pipeline")
    assert got.losses == [2.0, 1.5, 1.2] and got.n_stages == 4
    assert [s.stage for s in got.stages] == [0, 1, 2, 3]
    assert got.rank_step_times_s == [[0.6, 0.1, 0.8], [0.5, 0.2, 0.9]]
