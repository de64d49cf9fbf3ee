"""Per-block costs: the plain numbers every later step (solve, simulate, plan, report) works on.

Pure module: pydantic only, never torch. Profiling (``planner.costs.measure``) fills these in; the
solver and simulator read them. They round-trip through JSON as part of ``plan.json``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

from planner.schema.shares import ExpertShare, TensorParallelShare  # parts of BlockCost

OptimizerName = Literal["adamw", "sgd"]
OPTIMIZERS: tuple[str, ...] = get_args(OptimizerName)
StepTempRule = Literal["max", "sum"]
RecomputeMode = Literal["never", "selective", "full", "stage"]
"""How a stage checkpoints its activations (``planner.core.split.stage_model``): not at all; block by block,
selectively (each block keeps its matmul and attention outputs and recomputes the rest in backward,
torch's selective activation checkpointing) or fully (each block keeps only its input); or the whole
stage as one region (it keeps only the stage's input, and backward rebuilds all of it at once: the
least kept per microbatch, the most rebuilt at a time)."""
RECOMPUTE_MODES: tuple[str, ...] = get_args(RecomputeMode)
PARTIAL_MODES: tuple[str, ...] = ("selective", "full")
"""The modes a stage may apply to only some of its blocks (``split_recompute``)."""


@functools.lru_cache(maxsize=1024)  # the search validates every stage's value of every layout it predicts
def split_recompute(value: str) -> tuple[RecomputeMode, int | None]:
    """A stage's recompute value as (mode, how many of its checkpoint regions recompute).

    A stage may recompute only its first ``k`` checkpoint regions (one per block, except that a
    block whose end is no legal cut shares its region with the next), the rest keeping their
    activations, as Megatron-LM's ``--recompute-method block --recompute-num-layers k`` does: the
    value is then ``"full:k"`` or ``"selective:k"`` (k >= 1). A plain mode recomputes every region
    (count None).

    Args:
        value: "never", "selective", "full", "stage", or "selective:k" / "full:k".

    Returns:
        The mode and the count (None: all of the stage's regions).

    Raises:
        ValueError: no such mode, or a count that is no positive integer or follows a mode that
            recomputes all or nothing.
    """
    mode, sep, count = value.partition(":")
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute={value!r}; expected one of {', '.join(RECOMPUTE_MODES)} (or full:K, selective:K)")
    if not sep:
        return mode, None  # type: ignore[return-value]  # checked against RECOMPUTE_MODES above
    if mode not in PARTIAL_MODES or not count.isdigit() or int(count) < 1:
        raise ValueError(
            f"recompute={value!r}: only selective and full apply to some blocks, as MODE:K with K >= 1 "
            "the number of the stage's first blocks that recompute"
        )
    return mode, int(count)  # type: ignore[return-value]


class BlockCost(BaseModel):
    """What one block (a group of graph nodes, usually one module) costs per microbatch. Blocks are in
    execution (topological) order; a stage is a contiguous range of blocks."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @property
    def kept_cut_bytes(self) -> int:
        """What a checkpoint region starting after this block keeps of its input (``cut_kept_bytes``)."""
        return self.cut_bytes if self.cut_kept_bytes is None else self.cut_kept_bytes

    name: str = Field(description="Module FQN of the block, e.g. 'layers.3' or 'tok_embeddings'; unique.")
    first_node: str = Field(description="Name of the block's first graph node.")
    last_node: str = Field(description="Name of the block's last graph node.")
    fwd_s: float = Field(ge=0, allow_inf_nan=False, description="Forward time of one microbatch, seconds.")
    bwd_s: float = Field(ge=0, allow_inf_nan=False, description="Backward time of one microbatch, seconds.")
    params: int = Field(
        ge=0,
        description="Parameters the block's stage holds for it: those first used in this block, plus a copy of each "
        "tied parameter an earlier block owns (tied_params of them).",
    )
    param_bytes: int = Field(ge=0, description="Bytes of those parameters.")
    tied_params: int = Field(
        default=0, ge=0, description="Of params, the copies of tied parameters that an earlier block owns."
    )
    activation_bytes: int = Field(ge=0, description="Bytes saved for backward by one microbatch.")
    eager_activation_bytes: int | None = Field(
        default=None,
        ge=0,
        description="Compiled estimates: what the block saves run eagerly, the forward the tp "
        "share counts (planner.costs.tensor_parallel scales it to activation_bytes). None: eager or measured.",
    )
    weight_cast_bytes: int = Field(
        default=0,
        ge=0,
        description="Of activation_bytes, under autocast over fp32 weights: the lower-precision copies of the "
        "block's weights that its matmuls and convolutions save for backward, one set per microbatch. A stage that "
        "recomputes nothing, is not sharded by FSDP and holds three or more microbatches shares one set through "
        "the step instead (planner.core.levers.casts.shared_casts); a compiled stage, which casts inside its graph, "
        "never does. 0 without autocast.",
    )
    host_fwd_s: float = Field(
        default=0.0,
        ge=0,
        allow_inf_nan=False,
        description="Of fwd_s, estimated for a GPU: the host's time issuing the forward's operators one by one "
        "(eager dispatch, HardwareSpec.dispatch_s each). Splitting the block's work (tensor parallelism) leaves "
        "every rank as many operators to issue, so its forward never drops below this. 0: not estimated "
        "(measured costs, a CPU, compiled code).",
    )
    host_bwd_s: float = Field(
        default=0.0, ge=0, allow_inf_nan=False, description="The same for the backward (of bwd_s)."
    )
    bwd_input_s: float | None = Field(
        default=None,
        ge=0,
        allow_inf_nan=False,
        description="Backward w.r.t. the block's inputs only (I of F/I/W), seconds; None if not measured.",
    )
    bwd_weight_s: float | None = Field(
        default=None,
        ge=0,
        allow_inf_nan=False,
        description="Backward w.r.t. the block's weights only (W of F/I/W), seconds; None if not measured.",
    )
    recompute_s: float | None = Field(
        default=None,
        ge=0,
        allow_inf_nan=False,
        description="Extra forward the block costs in backward under activation checkpointing, seconds; None if not "
        "measured (the solver then charges the whole forward).",
    )
    selective_bytes: int | None = Field(
        default=None,
        ge=0,
        description="Of activation_bytes, what selective checkpointing keeps per microbatch (the outputs of the "
        "block's matmuls and attention); None if not measured (all of it: selective saves nothing).",
    )
    selective_recompute_s: float | None = Field(
        default=None,
        ge=0,
        allow_inf_nan=False,
        description="Extra seconds per microbatch under selective checkpointing: the forward's ops other than "
        "matmuls and attention, run again in backward, and what the policy adds to the forward; None if not "
        "measured (recompute_s, as full checkpointing).",
    )
    fwd_cold_s: float | None = Field(
        default=None,
        ge=0,
        allow_inf_nan=False,
        description="Extra forward seconds when the block starts a stage's forward after waiting for the "
        "activations it receives (the first block of every stage but the first); None if not measured (0).",
    )
    bwd_cold_s: float | None = Field(
        default=None,
        ge=0,
        allow_inf_nan=False,
        description="Extra backward seconds when the block starts a stage's backward after waiting for the "
        "gradient it receives (the last block of every stage but the last); None if not measured (0).",
    )
    flops_fwd: float | None = Field(
        default=None,
        ge=0,
        allow_inf_nan=False,
        description="Forward FLOPs per microbatch (torch.utils.flop_counter); None if not counted.",
    )
    flops_bwd: float | None = Field(
        default=None, ge=0, allow_inf_nan=False, description="Backward FLOPs per microbatch; None if not counted."
    )
    opt_s: float | None = Field(
        default=None,
        ge=0,
        allow_inf_nan=False,
        description="Optimizer step over this block's parameters, seconds (once per step, not per microbatch); None if not timed.",
    )
    opt_temp_bytes: int | None = Field(
        default=None,
        ge=0,
        description="Peak temporary bytes one optimizer step over this block's parameters allocates above the "
        "parameters, gradients and optimizer state (measured; including the copies of tied parameters its stage "
        "steps); a stage's combine by OptimizerSpec.step_temp_rule. None if not measured (the memory model then "
        "charges OptimizerSpec.step_temp_bytes).",
    )
    grad_s: float | None = Field(
        default=None,
        ge=0,
        allow_inf_nan=False,
        description="Per step, the passes over this block's gradients before the optimizer: averaging the "
        "accumulated gradients over the microbatches, the clipping norm and the clipping scale, seconds; None if "
        "not timed.",
    )
    cut_bytes: int = Field(
        ge=0, description="Bytes crossing a stage boundary placed right after this block, per microbatch, one way."
    )
    cut_tensors: int = Field(ge=0, description="Number of tensors crossing that boundary.")
    cut_kept_bytes: int | None = Field(
        default=None,
        ge=0,
        description="What a checkpoint region starting after this block (or a stage recomputed as one region) "
        "keeps of its input per microbatch: under sequence parallelism its sequence shards are 1/tp "
        "(planner.core.levers.tensor_parallel). None: cut_bytes, the whole.",
    )
    cut_share: int = Field(
        default=1,
        ge=1,
        description="Tensor-parallel ranks a boundary right after this block scatters its message over "
        "(Megatron-LM's scatter-gather; planner.run.boundary): each sends, receives and buffers "
        "ceil(cut_bytes / cut_share) bytes (sent_bytes) and all-gathers the whole from its peers over the "
        "node's link. 1: every rank sends the whole (no tensor parallelism, or an older plan).",
    )
    cut_gather_s: float = Field(
        default=0.0,
        ge=0,
        allow_inf_nan=False,
        description="Seconds of that all-gather per microbatch, one way: the receiving stage's forward gathers the "
        "activation, the sending stage's backward the gradient (0 with cut_share 1).",
    )
    output_bytes: int = Field(
        default=0,
        ge=0,
        description="Last block only: bytes of the model's output per microbatch (the last stage keeps it until backward).",
    )
    loss_s: float | None = Field(
        default=None,
        ge=0,
        allow_inf_nan=False,
        description="Last block only: the loss's forward per microbatch, seconds, included in fwd_s (its backward "
        "is in bwd_s), as a pipeline's last stage computes it; None if not measured apart.",
    )
    loss_bytes: int | None = Field(
        default=None,
        ge=0,
        description="Last block only: of activation_bytes, what the loss saves for backward per microbatch (it runs "
        "outside the stage's checkpoint regions, so checkpointing keeps it); None if not measured apart (0).",
    )
    bwd_temp_bytes: int | None = Field(
        default=None,
        ge=0,
        description="Peak bytes the block's backward allocates and frees again per microbatch, from its output's "
        "gradient on (gradients of its intermediate values; planner.costs.backward_temps), its parameters' and "
        "inputs' gradients excluded; None if not measured (0).",
    )
    loss_temp_bytes: int | None = Field(
        default=None,
        ge=0,
        description="Last block only: the same from the loss on (the loss's backward, then the block's): what a "
        "language model's loss holds, gradients the size of the logits in fp32, comes before any checkpoint "
        "region is rebuilt; None if not measured (0).",
    )
    cut_legal: bool = Field(description="Whether a stage boundary may be placed right after this block.")
    is_layer: bool = Field(
        description="One of the model's repeated layers (child of a ModuleList/Sequential/ModuleDict)."
    )
    # what its attention reads per microbatch: context parallelism gathers the keys and values, swaps the queries
    kv_bytes: int = Field(default=0, ge=0, description="Bytes of the keys and values its attention reads.")
    q_bytes: int = Field(default=0, ge=0, description="Bytes of the queries its attention reads.")
    attention_s: tuple[float, float] = Field(
        default=(0.0, 0.0), description="Its attention kernels' seconds, fwd/bwd (0: unknown)."
    )
    tp: TensorParallelShare | None = Field(
        default=None,
        description="How the block divides under tensor parallelism (None: nothing in it is split; it runs whole "
        "on every tensor-parallel rank). In a plan whose tp > 1 the times and bytes above are already one "
        "tensor-parallel rank's; FLOPs stay the whole model's.",
    )
    experts: ExpertShare | None = Field(
        default=None,
        description="Its mixture-of-experts layers' experts (None: a dense block). In a plan whose ep > 1 the "
        "times and bytes above are already one expert-parallel rank's.",
    )
    fsdp_params: int | None = Field(
        default=None,
        ge=0,
        description="What FSDP shards over a pipeline rank's dp replicas, as if each held it (None: params). "
        "Under expert parallelism a rank holds 1/ep of the experts and shards them over the dp/ep replicas holding "
        "the same ones: the share of every expert over dp, so this counts the experts whole.",
    )
    fsdp_param_bytes: int | None = Field(default=None, ge=0, description="Bytes of fsdp_params (None: param_bytes).")
    float8_share: float = Field(
        default=0.0, ge=0, le=1, description="Share of params FSDP gathers in float8 (--dtype fp8, tensorwise)."
    )

    def fsdp_sharded(self) -> tuple[int, int]:
        """(parameters, bytes) that FSDP's shard over dp divides: ``fsdp_params`` and
        ``fsdp_param_bytes``, else ``params`` and ``param_bytes``."""
        params = self.params if self.fsdp_params is None else self.fsdp_params
        return params, self.param_bytes if self.fsdp_param_bytes is None else self.fsdp_param_bytes

    @property
    def sent_bytes(self) -> int:
        """Bytes one rank sends (and buffers) at a boundary after this block, per microbatch, one way."""
        return -(-self.cut_bytes // self.cut_share)


GpuArch = Literal["volta", "ampere", "hopper", "blackwell"]
"""The NVIDIA GPU generations NCCL's tuning tables tell apart (src/graph/tuning.cc, ``compCapIndex``)."""


class NcclFabric(BaseModel):
    """What NCCL's cost model (``planner.core.levers.collectives``) needs to know about a node and its network.

    The figures are NCCL's own terms: NVLink counted in links of NCCL's per-link bandwidth
    (src/graph/topo.h ``SM80_NVLINK_BW`` ...), PCIe and network cards in bytes/s as NCCL reads them
    from the system (a PCIe 4.0 x16 link is 24 GB/s to NCCL: src/graph/topo.cc, width x speed / 80).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    arch: GpuArch = Field(description="GPU generation: which of tuning.cc's per-architecture tables apply.")
    nvlinks: int = Field(default=0, ge=0, description="NVLink links per GPU (0: the GPUs of a node talk over PCIe).")
    nvswitch: bool = Field(
        default=False, description="NVLinks go to NVSwitches (DGX / HGX): NVLink SHARP (NVLS) is possible on Hopper+."
    )
    pcie_Bps: float = Field(gt=0, allow_inf_nan=False, description="The GPU's PCIe link, bytes/s one direction.")
    nic_Bps: float = Field(gt=0, allow_inf_nan=False, description="One network card, bytes/s one direction.")
    gpus_per_nic: int = Field(default=1, ge=1, description="GPUs of a node sharing one network card.")
    cpu: Literal["intel", "amd", "arm"] = Field(
        default="intel", description="Host CPU vendor: NCCL's LL bandwidth cap and network overhead depend on it."
    )
    network: bool = Field(default=False, description="This link is the network between nodes (else inside one).")
    time_scale: float = Field(
        default=1.0,
        ge=0,
        allow_inf_nan=False,
        exclude=True,
        description="Every collective's predicted time times this: a what-if of planner.core.layout.robust (every "
        "collective 1.3x slower: NCCL's latencies x 1.3 and bandwidths / 1.3 scale its time so, its choice of "
        "algorithm unchanged). Never written to a file: a plan's links are the hardware's (1.0).",
    )


class LinkCost(BaseModel):
    """Cost of one point-to-point message between neighbouring pipeline ranks.

    A message costs ``latency_s + nbytes / bandwidth_Bps``. On this project's CPU machines the fixed
    part dominates: ~1-3 ms per (stage, microbatch) action inside a gloo pipelining schedule (see
    docs/predict_vs_measured.md, where calibration fits it), far above gloo's raw 0.2-0.4 ms round trip.

    Two kinds of link: an NCCL link (``nccl`` set: a GPU of the hardware table) whose collectives
    are costed by NCCL's own model (``planner.core.levers.collectives``: the algorithm and protocol
    NCCL picks, its latencies and channel bandwidths) and whose ``latency_s`` / ``bandwidth_Bps``
    are NCCL's figures for one send; and every other link (gloo on CPUs, a measured or calibrated
    link, an accelerator NCCL does not drive), costed by the alpha-beta model of a ring with
    ``latency_s`` and ``bandwidth_Bps``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="Short description, e.g. 'gloo-cpu'.")
    latency_s: float = Field(ge=0, allow_inf_nan=False, description="Fixed cost per message, seconds.")
    bandwidth_Bps: float = Field(gt=0, allow_inf_nan=False, description="Sustained bandwidth, bytes per second.")
    ranks_per_nic: int = Field(
        default=0,
        ge=0,
        description="For a network link: ranks of a node that share one network card of this bandwidth (1 where "
        "every GPU has its own, as on DGX / HGX nodes). A collective whose group has k ranks on every node it "
        "spans crosses nodes at max(1, k // ranks_per_nic) times this bandwidth, for NCCL spreads its channels "
        "over the node's cards, up to the intra-node link's (planner.core.levers.data_parallel.group_link). 0: every "
        "collective over this link gets this bandwidth.",
    )
    nccl: NcclFabric | None = Field(
        default=None,
        description="The node and network NCCL sees, for NCCL's cost model of collectives (None: not an NCCL link; "
        "collectives are alpha-beta rings over latency_s and bandwidth_Bps).",
    )
    local_ranks: int = Field(
        default=0,
        ge=0,
        description="For an NCCL link resolved for one collective group (planner.core.levers.data_parallel."
        "group_link): the group's ranks on each node it spans. 0: the link's own shape, the whole group in one "
        "node for an intra-node link, one rank per node for the network.",
    )
    cpu_share: float = Field(
        default=1.0,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="Share of a message's time its rank spends computing, the rest waiting. It matters only where "
        "ranks share processors (CPU ranks, more than cores / threads): the simulator then shares that part, and "
        "the wait takes no processor from the others (planner.core.step.simulate). 1: all of it computes.",
    )

    def send_s(self, nbytes: int) -> float:
        """Seconds to send one message of ``nbytes``.

        Args:
            nbytes: message size in bytes.

        Returns:
            ``latency_s + nbytes / bandwidth_Bps``.
        """
        return self.latency_s + nbytes / self.bandwidth_Bps


