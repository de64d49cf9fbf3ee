"""The timers both profilers share: how a block's inputs arrive, I/W backward, recompute, optimizer step.

A pipeline stage receives its inputs as detached tensors that require grad (``grad_inputs``); the
first stage gets the user's data, which needs none. A block that starts with an in-place operation
(a ReLU(inplace=True) right after a batch norm) cannot take such a leaf input; inside a pipeline it
never has to (the tracer makes such cuts illegal), so it is timed on a non-leaf copy
(``leaf_safe``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from planner.capture.checkpoint import checkpointed
from planner.schema.costs import OptimizerSpec, StepTempRule
from planner.torch_compat import is_view, memory_tracker, pipelining_backward, pytree

Forward = Callable[[tuple[Any, ...]], Any]


def grad_inputs(values: tuple[Any, ...], grad: bool = True) -> tuple[Any, ...]:
    """Detach block inputs and let float tensors require grad, as a pipeline stage receives them.

    Args:
        values: the block's inputs.
        grad: False for the first block: a pipeline's first stage gets the user's data, which
            needs no gradient.

    Returns:
        The inputs as the stage would receive them.
    """
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            v = v.detach()
            if grad and v.is_floating_point():
                v.requires_grad_(True)
        out.append(v)
    return tuple(out)


def leaf_safe(forward: Forward, args: tuple[Any, ...]) -> Forward:
    """``forward``, or a wrapper that clones its grad-requiring inputs when it modifies a leaf in place.

    Args:
        forward: ``forward(args)`` -> the block's output.
        args: example inputs as ``grad_inputs`` makes them (one trial forward runs on them).

    Returns:
        A forward that accepts leaf inputs.

    Raises:
        RuntimeError: the trial forward fails for another reason.
    """
    try:
        forward(args)
    except RuntimeError as e:
        if "leaf Variable that requires grad" not in str(e):
            raise

        def cloned(a: tuple[Any, ...]) -> Any:
            return forward(tuple(x.clone() if isinstance(x, torch.Tensor) and x.requires_grad else x for x in a))

        return cloned
    return forward


def sync(values: tuple[Any, ...]) -> None:
    """Wait for queued GPU work so wall-clock timing measures it (a no-op on CPU)."""
    if any(isinstance(v, torch.Tensor) and v.is_cuda for v in values):
        torch.cuda.synchronize()


def backward_roots(out: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Outputs that need a gradient, and a gradient of ones for each."""
    roots = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    return roots, [torch.ones_like(t) for t in roots]


def time_input_weight(forward: Forward, args: tuple[Any, ...], weights: Sequence[torch.Tensor]) -> tuple[float, float]:
    """One forward (untimed), then backward as zero-bubble schedules run it: I, then W.

    Uses torch.distributed.pipelining's own ``stage_backward_input`` / ``stage_backward_weight``
    (as ``PipelineStage.backward_one_chunk(full_backward=False)`` and
    ``backward_weight_one_chunk`` call them). When no input needs a gradient, torch runs no I and a
    full ``stage_backward`` as W (its first-stage path); without trainable weights W = 0.

    Args:
        forward: ``forward(args)`` -> the block's output (or the loss, for the last block).
        args: the block's inputs, already detached / requiring grad as a stage receives them.
        weights: the block's parameters.

    Returns:
        ``(I, W)`` in seconds.
    """
    stage_backward, stage_backward_input, stage_backward_weight = pipelining_backward()
    trainable = [w for w in weights if w.requires_grad]
    grad_in = any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
    if not trainable and not grad_in:
        return 0.0, 0.0
    out = forward(args)
    roots, grads = backward_roots(out)
    if not roots:
        return 0.0, 0.0
    # stage_backward_input detaches the outputs in place, which torch refuses for views (a stage
    # whose output is a view fails under zero-bubble schedules); a clone costs one copy backward.
    roots = [t.clone() if is_view(t) else t for t in roots]
    sync(args)
    t0 = time.perf_counter()
    if not grad_in:
        stage_backward(roots, grads, list(args))
        sync(args)
        return 0.0, time.perf_counter() - t0
    _, groups = stage_backward_input(roots, grads, list(args), iter(trainable))
    sync(args)
    t1 = time.perf_counter()
    if not trainable:
        return t1 - t0, 0.0
    stage_backward_weight(iter(trainable), groups)  # keeps the graph between groups, as the runner does
    sync(args)
    return t1 - t0, time.perf_counter() - t1


def time_recompute(
    forward: Forward, args: tuple[Any, ...], mode: str = "full", after: Callable[[Any], Any] | None = None
) -> float:
    """Seconds the forward takes when activation checkpointing re-runs it inside backward
    (``time_checkpointed``'s second figure)."""
    return time_checkpointed(forward, args, mode, after)[1]


