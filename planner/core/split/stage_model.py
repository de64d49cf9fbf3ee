"""The stage cost and memory model: what one stage of a split costs per microbatch and holds.

Pure module (no torch). A stage is a run ``blocks[start:end]`` of the blocks in execution order.
Its time per microbatch is its blocks' forward and backward, its recomputation, the cold starts of
the blocks that wait for a message, and one message per boundary per direction
(``stage_time_parts``, ``stage_costs``); its memory is weights, gradients, optimizer state, receive
buffers and the in-flight microbatches' activations (``stage_memory_bytes``). The exact solver
(``planner.core.split.solve``), the baselines (``planner.core.split.baselines``), the prediction
(``planner.core.step.predict``) and the search all cost stages here, so they agree to the last bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from pydantic import Field, field_validator

from planner.core.levers.casts import shared_casts
from planner.core.levers.links import Links, boundary_crosses, boundary_links, default_link, links_around
from planner.core.levers.recompute import (
    RegionBytes,
    loss_temps,
    prefix_bytes,
    rebuilt_bytes,
    recompute_mode,
    region_bytes,
    rerun_s,
    unit_grad_bytes,
    with_loss,
)
from planner.core.split.cuts import Split
from planner.core.step.schedules import in_flight_per_stage
from planner.errors import InfeasibleError
from planner.schema.costs import BlockCost, LinkCost, OptimizerSpec, RecomputeMode, split_recompute

DEFAULT_OPTIMIZER = OptimizerSpec()  # frozen, so one shared default is safe


class Partition(Split):
    """A split with its bottleneck: what the solver and ``evaluate`` return."""

    bottleneck_s: float = Field(
        description="Max over stages of the stage cost (``stage_costs``), seconds per microbatch."
    )

    @field_validator("starts")
    @classmethod
    def _check_starts(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if not v or v[0] != 0 or any(b <= a for a, b in zip(v, v[1:])):
            raise ValueError(f"starts={v} is invalid; expected starts[0] == 0 and strictly increasing.")
        return v


def boundary_message_s(block: BlockCost, link: LinkCost) -> float:
    """Seconds of one direction's message over ``link`` at the boundary after ``block``: the piece a
    rank sends (``sent_bytes``) plus half the tensor-parallel all-gather of a scattered boundary (one
    all-gather each way; like every message, charged half to each direction)."""
    return link.send_s(block.sent_bytes) + block.cut_gather_s / 2


def _boundary_send_s(
    blocks: Sequence[BlockCost],
    start: int,
    end: int,
    link: LinkCost,
    link_out: LinkCost | None = None,
    *,
    cross_in: bool = True,
    cross_out: bool = True,
) -> float:
    """Seconds a stage [start, end) spends on the messages of one microbatch in one direction.

    The boundary after block ``c - 1`` carries ``blocks[c - 1].sent_bytes`` per microbatch forward
    (activation) and the same size backward (its gradient); a rank receives at its start boundary
    (unless first, over ``link``) and sends at its end boundary (unless last, over ``link_out``,
    by default ``link``); a boundary inside one rank (``cross_in`` / ``cross_out`` False) sends nothing.
    Scattered over tensor-parallel ranks, a boundary also costs an all-gather (``cut_gather_s``) once
    each way: the stage's forward gathers its input, its backward its output's gradient. Like every
    message it is charged half to each direction (the forward and the backward's sums are what count).
    """
    s = 0.0
    if start > 0 and cross_in:
        s += boundary_message_s(blocks[start - 1], link)
    if end < len(blocks) and cross_out:
        s += boundary_message_s(blocks[end - 1], link_out or link)
    return s


def stage_time_parts(
    blocks: Sequence[BlockCost],
    start: int,
    end: int,
    link: LinkCost,
    recompute: bool | str = False,
    link_out: LinkCost | None = None,
    *,
    wait_in: bool = True,
    wait_out: bool = True,
) -> tuple[float, float, float]:
    """Forward, backward and per-direction message seconds of the stage ``blocks[start:end]``, per microbatch.

    The message time is paid once in forward (activations) and once in backward (their gradients,
    the same sizes). Activation checkpointing re-runs each block's forward inside its backward
    (Chen et al. 2016), so a recomputing stage's backward includes ``rerun_s``. A stage that
    waits for its activations starts its forward cold, and one that waits for their gradient its
    backward: ``cold_in`` and ``cold_out`` are added.

    Args:
        blocks: per-block costs in execution order.
        start: first block of the stage.
        end: one past its last block.
        link: cost of one message over the stage's start boundary (and its end one, unless ``link_out``).
        recompute: the stage's recompute mode ("never", "selective", "full", "stage"; True: "stage").
        link_out: cost of one message over its end boundary (None: ``link``).
        wait_in: the stage receives its activations from another rank (False: the stage before
            runs on the same rank, the turn of a V: nothing is sent or waited for).
        wait_out: the same for the gradients it receives from the stage after it.

    Returns:
        ``(fwd_s, bwd_s, comm_s)``, ``comm_s`` for one direction.
    """
    part = blocks[start:end]
    fwd = sum(b.fwd_s for b in part) + (cold_in(blocks, start) if wait_in else 0.0)
    mode = recompute_mode(recompute)
    bwd = sum(b.bwd_s for b in part) + rerun_s(part, mode)
    bwd += cold_out(blocks, end) if wait_out else 0.0
    return fwd, bwd, _boundary_send_s(blocks, start, end, link, link_out, cross_in=wait_in, cross_out=wait_out)


def cold_in(blocks: Sequence[BlockCost], start: int) -> float:
    """Seconds the stage starting at block ``start`` loses to a cold start of its forward: its first
    block's ``fwd_cold_s`` after waiting for the activations it receives (none for the first stage,
    which waits for nothing; 0 when not measured)."""
    return (blocks[start].fwd_cold_s or 0.0) if start > 0 else 0.0


def cold_out(blocks: Sequence[BlockCost], end: int) -> float:
    """Seconds the stage ending before block ``end`` loses to a cold start of its backward: its last
    block's ``bwd_cold_s`` after waiting for the gradient it receives (none for the last stage,
    whose backward follows its own forward and loss; 0 when not measured)."""
    return (blocks[end - 1].bwd_cold_s or 0.0) if end < len(blocks) else 0.0


def stage_bounds(starts: Sequence[int], n: int) -> list[tuple[int, int]]:
    ends = list(starts[1:]) + [n]
    return list(zip(starts, ends))


def check_starts(blocks: Sequence[BlockCost], starts: Sequence[int]) -> None:
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
    blocks: Sequence[BlockCost],
    split: Split,
    link: Links,
    schedule: str | None = None,
    stages_per_rank: int | None = None,
) -> list[float]:
    """Seconds one microbatch occupies each stage: forward + backward + its messages both ways.

    The largest one bounds the pipeline's throughput (Narayanan et al. 2021, Eq. 1).

    Args:
        blocks: per-block costs in execution order.
        split: each stage's first block and recompute mode.
        link: cost of one message between neighbouring ranks, or per boundary (``boundary_links``).
        schedule: places the stages on ranks: which boundaries cross ranks (``boundary_crosses``)
            and where a ``NodeLinks``' stages run (None: one rank per stage, looped placement).
        stages_per_rank: stages on each rank (None: ``boundary_crosses``' default).

    Returns:
        One cost per stage.

    Raises:
        InfeasibleError: ``split`` is not a valid partition on legal cuts.
    """
    starts = split.starts
    check_starts(blocks, starts)
    flags = split.flags
    links = boundary_links(link, len(starts), schedule)
    crosses = [True, *boundary_crosses(len(starts), schedule, stages_per_rank), True]  # padded: first and last
    costs = []
    for k, ((s, e), r) in enumerate(zip(stage_bounds(starts, len(blocks)), flags)):
        into, out = links_around(links, k, default_link(link))
        fwd, bwd, comm = stage_time_parts(blocks, s, e, into, r, out, wait_in=crosses[k], wait_out=crosses[k + 1])
        costs.append(fwd + bwd + comm + comm)
    return costs


def stage_memory_bytes(
    blocks: Sequence[BlockCost],
    start: int,
    end: int,
    in_flight: int,
    optimizer: OptimizerSpec,
    recompute: bool | str = False,
    n_microbatches: int = 1,
    shard: int = 1,
) -> int:
    """Peak memory of the stage holding ``blocks[start:end]``.

    Formula (bytes)::

        static   = 2 * P + optimizer.state_bytes(N, P)      # weights + grads, optimizer state
        buffers  = m * (cut_in + cut_out)                   # receive buffers, one per microbatch each way
        pipeline = in_flight * (A + out) + out + B          # saved activations and the cached stage
                                                            # output per live microbatch, + its gradient
                                                            # and one backward's temporaries
        step     = T                                        # optimizer temporaries (after backward)
        peak     = static + buffers + max(pipeline, step)

    with ``P`` = sum of ``param_bytes``, ``N`` = sum of ``params``, ``A`` = sum of
    ``activation_bytes`` (with autocast's lower-precision copies of the weights the matmuls save, a
    set per live microbatch; a stage that recomputes nothing, is not sharded and holds three or more
    microbatches shares one set instead: ``shared_casts``), ``cut_in`` = ``blocks[start - 1].sent_bytes`` (0 for the first stage),
    ``cut_out`` = ``blocks[end - 1].sent_bytes`` (0 for the last stage; under tensor parallelism
    both are one rank's piece of the scattered boundary, ``BlockCost.cut_share``), ``out`` = the stage's output
    per microbatch (``cut_out``; the model output ``output_bytes`` for the last stage), which
    torch's ``PipelineStage`` keeps until that microbatch's backward (and the size of its gradient),
    ``B`` the most temporaries any of the stage's blocks' backward holds besides (``bwd_temp_bytes``,
    planner.costs.backward_temps; unknown: 0), ``m`` = ``n_microbatches``
    (``PipelineStage`` allocates its receive buffers per microbatch, up front). ``in_flight`` is the
    stage's peak number of microbatches with forward done and backward pending under the schedule
    (``planner.core.step.schedules.peak_in_flight``). Each term was checked against MemTracker's categories
    on CPU runs (docs/predict_vs_measured.md). ``T``, the step's temporaries, is measured when every
    block of the stage has ``opt_temp_bytes``: their maximum or their sum, by
    ``optimizer.step_temp_rule`` (a per-tensor optimizer holds one tensor's temporaries at a time, a
    foreach one all of them); else ``optimizer.step_temp_bytes(N)``. On the last stage, where the
    loss's backward temporaries ``L`` were measured (``loss_temp_bytes``), ``out + B`` (and the
    rebuilt region below) becomes ``max(L, out + B - H)``: the loss's backward comes first and makes
    the output's gradient, and by the blocks' backward it has freed what it saved (``H``, ``loss_held``).

    With ``recompute`` each checkpoint region of the stage (``checkpoint_units``: one per block)
    keeps only its input per live microbatch, and backward rebuilds one region's activations at a
    time (Chen et al. 2016; what torchtitan's and Megatron's per-layer checkpointing do). Full
    checkpointing: ``in_flight * A`` becomes ``in_flight * U + max_u A_u``, with ``U`` the bytes of
    the regions' inputs (``cut_in`` and the cut before every later region; on the last stage also
    what the loss saves, ``loss_held``: it runs outside the regions) and ``A_u`` a region's
    activations (without the loss's) plus its backward's temporaries (``B_u``, rebuilt and backward
    coincide; ``B`` then counts only inside them). Selective checkpointing keeps, besides, the outputs of the regions' matmuls and
    attention (``K``, the blocks' ``selective_bytes``) and rebuilds the rest:
    ``in_flight * (U + K) + max_u (max(A_u - K_u, 0) + B_u)``. The whole stage as one region ("stage"):
    ``in_flight * cut_in + A + B`` (the loss's bytes kept per microbatch, as above; ``cut_in`` whole
    here, as the region keeps the gathered input, and in the regions' inputs ``U``).

    Sharded over ``shard`` > 1 data-parallel replicas (FSDP2 ``fully_shard`` of the stage with
    ``reshard_after_forward=False``), each rank keeps a 1/shard share of the weights, gradients,
    optimizer state and step temporaries, and holds the whole stage's parameters and their
    gradients unsharded while the pipeline runs (gathered at the first forward, reduce-scattered
    and freed after the last backward, before the optimizer step)::

        static   = ceil((2 * P' + optimizer.state_bytes(N', P')) / shard)
        pipeline = in_flight * (A + out) + out + B + 2 * P  # + the unsharded parameters and gradients
        step     = ceil(T / shard)

    where ``P'`` and ``N'`` are what FSDP shards (``BlockCost.fsdp_sharded``): ``P`` and ``N``, but
    under expert parallelism with the experts counted whole (a rank gathers its ``1 / ep`` of them,
    sharded over the ``dp / ep`` replicas holding the same ones: a ``1 / dp`` share of every expert).

    In a bf16 (or fp16) plan FSDP gathers the parameters in that dtype and accumulates and reduces
    the gradients in fp32 (``planner.run.wrappers.fsdp_policy``): the unsharded bytes are ``2 P + 4 N``
    (``unsharded_bytes``), and ``A`` holds no weight copies of autocast's (the gathered weights are
    already in its dtype: ``planner.core.levers.casts.without_casts``, applied to the blocks of a sharded
    layout).

    Sharded block by block (``stage_memory_parts`` with ``per_block``: every checkpoint unit its own ``fully_shard`` unit,
    resharded after its forward and after its backward, its gradients reduce-scattered as soon as they
    are computed, as torchtitan shards a model's layers), a rank holds only a few units unsharded at a
    time instead of ``2 * P``: the unit being computed and the next one, prefetched (parameters), and
    the unit's gradients until they are reduce-scattered (``G_u``, ``unit_grad_bytes``: ``P_u`` but for
    float8 weights gathered in a byte, whose gradients are bf16)::

        pipeline = in_flight * (A + out) + out + B + 2 * max_u P_u + max_u G_u

    DDP replicas (``shard`` 1) hold the whole stage, as one pipeline does: its gradient buckets are
    views of the gradients (``gradient_as_bucket_view=True``), no second copy.

    This formula keeps the gradients for the whole step. Where they are freed between steps
    (``Layout.fresh_grads``) they exist only from the stage's first backward on, so a stage whose every
    microbatch is live at once (all forwards first, as under GPipe) peaks lower, and an FSDP stage
    unit's sharded share only from its last backward, so it never sits beside the activations:
    ``MemoryParts.peak(in_flight, fresh_grads=True)``.

    Args:
        blocks: per-block costs in execution order.
        start: first block of the stage.
        end: one past the stage's last block.
        in_flight: peak live microbatches on this stage.
        optimizer: the optimizer (decides the state bytes per parameter byte).
        recompute: the stage's recompute mode ("never", "selective", "full", "stage"; True: "stage").
        n_microbatches: microbatches per step (receive buffers are per microbatch).
        shard: FSDP replicas the stage's state is sharded over (1: not sharded, DDP or one replica).

    Returns:
        The stage's memory estimate in bytes.

    Raises:
        InfeasibleError: an empty or out-of-range block range.
    """
    return stage_memory_parts(blocks, start, end, optimizer, recompute, n_microbatches, shard).peak(in_flight)


class MemoryParts(NamedTuple):
    """A stage's memory as the terms of ``stage_memory_bytes``, so that a rank running several stages
    can add them up (``planner.core.split.stage_plans.rank_memory_bytes``).

    At ``t`` live microbatches the stage holds ``fixed + max(t * per_microbatch + once, step)``, less
    its gradients while it has run no backward yet and a stage unit's sharded share until its last
    backward has run (``peak``).
    """

    fixed: int  # static + buffers: weights, gradients, optimizer state (sharded: a share), receive buffers
    per_microbatch: int  # per live microbatch: saved activations (the regions' inputs when recomputing) + cached output
    once: int  # the output's gradient (+ the one region's activations a recomputing stage rebuilds;
    # + the unsharded parameters and gradients of a sharded stage)
    step: int  # optimizer temporaries (after backward)
    grads: int = 0  # of fixed + once, the gradients (the share, and a sharded stage's unsharded ones)
    microbatches: int = 0  # microbatches per step: with as many live, every forward came before a backward
    cast: int = 0  # of per_microbatch, autocast's weight copies a stage may share (``shared_casts``); 0: it may not
    reduced: int = 0  # of grads, a stage unit's sharded gradients: made by the reduce-scatter after its last backward
    kept: int = 0  # of per_microbatch, the activations the stage keeps under its recompute mode (less its output)
    # of once, what exists only while the stage runs a backward (its output's gradient, the region it
    # rebuilds, the backward's temporaries, the loss's): a rank runs one backward at a time
    transient: int = 0

    def peak(self, in_flight: int, fresh_grads: bool = False) -> int:
        """The stage's peak bytes with ``in_flight`` live microbatches.

        With ``fresh_grads`` (the gradients are freed between steps: ``Layout.fresh_grads``) the
        gradients count from the stage's first backward on, which frees a microbatch's activations:
        with every microbatch live at once (``in_flight >= microbatches``: all forwards come before
        the first backward, as under GPipe) they come with one fewer. Of them, the ``reduced`` share
        (an FSDP stage unit's sharded gradients) is made only by the reduce-scatter after the last
        backward, when no activation is left: the unsharded gradients it is reduced from, held in
        ``once``, still exist then (``once + grads``).
        """
        x, y = shared_casts(self.per_microbatch, self.once, self.cast, in_flight)
        if not fresh_grads:
            return self.fixed + max(in_flight * x + y, self.step)
        r = self.reduced
        if in_flight >= self.microbatches:
            g = self.grads
            return self.fixed - g + max(in_flight * x + y, (in_flight - 1) * x + y + g - r, y + g, self.step + g)
        return self.fixed - r + max(in_flight * x + y, y + r, self.step + r)


def stage_memory_parts(
    blocks: Sequence[BlockCost],
    start: int,
    end: int,
    optimizer: OptimizerSpec,
    recompute: bool | str = False,
    n_microbatches: int = 1,
    shard: int = 1,
    per_block: bool = False,
) -> MemoryParts:
    """The terms of ``stage_memory_bytes`` for the stage ``blocks[start:end]`` (see there); with
    ``per_block`` (and ``shard`` > 1) FSDP shards it block by block.

    Raises:
        InfeasibleError: an empty or out-of-range block range, or no such recompute value.
    """
    sums, regions = _stage_sums(blocks, start, end, optimizer)
    mode, count = split_recompute(recompute_mode(recompute))
    if count is None or count >= len(regions.acts):
        return parts_from_sums(sums, optimizer, mode, n_microbatches, shard, per_block)
    return parts_from_sums(sums, optimizer, mode, n_microbatches, shard, per_block, prefix_bytes(regions, mode)[count])


def prefix_memory_parts(
    blocks: Sequence[BlockCost],
    start: int,
    end: int,
    optimizer: OptimizerSpec,
    mode: RecomputeMode,
    n_microbatches: int = 1,
    shard: int = 1,
    per_block: bool = False,
) -> list[MemoryParts]:
    """``stage_memory_parts`` of the stage under "mode:k" for every k from 0 (never) to all of its
    checkpoint regions (the plain ``mode``), in one pass over its regions.

    Args:
        blocks: per-block costs in execution order.
        start: first block of the stage.
        end: one past its last block.
        optimizer: the optimizer (state and step temporaries).
        mode: "full" or "selective".
        n_microbatches: microbatches per step (receive buffers).
        shard: FSDP replicas the state is sharded over (1: none).
        per_block: FSDP shards the stage block by block.

    Returns:
        One ``MemoryParts`` per k.

    Raises:
        InfeasibleError: an empty or out-of-range block range.
    """
    sums, regions = _stage_sums(blocks, start, end, optimizer)
    return [
        parts_from_sums(sums, optimizer, mode, n_microbatches, shard, per_block, held, keeps_all=k == 0)
        for k, held in enumerate(prefix_bytes(regions, mode))
    ]


def _stage_sums(
    blocks: Sequence[BlockCost], start: int, end: int, optimizer: OptimizerSpec
) -> tuple[StageSums, RegionBytes]:
    """The stage's sums and its regions' bytes (``stage_memory_parts``)."""
    n = len(blocks)
    if not 0 <= start < end <= n:
        raise InfeasibleError(
            f"block range [{start}, {end}) is invalid for {n} blocks; expected 0 <= start < end <= {n}."
        )
    part = blocks[start:end]
    p_bytes = sum(b.param_bytes for b in part)
    n_params = sum(b.params for b in part)
    a_bytes = sum(b.activation_bytes for b in part)
    cut_in = blocks[start - 1].sent_bytes if start > 0 else 0
    cut_out = blocks[end - 1].sent_bytes if end < n else 0
    out = cut_out if end < n else blocks[-1].output_bytes
    temps = [b.opt_temp_bytes for b in part]
    step_temp = optimizer.combine_step_temps([t for t in temps if t is not None]) if None not in temps else None
    regions = region_bytes(blocks, start, end)
    held = regions.held
    most = max(rebuilt_bytes(regions, "full"))
    most_rebuilt = max(rebuilt_bytes(regions, "selective"))
    tops = max(regions.params), max(regions.grads), max(regions.temps)  # FSDP's largest unit, the largest temporaries
    summed = Regions(sum(regions.inputs) + held, most, sum(regions.kept), most_rebuilt, held, *tops)
    kept_in = blocks[start - 1].kept_cut_bytes if start > 0 else 0
    cast = sum(b.weight_cast_bytes for b in part)
    fsdp = None
    if any(b.fsdp_params is not None for b in part):
        sharded = [b.fsdp_sharded() for b in part]
        fsdp = (sum(nbytes for _, nbytes in sharded), sum(params for params, _ in sharded))
    sums = StageSums(
        p_bytes,
        n_params,
        a_bytes,
        cut_in,
        cut_out,
        kept_in,
        out,
        step_temp,
        summed,
        loss_temps(blocks, end),
        cast,
        fsdp,
    )
    return sums, regions


def ceil_div(x: Any, d: int) -> Any:
    """``ceil(x / d)`` in integers, for Python ints and integer numpy arrays alike (FSDP pads every
    parameter to a multiple of the shard count, so a share is rounded up)."""
    return -((-x) // d)


class StageSums(NamedTuple):
    """What the memory formula needs of a stage's blocks, summed (``stage_memory_bytes``' symbols)."""

    p_bytes: int  # P: parameter bytes
    n_params: int  # N: parameters
    a_bytes: int  # A: activation bytes saved per microbatch
    cut_in: int  # bytes received per microbatch (0 for the first stage): one tensor-parallel rank's piece
    cut_out: int  # bytes sent per microbatch (0 for the last stage), the same
    kept_in: int  # the whole input, gathered over tensor-parallel ranks (0 for the first stage)
    out: int  # the stage's output per microbatch (the model's output for the last stage)
    step_temp: int | None  # T when measured for every block (None: ``optimizer.step_temp_bytes``)
    regions: Regions | None = None  # its checkpoint regions (None: one region, the whole stage)
    loss_temp: int | None = None  # the loss's backward temporaries (``loss_temps``: the last stage's), first
    cast: int = 0  # C: of A, autocast's copies of the weights (``weight_cast_bytes``)
    fsdp: tuple[int, int] | None = None  # (P, N) of what FSDP shards where not P and N (``BlockCost.fsdp_sharded``)


class Regions(NamedTuple):
    """What checkpointing keeps and rebuilds of a stage's regions (``checkpoint_units``)."""

    inputs: int  # U: bytes of every region's input (the stage's ``cut_in`` for the first), + the loss's
    most: int  # max over regions of their activations (rebuilt one region at a time, full) + their temporaries
    kept: int  # K: bytes selective checkpointing keeps (the matmul and attention outputs)
    most_rebuilt: int  # max over regions of activations minus kept, at least 0 (selective), + their temporaries
    held: int = 0  # what the last stage's loss saves (outside every region; in ``inputs`` too)
    most_params: int = 0  # max over regions of their parameter bytes (FSDP's units, per block)
    most_grads: int = 0  # max over regions of their gradients' bytes (``unit_grad_bytes``)
    temp: int = 0  # max over the stage's blocks of their backward's temporaries (``temp_bytes``)


def _recomputed(sums: StageSums, mode: RecomputeMode) -> tuple[int, int]:
    """A stage's bytes per live microbatch and once, besides its output, under ``mode`` (on all of
    its regions)."""
    regions = sums.regions or Regions(sums.cut_in, sums.a_bytes, 0, sums.a_bytes)
    if mode == "full":
        return regions.inputs, regions.most
    if mode == "selective":
        return regions.inputs + regions.kept, regions.most_rebuilt
    if mode == "stage":  # one region: its input (and the loss's) kept, all the rest rebuilt at once
        return sums.kept_in + regions.held, sums.a_bytes - regions.held + regions.temp
    return sums.a_bytes, regions.temp


def fp32_bytes(p_bytes: Any, n_params: Any) -> Any:
    """``max(P, 4 N)``: the bytes of the parameters in fp32 where they are narrower (their master
    copy, their gradients as FSDP accumulates and reduces them), else their own. Ints and arrays."""
    return p_bytes + (4 * n_params - p_bytes) * (p_bytes < 4 * n_params)


def unsharded_bytes(p_bytes: Any, n_params: Any, most_params: Any, most_grads: Any, per_block: bool) -> Any:
    """What an FSDP rank holds unsharded while its stage runs (``stage_memory_bytes``; ints and
    integer arrays alike).

    In a narrower dtype than fp32 the runner gathers the parameters in that dtype and reduces the
    gradients in fp32 (FSDP2's ``MixedPrecisionPolicy(param_dtype, reduce_dtype=float32)``,
    ``planner.run.wrappers.fsdp_policy``). Per stage: its parameters ``P``, its gradients accumulated
    over the microbatches in fp32 (``max(P, 4 N)``) and, while a backward runs, that microbatch's
    gradients in the parameters' dtype before FSDP adds them in (none in fp32, where autograd
    accumulates in place; ``unit_grad_bytes``: bf16 for float8 layers' weights gathered in a byte):
    ``2 P + 4 N`` narrower, ``2 P`` in fp32. Block by block: the unit computing and the next one
    prefetched, and the largest unit's gradients (``most_grads``), ``3 P_u`` in bf16 (the fp32 copy FSDP
    reduce-scatters them from is made after the unit's backward has freed its activations: measured
    on CPU, counting it over-predicted every block-unit case, docs/fsdp_units.md)."""
    if per_block:
        return 2 * most_params + most_grads
    wide = fp32_bytes(p_bytes, n_params)
    return p_bytes + unit_grad_bytes(p_bytes, n_params) + wide * (p_bytes < wide)


def grad_bytes(
    p_bytes: Any,
    n_params: Any,
    most: tuple[Any, Any],
    shard: int,
    per_block: bool,
    sharded: tuple[Any, Any] | None = None,
) -> Any:
    """Of a stage's bytes, its gradients (``MemoryParts.grads``): fp32 where the parameters are
    narrower (their fp32 master copy is what trains: the runner keeps fp32 weights and gradients
    under autocast, the same 16 bytes a parameter with AdamW), else the parameters' bytes; sharded, a
    share of those plus the unsharded ones held while the stage runs (``unsharded_bytes`` less the
    parameters). ``most``: the largest unit's parameter and gradient bytes (``Regions.most_params``,
    ``most_grads``). ``sharded``: the (bytes, parameters) whose share a rank keeps, where they differ
    from those it gathers (expert parallelism: ``BlockCost.fsdp_sharded``). Ints and integer arrays alike."""
    if shard > 1:
        held = 2 * most[0] if per_block else p_bytes
        whole = fp32_bytes(*(sharded or (p_bytes, n_params)))
        return ceil_div(whole, shard) + unsharded_bytes(p_bytes, n_params, *most, per_block) - held
    return fp32_bytes(p_bytes, n_params)


def reduced_bytes(p_bytes: Any, n_params: Any, shard: int, per_block: bool) -> Any:
    """Of a sharded stage's gradients (``grad_bytes``), the share a stage unit's reduce-scatter makes
    after its last backward (``MemoryParts.reduced``): ``max(P, 4 N) / shard`` of what FSDP shards
    (pass ``BlockCost.fsdp_sharded``'s sums); 0 block by block, where each unit's share is made
    during the backward, or unsharded. Ints and integer arrays alike."""
    if shard <= 1 or per_block:
        return 0 * p_bytes
    return ceil_div(fp32_bytes(p_bytes, n_params), shard)


def parts_from_sums(
    sums: StageSums,
    optimizer: OptimizerSpec,
    recompute: bool | str,
    n_microbatches: int,
    shard: int = 1,
    per_block: bool = False,
    recomputed: tuple[int, int] | None = None,
    keeps_all: bool = False,
) -> MemoryParts:
    """The formula of ``stage_memory_bytes`` on a stage's sums (shared with the solver's fast memory
    model); ``recomputed``: the bytes per live microbatch and once, besides the output, when only
    some regions recompute (``stage_memory_parts`` counts them region by region), else those of
    ``recompute`` on every region; ``keeps_all``: with ``recomputed``, no region recomputes (the
    stage may then share its weight copies, ``shared_casts``, as with "never").

    Raises:
        InfeasibleError: "mode:k" without ``recomputed`` (the sums do not tell which regions).
    """
    p_bytes, n_params, _, cut_in, cut_out, _, out, step_temp, regions, loss_temp, cast = sums[:11]
    step = optimizer.step_temp_bytes(n_params) if step_temp is None else step_temp
    if recomputed is None:
        mode, count = split_recompute(recompute_mode(recompute))
        if count is not None:
            raise InfeasibleError(f"recompute={recompute!r} needs the stage's regions: use stage_memory_parts")
        recomputed = _recomputed(sums, mode)
        keeps_all = mode == "never"
    saved, rebuilt = recomputed
    backward = with_loss(-1 if loss_temp is None else loss_temp, regions.held if regions else 0, out + rebuilt)
    if shard > 1:
        most: tuple[int, int] = (
            (regions.most_params, regions.most_grads) if regions else (p_bytes, unit_grad_bytes(p_bytes, n_params))
        )
        # what FSDP shards may be more than what the rank gathers (expert parallelism: StageSums.fsdp)
        sp, sn = sums.fsdp or (p_bytes, n_params)
        if step_temp is None:
            step = optimizer.step_temp_bytes(sn)
        return MemoryParts(
            fixed=ceil_div(2 * sp + optimizer.state_bytes(sn, sp), shard) + n_microbatches * (cut_in + cut_out),
            per_microbatch=saved + out,
            once=backward + unsharded_bytes(p_bytes, n_params, most[0], most[1], per_block),
            step=ceil_div(step, shard),
            grads=grad_bytes(p_bytes, n_params, most, shard, per_block, (sp, sn)),
            microbatches=n_microbatches,
            reduced=reduced_bytes(sp, sn, shard, per_block),
            kept=saved,
            transient=backward,
        )  # FSDP holds no copies (casts.without_casts)
    return MemoryParts(
        fixed=2 * p_bytes + optimizer.state_bytes(n_params, p_bytes) + n_microbatches * (cut_in + cut_out),
        per_microbatch=saved + out,
        once=backward,
        step=step,
        grads=grad_bytes(p_bytes, n_params, (0, 0), 1, False),
        microbatches=n_microbatches,
        cast=cast if keeps_all else 0,
        kept=saved,
        transient=backward,
    )


def stage_memories(
    blocks: Sequence[BlockCost],
    split: Split,
    *,
    schedule: str,
    n_microbatches: int,
    optimizer: OptimizerSpec = DEFAULT_OPTIMIZER,
    fresh_grads: bool = True,
) -> list[int]:
    """Memory estimate of every stage of a partition (see ``stage_memory_bytes``) of one pipeline, whose
    gradients are freed between steps unless ``fresh_grads`` is False (``MemoryParts.peak``).

    Args:
        blocks: per-block costs in execution order.
        split: each stage's first block and recompute mode.
        schedule: one of ``planner.core.step.schedules.SCHEDULES`` with one stage per rank (its in-flight counts).
        n_microbatches: microbatches per step.
        optimizer: the optimizer.
        fresh_grads: the gradients are freed between steps (False: kept, as DDP's buckets keep them).

    Returns:
        Bytes per stage.

    Raises:
        InfeasibleError: an invalid split or schedule request.
    """
    starts = split.starts
    check_starts(blocks, starts)
    infl = in_flight_per_stage(schedule, len(starts), n_microbatches)
    flags = split.flags
    return [
        stage_memory_parts(blocks, s, e, optimizer, flags[k], n_microbatches).peak(infl[k], fresh_grads)
        for k, (s, e) in enumerate(stage_bounds(starts, len(blocks)))
    ]


def evaluate(
    blocks: Sequence[BlockCost],
    split: Split,
    link: Links,
    schedule: str | None = None,
    stages_per_rank: int | None = None,
) -> Partition:
    """The bottleneck of a given split (max of ``stage_costs``).

    Args:
        blocks: per-block costs in execution order.
        split: each stage's first block and recompute mode.
        link: cost of one message between neighbouring ranks, or per boundary.
        schedule: places the stages on ranks (``stage_costs``; None: one rank per stage).
        stages_per_rank: stages on each rank (None: ``boundary_crosses``' default).

    Returns:
        The partition with its ``bottleneck_s`` (max stage cost, communication included).

    Raises:
        InfeasibleError: ``split`` is not a valid partition on legal cuts.
    """
    costs = stage_costs(blocks, split, link, schedule, stages_per_rank)
    return Partition(starts=split.starts, bottleneck_s=max(costs), recompute=split.recompute)
