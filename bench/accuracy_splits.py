"""cost_accuracy's two experiments on a moved split: cross-split calibration and split choice.

Cross-split: a calibration fitted to one split's run (`--calibrate`) carried over to the split with
one boundary moved by one block, and run there. Split choice: whether the planner's split is the
measured faster one against a neighbour predicted within ``NEAR`` of it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.cases import (
    DASH,
    Case,
    ModelSpec,
    make_case,
    ms,
    pct,
    plan_argv,
    plan_split,
    rel,
    run_case,
    split_of,
)
from bench.common import (
    last_line,
    planner_command,
    run_path_of,
    run_plan_file,
    table,
)
from planner.core.split.cuts import Split
from planner.core.step.calibrate import apply_calibration, calibrate
from planner.core.step.predict import predict_plan, refresh
from planner.errors import PlannerError
from planner.schema.plan import Plan
from planner.schema.result import RunResult

CROSS_SPLIT_MODELS = ("mlp_stack", "gpt")
SPLIT_CHOICE_MODELS = ("heavy_middle", "mlp_stack")
NEAR = 0.10  # "two splits predicted within 10 % of each other"


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


def split_at(plan: Plan, starts: Sequence[int]) -> Split:
    """The plan's split moved to ``starts``, every stage recomputing as the plan's does."""
    return Split(starts=tuple(starts), recompute=tuple(s.recompute for s in plan.stages))


def predicted_step(plan: Plan, starts: Sequence[int]) -> float | None:
    """The plan's predicted step time at another split (None: that split cannot be evaluated)."""
    try:
        return predict_plan(plan, split_at(plan, starts))[1].step_time_s
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
    out.b_in_process = predict_plan(a.plan, split_at(a.plan, starts), blocks=blocks, link=link)[1].step_time_s
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
    split = split_at(a.plan, starts)
    for i in range(1, ctx.pairs + 1):
        runs, error = run_pair(ctx, (a.plan_path, b_path), f"cross{i}")
        if error:
            out.error = f"pair {i}: {error}"
            return
        run_a, run_b = runs
        blocks, link = apply_calibration(a.plan.blocks, a.plan.link, calibrate(a.plan, run_a))
        predicted = predict_plan(a.plan, split, blocks=blocks, link=link)[1].step_time_s
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
