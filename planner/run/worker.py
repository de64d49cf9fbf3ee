"""One pipeline rank: the function ``elastic_launch`` starts in every worker process.

Rank r runs the plan's stages placed on it (one, or several for interleaved, looped and V-shaped
schedules) as ``torch.distributed.pipelining.PipelineStage`` objects under torch's own class for
the plan's schedule (``get_schedule_class``: ``ScheduleGPipe`` / ``Schedule1F1B`` with one stage,
``PipelineScheduleMulti`` subclasses with a list). Every rank rebuilds the whole model from the
model file with the plan's seed, traces it the same way the planner did and keeps only its own
stages (``build_stage_module`` shares parameters with the trace, so the rest is freed).

Every rank iterates the same data stream so the ranks agree on the step count; the rank holding
stage 0 feeds the inputs, the rank holding the last stage the target (under a V placement both
are rank 0), the others call ``step()`` with nothing.

A failure is written as a short JSON record to ``error_dir/rank<R>.json`` and the process exits
with status 1 (``SystemExit``, so neither torch.multiprocessing nor elastic prints a traceback);
the launcher turns the earliest record into one error message.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import os
import pickle
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from planner.capture.blocks import TiedParameter, TracedModel
from planner.capture.clock import BlockClock
from planner.capture.graph import buffers_restored
from planner.capture.load import ModelFile
from planner.capture.stage import stage_inputs, stage_module, trace_root
from planner.core.schedules import SPLIT_BACKWARD, placement
from planner.errors import PlannerError
from planner.run.checkpoint import RankState, latest_checkpoint, load_checkpoint, model_names, save_checkpoint
from planner.run.common import (
    autocast_region,
    check_ties,
    load_plan_model,
    local_part,
    make_optimizer,
    make_scheduler,
    print_flushed,
    tie_groups,
    trace_for_plan,
)
from planner.run.loop import Progress, RankModel, RankResult, train_steps
from planner.run.measure import StageProbe, probes_installed, recv_buffers
from planner.run.preflight import vocab_size_of
from planner.run.signals import SIGNAL_NAMES, ignore_stop_signals, raise_on_stop_signals
from planner.schema.jsonfile import write_atomic
from planner.schema.plan import Plan, StagePlan
from planner.schema.request import TORCH_NAMES, RunRequest
from planner.torch_compat import is_view


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class ContiguousBoundary(torch.nn.Module):
    """Make every tensor that crosses a stage boundary contiguous, in both directions.

    ``PipelineStage`` sends tensors as they are and gloo refuses non-contiguous ones ("input
    tensor has to be contiguous"); in its dynamic mode it even allocates the receive buffers with
    the stride it observed (``torch.empty_strided``). The gradient of a stage input is often a
    transposed view (attention), so without this a GPT split fails on the first backward send.
    """

    def __init__(self, module: torch.nn.Module, *, hooks: bool = False):
        super().__init__()
        self.module = module
        self.hooks = hooks

    def __call__(self, *args: object) -> object:
        # Called without nn.Module's hooks, on purpose: the stage's inputs are leaf tensors (the
        # receive buffers), and a module-level grad hook on a leaf breaks ``autograd.grad``, which the
        # zero-bubble schedules' input-only backward uses ("A leaf node was passed to
        # _will_engine_execute_node"); MemTracker installs such hooks on every module it sees called.
        # This wrapper has no hooks of its own; the stage module inside is called normally and
        # receives non-leaf tensors (``_ContiguousGrad``'s outputs).
        # Under FSDP (never with those schedules) the wrapper is the sharded module, whose hooks
        # gather the parameters: there it is called with them.
        if self.hooks:
            return super().__call__(*args)
        return self.forward(*args)

    def forward(self, *args: object) -> object:
        args = tuple(_ContiguousGrad.apply(a) if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args)
        out = self.module(*args)
        if isinstance(out, torch.Tensor):
            return _owned(out)
        if isinstance(out, tuple):
            return tuple(_owned(o) if isinstance(o, torch.Tensor) else o for o in out)
        return out


def _owned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and, if it is a view, copied into its own storage: torch 2.13's input-only
    backward (``stage_backward_input``, zero-bubble schedules) fails on a stage output that is a view."""
    t = t.contiguous()
    return t.clone() if is_view(t) else t


class Recomputed(torch.nn.Module):
    """Run a stage under activation checkpointing: keep only its inputs per microbatch and rebuild
    its activations during backward (the plan's ``recompute`` flag; non-reentrant
    ``torch.utils.checkpoint``, which also works when the stage's inputs need no grad)."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args: object) -> object:
        return torch.utils.checkpoint.checkpoint(self.module, *args, use_reentrant=False)


class Autocast(torch.nn.Module):
    """Run a stage's forward under ``torch.autocast`` (the plan's ``profile.autocast``): parameters
    stay fp32, the matmuls and what they save run in the lower precision, as the profile measured.
    A fresh autocast region per call, so its weight casts are per microbatch, as profiled."""

    def __init__(self, module: torch.nn.Module, plan: Plan, device_type: str):
        super().__init__()
        self.module, self.plan, self.device_type = module, plan, device_type

    def forward(self, *args: object) -> object:
        with autocast_region(self.plan, self.device_type):
            return self.module(*args)


def autocast_loss(
    loss_fn: Callable[..., torch.Tensor], plan: Plan, device: torch.device
) -> Callable[..., torch.Tensor]:
    """The model file's loss under the plan's autocast, as the profile timed the last block (unchanged without)."""
    if plan.profile.autocast is None:
        return loss_fn

    def loss(output: Any, target: Any) -> torch.Tensor:
        with autocast_region(plan, device.type):
            return loss_fn(output, target)

    return loss


def _speed_levers(plan: Plan, module: ContiguousBoundary, inner: torch.nn.Module, device: torch.device) -> None:
    """Apply the plan's ``compile`` and ``profile.autocast`` to a stage (after any sharding: FSDP
    wraps the eager module; the compiled one runs inside it)."""
    run = inner
    if plan.compile:
        import torch._functorch.config as functorch_config

        # The zero-bubble schedules' split backward runs the compiled backward twice, which donated
        # buffers forbid ("This backward function was compiled with non-empty donated buffers").
        functorch_config.donated_buffer = False
        run = torch.compile(inner)  # type: ignore[assignment]
    if plan.profile.autocast is not None:
        run = Autocast(run, plan, device.type)
    module.module = run


def _as_tuple(value: object) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def _example_io(traced: TracedModel, start: int, stage: torch.nn.Module, inputs: tuple) -> tuple[tuple, tuple]:
    """Real example inputs and outputs of one stage, for ``PipelineStage``'s static mode.

    Without them ``PipelineStage`` infers shapes at the first step by running every stage on
    *uninitialised* receive buffers (``torch.empty``): an integer tensor crossing a cut (token ids,
    ``torch.arange`` positions) is then garbage and an embedding lookup fails with "index out of
    range". So each rank runs the blocks before its stage once on the example microbatch (with
    autograd on, so ``requires_grad`` of every boundary tensor is what training will see).
    """
    # Same shapes and dtypes as training. torch.export's modules refuse .eval(), so train mode stays
    # on: the buffers are put back (batch norm's running statistics) and the RNG too (dropout), so
    # training starts exactly where the unsplit model's does.
    with buffers_restored(trace_root(traced)), torch.random.fork_rng(devices=[]), torch.enable_grad():
        x = stage_inputs(inputs)
        if start > 0:
            prefix = stage_module(traced, 0, start)
            x = tuple(t.detach().contiguous().requires_grad_(t.requires_grad) for t in _as_tuple(prefix(*x)))
        y = _as_tuple(stage(*x))
    return x, tuple(t.detach().requires_grad_(t.requires_grad) for t in y)


def _quiet() -> None:
    """Silence library chatter in the worker; real errors still reach the launcher."""
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module=r"torch\.distributed\..*")


def _train(plan: Plan, request: RunRequest, progress: Progress) -> RankResult:
    """Join the process group torchrun-style (from the environment), train this rank, leave the group."""
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
        return _train_rank(plan, request, _mesh(plan, rank, device), device, progress)
    finally:
        dist.destroy_process_group()


@dataclass(frozen=True)
class _Mesh:
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


def _mesh(plan: Plan, rank: int, device: torch.device) -> _Mesh:
    """The (dp, pp) mesh of the plan (laid out as ``Plan`` documents: global = replica x pp + pp rank)."""
    if plan.dp == 1:
        return _Mesh(rank, rank, 0, dist.group.WORLD, None, None)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (plan.dp, plan.n_ranks), mesh_dim_names=("dp", "pp"))
    return _Mesh(
        rank=rank,
        pp_rank=plan.pp_rank_of(rank),
        replica=plan.replica_of(rank),
        pp_group=mesh["pp"].get_group(),
        dp_group=mesh["dp"].get_group(),
        dp_mesh=mesh["dp"],
    )


class _DDP(DistributedDataParallel):
    """``DistributedDataParallel`` called without nn.Module's hooks, like ``ContiguousBoundary`` and
    for the same reason: its inputs are the stage's leaf receive buffers. ``PipelineStage``
    recognises it as DDP (no all-reduce until the last microbatch's backward)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)


@dataclass
class _RankStages:
    """What ``_build_stages`` makes for one rank."""

    modules: list[torch.nn.Module]  # what each PipelineStage runs (DDP-wrapped under ddp replicas)
    params: list[torch.nn.Parameter]  # trainable, each once (stages on one rank may share a tied one)
    optimizer: torch.optim.Optimizer | None
    stages: list[Any]  # PipelineStage
    schedule: Any
    finish_grads: Callable[[], None]
    counted: list[torch.nn.Parameter] | None
    tensors: dict[str, torch.Tensor]  # the unsplit model's name -> this rank's tensor (checkpoints)
    vocab_size: int | None  # the model's output width (sizes --data's vocabulary; None: not asked)
    clocks: list[BlockClock | None]  # per stage, the marks that time its blocks (None: compiled)


def _grad_finisher(
    plan: Plan,
    ties: list[TiedParameter],
    mesh: _Mesh,
    params: list[torch.nn.Parameter],
    tensors: dict[str, torch.Tensor],
    *,
    average: bool = False,
) -> tuple[Callable[[], None], set[int]]:
    """What turns the microbatches' accumulated gradients into the step's, and the tied copies this
    rank must leave out of the global norm.

    1. Every gradient is divided by the microbatch count, once per parameter. (torch's
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
    """
    mine: list[tuple[torch.nn.Parameter, Any]] = []
    not_counted: set[int] = set()
    for tie, ranks in tie_groups(plan, ties):
        if len(ranks) < 2:
            continue  # one rank holds every reader: its stages share the one parameter
        for replica in range(plan.dp):
            group = dist.new_group([plan.global_rank(replica, r) for r in ranks])
            if replica == mesh.replica and mesh.pp_rank in ranks:
                param = next((tensors[n] for n in tie.names if n in tensors), tie.param)
                mine.append((param, group))  # type: ignore[arg-type]
                if mesh.pp_rank != ranks[0]:
                    not_counted.add(id(param))
    scale = 1.0 / plan.n_microbatches

    def finish() -> None:
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(scale)
        if average and mesh.dp_group is not None:
            _average(params, mesh.dp_group, plan.dp)
        for param, group in mine:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(local_part(param.grad), op=dist.ReduceOp.SUM, group=group)

    return finish, not_counted


def _average(params: list[torch.nn.Parameter], group: Any, replicas: int) -> None:
    """Average the gradients over the replicas in one all-reduce per dtype (a missing one counts as 0)."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        assert p.grad is not None
        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    with torch.no_grad():
        for grads in by_dtype.values():
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            flat.div_(replicas)
            for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(reduced)


def _state_names(stage: torch.nn.Module, root: torch.nn.Module, aliases: dict[str, list[str]]) -> dict[str, list[str]]:
    """The stage module's own parameter and buffer names -> every name the unsplit model gives them.

    Taken before any wrapping: FSDP replaces the parameters (by new DTensor ones) but keeps their
    names within the stage module, so the names still find them afterwards.
    """
    root_names: dict[int, list[str]] = {}
    for name, t in [*root.named_parameters(remove_duplicate=False), *root.named_buffers(remove_duplicate=False)]:
        root_names.setdefault(id(t), []).append(name)
    out: dict[str, list[str]] = {}
    for local, t in [*stage.named_parameters(remove_duplicate=False), *stage.named_buffers(remove_duplicate=False)]:
        names = [alias for name in root_names.get(id(t), []) for alias in aliases.get(name, [])]
        if names:
            out[local] = list(dict.fromkeys(names))
    return out


def _aliases(model: torch.nn.Module) -> dict[str, list[str]]:
    """Each state name of the unsplit model -> all names of that tensor (a tied weight has several)."""
    out: dict[str, list[str]] = {}
    for names in model_names(model).values():
        for name in names:
            out[name] = names
    return out


def _block_clock(plan: Plan, stage: StagePlan, device: torch.device) -> BlockClock | None:
    """The marks that time every block of ``stage`` where it runs (``planner.capture.clock``); None
    for a compiled plan, whose graph each mark would break (it is timed per stage only)."""
    if plan.compile:
        return None
    return BlockClock(stage.start, stage.end, stage.end == len(plan.blocks), device.type == "cuda")


def _build_stages(plan: Plan, mf: ModelFile, mesh: _Mesh, device: torch.device, want_vocab: bool) -> _RankStages:
    """This rank's stage modules (wrapped for the plan's data parallelism), their trainable
    parameters, one optimizer over them, their ``PipelineStage`` objects, the plan's schedule
    (torch's own class for it), what finishes a step's gradients (``_grad_finisher``) and the
    state tensors a checkpoint holds, by the unsplit model's names."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    model = mf.build(plan.model.seed)
    aliases = _aliases(model)
    traced = trace_for_plan(plan, mf, model)
    del model  # the trace holds its own copy
    root = trace_root(traced)
    ties = check_ties(plan, traced)
    example = mf.batch(plan.microbatch_size, seed=plan.model.seed)[0]
    fsdp = plan.dp > 1 and plan.dp_mode == "fsdp"
    ddp = plan.dp > 1 and plan.dp_mode == "ddp"
    modules: list[torch.nn.Module] = []
    stages: list[Any] = []
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    # Every stage's example input and output first: FSDP shards the modules of the trace in place,
    # after which the trace's other cuts (the prefix that makes a later stage's example) cannot run.
    cut = []
    clocks: list[BlockClock | None] = []
    for stage_plan in plan.stages_of(mesh.pp_rank):
        clock = _block_clock(plan, stage_plan, device)
        clocks.append(clock)
        built = stage_module(traced, stage_plan.start, stage_plan.end, clock)
        inner = Recomputed(built) if stage_plan.recompute else built
        module = ContiguousBoundary(inner)
        # under the plan's autocast, so the examples (and the receive buffers made from them) have
        # the dtypes that will cross the cut
        with autocast_region(plan, device.type):
            cut.append((stage_plan, built, inner, module, *_example_io(traced, stage_plan.start, module, example)))
    vocab = vocab_size_of(traced, mf, plan) if want_vocab else None
    # Zero-bubble schedules compute weight gradients with autograd.grad, past DDP's hooks, so there
    # the replicas' gradients are averaged by ``finish`` instead (the same all-reduce, after the step's
    # backward).
    manual = ddp and plan.schedule in SPLIT_BACKWARD
    for stage_plan, built, inner, module, example_in, example_out in cut:
        names = _state_names(built, root, aliases)
        module.to(device)
        trainable = [p for p in module.parameters() if p.requires_grad]
        shared = [p for p in trainable if id(p) in seen]
        if fsdp and trainable:
            if shared:
                raise PlannerError(
                    f"stage {stage_plan.index} shares a tied parameter with another stage on rank {mesh.pp_rank}, "
                    "which FSDP cannot shard twice; re-plan with --dp-mode ddp"
                )
            from torch.distributed.fsdp import fully_shard

            _speed_levers(plan, module, inner, device)  # compiled before sharding, as torchtitan does
            # The boundary wrapper itself is sharded, so that torch's PipelineStage sees an FSDP
            # module: it then syncs gradients only after the last microbatch's backward instead of
            # reduce-scattering every microbatch's. Parameters stay gathered from forward to
            # backward: each microbatch's backward would otherwise gather them again.
            module.hooks = True
            fully_shard(module, mesh=mesh.dp_mesh, reshard_after_forward=False)
        else:
            _speed_levers(plan, module, inner, device)
        submod: torch.nn.Module = module
        if ddp and not manual and len(shared) < len(trainable):
            if shared:  # a tied parameter another DDP of this rank already reduces
                local = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
                DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                    module, [local[id(p)] for p in shared]
                )
            submod = _DDP(module, process_group=mesh.dp_group, gradient_as_bucket_view=True)
        seen.update(id(p) for p in trainable)
        for local_name, t in [*built.named_parameters(remove_duplicate=False), *built.named_buffers()]:
            for alias in names.get(local_name, []):
                tensors[alias] = t
        modules.append(submod)
        stages.append(
            PipelineStage(
                submod,
                stage_index=stage_plan.index,
                num_stages=plan.n_stages,
                device=device,
                input_args=tuple(t.to(device) for t in example_in),
                output_args=tuple(t.to(device) for t in example_out),
                group=mesh.pp_group,
            )
        )
    params = list({id(p): p for m in modules for p in m.parameters() if p.requires_grad}.values())
    optimizer = make_optimizer(params, plan)
    finish, not_counted = _grad_finisher(plan, ties, mesh, params, tensors, average=manual)
    del ties
    counted = [p for p in params if id(p) not in not_counted] if not_counted else None
    schedule_cls = get_schedule_class(TORCH_NAMES[plan.schedule])
    # scale_grads=False: ``finish`` averages the gradients over microbatches, once per parameter.
    # GPipe and 1F1B take their one stage; the others (PipelineScheduleMulti) a list, even of one.
    target = stages[0] if placement(plan.schedule) == "single" else stages
    loss_fn = autocast_loss(mf.loss_fn, plan, device)
    schedule = schedule_cls(target, n_microbatches=plan.n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return _RankStages(modules, params, optimizer, stages, schedule, finish, counted, tensors, vocab, clocks)


def _replica_rows(value: Any, replica: int, replicas: int) -> Any:
    """This replica's rows of a batch (tensors and tuples, lists or dicts of them; dim 0 is the sample)."""
    if replicas == 1:
        return value
    if isinstance(value, torch.Tensor):
        n = value.shape[0] // replicas
        return value[replica * n : (replica + 1) * n]
    if isinstance(value, (tuple, list)):
        return type(value)(_replica_rows(v, replica, replicas) for v in value)
    if isinstance(value, dict):
        return {k: _replica_rows(v, replica, replicas) for k, v in value.items()}
    return value


def _model_stream(mf: ModelFile, plan: Plan, mesh: _Mesh, skip: int) -> Iterator[tuple[Any, torch.Tensor]]:
    """The model file's own stream of global batches, cut to this replica's rows, after ``skip``
    batches (a resumed run replays the seeded stream up to its step)."""
    for k, (inputs, target) in enumerate(mf.train_batches(plan.batch_size, seed=plan.model.seed)):
        if k >= skip:
            yield _replica_rows(inputs, mesh.replica, plan.dp), _replica_rows(target, mesh.replica, plan.dp)


def _text_stream(plan: Plan, request: RunRequest, mf: ModelFile, mesh: _Mesh, vocab_size: int) -> Any:
    """``--data``'s stream for this replica (``planner.data.TextBatches``), its vocabulary kept
    beside the checkpoints so a resumed run reads the same ids."""
    from planner.data import TextBatches

    example = mf.batch(plan.microbatch_size, seed=plan.model.seed)
    vocab_file = request.checkpoint_root / "vocab.json" if request.save_checkpoints else None
    return TextBatches(
        request.data,
        example=example,
        vocab_size=vocab_size,
        global_rows=plan.batch_size,
        replica=mesh.replica,
        replicas=plan.dp,
        tokenizer=request.tokenizer,
        eval_fraction=request.eval_fraction,
        vocab_file=vocab_file,
    )


def _set_eval(modules: Sequence[torch.nn.Module], evaluating: bool) -> None:
    """Dropout off while evaluating where the module allows it (torch.export's modules refuse
    ``.eval()``: they evaluate with dropout as traced, which the shipped models set to 0)."""
    for m in modules:
        try:
            m.train(not evaluating)
        except (NotImplementedError, RuntimeError):
            pass


def _train_rank(plan: Plan, request: RunRequest, mesh: _Mesh, device: torch.device, progress: Progress) -> RankResult:
    """Build this rank's stages and schedule, resume if asked, and train them with the one training loop."""
    return _RankRun(plan, request, mesh, device).train(progress)


class _RankRun:
    """One rank's run: its stages and schedule, data stream, checkpoints and evaluations.

    Every rank of the run makes the same calls in the same order (each step, each evaluation,
    each checkpoint is collective), so no rank waits on another that skipped one.
    """

    def __init__(self, plan: Plan, request: RunRequest, mesh: _Mesh, device: torch.device) -> None:
        self.plan, self.request, self.mesh, self.device = plan, request, mesh, device
        self.mf = load_plan_model(plan, str(request.plan_file))
        built = _build_stages(plan, self.mf, mesh, device, want_vocab=request.data is not None)
        self.built = built
        self.mine = plan.stages_of(mesh.pp_rank)
        self.feeds = any(s.index == 0 for s in self.mine)  # holds the first stage: gives the inputs
        self.scores = any(s.index == plan.n_stages - 1 for s in self.mine)  # the target and the loss
        # Under FSDP every rank holds a shard of every parameter of its stages: the norm sums over all.
        self.norm_group = dist.group.WORLD if plan.dp_mode == "fsdp" and plan.dp > 1 else mesh.pp_group
        self.text = _text_stream(plan, request, self.mf, mesh, built.vocab_size) if built.vocab_size else None
        self.scheduler = make_scheduler(built.optimizer, request.steps, request.warmup, request.lr_decay)
        self.state = RankState(mesh.rank, built.tensors, built.optimizer, self.scheduler, self.text, device)
        self.probes = [
            StageProbe(s.index, clock, [b.name for b in plan.blocks[s.start : s.end]])
            for s, clock in zip(self.mine, built.clocks)
        ]
        self.evals: list[tuple[int, float, int]] = []
        self.written: list[str] = []

    def _all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        t = t.to(self.device)  # nccl reduces device tensors only
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.norm_group)
        return t.cpu()

    def _replica_mean(self, losses: list[torch.Tensor]) -> list[torch.Tensor]:
        """The microbatch losses averaged over the replicas: the global batch's."""
        if self.mesh.dp_group is None or not losses:
            return losses
        t = torch.stack([loss.detach() for loss in losses])
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.mesh.dp_group)
        return list(t / self.plan.dp)

    def _args(self, inputs: Sequence[Any]) -> tuple:
        return tuple(x.to(self.device) for x in stage_inputs(inputs)) if self.feeds else ()

    def run_microbatches(self, inputs: Sequence[Any], target: torch.Tensor) -> list[torch.Tensor] | None:
        """One step's microbatches: the first stage's rank feeds the inputs, the last stage's rank
        the target (one rank may hold both: V placements); the others only relay."""
        schedule = self.built.schedule
        if self.scores:
            mb_losses: list[torch.Tensor] = []
            schedule.step(*self._args(inputs), target=target.to(self.device), losses=mb_losses, return_outputs=False)
            return self._replica_mean(mb_losses)
        schedule.step(*self._args(inputs), return_outputs=False)
        return None

    def evaluate(self, step: int) -> None:
        """Loss and perplexity on the held-out part of ``--data`` (forward only, every rank)."""
        assert self.text is not None
        for probe in self.probes:
            probe.begin_step()  # the evaluation's timings are dropped below
        total, count = 0.0, 0
        _set_eval([s.submod for s in self.built.stages], True)
        with torch.no_grad():
            for inputs, target in self.text.eval_batches(self.request.eval_batches or None):
                if self.scores:
                    losses: list[torch.Tensor] = []
                    self.built.schedule.eval(*self._args(inputs), target=target.to(self.device), losses=losses)
                    total += float(torch.stack(self._replica_mean(losses)).mean())
                else:
                    self.built.schedule.eval(*self._args(inputs))
                count += 1
        _set_eval([s.submod for s in self.built.stages], False)
        for probe in self.probes:
            probe.discard_step()
        if self.scores and count:
            loss = total / count
            self.evals.append((step, loss, count))
            if self.request.echo and self.mesh.replica == 0:
                print_flushed(f"eval after step {step}: loss {loss:.4f}, perplexity {math.exp(min(loss, 700)):.2f}")

    def save(self, step: int) -> None:
        """A checkpoint after ``step`` (every rank writes its part)."""
        plan = self.plan
        meta = {
            "plan_fingerprint": plan.model.fingerprint,
            "starts": [s.start for s in plan.stages],
            "schedule": plan.schedule,
            "dp": plan.dp,
            "world_size": plan.world_size,
        }
        path = save_checkpoint(self.request.checkpoint_root, step, self.state, meta)
        self.written.append(str(path))
        if self.request.echo and self.mesh.rank == 0:
            print_flushed(f"checkpoint after step {step}: {path}")

    def after_step(self, step: int) -> None:
        """Evaluation and checkpoint when due (the last step's come after the loop)."""
        request = self.request
        if step == request.steps:
            return
        if self.text is not None and request.eval_every and step % request.eval_every == 0:
            self.evaluate(step)
        if request.save_checkpoints and request.checkpoint_every and step % request.checkpoint_every == 0:
            self.save(step)

    def _resume(self) -> int:
        """The first step to run: after the newest checkpoint when resuming, else 1."""
        if not self.request.resume:
            return 1
        found = latest_checkpoint(self.request.checkpoint_root)
        if found is None:
            raise PlannerError(f"--resume: no complete checkpoint in {self.request.checkpoint_root}")
        return load_checkpoint(found, self.state) + 1

    def _rank_model(self) -> RankModel:
        built = self.built
        return RankModel(
            rank=self.mesh.rank,
            stages=[(s.index, s.first_block, s.last_block) for s in self.mine],
            module=torch.nn.ModuleList(built.modules),
            params=built.params,
            optimizer=built.optimizer,
            device=self.device,
            run_microbatches=self.run_microbatches,
            reduce=self._all_reduce_sum,
            finish_grads=built.finish_grads,
            counted=built.counted,
            scheduler=self.scheduler,
            # the receive buffers exist from the first step on; read them when the tracked step starts
            extra_tensors=lambda: [b for st in built.stages for b in recv_buffers(st)],
        )

    def train(self, progress: Progress) -> RankResult:
        """Resume if asked, train to ``--steps``, evaluate and save the final checkpoint."""
        plan, request = self.plan, self.request
        first_step = self._resume()
        batches: Iterator[tuple[Any, torch.Tensor]] = (
            iter(self.text) if self.text is not None else _model_stream(self.mf, plan, self.mesh, skip=first_step - 1)
        )
        with probes_installed(list(zip(self.built.stages, self.probes)), self.built.schedule):
            result = train_steps(
                self._rank_model(),
                batches,
                request.steps,
                max_norm=plan.optimizer.grad_clip,
                probes=self.probes,
                echo=request.echo and self.scores and self.mesh.replica == 0,  # one rank prints the losses
                print_fn=print_flushed,
                progress=progress,
                first_step=first_step,
                after_step=self.after_step,
            )
            if self.text is not None:
                self.evaluate(request.steps)
        if request.save_checkpoints:
            self.save(request.steps)
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        return dataclasses.replace(
            result,
            replica=self.mesh.replica,
            first_step=first_step,
            peak_device_bytes=peak,
            evals=tuple(self.evals),
            checkpoints=tuple(self.written) if self.mesh.rank == 0 else (),
        )


