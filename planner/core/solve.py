"""Exact pipeline partition solver and the baselines it is compared against.

Pure module: never imports torch (numpy only). A partition splits the blocks (in execution order)
into contiguous, non-empty stages, one per rank, cutting only after blocks whose ``cut_legal`` is
True.

``solve`` is exact: it minimises the bottleneck stage cost (the slowest stage bounds the
steady-state throughput of GPipe and 1F1B alike, Narayanan et al. 2021 Eq. 1), as PipeDream and
Alpa do, subject to a per-stage memory limit, and breaks ties deterministically (least total stage
cost, then lexicographically smallest starts). It is the dynamic programme over (stage index, end
block) of PipeDream, computed on candidate stages only (see ``_exact_partition``):

* A stage ``[s, e)`` costs ``(pre[e] - pre[s]) + send_in[s] + send_out[e]`` (+ its recomputation),
  where a boundary's terms hold its messages both ways and the cold start of the block that waits
  for them (``cold_in``, ``cold_out``),
  so its cost without the per-end message term is non-decreasing in ``e``. With a link per
  boundary (ranks on several nodes, ``NodeLinks``) the message terms depend on the stage index k
  through the links of boundaries k - 1 and k: each stage index takes one of a few cost rows
  (``_Arrays.variant``; at most four with an intra- and an inter-node link), and the bound above
  uses the cheapest link; a stage whose lower bound
  exceeds a cap on the bottleneck can never be part of a partition under that cap. The same holds
  for a lower bound of its memory. Each start therefore has a window of candidate ends, found by
  binary search, and the programme only looks at those pairs; each stage index only at the starts
  it can have (``_band``). The cap starts near the average stage and rises to the best bottleneck
  found until that is within it.
* Memory grows with the number of live microbatches ``t``, so each candidate's fit is one
  threshold on ``t`` (computed once, in integers), and the stage index enters only through
  ``in_flight[k]``.
* Every candidate's cost is computed with the same floating-point operations, in the same order,
  as a stage-by-stage evaluation, and the programme takes the same minima and applies the same
  1e-9 tie tolerance; the result is the same partition the O(p n^2) programme returns, not just
  one of equal cost (the tests check this against that programme and brute force).

With ``w`` candidate ends per start (about the blocks of the widest stage under the optimum) it
runs in O(p n w) vectorised operations plus O(n log n) for the windows, instead of O(p n^2) calls:
2,000 blocks on 64 stages take well under a second (docs/solver_scaling.md). The worst case, a
bottleneck so large that most stages fit under it (one block dwarfing the rest, or all costs zero),
is still O(p n^2), vectorised (about a second at that size). When nothing fits, the error names the
smallest stage count that would, found by one reachability sweep from the last stage for all counts
at once (``_FitSearch``).

The baselines reproduce what torchtitan / Megatron (equal layer counts) and DeepSpeed
(``partition_method="parameters"``) would pick, evaluated on the same costs so the report can
compare them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray
from pydantic import BaseModel, ConfigDict, Field, field_validator

from planner.core.schedules import in_flight_per_stage, placement, stage_ranks
from planner.errors import InfeasibleError
from planner.schema.costs import BlockCost, LinkCost, OptimizerSpec

DEFAULT_OPTIMIZER = OptimizerSpec()  # frozen, so one shared default is safe

# Relative tolerance under which two bottlenecks / cost sums count as equal (float sums in a
# different order differ in the last bits; exact ties must not depend on that).
_REL_EPS = 1e-9


class Partition(BaseModel):
    """A split of the blocks into contiguous stages."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    starts: tuple[int, ...] = Field(
        description="First block of each stage; starts[0] == 0, strictly increasing. Stage k is "
        "blocks[starts[k]:starts[k+1]], the last stage runs to the end."
    )
    bottleneck_s: float = Field(
        description="Max over stages of the stage cost (``stage_costs``), seconds per microbatch."
    )
    recompute: tuple[bool, ...] = Field(
        default=(), description="Per stage: whether it recomputes its activations in backward (empty = none does)."
    )

    @field_validator("starts")
    @classmethod
    def _check_starts(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if not v or v[0] != 0 or any(b <= a for a, b in zip(v, v[1:])):
            raise ValueError(f"starts={v} is invalid; expected starts[0] == 0 and strictly increasing.")
        return v


# ---------------------------------------------------------------------------------------------
# Links between stages
# ---------------------------------------------------------------------------------------------


class NodeLinks(LinkCost):
    """The links of a pipeline whose ranks fill several nodes: its own fields are the intra-node link,
    ``inter`` the inter-node one.

    Ranks are placed on nodes consecutively (global rank g on node ``g // gpus_per_node``, as
    torchrun numbers them); stage i runs on the rank its schedule places it on
    (``planner.core.schedules.stage_ranks``), and the boundary between stages i and i + 1 uses
    ``inter`` when their ranks are on different nodes (the looped wrap from the last rank back to
    rank 0 included). With ``replicas`` data-parallel copies of the pipeline, replica k's pipeline
    rank r is global rank ``k * n_ranks + r`` (``planner.schema.plan.Plan``): a boundary uses
    ``inter`` when it crosses nodes in any replica (the replicas wait for each other at the gradient
    reduction, so the slowest sets the step). Being a ``LinkCost``, it passes through code that knows
    one link only; the solver and ``predict`` resolve it per boundary (``boundary_links``).
    """

    inter: LinkCost = Field(description="The link between ranks on different nodes.")
    gpus_per_node: int = Field(ge=1, description="Ranks per node.")
    n_ranks: int = Field(ge=1, description="Ranks of one replica's pipeline (--gpus / dp).")
    replicas: int = Field(default=1, ge=1, description="Data-parallel replicas of the pipeline (dp).")

    def node_of(self, replica: int, pp_rank: int) -> int:
        """The node that pipeline rank ``pp_rank`` of replica ``replica`` runs on."""
        return (replica * self.n_ranks + pp_rank) // self.gpus_per_node

    def crosses(self, a: int, b: int) -> bool:
        """Whether pipeline ranks ``a`` and ``b`` are on different nodes in any replica."""
        # replica k + gpus_per_node is replica k shifted by n_ranks whole nodes: the pattern repeats
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
        ranks = stage_ranks(schedule, p, n_stages // p) if schedule is not None else [i % p for i in range(n_stages)]
        intra = link.intra()
        return [link.inter if link.crosses(a, b) else intra for a, b in zip(ranks, ranks[1:])]
    if isinstance(link, LinkCost):
        return [link] * (n_stages - 1)
    links = list(link)
    if len(links) != n_stages - 1:
        raise InfeasibleError(f"{len(links)} links for {n_stages} stages; expected one per boundary ({n_stages - 1})")
    return links


def boundary_crosses(n_stages: int, schedule: str | None = None, stages_per_rank: int | None = None) -> list[bool]:
    """Whether each boundary between consecutive stages joins two ranks (``n_stages - 1`` flags).

    A boundary inside one rank (the turn of a V, where stages p - 1 and p share rank p - 1, or every
    boundary when one rank runs all the stages) sends nothing over a link, and its receiver waits
    for nothing, so no message and no cold start are charged there; ``planner.core.predict`` places
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


def _around(links: Sequence[LinkCost], k: int, default: LinkCost) -> tuple[LinkCost, LinkCost]:
    """The links at stage k's start and end boundaries (the other one where it has none)."""
    into = links[k - 1] if k > 0 else (links[0] if links else default)
    out = links[k] if k < len(links) else into
    return into, out


def _default_link(link: Links) -> LinkCost:
    """A link for a lone stage (it sends nothing, any will do)."""
    if isinstance(link, LinkCost):
        return link
    links = list(link)
    return links[0] if links else LinkCost(name="none", latency_s=0.0, bandwidth_Bps=1.0)


# ---------------------------------------------------------------------------------------------
# Costs of one stage
# ---------------------------------------------------------------------------------------------


def _boundary_send_s(
    blocks: Sequence[BlockCost],
    start: int,
    end: int,
    link: LinkCost,
    link_out: LinkCost | None = None,
    *,
    cross_in: bool = True,
    cross_out: bool = True,
) -> float:
    """Seconds a stage [start, end) spends on the messages of one microbatch in one direction.

    The boundary after block ``c - 1`` carries ``blocks[c - 1].cut_bytes`` per microbatch forward
    (activation) and the same size backward (its gradient); a rank receives at its start boundary
    (unless first, over ``link``) and sends at its end boundary (unless last, over ``link_out``,
    by default ``link``); a boundary inside one rank (``cross_in`` / ``cross_out`` False) sends nothing.
    """
    s = 0.0
    if start > 0 and cross_in:
        s += link.send_s(blocks[start - 1].cut_bytes)
    if end < len(blocks) and cross_out:
        s += (link_out or link).send_s(blocks[end - 1].cut_bytes)
    return s


def recompute_flags(recompute: Sequence[bool], n_stages: int) -> list[bool]:
    """Per-stage recompute flags, with the empty sequence meaning "no stage recomputes"."""
    return list(recompute) or [False] * n_stages


def compact_flags(flags: Sequence[bool]) -> tuple[bool, ...]:
    """The flags as plans store them: empty when no stage recomputes."""
    return tuple(flags) if any(flags) else ()


def recompute_cost(block: BlockCost) -> float:
    """Extra backward time of a block whose stage recomputes its activations.

    The profiler measures it (the forward again, up to the last tensor it saves: torch's checkpoint
    stops early there). When it is unknown (None: not measured) the block's whole forward is
    charged, the most a recomputation can cost.
    """
    return block.recompute_s if block.recompute_s is not None else block.fwd_s


def stage_time_parts(
    blocks: Sequence[BlockCost],
    start: int,
    end: int,
    link: LinkCost,
    recompute: bool = False,
    link_out: LinkCost | None = None,
    *,
    wait_in: bool = True,
    wait_out: bool = True,
) -> tuple[float, float, float]:
    """Forward, backward and per-direction message seconds of the stage ``blocks[start:end]``, per microbatch.

    The message time is paid once in forward (activations) and once in backward (their gradients,
    the same sizes). Activation checkpointing re-runs the stage's forward inside its backward
    (Chen et al. 2016), so a recomputing stage's backward includes ``recompute_cost``. A stage that
    waits for its activations starts its forward cold, and one that waits for their gradient its
    backward: ``cold_in`` and ``cold_out`` are added.

    Args:
        blocks: per-block costs in execution order.
        start: first block of the stage.
        end: one past its last block.
        link: cost of one message over the stage's start boundary (and its end one, unless ``link_out``).
        recompute: whether the stage recomputes its activations.
        link_out: cost of one message over its end boundary (None: ``link``).
        wait_in: the stage receives its activations from another rank (False: the stage before
            runs on the same rank, the turn of a V: nothing is sent or waited for).
        wait_out: the same for the gradients it receives from the stage after it.

    Returns:
        ``(fwd_s, bwd_s, comm_s)``, ``comm_s`` for one direction.
    """
    part = blocks[start:end]
    fwd = sum(b.fwd_s for b in part) + (cold_in(blocks, start) if wait_in else 0.0)
    bwd = sum(b.bwd_s for b in part) + (sum(recompute_cost(b) for b in part) if recompute else 0.0)
    bwd += cold_out(blocks, end) if wait_out else 0.0
    return fwd, bwd, _boundary_send_s(blocks, start, end, link, link_out, cross_in=wait_in, cross_out=wait_out)


def cold_in(blocks: Sequence[BlockCost], start: int) -> float:
    """Seconds the stage starting at block ``start`` loses to a cold start of its forward: its first
    block's ``fwd_cold_s`` after waiting for the activations it receives (none for the first stage,
    which waits for nothing; 0 when not measured)."""
    return (blocks[start].fwd_cold_s or 0.0) if start > 0 else 0.0


def cold_out(blocks: Sequence[BlockCost], end: int) -> float:
    """Seconds the stage ending before block ``end`` loses to a cold start of its backward: its last
    block's ``bwd_cold_s`` after waiting for the gradient it receives (none for the last stage,
    whose backward follows its own forward and loss; 0 when not measured)."""
    return (blocks[end - 1].bwd_cold_s or 0.0) if end < len(blocks) else 0.0


def _bounds(starts: Sequence[int], n: int) -> list[tuple[int, int]]:
    ends = list(starts[1:]) + [n]
    return list(zip(starts, ends))


def _check_starts(blocks: Sequence[BlockCost], starts: Sequence[int]) -> None:
    """Raise InfeasibleError unless ``starts`` is a valid partition of ``blocks`` on legal cuts."""
    n = len(blocks)
    if n == 0:
        raise InfeasibleError("blocks is empty; expected at least one block; profile a non-empty model.")
    if not starts or starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])) or starts[-1] >= n:
        raise InfeasibleError(
            f"starts={tuple(starts)} is invalid for {n} blocks; expected starts[0] == 0, strictly "
            f"increasing, all < {n}; give one start index per non-empty stage."
        )
    for c in starts[1:]:
        if not blocks[c - 1].cut_legal:
            raise InfeasibleError(
                f"a stage starts at block {c} ('{blocks[c].name}') but cutting after block "
                f"'{blocks[c - 1].name}' is not legal; expected cuts only after blocks with cut_legal; "
                "move the cut to a legal position."
            )