def time_checkpointed(
    forward: Forward, args: tuple[Any, ...], mode: str = "full", after: Callable[[Any], Any] | None = None
) -> tuple[float, float]:
    """Seconds of a block's forward under activation checkpointing, and of its re-run inside backward.

    The block runs as one checkpoint region as the runner runs it (``planner.capture.checkpoint``:
    non-reentrant ``torch.utils.checkpoint``, torch's defaults: early stop, RNG state preserved;
    selectively, the matmul and attention outputs come from its cache); its function is timed on
    each call and the second call is the recomputation. 0.0 when backward never needs it (nothing
    saved, nothing requires grad).

    Args:
        forward: ``forward(args)`` -> the block's output.
        args: the block's inputs as a stage receives them.
        mode: "full" or "selective".
        after: what runs on the region's output outside it (the last block's loss: a stage's loss
            runs after its checkpoint regions, so what the loss saves never makes the region
            re-run further); None: nothing.

    Returns:
        The forward's seconds under the checkpoint (selectively, with the policy's bookkeeping
        on every operator) and the recomputation's.
    """
    calls: list[float] = []

    def timed(*a: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return forward(a)
        finally:  # early stop ends the recomputation with an exception: still one call
            sync(a)
            calls.append(time.perf_counter() - t0)

    out = checkpointed(timed, args, mode)
    if after is not None:
        out = after(out)
    roots, grads = backward_roots(out)
    if roots:
        torch.autograd.backward(roots, grads)
    sync(args)
    return calls[0], (calls[1] if len(calls) > 1 else 0.0)


@dataclass
class OptimizerSteps:
    """One optimizer step per group of parameters (a block's), timed and its temporaries measured.

    Attributes:
        seconds: per group, the median step time (0.0 for a group without trainable parameters).
        temp_bytes: per group, the peak bytes its step allocated above what existed before it
            (parameters, gradients, optimizer state): the step's temporaries.
        all_temp_bytes: the temporaries of one step over every group's parameters together.
    """

    seconds: list[float]
    temp_bytes: list[int]
    all_temp_bytes: int

    @property
    def temp_rule(self) -> StepTempRule:
        """How the groups' temporaries combine into those of one step over several groups: "max"
        when the all-parameter step's are nearer the largest group's (a per-tensor optimizer, whose
        temporaries live one tensor at a time), else "sum" (a foreach optimizer)."""
        most, total = max(self.temp_bytes, default=0), sum(self.temp_bytes)
        return "max" if abs(self.all_temp_bytes - most) <= abs(self.all_temp_bytes - total) else "sum"


def _make_optimizer(params: list[torch.Tensor], optimizer: OptimizerSpec) -> torch.optim.Optimizer:
    if optimizer.name == "sgd":
        return torch.optim.SGD(params, lr=optimizer.lr)
    return torch.optim.AdamW(params, lr=optimizer.lr)


def _scratch_copies(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of the trainable ``params``, each with a random gradient (the originals stay untouched)."""
    copies = [p.detach().clone().requires_grad_(True) for p in params if p.requires_grad]
    for c in copies:
        c.grad = torch.randn_like(c)
    return copies


def measure_step_temps(opt: torch.optim.Optimizer) -> int:
    """Peak bytes one ``opt.step()`` allocates above what existed before it (its temporaries).

    Observed with torch's ``MemTracker`` (a dispatch mode that follows every tensor storage ops
    create until it is freed), with the parameters, their gradients and the optimizer's state
    registered first, so only what the step itself allocates counts. Call it after a first step
    (AdamW allocates its state there). The parameters are stepped.

    Args:
        opt: an optimizer whose parameters all have gradients.

    Returns:
        Bytes (0 for an optimizer without parameters).
    """
    params = [p for g in opt.param_groups for p in g["params"]]
    if not params:
        return 0
    tracker = memory_tracker()
    tracker.track_external(opt, *params, *[p.grad for p in params if p.grad is not None])
    total = "Total"  # mem_tracker._TOTAL_KEY
    before = {dev: snap[total] for dev, snap in tracker.get_tracker_snapshot("current").items()}
    with tracker:
        opt.step()
    peak = tracker.get_tracker_snapshot("peak")
    return max([0] + [snap[total] - before.get(dev, 0) for dev, snap in peak.items()])


def time_optimizer_steps(
    groups: Sequence[Sequence[torch.Tensor]],
    optimizer: OptimizerSpec,
    warmup: int = 1,
    repeats: int = 3,
    tied: Sequence[Sequence[torch.Tensor]] = (),
) -> OptimizerSteps:
    """Time one optimizer step per group in a round-robin, and measure each step's temporaries.

    Each group (a block's parameters) gets its own optimizer over copies of its trainable
    parameters with random gradients. A round steps group 0, 1, ..., n-1 in order and times each
    step, so every step runs after the other groups' data went through the caches, as in a stage
    that steps many parameters (a group timed alone would be cache-resident, and too fast). Warm-up
    rounds come first (AdamW allocates its state on the first step); the median over the timed
    rounds is kept. One more, untimed round measures each step's temporaries (``measure_step_temps``),
    then one step over all groups' copies together (sharing their state) measures the
    temporaries of the whole, which decides ``OptimizerSteps.temp_rule``.

    Args:
        groups: per group, the parameters (left untouched: copies are stepped).
        optimizer: which optimizer and learning rate.
        warmup: untimed rounds (at least 1).
        repeats: timed rounds.
        tied: per group (or empty), parameters the group's stage also steps a copy of without
            owning them (tied weights an earlier group owns): counted in its temporaries only.

    Returns:
        Per-group seconds and temporary bytes, and the all-parameter temporaries.
    """
    copies = [_scratch_copies(g) for g in groups]
    opts = [_make_optimizer(c, optimizer) if c else None for c in copies]
    times: list[list[float]] = [[] for _ in groups]
    for r in range(max(1, warmup) + repeats):
        for k, opt in enumerate(opts):
            if opt is None:
                continue
            sync(tuple(copies[k]))
            t0 = time.perf_counter()
            opt.step()
            sync(tuple(copies[k]))
            if r >= max(1, warmup):
                times[k].append(time.perf_counter() - t0)
    temps = []
    for k, opt in enumerate(opts):
        extra = _scratch_copies(tied[k]) if k < len(tied) else []
        if extra:  # the group's copies (sharing their state) and copies of the tied parameters
            with_tied = _make_optimizer(copies[k] + extra, optimizer)
            if opt is not None:
                with_tied.state.update({c: opt.state[c] for c in copies[k] if c in opt.state})
            with_tied.step()  # allocates the tied copies' state
            temps.append(measure_step_temps(with_tied))
        else:
            temps.append(measure_step_temps(opt) if opt is not None else 0)
    every = [c for group in copies for c in group]
    whole = 0
    if every:
        together = _make_optimizer(every, optimizer)
        for opt in opts:
            if opt is not None:
                together.state.update(opt.state)
        whole = measure_step_temps(together)
    return OptimizerSteps(
        seconds=[statistics.median(t) if t else 0.0 for t in times], temp_bytes=temps, all_temp_bytes=whole
    )


def time_grad_passes(
    groups: Sequence[Sequence[torch.Tensor]], clip: bool, warmup: int = 1, repeats: int = 3
) -> list[float]:
    """Per group, the seconds of the passes a rank makes over its gradients before the optimizer.

    The runner (``planner.run``) averages the gradients accumulated over the microbatches
    (``grad.mul_(1 / m)``), computes their norm for clipping (``torch.nn.utils.get_total_norm``) and,
    with clipping on, scales them (``clip_grads_with_norm_``). Each pass streams every gradient
    through memory, so a stage's cost is the sum of its blocks'. The groups are timed in turn,
    round after round, on copies of their gradients (``_scratch_copies``), so each group's passes
    run after the others' data went through the caches, as in ``time_optimizer_steps``.

    Args:
        groups: per group (a block's parameters), the parameters (left untouched).
        clip: whether the run clips (the plan's optimizer has ``grad_clip``).
        warmup: untimed rounds.
        repeats: timed rounds (median kept).

    Returns:
        Seconds per group (0.0 for a group without trainable parameters).
    """
    copies = [_scratch_copies(g) for g in groups]
    times: list[list[float]] = [[] for _ in copies]
    for r in range(warmup + repeats):
        for k, group in enumerate(copies):
            if not group:
                continue
            grads = [c.grad for c in group if c.grad is not None]
            sync(tuple(grads))
            t0 = time.perf_counter()
            for g in grads:
                g.mul_(0.5)
            norm = torch.nn.utils.get_total_norm(grads)
            if clip:
                torch.nn.utils.clip_grads_with_norm_(group, 1.0, norm)
            sync(tuple(grads))
            if r >= warmup:
                times[k].append(time.perf_counter() - t0)
            for g in grads:  # keep the values from shrinking to zero over the rounds
                g.mul_(2.0)
    return [statistics.median(t) if t else 0.0 for t in times]
