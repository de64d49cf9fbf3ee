"""Planned split vs the uniform-layer split of the encoder-stack LM, predicted and measured.

Plans the Pipe tutorial's encoder-stack language model at a size with a large vocabulary (the
output layer costs several encoder layers), then trains both splits for real on this machine,
alternating them round by round so machine noise hits both alike, and writes the figures to
docs/bench_encoder_split.md.

    python bench/encoder_split.py                       # size bigvocab, 2 stages
    python bench/encoder_split.py --gpus 4 --size bigvocab --steps 8 --rounds 2
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
from planner.core.predict import with_method  # noqa: E402
from planner.run import run_plan  # noqa: E402
from planner.schema.request import PlanRequest, RunRequest  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="bigvocab")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--steps", type=int, default=10, help="steps per run (the first is warm-up)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of (planned, uniform)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or ROOT / "docs" / f"bench_encoder_split_{args.size}_p{args.gpus}.md"

    model = ROOT / "models" / "encoder_lm.py"
    with tempfile.TemporaryDirectory() as tmp:
        planned = make_plan(
            PlanRequest.build(
                model_file=model,
                gpus=args.gpus,
                size=args.size,
                batch_size=args.batch_size,
                microbatches=args.microbatches,
                schedule=args.schedule,
                output=Path(tmp) / "plan.json",
            )
        )
        plans = {"planner (exact)": planned, "uniform layers": with_method(planned, "uniform")}
        paths = {}
        for name, plan in plans.items():
            paths[name] = Path(tmp) / f"{plan.method}.json"
            plan.save(paths[name])
        measured: dict[str, list[float]] = {name: [] for name in plans}
        losses: dict[str, list[float]] = {}
        for r in range(args.rounds):
            for name, plan in plans.items():
                print(f"round {r + 1}/{args.rounds}: {name}", flush=True)
                result = run_plan(plan, RunRequest(plan_file=paths[name], steps=args.steps))
                measured[name].extend(result.step_times_s[i - 1] for i in result.timed_steps)
                losses[name] = result.losses

    rows = []
    base_pred = plans["planner (exact)"].prediction.step_time_s
    base_meas = statistics.median(measured["planner (exact)"])
    for name, plan in plans.items():
        ends = [s.end - s.start for s in plan.stages]
        med = statistics.median(measured[name])
        rows.append(
            [
                name,
                "+".join(map(str, ends)),
                f"{plan.prediction.bottleneck_s * 1e3:.1f}",
                f"{plan.prediction.step_time_s * 1e3:.1f}",
                f"{med * 1e3:.1f}",
                f"{100 * (plan.prediction.step_time_s - med) / med:+.1f}%",
                f"{plan.prediction.step_time_s / base_pred:.3f}",
                f"{med / base_meas:.3f}",
            ]
        )
    table = tabulate(
        rows,
        headers=[
            "split",
            "blocks per stage",
            "pred slowest ms/mb",
            "pred step ms",
            "measured step ms (median)",
            "pred error",
            "pred vs planned",
            "measured vs planned",
        ],
        tablefmt="github",
        disable_numparse=True,
    )
    same_loss = all(abs(a - b) <= 1e-4 * max(1.0, abs(a)) for a, b in zip(*losses.values()))
    text = f"""# Planned vs uniform-layer split: encoder-stack LM (`{args.size}`), {args.gpus} stages

Written by `bench/encoder_split.py` on {dt.date.today().isoformat()} ({platform.node()}, {os.cpu_count()} cores,
torch {torch.__version__}, gloo, {planned.profile.threads} thread(s) per rank). Batch {args.batch_size} as
{args.microbatches} microbatches, schedule {args.schedule}; {args.rounds} alternating rounds of {args.steps} steps
each (the first step of each run is warm-up and left out). Both splits use the same profiled costs.

{table}

Both splits trained the same model on the same data: per-step losses equal to 1e-4: {same_loss}.

Stage block names (planned): {", ".join(f"{s.first_block}..{s.last_block}" for s in plans["planner (exact)"].stages)};
(uniform): {", ".join(f"{s.first_block}..{s.last_block}" for s in plans["uniform layers"].stages)}.
"""
    out.parent.mkdir(exist_ok=True)
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
