"""The links between pipeline stages, boundary by boundary.

Pure module (no torch). A pipeline's messages cross one link (``LinkCost``), one link per boundary,
or, on a cluster of several nodes, an intra-node and an inter-node link (``NodeLinks``) resolved
under the schedule's placement of stages on ranks (``boundary_links``). A boundary whose two
stages share a rank (the turn of a V) sends nothing (``boundary_crosses``).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from pydantic import Field

from planner.core.step.schedules import placement, stage_ranks
from planner.errors import InfeasibleError
from planner.schema.costs import LinkCost


class NodeLinks(LinkCost):
    """The links of a pipeline whose ranks fill several nodes: its own fields are the intra-node link,
    ``inter`` the inter-node one.

    Ranks are placed on nodes consecutively (global rank g on node ``g // gpus_per_node``, as
    torchrun numbers them); stage i runs on the rank its schedule places it on
    (``planner.core.step.schedules.stage_ranks``), and the boundary between stages i and i + 1 uses
    ``inter`` when their ranks are on different nodes (the looped wrap from the last rank back to
    rank 0 included). With ``replicas`` data-parallel copies of the pipeline, replica k's pipeline
    rank r is global rank ``(k * n_ranks + r) * tp``, or ``(r * replicas + k) * tp`` pipeline-outermost
    (``pp_outer``: expert-parallel plans, ``planner.schema.plan.Plan``): a boundary uses
    ``inter`` when it crosses nodes in any replica (the replicas wait for each other at the gradient
    reduction, so the slowest sets the step). Being a ``LinkCost``, it passes through code that knows
    one link only; the solver and ``predict`` resolve it per boundary (``boundary_links``).
    """

    inter: LinkCost = Field(description="The link between ranks on different nodes.")
    gpus_per_node: int = Field(ge=1, description="Ranks per node.")
    n_ranks: int = Field(ge=1, description="Pipeline ranks of one replica (pp: --gpus / (dp x tp)).")
    replicas: int = Field(default=1, ge=1, description="Data-parallel replicas of the pipeline (dp).")
    tp: int = Field(default=1, ge=1, description="Tensor-parallel ranks of every pipeline rank (inside one node).")
    pp_outer: bool = Field(
        default=False,
        description="Ranks laid out pipeline-outermost, (pp, dp, tp), as expert-parallel plans are: a pipeline "
        "rank's replicas consecutive. False: replicas outermost, (dp, pp, tp).",
    )

    def node_of(self, replica: int, pp_rank: int) -> int:
        """The node that pipeline rank ``pp_rank`` of replica ``replica`` runs on (its first
        tensor-parallel rank's: a pipeline rank's ``tp`` ranks share a node)."""
        if self.pp_outer:
            return (pp_rank * self.replicas + replica) * self.tp // self.gpus_per_node
        return (replica * self.n_ranks + pp_rank) * self.tp // self.gpus_per_node

    def crosses(self, a: int, b: int) -> bool:
        """Whether pipeline ranks ``a`` and ``b`` are on different nodes in any replica."""
        # replica k + gpus_per_node is replica k shifted by whole nodes (n_ranks * tp of them, or tp
        # pipeline-outermost): the pattern repeats
        return any(self.node_of(k, a) != self.node_of(k, b) for k in range(min(self.replicas, self.gpus_per_node)))

    def intra(self) -> LinkCost:
        """The intra-node link as a plain ``LinkCost`` (every ``LinkCost`` field of this one)."""
        return LinkCost(**{name: getattr(self, name) for name in LinkCost.model_fields})


Links = LinkCost | Sequence[LinkCost]
"""One link for every boundary, or one per boundary (stage i to i + 1), or a ``NodeLinks``."""


def boundary_links(link: Links, n_stages: int, schedule: str | None = None) -> list[LinkCost]:
    """The link of every boundary between consecutive stages (``n_stages - 1`` of them).

    Args:
        link: one link for all, a list with one per boundary, or a ``NodeLinks``.
        n_stages: stages of the pipeline.
        schedule: decides where a ``NodeLinks``' stages run (None: stage i on rank i mod ranks,
            the looped placement, which is also every one-stage-per-rank schedule's).

    Returns:
        The links, boundary by boundary.

    Raises:
        InfeasibleError: a list of the wrong length, or stages that do not spread over the ranks.
    """
    if isinstance(link, NodeLinks):
        p = link.n_ranks
        if n_stages % p:
            raise InfeasibleError(f"{n_stages} stages do not spread evenly over the {p} ranks of the links")
        flags = _crossings(link, n_stages, schedule)
        intra = link.intra()
        return [link.inter if crosses else intra for crosses in flags]
    if isinstance(link, LinkCost):
        return [link] * (n_stages - 1)
    links = list(link)
    if len(links) != n_stages - 1:
        raise InfeasibleError(f"{len(links)} links for {n_stages} stages; expected one per boundary ({n_stages - 1})")
    return links


@lru_cache(maxsize=1024)
def _crossings(link: NodeLinks, n_stages: int, schedule: str | None) -> tuple[bool, ...]:
    """Whether each boundary crosses nodes in any replica (``NodeLinks.crosses``), once per
    placement: the search places the same mesh under many layouts."""
    p = link.n_ranks
    ranks = stage_ranks(schedule, p, n_stages // p) if schedule is not None else [i % p for i in range(n_stages)]
    return tuple(link.crosses(a, b) for a, b in zip(ranks, ranks[1:]))


def boundary_crosses(n_stages: int, schedule: str | None = None, stages_per_rank: int | None = None) -> list[bool]:
    """Whether each boundary between consecutive stages joins two ranks (``n_stages - 1`` flags).

    A boundary inside one rank (the turn of a V, where stages p - 1 and p share rank p - 1, or every
    boundary when one rank runs all the stages) sends nothing over a link, and its receiver waits
    for nothing, so no message and no cold start are charged there; ``planner.core.step.predict`` places
    the stages the same way (``stage_ranks``).

    Args:
        n_stages: stages of the pipeline.
        schedule: decides the placement (None: every boundary joins two ranks).
        stages_per_rank: stages on each rank (None: 2 under a V placement, the only count it runs;
            else 1, one rank per stage).

    Returns:
        One flag per boundary, True where it joins two ranks.
    """
    v = stages_per_rank or (2 if schedule is not None and placement(schedule) == "v" else 1)
    if schedule is None or n_stages < 2 or v == 1 or n_stages % v:
        # one rank per stage; or not a layout the schedule runs, which the schedule checks refuse
        return [True] * max(n_stages - 1, 0)
    ranks = stage_ranks(schedule, n_stages // v, v)
    return [a != b for a, b in zip(ranks, ranks[1:])]


def links_around(links: Sequence[LinkCost], k: int, default: LinkCost) -> tuple[LinkCost, LinkCost]:
    """The links at stage k's start and end boundaries (the other one where it has none)."""
    into = links[k - 1] if k > 0 else (links[0] if links else default)
    out = links[k] if k < len(links) else into
    return into, out


def default_link(link: Links) -> LinkCost:
    """A link for a lone stage (it sends nothing, any will do)."""
    if isinstance(link, LinkCost):
        return link
    links = list(link)
    return links[0] if links else LinkCost(name="none", latency_s=0.0, bandwidth_Bps=1.0)
