"""One candidate of the search: a layout solved and predicted (``evaluate_choice``), under a
data-parallel mode that may still be open (``evaluate_modes``), on block costs rescaled to the
layout's microbatch size (``planner.core.levers.microbatch.blocks_at``).

Pure module: never imports torch. ``planner.core.layout.search`` enumerates the layouts, bounds and ranks
them; this module evaluates one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from planner.core.layout.bounds import floors
from planner.core.layout.fsdp_bounds import fsdp_traffic
from planner.core.layout.inputs import Cluster, Constraints, Layout, Scaling
from planner.core.layout.rank_fit import rank_split
from planner.core.levers.casts import compiled_casts, without_casts
from planner.core.levers.context_parallel import at_context, context_link
from planner.core.levers.data_parallel import as_gathered, layout_links, tp_link
from planner.core.levers.experts import at_degree as experts_at
from planner.core.levers.experts import group_link
from planner.core.levers.links import Links
from planner.core.levers.microbatch import blocks_at
from planner.core.levers.tensor_parallel import at_degree
from planner.core.split.cuts import Split
from planner.core.split.stage_plans import StageMemo
from planner.core.step.predict import predict
from planner.core.step.schedules import ZERO_BUBBLE, check_schedule
from planner.errors import InfeasibleError
from planner.schema.costs import BlockCost
from planner.schema.plan import Candidate, Prediction, StagePlan


class Outpaced(Exception):
    """A layout that cannot beat the search's best step: whatever it would give is either slower than
    ``bound`` (``evaluate_modes``) or does not fit. ``floor_s``: the least step it could still take,
    so that the search puts it back in line there (``planner.core.layout.search``) instead of solving
    the modes that could give it (FSDP's block units after stage units that do not fit, the slowest
    of them all)."""

    def __init__(self, floor_s: float) -> None:
        super().__init__(floor_s)
        self.floor_s = floor_s


@dataclass(frozen=True)
class Choice:
    """One evaluated combination: its layout, its blocks at the layout's microbatch size, its split's
    stages and prediction, and whether it fits the memory limit."""

    layout: Layout
    blocks: list[BlockCost]
    stages: list[StagePlan]
    prediction: Prediction
    fits: bool

    @property
    def split(self) -> Split:
        """The split its prediction carries."""
        return Split.of(self.prediction)

    def row(self) -> Candidate:
        """The candidate as the plan records it."""
        layout = self.layout
        return Candidate(
            schedule=layout.schedule,  # type: ignore[arg-type]  # a member of SCHEDULES
            n_microbatches=layout.n_microbatches,
            stages_per_rank=layout.stages_per_rank,
            dp=layout.data_replicas,
            dp_mode=layout.dp_mode,  # type: ignore[arg-type]  # "ddp", "fsdp" or "hsdp"
            dp_shard=layout.dp_shard or None,
            fsdp_units=layout.fsdp_units,  # type: ignore[arg-type]  # "stage" or "block"
            tp=layout.tp,
            ep=layout.ep,
            sequence_parallel=layout.sequence,
            cp=layout.cp,
            cp_attention=layout.cp_attention,  # type: ignore[arg-type]  # a member of CP_ATTENTION
            accumulation=layout.accumulation,
            starts=self.prediction.starts,
            step_time_s=self.prediction.step_time_s,
            bubble_fraction=self.prediction.bubble_fraction,
            max_memory_bytes=self.prediction.max_memory_bytes,
            fits=self.fits,
        )


def rank_blocks(
    blocks: Sequence[BlockCost], layout: Layout, link: Links, scaling: Scaling, batch_size: int
) -> list[BlockCost]:
    """The blocks as one rank of ``layout`` runs them: at its share of a microbatch, split over its
    tensor-parallel ranks, its share of each sequence (context parallelism, consecutive replicas) and
    its experts (expert parallelism, an expert group's ranks consecutive): what the search prices
    every layout with, and its what-if repricing (``planner.core.layout.robust``) alike.

    Args:
        blocks: per-block costs at microbatch size ``scaling.size0``.
        layout: the layout.
        link: the cluster's links.
        scaling: how the costs carry over to other microbatch sizes.
        batch_size: samples per step.

    Returns:
        The rank's block costs.
    """
    sized = blocks_at(blocks, scaling.size0, layout.rank_share(batch_size), scaling.fixed_fraction)
    shares = at_degree(sized, layout.tp, tp_link(link), sequence=layout.sequence, loss=layout.loss_parallel)
    if layout.cp > 1:  # a context-parallel group: consecutive replicas
        group = context_link(link, layout.pp, layout.dp, layout.tp, layout.cp, layout.pp_outer)
        shares = at_context(shares, layout.cp, layout.tp, group, ring=layout.cp_attention == "ring")
    if layout.ep > 1:  # an expert group's ranks are consecutive: an expert-parallel layout is pipeline-outermost
        shares = experts_at(shares, layout.ep, *group_link(link, layout.ep), tp=layout.tp, tp_link=tp_link(link))
    return list(shares)


def evaluate_choice(
    blocks: Sequence[BlockCost],
    cluster: Cluster,
    layout: Layout,
    constraints: Constraints,
    split: Split | None = None,
    memo: StageMemo | None = None,
) -> Choice:
    """Solve (unless ``split`` is given) and predict one layout.

    The solver gets each stage's in-flight count from its place in the schedule and, with several
    stages per rank, a per-stage cap on memory (``planner.core.layout.rank_fit.rank_split``: the share ``limit / v``, under which
    a rank's stages together fit, and where that fails or makes "auto" recompute, larger caps whose splits the
    predicted rank peak still fits); the prediction's per-rank peak decides ``fits``. ``blocks`` are
    costed at the layout's microbatch size; its ``dp`` replicas reduce gradients by its ``dp_mode``
    ("ddp", "fsdp" or "hsdp"), and FSDP's shards are what the memory limit holds.

    Args:
        blocks: per-block costs at the layout's microbatch size.
        cluster: the links (placed here for the layout's replicas) and the ranks that compute at once.
        layout: the schedule, pipeline ranks, microbatches, stages per rank, replicas and their mode.
        constraints: the optimizer, the per-rank memory limit and the recompute policy.
        split: a split to predict as it is (None: the solver's).
        memo: with ``split``, the stages of earlier splits of this layout and these blocks, reused
            and added to (``planner.core.split.stage_plans.StageMemo``; None: none).

    Returns:
        The evaluated layout.

    Raises:
        InfeasibleError: the schedule refuses these numbers, or no split fits.
    """
    pp = layout.pp
    check_schedule(layout.schedule, pp, layout.n_microbatches, layout.stages_per_rank)
    given, how = blocks, (layout.shard, layout.gather_bytes, constraints.compiled)
    if memo is not None and memo.derived is not None and memo.derived[0] is given and memo.derived[1] == how:
        blocks = memo.derived[2]  # derived already, the very list the memo's stages were laid out from
    elif layout.shard > 1:
        # FSDP gathers the weights in the plan's dtype: its stages hold them so (a measured bf16
        # profile counts the fp32 weights autocast trains), and autocast copies none
        blocks = as_gathered(without_casts(blocks), layout.gather_bytes)
    elif constraints.compiled:  # (FSDP's stages hold no copies, compiled or not)
        blocks = compiled_casts(blocks)
    if memo is not None:
        memo.derived = (given, how, blocks)
    limit = constraints.memory_limit_bytes
    link = layout_links(cluster.link, pp, layout.dp, layout.tp, layout.pp_outer)
    if split is None:
        stages, prediction = rank_split(blocks, link, layout, constraints, cluster.slots)
    else:
        stages, prediction = predict(blocks, split, link, layout, constraints.optimizer, cluster.slots, memo)
    fits = limit is None or prediction.max_memory_bytes <= limit
    # one replica is recorded as ddp, whatever was asked
    mode = ("hsdp" if layout.dp_mode == "hsdp" else "fsdp") if layout.shard > 1 else "ddp"
    units = layout.fsdp_units if mode != "ddp" else "stage"
    dp_shard = layout.dp_shard if mode == "hsdp" else 0
    return Choice(
        replace(layout, dp_mode=mode, fsdp_units=units, dp_shard=dp_shard), list(blocks), stages, prediction, fits
    )


def evaluate_modes(
    blocks: Sequence[BlockCost],
    cluster: Cluster,
    layout: Layout,
    constraints: Constraints,
    bound: float | None = None,
) -> Choice:
    """``evaluate_choice`` under a data-parallel mode that may be "auto": DDP when that fits the
    memory limit, else FSDP when that does (when neither fits, the one needing less memory), or
    HSDP in groups of ``layout.dp_shard`` replicas (when over 1: the replicas span nodes) where
    that fits too and is faster.

    Args:
        blocks: per-block costs at the layout's microbatch size.
        cluster: the links and the ranks that compute at once.
        layout: the layout; its ``dp_mode`` "ddp", "fsdp", "hsdp" or "auto" (with one replica, always ddp).
        constraints: the optimizer, the per-rank memory limit and the recompute policy.
        bound: the step a fitting layout must beat to matter to the caller (None: any); see Raises.

    Returns:
        The evaluated combination, its ``dp_mode`` the one chosen.

    Raises:
        InfeasibleError: no mode can split the model within the limit (FSDP's reason, the mode
            needing less memory for optimizer state).
        Outpaced: with ``bound``, FSDP's units are open, DDP does not fit (where it does, it is the
            answer, however slow), FSDP's stage units fit no faster than ``bound`` or not at all,
            and the step floor of FSDP's block units is over it too: the layout cannot give a step
            within ``bound``, and the block units, which gather every microbatch again, are not
            solved for nothing.
    """

    def attempt(mode: str) -> Choice:
        if mode != "ddp" and layout.fsdp_units == "auto":
            # (HSDP is tried only beside FSDP that fits: it is taken where faster, never deferred)
            outpaced = bound if mode == "fsdp" else None
            return _fsdp_units(blocks, cluster, replace(layout, dp_mode=mode), constraints, outpaced)
        units = layout.fsdp_units if mode != "ddp" else "stage"
        return evaluate_choice(blocks, cluster, replace(layout, dp_mode=mode, fsdp_units=units), constraints)

    dp, dp_mode, schedule = layout.dp, layout.dp_mode, layout.schedule
    if dp > 1 and schedule in ZERO_BUBBLE:
        # torch 2.13's FSDP2 does not follow these schedules' two-part backward (weight gradients by
        # autograd.grad, past its hooks): the runner cannot shard them, so they are planned with DDP.
        if dp_mode in ("fsdp", "hsdp"):
            raise InfeasibleError(
                f"--dp-mode {dp_mode} cannot run --schedule {schedule} (torch's FSDP2 does not follow its split "
                "backward); use --dp-mode ddp or another schedule"
            )
        return attempt("ddp")
    if dp == 1 or dp_mode != "auto":
        return attempt("ddp" if dp_mode == "auto" else dp_mode)
    # DDP is taken wherever it fits; where its memory floor alone is over the limit it cannot, and
    # it is solved only if the answer needs it (FSDP fails or does not fit either: the same answer)
    ddp_over = _over_limit(blocks, layout, "ddp", constraints)
    ddp: Choice | None = None
    if not ddp_over:
        try:
            ddp = attempt("ddp")
            if ddp.fits:
                return ddp
        except InfeasibleError:
            pass
    try:
        fsdp = attempt("fsdp")
    except InfeasibleError:
        ddp = _attempted(attempt, "ddp") if ddp_over else ddp
        if ddp is None:
            raise
        return ddp
    if fsdp.fits and layout.dp_shard > 1:
        # replicas on several nodes: shard groups of one node's replicas (HSDP) gather over the
        # node's link and cross nodes only to all-reduce a shard; taken where they fit and are faster
        if _outpaced(blocks, cluster, replace(layout, dp_mode="hsdp"), constraints, [fsdp]):
            return fsdp
        try:
            hsdp = attempt("hsdp")
        except InfeasibleError:
            return fsdp
        return hsdp if hsdp.fits and hsdp.prediction.step_time_s < fsdp.prediction.step_time_s else fsdp
    if fsdp.fits:
        return fsdp
    ddp = _attempted(attempt, "ddp") if ddp_over else ddp
    if ddp is None:
        return fsdp
    return min((ddp, fsdp), key=lambda c: c.prediction.max_memory_bytes)


def _over_limit(blocks: Sequence[BlockCost], layout: Layout, mode: str, constraints: Constraints) -> bool:
    """Whether ``layout`` under ``mode`` ("ddp", or "fsdp" with a stage per unit) cannot fit the
    memory limit whatever the split: its memory floor (``planner.core.layout.bounds.floors``,
    checked against the solved and simulated layouts in tests/test_bounds.py) is over it."""
    limit = constraints.memory_limit_bytes
    if limit is None:
        return False
    return floors(blocks, replace(layout, dp_mode=mode, fsdp_units="stage"), constraints.optimizer)[1] > limit


def _attempted(attempt: Callable[[str], Choice], mode: str) -> Choice | None:
    """``attempt(mode)``, None where no split fits it."""
    try:
        return attempt(mode)
    except InfeasibleError:
        return None


def _fsdp_units(
    blocks: Sequence[BlockCost],
    cluster: Cluster,
    layout: Layout,
    constraints: Constraints,
    bound: float | None = None,
) -> Choice:
    """``evaluate_choice`` under FSDP with its units open: the faster of a stage per unit and a block
    per unit that fits (a stage gathers once per step; blocks hold far less but gather again every
    microbatch); when neither fits, the one needing less memory.

    Raises:
        InfeasibleError: neither splits the model within the limit (the block units' reason: they
            need the least memory).
        Outpaced: no stage units fit faster than ``bound`` (None: never raised) and the block units'
            step floor is over it: ``floor_s`` the least of that floor and the stage units' step.
    """
    # a stage per unit holds the stage's weights whole: where even its memory floor is over the
    # limit it cannot fit, and it is solved only if the block units do not fit either (the same answer)
    stage_over = layout.dp_mode == "fsdp" and _over_limit(blocks, layout, "fsdp", constraints)
    tried: list[Choice] = []
    error: InfeasibleError | None = None
    for units in ("stage", "block"):  # on a tie, the stage: fewer, larger transfers
        if units == "stage" and stage_over:
            continue
        if units == "block" and _outpaced(blocks, cluster, replace(layout, fsdp_units="block"), constraints, tried):
            continue
        if units == "block" and bound is not None:
            # what the layout could still give: the block units' floor, or stage units that fit
            least = min(
                [_step_floor(blocks, cluster, replace(layout, fsdp_units="block"), constraints)]
                + [c.prediction.step_time_s for c in tried if c.fits]
            )
            if least > bound:
                raise Outpaced(least)
        try:
            tried.append(evaluate_choice(blocks, cluster, replace(layout, fsdp_units=units), constraints))
        except InfeasibleError as e:
            error = e  # the block units' when both fail
    if stage_over and not any(c.fits for c in tried):
        try:  # tried first, as above, so that the same candidate wins a tie
            tried.insert(0, evaluate_choice(blocks, cluster, replace(layout, fsdp_units="stage"), constraints))
        except InfeasibleError:
            pass  # the block units' error stands: it was raised after the stage units'
    if not tried:
        assert error is not None  # both raised
        raise error
    fitting = [c for c in tried if c.fits]
    if fitting:
        return min(fitting, key=lambda c: c.prediction.step_time_s)
    return min(tried, key=lambda c: c.prediction.max_memory_bytes)


def _outpaced(
    blocks: Sequence[BlockCost], cluster: Cluster, layout: Layout, constraints: Constraints, tried: Sequence[Choice]
) -> bool:
    """Whether a candidate of ``tried`` already fits faster than ``layout`` could run whatever its
    split (FSDP's block units beside its stage units, HSDP beside FSDP): its step floor
    (``_step_floor``) is over that step, so solving it cannot change the answer (the same answer,
    sooner)."""
    fitting = [c.prediction.step_time_s for c in tried if c.fits]
    if not fitting:
        return False
    return _step_floor(blocks, cluster, layout, constraints) > min(fitting)


def _step_floor(blocks: Sequence[BlockCost], cluster: Cluster, layout: Layout, constraints: Constraints) -> float:
    """The least step ``layout`` (its mode and FSDP units set) can take whatever its split
    (``planner.core.layout.bounds.floors``, with FSDP's collectives, checked against the solved and
    simulated layouts in tests/test_bounds.py)."""
    traffic = fsdp_traffic(blocks, cluster.link, layout, cluster.slots)
    step, _ = floors(
        blocks,
        layout,
        constraints.optimizer,
        limit=constraints.memory_limit_bytes,
        recompute=constraints.recompute,
        traffic=traffic,
    )
    return step


def unlimited_step(
    blocks: Sequence[BlockCost], cluster: Cluster, choice: Choice, constraints: Constraints
) -> float | None:
    """The step of ``choice``'s layout (its data-parallel mode as chosen) solved without the memory
    limit: where it is faster than the choice, the limit shaped it (unbalanced its split or made it
    recompute), and such a one-pass layout may lose to more passes of lighter microbatches
    (``--accumulation auto``: ``planner.core.layout.passes``), none of which is faster than it.

    Args:
        blocks: per-block costs at the layout's microbatch size (as ``evaluate_choice`` takes them).
        cluster: the links and the ranks that compute at once.
        choice: the layout as evaluated under ``constraints``.
        constraints: the optimizer, the per-rank memory limit and the recompute policy.

    Returns:
        The step in seconds; None without a limit, for a choice that does not fit, or where the
        layout has no split without the limit either.
    """
    if constraints.memory_limit_bytes is None or not choice.fits:
        return None
    try:
        free = evaluate_choice(blocks, cluster, choice.layout, replace(constraints, memory_limit_bytes=None))
    except InfeasibleError:
        return None
    return free.prediction.step_time_s


__all__ = ["Choice", "Outpaced", "evaluate_choice", "evaluate_modes", "unlimited_step"]
