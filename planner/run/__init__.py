"""The runner: train a plan on real processes with torch.distributed.pipelining (docs/architecture.md).

- ``launch``: checks in the parent, then one process per stage via ``elastic_launch`` (or this
  process for a 1-stage plan).
- ``worker``: one rank: its ``PipelineStage``, the plan's schedule, global-norm clipping.
- ``single``: the unsplit model in this process (1-stage plans; the equivalence reference).
- ``measure``: per-microbatch forward/backward timers around the stage inside the real schedule,
  point-to-point wait time, and memory by category (torch's MemTracker) on one step.
- ``result``: ``RunResult`` (with a ``StageMeasure`` per stage), the run.json written next to the plan.
"""

from __future__ import annotations

from typing import Any

from planner.schema.result import RunResult

__all__ = ["RunResult", "run_plan", "train_reference"]


def __getattr__(name: str) -> Any:
    # Lazy, so that reading a run.json (``planner.schema.result``, e.g. from the report) never imports torch.
    if name == "run_plan":
        from planner.run.launch import run_plan

        return run_plan
    if name == "train_reference":
        from planner.run.single import train_reference

        return train_reference
    raise AttributeError(f"module 'planner.run' has no attribute {name!r}")
