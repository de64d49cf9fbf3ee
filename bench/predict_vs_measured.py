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
from planner.run import run_plan  # noqa: E402

# (model file, size, overrides, gpus, batch size, microbatches): sizes where a stage computes for
# at least ~20 ms per microbatch on one thread, so fixed per-message costs do not dominate.
CASES = [
    ("gpt.py", "tiny", {"dim": 256, "n_layers": 8, "n_heads": 8, "ffn_dim": 1024, "vocab_size": 8000, "seq_len": 128}, 2, 32, 4),
    ("gpt.py", "tiny", {"dim": 256, "n_layers": 8, "n_heads": 8, "ffn_dim": 1024, "vocab_size": 8000, "seq_len": 128}, 4, 32, 8),
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
    rows = []
    errors: dict[str, list[float]] = {s: [] for s in SCHEDULES}
    with tempfile.TemporaryDirectory() as tmp:
        for model, size, overrides, gpus, batch, m in cases:
            for schedule in SCHEDULES:
                plan = make_plan(ROOT / "models" / model, gpus, size=size, overrides=overrides, batch_size=batch,
                                 microbatches=m, schedule=schedule, plan_dir=tmp, progress=False)
                path = Path(tmp) / "plan.json"
                plan.save(path)
                print(f"{model} {size} {overrides or ''} p={gpus} {schedule}", flush=True)
                result = run_plan(plan, path, steps, echo=False)
                measured = statistics.median(result.step_times_s[1:])
                predicted = plan.prediction.step_time_s
                err = 100 * (predicted - measured) / measured
                errors[schedule].append(abs(err))
                slowest = max(s.fwd_s + s.bwd_s for s in plan.stages)
                rows.append([
                    f"{model} {size}" + (" (custom)" if overrides else ""), gpus, schedule, f"{batch}/{m}",
                    "+".join(str(s.end - s.start) for s in plan.stages), f"{slowest * 1e3:.1f}",
                    f"{predicted * 1e3:.1f}", f"{measured * 1e3:.1f}", f"{err:+.1f}%",
                ])
    table = tabulate(rows, headers=["model", "ranks", "schedule", "batch/mb", "split", "slowest stage compute ms/mb",
                                    "predicted step ms", "measured step ms", "error"], tablefmt="github", disable_numparse=True)
    mae = "\n".join(f"- {s}: mean absolute error {statistics.mean(v):.1f}% over {len(v)} cases" for s, v in errors.items() if v)
    text = f"""# Predicted vs measured step time on this machine

Written by `bench/predict_vs_measured.py` on {dt.date.today().isoformat()} ({platform.node()}, {os.cpu_count()} cores,
torch {torch.__version__}, gloo, one process per rank, cores // ranks threads each). Each row plans the case
(measured per-block profile), then trains it for {steps} steps; measured = median step after the first.
The custom GPT size: {CASES[0][2]}.

{table}

{mae}
"""
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
