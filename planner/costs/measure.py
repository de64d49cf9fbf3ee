"""Measured profiling: per-block forward/backward time and memory on this machine's device.

Each block of a graph-traced model is cut out as its own module (the same code that builds
pipeline stages, ``planner.capture.trace.build_stage_module``) and timed on its real inputs, which come
from running the blocks before it. The last block includes the loss, as the last pipeline stage
does. Timing: warm-up runs, then repeats, median (robust to the noise of shared CPUs).

Backward split (zero-bubble schedules run them apart, so the solver needs both): besides the full
backward B (``torch.autograd.backward``, what GPipe/1F1B run) each block's backward is timed as
torch.distributed.pipelining runs it under ``backward_one_chunk(full_backward=False)`` and
``backward_weight_one_chunk``: I = ``stage_backward_input`` (gradients of the block's inputs only;
it keeps the graph alive and notes where the weight paths branch off), then W =
``stage_backward_weight`` (the weight gradients from those saved branch points). Calling torch's
own functions means the measured split includes what torch's split really costs (graph walks,
hooks, the branch nodes run twice), not an idealised one. Special cases, as torch has them:

- block 0 receives the user's data, which needs no gradient (a pipeline's first stage does too):
  torch skips I for the first stage and runs the *full* backward as its W (``stage_backward``,
  ``backward_weight_one_chunk`` with ``stage_index == 0``), so I = 0 and W = that full backward.
  Block 0's B is measured with such inputs too (no gradient of the data is ever computed in a
  pipeline). A later block none of whose inputs needs a gradient (only integer tensors cross into
  it) is timed the same way; torch itself would run I and then a W that finds no weight paths and
  computes no weight gradients for such a stage;
- a block without trainable parameters has W = 0 (nothing to run).

Recompute (activation checkpointing): ``recompute_s`` is *measured*, not copied from the forward:
the block runs under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` and its forward
function is timed the second time it is called, which is the recomputation inside backward. With
torch's default early stop the recomputation ends at the last saved tensor, so ops after it (a
residual add, a trailing sleep in the test fixtures) are not re-run: recompute ≤ forward. Dropout's
RNG-state restore is included.

Memory per block: parameter bytes (each parameter counted in the first block that reads it) and
the bytes autograd saves for backward during the block's forward, observed with
``torch.autograd.graph.saved_tensors_hooks`` (parameters excluded: they are counted once already).

Everything runs on the traced model's private copy, so the caller's model is never changed.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from planner.capture.blocks import GraphTrace, ModuleTrace, TracedModel
from planner.capture.stage import build_stage_module, stage_inputs
from planner.costs.blocks import block_cost
from planner.costs.timing import (
    backward_roots,
    grad_inputs,
    leaf_safe,
    sync,
    time_input_weight,
    time_optimizer_step,
    time_recompute,
)
from planner.schema.costs import BlockCost, OptimizerSpec
from planner.threads import torch_threads

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


def profile_blocks(
    traced: TracedModel,
    inputs: tuple[Any, ...],
    target: torch.Tensor,
    loss_fn: LossFn,
    *,
    warmup: int = 2,
    repeats: int = 5,
    threads: int | None = None,
    progress: bool = True,
    optimizer: OptimizerSpec | None = None,
) -> list[BlockCost]:
    """Measure every block of a traced model on one microbatch.

    Args:
        traced: the model, traced on a microbatch of the same shape as ``inputs``.
        inputs: positional inputs of one microbatch.
        target: the microbatch's target (the last block includes the loss).
        loss_fn: ``loss_fn(output, target) -> scalar``.
        warmup: untimed runs per block before measuring.
        repeats: timed runs per block; the median is kept.
        threads: intra-op threads while measuring (match the threads a rank will have); None
            keeps the current setting.
        progress: show a progress bar.
        optimizer: the run's optimizer; its step over each block's parameters is timed too
            (AdamW over a large output layer is several percent of a CPU step). None leaves
            ``opt_s`` unknown.

    Returns:
        One BlockCost per block, in block order.
    """
    with torch_threads(threads):
        if isinstance(traced, ModuleTrace):
            from planner.costs.measure_modules import profile_module_blocks

            costs = profile_module_blocks(
                traced, inputs, target, loss_fn, warmup=warmup, repeats=repeats, progress=progress
            )
        else:
            assert isinstance(traced, GraphTrace)
            costs = _profile_graph(traced, inputs, target, loss_fn, warmup, repeats, progress)
        if optimizer is None:
            return costs
        return _with_optimizer_shares(traced, costs, optimizer, warmup, repeats)


def _with_optimizer_shares(
    traced: TracedModel, costs: list[BlockCost], optimizer: OptimizerSpec, warmup: int, repeats: int
) -> list[BlockCost]:
    """Each block's share of one optimizer step over ALL parameters, shared out by parameter count.

    The optimizer streams every parameter, gradient and moment through memory once, so its time is
    proportional to the parameters a stage holds. Timing blocks one by one would measure
    cache-resident steps (2x too fast for the encoder LM's 12 M-parameter stage here).
    """
    owned = traced.owned_parameters()  # shared parameters step once, in their first block
    total_params = sum(p.numel() for own in owned for p in own if p.requires_grad)
    total_s = time_optimizer_step([p for own in owned for p in own], optimizer, warmup, repeats)
    per_param = total_s / total_params if total_params else 0.0
    return [
        cost.model_copy(update={"opt_s": per_param * sum(p.numel() for p in own if p.requires_grad)})
        for cost, own in zip(costs, owned)
    ]


@dataclass
class _Timings:
    """The repeats of one block: forward, backward, I, W, recompute, and the saved bytes."""

    fwd: list[float] = field(default_factory=list)
    bwd: list[float] = field(default_factory=list)
    bwd_input: list[float] = field(default_factory=list)
    bwd_weight: list[float] = field(default_factory=list)
    recompute: list[float] = field(default_factory=list)
    saved_bytes: int = 0


def _time_once(
    forward: Callable[[tuple[Any, ...]], Any], args: tuple[Any, ...], param_storages: set[tuple[int, int]]
) -> tuple[float, float, int]:
    """One forward and one full backward: (forward s, backward s, bytes saved for backward)."""
    seen: set[tuple[int, int]] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in param_storages:  # parameters are counted once, in param_bytes
            seen.add(key)
        return t

    sync(args)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        t0 = time.perf_counter()
        out = forward(args)
        sync(args)
        t1 = time.perf_counter()
    roots, grads = backward_roots(out)
    t2 = time.perf_counter()
    if roots:
        torch.autograd.backward(roots, grads)
    sync(args)
    t3 = time.perf_counter()
    return t1 - t0, t3 - t2, sum(size for _, size in seen)


def _time_block(
    forward: Callable[[tuple[Any, ...]], Any],
    current: tuple[Any, ...],
    grad: bool,
    weights: list[torch.nn.Parameter],
    param_storages: set[tuple[int, int]],
    warmup: int,
    repeats: int,
    bar: Any,
) -> _Timings:
    """Warm-up and timed repeats of one block: a full F+B, then I/W and the recompute on fresh inputs."""
    t = _Timings()
    for r in range(warmup + repeats):
        fwd, bwd, saved = _time_once(forward, grad_inputs(current, grad), param_storages)
        bwd_input, bwd_weight = time_input_weight(forward, grad_inputs(current, grad), weights)
        recompute = time_recompute(forward, grad_inputs(current, grad))
        if r >= warmup:
            t.fwd.append(fwd)
            t.bwd.append(bwd)
            t.bwd_input.append(bwd_input)
            t.bwd_weight.append(bwd_weight)
            t.recompute.append(recompute)
            t.saved_bytes = saved
        bar.update(1)
    return t


def _profile_graph(
    traced: GraphTrace,
    inputs: tuple[Any, ...],
    target: torch.Tensor,
    loss_fn: LossFn,
    warmup: int,
    repeats: int,
    progress: bool,
) -> list[BlockCost]:
    """Cut every block out on its own and time it on the real outputs of the blocks before it."""
    n = len(traced.blocks)
    traced.model.train()
    param_storages = {_storage_key(p) for p in traced.model.parameters()}
    owned = traced.owned_parameters()
    costs: list[BlockCost] = []
    current = stage_inputs(inputs)  # what the first stage takes: the tensors
    bar = tqdm(
        total=n * (warmup + repeats),
        desc="profiling blocks",
        unit="run",
        disable=None if progress else True,
        leave=False,
    )
    for k in range(n):
        module = build_stage_module(traced, k, k + 1, check_cuts=False)
        last = k == n - 1

        def run(args: tuple[Any, ...], module: torch.nn.Module = module, last: bool = last) -> Any:
            out = module(*args)
            return loss_fn(out, target) if last else out

        grad = k > 0  # the first block gets the user's data, which needs no gradient
        forward = leaf_safe(run, grad_inputs(current, grad))
        t = _time_block(forward, current, grad, list(module.parameters()), param_storages, warmup, repeats, bar)
        if not last:
            with torch.no_grad():
                out = module(*current)
            current = out if isinstance(out, tuple) else (out,)
        costs.append(
            block_cost(
                traced,
                k,
                owned[k],
                fwd_s=statistics.median(t.fwd),
                bwd_s=statistics.median(t.bwd),
                bwd_input_s=statistics.median(t.bwd_input),
                bwd_weight_s=statistics.median(t.bwd_weight),
                recompute_s=statistics.median(t.recompute),
                activation_bytes=t.saved_bytes,
            )
        )
    bar.close()
    traced.model.zero_grad(set_to_none=True)
    return costs


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return (s.data_ptr(), s.nbytes())
