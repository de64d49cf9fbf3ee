"""How long the joint search adds to planning: a 96-layer model on 8 ranks.

Estimates the costs of `models/gpt.py` with 96 layers for an H100 (roofline on the meta device, so
no profiling noise), then times ``assemble_plan`` (the search over schedule x microbatches x stages
per rank x split, the polishing of the winner, the baselines) against planning one fixed schedule.
Writes docs/search_time.md.

    python -m bench.search_time
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import tempfile
import time
from pathlib import Path

from bench.common import DOCS, MODELS, host, plan_on_costs, write_page
from planner.api import estimated_costs
from planner.capture.load import load_model_file
from planner.schema.request import PlanRequest

PAGE = """# Joint search time: {a.layers}-layer model on {a.gpus} ranks

Written by `bench/search_time.py` on {today} ({host},
Python {python}). `models/gpt.py` with {a.layers} layers (dim 2048, 32k vocabulary, sequence
1024; {blocks} blocks), batch {a.batch_size}, costs estimated for an H100 (bf16) in {t_costs:.1f} s.
The time below is `assemble_plan` alone: what planning adds to the costs.

| planning | seconds | schedule | m | stages/rank | predicted step ms | candidates kept |
|---|---:|---|---:|---:|---:|---:|
{rows}

Regenerate: `python -m bench.search_time`.
"""


def parse_args() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=96)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--out", type=Path, default=DOCS / "search_time.md")
    return parser.parse_args()


def plannings(gpus: int) -> list[tuple[str, dict[str, object]]]:
    """The joint search and two fixed schedules, as updates of the base request."""
    return [
        ("joint search (auto, the default)", {}),
        ("fixed: 1f1b, m = 2p", {"schedule": "1f1b", "microbatches": 2 * gpus, "stages_per_rank": 1}),
        (
            "fixed: interleaved-1f1b, m = 2p, v = 2",
            {"schedule": "interleaved-1f1b", "microbatches": 2 * gpus, "stages_per_rank": 2},
        ),
    ]


def main() -> None:
    """Estimate the costs once, time each planning on them, write the page."""
    args = parse_args()
    overrides = {
        "n_layers": args.layers,
        "dim": 2048,
        "n_heads": 16,
        "ffn_dim": 8192,
        "vocab_size": 32000,
        "seq_len": 1024,
    }
    with tempfile.TemporaryDirectory() as tmp:
        base = PlanRequest.build(
            model_file=MODELS / "gpt.py",
            gpus=args.gpus,
            overrides=overrides,
            batch_size=args.batch_size,
            gpu_type="h100",
            output=Path(tmp) / "plan.json",
            progress=False,
        )
        mf = load_model_file(base.model_file, base.size, base.overrides)
        t0 = time.perf_counter()
        costs = estimated_costs(mf, base, 1)
        t_costs = time.perf_counter() - t0
        rows = []
        for label, update in plannings(args.gpus):
            request = base.model_copy(update=update)
            t0 = time.perf_counter()
            plan = plan_on_costs(request, costs, mf, created="bench", memory_limit_bytes=costs.memory_bytes)
            elapsed = time.perf_counter() - t0
            rows.append(
                f"| {label} | {elapsed:.2f} | {plan.schedule} | {plan.n_microbatches} | {plan.stages_per_rank} "
                f"| {plan.prediction.step_time_s * 1e3:.1f} | {len(plan.search)} |"
            )
            print(rows[-1], flush=True)
    text = PAGE.format(
        a=args,
        today=dt.date.today().isoformat(),
        host=host(),
        python=platform.python_version(),
        blocks=len(costs.blocks),
        t_costs=t_costs,
        rows="\n".join(rows),
    )
    write_page(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