def stage_costs(
    blocks: Sequence[BlockCost],
    starts: Sequence[int],
    link: Links,
    recompute: Sequence[bool] = (),
    schedule: str | None = None,
    stages_per_rank: int | None = None,
) -> list[float]:
    """Seconds one microbatch occupies each stage: forward + backward + its messages both ways.

    The largest one bounds the pipeline's throughput (Narayanan et al. 2021, Eq. 1).

    Args:
        blocks: per-block costs in execution order.
        starts: first block of each stage (see ``Partition.starts``).
        link: cost of one message between neighbouring ranks, or per boundary (``boundary_links``).
        recompute: per stage, whether it recomputes activations; empty means no stage does.
        schedule: places the stages on ranks: which boundaries cross ranks (``boundary_crosses``)
            and where a ``NodeLinks``' stages run (None: one rank per stage, looped placement).
        stages_per_rank: stages on each rank (None: ``boundary_crosses``' default).

    Returns:
        One cost per stage.

    Raises:
        InfeasibleError: ``starts`` is not a valid partition on legal cuts.
    """
    _check_starts(blocks, starts)
    flags = recompute_flags(recompute, len(starts))
    links = boundary_links(link, len(starts), schedule)
    crosses = [True, *boundary_crosses(len(starts), schedule, stages_per_rank), True]  # padded: first and last
    costs = []
    for k, ((s, e), r) in enumerate(zip(_bounds(starts, len(blocks)), flags)):
        into, out = _around(links, k, _default_link(link))
        fwd, bwd, comm = stage_time_parts(blocks, s, e, into, r, out, wait_in=crosses[k], wait_out=crosses[k + 1])
        costs.append(fwd + bwd + comm + comm)
    return costs


def stage_memory_bytes(
    blocks: Sequence[BlockCost],
    start: int,
    end: int,
    in_flight: int,
    optimizer: OptimizerSpec,
    recompute: bool = False,
    n_microbatches: int = 1,
    shard: int = 1,
) -> int:
    """Peak memory of the stage holding ``blocks[start:end]``.

    Formula (bytes)::

        static   = 2 * P + optimizer.state_bytes(N, P)      # weights + grads, optimizer state
        buffers  = m * (cut_in + cut_out)                   # receive buffers, one per microbatch each way
        pipeline = in_flight * (A + out) + out              # saved activations and the cached stage
                                                            # output per live microbatch, + its gradient
        step     = T                                        # optimizer temporaries (after backward)
        peak     = static + buffers + max(pipeline, step)

    with ``P`` = sum of ``param_bytes``, ``N`` = sum of ``params``, ``A`` = sum of
    ``activation_bytes``, ``cut_in`` = ``blocks[start - 1].cut_bytes`` (0 for the first stage),
    ``cut_out`` = ``blocks[end - 1].cut_bytes`` (0 for the last stage), ``out`` = the stage's output
    per microbatch (``cut_out``; the model output ``output_bytes`` for the last stage), which
    torch's ``PipelineStage`` keeps until that microbatch's backward, ``m`` = ``n_microbatches``
    (``PipelineStage`` allocates its receive buffers per microbatch, up front). ``in_flight`` is the
    stage's peak number of microbatches with forward done and backward pending under the schedule
    (``planner.core.schedules.peak_in_flight``). Each term was checked against MemTracker's categories
    on CPU runs (docs/predict_vs_measured.md). ``T``, the step's temporaries, is measured when every
    block of the stage has ``opt_temp_bytes``: their maximum or their sum, by
    ``optimizer.step_temp_rule`` (a per-tensor optimizer holds one tensor's temporaries at a time, a
    foreach one all of them); else ``optimizer.step_temp_bytes(N)``.

    With ``recompute`` the stage keeps only its input per live microbatch and rebuilds one
    microbatch's activations at a time in backward: ``in_flight * A`` becomes
    ``in_flight * cut_in + A`` (activation checkpointing of the whole stage, Chen et al. 2016).

    Sharded over ``shard`` > 1 data-parallel replicas (FSDP2 ``fully_shard`` of the stage with
    ``reshard_after_forward=False``), each rank keeps a 1/shard share of the weights, gradients,
    optimizer state and step temporaries, and holds the whole stage's parameters and their
    gradients unsharded while the pipeline runs (gathered at the first forward, reduce-scattered
    and freed after the last backward, before the optimizer step)::

        static   = ceil((2 * P + optimizer.state_bytes(N, P)) / shard)
        pipeline = in_flight * (A + out) + out + 2 * P     # + the unsharded parameters and gradients
        step     = ceil(T / shard)

    DDP replicas (``shard`` 1) hold the whole stage, as one pipeline does: its gradient buckets are
    views of the gradients (``gradient_as_bucket_view=True``), no second copy.

    Args:
        blocks: per-block costs in execution order.
        start: first block of the stage.
        end: one past the stage's last block.
        in_flight: peak live microbatches on this stage.
        optimizer: the optimizer (decides the state bytes per parameter byte).
        recompute: whether the stage recomputes its activations in backward.
        n_microbatches: microbatches per step (receive buffers are per microbatch).
        shard: FSDP replicas the stage's state is sharded over (1: not sharded, DDP or one replica).

    Returns:
        The stage's memory estimate in bytes.

    Raises:
        InfeasibleError: an empty or out-of-range block range.
    """
    return stage_memory_parts(blocks, start, end, optimizer, recompute, n_microbatches, shard).peak(in_flight)


class MemoryParts(NamedTuple):
    """A stage's memory as the terms of ``stage_memory_bytes``, so that a rank running several stages
    can add them up (``planner.core.predict.rank_memory_bytes``).

    At ``t`` live microbatches the stage holds ``fixed + max(t * per_microbatch + once, step)``.
    """

    fixed: int  # static + buffers: weights, gradients, optimizer state (sharded: a share), receive buffers
    per_microbatch: int  # per live microbatch: saved activations (the input when recomputing) + cached output
    once: int  # the output's gradient (+ the one microbatch's activations a recomputing stage rebuilds;
    # + the unsharded parameters and gradients of a sharded stage)
    step: int  # optimizer temporaries (after backward)

    def peak(self, in_flight: int) -> int:
        """The stage's peak bytes with ``in_flight`` live microbatches."""
        return self.fixed + max(in_flight * self.per_microbatch + self.once, self.step)


