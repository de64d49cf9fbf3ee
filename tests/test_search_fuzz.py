"""Property test of the layout search over option combinations (issue 66): whatever a user asks,
the search answers with a plan or a one-line ``PlannerError``, never another exception.

The ``--memory-limit 1e-12`` that reached ``need / limit`` with a limit of 0 bytes (ZeroDivisionError)
was such a combination. Here hypothesis draws the options ``planner plan`` passes to the search (GPUs,
replicas and their mode, FSDP units, batch, microbatches, schedule, method, recomputation, a memory
limit from one byte to far past any device) on random block costs of a CPU or a GPU cluster, and runs
the pure search (``assemble_plan``, as tests/test_plans_unchanged.py does): no profiling, a few
hundredths of a second an example.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_plans_unchanged import REF, _block, profile_of

from planner.core.assemble import Origin, assemble_plan
from planner.core.layout.inputs import asked_of
from planner.core.levers.hardware import get_hardware, node_links
from planner.errors import PlannerError
from planner.schema.costs import LinkCost, OptimizerSpec
from planner.schema.plan import ProfileInfo
from planner.schema.request import PlanRequest

SCHEDULES = ["auto", "1f1b", "gpipe", "interleaved-1f1b", "looped-bfs", "interleaved-zb", "zbv", "dualpipev"]


@st.composite
def options(draw: st.DrawFn) -> dict[str, object]:
    """Options as `planner plan` passes them: mostly consistent (GPUs a multiple of the replicas, a
    batch that splits), sometimes not, so that both the request's refusals and the search are reached."""
    pp = draw(st.integers(1, 4))
    dp = draw(st.sampled_from([1, 2, 3, 4, "auto"]))
    gpus = pp * (dp if isinstance(dp, int) else draw(st.sampled_from([1, 2])))
    m = draw(st.none() | st.sampled_from([pp, 2 * pp, 4 * pp]))
    batch = draw(st.integers(1, 8)) * (m or 1) * (dp if isinstance(dp, int) else 2)
    if draw(st.integers(0, 9)) == 0:  # any numbers at all
        gpus, batch, m = draw(st.integers(1, 16)), draw(st.integers(1, 256)), draw(st.none() | st.integers(1, 32))
    return {
        "gpus": gpus,
        "dp": dp,
        "dp_mode": draw(st.sampled_from(["auto", "ddp", "fsdp", "hsdp"])),
        "fsdp_units": draw(st.sampled_from(["auto", "stage", "block"])),
        "batch_size": batch,
        "microbatches": m,
        "schedule": draw(st.sampled_from(SCHEDULES)),
        "method": draw(st.sampled_from(["optimal", "uniform", "params"])),
        "recompute": draw(st.sampled_from(["auto", "never", "always", "full", "selective"])),
    }


limits = st.none() | st.integers(1, 2**12) | st.integers(2**12, 2**34) | st.just(2**60)


def _cluster(seed: int, gpus: int) -> tuple[LinkCost, ProfileInfo]:
    """A CPU link or a GPU node's links, and the profile of that kind."""
    rng = random.Random(seed)
    gpu = rng.random() < 0.5
    profile = profile_of(gpu, None if gpu else rng.choice([None, 2]))
    if gpu:
        return node_links(get_hardware(rng.choice(["h100", "a100-80g"])), gpus, rng.choice([1, 8])), profile
    return LinkCost(name="l", latency_s=1e-4, bandwidth_Bps=1e9), profile


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), n_blocks=st.integers(2, 10), asked=options(), limit=limits)
def test_any_option_combination_gives_a_plan_or_one_line(
    seed: int, n_blocks: int, asked: dict[str, object], limit: int | None
) -> None:
    rng = random.Random(seed)
    blocks = [_block(rng, i, n_blocks) for i in range(n_blocks)]
    try:
        request = PlanRequest.build(
            model_file="m.py", optimizer=OptimizerSpec(name=rng.choice(["adamw", "sgd"])), **asked
        )
    except PlannerError as e:  # a combination refused up front: one line
        assert "\n" not in str(e) and str(e)
        event("refused by the request")
        return
    link, base = _cluster(seed, request.gpus)
    size = request.microbatch_size
    profile = base.model_copy(update={"microbatch_size": size, "min_microbatch_size": max(1, size // 2)})
    try:
        plan = assemble_plan(asked_of(request, limit), blocks, link, Origin(REF, profile, "t"))
    except PlannerError as e:  # no layout fits, the model has too few blocks, ...: one line
        assert "\n" not in str(e) and str(e), repr(e)
        event("refused by the search")
        return
    event("planned")
    assert plan.world_size == request.gpus and plan.batch_size == request.batch_size
    assert plan.prediction.step_time_s > 0
    if limit is not None:  # a plan is only given where it fits
        assert plan.prediction.max_memory_bytes <= limit, (plan.prediction.max_memory_bytes, limit)
