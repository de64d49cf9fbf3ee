"""Mixture-of-experts models planned for H100s: total and active parameters, predicted step and MFU,
and the same models with their experts sharded over replicas (``--ep``), into docs/gpu_costs.md.

    python -m bench.moe_estimates            # Mixtral 8x7B and Qwen1.5-MoE-A2.7B (a few minutes)

Each setup is planned in-process with ``planner.api.make_plan`` exactly as ``planner plan
models/hf/FILE --size SIZE --gpus N --gpu-type h100 -b B`` plans it (the model on the meta device,
bf16, microbatches of one sequence; schedule, microbatches, tensor parallelism, replicas and
accumulation searched). The routed experts run as grouped GEMMs, charged the FLOPs of the rows
routed to them (``planner/costs/roofline.py``), so the plan's FLOPs, and its MFU, are those of the
active parameters: MFU over active parameters, the figure MoE runs publish. Active parameters are
counted here as everything outside the routed experts plus top_k / n_experts of the experts. The
second table plans each setup at ``--tp`` 1 and 2 (DDP or FSDP replicas as the search finds best)
and each ``--ep`` that divides its experts (with tp 2 a multiple of 2: an expert group spans the
tensor-parallel ranks, each routing half its replica's tokens), ``--ep 1`` the same layout without
sharding: the step each degree buys.
The sections between the markers of docs/gpu_costs.md are replaced.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from bench.common import DOCS, MODELS, table, write_between_markers
from planner.api import make_plan
from planner.capture.load import load_model_file
from planner.errors import PlannerError
from planner.report.throughput import throughput
from planner.schema.request import PlanRequest

DOC = DOCS / "gpu_costs.md"
BEGIN = "<!-- BEGIN moe-estimates (written by bench/moe_estimates.py) -->"
END = "<!-- END moe-estimates -->"
EP_BEGIN = "<!-- BEGIN moe-ep (written by bench/moe_estimates.py) -->"
EP_END = "<!-- END moe-ep -->"
EP_DEGREES = (1, 2, 4, 8)
TP_DEGREES = (1, 2)  # with tp 2 an expert group spans the two tensor-parallel ranks
# (label, file, size, GPUs, batch of sequences)
SETUPS = [
    ("Mixtral 8x7B", "mixtral.py", "8x7b", 32, 256),
    ("Qwen1.5-MoE-A2.7B", "qwen_moe.py", "a2.7b", 8, 128),
]


def parameters(file: str, size: str) -> tuple[int, int]:
    """Total parameters, and those active per token (outside the routed experts, plus top_k of them)."""
    mf = load_model_file(MODELS / "hf" / file, size)
    with torch.device("meta"):
        model = mf.build()
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    return total, total - experts + experts * mf.config["top_k"] // mf.config["n_experts"]


def _request(file: str, size: str, gpus: int, batch: int, **options: object) -> PlanRequest:
    """``planner plan models/hf/FILE --size SIZE --gpus N --gpu-type h100 -b B`` with ``options``."""
    return PlanRequest.build(
        model_file=MODELS / "hf" / file,
        size=size,
        gpus=gpus,
        gpu_type="h100",
        batch_size=batch,
        dp="auto",
        progress=False,
        output=Path("/tmp/moe_estimates_plan.json"),
        **options,
    )


def ep_rows(label: str, file: str, size: str, gpus: int, batch: int) -> list[list[str]]:
    """The setup planned as expert parallelism runs it, one row per ``--tp`` of ``TP_DEGREES`` and
    ``--ep`` dividing its experts (a multiple of tp: the group spans the tensor-parallel ranks)."""
    experts = load_model_file(MODELS / "hf" / file, size).config["n_experts"]
    rows = []
    degrees = [d for d in EP_DEGREES if experts % d == 0 and gpus % d == 0]
    for tp, ep in [(tp, ep) for tp in TP_DEGREES for ep in degrees if ep % tp == 0 or ep == 1]:
        t0 = time.perf_counter()
        try:
            plan = make_plan(_request(file, size, gpus, batch, tp=tp, dp_mode="auto", ep=ep))
        except PlannerError as e:
            why = f"no plan: {str(e).split(';')[0][:100]}"
            rows.append([f"{label}, {gpus} H100, batch {batch}", str(tp), str(ep), why, "-", "-", "-"])
            continue
        t = throughput(plan)
        mode = plan.dp_mode + (" per block" if plan.sharded and plan.fsdp_units == "block" else "")
        layout = f"{plan.schedule}, pp {plan.n_ranks}, dp {plan.dp} ({mode}), m={plan.n_microbatches}" + (
            f", k={plan.accumulation}" if plan.accumulation > 1 else ""
        )
        print(f"{label} tp {tp} ep {ep}: {layout}, {time.perf_counter() - t0:.0f} s to plan", file=sys.stderr)
        rows.append(
            [
                f"{label}, {gpus} H100, batch {batch}",
                str(tp),
                str(ep),
                layout,
                f"{plan.prediction.step_time_s:.2f}",
                f"{t.tokens_per_s_per_gpu:,.0f}" if t.tokens_per_s_per_gpu else "-",
                f"{plan.prediction.max_memory_bytes / 2**30:.1f} GiB",
            ]
        )
    return rows


def one(label: str, file: str, size: str, gpus: int, batch: int) -> list[str]:
    """Plan one setup; its row of the table."""
    total, active = parameters(file, size)
    request = _request(file, size, gpus, batch, tp="auto")
    t0 = time.perf_counter()
    try:
        plan = make_plan(request)
    except PlannerError as e:
        print(f"{label}: {e}", file=sys.stderr)
        return [label, f"{total / 1e9:.1f} B", f"{active / 1e9:.1f} B", f"no plan: {str(e).split(';')[0][:120]}"] + [
            "-"
        ] * 4
    wall = time.perf_counter() - t0
    t = throughput(plan)
    layout = f"{plan.schedule}, pp {plan.n_ranks}, tp {plan.tp}, dp {plan.dp}, m={plan.n_microbatches}" + (
        f", k={plan.accumulation}" if plan.accumulation > 1 else ""
    )
    print(f"{label} on {gpus}: {layout}, {wall:.0f} s to plan", file=sys.stderr)
    return [
        f"{label}, {gpus} H100, batch {batch}",
        f"{total / 1e9:.1f} B",
        f"{active / 1e9:.1f} B",
        layout,
        f"{plan.prediction.step_time_s:.2f}",
        f"{t.tokens_per_s_per_gpu:,.0f}" if t.tokens_per_s_per_gpu else "-",
        f"{100 * t.mfu:.1f}%" if t.mfu is not None else "-",
        f"{plan.prediction.max_memory_bytes / 2**30:.1f} GiB",
    ]


def main() -> None:
    rows = [one(*s) for s in SETUPS]
    headers = ["setup", "parameters", "active", "plan (searched)", "step s", "tokens/s/GPU", "MFU (active)", "memory"]
    text = table(rows, headers)
    print(text)
    write_between_markers(DOC, BEGIN, END, text)
    ep = table(
        [row for s in SETUPS for row in ep_rows(*s)],
        ["setup", "tp", "ep", "plan", "step s", "tokens/s/GPU", "memory"],
    )
    print(ep)
    write_between_markers(DOC, EP_BEGIN, EP_END, ep)


if __name__ == "__main__":
    main()
