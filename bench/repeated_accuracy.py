"""Predicted vs measured under this machine's noise: every case planned and run N times, alternating.

`bench/cost_accuracy.py` compares one profile with one run. On this machine one measurement moves by
about 16 % on its own (docs/machine_noise.md), so two independent draws differ by about 19 % in mean
absolute terms and a single comparison cannot show a 7 % error, however exact the model. This
script repeats each comparison: N rounds, and in every round each case (model, ranks, schedule) is
planned afresh (`planner plan`: a new profile) and run (`planner run`), the cases taking turns so
that the machine's slow drift falls on all of them alike. Per case it reports the mean prediction
against the mean measurement (the error of the means, whose noise falls as 1 / sqrt(N)), every
draw's own error, and the noise left in the error of the means (two standard errors). Writes
docs/repeated_accuracy.md.

    .venv/bin/python -m bench.repeated_accuracy                     # every model, 2 ranks, gpipe + 1f1b, 3 rounds
    .venv/bin/python -m bench.repeated_accuracy --repeats 5 --models gpt mlp_stack --ranks 2 4
    .venv/bin/python -m bench.repeated_accuracy --keep              # keep every plan and run (for bench.runtime_link)
    .venv/bin/python -m bench.repeated_accuracy --from DIR1 DIR2    # one page from kept sweeps, their rounds pooled
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.cases import (
    DASH,
    ModelSpec,
    discover,
    make_case,
    mean_abs,
    ms,
    pct,
    plan_split,
    rel,
    run_case,
    shared_compute,
)
from bench.common import DOCS, background_cpu, machine, table, write_page
from planner.core.split.cuts import Split
from planner.core.step.predict import predict_plan
from planner.schema.costs import BlockCost
from planner.schema.plan import Plan
from planner.schema.result import RunResult

SCRIPT = "bench/repeated_accuracy.py"
RERUN = ".venv/bin/python -m bench.repeated_accuracy"
DEFAULT_OUT = DOCS / "repeated_accuracy.md"


@dataclass
class Draw:
    """One round of one case: the plan's figures and the run's."""

    split: str
    predicted_s: float
    measured_s: float
    stage_plan_s: list[float]  # per stage: fwd + bwd per microbatch, as planned
    stage_shared_s: list[float]  # the same, stretched as the simulator shares cores between ranks
    stage_run_s: list[float]  # per stage: forward_one_chunk + backward_one_chunk medians
    stage_blocks_s: list[float]  # per stage: the run's block times (outside-block runtime work left out)
    warm_s: float = math.nan  # the same plan re-predicted without its blocks' cold starts (paired: same run)
    own_blocks_s: float = math.nan  # the plan re-predicted with the run's own block times (NaN: none timed)


@dataclass
class Repeated:
    """Every round of one (model, ranks, schedule)."""

    model: ModelSpec
    ranks: int
    schedule: str
    draws: list[Draw] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        """The case in words."""
        return f"{self.model.name} p={self.ranks} {self.schedule}"

    def modal(self) -> list[Draw]:
        """The draws whose plan chose the most common split (stage figures compare only among them)."""
        if not self.draws:
            return []
        split = Counter(d.split for d in self.draws).most_common(1)[0][0]
        return [d for d in self.draws if d.split == split]


def draw_of(plan: Plan, run: RunResult) -> Draw:
    """One finished round's figures."""
    blocks = [sum(b.fwd_s + b.bwd_s for b in m.blocks) if m.blocks else math.nan for m in run.stages]
    return Draw(
        split=plan_split(plan),
        predicted_s=plan.prediction.step_time_s,
        measured_s=run.median_step_s,
        stage_plan_s=[s.fwd_s + s.bwd_s for s in plan.stages],
        stage_shared_s=shared_compute(plan),
        stage_run_s=[m.fwd_s + m.bwd_s for m in run.stages],
        stage_blocks_s=blocks,
        warm_s=without_cold_starts(plan),
        own_blocks_s=with_run_blocks(plan, run),
    )


