"""Tracing: capture a model as a graph, group its nodes into blocks, find the legal cut points.

The fallback chain (DESIGN.md "Tracing"):

1. ``torch.fx.symbolic_trace`` — fast (0.07 s for a 96-layer GPT here, against 6.2 s for export;
   shared/REFERENCES.md) and it keeps every ``torch.nn`` module as one ``call_module`` node, so
   dropout and batch norm keep their train-mode behaviour when a stage runs the graph.
2. ``torch.export.export(strict=False)`` — handles Python control flow on shapes and config flags
   (``if x.shape[1] > n``, ``if mask is None``) that fx cannot follow.
3. Module boundaries — no graph at all: the children of the model's containers are observed with
   forward hooks. Good enough to plan (costs per block), not to run: the runner needs a graph.

A *block* is a maximal run of graph nodes (in execution order) that belong to the same module:
each child of a ``ModuleList``/``Sequential``/``ModuleDict`` is a block (the repeated layers), and
every other top-level child (embedding, final norm, head) is a block of its own. Root-level
operations (``h * sqrt(d)``, ``.float()``) join the block before them.

A *cut* after block k is legal when everything live across it can be sent by a pipeline stage:
tensors, plus shape-derived constants (ints, sizes, dtypes) which are baked into the later stage
because a pipeline runs with fixed microbatch shapes anyway (``PipelineStage`` infers shapes once).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import logging
import sysconfig
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import networkx as nx
import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from planner.errors import TraceError

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
# Python values that may cross a cut by being baked into the later stage as constants.
_CONST_TYPES = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.Size)


@dataclass(frozen=True)
class ValueInfo:
    """What a graph node produced on the example microbatch.

    Attributes:
        kind: "tensor", "const" (a bakeable Python constant) or "opaque" (anything else).
        nbytes: bytes of the tensor(s); 0 for constants.
        const: the constant's value when kind == "const".
    """

    kind: str
    nbytes: int = 0
    const: Any = None


@dataclass(frozen=True)
class Block:
    """A contiguous run of graph nodes that the planner treats as one unit."""

    name: str
    nodes: tuple[str, ...]
    is_layer: bool


@dataclass(frozen=True)
class Cut:
    """The boundary after block ``after``: what crosses it and whether a stage may end there."""

    after: int
    tensors: tuple[str, ...]
    consts: tuple[str, ...]
    nbytes: int
    legal: bool
    reason: str = ""


@dataclass
class TracedModel:
    """A model captured as a graph and split into blocks with their cut points.

    Attributes:
        gm: the traced graph module (owns a private copy of the model's modules and parameters),
            or None when tracing fell back to module boundaries.
        model: the private copy of the model that was traced (never the caller's object).
        method: "fx", "export" or "modules".
        failures: (method, reason) for every tracer that was tried and failed, in order.
        blocks: blocks in execution order.
        cuts: ``cuts[k]`` is the boundary after ``blocks[k]`` (len(blocks) - 1 of them).
        values: what each node produced on the example microbatch.
        block_graph: networkx DAG of blocks; edge (i, j) carries the names of the values that block
            i produces and block j reads.
    """

    gm: fx.GraphModule | None
    model: nn.Module
    method: str
    failures: list[tuple[str, str]]
    blocks: list[Block]
    cuts: list[Cut]
    values: dict[str, ValueInfo] = field(default_factory=dict)
    block_graph: nx.DiGraph = field(default_factory=nx.DiGraph)
    block_of: dict[str, int] = field(default_factory=dict)

    def owned_parameters(self) -> list[list[nn.Parameter]]:
        """Per block, the parameters it owns: those it reads that no earlier block read.

        A shared (tied) parameter is owned by the first block that uses it, so parameter counts,
        bytes and optimizer work add up over blocks without counting it twice.

        Returns:
            One list per block, in block order.
        """
        claimed: set[int] = set()
        owned: list[list[nn.Parameter]] = []
        for k in range(len(self.blocks)):
            own = [p for p in self._block_parameters(k) if id(p) not in claimed]
            claimed.update(id(p) for p in own)
            owned.append(own)
        return owned

    def _block_parameters(self, k: int) -> list[nn.Parameter]:
        """Parameters read by block k: its module's, or those its nodes read (call_module targets
        and get_attr parameters)."""
        if self.gm is None:
            return list(self.model.get_submodule(self.blocks[k].name).parameters())
        gm = self.gm
        nodes = {n.name: n for n in gm.graph.nodes}
        found: dict[int, nn.Parameter] = {}
        for name in self.blocks[k].nodes:
            node = nodes[name]
            if node.op == "call_module":
                for p in gm.get_submodule(str(node.target)).parameters():
                    found.setdefault(id(p), p)
            for arg in node.all_input_nodes:
                if arg.op == "get_attr":
                    value = _get_attr(gm, str(arg.target))
                    if isinstance(value, nn.Parameter):
                        found.setdefault(id(value), value)
        return list(found.values())

    @property
    def output_bytes(self) -> int:
        """Bytes of the tensors the model returns for the example microbatch (0 if unknown)."""
        if self.gm is None:
            last = self.values.get(self.blocks[-1].name)
            return last.nbytes if last and last.kind == "tensor" else 0
        out = next(node for node in self.gm.graph.nodes if node.op == "output")
        names = {a.name for a in pytree.tree_leaves(out.args) if isinstance(a, fx.Node)}
        return sum(self.values[n].nbytes for n in names if n in self.values and self.values[n].kind == "tensor")

    @property
    def fingerprint(self) -> str:
        """A hash of the model's structure: blocks, their nodes and operators, parameter shapes.

        Two builds of the same model code and config give the same fingerprint; a change to the
        architecture or the config changes it. Weights and the example data do not enter it.
        """
        h = hashlib.sha256()
        h.update(self.method.encode())
        for block in self.blocks:
            h.update(f"[{block.name}|{block.is_layer}]".encode())
        if self.gm is not None:
            for node in self.gm.graph.nodes:
                h.update(f"{node.name}:{node.op}:{_target_name(node.target)};".encode())
        for name, p in self.model.named_parameters():
            h.update(f"{name}{tuple(p.shape)}{p.dtype};".encode())
        return h.hexdigest()[:16]


def _get_attr(root: nn.Module, target: str) -> Any:
    value: Any = root
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _target_name(target: Any) -> str:
    """A stable text for a node target (no memory addresses)."""
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None) or ""
    return f"{module}.{getattr(target, '__qualname__', getattr(target, '__name__', type(target).__name__))}"


class _Tracer(fx.Tracer):
    """fx tracer that keeps torch.nn modules as leaves (the default rule, stated here on purpose)."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return super().is_leaf_module(m, module_qualified_name)


def _trace_fx(model: nn.Module, inputs: tuple) -> fx.GraphModule:
    tracer = _Tracer()
    graph = tracer.trace(model)
    return fx.GraphModule(tracer.root, graph, model.__class__.__name__)


def _trace_export(model: nn.Module, inputs: tuple) -> fx.GraphModule:
    # A failing export logs warnings and prints the partial graph; the planner reports the reason
    # in one line instead, so keep that noise off the user's terminal.
    loggers = [logging.getLogger(name) for name in ("torch.fx.experimental.symbolic_shapes", "torch._dynamo", "torch.export", "torch._export")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ep = torch.export.export(model, inputs, strict=False)
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
    return ep.module()


_NOT_USER_CODE = tuple(
    str(Path(p).resolve()) for p in (Path(torch.__file__).parent, Path(__file__).parent, sysconfig.get_paths()["stdlib"])
)


def _short_reason(e: BaseException) -> str:
    """One line: the exception, shortened, and the model-code line that triggered it."""
    text = " ".join(str(e).split())
    if len(text) > 200:
        text = text[:200] + "..."
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not str(Path(f.filename).resolve()).startswith(_NOT_USER_CODE)]
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno}: {frames[-1].line})" if frames else ""
    return f"{type(e).__name__}: {text}{where}"


