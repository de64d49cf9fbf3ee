"""From block costs and a request to a plan: solve, compare with the baselines, predict, assemble.

Pure module: never imports torch. ``planner.api.make_plan`` calls it once the costs are known
(measured or estimated); the pure tests call it with hand-written costs, so the plan they check
is assembled by exactly the code the command line uses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from planner.core.layout.inputs import Asked, Cluster, Layout, Scaling, SearchSpace
from planner.core.layout.pending import Pool
from planner.core.layout.robust import Problem, robust_rows
from planner.core.layout.search import Choice, Progress, search
from planner.core.levers.data_parallel import gather_bytes_of, layout_links
from planner.core.levers.experts import expert_degrees
from planner.core.levers.links import NodeLinks
from planner.core.levers.tensor_parallel import allowed_degrees, block_degree_limit
from planner.core.split.baselines import BASELINE_NAMES, baseline_splits
from planner.core.split.cuts import Split
from planner.core.split.given import given_starts
from planner.core.split.solve import policy_options
from planner.core.step.predict import predict, slots_of
from planner.errors import InfeasibleError
from planner.schema.costs import BlockCost, LinkCost
from planner.schema.plan import ModelRef, Plan, Prediction, ProfileInfo, StagePlan, Tie

SEARCH_ROWS = 12
"""Candidates of the joint search the plan keeps (best first) for the report."""


def with_tied_copies(blocks: Sequence[BlockCost], ties: Sequence[Tie]) -> list[BlockCost]:
    """Charge every later reader of a tied parameter a copy of it: its elements, bytes (so its
    gradient and optimizer state too, through the memory model) and its share of the optimizer step.

    A stage that holds a later reader but not the owner keeps its own copy (the runner sums the
    copies' gradients). When owner and reader share a stage the copy is charged all the same: the
    solver costs blocks independently of the split, so the memory of such a stage is over-estimated
    by one copy, never under-estimated. Blocks that already carry copies are returned as they are.

    Args:
        blocks: per-block costs, each parameter counted once (in the block that first reads it).
        ties: the model's tied parameters.

    Returns:
        The blocks with the copies charged.
    """
    if not ties or any(b.tied_params for b in blocks):
        return list(blocks)
    index = {b.name: k for k, b in enumerate(blocks)}
    extra_params = [0] * len(blocks)
    extra_bytes = [0] * len(blocks)
    extra_opt = [0.0] * len(blocks)
    for tie in ties:
        owner = blocks[index[tie.blocks[0]]]
        # the owner's optimizer time per element, for the copy's share of the step
        per_param = (owner.opt_s or 0.0) / owner.params if owner.params else 0.0
        for name in tie.blocks[1:]:
            k = index[name]
            extra_params[k] += tie.params
            extra_bytes[k] += tie.param_bytes
            extra_opt[k] += per_param * tie.params
    out = []
    for k, b in enumerate(blocks):
        if not extra_params[k]:
            out.append(b)
            continue
        update: dict[str, object] = {
            "params": b.params + extra_params[k],
            "param_bytes": b.param_bytes + extra_bytes[k],
            "tied_params": extra_params[k],
        }
        if b.opt_s is not None:
            update["opt_s"] = b.opt_s + extra_opt[k]
        if b.fsdp_params is not None:  # FSDP shards the copy too
            sharded, sharded_bytes = b.fsdp_sharded()
            update["fsdp_params"] = sharded + extra_params[k]
            update["fsdp_param_bytes"] = sharded_bytes + extra_bytes[k]
        out.append(b.model_copy(update=update))
    return out


def compare_methods(
    chosen: Choice,
    asked: Asked,
    link: LinkCost,
    slots: float | None,
    given: tuple[Choice, list[int]] | None = None,
) -> dict[str, tuple[list[StagePlan], Prediction]]:
    """Every partition method's stages and prediction on the same costs, schedule and placement
    (and the same data-parallel replicas and mode).

    Args:
        chosen: the searched combination (schedule, microbatches, stages per rank, replicas, the
            optimal split).
        asked: the method the plan uses, the optimizer and the recompute policy.
        link: cost of one message between neighbouring ranks (or a ``NodeLinks``).
        slots: ranks that can compute at once (``slots_of``), None when each has its own device.
        given: the user's split (``--compare``): its stage starts and the search's choice for its
            stage count, whose layout it is costed under (``given_split``); None: none given.

    Returns:
        method -> (stages, prediction); a baseline that cannot split this model is left out.

    Raises:
        InfeasibleError: the requested method cannot split the model.
    """
    blocks, layout = chosen.blocks, chosen.layout
    n_stages = layout.n_stages
    # the links of this replica count's pipeline (a NodeLinks is placed for its ranks and replicas)
    placed = layout_links(link, layout.pp, layout.dp, layout.tp, layout.pp_outer)
    assert isinstance(placed, LinkCost)  # a link (or NodeLinks) in, the same kind out
    link = placed
    out: dict[str, tuple[list[StagePlan], Prediction]] = {"optimal": (chosen.stages, chosen.prediction)}
    # a baseline that cannot split this model is left out of the comparison, unless it is the method asked
    for name, split in baseline_splits(blocks, n_stages, link, required=asked.method).items():
        out[name] = predict(blocks, split, link, layout, asked.constraints.optimizer, slots)
    if given is not None:
        where, starts = given
        placed = layout_links(link, where.layout.pp, where.layout.dp, where.layout.tp, where.layout.pp_outer)
        recompute = asked.constraints.recompute
        policy_options(recompute, where.layout.schedule)  # selective cannot run under a zero-bubble one
        forced = recompute if recompute in ("selective", "full", "stage") else "never"
        theirs = Split(starts=tuple(starts), recompute=(forced,) * len(starts))
        out["given"] = predict(where.blocks, theirs, placed, where.layout, asked.constraints.optimizer, slots)
    return out


def given_split(
    compare: str | None, chosen: Choice, research: Callable[[SearchSpace], Choice], space: SearchSpace
) -> tuple[Choice, list[int]] | None:
    """The user's split (``--compare``) as stage starts, with the layout to cost it under: the
    chosen one when the stage counts agree, else the best the search finds for the split's stage
    count on the same pipeline ranks, replicas and tensor-parallel degree.

    Args:
        compare: the split (``--compare``; None: nothing to do).
        chosen: the searched choice.
        research: runs the search over another space.
        space: the space ``chosen`` was searched in.

    Returns:
        (the choice whose layout costs the split, its stage starts), or None without ``--compare``.

    Raises:
        InfeasibleError: the split does not fit the model, or no layout runs its stage count here.
    """
    if compare is None:
        return None
    starts = given_starts(compare, chosen.blocks)
    k, layout = len(starts), chosen.layout
    if k == layout.n_stages:
        return chosen, starts
    if k % layout.pp:
        raise InfeasibleError(
            f"--compare: the split has {k} stages, but the plan's pipelines have {layout.pp} ranks, which run a "
            f"multiple of {layout.pp} stages; give such a split, or --gpus / --dp for {k} pipeline ranks"
        )
    narrowed = replace(
        space,
        stages_per_rank=k // layout.pp,
        replicas=(layout.data_replicas,),
        dp_mode=layout.dp_mode,
        dp_shard=layout.dp_shard or space.dp_shard,
        degrees=(layout.tp,),
        fsdp_units=layout.fsdp_units,
    )
    try:
        return research(narrowed), starts
    except InfeasibleError as e:
        raise InfeasibleError(
            f"--compare: no schedule runs the split's {k} stages on {layout.pp} ranks here ({e})"
        ) from None


def search_rows(ranked: Sequence[Choice], rows: int = SEARCH_ROWS) -> list[Choice]:
    """The candidates the plan keeps for the report: the best ``rows``, with the best candidate of
    every replica count among them (so a searched ``--dp`` shows what each count reached).

    Args:
        ranked: every candidate, best first.
        rows: how many to keep (at least one per replica count, when there are more counts).

    Returns:
        The kept candidates, in ranked order.
    """
    firsts: dict[int, int] = {}
    for i, c in enumerate(ranked):
        firsts.setdefault(c.layout.dp, i)
    wanted = set(firsts.values())
    kept = set(range(min(rows, len(ranked))))
    for i in sorted(range(len(ranked)), reverse=True):  # drop the worst rows that no count needs
        if len(kept | wanted) <= rows:
            break
        if i in kept and i not in wanted:
            kept.discard(i)
    return [ranked[i] for i in sorted(kept | wanted)]


def _best_of_baselines(predictions: dict[str, tuple[list[StagePlan], Prediction]], limit: int | None) -> str:
    """Keep a baseline's split as the plan's where it fits and its simulated step is shorter than the
    solver's: the solver minimises the slowest stage under the memory limit and then moves one cut at a
    time against the simulated step, which can miss a split that shifts several cuts at once.

    Args:
        predictions: every method's stages and prediction; ``"optimal"`` is replaced in place.
        limit: the per-rank memory limit (None: none).

    Returns:
        A clause for the plan's ``choice`` line naming the baseline kept ("" when none was).
    """
    solver = predictions["optimal"][1].step_time_s
    faster = [
        (pred.step_time_s, name)
        for name, (_, pred) in predictions.items()
        if name in ("uniform", "params")
        and pred.step_time_s < solver * (1 - 1e-9)
        and (limit is None or pred.max_memory_bytes <= limit)
    ]
    if not faster:
        return ""
    step, name = min(faster)
    predictions["optimal"] = predictions[name]
    return (
        f"; the {BASELINE_NAMES[name]} split is {100 * (1 - step / solver):.1f}% faster by the simulated step than the "
        "solver's least-bottleneck split, so the plan uses it"
    )


def _check_memory(method: str, prediction: Prediction, stages: list[StagePlan], limit: int | None) -> None:
    """The baselines split by layer or parameter counts and know nothing of memory: refuse one that does not fit."""
    if limit is None or prediction.max_memory_bytes <= limit:
        return
    ranks = list(prediction.rank_memory_bytes) or [s.memory_bytes for s in stages]
    worst = max(range(len(ranks)), key=lambda r: ranks[r])
    held = [s for s in stages if s.rank == worst]
    raise InfeasibleError(
        f"the {method} split needs {ranks[worst] / 2**30:.2f} GiB on rank {worst} "
        f"({held[0].first_block} .. {held[-1].last_block}), over the {limit / 2**30:.2f} GiB limit; "
        "use --method optimal (it recomputes activations where needed) or raise --memory-limit"
    )


def tensor_parallel_degrees(asked: Asked, blocks: Sequence[BlockCost], tp_plan: dict[str, str] | None) -> list[int]:
    """The tensor-parallel degrees the search tries: those asked (divisors of a node's ranks, or
    ``--tp``) that every split block allows (``TensorParallelShare.divisor``).

    Raises:
        InfeasibleError: ``--tp N`` over 1 for a model without a tensor-parallel plan, or one whose
            split sizes N does not divide.
    """
    options = list(asked.space.degrees)
    if not tp_plan or all(b.tp is None for b in blocks):
        if options != [1] and asked.tp is not None:
            raise InfeasibleError(
                f"--tp {asked.tp}: the model declares no tensor-parallel plan (a `tp_plan` in the model file, or "
                "a Hugging Face config's base_model_tp_plan); give --tp 1 or auto"
            )
        return [1]
    degrees = allowed_degrees(blocks, options)
    if not degrees:
        raise InfeasibleError(
            f"--tp {asked.tp if asked.tp is not None else 'auto'} does not divide the model's split sizes (heads and widths: their greatest common "
            f"divisor is {block_degree_limit(blocks)}); give a divisor of it, or auto"
        )
    return degrees


@dataclass(frozen=True)
class Origin:
    """What a plan records about where its costs came from.

    Attributes:
        model: which model the costs are of.
        profile: where and how the costs were measured or estimated (``fixed_fraction`` scales
            them to other microbatch sizes).
        created: timestamp recorded in the plan.
        calibration: what a calibration changed in the costs, one line each (``--calibrate``;
            ``planner.core.step.calibrate.changes``), recorded for the report.
        experts: the model's experts modules and their counts (``Plan.experts``; empty: dense).
    """

    model: ModelRef
    profile: ProfileInfo
    created: str
    calibration: Sequence[str] = ()
    experts: Mapping[str, int] = field(default_factory=dict)


def _search_space(
    asked: Asked, blocks: Sequence[BlockCost], tp_plan: dict[str, str] | None, profile: ProfileInfo, trace: str
) -> SearchSpace:
    """The space the search covers: the one asked, its tensor-parallel degrees those the model's
    plan and the blocks allow, its sequence options those the blocks can run; FSDP gathers in the
    dtype the run computes in (``predict.plan_layout`` reads it off the plan alike)."""
    return replace(
        asked.space,
        degrees=tuple(tensor_parallel_degrees(asked, blocks, tp_plan)),
        gather_bytes=gather_bytes_of(profile),
        sequence=_sequence_options(asked, blocks),
        eps=asked.space.eps or expert_degrees(blocks, asked.world_size),
        cps=asked.space.cps or context_degrees(blocks, asked.world_size, profile.tokens_per_sample, asked, trace),
    )


AUTO_CP_LIMIT = 32  # --cp auto's largest degree (Megatron-Core's and torchtitan's published runs use up to 32)


def context_degrees(
    blocks: Sequence[BlockCost], world_size: int, tokens: int | None, asked: Asked, trace: str = "fx"
) -> tuple[int, ...]:
    """``--cp auto``'s degrees: 1, and where the model's attention reads keys and values a graph trace
    saw (``BlockCost.kv_bytes``) and its samples are sequences of token ids, every degree up to
    ``AUTO_CP_LIMIT`` that divides the ranks, twice of which divides the sequence (two blocks a rank:
    ``planner.capture.contract.sequence_length``); none above 1 compiled where the model traces by
    ``torch.export`` (``trace``: what context parallelism does not run with yet)."""
    compiled = asked.constraints.compiled and trace != "fx"
    if compiled or tokens is None or not any(b.kv_bytes for b in blocks):
        return (1,)
    fits = range(1, min(AUTO_CP_LIMIT, world_size) + 1)
    return tuple(c for c in fits if world_size % c == 0 and (c == 1 or tokens % (2 * c) == 0))


def _sequence_options(asked: Asked, blocks: Sequence[BlockCost]) -> tuple[bool, ...]:
    """Sequence parallelism's options for the search: none where no block carries a sequence share
    (the model's shards do not work token by token, ``planner.costs.tensor_parallel``, or none was
    counted) or the run is compiled; else as asked (``--sequence-parallel`` / ``--no-sequence-parallel``),
    both under auto. The chosen layout's flag is then the plan's."""
    if asked.constraints.compiled or not any(b.tp is not None and b.tp.sequence is not None for b in blocks):
        return (False,)
    return asked.space.sequence


def _hsdp_note(asked: SearchSpace, layout: Layout, link: LinkCost) -> str:
    """What became of ``--dp-mode hsdp`` when the chosen layout's one shard group holds every replica
    (recorded as FSDP); empty otherwise."""
    if asked.dp_mode != "hsdp" or layout.dp == 1 or layout.dp_mode == "hsdp":  # one replica: _one_replica_note
        return ""
    if asked.dp_shard is not None:
        why = f"--dp-shard {asked.dp_shard} is"
    elif isinstance(link, NodeLinks):
        why = "one node (--gpus-per-node) holds"
    else:
        why = "one machine (the plan has no node links: add --gpu-type and --gpus-per-node to plan for nodes) holds"
    return (
        f"; --dp-mode hsdp: {why} all {layout.dp} replicas of {layout.pp * layout.tp} rank(s) each, so the one "
        "shard group is fsdp (recorded so)"
    )


def _one_replica_note(asked: SearchSpace, layout: Layout) -> str:
    """What became of ``--dp-mode fsdp`` or ``hsdp`` when ``--dp auto`` chose one replica (``--dp 1``
    with either is refused by the request): said rather than dropped; empty otherwise."""
    if asked.dp_mode not in ("fsdp", "hsdp") or layout.dp > 1:
        return ""
    return f"; --dp-mode {asked.dp_mode}: not used, the chosen layout has one replica (dp 1), so nothing is sharded"


def _units_note(asked: SearchSpace, layout: Layout) -> str:
    """What became of ``--fsdp-units`` when the chosen layout shards nothing: one replica (``--dp auto``
    chose 1; ``--dp 1`` with it is refused by the request), or DDP replicas (``--dp-mode auto`` takes DDP
    where it fits). Said rather than dropped without a word; empty otherwise."""
    if asked.fsdp_units == "auto" or layout.shard > 1:
        return ""
    if layout.dp == 1:
        why = "one replica (dp 1), so nothing is sharded"
    else:
        why = f"{layout.dp} DDP replicas (--dp-mode auto takes DDP where it fits; give --dp-mode fsdp to shard)"
    return f"; --fsdp-units {asked.fsdp_units}: not used, the chosen layout has {why}"


def search_problem(
    asked: Asked, blocks: Sequence[BlockCost], link: LinkCost, profile: ProfileInfo, ties: Sequence[Tie] = ()
) -> Problem:
    """What ``assemble_plan`` searches on, as ``planner.core.layout.robust`` re-prices it: the blocks with
    their tied copies, the cluster, the constraints asked (their memory limit), the scaling and the batch.

    A bench compares the search's choice with a published layout so (``attribute_gap``)::

        def problem_of(request):  # each plan's own request: the blocks' tensor-parallel shares are its
            split = api.tensor_parallel_split(mf, request, costs, costs.blocks)
            asked = asked_of(api.with_step_temp_rule(request, costs.step_temp_rule), limit)
            return search_problem(asked, split.blocks, costs.link, costs.profile, costs.ties)

        gap = attribute_gap(problem_of(auto), plan_layout(choice), plan_layout(published), problem_of(given))

    Args:
        asked: what the user asked for, as core's records.
        blocks: per-block costs at the profile's microbatch size, with their tensor-parallel shares.
        link: the link between pipeline ranks (or a ``NodeLinks``).
        profile: the costs' profile (its microbatch size and scaling, its ranks' processor slots).
        ties: parameters several blocks read (``with_tied_copies``).

    Returns:
        The problem.
    """
    scaling = Scaling(
        profile.microbatch_size or asked.microbatch_size, profile.fixed_fraction, profile.min_microbatch_size
    )
    cluster = Cluster(asked.world_size, link, slots_of(profile))
    return Problem(with_tied_copies(blocks, ties), cluster, asked.constraints, scaling, asked.space.batch_size)


def _mesh_fields(layout: Layout, tp_plan: Mapping[str, str] | None, experts: Mapping[str, int]) -> dict[str, Any]:
    """The plan's fields of the chosen layout's mesh: its pipeline ranks, replicas, tensor and
    expert parallelism (``Plan``'s validation checks them together)."""
    return {
        "n_ranks": layout.pp,
        "dp": layout.data_replicas,
        "cp": layout.cp,
        "cp_attention": layout.cp_attention if layout.cp > 1 else "all-gather",
        "dp_mode": layout.dp_mode,  # "ddp", "fsdp" or "hsdp"
        "dp_shard": layout.dp_shard or None,
        "fsdp_units": layout.fsdp_units,  # "stage" or "block"
        "tp": layout.tp,
        "tp_plan": dict(tp_plan or {}) if layout.tp > 1 else {},
        "sequence_parallel": layout.sequence,  # only tried with tp > 1 and where it can run
        "loss_parallel": layout.loss_parallel,  # only with tp > 1
        "experts": dict(experts),
        "ep": layout.ep,
    }


def assemble_plan(
    asked: Asked,
    blocks: Sequence[BlockCost],
    link: LinkCost,
    origin: Origin,
    *,
    ties: Sequence[Tie] = (),
    tp_plan: dict[str, str] | None = None,
    progress: Progress | None = None,
    pool: Pool | None = None,
) -> Plan:
    """The plan for ``asked`` on these costs: the searched schedule and split, with the others for comparison.

    Args:
        asked: what the user asked for, as core's records (``planner.core.layout.inputs.asked_of``
            makes them from a ``PlanRequest``): the world size, the space to search, the
            constraints (the per-rank memory limit: the request's, else the device's capacity),
            the split method and a split to compare.
        blocks: per-block costs in execution order at ``profile.microbatch_size`` (else at
            ``asked.microbatch_size``; the last block's ``output_bytes`` filled in).
        link: cost of one message between neighbouring ranks (or a ``NodeLinks``).
        origin: the model, the profile, the timestamp and the calibration the plan records.
        ties: parameters several blocks read; their later readers are charged a copy
            (``with_tied_copies``) and the plan records them for the runner.
        tp_plan: the model's tensor-parallel plan (module-name patterns to styles), which the
            blocks' ``tp`` shares were computed from; recorded when the chosen degree is over 1.
        progress: told (layouts done, layouts in all) as the search goes, for a progress bar.
        pool: evaluates the search's next layouts together, in other processes (None: here, one
            at a time); the plan is the same.

    Returns:
        The plan.

    Raises:
        InfeasibleError: the requested split is impossible or does not fit the memory limit.
    """
    profile, slots = origin.profile, slots_of(origin.profile)
    problem = search_problem(asked, blocks, link, profile, ties)
    blocks, cluster, scaling = problem.blocks, problem.cluster, problem.scaling
    space = _search_space(asked, blocks, tp_plan, profile, origin.model.trace_method)
    memory_limit_bytes, method = asked.constraints.memory_limit_bytes, asked.method

    def run_search(limit: int | None, within: SearchSpace = space) -> tuple[Choice, list[Choice], str]:
        constraints = replace(asked.constraints, memory_limit_bytes=limit)
        return search(blocks, cluster, within, constraints, scaling, progress, pool)

    searched_limit = memory_limit_bytes
    try:
        chosen, ranked, note = run_search(memory_limit_bytes)
    except InfeasibleError:
        if method == "optimal" or memory_limit_bytes is None:
            raise
        # A baseline split ignores memory anyway: pick the schedule without the limit, then say
        # (below) how far over the limit the requested split is.
        chosen, ranked, note = run_search(None)
        searched_limit = None
    # the kept rows re-priced on slower hardware (collectives 1.3x, compute 1.1x): the report's robustness column
    rows = robust_rows(
        search_rows(ranked),
        replace(problem, constraints=replace(problem.constraints, memory_limit_bytes=searched_limit)),
    )
    given = given_split(asked.compare, chosen, lambda within: run_search(memory_limit_bytes, within)[0], space)
    if given is not None and given[0] is not chosen:  # another stage count: say which layout costs it
        lay = given[0].layout
        note += (
            f"; your split (--compare) has {lay.n_stages} stages, costed under {lay.schedule}, m={lay.n_microbatches}, "
            f"{lay.stages_per_rank} stage(s) per rank (the best layout for {lay.n_stages} stages)"
        )
    if method == "given" and given is not None:
        chosen = given[0]  # the plan runs the split under the best layout for its stage count
    note += _hsdp_note(asked.space, chosen.layout, link)
    note += _one_replica_note(asked.space, chosen.layout)
    note += _units_note(asked.space, chosen.layout)
    predictions = compare_methods(chosen, asked, link, slots, given)
    if method == "optimal" and asked.constraints.recompute in ("auto", "never"):  # (the baselines never recompute)
        note += _best_of_baselines(predictions, memory_limit_bytes)
    stages, prediction = predictions[method]
    _check_memory(method, prediction, stages, memory_limit_bytes)
    return Plan(
        created=origin.created,
        model=origin.model,
        profile=profile,
        link=link,
        optimizer=asked.constraints.optimizer,
        method=method,  # type: ignore[arg-type]  # a member of the Method choices
        schedule=chosen.layout.schedule,  # type: ignore[arg-type]  # a member of SCHEDULES
        n_stages=len(stages),
        **_mesh_fields(chosen.layout, tp_plan, origin.experts),
        batch_size=asked.space.batch_size,
        n_microbatches=chosen.layout.n_microbatches,
        accumulation=chosen.layout.accumulation,
        blocks=chosen.blocks,
        costed_microbatch_size=chosen.layout.microbatch_size(asked.space.batch_size),
        stages=stages,
        prediction=prediction,
        baselines={name: pred for name, (_, pred) in predictions.items() if name != method},
        memory_limit_bytes=memory_limit_bytes,
        search=rows,
        choice=note,
        ties=list(ties),
        compile=asked.constraints.compiled,  # the runner compiles as the plan says
        calibration=list(origin.calibration),
    )
