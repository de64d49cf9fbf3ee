"""What each parallelism and memory lever costs, in time and memory.

- ``links``: the link of each stage boundary (one, per boundary, or per node).
- ``hardware``: the accelerator table and its link costs.
- ``data_parallel``: replicas of the pipeline: DDP, FSDP and HSDP traffic, links and memory.
- ``tensor_parallel``: one tensor-parallel rank's share of a block and its collectives.
- ``recompute``: a stage's checkpoint regions: what each recompute mode re-runs and keeps.
- ``partial_recompute``: under ``--recompute auto``, the fewest of a stage's regions that fit.
- ``casts``: autocast's weight copies: which stages share one set a step, which hold none.
"""
