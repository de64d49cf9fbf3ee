"""Tier 1 (pure): a stage that recomputes only its first k checkpoint regions ("full:k",
"selective:k"), and ``--recompute auto`` choosing k (``planner.core.levers.partial_recompute``).

Exact bytes and seconds where they follow by hand; property tests against brute force over every
k and mode where they do not.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from plan_factory import ADAMW, layout_of, solved
from pydantic import ValidationError

from planner.core.layout.inputs import Constraints
from planner.core.levers.partial_recompute import fewest_recomputed
from planner.core.levers.recompute import checkpoint_units, rerun_s
from planner.core.split.cuts import Split
from planner.core.split.stage_model import (
    Partition,
    prefix_memory_parts,
    stage_costs,
    stage_memories,
    stage_memory_parts,
)
from planner.core.step.schedules import in_flight_per_stage
from planner.errors import InfeasibleError
from planner.schema.costs import BlockCost, LinkCost, OptimizerSpec, split_recompute
from planner.schema.plan import StagePlan

FREE = LinkCost(name="free", latency_s=0.0, bandwidth_Bps=1.0)


def blk(i: int, act: int = 100, cut: int = 10, **kw: object) -> BlockCost:
    fields: dict[str, object] = {
        "name": f"b{i}",
        "first_node": f"n{i}a",
        "last_node": f"n{i}b",
        "fwd_s": 1.0,
        "bwd_s": 0.0,
        "recompute_s": 1.0,
        "params": 0,
        "param_bytes": 0,
        "activation_bytes": act,
        "cut_bytes": cut,
        "cut_tensors": 1,
        "cut_legal": True,
        "is_layer": True,
    }
    fields.update(kw)
    return BlockCost.model_validate(fields)


def test_a_value_names_a_mode_and_how_many_regions() -> None:
    assert split_recompute("full") == ("full", None)
    assert split_recompute("full:3") == ("full", 3)
    assert split_recompute("selective:12") == ("selective", 12)
    for bad in ("stage:2", "never:1", "full:0", "full:-1", "full:x", "full:", "sometimes"):
        with pytest.raises(ValueError, match="recompute="):
            split_recompute(bad)
    # a plan's stage takes the same values, and refuses the rest
    stage = {
        "index": 0,
        "rank": 0,
        "split_node": "b",
        "start": 0,
        "end": 2,
        "first_block": "a",
        "last_block": "b",
        "params": 0,
        "fwd_s": 0.0,
        "bwd_s": 0.0,
        "comm_s": 0.0,
        "time_s": 0.0,
        "activation_bytes": 0,
        "in_flight": 1,
        "memory_bytes": 0,
    }
    assert StagePlan.model_validate({**stage, "recompute": "full:1"}).recompute == "full:1"
    assert StagePlan.model_validate({**stage, "recompute": True}).recompute == "stage"  # older plans' flag
    with pytest.raises(ValidationError, match="only selective and full apply to some blocks"):
        StagePlan.model_validate({**stage, "recompute": "stage:1"})


def test_the_first_k_regions_recompute_and_the_rest_keep_their_activations() -> None:
    # One stage of four 100-byte blocks with 10-byte cuts, GPipe with 4 microbatches, no parameters.
    # Per live microbatch: a recomputed region keeps its input (0 for the model's first block, else
    # 10), the others their 100 bytes; backward rebuilds one recomputed region (100) at a time, but
    # only after it has freed the other regions' activations (at least 100): nothing on top.
    blocks = [blk(i) for i in range(4)]
    parts = [stage_memory_parts(blocks, 0, 4, ADAMW, f"full:{k}", 4) for k in (1, 2, 3)]
    assert [p.per_microbatch for p in parts] == [300, 210, 120]
    assert [p.once for p in parts] == [0, 0, 0]
    # all four recomputed: the last rebuilt block comes on top of the inputs (full's 100)
    assert stage_memory_parts(blocks, 0, 4, ADAMW, "full", 4).once == 100
    # k = 4 is full, a count past the regions too; k = 0 (no value) is never
    assert stage_memory_parts(blocks, 0, 4, ADAMW, "full:9", 4) == stage_memory_parts(blocks, 0, 4, ADAMW, "full", 4)
    never = stage_memory_parts(blocks, 0, 4, ADAMW, "never", 4)
    assert (never.per_microbatch, never.once) == (400, 0)
    # The first k blocks re-run their forward in backward: k seconds.
    assert [rerun_s(blocks, f"full:{k}") for k in (1, 2, 3)] == [1.0, 2.0, 3.0]
    # Selectively, each recomputed block also keeps 30 bytes and rebuilds the other 70.
    kept = [b.model_copy(update={"selective_bytes": 30, "selective_recompute_s": 0.25}) for b in blocks]
    sel = stage_memory_parts(kept, 0, 4, ADAMW, "selective:2", 4)
    assert (sel.per_microbatch, sel.once) == (0 + 30 + 10 + 30 + 200, 0)  # 70 rebuilt, 200 freed
    assert rerun_s(kept, "selective:2") == 0.5


def test_the_stage_table_shows_what_each_stage_keeps_under_its_recompute_mode() -> None:
    # Two stages of two 100 MiB blocks with 10 MiB cuts: stage 0 recomputes its first block (which keeps
    # its input: none, the model's input), stage 1 both of its blocks (10 MiB each); the plan's stages
    # and the stage table say so, where the blocks' saved activations say 200 MiB for each
    from plan_factory import plan_of_blocks, predicted

    from planner.report.tables import stage_table

    mib = 2**20
    blocks = [blk(i, act=100 * mib, cut=10 * mib) for i in range(4)]
    stages, _ = predicted(blocks, [0, 2], FREE, "1f1b", 4, ADAMW, ["full:1", "full"])  # type: ignore[list-item]
    assert [(s.activation_bytes, s.kept_bytes) for s in stages] == [(200 * mib, 100 * mib), (200 * mib, 20 * mib)]
    plan = plan_of_blocks(blocks).model_copy(update={"stages": stages})
    rows = stage_table(plan).splitlines()
    assert rows[0].split()[10:13] == ["total", "ms", "act"]  # after "(2)": params, fwd, bwd, comm, total, act
    assert [r.split("(2)")[1].split()[5] for r in rows[2:]] == ["100.0", "20.0"]


def test_a_region_of_two_blocks_counts_as_one() -> None:
    # block 1's end is no legal cut: blocks 1 and 2 share a region; "full:2" recomputes blocks 0..2
    # and rebuilds blocks 1 and 2 at once (200) after block 3's 100 are freed
    blocks = [blk(0), blk(1, cut_legal=False), blk(2), blk(3)]
    assert checkpoint_units(blocks, 0, 4) == [(0, 1), (1, 3), (3, 4)]
    part = stage_memory_parts(blocks, 0, 4, ADAMW, "full:2", 4)
    assert (part.per_microbatch, part.once) == (0 + 10 + 100, 100)
    # block 1 re-runs in full (block 2 needs its output), block 2 up to its last save: 3 forwards
    assert rerun_s(blocks, "full:2") == 3.0


@st.composite
def _stages(draw: st.DrawFn) -> list[BlockCost]:
    n = draw(st.integers(1, 6))
    out = []
    for i in range(n):
        act = draw(st.integers(0, 500))
        out.append(
            blk(
                i,
                act=act,
                cut=draw(st.integers(0, 200)),
                cut_legal=i == n - 1 or draw(st.booleans()),
                selective_bytes=draw(st.integers(0, act)),
                bwd_temp_bytes=draw(st.one_of(st.none(), st.integers(0, 300))),
                loss_bytes=draw(st.integers(0, act)) if i == n - 1 else None,
                params=(p := draw(st.integers(0, 50))),
                param_bytes=4 * p,
                recompute_s=draw(st.floats(0, 2)),
                selective_recompute_s=draw(st.floats(0, 1)),
            )
        )
    return out


@settings(max_examples=150, deadline=None)
@given(_stages(), st.sampled_from(["full", "selective"]), st.integers(1, 4), st.integers(1, 3), st.booleans())
def test_every_count_agrees_with_the_plain_modes_at_its_ends(
    blocks: list[BlockCost], mode: str, m: int, shard: int, per_block: bool
) -> None:
    n = len(blocks)
    every = prefix_memory_parts(blocks, 0, n, ADAMW, mode, m, shard, per_block)  # type: ignore[arg-type]
    n_units = len(checkpoint_units(blocks, 0, n))
    assert len(every) == n_units + 1
    assert every[0] == stage_memory_parts(blocks, 0, n, ADAMW, "never", m, shard, per_block)
    assert every[-1] == stage_memory_parts(blocks, 0, n, ADAMW, mode, m, shard, per_block)
    for k in range(1, n_units):
        assert every[k] == stage_memory_parts(blocks, 0, n, ADAMW, f"{mode}:{k}", m, shard, per_block)
    # a stage not at the model's start: its first region keeps the cut it receives
    if n > 1 and blocks[0].cut_legal:
        later = prefix_memory_parts(blocks, 1, n, ADAMW, mode, m, shard, per_block)  # type: ignore[arg-type]
        assert later[-1] == stage_memory_parts(blocks, 1, n, ADAMW, mode, m, shard, per_block)
    times = [rerun_s(blocks, f"{mode}:{k}") for k in range(1, n_units)] + [rerun_s(blocks, mode)]
    assert times == sorted(times)  # more regions, never less recomputation


def test_auto_recomputes_only_the_blocks_that_must() -> None:
    # GPipe, p=2, m=4, four 100-byte blocks with 10-byte cuts (1 byte/s: 20 s of messages a stage).
    # Under 600 bytes no stage fits without recomputing; the solver's whole-stage choice is full
    # (230 / 220 bytes, 2 forwards again each). One block of each is enough: stage [0,2) with its
    # first block recomputed keeps 4 x (0 + 100 + 10 out) + 10 grad + 40 buffers = 490 (its first
    # block is rebuilt after the second's 100 bytes are freed), stage [2,4) 4 x (10 + 100) + 40 = 480.
    blocks = [blk(i) for i in range(4)]
    layout = layout_of("gpipe", 2, 4)
    constraints = Constraints(ADAMW, 600, "auto")
    split = solved(blocks, 2, FREE, schedule="gpipe", n_microbatches=4, memory_limit_bytes=600)
    assert split.starts == (0, 2) and split.recompute == ("full", "full") and split.bottleneck_s == 2 + 2 + 20
    infl = in_flight_per_stage("gpipe", 2, 4)
    narrowed = fewest_recomputed(blocks, split, FREE, layout, constraints, infl)
    assert narrowed.recompute == ("full:1", "full:1") and narrowed.bottleneck_s == 2 + 1 + 20
    assert stage_memories(blocks, narrowed, schedule="gpipe", n_microbatches=4) == [
        490,
        480,
    ]
    # At 489 bytes the first stage needs both blocks; the second still one.
    tight = fewest_recomputed(blocks, split, FREE, layout, Constraints(ADAMW, 489, "auto"), infl)
    assert tight.recompute == ("full", "full:1")
    # An explicit mode applies to every block, as asked; nothing to narrow without a limit.
    assert fewest_recomputed(blocks, split, FREE, layout, Constraints(ADAMW, 600, "full"), infl) is split
    assert fewest_recomputed(blocks, split, FREE, layout, Constraints(ADAMW, None, "auto"), infl) is split


def test_auto_may_trade_selective_everywhere_for_full_on_fewer_blocks() -> None:
    # Selective keeps 60 of each block's 100 bytes and re-runs 0.6 s of its 1 s forward: on all four
    # blocks 4 x (10 in + 60) - 10 (the first has no input) + 40 rebuilt = 310 bytes, 2.4 s. Full
    # on the first block only keeps 0 + 3 x 100 and rebuilds block 0 once the rest is freed: 300
    # bytes, in 1 s.
    blocks = [blk(i, selective_bytes=60, selective_recompute_s=0.6) for i in range(4)]
    layout = layout_of("gpipe", 1, 1)
    assert stage_memory_parts(blocks, 0, 4, ADAMW, "selective", 1).peak(1) == 310
    assert stage_memory_parts(blocks, 0, 4, ADAMW, "full:1", 1).peak(1) == 300
    split = Partition(starts=(0,), bottleneck_s=0.0, recompute=("selective",))
    got = fewest_recomputed(blocks, split, FREE, layout, Constraints(ADAMW, 310, "auto"), [1])
    assert got.recompute == ("full:1",)
    assert got.bottleneck_s == stage_costs(blocks, Split(starts=(0,), recompute=("full:1",)), FREE, "gpipe")[0] == 4 + 1
    # zero-bubble schedules run no selective region: there a full stage only narrows its full count
    zb = layout_of("zbv", 2, 2)
    split = Partition(starts=(0, 2), bottleneck_s=0.0, recompute=("full", "full"))
    narrowed = fewest_recomputed(blocks, split, FREE, zb, Constraints(ADAMW, 10**9, "auto"), [1, 1])
    assert all(not v.startswith("selective") for v in narrowed.recompute)


@settings(max_examples=120, deadline=None)
@given(_stages(), st.integers(1, 4), st.integers(0, 6000), st.sampled_from(["gpipe", "1f1b"]))
def test_the_narrowed_mode_is_the_fastest_that_fits(blocks: list[BlockCost], m: int, limit: int, schedule: str) -> None:
    # Against brute force: every mode on every count of the stage's regions.
    n = len(blocks)
    layout = layout_of(schedule, 1, m)
    infl = in_flight_per_stage(schedule, 1, m)
    constraints = Constraints(OptimizerSpec(), limit, "auto")
    modes = ["selective", "full"]
    n_units = len(checkpoint_units(blocks, 0, n))

    def peak(value: str) -> int:
        return stage_memory_parts(blocks, 0, n, ADAMW, value, m).peak(infl[0], layout.fresh_grads)

    for chosen in modes:
        if peak(chosen) > limit:
            continue
        split = Partition(starts=(0,), bottleneck_s=0.0, recompute=(chosen,))
        try:
            got = (fewest_recomputed(blocks, split, FREE, layout, constraints, infl).recompute or ("never",))[0]
        except InfeasibleError:
            pytest.fail("a fitting split must stay a fitting split")
        assert peak(got) <= limit
        options = [chosen, "never"] + [f"{mode}:{k}" for mode in modes for k in range(1, n_units + 1)]
        best = min(rerun_s(blocks, o) for o in options if peak(o) <= limit)
        assert rerun_s(blocks, got) == best
