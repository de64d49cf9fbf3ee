"""The benchmarks behind the figures in docs/: one script per page, run from the repository root.

    python -m bench.NAME --help

``bench.common`` holds what the scripts share (paths, commands, page writing, tables) and
``bench.cases`` the planned-and-run cases of the two accuracy benches; ``bench/models/`` holds model
files that only the benches plan. No script imports another.
"""
