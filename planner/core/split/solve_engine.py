"""The vectorised engine of the exact partition search (``planner.core.split.solve`` describes the method).

Pure module (numpy, no torch). Block ranges (possible stages) ``[s, e)`` are held as arrays (``Stages``) with
their cost per link variant and their memory thresholds on the live-microbatch count; ``stage_bands``
and ``banded_pairs`` list only the stages some stage index can hold under a cost cap, and
``exact_partition`` runs the dynamic programme over (stage index, end block) on them: the least
bottleneck first, then the least total cost among the splits within ``REL_EPS`` of it, then the
lexicographically first (or last) starts. ``planner.core.split.solve`` builds the ranges from block
costs and memory; ``planner.core.split.baselines`` from parameter counts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from planner.errors import InfeasibleError
from planner.schema.costs import BlockCost

# Relative tolerance under which two bottlenecks / cost sums count as equal (float sums in a
# different order differ in the last bits; exact ties must not depend on that).
REL_EPS = 1e-9


FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]
BoolArray = NDArray[np.bool_]
# Memory arithmetic runs in int64, or in Python integers (dtype object) when a model's byte counts
# could overflow int64; the arrays of byte counts are typed loosely for that reason.
AnyIntArray = NDArray[Any]


def tol(x: float) -> float:
    return REL_EPS * max(1.0, abs(x))


def legal_starts(blocks: Sequence[BlockCost]) -> list[bool]:
    """``legal[c]``: a stage may start at block c, i.e. a cut after block c-1 is legal (1 <= c < n)."""
    n = len(blocks)
    return [False] + [blocks[c - 1].cut_legal for c in range(1, n)] + [False]


def check_counts(blocks: Sequence[BlockCost], n_stages: int) -> None:
    n = len(blocks)
    if n == 0:
        raise InfeasibleError("blocks is empty; expected at least one block; profile a non-empty model.")
    if n_stages < 1:
        raise InfeasibleError(f"--gpus {n_stages}: need at least one stage; use --gpus 1 or more")
    if n_stages > n:
        raise InfeasibleError(
            f"--gpus {n_stages} is more than the model's {n} blocks (at most one stage per block); "
            f"use --gpus {n} or fewer, or split the model into finer blocks"
        )
    n_legal = sum(legal_starts(blocks))
    if n_legal < n_stages - 1:
        raise InfeasibleError(
            f"--gpus {n_stages} needs {n_stages - 1} cuts but the model has only {n_legal} legal cut "
            f"positions; use --gpus {n_legal + 1} or fewer, or make more block boundaries cuttable"
        )


def last_true(starts: IntArray, n: int, ok: Callable[[IntArray, IntArray], BoolArray]) -> IntArray:
    """Per start ``s``, the largest ``e`` in ``[s, n]`` with ``ok(s, e)``, or ``s`` when there is none.

    ``ok(s, e)`` must be true up to some end and false after it (monotone in ``e``), so a binary
    search per start finds that end: O(log n) vectorised steps.
    """
    lo = starts.copy()
    hi = np.full_like(starts, n)
    while True:
        active = lo < hi
        if not active.any():
            return lo
        mid = (lo + hi + 1) // 2
        good = active & ok(starts, mid)
        lo = np.where(good, mid, lo)
        hi = np.where(active & ~good, mid - 1, hi)


def range_pairs(starts: IntArray, first: IntArray, last: IntArray, end_ok: BoolArray) -> tuple[IntArray, IntArray]:
    """All stages ``[s, e)`` with ``s`` in ``starts``, ``first[s] <= e <= last[s]`` and ``end_ok[e]``, sorted by (s, e)."""
    counts = np.maximum(last - first + 1, 0)
    total = int(counts.sum())
    s = np.repeat(starts, counts)
    offset = np.repeat(np.cumsum(counts) - counts, counts)
    e = np.repeat(first, counts) + (np.arange(total, dtype=np.int64) - offset)
    keep = end_ok[e]
    return s[keep], e[keep]


def stage_bands(
    n: int, p: int, starts: IntArray, last: IntArray, short: Callable[[int, int], bool]
) -> tuple[IntArray, IntArray]:
    """Where stage k of ``p`` can start: between ``back[p - k]`` and ``reach[k]``.

    ``reach[k]`` is the furthest block stage k can start at: stage k - 1 starts at most at
    ``reach[k - 1]`` and ends at most at the furthest window end (``last``) of such a start.
    ``back[j]`` is the earliest block from which j stages can cover the rest: ``short(s, e)`` must be
    necessary for a stage ``[s, e)`` to be a block range and stay true when the stage shrinks, so the
    earliest start that can end at or after ``back[j - 1]`` is the earliest one that ends exactly
    there. Both over-approximate (they ignore illegal cuts and some costs), so no range of a
    complete partition falls outside; O(p log n).
    """
    reach = np.zeros(p + 1, dtype=np.int64)
    furthest = np.maximum.accumulate(last)
    for k in range(1, p + 1):
        i = int(np.searchsorted(starts, reach[k - 1], side="right")) - 1
        reach[k] = max(int(reach[k - 1]), int(furthest[i]))
    back = np.full(p + 1, n, dtype=np.int64)
    for j in range(1, p + 1):
        e = int(back[j - 1])
        lo, hi = 0, e  # the earliest s in [0, e] with short(s, e); e itself when even [e, e) fails
        while lo < hi:
            mid = (lo + hi) // 2
            if short(mid, e):
                hi = mid
            else:
                lo = mid + 1
        back[j] = lo
    return reach, back


def banded_pairs(
    n: int, p: int, starts: IntArray, last: IntArray, end_ok: BoolArray, reach: IntArray, back: IntArray
) -> tuple[IntArray, IntArray]:
    """The stages ``[s, e)`` with ``e <= last[s]`` that some stage index k can hold: s in k's start
    range ``[back[p - k], reach[k]]``, e in stage k + 1's (or n for the last stage)."""
    # The stage indices that can start at s: from the first whose reach gets there to the last whose
    # back bound allows it (and at most s, one block per earlier stage; stage 0 only at block 0).
    k_first = np.searchsorted(reach[:p], starts, side="left")
    k_last = np.searchsorted(back[p:0:-1], starts, side="right") - 1
    k_last = np.minimum(k_last, starts)
    ok = k_first <= k_last
    starts, last, k_first, k_last = starts[ok], last[ok], k_first[ok], k_last[ok]
    first = np.maximum(starts + 1, back[p - 1 - k_first])
    last = np.minimum(last, n - (p - 1 - k_last))
    return range_pairs(starts, first, last, end_ok)


