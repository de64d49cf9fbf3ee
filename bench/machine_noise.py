"""How much this machine's speed moves on its own: the noise floor under every predicted-vs-measured figure.

The planner's costs are measured at one moment and a run happens at another. This script repeats
one measurement, the in-context profile of a model (``planner.costs.context.time_in_context``: the
whole model as one marked stage, forward + loss + backward, median of 5 runs after 2 warm-ups),
again and again for a while, and reports how far the repeats spread. Two independent draws of
that spread differ by about sqrt(2) times it, which bounds how close any prediction can come to one
run, however exact the model. Writes ``docs/machine_noise.md``.

    .venv/bin/python -m bench.machine_noise [--seconds 40] [--model models/gpt.py --size tiny -b 8]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from bench.common import DOCS, MODELS, ROOT, write_page
from planner.capture.load import load_model_file
from planner.capture.trace import trace_model
from planner.costs.context import time_in_context
from planner.costs.settings import ProfileSettings, Sample


def sample(model: Path, size: str, batch: int, seconds: float) -> list[tuple[float, float]]:
    """(seconds since start, forward + backward ms) of repeated in-context profiles for ``seconds``."""
    mf = load_model_file(model, size)
    inputs, target = mf.batch(batch, seed=0)
    traced = trace_model(mf.build(0), inputs)
    out = []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        ctx = time_in_context(traced, Sample(inputs, target, mf.loss_fn), ProfileSettings(warmup=2, repeats=5), "cpu")
        out.append((time.perf_counter() - t0, (sum(ctx.fwd) + sum(ctx.bwd)) * 1e3))
    return out


def page(args: argparse.Namespace, values: list[tuple[float, float]]) -> str:
    """The markdown page."""
    ms = [v for _, v in values]
    mean, sd = statistics.mean(ms), statistics.stdev(ms)
    q = statistics.quantiles(ms, n=10)
    lag = [abs(b - a) / a for (_, a), (_, b) in zip(values, values[1:])]
    every = max(1, len(values) // 20)
    trace = ", ".join(f"{t:.1f} s: {v:.1f}" for t, v in values[::every])
    return f"""# Machine noise: how much one measurement moves on its own

Written by `bench/machine_noise.py` on {dt.date.today().isoformat()} ({platform.node() or "this machine"}, \
{os.cpu_count()} cores, torch {torch.__version__}, 1 thread). The in-context profile of
`{args.model} --size {args.size}` at microbatch {args.batch} (the whole model as one marked stage,
forward + loss + backward, median of 5 runs after 2 warm-ups: what `planner plan` measures per
block) repeated for {args.seconds:.0f} s.

| samples | mean ms | stdev | 10th pct ms | 90th pct ms | min ms | max ms | mean change between neighbours |
|---|---|---|---|---|---|---|---|
| {len(ms)} | {mean:.2f} | {100 * sd / mean:.1f} % | {q[0]:.2f} | {q[-1]:.2f} | {min(ms):.2f} | {max(ms):.2f} | \
{100 * statistics.mean(lag):.1f} % |

Over time (every {every}th sample): {trace}.

A plan's costs are one such draw and a run's median step another: with a spread of s between
draws, the two differ by about sqrt(2) s (here {100 * 2**0.5 * sd / mean:.0f} %) whatever the cost
model, and the mean absolute difference of two independent normal draws is about 0.8 of that
({100 * 0.8 * 2**0.5 * sd / mean:.0f} %). Errors in docs/cost_accuracy.md below that are noise.
"""


def main() -> None:
    """Sample, print the summary line, write the page."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=MODELS / "gpt.py")
    parser.add_argument("--size", default="tiny")
    parser.add_argument("-b", "--batch", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--out", type=Path, default=DOCS / "machine_noise.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    values = sample(args.model, args.size, args.batch, args.seconds)
    args.model = args.model.resolve().relative_to(ROOT) if args.model.resolve().is_relative_to(ROOT) else args.model
    text = page(args, values)
    write_page(args.out, text)
    print(text.splitlines()[-1] if text else "", f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
