"""A split laid out on its ranks: each stage's figures (``StagePlan``) and each rank's peak memory.

The first half of a prediction (``planner.core.step.predict.predict`` is ``timed(laid_out(...))``): what a
split's stages cost and hold, and what its ranks hold at their peak over the schedule's action
order. Kept apart from the timing because the peak alone decides whether a split fits, and the
searches lay out many splits that do not (``planner.core.layout.rank_fit``); ``StageMemo`` keeps the stages
of a split for the next split of the same layout (``planner.core.layout.search.refine``).

Pure module: never imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from planner.core.layout.inputs import Layout
from planner.core.levers.casts import shared_casts
from planner.core.levers.data_parallel import layout_links
from planner.core.levers.links import Links, boundary_links, default_link, links_around
from planner.core.levers.recompute import recompute_mode
from planner.core.split.cuts import Split
from planner.core.split.range_sums import block_sums
from planner.core.split.stage_model import (
    MemoryParts,
    check_starts,
    parts_from_sums,
    stage_memory_parts,
    stage_time_parts,
)
from planner.core.step.schedules import (
    Action,
    RankStates,
    in_flight_per_stage,
    peak_live_bytes,
    rank_states,
    stage_ranks,
)
from planner.errors import InfeasibleError
from planner.schema.costs import BlockCost, LinkCost, OptimizerSpec, split_recompute
from planner.schema.plan import StagePlan


@dataclass(frozen=True)
class LaidOut:
    """A split laid out on its ranks: its stages and each rank's peak memory, not yet timed.

    ``predict`` is ``timed(laid_out(...))``. Kept apart because the peak alone decides whether a
    split fits, and the searches (``planner.core.layout.rank_fit``) lay out many splits that do not: they
    time only those that fit.
    """

    split: Split
    stages: list[StagePlan]
    rank_memory: tuple[int, ...]  # each pipeline rank's peak bytes
    link: Links  # placed for the layout's replicas and tensor-parallel groups

    @property
    def max_memory_bytes(self) -> int:
        """The busiest rank's peak bytes."""
        return max(self.rank_memory)


@dataclass
class StageMemo:
    """Stages already laid out, for a caller that lays out many splits of the same blocks under the
    same links, layout and optimizer (``planner.core.layout.search.refine``: moving one cut changes two
    stages of a split, the others are laid out as before). Keyed by (index, start, end, recompute);
    ``laid_out`` reads it only while those inputs stay the same (the blocks the very same list) and
    starts it afresh otherwise. ``derived`` is where ``planner.core.layout.candidate.evaluate_choice`` keeps
    the blocks it derives for a layout (FSDP's gathered weights, compiled casts) between its calls.
    """

    inputs: tuple[Sequence[BlockCost], Links, Layout, OptimizerSpec] | None = None
    stages: dict[tuple[int, int, int, str], tuple[MemoryParts, StagePlan]] = field(default_factory=dict)
    derived: tuple[Sequence[BlockCost], tuple[object, ...], Sequence[BlockCost]] | None = None

    def bound_to(self, blocks: Sequence[BlockCost], link: Links, layout: Layout, optimizer: OptimizerSpec) -> None:
        """Keep the stages only if they were laid out from these very inputs; else start afresh."""
        held = self.inputs
        if held is None or not (held[0] is blocks and held[1:] == (link, layout, optimizer)):
            self.inputs = (blocks, link, layout, optimizer)
            self.stages = {}


