"""Ring attention: a context-parallel rank's queries against every position's keys and values, the
keys and values passed around the group's ring one chunk at a time instead of gathered whole.

Each of the ``cp`` ranks holds its own chunk of the sequence's keys and values. In ``cp`` steps each
rank attends its queries to the chunk it holds while it sends that chunk on to the next rank and
receives the previous rank's (``torch.distributed`` sends, overlapped with the step's attention), and
merges the steps' partial results by their log-sum-exp, as flash attention merges its tiles (Liu et
al. 2023, "Ring Attention with Blockwise Transformers", arXiv 2310.01889; Megatron-Core's
``--cp-comm-type p2p``, torch's ``context_parallel`` with its all-to-all rotation). No rank ever
holds more than two chunks, and backward keeps only its own: it passes the chunks around again, with
the keys' and values' gradients travelling beside them, each chunk's gradient summed over the ring and
arriving home after ``cp`` steps. Under a causal mask a step whose keys all lie after the rank's
queries computes nothing (it still passes its chunk on).

The arithmetic is exact attention in float32 or wider (scores, softmax, the merge), cast to the inputs' dtype
at the end; the gradients travel in the keys' dtype. ``planner.core.levers.context_parallel`` charges
the steps' sends, hidden behind each step's attention as far as it lasts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_NEG_INF = float("-inf")


class Ring:
    """The ring of a context-parallel group: who this rank sends to and receives from.

    Args:
        group: the group's process group.
        rank: this rank's index in it.
        size: its ranks.
    """

    def __init__(self, group: Any, rank: int, size: int) -> None:
        self.group = group
        self.rank = rank
        self.size = size
        self.next = dist.get_global_rank(group, (rank + 1) % size)
        self.prev = dist.get_global_rank(group, (rank - 1) % size)

    def holder(self, step: int) -> int:
        """Whose chunk this rank holds at ``step`` (its own at step 0, then the ranks before it)."""
        return (self.rank - step) % self.size

    def shift(self, tensors: list[torch.Tensor]) -> _Shift:
        """Start sending ``tensors`` to the next rank and receiving the previous rank's alike."""
        sent = [t.contiguous() for t in tensors]
        got = [torch.empty_like(t) for t in sent]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in sent]
        ops += [dist.P2POp(dist.irecv, g, self.prev, self.group) for g in got]
        return _Shift(got, sent, dist.batch_isend_irecv(ops))


class _Shift:
    """Sends and receives under way (the sent tensors kept alive until they are done)."""

    def __init__(self, got: list[torch.Tensor], sent: list[torch.Tensor], requests: list[Any]) -> None:
        self.got, self.sent, self.requests = got, sent, requests

    def wait(self) -> list[torch.Tensor]:
        """What arrived, once every send and receive is done."""
        for r in self.requests:
            r.wait()
        self.sent = []
        return self.got


def _wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the dtype the arithmetic runs in: float32, or wider where ``x`` is."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Keys or values repeated to the queries' heads (grouped-query attention), widened (``_wide``)."""
    x = _wide(x)
    return x.repeat_interleave(groups, dim=-3) if groups > 1 else x


