"""What ``planner plan`` does, as one call: ``make_plan(request)``.

The flow, one named step each: load the model file → capture and cost it (measured on this
machine's device, or estimated for hardware that is not here) → correct the costs with an earlier
run (``--calibrate``) → solve, compare and predict (``planner.core.assemble``) → the Plan.
The CLI builds the ``PlanRequest``; tests and notebooks build the same request and call this.
"""

from __future__ import annotations

import datetime as _dt
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from tqdm import tqdm

from planner.capture.blocks import GraphTrace, TracedModel
from planner.capture.contract import batch_norms
from planner.capture.ep_plan import Experts, resolve_experts
from planner.capture.expert_calls import calls_of
from planner.capture.load import ModelFile, load_model_file
from planner.capture.tp_graph import split_refusal
from planner.capture.trace import retrace
from planner.core.assemble import Origin, assemble_plan, search_problem
from planner.core.heap import bulk_allocation
from planner.core.layout.inputs import Asked, asked_of
from planner.core.layout.pending import Pool
from planner.core.layout.robust import Hardware, plan_layout, reprice
from planner.core.levers.experts import experts_refusal
from planner.core.levers.hardware import dtype_bytes
from planner.core.split.given import check_notation
from planner.core.step.calibrate import (
    apply_calibration,
    calibrated_request,
    changes,
    check_calibration,
    check_levers,
    load_calibration,
)
from planner.core.step.predict import with_links
from planner.core.step.schedules import check_placement, check_schedule, stages_per_rank_options
from planner.costs.blocks import attention_dropout
from planner.costs.experts import ExpertCosting, routed_rows, traced_rows, with_expert_shares
from planner.costs.model_costs import Costs, estimated_costs, measured_costs, say
from planner.costs.sequence import sequence_note
from planner.costs.tp_blocks import TensorParallelBlocks, tensor_parallel_blocks
from planner.errors import InfeasibleError, ModelFileError, PlanFileError, PlannerError
from planner.schema.costs import BlockCost, LinkCost, StepTempRule
from planner.schema.plan import ModelRef, Plan
from planner.schema.request import MOE_IMBALANCE, PlanRequest
from planner.workers import SearchPool


