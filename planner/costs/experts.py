"""What each block's mixture-of-experts layers hold, send and compute: its ``ExpertShare``.

Expert parallelism (``--ep``) shards the experts' weights and moves the rows routed to them, so the
planner needs, per block, its experts' parameters and the bytes its layers dispatch per microbatch
(``planner.core.levers.experts.at_degree`` turns those into one expert-parallel rank's costs). The
parameters come from the model's expert plan (``planner.capture.ep_plan``); the routed rows from
the shapes a torch.export trace records for each experts call's inputs (``traced_rows``), else
from one forward of the example microbatch that reads each experts call's inputs (``hidden`` [T, d],
``top_k_index`` [T, k]: T k rows of d features; ``routed_rows``). On the meta device the experts
never run (a stand-in returns zeros); on a real one they do, and the expert ids the router chose
give each expert's load, whence how unevenly a degree's ranks are loaded (``rank_imbalance``).

Two things change with the degree besides the weights a rank holds:

* the expert GEMMs: at degree ``ep`` a rank runs ``experts / ep`` experts, each on ``ep`` times as
  many rows (an even spread). Few rows per expert leave a grouped GEMM memory-bound on its weights
  (DeepSeek-V3: 256 experts, a 4,096-token microbatch routes 128 rows to each), so sharding the
  experts makes them faster per row. ``expert_gemm_s`` is the roofline's time (``HardwareSpec``:
  the GEMM's FLOPs at ``gemm_efficiency`` of its per-expert shape, or its rows' and weights' bytes
  at the memory bandwidth), for estimated costs;
* the imbalance: the busiest rank receives ``imbalance`` times the mean rows, and every all-to-all
  waits for it. Measured from the router on a real device (``rank_imbalance``), else from
  ``--moe-imbalance``, the busiest expert's rows over the mean (``spread_imbalance``; default
  ``planner.schema.request.MOE_IMBALANCE``, a published figure).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from planner.capture.blocks import GraphTrace, TracedModel, by_block
from planner.capture.ep_plan import ExpertLayer, Experts
from planner.capture.expert_calls import calls_of
from planner.core.levers.hardware import HardwareSpec
from planner.errors import ModelFileError
from planner.schema.costs import BlockCost
from planner.schema.shares import ExpertShare


@dataclass(frozen=True)
class Routed:
    """What one experts module receives per microbatch.

    Attributes:
        rows: routed rows (``T x k``: every token once per expert it is routed to).
        width: features of a row (``d``).
        loads: rows per expert, as the router chose them (None: not run, e.g. on the meta device).
        tokens: the tokens they come from (``T``; 0: not counted, taken as ``rows``).
    """

    rows: int
    width: int
    loads: tuple[int, ...] | None = None
    tokens: int = 0


def routed_rows(model: nn.Module, inputs: tuple[Any, ...], counts: Mapping[str, int]) -> dict[str, Routed]:
    """What each experts module receives per microbatch: ``T x k`` rows of ``d`` features of its call
    ``experts(hidden [T, d], top_k_index [T, k], ...)``, read off one forward of the model. On the meta
    device a stand-in for each experts module returns zeros of the hidden states' shape (the experts'
    own code, which may read a tensor's value to size its groups, never runs: a meta model's forward
    gets through); on a real device the experts run, and the expert ids give each expert's load.

    Args:
        model: the model.
        inputs: one microbatch's positional inputs, on the model's device.
        counts: the experts modules, each with its expert count (``Experts.counts``).

    Returns:
        Experts module name -> what it receives.

    Raises:
        ModelFileError: a module not called, or not with (hidden [T, d], top_k_index [T, k]) first.
    """
    seen: dict[str, Routed] = {}

    def watched(name: str, module: nn.Module, n: int) -> Any:
        original = module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            tensors = [v for v in [*args, *kwargs.values()] if isinstance(v, torch.Tensor)]
            if len(tensors) < 2 or tensors[0].dim() < 1 or tensors[1].dim() < 1:
                raise ModelFileError(
                    f"the experts module {name} is not called as experts(hidden [T, d], top_k_index [T, k], "
                    "top_k_weights [T, k])"
                )
            hidden, index = tensors[0], tensors[1]
            if hidden.is_meta:
                seen[name] = Routed(index.numel(), int(hidden.shape[-1]), tokens=_tokens(index))
                return torch.zeros_like(hidden)  # the contract's output shape; the experts themselves never run
            loads = torch.bincount(index.reshape(-1).long().clamp(0, n - 1), minlength=n)
            seen[name] = Routed(
                index.numel(), int(hidden.shape[-1]), tuple(int(x) for x in loads.tolist()), tokens=_tokens(index)
            )
            return original(*args, **kwargs)

        return forward

    names = list(counts)
    modules = [model.get_submodule(n) for n in names]
    for name, module in zip(names, modules):
        module.forward = watched(name, module, counts[name])  # type: ignore[method-assign]
    try:
        with torch.no_grad():
            model(*inputs)
    finally:
        for module in modules:
            del module.forward  # the class's forward again
    missing = [n for n in names if n not in seen]
    if missing:
        raise ModelFileError(f"the forward never calls the experts module {missing[0]}")
    return seen


def traced_rows(traced: TracedModel) -> dict[str, Routed]:
    """``routed_rows`` read off a torch.export trace that recorded the experts' calls: the shapes its
    nodes carry (``meta["val"]``) for each call's hidden states and expert ids (no loads: the trace
    holds no values); empty where the graph carries none (an fx trace: ``routed_rows`` runs the model
    instead).

    Args:
        traced: the model's trace.

    Returns:
        Experts module name -> what it receives, for every call the trace recorded, or nothing.
    """
    if not isinstance(traced, GraphTrace):
        return {}
    nodes = traced.nodes_by_name()
    out: dict[str, Routed] = {}
    for name, call in calls_of(traced.gm).items():
        hidden, index = (nodes[n].meta.get("val") for n in call.inputs[:2])
        if not isinstance(hidden, torch.Tensor) or not isinstance(index, torch.Tensor):
            return {}
        out[name] = Routed(index.numel(), int(hidden.shape[-1]), tokens=_tokens(index))
    return out


def _tokens(index: torch.Tensor) -> int:
    """The tokens of an experts call's expert ids ``[..., k]``: one per row of ``k`` ids."""
    return index.numel() // max(1, int(index.shape[-1])) if index.dim() else index.numel()


