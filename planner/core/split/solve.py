"""The exact pipeline partition solver: ``solve``, its memory model and its errors.

Pure module: never imports torch (numpy only). A partition splits the blocks (in execution order)
into contiguous, non-empty stages, one per rank, cutting only after blocks whose ``cut_legal`` is
True.

``solve`` is exact: it minimises the bottleneck stage cost (the slowest stage bounds the
steady-state throughput of GPipe and 1F1B alike, Narayanan et al. 2021 Eq. 1), as PipeDream and
Alpa do, subject to a per-stage memory limit, and breaks ties deterministically (least total stage
cost, then lexicographically smallest starts). It is the dynamic programme over (stage index, end
block) of PipeDream, computed on block ranges only (``planner.core.split.solve_engine.exact_partition``):

* A stage ``[s, e)`` costs ``(pre[e] - pre[s]) + send_in[s] + send_out[e]`` (+ its recomputation),
  where a boundary's terms hold its messages both ways and the cold start of the block that waits
  for them (``cold_in``, ``cold_out``), so its cost without the per-end message term is
  non-decreasing in ``e``. With a link per boundary (ranks on several nodes, ``NodeLinks``) the
  message terms depend on the stage index k through the links of boundaries k - 1 and k: each stage
  index takes one of a few cost rows (``_Arrays.variant``; at most four with an intra- and an
  inter-node link), and the bound above uses the cheapest link; a stage whose lower bound exceeds a
  cap on the bottleneck can never be part of a partition under that cap. The same holds for a lower
  bound of its memory. Each start therefore has a window of possible ends, found by binary search,
  and the programme only looks at those pairs; each stage index only at the starts it can have
  (``stage_bands``). The cap starts near the average stage and rises to the best bottleneck found
  until that is within it.
* Memory grows with the number of live microbatches ``t``, so each range's fit is one
  threshold on ``t`` (computed once, in integers), and the stage index enters only through
  ``in_flight[k]``.
* Every range's cost is computed with the same floating-point operations, in the same order,
  as a stage-by-stage evaluation, and the programme takes the same minima and applies the same
  1e-9 tie tolerance; the result is the same partition the O(p n^2) programme returns, not just
  one of equal cost (the tests check this against that programme and brute force).

With ``w`` possible ends per start (about the blocks of the widest stage under the optimum) it
runs in O(p n w) vectorised operations plus O(n log n) for the windows, instead of O(p n^2) calls:
2,000 blocks on 64 stages take well under a second (docs/solver_scaling.md). The worst case, a
bottleneck so large that most stages fit under it (one block dwarfing the rest, or all costs zero),
is still O(p n^2), vectorised (about a second at that size). When nothing fits, the error names the
smallest stage count that would, found by one reachability sweep from the last stage for all counts
at once (``_FitSearch``).

What a stage costs and holds is ``planner.core.split.stage_model``'s (shared with ``predict`` and the
search); the vectorised programme over block ranges is ``planner.core.split.solve_engine``'s (shared
with the parameter-balanced baseline, ``planner.core.split.baselines``); the links per boundary are
``planner.core.levers.links``'.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from planner.core.layout.inputs import NO_CONSTRAINTS, Constraints, Layout, check_in_flight
from planner.core.levers.links import Links, boundary_crosses, boundary_links, default_link
from planner.core.levers.recompute import with_loss
from planner.core.split.cuts import Split
from planner.core.split.range_sums import StepTempArrays, block_sums, block_times, message_rows
from planner.core.split.solve_engine import (
    AnyIntArray,
    BoolArray,
    IntArray,
    Stages,
    banded_pairs,
    check_counts,
    exact_partition,
    last_true,
    legal_starts,
    range_pairs,
    stage_bands,
)
from planner.core.split.stage_model import (
    Partition,
    ceil_div,
    evaluate,
    grad_bytes,
    parts_from_sums,
    reduced_bytes,
    stage_bounds,
    unsharded_bytes,
)
from planner.core.step.schedules import ZERO_BUBBLE, in_flight_per_stage
from planner.errors import InfeasibleError
from planner.schema.costs import BlockCost, LinkCost, OptimizerSpec, RecomputeMode

OPTIONS: dict[str, tuple[RecomputeMode, ...]] = {
    "never": ("never",),
    "selective": ("selective",),
    "full": ("full",),
    "stage": ("stage",),
    "auto": ("never", "selective", "full", "stage"),
}
"""Per recompute policy, the modes a stage may take, in the order they are tried: the first that
fits is taken (less recomputation first; full and stage recompute alike, stage keeps the least per
microbatch and rebuilds the most at a time)."""

MODES: tuple[RecomputeMode, ...] = ("never", "selective", "full", "stage")
"""The recompute modes in the order of ``_Arrays``' cost and fit rows."""


