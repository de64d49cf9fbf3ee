"""Block-range sums for the exact solver's memory model: any stage's terms in O(1).

Pure module (numpy only). ``stage_memory_parts`` (``planner.core.split.stage_model``) sums a stage's
blocks one by one; the solver asks the same of every block range, so it precomputes prefix sums
and range maxima (sparse tables) once per request: the measured optimizer-step temporaries
(``StepTemps``; on arrays ``StepTempArrays``) and the checkpoint regions (``RegionSums``), each
asked one stage at a time or, as arrays, for many stages at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from planner.core.levers.recompute import (
    full_rerun_cost,
    kept_bytes,
    loss_held,
    loss_temps,
    selective_cost,
    temp_bytes,
    unit_grad_bytes,
)
from planner.core.split.solve_engine import AnyIntArray, IntArray
from planner.core.split.stage_model import Regions, StageSums, boundary_message_s, cold_in, cold_out
from planner.schema.costs import BlockCost, LinkCost, OptimizerSpec


class RangeMax:
    """Maxima of any range of a list in O(1): a sparse table (``table[j][i]`` = max of
    ``values[i .. i + 2^j - 1]``), asked one range at a time (``of``) or many at once (``many``)."""

    def __init__(self, values: Sequence[int]) -> None:
        self.table = [list(values)]
        while 2 ** len(self.table) <= len(values):
            row, half = self.table[-1], 2 ** (len(self.table) - 1)
            self.table.append([max(row[i], row[i + half]) for i in range(len(row) - half)])
        self.n = len(values)

    def of(self, s: int, e: int) -> int:
        """Max of ``values[s:e]`` (``s < e``)."""
        j = (e - s).bit_length() - 1
        return max(self.table[j][s], self.table[j][e - (1 << j)])

    def arrays(self, dtype: Any) -> RangeMaxArrays:
        """The table as numpy rows, for ``many``."""
        return RangeMaxArrays([np.array(row, dtype=dtype) for row in self.table], self.n)


class RangeMaxArrays:
    """``RangeMax`` on arrays of ranges: its levels as the rows of one 2-D array (each padded to the
    first's length), so that a batch of ranges is answered by one gather per end, whatever their levels.
    (The solver asks hundreds of thousands of small batches; one pass per distinct level, with
    ``np.unique`` to find them, was most of the time it spent here.)"""

    def __init__(self, rows: list[Any], n: int) -> None:
        self.width = len(rows[0]) if rows else 0
        self.table = np.zeros((len(rows), max(self.width, 1)), dtype=rows[0].dtype if rows else np.int64)
        for level, row in enumerate(rows):
            self.table[level, : len(row)] = row
        self.log2 = np.array([0, 0] + [k.bit_length() - 1 for k in range(2, n + 1)], dtype=np.int64)

    def many(self, s: IntArray, e: IntArray) -> AnyIntArray:
        """Per range ``[s, e)``, its max (0 where ``e <= s``).

        A range of length L reads level floor(log2 L) at ``s`` and ``e - 2**level``, both inside that
        level's own row, so the padding is never read for a range that is not empty (an empty one
        reads level 0 and is then zeroed).
        """
        if not self.width:
            return 0 * s
        j = self.log2[np.maximum(e - s, 1)]
        last = self.width - 1
        lo, hi = np.minimum(s, last), np.minimum(np.maximum(e - np.left_shift(1, j), 0), last)
        most = np.maximum(self.table[j, lo], self.table[j, hi])
        out: AnyIntArray = np.where(e > s, most, 0 * most)
        return out


class StepTemps:
    """The measured optimizer-step temporaries of any block range in O(1) (``stage_memory_parts``'s
    ``T``): a prefix count of the blocks without ``opt_temp_bytes``, prefix sums for the "sum" rule
    and range maxima for "max".
    """

    def __init__(self, blocks: Sequence[BlockCost], optimizer: OptimizerSpec) -> None:
        self.rule = optimizer.step_temp_rule
        values = [b.opt_temp_bytes or 0 for b in blocks]
        self.pre_missing = [0]
        self.pre_sum = [0]
        for b, v in zip(blocks, values):
            self.pre_missing.append(self.pre_missing[-1] + (b.opt_temp_bytes is None))
            self.pre_sum.append(self.pre_sum[-1] + v)
        self.most = RangeMax(values)
        self.all_measured = self.pre_missing[-1] == 0
        self.none_measured = self.pre_missing[-1] == len(blocks)

    def of(self, s: int, e: int) -> int | None:
        """``T`` of the stage ``[s, e)`` (``s < e``): None when some block of it was not measured."""
        if self.pre_missing[e] != self.pre_missing[s]:
            return None
        if self.rule == "sum":
            return self.pre_sum[e] - self.pre_sum[s]
        return self.most.of(s, e)


class StepTempArrays:
    """``StepTemps`` on arrays of stages ``[s, e)``, with the fallback for unmeasured blocks: an AdamW
    step's two temporaries of 4 bytes per parameter (``OptimizerSpec.step_temp_bytes``), else 0."""

    def __init__(self, temps: StepTemps, dtype: Any, adamw: bool) -> None:
        self.rule, self.adamw = temps.rule, adamw
        self.all_measured, self.none_measured = temps.all_measured, temps.none_measured
        self.pre_missing = np.array(temps.pre_missing, dtype=np.int64)
        self.pre_sum = np.array(temps.pre_sum, dtype=dtype)
        self.most = temps.most.arrays(dtype)

    def measured(self, s: IntArray, e: IntArray) -> AnyIntArray:
        """Per stage, ``StepTemps.of`` with the unmeasured blocks counted as 0 (0 when ``e <= s``)."""
        if self.rule == "sum":
            total: AnyIntArray = self.pre_sum[e] - self.pre_sum[s]
            return total
        return self.most.many(s, e)

    def of(self, s: IntArray, e: IntArray, n_p: AnyIntArray) -> AnyIntArray:
        """Per stage, ``T`` of ``stage_memory_parts``: measured where all its blocks were, else the
        fallback (``n_p``: the stages' parameters)."""
        fallback = 8 * n_p if self.adamw else 0 * n_p
        if self.none_measured:
            return fallback
        step: AnyIntArray = np.where(self.pre_missing[e] == self.pre_missing[s], self.measured(s, e), fallback)
        return step

    def floor(self, s: IntArray, e: IntArray, n_p: AnyIntArray) -> AnyIntArray:
        """A lower bound of ``of`` that never decreases as ``e`` grows: exact when every block or none
        was measured; with some measured, the smaller of the two (each grows with ``e``)."""
        fallback = 8 * n_p if self.adamw else 0 * n_p
        if self.none_measured:
            return fallback
        measured = self.measured(s, e)
        if self.all_measured:
            return measured
        floor: AnyIntArray = np.minimum(measured, fallback)
        return floor


