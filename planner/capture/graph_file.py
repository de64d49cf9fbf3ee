"""A torch.export graph written to bytes and rebuilt on another copy of the model.

``planner run`` traces the model in the launcher (its checks before any rank starts), and every rank
traced it again: for a transformers model, a torch.export of one to two seconds per process, the
most of a small run's start. The launcher now writes its graph (``dump_graph``) and each rank rebuilds
it on its own copy of the model (``load_graph``), then groups, records and fingerprints it as a fresh
trace, so a graph that came back different is refused as a model that changed would be.

What is written: every node (name, kind, target, arguments), each node's module stack (what blocks
are grouped by), the graph's input and output structures (pytree specs), the tensors the graph reads
that the model does not hold (torch.export's lifted constants), which buffers stay out of the
state dict, and the experts modules' calls where expert parallelism recorded them
(``planner.capture.expert_calls``). The weights are not written: the rebuilt graph reads the
rank's model by name. Neither ``torch.export.save`` (its save and load took as long as exporting again, for a tiny Llama here) nor
pickling the module (it re-traces the generated code and drops the nodes' metadata) does this.

The one module torch.export adds, its input guards (``_guards_fn``, no users), is rebuilt as a module
that checks nothing: the launcher's trace already ran with these inputs. A graph holding anything
else this format does not cover (a higher-order operator's subgraph, a value pickle refuses) raises
``GraphFileError`` at ``dump_graph``; the caller then lets the ranks export as before.
"""

from __future__ import annotations

import operator
import pickle
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from planner.capture.expert_calls import META_KEY, calls_of
from planner.torch_compat import exported_pytree_info, operator_name, with_pytree_codegen

FORMAT = 1
"""The layout of the bytes; a reader refuses any other."""

GUARDS = "_guards_fn"
"""The input-guard module torch.export's modules call first (no users)."""


class GraphFileError(Exception):
    """The graph cannot be written in this format, or the bytes cannot be rebuilt into a graph."""


@dataclass(frozen=True)
class _Node:
    """A reference to an earlier node, by name."""

    name: str


@dataclass(frozen=True)
class _Op:
    """An operator overload, by namespace and ``packet.overload`` (``aten``, ``add.Tensor``)."""

    namespace: str
    name: str


class GuardsFn(nn.Module):
    """Stands for torch.export's input guards (``torch.export``'s own ``GuardsFn``) in a rebuilt graph:
    the inputs were checked when the launcher traced. Its class name is torch's, which the trace's
    fingerprint hashes for every module the graph calls."""

    def forward(self, *args: Any, **kwargs: Any) -> None:
        return None


def _encode(value: Any) -> Any:
    """A node argument with its nodes and operators as references (``_decode`` undoes it)."""
    if isinstance(value, fx.Node):
        return _Node(value.name)
    try:
        named = operator_name(value)
    except TypeError as e:
        raise GraphFileError(f"the graph calls {e}") from None
    if named is not None:
        return _Op(*named)
    if isinstance(value, tuple):
        return tuple(_encode(v) for v in value)
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(_encode(value.start), _encode(value.stop), _encode(value.step))
    return value


