"""The trace types: blocks, cuts, and the two kinds of traced model.

A *block* is the unit the planner places on a stage: a run of graph nodes that belong to one module
(a child of a ``ModuleList``/``Sequential``/``ModuleDict``, or another top-level child such as the
embedding or the head). A *cut* after block k is the boundary a stage may end at.

Two kinds of trace, dispatched by type:

- ``GraphTrace``: torch.fx or torch.export captured a graph; stages are cut out of it
  (``planner.capture.stage``), and the networkx ``block_graph`` says which values flow between
  which blocks (cut liveness is read off it).
- ``ModuleTrace``: no graph, only module boundaries observed with hooks; good for costs and
  tables, not for cutting stages.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch
import torch.fx as fx
from torch import nn

from planner.torch_compat import pytree

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


@dataclass(frozen=True)
class ValueInfo:
    """What a graph node (or a block, in a module trace) produced on the example microbatch.

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


def is_layer(container: nn.Module, child: nn.Module) -> bool:
    """A container child is a repeated *layer* when its type is the most common among its siblings.

    In the Pipe tutorial's ``Sequential(Encoder, TransformerEncoderLayer x N, Decoder)`` the encoder
    layers are layers and the embedding/decoder wrappers are not, which is what the uniform-layer
    baseline (torchtitan, Megatron) counts.

    Args:
        container: a ``ModuleList``/``Sequential``/``ModuleDict``.
        child: one of its children.

    Returns:
        Whether ``child`` is one of the repeated layers.
    """
    return type(child) in layer_types(container)


def layer_types(container: nn.Module) -> frozenset[type]:
    """The child types that are repeated layers of ``container`` (``is_layer``): the most common ones,
    if they occur at least twice. A caller asking for every child counts the siblings once this way.

    Args:
        container: a ``ModuleList``/``Sequential``/``ModuleDict``.
    """
    kinds = Counter(type(c) for c in container.children())
    top = max(kinds.values(), default=0)
    return frozenset(k for k, v in kinds.items() if v == top) if top >= 2 else frozenset()


@dataclass(frozen=True)
class TiedParameter:
    """One parameter that several blocks read.

    Attributes:
        param: the parameter (in the traced model).
        names: every name the model gives it (``named_parameters(remove_duplicate=False)``), the
            owning module's first.
        blocks: indices of the blocks that read it, ascending; the first owns it.
    """

    param: nn.Parameter
    names: tuple[str, ...]
    blocks: tuple[int, ...]


@dataclass
class TracedModel:
    """What both kinds of trace share: the private model copy, its blocks and their cuts.

    Attributes:
        model: the private copy of the model that was traced (never the caller's object).
        method: "fx", "export" or "modules".
        failures: (method, reason) for every tracer that was tried and failed, in order.
        blocks: blocks in execution order.
        cuts: ``cuts[k]`` is the boundary after ``blocks[k]`` (len(blocks) - 1 of them).
        values: what each node (graph) or block (modules) produced on the example microbatch.
    """

    model: nn.Module
    method: str
    failures: list[tuple[str, str]]
    blocks: list[Block]
    cuts: list[Cut]
    values: dict[str, ValueInfo] = field(default_factory=dict)

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
            own = [p for p in self.block_parameters(k) if id(p) not in claimed]
            claimed.update(id(p) for p in own)
            owned.append(own)
        return owned

    def tied_parameters(self) -> list[TiedParameter]:
        """The parameters more than one block reads (tied input embedding and output head, say).

        Returns:
            One entry per such parameter, ordered by the first block that reads it (every process
            that traces the same model gets the same list, so ranks can agree on groups by it).
        """
        readers: dict[int, list[int]] = {}
        found: dict[int, nn.Parameter] = {}
        for k in range(len(self.blocks)):
            for p in self.block_parameters(k):
                readers.setdefault(id(p), []).append(k)
                found[id(p)] = p
        aliases: dict[int, list[str]] = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        ties = []
        for pid, blocks in readers.items():
            if len(blocks) > 1:
                p = found[pid]
                names = aliases.get(pid) or [f"<parameter of {self.blocks[blocks[0]].name}>"]
                ties.append(TiedParameter(p, tuple(names), tuple(blocks)))
        return sorted(ties, key=lambda t: (t.blocks, t.names))

    def block_parameters(self, k: int) -> list[nn.Parameter]:
        """Parameters block k reads (each once)."""
        raise NotImplementedError

    @property
    def output_bytes(self) -> int:
        """Bytes of the tensors the model returns for the example microbatch (0 if unknown)."""
        raise NotImplementedError

    def _hash_structure(self, h: Any) -> None:
        """Add what only this kind of trace knows to the fingerprint."""

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
        self._hash_structure(h)
        for name, p in self.model.named_parameters():
            # every floating dtype hashes as fp32: an estimate for a GPU traces the model cast to the
            # planning dtype (bf16), and its plan must match the fp32 model `planner run` builds
            dtype = torch.float32 if p.is_floating_point() else p.dtype
            h.update(f"{name}{tuple(p.shape)}{dtype};".encode())
        return h.hexdigest()[:16]


