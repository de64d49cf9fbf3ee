"""Predicted vs measured step time (and peak memory) of real pipelined runs on this machine.

For each case: plan it (measured profile on this CPU), run it for real with gloo, and compare the
plan's predicted step time with the measured median; cases run one after another, so each
prediction is checked against a run on the same quiet machine. Writes docs/predict_vs_measured.md.

    python -m bench.predict_vs_measured            # all cases
    python -m bench.predict_vs_measured --quick    # fewer steps (a smoke test of the script)
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.common import DOCS, MODELS, blocks_per_stage, host, pct_error, save_and_train, table, write_page
from planner.api import make_plan
from planner.core.step.calibrate import calibrate
from planner.schema.plan import Plan
from planner.schema.request import PlanRequest
from planner.schema.result import RunResult

GPT_MID = {"dim": 128, "n_layers": 8, "n_heads": 4, "ffn_dim": 512, "vocab_size": 8000, "seq_len": 64}
# (model file, size, overrides, gpus, batch size, microbatches): sizes where a stage computes for
# at least ~20 ms per microbatch on one thread, so fixed per-message costs do not dominate.
CASES = [
    ("gpt.py", "tiny", GPT_MID, 2, 16, 4),
    ("gpt.py", "tiny", GPT_MID, 4, 16, 4),
    ("encoder_lm.py", "bigvocab", {}, 2, 16, 4),
    ("encoder_lm.py", "bigvocab", {}, 4, 16, 4),
]
Case = tuple[str, str, dict[str, int], int, int, int]
SCHEDULES = ("gpipe", "1f1b")
STEP_HEADERS = [
    "model",
    "ranks",
    "schedule",
    "batch/mb",
    "split",
    "slowest stage compute ms/mb",
    "predicted step ms",
    "measured step ms",
    "error",
]
CALIBRATED_HEADERS = [
    "model",
    "ranks",
    "schedule",
    "fitted ms/message",
    "global factor",
    "split",
    "predicted step ms",
    "measured step ms (2nd run)",
    "error",
]
MEMORY_HEADERS = ["model", "ranks", "schedule", "stage", "predicted MB", "measured peak MB (MemTracker)", "error"]
COMPUTE_HEADERS = ["model", "ranks", "schedule", "stage", "pred fwd ms/mb", "run fwd", "err", "pred bwd ms/mb"]
COMPUTE_HEADERS += ["run bwd", "err"]
PAGE = """# Predicted vs measured step time on this machine

Written by `bench/predict_vs_measured.py` on {today} ({host},
torch {torch}, gloo, one process per rank, cores // ranks threads each). Each row plans the case
(measured per-block profile), then trains it for {steps} steps; measured = median over the timed steps
(not the first, which sets the schedule up, nor the one run under the memory tracker).
The custom GPT size: {custom}.

{table}

{mae}

Analysis of these figures: docs/prediction_accuracy.md.

## After calibration (`planner plan --calibrate run.json`)

Each case's first run is fed back: per-stage compute factors and the per-message latency are fitted
to it (`planner/calibrate.py`), the case is planned again with the corrected costs, and that plan is
checked against a second, fresh run.

{cal_table}

{cal_mae}

## Compute per stage inside the pipeline

Predicted per-microbatch forward/backward compute of each stage (sum of its profiled blocks) against
the stage's own `forward_one_chunk` / `backward_one_chunk` time measured inside the running schedule
(medians; communication waits excluded on both sides).

{compute_table}

## Peak memory per rank

Predicted stage memory against the peak that `torch.distributed._tools.mem_tracker.MemTracker` saw
during one tracked step (parameters, gradients, optimizer state, activations, buffers, temporaries).

{mem_table}

Mean absolute memory error: {mem_mae:.1f}% over {mem_n} ranks.
"""


@dataclass
class Tables:
    """The page's rows and absolute errors (%), filled case by case."""

    rows: list[list[object]] = field(default_factory=list)
    cal_rows: list[list[object]] = field(default_factory=list)
    compute_rows: list[list[object]] = field(default_factory=list)
    mem_rows: list[list[object]] = field(default_factory=list)
    errors: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in SCHEDULES})
    cal_errors: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in SCHEDULES})
    mem_errors: list[float] = field(default_factory=list)


def parse_args() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="steps per run (the first is warm-up)")
    parser.add_argument("--quick", action="store_true", help="3 steps, first case only")
    parser.add_argument("--out", type=Path, default=DOCS / "predict_vs_measured.md")
    return parser.parse_args()


def plan_and_train(request: PlanRequest, path: Path, steps: int) -> tuple[Plan, RunResult]:
    """Plan ``request`` in this process (saved at ``path``) and train the plan for ``steps`` steps
    (``bench.common.plan_and_run`` does the same through the `planner` command)."""
    plan = make_plan(request)
    return plan, save_and_train(plan, path, steps)


