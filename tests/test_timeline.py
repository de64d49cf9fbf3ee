"""Pure-tier tests of planner.report.timeline: the step picture and the Chrome trace."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from matplotlib.axes import Axes
from matplotlib.patches import Rectangle
from matplotlib.text import Text

from planner.core.step.simulate import Event, StageTimes, simulate
from planner.errors import PlannerError
from planner.report.timeline import build_figure, chrome_trace, timeline_figure, write_trace

PNG = b"\x89PNG\r\n\x1a\n"


def _one_f_one_b() -> list[Event]:
    return simulate([(1.0, 2.0)] * 2, "1f1b", 4).events


def _zbv() -> list[Event]:
    return simulate([StageTimes(1.0, 2.0, 1.0, 1.0)] * 4, "zbv", 4, stages_per_rank=2).events


def _stretched(events: list[Event], factor: float) -> list[Event]:
    return [e.model_copy(update={"start_s": e.start_s * factor, "end_s": e.end_s * factor}) for e in events]


def _boxes(ax: Axes) -> list[Rectangle]:
    return [p for p in ax.patches if isinstance(p, Rectangle)]


def test_png_is_written_atomically(tmp_path: Path) -> None:
    out = tmp_path / "step.png"
    timeline_figure(_one_f_one_b(), 2, out, title="1f1b")
    data = out.read_bytes()
    assert data.startswith(PNG) and len(data) > 5000
    assert [p.name for p in tmp_path.iterdir()] == ["step.png"]  # no temporary file left behind
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~_umask()  # not mkstemp's 0600


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@pytest.mark.slow
def test_measured_panel_and_other_formats(tmp_path: Path) -> None:
    out = tmp_path / "zbv.png"
    timeline_figure(_zbv(), 2, out, measured=_stretched(_zbv(), 1.1))
    assert out.read_bytes().startswith(PNG)
    timeline_figure(_zbv(), 2, tmp_path / "zbv.svg", measured=_stretched(_zbv(), 1.1))
    assert "<svg" in (tmp_path / "zbv.svg").read_text()[:2000]
    timeline_figure(_zbv(), 2, tmp_path / "zbv.PDF")
    assert (tmp_path / "zbv.PDF").read_bytes().startswith(b"%PDF")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["zbv.PDF", "zbv.png", "zbv.svg"]


def test_replacing_a_picture_keeps_its_permissions(tmp_path: Path) -> None:
    out = tmp_path / "step.png"
    out.write_bytes(b"old")
    out.chmod(0o640)
    timeline_figure(_one_f_one_b(), 2, out)
    assert out.read_bytes().startswith(PNG)
    assert stat.S_IMODE(out.stat().st_mode) == 0o640


def test_every_action_is_one_box_in_its_panel() -> None:
    predicted = _zbv()
    measured = predicted[:-3]
    fig = build_figure(predicted, 2, measured=measured)
    axes = fig.get_axes()
    assert len(axes) == 2
    boxes = [_boxes(ax) for ax in axes]
    assert [len(b) for b in boxes] == [len(predicted), len(measured)]
    # each box spans its action: x from start to end, rank 0 on the top row (y = n_ranks - 1 - rank)
    for box, e in zip(boxes[0], predicted):
        assert (box.get_x(), box.get_x() + box.get_width()) == pytest.approx((e.start_s, e.end_s))
        assert box.get_y() + box.get_height() / 2 == pytest.approx(1 - e.rank)
    assert len({box.get_facecolor() for box in boxes[0]}) == 3  # F, I and W in three colours
    # the makespan is in the panel's title (F = I = W = 1 s: 4 mb x 2 stages x 3 s + 1 s of fill)
    assert axes[0].get_title() == "predicted pipeline: 25 s"
    assert axes[1].get_title().startswith("measured pipeline: ")
    # two stages per rank: the labels name the stage and the microbatch
    labels = {t.get_text() for t in axes[0].texts}
    assert {"s0·0", "s3·0", "s1·3"} <= labels


def test_shared_axis_shows_the_longer_step() -> None:
    """Regression: each panel used to set its own x limit, and the last one (measured) won."""
    predicted = _zbv()  # 25 s
    fig = build_figure(predicted, 2, measured=_stretched(predicted, 0.8))  # 20 s
    top, bottom = fig.get_axes()
    assert top.get_xlim() == bottom.get_xlim()
    assert top.get_xlim()[1] >= 25
    fig = build_figure(predicted, 2, measured=_stretched(predicted, 1.2))  # 30 s
    assert fig.get_axes()[0].get_xlim()[1] >= 30


def test_time_unit_follows_the_magnitude() -> None:
    fig = build_figure(simulate([(1e-3, 2e-3)] * 2, "gpipe", 2).events, 2)
    ax = fig.get_axes()[0]
    assert ax.get_xlabel() == "time (ms)"
    assert ax.get_title() == "predicted pipeline: 9 ms"  # (m + p - 1)(F + B) = 3 x 3 ms
    assert max(b.get_x() + b.get_width() for b in _boxes(ax)) == pytest.approx(9.0)
    one_stage_labels = {t.get_text() for t in ax.texts}
    assert one_stage_labels == {"0", "1"}  # one stage per rank: just the microbatch


def test_labels_are_left_out_of_boxes_too_narrow_for_them() -> None:
    events = simulate([(1e-3, 2e-3)] * 2, "gpipe", 64).events
    fig = build_figure(events, 2)
    ax = fig.get_axes()[0]
    assert len(_boxes(ax)) == len(events)
    assert all(isinstance(t, Text) for t in ax.texts) and len(ax.texts) < len(events)


def test_bad_inputs_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(PlannerError, match=r"--timeline .*step\.txt: cannot write a \.txt picture") as err:
        timeline_figure(_one_f_one_b(), 2, tmp_path / "step.txt")
    assert "\n" not in str(err.value)
    with pytest.raises(PlannerError, match="--timeline .*: cannot write a suffix-less picture"):
        timeline_figure(_one_f_one_b(), 2, tmp_path / "step")
    with pytest.raises(PlannerError, match="--timeline: the plan's step has no actions"):
        timeline_figure([], 2, tmp_path / "step.png")
    with pytest.raises(PlannerError, match="--timeline: the run recorded no actions"):
        timeline_figure(_one_f_one_b(), 2, tmp_path / "step.png", measured=[])
    with pytest.raises(PlannerError, match=r"--timeline: predicted actions on rank\(s\) 1, but .* ranks 0\.\.0"):
        timeline_figure(_one_f_one_b(), 1, tmp_path / "step.png")
    with pytest.raises(PlannerError, match="cannot write .*: No such file.*; choose a writable path with --timeline"):
        timeline_figure(_one_f_one_b(), 2, tmp_path / "missing" / "step.png")
    assert not list(tmp_path.iterdir())


def test_a_link_or_folder_is_never_replaced(tmp_path: Path) -> None:
    target = tmp_path / "kept.png"
    target.write_bytes(b"kept")
    link = tmp_path / "link.png"
    link.symlink_to(target)
    with pytest.raises(PlannerError, match="cannot write .*link.png: it is a symbolic link.*with --timeline"):
        timeline_figure(_one_f_one_b(), 2, link)
    assert link.is_symlink() and target.read_bytes() == b"kept"
    (tmp_path / "dir.png").mkdir()
    with pytest.raises(PlannerError, match="cannot write .*dir.png: it is a folder.*with --timeline"):
        timeline_figure(_one_f_one_b(), 2, tmp_path / "dir.png")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.png", "kept.png", "link.png"]


def test_chrome_trace_events(tmp_path: Path) -> None:
    predicted = _one_f_one_b()
    measured = _stretched(predicted, 1.5)
    trace = chrome_trace(predicted, measured=measured, name="1f1b")
    assert trace["displayTimeUnit"] == "ms"
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == 2 * len(predicted)
    assert len([e for e in complete if e["pid"] == 1]) == len(measured)
    first = next(e for e in complete if e["pid"] == 0 and e["tid"] == 1 and e["name"] == "B 0")
    ev = next(e for e in predicted if e.rank == 1 and e.kind == "B" and e.microbatch == 0)
    assert first["ts"] == ev.start_s * 1e6 and first["dur"] == (ev.end_s - ev.start_s) * 1e6
    assert (first["ts"], first["dur"]) == (2e6, 2e6)  # F0 on rank 0 then rank 1 (1 s each), then B0: 2 s
    assert first["cat"] == "B" and first["args"] == {"stage": 1, "microbatch": 0, "kind": "B"}
    again = next(e for e in complete if e["pid"] == 1 and e["tid"] == 1 and e["name"] == "B 0")
    assert again["ts"] == pytest.approx(3e6)  # the measured copy is 1.5x slower
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {(0, 0): "rank 0", (0, 1): "rank 1", (1, 0): "rank 0", (1, 1): "rank 1"}
    processes = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert processes == ["predicted", "measured"]
    assert all(e["ph"] in ("M", "X") for e in trace["traceEvents"])
    out = tmp_path / "trace.json"
    write_trace(out, trace)
    assert json.loads(out.read_text()) == trace
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json"]


def test_trace_names_the_stage_when_a_rank_holds_several() -> None:
    trace = chrome_trace(_zbv())
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert "F 0 (stage 3)" in names and "W 3 (stage 0)" in names
    assert len([e for e in trace["traceEvents"] if e["ph"] == "X"]) == len(_zbv())
    assert {e["pid"] for e in trace["traceEvents"]} == {0}  # no measured process without a run


def test_trace_errors_name_the_option(tmp_path: Path) -> None:
    with pytest.raises(PlannerError, match="--trace: the plan's step has no actions"):
        chrome_trace([])
    with pytest.raises(PlannerError, match="--trace: the run recorded no actions"):
        chrome_trace(_zbv(), measured=[])
    (tmp_path / "dir.json").mkdir()
    with pytest.raises(
        PlannerError, match=r"cannot write .*dir\.json: it is a folder.*; choose a writable path with --trace$"
    ):
        write_trace(tmp_path / "dir.json", chrome_trace(_zbv()))
