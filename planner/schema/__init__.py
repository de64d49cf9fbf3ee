"""The data every step exchanges: block costs, requests, plan.json and run.json (pure).

Owns: ``costs`` (BlockCost, LinkCost, OptimizerSpec), ``request`` (PlanRequest, RunRequest: every
option of ``planner plan`` / ``planner run``, validated once), ``plan`` (the plan document),
``result`` (the run document), ``jsonfile`` (atomic writes, versioned parsing) and ``outputs``
(``check_output``: an ``-o`` path is refused unless it is free or holds a document of the same kind).

May import: ``planner.errors``, pydantic. Never torch, never another planner package.
"""
