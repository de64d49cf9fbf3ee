"""The planner against published large runs: each published layout's prediction beside its figure,
then the layout the search picks for the same GPUs and batch. Writes docs/published_runs.md.

    python -m bench.published_runs                  # every row (a few minutes: costs estimated once per model)
    python -m bench.published_runs --only llama3    # the rows whose source starts with "llama3"

Sources (the figures are copied from them, nothing here is fitted to them):

* Llama 3 paper (Dubey et al., "The Llama 3 Herd of Models", 2024), Table 4: Llama 3 405B, bf16,
  sequence 8,192, 16 M tokens per batch (2,048 sequences), on 8,192 and 16,384 H100 (8 per node),
  TP 8 x PP 16 x DP 64 / 128: 430 and 400 TFLOP/s per GPU, 43 % and 41 % BF16 MFU (model FLOPs).
  Its section 3.3.2 describes FSDP, an interleaved pipeline schedule and training "without
  activation checkpointing", in 80 GB: the layout is predicted as it ran (``--sequence-parallel
  --dp-mode fsdp --schedule interleaved-1f1b --recompute never``, memory not capped, since it
  fitted), with the planner's predicted peak beside the 80 GB; and again within 80 GB by the
  planner's memory model, which then has stages recompute.
* Megatron-LM paper (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
  Using Megatron-LM", SC 2021), Table 1: GPT models of 1.7 B to 1 T parameters on 32 to 3,072 A100-80GB
  (8 per node), vocabulary 51,200, sequence 2,048, fp16, with their t, p, d = n / (t p) and batch. The
  paper's TFLOP/s count the activation recomputation's extra forward (its formula has 96 B s l h^2 where
  training without recomputation does 72): the table below converts them to model FLOPs (the factor is
  in the "published" cell) so that they compare with the planner's model-FLOP utilisation.
* torchtitan (benchmarks/llama3_h100_202412_torchtitan.md, Table 1): Llama 3.1 8B, FSDP over 8 H100
  (96 GB HBM2e at 2.4 TB/s, 500 W power limit), local batch 2, sequence 8,192, selective
  recomputation: 5,762 tokens/s per GPU (eager, bf16, torch of 23 Dec 2024), 82.4 GiB peak memory.
  Planned for those GPUs (``--gpu-type h100-hbm2e``; at the power limit the peak is "between SXM and
  NVL", so the layout is predicted again at the H100 NVL's datasheet peaks, ``LOW_PEAK``) with the
  attention kernel that torch ran on them (``--attention-kernel flash``: torch's FlashAttention-2,
  its default on H100 from 2.5.1 to 2.10, pytorch/pytorch#138522), ``--recompute selective``
  (torchtitan's "op" policy, which ``planner run`` uses). Its "FSDP + torch.compile" row, 6,667
  tokens/s per GPU and 77.0 GiB, is planned with ``--compile`` (torchtitan compiles each transformer
  block; ``planner run`` compiles each stage; the estimate fuses each block's memory-bound operators,
  ``planner/costs/fusion.py``). Its Float8 row is not modelled and is left out.
* torchtitan (docs/performance.md of 2024, "Llama 3 performance numbers"): Llama 3 8B (selective "op"
  recomputation) and 70B (full) with FSDP over 64 A100-80GB, local batch 1, sequence 8,192: 2,973 and
  331 tokens/s per GPU. The GPUs' network is not given: the ``a100-80g`` spec's 200 Gb/s per GPU.

The models: `models/llama.py` at the published sizes (the 405B size by name; Megatron's GPT as the same
decoder with multi-head attention and a SwiGLU of 8h/3 (rounded up to a multiple of 128, so that tensor
parallelism divides it), which has GPT's 8 h^2 feed-forward parameters and FLOPs within 1.2 %; RMSNorm and rotary embeddings instead of LayerNorm and learned positions change neither).
Costs are estimated for the published GPU (roofline on the meta device, no weights allocated).
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import DOCS, MODELS, host, plan_on_costs, table, write_page
from planner.api import estimated_costs
from planner.capture.load import load_model_file
from planner.errors import PlannerError
from planner.report.throughput import throughput
from planner.schema.plan import Plan
from planner.schema.request import PlanRequest


@dataclass(frozen=True)
class Published:
    """One published run: the model, the GPUs, the layout and the figure."""

    source: str
    model: str  # a label
    size: str | None
    overrides: dict[str, Any]
    gpu: str
    gpus: int
    tp: int
    pp: int
    batch: int  # sequences per step, global
    tflops: float  # published TFLOP/s per GPU, model FLOPs (converted where the source counts recompute)
    note: str = ""
    request: dict[str, Any] = field(default_factory=dict)  # extra PlanRequest fields (recompute, dp mode)
    memory_gib: float | None = None  # the published GPUs' memory when it is not the spec's (H100 96 GB)
    peak_gib: float | None = None  # the published peak memory per GPU, where the source gives one
    low_gpu: str | None = None  # the GPU at the low end of a published range of peaks (``LOW_PEAK``)
    # what the run did that the planner's memory model would not choose within the GPUs' memory (no
    # recomputation): the layout is predicted so, memory not capped since it fitted, and again within
    # the GPUs' memory by the planner's memory model
    as_run: dict[str, Any] = field(default_factory=dict)

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


def _megatron_factor(h: int, layers: int, s: int = 2048, vocab: int = 51200) -> float:
    """Model FLOPs over the FLOPs Megatron's formula counts with recomputation (its eq. 3 vs. 72 B s l h^2)."""
    base = 1 + s / (6 * h)
    logits = 6 * vocab / (layers * h)
    return (72 * base + logits) / (96 * base + logits)