@dataclass(kw_only=True)
class GraphTrace(TracedModel):
    """A model captured as a graph (fx or export), split into blocks with their cut points.

    Attributes:
        gm: the traced graph module (owns the private model's modules and parameters).
        block_graph: networkx DAG of blocks; edge (i, j) carries in ``values`` the names of the
            nodes block i produces and block j reads. A value is live across cut k when it is on
            an edge (i, j) with i <= k < j (``live_across``).
        block_of: graph node name -> block index (placeholders: 0, the output: the last block).
        example_output: what the graph returned when its values were recorded on the meta device
            (meta tensors), None otherwise: the forward check of a meta trace reads it rather than
            running the graph a second time (0.9 s at 1,000 layers).
    """

    gm: fx.GraphModule
    block_graph: nx.DiGraph
    block_of: dict[str, int]
    example_output: Any = field(default=None, repr=False, compare=False)
    _nodes: tuple[fx.Graph, int, dict[str, fx.Node]] | None = field(default=None, init=False, repr=False, compare=False)

    def nodes_by_name(self) -> dict[str, fx.Node]:
        """Graph node name -> node, built once (again only if ``gm``'s graph was replaced or changed
        size): stages and parameter look-ups read single nodes, block by block."""
        graph = self.gm.graph
        if self._nodes is None or self._nodes[0] is not graph or self._nodes[1] != len(graph.nodes):
            self._nodes = (graph, len(graph.nodes), {n.name: n for n in graph.nodes})
        return self._nodes[2]

    def live_across(self, k: int) -> set[str]:
        """Names of the values produced at or before block k and read after it."""
        return {v for i, j, vals in self.block_graph.edges(data="values") if i <= k < j for v in vals}

    def block_parameters(self, k: int) -> list[nn.Parameter]:
        """Parameters read by block k: call_module targets' and get_attr parameters."""
        gm = self.gm
        nodes = self.nodes_by_name()
        found: dict[int, nn.Parameter] = {}
        for name in self.blocks[k].nodes:
            node = nodes[name]
            if node.op == "call_module":
                for p in gm.get_submodule(str(node.target)).parameters():
                    found.setdefault(id(p), p)
            for arg in node.all_input_nodes:
                if arg.op == "get_attr":
                    value = get_attr(gm, str(arg.target))
                    if isinstance(value, nn.Parameter):
                        found.setdefault(id(value), value)
        return list(found.values())

    @property
    def output_bytes(self) -> int:
        """Bytes of the tensors the model returns for the example microbatch."""
        out = next(node for node in self.gm.graph.nodes if node.op == "output")
        names = {a.name for a in pytree.tree_leaves(out.args) if isinstance(a, fx.Node)}
        return sum(self.values[n].nbytes for n in names if n in self.values and self.values[n].kind == "tensor")

    def _hash_structure(self, h: Any) -> None:
        for node in self.gm.graph.nodes:
            if node.target is _CONTIGUOUS:
                # torch.export records .contiguous() only where the tensor was not contiguous, which
                # depends on the device's kernels: after CPU or GPU attention, whose output is laid
                # out (batch, seq, heads, dim), `o.transpose(1, 2).contiguous()` is a no-op, on meta
                # a copy. The same model traced on meta for an estimate must give the same hash.
                continue
            h.update(f"{node.name}:{node.op}:{target_name(node.target)};".encode())
            if node.op == "call_module":  # the module's class: ReLU -> GELU keeps the node's name
                h.update(type(self.gm.get_submodule(str(node.target))).__qualname__.encode())