def rank_imbalance(loads: Sequence[Sequence[int]], ep: int) -> float:
    """How unevenly ``ep`` ranks are loaded, each holding a consecutive ``1 / ep`` of every layer's
    experts (as ``planner.run.experts`` shards them): the sum over layers of the busiest rank's rows
    over the sum of the mean rows (each layer's all-to-all waits for its busiest rank).

    Args:
        loads: per layer, the rows routed to each expert.
        ep: the degree (divides every layer's expert count).

    Returns:
        The factor, at least 1 (1 with no rows).
    """
    busiest = mean = 0.0
    for layer in loads:
        per = len(layer) // ep
        ranks = [sum(layer[r * per : (r + 1) * per]) for r in range(ep)]
        busiest += max(ranks)
        mean += sum(ranks) / ep
    return max(1.0, busiest / mean) if mean > 0 else 1.0


def spread_imbalance(expert: float, n_experts: int, ep: int) -> float:
    """The busiest of ``ep`` ranks' rows over the mean, from the busiest expert's over the mean (``expert``,
    what MaxVio + 1 measures): a rank holds ``n_experts / ep`` experts, whose loads' excesses, taken as
    independent, add up as a square root while their mean adds up linearly, so the rank's excess is the
    expert's over the square root of the experts it holds (the expert's own with one expert per rank).

    Args:
        expert: the busiest expert's routed rows over the mean, at least 1.
        n_experts: experts per layer.
        ep: the degree (divides ``n_experts``).

    Returns:
        The factor, 1 at ``ep`` 1.
    """
    if ep <= 1:
        return 1.0
    return 1.0 + (expert - 1.0) / math.sqrt(n_experts / ep)


def expert_gemm_s(hw: HardwareSpec, peak: float, layer: ExpertLayer, rows: float, ep: int, width: int) -> float:
    """The roofline's forward seconds of one layer's expert GEMMs on one of ``ep`` ranks that
    receives ``rows`` rows: per weight matrix (a, b), one grouped GEMM of ``rows`` rows over the rank's
    ``n_experts / ep`` experts, ``2 rows a b`` FLOPs at ``gemm_efficiency`` of one expert's share
    ``(rows ep / n_experts, a, b)``, or the rows in and out and the experts' weights at the memory's
    bandwidth, whichever is longer; one kernel each (``planner.costs.roofline`` charges a grouped
    GEMM so).

    Args:
        hw: the hardware.
        peak: FLOP/s of the dtype the experts run in.
        layer: the experts module (its ``matrices``).
        rows: rows the rank receives.
        ep: the degree.
        width: bytes of an element.

    Returns:
        Seconds.
    """
    local = layer.n_experts // ep
    per_expert = max(1, round(rows / local)) if local else 1
    total = 0.0
    for a, b in layer.matrices:
        compute = 2.0 * rows * a * b / (peak * hw.gemm_efficiency(per_expert, a, b))
        memory = (rows * (a + b) + local * a * b) * width / (hw.memory_Bps * hw.memory_efficiency)
        roof = max(compute, memory)
        total += max(roof, hw.op_overhead_s) if hw.async_launch else roof + hw.op_overhead_s
    return total


