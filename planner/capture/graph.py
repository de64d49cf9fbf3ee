"""Graph tracing: torch.fx or torch.export, nodes grouped into blocks, legal cuts found.

- ``torch.fx.symbolic_trace`` is tried first: fast (0.07 s for a 96-layer GPT here, against 6.2 s for
  export) and it keeps every ``torch.nn`` module as one ``call_module`` node, so dropout and batch
  norm keep their train-mode behaviour when a stage runs the graph.
- ``torch.export.export(strict=False)`` handles Python control flow on shapes and config flags
  (``if x.shape[1] > n``, ``if mask is None``) that fx cannot follow.

A *block* is a maximal run of graph nodes (in execution order) that belong to the same module:
each child of a ``ModuleList``/``Sequential``/``ModuleDict`` is a block (the repeated layers), and
every other top-level child (embedding, final norm, head) is a block of its own. Root-level
operations (``h * sqrt(d)``, ``.float()``) join the block before them.

Which values flow between blocks is a networkx DAG (``GraphTrace.block_graph``); a value is live
across the cut after block k when it sits on an edge (i, j) with i <= k < j. The cut is legal when
everything live across it can be sent by a pipeline stage: tensors, plus shape-derived constants
(ints, sizes, dtypes) which are baked into the later stage because a pipeline runs with fixed
microbatch shapes anyway (``PipelineStage`` infers shapes once).
"""

from __future__ import annotations

import contextlib
import functools
import io
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import networkx as nx
import torch
import torch.fx as fx
from torch import nn

from planner.capture.blocks import CONTAINERS, Block, Cut, GraphTrace, ValueInfo, describe, is_layer, layer_types
from planner.capture.expert_calls import META_KEY, ExpertCall, exported_calls, recording
from planner.capture.meta_cache import meta_op_cache, on_meta
from planner.capture.shapes import shapes_or_real
from planner.capture.signature import block_structure, leaves_block, rebuild, signature, spec
from planner.errors import TraceError
from planner.torch_compat import (
    export_logger_names,
    fx_arg_bypass,
    lazy_graph_module,
    no_dispatch,
    quiet_loggers,
    set_node_arguments,
)


def trace_fx(model: nn.Module, inputs: tuple[Any, ...], experts: Sequence[str] = ()) -> fx.GraphModule:
    """``torch.fx`` symbolic trace; torch.nn modules stay leaves (one ``call_module`` node each). The
    calls of the ``experts`` modules are recorded in the module's ``meta`` (``planner.capture.expert_calls``)."""
    tracer = _Tracer()
    with recording(model, experts) as calls:
        graph = tracer.trace(model)
    # Planning runs the graph in interpreters and cuts stages out of it (each a module of its own):
    # the whole graph's Python code is generated only if something calls it.
    gm = lazy_graph_module(tracer.root, graph, model.__class__.__name__)
    if experts:
        gm.meta[META_KEY] = _all_called(calls, experts)
    return gm


def _all_called(calls: dict[str, ExpertCall], experts: Sequence[str]) -> dict[str, ExpertCall]:
    """``calls``, every one of ``experts`` in it (a module the forward never called: one line)."""
    missing = [name for name in experts if name not in calls]
    if missing:
        raise TraceError(f"the forward never calls the experts module {missing[0]}")
    return calls


_ARG_BYPASS = fx_arg_bypass()


