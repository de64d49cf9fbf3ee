"""How accurate the cost model is: predicted vs measured step time, stage compute, memory and block times.

For every model file (models/*.py, models/hf/*.py, bench/models/mlp_stack.py and heavy_middle.py) at
its tiny size, at 2 and 4 ranks, under GPipe and 1F1B, this script types what a user would type --
`planner plan` (measured profile on this CPU, uncalibrated) and `planner run` (gloo, one process per
rank) -- as subprocesses in a temporary folder holding a copy of the model files, reads the plan.json
and run.json they write and compares them: step time, per-stage forward/backward/optimizer/memory,
and per block the profiled time (in context, as the plan has it, and isolated: each block timed alone
in this process) against the time the block took inside the running pipeline, with the systematic
differences between profile and pipeline named and sized. Two
more experiments: a calibration carried over to another split (`--calibrate`, then the split moved
by one block), and whether the planner's split is the measured faster one against a near-equal
neighbour. Writes docs/cost_accuracy.md (and docs/cost_accuracy_blocks.csv, every block's figures).

    .venv/bin/python -m bench.cost_accuracy                          # everything (about 20-25 minutes on 2 idle cores)
    .venv/bin/python -m bench.cost_accuracy --quick                  # mlp_stack, 2 ranks, 1f1b: a smoke test
    .venv/bin/python -m bench.cost_accuracy --models toy mlp_stack --ranks 2
    .venv/bin/python -m bench.cost_accuracy --size-bench             # the bench models at their bench size

A command that fails becomes a failed row (its last error line) in the tables; the bench goes on.
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
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.accuracy_blocks import attach_isolated, block_section, systematic_section
from bench.accuracy_splits import (
    Context,
    CrossSplit,
    SplitChoice,
    cross_split_section,
    extras,
    progress,
    split_choice_section,
)
from bench.cases import (
    BENCH_MODELS,
    DASH,
    DEFAULT_MB_SAMPLES,
    Case,
    ModelSpec,
    discover,
    make_case,
    mean_abs,
    ms,
    ok_cases,
    pct,
    plan_split,
    rel,
    run_case,
    shared_compute,
)
from bench.common import (
    DOCS,
    ROOT,
    background_cpu,
    machine,
    table,
    write_page,
)

# This script runs the sweep and writes the page; the per-block comparison is bench.accuracy_blocks,
# the two experiments on a moved split bench.accuracy_splits.
SCRIPT = "bench/cost_accuracy.py"
RERUN = ".venv/bin/python -m bench.cost_accuracy"
BUSY_WARNING = 0.25  # above this share of the CPU used by others, the page says so
# (name, target %, how the achieved figure is read from the errors)
TARGETS: list[tuple[str, float]] = [
    ("step time, mean abs error", 7.0),
    ("step time, max abs error", 12.0),
    ("per-stage compute (fwd+bwd per microbatch), mean abs error", 10.0),
    ("peak memory per stage, mean abs error", 8.0),
    ("cross-split calibrated step time, max abs error (of the means over alternating pairs)", 5.0),
]


# --------------------------------------------------------------------------------------------------
# figures
# --------------------------------------------------------------------------------------------------
def mib(n: float | None) -> str:
    """MiB with one decimal, or a dash."""
    return DASH if n is None else f"{n / 2**20:.1f}"


@dataclass
class CaseErrors:
    """The errors of one finished case, in %."""

    step: float | None
    compute: list[float | None] = field(default_factory=list)
    memory: list[float | None] = field(default_factory=list)


def case_errors(case: Case) -> CaseErrors:
    """Step, per-stage compute (as shared cores stretch it) and per-stage memory errors of a finished case."""
    assert case.plan is not None and case.run is not None
    out = CaseErrors(rel(case.plan.prediction.step_time_s, case.run.median_step_s))
    for st, shared, m in zip(case.plan.stages, shared_compute(case.plan), case.run.stages):
        out.compute.append(rel(shared, m.fwd_s + m.bwd_s))
        out.memory.append(rel(st.memory_bytes, m.memory.peak_bytes if m.memory else None))
    return out


# --------------------------------------------------------------------------------------------------
# tables 1 and 2: step and stages
# --------------------------------------------------------------------------------------------------
def step_table(cases: Sequence[Case], skipped: Sequence[ModelSpec]) -> str:
    """Table 1: one row per case, failed cases with their error line, skipped models named."""
    rows = []
    for c in cases:
        head = [c.model.name, c.model.size or "default", str(c.ranks), c.schedule, f"{c.batch}/{c.microbatches}"]
        if c.error or c.plan is None or c.run is None:
            rows.append([*head, *[DASH] * 6, f"failed: {c.error}"])
            continue
        e = case_errors(c)
        pred, meas = c.plan.prediction.step_time_s, c.run.median_step_s
        cm, mm = mean_abs(e.compute), mean_abs(e.memory)
        rest = [ms(pred), ms(meas), pct(e.step), DASH if cm is None else f"{cm:.1f}%"]
        rows.append([*head, plan_split(c.plan), *rest, DASH if mm is None else f"{mm:.1f}%", "ok"])
    rows += [[m.name, DASH, DASH, DASH, DASH, *[DASH] * 6, f"skipped: {m.skip}"] for m in skipped]
    headers = ["model", "size", "ranks", "schedule", "batch/mb", "split", "predicted step ms"]
    headers += ["measured step ms", "step error", "mean abs stage compute error", "mean abs memory error", "status"]
    return table(rows, headers)


def stage_table(cases: Sequence[Case]) -> str:
    """Table 2: per stage, forward, backward, optimizer and memory, plan vs run."""
    rows = []
    for c in ok_cases(cases):
        assert c.plan is not None and c.run is not None
        for st, m in zip(c.plan.stages, c.run.stages):
            peak = m.memory.peak_bytes if m.memory else None
            rows.append(
                [c.model.name, str(c.ranks), c.schedule, str(st.index)]
                + [ms(st.fwd_s), ms(m.fwd_s), pct(rel(st.fwd_s, m.fwd_s))]
                + [ms(st.bwd_s), ms(m.bwd_s), pct(rel(st.bwd_s, m.bwd_s))]
                + [ms(st.opt_s), ms(m.optimizer_s), pct(rel(st.opt_s, m.optimizer_s))]
                + [mib(st.memory_bytes), mib(peak), pct(rel(st.memory_bytes, peak))]
            )
    headers = ["model", "ranks", "schedule", "stage", "fwd plan ms/mb", "fwd run", "err", "bwd plan ms/mb"]
    headers += ["bwd run", "err", "opt plan ms/step", "opt run", "err", "memory plan MiB", "memory run peak", "err"]
    return table(rows, headers)


def summary(cases: Sequence[Case], cross: Sequence[CrossSplit]) -> tuple[str, list[str]]:
    """The targets, the achieved figures and whether each is met; also one line per target for the console."""
    errs = [case_errors(c) for c in ok_cases(cases)]
    steps = [abs(e.step) for e in errs if e.step is not None]
    achieved: list[tuple[float | None, int]] = [
        (statistics.mean(steps) if steps else None, len(steps)),
        (max(steps) if steps else None, len(steps)),
        (mean_abs([x for e in errs for x in e.compute]), sum(x is not None for e in errs for x in e.compute)),
        (mean_abs([x for e in errs for x in e.memory]), sum(x is not None for e in errs for x in e.memory)),
    ]
    achieved.append(cross_achieved(cross))
    rows, lines = [], []
    for (name, target), (value, n) in zip(TARGETS, achieved):
        met = DASH if value is None else ("met" if value <= target else "not met")
        got = DASH if value is None else f"{value:.1f}%"
        rows.append([name, f"<= {target:.0f}%", got, str(n), met])
        lines.append(f"{name}: {got} (target <= {target:.0f}%, n={n}): {met}")
    return table(rows, ["figure", "target", "achieved", "n", "met"]), lines


def cross_achieved(cross: Sequence[CrossSplit]) -> tuple[float | None, int]:
    """The cross-split figure: the largest abs error of the means over alternating pairs, or of the
    single pair where no model has pairs; with how many models it covers."""
    paired = [abs(e[0]) for x in cross if (e := x.paired_err) is not None]
    if paired:
        return max(paired), len(paired)
    single = [abs(x.calibrated_err) for x in cross if x.calibrated_err is not None]
    return (max(single) if single else None), len(single)


# --------------------------------------------------------------------------------------------------
# the page
# --------------------------------------------------------------------------------------------------
def source_of(model: ModelSpec) -> str:
    """The model file's path in the repository (it ran from a copy)."""
    if model.name in BENCH_MODELS:
        return f"bench/models/{model.path.name}"
    return f"models/{model.name}.py"


