"""Time ``planner plan`` on Llama-3-70B for 64 H100s and write its prediction into docs/plan_70b.md.

    python -m bench.plan_70b                # the 70B plan (needs planner plan --gpu-type / --dtype)
    python -m bench.plan_70b --size tiny --gpus 2 -b 8 -m 4 --gpu-type none --doc /tmp/x.md
                                            # try the script on a small model, profiled on this machine

Runs, as a subprocess,

    planner plan models/llama.py --size 70b --gpus 64 --gpu-type h100 --dtype bf16 -b 64 -m 64 -o PLAN

and measures its wall time and peak resident memory (``os.wait4``'s rusage of that child: the
``ru_maxrss`` that ``/usr/bin/time -v`` reports). Planning a 70B model must not allocate its
weights (docs/architecture.md, "Costs"), so the peak RSS should be a few hundred MB, not the 141 GB of bf16
weights. It then reads the plan and replaces the section between the markers in the doc with the
timing, the per-stage table (blocks, parameters, activations per microbatch, in flight, predicted
memory) and the hand calculation of docs/plan_70b.md for the same split, side by side.

Exits non-zero with a one-line reason when the CLI lacks an option it needs or ``planner plan``
fails; the doc is then left unchanged.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import DOCS, ROOT, between_markers, run_timed, write_page
from planner.core.levers.hardware import get_hardware

BEGIN = "<!-- BEGIN planner-prediction (written by bench/plan_70b.py) -->"
END = "<!-- END planner-prediction -->"
GIB = 2**30
H100_USABLE = get_hardware("h100").memory_bytes  # what an H100-80GB reports to CUDA (docs/gpu_costs.md)


def planner_cmd() -> list[str]:
    """The ``planner`` command of this checkout (the repository's cli.py with this interpreter)."""
    return [sys.executable, str(ROOT / "cli.py")]


def check_options(needed: list[str]) -> None:
    """Fail clearly when ``planner plan`` does not know an option this benchmark passes."""
    proc = subprocess.run([*planner_cmd(), "plan", "--help"], check=False, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        sys.exit(f"error: `planner plan --help` failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}")
    missing = [opt for opt in needed if not re.search(rf"(^|\s){re.escape(opt)}[\s,=]", proc.stdout, re.MULTILINE)]
    if missing:
        sys.exit(
            f"error: `planner plan` has no {', '.join(missing)} option yet (the analytical cost model adds it); "
            "this benchmark needs it to plan a 70B model without allocating its weights. "
            "Try the script on a profiled model with --gpu-type none."
        )


def _hand_block(name: str, cfg: dict, b: int = 1) -> tuple[int, int, int] | None:
    """(params, fused-norm activation bytes, eager activation bytes) of one block with microbatch ``b``.

    The doc's formulas, for bf16 weights and activations (the eager norm's fp32 upcast included).
    """
    try:
        h, a, nkv = cfg["dim"], cfg["n_heads"], cfg["n_kv_heads"]
        V, s, mult, mo = cfg["vocab_size"], cfg["seq_len"], cfg["ffn_dim_multiplier"], cfg["multiple_of"]
    except KeyError:
        return None
    hidden = int(mult * int(2 * 4 * h / 3))
    f = mo * ((hidden + mo - 1) // mo)
    k = nkv * (h // a)
    s = s * b  # every term is per token
    if name == "tok_embeddings":
        return V * h, 8 * s, 8 * s
    if name == "norm":
        return h, 2 * s * h + 4 * s, 6 * s * h + 4 * s
    if name == "output":
        act = 2 * s * h + 4 * s * V + 8 * s
        return V * h, act, act
    if name.startswith("layers."):
        common = 4 * s * k + 8 * s * f + 4 * a * s + 8 * s
        return 2 * h * h + 2 * h * k + 3 * h * f + 2 * h, 12 * s * h + common, 20 * s * h + common
    return None


def _param_bytes(plan: dict) -> float:
    """Bytes per parameter of the planned model (2 for bf16/fp16, 4 for fp32)."""
    n = sum(b["params"] for b in plan["blocks"])
    return sum(b["param_bytes"] for b in plan["blocks"]) / n if n else 4.0


def hand_stage_bytes(plan: dict, stage: dict, eager: bool) -> int | None:
    """The doc's hand formula for the plan's split: 16 B/param, one receive buffer per microbatch for
    each boundary (torch's PipelineStage allocates them up front), and the larger of the pipeline's
    live memory — in_flight x (A + the cached stage output) + the output's gradient (a recomputing
    stage keeps its input instead of A, plus one microbatch's A) — and AdamW's step temporaries."""
    if _param_bytes(plan) != 2:
        return None  # the hand formulas are for bf16 (docs/plan_70b.md)
    cfg = plan["model"]["config"]
    mb = plan["batch_size"] // plan["n_microbatches"]
    blocks = plan["blocks"]
    n_params = act = 0
    for b in blocks[stage["start"] : stage["end"]]:
        hand = _hand_block(b["name"], cfg, mb)
        if hand is None:
            return None
        n_params += hand[0]
        act += hand[2] if eager else hand[1]
    cut = 2 * mb * cfg["seq_len"] * cfg["dim"]
    cut_in = cut if stage["start"] > 0 else 0
    cut_out = cut if stage["end"] < len(blocks) else 0
    # The stage's output per live microbatch (PipelineStage caches it until backward) and its
    # gradient: the hidden state, or the bf16 logits (seq x vocab) on the last stage.
    out = cut_out if stage["end"] < len(blocks) else 2 * mb * cfg["seq_len"] * cfg["vocab_size"]
    f = stage["in_flight"]
    pipeline = f * (cut_in + out) + act + out if stage.get("recompute") else f * (act + out) + out
    adamw_temps = 8 * n_params  # torch's foreach AdamW: two fp32 temporaries per parameter in the step
    return 16 * n_params + plan["n_microbatches"] * (cut_in + cut_out) + max(pipeline, adamw_temps)


def _gib(v: int | None) -> str:
    return "—" if v is None else f"{v / GIB:.2f}"


def render(plan: dict, cmd_text: str, wall: float, rss: int) -> str:
    """The markdown of the prediction section."""
    stages = plan["stages"]
    pred = plan["prediction"]
    lines = [
        (
            f"Run {_dt.datetime.now().astimezone().isoformat(timespec='seconds')} on {os.uname().nodename} "
            f"({os.cpu_count()} cores), torch {plan['profile'].get('torch_version', '?')}:"
        ),
        "",
        "```",
        cmd_text,
        "```",
        "",
        f"- wall time of `planner plan`: **{wall:.1f} s**; peak RSS: **{rss / 2**20:,.0f} MiB**",
        (
            f"- trace method {plan['model']['trace_method']}; {len(plan['blocks'])} blocks; "
            f"schedule {plan['schedule']}, {plan['n_microbatches']} microbatches of "
            f"{plan['batch_size'] // plan['n_microbatches']}; split method {plan['method']}"
        ),
        (
            f"- predicted step {pred['step_time_s']:.3f} s, bubble {pred['bubble_fraction']:.1%}, "
            f"imbalance {pred['imbalance']:.3f}, max memory {pred['max_memory_bytes'] / GIB:.2f} GiB "
            f"({sum(s['memory_bytes'] > H100_USABLE for s in stages)} of {len(stages)} stages above "
            f"{H100_USABLE / GIB:.1f} GiB, the H100's capacity)"
        ),
        "",
        "| stage | blocks | params | act GiB/mb | in flight | planner GiB | hand GiB (fused A) | hand GiB (eager A) | planner / hand (fused) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in stages:
        names = s["first_block"] if s["first_block"] == s["last_block"] else f"{s['first_block']} .. {s['last_block']}"
        fused, eager = hand_stage_bytes(plan, s, False), hand_stage_bytes(plan, s, True)
        ratio = "—" if not fused else f"{s['memory_bytes'] / fused:.3f}"
        lines.append(
            f"| {s['index']} | {names} | {s['params'] / 1e6:,.1f} M | {s['activation_bytes'] / GIB:.3f} | {s['in_flight']} "
            f"| {s['memory_bytes'] / GIB:.2f} | {_gib(fused)} | {_gib(eager)} | {ratio} |"
        )
    layer = next((b for b in plan["blocks"] if b["name"].startswith("layers.")), None)
    if layer is not None:
        hand = _hand_block(layer["name"], plan["model"]["config"], plan["batch_size"] // plan["n_microbatches"])
        if hand and _param_bytes(plan) == 2:
            lines += [
                "",
                (
                    f"Per layer: planner {layer['params']:,} params, {layer['activation_bytes']:,} B saved per microbatch, "
                    f"cut {layer['cut_bytes']:,} B; hand {hand[0]:,} params, {hand[1]:,} B (fused) / {hand[2]:,} B (eager)."
                ),
            ]
    return "\n".join(lines)


def write_section(doc: Path, body: str) -> None:
    """Replace the text between the markers (append the section when the doc has none)."""
    text = doc.read_text() if doc.exists() else ""
    replaced = between_markers(text, BEGIN, END, body)
    if replaced is None:
        replaced = text.rstrip("\n") + f"\n\n## Planner's prediction\n\n{BEGIN}\n{body}\n{END}\n"
    write_page(doc, replaced, "--doc")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/llama.py")
    ap.add_argument("--size", default="70b")
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument(
        "--gpu-type", default="h100", help="passed to planner plan; 'none' leaves it out (profile on this machine)"
    )
    ap.add_argument("--dtype", default="bf16", help="passed to planner plan; 'none' leaves it out")
    ap.add_argument("-b", "--batch-size", type=int, default=64)
    ap.add_argument("-m", "--microbatches", type=int, default=64)
    ap.add_argument("--doc", default=str(DOCS / "plan_70b.md"))
    ap.add_argument("--timeout", type=float, default=1800, help="seconds before planner plan is killed")
    args = ap.parse_args()

    extra: list[str] = []
    for opt, value in (("--gpu-type", args.gpu_type), ("--dtype", args.dtype)):
        if value.lower() != "none":
            extra += [opt, value]
    check_options([o for o in extra if o.startswith("--")])
    with tempfile.TemporaryDirectory() as tmp:
        plan_path = Path(tmp) / "plan.json"
        argv = [
            "plan",
            args.model,
            "--size",
            args.size,
            "--gpus",
            str(args.gpus),
            *extra,
            "-b",
            str(args.batch_size),
            "-m",
            str(args.microbatches),
            "-q",
            "-o",
            str(plan_path),
        ]
        cmd_text = "planner " + " ".join(argv[:-2])
        print(f"running: {cmd_text}", flush=True)
        code, wall, rss, out, err = run_timed([*planner_cmd(), *argv], args.timeout)
        if code != 0:
            why = (err.strip() or out.strip()).splitlines()[-1:] or ["(no output)"]
            sys.exit(
                f"error: planner plan exited with {code} after {wall:.1f} s (peak RSS {rss / 2**20:,.0f} MiB): {why[0]}"
            )
        plan = json.loads(plan_path.read_text())
    body = render(plan, cmd_text, wall, rss)
    write_section(Path(args.doc), body)
    print(body)
    print(f"\nwrote the prediction section of {args.doc}")


if __name__ == "__main__":
    main()
