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

A block that starts an action after a wait runs slower than one that follows another block: the
core idled, and caches and branch predictors went cold. In a pipeline that is the first block of a
stage's forward, which waits for its activations, and the last block of its backward, which waits
for their gradient; the first stage's forwards and the last stage's backwards follow other work
and do not wait. In the last bench sweep before cold starts were timed (402 blocks, 2 ranks, a
profile that waited before each of the whole model's actions; docs/prediction_accuracy.md, "Cold
starts at a stage's boundaries"), blocks inside a stage ran within 1.3 % of the profile; a stage's
first block's forward was 12 % slower there and its last block's backward 12 % slower, while the
model's first block's forward and last block's backward, which never wait in a pipeline, were 32 %
and 17 % faster. So the whole model runs in two kinds of passes, taking turns so that the machine's
drift touches both alike: warm passes, back to back, give every block's time inside a stage; cold
passes wait ``_WAIT_S`` (1 ms) before every block (the clock's ``pause_s``), and a block's cold penalty
(``BlockCost.fwd_cold_s``, ``bwd_cold_s``) is how much slower it ran there. The solver charges it
to the block that starts a stage's action after a receive (``planner.core.split.stage_model.stage_time_parts``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from planner.capture.blocks import GraphTrace
from planner.capture.clock import BlockClock
from planner.capture.float8 import convert_stage, emulated
from planner.capture.stage import build_stage_module, stage_inputs
from planner.costs.levers import autocast_context
from planner.costs.settings import ProfileSettings, Sample
from planner.costs.timing import backward_roots, sync
from planner.schema.costs import BlockCost

_perf = time.perf_counter
# How long a cold pass waits before each block. The penalty grows with the wait (on this project's
# CPU, the tiny GPT's blocks ran 5 %, 11 %, 14 % and 43 % slower after 0.25, 1, 2 and 5 ms); a
# stage in a balanced pipeline waits about a message's cost (the CPU link charges 1.5 ms) or less.
# Over two bench sweeps (docs/prediction_accuracy.md), the blocks that start a stage's action after
# a receive ran on average about 2/3 of the 2 ms penalty slower than the blocks inside it, which is
# about what a 1 ms wait gives.
_WAIT_S = 1e-3


@dataclass
class InContext:
    """Per-block medians of the whole-model warm passes (seconds per microbatch), the loss's forward
    apart (its backward is inside the last block's, as the clock counts it), and per block how much
    slower its forward and backward ran after a wait (``_penalties``)."""

    fwd: list[float]
    bwd: list[float]
    loss_fwd: float
    fwd_cold: list[float]
    bwd_cold: list[float]


def time_in_context(traced: GraphTrace, sample: Sample, settings: ProfileSettings, device_type: str) -> InContext:
    """Run the whole model as one stage, forward, loss and backward, ``warmup + repeats`` times warm
    and as many times cold, taking turns (see the module docstring).

    Args:
        traced: the graph trace (blocks in order).
        sample: one microbatch, its target and the loss.
        settings: ``warmup``: untimed runs of each kind; ``repeats``: timed runs of each kind
            (medians kept); ``autocast``: the plan's autocast dtype, or None. Threads, progress and
            compile are the caller's (``profile_model`` times in context only without compile).
        device_type: "cpu" or "cuda" (autocast).

    Returns:
        The per-block and loss medians, and the per-block cold penalties.
    """
    n = len(traced.blocks)
    cuda = device_type == "cuda"
    warm = BlockClock(0, n, loss_in_last=True, cuda=cuda)
    cold = BlockClock(0, n, loss_in_last=True, cuda=cuda, pause_s=_WAIT_S)
    # two stage modules over the same blocks: the same parameters, gradients accumulating in both
    modules = [(build_stage_module(traced, 0, n, check_cuts=False, clock=c), c) for c in (warm, cold)]
    if settings.float8 is not None:  # the layers converted as each block alone was (``_profile_graph``)
        for module, _ in modules:
            assert isinstance(module, torch.fx.GraphModule)
            convert_stage(module, settings.float8, traced.model, emulated(torch.device(device_type)))
    args = stage_inputs(sample.inputs)  # a first stage's inputs: the user's data, no gradient
    warmup, repeats = settings.warmup, settings.repeats
    loss_f: list[float] = []
    for r in range(warmup + repeats):
        for module, clock in modules:
            clock.step = r
            loss_s = _one_pass(module, clock, args, sample, device_type, settings.autocast)
            if r >= warmup and clock is warm:
                loss_f.append(loss_s)  # its backward is in the last block's (the clock's loss_in_last)
    traced.model.zero_grad(set_to_none=True)
    timed = range(warmup, warmup + repeats)
    fwd, _ = warm.medians(("F",), timed)
    bwd, _ = warm.medians(("B",), timed)
    return InContext(
        fwd,
        bwd,
        statistics.median(loss_f),
        _penalties(warm, cold, ("F",), timed),
        _penalties(warm, cold, ("B",), timed),
    )


def _penalties(warm: BlockClock, cold: BlockClock, kinds: tuple[str, ...], steps: range) -> list[float]:
    """Per block, the median over repeats of its cold time less its warm time in the same repeat
    (at least 0).

    The two passes of a repeat run back to back, so the machine's drift, which moves a long
    block's time by far more than a cold start, cancels from each difference; a difference of
    the two medians would keep it (the heavy block of bench/models/heavy_middle.py, 9-15 ms,
    read anything from 0 to 1.6 ms that way)."""
    w_times, _ = warm.block_times(kinds, steps)
    c_times, _ = cold.block_times(kinds, steps)
    out = []
    for w, c in zip(w_times, c_times):
        diffs = [x - y for x, y in zip(c, w)] if len(w) == len(c) else []
        out.append(max(0.0, statistics.median(diffs)) if diffs else 0.0)
    return out


def _one_pass(
    module: torch.nn.Module,
    clock: BlockClock,
    args: tuple[Any, ...],
    sample: Sample,
    device_type: str,
    autocast: str | None,
) -> float:
    """One forward, loss and backward of the whole-model stage on ``args`` (``sample``'s inputs as a
    first stage takes them); the loss's forward seconds.

    A cold clock (``pause_s``) waits before each action too, so that the model's first block's
    forward and the loss's backward start cold like every other block.
    """
    if clock.pause_s:
        time.sleep(clock.pause_s)
    clock.begin("F")
    with autocast_context(device_type, autocast):
        out = module(*args)
        sync(args)
        t0 = _perf()
        loss = sample.loss_fn(out, sample.target)
        sync(args)
        t1 = _perf()
    clock.finish()
    roots, grads = backward_roots(loss)
    if clock.pause_s:
        time.sleep(clock.pause_s)
    clock.begin("B")
    if roots:
        torch.autograd.backward(roots, grads)
    sync(args)
    clock.finish()
    return t1 - t0


def apply_in_context(costs: list[BlockCost], ctx: InContext) -> list[BlockCost]:
    """The isolated costs with the in-context forward and backward (see the module docstring).

    Args:
        costs: one isolated BlockCost per block.
        ctx: the in-context medians of the same blocks.

    Returns:
        The costs with in-context times and cold penalties; the last block's include the loss
        (``loss_s``: its forward).
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
            "selective_recompute_s": None if c.selective_recompute_s is None else c.selective_recompute_s * rf,
        }
        if k == last:
            update["loss_s"] = ctx.loss_fwd
        update["fwd_cold_s"], update["bwd_cold_s"] = ctx.fwd_cold[k], ctx.bwd_cold[k]
        out.append(c.model_copy(update=update))
    return out