def stage_memory_parts(
    blocks: Sequence[BlockCost],
    start: int,
    end: int,
    optimizer: OptimizerSpec,
    recompute: bool = False,
    n_microbatches: int = 1,
    shard: int = 1,
) -> MemoryParts:
    """The terms of ``stage_memory_bytes`` for the stage ``blocks[start:end]`` (see there).

    Raises:
        InfeasibleError: an empty or out-of-range block range.
    """
    n = len(blocks)
    if not 0 <= start < end <= n:
        raise InfeasibleError(
            f"block range [{start}, {end}) is invalid for {n} blocks; expected 0 <= start < end <= {n}."
        )
    part = blocks[start:end]
    p_bytes = sum(b.param_bytes for b in part)
    n_params = sum(b.params for b in part)
    a_bytes = sum(b.activation_bytes for b in part)
    cut_in = blocks[start - 1].cut_bytes if start > 0 else 0
    cut_out = blocks[end - 1].cut_bytes if end < n else 0
    out = cut_out if end < n else blocks[-1].output_bytes
    temps = [b.opt_temp_bytes for b in part]
    step_temp = optimizer.combine_step_temps([t for t in temps if t is not None]) if None not in temps else None
    return _parts(
        p_bytes, n_params, a_bytes, cut_in, cut_out, out, optimizer, recompute, n_microbatches, shard, step_temp
    )


def _ceil_div(x: Any, d: int) -> Any:
    """``ceil(x / d)`` in integers, for Python ints and integer numpy arrays alike (FSDP pads every
    parameter to a multiple of the shard count, so a share is rounded up)."""
    return -((-x) // d)


def _parts(
    p_bytes: int,
    n_params: int,
    a_bytes: int,
    cut_in: int,
    cut_out: int,
    out: int,
    optimizer: OptimizerSpec,
    recompute: bool,
    n_microbatches: int,
    shard: int = 1,
    step_temp: int | None = None,
) -> MemoryParts:
    """The formula of ``stage_memory_bytes`` on sums (shared with the solver's fast memory model);
    ``step_temp``: the stage's measured step temporaries (None: ``optimizer.step_temp_bytes``)."""
    step = optimizer.step_temp_bytes(n_params) if step_temp is None else step_temp
    if shard > 1:
        return MemoryParts(
            fixed=_ceil_div(2 * p_bytes + optimizer.state_bytes(n_params, p_bytes), shard)
            + n_microbatches * (cut_in + cut_out),
            per_microbatch=(cut_in + out) if recompute else (a_bytes + out),
            once=out + (a_bytes if recompute else 0) + 2 * p_bytes,
            step=_ceil_div(step, shard),
        )
    return MemoryParts(
        fixed=2 * p_bytes + optimizer.state_bytes(n_params, p_bytes) + n_microbatches * (cut_in + cut_out),
        per_microbatch=(cut_in + out) if recompute else (a_bytes + out),
        once=out + (a_bytes if recompute else 0),
        step=step,
    )


def stage_memories(
    blocks: Sequence[BlockCost],
    starts: Sequence[int],
    *,
    schedule: str,
    n_microbatches: int,
    optimizer: OptimizerSpec = DEFAULT_OPTIMIZER,
    recompute: Sequence[bool] = (),
) -> list[int]:
    """Memory estimate of every stage of a partition (see ``stage_memory_bytes``).

    Args:
        blocks: per-block costs in execution order.
        starts: first block of each stage.
        schedule: "gpipe" or "1f1b".
        n_microbatches: microbatches per step.
        optimizer: the optimizer.

    Returns:
        Bytes per stage.

    Raises:
        InfeasibleError: invalid ``starts`` or schedule request.
    """
    _check_starts(blocks, starts)
    infl = in_flight_per_stage(schedule, len(starts), n_microbatches)
    flags = recompute_flags(recompute, len(starts))
    return [
        stage_memory_bytes(blocks, s, e, infl[k], optimizer, flags[k], n_microbatches)
        for k, (s, e) in enumerate(_bounds(starts, len(blocks)))
    ]


def evaluate(
    blocks: Sequence[BlockCost],
    starts: Sequence[int],
    link: Links,
    recompute: Sequence[bool] = (),
    schedule: str | None = None,
    stages_per_rank: int | None = None,
) -> Partition:
    """The bottleneck of a given split (max of ``stage_costs``).

    Args:
        blocks: per-block costs in execution order.
        starts: first block of each stage.
        link: cost of one message between neighbouring ranks, or per boundary.
        recompute: per stage, whether it recomputes activations.
        schedule: places the stages on ranks (``stage_costs``; None: one rank per stage).
        stages_per_rank: stages on each rank (None: ``boundary_crosses``' default).

    Returns:
        The partition with its ``bottleneck_s`` (max stage cost, communication included).

    Raises:
        InfeasibleError: ``starts`` is not a valid partition on legal cuts.
    """
    costs = stage_costs(blocks, starts, link, recompute, schedule, stages_per_rank)
    return Partition(starts=tuple(starts), bottleneck_s=max(costs), recompute=compact_flags(recompute))


# ---------------------------------------------------------------------------------------------
# The exact partition search
# ---------------------------------------------------------------------------------------------

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]
BoolArray = NDArray[np.bool_]
# Memory arithmetic runs in int64, or in Python integers (dtype object) when a model's byte counts
# could overflow int64; the arrays of byte counts are typed loosely for that reason.
AnyIntArray = NDArray[Any]


def _tol(x: float) -> float:
    return _REL_EPS * max(1.0, abs(x))


def _legal_cuts(blocks: Sequence[BlockCost]) -> list[bool]:
    """``legal[c]``: a stage may start at block c, i.e. a cut after block c-1 is legal (1 <= c < n)."""
    n = len(blocks)
    return [False] + [blocks[c - 1].cut_legal for c in range(1, n)] + [False]


def _check_counts(blocks: Sequence[BlockCost], n_stages: int) -> None:
    n = len(blocks)
    if n == 0:
        raise InfeasibleError("blocks is empty; expected at least one block; profile a non-empty model.")
    if n_stages < 1:
        raise InfeasibleError(f"--gpus {n_stages}: need at least one stage; use --gpus 1 or more")
    if n_stages > n:
        raise InfeasibleError(
            f"--gpus {n_stages} is more than the model's {n} blocks (at most one stage per block); "
            f"use --gpus {n} or fewer, or split the model into finer blocks"
        )
    n_legal = sum(_legal_cuts(blocks))
    if n_legal < n_stages - 1:
        raise InfeasibleError(
            f"--gpus {n_stages} needs {n_stages - 1} cuts but the model has only {n_legal} legal cut "
            f"positions; use --gpus {n_legal + 1} or fewer, or make more block boundaries cuttable"
        )


class _StepTemps:
    """The measured optimizer-step temporaries of any block range in O(1) (``stage_memory_parts``'s
    ``T``): a prefix count of the blocks without ``opt_temp_bytes``, prefix sums for the "sum" rule
    and a sparse table of range maxima for "max" (``table[j][i]`` = max of blocks ``i .. i + 2^j - 1``).
    """

    def __init__(self, blocks: Sequence[BlockCost], optimizer: OptimizerSpec) -> None:
        self.rule = optimizer.step_temp_rule
        values = [b.opt_temp_bytes or 0 for b in blocks]
        self.pre_missing = [0]
        self.pre_sum = [0]
        for b, v in zip(blocks, values):
            self.pre_missing.append(self.pre_missing[-1] + (b.opt_temp_bytes is None))
            self.pre_sum.append(self.pre_sum[-1] + v)
        self.table = [values]
        while 2 ** len(self.table) <= len(values):
            row, half = self.table[-1], 2 ** (len(self.table) - 1)
            self.table.append([max(row[i], row[i + half]) for i in range(len(row) - half)])
        self.all_measured = self.pre_missing[-1] == 0
        self.none_measured = self.pre_missing[-1] == len(blocks)

    def of(self, s: int, e: int) -> int | None:
        """``T`` of the stage ``[s, e)`` (``s < e``): None when some block of it was not measured."""
        if self.pre_missing[e] != self.pre_missing[s]:
            return None
        if self.rule == "sum":
            return self.pre_sum[e] - self.pre_sum[s]
        j = (e - s).bit_length() - 1
        return max(self.table[j][s], self.table[j][e - (1 << j)])


