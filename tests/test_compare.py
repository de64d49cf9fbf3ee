"""Tier 1 (pure): predicted-vs-measured tables on a hand-made plan and a hand-made run, exact."""

from __future__ import annotations

import re

import pytest
from plan_factory import MB, big_head_blocks, plan_of_blocks
from run_factory import run_report, stage_report

from planner.errors import PlanFileError
from planner.report.compare import compare_blocks_table, compare_table
from planner.schema.plan import Plan
from planner.schema.result import BlockMeasure, MemoryMeasure, RunResult, StageMeasure


def stage_measure(
    plan: Plan, i: int, fwd_ms: float, bwd_ms: float, opt_ms: float, mem_mb: float | None
) -> StageMeasure:
    memory = None
    if mem_mb is not None:
        cats = {"Parameter": 0, "Total": int(mem_mb * MB)}
        memory = MemoryMeasure(
            source="memtracker", step=3, peak_bytes=int(mem_mb * MB), peak_by_category=cats, end_by_category=cats
        )
    return stage_report(
        plan.stages[i], fwd_s=fwd_ms / 1e3, bwd_s=bwd_ms / 1e3, optimizer_s=opt_ms / 1e3, step_s=0.5, memory=memory
    )


def make_run(plan: Plan, stages: list[StageMeasure], step_ms: float) -> RunResult:
    return run_report(plan, stages=stages, step_times_s=[1.0, step_ms / 1e3, 2.0], ranks=2, memory_step=3)


# Predicted (see test_report): stage 0 = embed + layers.0-2: fwd 31, bwd 61 ms, memory
# 16k x 16 B + 2 x (4 MB + 1 MB output) + 1 MB + 4 microbatches x 1 MB = 15.24 MB; stage 1 = layers.3 + output: fwd 35, bwd 70 ms,
# 13k x 16 B + 1 x 2 MB + 4 x 1 MB = 6.198 MB (+3.3% against 6 MB measured); no optimizer time
# profiled (0 planned against 2 ms measured is -100%; 0 against 0 has no error); step 522 ms.
# Stage 0 tracked no memory ("-").
EXPECTED = """\
  stage  blocks              fwd ms plan    run    err     bwd ms plan    run    err     opt ms plan    run    err      mem MB plan    run    err
-------  ------------------  -------------  -----  ------  -------------  -----  ------  -------------  -----  -------  -------------  -----  -----
      0  embed .. layers.2   31.00          24.80  +25.0%  61.00          61.00  +0.0%   0.00           2.00   -100.0%  15.24          -      -
      1  layers.3 .. output  35.00          50.00  -30.0%  70.00          87.50  -20.0%  0.00           0.00   -        6.20           6.00   +3.3%

      plan ms    run ms    err
----  ---------  --------  ------
step  522.00     580.00    -10.0%"""


def test_compare_table_exact() -> None:
    plan = plan_of_blocks(big_head_blocks())
    # fwd: 31 planned vs 24.8 measured = +25%; 35 vs 50 = -30%; bwd 70 vs 87.5 = -20%.
    run = make_run(plan, [stage_measure(plan, 0, 24.8, 61, 2, None), stage_measure(plan, 1, 50, 87.5, 0, 6)], 580)
    assert plan.prediction.step_time_s == pytest.approx(0.522)
    assert compare_table(plan, run) == EXPECTED


def test_run_of_another_split_is_refused() -> None:
    plan = plan_of_blocks(big_head_blocks())
    uniform = plan_of_blocks(big_head_blocks(), method="uniform")
    run = make_run(uniform, [stage_measure(uniform, i, 1, 1, 1, 1) for i in range(2)], 580)
    with pytest.raises(
        PlanFileError, match=r"stage 0 of the run covers embed \.\. layers\.1, the plan's covers embed \.\. layers\.2"
    ):
        compare_table(plan, run)
    other = run.model_copy(update={"plan_fingerprint": "0" * 16})
    with pytest.raises(PlanFileError, match="fingerprint 0000000000000000"):
        compare_table(plan, other)
    with pytest.raises(PlanFileError, match="measurements for 0 stage"):
        compare_table(plan, make_run(plan, [], 580))
    # the same split run under another schedule, microbatch count or batch: another step
    same = make_run(plan, [stage_measure(plan, i, 1, 1, 1, 1) for i in range(2)], 580)
    compare_table(plan, same)
    said = f"{plan.schedule}, {plan.n_microbatches} microbatch(es) of a batch of {plan.batch_size}"
    for edit, ran in [
        ({"schedule": "zbv"}, f"zbv, {plan.n_microbatches} microbatch(es) of a batch of {plan.batch_size}"),
        ({"n_microbatches": 7}, f"{plan.schedule}, 7 microbatch(es) of a batch of {plan.batch_size}"),
        ({"batch_size": 3}, f"{plan.schedule}, {plan.n_microbatches} microbatch(es) of a batch of 3"),
    ]:
        with pytest.raises(PlanFileError, match=re.escape(f"the run ran {ran}, the plan is {said}; compare")):
            compare_table(plan, same.model_copy(update=edit))


def test_compare_blocks_table_exact() -> None:
    """Every block's profiled time beside its time inside the pipeline, and the time outside the blocks."""
    plan = plan_of_blocks(big_head_blocks())  # blocks embed 1/1 ms, layers.0-3 10/20 ms, output 25/50 ms
    run = make_run(plan, [stage_measure(plan, 0, 35, 65, 0, None), stage_measure(plan, 1, 36, 72, 0, None)], 580)
    timed = [
        [BlockMeasure(name="embed", fwd_s=0.002, bwd_s=0.001)]
        + [BlockMeasure(name=f"layers.{k}", fwd_s=0.011, bwd_s=0.02) for k in range(3)],
        [BlockMeasure(name="layers.3", fwd_s=0.008, bwd_s=0.025), BlockMeasure(name="output", fwd_s=0.025, bwd_s=0.04)],
    ]
    stages = [
        m.model_copy(update={"blocks": b, "fwd_overhead_s": 0.0005, "bwd_overhead_s": 0.00125})
        for m, b in zip(run.stages, timed)
    ]
    table = compare_blocks_table(plan, run.model_copy(update={"stages": stages}))
    lines = table.splitlines()
    assert lines[0].split() == ["stage", "block", "fwd", "ms", "plan", "run", "err", "bwd", "ms", "plan", "run", "err"]
    assert lines[2].split() == ["0", "embed", "1.00", "2.00", "-50.0%", "1.00", "1.00", "+0.0%"]
    assert lines[3].split() == ["0", "layers.0", "10.00", "11.00", "-9.1%", "20.00", "20.00", "+0.0%"]
    assert lines[6].split() == ["1", "layers.3", "10.00", "8.00", "+25.0%", "20.00", "25.00", "-20.0%"]
    assert lines[7].split() == ["1", "output", "25.00", "25.00", "+0.0%", "50.00", "40.00", "+25.0%"]
    assert lines[-2].split() == ["0", "0.50", "1.25"] and lines[-1].split() == ["1", "0.50", "1.25"]
    assert compare_blocks_table(plan, run).startswith("(the run timed no blocks")
