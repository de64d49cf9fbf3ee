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
import csv
import datetime as dt
import io
import math
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.cases import (
    BENCH_MODELS,
    DASH,
    DEFAULT_MB_SAMPLES,
    Case,
    Isolated,
    ModelSpec,
    discover,
    make_case,
    mean_abs,
    ms,
    pct,
    plan_argv,
    plan_split,
    rel,
    run_case,
    shared_compute,
    split_of,
)
from bench.common import (
    DOCS,
    ROOT,
    background_cpu,
    last_line,
    machine,
    planner_command,
    run_path_of,
    run_plan_file,
    table,
    write_page,
)
from planner.capture.load import load_model_file
from planner.core.step.calibrate import apply_calibration, calibrate
from planner.core.step.predict import block_times_in_stages, predict_plan, refresh, stage_waits
from planner.errors import PlannerError
from planner.schema.plan import Plan
from planner.schema.result import RunResult

SCRIPT = "bench/cost_accuracy.py"
RERUN = ".venv/bin/python -m bench.cost_accuracy"
CROSS_SPLIT_MODELS = ("mlp_stack", "gpt")
SPLIT_CHOICE_MODELS = ("heavy_middle", "mlp_stack")
BUSY_WARNING = 0.25  # above this share of the CPU used by others, the page says so
NEAR = 0.10  # "two splits predicted within 10 % of each other"
# (name, target %, how the achieved figure is read from the errors)
TARGETS: list[tuple[str, float]] = [
    ("step time, mean abs error", 7.0),
    ("step time, max abs error", 12.0),
    ("per-stage compute (fwd+bwd per microbatch), mean abs error", 10.0),
    ("peak memory per stage, mean abs error", 8.0),
    ("cross-split calibrated step time, max abs error (of the means over alternating pairs)", 5.0),
]


# --------------------------------------------------------------------------------------------------
# the isolated profile
# --------------------------------------------------------------------------------------------------
def isolated_profile(case: Case) -> Isolated:
    """Every block of a case's model timed alone (`profile_model(..., in_context=False)`), in this process.

    Mirrors `planner.api.measured_costs` on the CPU: the plan's seed, microbatch size, threads per
    rank, warmup, repeats, autocast and compile. No optimizer: only the forward and backward are used.
    """
    from planner.capture.trace import trace_model
    from planner.costs.measure import profile_model
    from planner.costs.settings import ProfileSettings, Sample

    plan = case.plan
    assert plan is not None
    mf = load_model_file(case.model.path, case.model.size)
    model = mf.build(seed=plan.model.seed)
    inputs, target = mf.batch(plan.microbatch_size, seed=plan.model.seed)
    traced = trace_model(model, inputs)
    settings = ProfileSettings(
        warmup=plan.profile.warmup,
        repeats=plan.profile.repeats,
        threads=plan.profile.threads,
        progress=False,
        autocast=plan.profile.autocast,
        compile=plan.compile,
    )
    profile = profile_model(traced, Sample(inputs, target, mf.loss_fn), settings, in_context=False)
    return {b.name: (b.fwd_s, b.bwd_s) for b in profile.costs}


def attach_isolated(cases: Sequence[Case]) -> None:
    """Profile every planned (model, ranks) once with blocks timed alone; give it to each of its cases.

    Runs after the sweep, so nothing else of the bench runs meanwhile. The plans of one (model,
    ranks) share their microbatch size and threads (cores // ranks), whatever the schedule.
    """
    done: dict[tuple[str, int], tuple[Isolated | None, str]] = {}
    for case in cases:
        if case.plan is None:
            continue
        key = (case.model.name, case.ranks)
        if key not in done:
            t0 = time.perf_counter()
            try:
                done[key] = (isolated_profile(case), "")
            except Exception as exc:  # noqa: BLE001 - a failed profile is named on the page, not fatal
                done[key] = (None, f"{type(exc).__name__}: {last_line(str(exc))}")
            status = f"failed: {done[key][1]}" if done[key][1] else "ok"
            print(f"isolated profile {case.model.name} p={case.ranks}: {status} ({time.perf_counter() - t0:.0f} s)")
        case.isolated, case.isolated_error = done[key]


def progress(i: int, n: int, case: Case) -> None:
    """One printed line per finished case."""
    if case.error:
        status = f"FAILED: {case.error}"
    else:
        assert case.plan is not None and case.run is not None
        pred, meas = case.plan.prediction.step_time_s, case.run.median_step_s
        status = f"predicted {pred * 1e3:.1f} ms, measured {meas * 1e3:.1f} ms ({pct(rel(pred, meas))})"
    where = f"[{i}/{n}]" if n else "[extra]"
    print(f"{where} {case.label}: {status} ({case.seconds:.0f} s)", flush=True)


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


def ok_cases(cases: Sequence[Case]) -> list[Case]:
    """The cases that planned and ran."""
    return [c for c in cases if c.plan is not None and c.run is not None and not c.error]


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
# table 3: profile vs pipeline, per block
# --------------------------------------------------------------------------------------------------
BLOCK_CSV_HEADERS = ["model", "ranks", "schedule", "stage", "block", "has_loss", "profiled_fwd_ms"]
BLOCK_CSV_HEADERS += ["pipeline_fwd_ms", "fwd_ratio", "profiled_bwd_ms", "pipeline_bwd_ms", "bwd_ratio"]
BLOCK_CSV_HEADERS += ["isolated_fwd_ms", "fwd_ratio_isolated", "isolated_bwd_ms", "bwd_ratio_isolated"]
BLOCK_CSV_HEADERS += ["fwd_where", "bwd_where", "fwd_cold_ms", "bwd_cold_ms"]
# where a block runs in its stage, forward and backward (the block_positions table)
WAITS = "starts its stage's action after a message"
MODEL_END = "the model's first (fwd) / last (bwd) block"
INSIDE = "follows another block"


