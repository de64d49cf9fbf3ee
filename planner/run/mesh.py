"""Where a rank sits: its process group (joined torchrun-style, or a group of one in this process)
and its place on the plan's (dp, pp, tp) mesh (dp x cp replicas under context parallelism), with the groups it talks in.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from planner.errors import PlannerError
from planner.schema.plan import Plan
from planner.schema.run_request import RunRequest


@dataclass(frozen=True)
class RankMesh:
    """Where this rank sits on the (dp, pp, tp) mesh and the groups it talks in.

    Attributes:
        rank: the global rank.
        pp_rank: its rank in its pipeline (which stages it runs).
        replica: its data-parallel replica.
        pp_group: its pipeline's ranks with its tensor-parallel index (point-to-point; the
            gradient norm when tp is 1).
        dp_group: the ranks running the same stages in the other replicas (None: one replica).
        dp_mesh: those ranks as a 1-D ``DeviceMesh`` (FSDP shards over it; None: one replica).
        tp_rank: its index among its pipeline rank's tensor-parallel ranks (0 when tp is 1).
        tp_mesh: those ranks as a 1-D ``DeviceMesh`` (the stages are sharded over it; None: tp 1).
        replica_group: every rank of its replica, pipeline and tensor-parallel (the gradient norm
            under tp > 1; None: tp 1).
        norm_group: under HSDP, every rank of its shard group's replicas (each holds a shard of
            every gradient once among them: the gradient norm's group); under expert parallelism,
            every rank of its expert-parallel group's replicas; None otherwise.
        ep_rank: its index in its expert-parallel group (0 when ep is 1).
        ep_mesh: its expert-parallel group, ``ep`` consecutive ranks of the same pipeline rank (the
            tensor-parallel ranks of ``Plan.ep_replicas`` replicas), as a 1-D ``DeviceMesh`` (experts
            are dispatched over it; None: ep 1).
        edp_group: the ranks holding the same experts in the other expert-parallel groups (expert
            gradients are summed over it; None: ep 1, or one group).
        edp_mesh: those ranks as a ``DeviceMesh``, one group included (under FSDP the experts are
            sharded over it; under HSDP 2-D, (dp_replicate, edp_shard): sharded inside a shard
            group, replicated over the groups; None: ep 1).
        experts_mesh: under FSDP or HSDP, the expert-parallel group and ``edp_mesh`` as one
            ``DeviceMesh`` ordered (ep, ...edp_mesh's): an expert parameter's shard is its piece of
            the whole layer's tensor on it (``Shard(0)`` over ep, then FSDP's placements), the view a
            checkpoint saves (None: not sharded, or ep 1).
        cp_rank: its index in its context-parallel group, the chunk of the sequence it runs (0 when
            cp is 1).
        cp_mesh: that group, the ``cp`` consecutive replicas of its data-parallel replica at its
            pipeline and tensor-parallel position, as a 1-D ``DeviceMesh`` (attention gathers keys and
            values over it; None: cp 1).
        cp_tp_mesh: that group and its tensor-parallel ranks as one 2-D ``(cp, tp)`` ``DeviceMesh``
            (under sequence parallelism a chunk is split again over the tp ranks; None: cp or tp 1).
    """

    rank: int
    pp_rank: int
    replica: int
    pp_group: Any
    dp_group: Any | None
    dp_mesh: Any | None
    tp_rank: int = 0
    tp_mesh: Any | None = None
    replica_group: Any | None = None
    norm_group: Any | None = None
    ep_rank: int = 0
    ep_mesh: Any | None = None
    edp_group: Any | None = None
    edp_mesh: Any | None = None
    experts_mesh: Any | None = None
    cp_rank: int = 0
    cp_mesh: Any | None = None
    cp_tp_mesh: Any | None = None

    def data_replica(self, plan: Plan) -> int:
        """The data-parallel replica whose rows this rank reads: ``replica // cp``."""
        return self.replica // plan.cp