def models_run(cases: Sequence[Case]) -> str:
    """The models of the sweep with their sizes, in words."""
    seen = {c.model.name: f"`{source_of(c.model)}` ({c.model.size or 'default size'})" for c in cases}
    return "Models (size): " + (", ".join(seen.values()) or "none")


def header(args: argparse.Namespace, cases: Sequence[Case], seconds: float, busy: tuple[float, float]) -> str:
    """Title, date, machine, what was run, how errors are defined, the targets."""
    per_case = statistics.mean(c.seconds for c in cases) if cases else 0.0
    load = " / ".join("?" if math.isnan(b) else f"{100 * b:.0f}%" for b in busy)
    return f"""# Cost model accuracy: predicted vs measured

Written by `{SCRIPT}` on {dt.date.today().isoformat()} ({machine()}). Rerun with
`{RERUN}` (`--help` for the options). The whole bench took {seconds / 60:.1f} minutes,
{per_case:.0f} s per case (plan + run) on average; other processes used {load} of the CPU just before /
after it (2-second samples of /proc/stat).

**What was run.** {models_run(cases)}, each at
{", ".join(map(str, args.ranks))} ranks under {", ".join(args.schedules)}:
`planner plan MODEL --size S --gpus R --schedule SCHED -b B -m M --seed 0` (per-block costs measured on
this CPU; no calibration), then `planner run PLAN --steps {args.steps} --no-checkpoint` (gloo, one process
per rank, cores // ranks threads each, at least 1: at 4 ranks the 2 processes per core share them).
After the sweep, each (model, ranks) is profiled once more in the bench process with every block timed
alone (the isolated profile the planner used before it timed blocks in context), for table 3.
M = 2 x ranks microbatches (every stage holds at least 2) of {args.mb_samples} samples each (ResNet-50: 4).

**Errors** are (predicted - measured) / measured.
- Step: the plan's `prediction.step_time_s` against the run's `median_step_s` (median over the timed
  steps: not the first, which sets the schedule up, nor the one run under the memory tracker).
- Per-stage compute: the stage's `fwd_s + bwd_s` per microbatch (sum of its profiled blocks) against the
  run's per-stage medians of `forward_one_chunk` + `backward_one_chunk` (the loss included on the last
  stage on both sides; communication waits excluded on both sides). With more ranks than cores the
  plan's figure is stretched as the simulator shares the cores (the mean stretch of the stage's
  simulated actions), since the run's action times include the waits for a core; the per-stage table
  below shows the plan's unshared figures.
- Optimizer: the stage's `opt_s` against the run's `optimizer_s` per step.
- Memory: the stage's `memory_bytes` against the peak MemTracker saw in one tracked step.

**Targets** (uncalibrated plans): step time <= 7 % mean absolute error and <= 12 % maximum; per-stage
compute (fwd + bwd per microbatch) <= 10 % mean absolute; peak memory <= 8 % mean absolute; after a
calibration carried to another split, step time <= 5 %.""" + busy_warning(busy)