def trace_model(
    model: nn.Module, inputs: tuple, methods: tuple[str, ...] = ("fx", "export", "modules")
) -> TracedModel:
    """Trace ``model`` on an example microbatch, group nodes into blocks and find legal cuts.

    The model is deep-copied first, so tracing and everything done later with the result
    (profiling runs forward and backward) never changes the caller's model.

    Args:
        model: the model to trace.
        inputs: positional inputs of one microbatch (shapes are baked into constants; use the
            microbatch size the pipeline will run with).
        methods: tracers to try, in order (a subset of "fx", "export", "modules").

    Returns:
        The traced model with blocks and cuts.

    Raises:
        TraceError: when every tracer failed; the message names what stopped each one.
    """
    private = copy.deepcopy(model)
    failures: list[tuple[str, str]] = []
    tracers: dict[str, Callable[[nn.Module, tuple], fx.GraphModule]] = {"fx": _trace_fx, "export": _trace_export}
    for method in methods:
        if method == "modules":
            try:
                from planner.capture.modules import trace_module_boundaries

                return trace_module_boundaries(private, inputs, failures)
            except TraceError as e:
                failures.append(("modules", str(e)))
                continue
        try:
            gm = tracers[method](private, inputs)
            values = _record_values(gm, inputs)
        except Exception as e:  # any tracer failure means: try the next one
            failures.append((method, _short_reason(e)))
            continue
        return _analyse_graph(gm, private, method, failures, values)
    detail = "; ".join(f"{m}: {r}" for m, r in failures)
    raise TraceError(
        f"could not trace {type(model).__name__} with any of {', '.join(methods)} ({detail}); "
        "make forward free of data-dependent control flow, or put the repeated layers in an nn.ModuleList"
    )