def default_threads(world_size: int) -> int:
    """Intra-op threads per rank so that ``world_size`` CPU ranks (``--gpus``: every pipeline,
    tensor-parallel and data-parallel rank on this machine) do not oversubscribe the cores."""
    return max(1, (os.cpu_count() or 1) // world_size)


def make_plan(request: PlanRequest) -> Plan:
    """Plan a pipeline for a model file: capture, cost, calibrate, solve and predict.

    Args:
        request: every option of ``planner plan`` (``PlanRequest.build(...)``).

    Returns:
        The plan (not yet written to disk).

    Raises:
        PlannerError: for any bad input (model file, sizes, unknown hardware, impossible split or
            memory limit, a calibration of another model).
    """
    check_request(request)  # before any model is built
    threads = request.threads or default_threads(request.gpus)
    size = f" (size {request.size})" if request.size else ""
    say(request, f"planning {request.model_file}{size} for {request.gpus} GPUs: loading the model file")
    mf = load_model_file(request.model_file, request.size, request.overrides)
    source = load_calibration(request.calibrate_run) if request.calibrate_run else None
    if source is not None and (source.plan.tp > 1 or (isinstance(request.tp, int) and request.tp > 1)):
        # the fit compares a run's stage times with the plan's blocks, which under tensor
        # parallelism are one tp rank's: not yet mapped back to the unsplit blocks
        raise PlanFileError(
            "--calibrate with tensor parallelism is not supported yet: calibrate on a run of a plan with tp 1, "
            "and plan without --tp (or --tp 1)"
        )
    if source is not None and (source.plan.ep > 1 or request.ep != 1):  # the same: one expert-parallel rank's
        raise PlanFileError(
            "--calibrate with expert parallelism is not supported yet: calibrate on a run of a plan with ep 1, "
            "and plan without --ep (or --ep 1)"
        )
    if source is not None:
        check_levers(source.plan, request)
        request = calibrated_request(request, source.plan, source.fit.microbatch_size)
    estimated = request.gpu_type is not None
    # An estimate builds meta tensors, graphs and numbers only: collection is paused from the trace to
    # the plan at its size, so a 1,000-layer trace is walked once, not after each phase (2.7 s less;
    # planner.core.heap). A measured profile runs real tensors with collection on but in its search.
    with bulk_allocation() if estimated else nullcontext():
        if estimated:
            costs = estimated_costs(mf, request, threads)
        else:
            costs = measured_costs(mf, request, threads, source.plan if source else None)
        blocks, link = costs.blocks, costs.link
        if source is not None:
            check_calibration(source.fit, costs.traced.fingerprint, request.microbatch_size)
            blocks, link = apply_calibration(blocks, link, source.fit)
        with search_bar(request.progress) as progress, bulk_allocation(), SearchPool(request.jobs) as pool:
            plan = plan_from_costs(
                request,
                mf,
                costs,
                blocks,
                link,
                created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                calibration=changes(source.fit) if source is not None else (),
                memory_limit_bytes=request.memory_limit_bytes
                if request.memory_limit_bytes is not None
                else costs.memory_bytes,
                progress=progress,
                pool=pool,
            )
        # Two facts only known once the search has chosen: the graph at the chosen microbatch size,
        # which the runner traces (torch needed, so not in the pure assembly), and the links as placed.
        plan = traced_as_run(plan, mf, costs.traced, request)
    return with_links(plan, link)  # a multi-node plan records both links and the ranks per node


def tensor_parallel_split(
    mf: ModelFile, request: PlanRequest, costs: Costs, blocks: list[BlockCost]
) -> TensorParallelBlocks:
    """The blocks with their tensor-parallel shares, as the search takes them.

    Args:
        mf: the loaded model file (its ``tp_plan``).
        request: the plan request (``--tp``).
        costs: the costs the blocks come from (their trace, profile and hardware).
        blocks: ``costs.blocks``, or calibrated.

    Returns:
        The split blocks, the resolved plan and the note of ``tensor_parallel_blocks``.

    Raises:
        ModelFileError: the tensor-parallel plan does not fit the model (``tensor_parallel_blocks``).
    """
    # an estimate traces the model as built (fp32) and counts every floating element (activations,
    # the all-reduced outputs, parameters) in its planning dtype; a measurement under autocast counts
    # activations in the autocast dtype
    estimated = costs.profile.source == "estimated"
    width = costs.profile.dtype if estimated else request.autocast
    return tensor_parallel_blocks(
        mf,
        request,
        costs.traced,
        blocks,
        float_bytes=dtype_bytes(width) if width else None,
        param_bytes=dtype_bytes(width) if estimated and width else None,
        hardware=costs.hardware,  # estimated: the sharded GEMMs' lower efficiency
        dtype=costs.profile.dtype,
        size=costs.profile.microbatch_size,
    )


def attention_method(request: PlanRequest, traced: TracedModel) -> PlanRequest:
    """``request`` with the context-parallel attention methods this model can run: ring attention runs
    attention without dropout, so for a model whose attention drops out ``--cp-attention auto`` plans the
    all-gather alone.

    Args:
        request: the plan request.
        traced: the captured model.

    Returns:
        The request, ``cp_attention`` narrowed where it must be.

    Raises:
        ModelFileError: ``--cp-attention ring`` for a model whose attention drops out.
    """
    if request.cp == 1 or request.cp_attention == "all-gather":
        return request
    p = attention_dropout(traced)
    if p == 0:
        return request
    if request.cp_attention == "ring":
        raise ModelFileError(
            f"--cp-attention ring: ring attention runs attention without dropout, and this model's attention drops "
            f"out (p={p:g}); plan with --cp-attention all-gather (or auto), or set its attention dropout to 0"
        )
    return request.model_copy(update={"cp_attention": "all-gather"})


def plan_from_costs(
    request: PlanRequest,
    mf: ModelFile,
    costs: Costs,
    blocks: list[BlockCost],
    link: LinkCost,
    *,
    created: str,
    calibration: Sequence[str] = (),
    memory_limit_bytes: int | None,
    progress: Callable[[int, int], None] | None = None,
    pool: Pool | None = None,
) -> Plan:
    """The search on costs already made: the blocks' tensor-parallel shares, then ``assemble_plan``
    (``make_plan``'s second half; the benches plan many requests on one profile through it too).

    Args:
        request: the plan request.
        mf: the loaded model file.
        costs: the costs (its trace, profile, hardware, ties and step temporaries' rule).
        blocks: the blocks to plan (``costs.blocks``, or calibrated).
        link: the link between pipeline ranks (``costs.link``, or calibrated).
        created: the plan's time stamp.
        calibration: what a calibration changed (recorded in the plan).
        memory_limit_bytes: the per-rank limit (None: no limit).
        progress: called with (layouts done, layouts in all) as the search goes.
        pool: evaluates the search's next layouts together (``planner.workers.SearchPool``; None:
            one at a time, here); the plan is the same.

    Returns:
        The plan, without the runner's graph and the placed links (``make_plan`` adds them).

    Raises:
        PlannerError: no layout fits, or the request cannot run on the model.
    """
    request = attention_method(request, costs.traced)
    experts = resolve_experts(mf, costs.traced.model)  # a model file's bad ep_plan: said before the search
    traced_calls = calls_of(costs.traced.gm) if isinstance(costs.traced, GraphTrace) else {}
    if request.ep != 1 and (traced_calls or request.ep != "auto"):  # auto on a dense model, or no graph: ep 1
        blocks = expert_blocks(mf, request, costs, blocks, experts)
    split = tensor_parallel_split(mf, request, costs, blocks)
    asked = asked_of(with_step_temp_rule(request, costs.step_temp_rule), memory_limit_bytes)

    def assembled(split: TensorParallelBlocks) -> Plan:
        origin = Origin(
            model_ref(mf, costs.traced, request),
            costs.profile,
            created=created,
            calibration=tuple(calibration),
            experts=experts.counts,
        )
        plan = assemble_plan(
            asked,
            split.blocks,
            link,
            origin,
            ties=costs.ties,
            tp_plan=split.plan,
            progress=progress,
            pool=pool,
        )
        given = request.moe_imbalance  # recorded so that `planner report --config` makes the plan again
        return plan.model_copy(update={"moe_imbalance": given}) if isinstance(given, float) else plan

    plan = assembled(split)
    if plan.tp > 1 and costs.traced.method == "export":  # the runner's check, made once here (an export: seconds)
        say(request, f"checking that the model traces split {plan.tp} ways (torch.export at one rank's sizes)")
    why = split_refusal(costs.traced, mf, plan.tp, plan.tp_plan, request)
    if why is not None:
        if isinstance(request.tp, int):
            raise ModelFileError(f"--tp {request.tp}: {why}; give --tp 1")
        split = TensorParallelBlocks(list(blocks), {}, f"tensor parallelism: none, {why}")
        plan = assembled(split)
    # --tp auto on a model that cannot be split: why it stays whole; why not sequence parallelism where asked or split
    for note in filter(None, [split.note, sequence_note(request, plan.tp, split.note, split.sequence_note)]):
        plan = plan.model_copy(update={"choice": f"{plan.choice}; {note}" if plan.choice else note})
    if costs.bf16_blocks is not None and plan.profile.float8 is not None:
        plan = _with_bf16_step(plan, request, mf, costs, (asked, link), experts)
    return plan


def _with_bf16_step(
    plan: Plan, request: PlanRequest, mf: ModelFile, costs: Costs, on: tuple[Asked, LinkCost], experts: Experts
) -> Plan:
    """An FP8 plan with its layout and split predicted in bf16 beside it (``Float8Linears.bf16_step_s``):
    the same blocks estimated without float8, priced as the search prices the chosen layout on ``on``
    (what was asked, the link between pipeline ranks)."""
    asked, link = on
    assert costs.bf16_blocks is not None and plan.profile.float8 is not None
    chosen = request.model_copy(update={"tp": plan.tp, "ep": plan.ep})  # the chosen degrees' shares only
    blocks = costs.bf16_blocks
    if plan.ep > 1:
        blocks = expert_blocks(mf, chosen, costs, blocks, experts)
    split = tensor_parallel_split(mf, chosen, costs, blocks)
    problem = search_problem(asked, split.blocks, link, costs.profile, costs.ties)
    try:
        step = reprice(problem, *plan_layout(plan), Hardware()).step_time_s
    except PlannerError:  # (a schedule the bf16 blocks' numbers refuse: no figure)
        return plan
    float8 = plan.profile.float8.model_copy(update={"bf16_step_s": step})
    return plan.model_copy(update={"profile": plan.profile.model_copy(update={"float8": float8})})


def expert_blocks(
    mf: ModelFile, request: PlanRequest, costs: Costs, blocks: list[BlockCost], experts: Experts
) -> list[BlockCost]:
    """The blocks with their experts' shares (``planner.costs.experts``), for ``--ep`` above 1.

    Args:
        mf: the loaded model file.
        request: the plan request (``--ep``, the profiled microbatch).
        costs: the costs the blocks come from (their traced model and dtype).
        blocks: ``costs.blocks``, or calibrated.
        experts: the model's experts.

    Returns:
        The blocks, those holding experts with their ``ExpertShare``.

    Raises:
        InfeasibleError: the model has no experts, or ``--ep`` does not divide a layer's.
        ModelFileError: the model was traced by module boundaries (no graph to dispatch in).
    """
    ep = request.ep if isinstance(request.ep, int) else 1  # auto: the search keeps to the degrees that divide
    refused = experts_refusal(ep, experts.counts)
    if refused:
        raise InfeasibleError(refused)
    traced = costs.traced
    if not isinstance(traced, GraphTrace) or set(calls_of(traced.gm)) != set(experts.counts):
        raise ModelFileError(
            f"--ep {request.ep}: the model was traced by {traced.method}, which does not show where it calls its "
            "experts; expert parallelism needs a torch.fx or torch.export graph (--ep 1 plans it)"
        )
    model = costs.traced.model
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    # routed at the blocks' own size (``tensor_parallel_split``: costs reused for other microbatches)
    inputs, _ = mf.batch(costs.profile.microbatch_size or request.microbatch_size, seed=request.seed)
    inputs = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs)
    width = costs.profile.dtype if costs.profile.source == "estimated" else request.autocast
    # the router runs where the weights are real (its loads give the imbalance); a meta model only has shapes
    routed = (traced_rows(costs.traced) if device.type == "meta" else {}) or routed_rows(model, inputs, experts.counts)
    given: float | None = request.moe_imbalance if isinstance(request.moe_imbalance, float) else None
    if given is None and any(r.loads is None for r in routed.values()):  # auto where the router did not run
        given = MOE_IMBALANCE
    hw = costs.hardware
    costing = ExpertCosting(
        act_bytes=dtype_bytes(width) if width else 4,
        hardware=hw,
        peak=hw.peak(width or "bf16") if hw is not None else 0.0,
        imbalance=given,
    )
    return with_expert_shares(blocks, experts, routed, costing)


