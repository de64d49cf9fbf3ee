"""The planner against published large runs, each figure in its source's own convention. Writes
docs/published_runs.md, whole.

    python -m bench.published_runs                      # every row (many minutes: the searches)
    python -m bench.published_runs --only megatron      # the rows whose key starts with "megatron"
    python -m bench.published_runs --search-timeout 0   # no search column (the forced layouts only)

For each run (``bench.published_rows``: figures, layouts, GPUs, conventions and sources), with costs
estimated once for the GPUs that ran it (their shipped datasheet spec, ``--gpu-type``):

* within memory (the headline): the published t, p, d and batch forced, under the GPU's memory, the
  planner choosing what it must (recomputation, schedule, microbatches, DP mode where the source
  does not fix it): the plan the planner would produce for that layout;
* as run: the same layout with what the source says it ran with (recomputation, schedule, DP mode),
  memory not capped, its predicted peak beside the GPU's memory;
* the search's own choice for the same GPUs and batch (``--tp auto --dp auto --recompute auto``),
  in a child process stopped after ``--search-timeout`` seconds, with the worker processes ``planner
  plan`` starts by default (one per core).

Errors are the published step over the predicted one, minus one: the same in the source's
convention and in the planner's (its model FLOPs, causal attention at half), both shown.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import multiprocessing
import platform
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import (
    DOCS,
    MOE_PUBLISHED,
    ROOT,
    base_request,
    host,
    kept_between,
    plan_on_costs,
    search_update,
    table,
    write_page,
)
from bench.published_rows import CONVENTIONS, NOT_COMPARED, Published, figure_at, published_runs, published_step_s
from planner.api import estimated_costs
from planner.capture.load import load_model_file
from planner.core.levers.hardware import GPUS
from planner.errors import PlannerError
from planner.report.throughput import throughput
from planner.schema.plan import Plan
from planner.schema.request import PlanRequest
from planner.workers import default_jobs

BAND = 0.15  # issue 62's goal: every published layout within +-15 %


@dataclass(frozen=True)
class Variant:
    """One plan of a row: the plan (or why there is none) and the seconds planning it took."""

    plan: Plan | None
    why: str
    seconds: float


@dataclass(frozen=True)
class Outcome:
    """A row's three plans."""

    row: Published
    within: Variant
    as_run: Variant
    search: Variant
    memory_gib: float  # the memory the planner plans within (the GPU's, less its headroom)
    gap: str = ""  # where the search beats the within-memory layout by more than BAND: which effect carries it
    bf16: Variant | None = None  # an fp8 row: the within-memory layout planned in bf16 ("does FP8 pay here")


def _plan(base: PlanRequest, costs: Any, mf: Any, limit: int | None, jobs: int | None = None, **update: Any) -> Variant:
    request = base.model_copy(update=update)
    t0 = time.perf_counter()
    try:
        plan = plan_on_costs(request, costs, mf, created="bench", memory_limit_bytes=limit, jobs=jobs)
    except PlannerError as e:
        return Variant(None, str(e).split(";")[0][:160], time.perf_counter() - t0)
    return Variant(plan, "", time.perf_counter() - t0)


def _search(base: PlanRequest, costs: Any, mf: Any, limit: int | None, timeout_s: float) -> Variant:
    """The search's own choice, in a forked child stopped after ``timeout_s`` (a slow search must not
    hold the page), with the worker processes ``planner plan`` starts by default on this machine
    (``planner.workers.default_jobs``: the time a user waits): the child sends the plan back as JSON."""
    if timeout_s <= 0:
        return Variant(None, "not run", 0.0)
    update = search_update(base)
    ctx = multiprocessing.get_context("fork")  # the costs are inherited, not pickled
    receive, send = ctx.Pipe(duplex=False)

    def child() -> None:
        # a forked child inherits the parent's OpenMP team (the costs ran torch ops) but not its
        # threads: its first parallel op would wait on them for ever (it did: the search column read
        # "not finished" for rows whose search takes seconds). One thread runs every op inline.
        import torch

        torch.set_num_threads(1)
        v = _plan(base, costs, mf, limit, default_jobs(), **update)
        send.send((v.plan.model_dump_json() if v.plan is not None else None, v.why, v.seconds))

    t0 = time.perf_counter()
    proc = ctx.Process(target=child, daemon=True)
    proc.start()
    if not receive.poll(timeout_s):
        proc.kill()  # this bench's own child, by its handle
        proc.join()
        return Variant(None, f"not finished in {timeout_s:.0f} s (stopped)", time.perf_counter() - t0)
    text, why, seconds = receive.recv()
    proc.join()
    return Variant(Plan.model_validate_json(text) if text is not None else None, why, seconds)


