"""What the pipelining runtime itself costs per message on this machine, and whether that is the link a plan needs.

A plan charges every message between neighbouring stages ``latency_s + nbytes / bandwidth_Bps``
(``planner.schema.costs.LinkCost``; on CPU the fixed ``GLOO_CPU_LINK``, 1.5 ms, fitted to real runs).
This script measures the runtime's own floor: ``ranks`` processes (gloo, one thread each) run
``torch.distributed.pipelining``'s GPipe and 1F1B with ``PipelineStage`` modules that only scale their
input by a parameter, at a small (8 KiB) and a large (4 MiB) message, each step ending with the
gradient-norm all-reduce a training step has. With the modules' own compute timed alone, the planner's
step model (``planner.core.step.predict.predict``) is solved for the latency that gives the small message's
measured step, then for the bandwidth that gives the large one's.

With ``--runs DIR ...`` (folders kept by ``python -m bench.cost_accuracy --keep`` or
``python -m bench.repeated_accuracy --keep``) it then re-predicts every plan in them with the measured link
in place of the plan's own, against the same runs: the two links compared on identical profiles and
runs, so the machine's noise cancels out of the comparison. Writes docs/runtime_link.md.

    .venv/bin/python -m bench.runtime_link                          # the floor at 2 and 4 ranks
    .venv/bin/python -m bench.runtime_link --runs /tmp/repeated_accuracy_x /tmp/cost_accuracy_y
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import DOCS, ROOT, machine, table, write_page
from planner.core.layout.inputs import Layout
from planner.core.split.cuts import Split
from planner.core.step.predict import plan_split, predict, predict_plan
from planner.errors import PlannerError
from planner.schema.costs import GLOO_CPU_LINK, BlockCost, LinkCost, OptimizerSpec
from planner.schema.plan import Plan
from planner.schema.result import RunResult

SCRIPT = "bench/runtime_link.py"
RERUN = ".venv/bin/python -m bench.runtime_link"
DEFAULT_OUT = DOCS / "runtime_link.md"
ROWS = 8  # samples per microbatch
SIZES = (256, 131072)  # columns: 8 x 256 fp32 = 8 KiB (latency-bound), 8 x 131072 = 4 MiB (bandwidth-bound)
SCHEDULES = ("gpipe", "1f1b")
TIMEOUT_S = 300.0


# --------------------------------------------------------------------------------------------------
# one rank of the measurement pipeline (run as `python -m bench.runtime_link --worker ...`)
# --------------------------------------------------------------------------------------------------
class Scale(torch.nn.Module):
    """A stage that computes almost nothing but still has a parameter and a gradient to send."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def median_s(fn: Callable[[], object], repeats: int = 30) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls after 3 warm-up calls."""
    times = []
    for _ in range(repeats + 3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:])


def module_alone(cols: int) -> tuple[float, float]:
    """Forward and backward of the stage module alone, per microbatch."""
    module = Scale()
    x = torch.randn(ROWS, cols, requires_grad=True)
    grad = torch.ones(ROWS, cols)
    fwd = median_s(lambda: module(x))
    both = median_s(lambda: module(x).backward(grad))
    return fwd, max(0.0, both - fwd)


