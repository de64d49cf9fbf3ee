"""FSDP in a bf16 plan: weights gathered in bf16, gradients accumulated and reduced in fp32.

Tier 1 (pure): the memory and traffic the model charges, exact. Tier 2 (CPU torch): the policy the
runner gives ``fully_shard``, the in-process reference that rounds as the sharded stages do, the
examples made with the weights in bf16. The gloo runs (tier 3) that train such plans against that
reference are in tests/test_weight_casts.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from plan_factory import MB, block
from run_factory import MODELS
from test_fsdp_units import ADAMW, CPU, LINK, _plan

from planner.core.layout.inputs import Layout
from planner.core.levers.casts import without_casts
from planner.core.levers.data_parallel import as_gathered, block_fsdp_s, grad_reduce_s, rank_reduce_s, wide_bytes
from planner.core.levers.recompute import unit_grad_bytes
from planner.core.split.cuts import Split
from planner.core.split.stage_model import grad_bytes, stage_memory_parts, unsharded_bytes
from planner.core.step.predict import predict
from planner.schema.costs import BlockCost
from planner.schema.plan import Plan

QUARTER = MB // 4  # parameters of one MiB in fp32, half a MiB in bf16


def _bf16_layers(n: int = 4) -> list[BlockCost]:
    """``n`` layers of QUARTER parameters in bf16 (half a MiB), each saving 1 MiB for backward, of
    which its weight's bf16 copy (half a MiB) is autocast's."""
    return [
        block(f"layers.{i}", 10, 20, QUARTER).model_copy(update={"param_bytes": MB // 2, "weight_cast_bytes": MB // 2})
        for i in range(n)
    ]


# ------------------------------------------------------------------------------------------------
# Tier 1: memory and traffic, exact
# ------------------------------------------------------------------------------------------------


def test_a_sharded_stage_holds_bf16_weights_and_fp32_gradients_unsharded() -> None:
    # a bf16 stage of 1 Mi parameters (P = 2 MiB): the weights gathered in bf16 (2 MiB), the
    # gradients accumulated in fp32 (4 MiB) and one backward's bf16 gradients before FSDP adds
    # them in (2 MiB): 8 MiB, as the same stage in fp32 holds (weights and gradients, 2 x 4 MiB)
    assert unsharded_bytes(2 * MB, MB, 0, 0, per_block=False) == 8 * MB
    assert unsharded_bytes(4 * MB, MB, 0, 0, per_block=False) == 8 * MB
    # block by block: two units gathered and one unit's gradients, in the parameters' dtype
    assert unsharded_bytes(2 * MB, MB, MB // 2, MB // 2, per_block=True) == 3 * MB // 2
    # the gradients of it: a quarter of the fp32 4 MiB sharded over 4, and the 6 MiB unsharded (fp32
    # sums and one backward's bf16); in fp32 the share and the 4 MiB unsharded
    assert grad_bytes(2 * MB, MB, (0, 0), 4, per_block=False) == MB + 6 * MB
    assert grad_bytes(4 * MB, MB, (0, 0), 4, per_block=False) == MB + 4 * MB
    assert grad_bytes(2 * MB, MB, (MB // 2, MB // 2), 4, per_block=True) == MB + MB // 2
    # not sharded: the fp32 gradients of the master weights
    assert grad_bytes(2 * MB, MB, (0, 0), 1, per_block=False) == 4 * MB


def test_float8_weights_gathered_in_a_byte_have_bf16_gradients() -> None:
    # torchao's float8 all-gather: a float8 layer's weight gathered a byte a parameter, its gradient
    # made in the bf16 parameters' dtype. A stage of 1 Mi parameters, all in float8 layers (P = 1 MiB):
    # the weights (1 MiB), one backward's bf16 gradients (2 MiB), their fp32 sums (4 MiB)
    assert unit_grad_bytes(MB, MB) == 2 * MB
    assert unit_grad_bytes(4 * MB, MB) == 4 * MB  # fp32: its own bytes
    assert unsharded_bytes(MB, MB, 0, 0, per_block=False) == 7 * MB
    assert grad_bytes(MB, MB, (0, 0), 4, per_block=False) == MB + 6 * MB
    # block by block over four units of a quarter Mi parameters: two gathered (2 x 1/4 MiB), the
    # unit's gradients in bf16 (1/2 MiB), where counting them at the gathered width said 3/4 MiB
    layers = [block(f"layers.{i}", 10, 20, QUARTER).model_copy(update={"float8_share": 1.0}) for i in range(4)]
    gathered = as_gathered(layers, 2)
    assert [b.param_bytes for b in gathered] == [QUARTER] * 4
    parts = stage_memory_parts(gathered, 0, 4, ADAMW, "never", 2, 4, per_block=True)
    bf16 = stage_memory_parts(
        as_gathered([b.model_copy(update={"float8_share": 0.0}) for b in layers], 2),
        0,
        4,
        ADAMW,
        "never",
        2,
        4,
        per_block=True,
    )
    assert parts.grads == bf16.grads == MB + MB // 2  # the fp32 share (4 MiB / 4) and the unit's bf16
    assert bf16.once - parts.once == 2 * (MB // 2 - QUARTER)  # two units gathered in a byte, not two
    # the solver's fast memory model agrees with the formula on the float8 stage
    request = dict(gpus=4, dp=4, dp_mode="fsdp", fsdp_units="block", batch_size=8, microbatches=2, schedule="gpipe")
    plan = _plan(layers, profile=CPU.model_copy(update={"autocast": "bf16"}), **request)
    assert [b.param_bytes for b in plan.blocks] == [QUARTER] * 4
    assert plan.prediction.max_memory_bytes == stage_memory_parts(
        plan.blocks, 0, 4, ADAMW, "never", 2, 4, per_block=True
    ).peak(2, fresh_grads=True)


def test_sharded_blocks_save_no_weight_copies() -> None:
    blocks = _bf16_layers(2)
    bare = without_casts(blocks)
    assert [(b.activation_bytes, b.weight_cast_bytes) for b in bare] == [(MB // 2, 0)] * 2
    fp32 = [block("a", 1, 1, 10)]
    assert without_casts(fp32)[0] is fp32[0]  # nothing to take out: the same object


def test_fsdp_plans_count_no_copies_and_ddp_plans_do() -> None:
    blocks = _bf16_layers()
    request = dict(gpus=2, dp=2, batch_size=4, microbatches=2, schedule="gpipe")
    fsdp = _plan(blocks, dp_mode="fsdp", fsdp_units="stage", **request)
    ddp = _plan(blocks, dp_mode="ddp", **request)
    assert [b.weight_cast_bytes for b in fsdp.blocks] == [0] * 4
    assert [b.activation_bytes for b in fsdp.blocks] == [MB // 2] * 4
    assert [b.weight_cast_bytes for b in ddp.blocks] == [MB // 2] * 4
    # the FSDP plan's peak is the stage formula on the blocks without copies: at its peak (both
    # microbatches' forwards done, one backward's gradients made) one microbatch's 2 MiB of
    # activations, not 4
    want = stage_memory_parts(without_casts(blocks), 0, 4, ADAMW, "never", 2, 2).peak(2, fresh_grads=True)
    assert fsdp.prediction.max_memory_bytes == want
    with_copies = stage_memory_parts(blocks, 0, 4, ADAMW, "never", 2, 2).peak(2, fresh_grads=True)
    assert with_copies - want == 2 * MB


def test_gradients_are_reduced_in_fp32_and_weights_gathered_in_bf16() -> None:
    # LINK: 1 ms + 1 MiB per ms. FSDP over 4 of a rank with 2 MiB of bf16 weights (4 MiB of fp32
    # gradients): the gather's ring (3 steps) moves 3/4 of 2 MiB, the reduce-scatter's 3/4 of 4 MiB
    assert grad_reduce_s(2 * MB, 4, "fsdp", LINK, 4 * MB) == pytest.approx((3 + 1.5) * 1e-3 + (3 + 3) * 1e-3, rel=1e-12)
    # DDP all-reduces the fp32 gradients of the weights autocast trains: 2 x 3/4 of 4 MiB, 4 latencies
    assert grad_reduce_s(2 * MB, 4, "ddp", LINK, 4 * MB) == pytest.approx((4 + 6) * 1e-3, rel=1e-12)
    blocks = _bf16_layers()
    assert wide_bytes(blocks) == 4 * MB
    assert wide_bytes([block("a", 1, 1, QUARTER)]) == MB  # fp32: its own bytes
    stages, _ = predict(blocks, Split(starts=(0,)), LINK, Layout("gpipe", 1, 2, 1, dp=4, dp_mode="fsdp"), ADAMW)
    assert rank_reduce_s(blocks, stages, [LINK], 4, "fsdp") == pytest.approx([10.5e-3], rel=1e-12)
    # block by block, per microbatch and unit: two gathers of half a MiB, one reduce-scatter of 1 MiB
    per_unit = 2 * (3 + 0.75 / 2) * 1e-3 + (3 + 0.75) * 1e-3
    got = block_fsdp_s(blocks, stages, [LINK], 4, 2, overlap=False)
    assert got == pytest.approx([2 * 4 * per_unit], rel=1e-12)


def test_a_measured_bf16_plan_gathers_half_its_fp32_weight_bytes() -> None:
    # a profile measured under autocast counts the fp32 weights autocast trains (4 bytes a
    # parameter); FSDP gathers them in bf16: 2 bytes a parameter, the gradients still reduced in fp32
    layers = [block(f"layers.{i}", 10, 20, QUARTER) for i in range(4)]  # 1 Mi parameters, 4 MiB
    assert [b.param_bytes for b in as_gathered(layers, 2)] == [MB // 2] * 4
    assert as_gathered(layers, 0) is layers
    assert wide_bytes(as_gathered(layers, 2)) == wide_bytes(layers) == 4 * MB
    request = dict(gpus=2, dp=2, dp_mode="fsdp", fsdp_units="stage", batch_size=4, microbatches=2, schedule="gpipe")
    bf16 = _plan(layers, profile=CPU.model_copy(update={"autocast": "bf16"}), **request)
    fp32 = _plan(layers, **request)
    # over 2 replicas: the gather moves half of 2 MiB (1 ms + 1 ms), the reduce-scatter half of 4 MiB
    # (1 ms + 2 ms); in fp32 the gather moves half of 4 MiB too
    assert bf16.prediction.dp_reduce_s == pytest.approx(2e-3 + 3e-3, rel=1e-12)
    assert fp32.prediction.dp_reduce_s == pytest.approx(3e-3 + 3e-3, rel=1e-12)
    # and its stages hold the weights so: block by block, two units gathered and one unit's
    # gradients at 2 bytes a parameter (3 x half a MiB), not at the profile's 4 (3 x 1 MiB)
    assert [b.param_bytes for b in bf16.blocks] == [MB // 2] * 4
    assert [b.param_bytes for b in fp32.blocks] == [MB] * 4
    blockwise = dict(request, fsdp_units="block")
    bf16_blocks = _plan(layers, profile=CPU.model_copy(update={"autocast": "bf16"}), **blockwise)
    fp32_blocks = _plan(layers, **blockwise)
    held = stage_memory_parts(as_gathered(layers, 2), 0, 4, ADAMW, "never", 2, 2, per_block=True)
    assert bf16_blocks.prediction.max_memory_bytes == held.peak(2, fresh_grads=True)
    # at its peak (both forwards done, no gradients yet) the units' 3 MiB unsharded less the 3 MiB
    # of gradients still to come (the 2 MiB fp32 share, the unit's 1 MiB) in fp32; in bf16 1.5 MiB
    # less 2.5 MiB (the share, the unit's half MiB): 1 MiB apart
    assert fp32_blocks.prediction.max_memory_bytes - bf16_blocks.prediction.max_memory_bytes == MB


# ------------------------------------------------------------------------------------------------
# Tier 2: the runner's side on CPU torch
# ------------------------------------------------------------------------------------------------


def _with_autocast(plan: Plan, autocast: str | None) -> Plan:
    return plan.model_copy(update={"profile": plan.profile.model_copy(update={"autocast": autocast})})


def test_the_policy_gathers_in_the_plans_dtype_and_reduces_in_fp32() -> None:
    from planner.run.wrappers import fsdp_policy, sharded_param_dtype

    plan = _plan(_bf16_layers(), gpus=2, dp=2, dp_mode="fsdp", batch_size=2, microbatches=1, schedule="gpipe")
    bf16 = _with_autocast(plan, "bf16")
    policy = fsdp_policy(bf16)
    assert (policy.param_dtype, policy.reduce_dtype, policy.cast_forward_inputs) == (
        torch.bfloat16,
        torch.float32,
        False,
    )
    assert sharded_param_dtype(bf16) == torch.bfloat16
    assert fsdp_policy(_with_autocast(plan, None)).param_dtype is None  # fp32: FSDP's default
    ddp = _with_autocast(plan.model_copy(update={"dp_mode": "ddp"}), "bf16")
    assert sharded_param_dtype(ddp) is None  # DDP trains fp32 weights under autocast


def test_narrow_weights_compute_in_bf16_and_sum_fp32_gradients() -> None:
    from planner.run.single import NarrowWeights

    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 4)
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    storage = [p.data_ptr() for p in layer.parameters()]
    xs = [torch.randn(3, 8) for _ in range(2)]
    dtypes = []

    def step(i: int) -> torch.Tensor:
        out = layer(xs[i].to(torch.bfloat16))
        dtypes.append(out.dtype)
        loss = out.float().square().mean() / 2
        loss.backward()
        return loss.detach()

    NarrowWeights(list(layer.parameters()), torch.bfloat16).run(2, step)
    assert dtypes == [torch.bfloat16] * 2  # the weights were bf16 while it ran
    # the fp32 weights are back, untouched (the very storage), their gradients fp32 sums
    assert [p.data_ptr() for p in layer.parameters()] == storage
    assert all(torch.equal(p, before[n]) for n, p in layer.named_parameters())
    want = torch.zeros_like(layer.weight)
    for x in xs:  # each microbatch's bf16 gradient, added in fp32
        w = layer.weight.detach().to(torch.bfloat16).requires_grad_()
        b = layer.bias.detach().to(torch.bfloat16)
        torch.nn.functional.linear(x.to(torch.bfloat16), w, b).float().square().mean().div(2).backward()
        want += w.grad.float()
    assert layer.weight.grad is not None and layer.weight.grad.dtype == torch.float32
    assert torch.equal(layer.weight.grad, want)


def test_examples_made_with_bf16_weights_have_the_dtypes_fsdp_sends() -> None:
    from planner.capture.shapes import shapes_of, shapes_or_real

    emb = torch.nn.Embedding(10, 4)
    ids = torch.tensor([[1, 2, 3]])
    weight = emb.weight
    assert shapes_of(emb, emb, ids).dtype == torch.float32
    assert shapes_of(emb, emb, ids, param_dtype=torch.bfloat16).dtype == torch.bfloat16
    assert emb.weight is weight and emb.weight.dtype == torch.float32  # put back

    # the real run where fake tensors cannot run (it reads data) narrows real copies alike
    def reads(x: torch.Tensor) -> torch.Tensor:
        return emb(x[:, : int(x.max().item())])

    assert shapes_or_real(emb, reads, ids, param_dtype=torch.bfloat16).dtype == torch.bfloat16
    assert emb.weight is weight


def test_batch_norm_keeps_fp32_weights_beside_its_fp32_statistics() -> None:
    from planner.capture.load import load_model_file
    from planner.capture.shapes import keeps_fp32_weights, shapes_of
    from planner.run.single import narrowed_params

    assert keeps_fp32_weights(torch.nn.BatchNorm2d(4))
    assert not keeps_fp32_weights(torch.nn.BatchNorm2d(4, affine=False))  # no weights to keep
    assert not keeps_fp32_weights(torch.nn.LayerNorm(4)) and not keeps_fp32_weights(torch.nn.Linear(4, 4))
    model = load_model_file(MODELS / "resnet50.py", "tiny", {}).build(0)
    norms = {id(p) for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d) for p in m.parameters()}
    narrowed = narrowed_params(model)
    assert norms and not norms & {id(p) for p in narrowed}
    assert len(narrowed) + len(norms) == len(list(model.parameters()))
    # with every weight in bf16, batch norm refuses its fp32 statistics; with its own kept fp32, the
    # examples (and the run) go through
    x = torch.randn(2, 3, 32, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert shapes_of(model, model, x, param_dtype=torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.multiprocess
@pytest.mark.parametrize("units", ["stage", "block"])
def test_a_bf16_fsdp_resnet_trains_with_its_batch_norms_gathered_in_fp32(tmp_path: Path, units: str) -> None:
    from run_factory import plan_with_starts, saved

    from planner.run import run_plan
    from planner.schema.run_request import RunRequest

    plan = plan_with_starts(MODELS / "resnet50.py", [0], dp=2, dp_mode="fsdp", fsdp_units=units, n_microbatches=2)
    plan = _with_autocast(plan, "bf16")
    got = run_plan(plan, RunRequest(plan_file=saved(plan, tmp_path), steps=2, echo=False, save_checkpoints=False))
    # batch norm computes its statistics per replica, so the unsplit model is no reference here: the
    # run itself is the check (bf16 batch-norm weights beside fp32 statistics stopped it at step 1)
    assert len(got.losses) == 2 and all(math.isfinite(x) and x > 0 for x in got.losses)
    assert all(g > 0 for g in got.grad_norms)