def _within(base: PlanRequest, costs: Any, mf: Any, limit: int | None, row: Published, as_run: Variant) -> Variant:
    """The published layout within the GPU's memory, changing only what it must: as run (microbatches and
    split the planner's; where the source gives the schedule, its stages per rank as the as-run plan has
    them, so that a fixed recomputation is not kept by falling back to one stage per rank); else with
    the recomputation open (``auto``: the planner's per-stage choice); else with everything the
    source adds to the degrees open."""
    first = dict(row.as_run)
    if "schedule" in row.as_run and as_run.plan is not None:
        first["stages_per_rank"] = as_run.plan.stages_per_rank
    tries = [(first, ""), (row.as_run | {"recompute": "auto"}, "recompute"), ({}, ", ".join(sorted(row.as_run)))]
    seconds = 0.0
    why = "no plan"
    for update, opened in tries:
        v = _plan(base, costs, mf, limit, **update)
        seconds += v.seconds
        if v.plan is not None:
            return Variant(v.plan, f"opened: {opened}" if opened else "", seconds)
        why = v.why
    return Variant(None, why, seconds)


def evaluate(row: Published, tmp: Path, search_timeout_s: float) -> Outcome:
    """Plan one published run three ways: within the GPU's memory, as run, and the search's choice."""
    try:
        base = base_request(row, tmp)
    except PlannerError as e:  # a combination the planner refuses: the row says why
        none = Variant(None, str(e).split(";")[0][:160], 0.0)
        return Outcome(row, none, none, none, 0.0)
    mf = load_model_file(base.model_file, base.size, base.overrides)
    costs = estimated_costs(mf, base, 1)
    limit = costs.memory_bytes
    as_run = _plan(base, costs, mf, None, **row.as_run)
    within = _within(base, costs, mf, limit, row, as_run)
    search = _search(base, costs, mf, limit, search_timeout_s)
    gap = ""
    if search.plan is not None and within.plan is not None:
        gain = within.plan.prediction.step_time_s / search.plan.prediction.step_time_s - 1
        gap = _gap(base, costs, mf, limit, search.plan, within.plan) if gain > BAND else ""
    return Outcome(row, within, as_run, search, (limit or 0) / 2**30, gap, _bf16(row, base, mf))


def _bf16(row: Published, base: PlanRequest, mf: Any) -> Variant | None:
    """An fp8 row's within-memory layout planned in bf16, on bf16 costs: what FP8 gains there (None: a
    bf16 row)."""
    if row.dtype == "bf16":
        return None
    bf16 = base.model_copy(update={"dtype": "bf16"})
    costs = estimated_costs(mf, bf16, 1)
    as_run = _plan(bf16, costs, mf, None, **row.as_run)
    return _within(bf16, costs, mf, costs.memory_bytes, row, as_run)


