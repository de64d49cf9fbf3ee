"""The cost step of planning: a loaded model file traced and costed, measured on this machine's device
or estimated on the meta device for ``--gpu-type`` (``Costs``), with the facts the plan records of how.

``planner.api.make_plan`` runs it between loading the model file and the search; the benches and
tests call ``estimated_costs`` / ``measured_costs`` to plan many requests on one profile.
"""

from __future__ import annotations

import copy
import os
import socket
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from planner.capture.attention import attention_kept_whole
from planner.capture.blocks import GraphTrace, ModuleTrace, TracedModel
from planner.capture.contract import (
    check_batch_contract,
    check_batch_size,
    check_forward,
    check_traced_forward,
    check_trainable,
    sequence_length,
)
from planner.capture.ep_plan import resolve_experts
from planner.capture.float8 import check_float8, convert_model, emulated, float8_shares, linear_layers, require_torchao
from planner.capture.load import ModelFile, load_model_file, move_model
from planner.capture.meta_cache import meta_build
from planner.capture.stage import stage_inputs, stage_module
from planner.capture.trace import retrace, trace_model
from planner.core.levers.float8 import compute_dtype, float8_recipe, fsdp_float8_gather, kept_layers
from planner.core.levers.hardware import HardwareError, HardwareSpec, dtype_bytes, node_links
from planner.core.levers.hardware_file import hardware_named
from planner.costs.blocks import ties_of
from planner.costs.scaling import fixed_fraction, measured_time_at, second_size
from planner.errors import InfeasibleError, ModelFileError, PlannerError
from planner.schema.bounds import too_few_blocks
from planner.schema.costs import GLOO_CPU_LINK, NCCL_NVLINK_LINK, BlockCost, LinkCost, StepTempRule
from planner.schema.plan import Plan, ProfileInfo, Tie
from planner.schema.plan_parts import Float8Linears
from planner.schema.request import PlanRequest
from planner.threads import torch_threads
from planner.workers import Background

SIZE_AHEAD_MODULES = 500
"""An estimated model of at least this many modules (tens of transformer layers: Llama 3 70B has
1,047, DeepSeek-V3 1,215; GPT-2 small 164) is costed at its scaling fit's second microbatch size in
a worker process while this one traces it (``cost_at_size``): each trace of such a model takes
seconds (DeepSeek-V3's, 11 s on this project's 2-core CI machine)."""

