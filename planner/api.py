"""What ``planner plan`` does, as one call: ``make_plan(request)``.

The flow, one named step each: load the model file → capture and cost it (measured on this
machine's device, or estimated for hardware that is not here) → correct the costs with an earlier
run (``--calibrate``) → solve, compare and predict (``planner.core.assemble``) → the Plan.
The CLI builds the ``PlanRequest``; tests and notebooks build the same request and call this.
"""

from __future__ import annotations

import datetime as _dt
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from planner.capture.blocks import GraphTrace, ModuleTrace, TracedModel
from planner.capture.contract import check_batch_contract, check_batch_size, check_forward, check_traced_forward
from planner.capture.load import ModelFile, load_model_file, move_model
from planner.capture.meta_cache import meta_build
from planner.capture.stage import stage_module
from planner.capture.tp_graph import split_refusal
from planner.capture.trace import retrace, trace_model
from planner.core.assemble import Origin, assemble_plan
from planner.core.heap import bulk_allocation
from planner.core.layout.inputs import asked_of
from planner.core.layout.pending import Pool
from planner.core.levers.hardware import HardwareSpec, dtype_bytes, node_links
from planner.core.levers.hardware_file import hardware_named
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
from planner.costs.blocks import ties_of
from planner.costs.scaling import fixed_fraction, measured_time_at
from planner.costs.sequence import sequence_note
from planner.costs.tensor_parallel import TensorParallelBlocks, tensor_parallel_blocks
from planner.errors import InfeasibleError, ModelFileError, PlanFileError
from planner.schema.bounds import too_few_blocks
from planner.schema.costs import GLOO_CPU_LINK, NCCL_NVLINK_LINK, BlockCost, LinkCost, StepTempRule
from planner.schema.plan import ModelRef, Plan, ProfileInfo, Tie
from planner.schema.request import PlanRequest
from planner.threads import torch_threads
from planner.workers import SearchPool

# Share of a GPU's memory the solver may plan for: the CUDA context, the caching allocator's
# fragmentation and NCCL buffers take the rest (~1-2 GiB and a few percent on an 80 GB card).
GPU_MEMORY_HEADROOM = 0.95


