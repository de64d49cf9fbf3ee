"""The runner: train a plan on real processes with torch.distributed.pipelining (docs/architecture.md).

- ``launch``: checks in the parent (the plan, the model file and its digest, the cuts, the
  devices), then one process per stage via ``elastic_launch`` (or this process for a 1-stage plan).
- ``worker``: one rank: its ``PipelineStage`` and the plan's schedule, trained by ``loop``.
- ``single``: the unsplit model in this process (1-stage plans; the equivalence reference),
  gradient accumulation over microbatches, trained by ``loop``.
- ``loop``: the one training loop (draw, zero_grad, microbatches, global-norm clip, optimizer
  step, record, print), each rank's ``RankResult`` and the ``RunResult`` built from them.
- ``measure``: per-microbatch forward/backward timers around the stage inside the real schedule,
  point-to-point wait time, and memory by category (torch's MemTracker) on one step.
- ``common``: rebuilding and checking the planned model, the optimizer, clipping, the step line.

The run record itself (``RunResult``, a ``StageMeasure`` per stage) lives in
``planner.schema.result``, so reading a run.json needs no torch.
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
