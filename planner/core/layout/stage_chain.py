"""A pipeline pass's least makespan over every split into whole units: the stage chain, block by block.

Pure module: never imports torch. ``planner.core.layout.bounds.pipeline_floor`` bounds a pass by the
chain through the stages with the compute shared out continuously; but a stage holds whole units
(the blocks from one legal cut to the next), so where the stages are few blocks each (48 stages of
82 blocks) some stage must take two layers where the continuous share gives it 1.7, and the bound
misses a fifth of the step. ``StageChain.floor`` keeps the units whole.

Each stage ``s`` runs its ``m`` microbatches' forwards and backwards one at a time on its rank, after
the first microbatch's forward through every earlier stage and (with whole backwards) before the last
backward's way back through them: with ``H_s`` the compute of the units before the stage on that way
and ``W_s`` the stage's own per microbatch, the makespan is at least ``H_s + m W_s``. A makespan
``T`` is possible only if the units can be dealt to the stages in order so that every stage keeps
to it; dealing each stage as many units as it can take is never behind any other deal (the room a
stage has, ``T - H_s``, only grows with the units before it), so ``T`` is possible exactly where that
greedy deal covers every unit within the stages. ``floor`` bisects for the least such ``T``.
``tests/test_bounds.py`` checks it against every split of small problems.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

BISECTIONS = 40
"""Halvings of the interval the least makespan lies in: the floor is its lower end (relative error
about 1e-12 of the interval, which is never wider than the pass on one stage)."""


@dataclass(frozen=True)
class StageChain:
    """The units of a model in order, for ``floor``.

    Attributes:
        heads: prefix sums, from 0, of each unit's compute on the chain through the stages (forward
            and backward; forwards only where the schedule splits its backward, whose last action may
            be a weight half).
        works: prefix sums, from 0, of each unit's compute per microbatch (forward and backward).
    """

    heads: tuple[float, ...]
    works: tuple[float, ...]
    _floors: dict[tuple[int, int], float] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, heads: Sequence[float], works: Sequence[float]) -> StageChain:
        """The chain of units with these per-unit figures (see the attributes).

        Args:
            heads: each unit's compute on the chain, in model order.
            works: each unit's compute per microbatch, the same order.

        Returns:
            The chain.

        Raises:
            ValueError: the sequences differ in length.
        """
        if len(heads) != len(works):
            raise ValueError(f"{len(heads)} heads, {len(works)} works")
        return cls(tuple(itertools.accumulate(heads, initial=0.0)), tuple(itertools.accumulate(works, initial=0.0)))

    def floor(self, n_stages: int, m: int) -> float:
        """A lower bound of one pass's makespan over every split of the units into ``n_stages`` stages
        of ``m`` microbatches (kept: a search asks the same few thousand times).

        Args:
            n_stages: the pipeline's stages (ranks x stages per rank).
            m: microbatches in the pass.

        Returns:
            Seconds (0 without units, stages or microbatches, or more stages than units).
        """
        key = (n_stages, m)
        if key not in self._floors:
            self._floors[key] = self._least(n_stages, m)
        return self._floors[key]

    def floor_over(self, n_stages: int, m: int, other: float) -> float:
        """``max(other, floor(n_stages, m))``, with no bisection where the greedy deal covers the units
        within ``other`` (the floor is then at most ``other``): a caller that takes the larger of this
        floor and its other bounds often needs only that one deal.

        Args:
            n_stages: the pipeline's stages.
            m: microbatches in the pass.
            other: the caller's other bound, seconds.

        Returns:
            Seconds.
        """
        if (n_stages, m) not in self._floors and other > 0 and self._covers(other, n_stages, m):
            return other
        return max(other, self.floor(n_stages, m))

    def _least(self, n_stages: int, m: int) -> float:
        n_units = len(self.works) - 1
        if n_units < 1 or n_stages < 1 or m < 1 or n_stages > n_units:
            return 0.0
        lo, hi = 0.0, m * self.works[-1]  # one stage with everything keeps to m x the whole
        for _ in range(BISECTIONS):
            mid = (lo + hi) / 2
            if self._covers(mid, n_stages, m):
                hi = mid
            else:
                lo = mid
        return lo

    def _covers(self, makespan: float, n_stages: int, m: int) -> bool:
        """Whether the greedy deal keeps every stage within ``makespan`` and covers the units."""
        start, last = 0, len(self.works) - 1
        for _ in range(n_stages):
            room = (makespan - self.heads[start]) / m
            end = bisect.bisect_right(self.works, self.works[start] + room) - 1
            if end <= start:
                return False  # not even the next unit fits this stage
            if end >= last:
                return True
            start = end
        return False


__all__ = ["BISECTIONS", "StageChain"]
