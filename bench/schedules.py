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

    python bench/schedules.py                  # the defaults above (~10 minutes on 2 cores)
    python bench/schedules.py --steps 6 --rounds 1 --size tiny
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

from planner.api import default_threads, measured_costs, model_ref  # noqa: E402
from planner.capture.load import load_model_file  # noqa: E402
from planner.core.assemble import assemble_plan  # noqa: E402
from planner.core.schedules import placement  # noqa: E402
from planner.run import run_plan  # noqa: E402
from planner.run.single import train_model_file  # noqa: E402
from planner.schema.plan import Plan  # noqa: E402
from planner.schema.request import SCHEDULES, PlanRequest, RunRequest  # noqa: E402

CREATED = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _plan(base: PlanRequest, costs: object, mf: object, **update: object) -> Plan:
    request = base.model_copy(update=update)
    return assemble_plan(
        request,
        costs.blocks,  # type: ignore[attr-defined]
        costs.link,  # type: ignore[attr-defined]
        model=model_ref(mf, costs.traced, request),  # type: ignore[arg-type, attr-defined]
        profile=costs.profile,  # type: ignore[attr-defined]
        memory_limit_bytes=None,
        created=CREATED,
    )


def _ranks(values: dict[str, float]) -> list[str]:
    return [k for k, _ in sorted(values.items(), key=lambda kv: kv[1])]


