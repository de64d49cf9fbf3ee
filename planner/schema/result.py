"""run.json: what ``planner run`` measured, as plain numbers.

Pure module: pydantic only, never torch (``planner report`` reads it next to plan.json).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from planner.errors import PlanFileError
from planner.schema.jsonfile import parse_versioned, read_text, write_atomic
from planner.schema.plan import Plan

# 2: per-stage measurements (``stages``); ``median_step_s`` leaves out the memory-tracked step too.
RUN_VERSION = 2

# MemTracker's categories (torch.distributed._tools.mem_tracker._MemRefType values) plus "Total".
MEMORY_CATEGORIES = ("Parameter", "Buffer", "Gradient", "Activation", "Temp", "Optstate", "Other")


class MemoryMeasure(BaseModel):
    """Tensor memory of one rank during one training step, by what the tensors are.

    Tracked with ``torch.distributed._tools.mem_tracker.MemTracker`` (a TorchDispatchMode that sees
    every tensor the step allocates, on any device, CPU included) around one step after the first,
    so that the optimizer state already exists. Categories: Parameter, Buffer, Gradient, Activation
    (made in forward), Temp (made in backward: activation gradients), Optstate (AdamW moments and
    per-parameter ``step`` scalars, plus the optimizer's temporaries), Other (the stage's
    point-to-point receive buffers: one per microbatch and boundary tensor, activations and
    gradients). Allocator overhead and anything outside torch tensors is not counted.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: str = Field(description="'memtracker' (torch.distributed._tools.mem_tracker.MemTracker).")
    step: int = Field(description="The (1-based) training step that was tracked.")
    peak_bytes: int = Field(description="Peak total tensor bytes during the step.")
    peak_by_category: dict[str, int] = Field(description="Bytes per category at the moment of the peak.")
    end_by_category: dict[str, int] = Field(
        description="Bytes per category right after optimizer.step(): parameters, gradients and optimizer state in full."
    )


class BlockMeasure(BaseModel):
    """One block's times inside the running stage (``planner.capture.clock``), medians per microbatch."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="The block's FQN.")
    fwd_s: float = Field(
        description="Median forward per microbatch; the model's last block includes the loss, as the profile does."
    )
    bwd_s: float = Field(
        description="Median backward per microbatch (input gradients only under a schedule that splits the "
        "weight gradients off); the model's last block includes the loss's backward, as the profile does."
    )


class StageMeasure(BaseModel):
    """What one stage (one rank) measured inside the real schedule, medians over the timed steps (0 when
    the run timed none: ``RunResult.median_step_s`` is then None).

    ``fwd_s`` is ``PipelineStage.forward_one_chunk`` (the stage's forward on one microbatch, from
    already-received buffers; the receive wait and the send are outside it) plus, on the last
    stage, the loss, as the profiler counts it in the last block. ``bwd_s`` is
    ``backward_one_chunk`` (+ ``backward_weight_one_chunk`` when a schedule splits it): the
    autograd backward of one microbatch from already-received output gradients; on the last stage
    it starts at the loss. ``p2p_s`` is everything the schedule spends posting and waiting on
    point-to-point operations in one step: transfer time *and* the bubble (waiting for the
    neighbour to produce), which cannot be told apart on the receiving side.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    stage: int = Field(description="Stage index.")
    rank: int | None = Field(
        default=None, description="The rank that ran it (None: stage = rank). Per-step figures are the rank's."
    )
    first_block: str = Field(description="FQN of the stage's first block.")
    last_block: str = Field(description="FQN of the stage's last block.")
    fwd_s: float = Field(description="Median forward per microbatch (incl. the loss on the last stage).")
    bwd_s: float = Field(description="Median backward per microbatch.")
    loss_s: float = Field(description="Median loss computation per microbatch (last stage; included in fwd_s).")
    p2p_s: float = Field(
        description="Median per step: posting + waiting on sends/receives (includes bubble idle time)."
    )
    reduce_s: float = Field(description="Median per step: the gradient-norm all-reduce over the pipeline group.")
    clip_s: float = Field(description="Median per step: local norm + all-reduce + scaling the gradients.")
    optimizer_s: float = Field(description="Median per step: optimizer.step().")
    step_s: float = Field(description="Median per step: this rank's step wall time.")
    fwd_times_s: list[list[float]] = Field(description="[step][microbatch] forward times, every step.")
    bwd_times_s: list[list[float]] = Field(description="[step][microbatch] backward times, every step.")
    memory: MemoryMeasure | None = Field(default=None, description="Tensor memory by category (None: not tracked).")
    blocks: list[BlockMeasure] = Field(
        default_factory=list, description="Every block of the stage timed where it ran (empty: not timed)."
    )
    fwd_overhead_s: float = Field(
        default=0.0,
        description="Median per forward action: time outside every block (the runtime's bookkeeping; the loss "
        "is apart, in loss_s).",
    )
    bwd_overhead_s: float = Field(
        default=0.0,
        description="Median per backward action: time outside every block (the runtime's bookkeeping; weight "
        "gradients computed apart are not counted).",
    )
    timeline: list[tuple[str, int, float, float]] = Field(
        default_factory=list,
        description="One timed step's actions of this stage: (kind F/B/I/W, microbatch, start, end) in seconds "
        "after timeline_origin.",
    )
    timeline_origin: float | None = Field(
        default=None, description="Wall-clock time (time.time) the timeline's step began on this rank."
    )


