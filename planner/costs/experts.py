"""What each block's mixture-of-experts layers hold and send: its ``ExpertShare``.

Expert parallelism (``--ep``) shards the experts' weights and moves the rows routed to them, so the
planner needs, per block, its experts' parameters and the bytes its layers dispatch per microbatch
(``planner.core.levers.experts.at_degree`` turns those into one expert-parallel rank's costs). The
parameters come from the model's expert plan (``planner.capture.ep_plan``); the routed rows from
the shapes a torch.export trace records for each experts call's inputs (``traced_rows``), else
from one forward of the example microbatch with a stand-in for each experts module, which reads the
shapes of its inputs (``hidden`` [T, d], ``top_k_index`` [T, k]: T k rows of d features), the
experts themselves never run (``routed_rows``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from planner.capture.blocks import GraphTrace, TracedModel, by_block
from planner.capture.ep_plan import Experts
from planner.capture.expert_calls import calls_of
from planner.errors import ModelFileError
from planner.schema.costs import BlockCost, ExpertShare


def routed_rows(model: nn.Module, inputs: tuple[Any, ...], names: Sequence[str]) -> dict[str, tuple[int, int]]:
    """Rows each experts module receives per microbatch, and their width: ``T x k`` and ``d`` of its
    call ``experts(hidden [T, d], top_k_index [T, k], ...)``, read by a stand-in for its forward that
    returns zeros of the hidden states' shape (the experts' own code, which may read a tensor's value
    to size its groups, never runs: a meta model's forward gets through).

    Args:
        model: the model (any device; on meta nothing is computed).
        inputs: one microbatch's positional inputs, on the model's device.
        names: the experts modules.

    Returns:
        Experts module name -> (rows, width).

    Raises:
        ModelFileError: a module not called, or not with (hidden [T, d], top_k_index [T, k]) first.
    """
    seen: dict[str, tuple[int, int]] = {}

    def stand_in(name: str) -> Any:
        def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
            tensors = [v for v in [*args, *kwargs.values()] if isinstance(v, torch.Tensor)]
            if len(tensors) < 2 or tensors[0].dim() < 1 or tensors[1].dim() < 1:
                raise ModelFileError(
                    f"the experts module {name} is not called as experts(hidden [T, d], top_k_index [T, k], "
                    "top_k_weights [T, k])"
                )
            hidden, index = tensors[0], tensors[1]
            seen[name] = (index.numel(), int(hidden.shape[-1]))
            return torch.zeros_like(hidden)  # the contract's output shape; the experts themselves never run

        return forward

    modules = [model.get_submodule(n) for n in names]
    for name, module in zip(names, modules):
        module.forward = stand_in(name)  # type: ignore[method-assign]
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


def traced_rows(traced: TracedModel) -> dict[str, tuple[int, int]]:
    """``routed_rows`` read off a torch.export trace that recorded the experts' calls: the shapes its
    nodes carry (``meta["val"]``) for each call's hidden states and expert ids; empty where the
    graph carries none (an fx trace: ``routed_rows`` runs the model instead).

    Args:
        traced: the model's trace.

    Returns:
        Experts module name -> (rows, width), for every call the trace recorded, or nothing.
    """
    if not isinstance(traced, GraphTrace):
        return {}
    nodes = traced.nodes_by_name()
    out: dict[str, tuple[int, int]] = {}
    for name, call in calls_of(traced.gm).items():
        hidden, index = (nodes[n].meta.get("val") for n in call.inputs[:2])
        if not isinstance(hidden, torch.Tensor) or not isinstance(index, torch.Tensor):
            return {}
        out[name] = (index.numel(), int(hidden.shape[-1]))
    return out


def with_expert_shares(
    blocks: Sequence[BlockCost], experts: Experts, rows: dict[str, tuple[int, int]], act_bytes: int
) -> list[BlockCost]:
    """The blocks, each holding experts modules with its ``ExpertShare``.

    Args:
        blocks: the blocks' costs (one microbatch).
        experts: the model's experts (``planner.capture.ep_plan.resolve_experts``).
        rows: ``routed_rows`` of the same microbatch.
        act_bytes: bytes of an activation element in the planning dtype.

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
        share = ExpertShare(
            layers=len(mine),
            experts=min(layer.n_experts for layer in mine),
            params=params,
            param_bytes=min(block.param_bytes, round(params * per)),
            dispatch_bytes=sum(rows[layer.name][0] * rows[layer.name][1] * act_bytes for layer in mine),
        )
        out.append(block.model_copy(update={"experts": share}))
    return out


__all__ = ["routed_rows", "traced_rows", "with_expert_shares"]
