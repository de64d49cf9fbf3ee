"""Exact pipeline partition solver and the baselines it is compared against.

Pure module: never imports torch. A partition splits the blocks (in execution order) into
contiguous, non-empty stages, one per rank, cutting only after blocks whose ``cut_legal`` is True.

``solve`` is exact: a dynamic programme over (stage index, end block) minimises the bottleneck
stage cost (the slowest stage bounds the steady-state throughput of GPipe and 1F1B alike,
Narayanan et al. 2021 Eq. 1), as PipeDream and Alpa do, subject to a per-stage memory limit. A
second pass breaks ties deterministically. The baselines reproduce what torchtitan / Megatron
(equal layer counts) and DeepSpeed (``partition_method="parameters"``) would pick, evaluated on the
same costs so the report can compare them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator

from planner.core.schedules import action_order, peak_in_flight
from planner.errors import InfeasibleError
from planner.schema.costs import BlockCost, LinkCost, OptimizerSpec

DEFAULT_OPTIMIZER = OptimizerSpec()  # frozen, so one shared default is safe

# Relative tolerance under which two bottlenecks / cost sums count as equal (float sums in a
# different order differ in the last bits; exact ties must not depend on that).
_REL_EPS = 1e-9


class Partition(BaseModel):
    """A split of the blocks into contiguous stages."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    starts: tuple[int, ...] = Field(
        description="First block of each stage; starts[0] == 0, strictly increasing. Stage k is "
        "blocks[starts[k]:starts[k+1]], the last stage runs to the end."
    )
    bottleneck_s: float = Field(
        description="Max over stages of the stage cost (``stage_costs``), seconds per microbatch."
    )
    recompute: tuple[bool, ...] = Field(
        default=(), description="Per stage: whether it recomputes its activations in backward (empty = none does)."
    )

    @field_validator("starts")
    @classmethod
    def _check_starts(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if not v or v[0] != 0 or any(b <= a for a, b in zip(v, v[1:])):
            raise ValueError(f"starts={v} is invalid; expected starts[0] == 0 and strictly increasing.")
        return v


# ---------------------------------------------------------------------------------------------
# Costs of one stage
# ---------------------------------------------------------------------------------------------


def _boundary_send_s(blocks: Sequence[BlockCost], start: int, end: int, link: LinkCost) -> float:
    """Seconds a stage [start, end) spends on the messages of one microbatch in one direction.

    The boundary after block ``c - 1`` carries ``blocks[c - 1].cut_bytes`` per microbatch forward
    (activation) and the same size backward (its gradient); a rank receives at its start boundary
    (unless first) and sends at its end boundary (unless last).
    """
    s = 0.0
    if start > 0:
        s += link.send_s(blocks[start - 1].cut_bytes)
    if end < len(blocks):
        s += link.send_s(blocks[end - 1].cut_bytes)
    return s


def recompute_flags(recompute: Sequence[bool], n_stages: int) -> list[bool]:
    """Per-stage recompute flags, with the empty sequence meaning "no stage recomputes"."""
    return list(recompute) or [False] * n_stages


def compact_flags(flags: Sequence[bool]) -> tuple[bool, ...]:
    """The flags as plans store them: empty when no stage recomputes."""
    return tuple(flags) if any(flags) else ()


def recompute_cost(block: BlockCost) -> float:
    """Extra backward time of a block whose stage recomputes its activations.

    The profiler measures it (the forward again, up to the last tensor it saves: torch's checkpoint
    stops early there). When it is unknown (None: not measured) the block's whole forward is
    charged, the most a recomputation can cost.
    """
    return block.recompute_s if block.recompute_s is not None else block.fwd_s


def stage_time_parts(
    blocks: Sequence[BlockCost], start: int, end: int, link: LinkCost, recompute: bool = False
) -> tuple[float, float, float]:
    """Forward, backward and per-direction message seconds of the stage ``blocks[start:end]``, per microbatch.

    The message time is paid once in forward (activations) and once in backward (their gradients,
    the same sizes). Activation checkpointing re-runs the stage's forward inside its backward
    (Chen et al. 2016), so a recomputing stage's backward includes ``recompute_cost``.

    Args:
        blocks: per-block costs in execution order.
        start: first block of the stage.
        end: one past its last block.
        link: cost of one message between neighbouring ranks.
        recompute: whether the stage recomputes its activations.

    Returns:
        ``(fwd_s, bwd_s, comm_s)``, ``comm_s`` for one direction.
    """
    part = blocks[start:end]
    fwd = sum(b.fwd_s for b in part)
    bwd = sum(b.bwd_s for b in part) + (sum(recompute_cost(b) for b in part) if recompute else 0.0)
    return fwd, bwd, _boundary_send_s(blocks, start, end, link)


def _bounds(starts: Sequence[int], n: int) -> list[tuple[int, int]]:
    ends = list(starts[1:]) + [n]
    return list(zip(starts, ends))


def _check_starts(blocks: Sequence[BlockCost], starts: Sequence[int]) -> None:
    """Raise InfeasibleError unless ``starts`` is a valid partition of ``blocks`` on legal cuts."""
    n = len(blocks)
    if n == 0:
        raise InfeasibleError("blocks is empty; expected at least one block; profile a non-empty model.")
    if not starts or starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])) or starts[-1] >= n:
        raise InfeasibleError(
            f"starts={tuple(starts)} is invalid for {n} blocks; expected starts[0] == 0, strictly "
            f"increasing, all < {n}; give one start index per non-empty stage."
        )
    for c in starts[1:]:
        if not blocks[c - 1].cut_legal:
            raise InfeasibleError(
                f"a stage starts at block {c} ('{blocks[c].name}') but cutting after block "
                f"'{blocks[c - 1].name}' is not legal; expected cuts only after blocks with cut_legal; "
                "move the cut to a legal position."
            )