class Stages:
    """Block ranges (possible stages) ``[s, e)`` of a partition search, sorted by (s, e), with their costs.

    Every stage that can be part of a partition the search cares about is listed; a stage not listed
    is one the search may ignore (it costs more than the cap, or cannot fit memory). A stage placed
    at stage index k holds ``t = in_flight[k]`` live microbatches and costs ``costs[i]`` for the
    first option i (a way to run it: without recomputation, with some) that fits, ``t <= fits[i]``,
    else inf: the first option whose ``_MemoryModel.bytes`` fit, on arrays. Memory only grows with
    ``t``, so a stage's fit is one threshold on ``t`` per option, computed once per stage rather than
    once per stage index.

    ``complete`` says the cost cap did not remove any stage that fits memory, so a search on this
    table is exact whatever the optimum is. Only stages that some stage index can hold are listed
    (see ``stage_bands``), and each pass looks at stage k's band only.
    """

    def __init__(
        self,
        n: int,
        pairs: tuple[IntArray, IntArray],
        costs: tuple[FloatArray, ...],
        fits: tuple[IntArray, ...],
        complete: bool,
        t_span: tuple[int, int],
        band: tuple[IntArray, IntArray],
        by_end: bool = False,
    ) -> None:
        """Args: ``pairs`` the stages' starts and ends ``(s, e)``; ``costs`` their costs under each
        option, in the order they are tried; ``fits`` the most live microbatches they fit with each;
        the rest as the class says."""
        s, e = pairs
        self.n = n
        # costs: one row per cost variant (the links around the stage, ``_Arrays.variant``)
        self.s, self.e, self.costs, self.fits = s, e, costs, fits
        self.complete = complete
        self.t_span = t_span
        self.reach, self.back = band  # stage k starts in [back[p - k], reach[k]] (see stage_bands)
        # seg: the first stage of each start (each end when sorted by end), for reduceat.
        per = np.bincount(e if by_end else s, minlength=n + 1)
        self.seg: IntArray = (np.cumsum(per) - per)[per > 0]
        # s_ptr[s]:s_ptr[s + 1] are the stages starting at s (s < n), when sorted by start.
        self.s_ptr: IntArray = np.concatenate(([0], np.cumsum(per)))
        # When the stage index cannot change a stage's option (no limit, or all in-flight counts
        # fit the same way), its cost is one array for every stage index: the first option that
        # fits every count, when no option before it fits any.
        t_lo, t_hi = t_span
        self._fixed: FloatArray | None = None
        for c, t in zip(costs, fits):
            if not len(s) or int(t.min()) >= t_hi:
                self._fixed = c
                break
            if int(t.max()) >= t_lo:
                break
        self._cached: tuple[tuple[int, int], FloatArray] | None = None
        self._capped: tuple[tuple[int, int], FloatArray] | None = None

    def cost(self, t: int, v: int = 0, lo: int = 0, up: int | None = None) -> FloatArray:
        """Cost of stages ``lo:up`` in variant ``v`` when they hold ``t`` live microbatches (inf: they do not fit)."""
        if self._fixed is not None:
            return self._fixed[v, lo:up]
        if self._cached is not None and self._cached[0] == (t, v):
            return self._cached[1][lo:up]
        out: FloatArray = np.full(len(self.fits[0][lo:up]), math.inf)
        for c, fit in reversed(list(zip(self.costs, self.fits))):  # the first option that fits wins
            out = np.where(t <= fit[lo:up], c[v, lo:up], out)
        if lo == 0 and up is None:  # a whole row: GPipe asks for the same t at every stage index
            self._cached = ((t, v), out)
        return out

    def capped(self, t: int, v: int, thr: float) -> FloatArray:
        """``cost(t, v)`` with every stage costing more than ``thr`` set to inf (NaN stays NaN, as
        ``cost > thr`` is false for it in the reference)."""
        key = (-1 if self._fixed is not None else t, v)
        if self._capped is None or self._capped[0] != key:
            cost = self.cost(t, v)
            self._capped = (key, np.where(cost > thr, math.inf, cost))
        return self._capped[1]

    def allowed(self, t: int, lo: int, up: int) -> BoolArray:
        """Whether stages ``lo:up`` fit memory (some way) when they hold ``t`` live microbatches."""
        out: BoolArray = np.zeros(len(self.fits[0][lo:up]), dtype=bool)
        for fit in self.fits:
            out |= t <= fit[lo:up]
        return out

    def by_end(self) -> Stages:
        """The same stages sorted by (e, s): the order the bottleneck pass groups them in."""
        # A stable sort of small integers is a radix sort in numpy: linear in the stage count.
        key = self.e.astype(np.uint16) if self.n < 2**16 else self.e
        order = np.argsort(key, kind="stable")
        if self._fixed is not None:  # only the cost matters, one gather instead of several
            cost = self._fixed[:, order]
            t_any = np.zeros(1, dtype=np.int64)
            band = (self.reach, self.back)
            pairs = (self.s[order], self.e[order])
            return Stages(self.n, pairs, (cost,), (t_any,), self.complete, (0, 0), band, True)
        return Stages(
            self.n,
            (self.s[order], self.e[order]),
            tuple(c[:, order] for c in self.costs),
            tuple(t[order] for t in self.fits),
            self.complete,
            self.t_span,
            (self.reach, self.back),
            True,
        )