# Share of a GPU's memory the solver may plan for: the CUDA context, the caching allocator's
# fragmentation and NCCL buffers take the rest (~1-2 GiB and a few percent on an 80 GB card).
GPU_MEMORY_HEADROOM = 0.95


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
        bf16_blocks: an estimate in float8 (``--dtype fp8``): the same blocks with every layer in bf16,
            to price the chosen layout without float8 (None otherwise).
    """

    traced: TracedModel
    blocks: list[BlockCost]
    link: LinkCost
    profile: ProfileInfo
    memory_bytes: int | None
    ties: list[Tie] = field(default_factory=list)
    step_temp_rule: StepTempRule | None = None  # measured: how a stage's optimizer temporaries combine
    hardware: HardwareSpec | None = None
    bf16_blocks: list[BlockCost] | None = None


def tokens_per_sample(inputs: object) -> int | None:
    """Tokens in one sample, for tokens/s: the sequence length when the first input (positional, or
    keyword) is a batch of token ids (an integer tensor of shape (batch, seq)); None otherwise."""
    values = list(inputs.values()) if isinstance(inputs, dict) else list(inputs) if isinstance(inputs, tuple) else []
    first = values[0] if values else None
    if isinstance(first, torch.Tensor) and first.dim() == 2 and not (first.is_floating_point() or first.is_complex()):
        return int(first.shape[1])
    return None


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
    say(request, f"checking the model file: one forward of a microbatch of {request.microbatch_size} on the {device}")
    start = time.perf_counter()
    check_forward(mf, model, inputs, target)
    return time.perf_counter() - start


def _measured_alike(reuse: Plan, request: PlanRequest, threads: int, device: torch.device) -> bool:
    """Whether a calibrated plan's measured block costs were measured as this request would measure them."""
    same = (request.microbatch_size, threads, str(device), request.optimizer, "measured", request.autocast)
    return (
        reuse.compile == request.compile
        and (reuse.profile.float8 is None) == (float8_recipe(request.dtype) is None)
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


def say(request: PlanRequest, text: str, *, always: bool = False) -> None:
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
    elif on_meta:  # (the trace's own check runs its loss only)
        check_trainable(mf, model)
    say(request, f"tracing {type(model).__name__}{' on the meta device' if on_meta else ''}")
    # expert (and context) parallelism's stages replace the experts' calls: the trace records them as the run's will
    experts = tuple(resolve_experts(mf, model).counts) if request.ep != 1 or request.cp != 1 else ()
    traced = trace_model(model, inputs, copied=not on_meta, experts=experts)  # a meta model: for this trace alone
    if on_meta:
        check_traced_forward(mf, traced, inputs, target)
    if isinstance(traced, ModuleTrace):
        stage_module(traced, 0, len(traced.blocks))  # every plan runs: refuse blocks that are no chain, saying why
    if isinstance(request.cp, int) and request.cp > 1:  # the runner follows the sequence's chunks through a graph
        sequence_length(stage_inputs(inputs), request.cp)
        if isinstance(traced, ModuleTrace):
            raise ModelFileError(
                f"--cp {request.cp}: context parallelism follows the sequence's chunks through a traced graph, but "
                "this model traces by module boundaries only; plan without --cp"
            )
        if request.compile and traced.method == "export":
            raise ModelFileError(
                f"--cp {request.cp} with --compile: context parallelism runs compiled on graphs torch.fx traces, and "
                "this model traces by torch.export; plan without --compile"
            )
        whole = attention_kept_whole(traced.gm) if isinstance(traced, GraphTrace) else []
        if whole:  # ring attention replaces the graph's attention calls: one inside a module is not seen
            raise ModelFileError(
                f"--cp {request.cp}: context parallelism runs each scaled_dot_product_attention call of the traced "
                f"graph over the ring, but module {whole[0][0]!r} ({whole[0][1]}; "
                f"{len(whole)} such) runs nn.MultiheadAttention inside, which torch.fx keeps whole: its attention "
                "would see only its rank's chunk; plan without --cp, or "
                "write the attention with torch.nn.functional.scaled_dot_product_attention"
            )
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
    from planner.costs.measure import profile_model
    from planner.costs.settings import ProfileSettings, Sample

    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    _check_levers(device, request)  # before the model is built
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
        float8=float8_linears(request.dtype, traced, use_cuda),
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
        say(request, advice or "", always=advice is not None)
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
                float8=info.float8,
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
            timed, repeats = _float8_copy(model, info.float8, device), max(3, request.repeats)
            time_at = measured_time_at(mf, timed, request.seed, device, repeats, request.warmup, request.autocast)
            scaling = _scaling(request, time_at)
    capacity = int(torch.cuda.get_device_properties(device).total_memory * GPU_MEMORY_HEADROOM) if use_cuda else None
    link = NCCL_NVLINK_LINK if use_cuda else GLOO_CPU_LINK
    info = info.model_copy(update=scaling)
    blocks = _with_float8_shares(blocks, traced, info.float8)
    return Costs(traced, _with_output(blocks, traced), link, info, capacity, ties_of(traced), rule)


def _renamed(blocks: list[BlockCost], traced: TracedModel) -> list[BlockCost]:
    """The blocks as the run's trace names them (an estimate may cost a second trace of the model)."""
    return [
        b.model_copy(update={"first_node": t.nodes[0], "last_node": t.nodes[-1]}) for b, t in zip(blocks, traced.blocks)
    ]


def _with_float8_shares(blocks: list[BlockCost], traced: TracedModel, float8: Float8Linears | None) -> list[BlockCost]:
    """The blocks with the share of their parameters FSDP gathers in float8 (``fsdp_float8_gather``:
    a tensorwise float8 plan's layers), as the run's FSDP would if the search shards them."""
    if float8 is None or not fsdp_float8_gather(float8.recipe, "fsdp"):
        return blocks
    shares = float8_shares(traced, float8)
    return [b.model_copy(update={"float8_share": share}) for b, share in zip(blocks, shares)]


def _float8_copy(model: torch.nn.Module, float8: Float8Linears | None, device: torch.device) -> torch.nn.Module:
    """The model as a float8 plan trains it (a converted copy: its size scaling is timed so, the many small
    operators of torchao's casts included), or the model itself without float8."""
    if float8 is None:
        return model
    converted = copy.deepcopy(model)
    convert_model(converted, float8, emulated(device))
    return converted


def _check_levers(device: torch.device, request: PlanRequest) -> None:
    """Refuse, in one line, an autocast dtype or float8 training the device cannot run."""
    from planner.costs.levers import check_autocast

    if request.autocast is not None:
        check_autocast(device, request.autocast)
    if float8_recipe(request.dtype) is not None:
        check_float8(device, request.compile)


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
    assert request.gpu_type is not None
    hw = _hardware(request.gpu_type, threads, request.attention_kernel)
    dtype: str = request.dtype or ("fp32" if hw.kind == "cpu" else "bf16")
    if float8_recipe(dtype) is not None and "fp8" not in hw.peak_flops:
        raise HardwareError(
            f"--dtype {dtype}: {hw.name} has no FP8 tensor cores (its spec has peaks for {', '.join(hw.peak_flops)}, "
            "none for fp8); plan it with --dtype bf16, or for an FP8 GPU (h100, h200, l40s, l4, mi300x), or give "
            "a hardware file an fp8 peak"
        )
    dtype = compute_dtype(dtype)  # fp8: bf16 around the float8 GEMMs
    with meta_build():  # no weights, no initialisation
        model = mf.build(seed=request.seed)
    check_batch_size(mf, 2 * request.microbatch_size, request.seed)  # the rest of the contract needs real data
    inputs, target = _meta_batch(mf, request.microbatch_size, request.seed)
    ahead = _size_ahead(request, model, threads, dtype)
    try:
        return _estimated(mf, request, threads, model, (inputs, target), hw, dtype, ahead)
    finally:
        if ahead is not None:
            ahead[1].close()


def _meta_batch(mf: ModelFile, size: int, seed: int) -> tuple[tuple[object, ...], torch.Tensor]:
    """The model file's batch of ``size`` samples, its tensors on the meta device."""
    inputs, target = mf.batch(size, seed=seed)
    return tuple(x.to("meta") if isinstance(x, torch.Tensor) else x for x in inputs), target.to("meta")


@dataclass(frozen=True)
class SizeJob:
    """What a worker needs to cost the model at another microbatch size (``cost_at_size``).

    Attributes:
        request: the plan request (the model file, its size and settings, the hardware, the seed).
        threads: CPU threads per rank (for ``--gpu-type cpu``).
        size: the microbatch size.
        dtype: the planning dtype, 16-bit: the model is costed cast to it.
    """

    request: PlanRequest
    threads: int
    size: int
    dtype: str


def cost_at_size(job: SizeJob) -> float:
    """Seconds of one forward and backward of a microbatch of ``job.size``, as ``estimated_costs``
    costs them for a model it traces with torch.export in a 16-bit dtype (``costed_trace``): the
    model built on the meta device, cast to the dtype, traced at that size and estimated. Made in a
    worker process (``planner.workers.Background``) while the planner traces the model.

    Args:
        job: the model, the size and the dtype.

    Returns:
        Seconds.

    Raises:
        Exception: what the trace or the estimate raises at that size (the model cannot run it).
    """
    from planner.costs.estimate import TORCH_DTYPES, estimate_blocks

    request = job.request
    assert request.gpu_type is not None
    mf = load_model_file(request.model_file, request.size, request.overrides)
    hw = _hardware(request.gpu_type, job.threads, request.attention_kernel)
    with meta_build():
        model = mf.build(seed=request.seed)
    cast = move_model(model, dtype=TORCH_DTYPES[job.dtype])
    x, y = _meta_batch(mf, job.size, request.seed)
    costed = trace_model(cast, x)  # the tracers ``retrace`` tries
    float8 = float8_linears(request.dtype, costed, hw.kind == "gpu")
    on = (job.dtype, request.optimizer, False, request.compile)
    blocks = estimate_blocks(costed, x, y, mf.loss_fn, hw, *on, float8=float8)
    return sum(b.fwd_s + b.bwd_s for b in blocks)


def _size_ahead(
    request: PlanRequest, model: torch.nn.Module, threads: int, dtype: str
) -> tuple[int, Background] | None:
    """For a large model planned in a 16-bit dtype whose costs are fitted at a second size, that
    size costed in a worker from now on (``SIZE_AHEAD_MODULES``); None otherwise."""
    if not _fits_sizes(request) or dtype in ("fp32", "tf32"):
        return None
    if sum(1 for _ in model.modules()) < SIZE_AHEAD_MODULES:
        return None
    size = second_size(request.microbatch_size)
    return size, Background(cost_at_size, SizeJob(request, threads, size, dtype))


def _estimated(
    mf: ModelFile,
    request: PlanRequest,
    threads: int,
    model: torch.nn.Module,
    batch: tuple[tuple[object, ...], torch.Tensor],
    hw: HardwareSpec,
    dtype: str,
    ahead: tuple[int, Background] | None,
) -> Costs:
    """``estimated_costs`` once the model is built (``ahead``: a second size costed in a worker)."""
    from planner.costs.estimate import costed_trace, estimate_blocks

    inputs, target = batch
    on_cpu = hw.kind == "cpu"
    traced = _traced(mf, model, inputs, target, request, on_meta=True)
    costed, costed_model = costed_trace(traced, model, inputs, dtype)
    float8 = float8_linears(request.dtype, traced, not on_cpu)
    # compiled: costed as torch.compile fuses each block (planner.costs.fusion)
    on = (dtype, request.optimizer, request.progress, request.compile)  # dtype, optimizer, progress, compiled
    blocks = estimate_blocks(costed, inputs, target, mf.loss_fn, hw, *on, float8=float8)
    blocks = _renamed(blocks, traced)
    blocks = _with_float8_shares(blocks, costed, float8)
    # does float8 pay: the same blocks in bf16 (the layers' own casts and GEMMs), for the chosen layout
    bf16 = None if float8 is None else estimate_blocks(costed, inputs, target, mf.loss_fn, hw, *on)
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
        float8=float8,
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
        if ahead is not None and size == ahead[0] and costed is not traced:  # the cast export graph's: the worker's
            try:
                return float(ahead[1].result())
            except Exception:  # noqa: BLE001, S110 - made here: the size's own failure, or the worker's trouble
                pass
        x, y = _meta_batch(mf, size, request.seed)
        other = retrace(costed, costed_model, x)
        est = estimate_blocks(other, x, y, mf.loss_fn, hw, *on, float8=float8)
        return sum(b.fwd_s + b.bwd_s for b in est)

    scaling = _scaling(request, estimated_time_at)
    if scaling["min_microbatch_size"] > 1 and _runs_one(mf, model, costed, costed_model, request.seed):
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
        bf16_blocks=None if bf16 is None else _with_output(_renamed(bf16, traced), traced),
    )


