"""What the user asked for: every option of ``planner plan``, validated once (``planner run``'s:
``planner.schema.run_request``).

Pure module: pydantic only, never torch. The CLI builds a request from its options and the
library takes nothing else, so a test, a notebook and the command line make the same plan from
the same request. Bad values become one ``PlannerError`` line that names the command-line option.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from planner.errors import PlannerError, printable
from planner.schema.bounds import MAX_MEMORY_LIMIT_GIB, MemoryLimitGiB
from planner.schema.costs import OptimizerSpec
from planner.schema.counts import default_microbatches, divisors, expert_groups_fit, group_replicas
from planner.schema.names import (
    ZERO_BUBBLE,
    CpAttention,
    DpMode,
    Dtype,
    FsdpUnits,
    Method,
    Recompute,
    Schedule,
    schedule_name,
)

DEFAULT_GPUS_PER_NODE = 8
"""Ranks per node of estimated GPU plans (an HGX/DGX node holds 8 GPUs)."""

MOE_IMBALANCE = 1.52
"""``--moe-imbalance auto`` where the router cannot be run (an estimate on the meta device): the busiest
expert's routed rows over the mean, 1 + MaxVio_global of a 3B-parameter MoE (64 experts, top 6)
balanced by an auxiliary loss (Wang et al., "Auxiliary-Loss-Free Load Balancing Strategy for
Mixture-of-Experts", arXiv 2408.15664, Table 2: 0.52; 0.72 at 1B). The same paper's loss-free
balancing, which DeepSeek-V3 trains with, measures 1.04; force-balanced benchmarks are 1."""

R = TypeVar("R", bound="_Request")


def _count_or_auto(value: Any, what: str, too_few: str) -> Any:
    """A whole number of 1 or more (also as text, from a notebook or a config file), or "auto" in any case;
    ``too_few`` is the message for a number below 1."""
    message = f"expected a whole number of {what} (1 or more) or 'auto'"
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return "auto"
        if not text.lstrip("+-").isdigit():
            raise ValueError(message)
        value = int(text)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(message)
    if value < 1:
        raise ValueError(too_few)
    return value


def _admits(annotation: Any, kind: type) -> bool:
    """Whether a field's type admits ``kind`` (``kind`` itself, or inside a union or ``Annotated``)."""
    return annotation is kind or any(_admits(arg, kind) for arg in get_args(annotation))


class _Request(BaseModel):
    """Frozen, no unknown fields, and ``build`` turning validation errors into one line."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # field -> the command-line option a user typed, for messages
    OPTIONS: ClassVar[dict[str, str]] = {}

    @classmethod
    def _option(cls, field: str) -> str:
        """The option a user typed for ``field`` (``--gpus`` for gpus), for messages."""
        return cls.OPTIONS.get(field, field.replace("_", "-"))

    @classmethod
    def build(cls: type[R], **values: Any) -> R:
        """Validate ``values`` into a request.

        Args:
            values: the fields (see the class).

        Returns:
            The request.

        Raises:
            PlannerError: a value out of range or of the wrong kind, naming its option.
        """
        for name, value in values.items():
            spec = cls.model_fields.get(name)
            if isinstance(value, str) and not value.strip() and spec is not None and _admits(spec.annotation, Path):
                # an empty path is "." to pathlib: an unset "$CKPT" would fill the current folder
                raise PlannerError(f"{cls._option(name)}: an empty path; give one, or leave it out for its default")
            if isinstance(value, bool) and spec is not None and not _admits(spec.annotation, bool):
                # pydantic reads True as 1 (gpus=True planned one GPU, memory_limit_gib=True 1 GiB)
                option = cls._option(name)
                raise PlannerError(f"{option} {value}: {option} takes a value, not True or False")
            # str() refuses integers past 4300 digits (sys.get_int_max_str_digits()): no message could show one
            if isinstance(value, int) and abs(value).bit_length() > 4096:
                option = cls._option(name)
                raise PlannerError(
                    f"{option}: a number of over 1000 digits is out of range; give one that fits in 64 bits"
                )
        try:
            return cls(**values)
        except ValidationError as e:
            first = e.errors()[0]
            loc = [str(part) for part in first["loc"]]
            field = loc[-1] if len(loc) > 1 and loc[0] == "optimizer" else (loc[0] if loc else "")
            option = cls._option(field)
            given = first.get("input") if len(loc) > 1 else values.get(field, first.get("input"))
            msg = str(first["msg"]).removeprefix("Value error, ")
            try:
                # the "input" of a missing field is every other value: show none
                shown = "" if first["type"] == "missing" else f" {given}"
                where = f"{option}{shown}: " if option else ""
            except ValueError:  # a nested integer too long for str() (e.g. in the optimizer dict)
                where = f"{option} (a number too long to show): "
            # A value (ours or quoted by a validator) may hold a line break: escape such characters,
            # so the message stays the one line the CLI prints.
            message = printable(f"{where}{msg}")
            raise PlannerError(message) from None


class PlanRequest(_Request):
    """Every option of ``planner plan`` (see ``planner plan --help``)."""

    OPTIONS: ClassVar[dict[str, str]] = {
        "model_file": "MODEL_FILE",
        "gpus": "--gpus",
        "dp": "--dp",
        "dp_mode": "--dp-mode",
        "dp_shard": "--dp-shard",
        "fsdp_units": "--fsdp-units",
        "tp": "--tp",
        "ep": "--ep",
        "cp": "--cp",
        "cp_attention": "--cp-attention",
        "moe_imbalance": "--moe-imbalance",
        "size": "--size",
        "overrides": "--set",
        "batch_size": "--batch-size",
        "microbatches": "--microbatches",
        "accumulation": "--accumulation",
        "schedule": "--schedule",
        "stages_per_rank": "--stages-per-rank",
        "method": "--method",
        "compare": "--compare",
        "memory_limit_gib": "--memory-limit",
        "recompute": "--recompute",
        "gpu_type": "--gpu-type",
        "attention_kernel": "--attention-kernel",
        "dtype": "--dtype",
        "compile": "--compile",
        "multi_node": "--multi-node",
        "gpus_per_node": "--gpus-per-node",
        "calibrate_run": "--calibrate",
        "optimizer": "--optimizer",
        "threads": "--threads",
        "jobs": "--jobs",
        "repeats": "--repeats",
        "warmup": "--warmup",
        "seed": "--seed",
        "output": "--output",
        "name": "--optimizer",
        "lr": "--lr",
        "grad_clip": "--grad-clip",
    }

    model_file: Path = Field(description="The model file (build_model, make_batch; see README).")
    gpus: int = Field(ge=1, description="Ranks in all (processes, one device each): world size = dp x pp x tp.")
    dp: int | Literal["auto"] = Field(
        default=1,
        description="Data-parallel replicas of the pipeline (--gpus / dp ranks each, pipeline x tensor-parallel, the global batch "
        "split evenly over them), or auto: the search tries every divisor of --gpus that splits the batch.",
    )
    dp_mode: DpMode | Literal["auto"] = Field(
        default="auto",
        description="How replicas reduce gradients: ddp (all-reduce), fsdp (fully_shard: parameters, "
        "gradients and optimizer state sharded over the replicas), hsdp (sharded inside groups of --dp-shard "
        "replicas, the groups' gradients all-reduced), or auto: ddp where it fits, else fsdp, or hsdp in groups of "
        "one node's replicas where the replicas span nodes and that fits and is faster.",
    )
    dp_shard: int | Literal["auto"] = Field(
        default="auto",
        description="Under --dp-mode hsdp, the replicas of each shard group (a divisor of the replicas: dp x cp), or auto: the "
        "largest groups whose replicas (with their pipeline and tensor-parallel ranks) each lie on one node "
        "(--gpus-per-node), so the gathers stay inside a node and only the groups' all-reduce crosses nodes.",
    )
    fsdp_units: FsdpUnits | Literal["auto"] = Field(
        default="auto",
        description="Under fsdp or hsdp, what is gathered at a time: stage (each stage one unit, gathered for the whole "
        "step, reduced once), block (each block its own unit, gathered again for every microbatch's forward and "
        "backward and resharded after each, as torchtitan shards layers: far less memory, more traffic, "
        "overlapped with compute), or auto: the faster of the two that fits.",
    )
    tp: int | Literal["auto"] = Field(
        default="auto",
        description="Tensor-parallel ranks every pipeline rank is split over, inside one node (by the model's tp "
        "plan), or auto: every degree the node and the model allow (1 when the model declares no tp plan).",
    )
    ep: int | Literal["auto"] = Field(
        default=1,
        description="Expert-parallel ranks: each mixture-of-experts layer's experts sharded over this many data-"
        "parallel replicas, the tokens routed to them sent there and back (1: none), or auto: every degree that "
        "divides the experts, searched with the other dimensions where expert parallelism runs.",
    )
    cp: Annotated[int, Field(ge=1, le=2**20)] | Literal["auto"] = Field(
        default=1,
        description="Context-parallel ranks: every sequence split into this many chunks along the model inputs' "
        "dimension 1, one per rank, attention reaching the others' keys and values (1: none), or auto: 1 and "
        "every degree up to 32 that divides the ranks and the sequence, searched with the other dimensions.",
    )
    cp_attention: CpAttention | Literal["auto"] = Field(
        default="auto",
        description="With cp > 1, how attention reaches every position's keys and values: all-gather, ring "
        "(passed around the group, overlapped with attention), or auto: the faster that fits, per layout.",
    )
    moe_imbalance: Annotated[float, Field(ge=1, le=1000, allow_inf_nan=False)] | Literal["auto"] = Field(
        default="auto",
        description="Under expert parallelism, the busiest expert's routed rows over the mean (1: an even spread; "
        "a rank's follows, planner.costs.experts.spread_imbalance), or auto: the router's, measured on the "
        "example microbatch where the model runs, else MOE_IMBALANCE.",
    )
    # on, off, or auto: the search tries both where the model's shards allow it, keeping the faster that fits
    sequence_parallel: bool | Literal["auto"] = Field(default="auto", description="Sequence parallelism, tp > 1.")
    loss_parallel: bool = Field(
        default=False, description="Loss parallelism where tp > 1: the loss on the output head's split logits."
    )
    size: str | None = Field(default=None, description="A key of the file's SIZES (None: its defaults).")
    overrides: dict[str, Any] = Field(default_factory=dict, description="Config entries to replace (--set).")
    # bounded so the default microbatch count (a divisor search up to sqrt(batch)) stays instant
    batch_size: int = Field(default=32, ge=1, le=10**9, description="Samples per training step.")
    microbatches: int | None = Field(
        default=None, ge=1, description="Microbatches per step (None: auto, the search picks a divisor of the batch)."
    )
    accumulation: int | Literal["auto"] = Field(
        default="auto",
        description="Pipeline passes per step (gradient accumulation): each replica runs the schedule this many "
        "times on batch / (dp x passes) samples, --microbatches microbatches each, then reduces, clips and steps "
        "once. Memory is one pass's (torch allocates receive buffers for every microbatch of a pass), time the "
        "passes' together. auto: one pass, and more only for the layouts whose one pass does not fit, or fits only "
        "as the memory limit shapes it (an unbalanced split, recomputation).",
    )
    schedule: Schedule | Literal["auto"] = Field(default="auto", description="Pipeline schedule (auto: searched).")
    stages_per_rank: int | None = Field(
        default=None, ge=1, le=64, description="Stages on every rank (None: auto, as the schedule allows)."
    )
    method: Method = Field(default="optimal", description="The split the plan uses; the others are compared.")
    compare: str | None = Field(
        default=None,
        description="A split to cost beside the plan (planner.core.split.given: layer counts, a Megatron layout, "
        "parts:..., or fqns: and torchtitan's module lists as JSON); --method given trains it.",
    )
    memory_limit_gib: MemoryLimitGiB | None = Field(  # bounds: under one byte, past an exbibyte refused
        default=None,
        gt=0,
        le=MAX_MEMORY_LIMIT_GIB,
        allow_inf_nan=False,
        description="Per-rank limit in GiB (None: the GPU's capacity when known).",
    )
    recompute: Recompute = Field(
        default="auto",
        description="Activation checkpointing: auto (per stage, the first that fits of none, selective, full, "
        "stage), or never, selective, full (block by block) or stage (the whole stage as one region) on every "
        "stage (always: full).",
    )
    gpu_type: str | None = Field(default=None, description="Estimate for this hardware instead of measuring here.")
    attention_kernel: str | None = Field(
        default=None,
        description="--gpu-type estimates: the scaled_dot_product_attention backend to cost ('flash', 'cudnn', "
        "'efficient'; 'unfused': two GEMMs around a softmax, as code before FlashAttention ran it; None: the one "
        "current torch picks on that GPU).",
    )
    dtype: Dtype | None = Field(
        default=None,
        description="Measured costs: the autocast dtype (bf16, fp16: torch.autocast, parameters stay fp32; fp32 or "
        "None: no autocast). --gpu-type estimates: the parameter and activation dtype (None: bf16 on GPUs, fp32 on cpu).",
    )
    compile: bool = Field(default=False, description="Train with torch.compile (measured: blocks timed so).")
    multi_node: bool = Field(
        default=False, description="Estimated plans: every boundary crosses nodes (an alias of gpus_per_node 1)."
    )
    gpus_per_node: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description="Estimated plans: ranks per node, global rank g on node g // N; only boundaries between nodes use the "
        f"inter-node network (None: {DEFAULT_GPUS_PER_NODE}, or 1 with --multi-node).",
    )
    calibrate_run: Path | None = Field(default=None, description="A run.json whose measurements correct the costs.")
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    threads: int | None = Field(default=None, ge=1, description="CPU threads per rank (None: cores // gpus).")
    jobs: int | None = Field(default=None, ge=1, le=1024, description="Search worker processes (None: the cores here).")
    repeats: int = Field(default=5, ge=1, description="Timed runs per block.")
    warmup: int = Field(default=2, ge=0, description="Untimed runs per block.")
    # torch.manual_seed takes a 64-bit seed and the run adds the step number to it: keep it below 2**63.
    seed: int = Field(default=0, ge=0, le=2**63 - 1, description="Seed for weights and the example batch.")
    output: Path = Field(default=Path("plan.json"), description="Where the plan is written.")
    progress: bool = Field(default=True, description="Show progress bars.")

    @model_validator(mode="before")
    @classmethod
    def _schedule_names(cls, data: Any) -> Any:
        # torch's class names are accepted too (--schedule Interleaved1F1B), and any case of "auto"
        if isinstance(data, dict) and isinstance(data.get("schedule"), str):
            given = data["schedule"]
            try:
                name = "auto" if given.strip().lower() == "auto" else schedule_name(given)
            except ValueError as e:
                raise ValueError(f"--schedule {given}: {e}") from None
            data = {**data, "schedule": name}
        return data

    # what each count-or-auto option counts, and the hint for one under 1
    _COUNTS: ClassVar[dict[str, tuple[str, str]]] = {
        "dp": (
            "data-parallel replicas",
            "need at least one replica: give 1 (one pipeline on every rank) or more, or 'auto'",
        ),
        "dp_shard": (
            "replicas per shard group",
            "need at least two replicas per shard group: give 2 or more, or 'auto'",
        ),
        "accumulation": (
            "pipeline passes per step",
            "need at least one pass: give 1 (no gradient accumulation) or more, or 'auto'",
        ),
        "tp": (
            "tensor-parallel ranks",
            "need at least one rank per split: give 1 (no tensor parallelism) or more, or 'auto'",
        ),
        "ep": (
            "expert-parallel ranks",
            "need at least one rank per expert: give 1 (no expert parallelism) or more, or 'auto'",
        ),
    }

    @field_validator(*_COUNTS, mode="before")
    @classmethod
    def _count(cls, value: Any, info: ValidationInfo) -> Any:
        assert info.field_name is not None  # a field's validator always has its name
        what, hint = cls._COUNTS[info.field_name]
        return _count_or_auto(value, what, hint)

    @field_validator("recompute", mode="after")
    @classmethod
    def _recompute_name(cls, value: str) -> str:
        return "full" if value == "always" else value  # its name before selective checkpointing

    @field_validator("dp_mode", mode="before")
    @classmethod
    def _dp_mode_name(cls, value: Any) -> Any:
        return value.strip().lower() if isinstance(value, str) else value

    def _check_tensor_parallel(self) -> None:
        """Refuse a tensor-parallel degree that does not divide the ranks, a node, or the ranks left to replicas."""
        if self.sequence_parallel is True and self.compile:  # a stage compiled under its DTensor mode fails
            raise ValueError("--sequence-parallel runs eagerly only; leave out --compile")
        if self.sequence_parallel is True and self.tp == 1:  # else the option would be dropped without a word
            raise ValueError(
                "--sequence-parallel splits along the sequence what tensor parallelism keeps whole, but --tp is 1; "
                "give --tp 2 or more (or auto), or leave --sequence-parallel out"
            )
        if self.loss_parallel and self.tp == 1:
            raise ValueError(
                "--loss-parallel computes the loss on the output head's logits split over the tensor-parallel "
                "ranks, but --tp is 1; give --tp 2 or more (or auto), or leave --loss-parallel out"
            )
        if self.tp == "auto":
            return
        if self.gpus % self.tp:
            raise ValueError(f"--tp {self.tp} does not divide --gpus {self.gpus}; give a divisor of it, or auto")
        # fewer GPUs than a node holds are one node of that many (6 GPUs: tp 3 stays inside it)
        node = min(self.ranks_per_node, self.gpus) if self.gpu_type is not None else self.gpus
        if self.tp > 1 and node % self.tp:
            raise ValueError(
                f"--tp {self.tp} does not divide the {node} ranks of a node (--gpus-per-node): a tensor-parallel "
                "group all-reduces every layer and must stay inside one node"
            )
        if isinstance(self.dp, int) and self.gpus % (self.dp * self.tp):
            raise ValueError(
                f"--dp {self.dp} x --tp {self.tp} does not divide --gpus {self.gpus} (the ranks form dp replicas x "
                "pp pipeline ranks x tp tensor-parallel ranks)"
            )

    def _check_experts(self) -> None:
        """Refuse an expert-parallel degree that no replica count takes, or with what it does not run
        with yet (the model's experts are checked once it is loaded: ``planner.core.levers.experts``)."""
        if self.ep == 1 or self.ep == "auto":
            return
        tp = self.tp if isinstance(self.tp, int) else 1
        if tp > 1 and self.ep % tp:
            raise ValueError(
                f"--ep {self.ep} is no multiple of --tp {tp}: an expert-parallel group spans the tensor-parallel ranks "
                f"of the replicas it covers; give an --ep that {tp} divides (or auto)"
            )
        covered = group_replicas(self.ep, tp)
        if self.gpus % self.ep:
            raise ValueError(f"--ep {self.ep} does not divide --gpus {self.gpus}")
        self._check_expert_replicas(self.ep, tp, covered)
        shard = self.dp_shard
        if (
            self.dp_mode == "hsdp"
            and isinstance(shard, int)
            and not any(expert_groups_fit(self.ep, t, shard) for t in self.tp_options)
        ):
            raise ValueError(
                f"--ep {self.ep} covers {covered} replicas, which do not divide --dp-shard {self.dp_shard}: each "
                f"expert group lies inside an HSDP shard group; give a --dp-shard that is a multiple of {covered} "
                "(or auto)"
            )
        if self.sequence_parallel is True:
            raise ValueError(
                f"--ep {self.ep}: expert parallelism does not run with --sequence-parallel yet; give "
                "--no-sequence-parallel (or --ep 1)"
            )

    def _check_expert_replicas(self, ep: int, tp: int, covered: int) -> None:
        """Refuse replica counts ``--ep``'s groups of ``covered`` replicas (with their ``tp`` ranks) do not
        divide. A group covers consecutive replicas of the mesh: under context parallelism a replica's
        cp ranks too, so with ``--cp auto`` each layout's dp x cp is checked in the search instead."""
        if self.cp == "auto":
            return
        if isinstance(self.dp, int) and self.dp * self.cp % covered:
            over = f" (x {tp} tensor-parallel ranks)" if tp > 1 else ""
            replicas = f"--dp {self.dp}" if self.cp == 1 else f"--dp {self.dp} x --cp {self.cp}"
            raise ValueError(
                f"--ep {ep} shards the experts over {covered} replicas{over}, but {replicas} is no multiple "
                f"of {covered}; give --dp {covered} (or a multiple of it, or auto)"
            )
        if not any(expert_groups_fit(ep, t, d * self.cp) for t in self.tp_options for d in self.dp_options):
            tried = ", ".join(map(str, self.dp_options))
            raise ValueError(
                f"--ep {ep} shards the experts over replicas (ep / tp of them), but no replica count tried "
                f"({tried}: those that split the batch of {self.batch_size} evenly) is a multiple of that; give a "
                "larger --batch-size or a smaller --ep"
            )

    def _check_shard_groups(self) -> None:
        """Refuse a shard group size without hsdp, or one that does not divide the replicas."""
        if self.dp_shard == "auto":
            return
        if self.dp_mode != "hsdp":
            raise ValueError(
                f"--dp-shard {self.dp_shard} sizes HSDP's shard groups, but --dp-mode is {self.dp_mode}; add "
                "--dp-mode hsdp, or leave --dp-shard out"
            )
        if self.dp_shard < 2:
            raise ValueError(
                f"--dp-shard {self.dp_shard}: a shard group needs at least 2 replicas (1 is --dp-mode ddp)"
            )
        if self.dp == 1 and self.cp == 1:
            raise ValueError(
                f"--dp-shard {self.dp_shard} groups replicas, but --dp is 1 (one pipeline on every rank); give --dp K "
                "(a multiple of it, at least twice it) or --dp auto"
            )
        if not isinstance(self.dp, int) or not isinstance(self.cp, int):
            return  # each layout's replicas are checked in the search
        # under context parallelism every replica's cp ranks are replicas too (the stages are sharded over dp x cp)
        replicas, what = self.dp * self.cp, f"--dp {self.dp}" + (f" x --cp {self.cp}" if self.cp > 1 else "")
        if replicas % self.dp_shard or replicas == self.dp_shard:
            raise ValueError(
                f"--dp-shard {self.dp_shard} must divide {what} into at least two groups (shard groups of "
                "every replica are --dp-mode fsdp)"
            )

    def _check_context(self) -> None:
        """Refuse a context-parallel degree that does not divide the ranks, or ring attention without one
        (the sequence's length is checked once the model is loaded)."""
        if self.cp == 1 and self.cp_attention == "ring":
            raise ValueError(f"--cp-attention {self.cp_attention} needs --cp above 1 (or --cp auto)")
        if self.cp == 1 or self.cp == "auto":
            return
        if self.loss_parallel:  # the runner's context-parallel hooks meet the split logits: not run yet
            raise ValueError(
                f"--loss-parallel does not run with --cp {self.cp} yet; leave one of them out (with --cp auto the "
                "context-parallel layouts gather the logits whole)"
            )
        if self.gpus % self.cp:
            raise ValueError(f"--cp {self.cp} does not divide --gpus {self.gpus}")
        tp = self.tp if isinstance(self.tp, int) else 1
        if isinstance(self.dp, int) and self.gpus % (self.dp * tp * self.cp):
            raise ValueError(
                f"--dp {self.dp} x --tp {tp} x --cp {self.cp} does not divide --gpus {self.gpus} (the ranks form dp "
                "replicas x cp context-parallel ranks x pp pipeline ranks x tp tensor-parallel ranks)"
            )

    def _check_replicas(self) -> None:
        """Refuse a replica count that does not divide the ranks or the batch (before any model is built)."""
        self._check_tensor_parallel()
        self._check_context()
        if self.dp == "auto":
            return
        if self.gpus % self.dp:
            # listing the divisors of an absurd rank count would take long (O(sqrt)): name the rule then
            options = ", ".join(str(k) for k in divisors(self.gpus)) if self.gpus <= 2**40 else "a divisor of it"
            raise ValueError(
                f"--dp {self.dp} does not divide --gpus {self.gpus} (the ranks form dp replicas x pp pipeline "
                f"ranks); give --dp as one of {options}, or auto"
            )
        if self.batch_size % self.dp:
            raise ValueError(
                f"batch size {self.batch_size} does not split into {self.dp} equal replica batches; choose "
                f"--batch-size as a multiple of --dp (e.g. --batch-size {self.dp * max(1, self.batch_size // self.dp)})"
            )

    @model_validator(mode="after")
    def _consistent(self) -> PlanRequest:
        self._check_replicas()
        self._check_shard_groups()
        self._check_experts()
        if self.fsdp_units != "auto" and self.dp_mode == "ddp":
            raise ValueError(
                f"--fsdp-units {self.fsdp_units} shards with FSDP, but --dp-mode is ddp (every replica holds its "
                "stages whole); use --dp-mode fsdp, hsdp or auto, or leave --fsdp-units out"
            )
        if self.fsdp_units != "auto" and self.dp == 1 and self.profile_cp == 1:  # else it would be dropped unsaid
            raise ValueError(
                f"--fsdp-units {self.fsdp_units} shards with FSDP over replicas, but --dp is 1 (one pipeline on every "
                "rank, nothing to shard); give --dp 2 or more (or auto), or leave --fsdp-units out"
            )
        if self.dp_mode in ("fsdp", "hsdp") and self.dp == 1 and self.profile_cp == 1:  # said, not dropped
            raise ValueError(
                f"--dp-mode {self.dp_mode} shards over replicas, but --dp is 1 (one pipeline on every rank, nothing "
                "to shard); give --dp 2 or more (or auto), or leave --dp-mode out"
            )
        k = self.passes
        if k > 1 and self.batch_size % (self.profile_dp * k):
            raise ValueError(
                f"batch size {self.batch_size} does not split into {self.profile_dp} replica(s) x {k} passes; choose "
                f"--batch-size as a multiple of --dp x --accumulation, or --accumulation auto"
            )
        if k > 1 and self.microbatches is not None and (self.batch_size // (self.profile_dp * k)) % self.microbatches:
            raise ValueError(
                f"batch size {self.batch_size} does not split into {self.profile_dp} replica(s) x {k} passes x "
                f"{self.microbatches} microbatches; choose --batch-size as a multiple of --dp x --accumulation x "
                "--microbatches"
            )
        d = self.profile_dp
        if d > 1 and self.microbatches is not None and (self.batch_size // d) % self.microbatches:
            m = self.microbatches
            raise ValueError(
                f"batch size {self.batch_size} does not split into {d} replicas x {m} equal microbatches "
                f"(each replica's {self.batch_size // d} samples into {m}); choose --batch-size as a multiple of "
                f"--dp x --microbatches (e.g. --batch-size {d * m * max(1, self.batch_size // (d * m))})"
            )
        m = self.n_microbatches
        if self.batch_size % m:
            raise ValueError(
                f"batch size {self.batch_size} does not split into {m} equal microbatches; "
                f"choose --batch-size as a multiple of --microbatches (e.g. --batch-size {m * max(1, self.batch_size // m)})"
            )
        if self.method == "given" and self.compare is None:
            raise ValueError("--method given trains the split given with --compare SPLIT; give one")
        if self.recompute == "selective" and self.schedule in ZERO_BUBBLE:
            raise ValueError(
                f"--recompute selective cannot run under --schedule {self.schedule}: its two-part backward runs each "
                "stage's backward twice, which torch's selective activation checkpointing refuses; use --recompute "
                "full (or auto), or another schedule"
            )
        if self.multi_node and self.gpu_type is None:
            raise ValueError(
                "--multi-node applies to estimated costs only; add --gpu-type (measured plans use this machine's link)"
            )
        if self.gpus_per_node is not None and self.gpu_type is None:
            raise ValueError(
                "--gpus-per-node applies to estimated costs only; add --gpu-type (measured plans use this machine's link)"
            )
        if self.attention_kernel is not None and self.gpu_type in (None, "cpu"):
            raise ValueError(
                "--attention-kernel applies to --gpu-type estimates of GPUs only (a measured plan times the "
                "attention kernel torch runs here)"
            )
        if self.multi_node and self.gpus_per_node not in (None, 1):
            raise ValueError("--multi-node means --gpus-per-node 1 (every boundary crosses nodes); give one of the two")
        return self

    @property
    def autocast(self) -> Literal["bf16", "fp16"] | None:
        """The autocast dtype measured costs are profiled under: ``--dtype`` bf16, fp16 or an FP8 dtype
        (bf16) without ``--gpu-type``; None otherwise (fp32, or an estimate, whose ``--dtype`` is its own)."""
        if self.gpu_type is None and self.dtype is not None and self.dtype != "fp32":
            return "fp16" if self.dtype == "fp16" else "bf16"  # (fp8: bf16 around the float8 GEMMs)
        return None

    @property
    def n_microbatches(self) -> int:
        """Microbatches per step: as given, else a default that divides the batch (``default_microbatches``).

        With ``--microbatches auto`` this is the count the costs are profiled at; the search then
        tries the other divisors of the batch with rescaled costs. Counts are per replica: with
        ``--dp K`` each of the K pipelines runs this many microbatches of its batch / K samples."""
        if self.microbatches is not None:
            return self.microbatches
        return default_microbatches(self.batch_size // (self.profile_dp * self.passes), self.profile_pp)

    @property
    def passes(self) -> int:
        """Pipeline passes per step the costs are profiled for: ``--accumulation`` when given, else 1."""
        return self.accumulation if isinstance(self.accumulation, int) else 1

    @property
    def microbatch_size(self) -> int:
        """Samples per microbatch (of one replica's pipeline): the size the costs are profiled at."""
        return self.batch_size // (self.profile_dp * self.passes * self.n_microbatches)

    @property
    def profile_dp(self) -> int:
        """The replica count the costs are profiled for: ``--dp`` when given, 1 with ``--dp auto``
        (the search rescales the costs to the microbatches of the other replica counts)."""
        return self.dp if isinstance(self.dp, int) else 1

    @property
    def profile_tp(self) -> int:
        """The tensor-parallel degree the default microbatch count is chosen for: ``--tp`` when given, 1 with
        ``--tp auto`` (costs are always profiled unsplit; the search divides them per degree)."""
        return self.tp if isinstance(self.tp, int) else 1

    @property
    def profile_pp(self) -> int:
        """Pipeline ranks of one replica at ``profile_dp`` replicas: ``--gpus / (profile_dp x profile_tp)``."""
        return max(1, self.gpus // (self.profile_dp * self.profile_tp * self.profile_cp))

    @property
    def profile_cp(self) -> int:
        """The context-parallel degree the replicas are counted with before the search: ``--cp`` when
        given, 1 with ``--cp auto``."""
        return self.cp if isinstance(self.cp, int) else 1

    @property
    def tp_options(self) -> list[int]:
        """The tensor-parallel degrees the search may try before the model is asked: ``--tp`` alone, or with
        ``--tp auto`` every divisor of a node's ranks that divides ``--gpus``, ascending, for plans
        estimated for GPUs (``--gpu-type``). A plan measured here keeps degree 1 unless ``--tp`` names one:
        its sharded layers' measured cost and ``--calibrate`` are not yet modelled per tensor-parallel
        rank, and CPU ranks share this machine's cores. The model's tp plan narrows them further."""
        if isinstance(self.tp, int):
            return [self.tp]
        if self.gpu_type is None or self.gpu_type == "cpu":
            return [1]
        return divisors(math.gcd(self.ranks_per_node, self.gpus))

    @property
    def dp_options(self) -> list[int]:
        """The replica counts the search tries: ``--dp`` alone, or with ``--dp auto`` every divisor of
        ``--gpus`` that splits the batch into equal replica batches (and each of those into
        ``--microbatches``, when given), ascending."""
        if isinstance(self.dp, int):
            return [self.dp]
        # k must divide both the ranks and batch / m: the divisors of their gcd (batch <= 1e9: fast)
        ranks = self.gpus // self.profile_cp  # every replica is cp context-parallel ranks
        return divisors(math.gcd(ranks, self.batch_size // ((self.microbatches or 1) * self.passes)))

    @property
    def min_pipeline_ranks(self) -> int:
        """The fewest pipeline ranks any mesh tried has: ``--gpus`` / (the largest of ``dp_options`` x a given
        ``--tp``); with ``--tp auto`` the model may have no tensor-parallel plan, so degree 1 counts."""
        return max(1, self.gpus // (max(self.dp_options) * self.profile_tp * self.profile_cp))

    @property
    def ranks_per_node(self) -> int:
        """Ranks per node for estimated plans: ``--gpus-per-node``, 1 with ``--multi-node``, else 8."""
        if self.gpus_per_node is not None:
            return self.gpus_per_node
        return 1 if self.multi_node else DEFAULT_GPUS_PER_NODE

    @property
    def memory_limit_bytes(self) -> int | None:
        """``--memory-limit`` in bytes (None: not given)."""
        return int(self.memory_limit_gib * 2**30) if self.memory_limit_gib is not None else None
