"""How long the joint search adds to planning: a 96-layer model on 8 ranks.

Estimates the costs of `models/gpt.py` with 96 layers for an H100 (roofline on the meta device, so
no profiling noise), then times ``assemble_plan`` (the search over schedule x microbatches x stages
per rank x split, the polishing of the winner, the baselines) against planning one fixed schedule.
Writes docs/search_time.md.

    python bench/search_time.py
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.api import estimated_costs, model_ref  # noqa: E402
from planner.capture.load import load_model_file  # noqa: E402
from planner.core.assemble import assemble_plan  # noqa: E402
from planner.schema.request import PlanRequest  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=96)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "search_time.md")
    args = parser.parse_args()
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
            model_file=ROOT / "models" / "gpt.py",
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
        for label, update in (
            ("joint search (auto, the default)", {}),
            ("fixed: 1f1b, m = 2p", {"schedule": "1f1b", "microbatches": 2 * args.gpus, "stages_per_rank": 1}),
            (
                "fixed: interleaved-1f1b, m = 2p, v = 2",
                {"schedule": "interleaved-1f1b", "microbatches": 2 * args.gpus, "stages_per_rank": 2},
            ),
        ):
            request = base.model_copy(update=update)
            t0 = time.perf_counter()
            plan = assemble_plan(
                request,
                costs.blocks,
                costs.link,
                model=model_ref(mf, costs.traced, request),
                profile=costs.profile,
                memory_limit_bytes=costs.memory_bytes,
                created="bench",
            )
            elapsed = time.perf_counter() - t0
            rows.append(
                f"| {label} | {elapsed:.2f} | {plan.schedule} | {plan.n_microbatches} | {plan.stages_per_rank} "
                f"| {plan.prediction.step_time_s * 1e3:.1f} | {len(plan.search)} |"
            )
            print(rows[-1], flush=True)
    text = f"""# Joint search time: {args.layers}-layer model on {args.gpus} ranks

Written by `bench/search_time.py` on {dt.date.today().isoformat()} ({platform.node()}, {os.cpu_count()} cores,
Python {platform.python_version()}). `models/gpt.py` with {args.layers} layers (dim 2048, 32k vocabulary, sequence
1024; {len(costs.blocks)} blocks), batch {args.batch_size}, costs estimated for an H100 (bf16) in {t_costs:.1f} s.
The time below is `assemble_plan` alone: what planning adds to the costs.

| planning | seconds | schedule | m | stages/rank | predicted step ms | candidates kept |
|---|---:|---|---:|---:|---:|---:|
{chr(10).join(rows)}

Regenerate: `python bench/search_time.py`.
"""
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