def _decode(value: Any, nodes: dict[str, fx.Node]) -> Any:
    if isinstance(value, _Node):
        return nodes[value.name]
    if isinstance(value, _Op):
        packet, _, overload = value.name.partition(".")
        return getattr(getattr(getattr(torch.ops, value.namespace), packet), overload)
    if isinstance(value, tuple):
        return tuple(_decode(v, nodes) for v in value)
    if isinstance(value, list):
        return [_decode(v, nodes) for v in value]
    if isinstance(value, dict):
        return {k: _decode(v, nodes) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(_decode(value.start, nodes), _decode(value.stop, nodes), _decode(value.step, nodes))
    return value


def _module_stack(node: fx.Node) -> dict[str, tuple[str, str]] | None:
    """The node's module stack with each module's class as its name (a class of a model file loaded
    from a path may not be importable by name in another process; the name is all that is read)."""
    stack = node.meta.get("nn_module_stack")
    if stack is None:
        return None
    return {
        key: (fqn, kind if isinstance(kind, str) else f"{kind.__module__}.{kind.__qualname__}")
        for key, (fqn, kind) in stack.items()
    }


def _reader(model: nn.Module) -> Callable[[str], Any]:
    def read(target: str) -> Any:
        return operator.attrgetter(target)(model)

    return read


def _full(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _tree(gm: fx.GraphModule) -> list[tuple[str, list[str], list[tuple[str, bool]]]]:
    """Every module of ``gm`` (its root first), in ``named_modules`` order, with its own parameters and
    buffers in order (and whether each buffer is in the state dict): what the rebuilt module registers,
    so that its parameters, buffers and state dict list the same names in the same order.

    Raises:
        GraphFileError: a module other than a plain container or the input guards (a subgraph's).
    """
    kept = set(gm.state_dict(keep_vars=True))
    tree = []
    for path, module in gm.named_modules(remove_duplicate=False):
        if path and type(module) is not nn.Module and path != GUARDS:
            raise GraphFileError(f"the graph holds the module {path} ({type(module).__name__})")
        params = [name for name, _ in module.named_parameters(recurse=False, remove_duplicate=False)]
        buffers = [
            (name, _full(path, name) in kept) for name, _ in module.named_buffers(recurse=False, remove_duplicate=False)
        ]
        tree.append((path, params, buffers))
    return tree


def dump_graph(gm: fx.GraphModule, model: nn.Module) -> bytes:
    """``gm`` (a torch.export graph module of ``model``, or of a copy of it) as bytes for ``load_graph``.

    Args:
        gm: the graph module.
        model: the model the rebuilt graph will read its weights from by name (the same structure).

    Returns:
        The bytes.

    Raises:
        GraphFileError: the graph holds what this format does not cover (named).
    """
    read = _reader(model)
    tree = _tree(gm)
    held = {_full(path, name) for path, params, buffers in tree for name in [*params, *(b for b, _ in buffers)]}
    nodes = []
    constants: dict[str, torch.Tensor] = {}
    for node in gm.graph.nodes:
        target: Any = node.target
        if node.op == "call_function":
            target = _encode(node.target)
        elif node.op == "call_module" and node.target != GUARDS:
            raise GraphFileError(f"the graph calls the module {node.target}")
        elif node.op == "get_attr" and node.target not in held:
            raise GraphFileError(f"the graph reads {node.target}, which is no parameter or buffer of it")
        nodes.append((node.name, node.op, target, _encode(node.args), _encode(node.kwargs), _module_stack(node)))
    for name in sorted(held):
        try:
            read(name)
        except AttributeError:  # torch.export's lifted constants: tensors of the graph, not of the model
            constants[name] = operator.attrgetter(name)(gm).detach().clone()
    record = {
        "format": FORMAT,
        "class_name": type(model).__name__,
        "nodes": nodes,
        "tree": tree,
        "pytree": exported_pytree_info(gm),
        "constants": constants,
        "experts": calls_of(gm),  # the experts modules' calls, where expert parallelism recorded them
    }
    try:
        return pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # any value pickle refuses: the ranks trace for themselves
        raise GraphFileError(f"a value of the graph cannot be written ({type(e).__name__}: {e})") from e


def _rebuilt_tree(gm: fx.GraphModule, record: dict[str, Any], model: nn.Module) -> None:
    """Register on ``gm`` the modules, parameters and buffers ``_tree`` recorded, in its order, each
    tensor the model's own by name (a lifted constant: the one written)."""
    read, constants = _reader(model), record["constants"]
    for path, params, buffers in record["tree"]:
        module: nn.Module = gm  # the root's own tensors (BART's final_logits_bias)
        if path:
            owner, _, leaf = path.rpartition(".")
            module = GuardsFn() if path == GUARDS else nn.Module()
            gm.get_submodule(owner).add_module(leaf, module)
        for name in params:
            module.register_parameter(name, read(_full(path, name)))
        for name, persistent in buffers:
            full = _full(path, name)
            module.register_buffer(name, constants[full] if full in constants else read(full), persistent=persistent)


def load_graph(data: bytes, model: nn.Module) -> fx.GraphModule:
    """The graph ``dump_graph`` wrote, rebuilt to read ``model``'s weights and buffers by name.

    Args:
        data: ``dump_graph``'s bytes.
        model: a model of the structure the graph was traced from (its tensors are shared, not copied).

    Returns:
        The graph module: the same nodes, names, module stacks, input and output structures, and
        modules, parameters and buffers in the same order.

    Raises:
        GraphFileError: bytes of another format, or a graph that does not fit the model.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # pytree's LeafSpec, read back from the specs
            record = pickle.loads(data)  # noqa: S301 - bytes this run's launcher wrote for its own ranks
    except Exception as e:
        raise GraphFileError(f"the graph cannot be read ({type(e).__name__}: {e})") from e
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise GraphFileError("the graph was written in another format")
    graph = fx.Graph()
    made: dict[str, fx.Node] = {}
    # an empty graph first: fx would register the attributes in the order the graph reads them
    gm = fx.GraphModule(nn.Module(), fx.Graph(), record["class_name"])
    try:
        _rebuilt_tree(gm, record, model)
        for name, op, target, args, kwargs, stack in record["nodes"]:
            if op == "call_function":
                target = _decode(target, made)
            node = graph.create_node(op, target, _decode(args, made), _decode(kwargs, made), name=name)
            if node.name != name:
                raise GraphFileError(f"node {name} came back as {node.name}")
            if stack is not None:
                node.meta["nn_module_stack"] = stack
            made[name] = node
    except (AttributeError, KeyError, TypeError) as e:
        raise GraphFileError(f"the graph does not fit the model ({type(e).__name__}: {e})") from e
    with_pytree_codegen(graph, record["pytree"])
    gm.graph = graph  # generates its code
    if record.get("experts"):
        gm.meta[META_KEY] = dict(record["experts"])
    return gm


@dataclass
class RankGraphs:
    """The torch.export graphs a launcher made, as its ranks rebuild them instead of exporting again:
    the model's (``traced``) and, under tensor parallelism, the model's at one tp rank's sizes
    (``shard_sized``, ``planner.capture.tp_graph``).

    The launcher's object ``collects`` (each graph is written as its checks trace it); a rank's is read
    from the launcher's file and only read. A graph missing, or one that cannot be rebuilt, is traced.
    """

    traced: bytes | None = None
    shard_sized: bytes | None = None
    collects: bool = False

    def to_bytes(self) -> bytes:
        """Both graphs in one file's bytes (``from_bytes``)."""
        return pickle.dumps((FORMAT, self.traced, self.shard_sized), protocol=pickle.HIGHEST_PROTOCOL)

    @classmethod
    def from_bytes(cls, data: bytes) -> RankGraphs | None:
        """``to_bytes``'s graphs, to read; None for bytes of another format or that do not unpickle."""
        try:
            version, traced, sized = pickle.loads(data)  # noqa: S301 - the file this run's launcher wrote
        except Exception:  # noqa: BLE001 - unreadable: the rank traces for itself
            return None
        return cls(traced, sized) if version == FORMAT else None

    def written(self, folder: Path) -> str:
        """The graphs written to a file in ``folder`` for the ranks (``from_bytes``): its path, or ""
        where there is no graph to hand over."""
        if self.traced is None and self.shard_sized is None:
            return ""
        path = folder / "graphs.bin"
        path.write_bytes(self.to_bytes())
        return str(path)

    def keep_shard_sized(self, gm: fx.GraphModule, model: nn.Module) -> None:
        """Write the graph at one tp rank's sizes, where this object collects (else nothing)."""
        if self.collects:
            try:
                self.shard_sized = dump_graph(gm, model)
            except GraphFileError:
                self.shard_sized = None


__all__ = ["GraphFileError", "RankGraphs", "dump_graph", "load_graph"]