def _summed_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """A gradient at the queries' heads summed back to the keys' (the inverse of ``_heads``)."""
    if groups == 1:
        return x
    b, h, n, d = x.shape
    return x.view(b, h // groups, groups, n, d).sum(2)


class _Masks:
    """Which of a rank's queries may attend to which keys, a chunk of keys at a time.

    Args:
        rows: the sequence positions of the rank's queries.
        chunk: positions in each key chunk.
        causal: keys after a query's position are masked.
        mask: the model's mask with its rows already this rank's queries' (``[..., queries, length]``,
            boolean: True attends; else added to the scores), or None.
    """

    def __init__(self, rows: torch.Tensor, chunk: int, causal: bool, mask: torch.Tensor | None) -> None:
        self.rows, self.chunk, self.causal, self.mask = rows, chunk, causal, mask
        self.last = int(rows.max()) if causal else 0  # read once: on a GPU each read waits for the device

    def columns(self, holder: int) -> torch.Tensor:
        return holder * self.chunk + torch.arange(self.chunk, device=self.rows.device)

    def empty(self, holder: int) -> bool:
        """Whether causality masks every key of ``holder``'s chunk from every query."""
        return self.causal and holder * self.chunk > self.last

    def scores(self, s: torch.Tensor, holder: int) -> torch.Tensor:
        """The scores ``s`` of ``holder``'s chunk, masked (-inf where a query may not attend)."""
        cols = self.columns(holder)
        if self.causal:
            s = s.masked_fill(cols[None, :] > self.rows[:, None], _NEG_INF)
        if self.mask is not None:
            m = self.mask if self.mask.shape[-1] == 1 else self.mask.index_select(-1, cols)
            s = s.masked_fill(~m, _NEG_INF) if m.dtype == torch.bool else s + m
        return s


def _probabilities(
    q: torch.Tensor, k: torch.Tensor, masks: _Masks, holder: int, scale: float, lse: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's softmax numerators ``exp(s - lse)`` and the chunk's own log-sum-exp (where ``lse``
    is None, the chunk's; else the whole row's, as backward reads them)."""
    s = masks.scores(torch.matmul(q, k.transpose(-1, -2)) * scale, holder)
    own = torch.logsumexp(s, dim=-1)
    ref = own if lse is None else lse
    safe = torch.where(torch.isinf(ref), torch.zeros_like(ref), ref)  # a row with nothing to attend: all 0
    return torch.exp(s - safe[..., None]), own


def _merged(
    out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions over disjoint keys merged by their log-sum-exps."""
    new = torch.logaddexp(lse, part_lse)
    finite = ~torch.isinf(new)
    w_old = torch.where(finite, torch.exp(lse - new), torch.zeros_like(new))
    w_new = torch.where(finite, torch.exp(part_lse - new), torch.zeros_like(new))
    return out * w_old[..., None] + part * w_new[..., None], new


class RingAttention(torch.autograd.Function):
    """``softmax(q k^T * scale + mask) v`` over every rank's keys and values, passed around the ring
    (see the module docstring). Inputs are this rank's plain tensors: ``q`` its queries
    ``[batch, heads, queries, dim]`` at sequence positions ``rows``, ``k`` and ``v`` its own chunk of
    the keys and values ``[batch, kv heads, chunk, dim]`` (chunk ``rank`` of ``size``, in order)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rows: torch.Tensor,
        mask: torch.Tensor | None,
        causal: bool,
        scale: float,
        ring: Ring,
    ) -> torch.Tensor:
        groups = q.shape[-3] // k.shape[-3]
        masks = _Masks(rows, k.shape[-2], causal, mask)
        qf = _wide(q)
        out = qf.new_zeros((*q.shape[:-1], v.shape[-1]))
        lse = qf.new_full(q.shape[:-1], _NEG_INF)
        held = [k, v]
        for step in range(ring.size):
            pending = ring.shift(held) if step < ring.size - 1 else None
            holder = ring.holder(step)
            if not masks.empty(holder):
                p, part_lse = _probabilities(qf, _heads(held[0], groups), masks, holder, scale, None)
                out, lse = _merged(out, lse, torch.matmul(p, _heads(held[1], groups)), part_lse)
            if pending is not None:
                held = pending.wait()
        ctx.save_for_backward(q, k, v, rows, out, lse, *([] if mask is None else [mask]))
        ctx.causal, ctx.scale, ctx.ring, ctx.groups = causal, scale, ring, groups
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple:  # type: ignore[override]
        q, k, v, rows, out, lse, *mask = ctx.saved_tensors
        ring, groups, scale = ctx.ring, ctx.groups, ctx.scale
        masks = _Masks(rows, k.shape[-2], ctx.causal, mask[0] if mask else None)
        qf, do = _wide(q), _wide(dout)
        delta = (do * out).sum(-1, keepdim=True)  # softmax's backward: rowsum(dO * O)
        dq = torch.zeros_like(qf)
        held = [k, v]
        grads = [torch.zeros_like(k), torch.zeros_like(v)]  # the held chunk's, summed around the ring
        arriving = None
        for step in range(ring.size):
            pending = ring.shift(held) if step < ring.size - 1 else None
            holder = ring.holder(step)
            dk = dv = None
            if not masks.empty(holder):
                kk, vv = _heads(held[0], groups), _heads(held[1], groups)
                p, _ = _probabilities(qf, kk, masks, holder, scale, lse)
                dv = _summed_heads(torch.matmul(p.transpose(-1, -2), do), groups)
                ds = p * (torch.matmul(do, vv.transpose(-1, -2)) - delta)
                dq += torch.matmul(ds, kk) * scale
                dk = _summed_heads(torch.matmul(ds.transpose(-1, -2), qf) * scale, groups)
            if arriving is not None:  # the held chunk's gradients so far, from the rank before
                grads = arriving.wait()
            if dk is not None and dv is not None:
                grads = [(_wide(grads[0]) + dk).to(k.dtype), (_wide(grads[1]) + dv).to(v.dtype)]
            arriving = ring.shift(grads)  # on to the next rank; after the last step, home
            if pending is not None:
                held = pending.wait()
        assert arriving is not None
        dk_own, dv_own = arriving.wait()
        return dq.to(q.dtype), dk_own, dv_own, None, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rows: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float | None,
    ring: Ring,
) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence by ring attention.

    Args:
        q: the rank's queries ``[batch, heads, queries, dim]``.
        k: its own chunk of the keys ``[batch, kv heads, chunk, dim]`` (heads dividing the queries').
        v: the same of the values.
        rows: the queries' sequence positions (``queries`` of them).
        mask: the model's mask, its rows the queries' (boolean: True attends; else added), or None.
        causal: whether keys after a query's position are masked.
        scale: the scores' scale; None: ``1 / sqrt(dim)`` as ``scaled_dot_product_attention``'s.
        ring: the group's ring.

    Returns:
        The attention's output ``[batch, heads, queries, value dim]`` in ``q``'s dtype.
    """
    s = scale if scale is not None else q.shape[-1] ** -0.5
    return RingAttention.apply(q, k, v, rows, mask, causal, s, ring)  # type: ignore[no-any-return]


__all__ = ["Ring", "RingAttention", "ring_attention"]
