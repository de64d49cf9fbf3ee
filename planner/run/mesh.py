"""Where a rank sits: its process group (joined torchrun-style, or a group of one in this process)
and its place on the plan's (dp, pp) mesh, with the groups it talks in.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from planner.errors import PlannerError
from planner.schema.plan import Plan
from planner.schema.request import RunRequest


@dataclass(frozen=True)
class RankMesh:
    """Where this rank sits on the (dp, pp) mesh and the groups it talks in.

    Attributes:
        rank: the global rank.
        pp_rank: its rank in its pipeline (which stages it runs).
        replica: its data-parallel replica.
        pp_group: its pipeline's ranks (point-to-point, the gradient norm).
        dp_group: the ranks running the same stages in the other replicas (None: one replica).
        dp_mesh: those ranks as a 1-D ``DeviceMesh`` (FSDP shards over it; None: one replica).
    """

    rank: int
    pp_rank: int
    replica: int
    pp_group: Any
    dp_group: Any | None
    dp_mesh: Any | None


def rank_mesh(plan: Plan, rank: int, device: torch.device) -> RankMesh:
    """The (dp, pp) mesh of the plan (laid out as ``Plan`` documents: global = replica x pp + pp rank).

    Args:
        plan: the plan (replicas, pipeline ranks).
        rank: this process's global rank.
        device: this rank's device (the ``DeviceMesh``'s type).

    Returns:
        This rank's place and groups (the world group as its pipeline under one replica).
    """
    if plan.dp == 1:
        return RankMesh(rank, rank, 0, dist.group.WORLD, None, None)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (plan.dp, plan.n_ranks), mesh_dim_names=("dp", "pp"))
    return RankMesh(
        rank=rank,
        pp_rank=plan.pp_rank_of(rank),
        replica=plan.replica_of(rank),
        pp_group=mesh["pp"].get_group(),
        dp_group=mesh["dp"].get_group(),
        dp_mesh=mesh["dp"],
    )


@contextlib.contextmanager
def joined_group(plan: Plan, request: RunRequest) -> Iterator[tuple[RankMesh, torch.device]]:
    """Join the process group torchrun-style (from the environment) for the block, then leave it.

    Args:
        plan: the plan (ranks, backend, threads).
        request: ``planner run``'s options (``--timeout``).

    Yields:
        This rank's mesh and device.

    Raises:
        PlannerError: another number of processes joined than the plan has ranks.
    """
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    if world != plan.world_size:
        raise PlannerError(
            f"{world} processes joined the run but the plan has {plan.world_size} ranks "
            f"({plan.dp} replica(s) x {plan.n_ranks}); start world_size / nnodes processes on every node"
        )
    torch.set_num_threads(plan.profile.threads)
    backend = plan.profile.backend
    # Every wait on another rank (a collective, a point-to-point receive) is bounded by --timeout,
    # so a hung or stopped rank ends the run instead of holding the others for gloo's 30 minutes.
    timeout = datetime.timedelta(seconds=request.timeout_s)
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    try:
        yield rank_mesh(plan, rank, device), device
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def group_of_one(plan: Plan, request: RunRequest) -> Iterator[tuple[RankMesh, torch.device]]:
    """A process group of one in this process (a gloo group over an in-memory store) for the block.

    Args:
        plan: a plan whose ``world_size`` is 1.
        request: ``planner run``'s options (``--timeout``).

    Yields:
        The mesh of rank 0 and its device.
    """
    torch.set_num_threads(plan.profile.threads)
    if plan.profile.backend == "nccl":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    store = dist.HashStore()
    timeout = datetime.timedelta(seconds=request.timeout_s)
    dist.init_process_group(plan.profile.backend, store=store, rank=0, world_size=1, timeout=timeout)
    try:
        yield rank_mesh(plan, 0, device), device
    finally:
        dist.destroy_process_group()
