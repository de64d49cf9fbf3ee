"""The published runs that ``bench.published_runs`` compares the planner with: each run's figure, layout,
GPUs and FLOP convention, copied from its source (nothing here is fitted to them). Pure: no torch.

A row's published figure is turned into the step time it implies, in the source's own convention
(its FLOP formula, or tokens per second): ``published_step_s``. The planner's predicted step is put
into the same convention (``figure_at``), so that the error is the published step over the
predicted one, minus one, whatever the convention; the planner's own model FLOPs (causal attention
at half) give a second figure beside it, with the same error.

Sources:

* Llama 3 paper (Dubey et al., "The Llama 3 Herd of Models", 2024, arXiv 2407.21783), Table 4:
  Llama 3 405B, bf16, sequence 8,192, 2,048 sequences a step, TP 8 x PP 16 x DP 64 / 128 on 8,192 /
  16,384 H100 (80 GB HBM3, "up to 700W TDP", section 3.3.1): 430 and 400 TFLOP/s per GPU (43 % and
  41 % BF16 MFU). Section 3.3.2: FSDP, an interleaved schedule, training "without activation
  checkpointing". The paper does not give its FLOP formula: PaLM's (Chowdhery et al. 2022, appendix
  B: 6 N + 12 l h s per token, N without the token embedding, attention in full) is assumed, the one
  torchtitan (the same company's) uses; 430 / 989.5 = 43.5 % agrees with the published MFU.
* Megatron-LM paper (Narayanan et al., SC 2021, arXiv 2104.04473), Table 1: GPT models of 1.7 B to
  1 T parameters on 32 to 3,072 A100-80GB (8 per node, 200 Gb/s HDR InfiniBand per GPU), vocabulary
  51,200, sequence 2,048, fp16, full activation recomputation, data-parallel all-reduce. Its TFLOP/s
  count the recomputed forward and attention in full: its eq. (3), 96 B s l h^2 (1 + s/6h + V/16lh).
  Table 1 does not name the pipeline schedule: the paper's interleaved 1F1B (section 2.2.2) is
  assumed where p > 1 (the zero-bubble schedules the planner also knows came in 2023).
* torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (pytorch/torchtitan; torch of 23 Dec 2024):
  Llama 3.1 8B, FSDP, sequence 8,192, local batch 2, selective ("op") recomputation, on Grand Teton
  H100s (96 GB HBM2e at 2.4 TB/s, 400 Gb/s per GPU, 500 W power limit): Table 1 on 8 GPUs, 5,762
  tokens/s per GPU (82.4 GiB), compiled 6,667 (77.0 GiB); Table 3 on 128 GPUs, 5,605 (67.0 GiB),
  compiled 6,514 (62.0 GiB). With Float8 linears as well (``--dtype fp8``): 8B on 8 GPUs 8,532
  (76.8 GiB), on 128 GPUs 8,380 (61.8 GiB); Table 4, 70B on 256 GPUs, FSDP 32 x TP 8, local batch
  16, full recomputation: 829 (71.9 GiB; 876 with asynchronous TP); Table 5, 405B on 512 GPUs, FSDP 8
  x TP 8 x PP 8, local batch 32, full recomputation, asynchronous TP: 1F1B 100 (82.5 GiB),
  interleaved 1F1B 128 (72.7 GiB). The page names neither the float8 recipe nor its FSDP option:
  tensorwise scaling (the only recipe torchtitan's float8 converter had in December 2024) with
  FSDP's float8 all-gather (its documented float8 setting) are assumed. Tables 2 and 6 add context
  parallelism (FSDP x CP, compiled, Float8, full recomputation, the sequence doubling as cp does):
  the ``titan-*-cp*`` rows, planned with the all-gather attention torch's ``context_parallel`` ran.
* torchtitan, docs/performance.md as of commit 3faaa1a (Aug 2024): Llama 3.1 405B on 128 H100
  (footnote 1: "HBM2e based lower TDP SXM H100 (95GB)"), FSDP 16 x TP 8, local batch 2, full
  recomputation, no Float8 or async TP: 109 tokens/s per GPU (29.0 % MFU at the SXM peak). The row
  names no optimisation; the preset of that commit (train_configs/llama3_405b.toml) compiles. It is
  planned eager with sequence parallelism (torchtitan's TP shards the norms so; the planner's
  sequence parallelism runs eagerly only): an assumption. Its Llama 3 rows on 64 A100-80GB, FSDP, local
  batch 1: 8B with selective op recomputation 2,973 tokens/s per GPU, 70B with full 331.
* OPT (Zhang et al. 2022, arXiv 2205.01068), section 2.4: OPT-175B on 992 A100 80GB, FSDP with
  Megatron tensor parallelism, "up to 147 TFLOP/s per GPU"; Table 1: 96 layers, 96 heads, width
  12,288, batch 2M tokens; sequence 2,048; GPT-2's BPE (vocabulary 50,272). Not published there:
  the tensor-parallel degree (8, one node, assumed), the batch in sequences (992 = 8 a replica, 2.03 M
  tokens, assumed), recomputation (full, assumed) and the FLOP formula (Megatron's model FLOPs, 72 B s
  l h^2 (1 + s/6h + V/12lh), assumed).
* MegaScale (Jiang et al., NSDI 2024, arXiv 2402.15627): a 175B model on 12,288 GPUs at 55.2 % MFU
  (abstract), batch 6,144 (Table 2's caption); the system runs TP with sequence parallelism, an
  interleaved 1F1B pipeline and ZeRO-2 data parallelism (section 3, Figures 1-3). Not read here: the
  model's table, the layout's degrees and the GPU variant. Assumed: GPT-3 175B's shape (Brown et al.
  2020, Table 2.1: 96 layers, width 12,288, 96 heads, context 2,048), vocabulary 51,200, TP 8 x PP 8 x
  DP 192, A100 80GB, and Megatron's model-FLOP formula at the A100's 312 TFLOP/s. Its parallel
  transformer block and sliding-window attention are not modelled (the planner's block is sequential).
  The abstract also gives Megatron-LM on the same run, 1.34x slower (55.2 / 1.34 = 41.2 % MFU): the
  ``megascale-175b-megatron`` row, Megatron-LM's code being what the planner models.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

Convention = Literal["megatron96", "megatron72", "palm", "tokens"]
Unit = Literal["TFLOP/s", "MFU %", "tokens/s"]

# what each convention counts, for the page
CONVENTIONS: dict[str, str] = {
    "megatron96": "Megatron-LM eq. (3): 96 B s l h^2 (1 + s/6h + V/16lh), recomputed forward and attention "
    "in full (Narayanan et al. 2021)",
    "megatron72": "Megatron-LM's model FLOPs: 72 B s l h^2 (1 + s/6h + V/12lh), attention in full, no "
    "recomputation (Narayanan et al. 2021, appendix)",
    "palm": "PaLM's 6 N + 12 l h s per token (Chowdhery et al. 2022, appendix B; N without the token "
    "embedding, attention in full)",
    "tokens": "tokens per second per GPU (no FLOP count)",
}


@dataclass(frozen=True)
class Shape:
    """The transformer's published shape: what a FLOP formula needs."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int  # feed-forward width (SwiGLU: three matrices; GPT's 4h: ``gated`` False)
    vocab: int
    seq: int
    gated: bool = True

    @property
    def params(self) -> int:
        """N: the parameters PaLM's formula counts (every matrix but the token embedding; norms aside)."""
        head_dim = self.hidden // self.heads
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head_dim
        ffn = (3 if self.gated else 2) * self.hidden * self.ffn
        return self.layers * (attention + ffn) + self.vocab * self.hidden


