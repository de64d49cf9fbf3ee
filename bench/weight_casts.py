"""Autocast's weight copies held once a step: predicted against measured peak memory, on this machine.

A bf16 plan trains fp32 weights under autocast; each matmul saves a bf16 copy of its weight. The
runner keeps one autocast region open through each step (``planner.run.wrappers.weight_cast_cache``),
so a stage holds one set of copies however many microbatches are in flight, and the plan counts
them once (``BlockCost.weight_cast_bytes``). For GPipe (every microbatch in flight) and 1F1B: plan
``models/gpt.py`` at a size whose weights outweigh its activations, with a measured bf16 profile
here, train it on gloo ranks, and set each stage's measured peak (MemTracker) beside the plan's
prediction and beside what the same costs predict with one set of copies per microbatch in flight
(the count before the runner shared them). Writes docs/weight_casts.md.

    python -m bench.weight_casts
"""

from __future__ import annotations

import argparse
import datetime as dt
import tempfile
from pathlib import Path

import torch

from bench.common import DOCS, host, pct_error, planned_peaks, table, tiny_gpt_request, write_page
from planner.core.levers.casts import compiled_casts
from planner.core.step.predict import refresh

# wide layers on short sequences: a stage's weights (and so their bf16 copies) outweigh what one
# microbatch's activations add
GPT = {"dim": 256, "n_layers": 4, "n_heads": 4, "ffn_dim": 1024, "vocab_size": 2000, "seq_len": 16}
GPUS, BATCH, MICROBATCHES = 2, 16, 8
SPLIT = "2,2"
SCHEDULES = ("gpipe", "1f1b")
HEADERS = [
    "schedule",
    "stage",
    "in flight",
    "weight copies MB",
    "measured peak MB",
    "predicted MB (the plan's)",
    "error",
    "predicted MB (a set per microbatch)",
    "error ",
]

PAGE = """# Autocast's weight copies: held once a step, predicted against measured

Written by `python -m bench.weight_casts` on {today} ({host}, torch {torch}).

`models/gpt.py` with `{overrides}`, {gpus} gloo ranks, batch {batch} in {m} microbatches, `--dtype
bf16` (a measured profile here: every block under `torch.autocast`, weights fp32), `--method given
--compare {split}`, trained for {steps} steps. Each matmul saves a bf16 copy of its weight for
backward. `planner run` opens each microbatch's forward in its own autocast region inside one
region per step (`planner/run/wrappers.weight_cast_cache`) that keeps torch's cast cache alive, so
on a stage with three or more microbatches live the microbatches share one copy of each weight
(`planner/core/split/stage_model.shares_casts`: besides, it recomputes nothing and FSDP does not shard
it). The plan counts the shared copies once per stage
(`weight_cast_bytes`, measured apart from the activations), twice over: torch's autograd engine runs
the ready node created last first, and the cached copies' nodes, made at the step's first forward,
are the oldest of every later microbatch's graph, so each backward reaches them last and each
weight's bf16 gradient (a copy's size) waits until then (`planner/core/levers/casts.shared_casts`). A
stage with one or two live keeps a set per microbatch, as before (sharing would hold two sets
there too, and more than one with one live), and so does a stage FSDP shards (it reduce-scatters
a block's weight gradients before a shared copy's would arrive).
Each stage's peak as `torch.distributed._tools.mem_tracker.MemTracker` saw it during one tracked
step, beside the plan's prediction and beside the prediction of the same costs with one set of
copies per microbatch in flight (what the planner counted, and the runner held, before 28 Nov).

{table}

Mean absolute error: {once:.1f}% as the plan counts them, {per:.1f}% with one set per microbatch in flight.
"""


def parse_args() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="steps per run (the first is warm-up)")
    parser.add_argument("--out", type=Path, default=DOCS / "weight_casts.md")
    return parser.parse_args()


def main() -> None:
    """Plan and run each schedule, write the page."""
    args = parse_args()
    rows: list[list[object]] = []
    once: list[float] = []
    per: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for schedule in SCHEDULES:
            path = Path(tmp) / f"{schedule}.json"
            request = tiny_gpt_request(
                GPT,
                path,
                gpus=GPUS,
                batch_size=BATCH,
                microbatches=MICROBATCHES,
                schedule=schedule,
                recompute="never",
                method="given",
                compare=SPLIT,
                dtype="bf16",
            )
            print(f"{schedule}", flush=True)
            plan, _, peaks = planned_peaks(request, path, args.steps)
            # the same costs, the copies held per microbatch in flight
            apart = refresh(plan.model_copy(update={"blocks": compiled_casts(plan.blocks)}))[0]
            for (st, memory, err), old in zip(peaks, apart.stages):
                copies = sum(b.weight_cast_bytes for b in plan.blocks[st.start : st.end])
                old_err = pct_error(old.memory_bytes, memory.peak_bytes)
                once.append(abs(err))
                per.append(abs(old_err))
                rows.append(
                    [schedule, st.index, st.in_flight, f"{copies / 2**20:.2f}", f"{memory.peak_bytes / 2**20:.1f}"]
                    + [f"{st.memory_bytes / 2**20:.1f}", f"{err:+.1f}%", f"{old.memory_bytes / 2**20:.1f}"]
                    + [f"{old_err:+.1f}%"]
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
        steps=args.steps,
        table=table(rows, HEADERS),
        once=sum(once) / len(once),
        per=sum(per) / len(per),
    )
    write_page(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