def with_run_blocks(plan: Plan, run: RunResult) -> float:
    """``plan``'s step re-predicted with every block's forward and backward as the run timed them
    inside its stage (its cold starts and, in the last block, the loss included): what is left of
    the error is the schedule, message and optimizer model's, the profile's noise taken out. NaN
    when the run timed no blocks."""
    timed = {b.name: b for m in run.stages for b in m.blocks}
    if any(b.name not in timed for b in plan.blocks):
        return math.nan
    return step_with(
        plan, [b.model_copy(update={"fwd_s": timed[b.name].fwd_s, "bwd_s": timed[b.name].bwd_s}) for b in plan.blocks]
    )


def without_cold_starts(plan: Plan) -> float:
    """``plan``'s step re-predicted as if no block started cold after a message (what the planner
    predicted before it timed cold starts): the same profile and run, so the difference is the model's.
    NaN for a plan made before cold starts were timed."""
    if all(b.fwd_cold_s is None and b.bwd_cold_s is None for b in plan.blocks):
        return math.nan
    return step_with(plan, plan.blocks)


def step_with(plan: Plan, blocks: Sequence[BlockCost]) -> float:
    """``plan``'s split and everything else it fixes, re-predicted with ``blocks`` taken without
    cold starts (a run's own block times hold theirs already)."""
    warm = [b.model_copy(update={"fwd_cold_s": None, "bwd_cold_s": None}) for b in blocks]
    return predict_plan(plan, Split.of(plan.prediction), blocks=warm)[1].step_time_s


def from_kept(folders: Sequence[Path], args: argparse.Namespace) -> list[Repeated]:
    """The rounds of earlier sweeps, read back from their kept folders (``--keep``), nothing run.

    Several folders pool their rounds case by case, so that sweeps run at different times (each a
    few rounds) add up to the many rounds the machine's noise asks for; they must come from the
    same cost model for their means to mean anything.
    """
    found: dict[tuple[str, int, str], Repeated] = {}
    paths = [p for folder in folders for p in sorted(folder.glob("*_r*.run.json"), key=lambda p: p.name)]
    for run_path in paths:
        stem = run_path.name[: -len(".run.json")]
        head, _, k = stem.rpartition("_r")
        name, p, schedule = head.rsplit("_", 2)
        if not k.isdigit() or not p.startswith("p") or schedule not in args.schedules or int(p[1:]) not in args.ranks:
            continue
        plan, run = Plan.load(run_path.with_name(stem + ".json")), RunResult.load(run_path)
        key = (name, int(p[1:]), schedule)
        if key not in found:
            model = ModelSpec(name.replace("hf_", "hf/", 1), Path(plan.model.path), plan.model.size)
            found[key] = Repeated(model, key[1], schedule)
        found[key].draws.append(draw_of(plan, run))
    order = {s: i for i, s in enumerate(args.schedules)}
    return sorted(found.values(), key=lambda r: (r.model.name, r.ranks, order[r.schedule]))


def sweep(work: Path, specs: Sequence[ModelSpec], args: argparse.Namespace) -> list[Repeated]:
    """N rounds over every case, the cases taking turns within each round."""
    results = [Repeated(m, r, s) for m in specs if not m.skip for r in args.ranks for s in args.schedules]
    total = len(results) * args.repeats
    done = 0
    for k in range(args.repeats):
        for res in results:
            case = make_case(
                work, res.model, res.ranks, res.schedule, tag=f"_r{k + 1}", plan_options=plan_options(args)
            )
            run_case(case, args.steps, args.timeout)
            done += 1
            if case.error:
                res.errors.append(case.error)
                print(f"[{done}/{total}] {res.label} round {k + 1}: FAILED: {case.error}", flush=True)
                continue
            assert case.plan is not None and case.run is not None
            d = draw_of(case.plan, case.run)
            res.draws.append(d)
            e = pct(rel(d.predicted_s, d.measured_s))
            print(f"[{done}/{total}] {res.label} round {k + 1}: {d.split}, {e} ({case.seconds:.0f} s)", flush=True)
    return results


