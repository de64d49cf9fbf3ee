"""Expert parallelism at run time: one mixture-of-experts layer's experts sharded over the ranks of an
expert-parallel group, and the tokens routed to them dispatched and combined with all-to-alls.

An experts module (``planner.capture.ep_plan``: its parameters lead with the expert index; it is
called as ``experts(hidden [T, d], top_k_index [T, k], top_k_weights [T, k]) -> [T, d]``) holds, on
rank ``r`` of a group of ``ep``, experts ``r E/ep .. (r + 1) E/ep - 1`` only (``shard_experts``).
``ExpertDispatch`` runs in its place, on the tokens this rank holds:

1. every (token, slot) pair goes to the rank holding its expert: the pairs are ordered by that
   rank (stably, so each rank's rows keep the order of the unsplit layer's), the counts exchanged,
   then the rows and their local expert ids sent with ``all_to_all_single``;
2. the local experts run on the rows received, each row through its one expert at weight 1
   (``experts(rows, ids [R, 1], ones [R, 1])``);
3. the results go back with the reverse all-to-all and each pair's result is weighted by its
   router weight and summed into its token here, so the router's gradient stays on this rank.

Where the group spans a replica's tensor-parallel ranks (``planner.schema.plan.Plan.ep_replicas``),
which all hold the same tokens, each routes only its near-equal slice of them (``_Slice``: its
backward gathers every slice's input and router-weight gradients, so each rank ends with the whole
gradient, as unsplit) and gathers the others' results (``_Gather``: its backward keeps the slice):
no token runs its experts twice.

Dropless: every pair is computed, so a run equals the unsplit model (to the order of the sums).
The row exchanges are ``torch.distributed.nn.functional.all_to_all_single``, whose backward is the
reverse exchange: every rank of the group must run the layer's forward and backward in the same
order (the ranks of a group run the same pipeline rank of different replicas, the same schedule).
A rank that receives no rows still runs its experts on one row of zeros taken from its (empty)
input, as transformers' ``AllToAllEP`` does, so the backward exchange and the gradient hooks run.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed.nn.functional import all_to_all_single

from planner.capture.blocks import GraphTrace, TracedModel, by_block
from planner.capture.checkpoint import stage_units
from planner.capture.expert_calls import calls_of, replace_calls
from planner.errors import PlanFileError
from planner.run.mesh import RankMesh
from planner.schema.plan import Plan, StagePlan


def shard_experts(experts: nn.Module, name: str, rank: int, size: int) -> int:
    """Keep only rank ``rank``'s share of ``experts``'s experts, in place: every parameter cut to its
    rows ``rank E/size .. (rank + 1) E/size - 1`` (a new leaf parameter), and ``num_experts``, where
    the module declares it, set to the local count (transformers' experts size their routing masks
    by it).

    Args:
        experts: the experts module (parameters leading with the expert index).
        name: its name in the model, for errors.
        rank: this rank's index in the expert-parallel group.
        size: the group's size.

    Returns:
        The index of this rank's first expert.

    Raises:
        PlanFileError: ``size`` does not divide the module's expert count (a plan for another model).
    """
    params = list(experts.named_parameters())
    count = params[0][1].shape[0] if params else 0
    if not params or count % size or any(p.dim() < 2 or p.shape[0] != count for _, p in params):
        raise PlanFileError(
            f"the plan shards the experts of {name} over {size} ranks, but the model's module there holds "
            f"{count} experts (parameters {', '.join(f'{n} {tuple(p.shape)}' for n, p in params[:3])}); "
            "re-plan the model"
        )
    local = count // size
    first = rank * local
    for full, p in params:
        owner = experts.get_submodule(full.rpartition(".")[0]) if "." in full else experts
        leaf = full.rpartition(".")[2]
        owner.register_parameter(leaf, nn.Parameter(p.detach()[first : first + local].clone(), p.requires_grad))
    if isinstance(getattr(experts, "num_experts", None), int):
        experts.num_experts = local  # type: ignore[assignment]
    return first


class ExpertDispatch(nn.Module):
    """An experts module run expert-parallel (see the module docstring).

    Args:
        experts: the experts module, already cut to this rank's share (``shard_experts``).
        n_experts: the layer's experts in all.
        group: the expert-parallel process group (None: the default group).
    """

    experts: nn.Module

    def __init__(self, experts: nn.Module, n_experts: int, group: Any = None, tokens: Any = None) -> None:
        super().__init__()
        # held, not registered: the stage holds the experts module at its own name, so its parameters
        # keep the unsplit model's names (checkpoints, the optimizer's state, DDP)
        object.__setattr__(self, "experts", experts)
        self.group = group
        self.size = dist.get_world_size(group)
        self.local = n_experts // self.size
        self.tokens = tokens
        self.slices = dist.get_world_size(tokens) if tokens is not None else 1

    # A compiled stage (``--compile``) runs this eagerly: the exchange sizes are data (the router's
    # counts, read with ``tolist``), which torch.compile would split the graph on anyway; the rest of
    # the stage compiles around it.
    @torch.compiler.disable
    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """The layer's output for this rank's tokens: ``hidden`` [T, d], ``top_k_index`` [T, k]
        (global expert ids), ``top_k_weights`` [T, k] -> [T, d]. With a token group (the
        tensor-parallel ranks, which all hold the same tokens) this rank routes its slice of them
        only and gathers the others' results (``_slice``, ``_Gather``)."""
        if self.slices == 1:
            return self._routed(hidden, top_k_index, top_k_weights)
        width, k = hidden.shape[-1], top_k_index.shape[-1]
        flat = hidden.reshape(-1, width)
        part = _slice(flat.shape[0], self.slices, dist.get_rank(self.tokens))
        mine = _Slice.apply(flat, part, self.tokens)
        weights = _Slice.apply(top_k_weights.reshape(-1, k), part, self.tokens)
        done = self._routed(mine, top_k_index.reshape(-1, k)[part], weights)
        return _Gather.apply(done, flat.shape[0], self.tokens).reshape(hidden.shape)

    def _routed(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """``hidden``'s rows through their experts over the expert-parallel group (see the module docstring)."""
        k = top_k_index.shape[-1]
        pairs = top_k_index.reshape(-1)
        dest = torch.div(pairs, self.local, rounding_mode="floor")
        order = torch.argsort(dest, stable=True)
        send = torch.bincount(dest, minlength=self.size)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)  # how many rows each rank sends here
        sends, recvs = send.tolist(), recv.tolist()
        token = torch.div(order, k, rounding_mode="floor")  # each ordered pair's token
        ids = (pairs[order] - dest[order] * self.local).contiguous()
        got_ids = ids.new_empty(sum(recvs))
        dist.all_to_all_single(got_ids, ids, recvs, sends, group=self.group)
        rows = hidden.reshape(-1, hidden.shape[-1])[token]
        got = exchange_rows(rows.new_empty(sum(recvs), rows.shape[-1]), rows, recvs, sends, self.group)
        done = self._run(got, got_ids)
        back = exchange_rows(done.new_empty(len(pairs), done.shape[-1]), done, sends, recvs, self.group)
        weighted = (back * top_k_weights.reshape(-1)[order, None]).to(hidden.dtype)
        out = torch.zeros(hidden.reshape(-1, hidden.shape[-1]).shape, dtype=hidden.dtype, device=hidden.device)
        return out.index_add(0, token, weighted).reshape(hidden.shape)

    def _run(self, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The local experts on ``rows``, row ``i`` through expert ``ids[i]`` at weight 1."""
        if rows.shape[0] == 0:
            # one row of zeros, connected to the (empty) rows: the backward exchange and the experts'
            # gradient hooks still run on this rank
            zero = rows.sum(dim=0, keepdim=True)
            one = torch.ones(1, 1, dtype=rows.dtype, device=rows.device)
            return self.experts(zero, ids.new_zeros(1, 1), one)[:0]
        ones = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
        return self.experts(rows, ids[:, None], ones)


def exchange_rows(
    out: torch.Tensor, rows: torch.Tensor, recvs: list[int], sends: list[int], group: Any
) -> torch.Tensor:
    """``rows`` sent and ``out`` received with torch.distributed.nn's ``all_to_all_single``, whose
    backward is the reverse exchange. torch 2.13 marks it deprecated for the functional collectives'
    (a FutureWarning on every call, on every rank); it is kept for its backward over gloo, and the
    warning left out of the run's output."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*all_to_all_single is deprecated", category=FutureWarning)
        return all_to_all_single(out, rows, recvs, sends, group=group)


def _slice(total: int, parts: int, index: int) -> slice:
    """Part ``index`` of ``parts`` near-equal slices of ``total`` rows (the first ones a row longer)."""
    size, extra = divmod(total, parts)
    start = index * size + min(index, extra)
    return slice(start, start + size + (index < extra))


def _gather_rows(rows: torch.Tensor, total: int, group: Any) -> torch.Tensor:
    """Every rank's ``rows`` (its ``_slice`` of ``total``) in order, on every rank of ``group``: each
    padded to the longest slice for one ``all_gather`` (gloo gathers equal sizes), then trimmed."""
    parts = dist.get_world_size(group)
    longest = -(-total // parts)
    padded = rows.new_zeros(longest, *rows.shape[1:])
    padded[: rows.shape[0]] = rows
    every = [torch.empty_like(padded) for _ in range(parts)]
    dist.all_gather(every, padded.contiguous(), group=group)
    sizes = [len(range(total)[_slice(total, parts, i)]) for i in range(parts)]
    return torch.cat([t[:n] for t, n in zip(every, sizes)])


class _Slice(torch.autograd.Function):
    """A rank's slice of rows every rank of ``group`` holds alike; backward: the whole gradient,
    every rank's slice gathered (each row's gradient comes from the one rank that took it)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, part: slice, group: Any) -> torch.Tensor:
        ctx.total, ctx.group = rows.shape[0], group
        return rows[part].clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather_rows(grad.contiguous(), ctx.total, ctx.group), None, None


class _Gather(torch.autograd.Function):
    """Every rank's slice of ``total`` rows gathered whole on each; backward: this rank's slice of the
    gradient (every rank holds the same whole gradient of what is alike on all of them)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, total: int, group: Any) -> torch.Tensor:
        ctx.part = _slice(total, dist.get_world_size(group), dist.get_rank(group))
        return _gather_rows(rows.contiguous(), total, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad[ctx.part].contiguous(), None, None


def dispatch_experts(
    plan: Plan, stage: StagePlan, built: nn.Module, traced: TracedModel, mesh: RankMesh
) -> list[ExpertDispatch]:
    """Make a stage expert-parallel: in each of its graph modules (a chain's units, or the stage) every
    call of an experts module (recorded by the trace, ``planner.capture.expert_calls``) becomes an
    ``ExpertDispatch`` over the rank's expert-parallel group, and the experts module (the trace's
    own, with its Python forward) is cut to the rank's share and held at its name in the stage.

    Args:
        plan: the plan (``ep``, each layer's expert count).
        stage: the stage (its blocks: the experts modules it must dispatch).
        built: the stage module, before it is wrapped (its examples made on the whole experts).
        traced: the trace the stage was cut from.
        mesh: this rank's place (``ep_rank``, ``ep_mesh``).

    Returns:
        The stage's dispatches, in graph order; each one's ``experts`` is the rank's share of its
        layer's experts (their gradients are reduced over the expert groups, not the replicas; under
        FSDP each is sharded over ``edp_mesh``: ``shard_experts_over_groups``).

    Raises:
        PlanFileError: the model was traced without the experts' calls, a layer of the stage whose
            call was not found in its graph, or an expert count ``ep`` does not divide.
    """
    assert mesh.ep_mesh is not None
    group = mesh.ep_mesh.get_group()
    # the group spans the tensor-parallel ranks, which hold the same tokens: each routes its own slice
    tokens = mesh.tp_mesh.get_group() if plan.tp > 1 and mesh.tp_mesh is not None else None

    def dispatched(experts: nn.Module, name: str) -> nn.Module:
        shard_experts(experts, name, mesh.ep_rank, plan.ep)
        return ExpertDispatch(experts, plan.experts[name], group, tokens)

    return _replace_experts_calls(plan, stage, built, traced, dispatched, "_ep_")


class ExpertsCall(nn.Module):
    """An experts module's call as one module of a stage's graph, the experts whole (no expert
    parallelism): what context parallelism runs on a rank's plain tokens (``planner.run.context_shard.
    around_tokens``), since a graph's inlined experts (transformers' grouped matrix products) have no
    DTensor rules.

    Args:
        experts: the experts module (held, not registered: the stage holds it at its own name).
    """

    experts: nn.Module

    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "experts", experts)

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """The experts module's output for ``hidden`` [T, d] routed by ``top_k_index`` / ``top_k_weights`` [T, k]."""
        return self.experts(hidden, top_k_index, top_k_weights)  # type: ignore[no-any-return]


def experts_calls(plan: Plan, stage: StagePlan, built: nn.Module, traced: TracedModel) -> list[nn.Module]:
    """A stage's experts calls each made one ``ExpertsCall`` module of its graph (the experts whole).

    Args:
        plan: the plan (each layer's expert count).
        stage: the stage (its blocks: the experts modules it runs).
        built: the stage module, before it is wrapped.
        traced: the trace the stage was cut from (recorded with the experts' calls).

    Returns:
        The calls' modules.

    Raises:
        PlanFileError: as ``dispatch_experts``.
    """
    return _replace_experts_calls(plan, stage, built, traced, lambda experts, name: ExpertsCall(experts), "_experts_")


def _replace_experts_calls(
    plan: Plan,
    stage: StagePlan,
    built: nn.Module,
    traced: TracedModel,
    make: Callable[[nn.Module, str], nn.Module],
    prefix: str,
) -> list[Any]:
    """Replace every experts call of the stage's graph modules by the module ``make(experts, name)``
    (registered at ``prefix`` + the name), the experts module (the trace's own, with its Python
    forward) held at its name in the stage; the modules made, in graph order.

    Raises:
        PlanFileError: the model was traced without the experts' calls, or a layer of the stage whose
            call was not found in its graph.
    """
    calls = calls_of(traced.gm) if isinstance(traced, GraphTrace) else {}
    if set(calls) != set(plan.experts):
        raise PlanFileError(
            "the trace does not record where the model calls its experts (expert and context parallelism need a "
            "torch.fx or torch.export graph traced with them named); re-plan the model"
        )
    made: list[Any] = []
    done: list[str] = []
    for part in stage_units(built):
        if not isinstance(part, fx.GraphModule):
            continue

        def target(name: str, part: fx.GraphModule = part) -> str:
            experts = traced.model.get_submodule(name)
            module = make(experts, name)
            owner, _, leaf = name.rpartition(".")
            part.get_submodule(owner).add_module(leaf, experts)  # in place of the graph's copy of its weights
            made.append(module)
            path = prefix + name.replace(".", "_")
            part.add_module(path, module)
            return path

        done.extend(replace_calls(part, list(calls), target))
    held = by_block([b.name for b in plan.blocks[stage.start : stage.end]], dict(plan.experts))
    wanted = [name for names in held.values() for name in names]
    if sorted(done) != sorted(wanted):
        raise PlanFileError(
            f"stage {stage.index} holds the experts of {', '.join(wanted) or 'no layer'} but its graph calls "
            f"{', '.join(done) or 'none'} as one step; re-plan the model"
        )
    return made


def shard_experts_over_groups(plan: Plan, experts: Sequence[nn.Module], mesh: RankMesh, reshard: bool) -> None:
    """Under FSDP, each experts module its own ``fully_shard`` unit over the ranks holding the same
    experts (``edp_mesh``: ``dp / ep`` replicas, one included; under HSDP sharded over the
    ``dp_shard / ep`` of them in its shard group and replicated over the groups), before the stage's
    units take the rest over all the replicas, as torchtitan shards a mixture-of-experts model's experts.

    A rank's expert gradients are the sums over the tokens its group's ``ep`` replicas routed to
    them, so the reduce-scatter over the ``dp / ep`` groups sums every replica's in; it divides by
    the replicas (``dp``, times ``cp`` under context parallelism; not its own group's size, FSDP's
    default) to give the batch's mean gradient, as the rest's average over the replicas is. Over gloo the division runs after a summing
    reduce-scatter.

    Args:
        plan: the plan (replicas, its dtype: ``planner.run.wrappers.fsdp_policy``).
        experts: the rank's experts modules (``dispatch_experts``), on their device.
        mesh: this rank's place (``edp_mesh``).
        reshard: FSDP's ``reshard_after_forward``, as the stage's units take it.
    """
    from planner.run.wrappers import shard_over_replicas

    edp = mesh.edp_mesh
    assert edp is not None
    for module in experts:
        shard_over_replicas(plan, module, edp, reshard)
        module.set_gradient_divide_factor(float(plan.replicas))  # type: ignore[operator]
        # gloo has no pre-multiplied sum. Not for a reduce-scatter group of one: torch 2.13's FSDP2
        # there divides by the factor on its copy and again after a summing "reduction" (twice in all)
        if edp.device_type == "cpu" and edp.size(edp.ndim - 1) > 1:
            module.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]