def default_threads(world_size: int) -> int:
    """Intra-op threads per rank so that ``world_size`` CPU ranks (``--gpus``: every pipeline,
    tensor-parallel and data-parallel rank on this machine) do not oversubscribe the cores."""
    return max(1, (os.cpu_count() or 1) // world_size)


@dataclass
class Costs:
    """What the cost step produced, with the facts the plan records about it.

    Attributes:
        traced: the captured model.
        blocks: per-block costs, the last block's ``output_bytes`` filled in.
        link: cost of one message between neighbouring ranks.
        profile: where and how the costs were measured or estimated.
        memory_bytes: the device capacity the solver plans for, when known.
        ties: parameters several blocks read (tied weights).
        hardware: the hardware of estimated costs (None: measured).
    """

    traced: TracedModel
    blocks: list[BlockCost]
    link: LinkCost
    profile: ProfileInfo
    memory_bytes: int | None
    ties: list[Tie] = field(default_factory=list)
    step_temp_rule: StepTempRule | None = None  # measured: how a stage's optimizer temporaries combine
    hardware: HardwareSpec | None = None


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
    _say(request, f"planning {request.model_file}{size} for {request.gpus} GPUs: loading the model file")
    mf = load_model_file(request.model_file, request.size, request.overrides)
    source = load_calibration(request.calibrate_run) if request.calibrate_run else None
    if source is not None and (source.plan.tp > 1 or (isinstance(request.tp, int) and request.tp > 1)):
        # the fit compares a run's stage times with the plan's blocks, which under tensor
        # parallelism are one tp rank's: not yet mapped back to the unsplit blocks
        raise PlanFileError(
            "--calibrate with tensor parallelism is not supported yet: calibrate on a run of a plan with tp 1, "
            "and plan without --tp (or --tp 1)"
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
    )


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
    split = tensor_parallel_split(mf, request, costs, blocks)

    def assembled(split: TensorParallelBlocks) -> Plan:
        origin = Origin(
            model_ref(mf, costs.traced, request), costs.profile, created=created, calibration=tuple(calibration)
        )
        return assemble_plan(
            asked_of(with_step_temp_rule(request, costs.step_temp_rule), memory_limit_bytes),
            split.blocks,
            link,
            origin,
            ties=costs.ties,
            tp_plan=split.plan,
            progress=progress,
            pool=pool,
        )

    plan = assembled(split)
    if plan.tp > 1 and costs.traced.method == "export":  # the runner's check, made once here (an export: seconds)
        _say(request, f"checking that the model traces split {plan.tp} ways (torch.export at one rank's sizes)")
    why = split_refusal(costs.traced, mf, plan.tp, plan.tp_plan, request)
    if why is not None:
        if isinstance(request.tp, int):
            raise ModelFileError(f"--tp {request.tp}: {why}; give --tp 1")
        split = TensorParallelBlocks(list(blocks), {}, f"tensor parallelism: none, {why}")
        plan = assembled(split)
    # --tp auto on a model that cannot be split: why it stays whole; why not sequence parallelism where asked or split
    for note in filter(None, [split.note, sequence_note(request, plan.tp, split.note, split.sequence_note)]):
        plan = plan.model_copy(update={"choice": f"{plan.choice}; {note}" if plan.choice else note})
    return plan


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


def tokens_per_sample(inputs: object) -> int | None:
    """Tokens in one sample, for tokens/s: the sequence length when the first input (positional, or
    keyword) is a batch of token ids (an integer tensor of shape (batch, seq)); None otherwise."""
    values = list(inputs.values()) if isinstance(inputs, dict) else list(inputs) if isinstance(inputs, tuple) else []
    first = values[0] if values else None
    if isinstance(first, torch.Tensor) and first.dim() == 2 and not (first.is_floating_point() or first.is_complex()):
        return int(first.shape[1])
    return None


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


def _scaling(request: PlanRequest, time_at: Callable[[int], float]) -> dict[str, float | int]:
    """The ``ProfileInfo`` fields that scale costs to other microbatch counts: the profiled size, and
    the fixed share fitted only when the search tries other sizes (``--microbatches auto``, or
    ``--dp auto``: each replica count has its own microbatch size)."""
    size = request.microbatch_size
    if not _fits_sizes(request):
        return {"fixed_fraction": 0.0, "min_microbatch_size": size, "microbatch_size": size}
    fraction, smallest = fixed_fraction(time_at, size)
    return {"fixed_fraction": fraction, "min_microbatch_size": smallest, "microbatch_size": size}


def _fits_sizes(request: PlanRequest) -> bool:
    """Whether the search tries other microbatch sizes (``--microbatches auto``, or ``--dp auto``: each
    replica count has its own), so the costs are also fitted at a second size."""
    return request.microbatches is None or request.dp == "auto"


def _timed_check(
    mf: ModelFile, model: torch.nn.Module, inputs: tuple, target: torch.Tensor, request: PlanRequest
) -> float:
    """``check_forward``, said and timed: its seconds predict how long the profile will take."""
    device = target.device
    _say(request, f"checking the model file: one forward of a microbatch of {request.microbatch_size} on the {device}")
    start = time.perf_counter()
    check_forward(mf, model, inputs, target)
    return time.perf_counter() - start


def _measured_alike(reuse: Plan, request: PlanRequest, threads: int, device: torch.device) -> bool:
    """Whether a calibrated plan's measured block costs were measured as this request would measure them."""
    same = (request.microbatch_size, threads, str(device), request.optimizer, "measured", request.autocast)
    return (
        reuse.compile == request.compile
        and (
            reuse.microbatch_size,
            reuse.profile.threads,
            reuse.profile.device,
            # the measured temporaries rule is the reused plan's, not something the user asked for
            reuse.optimizer.model_copy(update={"step_temp_rule": request.optimizer.step_temp_rule}),
            reuse.profile.source,
            reuse.profile.autocast,
        )
        == same
    )


def _say(request: PlanRequest, text: str, *, always: bool = False) -> None:
    """A line on stderr about what planning does next, never under ``-q``: the phases on a terminal
    only (as the progress bars), so the first line comes within a second of the command; ``always``
    (a profile that will take minutes, said before it starts) in a log too."""
    if text and request.progress and (always or sys.stderr.isatty()):
        tqdm.write(text, file=sys.stderr)


def _traced(
    mf: ModelFile,
    model: torch.nn.Module,
    inputs: tuple[object, ...],
    target: torch.Tensor,
    request: PlanRequest,
    *,
    on_meta: bool = False,
    checked: bool = False,
) -> TracedModel:
    """Check the model file's forward and loss once (unless ``checked``), trace the model, check it
    has enough blocks. On the meta device the forward is checked on the trace (``check_traced_forward``)."""
    if not on_meta and not checked:
        check_forward(mf, model, inputs, target)
    _say(request, f"tracing {type(model).__name__}{' on the meta device' if on_meta else ''}")
    traced = trace_model(model, inputs, copied=not on_meta)  # a meta model is built for this trace alone
    if on_meta:
        check_traced_forward(mf, traced, inputs, target)
    if isinstance(traced, ModuleTrace):
        stage_module(traced, 0, len(traced.blocks))  # every plan runs: refuse blocks that are no chain, saying why
    pp = request.min_pipeline_ranks  # the fewest pipeline ranks a replica count tried gives
    if pp > len(traced.blocks):
        raise InfeasibleError(too_few_blocks(request.gpus, request.tp, request.dp, pp, [b.name for b in traced.blocks]))
    return traced


def _with_output(blocks: list[BlockCost], traced: TracedModel) -> list[BlockCost]:
    """The last stage keeps the model's output per live microbatch until backward (memory model):
    its bytes as the profile measured or the estimate computed them (under autocast, in the planning
    dtype), else as traced."""
    if blocks[-1].output_bytes:
        return blocks
    return blocks[:-1] + [blocks[-1].model_copy(update={"output_bytes": traced.output_bytes})]


def measured_costs(mf: ModelFile, request: PlanRequest, threads: int, reuse: Plan | None) -> Costs:
    """Trace and profile on this machine's device (a CUDA GPU when there is one, else the CPU).

    Under ``--dtype bf16|fp16`` every block is profiled under ``torch.autocast`` (parameters stay
    fp32; ``ProfileInfo.autocast`` records it), under ``--compile`` as ``torch.compile`` of it.

    Args:
        mf: the loaded model file.
        request: the plan request (microbatch size, seed, optimizer, warmup, repeats, progress,
            autocast, compile).
        threads: CPU threads per rank.
        reuse: the plan a calibration was fitted to: its block costs are reused when they were
            measured under the same conditions (re-profiling would only add fresh noise).

    Returns:
        The costs.

    Raises:
        PlannerError: the device cannot autocast in the requested dtype.
    """
    from planner.costs.duration import duration_advice
    from planner.costs.levers import check_autocast
    from planner.costs.measure import profile_model
    from planner.costs.settings import ProfileSettings, Sample

    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    if request.autocast is not None:
        check_autocast(device, request.autocast)  # before the model is built
    model = move_model(mf.build(seed=request.seed), device)
    inputs, target = mf.batch(request.microbatch_size, seed=request.seed)
    inputs = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs)
    target = target.to(device)
    forward_s = _timed_check(mf, model, inputs, target, request)
    traced = _traced(mf, model, inputs, target, request, checked=True)
    check_batch_contract(mf, model, request.microbatch_size, request.seed, device)
    info = ProfileInfo(
        device=str(device),
        backend="nccl" if use_cuda else "gloo",
        threads=threads,
        torch_version=torch.__version__,
        hostname=socket.gethostname(),
        warmup=request.warmup,
        repeats=request.repeats,
        cores=None if use_cuda else os.cpu_count(),
        tokens_per_sample=tokens_per_sample(inputs),
        autocast=request.autocast,
    )
    rule: StepTempRule | None = None
    if reuse is not None and _measured_alike(reuse, request, threads, device):
        blocks = list(reuse.blocks)
        rule = reuse.optimizer.step_temp_rule
        info = info.model_copy(
            update={"compile_failures": reuse.profile.compile_failures, "compile_s": reuse.profile.compile_s}
        )
        scaling: dict[str, float | int] = {
            "fixed_fraction": reuse.profile.fixed_fraction,
            "min_microbatch_size": reuse.profile.min_microbatch_size,
            "microbatch_size": request.microbatch_size,
        }
    else:
        advice = duration_advice(
            forward_s,
            warmup=request.warmup,
            repeats=request.repeats,
            fits_sizes=_fits_sizes(request),
            n_blocks=len(traced.blocks),
            microbatch_size=request.microbatch_size,
            device=str(device),
        )
        _say(request, advice or "", always=advice is not None)
        profile = profile_model(
            traced,
            Sample(inputs, target, mf.loss_fn),
            ProfileSettings(
                warmup=request.warmup,
                repeats=request.repeats,
                threads=None if use_cuda else threads,
                progress=request.progress,
                autocast=request.autocast,
                compile=request.compile,
            ),
            optimizer=request.optimizer,
        )
        blocks = profile.costs
        rule = profile.step_temp_rule
        if request.compile:
            info = info.model_copy(
                update={"compile_failures": profile.compile_failures, "compile_s": round(profile.compile_s, 3)}
            )
        # timed at the rank's thread count, as the blocks were (more threads time erratically on shared cores)
        with torch_threads(None if use_cuda else threads):
            time_at = measured_time_at(
                mf, model, request.seed, device, max(3, request.repeats), request.warmup, request.autocast
            )
            scaling = _scaling(request, time_at)
    capacity = int(torch.cuda.get_device_properties(device).total_memory * GPU_MEMORY_HEADROOM) if use_cuda else None
    link = NCCL_NVLINK_LINK if use_cuda else GLOO_CPU_LINK
    info = info.model_copy(update=scaling)
    return Costs(traced, _with_output(blocks, traced), link, info, capacity, ties_of(traced), rule)


