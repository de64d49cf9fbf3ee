"""Tensor parallelism inside a pipeline stage: the plan's ``tp_plan`` applied to a stage module with
torch's ``parallelize_module`` over the rank's tensor-parallel mesh, before the stage becomes a
``PipelineStage``; and which gradients of a sharded stage enter the global norm on this rank.

The stage modules keep the unsplit model's module names (``layers.0.attention.wq``), so the plan's
patterns (``'*'`` = exactly one dotted name part) match them directly. ``ColwiseParallel`` takes a
replicated input and returns its column shard, ``RowwiseParallel`` takes that shard and returns the
all-reduced (replicated) output: between the matched modules activations are plain local tensors,
and what crosses a stage boundary is the full activation, the same on every tensor-parallel rank.
A torch.export graph calls its layers as functions at sizes baked in: ``shardable_trace`` gives the
stages a graph of the same nodes at one tensor-parallel rank's sizes, its planned layers modules.
"""

from __future__ import annotations

import copy
import fnmatch
from dataclasses import replace
from typing import Any

import torch
from torch import fx, nn

from planner.capture.blocks import GraphTrace, TracedModel, target_name
from planner.capture.graph import trace_export
from planner.capture.trace import short_reason
from planner.errors import PlanFileError
from planner.torch_compat import graph_copy

STYLES = ("colwise", "rowwise")


def matches(name: str, pattern: str) -> bool:
    """A module name matches a ``tp_plan`` pattern: part for part, ``'*'`` matching exactly one part.

    Args:
        name: a dotted module name (``layers.0.attention.wq``).
        pattern: a ``tp_plan`` key (``layers.*.attention.wq``).
    """
    parts, pats = name.split("."), pattern.split(".")
    return len(parts) == len(pats) and all(fnmatch.fnmatchcase(n, p) for n, p in zip(parts, pats))


def _check_styles(tp_plan: dict[str, str]) -> None:
    bad = sorted({s for s in tp_plan.values() if s not in STYLES})
    if bad:
        raise PlanFileError(f"tp_plan style {bad[0]!r} is not one of {', '.join(STYLES)}")


def tp_styles(module: nn.Module, tp_plan: dict[str, str]) -> dict[str, str]:
    """The modules of ``module`` the plan shards, by name, with their style.

    Args:
        module: a stage module (named as the unsplit model names its modules).
        tp_plan: the plan's patterns -> "colwise" | "rowwise".

    Returns:
        Module name -> style, in module order (empty: nothing of this stage is sharded).

    Raises:
        PlanFileError: a style other than colwise / rowwise, or a matched module that is neither an
            ``nn.Linear`` nor an ``nn.Embedding`` (torch's styles shard only those; a torch.export
            graph's layer calls are made modules by ``shardable_trace``).
    """
    _check_styles(tp_plan)
    out: dict[str, str] = {}
    for name, sub in module.named_modules():
        style = next((s for pat, s in tp_plan.items() if name and matches(name, pat)), None)
        if style is None:
            continue
        if not isinstance(sub, (nn.Linear, nn.Embedding)):
            raise PlanFileError(
                f"tp_plan shards {name}, which this stage holds as a {type(sub).__name__}, not an nn.Linear: "
                "torch's ColwiseParallel / RowwiseParallel shard only nn.Linear and nn.Embedding modules; "
                "re-plan with tp 1"
            )
        out[name] = style
    return out


def shard_stage(module: nn.Module, tp_mesh: Any, tp_plan: dict[str, str]) -> dict[str, str]:
    """Shard a stage module's matched layers over the tensor-parallel mesh, in place.

    Args:
        module: the stage module (before any replica wrapping or ``PipelineStage``).
        tp_mesh: the rank's 1-D tensor-parallel ``DeviceMesh``.
        tp_plan: the plan's patterns -> styles.

    Returns:
        The sharded modules' names -> styles (``tp_styles``).
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = tp_styles(module, tp_plan)
    if styles:
        make = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        parallelize_module(module, tp_mesh, {name: make[style]() for name, style in styles.items()})
    return styles


def sharded_over_tp(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor split (``Shard``) over a mesh dimension named "tp": each tensor-parallel
    rank then holds a different part of it (its gradient's local squares add up over the tp ranks).

    Args:
        t: a parameter or gradient (a DTensor under tensor parallelism or FSDP, else a tensor).
    """
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(t, DTensor):
        return False
    names = t.device_mesh.mesh_dim_names or ()
    return any(n == "tp" and isinstance(p, Shard) for n, p in zip(names, t.placements))


def norm_counted(params: list[nn.Parameter], tp_rank: int) -> list[nn.Parameter]:
    """The parameters whose gradients this rank adds to the global norm under tensor parallelism:
    every tp-sharded one (each rank holds its own part), the replicated ones on tp rank 0 only (each
    tp rank holds the same full gradient; counted once).

    Args:
        params: the rank's trainable parameters.
        tp_rank: the rank's tensor-parallel index.
    """
    return [p for p in params if tp_rank == 0 or sharded_over_tp(p)]