class RegionSums:
    """The checkpoint regions of any stage ``[s, e)`` in O(1) (``stage_memory_parts``' ``Regions``).

    Stages start at legal cuts, so a stage's regions are the regions starting inside it
    (``checkpoint_units``): each region's input, activations and kept bytes are put at its first
    block, prefix sums add them and range maxima take their largest (a region's activations and
    rebuilt bytes with its backward's temporaries; the blocks' temporaries alone as well).
    """

    def __init__(self, blocks: Sequence[BlockCost]) -> None:
        n = len(blocks)
        heads = [0] + [c for c in range(1, n) if blocks[c - 1].cut_legal]
        inputs, acts, rebuilt, params, grads = [0] * n, [0] * n, [0] * n, [0] * n, [0] * n
        for a, z in zip(heads, [*heads[1:], n]):
            held = sum(loss_held(b) for b in blocks[a:z])  # the loss's, kept outside the regions
            temp = max(temp_bytes(b) for b in blocks[a:z])  # its backward's temporaries, while rebuilt
            inputs[a] = (blocks[a - 1].kept_cut_bytes if a > 0 else 0) + held
            acts[a] = sum(b.activation_bytes for b in blocks[a:z]) - held
            rebuilt[a] = max(acts[a] - sum(kept_bytes(b) for b in blocks[a:z]), 0) + temp
            acts[a] += temp
            params[a] = sum(b.param_bytes for b in blocks[a:z])
            grads[a] = unit_grad_bytes(params[a], sum(b.params for b in blocks[a:z]))
        self.pre_in, self.pre_kept, self.pre_held = [0], [0], [0]
        for b, x in zip(blocks, inputs):
            self.pre_in.append(self.pre_in[-1] + x)
            self.pre_kept.append(self.pre_kept[-1] + kept_bytes(b))
            self.pre_held.append(self.pre_held[-1] + loss_held(b))
        self.acts, self.rebuilt, self.params = RangeMax(acts), RangeMax(rebuilt), RangeMax(params)
        self.grads = RangeMax(grads)
        self.temps = RangeMax([temp_bytes(b) for b in blocks])

    def of(self, s: int, e: int) -> Regions:
        return Regions(
            self.pre_in[e] - self.pre_in[s],
            self.acts.of(s, e),
            self.pre_kept[e] - self.pre_kept[s],
            self.rebuilt.of(s, e),
            self.pre_held[e] - self.pre_held[s],
            self.params.of(s, e),
            self.grads.of(s, e),
            self.temps.of(s, e),
        )


