"""The records a plan is made of: which model (``ModelRef``), how its costs were had
(``ProfileInfo``), each stage (``StagePlan``), the prediction (``Prediction``), the search's rows
(``Candidate``) and tied parameters (``Tie``); ``planner.schema.plan.Plan`` holds them.

Pure module: pydantic only, never torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from planner.schema.costs import split_recompute
from planner.schema.names import CpAttention, DpMode, FsdpUnits, Schedule


def _mode(value: Any) -> Any:
    """A stage's recompute mode; plans written before checkpointing block by block stored a flag
    (True: the stage recomputed as one region, "stage")."""
    if isinstance(value, bool):
        return "stage" if value else "never"
    return value


def _checked_mode(value: str) -> str:
    split_recompute(value)  # ValueError for what is no mode: pydantic reports it on the field
    return value


StageRecompute = Annotated[str, BeforeValidator(_mode), AfterValidator(_checked_mode)]
"""A stage's recompute value: a ``RecomputeMode``, or "full:k" / "selective:k" (its first k
checkpoint regions recompute, ``split_recompute``)."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelRef(_Frozen):
    """Which model the plan is for, and how it was captured."""

    path: str = Field(description="Model file, absolute or relative to the plan file's folder.")
    size: str | None = Field(description="SIZES entry, or None for the file's defaults.")
    config: dict[str, Any] = Field(description="Config passed to build_model/make_batch (size + --set overrides).")
    file_digest: str = Field(description="SHA-256 prefix of the model file's text when planned.")
    part_digests: dict[str, str] = Field(
        default_factory=dict,
        description="SHA-256 prefix of each contract function's source (and of SIZES), to name what changed.",
    )
    fingerprint: str = Field(description="Hash of the traced structure: blocks, graph nodes, parameter shapes.")
    trace_method: Literal["fx", "export", "modules"]
    trace_failures: list[tuple[str, str]] = Field(
        default_factory=list, description="Tracers tried first, and why they failed."
    )
    # as --seed: torch.manual_seed takes a 64-bit seed, and the run adds the step number to it
    seed: int = Field(default=0, ge=0, le=2**63 - 1, description="Seed for the weights and the example batch.")
    batch_norms: list[str] = Field(
        default_factory=list,
        description="Modules that normalize by the statistics of the batch they are given (batch norm): each "
        "microbatch and each replica's share is normalized on its own (planner.capture.contract.batch_norms).",
    )
    expert_calls: bool = Field(
        default=False,
        description="The trace recorded where the graph calls each experts module (planner.capture.expert_calls), "
        "as expert parallelism needs: a run traces so too (under torch.export it names some nodes otherwise, "
        "which the fingerprint sees).",
    )


@dataclass(frozen=True)
class LinearLayer:
    """One linear layer of a traced model, as the float8 filters read it.

    Attributes:
        name: its module's qualified name in the model (``layers.0.attention.wq``).
        in_features: the width it reads (K of its forward GEMM).
        out_features: the width it writes (N).
        in_layer: it is inside one of the model's repeated layers (a block that is a layer).
        router: its output picks experts (a top-k reads it).
    """

    name: str
    in_features: int
    out_features: int
    in_layer: bool
    router: bool = False


class Float8Linears(_Frozen):
    """A plan's FP8 training (``--dtype fp8|fp8-rowwise``): torchao's float8 linear layers."""

    recipe: Literal["tensorwise", "rowwise"] = Field(description="torchao's scaling recipe.")
    converted: int = Field(ge=0, description="Linear layers whose GEMMs run in float8.")
    kept: dict[str, str] = Field(
        default_factory=dict,
        description="Linear layers that stay in bf16 -> why (planner.core.levers.float8.kept_reason); the runner "
        "converts every other nn.Linear the trace calls.",
    )
    bf16_step_s: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        description="The plan's layout and split predicted with every layer in bf16 (an estimate's: does FP8 pay "
        "here); None: not estimated, or the layout cannot run in bf16.",
    )

    @property
    def layers(self) -> int:
        """Every linear layer the trace calls: those converted and those kept in bf16."""
        return self.converted + len(self.kept)