def busy_warning(busy: tuple[float, float]) -> str:
    """A warning paragraph when other processes used much of the CPU around the bench ("" otherwise)."""
    busiest = max((b for b in busy if not math.isnan(b)), default=0.0)
    if busiest <= BUSY_WARNING:
        return ""
    return (
        f"\n\n**Measured on a busy machine:** other processes used up to {100 * busiest:.0f}% of its CPU around "
        "the bench, so the measured times here are longer and noisier, and the predictions further from them, "
        "than on an idle machine."
    )


def write_outputs(args: argparse.Namespace, result: BenchResult) -> list[str]:
    """Write the doc (and the block CSV); return the summary lines for the console."""
    csv_path = args.out.with_name(args.out.stem + "_blocks.csv")
    skipped = "(not run: --no-extras)" if args.no_extras else ""
    summary_text, lines = summary(result.cases, result.cross)
    try:
        csv_name = str(csv_path.relative_to(ROOT))
    except ValueError:
        csv_name = str(csv_path)
    sections = [
        header(args, result.cases, result.seconds, result.busy),
        "## Step time, per case",
        step_table(result.cases, result.skipped),
        "### Against the targets",
        summary_text,
        "## Per stage",
        "Per microbatch for forward and backward, per step for the optimizer; memory in MiB.",
        stage_table(result.cases),
        "## Where profile and pipeline diverge",
        "Per block: the profiled forward/backward against the same block timed inside the running stage "
        "(`run.stages[].blocks`); a ratio > 1 means the block is slower in the pipeline than profiled. Two "
        "profiles: in context (`plan.blocks`, what the planner uses: the whole model run as one stage, a timing "
        "mark between blocks, gradients accumulating) and isolated (each block cut out and timed alone, "
        "`profile_model(..., in_context=False)`, run once per (model, ranks) in the bench process after the "
        "sweep, at the plan's microbatch size, threads per rank, warmup and repeats). Ratios per case: the mean "
        "over blocks, and the time-weighted one (sum in-pipeline / sum profiled); on both sides the last block "
        "includes the loss. Overheads: "
        "per forward / backward action, the time outside every block (mean over the stages); loss: the run's "
        f"`loss_s` of the last stage and the profile's `loss_s` of the last block. Every block: `{csv_name}`.",
        block_section(result.cases, csv_path),
        "## Systematic differences, named and sized",
        "Each way the running pipeline differs from the profile, its size in this bench run (means over the "
        "cases that ran), the plan's figure for it, and whether the profile now accounts for it. Gaps are "
        "(profiled - in-pipeline) / in-pipeline, time-weighted over every block both have.",
        systematic_section(result.cases),
        "(analysis: see docs/prediction_accuracy.md)",
        "## Cross-split calibration",
        "Split A: the 2-rank 1f1b plan and its run (above). `planner plan ... --calibrate A.run.json` fits "
        "correction factors (per block where the run timed blocks, else per stage) and the link latency to "
        "that run; its plan is then forced to split B (one boundary "
        "moved by one block; figures re-derived with `planner.core.step.predict.refresh`), and B is run. 'In-process' "
        "re-derives B from A's own blocks with `apply_calibration` (the two agree when `--calibrate` reuses A's "
        "profile). Target: B calibrated within 5 %; the figure in the summary is the alternating pairs' "
        "error of the means (the second table), where the single pair's owes most to the machine's drift "
        "between two runs minutes apart.",
        skipped or cross_split_section(result.cross),
        "## Split choice",
        skipped or split_choice_section(result.choice),
        "## What the figures say",
        "(analysis: see docs/prediction_accuracy.md)",
    ]
    write_page(args.out, "\n\n".join(sections).rstrip() + "\n")
    return lines


