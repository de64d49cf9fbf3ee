"""Predicted against measured: how far the plan's figures were from what ``planner run`` saw.

Pure module (tabulate, no torch). Reads a Plan and the RunResult of running it; nothing is
re-measured. Errors are ``(predicted - measured) / measured``: negative means the plan
under-predicted (the run was slower or bigger than planned).

A plan of several data-parallel replicas is compared on replica 0, whose ranks report the stages
(every replica runs the same ones); its step is the job's, the gradient reduction included.
"""

from __future__ import annotations

from tabulate import tabulate

from planner.core.levers.data_parallel import check_run_replicas
from planner.core.step.predict import block_times_in_stages
from planner.core.step.simulate import Event
from planner.schema.plan import Plan
from planner.schema.result import RunResult, check_run_matches


def _err(predicted: float, measured: float) -> float | None:
    return (predicted - measured) / measured if measured > 0 else None


def _pct(e: float | None) -> str:
    return "-" if e is None else f"{100 * e:+.1f}%"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def _mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f}"


def compare_table(plan: Plan, run: RunResult) -> str:
    """Per stage: predicted vs measured forward and backward per microbatch, optimizer step and
    peak memory, with errors; then predicted vs measured step time.

    Measured memory is the tracked tensor peak (``StageMeasure.memory.peak_bytes``); "-" when the
    run tracked none (a 1-step run). Measured times are "-" when the run timed no step (1 or 2 steps:
    the set-up and the memory-tracked one, ``timed_steps``). With data-parallel replicas the stages are
    replica 0's and the predicted gradient reduction is shown under the step (the run times it inside
    its step).

    Args:
        plan: the plan that was run.
        run: its run.json.

    Returns:
        The two tables as text.

    Raises:
        PlanFileError: the run is not of this plan (see ``check_run_matches``).
    """
    check_run_matches(plan, run)
    check_run_replicas(plan, run)
    rows = []
    several = plan.stages_per_rank > 1
    timed = run.median_step_s is not None

    def measured(planned: float, ran: float) -> list[str]:  # the run's figure and the error, or none
        return [_ms(ran), _pct(_err(planned, ran))] if timed else ["-", "-"]

    for s, m in zip(plan.stages, run.stages):
        blocks = s.first_block if s.end - s.start == 1 else f"{s.first_block} .. {s.last_block}"
        mem = m.memory.peak_bytes if m.memory is not None else None
        # With several stages per rank the optimizer and the memory are the rank's (all its stages).
        opt_s = sum(x.opt_s for x in plan.stages_of(s.rank)) if several else s.opt_s
        mem_plan = plan.prediction.rank_memory_bytes[s.rank] if several else s.memory_bytes
        rows.append(
            [
                f"{s.index} (rank {s.rank})" if several else s.index,
                blocks,
                _ms(s.fwd_s),
                *measured(s.fwd_s, m.fwd_s),
                _ms(s.bwd_s),
                *measured(s.bwd_s, m.bwd_s),
                _ms(opt_s),
                *measured(opt_s, m.optimizer_s),
                _mb(mem_plan),
                "-" if mem is None else _mb(mem),
                "-" if mem is None else _pct(_err(mem_plan, mem)),
            ]
        )
    headers = [
        "stage",
        "blocks",
        "fwd ms plan",
        "run",
        "err",
        "bwd ms plan",
        "run",
        "err",
        "opt ms plan",
        "run",
        "err",
        "mem MB plan",
        "run",
        "err",
    ]
    stages = tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True, colalign=("right", "left"))
    predicted = plan.prediction.step_time_s
    steps = [["step", _ms(predicted), *measured(predicted, run.median_step_s or 0.0)]]
    loss_plan, loss_run = plan.blocks[-1].loss_s, run.stages[-1].loss_s
    if loss_plan is not None and plan.stages[-1].end == len(plan.blocks):
        steps.append(["  loss per microbatch (last stage)", _ms(loss_plan), *measured(loss_plan, loss_run)])
    if plan.dp > 1:
        steps.append([f"  of which {plan.dp_mode} reduction", _ms(plan.prediction.dp_reduce_s), "-", "-"])
    summary = tabulate(
        steps,
        headers=["", "plan ms", "run ms", "err"],
        tablefmt="simple",
        disable_numparse=True,
    )
    note = "\n(opt and mem are per rank: all of the rank's stages)" if several else ""
    return f"{stages}{note}\n\n{summary}"


def measured_events(plan: Plan, run: RunResult) -> list[Event]:
    """The run's recorded actions of one step (``StageMeasure.timeline``) as timeline events.

    Each rank recorded its own stages' actions in wall-clock time; the earliest step start over the
    ranks is time 0 (the ranks of one machine share its clock; on several nodes the clocks may
    differ by their offset).

    Args:
        plan: the plan that was run (which rank ran each stage).
        run: its run.json.

    Returns:
        The events, sorted by start (empty when the run recorded none: a run of under 2 steps).

    Raises:
        PlanFileError: the run is not of this plan.
    """
    check_run_matches(plan, run)
    check_run_replicas(plan, run)
    origins = [m.timeline_origin for m in run.stages if m.timeline_origin is not None and m.timeline]
    if not origins:
        return []
    zero = min(origins)
    events = [
        Event(
            rank=plan.stages[m.stage].rank,
            stage=m.stage,
            kind=kind,
            microbatch=mb,
            start_s=m.timeline_origin - zero + start,
            end_s=m.timeline_origin - zero + end,
        )
        for m in run.stages
        if m.timeline_origin is not None
        for kind, mb, start, end in m.timeline
    ]
    return sorted(events, key=lambda e: (e.start_s, e.rank))


def compare_blocks_table(plan: Plan, run: RunResult) -> str:
    """Per block: its profiled forward and backward (with its cold start where it begins a stage's
    action after a message: ``planner.core.step.predict.block_times_in_stages``) against its time inside
    the running stage (``StageMeasure.blocks``), then per stage the time its actions spent outside
    every block.

    Args:
        plan: the plan that was run.
        run: its run.json.

    Returns:
        The tables as text, or one line saying the run timed no blocks (a compiled plan, an older run).

    Raises:
        PlanFileError: the run is not of this plan.
    """
    check_run_matches(plan, run)
    check_run_replicas(plan, run)
    rows = []
    planned = block_times_in_stages(plan.blocks, plan.stages)  # a stage's receiving blocks start cold
    for s, m in zip(plan.stages, run.stages):
        for k, mb in zip(range(s.start, s.end), m.blocks):
            f, b = planned[k]
            rows.append(
                [
                    s.index,
                    plan.blocks[k].name,
                    _ms(f),
                    _ms(mb.fwd_s),
                    _pct(_err(f, mb.fwd_s)),
                    _ms(b),
                    _ms(mb.bwd_s),
                    _pct(_err(b, mb.bwd_s)),
                ]
            )
    if not rows:
        return "(the run timed no blocks: a compiled plan, a run of fewer than 3 steps, or a run.json written before per-block times)"
    headers = ["stage", "block", "fwd ms plan", "run", "err", "bwd ms plan", "run", "err"]
    table = tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True, colalign=("right", "left"))
    over = [[m.stage, _ms(m.fwd_overhead_s), _ms(m.bwd_overhead_s)] for m in run.stages if m.blocks]
    outside = tabulate(
        over,
        headers=["stage", "fwd ms outside blocks", "bwd ms outside blocks"],
        tablefmt="simple",
        disable_numparse=True,
    )
    return f"{table}\n\nper action, the runtime's time around the stage's blocks\n{outside}"
