"""How long planning takes at the scale of the largest published runs, and how much memory.

Two cases, Llama 3 on estimated H100 costs (`models/llama.py`, roofline on the meta device: no
profiling noise):

* 70B on 64 GPUs, batch 512 (one pipeline: the search covers schedule x microbatches x stages per rank);
* 405B on 16,384 GPUs, 8 per node, batch 2048, `--dp auto` (the search adds every replica count and
  DDP / FSDP).

For each case, in fresh processes (so that one case's caches and peak memory do not reach the other):

* search: the costs are estimated once, then `assemble_plan` (the search, the polishing of the
  winner, the baselines) is timed alone: what the search costs on top of the costs;
* whole `planner plan`: the command as a user runs it, wall time and peak RSS (``os.wait4``'s
  ``ru_maxrss`` of that process).

Writes docs/search_time.md.

    python -m bench.search_time                    # measure this checkout
    python -m bench.search_time --source DIR --out X.md  # measure another tree's planner (e.g. an older commit)

With ``--published``: the search of every published row of docs/published_runs.md (``bench.published_rows``)
as that page runs it (``--tp auto --dp auto --dp-mode auto --recompute auto``, sequence parallelism auto,
memory capped at the GPU's), each in a fresh process, timed alone on costs estimated once; with the
choice's step on slower hardware (``planner.core.layout.robust``: collectives 1.3x, compute 1.1x) and,
where that changes the winner, the robust runner-up. ``--before DIR`` measures another tree's planner
in the same run, row by row beside this one (so the machine's load falls alike on both), and the
table is written between the page's published-rows markers:

    python -m bench.search_time --published --before /tmp/old   # every row, old tree and this one
    python -m bench.search_time --published --only megatron-5   # rows whose key starts so
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import DOCS, ROOT, cpu_model, host, last_line, run_timed, write_page

CASES: dict[str, list[str]] = {
    "70B, 64 GPUs, -b 512": ["--size", "70b", "--gpus", "64", "--gpu-type", "h100", "-b", "512"],
    "405B, 16,384 GPUs (8 per node), -b 2048, --dp auto": [
        "--size",
        "405b",
        "--gpus",
        "16384",
        "--gpus-per-node",
        "8",
        "--gpu-type",
        "h100",
        "-b",
        "2048",
        "--dp",
        "auto",
    ],
}

PAGE = """# Planning time at scale: Llama 3 70B and 405B

Written by `bench/search_time.py` on {today} ({host}, {cpu}, Python {python}; CPU only, and the
machine shared with other jobs, so the times are upper bounds rather than a quiet machine's).
Costs are estimated for H100s (`--gpu-type h100`, roofline on the meta device). Search: `assemble_plan`
alone on those costs (the search over every open combination, the polishing of the winner, the
baselines); peak RSS of that process includes the cost estimation. Whole command: `planner plan
models/llama.py ...` as a user runs it, wall time and peak RSS.

| case | costs s | search s | search peak RSS MB | whole `planner plan` s | its peak RSS MB | layouts evaluated / in all | result |
|---|---:|---:|---:|---:|---:|---:|---|
{rows}

Regenerate: `python -m bench.search_time`.
"""


def parse_args() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DOCS / "search_time.md")
    parser.add_argument("--source", type=Path, default=ROOT, help="the tree whose planner is measured")
    parser.add_argument("--child", choices=sorted(CASES), help=argparse.SUPPRESS)
    parser.add_argument("--published", action="store_true", help="time the published rows' searches instead")
    parser.add_argument(
        "--only", default="", help="with --published: the rows whose key starts with one of these (comma-separated)"
    )
    parser.add_argument("--before", type=Path, help="with --published: also time this tree's planner, row by row")
    parser.add_argument("--timeout", type=float, default=900.0, help="with --published: seconds a search may take")
    parser.add_argument("--published-child", help=argparse.SUPPRESS)
    return parser.parse_args()


def child(case: str) -> dict[str, object]:
    """Estimate one case's costs and time its search alone (run in a fresh process): what was measured."""
    import planner.core.layout.search as search_module
    from planner.api import default_threads, estimated_costs, model_ref
    from planner.capture.load import load_model_file
    from planner.core.assemble import Origin, assemble_plan
    from planner.core.layout.inputs import asked_of
    from planner.costs.tp_blocks import tensor_parallel_blocks
    from planner.errors import PlannerError
    from planner.report.throughput import throughput
    from planner.schema.request import PlanRequest

    args = CASES[case]
    values = dict(zip(args[::2], args[1::2]))
    request = PlanRequest.build(
        model_file=str(ROOT / "models" / "llama.py"),
        size=values["--size"],
        gpus=int(values["--gpus"]),
        gpus_per_node=int(values["--gpus-per-node"]) if "--gpus-per-node" in values else None,
        gpu_type=values["--gpu-type"],
        batch_size=int(values["-b"]),
        dp=values.get("--dp", 1),
        output=Path(tempfile.gettempdir()) / "search_time_plan.json",
        progress=False,
    )
    mf = load_model_file(request.model_file, request.size, request.overrides)
    t0 = time.perf_counter()
    costs = estimated_costs(mf, request, request.threads or default_threads(request.gpus))
    t_costs = time.perf_counter() - t0
    try:
        from bench.search_time_rows import counting_search
    except ImportError:  # --source: an older tree's bench comes first on the path, without it
        counted: dict[str, Any] = {"evaluated": "?", "layouts": "?"}
    else:
        counted = counting_search(search_module)
    origin = Origin(model_ref(mf, costs.traced, request), costs.profile, "bench")
    # the blocks as make_plan gives them to the search: with their tensor-parallel shares, counted in
    # the planning dtype (an older tree, --source, without the function: as it then did)
    try:
        from planner.api import tensor_parallel_split

        split = tensor_parallel_split(mf, request, costs, costs.blocks)
    except ImportError:
        split = tensor_parallel_blocks(mf, request, costs.traced, costs.blocks, hardware=costs.hardware, dtype="bf16")
    t0 = time.perf_counter()
    try:
        plan = assemble_plan(
            asked_of(request, costs.memory_bytes), split.blocks, costs.link, origin, ties=costs.ties, tp_plan=split.plan
        )
        lay = f"dp={plan.dp} ({plan.dp_mode}), " if plan.dp > 1 else ""
        lay += f"tp={plan.tp}, " if plan.tp > 1 else ""
        passes = f", k={plan.accumulation} passes" if plan.accumulation > 1 else ""
        result = (
            f"{lay}pp={plan.n_ranks}, {plan.schedule}, m={plan.n_microbatches}, v={plan.stages_per_rank}{passes}: "
            f"step {plan.prediction.step_time_s:.3g} s, MFU {throughput(plan).mfu or 0:.1%}"
        )
    except PlannerError as e:
        result = f"error: {e}"
    t_search = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"costs_s": t_costs, "search_s": t_search, "rss_mb": rss, "result": result, **counted}


