"""What the user asked for: every option of ``planner plan`` and ``planner run``, validated once.

Pure module: pydantic only, never torch. The CLI builds a request from its options and the
library takes nothing else, so a test, a notebook and the command line make the same plan from
the same request. Bad values become one ``PlannerError`` line that names the command-line option.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from planner.errors import PlannerError
from planner.schema.costs import OptimizerSpec

Schedule = Literal["gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "interleaved-zb", "zbv", "dualpipev"]
Method = Literal["optimal", "uniform", "params"]
Recompute = Literal["auto", "never", "always"]
Dtype = Literal["bf16", "fp16", "fp32"]
SCHEDULES: tuple[str, ...] = get_args(Schedule)
"""The planner's schedule names (``--schedule``), in the order the search tries them."""

TORCH_NAMES: dict[str, str] = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved-1f1b": "Interleaved1F1B",
    "looped-bfs": "LoopedBFS",
    "interleaved-zb": "InterleavedZeroBubble",
    "zbv": "ZBVZeroBubble",
    "dualpipev": "DualPipeV",
}
"""Our name -> the name ``torch.distributed.pipelining.get_schedule_class`` takes."""


def schedule_name(name: str) -> str:
    """Our name for a schedule given by our name or torch's class name (case-insensitive).

    Args:
        name: e.g. ``interleaved-1f1b``, ``Interleaved1F1B`` or ``ScheduleInterleaved1F1B``.

    Returns:
        The planner's name (a member of ``SCHEDULES``).

    Raises:
        ValueError: not a schedule torch 2.13 provides.
    """
    key = name.strip().lower().removeprefix("schedule")
    for ours, theirs in TORCH_NAMES.items():
        if key in (ours, theirs.lower()):
            return ours
    raise ValueError(
        f"not a pipeline schedule; expected one of {', '.join(SCHEDULES)}, auto "
        f"(or torch's names: {', '.join(TORCH_NAMES.values())})"
    )


DEFAULT_GPUS_PER_NODE = 8
"""Ranks per node of estimated GPU plans (an HGX/DGX node holds 8 GPUs)."""

METHODS: tuple[str, ...] = get_args(Method)
RECOMPUTE: tuple[str, ...] = get_args(Recompute)
DTYPES: tuple[str, ...] = get_args(Dtype)

R = TypeVar("R", bound="_Request")


