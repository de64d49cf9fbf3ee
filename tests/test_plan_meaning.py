"""Tier 1 (pure): a plan file is checked by meaning (issue 66, part 2).

Every figure a plan derives (each stage's times, bytes and in-flight count, the prediction, the
baselines) is re-derived when the plan is loaded (``planner.core.step.predict.refresh``): a hand
edit of any of them is undone and named. An edit of what they are derived from is re-predicted:
one that changes the microbatch size (batch_size, n_microbatches, accumulation) is priced on the
blocks' costs rescaled to the new size, as the search would have priced that size from the
profiled costs. What cannot be re-predicted is refused in one line by the schema (a batch that does
not divide, fsdp with one replica, a recompute count past the stage's regions, sequence parallelism
without tp; tests/test_plan_schema.py, tests/test_mistakes_silent.py) or, against the model, by
``planner run`` (a tp its heads do not divide; tests/test_tp_plan.py).

The plans are the random problems of tests/test_plans_unchanged.py, made by ``assemble_plan`` and
``with_links`` as ``planner.api.make_plan`` makes them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from test_plans_unchanged import REF, problem

from planner.core.assemble import Origin, assemble_plan
from planner.core.layout.inputs import asked_of
from planner.core.levers.microbatch import blocks_at
from planner.core.step.predict import plan_split, predict_plan, refresh, with_links
from planner.errors import InfeasibleError, PlannerError
from planner.schema.costs import BlockCost
from planner.schema.plan import Plan

SEEDS = st.integers(0, 399)
FEW = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _made(seed: int) -> tuple[Plan, list[BlockCost]] | None:
    """Random problem ``seed``'s plan and the blocks as profiled (at the profile's microbatch size);
    None when no layout fits the problem."""
    request, blocks, link, profile, limit = problem(seed)
    try:
        plan = assemble_plan(asked_of(request, limit), blocks, link, Origin(REF, profile, "t"))
    except InfeasibleError:
        return None
    return with_links(plan, link), blocks  # as planner.api.make_plan records a multi-node plan's links


def _plan_and_blocks(seed: int) -> tuple[Plan, list[BlockCost]]:
    """``_made`` of a drawn seed, the draw rejected when the problem has no plan."""
    made = _made(seed)
    assume(made is not None)
    assert made is not None
    return made


def _derived(raw: dict[str, Any]) -> Iterator[tuple[Any, ...]]:
    """The paths of every number a plan derives: each stage's figures, the prediction's, each baseline's."""
    for i, stage in enumerate(raw["stages"]):
        for key, value in stage.items():
            if (
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and key not in ("index", "rank", "start", "end")
            ):
                yield ("stages", i, key)
    for section in [("prediction",)] + [("baselines", name) for name in raw["baselines"]]:
        holder = raw
        for key in section:
            holder = holder[key]
        for key, value in holder.items():
            if key in ("starts", "recompute"):
                continue  # the split itself: an edit of it is an edit of the stages (re-predicted, not undone)
            if isinstance(value, int | float) and not isinstance(value, bool):
                yield (*section, key)
            elif isinstance(value, list) and value and isinstance(value[0], int | float):
                yield (*section, key, 0)


def _edited(raw: dict[str, Any], path: tuple[Any, ...]) -> dict[str, Any]:
    copy = json.loads(json.dumps(raw))
    holder = copy
    for key in path[:-1]:
        holder = holder[key]
    value = holder[path[-1]]
    # a change the file's readers cannot mistake for float noise, within any range the field has (0..1 too)
    holder[path[-1]] = (value + 0.25 if value <= 0.5 else value - 0.25) if isinstance(value, float) else value * 2 + 1
    return copy


@FEW
@given(SEEDS)
def test_every_derived_figure_edited_by_hand_is_undone_and_named(seed: int) -> None:
    plan, _ = _plan_and_blocks(seed)
    raw = json.loads(plan.to_json())
    paths = list(_derived(raw))
    assert len(paths) >= 10 * len(plan.stages)
    for path in paths:
        try:
            edited = Plan.from_json(json.dumps(_edited(raw, path)))
        except PlannerError as e:  # out of its range (a bubble fraction past 1): refused in one line
            assert "\n" not in str(e) and "is not a valid plan" in str(e), path
            continue
        fresh, notes = refresh(edited)
        assert json.loads(fresh.to_json()) == raw, path
        named = path[2] if path[0] == "stages" else path[1] if path[0] == "baselines" else path[1]
        assert any(str(named) in note for note in notes), (path, notes)


