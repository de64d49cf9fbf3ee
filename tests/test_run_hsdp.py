"""Tier 3 (4 gloo processes): HSDP in the runner (``dp_mode`` "hsdp").

Four replicas in two shard groups of two (``fully_shard`` on the 2-D (dp_replicate, dp_shard)
mesh) train as the unsplit model does, with one unit per stage and block by block; each rank holds
half of the state (FSDP over all four, a quarter); a checkpoint written under HSDP resumes under
FSDP; with each replica's rank split over 2 tensor-parallel ranks (8 processes) too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from run_factory import MODELS, assert_close, assert_resumes_under, plan_with_starts, saved  # noqa: E402

from planner.run import run_plan, train_reference  # noqa: E402
from planner.schema.run_request import RunRequest  # noqa: E402

pytestmark = pytest.mark.multiprocess


def _hsdp(**kw: object):  # type: ignore[no-untyped-def]
    base = dict(schedule="1f1b", batch_size=8, n_microbatches=2, dp=4, dp_mode="hsdp", dp_shard=2)
    return plan_with_starts(MODELS / "gpt.py", [0], **{**base, **kw})  # type: ignore[arg-type]


def test_two_groups_of_two_train_like_the_unsplit_model_holding_half_the_state(tmp_path: Path) -> None:
    plan = _hsdp()
    path = saved(plan, tmp_path)
    got = run_plan(plan, RunRequest(plan_file=path, steps=3, echo=False, save_checkpoints=False))
    want = train_reference(plan, path, 3)
    assert got.replicas == 4
    assert_close(got.losses, want.losses, "loss")
    assert_close(got.grad_norms, want.grad_norms, "grad norm")  # clipped: the norm counts each shard once
    (stage,) = got.stages
    assert stage.memory is not None
    held = stage.memory.end_by_category
    # fp32 weights and gradients sharded 2 ways (FSDP pads each parameter to a multiple of 2)
    from planner.capture.load import load_model_file

    params = sum(p.numel() for p in load_model_file(MODELS / "gpt.py", "tiny").build(0).parameters())
    assert 4 * params / 2 <= held["Parameter"] == held["Gradient"] < 4 * params / 2 * 1.01


def test_block_units_with_full_recompute_train_like_the_unsplit_model(tmp_path: Path) -> None:
    plan = _hsdp(schedule="gpipe", fsdp_units="block")
    plan = plan.model_copy(update={"stages": [s.model_copy(update={"recompute": "full"}) for s in plan.stages]})
    path = saved(plan, tmp_path)
    got = run_plan(plan, RunRequest(plan_file=path, steps=2, echo=False, save_checkpoints=False))
    want = train_reference(plan, path, 2)
    assert_close(got.losses, want.losses, "loss")
    assert_close(got.grad_norms, want.grad_norms, "grad norm")


def test_an_hsdp_checkpoint_resumes_under_fsdp(tmp_path: Path) -> None:
    kw = dict(schedule="gpipe", optimizer="sgd", lr=0.5)
    fsdp = plan_with_starts(MODELS / "gpt.py", [0], batch_size=8, n_microbatches=2, dp=4, dp_mode="fsdp", **kw)  # type: ignore[arg-type]
    assert_resumes_under(_hsdp(**kw), fsdp, tmp_path)


def test_hsdp_over_tensor_parallel_ranks_trains_like_the_unsplit_model(tmp_path: Path) -> None:
    # 8 processes: 2 groups x 2 replicas x tp 2; fully_shard's 2-D mesh and the tp mesh share one root
    plan = plan_with_starts(
        MODELS / "llama.py",
        [0],
        schedule="1f1b",
        batch_size=8,
        n_microbatches=2,
        dp=4,
        dp_mode="hsdp",
        dp_shard=2,
        tp=2,
    )
    path = saved(plan, tmp_path)
    got = run_plan(plan, RunRequest(plan_file=path, steps=2, echo=False, save_checkpoints=False))
    want = train_reference(plan, path, 2)
    assert len(got.rank_step_times_s) == 8
    assert_close(got.losses, want.losses, "loss")
    assert_close(got.grad_norms, want.grad_norms, "grad norm")
