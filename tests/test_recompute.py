"""Tier 2 (CPU torch): activation checkpointing block by block (``planner.capture.checkpoint``).

What a checkpointed stage keeps and recomputes, checked exactly where it can be (bytes of known
shapes) and against the plain stage (values and gradients); what the profiler and the estimator
measure of it; the block clock under recomputation.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from planner.capture.checkpoint import CheckpointedStage, checkpointed, checkpointed_stage, kept_bytes
from planner.capture.clock import BlockClock
from planner.capture.load import load_model_file
from planner.capture.stage import stage_module
from planner.capture.trace import trace_model
from planner.core.levers.hardware import get_hardware
from planner.costs.estimate import estimate_blocks
from planner.costs.measure import profile_model
from planner.costs.settings import ProfileSettings, Sample

ROOT = Path(__file__).resolve().parent.parent
B, D = 8, 32


class Mlp(nn.Module):
    """Two blocks: up-projection with GELU, down-projection; each a ``layers.i``."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(D, 4 * D), nn.GELU()), nn.Linear(4 * D, D)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def test_selective_checkpointing_keeps_exactly_the_matmul_outputs() -> None:
    # Linear(D, 4D) + GELU on (B, D): the one addmm's output, B x 4D floats; GELU's is recomputed
    block = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU())
    x = torch.randn(B, D, requires_grad=True)
    with kept_bytes() as kept:
        block(x)
    assert kept.total() == 4 * B * 4 * D
    # as torchtitan's policy, only every other plain matmul (aten.mm) is kept: the first and the third
    chain = nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(D, D, bias=False), nn.ReLU())])
    with kept_bytes() as alternate:
        chain(x)
    assert alternate.total() == 2 * 4 * B * D
    # a block without matmuls keeps nothing
    with kept_bytes() as none:
        F.gelu(x) * 2
    assert none.total() == 0


def _gpt() -> tuple[object, tuple, torch.Tensor, object]:
    mf = load_model_file(ROOT / "models" / "gpt.py", "tiny", {})
    torch.manual_seed(0)
    model = mf.build()
    inputs, target = mf.batch(4)
    return mf, inputs, target, trace_model(model, inputs)


@pytest.mark.parametrize("mode", ["full", "selective", "first two full"])
def test_a_checkpointed_stage_computes_what_the_plain_stage_does(mode: str) -> None:
    mf, inputs, target, traced = _gpt()
    n = len(traced.blocks)
    units = [(k, k + 1) for k in range(n)]
    plain = stage_module(traced, 0, n)
    modes = ["full", "full"] + ["never"] * (n - 2) if mode == "first two full" else mode  # a plan's "full:2"
    regions = checkpointed_stage(traced, units, modes, stage_module)
    assert isinstance(regions, CheckpointedStage) and len(regions.regions) == n
    params = [p for p in traced.model.parameters() if p.requires_grad]

    def grads(module: nn.Module) -> tuple[float, list[torch.Tensor]]:
        for p in params:
            p.grad = None
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)  # the same dropout masks in both runs
            loss = mf.loss_fn(module(*inputs), target)
        loss.backward()
        return loss.item(), [p.grad.clone() for p in params]

    loss_a, grads_a = grads(plain)
    loss_b, grads_b = grads(regions)
    assert loss_b == pytest.approx(loss_a, rel=1e-6)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_a_checkpointed_stage_keeps_less_for_backward() -> None:
    # what autograd keeps outside the regions: each region's input (full), plus the kept outputs (selective)
    mf, inputs, target, traced = _gpt()
    n = len(traced.blocks)
    units = [(k, k + 1) for k in range(n)]

    def held(module: nn.Module) -> int:
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            mf.loss_fn(module(*inputs), target)
        params = {p.untyped_storage().data_ptr() for p in traced.model.parameters()}
        return sum(v for k, v in seen.items() if k not in params)

    never = held(stage_module(traced, 0, n))
    full = held(checkpointed_stage(traced, units, "full", stage_module))
    assert full < 0.3 * never
    # the first two regions recomputed, the rest as they are: in between
    some = held(checkpointed_stage(traced, units, ["full", "full"] + ["never"] * (n - 2), stage_module))
    assert full < some < never


def test_recomputation_passes_no_clock_mark() -> None:
    # a forward action notes each block's mark once; the recomputation inside backward notes none
    _, inputs, target, traced = _gpt()
    n = len(traced.blocks)
    clock = BlockClock(0, n, loss_in_last=True)
    stage = checkpointed_stage(traced, [(k, k + 1) for k in range(n)], "full", stage_module, clock)
    clock.begin("F")
    out = stage(*inputs)
    clock.finish()
    forward_marks = [k for k, _ in clock.actions[-1].marks]
    assert sorted(set(forward_marks)) == list(range(-1, n))
    clock.begin("B")
    F.cross_entropy(out.flatten(0, 1), target.flatten()).backward()
    clock.finish()
    backward_marks = [k for k, _ in clock.actions[-1].marks]
    # backward passes the marks from the last block down (a boundary's twice: the output mark of the
    # region before it and the input mark of the region after it, back to back); a recomputation
    # would note its region's marks again in forward order, going up
    assert backward_marks == sorted(backward_marks, reverse=True), backward_marks
    assert set(backward_marks) >= set(range(n - 1))
    times, _ = clock.block_times(("B",))
    assert all(len(t) == 1 and t[0] >= 0 for t in times)


