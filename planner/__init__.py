"""planner: a declarative pipeline-parallel partition planner for PyTorch.

Data flow (one module per step; see DESIGN.md): load → trace → profile → solve → simulate/predict
→ plan (plan.json) → run → report. The pure core (costs, solve, schedules, simulate, predict, plan,
report) never imports torch.
"""

__version__ = "0.1.0"