def megatron96(batch: int, s: Shape) -> float:
    """Megatron-LM 2021 eq. (3): FLOPs per step with full recomputation, attention in full.

    Args:
        batch: sequences per step.
        s: the model's shape.

    Returns:
        FLOPs per step.
    """
    b, q, n, h, v = batch, s.seq, s.layers, s.hidden, s.vocab
    return 96 * b * q * n * h * h * (1 + q / (6 * h) + v / (16 * n * h))


def megatron72(batch: int, s: Shape) -> float:
    """Megatron-LM's model FLOPs (no recomputation): 72 B s l h^2 (1 + s/6h + V/12lh).

    Args:
        batch: sequences per step.
        s: the model's shape.

    Returns:
        FLOPs per step.
    """
    b, q, n, h, v = batch, s.seq, s.layers, s.hidden, s.vocab
    return 72 * b * q * n * h * h * (1 + q / (6 * h) + v / (12 * n * h))


def palm(batch: int, s: Shape) -> float:
    """PaLM's model FLOPs (appendix B): (6 N + 12 l h s) per token, attention in full.

    Args:
        batch: sequences per step.
        s: the model's shape.

    Returns:
        FLOPs per step.
    """
    return batch * s.seq * (6 * s.params + 12 * s.layers * s.hidden * s.seq)