def _hardware(gpu_type: str, threads: int, attention: str | None) -> HardwareSpec:
    if gpu_type == "cpu":
        from planner.costs.cpu import calibrated_cpu

        return calibrated_cpu(threads)
    hw = hardware_named(gpu_type)  # a table entry, or a hardware file (planner probe -o FILE.json)
    return hw if attention is None else hw.with_attention(attention)


def estimated_costs(mf: ModelFile, request: PlanRequest, threads: int) -> Costs:
    """Build the model on the meta device (no weights allocated) and estimate its costs on ``--gpu-type``.

    Args:
        mf: the loaded model file.
        request: the plan request (``gpu_type`` set; dtype, multi-node, microbatch size, seed).
        threads: CPU threads per rank (for ``--gpu-type cpu``).

    Returns:
        The costs.
    """
    from planner.costs.estimate import costed_trace, estimate_blocks

    assert request.gpu_type is not None
    hw = _hardware(request.gpu_type, threads, request.attention_kernel)
    on_cpu = hw.kind == "cpu"
    dtype = request.dtype or ("fp32" if on_cpu else "bf16")
    with meta_build():  # no weights, no initialisation
        model = mf.build(seed=request.seed)
    check_batch_size(mf, 2 * request.microbatch_size, request.seed)  # the rest of the contract needs real data
    inputs, target = mf.batch(request.microbatch_size, seed=request.seed)
    inputs = tuple(x.to("meta") if isinstance(x, torch.Tensor) else x for x in inputs)
    target = target.to("meta")
    traced = _traced(mf, model, inputs, target, request, on_meta=True)
    costed, costed_model = costed_trace(traced, model, inputs, dtype)
    # compiled: costed as torch.compile fuses each block (planner.costs.fusion)
    on = (dtype, request.optimizer, request.progress, request.compile)  # dtype, optimizer, progress, compiled
    blocks = estimate_blocks(costed, inputs, target, mf.loss_fn, hw, *on)
    # the blocks as the run's trace names them
    blocks = [
        b.model_copy(update={"first_node": t.nodes[0], "last_node": t.nodes[-1]}) for b, t in zip(blocks, traced.blocks)
    ]
    info = ProfileInfo(
        device="cpu" if on_cpu else "cuda",
        backend="gloo" if on_cpu else "nccl",
        threads=threads if on_cpu else 1,
        torch_version=torch.__version__,
        hostname=socket.gethostname(),
        warmup=0,
        repeats=0,
        source="estimated",
        hardware=hw.name,
        attention_kernel=None if on_cpu else hw.attention_backend,
        dtype=dtype,
        cores=os.cpu_count() if on_cpu else None,
        tokens_per_sample=tokens_per_sample(inputs),
    )
    # ranks fill nodes in order: only boundaries between nodes take the inter-node network (the
    # search places the links for each replica count: planner.core.levers.data_parallel.layout_links)
    link = GLOO_CPU_LINK if on_cpu else node_links(hw, request.profile_pp, request.ranks_per_node)
    capacity = None if on_cpu else int(hw.memory_bytes * GPU_MEMORY_HEADROOM)

    def estimated_time_at(size: int) -> float:
        if size == request.microbatch_size:
            return sum(b.fwd_s + b.bwd_s for b in blocks)
        x, y = mf.batch(size, seed=request.seed)
        x = tuple(t.to("meta") if isinstance(t, torch.Tensor) else t for t in x)
        other = retrace(costed, costed_model, x)
        est = estimate_blocks(other, x, y.to("meta"), mf.loss_fn, hw, *on)
        return sum(b.fwd_s + b.bwd_s for b in est)

    scaling = _scaling(request, estimated_time_at)
    if scaling["min_microbatch_size"] > 1 and _runs_on_meta(mf, model, 1, request.seed):
        # An estimate is not a measurement: the affine fit extrapolates to any size the model runs,
        # and large runs use microbatches of one sample (one sequence). Only a model that cannot run
        # one (batch norm in training) keeps the fitted floor.
        scaling["min_microbatch_size"] = 1
    info = info.model_copy(update=scaling)
    return Costs(
        traced,
        _with_output(blocks, traced),
        link,
        info,
        capacity,
        ties_of(traced, dtype_bytes(dtype)),
        hardware=hw,
    )


def _runs_on_meta(mf: ModelFile, model: torch.nn.Module, size: int, seed: int) -> bool:
    """Whether the model's forward and loss run on a meta microbatch of ``size`` samples (shape checks
    only: nothing is computed). Batch norm in training refuses one sample per channel, say."""
    try:
        x, y = mf.batch(size, seed=seed)
        x = tuple(t.to("meta") if isinstance(t, torch.Tensor) else t for t in x)
        mf.loss_fn(model(*x), y.to("meta"))
    except Exception:  # noqa: BLE001 - any failure means "cannot run that small"
        return False
    return True


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
    )


def _stored_path(model: Path, plan_dir: Path) -> Path:
    """The model path as the plan stores it: relative when under the plan's folder (so a project
    can move as a whole), absolute otherwise."""
    rel = Path(os.path.relpath(model, plan_dir.resolve()))
    return rel if rel.parts and rel.parts[0] != ".." else model
