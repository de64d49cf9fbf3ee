"""A plan trained by your own script: ``pipeline(plan, model, example)`` gives this rank's stages as
torch ``PipelineStage`` objects, torch's schedule for the plan, and what a step needs around the
optimizer (tied gradients, replicas, the global norm), for a loop the script keeps.

``planner run`` trains through the same ``Pipeline`` (``planner.run.worker``, by way of
``runner_hooks``), so a script using it trains exactly as the planner's own runner does.
``docs/interop.md`` has a whole script.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from planner.capture.float8 import precompute_scales
from planner.capture.load import bind_inputs, default_loss, forward_parameters, model_output, prepare_model
from planner.capture.stage import stage_inputs
from planner.core.step.schedules import placement
from planner.errors import PlannerError
from planner.run.context_shard import sequence_chunk
from planner.run.gradients import clip_to_global_norm
from planner.run.loop import MicrobatchFn, ReduceFn
from planner.run.mesh import RankMesh, rank_mesh
from planner.run.model import StageSource, check_runnable
from planner.run.stages import RankStages, build_stages, gathers_float8, stage_unit_fsdp
from planner.run.wrappers import prefetch_gathers, weight_cast_cache
from planner.schema.plan import Plan


class Pipeline:
    """This rank's part of a planned pipeline, for a training loop of your own.

    One step, on every rank of the run (every call is collective)::

        loss = pipe.step(inputs, target)   # forward and backward of the plan's microbatches
        pipe.finish_grads()                # microbatch mean, tied copies summed, replicas averaged
        pipe.clip_grad_norm_(1.0)          # the whole model's norm, as clip_grad_norm_ unsplit
        optimizer.step(); optimizer.zero_grad()
        pipe.precompute_float8_scales()    # float8 weights gathered by FSDP: their scales at once

    Attributes:
        plan: the plan.
        mesh: this rank's place on the (dp, pp, tp) mesh and its process groups.
        device: where this rank's stages run.
        stages: torch ``PipelineStage`` objects of this rank's stages, in stage order.
        modules: the modules they run (wrapped for the plan's replicas), in stage order.
        schedule: torch's schedule object for the plan (``schedule.step`` as torch documents it;
            ``step`` below calls it with the right arguments for this rank).
        is_first: this rank holds the first stage (it is fed the inputs).
        is_last: this rank holds the last stage (it is given the target and computes the loss).
        replica: this rank's data-parallel replica (which rows of the global batch it reads; under
            context parallelism every rank of the replica reads them whole and cuts its own chunk of
            their sequences).
        replicas: the plan's data-parallel replicas (``plan.dp``).
        batch_size: the samples one replica reads per step (``plan.batch_size / plan.dp``).
    """

    def __init__(
        self,
        plan: Plan,
        built: RankStages,
        mesh: RankMesh,
        device: torch.device,
        forward_params: list[inspect.Parameter] | None = None,
    ) -> None:
        self.plan, self.mesh, self.device, self._built = plan, mesh, device, built
        self._forward_params = forward_params or []  # binds inputs given by name
        self.stages, self.modules, self.schedule = built.stages, built.modules, built.schedule
        # GPipe and 1F1B gather a stage-unit FSDP stage when a pass starts (the others' schedules do)
        self._prefetch = stage_unit_fsdp(plan) and placement(plan.schedule) == "single"
        mine = plan.stages_of(mesh.pp_rank)
        self.is_first = any(s.index == 0 for s in mine)
        self.is_last = any(s.index == plan.n_stages - 1 for s in mine)
        # which rows: the context-parallel ranks of a replica read the same ones (each cuts its own chunk)
        self.replica, self.replicas = mesh.data_replica(plan), plan.dp
        self.batch_size = plan.batch_size // plan.dp
        # Under FSDP every rank holds a shard of every parameter of its stages: the norm sums over
        # all; under HSDP over one shard group's replicas (the other groups hold the same shards).
        # Under tensor parallelism every rank of the replica holds part of its stages' gradients
        # (``norm_counted`` leaves the replicated copies to tp rank 0).
        self._norm_group = (
            mesh.norm_group
            if mesh.norm_group is not None
            else dist.group.WORLD
            if plan.dp_mode == "fsdp" and plan.replicas > 1
            else mesh.replica_group
            if plan.tp > 1
            else mesh.pp_group
        )

    def parameters(self) -> list[nn.Parameter]:
        """This rank's trainable parameters, each once (give these to your optimizer)."""
        return list(self._built.params)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers by the unsplit model's names (DTensor shards under FSDP,
        tensor or expert parallelism): what ``torch.distributed.checkpoint.save`` takes, so that a
        checkpoint written by every rank loads into the unsplit model or another plan."""
        shards = self._built.shards
        return {k: shards[id(t)](t) if id(t) in shards else t for k, t in self._built.tensors.items()}

    def step(self, inputs: Any, target: torch.Tensor | None = None) -> torch.Tensor | None:
        """Forward and backward of one step's microbatches (every rank calls it).

        Args:
            inputs: this replica's batch of inputs (``batch_size`` rows), as the model takes them: a
                tuple of positional inputs, one tensor, or a dict by ``forward``'s parameter names.
                Only the first stage's rank reads them; the others may pass None.
            target: this replica's targets; only the last stage's rank reads them.

        Returns:
            On the last stage's rank, the step's loss (the mean over its microbatches, averaged over
            the replicas: the global batch's loss); None on the others.

        Raises:
            PlannerError: the inputs or target are missing on the rank that needs them, or their
                rows are not the replica's batch.
        """
        losses = self._microbatch_losses(inputs, target)
        return None if losses is None else torch.stack([loss.detach() for loss in losses]).mean()

    def finish_grads(self) -> None:
        """Turn the step's accumulated gradients into the step's: the mean over microbatches, tied
        parameters' copies summed across the ranks holding them, replicas averaged (where DDP or FSDP
        did not already)."""
        self._built.finish_grads()

    def clip_grad_norm_(self, max_norm: float | None) -> float:
        """Clip by the whole model's gradient norm, as ``torch.nn.utils.clip_grad_norm_`` on the
        unsplit model would (every rank calls it).

        Args:
            max_norm: the norm to clip to (None: measure only).

        Returns:
            The global gradient norm before clipping.
        """
        return clip_to_global_norm(self._built.params, max_norm, self._sum_for_norm, self._built.counted)

    def precompute_float8_scales(self) -> None:
        """Call after ``optimizer.step()``: under a float8 plan whose FSDP gathers the weights in float8
        (tensorwise, sharded replicas), every float8 weight's scale for the next gathers in one
        all-reduce (torchao's ``precompute_float8_dynamic_scale_for_fsdp``, as torchtitan calls it);
        otherwise nothing. Optional: without it each gather reduces its weight's scale itself, to the
        same value (every rank calls it or none)."""
        if gathers_float8(self.plan):
            precompute_scales(self.modules)

    def _sum_for_norm(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks whose gradients make up the global norm (an all-reduce)."""
        t = t.to(self.device)  # nccl reduces device tensors only
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self._norm_group)
        return t.cpu()

    def _replica_mean(self, losses: list[torch.Tensor]) -> list[torch.Tensor]:
        """Microbatch losses averaged over the replicas: the global batch's."""
        if self.mesh.dp_group is None or not losses:
            return losses
        t = torch.stack([loss.detach() for loss in losses])
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.mesh.dp_group)
        return list(t / self.plan.replicas)

    def _first_stage_args(self, inputs: Any) -> tuple:
        """The first stage's positional tensor inputs on the device (nothing on other ranks)."""
        if not self.is_first:
            return ()
        if inputs is None:
            raise PlannerError(f"rank {self.mesh.rank} holds the first stage: give it the batch's inputs")
        args = stage_inputs(_positional(inputs, self._forward_params, "step()"))
        for x in args:
            if x.shape[0] != self.batch_size:
                raise PlannerError(
                    f"step() was given {x.shape[0]} rows; each of the plan's {self.replicas} replica(s) reads "
                    f"{self.batch_size} per step (--batch-size {self.plan.batch_size}): give each replica its rows"
                )
        return tuple(x.to(self.device) for x in sequence_chunk(args, self.mesh.cp_rank, self.plan.cp))

    def evaluate(self, inputs: Any, target: torch.Tensor | None = None) -> torch.Tensor | None:
        """The loss of one batch, forward only (every rank calls it), the stages in eval mode meanwhile
        where they allow it (torch.export's modules keep the dropout they were traced with).

        Args:
            inputs: as ``step`` takes them.
            target: as ``step`` takes it.

        Returns:
            On the last stage's rank, the batch's loss averaged over the replicas; None on the others.
        """
        train_mode(self.modules, False)
        try:
            with torch.no_grad():
                losses = self._microbatch_losses(inputs, target, training=False)
        finally:
            train_mode(self.modules, True)
        return None if losses is None else torch.stack([loss.detach() for loss in losses]).mean()

    def _microbatch_losses(
        self, inputs: Any, target: torch.Tensor | None, *, training: bool = True
    ) -> list[torch.Tensor] | None:
        """One step's microbatches: the first stage's rank feeds ``inputs``, the last stage's rank the
        target (one rank may hold both: V placements); the others only relay.

        With ``plan.accumulation`` k > 1 the schedule runs k times, on consecutive slices of the
        replica's batch (torch's ``schedule.step`` adds to ``.grad``).

        Args:
            inputs: the replica's batch of inputs, as ``step`` takes them (read on the first stage's
                rank only).
            target: the batch's target (read on the last stage's rank only).
            training: forward and backward (``schedule.step``), else forward only (``schedule.eval``).

        Returns:
            On the last stage's rank, the loss of every microbatch of every pass in order, averaged
            over the replicas; None on the others.

        Raises:
            PlannerError: no inputs, or another number of rows than the replica's batch, on the first
                stage's rank; no target on the last stage's rank.
        """
        args = self._first_stage_args(inputs)
        k = self.plan.accumulation
        run = partial(self.schedule.step, return_outputs=False) if training else self.schedule.eval
        if self.is_last and target is None:
            raise PlannerError(f"rank {self.mesh.rank} holds the last stage: give it the batch's target")
        if self.is_last and target is not None:  # under context parallelism, the rank's chunk of the sequence
            target = sequence_chunk(target, self.mesh.cp_rank, self.plan.cp, "target").to(self.device)
        else:
            target = None
        mb_losses: list[torch.Tensor] = []
        # one copy of each weight in the plan's autocast dtype for the step's every microbatch and pass
        # (training only: autocast caches a cast made under no_grad too, without its autograd link)
        with contextlib.ExitStack() as stack:
            if training:
                stack.enter_context(weight_cast_cache(self.plan, self.device.type))
            if self.plan.loss_parallel:  # the loss and its backward on the split logits (parallel_loss)
                from torch.distributed.tensor.parallel import loss_parallel

                stack.enter_context(loss_parallel())
            for i in range(k):
                if training and self._prefetch:
                    prefetch_gathers(self.modules)
                if not self.is_last:
                    run(*(_pass_slice(x, i, k) for x in args))
                    continue
                assert target is not None
                losses: list[torch.Tensor] = []
                run(*(_pass_slice(x, i, k) for x in args), target=_pass_slice(target, i, k), losses=losses)
                mb_losses += losses
        return self._replica_mean(mb_losses) if self.is_last else None


