"""Which values of a traced graph sequence parallelism splits by sequence (``sequence_values``).

Under sequence parallelism (Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models", 2022; Megatron-LM's ``--sequence-parallel``) a row-wise layer's output is
reduce-scattered over the tensor-parallel ranks along the sequence (dimension 1 of ``[batch, seq,
features]``) instead of all-reduced, and what the model computes from it before the next
column-wise layer (residual adds, norms) runs on each rank's slice of the sequence: those
activations, saved whole on every rank without it, are split ``tp`` ways. The column-wise layer
all-gathers its input whole again. ``planner.run.tensor_shard`` runs it with DTensors: a row-wise
output is a DTensor sharded on dimension 1, and every operator that reads one gives one
(``Replicated`` wraps the operator's other, plain tensors as replicated DTensors, which is exact: a
plain tensor outside the split layers is the same on every tensor-parallel rank).

``sequence_values`` follows that rule through the graph, so that the planner (its costs) and the
runner (the values crossing a pipeline stage's boundary) agree on which values are sequence shards.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import fx

from planner.capture.blocks import GraphTrace
from planner.capture.contract import SEQUENCE_DIM  # a row-wise output is scattered along it
from planner.capture.tp_plan import COLUMN_STYLES, matched_modules


def layer_styles(gm: fx.GraphModule, tp_plan: Mapping[str, str]) -> dict[str, str]:
    """The graph's call_module targets the plan splits, with their style.

    Args:
        gm: a traced graph whose planned layers are modules (a torch.fx trace, or the shardable
            torch.export graph of ``planner.capture.tp_graph``).
        tp_plan: patterns -> "colwise" | "rowwise" | "colwise_rep".

    Returns:
        Module path -> style.
    """
    return {name: style for name, (style, _, _) in matched_modules(gm, tp_plan).items()}


def sequence_values(traced: GraphTrace, tp_plan: Mapping[str, str]) -> frozenset[str]:
    """The names of the graph's values that are sequence shards under sequence parallelism.

    A row-wise layer's output is one; so is every tensor computed from one (any operator with a
    sequence-shard input) except a column-wise layer's output, which is the layer's own column
    shard of the gathered input (and ``colwise_rep``'s, gathered whole). Non-tensor values (sizes,
    constants) are never shards.

    Args:
        traced: the graph trace (its ``values`` say which nodes made tensors).
        tp_plan: the plan's patterns -> styles.

    Returns:
        Node names (empty: the plan has no row-wise layer in this graph).
    """
    styles = layer_styles(traced.gm, tp_plan)
    found: set[str] = set()
    for node in traced.gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        style = styles.get(str(node.target)) if node.op == "call_module" else None
        if style == "rowwise":
            found.add(node.name)
        elif style in COLUMN_STYLES:
            continue
        elif any(a.name in found for a in node.all_input_nodes):
            info = traced.values.get(node.name)
            if info is not None and info.kind == "tensor":
                found.add(node.name)
    return frozenset(found)


__all__ = ["SEQUENCE_DIM", "layer_styles", "sequence_values"]
