"""The arithmetic of the counts a request asks for: the divisors a count-or-auto option searches over
and the default microbatch count.

Pure module: the standard library only, never torch.
"""

from __future__ import annotations

import math


def divisors(n: int) -> list[int]:
    """Every divisor of ``n`` (>= 1), ascending, in O(sqrt(n)).

    Args:
        n: a positive whole number.

    Returns:
        The divisors, 1 and ``n`` included.
    """
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def group_replicas(ep: int, tp: int) -> int:
    """The replicas an expert-parallel group of ``ep`` ranks covers where each pipeline rank is
    split over ``tp`` tensor-parallel ranks: ``ep / tp`` (the group spans them all, as Megatron-Core
    with an expert tensor-parallel size of 1 and torchtitan with ``etp`` 1 carve it; ``ep`` with
    ``tp`` 1).

    Args:
        ep: expert-parallel ranks (a multiple of ``tp``: ``expert_groups_fit``).
        tp: tensor-parallel ranks per pipeline rank.

    Returns:
        Replicas, at least 1.
    """
    return max(1, ep // tp)


def expert_groups_fit(ep: int, tp: int, replicas: int) -> bool:
    """Whether expert-parallel groups of ``ep`` ranks tile ``replicas`` replicas of ``tp``
    tensor-parallel ranks each: ``tp`` divides ``ep`` and the replicas a group covers
    (``group_replicas``) divide ``replicas``.

    Args:
        ep: expert-parallel ranks.
        tp: tensor-parallel ranks per pipeline rank.
        replicas: the replicas (or an HSDP shard group's) the groups must tile.

    Returns:
        True where they do.
    """
    return ep % tp == 0 and replicas % group_replicas(ep, tp) == 0


def default_microbatches(batch_size: int, gpus: int) -> int:
    """The microbatch count when none is given: one that divides the batch and keeps the bubble small.

    The smallest divisor of ``batch_size`` that is at least 2 x gpus (the bubble of GPipe and 1F1B
    is (p - 1) / (m + p - 1), so m = 2p keeps it near a third); else the smallest divisor that is at
    least ``gpus`` (what 1F1B needs); else the whole batch, one sample per microbatch.

    Args:
        batch_size: samples per step.
        gpus: pipeline stages.

    Returns:
        The microbatch count.
    """
    found = divisors(batch_size)  # O(sqrt(batch))
    for floor in (2 * gpus, gpus):
        fits = [d for d in found if d >= floor]
        if fits:
            return fits[0]
    return batch_size


__all__ = ["default_microbatches", "divisors"]