def runner_hooks(pipe: Pipeline) -> tuple[MicrobatchFn, ReduceFn]:
    """What ``planner run``'s worker (``planner.run.worker``) trains ``pipe`` through, beyond the public
    ``Pipeline`` a user's script steps: the one training loop (``run.loop.train_steps``) records every
    microbatch's loss and times the global norm's all-reduce itself, so it takes those two pieces
    rather than ``step`` and ``clip_grad_norm_``.

    Args:
        pipe: this rank's pipeline.

    Returns:
        ``(inputs, target) -> losses``: one step's microbatches, forward and backward (every
        microbatch's loss averaged over the replicas on the last stage's rank, None on the others);
        and the sum of a tensor over the ranks whose gradients make up the global norm.
    """
    return pipe._microbatch_losses, pipe._sum_for_norm


def train_mode(modules: Sequence[nn.Module], training: bool) -> None:
    """Dropout on (training) or off where the module allows it (torch.export's modules refuse
    ``.eval()``: they evaluate with dropout as traced, which the shipped models set to 0)."""
    for m in modules:
        try:
            m.train(training)
        except (NotImplementedError, RuntimeError):
            pass


def pipeline(
    plan: Plan | str | Path,
    model: nn.Module,
    example: Any,
    *,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
    device: torch.device | str | None = None,
    timeout_s: float = 600.0,
) -> Pipeline:
    """This rank's stages of ``plan``, cut from ``model``, ready for your own training loop.

    Call it on every rank of a ``torchrun``-launched script, after building the same model (the same
    weights: seed the RNG or load one checkpoint) on every rank. The process group is joined from
    torchrun's environment when the script has not joined one (nccl for a plan made for GPUs, gloo
    for a CPU plan). The stages hold their own copy of the weights: train ``Pipeline.parameters()``,
    not ``model``'s. A Hugging Face model's key/value cache is switched off (``config.use_cache``,
    which training never reads), as the planner traced it.

    Args:
        plan: a plan (``Plan``) or the path of a plan.json written by ``planner plan``.
        model: the model the plan was made for (the same structure: the fingerprint is checked).
        example: one batch of inputs as ``step`` takes them (a tuple, a tensor or a dict by name);
            its first ``plan.microbatch_size`` rows size the stages' buffers.
        loss_fn: ``loss_fn(output, target)``, a mean over the batch (None: cross-entropy over the
            last dimension); a Hugging Face output is given as its logits.
        device: where this rank's stages run (None: ``cuda:LOCAL_RANK`` for a GPU plan, else the CPU).
        timeout_s: how long a joined process group waits on another rank (only when it joins one).

    Returns:
        This rank's ``Pipeline``.

    Raises:
        PlanFileError: the model is not the one the plan was made for, or the plan file is invalid.
        PlannerError: another number of processes than the plan's ranks, no process group and no
            torchrun environment, weights that differ between ranks, or an example smaller than a
            microbatch.
    """
    if not isinstance(plan, Plan):
        plan = Plan.load(plan)
    check_runnable(plan)
    where = torch.device(device) if device is not None else _default_device(plan)
    rank = _joined(plan, where, timeout_s)
    if where.type == "cuda":
        torch.cuda.set_device(where)
    _check_same_weights(model, where)
    prepare_model(model)  # a Hugging Face model's key/value cache off, as the planner traced it
    params = forward_parameters(model)
    inputs = tuple(_rows(x, plan.microbatch_size) for x in _positional(example, params, "the example"))
    user_loss = loss_fn or default_loss

    def loss(output: Any, target: torch.Tensor) -> torch.Tensor:
        return user_loss(model_output(output), target)

    mesh = rank_mesh(plan, rank, where)
    built = build_stages(plan, StageSource(model, inputs, loss), mesh, where, want_vocab=False)
    return Pipeline(plan, built, mesh, where, params)


