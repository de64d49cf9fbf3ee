"""What the launcher, the workers and the in-process loop share: rebuilding the planned model,
checking it is the model the plan was made for, the optimizer and the global-norm clipping.

Every process rebuilds the model from the model file with the plan's seed and config, so every
rank holds the same initial weights without sending any (and the unsplit reference does too).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from planner.capture.blocks import TiedParameter, TracedModel
from planner.capture.load import ModelFile, load_model_file
from planner.capture.stage import trace_root
from planner.capture.trace import trace_model
from planner.core.schedules import SPLIT_BACKWARD, check_schedule, stage_ranks
from planner.errors import PlanFileError, PlannerError
from planner.schema.plan import Plan


def load_plan_model(plan: Plan, plan_path: str | Path) -> ModelFile:
    """Load the plan's model file with exactly the config the plan was made with.

    Args:
        plan: the plan whose model file, size and config to use.
        plan_path: the plan file (a relative model path resolves against its folder).

    Returns:
        The loaded model file, its config replaced by the plan's.

    Raises:
        ModelFileError: the model file is missing or broken.
    """
    mf = load_model_file(plan.model_path(plan_path), plan.model.size)
    mf.config = dict(plan.model.config)
    return mf


def check_runnable(plan: Plan) -> None:
    """Reject plans the runner cannot execute, before any tracing or process.

    Args:
        plan: the plan to check.

    Raises:
        PlannerError: traced by module boundaries, or a 1F1B plan with fewer
            microbatches than stages.
    """
    if plan.profile.source == "estimated" and plan.profile.device != "cpu":
        raise PlannerError(
            f"this plan's costs were estimated for {plan.profile.hardware} ({plan.profile.dtype}), a GPU that is not "
            "here; to train, plan on the machine that runs it (without --gpu-type) and run that plan"
        )
    if plan.dp > 1 and plan.dp_mode == "fsdp" and plan.schedule in SPLIT_BACKWARD:
        raise PlanFileError(
            f"the plan shards {plan.dp} replicas with FSDP under --schedule {plan.schedule}, whose split backward "
            "torch 2.13's FSDP2 does not follow; re-plan with --dp-mode ddp or another schedule"
        )
    if plan.n_ranks > 1:
        # torch's own constructors refuse these
        check_schedule(plan.schedule, plan.n_ranks, plan.n_microbatches, plan.stages_per_rank)
        expected = stage_ranks(plan.schedule, plan.n_ranks, plan.stages_per_rank)
        if [s.rank for s in plan.stages] != expected:
            raise PlanFileError(
                f"the plan places its stages on ranks {[s.rank for s in plan.stages]}, but {plan.schedule} with "
                f"{plan.stages_per_rank} stages per rank runs them on {expected}; re-run `planner plan`"
            )


def check_blocks(plan: Plan, traced: TracedModel) -> None:
    """The plan's blocks are the traced model's, name for name and node for node.

    The fingerprint covers the model; this covers the plan file, whose block list a user may edit
    (a renamed or reordered block would put other layers on a stage than the report shows).

    Raises:
        PlanFileError: the first block that differs, named.
    """
    mine = [(b.name, b.first_node, b.last_node) for b in plan.blocks]
    theirs = [(b.name, b.nodes[0], b.nodes[-1]) for b in traced.blocks]
    if len(mine) != len(theirs):
        raise PlanFileError(
            f"the plan lists {len(mine)} blocks but the model traces into {len(theirs)}; re-run `planner plan`"
        )
    for k, (a, b) in enumerate(zip(mine, theirs)):
        if a != b:
            raise PlanFileError(
                f"block {k} of the plan is {a[0]!r} (nodes {a[1]} .. {a[2]}) but the model's block {k} is "
                f"{b[0]!r} (nodes {b[1]} .. {b[2]}); the plan was edited or is for another model: re-run `planner plan`"
            )


def trace_for_plan(plan: Plan, mf: ModelFile, model: nn.Module) -> TracedModel:
    """Trace ``model`` the way the planner did and check it is the structure the plan was made for.

    Args:
        plan: the plan (microbatch size, seed, tracer, fingerprint).
        mf: the plan's model file (for the example microbatch).
        model: the model freshly built from ``mf`` with the plan's seed.

    Returns:
        The trace (a graph, or module boundaries whose stages are chains of blocks), its buffers
        reset to the freshly built model's.

    Raises:
        PlanFileError: the traced fingerprint differs from the plan's.
        TraceError: the plan's tracer no longer works on the model.
    """
    inputs, _ = mf.batch(plan.microbatch_size, seed=plan.model.seed)
    traced = trace_model(model, inputs, methods=(plan.model.trace_method,))
    if traced.fingerprint != plan.model.fingerprint:
        raise PlanFileError(
            f"plan was made for a different model structure (fingerprint {plan.model.fingerprint}, "
            f"the file now gives {traced.fingerprint}); re-run `planner plan`"
        )
    check_blocks(plan, traced)
    # Tracing ran the (private copy of the) model forward in train mode, which moves batch-norm
    # running statistics; start training from the freshly built buffers like the unsplit model.
    fresh = dict(model.named_buffers())
    with torch.no_grad():
        for name, buf in trace_root(traced).named_buffers():
            if name in fresh and fresh[name].shape == buf.shape:
                buf.copy_(fresh[name])
    return traced


def check_ties(plan: Plan, traced: TracedModel) -> list[TiedParameter]:
    """The traced model's tied parameters, checked against the ties the plan records.

    Args:
        plan: the plan.
        traced: the model traced for it.

    Returns:
        ``traced.tied_parameters()`` (the same list, in the same order, on every rank).

    Raises:
        PlanFileError: a parameter several stages read that the plan does not record (a plan made
            before ties were served, or edited), named by both its names.
    """
    ties = traced.tied_parameters()
    recorded = {(t.names, t.blocks) for t in plan.ties}
    for tie in ties:
        blocks = tuple(traced.blocks[k].name for k in tie.blocks)
        stages = plan.stages_reading(tie.blocks)
        if (tie.names, blocks) not in recorded and len(stages) > 1:
            also = f" (also named {', '.join(tie.names[1:])})" if len(tie.names) > 1 else ""
            raise PlanFileError(
                f"parameter {tie.names[0]}{also} is read by {blocks[0]} on stage {stages[0]} and by {blocks[-1]} on "
                f"stage {stages[-1]} (tied weights), but the plan records no such tie, so its copies would drift "
                "apart; re-run `planner plan` (it records ties, and the runner keeps the copies equal)"
            )
    return ties


def tie_groups(plan: Plan, ties: list[TiedParameter]) -> list[tuple[TiedParameter, list[int]]]:
    """For each tie, the ranks holding a copy of its parameter, the owner's rank first.

    Args:
        plan: the plan (which stage runs which blocks, on which rank).
        ties: ``check_ties(plan, traced)``.

    Returns:
        (tie, ranks) per tie; ranks has one entry when every reader sits on one rank (one copy).
    """
    # stages in order, so the owner's (the first reader's) rank comes first
    return [(tie, list(dict.fromkeys(plan.stages[i].rank for i in plan.stages_reading(tie.blocks)))) for tie in ties]


def make_optimizer(params: Iterable[nn.Parameter], plan: Plan) -> torch.optim.Optimizer | None:
    """The plan's optimizer with torch's defaults for everything the plan does not say.

    Args:
        params: the parameters to optimize, each once.
        plan: the plan whose optimizer name and learning rate to use.

    Returns:
        ``torch.optim.SGD`` or ``torch.optim.AdamW``; None when there is nothing to optimize (a
        stage of parameter-free blocks, a ReLU say, still runs: it only relays activations).
    """
    params = list(params)
    if not params:
        return None
    if plan.optimizer.name == "sgd":
        return torch.optim.SGD(params, lr=plan.optimizer.lr)
    return torch.optim.AdamW(params, lr=plan.optimizer.lr)


def make_scheduler(optimizer: torch.optim.Optimizer | None, steps: int, warmup: int, decay: str) -> Any | None:
    """The learning-rate schedule of ``planner run`` (``--warmup``, ``--lr-decay``), stepped once per step.

    Args:
        optimizer: the rank's optimizer (None: nothing to schedule).
        steps: the run's last step (a cosine or linear decay reaches 0 there).
        warmup: steps of linear warm-up from 0 to the plan's rate (0: none).
        decay: "constant", "linear" or "cosine" after the warm-up.

    Returns:
        A ``torch.optim.lr_scheduler.LambdaLR``, or None for a constant rate without warm-up
        (or no optimizer).
    """
    if optimizer is None or (warmup == 0 and decay == "constant"):
        return None

    def factor(step: int) -> float:
        # ``step`` counts the optimizer steps taken: 0 for the first step's rate.
        if step < warmup:
            return (step + 1) / warmup
        if decay == "constant":
            return 1.0
        left = max(steps - warmup, 1)
        done = min(step - warmup, left) / left
        return 1.0 - done if decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * done))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def local_sq_norm(params: Iterable[nn.Parameter]) -> torch.Tensor:
    """Sum of squared gradient entries over ``params``.

    Args:
        params: parameters, with or without a gradient.

    Returns:
        A float64 scalar tensor; 0 when no parameter has a gradient.
    """
    # A sharded (FSDP) gradient counts its local shard; the caller sums over every rank.
    grads = [local_part(p.grad) for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    return torch.nn.utils.get_total_norm(grads).to(torch.float64) ** 2


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a DTensor (FSDP), else the tensor."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


AUTOCAST_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""The plan's ``profile.autocast`` -> the dtype ``torch.autocast`` computes in."""


