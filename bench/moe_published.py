"""Published mixture-of-experts training runs against the planner: each run's own layout planned as it
ran, and the planner's search for the same GPUs and batch, into docs/published_runs.md (between its
moe-published markers, which ``bench/published_runs.py`` keeps when it rewrites the page).

    python -m bench.moe_published            # about 4 minutes here

Every figure below is copied from its source; nothing is fitted to it (the planner's constants come
from datasheets and microbenchmarks: docs/gpu_costs.md, docs/collectives.md). The error is the
published step over the predicted one, minus one, as on the rest of the page: positive where the
planner predicts faster than the run went.

Sources:

* Megatron-LM, ``megatron/core/transformer/moe/README.md`` (NVIDIA/Megatron-LM, before commit
  0888a06d26): "With MCore v0.9, we've achieved ... 468 TFLOPS for Mixtral 8X7B bf16 training", and
  its reference layout for Mixtral 8x7B (dropless, MCore v0.8, H100 80GB, 8 x 400 Gb/s InfiniBand a
  node): 64 GPUs, sequence 4096, TP 1, EP 8, PP 4, VP 8, microbatch 1, global batch 256. Assumed: the
  468 TFLOP/s were measured in that layout (the README gives the figure and the layout apart), in
  Megatron's FLOP count of the time (``num_floating_point_operations`` in ``megatron/training/
  training.py``: 12 B s L h^2 (1 + (f / h) top_k 3/2 + kv_groups / heads + s / h + V / (2 L h)),
  attention in full), with routing as the planner assumes by default (``--moe-imbalance``).
* DeepSeek-V3 technical report (arXiv 2412.19437): 2,048 H800, 8 a node on NVLink and NVSwitch,
  InfiniBand across ("NVLink offers a bandwidth of 160 GB/s, roughly 3.2 times that of IB (50 GB/s)",
  section 3.2.2); "16-way Pipeline Parallelism (PP), 64-way Expert Parallelism (EP) spanning 8 nodes,
  and ZeRO-1 Data Parallelism (DP)", no tensor parallelism (section 3.2); DualPipe; FP8 mixed
  precision (section 3.3); sequence 4K, batch 15,360 sequences after the first 469 B tokens (section
  4.2); Table 1: 2,664 K H800 GPU hours of pre-training for 14.8 T tokens, i.e. 1,543 tokens/s per
  GPU, everything included (checkpoints, failures, the ramp of the batch). Its routing is balanced
  without an auxiliary loss, whose busiest expert carries 1.04 x the mean (arXiv 2408.15664,
  Table 2). Not published: the microbatch (searched here).
* NVIDIA-NeMo/Megatron-Bridge ``docs/performance-summary-archive.md``, 26.02 NeMo container, model GPT OSS
  120B on DGX-H100: 64 GPUs, BF16, GBS 1280, MBS 1, sequence 4096, FSDP 0 (DDP with Megatron's
  distributed optimizer), TP 1, PP 4, CP 1, VP n/a, EP 8: 5,993 tokens/s per GPU (163 TFLOP/s). "In MoE
  training benchmarks, we force-balance the token distribution among experts and all benchmarks are
  token-dropless": an even spread here (``--moe-imbalance 1``). The model: transformers'
  ``GptOssConfig`` defaults (36 layers of 128 experts, top 4: gpt-oss-120b). Under DDP a rank would hold
  its stages' weights, gradients and AdamW state whole (61-70 GB), which the distributed optimizer
  shards; the planner's nearest is FSDP with the experts sharded over the replicas holding them.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import DOCS, MODELS, MOE_PUBLISHED, table, write_between_markers
from planner.api import make_plan
from planner.errors import PlannerError
from planner.schema.plan import Plan
from planner.schema.request import PlanRequest

DOC = DOCS / "published_runs.md"
BEGIN, END = MOE_PUBLISHED


def megatron_moe_flops(
    batch: int, seq: int, layers: int, hidden: int, ffn: int, top_k: int, kv: float, vocab: int
) -> float:
    """Megatron-LM's FLOPs per step of a SwiGLU MoE transformer (``num_floating_point_operations``, MCore
    v0.9): 12 B s L h^2 (1 + (f / h) top_k 3/2 + kv + s / h + V / (2 L h)), ``kv`` the query groups over
    the heads; forward and backward, no recomputation, attention in full."""
    h = hidden
    return 12 * batch * seq * layers * h * h * (1 + ffn / h * top_k * 1.5 + kv + seq / h + vocab / (2 * layers * h))


@dataclass(frozen=True)
class MoeRun:
    """One published MoE run: its model, GPUs, layout and figure."""

    key: str
    source: str
    model: str  # the model, as the page names it
    model_file: Callable[[Path], Path]  # where the planner reads it (a model file, or a config written to tmp)
    size: str | None
    overrides: dict[str, Any]
    gpu: str
    gpus: int
    dp: int
    ep: int
    schedule: str  # the planner's schedule nearest the run's
    stages_per_rank: int
    batch: int  # sequences a step
    seq: int
    microbatches: int | None  # per replica a pass (None: not published, searched)
    figure: float
    unit: str  # "tokens/s" or "TFLOP/s"
    flops: float | None  # per step, in the source's count (a TFLOP/s figure)
    imbalance: float | str
    layout: str  # as published
    leaves_out: str  # what the run had that the planner does not model
    extra: dict[str, Any] = field(default_factory=dict)
    dp_mode: str = "ddp"  # the planner's nearest to the run's data parallelism

    def step_s(self) -> float:
        """The step the published figure implies."""
        if self.unit == "tokens/s":
            return self.batch * self.seq / (self.figure * self.gpus)
        assert self.flops is not None
        return self.flops / (self.figure * 1e12 * self.gpus)

    def figure_at(self, step_s: float) -> float:
        """The figure, in the source's unit, of a step of ``step_s`` seconds."""
        return self.step_s() / step_s * self.figure


