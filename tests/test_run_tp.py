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
