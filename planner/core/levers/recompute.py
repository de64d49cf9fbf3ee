"""What a stage's recompute mode re-runs and keeps: its checkpoint regions, block by block.

Pure module (no torch). A stage checkpoints its activations in one of the modes of
``planner.schema.costs.RecomputeMode`` (never; per checkpoint region, selectively or fully; or the
whole stage as one region), or on only its first k regions (``"full:k"``, ``"selective:k"``:
``planner.schema.costs.split_recompute``). Here: the regions (``checkpoint_units``), the seconds a
mode re-runs in backward (``rerun_s``) and the bytes it keeps per region (``region_bytes``, and per
count of recomputed regions ``prefix_bytes``). ``planner.core.split.stage_model`` turns these into a
stage's time and memory; the runner (``planner.run.stages``) builds the same regions.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any, NamedTuple

from planner.errors import InfeasibleError
from planner.schema.costs import BlockCost, RecomputeMode, split_recompute


@lru_cache(maxsize=4096)
def recompute_mode(value: bool | str) -> str:
    """One stage's recompute value (``planner.schema.costs.split_recompute``: a mode, or "full:k" /
    "selective:k" for its first k checkpoint regions); a flag of older plans and callers: True is
    "stage" (the whole stage as one region, as they recomputed), False "never".

    Raises:
        InfeasibleError: a string that is no such value.
    """
    # cached: the search checks the same few values hundreds of thousands of times
    if isinstance(value, bool):
        return "stage" if value else "never"
    try:
        split_recompute(value)
    except ValueError as e:
        raise InfeasibleError(str(e)) from None
    return value


def partial_mode(mode: RecomputeMode, count: int, n_units: int) -> str:
    """The stage value of ``mode`` on the first ``count`` of its ``n_units`` checkpoint regions:
    "never" for none, the plain mode for all, else "mode:count"."""
    if count <= 0:
        return "never"
    return mode if count >= n_units else f"{mode}:{count}"


def recomputed_prefix(part: Sequence[BlockCost], value: str) -> tuple[RecomputeMode, int]:
    """The stage ``part``'s mode and how many of its first blocks it applies to (every block for a
    plain mode; the blocks of its first k checkpoint regions for "mode:k")."""
    mode, count = split_recompute(recompute_mode(value))
    if count is None:
        return mode, len(part)
    units = checkpoint_units(part, 0, len(part))
    return mode, units[min(count, len(units)) - 1][1]


def recompute_flags(recompute: Sequence[bool | str], n_stages: int) -> list[str]:
    """Per-stage recompute modes, with the empty sequence meaning "no stage recomputes"."""
    return [recompute_mode(x) for x in recompute] or ["never"] * n_stages


def compact_flags(flags: Sequence[bool | str]) -> tuple[str, ...]:
    """The modes as plans store them: empty when no stage recomputes."""
    modes = tuple(recompute_mode(x) for x in flags)
    return modes if any(x != "never" for x in modes) else ()


def recompute_cost(block: BlockCost) -> float:
    """Extra backward time of a block under full checkpointing (its forward again).

    The profiler measures it (the forward again, up to the last tensor it saves: torch's checkpoint
    stops early there). When it is unknown (None: not measured) the block's whole forward is
    charged, the most a recomputation can cost.
    """
    return block.recompute_s if block.recompute_s is not None else block.fwd_s


def selective_cost(block: BlockCost) -> float:
    """Extra backward time of a block under selective checkpointing: the ops of its forward other
    than the matmuls and attention, run again (``selective_recompute_s``; unknown: ``recompute_cost``)."""
    return block.selective_recompute_s if block.selective_recompute_s is not None else recompute_cost(block)


def kept_bytes(block: BlockCost) -> int:
    """Bytes a block keeps per microbatch under selective checkpointing (unknown: all it saves)."""
    return block.selective_bytes if block.selective_bytes is not None else block.activation_bytes


def temp_bytes(block: BlockCost) -> int:
    """Peak temporaries of a block's backward per microbatch (``bwd_temp_bytes``; unknown: 0)."""
    return block.bwd_temp_bytes or 0


