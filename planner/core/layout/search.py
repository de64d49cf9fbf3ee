"""The joint search: schedule x microbatches x stages per rank x split, least predicted step time.

Pure module: never imports torch. For every combination the user left open (``--schedule auto``,
``--microbatches auto``, ``--stages-per-rank auto``) the exact solver splits the blocks into
ranks x stages-per-rank stages under the memory limit, with each stage's in-flight microbatches
taken from its place in that schedule; the simulator then times the step (``predict``). The
candidate with the least predicted step that fits wins; its split is then polished against the
simulated step itself (``refine``), since the bottleneck the solver minimises is not all of a step
(warm-up and drain, messages, the optimizer).

Costs are profiled at one microbatch size; other microbatch counts use ``blocks_at``, which scales
times by an affine model fitted when profiling (``ProfileInfo.fixed_fraction``: the part of a
microbatch's time that does not shrink with its size, e.g. kernel launches and per-op overhead)
and byte counts linearly.

Data parallelism (``--dp``): with dp replicas the ranks hold dp copies of a pipeline of
ranks / dp ranks, each running its batch / dp samples, so a candidate's microbatches hold
batch / (dp x m) samples (never fewer than the smallest the model ran when profiled); the
gradient reduction and FSDP's sharded memory enter through ``predict``. ``--dp auto`` adds the
replica count to the combinations searched; ``--dp-mode auto`` takes DDP where a candidate fits,
else FSDP.

Gradient accumulation (``--accumulation``): a layout may run its step as k passes of the schedule,
each of m microbatches (``Layout.accumulation``): k times one pass's makespan, but one pass's memory
(torch's ``PipelineStage`` allocates receive buffers for every microbatch of a pass, up front). With
``--accumulation auto`` a layout is retried in k > 1 passes only where its one pass does not fit,
or fits only as the memory limit shapes it (``planner.core.layout.passes``, ``unlimited_step``: a split
the limit unbalances, or recomputation the limit forces, may lose to more passes of lighter
microbatches); elsewhere one pass of the same microbatches is never slower.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from planner.core.layout.candidate import Choice, Outpaced, evaluate_choice, evaluate_modes
from planner.core.layout.inputs import Cluster, Constraints, Layout, Scaling, SearchSpace, replica_mode
from planner.core.layout.passes import accumulation_options, one_pass_of, one_pass_settles, retried_passes
from planner.core.layout.pending import (
    Pending,
    Pool,
    Sized,
    Task,
    full_floor,
    pending_layout,
    ring_dominates,
    taken,
)
from planner.core.layout.rank_fit import most_stages, too_many_stages
from planner.core.levers.data_parallel import layout_links
from planner.core.levers.experts import layout_refusal
from planner.core.split.baselines import BASELINE_NAMES, baseline_splits
from planner.core.split.cuts import Split
from planner.core.split.stage_plans import StageMemo
from planner.core.step.schedules import stages_per_rank_options
from planner.errors import InfeasibleError
from planner.schema.costs import BlockCost
from planner.schema.counts import divisors
from planner.schema.names import SCHEDULES

MAX_AUTO_STAGES_PER_RANK = 4
"""``--stages-per-rank auto`` tries 1 .. this many (more stages per rank add messages for less bubble)."""


Progress = Callable[[int, int], None]
"""Told (layouts done, layouts in all) as the search goes, for a progress bar."""

TIE = 1e-3
"""Predicted steps within this relative difference count as equal (the cost model is not that precise)."""

REFINE_EVALUATIONS = 120
# runners-up polished too when their solver split is within this of the polished winner's step (the polishing has gained up to about 2 % on the published runs' layouts),
# at most this many
REFINE_MARGIN = 0.03
REFINE_RIVALS = 2
"""At most this many neighbouring splits are simulated when polishing the winner against the simulated step."""


def microbatch_options(batch_size: int, fixed: int | None, min_size: int = 1) -> list[int]:
    """The microbatch counts the search tries: ``fixed`` alone, or every divisor of the batch whose
    microbatches hold at least ``min_size`` samples (the smallest the model ran when profiled), down
    to microbatches of one sample. The search's bounds prune the counts that cannot win
    (``planner.core.layout.search``'s module docstring)."""
    if fixed is not None:
        return [fixed]
    return [d for d in divisors(batch_size) if batch_size // d >= min_size]


def _max_stages_per_rank(blocks: Sequence[BlockCost], n_ranks: int) -> int:
    legal = sum(1 for b in blocks[:-1] if b.cut_legal)
    return max(1, min(MAX_AUTO_STAGES_PER_RANK, (legal + 1) // n_ranks))


def replica_microbatches(batch_size: int, dp: int, fixed: int | None, min_size: int) -> list[int]:
    """The microbatch counts one replica's pipeline may run with ``dp`` replicas.

    Each replica runs ``batch_size / dp`` samples: ``microbatch_options`` of that batch, and with
    more than one replica only counts that divide it into microbatches of at least ``min_size``
    samples (a fixed ``--microbatches`` included: costs are not extrapolated below the smallest
    microbatch the model ran).

    Args:
        batch_size: the global batch.
        dp: replicas.
        fixed: the given microbatch count (None: auto).
        min_size: the smallest microbatch allowed.

    Returns:
        The counts, ascending (empty: this replica count cannot run).
    """
    if batch_size % dp:
        return []
    replica = batch_size // dp
    counts = microbatch_options(replica, fixed, min_size)
    if dp > 1:
        counts = [m for m in counts if replica % m == 0 and replica // m >= min_size]
    return counts


def _layouts(
    blocks: Sequence[BlockCost], space: SearchSpace, pp: int, dp: int, ms: Sequence[int], tp: int = 1, ep: int = 1
) -> list[Layout]:
    """Every layout of ``space`` with ``dp`` replicas of ``pp`` ranks of ``tp`` tensor-parallel ranks
    each (their experts sharded over ``ep`` replicas) and these microbatch counts, schedules in
    ``SCHEDULES``' order."""
    schedules = list(SCHEDULES) if space.schedule == "auto" else [space.schedule]
    if pp == 1 and space.schedule == "auto":
        # one rank runs its stage alone: every schedule is gradient accumulation, at one speed; GPipe
        # runs every forward before the first backward (m microbatches' activations held), 1F1B
        # alternates (one held), so both are tried and the tie goes to the one needing less memory
        schedules = ["gpipe", "1f1b"]
    out = []
    for name in schedules:
        vs = (
            [space.stages_per_rank]
            if space.stages_per_rank is not None
            else stages_per_rank_options(name, _max_stages_per_rank(blocks, pp))
        )
        out += [
            Layout(
                name,
                pp,
                m,
                v,
                dp,
                space.dp_mode,
                tp,
                fsdp_units=space.fsdp_units,
                gather_bytes=space.gather_bytes,
                ep=ep,
            )
            for v in vs
            for m in ms
        ]
    return out


def _pending_layouts(
    blocks: Sequence[BlockCost],
    cluster: Cluster,
    space: SearchSpace,
    constraints: Constraints,
    scaling: Scaling,
    cache: dict[tuple[float, int, bool, int, int, str], Sized],
) -> tuple[list[Pending], list[InfeasibleError]]:
    """Every layout of ``space`` with its costs and floors, tensor-parallel degrees outermost, then
    replica counts (ascending: the simpler first), in ``_layouts``' order within them; ``cache``
    holds the costs by microbatch size, degree and sequence split (``_pending``)."""
    pending: list[Pending] = []
    errors: list[InfeasibleError] = []
    floor = min(scaling.min_size, scaling.size0)
    fixed_k = space.accumulation if space.accumulation is not None else 1
    for tp, rows, ep, cp in _meshes(cluster, space):
        # a mesh expert parallelism cannot run is no layout (HSDP's groups are checked below, once sized)
        if layout_refusal(ep, dp=rows * cp, tp=tp, dp_mode=space.dp_mode, cp=cp):
            continue
        dp = rows * cp  # the mesh's replicas: each data-parallel replica's context-parallel ranks
        pp = cluster.world_size // (dp * tp)
        ms = replica_microbatches(space.batch_size // fixed_k, rows, space.n_microbatches, floor)
        if not ms:
            errors.append(
                InfeasibleError(
                    f"--dp {rows}: the batch of {space.batch_size} does not split into {rows} replicas of microbatches "
                    f"of at least {floor} sample(s) (the smallest the model ran when profiled)"
                )
            )
            continue
        if pp > sum(1 for b in blocks[:-1] if b.cut_legal) + 1:
            errors.append(InfeasibleError(f"{pp} pipeline ranks (dp={dp}, tp={tp}) are more than the model's stages"))
            continue
        # an expert-parallel layout is pipeline-outermost: a pipeline rank's replicas are tp ranks apart
        mode, dp_shard = replica_mode(cluster, space, dp, pp * tp if ep == 1 else tp)
        if dp_shard < 0:
            errors.append(InfeasibleError(f"--dp-shard {space.dp_shard} does not divide {dp} replicas into groups"))
            continue
        if dp_shard % ep:  # an expert group lies inside a shard group
            if mode == "hsdp":
                errors.append(
                    InfeasibleError(f"--ep {ep} does not divide the {dp_shard} replicas of each HSDP shard group")
                )
                continue
            dp_shard = 0  # "auto": FSDP or DDP only
        layouts = _layouts(blocks, replace(space, dp_mode=mode), pp, dp, ms, tp, ep)
        if space.schedule != "auto" and not layouts:
            # a V schedule asked for on fewer blocks than two stages a rank need (under auto: no candidate)
            errors.append(InfeasibleError(too_many_stages(space.schedule, pp, 2, most_stages(blocks))))
            continue
        for sequence in space.sequence if tp > 1 and ep == 1 else (False,):  # not yet with ep
            for layout in layouts:
                # (loss parallelism does not run with context parallelism yet: gathered there)
                split_loss = space.loss_parallel and tp > 1 and cp == 1
                layout = replace(
                    layout, dp_shard=dp_shard, sequence=sequence, accumulation=fixed_k, cp=cp, loss_parallel=split_loss
                )
                items = [
                    pending_layout(blocks, cluster, replace(layout, cp_attention=a), space, scaling, constraints, cache)
                    for a in (space.cp_attention if cp > 1 else ("all-gather",))
                ]
                pending.extend(items[1:] if len(items) == 2 and ring_dominates(*items) else items)
    return pending, errors


@dataclass
class _Outcome:
    """What the search evaluated, and what it could rule out without solving."""

    results: list[Choice]
    errors: list[InfeasibleError]
    layouts: int = 0  # layouts enumerated
    evaluated: int = 0  # layouts solved and simulated (not those a pool evaluated ahead and the search then ruled out)
    pruned: int = 0  # layouts whose step floor was already slower than a fitting candidate
    unfit: list[Pending] = field(default_factory=list)  # memory floor over the limit, or no split fits


def _evaluate_all(
    blocks: Sequence[BlockCost],
    cluster: Cluster,
    space: SearchSpace,
    constraints: Constraints,
    scaling: Scaling,
    progress: Progress | None = None,
    pool: Pool | None = None,
) -> _Outcome:
    """Evaluate the layouts of ``space`` that can win: in ascending order of their step floor,
    skipping those whose memory floor is over the limit, until the floor of the next is slower
    than the fastest fitting candidate found (beyond ``TIE``: it could not even tie). With a
    ``pool``, the layouts next in that order are kept in its workers' hands (``ahead``) and their
    results taken in the same order: the same outcome, sooner on several cores."""
    # costs by microbatch size, degree and sequence split, shared with the layouts retried in several
    # passes below: with the microbatch count open they run their one-pass layout's microbatches
    cache: dict[tuple[float, int, bool, int, int, str], Sized] = {}
    pending, errors = _pending_layouts(blocks, cluster, space, constraints, scaling, cache)
    order = sorted(range(len(pending)), key=lambda k: (pending[k].step_floor_s, k))
    limit = constraints.memory_limit_bytes
    outcome = _Outcome([], errors, layouts=len(pending))
    found: list[tuple[int, Choice]] = []
    best: float | None = None
    # a layout whose one pass does not fit, or fits only as the memory limit shapes it, is retried
    # in several passes (gradient accumulation): those are queued beside it (their step floor is
    # its), after every first-pass layout in the enumeration's order; where one pass fits as it
    # would without a limit it is never slower than more passes of the same microbatches (each
    # pass pays the pipeline's warm-up and drain), so they are not tried (``retried_passes``)
    heap = [(pending[k].step_floor_s, k) for k in order]
    min_size = min(scaling.min_size, scaling.size0)

    def task(item: Pending, bound: float | None) -> Task:
        # timed without the limit too where its runs in several passes may be searched (``retried_passes``)
        retry = limit is not None and bool(accumulation_options(item.layout, space, min_size))
        return item.blocks, cluster, item.layout, constraints, retry, bound

    done = 0
    submitted: dict[int, int] = {}  # handed to the pool, not taken yet: their tickets
    passes_queued: set[int] = set()  # the layouts whose runs in several passes are queued already
    while heap:
        key, k = heapq.heappop(heap)
        item = pending[k]
        if item.totals is not None:  # a quick floor: the full one, and back in line if it is later
            pending[k] = item = full_floor(item, constraints)
            if item.step_floor_s > key:
                heapq.heappush(heap, (item.step_floor_s, k))
                continue
        if progress is not None:
            progress(done, len(pending))
        done += 1
        if best is not None and item.step_floor_s > best * (1 + TIE):
            outcome.pruned = len(heap) + 1
            break
        fits, choice, free = False, None, None  # type: bool, Choice | None, float | None
        if limit is not None and item.memory_floor > limit:
            outcome.unfit.append(item)
        else:
            bound = None if best is None else best * (1 + TIE)
            got, free = taken(k, pending, heap, submitted, task, pool, limit, bound)
            if isinstance(got, Outpaced):
                # no mode solved so far gives it within the bound, and the rest (FSDP's block units)
                # could not either: back in line at the least step it could still take, evaluated
                # whole if the search comes to it again; its runs in several passes are queued now,
                # as those of a one pass that does not fit (none of its modes that could win fits)
                pending[k] = item = replace(item, step_floor_s=max(item.step_floor_s, got.floor_s))
                heapq.heappush(heap, (item.step_floor_s, k))
                done -= 1
            elif isinstance(got, InfeasibleError):
                outcome.evaluated += 1
                outcome.errors.append(got)
                outcome.unfit.append(item)
            else:
                outcome.evaluated += 1
                choice = got
                found.append((k, choice))
                fits = one_pass_settles(choice, item.layout)
                if choice.fits and (best is None or choice.prediction.step_time_s < best):
                    best = choice.prediction.step_time_s
        if k in passes_queued:
            continue  # queued when it was put back in line (``Outpaced``), as many as it could ever need
        passes_queued.add(k)
        fitting = choice if fits and isinstance(choice, Choice) else None
        layouts, floor = retried_passes(item.layout, space, min_size, fitting, free, TIE)
        for layout in layouts:
            retried = pending_layout(blocks, cluster, layout, space, scaling, constraints, cache)
            pending.append(
                retried if floor is None else replace(retried, step_floor_s=max(retried.step_floor_s, floor))
            )
            heapq.heappush(heap, (pending[-1].step_floor_s, len(pending) - 1))
    if pool is not None:
        pool.discard(submitted.values())  # evaluated ahead, then ruled out: their results are not wanted
    outcome.layouts = len(pending)
    if progress is not None:
        progress(len(pending), len(pending))
    # the rest of the search ranks candidates in the enumeration's order (ties go to the earlier)
    outcome.results = [choice for _, choice in sorted(found, key=lambda kc: kc[0])]
    return outcome


def _meshes(cluster: Cluster, space: SearchSpace) -> list[tuple[int, int, int, int]]:
    """The (tensor-parallel degree, data-parallel replica count, expert-parallel degree, context-parallel
    degree) whose ranks divide the world size, ep 1 and cp 1 first (which of them expert parallelism
    runs on: ``_pending_layouts``; an expert group covers consecutive replicas of the dp x cp)."""
    return [
        (tp, dp, ep, cp)
        for cp in space.cps
        for ep in space.eps
        for tp in space.degrees
        for dp in space.replicas
        if cluster.world_size % (tp * dp * cp) == 0
    ]


def search(
    blocks: Sequence[BlockCost],
    cluster: Cluster,
    space: SearchSpace,
    constraints: Constraints,
    scaling: Scaling,
    progress: Progress | None = None,
    pool: Pool | None = None,
) -> tuple[Choice, list[Choice], str]:
    """Every open combination, solved and simulated; the fastest that fits, polished.

    Args:
        blocks: per-block costs at microbatch size ``scaling.size0``.
        cluster: every rank (``world_size``: each replica count dp in ``space.replicas`` gives a
            pipeline of world_size / dp ranks), the links between them (a ``NodeLinks`` is placed
            for each layout) and the ranks that compute at once.
        space: the batch and what is open: schedule, microbatches per replica (None: the divisors
            of the replica's batch, ``microbatch_options``), stages per rank (None: what each
            schedule allows, up to ``MAX_AUTO_STAGES_PER_RANK``), replica counts, data-parallel mode.
        constraints: the optimizer, the per-rank memory limit and the recompute policy.
        scaling: how the costs carry over to other microbatch sizes (``blocks_at``); auto counts,
            and every count with several replicas, stay at or above the smallest microbatch the
            model ran.
        progress: told (layouts done, layouts in all) as the search goes (None: nothing).
        pool: evaluates the layouts next in line together (None: one at a time, here); the
            result is the same.

    Returns:
        The chosen combination, every evaluated one (fastest first, those that fit before those
        that do not) and one line saying why the choice won.

    Raises:
        InfeasibleError: nothing the user asked for can run; or, under a memory limit, nothing fits
            (naming the closest layout and how far over the limit it is).
    """
    replicas = space.replicas
    bad = [dp for dp in replicas if dp < 1 or cluster.world_size % dp]
    if bad or not replicas:
        raise InfeasibleError(f"replica counts {list(replicas)} must be divisors of the {cluster.world_size} ranks")
    space = replace(space, replicas=tuple(sorted(set(replicas))))
    outcome = _evaluate_all(blocks, cluster, space, constraints, scaling, progress, pool)
    if not any(c.fits for c in outcome.results) and constraints.memory_limit_bytes is not None:
        raise _nothing_fits(outcome, cluster, constraints)
    best, ranked = _rank(outcome.results, outcome.errors)
    best, polished, beaten, start = _polished_best(best, ranked, cluster, constraints)
    open_parts = [
        label
        for label, is_open in (
            ("schedule", space.schedule == "auto"),
            ("microbatches", space.n_microbatches is None),
            ("stages per rank", space.stages_per_rank is None),
            ("data-parallel replicas", len(space.replicas) > 1),
            ("tensor-parallel degree", len(space.degrees) > 1),
            ("expert-parallel degree", len(space.eps) > 1),
            ("context-parallel degree", len(space.cps) > 1),
            # named only where a layout needed more than one pass (else the search is the one-pass one)
            ("pipeline passes", any(c.layout.accumulation > 1 for c in outcome.results)),
        )
        if is_open
    ]
    show = len(space.replicas) > 1 or len(space.degrees) > 1 or best.layout.dp > 1 or best.layout.tp > 1
    note = _why(polished, best, ranked, open_parts, show_dp=show, beaten=beaten, start=start)
    if outcome.pruned:
        note += f"; {outcome.pruned} more layouts ruled out unsolved (their lower bound on the step was slower)"
    # the list shows the winner first, as it will run: with its polished split (a runner-up may have won)
    return polished, [polished] + [c for c in ranked if c is not best], note


CLOSEST_TRIED = 6
"""When nothing fits, this many of the layouts that could not be split within the limit (those with
the least memory floor) are solved without it, to name the closest one."""


def _gib(nbytes: float) -> str:
    """GiB with two decimals, or three significant digits below 0.1 GiB (so a tiny limit is not "0.00")."""
    gib = nbytes / 2**30
    return f"{gib:.2f}" if gib >= 0.1 else f"{gib:.3g}"


def describe(layout: Layout) -> str:
    """A layout in one phrase: "1f1b, pp=8, m=64, k=2 passes, dp=8 (fsdp), tp=8" (what is 1 left out)."""
    text = f"{layout.schedule}, pp={layout.pp}, m={layout.n_microbatches}" + _passes(layout)
    text += f", {layout.stages_per_rank} stages per rank" if layout.stages_per_rank > 1 else ""
    text += f", dp={layout.data_replicas} ({dp_label(layout)})" if layout.dp > 1 else ""
    return text + _tp_text(layout)


def _tp_text(layout: Layout) -> str:
    """ ", tp=8" or ", tp=8 with sequence parallelism", or ", ep=8": a layout's tensor and expert
    parallelism, where over 1."""
    ep = f", ep={layout.ep}" if layout.ep > 1 else ""
    ep += f", cp={layout.cp}" + (" (ring attention)" if layout.cp_attention == "ring" else "") if layout.cp > 1 else ""
    if layout.tp == 1:
        return ep
    return ep + f", tp={layout.tp}" + (" with sequence parallelism" if layout.sequence else "")


def dp_label(layout: Layout) -> str:
    """How the layout's replicas reduce: "ddp", "fsdp", "fsdp per block" or "hsdp in groups of 4"."""
    mode = f"hsdp in groups of {layout.dp_shard}" if layout.dp_mode == "hsdp" else layout.dp_mode
    return f"{mode} per block" if layout.per_block else mode


def _nothing_fits(outcome: _Outcome, cluster: Cluster, constraints: Constraints) -> InfeasibleError:
    """The error for a search in which nothing fits the memory limit: the closest layout (the least
    memory any evaluated candidate needs, or any of the ``CLOSEST_TRIED`` most promising ones left
    unsolved or unsplittable needs: solved as the search would have, else without the limit) and how
    far over the limit it is."""
    limit = constraints.memory_limit_bytes
    assert limit is not None
    if outcome.layouts == 1 and outcome.errors:
        return outcome.errors[0]  # one layout asked for: the solver's own reason names what does not fit
    needs = [(c.prediction.max_memory_bytes, c.layout) for c in outcome.results]
    # without the limit the solver would recompute nowhere; the closest layout recomputes where allowed
    recompute = "full" if constraints.recompute == "auto" else constraints.recompute
    free = replace(constraints, memory_limit_bytes=None, recompute=recompute)
    for item in sorted(outcome.unfit, key=lambda p: (p.memory_floor, p.layout.n_microbatches))[:CLOSEST_TRIED]:
        # under the limit the least memory a split needs (a layout its memory floor left unsolved may
        # have one), else the solver's split without it
        for asked in (constraints, free):
            try:
                c = evaluate_modes(item.blocks, cluster, item.layout, asked)
            except InfeasibleError:
                continue
            needs.append((c.prediction.max_memory_bytes, c.layout))
            break
    if not needs:
        if outcome.errors:
            return outcome.errors[0]
        return InfeasibleError("nothing to search: no layout of these ranks and batch can run")
    # ties (a tiny model's layouts may need the same bytes) go to the first layout by name, so the message
    # does not depend on the order in which measured costs let the search reach them
    need, layout = min(needs, key=lambda nl: (nl[0], describe(nl[1])))
    hints = ["raise --memory-limit", "use more --gpus"]
    hints += ["--recompute auto"] if constraints.recompute == "never" else []
    # a 0-byte limit (plan_from_costs given one; PlanRequest refuses it) is no base for a "% over"
    over = f" ({need / limit - 1:.0%} over)" if limit > 0 else ""
    return InfeasibleError(
        f"no layout fits the {_gib(limit)} GiB memory limit: the closest, {describe(layout)}, needs "
        f"{_gib(need)} GiB per rank{over}; " + ", ".join(hints)
    )


def _rank(results: Sequence[Choice], errors: Sequence[InfeasibleError]) -> tuple[Choice, list[Choice]]:
    """The winner and every candidate, winner first, then those that fit by step time, then the rest.

    Within ``TIE`` of the fastest the steps are equal for every purpose: the winner is the one with
    the least memory among them, then the one with fewer data-parallel replicas (the simpler: fewer
    processes to a pipeline's batch, no gradient reduction), then the earlier schedule in
    ``SCHEDULES`` (the simpler; candidates come in that order within a replica count).

    Raises:
        InfeasibleError: nothing fits (naming the least any candidate needs), or nothing could be
            evaluated (the first candidate's own reason).
    """
    fitting = [c for c in results if c.fits]
    if not fitting:
        if results:
            least = min(results, key=lambda c: c.prediction.max_memory_bytes)
            lay = least.layout
            replicas = f", dp={lay.data_replicas} ({dp_label(lay)})" if lay.dp > 1 else ""
            raise InfeasibleError(
                f"no schedule, microbatch count and split fits the memory limit: the least needs "
                f"{least.prediction.max_memory_bytes / 2**30:.2f} GiB per rank ({lay.schedule}, "
                f"m={lay.n_microbatches}{_passes(lay)}{replicas}); raise --memory-limit, use more --gpus or --recompute auto"
            )
        raise errors[0] if errors else InfeasibleError("nothing to search: no schedule was given")
    fastest = min(c.prediction.step_time_s for c in fitting)
    best = min(
        (c for c in fitting if c.prediction.step_time_s <= fastest * (1 + TIE)),
        key=lambda c: (c.prediction.max_memory_bytes, c.layout.dp),
    )
    ranked = (
        [best]
        + sorted((c for c in fitting if c is not best), key=lambda c: c.prediction.step_time_s)
        + sorted((c for c in results if not c.fits), key=lambda c: c.prediction.step_time_s)
    )
    return best, ranked


def _passes(layout: Layout) -> str:
    """ ", k=8 passes": a layout's pipeline passes per step, when over 1."""
    return f", k={layout.accumulation} passes" if layout.accumulation > 1 else ""


def _replicas_text(c: Choice) -> str:
    """ ", dp=2 (ddp)": a candidate's replicas (and its tensor-parallel degree, when over 1), for the
    line on why the choice won."""
    return f", dp={c.layout.data_replicas} ({dp_label(c.layout)})" + _tp_text(c.layout)


def _why(
    chosen: Choice,
    unpolished: Choice,
    ranked: Sequence[Choice],
    open_parts: Sequence[str],
    *,
    show_dp: bool = False,
    beaten: tuple[Choice, Choice] | None = None,
    start: str = "",
) -> str:
    """One line: what won, by how much over the runner-up (``beaten``: the ranked winner, split and
    polished, where a runner-up polished faster), and what polishing the split gained (from a
    baseline's split where it started there: ``start``, that split in words)."""
    lay = chosen.layout
    what = f"{lay.schedule}, m={lay.n_microbatches}{_passes(lay)}" + (
        f", {lay.stages_per_rank} stages per rank" if lay.stages_per_rank > 1 else ""
    )
    what += _replicas_text(chosen) if show_dp else ""
    line = f"{what}: predicted step {chosen.prediction.step_time_s * 1e3:.3g} ms"
    others = [c for c in ranked if c.fits and c is not unpolished]
    if open_parts and others:
        nxt = others[0] if beaten is None else beaten[0]
        gain = nxt.prediction.step_time_s / unpolished.prediction.step_time_s - 1
        if beaten is not None:  # both polished: the runner-up's polished split won
            gain = beaten[1].prediction.step_time_s / chosen.prediction.step_time_s - 1
        runner_up = (
            f"{nxt.layout.schedule}, m={nxt.layout.n_microbatches}{_passes(nxt.layout)}"
            f"{', v=' + str(nxt.layout.stages_per_rank) if nxt.layout.stages_per_rank > 1 else ''}"
            f"{_replicas_text(nxt) if show_dp else ''}"
        )
        if gain < TIE:
            searched_dp = "data-parallel replicas" in open_parts
            kept = "less memory, fewer replicas, or" if searched_dp else "less memory, or"
            kept += " the simpler schedule"
            line += f", tied with {runner_up} (kept: {kept})"
        else:
            line += f", {gain:.1%} faster than the next best ({runner_up})"
            line += ", both splits polished" if beaten is not None else ""
        line += f"; {len(ranked)} candidates searched over {', '.join(open_parts)}"
    if chosen.prediction.starts != unpolished.prediction.starts:
        gain = 1 - chosen.prediction.step_time_s / unpolished.prediction.step_time_s
        if start:  # (as ``planner.core.assemble`` says where the winner's own baseline split was kept)
            line += f"; {start} is {gain:.1%} faster by the simulated step than the solver's least-bottleneck "
            line += "split, so the plan uses it"
        else:
            line += f"; moving cuts against the simulated step saved {gain:.1%} over the least-bottleneck split"
    return line


def _polished_best(
    best: Choice, ranked: Sequence[Choice], cluster: Cluster, constraints: Constraints
) -> tuple[Choice, Choice, tuple[Choice, Choice] | None, str]:
    """The winner after polishing (``refine``): the ranked winner's polished split, unless a runner-up
    within ``REFINE_MARGIN`` of it (at most ``REFINE_RIVALS`` of them) polishes to a step faster beyond
    ``TIE``; polishing may move a layout by a few percent, so the winner is chosen after it, not before.
    A winner in several passes is also polished against the one-pass layout it was retried from
    (``unlimited_step``): that one's split is the one the memory limit unbalanced, which is what
    polishing moves, so it may gain more than the margin.

    Each layout is polished from the solver's split and from any baseline's that steps faster (``_polish``).

    Returns:
        (the winner as the solver split it, the winner polished, where a runner-up won so the ranked
        winner as split and polished, else None, and the baseline's split the winner's polish
        started from, in words, else "").
    """
    polished, start = _polish(best, cluster, constraints)
    first = (best, polished)
    rivals = [c for c in ranked if c.fits and c is not best]
    near = [c for c in rivals if c.prediction.step_time_s < polished.prediction.step_time_s * (1 + REFINE_MARGIN)]
    near = near[:REFINE_RIVALS]
    parents = [c for c in rivals if one_pass_of(best.layout, c.layout) and all(c is not r for r in near)]
    for rival in near + parents:
        tried, name = _polish(rival, cluster, constraints)
        if tried.prediction.step_time_s < polished.prediction.step_time_s * (1 - TIE):
            best, polished, start = rival, tried, name
    return best, polished, None if best is first[0] else first, start


def _polish(choice: Choice, cluster: Cluster, constraints: Constraints) -> tuple[Choice, str]:
    """``refine`` of the solver's split and of every baseline's (equal layer counts, balanced
    parameters: ``planner.core.split.baselines``) that fits and steps faster than it, the fastest.
    The solver minimises the slowest stage and polishing moves one cut at a time, which can miss a
    split that shifts several cuts at once; ``planner.core.assemble`` keeps such a baseline split for
    the winner, and polishing every compared layout from it too lets it win where its layout was a
    runner-up. Baselines never recompute: only under ``--recompute auto`` or ``never``.

    Returns:
        The polished choice, and the baseline's split it was polished from, in words (else "").
    """
    best, start = refine(choice, cluster, constraints), ""
    if constraints.recompute not in ("auto", "never"):
        return best, start
    layout = choice.layout
    link = layout_links(cluster.link, layout.pp, layout.dp, layout.tp, layout.pp_outer)
    for name, split in baseline_splits(choice.blocks, layout.n_stages, link).items():
        try:
            begun = evaluate_choice(choice.blocks, cluster, layout, constraints, split)
        except InfeasibleError:
            continue
        if not begun.fits or begun.prediction.step_time_s >= choice.prediction.step_time_s * (1 - 1e-9):
            continue
        polished = refine(begun, cluster, constraints)
        if polished.prediction.step_time_s < best.prediction.step_time_s * (1 - 1e-9):
            moved = polished.prediction.starts != begun.prediction.starts
            best, start = polished, f"the {BASELINE_NAMES[name]} split" + (" with cuts moved" if moved else "")
    return best, start


def refine(choice: Choice, cluster: Cluster, constraints: Constraints, budget: int = REFINE_EVALUATIONS) -> Choice:
    """Polish a split against the simulated step: move one cut by one legal position at a time, keeping
    each move that shortens the predicted step and still fits (first improvement, cuts in order,
    until a whole pass finds none or ``REFINE_EVALUATIONS`` splits were simulated).

    The solver minimises the slowest stage, which bounds the steady state; the step also has the
    warm-up and drain, where earlier and later stages weigh differently, messages and the optimizer.
    Starting from the exact least-bottleneck split, this only ever accepts a split the simulator
    predicts to be faster, so the result is never slower than ``choice``. Its layout (replicas and
    their mode included) is kept, and so are its stages' recompute flags.

    Returns:
        The polished choice (``choice`` itself when no move helps).
    """
    blocks = choice.blocks
    n = len(blocks)
    best = choice
    recompute = choice.split.recompute
    memo = StageMemo()  # a move changes two stages: the others are laid out once for the whole polish
    improved = True
    while improved and budget > 0:
        improved = False
        for k in range(1, best.split.n_stages):
            for step in (-1, 1):
                starts = list(best.split.starts)
                c = starts[k] + step
                hi = starts[k + 1] if k + 1 < len(starts) else n
                if not starts[k - 1] < c < hi or not blocks[c - 1].cut_legal or budget <= 0:
                    continue
                budget -= 1
                trial = Split(starts=(*starts[:k], c, *starts[k + 1 :]), recompute=recompute)
                try:
                    cand = evaluate_choice(blocks, cluster, best.layout, constraints, trial, memo)
                except InfeasibleError:
                    continue
                # a strict improvement beyond float noise, so the descent cannot cycle
                if cand.fits and cand.prediction.step_time_s < best.prediction.step_time_s * (1 - 1e-9):
                    best = cand
                    improved = True
    return best


__all__ = [
    "Choice",
    "evaluate_choice",
    "evaluate_modes",
    "microbatch_options",
    "refine",
    "replica_microbatches",
    "search",
]