@contextmanager
def search_bar(enabled: bool) -> Iterator[Callable[[int, int], None]]:
    """A tqdm bar over the layouts the search evaluates (shown on a terminal, hidden when piped or ``enabled``
    is false); yields the callback ``assemble_plan`` reports (layouts done, layouts in all) to.

    Args:
        enabled: the request's ``progress`` (False under ``--quiet``).

    Returns:
        A context manager yielding the callback; the bar closes when the search ends.
    """
    bar = tqdm(desc="searching layouts", unit="layout", disable=None if enabled else True, leave=False)

    def tell(done: int, total: int) -> None:
        if bar.total != total:
            bar.total = total
        bar.n = done
        bar.refresh()

    try:
        yield tell
    finally:
        bar.close()


def with_step_temp_rule(request: PlanRequest, rule: StepTempRule | None) -> PlanRequest:
    """The request with the optimizer's step temporaries combined as measured on this machine
    (``OptimizerSpec.step_temp_rule``; None: as the request says, for estimated costs).

    Args:
        request: the plan request.
        rule: how the profiled optimizer step combined its temporaries.

    Returns:
        The request, its optimizer's rule replaced when one was measured.
    """
    if rule is None:
        return request
    return request.model_copy(update={"optimizer": request.optimizer.model_copy(update={"step_temp_rule": rule})})


