"""The planned model, rebuilt and checked: every process (the launcher, each rank, the unsplit
reference) loads the plan's model file with the plan's config and seed, so every rank holds the
same initial weights without sending any, and checks it is the model the plan was made for (the
traced fingerprint, the block list, the ties) and a plan the runner can execute.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from planner.capture.blocks import GraphTrace, TiedParameter, TracedModel
from planner.capture.contract import check_batch_contract
from planner.capture.graph_file import GraphFileError, RankGraphs, dump_graph, load_graph
from planner.capture.load import ModelFile, load_model_file
from planner.capture.stage import trace_root
from planner.capture.trace import trace_model
from planner.core.levers.experts import ep_refusal
from planner.core.step.schedules import ZERO_BUBBLE, check_schedule, stage_ranks
from planner.errors import PlanFileError, PlannerError, TraceError
from planner.schema.costs import split_recompute
from planner.schema.plan import Plan


def load_plan_model(plan: Plan, plan_path: str | Path) -> ModelFile:
    """Load the plan's model file with exactly the config the plan was made with.

    Args:
        plan: the plan whose model file, size and config to use.
        plan_path: the plan file (a relative model path resolves against its folder).

    Returns:
        The loaded model file, its config replaced by the plan's.

    Raises:
        ModelFileError: the model file is missing or broken.
    """
    mf = load_model_file(plan.model_path(plan_path), plan.model.size)
    mf.config = dict(plan.model.config)
    return mf


@dataclass(frozen=True)
class StageSource:
    """What a rank's stages are built from.

    Attributes:
        model: the model with the weights to train (the trace takes its own copy).
        example: one example microbatch's positional inputs, of the plan's microbatch size.
        loss_fn: the loss of the model's output and the target (``ModelFile.loss_fn``'s form).
        graphs: the launcher's torch.export graphs (``planner.capture.graph_file.RankGraphs``), rebuilt
            instead of exporting the model again; None: trace.
    """

    model: nn.Module
    example: tuple
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    graphs: RankGraphs | None = None


def planned_source(plan: Plan, mf: ModelFile) -> StageSource:
    """The plan's model built from its model file with the plan's seed, the file's example microbatch
    and loss: what ``planner run``'s ranks build their stages from.

    Args:
        plan: the plan (seed, microbatch size).
        mf: its model file, with the plan's config (``load_plan_model``).

    Returns:
        The stage source.

    Raises:
        ModelFileError: ``build_model`` or ``make_batch`` raises.
    """
    model = mf.build(plan.model.seed)
    example = mf.batch(plan.microbatch_size, seed=plan.model.seed)[0]
    return StageSource(model, example, mf.loss_fn)


def edited_parts(plan: Plan, mf: ModelFile) -> list[str] | None:
    """The contract parts of a model file edited since planning (None: which is not known, the plan
    recording no part digests; [] where only other text changed)."""
    old, new = plan.model.part_digests, mf.part_digests()
    if not old:
        return None
    return sorted(name for name in set(old) | set(new) if old.get(name) != new.get(name))


def changed_file_warning(plan: Plan, mf: ModelFile) -> str:
    """One line naming a model file edited since planning, and which of its contract parts changed."""
    parts = edited_parts(plan, mf)
    what = f"{', '.join(parts)} changed" if parts else "its text changed"
    return (
        f"warning: {mf.path} changed since it was planned ({what}; digest {plan.model.file_digest} -> {mf.digest}); "
        "the run uses the file as it is now (re-run `planner plan` if the change matters)"
    )


def check_edited_contract(plan: Plan, mf: ModelFile, model: nn.Module) -> None:
    """Planning's check of ``make_batch`` and ``loss_fn`` made again where either was edited since
    planning (or which parts were is not recorded): a batch of the wrong size, a loss that sums,
    refused before any rank starts, not on the rank that happens to notice, or not at all. On
    microbatches of one sample, the least work: the promises hold at any size or at none.

    Args:
        plan: the plan (its part digests, seed).
        mf: the model file as it is now.
        model: a model built from it (run in eval mode and restored).

    Raises:
        ModelFileError: the first broken promise (``check_batch_contract``).
    """
    if mf.digest == plan.model.file_digest:
        return
    edited = edited_parts(plan, mf)
    if edited is None or {"make_batch", "loss_fn"} & set(edited):
        check_batch_contract(mf, model, 1, plan.model.seed, torch.device("cpu"))


def check_runnable(plan: Plan) -> None:
    """Reject plans the runner cannot execute, before any tracing or process.

    Args:
        plan: the plan to check.

    Raises:
        PlannerError: traced by module boundaries, a 1F1B plan with fewer microbatches than
            stages, or expert parallelism with what it does not run with yet.
    """
    if plan.profile.source == "estimated" and plan.profile.device != "cpu" and not torch.cuda.is_available():
        # a plan made for GPUs on a laptop trains on the GPU machine (in its --dtype, by autocast)
        raise PlannerError(
            f"this plan's costs were estimated for {plan.profile.hardware} GPUs ({plan.profile.dtype}) and this "
            "machine has no GPU; run it where the GPUs are, or plan with --gpu-type cpu (or without --gpu-type) "
            "to train here"
        )
    if plan.sharded and plan.schedule in ZERO_BUBBLE:
        raise PlanFileError(
            f"the plan shards {plan.dp} replicas with {plan.dp_mode.upper()} under --schedule {plan.schedule}, whose two-part backward "
            "torch 2.13's FSDP2 does not follow; re-plan with --dp-mode ddp or another schedule"
        )
    refused = ep_refusal(
        plan.ep,
        plan.experts,
        dp=plan.replicas,
        tp=plan.tp,
        dp_mode=plan.dp_mode,
        dp_shard=plan.shard_size,
        sequence=plan.sequence_parallel,
        cp=plan.cp,
    )
    if refused:
        raise PlanFileError(f"the plan cannot run: {refused}; re-plan")
    selective = [s.index for s in plan.stages if split_recompute(s.recompute)[0] == "selective"]
    if selective and plan.schedule in ZERO_BUBBLE:
        raise PlanFileError(
            f"stage(s) {', '.join(map(str, selective))} checkpoint selectively under --schedule {plan.schedule}, whose "
            "two-part backward runs each stage's backward twice, which torch's selective activation checkpointing "
            "refuses; re-plan with --recompute full (or auto) or another schedule"
        )
    if plan.n_ranks > 1:
        # torch's own constructors refuse these
        check_schedule(plan.schedule, plan.n_ranks, plan.n_microbatches, plan.stages_per_rank)
        expected = stage_ranks(plan.schedule, plan.n_ranks, plan.stages_per_rank)
        if [s.rank for s in plan.stages] != expected:
            raise PlanFileError(
                f"the plan places its stages on ranks {[s.rank for s in plan.stages]}, but {plan.schedule} with "
                f"{plan.stages_per_rank} stages per rank runs them on {expected}; re-run `planner plan`"
            )


def check_blocks(plan: Plan, traced: TracedModel) -> None:
    """The plan's blocks are the traced model's, name for name and node for node.

    The fingerprint covers the model; this covers the plan file, whose block list a user may edit
    (a renamed or reordered block would put other layers on a stage than the report shows).

    Args:
        plan: the plan.
        traced: the model traced for it.

    Raises:
        PlanFileError: the first block that differs, named.
    """
    mine = [(b.name, b.first_node, b.last_node) for b in plan.blocks]
    theirs = [(b.name, b.nodes[0], b.nodes[-1]) for b in traced.blocks]
    if len(mine) != len(theirs):
        raise PlanFileError(
            f"the plan lists {len(mine)} blocks but the model traces into {len(theirs)}; re-run `planner plan`"
        )
    for k, (a, b) in enumerate(zip(mine, theirs)):
        if a != b:
            raise PlanFileError(
                f"block {k} of the plan is {a[0]!r} (nodes {a[1]} .. {a[2]}) but the model's block {k} is "
                f"{b[0]!r} (nodes {b[1]} .. {b[2]}); the plan was edited or is for another model: re-run `planner plan`"
            )


def _what_differs(plan: Plan, traced: TracedModel) -> str:
    """What a user can act on about a fingerprint that no longer matches: the blocks, or inside them."""
    planned, now = [b.name for b in plan.blocks], [b.name for b in traced.blocks]
    if planned == now:
        return f"the same {len(now)} blocks, with other operators or parameter shapes inside"
    count = f"{len(planned)} blocks in the plan, {len(now)} now; " if len(planned) != len(now) else ""
    k = next((i for i, (a, b) in enumerate(zip(planned, now)) if a != b), min(len(planned), len(now)))
    was = repr(planned[k]) if k < len(planned) else "none"
    is_now = repr(now[k]) if k < len(now) else "none"
    return f"{count}block {k} is {was} in the plan, {is_now} now"


def trace_for_plan(plan: Plan, model: nn.Module, inputs: tuple, graphs: RankGraphs | None = None) -> TracedModel:
    """Trace ``model`` the way the planner did and check it is the structure the plan was made for.

    Args:
        plan: the plan (tracer, fingerprint).
        model: the model with the weights to train (built from the plan's model file with its seed,
            or the user's own, ``planner.pipeline``).
        inputs: one example microbatch's positional inputs (``planned_source``).
        graphs: the launcher's torch.export graphs (``StageSource.graphs``): its graph of the model is
            rebuilt on the model's copy instead of exporting it again; where there is none, it cannot
            be rebuilt or it gives another structure, the model is exported as without it.

    Returns:
        The trace (a graph, or module boundaries whose stages are chains of blocks), its buffers
        reset to the freshly built model's.

    Raises:
        PlanFileError: the traced fingerprint differs from the plan's.
        TraceError: the plan's tracer no longer works on the model.
    """
    traced = (
        rebuilt_trace(plan, model, inputs, graphs.traced) if graphs is not None and graphs.traced is not None else None
    )
    if traced is None:
        # shapes are all the run needs of the example: recorded on fake tensors, not by a forward on the CPU
        traced = trace_model(
            model, inputs, methods=(plan.model.trace_method,), shapes_only=True, experts=experts_of(plan)
        )
    if traced.fingerprint != plan.model.fingerprint:
        raise PlanFileError(
            f"plan was made for a different model structure (fingerprint {plan.model.fingerprint}, "
            f"the model now gives {traced.fingerprint}: {_what_differs(plan, traced)}); re-run `planner plan`"
        )
    check_blocks(plan, traced)
    # Tracing ran the (private copy of the) model forward in train mode, which moves batch-norm
    # running statistics; start training from the freshly built buffers like the unsplit model.
    fresh = dict(model.named_buffers())
    with torch.no_grad():
        for name, buf in trace_root(traced).named_buffers():
            if name in fresh and fresh[name].shape == buf.shape:
                buf.copy_(fresh[name])
    return traced


def experts_of(plan: Plan) -> tuple[str, ...]:
    """The experts modules whose calls a trace for ``plan`` records: all of them where the planner's
    trace recorded them (``ModelRef.expert_calls``: expert parallelism was asked for, and its stages
    replace the calls; ``planner.capture.expert_calls``), none otherwise."""
    return tuple(plan.experts) if plan.model.expert_calls else ()


def rebuilt_trace(plan: Plan, model: nn.Module, inputs: tuple, graph: bytes) -> TracedModel | None:
    """The trace of ``model`` from the launcher's graph, or None where it cannot be rebuilt or does not
    give the plan's structure (the caller then exports: any refusal names what a fresh trace finds).

    Args:
        plan: the plan (its trace method and model fingerprint).
        model: this rank's model.
        inputs: an example batch for it.
        graph: the launcher's graph (``planner.capture.graph_file.dump_graph``).

    Returns:
        The trace, or None.
    """
    if plan.model.trace_method != "export":
        return None
    try:
        traced = trace_model(
            model, inputs, methods=("export",), shapes_only=True, exported=lambda private: load_graph(graph, private)
        )
    except TraceError:
        return None
    return traced if traced.fingerprint == plan.model.fingerprint else None


def graphs_for_ranks(traced: TracedModel) -> RankGraphs:
    """The launcher's trace as its ranks rebuild it (``StageSource.graphs``), collecting the graph at a
    tp rank's sizes as the launcher's checks make it: a torch.export graph only (an fx trace takes
    hundredths of a second to make again); none where the graph holds what
    ``planner.capture.graph_file`` does not cover (the ranks then export)."""
    graphs = RankGraphs(collects=True)
    if isinstance(traced, GraphTrace) and traced.method == "export":
        try:
            graphs.traced = dump_graph(traced.gm, traced.model)
        except GraphFileError:
            pass
    return graphs


def check_ties(plan: Plan, traced: TracedModel) -> list[TiedParameter]:
    """The traced model's tied parameters, checked against the ties the plan records.

    Args:
        plan: the plan.
        traced: the model traced for it.

    Returns:
        ``traced.tied_parameters()`` (the same list, in the same order, on every rank).

    Raises:
        PlanFileError: a parameter several stages read that the plan does not record (a plan made
            before ties were served, or edited), named by both its names.
    """
    ties = traced.tied_parameters()
    recorded = {(t.names, t.blocks) for t in plan.ties}
    for tie in ties:
        blocks = tuple(traced.blocks[k].name for k in tie.blocks)
        stages = plan.stages_reading(tie.blocks)
        if (tie.names, blocks) not in recorded and len(stages) > 1:
            also = f" (also named {', '.join(tie.names[1:])})" if len(tie.names) > 1 else ""
            raise PlanFileError(
                f"parameter {tie.names[0]}{also} is read by {blocks[0]} on stage {stages[0]} and by {blocks[-1]} on "
                f"stage {stages[-1]} (tied weights), but the plan records no such tie, so its copies would drift "
                "apart; re-run `planner plan` (it records ties, and the runner keeps the copies equal)"
            )
    return ties
