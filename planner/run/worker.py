"""One pipeline rank: the function ``elastic_launch`` starts in every worker process.

Rank r runs stage r of the plan as a ``torch.distributed.pipelining.PipelineStage`` under the
plan's schedule (``ScheduleGPipe`` / ``Schedule1F1B``). Every rank rebuilds the whole model from
the model file with the plan's seed, traces it the same way the planner did and keeps only its
own stage (``build_stage_module`` shares parameters with the trace, so the rest is freed).

Every rank iterates the same data stream so the ranks agree on the step count; rank 0 feeds the
inputs, the last rank the target, the middle ranks call ``step()`` with nothing.

A failure is written as a short JSON record to ``error_dir/rank<R>.json`` and the process exits
with status 1 (``SystemExit``, so neither torch.multiprocessing nor elastic prints a traceback);
the launcher turns the earliest record into one error message.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint

from planner.capture.blocks import GraphTrace
from planner.capture.load import ModelFile
from planner.capture.stage import build_stage_module
from planner.errors import PlannerError
from planner.run.common import load_plan_model, make_optimizer, print_flushed, trace_for_plan
from planner.run.loop import RankModel, RankResult, train_steps
from planner.run.measure import StageProbe, recv_buffers
from planner.schema.plan import Plan


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class ContiguousBoundary(torch.nn.Module):
    """Make every tensor that crosses a stage boundary contiguous, in both directions.

    ``PipelineStage`` sends tensors as they are and gloo refuses non-contiguous ones ("input
    tensor has to be contiguous"); in its dynamic mode it even allocates the receive buffers with
    the stride it observed (``torch.empty_strided``). The gradient of a stage input is often a
    transposed view (attention), so without this a GPT split fails on the first backward send.
    """

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args: object) -> object:
        args = tuple(_ContiguousGrad.apply(a) if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args)
        out = self.module(*args)
        if isinstance(out, torch.Tensor):
            return out.contiguous()
        if isinstance(out, tuple):
            return tuple(o.contiguous() if isinstance(o, torch.Tensor) else o for o in out)
        return out


class Recomputed(torch.nn.Module):
    """Run a stage under activation checkpointing: keep only its inputs per microbatch and rebuild
    its activations during backward (the plan's ``recompute`` flag; non-reentrant
    ``torch.utils.checkpoint``, which also works when the stage's inputs need no grad)."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args: object) -> object:
        return torch.utils.checkpoint.checkpoint(self.module, *args, use_reentrant=False)


def _as_tuple(value: object) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def _example_io(traced: GraphTrace, start: int, stage: torch.nn.Module, inputs: tuple) -> tuple[tuple, tuple]:
    """Real example inputs and outputs of one stage, for ``PipelineStage``'s static mode.

    Without them ``PipelineStage`` infers shapes at the first step by running every stage on
    *uninitialised* receive buffers (``torch.empty``): an integer tensor crossing a cut (token ids,
    ``torch.arange`` positions) is then garbage and an embedding lookup fails with "index out of
    range". So each rank runs the blocks before its stage once on the example microbatch (with
    autograd on, so ``requires_grad`` of every boundary tensor is what training will see).
    """
    # eval(): same shapes and dtypes, but batch norm does not update its running statistics.
    traced.gm.eval()
    stage.eval()
    try:
        with torch.enable_grad():
            x = tuple(inputs)
            if start > 0:
                prefix = build_stage_module(traced, 0, start)
                x = tuple(t.detach().contiguous().requires_grad_(t.requires_grad) for t in _as_tuple(prefix(*x)))
            y = _as_tuple(stage(*x))
    finally:
        traced.gm.train()
        stage.train()
    return x, tuple(t.detach().requires_grad_(t.requires_grad) for t in y)


def _quiet() -> None:
    """Silence library chatter in the worker; real errors still reach the launcher."""
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module=r"torch\.distributed\..*")


def _train(plan: Plan, plan_path: str, steps: int, echo: bool) -> RankResult:
    """Join the process group torchrun-style (from the environment), train this rank, leave the group."""
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    if world != plan.n_stages:
        raise PlannerError(
            f"{world} processes joined the run but the plan has {plan.n_stages} stages; "
            "start n_stages / nnodes processes on every node"
        )
    torch.set_num_threads(plan.profile.threads)
    backend = plan.profile.backend
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    try:
        return _train_rank(plan, plan_path, steps, echo, rank, world, device)
    finally:
        dist.destroy_process_group()


def _build_stage(
    plan: Plan, mf: ModelFile, rank: int, world: int, device: torch.device
) -> tuple[torch.nn.Module, list[torch.nn.Parameter], torch.optim.Optimizer, Any, Any]:
    """This rank's stage module, its trainable parameters, optimizer, its PipelineStage and the plan's schedule."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    traced = trace_for_plan(plan, mf, mf.build(plan.model.seed))
    stage_plan = plan.stages[rank]
    stage_module = build_stage_module(traced, stage_plan.start, stage_plan.end)
    module = ContiguousBoundary(Recomputed(stage_module) if stage_plan.recompute else stage_module)
    example_in, example_out = _example_io(
        traced, stage_plan.start, module, mf.batch(plan.microbatch_size, seed=plan.model.seed)[0]
    )
    del traced  # the other stages' parameters are only referenced from here
    module.to(device)
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, plan)
    stage = PipelineStage(
        module,
        stage_index=rank,
        num_stages=world,
        device=device,
        input_args=tuple(t.to(device) for t in example_in),
        output_args=tuple(t.to(device) for t in example_out),
    )
    schedule_cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[plan.schedule]
    # scale_grads=True: each microbatch's gradient is divided by n_microbatches, so with a
    # mean-reduced loss the accumulated gradient is the full-batch gradient.
    schedule = schedule_cls(stage, n_microbatches=plan.n_microbatches, loss_fn=mf.loss_fn, scale_grads=True)
    return module, params, optimizer, stage, schedule


def _train_rank(
    plan: Plan, plan_path: str, steps: int, echo: bool, rank: int, world: int, device: torch.device
) -> RankResult:
    """Build this rank's stage and schedule and train it with the one training loop."""
    mf = load_plan_model(plan, plan_path)
    module, params, optimizer, stage, schedule = _build_stage(plan, mf, rank, world, device)
    stage_plan = plan.stages[rank]
    is_first, is_last = rank == 0, rank == world - 1

    def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
        t = t.to(device)  # nccl reduces device tensors only
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.cpu()

    def run_microbatches(inputs: Sequence[Any], target: torch.Tensor) -> list[torch.Tensor] | None:
        # rank 0 feeds the inputs, the last rank the target; the middle ranks only relay.
        if is_first:
            schedule.step(*(x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs), return_outputs=False)
            return None
        if is_last:
            mb_losses: list[torch.Tensor] = []
            schedule.step(target=target.to(device), losses=mb_losses, return_outputs=False)
            return mb_losses
        schedule.step(return_outputs=False)
        return None

    model = RankModel(
        rank=rank,
        first_block=stage_plan.first_block,
        last_block=stage_plan.last_block,
        module=module,
        params=params,
        optimizer=optimizer,
        device=device,
        run_microbatches=run_microbatches,
        reduce=all_reduce_sum,
        # the receive buffers exist from the first step on; read them when the tracked step starts
        extra_tensors=lambda: recv_buffers(stage),
    )
    probe = StageProbe()
    batches = mf.train_batches(plan.batch_size, seed=plan.model.seed)
    with probe.installed(stage, schedule):
        return train_steps(
            model,
            batches,
            steps,
            max_norm=plan.optimizer.grad_clip,
            probe=probe,
            echo=echo,  # only the last rank has losses to print
            print_fn=print_flushed,
        )


def run_worker(plan_json: str, plan_path: str, steps: int, echo: bool, error_dir: str) -> RankResult:
    """Entry point of one worker process (top level, so ``spawn`` can pickle it).

    Args:
        plan_json: the plan's JSON text.
        plan_path: the plan file (for resolving the model path).
        steps: optimizer steps.
        echo: the last rank prints one line per step.
        error_dir: where to leave a failure record.

    Returns:
        This rank's measurements (losses only on the last rank).

    Raises:
        SystemExit: any failure, after writing its record to ``error_dir``.
    """
    _quiet()
    try:
        plan = Plan.from_json(plan_json, plan_path)
        return _train(plan, plan_path, steps, echo)
    except BaseException as e:  # noqa: BLE001 - every failure must reach the launcher as a record
        record = {
            "rank": int(os.environ.get("RANK", -1)),
            "time": time.time(),
            "type": type(e).__name__,
            "planner_error": isinstance(e, PlannerError),
            "message": " ".join(str(e).split()) or type(e).__name__,
            "traceback": traceback.format_exc(),
        }
        path = Path(error_dir) / f"rank{record['rank']}.json"
        path.write_text(json.dumps(record))
        sys.stdout.flush()
        raise SystemExit(1) from None
