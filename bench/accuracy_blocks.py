"""Where the profile and the running pipeline diverge, block by block: cost_accuracy's third table.

Every block's profiled forward and backward (in context, as the plan has them, and isolated: each
block timed alone in this process) against the time the block took inside the running stage, the
block CSV, and the systematic differences between profile and pipeline, named and sized.
"""

from __future__ import annotations

import csv
import io
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.cases import (
    DASH,
    Case,
    Isolated,
    mean_abs,
    ms,
    ok_cases,
    pct,
    rel,
)
from bench.common import (
    last_line,
    table,
    write_page,
)
from planner.capture.load import load_model_file
from planner.core.step.predict import block_times_in_stages, stage_waits


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