def _gpt(h: int, heads: int, layers: int) -> dict[str, Any]:
    return dict(
        dim=h,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=heads,
        vocab_size=51200,
        seq_len=2048,
        ffn_dim_multiplier=1.0,
        multiple_of=128,  # 8h/3 rounded up to 128 (at most +1.2 % FFN width): divisible by every tp degree
        rope_theta=10000.0,
    )


# Megatron-LM 2021, Table 1: (params label, heads, hidden, layers, t, p, GPUs, batch, TFLOP/s per GPU)
MEGATRON = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    ("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
]


SP = {"sequence_parallel": True}
# section 3.3.2 of the Llama 3 paper: FSDP, an interleaved schedule, "without activation checkpointing"
LLAMA3_AS_RUN = {"dp_mode": "fsdp", "schedule": "interleaved-1f1b", "recompute": "never"}

# torchtitan's H100s run at a 500 W power limit, and its benchmark says of their peak (footnote 2 of
# benchmarks/llama3_h100_202412_torchtitan.md): "the actual peak TFLOPs number is between SXM and
# NVL, and we don't know its exact value". Its rows are predicted at both ends: the h100-hbm2e spec
# (the SXM's datasheet peaks) and this one, the same GPU at the H100 NVL's datasheet peaks (NVIDIA
# H100 NVL datasheet: FP32 60 TFLOPS; TF32 835 / BF16 and FP16 1,671 TFLOPS with sparsity, half dense).
LOW_PEAK = "h100-hbm2e-nvl-peak"


def _register_low_peak() -> None:
    """Make ``LOW_PEAK`` a GPU type of this process (the benchmark's own; users never see it)."""
    from planner.core.levers.hardware import GPUS

    sxm = GPUS["h100-hbm2e"]
    GPUS[LOW_PEAK] = sxm.model_copy(
        update={
            "name": LOW_PEAK,
            "peak_flops": {"fp32": 60e12, "tf32": 417.5e12, "bf16": 835.5e12, "fp16": 835.5e12},
            "source": f"{sxm.source}, at the H100 NVL datasheet's peaks (the low end torchtitan gives)",
        }
    )


def published_runs() -> list[Published]:
    """Every published row the page compares with."""
    rows = [
        # the Llama 3 run splits norms and residuals along the sequence too (sequence parallelism),
        # and recomputes nothing
        *(
            Published(
                "llama3 Table 4",
                "Llama 3 405B",
                "405b",
                {},
                "h100",
                n,
                8,
                16,
                2048,
                tf,
                request=SP,
                as_run=LLAMA3_AS_RUN,
            )
            for n, tf in ((8192, 430.0), (16384, 400.0))
        ),
    ]
    for label, heads, h, layers, t, p, n, batch, tf in MEGATRON:
        factor = _megatron_factor(h, layers)
        rows.append(
            Published(
                "megatron2021 Table 1",
                f"GPT {label}",
                None,
                _gpt(h, heads, layers),
                "a100-80g",
                n,
                t,
                p,
                batch,
                tf * factor,
                note=f"{tf} x {factor:.3f}",
                request={"recompute": "always"},
            )
        )
    # torchtitan's rows compare tokens/s per GPU directly (the tflops field holds tokens/s for them)
    tokens = "tokens/s per GPU"
    # torchtitan's defaults for these rows: selective checkpointing of every block ("op" policy); the
    # attention kernel torch of December 2024 ran on an H100
    titan = {"dp_mode": "fsdp", "recompute": "selective", "attention_kernel": "flash"}
    for model, published, peak, compiled in (
        ("Llama 3.1 8B", 5762.0, 82.4, False),
        ("8B, compiled", 6667.0, 77.0, True),
    ):
        rows.append(
            Published(
                "torchtitan Table 1",
                model,
                "8b",
                {},
                "h100-hbm2e",  # the 96 GB HBM2e H100s of the run
                8,
                1,
                1,
                16,
                published,
                note=tokens,
                request=titan | ({"compile": True} if compiled else {}),
                peak_gib=peak,
                low_gpu=LOW_PEAK,
            )
        )
    for model, size, recompute, published in (
        ("Llama 3 8B", "8b", "selective", 2973.0),
        ("Llama 3 70B", "70b", "full", 331.0),
    ):
        request = {"dp_mode": "fsdp", "recompute": recompute}
        rows.append(Published("torchtitan A100", model, size, {}, "a100-80g", 64, 1, 1, 64, published, tokens, request))
    return rows


