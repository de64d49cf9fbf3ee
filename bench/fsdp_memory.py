"""FSDP block by block against FSDP per stage: predicted against measured peak memory and step, here.

For each FSDP unit (a stage, a block) and recompute mode (never, full), in fp32 and in bf16: plan the
model as two FSDP replicas of a one-rank pipeline (``--gpus 2 --dp 2 --dp-mode fsdp --fsdp-units
UNITS [--dtype bf16]``, measured profile on this CPU), train the plan for real on gloo ranks, and set
the predicted peak beside the peak ``MemTracker`` saw during one tracked step, and the predicted step
beside the measured median. Runs one after another on the same machine. Writes docs/fsdp_units.md.

    python -m bench.fsdp_memory            # all cases, both dtypes (about 8 minutes)
    python -m bench.fsdp_memory --quick    # block units only, fp32, 3 steps (a smoke test of the script)
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import tempfile
from pathlib import Path

import torch

from bench.common import DOCS, MODELS, host, planned_peaks, table, tiny_gpt_request, write_page
from planner.api import make_plan
from planner.errors import InfeasibleError
from planner.report.throughput import throughput
from planner.schema.request import PlanRequest

# gpt.py where the weights are most of a rank's memory (wide layers, short sequences), so what
# sharding block by block saves is visible next to the activations
GPT = {"dim": 256, "n_layers": 8, "n_heads": 4, "ffn_dim": 1024, "vocab_size": 4000, "seq_len": 64}
GPUS, BATCH = 2, 8
# (units, recompute, microbatches, schedule)
CASES = (
    ("stage", "never", 2, "gpipe"),
    ("block", "never", 2, "gpipe"),
    ("stage", "never", 2, "1f1b"),
    ("block", "never", 2, "1f1b"),
    ("block", "full", 2, "gpipe"),
    ("stage", "full", 1, "gpipe"),
    ("block", "full", 1, "gpipe"),
)
DTYPES = ("fp32", "bf16")
HEADERS = [
    "dtype",
    "units",
    "recompute",
    "microbatches",
    "schedule",
    "predicted MB",
    "measured peak MB",
    "error",
    "predicted step ms",
    "measured step ms",
]

PAGE = """# FSDP block by block: predicted against measured

Written by `python -m bench.fsdp_memory` on {today} ({host}, torch {torch}).