class _MemoryModel:
    """Memory check of stage [s, e) at stage index k, in integer arithmetic from prefix sums."""

    def __init__(
        self,
        blocks: Sequence[BlockCost],
        optimizer: OptimizerSpec,
        limit: float,
        recompute: str = "never",
        n_microbatches: int = 1,
        shard: int = 1,
    ) -> None:
        n = len(blocks)
        self.n = n
        self.limit = limit
        self.recompute = recompute
        self.optimizer = optimizer
        self.m = n_microbatches
        self.shard = shard
        self.pre_p = [0]
        self.pre_n = [0]
        self.pre_a = [0]
        for b in blocks:
            self.pre_p.append(self.pre_p[-1] + b.param_bytes)
            self.pre_n.append(self.pre_n[-1] + b.params)
            self.pre_a.append(self.pre_a[-1] + b.activation_bytes)
        self.cut_in = [0] + [blocks[s - 1].cut_bytes for s in range(1, n)]
        self.cut_out = [0] + [blocks[e - 1].cut_bytes for e in range(1, n)] + [0]
        self.out = self.cut_out[:n] + [blocks[-1].output_bytes]
        self.temps = _StepTemps(blocks, optimizer)

    def bytes(self, s: int, e: int, in_flight: int, recompute: bool = False) -> int:
        # Same formula as stage_memory_bytes.
        return _parts(
            self.pre_p[e] - self.pre_p[s],
            self.pre_n[e] - self.pre_n[s],
            self.pre_a[e] - self.pre_a[s],
            self.cut_in[s],
            self.cut_out[e],
            self.out[e],
            self.optimizer,
            recompute,
            self.m,
            self.shard,
            self.temps.of(s, e),
        ).peak(in_flight)

    def choice(self, s: int, e: int, in_flight: int) -> bool | None:
        """Whether the stage recomputes (False: no, True: yes), or None when it cannot fit either way."""
        if self.recompute != "always" and self.bytes(s, e, in_flight) <= self.limit:
            return False
        if self.recompute != "never" and self.bytes(s, e, in_flight, True) <= self.limit:
            return True
        return None

    def fits(self, s: int, e: int, in_flight: int) -> bool:
        return self.choice(s, e, in_flight) is not None


def _last_true(starts: IntArray, n: int, ok: Callable[[IntArray, IntArray], BoolArray]) -> IntArray:
    """Per start ``s``, the largest ``e`` in ``[s, n]`` with ``ok(s, e)``, or ``s`` when there is none.

    ``ok(s, e)`` must be true up to some end and false after it (monotone in ``e``), so a binary
    search per start finds that end: O(log n) vectorised steps.
    """
    lo = starts.copy()
    hi = np.full_like(starts, n)
    while True:
        active = lo < hi
        if not active.any():
            return lo
        mid = (lo + hi + 1) // 2
        good = active & ok(starts, mid)
        lo = np.where(good, mid, lo)
        hi = np.where(active & ~good, mid - 1, hi)


def _pairs(starts: IntArray, first: IntArray, last: IntArray, end_ok: BoolArray) -> tuple[IntArray, IntArray]:
    """All stages ``[s, e)`` with ``s`` in ``starts``, ``first[s] <= e <= last[s]`` and ``end_ok[e]``, sorted by (s, e)."""
    counts = np.maximum(last - first + 1, 0)
    total = int(counts.sum())
    s = np.repeat(starts, counts)
    offset = np.repeat(np.cumsum(counts) - counts, counts)
    e = np.repeat(first, counts) + (np.arange(total, dtype=np.int64) - offset)
    keep = end_ok[e]
    return s[keep], e[keep]


def _band(
    n: int, p: int, starts: IntArray, last: IntArray, short: Callable[[int, int], bool]
) -> tuple[IntArray, IntArray]:
    """Where stage k of ``p`` can start: between ``back[p - k]`` and ``reach[k]``.

    ``reach[k]`` is the furthest block stage k can start at: stage k - 1 starts at most at
    ``reach[k - 1]`` and ends at most at the furthest window end (``last``) of such a start.
    ``back[j]`` is the earliest block from which j stages can cover the rest: ``short(s, e)`` must be
    necessary for a stage ``[s, e)`` to be a candidate and stay true when the stage shrinks, so the
    earliest start that can end at or after ``back[j - 1]`` is the earliest one that ends exactly
    there. Both over-approximate (they ignore illegal cuts and some costs), so no candidate of a
    complete partition falls outside; O(p log n).
    """
    reach = np.zeros(p + 1, dtype=np.int64)
    furthest = np.maximum.accumulate(last)
    for k in range(1, p + 1):
        i = int(np.searchsorted(starts, reach[k - 1], side="right")) - 1
        reach[k] = max(int(reach[k - 1]), int(furthest[i]))
    back = np.full(p + 1, n, dtype=np.int64)
    for j in range(1, p + 1):
        e = int(back[j - 1])
        lo, hi = 0, e  # the earliest s in [0, e] with short(s, e); e itself when even [e, e) fails
        while lo < hi:
            mid = (lo + hi) // 2
            if short(mid, e):
                hi = mid
            else:
                lo = mid + 1
        back[j] = lo
    return reach, back


def _banded_pairs(
    n: int, p: int, starts: IntArray, last: IntArray, end_ok: BoolArray, reach: IntArray, back: IntArray
) -> tuple[IntArray, IntArray]:
    """The stages ``[s, e)`` with ``e <= last[s]`` that some stage index k can hold: s in k's start
    range ``[back[p - k], reach[k]]``, e in stage k + 1's (or n for the last stage)."""
    # The stage indices that can start at s: from the first whose reach gets there to the last whose
    # back bound allows it (and at most s, one block per earlier stage; stage 0 only at block 0).
    k_first = np.searchsorted(reach[:p], starts, side="left")
    k_last = np.searchsorted(back[p:0:-1], starts, side="right") - 1
    k_last = np.minimum(k_last, starts)
    ok = k_first <= k_last
    starts, last, k_first, k_last = starts[ok], last[ok], k_first[ok], k_last[ok]
    first = np.maximum(starts + 1, back[p - 1 - k_first])
    last = np.minimum(last, n - (p - 1 - k_last))
    return _pairs(starts, first, last, end_ok)


class _Stages:
    """Candidate stages ``[s, e)`` of a partition search, sorted by (s, e), with their costs.

    Every stage that can be part of a partition the search cares about is listed; a stage not listed
    is one the search may ignore (it costs more than the cap, or cannot fit memory). A stage placed
    at stage index k holds ``t = in_flight[k]`` live microbatches and costs ``c0`` when it fits
    without recomputation (``t <= t0``), else ``c1`` when it fits with it (``t <= t1``), else inf:
    ``_MemoryModel.choice`` on arrays. Memory only grows with ``t``, so a stage's fit is one threshold
    on ``t``, computed once per stage rather than once per stage index.

    ``complete`` says the cost cap did not remove any stage that fits memory, so a search on this
    table is exact whatever the optimum is. Only stages that some stage index can hold are listed
    (see ``_band``), and each pass looks at stage k's band only.
    """

    def __init__(
        self,
        n: int,
        s: IntArray,
        e: IntArray,
        c0: FloatArray,
        c1: FloatArray,
        t0: IntArray,
        t1: IntArray,
        complete: bool,
        t_span: tuple[int, int],
        band: tuple[IntArray, IntArray],
        by_end: bool = False,
    ) -> None:
        self.n = n
        # c0, c1: one row per cost variant (the links around the stage, ``_Arrays.variant``)
        self.s, self.e, self.c0, self.c1, self.t0, self.t1 = s, e, c0, c1, t0, t1
        self.complete = complete
        self.t_span = t_span
        self.reach, self.back = band  # stage k starts in [back[p - k], reach[k]] (see _band)
        # seg: the first stage of each start (each end when sorted by end), for reduceat.
        per = np.bincount(e if by_end else s, minlength=n + 1)
        self.seg: IntArray = (np.cumsum(per) - per)[per > 0]
        # s_ptr[s]:s_ptr[s + 1] are the stages starting at s (s < n), when sorted by start.
        self.s_ptr: IntArray = np.concatenate(([0], np.cumsum(per)))
        # When the stage index cannot change a stage's option (no limit, or all in-flight counts
        # fit the same way), its cost is one array for every stage index.
        t_lo, t_hi = t_span
        self._fixed: FloatArray | None = None
        if not len(s) or int(t0.min()) >= t_hi:
            self._fixed = c0
        elif int(t0.max()) < t_lo and int(t1.min()) >= t_hi:
            self._fixed = c1
        self._cached: tuple[tuple[int, int], FloatArray] | None = None
        self._capped: tuple[tuple[int, int], FloatArray] | None = None

    def cost(self, t: int, v: int = 0, lo: int = 0, up: int | None = None) -> FloatArray:
        """Cost of stages ``lo:up`` in variant ``v`` when they hold ``t`` live microbatches (inf: they do not fit)."""
        if self._fixed is not None:
            return self._fixed[v, lo:up]
        if self._cached is not None and self._cached[0] == (t, v):
            return self._cached[1][lo:up]
        c0, c1, t0, t1 = self.c0[v, lo:up], self.c1[v, lo:up], self.t0[lo:up], self.t1[lo:up]
        out: FloatArray = np.where(t <= t0, c0, np.where(t <= t1, c1, math.inf))
        if lo == 0 and up is None:  # a whole row: GPipe asks for the same t at every stage index
            self._cached = ((t, v), out)
        return out

    def capped(self, t: int, v: int, thr: float) -> FloatArray:
        """``cost(t, v)`` with every stage costing more than ``thr`` set to inf (NaN stays NaN, as
        ``cost > thr`` is false for it in the reference)."""
        key = (-1 if self._fixed is not None else t, v)
        if self._capped is None or self._capped[0] != key:
            cost = self.cost(t, v)
            self._capped = (key, np.where(cost > thr, math.inf, cost))
        return self._capped[1]

    def allowed(self, t: int, lo: int, up: int) -> BoolArray:
        """Whether stages ``lo:up`` fit memory (either way) when they hold ``t`` live microbatches."""
        return (t <= self.t0[lo:up]) | (t <= self.t1[lo:up])

    def by_end(self) -> _Stages:
        """The same stages sorted by (e, s): the order the bottleneck pass groups them in."""
        # A stable sort of small integers is a radix sort in numpy: linear in the stage count.
        key = self.e.astype(np.uint16) if self.n < 2**16 else self.e
        order = np.argsort(key, kind="stable")
        if self._fixed is not None:  # only the cost matters, one gather instead of four
            cost = self._fixed[:, order]
            t_any = np.zeros(1, dtype=np.int64)
            band = (self.reach, self.back)
            return _Stages(
                self.n, self.s[order], self.e[order], cost, cost, t_any, t_any, self.complete, (0, 0), band, True
            )
        return _Stages(
            self.n,
            self.s[order],
            self.e[order],
            self.c0[:, order],
            self.c1[:, order],
            self.t0[order],
            self.t1[order],
            self.complete,
            self.t_span,
            (self.reach, self.back),
            True,
        )