def stage_costs(
    blocks: Sequence[BlockCost], starts: Sequence[int], link: LinkCost, recompute: Sequence[bool] = ()
) -> list[float]:
    """Seconds one microbatch occupies each stage: forward + backward + its messages both ways.

    The largest one bounds the pipeline's throughput (Narayanan et al. 2021, Eq. 1).

    Args:
        blocks: per-block costs in execution order.
        starts: first block of each stage (see ``Partition.starts``).
        link: cost of one message between neighbouring ranks.
        recompute: per stage, whether it recomputes activations; empty means no stage does.

    Returns:
        One cost per stage.

    Raises:
        InfeasibleError: ``starts`` is not a valid partition on legal cuts.
    """
    _check_starts(blocks, starts)
    flags = recompute_flags(recompute, len(starts))
    costs = []
    for (s, e), r in zip(_bounds(starts, len(blocks)), flags):
        fwd, bwd, comm = stage_time_parts(blocks, s, e, link, r)
        costs.append(fwd + bwd + comm + comm)
    return costs


def stage_memory_bytes(
    blocks: Sequence[BlockCost],
    start: int,
    end: int,
    in_flight: int,
    optimizer: OptimizerSpec,
    recompute: bool = False,
    n_microbatches: int = 1,
) -> int:
    """Peak memory of the stage holding ``blocks[start:end]``.

    Formula (bytes)::

        static   = 2 * P + optimizer.state_bytes(N, P)      # weights + grads, optimizer state
        buffers  = m * (cut_in + cut_out)                   # receive buffers, one per microbatch each way
        pipeline = in_flight * (A + out) + out              # saved activations and the cached stage
                                                            # output per live microbatch, + its gradient
        step     = optimizer.step_temp_bytes(N)             # optimizer temporaries (after backward)
        peak     = static + buffers + max(pipeline, step)

    with ``P`` = sum of ``param_bytes``, ``N`` = sum of ``params``, ``A`` = sum of
    ``activation_bytes``, ``cut_in`` = ``blocks[start - 1].cut_bytes`` (0 for the first stage),
    ``cut_out`` = ``blocks[end - 1].cut_bytes`` (0 for the last stage), ``out`` = the stage's output
    per microbatch (``cut_out``; the model output ``output_bytes`` for the last stage), which
    torch's ``PipelineStage`` keeps until that microbatch's backward, ``m`` = ``n_microbatches``
    (``PipelineStage`` allocates its receive buffers per microbatch, up front). ``in_flight`` is the
    stage's peak number of microbatches with forward done and backward pending under the schedule
    (``planner.core.schedules.peak_in_flight``). Each term was checked against MemTracker's categories
    on CPU runs (docs/predict_vs_measured.md).

    With ``recompute`` the stage keeps only its input per live microbatch and rebuilds one
    microbatch's activations at a time in backward: ``in_flight * A`` becomes
    ``in_flight * cut_in + A`` (activation checkpointing of the whole stage, Chen et al. 2016).

    Args:
        blocks: per-block costs in execution order.
        start: first block of the stage.
        end: one past the stage's last block.
        in_flight: peak live microbatches on this stage.
        optimizer: the optimizer (decides the state bytes per parameter byte).
        recompute: whether the stage recomputes its activations in backward.
        n_microbatches: microbatches per step (receive buffers are per microbatch).

    Returns:
        The stage's memory estimate in bytes.

    Raises:
        InfeasibleError: an empty or out-of-range block range.
    """
    n = len(blocks)
    if not 0 <= start < end <= n:
        raise InfeasibleError(
            f"block range [{start}, {end}) is invalid for {n} blocks; expected 0 <= start < end <= {n}."
        )
    part = blocks[start:end]
    p_bytes = sum(b.param_bytes for b in part)
    n_params = sum(b.params for b in part)
    a_bytes = sum(b.activation_bytes for b in part)
    cut_in = blocks[start - 1].cut_bytes if start > 0 else 0
    cut_out = blocks[end - 1].cut_bytes if end < n else 0
    out = cut_out if end < n else blocks[-1].output_bytes
    return _peak(p_bytes, n_params, a_bytes, cut_in, cut_out, out, in_flight, optimizer, recompute, n_microbatches)


