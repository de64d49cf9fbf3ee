"""Block costs at another microbatch size (``blocks_at``): what the search prices each microbatch
count with, and what a plan whose batch or microbatch count was edited by hand is re-predicted with.

Pure module: never imports torch. The scaling law and its fixed share are fitted by
``planner.costs.scaling`` from two profiled sizes.
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.schema.costs import BlockCost
from planner.schema.shares import ExpertShare, SequenceShare, TensorParallelShare


def blocks_at(blocks: Sequence[BlockCost], size0: int, size: float, fixed_fraction: float) -> list[BlockCost]:
    """The block costs profiled at microbatch size ``size0``, rescaled to microbatch size ``size``.

    Times follow ``t(size) = t(size0) * (f + (1 - f) * size / size0)`` with ``f = fixed_fraction``;
    activation, boundary and output bytes and FLOPs scale with ``size / size0``; parameters and the
    optimizer step do not depend on the microbatch.

    Args:
        blocks: per-block costs at ``size0``.
        size0: the microbatch size they were profiled at.
        size: the microbatch size wanted (a fraction of samples: a context-parallel rank's share,
            ``planner.core.layout.inputs.Layout.rank_share``).
        fixed_fraction: the share of a microbatch's time that does not scale with its size (0..1).

    Returns:
        The rescaled blocks (the same objects when ``size == size0``).
    """
    if size == size0:
        return list(blocks)
    r = size / size0
    t = fixed_fraction + (1.0 - fixed_fraction) * r

    def scaled(x: float | None) -> float | None:
        return None if x is None else x * t

    out = []
    for b in blocks:
        out.append(
            b.model_copy(
                update={
                    "fwd_s": b.fwd_s * t,
                    "bwd_s": b.bwd_s * t,
                    "bwd_input_s": scaled(b.bwd_input_s),
                    "bwd_weight_s": scaled(b.bwd_weight_s),
                    "recompute_s": scaled(b.recompute_s),
                    "selective_recompute_s": scaled(b.selective_recompute_s),
                    "selective_bytes": None if b.selective_bytes is None else round(b.selective_bytes * r),
                    "loss_bytes": None if b.loss_bytes is None else round(b.loss_bytes * r),
                    "bwd_temp_bytes": None if b.bwd_temp_bytes is None else round(b.bwd_temp_bytes * r),
                    "loss_temp_bytes": None if b.loss_temp_bytes is None else round(b.loss_temp_bytes * r),
                    "flops_fwd": None if b.flops_fwd is None else b.flops_fwd * r,
                    "flops_bwd": None if b.flops_bwd is None else b.flops_bwd * r,
                    # autocast's weight copies do not grow with the microbatch
                    "activation_bytes": round((b.activation_bytes - b.weight_cast_bytes) * r) + b.weight_cast_bytes,
                    "eager_activation_bytes": (
                        None
                        if b.eager_activation_bytes is None
                        else round((b.eager_activation_bytes - b.weight_cast_bytes) * r) + b.weight_cast_bytes
                    ),
                    "cut_bytes": round(b.cut_bytes * r),
                    "cut_kept_bytes": None if b.cut_kept_bytes is None else round(b.cut_kept_bytes * r),
                    "output_bytes": round(b.output_bytes * r),
                    "kv_bytes": round(b.kv_bytes * r),
                    "q_bytes": round(b.q_bytes * r),
                    "attention_s": (b.attention_s[0] * t, b.attention_s[1] * t),
                    "tp": None if b.tp is None else _share_at(b.tp, r),
                    "experts": None if b.experts is None else _experts_at(b.experts, r, t),
                }
            )
        )
    return out


def _experts_at(share: ExpertShare, r: float, t: float) -> ExpertShare:
    """An experts share at ``r`` times the microbatch: the rows routed (and what they send, compute and save)
    grow with the tokens, the GEMMs' times as the block's do (factor ``t``), the parameters not at all."""
    return share.model_copy(
        update={
            "dispatch_bytes": round(share.dispatch_bytes * r),
            "rows": round(share.rows * r),
            "token_bytes": round(share.token_bytes * r),
            "flops_fwd": share.flops_fwd * r,
            "saved_bytes": round(share.saved_bytes * r),
            "gemm_s": {d: s * t for d, s in share.gemm_s.items()},
        }
    )


def _share_at(share: TensorParallelShare, r: float) -> TensorParallelShare:
    """A block's tensor-parallel share at ``r`` times the microbatch: its activations and all-reduced bytes scale."""
    return share.model_copy(
        update={
            "sharded_activation_bytes": round(share.sharded_activation_bytes * r),
            "unsplit_activation_bytes": round(share.unsplit_activation_bytes * r),
            "fwd_allreduce_bytes": round(share.fwd_allreduce_bytes * r),
            "fwd_allgather_bytes": round(share.fwd_allgather_bytes * r),
            "head_allgather_bytes": round(share.head_allgather_bytes * r),
            "head_rows": round(share.head_rows * r),
            "bwd_allreduce_bytes": round(share.bwd_allreduce_bytes * r),
            "sequence": None if share.sequence is None else _sequence_at(share.sequence, r),
        }
    )


def _sequence_at(seq: SequenceShare, r: float) -> SequenceShare:
    """A block's sequence share at ``r`` times the microbatch: its bytes scale (the parameters' do not)."""
    fields = ("activation_bytes", "gather_bytes", "regather_bytes", "whole_input_bytes")
    return seq.model_copy(update={f: round(getattr(seq, f) * r) for f in fields})


def blocks_resized(
    blocks: Sequence[BlockCost], costed: int, size: int, profiled: int | None, fixed_fraction: float
) -> list[BlockCost]:
    """Block costs at microbatch size ``costed`` (themselves rescaled from ``profiled`` by ``blocks_at``)
    rescaled to ``size`` under the same law: what ``blocks_at`` would give from the profiled costs.

    The law is anchored at the profiled size: ``t(s) = t(profiled) * (f + (1 - f) * s / profiled)``,
    so going from ``costed`` to ``size`` multiplies times by ``(f * profiled + (1 - f) * size) /
    (f * profiled + (1 - f) * costed)``: ``blocks_at`` from ``costed`` with the fixed share
    ``f * profiled / (f * profiled + (1 - f) * costed)``. Bytes scale with ``size / costed``.

    Args:
        blocks: per-block costs at ``costed``.
        costed: the microbatch size they are for.
        size: the microbatch size wanted.
        profiled: the size the costs were profiled at (None: unknown, the law taken at ``costed``).
        fixed_fraction: the fitted share of a microbatch's time at ``profiled`` that does not scale.

    Returns:
        The rescaled blocks (the same objects when ``size == costed``).
    """
    anchor = costed if profiled is None else profiled
    fixed = fixed_fraction * anchor
    share = fixed / (fixed + (1.0 - fixed_fraction) * costed) if fixed > 0 else 0.0
    return blocks_at(blocks, costed, size, share)
