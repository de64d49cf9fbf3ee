"""Predicted against measured: how far the plan's figures were from what ``planner run`` saw.

Pure module (tabulate, no torch). Reads a Plan and the RunResult of running it; nothing is
re-measured. Errors are ``(predicted - measured) / measured``: negative means the plan
under-predicted (the run was slower or bigger than planned).
"""

from __future__ import annotations

from tabulate import tabulate

from planner.errors import PlanFileError
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


def step_error(plan: Plan, run: RunResult) -> float:
    """Relative error of the predicted step time: ``(predicted - measured) / measured``.

    Args:
        plan: the plan that was run.
        run: its measured run (``median_step_s``).

    Returns:
        The signed relative error (0.1 = predicted 10% too slow).

    Raises:
        PlanFileError: the run is not of this plan's model, or measured no time.
    """
    if run.plan_fingerprint != plan.model.fingerprint:
        check_run_matches(plan, run)
    if run.median_step_s <= 0:
        raise PlanFileError("the run's median step time is 0; re-run `planner run` with more steps")
    return (plan.prediction.step_time_s - run.median_step_s) / run.median_step_s


def compare_table(plan: Plan, run: RunResult) -> str:
    """Per stage: predicted vs measured forward and backward per microbatch, optimizer step and
    peak memory, with errors; then predicted vs measured step time.

    Measured memory is the tracked tensor peak (``StageMeasure.memory.peak_bytes``); "-" when the
    run tracked none (a 1-step run).

    Args:
        plan: the plan that was run.
        run: its run.json.

    Returns:
        The two tables as text.

    Raises:
        PlanFileError: the run is not of this plan (see ``check_run_matches``).
    """
    check_run_matches(plan, run)
    rows = []
    for s, m in zip(plan.stages, run.stages):
        blocks = s.first_block if s.end - s.start == 1 else f"{s.first_block} .. {s.last_block}"
        mem = m.memory.peak_bytes if m.memory is not None else None
        rows.append(
            [
                s.index,
                blocks,
                _ms(s.fwd_s),
                _ms(m.fwd_s),
                _pct(_err(s.fwd_s, m.fwd_s)),
                _ms(s.bwd_s),
                _ms(m.bwd_s),
                _pct(_err(s.bwd_s, m.bwd_s)),
                _ms(s.opt_s),
                _ms(m.optimizer_s),
                _pct(_err(s.opt_s, m.optimizer_s)),
                _mb(s.memory_bytes),
                "-" if mem is None else _mb(mem),
                "-" if mem is None else _pct(_err(s.memory_bytes, mem)),
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
    predicted, measured = plan.prediction.step_time_s, run.median_step_s
    summary = tabulate(
        [["step", _ms(predicted), _ms(measured), _pct(_err(predicted, measured))]],
        headers=["", "plan ms", "run ms", "err"],
        tablefmt="simple",
        disable_numparse=True,
    )
    return f"{stages}\n\n{summary}"