@dataclass(frozen=True)
class BlockCall:
    """How a module-boundary block was called: its arguments with the one tensor that flows from
    block to block marked, everything else constants.

    Attributes:
        args: positional arguments; ``CHAINED`` at the slot of the flowing tensor.
        kwargs: keyword arguments (constants).
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]


CHAINED = "<the tensor flowing from block to block>"


@dataclass
class ModuleTrace(TracedModel):
    """A model observed at its module boundaries (no graph): blocks are modules, by FQN.

    Attributes:
        calls: per block, how to call it in a chain (empty when the model is no chain).
        first_input: which of the model's tensor inputs the first block takes.
        chain_reason: why the blocks cannot be run as a chain ("" when they can): a block that
            takes another tensor besides the flowing one, work done between blocks, ...
    """

    calls: list[BlockCall] = field(default_factory=list)
    first_input: int = 0
    chain_reason: str = ""

    def block_parameters(self, k: int) -> list[nn.Parameter]:
        """The parameters of block k's module."""
        return list(self.model.get_submodule(self.blocks[k].name).parameters())

    @property
    def output_bytes(self) -> int:
        """Bytes of the last block's first output tensor (0 if it returned none)."""
        last = self.values.get(self.blocks[-1].name)
        return last.nbytes if last and last.kind == "tensor" else 0


def get_attr(root: nn.Module, target: str) -> Any:
    """The attribute at dotted path ``target`` below ``root`` (a get_attr node's value)."""
    value: Any = root
    for part in target.split("."):
        value = getattr(value, part)
    return value


def target_name(target: Any) -> str:
    """A stable text for a node target (no memory addresses)."""
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None) or ""
    return f"{module}.{getattr(target, '__qualname__', getattr(target, '__name__', type(target).__name__))}"


def describe(value: Any) -> ValueInfo:
    """What kind of value a node produced: a tensor (with its bytes), a bakeable constant, or opaque."""
    if isinstance(value, torch.Tensor):
        return ValueInfo("tensor", value.numel() * value.element_size())
    if isinstance(value, _CONST_TYPES):
        return ValueInfo("const", 0, value)
    if isinstance(value, (tuple, list)) and all(isinstance(v, _CONST_TYPES) for v in value):
        return ValueInfo("const", 0, value)
    return ValueInfo("opaque")


_CONTIGUOUS = torch.ops.aten.contiguous.default

# Python values that may cross a cut by being baked into the later stage as constants.
_CONST_TYPES = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.Size)


def by_block(blocks: list[str], named: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The entries of ``named`` (keyed by module name) each block holds: a block named "layers.3"
    holds "layers.3" and "layers.3.*", found by each name's prefixes, longest first (one pass, not
    every block against every name). Names no block holds are left out.

    Args:
        blocks: the blocks' names (a module path each; "" is no block).
        named: module name -> anything (a matched layer, an experts module).

    Returns:
        Block name -> its entries of ``named``, in ``named``'s order.
    """
    names = {b for b in blocks if b}
    out: dict[str, dict[str, Any]] = {}
    for name, value in named.items():
        parts = name.split(".")
        owner = next((p for i in range(len(parts), 0, -1) if (p := ".".join(parts[:i])) in names), None)
        if owner is not None:
            out.setdefault(owner, {})[name] = value
    return out
