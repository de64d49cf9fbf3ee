"""The splits other tools would choose, evaluated on the planner's own costs.

Pure module (numpy, no torch). ``uniform_layers`` is torchtitan's and Megatron's default (equal
layer counts per stage), ``param_balanced`` DeepSpeed's ``partition_method="parameters"``; each is
costed by ``planner.core.split.stage_model.evaluate``, so the report can set them beside the plan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from planner.core.levers.links import Links
from planner.core.split.cuts import Split
from planner.core.split.solve_engine import (
    BoolArray,
    FloatArray,
    IntArray,
    Stages,
    banded_pairs,
    check_counts,
    exact_partition,
    last_true,
    legal_starts,
    stage_bands,
)
from planner.core.split.stage_model import Partition, evaluate
from planner.errors import InfeasibleError
from planner.schema.costs import BlockCost


def uniform_layers(blocks: Sequence[BlockCost], n_stages: int, link: Links) -> Partition:
    """Equal numbers of layers per stage: the torchtitan / Megatron default split.

    The ``is_layer`` blocks are dealt out in order, ``L // p`` per stage and one extra to each of the
    first ``L % p`` stages (torchtitan gives the remainder to the earliest stages). Non-layer blocks
    before the first layer join stage 0, those after the last layer join the last stage, and those
    between layers stay with the preceding layer, so stage k > 0 starts exactly at its first layer.
    If that start is not a legal cut, it moves to the nearest legal start that keeps the stages
    non-empty and increasing (the earlier one on a tie).

    Args:
        blocks: per-block costs in execution order.
        n_stages: number of stages p.
        link: cost of one message between neighbouring ranks (or one per boundary).

    Returns:
        The split with its bottleneck evaluated on the real stage costs (communication included).

    Raises:
        InfeasibleError: fewer layers than stages, too few blocks or legal cuts.
    """
    check_counts(blocks, n_stages)
    n = len(blocks)
    layers = [i for i, b in enumerate(blocks) if b.is_layer]
    if len(layers) < n_stages:
        raise InfeasibleError(
            f"the model has {len(layers)} layer blocks but --gpus is {n_stages}; expected at least one "
            "layer per stage for an equal-layer split; use fewer stages."
        )
    per, extra = divmod(len(layers), n_stages)
    legal = legal_starts(blocks)
    starts = [0]
    first_layer = 0
    for k in range(1, n_stages):
        first_layer += per + (1 if k - 1 < extra else 0)
        target = layers[first_layer]
        hi = n - (n_stages - k)  # leave one block for each later stage
        chosen = None
        for d in range(n):
            for c in (target - d, target + d):
                if starts[-1] < c <= hi and legal[c]:
                    chosen = c
                    break
            if chosen is not None:
                break
        if chosen is None:
            raise InfeasibleError(
                f"no legal cut is left for stage {k} of the equal-layer split; expected a cuttable "
                "boundary between the previous stage and the end; use fewer stages."
            )
        starts.append(chosen)
    return evaluate(blocks, Split(starts=tuple(starts)), link)


def param_balanced(blocks: Sequence[BlockCost], n_stages: int, link: Links) -> Partition:
    """Minimise the largest per-stage parameter count: DeepSpeed ``partition_method="parameters"``.

    DeepSpeed's ``partition_balanced`` minimised the max part weight over per-layer parameter
    counts by bisection (its greedy ``_lprobe``); this solves that objective exactly with the
    partition DP, on legal cuts only, with non-empty stages. Among equal optima it picks the
    lexicographically largest starts, i.e. the earlier stages as full as possible, as ``_lprobe``
    did. DeepSpeed 0.19's ``partition_balanced`` is a dynamic programme minimising the spread (the
    largest part minus the smallest) instead, which can choose another split (Llama 3 8B on 8
    stages: 3+5+5+5+5+4+4+4 blocks against 3+5+5+5+5+5+5+2 here); give DeepSpeed's own parts with
    ``--compare parts:...`` to cost exactly its split (``bench/interop_compare.py`` does).

    Args:
        blocks: per-block costs in execution order.
        n_stages: number of stages p.
        link: cost of one message between neighbouring ranks (or one per boundary).

    Returns:
        The split with its bottleneck evaluated on the real stage costs (communication included).

    Raises:
        InfeasibleError: too few blocks or legal cuts.
    """
    check_counts(blocks, n_stages)
    n = len(blocks)
    pre = [0]
    for b in blocks:
        pre.append(pre[-1] + b.params)
    counts = np.array(pre, dtype=np.int64 if pre[-1] < 2**62 else object)
    legal = legal_starts(blocks)
    first: IntArray = np.array([0] + [c for c in range(1, n) if legal[c]], dtype=np.int64)
    end_ok: BoolArray = np.array(legal[:n] + [True])

    def params(s: IntArray, e: IntArray) -> FloatArray:
        # float(pre[e] - pre[s]): the exact integer difference, rounded once
        out: FloatArray = np.asarray(counts[e] - counts[s]).astype(np.float64)
        return out

    def ranges(cap: float) -> Stages:
        last = np.full_like(first, n) if cap == math.inf else last_true(first, n, lambda s, e: params(s, e) <= cap)
        band = stage_bands(n, n_stages, first, last, lambda s, e: float(pre[e] - pre[s]) <= cap)
        s, e = banded_pairs(n, n_stages, first, last, end_ok, *band)
        c = params(s, e)
        ones = np.ones(len(s), dtype=np.int64)
        # Parameters have no memory check: every stage "fits" (t0 >= the one in-flight count, 0).
        row = c[np.newaxis, :]
        return Stages(n, (s, e), (row, row), (ones, -ones), bool((last == n).all()), (0, 0), band)

    first_cap = pre[-1] / n_stages + max(b.params for b in blocks)
    starts = exact_partition(n, n_stages, [0] * n_stages, ranges, first_cap, latest=True)
    assert starts is not None  # check_counts guarantees a partition without memory limits
    return evaluate(blocks, Split(starts=tuple(starts)), link)


BASELINE_NAMES = {"uniform": "equal-layer", "params": "parameter-balanced"}
"""The baselines' splits by name, as the plan's notes name them."""


def layers_or_all(blocks: Sequence[BlockCost]) -> list[BlockCost]:
    """Blocks for the uniform-layer baseline: a model without repeated layers counts every block."""
    if any(b.is_layer for b in blocks):
        return list(blocks)
    return [b.model_copy(update={"is_layer": True}) for b in blocks]


def baseline_splits(
    blocks: Sequence[BlockCost], n_stages: int, link: Links, required: str = ""
) -> dict[str, Partition]:
    """The baselines' splits of ``blocks`` into ``n_stages`` stages, by name ("uniform": equal layer
    counts, ``uniform_layers`` of ``layers_or_all``; "params": ``param_balanced``), those that can
    split the model.

    Args:
        blocks: per-block costs.
        n_stages: the stages to cut.
        link: the links the splits' messages are costed on.
        required: a baseline whose failure is raised rather than left out (the plan's ``--method``).

    Returns:
        The splits, by name (a baseline that cannot split the model left out).

    Raises:
        InfeasibleError: ``required`` cannot split the model.
    """
    out: dict[str, Partition] = {}
    for name in BASELINE_NAMES:
        try:
            if name == "uniform":
                out[name] = uniform_layers(layers_or_all(blocks), n_stages, link)
            else:
                out[name] = param_balanced(blocks, n_stages, link)
        except InfeasibleError:
            if name == required:
                raise
            continue
    return out