def _peak(
    p_bytes: int,
    n_params: int,
    a_bytes: int,
    cut_in: int,
    cut_out: int,
    out: int,
    in_flight: int,
    optimizer: OptimizerSpec,
    recompute: bool,
    n_microbatches: int,
) -> int:
    """The formula of ``stage_memory_bytes`` on sums (shared with the solver's fast memory model)."""
    static = 2 * p_bytes + optimizer.state_bytes(n_params, p_bytes)
    buffers = n_microbatches * (cut_in + cut_out)
    if recompute:
        pipeline = in_flight * (cut_in + out) + a_bytes + out
    else:
        pipeline = in_flight * (a_bytes + out) + out
    return static + buffers + max(pipeline, optimizer.step_temp_bytes(n_params))


def in_flight_per_stage(schedule: str, n_stages: int, n_microbatches: int) -> list[int]:
    """Peak live microbatches of every stage under a schedule (GPipe: m; 1F1B: min(m, p - i)).

    Args:
        schedule: "gpipe" or "1f1b".
        n_stages: number of stages p.
        n_microbatches: microbatches per step m.

    Returns:
        One count per stage index.

    Raises:
        InfeasibleError: the schedule cannot run with these numbers (see ``action_order``).
    """
    return [peak_in_flight(o) for o in action_order(schedule, n_stages, n_microbatches)]