def _record_values(gm: fx.GraphModule, inputs: tuple) -> dict[str, ValueInfo]:
    """Run the graph once (no grad) and note what each node produced."""
    values: dict[str, ValueInfo] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            values[n.name] = _describe(out)
            return out

    # Put the buffers back afterwards, so recording moves no batch-norm statistics. (Switching to
    # eval mode instead is not possible: torch.export's modules refuse .eval().)
    saved = {name: buf.clone() for name, buf in gm.named_buffers()}
    try:
        with torch.no_grad():
            Recorder(gm).run(*inputs)
    finally:
        with torch.no_grad():
            for name, buf in gm.named_buffers():
                buf.copy_(saved[name])
    return values


def _describe(value: Any) -> ValueInfo:
    if isinstance(value, torch.Tensor):
        return ValueInfo("tensor", value.numel() * value.element_size())
    if isinstance(value, _CONST_TYPES):
        return ValueInfo("const", 0, value)
    if isinstance(value, (tuple, list)) and all(isinstance(v, _CONST_TYPES) for v in value):
        return ValueInfo("const", 0, value)
    return ValueInfo("opaque")


def _module_path(node: fx.Node) -> list[str]:
    """The node's module stack as FQNs, outermost first (fx and export store it differently)."""
    stack = node.meta.get("nn_module_stack") or {}
    paths: list[str] = []
    for key, value in stack.items():
        fqn = value[0] if isinstance(value, tuple) else key
        if fqn:
            paths.append(fqn)
    if node.op == "call_module" and (not paths or paths[-1] != node.target) and not str(node.target).startswith("_"):
        paths.append(str(node.target))
    return paths


def _is_layer(container: nn.Module, child: nn.Module) -> bool:
    """A container child is a repeated *layer* when its type is the most common among its siblings.

    In the Pipe tutorial's ``Sequential(Encoder, TransformerEncoderLayer x N, Decoder)`` the encoder
    layers are layers and the embedding/decoder wrappers are not, which is what the uniform-layer
    baseline (torchtitan, Megatron) counts.
    """
    kinds = Counter(type(c) for c in container.children())
    top = max(kinds.values())
    return kinds[type(child)] == top and top >= 2


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