def laid_out(
    blocks: Sequence[BlockCost],
    split: Split,
    link: Links,
    layout: Layout,
    optimizer: OptimizerSpec,
    memo: StageMemo | None = None,
) -> LaidOut:
    """The stages of a split under a layout and each rank's peak memory (``predict``'s first half).

    Args:
        blocks: per-block costs, in execution order.
        split: each stage's first block (``layout.n_stages`` stages) and recompute mode.
        link: the link between neighbouring ranks, as ``predict`` takes it.
        layout: the schedule, ranks, microbatches, stages per rank and replicas.
        optimizer: decides the optimizer-state bytes per parameter byte.
        memo: stages laid out before from the same inputs, reused and added to (None: none).

    Returns:
        The split laid out.

    Raises:
        InfeasibleError: an invalid split, or a schedule request torch would refuse.
    """
    starts, n = split.starts, split.n_stages
    if n % layout.stages_per_rank:
        raise InfeasibleError(f"{n} stages do not spread evenly over ranks with {layout.stages_per_rank} stages each")
    if n != layout.n_stages:
        raise InfeasibleError(f"{n} stages for a layout of {layout.pp} ranks x {layout.stages_per_rank} stage(s)")
    schedule, p, n_microbatches, dp = layout.schedule, layout.pp, layout.n_microbatches, layout.dp
    ranks = stage_ranks(schedule, p, layout.stages_per_rank)
    context = _StageContext(optimizer, layout, ranks)
    link = layout_links(link, p, dp, layout.tp, layout.pp_outer)
    # a valid split: legal cuts, non-empty stages (each stage's times are the stage plans' below)
    check_starts(blocks, starts)
    links = boundary_links(link, n, schedule)
    flags = split.flags
    states = rank_states(schedule, p, n_microbatches, layout.stages_per_rank)
    in_flight = in_flight_per_stage(schedule, p, n_microbatches, layout.stages_per_rank)
    ends = list(starts[1:]) + [len(blocks)]
    if memo is not None:
        memo.bound_to(blocks, link, layout, optimizer)
    known = {} if memo is None else memo.stages
    parts: list[MemoryParts] = []
    stages: list[StagePlan] = []
    for i, (a, b) in enumerate(zip(starts, ends)):
        key = (i, a, b, flags[i])
        if key not in known:
            # a stage's figures depend on its blocks, its recompute mode and its place (index: its
            # links, rank, in-flight count), all fixed by the key once the inputs are
            own = _memory_parts(blocks, a, b, optimizer, flags[i], layout)
            around = links_around(links, i, default_link(link))
            known[key] = (own, _stage_plan(blocks, i, (a, b), around, flags[i], in_flight[i], context, own))
        parts.append(known[key][0])
        stages.append(known[key][1])
    rank_memory = tuple(rank_memory_bytes(blocks, stages, states[r], r, optimizer, layout, parts) for r in range(p))
    return LaidOut(split, stages, rank_memory, link)


def rank_memory_bytes(
    blocks: Sequence[BlockCost],
    stages: Sequence[StagePlan],
    order: Sequence[Action] | RankStates,
    rank: int,
    optimizer: OptimizerSpec,
    layout: Layout,
    parts: Sequence[MemoryParts] | None = None,
) -> int:
    """Peak memory of one rank over all the stages it runs.

    The terms of ``planner.core.split.stage_model.stage_memory_parts`` summed over the rank's stages, except
    that the activations are the peak of their sum over the rank's action order
    (``peak_live_bytes``): with several stages per rank, each stage's own peak comes at a different
    time; and what a backward holds only while it runs (``MemoryParts.transient``: the output's
    gradient, the rebuilt region, the backward's temporaries) is the largest stage's, not their sum:
    the rank runs one backward at a time. Where the gradients are freed between steps
    (``layout.fresh_grads``) a stage's count only from its first backward on, an FSDP stage unit's sharded share only from its last (as
    ``MemoryParts.peak``'s). With one stage per rank it equals ``MemoryParts.peak`` under GPipe and 1F1B, and is at most that elsewhere (the closed form assumes a
    stage with fewer microbatches live than a step has reaches its peak again after a backward).

    Args:
        blocks: per-block costs.
        stages: every stage of the plan (``rank`` set).
        order: this rank's action order, or its ``RankStates`` (``planner.core.step.schedules.rank_states``).
        rank: the rank.
        optimizer: the optimizer (state and step temporaries).
        layout: its microbatches per step (receive buffers), the FSDP replicas the stages' state is
            sharded over, whether FSDP shards block by block (each stage's unsharded units are
            added, though the rank gathers only one stage's at a time: an upper bound with several
            stages per rank) and whether the gradients are new every step.
        parts: every stage's ``stage_memory_parts``, by stage index, where the caller has them
            (None: computed here).

    Returns:
        Bytes.
    """
    fixed = once = step = transient = 0
    live_per_mb: dict[int, int] = {}
    grads: dict[int, int] = {}
    reduced: dict[int, int] = {}  # of the gradients, what comes only after the stage's last backward
    for st in stages:
        if st.rank != rank:
            continue
        own = (
            parts[st.index]
            if parts is not None
            else stage_memory_parts(
                blocks, st.start, st.end, optimizer, st.recompute, layout.n_microbatches, layout.shard, layout.per_block
            )
        )
        fixed += own.fixed
        # autocast's weight copies: a set per live microbatch, or shared (casts.shared_casts)
        per_microbatch, own_once = shared_casts(own.per_microbatch, own.once, own.cast, st.in_flight)
        live_per_mb[st.index] = per_microbatch
        once += own_once - own.transient
        transient = max(transient, own.transient)
        step += own.step
        grads[st.index] = own.grads - own.reduced if layout.fresh_grads else 0
        reduced[st.index] = own.reduced if layout.fresh_grads else 0
    late = sum(grads.values()) + sum(reduced.values())  # in fixed and once, but only from a backward on
    once += transient
    return fixed - late + max(peak_live_bytes(order, live_per_mb, grads, reduced) + once, step + late)