def rank_mesh(plan: Plan, rank: int, device: torch.device) -> RankMesh:
    """The (dp, pp, tp) mesh of the plan, laid out as ``Plan`` documents and torch's ``DeviceMesh``
    does (``torch.arange(world).view(dp, pp, tp)``: global = (replica x pp + pp rank) x tp + tp rank;
    an expert-parallel plan's pipeline-outermost, ``view(pp, dp)``: ``Plan.pp_outer``). With tp 1 it is
    the (dp, pp) mesh; with one replica and tp 1 no ``DeviceMesh`` is made at all.

    Args:
        plan: the plan (replicas, pipeline ranks).
        rank: this process's global rank.
        device: this rank's device (the ``DeviceMesh``'s type).

    Returns:
        This rank's place and groups (the world group as its pipeline under one replica).
    """
    if plan.replicas == 1 and plan.tp == 1:
        return RankMesh(rank, rank, 0, dist.group.WORLD, None, None)
    from torch.distributed.device_mesh import init_device_mesh

    if plan.dp_mode == "hsdp":
        return _mesh_hsdp(plan, rank, device)
    if plan.tp > 1:
        return _mesh_3d(plan, rank, device)
    if plan.pp_outer:  # the mesh's dimensions in the order of the ranks (a DeviceMesh is indexed by name)
        mesh = init_device_mesh(device.type, (plan.n_ranks, plan.replicas), mesh_dim_names=("pp", "dp"))
    else:
        mesh = init_device_mesh(device.type, (plan.replicas, plan.n_ranks), mesh_dim_names=("dp", "pp"))
    placed = RankMesh(
        rank=rank,
        pp_rank=plan.pp_rank_of(rank),
        replica=plan.replica_of(rank),
        pp_group=mesh["pp"].get_group(),
        dp_group=mesh["dp"].get_group(),
        dp_mesh=mesh["dp"],
    )
    return _with_experts(plan, placed, device) if plan.ep > 1 else _with_context(plan, placed, device)


def _with_context(plan: Plan, placed: RankMesh, device: torch.device) -> RankMesh:
    """``placed`` with its context-parallel group (``cp`` > 1; else as it is): replica ``r`` runs chunk
    ``r % cp`` of data-parallel replica ``r // cp``'s sequences, so a group is ``cp`` consecutive
    replicas at one pipeline and tensor-parallel position (``view(dp, cp, pp, tp)`` of the ranks;
    ``view(pp, dp, cp, tp)`` where they are pipeline-outermost, ``Plan.pp_outer``)."""
    if plan.cp == 1:
        return placed
    from torch.distributed.device_mesh import DeviceMesh

    if plan.pp_outer:
        ranks = torch.arange(plan.world_size).view(plan.n_ranks, plan.dp, plan.cp, plan.tp)
        mesh = DeviceMesh(device.type, ranks, mesh_dim_names=("pp", "data", "cp", "tp"))
    else:
        ranks = torch.arange(plan.world_size).view(plan.dp, plan.cp, plan.n_ranks, plan.tp)
        mesh = DeviceMesh(device.type, ranks, mesh_dim_names=("data", "cp", "pp", "tp"))
    both = mesh["cp", "tp"] if plan.tp > 1 else None
    return replace(placed, cp_rank=placed.replica % plan.cp, cp_mesh=mesh["cp"], cp_tp_mesh=both)


