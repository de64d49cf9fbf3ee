"""planner: a declarative pipeline-parallel partition planner for PyTorch.

The packages are the data flow (docs/architecture.md has the map and what each may import):

    capture (model file -> blocks, cuts) -> costs (measured or estimated per block)
      -> core (solve, simulate, predict; pure) -> schema (plan.json) -> run (train it) -> report (pure)

``api.make_plan(request)`` runs the planning half; ``run.run_plan(plan, request)`` the other.
"""

__version__ = "0.1.0"