def stage_memories(
    blocks: Sequence[BlockCost],
    starts: Sequence[int],
    *,
    schedule: str,
    n_microbatches: int,
    optimizer: OptimizerSpec = DEFAULT_OPTIMIZER,
    recompute: Sequence[bool] = (),
) -> list[int]:
    """Memory estimate of every stage of a partition (see ``stage_memory_bytes``).

    Args:
        blocks: per-block costs in execution order.
        starts: first block of each stage.
        schedule: "gpipe" or "1f1b".
        n_microbatches: microbatches per step.
        optimizer: the optimizer.

    Returns:
        Bytes per stage.

    Raises:
        InfeasibleError: invalid ``starts`` or schedule request.
    """
    _check_starts(blocks, starts)
    infl = in_flight_per_stage(schedule, len(starts), n_microbatches)
    flags = recompute_flags(recompute, len(starts))
    return [
        stage_memory_bytes(blocks, s, e, infl[k], optimizer, flags[k], n_microbatches)
        for k, (s, e) in enumerate(_bounds(starts, len(blocks)))
    ]


def evaluate(
    blocks: Sequence[BlockCost], starts: Sequence[int], link: LinkCost, recompute: Sequence[bool] = ()
) -> Partition:
    """The bottleneck of a given split (max of ``stage_costs``).

    Args:
        blocks: per-block costs in execution order.
        starts: first block of each stage.
        link: cost of one message between neighbouring ranks.

    Returns:
        The partition with its ``bottleneck_s`` (max stage cost, communication included).

    Raises:
        InfeasibleError: ``starts`` is not a valid partition on legal cuts.
    """
    costs = stage_costs(blocks, starts, link, recompute)
    return Partition(starts=tuple(starts), bottleneck_s=max(costs), recompute=compact_flags(recompute))


# ---------------------------------------------------------------------------------------------
# The dynamic programme
# ---------------------------------------------------------------------------------------------

Allowed = Callable[[int, int, int], bool]  # (start, end, stage index) -> stage may be placed
StageCost = Callable[[int, int, int], float]  # (start, end, stage index) -> cost (inf: not allowed)


def _tol(x: float) -> float:
    return _REL_EPS * max(1.0, abs(x))


def _dp_partition(
    n: int,
    n_stages: int,
    legal_cut: Sequence[bool],
    primary: StageCost,
    secondary: StageCost,
    allowed: Allowed,
    latest: bool = False,
) -> tuple[int, ...] | None:
    """Exact partition of ``n`` items into ``n_stages`` contiguous non-empty stages.

    Minimises max ``primary[s][e]`` over stages; among partitions within ``_REL_EPS`` of that optimum,
    minimises the sum of ``secondary[s][e]``; among those, returns the lexicographically smallest
    starts (largest with ``latest``). O(p n^2).

    Args:
        n: number of items.
        n_stages: number of stages p.
        legal_cut: ``legal_cut[c]`` says a stage may start at item c (1 <= c < n).
        primary: stage cost for the bottleneck, ``primary(s, e, k)`` for items [s, e) as stage k.
        secondary: stage cost for the tie-break sum.
        allowed: whether a stage [s, e) may be placed at stage index k (memory limit).
        latest: pick the lexicographically largest starts instead (earlier stages as full as possible).

    Returns:
        The starts, or None when no partition satisfies ``allowed``.
    """
    p = n_stages
    inf = math.inf

    def ends(k: int, s: int) -> range:
        # Stage k must leave at least one item for each later stage; the last stage ends at n.
        if k == p - 1:
            return range(n, n + 1)
        return range(s + 1, n - (p - 1 - k) + 1)

    def ok_end(k: int, e: int) -> bool:
        return k == p - 1 or legal_cut[e]

    # Pass 1: best[e] = smallest bottleneck covering [0, e) with stages 0..k.
    best = [inf] * (n + 1)
    for e in ends(0, 0):
        if ok_end(0, e) and allowed(0, e, 0):
            best[e] = primary(0, e, 0)
    for k in range(1, p):
        cur = [inf] * (n + 1)
        for s in range(k, n):
            if best[s] == inf:
                continue
            bs = best[s]
            for e in ends(k, s):
                if not ok_end(k, e):
                    continue
                c = primary(s, e, k)
                v = c if c > bs else bs
                if v < cur[e] and allowed(s, e, k):
                    cur[e] = v
        best = cur
    opt = best[n]
    if opt == inf:
        return None
    thr = opt + _tol(opt)

    # Pass 2: suffix DP. suf[k][s] = least sum of secondary covering [s, n) with stages k..p-1,
    # every stage's primary within the optimum bottleneck.
    suf: list[list[float]] = [[inf] * (n + 1) for _ in range(p + 1)]
    suf[p][n] = 0.0
    for k in range(p - 1, -1, -1):
        starts_k = range(0, 1) if k == 0 else range(k, n)
        for s in starts_k:
            if k > 0 and not legal_cut[s]:
                continue
            m = inf
            for e in ends(k, s):
                nxt = suf[k + 1][e]
                if nxt == inf or not ok_end(k, e) or primary(s, e, k) > thr:
                    continue
                v = secondary(s, e, k) + nxt
                if v < m and allowed(s, e, k):
                    m = v
            suf[k][s] = m
    # Forward reconstruction: the smallest (largest with ``latest``) next start achieving the minimum
    # sum gives the lexicographically smallest (largest) starts.
    starts = [0]
    s = 0
    for k in range(p - 1):
        target = suf[k][s]
        for e in reversed(ends(k, s)) if latest else ends(k, s):
            nxt = suf[k + 1][e]
            if nxt == inf or not ok_end(k, e) or primary(s, e, k) > thr or not allowed(s, e, k):
                continue
            if secondary(s, e, k) + nxt <= target + _tol(target):
                starts.append(e)
                s = e
                break
        else:  # pragma: no cover - pass 2 guarantees a continuation exists
            raise RuntimeError("partition DP reconstruction failed (planner bug)")
    return tuple(starts)