def _deepseek_config(tmp: Path) -> Path:
    """DeepSeek-V3 as transformers configures it (its defaults are the 671 B model), as a config.json."""
    from transformers import DeepseekV3Config

    folder = tmp / "deepseek-v3"
    folder.mkdir(exist_ok=True)
    DeepseekV3Config(architectures=["DeepseekV3ForCausalLM"]).to_json_file(folder / "config.json")
    return folder / "config.json"


def _gpt_oss_config(tmp: Path) -> Path:
    """GPT-OSS as transformers configures it (its defaults are gpt-oss-120b), as a config.json."""
    from transformers import GptOssConfig

    folder = tmp / "gpt-oss"
    folder.mkdir(exist_ok=True)
    GptOssConfig(architectures=["GptOssForCausalLM"]).to_json_file(folder / "config.json")
    return folder / "config.json"


RUNS = [
    MoeRun(
        key="megatron-mixtral-8x7b",
        source="Megatron-LM megatron/core/transformer/moe/README.md (MCore v0.8 layout, v0.9 figure)",
        model="Mixtral 8x7B (46.7 B, 12.9 B active)",
        model_file=lambda _tmp: MODELS / "hf" / "mixtral.py",
        size="8x7b",
        overrides={},
        gpu="h100",
        gpus=64,
        dp=16,
        ep=8,
        schedule="interleaved-1f1b",
        stages_per_rank=8,
        batch=256,
        seq=4096,
        microbatches=16,
        figure=468.0,
        unit="TFLOP/s",
        flops=megatron_moe_flops(256, 4096, 32, 4096, 14336, 2, 8 / 32, 32000),
        imbalance="auto",
        layout="TP 1, EP 8, PP 4, VP 8, MBS 1, GBS 256, dropless",
        leaves_out="Megatron's fused kernels (grouped GEMM, permute) and its overlap of the all-to-alls and the "
        "data-parallel reduction with compute; the distributed optimizer (ZeRO-1): DDP here",
    ),
    MoeRun(
        key="deepseek-v3",
        source="DeepSeek-V3 technical report (arXiv 2412.19437), sections 3.1-3.3, 4.2, Table 1",
        model="DeepSeek-V3 (671 B, 37 B active)",
        model_file=_deepseek_config,
        size=None,
        overrides={"seq_len": 4096},
        gpu="h800",
        gpus=2048,
        dp=128,
        ep=64,
        schedule="dualpipev",
        stages_per_rank=2,
        batch=15360,
        seq=4096,
        microbatches=None,
        figure=14.8e12 / (2664e3 * 3600),
        unit="tokens/s",
        flops=None,
        imbalance=1.04,
        layout="PP 16, EP 64 over 8 nodes, ZeRO-1 DP 128, DualPipe, FP8",
        leaves_out="FP8 GEMMs (the planner costs bf16); DualPipe's overlap of one microbatch's all-to-alls with "
        "another's compute (torch's DualPipeV, planned here, runs the two in turn: every exchange exposed); "
        "node-limited routing (each token sent to at most 4 nodes, once a node, then over NVLink: the planner "
        "sends every routed row); ZeRO-1: DDP here",
    ),
    MoeRun(
        key="megatron-bridge-gpt-oss-120b",
        source="NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md (26.02 container, DGX-H100)",
        model="GPT-OSS-120B (117 B, 5.1 B active)",
        model_file=_gpt_oss_config,
        size=None,
        overrides={"seq_len": 4096},
        gpu="h100",
        gpus=64,
        dp=16,
        ep=8,
        schedule="1f1b",
        stages_per_rank=1,
        batch=1280,
        seq=4096,
        microbatches=80,
        figure=5993.0,
        unit="tokens/s",
        flops=None,
        imbalance=1.0,
        layout="TP 1, PP 4, EP 8, MBS 1, GBS 1280, BF16, distributed optimizer, routing force-balanced",
        leaves_out="transformers' GPT-OSS attention runs eagerly (it has no SDPA path for its sinks: every "
        "head's 4,096 x 4,096 scores are materialised), where Megatron fuses it; Megatron's grouped GEMM and "
        "permute kernels and its overlap; the distributed optimizer (ZeRO-1): FSDP here (the weights gathered "
        "each microbatch where DDP does not fit)",
        dp_mode="fsdp",
    ),
]


