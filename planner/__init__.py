"""planner: a declarative pipeline-parallel partition planner for PyTorch.

The packages are the data flow (docs/architecture.md has the map and what each may import):

    capture (model file -> blocks, cuts) -> costs (measured or estimated per block)
      -> core (solve, simulate, predict; pure) -> schema (plan.json) -> run (train it) -> report (pure)

``api.make_plan(request)`` runs the planning half; ``run.run_plan(plan, request)`` the other.

For your own training script (launched with ``torchrun``; docs/interop.md)::

    import planner
    pipe = planner.pipeline("plan.json", model, example_inputs)   # this rank's stages, torch's schedule
    loss = pipe.step(inputs, target); pipe.finish_grads(); pipe.clip_grad_norm_(1.0); optimizer.step()

The public names load lazily, so that ``import planner.core`` (the pure core) never imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from planner.errors import PlannerError

__version__ = "0.1.0"
__all__ = ["Pipeline", "Plan", "PlannerError", "load_plan", "pipeline"]

if TYPE_CHECKING:  # (the pipeline names are typed where they live: planner.run.pipeline)
    from planner.schema.plan import Plan

_PUBLIC = {
    "Pipeline": ("planner.run.pipeline", "Pipeline"),
    "pipeline": ("planner.run.pipeline", "pipeline"),
    "Plan": ("planner.schema.plan", "Plan"),
}


def load_plan(path: str) -> Plan:
    """A plan.json written by ``planner plan``, validated.

    Args:
        path: the file.

    Returns:
        The plan.

    Raises:
        PlanFileError: the file is missing, is not a plan, or was written by an unknown version.
    """
    from planner.schema.plan import Plan

    return Plan.load(path)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        module, attr = _PUBLIC[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'planner' has no attribute {name!r}")
