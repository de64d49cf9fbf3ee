"""The last tracer of the fallback chain: module boundaries observed with forward hooks.

Used when neither torch.fx nor torch.export can capture the model (data-dependent control flow,
``.item()``, Python objects flowing between layers). There is no graph: the blocks are the
children of the model's containers (and its other top-level children), in the order they run,
and a cut after block k is legal when the tensor block k returns is the very tensor block k+1
receives first — the dataflow a pipeline stage needs, checked on a real forward pass.

A pipeline stage is then a chain of block modules (``ChainStage``): each called with the previous
one's output tensor and the constants it was called with. That is the model only when the model
*is* such a chain, which the trace checks by identity on the real forward pass: the first block
takes one of the model's inputs, each next block takes the very tensor the previous one returned
(no view, no work in between) and no other tensor, and the model returns the last block's output.
Otherwise ``chain_reason`` says why, and ``planner plan`` refuses such a model with that reason.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from planner.capture.blocks import (
    CHAINED,
    CONTAINERS,
    Block,
    BlockCall,
    Cut,
    ModuleTrace,
    ValueInfo,
    describe,
    layer_types,
)
from planner.capture.clock import BlockClock
from planner.capture.load import model_output
from planner.errors import TraceError
from planner.torch_compat import pytree


def block_modules(model: nn.Module) -> dict[str, tuple[nn.Module, bool]]:
    """Candidate blocks: children of containers (repeated layers) and other top-level children.

    Args:
        model: the root module.

    Returns:
        FQN -> (module, is_layer), outermost candidates only (nothing nested in another candidate).
    """
    found: dict[str, tuple[nn.Module, bool]] = {}

    def visit(prefix: str, module: nn.Module) -> None:
        layers = layer_types(module) if isinstance(module, CONTAINERS) else frozenset()  # siblings counted once
        for name, child in module.named_children():
            fqn = f"{prefix}.{name}" if prefix else name
            if isinstance(module, CONTAINERS):
                found[fqn] = (child, type(child) in layers)
            elif isinstance(child, CONTAINERS) or _has_container(child):
                visit(fqn, child)  # e.g. HF's `transformer` wrapper around `h`: look inside
            else:
                found[fqn] = (child, False)

    visit("", model)
    return found


def _has_container(module: nn.Module) -> bool:
    return any(isinstance(m, CONTAINERS) for m in module.modules())


def _first_tensor(value: Any) -> torch.Tensor | None:
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            return leaf
    return None


def trace_module_boundaries(model: nn.Module, inputs: tuple[Any, ...], failures: list[tuple[str, str]]) -> ModuleTrace:
    """Observe the model's block modules during one forward pass (no grad).

    Args:
        model: the planner's private copy of the model.
        inputs: positional inputs of one microbatch.
        failures: why the graph tracers failed (kept on the result for reports and errors).

    Returns:
        A ModuleTrace (``method="modules"``).

    Raises:
        TraceError: when the model has no block modules or its forward pass fails.
    """
    candidates = block_modules(model)
    if not candidates:
        raise TraceError(f"{type(model).__name__} has no child modules to use as pipeline blocks")
    calls: list[tuple[str, Any, Any]] = []
    times: dict[str, int] = {}
    handles = []
    for fqn, (module, _) in candidates.items():

        def hook(mod: nn.Module, args: tuple, kwargs: dict, out: Any, fqn: str = fqn) -> None:
            times[fqn] = times.get(fqn, 0) + 1
            if times[fqn] == 1:  # a module called twice (shared weights) counts once
                calls.append((fqn, (args, kwargs), out))

        handles.append(module.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            result = model(*inputs)
    except Exception as e:
        raise TraceError(f"forward pass of {type(model).__name__} failed: {type(e).__name__}: {e}") from e
    finally:
        for h in handles:
            h.remove()
    if not calls:
        raise TraceError(f"none of {type(model).__name__}'s child modules ran in forward")
    blocks = [Block(fqn, (fqn,), candidates[fqn][1]) for fqn, _, _ in calls]
    values: dict[str, ValueInfo] = {}
    cuts: list[Cut] = []
    for k in range(len(calls) - 1):
        out = _first_tensor(calls[k][2])
        nxt = _first_tensor(calls[k + 1][1])
        name = calls[k][0]
        if out is None:
            cuts.append(Cut(k, (), (), 0, False, f"{name} returns no tensor"))
            continue
        values[name] = describe(out)
        if nxt is None or nxt.untyped_storage().data_ptr() != out.untyped_storage().data_ptr():
            # the same tensor or a view of it (HF reshapes hidden states between modules)
            reason = f"{calls[k + 1][0]} does not take {name}'s output as its first input"
            cuts.append(Cut(k, (name,), (), values[name].nbytes, False, reason))
            continue
        cuts.append(Cut(k, (name,), (), values[name].nbytes, True))
    last = _first_tensor(calls[-1][2])
    if last is not None:
        values[calls[-1][0]] = describe(last)
    twice = [fqn for fqn, n in times.items() if n > 1]
    if twice:
        chain: list[BlockCall] = []
        first_input, reason = 0, f"{twice[0]} is called {times[twice[0]]} times in one forward"
    else:
        chain, first_input, reason = _chain(calls, inputs, model_output(result), candidates)
    return ModuleTrace(model, "modules", list(failures), blocks, cuts, values, chain, first_input, reason)


def _chain(
    calls: list[tuple[str, Any, Any]], inputs: tuple[Any, ...], result: Any, candidates: dict[str, Any]
) -> tuple[list[BlockCall], int, str]:
    """How to run the blocks as a chain, and which tensor input the first takes; or why they are no chain."""
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    out: list[BlockCall] = []
    first_input = 0
    flowing: torch.Tensor | None = None
    for k, (fqn, (args, kwargs), returned) in enumerate(calls):
        leaves = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        slots = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        if len(leaves) != 1 or len(slots) != 1:
            return [], 0, f"{fqn} takes {len(leaves)} tensors; a chain block takes only the previous block's output"
        x = args[slots[0]]
        if k == 0:
            matches = [i for i, t in enumerate(tensors) if t is x]
            if not matches:
                return [], 0, f"{fqn}, the first block, does not take one of the model's inputs as it is"
            first_input = matches[0]
        elif x is not flowing:
            return [], 0, f"{fqn} does not take {calls[k - 1][0]}'s output as it is (the model changes it in between)"
        bad = [a for a in pytree.tree_leaves((args, kwargs)) if a is not x and describe(a).kind != "const"]
        if bad:
            return [], 0, f"{fqn} takes a {type(bad[0]).__name__} argument that cannot be fixed for the run"
        out.append(BlockCall(tuple(CHAINED if i == slots[0] else a for i, a in enumerate(args)), dict(kwargs)))
        flowing = _first_tensor(returned)
        if flowing is None:
            return [], 0, f"{fqn} returns no tensor"
    if result is not flowing:
        return [], 0, f"the model does more with {calls[-1][0]}'s output before returning it"
    ran = {fqn for fqn, _, _ in calls}
    skipped = [
        fqn for fqn in candidates if fqn not in ran and any(p.requires_grad for p in candidates[fqn][0].parameters())
    ]
    if skipped:
        return [], 0, f"{skipped[0]} has parameters but never ran in forward"
    return out, first_input, ""


class ChainStage(nn.Module):
    """A pipeline stage of a module-boundary trace: blocks [start, end) called one after another.

    Args:
        traced: the module-boundary trace (its ``calls`` set: ``chain_reason`` empty).
        start: first block.
        end: one past the last block.
        clock: mark the input and every block's output for this clock (``planner.capture.clock``).
    """

    def __init__(self, traced: ModuleTrace, start: int, end: int, clock: BlockClock | None = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(traced.model.get_submodule(b.name) for b in traced.blocks[start:end])
        self.calls = traced.calls[start:end]
        self.take = traced.first_input if start == 0 else 0
        self.start = start
        self.clock = clock

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        x = inputs[self.take]
        if self.clock is not None:
            (x,) = self.clock.mark(self.start - 1, x)
        for k, (block, call) in enumerate(zip(self.blocks, self.calls), self.start):
            out = block(*(x if a is CHAINED else a for a in call.args), **call.kwargs)
            x = _first_tensor(out)  # type: ignore[assignment]  # the trace saw a tensor here
            if self.clock is not None:
                (x,) = self.clock.mark(k, x)
        return x