# MegaScale's abstract: 55.2 % MFU for 175B on 12,288 GPUs, "improving the MFU by 1.34x compared to
# Megatron-LM".
MEGASCALE_GAIN = 1.34

FORMULAS = {"megatron96": megatron96, "megatron72": megatron72, "palm": palm}


@dataclass(frozen=True)
class Published:
    """One published run: the model, the GPUs, the layout, the figure and its convention."""

    key: str  # short id for the page
    source: str  # the public source: paper and table / section, or repository file
    model: str
    size: str | None  # a key of models/llama.py's SIZES (None: ``overrides`` give the shape)
    overrides: dict[str, Any]
    shape: Shape
    gpu: str  # a shipped GPU type (planner/core/levers/hardware.py)
    gpu_note: str  # the GPUs that ran, and how the shipped spec differs (clock, memory)
    gpus: int
    tp: int
    pp: int
    batch: int  # sequences per step, global
    figure: float  # as published, in ``unit``
    unit: Unit
    convention: Convention
    request: dict[str, Any] = field(default_factory=dict)  # PlanRequest fields the run had in every variant
    as_run: dict[str, Any] = field(default_factory=dict)  # what it ran with beyond ``request`` (recompute...)
    peak_gib: float | None = None  # the published peak memory per GPU
    assumed: str = ""  # what the source does not publish and the row assumes ("" : nothing)
    cp: int = 1  # context-parallel ranks each sequence is split over
    dtype: str = "bf16"  # the planner's --dtype for it ("fp8": torchao's float8 linear layers)
    bf16_figure: float | None = None  # an fp8 row: the same run's published bf16 figure (in ``unit``), if any

    @property
    def dp(self) -> int:
        """Data-parallel replicas."""
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def degrees(self) -> str:
        """The layout as the page's column shows it: "t x p x d", with "x cp c" where there is one."""
        return f"{self.tp} x {self.pp} x {self.dp}" + (f" x cp {self.cp}" if self.cp > 1 else "")

    @property
    def tokens(self) -> int:
        """Tokens per step."""
        return self.batch * self.shape.seq


def source_flops(row: Published) -> float | None:
    """The FLOPs per step the source's convention counts (None: a tokens/s figure)."""
    formula = FORMULAS.get(row.convention)
    return formula(row.batch, row.shape) if formula is not None else None


def published_step_s(row: Published, peak_flops: float) -> float:
    """The step time the published figure implies in its own convention.

    Args:
        row: the run.
        peak_flops: one GPU's datasheet peak (bf16 dense), for an MFU figure.

    Returns:
        Seconds per step.
    """
    if row.unit == "tokens/s":
        return row.tokens / (row.figure * row.gpus)
    flops = source_flops(row)
    assert flops is not None, row.key
    per_gpu = row.figure * 1e12 if row.unit == "TFLOP/s" else row.figure / 100 * peak_flops
    return flops / (per_gpu * row.gpus)


