"""The runner: train a plan on real processes with torch.distributed.pipelining (docs/architecture.md).

- ``launch``: checks in the parent (the plan, the model file and its digest, the cuts, the
  devices), then one process per rank via ``elastic_launch`` (or this process for a one-rank plan).
- ``preflight``: ``planner run``'s own options checked in the parent (resume, data, checkpoint folder).
- ``faults``: what stopped a failed run, as one line.
- ``signals``: SIGTERM / SIGINT as exceptions (the CLI's handler and every rank's).
- ``worker``: one rank's orchestration: join the group, build the stages, resume, train by
  ``loop``, evaluate, checkpoint.
- ``mesh``: the rank's process group and its place on the (dp, pp) mesh.
- ``stages``: building a rank's stages: the trace cut into its ``PipelineStage`` objects, wrapped
  for the replicas, the schedule, the optimizer.
- ``wrappers``: what wraps a stage module (contiguous boundary, recomputation, autocast, compile,
  DDP without hooks) and the plan's autocast region.
- ``gradients``: finishing a step's gradients (microbatch averaging, ties, replicas) and the
  global-norm clipping.
- ``streams``: a rank's data, the model file's stream or ``--data``'s, cut to its replica's rows.
- ``model``: rebuilding and checking the planned model (and whether the runner can run the plan).
- ``optim``: the optimizer and the learning-rate schedule.
- ``checkpoint``: checkpoints keyed by the unsplit model's names; resume; weights export.
- ``single``: the unsplit model in this process (1-stage plans; the equivalence reference),
  gradient accumulation over microbatches, trained by ``loop``.
- ``loop``: the one training loop (draw, zero_grad, microbatches, global-norm clip, optimizer
  step, record, print), each rank's ``RankResult`` and the ``RunResult`` built from them.
- ``measure``: per-microbatch forward/backward timers around the stage inside the real schedule,
  point-to-point wait time, and memory by category (torch's MemTracker) on one step.
- ``console``: what a run prints (flushed lines, the step line).
- ``forkserver``: the server the ranks fork from, kept between launches in one process; the
  launcher's stdout, stderr and environment handed to each rank (``LaunchContext``).

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