PAGE = """# The planner against published runs

Written by `bench/published_runs.py` on {today} ({host}, Python {python}). For each published run:
the planner's prediction for **that exact layout** (its tensor-parallel degree t, pipeline ranks p and
replicas d; the schedule, microbatches and split are the planner's best for that layout), beside the
published figure; then the layout the search picks by itself for the same GPUs and batch (`--tp auto
--dp auto --recompute auto`, sequence parallelism auto: where the published run recomputes, the
planner chooses which blocks of which stages do). Costs are estimated for the published GPU (bf16; the roofline model of
`planner/core/levers/hardware.py`), never measured: no GPU was used. Figures are TFLOP/s per GPU of model
FLOPs (forward and backward, no recomputation) unless the row says otherwise; error = predicted /
published - 1.

{rows}

How to read it:

- Sources: the Llama 3 paper (Dubey et al. 2024), Table 4; the Megatron-LM paper (Narayanan et al.,
  SC 2021), Table 1 (its TFLOP/s include the recomputed forward; the "published" cell shows the
  figure times the model-FLOP factor); torchtitan's `benchmarks/llama3_h100_202412_torchtitan.md`,
  Table 1, and its 2024 `docs/performance.md` (A100 rows) (tokens/s per GPU). The docstring of
  `bench/published_runs.py` gives the details.
- torchtitan's H100 rows are planned for the GPUs they ran on (`--gpu-type h100-hbm2e`: 96 GB HBM2e
  at 2.4 TB/s) and the attention kernel its torch of December 2024 ran there (`--attention-kernel
  flash`). Their 500 W power limit lowers the clocks by an amount not published; torchtitan says
  their peak "is between SXM and NVL", so these rows are predicted at both ends ("SXM .. NVL"): the
  H100 SXM's datasheet peaks, then the H100 NVL's (835.5 dense bf16 TFLOP/s instead of 989.5), the
  same layout, memory and links. The compiled row is planned with `--compile`: each run of memory-bound operators
  between matrix products and attention charged as one fused kernel (`planner/costs/fusion.py`),
  its element-wise outputs recomputed in backward rather than saved, as torch.compile's partitioner does.
- The Llama 3 rows are planned with `--sequence-parallel`, as that run split its norms and
  residuals along the sequence (Megatron-LM's 2021 runs predate it; torchtitan's rows use no tensor
  parallelism). They are predicted as that run trained (section 3.3.2): FSDP, torch's interleaved
  1F1B and `--recompute never` ("without activation checkpointing"), with memory not capped, since
  it fitted in 80 GB. The "fits" cell gives the peak that the planner's memory model (torch's eager
  kernels and schedules) predicts for it against the 80 GB. It also gives the planner's own fit of
  the layout within 80 GB, which recomputes, with that fit's figure and error.
- What the planner does not model (and so where errors come from): communication overlapped with
  compute (Megatron and Llama 3 overlap the data-parallel reduction: Llama 3's FSDP is "asynchronously
  prefetching sharded model weights and reducing gradients"; its paper says nothing of overlapping
  the tensor-parallel traffic, which the planner charges whole, as torch's eager DTensors run it); the Llama 3 run's own pipeline schedule
  (a tuned interleaving, "N" microbatches in a row), its first/last stages with one layer fewer, and
  its memory savings (it frees each stage's input and output tensors and trained "without
  activation checkpointing"; the planner's memory model, of torch's eager kernels and
  `PipelineStage`, has most stages recompute their first layer); Megatron's fused kernels
  (the roofline model's GEMM and attention efficiencies are fixed per GPU, `docs/gpu_costs.md`).
  The planner predicts `planner run`, which reduces gradients in fp32 (DDP's are those of the fp32
  weights autocast trains; FSDP's by its `reduce_dtype`), as torchtitan and the Llama 3 run do; the
  Megatron-LM runs of 2021 trained in fp16 and all-reduced fp16 gradients, half the bytes. Every
  collective of an NVIDIA GPU is charged by NCCL's own cost model (`planner/core/levers/collectives.py`,
  ported from NCCL 2.30.7's `src/graph/tuning.cc`: the algorithm and protocol NCCL picks for the
  message size, ring, tree, NVLS or PAT with LL, LL128 or Simple, over NVLink inside a node and the
  network cards of every node the group spans; checked against published nccl-tests figures in
  docs/collectives.md). A stage unit's gathers run from the pass's
  start and its reduce-scatter after the stage's last backward, holding the rank's compute stream
  (torch's schedules reduce there, `PipelineStage.perform_reduce_grad`, and FSDP2 makes the stream
  wait for it): only what a rank's idle time or its other stages' compute does not hide counts.
- "fits" is the planner's predicted per-rank peak against the GPU's memory; a published layout that
  the planner says does not fit ran in reality, so its memory model is pessimistic there (per-layer
  recomputation and sharding are issue 27's subject).

Regenerate: `python -m bench.published_runs` (about {minutes:.0f} minutes on this machine).
"""


