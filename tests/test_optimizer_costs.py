"""The optimizer step's measured costs: per-block step times and temporaries, and how the memory
model combines the temporaries of a stage's blocks (the "max" / "sum" rule).

Pure tier: ``stage_memory_parts`` (the reference) against hand figures, and the solver's fast memory
path (prefix sums, a sparse table of range maxima) against it on random blocks. CPU torch tier: the
round-robin timer of ``planner.costs.timing``.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from plan_factory import assert_fit_limits_agree, memory_layout, solved

from planner.core.split import solve as solve_mod
from planner.core.split.stage_model import stage_memories, stage_memory_bytes, stage_memory_parts
from planner.core.step.schedules import in_flight_per_stage
from planner.errors import InfeasibleError
from planner.schema.costs import BlockCost, LinkCost, OptimizerSpec
from planner.schema.plan import Plan

FREE = LinkCost(name="free", latency_s=0.0, bandwidth_Bps=1.0)
MAX = OptimizerSpec(step_temp_rule="max")
SUM = OptimizerSpec(step_temp_rule="sum")


def blk(i: int, *, params: int = 0, temp: int | None = None, act: int = 0, f: float = 1.0) -> BlockCost:
    return BlockCost(
        name=f"b{i}",
        first_node=f"n{i}a",
        last_node=f"n{i}b",
        fwd_s=f,
        bwd_s=f,
        params=params,
        param_bytes=4 * params,
        activation_bytes=act,
        opt_temp_bytes=temp,
        cut_bytes=0,
        cut_tensors=1,
        cut_legal=True,
        is_layer=True,
    )


# --- the rule, by hand -------------------------------------------------------------------------


def test_combine_rule() -> None:
    assert MAX.combine_step_temps([100, 300, 200]) == 300
    assert SUM.combine_step_temps([100, 300, 200]) == 600
    assert MAX.combine_step_temps([]) == SUM.combine_step_temps([]) == 0
    assert OptimizerSpec().step_temp_rule == "sum"  # unmeasured: the rule that never under-estimates


def test_stage_step_term_uses_measured_temporaries() -> None:
    blocks = [blk(0, params=10, temp=100), blk(1, params=20, temp=300), blk(2, params=30, temp=200)]
    assert stage_memory_parts(blocks, 0, 3, MAX).step == 300
    assert stage_memory_parts(blocks, 0, 3, SUM).step == 600
    assert stage_memory_parts(blocks, 0, 1, MAX).step == 100
    # sharded over 4 FSDP replicas: a quarter, rounded up
    assert stage_memory_parts(blocks, 1, 3, SUM, shard=4).step == 125
    assert stage_memory_parts(blocks, 1, 3, MAX, shard=7).step == 43
    # the peak takes the larger of the pipeline phase and the optimizer phase
    fixed = 2 * 4 * 60 + 8 * 60
    assert stage_memory_bytes(blocks, 0, 3, 0, MAX) == fixed + 300
    # one block not measured: the whole stage falls back to 8 B per parameter (AdamW)
    partly = [blocks[0], blk(1, params=20), blocks[2]]
    assert stage_memory_parts(partly, 0, 3, MAX).step == 8 * 60
    assert stage_memory_parts(partly, 2, 3, MAX).step == 200
    # SGD measured at 0 stays 0; unmeasured SGD is 0 too
    sgd = OptimizerSpec(name="sgd", step_temp_rule="max")
    assert stage_memory_parts([blk(0, params=5, temp=0)], 0, 1, sgd).step == 0


def test_older_plans_load_without_the_new_fields(tmp_path) -> None:  # type: ignore[no-untyped-def]
    b = blk(0, params=3).model_dump()
    del b["opt_temp_bytes"]
    assert BlockCost.model_validate(b).opt_temp_bytes is None
    spec = OptimizerSpec.model_validate({"name": "adamw", "lr": 1e-3, "grad_clip": 1.0})
    assert spec.step_temp_rule == "sum"
    assert "step_temp_rule" in Plan.model_json_schema()["$defs"]["OptimizerSpec"]["properties"]


# --- the fast path against the reference ---------------------------------------------------------


@st.composite
def instances(draw: st.DrawFn) -> tuple[list[BlockCost], int, int, OptimizerSpec, str, list[int], int]:
    n = draw(st.integers(1, 9))
    scale = draw(st.sampled_from([1, 2**40, 2**62]))
    measured = draw(st.sampled_from(["all", "none", "some"]))
    blocks = []
    for i in range(n):
        temp: int | None = draw(st.integers(0, 3000)) * scale  # often the term that decides the fit
        if measured == "none" or (measured == "some" and draw(st.booleans())):
            temp = None
        blocks.append(
            BlockCost(
                name=f"b{i}",
                first_node=f"n{i}a",
                last_node=f"n{i}b",
                fwd_s=draw(st.integers(0, 5)) / 4,
                bwd_s=1.0,
                params=draw(st.integers(0, 50)) * scale,
                param_bytes=draw(st.integers(0, 200)) * scale,
                activation_bytes=draw(st.integers(0, 200)) * scale,
                opt_temp_bytes=temp,
                cut_bytes=draw(st.integers(0, 200)) * scale,
                cut_tensors=1,
                output_bytes=draw(st.integers(0, 200)) * scale,
                selective_bytes=draw(st.one_of(st.none(), st.integers(0, 200).map(lambda x: x * scale))),
                bwd_temp_bytes=draw(st.one_of(st.none(), st.integers(0, 200).map(lambda x: x * scale))),
                loss_bytes=draw(st.one_of(st.none(), st.integers(0, 200).map(lambda x: x * scale)))
                if i == n - 1
                else None,
                loss_temp_bytes=draw(st.one_of(st.none(), st.integers(0, 400).map(lambda x: x * scale)))
                if i == n - 1
                else None,
                cut_legal=True,
                is_layer=True,
            )
        )
    optimizer = OptimizerSpec(
        name=draw(st.sampled_from(["adamw", "sgd"])), step_temp_rule=draw(st.sampled_from(["max", "sum"]))
    )
    return (
        blocks,
        draw(st.integers(-5, 8000)) * scale,
        draw(st.integers(1, 9)),
        optimizer,
        draw(st.sampled_from(["never", "auto", "always", "selective", "stage"])),
        draw(st.lists(st.integers(0, 9), min_size=1, max_size=4)),
        draw(st.sampled_from([1, 3])),
    )


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(inst=instances())
def test_fast_memory_path_matches_stage_memory_parts(
    inst: tuple[list[BlockCost], int, int, OptimizerSpec, str, list[int], int],
) -> None:
    blocks, limit, m, optimizer, mode, infl, shard = inst
    n = len(blocks)
    fresh = shard > 1 or m % 2 == 1  # gradients freed between steps, or kept (DDP's buckets)
    mem = solve_mod._MemoryModel(blocks, optimizer, limit, mode, memory_layout(m, shard, fresh=fresh))
    pairs = [(s, e) for s in range(n) for e in range(s + 1, n + 1)]
    for s, e in pairs:
        part = blocks[s:e]
        temps = [b.opt_temp_bytes for b in part]
        # brute force over the range: the sparse table / prefix sums give the same
        if None in temps:
            want = None
        else:
            want = max(temps) if optimizer.step_temp_rule == "max" else sum(temps)  # type: ignore[type-var, arg-type]
        assert mem.sums.temps.of(s, e) == want
        for t in set(infl):
            for r in ("never", "selective", "full", "stage"):
                ref = stage_memory_parts(blocks, s, e, optimizer, r, m, shard).peak(t, fresh)
                assert mem.bytes(s, e, t, r) == ref, (s, e, t, r)
    # the vectorised fit thresholds and the fitting-end bounds agree with the scalar check
    arrays = solve_mod._Arrays(blocks, FREE, mem, mode, infl)
    s_arr = np.array([s for s, _ in pairs], dtype=np.int64)
    e_arr = np.array([e for _, e in pairs], dtype=np.int64)
    n_p = arrays.pre_n[e_arr] - arrays.pre_n[s_arr]
    step = arrays.step_temps.of(s_arr, e_arr, n_p)
    floor = arrays.step_temps.floor(s_arr, e_arr, n_p)
    for i, (s, e) in enumerate(pairs):
        assert step[i] == stage_memory_parts(blocks, s, e, optimizer).step, (s, e)
        assert floor[i] <= step[i]
        if e < n:  # the floor never decreases as the stage grows
            assert floor[i] <= floor[i + 1], (s, e)
    options = {
        "never": ("never",),
        "always": ("full",),
        "selective": ("selective",),
        "stage": ("stage",),
        "auto": ("never", "selective", "full", "stage"),
    }[mode]
    for t in set(infl):  # the bound the fitting ends are searched with is one
        bound = arrays._fit_bound(s_arr, e_arr, t)
        for i, (s, e) in enumerate(pairs):
            assert bound[i] <= min(mem.bytes(s, e, t, r) for r in options), (s, e, t)
    assert_fit_limits_agree(mem, arrays, pairs, infl)


def _brute_bottleneck(blocks: list[BlockCost], p: int, optimizer: OptimizerSpec, limit: int, m: int) -> float | None:
    """The least bottleneck over every split into p stages whose stages all fit (no recomputation)."""
    infl = in_flight_per_stage("1f1b", p, m)
    best = None
    for cuts in itertools.combinations(range(1, len(blocks)), p - 1):
        starts = (0, *cuts)
        bounds = list(zip(starts, (*cuts, len(blocks))))
        if any(
            stage_memory_bytes(blocks, s, e, infl[k], optimizer, False, m) > limit for k, (s, e) in enumerate(bounds)
        ):
            continue
        worst = max(sum(b.fwd_s + b.bwd_s for b in blocks[s:e]) for s, e in bounds)
        best = worst if best is None or worst < best else best
    return best


@settings(max_examples=60, deadline=None)
@given(
    temps=st.lists(st.integers(0, 60), min_size=2, max_size=7),
    times=st.lists(st.integers(1, 4), min_size=7, max_size=7),
    rule=st.sampled_from(["max", "sum"]),
    p=st.integers(1, 3),
    limit=st.integers(0, 200),
)
def test_solver_respects_measured_temporaries(
    temps: list[int], times: list[int], rule: str, p: int, limit: int
) -> None:
    # params 0: only the step temporaries (and activations) take memory, so the rule decides the split
    blocks = [blk(i, temp=t, act=5, f=float(times[i])) for i, t in enumerate(temps)]
    if p > len(blocks):
        return
    optimizer = OptimizerSpec(step_temp_rule=rule)  # type: ignore[arg-type]
    m = 4
    want = _brute_bottleneck(blocks, p, optimizer, limit, m)
    try:
        part = solved(
            blocks,
            p,
            FREE,
            schedule="1f1b",
            n_microbatches=m,
            optimizer=optimizer,
            memory_limit_bytes=limit,
            recompute="never",
        )
    except InfeasibleError:
        assert want is None
        return
    assert want is not None
    mems = stage_memories(blocks, part, schedule="1f1b", n_microbatches=m, optimizer=optimizer)
    assert max(mems) <= limit
    got = max(sum(b.fwd_s + b.bwd_s for b in blocks[s:e]) for s, e in zip(part.starts, (*part.starts[1:], len(blocks))))
    assert math.isclose(got, want)


# --- the round-robin timer (CPU torch) -----------------------------------------------------------


def test_round_robin_times_and_temporaries() -> None:
    from planner.costs.timing import time_optimizer_steps

    torch.manual_seed(0)
    small = [torch.nn.Parameter(torch.randn(64, 64)), torch.nn.Parameter(torch.randn(64))]
    big = torch.nn.Parameter(torch.randn(1_000_000))
    frozen = [torch.nn.Parameter(torch.randn(8), requires_grad=False)]
    before = big.detach().clone()
    steps = time_optimizer_steps([small, [], frozen, [big]], OptimizerSpec(), warmup=1, repeats=2)
    assert steps.seconds[0] > 0 and steps.seconds[3] > 0
    assert steps.seconds[1] == steps.seconds[2] == 0.0
    assert steps.temp_bytes[1] == steps.temp_bytes[2] == 0
    # torch's per-tensor AdamW on CPU: sqrt(exp_avg_sq) and the denominator, 2 x 4 B per element
    assert steps.temp_bytes[3] >= 2 * big.numel() * 4
    assert 0 < steps.temp_bytes[0] < steps.temp_bytes[3]
    # one step over all of them holds one tensor's temporaries at a time: the "max" rule
    assert steps.all_temp_bytes < sum(steps.temp_bytes)
    assert steps.temp_rule == "max"
    assert torch.equal(big.detach(), before)  # copies were stepped, not the parameters

    sgd = time_optimizer_steps([[big]], OptimizerSpec(name="sgd"), warmup=1, repeats=1)
    assert sgd.temp_bytes == [0] and sgd.all_temp_bytes == 0 and sgd.seconds[0] > 0


def test_tied_copies_count_in_temporaries() -> None:
    from planner.costs.timing import time_optimizer_steps

    emb = torch.nn.Parameter(torch.randn(500_000))
    head_bias = torch.nn.Parameter(torch.randn(10))
    steps = time_optimizer_steps([[emb], [head_bias]], OptimizerSpec(), warmup=1, repeats=1, tied=[[], [emb]])
    assert steps.temp_bytes[1] >= 2 * emb.numel() * 4  # the stage steps its own copy of the tied weight
    assert steps.seconds[1] > 0


def test_gradient_passes_are_timed_per_block() -> None:
    """The runner's passes over each block's gradients (average, clip norm, clip), on copies."""
    from planner.costs.timing import time_grad_passes

    big, small = torch.nn.Parameter(torch.randn(512, 512)), torch.nn.Parameter(torch.randn(8))
    frozen = torch.nn.Parameter(torch.randn(64), requires_grad=False)
    times = time_grad_passes([[big], [], [small], [frozen]], clip=True, warmup=1, repeats=3)
    assert times[0] > 0 and times[2] > 0 and times[1] == 0.0 and times[3] == 0.0
    assert big.grad is None and small.grad is None  # copies were stepped, the parameters left alone


def test_gradient_passes_estimate_counts_bytes() -> None:
    """Averaging (read + write), the norm (read) and the clip (read + write): 5 passes of the gradient
    bytes, 3 without clipping, at the memory bandwidth the hardware gets; on a GPU no per-op cost."""
    from planner.core.levers.hardware import get_hardware
    from planner.costs.estimate import grad_pass_seconds

    hw = get_hardware("h100")
    bw = hw.memory_Bps * hw.memory_efficiency
    assert hw.async_launch
    assert grad_pass_seconds(10**6, 4 * 10**6, 3, hw, clip=True) == 5 * 4e6 / bw
    assert grad_pass_seconds(10**6, 4 * 10**6, 3, hw, clip=False) == 3 * 4e6 / bw
    assert grad_pass_seconds(0, 0, 0, hw, clip=True) == 0.0
