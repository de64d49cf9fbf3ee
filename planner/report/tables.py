"""Balance report: the tables ``planner plan`` and ``planner report`` print.

Pure module (tabulate, no torch). Everything shown is read from the plan; nothing is recomputed.
"""

from __future__ import annotations

from tabulate import tabulate

from planner.schema.plan import Plan, Prediction

METHOD_TITLES = {
    "optimal": "planner (exact)",
    "uniform": "uniform layers (torchtitan/Megatron)",
    "params": "parameter-balanced (DeepSpeed)",
}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def _mb(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f}"


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def stage_table(plan: Plan) -> str:
    """One row per stage: its blocks, parameters, times, activations, memory, share of the bottleneck.

    Args:
        plan: the plan.

    Returns:
        The table as text.
    """
    bottleneck = plan.prediction.bottleneck_s
    rows = []
    for s in plan.stages:
        blocks = s.first_block if s.end - s.start == 1 else f"{s.first_block} .. {s.last_block}"
        if s.recompute:
            blocks += " [recompute]"
        rows.append(
            [
                s.index,
                f"{blocks} ({s.end - s.start})",
                _count(s.params),
                _ms(s.fwd_s),
                _ms(s.bwd_s),
                _ms(s.comm_s),
                _ms(s.time_s),
                _mb(s.activation_bytes),
                s.in_flight,
                _mb(s.memory_bytes),
                f"{100 * s.time_s / bottleneck:.0f}%" if bottleneck > 0 else "-",
            ]
        )
    headers = [
        "stage",
        "blocks (n)",
        "params",
        "fwd ms",
        "bwd ms",
        "comm ms",
        "total ms",
        "act MB/mb",
        "in flight",
        "memory MB",
        "of slowest",
    ]
    return tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True, colalign=("right", "left"))


def _split_text(pred: Prediction, n_blocks: int) -> str:
    ends = list(pred.starts[1:]) + [n_blocks]
    return "+".join(str(b - a) for a, b in zip(pred.starts, ends))


def summary_table(plan: Plan) -> str:
    """The plan's predicted figures beside the baselines' on the same costs.

    Args:
        plan: the plan.

    Returns:
        The table as text: one row per partition method.
    """
    rows = []
    chosen = plan.prediction
    entries = [(plan.method, chosen)] + [(k, v) for k, v in plan.baselines.items() if k != plan.method]
    for method, pred in entries:
        marker = " *" if method == plan.method else ""
        rows.append(
            [
                METHOD_TITLES.get(method, method) + marker,
                _split_text(pred, len(plan.blocks)),
                _ms(pred.bottleneck_s),
                _ms(pred.step_time_s),
                f"{100 * pred.bubble_fraction:.1f}%",
                f"{pred.imbalance:.3f}",
                _mb(pred.max_memory_bytes),
                f"{pred.step_time_s / chosen.step_time_s:.3f}x",
            ]
        )
    headers = [
        "partition",
        "blocks per stage",
        "slowest ms/mb",
        "step ms",
        "bubble",
        "imbalance",
        "max mem MB",
        "step vs plan",
    ]
    return tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)


def render(plan: Plan) -> str:
    """The full report: a header, the stage table and the summary table.

    Args:
        plan: the plan.

    Returns:
        The report text.
    """
    m = plan.model
    head = (
        f"{m.path} (size {m.size or 'default'}; traced by {m.trace_method}) on {plan.n_stages} x "
        f"{plan.profile.device}/{plan.profile.backend}, {plan.profile.threads} thread(s) per rank\n"
        f"schedule {plan.schedule}, batch {plan.batch_size} = {plan.n_microbatches} microbatches of "
        f"{plan.microbatch_size}; {len(plan.blocks)} blocks; link {plan.link.name} "
        f"({plan.link.latency_s * 1e3:.2f} ms + bytes / {plan.link.bandwidth_Bps / 1e9:.1f} GB/s)"
    )
    if m.trace_failures:
        head += "\n" + "\n".join(f"  {method} could not trace it: {reason}" for method, reason in m.trace_failures)
    summary = (
        f"predicted step {_ms(plan.prediction.step_time_s)} ms, bubble {100 * plan.prediction.bubble_fraction:.1f}%, "
        f"imbalance {plan.prediction.imbalance:.3f} (slowest / mean stage)"
    )
    return "\n\n".join([head, stage_table(plan), summary_table(plan), summary])
