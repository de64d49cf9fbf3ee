"""The pure core: from block costs and a request's records to a plan, with no torch.

Four rooms, each a sub-package with its own face (its ``__init__`` names what it owns):

- ``split``: one pipeline split of the blocks into stages: the exact solver (``solve``), the stage
  cost and memory model it shares with everything else (``stage_model``), the splits other tools
  choose (``baselines``) or the user gives (``given``), a split laid out on its ranks
  (``stage_plans``).
- ``step``: one training step in time: each torch schedule's action order (``schedules``), the
  discrete-event simulation (``simulate``), a laid-out split's prediction (``predict``), and a run's
  measurements fitted back into the costs (``calibrate``).
- ``layout``: the joint search over layouts (``search``), the records that travel into it
  (``inputs``), one candidate (``candidate``), the floors it prunes with (``bounds``), several
  stages per rank fitted to memory (``rank_fit``).
- ``levers``: what each parallelism and memory lever costs: links, hardware, data and tensor
  parallelism, recomputation (whole and partial) and autocast's weight copies.

At the top: ``assemble`` (costs + request -> Plan, the core's entry) and ``heap`` (the garbage
collector paused while a large structure is built).

May import: ``planner.errors``, ``planner.schema``, pydantic, numpy. Never torch, never the
effectful packages (capture, costs, run): ``tests/test_layout.py`` checks it.
"""