def _gap(base: PlanRequest, costs: Any, mf: Any, limit: int | None, choice: Plan, published: Plan) -> str:
    """Which modelled effect carries the search's gain over the published layout (issue 62 part 5:
    ``attribute_gap``, priced on the search's own problem, as ``assemble.search_problem`` shows)."""
    from planner import api
    from planner.core.assemble import search_problem
    from planner.core.layout.inputs import asked_of
    from planner.core.layout.robust import attribute_gap, plan_layout

    def problem_of(request: PlanRequest) -> Any:
        split = api.tensor_parallel_split(mf, request, costs, costs.blocks)
        asked = asked_of(api.with_step_temp_rule(request, costs.step_temp_rule), limit)
        return search_problem(asked, split.blocks, costs.link, costs.profile, costs.ties)

    opened = {"tp": "auto", "dp": "auto", "recompute": "auto", "sequence_parallel": "auto"}
    searched = base.model_copy(update=opened | ({"cp": "auto", "cp_attention": "auto"} if base.cp != 1 else {}))
    try:  # each layout priced on its own request's problem (the published one's tensor-parallel shares are --tp's)
        gap = attribute_gap(problem_of(searched), plan_layout(choice), plan_layout(published), problem_of(base))
    except PlannerError as e:  # InfeasibleError is one: a layout these figures cannot run
        return f"not attributed: {str(e)[:100]}"
    return f"carried by {gap.carried_by()}: {gap.line()}"


# --------------------------------------------------------------------------------------------------
# the page's cells
# --------------------------------------------------------------------------------------------------
def peak_of(row: Published) -> float:
    """The datasheet's dense bf16 peak of the row's GPU spec (FLOP/s)."""
    return GPUS[row.gpu].peak("bf16")


def _fmt(row: Published, value: float) -> str:
    if row.unit == "tokens/s" and value >= 1000:
        return f"{value:,.0f}"
    return f"{value:,.1f}"


def _error(predicted_s: float, published_s: float) -> float:
    """Published step over predicted, minus one: the figure's error in any one convention."""
    return published_s / predicted_s - 1


def _recompute(plan: Plan) -> str:
    """The stages' recompute values, each with how many stages have it ("full:20 x 2, never x 14")."""
    counts: dict[str, int] = {}
    for stage in plan.stages:
        counts[stage.recompute] = counts.get(stage.recompute, 0) + 1
    if set(counts) == {"never"}:
        return "no recompute"
    several = len(plan.stages) > 1
    return "recompute " + ", ".join(f"{v} x {n}" if several else v for v, n in counts.items())


def layout(plan: Plan) -> str:
    """One line: degrees, DP mode, schedule, microbatches, recomputation."""
    v = f", v {plan.stages_per_rank}" if plan.stages_per_rank > 1 else ""
    k = f", k {plan.accumulation}" if plan.accumulation > 1 else ""
    sp = ", sp" if plan.sequence_parallel else ""
    cp = f" x cp {plan.cp}" + (" (ring)" if plan.cp_attention == "ring" else "") if plan.cp > 1 else ""
    return (
        f"t {plan.tp} x p {plan.n_ranks} x d {plan.dp}{cp} ({plan.dp_mode if plan.replicas > 1 else '-'}{sp}), "
        f"{plan.schedule}, m {plan.n_microbatches}{v}{k}, {_recompute(plan)}"
    )


def _peak_gib(plan: Plan) -> float:
    return plan.prediction.max_memory_bytes / 2**30


def _planner_tflops(plan: Plan, step_s: float) -> float | None:
    """The planner's own count (model FLOPs, causal attention at half) per GPU at ``step_s``."""
    flops = throughput(plan).model_flops
    return flops / (step_s * plan.world_size) / 1e12 if flops is not None else None