def _costs_close(got: list[BlockCost], want: list[BlockCost]) -> None:
    """Times equal to float rounding, bytes within the one-byte roundings of two rescalings."""
    for g, w in zip(got, want, strict=True):
        for key, value in w.model_dump().items():
            mine = getattr(g, key)
            if isinstance(value, float):
                assert mine == pytest.approx(value, rel=1e-9, abs=1e-15), (w.name, key)
            elif isinstance(value, int) and not isinstance(value, bool):
                assert abs(mine - value) <= 1, (w.name, key)


@FEW
@given(SEEDS, st.sampled_from(["n_microbatches", "batch_size", "accumulation"]), st.sampled_from([2, 3]))
def test_an_edit_of_the_microbatch_size_is_predicted_as_the_search_would_price_that_size(
    seed: int, field: str, factor: int
) -> None:
    plan, profiled = _plan_and_blocks(seed)
    raw = json.loads(plan.to_json())
    raw[field] *= factor
    if field != "batch_size":  # the same batch in more microbatches or passes: it must still divide
        assume(plan.batch_size % (plan.dp * raw["accumulation"] * raw["n_microbatches"]) == 0)
    try:
        edited = Plan.from_json(json.dumps(raw))
        fresh, notes = refresh(edited)
    except PlannerError:  # the schedule refuses the new count (fewer microbatches than 1F1B needs): one line
        event("refused")
        return
    event(f"re-predicted ({field})")
    size, size0 = edited.microbatch_size, plan.profile.microbatch_size
    assert size != plan.microbatch_size and fresh.costed_microbatch_size == size
    assert notes[0].startswith(f"the microbatch is {size} samples") and f"not the {plan.microbatch_size} " in notes[0]
    # the oracle: the profiled blocks priced at the new size directly, as the search prices a size
    assert size0 is not None
    want = blocks_at(profiled, size0, size, plan.profile.fixed_fraction)
    _costs_close(fresh.blocks, want)
    stages, prediction = predict_plan(edited.model_copy(update={"blocks": want}), plan_split(edited))
    # The bytes of two rescalings round apart by a byte, so a stage's transfers (a boundary on each
    # side, forward and backward) by up to four bytes' time on the slowest link: 4 ns at 1 GB/s, a
    # 1e-7 of a 20 ms stage (problems 24 and 323). A step holds each stage's transfers once per microbatch.
    links = [link for link in (edited.link, edited.inter_node_link) if link is not None]
    byte_s = 1 / min(link.bandwidth_Bps for link in links)
    stage_abs = 4 * byte_s * (1 + 1e-6)  # (and the float rounding of a sum exactly four bytes apart)
    step_abs = stage_abs * len(stages) * edited.n_microbatches * edited.accumulation
    assert fresh.prediction.step_time_s == pytest.approx(prediction.step_time_s, rel=1e-7, abs=step_abs)
    assert [s.time_s for s in fresh.stages] == pytest.approx([s.time_s for s in stages], rel=1e-7, abs=stage_abs)
    assert fresh.prediction.max_memory_bytes == pytest.approx(prediction.max_memory_bytes, rel=1e-6)


def test_a_plan_without_the_costed_size_is_predicted_as_before() -> None:
    # plans written before costed_microbatch_size: their costs are taken at their microbatch size
    plan, _ = next(made for seed in range(400) if (made := _made(seed)) is not None)
    raw = json.loads(plan.to_json())
    del raw["costed_microbatch_size"]
    raw["n_microbatches"] *= 2
    if plan.batch_size % (plan.dp * plan.accumulation * raw["n_microbatches"]):
        raw["batch_size"] *= 2
    old = Plan.from_json(json.dumps(raw))
    fresh, notes = refresh(old)
    assert fresh.blocks == old.blocks and not any(n.startswith("the microbatch is") for n in notes)


@FEW
@given(SEEDS)
def test_a_plan_is_made_costed_at_its_own_microbatch(seed: int) -> None:
    plan, profiled = _plan_and_blocks(seed)
    assert plan.costed_microbatch_size == plan.microbatch_size
    assert refresh(plan)[1] == []  # consistent as made: nothing to re-derive
    size0 = plan.profile.microbatch_size
    assert size0 is not None
    _costs_close(plan.blocks, blocks_at(profiled, size0, plan.microbatch_size, plan.profile.fixed_fraction))
