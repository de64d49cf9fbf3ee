"""Context parallelism: what one of ``cp`` ranks that split every sequence costs (``at_context``).

Each rank holds the stage's weights whole and runs 1 / cp of every sequence: everything that acts
token by token costs 1 / cp of the whole (``planner.core.levers.microbatch.blocks_at`` at the rank's
share of a microbatch, ``Layout.rank_share``), and so does attention with the causal load balanced
over the ranks (each rank computes the queries of two mirrored blocks, ``run.context_shard.Mirrored``,
as Megatron-Core and torch's ``context_parallel`` balance it: a rank's queries against every
position's keys are then 1 / cp of the whole sequence's attention, causal or not). What context
parallelism adds, charged here per attention block, is the exchange, as ``planner.run.context_shard``
runs it (the Llama 3 run's all-gather):

* forward: an all-gather of every position's keys and values over the group (``kv_bytes``, this
  rank's heads under tensor parallelism), before the attention that reads them, which it does not
  overlap; under a mask (causal), an all-to-all of the queries to the ranks computing their blocks
  and one of the output back (``q_bytes``: only masked attention's); a recomputation runs them again;
* backward: a reduce-scatter of the keys' and values' gradients back to the ranks that made them, and
  the two all-to-alls of the output's and the queries' gradients, in the input gradient's pass;
* memory: the gathered keys and values stay saved for backward, ``cp - 1`` times the rank's own.

Pure module: never imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.core.levers.data_parallel import group_link, layout_links
from planner.core.levers.experts import all_to_all_s
from planner.core.levers.links import Links, NodeLinks, default_link
from planner.core.levers.tensor_parallel import allgather_s, group_local, ring_s
from planner.schema.costs import BlockCost, LinkCost


def context_link(link: Links, pp: int, replicas: int, tp: int, cp: int) -> LinkCost:
    """The link a context-parallel group crosses: ``cp`` consecutive replicas of one pipeline and
    tensor-parallel position (``pp x tp`` global ranks apart, ``planner.run.mesh``).

    Args:
        link: the cluster's links.
        pp: pipeline ranks of a replica.
        replicas: the mesh's replicas (data-parallel x context-parallel).
        tp: tensor-parallel ranks of a pipeline rank.
        cp: the group's ranks.

    Returns:
        The group's link (for NCCL, with its ranks per node).
    """
    if not isinstance(link, NodeLinks):
        return default_link(link)
    placed = layout_links(link, pp, replicas, tp, False)
    assert isinstance(placed, NodeLinks)
    return group_link(placed, 0, range(cp))


def at_context(blocks: Sequence[BlockCost], cp: int, tp: int, link: LinkCost) -> list[BlockCost]:
    """The blocks as one of ``cp`` context-parallel ranks runs them, their costs already at its share
    of the microbatch (see the module docstring).

    Args:
        blocks: per-block costs at the rank's share (``blocks_at``), one tensor-parallel rank's
            (``kv_bytes`` still every head's).
        cp: context-parallel ranks.
        tp: tensor-parallel ranks (each gathers its own heads' keys and values).
        link: the group's link (``context_link``).

    Returns:
        The blocks with the exchange's time and memory (the same objects with cp 1).
    """
    if cp <= 1:
        return list(blocks)
    out = []
    for b in blocks:
        if b.kv_bytes <= 0 and b.q_bytes <= 0:
            out.append(b)
            continue
        own = b.kv_bytes / tp  # this rank's chunk of its heads' keys and values
        gather = allgather_s(own * cp, cp, link)
        scatter = ring_s(own * cp, 1, cp, link)
        # the mirrored blocks: queries there and output back, their gradients the other way
        swaps = 2 * all_to_all_s(b.q_bytes / tp, cp, group_local(link, cp), link)
        gather, scatter = gather + swaps, scatter + swaps
        held = round(own * (cp - 1))
        out.append(
            b.model_copy(
                update={
                    "fwd_s": b.fwd_s + gather,
                    "bwd_s": b.bwd_s + scatter,
                    "bwd_input_s": None if b.bwd_input_s is None else b.bwd_input_s + scatter,
                    "recompute_s": None if b.recompute_s is None else b.recompute_s + gather,
                    "activation_bytes": b.activation_bytes + held,
                    "selective_bytes": None if b.selective_bytes is None else b.selective_bytes + held,
                }
            )
        )
    return out


__all__ = ["at_context", "context_link"]