def headline_cells(o: Outcome) -> list[str]:
    """The main table's row: the published figure, each variant's prediction and error in the source's
    convention, the as-run peak against the memory, and the same figures in the planner's count."""
    row, peak = o.row, peak_of(o.row)
    pub_s = published_step_s(row, peak)
    cells = [row.key, row.model, f"{row.gpus:,} {row.gpu}", row.degrees, f"{row.batch:,}"]
    cells += [f"{row.unit} ({row.convention})", _fmt(row, row.figure)]
    planner_pub: str = "—"
    for v in (o.within, o.as_run):
        if v.plan is None:
            cells += ["—", "—"]
            continue
        step = v.plan.prediction.step_time_s
        cells += [_fmt(row, figure_at(row, step, peak)), f"{100 * _error(step, pub_s):+.1f}%"]
    if o.as_run.plan is not None:
        gib = _peak_gib(o.as_run.plan)
        over = " **over**" if gib > o.memory_gib else ""
        cells.append(f"{gib:.1f} / {o.memory_gib:.1f}{over}")
    else:
        cells.append("—")
    planner_cells = []
    for v in (o.within, o.as_run):
        value = _planner_tflops(v.plan, v.plan.prediction.step_time_s) if v.plan is not None else None
        planner_cells.append(f"{value:,.1f}" if value is not None else "—")
        if v.plan is not None and planner_pub == "—":
            pub = _planner_tflops(v.plan, pub_s)
            planner_pub = f"{pub:,.1f}" if pub is not None else "—"
    return [*cells, planner_pub, *planner_cells]


HEADLINE = [
    "row",
    "model",
    "GPUs",
    "t x p x d",
    "batch",
    "unit (convention)",
    "published",
    "within memory",
    "error",
    "as run",
    "error (as run)",
    "as-run peak / memory GiB",
    "planner's count: published",
    "within memory (planner)",
    "as run (planner)",
]


def plan_cells(o: Outcome) -> list[str]:
    """The plans behind the figures, and the search's choice with its figure in the source's convention."""
    row = o.row
    cells = [row.key]
    for v in (o.within, o.as_run):
        note = f" ({v.why})" if v.why else ""
        cells.append(layout(v.plan) + note if v.plan is not None else f"no plan: {v.why}")
    if o.search.plan is not None:
        step = o.search.plan.prediction.step_time_s
        cells += [layout(o.search.plan), _fmt(row, figure_at(row, step, peak_of(row))), robustness(o.search.plan)]
    else:
        cells += [o.search.why or "no plan", "—", "—"]
    cells.append(o.gap or "—")
    cells.append(" / ".join(f"{v.seconds:.0f}" for v in (o.within, o.as_run, o.search)))
    return cells


PLANS = [
    "row",
    "within memory",
    "as run",
    "search's choice",
    "its figure",
    "robustness",
    "its gain over the within-memory layout",
    "s (within / as run / search)",
]


def robustness(plan: Plan) -> str:
    """The search's choice under slower hardware (issue 62 part 5, ``planner.report.robustness``): its
    step's change with collectives 1.3x and compute 1.1x slower, and the robust runner-up where that
    changes the winner; "—" where the planner has no such column (a commit before part 5)."""
    try:
        report = importlib.import_module("planner.report.robustness")
        robust = importlib.import_module("planner.core.layout.robust")
    except ImportError:
        return "—"
    if not report.has_column(plan):
        return "—"
    index = robust.chosen_row(plan)
    chosen = plan.search[index] if index is not None else None
    cell = report.slowed_cell(chosen) if chosen is not None else "—"
    line = report.robust_line(plan)
    return f"{cell}; {line}" if line else f"{cell}; the choice holds"


def fp8_cells(o: Outcome) -> list[str]:
    """An fp8 row's "does FP8 pay here": its within-memory prediction in fp8 and in bf16, the gain the
    planner predicts, and the published one where the source ran the same layout in bf16 too."""
    row, peak = o.row, peak_of(o.row)
    cells = [row.key, _fmt(row, row.figure), _fmt(row, row.bf16_figure) if row.bf16_figure else "—"]
    for v in (o.within, o.bf16):
        cells.append(_fmt(row, figure_at(row, v.plan.prediction.step_time_s, peak)) if v and v.plan else "—")
    f8, b16 = o.within.plan, o.bf16.plan if o.bf16 is not None else None
    same = f8.profile.float8.bf16_step_s if f8 is not None and f8.profile.float8 is not None else None
    cells.append(_fmt(row, figure_at(row, same, peak)) if same else "—")  # the plan's own: its layout and split
    gain = b16.prediction.step_time_s / f8.prediction.step_time_s if f8 is not None and b16 is not None else None
    cells.append(f"{gain:.2f}x" if gain is not None else "—")
    cells.append(f"{row.figure / row.bf16_figure:.2f}x" if row.bf16_figure else "—")
    f8_layers = f8.profile.float8 if f8 is not None else None
    cells.append(f"{f8_layers.converted} of {f8_layers.layers}" if f8_layers else "—")
    return cells


