# Two entry points for a fresh machine (see README): `make demo` and `make test` (lint, types, tests).
# `make check` is the inner loop: lint, types and the tests that need no second process and run fast.
# Both build their own virtual environment; torch is pinned to the CPU wheel that installs offline
# here (an unpinned torch would pull a multi-GB CUDA build).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
# pytest-xdist workers: one per core. Most tests are single-threaded Python (tracing, the search), so
# two workers on two cores nearly halve the suite; the multi-process tests pick free ports. Measured on
# clean clones here: 610-644 s of suite on 2026-12-04 (one VM), 1,164-1,267 s on 2026-12-06 (an AMD
# EPYC VM: 2,470 tests). Where the time goes (durations of one full run, 3,194 s of test time over
# the two workers): the gloo runs, every test starting 2-4 rank processes (expert parallelism 372 s,
# context parallelism 358 s, the shipped models 199 s, the transformers families 190 s, tensor
# parallelism 156 s); four workers instead of two ran three such files in the same 142 s, as the ranks
# already keep both cores busy.
WORKERS ?= auto

.PHONY: demo test suite check lint clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev,interop]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/planner plan models/gpt.py --gpus 2 --size tiny -o plan.json
	$(VENV)/bin/planner run plan.json --steps 10

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy --strict planner/core planner/schema planner/report planner/errors.py

# make test: the lint beside the suite, then the timing tests alone. mypy checks in one process: run
# first, it left one of the two cores idle for its 67 s here; beside the suite, the suite's workers
# use that core. A lint failure still fails `make test`, once the suite ends (`make lint` alone
# answers in about a minute).
# --durations: the log names the slowest tests, where CI's time goes; worksteal: an idle worker takes
# queued tests from a busy one, so the slow multi-process tests do not end in one worker's tail.
# The timing tests (sleeps measured to a few ms) run after, in one process: beside another worker's
# gloo ranks on these 2 cores a 35 ms sleep was measured at 43.
test: $(VENV)/.installed
	$(MAKE) --no-print-directory -j2 --output-sync=line lint suite
	$(PY) -m pytest -q -m timing -p no:cacheprovider

suite: $(VENV)/.installed
	$(PY) -m pytest -q -n $(WORKERS) --dist worksteal -m "not timing" --durations=30

check: lint
	$(PY) -m pytest -q -n $(WORKERS) --dist worksteal -m "not multiprocess and not slow and not timing" -p no:cacheprovider
	$(PY) -m pytest -q -m "timing and not multiprocess and not slow" -p no:cacheprovider

clean:
	rm -rf $(VENV) plan.json plan.run.json plan.ckpt
