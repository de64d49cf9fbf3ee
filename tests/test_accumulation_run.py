"""Tier 3: a plan of two pipeline passes per step trains as the unsplit model on whole batches
(real gloo processes on CPU): the passes' gradients accumulate, are scaled by every microbatch of
the step once, clipped by the global norm and stepped once."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from run_factory import MODELS, assert_close, plan_with_starts, saved  # noqa: E402

from planner.run import run_plan, train_reference  # noqa: E402
from planner.schema.run_request import RunRequest  # noqa: E402


@pytest.mark.multiprocess
def test_two_passes_train_as_the_unsplit_model(tmp_path: Path) -> None:
    clip = 0.5
    plan = plan_with_starts(
        MODELS / "gpt.py", [0, 3], schedule="1f1b", batch_size=8, n_microbatches=2, accumulation=2,
        optimizer="sgd", lr=0.5, grad_clip=clip,
    )  # fmt: skip
    assert plan.accumulation == 2 and plan.microbatch_size == 2
    path = saved(plan, tmp_path)
    got = run_plan(plan, RunRequest(plan_file=path, steps=3, echo=False))
    want = train_reference(plan, path, 3)
    assert_close(got.losses, want.losses, "loss")
    assert_close(got.grad_norms, want.grad_norms, "grad norm")
    assert all(g > clip for g in got.grad_norms), "clipping never happened"
