"""From block costs and a request to a plan: solve, compare with the baselines, predict, assemble.

Pure module: never imports torch. ``planner.api.make_plan`` calls it once the costs are known
(measured or estimated); the pure tests call it with hand-written costs, so the plan they check
is assembled by exactly the code the command line uses.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from planner.core.predict import predict, slots_of
from planner.core.solve import Partition, param_balanced, solve, uniform_layers
from planner.errors import InfeasibleError
from planner.schema.costs import BlockCost, LinkCost
from planner.schema.plan import ModelRef, Plan, Prediction, ProfileInfo, StagePlan
from planner.schema.request import PlanRequest


def layers_or_all(blocks: Sequence[BlockCost]) -> list[BlockCost]:
    """Blocks for the uniform-layer baseline: a model without repeated layers counts every block."""
    if any(b.is_layer for b in blocks):
        return list(blocks)
    return [b.model_copy(update={"is_layer": True}) for b in blocks]


def compare_methods(
    request: PlanRequest,
    blocks: Sequence[BlockCost],
    link: LinkCost,
    memory_limit_bytes: int | None,
    slots: float | None,
) -> dict[str, tuple[list[StagePlan], Prediction]]:
    """Every partition method's stages and prediction on the same costs.

    Args:
        request: schedule, microbatches, optimizer, recompute policy, the method the plan uses.
        blocks: per-block costs in execution order.
        link: cost of one message between neighbouring ranks.
        memory_limit_bytes: the limit the exact solver respects (None: none).
        slots: ranks that can compute at once (``slots_of``), None when each has its own device.

    Returns:
        method -> (stages, prediction); a baseline that cannot split this model is left out.

    Raises:
        InfeasibleError: the requested method cannot split the model.
    """
    m = request.n_microbatches
    solvers: dict[str, Callable[[], Partition]] = {
        "optimal": lambda: solve(
            blocks,
            request.gpus,
            link,
            schedule=request.schedule,
            n_microbatches=m,
            optimizer=request.optimizer,
            memory_limit_bytes=memory_limit_bytes,
            recompute=request.recompute,
        ),
        "uniform": lambda: uniform_layers(layers_or_all(blocks), request.gpus, link),
        "params": lambda: param_balanced(blocks, request.gpus, link),
    }
    out: dict[str, tuple[list[StagePlan], Prediction]] = {}
    for name, solver in solvers.items():
        try:
            split = solver()
        except InfeasibleError:
            if name == request.method:
                raise
            continue  # a baseline that cannot split this model is left out of the comparison
        out[name] = predict(blocks, split.starts, link, request.schedule, m, request.optimizer, split.recompute, slots)
    return out


def _check_memory(method: str, stages: list[StagePlan], limit: int | None) -> None:
    """The baselines split by layer or parameter counts and know nothing of memory: refuse one that does not fit."""
    if limit is None:
        return
    worst = max(stages, key=lambda st: st.memory_bytes)
    if worst.memory_bytes > limit:
        raise InfeasibleError(
            f"the {method} split needs {worst.memory_bytes / 2**30:.2f} GiB on stage {worst.index} "
            f"({worst.first_block} .. {worst.last_block}), over the {limit / 2**30:.2f} GiB limit; "
            "use --method optimal (it recomputes activations where needed) or raise --memory-limit"
        )


def assemble_plan(
    request: PlanRequest,
    blocks: Sequence[BlockCost],
    link: LinkCost,
    *,
    model: ModelRef,
    profile: ProfileInfo,
    memory_limit_bytes: int | None,
    created: str,
) -> Plan:
    """The plan for ``request`` on these costs: the requested split, with the others for comparison.

    Args:
        request: what the user asked for.
        blocks: per-block costs in execution order (the last block's ``output_bytes`` filled in).
        link: cost of one message between neighbouring ranks.
        model: which model the costs are of.
        profile: where and how the costs were measured or estimated.
        memory_limit_bytes: per-rank limit (the request's, else the device's capacity; None: none).
        created: timestamp recorded in the plan.

    Returns:
        The plan.

    Raises:
        InfeasibleError: the requested split is impossible or does not fit the memory limit.
    """
    predictions = compare_methods(request, blocks, link, memory_limit_bytes, slots_of(profile))
    stages, prediction = predictions[request.method]
    _check_memory(request.method, stages, memory_limit_bytes)
    return Plan(
        created=created,
        model=model,
        profile=profile,
        link=link,
        optimizer=request.optimizer,
        method=request.method,
        schedule=request.schedule,
        n_stages=request.gpus,
        batch_size=request.batch_size,
        n_microbatches=request.n_microbatches,
        blocks=list(blocks),
        stages=stages,
        prediction=prediction,
        baselines={name: pred for name, (_, pred) in predictions.items() if name != request.method},
    )