`models/gpt.py` with `{overrides}` as {gpus} FSDP replicas of a one-rank pipeline (`--gpus {gpus}
--dp {gpus} --dp-mode fsdp`), batch {batch}, planned with a measured profile here under
`--fsdp-units UNITS --recompute MODE -m M --schedule S` (and `--dtype bf16` for the bf16 rows), then
trained for {steps} steps on gloo. The predicted
peak (the plan's, `planner.core.split.stage_model.MemoryParts.peak`) beside the peak
`torch.distributed._tools.mem_tracker.MemTracker` saw during one tracked step; the predicted step
beside the median measured step (the first step and the tracked one left out).

`stage`: the stage is one `fully_shard` unit, gathered at the first forward and kept unsharded
(parameters and gradients) until the last backward. `block`: every block its own unit, resharded
after its forward and its backward, its gradients reduce-scattered at once: the model counts the
unit computing, the next one prefetched and the unit's gradients, `3 x` the largest unit's
parameter bytes, instead of the stage's (`2 x` its bytes in fp32; in bf16 `2 P + 4 N` with `N` parameters, below). With one pass a step FSDP's gradients are new every
step, so the unsharded ones count only from a stage's first backward on (under GPipe, with one
microbatch's activations fewer) and a stage unit's sharded share only from its reduce-scatter after
the last backward (docs/architecture.md, memory rules).

bf16: FSDP gathers the weights in bf16 and sums and reduce-scatters the gradients in fp32
(`MixedPrecisionPolicy`, `planner/run/wrappers.fsdp_policy`), so the stages save no autocast copies
of their weights; a stage unit holds its bf16 weights, its fp32 gradient sums and one backward's bf16
gradients unsharded (`planner/core/split/stage_model.unsharded_bytes`). Before that policy (fp32 weights
gathered, a bf16 copy of each saved per microbatch) the same bf16 runs peaked at 176.9, 136.4,
176.9, 122.0, 102.7, 163.8 and 98.4 MB, in the order of the table (measured here on 28 Nov 2026).
A profile measured under autocast counts the fp32 weights; an FSDP plan counts its gathered units at
2 bytes a parameter (`planner/core/levers/data_parallel.as_gathered`). A stage unit's sharded gradients
are made by its reduce-scatter after the last backward, when no activation is left, so the model
counts them only from then on (`MemoryParts.reduced`); before it counted them from the first backward,
and the stage-unit rows that recompute nothing were over-predicted by 11.9 % (fp32) and 12.4 % (bf16),
mean error 5.1 % over the 14 runs (measured here on 28 Nov 2026).

{table}

Mean absolute memory error: {mae:.1f}% over {n} runs (fp32 stage units: {mae_stage:.1f}%, fp32 block units:
{mae_block:.1f}%; bf16: {mae_bf16:.1f}%).

## At scale (estimated for absent GPUs, the roofline costs of `planner/core/levers/hardware.py`)

The same choice for the runs of issue 27, planned by name with `--fsdp-units stage` and then
`--fsdp-units block` (everything else as given; `--scale-only` recomputes this table alone):

{scale}
"""

# (what, model file, size, options): FSDP runs whose units decide whether they fit
SCALE = [
    (
        "Llama 3 70B, FSDP over 64 A100-80G, local batch 1, full recompute",
        "llama.py",
        "70b",
        dict(gpus=64, dp=64, dp_mode="fsdp", recompute="full", batch_size=64, gpu_type="a100-80g"),
    ),
    (
        "Llama 3 70B, HSDP over 64 A100-80G in groups of 8 (one node), local batch 1, full recompute",
        "llama.py",
        "70b",
        dict(gpus=64, dp=64, dp_mode="hsdp", recompute="full", batch_size=64, gpu_type="a100-80g"),
    ),
    (
        "Llama 3 70B, HSDP over 64 A100-80G in groups of 32 (4 nodes), local batch 1, full recompute",
        "llama.py",
        "70b",
        dict(gpus=64, dp=64, dp_mode="hsdp", dp_shard=32, recompute="full", batch_size=64, gpu_type="a100-80g"),
    ),
    (
        "Llama 3.1 8B, FSDP over 8 H100 (96 GB HBM2e), local batch 2, selective recompute, FlashAttention-2 "
        "(torchtitan's run)",
        "llama.py",
        "8b",
        dict(
            gpus=8,
            dp=8,
            dp_mode="fsdp",
            recompute="selective",
            batch_size=16,
            gpu_type="h100-hbm2e",
            attention_kernel="flash",
            memory_limit_gib=89.0,
        ),
    ),
]
SCALE_HEADERS = [
    "run",
    "units",
    "plan",
    "peak GiB",
    "step ms",
    "FSDP traffic not hidden, ms",
    "tokens/s per GPU",
    "MFU",
]


def parse_args() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="steps per run (the first is warm-up)")
    parser.add_argument("--quick", action="store_true", help="3 steps, block units only")
    parser.add_argument("--out", type=Path, default=DOCS / "fsdp_units.md")
    parser.add_argument(
        "--scale-only", action="store_true", help="recompute only the at-scale table of an existing page (no runs)"
    )
    return parser.parse_args()


def rewrite_scale(path: Path) -> None:
    """Replace the at-scale table of the page at ``path`` (the first table after its heading) by a new one."""
    text = path.read_text()
    head = text.index("## At scale")
    lines = text[head:].split("\n")
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    last = next((i for i in range(first, len(lines)) if not lines[i].startswith("|")), len(lines))
    lines[first:last] = table(at_scale(), SCALE_HEADERS).split("\n")
    write_page(path, text[:head] + "\n".join(lines))


def main() -> None:
    """Plan and run every case, write the page."""
    args = parse_args()
    if args.scale_only:
        rewrite_scale(args.out)
        return
    steps = 3 if args.quick else args.steps
    cases = [c for c in CASES if c[0] == "block"][:1] if args.quick else list(CASES)
    rows: list[list[object]] = []
    errors: dict[str, list[float]] = {"stage": [], "block": [], "bf16": []}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in DTYPES[:1] if args.quick else DTYPES:
            for units, mode, m, schedule in cases:
                rows += _case(Path(tmp), dtype, units, mode, m, schedule, steps, errors)
    every = [e for v in errors.values() for e in v]
    text = PAGE.format(
        today=dt.date.today().isoformat(),
        host=host(),
        torch=torch.__version__,
        overrides=GPT,
        gpus=GPUS,
        batch=BATCH,
        steps=steps,
        table=table(rows, HEADERS),
        mae=statistics.mean(every) if every else float("nan"),
        n=len(every),
        scale=table(at_scale(), SCALE_HEADERS),
        **{f"mae_{units}": statistics.mean(v) if v else float("nan") for units, v in errors.items()},
    )
    write_page(args.out, text)
    print(text)


def _case(
    tmp: Path, dtype: str, units: str, mode: str, m: int, schedule: str, steps: int, errors: dict[str, list[float]]
) -> list[list[object]]:
    """Plan and train one case; its rows (one per tracked stage), its errors added to ``errors``."""
    path = tmp / f"{dtype}-{units}-{mode}-{m}-{schedule}.json"
    request = tiny_gpt_request(
        GPT,
        path,
        gpus=GPUS,
        dp=GPUS,
        dp_mode="fsdp",
        fsdp_units=units,
        batch_size=BATCH,
        microbatches=m,
        schedule=schedule,
        recompute=mode,
        dtype=dtype,
    )
    print(f"--dtype {dtype} --fsdp-units {units} --recompute {mode} -m {m} --schedule {schedule}", flush=True)
    plan, result, peaks = planned_peaks(request, path, steps)
    rows: list[list[object]] = []
    for st, memory, err in peaks:
        errors["bf16" if dtype == "bf16" else units].append(abs(err))
        rows.append(
            [dtype, units, mode, m, schedule, f"{st.memory_bytes / 2**20:.1f}", f"{memory.peak_bytes / 2**20:.1f}"]
            + [f"{err:+.1f}%", f"{plan.prediction.step_time_s * 1e3:.0f}", f"{result.median_step_s * 1e3:.0f}"]
        )
    return rows


def at_scale() -> list[list[str]]:
    """The ``SCALE`` runs under stage and block units: what fits and what it is predicted to do."""
    rows: list[list[str]] = []
    for what, name, size, options in SCALE:
        for units in ("stage", "block"):
            print(f"{what}: --fsdp-units {units}", flush=True)
            request = PlanRequest.build(
                model_file=MODELS / name, size=size, fsdp_units=units, progress=False, **options
            )
            try:
                plan = make_plan(request)
            except InfeasibleError as e:
                rows.append([what, units, f"none: {str(e)[:140]}", "", "", "", "", ""])
                continue
            t = throughput(plan)
            pred = plan.prediction
            rows.append(
                [what, units, f"{plan.schedule}, pp {plan.n_ranks}, m {plan.n_microbatches}"]
                + [
                    f"{pred.max_memory_bytes / 2**30:.1f}",
                    f"{pred.step_time_s * 1e3:,.0f}",
                    f"{pred.dp_reduce_s * 1e3:,.0f}",
                ]
                + [
                    f"{t.tokens_per_s_per_gpu:,.0f}" if t.tokens_per_s_per_gpu else "",
                    f"{100 * t.mfu:.1f}%" if t.mfu else "",
                ]
            )
    return rows


if __name__ == "__main__":
    main()
