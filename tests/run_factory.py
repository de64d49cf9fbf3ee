"""Real plans for the runner's tests, assembled directly (no CLI, no profiling), and the one
factory of run reports (``RunResult``) for every test that needs one.

The runner only reads the stage ranges, the model reference and the run settings, so block costs
and predictions are plausible made-up numbers. The fingerprint and block names come from tracing
the model exactly as the planner does. ``edited_copy`` makes the hand-edited plan files that the
tests of the plan-file checks give the commands.

The run reports need no torch (run.json is pure data), so torch is imported only by ``plan_with_starts``:
the pure tests (compare, calibrate, fuzz) build their reports here without it.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from planner.core.step.schedules import stage_ranks
from planner.schema.costs import GLOO_CPU_LINK, BlockCost, OptimizerSpec
from planner.schema.plan import ModelRef, Plan, Prediction, ProfileInfo, StagePlan
from planner.schema.result import MemoryMeasure, RunResult, StageMeasure

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
REL = 1e-4


# models/toy.py made a model whose split its own code cannot run: control flow on a shape (fx cannot
# follow it, torch.export can) and a reshape to the full hidden width, which one tp rank's half lacks
TOY_FULL_WIDTH = (
    "        return self.net2(self.relu(self.net1(x)))\n",
    "        h = self.relu(self.net1(x))\n"
    "        if x.shape[0] > 0:  # control flow on a shape: fx cannot follow it, torch.export can\n"
    "            h = h.reshape(x.shape[0], self.net1.out_features)  # the full width\n"
    "        return self.net2(h)\n\n\n"
    'tp_plan = {"net1": "colwise", "net2": "rowwise"}\n',
)


def plan_with_starts(
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
    tp: int = 1,
    tp_plan: dict[str, str] | None = None,
    accumulation: int = 1,
    fsdp_units: str = "stage",
    dp_shard: int | None = None,
    cut_share: int | None = None,
    overrides: dict[str, Any] | None = None,
    ep: int = 1,
    expert_calls: bool = False,
) -> Plan:
    """A valid Plan for ``model_path`` whose stages start at the blocks in ``starts`` (placed on ranks
    as ``schedule`` places ``stages_per_rank`` stages per rank), run as ``dp`` replicas, each pipeline
    rank split over ``tp`` tensor-parallel ranks by ``tp_plan`` (None: the model file's own), each step
    in ``accumulation`` passes (under hsdp, ``dp_shard`` replicas per shard group); the boundaries
    scattered over ``cut_share`` tensor-parallel ranks (None: ``tp``, as the planner plans them; 1: sent
    whole, as plans made before scattering); ``overrides`` replace entries of the size's config (``--set``);
    each mixture-of-experts layer's experts sharded over ``ep`` replicas; ``expert_calls``: the trace
    records the experts' calls without ``ep`` (context parallelism runs them as modules)."""
    import torch

    from planner.capture.ep_plan import resolve_experts
    from planner.capture.load import load_model_file
    from planner.capture.tp_plan import resolve_tp_plan
    from planner.capture.trace import trace_model
    from planner.costs.blocks import ties_of

    mf = load_model_file(model_path, size, overrides)
    inputs, _ = mf.batch(batch_size // (dp * accumulation * n_microbatches), seed=seed)
    model = mf.build(seed)
    experts = resolve_experts(mf, model).counts
    traced = trace_model(model, inputs, experts=tuple(experts) if ep > 1 or expert_calls else ())
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
            cut_share=tp if cut_share is None else cut_share,
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
            expert_calls=ep > 1 or expert_calls,
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
        tp=tp,
        tp_plan=(resolve_tp_plan(mf, traced.model).plan if tp_plan is None else tp_plan) if tp > 1 else {},
        accumulation=accumulation,
        fsdp_units=fsdp_units,
        dp_shard=dp_shard,
        experts=experts,
        ep=ep,
    )


def saved(plan: Plan, tmp_path: Path) -> Path:
    path = tmp_path / "plan.json"
    plan.save(path)
    return path


def edited_copy(plan_file: Path, edit: Callable[[dict[str, Any]], None], out: Path) -> Path:
    """A copy of a plan file with its JSON edited as a hand or another version might have: what the
    tests of the plan-file checks give ``planner run`` and ``planner report``.

    Args:
        plan_file: the plan.json to copy (left as it is, so several tests can share one).
        edit: changes the parsed JSON object in place.
        out: where the edited copy goes.

    Returns:
        ``out``.
    """
    raw = json.loads(plan_file.read_text())
    edit(raw)
    out.write_text(json.dumps(raw))
    return out


def assert_trains_like_unsplit(plan: Plan, tmp_path: Path, what: str, steps: int = 2) -> None:
    """Save ``plan``, train it ``steps`` steps with ``planner run`` and with the unsplit model: the
    losses and global gradient norms agree at rel ``REL``."""
    from planner.run import run_plan, train_reference
    from planner.schema.run_request import RunRequest

    path = saved(plan, tmp_path)
    got = run_plan(plan, RunRequest(plan_file=path, steps=steps))
    want = train_reference(plan, path, steps)
    assert got.losses == pytest.approx(want.losses, rel=REL), what
    assert got.grad_norms == pytest.approx(want.grad_norms, rel=REL), what


def assert_close(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == pytest.approx(w, rel=REL), f"{what}[{i}]: pipeline {g} vs unsplit {w}"


def assert_resumes_under(writer: Plan, reader: Plan, tmp_path: Path) -> None:
    """A checkpoint ``writer`` saves after 2 steps resumes under ``reader`` (the same state, run another
    way) to the losses and gradient norms of an uninterrupted 4-step run of ``reader``."""
    from planner.run import run_plan
    from planner.schema.run_request import RunRequest

    (tmp_path / "reader").mkdir()
    (tmp_path / "writer").mkdir()
    reader_path, writer_path = saved(reader, tmp_path / "reader"), saved(writer, tmp_path / "writer")
    whole = run_plan(reader, RunRequest(plan_file=reader_path, steps=4, checkpoint_dir=tmp_path / "whole", echo=False))
    ckpt = tmp_path / "ckpt"
    first = run_plan(writer, RunRequest(plan_file=writer_path, steps=2, checkpoint_dir=ckpt, echo=False))
    assert_close(first.losses, whole.losses[:2], "loss")
    resumed = run_plan(reader, RunRequest(plan_file=reader_path, steps=4, checkpoint_dir=ckpt, resume=True, echo=False))
    assert resumed.first_step == 3
    assert_close(resumed.losses, whole.losses[2:], "loss")
    assert_close(resumed.grad_norms, whole.grad_norms[2:], "grad norm")


def stage_report(
    stage: StagePlan | int,
    *,
    fwd_s: float,
    bwd_s: float,
    step_s: float,
    optimizer_s: float = 0.0,
    loss_s: float = 0.0,
    p2p_s: float = 0.0,
    reduce_s: float = 0.0,
    clip_s: float = 0.0,
    fwd_times_s: list[list[float]] | None = None,
    bwd_times_s: list[list[float]] | None = None,
    memory: MemoryMeasure | None = None,
) -> StageMeasure:
    """One stage's figures in a run report.

    Args:
        stage: a plan's stage (its index and blocks), or a stage index (blocks named ``b<i>``).
        fwd_s, bwd_s, step_s, optimizer_s, loss_s, p2p_s, reduce_s, clip_s: the medians.
        fwd_times_s, bwd_times_s: [step][microbatch] times (None: one step of one microbatch at the
            median).
        memory: the tracked step's memory (None: not tracked).
    """
    index = stage if isinstance(stage, int) else stage.index
    first = f"b{stage}" if isinstance(stage, int) else stage.first_block
    last = f"b{stage}" if isinstance(stage, int) else stage.last_block
    return StageMeasure(
        stage=index,
        first_block=first,
        last_block=last,
        fwd_s=fwd_s,
        bwd_s=bwd_s,
        loss_s=loss_s,
        p2p_s=p2p_s,
        reduce_s=reduce_s,
        clip_s=clip_s,
        optimizer_s=optimizer_s,
        step_s=step_s,
        fwd_times_s=[[fwd_s]] if fwd_times_s is None else fwd_times_s,
        bwd_times_s=[[bwd_s]] if bwd_times_s is None else bwd_times_s,
        memory=memory,
    )


def plan_stage_reports(
    plan: Plan, *, step_s: float, factor: float = 1.0, per_microbatch: bool = True
) -> list[StageMeasure]:
    """Every stage of ``plan`` as run at ``factor`` x its planned forward, backward and optimizer times.

    Args:
        plan: the plan.
        step_s: each stage's median step.
        factor: measured / planned.
        per_microbatch: record one step of one microbatch at the medians (False: no per-microbatch times).
    """
    return [
        stage_report(
            s,
            fwd_s=factor * s.fwd_s,
            bwd_s=factor * s.bwd_s,
            optimizer_s=factor * s.opt_s,
            step_s=step_s,
            fwd_times_s=None if per_microbatch else [],
            bwd_times_s=None if per_microbatch else [],
        )
        for s in plan.stages
    ]


def run_report(
    plan: Plan | None = None,
    *,
    step_times_s: list[float],
    stages: list[StageMeasure] | None = None,
    ranks: int | None = None,
    losses: list[float] | None = None,
    grad_norms: list[float] | None = None,
    rank_step_times_s: list[list[float]] | None = None,
    timed_steps: list[int] | None = None,
    median_step_s: float | None = None,
    **fields: Any,
) -> RunResult:
    """A run report (run.json) with the given figures; what is not given is a plausible constant.

    Args:
        plan: the plan run (its fingerprint, schedule, stages, microbatches, batch); None: a 2-stage
            1F1B run of 4 microbatches of a batch of 8 of model ``"f" * 16``.
        step_times_s: the step times; the run has as many steps.
        stages: the per-stage figures (None: none).
        ranks: how many ranks (threads, peak memory and step times per rank); None: the plan's
            world size, else its stage count.
        losses, grad_norms: per step (None: 1.0 each).
        rank_step_times_s: per rank and step (None: every rank at ``step_times_s``).
        timed_steps: the steps the medians are over (None: step 2, after the set-up step).
        median_step_s: None: the median of ``step_times_s`` over ``timed_steps`` (None without one).
        fields: any other ``RunResult`` field, as given (``mode``, ``status``, ``memory_step``...).
    """
    steps = len(step_times_s)
    base: dict[str, Any] = {
        "plan_fingerprint": "f" * 16,
        "schedule": "1f1b",
        "n_stages": 2,
        "n_microbatches": 4,
        "batch_size": 8,
    }
    if plan is not None:
        base = {
            "plan_fingerprint": plan.model.fingerprint,
            "schedule": plan.schedule,
            "n_stages": plan.n_stages,
            "n_microbatches": plan.n_microbatches,
            "batch_size": plan.batch_size,
        }
    n = ranks if ranks is not None else plan.world_size if plan is not None else base["n_stages"]
    timed = [2] if timed_steps is None else timed_steps
    values: dict[str, Any] = {
        **base,
        "mode": "pipeline",
        "backend": "gloo",
        "steps": steps,
        "threads": [1] * n,
        "losses": [1.0] * steps if losses is None else losses,
        "grad_norms": [1.0] * steps if grad_norms is None else grad_norms,
        "grad_clip": 1.0,
        "step_times_s": step_times_s,
        "rank_step_times_s": [list(step_times_s)] * n if rank_step_times_s is None else rank_step_times_s,
        # no timed step (a run of one or two, or cut short): no median, as the runner reports it
        "median_step_s": median_step_s
        if median_step_s is not None or not timed
        else RunResult.median_of(step_times_s, timed),
        "peak_rss_bytes": [1] * n,
        "timed_steps": timed,
        "stages": stages or [],
    }
    return RunResult(**{**values, **fields})


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (bound once and released): a rendezvous endpoint for tests."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
