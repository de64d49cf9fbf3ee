"""Predicted tokens/s per GPU and MFU of Llama 3 on H100s, beside published runs, into docs/gpu_costs.md.

    python -m bench.gpu_estimates              # 8B on 8 H100; 70B on 16, 32 and 64 (about 1-2 minutes)
    python -m bench.gpu_estimates --only 8b    # one model (quick look; the doc is left unchanged)

Each setup is planned in-process with ``planner.api.make_plan`` exactly as ``planner plan
models/llama.py --size SIZE --gpus N --tp 1 --gpu-type h100 --dtype bf16 -b B -m B`` plans it (the model on
the meta device, costs estimated by the roofline of ``planner.costs.estimate``; microbatches of one
8192-token sequence; schedule and stages per rank searched). The table gives the predicted step,
its bubble, tokens/s per GPU and MFU (``planner.report.throughput``), the MFU of the step without
its bubble (the ranks' compute alone), and the MFU under torchtitan's FLOP count (6 x non-embedding
parameters + 12 x layers x heads x head dim x sequence per token: causal attention counted in full),
the count the published figures use. The section between the markers of docs/gpu_costs.md is
replaced.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench.common import DOCS, MODELS, write_between_markers
from planner.api import make_plan
from planner.errors import PlannerError
from planner.report.throughput import throughput
from planner.schema.plan import Plan
from planner.schema.request import PlanRequest

DOC = DOCS / "gpu_costs.md"
BEGIN = "<!-- BEGIN gpu-estimates (written by bench/gpu_estimates.py) -->"
END = "<!-- END gpu-estimates -->"
# size, GPUs, batch = microbatches (one sequence each): as many as the receive buffers (m per boundary,
# 128 MiB each for 70B) leave room for next to 16 B per parameter of weights, gradients and AdamW
SETUPS = [("8b", 8, 64), ("70b", 16, 16), ("70b", 32, 64), ("70b", 64, 128)]
LLAMA = {"8b": (32, 32, 128), "70b": (80, 64, 128)}  # layers, heads, head dim
SEQ = 8192
PARAMS = {"8b": 8_030_261_248, "70b": 70_553_706_496}  # models/llama.py


def field_flops_per_token(plan: Plan, size: str) -> float:
    """torchtitan's ``get_num_flop_per_token``: 6 x non-embedding parameters + 12 L H Q T."""
    layers, heads, head_dim = LLAMA[size]
    params = sum(b.params for b in plan.blocks if b.name != "tok_embeddings")
    return 6 * params + 12 * layers * heads * head_dim * SEQ


def one(size: str, gpus: int, batch: int) -> list[str]:
    """Plan one setup; its row of the table."""
    request = PlanRequest.build(
        model_file=MODELS / "llama.py",
        size=size,
        gpus=gpus,
        batch_size=batch,
        microbatches=batch,
        tp=1,  # a pipeline alone, as the section compares (the search's default tries tensor parallelism too)
        dp=1,
        gpu_type="h100",
        dtype="bf16",
        progress=False,
        output=Path("/tmp/gpu_estimates_plan.json"),
    )
    t0 = time.perf_counter()
    try:
        plan = make_plan(request)
    except PlannerError as e:  # a pipeline alone cannot hold it: say why, in the table
        print(f"{size} on {gpus}: {e}", file=sys.stderr)
        state = PARAMS[size] * 16 / gpus / 2**30  # bf16 weights and grads, fp32 master and AdamW moments
        why = f"does not fit 95 % of an H100 (m={batch}): weights, gradients and AdamW state alone take {state:.0f} GiB per rank"
        return [f"Llama 3 {size.upper()}, {gpus} H100", why, *["-"] * 6]
    wall = time.perf_counter() - t0
    t = throughput(plan)
    assert t.tokens_per_s_per_gpu is not None and t.mfu is not None and t.busy_mfu is not None and t.peak_flops
    field = t.tokens_per_s_per_gpu * field_flops_per_token(plan, size) / t.peak_flops
    pred = plan.prediction
    what = f"{plan.schedule}, m={plan.n_microbatches}" + (
        f", v={plan.stages_per_rank}" if plan.stages_per_rank > 1 else ""
    )
    print(f"{size} on {gpus}: {what}, {wall:.0f} s to plan", file=sys.stderr)
    return [
        f"Llama 3 {size.upper()}, {gpus} H100",
        what,
        f"{pred.step_time_s:.2f}",
        f"{100 * pred.bubble_fraction:.0f}%",
        f"{t.tokens_per_s_per_gpu:,.0f}",
        f"{100 * t.mfu:.1f}%",
        f"{100 * t.busy_mfu:.1f}%",
        f"{100 * field:.1f}%",
    ]


def table(rows: list[list[str]]) -> str:
    head = [
        "setup",
        "plan (searched)",
        "step s",
        "bubble",
        "tokens/s/GPU",
        "MFU",
        "MFU without the bubble",
        "MFU, torchtitan's count",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=sorted(LLAMA), help="one model size only; the doc is not written")
    args = parser.parse_args()
    setups = [s for s in SETUPS if args.only is None or s[0] == args.only]
    text = table([one(*s) for s in setups])
    print(text)
    if args.only is not None:
        return
    write_between_markers(DOC, BEGIN, END, text)


if __name__ == "__main__":
    main()
