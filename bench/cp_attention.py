"""Where ring attention pays: one context-parallel layout planned both ways (``--cp-attention all-gather``
and ``ring``), Llama 3 70B and 405B on H100s, from 8,192 to 131,072 tokens a sequence: writes
docs/cp_attention.md.

Each case is one data-parallel replica of tensor parallelism 8 within a node, 4 (70B) or 16 (405B)
pipeline ranks and ``cp`` context-parallel ranks across nodes (the Llama 3 long-context stage's
arrangement), FSDP over the cp ranks, two sequences a pipeline rank a step, recomputation as the planner
chooses within the H100's memory. Everything is the planner's estimate
(``--gpu-type h100``): the gather waits for every position's keys and values before attention; the ring
hides each step's send behind that step's attention (``planner.core.levers.context_parallel``).

    python -m bench.cp_attention [--out docs/cp_attention.md]
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import tempfile
import time
from pathlib import Path

from bench.common import DOCS, ROOT, host, table, write_page
from planner.api import make_plan
from planner.schema.plan import Plan
from planner.schema.request import PlanRequest

# (size, sequence length, cp): the Llama 3 405B long-context stage ran 131,072 tokens with cp 16
CASES: list[tuple[str, int, int]] = [
    ("70b", 8192, 2),
    ("70b", 32768, 4),
    ("70b", 131072, 16),
    ("405b", 8192, 2),
    ("405b", 32768, 4),
    ("405b", 131072, 16),
]


PIPELINE = {"70b": 4, "405b": 16}  # pipeline ranks: the weights' FSDP shards then fit beside the activations


def planned(size: str, seq: int, cp: int, attention: str, out: Path) -> tuple[Plan, float]:
    """The layout planned with ``attention``, and the seconds planning took."""
    request = PlanRequest.build(
        model_file=ROOT / "models" / "llama.py",
        size=size,
        overrides={"seq_len": seq},
        gpus=8 * cp * PIPELINE[size],
        gpu_type="h100",
        tp=8,
        cp=cp,
        dp=1,
        dp_mode="fsdp",
        sequence_parallel=False,
        batch_size=2 * PIPELINE[size],
        recompute="auto",
        cp_attention=attention,
        output=out,
        progress=False,
    )
    t0 = time.perf_counter()
    plan = make_plan(request)
    return plan, time.perf_counter() - t0


def rows(tmp: Path) -> list[list[str]]:
    """One row per case: both methods' steps and peaks, and which the search picks (``auto``)."""
    out = []
    for size, seq, cp in CASES:
        gathered, _ = planned(size, seq, cp, "all-gather", tmp / "g.json")
        ring, _ = planned(size, seq, cp, "ring", tmp / "r.json")
        auto, seconds = planned(size, seq, cp, "auto", tmp / "a.json")
        g, r = gathered.prediction, ring.prediction
        out.append(
            [
                f"Llama 3 {size.upper()}",
                f"{seq:,}",
                f"t 8 x p {gathered.n_ranks} x cp {cp}",
                f"{g.step_time_s:.2f}",
                f"{r.step_time_s:.2f}",
                f"{g.step_time_s / r.step_time_s:.3f}",
                f"{g.max_memory_bytes / 2**30:.1f}",
                f"{r.max_memory_bytes / 2**30:.1f}",
                f"{auto.cp_attention} ({seconds:.0f} s)",
            ]
        )
    return out


HEADERS = [
    "model",
    "tokens a sequence",
    "layout",
    "all-gather step (s)",
    "ring step (s)",
    "ring speedup",
    "all-gather peak (GiB)",
    "ring peak (GiB)",
    "--cp-attention auto picks",
]

PAGE = """# Ring attention against the all-gather, as the planner predicts them

Written by `python -m bench.cp_attention` on {today}, on {host} (Python {python}), in {minutes:.1f}
minutes; no GPU was used: every figure is the planner's estimate for H100 SXM GPUs (`--gpu-type h100`,
8 a node). Each case: tensor parallelism 8 inside a node, 4 (70B) or 16 (405B) pipeline ranks, `cp`
context-parallel ranks across nodes, FSDP over them, two sequences a pipeline rank a step,
recomputation chosen within the memory;
planned with `--cp-attention all-gather`, `ring`, and `auto` (both searched).

{table}

The gather waits for every position's keys and values before attention and keeps them for backward;
the ring sends one chunk a step, hidden behind that step's attention where the attention lasts longer
(docs/context_parallel.md, "Costs"). With grouped-query attention's 8 key-value heads the chunks are
small, so the gather is short as well: the ring's gain is what the gather leaves exposed, and it grows
with the sequence (the gather grows with it, and the attention that hides the ring's sends grows
faster). Each peak is its own plan's: the recomputation is chosen per plan within the memory, so the
memory the ring frees may go to recomputing less.
"""


def main() -> None:
    """Plan every case both ways, write the page."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DOCS / "cp_attention.md")
    args = parser.parse_args()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        body = table(rows(Path(tmp)), HEADERS)
    text = PAGE.format(
        today=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        host=host(),
        python=platform.python_version(),
        minutes=(time.perf_counter() - t0) / 60,
        table=body,
    )
    write_page(args.out, text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