@dataclass(frozen=True)
class BlockPair:
    """One block's profiled cost (in context, and alone) and its time inside the running stage, per microbatch."""

    stage: int
    name: str
    has_loss: bool  # the profile's figures include the loss (the last block)
    profiled_fwd: float  # the plan's: timed in context
    pipeline_fwd: float
    profiled_bwd: float
    pipeline_bwd: float
    isolated_fwd: float | None = None  # timed alone (None: no isolated profile)
    isolated_bwd: float | None = None
    fwd_where: str = INSIDE  # WAITS, MODEL_END or INSIDE
    bwd_where: str = INSIDE
    fwd_cold: float = 0.0  # of profiled_fwd: the cold start the plan adds where the block waits
    bwd_cold: float = 0.0


def ratio(a: float, b: float) -> float | None:
    """a / b, None when b is 0."""
    return a / b if b > 0 else None


def fmt_ratio(x: float | None) -> str:
    """A ratio with three decimals, or a dash."""
    return DASH if x is None else f"{x:.3f}"


def block_pairs(case: Case) -> list[BlockPair]:
    """Every block the run timed, next to its profiled cost (and its isolated one, where there is one),
    with where it runs in its stage."""
    assert case.plan is not None and case.run is not None
    plan = case.plan
    # where the plan's split has a block start an action after a message, its cold start is added
    planned = block_times_in_stages(plan.blocks, plan.stages)
    index = {b.name: k for k, b in enumerate(plan.blocks)}
    alone = case.isolated or {}
    out = []
    for i, (st, m) in enumerate(zip(plan.stages, case.run.stages)):
        waits_in, waits_out = stage_waits(plan.stages, i)
        for tb in getattr(m, "blocks", None) or []:
            k = index.get(tb.name)
            if k is None:
                continue
            b, (f, w) = plan.blocks[k], planned[k]
            iso_f, iso_b = alone.get(tb.name, (None, None))
            fwd_where = MODEL_END if k == 0 else WAITS if k == st.start and waits_in else INSIDE
            last = k == len(plan.blocks) - 1
            bwd_where = MODEL_END if last else WAITS if k == st.end - 1 and waits_out else INSIDE
            out.append(
                BlockPair(
                    stage=m.stage,
                    name=tb.name,
                    has_loss=b.loss_s is not None,
                    profiled_fwd=f,
                    pipeline_fwd=tb.fwd_s,
                    profiled_bwd=w,
                    pipeline_bwd=tb.bwd_s,
                    isolated_fwd=iso_f,
                    isolated_bwd=iso_b,
                    fwd_where=fwd_where,
                    bwd_where=bwd_where,
                    fwd_cold=f - b.fwd_s,
                    bwd_cold=w - b.bwd_s,
                )
            )
    return out


def ms4(seconds: float | None) -> str:
    """Milliseconds with four decimals (the CSV), or empty."""
    return "" if seconds is None else f"{seconds * 1e3:.4f}"


def csv_rows(case: Case, pairs: Sequence[BlockPair]) -> list[list[str]]:
    """The CSV rows of a case's blocks (milliseconds; ratios are in-pipeline / profiled or / isolated)."""
    rows = []
    for p in pairs:
        iso_fwd = None if p.isolated_fwd is None else ratio(p.pipeline_fwd, p.isolated_fwd)
        iso_bwd = None if p.isolated_bwd is None else ratio(p.pipeline_bwd, p.isolated_bwd)
        rows.append(
            [case.model.name, str(case.ranks), case.schedule, str(p.stage), p.name, str(p.has_loss)]
            + [ms4(p.profiled_fwd), ms4(p.pipeline_fwd), fmt_ratio(ratio(p.pipeline_fwd, p.profiled_fwd))]
            + [ms4(p.profiled_bwd), ms4(p.pipeline_bwd), fmt_ratio(ratio(p.pipeline_bwd, p.profiled_bwd))]
            + [ms4(p.isolated_fwd), "" if iso_fwd is None else fmt_ratio(iso_fwd)]
            + [ms4(p.isolated_bwd), "" if iso_bwd is None else fmt_ratio(iso_bwd)]
            + [p.fwd_where, p.bwd_where, ms4(p.fwd_cold), ms4(p.bwd_cold)]
        )
    return rows


def against(pairs: Sequence[BlockPair], side: str, ref: str) -> list[tuple[float, float]]:
    """(in-pipeline, reference) seconds of every block that has the reference.

    Args:
        pairs: the blocks.
        side: "fwd" or "bwd".
        ref: "profiled" (the plan's, in context) or "isolated" (timed alone).
    """
    out = []
    for p in pairs:
        reference = getattr(p, f"{ref}_{side}")
        if reference is not None:
            out.append((float(getattr(p, f"pipeline_{side}")), float(reference)))
    return out


