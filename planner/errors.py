"""The planner's domain errors: one small hierarchy the CLI turns into one-line messages.

Pure module: imports nothing from torch.
"""

from __future__ import annotations


class PlannerError(ValueError):
    """Base of every error a user can cause (bad input, bad file, impossible request).

    The message names the value, what was expected and how to fix it. The CLI prints it on one
    line and exits with status 2; anything that is not a ``PlannerError`` is a bug in the planner.
    """


class ModelFileError(PlannerError):
    """A model file is missing, fails to import, or does not follow the model-file contract."""


class TraceError(PlannerError):
    """No tracer in the fallback chain could capture the model."""


class PlanFileError(PlannerError):
    """A plan.json is malformed, of another version, or made for a model that has since changed."""


class InfeasibleError(PlannerError):
    """No partition satisfies the request (too few legal cuts, memory limit, batch not divisible)."""
