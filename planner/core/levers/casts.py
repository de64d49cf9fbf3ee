"""Autocast's weight copies: which stages share one set over a step, and which hold none.

Pure module: never imports torch. A bf16 (or fp16) plan trains fp32 weights under ``torch.autocast``;
each matmul saves a copy of its weight in that dtype for its backward (``BlockCost.weight_cast_bytes``,
part of ``activation_bytes``). Where the runner keeps one autocast cache through the step, a stage's
microbatches share one set (``shares_casts``, ``shared_casts``); an FSDP-sharded stage gathers its
weights in the plan's dtype already, so autocast copies nothing there (``without_casts``). The memory
model (``planner.core.split.stage_model``) and the solver count the copies through these.
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.schema.costs import BlockCost


def without_casts(blocks: Sequence[BlockCost]) -> list[BlockCost]:
    """The blocks as an FSDP-sharded stage runs them: no weight copies of autocast's.

    FSDP gathers the parameters in the plan's dtype (``MixedPrecisionPolicy``), so autocast finds
    them already in it and copies nothing; the copies leave ``activation_bytes`` (and
    ``weight_cast_bytes``). The same objects where there are none.

    Args:
        blocks: per-block costs.

    Returns:
        The blocks without copies.
    """
    return [
        b.model_copy(update={"activation_bytes": b.activation_bytes - b.weight_cast_bytes, "weight_cast_bytes": 0})
        if b.weight_cast_bytes
        else b
        for b in blocks
    ]


def compiled_casts(blocks: Sequence[BlockCost]) -> list[BlockCost]:
    """The blocks as a compiled stage holds autocast's copies of its weights: one per microbatch.

    The runner keeps one autocast cache through a step, so an eager stage with many microbatches
    live may share its copies (``BlockCost.weight_cast_bytes``, ``casts.shared_casts``); a
    compiled graph casts inside itself on every call and saves its copies with the microbatch's
    activations.

    Args:
        blocks: per-block costs.

    Returns:
        The blocks with no copies to share (the same objects where there are none).
    """
    return [b.model_copy(update={"weight_cast_bytes": 0}) if b.weight_cast_bytes else b for b in blocks]


SHARED_CASTS_FROM = 3
"""A stage with at least this many microbatches live shares autocast's weight copies among them
(``shares_casts``, ``shared_casts``; the runner: ``planner.run.wrappers.Autocast``)."""


def shares_casts(in_flight: int, sharded: bool = False, recompute: str = "never") -> bool:
    """Whether a stage's microbatches share one set of autocast's weight copies (``shared_casts``).

    Only where it pays and is safe: three or more microbatches live at its peak; nothing recomputed
    (a checkpointed region drops its copies with its activations, where the shared cache would keep
    them all step); not under FSDP, whose stages gather their weights in the plan's dtype, so that
    autocast copies nothing there (``without_casts``; and with fp32 weights gathered, FSDP would
    reduce-scatter a block's weight gradients as soon as its backward is done, before a shared
    copy's gradient reaches its weight: the losses parted from the unsplit model's at step 2).

    Args:
        in_flight: the stage's peak live microbatches (``StagePlan.in_flight``).
        sharded: FSDP or HSDP shards the stage (``Plan.sharded``).
        recompute: the stage's recompute value.

    Returns:
        True from ``SHARED_CASTS_FROM`` live on, for an unsharded stage that recomputes nothing.
    """
    return not sharded and recompute == "never" and in_flight >= SHARED_CASTS_FROM


def shared_casts(per_microbatch: int, once: int, cast: int, in_flight: int) -> tuple[int, int]:
    """A stage's bytes per live microbatch and once, its weight copies shared where it shares them.

    Each microbatch's forward runs in a fresh autocast region, its matmuls saving their own copies of
    the weights until its backward: ``cast`` of ``per_microbatch`` (and a recomputed region drops
    them with its other activations, so ``cast`` is 0 there). A stage with ``SHARED_CASTS_FROM`` or
    more live shares them instead: the runner keeps autocast's cast cache through the step
    (``planner.run.wrappers.weight_cast_cache``), so the copies are made once, at the step's first
    forward, and their autograd nodes are the oldest of every later microbatch's graph. torch's
    engine runs the ready node created last first, so each backward reaches them only at its very
    end, and every weight's gradient in the autocast dtype (a copy's size) waits until then: twice
    ``cast``, once (measured on CPU, docs/weight_casts.md). With two live either way holds two sets;
    with one, sharing would add the waiting gradients, so it is not done.

    Args:
        per_microbatch: the stage's bytes per live microbatch, its own copies included.
        once: its bytes once.
        cast: of ``per_microbatch``, the copies it may share (0: none, or it may not).
        in_flight: its peak live microbatches (decides whether it shares).

    Returns:
        (per live microbatch, once), as the run holds them (the solver's fit test mirrors this on
        arrays: ``planner.core.split.solve``).
    """
    if cast and shares_casts(in_flight):
        return per_microbatch - cast, once + 2 * cast
    return per_microbatch, once
