"""Data parallelism over pipeline replicas: the links and time of the gradient reduction.

Pure module: never imports torch. A plan of ``dp`` replicas runs ``dp`` copies of one pipeline of
``n_ranks`` ranks on a (dp, pp) mesh, global rank = replica x n_ranks + pipeline rank
(``torch.arange(world).view(dp, pp)``), or pipeline-outermost for expert parallelism, global rank =
pipeline rank x dp + replica (see ``planner.schema.plan.Plan``; ``NodeLinks.pp_outer``). Each replica runs the pipeline on its batch / dp samples; once per
step the replicas of every pipeline rank reduce that rank's gradients over their own group:

* DDP: an all-reduce, ``2 (dp - 1) / dp x bytes`` over the group's link;
* FSDP with stage units (``fully_shard`` per stage, ``reshard_after_forward=False``): an all-gather of the
  parameters (at the first forward) and a reduce-scatter of the gradients (after the last
  backward), ``(dp - 1) / dp x bytes`` each.

HSDP (``dp_mode`` "hsdp", ``dp_shard`` s): FSDP inside each group of s consecutive replicas (its
gathers and reduce-scatters over the group's link, ``(s - 1) / s`` of the bytes), then an all-reduce
of each rank's 1/s shard of the gradients over the ``dp / s`` groups (the replicate group's link,
``2 (dp / s - 1) / (dp / s) x bytes / s``), which FSDP2 runs right after every reduce-scatter. The
shard groups, their links and a rank's HSDP traffic with stage units: ``planner.core.levers.hsdp``;
the per-unit traffic (``block_fsdp_stages``) and ``stage_traffic`` here take the groups as arguments.

The bytes: FSDP gathers the parameters in the plan's dtype (``as_gathered``: a bf16 plan whose profile
was measured counts the fp32 weights autocast trains, ``Layout.gather_bytes``); gradients are reduced in
fp32 where the parameters are narrower (``wide_bytes``): DDP's are those of the fp32 weights autocast trains, and
FSDP reduces in fp32 by its ``MixedPrecisionPolicy`` (``planner.run.wrappers.fsdp_policy``), as
torchtitan, Megatron and the Llama 3 run do, for the sum over microbatches and replicas keeps fp32's
precision.

On an NCCL link (a GPU of the hardware table: ``LinkCost.nccl``) each collective is charged as NCCL's
own cost model predicts it (``planner.core.levers.collectives``: the algorithm and protocol NCCL
picks for the size, group and nodes, its latencies and channel bandwidths). On any other link
(gloo on CPUs, a measured or calibrated link) it is charged by the alpha-beta model of its
algorithm: a ring all-gather or reduce-scatter over n ranks ``(n - 1)`` latencies plus ``(n - 1) /
n`` of the bytes at the group's bandwidth, an all-reduce twice the bytes with a tree's ``2
ceil(log2 n)`` latencies (``_ring_s``, ``group_allreduce_s``), so a group of thousands pays for its
ring's steps. Where it runs is ``planner.core.step.predict``'s: on NCCL links beside the
compute as torch runs it (below, ``planner.core.levers.overlap``), on CPU ranks sharing cores
after the pipeline, nothing hidden.

FSDP block by block (``fsdp_units`` "block", ``block_fsdp_s``) gathers every unit for each
microbatch's forward, again for its backward, and reduce-scatters the unit's gradients then: three
transfers of the rank's parameters per microbatch (the third in fp32, as above). FSDP2 issues the next unit's gather while the
current unit computes (prefetch one unit ahead), so a gather hides only behind the compute of the
unit before it, and the reduce-scatters behind the next units' backward: ``block_fsdp_stages`` lays
each stage's units on that timeline (``planner.core.levers.overlap``). DDP's all-reduce, on GPUs
where DDP itself reduces (``ddp_follows``), runs in buckets as the last backward produces the
gradients (``ddp_stage_overlap``). The memory side (FSDP's shards) lives with the
rest of the memory model, ``planner.core.split.stage_model.stage_memory_bytes`` (``shard``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from functools import lru_cache, partial

from planner.core.levers.collectives import Collective, collective_time, least_seconds_per_byte
from planner.core.levers.experts import by_group
from planner.core.levers.links import Links, NodeLinks
from planner.core.levers.overlap import NONE, Overlap, bucketed, fsdp_unit_pass, spread
from planner.core.levers.recompute import checkpoint_units
from planner.core.split.stage_model import fp32_bytes
from planner.errors import InfeasibleError, PlanFileError
from planner.schema.costs import BlockCost, LinkCost
from planner.schema.names import ZERO_BUBBLE
from planner.schema.plan import Plan, ProfileInfo, StagePlan
from planner.schema.result import RunResult


def shard_of(dp: int, dp_mode: str, dp_shard: int = 0) -> int:
    """Replicas a stage's parameters, gradients and optimizer state are sharded over: ``dp`` under
    FSDP, ``dp_shard`` under HSDP, 1 under DDP (every replica holds the whole stage).

    Args:
        dp: data-parallel replicas.
        dp_mode: "ddp", "fsdp" or "hsdp".
        dp_shard: under HSDP, the replicas of each shard group (a divisor of ``dp``).

    Returns:
        The shard count.

    Raises:
        InfeasibleError: an unknown mode, or HSDP groups that do not divide the replicas.
    """
    if dp_mode not in ("ddp", "fsdp", "hsdp"):
        raise InfeasibleError(f"dp_mode {dp_mode!r}; expected 'ddp', 'fsdp' or 'hsdp'")
    if dp_mode == "hsdp":
        if dp_shard < 1 or dp % dp_shard:
            raise InfeasibleError(f"HSDP shard groups of {dp_shard} replica(s) do not divide {dp} replicas")
        return dp_shard
    return dp if dp_mode == "fsdp" else 1


def layout_links(link: Links, n_ranks: int, dp: int, tp: int = 1, pp_outer: bool = False) -> Links:
    """The links of one replica's pipeline of ``n_ranks`` ranks among ``dp`` replicas, each pipeline
    rank split over ``tp`` tensor-parallel ranks, the ranks laid out replicas-outermost or, with
    ``pp_outer``, pipeline-outermost (``planner.schema.plan.Plan``).

    Args:
        link: one link, one per boundary, or a ``NodeLinks`` (its ``n_ranks``, ``replicas`` and
            ``tp`` are replaced: a boundary uses the inter-node link when it crosses nodes in any
            replica).
        n_ranks: pipeline ranks of a replica.
        dp: replicas.
        tp: tensor-parallel ranks per pipeline rank.
        pp_outer: the ranks laid out pipeline-outermost (expert-parallel layouts).

    Returns:
        What ``predict`` and the solver take as ``link`` for this layout (``link`` itself unless a
        ``NodeLinks``).
    """
    if isinstance(link, NodeLinks):
        if (link.n_ranks, link.replicas, link.tp, link.pp_outer) == (n_ranks, dp, tp, pp_outer):
            return link
        return link.model_copy(update={"n_ranks": n_ranks, "replicas": dp, "tp": tp, "pp_outer": pp_outer})
    return link


def tp_link(link: Links) -> LinkCost:
    """The link a tensor-parallel group's all-reduces cross: the intra-node one (the group stays in
    a node), or the plan's one link."""
    if isinstance(link, NodeLinks):
        return link.intra()
    one = link if isinstance(link, LinkCost) else next(iter(link), None)
    return one if one is not None else LinkCost(name="none", latency_s=0.0, bandwidth_Bps=1.0)


