"""Hand-made plans for the pure tests (no torch, no profiling): exact numbers, known answers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from planner.core.assemble import Origin, assemble_plan
from planner.core.layout.inputs import Cluster, Constraints, Layout, Scaling, SearchSpace, asked_of
from planner.core.layout.search import Choice, search
from planner.core.levers.links import Links
from planner.core.split.cuts import Split
from planner.core.split.solve import solve
from planner.core.split.stage_model import Partition
from planner.core.step.predict import predict
from planner.core.step.schedules import placement
from planner.schema.costs import BlockCost, LinkCost, OptimizerSpec
from planner.schema.plan import ModelRef, Plan, Prediction, ProfileInfo, StagePlan
from planner.schema.request import PlanRequest

MB = 2**20
# A link with no fixed cost and 1 MB/ms, so comm times are easy to check by hand.
LINK = LinkCost(name="test-link", latency_s=0.0, bandwidth_Bps=MB * 1000.0)
ADAMW = OptimizerSpec()


def block(
    name: str, fwd_ms: float, bwd_ms: float, params: int, *, layer: bool = True, act_mb: int = 1, cut_mb: int = 1
) -> BlockCost:
    """A block with times in ms and sizes in MB (fp32 parameters)."""
    return BlockCost(
        name=name,
        first_node=f"{name}_first",
        last_node=f"{name}_last",
        fwd_s=fwd_ms / 1e3,
        bwd_s=bwd_ms / 1e3,
        params=params,
        param_bytes=4 * params,
        activation_bytes=act_mb * MB,
        cut_bytes=cut_mb * MB,
        cut_tensors=1,
        cut_legal=True,
        is_layer=layer,
    )


def big_head_blocks() -> list[BlockCost]:
    """An embedding, four equal layers and an output layer as costly as 2.5 layers (large vocabulary)."""
    return (
        [block("embed", 1, 1, 1000, layer=False)]
        + [block(f"layers.{i}", 10, 20, 5000) for i in range(4)]
        + [block("output", 25, 50, 8000, layer=False)]
    )


def plan_of_blocks(
    blocks: list[BlockCost],
    n_stages: int = 2,
    schedule: str = "1f1b",
    m: int = 4,
    method: str = "optimal",
    memory_limit_bytes: int | None = None,
    accumulation: int | str = "auto",
) -> Plan:
    """Assemble a Plan from given block costs with the same code ``planner plan`` uses."""
    request = PlanRequest.build(
        model_file="models/example.py",
        gpus=n_stages,
        schedule=schedule,
        method=method,
        batch_size=4 * m,
        microbatches=m,
        accumulation=accumulation,
    )
    return assemble_plan(
        asked_of(request, memory_limit_bytes),
        blocks,
        LINK,
        Origin(
            ModelRef(
                path="models/example.py",
                size="tiny",
                config={"n_layers": 4},
                file_digest="0" * 16,
                fingerprint="f" * 16,
                trace_method="fx",
                trace_failures=[],
                seed=0,
            ),
            ProfileInfo(
                device="cpu", backend="gloo", threads=1, torch_version="2.13.0", hostname="test", warmup=2, repeats=5
            ),
            "2026-11-21T00:00:00+00:00",
        ),
    )


def memory_layout(m: int, shard: int = 1, per_block: bool = False, fresh: bool = False) -> Layout:
    """A one-rank layout whose memory terms are these: ``m`` microbatches, the state sharded over
    ``shard`` replicas (FSDP; 1: DDP over two, or one replica when ``fresh``), block by block or not,
    and gradients freed between steps (``Layout.fresh_grads``) or kept (DDP's buckets, or two passes)."""
    dp = shard if shard > 1 else (1 if fresh else 2)
    units = "block" if per_block else "stage"
    passes = 2 if shard > 1 and not fresh else 1
    layout = Layout("gpipe", 1, m, dp=dp, dp_mode="fsdp" if shard > 1 else "ddp", accumulation=passes, fsdp_units=units)
    assert layout.fresh_grads == fresh and layout.shard == shard
    return layout


def assert_fit_limits_agree(mem: Any, arrays: Any, pairs: list[tuple[int, int]], infl: list[int]) -> None:
    """The solver's vectorised fit thresholds and fitting-end bounds (``solve._Arrays``) agree with its
    scalar memory check (``solve._MemoryModel.bytes`` against its limit) for every stage ``pairs`` and in-flight count."""
    import numpy as np

    from planner.core.split import solve as solve_mod

    s_arr = np.array([s for s, _ in pairs], dtype=np.int64)
    e_arr = np.array([e for _, e in pairs], dtype=np.int64)
    fits = arrays.fit_limits(s_arr, e_arr)  # per mode: never, selective, full, stage
    modes = ("never", "selective", "full", "stage")
    order = mem.options  # the policy's modes, in the order they are tried
    last = dict(zip(arrays.starts.tolist(), arrays.last_fit(min(infl)).tolist()))
    for i, (s, e) in enumerate(pairs):
        for t in set(infl):
            # the scalar model: the first of the policy's modes whose bytes fit the limit
            want = next((mode for mode in order if mem.bytes(s, e, t, mode) <= mem.limit), None)
            got = next((mode for mode in order if t <= fits[modes.index(mode)][i]), None)
            assert got == want, (s, e, t)
            # what solve() records as the stage's mode reads the same rows
            assert solve_mod._stage_modes(arrays, [(s, e)], [t]) == [want or "never"], (s, e, t)
            for mode in modes:  # a mode the policy rules out fits nothing
                assert mode in order or fits[modes.index(mode)][i] == -1
            if want is not None:
                assert e <= last[s], (s, e, t)


def layout_of(
    schedule: str, n_stages: int, n_microbatches: int, stages_per_rank: int | None = None, shard: int = 1
) -> Layout:
    """The layout of ``n_stages`` stages under ``schedule`` (stages per rank: 2 under a V, else 1,
    unless given), sharded over ``shard`` FSDP replicas."""
    v = stages_per_rank or (2 if placement(schedule) == "v" else 1)
    return Layout(schedule, n_stages // v, n_microbatches, v, dp=shard, dp_mode="fsdp" if shard > 1 else "ddp")


def solved(
    blocks: Sequence[BlockCost],
    n_stages: int,
    link: Links,
    *,
    schedule: str = "1f1b",
    n_microbatches: int,
    optimizer: OptimizerSpec = ADAMW,
    memory_limit_bytes: int | None = None,
    recompute: str = "auto",
    in_flight: Sequence[int] | None = None,
    shard: int = 1,
    stages_per_rank: int | None = None,
) -> Partition:
    """``solve`` for ``n_stages`` stages, its layout and constraints spelled as keywords."""
    layout = layout_of(schedule, n_stages, n_microbatches, stages_per_rank, shard)
    return solve(blocks, link, layout, Constraints(optimizer, memory_limit_bytes, recompute), in_flight)


def predicted(
    blocks: Sequence[BlockCost],
    starts: Sequence[int],
    link: Links,
    schedule: str,
    n_microbatches: int,
    optimizer: OptimizerSpec,
    recompute: Sequence[bool] = (),
    slots: float | None = None,
    stages_per_rank: int = 1,
    dp: int = 1,
    dp_mode: str = "ddp",
) -> tuple[list[StagePlan], Prediction]:
    """``predict`` for a split of ``len(starts)`` stages, its layout spelled as arguments."""
    # rounded down: predict refuses a split whose stages do not spread evenly over the ranks
    layout = Layout(schedule, len(starts) // stages_per_rank, n_microbatches, stages_per_rank, dp, dp_mode)
    return predict(blocks, Split(starts=tuple(starts), recompute=tuple(recompute)), link, layout, optimizer, slots)


def searched(
    blocks: Sequence[BlockCost],
    link: Links = LINK,
    *,
    n_ranks: int,
    batch_size: int,
    size0: int,
    fixed_fraction: float = 0.0,
    min_microbatch_size: int = 1,
    schedule: str = "auto",
    n_microbatches: int | None = None,
    stages_per_rank: int | None = None,
    optimizer: OptimizerSpec = ADAMW,
    memory_limit_bytes: int | None = None,
    recompute: str = "auto",
    slots: float | None = None,
    replicas: Sequence[int] = (1,),
    dp_mode: str = "ddp",
) -> tuple[Choice, list[Choice], str]:
    """``search`` over ``n_ranks`` ranks in all, its cluster, space, constraints and scaling spelled as keywords."""
    return search(
        blocks,
        Cluster(n_ranks, link, slots),
        SearchSpace(batch_size, schedule, n_microbatches, stages_per_rank, tuple(replicas), dp_mode),
        Constraints(optimizer, memory_limit_bytes, recompute),
        Scaling(size0, fixed_fraction, min_microbatch_size),
    )
