"""Pure-tier tests of planner.core.solve: exactness against brute force, hand cases, baselines, purity."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.core.schedules import SCHEDULES, action_order, peak_in_flight
from planner.core.solve import (
    Partition,
    evaluate,
    param_balanced,
    solve,
    stage_costs,
    stage_memories,
    stage_memory_bytes,
    stage_time_parts,
    uniform_layers,
)
from planner.errors import InfeasibleError
from planner.schema.costs import BlockCost, LinkCost, OptimizerSpec

FREE = LinkCost(name="free", latency_s=0.0, bandwidth_Bps=1.0)  # with cut_bytes=0: no communication
SGD = OptimizerSpec(name="sgd")


def blk(
    i: int,
    f: float,
    b: float = 0.0,
    *,
    params: int = 0,
    param_bytes: int = 0,
    act: int = 0,
    cut: int = 0,
    legal: bool = True,
    layer: bool = True,
) -> BlockCost:
    return BlockCost(
        name=f"b{i}",
        first_node=f"n{i}a",
        last_node=f"n{i}b",
        fwd_s=f,
        bwd_s=b,
        params=params,
        param_bytes=param_bytes,
        activation_bytes=act,
        cut_bytes=cut,
        cut_tensors=1,
        cut_legal=legal,
        is_layer=layer,
    )


def times(ts: list[float], **kw: object) -> list[BlockCost]:
    return [blk(i, t, **kw) for i, t in enumerate(ts)]  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Brute force
# ---------------------------------------------------------------------------------------------


def brute(
    blocks: list[BlockCost],
    p: int,
    link: LinkCost,
    schedule: str,
    m: int,
    optimizer: OptimizerSpec,
    limit: int | None,
    recompute: str = "never",
) -> list[tuple[tuple[int, ...], float, float]]:
    """Every feasible partition as (starts, bottleneck, sum of stage costs).

    Each stage takes the cheapest option that fits: without recomputation unless ``recompute`` is
    "always" or it does not fit; with recomputation when allowed ("auto", "always") and it fits.
    """
    n = len(blocks)
    if p > n or (schedule == "1f1b" and m < p):
        return []
    infl = [peak_in_flight(o) for o in action_order(schedule, p, m)]
    cuts = [c for c in range(1, n) if blocks[c - 1].cut_legal]
    cap = math.inf if limit is None else limit
    out = []
    for combo in itertools.combinations(cuts, p - 1):
        starts = (0, *combo)
        ends = list(starts[1:]) + [n]
        flags = []
        for k, (s, e) in enumerate(zip(starts, ends)):
            options = {"never": [False], "auto": [False, True], "always": [True]}[recompute]
            fit = [r for r in options if stage_memory_bytes(blocks, s, e, infl[k], optimizer, r, m) <= cap]
            flags.append(fit[0] if fit else None)
        if None in flags:
            continue
        costs = stage_costs(blocks, starts, link, flags)
        out.append((starts, max(costs), sum(costs)))
    return out


# Times on a 0.01 grid and bandwidths that give comm times on a 0.001 grid: distinct partitions then
# differ by far more than the solver's 1e-9 tie tolerance, so "optimal" and "tied" mean the same
# thing to the solver and to brute force. (Free floats made hypothesis find partitions 8e-9 s apart,
# which the solver rightly treats as a tie and the strict brute force did not.)
time_st = st.integers(0, 500).map(lambda x: x / 100)


@st.composite
def instances(draw: st.DrawFn) -> tuple[list[BlockCost], int, LinkCost, str, int, OptimizerSpec, int | None]:
    n = draw(st.integers(1, 9))
    blocks = [
        blk(
            i,
            draw(time_st),
            draw(time_st),
            params=draw(st.integers(0, 50)),
            param_bytes=draw(st.integers(0, 200)),
            act=draw(st.integers(0, 100)),
            cut=draw(st.integers(0, 100)),
            legal=draw(st.booleans()) or draw(st.booleans()),  # 75 % legal
        )
        for i in range(n)
    ]
    p = draw(st.integers(1, n))
    link = LinkCost(
        name="l",
        latency_s=draw(st.sampled_from([0.0, 0.25, 1.0])),
        bandwidth_Bps=draw(st.sampled_from([10.0, 100.0, 1000.0])),
    )
    schedule = draw(st.sampled_from(SCHEDULES))
    m = draw(st.integers(1, 10))
    optimizer = draw(st.sampled_from([SGD, OptimizerSpec()]))
    limit = draw(st.one_of(st.none(), st.integers(0, 4000)))
    recompute = draw(st.sampled_from(["never", "auto", "always"]))
    return blocks, p, link, schedule, m, optimizer, limit, recompute


@settings(max_examples=200, deadline=None)
@given(inst=instances())
def test_solve_matches_brute_force(
    inst: tuple[list[BlockCost], int, LinkCost, str, int, OptimizerSpec, int | None],
) -> None:
    blocks, p, link, schedule, m, optimizer, limit, recompute = inst
    feasible = brute(blocks, p, link, schedule, m, optimizer, limit, recompute)
    if not feasible:
        with pytest.raises(InfeasibleError) as err:
            solve(
                blocks,
                p,
                link,
                schedule=schedule,
                n_microbatches=m,
                optimizer=optimizer,
                memory_limit_bytes=limit,
                recompute=recompute,
            )
        msg = str(err.value)
        if "smallest stage count that fits is" in msg:
            q = int(msg.split("smallest stage count that fits is ")[1].split(":")[0])
            assert q > p and brute(blocks, q, link, schedule, m, optimizer, limit, recompute)
            for smaller in range(p + 1, q):
                if schedule == "gpipe" or m >= smaller:
                    assert not brute(blocks, smaller, link, schedule, m, optimizer, limit, recompute)
        return
    part = solve(
        blocks,
        p,
        link,
        schedule=schedule,
        n_microbatches=m,
        optimizer=optimizer,
        memory_limit_bytes=limit,
        recompute=recompute,
    )
    opt = min(b for _, b, _ in feasible)
    assert math.isclose(part.bottleneck_s, opt, rel_tol=1e-9, abs_tol=1e-12)
    optimal = [(s, b, c) for s, b, c in feasible if b <= opt + 1e-9 * max(1.0, opt)]
    assert part.starts in [s for s, _, _ in optimal]
    best_sum = min(c for _, _, c in optimal)
    ours_sum = sum(stage_costs(blocks, part.starts, link, part.recompute))
    assert math.isclose(ours_sum, best_sum, rel_tol=1e-9, abs_tol=1e-12)
    tied = sorted(s for s, _, c in optimal if c <= best_sum + 1e-9 * max(1.0, best_sum))
    assert part.starts == tied[0]
    if limit is not None:
        assert (
            max(
                stage_memories(
                    blocks,
                    part.starts,
                    schedule=schedule,
                    n_microbatches=m,
                    optimizer=optimizer,
                    recompute=part.recompute,
                )
            )
            <= limit
        )


# ---------------------------------------------------------------------------------------------
# Hand cases
# ---------------------------------------------------------------------------------------------


def test_even_split() -> None:
    assert solve(times([1, 1, 1, 1]), 2, FREE, n_microbatches=4) == Partition(starts=(0, 2), bottleneck_s=2.0)


def test_heavy_first_block() -> None:
    assert solve(times([4, 1, 1, 1, 1]), 2, FREE, n_microbatches=4) == Partition(starts=(0, 1), bottleneck_s=4.0)


def test_equal_bottleneck_prefers_smallest_starts() -> None:
    # (0,1): max(1, 3) = 3; (0,2): max(3, 1) = 3; same total -> lexicographically smallest.
    assert solve(times([1, 2, 1]), 2, FREE, n_microbatches=2).starts == (0, 1)


def test_equal_bottleneck_prefers_less_communication() -> None:
    # link 10 B/s, no latency: cut after b0 costs 0.1 s per message, after b1 0.5 s, after b2 0.1 s.
    link = LinkCost(name="slow", latency_s=0.0, bandwidth_Bps=10.0)
    blocks = [blk(0, 4.0, cut=1), blk(1, 1.0, cut=5), blk(2, 1.0, cut=1), blk(3, 1.0, cut=0)]
    # (0,1,2): 4.2, 2.2, 3.0 (sum 9.4); (0,1,3): 4.2, 2.4, 1.2 (sum 7.8): same bottleneck 4.2.
    part = solve(blocks, 3, link, n_microbatches=4)
    assert part.starts == (0, 1, 3)
    assert math.isclose(part.bottleneck_s, 4.2)
    assert [round(c, 12) for c in stage_costs(blocks, (0, 1, 3), link)] == [4.2, 2.4, 1.2]
    assert math.isclose(stage_time_parts(blocks, 1, 3, link)[2], 0.2)  # per direction; gradients pay the same


def test_big_head_beats_uniform_layers() -> None:
    # embedding (1 s, not a layer) + 8 layers (1 s) + vocabulary head (4 s, not a layer), 2 stages.
    blocks = [blk(0, 1.0, layer=False)] + [blk(i, 1.0) for i in range(1, 9)] + [blk(9, 4.0, layer=False)]
    uni = uniform_layers(blocks, 2, FREE)
    assert uni == Partition(starts=(0, 5), bottleneck_s=8.0)  # 1 + 4 layers | 4 layers + head
    best = solve(blocks, 2, FREE, n_microbatches=8)
    # (0,6): 6 | 7 and (0,7): 7 | 6 tie at 7 with equal sums -> smallest starts.
    assert best == Partition(starts=(0, 6), bottleneck_s=7.0)


def test_illegal_cut_forces_other_split() -> None:
    blocks = times([1, 1, 1, 1])
    blocks[1] = blk(1, 1.0, legal=False)  # no cut between b1 and b2
    assert solve(blocks, 2, FREE, n_microbatches=2) == Partition(starts=(0, 1), bottleneck_s=3.0)
    with pytest.raises(InfeasibleError, match="not legal"):
        evaluate(blocks, (0, 2), FREE)


def test_too_few_legal_cuts_or_blocks() -> None:
    blocks = [blk(0, 1.0, legal=False), blk(1, 1.0, legal=False), blk(2, 1.0)]
    with pytest.raises(InfeasibleError, match="only 0 legal cut"):
        solve(blocks, 2, FREE, n_microbatches=2)
    with pytest.raises(InfeasibleError, match="is more than the model's 3 blocks"):
        solve(blocks, 4, FREE, n_microbatches=4)
    with pytest.raises(InfeasibleError, match="needs at least one microbatch per stage"):
        solve(times([1, 1, 1]), 3, FREE, n_microbatches=2, schedule="1f1b")


def test_memory_limit_forces_split_and_names_stage_count() -> None:
    # sgd: params + grads = 2 * 100 = 200 bytes per block; limit 400 -> at most 2 blocks per stage.
    blocks = times([3, 1, 1, 1], param_bytes=100)
    assert solve(blocks, 2, FREE, n_microbatches=1, schedule="gpipe", optimizer=SGD).starts == (0, 1)
    limited = solve(blocks, 2, FREE, n_microbatches=1, schedule="gpipe", optimizer=SGD, memory_limit_bytes=400)
    assert limited == Partition(starts=(0, 2), bottleneck_s=4.0)
    with pytest.raises(InfeasibleError, match="smallest stage count that fits is 2"):
        solve(blocks, 1, FREE, n_microbatches=1, schedule="gpipe", optimizer=SGD, memory_limit_bytes=400)
    with pytest.raises(InfeasibleError, match="block 'b0' alone needs 200 bytes"):
        solve(blocks, 1, FREE, n_microbatches=1, schedule="gpipe", optimizer=SGD, memory_limit_bytes=150)


def test_memory_uses_in_flight_of_each_stage() -> None:
    # 100 activation bytes per block and microbatch; 1F1B, p=2, m=4: stage 0 holds 2, stage 1 holds 1.
    blocks = times([1, 1, 1, 1], act=100)
    part = solve(blocks, 2, FREE, n_microbatches=4, schedule="1f1b", memory_limit_bytes=350, recompute="never")
    assert part == Partition(starts=(0, 1), bottleneck_s=3.0)  # (0,2) would need 400 on stage 0
    assert stage_memories(blocks, part.starts, schedule="1f1b", n_microbatches=4) == [200, 300]
    # GPipe keeps all 4 microbatches on every stage: even one block needs 400.
    with pytest.raises(InfeasibleError, match="alone needs 400 bytes"):
        solve(blocks, 2, FREE, n_microbatches=4, schedule="gpipe", memory_limit_bytes=350, recompute="never")


def test_recompute_auto_makes_a_plan_fit() -> None:
    # GPipe, p=2, m=4, 100 activation bytes per block and microbatch, 10-byte cuts. Without
    # recomputation one block alone holds 4 x 100 = 400 > 300. Recomputing, a stage keeps its
    # 10-byte input and its 10-byte cached output per live microbatch plus one microbatch's
    # activations: stage [0,2) needs 4*(0+10) + 200 + 10 (output grad) + 4*10 (receive buffers) = 290,
    # stage [2,4) 4*(10+0) + 200 + 0 + 4*10 = 280.
    blocks = [b.model_copy(update={"recompute_s": b.fwd_s}) for b in times([1, 1, 1, 1], act=100, cut=10)]
    part = solve(blocks, 2, FREE, n_microbatches=4, schedule="gpipe", memory_limit_bytes=300)
    assert part.starts == (0, 2) and part.recompute == (True, True)
    # 2 blocks x (forward 1 + forward again in backward 1) + the 10-byte boundary each way at 1 B/s.
    assert part.bottleneck_s == 4.0 + 20.0
    assert stage_memories(blocks, part.starts, schedule="gpipe", n_microbatches=4, recompute=part.recompute) == [
        290,
        280,
    ]
    # Only the stage that does not fit recomputes: 1F1B keeps 2 microbatches on stage 0, 1 on stage 1.
    part = solve(blocks, 2, FREE, n_microbatches=4, schedule="1f1b", memory_limit_bytes=300)
    assert part.starts == (0, 2) and part.recompute == (True, False)
    # Without a limit nothing recomputes; "always" recomputes everywhere.
    assert solve(blocks, 2, FREE, n_microbatches=4).recompute == ()
    assert solve(blocks, 2, FREE, n_microbatches=4, recompute="always").recompute == (True, True)


def test_stage_memory_formula() -> None:
    blocks = [
        blk(0, 1.0, params=10, param_bytes=40, act=3, cut=7),
        blk(1, 1.0, params=20, param_bytes=80, act=5, cut=11),
        blk(2, 1.0, cut=13),
    ]
    # adamw, fp32, stage [0,2), 4 in flight, m = 1:
    #   static   = (40+80) * 2 (weights + grads) + 30 * 8 (two fp32 moments)  = 480
    #   buffers  = m * (0 in (first stage) + 11 out)                          = 11
    #   pipeline = 4 * ((3+5) activations + 11 cached output) + 11 its grad   = 87
    #   step     = 30 * 8 (AdamW's two fp32 temporaries)                      = 240
    assert stage_memory_bytes(blocks, 0, 2, 4, OptimizerSpec()) == 480 + 11 + max(87, 240)
    assert stage_memory_bytes(blocks, 0, 2, 4, OptimizerSpec(), n_microbatches=8) == 480 + 88 + max(87, 240)
    # last stage [1,3) with SGD (no state, no temporaries), 1 in flight: 80 * 2 + 7 in + 1 * 5
    assert stage_memory_bytes(blocks, 1, 3, 1, SGD) == 160 + 7 + 5
    # the last stage keeps the model output per live microbatch (output_bytes of the last block)
    with_output = blocks[:2] + [blocks[2].model_copy(update={"output_bytes": 100})]
    assert stage_memory_bytes(with_output, 1, 3, 2, SGD) == 160 + 7 + 2 * (5 + 100) + 100


def test_stage_memory_mixed_precision_keeps_fp32_master() -> None:
    # bf16 parameters (2 B each): weights 2 + grads 2 + fp32 master 4 + two fp32 moments 8 = 16 B per
    # parameter, ZeRO's "2 + 2 + 12"; AdamW's step adds two fp32 temporaries (8 B).
    blocks = [blk(0, 1.0, params=1000, param_bytes=2000), blk(1, 1.0)]
    assert stage_memory_bytes(blocks, 0, 1, 0, OptimizerSpec()) == 16 * 1000 + 8 * 1000
    assert stage_memory_bytes(blocks, 0, 1, 0, SGD) == 8 * 1000


# ---------------------------------------------------------------------------------------------
# Baselines
# ---------------------------------------------------------------------------------------------


def test_uniform_layers_uneven() -> None:
    # 7 layers over 3 stages: 3, 2, 2 (extra layers to the earliest stages, as torchtitan).
    assert uniform_layers(times([1] * 7), 3, FREE).starts == (0, 3, 5)
    # with a leading embedding and a trailing head (non-layers): layers are blocks 1..7.
    blocks = [blk(0, 1.0, layer=False)] + [blk(i, 1.0) for i in range(1, 8)] + [blk(8, 1.0, layer=False)]
    part = uniform_layers(blocks, 3, FREE)
    assert part == Partition(starts=(0, 4, 6), bottleneck_s=4.0)


def test_uniform_layers_non_layer_stays_with_preceding_layer() -> None:
    blocks = [blk(0, 1.0), blk(1, 1.0), blk(2, 1.0, layer=False), blk(3, 1.0), blk(4, 1.0)]
    assert uniform_layers(blocks, 2, FREE).starts == (0, 3)


def test_uniform_layers_moves_illegal_cut_to_nearest_legal() -> None:
    blocks = times([1] * 6)
    blocks[2] = blk(2, 1.0, legal=False)  # target start 3 is illegal; 2 and 4 are both 1 away
    assert uniform_layers(blocks, 2, FREE).starts == (0, 2)
    blocks[1] = blk(1, 1.0, legal=False)  # now only 4 is 1 away
    assert uniform_layers(blocks, 2, FREE).starts == (0, 4)
    with pytest.raises(InfeasibleError, match="layer blocks"):
        uniform_layers(times([1, 1], layer=False), 2, FREE)


def test_param_balanced() -> None:
    blocks = [blk(i, 1.0, params=p) for i, p in enumerate([10, 1, 1, 1, 1, 1, 10])]
    part = param_balanced(blocks, 3, FREE)
    assert part == Partition(starts=(0, 1, 6), bottleneck_s=5.0)  # params 10 | 5 | 10
    # all equal: max 3 params per stage; ties fill the earlier stages first (DeepSpeed's greedy probe).
    assert param_balanced(times([1] * 7, params=1), 3, FREE).starts == (0, 3, 6)
    # an illegal cut is respected: after block 0 is not cuttable.
    blocks[0] = blk(0, 1.0, params=10, legal=False)
    assert param_balanced(blocks, 3, FREE).starts == (0, 2, 6)  # 11 | 4 | 10


# ---------------------------------------------------------------------------------------------
# Scale and purity
# ---------------------------------------------------------------------------------------------


def test_large_instance_is_fast() -> None:
    link = LinkCost(name="l", latency_s=1e-3, bandwidth_Bps=1e9)
    blocks = [blk(i, 0.001 * (1 + i % 7), 0.002, param_bytes=1000, act=500, cut=4096) for i in range(90)]
    t0 = time.perf_counter()
    part = solve(blocks, 64, link, n_microbatches=64, memory_limit_bytes=10**6)
    assert time.perf_counter() - t0 < 3.0
    assert len(part.starts) == 64
    t0 = time.perf_counter()
    solve(blocks, 30, link, n_microbatches=64, memory_limit_bytes=10**6)
    assert time.perf_counter() - t0 < 3.0


def test_pure_modules_do_not_import_torch() -> None:
    code = "import planner.core.solve, planner.core.simulate, planner.core.schedules, planner.schema.costs, sys; assert 'torch' not in sys.modules"
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr


def test_unknown_recompute_cost_is_charged_as_the_whole_forward() -> None:
    # recompute_s None (not measured): a recomputing stage pays its blocks' forward again in backward.
    blocks = times([1, 1, 1, 1], act=100, cut=10)
    assert all(b.recompute_s is None for b in blocks)
    always = solve(blocks, 2, FREE, n_microbatches=4, recompute="always")
    never = solve(blocks, 2, FREE, n_microbatches=4, recompute="never")
    assert always.recompute == (True, True)
    fwd = sum(b.fwd_s for b in blocks[: always.starts[1]])
    assert always.bottleneck_s == pytest.approx(never.bottleneck_s + fwd)
