"""Training in this process, without a pipeline: the 1-stage plan, and the unsplit reference that
a pipelined run must match (the same loss and gradients as the unsplit model, docs/architecture.md).

The model is the user's own ``nn.Module`` from ``build_model`` (not the traced graph), built with
the plan's seed, trained on the same data stream, with the same optimizer and clipping as the
pipeline. With ``n_microbatches > 1`` the batch is split the way the pipeline schedule splits it
(``torch.tensor_split`` on dim 0) and gradients are accumulated with weight 1/m, which is what
``PipelineScheduleSingle(scale_grads=True)`` does; for a mean-reduced loss that equals one
full-batch step.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from planner.capture.float8 import convert_model
from planner.capture.load import ModelFile
from planner.capture.shapes import keeps_fp32_weights
from planner.run.loop import RankModel, RankResult, run_result, train_steps
from planner.run.measure import StageProbe
from planner.run.model import load_plan_model
from planner.run.optim import make_optimizer
from planner.run.wrappers import autocast_region, sharded_param_dtype
from planner.schema.plan import Plan
from planner.schema.result import RunResult
from planner.threads import torch_threads


def _chunks(value: Any, m: int) -> list[Any]:
    """Split a tensor on dim 0 into m pieces; anything else is given to every piece unchanged."""
    if isinstance(value, torch.Tensor):
        return list(torch.tensor_split(value, m, dim=0))
    return [value] * m


def narrowed_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The trainable parameters FSDP's mixed precision gathers in the plan's dtype: all but those of
    modules that keep theirs in fp32 (``planner.capture.shapes.keeps_fp32_weights``: batch norm)."""
    kept = {id(p) for m in model.modules() if keeps_fp32_weights(m) for p in m.parameters(recurse=False)}
    return [p for p in model.parameters() if p.requires_grad and id(p) not in kept]


