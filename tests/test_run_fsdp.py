"""Tier 2-3: FSDP block by block in the runner (``fsdp_units`` "block").

Tier 2 (one process): each unit of a stage's chain becomes its own ``fully_shard`` unit and the stage
module the root, with the boundary wrapper left unsharded. Tier 3 (gloo processes): training equals
the unsplit model under every recompute mode, with a tie inside the stage, and a checkpoint written
block by block resumes under stage units.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from run_factory import MODELS, assert_close, assert_resumes_under, plan_with_starts, saved  # noqa: E402

from planner.run import run_plan, train_reference  # noqa: E402
from planner.schema.run_request import RunRequest  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _with_recompute(plan, mode: str):  # type: ignore[no-untyped-def]
    return plan.model_copy(update={"stages": [s.model_copy(update={"recompute": mode}) for s in plan.stages]})


def test_every_unit_is_its_own_fsdp_unit_and_the_wrapper_stays_plain(tmp_path: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from planner.capture.checkpoint import stage_units
    from planner.run.mesh import RankMesh
    from planner.run.model import load_plan_model, planned_source
    from planner.run.stages import build_stages

    plan = plan_with_starts(
        MODELS / "gpt.py", [0], batch_size=8, n_microbatches=2, dp=2, dp_mode="fsdp", fsdp_units="block"
    )
    plan = _with_recompute(plan, "full")
    path = saved(plan, tmp_path)
    # the stages of one replica, sharded over a data-parallel mesh of this one process
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        dp_mesh = init_device_mesh("cpu", (1,))
        mesh = RankMesh(0, 0, 0, dist.group.WORLD, dp_mesh.get_group(), dp_mesh)
        source = planned_source(plan, load_plan_model(plan, path))
        built = build_stages(plan, source, mesh, torch.device("cpu"), want_vocab=False)
    finally:
        dist.destroy_process_group()
    (module,) = built.modules
    assert not isinstance(module, FSDPModule)  # PipelineStage must not take over FSDP's gradient sync
    inner = module.module
    assert isinstance(inner, FSDPModule)  # the root: what two units share
    units = stage_units(inner)
    assert len(units) == len(plan.blocks) and all(isinstance(u, FSDPModule) for u in units)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("model", "starts", "schedule", "recompute"),
    [
        (MODELS / "gpt.py", [0], "1f1b", "never"),
        (MODELS / "gpt.py", [0], "gpipe", "full"),
        (MODELS / "gpt.py", [0], "1f1b", "selective"),
        (MODELS / "gpt.py", [0], "gpipe", "stage"),
        # four stages on the one rank, each sharded with its own root, each recomputing its first block
        (MODELS / "gpt.py", [0, 2, 4, 6], "interleaved-1f1b", "full:1"),
        # embedding and head tied inside the one stage: their units stay with the root
        (FIXTURES / "dies_at.py", [0], "gpipe", "never"),
    ],
    ids=["gpt-never", "gpt-full", "gpt-selective", "gpt-stage", "gpt-looped", "tied"],
)
def test_block_units_train_like_the_unsplit_model(
    tmp_path: Path, model: Path, starts: list[int], schedule: str, recompute: str
) -> None:
    plan = plan_with_starts(
        model,
        starts,
        schedule=schedule,
        batch_size=8,
        n_microbatches=2,
        dp=2,
        dp_mode="fsdp",
        fsdp_units="block",
        stages_per_rank=len(starts),
    )
    plan = _with_recompute(plan, recompute)
    path = saved(plan, tmp_path)
    got = run_plan(plan, RunRequest(plan_file=path, steps=3, save_checkpoints=False, echo=False))
    want = train_reference(plan, path, 3)
    assert got.replicas == 2
    assert_close(got.losses, want.losses, "loss")
    assert_close(got.grad_norms, want.grad_norms, "grad norm")


@pytest.mark.multiprocess
def test_block_units_over_a_pipeline_train_like_the_unsplit_model(tmp_path: Path) -> None:
    plan = plan_with_starts(
        MODELS / "gpt.py",
        [0, 4],
        schedule="1f1b",
        batch_size=8,
        n_microbatches=2,
        dp=2,
        dp_mode="fsdp",
        fsdp_units="block",
    )
    path = saved(_with_recompute(plan, "full"), tmp_path)
    got = run_plan(plan, RunRequest(plan_file=path, steps=2, save_checkpoints=False, echo=False))
    want = train_reference(plan, path, 2)
    assert len(got.rank_step_times_s) == 4
    assert_close(got.losses, want.losses, "loss")
    assert_close(got.grad_norms, want.grad_norms, "grad norm")


@pytest.mark.multiprocess
def test_a_block_sharded_checkpoint_resumes_under_stage_units(tmp_path: Path) -> None:
    # The units change what is gathered when, not the state: a checkpoint written block by block
    # resumes under one unit per stage to the losses of an uninterrupted run.
    kw = dict(schedule="gpipe", batch_size=8, n_microbatches=2, dp=2, dp_mode="fsdp", optimizer="sgd", lr=0.5)
    stage = plan_with_starts(MODELS / "gpt.py", [0], **kw)  # type: ignore[arg-type]
    blocks = _with_recompute(plan_with_starts(MODELS / "gpt.py", [0], fsdp_units="block", **kw), "full")  # type: ignore[arg-type]
    assert_resumes_under(blocks, stage, tmp_path)