def figure_at(row: Published, step_s: float, peak_flops: float) -> float:
    """The row's figure, in its source's unit and convention, for a step of ``step_s`` seconds.

    Args:
        row: the run.
        step_s: a step time (predicted).
        peak_flops: one GPU's datasheet peak, for an MFU figure.

    Returns:
        The figure (TFLOP/s per GPU, MFU in per cent or tokens/s per GPU).
    """
    if row.unit == "tokens/s":
        return row.tokens / (step_s * row.gpus)
    flops = source_flops(row)
    assert flops is not None, row.key
    per_gpu = flops / (step_s * row.gpus)
    return per_gpu / 1e12 if row.unit == "TFLOP/s" else 100 * per_gpu / peak_flops


def _gpt(h: int, heads: int, layers: int, vocab: int = 51200) -> dict[str, Any]:
    """models/llama.py as Megatron's GPT: multi-head attention, a SwiGLU of 8h/3 rounded up to a
    multiple of 128 (GPT's 8 h^2 feed-forward parameters and FLOPs within 1.2 %, divisible by every
    tensor-parallel degree); RMSNorm and rotary embeddings for LayerNorm and learned positions change
    neither."""
    return dict(
        dim=h,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=heads,
        vocab_size=vocab,
        seq_len=2048,
        ffn_dim_multiplier=1.0,
        multiple_of=128,
        rope_theta=10000.0,
    )


def _gpt_shape(h: int, heads: int, layers: int, vocab: int = 51200) -> Shape:
    return Shape(layers, h, heads, heads, 4 * h, vocab, 2048, gated=False)


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

# Llama 3 paper, Table 3: the models' shapes (FFN width, vocabulary 128,256; 8 KV heads)
LLAMA_8B = Shape(32, 4096, 32, 8, 14336, 128256, 8192)
LLAMA_70B = Shape(80, 8192, 64, 8, 28672, 128256, 8192)
LLAMA_405B = Shape(126, 16384, 128, 8, 53248, 128256, 8192)
LONG = 131072  # the Llama 3 long-context stage's sequence (Table 4: TP 8 x CP 16 x PP 16 x DP 8)

H100_SXM = "H100 SXM 80 GB HBM3 at up to 700 W (Llama 3 paper 3.3.1): the shipped `h100`, its datasheet"
GRAND_TETON = (
    "Grand Teton H100 SXM, 96 GB HBM2e at 2.4 TB/s, 500 W power limit: the shipped `h100-hbm2e` at the SXM "
    "datasheet's 989.5 bf16 TFLOP/s; the clock at 500 W is not published (torchtitan: its peak is "
    '"between SXM and NVL") and not modelled'
)
A100 = "A100 SXM 80 GB: the shipped `a100-80g`, its datasheet (312 bf16 TFLOP/s, 200 Gb/s HDR per GPU)"

SP = {"sequence_parallel": True}
# The loss on the output head's split logits (``--loss-parallel``), where the code that ran does so with
# tensor parallelism: Megatron-LM since its first paper (Shoeybi et al. 2019, section 3: the parallel
# GEMM's output fused with the cross-entropy, "communicating scalar losses instead of logits"), and
# torchtitan by default (enable_loss_parallel at 3faaa1a, disable_loss_parallel off at 9dec370).
LOSS = {"loss_parallel": True}


def published_runs() -> list[Published]:
    """Every published row the page compares with, in the page's order."""
    return [
        *_llama3(),
        *_megatron(),
        *_torchtitan(),
        *_torchtitan_fp8(),
        *_torchtitan_cp(),
        *_torchtitan_docs(),
        *_opt_and_megascale(),
    ]


