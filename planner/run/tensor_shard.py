"""Tensor parallelism inside a pipeline stage: the plan's ``tp_plan`` applied to a stage module with
torch's ``parallelize_module`` over the rank's tensor-parallel mesh, before the stage becomes a
``PipelineStage``; and which gradients of a sharded stage enter the global norm on this rank.

The stage modules keep the unsplit model's module names (``layers.0.attention.wq``), so the plan's
patterns (``'*'`` = exactly one dotted name part) match them directly. ``ColwiseParallel`` takes a
replicated input and returns its column shard, ``RowwiseParallel`` takes that shard and returns the
all-reduced (replicated) output, a ``colwise_rep`` layer (an output head) returns its column shards
all-gathered: between the matched modules activations are plain local tensors, and what crosses a
stage boundary is the full activation, the same on every tensor-parallel rank.
A torch.export graph calls its layers as functions at sizes baked in: ``shardable_trace`` gives the
stages a graph of the same nodes at one tensor-parallel rank's sizes, its planned layers modules.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import nn

from planner.capture.blocks import TracedModel
from planner.capture.graph_file import RankGraphs
from planner.capture.tp_graph import shardable_trace as _shardable
from planner.capture.tp_plan import COLUMN_STYLES, indivisible_split, matched_modules, style_error
from planner.errors import PlanFileError, PlannerError, TraceError
from planner.run.sequence_shard import row_style


def tp_styles(module: nn.Module, tp_plan: dict[str, str]) -> dict[str, str]:
    """The modules of ``module`` the plan shards, by name, with their style.

    Args:
        module: a stage module (named as the unsplit model names its modules).
        tp_plan: the plan's patterns -> "colwise" | "rowwise" | "colwise_rep".

    Returns:
        Module name -> style, in module order (empty: nothing of this stage is sharded).

    Raises:
        PlanFileError: a style not in ``STYLES``, or a matched module that is neither an
            ``nn.Linear`` nor an ``nn.Embedding`` (torch's styles shard only those; a torch.export
            graph's layer calls are made modules by ``shardable_trace``).
    """
    bad = style_error(tp_plan)
    if bad:
        raise PlanFileError(bad)
    out: dict[str, str] = {}
    for name, (style, sub, _) in matched_modules(module, tp_plan).items():
        if not isinstance(sub, (nn.Linear, nn.Embedding)):
            raise PlanFileError(
                f"tp_plan shards {name}, which this stage holds as a {type(sub).__name__}, not an nn.Linear: "
                "torch's ColwiseParallel / RowwiseParallel shard only nn.Linear and nn.Embedding modules; "
                "re-plan with tp 1"
            )
        out[name] = style
    return out


def shard_stage(
    module: nn.Module, tp_mesh: Any, tp_plan: dict[str, str], *, sequence: bool = False, loss: bool = False
) -> dict[str, str]:
    """Shard a stage module's matched layers over the tensor-parallel mesh, in place.

    Args:
        module: the stage module (before any replica wrapping or ``PipelineStage``).
        tp_mesh: the rank's 1-D tensor-parallel ``DeviceMesh``.
        tp_plan: the plan's patterns -> styles.
        sequence: sequence parallelism: row-wise outputs reduce-scattered along the sequence and
            left DTensors (``planner.run.sequence_shard``, which must be installed first).
        loss: loss parallelism, on the last stage: its output head (a ``colwise_rep`` ``nn.Linear``)
            returns its logits as a DTensor split along the last dimension, which the loss reads
            under torch's ``loss_parallel`` (``parallel_loss``), never gathered whole.

    Returns:
        The sharded modules' names -> styles (``tp_styles``).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = tp_styles(module, tp_plan)
    if styles:
        make: dict[str, Callable[[], Any]] = {
            "colwise": ColwiseParallel,
            "rowwise": row_style if sequence else RowwiseParallel,
            # an output head: its column shards all-gathered, so the loss reads the whole logits; an
            # embedding: each rank's slice of every vector, gathered whole (capture.tp_plan says why not rows)
            "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        }
        head = lambda: ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)  # noqa: E731
        parallelize_module(
            module,
            tp_mesh,
            {
                name: head()
                if loss and style == "colwise_rep" and isinstance(module.get_submodule(name), nn.Linear)
                # (an embedding's colwise_rep stays gathered: the layers after it read whole vectors)
                else make[style]()
                for name, style in styles.items()
            },
        )
    return styles


def parallel_loss(loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """The model's loss on the last stage's logits split over the tensor-parallel ranks (loss
    parallelism, ``shard_stage(loss=True)``), its value a plain tensor: the schedule and the step's
    loss records read plain tensors. It runs, with the backward, under torch's ``loss_parallel``
    (``Pipeline`` enters it around the step), which computes ``cross_entropy`` (or ``log_softmax`` then
    ``nll_loss``) on the class dimension's shards; other operators on the split logits run as
    DTensors do (gathered where an operator needs them whole).

    Args:
        loss_fn: ``loss_fn(output, target)``, the model file's loss (as the schedule calls it).

    Returns:
        The loss for the schedule.

    Raises:
        PlanFileError: the loss fails on the split logits (one line: what failed, and to re-plan
            without ``--loss-parallel``).
    """
    from torch.distributed.tensor import DTensor

    def loss(output: Any, target: torch.Tensor) -> torch.Tensor:
        try:
            value = loss_fn(output, target)
        except PlannerError:
            raise
        except Exception as e:  # a user's loss meeting DTensors: said in one line, not a traceback
            first = (str(e).strip().splitlines() or [""])[0][:300]
            raise PlanFileError(
                f"loss parallelism: loss_fn() fails on the output head's logits split over the tensor-parallel "
                f"ranks ({type(e).__name__}: {first}); torch's loss_parallel computes cross_entropy, or "
                "log_softmax then nll_loss, on the class dimension: re-plan without --loss-parallel"
            ) from e
        # (a replicated scalar, the cross-entropy's: no traffic; a partial one is summed here), copied:
        # the local value is a view, which a zero-bubble schedule's input backward cannot detach in place
        return value.full_tensor().clone() if isinstance(value, DTensor) else value

    return loss


def sharded_over_tp(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor split (``Shard``) over a mesh dimension named "tp": each tensor-parallel
    rank then holds a different part of it (its gradient's local squares add up over the tp ranks).

    Args:
        t: a parameter or gradient (a DTensor under tensor parallelism or FSDP, else a tensor).
    """
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(t, DTensor):
        return False
    names = t.device_mesh.mesh_dim_names or ()
    return any(n == "tp" and isinstance(p, Shard) for n, p in zip(names, t.placements))


def norm_counted(params: list[nn.Parameter], tp_rank: int, own: Collection[int] = ()) -> list[nn.Parameter]:
    """The parameters whose gradients this rank adds to the global norm under tensor parallelism:
    every tp-sharded one (each rank holds its own part), the replicated ones on tp rank 0 only (each
    tp rank holds the same full gradient; counted once).

    Args:
        params: the rank's trainable parameters.
        tp_rank: the rank's tensor-parallel index.
        own: ids of parameters every tensor-parallel rank holds its own of (the experts of an
            expert-parallel group spanning them), counted on each.

    Returns:
        The parameters, in their order.
    """
    return [p for p in params if tp_rank == 0 or id(p) in own or sharded_over_tp(p)]


def check_tp_degree(model: nn.Module, tp_plan: dict[str, str], tp: int) -> None:
    """Check, before any rank starts, that ``tp`` divides every size the plan's tp_plan splits in the
    whole model, heads included, as ``planner plan`` checked its own degree (``check_tp_plan``).

    A plan's tp edited by hand (2 to 4 on a model of 2 key-value heads) passed the width checks of
    ``check_tp_split`` and failed at the first step, after every rank had started.

    Args:
        model: the unsplit model.
        tp_plan: the plan's patterns -> styles.
        tp: the plan's tensor-parallel degree.

    Raises:
        PlanFileError: a split size (features, an embedding's width, a head count) ``tp`` does not divide.
    """
    reason = indivisible_split(model, tp_plan, tp)
    if reason:
        raise PlanFileError(f"the plan's tp {tp} cannot split this model: {reason}, re-planning with `planner plan`")


def check_tp_split(module: nn.Module, tp_plan: dict[str, str], tp: int) -> dict[str, str]:
    """Check, before any rank starts, that a stage module can be split ``tp`` ways by the plan.

    Args:
        module: a stage module, unsharded.
        tp_plan: the plan's patterns -> styles.
        tp: the tensor-parallel ranks.

    Returns:
        The modules the plan shards in this stage (``tp_styles``).

    Raises:
        PlanFileError: ``tp_styles``'s reasons, or a sharded width ``tp`` does not divide (the ranks'
            shards would differ in size, and a layer that reshapes to -1 heads would mix heads).
    """
    styles = tp_styles(module, tp_plan)
    subs = dict(module.named_modules())
    for name, style in styles.items():
        sub = subs[name]
        if isinstance(sub, nn.Linear):
            width, what = (sub.out_features, "output") if style in COLUMN_STYLES else (sub.in_features, "input")
        else:
            assert isinstance(sub, nn.Embedding)
            width, what = (sub.embedding_dim, "embedding") if style in COLUMN_STYLES else (sub.num_embeddings, "row")
        # a colwise_rep linear is gathered whole (torch shards it unevenly); an embedding's width must divide
        if width % tp and (style != "colwise_rep" or isinstance(sub, nn.Embedding)):
            raise PlanFileError(
                f"tp_plan splits {name} {style} over {tp} ranks, but its {what} width {width} is not a multiple "
                f"of {tp}; re-plan with a tp that divides it"
            )
    return styles


def shardable_trace(
    traced: TracedModel,
    model: nn.Module,
    inputs: tuple,
    tp_plan: dict[str, str],
    tp: int,
    graphs: RankGraphs | None = None,
) -> TracedModel:
    """``planner.capture.tp_graph.shardable_trace``: the trace the stages are cut from under tensor
    parallelism (a torch.export graph at one tp rank's sizes, its planned layers modules); ``graphs``:
    the launcher's graphs, rebuilt or collected (``planner.capture.graph_file.RankGraphs``).

    Raises:
        PlanFileError: the plan's split cannot run on this model (the reason, and what to do).
    """
    try:
        return _shardable(traced, model, inputs, tp_plan, tp, graphs)
    except TraceError as e:
        raise PlanFileError(f"{e}; re-plan with tp 1") from e
