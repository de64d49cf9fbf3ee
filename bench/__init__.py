"""The benchmarks behind the figures in docs/: one script per page, run from the repository root.

    python -m bench.NAME --help

``bench.common`` holds what the scripts share (paths, commands, page writing, tables, the tiny-GPT
request) and ``bench.cases`` the planned-and-run cases of the two accuracy benches; a script too long
for one module keeps its entry and ``main`` and moves the rest to helper modules of its own
(``bench.accuracy_blocks`` and ``bench.accuracy_splits`` for ``bench.cost_accuracy``; ``bench.seed_run``,
``seed_text``, ``seed_pages`` and ``seed_resnet`` for ``bench.seed_systems``). ``bench/models/`` holds
model files that only the benches plan. No script imports another.
"""