def _spearman(a: list[str], b: list[str]) -> float:
    n = len(a)
    if n < 2:
        return 1.0
    pos = {k: i for i, k in enumerate(b)}
    d2 = sum((i - pos[k]) ** 2 for i, k in enumerate(a))
    return 1 - 6 * d2 / (n * (n * n - 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "encoder_lm.py")
    parser.add_argument("--size", default="bigvocab")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=8, help="m for the per-schedule comparison (a)")
    parser.add_argument(
        "--steps", type=int, default=8, help="steps per run (the first and the memory-tracked one are not timed)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds over all plans")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "schedules.md")
    args = parser.parse_args()
    p, m = args.gpus, args.microbatches

    threads = default_threads(p)
    with tempfile.TemporaryDirectory() as tmp:
        base = PlanRequest.build(
            model_file=args.model,
            gpus=p,
            size=args.size,
            batch_size=args.batch_size,
            output=Path(tmp) / "plan.json",
            threads=threads,
        )
        mf = load_model_file(base.model_file, base.size, base.overrides)
        print("profiling once ...", flush=True)
        costs = measured_costs(mf, base, threads, None)

        plans: dict[str, Plan] = {}
        for name in SCHEDULES:
            v = 1 if placement(name) == "single" else 2
            try:
                plans[name] = _plan(base, costs, mf, schedule=name, microbatches=m, stages_per_rank=v)
            except Exception as e:  # noqa: BLE001 - a schedule torch refuses at this m is reported, not fatal
                print(f"{name}: not planned ({e})")
        searched = _plan(base, costs, mf)
        fixed = _plan(base, costs, mf, schedule="1f1b", microbatches=2 * p, stages_per_rank=1)
        runs = {**{f"(a) {k}": v for k, v in plans.items()}, "(c) joint search": searched, "(c) 1f1b m=2p": fixed}
        paths: dict[str, Path] = {}
        for i, (name, plan) in enumerate(runs.items()):
            paths[name] = Path(tmp) / f"plan{i}.json"
            plan.save(paths[name])

        measured: dict[str, list[float]] = {name: [] for name in runs}
        single: list[float] = []
        losses: dict[str, list[float]] = {}
        for r in range(args.rounds):
            for name, plan in runs.items():
                print(f"round {r + 1}/{args.rounds}: {name}", flush=True)
                res = run_plan(plan, RunRequest(plan_file=paths[name], steps=args.steps, echo=False))
                measured[name].extend(res.step_times_s[i - 1] for i in res.timed_steps)
                losses[name] = res.losses
            print(f"round {r + 1}/{args.rounds}: one process", flush=True)
            ref = train_model_file(searched, mf, args.steps, n_microbatches=1, echo=False, track_memory=False)
            single.extend(ref.step_times_s[i - 1] for i in ref.timed_steps)

    med = {k: statistics.median(v) for k, v in measured.items()}
    rows = []
    sched_pred: dict[str, float] = {}
    sched_meas: dict[str, float] = {}
    for name, plan in plans.items():
        key = f"(a) {name}"
        pred = plan.prediction.step_time_s
        sched_pred[name], sched_meas[name] = pred, med[key]
        rows.append(
            [
                name,
                plan.stages_per_rank,
                "+".join(str(s.end - s.start) for s in plan.stages),
                f"{100 * plan.prediction.bubble_fraction:.1f}%",
                f"{pred * 1e3:.0f}",
                f"{med[key] * 1e3:.0f}",
                f"{100 * (pred - med[key]) / med[key]:+.1f}%",
            ]
        )
    table_a = tabulate(
        rows,
        headers=["schedule", "stages/rank", "blocks per stage", "pred bubble", "pred step ms", "measured ms", "error"],
        tablefmt="github",
        disable_numparse=True,
    )
    order_pred, order_meas = _ranks(sched_pred), _ranks(sched_meas)
    rho = _spearman(order_pred, order_meas)
    errors = [abs(sched_pred[k] - sched_meas[k]) / sched_meas[k] for k in sched_pred]

    rows_c = []
    for name in ("(c) joint search", "(c) 1f1b m=2p"):
        plan = runs[name]
        rows_c.append(
            [
                name[4:],
                plan.schedule,
                plan.n_microbatches,
                plan.stages_per_rank,
                "+".join(str(s.end - s.start) for s in plan.stages),
                f"{plan.prediction.step_time_s * 1e3:.0f}",
                f"{med[name] * 1e3:.0f}",
            ]
        )
    table_c = tabulate(
        rows_c,
        headers=["plan", "schedule", "m", "stages/rank", "blocks per stage", "pred step ms", "measured ms"],
        tablefmt="github",
        disable_numparse=True,
    )
    gain_pred = fixed.prediction.step_time_s / searched.prediction.step_time_s
    gain_meas = med["(c) 1f1b m=2p"] / med["(c) joint search"]

    one = statistics.median(single)
    ms = searched.n_microbatches
    ideal = p * ms / (ms + p - 1)
    speedup = one / med["(c) joint search"]
    same = all(abs(a - b) <= 1e-4 * max(1.0, abs(a)) for a, b in zip(*[losses[k] for k in list(runs)[:2]]))

    text = f"""# Schedules on {p} CPU ranks: simulated vs measured, joint search vs fixed 1F1B, throughput

Written by `bench/schedules.py` on {dt.date.today().isoformat()} ({platform.node()}, {os.cpu_count()} cores,
torch {torch.__version__}, gloo, {threads} thread(s) per rank). Model `{args.model.name}` size `{args.size}`,
batch {args.batch_size}. Costs profiled once; every plan below is made from the same costs. {args.rounds} alternating
round(s) over all plans and the one-process run, {args.steps} steps each (the first step and the memory-tracked
one are not timed). Regenerate: `python bench/schedules.py`.

## (a) Every schedule, m = {m}: simulated vs measured step

{table_a}

Mean absolute error {100 * statistics.mean(errors):.1f}%, max {100 * max(errors):.1f}%.
Simulated order (fastest first): {", ".join(order_pred)}.
Measured order: {", ".join(order_meas)}.
Spearman rank correlation {rho:.2f} ({"same order" if order_pred == order_meas else "the orders differ"}).

## (c) Joint search vs fixed 1F1B at m = 2p

{table_c}

The search's choice: {searched.choice}

Predicted gain of the search over 1F1B m = 2p: {gain_pred:.3f}x; measured: {gain_meas:.3f}x.

## (d) Throughput against one process

One process (the unsplit model, full batch, {threads} thread(s)): {one * 1e3:.0f} ms per step. The searched plan
({searched.schedule}, m = {ms}, {p} ranks): {med["(c) joint search"] * 1e3:.0f} ms. Speed-up {speedup:.2f}x against
the ideal p m / (m + p - 1) = {ideal:.2f}x: {100 * speedup / ideal:.0f}% of ideal.

Losses of the first two plans equal to 1e-4 step by step (the same training): {same}.
"""
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