def expert_shards(experts: Sequence[nn.Module], mesh: RankMesh) -> dict[int, Callable[[torch.Tensor], torch.Tensor]]:
    """For each expert parameter this rank holds a share of, what turns it (or its optimizer state,
    of its shape) into a ``DTensor`` of the whole layer's tensor: sharded by expert over the rank's
    expert-parallel group, and under FSDP (HSDP) each group's experts again as FSDP placed them on
    ``edp_mesh`` (on ``experts_mesh``: ``Shard(0)`` over ep, then FSDP's placements). It is the view a checkpoint saves, so
    that ``torch.distributed.checkpoint`` writes each expert once and reads it back into any other
    ``ep`` (or none), sharded or not.

    Args:
        experts: the rank's experts modules (``dispatch_experts``), after any sharding.
        mesh: this rank's place (``ep_mesh``, ``experts_mesh``).

    Returns:
        Parameter id -> the function (it shares the tensor's storage: a load writes into it).
    """
    from torch.distributed.tensor import DTensor, Shard

    ep_mesh = mesh.ep_mesh
    assert ep_mesh is not None
    size = ep_mesh.size()

    def whole(t: torch.Tensor) -> torch.Tensor:
        shape = (t.shape[0] * size, *t.shape[1:])  # a DTensor's (FSDP's) shape is its group's experts'
        on, placements = ep_mesh, [Shard(0)]
        if isinstance(t, DTensor):  # FSDP's (HSDP's) shard of the group's experts, placed as FSDP placed it
            on, placements, t = mesh.experts_mesh, [Shard(0), *t.placements], t.to_local()  # type: ignore[list-item]
        return DTensor.from_local(
            t, on, placements, run_check=False, shape=torch.Size(shape), stride=contiguous_strides(shape)
        )

    return {id(p): whole for module in experts for p in module.parameters()}


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


__all__ = [
    "ExpertDispatch",
    "ExpertsCall",
    "contiguous_strides",
    "dispatch_experts",
    "experts_calls",
    "exchange_rows",
    "expert_shards",
    "shard_experts",
    "shard_experts_over_groups",
]
