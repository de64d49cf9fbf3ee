"""Lower bounds on a layout's step time and per-rank memory, over every split: what the search prunes with.

Pure module: never imports torch. The joint search (``planner.core.layout.search``) evaluates layouts in
ascending order of ``step_floor`` and stops once the next floor is slower than the fastest layout
that fits; it skips, without solving, a layout whose ``memory_floor`` is over the limit. Both are
computed from the blocks' costs alone, in one pass, so tens of thousands of layouts cost nothing next
to one solve. ``tests/test_bounds.py`` checks on random problems that neither exceeds what the solver
and the simulator then find, for the solver's split and for random splits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from planner.core.layout.inputs import Layout
from planner.core.step.schedules import ZERO_BUBBLE
from planner.schema.costs import BlockCost, OptimizerSpec


def step_floor(blocks: Sequence[BlockCost], layout: Layout, optimizer: OptimizerSpec) -> float:
    """A lower bound of the layout's predicted step over every split.

    Each pass's makespan is at least the busiest pipeline rank's compute, itself at least the mean
    of every microbatch's forward and backward over the ranks (a two-part backward: the least of the
    whole and its two halves), and at least the chains through the stages (``pipeline_floor``,
    ``chain_floor``); after the passes the slowest rank steps its optimizer, at least the mean share
    of the parameters, a 1/dp share when FSDP may shard it (the passes' makespans and the optimizer
    step are parts of the step; messages, the rest of the bubble and the gradient reduction only add).

    Args:
        blocks: per-block costs at the layout's microbatch size.
        layout: the layout (its pipeline ranks and microbatches).
        optimizer: the optimizer (unused by the bound; kept so both floors take the same arguments).

    Returns:
        Seconds.
    """
    return floors(blocks, layout, optimizer)[0]


def memory_floor(blocks: Sequence[BlockCost], layout: Layout, optimizer: OptimizerSpec) -> int:
    """A lower bound of the memory the layout's busiest rank needs over every split.

    The busiest rank holds at least the mean of the weights, gradients and optimizer state (a 1/dp
    share under FSDP, which then also holds its stages' weights and gradients whole while the
    pipeline runs unless it shards block by block) and of the receive buffers (``floors``); the lower of DDP's and FSDP's when the
    mode is still open ("auto").

    Args:
        blocks: per-block costs at the layout's microbatch size.
        layout: the layout (pipeline ranks, replicas and their mode).
        optimizer: the optimizer (its state bytes).

    Returns:
        Bytes.
    """
    return floors(blocks, layout, optimizer)[1]


@dataclass(frozen=True)
class BlockTotals:
    """What ``floors`` sums over the blocks, which depends on them and on whether the schedule splits
    its backward only: the search computes it once per set of block costs, not once per layout.

    Attributes:
        compute: every block's forward and backward for one microbatch (a two-part backward: the least
            of the whole and its halves), seconds.
        backward: of ``compute``, the backwards.
        step: every block's optimizer step and gradient work, seconds.
        param_bytes: the blocks' parameter bytes.
        params: their parameter count.
        lead: the least share of a block's compute on the chain through the stages (``pipeline_floor``).
        least_cut: the smallest legal cut's bytes (None: no legal cut).
    """

    compute: float
    backward: float
    step: float
    param_bytes: int
    params: int
    lead: float
    least_cut: int | None


def block_totals(blocks: Sequence[BlockCost], split: bool) -> BlockTotals:
    """``BlockTotals`` of ``blocks`` for a schedule that splits its backward (``split``) or not.

    Args:
        blocks: per-block costs.
        split: whether the schedule runs the input and weight halves of the backward apart.

    Returns:
        The totals.
    """
    compute = 0.0
    backward = 0.0
    step = 0.0
    p_bytes = n_params = 0
    lead = 1.0  # the least share of a block's compute that lies on the chain before a stage (below)
    for b in blocks:
        bwd = b.bwd_s
        if split and b.bwd_input_s is not None and b.bwd_weight_s is not None:
            # a two-part backward runs its input and weight halves, which need not add up to the whole
            bwd = min(bwd, b.bwd_input_s + b.bwd_weight_s)
        compute += b.fwd_s + bwd
        backward += bwd
        if split and b.fwd_s + bwd > 0:
            lead = min(lead, b.fwd_s / (b.fwd_s + bwd))
        step += (b.opt_s or 0.0) + (b.grad_s or 0.0)
        p_bytes += b.param_bytes
        n_params += b.params
    cuts = [b.sent_bytes for b in blocks[:-1] if b.cut_legal]
    return BlockTotals(compute, backward, step, p_bytes, n_params, lead, min(cuts) if cuts else None)


def floors(
    blocks: Sequence[BlockCost], layout: Layout, optimizer: OptimizerSpec, totals: BlockTotals | None = None
) -> tuple[float, int]:
    """``step_floor`` and ``memory_floor`` in one pass over the blocks.

    Both count the receive buffers torch's ``PipelineStage`` allocates up front: each of the
    ``n_stages - 1`` stage boundaries holds ``m`` microbatches' cut bytes in each direction (the stage
    before it the gradients', the stage after it the activations'), at least the least legal cut's,
    so the ranks hold ``2 m (n_stages - 1)`` such cuts between them, the busiest at least the mean.
    With several passes (gradient accumulation) the step computes every pass's microbatches (``m x
    accumulation``); the memory is one pass's.

    Args:
        blocks: per-block costs at the layout's microbatch size.
        layout: the layout.
        optimizer: the optimizer (its state bytes).
        totals: ``block_totals(blocks, split)`` for the layout's schedule, where the caller keeps it
            (None: summed here).

    Returns:
        (the step floor in seconds, the memory floor in bytes).
    """
    pp, m, dp = layout.pp, layout.n_microbatches, layout.dp
    split = layout.schedule in ZERO_BUBBLE
    t = totals if totals is not None else block_totals(blocks, split)
    # what FSDP may shard the optimizer step over: the search plans split-backward schedules with DDP
    most = layout.dp_shard if layout.dp_mode == "hsdp" else dp  # the most replicas a stage is sharded over
    shard = most if dp > 1 and layout.dp_mode in ("fsdp", "hsdp", "auto") and not split else 1
    static = 2 * t.param_bytes + optimizer.state_bytes(t.params, t.param_bytes)
    least = t.least_cut
    buffers = 2 * m * (layout.n_stages - 1) * least if least is not None and layout.n_stages > 1 else 0
    ddp = (static + buffers) // pp
    # FSDP holds its stages' weights and gradients whole while the pipeline runs, or block by block
    # only a few units at a time (counted as none here)
    whole = 0 if layout.fsdp_units in ("block", "auto") else 2 * t.param_bytes
    fsdp = (static // max(1, most) + whole + buffers) // pp
    modes = {"ddp": ddp, "fsdp": fsdp, "hsdp": fsdp, "auto": min(ddp, fsdp)}
    memory = ddp if dp == 1 else modes.get(layout.dp_mode, ddp)
    # one pass's makespan is at least each of: the busiest rank's compute, the chain of the
    # stages (``pipeline_floor``), the chain around the stage with the most backward (``chain_floor``);
    # the step adds the passes, then the slowest rank's optimizer (at least the mean)
    one_pass = max(
        t.compute * m / pp,
        pipeline_floor(t.compute, m, layout.n_stages, t.lead),
        chain_floor(t.compute, t.backward, m, layout.n_stages, split),
    )
    return layout.accumulation * one_pass + t.step / shard / pp, memory


def pipeline_floor(compute: float, m: int, n_stages: int, lead: float = 1.0) -> float:
    """A lower bound of one pass's makespan over every split into ``n_stages`` stages, bubble included.

    Each stage runs its ``m`` forwards and backwards one at a time on its rank, after its first
    microbatch's forwards through every earlier stage and before its last backward's way back
    through them (a two-part backward's last action may be a weight half: its forward way only). With
    ``t`` a stage's compute per microbatch and ``T`` that of the stages before it, the makespan is at
    least ``lead T + m t`` for every stage, ``lead`` the least share of a block's compute on that way
    (1 with whole backwards, its forward share with split ones). The split that makes the largest of
    these least makes them all equal: ``t = (B - lead T) / m``, so the stages' compute sums to
    ``B (1 - (1 - lead/m)^n) / lead``; ``compute`` gives ``B``. One microbatch: its whole chain; many:
    towards ``m compute / n``, each stage's mean share.

    Args:
        compute: every block's forward and backward time for one microbatch (seconds).
        m: microbatches in the pass.
        n_stages: the pipeline's stages (ranks x stages per rank).
        lead: the least share of a block's compute that runs on the chain through the stages.

    Returns:
        Seconds (0 when ``lead`` is 0: nothing is known of the chain).
    """
    if lead <= 0 or m < 1 or n_stages < 1:
        return 0.0
    return lead * compute / (1 - (1 - lead / m) ** n_stages)


def chain_floor(compute: float, backward: float, m: int, n_stages: int, split: bool = False) -> float:
    """A lower bound of one pass's makespan over every split into ``n_stages`` stages: the chain
    around the stage with the most backward.

    Take any stage s, its backward ``b`` per microbatch. Its first backward waits for that
    microbatch's forward through every stage and its backward through the stages after s; from then
    on s runs all ``m`` of its backwards, one at a time; after its last one, that microbatch's
    backward still goes through the stages before s. So the makespan is at least ``F + B + (m - 1)
    b`` with ``F`` and ``B`` every block's forward and backward of one microbatch (``compute = F +
    B``), and the stage with the most backward has at least the mean, ``b >= B / n_stages``. With a
    two-part backward (zero-bubble schedules) only the input halves are on the chain and a stage's
    last action may be a weight half: at least ``F + m b``, with ``B`` the least of the whole and
    its halves. Messages, recomputation and other ranks' work only add. Tightest where microbatches
    are few for the stages: one microbatch is ``F + B``, the whole chain; with many, each stage's
    mean share bounds better (``floors`` takes the largest of the bounds).

    Args:
        compute: every block's forward and backward time for one microbatch (seconds).
        backward: of it, the backwards.
        m: microbatches in the pass.
        n_stages: the pipeline's stages (ranks x stages per rank).
        split: whether the schedule runs the backward in two parts.

    Returns:
        Seconds (0 without stages or microbatches).
    """
    if m < 1 or n_stages < 1:
        return 0.0
    forward, per_stage = compute - backward, backward / n_stages
    if split:
        return forward + m * per_stage
    return compute + (m - 1) * per_stage


__all__ = [
    "BlockTotals",
    "block_totals",
    "chain_floor",
    "floors",
    "memory_floor",
    "pipeline_floor",
    "step_floor",
]