def mean_ratio(xy: Sequence[tuple[float, float]]) -> str:
    """Mean over blocks of in-pipeline / reference, or a dash."""
    xs = [r for x, y in xy if (r := ratio(x, y)) is not None]
    return DASH if not xs else f"{statistics.mean(xs):.3f}"


def weighted_ratio(xy: Sequence[tuple[float, float]]) -> str:
    """Sum in-pipeline / sum reference, or a dash."""
    return DASH if not xy else fmt_ratio(ratio(sum(x for x, _ in xy), sum(y for _, y in xy)))


def block_summary(case: Case, pairs: Sequence[BlockPair]) -> list[str]:
    """Table 3's row of a case: in-pipeline / in-context and / isolated ratios, overheads, loss."""
    assert case.plan is not None and case.run is not None
    ratios = []
    for side in ("fwd", "bwd"):  # both sides count the loss in the last block (forward and backward)
        for ref in ("profiled", "isolated"):
            xy = against(pairs, side, ref)
            ratios += [mean_ratio(xy), weighted_ratio(xy)]
    stages = case.run.stages
    return [case.model.name, str(case.ranks), case.schedule, f"{len(pairs)}/{len(case.plan.blocks)}"] + [
        *ratios,
        ms(statistics.mean(getattr(s, "fwd_overhead_s", 0.0) for s in stages)),
        ms(statistics.mean(getattr(s, "bwd_overhead_s", 0.0) for s in stages)),
        ms(stages[-1].loss_s),
        ms(case.plan.blocks[-1].loss_s),
    ]


def block_positions(pairs: Sequence[BlockPair], ranks: int) -> list[list[str]]:
    """Rows of the by-position table at ``ranks``: per side and position, time-weighted in-pipeline /
    profiled, with the plan's cold starts and without them."""
    rows = []
    for side in ("fwd", "bwd"):
        for where in (WAITS, MODEL_END, INSIDE):
            group = [p for p in pairs if getattr(p, f"{side}_where") == where]
            if not group:
                continue
            run = sum(getattr(p, f"pipeline_{side}") for p in group)
            with_cold = sum(getattr(p, f"profiled_{side}") for p in group)
            cold = sum(getattr(p, f"{side}_cold") for p in group)
            rows.append(
                [str(ranks), side, where, str(len(group)), f"{1e3 * run:.1f}", fmt_ratio(ratio(run, with_cold))]
                + [fmt_ratio(ratio(run, with_cold - cold)), f"{1e3 * cold / len(group):.3f}"]
            )
    return rows


POSITION_HEADERS = ["ranks", "side", "the block", "blocks", "in-pipeline ms (sum)", "pipeline/plan"]
POSITION_HEADERS += ["pipeline/plan without cold starts", "cold start ms per block (mean)"]


def block_section(cases: Sequence[Case], csv_path: Path) -> str:
    """Table 3 (one row per case with block times) and the per-block CSV next to the doc."""
    all_rows, summary_rows, without = [], [], []
    by_ranks: dict[int, list[BlockPair]] = {}
    for c in ok_cases(cases):
        pairs = block_pairs(c)
        if not pairs:
            without.append(c.label)
            continue
        all_rows += csv_rows(c, pairs)
        summary_rows.append(block_summary(c, pairs))
        if c.model.name != "toy":  # blocks of microseconds: their ratios are the clock's resolution
            by_ranks.setdefault(c.ranks, []).extend(pairs)
    out = io.StringIO(newline="")
    writer = csv.writer(out)
    writer.writerow(BLOCK_CSV_HEADERS)
    writer.writerows(all_rows)
    write_page(csv_path, out.getvalue())
    headers = ["model", "ranks", "schedule", "blocks compared"]
    for side in ("fwd", "bwd"):
        headers += [f"{side} pipeline/in-context (mean)", f"{side} pipeline/in-context (time-weighted)"]
        headers += [f"{side} pipeline/isolated (mean)", f"{side} pipeline/isolated (time-weighted)"]
    headers += ["fwd overhead ms/action", "bwd overhead ms/action", "loss run ms/mb (fwd)", "loss profiled ms/mb (fwd)"]
    text = table(summary_rows, headers) if summary_rows else "(no run.json held per-block times)"
    positions = [row for r in sorted(by_ranks) for row in block_positions(by_ranks[r], r)]
    if positions:
        text += (
            "\n\nBy where a block runs in its stage (toy model aside), time-weighted: a block that starts its "
            "stage's forward after receiving activations, or its backward after receiving their gradient, "
            "runs cold, and the plan adds its measured cold start (`BlockCost.fwd_cold_s`, `bwd_cold_s`); "
            "the model's first block's forward and its last block's backward (with the loss) follow other "
            "work and never wait.\n\n" + table(positions, POSITION_HEADERS)
        )
    if without:
        text += f"\n\nNo per-block times in the run.json of: {', '.join(without)}."
    failed = sorted({f"{c.model.name} p={c.ranks}: {c.isolated_error}" for c in ok_cases(cases) if c.isolated_error})
    if failed:
        text += "\n\nNo isolated profile (its columns are dashes) for: " + "; ".join(failed) + "."
    return text


# --------------------------------------------------------------------------------------------------
# systematic differences, named and sized
# --------------------------------------------------------------------------------------------------
def mean_of(xs: Iterable[float | None]) -> float | None:
    """Mean of the values that exist, None when none does."""
    vals = [x for x in xs if x is not None]
    return statistics.mean(vals) if vals else None