def policy_options(recompute: str, schedule: str | None = None) -> tuple[RecomputeMode, ...]:
    """The modes a stage may take under the recompute policy and schedule, in the order they are tried.

    The zero-bubble schedules run a stage's backward in two passes (input gradients, then weight
    gradients), and torch's selective activation checkpointing allows one backward per region
    ("You are only allowed to backward once on any region computed under selective activation
    checkpoint"): there no stage checkpoints selectively.

    Raises:
        InfeasibleError: an unknown policy, or "selective" under a zero-bubble schedule.
    """
    recompute = "full" if recompute == "always" else recompute  # its old name
    if recompute not in OPTIONS:
        raise InfeasibleError(f"recompute={recompute!r}; expected one of {', '.join(OPTIONS)}")
    options = OPTIONS[recompute]
    if schedule in ZERO_BUBBLE:
        if recompute == "selective":
            raise InfeasibleError(
                f"--recompute selective cannot run under --schedule {schedule}: its two-part backward runs each "
                "stage's backward twice, which torch's selective activation checkpointing refuses; use "
                "--recompute full (or auto), or another schedule"
            )
        options = tuple(o for o in options if o != "selective")
    return options


class _MemoryModel:
    """Memory check of stage [s, e) at stage index k, in integer arithmetic from prefix sums."""

    def __init__(
        self,
        blocks: Sequence[BlockCost],
        optimizer: OptimizerSpec,
        limit: float,
        recompute: str = "never",
        layout: Layout | None = None,
    ) -> None:
        n = len(blocks)
        layout = layout or Layout("gpipe", 1, 1)  # one rank: its microbatches, replicas and schedule
        self.n, self.limit, self.recompute = n, limit, recompute
        self.options = policy_options(recompute, layout.schedule)  # what a stage may take, in order
        self.optimizer = optimizer
        self.m = layout.n_microbatches
        self.shard = layout.shard
        self.per_block = layout.per_block  # FSDP block by block: a few units unsharded at a time
        self.fresh = layout.fresh_grads  # no gradients before a stage's first backward
        sums = block_sums(blocks, optimizer)
        self.sums = sums  # prefix sums and per-boundary sizes (loss_temp -1: not the last stage, or not measured)

    def bytes(self, s: int, e: int, in_flight: int, recompute: bool | str = False) -> int:
        # Same formula as stage_memory_bytes.
        parts = parts_from_sums(self.sums.stage(s, e), self.optimizer, recompute, self.m, self.shard, self.per_block)
        return parts.peak(in_flight, self.fresh)


