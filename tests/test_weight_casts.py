"""Autocast's lower-precision copies of the weights: held once a step by the runner, counted apart.

Under ``--dtype bf16`` a stage keeps fp32 weights and computes under ``torch.autocast``; each matmul
saves a bf16 copy of its weight for backward. The runner opens every microbatch's forward in a
fresh autocast region (``planner.run.wrappers.Autocast``) inside one step-wide
``weight_cast_cache``, so the microbatches share one copy; the profilers count the copies apart
from the activations (``BlockCost.weight_cast_bytes``), and the memory model holds them once.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch
from run_factory import MODELS, assert_close, plan_with_starts, saved
from torch import nn

from planner.core.levers.casts import shares_casts
from planner.costs.levers import is_weight_cast
from planner.run import run_plan, train_reference
from planner.run.wrappers import Autocast, weight_cast_cache
from planner.schema.plan import Plan
from planner.schema.run_request import RunRequest


def _with_autocast(plan: Plan, autocast: str | None) -> Plan:
    return plan.model_copy(update={"profile": plan.profile.model_copy(update={"autocast": autocast})})


def _bf16_plan() -> Plan:
    return _with_autocast(plan_with_starts(MODELS / "gpt.py", [0, 3], schedule="1f1b", n_microbatches=4), "bf16")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def test_is_weight_cast_tells_autocasts_copies_from_activations_and_parameters() -> None:
    model = _mlp()
    params = {id(p) for p in model.parameters()}
    saved: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    x = torch.randn(4, 16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        model(x).float().sum()
    casts = [t for t in saved if is_weight_cast(t, params)]
    # each Linear saves its weight's bf16 copy (transposed: a view of the cast) for its input's gradient
    assert sorted(tuple(t.shape) for t in casts) == [(16, 32), (32, 8)]
    assert all(t.dtype == torch.bfloat16 for t in casts)
    # the activations (inputs, the ReLU's output) are not copies of weights
    assert len(saved) > len(casts) and not any(is_weight_cast(t, params) for t in saved if t.shape[0] == 4)
    # without autocast the matmul saves the fp32 parameter itself: no copy
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        model(x).sum()
    assert not any(is_weight_cast(t, params) for t in saved)
    assert not is_weight_cast(model[0].weight.to(torch.bfloat16).detach(), params)  # no autograd link


def _step(
    model: nn.Module, plan: Plan, shared: bool, microbatches: int = 3, share: bool = True
) -> tuple[int, list[torch.Tensor]]:
    """One step of ``microbatches`` forwards (all in flight, as GPipe runs them) then their backwards,
    each forward in its own autocast region as a stage runs it (``share``: a stage with many live);
    inside the step's cache if ``shared``. Returns the distinct bf16 weight copies saved, and the
    parameters' gradients."""
    stage = Autocast(model, plan, "cpu", share=share)
    params = {id(p) for p in model.parameters()}
    copies: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if is_weight_cast(t, params):
            copies.add(t.untyped_storage().data_ptr())
        return t

    torch.manual_seed(1)
    # a stage's input needs a gradient (it came from the stage before): every Linear saves its copy
    batches = [torch.randn(4, 16, requires_grad=True) for _ in range(microbatches)]
    model.zero_grad(set_to_none=True)
    with weight_cast_cache(plan, "cpu") if shared else contextlib.nullcontext():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            losses = [stage(x).float().square().mean() for x in batches]
        for loss in losses:
            loss.backward()
    return len(copies), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_one_step_holds_one_copy_of_each_weight_whatever_the_microbatches_in_flight() -> None:
    plan = _bf16_plan()
    model = _mlp()
    per_microbatch, grads_apart = _step(model, plan, shared=False)
    once, grads_shared = _step(model, plan, shared=True)
    # two Linear weights: a copy each per microbatch in flight without the cache, one each with it
    assert (per_microbatch, once) == (2 * 3, 2)
    # the same casts of the same weights: the gradients are the same, bit for bit
    assert len(grads_shared) == 4 and all(torch.equal(a, b) for a, b in zip(grads_apart, grads_shared))
    # a stage with few live (planner.core.levers.casts.shares_casts) keeps its own copies per microbatch
    assert not shares_casts(2) and shares_casts(3)
    assert not shares_casts(3, sharded=True) and not shares_casts(3, recompute="full")
    own, grads_own = _step(model, plan, shared=True, share=False)
    assert own == 2 * 3 and all(torch.equal(a, b) for a, b in zip(grads_apart, grads_own))
    # the cache is gone after the step: the next step casts the (updated) weights again
    assert not torch.is_autocast_enabled("cpu")
    with torch.no_grad():
        model[0].weight.add_(1.0)
    _, after = _step(model, plan, shared=True)
    assert not torch.equal(after[0], grads_shared[0])