def _default_device(plan: Plan) -> torch.device:
    if plan.profile.backend == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _joined(plan: Plan, device: torch.device, timeout_s: float) -> int:
    """Join the process group from torchrun's environment unless the script has; this rank's number.

    Raises:
        PlannerError: no group and no torchrun environment, or another number of processes than the
            plan's ranks.
    """
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        backend = "nccl" if device.type == "cuda" else "gloo"
        if plan.world_size == 1 and "RANK" not in os.environ:  # a plan of one rank: a group of one, here
            dist.init_process_group(
                backend,
                store=dist.HashStore(),
                rank=0,
                world_size=1,
                timeout=timeout,
                device_id=device if backend == "nccl" else None,
            )
        elif "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise PlannerError(
                f"the plan has {plan.world_size} rank(s) and this process joined no process group: start the script "
                f"with `torchrun --nproc-per-node {plan.world_size} SCRIPT` (or call "
                "torch.distributed.init_process_group first)"
            )
        else:
            dist.init_process_group(backend, timeout=timeout, device_id=device if backend == "nccl" else None)
    world = dist.get_world_size()
    if world != plan.world_size:
        raise PlannerError(
            f"{world} processes joined but the plan has {plan.world_size} ranks ({plan.replicas} replica(s) x "
            f"{plan.n_ranks} pipeline rank(s) x {plan.tp} tensor-parallel); start the script with "
            f"`torchrun --nproc-per-node {plan.world_size}` (or re-plan with --gpus {world})"
        )
    return dist.get_rank()


