"""What the tutorials' speed levers change in the cost model on this machine: autocast and compile.

Profiles `models/gpt.py` and `models/encoder_lm.py` (size tiny, 2 ranks, batch 32, microbatches of
8) four ways -- fp32 eager (today's default), `--dtype bf16` (torch.autocast), `--compile`
(torch.compile per block) and both -- and reports per block the forward and backward time and the
bytes saved for backward and sent across the cut after it, then per configuration the predicted
step (1F1B with 4 microbatches, the same schedule for all, and the joint search's own choice),
the peak memory, and how long profiling and compiling took.

Compilation is timed with an empty inductor cache (a fresh TORCHINDUCTOR_CACHE_DIR; what a first
`planner plan --compile` pays), and once more with the cache that run filled (what a second plan
of the same model pays).

Writes docs/speed_levers.md.

    python -m bench.speed_levers          # about 2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import tempfile
import time
from pathlib import Path

# before torch is imported: compile times below are those of an empty cache
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="speed_levers_inductor_"))

import torch  # noqa: E402

from bench.common import DOCS, MODELS, ROOT, host, plan_on_costs, table, write_page  # noqa: E402
from planner.api import Costs, default_threads, measured_costs  # noqa: E402
from planner.capture.load import ModelFile, load_model_file  # noqa: E402
from planner.schema.plan import Plan  # noqa: E402
from planner.schema.request import PlanRequest  # noqa: E402

CREATED = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
GPUS, BATCH, MICROBATCHES = 2, 32, 4
CONFIGS: list[tuple[str, str | None, bool]] = [
    ("fp32", None, False),
    ("bf16", "bf16", False),
    ("compiled", None, True),
    ("bf16 + compiled", "bf16", True),
]


def _plan(request: PlanRequest, costs: Costs, mf: ModelFile) -> Plan:
    return plan_on_costs(request, costs, mf, created=CREATED)


def _measure(model: Path, autocast: str | None, compile: bool, repeats: int, out: Path) -> dict[str, object]:
    """Profile once (the joint search's request: it fits the scaling too), plan twice on those costs."""
    request = PlanRequest.build(
        model_file=model,
        gpus=GPUS,
        size="tiny",
        batch_size=BATCH,
        dtype=autocast,
        compile=compile,
        repeats=repeats,
        warmup=2,
        progress=False,
        output=out,
    )
    mf = load_model_file(model, "tiny", {})
    start = time.perf_counter()
    costs = measured_costs(mf, request, default_threads(GPUS), None)
    wall = time.perf_counter() - start
    fixed = _plan(request.model_copy(update={"schedule": "1f1b", "microbatches": MICROBATCHES}), costs, mf)
    searched = _plan(request, costs, mf)
    return {"costs": costs, "wall": wall, "fixed": fixed, "searched": searched}


def _cell(values: list[float], fmt: str) -> str:
    return " / ".join(format(v, fmt) for v in values)


def _block_table(runs: dict[str, dict[str, object]]) -> str:
    blocks = {name: run["costs"].blocks for name, run in runs.items()}  # type: ignore[attr-defined]
    rows = []
    for k, b in enumerate(blocks["fp32"]):
        of = [blocks[name][k] for name in blocks]
        rows.append(
            [
                b.name,
                _cell([c.fwd_s * 1e3 for c in of], ".2f"),
                _cell([c.bwd_s * 1e3 for c in of], ".2f"),
                _cell([(c.bwd_input_s or 0.0) * 1e3 + (c.bwd_weight_s or 0.0) * 1e3 for c in of], ".2f"),
                _cell([c.activation_bytes / 1024 for c in of], ".0f"),
                _cell([(c.output_bytes if k == len(blocks["fp32"]) - 1 else c.cut_bytes) / 1024 for c in of], ".0f"),
            ]
        )
    order = " / ".join(blocks)
    headers = [
        "block",
        f"fwd ms ({order})",
        "bwd ms",
        "I + W ms (two-part backward)",
        "saved KiB",
        "cut KiB (last: output)",
    ]
    return table(rows, headers)


def _summary_table(runs: dict[str, dict[str, object]], warm: dict[str, float]) -> str:
    rows = []
    for name, run in runs.items():
        fixed: Plan = run["fixed"]  # type: ignore[assignment]
        searched: Plan = run["searched"]  # type: ignore[assignment]
        profile = fixed.profile
        compile_s = "" if profile.compile_s is None else f"{profile.compile_s:.1f}"
        if name in warm:
            compile_s += f" ({warm[name]:.1f} warm)"
        failures = len(profile.compile_failures)
        layers = [b for b in fixed.blocks if b.is_layer]
        split = sum((b.bwd_input_s or 0.0) + (b.bwd_weight_s or 0.0) for b in layers) / sum(b.bwd_s for b in layers)
        rows.append(
            [
                name,
                f"{run['wall']:.1f}",  # type: ignore[str-format]
                compile_s + (f"; {failures} failed" if failures else ""),
                f"{split:.2f}",
                f"{max(s.time_s for s in fixed.stages) * 1e3:.2f}",
                f"{fixed.prediction.step_time_s * 1e3:.2f}",
                f"{fixed.prediction.max_memory_bytes / 2**20:.1f}",
                f"{searched.schedule}, m={searched.n_microbatches}: {searched.prediction.step_time_s * 1e3:.2f}",
            ]
        )
    headers = [
        "profile",
        "profiling s",
        "compile s (cold cache)",
        "layers' (I + W) / B",
        "slowest stage ms/mb",
        "step ms (1f1b, m=4)",
        "max mem MB",
        "joint search: choice, step ms",
    ]
    return table(rows, headers)


def _layer_ratio(runs: dict[str, dict[str, object]], config: str, of: str) -> float:
    """Sum over the repeated layers of ``of`` (fwd_s, bwd_s, activation_bytes) in ``config`` / in fp32."""

    def total(name: str) -> float:
        plan: Plan = runs[name]["fixed"]  # type: ignore[assignment]
        return float(sum(getattr(b, of) for b in plan.blocks if b.is_layer))

    return total(config) / total("fp32")


def _reading(stats: dict[str, dict[str, dict[str, object]]]) -> str:
    """The notes under the tables, their numbers taken from this run."""

    def each(config: str, of: str, fmt: str = ".1f") -> str:
        return " and ".join(f"{_layer_ratio(runs, config, of):{fmt}}x ({name})" for name, runs in stats.items())

    bf16_bwd = min(_layer_ratio(runs, "bf16", "bwd_s") for runs in stats.values())
    compiled = [_layer_ratio(runs, "compiled", t) for runs in stats.values() for t in ("fwd_s", "bwd_s")]
    return f"""- **bf16 autocast on this CPU** ({_cpu_bf16()}): the layers' backward takes
  {each("bf16", "bwd_s")} the fp32 time, their forward {each("bf16", "fwd_s")}.
  {"Slower, not faster: autocast's casts and the bf16 backward kernels cost more than they save at these sizes. " if bf16_bwd > 1.1 else ""}The plan
  counts what was measured; on a GPU with bf16 tensor cores the same flag measures the speed-up.
  Nothing is tuned away.
- **Saved activations shrink**: {each("bf16", "activation_bytes", ".2f")} the fp32 bytes per layer (bf16
  copies of the matmul inputs and weights instead of fp32 inputs), so the peak memory drops. The weight
  copies count: autocast casts them once per autocast region, and a pipeline stage runs one region per
  microbatch, so every microbatch in flight holds its own set.
- **What crosses a cut does not shrink in these two models**: their residual stream stays fp32 (each
  layer adds a bf16 sublayer output to its fp32 input, which promotes to fp32, and the encoder layer's
  closing `LayerNorm` keeps its input's dtype), so the next block receives fp32. The encoder LM's
  logits are bf16 (its output layer is a plain `Linear`); GPT's are fp32 (its forward ends in
  `.float()`). Each is measured per block, never assumed.
- **Compiled blocks**: forward {each("compiled", "fwd_s")}, backward {each("compiled", "bwd_s")} the
  eager time{": not faster here (not investigated further; each block is about a millisecond on one thread)" if min(compiled) > 0.9 else ""}.
  Compiled, the two-part backward of the zero-bubble schedules (I, then W) runs the block's single
  compiled backward node once per pass, so I + W is about twice B (the `layers' (I + W) / B` column;
  eager blocks split it for less); the search sees it.
- **Compile time** dominates a compiled plan with an empty inductor cache: the first model of the
  run also pays inductor's one-time start-up in the process, the second only its own blocks; with
  the cache filled by the first plan, a second plan of the same model compiles in about a second.
  Identical layers are compiled and measured once (`planner.costs.estimate.structure_key`).
- **The joint search column** rescales the costs to other microbatch sizes with a fixed share fitted
  from two timings of the whole (eager) model; on this shared machine that fit is noisy, so compare
  configurations in the fixed 1F1B column."""


def _cpu_bf16() -> str:
    """Whether this CPU has bf16 instructions (AVX512-BF16) and matrix tiles (AMX), from /proc/cpuinfo."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return "flags unknown"
    has = [f for f in ("avx512_bf16", "amx_bf16") if f" {f}" in flags]
    missing = [f for f in ("avx512_bf16", "amx_bf16") if f not in has]
    return ", ".join([*(f"has {f}" for f in has), *(f"no {f}" for f in missing)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per block (median kept)")
    parser.add_argument("--out", type=Path, default=DOCS / "speed_levers.md")
    args = parser.parse_args()
    models = [MODELS / "gpt.py", MODELS / "encoder_lm.py"]
    total = time.perf_counter()
    sections = []
    stats: dict[str, dict[str, dict[str, object]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            runs = {}
            for name, autocast, compile in CONFIGS:
                print(f"{model.name}: {name} ...", flush=True)
                runs[name] = _measure(model, autocast, compile, args.repeats, Path(tmp) / "plan.json")
            warm = {}
            for name, autocast, compile in CONFIGS:
                if compile:  # the same plan again: the inductor cache now holds these blocks
                    again = _measure(model, autocast, compile, args.repeats, Path(tmp) / "plan.json")
                    warm[name] = again["fixed"].profile.compile_s  # type: ignore[attr-defined]
            stats[model.stem] = runs
            rel = model.relative_to(ROOT)
            sections.append(
                f"## `{rel} --size tiny`\n\nPer block (microbatch of {BATCH // MICROBATCHES} samples; "
                f"{' / '.join(runs)} in each cell):\n\n{_block_table(runs)}\n\n"
                f"Per configuration (2 ranks, batch {BATCH}):\n\n{_summary_table(runs, warm)}\n"
            )
    elapsed = time.perf_counter() - total
    text = f"""# Speed levers: autocast and torch.compile in the cost model

Written by `bench/speed_levers.py` on {CREATED[:10]} ({host()},
torch {torch.__version__}, {default_threads(GPUS)} thread(s) per rank as `planner plan --gpus {GPUS}`
profiles; {elapsed:.0f} s in all). What `planner plan MODEL --gpus {GPUS} --size tiny` measures with
`--dtype bf16` (every block under `torch.autocast("cpu", dtype=torch.bfloat16)`; parameters,
gradients and optimizer state stay fp32), with `--compile` (every block profiled as
`torch.compile(block)`, identical layers sharing one measurement), and with both. Times are medians
of {args.repeats} runs on a shared 2-core VM (other work ran beside it): differences of 20 % between
runs of the same block are noise here.

{chr(10).join(sections)}
## Reading the figures

{_reading(stats)}

Regenerate: `python -m bench.speed_levers`.
"""
    write_page(args.out, text)
    print(f"wrote {args.out} in {elapsed:.0f} s")


if __name__ == "__main__":
    main()