def one_case(tables: Tables, folder: Path, case: Case, schedule: str, steps: int) -> None:
    """Plan and run one case; fit a calibration to that run, plan again and check on a second run."""
    model, size, overrides, gpus, batch, m = case
    request = PlanRequest.build(
        model_file=MODELS / model,
        gpus=gpus,
        size=size,
        overrides=overrides or {},
        batch_size=batch,
        microbatches=m,
        schedule=schedule,
        output=folder / "plan.json",
        progress=False,
    )
    print(f"{model} {size} {overrides or ''} p={gpus} {schedule}", flush=True)
    plan, result = plan_and_train(request, folder / "plan.json", steps)
    err = pct_error(plan.prediction.step_time_s, result.median_step_s)
    tables.errors[schedule].append(abs(err))
    # The calibration loop: fit to this run, plan again, and check on a second, fresh run.
    run_path = folder / "plan.run.json"
    result.save(run_path)  # --calibrate reads the run and finds its plan next to it
    cal = calibrate(plan, result)  # the same fit make_plan applies, for the table
    plan2, result2 = plan_and_train(
        request.model_copy(update={"calibrate_run": run_path}), folder / "plan2.json", steps
    )
    err2 = pct_error(plan2.prediction.step_time_s, result2.median_step_s)
    tables.cal_errors[schedule].append(abs(err2))
    label = f"{model} {size}" + (" (custom)" if overrides else "")
    tables.cal_rows.append(
        [label, gpus, schedule, f"{cal.latency_s * 1e3:.2f}", f"{cal.global_factor:.3f}", blocks_per_stage(plan2)]
        + [f"{plan2.prediction.step_time_s * 1e3:.1f}", f"{result2.median_step_s * 1e3:.1f}", f"{err2:+.1f}%"]
    )
    stage_rows(tables, [f"{model} {size}", gpus, schedule], plan, result)
    slowest = max(s.fwd_s + s.bwd_s for s in plan.stages)
    tables.rows.append(
        [label, gpus, schedule, f"{batch}/{m}", blocks_per_stage(plan), f"{slowest * 1e3:.1f}"]
        + [f"{plan.prediction.step_time_s * 1e3:.1f}", f"{result.median_step_s * 1e3:.1f}", f"{err:+.1f}%"]
    )


def stage_rows(tables: Tables, head: list[object], plan: Plan, result: RunResult) -> None:
    """Per stage: predicted memory against the tracked peak, predicted compute against the run's."""
    for st, meas in zip(plan.stages, result.stages):
        if meas.memory is not None:
            mem_err = pct_error(st.memory_bytes, meas.memory.peak_bytes)
            tables.mem_errors.append(abs(mem_err))
            tables.mem_rows.append(
                [*head, st.index, f"{st.memory_bytes / 2**20:.1f}", f"{meas.memory.peak_bytes / 2**20:.1f}"]
                + [f"{mem_err:+.1f}%"]
            )
        fwd_err = pct_error(st.fwd_s, meas.fwd_s)
        bwd_err = pct_error(st.bwd_s, meas.bwd_s)
        tables.compute_rows.append(
            [*head, st.index, f"{st.fwd_s * 1e3:.1f}", f"{meas.fwd_s * 1e3:.1f}", f"{fwd_err:+.1f}%"]
            + [f"{st.bwd_s * 1e3:.1f}", f"{meas.bwd_s * 1e3:.1f}", f"{bwd_err:+.1f}%"]
        )


def mean_abs_lines(errors: dict[str, list[float]]) -> str:
    """One line per schedule: its mean absolute error over the cases."""
    return "\n".join(
        f"- {s}: mean absolute error {statistics.mean(v):.1f}% over {len(v)} cases" for s, v in errors.items() if v
    )


def page(tables: Tables, steps: int) -> str:
    """The markdown page."""
    mem = tables.mem_errors
    return PAGE.format(
        today=dt.date.today().isoformat(),
        host=host(),
        torch=torch.__version__,
        steps=steps,
        custom=CASES[0][2],
        table=table(tables.rows, STEP_HEADERS),
        mae=mean_abs_lines(tables.errors),
        cal_table=table(tables.cal_rows, CALIBRATED_HEADERS),
        cal_mae=mean_abs_lines(tables.cal_errors),
        compute_table=table(tables.compute_rows, COMPUTE_HEADERS),
        mem_table=table(tables.mem_rows, MEMORY_HEADERS),
        mem_mae=statistics.mean(mem) if mem else float("nan"),
        mem_n=len(mem),
    )


def main() -> None:
    """Plan and run every case under every schedule, write the page."""
    args = parse_args()
    cases = CASES[:1] if args.quick else CASES
    steps = 3 if args.quick else args.steps
    tables = Tables()
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            for schedule in SCHEDULES:
                one_case(tables, Path(tmp), case, schedule, steps)
    text = page(tables, steps)
    write_page(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
