"""Expert parallelism: which layouts can shard a mixture-of-experts model's experts over replicas.

Pure module (no torch). A plan of ``ep`` > 1 shards each experts module over ``ep`` consecutive
replicas of the same pipeline rank (``planner.schema.plan.Plan.ep``); the runner dispatches the
tokens routed to them with all-to-alls (``planner.run.experts``). ``ep_refusal`` says, in one line,
what the runner does not run with it yet, so that ``planner plan`` never writes such a plan and
``planner run`` refuses one before any process starts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from planner.core.step.schedules import ZERO_BUBBLE


def ep_refusal(
    ep: int,
    experts: Mapping[str, int],
    *,
    dp: int,
    tp: int,
    dp_mode: str,
    schedule: str,
    compiled: bool = False,
    recompute: Sequence[str] = (),
) -> str | None:
    """Why a layout cannot shard its experts ``ep`` ways, or None when it can (or ``ep`` is 1).

    Args:
        ep: expert-parallel ranks.
        experts: each experts module's name -> its expert count (``Plan.experts``).
        dp: data-parallel replicas (the expert-parallel ranks are replicas).
        tp: tensor-parallel ranks per pipeline rank.
        dp_mode: how the replicas reduce gradients ("ddp", "fsdp", "hsdp").
        schedule: the pipeline schedule.
        compiled: whether the stages are compiled (``--compile``).
        recompute: each stage's recompute value.

    Returns:
        One line naming what stands in the way and what to give instead.
    """
    if ep == 1:
        return None
    if not experts:
        return f"--ep {ep}: the model has no experts to shard (no ep_plan, nor a Hugging Face base_model_ep_plan)"
    odd = next(((name, n) for name, n in experts.items() if n % ep), None)
    if odd is not None:
        return f"--ep {ep} does not divide the {odd[1]} experts of {odd[0]}"
    if dp % ep:
        return f"--ep {ep} does not divide the {dp} data-parallel replicas, over which the experts are sharded"
    notyet = [
        (tp > 1, f"with tensor parallelism (tp {tp})", "--tp 1"),
        (dp_mode != "ddp", f"with {dp_mode.upper()} replicas", "--dp-mode ddp"),
        (schedule in ZERO_BUBBLE, f"under {schedule} (a two-part backward)", "another schedule"),
        (compiled, "compiled", "no --compile"),
        (any(r != "never" for r in recompute), "with recomputation", "--recompute never"),
    ]
    for blocked, what, instead in notyet:
        if blocked:
            return f"--ep {ep}: expert parallelism does not run {what} yet; give {instead} (or --ep 1)"
    return None


__all__ = ["ep_refusal"]
