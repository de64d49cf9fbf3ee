"""Shared test helpers: the repository root on sys.path and paths to model files."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import settings

# On a busy 2-core machine (CI's, with rank processes beside the test) an example's wall time says more
# about the load than about the code: no property test has a deadline (a test's own @settings still
# set its example counts).
settings.register_profile("planner", deadline=None)
settings.load_profile("planner")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `pytest` run without `python -m` or an editable install
    sys.path.insert(0, str(ROOT))

MODELS_DIR = ROOT / "models"
FIXTURES_DIR = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture
def fixture_path():
    """Path of a model file in tests/fixtures, by stem: ``fixture_path("skip")``."""
    return lambda stem: FIXTURES_DIR / f"{stem}.py"


def solve_every_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on, the search with its floors at 0 and no layout put back in line as ``Outpaced``:
    every layout is solved and ranked, none ruled out unsolved (for tests of what the ranking says of
    layouts the floors would rule out)."""
    import planner.core.layout.pending as pending

    evaluate_modes = pending.evaluate_modes
    monkeypatch.setattr(pending, "floors", lambda *args, **kwargs: (0.0, 0))
    monkeypatch.setattr(pending, "evaluate_modes", lambda *args, bound=None: evaluate_modes(*args[:4]))


@pytest.fixture
def every_layout_solved(monkeypatch: pytest.MonkeyPatch) -> None:
    """``solve_every_layout`` for the whole test."""
    solve_every_layout(monkeypatch)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tier-4 tests (marker ``cuda``) where no GPU is present."""
    if not any(item.get_closest_marker("cuda") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device on this machine")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)
