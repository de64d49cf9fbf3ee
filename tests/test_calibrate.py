"""Tier 1 (pure): the calibration loop on hand-made plans and synthetic runs with known answers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from plan_factory import LINK, big_head_blocks, plan_of_blocks, predicted
from run_factory import plan_stage_reports, run_report

from planner.core.step.calibrate import Calibration, apply_calibration, calibrate, changes, load_calibration
from planner.errors import PlanFileError
from planner.schema.plan import Plan
from planner.schema.result import BlockMeasure, RunResult

ROOT = Path(__file__).resolve().parent.parent


def blocks_with_opt() -> list:
    # Give every block an optimizer time, so the optimizer factor is exercised too.
    return [b.model_copy(update={"opt_s": 1e-3 * (k + 1)}) for k, b in enumerate(big_head_blocks())]


def synthetic_run(plan: Plan, factor: float, step_s: float) -> RunResult:
    """A run whose per-stage compute is exactly ``factor`` x the plan's, with the given step time."""
    stages = plan_stage_reports(plan, step_s=step_s, factor=factor, per_microbatch=False)
    return run_report(plan, stages=stages, step_times_s=[step_s, step_s], ranks=plan.n_stages)


def repredict(plan: Plan, cal: Calibration, starts: tuple[int, ...] | None = None) -> float:
    blocks, link = apply_calibration(plan.blocks, plan.link, cal)
    starts = starts or cal.starts
    return predicted(blocks, starts, link, plan.schedule, plan.n_microbatches, plan.optimizer)[1].step_time_s


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_uniformly_slower_run_gives_its_factor_and_reproduces_the_step(schedule: str) -> None:
    plan = plan_of_blocks(blocks_with_opt(), schedule=schedule)
    measured = 1.2 * plan.prediction.step_time_s
    cal = calibrate(plan, synthetic_run(plan, 1.2, measured))
    for s in cal.stages:
        assert (s.fwd_factor, s.bwd_factor, s.opt_factor) == pytest.approx((1.2, 1.2, 1.2), rel=1e-12)
    # Compute x1.2 alone leaves the messages (1 MB at 1 MB/ms, zero latency) at their planned
    # cost, so the remaining 20% of the communication is taken up by a fitted latency.
    assert cal.latency_s > 0 and cal.global_factor == 1.0
    assert cal.calibrated_step_s == pytest.approx(measured, rel=1e-6)
    assert repredict(plan, cal) == pytest.approx(measured, rel=1e-6)


def test_latency_fit_recovers_a_known_latency() -> None:
    plan = plan_of_blocks(blocks_with_opt())
    assert plan.link.latency_s == 0.0
    true_link = LINK.model_copy(update={"latency_s": 0.7e-3})
    starts = tuple(s.start for s in plan.stages)
    measured = predicted(plan.blocks, starts, true_link, plan.schedule, plan.n_microbatches, plan.optimizer)[
        1
    ].step_time_s
    cal = calibrate(plan, synthetic_run(plan, 1.0, measured))
    assert cal.latency_s == pytest.approx(0.7e-3, rel=1e-9)
    assert cal.global_factor == 1.0
    assert all((s.fwd_factor, s.bwd_factor, s.opt_factor) == (1.0, 1.0, 1.0) for s in cal.stages)


def test_run_faster_than_compute_alone_fits_a_global_factor() -> None:
    plan = plan_of_blocks(blocks_with_opt())
    measured = 0.5 * plan.prediction.step_time_s  # below what the compute alone predicts
    cal = calibrate(plan, synthetic_run(plan, 1.0, measured))
    assert cal.latency_s == 0.0
    assert 0 < cal.global_factor < 0.5
    assert repredict(plan, cal) == pytest.approx(measured, rel=1e-6)


def test_block_factors_follow_the_blocks_into_a_new_split() -> None:
    plan = plan_of_blocks(blocks_with_opt())  # stages: embed..layers.2 | layers.3..output
    run = synthetic_run(plan, 1.0, plan.prediction.step_time_s)
    slow_head = run.stages[1].model_copy(update={"fwd_s": 2 * run.stages[1].fwd_s, "bwd_s": 3 * run.stages[1].bwd_s})
    cal = calibrate(plan, run.model_copy(update={"stages": [run.stages[0], slow_head]}))
    blocks, link = apply_calibration(plan.blocks, plan.link, cal)
    g = cal.global_factor
    for old, new in zip(plan.blocks, blocks):
        in_head_stage = old.name in ("layers.3", "output")
        assert new.fwd_s == pytest.approx(old.fwd_s * (2 if in_head_stage else 1) * g, rel=1e-12)
        assert new.bwd_s == pytest.approx(old.bwd_s * (3 if in_head_stage else 1) * g, rel=1e-12)
        assert new.opt_s == pytest.approx(old.opt_s * g, rel=1e-12)
        assert (new.name, new.param_bytes, new.cut_bytes) == (old.name, old.param_bytes, old.cut_bytes)
    assert link.latency_s == cal.latency_s and link.bandwidth_Bps == plan.link.bandwidth_Bps
    assert link.name == "test-link+calibrated"
    # On another split the same blocks keep those factors: layers.3 stays 2x/3x wherever it goes.
    other = predicted(blocks, (0, 3), link, plan.schedule, plan.n_microbatches, plan.optimizer)[0]
    assert other[1].fwd_s == pytest.approx(blocks[3].fwd_s + blocks[4].fwd_s + blocks[5].fwd_s, rel=1e-12)
    assert blocks[4].fwd_s == pytest.approx(2 * g * plan.blocks[4].fwd_s, rel=1e-12)


