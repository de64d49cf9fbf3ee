"""Context parallelism: what one of ``cp`` ranks that split every sequence costs (``at_context``).

Each rank holds the stage's weights whole and runs 1 / cp of every sequence: everything that acts
token by token costs 1 / cp of the whole (``planner.core.levers.microbatch.blocks_at`` at the rank's
share of a microbatch, ``Layout.rank_share``), and so does attention with the causal load balanced
over the ranks (each rank computes the queries of two mirrored blocks, ``run.context_shard.Mirrored``,
as Megatron-Core and torch's ``context_parallel`` balance it: a rank's queries against every
position's keys are then 1 / cp of the whole sequence's attention, causal or not). What context
parallelism adds, charged here per attention block, is the exchange, as ``planner.run.context_shard``
runs it, by either method (``Plan.cp_attention``):

* **all-gather** (the Llama 3 run's): forward all-gathers every position's keys and values over the
  group (``kv_bytes``, this rank's heads under tensor parallelism) before the attention that reads
  them, which it does not overlap; backward reduce-scatters their gradients; the gathered keys and
  values stay saved for backward, ``cp - 1`` times the rank's own;
* **ring** (``planner.run.ring_attention``): ``cp - 1`` steps each send the chunk held to the next
  rank while attention runs on it, so a step costs only what its send takes beyond the step's
  attention (the block's attention kernels' seconds, ``BlockCost.attention_s``, spread evenly over
  the ``cp`` steps: the causal balance evens them out over a rank's two blocks; 0 where the costs
  do not know them, as a measured profile: then nothing hides). Backward sends each chunk on again
  with its gradient beside it, ``cp - 1`` steps of two chunks hidden behind the backward's attention,
  and the gradients' last step home unhidden. Only the rank's own chunk stays saved.

Either way, under a mask (causal) an all-to-all of the queries to the ranks computing their blocks
and one of the output back (``q_bytes``: only masked attention's), their gradients the other way in
backward; a recomputation runs the forward's exchange again.

Pure module: never imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.core.levers.data_parallel import group_link, layout_links
from planner.core.levers.experts import all_to_all_s
from planner.core.levers.links import Links, NodeLinks, default_link
from planner.core.levers.tensor_parallel import allgather_s, group_local, ring_s
from planner.schema.costs import BlockCost, LinkCost


def context_link(link: Links, pp: int, replicas: int, tp: int, cp: int, pp_outer: bool = False) -> LinkCost:
    """The link a context-parallel group crosses: ``cp`` consecutive replicas of one pipeline and
    tensor-parallel position (``pp x tp`` global ranks apart, ``planner.run.mesh``; ``tp`` apart where
    the ranks are pipeline-outermost: expert-parallel layouts).

    Args:
        link: the cluster's links.
        pp: pipeline ranks of a replica.
        replicas: the mesh's replicas (data-parallel x context-parallel).
        tp: tensor-parallel ranks of a pipeline rank.
        cp: the group's ranks.
        pp_outer: the ranks laid out pipeline-outermost (``Layout.pp_outer``).

    Returns:
        The group's link (for NCCL, with its ranks per node).
    """
    if not isinstance(link, NodeLinks):
        return default_link(link)
    placed = layout_links(link, pp, replicas, tp, pp_outer)
    assert isinstance(placed, NodeLinks)
    return group_link(placed, 0, range(cp))


def at_context(blocks: Sequence[BlockCost], cp: int, tp: int, link: LinkCost, ring: bool = False) -> list[BlockCost]:
    """The blocks as one of ``cp`` context-parallel ranks runs them, their costs already at its share
    of the microbatch (see the module docstring).

    Args:
        blocks: per-block costs at the rank's share (``blocks_at``), one tensor-parallel rank's
            (``kv_bytes`` still every head's).
        cp: context-parallel ranks.
        tp: tensor-parallel ranks (each gathers its own heads' keys and values).
        link: the group's link (``context_link``).
        ring: by ring attention instead of the all-gather.

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
        fwd, bwd, held = _ring(b, own, cp, tp, link) if ring else _gathered(own, cp, link)
        # the mirrored blocks: queries there and output back, their gradients the other way
        swaps = 2 * all_to_all_s(b.q_bytes / tp, cp, group_local(link, cp), link)
        fwd, bwd = fwd + swaps, bwd + swaps
        out.append(
            b.model_copy(
                update={
                    "fwd_s": b.fwd_s + fwd,
                    "bwd_s": b.bwd_s + bwd,
                    "bwd_input_s": None if b.bwd_input_s is None else b.bwd_input_s + bwd,
                    "recompute_s": None if b.recompute_s is None else b.recompute_s + fwd,
                    "activation_bytes": b.activation_bytes + held,
                    "selective_bytes": None if b.selective_bytes is None else b.selective_bytes + held,
                }
            )
        )
    return out


def _gathered(own: float, cp: int, link: LinkCost) -> tuple[float, float, int]:
    """The all-gather's forward and backward seconds and the bytes it keeps for backward."""
    return allgather_s(own * cp, cp, link), ring_s(own * cp, 1, cp, link), round(own * (cp - 1))


def _ring(b: BlockCost, own: float, cp: int, tp: int, link: LinkCost) -> tuple[float, float, int]:
    """Ring attention's forward and backward seconds beyond the attention they hide behind, and the
    bytes it keeps for backward (none beyond the rank's own chunk)."""
    send = link.send_s(round(own))  # one chunk to the next rank: every rank sends at once, each on its own link
    fwd_step, bwd_step = (t / (tp * cp) for t in b.attention_s)  # one step's attention, this rank's heads
    fwd = (cp - 1) * max(send - fwd_step, 0.0)
    bwd = (cp - 1) * max(2 * send - bwd_step, 0.0) + send  # the chunk and its gradient; the last step home
    return fwd, bwd, 0


__all__ = ["at_context", "context_link"]