def autocast_region(plan: Plan, device_type: str) -> contextlib.AbstractContextManager[Any]:
    """A fresh region of the plan's autocast (``--dtype`` on measured costs), or one that changes nothing.

    Args:
        plan: the plan (``profile.autocast``: "bf16", "fp16" or None).
        device_type: where the region computes ("cpu", "cuda").

    Returns:
        A new context manager per call, as the profile opened one per block run.
    """
    if plan.profile.autocast is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=AUTOCAST_DTYPES[plan.profile.autocast])


def clip_to_global_norm(
    params: list[nn.Parameter],
    max_norm: float | None,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    counted: list[nn.Parameter] | None = None,
) -> float:
    """Clip by the norm of the WHOLE model's gradient, as ``clip_grad_norm_`` on the unsplit model would.

    Each stage only holds its own gradients, so the squared norms are summed over the pipeline
    group first.

    Args:
        params: this rank's trainable parameters; their gradients are scaled in place.
        max_norm: the global norm to clip to (None: measure only).
        reduce: sums a tensor over the pipeline group (an all-reduce(SUM)); None in one process.
        counted: the parameters whose gradients enter the norm (None: all of ``params``); a tied
            parameter's copies on other ranks are left out, so the model counts it once.

    Returns:
        The global gradient norm before clipping.
    """
    sq = local_sq_norm(params if counted is None else counted)
    if reduce is not None:
        sq = reduce(sq)
    total = math.sqrt(float(sq))
    if max_norm is not None:
        device = next((p.grad.device for p in params if p.grad is not None), torch.device("cpu"))
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, torch.tensor(total, dtype=torch.float32, device=device))
    return total