def test_calibration_round_trips_and_refuses_other_blocks(tmp_path: Path) -> None:
    plan = plan_of_blocks(blocks_with_opt())
    cal = calibrate(plan, synthetic_run(plan, 1.2, 1.2 * plan.prediction.step_time_s))
    assert Calibration.from_json(cal.to_json()) == cal
    cal.save(tmp_path / "cal.json")
    assert Calibration.from_json((tmp_path / "cal.json").read_text()) == cal
    renamed = [b.model_copy(update={"name": "x"}) if k == 0 else b for k, b in enumerate(plan.blocks)]
    with pytest.raises(PlanFileError, match=r"the calibration's blocks are not this model's \(e.g. embed\)"):
        apply_calibration(renamed, plan.link, cal)
    by_stage = cal.model_copy(update={"blocks": []})  # an older calibration: by stage only
    with pytest.raises(
        PlanFileError, match="calibration stage 0 covered embed .. layers.2, but blocks 0..3 are x .. layers.2"
    ):
        apply_calibration(renamed, plan.link, by_stage)
    with pytest.raises(PlanFileError, match="calibration format version None; this planner reads version 1"):
        Calibration.from_json("{}")


def test_load_calibration_finds_the_plan_next_to_the_run(tmp_path: Path) -> None:
    plan = plan_of_blocks(blocks_with_opt())
    plan.save(tmp_path / "p.json")
    run = synthetic_run(plan, 1.2, 1.2 * plan.prediction.step_time_s)
    run.save(tmp_path / "p.run.json")
    assert load_calibration(tmp_path / "p.run.json") == (plan, calibrate(plan, run))
    run.save(tmp_path / "elsewhere.json")
    with pytest.raises(PlanFileError, match="cannot find the plan"):
        load_calibration(tmp_path / "elsewhere.json")
    recorded = run.model_copy(update={"plan_path": str(tmp_path / "p.json")})
    recorded.save(tmp_path / "elsewhere.json")
    assert load_calibration(tmp_path / "elsewhere.json")[1].stages == calibrate(plan, run).stages


def test_compare_and_calibrate_import_no_torch() -> None:
    code = "import sys, planner.report.compare, planner.core.step.calibrate; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def _run_with_block_times(plan: Plan, fwd: list[float], bwd: list[float], step_s: float) -> RunResult:
    """A run whose blocks took ``fwd[k]`` / ``bwd[k]`` inside their stages (stage times their sums)."""
    run = synthetic_run(plan, 1.0, step_s)
    stages = []
    for st, m in zip(plan.stages, run.stages):
        part = range(st.start, st.end)
        blocks = [BlockMeasure(name=plan.blocks[k].name, fwd_s=fwd[k], bwd_s=bwd[k]) for k in part]
        update = {"blocks": blocks, "fwd_s": sum(fwd[k] for k in part), "bwd_s": sum(bwd[k] for k in part)}
        stages.append(m.model_copy(update=update))
    return run.model_copy(update={"stages": stages})


