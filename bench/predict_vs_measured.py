"""Predicted vs measured step time (and peak memory) of real pipelined runs on this machine.

For each case: plan it (measured profile on this CPU), run it for real with gloo, and compare the
plan's predicted step time with the measured median; cases run one after another, so each
prediction is checked against a run on the same quiet machine. Writes docs/predict_vs_measured.md.

    python bench/predict_vs_measured.py            # all cases
    python bench/predict_vs_measured.py --quick    # fewer steps (a smoke test of the script)
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

from planner.api import make_plan  # noqa: E402
from planner.core.calibrate import calibrate  # noqa: E402
from planner.run import run_plan  # noqa: E402
from planner.schema.request import PlanRequest, RunRequest  # noqa: E402

GPT_MID = {"dim": 128, "n_layers": 8, "n_heads": 4, "ffn_dim": 512, "vocab_size": 8000, "seq_len": 64}
# (model file, size, overrides, gpus, batch size, microbatches): sizes where a stage computes for
# at least ~20 ms per microbatch on one thread, so fixed per-message costs do not dominate.
CASES = [
    ("gpt.py", "tiny", GPT_MID, 2, 16, 4),
    ("gpt.py", "tiny", GPT_MID, 4, 16, 4),
    ("encoder_lm.py", "bigvocab", {}, 2, 16, 4),
    ("encoder_lm.py", "bigvocab", {}, 4, 16, 4),
]
SCHEDULES = ("gpipe", "1f1b")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="steps per run (the first is warm-up)")
    parser.add_argument("--quick", action="store_true", help="3 steps, first case only")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "predict_vs_measured.md")
    args = parser.parse_args()
    cases = CASES[:1] if args.quick else CASES
    steps = 3 if args.quick else args.steps
    rows: list[list] = []
    mem_rows: list[list] = []
    compute_rows: list[list] = []
    mem_errors: list[float] = []
    cal_rows: list[list] = []
    errors: dict[str, list[float]] = {s: [] for s in SCHEDULES}
    cal_errors: dict[str, list[float]] = {s: [] for s in SCHEDULES}
    with tempfile.TemporaryDirectory() as tmp:
        for model, size, overrides, gpus, batch, m in cases:
            for schedule in SCHEDULES:
                path = Path(tmp) / "plan.json"
                request = PlanRequest.build(
                    model_file=ROOT / "models" / model,
                    gpus=gpus,
                    size=size,
                    overrides=overrides or {},
                    batch_size=batch,
                    microbatches=m,
                    schedule=schedule,
                    output=path,
                    progress=False,
                )
                plan = make_plan(request)
                plan.save(path)
                print(f"{model} {size} {overrides or ''} p={gpus} {schedule}", flush=True)
                result = run_plan(plan, RunRequest(plan_file=path, steps=steps, echo=False))
                measured = result.median_step_s  # over the timed steps: not the first, not the memory-tracked one
                predicted = plan.prediction.step_time_s
                err = 100 * (predicted - measured) / measured
                errors[schedule].append(abs(err))
                # The calibration loop: fit to this run, plan again, and check on a second, fresh run.
                run_path = Path(tmp) / "plan.run.json"
                result.save(run_path)  # --calibrate reads the run and finds its plan next to it
                cal = calibrate(plan, result)  # the same fit make_plan applies, for the table
                plan2 = make_plan(request.model_copy(update={"calibrate_run": run_path}))
                path2 = Path(tmp) / "plan2.json"
                plan2.save(path2)
                result2 = run_plan(plan2, RunRequest(plan_file=path2, steps=steps, echo=False))
                err2 = 100 * (plan2.prediction.step_time_s - result2.median_step_s) / result2.median_step_s
                cal_errors[schedule].append(abs(err2))
                cal_rows.append(
                    [
                        f"{model} {size}" + (" (custom)" if overrides else ""),
                        gpus,
                        schedule,
                        f"{cal.latency_s * 1e3:.2f}",
                        f"{cal.global_factor:.3f}",
                        "+".join(str(s.end - s.start) for s in plan2.stages),
                        f"{plan2.prediction.step_time_s * 1e3:.1f}",
                        f"{result2.median_step_s * 1e3:.1f}",
                        f"{err2:+.1f}%",
                    ]
                )
                slowest = max(s.fwd_s + s.bwd_s for s in plan.stages)
                for st, meas in zip(plan.stages, result.stages):
                    if meas.memory is not None:
                        mem_err = 100 * (st.memory_bytes - meas.memory.peak_bytes) / meas.memory.peak_bytes
                        mem_errors.append(abs(mem_err))
                        mem_rows.append(
                            [
                                f"{model} {size}",
                                gpus,
                                schedule,
                                st.index,
                                f"{st.memory_bytes / 2**20:.1f}",
                                f"{meas.memory.peak_bytes / 2**20:.1f}",
                                f"{mem_err:+.1f}%",
                            ]
                        )
                    fwd_err = 100 * (st.fwd_s - meas.fwd_s) / meas.fwd_s
                    bwd_err = 100 * (st.bwd_s - meas.bwd_s) / meas.bwd_s
                    compute_rows.append(
                        [
                            f"{model} {size}",
                            gpus,
                            schedule,
                            st.index,
                            f"{st.fwd_s * 1e3:.1f}",
                            f"{meas.fwd_s * 1e3:.1f}",
                            f"{fwd_err:+.1f}%",
                            f"{st.bwd_s * 1e3:.1f}",
                            f"{meas.bwd_s * 1e3:.1f}",
                            f"{bwd_err:+.1f}%",
                        ]
                    )
                rows.append(
                    [
                        f"{model} {size}" + (" (custom)" if overrides else ""),
                        gpus,
                        schedule,
                        f"{batch}/{m}",
                        "+".join(str(s.end - s.start) for s in plan.stages),
                        f"{slowest * 1e3:.1f}",
                        f"{predicted * 1e3:.1f}",
                        f"{measured * 1e3:.1f}",
                        f"{err:+.1f}%",
                    ]
                )
    table = tabulate(
        rows,
        headers=[
            "model",
            "ranks",
            "schedule",
            "batch/mb",
            "split",
            "slowest stage compute ms/mb",
            "predicted step ms",
            "measured step ms",
            "error",
        ],
        tablefmt="github",
        disable_numparse=True,
    )
    cal_table = tabulate(
        cal_rows,
        headers=[
            "model",
            "ranks",
            "schedule",
            "fitted ms/message",
            "global factor",
            "split",
            "predicted step ms",
            "measured step ms (2nd run)",
            "error",
        ],
        tablefmt="github",
        disable_numparse=True,
    )
    cal_mae = "\n".join(
        f"- {s}: mean absolute error {statistics.mean(v):.1f}% over {len(v)} cases" for s, v in cal_errors.items() if v
    )
    mem_table = tabulate(
        mem_rows,
        headers=["model", "ranks", "schedule", "stage", "predicted MB", "measured peak MB (MemTracker)", "error"],
        tablefmt="github",
        disable_numparse=True,
    )
    compute_table = tabulate(
        compute_rows,
        headers=[
            "model",
            "ranks",
            "schedule",
            "stage",
            "pred fwd ms/mb",
            "run fwd",
            "err",
            "pred bwd ms/mb",
            "run bwd",
            "err",
        ],
        tablefmt="github",
        disable_numparse=True,
    )
    mae = "\n".join(
        f"- {s}: mean absolute error {statistics.mean(v):.1f}% over {len(v)} cases" for s, v in errors.items() if v
    )
    text = f"""# Predicted vs measured step time on this machine

Written by `bench/predict_vs_measured.py` on {dt.date.today().isoformat()} ({platform.node()}, {os.cpu_count()} cores,
torch {torch.__version__}, gloo, one process per rank, cores // ranks threads each). Each row plans the case
(measured per-block profile), then trains it for {steps} steps; measured = median over the timed steps
(not the first, which sets the schedule up, nor the one run under the memory tracker).
The custom GPT size: {CASES[0][2]}.

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

Mean absolute memory error: {statistics.mean(mem_errors) if mem_errors else float("nan"):.1f}% over {len(mem_errors)} ranks.
"""
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
