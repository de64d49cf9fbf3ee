"""``bench.search_time --published``: how long the search of every published row takes, with its robustness.

Each row of ``bench.published_rows`` is searched as docs/published_runs.md searches it (``--tp auto
--dp auto --dp-mode auto --recompute auto``, sequence parallelism auto, memory capped at the GPU's, on
costs estimated for the published GPU), in a fresh process per row and tree: the costs are estimated
first, then the search (``plan_on_costs``: the search, the polishing, the baselines) is timed alone.
A search longer than the timeout is stopped and said so. The table goes between the markers of
docs/search_time.md.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import DOCS, ROOT, cpu_model, host, table, write_between_markers

BEGIN = "<!-- published searches: begin (bench.search_time --published) -->"
END = "<!-- published searches: end -->"


def published_child(key: str) -> dict[str, Any]:
    """Estimate one row's costs and time its search alone (run in a fresh process): what was measured.

    Args:
        key: the row's key.

    Returns:
        Seconds of the costs and of the search, the layouts evaluated and in all, the result, the
        choice's step change on slower hardware and the robustness warning (empty where it holds).
    """
    import planner.core.layout.search as search_module
    from bench.common import base_request, plan_on_costs, search_update
    from bench.published_rows import published_runs
    from planner.api import estimated_costs
    from planner.capture.load import load_model_file
    from planner.errors import PlannerError

    row = next(r for r in published_runs() if r.key == key)
    base = base_request(row, Path(tempfile.gettempdir()))  # the plan is never written
    mf = load_model_file(base.model_file, base.size, base.overrides)
    t0 = time.perf_counter()
    costs = estimated_costs(mf, base, 1)
    t_costs = time.perf_counter() - t0
    counted: dict[str, Any] = counting_search(search_module)
    t0 = time.perf_counter()
    try:
        plan = plan_on_costs(
            base.model_copy(update=search_update(base)),
            costs,
            mf,
            created="bench",
            memory_limit_bytes=costs.memory_bytes,
            jobs=_jobs(),
        )
    except PlannerError as e:
        return {"costs_s": t_costs, "search_s": time.perf_counter() - t0, "result": f"error: {e}"[:160], **counted}
    t_search = time.perf_counter() - t0
    return {"costs_s": t_costs, "search_s": t_search, "result": _result(plan), **_robustness(plan), **counted}


def counting_search(search_module: Any) -> dict[str, int]:
    """Count what a tree's search does, from the next search on: {"layouts": enumerated (the last
    search's), "evaluated": solved and simulated (all searches')}. A tree whose search counts its
    evaluations itself (``_Outcome.evaluated``: its worker processes do not see this process's
    functions) is read; an older tree's evaluation function is wrapped.

    Args:
        search_module: the tree's ``planner.core.layout.search``.

    Returns:
        The counts, updated as its searches run.
    """
    counted = {"evaluated": 0, "layouts": 0}
    evaluate_all, evaluate_modes = search_module._evaluate_all, search_module.evaluate_modes
    counts_itself = "evaluated" in getattr(search_module._Outcome, "__dataclass_fields__", {})

    def counting_all(*a: Any, **k: Any) -> Any:
        outcome = evaluate_all(*a, **k)
        counted["layouts"] = outcome.layouts
        counted["evaluated"] += outcome.evaluated if counts_itself else 0
        return outcome

    def counting_modes(*a: Any, **k: Any) -> Any:
        counted["evaluated"] += 1
        return evaluate_modes(*a, **k)

    search_module._evaluate_all = counting_all
    if not counts_itself:
        search_module.evaluate_modes = counting_modes
    return counted


def _jobs() -> int | None:
    """The worker processes ``planner plan`` starts by default on this machine (None where the measured
    tree's planner has none)."""
    try:
        from planner.workers import default_jobs
    except ImportError:
        return None
    return default_jobs()


def _result(plan: Any) -> str:
    """The plan's layout and step in one phrase."""
    lay = f"dp {plan.dp} ({plan.dp_mode}{' per block' if plan.fsdp_units == 'block' else ''}), " if plan.dp > 1 else ""
    lay += f"tp {plan.tp}{' sp' if plan.sequence_parallel else ''}, " if plan.tp > 1 else ""
    lay += f"cp {plan.cp}{' (ring)' if plan.cp_attention == 'ring' else ''}, " if plan.cp > 1 else ""
    passes = f", k {plan.accumulation}" if plan.accumulation > 1 else ""
    return (
        f"{lay}pp {plan.n_ranks}, {plan.schedule}, m {plan.n_microbatches}, v {plan.stages_per_rank}{passes}: "
        f"step {plan.prediction.step_time_s:.3g} s"
    )


def _robustness(plan: Any) -> dict[str, str]:
    """The choice's slowed step change and the warning, where this tree's planner has them (else "")."""
    try:
        from planner.core.layout.robust import chosen_row
        from planner.report.robustness import robust_line, slowed_cell
    except ImportError:  # a tree from before the robustness column
        return {"slowed": "", "warning": ""}
    k = chosen_row(plan)
    return {"slowed": slowed_cell(plan.search[k]) if k is not None else "", "warning": robust_line(plan)}


def _measure(key: str, source: Path, timeout_s: float, script: Path) -> dict[str, Any]:
    """One row's child process on ``source``'s planner (stopped after ``timeout_s``)."""
    env = {**os.environ, "PYTHONPATH": f"{source}{os.pathsep}{ROOT}", "PYTHONDONTWRITEBYTECODE": "1"}
    # by path: with the tree first on the path, its planner is the one imported; the bench is this one
    argv = [sys.executable, str(script), "--published-child", key]
    t0 = time.perf_counter()
    try:
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {"search_s": None, "result": f"stopped after {timeout_s:.0f} s", "wall_s": time.perf_counter() - t0}
    if done.returncode != 0:
        return {"search_s": None, "result": f"failed: {(done.stderr.strip().splitlines() or ['?'])[-1][:120]}"}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


HEADERS = ["row", "model", "GPUs", "search s", "before s", "layouts evaluated / in all", "choice", "slowed", "robust?"]


def time_published(
    only: str, before: Path | None, timeout_s: float, script: Path, out: Path = DOCS / "search_time.md"
) -> None:
    """Time every published row's search (and ``before``'s, row by row beside it), write the table
    between the markers of ``out``.

    Args:
        only: the rows whose key starts with one of these, comma-separated ("": all).
        before: another tree whose planner is timed beside this one (None: this one only).
        timeout_s: seconds a search may take before it is stopped.
        script: ``bench/search_time.py``, run as each row's child.
        out: the page (``--out``; docs/search_time.md by default).
    """
    from bench.published_rows import published_runs

    rows = []
    for row in published_runs():
        if not any(row.key.startswith(prefix) for prefix in only.split(",")):
            continue
        old = _measure(row.key, before, timeout_s, script) if before is not None else None
        new = _measure(row.key, ROOT, timeout_s, script)
        rows.append(
            [
                row.key,
                row.model,
                f"{row.gpus:,} {row.gpu}",
                _seconds(new),
                _seconds(old) if old is not None else "-",
                f"{new.get('evaluated', '?')} / {new.get('layouts', '?')}",
                str(new["result"]).replace("|", "/"),
                new.get("slowed", "") or "-",
                new.get("warning", "") or ("holds" if new.get("slowed") else "-"),
            ]
        )
        print(" | ".join(rows[-1]), flush=True)
    when = (
        f"Measured by `python -m bench.search_time --published` on {dt.date.today().isoformat()} ({host()}, "
        f"{cpu_model() or platform.processor() or 'unknown CPU'}, Python {platform.python_version()}; the machine "
        "shared with other jobs, so the times are noisy upper bounds)"
        # the tree by its directory's name (a checkout named for its commit), not where it sat
        + (f', beside the planner of `{before.name}` ("before s"), row by row' if before is not None else "")
        + '. "slowed": the choice\'s step with collectives 1.3x and compute 1.1x slower; "robust?": whether '
        "it still wins among the plan's search rows then, else the robust runner-up."
    )
    write_between_markers(out, BEGIN, END, f"{when}\n\n{table(rows, HEADERS)}")


def _seconds(got: dict[str, Any]) -> str:
    """A row's search seconds, or why there are none."""
    if got.get("search_s") is None or str(got.get("result", "")).startswith("error"):
        return str(got.get("result", "?"))[:80]
    return f"{got['search_s']:.1f}"


__all__ = ["BEGIN", "END", "HEADERS", "published_child", "time_published"]
