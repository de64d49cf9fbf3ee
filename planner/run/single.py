"""Training in this process, without a pipeline: the 1-stage plan, and the unsplit reference that
a pipelined run must match (the same loss and gradients as the unsplit model, docs/architecture.md).

The model is the user's own ``nn.Module`` from ``build_model`` (not the traced graph), built with
the plan's seed, trained on the same data stream, with the same optimizer and clipping as the
pipeline. With ``n_microbatches > 1`` the batch is split the way the pipeline schedule splits it
(``torch.tensor_split`` on dim 0) and gradients are accumulated with weight 1/m, which is what
``PipelineScheduleSingle(scale_grads=True)`` does; for a mean-reduced loss that equals one
full-batch step.
"""

from __future__ import annotations

import contextlib
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from planner.capture.load import ModelFile
from planner.run.common import clip_and_step, load_plan_model, make_optimizer, memory_step_of, step_line
from planner.run.common import step_note as _note
from planner.run.measure import MemoryProbe, StageProbe, summarize
from planner.schema.plan import Plan
from planner.schema.result import RunResult, StageMeasure, timed_steps
from planner.threads import torch_threads


def _chunks(value: Any, m: int) -> list[Any]:
    """Split a tensor on dim 0 into m pieces; anything else is given to every piece unchanged."""
    if isinstance(value, torch.Tensor):
        return list(torch.tensor_split(value, m, dim=0))
    return [value] * m


def _microbatch(
    model: torch.nn.Module,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    inputs: list[Any],
    target: torch.Tensor,
    i: int,
    n_microbatches: int,
    probe: StageProbe,
) -> torch.Tensor:
    """Forward, loss and backward of microbatch ``i``, timed into ``probe``; its gradient weighs 1/m."""
    if probe.memory is not None:
        probe.memory.reset_mod_stats()  # see StageProbe: one root forward per microbatch
    ta = time.perf_counter()
    out = model(*inputs)
    tb = time.perf_counter()
    loss = loss_fn(out, target)
    tc = time.perf_counter()
    (loss / n_microbatches).backward()
    td = time.perf_counter()
    probe.add_fwd(i, tc - ta)
    probe.add_loss(i, tc - tb)
    probe.add_bwd(i, td - tc)
    return loss.detach()


def train_model_file(
    plan: Plan,
    mf: ModelFile,
    steps: int,
    *,
    n_microbatches: int = 1,
    echo: bool = True,
    print_fn: Callable[[str], None] = print,
    track_memory: bool = True,
    plan_path: str | Path | None = None,
) -> RunResult:
    """Train ``mf``'s unsplit model for ``steps`` steps in this process with the plan's settings.

    Args:
        plan: batch size, optimizer, seed and threads come from here (its stages are ignored).
        mf: the loaded model file, with the plan's config.
        steps: optimizer steps to take.
        n_microbatches: gradient-accumulation microbatches per step (1: one full-batch pass).
        echo: print one progress line per step.
        print_fn: where progress lines go.
        track_memory: run the last step (of two or more) under the memory tracker.
        plan_path: the plan file, recorded in the result.

    Returns:
        The measured run (mode "local", one rank).
    """
    with torch_threads(plan.profile.threads):
        model = mf.build(plan.model.seed)
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = make_optimizer(params, plan)
        batches = mf.train_batches(plan.batch_size, seed=plan.model.seed)
        loss_fn = mf.loss_fn
        memory_step = memory_step_of(steps) if track_memory else None
        probe, memory = StageProbe(), MemoryProbe(torch.device("cpu"))
        losses: list[float] = []
        norms: list[float] = []
        times: list[float] = []
        clip_times: list[float] = []
        opt_times: list[float] = []
        for step in range(1, steps + 1):
            inputs, target = next(batches)
            probe.begin_step()
            tracked = memory.step(step, probe, model, optimizer, []) if step == memory_step else None
            with tracked if tracked is not None else contextlib.nullcontext() as done:
                t0 = time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                split_inputs = [_chunks(x, n_microbatches) for x in inputs]
                split_target = _chunks(target, n_microbatches)
                mb_losses = [
                    _microbatch(
                        model, loss_fn, [xs[i] for xs in split_inputs], split_target[i], i, n_microbatches, probe
                    )
                    for i in range(n_microbatches)
                ]
                norm, clip_s, opt_s = clip_and_step(params, optimizer, plan.optimizer.grad_clip)
                t1 = time.perf_counter()
                if done is not None:
                    done()
            times.append(t1 - t0)
            norms.append(norm)
            clip_times.append(clip_s)
            opt_times.append(opt_s)
            losses.append(float(torch.stack(mb_losses).mean()))
            if echo:
                print_fn(step_line(step, steps, losses[-1], times[-1], _note(step, memory_step)))
    return _local_result(
        plan,
        plan_path,
        n_microbatches,
        steps,
        memory_step,
        probe,
        memory.result,
        losses=losses,
        norms=norms,
        times=times,
        clip=clip_times,
        opt=opt_times,
    )


def _local_result(
    plan: Plan,
    plan_path: str | Path | None,
    n_microbatches: int,
    steps: int,
    memory_step: int | None,
    probe: StageProbe,
    memory_result: dict[str, Any] | None,
    *,
    losses: list[float],
    norms: list[float],
    times: list[float],
    clip: list[float],
    opt: list[float],
) -> RunResult:
    """The run report of an in-process run: one rank that holds the whole model."""
    timed = timed_steps(steps, memory_step)
    return RunResult(
        plan_fingerprint=plan.model.fingerprint,
        plan_path=str(Path(plan_path).resolve()) if plan_path is not None else None,
        mode="local",
        schedule=plan.schedule,
        n_stages=1,
        n_microbatches=n_microbatches,
        batch_size=plan.batch_size,
        backend="none",
        steps=steps,
        threads=[plan.profile.threads],
        losses=losses,
        grad_norms=norms,
        grad_clip=plan.optimizer.grad_clip,
        step_times_s=times,
        rank_step_times_s=[times],
        median_step_s=RunResult.median_of(times, timed),
        peak_rss_bytes=[resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024],
        predicted_step_s=plan.prediction.step_time_s,
        memory_step=memory_step,
        timed_steps=timed,
        stages=[
            StageMeasure.model_validate(
                summarize(
                    stage=0,
                    first_block=plan.blocks[0].name,
                    last_block=plan.blocks[-1].name,
                    probe=probe,
                    steps=timed,
                    times=times,
                    clip=clip,
                    reduce=[0.0] * steps,
                    opt=opt,
                    memory=memory_result,
                )
            )
        ],
    )


def train_reference(plan: Plan, plan_path: str | Path, steps: int, *, echo: bool = False) -> RunResult:
    """The unsplit model trained on full batches in this process: what a pipelined run must match.

    Args:
        plan: the plan whose model, seed, data, optimizer and clipping to use.
        plan_path: the plan file (relative model paths resolve against its folder).
        steps: optimizer steps.
        echo: print one progress line per step.

    Returns:
        The measured run (mode "local", ``n_microbatches`` 1).
    """
    return train_model_file(
        plan,
        load_plan_model(plan, plan_path),
        steps,
        n_microbatches=1,
        echo=echo,
        track_memory=False,
        plan_path=plan_path,
    )