@dataclass(frozen=True)
class BlockSums:
    """The prefix sums and per-boundary sizes a memory check reads, a function of the blocks (and
    the optimizer) only."""

    pre_p: list[int]
    pre_n: list[int]
    pre_a: list[int]
    pre_c: list[int]  # autocast's weight copies (``weight_cast_bytes``)
    cut_in: list[int]
    kept_in: list[int]
    cut_out: list[int]
    out: list[int]
    loss_temp: list[int]
    temps: StepTemps
    regions: RegionSums
    # what FSDP shards, where it differs from what the rank holds (``BlockCost.fsdp_sharded``: expert
    # parallelism's whole experts): its bytes' and parameters' prefix sums; None where it never does
    pre_fsdp: tuple[list[int], list[int]] | None = None

    def fsdp_of(self, s: int, e: int) -> tuple[int, int] | None:
        """``StageSums.fsdp`` of the stage ``[s, e)``: None where FSDP shards what the rank holds."""
        if self.pre_fsdp is None:
            return None
        pre_fp, pre_fn = self.pre_fsdp
        return pre_fp[e] - pre_fp[s], pre_fn[e] - pre_fn[s]

    def stage(self, s: int, e: int) -> StageSums:
        """The ``StageSums`` of the stage ``[s, e)`` in O(1): what ``stage_memory_parts`` sums block by
        block (``s < e``, a valid range)."""
        return StageSums(
            self.pre_p[e] - self.pre_p[s],
            self.pre_n[e] - self.pre_n[s],
            self.pre_a[e] - self.pre_a[s],
            self.cut_in[s],
            self.cut_out[e],
            self.kept_in[s],
            self.out[e],
            self.temps.of(s, e),
            self.regions.of(s, e),
            None if self.loss_temp[e] < 0 else self.loss_temp[e],
            self.pre_c[e] - self.pre_c[s],
            self.fsdp_of(s, e),
        )


_T = TypeVar("_T")


def _per_blocks(
    store: dict[int, tuple[Sequence[BlockCost], Any, Any]],
    blocks: Sequence[BlockCost],
    key: Any,
    make: Callable[[], _T],
) -> _T:
    """``make()``, once per blocks object and ``key`` while the last 8 are kept in ``store``.

    The search solves hundreds of layouts over the same blocks: their sums are made once per blocks
    object (a 1,000-layer model spent a quarter of its search rebuilding them). Keyed by identity,
    the blocks kept alongside so the id cannot be reused while cached.
    """
    known = store.get(id(blocks))
    if known is not None and known[0] is blocks and known[1] == key:
        value: _T = known[2]
        return value
    value = make()
    if len(store) >= 8:
        store.pop(next(iter(store)))
    store[id(blocks)] = (blocks, key, value)
    return value


_SUMS: dict[int, tuple[Sequence[BlockCost], Any, Any]] = {}


def block_sums(blocks: Sequence[BlockCost], optimizer: OptimizerSpec) -> BlockSums:
    """The blocks' ``BlockSums``, made once per blocks object and optimizer (``_per_blocks``).

    Args:
        blocks: per-block costs.
        optimizer: the optimizer (its step temporaries).

    Returns:
        The sums (shared: never modify them).
    """
    return _per_blocks(_SUMS, blocks, optimizer, lambda: _block_sums(blocks, optimizer))