FP8_HEADERS = [
    "row",
    "published (fp8)",
    "published (bf16, same run)",
    "planner: fp8",
    "planner: bf16, same layout",
    "planner: bf16, the fp8 plan's layout and split",
    "FP8's gain, predicted",
    "FP8's gain, published",
    "float8 layers",
]


def gpu_cells(row: Published) -> list[str]:
    """The row's GPU spec, convention and source, and what it assumes."""
    hw = GPUS[row.gpu]
    spec = f"`{row.gpu}`: {hw.peak('bf16') / 1e12:.1f} TFLOP/s bf16, {hw.memory_bytes / 2**30:.1f} GiB"
    kernel = row.request.get("attention_kernel")
    if kernel:  # another attention kernel than the GPU's default, as the run's software had it
        spec += f", `{kernel}` attention"
    return [row.key, row.source, spec, row.gpu_note, CONVENTIONS[row.convention], row.assumed or "—"]


GPU_HEADERS = ["row", "source", "GPU spec (datasheet)", "the GPUs that ran", "convention", "assumed (not published)"]


def errors(outcomes: list[Outcome], variant: str, only_published: bool = False) -> list[float]:
    """The errors of one variant ("within" or "as_run") over the rows that have a plan."""
    out = []
    for o in outcomes:
        v: Variant = getattr(o, variant)
        if v.plan is None or (only_published and o.row.assumed):
            continue
        out.append(_error(v.plan.prediction.step_time_s, published_step_s(o.row, peak_of(o.row))))
    return out


def summary(outcomes: list[Outcome]) -> str:
    """The headline figures: mean |error| and how many rows are within the band, per variant."""
    lines = []
    for variant, name in (("within", "Within memory (the headline)"), ("as_run", "As run")):
        for only, scope in ((False, "every row"), (True, "the rows that assume nothing")):
            errs = errors(outcomes, variant, only)
            if not errs:
                continue
            inside = sum(abs(e) <= BAND for e in errs)
            worst = max(errs, key=abs)
            lines.append(
                f"- {name}, {scope}: mean |error| **{100 * sum(abs(e) for e in errs) / len(errs):.1f} %** over "
                f"{len(errs)} rows, **{inside} of {len(errs)}** within ±15 %, worst {100 * worst:+.1f} %."
            )
    unplanned = [o.row.key for o in outcomes if o.within.plan is None]
    if unplanned:  # counted nowhere above: a layout the planner cannot fit is no error of its step
        lines.append(
            f"- No plan within memory (not in the figures above): {len(unplanned)} of {len(outcomes)} rows, "
            f"{', '.join(unplanned)} (the plans table says why)."
        )
    return "\n".join(lines)


def commit() -> str:
    """HEAD's short hash, with the planner files the working tree changes beside it (they were planned with)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "planner", "models", "bench"], cwd=ROOT, capture_output=True, text=True
    )
    changed = [line[3:] for line in dirty.stdout.splitlines() if line.strip()]
    text = head.stdout.strip() or "unknown"
    return text + (f" (working tree changing {', '.join(changed)})" if changed else "")


PAGE = """# The planner against published runs

Written whole by `python -m bench.published_runs` (`bench/published_runs.py`, the rows in
`bench/published_rows.py`) on {today}, at commit {commit}, on {host} (Python {python}), in
**{minutes:.1f} minutes**. No row is edited by hand; no GPU was used: every cost is the planner's
estimate for the GPUs that ran the published run, at their datasheet figures.

