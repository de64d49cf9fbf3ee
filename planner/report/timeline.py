"""One pipeline step as a picture and as Chrome / Perfetto trace events.

Owns the timeline views of a step: ``timeline_figure`` (a picture with one row per rank and a box
per action, the idle time between boxes being the bubbles; the measured step in a second panel
under the predicted one), ``build_figure`` (that figure, not yet written) and ``chrome_trace`` /
``write_trace`` (the same actions as trace-event JSON for ``chrome://tracing`` or
https://ui.perfetto.dev).

Pure module: matplotlib through its object API with the Agg canvas (no ``pyplot``, no global
state, no display), the standard library, never torch. The input is a list of
``planner.core.step.simulate.Event``: the predicted step (``planner.core.step.predict.simulate_plan``) and,
optionally, the step a run recorded (``planner.report.compare.measured_events``).
``planner report PLAN --timeline step.png --trace step.json`` calls these.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from planner.core.step.simulate import Event
from planner.errors import PlannerError
from planner.schema.jsonfile import write_atomic

COLOURS = {"F": "#4C72B0", "B": "#DD8452", "I": "#C44E52", "W": "#55A868"}
"""Forward, full backward, input-gradient and weight-gradient actions (any other kind is grey)."""

NAMES = {"F": "forward", "B": "backward", "I": "backward (inputs)", "W": "backward (weights)"}

IMAGE_FORMATS = ("png", "svg", "pdf")
"""What ``--timeline`` writes (and what ``check_output`` recognises as an earlier picture to replace)."""
"""Suffixes ``--timeline`` writes: matplotlib's Agg canvas formats that are pictures (not raw
pixel dumps, not PGF, which needs LaTeX)."""

FIG_WIDTH_IN = 12.0
AXES_WIDTH_IN = FIG_WIDTH_IN - 1.3  # less the rank labels and margins: what the boxes span
LABEL_PT = 7.0
DPI = 120


def _unit(span_s: float) -> tuple[float, str]:
    """Scale and label of the time axis for a step of ``span_s`` seconds."""
    if span_s >= 2.0:
        return 1.0, "s"
    if span_s >= 2e-3:
        return 1e3, "ms"
    return 1e6, "µs"


def _several_stages(events: Sequence[Event]) -> bool:
    """Whether some rank runs more than one stage (then labels name the stage too)."""
    ranks: dict[int, set[int]] = {}
    for e in events:
        ranks.setdefault(e.rank, set()).add(e.stage)
    return any(len(s) > 1 for s in ranks.values())


def _panels(predicted: Sequence[Event], measured: Sequence[Event] | None, option: str) -> list[tuple[str, list[Event]]]:
    """The panels to show, checked: ``[("predicted", ...), ("measured", ...)]``.

    Raises:
        PlannerError: no predicted actions, or a measured list that is given but empty.
    """
    if not predicted:
        raise PlannerError(f"{option}: the plan's step has no actions to draw")
    panels = [("predicted", list(predicted))]
    if measured is not None:
        if not measured:
            raise PlannerError(
                f"{option}: the run recorded no actions (a run of under 2 steps records none); "
                "run more --steps, or leave the run out to show only the prediction"
            )
        panels.append(("measured", list(measured)))
    for name, events in panels:
        for e in events:
            if not (math.isfinite(e.start_s) and math.isfinite(e.end_s) and e.end_s >= e.start_s):
                raise PlannerError(
                    f"{option}: {name} action {e.kind}{e.microbatch} on rank {e.rank} has times "
                    f"{e.start_s}..{e.end_s} s; expected finite times with end >= start"
                )
    return panels


def _check_ranks(panels: list[tuple[str, list[Event]]], n_ranks: int) -> None:
    """Refuse ranks the picture has no row for."""
    if n_ranks < 1:
        raise PlannerError(f"--timeline: {n_ranks} ranks; need at least one row to draw")
    for name, events in panels:
        bad = sorted({e.rank for e in events if not 0 <= e.rank < n_ranks})
        if bad:
            raise PlannerError(
                f"--timeline: {name} actions on rank(s) {', '.join(map(str, bad))}, but the pipeline has "
                f"ranks 0..{n_ranks - 1}; is the run of this plan?"
            )


def _row_in(n_ranks: int) -> float:
    """Height of one rank's row in inches: 0.4 up to 16 ranks, then shrinking (at least 0.1)."""
    return 0.4 if n_ranks <= 16 else max(0.1, 6.4 / n_ranks)


