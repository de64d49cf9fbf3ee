"""A torch.export graph whose tensor-parallel layers torch's styles can shard (``shardable_trace``).

torch's ``ColwiseParallel`` / ``RowwiseParallel`` shard ``nn.Linear`` / ``nn.Embedding`` modules a
stage calls as modules: a torch.fx trace keeps them. A torch.export trace calls the weights as
functions (``aten.linear``) and bakes every size into the graph (Hugging Face Llama's grouped-query
attention expands a constant number of key/value heads), so a rank holding 1/tp of the heads needs
a graph of its own sizes. Used by the runner before it shards (``planner.run.tensor_shard``) and by
``planner plan``, which checks once that a plan's split can run (``shard_sized_graph``).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch
from torch import fx, nn

from planner.capture.blocks import GraphTrace, TracedModel, target_name
from planner.capture.expert_calls import calls_of, tag_calls
from planner.capture.graph import trace_export
from planner.capture.graph_file import GraphFileError, RankGraphs, load_graph
from planner.capture.load import ModelFile
from planner.capture.tp_plan import matched_modules, style_error
from planner.capture.trace import short_reason
from planner.errors import TraceError
from planner.schema.request import PlanRequest
from planner.torch_compat import graph_copy


def shardable_trace(
    traced: TracedModel,
    model: nn.Module,
    inputs: tuple,
    tp_plan: dict[str, str],
    tp: int,
    graphs: RankGraphs | None = None,
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
        tp_plan: the plan's patterns -> "colwise" | "rowwise" | "colwise_rep".
        tp: the tensor-parallel ranks.

    Returns:
        ``traced``, or a ``GraphTrace`` of the same blocks and nodes whose graph module shares
        ``traced.gm``'s parameters.

    Raises:
        TraceError: a planned layer whose weight the graph uses other than as one linear or
            embedding call, a width ``tp`` does not divide, or a model that does not trace (or traces
            into other nodes) with its layers split ``tp`` ways.
    """
    sized = shard_sized_graph(traced, model, inputs, tp_plan, tp, graphs)
    if sized is None:
        return traced
    assert isinstance(traced, GraphTrace)  # shard_sized_graph says None otherwise
    graph = graph_copy(sized.graph)
    for name, call in _layer_calls(graph, _planned_layers(traced.gm, tp_plan)).items():
        call_as_module(traced.gm, graph, name, call)
    return replace(traced, gm=fx.GraphModule(traced.gm, graph, traced.gm.__class__.__name__))


def shard_sized_graph(
    traced: TracedModel,
    model: nn.Module,
    inputs: tuple,
    tp_plan: dict[str, str],
    tp: int,
    graphs: RankGraphs | None = None,
) -> fx.GraphModule | None:
    """The model exported again with its planned layers' weights at one tensor-parallel rank's shard
    shapes, checked to have ``traced``'s nodes (``shardable_trace``); ``traced`` is not changed.

    Args:
        traced: a trace of ``model`` (only a torch.export trace needs a graph of its own).
        model: the model (its weights are shared with the copy exported, not copied).
        inputs: the example microbatch's positional inputs, on the model's device.
        tp_plan: the patterns -> "colwise" | "rowwise" | "colwise_rep".
        tp: the tensor-parallel ranks.
        graphs: the launcher's graphs: its graph at these sizes is rebuilt instead of exporting
            (checked like an export), or this export kept for the ranks where ``graphs`` collects.

    Returns:
        The graph module at the shards' sizes; None for a torch.fx trace, tp 1 or no planned layer.

    Raises:
        TraceError: the reason the split cannot run (``shardable_trace``).
    """
    if not isinstance(traced, GraphTrace) or traced.method != "export" or tp == 1:
        return None
    layers = _planned_layers(traced.gm, tp_plan)
    if not layers:
        return None
    calls = _layer_calls(traced.gm.graph, layers)
    local = _local_copy(model, {name: (calls[name].target, style) for name, style in layers.items()}, tp)
    gm = _rebuilt(graphs, local)
    if gm is None:
        try:
            # traced as the plan's graph was: with its experts' calls recorded (their preserved call
            # signatures name some nodes), so the two graphs' nodes agree (expert parallelism)
            gm = trace_export(local, inputs, experts=tuple(calls_of(traced.gm)))
        except Exception as e:  # any failure of the model's code at the shards' sizes: said in one line
            raise TraceError(
                f"the model does not trace with its tp_plan layers split {tp} ways ({short_reason(e)}): its code "
                "reads the full number of heads or widths"
            ) from e
        if graphs is not None:
            graphs.keep_shard_sized(gm, local)
    _check_same_nodes(traced.gm.graph, gm.graph, tp)
    tag_calls(gm)  # the experts' calls marked on this graph's nodes too, where a stage cut from it finds them
    return gm


