"""Pure-tier tests of planner.core.bounds: the floors the search prunes with never exceed what the
solver and the simulator find, for the solver's split and for any other split."""

from __future__ import annotations

import random
from dataclasses import replace

from hypothesis import assume, given, settings
from hypothesis import strategies as st
from test_plans_unchanged import _block

from planner.core.bounds import floors, memory_floor, step_floor
from planner.core.inputs import Cluster, Constraints, Layout
from planner.core.schedules import SCHEDULES, SPLIT_BACKWARD, check_schedule, stages_per_rank_options
from planner.core.search import evaluate_choice, evaluate_modes
from planner.core.stage_model import Partition
from planner.errors import InfeasibleError
from planner.schema.costs import LinkCost, OptimizerSpec

LINKS = [
    LinkCost(name="free", latency_s=0.0, bandwidth_Bps=1e12),
    LinkCost(name="slow", latency_s=1e-3, bandwidth_Bps=1e9),
]


def _runnable(schedule: str, p: int, m: int, v: int) -> bool:
    try:
        check_schedule(schedule, p, m, v)
    except InfeasibleError:
        return False
    return True


@st.composite
def problems(draw: st.DrawFn) -> tuple[list, Cluster, Layout, Constraints, random.Random]:  # type: ignore[type-arg]
    rng = random.Random(draw(st.integers(0, 2**32)))
    n = draw(st.integers(2, 10))
    blocks = [_block(rng, i, n) for i in range(n)]
    legal = sum(b.cut_legal for b in blocks[:-1]) + 1
    schedule = draw(st.sampled_from(SCHEDULES))
    pp = draw(st.integers(1, min(4, legal)))
    options = [v for v in stages_per_rank_options(schedule, 3) if pp * v <= legal]
    assume(options)
    v = draw(st.sampled_from(options))
    m = draw(st.integers(1, 8))
    assume(_runnable(schedule, pp, m, v))
    dp = draw(st.sampled_from([1, 2, 4]))
    mode = draw(st.sampled_from(["ddp", "fsdp", "auto"]))
    cluster = Cluster(world_size=pp * dp, link=draw(st.sampled_from(LINKS)), slots=draw(st.sampled_from([None, 2.0])))
    optimizer = OptimizerSpec(
        name=draw(st.sampled_from(["adamw", "sgd"])), grad_clip=draw(st.sampled_from([None, 1.0]))
    )
    constraints = Constraints(
        optimizer=optimizer, recompute=draw(st.sampled_from(["never", "always", "auto", "selective"]))
    )
    accumulation = draw(st.sampled_from([1, 1, 2, 3]))
    layout = Layout(schedule, pp, m, v, dp, mode, accumulation=accumulation)
    return blocks, cluster, layout, constraints, rng


def _random_split(blocks: list, n_stages: int, rng: random.Random) -> Partition | None:  # type: ignore[type-arg]
    cuts = [i for i in range(1, len(blocks)) if blocks[i - 1].cut_legal]
    if len(cuts) < n_stages - 1:
        return None
    starts = (0, *sorted(rng.sample(cuts, n_stages - 1)))
    modes = ("never", "selective", "full", "stage")
    return Partition(starts=starts, bottleneck_s=0.0, recompute=tuple(rng.choice(modes) for _ in starts))


@settings(max_examples=300, deadline=None)
@given(problems())
def test_floors_never_exceed_the_solved_and_simulated_layout(problem: tuple) -> None:  # type: ignore[type-arg]
    blocks, cluster, layout, constraints, rng = problem
    step, memory = floors(blocks, layout, constraints.optimizer)
    assert (step, memory) == (
        step_floor(blocks, layout, constraints.optimizer),
        memory_floor(blocks, layout, constraints.optimizer),
    )
    try:
        choices = [evaluate_modes(blocks, cluster, layout, constraints)]
    except InfeasibleError:
        choices = []
    # and a random split (the floors hold over every split), under each mode the layout allows
    split = _random_split(blocks, layout.n_stages, rng)
    modes = ["ddp", "fsdp"] if layout.dp_mode == "auto" else [layout.dp_mode]
    if layout.dp == 1 or layout.schedule in SPLIT_BACKWARD:
        modes = ["ddp"]  # one replica is DDP; split-backward schedules are planned with DDP only
    for mode in modes if split is not None else []:
        try:
            choices.append(evaluate_choice(blocks, cluster, replace(layout, dp_mode=mode), constraints, split))
        except InfeasibleError:
            pass
    for c in choices:
        assert step <= c.prediction.step_time_s * (1 + 1e-12), (step, c.prediction.step_time_s, c.layout)
        assert memory <= c.prediction.max_memory_bytes, (memory, c.prediction.max_memory_bytes, c.layout)
