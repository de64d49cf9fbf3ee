"""Tier-2 test: ``planner.core.schedules.action_order`` matches what torch's schedules execute.

Runs the real ``ScheduleGPipe`` / ``Schedule1F1B._step_microbatches`` of the installed torch with a
mocked stage whose communication ops are empty, and records the order of
``forward_one_chunk`` / ``backward_one_chunk`` calls. Also checks torch's own schedule IR
(``_get_pipeline_order`` via ``_schedule_visualizer.get_schedule_ops``) with its idle slots removed.
"""

from __future__ import annotations

from unittest import mock

import pytest

torch = pytest.importorskip("torch")
from torch.distributed.pipelining import schedules as tsched  # noqa: E402
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops  # noqa: E402
from torch.distributed.pipelining.stage import PipelineStage  # noqa: E402

from planner.core.schedules import action_order, peak_in_flight  # noqa: E402
from planner.errors import InfeasibleError  # noqa: E402

TORCH_CLASSES = {"gpipe": tsched.ScheduleGPipe, "1f1b": tsched.Schedule1F1B}
CASES = [(p, m) for p in range(1, 6) for m in range(1, 10)]


def _torch_executed_order(schedule: str, n_stages: int, stage_index: int, n_microbatches: int) -> list[tuple[str, int]]:
    """Run torch's ``_step_microbatches`` for one stage with a mocked stage; record the compute calls."""
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.num_stages = n_stages
    stage.stage_index = stage_index
    stage.is_first = stage_index == 0
    stage.is_last = stage_index == n_stages - 1
    stage.group_rank = stage_index
    stage.group_size = n_stages
    stage.submod = None
    # No peers to talk to: every send/recv op list is empty, so nothing touches a process group.
    for name in ("get_fwd_recv_ops", "get_fwd_send_ops", "get_bwd_recv_ops", "get_bwd_send_ops"):
        getattr(stage, name).return_value = []
    calls: list[tuple[str, int]] = []
    stage.forward_one_chunk.side_effect = lambda mb, *a, **k: calls.append(("F", mb))
    stage.backward_one_chunk.side_effect = lambda mb, *a, **k: calls.append(("B", mb))

    sched = TORCH_CLASSES[schedule](stage, n_microbatches)
    sched._initialize_stage = lambda *a, **k: None  # shape inference needs real tensors/process group
    sched._step_microbatches()
    return calls


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), CASES)
def test_matches_torch_step_microbatches(schedule: str, p: int, m: int) -> None:
    if schedule == "1f1b" and m < p:
        with pytest.raises(ValueError):
            _torch_executed_order(schedule, p, 0, m)
        with pytest.raises(InfeasibleError, match="needs at least one microbatch per stage"):
            action_order(schedule, p, m)
        return
    ours = action_order(schedule, p, m)
    assert len(ours) == p
    for i in range(p):
        assert ours[i] == _torch_executed_order(schedule, p, i, m), (schedule, p, m, i)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in CASES if m >= p])
def test_matches_torch_schedule_ir(schedule: str, p: int, m: int) -> None:
    ir = get_schedule_ops("GPipe" if schedule == "gpipe" else "1F1B", p, m)
    kinds = {tsched._ComputationType.FORWARD: "F", tsched._ComputationType.FULL_BACKWARD: "B"}
    for rank, actions in enumerate(ir):
        if schedule == "1f1b" and rank == p - 1:
            # torch 2.13's Schedule1F1B._get_pipeline_order mislabels the last rank's forwards
            # (F1..F(m), skipping F0: ``forward_mb`` starts at 0 and is pre-incremented when there is
            # no warm-up). Only the IR/visualizer is affected; execution (_step_microbatches, checked
            # above) runs F0..F(m-1), which is what action_order returns.
            continue
        theirs = [
            (kinds[a.computation_type], a.microbatch_index)
            for a in actions
            if a is not None and a.computation_type in kinds
        ]
        assert action_order(schedule, p, m)[rank] == theirs


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in CASES if m >= p])
def test_peak_in_flight_closed_forms(p: int, m: int) -> None:
    for i, order in enumerate(action_order("1f1b", p, m)):
        assert peak_in_flight(order) == min(m, p - i)
    for order in action_order("gpipe", p, m):
        assert peak_in_flight(order) == m