def optimizer_cost(block: BlockCost) -> float:
    """The block's share of the optimizer step; 0 when it was not timed (None)."""
    return block.opt_s if block.opt_s is not None else 0.0


def sharded_work(block: BlockCost, seconds: float, shard: int) -> float:
    """``seconds`` of the block's optimizer step or gradient work, as over the parameters FSDP
    shards when ``shard`` > 1 (``BlockCost.fsdp_sharded``: under expert parallelism the experts
    whole, their work a rank holds ``1 / ep`` of), before the division by ``shard``."""
    if shard <= 1 or block.fsdp_params is None or not block.params:
        return seconds
    return seconds * block.fsdp_params / block.params


def _memory_parts(
    blocks: Sequence[BlockCost], start: int, end: int, optimizer: OptimizerSpec, recompute: bool | str, layout: Layout
) -> MemoryParts:
    """``stage_memory_parts`` of a stage under the layout, its sums read off the blocks' prefix sums
    (made once per blocks object: a search predicts hundreds of layouts over the same blocks) unless
    only its first k regions recompute, which needs them region by region."""
    mode, count = split_recompute(recompute_mode(recompute))
    m, shard, per_block = layout.n_microbatches, layout.shard, layout.per_block
    if count is not None:
        return stage_memory_parts(blocks, start, end, optimizer, recompute, m, shard, per_block)
    return parts_from_sums(block_sums(blocks, optimizer).stage(start, end), optimizer, mode, m, shard, per_block)


@dataclass(frozen=True)
class _StageContext:
    """What every stage of one prediction shares: the optimizer (state bytes), the layout (its
    microbatches per step, FSDP's sharding and whether the gradients are new every step) and the
    rank of every stage (a boundary between two stages on the same rank, the turn of a V, carries
    no message)."""

    optimizer: OptimizerSpec
    layout: Layout
    rank_of: Sequence[int]


def _stage_plan(
    blocks: Sequence[BlockCost],
    index: int,
    bounds: tuple[int, int],
    links: tuple[LinkCost, LinkCost],
    recompute: str,
    in_flight: int,
    context: _StageContext,
    memory: MemoryParts,
) -> StagePlan:
    """One stage's predicted figures: times per microbatch, optimizer step, activations and peak memory.

    Args:
        blocks: per-block costs in execution order.
        index: the stage's index.
        bounds: its first block and one past its last.
        links: the cost of one message over its start boundary and over its end boundary.
        recompute: its recompute mode ("never", "selective", "full", "stage", or "full:k" / "selective:k").
        in_flight: its peak live microbatches under the schedule.
        context: what the prediction's stages share.
        memory: its memory terms (``stage_memory_parts``).

    Returns:
        The stage.
    """
    start, end = bounds
    rank_of, layout = context.rank_of, context.layout
    shard = layout.shard

    def crosses(other: int) -> bool:
        return rank_of[other] != rank_of[index]

    fwd, bwd, comm = stage_time_parts(
        blocks,
        start,
        end,
        links[0],
        recompute,
        links[1],
        wait_in=start > 0 and crosses(index - 1),
        wait_out=end < len(blocks) and crosses(index + 1),
    )
    part = blocks[start:end]
    split = all(x.bwd_input_s is not None and x.bwd_weight_s is not None for x in part)
    extra = bwd - sum(x.bwd_s for x in part)  # recomputation and a cold start, paid in the input-gradient pass
    return StagePlan(
        index=index,
        rank=rank_of[index],
        start=start,
        end=end,
        first_block=blocks[start].name,
        last_block=blocks[end - 1].name,
        split_node=blocks[end - 1].last_node if end < len(blocks) else None,
        params=sum(x.params for x in part),
        fwd_s=fwd,
        bwd_s=bwd,
        comm_s=2 * comm,
        time_s=fwd + bwd + comm + comm,
        opt_s=sum(sharded_work(x, optimizer_cost(x), shard) for x in part) / shard,
        grad_s=sum(sharded_work(x, x.grad_s or 0.0, shard) for x in part) / shard,
        recompute=recompute,
        activation_bytes=sum(x.activation_bytes for x in part),
        kept_bytes=int(memory.kept),
        in_flight=in_flight,
        memory_bytes=memory.peak(in_flight, layout.fresh_grads),
        # torch 2.13 never runs I on the first stage (its inputs need no gradient): its W is the
        # whole backward (PipelineStage.backward_weight_one_chunk with stage_index 0)
        bwd_input_s=(0.0 if index == 0 else sum(x.bwd_input_s or 0.0 for x in part) + extra) if split else None,
        bwd_weight_s=(bwd if index == 0 else sum(x.bwd_weight_s or 0.0 for x in part)) if split else None,
    )


__all__ = ["LaidOut", "StageMemo", "laid_out", "optimizer_cost", "rank_memory_bytes"]
