"""Time ``planner.core.split.solve.solve`` against the O(p n^2) programme it replaced; write docs/solver_scaling.md.

    python -m bench.solver_scaling                   # the doc's table (about 10 minutes: the reference is slow)
    python -m bench.solver_scaling --ref-budget 0    # the new solver only (seconds)
    python -m bench.solver_scaling --doc /tmp/x.md   # write elsewhere

For every block count in (10, 50, 100, 250, 500, 1000, 2000) and stage count in (2, 4, 8, 16, 32,
64) with stages <= blocks it builds a seeded random model (forward 0.5-1.5 ms per block, backward
twice that, bf16 parameters, 90 % of the boundaries cuttable, NVLink-class link, 1F1B with
m = 2 x stages) and times ``solve``: the median of ``--repeats`` runs. Three row sets:

* no memory limit;
* a binding limit: the tightest of a few fractions (90-99.9 %) of the largest stage memory of the
  unconstrained optimum that some split still fits, recompute "auto" (so the optimum must change);
* infeasible limits (a few sizes up to 2,000 x 64): the largest fraction (50 % down to 10 %) that no
  split fits, which times the error path that searches for the smallest stage count that fits.

The old solver (``_reference_solve`` in tests/test_solve.py, the O(p n^2) programme kept there as
the tests' reference; importing it needs the dev extras) is timed once, in the same run, wherever
its predicted time (a fit of its runs on smaller sizes) is below ``--ref-budget`` seconds, and its
answer is compared with the new one (the "same" column: identical partition, or identical error).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from bench.common import DOCS, ROOT, cpu_model, write_page
from planner.core.layout.inputs import Constraints, Layout
from planner.core.split.solve import solve
from planner.core.split.stage_model import Partition, stage_memories
from planner.errors import InfeasibleError
from planner.schema.costs import NCCL_NVLINK_LINK, BlockCost

BLOCKS = (10, 50, 100, 250, 500, 1000, 2000)
STAGES = (2, 4, 8, 16, 32, 64)
INFEASIBLE = ((50, 16), (100, 16), (250, 16), (250, 64), (500, 16), (500, 64), (1000, 64), (2000, 64))
GIB = 2**30
Outcome = Partition | str  # a partition, or the error message


def model(n: int) -> list[BlockCost]:
    """A seeded random model of ``n`` blocks (the same blocks for every stage count)."""
    rng = np.random.default_rng(n)
    fwd = rng.uniform(0.5e-3, 1.5e-3, n)
    params = rng.integers(10**6, 10**7, n)
    act = rng.integers(10**6, 10**7, n)
    cut = rng.integers(10**5, 10**6, n)
    legal = rng.random(n) < 0.9
    return [
        BlockCost(
            name=f"b{i}",
            first_node=f"n{i}a",
            last_node=f"n{i}b",
            fwd_s=float(fwd[i]),
            bwd_s=float(2 * fwd[i]),
            recompute_s=float(fwd[i]),
            params=int(params[i]),
            param_bytes=int(2 * params[i]),  # bf16: the optimizer keeps an fp32 master copy
            activation_bytes=int(act[i]),
            cut_bytes=int(cut[i]),
            cut_tensors=1,
            output_bytes=int(cut[i]) if i == n - 1 else 0,
            cut_legal=bool(legal[i]),
            is_layer=True,
        )
        for i in range(n)
    ]


def solve_stages(
    blocks: list[BlockCost],
    p: int,
    link: Any,
    *,
    schedule: str,
    n_microbatches: int,
    memory_limit_bytes: int | None,
    recompute: str,
) -> Partition:
    """``solve`` for ``p`` stages with these keywords (the reference solver's spelling)."""
    return solve(
        blocks,
        link,
        Layout(schedule, p, n_microbatches),
        Constraints(memory_limit_bytes=memory_limit_bytes, recompute=recompute),
    )


def run(fn: Callable[..., Partition | None], blocks: list[BlockCost], p: int, limit: int | None) -> Outcome:
    try:
        out = fn(
            blocks,
            p,
            NCCL_NVLINK_LINK,
            schedule="1f1b",
            n_microbatches=2 * p,
            memory_limit_bytes=limit,
            recompute="auto",
        )
    except InfeasibleError as err:
        return str(err)
    return out if out is not None else "no split fits (the reference names no stage count)"


def timed(
    repeats: int, fn: Callable[..., Partition], blocks: list[BlockCost], p: int, limit: int | None
) -> tuple[float, Outcome]:
    """Median wall time of ``repeats`` runs of ``run(fn, blocks, p, limit)``, and the last result."""
    times = []
    out: Outcome = ""
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = run(fn, blocks, p, limit)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def binding_limit(blocks: list[BlockCost], p: int, free: Partition, scale: float) -> int:
    """``scale`` x the largest stage memory of the unconstrained optimum."""
    return int(scale * max(stage_memories(blocks, free, schedule="1f1b", n_microbatches=2 * p)))


def feasible_binding_limit(blocks: list[BlockCost], p: int, free: Partition) -> int:
    """The tightest of a few limits below the unconstrained optimum's peak that some split still fits
    (the optimum must change); 90 % of that peak when none does (the row then times the error path)."""
    for scale in (0.9, 0.95, 0.98, 0.99, 0.995, 0.999):
        limit = binding_limit(blocks, p, free, scale)
        if isinstance(run(solve_stages, blocks, p, limit), Partition):
            return limit
    return binding_limit(blocks, p, free, 0.9)


def infeasible_limit(blocks: list[BlockCost], p: int, free: Partition) -> tuple[int, float]:
    """The largest of a few fractions of the unconstrained optimum's peak that no split fits."""
    for scale in (0.5, 0.4, 0.3, 0.25, 0.2, 0.15, 0.1):
        limit = binding_limit(blocks, p, free, scale)
        if isinstance(run(solve_stages, blocks, p, limit), str):
            break
    return limit, scale


def tests_module(name: str, *helpers: str) -> ModuleType:
    """``tests/<name>.py`` loaded from its file (it needs the dev extras), after the helper modules of
    tests/ it imports by their bare names (as pytest makes them importable), each under its own name."""
    for module_name in (*helpers, name):
        if module_name not in sys.modules:
            spec = importlib.util.spec_from_file_location(module_name, ROOT / "tests" / f"{module_name}.py")
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
    return sys.modules[name]


class Reference:
    """Times the old solver where a fit of its earlier runs predicts it finishes within budget.

    Its work grows as p n^2 when some split fits; when none does, its error path tries every larger
    stage count q with an O(q n^2) reachability each (1F1B: one mask per in-flight count), up to the
    count the new solver named. Each kind gets its own fit.
    """

    def __init__(self, budget: float) -> None:
        self.solve = tests_module("test_solve", "plan_factory")._reference_solve  # the O(p n^2) programme
        self.budget = budget
        self.per_unit: dict[str, float] = {}  # kind -> seconds per unit of work
        self.basis: dict[str, int] = {}  # kind -> the units of the run that rate comes from

    def time(self, blocks: list[BlockCost], p: int, limit: int | None, kind: str) -> tuple[float, Outcome] | None:
        n = len(blocks)
        units = p * n**2
        if kind == "infeasible":
            # The reference in tests/test_solve.py only says that no split fits; it no longer searches
            # the smallest stage count that would (the test checks solve's count by meaning), so there
            # is nothing of the old error path left to time.
            return None
        rate = self.per_unit.get(kind)
        if self.budget <= 0 or (rate is not None and rate * units > self.budget):
            return None
        secs, out = timed(1, self.solve, blocks, p, limit)
        # The largest run so far predicts best (small ones are mostly overhead).
        if units >= self.basis.get(kind, 10**5):
            self.per_unit[kind] = secs / units
            self.basis[kind] = units
        return secs, out


def fmt_ms(secs: float) -> str:
    return f"{secs * 1e3:.1f}"


def describe(out: Outcome) -> str:
    if isinstance(out, str):
        return "infeasible: " + (out.split(": ", 2)[1] if "smallest stage count" in out else out[:60])
    flags = sum(out.recompute)
    return f"{flags} stage(s) recompute" if flags else "split changes"


HEADER = """# Solver scaling: `solve` on up to 2,000 blocks x 64 stages

Written by `bench/solver_scaling.py` (the numbers below are from one run of it).

- Date: {date}
- Machine: {cpu}, {cores} CPUs; Python {python}, numpy {numpy}
- Command: `python -m bench.solver_scaling --repeats {repeats} --ref-budget {budget:g}`
- Total bench time: {minutes:.1f} min

Model: seeded random blocks (forward 0.5-1.5 ms, backward twice that, 1-10 M bf16 parameters,
1-10 MB activations and 0.1-1 MB boundary tensors per microbatch, 90 % of boundaries cuttable),
NVLink-class link, 1F1B with m = 2 x stages, AdamW. New: median of the runs above; reference: the
O(p n^2) programme `solve` used before (kept in tests/test_solve.py as `_reference_solve`), one run,
only where a fit of its smaller runs predicted under {budget:g} s. *Same*: the two
return the identical partition (starts, bottleneck, recompute flags) or the identical error.

## Without a memory limit

| blocks | stages | new (ms) | reference (s) | speed-up | same |
|---:|---:|---:|---:|---:|:---:|"""
LIMITED = """
## With a binding memory limit

Limit: the tightest of 90, 95, 98, 99, 99.5 and 99.9 % of the largest stage memory of the
unconstrained optimum that some split still fits (so that optimum no longer fits and another must
be found), `recompute="auto"`; 90 % where none does, and the row times the error path.

| blocks | stages | limit (GiB) | new (ms) | reference (s) | speed-up | same | outcome |
|---:|---:|---:|---:|---:|---:|:---:|---|"""
ERROR_PATH = """
## Infeasible limits (the error path)

The largest of 50, 40, 30, 25, 20, 15 and 10 % of the unconstrained optimum's largest stage that no
split into that many stages fits, even recomputing: the time to find that nothing fits and build
the message, which searches for the smallest stage count that does (the old solver's slowest path).

| blocks | stages | limit (GiB) | fraction | new (ms) | reference (s) | speed-up | same | message |
|---:|---:|---:|---:|---:|---:|---:|:---:|---|"""
HOW = """
## How

The search is the same dynamic programme over (stage, end block), run only on candidate stages:
a stage's cost without its outgoing message never decreases as it grows, and neither does a lower
bound of its memory, so each start gets a window of ends (binary search) outside which a stage
cannot be under the bottleneck cap or fit; a stage index only looks at the starts it can have
(between the earliest block from which the later stages can still cover the rest and the furthest
a chain of windows reaches from block 0). The cap starts near the average stage and is raised to
the best bottleneck found until that is within it. Memory grows with the live microbatches, so each
candidate's fit is one threshold on that count and the stage index only picks the threshold. All
floating-point sums are formed in the same order as before, so ties resolve identically. Cost:
O(p x candidates) vectorised work, about O(p n w) for w ends per start (w ~ blocks per stage);
degenerate inputs where most stages fit under the bottleneck (one block far larger than all the
others, all costs zero) fall back towards O(p n^2) vectorised work (about 1 s at 2,000 x 64). The
error path answers "does some split into q stages fit" for every q with one reachability sweep
from the last stage (GPipe's and 1F1B's in-flight counts, counted from the end, do not depend on q).
"""
Timing = tuple[float, Outcome] | None  # the reference's (seconds, outcome), None where not run


def parse_args() -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="runs of the new solver per size (median)")
    ap.add_argument(
        "--ref-budget", type=float, default=40.0, help="time the reference where it should take under this (s)"
    )
    ap.add_argument("--doc", type=Path, default=DOCS / "solver_scaling.md")
    return ap.parse_args()


