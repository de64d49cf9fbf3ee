"""Analytical (roofline) block costs against measured ones, on this machine's CPU.

For each model and size: ``planner.costs.measure.profile_blocks`` measures every block (threads=1,
median of repeats) and ``planner.costs.estimate.estimate_blocks`` predicts it from FLOPs and bytes on
``planner.costs.cpu.calibrated_cpu(threads=1)`` — the same estimator that plans for GPUs that
are not here, pointed at the one that is. Writes per-block and per-model errors to
docs/analytical_vs_measured.md. Run it on a quiet machine (other processes skew both the
calibration and the measurement).

    python bench/analytical_vs_measured.py                      # calibrate (cached), measure, write
    python bench/analytical_vs_measured.py --repeats 1 --warmup 1 --refresh-calibration
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import socket
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

from planner.capture.load import load_model_file  # noqa: E402
from planner.capture.trace import trace_model  # noqa: E402
from planner.costs.cpu import calibrated_cpu  # noqa: E402
from planner.costs.estimate import estimate_blocks  # noqa: E402
from planner.costs.measure import profile_blocks  # noqa: E402
from planner.schema.costs import OptimizerSpec  # noqa: E402

# (model file, size, overrides, microbatch size)
CASES = [
    ("gpt.py", "tiny", {}, 8),
    ("gpt.py", "tiny", {"dim": 256, "n_heads": 4, "ffn_dim": 1024, "seq_len": 128, "vocab_size": 8000}, 4),
    ("encoder_lm.py", "tiny", {}, 8),
    ("encoder_lm.py", "bigvocab", {}, 4),
]


def _err(est: float, meas: float) -> str:
    return f"{100 * (est - meas) / meas:+.0f}%" if meas > 0 else "-"


def _ms(x: float) -> str:
    return f"{1e3 * x:.3f}"


def run_case(path: str, size: str, overrides: dict, batch: int, hw, warmup: int, repeats: int):
    mf = load_model_file(ROOT / "models" / path, size, overrides)
    torch.manual_seed(0)
    model = mf.build()
    inputs, target = mf.batch(batch)
    traced = trace_model(model, inputs)
    opt = OptimizerSpec()
    measured = profile_blocks(
        traced, inputs, target, mf.loss_fn, warmup=warmup, repeats=repeats, threads=1, progress=False, optimizer=opt
    )
    estimated = estimate_blocks(traced, inputs, target, mf.loss_fn, hw, "fp32", opt, progress=False)
    rows = []
    for m, e in zip(measured, estimated):
        rows.append(
            [
                m.name,
                _ms(m.fwd_s),
                _ms(e.fwd_s),
                _err(e.fwd_s, m.fwd_s),
                _ms(m.bwd_s),
                _ms(e.bwd_s),
                _err(e.bwd_s, m.bwd_s),
                _ms(m.opt_s),
                _ms(e.opt_s),
                _err(e.opt_s, m.opt_s),
                _err(e.activation_bytes, m.activation_bytes),
            ]
        )
    tot_m = sum(c.fwd_s + c.bwd_s for c in measured)
    tot_e = sum(c.fwd_s + c.bwd_s for c in estimated)
    opt_m, opt_e = sum(c.opt_s for c in measured), sum(c.opt_s for c in estimated)
    extra = " ".join(f"{k}={v}" for k, v in overrides.items())
    label = f"{path} {size}" + (f" ({extra})" if extra else "") + f", microbatch {batch}"
    summary = [
        label,
        _ms(tot_m),
        _ms(tot_e),
        _err(tot_e, tot_m),
        _ms(opt_m),
        _ms(opt_e),
        _err(opt_e, opt_m),
        f"{sum(abs(e.fwd_s + e.bwd_s - m.fwd_s - m.bwd_s) for m, e in zip(measured, estimated)) / tot_m:.0%}",
    ]
    return label, rows, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--refresh-calibration", action="store_true")
    parser.add_argument("--cache", default=None, help="calibration cache file (default ~/.cache/planner/cpu.json)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "analytical_vs_measured.md"))
    args = parser.parse_args()

    hw = calibrated_cpu(1, path=args.cache, refresh=args.refresh_calibration)
    headers = [
        "block",
        "fwd ms meas",
        "fwd ms est",
        "err",
        "bwd ms meas",
        "bwd ms est",
        "err",
        "opt ms meas",
        "opt ms est",
        "err",
        "saved bytes err",
    ]
    sections, summaries = [], []
    for path, size, overrides, batch in CASES:
        label, rows, summary = run_case(path, size, overrides, batch, hw, args.warmup, args.repeats)
        print(label, summary[3], file=sys.stderr)
        sections.append(f"### {label}\n\n" + tabulate(rows, headers, tablefmt="github") + "\n")
        summaries.append(summary)
    now = dt.datetime.now().astimezone().isoformat(timespec="seconds")
    text = "\n".join(
        [
            "# Analytical vs measured block costs (CPU)",
            "",
            f"Generated by `bench/analytical_vs_measured.py` on {now}; host {socket.gethostname()}, "
            f"{platform.processor() or platform.machine()}, torch {torch.__version__}; 1 intra-op thread; "
            f"measured: warm-up {args.warmup}, median of {args.repeats}.",
            "",
            f"Calibrated CPU (`planner.costs.cpu`): {hw.peak('fp32') / 1e9:.1f} GFLOP/s fp32 matmul, "
            f"{hw.memory_Bps / 1e9:.1f} GB/s memory, {hw.op_overhead_s * 1e6:.2f} us per operator.",
            "",
            "Estimated = `planner.costs.estimate.estimate_blocks` (per-operator roofline + operator overhead, fp32); "
            "measured = `planner.costs.measure.profile_blocks`. err = (estimated - measured) / measured. "
            "'abs block err' = sum over blocks of |est - meas| of fwd+bwd, over the measured total.",
            "",
            "## Per model (forward + backward of all blocks, one microbatch; optimizer step)",
            "",
            tabulate(
                summaries,
                ["model", "fwd+bwd ms meas", "est", "err", "opt ms meas", "est", "err", "abs block err"],
                tablefmt="github",
            ),
            "",
            "## Per block",
            "",
            *sections,
        ]
    )
    Path(args.out).write_text(text)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
