# Two entry points for a fresh machine (see README): `make demo` and `make test` (lint, types, tests).
# `make check` is the inner loop: lint, types and the tests that need no second process and run fast.
# Both build their own virtual environment; torch is pinned to the CPU wheel that installs offline
# here (an unpinned torch would pull a multi-GB CUDA build).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0

.PHONY: demo test check lint clean

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

# --durations: the log names the slowest tests, where CI's time goes
test: lint
	$(PY) -m pytest -q --durations=30

check: lint
	$(PY) -m pytest -q -m "not multiprocess and not slow" -p no:cacheprovider

clean:
	rm -rf $(VENV) plan.json plan.run.json plan.ckpt
