"""HSDP (``dp_mode`` "hsdp", ``Plan.dp_shard`` replicas per shard group): how the replicas split
into shard groups, the links those groups and their replicate groups talk over, and a rank's
traffic with stage units.

Pure module: never imports torch. FSDP runs inside each group of ``dp_shard`` consecutive replicas
(its gathers and reduce-scatters over the group's link, ``(s - 1) / s`` of the bytes), then each rank
all-reduces its ``1 / s`` of the gradients over the ``dp / s`` groups (the replicate group's link),
as FSDP2 does after every reduce-scatter (``planner.core.levers.data_parallel`` charges the rest of
data parallelism, and HSDP's per-unit traffic with it). Under expert parallelism an expert group
lies inside a shard group, and a rank's experts are sharded over the ``s / ep`` replicas of it
holding them, then all-reduced over the groups (``planner.core.levers.experts.by_group``).
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.core.levers.data_parallel import (
    dp_group_links,
    grad_reduce_s,
    group_allreduce_s,
    layout_links,
    rank_groups,
    slowest_link,
)
from planner.core.levers.data_parallel import group_link as replicas_link
from planner.core.levers.links import Links, NodeLinks
from planner.schema.costs import BlockCost, LinkCost
from planner.schema.plan import StagePlan


def hsdp_shard(dp: int, group_ranks: int, node_ranks: int, asked: int | None = None) -> int:
    """The replicas of each HSDP shard group for ``dp`` replicas ``group_ranks`` global ranks apart
    (pipeline x tensor-parallel; tensor-parallel alone where the ranks are pipeline-outermost):
    ``asked`` when given, else the largest divisor of ``dp`` whose
    groups each lie on one node (replica k's ranks are ``k x group_ranks`` on, nodes of
    ``node_ranks``), so the groups' gathers stay inside a node; where no group of two or more does,
    the largest that fits a node's rank count (1 when one replica fills a node).

    Args:
        dp: replicas.
        group_ranks: global ranks from one replica to the next (``pp x tp``, or ``tp``).
        node_ranks: ranks per node.
        asked: the size the user gave (``--dp-shard``), or None.

    Returns:
        The group size; 0 when ``asked`` does not divide ``dp`` (no such layout).
    """
    if asked is not None:
        return asked if dp % asked == 0 else 0
    width = max(1, group_ranks)
    room = max(1, node_ranks // width)
    sizes = [d for d in range(min(dp, room), 0, -1) if dp % d == 0]

    def on_one_node(size: int) -> bool:
        # the placement repeats every node_ranks groups: those tell
        firsts = [k * size * width for k in range(min(dp // size, node_ranks))]
        return all(a // node_ranks == (a + size * width - 1) // node_ranks for a in firsts)

    return next((d for d in sizes if d > 1 and on_one_node(d)), sizes[0])


def hsdp_links(link: Links, n_ranks: int, dp: int, shard: int) -> tuple[list[LinkCost], list[LinkCost]]:
    """The links each pipeline rank's HSDP groups talk over: its shard groups (``shard`` consecutive
    replicas) and its replicate groups (every ``shard``-th replica), one of each per pipeline rank.

    Each group's link is ``group_link``'s (intra-node on one node, else the network over the cards
    of its members on each node); a rank's groups of one kind wait for the slowest of them. Plans
    with one link use it for both.

    Args:
        link: the plan's link(s).
        n_ranks: pipeline ranks of a replica.
        dp: replicas.
        shard: replicas per shard group (divides ``dp``).

    Returns:
        (shard-group links, replicate-group links), one per pipeline rank each.
    """
    if not isinstance(link, NodeLinks):
        one = dp_group_links(link, n_ranks, dp)
        return one, one
    placed = layout_links(link, n_ranks, dp, link.tp, link.pp_outer)
    assert isinstance(placed, NodeLinks)
    groups = dp // shard
    # the layout repeats every gpus_per_node replicas (they fill whole nodes): that many groups tell
    shards = [range(k * shard, (k + 1) * shard) for k in range(min(groups, link.gpus_per_node))]
    copies = [range(j, dp, shard) for j in range(min(shard, link.gpus_per_node))]

    def over(members: list[range], r: int) -> LinkCost:
        return slowest_link([replicas_link(placed, r, g) for g in members])

    return [over(shards, r) for r in range(n_ranks)], [over(copies, r) for r in range(n_ranks)]


def hsdp_reduce_s(
    nbytes: int, shard: int, groups: int, link: LinkCost, copies: LinkCost, reduce_bytes: int | None = None
) -> float:
    """Seconds one pipeline rank spends on HSDP's once-a-pass traffic (stage units) for ``nbytes`` of parameters:
    FSDP's gather and reduce-scatter inside its shard group of ``shard`` replicas (``link``), then the
    all-reduce of its 1/shard of the gradients over the ``groups`` groups (``copies``' link).

    Args:
        nbytes: the rank's parameter bytes.
        shard: replicas per shard group.
        groups: shard groups (``dp / shard``).
        link: the shard group's link.
        copies: the replicate group's link.
        reduce_bytes: its gradients' bytes as reduced (None: ``nbytes``; ``grad_reduce_s``).

    Returns:
        Seconds per step.
    """
    grads = nbytes if reduce_bytes is None else reduce_bytes
    return grad_reduce_s(nbytes, shard, "fsdp", link, grads) + group_allreduce_s(grads / shard, groups, copies)


def rank_hsdp_s(
    blocks: Sequence[BlockCost],
    stages: Sequence[StagePlan],
    links: Sequence[LinkCost],
    copies: Sequence[LinkCost],
    shard: int,
    groups: int,
) -> list[float]:
    """Every pipeline rank's HSDP traffic with stage units, its parameters at once (``hsdp_reduce_s``);
    under expert parallelism the experts' over the ``shard / ep`` replicas of a shard group holding
    them, then over the groups (``by_group``).

    Args:
        blocks: per-block costs (``param_bytes`` as gathered).
        stages: the pipeline's stages (``rank`` set).
        links: each rank's shard-group link (``hsdp_links``' first).
        copies: each rank's replicate-group link (``hsdp_links``' second).
        shard: replicas per shard group.
        groups: shard groups.

    Returns:
        Seconds per rank.
    """
    out = []
    held = rank_groups(blocks, stages, len(links))
    for link, copy, ((dense, experts, ep), (dense_grads, expert_grads, _)) in zip(links, copies, held):
        seconds = hsdp_reduce_s(dense, shard, groups, link, copy, dense_grads)
        if experts or expert_grads:
            seconds += hsdp_reduce_s(experts, shard // ep, groups, link, copy, expert_grads)
        out.append(seconds)
    return out


__all__ = ["hsdp_links", "hsdp_reduce_s", "hsdp_shard", "rank_hsdp_s"]