def timed_steps(steps: int, memory_step: int | None) -> list[int]:
    """The (1-based) steps whose times count in medians: every step but the first and the memory-tracked one.

    The first step pays for the schedule's set-up (warm-up vote, receive buffers) and the
    memory-tracked step runs every op through a Python dispatch mode (~25x slower): neither is a
    step time, so a run of 1 or 2 steps has none (empty), and no median is taken from them.
    """
    return [s for s in range(2, steps + 1) if s != memory_step]


class EvalMeasure(BaseModel):
    """One evaluation on the held-out split of ``--data``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    step: int = Field(description="The training step after which it ran.")
    loss: float = Field(description="Mean loss over the held-out batches.")
    perplexity: float = Field(description="exp(loss) (for a mean token cross-entropy).")
    batches: int = Field(description="Held-out batches evaluated.")


class RunResult(BaseModel):
    """Measured figures of one training run of a plan.

    Step time is wall time on each rank from just before ``zero_grad`` to just after
    ``optimizer.step()``: the whole pipeline schedule (every microbatch's forward and backward,
    the point-to-point waits of the bubble), the global-norm all-reduce and clipping, and the
    optimizer. Fetching the batch is outside it. No barrier is added, so ranks drift by up to a
    pipeline fill; the global-norm all-reduce re-aligns them every step. The first step also pays
    for the schedule's set-up (warm-up vote, receive buffers) and one later step (``memory_step``)
    runs under the memory tracker, so medians are over ``timed_steps`` only.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int = RUN_VERSION
    plan_fingerprint: str = Field(description="plan.model.fingerprint of the plan that was run.")
    plan_path: str | None = Field(default=None, description="The plan file that was run (absolute path when recorded).")
    mode: str = Field(description="'pipeline' (one process per rank) or 'local' (this process, no pipeline).")
    schedule: str
    n_stages: int
    n_microbatches: int
    batch_size: int
    backend: str
    steps: int
    threads: list[int] = Field(description="Intra-op threads of each rank.")
    losses: list[float] = Field(description="Per step: mean of the microbatch losses (= full-batch mean loss).")
    grad_norms: list[float] = Field(description="Per step: global gradient norm over the whole model, before clipping.")
    grad_clip: float | None = Field(description="Max global norm the gradients were clipped to (None: no clipping).")
    step_times_s: list[float] = Field(description="Per step: the slowest rank's step wall time.")
    rank_step_times_s: list[list[float]] = Field(description="[rank][step] step wall time of each rank.")
    median_step_s: float | None = Field(
        default=None, description="Median of step_times_s over timed_steps (None: no timed step, a run of 1 or 2)."
    )
    peak_rss_bytes: list[int] = Field(description="Per rank: peak resident memory of the process (ru_maxrss).")
    predicted_step_s: float | None = Field(default=None, description="The plan's predicted step time, for comparison.")
    memory_step: int | None = Field(default=None, description="The step run under the memory tracker (None: none).")
    timed_steps: list[int] = Field(default_factory=list, description="1-based steps the medians are taken over.")
    stages: list[StageMeasure] = Field(
        default_factory=list, description="Per stage (rank) measurements, stage 0 first."
    )
    status: Literal["completed", "failed", "interrupted"] = Field(
        default="completed", description="How the run ended: every step done, a failure, or Ctrl-C / SIGTERM."
    )
    stopped: str | None = Field(default=None, description="Why the run stopped early (None: it completed).")
    first_step: int = Field(default=1, ge=1, description="The step the run started at (> 1: resumed).")
    replicas: int = Field(default=1, ge=1, description="Data-parallel replicas of the pipeline.")
    samples_per_s: float | None = Field(
        default=None, description="Global batch / median step time (None: no timed step)."
    )
    tokens_per_s: float | None = Field(default=None, description="Tokens per second (None: not a token model).")
    peak_device_bytes: list[int] = Field(
        default_factory=list, description="Per rank: peak allocated device memory (CUDA only; empty on CPU)."
    )
    evals: list[EvalMeasure] = Field(default_factory=list, description="Held-out evaluations (--data).")
    checkpoints: list[str] = Field(default_factory=list, description="Checkpoint folders written by this run.")

    @staticmethod
    def median_of(times: list[float], steps: list[int]) -> float:
        """Median of ``times`` (one per step) over the 1-based ``steps``."""
        return statistics.median(times[s - 1] for s in steps)

    def to_json(self) -> str:
        """The result as indented JSON text."""
        return self.model_dump_json(indent=2) + "\n"

    def save(self, path: str | Path) -> None:
        """Write run.json to ``path`` (via a temporary file, so a failure never leaves half a file)."""
        write_atomic(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> RunResult:
        """Read and validate a run.json.

        Raises:
            PlanFileError: missing, not JSON, or not a run result of this version.
        """
        fix = "give the run report `planner run PLAN` wrote (PLAN.run.json next to the plan, or its -o)"
        text = read_text(path, "run result", fix)
        if _looks_like_plan(text):
            stem = Path(path).with_suffix("")
            raise PlanFileError(
                f"{path} is a plan, not a run report; train it with `planner run {path}` and give the run report "
                f"it writes ({stem}.run.json)"
            )
        return parse_versioned(text, cls, RUN_VERSION, str(path), "run result", fix)


def _looks_like_plan(text: str) -> bool:
    """Whether a document is a plan.json (to answer "a plan was given where a run report belongs")."""
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError):
        return False
    return isinstance(raw, dict) and {"model", "blocks", "stages", "prediction"} <= raw.keys()