class _Arrays:
    """The stage costs and memory of one ``solve`` request as arrays over block boundaries.

    Costs are built exactly as a stage-by-stage evaluation builds them (prefix sums accumulated in
    Python in block order; per stage ``((pre[e] - pre[s]) + send_in[s]) + send_out[e]``, plus
    ``pre_r[e] - pre_r[s]`` or ``pre_rs[e] - pre_rs[s]`` when it checkpoints block by block, and
    ``(pre_f[e - 1] - pre_f[s]) + rerun[e - 1]`` as one region: ``stage_model.rerun_s``), so the
    vectorised search compares the same floats.

    With a link per boundary, ``send_in`` and ``send_out`` have one row per distinct link, and stage
    index k costs ``variant[k]``'s row of the range costs: the pair (link into stage k, link out
    of it). One link gives one row, the arrays of the single-link search. A boundary inside one rank
    (``crosses`` False: a V's turn) has a row of its own, of zeros: no message, no cold start.
    """

    def __init__(
        self,
        blocks: Sequence[BlockCost],
        link: Links,
        mem: _MemoryModel,
        mode: str,
        in_flight: Sequence[int],
        crosses: Sequence[bool] | None = None,
    ) -> None:
        n = len(blocks)
        self.n = n
        self.mode = "full" if mode == "always" else mode
        mode = self.mode
        self.mem = mem
        # forward + backward, full and selective checkpointing's extra backward, forwards (a stage as
        # one region re-runs all but its last block's in full) and each block's re-run as a region's last
        times = block_times(blocks)
        pre, pre_r, pre_rs, pre_f, rerun = times.pre, times.pre_r, times.pre_rs, times.pre_f, times.rerun
        self.p = len(in_flight)
        links = boundary_links(link, self.p)
        distinct: list[LinkCost] = []
        for one in links or [default_link(link)]:
            if one not in distinct:
                distinct.append(one)
        within = len(distinct)  # the row of a boundary inside one rank
        crossing = list(crosses) if crosses is not None else [True] * len(links)
        ids = [distinct.index(one) if c else within for one, c in zip(links, crossing, strict=True)]
        pairs = [(ids[k - 1] if k else (ids[0] if ids else 0), ids[k] if k < len(ids) else 0) for k in range(self.p)]
        pairs = [(a, a if k == self.p - 1 else b) for k, (a, b) in enumerate(pairs)]  # the last stage sends nothing
        self.pairs = list(dict.fromkeys(pairs))
        self.variant = [self.pairs.index(pair) for pair in pairs]
        # comm_fwd + comm_bwd = both directions' messages in and out (stage_model._boundary_send_s); a
        # boundary's receiver also starts cold
        rows = [message_rows(blocks, one) for one in distinct]
        send_in = [row_in for row_in, _ in rows]
        send_out = [row_out for _, row_out in rows]
        if within in ids:
            send_in.append([0.0] * n)
            send_out.append([0.0] * (n + 1))
        self.pre_list = pre
        self.pre = np.array(pre)
        self.pre_r = np.array(pre_r)
        self.pre_rs = np.array(pre_rs)
        self.pre_f, self.rerun = np.array(pre_f), np.array(rerun or [0.0])
        self.send_in = np.array(send_in)
        self.send_out = np.array(send_out)
        self.send_in_min = self.send_in.min(axis=0)  # the cheapest link: bounds every stage index's cost
        # An infinite latency or recompute_s makes some costs inf or NaN, which the cost windows
        # cannot bound; such inputs search every stage that fits (still exact, just slower).
        self.finite = bool(
            np.isfinite(self.pre).all()
            and np.isfinite(self.send_in).all()
            and np.isfinite(self.send_out).all()
            and (mode == "never" or (np.isfinite(self.pre_r).all() and np.isfinite(self.pre_rs).all()))
        )
        legal = legal_starts(blocks)
        self.starts: IntArray = np.array([0] + [c for c in range(1, n) if legal[c]], dtype=np.int64)
        self.end_ok: BoolArray = np.array(legal[:n] + [True])
        self.t_span = (min(in_flight), max(in_flight))
        self.free = mem.limit == math.inf
        self._last_fit: dict[int, IntArray] = {}
        # "Fits at every in-flight count asked for"; no schedule holds more than its m microbatches.
        self.big = 0
        self.widen(max(*in_flight, mem.m))

    def widen(self, t: int) -> None:
        """Make the fit thresholds tell counts up to ``t`` apart (the error path asks other stage counts)."""
        if t < self.big:
            return
        self.big = t + 1
        self._last_fit.clear()
        if not self.free:
            self._memory_arrays(self.mem)

    def _memory_arrays(self, mem: _MemoryModel) -> None:
        n, sums = self.n, mem.sums
        # what FSDP shards is at least what a rank holds (expert parallelism counts the experts whole)
        pre_p, pre_n = (sums.pre_fsdp[0][n], sums.pre_fsdp[1][n]) if sums.pre_fsdp else (sums.pre_p[n], sums.pre_n[n])
        pre_a = sums.pre_a[n]
        cmax = max([0, *sums.kept_in, *sums.cut_out, *sums.out])
        # Every byte count the fit test forms stays below this (generous) bound, in magnitude.
        temps, regions = sums.temps, sums.regions
        # weights, grads, state, step temporaries, autocast's weight copies shared (twice: shared_casts)
        static = 2 * pre_p + 16 * pre_n + temps.pre_sum[n] + 2 * sums.pre_c[n]
        # what checkpointing keeps, at most, and one backward's temporaries (a block's, or the loss's)
        held = regions.pre_in[n] + regions.pre_kept[n] + max([*regions.temps.table[0], sums.loss_temp[n]])
        bound = 4 * (static + 2 * (mem.m + 1) * cmax + (self.big + 1) * (pre_a + held + 2 * cmax)) + 16
        dtype: Any = np.int64 if bound < 2**62 else object
        self.pre_p = np.array(sums.pre_p, dtype=dtype)
        self.pre_n = np.array(sums.pre_n, dtype=dtype)
        fsdp = sums.pre_fsdp
        self.pre_fp = np.array(fsdp[0], dtype=dtype) if fsdp else self.pre_p
        self.pre_fn = np.array(fsdp[1], dtype=dtype) if fsdp else self.pre_n
        self.pre_a = np.array(sums.pre_a, dtype=dtype)
        self.pre_c = np.array(sums.pre_c, dtype=dtype)
        self.cut_in = np.array(sums.cut_in, dtype=dtype)
        self.kept_in = np.array(sums.kept_in, dtype=dtype)
        self.cut_out = np.array(sums.cut_out, dtype=dtype)
        self.out = np.array(sums.out, dtype=dtype)
        self.loss_temp = np.array(sums.loss_temp, dtype=dtype)
        # the measured step temporaries (StepTemps as arrays)
        self.step_temps = StepTempArrays(temps, dtype, adamw=mem.optimizer.name == "adamw")
        # the checkpoint regions (RegionSums as arrays)
        self.pre_in = np.array(regions.pre_in, dtype=dtype)
        self.pre_kept = np.array(regions.pre_kept, dtype=dtype)
        self.pre_held = np.array(regions.pre_held, dtype=dtype)
        self.region_acts = regions.acts.arrays(dtype)
        self.region_rebuilt = regions.rebuilt.arrays(dtype)
        self.region_params = regions.params.arrays(dtype)
        self.region_grads = regions.grads.arrays(dtype)
        self.block_temps = regions.temps.arrays(dtype)
        # A limit above every possible byte count fits the same as that bound; one below zero fits
        # nothing, like -1. Clamping keeps the arithmetic in range.
        self.limit = max(-1, min(math.floor(mem.limit), bound))
        self.adamw = mem.optimizer.name == "adamw"

    def _saved(self, s: IntArray, e: IntArray, a_b: AnyIntArray) -> dict[str, tuple[AnyIntArray, AnyIntArray]]:
        """Per recompute mode, the stages' bytes per live microbatch and once, besides their output
        (``planner.core.split.stage_model._recomputed`` on arrays)."""
        inputs = self.pre_in[e] - self.pre_in[s]
        kept = self.pre_kept[e] - self.pre_kept[s]
        held = self.pre_held[e] - self.pre_held[s]
        temp = self.block_temps.many(s, e)
        return {
            "never": (a_b, temp),
            "selective": (inputs + kept, self.region_rebuilt.many(s, e)),
            "full": (inputs, self.region_acts.many(s, e)),
            "stage": (self.kept_in[s] + held, a_b - held + temp),
        }

    def _fit_bound(self, s: IntArray, e: IntArray, t: int) -> AnyIntArray:
        """A lower bound of the stage's bytes at ``t`` or more live microbatches, any way it can
        run, that never decreases as the stage grows (``e`` up): ``parts_from_sums`` without the optimizer's
        fp32 master copy and the outgoing boundary's terms (the parts that can shrink). With the
        gradients new every step, every microbatch live holds no more than one fewer with the gradients
        (``MemoryParts.peak``), so the bound of one fewer holds."""
        if self.mem.fresh and t >= self.mem.m:
            t -= 1
        p_b = self.pre_p[e] - self.pre_p[s]
        n_p = self.pre_n[e] - self.pre_n[s]
        a_b = self.pre_a[e] - self.pre_a[s]
        cin = self.cut_in[s]
        per_param = 8 * n_p if self.adamw else 0 * n_p
        step = self.step_temps.floor(s, e, n_p)
        # each mode's saved bytes only grow with e (sums of non-negative terms, and range maxima)
        saved = self._saved(s, e, a_b)
        # less what a last stage's loss saved, freed before its blocks' backward (``with_loss``): still
        # growing with e from one live microbatch on (the last block adds at least that per microbatch)
        held = self.pre_held[e] - self.pre_held[s]
        # keeping every activation, unsharded, the weight copies may be shared (casts.shared_casts):
        # at t live at least t * (A - C) + min(t, 2) * C, exact either way, and growing with e too
        c = self.pre_c[e] - self.pre_c[s] if self.mem.shard == 1 else 0 * held
        per = {o: saved[o][0] - (c if o == "never" else 0) for o in self.mem.options}
        once = {o: saved[o][1] + (min(t, 2) * c if o == "never" else 0) for o in self.mem.options}
        options = [t * per[o] + once[o] - held if t else 0 * held for o in self.mem.options]
        pipeline = options[0]
        for other in options[1:]:
            pipeline = np.minimum(pipeline, other)
        d = self.mem.shard
        if d > 1:  # the sharded state (rounded down: still a lower bound) and the unsharded copies; a
            # stage unit's gradient share left out where it comes after the activations are gone
            # (MemoryParts.reduced): the rest of its state is still at least the share's floor.
            # Of what FSDP shards (StageSums.fsdp): the experts whole under expert parallelism
            fp_b, fn_p = self.pre_fp[e] - self.pre_fp[s], self.pre_fn[e] - self.pre_fn[s]
            grads = 0 * fp_b if self.mem.fresh and not self.mem.per_block else fp_b
            moments = 8 * fn_p if self.adamw else 0 * fn_p
            sharded: AnyIntArray = (fp_b + grads + moments) // d + self.mem.m * cin
            most = (self.region_params.many(s, e), self.region_grads.many(s, e))
            unsharded = unsharded_bytes(p_b, n_p, *most, self.mem.per_block)
            step = self.step_temps.floor(s, e, fn_p)
            bound: AnyIntArray = sharded + np.maximum(pipeline + unsharded, step // d)
            return bound
        out: AnyIntArray = 2 * p_b + per_param + self.mem.m * cin + np.maximum(pipeline, step)
        return out

    def last_fit(self, t_floor: int) -> IntArray:
        """Per possible start, the last end whose stage may fit memory at ``t_floor`` or more live microbatches."""
        if self.free:
            return np.full_like(self.starts, self.n)
        if t_floor not in self._last_fit:
            self._last_fit[t_floor] = last_true(
                self.starts, self.n, lambda s, e: np.asarray(self._fit_bound(s, e, t_floor) <= self.limit, dtype=bool)
            )
        return self._last_fit[t_floor]

    def fit_limits(self, s: IntArray, e: IntArray) -> tuple[IntArray, ...]:
        """Per recompute mode (``MODES``: never, selective, full), the most live microbatches at which
        each stage fits, -1 when it does not fit even with none, ``big`` when it always fits; -1 for
        a mode the recompute policy rules out.

        ``MemoryParts.peak`` is ``K + max(t * X + Y, step)``: they fit ``limit`` iff ``K + step`` and
        ``K + Y`` do and ``t <= (limit - K - Y) // X``. With the gradients new every step (``G`` bytes)
        ``t >= m`` live (every microbatch) fit iff ``t - 1`` do and ``t * X + Y <= limit - K + G``.
        Of ``G``, a stage unit's sharded share ``R`` comes only after the last backward, so fewer
        than ``m`` live fit iff ``t * X + Y <= limit - K + R`` (besides ``K + Y`` and ``K + step``),
        and ``t >= m`` iff ``(t - 1) * X + Y <= limit - K + R`` and ``t * X + Y <= limit - K + G``.
        """
        no = np.full(len(s), -1, dtype=np.int64)
        allowed = self.mem.options
        if self.free:
            yes = np.full(len(s), self.big, dtype=np.int64)
            return tuple(yes if option in allowed else no for option in MODES)
        p_b = self.pre_p[e] - self.pre_p[s]
        n_p = self.pre_n[e] - self.pre_n[s]
        a_b = self.pre_a[e] - self.pre_a[s]
        cin, cout, out, loss_temp = self.cut_in[s], self.cut_out[e], self.out[e], self.loss_temp[e]
        held = self.pre_held[e] - self.pre_held[s]
        cast = self.pre_c[e] - self.pre_c[s]  # of a_b, autocast's weight copies (casts.shared_casts)
        # Mirrors OptimizerSpec.state_bytes / step_temp_bytes on arrays (test_solve checks the two agree):
        # an fp32 master copy when the parameters are narrower than fp32, AdamW's two moments and
        # its step temporaries (measured, or two per parameter).
        master = np.where(p_b < 4 * n_p, 4 * n_p, 0 * n_p)
        moments = 8 * n_p if self.adamw else 0 * n_p
        step = self.step_temps.of(s, e, n_p)
        static = 2 * p_b + master + moments
        unsharded, most = 0 * p_b, (0 * p_b, 0 * p_b)
        fp_b, fn_p = p_b, n_p
        d = self.mem.shard
        if d > 1:  # parts_from_sums with shard: a share of the static bytes and step (of what FSDP shards:
            # StageSums.fsdp), the whole stage while it runs
            fp_b, fn_p = self.pre_fp[e] - self.pre_fp[s], self.pre_fn[e] - self.pre_fn[s]
            master = np.where(fp_b < 4 * fn_p, 4 * fn_p, 0 * fn_p)
            moments = 8 * fn_p if self.adamw else 0 * fn_p
            static = ceil_div(2 * fp_b + master + moments, d)
            step = ceil_div(self.step_temps.of(s, e, fn_p), d)
            most = (self.region_params.many(s, e), self.region_grads.many(s, e))
            unsharded = unsharded_bytes(p_b, n_p, *most, self.mem.per_block)
        grads = grad_bytes(p_b, n_p, most, d, self.mem.per_block, (fp_b, fn_p)) if self.mem.fresh else 0 * p_b
        # a stage unit's gradient share, made after its last backward: not beside the activations
        reduced = reduced_bytes(fp_b, fn_p, d, self.mem.per_block) if self.mem.fresh else 0 * p_b
        head = self.limit - (static + self.mem.m * (cin + cout))
        saved = self._saved(s, e, a_b)
        limits = []
        for option in MODES:
            if option not in allowed:
                limits.append(no)
                continue
            x, y = saved[option][0] + out, with_loss(loss_temp, held, saved[option][1] + out) + unsharded
            # a stage keeping every activation, not sharded, shares its weight copies from 3 live on
            # (casts.shared_casts, SHARED_CASTS_FROM): (x - C) per live microbatch, 2 C once
            c = cast if option == "never" and d == 1 else 0 * cast
            xs, ys = x - c, y + 2 * c
            fits_alone = (y <= head) & (step <= head)
            room = head + reduced  # live microbatches beside all but the gradient share
            fits_one, fits_two, fits_three = x + y <= room, 2 * x + y <= room, 3 * xs + ys <= room
            most = np.minimum((room - ys) // np.maximum(xs, 1), self.big)
            fewer = np.where(fits_two, 2, np.where(fits_one, 1, 0))
            t_max = np.where(fits_alone, np.where(fits_three, np.where(xs > 0, most, self.big), fewer), -1)
            if self.mem.fresh:  # from m live on, one fewer with the gradients (MemoryParts.peak)
                more = t_max + 1
                at_more = np.where(more >= 3, more * xs + ys, more * x + y) <= head + grads
                grow = (t_max >= 0) & (t_max < self.big) & (more >= self.mem.m) & at_more
                t_max = np.where(grow, more, t_max)
            limits.append(np.asarray(t_max).astype(np.int64))
        return tuple(limits)

    def ranges(self, cap: float) -> Stages:
        """Every stage that fits memory at some asked-for in-flight count and may cost <= ``cap``."""
        n = self.n
        cap = cap if self.finite else math.inf
        last_fit = self.last_fit(self.t_span[0])
        if cap == math.inf:
            last_cheap = np.full_like(self.starts, n)
        else:
            # The cost without its per-end message and recomputation never decreases with e.
            last_cheap = last_true(
                self.starts, n, lambda s, e: ((self.pre[e] - self.pre[s]) + self.send_in_min[s]) <= cap
            )
        last = np.minimum(last_fit, last_cheap)
        pre = self.pre_list

        def short(s: int, e: int) -> bool:  # necessary for cost <= cap, and kept when the stage shrinks
            return cap == math.inf or (pre[e] - pre[s]) <= cap

        band = stage_bands(n, self.p, self.starts, last, short)
        s, e = banded_pairs(n, self.p, self.starts, last, self.end_ok, *band)
        with np.errstate(invalid="ignore"):  # inf - inf of an infinite recompute_s: NaN, as the reference gets
            base = self.pre[e] - self.pre[s]
            c0 = np.stack([(base + self.send_in[a][s]) + self.send_out[b][e] for a, b in self.pairs])
            full = c0 + (self.pre_r[e] - self.pre_r[s]) if self.mode in ("full", "auto") else c0
            selective = c0 + (self.pre_rs[e] - self.pre_rs[s]) if self.mode in ("selective", "auto") else c0
            one = (
                c0 + ((self.pre_f[e - 1] - self.pre_f[s]) + self.rerun[e - 1]) if self.mode in ("stage", "auto") else c0
            )
        fits = self.fit_limits(s, e)
        complete = bool((last_cheap >= last_fit).all())
        return Stages(n, (s, e), (c0, selective, full, one), fits, complete, self.t_span, band)  # in MODES' order


class _FitSearch:
    """Whether some split into q stages fits memory, for many q (the infeasible-limit error path).

    Reachability from the right: ``layers[j]`` marks the starts from which the blocks to the end
    split into j + 1 stages that all fit, stage q-1-j holding ``in_flight[q-1-j]`` microbatches.
    Counting from the right, GPipe's and 1F1B's counts do not depend on q (m everywhere; min(m, j+1)),
    so the layers of one q are the first layers of the next and each q costs one more layer.
    """

    def __init__(self, arrays: _Arrays, t_floor: int) -> None:
        self.t_floor = t_floor
        self.n = arrays.n
        s, e = range_pairs(arrays.starts, arrays.starts + 1, arrays.last_fit(t_floor), arrays.end_ok)
        self.s, self.e, self.most = s, e, np.maximum.reduce(arrays.fit_limits(s, e))
        self.to_end = e == arrays.n
        self.rev: list[int] = []
        self.layers: list[BoolArray] = []

    def _extend(self, t: int) -> None:
        prev = self.layers[-1] if self.layers else None
        if prev is not None and not prev.any():
            layer = prev  # nothing reaches the end with fewer stages, so nothing does with more
        else:
            ok = (self.most >= t) & (self.to_end if prev is None else prev[self.e])
            layer = np.zeros(self.n + 1, dtype=bool)
            layer[self.s[ok]] = True
        self.layers.append(layer)
        self.rev.append(t)

    def fits(self, in_flight: Sequence[int]) -> bool:
        """Whether some split into ``len(in_flight)`` stages fits (``_any_fit`` of the O(p n^2) solver)."""
        rev = list(reversed(in_flight))
        same = 0
        while same < min(len(rev), len(self.rev)) and rev[same] == self.rev[same]:
            same += 1
        if same < len(rev):
            del self.layers[same:]
            del self.rev[same:]
            for t in rev[same:]:
                self._extend(t)
        return bool(self.layers[len(rev) - 1][0])


def _memory_error(
    blocks: Sequence[BlockCost],
    n_stages: int,
    schedule: str,
    n_microbatches: int,
    mem: _MemoryModel,
    arrays: _Arrays,
    in_flight: Sequence[int] | None = None,
) -> InfeasibleError:
    """Build the error for a memory limit nothing fits, naming the smallest stage count that would.

    With ``in_flight`` given (the caller's own counts, so other stage counts mean nothing here) it
    skips that search and names a block that cannot fit alone.
    """
    n = len(blocks)
    n_legal = sum(legal_starts(blocks))
    limit = mem.limit
    skipped_1f1b = False
    q_hi = min(n, n_legal + 1)
    if in_flight is None:
        counts = range(n_stages + 1, q_hi + 1)
        if schedule == "1f1b":
            # torch's Schedule1F1B needs n_microbatches >= n_stages
            skipped_1f1b = len(counts) > 0 and q_hi > n_microbatches
            counts = range(n_stages + 1, min(q_hi, n_microbatches) + 1)
        # GPipe keeps all m microbatches on every stage, 1F1B min(m, q - i) on stage i of q
        # (in_flight_per_stage). Counted from the last stage neither depends on q, so one sweep from
        # the right tells which counts can fit, sparing the schedule of every count that cannot; the
        # count it names is then checked with the schedule's own numbers. Other schedules are asked
        # for every count.
        from_end: Callable[[int], int] | None = {
            "gpipe": lambda j: n_microbatches,
            "1f1b": lambda j: min(n_microbatches, j + 1),
        }.get(schedule)
        search = _FitSearch(arrays, 1 if from_end is None else from_end(0)) if len(counts) else None
        maybe: list[bool] = []
        if from_end is not None and search is not None:
            search.fits([from_end(j) for j in reversed(range(counts[-1]))])
            maybe = [bool(layer[0]) for layer in search.layers]
        for q in counts:
            if from_end is not None and not maybe[q - 1]:
                continue
            infl = in_flight_per_stage(schedule, q, n_microbatches)
            assert search is not None  # built whenever there is a count to try
            if max(infl) >= arrays.big or min(infl) < search.t_floor:
                arrays.widen(max(infl))
                search = _FitSearch(arrays, min(search.t_floor, *infl))
            if search.fits(infl):
                return InfeasibleError(
                    f"--memory-limit {_gib(limit)} is too small for {n_stages} stages: no split fits; "
                    f"the smallest stage count that fits is {q}: use --gpus {q} or raise --memory-limit"
                )
    # Even the finest splits fail: name a block that cannot fit on its own with the fewest live
    # microbatches its stage can have. GPipe holds m everywhere; under 1F1B the last stage holds 1,
    # but block 0 is always on stage 0, which holds min(m, p) >= min(m, n_stages) (Narayanan 2021).
    # With given counts, block j can only be on stages max(0, j - (n - p)) .. min(j, p - 1).
    for j in range(n):
        if in_flight is not None:
            min_live = min(in_flight[max(0, j - (n - n_stages)) : min(j, n_stages - 1) + 1])
        elif schedule == "gpipe":
            min_live = n_microbatches
        else:
            min_live = min(n_microbatches, n_stages) if j == 0 else 1
        need = mem.bytes(j, j + 1, min_live)
        if need > limit:
            return InfeasibleError(
                f"block '{blocks[j].name}' alone needs {need} bytes ({_gib(need)}: params, grads, optimizer "
                f"state, {min_live} microbatch(es) of activations and boundary buffers) but --memory-limit is "
                f"{_gib(limit)}; raise --memory-limit, use a lighter --optimizer or smaller microbatches (more -m)"
            )
    if in_flight is not None:
        return InfeasibleError(
            f"--memory-limit {_gib(limit)} is too small: no split into {n_stages} stages fits with "
            f"{list(in_flight)} microbatches in flight per stage; raise --memory-limit, use more stages or "
            "make more block boundaries cuttable"
        )
    more = " (1F1B also needs at least one microbatch per stage: raise -m)" if skipped_1f1b else ""
    return InfeasibleError(
        f"--memory-limit {_gib(limit)} is too small: no split into {n_stages} to {min(n, n_legal + 1)} "
        f"stages fits{more}; raise --memory-limit or make more block boundaries cuttable"
    )


def _stage_modes(arrays: _Arrays, bounds: Sequence[tuple[int, int]], in_flight: Sequence[int]) -> list[str]:
    """Each stage's recompute mode: the first of the policy's options it fits at its live
    microbatches, read off the solver's own fit rows (``_Arrays.fit_limits``, the limit's most live
    microbatches per mode) for the stages at once, so that the modes are those its costs took (the
    first option whose ``_MemoryModel.bytes`` is within the limit, one stage at a time, says the same:
    tests/test_solve.py checks the two agree); "never" where none fits."""
    s = np.array([a for a, _ in bounds], dtype=np.int64)
    e = np.array([b for _, b in bounds], dtype=np.int64)
    limits = arrays.fit_limits(s, e)
    rows = [(option, limits[MODES.index(option)]) for option in arrays.mem.options]
    return [next((option for option, row in rows if t <= row[k]), "never") for k, t in enumerate(in_flight)]


def _gib(nbytes: float) -> str:
    """Bytes as the GiB figure ``--memory-limit`` takes."""
    return f"{nbytes / 2**30:.3g} GiB"


def solve(
    blocks: Sequence[BlockCost],
    link: Links,
    layout: Layout,
    constraints: Constraints = NO_CONSTRAINTS,
    in_flight: Sequence[int] | None = None,
) -> Partition:
    """The partition with the smallest bottleneck stage cost (exact).

    Minimises max stage cost over all contiguous partitions into exactly ``layout.n_stages``
    non-empty stages on legal cuts, with every stage's ``stage_memory_bytes`` (using the peak
    in-flight count of that stage under the layout's schedule, or ``in_flight``) at most
    ``constraints.memory_limit_bytes`` when given. Ties (within a relative 1e-9) go to the least
    total stage cost (less communication), then to the lexicographically smallest starts.

    The search is the O(p n^2) dynamic programme restricted to block ranges (those whose cost
    and memory lower bounds allow them under the optimum) and vectorised; see ``exact_partition``
    for why that returns the very same partition. About O(p n w) for w possible ends per start.

    Args:
        blocks: per-block costs in execution order.
        link: cost of one message between neighbouring ranks: one for all, one per boundary, or a
            ``NodeLinks`` (``boundary_links``).
        layout: the stages to cut (``n_stages``), the schedule that decides each stage's in-flight
            microbatches and where it runs (which boundaries stay inside one rank and cost no
            message or cold start: ``boundary_crosses``), the microbatches per step (receive
            buffers), and the FSDP replicas every stage's state is sharded over (``shard``).
        constraints: the optimizer (state bytes per parameter byte), the memory limit of one
            stage (None: none) and the recompute policy: "never", "selective", "full" or "stage"
            (every stage so), or "auto" (a stage recomputes only when it would not fit the memory
            limit otherwise: selectively where that fits, else fully, else as one region, and pays
            the recomputation in backward). The choice is part of the exact search: each stage's cost is that of its
            first option that fits (``OPTIONS``).
        in_flight: peak live microbatches of each stage (one per stage), replacing the counts
            the schedule gives (``planner.core.step.schedules.in_flight_per_stage``).

    Returns:
        The optimal partition (with its per-stage recompute modes).

    Raises:
        InfeasibleError: more stages than blocks, too few legal cuts, a schedule request torch
            refuses, ``in_flight`` of the wrong length or with negative counts (or with fewer than
            one microbatch), or no partition fits the memory limit (the message names the smallest
            stage count that would fit, or the block that cannot fit alone).
    """
    recompute, memory_limit_bytes = constraints.recompute, constraints.memory_limit_bytes
    policy_options(recompute, layout.schedule)  # refuses what cannot run, before any work
    schedule, n_stages, n_microbatches = layout.schedule, layout.n_stages, layout.n_microbatches
    check_counts(blocks, n_stages)
    if in_flight is None:
        infl = in_flight_per_stage(schedule, layout.pp, n_microbatches, layout.stages_per_rank)
    else:
        infl = check_in_flight(in_flight, n_stages, n_microbatches)
    n = len(blocks)
    limit = memory_limit_bytes if memory_limit_bytes is not None else math.inf
    # Without a limit "auto" never needs to recompute.
    mode = "never" if memory_limit_bytes is None and recompute == "auto" else recompute
    mem = _MemoryModel(blocks, constraints.optimizer, limit, mode, layout)
    crosses = boundary_crosses(n_stages, schedule, layout.stages_per_rank)
    arrays = _Arrays(blocks, boundary_links(link, n_stages, schedule), mem, mode, infl, crosses)
    # First cap: the average stage plus the largest block and messages, about where the optimum is
    # when memory does not bind (any value is correct; a close one saves a pass).
    extra = {"full": arrays.pre_r, "stage": arrays.pre_f, "selective": arrays.pre_rs}.get(mode, 0.0 * arrays.pre)
    with np.errstate(invalid="ignore"):  # non-finite inputs search without a cap anyway
        total = float(arrays.pre[n] + extra[n])
        largest = float(np.max(np.diff(arrays.pre) + np.diff(extra)))
        first_cap = total / n_stages + largest + float(np.max(arrays.send_in) + np.max(arrays.send_out))
    # Where memory binds, a cheap test of memory alone (no costs) tells a limit nothing fits (the
    # searches of rank_fit try many) after one pass, instead of after the passes doubling the cap
    any_fit = None if arrays.free else (lambda: _FitSearch(arrays, min(infl)).fits(infl))
    starts = exact_partition(n, n_stages, infl, arrays.ranges, first_cap, variant=arrays.variant, any_fit=any_fit)
    if starts is None:
        given = None if in_flight is None else infl
        raise _memory_error(blocks, n_stages, schedule, n_microbatches, mem, arrays, given)
    flags = _stage_modes(arrays, stage_bounds(starts, n), infl)
    return evaluate(blocks, Split(starts=tuple(starts), recompute=tuple(flags)), link, schedule, layout.stages_per_rank)
