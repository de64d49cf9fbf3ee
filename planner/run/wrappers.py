"""What wraps a stage module on a rank, innermost first (inside it, a recomputing stage's checkpoint
regions: ``planner.capture.checkpoint``): ``torch.compile`` and autocast (the plan's speed levers), the boundary that makes every tensor
crossing it contiguous, and DDP without module hooks; and the plan's autocast region, shared with
the in-process run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from planner.capture.shapes import keeps_fp32_weights
from planner.core.levers.casts import shares_casts
from planner.run.boundary import BoundaryScatter
from planner.schema.plan import Plan
from planner.torch_compat import is_view

AUTOCAST_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""The plan's ``profile.autocast`` -> the dtype ``torch.autocast`` computes in."""


def fsdp_policy(plan: Plan) -> Any:
    """FSDP2's mixed precision for the plan's sharded stages: in a bf16 (or fp16) plan the weights are
    gathered in that dtype and the gradients accumulated over microbatches and reduce-scattered in
    fp32, as torchtitan, Megatron and the Llama 3 run keep them; in fp32, FSDP's default.

    Gathered in the plan's dtype, the weights are what autocast computes in already, so a sharded
    stage saves no copies of them (``planner.core.levers.casts.without_casts``) and its gathers move half
    the bytes; the fp32 master weights (the shards) are what the optimizer steps, as under autocast.
    The memory model counts what this holds (``planner.core.split.stage_model.unsharded_bytes``).

    Args:
        plan: the plan (``profile.run_autocast``).

    Returns:
        A ``torch.distributed.fsdp.MixedPrecisionPolicy``.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = sharded_param_dtype(plan)
    if dtype is None:
        return MixedPrecisionPolicy()
    # the inputs stay as they come (autocast casts what its matmuls take): FSDP's cast of every
    # floating input would also narrow what a stage only passes on (a mask, rotary tables), and the
    # dtypes crossing each cut would then depend on which stages a tensor went through
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)


def shard_over_replicas(plan: Plan, module: torch.nn.Module, mesh: Any, reshard_after_forward: bool) -> None:
    """``fully_shard`` of ``module`` over the replicas with the plan's mixed precision (``fsdp_policy``).

    In a bf16 plan each submodule that keeps its weights in fp32
    (``planner.capture.shapes.keeps_fp32_weights``: batch norm) first becomes its own unit with FSDP's
    default policy, so that its weights are gathered in fp32 while the rest are gathered in bf16
    (FSDP2 takes a nested unit's policy for its own parameters; a unit sharded before, as block
    units are before their root, is left as it is).

    Args:
        plan: the plan (its dtype).
        module: the module to shard (a stage, one of its units, or their root).
        mesh: the data-parallel mesh.
        reshard_after_forward: FSDP's, for the module and its fp32 units alike.
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    if sharded_param_dtype(plan) is not None:
        for sub in module.modules():
            if sub is not module and keeps_fp32_weights(sub) and not isinstance(sub, FSDPModule):
                fully_shard(
                    sub, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=MixedPrecisionPolicy()
                )
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=fsdp_policy(plan))


def prefetch_gathers(modules: Sequence[torch.nn.Module]) -> None:
    """Start FSDP's all-gather of every FSDP unit in ``modules`` now, without waiting: each unit's
    forward then waits for its own (FSDP2's pre-forward finds the gather under way).

    GPipe and 1F1B (torch's ``PipelineScheduleSingle``) would gather a stage lazily at its first
    forward, on the critical path of the first microbatch at every rank; issued when the pass starts,
    a rank that waits for its first activation gathers meanwhile, as the plan predicts
    (``planner.core.step.simulate.Traffic``). The multi-stage schedules prefetch through their own
    ``UNSHARD`` actions (``planner.torch_compat.gather_each_stage_once``).

    Args:
        modules: the rank's stage modules sharded with stage units (``shard_over_replicas``).
    """
    from torch.distributed.fsdp import FSDPModule

    for module in modules:
        for sub in module.modules():
            if isinstance(sub, FSDPModule):
                sub.unshard(async_op=True)


def sharded_param_dtype(plan: Plan) -> torch.dtype | None:
    """The dtype the plan's FSDP-sharded stages compute their weights in (``fsdp_policy``): the plan's
    autocast dtype where it shards, else None (the weights' own)."""
    if not plan.sharded or plan.profile.run_autocast is None:
        return None
    return AUTOCAST_DTYPES[plan.profile.run_autocast]


def autocast_region(plan: Plan, device_type: str, cache: bool = True) -> contextlib.AbstractContextManager[Any]:
    """A fresh region of the plan's autocast (``--dtype`` on measured costs), or one that changes nothing.

    Args:
        plan: the plan (``profile.run_autocast``: "bf16", "fp16" or None).
        device_type: where the region computes ("cpu", "cuda").
        cache: its weight casts go to autocast's cache (shared while an outer region holds it:
            ``weight_cast_cache``), else each is made for this region alone.

    Returns:
        A new context manager per call, as the profile opened one per block run.
    """
    if plan.profile.run_autocast is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=AUTOCAST_DTYPES[plan.profile.run_autocast], cache_enabled=cache)