# Published MoE figures with a layout, not compared: (run, source, published, why not)
NOT_COMPARED = [
    (
        "NeMo Megatron-Bridge 25.09, DeepSeek-V3 on 1,024 H100, TP 2, PP 8, VP 4, EP 64, GBS 8192, seq 4096",
        "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md",
        "1,297 tokens/s per GPU, 338 TFLOP/s (FP8)",
        "FP8, not run here yet (its TP 2 x EP 64 is: each expert group spans the tensor-parallel ranks)",
    ),
    (
        "NeMo Megatron-Bridge, Qwen3-235B-A22B on 256 H100 (TP 2, PP 8, EP 32) and Qwen3-30B-A3B on 16 H100",
        "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md",
        "1,204-1,712 and 8,960-10,494 tokens/s per GPU (FP8)",
        "FP8, not run here yet (TP 2 with EP is); the NeMo rows force-balance the routing",
    ),
    (
        "torchtitan, DeepSeek-V3 16B on 8 H100 (FSDP + EP)",
        "pytorch/torchtitan issue 1789",
        "about 20 % MFU",
        "an issue thread's figures, not a benchmark: the local batch and EP degree are not given",
    ),
]


@dataclass(frozen=True)
class Outcome:
    """A run planned as it ran (and with even routing), and searched."""

    run: MoeRun
    as_run: Plan | None
    even: Plan | None
    searched: Plan | None
    search_s: float
    why: str = ""


def _request(run: MoeRun, model_file: Path, tmp: Path, **options: Any) -> PlanRequest:
    values: dict[str, Any] = dict(
        model_file=model_file,
        size=run.size,
        overrides=run.overrides,
        gpus=run.gpus,
        gpus_per_node=8,
        gpu_type=run.gpu,
        batch_size=run.batch,
        moe_imbalance=run.imbalance,
        progress=False,
        output=tmp / f"{run.key}.json",
    )
    return PlanRequest.build(**{**values, **options})