def _llama3() -> list[Published]:
    return [
        Published(
            f"llama3-{n // 1024}k",
            "Llama 3 paper, Table 4 (arXiv 2407.21783)",
            "Llama 3 405B",
            "405b",
            {},
            LLAMA_405B,
            "h100",
            H100_SXM,
            n,
            8,
            16,
            2048,
            tf,
            "TFLOP/s",
            "palm",
            request=SP | {"dp_mode": "fsdp"},
            # section 3.3.2: an interleaved schedule, "without activation checkpointing"
            as_run={"schedule": "interleaved-1f1b", "recompute": "never"},
            assumed="FLOP formula (PaLM's)",
        )
        for n, tf in ((8192, 430.0), (16384, 400.0))
    ] + [
        Published(
            "llama3-long",
            "Llama 3 paper, Table 4 (arXiv 2407.21783): the long-context stage",
            "Llama 3 405B, 131,072 tokens",
            "405b",
            {"seq_len": LONG},
            replace(LLAMA_405B, seq=LONG),
            "h100",
            H100_SXM,
            16384,
            8,
            16,
            128,  # 16 M tokens a batch
            380.0,
            "TFLOP/s",
            "palm",
            # "all-gather based context parallelism" (section 3.3.2)
            request={"dp_mode": "fsdp", "cp_attention": "all-gather"},
            as_run={"schedule": "interleaved-1f1b", "recompute": "never"},
            assumed=(
                "FLOP formula (PaLM's); no recomputation and the interleaved schedule, as section 3.3.2 gives "
                "for pre-training; sequence parallelism searched (the paper does not say)"
            ),
            cp=16,
        )
    ]


def _megatron() -> list[Published]:
    rows = []
    for label, heads, h, layers, t, p, n, batch, tf in MEGATRON:
        rows.append(
            Published(
                f"megatron-{label}",
                "Megatron-LM paper, Table 1 (arXiv 2104.04473)",
                f"GPT {label}",
                None,
                _gpt(h, heads, layers),
                _gpt_shape(h, heads, layers),
                "a100-80g",
                A100,
                n,
                t,
                p,
                batch,
                tf,
                "TFLOP/s",
                "megatron96",
                # attention as that code ran it: two GEMMs around its fused softmax (FlashAttention is of 2022)
                request={"sequence_parallel": False, "attention_kernel": "unfused"} | (LOSS if t > 1 else {}),
                # the paper's interleaved schedule (section 2.2.2) where there is a pipeline; the zero-bubble
                # schedules the planner also knows are of 2023
                as_run={"recompute": "full", "dp_mode": "ddp"} | ({"schedule": "interleaved-1f1b"} if p > 1 else {}),
                assumed="schedule (interleaved 1F1B: Table 1 does not name it)" if p > 1 else "",
            )
        )
    return rows


# torchtitan's float8 settings as of its December 2024 benchmarks (not named on the page): tensorwise
# scaling, the only recipe its float8 converter had then, with FSDP gathering the float8 weights in float8
FLOAT8_ASSUMED = "tensorwise scaling with FSDP's float8 all-gather (torchtitan's float8 settings of Dec 2024)"


# torchtitan's Llama (torchtitan/models/llama/model.py at 9dec370 and 3faaa1a) rotates q and k as complex
# numbers and copies k and v to every query head (repeat_kv) before SDPA: models/llama.py's reference
# attention code, which costs those kernels (and context parallelism's gather of the repeated k and v)
TITAN_CODE: dict[str, Any] = {"attention_code": "reference"}