def _check_same_weights(model: nn.Module, device: torch.device) -> None:
    """Every rank built the same weights: each stage is cut from its own rank's copy of the model, so
    ranks built from different seeds would train a model no one built.

    Raises:
        PlannerError: the weights differ between ranks.
    """
    total, squares = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    for t in model.state_dict().values():
        if t.is_floating_point() and not t.is_meta:
            total += torch.sum(t.detach(), dtype=torch.float64).cpu()
            squares += torch.sum(t.detach().double() ** 2).cpu()
    mine = torch.stack([total, squares]).to(device)
    low, high = mine.clone(), mine.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    if not torch.equal(low, high):
        raise PlannerError(
            "the model's weights differ between ranks: build it the same way on every rank (torch.manual_seed(...) "
            "before building it, or load one checkpoint), so that every stage starts from one model"
        )


def _positional(inputs: Any, params: list[inspect.Parameter], what: str) -> tuple:
    """Inputs as the model's positional arguments: a tuple as it is, one tensor as a 1-tuple, a dict
    bound by ``forward``'s parameter names (``bind_inputs``)."""
    if isinstance(inputs, tuple):
        return inputs
    if isinstance(inputs, torch.Tensor):
        return (inputs,)
    if isinstance(inputs, Mapping):
        return bind_inputs(inputs, params, what)
    if isinstance(inputs, Sequence) and not isinstance(inputs, str):
        return tuple(inputs)
    raise PlannerError(
        f"{what}: expected a tuple, a tensor or a dict of the model's inputs, not {type(inputs).__name__}"
    )


def _rows(x: Any, n: int) -> Any:
    """A microbatch's rows of one input (non-tensor inputs as they are).

    Raises:
        PlannerError: fewer than ``n`` rows.
    """
    if not isinstance(x, torch.Tensor):
        return x
    if x.dim() == 0 or x.shape[0] < n:
        rows = 0 if x.dim() == 0 else x.shape[0]
        raise PlannerError(
            f"the example input has {rows} row(s) but the plan's microbatch is {n} sample(s): give at least one "
            "microbatch (a batch from your data loader will do)"
        )
    return x[:n]


def _pass_slice(t: torch.Tensor, i: int, passes: int) -> torch.Tensor:
    """Pass ``i``'s consecutive share of the replica's batch (dim 0) out of ``passes``."""
    if passes == 1:
        return t
    rows = t.shape[0] // passes
    return t[i * rows : (i + 1) * rows]
