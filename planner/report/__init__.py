"""What the user reads: the balance tables and predicted-vs-measured tables (pure).

Owns: ``tables`` (the report ``planner plan`` and ``planner report`` print) and ``compare``
(plan against a run.json, error in %).

May import: ``planner.errors``, ``planner.schema``, ``planner.core``, tabulate. Never torch.
"""
