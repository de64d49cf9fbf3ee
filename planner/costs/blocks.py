"""The one builder from raw measurements to ``BlockCost``, for every way of getting costs.

The measured graph profiler, the module-boundary profiler and the roofline estimator each produce
times and bytes; what a block *is* (its name, nodes, parameters, the cut after it, whether it is a
repeated layer) comes from the trace, and is filled in here, once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from planner.capture.attention import attention_calls
from planner.capture.blocks import GraphTrace, TracedModel
from planner.schema.costs import BlockCost, StepTempRule
from planner.schema.plan import Tie


@dataclass
class Profile:
    """What profiling measured: the block costs, and what compiling the blocks did.

    Attributes:
        costs: one BlockCost per block, in block order.
        compile_failures: (block name, why) for every block ``torch.compile`` failed on; those
            blocks were timed eagerly.
        compile_s: seconds the untimed first runs of the compiled blocks took beyond ordinary
            runs (compilation, mostly); 0.0 without compile.
        shared: blocks that took an identical earlier block's compiled measurement.
        step_temp_rule: how a stage's optimizer-step temporaries combine its blocks' ("max": per
            tensor, as torch's CPU AdamW; "sum": over all, as a for-each step), from one step
            over all parameters; None when the optimizer was not timed.
    """

    costs: list[BlockCost]
    compile_failures: list[tuple[str, str]] = field(default_factory=list)
    compile_s: float = 0.0
    step_temp_rule: StepTempRule | None = None
    shared: int = 0


def block_cost(
    traced: TracedModel,
    k: int,
    params: list[nn.Parameter],
    *,
    fwd_s: float,
    bwd_s: float,
    activation_bytes: int,
    weight_cast_bytes: int = 0,
    bwd_input_s: float | None = None,
    bwd_weight_s: float | None = None,
    recompute_s: float | None = None,
    selective_recompute_s: float | None = None,
    selective_bytes: int | None = None,
    loss_bytes: int | None = None,
    bwd_temp_bytes: int | None = None,
    loss_temp_bytes: int | None = None,
    flops_fwd: float | None = None,
    flops_bwd: float | None = None,
    opt_s: float | None = None,
    grad_s: float | None = None,
    float_bytes: int | None = None,
    cut_bytes: int | None = None,
    output_bytes: int = 0,
    kv_bytes: int | None = None,
    q_bytes: int | None = None,
) -> BlockCost:
    """The cost record of block ``k`` of ``traced``.

    Args:
        traced: the captured model.
        k: the block's index.
        params: the parameters the block owns (``TracedModel.owned_parameters()[k]``).
        fwd_s: forward seconds per microbatch.
        bwd_s: backward seconds per microbatch.
        activation_bytes: bytes saved for backward by one microbatch, autocast's copies of the
            weights included.
        weight_cast_bytes: of those, the copies (``BlockCost.weight_cast_bytes``); 0 without autocast.
        bwd_input_s: I of F/I/W; None when not measured.
        bwd_weight_s: W of F/I/W; None when not measured.
        recompute_s: extra forward under activation checkpointing; None when not measured.
        selective_recompute_s: extra forward under selective checkpointing; None when not measured.
        selective_bytes: bytes selective checkpointing keeps per microbatch; None when not measured.
        loss_bytes: the last block: what its loss saves for backward; None when not measured.
        bwd_temp_bytes: the peak temporaries of the block's backward from its output's gradient; None
            when not measured.
        loss_temp_bytes: the last block: the same from its loss on; None when not measured.
        flops_fwd: forward FLOPs; None when not counted.
        flops_bwd: backward FLOPs; None when not counted.
        opt_s: the block's share of the optimizer step; None when not timed.
        grad_s: the passes over the block's gradients before the optimizer; None when not timed.
        float_bytes: bytes per floating-point parameter element in the planning dtype (estimates
            for another dtype); None counts the parameters as they are.
        cut_bytes: bytes crossing the cut after the block when they differ from the trace's
            (estimates in another dtype, measurements under autocast); None takes the trace's.
        output_bytes: the last block: bytes of the model's output (0: not known here; the caller
            fills it in from the trace).
        kv_bytes: bytes of the keys and values its attention reads (estimates count them in the
            planning dtype); None takes the trace's (``attention_bytes``).
        q_bytes: the same of its queries.

    Returns:
        The block's costs.
    """
    block = traced.blocks[k]
    cut = traced.cuts[k] if k < len(traced.cuts) else None

    def width(p: nn.Parameter) -> int:
        return float_bytes if float_bytes is not None and p.is_floating_point() else p.element_size()

    if q_bytes is None or kv_bytes is None:  # the trace's, read once
        traced_q, traced_kv = attention_bytes(traced, k)
        q_bytes = traced_q if q_bytes is None else q_bytes
        kv_bytes = traced_kv if kv_bytes is None else kv_bytes
    return BlockCost(
        name=block.name,
        first_node=block.nodes[0],
        last_node=block.nodes[-1],
        fwd_s=fwd_s,
        bwd_s=bwd_s,
        bwd_input_s=bwd_input_s,
        bwd_weight_s=bwd_weight_s,
        recompute_s=recompute_s,
        selective_recompute_s=selective_recompute_s,
        selective_bytes=selective_bytes,
        loss_bytes=loss_bytes,
        bwd_temp_bytes=bwd_temp_bytes,
        loss_temp_bytes=loss_temp_bytes,
        flops_fwd=flops_fwd,
        flops_bwd=flops_bwd,
        opt_s=opt_s,
        grad_s=grad_s,
        params=sum(p.numel() for p in params),
        param_bytes=sum(p.numel() * width(p) for p in params),
        activation_bytes=activation_bytes,
        weight_cast_bytes=weight_cast_bytes,
        cut_bytes=0 if cut is None else (cut.nbytes if cut_bytes is None else cut_bytes),
        cut_tensors=len(cut.tensors) if cut else 0,
        cut_legal=cut.legal if cut else False,
        is_layer=block.is_layer,
        output_bytes=output_bytes,
        kv_bytes=kv_bytes,
        q_bytes=q_bytes,
    )


def attention_dropout(traced: TracedModel) -> float:
    """The largest dropout probability the traced graph's scaled-dot-product attention calls pass (0 for a
    module trace, or where none drops out; a probability the graph computes counts as dropping out).

    Args:
        traced: the captured model (traced in training mode, as it trains).

    Returns:
        The probability (1.0 where the graph computes it).
    """
    if not isinstance(traced, GraphTrace):
        return 0.0
    most = 0.0
    for a in attention_calls(traced.gm.graph.nodes):
        p = a["dropout_p"]
        most = max(most, float(p) if isinstance(p, (int, float)) else 1.0)
    return most


def attention_bytes(traced: TracedModel, k: int) -> tuple[int, int]:
    """What block ``k``'s scaled-dot-product attention reads per microbatch, as traced (0 for a module
    trace, or a block without such a call): the queries of its masked (causal) calls, which context
    parallelism's mirrored blocks swap between ranks, and every call's keys and values, which it
    gathers (``planner.core.levers.context_parallel``).

    Args:
        traced: the captured model.
        k: the block's index.

    Returns:
        (query bytes, key and value bytes).
    """
    if not isinstance(traced, GraphTrace):
        return 0, 0
    nodes = traced.nodes_by_name()

    def nbytes(arg: Any) -> int:
        info = traced.values.get(arg.name) if isinstance(arg, torch.fx.Node) else None
        return info.nbytes if info is not None else 0

    q = kv = 0
    for a in attention_calls(nodes.get(name) for name in traced.blocks[k].nodes):
        q += nbytes(a["query"]) if a["is_causal"] or a["attn_mask"] is not None else 0
        kv += nbytes(a["key"]) + nbytes(a["value"])
    return q, kv


def ties_of(traced: TracedModel, float_bytes: int | None = None) -> list[Tie]:
    """The plan's record of every parameter several blocks read (``TracedModel.tied_parameters``).

    Args:
        traced: the captured model.
        float_bytes: bytes per floating-point element in the planning dtype; None: as stored.

    Returns:
        One ``Tie`` per shared parameter, ordered by the first block that reads it.
    """
    ties = []
    for tie in traced.tied_parameters():
        p = tie.param
        width = float_bytes if float_bytes is not None and p.is_floating_point() else p.element_size()
        ties.append(
            Tie(
                names=tie.names,
                blocks=tuple(traced.blocks[k].name for k in tie.blocks),
                params=p.numel(),
                param_bytes=p.numel() * width,
            )
        )
    return ties
