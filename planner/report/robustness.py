"""The search's robustness as the report shows it: each row's step on slower hardware, and a warning where that changes the winner.

Pure module: never imports torch. The slowed steps are the plan's own (``Candidate.slow_step_time_s``,
written by ``planner.core.layout.robust.robust_rows``: every collective and send 1.3x slower, compute
1.1x slower); this module only formats them and reads the verdict off the plan's rows.
"""

from __future__ import annotations

from planner.core.layout.robust import SLOW, chosen_row, verdict
from planner.schema.plan import Candidate, Plan

HEADER = "slowed"
"""The robustness column's header: the step's change under ``SLOW``."""


def what_if() -> str:
    """The slowdown in words: "collectives 1.3x, compute 1.1x slower"."""
    return f"collectives {SLOW.collectives:g}x, compute {SLOW.compute:g}x slower"


def has_column(plan: Plan) -> bool:
    """Whether any of the plan's search rows was re-priced (older plans have none)."""
    return any(c.slow_step_time_s is not None for c in plan.search)


def slowed_cell(c: Candidate) -> str:
    """A row's step change under the slowdown: "+14.2%" ("-" where it was not re-priced).

    Args:
        c: a search row.

    Returns:
        The cell.
    """
    if c.slow_step_time_s is None or c.step_time_s <= 0:
        return "-"
    return f"{c.slow_step_time_s / c.step_time_s - 1:+.1%}"


def describe_row(c: Candidate) -> str:
    """A search row in one phrase: "1f1b, pp=4, m=32, dp=2 (fsdp), tp=8" (what is 1 left out)."""
    text = f"{c.schedule}, pp={len(c.starts) // c.stages_per_rank}, m={c.n_microbatches}"
    text += f", k={c.accumulation} passes" if c.accumulation > 1 else ""
    text += f", {c.stages_per_rank} stages per rank" if c.stages_per_rank > 1 else ""
    if c.dp > 1:
        mode = f"hsdp in groups of {c.dp_shard}" if c.dp_mode == "hsdp" else c.dp_mode
        text += f", dp={c.dp} ({mode}{' per block' if c.fsdp_units == 'block' else ''})"
    if c.tp > 1:
        text += f", tp={c.tp}" + (" with sequence parallelism" if c.sequence_parallel else "")
    if c.cp > 1:
        text += f", cp={c.cp}" + (" (ring attention)" if c.cp_attention == "ring" else "")
    return text


def robust_line(plan: Plan) -> str:
    """One line where the slowdown changes the winner, naming the robust runner-up; else empty.

    Args:
        plan: the plan.

    Returns:
        The warning, or "" (the choice holds, or nothing was re-priced).
    """
    chosen = chosen_row(plan)
    if chosen is None:
        return ""
    v = verdict(plan.search, chosen)
    if v is None or not v.flips:
        return ""
    mine, other = plan.search[v.chosen], plan.search[v.slow_winner]
    assert mine.slow_step_time_s is not None and other.slow_step_time_s is not None  # both re-priced (verdict)
    lead = mine.slow_step_time_s / other.slow_step_time_s - 1
    return (
        f"not robust: with {what_if()} the robust runner-up, {describe_row(other)}, would be {lead:.1%} faster "
        f"({other.slow_step_time_s * 1e3:.4g} ms against {mine.slow_step_time_s * 1e3:.4g} ms; as modelled it is "
        f"{other.step_time_s / mine.step_time_s - 1:+.1%})"
    )


__all__ = ["HEADER", "describe_row", "has_column", "robust_line", "slowed_cell", "what_if"]
