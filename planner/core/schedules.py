"""Pure action orders of the single-stage pipeline schedules the planner supports.

Pure module: never imports torch. The orders reproduce, action for action, what
``torch.distributed.pipelining.ScheduleGPipe`` and ``Schedule1F1B`` execute in their
``_step_microbatches`` (torch 2.13), so that simulation and memory accounting describe the run
that actually happens. ``tests/test_schedules_torch.py`` checks this against torch itself.
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.errors import InfeasibleError

Action = tuple[str, int]
"""One compute action: ("F" or "B", microbatch index)."""

SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")


def check_schedule(schedule: str, n_stages: int, n_microbatches: int) -> None:
    """Reject requests torch's schedules cannot run: the one place this rule lives (the planner checks it
    before profiling, the runner before launching, ``action_order`` always).

    Raises:
        InfeasibleError: unknown schedule, p < 1, m < 1, or 1F1B with m < p (torch refuses it).
    """
    if schedule not in SCHEDULES:
        raise InfeasibleError(
            f"schedule {schedule!r} is not supported; expected one of {', '.join(SCHEDULES)}; pick one of those."
        )
    if n_stages < 1:
        raise InfeasibleError(f"--gpus {n_stages}: need at least one stage; use --gpus 1 or more")
    if n_microbatches < 1:
        raise InfeasibleError(f"--microbatches {n_microbatches}: need at least one microbatch; use -m 1 or more")
    # torch's Schedule1F1B.__init__ raises ValueError when n_microbatches < num_stages.
    if schedule == "1f1b" and n_microbatches < n_stages:
        raise InfeasibleError(
            f"--microbatches {n_microbatches} is too small for --schedule 1f1b with {n_stages} stages: "
            f"torch's Schedule1F1B needs at least one microbatch per stage; use -m {n_stages} or more, "
            "fewer --gpus, or --schedule gpipe"
        )


def action_order(schedule: str, n_stages: int, n_microbatches: int) -> list[list[Action]]:
    """Per-rank order of forward/backward actions of one training step (one stage per rank).

    GPipe (``ScheduleGPipe._step_microbatches``): every rank runs F0..F(m-1), then B0..B(m-1).

    1F1B (``Schedule1F1B._step_microbatches``): stage ``i`` (0-based) first runs
    ``w = min(m, p - i)`` warm-up forwards, then alternates "1B1F" (B first) until all forwards
    are issued, then drains the remaining backwards. This equals Megatron's 1F1B order
    (Narayanan et al. 2021 §2.2.1): p-1-i warm-up forwards followed by F/B pairs.

    Args:
        schedule: "gpipe" or "1f1b".
        n_stages: number of pipeline stages p (= ranks).
        n_microbatches: number of microbatches m per step.

    Returns:
        ``orders[i]`` is the list of ``(kind, microbatch)`` actions rank ``i`` runs, in order.

    Raises:
        InfeasibleError: unknown schedule, p < 1, m < 1, or 1F1B with m < p (torch refuses it).
    """
    check_schedule(schedule, n_stages, n_microbatches)
    m = n_microbatches
    orders: list[list[Action]] = []
    for stage in range(n_stages):
        if schedule == "gpipe":
            order: list[Action] = [("F", mb) for mb in range(m)] + [("B", mb) for mb in range(m)]
        else:
            warmup = min(m, n_stages - stage)
            order = [("F", mb) for mb in range(warmup)]
            fwd, bwd = warmup, 0
            # "1B1F" steady state exactly as torch: B first, then F while forwards remain.
            while True:
                order.append(("B", bwd))
                bwd += 1
                if fwd == m:
                    break
                order.append(("F", fwd))
                fwd += 1
            order.extend(("B", mb) for mb in range(bwd, m))
        orders.append(order)
    return orders


def peak_in_flight(order_for_rank: Sequence[Action]) -> int:
    """Peak number of microbatches whose forward ran on this rank and backward has not yet.

    This is how many microbatches' activations the rank holds at once (GPipe: m on every stage;
    1F1B: min(m, p - i) on stage i, Narayanan et al. 2021).

    Args:
        order_for_rank: one rank's action order, as returned by ``action_order``.

    Returns:
        The maximum, over prefixes of the order, of (#F - #B).

    Raises:
        ValueError: an action kind other than "F" or "B".
    """
    live = 0
    peak = 0
    for kind, _mb in order_for_rank:
        if kind == "F":
            live += 1
            peak = max(peak, live)
        elif kind == "B":
            live -= 1
        else:
            raise ValueError(f"action kind {kind!r} is invalid; expected 'F' or 'B'.")
    return peak
