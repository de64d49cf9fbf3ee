"""Building a rank's stages: the planned model rebuilt and traced as the planner did, each stage of
this rank cut out of the trace with a real example input and output, wrapped (recomputation, the
contiguous boundary, FSDP or DDP across the replicas, compile and autocast), made a torch
``PipelineStage``; torch's class for the plan's schedule over them; one optimizer; and what
finishes a step's gradients (``planner.run.gradients``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from planner.capture.blocks import GraphTrace, TracedModel
from planner.capture.checkpoint import CheckpointedStage, checkpointed_stage, stage_units
from planner.capture.clock import BlockClock
from planner.capture.contract import sequence_length
from planner.capture.float8 import convert_stage, emulated, float8_modules, precompute_scales
from planner.capture.graph import buffers_restored, retarget_devices
from planner.capture.shapes import shapes_or_real
from planner.capture.stage import stage_inputs, stage_module, trace_root
from planner.capture.tp_plan import COLUMN_STYLES
from planner.capture.tp_sequence import sequence_values
from planner.core.levers.float8 import fsdp_float8_gather
from planner.core.levers.recompute import checkpoint_units
from planner.core.step.schedules import ZERO_BUBBLE, placement
from planner.errors import PlanFileError, PlannerError
from planner.run.boundary import boundary_scatter, sent_examples
from planner.run.checkpoint import model_names
from planner.run.context_shard import (
    SequenceShards,
    around_sharded,
    around_tokens,
    boundary_chunks,
    chunk_flagged,
    chunk_weighted_loss,
)
from planner.run.context_shard import install as install_context
from planner.run.experts import (
    dispatch_experts,
    expert_shards,
    experts_calls,
    shard_experts_over_groups,
)
from planner.run.gradients import grad_finisher
from planner.run.mesh import RankMesh
from planner.run.model import StageSource, check_ties, trace_for_plan
from planner.run.optim import make_optimizer
from planner.run.sequence_shard import install as install_sequence
from planner.run.streams import vocab_size_of
from planner.run.tensor_shard import norm_counted, parallel_loss, shard_stage, shardable_trace, tp_styles
from planner.run.wrappers import (
    ContiguousBoundary,
    HooklessDDP,
    apply_speed_levers,
    autocast_loss,
    autocast_region,
    shard_over_replicas,
    sharded_param_dtype,
)
from planner.schema.costs import split_recompute
from planner.schema.names import TORCH_NAMES
from planner.schema.plan import Plan, StagePlan
from planner.torch_compat import ddp_ignore, gather_each_stage_once, split_backward_patched


@dataclass(frozen=True)
class RankStages:
    """What ``build_stages`` makes for one rank.

    Attributes:
        modules: what each ``PipelineStage`` runs (DDP-wrapped under ddp replicas), in stage order.
        params: the trainable parameters, each once (stages on one rank may share a tied one).
        optimizer: one optimizer over ``params`` (None: the rank holds no parameters).
        stages: the ``PipelineStage`` of each of the rank's stages, in stage order.
        schedule: torch's class for the plan's schedule, over ``stages``.
        finish_grads: turns a step's accumulated gradients into the step's (``grad_finisher``).
        counted: the parameters whose gradients enter the global norm (None: all of ``params``).
        tensors: the unsplit model's name -> this rank's tensor (what a checkpoint holds).
        vocab_size: the model's output width (sizes ``--data``'s vocabulary; None: not asked).
        clocks: per stage, the marks that time its blocks (None: a compiled stage).
        shards: id of a parameter this rank holds a share of (an expert-parallel layer's experts) ->
            what turns it, or a tensor of its shape, into the whole tensor's view a checkpoint
            saves (``planner.run.experts.expert_shards``); empty otherwise.
    """

    modules: list[torch.nn.Module]
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer | None
    stages: list[Any]
    schedule: Any
    finish_grads: Callable[[], None]
    counted: list[torch.nn.Parameter] | None
    tensors: dict[str, torch.Tensor]
    vocab_size: int | None
    clocks: list[BlockClock | None]
    shards: dict[int, Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=dict)


@dataclass(frozen=True)
class _CutStage:
    """One of the rank's stages cut out of the trace, before any wrapping across the replicas.

    Attributes:
        plan: the plan's record of the stage.
        built: the stage module (it shares its parameters with the trace).
        inner: what the boundary calls: ``built``, under recomputation where the plan says.
        module: the boundary wrapper around ``inner``.
        example_in: the stage's real example inputs (the blocks before it run once), as it receives
            them (a tensor-parallel rank's pieces where its boundary is scattered, ``run.boundary``).
        example_out: its outputs on them, as it sends them.
        clock: the marks that time its blocks (None: a compiled plan).
    """

    plan: StagePlan
    built: torch.nn.Module
    inner: torch.nn.Module
    module: ContiguousBoundary
    example_in: tuple
    example_out: tuple
    clock: BlockClock | None
    chunks: tuple[list[bool], list[bool]] = ([], [])


def build_stages(
    plan: Plan, source: StageSource, mesh: RankMesh, device: torch.device, *, want_vocab: bool
) -> RankStages:
    """This rank's stages, ready to train under torch's schedule.

    Args:
        plan: the plan.
        source: the model with the weights to train, an example microbatch and the loss
            (``planned_source``: the plan's model file; ``planner.pipeline``: the user's).
        mesh: this rank's place and groups.
        device: where the stages run.
        want_vocab: also find the model's output width (``--data`` sizes its vocabulary by it).

    Returns:
        The stage modules (wrapped for the plan's data parallelism), their trainable parameters, one
        optimizer over them, their ``PipelineStage`` objects, the schedule, what finishes a step's
        gradients and the state tensors a checkpoint holds, by the unsplit model's names.

    Raises:
        PlanFileError: the model is not the one the plan was made for, or has a tie it does not record.
        PlannerError: two stages of this rank share a tied parameter under FSDP.
    """
    aliases = _aliases(source.model)  # taken before tracing
    traced = trace_for_plan(plan, source.model, source.example, source.graphs)  # the trace holds its own model copy
    # the graph the stages are cut from: under tensor parallelism a torch.export graph's layers become
    # modules torch's styles shard, at one tp rank's sizes (the examples still come from ``traced``)
    shardable = shardable_trace(traced, source.model, source.example, plan.tp_plan, plan.tp, source.graphs)
    if device.type != "cpu":
        for trace in {id(t): t for t in (traced, shardable)}.values():
            if isinstance(trace, GraphTrace):
                retarget_devices(trace.gm, device)  # traced on the CPU, run on the rank's GPU
    root = trace_root(traced)
    ties = check_ties(plan, traced)
    cut = _cut_stages(plan, source.example, traced, mesh, device, shardable)
    sequence = (
        sequence_values(shardable, plan.tp_plan)
        if plan.sequence_parallel and isinstance(shardable, GraphTrace)
        else frozenset()
    )
    vocab = vocab_size_of(traced, source.example) if want_vocab else None
    # Zero-bubble schedules compute weight gradients with autograd.grad, past DDP's hooks, so there
    # the replicas' gradients are averaged by ``finish`` instead (the same all-reduce, after the step's
    # backward).
    # Under tensor parallelism too: the parameters are DTensors, which torch 2.13's DDP does not reduce.
    # With several passes per step (gradient accumulation) torch's PipelineStage would all-reduce at
    # the end of every pass: averaged by ``finish`` too, once per step, after the last pass.
    manual = (
        plan.replicas > 1
        and plan.dp_mode == "ddp"
        and (plan.schedule in ZERO_BUBBLE or plan.tp > 1 or plan.accumulation > 1)
    )
    modules: list[torch.nn.Module] = []
    stages: list[Any] = []
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    experts: list[torch.nn.Module] = []  # expert-parallel: reduced over the expert groups, not the replicas
    for stage in cut:
        names = _state_names(stage.built, root, aliases)  # before wrapping: FSDP replaces the parameters
        held: list[torch.nn.Module] = []
        calls: list[torch.nn.Module] = []
        if plan.ep > 1:  # the examples were made above, on the whole experts
            dispatches = dispatch_experts(plan, stage.plan, stage.built, traced, mesh)
            held = [d.experts for d in dispatches]
            experts.extend(held)
            calls = list(dispatches)
        elif plan.cp > 1 and plan.model.expert_calls:  # the experts on a rank's plain tokens
            calls = experts_calls(plan, stage.plan, stage.built, traced)
        _split_inside(plan, stage, mesh, shardable, sequence, calls)
        submod = _replicated(plan, stage, mesh, device, seen, manual=manual, experts=held)
        for local_name, t in [*stage.built.named_parameters(remove_duplicate=False), *stage.built.named_buffers()]:
            for alias in names.get(local_name, []):
                tensors[alias] = t
        modules.append(submod)
        stages.append(_pipeline_stage(plan, stage, submod, mesh, device))
    params = list({id(p): p for m in modules for p in m.parameters() if p.requires_grad}.values())
    optimizer = make_optimizer(params, plan)
    if optimizer is not None and gathers_float8(plan):
        # as torchtitan does: every float8 weight's scale for the next gathers in one all-reduce
        optimizer.register_step_post_hook(lambda *_: precompute_scales(modules))
    # the experts' parameters as wrapped (FSDP replaces them); FSDP reduces them itself
    own = [p for module in experts for p in module.parameters()]
    finish, not_counted = grad_finisher(
        plan, ties, mesh, params, tensors, average=manual, experts=None if plan.sharded else own
    )
    del ties
    counted = [p for p in params if id(p) not in not_counted] if not_counted else None
    mine = {id(p) for p in own}
    if plan.tp > 1:  # an expert group spans the tensor-parallel ranks: each holds its own experts
        counted = norm_counted(counted if counted is not None else params, mesh.tp_rank, own=mine)
    if plan.ep > 1 and not plan.sharded:  # the norm sums over the expert group's replicas: each expert
        # once, the rest from one (under FSDP over every rank: each shard is held once, experts or not)
        first = mesh.replica % plan.ep_replicas == 0
        counted = [p for p in (params if counted is None else counted) if id(p) in mine or first]
    return RankStages(
        modules=modules,
        params=params,
        optimizer=optimizer,
        stages=stages,
        schedule=_schedule(
            plan, chunk_weighted_loss(source.loss_fn, mesh.cp_mesh) if plan.cp > 1 else source.loss_fn, stages, device
        ),
        finish_grads=finish,
        counted=counted,
        tensors=tensors,
        vocab_size=vocab,
        clocks=[stage.clock for stage in cut],
        shards=expert_shards(experts, mesh) if experts else {},
    )


def _cut_stages(
    plan: Plan, example: tuple, traced: TracedModel, mesh: RankMesh, device: torch.device, shardable: TracedModel
) -> list[_CutStage]:
    """Every stage of this rank cut out of ``shardable`` (``traced``, or its graph with the layers
    tensor parallelism shards as modules: ``shardable_trace``), each with its example input and
    output, made on ``traced``.

    All the examples are made before any module is wrapped: FSDP shards the modules of the trace in
    place, after which the trace's other cuts (the prefix that makes a later stage's example)
    cannot run.
    """
    cut: list[_CutStage] = []
    for stage_plan in plan.stages_of(mesh.pp_rank):
        clock = _block_clock(plan, stage_plan, device)
        built = _stage_chain(plan, shardable, stage_plan, clock)
        inner = built
        module = ContiguousBoundary(inner)
        # a shardable export graph has one tp rank's sizes baked in: its examples come from the full one
        shown = (
            module
            if shardable is traced
            else ContiguousBoundary(stage_module(traced, stage_plan.start, stage_plan.end))
        )
        # float8 layers before the examples (they send what the stage computes in) and any sharding
        for stage in {id(m): m for m in (built, shown.module)}.values():
            _to_float8(plan, stage, traced.model, device)
        # under the plan's autocast, so the examples (and the receive buffers made from them) have
        # the dtypes that will cross the cut
        with autocast_region(plan, device.type):
            example_in, example_out = _example_io(
                traced, stage_plan.start, shown, example, device, sharded_param_dtype(plan)
            )
        chunks: tuple[list[bool], list[bool]] = ([], [])
        if plan.cp > 1:  # a rank's chunk of the sequence crosses (its first, for the shapes)
            example_in, example_out, chunks = _context_examples(plan, shardable, example, example_in, example_out)
        # under tensor parallelism, what crosses to another pipeline rank crosses as 1/tp pieces
        group = mesh.tp_mesh.get_group() if mesh.tp_mesh is not None else None
        module.scatter = boundary_scatter(plan, stage_plan, example_in, example_out, group, mesh.tp_rank)
        example_in, example_out = sent_examples(module.scatter, example_in, example_out)
        cut.append(_CutStage(stage_plan, built, inner, module, example_in, example_out, clock, chunks))
    return cut


def gathers_float8(plan: Plan) -> bool:
    """Whether the plan's FSDP gathers float8 weights in float8 (``fsdp_float8_gather``, sharded
    replicas): then every optimizer step is followed by ``precompute_scales``."""
    f8 = plan.profile.float8
    return f8 is not None and fsdp_float8_gather(f8.recipe, plan.dp_mode) and plan.sharded


def _to_float8(plan: Plan, stage: torch.nn.Module, model: torch.nn.Module, device: torch.device) -> None:
    """A float8 plan's stage with its linear layers converted to torchao's (``planner.capture.float8``),
    unit by unit: before tensor parallelism and FSDP wrap them, as torchtitan converts."""
    f8 = plan.profile.float8
    if f8 is None:
        return
    gather = gathers_float8(plan)
    for unit in stage_units(stage):
        if isinstance(unit, torch.fx.GraphModule):
            convert_stage(unit, f8, model, emulated(device), gather)


def _stage_chain(plan: Plan, traced: TracedModel, stage_plan: StagePlan, clock: BlockClock | None) -> torch.nn.Module:
    """The module of one stage as its recompute mode and FSDP's units want it: one module of its
    blocks, or a chain of units (``checkpoint_units``: one per block, as the plan's memory model
    counts them), each its own checkpoint region when it recomputes block by block, the whole chain
    one region when the stage recomputes as one ("stage")."""
    start, end = stage_plan.start, stage_plan.end
    recompute, count = split_recompute(stage_plan.recompute)
    if not per_block_fsdp(plan):
        if recompute == "never":
            return stage_module(traced, start, end, clock)
        if recompute == "stage":  # the whole stage as one region
            return checkpointed_stage(traced, [(start, end)], "full", stage_module, clock)
    units = checkpoint_units(plan.blocks, start, end)
    if recompute == "stage":  # FSDP's units inside, the whole chain rebuilt at once
        return CheckpointedStage([checkpointed_stage(traced, units, "never", stage_module, clock)], "full", clock)
    first = len(units) if count is None else min(count, len(units))  # "full:k": only the first k regions
    modes = [recompute] * first + ["never"] * (len(units) - first)
    return checkpointed_stage(traced, units, modes, stage_module, clock)


def _sequence_inputs(stage: _CutStage, shardable: TracedModel, sequence: frozenset[str]) -> list[bool]:
    """Under sequence parallelism, which of a stage's inputs are sequence shards in the whole graph
    (``sequence``: ``planner.capture.tp_sequence``'s names).

    Raises:
        PlanFileError: the model was traced by module boundaries (no graph to follow the shards in).
    """
    if not isinstance(shardable, GraphTrace):
        raise PlanFileError(
            "the plan asks for sequence parallelism, but this model traces by module boundaries only; "
            "re-plan without --sequence-parallel"
        )
    start = stage.plan.start
    names = list(shardable.cuts[start - 1].tensors) if start > 0 else []
    return [name in sequence for name in names]


def _split_inside(
    plan: Plan,
    stage: _CutStage,
    mesh: RankMesh,
    shardable: TracedModel,
    sequence: frozenset[str],
    experts: Sequence[torch.nn.Module] = (),
) -> None:
    """What splits a stage inside its pipeline rank, before FSDP or DDP wrap it: context parallelism's
    hooks (``planner.run.context_shard``, sequence parallelism inside them where both split the
    sequence), else sequence parallelism's (``planner.run.sequence_shard``), then torch's
    tensor-parallel styles (every example was made before, on the unsharded trace), and context
    parallelism's unwrapping around the layers they sharded and around the stage's ``experts`` calls
    (``planner.run.experts.experts_calls``: they see the rank's plain tokens)."""
    units = stage_units(stage.built)  # a chain's units are named as the unsplit model names them
    ring = plan.cp_attention == "ring"
    shards = None
    if plan.cp > 1 and plan.tp > 1 and plan.sequence_parallel:
        shards = SequenceShards(mesh.cp_tp_mesh, mesh.tp_mesh, _sequence_inputs(stage, shardable, sequence))
    context = install_context(stage.built, units, mesh.cp_mesh, stage.chunks, ring, shards) if plan.cp > 1 else None
    if context is not None and plan.profile.float8 is not None and plan.tp == 1:
        # torchao's float8 layers cast and multiply in autograd functions whose backward runs outside the
        # mode: they see plain chunks, as tensor-parallel layers do (a linear layer works token by token)
        around_sharded(context, [layer for unit in units for layer in float8_modules(unit)])
    if context is not None and experts:
        around_tokens(context, experts)
    if plan.tp == 1:
        return
    if plan.sequence_parallel and context is None:  # its hooks first: before torch's styles and FSDP's
        columns = [
            unit.get_submodule(name)
            for unit in units
            for name, style in tp_styles(unit, plan.tp_plan).items()
            if style in COLUMN_STYLES
        ]
        install_sequence(stage.built, units, columns, mesh.tp_mesh, _sequence_inputs(stage, shardable, sequence))
    # loss parallelism: the last stage's head leaves its logits split, for the loss (``parallel_loss``)
    loss = plan.loss_parallel and stage.plan.index == plan.n_stages - 1
    for part in units:
        shard_stage(part, mesh.tp_mesh, plan.tp_plan, sequence=plan.sequence_parallel, loss=loss)
    if context is not None:
        around_sharded(context, [unit.get_submodule(name) for unit in units for name in tp_styles(unit, plan.tp_plan)])


def _context_examples(
    plan: Plan, traced: TracedModel, example: tuple, example_in: tuple, example_out: tuple
) -> tuple[tuple, tuple, tuple[list[bool], list[bool]]]:
    """A stage's examples as one context-parallel rank receives and sends them (its sequence chunks
    cut), and which of them are chunks (``boundary_chunks``).

    Raises:
        PlanFileError: the model was traced by module boundaries (context parallelism follows a graph).
        ModelFileError: the inputs have no sequence that splits into ``cp`` chunks.
    """
    if not isinstance(traced, GraphTrace):
        raise PlanFileError(
            "the plan splits sequences over context-parallel ranks, but this model traces by module boundaries "
            "only; re-plan without --cp"
        )
    length = sequence_length(example, plan.cp)
    ins, outs = boundary_chunks(example_in, length), boundary_chunks(example_out, length)
    return chunk_flagged(example_in, ins, plan.cp), chunk_flagged(example_out, outs, plan.cp), (ins, outs)


def stage_unit_fsdp(plan: Plan) -> bool:
    """Whether the plan's replicas shard each stage as one FSDP unit (FSDP or HSDP, ``fsdp_units``
    "stage"): the runner then gathers each stage once per pass, at its start."""
    return plan.sharded and not per_block_fsdp(plan)


def per_block_fsdp(plan: Plan) -> bool:
    """Whether the plan's replicas shard its stages block by block (FSDP or HSDP, ``fsdp_units`` "block")."""
    return plan.sharded and plan.fsdp_units == "block"


def _shard_blocks(plan: Plan, stage: _CutStage, mesh: RankMesh) -> None:
    """FSDP block by block: every unit of the stage's chain its own ``fully_shard`` unit, resharded
    after its forward (gathered again for its backward), then the chain itself as the root, which
    keeps what two units share (a tie inside the stage) and drives the units' gradient reduction.

    The stage's boundary wrapper stays unsharded, so torch's ``PipelineStage`` sees no FSDP module
    and leaves FSDP's hooks alone: each unit's gradients are reduce-scattered (into the sharded
    gradients, which accumulate over microbatches) and its parameters resharded as soon as its
    backward is done, instead of the whole stage staying unsharded until the last microbatch.
    """
    units = stage_units(stage.built)
    owners = Counter(id(p) for unit in units for p in unit.parameters())
    for unit in units:
        params = list(unit.parameters())
        # a unit that shares a tie with another stays with the root
        if any(p.requires_grad for p in params) and all(owners[id(p)] == 1 for p in params):
            shard_over_replicas(plan, unit, mesh.dp_mesh, True)
    # the root's own parameters (ties) are needed again at the start of backward: not resharded
    shard_over_replicas(plan, stage.inner, mesh.dp_mesh, False)


def _replicated(
    plan: Plan,
    stage: _CutStage,
    mesh: RankMesh,
    device: torch.device,
    seen: set[int],
    *,
    manual: bool,
    experts: Sequence[torch.nn.Module] = (),
) -> torch.nn.Module:
    """What the stage's ``PipelineStage`` runs: its boundary on the device, sharded over the replicas
    (FSDP) or wrapped in DDP, compiled and autocast as the plan says.

    Args:
        plan: the plan (replicas, their mode).
        stage: the stage, cut.
        mesh: this rank's groups.
        device: where it runs.
        seen: ids of the trainable parameters of the rank's earlier stages; this stage's are added.
        manual: the replicas' gradients are averaged by the gradient finisher, not by DDP.
        experts: the stage's experts modules under expert parallelism, this rank's share of them,
            which the other replicas do not hold alike: DDP leaves them to the gradient finisher,
            FSDP shards them over the replicas holding the same experts (``shard_experts_over_groups``).

    Raises:
        PlannerError: under FSDP, the stage shares a tied parameter with an earlier stage of the rank.
    """
    module = stage.module
    module.to(device)
    trainable = [p for p in module.parameters() if p.requires_grad]
    shared = [p for p in trainable if id(p) in seen]
    fsdp = plan.sharded and bool(trainable)
    if fsdp and shared:
        raise PlannerError(
            f"stage {stage.plan.index} shares a tied parameter with another stage on rank {mesh.pp_rank}, "
            "which FSDP cannot shard twice; re-plan with --dp-mode ddp"
        )
    # compiled before sharding, as torchtitan does
    apply_speed_levers(plan, module, stage.inner, device, stage.plan.in_flight, stage.plan.recompute)
    if fsdp and experts:  # their own units first: the stage's units then leave their parameters alone
        shard_experts_over_groups(plan, experts, mesh, reshard=per_block_fsdp(plan))
    if fsdp and per_block_fsdp(plan):
        _shard_blocks(plan, stage, mesh)
    elif fsdp:
        # The boundary wrapper itself is sharded, so that torch's PipelineStage sees an FSDP
        # module: it then syncs gradients only after the last microbatch's backward instead of
        # reduce-scattering every microbatch's. Parameters stay gathered from forward to
        # backward: each microbatch's backward would otherwise gather them again.
        module.hooks = True
        shard_over_replicas(plan, module, mesh.dp_mesh, False)
    submod: torch.nn.Module = module
    own = {id(p) for module in experts for p in module.parameters()}
    ignored = shared + [p for p in trainable if id(p) in own and id(p) not in seen]
    if plan.replicas > 1 and plan.dp_mode == "ddp" and not manual and len(ignored) < len(trainable):
        if ignored:  # a tied parameter another DDP of this rank already reduces, or an expert
            local = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
            ddp_ignore(module, [local[id(p)] for p in ignored])
        submod = HooklessDDP(module, process_group=mesh.dp_group, gradient_as_bucket_view=True)
    seen.update(id(p) for p in trainable)
    return submod


def _pipeline_stage(plan: Plan, stage: _CutStage, submod: torch.nn.Module, mesh: RankMesh, device: torch.device) -> Any:
    """The stage as torch's ``PipelineStage`` in static mode (its example input and output given)."""
    from torch.distributed.pipelining import PipelineStage

    return PipelineStage(
        submod,
        stage_index=stage.plan.index,
        num_stages=plan.n_stages,
        device=device,
        input_args=tuple(t if t.is_meta else t.to(device) for t in stage.example_in),
        output_args=tuple(t if t.is_meta else t.to(device) for t in stage.example_out),
        group=mesh.pp_group,
    )


def _schedule(
    plan: Plan, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], stages: list[Any], device: torch.device
) -> Any:
    """torch's class for the plan's schedule over the rank's stages, ``loss_fn`` at its end."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    schedule_cls = get_schedule_class(TORCH_NAMES[plan.schedule])
    if plan.schedule in ZERO_BUBBLE:
        split_backward_patched()  # parameter groups that share nodes (T5, ALBERT); a frozen prefix
    # scale_grads=False: ``finish`` averages the gradients over microbatches, once per parameter.
    # GPipe and 1F1B take their one stage; the others (PipelineScheduleMulti) a list, even of one.
    target = stages[0] if placement(plan.schedule) == "single" else stages
    loss = autocast_loss(parallel_loss(loss_fn) if plan.loss_parallel else loss_fn, plan, device)
    schedule = schedule_cls(target, n_microbatches=plan.n_microbatches, loss_fn=loss, scale_grads=False)
    if stage_unit_fsdp(plan) and placement(plan.schedule) != "single":
        gather_each_stage_once(schedule)  # as the plan predicts; GPipe and 1F1B: prefetch_gathers
    return schedule


def _as_tuple(value: object) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def _example_io(
    traced: TracedModel,
    start: int,
    stage: torch.nn.Module,
    inputs: tuple,
    device: torch.device,
    param_dtype: torch.dtype | None = None,
) -> tuple[tuple, tuple]:
    """Example inputs and outputs of one stage, for ``PipelineStage``'s static mode; with
    ``param_dtype`` (FSDP's mixed precision, ``planner.run.wrappers.fsdp_policy``) every stage
    computes with its parameters in that dtype, as FSDP gathers them.

    Without them ``PipelineStage`` infers shapes at the first step by running every stage on
    *uninitialised* receive buffers (``torch.empty``): an integer tensor crossing a cut (token ids,
    ``torch.arange`` positions) is then garbage and an embedding lookup fails with "index out of
    range". So each rank runs the blocks before its stage once on the example microbatch (with
    autograd on, so ``requires_grad`` of every boundary tensor is what training will see).
    """
    # Same shapes and dtypes as training. torch.export's modules refuse .eval(), so train mode stays
    # on: the buffers are put back (batch norm's running statistics) and the RNG too (dropout), so
    # training starts exactly where the unsplit model's does.
    # PipelineStage reads only shape, stride, dtype and requires_grad of the examples: they are made on
    # fake tensors where the model runs on them (a real prefix is a forward at full width on the CPU)
    prefix = stage_module(traced, 0, start) if start > 0 else None

    def examples(*x: Any) -> tuple[tuple, tuple]:
        if prefix is not None:
            x = tuple(t.detach().contiguous().requires_grad_(t.requires_grad) for t in _as_tuple(prefix(*x)))
        return x, _as_tuple(stage(*x))

    both = torch.nn.ModuleList([stage] if prefix is None else [prefix, stage])  # one swap of their weights
    with buffers_restored(trace_root(traced)), torch.random.fork_rng(devices=[]), torch.enable_grad():
        # as if on the rank's device, so that a GPU's autocast gives the dtypes training will send (the
        # trace's weights are still on the CPU here, where autocast for cuda would change nothing)
        x, y = shapes_or_real(both, examples, *stage_inputs(inputs), device=device, param_dtype=param_dtype)
    return x, tuple(t.detach().requires_grad_(t.requires_grad) for t in y)


def _state_names(stage: torch.nn.Module, root: torch.nn.Module, aliases: dict[str, list[str]]) -> dict[str, list[str]]:
    """The stage module's own parameter and buffer names -> every name the unsplit model gives them.

    Taken before any wrapping: FSDP replaces the parameters (by new DTensor ones) but keeps their
    names within the stage module, so the names still find them afterwards.
    """
    root_names: dict[int, list[str]] = {}
    for name, t in [*root.named_parameters(remove_duplicate=False), *root.named_buffers(remove_duplicate=False)]:
        root_names.setdefault(id(t), []).append(name)
    out: dict[str, list[str]] = {}
    for local, t in [*stage.named_parameters(remove_duplicate=False), *stage.named_buffers(remove_duplicate=False)]:
        names = [alias for name in root_names.get(id(t), []) for alias in aliases.get(name, [])]
        if names:
            out[local] = list(dict.fromkeys(names))
    return out


def _aliases(model: torch.nn.Module) -> dict[str, list[str]]:
    """Each state name of the unsplit model -> all names of that tensor (a tied weight has several)."""
    out: dict[str, list[str]] = {}
    for names in model_names(model).values():
        for name in names:
            out[name] = names
    return out


def _block_clock(plan: Plan, stage: StagePlan, device: torch.device) -> BlockClock | None:
    """The marks that time every block of ``stage`` where it runs (``planner.capture.clock``); None
    for a compiled plan, whose graph each mark would break (it is timed per stage only)."""
    if plan.compile:
        return None
    return BlockClock(stage.start, stage.end, stage.end == len(plan.blocks), device.type == "cuda")
