"""Tensor parallelism inside a pipeline stage: what one tensor-parallel rank of a block costs.

Pure module: never imports torch. A plan of degree ``tp`` splits every pipeline rank over ``tp``
ranks of one node (``planner.schema.plan.Plan``: global rank = (replica x pp + pipeline rank) x tp
+ tensor-parallel rank). Each rank holds 1/tp of the split layers (``BlockCost.tp``, from the model's
tensor-parallel plan: column-wise layers split their output features, row-wise ones their input
features, Megatron-LM's layout as torch's ``ColwiseParallel`` / ``RowwiseParallel`` run it) and
the whole of the rest. ``at_degree`` turns a block's costs into one such rank's:

* compute: the split share of the forward and backward (``sharded_compute``) runs on 1/tp of the
  features, the rest (norms, residual adds, an embedding the plan leaves whole) whole on every rank:
  ``(1 - sharded_compute) + sharded_compute / tp * slowdown(tp)``; the loss (``BlockCost.loss_s``,
  its backward taken as long) runs whole on every rank, the logits gathered; ``slowdown`` is 1 for measured
  costs; estimated costs carry the smaller matrices' lower GEMM efficiency at the sharded shapes
  (``TensorParallelShare.slowdown``, from ``planner.costs.tensor_parallel``);
* collectives: every row-wise layer's output is all-reduced in forward, every column-wise layer's
  input gradient in backward (one all-reduce per layer, as torch runs them), over the node's link:
  on an NCCL link as NCCL's own model costs it (``planner.core.levers.collectives``: the algorithm
  and protocol it picks for the size), elsewhere (gloo, a measured link) an alpha-beta ring,
  ``2 (tp - 1) / tp`` of the bytes each way plus ``ceil(log2 tp)`` latencies; a
  ``colwise_rep`` layer's output (an output head's logits) is all-gathered in forward, ``(tp - 1) /
  tp`` of its bytes (its backward takes each rank's slice of the gradient: no traffic), and its input
  gradient all-reduced in backward as a column-wise layer's (an embedding's input is token ids: none);
  none is overlapped with compute
  (torch's eager tensor parallelism does not overlap them);
* loss parallelism (``Plan.loss_parallel``, torchtitan's default with tensor parallelism): the output
  head (``TensorParallelShare.head_allgather_bytes``, in the model's last block) keeps its logits
  split, no all-gather; torch's ``loss_parallel`` computes the cross-entropy on each rank's columns
  with three all-reduces of one fp32 value per row in forward (each row's max, sum of exponentials
  and target logit; its backward is local), so the model's output, what the loss saves, its
  backward's temporaries and its time (``BlockCost.loss_s``, the backward taken as long as the
  forward) are 1/tp of the whole;
* memory: split parameters (with their gradients and optimizer state) and the activations saved
  inside split layers are divided by tp; the rest is held whole;
* messages between pipeline stages: the hidden state at a boundary is the same on every
  tensor-parallel rank, so each sends 1/tp of it to its peer and the receivers all-gather the
  pieces over the node's link (Megatron-LM's scatter-gather, Narayanan et al. 2021, section 4.1;
  ``planner.run.boundary``); the gradient goes back the same way. A block's ``cut_share`` and
  ``cut_gather_s`` say so: its receive buffers and the stage output torch keeps per microbatch are
  the 1/tp piece, the gathered whole is what the next stage's layers save;
* FLOPs stay the whole model's, so utilisation (MFU) counts the model's work, not the copies.

Sources: Shoeybi et al., "Megatron-LM" (2019), section 3; Narayanan et al., "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM" (SC 2021), section 3.2 (the all-reduce
count per layer and why tensor parallelism stays inside a node).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from planner.core.levers.collectives import Collective, collective_time
from planner.schema.costs import BlockCost, LinkCost
from planner.schema.shares import SequenceShare, TensorParallelShare


def group_local(link: LinkCost, ranks: int) -> int:
    """A group's ranks on each node, as NCCL's model takes them: what ``group_link`` recorded for a
    group across nodes, one on a network link, else all ``ranks`` (a group inside one node)."""
    if link.local_ranks:
        return link.local_ranks
    return 1 if link.nccl is not None and link.nccl.network else ranks


def _nccl_s(op: Collective, nbytes: float, count: int, tp: int, link: LinkCost) -> float | None:
    """``count`` equal collectives of ``nbytes`` in all over ``tp`` ranks of one node by NCCL's own
    model (``planner.core.levers.collectives``: each pays its latency, at the algorithm and
    protocol NCCL picks for its size); None on a link NCCL does not drive (the alpha-beta ring)."""
    if link.nccl is None:
        return None
    return count * collective_time(op, nbytes / count, tp, group_local(link, tp), link.nccl).seconds


def allreduce_s(nbytes: float, count: int, tp: int, link: LinkCost) -> float:
    """Seconds of ``count`` all-reduces of ``nbytes`` bytes in all over ``tp`` ranks on ``link``.

    Args:
        nbytes: bytes of all of them together (each rank's full tensor, summed).
        count: how many all-reduces (each pays the latency).
        tp: ranks in the group.
        link: the group's link (one node's).

    Returns:
        Seconds; 0 with one rank or nothing to reduce.
    """
    if tp <= 1 or count == 0:
        return 0.0
    nccl = _nccl_s("all_reduce", nbytes, count, tp, link)
    if nccl is not None:
        return nccl
    return count * math.ceil(math.log2(tp)) * link.latency_s + 2 * (tp - 1) / tp * nbytes / link.bandwidth_Bps


def allgather_s(nbytes: float, tp: int, link: LinkCost) -> float:
    """Seconds of one all-gather that leaves ``nbytes`` bytes in all on each of ``tp`` ranks of ``link``.

    Args:
        nbytes: bytes of the gathered tensor (each rank contributes 1/tp of them).
        tp: ranks in the group.
        link: the group's link (one node's).

    Returns:
        Seconds (a ring: ``(tp - 1) / tp`` of the bytes, ``ceil(log2 tp)`` latencies as ``allreduce_s``
        charges); 0 with one rank or nothing to gather.
    """
    if tp <= 1 or nbytes <= 0:
        return 0.0
    nccl = _nccl_s("all_gather", nbytes, 1, tp, link)
    if nccl is not None:
        return nccl
    return math.ceil(math.log2(tp)) * link.latency_s + (tp - 1) / tp * nbytes / link.bandwidth_Bps


def ring_s(nbytes: float, count: int, tp: int, link: LinkCost) -> float:
    """Seconds of ``count`` all-gathers or reduce-scatters (as sequence parallelism runs them) moving
    ``nbytes`` bytes of whole tensors in all over ``tp`` ranks: ``(tp - 1) / tp`` of the bytes and
    ``ceil(log2 tp)`` latencies each, as ``allgather_s`` charges.

    Args:
        nbytes: bytes of the whole tensors, summed.
        count: how many collectives (each pays the latency).
        tp: ranks in the group.
        link: the group's link.

    Returns:
        Seconds; 0 with one rank or nothing to move.
    """
    if tp <= 1 or count == 0:
        return 0.0
    nccl = _nccl_s("all_gather", nbytes, count, tp, link)  # NCCL's model costs the two alike
    if nccl is not None:
        return nccl
    return count * math.ceil(math.log2(tp)) * link.latency_s + (tp - 1) / tp * nbytes / link.bandwidth_Bps


def block_degree_limit(blocks: Sequence[BlockCost]) -> int | None:
    """The greatest common divisor of every split block's ``TensorParallelShare.divisor``: a degree
    must divide it (0: any degree, every split block allows any; None: no block is split, so only
    degree 1 means anything)."""
    divisors = [b.tp.divisor for b in blocks if b.tp is not None]
    return math.gcd(*divisors) if divisors else None


def allowed_degrees(blocks: Sequence[BlockCost], options: Sequence[int]) -> list[int]:
    """Of the degrees ``options`` (the cluster's), those the blocks allow, ascending.

    Args:
        blocks: per-block costs (``tp`` set where the model's tensor-parallel plan splits them).
        options: the degrees the cluster allows (divisors of a node's ranks).

    Returns:
        ``[1]`` when nothing is split; else the options that divide every split size.
    """
    limit = block_degree_limit(blocks)
    if limit is None:
        return [1] if 1 in options or not options else []
    return sorted(t for t in set(options) if limit % t == 0)


def _rerun_share(block: BlockCost) -> float:
    """The share of the block's forward its full recomputation re-runs (1 when unknown)."""
    if block.recompute_s is None or block.fwd_s <= 0:
        return 1.0
    return min(1.0, block.recompute_s / block.fwd_s)


def _plus(x: int | None, extra: int) -> int | None:
    return x if not extra else (x or 0) + extra


def _scaled(x: float | None, factor: float, extra: float = 0.0, host: float = 0.0) -> float | None:
    """``x`` scaled by the rank's share of the work, never below ``host`` (the host's time issuing its
    operators, which a split does not shorten), plus ``extra``."""
    return None if x is None else max(x * factor, host) + extra


def _host_share(part: float | None, whole: float, host: float) -> float:
    """Of a phase's host time ``host``, the share a part of it (``part`` of ``whole`` seconds) holds."""
    return host * part / whole if part is not None and whole > 0 else 0.0


def _sequence_comm(
    share: TensorParallelShare, seq: SequenceShare, tp: int, link: LinkCost
) -> tuple[float, float, float, float]:
    """Collectives of a block under sequence parallelism: each row-wise output reduce-scattered (its
    gradient all-gathered), each gathered column-wise input all-gathered (its gradient reduce-scattered
    once) and gathered again in backward by each layer that keeps it as a shard, each whole one's
    gradient all-reduced once, the whole parameters read on sequence shards all-reduced (their
    gradients).

    Returns:
        (forward, the input gradient's backward with the re-gathers, the re-gathers alone, the
        parameters' gradient all-reduces): a two-part backward (zero-bubble) unpacks a layer's saved
        input in both passes, so its weight pass gathers again too, and reduces the parameters'.
    """
    fwd = (
        ring_s(share.fwd_allreduce_bytes, share.fwd_allreduces, tp, link)
        + ring_s(seq.gather_bytes, seq.gathers, tp, link)
        + allgather_s(share.fwd_allgather_bytes, tp, link)
    )
    regather = ring_s(seq.regather_bytes, seq.regathers, tp, link)
    bwd_input = (
        ring_s(share.fwd_allreduce_bytes, share.fwd_allreduces, tp, link)
        + ring_s(seq.gather_bytes, seq.gathers, tp, link)
        + regather
        + allreduce_s(seq.whole_input_bytes, seq.whole_inputs, tp, link)
    )
    return fwd, bwd_input, regather, allreduce_s(seq.param_grad_bytes, seq.param_grads, tp, link)


def _loss_split(block: BlockCost, share: TensorParallelShare, tp: int, link: LinkCost) -> tuple[float, dict[str, Any]]:
    """Under loss parallelism, the output block's head left split (its gather gone, the ``share`` passed
    in has it no more): the forward seconds of torch's ``loss_parallel`` all-reduces (each row's max,
    sum of exponentials and target logit, in fp32; its backward is local), and the block's figures
    of the model's output and its loss at 1/tp (they are as wide as the logits)."""
    comm = allreduce_s(3 * 4 * share.head_rows, 3, tp, link)
    out = {
        "output_bytes": math.ceil(block.output_bytes / tp),
        "loss_bytes": None if block.loss_bytes is None else math.ceil(block.loss_bytes / tp),
        "loss_temp_bytes": None if block.loss_temp_bytes is None else math.ceil(block.loss_temp_bytes / tp),
        "loss_s": None if block.loss_s is None else block.loss_s / tp,
    }
    return comm, out


def _block_at(
    block: BlockCost, share: TensorParallelShare, tp: int, link: LinkCost, sequence: bool, loss: bool = False
) -> BlockCost:
    """One tensor-parallel rank's costs of ``block`` (see the module docstring); ``loss``: loss
    parallelism, which leaves the model's output split where this block's head makes it."""
    loss = loss and share.head_allgather_bytes > 0 and block.output_bytes > 0
    if loss:
        share = share.model_copy(update={"fwd_allgather_bytes": share.fwd_allgather_bytes - share.head_allgather_bytes})
    loss_comm, loss_update = _loss_split(block, share, tp, link) if loss else (0.0, {})
    seq = share.sequence if sequence else None
    seq_compute = seq.compute if seq is not None else 0.0
    compute = (1.0 - share.sharded_compute - seq_compute) + share.sharded_compute / tp * share.slowdown_at(tp)
    compute += seq_compute / tp
    # the loss (the last block's) runs outside the split layers: whole on every rank where the logits are
    # gathered, on 1/tp of them under loss parallelism; its forward, and a backward taken as long (the
    # same tensors read and written), at that share instead of the block's factor
    loss_fix = (block.loss_s or 0.0) * ((1.0 / tp if loss else 1.0) - compute)
    if seq is not None:
        fwd_comm, input_comm, regather, param_reduce = _sequence_comm(share, seq, tp, link)
        # a whole backward runs the input gradient's collectives and the parameters' all-reduces; a
        # split one (zero-bubble) the first in its input pass and, in its weight pass, the re-gathers
        # again (it unpacks the kept shards once more) and the all-reduces
        bwd_comm = input_comm + param_reduce
        weight_comm = regather + param_reduce
    else:
        fwd_comm = allreduce_s(share.fwd_allreduce_bytes, share.fwd_allreduces, tp, link) + allgather_s(
            share.fwd_allgather_bytes, tp, link
        )
        bwd_comm = input_comm = allreduce_s(share.bwd_allreduce_bytes, share.bwd_allreduces, tp, link)
        weight_comm = 0.0
    fwd_comm += loss_comm
    param_bytes = block.param_bytes - share.sharded_param_bytes + math.ceil(share.sharded_param_bytes / tp)
    params = block.params - share.sharded_params + math.ceil(share.sharded_params / tp)
    # the optimizer step, the gradient passes and their temporaries follow the bytes each rank holds
    held = param_bytes / block.param_bytes if block.param_bytes else 1.0
    rerun_comm = fwd_comm * _rerun_share(block)
    # the weight copies autocast saves (of the activations) are the rank's share of its weights
    cast = math.ceil(block.weight_cast_bytes * held)
    own = block.activation_bytes - block.weight_cast_bytes
    # (what every rank saves whole stays whole: costs.tensor_parallel caps the split part so)
    unsplit = min(share.unsplit_activation_bytes, own)
    sharded = min(share.sharded_activation_bytes, own - unsplit)
    # under sequence parallelism the whole bytes saved of sequence shards are split too
    along = min(seq.activation_bytes, unsplit) if seq is not None else 0
    activation = own - sharded + sharded // tp - along + along // tp + cast
    split = activation / block.activation_bytes if block.activation_bytes else 1.0
    if loss_update.get("loss_bytes") is not None:  # what the loss saves: 1/tp of it
        activation -= (block.loss_bytes or 0) - loss_update["loss_bytes"]
    # a kept shard is whole again while its layer's weight gradient runs (and in a rebuilt region)
    regathered = seq.column_bytes - seq.column_bytes // tp if seq is not None else 0

    def as_activations(x: int | None) -> int | None:  # bytes split as the block's activations are
        return None if x is None else math.ceil(x * split)

    return block.model_copy(
        update={
            "fwd_s": max(block.fwd_s * compute + loss_fix, block.host_fwd_s) + fwd_comm,
            "bwd_s": max(block.bwd_s * compute + loss_fix, block.host_bwd_s) + bwd_comm,
            "bwd_input_s": _scaled(
                block.bwd_input_s,
                compute,
                input_comm + loss_fix,
                _host_share(block.bwd_input_s, block.bwd_s, block.host_bwd_s),
            ),
            "bwd_weight_s": _scaled(
                block.bwd_weight_s, compute, weight_comm, _host_share(block.bwd_weight_s, block.bwd_s, block.host_bwd_s)
            ),
            # recomputing the forward runs its all-reduces again, those before the block's last saved
            # tensor only (torch's early stop: a layer's last all-reduce, after its last matmul, is not
            # re-run): charged the share of the forward the recomputation re-runs
            "recompute_s": _scaled(
                block.recompute_s, compute, rerun_comm, _host_share(block.recompute_s, block.fwd_s, block.host_fwd_s)
            ),
            "selective_recompute_s": _scaled(
                block.selective_recompute_s,
                compute,
                rerun_comm,
                _host_share(block.selective_recompute_s, block.fwd_s, block.host_fwd_s),
            ),
            # what selective checkpointing keeps, and the backward's temporaries (gradients of the
            # activations), split as the block's activations are
            "selective_bytes": as_activations(block.selective_bytes),
            "bwd_temp_bytes": _plus(as_activations(block.bwd_temp_bytes), regathered),
            "params": params,
            "param_bytes": param_bytes,
            "activation_bytes": activation,
            "weight_cast_bytes": cast,
            "opt_s": _scaled(block.opt_s, held),
            "grad_s": _scaled(block.grad_s, held),
            "opt_temp_bytes": None if block.opt_temp_bytes is None else math.ceil(block.opt_temp_bytes * held),
            **loss_update,
        }
    )


def at_degree(
    blocks: Sequence[BlockCost], tp: int, link: LinkCost, *, sequence: bool = False, loss: bool = False
) -> list[BlockCost]:
    """Every block's costs on one of ``tp`` tensor-parallel ranks.

    Args:
        blocks: per-block costs of the whole (unsplit) block, ``tp`` set where the model's plan
            splits it.
        tp: the degree (1: the blocks as they are).
        link: the link inside a node, which the all-reduces cross.
        sequence: sequence parallelism (the blocks' ``TensorParallelShare.sequence``; see the module
            docstring).
        loss: loss parallelism: the output head's logits stay split and the loss runs on each rank's
            columns (see the module docstring).

    Returns:
        The blocks as one tensor-parallel rank runs and holds them (the same objects at degree 1).
    """
    if tp == 1:
        return list(blocks)
    return [
        _scattered(
            block if block.tp is None else _block_at(block, block.tp, tp, link, sequence, loss), tp, link, sequence
        )
        for block in blocks
    ]


def _scattered(block: BlockCost, tp: int, link: LinkCost, sequence: bool) -> BlockCost:
    """``block`` with the message at a boundary after it scattered over ``tp`` ranks (module docstring);
    under sequence parallelism its sequence shards also gathered before they leave and their
    gradient on arrival (one more all-gather each way)."""
    gather = allgather_s(block.cut_bytes, tp, link)
    seq = block.tp.sequence if sequence and block.tp is not None else None
    if seq is None or seq.cut_share <= 0:
        return block.model_copy(update={"cut_share": tp, "cut_gather_s": gather})
    gather += allgather_s(block.cut_bytes * seq.cut_share, tp, link)
    # a checkpoint region starting here keeps the shards of its input (the runner cuts them on arrival)
    shards = block.cut_bytes * seq.cut_share
    kept = round(block.cut_bytes - shards + shards / tp)
    return block.model_copy(update={"cut_share": tp, "cut_gather_s": gather, "cut_kept_bytes": kept})


__all__ = ["allgather_s", "allowed_degrees", "allreduce_s", "at_degree", "block_degree_limit", "group_local", "ring_s"]
