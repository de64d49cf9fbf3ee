"""The one training loop of ``planner run`` and the one way its figures become a ``RunResult``.

A pipeline rank (``planner.run.worker``) and the in-process runner (``planner.run.single``) both
step through ``train_steps``, so both draw, time, clip, record and print a step the same way.
What differs between them is handed in as a ``RankModel``: how one step's microbatches run (the
plan's ``PipelineStage`` schedule on a rank, gradient accumulation in this process), the
all-reduce that makes the gradient norm global (None in one process) and the tensors the memory
tracker cannot see being made (a stage's receive buffers).

Each rank's figures come back as a ``RankResult`` (from a worker process through
``elastic_launch``, so it is a frozen dataclass of picklable fields); ``run_result`` turns the
ranks of a run into the run.json record.
"""

from __future__ import annotations

import contextlib
import math
import resource
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from planner.errors import PlannerError
from planner.run.common import clip_and_step, memory_step_of, step_line, step_note
from planner.run.measure import MemoryProbe, StageProbe, summarize
from planner.schema.plan import Plan
from planner.schema.result import MemoryMeasure, RunResult, StageMeasure, timed_steps

# (inputs, target) of one step -> its microbatch losses, or None on a rank that computes no loss.
MicrobatchFn = Callable[[Sequence[Any], torch.Tensor], list[torch.Tensor] | None]
# Sums a tensor over the pipeline group (an all-reduce) and returns it on the CPU.
ReduceFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class RankResult:
    """What one rank measured in a run (one per process; the in-process runner is rank 0).

    Attributes:
        rank: the pipeline rank (= stage index).
        losses: per step, the mean microbatch loss; empty on ranks that compute no loss.
        grad_norms: per step, the global gradient norm before clipping.
        times: per step, this rank's step wall time in seconds.
        threads: torch's intra-op threads on this rank.
        peak_rss_bytes: the process's peak resident memory (ru_maxrss).
        memory_step: the step run under the memory tracker (None: none).
        measures: per-microbatch and per-step timers and memory of each stage this rank ran.
    """

    rank: int
    losses: tuple[float, ...]
    grad_norms: tuple[float, ...]
    times: tuple[float, ...]
    threads: int
    peak_rss_bytes: int
    memory_step: int | None
    measures: tuple[StageMeasure, ...]


@dataclass(frozen=True)
class RankModel:
    """What one rank trains and how one step's microbatches run on it.

    Attributes:
        rank: the pipeline rank (0 in this process).
        stages: (stage index, its first block's FQN, its last block's FQN) of every stage this rank
            runs, in the order of ``probes`` given to ``train_steps``.
        module: the module the memory tracker registers (parameters, buffers).
        params: the trainable parameters: clipped and stepped (each once).
        optimizer: their optimizer (None: the rank holds no parameters).
        device: where the module lives (the memory tracker's device).
        run_microbatches: runs forward and backward of every microbatch of one step.
        reduce: sums the squared gradient norm over the pipeline group (None: one process).
        extra_tensors: tensors made before the tracked step that the tracker must count
            ("Other"); called only when that step starts.
        finish_grads: after the microbatches, turns the accumulated gradients into the step's
            (a pipeline rank averages over microbatches and sums tied copies over ranks; None:
            they already are).
        counted: the parameters whose gradients enter the global norm (None: all of ``params``;
            a tied parameter's copies count on the owner's rank only).
    """

    rank: int
    stages: list[tuple[int, str, str]]
    module: nn.Module
    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer | None
    device: torch.device
    run_microbatches: MicrobatchFn
    reduce: ReduceFn | None = None
    extra_tensors: Callable[[], list[torch.Tensor]] = list
    finish_grads: Callable[[], None] | None = None
    counted: list[nn.Parameter] | None = None


@dataclass
class _Record:
    """The per-step figures of one rank, appended to as the steps run."""

    losses: list[float] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    clip: list[float] = field(default_factory=list)
    opt: list[float] = field(default_factory=list)
    reduce: list[float] = field(default_factory=list)