def traced_as_run(plan: Plan, mf: ModelFile, traced: TracedModel, request: PlanRequest) -> Plan:
    """The plan with the model's structure as ``planner run`` will trace it: at the plan's
    microbatch size, which the search may have changed from the profiled one.

    torch.export bakes sizes into the graph and specialises a dimension of 1, so the graph at one
    sample per microbatch can have other nodes than at eight; the runner traces at the plan's size
    and checks the fingerprint and every block's first and last node against the plan.

    Args:
        plan: the assembled plan.
        mf: its model file.
        traced: the model as profiled (at ``request.microbatch_size``).
        request: the plan request.

    Returns:
        The plan, its fingerprint, block nodes and split nodes those of the trace at its size.

    Raises:
        InfeasibleError: the model traces into other blocks at the plan's microbatch size.
    """
    if plan.microbatch_size == request.microbatch_size:
        return plan
    params = list(traced.model.parameters())
    device = params[0].device if params else torch.device("cpu")
    inputs, _ = mf.batch(plan.microbatch_size, seed=request.seed)
    inputs = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs)
    at_run = retrace(traced, traced.model, inputs, methods=(traced.method,))
    if isinstance(at_run, GraphTrace) and isinstance(traced, GraphTrace) and at_run.gm is traced.gm:
        # the graph was reused (an fx trace at another size): its model, blocks and nodes are
        # traced's, so are the fingerprint and block nodes (hashing both took 1 s at 1,000 layers)
        return plan
    if at_run.fingerprint == traced.fingerprint and [b.nodes for b in at_run.blocks] == [
        b.nodes for b in traced.blocks
    ]:
        return plan
    names = [b.name for b in at_run.blocks]
    if names != [b.name for b in plan.blocks]:
        raise InfeasibleError(
            f"the model traces into other blocks with microbatches of {plan.microbatch_size} samples (the search's "
            f"choice, m={plan.n_microbatches}) than with {request.microbatch_size} (profiled); give "
            f"--microbatches {request.n_microbatches}"
            + (f" --dp {request.profile_dp}" if request.dp != request.profile_dp else "")
            + " to plan at the profiled size"
        )
    blocks = [
        b.model_copy(update={"first_node": t.nodes[0], "last_node": t.nodes[-1]})
        for b, t in zip(plan.blocks, at_run.blocks)
    ]
    stages = [
        s.model_copy(update={"split_node": blocks[s.end - 1].last_node if s.end < len(blocks) else None})
        for s in plan.stages
    ]
    model = plan.model.model_copy(update={"fingerprint": at_run.fingerprint})
    return plan.model_copy(update={"model": model, "blocks": blocks, "stages": stages})