def _label(e: Event, several: bool) -> str:
    return f"s{e.stage}·{e.microbatch}" if several else str(e.microbatch)


def _fits(label: str, box_pt: float, row_pt: float) -> bool:
    """Whether ``label`` fits in a box ``box_pt`` points wide, in a row ``row_pt`` points high."""
    return row_pt >= 1.3 * LABEL_PT and box_pt >= 0.62 * LABEL_PT * len(label) + 3


def _draw(ax: Axes, events: Sequence[Event], n_ranks: int, scale: float, span_s: float, several: bool) -> None:
    """One panel: a row per rank (rank 0 on top), a box per action, the idle time left blank."""
    pt_per_s = AXES_WIDTH_IN * 72 / span_s if span_s > 0 else 0.0
    row_pt = 0.8 * _row_in(n_ranks) * 72
    for e in events:
        y = n_ranks - 1 - e.rank
        box_pt = (e.end_s - e.start_s) * pt_per_s
        rect = Rectangle(
            (e.start_s * scale, y - 0.4),
            (e.end_s - e.start_s) * scale,
            0.8,
            facecolor=COLOURS.get(e.kind, "#8C8C8C"),
            edgecolor="white",
            linewidth=0.5 if box_pt >= 4 else 0.0,  # white edges would wash out boxes this narrow
        )
        ax.add_patch(rect)
        label = _label(e, several)
        if _fits(label, box_pt, row_pt):
            mid = (e.start_s + e.end_s) / 2 * scale
            ax.text(mid, y, label, ha="center", va="center", fontsize=LABEL_PT, color="white", clip_on=True)
    ax.set_ylim(-0.6, n_ranks - 0.4)
    ax.set_yticks(range(n_ranks))
    ax.set_yticklabels([f"rank {r}" for r in reversed(range(n_ranks))])
    ax.tick_params(axis="y", length=0)


