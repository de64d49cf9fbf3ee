"""bench.moe_published's runs: Megatron's MoE FLOP count by hand, each run's figure turned into its step
and back, and each layout's degrees consistent (pure and fast: no planning)."""

from __future__ import annotations

import pytest

from bench.moe_published import NOT_COMPARED, RUNS, megatron_moe_flops
from planner.core.levers.hardware import GPUS


def test_megatrons_moe_flops_by_hand() -> None:
    """Mixtral 8x7B, global batch 256 of 4,096 tokens: 12 B s L h^2 = 12 x 256 x 4096 x 32 x 4096^2 =
    6.755399e15; (1 + (14336 / 4096) x 2 x 3/2 + 8/32 + 4096/4096 + 32000 / (2 x 32 x 4096)) = 1 + 10.5 +
    0.25 + 1 + 0.122070 = 12.872070; the product 8.695598e16 FLOPs a step, which at the published 468
    TFLOP/s on 64 GPUs is a step of 2.9032 s, 5,643 tokens/s per GPU."""
    run = next(r for r in RUNS if r.key == "megatron-mixtral-8x7b")
    assert megatron_moe_flops(256, 4096, 32, 4096, 14336, 2, 8 / 32, 32000) == pytest.approx(8.695598e16, rel=1e-6)
    assert run.step_s() == pytest.approx(2.9032, rel=1e-4)
    assert run.figure_at(run.step_s()) == pytest.approx(468.0)  # the round trip
    assert run.figure_at(2 * run.step_s()) == pytest.approx(234.0)  # twice the step, half the figure


def test_deepseek_v3s_gpu_hours_are_a_step() -> None:
    """14.8 T tokens in 2,664 K H800 hours: 1,543.2 tokens/s per GPU; 15,360 sequences of 4,096 tokens on
    2,048 GPUs then take 19.907 s a step."""
    run = next(r for r in RUNS if r.key == "deepseek-v3")
    assert run.figure == pytest.approx(1543.21, abs=0.01)
    assert run.step_s() == pytest.approx(19.907, rel=1e-4)


def test_gpt_oss_120bs_tokens_are_a_step() -> None:
    """1,280 sequences of 4,096 tokens at 5,993 tokens/s per GPU on 64 GPUs: a step of 13.670 s."""
    run = next(r for r in RUNS if r.key == "megatron-bridge-gpt-oss-120b")
    assert run.step_s() == pytest.approx(1280 * 4096 / (5993 * 64), rel=1e-12) == pytest.approx(13.670, rel=1e-4)
    assert (run.dp_mode, run.imbalance, run.dp * (run.gpus // run.dp)) == ("fsdp", 1.0, 64)


def test_every_run_names_its_source_and_a_layout_the_planner_can_take() -> None:
    assert len({r.key for r in RUNS}) == len(RUNS)
    for r in RUNS:
        assert r.source and r.layout and r.leaves_out, r.key
        assert r.gpu in GPUS and r.gpus % r.dp == 0 and r.dp % r.ep == 0, r.key
        assert r.batch % r.dp == 0 and (r.microbatches is None or (r.batch // r.dp) % r.microbatches == 0), r.key
        assert (r.unit == "tokens/s") == (r.flops is None), r.key
        assert r.dp_mode in ("ddp", "fsdp"), r.key  # what the planner runs with expert parallelism
    for run, source, figures, why in NOT_COMPARED:
        assert run and source and figures and why
