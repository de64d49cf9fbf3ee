"""The optimizer and the learning-rate schedule of a run: the plan's optimizer (torch's defaults for
what the plan does not say) and ``--warmup`` / ``--lr-decay``, stepped once per step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, TypeVar

import torch
from torch import nn

from planner.schema.plan import Plan

T = TypeVar("T", bound=torch.Tensor)


def make_optimizer(params: Iterable[nn.Parameter], plan: Plan) -> torch.optim.Optimizer | None:
    """The plan's optimizer with torch's defaults for everything the plan does not say.

    Args:
        params: the parameters to optimize, each once.
        plan: the plan whose optimizer name and learning rate to use.

    Returns:
        ``torch.optim.SGD`` or ``torch.optim.AdamW``; None when there is nothing to optimize (a
        stage of parameter-free blocks, a ReLU say, still runs: it only relays activations).
    """
    params = list(params)
    if not params:
        return None
    groups: Any = params
    kinds = by_kind(params)
    if len(kinds) > 1:
        # Tensor parallelism mixes DTensor and plain parameters, which one foreach kernel refuses;
        # each param group is stepped on its own (same rate, same schedule).
        groups = [{"params": group} for group in kinds]
    if plan.optimizer.name == "sgd":
        return torch.optim.SGD(groups, lr=plan.optimizer.lr)
    return torch.optim.AdamW(groups, lr=plan.optimizer.lr)


def by_kind(tensors: Iterable[T]) -> list[list[T]]:
    """``tensors`` split into the plain tensors and the DTensors of each mesh, in order (one list when
    all are of one kind): one foreach kernel refuses a mix (tensor parallelism leaves norms plain,
    FSDP x tp puts them on the dp mesh and the split layers on the (dp, tp) mesh).

    Args:
        tensors: parameters or gradients.
    """
    from torch.distributed.tensor import DTensor

    kinds: dict[Any, list[T]] = {}
    for t in tensors:
        kinds.setdefault(t.device_mesh if isinstance(t, DTensor) else None, []).append(t)
    return list(kinds.values())


def make_scheduler(optimizer: torch.optim.Optimizer | None, steps: int, warmup: int, decay: str) -> Any | None:
    """The learning-rate schedule of ``planner run`` (``--warmup``, ``--lr-decay``), stepped once per step.

    Args:
        optimizer: the rank's optimizer (None: nothing to schedule).
        steps: the run's last step (a cosine or linear decay reaches 0 there).
        warmup: steps of linear warm-up from 0 to the plan's rate (0: none).
        decay: "constant", "linear" or "cosine" after the warm-up.

    Returns:
        A ``torch.optim.lr_scheduler.LambdaLR``, or None for a constant rate without warm-up
        (or no optimizer).
    """
    if optimizer is None or (warmup == 0 and decay == "constant"):
        return None

    def factor(step: int) -> float:
        # ``step`` counts the optimizer steps taken: 0 for the first step's rate.
        if step < warmup:
            return (step + 1) / warmup
        if decay == "constant":
            return 1.0
        left = max(steps - warmup, 1)
        done = min(step - warmup, left) / left
        return 1.0 - done if decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * done))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