def _bottleneck(stages: _Stages, n: int, p: int, in_flight: Sequence[int], variant: Sequence[int]) -> float:
    """Pass 1: the least bottleneck over partitions made of ``stages`` (inf: none).

    ``best[e]`` is the least bottleneck covering blocks ``[0, e)`` with stages 0..k; stage k's row is
    the minimum over its candidate stages ``[s, e)`` of ``max(best[s], cost)``, one vectorised pass
    over the candidates grouped by end. Stage k must leave a block for each later stage and only the
    last one ends at n, exactly as in the O(p n^2) programme.
    """
    inf = math.inf
    best = np.full(n + 1, inf)
    lo, up = 0, int(stages.s_ptr[1])  # the stages starting at block 0
    ends = stages.e[lo:up]
    first = stages.cost(in_flight[0], variant[0])[lo:up]
    keep = ends == n if p == 1 else ends <= n - (p - 1)
    best[ends[keep]] = first[keep]
    if p == 1:
        return float(best[n])
    # A NaN cost (an infinite recompute_s) never improves a later stage: the reference's `v < cur[e]`
    # is false for it. Only the row of stage 0 can hold one; later rows take minima that skip NaN.
    best[np.isnan(best)] = inf
    table = stages.by_end()
    reach, back = stages.reach, stages.back
    for k in range(1, p):
        cost = table.cost(in_flight[k], variant[k])
        # Stage k ends where stage k + 1 can start (n for the last): other rows cannot complete.
        e_lo, e_hi = (
            (n, n) if k == p - 1 else (max(k + 1, int(back[p - 1 - k])), min(int(reach[k + 1]), n - (p - 1 - k)))
        )
        lo, up = int(np.searchsorted(table.e, e_lo, side="left")), int(np.searchsorted(table.e, e_hi, side="right"))
        # max(best[s], cost) as the reference takes it: a NaN cost leaves best[s].
        v = np.fmax(cost[lo:up], best[table.s[lo:up]])
        cur = np.full(n + 1, inf)
        if up > lo:
            seg = table.seg[(table.seg >= lo) & (table.seg < up)]
            cur[table.e[seg]] = np.minimum.reduceat(v, seg - lo)
        if not np.isfinite(cur).any():
            return inf
        best = cur
    return float(best[n])


def _tie_break(
    stages: _Stages, n: int, p: int, in_flight: Sequence[int], variant: Sequence[int], thr: float, latest: bool
) -> tuple[int, ...]:
    """Pass 2 and reconstruction: among partitions with every stage cost <= ``thr``, the least sum of
    stage costs, then the lexicographically smallest starts (largest with ``latest``).

    ``suf[k][s]`` is the least sum covering ``[s, n)`` with stages k..p-1, computed right to left as
    ``cost + suf[k + 1][e]``, the same float additions in the same order as the O(p n^2) programme,
    so the reconstruction below, which takes the first end within the tie tolerance of the target,
    sees the same numbers and makes the same choices.
    """
    inf = math.inf
    suf = np.full((p + 1, n + 1), inf)
    suf[p, n] = 0.0
    s_all, e_all = stages.s, stages.e
    for k in range(p - 1, -1, -1):
        # Only starts stage k can have: the reconstruction never reads another row, and no end it
        # reads lies beyond the next stage's reach.
        s_lo, s_hi = (0, 0) if k == 0 else (max(k, int(stages.back[p - k])), min(int(stages.reach[k]), n - (p - k)))
        if s_hi < s_lo:
            continue
        lo, up = int(stages.s_ptr[s_lo]), int(stages.s_ptr[s_hi + 1])
        if up <= lo:
            continue
        # The reference skips an end with suf[k + 1][e] == inf or a cost above thr; both give an inf
        # sum here (inf + x, x + inf), which never wins either. Ends that leave too few blocks for the
        # later stages have suf[k + 1][e] == inf, so they need no test of their own.
        v = stages.capped(in_flight[k], variant[k], thr)[lo:up] + suf[k + 1][e_all[lo:up]]
        seg = stages.seg[(stages.seg >= lo) & (stages.seg < up)]
        mins = np.fmin.reduceat(v, seg - lo)  # NaN sums never win (the reference's `v < m`)
        mins[np.isnan(mins)] = inf
        suf[k, s_all[seg]] = mins
    starts = [0]
    s = 0
    for k in range(p - 1):
        target = float(suf[k, s])
        bound = target + _tol(target)
        lo, up = int(stages.s_ptr[s]), int(stages.s_ptr[s + 1])
        t = in_flight[k]
        ends = e_all[lo:up]
        cost = stages.cost(t, variant[k], lo, up)
        nxt = suf[k + 1][ends]
        ok = (nxt != inf) & (ends <= n - (p - 1 - k)) & ~(cost > thr) & stages.allowed(t, lo, up)
        ok &= cost + nxt <= bound
        hits = np.flatnonzero(ok)
        if not len(hits):  # pragma: no cover - pass 2 guarantees a continuation exists
            raise RuntimeError("partition DP reconstruction failed (planner bug)")
        s = int(ends[hits[-1] if latest else hits[0]])
        starts.append(s)
    return tuple(starts)


def _exact_partition(
    n: int,
    p: int,
    in_flight: Sequence[int],
    candidates: Callable[[float], _Stages],
    first_cap: float,
    latest: bool = False,
    variant: Sequence[int] | None = None,
) -> tuple[int, ...] | None:
    """Exact partition of ``n`` items into ``p`` contiguous non-empty stages on candidate stages.

    Minimises the max stage cost; among partitions within ``_REL_EPS`` of that optimum, minimises the
    sum of stage costs; among those, returns the lexicographically smallest starts (largest with
    ``latest``): the O(p n^2) dynamic programme's answer, computed on candidates only.

    ``candidates(cap)`` lists every stage whose cost can be <= ``cap`` and that fits memory (a
    superset is fine). Pass 1 runs on the candidates under a guessed cap: if the best bottleneck it
    finds is within the cap, every stage of every better partition was a candidate, so it is the
    optimum; otherwise that bottleneck (a real partition's, so an upper bound on the optimum)
    becomes the cap, or the cap doubles when no partition was found, until the candidates are all
    stages that fit (``complete``), where infeasibility is exact. Pass 2 then needs only the stages
    within the optimum plus the tolerance. Each pass is O(p x candidates) vectorised work.

    Args:
        n: number of items.
        p: number of stages.
        in_flight: live microbatches of each stage index (decides how a stage fits memory).
        candidates: the candidate stages under a cap on the stage cost (``math.inf``: no cap).
        first_cap: the first cap to try (any value; a good guess saves a pass).
        latest: pick the lexicographically largest starts instead (earlier stages as full as possible).
        variant: the cost row of each stage index (None: row 0 for all).

    Returns:
        The starts, or None when no partition fits.
    """
    rows = list(variant) if variant is not None else [0] * p
    cap = first_cap
    while True:
        stages = candidates(cap)
        opt = _bottleneck(stages, n, p, in_flight, rows)
        if opt <= cap or stages.complete:
            break
        if opt < math.inf:
            cap = opt  # a real partition's bottleneck: the next pass is exact
        else:
            cap = 2 * cap if 0 < cap < math.inf else math.inf
    if opt == math.inf:
        return None
    thr = opt + _tol(opt)
    return _tie_break(candidates(thr), n, p, in_flight, rows, thr, latest)


