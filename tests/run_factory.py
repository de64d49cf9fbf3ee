"""Real plans for the runner's tests, assembled directly (no CLI, no profiling).

The runner only reads the stage ranges, the model reference and the run settings, so block costs
and predictions are plausible made-up numbers. The fingerprint and block names come from tracing
the model exactly as the planner does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from planner.capture.load import load_model_file
from planner.capture.trace import trace_model
from planner.core.schedules import stage_ranks
from planner.costs.blocks import ties_of
from planner.schema.costs import GLOO_CPU_LINK, BlockCost, OptimizerSpec
from planner.schema.plan import ModelRef, Plan, Prediction, ProfileInfo, StagePlan

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
REL = 1e-4


def make_plan(
    model_path: Path,
    starts: list[int],
    *,
    size: str | None = "tiny",
    schedule: str = "gpipe",
    batch_size: int = 8,
    n_microbatches: int = 4,
    grad_clip: float | None = 1.0,
    optimizer: str = "adamw",
    lr: float = 1e-3,
    backend: str = "gloo",
    seed: int = 0,
    stages_per_rank: int = 1,
    record_ties: bool = True,
    dp: int = 1,
    dp_mode: str = "ddp",
) -> Plan:
    """A valid Plan for ``model_path`` whose stages start at the blocks in ``starts`` (placed on ranks
    as ``schedule`` places ``stages_per_rank`` stages per rank), run as ``dp`` replicas."""
    mf = load_model_file(model_path, size)
    inputs, _ = mf.batch(batch_size // (dp * n_microbatches), seed=seed)
    traced = trace_model(mf.build(seed), inputs)
    n = len(traced.blocks)
    blocks = [
        BlockCost(
            name=b.name,
            first_node=b.nodes[0],
            last_node=b.nodes[-1],
            fwd_s=1e-3,
            bwd_s=2e-3,
            params=1000,
            param_bytes=4000,
            activation_bytes=10_000,
            cut_bytes=traced.cuts[k].nbytes if k < n - 1 else 0,
            cut_tensors=len(traced.cuts[k].tensors) if k < n - 1 else 0,
            cut_legal=traced.cuts[k].legal if k < n - 1 else False,
            is_layer=b.is_layer,
        )
        for k, b in enumerate(traced.blocks)
    ]
    bounds = [*starts, n]
    n_ranks = len(starts) // stages_per_rank
    ranks = stage_ranks(schedule, n_ranks, stages_per_rank)
    stages = [
        StagePlan(
            index=i,
            rank=ranks[i],
            start=s,
            end=e,
            first_block=blocks[s].name,
            last_block=blocks[e - 1].name,
            split_node=blocks[e - 1].last_node if e < n else None,
            params=1000 * (e - s),
            fwd_s=1e-3 * (e - s),
            bwd_s=2e-3 * (e - s),
            comm_s=3e-3,
            time_s=3e-3 * (e - s) + 3e-3,
            activation_bytes=10_000 * (e - s),
            in_flight=n_microbatches,
            memory_bytes=1 << 20,
        )
        for i, (s, e) in enumerate(zip(bounds, bounds[1:]))
    ]
    times = tuple(st.time_s for st in stages)
    prediction = Prediction(
        starts=tuple(starts),
        stage_time_s=times,
        bottleneck_s=max(times),
        pipeline_time_s=max(times) * (n_microbatches + len(starts) - 1),
        step_time_s=max(times) * (n_microbatches + len(starts) - 1),
        bubble_fraction=0.3,
        imbalance=max(times) * len(times) / sum(times),
        max_memory_bytes=1 << 20,
    )
    return Plan(
        created="2026-11-21T00:00:00+00:00",
        model=ModelRef(
            path=str(model_path),
            size=size,
            config=dict(mf.config),
            file_digest=mf.digest,
            part_digests=mf.part_digests(),
            fingerprint=traced.fingerprint,
            trace_method=traced.method,
            trace_failures=list(traced.failures),
            seed=seed,
        ),
        profile=ProfileInfo(
            device="cpu",
            backend=backend,
            threads=1,
            torch_version=torch.__version__,
            hostname="test",
            warmup=0,
            repeats=1,
        ),
        link=GLOO_CPU_LINK,
        optimizer=OptimizerSpec(name=optimizer, lr=lr, grad_clip=grad_clip),
        method="optimal",
        schedule=schedule,
        n_stages=len(starts),
        n_ranks=n_ranks,
        batch_size=batch_size,
        n_microbatches=n_microbatches,
        blocks=blocks,
        stages=stages,
        prediction=prediction,
        baselines={},
        ties=ties_of(traced) if record_ties else [],
        dp=dp,
        dp_mode=dp_mode,
    )


def saved(plan: Plan, tmp_path: Path) -> Path:
    path = tmp_path / "plan.json"
    plan.save(path)
    return path


def assert_close(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == pytest.approx(w, rel=REL), f"{what}[{i}]: pipeline {g} vs unsplit {w}"