def loss_temps(blocks: Sequence[BlockCost], end: int) -> int | None:
    """The loss's backward temporaries of a stage ending before block ``end``: the last stage's
    (``loss_temp_bytes``, the loss's backward and then the last block's), else (or unknown) None."""
    return blocks[-1].loss_temp_bytes if end == len(blocks) else None


def with_loss(loss_temp: Any, held: Any, grad_and_rebuilt: Any) -> Any:
    """A stage's bytes once, besides per microbatch, in its backward: the output's gradient and what
    its blocks rebuild and hold as temporaries (``grad_and_rebuilt``); on the last stage whose loss's
    temporaries were measured (``loss_temp`` >= 0), the larger of those, which come first, and that
    less what the loss saved (``held``), freed by its backward by then. For ints and for the solver's
    integer arrays alike (a comparison times a difference selects, as ``ceil_div`` divides)."""
    after = grad_and_rebuilt - held
    larger = after + (loss_temp - after) * (loss_temp > after)  # max(loss_temp, after)
    return grad_and_rebuilt + (larger - grad_and_rebuilt) * (loss_temp >= 0)


def loss_held(block: BlockCost) -> int:
    """Bytes of a block's activations that checkpointing cannot drop: the last block's loss runs
    outside the stage module, after its checkpoint regions, so what the loss saves stays per
    microbatch (``loss_bytes``; unknown: 0)."""
    return min(block.loss_bytes or 0, block.activation_bytes)


def rerun_s(part: Sequence[BlockCost], value: str) -> float:
    """Extra backward seconds of a stage of blocks ``part`` under its recompute ``value``.

    A checkpoint region re-runs its forward only up to its last saved tensor (torch's early stop),
    which ``recompute_cost`` / ``selective_cost`` measure per block. Block by block (full, selective)
    the regions are ``checkpoint_units``: a block whose end is no legal cut shares its region with
    the next, so under full checkpointing it re-runs in full; under selective its tail past its last
    save is charged nothing (mostly its last matmul, whose output the policy keeps). A stage run as
    one region re-runs every block but its last in full, since the later blocks need their outputs.
    "full:k" / "selective:k" re-run only the stage's first k regions so.
    """
    mode, upto = recomputed_prefix(part, value)
    part = part[:upto]
    if mode == "never" or not part:
        return 0.0
    if mode == "selective":
        return sum(selective_cost(b) for b in part)
    last = len(part) - 1
    whole = mode == "stage"  # one region: every block but the last feeds a later one of the same region
    return sum(full_rerun_cost(b, i == last or (b.cut_legal and not whole)) for i, b in enumerate(part))


def full_rerun_cost(block: BlockCost, ends_region: bool) -> float:
    """What ``block`` re-runs under full checkpointing: up to its last save when it ends its checkpoint
    region (``recompute_cost``), its whole forward when a later block of the region needs its output."""
    return recompute_cost(block) if ends_region else block.fwd_s


def checkpoint_units(blocks: Sequence[BlockCost], start: int, end: int) -> list[tuple[int, int]]:
    """The checkpoint regions of the stage ``blocks[start:end]``: one per block, except that a block
    whose end is no legal cut (a non-tensor value crosses it) shares its region with the next.

    The runner checkpoints exactly these (``planner.run.stages``), so at most one region's
    activations are rebuilt at a time.
    """
    cuts = [c for c in range(start + 1, end) if blocks[c - 1].cut_legal]
    edges = [start, *cuts, end]
    return list(zip(edges, edges[1:]))


class RegionBytes(NamedTuple):
    """What a stage's memory model needs of each of its checkpoint regions (``checkpoint_units``' order)."""

    inputs: list[int]  # the region's input: the cut before it (0 for the model's first block)
    acts: list[int]  # its activations, less what the loss saves (``loss_held``)
    kept: list[int]  # what selective checkpointing keeps of them (``kept_bytes``)
    temps: list[int]  # its largest backward temporaries (``temp_bytes``)
    params: list[int]  # its parameter bytes (FSDP's unit, block by block)
    held: int  # what the stage's loss saves: outside every region, kept per microbatch in every mode
    grads: list[int]  # its gradients in the parameters' dtype (``unit_grad_bytes``: FSDP's unit, block by block)