def weight_cast_cache(plan: Plan, device_type: str) -> contextlib.AbstractContextManager[Any]:
    """Around one step's forwards and backwards: the microbatches of a stage that shares its casts
    (``Autocast``'s ``share``) use one lower-precision copy of each weight, not one each (nothing
    changes without autocast).

    torch keeps autocast's casts of leaf parameters in a cache that it drops when the outermost
    autocast region ends. Each microbatch's forward runs in a fresh region (``Autocast``), so
    without an outer one every microbatch in flight would hold its own copies of the stage's weights,
    saved for its backward (a Llama 3 8B stage: 1.8 GiB per microbatch in flight). This region
    computes nothing in the lower precision itself (backward runs outside autocast, as torch's
    recipe has it); it only holds the nesting open, so the cached casts live until the step's last
    backward, once. A compiled stage casts inside its graph and keeps one copy per microbatch regardless (the
    plan counts it so: ``planner.core.levers.casts.compiled_casts``).

    Only around forwards that build autograd graphs: torch caches a weight's cast made under
    ``no_grad`` too, without its link to the weight, and a later forward in the same cache would
    then train nothing into that weight (the checkpoint regions are non-reentrant: their forward
    keeps grad mode on, and a rebuilt region finds the linked copy).

    Args:
        plan: the plan (``profile.run_autocast``).
        device_type: where the stages compute ("cpu", "cuda").

    Returns:
        A new context manager per call.
    """
    if plan.profile.run_autocast is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=AUTOCAST_DTYPES[plan.profile.run_autocast], enabled=False)


class ContiguousGrad(torch.autograd.Function):
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
        # tensor parallelism: inputs gathered from, outputs scattered into 1/tp pieces (run.boundary)
        self.scatter: BoundaryScatter | None = None

    def __call__(self, *args: object) -> object:
        # Called without nn.Module's hooks, on purpose: the stage's inputs are leaf tensors (the
        # receive buffers), and a module-level grad hook on a leaf breaks ``autograd.grad``, which the
        # zero-bubble schedules' input-only backward uses ("A leaf node was passed to
        # _will_engine_execute_node"); MemTracker installs such hooks on every module it sees called.
        # This wrapper has no hooks of its own; the stage module inside is called normally and
        # receives non-leaf tensors (``ContiguousGrad``'s outputs).
        # Under FSDP (never with those schedules) the wrapper is the sharded module, whose hooks
        # gather the parameters: there it is called with them.
        if self.hooks:
            return super().__call__(*args)
        return self.forward(*args)

    def forward(self, *args: object) -> object:
        args = tuple(ContiguousGrad.apply(a) if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args)
        if self.scatter is not None:
            args = self.scatter.gather(args)
        out = self.module(*args)
        if self.scatter is not None:  # first: a scattered piece is a copy of its own already
            out = self.scatter.scatter(out)
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


class Autocast(torch.nn.Module):
    """Run a stage's forward under ``torch.autocast`` (the plan's ``profile.run_autocast``): parameters
    stay fp32, the matmuls and what they save run in the lower precision, as the profile measured.

    A fresh autocast region per call. With ``share`` (a stage with many microbatches live:
    ``planner.core.levers.casts.shares_casts``) its weight casts go to autocast's cache, which the
    step's ``weight_cast_cache`` keeps, so they are made once per step and shared by the
    microbatches; without, each microbatch makes and saves its own (fewer bytes with one or two
    live: a shared copy's gradients wait for the end of every backward, ``shared_casts``)."""

    def __init__(self, module: torch.nn.Module, plan: Plan, device_type: str, share: bool = True):
        super().__init__()
        self.module, self.plan, self.device_type, self.share = module, plan, device_type, share

    def forward(self, *args: object) -> object:
        with autocast_region(self.plan, self.device_type, cache=self.share):
            return self.module(*args)


def autocast_loss(
    loss_fn: Callable[..., torch.Tensor], plan: Plan, device: torch.device
) -> Callable[..., torch.Tensor]:
    """The model file's loss under the plan's autocast, as the profile timed the last block (unchanged without).

    Args:
        loss_fn: the model file's loss.
        plan: the plan (``profile.run_autocast``).
        device: where the loss runs.

    Returns:
        ``loss_fn`` itself without autocast, else a function calling it in a fresh autocast region.
    """
    if plan.profile.run_autocast is None:
        return loss_fn

    def loss(output: Any, target: Any) -> torch.Tensor:
        with autocast_region(plan, device.type):
            return loss_fn(output, target)

    return loss


def apply_speed_levers(
    plan: Plan,
    module: ContiguousBoundary,
    inner: torch.nn.Module,
    device: torch.device,
    in_flight: int = 1,
    recompute: str = "never",
) -> None:
    """Apply the plan's ``compile`` and ``profile.autocast`` to a stage (after any sharding: FSDP
    wraps the eager module; the compiled one runs inside it).

    The compiled module compiles at its first call, which must happen inside
    ``planner.torch_compat.retain_graph_compile`` (the worker trains inside it): the zero-bubble
    schedules' two-part backward runs the compiled backward twice, which donated buffers forbid.

    Args:
        plan: the plan (``compile``, ``profile.autocast``).
        module: the stage's boundary wrapper; what it calls is replaced.
        inner: the stage module (checkpointed where the plan says), as the boundary calls it now.
        device: where the stage runs (autocast's device type).
        in_flight: the stage's peak live microbatches (``StagePlan.in_flight``) and
        recompute: its recompute value: they decide whether its microbatches share autocast's weight
            copies (``planner.core.levers.casts.shares_casts``).
    """
    run = inner
    if plan.compile:
        run = torch.compile(inner)  # type: ignore[assignment]
    if plan.profile.run_autocast is not None:
        run = Autocast(run, plan, device.type, share=shares_casts(in_flight, plan.sharded, recompute))
    module.module = run


class HooklessDDP(DistributedDataParallel):
    """``DistributedDataParallel`` called without nn.Module's hooks, like ``ContiguousBoundary`` and
    for the same reason: its inputs are the stage's leaf receive buffers. ``PipelineStage``
    recognises it as DDP (no all-reduce until the last microbatch's backward)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)