def check_request(request: PlanRequest) -> None:
    """Refuse, before any model is built, a schedule / microbatch / stages-per-rank request that
    torch's schedule classes refuse whatever the split (only when all three are given, and the
    replica count: otherwise the search tries what can run), and a ``--compare`` split written in no
    notation it reads.

    Raises:
        InfeasibleError: the schedule cannot run with these numbers, or the split cannot be read.
    """
    if request.compare is not None:
        check_notation(request.compare)
    if request.schedule == "auto" or request.dp == "auto":
        return
    pp = request.profile_pp  # the pipeline ranks of the one replica count asked for
    v = request.stages_per_rank
    if v is not None:
        check_placement(request.schedule, pp, v)
    if request.microbatches is not None:
        # the microbatch rules do not depend on v: any count the schedule runs with will do
        v = v if v is not None else stages_per_rank_options(request.schedule, 2)[-1]
        check_schedule(request.schedule, pp, request.microbatches, v)


def model_ref(mf: ModelFile, traced: TracedModel, request: PlanRequest) -> ModelRef:
    """Which model the plan is for: its path (relative to the plan's folder when under it), config,
    digest, fingerprint and how it was traced."""
    return ModelRef(
        path=str(_stored_path(mf.path, request.output.parent)),
        size=mf.size,
        config=mf.config,
        file_digest=mf.digest,
        part_digests=mf.part_digests(),
        fingerprint=traced.fingerprint,
        trace_method=traced.method,  # type: ignore[arg-type]
        trace_failures=traced.failures,
        seed=request.seed,
        expert_calls=bool(calls_of(traced.gm)) if isinstance(traced, GraphTrace) else False,
        batch_norms=batch_norms(traced.model),
    )


def _stored_path(model: Path, plan_dir: Path) -> Path:
    """The model path as the plan stores it: relative when under the plan's folder (so a project
    can move as a whole), absolute otherwise."""
    rel = Path(os.path.relpath(model, plan_dir.resolve()))
    return rel if rel.parts and rel.parts[0] != ".." else model
