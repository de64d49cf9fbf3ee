"""Every schedule on 2 CPU ranks: simulated vs measured step, the joint search vs fixed 1F1B, and the
pipeline's throughput against one process, all measured side by side in one run.

Profiles the encoder-stack LM once (the `bigvocab` size: 8 encoder layers of width 256 and a
32k-token output layer that costs several layers), then, on the same costs:

(a) plans it under each schedule (GPipe and 1F1B one stage per rank; the interleaved, looped and
    V-shaped ones two stages per rank) with the same microbatch count, trains every plan for real,
    alternating them round by round so machine noise hits all alike, and compares the simulated
    step with the measured median, and the order the simulator ranks the schedules in with the
    measured order;
(c) plans it with the joint search (`--schedule auto --microbatches auto --stages-per-rank auto`)
    and with fixed 1F1B at m = 2p, predicted and measured;
(d) trains the unsplit model in one process (same threads per process) on the same batch and
    reports the searched plan's measured speed-up as a share of the ideal p m / (m + p - 1).

Writes docs/schedules.md.

    python -m bench.schedules                  # the defaults above (~10 minutes on 2 cores)
    python -m bench.schedules --steps 6 --rounds 1 --size tiny
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common import (
    DOCS,
    MODELS,
    alternate,
    blocks_per_stage,
    host,
    plan_on_costs,
    same_losses,
    table,
    timed_step_times,
    write_page,
)
from planner.api import Costs, default_threads, measured_costs
from planner.capture.load import ModelFile, load_model_file
from planner.core.step.schedules import placement
from planner.run.single import train_model_file
from planner.schema.names import SCHEDULES
from planner.schema.plan import Plan
from planner.schema.request import PlanRequest

CREATED = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
SEARCHED, FIXED = "(c) joint search", "(c) 1f1b m=2p"
HEADERS_A = ["schedule", "stages/rank", "blocks per stage", "pred bubble", "pred step ms", "measured ms", "error"]
HEADERS_C = ["plan", "schedule", "m", "stages/rank", "blocks per stage", "pred step ms", "measured ms"]
PAGE = """# Schedules on {p} CPU ranks: simulated vs measured, joint search vs fixed 1F1B, throughput

Written by `bench/schedules.py` on {today} ({host},
torch {torch}, gloo, {threads} thread(s) per rank). Model `{a.model.name}` size `{a.size}`,
batch {a.batch_size}. Costs profiled once; every plan below is made from the same costs. {a.rounds} alternating
round(s) over all plans and the one-process run, {a.steps} steps each (the first step and the memory-tracked
one are not timed). Regenerate: `python -m bench.schedules`.

## (a) Every schedule, m = {m}: simulated vs measured step

{table_a}

{orders}

## (c) Joint search vs fixed 1F1B at m = 2p

{table_c}

The search's choice: {searched.choice}

Predicted gain of the search over 1F1B m = 2p: {gain_pred:.3f}x; measured: {gain_meas:.3f}x.

## (d) Throughput against one process

{throughput}

