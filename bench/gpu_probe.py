"""`planner probe` on a GPU, and one-GPU plans from its file, the datasheet and a measurement beside a run, into docs/probe_gpu.md.

    python -m bench.gpu_probe              # on a machine with an NVIDIA GPU (about 4 minutes on an H200)
    python -m bench.gpu_probe --dry-run    # this machine's CPU, tiny shapes: the script's own check, no page

docs/probe.md left the probe's CUDA path unverified. This script runs the command line a user runs,
on the GPU it finds:

1. ``planner probe --gpus 1 -o default.json`` (the default GPU sweep: square and skinny GEMMs to 8192,
   copies to 256 MiB, attention, operator overhead), then ``planner probe models/llama.py --size 8b
   --set n_layers=2 --microbatch-size 1 --gpus 1 -o llama.json`` (GEMMs at that model's shapes): exit,
   wall time, last line;
2. the constants each file holds beside the shipped spec of that GPU (``--gpu-type h200``): the GEMM
   ceiling, the GEMM half-efficiency dimension, memory bandwidth, attention forward / backward and the
   host's time per operator (``dispatch_s``: a GPU probe's tiny-model measure);
3. two models (``PLANNED``: the Llama above, compute-bound, and a small GPT whose step is set by
   launching its operators), each planned four ways in bf16 on one GPU: measured on this GPU (no
   ``--gpu-type``), the shipped spec, and each probe file; then ``planner run`` of the measured plan,
   whose median step and peak device memory every prediction is set beside;
4. each of those models' plain eager training step in this process (bf16 autocast, AdamW; no
   runtime around it): forward, backward and optimizer medians, the GPU's kernel time in one step
   (torch.profiler), the operators a plan's roofline counts (views included), and the forward and
   backward time per operator beside each probe file's ``dispatch_s`` times that count.

One GPU has no collectives to measure (a probe of one rank has no one to talk to): the link figures of
these files are the spec's defaults and play no part in a one-GPU plan.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import DOCS, MODELS, ROOT, execute, gpu_type_of, last_line, table, write_page
from planner.core.levers.hardware import HardwareSpec, get_hardware
from planner.core.levers.hardware_file import read_hardware_file
from planner.schema.plan import Plan
from planner.schema.result import RunResult

DOC = DOCS / "probe_gpu.md"
CLI = [sys.executable, str(ROOT / "cli.py")]
TIMEOUT_S = 600.0
MEASURED = "measured on this GPU"


def _command(argv: list[str], rows: list[list[Any]]) -> bool:
    """Run ``planner ARGV``; add its row (command, exit, seconds, last line); True when it succeeded."""
    done = execute([*CLI, *argv], ROOT, TIMEOUT_S)
    shown = " ".join(a if not a.startswith("/") else Path(a).name for a in argv)
    line = last_line(done.stdout) if done.returncode == 0 else done.error
    line = re.sub(r"/tmp/gpu_probe_\w+/(model\d/)?", "", line)  # the page names the files, not this run's folder
    rows.append([f"planner {shown}", done.note or done.returncode, f"{done.seconds:.0f}", line])
    if done.returncode != 0:
        print(done.stdout[-2000:], done.stderr[-3000:], sep="\n", file=sys.stderr)
    return done.returncode == 0


def probes(tmp: Path, dry: bool) -> tuple[str, dict[str, Path]]:
    """Section 1: the two probes; their table and the files they wrote."""
    quick = ["--quick", "--device", "cpu"] if dry else []
    runs = {
        "default sweep": ["probe", "--gpus", "1", *quick, "--no-progress", "-o", str(tmp / "default.json")],
        "model GEMMs": ["probe", *_model_args(*(DRY_PLANNED if dry else PLANNED)[0][1:4]), "--microbatch-size", "1"]
        + ["--gpus", "1", *quick, "--no-progress"]
        + ["-o", str(tmp / "llama.json")],
    }
    rows: list[list[Any]] = []
    files = {name: Path(argv[-1]) for name, argv in runs.items() if _command(argv, rows)}
    return table(rows, ["command", "exit", "s", "last line"]), files


def _constants(hw: HardwareSpec, dtype: str) -> list[float]:
    """What a plan reads from a spec: GEMM ceiling, half-efficiency dimension, bandwidth, attention, host time."""
    peak = hw.peak_flops.get(dtype, float("nan"))
    return [
        peak * hw.matmul_efficiency / 1e12,
        float(hw.gemm_half_dim),
        hw.memory_Bps * hw.memory_efficiency / 1e9,
        peak * hw.attention_efficiency(backward=False) / 1e12,
        peak * hw.attention_efficiency(backward=True) / 1e12,
        hw.dispatch_s * 1e6,
    ]


def constants(files: dict[str, Path], shipped: HardwareSpec, dtype: str) -> str:
    """Section 2: each file's constants beside the shipped spec's (and their ratio)."""
    names = [
        f"{dtype} GEMM ceiling, TFLOP/s",
        "GEMM half-efficiency dim",
        "memory GB/s",
        "attention fwd, TFLOP/s",
        "attention bwd, TFLOP/s",
        "host time per operator (dispatch_s), us",
    ]
    ship = _constants(shipped, dtype)
    found = {name: _constants(read_hardware_file(path).spec, dtype) for name, path in files.items()}
    rows = []
    for i, what in enumerate(names):
        row: list[Any] = [what]
        for values in found.values():
            ratio = values[i] / ship[i] if ship[i] else float("nan")
            row += [f"{values[i]:,.4g}", f"{ratio:.2f}"]
        rows.append([*row, f"{ship[i]:,.4g}"])
    headers = ["constant"]
    for name in found:
        headers += [f"probe: {name}", "/ shipped"]
    return table(rows, [*headers, f"shipped `{shipped.name}`"])


# The models planned and run (section 3): a name, the model file, its size and overrides, samples a
# step. The first is compute-bound (its GEMMs and attention set the step), and the model-shaped probe
# measures its GEMMs; the second is small enough that the host issuing its operators sets the step,
# which is what a spec's dispatch_s stands for.
Model = tuple[str, str, str, dict[str, Any], int]  # name, file, size, overrides, samples a step
PLANNED: list[Model] = [
    ("Llama 3 8B widths, 2 layers, 1 x 8,192 tokens", "llama.py", "8b", {"n_layers": 2}, 1),
    ("GPT tutorial (512 wide, 8 layers), 8 x 500 tokens", "gpt.py", "tutorial", {}, 8),
]
DRY_PLANNED: list[Model] = [
    ("Llama tiny", "llama.py", "tiny", {}, 1),
    ("GPT tiny", "gpt.py", "tiny", {}, 8),
]


def _model_args(file: str, size: str, overrides: dict[str, Any]) -> list[str]:
    """The command-line arguments naming a model: its file, size and overrides."""
    sets = [a for k, v in overrides.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    return [str(MODELS / file), "--size", size, *sets]


def _planned(tmp: Path, model: list[str], batch: int, ways: dict[str, list[str]], dry: bool) -> tuple[list[Any], str]:
    """One model planned every way, then its measured plan run: the commands' rows and the predictions' table."""
    base = [
        "plan",
        *model,
        "--gpus",
        "1",
        "-b",
        str(batch),
        "--microbatches",
        "1",
        "--dtype",
        "fp32" if dry else "bf16",
    ]
    rows: list[list[Any]] = []
    made: dict[str, Plan] = {}
    for i, (name, extra) in enumerate(ways.items()):
        path = tmp / f"plan{i}.json"
        if _command([*base, *extra, "-o", str(path)], rows):
            made[name] = Plan.load(path)
    run: RunResult | None = None
    if MEASURED in made:
        out = tmp / "run.json"
        if _command(["run", str(tmp / "plan0.json"), "--steps", "12", "--no-checkpoint", "-o", str(out)], rows):
            run = RunResult.load(out)
    step = run.median_step_s if run is not None else None
    peak = max(run.peak_device_bytes) if run is not None and run.peak_device_bytes else None
    lines = []
    for name, plan in made.items():
        p = plan.prediction
        lines.append(
            [
                name,
                f"{p.step_time_s * 1e3:.2f}",
                f"{p.step_time_s / step:.2f}" if step else "-",
                f"{p.max_memory_bytes / 2**30:.2f}",
                f"{p.max_memory_bytes / peak:.2f}" if peak else "-",
            ]
        )
    measured = f"{step * 1e3:.2f} ms" if step else "no run"
    measured += f", peak {peak / 2**30:.2f} GiB" if peak else ""
    head = ["plan", "predicted step ms", "/ run", "predicted peak GiB", "/ run"]
    return rows, f"`planner run`: median step {measured}.\n\n{table(lines, head)}"


def plans(tmp: Path, files: dict[str, Path], shipped: str, dry: bool) -> str:
    """Section 3: each model planned four ways, then its measured plan run; predictions beside the run."""
    ways = {MEASURED: [], f"`--gpu-type {shipped}`": ["--gpu-type", shipped]}
    ways.update({f"probe file ({name})": ["--gpu-type", str(path)] for name, path in files.items()})
    rows: list[list[Any]] = []
    parts = []
    for i, (title, file, size, overrides, batch) in enumerate(DRY_PLANNED if dry else PLANNED):
        folder = tmp / f"model{i}"
        folder.mkdir()
        found, text = _planned(folder, _model_args(file, size, overrides), batch, ways, dry)
        rows += found
        parts.append(f"### {title}\n\n{text}\n")
    return table(rows, ["command", "exit", "s", "last line"]) + "\n\n" + "\n".join(parts)


def _eager_step(
    file: str, size: str, overrides: dict[str, Any], batch: int, device: torch.device, dry: bool
) -> dict[str, float]:
    """A model's plain eager step (bf16 autocast, AdamW) on ``device``: forward, backward and optimizer
    medians (s), the operators the roofline counts in forward and backward, and the GPU's kernel time
    in one step (torch.profiler; 0 on a CPU)."""
    from torch.profiler import ProfilerActivity, profile

    from planner.capture.load import load_model_file
    from planner.costs.roofline import Roofline, Tally

    mf = load_model_file(MODELS / file, size, overrides)
    model = mf.build(seed=0).to(device)
    inputs, target = mf.batch(batch, seed=0)
    inputs, target = tuple(x.to(device) for x in inputs), target.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    cuda = device.type == "cuda"
    dtype = torch.float32 if dry else torch.bfloat16

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def forward() -> torch.Tensor:
        with torch.autocast(device.type, dtype=dtype, enabled=not dry):
            return mf.loss_fn(model(*inputs), target)

    times: dict[str, list[float]] = {"fwd": [], "bwd": [], "opt": []}
    for i in range(3 if dry else 15):
        sync()
        t0 = time.perf_counter()
        loss = forward()
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        t3 = time.perf_counter()
        if i >= (1 if dry else 5):
            times["fwd"].append(t1 - t0)
            times["bwd"].append(t2 - t1)
            times["opt"].append(t3 - t2)
    counter = Roofline(get_hardware("h200"), "bf16")  # counts operators as a plan's estimate does
    with counter.phase(Tally()) as fwd_ops:
        loss = forward()
    with counter.phase(Tally()) as bwd_ops:
        loss.backward()
    opt.zero_grad(set_to_none=True)
    kernels = 0.0
    if cuda:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            forward().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
        kernels = sum(e.self_device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA") / 1e6
    found: dict[str, float] = {k: statistics.median(v) for k, v in times.items()}
    return {**found, "ops": float(fwd_ops.ops + bwd_ops.ops), "kernels": kernels}


def eager_steps(device: torch.device, probe_files: dict[str, Path], dry: bool) -> str:
    """Section 4: each model's plain eager step split into its parts, beside what a probe file's
    host time per operator (``dispatch_s``) would charge for the operators the roofline counts."""
    overhead = {name: read_hardware_file(path).spec.dispatch_s for name, path in probe_files.items()}
    rows = []
    for title, file, size, overrides, batch in DRY_PLANNED if dry else PLANNED:
        got = _eager_step(file, size, overrides, batch, device, dry)
        fwd_bwd = got["fwd"] + got["bwd"]
        row = [title, *(f"{got[k] * 1e3:.2f}" for k in ("fwd", "bwd", "opt", "kernels")), f"{got['ops']:.0f}"]
        row.append(f"{fwd_bwd / got['ops'] * 1e6:.1f}")
        row += [f"{got['ops'] * o * 1e3:.1f}" for o in overhead.values()]
        rows.append(row)
    head = ["model", "fwd ms", "bwd ms", "optimizer ms", "GPU kernels ms (one step)", "operators (fwd + bwd)"]
    head.append("fwd + bwd per operator, us")
    head += [f"operators x dispatch_s ({name}), ms" for name in overhead]
    return table(rows, head)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU; print, write nothing")
    parser.add_argument("--out", type=Path, default=DOC, help="the page to write (default docs/probe_gpu.md)")
    parser.add_argument("--keep", type=Path, help="also copy the probes' hardware files and the run into this folder")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        print("no CUDA device here: run on a GPU machine, or --dry-run", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(0) if cuda else "cpu (dry run)"
    shipped = gpu_type_of(name) if cuda else "h200"
    if shipped is None:
        print(f"{name}: no shipped spec of that name; comparing with h100", file=sys.stderr)
        shipped = "h100"
    tmp = Path(tempfile.mkdtemp(prefix="gpu_probe_"))
    started = datetime.datetime.now(datetime.timezone.utc)
    first, files = probes(tmp, args.dry_run)
    print(first, flush=True)
    second = constants(files, get_hardware(shipped), "fp32" if args.dry_run else "bf16") if files else "no file"
    print(second, flush=True)
    third = plans(tmp, files, shipped, args.dry_run)
    print(third, flush=True)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    fourth = eager_steps(device, files, args.dry_run)
    print(fourth, flush=True)
    if args.keep is not None:  # the raw sweeps and the run, for a reader of the page
        args.keep.mkdir(parents=True, exist_ok=True)
        for path in [*files.values(), tmp / "model0" / "run.json"]:
            if path.exists():
                shutil.copy(path, args.keep / path.name)
    if args.dry_run:
        return 0
    minutes = (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds() / 60
    head = (
        f"# `planner probe` on a GPU: {name}\n\n"
        f"Written by `python -m bench.gpu_probe` on {datetime.date.today()} in {minutes:.1f} minutes (torch "
        f"{torch.__version__}, CUDA {torch.version.cuda}); the script's docstring says what each section runs.\n"
    )
    body = (
        f"\n## The probes\n\n{first}\n"
        f"\n## The files beside the shipped `{shipped}` spec\n\n{second}\n"
        f"\n## Plans four ways beside a run\n\n{third}\n"
        f"\n## Where the small model's step goes: plain eager, in this process\n\n{fourth}\n"
    )
    write_page(args.out, head + body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
