"""The roofline's GPU estimates beside the same work measured on a GPU, and the CUDA paths run, into docs/gpu_check.md.

    python -m bench.gpu_check                # on a machine with an NVIDIA GPU (about 3 minutes on an H100)
    python -m bench.gpu_check --dry-run      # tiny shapes on this machine's CPU: the script's own check, no page

Every estimate of ``planner plan --gpu-type NAME`` comes from the roofline of ``planner.costs.roofline``
with the figures of ``planner.core.levers.hardware`` (docs/gpu_costs.md). This script measures, on the GPU it
runs on, what those figures stand for, and puts the estimate beside each measurement:

1. the two ceilings: a large bf16 GEMM's FLOP/s and a device-to-device copy's bytes/s;
2. the GEMMs of a Llama 3 70B layer (one 8,192-token sequence) whole and as one rank's shard at tensor
   parallel degrees 2, 4 and 8 (``gemm_seconds``, the function the tensor-parallel slowdown uses);
3. causal fused attention (head dim 128, 8,192 tokens) forward and backward, with torch's default
   kernel and each fused kernel this torch has;
4. every distinct block of ``models/llama.py`` at the 8B and 70B widths (a few layers), measured by the
   planner's own profiler (``planner.api.measured_costs``) on a bf16 model beside ``estimated_costs``;
5. one whole training step of those models (bf16 weights, fp32 master weights and AdamW moments, as
   the estimate assumes) beside the plan's predicted step and peak memory;
6. the CUDA paths of the command line: ``planner plan`` measured on the GPU, then ``planner run``.

Timings are CUDA-event medians after warm-up. The page is written only on a GPU; ``--dry-run`` runs
every section on tiny shapes on the CPU and prints the tables.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import DOCS, MODELS, ROOT, gpu_type_of, table, write_page
from planner.core.levers.hardware import HardwareSpec, get_hardware

DOC = DOCS / "gpu_check.md"
TOKENS = 8192
# Llama 3 70B: model width, K/V width (8 heads x 128), FFN width
DIM, KV, FFN = 8192, 1024, 28672
# (name, style, n, k) of y = x @ W.T with W (n, k): colwise layers split n, rowwise layers split k
LAYERS_70B = [
    ("wq", "colwise", DIM, DIM),
    ("wk", "colwise", KV, DIM),
    ("w1", "colwise", FFN, DIM),
    ("wo", "rowwise", DIM, DIM),
    ("w2", "rowwise", DIM, FFN),
]
DEGREES = (1, 2, 4, 8)
# models/llama.py at real widths with few layers: (size, overrides)
MODELS_AT = [("8b", {"n_layers": 2}), ("70b", {"n_layers": 1})]
DRY_MODELS = [("tiny", {"n_layers": 2})]


def _hardware_for(name: str) -> HardwareSpec:
    """The planner's spec for the GPU this runs on, from its CUDA name ("NVIDIA H100 80GB HBM3" → h100)."""
    key = gpu_type_of(name)
    if key is not None:
        return get_hardware(key)
    print(f"{name}: no spec of that name in planner/core/levers/hardware.py; comparing with h100", file=sys.stderr)
    return get_hardware("h100")


