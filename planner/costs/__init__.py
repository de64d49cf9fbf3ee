"""What every block costs: measured here, or estimated for hardware that is not here (torch).

Owns: ``blocks`` (the one builder from raw figures to ``BlockCost``), ``timing`` (the timers
shared by both profilers: I/W split, recompute, optimizer step), ``measure`` (graph traces: each
block cut out and timed), ``measure_modules`` (module-boundary traces: hooks on a whole-model
run), ``estimate`` (roofline over aten operators on the meta device), ``cpu`` (this CPU as a
``HardwareSpec``, micro-benchmarked and cached), ``levers`` (the speed levers the profilers apply:
``torch.autocast`` regions and ``torch.compile`` settings), ``settings`` (what the measured profilers
take: the ``Sample`` to time on and the ``ProfileSettings`` to time it with), ``backward_temps``
(what a backward allocates and frees again: the dispatch mode both profilers run it under).

May import: ``planner.errors``, ``planner.schema``, ``planner.core`` (the hardware table),
``planner.capture``, ``planner.threads``, ``planner.torch_compat``, torch.
"""
