"""Pure-tier tests of planner.core.layout.bounds: the floors the search prunes with never exceed what the
solver and the simulator find, for the solver's split and for any other split."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import replace

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from plan_factory import block
from test_plans_unchanged import MB, _block

import planner.core.layout.candidate as candidate_module
from planner.core.layout.bounds import (
    _cheapest_first,
    block_totals,
    busiest_load,
    chain_floor,
    ends_floor,
    floors,
    least_rerun,
    memory_floor,
    pipeline_floor,
    recompute_floor,
    step_floor,
    step_temp_floor,
)
from planner.core.layout.candidate import Outpaced
from planner.core.layout.fsdp_bounds import fsdp_traffic, master_floor, unsharded_floor
from planner.core.layout.inputs import Cluster, Constraints, Layout
from planner.core.layout.search import Choice, evaluate_choice, evaluate_modes
from planner.core.layout.stage_chain import StageChain
from planner.core.levers.data_parallel import as_gathered
from planner.core.levers.experts import at_degree as experts_at
from planner.core.levers.hardware import get_hardware, node_links
from planner.core.split.stage_model import Partition
from planner.core.step.schedules import SCHEDULES, ZERO_BUBBLE, check_schedule, stages_per_rank_options
from planner.core.step.simulate import StageTimes, simulate_step
from planner.errors import InfeasibleError
from planner.schema.costs import BlockCost, LinkCost, OptimizerSpec
from planner.schema.shares import ExpertShare

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


def _pipeline(draw: st.DrawFn, blocks: list[BlockCost], schedules: Sequence[str]) -> tuple[str, int, int, int]:
    """A schedule of ``schedules``, pipeline ranks, stages per rank and microbatches the blocks can run."""
    legal = sum(b.cut_legal for b in blocks[:-1]) + 1
    schedule = draw(st.sampled_from(schedules))
    pp = draw(st.integers(1, min(4, legal)))
    options = [v for v in stages_per_rank_options(schedule, 3) if pp * v <= legal]
    assume(options)
    v = draw(st.sampled_from(options))
    m = draw(st.integers(1, 8))
    assume(_runnable(schedule, pp, m, v))
    return schedule, pp, v, m


@st.composite
def problems(draw: st.DrawFn) -> tuple[list, Cluster, Layout, Constraints, random.Random]:  # type: ignore[type-arg]
    rng = random.Random(draw(st.integers(0, 2**32)))
    n = draw(st.integers(2, 10))
    blocks = [_block(rng, i, n) for i in range(n)]
    schedule, pp, v, m = _pipeline(draw, blocks, SCHEDULES)
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


def _solved_and_random(
    blocks: list,  # type: ignore[type-arg]
    cluster: Cluster,
    layout: Layout,
    constraints: Constraints,
    rng: random.Random,
) -> list[Choice]:
    """The layout as the search evaluates it and a random split of it (the floors hold over every
    split) under each mode the layout allows, those that run."""
    choices = []
    try:
        choices.append(evaluate_modes(blocks, cluster, layout, constraints))
    except InfeasibleError:
        pass
    split = _random_split(blocks, layout.n_stages, rng)
    modes = ["ddp", "fsdp"] if layout.dp_mode == "auto" else [layout.dp_mode]
    if layout.dp == 1 or layout.schedule in ZERO_BUBBLE:
        modes = ["ddp"]  # one replica is DDP; split-backward schedules are planned with DDP only
    for mode in modes if split is not None else []:
        try:
            choices.append(evaluate_choice(blocks, cluster, replace(layout, dp_mode=mode), constraints, split))
        except InfeasibleError:
            pass
    return choices


@settings(max_examples=300, deadline=None)
@given(problems())
def test_floors_never_exceed_the_solved_and_simulated_layout(problem: tuple) -> None:  # type: ignore[type-arg]
    blocks, cluster, layout, constraints, rng = problem
    step, memory = floors(blocks, layout, constraints.optimizer)
    assert (step, memory) == (
        step_floor(blocks, layout, constraints.optimizer),
        memory_floor(blocks, layout, constraints.optimizer),
    )
    for c in _solved_and_random(blocks, cluster, layout, constraints, rng):
        assert step <= c.prediction.step_time_s * (1 + 1e-12), (step, c.prediction.step_time_s, c.layout)
        assert memory <= c.prediction.max_memory_bytes, (memory, c.prediction.max_memory_bytes, c.layout)


@settings(max_examples=200, deadline=None)
@given(problems())
def test_floors_from_kept_totals_are_the_floors(problem: tuple) -> None:  # type: ignore[type-arg]
    """The search sums the blocks once per set of costs (``block_totals``) and hands the sums to
    ``floors`` for each layout: the same floors as summing them there, for either backward kind."""
    blocks, _, layout, constraints, _ = problem
    split = layout.schedule in ZERO_BUBBLE
    kept = floors(blocks, layout, constraints.optimizer, block_totals(blocks, split))
    assert kept == floors(blocks, layout, constraints.optimizer)


def test_pipeline_floor_exact_values() -> None:
    """One microbatch: its whole chain; two stages of two microbatches: the split (2c/3, c/3) makes
    both stages' bounds 4c/3 (stage 0: 2 t0; stage 1: t0 + 2 t1); many microbatches: the mean."""
    assert pipeline_floor(3.0, 1, 8) == pytest.approx(3.0)
    assert pipeline_floor(3.0, 2, 2) == pytest.approx(4.0)
    assert pipeline_floor(1.0, 10_000, 4) == pytest.approx(10_000 / 4, rel=1e-3)
    # a two-part backward whose chain carries half of each block: weaker, and nothing without a chain
    assert pipeline_floor(3.0, 2, 2, lead=0.5) < pipeline_floor(3.0, 2, 2)
    assert pipeline_floor(3.0, 2, 2, lead=0.0) == 0.0