@lru_cache(maxsize=4096)
def group_link(link: NodeLinks, pp_rank: int, members: range) -> LinkCost:
    """The link a collective over pipeline rank ``pp_rank``'s replicas ``members`` crosses.

    A group on one node uses the intra-node link. A group spanning nodes uses the network: NCCL
    builds its rings and trees over as many channels as the node's network cards carry, so a group
    with k members on every node it spans crosses nodes over k cards at once (k // ``ranks_per_nic``
    of them where ranks share a card), up to the intra-node link the same data also crosses
    (NVIDIA/nccl issues 652 and 412: "performance should add up as you add more" cards; issue 812: a
    DGX A100 with eight 200 Gb/s cards measures 192 GB/s of all-reduce bus bandwidth, where one card
    gives 24). The node with the fewest members sets the pace (its cards carry the same volume).

    Args:
        link: the plan's links, placed for the layout (``layout_links``).
        pp_rank: the pipeline rank whose replicas reduce together.
        members: those replicas.

    Returns:
        The group's link: ``link.intra()``, ``link.inter``, or ``link.inter`` at a multiple of its
        bandwidth, named ``<inter> x<k> cards``; for an NCCL link, ``link.inter`` with the group's
        ranks on each node (``local_ranks``), from which NCCL's model finds its channels itself.
    """
    counts = Counter(link.node_of(k, pp_rank) for k in members)
    intra = link.intra()
    if len(counts) <= 1:
        return intra
    inter = link.inter
    if inter.nccl is not None:
        # NCCL's model takes the group's shape itself: its members on each node (the cards they use)
        local = min(counts.values())
        if local <= 1:
            return inter
        return inter.model_copy(update={"name": f"{inter.name} x{local} ranks a node", "local_ranks": local})
    cards = min(counts.values()) // inter.ranks_per_nic if inter.ranks_per_nic else 1
    if cards <= 1:
        return inter
    bandwidth = min(cards * inter.bandwidth_Bps, intra.bandwidth_Bps)
    return inter.model_copy(update={"name": f"{inter.name} x{cards} cards", "bandwidth_Bps": bandwidth})


