"""Predicted figures for a partition: per-stage times and memory, step time, bubble, imbalance.

Pure module (no torch): combines the solver's stage costs with the schedule simulator. Both the
chosen plan and the baselines go through this one function, so the report compares like with like.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from pydantic import BaseModel

from planner.core.layout.inputs import Layout
from planner.core.levers.data_parallel import (
    allreduce_steps,
    block_fsdp_s,
    block_fsdp_stages,
    ddp_follows,
    ddp_stage_overlap,
    dp_group_links,
    experts_after_s,
    gather_bytes_of,
    rank_reduce_s,
    replica_slots,
    stage_traffic,
    wide_bytes,
)
from planner.core.levers.experts import by_group
from planner.core.levers.hsdp import hsdp_links, rank_hsdp_s
from planner.core.levers.links import Links, NodeLinks, boundary_links
from planner.core.levers.microbatch import blocks_resized
from planner.core.levers.overlap import COMPUTE_SLOWDOWN, NONE, Overlap, charged_s, exposed_only
from planner.core.split.cuts import Split
from planner.core.split.stage_model import (
    cold_in,
    cold_out,
)
from planner.core.split.stage_plans import LaidOut, StageMemo, laid_out
from planner.core.step.simulate import SimResult, StageTimes, Traffic, simulate, simulate_step, simulate_traffic
from planner.errors import InfeasibleError
from planner.schema.costs import BlockCost, LinkCost, OptimizerSpec
from planner.schema.plan import Plan, Prediction, ProfileInfo, StagePlan


def predict(
    blocks: Sequence[BlockCost],
    split: Split,
    link: Links,
    layout: Layout,
    optimizer: OptimizerSpec,
    slots: float | None = None,
    memo: StageMemo | None = None,
) -> tuple[list[StagePlan], Prediction]:
    """Predict what a partition costs under a layout: its schedule, run by ``layout.dp`` replicas.

    Every figure is one replica's pipeline (the replicas run the same one on their own samples),
    plus, once per step after the pipeline, the reduction of each rank's gradients over its
    replicas (``planner.core.levers.data_parallel``); FSDP shards memory and the optimizer step. With
    ``layout.accumulation`` k > 1 passes the pipeline part is k times one pass's makespan (the
    bubble fraction is one pass's, the same every pass) and the memory one pass's; the reduction
    (FSDP's: once per pass), the clipping all-reduce and the optimizer step are added once.

    Args:
        blocks: per-block costs, in execution order.
        split: each stage's first block (``layout.n_stages`` stages) and recompute mode.
        link: cost of one message between neighbouring ranks, or per boundary (a ``NodeLinks`` is
            placed with the schedule: ``planner.core.levers.links.boundary_links``).
        layout: the schedule, pipeline ranks, microbatches per step, stages per rank (looped or V
            placement, as the schedule places them), replicas and their mode ("ddp", "fsdp" or
            "hsdp": sharded memory and optimizer step, each its own traffic).
        optimizer: decides the optimizer-state bytes per parameter byte.
        slots: ranks of all replicas that can compute at once (CPU ranks sharing cores: cores /
            threads per rank; each replica gets ``slots / dp``); None when each rank has its own
            device. See ``planner.core.step.simulate.simulate``.
        memo: stages laid out before from the same inputs (``StageMemo``; None: none).

    Returns:
        The stages (with predicted time and memory each) and the step-level prediction.

    Raises:
        InfeasibleError: an invalid split, or a schedule request torch would refuse.
    """
    return timed(laid_out(blocks, split, link, layout, optimizer, memo), blocks, layout, slots)


def timed(
    laid: LaidOut, blocks: Sequence[BlockCost], layout: Layout, slots: float | None = None
) -> tuple[list[StagePlan], Prediction]:
    """A laid-out split's step: its schedule simulated, the replicas' reduction, clipping and
    optimizer added (``predict``'s second half).

    Args:
        laid: the split laid out (``laid_out``) with the same ``blocks`` and ``layout``.
        blocks: per-block costs, in execution order.
        layout: the layout the split was laid out under.
        slots: ranks that compute at once (``predict``).

    Returns:
        The stages and the step-level prediction.
    """
    schedule, p, n_microbatches, dp = layout.schedule, layout.pp, layout.n_microbatches, layout.dp
    stages, link = laid.stages, laid.link
    links = boundary_links(link, len(stages), schedule)
    times = stage_times(stages, _cpu_share(link))
    # a pipeline rank is tp processes: CPU ranks sharing cores run fewer pipeline ranks at once
    shared = replica_slots(slots, dp * layout.tp)
    one_pass_s, bubble = simulate_step(times, schedule, n_microbatches, shared, layout.stages_per_rank)
    # Each rank reduces its gradients over its replicas (DDP's all-reduce, FSDP's all-gather +
    # reduce-scatter: planner.core.levers.data_parallel), overlapped as torch runs it on devices
    # (planner.core.levers.overlap): FSDP's stage units and DDP's buckets on the pipeline's timeline
    # (simulate.Traffic: what they add is the makespan's growth), FSDP's block units per action.
    # Otherwise (ranks sharing CPU cores, the runner's own all-reduce) the reduction is charged
    # after the pipeline, not overlapped; the clipping norm needs the reduced gradients, so it
    # waits for the slowest rank.
    replicas = _replica_traffic(blocks, stages, link, layout, overlap=slots is None)
    dp_links, dp_reduce_s, per_stage = replicas.links, replicas.after_s, replicas.stages
    if replicas.traffic is not None:  # (and what comes after the pass besides: DDP's experts)
        on_timeline_s, per_stage = _on_timeline(times, layout, replicas, one_pass_s, stages)
        dp_reduce_s = on_timeline_s + replicas.after_s
    # Then each rank joins the gradient-norm all-reduce for clipping (one scalar: a reduce and a
    # broadcast, ~2 log2(group) messages) over the pipeline and tensor-parallel group, or over every
    # rank when FSDP shards the gradients; only then does every rank step its optimizer.
    # The step ends when the slowest optimizer is done. Over several nodes its messages pay the
    # slowest link's latency.
    shard = layout.shard
    group = p * shard * layout.tp  # under HSDP, one group's replicas hold every gradient once
    latency = max([x.latency_s for x in links] + ([x.latency_s for x in dp_links] if shard > 1 else []), default=0.0)
    allreduce_s = allreduce_steps(group) * latency
    if shard > 1 and any(b.float8_share for b in blocks):
        # after the optimizer, every float8 weight's scale for the next gathers in one all-reduce over
        # the ranks sharding the weights (planner.capture.float8.precompute_scales): a few numbers,
        # its messages' latency (the pass over the weights' shards it reads is not charged: a
        # millisecond for the 405B rows of docs/published_runs.md)
        allreduce_s += allreduce_steps(shard * layout.tp) * latency
    # before the optimizer each rank averages and clips its gradients: passes over all of them
    rank_opt = [sum(s.opt_s + s.grad_s for s in stages if s.rank == r) for r in range(p)]
    # With several passes (gradient accumulation) the schedule runs that many times back to back,
    # each a whole pipeline with its warm-up and drain; the gradients accumulate, and the clipping
    # and the optimizer come once. DDP's reduction comes once too (the runner averages the
    # replicas' gradients after the last pass); FSDP's comes after every pass, as torch's
    # PipelineStage reshards and reduce-scatters at the end of each schedule step (and gathers the
    # parameters again at the next pass's first forward).
    passes = layout.accumulation
    pipeline_s = passes * one_pass_s
    if shard > 1:
        dp_reduce_s *= passes
    stages = _with_comm(stages, per_stage, passes if shard > 1 else 1, passes * n_microbatches)
    step_s = pipeline_s + dp_reduce_s + allreduce_s + max(rank_opt)
    rank_memory = laid.rank_memory
    stage_time = tuple(s.time_s for s in stages)
    mean = sum(stage_time) / len(stage_time)
    prediction = Prediction(
        starts=laid.split.starts,
        recompute=laid.split.recompute,
        stage_time_s=stage_time,
        bottleneck_s=max(stage_time),
        pipeline_time_s=pipeline_s,
        step_time_s=step_s,
        bubble_fraction=bubble,
        imbalance=max(stage_time) / mean if mean > 0 else 1.0,
        max_memory_bytes=max(rank_memory),
        rank_memory_bytes=tuple(rank_memory) if layout.stages_per_rank > 1 else (),
        dp_reduce_s=dp_reduce_s,
    )
    return stages, prediction


def plan_links(plan: Plan) -> LinkCost:
    """The links ``plan`` was made with: a ``NodeLinks`` when it records ranks per node and the
    inter-node link (placed for its ``dp`` replicas), else its one link.

    Args:
        plan: a plan.

    Returns:
        What ``predict`` takes as ``link`` to redo the plan's figures.
    """
    if plan.inter_node_link is None or plan.gpus_per_node is None:
        return plan.link
    return NodeLinks(
        **plan.link.model_dump(),
        inter=plan.inter_node_link,
        gpus_per_node=plan.gpus_per_node,
        n_ranks=plan.n_ranks,
        replicas=plan.replicas,
        tp=plan.tp,
        pp_outer=plan.pp_outer,
    )


def plan_split(plan: Plan) -> Split:
    """The split a plan's stages record (each its first block and recompute mode).

    Args:
        plan: a plan.

    Returns:
        The split.
    """
    return Split(starts=tuple(s.start for s in plan.stages), recompute=tuple(s.recompute for s in plan.stages))


def predict_plan(
    plan: Plan,
    split: Split,
    *,
    blocks: Sequence[BlockCost] | None = None,
    link: LinkCost | None = None,
) -> tuple[list[StagePlan], Prediction]:
    """``predict`` a split of ``plan`` under everything else the plan fixes: its links, schedule,
    microbatches, optimizer, stages per rank, CPU sharing and data-parallel layout.

    Args:
        plan: the plan.
        split: each stage's first block and recompute mode.
        blocks: other costs for the same blocks (calibrated, say; None: the plan's).
        link: another link (None: ``plan_links(plan)``).

    Returns:
        The stages and the prediction.

    Raises:
        InfeasibleError: the split or the schedule cannot be evaluated.
    """
    return predict(
        plan.blocks if blocks is None else blocks,
        split,
        plan_links(plan) if link is None else link,
        plan_layout(plan),
        plan.optimizer,
        slots_of(plan.profile),
    )


class _Replicas(NamedTuple):
    """The data-parallel reduction of a layout (``_replica_traffic``): each pipeline rank's group
    link, the seconds charged after the pipeline (per pass under FSDP, else per step), the
    collectives to place on the pipeline's timeline (None: none; then what comes after the pass
    is only what they add to it, and DDP's experts' all-reduce), and each stage's collectives and
    their exposed part over the same span (``_on_timeline`` fills those of the timeline's)."""

    links: list[LinkCost]
    after_s: float
    traffic: Traffic | None
    stages: list[Overlap]
    slowdown: float = 0.0  # of compute beside a collective (planner.core.levers.overlap), on NCCL links


def _replica_traffic(
    blocks: Sequence[BlockCost], stages: Sequence[StagePlan], link: Links, layout: Layout, *, overlap: bool
) -> _Replicas:
    """The data-parallel reduction of a layout (``_Replicas``). DDP: an all-reduce once per step,
    in buckets during the last backward on devices where DDP itself reduces (``ddp_follows``);
    FSDP with stage units: a gather and a reduce-scatter per stage every pass, on the timeline on
    devices; FSDP block by block: every microbatch, prefetched unit by unit
    (``block_fsdp_stages``); under HSDP inside each shard group, followed by the all-reduce of the
    shards over the groups (``planner.core.levers.data_parallel``). Without ``overlap`` (ranks
    sharing CPU cores) or where the runner all-reduces after the backward, nothing hides."""
    p, dp, m = layout.pp, layout.dp, layout.n_microbatches
    hsdp = layout.dp_mode == "hsdp" and dp > 1
    size, groups = (layout.shard, dp // layout.shard) if hsdp else (dp, 1)
    inner, copies = hsdp_links(link, p, dp, size) if hsdp else (dp_group_links(link, p, dp), [])
    if dp == 1:
        return _Replicas(inner, 0.0, None, [NONE] * len(stages))
    # FSDP2's and DDP's own overlap on links NCCL drives (the GPUs of the hardware table); a link
    # it does not (gloo, a measured link) keeps the charges made before (docs/overlap.md)
    nccl = overlap and all(x.nccl is not None for x in inner)
    if layout.per_block:
        per = block_fsdp_stages(blocks, stages, inner, size, nccl, copies, groups)
        if nccl:
            ranks = [0.0] * p
            for st, one in zip(stages, per):
                ranks[st.rank] += m * charged_s(one, COMPUTE_SLOWDOWN)
        else:  # the charge as it always was: these plans' figures stay bit for bit
            ranks = block_fsdp_s(blocks, stages, inner, size, m, overlap, copies, groups)
            per = _shares(blocks, stages, ranks, [m * one.traffic_s for one in per])
            return _Replicas(inner, max(ranks), None, per)
        return _Replicas(inner, max(ranks), None, [one.times(m) for one in per])
    if overlap and layout.shard > 1:
        traffic = Traffic(*stage_traffic(blocks, stages, inner, size, copies, groups))
        return _Replicas(inner, 0.0, traffic, [], COMPUTE_SLOWDOWN if nccl else 0.0)
    if nccl and layout.dp_mode == "ddp" and ddp_follows(layout.schedule, layout.tp, layout.accumulation):
        per = ddp_stage_overlap(blocks, stages, inner, dp)
        held = [charged_s(one, COMPUTE_SLOWDOWN) for one in per]
        after = experts_after_s(blocks, stages, inner, dp)  # the experts', after the backward: nothing hidden
        experts = _shares(blocks, stages, after, weight=lambda part: by_group(part, wide=True)[1])
        per = [one.plus(x) for one, x in zip(per, experts)]
        return _Replicas(inner, max(after, default=0.0), Traffic([0.0] * len(stages), held), per)
    if hsdp:
        ranks = rank_hsdp_s(blocks, stages, inner, copies, size, groups)
    else:
        ranks = rank_reduce_s(blocks, stages, inner, dp, layout.dp_mode)
    return _Replicas(inner, max(ranks), None, _shares(blocks, stages, ranks))


def _shares(
    blocks: Sequence[BlockCost],
    stages: Sequence[StagePlan],
    ranks: Sequence[float],
    traffic: Sequence[float] = (),
    weight: Callable[[Sequence[BlockCost]], int] = wide_bytes,
) -> list[Overlap]:
    """What each rank's reduction charges (``ranks``), shared over its stages by their gradients'
    bytes (``weight``: of what the reduction carries; the runner reduces a rank's stages together);
    each stage's collectives ``traffic`` (empty: the charge, nothing hidden)."""
    wide = [weight(blocks[st.start : st.end]) for st in stages]
    total = [0] * len(ranks)
    for st, w in zip(stages, wide):
        total[st.rank] += w
    shown = [ranks[st.rank] * w / total[st.rank] if total[st.rank] else 0.0 for st, w in zip(stages, wide)]
    if not traffic:
        return [exposed_only(x) for x in shown]
    return [Overlap(t, min(x, t)) for x, t in zip(shown, traffic)]


def _on_timeline(
    times: Sequence[StageTimes], layout: Layout, replicas: _Replicas, one_pass_s: float, stages: Sequence[StagePlan]
) -> tuple[float, list[Overlap]]:
    """What the collectives placed on one pass's timeline (``replicas.traffic``) add to it, and each
    stage's figures.

    The makespan's growth (``simulate_traffic``) counts what ranks waited for: a stage's gather
    where its first action waited for it, its reduction (the rank is held for it). The part of
    the stage-unit gathers that ran beside the rank's work slows its compute (``replicas.slowdown``):
    the most any rank loses so is added after the pass. DDP's held time has its slowdown already.
    """
    traffic = replicas.traffic
    assert traffic is not None
    makespan, waits = simulate_traffic(times, layout.schedule, layout.n_microbatches, layout.stages_per_rank, traffic)
    per = [Overlap(g + r, min(w, g) + r) for g, r, w in zip(traffic.gather, traffic.reduce, waits)]
    if not replicas.slowdown:
        return makespan - one_pass_s, replicas.stages or per
    hidden = [0.0] * layout.pp
    for st, g, w in zip(stages, traffic.gather, waits):
        hidden[st.rank] += max(0.0, g - w)
    return makespan - one_pass_s + replicas.slowdown * max(hidden), replicas.stages or per


def _with_comm(stages: list[StagePlan], per: Sequence[Overlap], times: int, messages: int) -> list[StagePlan]:
    """The stages with their communication per step: ``per``'s data-parallel figures ``times`` over
    (once per pass under FSDP) and their pipeline messages (``comm_s``, ``messages`` microbatches)."""
    if not per:
        per = [NONE] * len(stages)
    return [
        st.model_copy(
            update={
                "comm_hidden_s": times * one.hidden_s,
                "comm_exposed_s": times * one.exposed_s + messages * st.comm_s,
            }
        )
        for st, one in zip(stages, per)
    ]


def plan_layout(plan: Plan) -> Layout:
    """The layout a plan runs: its schedule, pipeline ranks, microbatches, stages per rank, replicas,
    tensor-parallel degree, passes per step, FSDP units and expert-parallel degree (which lays the
    ranks out pipeline-outermost: ``Layout.pp_outer``)."""
    return Layout(
        plan.schedule,
        plan.n_ranks,
        plan.n_microbatches,
        plan.stages_per_rank,
        plan.replicas,
        plan.dp_mode,
        plan.tp,
        plan.accumulation,
        plan.fsdp_units,
        plan.dp_shard or 0,
        gather_bytes_of(plan.profile),
        plan.sequence_parallel,
        ep=plan.ep,
        cp=plan.cp,
        cp_attention=plan.cp_attention,
        loss_parallel=plan.loss_parallel,
    )


def with_links(plan: Plan, link: LinkCost) -> Plan:
    """``plan`` recording the links it was made with (see ``plan_links``): a ``NodeLinks`` is stored
    as its intra-node link, the inter-node link and the ranks per node.

    Args:
        plan: a plan assembled with ``link``.
        link: the link or ``NodeLinks`` given to the solver.

    Returns:
        The plan with ``link``, ``inter_node_link`` and ``gpus_per_node`` set.
    """
    if not isinstance(link, NodeLinks):
        return plan.model_copy(update={"link": link})
    update = {"link": link.intra(), "inter_node_link": link.inter, "gpus_per_node": link.gpus_per_node}
    return plan.model_copy(update=update)


def _cpu_share(link: Links) -> float:
    """The links' ``cpu_share`` (the first one's when there are several: one machine's runtime)."""
    if isinstance(link, LinkCost):
        return link.cpu_share
    links = list(link)
    return links[0].cpu_share if links else 1.0


def stage_times(stages: Sequence[StagePlan], cpu_share: float = 1.0) -> list[StageTimes]:
    """What each stage's actions occupy its rank in the simulator.

    Each action carries its messages: a forward sends/receives activations, a backward (its input
    part when split) their gradients. Of that message time, ``1 - cpu_share`` is waiting
    (``StageTimes.msg``), which ranks sharing processors do not compete for.

    Args:
        stages: the stages.
        cpu_share: the link's ``LinkCost.cpu_share``.

    Returns:
        One ``StageTimes`` per stage.
    """
    return [
        StageTimes(
            s.fwd_s + s.comm_s / 2,
            s.bwd_s + s.comm_s / 2,
            None if s.bwd_input_s is None else s.bwd_input_s + s.comm_s / 2,
            s.bwd_weight_s,
            s.comm_s / 2 * (1.0 - cpu_share),
        )
        for s in stages
    ]


def simulate_plan(plan: Plan) -> SimResult:
    """The predicted timeline of one pass of one replica of ``plan`` (its forward/backward actions;
    a step runs ``plan.accumulation`` of them; the gradient reduction and optimizer step that follow
    are not drawn).

    Raises:
        InfeasibleError: the plan's schedule cannot run its numbers (a hand-edited file).
    """
    slots = replica_slots(slots_of(plan.profile), plan.replicas * plan.tp)
    times = stage_times(plan.stages, plan.link.cpu_share)
    return simulate(times, plan.schedule, plan.n_microbatches, slots, plan.stages_per_rank)


def slots_of(profile: ProfileInfo) -> float | None:
    """How many ranks (of all replicas) can compute at once: cores / threads for CPU plans, else None
    (one device each)."""
    return profile.cores / profile.threads if profile.cores else None


def block_times_in_stages(blocks: Sequence[BlockCost], stages: Sequence[StagePlan]) -> list[tuple[float, float]]:
    """Every block's forward and backward seconds where ``stages`` run it: its own, plus its cold
    start where it begins a stage's action after a message from another rank (``cold_in``,
    ``cold_out``). What a run's per-block times (``StageMeasure.blocks``) compare with.

    Args:
        blocks: per-block costs in execution order.
        stages: the stages (start, end and rank of each), in order.

    Returns:
        ``(fwd_s, bwd_s)`` per block, in block order.
    """
    out = [(b.fwd_s, b.bwd_s) for b in blocks]
    for i, st in enumerate(stages):
        wait_in, wait_out = stage_waits(stages, i)
        if wait_in:
            f, b = out[st.start]
            out[st.start] = (f + cold_in(blocks, st.start), b)
        if wait_out:
            f, b = out[st.end - 1]
            out[st.end - 1] = (f, b + cold_out(blocks, st.end))
    return out


def stage_waits(stages: Sequence[StagePlan], i: int) -> tuple[bool, bool]:
    """Whether stage ``i`` waits for a message from another rank: for its activations (it is not
    the first stage, and the stage before runs elsewhere), and for their gradient (the same with
    the stage after it). The turn of a V joins two stages on one rank: nothing is waited for."""
    return (
        i > 0 and stages[i - 1].rank != stages[i].rank,
        i + 1 < len(stages) and stages[i + 1].rank != stages[i].rank,
    )


def with_method(plan: Plan, method: str) -> Plan:
    """The same plan (same costs, schedule, batch) split by another of its compared methods.

    Used to run a baseline split side by side with the planned one on identical costs.

    Args:
        plan: a plan whose ``baselines`` include ``method``.
        method: "optimal", "uniform" or "params".

    Returns:
        A plan whose stages are ``method``'s split; the former choice moves to ``baselines``.

    Raises:
        InfeasibleError: when the plan has no figures for ``method``.
    """
    if method == plan.method:
        return plan
    if method not in plan.baselines:
        raise InfeasibleError(
            f"the plan has no '{method}' split to switch to; it compares {', '.join(plan.baselines) or 'nothing'}"
        )
    base = plan.baselines[method]
    stages, prediction = predict_plan(plan, Split.of(base))
    baselines = {k: v for k, v in plan.baselines.items() if k != method}
    baselines[plan.method] = plan.prediction
    return plan.model_copy(
        update={"method": method, "stages": stages, "prediction": prediction, "baselines": baselines}
    )


def _same(a: object, b: object) -> bool:
    """Equal, with floats compared to a relative 1e-9 (JSON round trips keep them exact; this only
    forgives the last bit)."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _differences(stored: BaseModel, fresh: BaseModel) -> list[str]:
    return [name for name in type(stored).model_fields if not _same(getattr(stored, name), getattr(fresh, name))]


def _at_its_microbatch(plan: Plan) -> tuple[Plan, str]:
    """``plan`` with its blocks' costs at its microbatch size, and a line saying so when a hand edit
    (batch_size, dp, accumulation, n_microbatches) had changed the size they were costed at; empty
    when it did not (or the plan predates ``costed_microbatch_size``)."""
    costed, size = plan.costed_microbatch_size, plan.microbatch_size
    if costed is None or costed == size:
        return plan, ""
    profile = plan.profile
    blocks = blocks_resized(plan.blocks, costed, size, profile.microbatch_size, profile.fixed_fraction)
    split = f"{plan.dp} replica(s) x " if plan.dp > 1 else ""
    split += f"{plan.accumulation} pass(es) x " if plan.accumulation > 1 else ""
    note = (
        f"the microbatch is {size} samples (batch_size {plan.batch_size} over {split}{plan.n_microbatches} "
        f"microbatch{'es' if plan.n_microbatches > 1 else ''}), not the {costed} its blocks were costed at: their "
        f"costs were rescaled to {size}"
    )
    return plan.model_copy(update={"blocks": blocks, "costed_microbatch_size": size}), note


def refresh(plan: Plan) -> tuple[Plan, list[str]]:
    """The plan with every figure recomputed from its blocks, and what a hand edit had changed.

    ``plan.json`` is a text file users may edit: moving a stage boundary, changing a block's cost
    or the schedule. The stage and step figures are derived from the blocks, the link, the split
    and the schedule, so they are recomputed here; a figure that differs from the stored one means
    the file was edited (or made by another version), and is named. An edit that changes the
    microbatch size (batch_size, dp, accumulation, n_microbatches) first rescales the blocks' costs
    to the new size (``blocks_resized``), as the search would have costed it.

    Args:
        plan: a loaded plan.

    Returns:
        The plan with recomputed stages, prediction and baselines, and one line per stage or
        prediction whose stored figures differed (empty when the file is consistent).

    Raises:
        InfeasibleError: the edited split or schedule cannot be evaluated (an illegal cut, too few
            microbatches for 1F1B).
    """
    plan, resized = _at_its_microbatch(plan)
    stages, prediction = predict_plan(plan, plan_split(plan))
    notes = [resized] if resized else []
    for old, new in zip(plan.stages, stages):
        changed = _differences(old, new)
        if changed:
            notes.append(f"stage {old.index}: {', '.join(changed)} did not match its blocks")
    changed = _differences(plan.prediction, prediction)
    if changed:
        notes.append(f"prediction: {', '.join(changed)} did not match the stages")
    baselines = {}
    for name, base in plan.baselines.items():
        if len(base.starts) != len(plan.stages):
            # a --compare split of another stage count, costed under its own layout (the plan keeps
            # only its figures): kept as written
            baselines[name] = base
            continue
        fresh = predict_plan(plan, Split.of(base))[1]
        if _differences(base, fresh):
            notes.append(f"baseline {name}: figures did not match its split")
        baselines[name] = fresh
    update = {"stages": stages, "prediction": prediction, "baselines": baselines}
    return plan.model_copy(update=update), notes