@pytest.mark.parametrize("cold", [False, True], ids=["warm", "cold-starts"])
@pytest.mark.parametrize("seed", range(5))
def test_one_run_of_one_split_predicts_every_other_split_exactly(seed: int, cold: bool) -> None:
    """Blocks timed inside the run carry their own factors: any split's stage compute is then the
    sum of the blocks' true times (by-stage factors cannot do this when blocks differ). With cold
    starts, the run's boundary blocks ran cold, and the factor carries to both of a block's times."""
    import random

    rnd = random.Random(seed)
    base = blocks_with_opt()
    if cold:
        base = [b.model_copy(update={"fwd_cold_s": 0.3 * b.fwd_s, "bwd_cold_s": 0.2 * b.bwd_s}) for b in base]
    plan = plan_of_blocks(base)
    n = len(plan.blocks)
    factor_f = [rnd.uniform(0.6, 1.6) for _ in plan.blocks]
    factor_b = [rnd.uniform(0.6, 1.6) for _ in plan.blocks]
    true_fwd = [b.fwd_s * f for b, f in zip(plan.blocks, factor_f)]
    true_bwd = [b.bwd_s * f for b, f in zip(plan.blocks, factor_b)]
    ran_fwd, ran_bwd = list(true_fwd), list(true_bwd)
    for st in plan.stages:  # what the run's blocks took where they ran: cold at a receiving boundary
        if st.index > 0:
            ran_fwd[st.start] += (plan.blocks[st.start].fwd_cold_s or 0.0) * factor_f[st.start]
        if st.index < plan.n_stages - 1:
            ran_bwd[st.end - 1] += (plan.blocks[st.end - 1].bwd_cold_s or 0.0) * factor_b[st.end - 1]
    cal = calibrate(plan, _run_with_block_times(plan, ran_fwd, ran_bwd, 2 * plan.prediction.step_time_s))
    assert cal.global_factor == 1.0 and all(b.measured_in_block for b in cal.blocks)
    blocks, link = apply_calibration(plan.blocks, plan.link, cal)
    by_stage, _ = apply_calibration(plan.blocks, plan.link, cal.model_copy(update={"blocks": []}))
    worse = 0
    for cut in range(1, n):
        stages = predicted(blocks, (0, cut), link, plan.schedule, plan.n_microbatches, plan.optimizer)[0]
        old = predicted(by_stage, (0, cut), link, plan.schedule, plan.n_microbatches, plan.optimizer)[0]
        for st, o in zip(stages, old):
            fwd, bwd = sum(true_fwd[st.start : st.end]), sum(true_bwd[st.start : st.end])
            if st.index == 1:
                fwd += (plan.blocks[cut].fwd_cold_s or 0.0) * factor_f[cut]
            else:
                bwd += (plan.blocks[cut - 1].bwd_cold_s or 0.0) * factor_b[cut - 1]
            assert (st.fwd_s, st.bwd_s) == pytest.approx((fwd, bwd), rel=1e-12)
            worse += abs(o.fwd_s - fwd) > 1e-9 * fwd
    assert worse > 0  # the stage factors miss somewhere: the per-block ones are what carries over
    lines = changes(cal)
    assert lines[0] == f"{n} blocks ({n} timed inside their stage, the rest by their stage's factors)"
    assert lines[1].startswith("forward x") and "most: " in lines[1]
    assert Calibration.from_json(cal.to_json()) == cal


def test_a_run_without_block_times_gives_each_block_its_stage_factors() -> None:
    plan = plan_of_blocks(blocks_with_opt())
    cal = calibrate(plan, synthetic_run(plan, 1.3, 1.3 * plan.prediction.step_time_s))
    assert [b.name for b in cal.blocks] == [b.name for b in plan.blocks]
    assert not any(b.measured_in_block for b in cal.blocks)
    assert {b.fwd_factor for b in cal.blocks} == {s.fwd_factor for s in cal.stages}


def test_a_calibration_from_or_for_tensor_parallelism_is_refused(tmp_path: Path) -> None:
    # the fit maps stage times to the plan's blocks, which under tp are one tp rank's: refused, one line
    from planner.api import make_plan as plan_model
    from planner.schema.request import PlanRequest

    plan = plan_of_blocks(blocks_with_opt())
    tp_plan = plan.model_copy(update={"tp": 2, "tp_plan": {"layers.*.w1": "colwise"}})
    tp_plan.save(tmp_path / "p.json")
    synthetic_run(tp_plan, 1.0, plan.prediction.step_time_s).save(tmp_path / "p.run.json")
    request = PlanRequest.build(
        model_file=str(ROOT / "models" / "toy.py"), gpus=2, calibrate_run=tmp_path / "p.run.json"
    )
    with pytest.raises(PlanFileError, match="--calibrate with tensor parallelism is not supported yet"):
        plan_model(request)


def test_a_calibration_for_expert_parallelism_is_refused(tmp_path: Path) -> None:
    # the same for ep: the blocks of an expert-parallel plan are one ep rank's, all-to-alls included
    from planner.api import make_plan as plan_model
    from planner.schema.request import PlanRequest

    plan = plan_of_blocks(blocks_with_opt())
    plan.save(tmp_path / "p.json")
    synthetic_run(plan, 1.0, plan.prediction.step_time_s).save(tmp_path / "p.run.json")
    request = PlanRequest.build(
        model_file=str(ROOT / "models" / "toy.py"), gpus=2, dp=2, ep=2, calibrate_run=tmp_path / "p.run.json"
    )
    with pytest.raises(PlanFileError, match="--calibrate with expert parallelism is not supported yet"):
        plan_model(request)