def share(part: float | None, whole: float | None) -> str:
    """`part` as an unsigned percentage of `whole`, or a dash."""
    if part is None or whole is None or whole <= 0:
        return DASH
    return f"{100 * part / whole:.1f}%"


def gap(xy: Sequence[tuple[float, float]]) -> float | None:
    """Time-weighted (sum reference / sum in-pipeline - 1) in %, None without blocks."""
    r = ratio(sum(y for _, y in xy), sum(x for x, _ in xy))
    return None if r is None else 100 * (r - 1)


def alone_row(cases: Sequence[Case]) -> list[str]:
    """Blocks timed alone vs back to back in a stage: the isolated and in-context gaps to the pipeline."""
    pairs = [p for c in cases for p in block_pairs(c) if p.isolated_fwd is not None]
    name = "blocks alone vs back to back in a stage (allocator, accumulating gradients, caches)"
    if not pairs:
        return [name, "no isolated profile or no block times", DASH, DASH]
    iso = {side: gap(against(pairs, side, "isolated")) for side in ("fwd", "bwd")}
    ctx = {side: gap(against(pairs, side, "profiled")) for side in ("fwd", "bwd")}
    size = f"isolated vs in-pipeline, time-weighted over {len(pairs)} blocks: fwd {pct(iso['fwd'])}, "
    size += f"bwd {pct(iso['bwd'])}"
    plan = f"in-context vs in-pipeline: fwd {pct(ctx['fwd'])}, bwd {pct(ctx['bwd'])}"
    closer = all(abs(ctx[s] or 0.0) <= abs(iso[s] or 0.0) for s in ("fwd", "bwd"))
    if closer:
        verdict = "yes: the plan's blocks are timed in context (what is left: the plan column)"
    else:
        verdict = "in part: the plan's blocks are timed in context, yet not closer to the pipeline on both sides"
    return [name, size, plan, verdict]


def loss_row(cases: Sequence[Case]) -> list[str]:
    """The loss on the last stage: the run's loss_s per microbatch against the plan's last-block loss_s."""
    last = [c.run.stages[-1] for c in cases if c.run is not None]
    run_loss = mean_of(s.loss_s for s in last)
    of_fwd = mean_of(s.loss_s / s.fwd_s if s.fwd_s > 0 else None for s in last)
    plan_loss = mean_of(c.plan.blocks[-1].loss_s for c in cases if c.plan is not None)
    size = f"run loss_s {ms(run_loss)} ms/mb (mean over {len(last)} cases), "
    size += DASH if of_fwd is None else f"{100 * of_fwd:.1f}% of the last stage's fwd"
    plan = f"last block loss_s {ms(plan_loss)} ms/mb"
    plan += "" if plan_loss is None else f" ({pct(rel(plan_loss, run_loss))} vs the run)"
    if plan_loss is None:
        verdict = "no: the plan's last block has no loss_s"
    else:
        verdict = "yes: inside the last block's fwd and bwd (timed apart in context, added to them)"
    return ["the loss on the last stage", size, plan, verdict]


def overhead_row(cases: Sequence[Case]) -> list[str]:
    """The runtime's time per action outside the blocks, and whatever the plan's stages add beyond
    their blocks (as the split runs them: their cold starts included)."""
    fwd_ov, bwd_ov, of_compute, extra_fwd, extra_bwd = [], [], [], [], []
    for c in cases:
        assert c.plan is not None and c.run is not None
        planned = block_times_in_stages(c.plan.blocks, c.plan.stages)
        for st, m in zip(c.plan.stages, c.run.stages):
            blocks = planned[st.start : st.end]
            extra_fwd.append(st.fwd_s - sum(f for f, _ in blocks))
            if not st.recompute:  # a recomputing stage's bwd_s adds the forward again
                extra_bwd.append(st.bwd_s - sum(b for _, b in blocks))
            if not m.blocks:  # the run did not time its blocks: no overhead figure
                continue
            fwd_ov.append(m.fwd_overhead_s)
            bwd_ov.append(m.bwd_overhead_s)
            compute = m.fwd_s + m.bwd_s
            of_compute.append((m.fwd_overhead_s + m.bwd_overhead_s) / compute if compute > 0 else None)
    f, b, s = mean_of(fwd_ov), mean_of(bwd_ov), mean_of(of_compute)
    size = f"fwd {ms(f)} ms + bwd {ms(b)} ms per action (mean over {len(fwd_ov)} stages), "
    size += DASH if s is None else f"{100 * s:.1f}% of the stage's compute (fwd+bwd) per microbatch"
    ef, eb = mean_of(extra_fwd), mean_of(extra_bwd)
    plan = f"stage fwd_s / bwd_s beyond its blocks and their cold starts: {ms(ef)} / {ms(eb)} ms"
    added = max(abs(ef or 0.0), abs(eb or 0.0)) > 1e-6
    verdict = (
        "yes: the plan's stages add it"
        if added
        else "in the link, not the stage: each message's fixed cost (latency_s) carries it (docs/runtime_link.md)"
    )
    return ["the runtime's cost per action (outside the blocks)", size, plan, verdict]