Losses of the first two plans equal to 1e-4 step by step (the same training): {same}.
"""
ORDERS = """Mean absolute error {mean:.1f}%, max {max:.1f}%.
Simulated order (fastest first): {pred}.
Measured order: {meas}.
Spearman rank correlation {rho:.2f} ({verdict})."""
THROUGHPUT = """One process (the unsplit model, full batch, {threads} thread(s)): {one:.0f} ms per step. The searched plan
({schedule}, m = {m}, {p} ranks): {piped:.0f} ms. Speed-up {speedup:.2f}x against
the ideal p m / (m + p - 1) = {ideal:.2f}x: {share:.0f}% of ideal."""


@dataclass
class Measured:
    """Every plan, the medians of their timed steps, the one-process steps and the last losses."""

    plans: dict[str, Plan]  # (a) per schedule
    runs: dict[str, Plan]  # everything that ran: (a) by "(a) NAME", then SEARCHED and FIXED
    median: dict[str, float]
    single: list[float]
    losses: dict[str, list[float]]


def parse_args() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=MODELS / "encoder_lm.py")
    parser.add_argument("--size", default="bigvocab")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=8, help="m for the per-schedule comparison (a)")
    parser.add_argument(
        "--steps", type=int, default=8, help="steps per run (the first and the memory-tracked one are not timed)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds over all plans")
    parser.add_argument("--out", type=Path, default=DOCS / "schedules.md")
    return parser.parse_args()


def _plan(base: PlanRequest, costs: Costs, mf: ModelFile, **update: object) -> Plan:
    return plan_on_costs(base.model_copy(update=update), costs, mf, created=CREATED)


def every_schedule(base: PlanRequest, costs: Costs, mf: ModelFile, m: int) -> dict[str, Plan]:
    """(a): one plan per schedule at ``m`` microbatches (a schedule torch refuses is reported, not fatal)."""
    plans: dict[str, Plan] = {}
    for name in SCHEDULES:
        v = 1 if placement(name) == "single" else 2
        try:
            plans[name] = _plan(base, costs, mf, schedule=name, microbatches=m, stages_per_rank=v)
        except Exception as e:  # noqa: BLE001 - a schedule torch refuses at this m is reported, not fatal
            print(f"{name}: not planned ({e})")
    return plans


def measure(args: argparse.Namespace, threads: int, folder: Path) -> Measured:
    """Profile once, plan every comparison on those costs, run them all in alternating rounds."""
    base = PlanRequest.build(
        model_file=args.model,
        gpus=args.gpus,
        size=args.size,
        batch_size=args.batch_size,
        output=folder / "plan.json",
        threads=threads,
    )
    mf = load_model_file(base.model_file, base.size, base.overrides)
    print("profiling once ...", flush=True)
    costs = measured_costs(mf, base, threads, None)
    plans = every_schedule(base, costs, mf, args.microbatches)
    searched = _plan(base, costs, mf)
    fixed = _plan(base, costs, mf, schedule="1f1b", microbatches=2 * args.gpus, stages_per_rank=1)
    runs = {**{f"(a) {k}": v for k, v in plans.items()}, SEARCHED: searched, FIXED: fixed}
    single: list[float] = []

    def one_process(r: int) -> None:
        print(f"round {r + 1}/{args.rounds}: one process", flush=True)
        ref = train_model_file(searched, mf, args.steps, n_microbatches=1, echo=False, track_memory=False)
        single.extend(timed_step_times(ref))

    measured, losses = alternate(runs, folder, args.rounds, args.steps, echo=False, after_round=one_process)
    median = {k: statistics.median(v) for k, v in measured.items()}
    return Measured(plans, runs, median, single, losses)


def _ranks(values: dict[str, float]) -> list[str]:
    return [k for k, _ in sorted(values.items(), key=lambda kv: kv[1])]


def _spearman(a: list[str], b: list[str]) -> float:
    n = len(a)
    if n < 2:
        return 1.0
    pos = {k: i for i, k in enumerate(b)}
    d2 = sum((i - pos[k]) ** 2 for i, k in enumerate(a))
    return 1 - 6 * d2 / (n * (n * n - 1))


def section_a(got: Measured) -> tuple[str, str]:
    """(a): the table of every schedule, and its errors and orders in words."""
    rows = []
    pred: dict[str, float] = {}
    meas: dict[str, float] = {}
    for name, plan in got.plans.items():
        pred[name], meas[name] = plan.prediction.step_time_s, got.median[f"(a) {name}"]
        rows.append(
            [
                name,
                plan.stages_per_rank,
                blocks_per_stage(plan),
                f"{100 * plan.prediction.bubble_fraction:.1f}%",
                f"{pred[name] * 1e3:.0f}",
                f"{meas[name] * 1e3:.0f}",
                f"{100 * (pred[name] - meas[name]) / meas[name]:+.1f}%",
            ]
        )
    order_pred, order_meas = _ranks(pred), _ranks(meas)
    errors = [abs(pred[k] - meas[k]) / meas[k] for k in pred]
    orders = ORDERS.format(
        mean=100 * statistics.mean(errors),
        max=100 * max(errors),
        pred=", ".join(order_pred),
        meas=", ".join(order_meas),
        rho=_spearman(order_pred, order_meas),
        verdict="same order" if order_pred == order_meas else "the orders differ",
    )
    return table(rows, HEADERS_A), orders


def table_c(got: Measured) -> str:
    """(c): the searched plan and fixed 1F1B, predicted and measured."""
    rows = []
    for name in (SEARCHED, FIXED):
        plan = got.runs[name]
        rows.append(
            [
                name[4:],
                plan.schedule,
                plan.n_microbatches,
                plan.stages_per_rank,
                blocks_per_stage(plan),
                f"{plan.prediction.step_time_s * 1e3:.0f}",
                f"{got.median[name] * 1e3:.0f}",
            ]
        )
    return table(rows, HEADERS_C)


def throughput(got: Measured, p: int, threads: int) -> str:
    """(d): the searched plan's measured speed-up over one process, against the ideal."""
    one = statistics.median(got.single)
    searched, piped = got.runs[SEARCHED], got.median[SEARCHED]
    ms = searched.n_microbatches
    ideal = p * ms / (ms + p - 1)
    speedup = one / piped
    return THROUGHPUT.format(
        threads=threads,
        one=one * 1e3,
        schedule=searched.schedule,
        m=ms,
        p=p,
        piped=piped * 1e3,
        speedup=speedup,
        ideal=ideal,
        share=100 * speedup / ideal,
    )


def page(args: argparse.Namespace, got: Measured, threads: int) -> str:
    """The markdown page."""
    table_a, orders = section_a(got)
    searched, fixed = got.runs[SEARCHED], got.runs[FIXED]
    first_two = [got.losses[k] for k in list(got.runs)[:2]]
    return PAGE.format(
        a=args,
        p=args.gpus,
        m=args.microbatches,
        today=dt.date.today().isoformat(),
        host=host(),
        torch=torch.__version__,
        threads=threads,
        table_a=table_a,
        orders=orders,
        table_c=table_c(got),
        searched=searched,
        gain_pred=fixed.prediction.step_time_s / searched.prediction.step_time_s,
        gain_meas=got.median[FIXED] / got.median[SEARCHED],
        throughput=throughput(got, args.gpus, threads),
        same=same_losses(*first_two),
    )


def main() -> None:
    """Profile, plan, run in alternation, write the page."""
    args = parse_args()
    threads = default_threads(args.gpus)
    with tempfile.TemporaryDirectory() as tmp:
        got = measure(args, threads, Path(tmp))
    text = page(args, got, threads)
    write_page(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
