"""Checkpointing block by block on a GPU: each recompute mode planned, then trained by `planner run`, into docs/gpu_recompute.md.

    python -m bench.gpu_recompute              # on a machine with an NVIDIA GPU (about 9 minutes on an H100)
    python -m bench.gpu_recompute --dry-run    # the tiny model on this machine's CPU: the script's own check
    python -m bench.gpu_recompute --modes never,full --sources estimated   # some of the rows

docs/gpu_check.md put the roofline beside one GPU for plain training. This page does the same for
activation checkpointing (``--recompute never|selective|full|stage``, docs/recompute.md), the one
thing of the estimate that page did not cover: ``models/llama.py`` at the 8B width with two layers
(a sequence of 8,192 tokens, two sequences a step) is planned for the GPU it runs on, and each plan
is trained by ``planner run`` on that GPU, so the checkpoint regions, the selective policy and the
autocast are the runner's own. Each mode is planned twice:

* **estimated**: ``--gpu-type NAME`` (the roofline, as a user planning for GPUs they do not have);
* **measured**: profiled on this GPU by the planner's own profiler (``--dtype bf16``), which times
  each block's recomputation under the mode's policy.

Each row puts the plan's predicted step time and peak memory per rank beside the run's median step
(the first step and the memory-tracked step left out) and its peak allocated device memory.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
from pathlib import Path

import torch

from bench.common import DOCS, MODELS, PLANNER, gpu_type_of, plan_and_run, table, write_page

DOC = DOCS / "gpu_recompute.md"
MODES = ("never", "selective", "full", "stage")
# (size, overrides, batch, microbatches): the GPU case, and the dry run's
GPU_CASE = ("8b", {"n_layers": 2}, 2, 1)
DRY_CASE = ("tiny", {"n_layers": 2}, 4, 2)
GIB = 2**30


def _row(mode: str, source: str, argv: list[str], plan_path: Path, steps: int) -> list[str]:
    """Plan with ``argv`` and run it: one row of predicted against measured figures."""
    plan, run, error = plan_and_run([*argv, "-o", str(plan_path)], plan_path, steps, timeout_s=900)
    if plan is None or run is None:
        print(f"{mode} {source}: {error}", file=sys.stderr, flush=True)
        return [mode, source, error[:160], "", "", "", "", "", ""]
    predicted_s = plan.prediction.step_time_s
    predicted_b = plan.prediction.max_memory_bytes
    temps = ", ".join(f"{b.name} {(b.bwd_temp_bytes or 0) / 2**20:.0f}" for b in plan.blocks)
    print(f"  {mode} {source}: the plan's backward temporaries per block (MiB): {temps}", flush=True)
    peak = max(run.peak_device_bytes) if run.peak_device_bytes else 0
    tracked = [s.memory.peak_bytes for s in run.stages if s.memory is not None]
    row = [
        mode,
        source,
        f"{predicted_s * 1e3:.1f}",
        f"{run.median_step_s * 1e3:.1f}",
        f"{predicted_s / run.median_step_s:.2f}",
        f"{predicted_b / GIB:.2f}",
        f"{peak / GIB:.2f}" if peak else "-",
        f"{predicted_b / peak:.2f}" if peak else "-",
        f"{max(tracked) / GIB:.2f}" if tracked else "-",
    ]
    for stage in run.stages:  # where the step and the peak went, for reading the page's columns
        print(
            f"  {mode} {source}: run's fwd {stage.fwd_s * 1e3:.1f} ms, bwd {stage.bwd_s * 1e3:.1f} ms, optimizer "
            f"{stage.optimizer_s * 1e3:.1f} ms, clip {stage.clip_s * 1e3:.1f} ms a step",
            flush=True,
        )
        if stage.memory is not None:
            parts = sorted(stage.memory.peak_by_category.items(), key=lambda kv: -kv[1])
            row_parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in parts if v)
            print(f"  {mode} {source}: tracked peak by category (GiB): {row_parts}", flush=True)
    print(" | ".join(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="the tiny model on the CPU; print, write nothing")
    parser.add_argument("--out", type=Path, default=DOC, help="the page to write (default docs/gpu_recompute.md)")
    parser.add_argument("--steps", type=int, default=6, help="training steps of each run (default 6)")
    parser.add_argument(
        "--modes", default=",".join(MODES), help=f"recompute modes to run, comma-separated (default {','.join(MODES)})"
    )
    parser.add_argument(
        "--sources",
        default="estimated,measured",
        help="which plans of each mode: estimated (--gpu-type), measured (profiled here), or both (the default)",
    )
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    sources = set(args.sources.split(","))
    if not set(modes) <= set(MODES) or not sources <= {"estimated", "measured"}:
        print(f"--modes takes {', '.join(MODES)}; --sources estimated, measured", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        print("no CUDA device here: run on a GPU machine, or --dry-run", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(0) if cuda else "cpu (dry run)"
    gpu = (gpu_type_of(name) or "h100") if cuda else "h100"
    size, overrides, batch, micro = DRY_CASE if args.dry_run else GPU_CASE
    tmp = Path(tempfile.mkdtemp(prefix="gpu_recompute_"))
    common = [str(MODELS / "llama.py"), "--size", size, "--gpus", "1", "-b", str(batch), "-m", str(micro)]
    common += [f"--set={k}={v}" for k, v in overrides.items()] + ["-q"]
    rows = []
    for mode in modes:
        if "estimated" in sources:
            estimated = [PLANNER, "plan", *common, "--recompute", mode, "--gpu-type", gpu]
            rows.append(_row(mode, f"estimated ({gpu})", estimated, tmp / f"{mode}_est.json", args.steps))
        if "measured" in sources:
            measured = [PLANNER, "plan", *common, "--recompute", mode, "--dtype", "bf16"]
            rows.append(_row(mode, "measured here", measured, tmp / f"{mode}_meas.json", args.steps))
    headers = [
        "recompute",
        "plan",
        "predicted step ms",
        "run's median ms",
        "pred / run",
        "predicted peak GiB",
        "run's peak GiB",
        "pred / run",
        "tracked step GiB",
    ]
    body = table(rows, headers)
    shown = ", ".join(f"{k}={v}" for k, v in overrides.items())
    print(body)
    if args.dry_run:
        return 0
    head = (
        f"# Checkpointing block by block on a GPU: {name}\n\n"
        f"Written by `python -m bench.gpu_recompute` on {datetime.date.today()} (torch {torch.__version__}, CUDA "
        f"{torch.version.cuda}). `models/llama.py --size {size}` ({shown}), batch {batch} in {micro} microbatch(es), "
        f"one GPU, {args.steps} steps a run. How each row is made is in the script's docstring; pred / run above 1: "
        "the plan expected more than the run took. *run's peak*: the most device memory allocated over the run; "
        "*tracked step*: the tensors alive at the peak of the one step run under the memory tracker.\n\n"
    )
    write_page(args.out, head + body + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