def grad_row(cases: Sequence[Case]) -> list[str]:
    """The per-step passes over the gradients before the optimizer: the plan's grad_s (the run has no timer)."""
    per_case = [(sum(st.grad_s for st in c.plan.stages), c) for c in cases if c.plan is not None]
    total = mean_of(g for g, _ in per_case)
    of_step = mean_of(g / c.run.median_step_s for g, c in per_case if c.run is not None and c.run.median_step_s > 0)
    clip = mean_of(m.clip_s for _, c in per_case if c.run is not None for m in c.run.stages)
    size = (
        "not timed apart in the run: the passes are inside its step (for scale, the run's clip_s, norm + "
        f"all-reduce + clip with the waits for other ranks, is {ms(clip)} ms per stage)"
    )
    plan = f"stage grad_s summed over stages: {ms(total)} ms/step (mean over {len(per_case)} cases), "
    plan += DASH if of_step is None else f"{100 * of_step:.1f}% of the measured step"
    verdict = "yes: in the predicted step, before the optimizer" if total else "no: the plan's grad_s is 0"
    return ["per-step gradient passes before the optimizer", size, plan, verdict]


def optimizer_row(cases: Sequence[Case]) -> list[str]:
    """The optimizer per parameter group: per-stage plan opt_s against the run's optimizer_s."""
    pairs = [
        (st.opt_s, m.optimizer_s)
        for c in cases
        if c.plan is not None and c.run is not None
        for st, m in zip(c.plan.stages, c.run.stages)
    ]
    errs = [rel(p, r) for p, r in pairs]
    signed = mean_of(errs)
    size = f"run optimizer_s {ms(mean_of(r for _, r in pairs))} ms/step per stage (mean over {len(pairs)} stages)"
    plan = f"opt_s {ms(mean_of(p for p, _ in pairs))} ms; error mean abs "
    plan += f"{DASH if (a := mean_abs(errs)) is None else f'{a:.1f}%'}, mean signed {pct(signed)}"
    timed = any(p > 0 for p, _ in pairs)
    verdict = "yes: each block's step timed on its own tensors, round-robin" if timed else "no: opt_s is 0"
    return ["optimizer per parameter group", size, plan, verdict]


def p2p_row(cases: Sequence[Case]) -> list[str]:
    """Point-to-point and waiting: the run's p2p_s per step against the schedule's predicted idle and transfers."""
    run_share, run_s, plan_share = [], [], []
    for c in cases:
        assert c.plan is not None and c.run is not None
        pred = c.plan.prediction
        for st, m in zip(c.plan.stages, c.run.stages):
            run_s.append(m.p2p_s)
            run_share.append(m.p2p_s / m.step_s if m.step_s > 0 else None)
            idle = pred.pipeline_time_s - c.plan.n_microbatches * (st.fwd_s + st.bwd_s)
            plan_share.append(idle / pred.step_time_s if pred.step_time_s > 0 else None)
    r, p = mean_of(run_share), mean_of(plan_share)
    size = f"run p2p_s {ms(mean_of(run_s))} ms/step per stage, "
    size += DASH if r is None else f"{100 * r:.1f}% of the rank's step"
    plan = "pipeline makespan - microbatches x stage (fwd+bwd): "
    plan += DASH if p is None else f"{100 * p:.1f}% of the predicted step"
    verdict = "yes, simulated: the schedule's bubble and the link's cost per message (comm_s)"
    return ["point-to-point and waiting", size, plan, verdict]


def systematic_section(cases: Sequence[Case]) -> str:
    """One row per named difference between profile and pipeline, sized in this run."""
    done = ok_cases(cases)
    if not done:
        return "(no case planned and ran)"
    rows = [alone_row(done), loss_row(done), overhead_row(done), grad_row(done), optimizer_row(done)]
    rows.append(p2p_row(done))
    headers = ["difference", "size measured in this run", "the plan's figure", "the profile accounts for it"]
    return table(rows, headers)


# --------------------------------------------------------------------------------------------------
# moving a split
# --------------------------------------------------------------------------------------------------
def with_starts(plan: Plan, starts: Sequence[int]) -> Plan:
    """The plan split at `starts` instead, every figure re-derived from its blocks (`refresh`)."""
    stages = [s.model_copy(update={"start": a}) for s, a in zip(plan.stages, starts)]
    return refresh(plan.model_copy(update={"stages": stages}))[0]


def moved_splits(plan: Plan, shifts: Sequence[int] = (1, -1, 2, -2)) -> list[tuple[int, ...]]:
    """The plan's split with one boundary moved by each of `shifts` blocks, where the cuts are legal."""
    base = [s.start for s in plan.stages]
    n = len(plan.blocks)
    out: list[tuple[int, ...]] = []
    for shift in shifts:
        for i in range(1, len(base)):
            starts = list(base)
            starts[i] += shift
            increasing = all(a < b for a, b in zip(starts, starts[1:])) and starts[-1] < n
            if increasing and all(plan.blocks[a - 1].cut_legal for a in starts[1:]) and tuple(starts) not in out:
                out.append(tuple(starts))
    return out


def predicted_step(plan: Plan, starts: Sequence[int]) -> float | None:
    """The plan's predicted step time at another split (None: that split cannot be evaluated)."""
    recompute = [s.recompute for s in plan.stages]
    try:
        return predict_plan(plan, starts, recompute)[1].step_time_s
    except PlannerError:
        return None