class NarrowWeights:
    """The unsplit model computing as the plan's FSDP-sharded stages do in a bf16 (or fp16) plan:
    with its weights in that dtype, its gradients summed over microbatches in fp32 into its fp32
    weights' ``.grad`` (``planner.run.wrappers.fsdp_policy``), so that the reference rounds as they do.

    ``run(step)`` calls ``step(i)`` for each microbatch with the weights narrowed, adds each
    microbatch's gradients into fp32 ones and puts the fp32 weights back, whatever happens.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], dtype: torch.dtype) -> None:
        self.params = list(params)
        self.dtype = dtype

    def run(self, n: int, step: Callable[[int], torch.Tensor]) -> list[torch.Tensor]:
        """``step(i)`` for i < n under the narrowed weights; their fp32 gradients set after."""
        masters = [p.data for p in self.params]
        sums: list[torch.Tensor | None] = [p.grad.float() if p.grad is not None else None for p in self.params]
        try:
            for p in self.params:
                p.grad = None
                p.data = p.data.to(self.dtype)
            losses = []
            for i in range(n):
                losses.append(step(i))
                for k, p in enumerate(self.params):
                    if p.grad is not None:
                        g, held = p.grad.float(), sums[k]
                        sums[k] = g if held is None else held.add_(g)
                        p.grad = None
        finally:
            for p, master in zip(self.params, masters):
                p.grad = None
                p.data = master
        for p, total in zip(self.params, sums):
            p.grad = total
        return losses


def _microbatch(
    model: torch.nn.Module,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    inputs: list[Any],
    target: torch.Tensor,
    i: int,
    n_microbatches: int,
    probe: StageProbe,
    autocast: Callable[[], Any],
) -> torch.Tensor:
    """Forward, loss and backward of microbatch ``i``, timed into ``probe``; its gradient weighs 1/m."""
    if probe.memory is not None:
        probe.memory.reset_mod_stats()  # see StageProbe: one root forward per microbatch
    ta = time.perf_counter()
    with autocast():  # a fresh region of the plan's --dtype per microbatch (a no-op without one)
        out = model(*inputs)
        tb = time.perf_counter()
        loss = loss_fn(out, target)
    tc = time.perf_counter()
    (loss / n_microbatches).backward()
    td = time.perf_counter()
    probe.add_fwd(i, tc - ta)
    probe.add_loss(i, tc - tb)
    probe.add_bwd(i, td - tc)
    return loss.detach()


def train_model_file(
    plan: Plan,
    mf: ModelFile,
    steps: int,
    *,
    n_microbatches: int = 1,
    echo: bool = True,
    print_fn: Callable[[str], None] = print,
    track_memory: bool = True,
    plan_path: str | Path | None = None,
) -> RunResult:
    """Train ``mf``'s unsplit model for ``steps`` steps in this process with the plan's settings.

    Args:
        plan: batch size, optimizer, seed and threads come from here (its stages are ignored).
        mf: the loaded model file, with the plan's config.
        steps: optimizer steps to take.
        n_microbatches: gradient-accumulation microbatches per step (1: one full-batch pass).
        echo: print one progress line per step.
        print_fn: where progress lines go.
        track_memory: run the last step (of two or more) under the memory tracker.
        plan_path: the plan file, recorded in the result.

    Returns:
        The measured run (mode "local", one rank).
    """
    rank = train_local(
        plan, mf, steps, n_microbatches=n_microbatches, echo=echo, print_fn=print_fn, track_memory=track_memory
    )
    return run_result(plan, [rank], mode="local", plan_path=plan_path, n_microbatches=n_microbatches)


def train_local(
    plan: Plan,
    mf: ModelFile,
    steps: int,
    *,
    n_microbatches: int = 1,
    echo: bool = True,
    print_fn: Callable[[str], None] = print,
    track_memory: bool = True,
) -> RankResult:
    """The in-process run as rank 0 of one: the whole model, gradients accumulated over microbatches.

    Args:
        plan: batch size, optimizer, seed and threads come from here (its stages are ignored).
        mf: the loaded model file, with the plan's config.
        steps: optimizer steps to take.
        n_microbatches: gradient-accumulation microbatches per step (1: one full-batch pass).
        echo: print one progress line per step.
        print_fn: where progress lines go.
        track_memory: run the last step (of two or more) under the memory tracker.

    Returns:
        This process's figures (rank 0, holding every block).
    """
    with torch_threads(plan.profile.threads):
        model = mf.build(plan.model.seed)
        if plan.profile.float8 is not None:  # the layers the stages convert, emulated here on the CPU
            convert_model(model, plan.profile.float8, emulate=True)
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = make_optimizer(params, plan)
        batches = mf.train_batches(plan.batch_size, seed=plan.model.seed)
        loss_fn = mf.loss_fn
        probe = StageProbe()
        cast = functools.partial(autocast_region, plan, "cpu")  # the plan's --dtype, as the stages run

        narrow = sharded_param_dtype(plan)  # the sharded stages' weights: as FSDP gathers them

        def run_microbatches(inputs: Sequence[Any], target: torch.Tensor) -> list[torch.Tensor]:
            split_inputs = [_chunks(x, n_microbatches) for x in inputs]
            split_target = _chunks(target, n_microbatches)

            # one microbatch live at a time: each casts its own weight copies (sharing them would hold
            # their gradients too, planner.core.levers.casts.shared_casts)
            def one(i: int) -> torch.Tensor:
                xs = [x[i] for x in split_inputs]
                return _microbatch(model, loss_fn, xs, split_target[i], i, n_microbatches, probe, cast)

            if narrow is not None:
                return NarrowWeights(narrowed_params(model), narrow).run(n_microbatches, one)
            return [one(i) for i in range(n_microbatches)]

        rank = RankModel(
            rank=0,
            stages=[(0, plan.blocks[0].name, plan.blocks[-1].name)],
            module=model,
            params=params,
            optimizer=optimizer,
            device=torch.device("cpu"),
            run_microbatches=run_microbatches,
        )
        return train_steps(
            rank,
            batches,
            steps,
            max_norm=plan.optimizer.grad_clip,
            probes=[probe],
            track_memory=track_memory,
            echo=echo,
            print_fn=print_fn,
        )


def train_reference(plan: Plan, plan_path: str | Path, steps: int, *, echo: bool = False) -> RunResult:
    """The unsplit model trained on full batches in this process: what a pipelined run must match.

    Args:
        plan: the plan whose model, seed, data, optimizer and clipping to use.
        plan_path: the plan file (relative model paths resolve against its folder).
        steps: optimizer steps.
        echo: print one progress line per step.

    Returns:
        The measured run (mode "local", ``n_microbatches`` 1; under float8's tensorwise scaling, each
        replica's microbatches: a cast's scale is its tensor's largest magnitude, which a full batch
        takes over more rows than any rank's microbatch holds).
    """
    f8 = plan.profile.float8
    n = plan.dp * plan.n_microbatches * plan.accumulation if f8 is not None and f8.recipe == "tensorwise" else 1
    return train_model_file(
        plan,
        load_plan_model(plan, plan_path),
        steps,
        n_microbatches=n,
        echo=echo,
        track_memory=False,
        plan_path=plan_path,
    )