def _legal_cuts(blocks: Sequence[BlockCost]) -> list[bool]:
    """``legal[c]``: a stage may start at block c, i.e. a cut after block c-1 is legal (1 <= c < n)."""
    n = len(blocks)
    return [False] + [blocks[c - 1].cut_legal for c in range(1, n)] + [False]


def _cost_matrix(blocks: Sequence[BlockCost], link: LinkCost) -> list[list[float]]:
    """``m[s][e]`` = stage_cost of a stage [s, e), from prefix sums (O(n^2))."""
    n = len(blocks)
    pre = [0.0]
    for b in blocks:
        pre.append(pre[-1] + b.fwd_s + b.bwd_s)
    # comm_fwd + comm_bwd = 2 * (send in + send out)
    send_in = [0.0] + [2 * link.send_s(blocks[s - 1].cut_bytes) for s in range(1, n)]
    send_out = [0.0] + [2 * link.send_s(blocks[e - 1].cut_bytes) for e in range(1, n)] + [0.0]
    mat = [[math.inf] * (n + 1) for _ in range(n + 1)]
    for s in range(n):
        for e in range(s + 1, n + 1):
            mat[s][e] = (pre[e] - pre[s]) + send_in[s] + send_out[e]
    return mat


def _check_counts(blocks: Sequence[BlockCost], n_stages: int) -> None:
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
    n_legal = sum(_legal_cuts(blocks))
    if n_legal < n_stages - 1:
        raise InfeasibleError(
            f"--gpus {n_stages} needs {n_stages - 1} cuts but the model has only {n_legal} legal cut "
            f"positions; use --gpus {n_legal + 1} or fewer, or make more block boundaries cuttable"
        )


