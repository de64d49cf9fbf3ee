"""Tier 1 (pure): samples/s, tokens/s per GPU and MFU of a plan (planner.report.throughput)."""

from __future__ import annotations

import pytest
from plan_factory import big_head_blocks, plan_of_blocks

from planner.core.levers.hardware import get_hardware
from planner.report.tables import render
from planner.report.throughput import peak_flops, throughput, throughput_line
from planner.schema.plan import Plan

SEQ = 2048


def _counted(plan: Plan, *, hardware: str | None = "h100", tokens: int | None = SEQ) -> Plan:
    """The plan with FLOPs on every block (fwd = 1 TFLOP per ms of forward, bwd twice that)."""
    blocks = [b.model_copy(update={"flops_fwd": b.fwd_s * 1e15, "flops_bwd": 2 * b.fwd_s * 1e15}) for b in plan.blocks]
    profile = plan.profile.model_copy(
        update={"source": "estimated", "hardware": hardware, "dtype": "bf16", "tokens_per_sample": tokens}
    )
    return plan.model_copy(update={"blocks": blocks, "profile": profile})


def test_throughput_figures_are_exact() -> None:
    plan = _counted(plan_of_blocks(big_head_blocks(), n_stages=2, m=4))
    t = throughput(plan)
    step = plan.prediction.step_time_s
    assert t.samples_per_s == pytest.approx(plan.batch_size / step)
    assert t.tokens_per_s == pytest.approx(plan.batch_size * SEQ / step)
    assert t.tokens_per_s_per_gpu == pytest.approx(plan.batch_size * SEQ / step / 2)
    forward = sum(b.fwd_s for b in plan.blocks) * 1e15
    assert t.model_flops == pytest.approx(3 * forward * plan.n_microbatches)  # no recomputation counted
    peak = get_hardware("h100").peak("bf16")
    assert t.peak_flops == peak == peak_flops(plan)
    assert t.mfu == pytest.approx(t.model_flops / (step * 2 * peak))
    busy = plan.prediction.pipeline_time_s * (1 - plan.prediction.bubble_fraction)
    assert t.busy_mfu == pytest.approx(t.model_flops / (busy * 2 * peak))
    assert t.busy_mfu > t.mfu  # the bubble only lowers it


def test_measured_cpu_plans_show_samples_and_tokens_only() -> None:
    plan = plan_of_blocks(big_head_blocks())
    t = throughput(plan)
    assert t.tokens_per_s is None and t.mfu is None and t.peak_flops is None and t.model_flops is None
    assert throughput_line(plan) == f"throughput: {t.samples_per_s:.4g} samples/s"
    with_tokens = _counted(plan, hardware=None)  # FLOPs known, no peak: tokens/s, no MFU
    line = throughput_line(with_tokens)
    assert "tokens/s" in line and "per GPU" in line and "MFU" not in line
    assert throughput(with_tokens, peak=1e15).mfu is not None  # a caller's own peak


def test_the_report_shows_the_throughput_line() -> None:
    plan = _counted(plan_of_blocks(big_head_blocks()))
    text = render(plan)
    assert throughput_line(plan) in text and "MFU" in text and "without the bubble" in text


def test_unknown_dtype_or_hardware_gives_no_peak() -> None:
    plan = _counted(plan_of_blocks(big_head_blocks()), hardware="v100")
    assert peak_flops(plan) is None  # the plan says bf16, which a V100 lacks
    assert peak_flops(_counted(plan_of_blocks(big_head_blocks()), hardware="cpu-host-1t")) is None