def _bottleneck(stages: Stages, n: int, p: int, in_flight: Sequence[int], variant: Sequence[int]) -> float:
    """Pass 1: the least bottleneck over partitions made of ``stages`` (inf: none).

    ``best[e]`` is the least bottleneck covering blocks ``[0, e)`` with stages 0..k; stage k's row is
    the minimum over its block ranges ``[s, e)`` of ``max(best[s], cost)``, one vectorised pass
    over the ranges grouped by end. Stage k must leave a block for each later stage and only the
    last one ends at n, exactly as in the O(p n^2) programme.
    """
    inf = math.inf
    best = np.full(n + 1, inf)
    lo, up = 0, int(stages.s_ptr[1])  # the stages starting at block 0
    ends = stages.e[lo:up]
    first = stages.cost(in_flight[0], variant[0])[lo:up]
    keep = ends == n if p == 1 else ends <= n - (p - 1)
    best[ends[keep]] = first[keep]
    if p == 1:
        return float(best[n])
    # A NaN cost (an infinite recompute_s) never improves a later stage: the reference's `v < cur[e]`
    # is false for it. Only the row of stage 0 can hold one; later rows take minima that skip NaN.
    best[np.isnan(best)] = inf
    table = stages.by_end()
    reach, back = stages.reach, stages.back
    for k in range(1, p):
        cost = table.cost(in_flight[k], variant[k])
        # Stage k ends where stage k + 1 can start (n for the last): other rows cannot complete.
        e_lo, e_hi = (
            (n, n) if k == p - 1 else (max(k + 1, int(back[p - 1 - k])), min(int(reach[k + 1]), n - (p - 1 - k)))
        )
        lo, up = int(np.searchsorted(table.e, e_lo, side="left")), int(np.searchsorted(table.e, e_hi, side="right"))
        # max(best[s], cost) as the reference takes it: a NaN cost leaves best[s].
        v = np.fmax(cost[lo:up], best[table.s[lo:up]])
        cur = np.full(n + 1, inf)
        if up > lo:
            seg = table.seg[(table.seg >= lo) & (table.seg < up)]
            cur[table.e[seg]] = np.minimum.reduceat(v, seg - lo)
        if not np.isfinite(cur).any():
            return inf
        best = cur
    return float(best[n])