def time_ms(fn: Callable[[], Any], device: torch.device, warmup: int = 3, repeats: int = 10) -> float:
    """Median milliseconds of ``fn()`` (CUDA events on a GPU, the wall clock on a CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def ceilings(device: torch.device, hw: HardwareSpec, dry: bool) -> str:
    """A large GEMM's bf16 FLOP/s and a copy's bytes/s, beside the figures the roofline uses."""
    n = 512 if dry else 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    ms = time_ms(lambda: a @ b, device)
    gemm = 2 * n**3 / (ms / 1e3)
    src = torch.randn(2**22 if dry else 2**29, device=device)  # 2 GiB of fp32 on a GPU
    dst = torch.empty_like(src)
    ms_copy = time_ms(lambda: dst.copy_(src), device)
    copy = 2 * src.numel() * 4 / (ms_copy / 1e3)  # bytes read + written
    roof_gemm = hw.peak("bf16") * hw.gemm_efficiency(n, n, n)
    roof_copy = hw.memory_Bps * hw.memory_efficiency
    rows = [
        [
            f"bf16 GEMM {n}^3",
            f"{gemm / 1e12:.0f} TFLOP/s",
            f"{roof_gemm / 1e12:.0f} TFLOP/s",
            f"{roof_gemm / gemm:.2f}",
        ],
        [
            f"copy {src.numel() * 4 >> 20} MiB",
            f"{copy / 1e9:.0f} GB/s",
            f"{roof_copy / 1e9:.0f} GB/s",
            f"{roof_copy / copy:.2f}",
        ],
    ]
    return table(rows, ["what", "measured", "roofline assumes", "assumed / measured"])


def gemms(device: torch.device, hw: HardwareSpec, dry: bool) -> str:
    """Each 70B projection whole and sharded: measured ms beside ``gemm_seconds``."""
    from planner.costs.tensor_parallel import gemm_seconds

    scale = 16 if dry else 1
    m = TOKENS // scale
    peak = hw.peak("bf16")
    rows = []
    for name, style, n_full, k_full in LAYERS_70B:
        for t in DEGREES:
            n = n_full // scale // (t if style == "colwise" else 1)
            k = k_full // scale // (t if style == "rowwise" else 1)
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
            ms = time_ms(lambda x=x, w=w: F.linear(x, w), device)
            est = gemm_seconds(hw, peak, m, n, k, 2) * 1e3
            tflops = 2 * m * n * k / (ms / 1e3) / 1e12
            rows.append([name, style, t, f"{m}x{n}x{k}", f"{ms:.3f}", f"{tflops:.0f}", f"{est:.3f}", f"{est / ms:.2f}"])
    return table(rows, ["layer", "style", "tp", "m x n x k", "measured ms", "TFLOP/s", "estimated ms", "est / meas"])


def _attention_estimate(hw: HardwareSpec, heads: int, seq: int) -> tuple[float, float]:
    """The roofline's forward and backward ms of one causal attention (``planner.costs.roofline``)."""
    from planner.costs.roofline import Roofline, Tally

    q, k, v = (
        torch.empty(1, heads, seq, 128, device="meta", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    )
    roof = Roofline(hw, "bf16")
    fwd, bwd = Tally(), Tally()
    with roof.phase(fwd):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with roof.phase(bwd):
        out.backward(torch.empty_like(out))
    return fwd.seconds * 1e3, bwd.seconds * 1e3


def _attention_measured(device: torch.device, heads: int, seq: int, backend: Any) -> tuple[float, float]:
    from torch.nn.attention import sdpa_kernel

    q, k, v = (
        torch.randn(1, heads, seq, 128, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    )
    grad = torch.randn(1, heads, seq, 128, device=device, dtype=torch.bfloat16)

    def forward() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def backward() -> None:
        out = forward()
        torch.autograd.grad(out, (q, k, v), grad)

    context = sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()
    with context:
        fwd = time_ms(forward, device)
        both = time_ms(backward, device)
    return fwd, both - fwd


def attention(device: torch.device, hw: HardwareSpec, dry: bool) -> str:
    """Causal attention at 70B's heads (tp 1 and tp 8): each kernel measured beside the roofline."""
    from torch.nn.attention import SDPBackend

    seq = 256 if dry else TOKENS
    kernels: list[tuple[str, Any]] = [("default", None)]
    if device.type == "cuda":
        kernels += [
            ("flash", SDPBackend.FLASH_ATTENTION),
            ("cudnn", SDPBackend.CUDNN_ATTENTION),
            ("efficient", SDPBackend.EFFICIENT_ATTENTION),
        ]
    rows = []
    for heads in (64, 8):
        est_f, est_b = _attention_estimate(hw, heads, seq)
        flops_f = 4 * heads * seq * seq * 128 / 2  # causal: half the score matrix
        for name, backend in kernels:
            try:
                f, b = _attention_measured(device, heads, seq, backend)
            except RuntimeError as e:  # the kernel does not run here
                rows.append([heads, name, str(e).splitlines()[0][:60], "", "", "", "", ""])
                continue
            rows.append(
                [
                    heads,
                    name,
                    f"{f:.3f}",
                    f"{flops_f / (f / 1e3) / 1e12:.0f}",
                    f"{est_f:.3f}",
                    f"{b:.3f}",
                    f"{2.5 * flops_f / (b / 1e3) / 1e12:.0f}",
                    f"{est_b:.3f}",
                ]
            )
    headers = ["heads", "kernel", "fwd ms", "fwd TFLOP/s", "est fwd ms", "bwd ms", "bwd TFLOP/s", "est bwd ms"]
    return table(rows, headers)


def _model_file(size: str, overrides: dict[str, Any], device: torch.device) -> Any:
    """models/llama.py at ``size`` with ``overrides``, built straight on ``device`` in bf16."""
    from planner.capture.load import load_model_file, move_model

    mf = load_model_file(MODELS / "llama.py", size, overrides)
    build = mf.build

    def build_bf16(seed: int = 0) -> torch.nn.Module:
        with torch.device(device):
            return move_model(build(seed=seed), dtype=torch.bfloat16)

    mf.build = build_bf16  # type: ignore[method-assign]
    return mf


def _request(size: str, overrides: dict[str, Any], out: Path, **extra: Any) -> Any:
    from planner.schema.request import PlanRequest

    return PlanRequest.build(
        model_file=MODELS / "llama.py",
        size=size,
        overrides=overrides,
        gpus=1,
        batch_size=1,
        microbatches=1,
        output=out,
        progress=False,
        **extra,
    )


def blocks(device: torch.device, hw: HardwareSpec, dry: bool, tmp: Path) -> tuple[str, list[Any]]:
    """Every distinct block measured by the planner's profiler beside its estimate; the estimated costs."""
    from planner.api import estimated_costs, measured_costs
    from planner.capture.load import load_model_file

    rows, estimates = [], []
    for size, overrides in DRY_MODELS if dry else MODELS_AT:
        mf = _model_file(size, overrides, device)
        request = _request(size, overrides, tmp / "plan.json")
        measured = measured_costs(mf, request, 1, None)
        plain = load_model_file(MODELS / "llama.py", size, overrides)  # the estimate builds it on meta itself
        est = estimated_costs(plain, request.model_copy(update={"gpu_type": hw.name, "dtype": "bf16"}), 1)
        estimates.append((size, overrides, mf, plain, request, est))
        seen = set()
        for m, e in zip(measured.blocks, est.blocks):
            kind = m.name.split(".")[0]
            if kind in seen:
                continue
            seen.add(kind)
            rows.append(
                [
                    size,
                    m.name,
                    f"{m.fwd_s * 1e3:.2f}",
                    f"{e.fwd_s * 1e3:.2f}",
                    f"{e.fwd_s / m.fwd_s:.2f}",
                    f"{m.bwd_s * 1e3:.2f}",
                    f"{e.bwd_s * 1e3:.2f}",
                    f"{e.bwd_s / m.bwd_s:.2f}",
                    f"{m.activation_bytes / 2**20:.0f}",
                    f"{e.activation_bytes / 2**20:.0f}",
                ]
            )
    headers = ["size", "block", "fwd ms", "est", "est/meas", "bwd ms", "est", "est/meas", "saved MiB", "est"]
    return table(rows, headers), estimates


def _real_step(mf: Any, request: Any, device: torch.device) -> tuple[float, int, int]:
    """One training step of a bf16 model with fp32 master weights and AdamW moments, as the estimate
    assumes (16 B per parameter): its median ms, the peak bytes up to the end of the backward (what the
    plan's memory model counts), and the peak of the whole step (the step here also holds an fp32 copy
    of every gradient while it steps, 4 B per parameter the plan does not count: torch's AdamW takes
    no bf16 gradients for fp32 weights)."""
    model = mf.build(seed=0)
    inputs, target = mf.batch(request.microbatch_size, seed=0)
    inputs = tuple(x.to(device) for x in inputs)
    target = target.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float() for p in params]
    opt = torch.optim.AdamW(masters, lr=1e-5, foreach=True)
    cuda = device.type == "cuda"
    peaks = [0, 0]  # up to the end of the backward, whole step

    def step() -> None:
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        loss = mf.loss_fn(model(*inputs), target)
        loss.backward()
        if cuda:
            peaks[0] = max(peaks[0], torch.cuda.max_memory_allocated(device))
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for master, p in zip(masters, params):
            master.grad = p.grad.float()  # type: ignore[union-attr]
            p.grad = None
        opt.step()
        opt.zero_grad(set_to_none=True)  # the fp32 gradients live only during the step
        with torch.no_grad():
            torch._foreach_copy_(params, masters)
        if cuda:
            peaks[1] = max(peaks[1], torch.cuda.max_memory_allocated(device))

    ms = time_ms(step, device, warmup=2, repeats=5)
    return ms, peaks[0], peaks[1]


def steps(device: torch.device, estimates: list[Any]) -> str:
    """Each model's whole training step measured beside its one-GPU plan's prediction."""
    from bench.common import plan_on_costs

    rows = []
    for size, overrides, mf, plain, request, est in estimates:
        plan = plan_on_costs(
            request.model_copy(update={"gpu_type": est.hardware.name, "dtype": "bf16"}), est, plain, created="bench"
        )
        ms, peak, whole = _real_step(mf, request, device)
        predicted = plan.prediction.step_time_s * 1e3
        pred_mem = plan.prediction.max_memory_bytes
        shown = ", ".join(f"{k}={v}" for k, v in overrides.items())
        rows.append(
            [
                f"{size} ({shown})",
                f"{ms:.1f}",
                f"{predicted:.1f}",
                f"{predicted / ms:.2f}",
                f"{peak / 2**30:.2f}",
                f"{pred_mem / 2**30:.2f}",
                f"{pred_mem / peak:.2f}" if peak else "-",
                f"{whole / 2**30:.2f}",
            ]
        )
        torch.cuda.empty_cache() if device.type == "cuda" else None
    return table(
        rows,
        [
            "model",
            "step ms",
            "predicted",
            "pred/meas",
            "peak to bwd end GiB",
            "predicted",
            "pred/meas",
            "step peak GiB",
        ],
    )


def cuda_paths(tmp: Path) -> str:
    """``planner plan`` measured here, then ``planner run`` of that plan: their last lines."""
    plan = tmp / "tiny.json"
    commands = [
        ["plan", str(MODELS / "llama.py"), "--size", "tiny", "--gpus", "1", "--dtype", "bf16", "-o", str(plan)],
        ["run", str(plan), "--steps", "3"],
    ]
    rows = []
    for argv in commands:
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, str(ROOT / "cli.py"), *argv], capture_output=True, text=True, cwd=ROOT)
        lines = done.stdout.strip().splitlines()
        if done.returncode:
            print(done.stdout[-3000:], done.stderr[-3000:], sep="\n", file=sys.stderr)
            lines = done.stderr.strip().splitlines()
        warned = [line.strip() for line in done.stderr.splitlines() if "Warning" in line]
        if warned and not done.returncode and lines:
            lines[-1] += f" (and {len(warned)} warning line(s): {warned[0][:200]})"
        rows.append(
            [f"planner {argv[0]}", done.returncode, f"{time.perf_counter() - t0:.0f}", lines[-1][:300] if lines else ""]
        )
    return table(rows, ["command", "exit", "s", "last line"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU; print, write nothing")
    parser.add_argument("--out", type=Path, default=DOC, help="the page to write (default docs/gpu_check.md)")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        print("no CUDA device here: run on a GPU machine, or --dry-run", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    name = torch.cuda.get_device_name(device) if cuda else "cpu (dry run)"
    hw = _hardware_for(name) if cuda else get_hardware("h100")
    sections: list[tuple[str, str]] = []
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    estimates: list[Any] = []

    def section(title: str, fn: Callable[[], str]) -> None:
        t0 = time.perf_counter()
        try:
            body = fn()
        except Exception:  # one section failing must not lose the others' measurements
            body = "failed:\n\n```\n" + traceback.format_exc()[-1500:] + "```"
        print(f"## {title} ({time.perf_counter() - t0:.0f} s)\n\n{body}\n", flush=True)
        sections.append((title, body))

    def block_section() -> str:
        text, found = blocks(device, hw, args.dry_run, tmp)
        estimates.extend(found)
        return text

    section("Ceilings", lambda: ceilings(device, hw, args.dry_run))
    section(
        "GEMMs of a Llama 3 70B layer, whole and one tensor-parallel rank's shard",
        lambda: gemms(device, hw, args.dry_run),
    )
    section("Causal attention, head dim 128", lambda: attention(device, hw, args.dry_run))
    section("Blocks of models/llama.py: the planner's profiler beside its estimate", block_section)
    section("One training step beside the one-GPU plan", lambda: steps(device, estimates))
    section("The command line on the GPU", lambda: cuda_paths(tmp))
    if args.dry_run:
        return 0
    head = (
        f"# Estimates beside a GPU: {name}\n\n"
        f"Written by `python -m bench.gpu_check` on {datetime.date.today()} (torch {torch.__version__}, CUDA "
        f"{torch.version.cuda}); estimates from the planner's `{hw.name}` spec. What each section measures, and how, "
        "is in the script's docstring. est / meas above 1: the estimate is slower than the GPU.\n"
    )
    write_page(args.out, head + "".join(f"\n## {t}\n\n{b}\n" for t, b in sections))
    return 0


if __name__ == "__main__":
    sys.exit(main())
