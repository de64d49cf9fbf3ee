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