def _figure(plan: Plan, row: Published) -> float:
    """The plan's predicted figure in the row's unit: model TFLOP/s per GPU, or tokens/s per GPU."""
    t = throughput(plan)
    if row.note == "tokens/s per GPU":
        return t.tokens_per_s_per_gpu or 0.0
    if t.mfu is None or t.peak_flops is None:
        return 0.0
    return t.mfu * t.peak_flops / 1e12


def _layout(plan: Plan) -> str:
    v = f", v {plan.stages_per_rank}" if plan.stages_per_rank > 1 else ""
    k = f", k {plan.accumulation} passes" if plan.accumulation > 1 else ""
    return (
        f"t {plan.tp} x p {plan.n_ranks} x d {plan.dp} ({plan.dp_mode if plan.dp > 1 else '-'}), "
        f"{plan.schedule}, m {plan.n_microbatches}{v}{k}, {_recompute(plan)}"
    )


def _recompute(plan: Plan) -> str:
    """The stages' recompute values, each with how many stages have it ("full:20 x 2, never x 14")."""
    counts: dict[str, int] = {}
    for stage in plan.stages:
        counts[stage.recompute] = counts.get(stage.recompute, 0) + 1
    if set(counts) == {"never"}:
        return "no recompute"
    several = len(plan.stages) > 1
    return "recompute " + ", ".join(f"{v} x {n}" if several else v for v, n in counts.items())


def _memory(plan: Plan) -> str:
    over = plan.memory_limit_bytes is not None and plan.prediction.max_memory_bytes > plan.memory_limit_bytes
    return f"{plan.prediction.max_memory_bytes / 2**30:.1f} GiB{' (over)' if over else ''}"


def _plan(base: PlanRequest, costs: Any, mf: Any, limit: int | None, **update: Any) -> tuple[Plan | None, str, float]:
    request = base.model_copy(update=update)
    t0 = time.perf_counter()
    try:
        plan = plan_on_costs(request, costs, mf, created="bench", memory_limit_bytes=limit)
    except PlannerError as e:
        return None, str(e).split(";")[0][:160], time.perf_counter() - t0
    return plan, "", time.perf_counter() - t0


def _chosen(plan: Plan) -> dict[str, Any]:
    """The request fields that pin ``plan``'s layout (schedule, microbatches, stages per rank,
    replicas' mode, recomputation), so another GPU's costs predict the same run."""
    fields: dict[str, Any] = {
        "schedule": plan.schedule,
        "microbatches": plan.n_microbatches,
        "stages_per_rank": plan.stages_per_rank,
    }
    if plan.dp > 1:
        fields |= {"dp_mode": plan.dp_mode, "fsdp_units": plan.fsdp_units}
    recompute = {stage.recompute for stage in plan.stages}
    if len(recompute) == 1 and ":" not in (mode := next(iter(recompute))):
        fields["recompute"] = mode
    return fields