class _Tracer(fx.Tracer):
    """``fx.Tracer`` whose parameter and buffer look-ups are dictionary reads.

    ``fx.Tracer`` names a parameter or buffer the forward touches by walking ``named_parameters()``
    / ``named_buffers()`` of the whole model until it meets the object: once per access, so a model
    of n layers took n^2 steps (most of the trace of a 1,000-layer Llama). The tables here hold the
    same first names, built once per trace; an object not in them (registered during the forward)
    goes the ``fx.Tracer`` way, so the graph is the one ``fx.Tracer`` makes. Arguments of the exact
    types fx lowers without checks (proxies, numbers, tuples, lists) skip ``fx.Tracer``'s checks for
    parameters, modules and opaque objects, which pass them on unchanged (a third of a large trace).
    """

    def trace(self, root: nn.Module | Any, concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        self._params_by_id: dict[int, tuple[str, torch.Tensor]] = {}
        self._buffers_by_id: dict[int, tuple[str, torch.Tensor]] = {}
        if isinstance(root, nn.Module):
            self._params_by_id = {id(p): (n, p) for n, p in root.named_parameters()}
            self._buffers_by_id = {id(b): (n, b) for n, b in root.named_buffers()}
        return super().trace(root, concrete_args)

    @staticmethod
    def _name_in(table: dict[int, tuple[str, torch.Tensor]], value: torch.Tensor) -> str | None:
        hit = table.get(id(value))
        return hit[0] if hit is not None and hit[1] is value else None

    def create_arg(self, a: Any) -> Any:
        fast = _ARG_BYPASS.get(type(a))
        if fast is not None:  # a proxy, number, tuple, list of exactly that type: fx.Tracer's checks all pass it on
            return fast(self, a)
        if isinstance(a, torch.Tensor):  # as fx.Tracer.create_arg: parameters, then buffers, by first name
            name = self._name_in(self._params_by_id if isinstance(a, nn.Parameter) else self._buffers_by_id, a)
            if name is not None:
                return self.create_node("get_attr", name, (), {})
        return super().create_arg(a)

    def create_node(
        self,
        kind: str,
        target: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        name: str | None = None,
        type_expr: Any | None = None,
    ) -> fx.Node:
        # torch 2.13's Graph.create_node walks every argument of a call for raw SymInts to warn of,
        # which a symbolic trace never makes (its values are proxies): a node made without arguments
        # and given them afterwards skips that walk (a tenth of a 1,000-layer trace), the same node
        if self.check_mutable_operations or not (args or kwargs):
            return super().create_node(kind, target, args, kwargs, name, type_expr)
        node = super().create_node(kind, target, (), {}, name, type_expr)
        set_node_arguments(node, args, kwargs)
        return node

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        name = self._name_in(self._params_by_id, attr_val) if isinstance(attr_val, nn.Parameter) else None
        if name is None:
            return super().getattr(attr, attr_val, parameter_proxy_cache)
        if name not in parameter_proxy_cache:  # as fx.Tracer.getattr
            factory = None
            if self.param_shapes_constant:
                factory = functools.partial(fx.proxy.ParameterProxy, self, name=name, param=attr_val)
            parameter_proxy_cache[name] = self.create_proxy("get_attr", name, (), {}, proxy_factory_fn=factory)
        return parameter_proxy_cache[name]


def trace_export(model: nn.Module, inputs: tuple[Any, ...], experts: Sequence[str] = ()) -> fx.GraphModule:
    """``torch.export.export(strict=False)``, with its logging and partial-graph printing silenced.

    A failing export logs warnings and prints the partial graph; the planner reports the reason in
    one line instead, so that noise is kept off the user's terminal. The ``experts`` modules' call
    signatures are preserved and their calls recorded in the module's ``meta``
    (``planner.capture.expert_calls``).
    """
    with (
        quiet_loggers(export_logger_names()),
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(io.StringIO()),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        # no source line recorded on every node: nothing here reads them, and collecting and
        # symbolizing each node's Python stack was a tenth of an export's time
        emitted, torch.fx.config.do_not_emit_stack_traces = torch.fx.config.do_not_emit_stack_traces, True
        try:
            ep = torch.export.export(model, inputs, strict=False, preserve_module_call_signature=tuple(experts))
        finally:
            torch.fx.config.do_not_emit_stack_traces = emitted
    gm = ep.module()
    _drop_metadata_asserts(gm)  # type: ignore[arg-type]
    if experts:
        gm.meta[META_KEY] = _all_called(exported_calls(ep, experts), experts)
    return gm  # type: ignore[return-value]


def _drop_metadata_asserts(gm: fx.GraphModule) -> None:
    """Remove the ``aten._assert_tensor_metadata`` checks torch.export puts before a ``.to(dtype)``.

    They assert the dtype and device the tensor had when traced (fp32, on the CPU). Under autocast a
    stage's activations are bf16, so Mixtral's ``routing_weights.to(hidden_states.dtype)`` stopped the
    profile and the run on a GPU ("Tensor dtype mismatch! Expected: Float, Got: BFloat16") where the
    eager model trains; the cast that follows each check stays and does what the model's code says.
    """
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default:
            gm.graph.erase_node(node)
    gm.recompile()


def record_values(
    gm: fx.GraphModule,
    inputs: tuple[Any, ...],
    shapes_only: bool = False,
    blocks: Sequence[Block] | None = None,
) -> dict[str, ValueInfo]:
    """Run the graph once (no grad) and note what each node produced.

    The buffers are put back afterwards, so recording moves no batch-norm statistics. (Switching
    to eval mode instead is not possible: torch.export's modules refuse ``.eval()``.)

    Args:
        gm: the traced graph.
        inputs: one example microbatch.
        shapes_only: run on fake tensors (``planner.capture.shapes``: no weights read, nothing
            computed), or for real where fake tensors cannot run the graph. The runner's traces do;
            the planner's run for real, as the profile does next.
        blocks: the graph's blocks (``group_blocks``): on the meta device a block that is the twin
            of one run before (``planner.capture.signature``) is not run again, its values are
            replayed (a 1,000-layer model runs each distinct layer once). None: every node runs.

    Returns:
        Node name -> what it produced.
    """
    return recorded_run(gm, inputs, shapes_only, blocks)[0]


def recorded_run(
    gm: fx.GraphModule,
    inputs: tuple[Any, ...],
    shapes_only: bool = False,
    blocks: Sequence[Block] | None = None,
) -> tuple[dict[str, ValueInfo], Any]:
    """``record_values``, and what the graph returned when it ran on the meta device.

    Args:
        gm: as ``record_values``.
        inputs: as ``record_values``.
        shapes_only: as ``record_values``.
        blocks: as ``record_values``.

    Returns:
        The values, and the graph's output: meta tensors when the graph ran on the meta device, None
        when it ran on real or fake tensors (not kept: a real output can be large, a fake one is
        tied to its fake mode).
    """
    values: dict[str, ValueInfo] = {}
    meta = not shapes_only and on_meta(gm, inputs)

    def run(*args: Any) -> Any:
        values.clear()  # a fake run that failed half-way leaves nothing behind
        return _interpreter(gm, values, blocks if meta else None).run(*args)

    with buffers_restored(gm), torch.no_grad():
        if shapes_only:
            shapes_or_real(gm, run, *inputs)
            return values, None
        with meta_op_cache(meta):  # identical operators: their meta kernels run once
            out = run(*inputs)
    return values, out if meta else None


def _interpreter(gm: fx.GraphModule, values: dict[str, ValueInfo], blocks: Sequence[Block] | None) -> fx.Interpreter:
    """The interpreter that runs ``gm`` noting its values: replaying twin blocks when given
    ``blocks`` (meta runs only), else running every node."""
    return _Replaying(gm, values, blocks) if blocks else _Recorder(gm, values)


class _Recorder(fx.Interpreter):
    """Runs the graph, noting what each node produced."""

    def __init__(self, gm: fx.GraphModule, values: dict[str, ValueInfo], *, free_values: bool = True) -> None:
        # free_values False: keep every node's value to the end (meta tensors hold no memory), which
        # spares the interpreter its table of last uses, a pass over every node's inputs per run
        super().__init__(gm, garbage_collect_values=free_values)
        self.values = values

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        self.values[n.name] = describe(out)
        return out


class _Replaying(_Recorder):
    """``_Recorder`` that runs each distinct block once and replays its twins' values (meta only).

    A twin's values are the first block's, node by node: its descriptions are copied, and only the
    values that leave the block (read by a later block or the output) are made again as fresh meta
    tensors; the others are never read, since the twin's nodes do not run.
    """

    def __init__(self, gm: fx.GraphModule, values: dict[str, ValueInfo], blocks: Sequence[Block]) -> None:
        super().__init__(gm, values, free_values=False)
        self.first = {b.nodes[0]: b for b in blocks if b.nodes}
        self.last = {b.nodes[-1] for b in blocks if b.nodes}
        # signature -> its nodes' value specs, descriptions and whether each leaves the block, in order
        self.known: dict[Any, tuple[list[Any], list[ValueInfo], list[bool]]] = {}
        self.replay: tuple[list[Any], list[ValueInfo]] | None = None  # a twin running now: its values
        self.recording: tuple[Any, list[Any], list[ValueInfo]] | None = None  # a new block: its key, so far
        self.block: Block | None = None
        self.in_block: set[str] = set()
        self.position = 0
        self.nodes = {n.name: n for n in gm.graph.nodes}

    def _begin(self, block: Block) -> None:
        shape = block_structure(self.module, block.nodes, self.nodes)
        key = signature(shape, self.module, lambda a: self.env[a])
        self.block, self.in_block, self.position = block, set(block.nodes), 0
        if key is not None and key in self.known:
            specs, infos, leaves = self.known[key]
            with no_dispatch():  # plain allocations: the meta cache has nothing to add to them
                fresh = [rebuild(x) if out else None for x, out in zip(specs, leaves)]
            self.replay, self.recording = (fresh, infos), None
        else:
            self.replay, self.recording = None, ((key, [], []) if key is not None else None)

    def run_node(self, n: fx.Node) -> Any:
        if n.name in self.first:
            self._begin(self.first[n.name])
        if n.name not in self.in_block:
            return super().run_node(n)
        if self.replay is not None:
            out = self.replay[0][self.position]
            self.values[n.name] = self.replay[1][self.position]
        else:
            out = super().run_node(n)
            if self.recording is not None:
                recorded = spec(out)
                if recorded is None:  # a value that cannot be replayed: the block is not remembered
                    self.recording = None
                else:
                    self.recording[1].append(recorded)
                    self.recording[2].append(self.values[n.name])
        self.position += 1
        if n.name in self.last:
            if self.recording is not None and self.block is not None:
                key, specs, infos = self.recording
                self.known[key] = (specs, infos, leaves_block(self.block.nodes, self.nodes))
            self.replay = self.recording = None
            self.in_block = set()
        return out


def retarget_devices(gm: fx.GraphModule, device: torch.device) -> int:
    """Point every CPU device the graph names at ``device``, in place.

    torch.export records the device of a tensor the forward makes (``torch.arange(n, device=x.device)``
    in transformers' masks and positions, ``.to(x.device)``) as the constant it was when traced. The
    runner traces on the CPU (the model is built there; a rank's GPU need not hold all of it) and runs
    the stages on the rank's GPU, where such a node failed with "Tensor device mismatch! Expected: cpu,
    Got: cuda:0" (every transformers model under `planner run` on a GPU). torch.fx keeps them as calls
    on the tensor, so its graphs have none.

    Args:
        gm: the traced graph.
        device: where its stages will run.

    Returns:
        How many arguments were changed.
    """
    changed = 0

    def move(a: Any) -> Any:
        nonlocal changed
        if isinstance(a, torch.device) and a.type == "cpu":
            changed += 1
            return device
        return a

    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        args = fx.node.map_aggregate(node.args, move)
        kwargs = {
            k: (move(torch.device(v)) if k == "device" and v == "cpu" else fx.node.map_aggregate(v, move))
            for k, v in node.kwargs.items()
        }
        node.args, node.kwargs = tuple(args), kwargs
    if changed:
        gm.recompile()
    return changed


@contextlib.contextmanager
def buffers_restored(module: nn.Module) -> Iterator[None]:
    """Put ``module``'s buffers back as they were when the block ends (batch-norm statistics that
    an example forward moved). Used instead of ``.eval()``, which torch.export's modules refuse."""
    saved = {name: buf.clone() for name, buf in module.named_buffers()}
    try:
        yield
    finally:
        with torch.no_grad():
            for name, buf in module.named_buffers():
                buf.copy_(saved[name])


def analyse_graph(
    gm: fx.GraphModule,
    model: nn.Module,
    method: str,
    failures: list[tuple[str, str]],
    values: dict[str, ValueInfo],
    blocks: Sequence[Block] | None = None,
) -> GraphTrace:
    """Group a traced graph's nodes into blocks, build the block graph and judge every cut.

    Args:
        gm: the traced graph.
        model: the private model copy it was traced from (module paths are resolved on it).
        method: "fx" or "export".
        failures: tracers tried before, and why they failed.
        values: ``record_values(gm, inputs)``.
        blocks: ``group_blocks(gm, model)`` where the caller made them (None: grouped here).

    Returns:
        The graph trace.

    Raises:
        TraceError: the graph has no operations, or is not in execution order.
    """
    nodes = list(gm.graph.nodes)
    blocks = list(blocks) if blocks is not None else group_blocks(gm, model)
    if not blocks:
        raise TraceError(f"{type(model).__name__} has no operations to place in a pipeline stage")
    block_of = {name: i for i, b in enumerate(blocks) for name in b.nodes}
    for n in nodes:
        if n.op == "placeholder":
            block_of[n.name] = 0
        elif n.op == "output":
            block_of[n.name] = len(blocks) - 1
    graph = _block_graph(nodes, block_of, len(blocks))
    trace = GraphTrace(model, method, failures, blocks, [], values, gm=gm, block_graph=graph, block_of=block_of)
    trace.cuts = _judge_cuts(trace, nodes)
    return trace


def with_values(traced: GraphTrace, values: dict[str, ValueInfo]) -> GraphTrace:
    """``traced`` with the values recorded on inputs of another size: the same graph groups into the
    same blocks and block graph (they depend on the nodes and their module paths only), so only the
    cuts, which look at the values, are judged again.

    Args:
        traced: a graph trace.
        values: ``record_values(traced.gm, inputs)`` at the new size.

    Returns:
        A trace sharing ``traced``'s graph, model, blocks and block graph.
    """
    trace = GraphTrace(
        traced.model,
        traced.method,
        list(traced.failures),
        traced.blocks,
        [],
        values,
        gm=traced.gm,
        block_graph=traced.block_graph,
        block_of=traced.block_of,
    )
    trace.cuts = _judge_cuts(trace, list(traced.gm.graph.nodes))
    return trace


def group_blocks(gm: fx.GraphModule, model: nn.Module) -> list[Block]:
    """The graph's operations grouped into blocks (none when it has no operations).

    Maximal runs of nodes with the same block key (``block_key``: the repeated layer or top-level
    module a node runs in); root-level operations join the run before. The grouping looks at the
    nodes' module paths only, not at any value, so it can come before the values are recorded.

    Args:
        gm: the traced graph.
        model: the private model copy it was traced from (module paths are resolved on it).

    Returns:
        The blocks, in graph order.
    """
    compute = [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    return _group_blocks(model, compute) if compute else []


def _group_blocks(model: nn.Module, compute: list[fx.Node]) -> list[Block]:
    """Maximal runs of nodes with the same block key; root-level operations join the run before."""
    ancestors = _ancestors(model)
    layers: dict[int, frozenset[type]] = {}  # layer_types per container: its children counted once
    by_stack: dict[tuple[str, ...], tuple[str | None, bool]] = {}  # the nodes of one module share a stack

    def key_of(n: fx.Node) -> tuple[str | None, bool]:
        stack = tuple(_module_path(n, calls=True))
        if stack not in by_stack:
            by_stack[stack] = block_key(model, list(stack), ancestors, layers)
        return by_stack[stack]

    keys = {n.name: key_of(n) for n in compute}
    current = next((keys[n.name] for n in compute if keys[n.name][0] is not None), ("<root>", False))
    runs: list[tuple[tuple[str | None, bool], list[str]]] = []
    for n in compute:
        key = keys[n.name] if keys[n.name][0] is not None else current
        current = key
        if runs and runs[-1][0] == key:
            runs[-1][1].append(n.name)
        else:
            runs.append((key, [n.name]))
    # a module the forward calls again (ALBERT's one layer, applied to every block) is a repeated layer
    called_again = {_plain(path) for (path, _), _ in runs if path and path != _plain(path)}
    blocks: list[Block] = []
    seen: dict[str, int] = {}
    for (path, layer), names in runs:
        name = _plain(path) if path else "<root>"  # a layer's later calls: name#2, name#3, ...
        layer = layer or name in called_again
        seen[name] = seen.get(name, 0) + 1
        unique = name if seen[name] == 1 else f"{name}#{seen[name]}"
        blocks.append(Block(unique, tuple(names), layer))
    return blocks


def _block_graph(nodes: list[fx.Node], block_of: dict[str, int], n_blocks: int) -> nx.DiGraph:
    """Edge (i, j) for every value block i produces and block j reads, the value names on the edge.

    get_attr nodes (parameters, buffers, constants) are never sent: each stage that reads one holds
    it itself, so they belong to no block and make no edge.
    """
    graph = nx.DiGraph()
    graph.add_nodes_from(range(n_blocks))
    for n in nodes:
        if n.op == "get_attr" or n.name not in block_of:
            continue
        src = block_of[n.name]
        for user in n.users:
            dst = block_of.get(user.name)
            if dst is None or dst == src:
                continue
            if dst < src:  # fx graphs are topologically ordered, so blocks in node order cannot go back
                raise TraceError(f"node {user.name} reads {n.name} from a later block: graph is not in execution order")
            if not graph.has_edge(src, dst):
                graph.add_edge(src, dst, values=[])
            if n.name not in graph.edges[src, dst]["values"]:
                graph.edges[src, dst]["values"].append(n.name)
    return graph


def _judge_cuts(trace: GraphTrace, nodes: list[fx.Node]) -> list[Cut]:
    """Every cut, in one sweep over the blocks (what ``trace.live_across(k)`` says for each k).

    A value is live across cut k when its block is at or before k and its last reader's block after
    k: it enters the live set at its own block and leaves it at its last reader's. Readers that
    modify a value in place are found once per value, not once per cut it crosses.
    """
    order = {n.name: i for i, n in enumerate(nodes)}
    by_name = {n.name: n for n in nodes}
    born: dict[int, list[str]] = {}
    dies: dict[int, list[str]] = {}
    for i, j, vals in trace.block_graph.edges(data="values"):
        for v in vals:
            born.setdefault(i, []).append(v)
            dies.setdefault(j, []).append(v)
    last: dict[str, int] = {}
    for j, vals in dies.items():
        for v in vals:
            last[v] = max(last.get(v, j), j)
    modifiers: dict[str, list[tuple[int, str]]] = {}
    live: set[str] = set()
    cuts = []
    for k in range(len(trace.blocks) - 1):
        live.update(born.get(k, ()))
        live.difference_update([v for v in dies.get(k, ()) if last[v] == k])
        cuts.append(_judge_cut(trace, k, sorted(live, key=order.__getitem__), by_name, modifiers))
    return cuts


def _judge_cut(
    trace: GraphTrace,
    k: int,
    live: list[str],
    by_name: dict[str, fx.Node],
    modifiers: dict[str, list[tuple[int, str]]],
) -> Cut:
    """Whether a stage may end after block k, with ``live`` the values crossing it in graph order.

    ``modifiers`` caches, per value, its readers that change it in place (their blocks and names).
    """
    kinds = {v: trace.values.get(v, ValueInfo("opaque")).kind for v in live}
    tensors = tuple(v for v in live if kinds[v] == "tensor")
    consts = tuple(v for v in live if kinds[v] == "const")
    opaque = [v for v in live if kinds[v] == "opaque"]
    for v in tensors:
        if v not in modifiers:
            modifiers[v] = [
                (trace.block_of.get(u.name, -1), u.name)
                for u in by_name[v].users
                if _modifies_input(trace.gm, u, by_name[v])
            ]
    inplace = [name for v in tensors for block, name in modifiers[v] if block > k]
    reason = ""
    if opaque:
        reason = f"non-tensor value(s) {', '.join(opaque[:3])} cross this boundary"
    elif inplace:
        # A pipeline stage receives its inputs as leaf tensors that require grad; autograd refuses
        # in-place operations on those.
        reason = f"{inplace[0]} modifies a received tensor in place"
    elif not tensors:
        reason = "nothing crosses this boundary"
    nbytes = sum(trace.values[v].nbytes for v in tensors)
    return Cut(k, tensors, consts, nbytes, legal=not reason, reason=reason)


def _module_path(node: fx.Node, calls: bool = False) -> list[str]:
    """The node's module stack as FQNs, outermost first (fx and export store it differently).

    With ``calls``, the second and later calls of a module carry their index (``layer@1``), as both
    tracers key them in the stack: ALBERT applies one layer module to every block, and each
    application is a block of its own (``_group_blocks``; ``_plain`` drops the index).
    """
    stack = node.meta.get("nn_module_stack") or {}
    paths: list[str] = []
    for key, value in stack.items():
        fqn = value[0] if isinstance(value, tuple) else key
        if fqn:
            _, at, index = str(key).rpartition("@")
            paths.append(f"{fqn}@{index}" if calls and at and index.isdigit() else fqn)
    if node.op == "call_module" and (not paths or paths[-1] != node.target) and not str(node.target).startswith("_"):
        paths.append(str(node.target))
    return paths


def _ancestors(root: nn.Module) -> set[str]:
    """Paths of the root and of every module that (transitively) holds a container."""
    found = {""}
    for path, module in root.named_modules():
        if isinstance(module, CONTAINERS):
            parts = path.split(".") if path else []
            found.update(".".join(parts[:i]) for i in range(len(parts) + 1))
    return found


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def _plain(path: str) -> str:
    """A module path without its call index (``_module_path(..., calls=True)``)."""
    return path.partition("@")[0]


def block_key(
    root: nn.Module, paths: list[str], ancestors: set[str], layers: dict[int, frozenset[type]] | None = None
) -> tuple[str | None, bool]:
    """Which block a node with module stack ``paths`` belongs to, and whether it is a repeated layer.

    The block is the outermost module on the path that is a child of a container (one of the
    repeated layers), or else the outermost module that is a child of a module holding the
    containers (embedding, final norm, head — also inside wrappers such as HF's ``transformer``).

    Args:
        root: the traced model.
        paths: the node's module stack, outermost first (paths may carry a call index, ``layer@1``,
            which the block key keeps: another call of a layer is another block).
        ancestors: ``_ancestors(root)``.
        layers: a cache of ``layer_types`` per container id, shared by the calls for one model
            (``is_layer`` counts the container's children: n layers would take n^2 steps).

    Returns:
        (block name or None for root-level operations, is_layer).
    """
    for path in paths:
        try:
            parent = root.get_submodule(_parent(_plain(path)))
        except AttributeError:
            continue
        if isinstance(parent, CONTAINERS):
            child = root.get_submodule(_plain(path))
            if layers is None:
                return path, is_layer(parent, child)
            if id(parent) not in layers:
                layers[id(parent)] = layer_types(parent)
            return path, type(child) in layers[id(parent)]
    for path in paths:
        if _plain(path) not in ancestors and _parent(_plain(path)) in ancestors:
            return path, False
    return None, False  # root-level (or wrapper-level) operation: joins the block before it


def _modifies_input(gm: fx.GraphModule, user: fx.Node, value: fx.Node) -> bool:
    """Whether ``user`` changes ``value`` in place (ReLU(inplace=True), x.add_(...), F.relu(x, inplace=True))."""
    if not user.args or user.args[0] is not value:
        return False
    if user.kwargs.get("inplace") is True:
        return True
    if user.op == "call_module":
        return getattr(gm.get_submodule(str(user.target)), "inplace", False) is True
    name = user.target if user.op == "call_method" else getattr(user.target, "__name__", "")
    return isinstance(name, str) and (name.endswith("_") and not name.endswith("__") or name.startswith("__i"))
