"""Profiling for models traced by module boundaries (no graph to cut blocks out of).

The whole model runs forward and backward; hooks note when each block starts and ends.

- forward time of a block: from its forward pre-hook to its forward hook;
- backward time of block k: from the moment the gradient of its output is ready to the moment the
  gradient of block k-1's output (its input) is ready (``Tensor.register_hook`` on the outputs);
  the first block ends when backward returns, the last block starts when backward starts (its
  backward includes the loss);
- saved activations: ``saved_tensors_hooks`` attribute each saved tensor to the block running.

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

from planner.costs import BlockCost
from planner.trace import TracedModel

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

        def pre(mod: Any, args: Any, name: str = name) -> None:
            state["block"] = index[name]
            state.setdefault("start", {})[name] = time.perf_counter()

        def post(mod: Any, args: Any, out: Any, name: str = name) -> None:
            i = index[name]
            state["fwd"][i] = time.perf_counter() - state["start"][name]
            state["block"] = None
            leaf = next((t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad), None)
            if leaf is not None and i not in state["hooked"]:
                state["hooked"].add(i)
                leaf.register_hook(lambda g, i=i: state["grad_ready"].__setitem__(i, time.perf_counter()))

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))

    def pack(t: torch.Tensor) -> torch.Tensor:
        i = state.get("block")
        if i is not None and id(t) not in param_ids:
            state["saved"][i].add((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
        return t

    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        for r in tqdm(range(warmup + repeats), desc="profiling model", disable=None if progress else True, leave=False):
            state.update(fwd=[0.0] * n, grad_ready={}, hooked=set(), saved=[set() for _ in range(n)], block=None)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = loss_fn(model(*inputs), target)
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
    finally:
        for h in handles:
            h.remove()
        torch.set_num_threads(old_threads)
    costs = []
    claimed: set[int] = set()
    for i, name in enumerate(names):
        params = [p for p in model.get_submodule(name).parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in params)
        cut = traced.cuts[i] if i < n - 1 else None
        costs.append(
            BlockCost(
                name=name,
                first_node=name,
                last_node=name,
                fwd_s=statistics.median(fwd[i]),
                bwd_s=statistics.median(bwd[i]),
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