def _pace(one: LinkCost) -> tuple[float, float]:
    """How fast a group's link reduces, for comparing groups: its bandwidth; for an NCCL link the
    network below any node's NVLink, and over more cards faster."""
    if one.nccl is None:
        return (one.bandwidth_Bps, -one.latency_s)
    if not one.nccl.network:
        return (math.inf, -one.latency_s)
    return (max(1, one.local_ranks // one.nccl.gpus_per_nic) * one.bandwidth_Bps, -one.latency_s)


def slowest_link(links: Sequence[LinkCost]) -> LinkCost:
    """The slowest of several groups' links (the replicas wait for each other at the reduction)."""
    return min(links, key=_pace)


def _nccl_s(op: Collective, nbytes: float, group: int, link: LinkCost) -> float | None:
    """One collective over ``group`` ranks by NCCL's own model (``planner.core.levers.collectives``),
    the group shaped by the link (``local_ranks``: its ranks on each node; else all in one node, or one
    a node on the network); None on a link NCCL does not drive (gloo, a measured link)."""
    if link.nccl is None:
        return None
    local = link.local_ranks or (1 if link.nccl.network else group)
    return collective_time(op, nbytes, group, local, link.nccl).seconds


def dp_group_links(link: Links, n_ranks: int, dp: int) -> list[LinkCost]:
    """The link each pipeline rank's replicas reduce their gradients over.

    Pipeline rank r's replicas are global ranks ``r, r + n_ranks, ..., r + (dp - 1) n_ranks`` (times
    the link's tensor-parallel degree); with ranks on nodes of ``gpus_per_node`` (a ``NodeLinks``)
    the group uses the intra-node link when all of them are on one node, else the network, over as
    many cards as it has members on each node (``group_link``). Plans with one link (CPU / gloo,
    measured GPU plans) reduce over that link; a list of links per boundary reduces over its first.

    Args:
        link: the plan's link(s).
        n_ranks: pipeline ranks of a replica.
        dp: replicas.

    Returns:
        One link per pipeline rank.
    """
    if isinstance(link, NodeLinks):
        placed = layout_links(link, n_ranks, dp, link.tp, link.pp_outer)
        assert isinstance(placed, NodeLinks)
        return [group_link(placed, r, range(dp)) for r in range(n_ranks)]
    one = link if isinstance(link, LinkCost) else next(iter(link), None)
    if one is None:  # a lone stage's empty list of boundary links: nothing to time it by
        one = LinkCost(name="none", latency_s=0.0, bandwidth_Bps=1.0)
    return [one] * n_ranks


def _ring_s(nbytes: float, group: int, link: LinkCost, op: Collective = "all_gather") -> float:
    """An all-gather or a reduce-scatter (``op``) of ``nbytes`` (the whole, gathered size) over
    ``group`` ranks. On an NCCL link, as NCCL's model predicts it (``_nccl_s``); elsewhere a ring of
    ``group - 1`` steps, each sending ``1 / group`` of the bytes, so ``(group - 1) latencies + (group
    - 1) / group x nbytes / bandwidth`` (the alpha-beta cost of the ring; Thakur, Rabenseifner and
    Gropp, "Optimization of collective communication operations in MPICH", 2005). 0 alone."""
    if group <= 1:
        return 0.0
    nccl = _nccl_s(op, nbytes, group, link)
    if nccl is not None:
        return nccl
    return (group - 1) * link.latency_s + (group - 1) / group * nbytes / link.bandwidth_Bps


def ring_rate(group: int, link: LinkCost, op: Collective = "all_gather") -> float:
    """The least seconds per byte ``_ring_s`` charges an all-gather or a reduce-scatter over
    ``group`` ranks on ``link``, or ``group_allreduce_s`` an all-reduce, at any size: ``_ring_s(n,
    group, link, op) >= n x this`` (NCCL's model: ``least_seconds_per_byte``; elsewhere the ring's
    bandwidth term, twice for an all-reduce). The search's floors take it.

    Args:
        group: ranks of the group.
        link: its link.
        op: "all_gather", "reduce_scatter" or "all_reduce".

    Returns:
        Seconds per byte (0 for a group of one).
    """
    if group <= 1:
        return 0.0
    if link.nccl is not None:
        local = link.local_ranks or (1 if link.nccl.network else group)
        return least_seconds_per_byte(op, group, local, link.nccl)
    return (2 if op == "all_reduce" else 1) * (group - 1) / group / link.bandwidth_Bps


def grad_reduce_s(nbytes: int, dp: int, dp_mode: str, link: LinkCost, reduce_bytes: int | None = None) -> float:
    """Seconds one pipeline rank spends reducing its gradients over its ``dp`` replicas.

    DDP: all-reduce of the gradients, ``2 ceil(log2 dp) latency + 2 (dp - 1) / dp x R / bandwidth``.
    FSDP: all-gather of the parameters (``nbytes``) plus reduce-scatter of the gradients (``R``),
    rings of ``(dp - 1) latency + (dp - 1) / dp x bytes / bandwidth`` each. ``R`` is ``reduce_bytes``: in a dtype
    narrower than fp32 the gradients are reduced in fp32 (DDP's of the fp32 weights autocast trains,
    FSDP's by its ``reduce_dtype``; ``wide_bytes``) while FSDP gathers the parameters in their own.
    0 with one replica.

    Args:
        nbytes: the rank's parameter bytes, tied copies included.
        dp: replicas.
        dp_mode: "ddp" or "fsdp".
        link: the group's link (``dp_group_links``).
        reduce_bytes: the bytes of its gradients as reduced (None: ``nbytes``).

    Returns:
        Seconds per step.

    Raises:
        InfeasibleError: an unknown mode.
    """
    shard_of(dp, dp_mode)  # validates the mode
    if dp <= 1:
        return 0.0
    grads = nbytes if reduce_bytes is None else reduce_bytes
    if dp_mode == "ddp":
        return group_allreduce_s(grads, dp, link)
    return _ring_s(nbytes, dp, link) + _ring_s(grads, dp, link, "reduce_scatter")


def gather_bytes_of(profile: ProfileInfo) -> int:
    """Bytes per parameter FSDP gathers a plan's weights in (``Layout.gather_bytes``): 2 where the run
    computes in bf16 or fp16 (``planner.run.wrappers.fsdp_policy``), else 0 (the parameters' own)."""
    return 2 if profile.run_autocast is not None else 0


def as_gathered(blocks: Sequence[BlockCost], gather_bytes: int) -> Sequence[BlockCost]:
    """The blocks with ``param_bytes`` as FSDP gathers them: ``gather_bytes`` a parameter where that
    is narrower (a bf16 plan measured with the fp32 weights autocast trains), one for the share in
    float8 layers FSDP gathers in float8 (``BlockCost.float8_share``), their own otherwise; 0:
    unchanged. Their gradients, reduced in fp32 (``wide_bytes``), and their sharded state (the fp32
    master weights, ``OptimizerSpec.state_bytes``) come to what they were; the stage's unsharded
    bytes are then those it holds (``stage_model.unsharded_bytes``)."""
    if not gather_bytes:
        return blocks
    out = []
    for b in blocks:
        # torchao's float8 all-gather (``float8_share``): a float8 layer's weight a byte a parameter
        width = gather_bytes - (gather_bytes - 1) * b.float8_share
        if b.param_bytes <= width * b.params:
            out.append(b)
            continue
        update = {"param_bytes": round(width * b.params)}
        if b.fsdp_params is not None:  # what FSDP shards (expert parallelism's whole experts) alike
            update["fsdp_param_bytes"] = round(width * b.fsdp_params)
        out.append(b.model_copy(update=update))
    return out


def wide_bytes(blocks: Sequence[BlockCost]) -> int:
    """The blocks' gradients as reduced: fp32 where their parameters are narrower (``max(P, 4 N)``
    per block, ``stage_model.fp32_bytes``), else the parameters' bytes."""
    return sum(fp32_bytes(b.param_bytes, b.params) for b in blocks)


def _by_group_s(op: Collective, blocks: Sequence[BlockCost], dp: int, link: LinkCost) -> float:
    """One FSDP collective of the blocks' parameters (``op`` "all_gather") or gradients
    ("reduce_scatter", ``wide_bytes``) split ``by_group``: the experts a rank holds of an
    expert-parallel block over the ``dp / ep`` replicas holding the same ones, the rest over all
    ``dp``, on the same link (an expert group's replicas lie over the nodes as the replicas do)."""
    dense, experts, ep = by_group(blocks, wide=op == "reduce_scatter")
    return _ring_s(dense, dp, link, op) + (_ring_s(experts, dp // ep, link, op) if experts else 0.0)


def rank_groups(
    blocks: Sequence[BlockCost], stages: Sequence[StagePlan], n_ranks: int
) -> list[tuple[tuple[int, int, int], tuple[int, int, int]]]:
    """What each of ``n_ranks`` pipeline ranks reduces, over all of its stages: ``by_group`` of its
    blocks' parameters and of their gradients as reduced (``wide``).

    Args:
        blocks: per-block costs, as one rank holds them.
        stages: the pipeline's stages (``rank`` set).
        n_ranks: pipeline ranks.

    Returns:
        Per rank: ((dense, experts, ep) bytes of the parameters, the same of the gradients).
    """
    held: list[list[BlockCost]] = [[] for _ in range(n_ranks)]
    for st in stages:
        held[st.rank].extend(blocks[st.start : st.end])
    return [(by_group(part), by_group(part, wide=True)) for part in held]


def rank_reduce_s(
    blocks: Sequence[BlockCost],
    stages: Sequence[StagePlan],
    links: Sequence[LinkCost],
    dp: int,
    dp_mode: str,
) -> list[float]:
    """The gradient reduction of every pipeline rank (over all of its stages' parameters); under
    expert parallelism the experts' over the ``dp / ep`` replicas holding the same ones (``by_group``).

    Args:
        blocks: per-block costs (``param_bytes``, tied copies charged).
        stages: the pipeline's stages (``rank`` set).
        links: each rank's group link (``dp_group_links``).
        dp: replicas.
        dp_mode: "ddp" or "fsdp".

    Returns:
        Seconds per rank.
    """
    out = []
    for link, ((dense, experts, ep), (dense_grads, expert_grads, _)) in zip(
        links, rank_groups(blocks, stages, len(links))
    ):
        seconds = grad_reduce_s(dense, dp, dp_mode, link, dense_grads)
        if experts or expert_grads:
            seconds += grad_reduce_s(experts, dp // ep, dp_mode, link, expert_grads)
        out.append(seconds)
    return out


def stage_traffic(
    blocks: Sequence[BlockCost],
    stages: Sequence[StagePlan],
    links: Sequence[LinkCost],
    shard: int,
    copies: Sequence[LinkCost] = (),
    groups: int = 1,
) -> tuple[list[float], list[float]]:
    """FSDP's collectives of every stage with stage units, as ``planner.core.step.simulate.Traffic`` places
    them: the all-gather of its parameters, and the reduce-scatter of its gradients (fp32 where the
    parameters are narrower, ``wide_bytes``) followed under HSDP by the all-reduce of the stage's
    1/shard of them over the ``groups`` shard groups. The same rings ``grad_reduce_s`` and
    ``hsdp_reduce_s`` charge a rank, split by stage.

    Args:
        blocks: per-block costs (``param_bytes`` as gathered: ``as_gathered``).
        stages: the pipeline's stages (``rank`` set).
        links: each pipeline rank's shard-group link (``dp_group_links``; ``hsdp_links``' first).
        shard: replicas the stages are sharded over.
        copies: under HSDP, each rank's replicate-group link (``hsdp_links``' second).
        groups: under HSDP, the shard groups (1: plain FSDP).

    Returns:
        Seconds per stage: the gathers and the reductions.
    """
    gather, reduce = [], []
    for st in stages:
        part, link = blocks[st.start : st.end], links[st.rank]
        gather.append(_by_group_s("all_gather", part, shard, link))  # the experts' over their groups
        spread = _spread_s(part, shard, groups, copies[st.rank]) if groups > 1 else 0.0
        reduce.append(_by_group_s("reduce_scatter", part, shard, link) + spread)
    return gather, reduce


def _spread_s(blocks: Sequence[BlockCost], shard: int, groups: int, copies: LinkCost) -> float:
    """HSDP's all-reduce of a rank's gradient shards of ``blocks`` over the ``groups`` shard groups:
    its ``1 / shard`` of the rest, and of an expert-parallel block's experts (``by_group``, their own
    FSDP unit) its ``1 / (shard / ep)``, each group's ranks holding them."""
    dense, experts, ep = by_group(blocks, wide=True)
    return group_allreduce_s(dense / shard, groups, copies) + (
        group_allreduce_s(experts / (shard // ep), groups, copies) if experts else 0.0
    )


def allreduce_steps(group: int) -> int:
    """The latencies an all-reduce over ``group`` ranks pays: a tree's ``2 ceil(log2 group)`` (NCCL's
    tree, gloo's halving-doubling; never more than a ring's ``2 (group - 1)``); 0 alone."""
    return 2 * math.ceil(math.log2(group)) if group > 1 else 0


def group_allreduce_s(nbytes: float, group: int, link: LinkCost) -> float:
    """An all-reduce of ``nbytes`` over ``group`` ranks: on an NCCL link as NCCL's model predicts it
    (``_nccl_s``), elsewhere the ring's ``2 (group - 1) / group x nbytes`` at the link's bandwidth,
    with a tree's latencies (``allreduce_steps``). 0 alone."""
    if group <= 1:
        return 0.0
    nccl = _nccl_s("all_reduce", nbytes, group, link)
    if nccl is not None:
        return nccl
    return allreduce_steps(group) * link.latency_s + 2 * (group - 1) / group * nbytes / link.bandwidth_Bps


def block_fsdp_s(
    blocks: Sequence[BlockCost],
    stages: Sequence[StagePlan],
    links: Sequence[LinkCost],
    dp: int,
    n_microbatches: int,
    overlap: bool = True,
    copies: Sequence[LinkCost] = (),
    groups: int = 1,
) -> list[float]:
    """Seconds each pipeline rank's FSDP traffic adds to one pass when it shards block by block.

    Per microbatch a rank gathers each of its units (``checkpoint_units`` of its stages) for the
    forward and again for the backward, and reduce-scatters the unit's gradients:
    ``m ((dp - 1) / dp (2 P + R) / bandwidth + 3 u (dp - 1) latency)`` in all for ``P`` parameter bytes in ``u``
    units, their gradients ``R`` bytes as reduced (fp32 where the parameters are narrower, ``wide_bytes``).
    Ranks that share CPU cores (gloo) compute and communicate on the same cores: there nothing
    overlaps (``overlap`` False) and all of the traffic shows. With ``overlap`` this is the charge
    links NCCL does not drive keep (a measured link): the first gather of every forward and
    backward waits, the rest hides behind the rank's whole compute where it can; on NCCL links
    ``planner.core.step.predict`` lays each stage's units on FSDP2's timeline instead
    (``block_fsdp_stages``), where a gather hides only behind the unit before it. Under HSDP
    (``groups`` shard groups of ``dp`` replicas each) every unit's reduce-scatter is followed by the
    all-reduce of its shard over the groups, every microbatch too.

    Args:
        blocks: per-block costs (``param_bytes``).
        stages: the pipeline's stages (``rank``, ``fwd_s``, ``bwd_s`` set).
        links: each rank's group link (``dp_group_links``; the shard groups' under HSDP).
        dp: replicas the units are sharded over (the shard group's under HSDP).
        n_microbatches: microbatches per pass.
        overlap: whether the traffic runs beside the compute (a GPU's copy engines and NICs).
        copies: under HSDP, each rank's replicate-group link (``hsdp_links``).
        groups: under HSDP, the shard groups the gradients are all-reduced over (1: none).

    Returns:
        Seconds per pass, per rank (0 with one replica).
    """
    if dp <= 1:
        return [0.0] * len(links)
    out = []
    for rank, link in enumerate(links):
        mine = [st for st in stages if st.rank == rank]
        units = [u for st in mine for u in checkpoint_units(blocks, st.start, st.end)]
        unit_bytes = [sum(b.param_bytes for b in blocks[a:z]) for a, z in units]
        traffic = (
            n_microbatches
            * sum(  # the experts' over their groups (``by_group``)
                2 * _by_group_s("all_gather", blocks[a:z], dp, link)
                + _by_group_s("reduce_scatter", blocks[a:z], dp, link)
                for a, z in units
            )
        )
        if groups > 1:
            traffic += n_microbatches * sum(_spread_s(blocks[a:z], dp, groups, copies[rank]) for a, z in units)
        waits = 2 * n_microbatches * _ring_s(max(unit_bytes, default=0), dp, link)
        busy = n_microbatches * sum(st.fwd_s + st.bwd_s for st in mine)
        out.append(waits + max(traffic - waits - busy, 0.0) if overlap else traffic)
    return out


def block_fsdp_stages(
    blocks: Sequence[BlockCost],
    stages: Sequence[StagePlan],
    links: Sequence[LinkCost],
    dp: int,
    overlap: bool = True,
    copies: Sequence[LinkCost] = (),
    groups: int = 1,
) -> list[Overlap]:
    """One microbatch of every stage's FSDP traffic when it shards block by block, as FSDP2 runs it.

    Each unit (``checkpoint_units``) is gathered for the forward and again for the backward and
    reduce-scatters its gradients (under HSDP then all-reduces its shard over the ``groups``); the
    stage's forward and backward seconds are shared over its units by their blocks' own times
    (``spread``: recomputation and a cold start go with them) and the collectives laid beside them
    with one unit of prefetch (``planner.core.levers.overlap.fsdp_unit_pass``). Without ``overlap``
    (ranks sharing CPU cores) every collective is exposed.

    Args:
        blocks: per-block costs (``param_bytes`` as gathered, ``fwd_s``, ``bwd_s``).
        stages: the pipeline's stages (``rank``, ``fwd_s``, ``bwd_s`` set).
        links: each rank's group link (the shard groups' under HSDP).
        dp: replicas the units are sharded over.
        overlap: whether the collectives run beside the compute.
        copies: under HSDP, each rank's replicate-group link.
        groups: under HSDP, the shard groups (1: none).

    Returns:
        Per stage: its collectives' seconds and the part its compute waits for, per microbatch.
    """
    if dp <= 1:
        return [NONE] * len(stages)
    out = []
    for st in stages:
        link, units = links[st.rank], checkpoint_units(blocks, st.start, st.end)
        # a unit's experts are their own FSDP unit, gathered and reduced over their groups (``by_group``)
        gathers = [_by_group_s("all_gather", blocks[a:z], dp, link) for a, z in units]
        reduces = []
        for a, z in units:
            spread_s = _spread_s(blocks[a:z], dp, groups, copies[st.rank]) if groups > 1 else 0.0
            reduces.append(_by_group_s("reduce_scatter", blocks[a:z], dp, link) + spread_s)
        if not overlap:
            out.append(Overlap(2 * sum(gathers) + sum(reduces), 2 * sum(gathers) + sum(reduces)))
            continue
        fwd = spread(st.fwd_s, [sum(b.fwd_s for b in blocks[a:z]) for a, z in units])
        bwd = spread(st.bwd_s, [sum(b.bwd_s for b in blocks[a:z]) for a, z in units])
        out.append(fsdp_unit_pass(gathers, fwd, bwd, reduces))
    return out


def ddp_follows(schedule: str, tp: int, accumulation: int) -> bool:
    """Whether torch's DDP reduces the replicas' gradients itself, in buckets during the last
    backward of each stage (``planner.run.stages``): not under the zero-bubble schedules (their
    weight gradients bypass DDP's hooks), tensor parallelism (DTensor parameters) or several passes
    per step; there the runner all-reduces after the step's backward, nothing hidden."""
    return schedule not in ZERO_BUBBLE and tp == 1 and accumulation == 1


def ddp_stage_overlap(
    blocks: Sequence[BlockCost], stages: Sequence[StagePlan], links: Sequence[LinkCost], dp: int
) -> list[Overlap]:
    """Every stage's DDP all-reduces in buckets during its last microbatch's backward
    (``planner.core.levers.overlap.bucketed``): its blocks' gradients (fp32 where the parameters are
    narrower, ``wide_bytes``) in backward order, each ready when its block's share of the stage's
    backward (``spread``) is done, the buckets all-reduced one after another over the rank's group.
    The experts a rank holds of an expert-parallel block are not DDP's (the runner leaves them out
    and all-reduces them over their groups after the backward: ``experts_after_s``).

    Args:
        blocks: per-block costs.
        stages: the pipeline's stages (``rank``, ``bwd_s`` set).
        links: each rank's group link (``dp_group_links``).
        dp: replicas.

    Returns:
        Per stage: the all-reduces' seconds and what its backward waits for after its compute.
    """
    if dp <= 1:
        return [NONE] * len(stages)
    out = []
    for st in stages:
        part, link = blocks[st.start : st.end][::-1], links[st.rank]
        grads = [float(by_group([b], wide=True)[0]) for b in part]
        compute = spread(st.bwd_s, [b.bwd_s for b in part])
        out.append(bucketed(grads, compute, partial(group_allreduce_s, group=dp, link=link)))
    return out


def experts_after_s(
    blocks: Sequence[BlockCost], stages: Sequence[StagePlan], links: Sequence[LinkCost], dp: int
) -> list[float]:
    """Seconds each pipeline rank all-reduces its experts' gradients after the step's backward under
    DDP (``planner.run.gradients``: left out of DDP's buckets, one all-reduce over the ``dp / r``
    replicas holding the same experts, ``r`` the replicas an expert group covers
    (``planner.core.levers.experts.by_group``), nothing hidden).

    Args:
        blocks: per-block costs, as one expert-parallel rank holds them.
        stages: the pipeline's stages (``rank`` set).
        links: each rank's group link (``dp_group_links``).
        dp: replicas.

    Returns:
        Seconds per rank (0 without experts, or with one replica per expert group).
    """
    return [
        group_allreduce_s(expert_grads, dp // ep, link) if expert_grads else 0.0
        for link, (_, (_, expert_grads, ep)) in zip(links, rank_groups(blocks, stages, len(links)))
    ]


def replica_slots(slots: float | None, dp: int) -> float | None:
    """Ranks of one replica that can compute at once when ``dp`` replicas share the processors.

    CPU ranks share the machine's cores (``planner.core.step.predict.slots_of``): dp replicas running
    side by side leave each pipeline 1/dp of them. None (one device per rank) stays None.

    Args:
        slots: ranks of all replicas that can compute at once (None: no sharing).
        dp: replicas.

    Returns:
        ``slots / dp``, or None.
    """
    return None if slots is None else slots / dp


def check_run_replicas(plan: Plan, run: RunResult) -> None:
    """Refuse a run with another number of data-parallel replicas than ``plan`` (its per-stage
    figures are replica 0's, its step includes the reduction over its own replicas).

    Args:
        plan: a plan.
        run: a run report said to be of it.

    Raises:
        PlanFileError: the replica counts differ.
    """
    if run.replicas != plan.dp:
        raise PlanFileError(
            f"the run trained {run.replicas} data-parallel replica(s), the plan has {plan.dp}; compare a plan "
            "with a run of that same plan"
        )


__all__ = [
    "allreduce_steps",
    "as_gathered",
    "block_fsdp_s",
    "block_fsdp_stages",
    "check_run_replicas",
    "ddp_follows",
    "ddp_stage_overlap",
    "dp_group_links",
    "experts_after_s",
    "gather_bytes_of",
    "grad_reduce_s",
    "group_allreduce_s",
    "group_link",
    "layout_links",
    "rank_groups",
    "rank_reduce_s",
    "replica_slots",
    "ring_rate",
    "shard_of",
    "slowest_link",
    "stage_traffic",
    "wide_bytes",
]