def base_case(ctx: Context, model: ModelSpec) -> Case:
    """The model's 2-rank 1F1B case from the sweep, or planned and run now."""
    for case in [*ctx.cases, *ctx.extra_cases]:
        if (case.model.name, case.ranks, case.schedule) == (model.name, 2, "1f1b"):
            return case
    case = run_case(make_case(ctx.work, model, 2, "1f1b", mb_samples=ctx.mb_samples), ctx.steps, ctx.timeout_s)
    ctx.extra_cases.append(case)
    progress(0, 0, case)
    return case


@dataclass
class Context:
    """What the extra experiments need from the sweep."""

    work: Path
    cases: list[Case]
    models: dict[str, ModelSpec]
    steps: int
    timeout_s: float
    pairs: int
    mb_samples: int  # samples per microbatch (--mb-samples)
    extra_cases: list[Case] = field(default_factory=list)  # base cases the sweep did not run


# --------------------------------------------------------------------------------------------------
# cross-split calibration
# --------------------------------------------------------------------------------------------------
@dataclass
class CrossSplit:
    """A calibration from split A's run, carried to split B and checked by running B."""

    model: str
    error: str = ""
    a_split: str = DASH
    a_measured: float | None = None
    a_recalibrated: float | None = None  # calibrate(A, run A).calibrated_step_s: the fit on A itself
    c_split: str = DASH  # the split `planner plan --calibrate` chose
    b_split: str = DASH
    b_uncalibrated: float | None = None
    b_calibrated: float | None = None  # the --calibrate plan, split forced to B
    b_in_process: float | None = None  # apply_calibration on A's blocks, predicted at B
    b_measured: float | None = None
    # alternating pairs run after it: (B predicted from calibrating on this pair's A run, B measured)
    pairs: list[tuple[float, float]] = field(default_factory=list)

    @property
    def paired_err(self) -> tuple[float, float] | None:
        """The error of the means over the pairs, %, and its noise (2 standard errors of the per-pair
        errors, as the split choice's); None with fewer than two pairs."""
        if len(self.pairs) < 2:
            return None
        errs = [100 * (p - m) / m for p, m in self.pairs]
        mean_pred = statistics.mean(p for p, _ in self.pairs)
        mean_meas = statistics.mean(m for _, m in self.pairs)
        return 100 * (mean_pred - mean_meas) / mean_meas, 2 * statistics.stdev(errs) / math.sqrt(len(errs))

    @property
    def uncalibrated_err(self) -> float | None:
        """B's uncalibrated prediction against its run, %."""
        return None if self.b_uncalibrated is None else rel(self.b_uncalibrated, self.b_measured)

    @property
    def calibrated_err(self) -> float | None:
        """B's calibrated prediction against its run, %."""
        return None if self.b_calibrated is None else rel(self.b_calibrated, self.b_measured)


def calibrated_plan(ctx: Context, a: Case) -> tuple[Plan | None, str]:
    """`planner plan ... --calibrate A.run.json` (same model, ranks, schedule, batch)."""
    c = make_case(ctx.work, a.model, a.ranks, a.schedule, tag="_calibrated", mb_samples=ctx.mb_samples)
    error = planner_command(plan_argv(c, "--calibrate", str(run_path_of(a.plan_path))), ctx.work, ctx.timeout_s)
    if error:
        return None, f"planner plan --calibrate: {error}"
    return Plan.load(c.plan_path), ""


def cross_split(ctx: Context, model: ModelSpec) -> CrossSplit:
    """Calibrate on A's run, force the split to B (A moved by one block), predict B, run B."""
    out = CrossSplit(model.name)
    try:
        return _cross_split(ctx, model, out)
    except PlannerError as exc:  # a calibration or split the planner refuses: named in the table
        out.error = f"{type(exc).__name__}: {last_line(str(exc))}"
        return out


def _cross_split(ctx: Context, model: ModelSpec, out: CrossSplit) -> CrossSplit:
    """`cross_split`'s steps, filling `out` as far as they get."""
    a = base_case(ctx, model)
    if a.error or a.plan is None or a.run is None:
        out.error = f"split A: {a.error}"
        return out
    out.a_split, out.a_measured = plan_split(a.plan), a.run.median_step_s
    cal = calibrate(a.plan, a.run)
    out.a_recalibrated = cal.calibrated_step_s
    c_plan, out.error = calibrated_plan(ctx, a)
    moves = moved_splits(a.plan)
    if c_plan is None or not moves:
        out.error = out.error or "no legal split next to A's"
        return out
    out.c_split = plan_split(c_plan)
    c_starts = tuple(st.start for st in c_plan.stages)
    starts = next((m for m in moves if m != c_starts), moves[0])  # a split neither run nor chosen
    n = len(a.plan.blocks)
    out.b_split = split_of(starts, n)
    out.b_uncalibrated = predicted_step(a.plan, starts)
    b_plan = with_starts(c_plan, starts)
    out.b_calibrated = b_plan.prediction.step_time_s
    blocks, link = apply_calibration(a.plan.blocks, a.plan.link, cal)
    recompute = [s.recompute for s in a.plan.stages]
    out.b_in_process = predict_plan(a.plan, starts, recompute, blocks=blocks, link=link)[1].step_time_s
    b_path = ctx.work / f"{model.name.replace('/', '_')}_split_b.json"
    b_plan.save(b_path)
    print(f"cross-split {model.name}: running split B {out.b_split} (A was {out.a_split})", flush=True)
    run, out.error = run_plan_file(b_path, run_path_of(b_path), ctx.steps, ctx.timeout_s)
    out.b_measured = run.median_step_s if run else None
    if run is not None:
        cross_pairs(ctx, a, starts, b_path, out)
    return out