def build_figure(
    predicted: Sequence[Event], n_ranks: int, *, measured: Sequence[Event] | None = None, title: str = ""
) -> Figure:
    """The timeline figure (predicted on top, measured below when given), not yet written.

    Args:
        predicted: the predicted step's events (``simulate(...).events``).
        n_ranks: ranks of the pipeline: one row each, rank 0 on top.
        measured: a run's recorded events of one step (times from the step's start), or None.
        title: the figure's title ("" for none).

    Returns:
        The matplotlib figure on an Agg canvas: one axis per panel sharing the time axis, each
        holding exactly one ``Rectangle`` patch per event and titled with its makespan.

    Raises:
        PlannerError: no predicted events, a measured list given empty, an event on a rank
            outside ``0 .. n_ranks - 1``, or non-finite or negative durations.
    """
    panels = _panels(predicted, measured, "--timeline")
    _check_ranks(panels, n_ranks)
    span = max(e.end_s for _, events in panels for e in events)
    scale, unit = _unit(span)
    several = any(_several_stages(events) for _, events in panels)
    heights = [0.45 + _row_in(n_ranks) * n_ranks for _ in panels]
    fig = Figure(figsize=(FIG_WIDTH_IN, 1.1 + sum(heights)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False, height_ratios=heights)[:, 0]
    for ax, (name, events) in zip(axes, panels):
        _draw(ax, events, n_ranks, scale, span, several)
        step = max(e.end_s for e in events)
        # the pipeline's actions only: a plan's step also holds what runs after them (the optimizer
        # step, gradient reductions), which the caller's title states
        ax.set_title(f"{name} pipeline: {step * scale:.3g} {unit}", fontsize=9)
    # shared axis: one limit for all panels, so the longer step is never cut off
    axes[-1].set_xlim(0, span * scale * 1.005 if span > 0 else 1.0)
    axes[-1].set_xlabel(f"time ({unit})")
    kinds = [k for k in COLOURS if any(e.kind == k for _, events in panels for e in events)]
    fig.legend(
        handles=[Patch(facecolor=COLOURS[k], label=NAMES[k]) for k in kinds],
        loc="outside upper right",
        ncol=max(1, len(kinds)),
        fontsize=8,
        frameon=False,
    )
    if title:
        fig.suptitle(title, x=0.01, ha="left", fontsize=10)
    return fig


def _image_format(path: Path) -> str:
    """The format the suffix names; a PlannerError unless matplotlib writes it as a picture."""
    fmt = path.suffix.lower().lstrip(".")
    writable = FigureCanvasAgg(Figure()).get_supported_filetypes()
    if fmt not in IMAGE_FORMATS or fmt not in writable:
        shown = f"a .{fmt}" if fmt else "a suffix-less"
        raise PlannerError(
            f"--timeline {path}: cannot write {shown} picture; end the name in .png, .svg or .pdf, "
            "e.g. --timeline step.png"
        )
    return fmt


def check_timeline_path(path: str | Path) -> None:
    """Refuse a ``--timeline`` name matplotlib cannot write as a picture, before anything is printed.

    Raises:
        PlannerError: the suffix names no picture format (``_image_format``).
    """
    _image_format(Path(path))


def timeline_figure(
    predicted: Sequence[Event],
    n_ranks: int,
    path: str | Path,
    *,
    measured: Sequence[Event] | None = None,
    title: str = "",
) -> None:
    """Draw one step (and the measured one under it) and write the picture atomically.

    Args:
        predicted: the predicted step's events (``simulate(...).events``).
        n_ranks: ranks of the pipeline: one row each, rank 0 on top.
        path: where to write it; the suffix picks the format (.png, .svg, .pdf, and the other
            ``IMAGE_FORMATS``). An existing file is replaced; its permissions are kept.
        measured: a run's recorded events of one step (times from the step's start), or None.
        title: the figure's title ("" for none).

    Raises:
        PlannerError: a suffix matplotlib cannot write as a picture, no events (see
            ``build_figure``), a destination that is a link, folder or device, or a folder that
            cannot be written. Every message names ``--timeline``.
    """
    p = Path(path)
    fmt = _image_format(p)
    fig = build_figure(predicted, n_ranks, measured=measured, title=title)
    write_atomic(p, lambda f: fig.savefig(f, format=fmt, dpi=DPI), option="--timeline")


def _trace_process(pid: int, panel: str, events: Sequence[Event], several: bool) -> list[dict[str, Any]]:
    """One panel's trace events: its process and thread names, then an ``X`` event per action."""
    out: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": panel}},
        {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}},
    ]
    for rank in sorted({e.rank for e in events}):
        out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": rank, "args": {"name": f"rank {rank}"}})
        out.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": rank, "args": {"sort_index": rank}})
    for e in events:
        out.append(
            {
                "name": f"{e.kind} {e.microbatch}" + (f" (stage {e.stage})" if several else ""),
                "cat": e.kind,
                "ph": "X",
                "pid": pid,
                "tid": e.rank,
                "ts": e.start_s * 1e6,
                "dur": (e.end_s - e.start_s) * 1e6,
                "args": {"stage": e.stage, "microbatch": e.microbatch, "kind": e.kind},
            }
        )
    return out


def chrome_trace(
    predicted: Sequence[Event], *, measured: Sequence[Event] | None = None, name: str = "pipeline step"
) -> dict[str, Any]:
    """The step as Chrome / Perfetto trace events: one process per panel, one thread per rank.

    Args:
        predicted: the predicted step's events (``simulate(...).events``).
        measured: a run's recorded events of one step (times from the step's start), or None.
        name: the trace's label (kept under ``otherData``).

    Returns:
        ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {"name": name}}``: ``M``
        metadata naming process 0 "predicted" and 1 "measured" and each rank's thread ("rank 0",
        ...; tid = rank), then one ``X`` (complete) event per action with ``ts`` / ``dur`` in
        microseconds, ``name`` "F 3" (kind and microbatch; "F 3 (stage 5)" when a rank holds
        several stages), ``cat`` the kind and ``args`` {stage, microbatch, kind}.

    Raises:
        PlannerError: no predicted events, or a measured list given empty (naming ``--trace``).
    """
    panels = _panels(predicted, measured, "--trace")
    several = any(_several_stages(events) for _, events in panels)
    out: list[dict[str, Any]] = []
    for pid, (panel, events) in enumerate(panels):
        out.extend(_trace_process(pid, panel, events, several))
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {"name": name}}


def write_trace(path: str | Path, trace: dict[str, Any]) -> None:
    """Write trace events as JSON text, atomically (``planner.schema.jsonfile.write_atomic``).

    Args:
        path: the destination (.json; an existing file is replaced).
        trace: what ``chrome_trace`` returned.

    Raises:
        PlannerError: the destination is a link, folder or device, or cannot be written (naming
            ``--trace``).
    """
    write_atomic(path, json.dumps(trace) + "\n", option="--trace")