def _torchtitan() -> list[Published]:
    rows = []
    titan = {"dp_mode": "fsdp", "attention_kernel": "flash"}  # FlashAttention-2: torch's SDPA on H100 in Dec 2024
    bench = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
    for table, n, figures in (
        ("Table 1", 8, ((5762.0, 82.4), (6667.0, 77.0), (8532.0, 76.8))),
        ("Table 3", 128, ((5605.0, 67.0), (6514.0, 62.0), (8380.0, 61.8))),
    ):
        # FSDP; + torch.compile; + torch.compile + Float8 (--dtype fp8, beside the compiled bf16 figure)
        for (suffix, what), (tps, peak) in zip(
            (("", ""), ("-compiled", ", compiled"), ("-fp8", ", compiled, Float8")), figures
        ):
            fp8 = suffix == "-fp8"
            rows.append(
                Published(
                    f"titan-8b-{n}{suffix}",
                    f"{bench}, {table}",
                    "Llama 3.1 8B" + what,
                    "8b",
                    TITAN_CODE,
                    LLAMA_8B,
                    "h100-hbm2e",
                    GRAND_TETON,
                    n,
                    1,
                    1,
                    2 * n,
                    tps,
                    "tokens/s",
                    "tokens",
                    request=titan | ({"compile": True} if suffix else {}),
                    as_run={"recompute": "selective"},
                    peak_gib=peak,
                    assumed=FLOAT8_ASSUMED if fp8 else "",
                    dtype="fp8" if fp8 else "bf16",
                    bf16_figure=figures[1][0] if fp8 else None,
                )
            )
    return rows


TITAN_PIPELINE = {"1f1b": {"microbatches": 8}, "interleaved-1f1b": {"microbatches": 8, "stages_per_rank": 2}}
"""What torchtitan's pipeline ran with where its benchmark names no microbatch count or split: its
defaults at the benchmark's commit (9dec370, ``torchtitan/parallelisms/pipelining_utils.py``):
``pipeline_parallel_microbatches`` unset is the pipeline degree (8), and a looped schedule without
split points gets 2 stages per rank (``generate_split_points``)."""
TITAN_PIPELINE_ASSUMED = (
    "8 microbatches (and 2 stages per rank interleaved): torchtitan's defaults at the benchmark's commit "
    "9dec370, the pipeline degree and generate_split_points' 2 stages per looped rank"
)


def _torchtitan_fp8() -> list[Published]:
    """torchtitan's Float8 rows of 70B and 405B (benchmarks/llama3_h100_202412_torchtitan.md, Tables 4 and
    5; its 8B ones are ``_torchtitan``'s), all compiled: the planner's ``--dtype fp8`` (torchao's float8
    linear layers) with ``--compile``."""
    bench = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
    titan = {"dp_mode": "fsdp", "attention_kernel": "flash", "compile": True} | LOSS
    rows = []
    # torchtitan's tensor parallelism shards the norms along the sequence, which the planner runs eagerly
    # only: the compiled rows are planned without it
    no_sp = "; sequence parallelism not planned (the planner's runs eagerly only, these rows compile)"
    rows.append(
        Published(
            "titan-70b-256-fp8",
            f"{bench}, Table 4",
            "Llama 3.1 70B, compiled, Float8",
            "70b",
            TITAN_CODE,
            LLAMA_70B,
            "h100-hbm2e",
            GRAND_TETON,
            256,
            8,
            1,
            512,
            829.0,
            "tokens/s",
            "tokens",
            request=titan,
            as_run={"recompute": "full"},
            peak_gib=71.9,
            assumed=FLOAT8_ASSUMED + no_sp,
            dtype="fp8",
        )
    )
    for schedule, tps, peak in (("1f1b", 100.0, 82.5), ("interleaved-1f1b", 128.0, 72.7)):
        rows.append(
            Published(
                f"titan-405b-512-fp8-{schedule.split('-')[0]}",
                f"{bench}, Table 5",
                f"Llama 3.1 405B, compiled, Float8, {schedule}",
                "405b",
                TITAN_CODE,
                LLAMA_405B,
                "h100-hbm2e",
                GRAND_TETON,
                512,
                8,
                8,
                256,
                tps,
                "tokens/s",
                "tokens",
                request=titan,
                as_run={"recompute": "full", "schedule": schedule} | TITAN_PIPELINE[schedule],
                peak_gib=peak,
                assumed=FLOAT8_ASSUMED + no_sp + "; its asynchronous TP not modelled; " + TITAN_PIPELINE_ASSUMED,
                dtype="fp8",
            )
        )
    return rows