def check_tp_split(module: nn.Module, tp_plan: dict[str, str], tp: int) -> dict[str, str]:
    """Check, before any rank starts, that a stage module can be split ``tp`` ways by the plan.

    Args:
        module: a stage module, unsharded.
        tp_plan: the plan's patterns -> styles.
        tp: the tensor-parallel ranks.

    Returns:
        The modules the plan shards in this stage (``tp_styles``).

    Raises:
        PlanFileError: ``tp_styles``'s reasons, or a sharded width ``tp`` does not divide (the ranks'
            shards would differ in size, and a layer that reshapes to -1 heads would mix heads).
    """
    styles = tp_styles(module, tp_plan)
    subs = dict(module.named_modules())
    for name, style in styles.items():
        sub = subs[name]
        if isinstance(sub, nn.Linear):
            width, what = (sub.out_features, "output") if style == "colwise" else (sub.in_features, "input")
        else:
            assert isinstance(sub, nn.Embedding)
            width, what = (sub.embedding_dim, "embedding") if style == "colwise" else (sub.num_embeddings, "row")
        if width % tp:
            raise PlanFileError(
                f"tp_plan splits {name} {style} over {tp} ranks, but its {what} width {width} is not a multiple "
                f"of {tp}; re-plan with a tp that divides it"
            )
    return styles


def shardable_trace(
    traced: TracedModel, model: nn.Module, inputs: tuple, tp_plan: dict[str, str], tp: int
) -> TracedModel:
    """A trace whose stages torch's tensor-parallel styles can shard: ``traced`` itself for a torch.fx
    trace (its layers are modules); for a torch.export trace, the same graph with the planned layers
    called as modules and the sizes it bakes in as one tensor-parallel rank sees them.

    torch.export calls a linear layer as ``aten.linear(x, weight, bias)`` and bakes every size into
    the graph: Hugging Face Llama's grouped-query attention expands the key/value heads to a constant
    ``[batch, kv_heads, groups, seq, head_dim]``. A rank holding 1/tp of the heads needs the sizes its
    own shards give, so the model is exported again with the planned layers' weights at their
    shard's shape (the rest shared, not copied), and that graph, which must have the same nodes, is
    the one the stages are cut from: each planned ``aten.linear`` / ``aten.embedding`` becomes a call
    of an ``nn.Linear`` / ``nn.Embedding`` holding the model's own full parameters, which
    ``shard_stage`` then shards. The examples a stage is built with still come from ``traced`` (full
    sizes, unsharded weights).

    Args:
        traced: the model traced for the plan (``trace_for_plan``).
        model: the model with its weights (as built for the run, unsharded).
        inputs: the example microbatch's positional inputs the model was traced with.
        tp_plan: the plan's patterns -> "colwise" | "rowwise".
        tp: the tensor-parallel ranks.

    Returns:
        ``traced``, or a ``GraphTrace`` of the same blocks and nodes whose graph module shares
        ``traced.gm``'s parameters.

    Raises:
        PlanFileError: a planned layer whose weight the graph uses other than as one linear or
            embedding call, a width ``tp`` does not divide, or a model that does not trace (or traces
            into other nodes) with its layers split ``tp`` ways.
    """
    if not isinstance(traced, GraphTrace) or traced.method != "export" or tp == 1:
        return traced
    layers = _planned_layers(traced.gm, tp_plan)
    if not layers:
        return traced
    calls = {name: _layer_call(traced.gm.graph, name) for name in layers}
    local = _local_copy(model, {name: (calls[name].target, style) for name, style in layers.items()}, tp)
    try:
        gm = trace_export(local, inputs)
    except Exception as e:  # any failure of the model's code at the shards' sizes: said in one line
        raise PlanFileError(
            f"the model does not trace with its tp_plan layers split {tp} ways ({short_reason(e)}): its code reads "
            "the full number of heads or widths; re-plan with tp 1"
        ) from e
    _check_same_nodes(traced.gm.graph, gm.graph, tp)
    graph = graph_copy(gm.graph)
    for name in layers:
        _call_as_module(traced.gm, graph, name)
    return replace(traced, gm=fx.GraphModule(traced.gm, graph, traced.gm.__class__.__name__))


_LAYER_OPS = {"linear": 1, "embedding": 0}  # an aten layer call -> the position of its weight argument


def _planned_layers(gm: fx.GraphModule, tp_plan: dict[str, str]) -> dict[str, str]:
    """The graph module's modules holding a weight that ``tp_plan`` names, with their style."""
    _check_styles(tp_plan)
    out: dict[str, str] = {}
    for name, sub in gm.named_modules():
        style = next((s for pat, s in tp_plan.items() if name and matches(name, pat)), None)
        if style is not None and isinstance(sub._parameters.get("weight"), nn.Parameter):
            out[name] = style
    return out