class ProfileInfo(_Frozen):
    """Where and how the costs were measured."""

    device: str
    backend: Literal["gloo", "nccl"]
    threads: int = Field(ge=1, description="Intra-op threads per rank while profiling (as in the run).")
    torch_version: str
    hostname: str
    warmup: int
    repeats: int
    source: Literal["measured", "estimated"] = Field(
        default="measured", description="Costs measured on this machine, or estimated by the roofline model."
    )
    hardware: str | None = Field(
        default=None, description="Hardware the estimate is for (--gpu-type), None when measured."
    )
    attention_kernel: str | None = Field(
        default=None,
        description="The scaled_dot_product_attention backend a GPU estimate costs (--attention-kernel, or the "
        "GPU's default); None when measured or estimated for a CPU.",
    )
    dtype: str = Field(
        default="fp32",
        description="Parameter dtype the costs are for; estimates (--gpu-type --dtype) also cost activations in it. "
        "Measured plans keep the model's fp32 here, also under autocast.",
    )
    autocast: Literal["bf16", "fp16"] | None = Field(
        default=None,
        description="Measured under torch.autocast in this dtype (--dtype bf16|fp16 without --gpu-type): parameters, "
        "gradients and optimizer state in dtype (autocast's master weights), activations and the bytes crossing a cut "
        "as autocast made them. The runner runs each stage's forward (and the last stage's loss) under "
        "torch.autocast(device.type, dtype=...). None: no autocast (estimates never set it).",
    )
    float8: Float8Linears | None = Field(
        default=None,
        description="--dtype fp8: the linear layers trained in float8 (torchao), over the bf16 of dtype/autocast; "
        "None: no float8.",
    )
    compile_failures: list[tuple[str, str]] = Field(
        default_factory=list,
        description="(block, why) for each block torch.compile failed on while profiling (--compile): "
        "it was profiled eagerly.",
    )
    compile_s: float | None = Field(
        default=None,
        ge=0,
        allow_inf_nan=False,
        description="Seconds compiling took while profiling (the untimed first runs beyond ordinary runs); "
        "None: the blocks were not compiled.",
    )
    cores: int | None = Field(
        default=None, description="CPU cores the ranks share (CPU plans); None when every rank has its own GPU."
    )
    fixed_fraction: float = Field(
        default=0.0,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="Share of a microbatch's time that does not shrink with its size (fitted at two sizes; "
        "scales the costs to other microbatch counts).",
    )
    min_microbatch_size: int = Field(
        default=1, ge=1, description="Smallest microbatch the model ran when profiled (the search stays at or above)."
    )
    tokens_per_sample: int | None = Field(
        default=None,
        ge=1,
        description="Tokens in one sample (the sequence length of token-id inputs), for tokens/s; None: not a token model.",
    )
    microbatch_size: int | None = Field(
        default=None,
        ge=1,
        description="Samples per microbatch the costs were profiled or estimated at (the plan's blocks are "
        "rescaled from it to the plan's microbatch); None: the plan's own.",
    )

    @property
    def run_autocast(self) -> Literal["bf16", "fp16"] | None:
        """The autocast dtype the run trains in: ``autocast`` for measured costs; for an estimate in bf16 or
        fp16 (``--gpu-type``), that dtype, since the estimate costs compute and activations in it and
        autocast over fp32 weights is how the run computes in it (the same 16 bytes per parameter of
        weights, gradients and AdamW state as the estimate's bf16 weights with fp32 master copies)."""
        if self.autocast is not None:
            return self.autocast
        if self.source == "estimated" and self.dtype in ("bf16", "fp16"):
            return "bf16" if self.dtype == "bf16" else "fp16"
        return None