def test_chain_floor_exact_values() -> None:
    """Four stages, each 1 s of forward and 2 s of backward, eight microbatches: the chain is 12 s and
    each stage adds 7 more backwards of 2 s (26 s; 1F1B's balanced makespan is (8 + 3) x 3 = 33 s);
    split backward: the forwards' chain and all eight backwards (4 + 16 = 20 s). One microbatch: the
    whole chain."""
    assert chain_floor(12.0, 8.0, 8, 4) == pytest.approx(26.0)
    assert chain_floor(12.0, 8.0, 8, 4, split=True) == pytest.approx(20.0)
    assert chain_floor(12.0, 8.0, 1, 4) == pytest.approx(12.0)
    assert chain_floor(12.0, 8.0, 0, 4) == 0.0
    # tighter than the busiest rank's mean where microbatches are few for the stages, looser where many
    assert chain_floor(12.0, 8.0, 2, 4) > 12.0 * 2 / 4
    assert chain_floor(12.0, 8.0, 64, 4) < 12.0 * 64 / 4


def test_ends_floor_exact_values() -> None:
    """Four ranks of single-block stages, each block 1 s forward and 2 s backward: the chains around
    ranks 0-3 hold 0, 3, 6 and 9 s of compute, so the ranks' 8 x 12 s of work and those 18 s give
    (96 + 18) / 4 = 28.5 s, half a block's compute per rank after the first above the mean (24 s);
    1F1B's balanced makespan is (8 + 3) x 3 = 33 s. A two-part backward chains forwards only (6 s);
    a block that cannot be cut after joins the next unit."""
    blocks = [block(f"layers.{i}", 1000, 2000, 10) for i in range(4)]
    totals = block_totals(blocks, False)
    assert totals.ends == pytest.approx((0.0, 0.0, 3.0, 9.0, 18.0))
    assert ends_floor(totals.ends, 8 * totals.compute, 4) == pytest.approx(28.5)
    assert block_totals(blocks, True).ends == pytest.approx((0.0, 0.0, 1.0, 3.0, 6.0))
    fused = [blocks[0].model_copy(update={"cut_legal": False}), *blocks[1:]]
    assert block_totals(fused, False).ends == pytest.approx((0.0, 0.0, 6.0, 15.0))
    # more ranks than units: the units there are; no ranks: nothing
    assert ends_floor(totals.ends, 0.0, 8) == pytest.approx(18.0 / 8)
    assert ends_floor(totals.ends, 5.0, 0) == 0.0


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(SCHEDULES),
    st.integers(1, 4),
    st.integers(1, 3),
    st.integers(1, 8),
    st.lists(st.tuples(st.floats(0.01, 10.0), st.floats(0.01, 10.0), st.floats(0.1, 0.9)), min_size=12, max_size=12),
)
def test_pass_floors_under_the_simulated_makespan(
    schedule: str, p: int, v: int, m: int, times: list[tuple[float, float, float]]
) -> None:
    """For any stage times of any schedule, the makespan the simulator gives (no messages) is at least
    each floor of their totals (``pipeline_floor``, ``chain_floor``): the floors hold over every
    split, so they cannot beat this one."""
    assume(v in stages_per_rank_options(schedule, 3) and _runnable(schedule, p, m, v))
    stages = [StageTimes(f=f, b=b, i=b * share, w=b * (1 - share)) for f, b, share in times[: p * v]]
    split = schedule in ZERO_BUBBLE
    lead = min(t.f / (t.f + t.b) for t in stages) if split else 1.0
    makespan, _ = simulate_step(stages, schedule, m, stages_per_rank=v)
    total, backward = sum(t.f + t.b for t in stages), sum(t.b for t in stages)
    assert pipeline_floor(total, m, p * v, lead) <= makespan * (1 + 1e-9)
    assert chain_floor(total, backward, m, p * v, split) <= makespan * (1 + 1e-9)
    # each stage one unit of blocks: the chains before (and with whole backwards after) each rank's work
    chains = list(itertools.accumulate((t.f + (0.0 if split else t.b) for t in stages[: p - 1]), initial=0.0))
    ends = tuple(itertools.accumulate(chains, initial=0.0))
    assert ends_floor(ends, total * m, p) <= makespan * (1 + 1e-9)


