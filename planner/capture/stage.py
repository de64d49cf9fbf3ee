"""Cutting a pipeline stage out of a graph trace: the module that runs blocks [start, end).

The same code builds the stages ``planner run`` trains and the single blocks the profiler and the
estimator time, so what is measured is what runs.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from planner.capture.blocks import GraphTrace, ModuleTrace, TracedModel
from planner.capture.clock import BlockClock
from planner.capture.load import model_output
from planner.errors import TraceError
from planner.torch_compat import exported_out_spec, pytree


def _impure(node: fx.Node) -> bool:
    """fx treats method calls as pure; in-place ones (y.mul_(2), masked_fill_) must survive dead-code removal."""
    if node.is_impure():
        return True
    if isinstance(getattr(node.target, "__self__", None), BlockClock):  # a mark: it times, it is never dead
        return True
    if node.kwargs.get("inplace") is True:
        return True
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return isinstance(name, str) and name.endswith("_") and not name.endswith("__")


def trace_root(traced: TracedModel) -> nn.Module:
    """The module whose parameters and buffers the stages share: the graph, or the model itself."""
    return traced.gm if isinstance(traced, GraphTrace) else traced.model


def stage_module(traced: TracedModel, start: int, end: int, clock: BlockClock | None = None) -> nn.Module:
    """The module a pipeline stage runs for blocks [start, end) of any trace: cut from the graph
    (``build_stage_module``), or for a module-boundary trace a ``ChainStage`` calling the block
    modules one after another.

    Args:
        traced: the trace.
        start: first block of the stage.
        end: one past the last block.
        clock: time every block of the stage where it runs (``planner.capture.clock``); None: no marks.

    Returns:
        The stage module (parameters shared with the trace).

    Raises:
        TraceError: a module-boundary trace whose blocks are no chain (the reason named), an empty
            range, or an illegal cut.
    """
    if isinstance(traced, ModuleTrace):
        return _chain_stage(traced, start, end, clock)
    return build_stage_module(traced, start, end, clock=clock)


def build_stage_module(
    traced: TracedModel, start: int, end: int, *, check_cuts: bool = True, clock: BlockClock | None = None
) -> fx.GraphModule:
    """Build the module that runs ``blocks[start:end]`` of a traced model.

    Its positional inputs are the tensors crossing the cut before ``start`` (for ``start == 0`` the
    model's own tensor inputs: ``stage_inputs``; non-tensor inputs such as a None are baked in), in
    graph order; it returns the tensors crossing the cut after ``end - 1`` (a single tensor when only
    one crosses), or for the last stage the model's output as ``loss_fn`` receives it
    (``model_output``: the logits of a Hugging Face ``ModelOutput``). Values that
    merely pass through the stage (skip connections) are returned unchanged. Parameters and
    submodules are shared with ``traced.gm``, not copied.

    Args:
        traced: a graph trace (method "fx" or "export").
        start: first block of the stage.
        end: one past the last block of the stage.
        check_cuts: refuse illegal cuts at either end (profiling turns this off to time single
            blocks; non-tensor values must still be constants or tensors).
        clock: mark the stage's inputs and every block boundary up to its output for this clock
            (``planner.capture.clock``); None: no marks.

    Returns:
        The stage as an ``fx.GraphModule``.

    Raises:
        TraceError: when the model was traced by module boundaries (no graph: ``stage_module``
            builds those stages), the range is empty, or a cut at either end is not legal.
    """
    if not isinstance(traced, GraphTrace):
        raise TraceError("a module-boundary trace has no graph to cut; its stages are chains of blocks (stage_module)")
    graph = stage_graph(traced, start, end, check_cuts=check_cuts, clock=clock)
    stage = fx.GraphModule(traced.gm, graph, f"stage_{start}_{end}")
    stage.recompile()
    return stage


def stage_graph(
    traced: GraphTrace, start: int, end: int, *, check_cuts: bool = True, clock: BlockClock | None = None
) -> fx.Graph:
    """The graph ``build_stage_module`` makes its module of (same arguments), without the module:
    its get_attr and call_module nodes name attributes of ``traced.gm``. Generating a module's
    Python code costs milliseconds; the estimator keys 1,000 blocks by their graphs and builds
    modules only for the few distinct ones.

    Raises:
        TraceError: an empty range, or an illegal cut at either end (as ``build_stage_module``).
    """
    n = len(traced.blocks)
    if not 0 <= start < end <= n:
        raise TraceError(f"stage block range [{start}, {end}) is not within the model's {n} blocks")
    for k in (start - 1, end - 1):
        if check_cuts and 0 <= k < n - 1 and not traced.cuts[k].legal:
            raise TraceError(f"cannot cut after block {traced.blocks[k].name}: {traced.cuts[k].reason}")
    graph = fx.Graph(owning_module=traced.gm)  # its attributes, for the purity check and the lint
    lookup = _copier(traced, graph, start, end)
    if clock is not None:
        _mark(graph, lookup, clock, start - 1, _boundary_values(traced, start - 1))
    for i in range(start, end):
        for name in traced.blocks[i].nodes:
            lookup.env[name] = graph.node_copy(lookup.nodes[name], lookup)
        if clock is not None:
            _mark(graph, lookup, clock, i, _boundary_values(traced, i))
    graph.output(_stage_output(traced, lookup, end))
    # Shape reads whose consumers went to other stages are dead here; drop them.
    graph.eliminate_dead_code(is_impure_node=_impure)
    graph.lint()
    return graph


def _boundary_values(traced: GraphTrace, k: int) -> list[str]:
    """Names of the values crossing the boundary after block ``k``: the model's inputs for k = -1,
    the output's values for the last block."""
    if k < 0:
        return [n.name for n in traced.gm.graph.nodes if n.op == "placeholder"]
    if k < len(traced.cuts):
        return list(traced.cuts[k].tensors)
    out = next(node for node in traced.gm.graph.nodes if node.op == "output")
    names: list[str] = []

    def note(node: fx.Node) -> fx.Node:
        names.append(node.name)
        return node

    fx.node.map_arg(out.args[0], note)
    return list(dict.fromkeys(names))


def _mark(graph: fx.Graph, lookup: _Lookup, clock: BlockClock, k: int, names: Sequence[str]) -> None:
    """Route the values ``names`` through ``clock.mark(k, ...)``; later nodes use the marked ones."""
    names = [name for name in names if isinstance(lookup.env.get(name), fx.Node)]
    marked = graph.call_function(clock.mark, (k, *(lookup.env[name] for name in names)))
    for j, name in enumerate(names):
        lookup.env[name] = graph.call_function(operator.getitem, (marked, j))


def _chain_stage(traced: ModuleTrace, start: int, end: int, clock: BlockClock | None = None) -> nn.Module:
    from planner.capture.modules import ChainStage
    from planner.capture.trace import trace_advice

    if traced.chain_reason or not traced.calls:
        why = "; ".join(f"{m}: {r}" for m, r in traced.failures)
        raise TraceError(
            f"this model was traced by module boundaries ({why}) and its blocks cannot run as a chain of stages: "
            f"{traced.chain_reason or 'no calls were recorded'}; to make it traceable by torch.fx or torch.export, "
            f"{trace_advice(traced.failures)}; or make its blocks a chain (each takes only the previous one's output)"
        )
    if not 0 <= start < end <= len(traced.blocks):
        raise TraceError(f"stage block range [{start}, {end}) is not within the model's {len(traced.blocks)} blocks")
    return ChainStage(traced, start, end, clock)


class _Lookup:
    """Maps an original node to its copy in the stage graph, copying get_attr nodes on first use."""

    def __init__(self, traced: GraphTrace, graph: fx.Graph, start: int, end: int) -> None:
        self.graph = graph
        self.start, self.end = start, end
        self.env: dict[str, Any] = {}
        self.nodes = traced.nodes_by_name()

    def __call__(self, a: fx.Node) -> Any:
        if a.name not in self.env:
            src = self.nodes[a.name]
            if src.op != "get_attr":
                raise TraceError(
                    f"value {a.name} is needed in blocks [{self.start}, {self.end}) but not available there"
                )
            self.env[a.name] = self.graph.node_copy(src, self)
        return self.env[a.name]


def _copier(traced: GraphTrace, graph: fx.Graph, start: int, end: int) -> _Lookup:
    """The lookup with the stage's inputs in place: the model's placeholders, or the cut's values."""
    lookup = _Lookup(traced, graph, start, end)
    if start == 0:
        for node in traced.gm.graph.nodes:
            if node.op != "placeholder":
                continue
            info = traced.values.get(node.name)
            if info is not None and info.kind == "const":
                lookup.env[node.name] = info.const  # a None or a flag: fixed for the run, as shapes are
            else:
                lookup.env[node.name] = graph.node_copy(node, lookup)
    else:
        cut = traced.cuts[start - 1]
        for name in cut.tensors:
            lookup.env[name] = graph.placeholder(name)
        for name in cut.consts:
            lookup.env[name] = traced.values[name].const
    return lookup


def _stage_output(traced: GraphTrace, lookup: _Lookup, end: int) -> Any:
    """The model's output for the last stage (in its own structure), else the tensors crossing the cut."""
    if end == len(traced.blocks):
        out = next(node for node in traced.gm.graph.nodes if node.op == "output")
        result = fx.node.map_arg(out.args[0], lookup)
        spec = exported_out_spec(traced.gm)
        if spec is not None:  # torch.export flattens outputs; give the last stage the model's own structure
            result = pytree.tree_unflatten(list(result), spec)  # type: ignore[arg-type]
        return model_output(result)
    outs = tuple(lookup(lookup.nodes[name]) for name in traced.cuts[end - 1].tensors)
    return outs[0] if len(outs) == 1 else outs


def stage_inputs(inputs: Sequence[Any]) -> tuple[Any, ...]:
    """What the first stage takes of the model's positional inputs: the tensors, in order (the
    non-tensor ones are baked into it by ``build_stage_module``)."""
    return tuple(x for x in inputs if isinstance(x, torch.Tensor))