def _torchtitan_cp() -> list[Published]:
    """torchtitan's context-parallel rows (benchmarks/llama3_h100_202412_torchtitan.md, Tables 2 and 6):
    FSDP x CP on 8 GPUs (8B) and FSDP x CP x TP 8 x PP 8 on 512 (405B), the sequence doubling as CP does,
    compiled, Float8, full recomputation; a local batch of 1 (8B) and 8 (405B) sequences per FSDP rank
    (the CP ranks of one share it). torch's ``context_parallel`` of the time all-gathered the keys and
    values (torchtitan's ``context_parallel_rotate_method`` default)."""
    bench = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
    titan = {"dp_mode": "fsdp", "attention_kernel": "flash", "compile": True, "cp_attention": "all-gather"}
    assumed = FLOAT8_ASSUMED + "; torch's context_parallel all-gathering the keys and values (its default then)"
    rows = []
    for table, size, shape, gpus, tp, pp, local, figures in (
        ("Table 2", "8b", LLAMA_8B, 8, 1, 1, 1, ((3890.0, 83.9), (2540.0, 84.2), (1071.0, 84.0), (548.0, 84.5))),
        ("Table 6", "405b", LLAMA_405B, 512, 8, 8, 8, ((76.0, 75.3), (47.0, 75.9), (31.0, 77.1), (16.0, 84.9))),
    ):
        for k, (tps, peak) in enumerate(figures):
            cp, seq = 2**k, 32768 * 2**k
            fsdp = gpus // (tp * pp * cp)
            extra = (
                ""
                if tp == 1
                else "; sequence parallelism not planned (the planner's runs eagerly only, these rows compile); "
                "its asynchronous TP not modelled"
                + ("; its loss parallelism not planned (the planner's runs without cp only)" if cp > 1 else "")
            )
            rows.append(
                Published(
                    f"titan-{size}-{gpus}-cp{cp}",
                    f"{bench}, {table}",
                    f"Llama 3.1 {size.upper()}, {seq // 1024}k tokens, compiled, Float8" + (", 1f1b" if pp > 1 else ""),
                    size,
                    TITAN_CODE | {"seq_len": seq},
                    replace(shape, seq=seq),
                    "h100-hbm2e",
                    GRAND_TETON,
                    gpus,
                    tp,
                    pp,
                    local * fsdp,
                    tps,
                    "tokens/s",
                    "tokens",
                    # torchtitan's loss parallelism: not with context parallelism in the planner's runner yet
                    request=titan | (LOSS if tp > 1 and cp == 1 else {}),
                    as_run={"recompute": "full"} | ({"schedule": "1f1b"} | TITAN_PIPELINE["1f1b"] if pp > 1 else {}),
                    peak_gib=peak,
                    assumed=assumed + extra + (f"; {TITAN_PIPELINE_ASSUMED}" if pp > 1 else ""),
                    cp=cp,
                    dtype="fp8",
                )
            )
    return rows


def _torchtitan_docs() -> list[Published]:
    rows = []
    perf = "torchtitan docs/performance.md (3faaa1a)"
    rows.append(
        Published(
            "titan-405b-128",
            f"{perf}, Llama 3.1 performance",
            "Llama 3.1 405B",
            "405b",
            TITAN_CODE,
            LLAMA_405B,
            "h100-hbm2e",
            GRAND_TETON,
            128,
            8,
            1,
            32,
            109.0,
            "tokens/s",
            "tokens",
            # torchtitan's tensor parallelism shards the norms along the sequence (``SequenceParallel``), which
            # the planner runs eagerly only: planned eager, with it (the row names no optimisation)
            request=SP | LOSS | {"dp_mode": "fsdp", "attention_kernel": "flash"},
            as_run={"recompute": "full"},
            assumed="eager (the row names no optimisation; the preset of its commit compiles)",
        )
    )
    for model, size, shape, recompute, tps in (
        ("Llama 3 8B", "8b", LLAMA_8B, "selective", 2973.0),
        ("Llama 3 70B", "70b", LLAMA_70B, "full", 331.0),
    ):
        rows.append(
            Published(
                f"titan-a100-{size}",
                f"{perf}, Llama 3 performance",
                model,
                size,
                TITAN_CODE,
                shape,
                "a100-80g",
                A100 + "; the network is not published",
                64,
                1,
                1,
                64,
                tps,
                "tokens/s",
                "tokens",
                request={"dp_mode": "fsdp"},
                as_run={"recompute": recompute},
            )
        )
    return rows