def block_key(root: nn.Module, paths: list[str], ancestors: set[str]) -> tuple[str | None, bool]:
    """Which block a node with module stack ``paths`` belongs to, and whether it is a repeated layer.

    The block is the outermost module on the path that is a child of a container (one of the
    repeated layers), or else the outermost module that is a child of a module holding the
    containers (embedding, final norm, head — also inside wrappers such as HF's ``transformer``).

    Args:
        root: the traced model.
        paths: the node's module stack, outermost first.
        ancestors: ``_ancestors(root)``.

    Returns:
        (block name or None for root-level operations, is_layer).
    """
    for path in paths:
        try:
            parent = root.get_submodule(_parent(path))
        except AttributeError:
            continue
        if isinstance(parent, CONTAINERS):
            return path, _is_layer(parent, root.get_submodule(path))
    for path in paths:
        if path not in ancestors and _parent(path) in ancestors:
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


def _analyse_graph(
    gm: fx.GraphModule, model: nn.Module, method: str, failures: list[tuple[str, str]], values: dict[str, ValueInfo]
) -> TracedModel:
    nodes = list(gm.graph.nodes)
    compute = [n for n in nodes if n.op not in ("placeholder", "get_attr", "output")]
    if not compute:
        raise TraceError(f"{type(model).__name__} has no operations to place in a pipeline stage")
    ancestors = _ancestors(model)
    keys: dict[str, tuple[str | None, bool]] = {n.name: block_key(model, _module_path(n), ancestors) for n in compute}
    # Root-level operations join the block before them (or the first block if nothing precedes).
    first_key = next((keys[n.name] for n in compute if keys[n.name][0] is not None), ("<root>", False))
    current = first_key
    runs: list[tuple[tuple[str, bool], list[str]]] = []
    for n in compute:
        key = keys[n.name] if keys[n.name][0] is not None else current
        current = key
        if runs and runs[-1][0] == key:
            runs[-1][1].append(n.name)
        else:
            runs.append((key, [n.name]))  # type: ignore[arg-type]
    blocks: list[Block] = []
    seen: dict[str, int] = {}
    for (name, is_layer), names in runs:
        seen[name] = seen.get(name, 0) + 1
        unique = name if seen[name] == 1 else f"{name}#{seen[name]}"
        blocks.append(Block(unique, tuple(names), is_layer))
    block_of = {name: i for i, b in enumerate(blocks) for name in b.nodes}
    for n in nodes:
        if n.op == "placeholder":
            block_of[n.name] = 0
        elif n.op == "output":
            block_of[n.name] = len(blocks) - 1
    # get_attr nodes (parameters, buffers, constants) are never sent: each stage that reads one
    # holds it itself. They belong to no block.
    graph = nx.DiGraph()
    graph.add_nodes_from(range(len(blocks)))
    last_use: dict[str, int] = {}
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
            graph.add_edge(src, dst)
            graph.edges[src, dst].setdefault("values", []).append(n.name)
            last_use[n.name] = max(last_use.get(n.name, src), dst)
    order = {n.name: i for i, n in enumerate(nodes)}
    by_name = {n.name: n for n in nodes}
    cuts: list[Cut] = []
    for k in range(len(blocks) - 1):
        live = [name for name, end in last_use.items() if block_of[name] <= k < end]
        live.sort(key=order.__getitem__)
        tensors = tuple(v for v in live if values.get(v, ValueInfo("opaque")).kind == "tensor")
        consts = tuple(v for v in live if values.get(v, ValueInfo("opaque")).kind == "const")
        opaque = [v for v in live if v not in tensors and v not in consts]
        inplace = [u.name for v in tensors for u in by_name[v].users if block_of.get(u.name, -1) > k and _modifies_input(gm, u, by_name[v])]
        reason = ""
        if opaque:
            reason = f"non-tensor value(s) {', '.join(opaque[:3])} cross this boundary"
        elif inplace:
            # A pipeline stage receives its inputs as leaf tensors that require grad; autograd
            # refuses in-place operations on those.
            reason = f"{inplace[0]} modifies a received tensor in place"
        elif not tensors:
            reason = "nothing crosses this boundary"
        nbytes = sum(values[v].nbytes for v in tensors)
        cuts.append(Cut(k, tensors, consts, nbytes, legal=not reason, reason=reason))
    return TracedModel(gm, model, method, failures, blocks, cuts, values, graph, block_of)