def run_pair(ctx: Context, paths: Sequence[Path], tag: str) -> tuple[list[RunResult], str]:
    """`planner run` each plan file once, in order (one alternating pair, runs tagged ``tag``):
    the runs that finished, and the first error ("" when all did)."""
    runs: list[RunResult] = []
    for path in paths:
        run, error = run_plan_file(path, run_path_of(path, tag), ctx.steps, ctx.timeout_s)
        if run is None:
            return runs, error
        runs.append(run)
    return runs, ""


def cross_pairs(ctx: Context, a: Case, starts: Sequence[int], b_path: Path, out: CrossSplit) -> None:
    """Run A then B, `ctx.pairs` times; each pair calibrates on its own A run and predicts B.

    One A run long before one B run (the pair above) leaves the comparison to the machine's drift
    between them; adjacent runs share most of it, and the mean over pairs halves the rest with every
    fourfold more pairs (docs/machine_noise.md).
    """
    assert a.plan is not None
    recompute = [s.recompute for s in a.plan.stages]
    for i in range(1, ctx.pairs + 1):
        runs, error = run_pair(ctx, (a.plan_path, b_path), f"cross{i}")
        if error:
            out.error = f"pair {i}: {error}"
            return
        run_a, run_b = runs
        blocks, link = apply_calibration(a.plan.blocks, a.plan.link, calibrate(a.plan, run_a))
        predicted = predict_plan(a.plan, starts, recompute, blocks=blocks, link=link)[1].step_time_s
        out.pairs.append((predicted, run_b.median_step_s))
        print(
            f"cross-split {out.model}: pair {i}: B predicted {ms(predicted)} ms, measured {ms(run_b.median_step_s)} ms"
        )


def cross_split_section(results: Sequence[CrossSplit]) -> str:
    """The cross-split tables: the single pair as a user makes it, then the alternating pairs."""
    if not results:
        return "(not run: neither mlp_stack nor gpt was selected)"
    return "\n\n".join([cross_single_table(results), cross_pairs_table(results)])


def cross_pairs_table(results: Sequence[CrossSplit]) -> str:
    """Per model: the alternating pairs' mean predicted and measured B and the error of the means."""
    rows = []
    for r in results:
        err = r.paired_err
        preds, meas = [p for p, _ in r.pairs], [m for _, m in r.pairs]
        rows.append(
            [r.model, r.b_split, str(len(r.pairs))]
            + [ms(statistics.mean(preds)) if preds else DASH, ms(statistics.mean(meas)) if meas else DASH]
            + [", ".join(pct(rel(p, m)) for p, m in r.pairs) or DASH]
            + [DASH if err is None else pct(err[0]), DASH if err is None else f"±{err[1]:.1f}%"]
            + [DASH if err is None else ("yes" if abs(err[0]) <= 5 else "no")]
        )
    headers = ["model", "split B", "pairs", "B predicted ms (mean)", "B measured ms (mean)", "each pair's error"]
    headers += ["error of the means", "its noise (2 SE)", "<= 5%"]
    intro = (
        "Alternating pairs: A run, then B run, again and again; each pair calibrates on its own A run "
        "(`calibrate` + `apply_calibration`, what `--calibrate` does) and predicts B, so that the A run "
        "a calibration reads and the B run it is checked against share the machine's speed of the moment."
    )
    return intro + "\n\n" + table(rows, headers)


def cross_single_table(results: Sequence[CrossSplit]) -> str:
    """The single pair: A from the sweep, `planner plan --calibrate`, B run once."""
    rows = []
    for r in results:
        rows.append(
            [r.model, r.a_split, ms(r.a_measured), ms(r.a_recalibrated), r.c_split, r.b_split]
            + [ms(r.b_uncalibrated), ms(r.b_calibrated), ms(r.b_in_process), ms(r.b_measured)]
            + [pct(r.uncalibrated_err), pct(r.calibrated_err)]
            + [DASH if r.calibrated_err is None else ("yes" if abs(r.calibrated_err) <= 5 else "no")]
            + [f"failed: {r.error}" if r.error else "ok"]
        )
    headers = ["model", "split A", "A measured ms", "A re-predicted after calibration ms", "split --calibrate chose"]
    headers += ["split B (forced)", "B uncalibrated ms", "B calibrated ms", "B calibrated in-process ms"]
    headers += ["B measured ms", "B uncalibrated error", "B calibrated error", "<= 5%", "status"]
    return table(rows, headers)


# --------------------------------------------------------------------------------------------------
# split choice
# --------------------------------------------------------------------------------------------------
@dataclass
class SplitChoice:
    """The planner's split A against a near-equal neighbour B, run alternately."""

    model: str
    error: str = ""
    a_split: str = DASH
    b_split: str = DASH
    a_predicted: float | None = None
    b_predicted: float | None = None
    a_runs: list[float] = field(default_factory=list)
    b_runs: list[float] = field(default_factory=list)
    near: bool = True  # B predicted within NEAR of A