def _opt_and_megascale() -> list[Published]:
    rows = []
    rows.append(
        Published(
            "opt-175b",
            "OPT paper, section 2.4 and Table 1 (arXiv 2205.01068)",
            "OPT-175B",
            None,
            _gpt(12288, 96, 96, vocab=50272),
            _gpt_shape(12288, 96, 96, vocab=50272),
            "a100-80g",
            A100,
            992,
            8,
            1,
            992,
            147.0,
            "TFLOP/s",
            "megatron72",
            # trained Oct 2021 - Jan 2022 with Megatron's fused softmax between two GEMMs, before FlashAttention
            # (metaseq carries Megatron's kernels: metaseq/modules/megatron/fused_kernels, model/fused_softmax.py)
            # metaseq's loss on the split logits: its vocab_parallel_cross_entropy criterion
            request={"dp_mode": "fsdp", "sequence_parallel": False, "attention_kernel": "unfused"} | LOSS,
            as_run={"recompute": "full"},
            assumed="TP 8, batch 992 sequences, full recomputation, FLOP formula (Megatron's model FLOPs), "
            "the loss on the split logits (metaseq's vocab_parallel_cross_entropy)",
        )
    )
    rows.append(
        Published(
            "megascale-175b",
            "MegaScale, abstract and Table 2 (arXiv 2402.15627)",
            "175B (GPT-3 shape)",
            None,
            _gpt(12288, 96, 96),
            _gpt_shape(12288, 96, 96),
            "a100-80g",
            "NVIDIA Ampere GPUs (variant not read here): the shipped `a100-80g`, its datasheet",
            12288,
            8,
            8,
            6144,
            55.2,
            "MFU %",
            "megatron72",
            request=SP | LOSS,
            as_run={"schedule": "interleaved-1f1b"},
            assumed=(
                "model shape (GPT-3's), TP 8 x PP 8 x DP 192, A100 80GB, FLOP formula (Megatron's model FLOPs); "
                "its ZeRO-2 not modelled (the DP mode is the planner's)"
            ),
        )
    )
    # the same run on Megatron-LM (the abstract's 1.34x), the code the planner models: a sequential block,
    # full attention, the tensor-parallel collectives on the critical path
    megatron = f"; Megatron-LM's MFU from the abstract's 55.2 % and {MEGASCALE_GAIN}x (Table 2's not read here)"
    source = "MegaScale, abstract (arXiv 2402.15627): Megatron-LM on the same run"
    key, model, figure = "megascale-175b-megatron", "175B (GPT-3 shape), Megatron-LM", round(55.2 / MEGASCALE_GAIN, 1)
    return [
        *rows,
        replace(rows[-1], key=key, source=source, model=model, figure=figure, assumed=rows[-1].assumed + megatron),
    ]


# Published runs the page lists without comparing: what the planner cannot model, or figures not here.
NOT_COMPARED: list[tuple[str, str, str, str]] = [
    (
        "Fernandez et al. 2024, FSDP against TP / PP on up to 2,048 H100",
        "arXiv 2411.13055",
        "figures not available here",
        "its tables and figures could not be read in this session (no network; the stored copy gives only "
        "the abstract: FSDP without model parallelism stops paying at scale)",
    ),
]
