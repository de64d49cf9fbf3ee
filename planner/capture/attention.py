"""Scaled-dot-product attention as traced graphs call it: the two callables and their parameters."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

SDPA_CALLS: tuple[Any, ...] = (F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default)
"""What a graph's attention node calls: fx graphs the function, torch.export graphs the aten operator
(the same parameters). Taken at import, before the roofline swaps the function for its estimate
(``planner.costs.roofline.fused_attention``)."""

SDPA_SIGNATURE = inspect.Signature(
    [
        inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default)
        for name, default in (
            ("query", inspect.Parameter.empty),
            ("key", inspect.Parameter.empty),
            ("value", inspect.Parameter.empty),
            ("attn_mask", None),
            ("dropout_p", 0.0),
            ("is_causal", False),
            ("scale", None),
            ("enable_gqa", False),
        )
    ]
)


def sdpa_arguments(args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A scaled-dot-product attention call's arguments by name, defaults filled in.

    Args:
        args: its positional arguments (tensors, or a graph node's arguments).
        kwargs: its keyword arguments.

    Returns:
        query, key, value, attn_mask, dropout_p, is_causal, scale and enable_gqa.

    Raises:
        TypeError: arguments no such call takes.
    """
    bound = SDPA_SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def attention_calls(nodes: Iterable[Any]) -> Iterator[dict[str, Any]]:
    """The arguments, by name (``sdpa_arguments``), of every scaled-dot-product attention call among a
    graph's ``nodes`` (None entries skipped).

    Args:
        nodes: fx nodes, in any order.

    Yields:
        Each call's query, key, value, attn_mask, dropout_p, is_causal, scale and enable_gqa.
    """
    for node in nodes:
        if node is not None and node.op == "call_function" and node.target in SDPA_CALLS:
            yield sdpa_arguments(node.args, dict(node.kwargs))


def attention_kept_whole(gm: torch.fx.GraphModule) -> list[tuple[str, str]]:
    """The modules a graph calls whole (``call_module`` nodes: torch.fx keeps ``torch.nn`` modules as
    leaves) that run ``nn.MultiheadAttention`` inside, where no ``attention_calls`` entry sees it
    (``nn.TransformerEncoderLayer``, say); a torch.export graph inlines them and has none.

    Args:
        gm: a traced graph module.

    Returns:
        Their targets and class names, in graph order.
    """
    out: list[tuple[str, str]] = []
    for node in gm.graph.nodes:
        if node.op == "call_module":
            module = gm.get_submodule(str(node.target))
            if any(isinstance(m, torch.nn.MultiheadAttention) for m in module.modules()):
                out.append((str(node.target), type(module).__name__))
    return out


__all__ = ["SDPA_CALLS", "SDPA_SIGNATURE", "attention_calls", "attention_kept_whole", "sdpa_arguments"]