def train_in_process(plan: Plan, request: RunRequest) -> RankResult:
    """Train a plan of one rank (one stage, one replica) in this process, as its one worker would.

    The same stage, schedule, data stream, checkpoints and evaluation as a launched run, on a
    process group of one (a gloo group over an in-memory store): no process is started.

    Args:
        plan: a plan whose ``world_size`` is 1.
        request: ``planner run``'s options.

    Returns:
        The rank's figures.
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
        return _train_rank(plan, request, _mesh(plan, 0, device), device, Progress())
    finally:
        dist.destroy_process_group()


def run_worker(plan_json: str, request_json: str, error_dir: str) -> RankResult:
    """Entry point of one worker process (top level, so ``spawn`` can pickle it).

    Args:
        plan_json: the plan's JSON text.
        request_json: ``planner run``'s options (a ``RunRequest`` as JSON).
        error_dir: where to leave a failure record.

    Returns:
        This rank's measurements (losses only on the last rank).

    Raises:
        SystemExit: any failure, after writing its record to ``error_dir``: ``rank<R>.json`` (the
            rank, the time, the exception's type and one-line message, whether it is a user error,
            the signal that stopped the rank if one did (SIGINT, SIGTERM), the step it was in and
            the steps it completed, the traceback) and, when a step completed,
            ``rank<R>.partial.pkl`` (the pickled ``RankResult`` of the completed steps).
    """
    _quiet()
    raise_on_stop_signals()
    # torch.fx's interpreter makes a tqdm bar, whose default lock is a multiprocessing semaphore: a
    # rank killed by SIGKILL would leak it ("leaked semaphore objects" at exit). A thread lock does not.
    tqdm.set_lock(threading.RLock())
    progress = Progress()
    try:
        request = RunRequest.model_validate_json(request_json)
        plan = Plan.from_json(plan_json, str(request.plan_file))
        return _train(plan, request, progress)
    except BaseException as e:  # noqa: BLE001 - every failure must reach the launcher as a record
        ignore_stop_signals()  # a second signal while the record is written must not leave half a record
        rank = int(os.environ.get("RANK", -1))
        record = {
            "rank": rank,
            "time": time.time(),
            "type": type(e).__name__,
            "planner_error": isinstance(e, PlannerError),
            "message": " ".join(str(e).split()) or type(e).__name__,
            "signal": SIGNAL_NAMES.get(type(e)),
            "step": progress.step or None,
            "done": progress.done,
            "traceback": traceback.format_exc(),
        }
        folder = Path(error_dir)
        if progress.partial is not None:
            write_atomic(folder / f"rank{rank}.partial.pkl", pickle.dumps(progress.partial))
        write_atomic(folder / f"rank{rank}.json", json.dumps(record).encode())
        sys.stdout.flush()
        raise SystemExit(1) from None