For each published run, three plans of the same model, GPUs and batch:

- **within memory** (the headline): the published tensor-parallel degree t, pipeline ranks p,
  replicas d and batch forced, within the GPU's memory as the planner counts it (its capacity less
  5 % headroom), changing only what it must to fit: the run as published (its recomputation,
  schedule with the as-run plan's stages per rank, and data-parallel mode where the source gives
  them; microbatches and the split are the planner's, but where the row gives what the run's software
  did by default: torchtitan's 405B pipelines, 8 microbatches and 2 stages per looped rank); where
  that does not fit, with the
  recomputation open (`--recompute auto`, the planner's choice per stage), then with all of those
  open (the plans table says "opened: ..." where it had to). This is the plan `planner
  plan` would produce for that layout on those GPUs;
- **as run**: the same layout with what the source says the run did (its recomputation,
  schedule, data-parallel mode; the rows below say which), memory not capped, its predicted peak
  beside the GPU's memory (**over** where the planner says it would not fit: the run fitted, so
  the planner's memory model is pessimistic there);
- **the search's own choice** (`--tp auto --dp auto --recompute auto`, sequence parallelism and
  data-parallel mode open) for the same GPUs and batch, with its figure, searched as `planner plan`
  searches here ({jobs} worker processes, one per core); a search still running after {timeout:.0f} s
  is stopped and said so.

Every figure is in its **source's own convention** (its unit and its FLOP formula: the GPU
table below gives it per row); **error** = predicted / published − 1 in that convention, which is
the published step time over the predicted one, minus one. The planner's own count (its model
FLOPs, causal attention at half, no recomputation) is beside it: the same step times, so the same
errors, on a smaller FLOP count. The goal (issue 62): every published layout within ±15 %, mean
|error| ≤ 8 %, at the datasheet peak of the GPUs that ran it.

## Headline

{summary}

{outside}

{headline}

## The plans

{plans}

## Does FP8 pay here?

The rows that train their linear layers in float8 (`--dtype fp8`: torchao's `Float8Linear`,
docs/fp8.md), beside the same layout planned in bf16 on bf16 costs (its within-memory plan, which
may recompute or split otherwise), the fp8 plan's own layout and split priced in bf16 (what its
report says: "float8 pays here"), and the gain published where the source ran that layout in bf16
too. The predicted gain is the first bf16 column's over the fp8 one.

{fp8}

## GPUs, conventions, sources, assumptions

One GPU spec per row: the shipped spec (`planner/core/levers/hardware.py`) of the GPUs that ran,
at its datasheet peak. A clock the source does not publish is said, not fitted.

{gpus}

## Where the constants come from

Nothing here is fitted to a published run.

- Peaks, memory, NVLink and the network card per GPU: the shipped GPU specs in
  `planner/core/levers/hardware.py`, each citing its datasheet (NVIDIA H100 SXM: 989.5 dense bf16
  TFLOP/s, 80 GB HBM3 at 3.35 TB/s, 450 GB/s NVLink a direction, 400 Gb/s NDR per GPU; its 96 GB
  HBM2e variant from torchtitan's benchmark page; NVIDIA A100 80GB SXM: 312, 2.04 TB/s, 300 GB/s,
  200 Gb/s HDR per GPU, the DGX A100 reference design).
- Collectives (tensor-parallel, DDP, FSDP, HSDP, pipeline sends): NCCL's own cost model, issue 62
  part 1 (`planner/core/levers/collectives.py`, ported from NCCL 2.30.7's `src/graph/tuning.cc`;
  checked against published nccl-tests figures in docs/collectives.md).
