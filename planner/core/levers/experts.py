"""Expert parallelism: which layouts can shard a mixture-of-experts model's experts over ranks,
and what one expert-parallel rank of a block costs.

Pure module (no torch). A plan of ``ep`` > 1 shards each experts module over ``ep`` consecutive
ranks of the same pipeline rank (``planner.schema.plan.Plan.ep``): ``ep`` replicas, or where the
pipeline rank is split over ``tp`` tensor-parallel ranks, those of ``ep / tp`` replicas
(``planner.schema.counts.group_replicas``), each routing its ``1 / tp`` of its replica's tokens and gathering the others'
results (one all-gather of the layer's tokens each way over the tensor-parallel link). The runner
dispatches the tokens routed to them with all-to-alls (``planner.run.experts``). ``ep_refusal`` says, in one line,
what the runner does not run with it yet, so that ``planner plan`` never writes such a plan and
``planner run`` refuses one before any process starts (the search keeps to what ``layout_refusal``
passes). ``at_degree`` turns a block's costs into one
expert-parallel rank's (``BlockCost.experts``, from ``planner.costs.experts``):

* memory: the experts' parameters, and with them their gradients and optimizer state, ``1 / ep``
  each; the rest whole. Under FSDP the rank's experts are sharded over the ``dp / r`` replicas
  holding the same ones (``r``: the replicas a group covers, ``group_replicas``) (``planner.run.experts.shard_experts_over_groups``): a ``1 / dp`` share of
  every expert (of ``1 / (dp x tp)`` where the group spans ``tp`` ranks), as the rest's, so what
  FSDP shards counts them whole (``BlockCost.fsdp_params``; ``1 / tp`` of them) while what it gathers
  is the rank's ``1 / ep``. The activations stay but for the imbalance: under dropless routing the
  busiest rank receives ``imbalance`` times the mean rows (``ExpertShare.imbalance``: the router's,
  measured, or ``--moe-imbalance``) and its experts save that much more (``saved_bytes``); one
  layer's exchange at a time holds a send and a receive buffer of those rows (``bwd_temp_bytes``);
* compute: the expert GEMMs at the local expert count, ``ep`` times as many rows per expert, on the
  busiest rank (``ExpertShare.gemm_s``, the roofline's at each degree: few rows per expert leave a
  grouped GEMM memory-bound on its weights, so sharding the experts speeds them per row); measured
  costs keep their time, the experts' FLOP share of it scaled by the imbalance. The optimizer step
  and gradient work shrink with the parameters;
* communication: each layer's dispatch and combine, one all-to-all each way in forward and again in
  backward (and its forward's again where the block recomputes: neither checkpointing mode keeps what
  an exchange returns), ``imbalance x dispatch_bytes`` of rows for the busiest rank (every exchange
  waits for it), ``(ep - 1) / ep`` of them to other ranks: on an
  NCCL link as NCCL's own model costs an all-to-all (``planner.core.levers.collectives``: the peers
  on the node over NVLink, the rest over the node's cards), elsewhere (gloo, a measured link) an
  alpha-beta, ``ep - 1`` latencies and the bytes to others. None overlaps compute (the runner
  waits for each exchange). The replicas' reduction (and FSDP's gathers) of the experts run over
  the ``dp / r`` replicas holding the same ones, the rest's over all of them
  (``by_group``), on the replicas' link; where DDP reduces in
  buckets during the backward (NCCL), the buckets carry the rest and the experts' all-reduce comes
  after the backward, as the runner does it (``planner.core.levers.data_parallel.experts_after_s``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from planner.core.levers.collectives import collective_time
from planner.core.levers.links import Links, NodeLinks, default_link
from planner.core.levers.tensor_parallel import allgather_s
from planner.core.split.stage_model import fp32_bytes
from planner.schema.costs import BlockCost, LinkCost
from planner.schema.counts import group_replicas
from planner.schema.shares import ExpertShare


def ep_refusal(
    ep: int,
    experts: Mapping[str, int],
    *,
    dp: int,
    tp: int,
    dp_mode: str,
    dp_shard: int = 0,
    sequence: bool = False,
    cp: int = 1,
) -> str | None:
    """Why a layout cannot shard its experts ``ep`` ways, or None when it can (or ``ep`` is 1): the
    model's experts (``experts_refusal``), then the layout (``layout_refusal``).

    Args:
        ep: expert-parallel ranks.
        experts: each experts module's name -> its expert count (``Plan.experts``).
        dp: the mesh's replicas (data-parallel x context-parallel; the expert-parallel ranks are replicas).
        tp: tensor-parallel ranks per pipeline rank.
        dp_mode: how the replicas reduce gradients ("ddp", "fsdp", "hsdp").
        dp_shard: under HSDP, the replicas of each shard group.
        sequence: with ``tp`` > 1, sequence parallelism.
        cp: context-parallel ranks (for the message).

    Returns:
        One line naming what stands in the way and what to give instead.
    """
    return experts_refusal(ep, experts) or layout_refusal(
        ep, dp=dp, tp=tp, dp_mode=dp_mode, dp_shard=dp_shard, sequence=sequence, cp=cp
    )


def experts_refusal(ep: int, experts: Mapping[str, int]) -> str | None:
    """Why a model's experts cannot be sharded ``ep`` ways (none, or a layer's count ``ep`` does not
    divide), or None.

    Args:
        ep: expert-parallel ranks.
        experts: each experts module's name -> its expert count.

    Returns:
        One line, or None (also for ``ep`` 1).
    """
    if ep == 1:
        return None
    if not experts:
        return f"--ep {ep}: the model has no experts to shard (no ep_plan, nor a Hugging Face base_model_ep_plan)"
    odd = next(((name, n) for name, n in experts.items() if n % ep), None)
    if odd is not None:
        return f"--ep {ep} does not divide the {odd[1]} experts of {odd[0]}"
    return None


def layout_refusal(
    ep: int, *, dp: int, tp: int, dp_mode: str, dp_shard: int = 0, sequence: bool = False, cp: int = 1
) -> str | None:
    """Why a layout cannot shard experts ``ep`` ways: an ``ep`` that does not span whole
    tensor-parallel groups, replicas (or HSDP shard groups) its groups do not divide, or what the
    runner does not run expert parallelism with yet; None where it can (or ``ep`` is 1). The search
    keeps to the layouts this passes, ``planner run`` refuses the rest.

    Args:
        ep: expert-parallel ranks.
        dp: the mesh's replicas (data-parallel replicas, times ``cp``: a replica's context-parallel
            ranks are consecutive replicas, which an expert group may cover).
        tp: tensor-parallel ranks per pipeline rank (an expert group spans them: ``group_replicas``).
        dp_mode: how the replicas reduce gradients ("ddp", "fsdp", "hsdp").
        dp_shard: under HSDP, the replicas of each shard group (an expert group lies inside one).
        sequence: with ``tp`` > 1, sequence parallelism.
        cp: context-parallel ranks (for the message).

    Returns:
        One line, or None.
    """
    if ep == 1:
        return None
    what = (
        f"{dp} data-parallel replicas"
        if cp == 1
        else f"{dp} replicas ({dp // cp} data-parallel x {cp} context-parallel)"
    )
    if tp > 1 and ep % tp:
        return (
            f"--ep {ep} is no multiple of --tp {tp}: an expert-parallel group spans the {tp} tensor-parallel ranks "
            f"of each replica it covers (each routes its 1/{tp} of the tokens); give an --ep that {tp} divides"
        )
    replicas = group_replicas(ep, tp)
    if dp % replicas:
        return (
            f"--ep {ep} covers {replicas} replica(s) ({replicas} x {tp} tensor-parallel ranks), which do not divide "
            f"the {what}"
            if tp > 1
            else f"--ep {ep} does not divide the {what}, over which the experts are sharded"
        )
    if dp_mode == "hsdp" and dp_shard and dp_shard % replicas:
        what = f"covers {replicas} replicas, which do not divide" if tp > 1 else "does not divide"
        return (
            f"--ep {ep} {what} the {dp_shard} replicas of each HSDP shard group (--dp-shard), inside which an "
            "expert group lies"
        )
    notyet = [(tp > 1 and sequence, "with sequence parallelism", "--no-sequence-parallel")]
    for blocked, what, instead in notyet:
        if blocked:
            return f"--ep {ep}: expert parallelism does not run {what} yet; give {instead} (or --ep 1)"
    return None


def all_to_all_s(nbytes: float, ranks: int, local: int, link: LinkCost) -> float:
    """Seconds of one all-to-all in which each of ``ranks`` ranks sends ``nbytes`` (``nbytes / ranks``
    to each, itself included), ``local`` of them on each node.

    Args:
        nbytes: one rank's send buffer.
        ranks: the group.
        local: its ranks on each node (``ranks`` inside one node).
        link: the link the group's messages cross (the inter-node link where ``local < ranks``).

    Returns:
        Seconds; 0 with one rank or nothing to send.
    """
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    if link.nccl is not None:
        return collective_time("all_to_all", nbytes, ranks, local, link.nccl).seconds
    return (ranks - 1) * link.latency_s + (ranks - 1) / ranks * nbytes / link.bandwidth_Bps


def group_link(link: Links, ep: int) -> tuple[LinkCost, int]:
    """The link an expert-parallel group crosses and its ranks per node: ``ep`` consecutive global
    ranks (an expert-parallel layout is pipeline-outermost, ``planner.schema.plan.Plan.pp_outer``:
    a pipeline rank's replicas follow each other, each one's tensor-parallel ranks together, and a
    group covers whole replicas), ranks filling nodes in order.

    Args:
        link: the cluster's links (one link, or an intra- and an inter-node ``NodeLinks``).
        ep: the group's ranks.

    Returns:
        (the link, the group's ranks on each node).
    """
    if not isinstance(link, NodeLinks):
        return default_link(link), ep
    local = max(1, min(ep, link.gpus_per_node))
    return (default_link(link) if local >= ep else link.inter), local


def at_degree(
    blocks: Sequence[BlockCost], ep: int, link: LinkCost, local: int, tp: int = 1, tp_link: LinkCost | None = None
) -> list[BlockCost]:
    """The blocks as one of ``ep`` expert-parallel ranks runs them (see the module docstring).

    Args:
        blocks: per-block costs (one microbatch), split over ``tp`` tensor-parallel ranks already
            (``planner.core.levers.tensor_parallel.at_degree``: the experts whole); blocks without
            ``experts`` are returned as they are.
        ep: expert-parallel ranks (1: the blocks unchanged).
        link: the link the group crosses (``group_link``).
        local: the group's ranks on each node.
        tp: tensor-parallel ranks the group spans (``group_replicas``): each routes its ``1 / tp`` of
            its replica's tokens and gathers the others' results.
        tp_link: their link (``tp`` > 1).

    Returns:
        The blocks.
    """
    if ep <= 1:
        return list(blocks)
    out: list[BlockCost] = []
    for b in blocks:
        share = b.experts
        out.append(b if share is None else _rank_of(b, share, ep, (link, local), (tp, tp_link or link)))
    return out


def _rank_of(
    b: BlockCost, share: ExpertShare, ep: int, group: tuple[LinkCost, int], span: tuple[int, LinkCost]
) -> BlockCost:
    """One block as the busiest of ``ep`` expert-parallel ranks runs them (``at_degree``): ``group``
    the group's (link, ranks per node), ``span`` the tensor-parallel ranks it spans and their link."""
    imbalance = share.imbalance_at(ep)
    tp, tp_link = span
    params = b.params - share.params + share.params // ep
    param_bytes = b.param_bytes - share.param_bytes + share.param_bytes // ep
    kept = param_bytes / b.param_bytes if b.param_bytes else 1.0
    # dispatch and combine per layer, forward and again backward; the busiest rank receives (and every
    # all-to-all waits for) imbalance x the mean rows, of its 1 / tp of the tokens
    sent = imbalance * share.dispatch_bytes / share.layers / tp
    pair = 2 * share.layers * all_to_all_s(sent, ep, group[1], group[0])
    # over tp ranks each gathers the others' results (forward) and input gradients (backward): one
    # all-gather of the layer's tokens each way
    gather = share.layers * allgather_s((share.token_bytes or share.dispatch_bytes) / share.layers, tp, tp_link)
    gemm = _gemm_change(b, share, ep, imbalance, tp)  # the forward's; the backward runs two GEMMs per weight
    extra_saved = round((imbalance / tp - 1.0) * share.saved_bytes)
    # one layer's exchange at a time holds a send and a receive buffer of the busiest rank's rows (the
    # backward's reverse exchanges too): beside the backward's own temporaries
    buffers = round(2 * sent)
    whole_params, whole_bytes = b.fsdp_sharded()
    return b.model_copy(
        update={
            "params": params,
            "param_bytes": param_bytes,
            # FSDP shards a rank's experts over the ranks holding the same ones: of every expert a share
            # over dp x tp (over dp where the group spans no tensor-parallel ranks), the rest's over dp
            "fsdp_params": whole_params - share.params + share.params // tp,
            "fsdp_param_bytes": whole_bytes - share.param_bytes + share.param_bytes // tp,
            "activation_bytes": max(b.weight_cast_bytes, b.activation_bytes + extra_saved),
            "selective_bytes": None if b.selective_bytes is None else _kept(b.selective_bytes, b, extra_saved),
            "bwd_temp_bytes": (b.bwd_temp_bytes or 0) + buffers,
            "fwd_s": max(0.0, b.fwd_s + pair + gather + gemm),
            "bwd_s": max(0.0, b.bwd_s + pair + gather + 2 * gemm),
            "bwd_input_s": None if b.bwd_input_s is None else max(0.0, b.bwd_input_s + pair + gather + gemm),
            "bwd_weight_s": None if b.bwd_weight_s is None else max(0.0, b.bwd_weight_s + gemm),
            # recomputing the block's forward runs its exchanges and GEMMs again (neither checkpointing mode
            # keeps what an all-to-all returns); selective keeps the GEMMs' outputs. None: the whole forward
            "recompute_s": None if b.recompute_s is None else max(0.0, b.recompute_s + pair + gather + gemm),
            "selective_recompute_s": None
            if b.selective_recompute_s is None
            else b.selective_recompute_s + pair + gather,
            "opt_s": None if b.opt_s is None else b.opt_s * kept,
            "grad_s": None if b.grad_s is None else b.grad_s * kept,
            "experts": share.model_copy(update={"ranks": ep, "span": tp}),
        }
    )


def _kept(selective: int, b: BlockCost, extra: int) -> int:
    """What selective checkpointing keeps of block ``b`` with its experts saving ``extra`` bytes more:
    all of them where they grow (it keeps the GEMMs' inputs and outputs); where they shrink (a slice
    of the tokens each), by the share of the block's activations it keeps, as tensor parallelism
    split it (``planner.core.levers.tensor_parallel``)."""
    if extra >= 0:
        return selective + extra
    share = min(1.0, selective / b.activation_bytes) if b.activation_bytes else 1.0
    return max(0, selective + round(extra * share))


def _gemm_change(b: BlockCost, share: ExpertShare, ep: int, imbalance: float, tp: int) -> float:
    """Seconds the expert GEMMs' forward gains (or loses) on the busiest of ``ep`` ranks, each
    routing its ``1 / tp`` of a replica's tokens: estimated costs list the roofline's time per
    degree, imbalance included (``ExpertShare.gemm_s``); a group of ``ep`` over ``tp`` ranks runs as
    many rows per expert as degree ``ep / tp`` on ``1 / tp`` of its experts (a grouped GEMM's time is
    its experts' sum), at degree ``ep``'s imbalance. For measured ones the experts' share of the
    block's measured forward, by FLOPs, scales with the imbalance over ``tp``."""
    if share.gemm_s:
        degree = group_replicas(ep, tp)
        below = [d for d in share.gemm_s if d <= degree]
        if not below:
            return 0.0
        at = max(below)
        time = share.gemm_s[at] * imbalance / share.imbalance_at(at) / tp
        return time - share.gemm_s.get(1, share.gemm_s[at])
    if share.flops_fwd <= 0 or not b.flops_fwd:
        return 0.0
    return (imbalance / tp - 1.0) * b.fwd_s * min(1.0, share.flops_fwd / b.flops_fwd)


def held_experts(b: BlockCost) -> tuple[int, int, int]:
    """The experts one expert-parallel rank holds of block ``b`` (``at_degree``), as (parameters,
    bytes, the replicas its group covers: ``group_replicas``); (0, 0, 1) for a block not sharded so."""
    share = b.experts
    if share is None or share.ranks <= 1:
        return 0, 0, 1
    return share.params // share.ranks, share.param_bytes // share.ranks, group_replicas(share.ranks, share.span)


def by_group(blocks: Sequence[BlockCost], wide: bool = False) -> tuple[int, int, int]:
    """The blocks' parameter bytes (``wide``: their gradients as reduced, fp32 where the parameters
    are narrower) split by the replicas that gather or reduce them: (over all the replicas, over the
    ``dp / r`` replicas holding the same experts, r: the replicas an expert group covers,
    ``group_replicas``). The experts one rank holds of an
    expert-parallel block (``held_experts``) take the second group, the rest and every block
    without experts the first.

    Args:
        blocks: per-block costs, as one expert-parallel rank holds them (``at_degree``).
        wide: the gradients' bytes as reduced instead of the parameters'.

    Returns:
        (bytes over all the replicas, bytes over the expert groups' replicas, r; 1 without experts).
    """

    def size(nbytes: int, params: int) -> int:
        return fp32_bytes(nbytes, params) if wide else nbytes

    whole = sum(size(b.param_bytes, b.params) for b in blocks)
    held = [held_experts(b) for b in blocks]
    experts = sum(size(nbytes, params) for params, nbytes, _ in held)
    return whole - experts, experts, max((ep for *_, ep in held), default=1)


def expert_degrees(blocks: Sequence[BlockCost], world_size: int) -> tuple[int, ...]:
    """The expert-parallel degrees ``--ep auto`` tries: 1, and every divisor of the layers' expert
    counts that divides the world size (1 alone for a dense model).

    Args:
        blocks: per-block costs (their ``experts`` shares).
        world_size: every rank.

    Returns:
        The degrees, ascending.
    """
    counts = [b.experts.experts for b in blocks if b.experts is not None]
    if not counts:
        return (1,)
    common = math.gcd(*counts)
    return tuple(d for d in range(1, common + 1) if common % d == 0 and world_size % d == 0)


__all__ = [
    "all_to_all_s",
    "at_degree",
    "by_group",
    "ep_refusal",
    "expert_degrees",
    "experts_refusal",
    "group_link",
    "held_experts",
    "layout_refusal",
]
