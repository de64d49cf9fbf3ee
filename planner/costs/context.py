"""Block times measured in context: the whole model run as one stage, every block timed where it runs.

A block timed alone (``planner.costs.measure``) is not a block inside a stage: alone, the block's
weight gradients are made anew and the I/W and recompute timings between repeats churn the
allocator, so large buffers come back as fresh pages that fault on first touch; inside a stage the
gradients accumulate over the step's microbatches into buffers that already exist, and the blocks
run back to back. docs/cost_accuracy.md sizes the gap, time-weighted over every block, for the
isolated profile and for this one ("Where profile and pipeline diverge").

So the forward and backward of every block are measured the way a stage runs them: the model is
cut as one stage holding every block (``planner.capture.stage.build_stage_module``) with a
``BlockClock`` mark at every block boundary (``planner.capture.clock``), and runs forward, loss and
backward repeatedly, its gradients accumulating as over a step's microbatches. The loss is timed
apart (forward, and its backward: from the start of backward to the last block's mark), and added
to the last block's forward and backward, where a pipeline's last stage spends it. The isolated
measurements keep what only they can give (I/W, recompute, saved bytes); ``apply_in_context`` rescales I
and W by the block's in-context/isolated backward ratio and the recompute by the forward ratio.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from planner.capture.blocks import GraphTrace
from planner.capture.clock import BlockClock
from planner.capture.stage import build_stage_module, stage_inputs
from planner.costs.levers import autocast_context
from planner.costs.timing import backward_roots, sync
from planner.schema.costs import BlockCost

_perf = time.perf_counter
# A stage waits for its neighbour between actions, and the first blocks after a wait run slower (the
# core idled; caches and predictors went cold): measured on this project's CPU, the first block of
# a 0.4 ms-per-block model took about twice its back-to-back time after a 5 ms wait. The profile
# waits this long before each action, as a pipeline's ranks do.
_WAIT_S = 2e-3


@dataclass
class InContext:
    """Per-block medians of the whole-model runs (seconds per microbatch), and the loss's forward apart
    (its backward is inside the last block's, as the clock counts it)."""

    fwd: list[float]
    bwd: list[float]
    loss_fwd: float


def time_in_context(
    traced: GraphTrace,
    inputs: tuple[Any, ...],
    target: torch.Tensor,
    loss_fn: Any,
    *,
    warmup: int,
    repeats: int,
    device_type: str,
    autocast: str | None,
) -> InContext:
    """Run the whole model as one stage, forward, loss and backward, ``warmup + repeats`` times.

    Args:
        traced: the graph trace (blocks in order).
        inputs: one microbatch's positional inputs.
        target: its target.
        loss_fn: ``loss_fn(output, target) -> scalar``.
        warmup: untimed runs.
        repeats: timed runs (medians kept).
        device_type: "cpu" or "cuda" (autocast).
        autocast: the plan's autocast dtype, or None.

    Returns:
        The per-block and loss medians.
    """
    n = len(traced.blocks)
    clock = BlockClock(0, n, loss_in_last=True, cuda=device_type == "cuda")
    module = build_stage_module(traced, 0, n, check_cuts=False, clock=clock)
    args = stage_inputs(inputs)  # a first stage's inputs: the user's data, no gradient
    loss_f: list[float] = []
    for r in range(warmup + repeats):
        clock.step = r
        time.sleep(_WAIT_S)  # as a stage waits for its neighbour before each action
        clock.begin("F")
        with autocast_context(device_type, autocast):
            out = module(*args)
            sync(args)
            t0 = _perf()
            loss = loss_fn(out, target)
            sync(args)
            t1 = _perf()
        clock.finish()
        roots, grads = backward_roots(loss)
        time.sleep(_WAIT_S)
        clock.begin("B")
        if roots:
            torch.autograd.backward(roots, grads)
        sync(args)
        clock.finish()
        if r >= warmup:
            loss_f.append(t1 - t0)  # its backward is in the last block's (the clock's loss_in_last)
    traced.model.zero_grad(set_to_none=True)
    timed = range(warmup, warmup + repeats)
    fwd, _ = clock.medians(("F",), timed)
    bwd, _ = clock.medians(("B",), timed)
    return InContext(fwd, bwd, statistics.median(loss_f))


def apply_in_context(costs: list[BlockCost], ctx: InContext) -> list[BlockCost]:
    """The isolated costs with the in-context forward and backward (see the module docstring).

    Args:
        costs: one isolated BlockCost per block.
        ctx: the in-context medians of the same blocks.

    Returns:
        The costs with in-context times; the last block's include the loss (``loss_s``: its forward).
    """
    out = []
    last = len(costs) - 1
    for k, (c, f, b) in enumerate(zip(costs, ctx.fwd, ctx.bwd)):
        if k == last:  # the clock counted the loss's backward in the last block's already
            f += ctx.loss_fwd
        rf = f / c.fwd_s if c.fwd_s > 0 else 1.0
        rb = b / c.bwd_s if c.bwd_s > 0 else 1.0
        update: dict[str, Any] = {
            "fwd_s": f,
            "bwd_s": b,
            "bwd_input_s": None if c.bwd_input_s is None else c.bwd_input_s * rb,
            "bwd_weight_s": None if c.bwd_weight_s is None else c.bwd_weight_s * rb,
            "recompute_s": None if c.recompute_s is None else c.recompute_s * rf,
        }
        if k == last:
            update["loss_s"] = ctx.loss_fwd
        out.append(c.model_copy(update=update))
    return out
