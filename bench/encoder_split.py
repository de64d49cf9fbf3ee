"""Planned split vs the uniform-layer split of the encoder-stack LM, predicted and measured.

Plans the Pipe tutorial's encoder-stack language model at a size with a large vocabulary (the
output layer costs several encoder layers), then trains both splits for real on this machine,
alternating them round by round so machine noise hits both alike, and writes the figures to
docs/bench_encoder_split_<size>_p<gpus>.md.

    python -m bench.encoder_split                       # size bigvocab, 2 stages
    python -m bench.encoder_split --gpus 4 --size bigvocab --steps 8 --rounds 2
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import tempfile
from pathlib import Path

import torch

from bench.common import DOCS, MODELS, alternate, blocks_per_stage, host, same_losses, table, write_page
from planner.api import make_plan
from planner.core.step.predict import with_method
from planner.schema.plan import Plan
from planner.schema.request import PlanRequest

PLANNED, UNIFORM = "planner (exact)", "uniform layers"
HEADERS = [
    "split",
    "blocks per stage",
    "pred slowest ms/mb",
    "pred step ms",
    "measured step ms (median)",
    "pred error",
    "pred vs planned",
    "measured vs planned",
]
PAGE = """# Planned vs uniform-layer split: encoder-stack LM (`{a.size}`), {a.gpus} stages

Written by `bench/encoder_split.py` on {today} ({host},
torch {torch}, gloo, {threads} thread(s) per rank). Batch {a.batch_size} as
{a.microbatches} microbatches, schedule {a.schedule}; {a.rounds} alternating rounds of {a.steps} steps
each (the first step of each run is warm-up and left out). Both splits use the same profiled costs.

{table}

Both splits trained the same model on the same data: per-step losses equal to 1e-4: {same_loss}.

Stage block names (planned): {planned_names};
(uniform): {uniform_names}.
"""


def parse_args() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="bigvocab")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--steps", type=int, default=10, help="steps per run (the first is warm-up)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of (planned, uniform)")
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args()


def plans(args: argparse.Namespace, folder: Path) -> dict[str, Plan]:
    """The planner's split and the uniform-layer one, on the same profiled costs."""
    planned = make_plan(
        PlanRequest.build(
            model_file=MODELS / "encoder_lm.py",
            gpus=args.gpus,
            size=args.size,
            batch_size=args.batch_size,
            microbatches=args.microbatches,
            schedule=args.schedule,
            output=folder / "plan.json",
        )
    )
    return {PLANNED: planned, UNIFORM: with_method(planned, "uniform")}


def rows(plans: dict[str, Plan], measured: dict[str, list[float]]) -> list[list[str]]:
    """One row per split: predicted and measured, each against the planned split."""
    base_pred = plans[PLANNED].prediction.step_time_s
    base_meas = statistics.median(measured[PLANNED])
    out = []
    for name, plan in plans.items():
        med = statistics.median(measured[name])
        out.append(
            [
                name,
                blocks_per_stage(plan),
                f"{plan.prediction.bottleneck_s * 1e3:.1f}",
                f"{plan.prediction.step_time_s * 1e3:.1f}",
                f"{med * 1e3:.1f}",
                f"{100 * (plan.prediction.step_time_s - med) / med:+.1f}%",
                f"{plan.prediction.step_time_s / base_pred:.3f}",
                f"{med / base_meas:.3f}",
            ]
        )
    return out


def stage_names(plan: Plan) -> str:
    """The first and last block of every stage."""
    return ", ".join(f"{s.first_block}..{s.last_block}" for s in plan.stages)


def main() -> None:
    """Plan, train both splits in alternation, write the page."""
    args = parse_args()
    out = args.out or DOCS / f"bench_encoder_split_{args.size}_p{args.gpus}.md"
    with tempfile.TemporaryDirectory() as tmp:
        both = plans(args, Path(tmp))
        measured, losses = alternate(both, Path(tmp), args.rounds, args.steps)
    text = PAGE.format(
        a=args,
        today=dt.date.today().isoformat(),
        host=host(),
        torch=torch.__version__,
        threads=both[PLANNED].profile.threads,
        table=table(rows(both, measured), HEADERS),
        same_loss=same_losses(*losses.values()),
        planned_names=stage_names(both[PLANNED]),
        uniform_names=stage_names(both[UNIFORM]),
    )
    write_page(out, text)
    print(text)


if __name__ == "__main__":
    main()
