"""The last tracer of the fallback chain: module boundaries observed with forward hooks.

Used when neither torch.fx nor torch.export can capture the model (data-dependent control flow,
``.item()``, Python objects flowing between layers). There is no graph: the blocks are the
children of the model's containers (and its other top-level children), in the order they run,
and a cut after block k is legal when the tensor block k returns is the very tensor block k+1
receives first — the dataflow a pipeline stage needs, checked on a real forward pass.

Plans made this way are good for costs and balance tables; the runner needs a graph to build
stages and says so.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from planner.capture.blocks import CONTAINERS, Block, Cut, ModuleTrace, ValueInfo, is_layer
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
        for name, child in module.named_children():
            fqn = f"{prefix}.{name}" if prefix else name
            if isinstance(module, CONTAINERS):
                found[fqn] = (child, is_layer(module, child))
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
    handles = []
    for fqn, (module, _) in candidates.items():

        def hook(mod: nn.Module, args: tuple, kwargs: dict, out: Any, fqn: str = fqn) -> None:
            if all(c[0] != fqn for c in calls):  # a module called twice (shared weights) counts once
                calls.append((fqn, (args, kwargs), out))

        handles.append(module.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            model(*inputs)
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
        values[name] = ValueInfo("tensor", out.numel() * out.element_size())
        if nxt is None or nxt.untyped_storage().data_ptr() != out.untyped_storage().data_ptr():
            # the same tensor or a view of it (HF reshapes hidden states between modules)
            reason = f"{calls[k + 1][0]} does not take {name}'s output as its first input"
            cuts.append(Cut(k, (name,), (), values[name].nbytes, False, reason))
            continue
        cuts.append(Cut(k, (name,), (), values[name].nbytes, True))
    last = _first_tensor(calls[-1][2])
    if last is not None:
        values[calls[-1][0]] = ValueInfo("tensor", last.numel() * last.element_size())
    return ModuleTrace(model, "modules", list(failures), blocks, cuts, values)
