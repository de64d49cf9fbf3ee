"""What FSDP costs a layout at least, over every split: the time of its collectives (``fsdp_traffic``,
with DDP's all-reduce beside them) and the bytes it holds unsharded or keeps in fp32
(``unsharded_floor``, ``master_floor``).

Pure module: never imports torch. ``planner.core.layout.bounds.floors`` adds these to a layout's step
and memory floors; like them, they are computed once per set of block costs (and replica layout), not
once per layout. ``tests/test_bounds.py`` checks on random problems, with weights profiled in fp32 or
estimated in bf16 and some of them in float8 layers, that the floors they give never exceed what the
solver and the simulator then find.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

from planner.core.layout.inputs import Layout
from planner.core.levers.casts import without_casts
from planner.core.levers.collectives import Collective
from planner.core.levers.data_parallel import as_gathered, dp_group_links, layout_links, ring_rate
from planner.core.levers.experts import by_group
from planner.core.levers.hsdp import hsdp_links
from planner.core.levers.links import Links
from planner.core.levers.overlap import COMPUTE_SLOWDOWN
from planner.schema.costs import BlockCost, LinkCost


class FsdpFloor(NamedTuple):
    """What FSDP costs at least, over a pipeline's ranks (``fsdp_traffic``): block by block, one
    microbatch's collectives; a stage per unit, one pass's reduce-scatters.

    Attributes:
        traffic: seconds of every block's two gathers and reduce-scatter, at the least seconds per byte.
        reduced: of it, the reduce-scatters: what FSDP with a stage per unit holds its ranks for once a
            pass, whatever the split (``planner.core.step.simulate.Traffic``: a stage's reduce-scatter
            after its last backward, its rank computing nothing meanwhile).
        cold: prefix sums, from 0, of the blocks' gathers at that rate, smallest first: each stage's
            forward and backward wait for their first unit's gather (``prefetched``), and the stages'
            first (and last) blocks are distinct, so ``2 x cold[n]`` is exposed on ``n`` stages.
        per_stage: whether every stage starts cold (FSDP2's timeline on NCCL links, or nothing hidden);
            else (a link NCCL does not drive, overlapped) each rank waits for twice its largest unit.
        slowdown: how much slower the compute runs beside the collectives it hides
            (``planner.core.levers.overlap.COMPUTE_SLOWDOWN`` where NCCL drives every link and the
            ranks have devices of their own; else 0): what a hidden second of them still costs.
    """

    traffic: float
    reduced: float
    cold: tuple[float, ...]
    per_stage: bool
    slowdown: float = 0.0

    @property
    def gathered(self) -> float:
        """Of ``traffic``, one gather of every block: what a stage per unit gathers once a pass."""
        return (self.traffic - self.reduced) / 2

    def charged(self, exposed: float) -> float:
        """The least a microbatch's block-by-block collectives add to the ranks together where at least
        ``exposed`` of their ``traffic`` seconds are exposed: the exposed seconds, and the slowdown of
        the compute beside the rest (``planner.core.levers.overlap.charged_s``)."""
        return exposed + self.slowdown * max(0.0, self.traffic - exposed)

    def exposed(self, layout: Layout) -> float:
        """The least exposed seconds a microbatch's gathers wait for, over the layout's ranks."""
        n = layout.n_stages if self.per_stage else layout.pp
        return 2 * self.cold[min(n, len(self.cold) - 1)]


def fsdp_traffic(
    blocks: Sequence[BlockCost], link: Links, layout: Layout, slots: float | None = None
) -> dict[str, FsdpFloor]:
    """A lower bound of what one microbatch's FSDP collectives cost a pipeline's ranks together when
    FSDP shards block by block (``floors``' ``traffic``), by mode: "fsdp" over the replicas, and
    "hsdp" over the shard groups where the layout has them.

    Whatever the split, every block is gathered for the forward and again for the backward and its
    gradients reduce-scattered, each rank's units over its own group link (``dp_group_links``, as
    ``planner.core.step.predict`` places them), the experts a rank holds over the replicas holding
    the same ones (``by_group``); no collective costs less than its bytes at the least seconds per
    byte of the fastest of those links (``ring_rate``). HSDP's all-reduce over the groups only adds.
    With a stage per unit every block's gradients are reduce-scattered once a pass the same way
    (``FsdpFloor.reduced``). Under "ddp", the replicas' all-reduce of every block's gradients once a
    step (``_ddp_floor``), at the least seconds per byte as well.

    Args:
        blocks: per-block costs as the layout's ranks hold them (degrees applied).
        link: the cluster's link(s), not yet placed for the layout.
        layout: the layout (pipeline ranks, replicas, their shard groups, the gathered dtype).
        slots: ranks that compute at once (``Cluster.slots``; not None: ranks share cores and
            nothing overlaps).

    Returns:
        The floors by mode (empty with one replica).
    """
    pp, dp = layout.pp, layout.dp
    if dp <= 1:
        return {}
    gathered = as_gathered(without_casts(blocks), layout.gather_bytes)
    split = [by_group([b]) for b in gathered]
    _, _, ep = by_group(gathered)
    dense_grads, expert_grads, _ = by_group(gathered, wide=True)
    placed = layout_links(link, pp, dp, layout.tp, layout.pp_outer)
    groups = [("fsdp", dp, dp_group_links(placed, pp, dp))]
    out: dict[str, FsdpFloor] = {"ddp": _ddp_floor(blocks, groups[0][2], dp, slots)}
    if layout.dp_shard > 1 and layout.dp_mode in ("hsdp", "auto"):
        groups.append(("hsdp", layout.dp_shard, hsdp_links(placed, pp, dp, layout.dp_shard)[0]))
    for mode, size, links in groups:
        distinct = list(dict.fromkeys(links))
        dense_rate, expert_rate = (
            _least_rate(distinct, "all_gather", size),
            _least_rate(distinct, "all_gather", size // ep),
        )
        gathers = sorted(dense_rate * d + expert_rate * e for d, e, _ in split)
        reduced = _least_rate(distinct, "reduce_scatter", size) * dense_grads
        reduced += _least_rate(distinct, "reduce_scatter", size // ep) * expert_grads
        nccl, slowdown = _overlap(distinct, slots)
        cold = (0.0, *itertools.accumulate(gathers))
        out[mode] = FsdpFloor(2 * sum(gathers) + reduced, reduced, cold, slots is not None or nccl, slowdown)
    return out


def _overlap(links: Sequence[LinkCost], slots: float | None) -> tuple[bool, float]:
    """Whether NCCL drives every one of ``links``, and how much slower the compute runs beside the
    collectives it hides there: ``COMPUTE_SLOWDOWN`` where it does and the ranks have devices of their
    own (``slots`` None), else 0, as ``planner.core.step.predict`` charges it."""
    nccl = all(one.nccl is not None for one in links)
    return nccl, COMPUTE_SLOWDOWN if nccl and slots is None else 0.0


def _ddp_floor(blocks: Sequence[BlockCost], links: Sequence[LinkCost], dp: int, slots: float | None) -> FsdpFloor:
    """DDP's all-reduce of every block's gradients as reduced (fp32 where the parameters are narrower;
    the experts' go over their own groups, after), at the least seconds per byte of the fastest
    rank's group link: its ``traffic`` (and ``reduced``), over the pipeline's ranks together, once a
    step; ``slowdown`` where its buckets may run beside the last backward (``floors`` says where)."""
    distinct = list(dict.fromkeys(links))
    seconds = _least_rate(distinct, "all_reduce", dp) * by_group(blocks, wide=True)[0]
    nccl, slowdown = _overlap(distinct, slots)
    return FsdpFloor(seconds, seconds, (0.0,), slots is not None or nccl, slowdown)


def _least_rate(links: Sequence[LinkCost], op: Collective, group: int) -> float:
    """The least seconds per byte ``op`` over ``group`` ranks takes on any of ``links`` (``ring_rate``)."""
    return min(ring_rate(group, one, op) for one in links)


def unsharded_floor(gathered: Sequence[BlockCost]) -> int:
    """A lower bound, over every split, of the sum over the stages of what FSDP with a stage per unit
    holds unsharded while its stage runs (``planner.core.split.stage_model.unsharded_bytes``: the
    weights as gathered, ``P``, one backward's gradients, ``max(P, 2 N)``, and where ``P`` is narrower
    than fp32 the gradients accumulated in fp32, ``4 N``).

    Each stage's figure comes from its sums, and a sum of maxima is at least the maximum of the sums,
    so ``P + max(P, 2 N)`` of the totals bounds the first two terms, and ``master_floor`` the fp32
    accumulators. Weights estimated in bf16 hold ``8 N`` so, not the ``2 P = 4 N`` that counting the
    weights and gradients at the weights' width gives.

    Args:
        gathered: per-block costs with the weights as FSDP gathers them (``as_gathered``).

    Returns:
        Bytes.
    """
    p_bytes = sum(b.param_bytes for b in gathered)
    n_params = sum(b.params for b in gathered)
    return p_bytes + max(p_bytes, 2 * n_params) + master_floor([(b.param_bytes, b.params) for b in gathered])


def master_floor(weights: Sequence[tuple[int, int]]) -> int:
    """A lower bound, over every split, of the sum over the stages of ``4 N`` where a stage's
    parameters are narrower than fp32 (``P < 4 N`` of its sums), else 0: the fp32 master copies an
    optimizer keeps (``OptimizerSpec.state_bytes``) and FSDP's fp32 gradient accumulators.

    ``4 N`` of the totals where every block with parameters is narrower (then so is every stage);
    otherwise ``max(0, 4 N - P)`` of the totals, which no stage's figure is below (``4 N >= 4 N - P``
    where narrower, ``0`` otherwise) and whose positive parts add up to at least the whole's.

    Args:
        weights: per block, its parameters' (bytes, count).

    Returns:
        Bytes.
    """
    p_bytes = sum(p for p, _ in weights)
    n_params = sum(n for _, n in weights)
    if all(p < 4 * n for p, n in weights if n):
        return 4 * n_params
    return max(0, 4 * n_params - p_bytes)


__all__ = ["FsdpFloor", "fsdp_traffic", "master_floor", "unsharded_floor"]