def _runs_one(
    mf: ModelFile, model: torch.nn.Module, costed: TracedModel, costed_model: torch.nn.Module, seed: int
) -> bool:
    """Whether the model runs a microbatch of one sample on the meta device: its forward and loss
    run (shape checks only: nothing is computed; batch norm in training refuses one sample per
    channel, say), or, where they do not run eagerly on meta, the costs' trace retraces at that size.
    transformers' MoE experts loop over the experts the router hit (``Tensor.item`` refused on meta)
    or run grouped GEMMs that refuse fp32 operands, but trace as a whole (one more trace: the
    plan's costs and the search's microbatches then reach one sample, as large MoE runs train)."""
    x, y = mf.batch(1, seed=seed)
    x = tuple(t.to("meta") if isinstance(t, torch.Tensor) else t for t in x)
    try:
        mf.loss_fn(model(*x), y.to("meta"))
        return True
    except Exception:  # noqa: BLE001, S110 - not eagerly on meta: the trace says
        pass
    try:
        retrace(costed, costed_model, x)
    except Exception:  # noqa: BLE001 - any failure means "cannot run that small"
        return False
    return True


def float8_linears(dtype: str | None, traced: TracedModel, small_filter: bool) -> Float8Linears | None:
    """The plan's float8 layers for ``--dtype``: which of the traced model's linear layers convert.

    Args:
        dtype: the request's ``--dtype``.
        traced: the model's trace.
        small_filter: apply torchao's size thresholds (a GPU plan: ``planner.core.levers.float8.too_small``).

    Returns:
        The record (None: not an FP8 dtype).

    Raises:
        PlannerError: torchao is missing, or no linear layer of the model converts.
        TraceError: the model was traced by module boundaries.
    """
    recipe = float8_recipe(dtype)
    if recipe is None:
        return None
    require_torchao()
    layers = linear_layers(traced)
    kept = kept_layers(layers, recipe, small_filter)
    if len(kept) == len(layers):
        why = Counter(kept.values()).most_common(1)[0][0] if kept else "the model has none"
        raise PlannerError(
            f"--dtype {dtype}: none of the model's {len(layers)} linear layers would train in float8 ({why}); "
            "plan it with --dtype bf16"
        )
    return Float8Linears(
        recipe="rowwise" if recipe == "rowwise" else "tensorwise", converted=len(layers) - len(kept), kept=kept
    )


__all__ = ["GPU_MEMORY_HEADROOM", "Costs", "estimated_costs", "measured_costs", "say", "tokens_per_sample"]