def test_the_cache_changes_nothing_without_autocast() -> None:
    assert isinstance(weight_cast_cache(_with_autocast(_bf16_plan(), None), "cpu"), contextlib.nullcontext)
    cache = weight_cast_cache(_bf16_plan(), "cpu")
    with cache:  # computes nothing in bf16 itself: only the microbatches' own regions do
        assert not torch.is_autocast_enabled("cpu")
        assert torch.matmul(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.float32


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("schedule", "recompute", "extra"),
    [
        ("1f1b", None, {}),
        ("zbv", None, {}),
        ("1f1b", ("full", "selective"), {}),
        ("zbv", ("full:1",), {}),
        ("gpipe", None, {"dp": 2, "dp_mode": "fsdp", "fsdp_units": "block"}),
        ("1f1b", None, {"dp": 2, "dp_mode": "fsdp", "fsdp_units": "stage"}),
        ("1f1b", None, {"own": 1}),
    ],
    ids=["1f1b", "zbv", "checkpointed", "zbv-checkpointed", "fsdp-blocks", "fsdp-stages", "one-stage-shares"],
)
def test_bf16_pipelines_train_like_the_unsplit_model_under_the_same_autocast(
    tmp_path: Path, schedule: str, recompute: tuple[str, ...] | None, extra: dict[str, Any]
) -> None:
    # the shared copies serve every microbatch's backward, the zero-bubble schedules' split input and
    # weight halves too, the checkpoint regions' rebuilt forwards (which find the cached copies), FSDP's
    # gathered weights (resharded after each block's forward: the cached copy outlives the gathered
    # storage), and a rank whose stage keeps its own copies beside one that shares
    own = extra.pop("own", None)
    starts, v = ([0, 3], 1) if schedule != "zbv" else ([0, 2, 4, 5], 2)
    plan = plan_with_starts(MODELS / "gpt.py", starts, schedule=schedule, n_microbatches=4, stages_per_rank=v, **extra)
    stages = list(plan.stages)
    if recompute is not None:
        stages = [s.model_copy(update={"recompute": recompute[i % len(recompute)]}) for i, s in enumerate(stages)]
    if own is not None:  # that stage planned with one microbatch live: its microbatches cast for themselves
        stages[own] = stages[own].model_copy(update={"in_flight": 1})
    plan = _with_autocast(plan.model_copy(update={"stages": stages}), "bf16")
    # FSDP never shares (it gathers the weights in bf16: there are no copies), nor does a
    # recomputing stage (its regions drop their copies)
    want = [s.index != own and not plan.sharded and s.recompute == "never" for s in plan.stages]
    assert [shares_casts(s.in_flight, plan.sharded, s.recompute) for s in plan.stages] == want
    path = saved(plan, tmp_path)
    got = run_plan(plan, RunRequest(plan_file=path, steps=3, save_checkpoints=False, echo=False))
    want = train_reference(plan, path, 3)  # the unsplit model under the same autocast
    fp32 = train_reference(_with_autocast(plan, None), path, 3)
    if plan.sharded:
        # FSDP gathers the weights in bf16 and sums the gradients in fp32 (run.wrappers.fsdp_policy):
        # the reference computes so too, and apart from fp32 weights under autocast (as DDP runs)
        ddp = train_reference(plan.model_copy(update={"dp_mode": "ddp"}), path, 3)
        assert want.losses != pytest.approx(ddp.losses, rel=1e-6)
    assert_close(got.losses, want.losses, "loss")
    # bf16 rounds the pipelined and the unsplit sums apart by ~1e-3 at step 3: the same figures, to the
    # last bit, as the runner gave before it shared the copies (checked when the cache was added)
    assert got.grad_norms == pytest.approx(want.grad_norms, rel=3e-3)
    assert want.losses != pytest.approx(fp32.losses, rel=1e-6)  # autocast really ran