def _block_sums(blocks: Sequence[BlockCost], optimizer: OptimizerSpec) -> BlockSums:
    n = len(blocks)
    pre_p, pre_n, pre_a, pre_c = [0], [0], [0], [0]
    for b in blocks:
        pre_p.append(pre_p[-1] + b.param_bytes)
        pre_n.append(pre_n[-1] + b.params)
        pre_a.append(pre_a[-1] + b.activation_bytes)
        pre_c.append(pre_c[-1] + b.weight_cast_bytes)
    # receive buffers and the kept stage output are what one rank sends (a tensor-parallel piece);
    # a stage recomputed as one region keeps the whole gathered input
    cut_out = [0] + [blocks[e - 1].sent_bytes for e in range(1, n)] + [0]
    last = loss_temps(blocks, n)
    sums = BlockSums(
        pre_p,
        pre_n,
        pre_a,
        pre_c,
        cut_in=[0] + [blocks[s - 1].sent_bytes for s in range(1, n)],
        kept_in=[0] + [blocks[s - 1].kept_cut_bytes for s in range(1, n)],
        cut_out=cut_out,
        out=cut_out[:n] + [blocks[-1].output_bytes],
        loss_temp=[-1] * n + [-1 if last is None else last],
        temps=StepTemps(blocks, optimizer),
        regions=RegionSums(blocks),
        pre_fsdp=_fsdp_prefix(blocks),
    )
    return sums


def _fsdp_prefix(blocks: Sequence[BlockCost]) -> tuple[list[int], list[int]] | None:
    """Prefix sums of what FSDP shards, (bytes, parameters), where some block's differs from what it
    holds (``BlockCost.fsdp_params``), else None."""
    if all(b.fsdp_params is None for b in blocks):
        return None
    pre_fp, pre_fn = [0], [0]
    for b in blocks:
        params, nbytes = b.fsdp_sharded()
        pre_fp.append(pre_fp[-1] + nbytes)
        pre_fn.append(pre_fn[-1] + params)
    return pre_fp, pre_fn


@dataclass(frozen=True)
class BlockTimes:
    """Prefix sums of the blocks' seconds, in block order as a stage-by-stage evaluation adds them
    (the exact solver's time model, ``planner.core.split.solve``), a function of the blocks only."""

    pre: list[float]  # forward + backward
    pre_r: list[float]  # full checkpointing's extra backward (a block ending no legal cut re-runs in full)
    pre_rs: list[float]  # selective checkpointing's
    pre_f: list[float]  # forwards
    rerun: list[float]  # each block's full re-run as the last of a region


_TIMES: dict[int, tuple[Sequence[BlockCost], Any, Any]] = {}
_ROWS: dict[int, tuple[Sequence[BlockCost], Any, Any]] = {}


def message_rows(blocks: Sequence[BlockCost], link: LinkCost) -> tuple[list[float], list[float]]:
    """Per stage start ``s`` (index s, 0 for the first stage) both directions' messages in over
    ``link`` plus the receiver's cold start, and per stage end ``e`` (index e, 0 for none, n for the
    last stage) the same out: the communication the solver's time model adds to a stage
    (``stage_model._boundary_send_s``), made once per blocks object and link.

    Returns:
        The two rows (shared: never modify them).
    """
    per_link: dict[LinkCost, tuple[list[float], list[float]]] = _per_blocks(_ROWS, blocks, None, dict)
    if link not in per_link:
        n = len(blocks)
        send_in = [0.0] + [2 * boundary_message_s(blocks[s - 1], link) + cold_in(blocks, s) for s in range(1, n)]
        send_out = [0.0] + [2 * boundary_message_s(blocks[e - 1], link) + cold_out(blocks, e) for e in range(1, n)]
        per_link[link] = (send_in, send_out + [0.0])
    return per_link[link]


def block_times(blocks: Sequence[BlockCost]) -> BlockTimes:
    """The blocks' ``BlockTimes``, made once per blocks object (``_per_blocks``).

    Args:
        blocks: per-block costs.

    Returns:
        The sums (shared: never modify them).
    """
    return _per_blocks(_TIMES, blocks, None, lambda: _block_times(blocks))


def _block_times(blocks: Sequence[BlockCost]) -> BlockTimes:
    n = len(blocks)
    pre, pre_r, pre_rs, pre_f = [0.0], [0.0], [0.0], [0.0]
    rerun = [full_rerun_cost(b, True) for b in blocks]
    for i, b in enumerate(blocks):
        pre.append(pre[-1] + b.fwd_s + b.bwd_s)
        pre_r.append(pre_r[-1] + (rerun[i] if b.cut_legal or i == n - 1 else full_rerun_cost(b, False)))
        pre_rs.append(pre_rs[-1] + selective_cost(b))
        pre_f.append(pre_f[-1] + b.fwd_s)
    return BlockTimes(pre, pre_r, pre_rs, pre_f, rerun)
