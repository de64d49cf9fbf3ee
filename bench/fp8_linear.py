"""A linear layer in float8 against bf16 on an H100, as the planner's roofline charges it, beside torchao's
published H100 microbenchmark: writes docs/fp8_linear.md.

Each layer is run forward and backward on the meta device under the roofline (``planner.costs.roofline``),
once as ``nn.Linear`` in bf16 and once converted to torchao's ``Float8Linear`` (``--dtype fp8``): its casts
and scales as torchao computes them, its GEMMs at the FP8 peak. Eager (each operator a kernel, issued by
the host) and compiled (memory-bound operators fused, ``--compile``). torchao's README (torchao/float8,
"Performance") gives two measured points for a compiled tensorwise linear on an H100: a float8 speedup of
0.80 at (M, K, N) = (1024, 2048, 1024) and 1.39 at (4096, 8192, 16384). The other shapes are a Llama 3 8B
layer's at 16,384 tokens a microbatch (no published figure).

    python -m bench.fp8_linear [--out docs/fp8_linear.md]
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
from pathlib import Path

import torch

from bench.common import DOCS, host, table, write_page
from planner.capture.float8 import convert_stage_modules
from planner.core.levers.hardware import GPUS
from planner.costs.roofline import Roofline, Tally

# (name, M, K, N, torchao's published compiled tensorwise speedup or None)
SHAPES: list[tuple[str, int, int, int, float | None]] = [
    ("torchao README, small", 1024, 2048, 1024, 0.80),
    ("torchao README, large", 4096, 8192, 16384, 1.39),
    ("Llama 3 8B wq / wo", 16384, 4096, 4096, None),
    ("Llama 3 8B wk / wv", 16384, 4096, 1024, None),
    ("Llama 3 8B w1 / w3", 16384, 4096, 14336, None),
    ("Llama 3 8B w2", 16384, 14336, 4096, None),
]


def linear_seconds(m: int, k: int, n: int, recipe: str | None, compiled: bool, gpu: str = "h100") -> float:
    """Seconds of one linear layer's forward and backward (input ``m x k``, weight ``n x k``, no bias) on
    ``gpu``, as the roofline charges them.

    Args:
        m: rows of the input (tokens).
        k: the input width.
        n: the output width.
        recipe: torchao's float8 recipe ("tensorwise", "rowwise"), or None for bf16.
        compiled: charged as ``torch.compile`` runs it (fused memory-bound operators).
        gpu: a shipped GPU spec.

    Returns:
        Seconds.
    """
    with torch.device("meta"):
        layer = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)).to(torch.bfloat16)
    if recipe is not None:
        convert_stage_modules(layer, recipe, (), emulate=True)
    x = torch.empty(m, k, device="meta", dtype=torch.bfloat16, requires_grad=True)
    mode = Roofline(GPUS[gpu], "bf16", fuse=compiled)
    fwd, bwd = Tally(), Tally()
    with mode.phase(fwd):
        y = layer(x)
    with mode.phase(bwd):
        y.backward(torch.empty_like(y))
    return fwd.seconds + bwd.seconds


def rows() -> list[list[str]]:
    """One row per shape and mode: bf16 and float8 times, the speedups and torchao's published one."""
    out = []
    for name, m, k, n, published in SHAPES:
        for compiled in (True, False):
            bf16 = linear_seconds(m, k, n, None, compiled)
            tensorwise = linear_seconds(m, k, n, "tensorwise", compiled)
            rowwise = linear_seconds(m, k, n, "rowwise", compiled)
            pub = f"{published:.2f}" if published is not None and compiled else "—"
            out.append(
                [
                    name,
                    f"{m} x {k} x {n}",
                    "compiled" if compiled else "eager",
                    f"{bf16 * 1e6:,.1f}",
                    f"{tensorwise * 1e6:,.1f}",
                    f"{bf16 / tensorwise:.2f}",
                    f"{bf16 / rowwise:.2f}",
                    pub,
                    f"{100 * (bf16 / tensorwise / published - 1):+.1f}%" if published is not None and compiled else "—",
                ]
            )
    return out


HEADERS = [
    "shape",
    "M x K x N",
    "mode",
    "bf16 (us)",
    "float8 tensorwise (us)",
    "speedup, tensorwise",
    "speedup, rowwise",
    "published (torchao)",
    "error",
]

PAGE = """# A linear layer in float8, estimated against torchao's H100 microbenchmark

Written by `python -m bench.fp8_linear` on {today}, on {host} (Python {python}); no GPU was used: every
time is the planner's roofline estimate for an H100 SXM (the shipped `h100`: 989.5 bf16 and 1,979 FP8 dense
TFLOP/s, 3.35 TB/s), of one linear layer's forward and backward, in bf16 and converted to torchao's
`Float8Linear` (docs/fp8.md says how each part is charged). torchao's README ("Performance",
torchao/float8/README.md) measured a compiled tensorwise linear on an H100 at two shapes; the table
gives the estimate beside them. Nothing is fitted to them: the FP8 GEMM rate is NVIDIA's published
1.75x of bf16 for large GEMMs on Hopper, the casts are torchao's own operators under the roofline.

{table}

Eager float8 is slower than bf16 at every shape: torchao's scale and cast run as a dozen separate
kernels per operand (absolute value, maximum, division, clamp, cast), each a pass over the tensor, and
each issued by the host; torchao's README and torchtitan compile float8 for that reason.
"""


def main() -> None:
    """Estimate every shape, write the page."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DOCS / "fp8_linear.md")
    args = parser.parse_args()
    text = PAGE.format(
        today=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        host=host(),
        python=platform.python_version(),
        table=table(rows(), HEADERS),
    )
    write_page(args.out, text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
