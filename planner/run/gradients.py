"""Finishing a step's gradients: what turns the microbatches' accumulated gradients into the step's
(averaged over microbatches once per parameter, tied copies summed across their ranks, averaged
over the replicas where DDP cannot), and the clipping by the global norm over every stage.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from planner.capture.blocks import TiedParameter
from planner.run.mesh import RankMesh
from planner.run.optim import by_kind
from planner.schema.plan import Plan
from planner.torch_compat import flatten_dense, unflatten_dense


def tie_groups(plan: Plan, ties: list[TiedParameter]) -> list[tuple[TiedParameter, list[int]]]:
    """For each tie, the ranks holding a copy of its parameter, the owner's rank first.

    Args:
        plan: the plan (which stage runs which blocks, on which rank).
        ties: ``check_ties(plan, traced)``.

    Returns:
        (tie, ranks) per tie; ranks has one entry when every reader sits on one rank (one copy).
    """
    # stages in order, so the owner's (the first reader's) rank comes first
    return [(tie, list(dict.fromkeys(plan.stages[i].rank for i in plan.stages_reading(tie.blocks)))) for tie in ties]


def grad_finisher(
    plan: Plan,
    ties: list[TiedParameter],
    mesh: RankMesh,
    params: list[torch.nn.Parameter],
    tensors: dict[str, torch.Tensor],
    *,
    average: bool = False,
    experts: list[torch.nn.Parameter] | None = None,
) -> tuple[Callable[[], None], set[int]]:
    """What turns the microbatches' accumulated gradients into the step's, and the tied copies this
    rank must leave out of the global norm.

    1. Every gradient is divided by the microbatch count (of all ``plan.accumulation`` passes), once
       per parameter. (torch's
       ``scale_grads=True`` divides per stage, so a tied parameter that two stages on one rank share
       would be divided twice.) With a mean-reduced loss this gives the replica's batch gradient;
       DDP / FSDP have already averaged it over the replicas.
    2. Each tied parameter's gradient is summed over the ranks of one replica holding a copy, so
       every copy takes the same step. Every rank creates every group, in the same order
       (``dist.new_group`` is collective over the whole world), and joins the all-reduce of the
       groups it is in. Under FSDP the copies are sharded alike, so their local shards are summed.

    A tie's parameter is looked up by name in ``tensors`` (the rank's state after wrapping):
    FSDP replaces the traced parameter by a sharded one. With ``average`` the gradients are also
    averaged over the replicas here (DDP's all-reduce, for schedules DDP cannot follow).

    3. Under expert parallelism this rank's experts (``experts``, which DDP leaves alone) hold the
       gradient of every token routed to them from the ``ep`` replicas of its group: summed over
       the groups (the ranks holding the same experts) and divided by the replica count, they are
       the batch's mean gradient, as DDP's average is for the rest.

    Args:
        plan: the plan (microbatches, replicas, which rank holds which stage).
        ties: ``check_ties(plan, traced)``, the same list on every rank.
        mesh: this rank's place and groups.
        params: this rank's trainable parameters, each once.
        tensors: the unsplit model's name -> this rank's tensor (after wrapping).
        average: average over the replicas here too.
        experts: this rank's share of the expert-parallel layers' experts (None: none).

    Returns:
        (the function to call after each step's backward, the ids of the tied copies to leave out
        of the global norm).
    """
    mine: list[tuple[torch.nn.Parameter, Any]] = []
    not_counted: set[int] = set()
    for tie, ranks in tie_groups(plan, ties):
        if len(ranks) < 2:
            continue  # one rank holds every reader: its stages share the one parameter
        # one group per replica and tensor-parallel index: a pipeline rank's tp ranks each hold a copy
        for replica, tp_rank in [(d, t) for d in range(plan.replicas) for t in range(plan.tp)]:
            group = dist.new_group([plan.global_rank(replica, r, tp_rank) for r in ranks])
            if replica == mesh.replica and tp_rank == mesh.tp_rank and mesh.pp_rank in ranks:
                param = next((tensors[n] for n in tie.names if n in tensors), tie.param)
                mine.append((param, group))  # type: ignore[arg-type]
                if mesh.pp_rank != ranks[0]:
                    not_counted.add(id(param))
    # every microbatch of every pass (gradient accumulation) added its mean-loss gradient
    scale = 1.0 / (plan.n_microbatches * plan.accumulation)
    own = {id(p) for p in experts or ()}

    def finish() -> None:
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(scale)
        if average and mesh.dp_group is not None:
            average_over_replicas([p for p in params if id(p) not in own], mesh.dp_group, plan.replicas)
        if own:
            _average_experts(list(experts or ()), mesh.edp_group, plan.replicas)
        for param, group in mine:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(local_part(param.grad), op=dist.ReduceOp.SUM, group=group)

    return finish, not_counted


def _average_experts(params: list[torch.nn.Parameter], group: Any | None, replicas: int) -> None:
    """Expert gradients summed over the ranks holding the same experts (``group``; None: this rank's
    group is all the replicas) and divided by ``replicas``: the batch's mean gradient."""
    if group is not None:
        average_over_replicas(params, group, replicas)
        return
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.grad.div_(replicas)


def average_over_replicas(params: list[torch.nn.Parameter], group: Any, replicas: int) -> None:
    """Average the gradients over the replicas in one all-reduce per dtype (a missing one counts as 0).

    Args:
        params: this rank's trainable parameters; their gradients are replaced by the averages.
        group: the ranks holding the same stages in the other replicas.
        replicas: how many there are (this one included).
    """
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        assert p.grad is not None
        by_dtype.setdefault(p.grad.dtype, []).append(local_part(p.grad))  # a DTensor's (tensor parallel) shard
    with torch.no_grad():
        for grads in by_dtype.values():
            flat = flatten_dense(grads)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            flat.div_(replicas)
            for g, reduced in zip(grads, unflatten_dense(flat, grads)):
                g.copy_(reduced)


def local_sq_norm(params: Iterable[nn.Parameter]) -> torch.Tensor:
    """Sum of squared gradient entries over ``params``.

    Args:
        params: parameters, with or without a gradient.

    Returns:
        A float64 scalar tensor; 0 when no parameter has a gradient.
    """
    # A sharded (FSDP) gradient counts its local shard; the caller sums over every rank.
    grads = [local_part(p.grad) for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    return torch.nn.utils.get_total_norm(grads).to(torch.float64) ** 2


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a DTensor (FSDP), else the tensor.

    Args:
        t: a tensor or a DTensor.

    Returns:
        A plain tensor (a view of the DTensor's local shard).
    """
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def clip_to_global_norm(
    params: list[nn.Parameter],
    max_norm: float | None,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    counted: list[nn.Parameter] | None = None,
) -> float:
    """Clip by the norm of the WHOLE model's gradient, as ``clip_grad_norm_`` on the unsplit model would.

    Each stage only holds its own gradients, so the squared norms are summed over the pipeline
    group first.

    Args:
        params: this rank's trainable parameters; their gradients are scaled in place.
        max_norm: the global norm to clip to (None: measure only).
        reduce: sums a tensor over the pipeline group (an all-reduce(SUM)); None in one process.
        counted: the parameters whose gradients enter the norm (None: all of ``params``); a tied
            parameter's copies on other ranks are left out, so the model counts it once.

    Returns:
        The global gradient norm before clipping.
    """
    sq = local_sq_norm(params if counted is None else counted)
    if reduce is not None:
        sq = reduce(sq)
    total = math.sqrt(float(sq))
    if max_norm is not None:
        device = next((p.grad.device for p in params if p.grad is not None), torch.device("cpu"))
        norm = torch.tensor(total, dtype=torch.float32, device=device)
        # DTensor and plain gradients (tensor parallelism) in separate foreach calls, which refuse a mix
        for kind in by_kind(params):
            torch.nn.utils.clip_grads_with_norm_(kind, max_norm, norm)
    return total


def clip_and_step(
    params: list[nn.Parameter],
    optimizer: torch.optim.Optimizer | None,
    max_norm: float | None,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    counted: list[nn.Parameter] | None = None,
) -> tuple[float, float, float]:
    """End a training step: clip to the global norm (``clip_to_global_norm``), then step the optimizer.

    Args:
        params: this rank's trainable parameters.
        optimizer: their optimizer (None: the rank has no parameters; it still joins the all-reduce).
        max_norm: the global norm to clip to (None: no clipping).
        reduce: sums a tensor over the pipeline group; None in one process.
        counted: the parameters whose gradients enter the norm (None: all of ``params``).

    Returns:
        (global norm before clipping, seconds clipping took, seconds the optimizer step took).
    """
    t0 = time.perf_counter()
    norm = clip_to_global_norm(params, max_norm, reduce, counted)
    t1 = time.perf_counter()
    if optimizer is not None:
        optimizer.step()
        # a GPU's step runs after the call returns: wait for it, or its time lands in the next forward
        # (docs/gpu_recompute.md: 3.4 ms timed for an AdamW step over 1.49 B parameters)
        devices = {p.device for p in params if p.device.type == "cuda"}
        for device in devices:
            torch.cuda.synchronize(device)
    return norm, t1 - t0, time.perf_counter() - t1