# Measured on this project's machines (docs/predict_vs_measured.md): ~1-3 ms fixed cost per
# (stage, microbatch) action inside a torch.distributed.pipelining schedule on gloo; loopback
# bandwidth for the small tensors involved is a few GB/s. Of that time 60 % is processor work that
# ranks sharing cores compete for: over 99 bench runs re-predicted on their own profiles (4 ranks on
# 2 cores), all of it as processor work over-predicted the step by 8 %, none of it under-predicted
# by 11 %, 60 % left no bias (docs/prediction_accuracy.md, "Messages on shared cores").
GLOO_CPU_LINK = LinkCost(name="gloo-cpu", latency_s=1.5e-3, bandwidth_Bps=2.0e9, cpu_share=0.6)
# NVLink-class intra-node link for nccl (H100 SXM: 450 GB/s per direction; small-message latency ~10 us).
NCCL_NVLINK_LINK = LinkCost(name="nccl-nvlink", latency_s=10e-6, bandwidth_Bps=300e9)


class OptimizerSpec(BaseModel):
    """Which optimizer the run uses and so how much state it keeps per parameter byte."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: OptimizerName = Field(default="adamw", description="'adamw' or 'sgd'.")
    lr: float = Field(default=1e-3, gt=0, allow_inf_nan=False, description="Learning rate.")
    grad_clip: float | None = Field(
        default=1.0, gt=0, allow_inf_nan=False, description="Max global gradient norm; None disables clipping."
    )
    step_temp_rule: StepTempRule = Field(
        default="sum",
        description="How the measured step temporaries of a stage's blocks (BlockCost.opt_temp_bytes) combine into "
        "the stage's: 'max' when the optimizer steps one tensor at a time (torch's per-tensor AdamW on CPU: only the "
        "temporaries of the tensor being stepped are alive), 'sum' when it steps all together (foreach, as on "
        "CUDA). The profiler decides it from one step over all parameters (planner.costs.timing.OptimizerSteps."
        "temp_rule): the rule whose figure is nearer that step's temporaries. 'sum' (never below the truth) when "
        "not measured.",
    )

    def combine_step_temps(self, temps: Sequence[int]) -> int:
        """The temporaries of one step over several blocks from theirs (``step_temp_rule``).

        Args:
            temps: the blocks' ``opt_temp_bytes``.

        Returns:
            Bytes: their maximum or their sum (0 for none).
        """
        return max(temps, default=0) if self.step_temp_rule == "max" else sum(temps)

    def state_bytes(self, params: int, param_bytes: int) -> int:
        """Bytes of optimizer state for ``params`` parameters that take ``param_bytes`` bytes.

        AdamW keeps two fp32 moments per parameter (8 B); when the parameters themselves are
        narrower than fp32 (bf16/fp16 mixed precision) the optimizer also keeps an fp32 master copy
        (4 B) — the 2 + 2 + 12 bytes per parameter of ZeRO (Rajbhandari et al. 2020, §3.1). Plain
        SGD (no momentum) keeps nothing, but a master copy with narrow parameters.

        Args:
            params: number of parameters.
            param_bytes: their bytes as stored in the model.

        Returns:
            Optimizer-state bytes.
        """
        master = 4 * params if param_bytes < 4 * params else 0
        moments = 8 * params if self.name == "adamw" else 0
        return master + moments

    def step_temp_bytes(self, params: int) -> int:
        """Temporary bytes one optimizer step allocates on top of its state.

        The fallback when the blocks' temporaries were not measured (``BlockCost.opt_temp_bytes``): AdamW builds
        the denominator ``sqrt(exp_avg_sq) / bc + eps`` as a new fp32 tensor and one more intermediate of the same
        size: 2 x 4 B per parameter, all at once under a foreach implementation (CUDA); torch's per-tensor AdamW
        on CPU holds them for one tensor at a time (then this over-estimates). Plain SGD updates in place.

        Args:
            params: number of parameters stepped.

        Returns:
            Bytes.
        """
        return 8 * params if self.name == "adamw" else 0