def _tie_break(
    stages: Stages, n: int, p: int, in_flight: Sequence[int], variant: Sequence[int], thr: float, latest: bool
) -> tuple[int, ...]:
    """Pass 2 and reconstruction: among partitions with every stage cost <= ``thr``, the least sum of
    stage costs, then the lexicographically smallest starts (largest with ``latest``).

    ``suf[k][s]`` is the least sum covering ``[s, n)`` with stages k..p-1, computed right to left as
    ``cost + suf[k + 1][e]``, the same float additions in the same order as the O(p n^2) programme,
    so the reconstruction below, which takes the first end within the tie tolerance of the target,
    sees the same numbers and makes the same choices.
    """
    inf = math.inf
    suf = np.full((p + 1, n + 1), inf)
    suf[p, n] = 0.0
    s_all, e_all = stages.s, stages.e
    for k in range(p - 1, -1, -1):
        # Only starts stage k can have: the reconstruction never reads another row, and no end it
        # reads lies beyond the next stage's reach.
        s_lo, s_hi = (0, 0) if k == 0 else (max(k, int(stages.back[p - k])), min(int(stages.reach[k]), n - (p - k)))
        if s_hi < s_lo:
            continue
        lo, up = int(stages.s_ptr[s_lo]), int(stages.s_ptr[s_hi + 1])
        if up <= lo:
            continue
        # The reference skips an end with suf[k + 1][e] == inf or a cost above thr; both give an inf
        # sum here (inf + x, x + inf), which never wins either. Ends that leave too few blocks for the
        # later stages have suf[k + 1][e] == inf, so they need no test of their own.
        v = stages.capped(in_flight[k], variant[k], thr)[lo:up] + suf[k + 1][e_all[lo:up]]
        seg = stages.seg[(stages.seg >= lo) & (stages.seg < up)]
        mins = np.fmin.reduceat(v, seg - lo)  # NaN sums never win (the reference's `v < m`)
        mins[np.isnan(mins)] = inf
        suf[k, s_all[seg]] = mins
    starts = [0]
    s = 0
    for k in range(p - 1):
        target = float(suf[k, s])
        bound = target + tol(target)
        lo, up = int(stages.s_ptr[s]), int(stages.s_ptr[s + 1])
        t = in_flight[k]
        ends = e_all[lo:up]
        cost = stages.cost(t, variant[k], lo, up)
        nxt = suf[k + 1][ends]
        ok = (nxt != inf) & (ends <= n - (p - 1 - k)) & ~(cost > thr) & stages.allowed(t, lo, up)
        ok &= cost + nxt <= bound
        hits = np.flatnonzero(ok)
        if not len(hits):  # pragma: no cover - pass 2 guarantees a continuation exists
            raise RuntimeError("partition DP reconstruction failed (planner bug)")
        s = int(ends[hits[-1] if latest else hits[0]])
        starts.append(s)
    return tuple(starts)


