"""Lower bounds on a layout's step time and per-rank memory, over every split: what the search prunes with.

Pure module: never imports torch. The joint search (``planner.core.layout.search``) evaluates layouts in
ascending order of ``step_floor`` and stops once the next floor is slower than the fastest layout
that fits; it skips, without solving, a layout whose ``memory_floor`` is over the limit. Both are
computed from the blocks' costs alone (the step's also from the memory limit and the recompute
policy: the recomputation fitting it forces, ``recompute_floor``; and under FSDP from the replicas'
links: block by block, the collectives the compute cannot hide; a stage per unit, the reduce-scatters
that hold the ranks once a pass, ``fsdp_traffic``), from sums taken
once per set of costs (``block_totals``, and the traffic once per replica layout), so tens of
thousands of layouts cost nothing next to one solve.
``tests/test_bounds.py`` checks on random problems that neither exceeds what the solver and the
simulator then find, for the solver's split and for random splits (the step's under a limit: for
those that fit it).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from planner.core.layout.fsdp_bounds import FsdpFloor, master_floor, unsharded_floor
from planner.core.layout.inputs import Layout
from planner.core.layout.stage_chain import StageChain
from planner.core.levers.data_parallel import as_gathered, ddp_follows
from planner.core.levers.recompute import kept_bytes, loss_held, recompute_cost, selective_cost
from planner.core.split.solve import policy_options
from planner.core.step.schedules import LIVE_CLOSED_FORMS, ZERO_BUBBLE, live_at_first_backward
from planner.errors import InfeasibleError
from planner.schema.costs import BlockCost, OptimizerSpec


def step_floor(blocks: Sequence[BlockCost], layout: Layout, optimizer: OptimizerSpec) -> float:
    """A lower bound of the layout's predicted step over every split.

    Each pass's makespan is at least the busiest pipeline rank's compute, itself at least the mean
    of every microbatch's forward and backward over the ranks (a two-part backward: the least of the
    whole and its two halves) with the chains before and after each rank's own work (``ends_floor``)
    and at least what whole blocks force on some rank (``busiest_load``),
    and at least the chains through the stages (``pipeline_floor``,
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


Frees = tuple[tuple[float, ...], tuple[float, ...]]
"""Prefix sums, from 0, of the bytes items free and of what freeing them costs, cheapest per byte first."""


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
        loads: prefix sums of the blocks' compute sorted largest first (``busiest_load``), from 0.
        backwards: the same of their backwards.
        acts: the least bytes per live microbatch the blocks keep without recomputing (their
            activations less autocast's weight copies, which live microbatches may share).
        frees: what recomputing frees at least cost (``least_rerun``), under full checkpointing.
        frees_selective: the same where selective checkpointing is allowed too.
        fsdp: what FSDP shards, (bytes, parameters) (``BlockCost.fsdp_sharded``): ``param_bytes``
            and ``params``, but under expert parallelism with the experts counted whole; the bytes as
            FSDP gathers them (``gather_bytes`` a parameter: ``as_gathered``).
        ends: by pipeline ranks k, from 0, the least sum over ranks 0 .. k - 1 of the compute on the
            chain before and after each rank's own work (``ends_floor``).
        unsharded: what FSDP with a stage per unit holds unsharded while the pipeline runs, at least,
            summed over the stages of any split (``unsharded_floor``), the weights as gathered.
        master: the fp32 master copies the optimizer keeps of parameters narrower than fp32, at least,
            summed over the stages of any split (``master_floor``).
        fsdp_master: the same of what FSDP shards, as gathered.
        step_temps: the optimizer step's temporaries, at least, summed over the stages of any split
            (``step_temp_floor``): of every parameter a rank holds, and of what FSDP shards.
        gather_bytes: the gathered width ``fsdp``, ``unsharded`` and ``fsdp_master`` are for
            (``Layout.gather_bytes``).
        optimizer: the optimizer ``step_temps`` are for (None: not counted, 0).
        chain: the units (blocks between legal cuts) in order, for the chain through stages of
            whole units (``StageChain.floor``).
    """

    compute: float
    backward: float
    step: float
    param_bytes: int
    params: int
    lead: float
    least_cut: int | None
    loads: tuple[float, ...]
    backwards: tuple[float, ...]
    acts: int
    frees: Frees
    frees_selective: Frees
    fsdp: tuple[int, int]
    ends: tuple[float, ...]
    unsharded: int = 0
    master: int = 0
    fsdp_master: int = 0
    step_temps: tuple[int, int] = (0, 0)
    gather_bytes: int = 0
    optimizer: OptimizerSpec | None = None
    chain: StageChain = field(default_factory=lambda: StageChain.of([], []))


def block_totals(
    blocks: Sequence[BlockCost], split: bool, gather_bytes: int = 0, optimizer: OptimizerSpec | None = None
) -> BlockTotals:
    """``BlockTotals`` of ``blocks`` for a schedule that splits its backward (``split``) or not.

    Args:
        blocks: per-block costs.
        split: whether the schedule runs the input and weight halves of the backward apart.
        gather_bytes: bytes per parameter FSDP gathers the weights in (``Layout.gather_bytes``).
        optimizer: the optimizer whose step temporaries the memory floor counts (None: none).

    Returns:
        The totals.
    """
    compute = 0.0
    backward = 0.0
    step = 0.0
    p_bytes = n_params = 0
    lead = 1.0  # the least share of a block's compute that lies on the chain before a stage (below)
    loads: list[float] = []
    backwards: list[float] = []
    acts = 0
    full: list[tuple[float, float]] = []  # per block: the most bytes recomputing it frees, and at what least cost
    either: list[tuple[float, float]] = []
    for b in blocks:
        bwd = b.bwd_s
        if split and b.bwd_input_s is not None and b.bwd_weight_s is not None:
            # a two-part backward runs its input and weight halves, which need not add up to the whole
            bwd = min(bwd, b.bwd_input_s + b.bwd_weight_s)
        compute += b.fwd_s + bwd
        backward += bwd
        loads.append(b.fwd_s + bwd)
        backwards.append(bwd)
        # what a live microbatch keeps of the block without recomputing (``acts``); recomputing it
        # frees at most that less what its loss saves; full checkpointing (by region or by stage)
        # re-runs its forward, or up to its last save; selective re-runs its other ops and frees at
        # most what the policy does not keep. A block's cost per byte is the least of its modes'.
        own = b.activation_bytes - b.weight_cast_bytes
        acts += own
        most = own - loss_held(b)
        if most > 0:
            rerun = min(recompute_cost(b), b.fwd_s)
            full.append((most, rerun))
            loose = own - kept_bytes(b)
            cheaper = selective_cost(b) / loose if loose > 0 else math.inf
            either.append((most, min(rerun, cheaper * most)))
        if split and b.fwd_s + bwd > 0:
            lead = min(lead, b.fwd_s / (b.fwd_s + bwd))
        step += (b.opt_s or 0.0) + (b.grad_s or 0.0)
        p_bytes += b.param_bytes
        n_params += b.params
    cuts = [b.sent_bytes for b in blocks[:-1] if b.cut_legal]
    gathered = as_gathered(blocks, gather_bytes)  # FSDP's weights as it gathers them
    sharded = [b.fsdp_sharded()[::-1] for b in gathered]  # what FSDP shards of each: (bytes, parameters)
    # the compute on each rank's chain (``ends_floor``), by unit: the blocks from one legal cut to the
    # next, which no stage splits (a two-part backward's last action may be a weight half: forwards only)
    units, works = [0.0], [0.0]  # and each unit's compute per microbatch (``StageChain``)
    for k, b in enumerate(blocks):
        units[-1] += b.fwd_s + (0.0 if split else b.bwd_s)
        works[-1] += loads[k]
        if b.cut_legal and k < len(blocks) - 1:
            units.append(0.0)
            works.append(0.0)
    before = itertools.accumulate(units[:-1], initial=0.0)  # before rank r: the first r units at least
    return BlockTotals(
        compute,
        backward,
        step,
        p_bytes,
        n_params,
        lead,
        min(cuts) if cuts else None,
        _largest_first(loads),
        _largest_first(backwards),
        acts,
        _cheapest_first(full),
        _cheapest_first(either),
        (sum(p for p, _ in sharded), sum(n for _, n in sharded)),
        tuple(itertools.accumulate(before, initial=0.0)),
        unsharded_floor(gathered),
        master_floor([(b.param_bytes, b.params) for b in blocks]),
        master_floor(sharded),
        (step_temp_floor(blocks, optimizer, False), step_temp_floor(blocks, optimizer, True)),
        gather_bytes,
        optimizer,
        StageChain.of(units, works),
    )


def step_temp_floor(blocks: Sequence[BlockCost], optimizer: OptimizerSpec | None, fsdp: bool) -> int:
    """A lower bound, over every split, of the sum over the stages of the optimizer step's temporaries
    (``planner.core.split.stage_model.parts_from_sums``' ``step``: the blocks' measured ones combined
    by ``OptimizerSpec.step_temp_rule`` where all of a stage's were measured, else
    ``OptimizerSpec.step_temp_bytes`` of its parameters, which grows linearly with them).

    A block not measured adds its formula's bytes to any stage that holds it; a measured one, under
    the "sum" rule, the less of its measure and its formula's; under "max", nothing (the stage's
    maximum is its own, not a sum).

    Args:
        blocks: per-block costs.
        optimizer: the optimizer (None: 0).
        fsdp: of what FSDP shards (``BlockCost.fsdp_sharded``), else of the parameters a rank holds.

    Returns:
        Bytes.
    """
    if optimizer is None:
        return 0
    total = 0
    for b in blocks:
        formula = optimizer.step_temp_bytes(b.fsdp_sharded()[0] if fsdp else b.params)
        if b.opt_temp_bytes is None:
            total += formula
        elif optimizer.step_temp_rule == "sum":
            total += min(b.opt_temp_bytes, formula)
    return total


def _cheapest_first(items: Sequence[tuple[float, float]]) -> Frees:
    """``Frees`` of (bytes, cost) items."""
    ordered = sorted(items, key=lambda bc: bc[1] / bc[0])
    return (0.0, *itertools.accumulate(b for b, _ in ordered)), (0.0, *itertools.accumulate(c for _, c in ordered))


def least_rerun(frees: Frees, nbytes: float) -> float:
    """The least cost of freeing ``nbytes`` from items that may each be freed in part, at their
    cost per byte (the cheapest first); all of them where ``nbytes`` is more than they hold.

    Args:
        frees: the items (``Frees``).
        nbytes: bytes to free.

    Returns:
        The cost (0 for nothing to free).
    """
    sizes, costs = frees
    if nbytes <= 0:
        return 0.0
    k = bisect.bisect_left(sizes, nbytes)
    if k >= len(sizes):
        return costs[-1]
    # the first k - 1 items whole, then the share of item k that makes up the rest
    return costs[k - 1] + (costs[k] - costs[k - 1]) * (nbytes - sizes[k - 1]) / (sizes[k] - sizes[k - 1])


def _largest_first(values: Sequence[float]) -> tuple[float, ...]:
    """Prefix sums of ``values`` sorted largest first, from 0 (``busiest_load``'s input)."""
    return (0.0, *itertools.accumulate(sorted(values, reverse=True)))


def busiest_load(prefix: Sequence[float], bins: int) -> float:
    """A lower bound of the largest load when whole items are dealt out to ``bins`` bins, any way.

    The mean is one bound. For each j >= 0 with ``j x bins + 1`` items, some bin holds at least
    ``j + 1`` of the ``j x bins + 1`` largest (there are more of them than ``j`` per bin), and those
    weigh at least the ``j + 1`` smallest of them. Blocks dealt to pipeline ranks are such items,
    whatever the split (contiguous stages, several per rank): one rank computes at least this per
    microbatch. Exact where the items are equal: ``n`` equal blocks on ``p`` ranks, ``ceil(n / p)``.

    Args:
        prefix: prefix sums of the items sorted largest first, from 0 (``BlockTotals.loads``).
        bins: how many bins (ranks, or stages).

    Returns:
        The bound (0 without items or bins).
    """
    n = len(prefix) - 1
    if bins < 1 or n < 1:
        return 0.0
    best = prefix[n] / bins
    j = 0  # (the largest item alone: j = 0)
    while j * bins < n:
        top = j * bins + 1  # the j x bins + 1 largest; of them, the j + 1 smallest
        best = max(best, prefix[top] - prefix[top - j - 1])
        j += 1
    return best


def floors(
    blocks: Sequence[BlockCost],
    layout: Layout,
    optimizer: OptimizerSpec,
    totals: BlockTotals | None = None,
    *,
    limit: int | None = None,
    recompute: str = "auto",
    read_orders: bool = True,
    traffic: Mapping[str, FsdpFloor] | None = None,
) -> tuple[float, int]:
    """``step_floor`` and ``memory_floor`` in one pass over the blocks.

    Both count the receive buffers torch's ``PipelineStage`` allocates up front: each of the
    ``n_stages - 1`` stage boundaries holds ``m`` microbatches' cut bytes in each direction (the stage
    before it the gradients', the stage after it the activations'), at least the least legal cut's,
    so the ranks hold ``2 m (n_stages - 1)`` such cuts between them, the busiest at least the mean.
    With several passes (gradient accumulation) the step computes every pass's microbatches (``m x
    accumulation``); the memory is one pass's. Under a memory ``limit`` the ranks' compute includes
    the recomputation that fitting it forces (``recompute_floor``). A layout whose data-parallel mode
    or FSDP units are still open ("auto") has the least memory floor of the modes it may run, and the
    least step floor of those whose memory floor fits the limit (only they can give a layout that fits).

    Args:
        blocks: per-block costs at the layout's microbatch size.
        layout: the layout.
        optimizer: the optimizer (its state bytes).
        totals: ``block_totals(blocks, split, layout.gather_bytes)`` for the layout's schedule, where
            the caller keeps it (None, or for another gathered width: summed here).
        limit: the per-rank memory limit in bytes (None: none, and no recomputation is forced).
        recompute: the recompute policy (``--recompute``: which modes a stage may take).
        read_orders: read each rank's live microbatches off the schedule's action orders where they
            have no closed form (``recompute_floor``); False: a quicker, lower step floor there.
        traffic: by mode ("fsdp", "hsdp"), what one microbatch's FSDP collectives cost a pipeline's
            ranks together at least when it shards block by block, and of them the reduce-scatters a
            stage per unit runs once a pass (``fsdp_traffic``); None: nothing counted.

    Returns:
        (the step floor in seconds, the memory floor in bytes).
    """
    t = totals
    if t is None or t.gather_bytes != layout.gather_bytes or t.optimizer != optimizer:  # (kept for other ones)
        t = block_totals(blocks, layout.schedule in ZERO_BUBBLE, layout.gather_bytes, optimizer)
    pairs = [_mode_floors(t, one, optimizer, limit, recompute, read_orders, traffic or {}) for one in _modes(layout)]
    memory = min(mem for _, mem in pairs)
    fitting = [step for step, mem in pairs if limit is None or mem <= limit]
    return min(fitting or [step for step, _ in pairs]), memory


def _modes(layout: Layout) -> list[Layout]:
    """The layout under each data-parallel mode and FSDP units it may run (``evaluate_modes``): its
    own where they are set; under "auto" DDP, FSDP and, with shard groups, HSDP (split-backward
    schedules: DDP only, as the search plans them), each with stage and block units."""
    if layout.dp == 1:
        return [layout]
    if layout.dp_mode != "auto":
        modes = [layout.dp_mode]
    elif layout.schedule in ZERO_BUBBLE:
        modes = ["ddp"]
    else:
        modes = ["ddp", "fsdp"] + (["hsdp"] if layout.dp_shard > 1 else [])
    out = []
    for mode in modes:
        units = (
            ["stage"] if mode == "ddp" else ["stage", "block"] if layout.fsdp_units == "auto" else [layout.fsdp_units]
        )
        out += [replace(layout, dp_mode=mode, fsdp_units=u) for u in units]
    return out


def _mode_floors(
    t: BlockTotals,
    layout: Layout,
    optimizer: OptimizerSpec,
    limit: int | None,
    recompute: str,
    read_orders: bool,
    traffic: Mapping[str, FsdpFloor],
) -> tuple[float, int]:
    """``floors`` of a layout whose mode and units are set (see there)."""
    pp, m, dp, mode = layout.pp, layout.n_microbatches, layout.dp, layout.dp_mode
    split = layout.schedule in ZERO_BUBBLE
    # what FSDP may shard the optimizer step over: the search plans split-backward schedules with DDP
    most = layout.dp_shard if mode == "hsdp" else dp  # the replicas a stage is sharded over
    shard = most if dp > 1 and mode in ("fsdp", "hsdp") and not split else 1
    # what FSDP shards: more than a rank holds under expert parallelism (every expert's share)
    f_bytes, f_params = t.fsdp
    least = t.least_cut
    buffers = 2 * m * (layout.n_stages - 1) * least if least is not None and layout.n_stages > 1 else 0
    # the optimizer's state: its moments (state_bytes of fp32 parameters) and the fp32 master copies
    # of narrower ones, at least (``master_floor``: a stage's state comes from its sums)
    ddp_state = optimizer.state_bytes(t.params, 4 * t.params) + t.master
    fsdp_state = optimizer.state_bytes(f_params, 4 * f_params) + t.fsdp_master
    if dp == 1 or mode not in ("fsdp", "hsdp"):
        # a rank holds its weights, gradients, state and buffers through its optimizer's step too
        # (``MemoryParts.peak``: the fixed bytes and the larger of the live ones and the step's)
        memory = (2 * t.param_bytes + ddp_state + buffers + t.step_temps[0]) // pp
    else:
        # FSDP holds its stages' weights and gradients whole while the pipeline runs (gathered, and
        # the gradients in fp32 too: ``unsharded_floor``), or block by block only a few units at a
        # time (counted as none here)
        whole = 0 if layout.fsdp_units == "block" else t.unsharded
        sharded = 2 * f_bytes + fsdp_state
        # the optimizer's step temporaries (a shard's) come instead of, not beside, what the pass holds
        memory = (sharded // max(1, most) + max(whole, t.step_temps[1] // max(1, most)) + buffers) // pp
    # one pass's makespan is at least each of: the busiest rank's compute (with the recomputation
    # the limit forces, at least the mean), the chain of the stages (``pipeline_floor``), the chain
    # around the stage with the most backward (``chain_floor``); the step adds the passes, then the
    # slowest rank's optimizer (at least the mean)
    state = fsdp_state if shard > 1 else ddp_state
    rerun = recompute_floor(t, layout, state // shard + buffers, limit, recompute, read_orders)
    busy = t.compute + rerun  # every stage's compute of a microbatch, recomputation included
    # (a recomputing backward is on the chain: with whole backwards the chain carries all of it)
    chain = pipeline_floor(busy if not split else t.compute, m, layout.n_stages, t.lead)
    one_pass = max(
        busiest_load(t.loads, pp) * m,
        ends_floor(t.ends, busy * m, pp),
        chain,
        chain_floor(t.compute, t.backward, m, layout.n_stages, split, busiest_load(t.backwards, layout.n_stages)),
    )
    one_pass = t.chain.floor_over(layout.n_stages, m, one_pass)  # (the whole units' chain: often under the rest)
    fsdp = traffic.get(mode) if shard > 1 and not split else None
    if fsdp is not None and layout.fsdp_units == "stage":
        # FSDP a stage per unit: each pass, every stage's reduce-scatter holds its rank after the
        # stage's last backward (on the timeline, or after the pass where nothing overlaps), so the
        # ranks' compute and those reductions add up, the busiest at least their mean; a stage's
        # gather is waited for or slows the compute beside it (its ``slowdown``), at least the latter
        one_pass = max(one_pass, (busy * m + fsdp.reduced + fsdp.slowdown * fsdp.gathered) / pp)
    elif fsdp is not None:
        # FSDP block by block: every microbatch, what the stages' compute does not hide of their
        # collectives (at least the traffic beyond it, and the cold starts' gathers) and the slowdown
        # of the compute beside the rest (``FsdpFloor.charged``) come after the pass
        # (``planner.core.step.predict``). For stage times x >= busy the pass and that are at least
        # ``k x + charged(max(cold, moved - x)) m / pp``, the chain's bound ``k x`` linear in x:
        # least at busy or where the traffic's term stops falling
        moved, cold = fsdp.traffic, fsdp.exposed(layout)
        k = chain / busy if busy > 0 else 0.0

        def with_traffic(x: float) -> float:
            return k * x + fsdp.charged(max(cold, moved - x)) * m / pp

        one_pass = max(
            one_pass,
            (busy + fsdp.charged(max(cold, moved - busy))) * m / pp,
            min(with_traffic(busy), with_traffic(max(busy, moved - cold))),
        )
    ddp = traffic.get("ddp") if mode == "ddp" and dp > 1 else None
    after = 0.0
    if ddp is not None and ddp.slowdown and ddp_follows(layout.schedule, layout.tp, layout.accumulation):
        # DDP's buckets during each stage's last backward (``planner.core.step.predict``): each holds
        # its rank for what it exposes and the slowdown of the compute beside the rest, at least the latter
        one_pass = max(one_pass, (busy * m + ddp.slowdown * ddp.traffic) / pp)
    elif ddp is not None:
        after = ddp.traffic / pp  # all-reduced after the step's backward, nothing hidden: the busiest at least the mean
    return layout.accumulation * one_pass + t.step / shard / pp + after, memory


def recompute_floor(
    t: BlockTotals, layout: Layout, held: int, limit: int | None, recompute: str, read_orders: bool = True
) -> float:
    """A lower bound of the recomputation seconds per microbatch, summed over the pipeline's ranks,
    that fitting every rank within ``limit`` forces, over every split.

    At its first backward rank r holds, besides what it keeps all step (``held_r``; at least
    ``held`` between the ranks: the optimizer state, its share where FSDP may shard it, and the
    receive buffers), at least ``live_r`` microbatches of each of its stages
    (``planner.core.step.schedules.live_at_first_backward``: its warm-up), each keeping its blocks'
    activations (``a_r``; ``acts`` between the ranks, whatever the split) less what recomputation
    frees of them (``f_r``). Within the limit, ``f_r >= a_r - (limit - held_r) / live_r``, so the
    ranks free at least ``acts - sum((limit - held_r) / live_r)`` bytes of a microbatch between them,
    the sum at its largest where the held bytes fill the ranks holding the most microbatches first
    (up to the limit each), which costs at least ``least_rerun`` of the modes the policy allows (each block
    freeing at most its activations less its loss's, at the least cost per byte of its modes;
    recomputing part of a stage frees part of its blocks').

    Args:
        t: the blocks' totals.
        layout: the schedule, pipeline ranks and microbatches of one pass.
        held: bytes the ranks hold all step between them, at least.
        limit: the per-rank limit (None: nothing is forced).
        recompute: the recompute policy.
        read_orders: build the schedule's action orders where its live counts have no closed form
            (``LIVE_CLOSED_FORMS``); False: one live microbatch a rank there (a lower, quicker bound).

    Returns:
        Seconds per microbatch (0 where nothing need recompute, or it cannot).
    """
    if limit is None:
        return 0.0
    try:
        modes = policy_options(recompute, layout.schedule)
    except InfeasibleError:
        return 0.0  # a policy the schedule refuses: the solver says so
    if modes == ("never",):
        return 0.0  # nothing may recompute: the split fits or not, at no cost in time
    pp, m = layout.pp, layout.n_microbatches
    if t.acts <= (pp * limit - held) / m:
        return 0.0  # fits even were every microbatch live on every rank: nothing to read off the schedule
    live: Sequence[int] = (1,) * pp  # at least one a rank; a shape the schedule refuses: the solver says so
    if read_orders or layout.schedule in LIVE_CLOSED_FORMS:
        try:
            live = live_at_first_backward(layout.schedule, pp, m, layout.stages_per_rank)
        except InfeasibleError:
            pass
    # rank r holds held_r + live_r (a_r - f_r) <= limit, freeing f_r bytes of each live microbatch;
    # summed, with sum(a_r) = acts: sum(f_r) >= acts - sum((limit - held_r) / live_r), at least
    # where the held bytes sit on the ranks holding the most microbatches, up to the limit each
    room, left = 0.0, held
    for n in sorted(live, reverse=True):
        own = min(limit, left)
        left -= own
        room += (limit - own) / n
    room -= left  # (held bytes over every rank's limit: no split fits, and the floor need not hold)
    return least_rerun(t.frees_selective if "selective" in modes else t.frees, t.acts - room)


def ends_floor(ends: Sequence[float], work: float, pp: int) -> float:
    """A lower bound of one pass's makespan: the ranks' work, and the chains around each rank's own.

    Rank r holds stage r first (looped and V placements alike), so its first action waits for a
    microbatch's forward through stages 0 .. r - 1; with whole backwards its last action (a backward)
    is followed by that microbatch's backward back through them. Those stages hold at least the first
    r units of blocks (a stage is never empty and cuts only at legal cuts): with ``E_r`` their compute
    (forwards only with a two-part backward), rank r finishes no sooner than ``E_r + W_r``, ``W_r`` its
    own compute, and the busiest of these is at least their mean, ``(sum(E_r) + sum(W_r)) / pp``.
    Messages, recomputation and waits only add. On ``pp`` equal single-block units this adds half a
    unit's compute per rank after the first: ``(pp - 1) / 2`` units.

    Args:
        ends: ``BlockTotals.ends``: ``ends[k]`` is the sum of ``E_r`` over ranks ``r < k``.
        work: every rank's compute of the pass together (every microbatch's, recomputation included).
        pp: pipeline ranks.

    Returns:
        Seconds (0 without ranks).
    """
    if pp < 1:
        return 0.0
    return (work + ends[min(pp, len(ends) - 1)]) / pp


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


def chain_floor(
    compute: float, backward: float, m: int, n_stages: int, split: bool = False, most: float = 0.0
) -> float:
    """A lower bound of one pass's makespan over every split into ``n_stages`` stages: the chain
    around the stage with the most backward.

    Take any stage s, its backward ``b`` per microbatch. Its first backward waits for that
    microbatch's forward through every stage and its backward through the stages after s; from then
    on s runs all ``m`` of its backwards, one at a time; after its last one, that microbatch's
    backward still goes through the stages before s. So the makespan is at least ``F + B + (m - 1)
    b`` with ``F`` and ``B`` every block's forward and backward of one microbatch (``compute = F +
    B``), and the stage with the most backward has at least the mean, ``b >= B / n_stages`` (and at
    least ``most``, what whole blocks force on some stage). With a
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
        most: a known lower bound of the most backward a stage has (whole blocks dealt to the
            stages, ``busiest_load``), where it is above the mean.

    Returns:
        Seconds (0 without stages or microbatches).
    """
    if m < 1 or n_stages < 1:
        return 0.0
    forward, per_stage = compute - backward, max(backward / n_stages, most)
    if split:
        return forward + m * per_stage
    return compute + (m - 1) * per_stage


__all__ = [
    "BlockTotals",
    "block_totals",
    "busiest_load",
    "chain_floor",
    "ends_floor",
    "recompute_floor",
    "floors",
    "least_rerun",
    "memory_floor",
    "pipeline_floor",
    "step_floor",
    "step_temp_floor",
]
