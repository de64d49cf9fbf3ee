"""The pure core: schedules, simulation, the solver, predictions and the calibration fit.

Owns: ``schedules`` (per-rank action orders, as torch executes them), ``simulate`` (one step as
discrete events), ``solve`` (exact partition and the baselines), ``predict`` (stage figures and the
step prediction), ``assemble`` (costs + request -> Plan), ``calibrate`` (fit a run's measurements),
``hardware`` (the accelerator table and link costs), ``data_parallel`` (replicas of the pipeline:
the gradient reduction's links and time).

May import: ``planner.errors``, ``planner.schema``, pydantic. Never torch, never the effectful
packages (capture, costs, run): ``tests/test_layout.py`` checks it.
"""