def evaluate(run: MoeRun, tmp: Path) -> Outcome:
    """Plan ``run`` in its own layout (and with even routing), then search its GPUs."""
    model_file = run.model_file(tmp)
    pinned = dict(
        dp=run.dp,
        tp=1,
        ep=run.ep,
        dp_mode=run.dp_mode,
        schedule=run.schedule,
        stages_per_rank=run.stages_per_rank,
        microbatches=run.microbatches,
    )
    try:
        as_run = make_plan(_request(run, model_file, tmp, **pinned))
        even = make_plan(_request(run, model_file, tmp, **{**pinned, "moe_imbalance": 1.0}))
    except PlannerError as e:
        return Outcome(run, None, None, None, 0.0, str(e))
    t0 = time.perf_counter()
    try:
        searched = make_plan(_request(run, model_file, tmp, dp="auto", tp="auto", ep="auto"))
    except PlannerError as e:
        return Outcome(run, as_run, even, None, time.perf_counter() - t0, str(e))
    return Outcome(run, as_run, even, searched, time.perf_counter() - t0)


def _layout(plan: Plan) -> str:
    v = f", v {plan.stages_per_rank}" if plan.stages_per_rank > 1 else ""
    return (
        f"{plan.schedule}, pp {plan.n_ranks}{v}, dp {plan.dp} ({plan.dp_mode}), ep {plan.ep}, tp {plan.tp}, "
        f"m {plan.n_microbatches}"
    )


def _fmt(run: MoeRun, value: float) -> str:
    return f"{value:,.0f} {run.unit}"


def _error(run: MoeRun, plan: Plan) -> str:
    return f"{100 * (run.step_s() / plan.prediction.step_time_s - 1):+.1f}%"


def cells(o: Outcome) -> list[str]:
    """The run's row: published, as run (and its error), even routing, the search's choice."""
    run = o.run
    head = [run.key, f"{run.gpus} {run.gpu}", run.layout, _fmt(run, run.figure)]
    if o.as_run is None or o.even is None:
        return [*head, f"no plan: {o.why.split(';')[0][:160]}", "-", "-", "-", "-"]
    as_run = o.as_run.prediction.step_time_s
    searched = (
        f"{_layout(o.searched)}: {_fmt(run, run.figure_at(o.searched.prediction.step_time_s))} in {o.search_s:.0f} s"
        if o.searched is not None
        else f"no plan: {o.why.split(';')[0][:120]}"
    )
    return [
        *head,
        f"{_layout(o.as_run)}: {_fmt(run, run.figure_at(as_run))}, {o.as_run.prediction.max_memory_bytes / 2**30:.1f} GiB",
        _error(run, o.as_run),
        f"{_fmt(run, run.figure_at(o.even.prediction.step_time_s))} ({_error(run, o.even)})",
        searched,
        run.leaves_out,
    ]


HEADERS = [
    "run",
    "GPUs",
    "published layout",
    "published",
    "planned as run: layout, predicted, memory",
    "error",
    "even routing",
    "the planner's search",
    "what the planner leaves out",
]


def main() -> None:
    """Plan every run, write the section."""
    t0 = time.perf_counter()
    outcomes = []
    with tempfile.TemporaryDirectory() as tmp:
        for run in RUNS:
            outcomes.append(evaluate(run, Path(tmp)))
            print(json.dumps(cells(outcomes[-1])), file=sys.stderr, flush=True)
    body = (
        table([cells(o) for o in outcomes], HEADERS)
        + "\n\nNot compared:\n\n"
        + table(NOT_COMPARED, ["run", "source", "published", "why not compared"])
        + f"\n\nWritten by `python -m bench.moe_published` in {(time.perf_counter() - t0) / 60:.1f} minutes "
        "(sources and assumptions: the script's docstring)."
    )
    print(body)
    write_between_markers(DOC, BEGIN, END, body)


if __name__ == "__main__":
    main()