def _rebuilt(graphs: RankGraphs | None, local: nn.Module) -> fx.GraphModule | None:
    """The launcher's graph at the shards' sizes rebuilt on ``local`` (None: none to rebuild, or it
    does not fit: the caller exports)."""
    if graphs is None or graphs.collects or graphs.shard_sized is None:
        return None
    try:
        return load_graph(graphs.shard_sized, local)
    except GraphFileError:
        return None


_LAYER_OPS = {"linear": 1, "embedding": 0}  # an aten layer call -> the position of its weight argument


def _planned_layers(gm: fx.GraphModule, tp_plan: dict[str, str]) -> dict[str, str]:
    """The graph module's modules holding a weight that ``tp_plan`` names, with their style."""
    bad = style_error(tp_plan)
    if bad:
        raise TraceError(bad)
    return {
        name: style
        for name, (style, sub, _) in matched_modules(gm, tp_plan).items()
        if isinstance(dict(sub.named_parameters(recurse=False, remove_duplicate=False)).get("weight"), nn.Parameter)
    }


def _layer_calls(graph: fx.Graph, names: Iterable[str]) -> dict[str, fx.Node]:
    """Each layer's one ``aten.linear`` / ``aten.embedding`` node on its weight (``_layer_call``), the
    graph's attribute reads indexed once (a 70B graph has tens of thousands of nodes, hundreds of layers)."""
    reads: dict[str, list[fx.Node]] = {}
    for n in graph.nodes:
        if n.op == "get_attr":
            reads.setdefault(str(n.target), []).append(n)
    return {name: _layer_call(reads.get(f"{name}.weight", []), name) for name in names}


def _layer_call(getters: list[fx.Node], name: str) -> fx.Node:
    """The one ``aten.linear`` / ``aten.embedding`` node that uses the layer ``name``'s weight, read by
    the graph's ``getters`` of it."""
    users = [u for g in getters for u in g.users]
    op = users[0].target if len(users) == 1 else None
    kind = getattr(getattr(op, "overloadpacket", None), "__name__", "")
    if kind not in _LAYER_OPS or users[0].args[_LAYER_OPS[kind]] is not getters[0]:
        uses = ", ".join(sorted({str(u.target) for u in users})) or "nothing"
        raise TraceError(
            f"tp_plan shards {name}, whose weight the model's graph uses as {uses}, not as one linear or embedding call"
        )
    return users[0]


def _local_copy(model: nn.Module, layers: dict[str, tuple[Any, str]], tp: int) -> nn.Module:
    """A copy of ``model`` whose planned layers' weights (and a colwise linear's bias) have one
    tensor-parallel rank's shape, uninitialised; every other parameter and buffer is shared (a
    colwise_rep layer's too: its output is gathered whole, so what follows it sees the full sizes)."""
    memo: dict[int, Any] = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    for name, (op, style) in layers.items():
        try:
            sub = model.get_submodule(name)
        except AttributeError as e:  # the graph's module names are the model's; say so if not
            raise TraceError(f"tp_plan shards {name}, which the model (as built) does not have") from e
        kind = op.overloadpacket.__name__
        if style == "colwise_rep":  # its output is gathered whole: the graph after it keeps the full sizes
            continue
        # the sharded dimension of the weight: linear weights are (out, in), embeddings (rows, width)
        dim = {("linear", "colwise"): 0, ("linear", "rowwise"): 1, ("embedding", "colwise"): 1}.get((kind, style), 0)
        for pname, p in sub.named_parameters(recurse=False):
            if pname == "weight" or (pname == "bias" and kind == "linear" and style == "colwise"):
                memo[id(p)] = nn.Parameter(_shard_shape(p, dim if pname == "weight" else 0, tp, name), p.requires_grad)
    return copy.deepcopy(model, memo)