# --------------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------------
@dataclass
class BenchResult:
    """Everything the page is written from."""

    cases: list[Case]
    skipped: list[ModelSpec]
    cross: list[CrossSplit]
    choice: SplitChoice | None
    seconds: float
    busy: tuple[float, float]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", help="model names or file stems (gpt, hf/gpt2, mlp_stack; llama: both)")
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 4], help="pipeline ranks (default: 2 4)")
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"], help="schedules (default: gpipe 1f1b)")
    parser.add_argument("--steps", type=int, default=8, help="steps per run (the first is warm-up; default 8)")
    parser.add_argument(
        "--pairs", type=int, default=5, help="A/B pairs of the split-choice and of each cross-split run (default 5)"
    )
    parser.add_argument("--size-bench", action="store_true", help="the bench models at their `bench` size")
    parser.add_argument(
        "--mb-samples", type=int, default=DEFAULT_MB_SAMPLES, help="samples per microbatch (ResNet: 4; default 8)"
    )
    parser.add_argument("--no-extras", action="store_true", help="skip the cross-split and split-choice runs")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per command before it is stopped")
    parser.add_argument("--quick", action="store_true", help="mlp_stack, 2 ranks, 1f1b, 2 pairs: a smoke test")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (its path is printed)")
    parser.add_argument("--out", type=Path, default=DOCS / "cost_accuracy.md")
    args = parser.parse_args(argv)
    if args.quick:
        args.models = args.models or ["mlp_stack"]
        args.ranks, args.schedules, args.pairs = [2], ["1f1b"], min(args.pairs, 2)
    return args


def sweep(work: Path, specs: Sequence[ModelSpec], args: argparse.Namespace) -> list[Case]:
    """Plan and run every (model, ranks, schedule), one printed line per case; then the isolated profiles."""
    todo = [
        make_case(work, m, r, s, mb_samples=args.mb_samples)
        for m in specs
        if not m.skip
        for r in args.ranks
        for s in args.schedules
    ]
    for i, case in enumerate(todo, start=1):
        progress(i, len(todo), run_case(case, args.steps, args.timeout))
    attach_isolated(todo)
    return todo


def main(argv: Sequence[str] | None = None) -> int:
    """Run the bench and write the page; 1 if any case failed."""
    args = parse_args(argv)
    t0 = time.perf_counter()
    busy_before = background_cpu()
    work = Path(tempfile.mkdtemp(prefix="cost_accuracy_"))
    try:
        specs = discover(work, args.models, args.size_bench)
        for m in specs:
            if m.skip:
                print(f"skipping {m.name}: {m.skip}", flush=True)
        cases = sweep(work, specs, args)
        models = {m.name: m for m in specs if not m.skip}
        ctx = Context(work, cases, models, args.steps, args.timeout, args.pairs, args.mb_samples)
        cross, choice = extras(ctx, not args.no_extras)
        busy = (busy_before, background_cpu())
        result = BenchResult(cases, [m for m in specs if m.skip], cross, choice, time.perf_counter() - t0, busy)
        lines = write_outputs(args, result)
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print("\n".join(lines))
    failed = [c.label for c in cases if c.error]
    print(f"wrote {args.out}; {time.perf_counter() - t0:.0f} s; failed: {', '.join(failed) or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