def unit_grad_bytes(p_bytes: Any, n_params: Any) -> Any:
    """``max(P, 2 N)``: the bytes of one backward's gradients of parameters gathered in ``P`` bytes, in
    the parameters' compute dtype, never narrower than 16 bits: a float8 layer's weight gathered in a
    byte (torchao's float8 all-gather, ``levers.data_parallel.as_gathered``) gets bf16 gradients.
    Ints and integer arrays alike."""
    return p_bytes + (2 * n_params - p_bytes) * (p_bytes < 2 * n_params)


def region_bytes(blocks: Sequence[BlockCost], start: int, end: int) -> RegionBytes:
    """The ``RegionBytes`` of the stage ``blocks[start:end]``."""
    units = checkpoint_units(blocks, start, end)
    params = [sum(b.param_bytes for b in blocks[a:z]) for a, z in units]
    return RegionBytes(
        [blocks[a - 1].kept_cut_bytes if a > 0 else 0 for a, _ in units],
        [sum(b.activation_bytes - loss_held(b) for b in blocks[a:z]) for a, z in units],
        [sum(kept_bytes(b) for b in blocks[a:z]) for a, z in units],
        [max(temp_bytes(b) for b in blocks[a:z]) for a, z in units],
        params,
        sum(loss_held(b) for b in blocks[start:end]),
        [unit_grad_bytes(p, sum(b.params for b in blocks[a:z])) for p, (a, z) in zip(params, units, strict=True)],
    )


def rebuilt_bytes(regions: RegionBytes, mode: RecomputeMode) -> list[int]:
    """Per region, what backward holds while it rebuilds that region under ``mode`` ("full" or
    "selective"): its activations (less what selective kept) and its temporaries."""
    return [
        (max(a - k, 0) if mode == "selective" else a) + t
        for a, k, t in zip(regions.acts, regions.kept, regions.temps, strict=True)
    ]


def prefix_bytes(regions: RegionBytes, mode: RecomputeMode) -> list[tuple[int, int]]:
    """For k = 0 .. all of the stage's regions, its bytes per live microbatch and once (besides its
    output) when its first k regions recompute under ``mode`` ("full" or "selective") and the rest
    keep their activations.

    A recomputed region keeps its input (and, selectively, what the policy keeps) per live
    microbatch; the others keep their activations. Backward rebuilds one recomputed region at a
    time (its activations, less what it kept, and its temporaries); a region that keeps its
    activations needs only its temporaries then. Backward reaches the recomputed regions (the
    first k) only after the others, whose activations that microbatch has freed by then: the
    region being rebuilt is counted less those (measured on this machine: charging it on top
    over-predicted a 5-block stage with 2 recomputed by 12 MB, +7 to +11 %, docs/recompute.md).
    k = 0 is "never", all regions the plain mode.
    """
    n = len(regions.acts)
    rebuilt = rebuilt_bytes(regions, mode)
    per_region = [i + (k if mode == "selective" else 0) for i, k in zip(regions.inputs, regions.kept, strict=True)]
    tail_temp = [0] * (n + 1)  # max temporaries of regions k.. (0 past the last)
    tail_acts = [0] * (n + 1)  # activations of regions k..
    for k in reversed(range(n)):
        tail_temp[k] = max(tail_temp[k + 1], regions.temps[k])
        tail_acts[k] = tail_acts[k + 1] + regions.acts[k]
    saved, most = sum(regions.acts) + regions.held, 0
    out = [(saved, tail_temp[0])]
    for k in range(n):
        saved += per_region[k] - regions.acts[k]
        most = max(most, rebuilt[k])
        out.append((saved, max(most - tail_acts[k + 1], tail_temp[k + 1])))
    return out