def _impure(node: fx.Node) -> bool:
    if node.is_impure():
        return True
    if node.kwargs.get("inplace") is True:
        return True
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return isinstance(name, str) and name.endswith("_") and not name.endswith("__")


def build_stage_module(traced: TracedModel, start: int, end: int, *, check_cuts: bool = True) -> fx.GraphModule:
    """Build the module that runs ``blocks[start:end]`` of a traced model.

    Its positional inputs are the tensors crossing the cut before ``start`` (the model's own inputs
    for ``start == 0``), in graph order; it returns the tensors crossing the cut after ``end - 1``
    (a single tensor when only one crosses), or the model's output for the last stage. Values that
    merely pass through the stage (skip connections) are returned unchanged. Parameters and
    submodules are shared with ``traced.gm``, not copied.

    Args:
        traced: a graph-traced model (method "fx" or "export").
        start: first block of the stage.
        end: one past the last block of the stage.
        check_cuts: refuse illegal cuts at either end (profiling turns this off to time single
            blocks; non-tensor values must still be constants or tensors).

    Returns:
        The stage as an ``fx.GraphModule``.

    Raises:
        TraceError: when the model was traced by module boundaries (no graph), the range is empty,
            or a cut at either end is not legal.
    """
    gm = traced.gm
    if gm is None:
        raise TraceError(
            f"this model was traced by module boundaries ({'; '.join(r for _, r in traced.failures)}), "
            "so there is no graph to cut into stages; make it traceable by torch.fx or torch.export"
        )
    n = len(traced.blocks)
    if not 0 <= start < end <= n:
        raise TraceError(f"stage block range [{start}, {end}) is not within the model's {n} blocks")
    for k in (start - 1, end - 1):
        if check_cuts and 0 <= k < n - 1 and not traced.cuts[k].legal:
            raise TraceError(f"cannot cut after block {traced.blocks[k].name}: {traced.cuts[k].reason}")
    graph = fx.Graph()
    env: dict[str, Any] = {}
    nodes = {node.name: node for node in gm.graph.nodes}
    if start == 0:
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                env[node.name] = graph.node_copy(node, lambda a: env[a.name])
    else:
        cut = traced.cuts[start - 1]
        for name in cut.tensors:
            env[name] = graph.placeholder(name)
        for name in cut.consts:
            env[name] = traced.values[name].const

    def lookup(a: fx.Node) -> Any:
        if a.name not in env:
            src = nodes[a.name]
            if src.op != "get_attr":
                raise TraceError(f"value {a.name} is needed in blocks [{start}, {end}) but not available there")
            env[a.name] = graph.node_copy(src, lookup)
        return env[a.name]

    for i in range(start, end):
        for name in traced.blocks[i].nodes:
            env[name] = graph.node_copy(nodes[name], lookup)
    if end == n:
        out = next(node for node in gm.graph.nodes if node.op == "output")
        result = fx.node.map_arg(out.args[0], lookup)
        codegen = gm.graph._codegen
        if isinstance(codegen, fx.graph._PyTreeCodeGen) and codegen.pytree_info.out_spec is not None:
            # torch.export flattens outputs; give the last stage the model's own output structure.
            result = pytree.tree_unflatten(list(result), codegen.pytree_info.out_spec)
        graph.output(result)
    else:
        live = traced.cuts[end - 1].tensors
        outs = tuple(lookup(nodes[name]) for name in live)
        graph.output(outs[0] if len(outs) == 1 else outs)
    stage = fx.GraphModule(gm, graph, f"stage_{start}_{end}")
    # Shape reads whose consumers went to other stages are dead here; drop them. fx treats method
    # calls as pure, so keep in-place ones (y.mul_(2), masked_fill_) whose result goes unused.
    stage.graph.eliminate_dead_code(is_impure_node=_impure)
    stage.graph.lint()
    stage.recompile()
    return stage
