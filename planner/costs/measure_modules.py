"""Profiling for models traced by module boundaries (no graph to cut blocks out of).

The whole model runs forward and backward; hooks note when each block starts and ends.

- forward time of a block: from its forward pre-hook to its forward hook;
- backward time of block k: from the moment the gradient of its output is ready to the moment the
  gradient of block k-1's output (its input) is ready (``Tensor.register_hook`` on the outputs);
  the first block ends when backward returns, the last block starts when backward starts (its
  backward includes the loss);
- saved activations: ``saved_tensors_hooks`` attribute each saved tensor to the block running;
- backward split (I, W) and recompute: there is no graph to cut a block out of, but each block is a
  module, so its inputs (positional and keyword) are captured with a forward pre-hook during the
  first whole-model run, and afterwards the block is called alone on them and timed with the same
  functions as the graph profiler (``planner.costs.measure.time_input_weight``: torch.distributed
  .pipelining's own ``stage_backward_input`` / ``stage_backward_weight``; and
  ``planner.costs.measure.time_recompute``). Inputs of block 0 need no gradient (a first stage gets the
  user's data), so I = 0 and W = its full backward there, as torch runs a first stage; later
  blocks' float inputs require grad, as a stage receives them; keyword tensors never do (torch
  sends no gradient for them). The last block includes the loss when its output is the model's
  output; when root-level operations follow it, it is timed with a gradient of ones on its own
  output, so those operations and the loss are in its B but not in its I/W. A block the model
  never called gets I = W = recompute = 0.

Root-level operations between blocks are not attributed to any block; for models that need this
fallback they are a few element-wise operations.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree
from tqdm import tqdm

from planner.schema.costs import BlockCost
from planner.costs.measure import _grad_inputs, _needs_non_leaf, time_input_weight, time_recompute
from planner.capture.blocks import TracedModel

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


def profile_module_blocks(
    traced: TracedModel,
    inputs: tuple,
    target: torch.Tensor,
    loss_fn: LossFn,
    *,
    warmup: int = 2,
    repeats: int = 5,
    threads: int | None = None,
    progress: bool = True,
) -> list[BlockCost]:
    """Measure each block of a module-boundary trace during whole-model forward/backward runs.

    Args:
        traced: a TracedModel with ``method == "modules"``.
        inputs: positional inputs of one microbatch.
        target: the microbatch's target.
        loss_fn: ``loss_fn(output, target) -> scalar``.
        warmup: untimed whole-model runs.
        repeats: timed runs; medians are kept.
        threads: intra-op threads while measuring; None keeps the current setting.
        progress: show a progress bar.

    Returns:
        One BlockCost per block, in block order.
    """
    model = traced.model
    model.train()
    names = [b.name for b in traced.blocks]
    index = {name: i for i, name in enumerate(names)}
    n = len(names)
    param_ids = {id(p) for p in model.parameters()}
    fwd: list[list[float]] = [[] for _ in range(n)]
    bwd: list[list[float]] = [[] for _ in range(n)]
    saved = [0] * n
    state: dict[str, Any] = {}
    handles = []
    for name in names:
        module = model.get_submodule(name)

        def pre(mod: Any, args: Any, kwargs: Any, name: str = name) -> None:
            i = index[name]
            if state["capture"] and i not in state["inputs"]:  # copies: root ops may change them in place
                state["inputs"][i] = pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), (args, kwargs))
            state["block"] = i
            state.setdefault("start", {})[name] = time.perf_counter()

        def post(mod: Any, args: Any, out: Any, name: str = name) -> None:
            i = index[name]
            state["fwd"][i] = time.perf_counter() - state["start"][name]
            state["block"] = None
            if state["capture"] and i == n - 1:
                state["last_out"] = out
            leaf = next((t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad), None)
            if leaf is not None and i not in state["hooked"]:
                state["hooked"].add(i)
                leaf.register_hook(lambda g, i=i: state["grad_ready"].__setitem__(i, time.perf_counter()))

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post))

    def pack(t: torch.Tensor) -> torch.Tensor:
        i = state.get("block")
        if i is not None and id(t) not in param_ids:
            state["saved"][i].add((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
        return t

    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    state.update(inputs={}, capture=True, last_out=None)
    ends_model = False
    try:
        for r in tqdm(range(warmup + repeats), desc="profiling model", disable=None if progress else True, leave=False):
            state.update(fwd=[0.0] * n, grad_ready={}, hooked=set(), saved=[set() for _ in range(n)], block=None)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                output = model(*inputs)
                loss = loss_fn(output, target)
            if state["capture"]:
                ends_model = state["last_out"] is output
                state.update(capture=False, last_out=None)
            del output
            t_start = time.perf_counter()
            loss.backward()
            t_end = time.perf_counter()
            model.zero_grad(set_to_none=True)
            if r < warmup:
                continue
            ready = state["grad_ready"]
            for i in range(n):
                fwd[i].append(state["fwd"][i])
                begin = ready.get(i, t_start) if i < n - 1 else t_start
                end = ready.get(i - 1, t_end) if i > 0 else t_end
                bwd[i].append(max(0.0, end - begin))
                saved[i] = sum(size for _, size in state["saved"][i])
        for h in handles:  # the isolated runs below must not trigger the timing hooks
            h.remove()
        handles.clear()
        split = [
            _split_block(model.get_submodule(name), state["inputs"].get(i), i == 0, loss_fn, target,
                         i == n - 1 and ends_model, warmup, repeats)
            for i, name in enumerate(tqdm(names, desc="profiling I/W", disable=None if progress else True, leave=False))
        ]
    finally:
        for h in handles:
            h.remove()
        state.clear()
        model.zero_grad(set_to_none=True)
        torch.set_num_threads(old_threads)
    costs = []
    owned = traced.owned_parameters()
    for i, name in enumerate(names):
        params = owned[i]
        cut = traced.cuts[i] if i < n - 1 else None
        costs.append(
            BlockCost(
                name=name,
                first_node=name,
                last_node=name,
                fwd_s=statistics.median(fwd[i]),
                bwd_s=statistics.median(bwd[i]),
                bwd_input_s=split[i][0],
                bwd_weight_s=split[i][1],
                recompute_s=split[i][2],
                params=sum(p.numel() for p in params),
                param_bytes=sum(p.numel() * p.element_size() for p in params),
                activation_bytes=saved[i],
                cut_bytes=cut.nbytes if cut else 0,
                cut_tensors=len(cut.tensors) if cut else 0,
                cut_legal=cut.legal if cut else False,
                is_layer=traced.blocks[i].is_layer,
            )
        )
    return costs


def _split_block(
    module: torch.nn.Module,
    captured: tuple[tuple, dict] | None,
    first: bool,
    loss_fn: LossFn,
    target: torch.Tensor,
    with_loss: bool,
    warmup: int,
    repeats: int,
) -> tuple[float, float, float]:
    """Median (I, W, recompute) seconds of one block called alone on its captured inputs."""
    if captured is None:  # the model never called this block
        return 0.0, 0.0, 0.0
    args, kwargs = captured
    kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.detach(), kwargs)

    def forward(a: tuple) -> Any:
        out = module(*a, **kwargs)
        return loss_fn(out, target) if with_loss else out

    # as in planner.costs.measure: a block starting with an in-place op cannot take a leaf input
    if _needs_non_leaf(forward, _grad_inputs(args, not first)):
        plain = forward

        def forward(a: tuple) -> Any:  # noqa: F811 - deliberate wrapper
            return plain(tuple(x.clone() if isinstance(x, torch.Tensor) and x.requires_grad else x for x in a))

    weights = list(module.parameters())
    runs = []
    for r in range(warmup + repeats):
        try:
            i_s, w_s = time_input_weight(forward, _grad_inputs(args, not first), weights)
            rec = time_recompute(forward, _grad_inputs(args, not first))
        except RuntimeError:
            # Some blocks cannot run alone on their captured inputs: state passed in keyword
            # arguments (Hugging Face's DynamicCache) keeps tensors of the whole-model graph. Their
            # I/W split and recompute time stay unknown (0); forward and backward are still measured.
            return 0.0, 0.0, 0.0
        if r >= warmup:
            runs.append((i_s, w_s, rec))
    return (statistics.median(x[0] for x in runs), statistics.median(x[1] for x in runs),
            statistics.median(x[2] for x in runs))