class _MemoryModel:
    """Memory check of stage [s, e) at stage index k, in integer arithmetic from prefix sums."""

    def __init__(
        self,
        blocks: Sequence[BlockCost],
        optimizer: OptimizerSpec,
        limit: float,
        recompute: str = "never",
        n_microbatches: int = 1,
    ) -> None:
        n = len(blocks)
        self.n = n
        self.limit = limit
        self.recompute = recompute
        self.optimizer = optimizer
        self.m = n_microbatches
        self.pre_p = [0]
        self.pre_n = [0]
        self.pre_a = [0]
        for b in blocks:
            self.pre_p.append(self.pre_p[-1] + b.param_bytes)
            self.pre_n.append(self.pre_n[-1] + b.params)
            self.pre_a.append(self.pre_a[-1] + b.activation_bytes)
        self.cut_in = [0] + [blocks[s - 1].cut_bytes for s in range(1, n)]
        self.cut_out = [0] + [blocks[e - 1].cut_bytes for e in range(1, n)] + [0]
        self.out = self.cut_out[:n] + [blocks[-1].output_bytes]

    def bytes(self, s: int, e: int, in_flight: int, recompute: bool = False) -> int:
        # Same formula as stage_memory_bytes.
        return _peak(
            self.pre_p[e] - self.pre_p[s],
            self.pre_n[e] - self.pre_n[s],
            self.pre_a[e] - self.pre_a[s],
            self.cut_in[s],
            self.cut_out[e],
            self.out[e],
            in_flight,
            self.optimizer,
            recompute,
            self.m,
        )

    def choice(self, s: int, e: int, in_flight: int) -> bool | None:
        """Whether the stage recomputes (False: no, True: yes), or None when it cannot fit either way."""
        if self.recompute != "always" and self.bytes(s, e, in_flight) <= self.limit:
            return False
        if self.recompute != "never" and self.bytes(s, e, in_flight, True) <= self.limit:
            return True
        return None

    def fits(self, s: int, e: int, in_flight: int) -> bool:
        return self.choice(s, e, in_flight) is not None


def _any_fit(blocks: Sequence[BlockCost], mem: _MemoryModel, infl: Sequence[int]) -> bool:
    """Whether some partition into ``len(infl)`` stages fits memory (bitset reachability, O(p n) ORs)."""
    n = len(blocks)
    legal = _legal_cuts(blocks)
    q = len(infl)
    masks: dict[int, list[int]] = {}
    reach = 1  # bit s set: some prefix partition ends at s
    for k in range(q):
        t = infl[k]
        if t not in masks:
            rows = []
            for s in range(n):
                bits = 0
                for e in range(s + 1, n + 1):
                    if (e == n or legal[e]) and mem.fits(s, e, t):
                        bits |= 1 << e
                rows.append(bits)
            masks[t] = rows
        new = 0
        s_bits = reach
        while s_bits:
            low = s_bits & -s_bits
            s = low.bit_length() - 1
            if s < n:
                new |= masks[t][s]
            s_bits ^= low
        if k < q - 1:
            new &= ~(1 << n)  # only the last stage may end at n
        reach = new
        if not reach:
            return False
    return bool(reach >> n & 1)


def _memory_error(
    blocks: Sequence[BlockCost],
    n_stages: int,
    schedule: str,
    n_microbatches: int,
    mem: _MemoryModel,
) -> InfeasibleError:
    """Build the error for a memory limit nothing fits, naming the smallest stage count that would."""
    n = len(blocks)
    n_legal = sum(_legal_cuts(blocks))
    limit = mem.limit
    skipped_1f1b = False
    for q in range(n_stages + 1, min(n, n_legal + 1) + 1):
        if schedule == "1f1b" and n_microbatches < q:
            skipped_1f1b = True  # torch's Schedule1F1B needs n_microbatches >= n_stages
            continue
        if _any_fit(blocks, mem, in_flight_per_stage(schedule, q, n_microbatches)):
            return InfeasibleError(
                f"--memory-limit {_gib(limit)} is too small for {n_stages} stages: no split fits; "
                f"the smallest stage count that fits is {q}: use --gpus {q} or raise --memory-limit"
            )
    # Even the finest splits fail: name a block that cannot fit on its own with the fewest live
    # microbatches its stage can have. GPipe holds m everywhere; under 1F1B the last stage holds 1,
    # but block 0 is always on stage 0, which holds min(m, p) >= min(m, n_stages) (Narayanan 2021).
    for j in range(n):
        if schedule == "gpipe":
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
    more = " (1F1B also needs at least one microbatch per stage: raise -m)" if skipped_1f1b else ""
    return InfeasibleError(
        f"--memory-limit {_gib(limit)} is too small: no split into {n_stages} to {min(n, n_legal + 1)} "
        f"stages fits{more}; raise --memory-limit or make more block boundaries cuttable"
    )