class StagePlan(_Frozen):
    """One pipeline stage: a contiguous range of blocks on one rank, and what it is predicted to cost."""

    index: int = Field(ge=0)
    rank: int = Field(
        ge=0,
        description="The pipeline rank that runs this stage (several stages per rank: looped or V); in every "
        "replica (global rank = replica x n_ranks + rank).",
    )
    start: int = Field(ge=0, description="First block index.")
    end: int = Field(ge=1, description="One past the last block index.")
    first_block: str = Field(description="FQN of the first block.")
    last_block: str = Field(description="FQN of the last block.")
    split_node: str | None = Field(description="Graph node after which this stage ends (None for the last stage).")
    params: int = Field(ge=0)
    fwd_s: float = Field(ge=0, allow_inf_nan=False, description="Forward compute per microbatch.")
    bwd_s: float = Field(ge=0, allow_inf_nan=False, description="Backward compute per microbatch.")
    comm_s: float = Field(
        ge=0, allow_inf_nan=False, description="Send/receive time per microbatch (forward + backward)."
    )
    time_s: float = Field(ge=0, allow_inf_nan=False, description="fwd + bwd + comm per microbatch.")
    opt_s: float = Field(
        default=0.0,
        ge=0,
        allow_inf_nan=False,
        description="Optimizer step over the stage's parameters (its 1/dp shard under FSDP), once per training step.",
    )
    grad_s: float = Field(
        default=0.0,
        ge=0,
        allow_inf_nan=False,
        description="Per training step, before the optimizer: averaging the stage's accumulated gradients over the "
        "microbatches, their clipping norm and the clipping scale (a 1/dp shard under FSDP).",
    )
    recompute: StageRecompute = Field(
        default="never",
        description="How the stage checkpoints its activations: never; block by block, selective (each block keeps "
        "its matmul and attention outputs) or full (each block keeps its input); selective:K or full:K (only the "
        "stage's first K blocks so, the rest keep their activations); or stage (the whole stage as one region, "
        "keeping its input); recomputed in backward.",
    )
    activation_bytes: int = Field(ge=0, description="Saved activations per microbatch, without recomputation.")
    kept_bytes: int | None = Field(
        default=None,
        ge=0,
        description="Saved activations per microbatch under the stage's recompute mode: what its checkpoint regions "
        "keep (their inputs, or selectively also their matmul and attention outputs) and the other blocks' saved "
        "activations (activation_bytes when it does not recompute). None: a plan written before this field.",
    )
    in_flight: int = Field(ge=1, description="Peak microbatches holding activations under the schedule.")
    memory_bytes: int = Field(
        ge=0, description="Predicted peak: params, grads, optimizer state, in-flight activations, buffers."
    )
    bwd_input_s: float | None = Field(
        default=None, ge=0, allow_inf_nan=False, description="Input-gradient part of bwd_s (two-part backward)."
    )
    bwd_weight_s: float | None = Field(
        default=None, ge=0, allow_inf_nan=False, description="Weight-gradient part of bwd_s (two-part backward)."
    )
    comm_hidden_s: float | None = Field(
        default=None,
        ge=0,
        allow_inf_nan=False,
        description="Per training step: seconds of the stage's data-parallel collectives (FSDP's gathers and "
        "reduce-scatters, DDP's or HSDP's all-reduces) that run beside its compute, hidden "
        "(planner.core.levers.overlap; the compute beside them is charged its slowdown). None: a plan written "
        "before this field.",
    )
    comm_exposed_s: float | None = Field(
        default=None,
        ge=0,
        allow_inf_nan=False,
        description="Per training step: seconds of the stage's communication its rank waits for: its pipeline "
        "messages (comm_s, every microbatch of every pass) and the data-parallel collectives its compute does not "
        "hide. None: a plan written before this field.",
    )