- How data-parallel communication overlaps compute: issue 62 part 2
  (`planner/core/levers/overlap.py`, docs/overlap.md): FSDP2 prefetching one unit ahead, DDP's
  25 MiB buckets (torch's defaults and docstrings), and compute beside a collective charged the
  18.9 % mean slowdown Lee et al. measured (arXiv 2507.03114).
- GEMM and attention efficiencies: fixed per GPU in the specs (`matmul_efficiency`, the
  attention kernels' forward / backward efficiencies), from microbenchmarks cited in
  docs/gpu_costs.md (on an H100, the blocks measured at 0.97–1.0× their estimate, docs/gpu_check.md).
- The attention kernel: the one the run's software had, named in the GPU table below where it is
  not the GPU's default (`--attention-kernel`): FlashAttention-2 (`flash`) for torchtitan's runs on
  the torch of December 2024; for the Megatron-LM runs of 2021 and OPT (trained before FlashAttention,
  2022) two batched GEMMs around a fused softmax (`unfused`: the GEMM figures and the memory
  bandwidth, every score computed and the probabilities saved; docs/gpu_costs.md).
- FP8: the datasheet's FP8 peak (1,979 dense TFLOP/s on an H100), large FP8 GEMMs at 1.75× bf16's
  speed (NVIDIA's cuBLAS 12.9 figure for Hopper), and torchao's own casts and scales run under the
  roofline as the memory-bound operators they are (docs/fp8.md).
- The shipped specs are hardware files of `planner probe`'s format (issue 62 part 3); no probe file
  is used here (no GPU cluster was measured).

## What the planner leaves out (where its errors come from)

The effects most likely behind the rows outside ±15 % (named, not measured: checking them needs
the GPUs that ran):

- torchtitan's H100 rows, all predicted too fast: their GPUs ran at a 500 W power limit (torchtitan:
  "the actual peak TFLOPs number is between SXM and NVL, and we don't know its exact value"), and
  are planned at the SXM datasheet's 989.5 TFLOP/s; the NVL's 835.5 is 16 % lower. They are planned
  on torchtitan's own attention code (`models/llama.py` with `attention_code=reference`: RoPE as one
  complex product, k and v copied to every query head before SDPA, and those copies what context
  parallelism gathers). On the planner's code (RoPE as nine elementwise kernels, torchtitan's three; SDPA's
  grouped-query attention) the 8B rows credited torch.compile with a 1.26x gain against the
  published 1.157x; on torchtitan's 1.20x: its eager rows now miss by nearly as much as its
  compiled ones (+19 / +23 % on 8 GPUs, +24 / +28 % on 128), what a clock slower than the
  datasheet's gives every row alike. The miss comes with those GPUs, not with the model, its code
  or its layout: the same model planned on the same code as torchtitan's FSDP ran it, eager and with
  the same selective recomputation, on 64 A100s at their full power (titan-a100-8b, torchtitan's
  docs/performance.md) is predicted within 5 %. The 405B context-parallel rows gather 16 copies of each
  key-value head: their misses fell by 7 to 24 points, and the 256k-token row no longer fits the
  planner's memory model (which already counted 2x what the run held, without sequence parallelism).
- MegaScale, predicted too slow: it overlaps the tensor- and sequence-parallel collectives with the
  GEMMs beside them (all-gather and reduce-scatter fused into the linears, its Figure 3) and runs a
  parallel transformer block (attention and MLP side by side) with sliding-window attention; the
  planner charges those collectives on the critical path of a sequential block. Its layout, shape
  and GPU variant are assumed besides (the GPU table). The same abstract puts Megatron-LM, whose
  sequential block and collectives the planner does model, 1.34x below MegaScale on that run: the
  megascale-175b-megatron row, planned alike.

And in every row:

- Megatron's and MegaScale's overlap of the tensor-parallel collectives with GEMMs (MegaScale's
  fused all-gather / reduce-scatter linears): the planner charges the tensor-parallel traffic as
  torch's eager DTensors run it, on the critical path.
- Megatron's fused kernels (softmax, bias-GeLU, fused Adam): the roofline's efficiencies are fixed
  per GPU, those of torch's kernels.