def _rich_block(rng: random.Random, i: int, n: int) -> BlockCost:
    """A random block with what recomputation and memory read: selective costs and bytes, autocast's
    weight copies, its backward's temporaries and, on the last, the loss's saved bytes."""
    b = _block(rng, i, n)
    cast = rng.choice([0, b.activation_bytes // 4])
    return b.model_copy(
        update={
            "weight_cast_bytes": cast,
            "selective_bytes": rng.choice([None, rng.randint(0, max(1, b.activation_bytes))]),
            "selective_recompute_s": rng.choice([None, rng.randint(0, 20) / 1e3]),
            "bwd_temp_bytes": rng.choice([None, rng.randint(0, 2) * MB]),
            "loss_bytes": rng.randint(0, 2) * MB if i == n - 1 else None,
            "recompute_s": rng.choice([None, 0.0, rng.randint(1, 40) / 1e3]),
        }
    )


@settings(max_examples=400, deadline=None)
@given(problems(), st.floats(0.05, 1.5), st.sampled_from(["auto", "full", "selective", "never"]))
def test_floors_under_a_memory_limit_never_exceed_a_fitting_layout(
    problem: tuple,  # type: ignore[type-arg]
    share: float,
    recompute: str,
) -> None:
    """Under a memory limit the step floor counts the recomputation fitting it forces
    (``recompute_floor``): never more than the step of the solver's split, or of a random split
    with random recomputation, wherever that fits the limit."""
    _, cluster, layout, constraints, rng = problem
    n = rng.randint(2, 10)
    blocks = [_rich_block(rng, i, n) for i in range(n)]
    legal = sum(b.cut_legal for b in blocks[:-1]) + 1
    assume(layout.n_stages <= legal)
    # a limit from a sliver of the model's bytes to more than all of them
    whole = sum(b.param_bytes * 4 + b.activation_bytes * layout.n_microbatches for b in blocks)
    limit = int(whole * share / layout.pp) + 1
    limited = replace(constraints, memory_limit_bytes=limit, recompute=recompute)
    step, _ = floors(blocks, layout, constraints.optimizer, limit=limit, recompute=recompute)
    for c in _solved_and_random(blocks, cluster, layout, limited, rng):
        if c.fits:
            assert step <= c.prediction.step_time_s * (1 + 1e-9), (step, c.prediction.step_time_s, c.layout)


def test_busiest_load_against_every_deal() -> None:
    """``busiest_load`` never exceeds the least largest load over every way of dealing the items
    to the bins (brute force), and equals it for equal items: ceil(n / bins) of them."""
    rng = random.Random(7)
    for _ in range(300):
        n, bins = rng.randint(1, 7), rng.randint(1, 4)
        items = [rng.choice([1.0, 2.0, 3.0, rng.random() * 5]) for _ in range(n)]
        best = min(
            max(sum(x for x, b in zip(items, deal, strict=True) if b == k) for k in range(bins))
            for deal in itertools.product(range(bins), repeat=n)
        )
        prefix = (0.0, *itertools.accumulate(sorted(items, reverse=True)))
        assert busiest_load(prefix, bins) <= best + 1e-12
    for n, bins in [(82, 16), (82, 24), (80, 8), (5, 2), (3, 4)]:
        prefix = tuple(float(k) for k in range(n + 1))
        assert busiest_load(prefix, bins) == math.ceil(n / bins)
    assert busiest_load((0.0,), 4) == 0.0


def test_least_rerun_takes_the_cheapest_bytes_first() -> None:
    """Items of (bytes, cost): free the cheapest per byte first, part of the next, all of them at most."""
    frees = _cheapest_first([(100.0, 50.0), (10.0, 1.0), (50.0, 5.0)])  # 0.5, 0.1, 0.1 per byte
    assert least_rerun(frees, 0) == 0.0
    assert least_rerun(frees, 10) == pytest.approx(1.0)
    assert least_rerun(frees, 60) == pytest.approx(6.0)
    assert least_rerun(frees, 80) == pytest.approx(6.0 + 20 * 0.5)
    assert least_rerun(frees, 1e9) == pytest.approx(56.0)


def test_recompute_floor_exact_values() -> None:
    """Four equal blocks of 1 s forward, 2 s backward, 1 GiB kept per microbatch, 1 s to re-run;
    GPipe on two ranks, four microbatches live at once, 3 GiB a rank: 16 GiB of activations in
    6 GiB, so 2.5 GiB a microbatch freed at 1 s a GiB: 2.5 s of recomputation a microbatch, and the
    step at least the mean 4 x (12 + 2.5) / 2 = 29 s and, the recomputation on the stages' chain too,
    (12 + 2.5) / (1 - (3 / 4)^2) = 33.1 s (``pipeline_floor``; the balanced split takes 5 x 7.25 s). 1F1B holds two microbatches on its first rank and one on
    its second at their first backwards: room for 3 / 2 + 3 = 4.5 GiB of a microbatch, nothing
    forced; in 2 GiB a rank, 1 + 2 = 3 GiB: 1 GiB freed, 1 s."""
    gib = 2**30
    blocks = [
        block(f"b{i}", 1000, 2000, 0, act_mb=1024).model_copy(update={"recompute_s": 1.0, "cut_bytes": 1})
        for i in range(4)
    ]
    optimizer = OptimizerSpec(name="sgd")
    gpipe = Layout("gpipe", 2, 4, 1, 1, "ddp")
    totals = block_totals(blocks, False)
    held = 2 * 4 * 1 * 1  # receive buffers: 2 m (stages - 1) cuts of 1 byte
    assert recompute_floor(totals, gpipe, held, 3 * gib, "full") == pytest.approx(2.5, rel=1e-6)
    assert recompute_floor(totals, gpipe, held, 3 * gib, "never") == 0.0
    assert recompute_floor(totals, gpipe, held, None, "full") == 0.0
    step, _ = floors(blocks, gpipe, optimizer, limit=3 * gib, recompute="full")
    assert step == pytest.approx(14.5 / (1 - 0.75**2), rel=1e-6)
    one_f_one_b = Layout("1f1b", 2, 4, 1, 1, "ddp")
    assert recompute_floor(totals, one_f_one_b, held, 3 * gib, "full") == 0.0
    assert recompute_floor(totals, one_f_one_b, held, 2 * gib, "full") == pytest.approx(1.0, rel=1e-6)


@st.composite
def fsdp_problems(draw: st.DrawFn) -> tuple:  # type: ignore[type-arg]
    """Layouts FSDP may shard block by block on GPU nodes (NCCL's links), or DDP all-reduce, blocks of
    megabytes to gigabytes of parameters (their collectives hidden behind the compute, or not), some
    with experts, in one pass a step or two."""
    rng = random.Random(draw(st.integers(0, 2**32)))
    n = draw(st.integers(2, 8))
    scale = draw(st.sampled_from([1, 1_000, 10_000, 100_000]))
    blocks = [_rich_block(rng, i, n) for i in range(n)]
    # weights profiled in fp32 (a measured bf16 run's), or estimated in bf16 (gathered as they are:
    # their fp32 gradient accumulators the wider), some of them in float8 layers
    width = draw(st.sampled_from([4, 2]))
    blocks = [
        b.model_copy(
            update={
                "params": b.params * scale,
                "param_bytes": b.param_bytes * scale * width // 4,
                "float8_share": rng.choice([0.0, 0.0, 0.5, 1.0]),
            }
        )
        for b in blocks
    ]
    ep = draw(st.sampled_from([1, 1, 2]))
    schedule, pp, v, m = _pipeline(draw, blocks, [s for s in SCHEDULES if s not in ZERO_BUBBLE])
    dp = draw(st.sampled_from([2, 4, 8]))
    mode = draw(st.sampled_from(["fsdp", "hsdp", "auto", "ddp"]))
    dp_shard = draw(st.sampled_from([2, 4])) if mode not in ("fsdp", "ddp") else 0
    assume(dp_shard < dp and dp % max(1, dp_shard) == 0 and (dp_shard % ep == 0 if dp_shard else True))
    assume(dp % ep == 0)
    link = node_links(get_hardware("h100"), pp, draw(st.sampled_from([2, 8])))
    if ep > 1:
        shares = [
            ExpertShare(
                layers=1, experts=4, params=b.params * 4 // 5, param_bytes=b.param_bytes * 4 // 5, dispatch_bytes=MB
            )
            if b.params and b.is_layer
            else None
            for b in blocks
        ]
        blocks = experts_at([b.model_copy(update={"experts": s}) for b, s in zip(blocks, shares)], ep, link, 2)
    cluster = Cluster(world_size=pp * dp, link=link, slots=draw(st.sampled_from([None, None, 2.0])))
    recompute = draw(st.sampled_from(["never", "auto", "full"]))
    share = draw(st.sampled_from([None, 0.05, 0.3, 1.0]))  # a limit from a sliver of the model's bytes to all of them
    whole = sum(b.param_bytes * 4 + b.activation_bytes * m for b in blocks)
    limit = None if share is None else int(whole * share / pp) + 1
    constraints = Constraints(optimizer=OptimizerSpec(name="adamw"), memory_limit_bytes=limit, recompute=recompute)
    units = draw(st.sampled_from(["block", "stage", "auto"]))
    layout = Layout(schedule, pp, m, v, dp, mode, fsdp_units=units, dp_shard=dp_shard, gather_bytes=2, ep=ep)
    # several passes a step: DDP all-reduces after the last, not in buckets during it
    layout = replace(layout, accumulation=draw(st.sampled_from([1, 1, 2])))
    return blocks, cluster, layout, constraints, rng


@settings(max_examples=250, deadline=None)
@given(fsdp_problems())
def test_floors_with_fsdp_traffic_never_exceed_the_layout(problem: tuple) -> None:  # type: ignore[type-arg]
    """With FSDP's collectives counted (``fsdp_traffic``: the traffic the compute cannot hide and the
    gathers every stage waits for cold) the floors still never exceed the solver's split or a random
    split under any mode and units the layout may run (the step: where it fits the memory limit), on
    NCCL's links, with experts or not, under a limit or none."""
    blocks, cluster, layout, constraints, rng = problem
    traffic = fsdp_traffic(blocks, cluster.link, layout, cluster.slots)
    limit, recompute = constraints.memory_limit_bytes, constraints.recompute
    step, memory = floors(blocks, layout, constraints.optimizer, traffic=traffic, limit=limit, recompute=recompute)
    assert step >= floors(blocks, layout, constraints.optimizer, limit=limit, recompute=recompute)[0]  # it only adds
    choices = []
    try:
        choices.append(evaluate_modes(blocks, cluster, layout, constraints))
    except InfeasibleError:
        pass
    split = _random_split(blocks, layout.n_stages, rng)
    modes = (
        ["ddp", "fsdp"] + (["hsdp"] if layout.dp_shard > 1 else []) if layout.dp_mode == "auto" else [layout.dp_mode]
    )
    for mode in modes if split is not None else []:
        for units in ["stage", "block"] if layout.fsdp_units == "auto" else [layout.fsdp_units]:
            try:
                one = replace(layout, dp_mode=mode, fsdp_units=units)
                choices.append(evaluate_choice(blocks, cluster, one, constraints, split))
            except InfeasibleError:
                pass
    for c in choices:
        if c.fits:  # (under a limit, the step floor is that of the modes whose memory floor fits)
            assert step <= c.prediction.step_time_s * (1 + 1e-9), (step, c.prediction.step_time_s, c.layout)
        assert memory <= c.prediction.max_memory_bytes, (memory, c.prediction.max_memory_bytes, c.layout)


@settings(max_examples=200, deadline=None)
@given(fsdp_problems())
def test_units_and_hsdp_skipped_by_their_floor_give_the_same_choice(problem: tuple) -> None:  # type: ignore[type-arg]
    """``evaluate_modes`` leaves FSDP's block units (HSDP) unsolved where stage units (FSDP) already
    fit faster than their step floor: the very choice, split and figures as solving every one."""
    blocks, cluster, layout, constraints, _ = problem

    def outcome() -> object:
        try:
            c = evaluate_modes(blocks, cluster, layout, constraints)
        except InfeasibleError as e:
            return str(e)
        return c.layout, c.prediction, c.fits

    skipping = outcome()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(candidate_module, "_outpaced", lambda *a: False)
        assert outcome() == skipping


def _units_solved(patch: pytest.MonkeyPatch) -> list[str]:
    """From here on (under ``patch``), the FSDP units of every layout ``evaluate_choice`` solves, in order."""
    solved: list[str] = []
    real = candidate_module.evaluate_choice

    def counted(blocks: list, cluster: Cluster, layout: Layout, *rest: object) -> Choice:  # type: ignore[type-arg]
        solved.append(layout.fsdp_units)
        return real(blocks, cluster, layout, *rest)  # type: ignore[arg-type]

    patch.setattr(candidate_module, "evaluate_choice", counted)
    return solved


def test_block_units_slower_than_their_floor_are_not_solved() -> None:
    """Two ranks of 1F1B, 4 replicas over a slow link: stage units gather once a pass; block units
    would gather every block twice a microbatch, over their floor. They are never solved, and the
    answer is the stage units' as when both are."""
    link = LinkCost(name="plain", latency_s=0.0, bandwidth_Bps=1e9)
    blocks = [
        block(f"b{i}", 250, 250, 50_000_000, act_mb=0).model_copy(update={"param_bytes": 10**8}) for i in range(2)
    ]
    constraints = Constraints(optimizer=OptimizerSpec(name="sgd"))
    cluster = Cluster(world_size=8, link=link)
    layout = Layout("1f1b", 2, 16, 1, 4, "fsdp", fsdp_units="auto")
    with pytest.MonkeyPatch.context() as patch:
        solved = _units_solved(patch)
        got = evaluate_modes(blocks, cluster, layout, constraints)
        assert solved == ["stage"] and got.layout.fsdp_units == "stage"
        patch.setattr(candidate_module, "_outpaced", lambda *a: False)
        both = evaluate_modes(blocks, cluster, layout, constraints)
        assert solved == ["stage", "stage", "block"]
    assert both.prediction == got.prediction and both.layout == got.layout


@settings(max_examples=250, deadline=None)
@given(fsdp_problems(), st.floats(0.2, 1.5))
def test_a_layout_is_outpaced_only_where_it_could_not_beat_the_bound(problem: tuple, share: float) -> None:  # type: ignore[type-arg]
    """``evaluate_modes`` with a bound gives the very choice it gives without one, or says the layout
    is ``Outpaced``: then the floor it names is over the bound, and the layout without the bound either
    does not fit or steps no faster than that floor (the search loses nothing by not solving it)."""
    blocks, cluster, layout, constraints, _ = problem

    def outcome(bound: float | None) -> object:
        try:
            c = evaluate_modes(blocks, cluster, layout, constraints, bound)
        except InfeasibleError as e:
            return str(e)
        return c.layout, c.prediction, c.fits

    whole = outcome(None)
    reference = whole[1].step_time_s if isinstance(whole, tuple) else 1.0
    bound = reference * share
    try:
        got = outcome(bound)
    except Outpaced as e:
        assert e.floor_s > bound
        if isinstance(whole, tuple) and whole[2]:
            assert whole[1].step_time_s >= e.floor_s * (1 - 1e-9), (whole[1].step_time_s, e.floor_s)
        return
    assert got == whole


def test_stage_units_that_do_not_fit_and_slow_block_units_are_outpaced() -> None:
    """One pipeline rank of 8 blocks over 4 replicas on a slow link, its memory limit between what
    block units and stage units need: stage units do not fit; block units would, gathering every
    block twice a microbatch. Below their step floor, the layout is ``Outpaced`` at that floor with
    the block units never solved (the stage units' memory floor is over the limit already: they are
    not solved either); at the floor, it is evaluated whole, the block units' choice."""
    link = LinkCost(name="plain", latency_s=0.0, bandwidth_Bps=1e9)
    blocks = [block(f"b{i}", 250, 250, 25_000_000, act_mb=0) for i in range(8)]
    layout = Layout("gpipe", 1, 4, 1, 4, "fsdp", fsdp_units="auto")
    cluster = Cluster(world_size=4, link=link)
    free = Constraints(optimizer=OptimizerSpec(name="sgd"))
    need = {
        units: evaluate_choice(blocks, cluster, replace(layout, fsdp_units=units), free).prediction.max_memory_bytes
        for units in ("stage", "block")
    }
    assert need["block"] < need["stage"]
    constraints = replace(free, memory_limit_bytes=(need["block"] + need["stage"]) // 2)
    floor = candidate_module._step_floor(blocks, cluster, replace(layout, fsdp_units="block"), constraints)
    with pytest.MonkeyPatch.context() as patch:
        solved = _units_solved(patch)
        with pytest.raises(Outpaced) as raised:
            evaluate_modes(blocks, cluster, layout, constraints, floor * 0.99)
        assert raised.value.floor_s == floor and "block" not in solved
        got = evaluate_modes(blocks, cluster, layout, constraints, floor)
        assert solved.count("block") == 1
    assert got.fits and got.layout.fsdp_units == "block" and got.prediction.step_time_s >= floor
    assert got == evaluate_modes(blocks, cluster, layout, constraints)


def test_fsdp_traffic_exact_values() -> None:
    """Two blocks of 500 M bf16 parameters (1 GB) over 4 replicas on a plain link of 1 GB/s: each
    gathered twice (1 GB) and its fp32 gradients (2 GB) reduce-scattered, every collective moving
    3/4 of its bytes: (2 x 1 + 2) x 0.75 = 3 s a block, 6 s a microbatch; a cold start waits for a
    whole gather, 0.75 s. Two ranks of one block each (1 s of compute a microbatch between them),
    1F1B with 4 microbatches: the pass's chain (``pipeline_floor``) plus the traffic the compute
    cannot hide, (6 - 1) s a microbatch over the two ranks. A stage per unit: the reduce-scatters
    once a pass."""
    link = LinkCost(name="plain", latency_s=0.0, bandwidth_Bps=1e9)
    blocks = [
        block(f"b{i}", 250, 250, 500_000_000, act_mb=0).model_copy(update={"param_bytes": 10**9}) for i in range(2)
    ]
    layout = Layout("1f1b", 2, 4, 1, 4, "fsdp", fsdp_units="block")
    floors_by_mode = fsdp_traffic(blocks, link, layout, None)
    assert set(floors_by_mode) == {"ddp", "fsdp"}
    got = floors_by_mode["fsdp"]
    assert got.traffic == pytest.approx(6.0)
    assert got.cold == pytest.approx((0.0, 0.75, 1.5)) and got.per_stage is False
    assert got.exposed(layout) == pytest.approx(3.0)  # each rank waits for two gathers at least
    step, _ = floors(blocks, layout, OptimizerSpec(name="sgd"), traffic={"fsdp": got})
    assert step == pytest.approx(pipeline_floor(1.0, 4, 2) + (6.0 - 1.0) * 4 / 2)
    assert step > floors(blocks, layout, OptimizerSpec(name="sgd"))[0]
    # stage units gather once a pass and reduce-scatter once (3 s of the 6, each stage's holding its
    # rank after its last backward): the ranks' 4 x 1 s of compute and those 3 s over 2 ranks
    assert got.reduced == pytest.approx(3.0)
    stage_units = replace(layout, fsdp_units="stage")
    assert floors(blocks, stage_units, OptimizerSpec(name="sgd"), traffic={"fsdp": got})[0] == pytest.approx(3.5)
    # without them, the chain of whole blocks: the second stage waits for the first block's 0.5 s a
    # microbatch, then runs its 4 x 0.5 s (the continuous share, ``pipeline_floor``, is less)
    assert floors(blocks, stage_units, OptimizerSpec(name="sgd"))[0] == pytest.approx(2.5)
    assert pipeline_floor(1.0, 4, 2) < 2.5
    # on GPUs a hidden collective slows the compute beside it (here 20 %): block by block the 5 s a
    # microbatch exposes and 0.2 x the 1 s hidden; a stage per unit 0.2 x its once-a-pass gathers (1.5 s)
    slowed = {"fsdp": got._replace(slowdown=0.2)}
    assert got._replace(slowdown=0.2).charged(5.0) == pytest.approx(5.2)
    step, _ = floors(blocks, layout, OptimizerSpec(name="sgd"), traffic=slowed)
    assert step == pytest.approx(pipeline_floor(1.0, 4, 2) + 5.2 * 4 / 2)
    assert floors(blocks, stage_units, OptimizerSpec(name="sgd"), traffic=slowed)[0] == pytest.approx(
        3.5 + 0.2 * 1.5 / 2
    )
    assert fsdp_traffic(blocks, link, replace(layout, dp=1), None) == {}
    # DDP all-reduces the 4 GB of fp32 gradients once a step, 2 x 3/4 of them at 1 GB/s: 6 s over the
    # two ranks, after the step on a link NCCL does not drive (3 s a rank, beside the pass's floor)
    ddp = floors_by_mode["ddp"]
    assert ddp.traffic == pytest.approx(6.0) and ddp.slowdown == 0.0
    ddp_layout = replace(layout, dp_mode="ddp", fsdp_units="stage")
    with_ddp, _ = floors(blocks, ddp_layout, OptimizerSpec(name="sgd"), traffic=floors_by_mode)
    assert with_ddp == pytest.approx(floors(blocks, ddp_layout, OptimizerSpec(name="sgd"))[0] + 3.0)


def _weights(params: int, width: int, float8: float = 0.0, temps: int | None = None) -> BlockCost:
    return block("w", 1, 2, params).model_copy(
        update={"param_bytes": width * params, "float8_share": float8, "opt_temp_bytes": temps}
    )


def test_unsharded_and_master_floors_exact_values() -> None:
    """What FSDP's stage units hold unsharded (``unsharded_bytes``: P + max(P, 2 N) + 4 N where P is
    narrower than fp32): 8 bytes a parameter of bf16 weights, gathered as they are, and of fp32 ones
    gathered in bf16; 7 of a float8 layer's weights gathered in a byte; 8 of fp32 weights gathered
    whole (no fp32 copy). Blocks of both widths: the fp32 copies only as far as the totals show them."""
    n = 1000
    assert unsharded_floor(as_gathered([_weights(n, 2)], 2)) == 8 * n
    assert unsharded_floor(as_gathered([_weights(n, 4)], 2)) == 8 * n
    assert unsharded_floor(as_gathered([_weights(n, 4, float8=1.0)], 2)) == 7 * n
    assert unsharded_floor([_weights(n, 4)]) == 8 * n
    assert master_floor([(2 * n, n), (4 * n, n)]) == 4 * 2 * n - 6 * n  # mixed: max(0, 4 N - P)
    assert master_floor([(2 * n, n), (2 * n, n), (0, 0)]) == 8 * n  # every block narrower: 4 N
    # the memory floor of FSDP stage units on 2 replicas, 1 rank: state (12 bytes a bf16 parameter
    # with AdamW) and 2 P sharded, and the 8 N unsharded
    layout = Layout("gpipe", 1, 1, 1, 2, "fsdp", fsdp_units="stage", gather_bytes=2)
    _, memory = floors([_weights(n, 2)], layout, OptimizerSpec(name="adamw"))
    assert memory == (4 * n + 12 * n) // 2 + 8 * n


def test_step_temp_floor_exact_values() -> None:
    """The optimizer step's temporaries over any split: AdamW's 8 bytes a parameter where not measured,
    the less of that and the measure under the "sum" rule, nothing measured under "max"; SGD none.
    DDP's memory floor holds them beside the weights, gradients and state."""
    adamw, sgd = OptimizerSpec(name="adamw"), OptimizerSpec(name="sgd")
    blocks = [_weights(1000, 2), _weights(1000, 2, temps=3000), _weights(1000, 2, temps=20_000)]
    assert step_temp_floor(blocks, adamw, False) == 8000 + 3000 + 8000
    assert step_temp_floor(blocks, adamw.model_copy(update={"step_temp_rule": "max"}), False) == 8000
    assert step_temp_floor(blocks, sgd, False) == 0
    assert step_temp_floor(blocks, None, False) == 0
    layout = Layout("gpipe", 1, 1, 1, 1, "ddp")
    _, memory = floors(blocks[:1], layout, adamw)
    assert memory == 2 * 2000 + 12 * 1000 + 8000


@settings(max_examples=300, deadline=None)
@given(
    works=st.lists(st.floats(0.0, 5.0), min_size=1, max_size=7),
    forward=st.floats(0.0, 1.0),
    n_stages=st.integers(1, 7),
    m=st.integers(1, 6),
)
def test_stage_chain_is_the_least_over_every_split(works: list[float], forward: float, n_stages: int, m: int) -> None:
    """``StageChain.floor`` against every split of the units into the stages: the least over them of the
    largest ``H_s + m W_s`` (the units before the stage on the chain, the stage's own per microbatch),
    to bisection precision; 0 where the stages are more than the units."""
    heads = [forward * w for w in works]
    chain = StageChain.of(heads, works)
    n = len(works)
    if n_stages > n:
        assert chain.floor(n_stages, m) == 0.0
        return
    best = math.inf
    for cuts in itertools.combinations(range(1, n), n_stages - 1):
        edges = (0, *cuts, n)
        worst = max(sum(heads[: edges[k]]) + m * sum(works[edges[k] : edges[k + 1]]) for k in range(n_stages))
        best = min(best, worst)
    got = chain.floor(n_stages, m)
    assert got <= best * (1 + 1e-9) + 1e-12
    assert got >= best * (1 - 1e-9) - 1e-9
    assert chain.floor(n_stages, m) == got  # (kept)


@settings(max_examples=300, deadline=None)
@given(
    works=st.lists(st.floats(0.0, 5.0), min_size=1, max_size=9),
    forward=st.floats(0.0, 1.0),
    n_stages=st.integers(1, 9),
    m=st.integers(1, 6),
    other=st.floats(-1.0, 60.0),
)
def test_stage_chain_floor_over_another_bound_is_their_larger(
    works: list[float], forward: float, n_stages: int, m: int, other: float
) -> None:
    """``StageChain.floor_over`` (no bisection where one greedy deal covers the units within the other
    bound) is exactly the larger of that bound and ``floor``, first asked or after ``floor`` is kept."""
    heads = [forward * w for w in works]
    fresh, kept = StageChain.of(heads, works), StageChain.of(heads, works)
    assert fresh.floor_over(n_stages, m, other) == max(other, kept.floor(n_stages, m))
    assert kept.floor_over(n_stages, m, other) == max(other, kept.floor(n_stages, m))


def test_stage_chain_exact_values() -> None:
    """Four equal units of 1 s, 2 microbatches: on 2 stages, 2 units each, the second waiting for the
    first's 2 s: 2 + 2 x 2 = 6 s (an uneven deal, 3 + 1, is 2 x 3 = 6 too); on 4 stages the last
    waits for 3 s and runs 2: 5 s, where the continuous share (``pipeline_floor``) says 4.27."""
    chain = StageChain.of([1.0] * 4, [1.0] * 4)
    assert chain.floor(2, 2) == pytest.approx(6.0)
    assert chain.floor(4, 2) == pytest.approx(5.0)
    assert pipeline_floor(4.0, 2, 4) == pytest.approx(4 / (1 - 0.5**4))  # 4.27
    assert chain.floor(5, 2) == 0.0
    with pytest.raises(ValueError, match="heads"):
        StageChain.of([1.0], [])