class Prediction(_Frozen):
    """Predicted figures for one partition under the plan's schedule."""

    starts: tuple[int, ...]
    recompute: tuple[StageRecompute, ...] = Field(
        default=(), description="Per stage: its recompute mode (empty: no stage recomputes)."
    )
    stage_time_s: tuple[float, ...]
    bottleneck_s: float = Field(ge=0, allow_inf_nan=False)
    pipeline_time_s: float = Field(
        ge=0,
        allow_inf_nan=False,
        description="Makespan of the schedule's forward/backward actions, over every pass of the step "
        "(accumulation x one pass's).",
    )
    step_time_s: float = Field(
        ge=0,
        allow_inf_nan=False,
        description="Pipeline makespan (every pass) plus the data-parallel gradient reduction (dp_reduce_s), the "
        "gradient-norm all-reduce and the optimizer step.",
    )
    bubble_fraction: float = Field(ge=0, le=1, description="Idle share of one pass's pipeline (the same every pass).")
    imbalance: float = Field(
        ge=0, allow_inf_nan=False, description="Slowest stage time / mean stage time (1.0 = perfectly balanced)."
    )
    max_memory_bytes: int = Field(ge=0, description="The most any rank needs.")
    rank_memory_bytes: tuple[int, ...] = Field(default=(), description="Predicted peak per rank (empty: per stage).")
    dp_reduce_s: float = Field(
        default=0.0,
        ge=0,
        allow_inf_nan=False,
        description="What the gradient reduction over the data-parallel replicas adds to the step (DDP's "
        "all-reduce, the slowest rank's: after the pipeline, or on GPUs where torch's DDP reduces in buckets during "
        "the last backward, its exposed tail and the slowdown of the compute beside it (docs/overlap.md); FSDP's all-gather + reduce-scatter: with stage units on "
        "devices, each stage's placed where torch runs it, inside every pass, and this is how much longer the "
        "passes take); included in step_time_s (0: one replica).",
    )


class Candidate(_Frozen):
    """One point of the joint search: a schedule, microbatch count and stages per rank with its best split."""

    schedule: Schedule
    n_microbatches: int = Field(ge=1)
    stages_per_rank: int = Field(ge=1)
    dp: int = Field(default=1, ge=1, description="Data-parallel replicas of the pipeline.")
    dp_mode: DpMode = Field(default="ddp", description="How the replicas reduce gradients (ddp, fsdp or hsdp).")
    dp_shard: int | None = Field(default=None, ge=2, description="Under hsdp, the replicas of each shard group.")
    fsdp_units: FsdpUnits = Field(
        default="stage", description="Under fsdp or hsdp, what is gathered at a time (stage or block)."
    )
    tp: int = Field(default=1, ge=1, description="Tensor-parallel ranks each stage is split over.")
    ep: int = Field(default=1, ge=1, description="Expert-parallel ranks each MoE layer's experts are sharded over.")
    sequence_parallel: bool = Field(default=False, description="With tp > 1, sequence parallelism (Plan's field).")
    cp: int = Field(default=1, ge=1, description="Context-parallel ranks each sequence is split over (Plan's field).")
    cp_attention: CpAttention = Field(
        default="all-gather", description="With cp > 1, how attention reaches the other chunks (Plan's field)."
    )
    accumulation: int = Field(
        default=1, ge=1, description="Pipeline passes per step, each of n_microbatches (gradient accumulation)."
    )
    starts: tuple[int, ...]
    step_time_s: float = Field(ge=0, allow_inf_nan=False)
    bubble_fraction: float = Field(ge=0, le=1)
    max_memory_bytes: int = Field(ge=0)
    fits: bool = Field(description="The most any rank needs is within the memory limit.")
    slow_step_time_s: float | None = Field(
        default=None,
        ge=0,
        allow_inf_nan=False,
        description="The same layout and split re-predicted with every collective and send 1.3x slower and compute "
        "1.1x slower (planner.core.layout.robust); None: not re-priced (it does not fit, or an older plan).",
    )


class Tie(_Frozen):
    """A parameter several blocks read (a tied input embedding and output head, say).

    Every stage holding one of those blocks holds a copy: the first reader owns the parameter, and
    each later reader's ``BlockCost`` counts a copy (``tied_params``), so the stage's memory does. The runner sums the copies' gradients across
    their ranks before clipping and the optimizer step, so the copies stay identical, as Megatron's
    embedding group and DeepSpeed's ``TiedLayerSpec`` do.
    """

    names: tuple[str, ...] = Field(min_length=1, description="Every name the model gives the parameter.")
    blocks: tuple[str, ...] = Field(min_length=2, description="The blocks that read it; the first owns it.")
    params: int = Field(ge=0, description="Elements of the parameter.")
    param_bytes: int = Field(ge=0, description="Bytes of one copy in the planning dtype.")


__all__ = ["Candidate", "ModelRef", "Prediction", "ProfileInfo", "StagePlan", "StageRecompute", "Tie"]
