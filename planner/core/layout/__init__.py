"""The layout search: tensor parallelism x replicas x schedule x microbatches x stages per rank x split.

- ``inputs``: the records that travel together (``Cluster``, ``Layout``, ``Constraints``,
  ``Scaling``, ``SearchSpace``).
- ``search``: the joint search (``search``), least predicted step that fits.
- ``candidate``: one layout solved and predicted, under a data-parallel mode that may still be open.
- ``bounds``: lower bounds on a layout's step and per-rank memory, what the search prunes with.
- ``pending``: the search's queue of layouts with their floors, and the next of them handed to a
  pool of worker processes together (``Pool``, given by ``planner.workers`` at the edge).
- ``rank_fit``: with several stages per rank, the split whose every rank fits the memory limit.
"""