def same_as(old: Timing, new: Outcome) -> bool | None:
    """Whether the reference found the same partition (or error), None where it did not run."""
    return None if old is None else repr(old[1]) == repr(new)


def feasible_rows(repeats: int, ref: Reference) -> tuple[list[str], list[str]]:
    """Every (blocks, stages): the table rows without a memory limit and with a binding one."""
    free_rows, mem_rows = [], []
    for n in BLOCKS:
        blocks = model(n)
        for p in (s for s in STAGES if s <= n):
            new_s, free = timed(repeats, solve_stages, blocks, p, None)
            assert isinstance(free, Partition)
            old = ref.time(blocks, p, None, "free")
            free_rows.append(f"| {n} | {p} | {fmt_ms(new_s)} " + ref_cells(old, new_s, same_as(old, free)))
            limit = feasible_binding_limit(blocks, p, free)
            new_m, limited = timed(repeats, solve_stages, blocks, p, limit)
            old = ref.time(blocks, p, limit, "limit" if isinstance(limited, Partition) else "infeasible")
            cells = ref_cells(old, new_m, same_as(old, limited))
            mem_rows.append(f"| {n} | {p} | {limit / GIB:.2f} | {fmt_ms(new_m)} " + cells + f" {describe(limited)} |")
            print(f"{n:5d} x {p:2d}: {fmt_ms(new_s)} ms, limited {fmt_ms(new_m)} ms", file=sys.stderr, flush=True)
    return free_rows, mem_rows


