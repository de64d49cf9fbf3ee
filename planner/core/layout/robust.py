"""How the search's best candidates move on slower hardware than modelled, and which modelled effects carry one layout's lead over another.

Pure module: never imports torch. A candidate is re-priced by predicting its layout and split again
(``evaluate_choice`` with the split given) on the same block costs under a what-if of the hardware
(``Hardware``): every collective and send ``collectives`` times slower (an alpha-beta link's
latency times it and its bandwidth divided by it; an NCCL link's collectives through
``NcclFabric.time_scale``, which scales NCCL's own latencies and bandwidths so and leaves its choice
of algorithm as it was), every compute time ``compute`` times slower (forward, backward, its two
parts, recomputation, cold starts, the optimizer step and gradient work), recomputation's time
``recompute`` times. Nothing else moves: the memory, so what fits, stays.

``SLOW`` is issue 62's what-if: collectives 1.3x, compute 1.1x. Neither is a cost-model constant
(the model keeps its own); they are the margins within which the choice should still hold, about
twice the mean error of the collective model against published nccl-tests bus bandwidths
(docs/collectives.md: 14.2 % mean |error|) and of the roofline's compute against measured GEMMs
(docs/gpu_costs.md). ``robust_rows`` records each fitting row's slowed step
(``Candidate.slow_step_time_s``); ``verdict`` says, from the plan's rows alone, whether the winner
changes under the slowdown and which row wins then (the robust runner-up). Only the rows the plan
keeps are re-priced, so a layout outside them that would win on slow hardware is not named.

``attribute_gap`` splits the predicted step difference between two layouts of the same model and
GPUs (the search's choice and a published one, say) into modelled effects, by removing them one at
a time in a fixed order from both and re-predicting: exposed communication (every collective and
send free), then recomputation (free), then the pipeline's idle share (the bubble of what is left),
and the rest (compute at the layout's microbatch size and tensor-parallel degree, the optimizer).
The parts add up to the difference exactly; the order matters where effects interact (a free
collective shrinks the bubble it filled), and the line it writes names the order. A bench builds the
``Problem`` with ``planner.core.assemble.search_problem`` (its docstring shows the call) and a plan's
layout and split with ``plan_layout``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from planner.core.layout.candidate import Choice, evaluate_choice, rank_blocks
from planner.core.layout.inputs import Cluster, Constraints, Layout, Scaling
from planner.core.layout.search import TIE  # slowed steps within it count as equal, as the search's do
from planner.core.levers.links import Links, NodeLinks
from planner.core.split.cuts import Split
from planner.core.step import predict
from planner.errors import InfeasibleError
from planner.schema.costs import BlockCost, LinkCost
from planner.schema.plan import Candidate, Plan, Prediction

FREE_BANDWIDTH = 1e30
"""Bytes/s of a link whose messages cost nothing (``Hardware(collectives=0)``): a finite stand-in for infinity."""


@dataclass(frozen=True)
class Hardware:
    """A what-if of the hardware: factors on what the model predicts (1: as modelled).

    Attributes:
        collectives: every collective's and send's time times this (0: free).
        compute: every compute time times this.
        recompute: recomputation's time times this, on top of ``compute`` (0: free).
    """

    collectives: float = 1.0
    compute: float = 1.0
    recompute: float = 1.0


SLOW = Hardware(collectives=1.3, compute=1.1)
"""Issue 62's what-if: every collective 1.3x slower, compute 1.1x slower."""


@dataclass(frozen=True)
class Problem:
    """What the search priced its candidates on, to price them again.

    Attributes:
        blocks: per-block costs at ``scaling.size0``, whole (before tensor parallelism), tied copies counted.
        cluster: the ranks and their links.
        constraints: the optimizer, the memory limit the plan was searched under, the recompute policy.
        scaling: how costs carry over to other microbatch sizes.
        batch_size: the global batch.
    """

    blocks: list[BlockCost]
    cluster: Cluster
    constraints: Constraints
    scaling: Scaling
    batch_size: int


def slowed_link(link: Links, factor: float) -> Links:
    """``link`` with every message and collective ``factor`` times slower (0: free).

    Args:
        link: one link, one per boundary, or a ``NodeLinks`` (its inter-node link slowed too).
        factor: the slowdown (1: the link itself).

    Returns:
        The slowed links, of the same shape.
    """
    if factor == 1.0:
        return link
    if isinstance(link, LinkCost):
        return _slowed(link, factor)
    return [_slowed(one, factor) for one in link]