def timed(fn: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
    """``fn``, appending each call's seconds to ``into``."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - t0)

    return wrapper


def pipeline_steps(rank: int, ranks: int, schedule_name: str, microbatches: int, cols: int, steps: int) -> dict:
    """``steps`` timed steps (after 3 warm-up steps): this rank's step times and median action times."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    from planner.schema.names import TORCH_NAMES

    # a received activation needs a gradient (the runtime allocates its buffers like the example's)
    example_in = torch.zeros(ROWS, cols, requires_grad=rank > 0)
    example_out = torch.zeros(ROWS, cols, requires_grad=True)
    stage = PipelineStage(
        Scale(), rank, ranks, torch.device("cpu"), input_args=(example_in,), output_args=(example_out,)
    )
    fwd: list[float] = []
    bwd: list[float] = []
    stage.forward_one_chunk = timed(stage.forward_one_chunk, fwd)  # type: ignore[method-assign]
    stage.backward_one_chunk = timed(stage.backward_one_chunk, bwd)  # type: ignore[method-assign]
    schedule = get_schedule_class(TORCH_NAMES[schedule_name])(
        stage, n_microbatches=microbatches, loss_fn=lambda y, t: (y - t).mean(), scale_grads=False
    )
    batch = torch.randn(ROWS * microbatches, cols)
    norm = torch.zeros(1)
    times = []
    for i in range(steps + 3):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            schedule.step(batch)
        elif rank == ranks - 1:
            schedule.step(target=batch)
        else:
            schedule.step()
        dist.all_reduce(norm)  # the gradient-norm all-reduce that ends a training step
        times.append(time.perf_counter() - t0)
        if i == 2:
            fwd.clear()
            bwd.clear()
    return {"step_s": times[3:], "fwd_action_s": statistics.median(fwd), "bwd_action_s": statistics.median(bwd)}


def worker(args: argparse.Namespace) -> None:
    """One rank: every (size, schedule); writes ``rank<R>.json`` into ``args.dir``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = f"file://{Path(args.dir) / 'store'}"
    ranks = args.ranks[0]  # a worker is launched with its pipeline's one rank count
    dist.init_process_group("gloo", init_method=store, rank=args.rank, world_size=ranks)
    try:
        out = []
        for cols in SIZES:
            alone = (0.0, 0.0)
            for r in range(ranks):  # one rank at a time: the module alone, not sharing the cores
                dist.barrier()
                if r == args.rank:
                    alone = module_alone(cols)
            for schedule in SCHEDULES:
                run = pipeline_steps(args.rank, ranks, schedule, args.microbatches, cols, args.steps)
                out.append({"schedule": schedule, "cols": cols, "fwd_s": alone[0], "bwd_s": alone[1], **run})
    finally:
        dist.destroy_process_group()
    (Path(args.dir) / f"rank{args.rank}.json").write_text(json.dumps(out))


# --------------------------------------------------------------------------------------------------
# launching and fitting
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sample:
    """One measured (ranks, schedule, message size)."""

    ranks: int
    schedule: str
    microbatches: int
    nbytes: int
    fwd_s: float  # the module alone, per microbatch
    bwd_s: float
    fwd_action_s: float  # the runtime's forward_one_chunk, median
    bwd_action_s: float
    step_s: float  # median over steps of the slowest rank's step


def measure(ranks: int, microbatches: int, steps: int) -> list[Sample]:
    """Launch ``ranks`` workers and read their figures back."""
    with tempfile.TemporaryDirectory(prefix="runtime_link_") as tmp:
        cmd = [sys.executable, "-m", "bench.runtime_link", "--worker", "--dir", tmp, "--ranks", str(ranks)]
        cmd += ["--microbatches", str(microbatches), "--steps", str(steps)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        procs = [
            subprocess.Popen([*cmd, "--rank", str(r)], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
            for r in range(ranks)
        ]
        for p in procs:
            _, err = p.communicate(timeout=TIMEOUT_S)
            if p.returncode:
                raise PlannerError(f"a measurement rank failed: {(err.strip().splitlines() or ['?'])[-1]}")
        per_rank = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(ranks)]
    samples = []
    for rows in zip(*per_rank):  # the same (size, schedule) on every rank
        slowest = [max(step) for step in zip(*(r["step_s"] for r in rows))]
        samples.append(
            Sample(
                ranks=ranks,
                schedule=rows[0]["schedule"],
                microbatches=microbatches,
                nbytes=ROWS * rows[0]["cols"] * 4,
                fwd_s=statistics.median(r["fwd_s"] for r in rows),
                bwd_s=statistics.median(r["bwd_s"] for r in rows),
                fwd_action_s=statistics.median(r["fwd_action_s"] for r in rows),
                bwd_action_s=statistics.median(r["bwd_action_s"] for r in rows),
                step_s=statistics.median(slowest),
            )
        )
    return samples


def predicted_step_s(s: Sample, link: LinkCost) -> float:
    """The planner's step for the measurement pipeline over ``link`` (one block per rank)."""
    blocks = [
        BlockCost(
            name=f"stage{i}",
            first_node=f"stage{i}",
            last_node=f"stage{i}",
            fwd_s=s.fwd_s,
            bwd_s=s.bwd_s,
            params=1,
            param_bytes=4,
            activation_bytes=s.nbytes,
            cut_bytes=s.nbytes if i < s.ranks - 1 else 0,
            cut_tensors=1 if i < s.ranks - 1 else 0,
            cut_legal=True,
            is_layer=True,
        )
        for i in range(s.ranks)
    ]
    optimizer = OptimizerSpec(name="sgd", grad_clip=None)
    slots = (os.cpu_count() or 1) / 1.0
    layout = Layout(s.schedule, s.ranks, s.microbatches)
    return predict(blocks, Split(starts=tuple(range(s.ranks))), link, layout, optimizer, slots)[1].step_time_s


def solve_for(f: Callable[[float], float], target: float, lo: float, hi: float) -> float:
    """The x in [lo, hi] where the non-decreasing ``f`` reaches ``target`` (an end when it does not)."""
    if f(lo) >= target:
        return lo
    while f(hi) < target and hi < 1e3:
        hi *= 2
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return hi


def fit(samples: Sequence[Sample]) -> tuple[float, float]:
    """(latency s, bandwidth B/s) at which the planner's step model gives the small and large messages' steps."""
    small = min(samples, key=lambda s: s.nbytes)
    large = max(samples, key=lambda s: s.nbytes)

    def step(s: Sample, latency: float, per_byte: float) -> float:
        link = LinkCost(name="fit", latency_s=latency, bandwidth_Bps=1 / per_byte, cpu_share=GLOO_CPU_LINK.cpu_share)
        return predicted_step_s(s, link)

    per_byte, latency = 1 / 2e9, 0.0
    for _ in range(4):  # the small message barely depends on the bandwidth: this settles at once
        latency = solve_for(lambda x, b=per_byte: step(small, x, b), small.step_s, 0.0, 1e-4)
        per_byte = solve_for(lambda x, a=latency: step(large, a, x), large.step_s, 1e-12, 1e-9)
    return latency, 1 / per_byte


# --------------------------------------------------------------------------------------------------
# the same plans and runs, re-predicted with the measured link
# --------------------------------------------------------------------------------------------------
@dataclass
class Paired:
    """One kept plan and its run: the step predicted with the plan's link and with the measured one."""

    name: str
    ranks: int
    schedule: str
    measured_s: float
    plan_link_s: float
    floor_link_s: float


def paired(dirs: Sequence[Path], links: dict[tuple[int, str], LinkCost]) -> list[Paired]:
    """Every plan (X.json beside X.run.json) in ``dirs`` whose ranks and schedule were measured."""
    out = []
    for d in dirs:
        for run_path in sorted(d.glob("*.run.json")):
            plan_path = run_path.with_name(run_path.name[: -len(".run.json")] + ".json")
            if not plan_path.exists():
                continue
            try:
                plan, run = Plan.load(plan_path), RunResult.load(run_path)
            except PlannerError:
                continue
            link = links.get((plan.n_ranks, plan.schedule))
            if link is None or plan.dp != 1 or plan.stages_per_rank != 1:
                continue
            split = plan_split(plan)
            # both with today's step model (a plan kept from an older planner stores older figures)
            default = predict_plan(plan, split, link=GLOO_CPU_LINK)[1].step_time_s
            floor = predict_plan(plan, split, link=link)[1].step_time_s
            name = plan.model.path.rsplit("/", 1)[-1].removesuffix(".py")
            out.append(Paired(name, plan.n_ranks, plan.schedule, run.median_step_s, default, floor))
    return out


# --------------------------------------------------------------------------------------------------
# the page
# --------------------------------------------------------------------------------------------------
def rel(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured, in %."""
    return 100 * (predicted - measured) / measured


def floor_rows(samples: Sequence[Sample], links: dict[tuple[int, str], LinkCost]) -> list[list[str]]:
    """One row per measured (ranks, schedule, size)."""
    rows = []
    for s in samples:
        link = links[(s.ranks, s.schedule)]
        rows.append(
            [
                str(s.ranks),
                s.schedule,
                f"{s.nbytes / 1024:.0f} KiB",
                f"{s.step_s * 1e3:.2f}",
                f"{s.fwd_s * 1e3:.3f} / {s.bwd_s * 1e3:.3f}",
                f"{(s.fwd_action_s - s.fwd_s) * 1e3:.3f} / {(s.bwd_action_s - s.bwd_s) * 1e3:.3f}",
                f"{link.latency_s * 1e3:.3f}",
                f"{link.bandwidth_Bps / 1e9:.2f}",
            ]
        )
    return rows


def paired_rows(pairs: Sequence[Paired]) -> list[list[str]]:
    """Per (ranks, schedule): both links' errors on the same plans and runs (toy model apart)."""
    rows = []
    for key in sorted({(p.ranks, p.schedule) for p in pairs}):
        group = [p for p in pairs if (p.ranks, p.schedule) == key and p.name != "toy"]
        if not group:
            continue
        plan_e = [rel(p.plan_link_s, p.measured_s) for p in group]
        floor_e = [rel(p.floor_link_s, p.measured_s) for p in group]
        rows.append(
            [
                str(key[0]),
                key[1],
                str(len(group)),
                f"{statistics.mean(plan_e):+.1f}% / {statistics.mean(map(abs, plan_e)):.1f}%",
                f"{statistics.mean(floor_e):+.1f}% / {statistics.mean(map(abs, floor_e)):.1f}%",
            ]
        )
    toy = [p for p in pairs if p.name == "toy"]
    if toy:
        plan_e = [rel(p.plan_link_s, p.measured_s) for p in toy]
        floor_e = [rel(p.floor_link_s, p.measured_s) for p in toy]
        rows.append(
            [
                "toy",
                "both",
                str(len(toy)),
                f"{statistics.mean(plan_e):+.1f}% / {statistics.mean(map(abs, plan_e)):.1f}%",
                f"{statistics.mean(floor_e):+.1f}% / {statistics.mean(map(abs, floor_e)):.1f}%",
            ]
        )
    return rows


FLOOR_HEADERS = [
    "ranks",
    "schedule",
    "message",
    "step ms (median)",
    "module alone fwd / bwd ms",
    "runtime per action beyond it, fwd / bwd ms",
    "fitted latency ms",
    "fitted bandwidth GB/s",
]
PAGE = """# The pipelining runtime's own cost per message, and the link a plan needs

Written by `{script}` on {today} ({machine}) in {seconds:.0f} s. Rerun with
`{rerun} [--runs DIR ...]`.

**What was measured.** {ranks} processes (gloo, 1 thread each) ran
`torch.distributed.pipelining`'s GPipe and 1F1B schedules, {a.microbatches} microbatches of {rows} rows,
{a.steps} timed steps after 3 warm-up steps, with stages that only multiply their input by a
parameter, at an 8 KiB and a 4 MiB message; each step ends with the gradient-norm all-reduce. The
latency and bandwidth are those at which the planner's own step model (`planner.core.step.predict.predict`,
the stage modules' compute timed alone, the messages' processor share as the plan's link has it)
gives the measured median steps: the latency from the small message, the bandwidth from the large
one, per (ranks, schedule).

## The runtime's floor

{floor}

## The same plans and runs, predicted with each link

Every kept plan in {folders} folder(s) re-predicted twice with today's step model, once with the
plan link (`GLOO_CPU_LINK`) and once with the measured floor for its ranks and schedule, against the
same run: errors of the predicted step, mean signed / mean absolute, over {runs} runs. Same
profiles, same runs: the difference between the two columns is the links' alone.

{compared}

(what the figures say: docs/prediction_accuracy.md)
"""


def page(
    args: argparse.Namespace, samples: Sequence[Sample], links: dict, pairs: Sequence[Paired], seconds: float
) -> str:
    """The markdown page."""
    compared = (
        "No kept runs were given (`--runs DIR ...`)."
        if not pairs
        else table(
            paired_rows(pairs),
            [
                "ranks",
                "schedule",
                "runs",
                f"plan's link ({GLOO_CPU_LINK.latency_s * 1e3:.1f} ms): signed / abs",
                "measured floor: signed / abs",
            ],
        )
    )
    return PAGE.format(
        script=SCRIPT,
        today=dt.date.today().isoformat(),
        machine=machine(),
        seconds=seconds,
        rerun=RERUN,
        ranks=", ".join(map(str, args.ranks)),
        a=args,
        rows=ROWS,
        floor=table(floor_rows(samples, links), FLOOR_HEADERS),
        folders=len(args.runs),
        runs=len(pairs),
        compared=compared,
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 4], help="pipeline ranks to measure (default 2 4)")
    parser.add_argument("--microbatches", type=int, default=8, help="microbatches per step (default 8)")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per schedule and size (default 15)")
    parser.add_argument("--runs", nargs="*", type=Path, default=[], help="folders of kept plans and runs to re-predict")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the page to write")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--dir", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if any(r < 2 for r in args.ranks) or args.microbatches < 1 or args.steps < 1:
        parser.error("--ranks must be >= 2, --microbatches and --steps >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Measure, fit, compare, write the page."""
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    t0 = time.perf_counter()
    samples: list[Sample] = []
    links: dict[tuple[int, str], LinkCost] = {}
    for ranks in args.ranks:
        got = measure(ranks, args.microbatches, args.steps)
        samples += got
        for schedule in SCHEDULES:
            latency, bandwidth = fit([s for s in got if s.schedule == schedule])
            links[(ranks, schedule)] = LinkCost(
                name=f"floor-{ranks}-{schedule}", latency_s=latency, bandwidth_Bps=bandwidth
            )
            print(
                f"{ranks} ranks, {schedule}: latency {latency * 1e3:.3f} ms, bandwidth {bandwidth / 1e9:.2f} GB/s",
                flush=True,
            )
    pairs = paired(args.runs, links)
    write_page(args.out, page(args, samples, links, pairs, time.perf_counter() - t0))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