def check_run_matches(plan: Plan, run: RunResult) -> None:
    """Raise unless ``run`` is a run of ``plan``'s model, schedule, batch and split, with per-stage
    measurements.

    Raises:
        PlanFileError: another model, another schedule, microbatch count or batch size, another
            number of stages, stages that start at other blocks, or a run.json without per-stage
            measurements.
    """
    if run.plan_fingerprint != plan.model.fingerprint:
        raise PlanFileError(
            f"the run was of a model with fingerprint {run.plan_fingerprint}, the plan is for {plan.model.fingerprint}; "
            "compare a plan with the run.json `planner run` wrote for it"
        )
    if len(run.stages) != plan.n_stages:
        raise PlanFileError(
            f"the run has measurements for {len(run.stages)} stage(s), the plan has {plan.n_stages}; "
            "re-run the plan with `planner run PLAN` (on one node, so every rank reports)"
        )
    for s, m in zip(plan.stages, run.stages):
        if (m.first_block, m.last_block) != (s.first_block, s.last_block):
            raise PlanFileError(
                f"stage {s.index} of the run covers {m.first_block} .. {m.last_block}, the plan's covers "
                f"{s.first_block} .. {s.last_block}; compare a plan with a run of that same plan"
            )
    ran, planned = (
        (run.schedule, run.n_microbatches, run.batch_size),
        (plan.schedule, plan.n_microbatches, plan.batch_size),
    )
    if ran != planned:  # (same split, another step: its figures are not the plan's to compare)
        said = "{}, {} microbatch(es) of a batch of {}"
        raise PlanFileError(
            f"the run ran {said.format(*ran)}, the plan is {said.format(*planned)}; compare a plan with a run "
            "of that same plan"
        )