def _slowed(link: LinkCost, factor: float) -> LinkCost:
    """One link (a ``NodeLinks``' inter-node link too) ``factor`` times slower."""
    bandwidth = link.bandwidth_Bps / factor if factor > 0 else FREE_BANDWIDTH
    update: dict[str, object] = {"latency_s": link.latency_s * factor, "bandwidth_Bps": bandwidth}
    if link.nccl is not None:
        update["nccl"] = link.nccl.model_copy(update={"time_scale": link.nccl.time_scale * factor})
    if isinstance(link, NodeLinks):
        update["inter"] = _slowed(link.inter, factor)
    return link.model_copy(update=update)


_COMPUTE = ("fwd_s", "bwd_s", "bwd_input_s", "bwd_weight_s", "fwd_cold_s", "bwd_cold_s", "opt_s", "grad_s", "loss_s")
_RECOMPUTE = ("recompute_s", "selective_recompute_s")


def slowed_blocks(blocks: Sequence[BlockCost], hardware: Hardware) -> list[BlockCost]:
    """The blocks' compute times under ``hardware`` (its ``compute`` and ``recompute`` factors).

    Args:
        blocks: per-block costs.
        hardware: the what-if.

    Returns:
        The blocks (the same objects when both factors are 1).
    """
    if hardware.compute == 1.0 and hardware.recompute == 1.0:
        return list(blocks)
    factors = {name: hardware.compute for name in _COMPUTE} | {
        name: hardware.compute * hardware.recompute for name in _RECOMPUTE
    }
    return [
        b.model_copy(update={k: getattr(b, k) * f for k, f in factors.items() if getattr(b, k) is not None})
        for b in blocks
    ]


def reprice(problem: Problem, layout: Layout, split: Split, hardware: Hardware) -> Prediction:
    """One layout and split predicted again under ``hardware``.

    Args:
        problem: what the search priced on.
        layout: the layout, its data-parallel mode and units resolved (a ``Choice``'s).
        split: its split (stage starts and each stage's recompute).
        hardware: the what-if.

    Returns:
        The prediction.

    Raises:
        InfeasibleError: the layout cannot run these numbers (the schedule refuses them).
    """
    link = slowed_link(problem.cluster.link, hardware.collectives)
    blocks = rank_blocks(slowed_blocks(problem.blocks, hardware), layout, link, problem.scaling, problem.batch_size)
    cluster = replace(problem.cluster, link=link)
    return evaluate_choice(blocks, cluster, layout, problem.constraints, split).prediction


def robust_rows(rows: Sequence[Choice], problem: Problem, hardware: Hardware = SLOW) -> list[Candidate]:
    """The plan's search rows, each that fits with its step under ``hardware`` (``slow_step_time_s``).

    Args:
        rows: the candidates the plan keeps, as the search ranked them.
        problem: what the search priced on.
        hardware: the what-if (``SLOW``).

    Returns:
        The rows as the plan records them.
    """
    out = []
    for choice in rows:
        row = choice.row()
        if choice.fits:
            try:
                slow = reprice(problem, choice.layout, choice.split, hardware).step_time_s
            except InfeasibleError:
                slow = None
            row = row.model_copy(update={"slow_step_time_s": slow})
        out.append(row)
    return out


def chosen_row(plan: Plan) -> int | None:
    """The index of the plan's own layout among its search rows (None: not among them)."""
    for i, c in enumerate(plan.search):
        if (
            c.schedule,
            c.n_microbatches,
            c.stages_per_rank,
            c.dp,
            c.dp_mode,
            c.fsdp_units,
            c.tp,
            c.accumulation,
            c.sequence_parallel,
            c.ep,
            c.cp,
            c.cp_attention,
        ) == (
            plan.schedule,
            plan.n_microbatches,
            plan.stages_per_rank,
            plan.dp,
            plan.dp_mode,
            plan.fsdp_units,
            plan.tp,
            plan.accumulation,
            plan.sequence_parallel,
            plan.ep,
            plan.cp,
            plan.cp_attention,
        ):
            return i
    return None


@dataclass(frozen=True)
class Verdict:
    """What the slowdown does to the choice.

    Attributes:
        chosen: the plan's row among its search rows.
        slow_winner: the row with the least slowed step (the chosen one unless another is faster
            beyond ``TIE``; of rows tied with it, the first in the plan's order).
    """

    chosen: int
    slow_winner: int

    @property
    def flips(self) -> bool:
        """Whether another row wins under the slowdown."""
        return self.slow_winner != self.chosen