def _layer_call(graph: fx.Graph, name: str) -> fx.Node:
    """The one ``aten.linear`` / ``aten.embedding`` node that uses the layer ``name``'s weight."""
    getters = [n for n in graph.nodes if n.op == "get_attr" and n.target == f"{name}.weight"]
    users = [u for g in getters for u in g.users]
    op = users[0].target if len(users) == 1 else None
    kind = getattr(getattr(op, "_overloadpacket", None), "__name__", "")
    if kind not in _LAYER_OPS or users[0].args[_LAYER_OPS[kind]] is not getters[0]:
        uses = ", ".join(sorted({str(u.target) for u in users})) or "nothing"
        raise PlanFileError(
            f"tp_plan shards {name}, whose weight the model's graph uses as {uses}, not as one linear or embedding "
            "call; re-plan with tp 1 (or a tp_plan without it)"
        )
    return users[0]


def _local_copy(model: nn.Module, layers: dict[str, tuple[Any, str]], tp: int) -> nn.Module:
    """A copy of ``model`` whose planned layers' weights (and a colwise linear's bias) have one
    tensor-parallel rank's shape, uninitialised; every other parameter and buffer is shared."""
    memo: dict[int, Any] = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    for name, (op, style) in layers.items():
        sub = model.get_submodule(name)
        kind = op._overloadpacket.__name__
        # the sharded dimension of the weight: linear weights are (out, in), embeddings (rows, width)
        dim = {("linear", "colwise"): 0, ("linear", "rowwise"): 1, ("embedding", "colwise"): 1}.get((kind, style), 0)
        for pname, p in sub.named_parameters(recurse=False):
            if pname == "weight" or (pname == "bias" and kind == "linear" and style == "colwise"):
                memo[id(p)] = nn.Parameter(_shard_shape(p, dim if pname == "weight" else 0, tp, name), p.requires_grad)
    return copy.deepcopy(model, memo)


def _shard_shape(p: torch.Tensor, dim: int, tp: int, name: str) -> torch.Tensor:
    """An uninitialised tensor of ``p``'s shape with dimension ``dim`` split ``tp`` ways."""
    if p.shape[dim] % tp:
        raise PlanFileError(
            f"tp_plan splits {name} over {tp} ranks, but its width {p.shape[dim]} is not a multiple of {tp}; "
            "re-plan with a tp that divides it"
        )
    shape = list(p.shape)
    shape[dim] //= tp
    return torch.empty(shape, dtype=p.dtype, device=p.device)


def _check_same_nodes(full: fx.Graph, local: fx.Graph, tp: int) -> None:
    """The graph at the shards' sizes has the full graph's nodes, name for name and op for op."""

    def nodes(g: fx.Graph) -> list[tuple[str, str, str]]:
        return [(n.name, n.op, target_name(n.target)) for n in g.nodes]

    a, b = nodes(full), nodes(local)
    if a != b:
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        was = a[k] if k < len(a) else "none"
        now = b[k] if k < len(b) else "none"
        raise PlanFileError(
            f"the model traces into other operations with its tp_plan layers split {tp} ways (node {k}: {was} whole, "
            f"{now} split): its code branches on the heads or widths; re-plan with tp 1"
        )


def _call_as_module(root: fx.GraphModule, graph: fx.Graph, name: str) -> None:
    """Replace the graph's call of the layer ``name`` (``aten.linear`` / ``aten.embedding`` on its
    weight) by a call of an ``nn.Linear`` / ``nn.Embedding`` module holding ``root``'s own parameters,
    installed in ``root`` under ``name``; the node keeps its name and metadata."""
    call = _layer_call(graph, name)
    holder = root.get_submodule(name)
    weight = holder.get_parameter("weight")
    args = list(call.args)
    if call.target is torch.ops.aten.linear.default:
        bias = args[2] if len(args) > 2 else None
        if bias is not None and not (
            isinstance(bias, fx.Node) and bias.op == "get_attr" and bias.target == f"{name}.bias"
        ):
            raise PlanFileError(f"tp_plan shards {name}, whose linear call adds a bias not its own; re-plan with tp 1")
        layer: nn.Module = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        layer.weight = weight
        if bias is not None:
            layer.bias = holder.get_parameter("bias")
        x = args[0]
    else:
        padding = args[2] if len(args) > 2 else -1
        if not isinstance(padding, int) or any(args[3:]) or call.kwargs:  # scale_grad_by_freq, sparse
            raise PlanFileError(
                f"tp_plan shards {name}, an embedding with options torch's styles do not keep; re-plan with tp 1"
            )
        layer = nn.Embedding(
            weight.shape[0], weight.shape[1], padding_idx=None if padding == -1 else padding, device="meta"
        )
        layer.weight = weight
        x = args[1]
    parent, _, leaf = name.rpartition(".")
    root.get_submodule(parent).register_module(leaf, layer)
    with graph.inserting_before(call):
        module_call = graph.call_module(name, (x,))
    module_call.meta = dict(call.meta)
    call.replace_all_uses_with(module_call)
    old = call.name
    graph.erase_node(call)
    module_call.name = old