def exact_partition(
    n: int,
    p: int,
    in_flight: Sequence[int],
    ranges: Callable[[float], Stages],
    first_cap: float,
    latest: bool = False,
    variant: Sequence[int] | None = None,
    any_fit: Callable[[], bool] | None = None,
) -> tuple[int, ...] | None:
    """Exact partition of ``n`` items into ``p`` contiguous non-empty stages on block ranges.

    Minimises the max stage cost; among partitions within ``REL_EPS`` of that optimum, minimises the
    sum of stage costs; among those, returns the lexicographically smallest starts (largest with
    ``latest``): the O(p n^2) dynamic programme's answer, computed on those ranges only.

    ``ranges(cap)`` lists every stage whose cost can be <= ``cap`` and that fits memory (a
    superset is fine). Pass 1 runs on the ranges under a guessed cap: if the best bottleneck it
    finds is within the cap, every stage of every better partition was a block range, so it is the
    optimum; otherwise that bottleneck (a real partition's, so an upper bound on the optimum) plus
    the tolerance becomes the cap, or the cap doubles when no partition was found, until the ranges
    are all stages that fit (``complete``), where infeasibility is exact. Pass 2 then needs only the
    stages within the optimum plus the tolerance: the last pass's ranges where its cap covers that
    (a superset is fine), else those listed anew. Each pass is O(p x ranges) vectorised work.

    Args:
        n: number of items.
        p: number of stages.
        in_flight: live microbatches of each stage index (decides how a stage fits memory).
        ranges: the block ranges under a cap on the stage cost (``math.inf``: no cap).
        first_cap: the first cap to try (any value; a good guess saves a pass).
        latest: pick the lexicographically largest starts instead (earlier stages as full as possible).
        variant: the cost row of each stage index (None: row 0 for all).
        any_fit: whether some partition fits memory at all (None: not known). Asked once, when a
            pass under a finite cap finds no partition: where it says no, the answer is None at
            once instead of after the passes that double the cap until the ranges are complete.
            It must not say no where a partition of the ranges fits.

    Returns:
        The starts, or None when no partition fits.
    """
    rows = list(variant) if variant is not None else [0] * p
    cap = first_cap
    while True:
        stages = ranges(cap)
        opt = _bottleneck(stages, n, p, in_flight, rows)
        if opt <= cap or stages.complete:
            break
        if opt < math.inf:
            # a real partition's bottleneck (with the tolerance pass 2 reads within): the next pass
            # is exact, and its ranges hold every stage pass 2 needs
            cap = opt + tol(opt)
        else:
            if any_fit is not None and not any_fit():
                return None  # memory rules out every partition: no larger cap can find one
            any_fit = None  # some partition fits: only the cap kept it out
            cap = 2 * cap if 0 < cap < math.inf else math.inf
    if opt == math.inf:
        return None
    thr = opt + tol(opt)
    # pass 2 on the last pass's ranges where they hold every stage within thr (a superset is fine):
    # after a pass under a real partition's bottleneck they are those of thr's own
    return _tie_break(stages if thr <= cap else ranges(thr), n, p, in_flight, rows, thr, latest)