def _gib(nbytes: float) -> str:
    """Bytes as the GiB figure ``--memory-limit`` takes."""
    return f"{nbytes / 2**30:.3g} GiB"


def solve(
    blocks: Sequence[BlockCost],
    n_stages: int,
    link: LinkCost,
    *,
    schedule: str = "1f1b",
    n_microbatches: int,
    optimizer: OptimizerSpec = DEFAULT_OPTIMIZER,
    memory_limit_bytes: int | None = None,
    recompute: str = "auto",
) -> Partition:
    """The partition with the smallest bottleneck stage cost (exact).

    Minimises max stage cost over all contiguous partitions into exactly ``n_stages`` non-empty
    stages on legal cuts, with every stage's ``stage_memory_bytes`` (using the peak in-flight count
    of that stage index under ``schedule``) at most ``memory_limit_bytes`` when given. Ties (within
    a relative 1e-9) go to the least total stage cost (less communication), then to the
    lexicographically smallest starts.

    Args:
        blocks: per-block costs in execution order.
        n_stages: number of pipeline stages (= ranks).
        link: cost of one message between neighbouring ranks.
        schedule: "gpipe" or "1f1b"; decides the in-flight microbatches per stage.
        n_microbatches: microbatches per step.
        optimizer: the optimizer (state bytes per parameter byte).
        memory_limit_bytes: per-rank memory limit, or None for no limit.
        recompute: activation checkpointing per stage: "never", "always", or "auto" — a stage
            recomputes only when it would not fit the memory limit otherwise (it then pays its
            forward once more in backward). The choice is part of the exact search: each stage's
            cost is the cheaper option that fits.

    Returns:
        The optimal partition (with its per-stage recompute flags).

    Raises:
        InfeasibleError: n_stages > number of blocks, too few legal cuts, a schedule request torch
            refuses, or no partition fits the memory limit (the message names the smallest stage
            count that would fit, or the block that cannot fit alone).
    """
    if recompute not in ("never", "auto", "always"):
        raise InfeasibleError(f"recompute={recompute!r}; expected 'never', 'auto' or 'always'")
    _check_counts(blocks, n_stages)
    infl = in_flight_per_stage(schedule, n_stages, n_microbatches)
    n = len(blocks)
    plain = _cost_matrix(blocks, link)
    pre_r = [0.0]
    for b in blocks:
        pre_r.append(pre_r[-1] + recompute_cost(b))
    limit = memory_limit_bytes if memory_limit_bytes is not None else math.inf
    # Without a limit "auto" never needs to recompute.
    mode = recompute if memory_limit_bytes is not None or recompute == "always" else "never"
    mem = _MemoryModel(blocks, optimizer, limit, mode, n_microbatches)

    def choice(s: int, e: int, k: int) -> bool | None:
        return mem.choice(s, e, infl[k])

    def cost(s: int, e: int, k: int) -> float:
        c = choice(s, e, k)
        if c is None:
            return math.inf
        return plain[s][e] + (pre_r[e] - pre_r[s] if c else 0.0)

    allowed: Allowed = lambda s, e, k: choice(s, e, k) is not None  # noqa: E731
    starts = _dp_partition(n, n_stages, _legal_cuts(blocks), cost, cost, allowed)
    if starts is None:
        raise _memory_error(blocks, n_stages, schedule, n_microbatches, mem)
    bounds = _bounds(starts, n)
    flags = [bool(choice(s, e, k)) for k, (s, e) in enumerate(bounds)]
    return evaluate(blocks, starts, link, flags)


