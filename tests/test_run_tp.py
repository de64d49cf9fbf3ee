"""Tier 3: tensor parallelism inside pipeline stages (``Plan.tp``, ``tp_plan``), real gloo processes
on CPU against the unsplit model: losses and global gradient norms (clipping on) equal within 1e-4.

Plans are built by the test factory with ``tp`` and ``tp_plan`` given, not chosen by the planner.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from run_factory import MODELS, assert_close, make_plan, saved  # noqa: E402

from planner.run import run_plan, train_reference  # noqa: E402
from planner.schema.request import RunRequest  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures"


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
def test_llama_tp2_pp2_matches_unsplit_model(tmp_path: Path) -> None:
    plan = make_plan(
        MODELS / "llama.py", [0, 3], schedule="1f1b", n_microbatches=2, optimizer="sgd", lr=0.5, grad_clip=0.5, tp=2
    )
    assert plan.world_size == 4
    got, want = _run_and_compare(plan, tmp_path, save_checkpoints=False)
    assert [s.stage for s in got.stages] == [0, 1]  # one tp rank per pipeline rank reports
    print("llama tp2 pp2", got.losses, want.losses, got.grad_norms, want.grad_norms)


@pytest.mark.multiprocess
def test_tied_embedding_and_head_across_pipeline_ranks_tp2(tmp_path: Path) -> None:
    # stage 0: the embedding; stage 1: both layers (split colwise then rowwise) and the head tied to it
    tp_plan = {"layers.0": "colwise", "layers.1": "rowwise"}
    plan = make_plan(
        FIXTURES / "tied.py", [0, 1], schedule="gpipe", optimizer="sgd", lr=0.5, grad_clip=0.05, tp=2, tp_plan=tp_plan
    )
    assert len(plan.ties) == 1
    got, want = _run_and_compare(plan, tmp_path, save_checkpoints=False)
    print("tied tp2 pp2", got.losses, want.losses, got.grad_norms, want.grad_norms)


@pytest.mark.multiprocess
def test_two_replicas_of_a_tp2_stage_match_one_process(tmp_path: Path) -> None:
    plan = make_plan(
        MODELS / "llama.py", [0], schedule="gpipe", n_microbatches=2, optimizer="adamw", grad_clip=0.5, dp=2, tp=2
    )
    assert (plan.dp, plan.n_ranks, plan.tp, plan.world_size) == (2, 1, 2, 4)
    got, want = _run_and_compare(plan, tmp_path, save_checkpoints=False)
    assert got.replicas == 2
    print("llama dp2 tp2", got.losses, want.losses, got.grad_norms, want.grad_norms)
