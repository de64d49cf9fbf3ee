"""One pipeline split: which blocks each stage holds, what each stage costs, and the best such split.

- ``solve``: the exact partition solver (``solve``), its memory model and its errors.
- ``solve_engine``: the vectorised dynamic programme ``solve`` runs over block ranges.
- ``range_sums``: prefix sums and range maxima giving any block range's memory terms in O(1).
- ``stage_model``: what one stage of a split costs per microbatch and holds (``evaluate``), shared
  by the solver, the baselines, the prediction and the search.
- ``stage_plans``: a split laid out on its ranks (``laid_out``, ``StageMemo``): each stage's
  ``StagePlan`` and each rank's peak memory.
- ``baselines``: equal layer counts (torchtitan, Megatron) and parameter-balanced (DeepSpeed).
- ``given``: a split the user already runs (``--compare SPLIT``), as stage starts.
"""