@dataclass(frozen=True)
class ExpertCosting:
    """How the shares cost the expert GEMMs and the imbalance.

    Attributes:
        act_bytes: bytes of an activation element in the planning dtype.
        hardware: the hardware of estimated costs (the GEMMs' ``gemm_s``); None: measured costs.
        peak: FLOP/s of the planning dtype on ``hardware``.
        imbalance: the busiest expert's rows over the mean (``--moe-imbalance``; a rank's follows by
            ``spread_imbalance``); None: measured from the router where it ran (``Routed.loads``), else 1.
    """

    act_bytes: int
    hardware: HardwareSpec | None = None
    peak: float = 0.0
    imbalance: float | None = None


def with_expert_shares(
    blocks: Sequence[BlockCost], experts: Experts, routed: Mapping[str, Routed], costing: ExpertCosting
) -> list[BlockCost]:
    """The blocks, each holding experts modules with its ``ExpertShare``.

    Args:
        blocks: the blocks' costs (one microbatch).
        experts: the model's experts (``planner.capture.ep_plan.resolve_experts``).
        routed: ``routed_rows`` of the same microbatch.
        costing: how to cost the GEMMs and the imbalance.

    Returns:
        The blocks; a block that holds experts modules carries their share, the rest unchanged.
    """
    held = by_block([b.name for b in blocks], {layer.name: layer for layer in experts.layers})
    out: list[BlockCost] = []
    for block in blocks:
        mine = list(held.get(block.name, {}).values())
        if not mine:
            out.append(block)
            continue
        params = min(block.params, sum(layer.params for layer in mine))
        # the block counts its parameters in the planning dtype (an estimate) or as built: its own bytes per element
        per = block.param_bytes / block.params if block.params else 0.0
        common = min(layer.n_experts for layer in mine)
        degrees = [d for d in range(1, common + 1) if all(layer.n_experts % d == 0 for layer in mine)]
        imbalance = _imbalance(mine, routed, degrees, costing.imbalance)
        share = ExpertShare(
            layers=len(mine),
            experts=common,
            params=params,
            param_bytes=min(block.param_bytes, round(params * per)),
            dispatch_bytes=sum(
                routed[layer.name].rows * routed[layer.name].width * costing.act_bytes for layer in mine
            ),
            rows=sum(routed[layer.name].rows for layer in mine),
            token_bytes=sum(
                (routed[layer.name].tokens or routed[layer.name].rows) * routed[layer.name].width * costing.act_bytes
                for layer in mine
            ),
            flops_fwd=sum(2.0 * routed[layer.name].rows * sum(a * b for a, b in layer.matrices) for layer in mine),
            saved_bytes=sum(
                routed[layer.name].rows * sum(a + b for a, b in layer.matrices) * costing.act_bytes for layer in mine
            ),
            gemm_s=_gemms(mine, routed, degrees, imbalance, costing),
            imbalance=imbalance,
        )
        out.append(block.model_copy(update={"experts": share}))
    return out


def _imbalance(
    layers: Sequence[ExpertLayer], routed: Mapping[str, Routed], degrees: Sequence[int], given: float | None
) -> dict[int, float]:
    """Per degree above 1, the busiest rank's rows over the mean: ``given``, else the router's loads."""
    if given is not None:
        n = min(layer.n_experts for layer in layers)
        return {d: round(spread_imbalance(given, n, d), 4) for d in degrees if d > 1}
    loads = [routed[layer.name].loads for layer in layers]
    if any(load is None for load in loads):
        return {}
    return {d: round(rank_imbalance([load for load in loads if load is not None], d), 4) for d in degrees if d > 1}


def _gemms(
    layers: Sequence[ExpertLayer],
    routed: Mapping[str, Routed],
    degrees: Sequence[int],
    imbalance: Mapping[int, float],
    costing: ExpertCosting,
) -> dict[int, float]:
    """Per degree, the forward seconds of the layers' expert GEMMs on the busiest rank (estimated costs)."""
    hw = costing.hardware
    if hw is None or not all(layer.matrices for layer in layers):
        return {}
    return {
        d: sum(
            expert_gemm_s(
                hw, costing.peak, layer, routed[layer.name].rows * imbalance.get(d, 1.0), d, costing.act_bytes
            )
            for layer in layers
        )
        for d in degrees
    }


__all__ = [
    "ExpertCosting",
    "Routed",
    "expert_gemm_s",
    "rank_imbalance",
    "routed_rows",
    "traced_rows",
    "with_expert_shares",
]