- The Llama 3 run's own pipeline schedule (a tuned interleaving with "N" microbatches in a row,
  first and last stages one layer short) and memory savings: the planner's memory model is of
  torch's eager kernels and `PipelineStage` (a receive buffer per microbatch), so it needs more
  memory than that run did and recomputes to fit.
- MegaScale's parallel transformer block and sliding-window attention; OPT's and MegaScale's
  unpublished details (the GPU table's "assumed").
- The H100s' clocks under torchtitan's 500 W limit (planned at the SXM datasheet peak).
- The Megatron runs' fp16 gradient all-reduce (the planner reduces in fp32, as `planner run` does:
  twice the bytes).
- torchtitan's float8 rows: the float8 layers the planner keeps in bf16 by torchao's size filter
  (Llama's key and value projections on an H100, docs/fp8.md), which torchtitan of December 2024
  converted; its asynchronous tensor parallelism (Table 5); sequence parallelism with compile.

## Published runs not compared

{not_compared}

## Mixture-of-experts runs

Each run's own layout planned as it ran (bf16; the planner's schedule nearest the run's, DualPipeV
for DualPipe), with routing as the run balanced it and evenly, and the planner's search
over the same GPUs and batch (`--dp auto --tp auto --ep auto`). Written by `python -m
bench.moe_published`; `bench/published_runs.py` keeps this section as it is.

{moe_begin}
{moe}
{moe_end}
"""


def outside(outcomes: list[Outcome]) -> str:
    """A sentence naming the rows outside the band, per variant (empty when none)."""
    parts = []
    for variant, name in (("within", "within memory"), ("as_run", "as run")):
        rows = []
        for o in outcomes:
            v: Variant = getattr(o, variant)
            if v.plan is None:
                rows.append(f"{o.row.key} (no plan)")
                continue
            e = _error(v.plan.prediction.step_time_s, published_step_s(o.row, peak_of(o.row)))
            if abs(e) > BAND:
                rows.append(f"{o.row.key} {100 * e:+.1f} %")
        if rows:
            parts.append(f"Outside ±15 % {name}: {', '.join(rows)}.")
    return " ".join(parts)


def main() -> None:
    """Plan every published row, write the page."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="only the rows whose key starts with this")
    # issue 62's goal for a published row's search is 60 s
    parser.add_argument("--search-timeout", type=float, default=60.0, help="seconds per search (0: no search)")
    parser.add_argument("--out", type=Path, default=DOCS / "published_runs.md")
    args = parser.parse_args()
    t0 = time.perf_counter()
    at = commit()  # before planning: a commit landing meanwhile is not the one planned with
    outcomes = []
    with tempfile.TemporaryDirectory() as tmp:
        for row in published_runs():
            if not row.key.startswith(args.only):
                continue
            outcomes.append(evaluate(row, Path(tmp), args.search_timeout))
            print(" | ".join(headline_cells(outcomes[-1]) + plan_cells(outcomes[-1])[1:]), flush=True)
    text = PAGE.format(
        today=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        commit=at,
        host=host(),
        python=platform.python_version(),
        minutes=(time.perf_counter() - t0) / 60,
        timeout=args.search_timeout,
        jobs=default_jobs(),
        summary=summary(outcomes),
        outside=outside(outcomes),
        headline=table([headline_cells(o) for o in outcomes], HEADLINE),
        plans=table([plan_cells(o) for o in outcomes], PLANS),
        gpus=table([gpu_cells(o.row) for o in outcomes], GPU_HEADERS),
        fp8=table([fp8_cells(o) for o in outcomes if o.bf16 is not None], FP8_HEADERS),
        not_compared=table(NOT_COMPARED, ["run", "source", "published", "why not compared"]),
        moe_begin=MOE_PUBLISHED[0],
        moe=kept_between(args.out, *MOE_PUBLISHED),
        moe_end=MOE_PUBLISHED[1],
    )
    write_page(args.out, text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
