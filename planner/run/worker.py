"""One pipeline rank: the function ``elastic_launch`` starts in every worker process.

Rank r runs the plan's stages placed on it (one, or several for interleaved, looped and V-shaped
schedules) as ``torch.distributed.pipelining.PipelineStage`` objects under torch's own class for
the plan's schedule (``get_schedule_class``: ``ScheduleGPipe`` / ``Schedule1F1B`` with one stage,
``PipelineScheduleMulti`` subclasses with a list). Every rank rebuilds the whole model from the
model file with the plan's seed, traces it the same way the planner did and keeps only its own
stages (``build_stage_module`` shares parameters with the trace, so the rest is freed).

Every rank iterates the same data stream so the ranks agree on the step count; the rank holding
stage 0 feeds the inputs, the rank holding the last stage the target (under a V placement both
are rank 0), the others call ``step()`` with nothing.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint

from planner.capture.blocks import TiedParameter, TracedModel
from planner.capture.graph import buffers_restored
from planner.capture.load import ModelFile
from planner.capture.stage import stage_inputs, stage_module, trace_root
from planner.core.schedules import placement
from planner.errors import PlannerError
from planner.run.common import (
    check_ties,
    load_plan_model,
    make_optimizer,
    print_flushed,
    tie_groups,
    trace_for_plan,
)
from planner.run.loop import RankModel, RankResult, train_steps
from planner.run.measure import StageProbe, probes_installed, recv_buffers
from planner.schema.plan import Plan
from planner.schema.request import TORCH_NAMES
from planner.torch_compat import is_view


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

    def __call__(self, *args: object) -> object:
        # Called without nn.Module's hooks, on purpose: the stage's inputs are leaf tensors (the
        # receive buffers), and a module-level grad hook on a leaf breaks ``autograd.grad``, which the
        # zero-bubble schedules' input-only backward uses ("A leaf node was passed to
        # _will_engine_execute_node"); MemTracker installs such hooks on every module it sees called.
        # This wrapper has no hooks of its own; the stage module inside is called normally and
        # receives non-leaf tensors (``_ContiguousGrad``'s outputs).
        return self.forward(*args)

    def forward(self, *args: object) -> object:
        args = tuple(_ContiguousGrad.apply(a) if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args)
        out = self.module(*args)
        if isinstance(out, torch.Tensor):
            return _owned(out)
        if isinstance(out, tuple):
            return tuple(_owned(o) if isinstance(o, torch.Tensor) else o for o in out)
        return out


def _owned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and, if it is a view, copied into its own storage: torch 2.13's input-only
    backward (``stage_backward_input``, zero-bubble schedules) fails on a stage output that is a view."""
    t = t.contiguous()
    return t.clone() if is_view(t) else t


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


def _example_io(traced: TracedModel, start: int, stage: torch.nn.Module, inputs: tuple) -> tuple[tuple, tuple]:
    """Real example inputs and outputs of one stage, for ``PipelineStage``'s static mode.

    Without them ``PipelineStage`` infers shapes at the first step by running every stage on
    *uninitialised* receive buffers (``torch.empty``): an integer tensor crossing a cut (token ids,
    ``torch.arange`` positions) is then garbage and an embedding lookup fails with "index out of
    range". So each rank runs the blocks before its stage once on the example microbatch (with
    autograd on, so ``requires_grad`` of every boundary tensor is what training will see).
    """
    # Same shapes and dtypes as training. torch.export's modules refuse .eval(), so train mode stays
    # on: the buffers are put back (batch norm's running statistics) and the RNG too (dropout), so
    # training starts exactly where the unsplit model's does.
    with buffers_restored(trace_root(traced)), torch.random.fork_rng(devices=[]), torch.enable_grad():
        x = stage_inputs(inputs)
        if start > 0:
            prefix = stage_module(traced, 0, start)
            x = tuple(t.detach().contiguous().requires_grad_(t.requires_grad) for t in _as_tuple(prefix(*x)))
        y = _as_tuple(stage(*x))
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
    if world != plan.n_ranks:
        raise PlannerError(
            f"{world} processes joined the run but the plan has {plan.n_ranks} ranks; "
            "start n_ranks / nnodes processes on every node"
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
        return _train_rank(plan, plan_path, steps, echo, rank, device)
    finally:
        dist.destroy_process_group()


@dataclass
class _RankStages:
    """What ``_build_stages`` makes for one rank."""

    modules: list[torch.nn.Module]
    params: list[torch.nn.Parameter]  # trainable, each once (stages on one rank may share a tied one)
    optimizer: torch.optim.Optimizer | None
    stages: list[Any]  # PipelineStage
    schedule: Any
    finish_grads: Callable[[], None]
    counted: list[torch.nn.Parameter] | None


def _grad_finisher(
    plan: Plan, ties: list[TiedParameter], rank: int, params: list[torch.nn.Parameter]
) -> tuple[Callable[[], None], set[int]]:
    """What turns the microbatches' accumulated gradients into the step's, and the tied copies this
    rank must leave out of the global norm.

    1. Every gradient is divided by the microbatch count, once per parameter. (torch's
       ``scale_grads=True`` divides per stage, so a tied parameter that two stages on one rank share
       would be divided twice.) With a mean-reduced loss this gives the full-batch gradient.
    2. Each tied parameter's gradient is summed over the ranks holding a copy, so every copy takes
       the same step. Every rank creates every group, in the same order (``dist.new_group`` is
       collective over the whole world), and joins the all-reduce of the groups it is in.
    """
    mine: list[tuple[torch.nn.Parameter, Any]] = []
    not_counted: set[int] = set()
    for tie, ranks in tie_groups(plan, ties):
        if len(ranks) < 2:
            continue  # one rank holds every reader: its stages share the one parameter
        group = dist.new_group(ranks)
        if rank in ranks:
            mine.append((tie.param, group))
            if rank != ranks[0]:
                not_counted.add(id(tie.param))
    scale = 1.0 / plan.n_microbatches

    def finish() -> None:
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(scale)
        for param, group in mine:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=group)

    return finish, not_counted


