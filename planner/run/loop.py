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
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from planner.errors import PlannerError
from planner.run.console import step_line, step_note
from planner.run.gradients import clip_and_step
from planner.run.measure import MemoryProbe, StageProbe, memory_step_of, summarize
from planner.schema.plan import Plan
from planner.schema.result import EvalMeasure, MemoryMeasure, RunResult, StageMeasure, timed_steps

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
        replica: the data-parallel replica the rank belongs to (``rank`` is its global rank).
        first_step: the run's number of its first step (> 1: resumed from a checkpoint).
        peak_device_bytes: the most device memory allocated (CUDA; None on CPU).
        evals: (step, mean held-out loss, batches) per evaluation (``--data``).
        checkpoints: the checkpoint folders written (rank 0 of the run reports them).
    """

    rank: int
    losses: tuple[float, ...]
    grad_norms: tuple[float, ...]
    times: tuple[float, ...]
    threads: int
    peak_rss_bytes: int
    memory_step: int | None
    measures: tuple[StageMeasure, ...]
    replica: int = 0
    first_step: int = 1
    peak_device_bytes: int | None = None
    evals: tuple[tuple[int, float, int], ...] = ()
    checkpoints: tuple[str, ...] = ()


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
        scheduler: the learning-rate schedule, stepped after each optimizer step (None: constant).
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
    scheduler: Any | None = None


@dataclass
class Progress:
    """How far ``train_steps`` got, readable after it raised (a worker's failure record).

    Attributes:
        step: the step being run (0: none started yet).
        done: the steps completed.
        partial: this rank's figures for the completed steps, set when training stopped early
            (None: it did not, or no step completed).
    """

    step: int = 0
    done: int = 0
    partial: RankResult | None = None


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
    progress: Progress | None = None,
    first_step: int = 1,
    after_step: Callable[[int], None] | None = None,
) -> RankResult:
    """Train ``rank`` for ``steps`` optimizer steps and measure every one.

    A step's time runs from just before ``zero_grad`` to just after ``optimizer.step()``: every
    microbatch, the global-norm clipping and the optimizer, not the batch draw. The last step
    (of two or more) runs under the memory tracker when ``track_memory``.

    Args:
        rank: the model, optimizer and microbatch runner of this rank.
        batches: the plan's data stream; one full batch is drawn per step on every rank.
        steps: the run's last step (optimizer steps, counted from 1 over every launch).
        max_norm: the global gradient norm to clip to (None: no clipping).
        probes: the microbatch timers of the rank's stages (as ``rank.stages``), which
            ``rank.run_microbatches`` records into.
        track_memory: run the last step (of two or more) under the memory tracker.
        echo: print one line per step (on ranks that compute the loss).
        print_fn: where those lines go.
        progress: updated as the steps run; when training stops early (any exception, Ctrl-C),
            it keeps the completed steps' figures before the exception propagates.
        first_step: the run's number of the first step (> 1: resumed from a checkpoint); the
            steps run are ``first_step .. steps``.
        after_step: called with the step's number after each step, outside its time (checkpoints,
            evaluation).

    Returns:
        This rank's figures.

    Raises:
        ModelFileError: the model file's data stream failed or ran out.
    """
    n = steps - first_step + 1
    memory_step = memory_step_of(n) if track_memory else None
    memory = MemoryProbe(rank.device)
    rec = _Record()
    progress = progress if progress is not None else Progress()
    progress.step = progress.done = first_step - 1
    bar = _bar(n, first_step, steps) if echo and sys.stdout.isatty() else None
    lines = _StepLines(steps, first_step, memory_step, print_fn if echo and bar is None else None, bar)
    try:
        _run_steps(
            rank, batches, first_step, n, max_norm, probes, memory, memory_step, rec, lines, progress, after_step
        )
    except BaseException:
        if rec.times:
            progress.partial = _rank_result(rank, probes, _completed(rec), memory_step, memory.result)
        raise
    finally:
        if bar is not None:
            bar.close()
    return _rank_result(rank, probes, rec, memory_step, memory.result)


def _bar(n: int, first_step: int, steps: int) -> Any:
    """A progress bar over the steps of this launch (at a terminal; logs get one line per step)."""
    from tqdm import tqdm

    return tqdm(total=steps, initial=first_step - 1, unit="step", dynamic_ncols=True, leave=True)


@dataclass
class _StepLines:
    """Where each step is reported: a progress bar at a terminal, else one line per step."""

    steps: int
    first_step: int
    memory_step: int | None
    print_fn: Callable[[str], None] | None
    bar: Any

    def show(self, local: int, loss: float | None, seconds: float) -> None:
        step = self.first_step + local - 1
        if self.bar is not None:
            if loss is not None:
                self.bar.set_postfix_str(f"loss {loss:.4f}  {seconds * 1e3:.1f} ms", refresh=False)
            self.bar.update(1)
        elif self.print_fn is not None and loss is not None:
            note = step_note(local, self.memory_step)
            self.print_fn(step_line(step, self.steps, loss, seconds, note))


def _completed(rec: _Record) -> _Record:
    """``rec`` cut to the steps that finished (a step that failed may have left some figures)."""
    n = len(rec.times)
    return _Record(
        losses=rec.losses[:n],
        norms=rec.norms[:n],
        times=rec.times,
        clip=rec.clip[:n],
        opt=rec.opt[:n],
        reduce=rec.reduce[:n],
    )


def _run_steps(
    rank: RankModel,
    batches: Iterator[tuple[Sequence[Any], torch.Tensor]],
    first_step: int,
    n: int,
    max_norm: float | None,
    probes: Sequence[StageProbe],
    memory: MemoryProbe,
    memory_step: int | None,
    rec: _Record,
    lines: _StepLines,
    progress: Progress,
    after_step: Callable[[int], None] | None,
) -> None:
    """The steps of ``train_steps``, recording into ``rec`` and ``progress``. ``step`` counts this
    launch's steps from 1 (the records' index); ``progress`` and ``after_step`` get the run's own
    step numbers (``first_step`` onwards)."""
    reduce = _timed_reduce(rank.reduce, rec.reduce)
    for step in range(1, n + 1):
        progress.step = first_step + step - 1
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
            if rank.scheduler is not None:
                rank.scheduler.step()
            t1 = time.perf_counter()
            if done is not None:
                done()  # the end-of-step snapshot: gradients and optimizer state in full
        _stop_if_not_finite(progress.step, mb_losses, norm)
        rec.times.append(t1 - t0)
        rec.norms.append(norm)
        rec.clip.append(clip_s)
        rec.opt.append(opt_s)
        if mb_losses is not None:
            rec.losses.append(float(torch.stack([loss.detach() for loss in mb_losses]).mean()))
        progress.done = progress.step
        lines.show(step, rec.losses[-1] if mb_losses is not None else None, rec.times[-1])
        if after_step is not None:
            after_step(progress.step)  # checkpoint, evaluation: outside the step's time


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
        mode: "pipeline" (one process per rank) or "local" (the whole model in this process).
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
    # Replicas run the same stages and agree on the (replica-averaged) loss: stage figures come
    # from the lowest replica that reported, step times from every rank.
    first_replica = min(r.replica for r in ranks)
    # A pipeline rank's tensor-parallel ranks run the same stages on the same data: its tp rank 0 speaks for them.
    tp = getattr(plan, "tp", 1)
    one = [r for r in ranks if r.replica == first_replica and r.rank % tp == 0] or [
        r for r in ranks if r.replica == first_replica
    ]
    # the rank that holds the last stage computes the loss (rank 0 under a V placement)
    last = next((r for r in one if any(m.stage == n_stages - 1 for m in r.measures)), None)
    steps = min(len(r.times) for r in ranks)
    step_times = [max(r.times[i] for r in ranks) for i in range(steps)]
    memory_step = ranks[0].memory_step
    timed = timed_steps(steps, memory_step)
    # no timed step (1 or 2 steps: set-up and memory-tracked): no median, rather than one of those
    median = RunResult.median_of(step_times, timed) if timed else None
    samples_per_s = plan.batch_size / median if median else None
    tokens = plan.profile.tokens_per_sample
    evals = last.evals if last is not None else ()
    devices = [r.peak_device_bytes for r in ranks if r.peak_device_bytes is not None]
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
        losses=list(last.losses[:steps]) if last is not None else [],
        grad_norms=list(ranks[0].grad_norms[:steps]),
        grad_clip=plan.optimizer.grad_clip,
        step_times_s=step_times,
        rank_step_times_s=[list(r.times[:steps]) for r in ranks],
        median_step_s=median,
        peak_rss_bytes=[r.peak_rss_bytes for r in ranks],
        predicted_step_s=plan.prediction.step_time_s,
        memory_step=memory_step,
        timed_steps=timed,
        stages=sorted((m for r in one for m in r.measures), key=lambda m: m.stage),
        first_step=ranks[0].first_step,
        replicas=getattr(plan, "dp", 1),
        samples_per_s=samples_per_s,
        tokens_per_s=samples_per_s * tokens if samples_per_s is not None and tokens else None,
        peak_device_bytes=[int(b) for b in devices],
        evals=[EvalMeasure(step=s, loss=loss, perplexity=_perplexity(loss), batches=b) for s, loss, b in evals],
        checkpoints=sorted({c for r in ranks for c in r.checkpoints}),
    )


def _perplexity(loss: float) -> float:
    """exp(loss), capped so a diverged loss stays a finite number in run.json."""
    return math.exp(min(loss, 700.0))
