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
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm

from planner.schema.costs import BlockCost, OptimizerSpec
from planner.capture.blocks import GraphTrace, ModuleTrace, TracedModel
from planner.capture.stage import build_stage_module

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


def _as_tuple(value: Any) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def _grad_inputs(values: tuple, grad: bool = True) -> tuple:
    """Detach block inputs and let float tensors require grad, as a pipeline stage receives them.

    ``grad=False`` for the first block: a pipeline's first stage gets the user's data, which needs
    no gradient.
    """
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            v = v.detach()
            if grad and v.is_floating_point():
                v.requires_grad_(True)
        out.append(v)
    return tuple(out)


def _needs_non_leaf(forward: Callable[[tuple], Any], args: tuple) -> bool:
    try:
        forward(args)
    except RuntimeError as e:
        if "leaf Variable that requires grad" in str(e):
            return True
        raise
    return False


def _sync(values: tuple) -> None:
    """Wait for queued GPU work so wall-clock timing measures it (a no-op on CPU)."""
    if any(isinstance(v, torch.Tensor) and v.is_cuda for v in values):
        torch.cuda.synchronize()


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return (s.data_ptr(), s.nbytes())


def _backward_roots(out: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Outputs that need a gradient, and a gradient of ones for each."""
    roots = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    return roots, [torch.ones_like(t) for t in roots]


def time_input_weight(forward: Callable[[tuple], Any], args: tuple, weights: list[torch.Tensor]) -> tuple[float, float]:
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
    # imported here: torch.distributed.pipelining takes ~1 s to import, and planning from a plan
    # file or reporting never needs it
    from torch.distributed.pipelining._backward import stage_backward, stage_backward_input, stage_backward_weight

    trainable = [w for w in weights if w.requires_grad]
    grad_in = any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
    if not trainable and not grad_in:
        return 0.0, 0.0
    out = forward(args)
    roots, grads = _backward_roots(out)
    if not roots:
        return 0.0, 0.0
    # stage_backward_input detaches the outputs in place, which torch refuses for views (a stage
    # whose output is a view fails under zero-bubble schedules); a clone costs one copy backward.
    roots = [t.clone() if t._is_view() else t for t in roots]
    _sync(args)
    t0 = time.perf_counter()
    if not grad_in:
        stage_backward(roots, grads, list(args))
        _sync(args)
        return 0.0, time.perf_counter() - t0
    _, groups = stage_backward_input(roots, grads, list(args), iter(trainable))
    _sync(args)
    t1 = time.perf_counter()
    if not trainable:
        return t1 - t0, 0.0
    stage_backward_weight(iter(trainable), groups)
    _sync(args)
    return t1 - t0, time.perf_counter() - t1


def time_recompute(forward: Callable[[tuple], Any], args: tuple) -> float:
    """Seconds the forward takes when activation checkpointing re-runs it inside backward.

    The block runs under non-reentrant ``torch.utils.checkpoint`` (torch's defaults: early stop,
    RNG state preserved); its function is timed on each call and the second call is the
    recomputation. 0.0 when backward never needs it (nothing saved, nothing requires grad).

    Args:
        forward: ``forward(args)`` -> the block's output (or the loss, for the last block).
        args: the block's inputs as a stage receives them.

    Returns:
        Recompute seconds.
    """
    calls: list[float] = []

    def timed(*a: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return forward(a)
        finally:  # early stop ends the recomputation with an exception: still one call
            _sync(a)
            calls.append(time.perf_counter() - t0)

    out = checkpoint(timed, *args, use_reentrant=False)
    roots, grads = _backward_roots(out)
    if roots:
        torch.autograd.backward(roots, grads)
    _sync(args)
    return calls[1] if len(calls) > 1 else 0.0


def profile_blocks(
    traced: TracedModel,
    inputs: tuple,
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
            (AdamW over a large output layer is several percent of a CPU step). None skips it.

    Returns:
        One BlockCost per block, in block order.
    """
    if isinstance(traced, ModuleTrace):
        from planner.costs.measure_modules import profile_module_blocks

        costs = profile_module_blocks(traced, inputs, target, loss_fn, warmup=warmup, repeats=repeats,
                                      threads=threads, progress=progress)
    else:
        old_threads = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        try:
            costs = _profile_graph(traced, inputs, target, loss_fn, warmup, repeats, progress)
        finally:
            torch.set_num_threads(old_threads)
    if optimizer is None:
        return costs
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        # One step over ALL parameters, shared out by parameter count: the optimizer streams every
        # parameter, gradient and moment through memory once, so its time is proportional to the
        # parameters a stage holds. Timing blocks one by one would measure cache-resident steps
        # (2x too fast for the encoder LM's 12 M-parameter stage here).
        owned = traced.owned_parameters()  # shared parameters step once, in their first block
        total_params = sum(p.numel() for own in owned for p in own if p.requires_grad)
        total_s = time_optimizer_step([p for own in owned for p in own], optimizer, warmup, repeats)
        per_param = total_s / total_params if total_params else 0.0
        return [cost.model_copy(update={"opt_s": per_param * sum(p.numel() for p in own if p.requires_grad)})
                for cost, own in zip(costs, owned)]
    finally:
        torch.set_num_threads(old_threads)


def time_optimizer_step(params: list[torch.Tensor], optimizer: OptimizerSpec, warmup: int = 1, repeats: int = 3) -> float:
    """Median time of one optimizer step over copies of ``params`` with random gradients.

    Args:
        params: the parameters one block owns (left untouched: copies are stepped).
        optimizer: which optimizer and learning rate.
        warmup: untimed steps (AdamW allocates its state on the first).
        repeats: timed steps.

    Returns:
        Seconds per step (0.0 when there are no parameters).
    """
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        return 0.0
    copies = [p.detach().clone().requires_grad_(True) for p in trainable]
    for c in copies:
        c.grad = torch.randn_like(c)
    opt: torch.optim.Optimizer
    if optimizer.name == "sgd":
        opt = torch.optim.SGD(copies, lr=optimizer.lr)
    else:
        opt = torch.optim.AdamW(copies, lr=optimizer.lr)
    times = []
    for r in range(max(1, warmup) + repeats):
        _sync(tuple(copies))
        t0 = time.perf_counter()
        opt.step()
        _sync(tuple(copies))
        if r >= max(1, warmup):
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _profile_graph(
    traced: TracedModel, inputs: tuple, target: torch.Tensor, loss_fn: LossFn, warmup: int, repeats: int, progress: bool
) -> list[BlockCost]:
    n = len(traced.blocks)
    traced.model.train()
    param_storages = {_storage_key(p) for p in traced.model.parameters()}
    owned = traced.owned_parameters()
    costs: list[BlockCost] = []
    current = tuple(inputs)
    bar = tqdm(total=n * (warmup + repeats), desc="profiling blocks", unit="run", disable=None if progress else True, leave=False)
    for k, block in enumerate(traced.blocks):
        module = build_stage_module(traced, k, k + 1, check_cuts=False)
        last = k == n - 1

        def forward(args: tuple) -> Any:
            out = module(*args)
            return loss_fn(out, target) if last else out

        # A block that starts with an in-place op (a ReLU(inplace=True) right after a batch norm)
        # cannot take a leaf input; inside a stage it never has to (such cuts are illegal), so
        # profile it on a non-leaf copy.
        grad = k > 0  # the first block gets the user's data, which needs no gradient
        if _needs_non_leaf(forward, _grad_inputs(current, grad)):
            plain = forward

            def forward(args: tuple) -> Any:  # noqa: F811 - deliberate wrapper
                return plain(tuple(a.clone() if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args))

        weights = list(module.parameters())
        fwd_times: list[float] = []
        bwd_times: list[float] = []
        input_times: list[float] = []
        weight_times: list[float] = []
        recompute_times: list[float] = []
        saved_bytes = 0
        for r in range(warmup + repeats):
            args = _grad_inputs(current, grad)
            _sync(args)
            seen: set[tuple[int, int]] = set()

            def pack(t: torch.Tensor) -> torch.Tensor:
                key = _storage_key(t)
                if key not in param_storages:
                    seen.add(key)
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                t0 = time.perf_counter()
                out = forward(args)
                _sync(args)
                t1 = time.perf_counter()
            roots, grads = _backward_roots(out)
            t2 = time.perf_counter()
            if roots:
                torch.autograd.backward(roots, grads)
            _sync(args)
            t3 = time.perf_counter()
            del out, roots, grads
            # separate runs on fresh inputs: I/W as zero-bubble schedules run them, and the recompute
            bwd_input, bwd_weight = time_input_weight(forward, _grad_inputs(current, grad), weights)
            recompute = time_recompute(forward, _grad_inputs(current, grad))
            if r >= warmup:
                fwd_times.append(t1 - t0)
                bwd_times.append(t3 - t2)
                input_times.append(bwd_input)
                weight_times.append(bwd_weight)
                recompute_times.append(recompute)
                saved_bytes = sum(size for _, size in seen)
            bar.update(1)
        with torch.no_grad():
            current = _as_tuple(module(*current)) if not last else current
        params = owned[k]
        cut = traced.cuts[k] if not last else None
        costs.append(
            BlockCost(
                name=block.name,
                first_node=block.nodes[0],
                last_node=block.nodes[-1],
                fwd_s=statistics.median(fwd_times),
                bwd_s=statistics.median(bwd_times),
                bwd_input_s=statistics.median(input_times),
                bwd_weight_s=statistics.median(weight_times),
                recompute_s=statistics.median(recompute_times),
                params=sum(p.numel() for p in params),
                param_bytes=sum(p.numel() * p.element_size() for p in params),
                activation_bytes=saved_bytes,
                cut_bytes=cut.nbytes if cut else 0,
                cut_tensors=len(cut.tensors) if cut else 0,
                cut_legal=cut.legal if cut else False,
                is_layer=block.is_layer,
            )
        )
    bar.close()
    traced.model.zero_grad(set_to_none=True)
    return costs
