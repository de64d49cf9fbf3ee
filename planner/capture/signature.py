"""What makes two blocks of a graph the same computation, and replaying one block's values for its twin.

A transformer's layers are one block repeated: the same operations on inputs of the same shapes,
whose parameters have the same shapes. On the meta device (where planning runs the model: shapes,
no data) such a block produces the same shapes every time, so a run over the whole graph needs to
execute each distinct block once and can hand every twin fresh tensors of the recorded shapes
(``spec`` records a value, ``rebuild`` makes a fresh one). Two blocks are twins when their ``signature`` is equal: each node's operation
(function, or the shapes of the module or attribute it uses), its arguments as positions among the
block's nodes, positions among the values it reads from outside (each with that value's metadata)
or constants. Names are left out, so ``layers.0`` and ``layers.41`` are twins.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from planner.capture.blocks import get_attr

_META = torch.device("meta")
_CONSTANTS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.Size)


def show(value: Any) -> str:
    """A tensor, module or constant as a signature shows it: shapes, dtypes and flags, never names."""
    if isinstance(value, torch.Tensor):
        return f"T{tuple(value.shape)}{value.dtype}{value.requires_grad}"
    if isinstance(value, nn.Module):
        state = [(tuple(t.shape), t.dtype, t.requires_grad) for t in (*value.parameters(), *value.buffers())]
        return f"M{value!r}{state}"
    return repr(value)


def node_target(node: fx.Node, root: nn.Module) -> str:
    """A node's operation: its function's qualified name, or what its attribute or module holds."""
    if node.op == "placeholder":
        return ""  # its name is the value it receives: only its position counts
    if node.op == "get_attr":
        return show(get_attr(root, str(node.target)))
    if node.op == "call_module":
        return show(root.get_submodule(str(node.target)))
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__qualname__", repr(node.target))
    return f"{getattr(node.target, '__module__', '')}.{target}"


def spec(value: Any) -> Any:
    """What a value replays as: a meta tensor's metadata, a constant, a tuple or list of those; None
    when it cannot be replayed (a real tensor, an object)."""
    if isinstance(value, torch.Tensor):
        if value.device != _META or type(value) not in (torch.Tensor, nn.Parameter):
            return None
        return ("T", tuple(value.shape), value.stride(), value.storage_offset(), value.dtype, value.requires_grad)
    if isinstance(value, _CONSTANTS):
        return ("C", value)
    if isinstance(value, (tuple, list)):
        parts = [spec(v) for v in value]
        return None if any(p is None for p in parts) else ("L", type(value), tuple(parts))
    return None


def rebuild(recorded: Any) -> Any:
    """A fresh value for a ``spec``: meta tensors of the recorded metadata, the same constants."""
    kind = recorded[0]
    if kind == "C":
        return recorded[1]
    if kind == "L":
        return recorded[1](rebuild(p) for p in recorded[2])
    _, shape, stride, offset, dtype, grad = recorded
    if offset == 0:
        out = torch.empty_strided(shape, stride, dtype=dtype, device=_META)
    else:  # a view into a larger storage (a chunk of a fused projection): the same offset
        extent = 1 + offset + sum((n - 1) * s for n, s in zip(shape, stride) if n > 0)
        out = torch.empty(extent, dtype=dtype, device=_META).as_strided(shape, stride, offset)
    return out.requires_grad_(grad) if grad and out.is_floating_point() else out


def structure(nodes: Sequence[fx.Node], root: nn.Module) -> tuple[tuple[Any, ...], tuple[fx.Node, ...]]:
    """The part of a block's signature that the graph alone fixes: each node's operation and
    arguments, and the nodes outside the block it reads, in the order it first reads them.

    Args:
        nodes: the block's nodes, in graph order.
        root: the module whose attributes and submodules the nodes name.

    Returns:
        (the nodes' parts, the outside nodes).
    """
    inside = {n: i for i, n in enumerate(nodes)}
    outside: dict[fx.Node, int] = {}

    def arg(a: fx.Node) -> str:
        if a in inside:
            return f"%{inside[a]}"
        if a not in outside:
            outside[a] = len(outside)
        return f"%in{outside[a]}"

    parts = tuple((n.op, node_target(n, root), repr(fx.node.map_arg((n.args, n.kwargs), arg))) for n in nodes)
    return parts, tuple(outside)


# Each graph's block structures, kept across its runs: planning runs one graph at several
# microbatch sizes (and for the tensor-parallel shares), its blocks' structure the same each time.
_STRUCTURES: weakref.WeakKeyDictionary[nn.Module, dict[tuple[str, ...], Any]] = weakref.WeakKeyDictionary()


def block_structure(gm: nn.Module, names: tuple[str, ...], by_name: dict[str, fx.Node]) -> Any:
    """``structure`` of the block of ``gm`` made of the nodes ``names``, computed once per graph.

    Args:
        gm: the traced graph module (its attributes and submodules are what the nodes name).
        names: the block's node names, in graph order.
        by_name: node name -> node of ``gm``.

    Returns:
        The block's ``structure``.
    """
    known = _STRUCTURES.setdefault(gm, {})
    if names not in known:
        known[names] = structure([by_name[m] for m in names], gm)
    return known[names]


def leaves_block(names: Sequence[str], by_name: dict[str, fx.Node]) -> list[bool]:
    """Whether each of a block's values is read outside it (by a later block or the output): only
    those are made again when a twin is replayed; its other values are never read.

    Args:
        names: the block's node names, in graph order.
        by_name: node name -> node of the graph.

    Returns:
        One flag per node of ``names``.
    """
    inside = set(names)
    return [any(u.name not in inside for u in by_name[name].users) for name in names]


def signature(shape: tuple[tuple[Any, ...], tuple[fx.Node, ...]], root: nn.Module, value_of: Any) -> Any:
    """A block's signature (see the module docstring), or None when a value it reads from outside
    cannot be described (then it is run, never replayed).

    Args:
        shape: the block's ``structure``.
        root: the module whose attributes the outside get_attr nodes name.
        value_of: node -> the value it holds now, for the outside nodes that are no attributes.

    Returns:
        A hashable signature, or None.
    """
    parts, outside = shape
    described = tuple(node_target(a, root) if a.op == "get_attr" else spec(value_of(a)) for a in outside)
    return None if any(d is None for d in described) else (parts, described)


__all__ = ["block_structure", "node_target", "rebuild", "show", "signature", "spec", "structure"]
