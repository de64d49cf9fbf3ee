"""Tier-2 test: ``planner.core.step.schedules.action_order`` matches what torch's schedules execute.

Runs the real ``ScheduleGPipe`` / ``Schedule1F1B._step_microbatches`` of the installed torch with a
mocked stage whose communication ops are empty, and records the order of
``forward_one_chunk`` / ``backward_one_chunk`` calls. Also checks torch's own schedule IR
(``_get_pipeline_order`` via ``_schedule_visualizer.get_schedule_ops``) with its idle slots removed,
and, for the schedules with several stages per rank, the ``pipeline_order`` their constructors
compute (which ``_PipelineScheduleRuntime`` executes in order), including which requests their
constructors refuse.
"""

from __future__ import annotations

from unittest import mock

import pytest

torch = pytest.importorskip("torch")
from torch.distributed.pipelining import schedules as tsched  # noqa: E402
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops  # noqa: E402
from torch.distributed.pipelining.stage import PipelineStage  # noqa: E402

from planner.core.step.schedules import (  # noqa: E402
    SCHEDULES,
    TORCH_NAMES,
    action_order,
    in_flight_per_stage,
    stage_ranks,
    stages_per_rank_options,
)
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
        assert [(a.kind, a.microbatch) for a in ours[i]] == _torch_executed_order(schedule, p, i, m), (
            schedule,
            p,
            m,
            i,
        )
        assert all(a.stage == i for a in ours[i])


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
        assert [(a.kind, a.microbatch) for a in action_order(schedule, p, m)[rank]] == theirs


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in CASES if m >= p])
def test_peak_in_flight_closed_forms(p: int, m: int) -> None:
    assert in_flight_per_stage("1f1b", p, m) == [min(m, p - i) for i in range(p)]
    assert in_flight_per_stage("gpipe", p, m) == [m] * p


_KINDS = {
    tsched.FORWARD: "F",
    tsched.FULL_BACKWARD: "B",
    tsched.BACKWARD_INPUT: "I",
    tsched.BACKWARD_WEIGHT: "W",
}


def _torch_pipeline_order(schedule: str, p: int, m: int, v: int) -> tuple[list[list[tuple[int, str, int]]], list[int]]:
    """torch's compute actions per rank (idle slots dropped, DualPipeV's overlapped F&B as its two
    sub-actions) and its stage -> rank map, from the class's own constructor on mocked stages."""
    cls = tsched.get_schedule_class(TORCH_NAMES[schedule])
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank = 0
    stage.group_size = p
    stage.submod = None
    stage.num_stages = p * v
    sched = cls([stage] * v, m)
    orders = []
    for rank in range(p):
        acts: list[tuple[int, str, int]] = []
        for a in sched.pipeline_order[rank]:
            if a is None:
                continue
            subs = a.sub_actions if a.computation_type == tsched.OVERLAP_F_B else (a,)
            acts += [(x.stage_index, _KINDS[x.computation_type], x.microbatch_index) for x in subs]
        orders.append(acts)
    return orders, [sched.stage_index_to_group_rank[s] for s in range(p * v)]


MULTI_CASES = [
    (schedule, p, m, v)
    for schedule in SCHEDULES
    if schedule not in ("gpipe", "1f1b")
    for p in range(1, 5)
    for m in range(1, 11)
    for v in stages_per_rank_options(schedule, 3)
]


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "p", "m", "v"), MULTI_CASES)
def test_multi_stage_orders_match_torch(schedule: str, p: int, m: int, v: int) -> None:
    try:
        theirs, ranks = _torch_pipeline_order(schedule, p, m, v)
    except ValueError:
        # torch's constructor refuses it: so must we, with our one-line message
        with pytest.raises(InfeasibleError):
            action_order(schedule, p, m, v)
        return
    ours = action_order(schedule, p, m, v)
    assert [[(a.stage, a.kind, a.microbatch) for a in order] for order in ours] == theirs
    assert stage_ranks(schedule, p, v) == ranks


def _leaf_stages(actions: list) -> list[int]:
    """The stages of ``actions`` in order, an overlapped F&B as its two sub-actions."""
    out = []
    for a in actions:
        if a is not None:
            subs = a.sub_actions if a.computation_type == tsched.OVERLAP_F_B else (a,)
            out += [x.stage_index for x in subs]
    return out


@pytest.mark.parametrize("schedule", [s for s in SCHEDULES if s not in ("gpipe", "1f1b")])
def test_fsdp_stages_are_gathered_once_each_at_the_start(schedule: str) -> None:
    """``gather_each_stage_once`` keeps torch's compute actions and reductions in their order and
    gathers each stage of a rank once, all before its first action, resharding a stage only after
    its last (torch's own lowering keeps three stages gathered: with 4 per rank it regathers)."""
    from planner.torch_compat import gather_each_stage_once

    p, m = 4, 8
    v = max(stages_per_rank_options(schedule, 4))
    cls = tsched.get_schedule_class(TORCH_NAMES[schedule])
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod, stage.num_stages = 0, p, None, p * v
    sched = cls([stage] * v, m)
    messages = (tsched.SEND_F, tsched.RECV_F, tsched.SEND_B, tsched.RECV_B)
    fsdp_kinds = (tsched.UNSHARD, tsched.RESHARD)

    def compute(actions: list) -> list:
        return [a for a in actions if a.computation_type not in messages + fsdp_kinds]

    before = {r: list(acts) for r, acts in sched.pipeline_order_with_comms.items()}
    gather_each_stage_once(sched)
    after = sched.pipeline_order_with_comms
    for rank in range(p):
        assert compute(after[rank]) == compute(before[rank])
        mine = sorted(set(_leaf_stages(sched.pipeline_order[rank])))
        kinds = [a.computation_type for a in after[rank]]
        gathers = [a.stage_index for a in after[rank] if a.computation_type == tsched.UNSHARD]
        assert sorted(gathers) == mine and kinds[: len(mine)] == [tsched.UNSHARD] * len(mine)
        for s in mine:
            last = max(
                i for i, a in enumerate(after[rank]) if a.computation_type not in fsdp_kinds and s in _leaf_stages([a])
            )
            reshards = [
                i for i, a in enumerate(after[rank]) if a.computation_type == tsched.RESHARD and a.stage_index == s
            ]
            assert len(reshards) == 1 and reshards[0] > last
    if schedule == "interleaved-1f1b":  # v 4: torch's own window regathers
        assert sum(a.computation_type == tsched.UNSHARD for a in before[0]) > v