def _build_stages(plan: Plan, mf: ModelFile, rank: int, device: torch.device) -> _RankStages:
    """This rank's stage modules, their trainable parameters, one optimizer over them, their
    ``PipelineStage`` objects, the plan's schedule (torch's own class for it) and what finishes
    a step's gradients (``_grad_finisher``)."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    traced = trace_for_plan(plan, mf, mf.build(plan.model.seed))
    ties = check_ties(plan, traced)
    example = mf.batch(plan.microbatch_size, seed=plan.model.seed)[0]
    modules: list[torch.nn.Module] = []
    stages: list[Any] = []
    for stage_plan in plan.stages_of(rank):
        built_module = stage_module(traced, stage_plan.start, stage_plan.end)
        module = ContiguousBoundary(Recomputed(built_module) if stage_plan.recompute else built_module)
        example_in, example_out = _example_io(traced, stage_plan.start, module, example)
        module.to(device)
        modules.append(module)
        stages.append(
            PipelineStage(
                module,
                stage_index=stage_plan.index,
                num_stages=plan.n_stages,
                device=device,
                input_args=tuple(t.to(device) for t in example_in),
                output_args=tuple(t.to(device) for t in example_out),
            )
        )
    del traced  # the other stages' parameters are only referenced from here
    params = list({id(p): p for m in modules for p in m.parameters() if p.requires_grad}.values())
    optimizer = make_optimizer(params, plan)
    finish, not_counted = _grad_finisher(plan, ties, rank, params)
    del ties
    counted = [p for p in params if id(p) not in not_counted] if not_counted else None
    schedule_cls = get_schedule_class(TORCH_NAMES[plan.schedule])
    # scale_grads=False: ``finish`` averages the gradients over microbatches, once per parameter.
    # GPipe and 1F1B take their one stage; the others (PipelineScheduleMulti) a list, even of one.
    target = stages[0] if placement(plan.schedule) == "single" else stages
    schedule = schedule_cls(target, n_microbatches=plan.n_microbatches, loss_fn=mf.loss_fn, scale_grads=False)
    return _RankStages(modules, params, optimizer, stages, schedule, finish, counted)


def _train_rank(plan: Plan, plan_path: str, steps: int, echo: bool, rank: int, device: torch.device) -> RankResult:
    """Build this rank's stages and schedule and train them with the one training loop."""
    mf = load_plan_model(plan, plan_path)
    built = _build_stages(plan, mf, rank, device)
    stages, schedule = built.stages, built.schedule
    mine = plan.stages_of(rank)
    feeds = any(s.index == 0 for s in mine)  # holds the first stage: gives the inputs
    scores = any(s.index == plan.n_stages - 1 for s in mine)  # holds the last stage: the target and loss

    def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
        t = t.to(device)  # nccl reduces device tensors only
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.cpu()

    def run_microbatches(inputs: Sequence[Any], target: torch.Tensor) -> list[torch.Tensor] | None:
        # the first stage's rank feeds the inputs, the last stage's rank the target (one rank may
        # hold both: V placements); the others only relay.
        args = tuple(x.to(device) for x in stage_inputs(inputs)) if feeds else ()
        mb_losses: list[torch.Tensor] = []
        if scores:
            schedule.step(*args, target=target.to(device), losses=mb_losses, return_outputs=False)
            return mb_losses
        schedule.step(*args, return_outputs=False)
        return None

    model = RankModel(
        rank=rank,
        stages=[(s.index, s.first_block, s.last_block) for s in mine],
        module=torch.nn.ModuleList(built.modules),
        params=built.params,
        optimizer=built.optimizer,
        device=device,
        run_microbatches=run_microbatches,
        reduce=all_reduce_sum,
        finish_grads=built.finish_grads,
        counted=built.counted,
        # the receive buffers exist from the first step on; read them when the tracked step starts
        extra_tensors=lambda: [b for st in stages for b in recv_buffers(st)],
    )
    probes = [StageProbe(s.index) for s in mine]
    batches = mf.train_batches(plan.batch_size, seed=plan.model.seed)
    with probes_installed(list(zip(stages, probes)), schedule):
        return train_steps(
            model,
            batches,
            steps,
            max_norm=plan.optimizer.grad_clip,
            probes=probes,
            echo=echo and scores,  # only the rank with the last stage has losses to print
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