def neighbour(a: Case) -> tuple[tuple[int, ...], float, bool] | None:
    """The moved split with the prediction closest to A's (preferring one within NEAR); None if none."""
    assert a.plan is not None
    pa = a.plan.prediction.step_time_s
    scored = [(s, p) for s in moved_splits(a.plan) if (p := predicted_step(a.plan, s)) is not None]
    if not scored:
        return None
    starts, pb = min(scored, key=lambda sp: abs(sp[1] - pa))
    return starts, pb, abs(pb - pa) <= NEAR * pa


def split_choice(ctx: Context, model: ModelSpec) -> SplitChoice:
    """Run the planner's split and its neighbour alternately, `ctx.pairs` pairs."""
    out = SplitChoice(model.name)
    try:
        return _split_choice(ctx, model, out)
    except PlannerError as exc:  # a split the planner refuses: named on the page
        out.error = f"{type(exc).__name__}: {last_line(str(exc))}"
        return out


def _split_choice(ctx: Context, model: ModelSpec, out: SplitChoice) -> SplitChoice:
    """`split_choice`'s steps, filling `out` as far as they get."""
    a = base_case(ctx, model)
    if a.error or a.plan is None:
        out.error = f"split A: {a.error}"
        return out
    found = neighbour(a)
    if found is None:
        out.error = "no legal split next to the planner's"
        return out
    starts, out.b_predicted, out.near = found
    out.a_split, out.b_split = plan_split(a.plan), split_of(starts, len(a.plan.blocks))
    out.a_predicted = a.plan.prediction.step_time_s
    b_path = ctx.work / f"{model.name.replace('/', '_')}_choice_b.json"
    with_starts(a.plan, starts).save(b_path)
    for i in range(1, ctx.pairs + 1):
        runs, error = run_pair(ctx, (a.plan_path, b_path), f"pair{i}")
        for run, times in zip(runs, (out.a_runs, out.b_runs)):
            times.append(run.median_step_s)
        if error:
            out.error = f"pair {i}: {error}"
            return out
        print(f"split choice {model.name}: pair {i}: A {ms(out.a_runs[-1])} ms, B {ms(out.b_runs[-1])} ms", flush=True)
    return out


def choice_verdict(r: SplitChoice) -> str:
    """Whether A is measured faster, slower, or within the noise of the pair differences."""
    diffs = [100 * (b - a) / a for a, b in zip(r.a_runs, r.b_runs)]
    if len(diffs) < 2:
        return "too few pairs to tell the difference from the noise."
    mean = statistics.mean(diffs)
    noise = 2 * statistics.stdev(diffs) / math.sqrt(len(diffs))
    faster = sum(d > 0 for d in diffs)
    head = (
        f"Mean pair difference (B - A) / A: {mean:+.1f}%; noise: {noise:.1f}% (two standard errors of the "
        f"pair differences, 2 x stdev / sqrt({len(diffs)})). A was faster in {faster} of {len(diffs)} pairs. "
    )
    if mean > noise:
        return head + "**The planner's split is the measured faster one.**"
    if mean < -noise:
        return head + "**The neighbour is measured faster: the planner chose the slower split.**"
    return head + "**The two are within the noise of each other: the choice cannot be told apart from B.**"


def split_choice_section(r: SplitChoice | None) -> str:
    """The split-choice table and verdict."""
    if r is None:
        return "(not run: neither heavy_middle nor mlp_stack was selected)"
    if not r.a_runs or not r.b_runs:
        return f"{r.model}: failed: {r.error}"
    rows = [[str(i), ms(a), ms(b), pct(rel(b, a))] for i, (a, b) in enumerate(zip(r.a_runs, r.b_runs), start=1)]
    rows.append(["median", ms(statistics.median(r.a_runs)), ms(statistics.median(r.b_runs)), DASH])
    near = "" if r.near else f" (no neighbour was predicted within {NEAR:.0%}: the closest is used)"
    lines = [
        f"Model {r.model}, 2 ranks, 1f1b. A = the planner's split {r.a_split} (predicted {ms(r.a_predicted)} ms); "
        f"B = {r.b_split}, one boundary moved (predicted {ms(r.b_predicted)} ms, "
        f"{pct(rel(r.b_predicted or 0.0, r.a_predicted))} vs A){near}. Runs alternate A, B, A, B, ...; each "
        "figure is one run's median step.",
        table(rows, ["pair", "A measured ms", "B measured ms", "(B - A) / A"]),
        choice_verdict(r),
    ]
    if r.error:
        lines.append(f"Stopped early: {r.error}")
    return "\n\n".join(lines)


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


def choice_model(ctx: Context) -> ModelSpec | None:
    """The first selected split-choice model with a neighbour predicted within NEAR, else the first with any."""
    names = [n for n in SPLIT_CHOICE_MODELS if n in ctx.models]
    fallback = None
    for name in names:
        a = base_case(ctx, ctx.models[name])
        found = neighbour(a) if a.plan is not None and not a.error else None
        if found is not None and found[2]:
            return ctx.models[name]
        if found is not None and fallback is None:
            fallback = ctx.models[name]
    return fallback or (ctx.models[names[0]] if names else None)


def extras(ctx: Context, run_them: bool) -> tuple[list[CrossSplit], SplitChoice | None]:
    """The cross-split and split-choice experiments on the selected models they name."""
    if not run_them:
        return [], None
    cross = [cross_split(ctx, ctx.models[m]) for m in CROSS_SPLIT_MODELS if m in ctx.models]
    model = choice_model(ctx)
    return cross, None if model is None else split_choice(ctx, model)


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
