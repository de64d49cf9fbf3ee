"""The records that travel together into the solver, the prediction and the search.

Pure module (no torch). Each is small and frozen, and names one thing a caller decides once:

- ``Cluster``: the ranks a plan may use: how many in all (``world_size``, ``--gpus``), the links
  between them (one ``LinkCost``, or a ``NodeLinks`` that knows the ranks per node) and how many
  can compute at once (CPU ranks sharing cores).
- ``Layout``: one way to run a step on them: ``dp`` replicas of a ``pp``-rank pipeline under a
  schedule, with its microbatches and stages per rank, each pipeline rank split over ``tp``
  tensor-parallel ranks; ``dp * pp * tp`` is the cluster's world size, and
  ``pp`` is what a plan records as ``Plan.n_ranks`` (the ranks of one replica's pipeline).
- ``Constraints``: what every split must respect: the optimizer's state, the memory limit per rank
  and the activation-checkpointing policy.
- ``Scaling``: how the profiled block costs carry over to other microbatch sizes.
- ``SearchSpace``: what the joint search is asked to cover (None or "auto" where it is open).
- ``Asked``: a whole request as core takes it (``asked_of`` turns ``planner plan``'s
  ``PlanRequest`` into one): the world size, the search space and constraints as asked, the split
  method and a split to compare.

``check_in_flight`` checks the live-microbatch counts a caller may give the solver instead of the schedule's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from planner.core.levers.data_parallel import shard_of
from planner.core.levers.hsdp import hsdp_shard
from planner.core.levers.links import Links, NodeLinks
from planner.errors import InfeasibleError
from planner.schema.costs import OptimizerSpec
from planner.schema.counts import group_replicas
from planner.schema.names import CP_ATTENTION
from planner.schema.request import PlanRequest


@dataclass(frozen=True)
class Cluster:
    """The ranks a plan may use.

    Attributes:
        world_size: every rank, of all replicas (``--gpus``).
        link: the cost of one message between neighbouring ranks, one per boundary, or a
            ``NodeLinks`` (an intra- and an inter-node link, and the ranks per node).
        slots: ranks that can compute at once (CPU ranks sharing cores: cores / threads per rank);
            None when every rank has its own device.
    """

    world_size: int
    link: Links
    slots: float | None = None


@dataclass(frozen=True)
class Layout:
    """One way to run a step: ``dp`` replicas of a ``pp``-rank pipeline.

    Attributes:
        schedule: one of ``planner.core.step.schedules.SCHEDULES``.
        pp: pipeline ranks of one replica (``Plan.n_ranks``).
        n_microbatches: microbatches per step of one replica.
        stages_per_rank: stages on every pipeline rank.
        dp: data-parallel replicas of the pipeline.
        dp_mode: how the replicas reduce gradients: "ddp", "fsdp", "hsdp", or "auto" before the search
            decides (``planner.core.layout.search.evaluate_modes``).
        tp: tensor-parallel ranks each pipeline rank is split over (inside one node).
        accumulation: pipeline passes per step (gradient accumulation): each replica runs the
            schedule this many times, ``n_microbatches`` microbatches each, then reduces, clips and
            steps once. Memory is one pass's (its receive buffers are ``n_microbatches``' worth).
        fsdp_units: under FSDP, its units: "stage" or "block" (``planner.schema.request.FsdpUnits``),
            or "auto" before the search decides.
        dp_shard: under HSDP, the replicas of each shard group (a divisor of ``dp``; 0 otherwise).
        gather_bytes: bytes per parameter FSDP gathers the weights in (2: a bf16 or fp16 plan, whose
            measured profile counts the fp32 weights autocast trains; 0: the parameters' own bytes).
        sequence: with ``tp`` > 1, sequence parallelism (``planner.core.levers.tensor_parallel.at_degree``).
        ep: expert-parallel ranks: each experts module sharded over this many replicas
            (``planner.core.levers.experts.at_degree``).
        cp: context-parallel ranks: each data-parallel replica's sequences split over ``cp`` of the
            ``dp`` replicas above, which then count ``dp / cp`` data-parallel replicas (``dp`` is every
            rank holding a stage's weights, what reduces and shards them;
            ``planner.core.levers.context_parallel``).
        cp_attention: with cp > 1, how attention reaches every position's keys and values
            ("all-gather" or "ring", ``planner.schema.plan.Plan.cp_attention``).
        loss_parallel: with ``tp`` > 1, the output head's logits left split and the loss computed on
            them (``planner.core.levers.tensor_parallel.at_degree``).
    """

    schedule: str
    pp: int
    n_microbatches: int
    stages_per_rank: int = 1
    dp: int = 1
    dp_mode: str = "ddp"
    tp: int = 1
    accumulation: int = 1
    fsdp_units: str = "stage"
    dp_shard: int = 0
    gather_bytes: int = 0
    sequence: bool = False
    ep: int = 1
    cp: int = 1
    cp_attention: str = "all-gather"
    loss_parallel: bool = False

    @property
    def data_replicas(self) -> int:
        """Data-parallel replicas, each reading its own rows: ``dp / cp``."""
        return self.dp // self.cp

    def microbatch_size(self, batch_size: int) -> int:
        """Samples per microbatch of ``batch_size`` under this layout (its replicas, passes and microbatches)."""
        return batch_size // (self.data_replicas * self.accumulation * self.n_microbatches)

    def rank_share(self, batch_size: int) -> float:
        """What one rank computes per microbatch, in whole sequences: the microbatch's samples, each
        1 / ``cp`` of its sequence under context parallelism (what the block costs are scaled to)."""
        return batch_size / (self.dp * self.accumulation * self.n_microbatches)

    @property
    def n_stages(self) -> int:
        """Stages of one replica's pipeline: ``pp * stages_per_rank``."""
        return self.pp * self.stages_per_rank

    @property
    def pp_outer(self) -> bool:
        """Whether the ranks are laid out pipeline-outermost: expert-parallel layouts, whose expert groups
        (replicas of one pipeline rank) then fill a node together (``planner.schema.plan.Plan.pp_outer``)."""
        return self.ep > 1

    @property
    def shard(self) -> int:
        """Replicas a stage's parameters, gradients and optimizer state are sharded over: ``dp``
        under FSDP, ``dp_shard`` under HSDP, 1 under DDP (every replica holds the whole stage).

        Raises:
            InfeasibleError: ``dp_mode`` is not "ddp", "fsdp" or "hsdp" (an "auto" not yet decided).
        """
        return shard_of(self.dp, self.dp_mode, self.dp_shard)

    @property
    def per_block(self) -> bool:
        """Whether FSDP shards block by block (``fsdp_units`` "block" over several replicas): then a rank
        holds only a few blocks' parameters unsharded at a time, gathered again every microbatch."""
        return self.fsdp_units == "block" and self.shard > 1

    @property
    def fresh_grads(self) -> bool:
        """Whether a rank's gradients are freed between steps (the runner's ``zero_grad(set_to_none=True)``)
        and so exist only from its stages' first backward on (``MemoryParts.peak``). Not under DDP
        replicas, whose buckets hold them for good (``gradient_as_bucket_view``), nor with several
        passes a step, whose later passes accumulate into the first one's."""
        return self.accumulation == 1 and (self.dp == 1 or self.shard > 1)


@dataclass(frozen=True)
class Constraints:
    """What every split must respect.

    Attributes:
        optimizer: the optimizer (its state bytes per parameter, its step's temporaries).
        memory_limit_bytes: per-rank limit (None: none).
        recompute: activation checkpointing, block by block, per stage: "auto" (the least
            recomputation that fits: none, else selective, else full), "never", "selective" or
            "full" (every stage); "always" is "full" (its name before selective existed).
        compiled: the stages run compiled, which hold autocast's weight copies per microbatch
            (``planner.core.levers.casts.compiled_casts``) where FSDP does not gather them cast already.
    """

    optimizer: OptimizerSpec = OptimizerSpec()
    memory_limit_bytes: int | None = None
    recompute: str = "auto"
    compiled: bool = False

    def __post_init__(self) -> None:
        if self.recompute == "always":
            object.__setattr__(self, "recompute", "full")


@dataclass(frozen=True)
class Scaling:
    """How block costs profiled at one microbatch size carry over to others
    (``planner.core.levers.microbatch.blocks_at``).

    Attributes:
        size0: the microbatch size the costs were profiled at (samples).
        fixed_fraction: the share of a block's time that does not scale with the microbatch size.
        min_size: the smallest microbatch the model ran; costs are not extrapolated below it.
    """

    size0: int
    fixed_fraction: float = 0.0
    min_size: int = 1


@dataclass(frozen=True)
class SearchSpace:
    """What the joint search is asked to cover (an option left open is None or "auto").

    Attributes:
        batch_size: samples per step, the global batch (split evenly over the replicas).
        schedule: a schedule name, or "auto" for all of them.
        n_microbatches: microbatches per pass of a replica, or None for the divisors of the replica's batch.
        stages_per_rank: stages per rank, or None for what each schedule allows.
        replicas: the data-parallel replica counts to try (each divides the world size).
        dp_mode: "ddp", "fsdp", "hsdp" or "auto".
        fsdp_units: under FSDP, "stage", "block" or "auto" (the faster that fits).
        dp_shard: under HSDP, the replicas of each shard group, or None for the largest that lie on one node.
        degrees: the tensor-parallel degrees to try (each divides a node's ranks and the world size).
        accumulation: pipeline passes per step, or None to try them (``planner.core.layout.search``).
        gather_bytes: bytes per parameter FSDP gathers in (``Layout.gather_bytes``).
        sequence: whether the tensor-parallel degrees > 1 run with sequence parallelism, the options
            tried: (False,), (True,) or both (``planner.core.levers.tensor_parallel.at_degree``).
        eps: the expert-parallel degrees to try (``--ep``; empty for auto until the blocks give the
            experts' counts, ``planner.core.assemble``): above 1 only with replica counts they divide,
            DDP replicas, tp 1 and the schedules with a whole backward (the search keeps to them,
            ``planner.core.levers.experts.layout_refusal``).
        cps: the context-parallel degrees to try (``--cp``; empty for auto until the blocks say which
            attention there is to split, ``planner.core.assemble``): above 1 only with ep 1, without
            sequence parallelism or HSDP.
        cp_attention: how context-parallel layouts attend, the methods tried ("all-gather", "ring";
            ``planner.core.levers.context_parallel``).
        loss_parallel: whether the layouts with ``tp`` > 1 run loss parallelism (``Layout.loss_parallel``).
    """

    batch_size: int
    schedule: str = "auto"
    n_microbatches: int | None = None
    stages_per_rank: int | None = None
    replicas: tuple[int, ...] = (1,)
    dp_mode: str = "ddp"
    degrees: tuple[int, ...] = (1,)
    accumulation: int | None = 1
    fsdp_units: str = "stage"
    dp_shard: int | None = None
    gather_bytes: int = 0
    sequence: tuple[bool, ...] = (False,)
    eps: tuple[int, ...] = (1,)
    cps: tuple[int, ...] = (1,)
    cp_attention: tuple[str, ...] = ("all-gather",)
    loss_parallel: bool = False


NO_CONSTRAINTS = Constraints()
"""AdamW, no memory limit, recomputation only where needed (so never): the default of the solver."""


def check_in_flight(in_flight: Sequence[int], n_stages: int, n_microbatches: int) -> list[int]:
    """The peak live microbatches per stage a caller gives ``solve``, checked.

    Raises:
        InfeasibleError: the wrong number of counts, a negative or fractional one, or no microbatch.
    """
    counts = [int(x) for x in in_flight]
    if len(counts) != n_stages:
        raise InfeasibleError(
            f"in_flight has {len(counts)} entries for {n_stages} stages; expected one peak in-flight "
            "microbatch count per stage (planner.core.step.schedules.in_flight_per_stage gives them)."
        )
    if any(c < 0 or c != x for c, x in zip(counts, in_flight)):
        raise InfeasibleError(
            f"in_flight={list(in_flight)} is invalid; expected whole numbers >= 0 (live microbatches per stage)."
        )
    if n_microbatches < 1:
        raise InfeasibleError(f"--microbatches {n_microbatches}: need at least one microbatch; use -m 1 or more")
    return counts


@dataclass(frozen=True)
class Asked:
    """A request as core takes it: the records ``planner.core.assemble.assemble_plan`` plans from.

    Attributes:
        world_size: every rank, of all replicas (``--gpus``).
        space: what the search covers, as asked: its tensor-parallel degrees and sequence options
            before the model's blocks narrow them, its ``gather_bytes`` before the profile sets it.
        constraints: the optimizer, the per-rank memory limit, the recompute policy, compilation.
        microbatch_size: the microbatch size the costs were made at, where the profile does not say.
        method: the split the plan uses: "optimal", "uniform", "params" or "given".
        compare: a split the user runs (``--compare``), in any notation ``planner.core.split.given``
            reads (None: none).
        tp: an explicit ``--tp`` (None: auto), named when the model cannot split that way.
    """

    world_size: int
    space: SearchSpace
    constraints: Constraints
    microbatch_size: int
    method: str = "optimal"
    compare: str | None = None
    tp: int | None = None


def asked_of(request: PlanRequest, memory_limit_bytes: int | None) -> Asked:
    """``planner plan``'s options as the records core plans from (the one place core reads a request).

    Args:
        request: the validated request.
        memory_limit_bytes: the per-rank limit: the request's, else the device's (None: none).

    Returns:
        The request as core's records.
    """
    ep = request.ep if isinstance(request.ep, int) else 1
    space = SearchSpace(
        request.batch_size,
        request.schedule,
        request.microbatches,
        request.stages_per_rank,
        # the replica counts some degree's expert groups divide (``layout_refusal`` sorts out the rest): a
        # group covers consecutive replicas of the dp x cp (any count where cp is searched)
        tuple(
            d
            for d in request.dp_options
            if request.cp == "auto" or any(d * request.cp % group_replicas(ep, t) == 0 for t in request.tp_options)
        ),
        request.dp_mode,
        tuple(request.tp_options),
        None if request.accumulation == "auto" else request.accumulation,
        request.fsdp_units,
        None if request.dp_shard == "auto" else request.dp_shard,
        sequence=(False, True) if request.sequence_parallel == "auto" else (request.sequence_parallel is True,),
        eps=(ep,) if isinstance(request.ep, int) else (),
        cps=(request.cp,) if isinstance(request.cp, int) else (),
        cp_attention=CP_ATTENTION if request.cp_attention == "auto" else (request.cp_attention,),
        loss_parallel=request.loss_parallel,
    )
    return Asked(
        world_size=request.gpus,
        space=space,
        constraints=Constraints(request.optimizer, memory_limit_bytes, request.recompute, request.compile),
        microbatch_size=request.microbatch_size,
        method=request.method,
        compare=request.compare,
        tp=request.tp if isinstance(request.tp, int) else None,
    )


def replica_mode(cluster: Cluster, space: SearchSpace, dp: int, replica_ranks: int) -> tuple[str, int]:
    """The data-parallel mode of ``space`` for ``dp`` replicas of ``replica_ranks`` ranks, with HSDP's
    shard groups sized (``hsdp_shard``: ``--dp-shard``, else as many replicas as share a node; one
    machine for plans without node links). HSDP whose one group holds every replica is FSDP: that is
    what the layout is searched (and recorded) as. Where one replica fills a node, HSDP asked for
    takes the smallest groups (they must cross nodes). Under
    "auto" the size is that of the groups ``evaluate_modes`` may try (0: the replicas share a node,
    or each fills one).

    Args:
        cluster: the ranks and their links.
        space: the search's options (``dp_mode``, ``dp_shard``).
        dp: replicas.
        replica_ranks: global ranks from one replica to the next (``pp x tp``, or ``tp`` where the
            ranks are pipeline-outermost: expert-parallel layouts, ``Layout.pp_outer``).

    Returns:
        (mode, shard group size): the size 0 outside HSDP, -1 when ``--dp-shard`` does not divide ``dp``.
    """
    node = cluster.link.gpus_per_node if isinstance(cluster.link, NodeLinks) else cluster.world_size
    if space.dp_mode == "auto" and dp > 1:
        # the groups "auto" may try, where the replicas span nodes (``evaluate_modes``)
        shard = hsdp_shard(dp, replica_ranks, node)
        return "auto", shard if 1 < shard < dp else 0
    if space.dp_mode != "hsdp":
        return space.dp_mode, 0
    if dp == 1:
        return "ddp", 0
    shard = hsdp_shard(dp, replica_ranks, node, space.dp_shard)
    if shard == 1:
        # asked for HSDP where one replica fills a node: groups must cross nodes, the smallest do least
        shard = min(d for d in range(2, dp + 1) if dp % d == 0)
    if shard == 0:
        return space.dp_mode, -1
    if shard == dp:
        return "fsdp", 0
    return "hsdp", shard
