"""How many of a stage's blocks recompute under ``--recompute auto``: the fewest that still fit.

Pure module: never imports torch. The solver (``planner.core.split.solve``) picks each stage's mode among
whole-stage options (never, selective, full, stage: the first that fits). A stage that must
recompute rarely needs every block to: Megatron-LM's ``--recompute-method block
--recompute-num-layers k`` checkpoints only the first k layers of each pipeline stage, the rest
keep their activations, and k is tuned by hand until the run fits. Here the search does it: for a
stage the solver made recompute selectively or fully, ``fewest_recomputed`` tries the same mode,
and the other of the two, on only the stage's first k checkpoint regions (``"full:k"``,
``"selective:k"``) and keeps the option with the least recomputation time that fits the same
per-stage memory limit.

The memory of such a stage for every k comes from one pass over its regions
(``planner.core.split.stage_model.prefix_memory_parts``); its recomputation time only grows with k, so
within a mode the least k that fits is the fastest, and the scan is exact.

Because the split itself was chosen with whole-stage modes, the result is at least as fast as the
solver's and every stage still fits, but a split chosen knowing the partial options could be faster
still (the solver's exactness covers whole-stage modes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from planner.core.layout.inputs import Constraints, Layout
from planner.core.levers.links import Links
from planner.core.levers.recompute import partial_mode, rerun_s
from planner.core.split.cuts import Split
from planner.core.split.solve import policy_options
from planner.core.split.stage_model import Partition, evaluate, prefix_memory_parts, stage_bounds
from planner.schema.costs import PARTIAL_MODES, BlockCost, RecomputeMode

Peaks = dict[tuple[int, int, str, int], list[int]]
"""A stage's peaks by count of recomputed regions (``fewest_recomputed``), by (start, end, mode, live
microbatches): the same for every split of one layout's blocks."""


def fewest_recomputed(
    blocks: Sequence[BlockCost],
    split: Partition,
    link: Links,
    layout: Layout,
    constraints: Constraints,
    in_flight: Sequence[int],
    known: Peaks | None = None,
) -> Partition:
    """The solver's split with each recomputing stage's mode narrowed to its fewest regions that fit.

    Only under ``--recompute auto`` with a memory limit (an explicit mode is applied to every block,
    as asked; without a limit nothing recomputes).

    Args:
        blocks: per-block costs in execution order.
        split: the solver's partition (its starts and per-stage modes).
        link: the links the solver costed the split with.
        layout: the schedule (which modes may run), microbatches, replicas and their sharding.
        constraints: the optimizer, the memory limit of one stage and the recompute policy.
        in_flight: each stage's peak live microbatches, as the solver had them.
        known: peaks counted for other splits of the same blocks and layout, by (start, end, mode,
            live microbatches), read and added to (None: none kept); they depend on nothing else.

    Returns:
        The partition with the narrowed modes and its bottleneck re-evaluated (``split`` itself when
        nothing changes).
    """
    limit = constraints.memory_limit_bytes
    if constraints.recompute != "auto" or limit is None or not split.recompute:
        return split
    modes = [m for m in policy_options("auto", layout.schedule) if m in PARTIAL_MODES]
    flags = list(split.recompute)
    for k, (start, end) in enumerate(stage_bounds(split.starts, len(blocks))):
        if flags[k] not in PARTIAL_MODES:  # never, stage: nothing to narrow
            continue
        peaks = {mode: _peaks(blocks, start, end, mode, in_flight[k], layout, constraints, known) for mode in modes}
        flags[k] = narrowest(blocks[start:end], flags[k], peaks, limit)
    if flags == list(split.recompute):
        return split
    return evaluate(
        blocks, Split(starts=split.starts, recompute=tuple(flags)), link, layout.schedule, layout.stages_per_rank
    )


def _peaks(
    blocks: Sequence[BlockCost],
    start: int,
    end: int,
    mode: RecomputeMode,
    live: int,
    layout: Layout,
    constraints: Constraints,
    known: Peaks | None,
) -> list[int]:
    """The stage ``blocks[start:end]``'s peak bytes with ``live`` microbatches and its first k regions
    recomputed in ``mode``, for k = 0 .. all (``prefix_memory_parts``), from ``known`` where counted."""
    key = (start, end, mode, live)
    if known is not None and key in known:
        return known[key]
    parts = prefix_memory_parts(
        blocks, start, end, constraints.optimizer, mode, layout.n_microbatches, layout.shard, layout.per_block
    )
    peaks = [one.peak(live, layout.fresh_grads) for one in parts]
    if known is not None:
        known[key] = peaks
    return peaks


def narrowest(part: Sequence[BlockCost], value: str, peaks: Mapping[RecomputeMode, Sequence[int]], limit: float) -> str:
    """The stage ``part``'s cheapest recompute value that fits, among ``value`` (which fits) and each
    mode of ``peaks`` on its first k checkpoint regions, for the least k that fits.

    Args:
        part: the stage's blocks.
        value: its mode as the solver chose it.
        peaks: per mode that may apply to some regions ("selective", "full"; the schedule may rule
            out selective), the stage's peak bytes with its first k regions so, for k = 0 .. all.
        limit: the stage's memory limit.

    Returns:
        ``value``, or "mode:k" with less recomputation (ties keep ``value``, then the first mode).
    """
    best, best_s = value, rerun_s(part, value)
    for mode, by_count in peaks.items():
        fitting = [k for k, peak in enumerate(by_count) if peak <= limit]
        if not fitting:
            continue
        option = partial_mode(mode, fitting[0], len(by_count) - 1)
        seconds = rerun_s(part, option)
        if seconds < best_s:
            best, best_s = option, seconds
    return best
