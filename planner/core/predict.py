"""Predicted figures for a partition: per-stage times and memory, step time, bubble, imbalance.

Pure module (no torch): combines the solver's stage costs with the schedule simulator. Both the
chosen plan and the baselines go through this one function, so the report compares like with like.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pydantic import BaseModel

from planner.core.schedules import action_order, peak_in_flight
from planner.core.simulate import simulate
from planner.core.solve import compact_flags, recompute_flags, stage_costs, stage_memory_bytes, stage_time_parts
from planner.errors import InfeasibleError
from planner.schema.costs import BlockCost, LinkCost, OptimizerSpec
from planner.schema.plan import Plan, Prediction, ProfileInfo, StagePlan


def predict(
    blocks: Sequence[BlockCost],
    starts: Sequence[int],
    link: LinkCost,
    schedule: str,
    n_microbatches: int,
    optimizer: OptimizerSpec,
    recompute: Sequence[bool] = (),
    slots: float | None = None,
) -> tuple[list[StagePlan], Prediction]:
    """Predict what a partition costs under a schedule.

    Args:
        blocks: per-block costs, in execution order.
        starts: first block of each stage (starts[0] == 0).
        link: cost of one message between neighbouring ranks.
        schedule: "gpipe" or "1f1b".
        n_microbatches: microbatches per step.
        optimizer: decides the optimizer-state bytes per parameter byte.
        recompute: per stage, activation checkpointing (empty: no stage recomputes).
        slots: ranks that can compute at once (CPU ranks sharing cores: cores / threads per
            rank); None when each rank has its own device. See ``planner.core.simulate.simulate``.

    Returns:
        The stages (with predicted time and memory each) and the step-level prediction.
    """
    stage_costs(blocks, starts, link, recompute)  # validates the split (legal cuts, non-empty stages)
    flags = recompute_flags(recompute, len(starts))
    in_flight = [peak_in_flight(o) for o in action_order(schedule, len(starts), n_microbatches)]
    ends = list(starts[1:]) + [len(blocks)]
    stages = [
        stage_plan(blocks, i, a, b, link, flags[i], in_flight[i], optimizer, n_microbatches)
        for i, (a, b) in enumerate(zip(starts, ends))
    ]
    # Each action carries its messages: a forward sends/receives activations, a backward their gradients.
    sim = simulate([(s.fwd_s + s.comm_s / 2, s.bwd_s + s.comm_s / 2) for s in stages], schedule, n_microbatches, slots)
    # After its last backward each rank joins the gradient-norm all-reduce for clipping (one
    # scalar over the pipeline group: a reduce and a broadcast, ~2 log2(p) messages), which waits
    # for the last rank to finish its backwards (stage 0 under GPipe and 1F1B); only then does
    # every rank step its optimizer. The step ends when the slowest optimizer is done.
    p = len(stages)
    allreduce_s = 2 * math.ceil(math.log2(p)) * link.latency_s if p > 1 else 0.0
    step_s = sim.step_time_s + allreduce_s + max(s.opt_s for s in stages)
    stage_time = tuple(s.time_s for s in stages)
    mean = sum(stage_time) / len(stage_time)
    prediction = Prediction(
        starts=tuple(starts),
        recompute=compact_flags(flags),
        stage_time_s=stage_time,
        bottleneck_s=max(stage_time),
        pipeline_time_s=sim.step_time_s,
        step_time_s=step_s,
        bubble_fraction=sim.bubble_fraction,
        imbalance=max(stage_time) / mean if mean > 0 else 1.0,
        max_memory_bytes=max(s.memory_bytes for s in stages),
    )
    return stages, prediction


def slots_of(profile: ProfileInfo) -> float | None:
    """How many ranks can compute at once: cores / threads for CPU plans, else None (one device each)."""
    return profile.cores / profile.threads if profile.cores else None


def optimizer_cost(block: BlockCost) -> float:
    """The block's share of the optimizer step; 0 when it was not timed (None)."""
    return block.opt_s if block.opt_s is not None else 0.0


def stage_plan(
    blocks: Sequence[BlockCost],
    index: int,
    start: int,
    end: int,
    link: LinkCost,
    recompute: bool,
    in_flight: int,
    optimizer: OptimizerSpec,
    n_microbatches: int,
) -> StagePlan:
    """One stage's predicted figures: times per microbatch, optimizer step, activations and peak memory.

    Args:
        blocks: per-block costs in execution order.
        index: the stage's index.
        start: its first block.
        end: one past its last block.
        link: cost of one message between neighbouring ranks.
        recompute: whether it recomputes its activations in backward.
        in_flight: its peak live microbatches under the schedule.
        optimizer: the optimizer (state bytes).
        n_microbatches: microbatches per step (receive buffers).

    Returns:
        The stage.
    """
    fwd, bwd, comm = stage_time_parts(blocks, start, end, link, recompute)
    part = blocks[start:end]
    return StagePlan(
        index=index,
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
        opt_s=sum(optimizer_cost(x) for x in part),
        recompute=recompute,
        activation_bytes=sum(x.activation_bytes for x in part),
        in_flight=in_flight,
        memory_bytes=stage_memory_bytes(blocks, start, end, in_flight, optimizer, recompute, n_microbatches),
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
    stages, prediction = predict(
        plan.blocks,
        base.starts,
        plan.link,
        plan.schedule,
        plan.n_microbatches,
        plan.optimizer,
        base.recompute,
        slots_of(plan.profile),
    )
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


def refresh(plan: Plan) -> tuple[Plan, list[str]]:
    """The plan with every figure recomputed from its blocks, and what a hand edit had changed.

    ``plan.json`` is a text file users may edit: moving a stage boundary, changing a block's cost
    or the schedule. The stage and step figures are derived from the blocks, the link, the split
    and the schedule, so they are recomputed here; a figure that differs from the stored one means
    the file was edited (or made by another version), and is named.

    Args:
        plan: a loaded plan.

    Returns:
        The plan with recomputed stages, prediction and baselines, and one line per stage or
        prediction whose stored figures differed (empty when the file is consistent).

    Raises:
        InfeasibleError: the edited split or schedule cannot be evaluated (an illegal cut, too few
            microbatches for 1F1B).
    """
    starts = [s.start for s in plan.stages]
    flags = [s.recompute for s in plan.stages]
    slots = slots_of(plan.profile)
    args = (plan.link, plan.schedule, plan.n_microbatches, plan.optimizer)
    stages, prediction = predict(plan.blocks, starts, *args, flags, slots)
    notes = []
    for old, new in zip(plan.stages, stages):
        changed = _differences(old, new)
        if changed:
            notes.append(f"stage {old.index}: {', '.join(changed)} did not match its blocks")
    changed = _differences(plan.prediction, prediction)
    if changed:
        notes.append(f"prediction: {', '.join(changed)} did not match the stages")
    baselines = {}
    for name, base in plan.baselines.items():
        fresh = predict(plan.blocks, base.starts, *args, base.recompute, slots)[1]
        if _differences(base, fresh):
            notes.append(f"baseline {name}: figures did not match its split")
        baselines[name] = fresh
    update = {"stages": stages, "prediction": prediction, "baselines": baselines}
    return plan.model_copy(update=update), notes
