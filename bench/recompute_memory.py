"""Checkpointing block by block: predicted against measured peak memory and step, on this machine.

For each recompute mode (never, selective, full) and schedule: plan the model with that mode on
every stage (``--recompute MODE``, measured profile on this CPU), train the plan for real on gloo
ranks, and set each stage's predicted peak beside the peak ``MemTracker`` saw during one tracked
step, and the predicted step beside the measured median. Runs one after another on the same
machine. Writes docs/recompute.md.

    python -m bench.recompute_memory            # all cases
    python -m bench.recompute_memory --quick    # one schedule, 3 steps (a smoke test of the script)
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import tempfile
from pathlib import Path

import torch

from bench.common import DOCS, host, planned_peaks, table, tiny_gpt_request, write_page

# gpt.py at a size where a stage's activations are most of its memory (long sequences, wide MLP),
# so what checkpointing saves is visible next to the weights and optimizer state
GPT = {"dim": 128, "n_layers": 8, "n_heads": 4, "ffn_dim": 1024, "vocab_size": 4000, "seq_len": 256}
GPUS, BATCH, MICROBATCHES = 2, 16, 4
SPLIT = "4,4"  # layers per stage (--compare), the embedding with the first and the head with the last
MODES = ("never", "selective", "full", "stage", "selective:2", "full:2")
# (MODE:2: every stage recomputes only its first two blocks, set in the plan as a user would edit
# plan.json; the plan is made with MODE and predicted again)
SCHEDULES = ("gpipe", "1f1b")
HEADERS = [
    "recompute",
    "schedule",
    "stage",
    "in flight",
    "predicted MB",
    "measured peak MB",
    "error",
    "predicted step ms",
    "measured step ms",
]

PAGE = """# Activation checkpointing block by block: predicted against measured

Written by `python -m bench.recompute_memory` on {today} ({host}, torch {torch}).

`models/gpt.py` with `{overrides}`, {gpus} gloo ranks, batch {batch} in {m} microbatches, planned
with a measured profile here, `--method given --compare {split}` (the same split under every
mode) and `--recompute MODE` (every stage so), then trained for {steps} steps. Each stage's predicted peak (the plan's, `planner.core.split.stage_model.MemoryParts.peak`) beside the peak
`torch.distributed._tools.mem_tracker.MemTracker` saw during one tracked step (parameters,
gradients, optimizer state, activations, buffers, temporaries); the predicted step beside the
median measured step (the first step, which sets the schedule up, and the tracked one left out).

Full checkpointing keeps each block's input per live microbatch and rebuilds one block at a time;
selective keeps, besides, the outputs of the block's matmuls, convolutions and attention (torch's
selective activation checkpointing with torchtitan's "op" policy, `planner/capture/checkpoint.py`)
and recomputes the rest (layer norms, GELU, dropout, softmax's neighbours); stage keeps only the
stage's input and rebuilds the whole stage at once; `full:2` and `selective:2` checkpoint only each
stage's first two blocks (the rest keep their activations), as `--recompute auto` chooses when
fewer blocks are enough, and as Megatron-LM's `--recompute-num-layers 2` does. The last stage also
keeps what its loss saves in every mode (the loss runs outside the stage's regions).

What a recomputation costs: each region re-runs its forward only up to the last tensor it saves
(torch's early stop), which the profiler times and the estimate counts operator by operator; a
stage run as one region re-runs every block but its last in full. On an H100 the charged extra
time was checked against `planner run` for every mode (docs/gpu_recompute.md).

{table}

Mean absolute memory error: {mae:.1f}% over {n} stages ({mae_modes}).

Activation memory the modes leave, stage 0 under GPipe (all {m} microbatches in flight), measured:
{saving}
"""


def parse_args() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="steps per run (the first is warm-up)")
    parser.add_argument("--quick", action="store_true", help="3 steps, GPipe only")
    parser.add_argument("--out", type=Path, default=DOCS / "recompute.md")
    return parser.parse_args()


def main() -> None:
    """Plan and run every mode under every schedule, write the page."""
    args = parse_args()
    steps = 3 if args.quick else args.steps
    schedules = SCHEDULES[:1] if args.quick else SCHEDULES
    rows: list[list[object]] = []
    errors: dict[str, list[float]] = {mode: [] for mode in MODES}
    stage0: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for schedule in schedules:
            for mode in MODES:
                path = Path(tmp) / f"{schedule}-{mode}.json"
                request = tiny_gpt_request(
                    GPT,
                    path,
                    gpus=GPUS,
                    batch_size=BATCH,
                    microbatches=MICROBATCHES,
                    schedule=schedule,
                    recompute=mode.partition(":")[0],
                    method="given",  # the same split under every mode: 4 layers a stage
                    compare=SPLIT,
                )
                print(f"{schedule} --recompute {mode}", flush=True)
                plan, result, peaks = planned_peaks(request, path, steps, mode if ":" in mode else None)
                for st, memory, err in peaks:
                    errors[mode].append(abs(err))
                    if st.index == 0 and schedule == "gpipe":
                        stage0[mode] = memory.peak_by_category.get("Activation", 0.0)
                    rows.append(
                        [mode, schedule, st.index, st.in_flight, f"{st.memory_bytes / 2**20:.1f}"]
                        + [f"{memory.peak_bytes / 2**20:.1f}", f"{err:+.1f}%"]
                        + [f"{plan.prediction.step_time_s * 1e3:.0f}", f"{result.median_step_s * 1e3:.0f}"]
                    )
    every = [e for v in errors.values() for e in v]
    saving = "\n".join(
        f"- {mode}: {stage0[mode] / 2**20:.1f} MB"
        + (f" ({stage0[mode] / stage0['never']:.2f}x never's)" if mode != "never" and stage0.get("never") else "")
        for mode in MODES
        if mode in stage0
    )
    text = PAGE.format(
        today=dt.date.today().isoformat(),
        host=host(),
        torch=torch.__version__,
        overrides=GPT,
        gpus=GPUS,
        batch=BATCH,
        m=MICROBATCHES,
        split=SPLIT,
        steps=steps,
        table=table(rows, HEADERS),
        mae=statistics.mean(every) if every else float("nan"),
        n=len(every),
        saving=saving,
        mae_modes=", ".join(f"{mode}: {statistics.mean(v):.1f}%" for mode, v in errors.items() if v),
    )
    write_page(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