def verdict(rows: Sequence[Candidate], chosen: int) -> Verdict | None:
    """Whether the winner changes under the slowdown, from the rows' slowed steps.

    Args:
        rows: the plan's search rows.
        chosen: the plan's row among them.

    Returns:
        The verdict (None: the chosen row was not re-priced).
    """
    mine = rows[chosen].slow_step_time_s
    if mine is None:
        return None
    priced = [(r.slow_step_time_s, i) for i, r in enumerate(rows) if r.fits and r.slow_step_time_s is not None]
    best = min(s for s, _ in priced)
    if best >= mine * (1 - TIE):
        return Verdict(chosen, chosen)
    # rows tied with the fastest: the first in the plan's order (the search's ranking as modelled)
    return Verdict(chosen, next(i for s, i in priced if s <= best * (1 + TIE)))


@dataclass(frozen=True)
class Gap:
    """A predicted step difference between two layouts, split into modelled effects.

    Attributes:
        chosen_s: the chosen layout's step.
        reference_s: the reference layout's step.
        parts: (effect, seconds of the difference ``reference - chosen`` it carries), adding up to it.
    """

    chosen_s: float
    reference_s: float
    parts: tuple[tuple[str, float], ...]

    @property
    def gain(self) -> float:
        """How much faster the chosen layout is: reference / chosen - 1."""
        return self.reference_s / self.chosen_s - 1

    def carried_by(self) -> str:
        """The effect that carries most of the difference."""
        return max(self.parts, key=lambda p: p[1])[0]

    def line(self) -> str:
        """One line: the gain and each effect's share of it, largest first."""
        total = self.reference_s - self.chosen_s
        shares = sorted(self.parts, key=lambda p: -p[1])
        text = ", ".join(f"{name} {s / total:.0%}" if total else f"{name} {s:+.3g} s" for name, s in shares)
        return (
            f"{self.gain:+.1%} faster than the reference ({self.reference_s:.3g} s against {self.chosen_s:.3g} s "
            f"a step): {text} (effects removed in this order: exposed communication, recompute, bubble)"
        )


EFFECTS = ("exposed communication", "recompute", "bubble", "compute and optimizer")
"""The effects ``attribute_gap`` names, in the order it removes them."""


def effects(problem: Problem, layout: Layout, split: Split) -> tuple[float, dict[str, float]]:
    """One layout's step and the seconds of it each of ``EFFECTS`` carries (they add up to the step).

    Args:
        problem: what the search priced on.
        layout: the layout (modes resolved).
        split: its split.

    Returns:
        (the step, seconds per effect).
    """
    step = reprice(problem, layout, split, Hardware()).step_time_s
    free_comm = reprice(problem, layout, split, Hardware(collectives=0.0))
    bare = reprice(problem, layout, split, Hardware(collectives=0.0, recompute=0.0))
    idle = bare.pipeline_time_s * bare.bubble_fraction
    parts = {
        EFFECTS[0]: step - free_comm.step_time_s,
        EFFECTS[1]: free_comm.step_time_s - bare.step_time_s,
        EFFECTS[2]: idle,
        EFFECTS[3]: bare.step_time_s - idle,
    }
    return step, parts


def attribute_gap(
    problem: Problem,
    chosen: tuple[Layout, Split],
    reference: tuple[Layout, Split],
    reference_problem: Problem | None = None,
) -> Gap:
    """The predicted step difference between ``reference`` and ``chosen``, split into ``EFFECTS``.

    Args:
        problem: what the choice was priced on (the model, GPUs and batch).
        chosen: the search's choice (layout, split).
        reference: the layout compared with (a published one, at the planner's split for it).
        reference_problem: what the reference was priced on, where its plan came from another
            request (``--tp 8`` against ``--tp auto``: the blocks' tensor-parallel shares are the
            request's); None: ``problem``. Each layout is re-priced on its own, to its plan's step.

    Returns:
        The difference and its parts (``reference``'s seconds of each effect minus ``chosen``'s).

    Raises:
        InfeasibleError: either layout cannot run these numbers.
    """
    mine, mine_parts = effects(problem, *chosen)
    ref, ref_parts = effects(reference_problem or problem, *reference)
    parts = tuple((name, ref_parts[name] - mine_parts[name]) for name in EFFECTS)
    return Gap(mine, ref, parts)


def plan_layout(plan: Plan) -> tuple[Layout, Split]:
    """A plan's layout and split, as ``reprice`` and ``attribute_gap`` take them.

    Args:
        plan: the plan.

    Returns:
        (layout, split).
    """
    return predict.plan_layout(plan), Split.of(plan.prediction)


__all__ = [
    "EFFECTS",
    "SLOW",
    "Gap",
    "Hardware",
    "Problem",
    "Verdict",
    "attribute_gap",
    "chosen_row",
    "effects",
    "plan_layout",
    "reprice",
    "robust_rows",
    "slowed_blocks",
    "slowed_link",
    "verdict",
]