def test_checkpointed_refuses_an_unknown_mode() -> None:
    with pytest.raises(ValueError, match="expected 'full', 'selective' or 'never'"):
        CheckpointedStage([nn.Identity()], "sometimes")
    with pytest.raises(ValueError, match="one per region"):
        CheckpointedStage([nn.Identity(), nn.Identity()], ["full"])
    x = torch.randn(2, 3, requires_grad=True)
    assert torch.equal(checkpointed(lambda t: t * 2, (x,), "full"), x * 2)


def test_the_profiler_measures_selective_checkpointing() -> None:
    torch.manual_seed(0)
    model = Mlp()
    x, y = torch.randn(B, D), torch.randn(B, D)
    traced = trace_model(model, (x,))
    costs = profile_model(traced, Sample((x,), y, _mse), ProfileSettings(progress=False, warmup=0, repeats=1)).costs
    # block 0 keeps its addmm's output (B x 4D floats); block 1's addmm output is the block's output,
    # which the stage keeps anyway (the next region's input, or the last stage's output): nothing more
    assert [c.selective_bytes for c in costs] == [4 * B * 4 * D, 0]
    # the loss, ((out - target) ** 2).mean(), saves out - target for backward: B x D floats, which
    # stay per microbatch whatever the stage checkpoints (the loss runs outside its regions)
    assert [c.loss_bytes for c in costs] == [None, 4 * B * D]
    assert all(c.selective_recompute_s is not None and c.selective_recompute_s >= 0 for c in costs)


@pytest.mark.timing  # measured CPU times: run alone on the cores (Makefile)
def test_selective_recomputation_skips_the_matmuls() -> None:
    # one big matmul and a cheap activation: full recomputation runs the matmul again, selective not.
    # The matmul (2.1 GFLOP) is ~10x the activation and the policy's bookkeeping here, so the margin
    # holds while other processes share the cores (at 512 x 768 it was 4x, and a loaded run failed)
    d = 1024
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(d, d), nn.ReLU()), nn.Sequential(nn.Linear(d, d), nn.ReLU()))
    x, y = torch.randn(1024, d), torch.randn(1024, d)
    costs = profile_model(
        trace_model(model, (x,)), Sample((x,), y, _mse), ProfileSettings(progress=False, warmup=1, repeats=5)
    ).costs
    for c in costs:
        assert c.recompute_s is not None and c.selective_recompute_s is not None
        assert c.selective_recompute_s < 0.5 * c.recompute_s, (c.name, c.selective_recompute_s, c.recompute_s)


def test_the_estimate_keeps_matmuls_and_attention_and_recomputes_the_rest() -> None:
    mf = load_model_file(ROOT / "models" / "llama.py", "tiny", {})
    with torch.device("meta"):
        model = mf.build()
    inputs, target = mf.batch(2)
    inputs = tuple(t.to("meta") for t in inputs)
    traced = trace_model(model, inputs)
    costs = estimate_blocks(traced, inputs, target.to("meta"), mf.loss_fn, get_hardware("h100"), progress=False)
    layers = [c for c in costs if c.name.startswith("layers.")]
    assert layers
    # cross-entropy keeps its log-probabilities: as many elements as the logits, in fp32
    assert costs[-1].loss_bytes is not None and costs[-1].loss_bytes >= costs[-1].output_bytes
    for c in layers:
        assert c.selective_bytes is not None and 0 < c.selective_bytes < c.activation_bytes
        assert c.selective_recompute_s is not None and 0 < c.selective_recompute_s < c.fwd_s


def test_plans_written_before_selective_checkpointing_still_load() -> None:
    # plan.json stored a flag per stage (true: the stage recomputed); it reads as "full" / "never"
    import json

    from planner.schema.plan import Plan
    from tests.run_factory import MODELS, plan_with_starts

    plan = plan_with_starts(MODELS / "gpt.py", [0, 3])
    data = json.loads(plan.model_dump_json())
    data["stages"][0]["recompute"], data["stages"][1]["recompute"] = True, False
    data["prediction"]["recompute"] = [True, False]
    old = Plan.model_validate(data)
    # (as they ran: the whole stage as one checkpoint region)
    assert [s.recompute for s in old.stages] == ["stage", "never"]
    assert old.prediction.recompute == ("stage", "never")