def _shard_shape(p: torch.Tensor, dim: int, tp: int, name: str) -> torch.Tensor:
    """An uninitialised tensor of ``p``'s shape with dimension ``dim`` split ``tp`` ways."""
    if p.shape[dim] % tp:
        raise TraceError(
            f"tp_plan splits {name} over {tp} ranks, but its width {p.shape[dim]} is not a multiple of {tp}"
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
        raise TraceError(
            f"the model traces into other operations with its tp_plan layers split {tp} ways (node {k}: {was} whole, "
            f"{now} split): its code branches on the heads or widths"
        )


def call_as_module(root: fx.GraphModule, graph: fx.Graph, name: str, call: fx.Node) -> fx.Node:
    """Replace the graph's ``call`` of the layer ``name`` (``aten.linear`` / ``aten.embedding`` on its
    weight) by a call of an ``nn.Linear`` / ``nn.Embedding`` module holding ``root``'s own parameters,
    installed in ``root`` under ``name``; the node keeps its name and metadata. Tensor parallelism's
    planned layers become modules so (``shardable_trace``), and so do float8's linear layers
    (``planner.capture.float8.convert_stage``). Returns the new call."""
    holder = root.get_submodule(name)
    weight = holder.get_parameter("weight")
    args = list(call.args)
    if call.target is torch.ops.aten.linear.default:
        bias = args[2] if len(args) > 2 else None
        if bias is not None and not (
            isinstance(bias, fx.Node) and bias.op == "get_attr" and bias.target == f"{name}.bias"
        ):
            raise TraceError(f"tp_plan shards {name}, whose linear call adds a bias not its own")
        layer: nn.Module = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        layer.weight = weight
        if bias is not None:
            layer.bias = holder.get_parameter("bias")
        x = args[0]
    else:
        padding = args[2] if len(args) > 2 else -1
        if not isinstance(padding, int) or any(args[3:]) or call.kwargs:  # scale_grad_by_freq, sparse
            raise TraceError(f"tp_plan shards {name}, an embedding with options torch's styles do not keep")
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
    return module_call


def split_refusal(
    traced: TracedModel, mf: ModelFile, tp: int, tp_plan: dict[str, str], request: PlanRequest
) -> str | None:
    """Why a plan's tensor-parallel split cannot run on the model, as the runner would find before
    launch (``shard_sized_graph``): a torch.export graph must trace again at one tp rank's
    sizes into the same nodes. Checked once, for the split the search chose.

    Args:
        traced: the model as traced for the plan (at ``request.microbatch_size``).
        mf: its model file (the example microbatch).
        tp: the chosen tensor-parallel degree.
        tp_plan: the patterns -> styles the plan splits by.
        request: the plan request (its microbatch size and seed).

    Returns:
        The reason, or None (it runs, or needs no check: a torch.fx graph, tp 1).
    """
    if tp == 1 or not isinstance(traced, GraphTrace) or traced.method != "export":
        return None
    params = list(traced.model.parameters())
    device = params[0].device if params else torch.device("cpu")
    inputs, _ = mf.batch(request.microbatch_size, seed=request.seed)
    inputs = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs)
    try:
        shard_sized_graph(traced, traced.model, inputs, tp_plan, tp)
    except TraceError as e:
        return str(e)
    return None


__all__ = ["shard_sized_graph", "shardable_trace", "split_refusal"]
