"""bench.published_runs's rows and page: the FLOP conventions by hand, every row's source and GPU spec,
and the page's errors recomputed from its own columns (pure and fast: no planning)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench.published_rows import (
    CONVENTIONS,
    NOT_COMPARED,
    figure_at,
    megatron96,
    palm,
    published_runs,
    published_step_s,
)
from planner.core.levers.hardware import GPUS

PAGE = Path(__file__).resolve().parents[1] / "docs" / "published_runs.md"


def test_megatron_formula_by_hand() -> None:
    """GPT 1.7B of Megatron-LM's Table 1: B 512, s 2048, l 24, h 2304, V 51,200.

    96 B s l h^2 = 96 x 512 x 2048 x 24 x 5,308,416 = 1.282472e16; (1 + s/6h + V/16lh) = 1 + 2048/13,824
    + 51,200/884,736 = 1 + 0.148148 + 0.057870 = 1.206019; the product 1.546683e16 FLOPs a step; at
    the published 137 TFLOP/s on 32 GPUs the step is 1.546683e16 / (137e12 x 32) = 3.5280 s.
    """
    row = next(r for r in published_runs() if r.key == "megatron-1.7B")
    assert megatron96(row.batch, row.shape) == pytest.approx(1.546683e16, rel=1e-6)
    step = published_step_s(row, GPUS[row.gpu].peak("bf16"))
    assert step == pytest.approx(3.5280, rel=1e-4)
    assert figure_at(row, step, 0.0) == pytest.approx(137.0)  # the convention's round trip


def test_palm_formula_gives_torchtitans_published_mfu() -> None:
    """torchtitan's 405B row: 109 tokens/s per GPU is 29.0 % MFU at 989 TFLOP/s by PaLM's count
    (its docs/performance.md; torchtitan/utils.py's get_num_flop_per_token, embedding excluded), which
    the Llama 3 rows assume. 109 is rounded: +-0.5 tokens/s is +-0.13 points."""
    row = next(r for r in published_runs() if r.key == "titan-405b-128")
    per_token = palm(1, row.shape) / row.shape.seq
    assert 109 * per_token / 989e12 == pytest.approx(0.290, abs=0.0015)


def test_megascale_megatron_row_is_the_abstracts_ratio() -> None:
    """MegaScale's abstract: 55.2 % MFU, "improving the MFU by 1.34x compared to Megatron-LM": the
    Megatron-LM row is 55.2 / 1.34 = 41.19 -> 41.2 % on the same run (layout, batch, GPUs, convention)."""
    rows = {r.key: r for r in published_runs()}
    own, megatron = rows["megascale-175b"], rows["megascale-175b-megatron"]
    assert megatron.figure == 41.2
    for name in ("gpus", "tp", "pp", "batch", "shape", "unit", "convention", "request", "as_run"):
        assert getattr(megatron, name) == getattr(own, name), name


def test_every_row_names_its_source_gpu_and_convention() -> None:
    rows = published_runs()
    assert len({r.key for r in rows}) == len(rows)
    for r in rows:
        assert r.source and r.gpu_note and r.model, r.key
        assert r.gpu in GPUS, r.key
        assert r.convention in CONVENTIONS, r.key
        assert r.tp * r.pp * r.dp * r.cp == r.gpus, r.key
        assert (r.unit == "tokens/s") == (r.convention == "tokens"), r.key
    for run, source, figures, why in NOT_COMPARED:
        assert run and source and figures and why


def _table(text: str, heading: str) -> list[dict[str, str]]:
    """The first markdown table after ``heading``, as dicts by header."""
    lines = text.split(heading, 1)[1].splitlines()
    rows = [line for line in lines if line.startswith("|")]
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    block = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        block.append([c.strip() for c in line.strip("|").split("|")])
    assert rows
    headers, body = block[0], block[2:]
    return [dict(zip(headers, cells)) for cells in body]


def _number(cell: str) -> float:
    return float(cell.replace(",", "").rstrip("%"))


def test_page_errors_follow_from_its_own_columns() -> None:
    text = PAGE.read_text()
    assert "Written whole by `python -m bench.published_runs`" in text and "at commit" in text
    assert "Stale since" not in text
    rows = _table(text, "## Headline")
    assert len(rows) == len(published_runs())
    errors: dict[str, list[float]] = {"within": [], "as_run": []}
    for r in rows:
        published = _number(r["published"])
        for column, error_column, variant in (
            ("within memory", "error", "within"),
            ("as run", "error (as run)", "as_run"),
        ):
            if r[column] == "—":
                continue
            shown = _number(r[error_column])
            # the cells are rounded: the error shown to 0.05 points, the figure to half its last digit
            # (which, on a small published figure, moves the error by more than that)
            cell = r[column].replace(",", "")
            half = 0.5 * 10.0 ** -(len(cell.split(".")[1]) if "." in cell else 0)
            tolerance = 0.1 + 100 * half / published
            assert 100 * (_number(r[column]) / published - 1) == pytest.approx(shown, abs=tolerance), r["row"]
            errors[variant].append(shown)
    for variant, name in (("within", "Within memory (the headline), every row"), ("as_run", "As run, every row")):
        match = re.search(re.escape(name) + r": mean \|error\| \*\*([\d.]+) %\*\* over (\d+) rows, \*\*(\d+) of", text)
        assert match, name
        errs = errors[variant]
        assert int(match.group(2)) == len(errs)
        assert float(match.group(1)) == pytest.approx(sum(abs(e) for e in errs) / len(errs), abs=0.1)
        assert int(match.group(3)) == sum(abs(e) <= 15.0 for e in errs)