def _timed_reduce(reduce: ReduceFn | None, into: list[float]) -> ReduceFn | None:
    """``reduce`` that appends its seconds to ``into`` (the all-reduce is part of clipping's time,
    and reported on its own too)."""
    if reduce is None:
        return None

    def timed(t: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        out = reduce(t)
        into.append(time.perf_counter() - t0)
        return out

    return timed


def train_steps(
    rank: RankModel,
    batches: Iterator[tuple[Sequence[Any], torch.Tensor]],
    steps: int,
    *,
    max_norm: float | None,
    probes: Sequence[StageProbe],
    track_memory: bool = True,
    echo: bool = False,
    print_fn: Callable[[str], None] = print,
) -> RankResult:
    """Train ``rank`` for ``steps`` optimizer steps and measure every one.

    A step's time runs from just before ``zero_grad`` to just after ``optimizer.step()``: every
    microbatch, the global-norm clipping and the optimizer, not the batch draw. The last step
    (of two or more) runs under the memory tracker when ``track_memory``.

    Args:
        rank: the model, optimizer and microbatch runner of this rank.
        batches: the plan's data stream; one full batch is drawn per step on every rank.
        steps: optimizer steps.
        max_norm: the global gradient norm to clip to (None: no clipping).
        probes: the microbatch timers of the rank's stages (as ``rank.stages``), which
            ``rank.run_microbatches`` records into.
        track_memory: run the last step (of two or more) under the memory tracker.
        echo: print one line per step (on ranks that compute the loss).
        print_fn: where those lines go.

    Returns:
        This rank's figures.

    Raises:
        ModelFileError: the model file's data stream failed or ran out.
    """
    memory_step = memory_step_of(steps) if track_memory else None
    memory = MemoryProbe(rank.device)
    rec = _Record()
    reduce = _timed_reduce(rank.reduce, rec.reduce)
    for step in range(1, steps + 1):
        inputs, target = next(batches)  # every rank draws, so all ranks stay on the same step
        for probe in probes:
            probe.begin_step()
        tracked = (
            memory.step(step, probes, rank.module, rank.optimizer, rank.extra_tensors())
            if step == memory_step
            else None
        )
        with tracked if tracked is not None else contextlib.nullcontext() as done:
            t0 = time.perf_counter()
            if rank.optimizer is not None:
                rank.optimizer.zero_grad(set_to_none=True)
            mb_losses = rank.run_microbatches(inputs, target)
            if rank.finish_grads is not None:
                rank.finish_grads()
            norm, clip_s, opt_s = clip_and_step(rank.params, rank.optimizer, max_norm, reduce, rank.counted)
            t1 = time.perf_counter()
            if done is not None:
                done()  # the end-of-step snapshot: gradients and optimizer state in full
        _stop_if_not_finite(step, mb_losses, norm)
        rec.times.append(t1 - t0)
        rec.norms.append(norm)
        rec.clip.append(clip_s)
        rec.opt.append(opt_s)
        if mb_losses is not None:
            rec.losses.append(float(torch.stack([loss.detach() for loss in mb_losses]).mean()))
            if echo:
                print_fn(step_line(step, steps, rec.losses[-1], rec.times[-1], step_note(step, memory_step)))
    return _rank_result(rank, probes, rec, memory_step, memory.result)


def _stop_if_not_finite(step: int, mb_losses: list[torch.Tensor] | None, norm: float) -> None:
    """Stop the run at the first NaN or infinite loss or gradient norm, naming the step.

    Training on would only spread the NaN into every weight. Checked after the step, so every rank
    has passed the gradient-norm all-reduce and stops at the same step: the last rank names the
    loss, the others the norm (which the NaN reaches through the all-reduce).

    Raises:
        PlannerError: the loss or the global gradient norm is not finite.
    """
    losses = [float(loss.detach()) for loss in mb_losses or []]
    bad = next((v for v in losses if not math.isfinite(v)), None)
    what = (
        f"the loss is {bad}" if bad is not None else (f"the gradient norm is {norm}" if not math.isfinite(norm) else "")
    )
    if what:
        raise PlannerError(
            f"step {step}: {what}; training stopped (lower the plan's learning rate (--lr), keep --grad-clip on, "
            "or check the data and the model for values that overflow)"
        )


def _rank_result(
    rank: RankModel, probes: Sequence[StageProbe], rec: _Record, memory_step: int | None, memory: MemoryMeasure | None
) -> RankResult:
    """One rank's figures once its steps are done (one measure per stage; the per-step figures are the rank's)."""
    steps = len(rec.times)
    several = len(rank.stages) > 1
    measures = tuple(
        summarize(
            stage=index,
            first_block=first,
            last_block=last,
            probe=probe,
            steps=timed_steps(steps, memory_step),
            times=rec.times,
            clip=rec.clip,
            reduce=rec.reduce if rank.reduce is not None else [0.0] * steps,
            opt=rec.opt,
            memory=memory,
            rank=rank.rank if several or index != rank.rank else None,
        )
        for (index, first, last), probe in zip(rank.stages, probes)
    )
    return RankResult(
        rank=rank.rank,
        losses=tuple(rec.losses),
        grad_norms=tuple(rec.norms),
        times=tuple(rec.times),
        threads=torch.get_num_threads(),
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        memory_step=memory_step,
        measures=measures,
    )


def run_result(
    plan: Plan,
    ranks: Sequence[RankResult],
    *,
    mode: Literal["pipeline", "local"],
    plan_path: str | Path | None = None,
    n_microbatches: int | None = None,
) -> RunResult:
    """The run record of one run from its ranks' figures.

    Args:
        plan: the plan that was run.
        ranks: one result per rank that reported (on several nodes: this node's ranks only).
        mode: "pipeline" (one process per stage) or "local" (the whole model in this process).
        plan_path: the plan file, recorded as an absolute path.
        n_microbatches: microbatches per step when they differ from the plan's (the unsplit
            reference trains on full batches).

    Returns:
        The run: step time is the slowest rank's, losses come from the last stage's rank (none
        when it ran on another node), gradient norms from the lowest rank (all ranks agree).

    Raises:
        ValueError: no rank reported.
    """
    if not ranks:
        raise ValueError("a run needs at least one rank's result")
    ranks = sorted(ranks, key=lambda r: r.rank)
    pipeline = mode == "pipeline"
    n_stages = plan.n_stages if pipeline else 1
    # the rank that holds the last stage computes the loss (rank 0 under a V placement)
    last = next((r for r in ranks if any(m.stage == n_stages - 1 for m in r.measures)), None)
    steps = len(ranks[0].times)
    step_times = [max(r.times[i] for r in ranks) for i in range(steps)]
    memory_step = ranks[0].memory_step
    timed = timed_steps(steps, memory_step)
    return RunResult(
        plan_fingerprint=plan.model.fingerprint,
        plan_path=str(Path(plan_path).resolve()) if plan_path is not None else None,
        mode=mode,
        schedule=plan.schedule,
        n_stages=n_stages,
        n_microbatches=plan.n_microbatches if n_microbatches is None else n_microbatches,
        batch_size=plan.batch_size,
        backend=plan.profile.backend if pipeline else "none",
        steps=steps,
        threads=[r.threads for r in ranks],
        losses=list(last.losses) if last is not None else [],
        grad_norms=list(ranks[0].grad_norms),
        grad_clip=plan.optimizer.grad_clip,
        step_times_s=step_times,
        rank_step_times_s=[list(r.times) for r in ranks],
        median_step_s=RunResult.median_of(step_times, timed),
        peak_rss_bytes=[r.peak_rss_bytes for r in ranks],
        predicted_step_s=plan.prediction.step_time_s,
        memory_step=memory_step,
        timed_steps=timed,
        stages=sorted((m for r in ranks for m in r.measures), key=lambda m: m.stage),
    )