class _Arrays:
    """The stage costs and memory of one ``solve`` request as arrays over block boundaries.

    Costs are built exactly as a stage-by-stage evaluation builds them (prefix sums accumulated in
    Python in block order; per stage ``((pre[e] - pre[s]) + send_in[s]) + send_out[e]``, plus
    ``pre_r[e] - pre_r[s]`` when it recomputes), so the vectorised search compares the same floats.

    With a link per boundary, ``send_in`` and ``send_out`` have one row per distinct link, and stage
    index k costs ``variant[k]``'s row of the candidate costs: the pair (link into stage k, link out
    of it). One link gives one row, the arrays of the single-link search. A boundary inside one rank
    (``crosses`` False: a V's turn) has a row of its own, of zeros: no message, no cold start.
    """

    def __init__(
        self,
        blocks: Sequence[BlockCost],
        link: Links,
        mem: _MemoryModel,
        mode: str,
        in_flight: Sequence[int],
        crosses: Sequence[bool] | None = None,
    ) -> None:
        n = len(blocks)
        self.n = n
        self.mode = mode
        self.mem = mem
        pre = [0.0]
        pre_r = [0.0]
        for b in blocks:
            pre.append(pre[-1] + b.fwd_s + b.bwd_s)
            pre_r.append(pre_r[-1] + recompute_cost(b))
        self.p = len(in_flight)
        links = boundary_links(link, self.p)
        distinct: list[LinkCost] = []
        for one in links or [_default_link(link)]:
            if one not in distinct:
                distinct.append(one)
        within = len(distinct)  # the row of a boundary inside one rank
        crossing = list(crosses) if crosses is not None else [True] * len(links)
        ids = [distinct.index(one) if c else within for one, c in zip(links, crossing, strict=True)]
        pairs = [(ids[k - 1] if k else (ids[0] if ids else 0), ids[k] if k < len(ids) else 0) for k in range(self.p)]
        pairs = [(a, a if k == self.p - 1 else b) for k, (a, b) in enumerate(pairs)]  # the last stage sends nothing
        self.pairs = list(dict.fromkeys(pairs))
        self.variant = [self.pairs.index(pair) for pair in pairs]
        # comm_fwd + comm_bwd = 2 * (send in + send out); a boundary's receiver also starts cold
        send_in = [
            [0.0] + [2 * one.send_s(blocks[s - 1].cut_bytes) + cold_in(blocks, s) for s in range(1, n)]
            for one in distinct
        ]
        send_out = [
            [0.0] + [2 * one.send_s(blocks[e - 1].cut_bytes) + cold_out(blocks, e) for e in range(1, n)] + [0.0]
            for one in distinct
        ]
        if within in ids:
            send_in.append([0.0] * n)
            send_out.append([0.0] * (n + 1))
        self.pre_list = pre
        self.pre = np.array(pre)
        self.pre_r = np.array(pre_r)
        self.send_in = np.array(send_in)
        self.send_out = np.array(send_out)
        self.send_in_min = self.send_in.min(axis=0)  # the cheapest link: bounds every stage index's cost
        # An infinite latency or recompute_s makes some costs inf or NaN, which the cost windows
        # cannot bound; such inputs search every stage that fits (still exact, just slower).
        self.finite = bool(
            np.isfinite(self.pre).all()
            and np.isfinite(self.send_in).all()
            and np.isfinite(self.send_out).all()
            and (mode == "never" or np.isfinite(self.pre_r).all())
        )
        legal = _legal_cuts(blocks)
        self.starts: IntArray = np.array([0] + [c for c in range(1, n) if legal[c]], dtype=np.int64)
        self.end_ok: BoolArray = np.array(legal[:n] + [True])
        self.t_span = (min(in_flight), max(in_flight))
        self.free = mem.limit == math.inf
        self._last_fit: dict[int, IntArray] = {}
        # "Fits at every in-flight count asked for"; no schedule holds more than its m microbatches.
        self.big = 0
        self.widen(max(*in_flight, mem.m))

    def widen(self, t: int) -> None:
        """Make the fit thresholds tell counts up to ``t`` apart (the error path asks other stage counts)."""
        if t < self.big:
            return
        self.big = t + 1
        self._last_fit.clear()
        if not self.free:
            self._memory_arrays(self.mem)

    def _memory_arrays(self, mem: _MemoryModel) -> None:
        n = self.n
        pre_p, pre_n, pre_a = mem.pre_p[n], mem.pre_n[n], mem.pre_a[n]
        cmax = max([0, *mem.cut_in, *mem.cut_out, *mem.out])
        # Every byte count the fit test forms stays below this (generous) bound, in magnitude.
        temps = mem.temps
        static = 2 * pre_p + 16 * pre_n + temps.pre_sum[n]  # weights, grads, state, step temporaries
        bound = 4 * (static + 2 * (mem.m + 1) * cmax + (self.big + 1) * (pre_a + 2 * cmax)) + 16
        dtype: Any = np.int64 if bound < 2**62 else object
        self.pre_p = np.array(mem.pre_p, dtype=dtype)
        self.pre_n = np.array(mem.pre_n, dtype=dtype)
        self.pre_a = np.array(mem.pre_a, dtype=dtype)
        self.cut_in = np.array(mem.cut_in, dtype=dtype)
        self.cut_out = np.array(mem.cut_out, dtype=dtype)
        self.out = np.array(mem.out, dtype=dtype)
        # the measured step temporaries (_StepTemps as arrays)
        self.temp_rule = temps.rule
        self.temps_all, self.temps_none = temps.all_measured, temps.none_measured
        self.pre_missing = np.array(temps.pre_missing, dtype=np.int64)
        self.pre_temp = np.array(temps.pre_sum, dtype=dtype)
        self.temp_table = [np.array(row, dtype=dtype) for row in temps.table]
        self.log2 = np.array([0, 0] + [k.bit_length() - 1 for k in range(2, n + 1)], dtype=np.int64)
        # A limit above every possible byte count fits the same as that bound; one below zero fits
        # nothing, like -1. Clamping keeps the arithmetic in range.
        self.limit = max(-1, min(math.floor(mem.limit), bound))
        self.adamw = mem.optimizer.name == "adamw"

    def _measured_temps(self, s: IntArray, e: IntArray) -> AnyIntArray:
        """Per stage ``[s, e)``, ``_StepTemps.of`` with the unmeasured blocks counted as 0 (0 when ``e <= s``)."""
        if self.temp_rule == "sum":
            total: AnyIntArray = self.pre_temp[e] - self.pre_temp[s]
            return total
        length = np.maximum(e - s, 1)
        j = self.log2[length]
        most = 0 * self.pre_temp[s]
        for level in np.unique(j).tolist():  # at most log2(n) + 1 levels
            row = self.temp_table[level]
            at = j == level
            lo, hi = s[at], np.maximum(e[at] - (1 << level), 0)
            most[at] = np.maximum(row[np.minimum(lo, len(row) - 1)], row[np.minimum(hi, len(row) - 1)])
        out: AnyIntArray = np.where(e > s, most, 0 * most)
        return out

    def _step_temps(self, s: IntArray, e: IntArray, n_p: AnyIntArray) -> AnyIntArray:
        """Per stage, ``T`` of ``stage_memory_parts``: measured where all its blocks were, else the fallback."""
        fallback = 8 * n_p if self.adamw else 0 * n_p
        if self.temps_none:
            return fallback
        step: AnyIntArray = np.where(self.pre_missing[e] == self.pre_missing[s], self._measured_temps(s, e), fallback)
        return step

    def _step_floor(self, s: IntArray, e: IntArray, n_p: AnyIntArray) -> AnyIntArray:
        """A lower bound of ``_step_temps`` that never decreases as ``e`` grows: exact when every
        block or none was measured; with some measured, the smaller of the two (each grows with ``e``)."""
        fallback = 8 * n_p if self.adamw else 0 * n_p
        if self.temps_none:
            return fallback
        measured = self._measured_temps(s, e)
        if self.temps_all:
            return measured
        floor: AnyIntArray = np.minimum(measured, fallback)
        return floor

    def _fit_bound(self, s: IntArray, e: IntArray, t: int) -> AnyIntArray:
        """A lower bound of the stage's bytes at ``t`` or more live microbatches, either way it can
        run, that never decreases as the stage grows (``e`` up): ``_parts`` without the optimizer's
        fp32 master copy and the outgoing boundary's terms (the parts that can shrink)."""
        p_b = self.pre_p[e] - self.pre_p[s]
        n_p = self.pre_n[e] - self.pre_n[s]
        a_b = self.pre_a[e] - self.pre_a[s]
        cin = self.cut_in[s]
        per_param = 8 * n_p if self.adamw else 0 * n_p
        step = self._step_floor(s, e, n_p)
        plain = t * a_b
        rebuilt = t * cin + a_b
        if self.mode == "never":
            pipeline = plain
        elif self.mode == "always":
            pipeline = rebuilt
        else:
            pipeline = np.minimum(plain, rebuilt)
        d = self.mem.shard
        if d > 1:  # the sharded state (rounded down: still a lower bound) and the unsharded copies
            sharded: AnyIntArray = (2 * p_b + per_param) // d + self.mem.m * cin
            bound: AnyIntArray = sharded + np.maximum(pipeline + 2 * p_b, step // d)
            return bound
        out: AnyIntArray = 2 * p_b + per_param + self.mem.m * cin + np.maximum(pipeline, step)
        return out

    def last_fit(self, t_floor: int) -> IntArray:
        """Per candidate start, the last end whose stage may fit memory at ``t_floor`` or more live microbatches."""
        if self.free:
            return np.full_like(self.starts, self.n)
        if t_floor not in self._last_fit:
            self._last_fit[t_floor] = _last_true(
                self.starts, self.n, lambda s, e: np.asarray(self._fit_bound(s, e, t_floor) <= self.limit, dtype=bool)
            )
        return self._last_fit[t_floor]

    def fit_limits(self, s: IntArray, e: IntArray) -> tuple[IntArray, IntArray]:
        """The most live microbatches at which each stage fits without (``t0``) and with (``t1``)
        recomputation, -1 when it does not fit even with none, ``big`` when it always fits; -1 for an
        option the recompute mode rules out.

        ``MemoryParts.peak`` is ``K + max(t * X + Y, step)``: they fit ``limit`` iff ``K + step`` and
        ``K + Y`` do and ``t <= (limit - K - Y) // X``.
        """
        no = np.full(len(s), -1, dtype=np.int64)
        if self.free:
            yes = np.full(len(s), self.big, dtype=np.int64)
            return (yes if self.mode != "always" else no), (yes if self.mode != "never" else no)
        p_b = self.pre_p[e] - self.pre_p[s]
        n_p = self.pre_n[e] - self.pre_n[s]
        a_b = self.pre_a[e] - self.pre_a[s]
        cin, cout, out = self.cut_in[s], self.cut_out[e], self.out[e]
        # Mirrors OptimizerSpec.state_bytes / step_temp_bytes on arrays (test_solve checks the two agree):
        # an fp32 master copy when the parameters are narrower than fp32, AdamW's two moments and
        # its step temporaries (measured, or two per parameter).
        master = np.where(p_b < 4 * n_p, 4 * n_p, 0 * n_p)
        moments = 8 * n_p if self.adamw else 0 * n_p
        step = self._step_temps(s, e, n_p)
        static = 2 * p_b + master + moments
        unsharded = 0 * p_b
        d = self.mem.shard
        if d > 1:  # _parts with shard: a share of the static bytes and step, the whole stage while it runs
            static, step, unsharded = _ceil_div(static, d), _ceil_div(step, d), 2 * p_b
        head = self.limit - (static + self.mem.m * (cin + cout))
        limits = []
        for option, (x, y) in (
            ("never", (a_b + out, out + unsharded)),
            ("always", (cin + out, a_b + out + unsharded)),
        ):
            if self.mode not in (option, "auto"):
                limits.append(no)
                continue
            fits_alone = (y <= head) & (step <= head)
            most = np.minimum((head - y) // np.maximum(x, 1), self.big)
            t_max = np.where(fits_alone, np.where(x > 0, most, self.big), -1)
            limits.append(np.asarray(t_max).astype(np.int64))
        return limits[0], limits[1]

    def candidates(self, cap: float) -> _Stages:
        """Every stage that fits memory at some asked-for in-flight count and may cost <= ``cap``."""
        n = self.n
        cap = cap if self.finite else math.inf
        last_fit = self.last_fit(self.t_span[0])
        if cap == math.inf:
            last_cheap = np.full_like(self.starts, n)
        else:
            # The cost without its per-end message and recomputation never decreases with e.
            last_cheap = _last_true(
                self.starts, n, lambda s, e: ((self.pre[e] - self.pre[s]) + self.send_in_min[s]) <= cap
            )
        last = np.minimum(last_fit, last_cheap)
        pre = self.pre_list

        def short(s: int, e: int) -> bool:  # necessary for cost <= cap, and kept when the stage shrinks
            return cap == math.inf or (pre[e] - pre[s]) <= cap

        band = _band(n, self.p, self.starts, last, short)
        s, e = _banded_pairs(n, self.p, self.starts, last, self.end_ok, *band)
        with np.errstate(invalid="ignore"):  # inf - inf of an infinite recompute_s: NaN, as the reference gets
            base = self.pre[e] - self.pre[s]
            c0 = np.stack([(base + self.send_in[a][s]) + self.send_out[b][e] for a, b in self.pairs])
            c1 = c0 + (self.pre_r[e] - self.pre_r[s]) if self.mode != "never" else c0
        t0, t1 = self.fit_limits(s, e)
        complete = bool((last_cheap >= last_fit).all())
        return _Stages(n, s, e, c0, c1, t0, t1, complete, self.t_span, band)


class _FitSearch:
    """Whether some split into q stages fits memory, for many q (the infeasible-limit error path).

    Reachability from the right: ``layers[j]`` marks the starts from which the blocks to the end
    split into j + 1 stages that all fit, stage q-1-j holding ``in_flight[q-1-j]`` microbatches.
    Counting from the right, GPipe's and 1F1B's counts do not depend on q (m everywhere; min(m, j+1)),
    so the layers of one q are the first layers of the next and each q costs one more layer.
    """

    def __init__(self, arrays: _Arrays, t_floor: int) -> None:
        self.t_floor = t_floor
        self.n = arrays.n
        s, e = _pairs(arrays.starts, arrays.starts + 1, arrays.last_fit(t_floor), arrays.end_ok)
        t0, t1 = arrays.fit_limits(s, e)
        self.s, self.e, self.most = s, e, np.maximum(t0, t1)
        self.to_end = e == arrays.n
        self.rev: list[int] = []
        self.layers: list[BoolArray] = []

    def _extend(self, t: int) -> None:
        prev = self.layers[-1] if self.layers else None
        if prev is not None and not prev.any():
            layer = prev  # nothing reaches the end with fewer stages, so nothing does with more
        else:
            ok = (self.most >= t) & (self.to_end if prev is None else prev[self.e])
            layer = np.zeros(self.n + 1, dtype=bool)
            layer[self.s[ok]] = True
        self.layers.append(layer)
        self.rev.append(t)

    def fits(self, in_flight: Sequence[int]) -> bool:
        """Whether some split into ``len(in_flight)`` stages fits (``_any_fit`` of the O(p n^2) solver)."""
        rev = list(reversed(in_flight))
        same = 0
        while same < min(len(rev), len(self.rev)) and rev[same] == self.rev[same]:
            same += 1
        if same < len(rev):
            del self.layers[same:]
            del self.rev[same:]
            for t in rev[same:]:
                self._extend(t)
        return bool(self.layers[len(rev) - 1][0])


def _memory_error(
    blocks: Sequence[BlockCost],
    n_stages: int,
    schedule: str,
    n_microbatches: int,
    mem: _MemoryModel,
    arrays: _Arrays,
    in_flight: Sequence[int] | None = None,
) -> InfeasibleError:
    """Build the error for a memory limit nothing fits, naming the smallest stage count that would.

    With ``in_flight`` given (the caller's own counts, so other stage counts mean nothing here) it
    skips that search and names a block that cannot fit alone.
    """
    n = len(blocks)
    n_legal = sum(_legal_cuts(blocks))
    limit = mem.limit
    skipped_1f1b = False
    q_hi = min(n, n_legal + 1)
    if in_flight is None:
        counts = range(n_stages + 1, q_hi + 1)
        if schedule == "1f1b":
            # torch's Schedule1F1B needs n_microbatches >= n_stages
            skipped_1f1b = len(counts) > 0 and q_hi > n_microbatches
            counts = range(n_stages + 1, min(q_hi, n_microbatches) + 1)
        # GPipe keeps all m microbatches on every stage, 1F1B min(m, q - i) on stage i of q
        # (in_flight_per_stage). Counted from the last stage neither depends on q, so one sweep from
        # the right tells which counts can fit, sparing the schedule of every count that cannot; the
        # count it names is then checked with the schedule's own numbers. Other schedules are asked
        # for every count.
        from_end: Callable[[int], int] | None = {
            "gpipe": lambda j: n_microbatches,
            "1f1b": lambda j: min(n_microbatches, j + 1),
        }.get(schedule)
        search = _FitSearch(arrays, 1 if from_end is None else from_end(0)) if len(counts) else None
        maybe: list[bool] = []
        if from_end is not None and search is not None:
            search.fits([from_end(j) for j in reversed(range(counts[-1]))])
            maybe = [bool(layer[0]) for layer in search.layers]
        for q in counts:
            if from_end is not None and not maybe[q - 1]:
                continue
            infl = in_flight_per_stage(schedule, q, n_microbatches)
            assert search is not None  # built whenever there is a count to try
            if max(infl) >= arrays.big or min(infl) < search.t_floor:
                arrays.widen(max(infl))
                search = _FitSearch(arrays, min(search.t_floor, *infl))
            if search.fits(infl):
                return InfeasibleError(
                    f"--memory-limit {_gib(limit)} is too small for {n_stages} stages: no split fits; "
                    f"the smallest stage count that fits is {q}: use --gpus {q} or raise --memory-limit"
                )
    # Even the finest splits fail: name a block that cannot fit on its own with the fewest live
    # microbatches its stage can have. GPipe holds m everywhere; under 1F1B the last stage holds 1,
    # but block 0 is always on stage 0, which holds min(m, p) >= min(m, n_stages) (Narayanan 2021).
    # With given counts, block j can only be on stages max(0, j - (n - p)) .. min(j, p - 1).
    for j in range(n):
        if in_flight is not None:
            min_live = min(in_flight[max(0, j - (n - n_stages)) : min(j, n_stages - 1) + 1])
        elif schedule == "gpipe":
            min_live = n_microbatches
        else:
            min_live = min(n_microbatches, n_stages) if j == 0 else 1
        need = mem.bytes(j, j + 1, min_live)
        if need > limit:
            return InfeasibleError(
                f"block '{blocks[j].name}' alone needs {need} bytes ({_gib(need)}: params, grads, optimizer "
                f"state, {min_live} microbatch(es) of activations and boundary buffers) but --memory-limit is "
                f"{_gib(limit)}; raise --memory-limit, use a lighter --optimizer or smaller microbatches (more -m)"
            )
    if in_flight is not None:
        return InfeasibleError(
            f"--memory-limit {_gib(limit)} is too small: no split into {n_stages} stages fits with "
            f"{list(in_flight)} microbatches in flight per stage; raise --memory-limit, use more stages or "
            "make more block boundaries cuttable"
        )
    more = " (1F1B also needs at least one microbatch per stage: raise -m)" if skipped_1f1b else ""
    return InfeasibleError(
        f"--memory-limit {_gib(limit)} is too small: no split into {n_stages} to {min(n, n_legal + 1)} "
        f"stages fits{more}; raise --memory-limit or make more block boundaries cuttable"
    )


def _gib(nbytes: float) -> str:
    """Bytes as the GiB figure ``--memory-limit`` takes."""
    return f"{nbytes / 2**30:.3g} GiB"


def _check_in_flight(in_flight: Sequence[int], n_stages: int, n_microbatches: int) -> list[int]:
    counts = [int(x) for x in in_flight]
    if len(counts) != n_stages:
        raise InfeasibleError(
            f"in_flight has {len(counts)} entries for {n_stages} stages; expected one peak in-flight "
            "microbatch count per stage (planner.core.schedules.in_flight_per_stage gives them)."
        )
    if any(c < 0 or c != x for c, x in zip(counts, in_flight)):
        raise InfeasibleError(
            f"in_flight={list(in_flight)} is invalid; expected whole numbers >= 0 (live microbatches per stage)."
        )
    if n_microbatches < 1:
        raise InfeasibleError(f"--microbatches {n_microbatches}: need at least one microbatch; use -m 1 or more")
    return counts


def solve(
    blocks: Sequence[BlockCost],
    n_stages: int,
    link: Links,
    *,
    schedule: str = "1f1b",
    n_microbatches: int,
    optimizer: OptimizerSpec = DEFAULT_OPTIMIZER,
    memory_limit_bytes: int | None = None,
    recompute: str = "auto",
    in_flight: Sequence[int] | None = None,
    shard: int = 1,
    stages_per_rank: int | None = None,
) -> Partition:
    """The partition with the smallest bottleneck stage cost (exact).

    Minimises max stage cost over all contiguous partitions into exactly ``n_stages`` non-empty
    stages on legal cuts, with every stage's ``stage_memory_bytes`` (using the peak in-flight count
    of that stage index under ``schedule``, or ``in_flight``) at most ``memory_limit_bytes`` when
    given. Ties (within a relative 1e-9) go to the least total stage cost (less communication), then
    to the lexicographically smallest starts.

    The search is the O(p n^2) dynamic programme restricted to candidate stages (those whose cost
    and memory lower bounds allow them under the optimum) and vectorised; see ``_exact_partition``
    for why that returns the very same partition. About O(p n w) for w candidate ends per start.

    Args:
        blocks: per-block costs in execution order.
        n_stages: number of pipeline stages.
        link: cost of one message between neighbouring ranks: one for all, one per boundary, or a
            ``NodeLinks`` (``boundary_links``).
        schedule: "gpipe" or "1f1b"; decides the in-flight microbatches per stage (unless
            ``in_flight`` is given); any schedule places the stages on ranks: where a ``NodeLinks``'
            stages run and which boundaries stay inside one rank.
        n_microbatches: microbatches per step.
        optimizer: the optimizer (state bytes per parameter byte).
        memory_limit_bytes: per-stage memory limit, or None for no limit.
        recompute: activation checkpointing per stage: "never", "always", or "auto" — a stage
            recomputes only when it would not fit the memory limit otherwise (it then pays its
            forward once more in backward). The choice is part of the exact search: each stage's
            cost is the cheaper option that fits.
        in_flight: peak live microbatches of each stage (one per stage), replacing the counts
            derived from ``schedule`` (for schedules with several stages per rank, whose counts
            ``planner.core.schedules.in_flight_per_stage`` gives per global stage).
        shard: FSDP replicas every stage's state is sharded over (``stage_memory_bytes``; 1: none).
        stages_per_rank: stages on each rank, which with ``schedule`` says which boundaries join
            two ranks and pay a message and a cold start (``boundary_crosses``; None: its default).

    Returns:
        The optimal partition (with its per-stage recompute flags).

    Raises:
        InfeasibleError: n_stages > number of blocks, too few legal cuts, a schedule request torch
            refuses, ``in_flight`` of the wrong length or with negative counts (or with fewer than
            one microbatch), or no partition fits the memory limit (the message names the smallest stage count that would fit, or the
            block that cannot fit alone).
    """
    if recompute not in ("never", "auto", "always"):
        raise InfeasibleError(f"recompute={recompute!r}; expected 'never', 'auto' or 'always'")
    _check_counts(blocks, n_stages)
    if in_flight is None:
        infl = in_flight_per_stage(schedule, n_stages, n_microbatches)
    else:
        infl = _check_in_flight(in_flight, n_stages, n_microbatches)
    n = len(blocks)
    limit = memory_limit_bytes if memory_limit_bytes is not None else math.inf
    # Without a limit "auto" never needs to recompute.
    mode = recompute if memory_limit_bytes is not None or recompute == "always" else "never"
    mem = _MemoryModel(blocks, optimizer, limit, mode, n_microbatches, shard)
    crosses = boundary_crosses(n_stages, schedule, stages_per_rank)
    arrays = _Arrays(blocks, boundary_links(link, n_stages, schedule), mem, mode, infl, crosses)
    # First cap: the average stage plus the largest block and messages, about where the optimum is
    # when memory does not bind (any value is correct; a close one saves a pass).
    with_r = mode == "always"
    with np.errstate(invalid="ignore"):  # non-finite inputs search without a cap anyway
        total = float(arrays.pre[n] + (arrays.pre_r[n] if with_r else 0.0))
        largest = float(np.max(np.diff(arrays.pre) + (np.diff(arrays.pre_r) if with_r else 0.0)))
        first_cap = total / n_stages + largest + float(np.max(arrays.send_in) + np.max(arrays.send_out))
    starts = _exact_partition(n, n_stages, infl, arrays.candidates, first_cap, variant=arrays.variant)
    if starts is None:
        given = None if in_flight is None else infl
        raise _memory_error(blocks, n_stages, schedule, n_microbatches, mem, arrays, given)
    bounds = _bounds(starts, n)
    flags = [bool(mem.choice(s, e, infl[k])) for k, (s, e) in enumerate(bounds)]
    return evaluate(blocks, starts, link, flags, schedule, stages_per_rank)


# ---------------------------------------------------------------------------------------------
# Baselines
# ---------------------------------------------------------------------------------------------


def uniform_layers(blocks: Sequence[BlockCost], n_stages: int, link: LinkCost) -> Partition:
    """Equal numbers of layers per stage: the torchtitan / Megatron default split.

    The ``is_layer`` blocks are dealt out in order, ``L // p`` per stage and one extra to each of the
    first ``L % p`` stages (torchtitan gives the remainder to the earliest stages). Non-layer blocks
    before the first layer join stage 0, those after the last layer join the last stage, and those
    between layers stay with the preceding layer, so stage k > 0 starts exactly at its first layer.
    If that start is not a legal cut, it moves to the nearest legal start that keeps the stages
    non-empty and increasing (the earlier one on a tie).

    Args:
        blocks: per-block costs in execution order.
        n_stages: number of stages p.
        link: cost of one message between neighbouring ranks.

    Returns:
        The split with its bottleneck evaluated on the real stage costs (communication included).

    Raises:
        InfeasibleError: fewer layers than stages, too few blocks or legal cuts.
    """
    _check_counts(blocks, n_stages)
    n = len(blocks)
    layers = [i for i, b in enumerate(blocks) if b.is_layer]
    if len(layers) < n_stages:
        raise InfeasibleError(
            f"the model has {len(layers)} layer blocks but --gpus is {n_stages}; expected at least one "
            "layer per stage for an equal-layer split; use fewer stages."
        )
    per, extra = divmod(len(layers), n_stages)
    legal = _legal_cuts(blocks)
    starts = [0]
    first_layer = 0
    for k in range(1, n_stages):
        first_layer += per + (1 if k - 1 < extra else 0)
        target = layers[first_layer]
        hi = n - (n_stages - k)  # leave one block for each later stage
        chosen = None
        for d in range(n):
            for c in (target - d, target + d):
                if starts[-1] < c <= hi and legal[c]:
                    chosen = c
                    break
            if chosen is not None:
                break
        if chosen is None:
            raise InfeasibleError(
                f"no legal cut is left for stage {k} of the equal-layer split; expected a cuttable "
                "boundary between the previous stage and the end; use fewer stages."
            )
        starts.append(chosen)
    return evaluate(blocks, starts, link)


def param_balanced(blocks: Sequence[BlockCost], n_stages: int, link: LinkCost) -> Partition:
    """Minimise the largest per-stage parameter count: DeepSpeed ``partition_method="parameters"``.

    DeepSpeed's ``partition_balanced`` minimises the max part weight over per-layer parameter
    counts; this solves the same objective exactly with the partition DP, on legal cuts only, with
    non-empty stages. Among equal optima it picks the lexicographically largest starts, i.e. the
    earlier stages as full as possible, as DeepSpeed's greedy ``_lprobe`` does (it bisects each part
    up to the bottleneck); DeepSpeed's own bisection is approximate (eps) and may allow empty parts.

    Args:
        blocks: per-block costs in execution order.
        n_stages: number of stages p.
        link: cost of one message between neighbouring ranks.

    Returns:
        The split with its bottleneck evaluated on the real stage costs (communication included).

    Raises:
        InfeasibleError: too few blocks or legal cuts.
    """
    _check_counts(blocks, n_stages)
    n = len(blocks)
    pre = [0]
    for b in blocks:
        pre.append(pre[-1] + b.params)
    counts = np.array(pre, dtype=np.int64 if pre[-1] < 2**62 else object)
    legal = _legal_cuts(blocks)
    first: IntArray = np.array([0] + [c for c in range(1, n) if legal[c]], dtype=np.int64)
    end_ok: BoolArray = np.array(legal[:n] + [True])

    def params(s: IntArray, e: IntArray) -> FloatArray:
        # float(pre[e] - pre[s]): the exact integer difference, rounded once
        out: FloatArray = np.asarray(counts[e] - counts[s]).astype(np.float64)
        return out

    def candidates(cap: float) -> _Stages:
        last = np.full_like(first, n) if cap == math.inf else _last_true(first, n, lambda s, e: params(s, e) <= cap)
        band = _band(n, n_stages, first, last, lambda s, e: float(pre[e] - pre[s]) <= cap)
        s, e = _banded_pairs(n, n_stages, first, last, end_ok, *band)
        c = params(s, e)
        ones = np.ones(len(s), dtype=np.int64)
        # Parameters have no memory check: every stage "fits" (t0 >= the one in-flight count, 0).
        row = c[np.newaxis, :]
        return _Stages(n, s, e, row, row, ones, -ones, bool((last == n).all()), (0, 0), band)

    first_cap = pre[-1] / n_stages + max(b.params for b in blocks)
    starts = _exact_partition(n, n_stages, [0] * n_stages, candidates, first_cap, latest=True)
    assert starts is not None  # _check_counts guarantees a partition without memory limits
    return evaluate(blocks, starts, link)