def mean_sd(xs: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    return statistics.mean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def error_of_means(pred: Sequence[float], meas: Sequence[float]) -> float | None:
    """(mean predicted - mean measured) / mean measured, in %."""
    return rel(statistics.mean(pred), statistics.mean(meas)) if pred and meas else None


def noise_of(pred: Sequence[float], meas: Sequence[float]) -> float | None:
    """Two standard errors of the error of the means, in % (from the draws' own spread)."""
    n = len(pred)
    if n < 2:
        return None
    (mp, sp), (mm, sm) = mean_sd(pred), mean_sd(meas)
    return 200 * math.sqrt((sp / mp) ** 2 + (sm / mm) ** 2) / math.sqrt(n)


def stage_errors(res: Repeated, field_name: str, planned: str = "stage_shared_s") -> list[float | None]:
    """Per stage, the error of the means of the planned compute (``planned``) against ``field_name`` of the run."""
    draws = res.modal()
    if not draws:
        return []
    out: list[float | None] = []
    for i in range(len(draws[0].stage_plan_s)):
        plan = [getattr(d, planned)[i] for d in draws]
        run = [getattr(d, field_name)[i] for d in draws]
        out.append(None if any(math.isnan(x) for x in run) else error_of_means(plan, run))
    return out


def case_rows(results: Sequence[Repeated]) -> list[list[str]]:
    """One row per case."""
    rows = []
    for r in results:
        if not r.draws:
            rows.append([r.model.name, str(r.ranks), r.schedule, "0", DASH, DASH, DASH, DASH, DASH, DASH, DASH])
            continue
        pred, meas = [d.predicted_s for d in r.draws], [d.measured_s for d in r.draws]
        (mp, sp), (mm, sm) = mean_sd(pred), mean_sd(meas)
        noise = noise_of(pred, meas)
        rows.append(
            [
                r.model.name,
                str(r.ranks),
                r.schedule,
                str(len(r.draws)),
                " / ".join(sorted(set(d.split for d in r.draws))),
                f"{ms(mp)} ± {100 * sp / mp:.0f}%",
                f"{ms(mm)} ± {100 * sm / mm:.0f}%",
                pct(error_of_means(pred, meas)),
                DASH if noise is None else f"±{noise:.1f}%",
                ", ".join(pct(rel(p, m)) for p, m in zip(pred, meas)),
                pct(mean_abs(stage_errors(r, "stage_run_s"))).lstrip("+"),
            ]
        )
    return rows


HEADERS = (
    "model",
    "ranks",
    "schedule",
    "rounds",
    "split(s)",
    "predicted ms (mean ± sd)",
    "measured ms (mean ± sd)",
    "error of the means",
    "its noise (2 SE)",
    "each round's error",
    "stage compute, error of the means (mean abs)",
)


@dataclass
class Summary:
    """The page's figures over the cases (the toy model apart: its blocks take microseconds)."""

    lines: list[str]
    rows: list[list[str]]
    headers: list[str]


def paired_errors(real: Sequence[Repeated], field_name: str) -> list[float | None]:
    """Per case, the error of the means of a re-prediction (``Draw.warm_s``, ``own_blocks_s``)
    against the same runs; None where a round has none (NaN: a kept sweep from before it)."""
    out: list[float | None] = []
    for r in real:
        again = [getattr(d, field_name) for d in r.draws]
        ok = all(math.isfinite(x) for x in again)
        out.append(error_of_means(again, [d.measured_s for d in r.draws]) if ok else None)
    return out


def _figures(real: Sequence[Repeated]) -> list[str]:
    """One column of the summary: the figures over ``real`` (cases that ran, toy apart)."""

    def fig(xs: Sequence[float | None]) -> str:
        m = mean_abs(xs)
        return DASH if m is None else f"{m:.1f}%"

    pairs = [([d.predicted_s for d in r.draws], [d.measured_s for d in r.draws]) for r in real]
    means = [error_of_means(p, m) for p, m in pairs]
    signed = [e for e in means if e is not None]
    # the same plans and runs, the plans re-predicted without cold starts (kept sweeps older than
    # cold starts have none to take away: NaN, a dash)
    warm = paired_errors(real, "warm_s")
    own = paired_errors(real, "own_blocks_s")
    return [
        fig(means),
        fig([max((abs(x) for x in signed), default=None)]),
        pct(statistics.mean(signed)) if signed else DASH,
        fig([rel(d.predicted_s, d.measured_s) for r in real for d in r.draws]),
        fig([noise_of(p, m) for p, m in pairs]),
        fig([e for r in real for e in stage_errors(r, "stage_run_s")]),
        fig([e for r in real for e in stage_errors(r, "stage_run_s", "stage_plan_s")]),
        fig([e for r in real for e in stage_errors(r, "stage_blocks_s")]),
        fig(warm),
        pct(statistics.mean(w)) if (w := [e for e in warm if e is not None]) else DASH,
        fig(own),
        pct(statistics.mean(o)) if (o := [e for e in own if e is not None]) else DASH,
        str(len(signed)),
    ]


SUMMARY_ROWS = (
    ("step, error of the means, mean abs", "<= 7%"),
    ("step, error of the means, max abs", "<= 12%"),
    ("step, error of the means, mean signed", ""),
    ("step, each round alone, mean abs", ""),
    ("noise left in an error of the means (2 SE), mean", ""),
    ("per-stage compute per action, error of the means, mean abs (plan stretched by shared cores)", "<= 10%"),
    ("the same, the plan's unshared fwd_s + bwd_s", ""),
    ("per-stage compute in the blocks only, error of the means, mean abs", ""),
    ("step, error of the means, the same plans without cold starts, mean abs", ""),
    ("the same, mean signed", ""),
    ("step, error of the means, the plans with the run's own block times, mean abs", ""),
    ("the same, mean signed", ""),
    ("cases", ""),
)


def summarize(results: Sequence[Repeated]) -> Summary:
    """Per rank count and over all: the errors of the means, each round's, the noise left, per-stage compute."""
    real = [r for r in results if r.draws and r.model.name != "toy"]
    ranks = sorted({r.ranks for r in real})
    columns = [_figures([r for r in real if r.ranks == k]) for k in ranks] + [_figures(real)]
    rows = [[name, *(c[i] for c in columns), target] for i, (name, target) in enumerate(SUMMARY_ROWS)]
    headers = ["figure", *(f"{k} ranks" for k in ranks), "all", "target"]
    lines = [f"{row[0]}: " + ", ".join(f"{h} {v}" for h, v in zip(headers[1:-1], row[1:-1])) for row in rows]
    return Summary(lines, rows, headers)


def rerun_options(args: argparse.Namespace) -> str:
    """The sweep's options that differ from the defaults, as typed."""
    words = []
    if args.ranks != [2]:
        words += ["--ranks", *map(str, args.ranks)]
    if args.repeats != 3:
        words += ["--repeats", str(args.repeats)]
    if args.steps != 8:
        words += ["--steps", str(args.steps)]
    if args.plan_repeats is not None:
        words += ["--plan-repeats", str(args.plan_repeats)]
    return "".join(" " + w for w in words)


def plan_options(args: argparse.Namespace) -> list[str]:
    """The extra `planner plan` options of the sweep (none for the defaults)."""
    return [] if args.plan_repeats is None else ["--repeats", str(args.plan_repeats)]


def when(seconds: float, load: str) -> str:
    """How long the sweep took and how busy the machine was (nothing when re-read from a kept folder)."""
    if math.isnan(seconds):
        return ", from the plans and runs of an earlier sweep (`--from`)"
    return f" in {seconds / 60:.1f} minutes; other processes used {load} of the CPU just before / after it"


PAGE = """# Cost model accuracy under the machine's noise: repeated, alternating rounds

Written by `{script}` on {today} ({machine}){when}. Rerun with
`{rerun}` (`--help` for the options).

**What was run.** {a.repeats} rounds; in each, every case below was planned afresh (`planner plan{options}`,
a new in-context profile, uncalibrated) and run (`planner run --steps {a.steps}`), the cases taking
turns, as `bench/cost_accuracy.py` does once (same batch, microbatches and seed). The split may differ
between rounds when the profiles do: every split chosen is listed.

**Figures.** Errors are (predicted - measured) / measured. The error of the means compares the mean of
the rounds' predicted steps with the mean of their measured steps; its noise (two standard errors,
from the spread of the rounds' predictions and measurements) is what it may still owe to the machine.
Per-stage compute, per action: the plan's `fwd_s + bwd_s` per microbatch against the run's
`forward_one_chunk + backward_one_chunk` medians; in the blocks: against the run's own block times
inside those actions, leaving out the runtime's work outside the blocks, which the plan charges with the
link's cost per message, not with the stage. Stage figures use the rounds that chose the most common split.
"Without cold starts": the same plans re-predicted as if no block started cold after a message
(`BlockCost.fwd_cold_s`, `bwd_cold_s` taken away), against the same runs, so the comparison owes nothing
to the machine's noise. "With the run's own block times": each plan re-predicted with every block's
forward and backward as its run timed them inside the stage, so that what is left is the error of the
schedule, message and optimizer model alone.
The toy model (blocks of microseconds: its step is the link's cost per message) is in the table but not in the summary.

## Per case

{cases}

## Summary (toy model aside)

{summary}
{failed}
(what the figures say: docs/prediction_accuracy.md)
"""


def page(
    args: argparse.Namespace,
    results: Sequence[Repeated],
    seconds: float,
    busy: tuple[float, float],
    options: Sequence[str] = (),
) -> str:
    """The markdown page; ``options``: the sweep's extra `planner plan` options, as run."""
    summary = summarize(results)
    load = " / ".join("?" if math.isnan(b) else f"{100 * b:.0f}%" for b in busy)
    failed = [f"{r.label}: {len(r.errors)} round(s) failed ({r.errors[0]})" for r in results if r.errors]
    return PAGE.format(
        script=SCRIPT,
        today=dt.date.today().isoformat(),
        machine=machine(),
        when=when(seconds, load),
        rerun=RERUN + rerun_options(args),
        a=args,
        options="".join(" " + w for w in options),
        cases=table(case_rows(results), HEADERS),
        summary=table(summary.rows, summary.headers),
        failed="" if not failed else "\nFailed rounds: " + "; ".join(failed) + "\n",
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=None, help="model names or file stems (default: all)")
    parser.add_argument("--ranks", nargs="+", type=int, default=[2], help="pipeline ranks (default: 2)")
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"], help="schedules (default: gpipe 1f1b)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds over every case (default 3)")
    parser.add_argument("--steps", type=int, default=8, help="steps per run (default 8)")
    parser.add_argument(
        "--plan-repeats", type=int, default=None, help="`planner plan --repeats N` (timed runs per block; default 5)"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per command before it is stopped")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (its path is printed)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the page to write")
    parser.add_argument(
        "--from",
        dest="kept",
        type=Path,
        nargs="+",
        default=None,
        help="write the page from kept folders (their rounds pooled), running nothing",
    )
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.steps < 3:
        parser.error("--repeats must be >= 1 and --steps >= 3")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the rounds and write the page."""
    args = parse_args(argv)
    t0 = time.perf_counter()
    if args.kept is not None:
        results = from_kept(args.kept, args)
        write_page(args.out, page(args, results, math.nan, (math.nan, math.nan)))
        print("\n".join(summarize(results).lines))
        print(f"wrote {args.out} from {', '.join(map(str, args.kept))}")
        return 0
    busy_before = background_cpu()
    work = Path(tempfile.mkdtemp(prefix="repeated_accuracy_"))
    try:
        specs = discover(work, args.models, bench_size=False)
        results = sweep(work, specs, args)
        busy = (busy_before, background_cpu())
        text = page(args, results, time.perf_counter() - t0, busy, plan_options(args))
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    write_page(args.out, text)
    print("\n".join(summarize(results).lines))
    print(f"wrote {args.out}; {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