# ---------------------------------------------------------------------------------------------
# Baselines
# ---------------------------------------------------------------------------------------------


def uniform_layers(blocks: Sequence[BlockCost], n_stages: int, link: LinkCost) -> Partition:
    """Equal numbers of layers per stage: the torchtitan / Megatron default split.

    The ``is_layer`` blocks are dealt out in order, ``L // p`` per stage and one extra to each of the
    first ``L % p`` stages (torchtitan gives the remainder to the earliest stages). Non-layer blocks
    before the first layer join stage 0, those after the last layer join the last stage, and those
    between layers stay with the preceding layer, so stage k > 0 starts exactly at its first layer.
    If that start is not a legal cut, it moves to the nearest legal start that keeps the stages
    non-empty and increasing (the earlier one on a tie).

    Args:
        blocks: per-block costs in execution order.
        n_stages: number of stages p.
        link: cost of one message between neighbouring ranks.

    Returns:
        The split with its bottleneck evaluated on the real stage costs (communication included).

    Raises:
        InfeasibleError: fewer layers than stages, too few blocks or legal cuts.
    """
    _check_counts(blocks, n_stages)
    n = len(blocks)
    layers = [i for i, b in enumerate(blocks) if b.is_layer]
    if len(layers) < n_stages:
        raise InfeasibleError(
            f"the model has {len(layers)} layer blocks but --gpus is {n_stages}; expected at least one "
            "layer per stage for an equal-layer split; use fewer stages."
        )
    per, extra = divmod(len(layers), n_stages)
    legal = _legal_cuts(blocks)
    starts = [0]
    first_layer = 0
    for k in range(1, n_stages):
        first_layer += per + (1 if k - 1 < extra else 0)
        target = layers[first_layer]
        hi = n - (n_stages - k)  # leave one block for each later stage
        chosen = None
        for d in range(n):
            for c in (target - d, target + d):
                if starts[-1] < c <= hi and legal[c]:
                    chosen = c
                    break
            if chosen is not None:
                break
        if chosen is None:
            raise InfeasibleError(
                f"no legal cut is left for stage {k} of the equal-layer split; expected a cuttable "
                "boundary between the previous stage and the end; use fewer stages."
            )
        starts.append(chosen)
    return evaluate(blocks, starts, link)


def param_balanced(blocks: Sequence[BlockCost], n_stages: int, link: LinkCost) -> Partition:
    """Minimise the largest per-stage parameter count: DeepSpeed ``partition_method="parameters"``.

    DeepSpeed's ``partition_balanced`` minimises the max part weight over per-layer parameter
    counts; this solves the same objective exactly with the partition DP, on legal cuts only, with
    non-empty stages. Among equal optima it picks the lexicographically largest starts, i.e. the
    earlier stages as full as possible, as DeepSpeed's greedy ``_lprobe`` does (it bisects each part
    up to the bottleneck); DeepSpeed's own bisection is approximate (eps) and may allow empty parts.

    Args:
        blocks: per-block costs in execution order.
        n_stages: number of stages p.
        link: cost of one message between neighbouring ranks.

    Returns:
        The split with its bottleneck evaluated on the real stage costs (communication included).

    Raises:
        InfeasibleError: too few blocks or legal cuts.
    """
    _check_counts(blocks, n_stages)
    n = len(blocks)
    pre = [0]
    for b in blocks:
        pre.append(pre[-1] + b.params)
    params = [[float(pre[e] - pre[s]) if e > s else math.inf for e in range(n + 1)] for s in range(n + 1)]
    cost: StageCost = lambda s, e, k: params[s][e]  # noqa: E731
    starts = _dp_partition(n, n_stages, _legal_cuts(blocks), cost, cost, lambda s, e, k: True, latest=True)
    assert starts is not None  # _check_counts guarantees a partition without memory limits
    return evaluate(blocks, starts, link)