WHOLE_TIMEOUT_S = 3600.0
"""A whole `planner plan` that runs longer than this is stopped (the targets are under a minute)."""


def whole_command(case: str, source: Path) -> tuple[float, float, str]:
    """Wall seconds and peak RSS (MB) of ``planner plan`` for ``case``, and its last line on failure."""
    # what the ``planner`` console script runs, from ``source`` (cli.console; cli.main in trees from
    # before it, which the installed script would not find)
    entry = "import sys, cli; sys.argv[0] = 'planner'; getattr(cli, 'console', cli.main)()"
    with tempfile.TemporaryDirectory() as tmp:
        argv = [sys.executable, "-c", entry, "plan", str(ROOT / "models" / "llama.py"), *CASES[case]]
        argv += ["-o", f"{tmp}/plan.json"]
        env = {**os.environ, "PYTHONPATH": str(source), "PYTHONDONTWRITEBYTECODE": "1"}
        code, wall, rss, out, err = run_timed(argv, WHOLE_TIMEOUT_S, Path(tmp), env)
    return wall, rss / 2**20, "" if code == 0 else last_line(err, out)


def main() -> None:
    """Measure every case in fresh processes, write the page."""
    args = parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    if args.published_child:
        from bench.search_time_rows import published_child

        print(json.dumps(published_child(args.published_child)))
        return
    if args.published:
        from bench.search_time_rows import time_published

        time_published(args.only, args.before, args.timeout, Path(__file__).resolve(), args.out)
        return
    rows = []
    for case in CASES:
        env = {**os.environ, "PYTHONPATH": f"{args.source}{os.pathsep}{ROOT}"}
        done = subprocess.run(
            # by path: with --source first on the path, its planner is the one imported
            [sys.executable, str(Path(__file__).resolve()), "--child", case],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        got = json.loads(done.stdout.strip().splitlines()[-1])
        wall, rss, error = whole_command(case, args.source)
        result = str(got["result"]).replace("|", "\\|")
        result = result if len(result) <= 160 else result[:160] + " ..."
        rows.append(
            f"| {case} | {got['costs_s']:.1f} | {got['search_s']:.2f} | {got['rss_mb']:.0f} | {wall:.1f}"
            f"{' (' + error + ')' if error and not result.startswith('error') else ''} | {rss:.0f} "
            f"| {got['evaluated']} / {got['layouts']} | {result} |"
        )
        print(rows[-1], flush=True)
    text = PAGE.format(
        today=dt.date.today().isoformat(),
        host=host(),
        cpu=cpu_model() or platform.processor() or "unknown CPU",
        python=platform.python_version(),
        rows="\n".join(rows),
    )
    write_page(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