def clip_and_step(
    params: list[nn.Parameter],
    optimizer: torch.optim.Optimizer | None,
    max_norm: float | None,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    counted: list[nn.Parameter] | None = None,
) -> tuple[float, float, float]:
    """End a training step: clip to the global norm (``clip_to_global_norm``), then step the optimizer.

    Args:
        params: this rank's trainable parameters.
        optimizer: their optimizer (None: the rank has no parameters; it still joins the all-reduce).
        max_norm: the global norm to clip to (None: no clipping).
        reduce: sums a tensor over the pipeline group; None in one process.
        counted: the parameters whose gradients enter the norm (None: all of ``params``).

    Returns:
        (global norm before clipping, seconds clipping took, seconds the optimizer step took).
    """
    t0 = time.perf_counter()
    norm = clip_to_global_norm(params, max_norm, reduce, counted)
    t1 = time.perf_counter()
    if optimizer is not None:
        optimizer.step()
    return norm, t1 - t0, time.perf_counter() - t1


def print_flushed(line: str) -> None:
    """Print ``line`` and flush it: worker processes and the launcher write to the same terminal.

    Args:
        line: the text, without a newline.
    """
    print(line, flush=True)


def memory_step_of(steps: int) -> int | None:
    """The step run under the memory tracker.

    The last one, when there are at least 2: by then the optimizer state and the receive buffers
    exist (the first step sets the schedule up). It runs ~25x slower, so medians leave it out.

    Args:
        steps: the run's optimizer steps.

    Returns:
        The 1-based step, or None when the run is too short to track one.
    """
    return steps if steps >= 2 else None


def step_line(step: int, steps: int, loss: float, seconds: float, note: str = "") -> str:
    """The progress line printed after every step.

    Args:
        step: the 1-based step.
        steps: the run's steps (sets the width of the counter).
        loss: the step's mean microbatch loss.
        seconds: the step's wall time.
        note: why the step's time is untypical ("" when it is not).

    Returns:
        e.g. ``step  2/20  loss 4.0069  12.3 ms``.
    """
    width = len(str(steps))
    return f"step {step:>{width}}/{steps}  loss {loss:.4f}  {seconds * 1e3:.1f} ms" + (f"  ({note})" if note else "")


def step_note(step: int, memory_step: int | None) -> str:
    """Why a step's time is not typical: the first sets the schedule up, one runs under MemTracker.

    Args:
        step: the 1-based step.
        memory_step: the memory-tracked step (None: none).

    Returns:
        The note for ``step_line`` ("" for a typical step).
    """
    if step == memory_step:
        return "memory tracked, not timed"
    if step == 1:
        return "set-up, not timed"
    return ""
