"""run.json: what ``planner run`` measured, as plain numbers.

Pure module: pydantic only, never torch (``planner report`` reads it next to plan.json).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from planner.errors import PlanFileError
from planner.jsonfile import write_atomic

RUN_VERSION = 1


class RunResult(BaseModel):
    """Measured figures of one training run of a plan.

    Step time is wall time on each rank from just before ``zero_grad`` to just after
    ``optimizer.step()``: the whole pipeline schedule (every microbatch's forward and backward,
    the point-to-point waits of the bubble), the global-norm all-reduce and clipping, and the
    optimizer. Fetching the batch is outside it. No barrier is added, so ranks drift by up to a
    pipeline fill; the global-norm all-reduce re-aligns them every step. The first step also pays
    for the schedule's set-up (warm-up vote, receive buffers), so ``median_step_s`` leaves it out.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int = RUN_VERSION
    plan_fingerprint: str = Field(description="plan.model.fingerprint of the plan that was run.")
    mode: str = Field(description="'pipeline' (one process per stage) or 'local' (this process, no pipeline).")
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
    median_step_s: float = Field(description="Median of step_times_s after the first (warm-up) step.")
    peak_rss_bytes: list[int] = Field(description="Per rank: peak resident memory of the process (ru_maxrss).")
    predicted_step_s: float | None = Field(default=None, description="The plan's predicted step time, for comparison.")

    @staticmethod
    def median_after_warmup(times: list[float]) -> float:
        """Median of ``times[1:]`` (the first step pays for shape inference); ``times[0]`` if alone."""
        return statistics.median(times[1:] if len(times) > 1 else times)

    def to_json(self) -> str:
        """The result as indented JSON text."""
        return self.model_dump_json(indent=2) + "\n"

    def save(self, path: str | Path) -> None:
        """Write run.json to ``path`` (via a temporary file, so a failure never leaves half a file)."""
        write_atomic(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "RunResult":
        """Read and validate a run.json.

        Raises:
            PlanFileError: missing, not JSON, or not a run result of this version.
        """
        try:
            raw = json.loads(Path(path).read_text())
        except OSError as e:
            raise PlanFileError(f"cannot read run result {path}: {e.strerror}; write one with `planner run PLAN -o {path}`") from e
        except json.JSONDecodeError as e:
            raise PlanFileError(f"{path} is not JSON ({e}); write it with `planner run PLAN -o {path}`") from e
        if not isinstance(raw, dict) or raw.get("version") != RUN_VERSION:
            raise PlanFileError(f"{path} is not a version-{RUN_VERSION} run result; re-run `planner run` to make a new one")
        try:
            return cls.model_validate(raw)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "(top level)"
            raise PlanFileError(f"{path} is not a valid run result: {where}: {first['msg']}; re-run `planner run`") from e
