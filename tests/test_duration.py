"""A measured profile that will take minutes is said up front, with the quicker choices."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

import planner.costs.duration as duration
from cli import main
from planner.costs.duration import duration_advice, profile_seconds

ROOT = Path(__file__).resolve().parents[1]


def test_the_prediction_counts_forwards_per_run() -> None:
    # 40 forwards, 18 per run of the block profile (2 + 5 runs) and 4.5 per run of the size fit
    # (2 + max(3, 5) runs)
    assert profile_seconds(2.0, 2, 5, fits_sizes=False) == pytest.approx(2.0 * (40 + 18 * 7))
    assert profile_seconds(2.0, 2, 5, fits_sizes=True) == pytest.approx(2.0 * (40 + 18 * 7) + 2.0 * 4.5 * 7)
    assert profile_seconds(2.0, 0, 1, fits_sizes=True) == pytest.approx(2.0 * (40 + 18) + 2.0 * 4.5 * 3)


def test_a_short_profile_says_nothing() -> None:
    assert (
        duration_advice(0.05, warmup=2, repeats=5, fits_sizes=True, n_blocks=6, microbatch_size=8, device="cpu") is None
    )


def test_a_long_profile_says_how_long_and_the_quicker_choices() -> None:
    line = duration_advice(41.3, warmup=2, repeats=5, fits_sizes=True, n_blocks=14, microbatch_size=8, device="cpu")
    assert line is not None
    assert line.startswith("measuring 14 blocks on the cpu will take about 2.3 h (one forward of a microbatch")
    assert "--gpu-type cpu (seconds" in line
    assert "--repeats 1 (about 80 min: noisier times)" in line
    assert "about 17 min at 1 sample per microbatch" in line
    # nothing to offer that is already chosen
    one = duration_advice(30.0, warmup=0, repeats=1, fits_sizes=False, n_blocks=3, microbatch_size=1, device="cpu")
    assert one is not None and "--repeats 1" not in one and "--microbatches" not in one
    assert "about 29 min" in one  # 30 s x (40 + 18)


def test_planner_plan_says_it_before_the_profile(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Said on stderr in a log too (not only on a terminal), and never under -q."""
    monkeypatch.setattr(duration, "LONG_S", 0.0)  # every profile counts as long
    model = str(ROOT / "models" / "toy.py")
    out = str(tmp_path / "plan.json")
    result = CliRunner().invoke(main, ["plan", model, "--gpus", "2", "--repeats", "1", "-o", out])
    assert result.exit_code == 0, result.output
    said = [line for line in result.stderr.splitlines() if line.startswith("measuring ")]
    assert len(said) == 1 and "blocks on the cpu will take about" in said[0]
    assert "measuring" not in result.stdout  # the report stays clean
    quiet = CliRunner().invoke(main, ["plan", model, "--gpus", "2", "--repeats", "1", "-q", "-o", out])
    assert quiet.exit_code == 0 and "measuring" not in quiet.output