def evaluate(row: Published, tmp: Path) -> list[str]:
    """The page's row for one published run: published figure, the prediction of its layout, the search's."""
    base = PlanRequest.build(
        model_file=MODELS / "llama.py",
        size=row.size,
        overrides=row.overrides,
        gpus=row.gpus,
        gpu_type=row.gpu,
        gpus_per_node=8,
        dtype="bf16",
        batch_size=row.batch,
        tp=row.tp,
        dp=row.dp,
        output=tmp / "plan.json",
        progress=False,
        # the published runs' own choice: sequence parallelism only where the row says so (the Llama 3 run)
        **({"sequence_parallel": False} | row.request),
    )
    mf = load_model_file(base.model_file, base.size, base.overrides)
    costs = estimated_costs(mf, base, 1)
    limit = round(row.memory_gib * 2**30) if row.memory_gib is not None else costs.memory_bytes
    given, why, t_given = _plan(base, costs, mf, limit)
    fitted = None  # the planner's own fit of the layout within the GPUs' memory, for an ``as_run`` row
    if row.as_run:  # as it trained: no recomputation, memory not capped (it fitted in reality)
        fitted = given
        given, _, t_as_run = _plan(base, costs, mf, None, **row.as_run)
        t_given += t_as_run
    elif given is None:  # the published layout does not fit the planner's memory model: predict it anyway
        given, _, t_given = _plan(base, costs, mf, None)
    # the planner's own choice: layout and activation checkpointing (which blocks of which stages)
    searched, why_s, t_search = _plan(
        base, costs, mf, limit, tp="auto", dp="auto", recompute="auto", sequence_parallel="auto"
    )
    low = None
    if row.low_gpu is not None and given is not None:  # the same layout at the low end of the peaks
        _register_low_peak()
        at_low = base.model_copy(update={"gpu_type": row.low_gpu})
        low_costs = estimated_costs(mf, at_low, 1)
        low, _, _ = _plan(at_low, low_costs, mf, None, **_chosen(given))
    published = f"{row.tflops:,.0f}" + (f" ({row.note})" if row.note else "")
    cells = [row.source, row.model, f"{row.gpus:,} {row.gpu}", f"t {row.tp} x p {row.pp} x d {row.dp}", str(row.batch)]
    cells.append(published)
    if given is None:
        cells += ["—", "—", why or "no plan", "—"]
    else:
        figure = _figure(given, row)
        if not row.as_run:
            fits = "yes" if not why else "no: " + _memory(given)
        else:  # the peak it would need by the planner's count, and the planner's own fit
            peak, cap = given.prediction.max_memory_bytes / 2**30, limit / 2**30
            fits = f"peak {peak:.1f} GiB against {cap:.1f} ({peak / cap - 1:+.0%}, the memory model's excess)"
            if fitted is not None:
                fitted_figure = _figure(fitted, row)
                fits += (
                    f"; within {cap:.1f} GiB: {_layout(fitted)}, {fitted_figure:,.0f} "
                    f"({fitted_figure / row.tflops - 1:+.0%})"
                )
            else:
                fits += f"; within {cap:.1f} GiB: {why}"
        if row.peak_gib is not None:  # the peak beside the published one
            peak = given.prediction.max_memory_bytes / 2**30
            fits += f", peak {peak:.1f} GiB against {row.peak_gib} published ({peak / row.peak_gib - 1:+.0%})"
        predicted, error = f"{figure:,.0f}", f"{figure / row.tflops - 1:+.0%}"
        if low is not None:  # "SXM peak .. NVL peak"
            low_figure = _figure(low, row)
            predicted += f" .. {low_figure:,.0f}"
            error += f" .. {low_figure / row.tflops - 1:+.0%}"
        cells += [
            predicted,
            error,
            f"{_layout(given)}; fits {fits}",
            f"{t_given:.0f}",
        ]
    if searched is None:
        cells += [why_s or "no plan", "—", f"{t_search:.0f}"]
    else:
        cells += [_layout(searched), f"{_figure(searched, row):,.0f}", f"{t_search:.0f}"]
    return cells


HEADERS = [
    "source",
    "model",
    "GPUs",
    "published layout",
    "batch",
    "published",
    "predicted",
    "error",
    "planner on that layout",
    "s",
    "search's choice",
    "its figure",
    "s",
]


def main() -> None:
    """Plan every published row, write the page."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="only the rows whose source starts with this")
    parser.add_argument("--out", type=Path, default=DOCS / "published_runs.md")
    args = parser.parse_args()
    t0 = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for row in published_runs():
            if not row.source.startswith(args.only):
                continue
            rows.append(evaluate(row, Path(tmp)))
            print(" | ".join(rows[-1]), flush=True)
    text = PAGE.format(
        today=dt.date.today().isoformat(),
        host=host(),
        python=platform.python_version(),
        rows=table(rows, HEADERS),
        minutes=(time.perf_counter() - t0) / 60,
    )
    write_page(args.out, text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