def infeasible_rows(repeats: int, ref: Reference) -> list[str]:
    """The error path's table rows: a limit no split fits, for a few sizes."""
    rows = []
    for n, p in INFEASIBLE:
        blocks = model(n)
        free = run(solve_stages, blocks, p, None)
        assert isinstance(free, Partition)
        limit, scale = infeasible_limit(blocks, p, free)
        new_e, err = timed(repeats, solve_stages, blocks, p, limit)
        assert isinstance(err, str), "no tried limit was infeasible"
        old = ref.time(blocks, p, limit, "infeasible")
        same = None if old is None else old[1] == err
        rows.append(
            f"| {n} | {p} | {limit / GIB:.2f} | {scale:.0%} | {fmt_ms(new_e)} "
            + ref_cells(old, new_e, same)
            + f" {describe(err)} |"
        )
        print(f"{n:5d} x {p:2d}: infeasible {fmt_ms(new_e)} ms", file=sys.stderr, flush=True)
    return rows


def ref_cells(old: Timing, new_s: float, same: bool | None) -> str:
    """The reference's time, the speed-up and whether it agrees (dashes where it did not run)."""
    if old is None:
        return "| — | — | — |"
    ratio = old[0] / new_s
    shown = f"{ratio:.1f}x" if ratio < 10 else f"{ratio:,.0f}x"
    return f"| {old[0]:.2f} | {shown} | {'yes' if same else '**NO**'} |"


def main() -> None:
    """Time every size, write the page."""
    args = parse_args()
    ref = Reference(args.ref_budget)
    started = time.perf_counter()
    free_rows, mem_rows = feasible_rows(args.repeats, ref)
    err_rows = infeasible_rows(args.repeats, ref)
    header = HEADER.format(
        date=_dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        cpu=platform.processor() or cpu_model() or platform.machine() or "unknown CPU",
        cores=os.cpu_count(),
        python=platform.python_version(),
        numpy=np.__version__,
        repeats=args.repeats,
        budget=args.ref_budget,
        minutes=(time.perf_counter() - started) / 60,
    )
    write_page(args.doc, "\n".join([header, *free_rows, LIMITED, *mem_rows, ERROR_PATH, *err_rows, HOW]), "--doc")
    print(f"wrote {args.doc}", file=sys.stderr)


if __name__ == "__main__":
    main()