class _Request(BaseModel):
    """Frozen, no unknown fields, and ``build`` turning validation errors into one line."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # field -> the command-line option a user typed, for messages
    OPTIONS: ClassVar[dict[str, str]] = {}

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
            # str() refuses integers past sys.get_int_max_str_digits() (4300 digits), so no
            # message, ours or a validator's, could show one: refuse it here, by its option.
            if isinstance(value, int) and abs(value).bit_length() > 4096:
                option = cls.OPTIONS.get(name, name.replace("_", "-"))
                raise PlannerError(
                    f"{option}: a number of over 1000 digits is out of range; give one that fits in 64 bits"
                )
        try:
            return cls(**values)
        except ValidationError as e:
            first = e.errors()[0]
            loc = [str(part) for part in first["loc"]]
            field = loc[-1] if len(loc) > 1 and loc[0] == "optimizer" else (loc[0] if loc else "")
            option = cls.OPTIONS.get(field, field.replace("_", "-"))
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
            message = "".join(c if c.isprintable() else repr(c)[1:-1] for c in f"{where}{msg}")
            raise PlannerError(message) from None


class PlanRequest(_Request):
    """Every option of ``planner plan`` (see ``planner plan --help``)."""

    OPTIONS: ClassVar[dict[str, str]] = {
        "model_file": "MODEL_FILE",
        "gpus": "--gpus",
        "size": "--size",
        "overrides": "--set",
        "batch_size": "--batch-size",
        "microbatches": "--microbatches",
        "schedule": "--schedule",
        "stages_per_rank": "--stages-per-rank",
        "method": "--method",
        "memory_limit_gib": "--memory-limit",
        "recompute": "--recompute",
        "gpu_type": "--gpu-type",
        "dtype": "--dtype",
        "multi_node": "--multi-node",
        "gpus_per_node": "--gpus-per-node",
        "calibrate_run": "--calibrate",
        "optimizer": "--optimizer",
        "threads": "--threads",
        "repeats": "--repeats",
        "warmup": "--warmup",
        "seed": "--seed",
        "output": "--output",
        "name": "--optimizer",
        "lr": "--lr",
        "grad_clip": "--grad-clip",
    }

    model_file: Path = Field(description="The model file (build_model, make_batch; see README).")
    gpus: int = Field(ge=1, description="Pipeline ranks (processes, one device each).")
    size: str | None = Field(default=None, description="A key of the file's SIZES (None: its defaults).")
    overrides: dict[str, Any] = Field(default_factory=dict, description="Config entries to replace (--set).")
    # bounded so the default microbatch count (a divisor search up to sqrt(batch)) stays instant
    batch_size: int = Field(default=32, ge=1, le=10**9, description="Samples per training step.")
    microbatches: int | None = Field(
        default=None, ge=1, description="Microbatches per step (None: auto, the search picks a divisor of the batch)."
    )
    schedule: Schedule | Literal["auto"] = Field(default="auto", description="Pipeline schedule (auto: searched).")
    stages_per_rank: int | None = Field(
        default=None, ge=1, le=64, description="Stages on every rank (None: auto, as the schedule allows)."
    )
    method: Method = Field(default="optimal", description="The split the plan uses; the others are compared.")
    memory_limit_gib: float | None = Field(
        # 2**30 GiB (an exbibyte) is far past any device and keeps the limit a finite byte count
        default=None,
        gt=0,
        le=2**30,
        allow_inf_nan=False,
        description="Per-rank limit in GiB (None: the GPU's capacity when known).",
    )
    recompute: Recompute = Field(default="auto", description="Activation checkpointing per stage.")
    gpu_type: str | None = Field(default=None, description="Estimate for this hardware instead of measuring here.")
    dtype: Dtype | None = Field(
        default=None, description="Dtype of --gpu-type estimates (None: bf16 on GPUs, fp32 on cpu)."
    )
    multi_node: bool = Field(
        default=False, description="Estimated plans: every boundary crosses nodes (an alias of gpus_per_node 1)."
    )
    gpus_per_node: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description="Estimated plans: ranks per node, rank r on node r // N; only boundaries between nodes use the "
        f"inter-node network (None: {DEFAULT_GPUS_PER_NODE}, or 1 with --multi-node).",
    )
    calibrate_run: Path | None = Field(default=None, description="A run.json whose measurements correct the costs.")
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    threads: int | None = Field(default=None, ge=1, description="CPU threads per rank (None: cores // gpus).")
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

    @model_validator(mode="after")
    def _consistent(self) -> PlanRequest:
        m = self.n_microbatches
        if self.batch_size % m:
            raise ValueError(
                f"batch size {self.batch_size} does not split into {m} equal microbatches; "
                f"choose --batch-size as a multiple of --microbatches (e.g. --batch-size {m * max(1, self.batch_size // m)})"
            )
        if self.multi_node and self.gpu_type is None:
            raise ValueError(
                "--multi-node applies to estimated costs only; add --gpu-type (measured plans use this machine's link)"
            )
        if self.gpus_per_node is not None and self.gpu_type is None:
            raise ValueError(
                "--gpus-per-node applies to estimated costs only; add --gpu-type (measured plans use this machine's link)"
            )
        if self.multi_node and self.gpus_per_node not in (None, 1):
            raise ValueError("--multi-node means --gpus-per-node 1 (every boundary crosses nodes); give one of the two")
        if self.dtype is not None and self.gpu_type is None:
            raise ValueError(
                "--dtype applies to estimated costs only; add --gpu-type (measured costs use the model's own dtype)"
            )
        return self

    @property
    def n_microbatches(self) -> int:
        """Microbatches per step: as given, else a default that divides the batch (``default_microbatches``).

        With ``--microbatches auto`` this is the count the costs are profiled at; the search then
        tries the other divisors of the batch with rescaled costs."""
        if self.microbatches is not None:
            return self.microbatches
        return default_microbatches(self.batch_size, self.gpus)

    @property
    def microbatch_size(self) -> int:
        """Samples per microbatch."""
        return self.batch_size // self.n_microbatches

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


def default_microbatches(batch_size: int, gpus: int) -> int:
    """The microbatch count when none is given: one that divides the batch and keeps the bubble small.

    The smallest divisor of ``batch_size`` that is at least 2 x gpus (the bubble of GPipe and 1F1B
    is (p - 1) / (m + p - 1), so m = 2p keeps it near a third); else the smallest divisor that is at
    least ``gpus`` (what 1F1B needs); else the whole batch, one sample per microbatch.

    Args:
        batch_size: samples per step.
        gpus: pipeline stages.

    Returns:
        The microbatch count.
    """
    small = [d for d in range(1, math.isqrt(batch_size) + 1) if batch_size % d == 0]  # O(sqrt(batch))
    divisors = sorted({*small, *(batch_size // d for d in small)})
    for floor in (2 * gpus, gpus):
        fits = [d for d in divisors if d >= floor]
        if fits:
            return fits[0]
    return batch_size


class RunRequest(_Request):
    """Every option of ``planner run`` (see ``planner run --help``)."""

    OPTIONS: ClassVar[dict[str, str]] = {
        "plan_file": "PLAN_FILE",
        "steps": "--steps",
        "nnodes": "--nnodes",
        "rdzv_endpoint": "--rdzv-endpoint",
        "rdzv_id": "--rdzv-id",
        "output": "--output",
    }

    plan_file: Path = Field(description="The plan to train (relative model paths resolve against its folder).")
    steps: int = Field(default=20, ge=1, description="Optimizer steps.")
    nnodes: int = Field(default=1, ge=1, description="Machines taking part (torchrun's --nnodes).")
    rdzv_endpoint: str | None = Field(
        default=None, description="host:port of the rendezvous (None: localhost, a free port)."
    )
    rdzv_id: str | None = Field(
        default=None, description="Rendezvous id shared by every machine (None: from the plan)."
    )
    output: Path | None = Field(default=None, description="Where run.json goes (None: PLAN's name with .run.json).")
    echo: bool = Field(default=True, description="Print one line per step.")

    @model_validator(mode="after")
    def _endpoint(self) -> RunRequest:
        if self.rdzv_endpoint is not None:
            host, sep, port = self.rdzv_endpoint.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
                raise ValueError(
                    f"--rdzv-endpoint {self.rdzv_endpoint}: expected HOST:PORT with a port number 0-65535, "
                    "e.g. --rdzv-endpoint node0:29500"
                )
        if self.nnodes > 1 and self.rdzv_endpoint is None:
            raise ValueError(f"a run on {self.nnodes} nodes needs --rdzv-endpoint HOST:PORT reachable from every node")
        return self

    @property
    def rdzv_host(self) -> str | None:
        """The rendezvous host (None: this machine, a free port)."""
        return self.rdzv_endpoint.rpartition(":")[0].strip("[]") if self.rdzv_endpoint else None

    @property
    def result_path(self) -> Path:
        """Where the run report is written."""
        return self.output if self.output is not None else self.plan_file.with_suffix(".run.json")