def _with_experts(plan: Plan, placed: RankMesh, device: torch.device) -> RankMesh:
    """``placed`` with its expert-parallel groups: each pipeline rank's ranks split into ``dp / r``
    groups of ``ep`` consecutive ones (an expert-parallel plan is pipeline-outermost,
    ``Plan.pp_outer``), ``r = Plan.ep_replicas`` replicas with all their tensor-parallel ranks, as
    Megatron-Core (an expert tensor-parallel size of 1) and torchtitan (``etp`` 1) carve them:
    ``(pp, edp, ep)``, ep rank = (replica mod r) x tp + tensor-parallel rank (``_ep_rank``). Each
    tensor-parallel rank routes its own slice of the replica's tokens (``ExpertDispatch``). Under DDP
    the gradient norm sums over each group's replicas (each expert is held once among them); under
    FSDP over every rank (each expert's shards are held once among a pipeline rank's ranks, as the
    rest's are), and the ``(ep, edp)`` mesh places a shard in its layer's tensor."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    ep, pp, tp, covered = plan.ep, plan.n_ranks, plan.tp, plan.ep_replicas
    groups = plan.replicas // covered  # under context parallelism a replica's cp ranks are replicas too
    mesh = init_device_mesh(device.type, (pp, groups, ep), mesh_dim_names=("pp", "edp", "ep"))
    norm_group = experts_mesh = None
    if plan.sharded:
        # the same ranks, ordered (pp, ep, edp): a DeviceMesh's dimensions nest in their order, and an
        # expert's index runs over the group (ep) before its shards (edp)
        ranks = torch.arange(plan.world_size).view(pp, groups, ep).permute(0, 2, 1)
        experts_mesh = DeviceMesh(device.type, ranks, mesh_dim_names=("pp", "ep", "edp"))["ep", "edp"]
    else:
        for k in range(groups):  # every rank creates every group, in the same order
            members = [
                plan.global_rank(k * covered + i, p, t) for i in range(covered) for p in range(pp) for t in range(tp)
            ]
            group = dist.new_group(members)
            if placed.replica // covered == k:
                norm_group = group
    placed = replace(
        placed,
        ep_rank=_ep_rank(plan, placed),
        ep_mesh=mesh["ep"],
        edp_group=mesh["edp"].get_group() if groups > 1 else None,
        edp_mesh=mesh["edp"],
        experts_mesh=experts_mesh,
        norm_group=norm_group,
    )
    return _with_context(plan, placed, device)


def _ep_rank(plan: Plan, placed: RankMesh) -> int:
    """A rank's index in its expert-parallel group: its replica's place among the group's
    ``Plan.ep_replicas``, then its tensor-parallel rank (the group's ranks in global order)."""
    return (placed.replica % plan.ep_replicas) * plan.tp + placed.tp_rank


def _mesh_3d(plan: Plan, rank: int, device: torch.device) -> RankMesh:
    """The (dp, pp, tp) mesh of a tensor-parallel plan (``rank_mesh``)."""
    from torch.distributed.device_mesh import init_device_mesh

    if plan.pp_outer:  # an expert-parallel plan: the mesh's dimensions in the order of the ranks
        mesh = init_device_mesh(device.type, (plan.n_ranks, plan.replicas, plan.tp), mesh_dim_names=("pp", "dp", "tp"))
    else:
        mesh = init_device_mesh(device.type, (plan.replicas, plan.n_ranks, plan.tp), mesh_dim_names=("dp", "pp", "tp"))
    # One group per replica for the gradient norm: every rank creates every group, in the same
    # order (``new_group`` is collective over the world).
    replica_group = None
    for replica in range(plan.replicas):
        ranks = [plan.global_rank(replica, p, t) for p in range(plan.n_ranks) for t in range(plan.tp)]
        group = dist.new_group(ranks) if plan.replicas > 1 else dist.group.WORLD
        if replica == plan.replica_of(rank):
            replica_group = group
    placed = RankMesh(
        rank=rank,
        pp_rank=plan.pp_rank_of(rank),
        replica=plan.replica_of(rank),
        pp_group=mesh["pp"].get_group(),
        dp_group=mesh["dp"].get_group() if plan.replicas > 1 else None,
        dp_mesh=mesh["dp"] if plan.replicas > 1 else None,
        tp_rank=plan.tp_rank_of(rank),
        tp_mesh=mesh["tp"],
        replica_group=replica_group,
    )
    return _with_experts(plan, placed, device) if plan.ep > 1 else _with_context(plan, placed, device)


def _mesh_hsdp(plan: Plan, rank: int, device: torch.device) -> RankMesh:
    """The mesh of an HSDP plan: the replicas split into ``dp / dp_shard`` groups of ``dp_shard``
    consecutive ones, ``(dp_replicate, dp_shard, pp, tp)``, laid out as ``rank_mesh``'s (replica =
    replicate index x dp_shard + shard index). FSDP2 shards over the 2-D (dp_replicate, dp_shard)
    sub-mesh: inside a group by reduce-scatter, across the groups by all-reduce."""
    from torch.distributed.device_mesh import init_device_mesh

    shard, pp, tp = plan.shard_size, plan.n_ranks, plan.tp
    groups = plan.replicas // shard  # under context parallelism every replica's cp ranks are replicas
    if plan.pp_outer:  # an expert-parallel plan: pipeline-outermost, the mesh in the ranks' order
        names = ("pp", "dp_replicate", "dp_shard", "tp")
        mesh = init_device_mesh(device.type, (pp, groups, shard, tp), mesh_dim_names=names)
    else:
        names = ("dp_replicate", "dp_shard", "pp", "tp")
        mesh = init_device_mesh(device.type, (groups, shard, pp, tp), mesh_dim_names=names)
    replica = plan.replica_of(rank)
    # Every rank creates every group, in the same order (``new_group`` is collective over the world):
    # one per shard group for the gradient norm, one per (pipeline, tensor-parallel) position over
    # all the replicas for the losses' mean and the averaging the runner does itself.
    norm_group = dp_group = None
    for k in range(groups):
        group = dist.new_group(
            [plan.global_rank(k * shard + i, p, t) for i in range(shard) for p in range(pp) for t in range(tp)]
        )
        if replica // shard == k:
            norm_group = group
    for p, t in [(p, t) for p in range(pp) for t in range(tp)]:
        group = dist.new_group([plan.global_rank(d, p, t) for d in range(plan.replicas)])
        if (p, t) == (plan.pp_rank_of(rank), plan.tp_rank_of(rank)):
            dp_group = group
    placed = RankMesh(
        rank=rank,
        pp_rank=plan.pp_rank_of(rank),
        replica=replica,
        pp_group=mesh["pp"].get_group(),
        dp_group=dp_group,
        dp_mesh=mesh["dp_replicate", "dp_shard"],
        tp_rank=plan.tp_rank_of(rank),
        tp_mesh=mesh["tp"] if tp > 1 else None,
        norm_group=norm_group,
    )
    return _hsdp_experts(plan, placed, device) if plan.ep > 1 else _with_context(plan, placed, device)


def _hsdp_experts(plan: Plan, placed: RankMesh, device: torch.device) -> RankMesh:
    """``placed`` (an HSDP rank) with its expert-parallel groups: ``ep`` consecutive ranks of one
    pipeline rank, ``r = Plan.ep_replicas`` replicas inside a shard group (``r`` divides it) with their
    tensor-parallel ranks, replica = group x dp_shard + (j x r + the replica's place in its group). A
    rank's experts are sharded over the ``dp_shard / r`` ranks of its shard group holding the same
    ones and replicated over the groups: a 2-D (dp_replicate, edp_shard) mesh, as torchtitan takes
    ``dp_shard_mod_ep``. The norm keeps the shard group's ranks (every shard of every parameter, the
    experts' included, is held once among them)."""
    from torch.distributed.device_mesh import DeviceMesh

    ep, pp, shard, covered = plan.ep, plan.n_ranks, plan.shard_size, plan.ep_replicas
    groups = plan.replicas // shard
    # the same ranks, ordered (pp, ep, dp_replicate, edp_shard): a DeviceMesh's dimensions nest in their
    # order, and an expert's index runs over the group (ep) before its replicas and shards
    ranks = torch.arange(plan.world_size).view(pp, groups, shard // covered, ep).permute(0, 3, 1, 2)
    mesh = DeviceMesh(device.type, ranks, mesh_dim_names=("pp", "ep", "dp_replicate", "edp_shard"))
    placed = replace(
        placed,
        ep_rank=_ep_rank(plan, placed),
        ep_mesh=mesh["ep"],
        edp_mesh=mesh["dp_replicate", "edp_shard"],
        experts_mesh=mesh["ep", "dp_replicate", "edp_shard"],
    )
    return _with_context(plan, placed, device)


def threads_per_rank(plan: Plan, cores: int | None = None) -> int:
    """Intra-op threads of each rank: the plan's, but no more than this machine's cores shared by its
    ranks (at least 1), so the tensor-parallel ranks of a CPU run do not oversubscribe the cores.

    Args:
        plan: the plan (profiled threads, ranks in all).
        cores: the cores to share (None: ``os.cpu_count()``).
    """
    have = cores if cores is not None else os.cpu_count() or 1
    if plan.profile.backend == "nccl":
        return plan.profile.threads
    return max(1, min(plan.profile.threads, have // plan.world_size))


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
            f"({plan.replicas} replica(s) x {plan.n_ranks} x {plan.tp} tensor-parallel); start world_size / nnodes processes on every node"
        )
    torch.set_num_threads(threads_per_rank(plan))
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
    """A process group of one in this process (the plan's backend over an in-memory store) for the block.

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
    # nccl bound to the device up front, as the launched ranks do (without it barrier() warns and guesses)
    dist.init_process_group(
        plan.profile.backend,
        store=store,
        rank=0,
        world_size=1,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    try:
        yield rank_mesh(plan, 0, device), device
    finally:
        dist.destroy_process_group()
