"""Context parallelism inside a stage: each sequence split along dimension 1 over the context-parallel
ranks, attention over the whole sequence by gathering its keys and values.

Long-context training splits every sequence over ``cp`` ranks (Megatron-Core's
``--context-parallel-size``, torch's ``context_parallel`` in torchtitan; the Llama 3 run's long-context
stage with cp 16). Each rank holds the same stages (weights whole) and runs its own chunk of every
sequence through them: everything that acts token by token (embeddings, linear layers, norms,
residual adds, the loss) runs on the chunk alone; attention, the one operator that mixes positions,
needs every position's keys and values. Here they are all-gathered (the Llama 3 run's choice, cheap
with grouped-query attention's few key/value heads), and each rank's queries attend to them under the
causal mask of their own positions; in backward the keys' and values' gradients are
reduce-scattered back to the ranks that made them.

It runs on any traced stage without knowing its code, with torch's DTensors over the rank's
context-parallel mesh:

* the stage's inputs (the sequence chunks it receives) enter as DTensors sharded along dimension 1
  (``Shard(1)``): a view or transpose of one keeps its sequence sharding, and a position table the
  model slices by the sequence's length (rotary embeddings) is sliced at the global length and cut to
  this rank's positions when it meets the chunk, so positions follow the chunks without the model
  being told;
* ``Context`` wraps every plain tensor of a call that also reads such a DTensor (a weight, a buffer)
  as a replicated DTensor whose gradient is this rank's own part (``grad_placements=[Partial()]``):
  the chunks' weight gradients are not summed here; the replicas' averaging (DDP or FSDP over the
  ``dp x cp`` replicas, ``planner.schema.plan.Plan.replicas``) adds them, which with every rank's
  loss the mean over its equal chunk gives the gradient of the mean over the whole sequence;
* ``scaled_dot_product_attention`` on sequence-sharded queries is replaced by the gathered
  attention above, exact for ``is_causal`` and for a mask the model passes (its rows cut to the
  rank's queries);
* the stage's outputs leave as this rank's chunk (a plain tensor again), what the next stage, or
  the loss with the target's chunk, reads; the loss is weighted by the positions the chunk counts
  (``chunk_weighted_loss``: a padded sequence's chunks count different numbers).

Where tensor parallelism splits the stage too, its sharded layers see plain tensors (their own
DTensors are on the tensor-parallel mesh): ``around_sharded`` unwraps a layer's input and wraps its
output again around torch's own hooks. Which values crossing a pipeline boundary are chunks is a rule on
their shapes (``boundary_chunks``), the sender's and the receiver's alike. ``planner.core.levers.context_parallel`` charges the same gathers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from planner.capture.attention import SDPA_CALLS, sdpa_arguments
from planner.capture.contract import SEQUENCE_DIM
from planner.errors import PlannerError
from planner.run.experts import contiguous_strides, exchange_rows
from planner.run.ring_attention import Ring, ring_attention
from planner.run.sequence_shard import SavedShards, autocast_cast, hook_units
from planner.run.wrappers import ContiguousGrad
from planner.torch_compat import pytree

_HEAD_SEQUENCE_DIM = 2  # [batch, heads, seq, head_dim]: attention's queries, keys and values


def sequence_chunk(value: Any, rank: int, cp: int, what: str = "input") -> Any:
    """This context-parallel rank's chunk of a batch's sequences: every tensor of two or more
    dimensions cut along dimension 1 into ``cp`` equal chunks, the ``rank``-th kept (tuples, lists
    and dicts of them followed; a tensor of one dimension, a per-sample value, kept whole).

    Args:
        value: a batch's inputs or target (this replica's rows).
        rank: the chunk, 0 .. cp - 1.
        cp: the plan's context-parallel ranks.
        what: what ``value`` is, for the error.

    Returns:
        The same structure holding the chunks.

    Raises:
        PlannerError: a sequence does not split into ``cp`` equal chunks.
    """
    if cp == 1:
        return value
    if isinstance(value, torch.Tensor):
        if value.dim() < 2:
            return value
        length = value.shape[SEQUENCE_DIM]
        if length % cp:
            raise PlannerError(
                f"the {what}'s sequence has {length} positions, which do not split into cp {cp} equal chunks; "
                f"use a sequence length divisible by {cp}"
            )
        n = length // cp
        return value.narrow(SEQUENCE_DIM, rank * n, n).contiguous()
    if isinstance(value, (tuple, list)):
        return type(value)(sequence_chunk(v, rank, cp, what) for v in value)
    if isinstance(value, dict):
        return {k: sequence_chunk(v, rank, cp, what) for k, v in value.items()}
    return value


def boundary_chunks(values: Sequence[Any], length: int) -> list[bool]:
    """Which values crossing a pipeline boundary (or entering the first stage) cross as sequence
    chunks: the tensors of two or more dimensions whose dimension 1 is the sequence's ``length``.
    The others cross whole: a causal mask ``[batch, 1, seq, seq]``, a per-sample value.

    Either way each rank receives the same global tensor (DTensor semantics): a chunk is wrapped as
    ``Shard(1)`` of it, a whole value is used as it is; the rule only has to be the sender's and the
    receiver's alike, which a rule on the example's shapes is.

    Args:
        values: the boundary's example values, whole.
        length: the sequence's length (the model inputs' dimension 1).

    Returns:
        One flag per value.
    """
    return [isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[SEQUENCE_DIM] == length for v in values]


def chunk_flagged(values: tuple, flags: Sequence[bool], cp: int) -> tuple:
    """``values`` with the flagged ones cut to the first of ``cp`` chunks of their sequence (the
    shapes a stage's ``PipelineStage`` sizes its buffers by)."""
    return tuple(sequence_chunk(v, 0, cp) if f else v for v, f in zip(values, flags, strict=True))


IGNORE_INDEX = -100  # the target value torch's cross_entropy and transformers' losses leave out


def chunk_weighted_loss(loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], mesh: Any) -> Callable[..., torch.Tensor]:
    """The model's loss on a rank's chunk, weighted so that the context-parallel ranks' mean is the
    whole sequence's loss.

    A loss is a mean over the positions it counts; the chunks of a padded sequence count different
    numbers of them (padding sits at the end), and the mean of their means is not the sequence's. So
    each chunk's loss is scaled by its counted positions (targets other than ``IGNORE_INDEX``) over
    the group's mean count, one all-reduce of a count per microbatch (a chunk that counts none
    contributes 0). Unpadded sequences count alike: every weight is 1.

    Args:
        loss_fn: the model's ``loss_fn(output, target)``.
        mesh: the rank's context-parallel mesh.

    Returns:
        ``loss_fn`` weighted.
    """

    def weighted(output: Any, target: torch.Tensor) -> torch.Tensor:
        counted = (target != IGNORE_INDEX).sum().to(torch.float64) if not target.is_floating_point() else None
        if counted is None:  # a regression target counts every position
            return loss_fn(output, target)
        total = counted.clone()
        dist.all_reduce(total, group=mesh.get_group())
        if counted.item() == 0:  # its mean would be 0 / 0
            first = next(t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor))
            return first.sum() * 0.0
        return loss_fn(output, target) * float(counted.item() * mesh.size() / total.item())

    return weighted


def _is_chunked(x: Any, mesh: Any) -> bool:
    """Whether ``x`` is a DTensor on the context-parallel mesh."""
    from torch.distributed.tensor import DTensor

    # (equality, not identity: torch.compile's trace of the mode sees another object for the same mesh)
    return isinstance(x, DTensor) and x.device_mesh == mesh


@dataclass(frozen=True)
class Placements:
    """The placements of a stage's chunks on their mesh, over the context-parallel ranks and, on a
    ``(cp, tp)`` mesh (sequence parallelism), replicated over the tensor-parallel ranks. Made once
    when the split is installed: read inside a compiled stage, a mesh's own attributes would be traced.

    Attributes:
        chunk: a chunk of the sequence (``Shard(1)``).
        heads: a chunk of attention's ``[batch, heads, seq, head_dim]`` (``Shard(2)``).
        whole: every position (``Replicate()``).
        own: a gradient left as this rank's own over the cp ranks (``Partial()``), replicated over tp.
        shard: on a ``(cp, tp)`` mesh, a tensor-parallel rank's slice of the chunk (``Shard(1)`` on both).
        partial: on a ``(cp, tp)`` mesh, the chunk's gradient as each tp rank's partial sum.
    """

    chunk: tuple[Any, ...]
    heads: tuple[Any, ...]
    whole: tuple[Any, ...]
    own: tuple[Any, ...]
    shard: tuple[Any, ...]
    partial: tuple[Any, ...]


def placements_on(mesh: Any) -> Placements:
    """The ``Placements`` of chunks on ``mesh`` (1-D: cp; 2-D: (cp, tp))."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    rest = (Replicate(),) * (mesh.ndim - 1)
    return Placements(
        chunk=(Shard(SEQUENCE_DIM), *rest),
        heads=(Shard(_HEAD_SEQUENCE_DIM), *rest),
        whole=(Replicate(), *rest),
        own=(Partial(), *rest),
        shard=(Shard(SEQUENCE_DIM),) * mesh.ndim,
        partial=(Shard(SEQUENCE_DIM), *(Partial(),) * (mesh.ndim - 1)),
    )


class Context(TorchFunctionMode):
    """A stage's forward on sequence chunks: plain tensors meeting a chunked DTensor become replicated
    ones, attention on chunked queries gathers the keys and values (see the module docstring).

    Args:
        mesh: the mesh the chunks' DTensors live on: the rank's 1-D context-parallel mesh, or under
            sequence parallelism its 2-D ``(cp, tp)`` mesh (``RankMesh.cp_tp_mesh``).
        ring: the group's ring where attention is ring attention (``planner.run.ring_attention``); None:
            the gather.
        group: the context-parallel group's 1-D mesh, where keys, values and queries are exchanged
            (``mesh`` itself without sequence parallelism).
        placements: the chunks' placements on ``mesh`` (``placements_on``).
    """

    def __init__(self, mesh: Any, ring: Ring | None, group: Any, placements: Placements) -> None:
        super().__init__()
        self.mesh = mesh
        self.group_mesh = group
        self.ring = ring
        self.placements = placements

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.distributed.tensor import DTensor

        kwargs = kwargs or {}
        if func in SDPA_CALLS and args and _is_chunked(args[0], self.mesh):
            return self._attention(*args, **kwargs)
        leaves = pytree.tree_leaves((args, kwargs))
        if any(_is_chunked(a, self.mesh) for a in leaves) and any(
            isinstance(a, torch.Tensor) and not isinstance(a, DTensor) for a in leaves
        ):
            # the gradient is this rank's own over the cp ranks (the replicas' averaging adds the chunks'),
            # summed over the tp ranks (each computed it from its slice of the chunk: sequence parallelism)
            everywhere, own = self.placements.whole, self.placements.own

            def wrap(a: Any) -> Any:
                if isinstance(a, torch.Tensor) and not isinstance(a, DTensor):
                    return DTensor.from_local(a, self.mesh, everywhere, run_check=False, grad_placements=own)
                return a

            args, kwargs = pytree.tree_map(wrap, (args, kwargs))
        return func(*args, **kwargs)

    def _attention(self, *args: Any, **kwargs: Any) -> Any:
        """Scaled dot-product attention of this rank's queries over every position's keys and values."""
        from torch.distributed.tensor import DTensor

        a = sdpa_arguments(args, kwargs)
        q, k, v = a["query"], a["key"], a["value"]
        chunked = self.placements.heads
        if any(not _is_chunked(t, self.mesh) or t.placements != chunked for t in (q, k, v)):
            raise PlannerError(
                "context parallelism needs attention's queries, keys and values split along the sequence "
                f"([batch, heads, seq, head_dim]); this model's are placed {[getattr(t, 'placements', None) for t in (q, k, v)]}"
            )

        # a DTensor made from a local gradient takes the global strides of a contiguous tensor, and
        # attention's backward may return its gradients in another layout, which a later ``view`` of the
        # DTensor's local part then cannot follow: the gradients leave attention contiguous
        def whole(t: Any) -> torch.Tensor:
            # every position's keys (or values), their gradient reduce-scattered back in backward
            return ContiguousGrad.apply(
                t.contiguous()
                .redistribute(self.mesh, self.placements.whole)
                .to_local(grad_placements=self.placements.own)
            )

        local_q = ContiguousGrad.apply(q.contiguous().to_local())
        n = local_q.shape[_HEAD_SEQUENCE_DIM]
        mask, causal = a["attn_mask"], a["is_causal"]
        if causal and mask is not None:
            raise PlannerError("scaled_dot_product_attention was given both a mask and is_causal")
        if isinstance(mask, DTensor):
            mask = mask.redistribute(self.mesh, self.placements.whole).to_local()
        # under a mask (causal, as a decoder's is) each rank computes two mirrored blocks of queries
        group = self.group_mesh
        mirrored = Mirrored(group.get_local_rank(), group.size()) if (causal or mask is not None) else None
        if mirrored is not None and n % 2 == 0:
            local_q = mirrored.swap(local_q, group.get_group())
            rows = mirrored.positions(n // 2, local_q.device)
        else:
            rows = group.get_local_rank() * n + torch.arange(n, device=local_q.device)
            mirrored = None
        if mask is not None and mask.shape[-2] != 1:
            mask = mask.index_select(-2, rows)  # the rows of this rank's queries
        if self.ring is not None:
            out = self._ring(local_q, k, v, rows, mask, a)
        else:
            out = self._gathered(local_q, whole(k), whole(v), rows, mask, a)
        if mirrored is not None:  # each block's output back to the rank holding its positions
            out = mirrored.swap_back(out, group.get_group())
        return DTensor.from_local(out, self.mesh, chunked, run_check=False)

    def _gathered(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, mask: Any, a: dict[str, Any]
    ) -> torch.Tensor:
        """The rank's queries against every position's keys and values, gathered."""
        length = k.shape[_HEAD_SEQUENCE_DIM]
        if a["is_causal"]:
            mask = torch.arange(length, device=q.device)[None, :] <= rows[:, None]
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=a["dropout_p"],
            is_causal=False,
            scale=a["scale"],
            enable_gqa=a["enable_gqa"],
        )

    def _ring(self, q: torch.Tensor, k: Any, v: Any, rows: torch.Tensor, mask: Any, a: dict[str, Any]) -> torch.Tensor:
        """The rank's queries against every position's keys and values, passed around the ring."""
        assert self.ring is not None
        if a["dropout_p"]:
            raise PlannerError(
                f"ring attention runs attention without dropout, and this model's drops out p={a['dropout_p']}; "
                "plan with --cp-attention all-gather, or set the model's attention dropout to 0"
            )

        def own(t: Any) -> torch.Tensor:  # this rank's chunk: its gradient is its own
            return ContiguousGrad.apply(t.contiguous().to_local())

        return ring_attention(
            q, own(k), own(v), rows, mask=mask, causal=bool(a["is_causal"]), scale=a["scale"], ring=self.ring
        )


@dataclass(frozen=True)
class Mirrored:
    """The causal load balance of context parallelism: of a sequence cut into ``2 x size`` blocks,
    rank ``rank`` holds the contiguous blocks ``2 rank`` and ``2 rank + 1`` (its chunk) but computes
    attention for the queries of blocks ``rank`` and ``2 size - 1 - rank``, one early and one late,
    so every rank's causal work is the same (Megatron-Core and torch's ``context_parallel`` cut the
    sequence so from the start; here the chunks stay contiguous for everything else, and only the
    queries and attention's output move, by one all-to-all each way).

    Args:
        rank: this rank's index in its context-parallel group.
        size: the group's ranks.
    """

    rank: int
    size: int

    def owner(self, block: int) -> int:
        """The rank that computes block ``block``'s queries."""
        return block if block < self.size else 2 * self.size - 1 - block

    @property
    def held(self) -> tuple[int, int]:
        """The blocks of this rank's chunk."""
        return 2 * self.rank, 2 * self.rank + 1

    @property
    def computed(self) -> tuple[int, int]:
        """The blocks whose queries this rank computes, in the order it computes them."""
        return self.rank, 2 * self.size - 1 - self.rank

    def positions(self, block: int, device: torch.device) -> torch.Tensor:
        """The sequence positions of the computed queries (``block`` positions a block)."""
        return torch.cat([torch.arange(b * block, (b + 1) * block, device=device) for b in self.computed])

    def _sent(self) -> list[int]:
        """The held blocks in the order they are sent: by the rank computing them, then by block."""
        return sorted(self.held, key=lambda b: (self.owner(b), b))

    def _received(self) -> list[int]:
        """The computed blocks in the order they arrive: by the rank holding them, then by block."""
        return sorted(self.computed, key=lambda b: (b // 2, b))

    def _counts(self, blocks: list[int], rank_of: Callable[[int], int], block: int) -> list[int]:
        return [block * sum(1 for b in blocks if rank_of(b) == r) for r in range(self.size)]

    def swap(self, x: torch.Tensor, group: Any) -> torch.Tensor:
        """``x`` ([batch, heads, seq chunk, dim], this rank's held blocks) as the computed blocks."""
        return self._move(x, self._sent(), self._received(), self.computed, group, back=False)

    def swap_back(self, x: torch.Tensor, group: Any) -> torch.Tensor:
        """The computed blocks' ``x`` (attention's output) as this rank's held blocks again."""
        return self._move(x, self._received(), self._sent(), self.held, group, back=True)

    def _move(
        self, x: torch.Tensor, send: list[int], receive: list[int], order: tuple[int, int], group: Any, back: bool
    ) -> torch.Tensor:
        block = x.shape[_HEAD_SEQUENCE_DIM] // 2
        rows = x.permute(2, 0, 1, 3)  # the sequence first: all_to_all splits dimension 0
        have = dict(zip(self.computed if back else self.held, (rows[:block], rows[block:]), strict=True))
        payload = torch.cat([have[b] for b in send]).contiguous()

        def holder(b: int) -> int:
            return b // 2

        sends = self._counts(send, holder if back else self.owner, block)
        recvs = self._counts(receive, self.owner if back else holder, block)
        got = exchange_rows(payload.new_empty(payload.shape), payload, recvs, sends, group)
        parts = dict(zip(receive, got.split(block), strict=True))
        return torch.cat([parts[b] for b in order]).permute(1, 2, 0, 3).contiguous()


@dataclass(frozen=True)
class SequenceShards:
    """Sequence parallelism inside context parallelism: each context-parallel rank's chunk split again
    along the sequence over its tensor-parallel ranks between a row-wise and the next column-wise layer.

    Args:
        mesh: the rank's 2-D ``(cp, tp)`` mesh (``RankMesh.cp_tp_mesh``): the chunks' DTensors live on it.
        tp_mesh: the rank's tensor-parallel mesh (torch's styles shard the layers over it).
        inputs: for each positional input of the stage, whether it is a sequence shard in the whole
            graph (``planner.capture.tp_sequence``): it arrives as the chunk and is cut to this rank's slice.
    """

    mesh: Any
    tp_mesh: Any
    inputs: Sequence[bool]


class ContextSplit:
    """One stage's context parallelism: installed by ``install``, the hooks share this state.

    Args:
        mesh: the rank's 1-D context-parallel mesh.
        chunks_in: for each positional input of the stage, whether it is a sequence chunk
            (``boundary_chunks``); the others arrive whole.
        chunks_out: the same for each of its outputs (leaving as this rank's chunk, or whole).
        ring: attention by ring attention instead of the gather (``Plan.cp_attention``).
        sequence: sequence parallelism inside the chunks (None: none). Its chunks' DTensors are then
            on the ``(cp, tp)`` mesh: ``(Shard(1), Shard(1))`` between a row-wise and the next
            column-wise layer, ``(Shard(1), Replicate())`` where the tensor-parallel layers split the
            features (each tensor-parallel rank's own, as without it); a column-wise layer's input is
            gathered over the tensor-parallel ranks once per value and kept for its backward as the
            shard (``planner.run.sequence_shard.SavedShards``), a row-wise layer's output
            reduce-scattered along the sequence by torch's style.
    """

    def __init__(
        self,
        mesh: Any,
        chunks_in: Sequence[bool],
        chunks_out: Sequence[bool],
        ring: bool = False,
        sequence: SequenceShards | None = None,
    ) -> None:
        self.group_mesh = mesh
        self.sequence = sequence
        self.mesh = mesh if sequence is None else sequence.mesh  # the chunks' DTensors' mesh
        self.placements = placements_on(self.mesh)
        # one ring for every forward of the stage (its peers are the group's, whatever the step)
        self.ring = Ring(mesh.get_group(), mesh.get_local_rank(), mesh.size()) if ring else None
        self.chunks_in = list(chunks_in)
        self.chunks_out = list(chunks_out)
        self.depth = 0  # units nest (a chain of units, a checkpoint region): one mode at a time
        self.mode: Context | None = None
        self.layer_chunked: dict[int, bool] = {}  # a tensor-parallel layer running: was its input a chunk
        self.saved = SavedShards()

    def enter(self, *_: Any) -> None:
        if self.depth == 0:
            self.mode = Context(self.mesh, self.ring, self.group_mesh, self.placements)
            self.mode.__enter__()
        self.depth += 1

    def leave(self, *_: Any) -> None:
        if self.depth == 0:  # a hook before ``enter`` raised: nothing was entered
            return
        self.depth -= 1
        if self.depth == 0 and self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.mode = None
            self.saved.forget()  # a recomputation (in backward) gathers its own

    def stage_in(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """The stage's inputs, its sequence chunks as DTensors (the mode entered)."""
        from torch.distributed.tensor import DTensor

        while self.depth:  # whatever an earlier failed forward left
            self.leave()
        self.enter()
        chunked = self.placements.chunk
        shards = [False] * len(args)
        if self.sequence is not None:
            self.saved.start()
            shards = list(self.sequence.inputs) + [False] * (len(args) - len(self.sequence.inputs))

        def chunk(x: Any, flag: bool, shard: bool) -> Any:
            if flag and isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
                x = DTensor.from_local(x, self.mesh, chunked, run_check=False)
                # this tensor-parallel rank's slice of the chunk (no traffic; its gradient gathered)
                return x.redistribute(self.mesh, self.placements.shard) if shard else x
            return x

        flags = self.chunks_in + [False] * (len(args) - len(self.chunks_in))
        return tuple(chunk(x, f, sh) for x, f, sh in zip(args, flags, shards, strict=False))

    def stage_out(self, module: nn.Module, args: Any, output: Any) -> Any:
        """The stage's outputs as plain tensors: its sequence chunks as this rank's chunk, the rest whole."""
        self.leave()
        self.saved.stop()
        if isinstance(output, tuple):
            flags = self.chunks_out + [False] * (len(output) - len(self.chunks_out))
            return tuple(self._leaving(t, f) for t, f in zip(output, flags, strict=False))
        return self._leaving(output, bool(self.chunks_out and self.chunks_out[0]))

    def _leaving(self, t: Any, chunk: bool) -> Any:

        if _is_chunked(t, self.mesh):
            return self.local_chunk(t) if chunk else t.redistribute(self.mesh, self.placements.whole).to_local()
        if chunk and isinstance(t, torch.Tensor):  # made from positions alone: this rank's positions
            group = self.group_mesh
            return sequence_chunk(t, group.get_local_rank(), group.size(), "stage boundary")
        return t

    def local_chunk(self, t: Any) -> Any:
        """A DTensor of the mesh as this rank's chunk of its dimension 1 (a plain tensor; a sequence
        shard gathered over the tensor-parallel ranks)."""

        return t.contiguous().redistribute(self.mesh, self.placements.chunk).to_local()

    def layer_in(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """A tensor-parallel layer's input as this rank's plain chunk (torch's hooks wrap it on their own
        mesh); under sequence parallelism a sequence shard as the chunk gathered over the tensor-parallel
        ranks (``_gathered_chunk``)."""
        chunked = bool(args) and _is_chunked(args[0], self.mesh)
        self.layer_chunked[id(module)] = chunked
        if not chunked:
            return args
        if self.sequence is not None and args[0].placements[-1].is_shard():
            return (self._gathered_chunk(args[0]), *args[1:])
        return (self.local_chunk(args[0]), *args[1:])

    def _gathered_chunk(self, x: Any) -> Any:
        """A sequence shard (``(Shard(1), Shard(1))``) as this rank's chunk gathered over the
        tensor-parallel ranks: a DTensor replicated on the tensor-parallel mesh, which torch's
        column-wise style takes as it is, whose partial input gradients (q, k and v reading one value
        add theirs first) are reduce-scattered back in one collective. Kept for backward as the shard."""
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

        assert self.sequence is not None
        whole = self.saved.recent(x)
        if whole is not None:
            return whole
        shard = autocast_cast(x)
        local = shard.redistribute(self.mesh, self.placements.chunk).to_local(grad_placements=self.placements.partial)
        tp_mesh = self.sequence.tp_mesh
        whole = DTensor.from_local(local, tp_mesh, [Replicate()], run_check=False, grad_placements=[Partial()])
        # gathered again for backward from the shard, on the tensor-parallel mesh alone
        self.saved.gathered(
            whole, DTensor.from_local(shard.to_local().detach(), tp_mesh, [Shard(SEQUENCE_DIM)], run_check=False)
        )
        self.saved.remember(x, whole)
        return whole

    def layer_out(self, module: nn.Module, args: Any, output: Any) -> Any:
        """A tensor-parallel layer's output as a chunk of the sequence again, where its input was one
        (a row-wise layer's reduce-scattered output under sequence parallelism as the sequence shard)."""
        from torch.distributed.tensor import DTensor

        if not self.layer_chunked.pop(id(module), False):
            return output
        chunked = self.placements.chunk

        def chunk(x: Any) -> Any:
            if isinstance(x, DTensor) and self.sequence is not None and x.device_mesh == self.sequence.tp_mesh:
                return DTensor.from_local(x.to_local(), self.mesh, self.placements.shard, run_check=False)
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and x.dim() >= 2:
                return DTensor.from_local(x, self.mesh, chunked, run_check=False)
            return x

        return pytree.tree_map(chunk, output)


def install(
    stage: nn.Module,
    units: Sequence[nn.Module],
    mesh: Any,
    chunks: tuple[Sequence[bool], Sequence[bool]],
    ring: bool = False,
    sequence: SequenceShards | None = None,
) -> ContextSplit:
    """Install context parallelism on a stage.

    Call before FSDP or DDP wrap anything: FSDP's hooks (registered later, its pre-forward hooks
    prepended) then run outside the mode. Where tensor parallelism shards layers of the stage, call
    ``around_sharded`` after it has.

    Args:
        stage: the stage module (its inputs and outputs cross pipeline boundaries).
        units: the modules it runs one after another (``stage_units``): each runs under the mode,
            also when a recomputation re-runs it in backward.
        mesh: the rank's context-parallel mesh.
        chunks: which of the stage's positional inputs, and which of its outputs, are sequence
            chunks (``boundary_chunks``).
        ring: attention by ring attention (``planner.run.ring_attention``) instead of the gather.
        sequence: sequence parallelism inside the chunks (``ContextSplit``; None: none). Its layers
            are sharded with torch's sequence-parallel styles (``shard_stage(sequence=True)``) and
            hooked by ``around_sharded``; ``planner.run.sequence_shard`` is not installed.

    Returns:
        The shared state (held by the hooks).
    """
    split = ContextSplit(mesh, *chunks, ring=ring, sequence=sequence)
    hook_units(stage, units, split)
    return split


def around_sharded(split: ContextSplit, layers: Sequence[nn.Module]) -> None:
    """Let tensor-parallel layers (already sharded by torch's styles) see plain chunks: the input
    unwrapped before torch's input hook, the output wrapped again after its output hook.

    Args:
        split: the stage's context parallelism (``install``).
        layers: its tensor-parallel layers.
    """
    for layer in layers:
        layer.register_forward_pre_hook(split.layer_in, prepend=True)
        layer.register_forward_hook(split.layer_out)


def around_tokens(split: ContextSplit, modules: Sequence[nn.Module]) -> None:
    """Let modules that work token by token on flattened tokens (an experts call: ``[T, d]`` rows
    routed by ``[T, k]`` indices) see this rank's plain rows: the chunked DTensors among their inputs
    unwrapped as they are placed (a chunk's rows flattened are ``_StridedShard`` of the global rows:
    its local part is exactly this rank's tokens), the output wrapped again as the first input was,
    its width the output's own. Exact for any module that computes each row on its own.

    Args:
        split: the stage's context parallelism (``install``).
        modules: the modules.
    """
    placed_as: dict[int, tuple[Any, torch.Size]] = {}

    def unwrap(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        from torch.distributed.tensor import DTensor

        first = args[0] if args else None
        if first is None or not _is_chunked(first, split.mesh):
            return args
        placed_as[id(module)] = (first.placements, first.shape)

        def local(x: Any) -> Any:
            if not isinstance(x, DTensor):
                return x
            if x.placements != first.placements:  # the rows as the first input's (a router's output gathered)
                x = x.redistribute(split.mesh, first.placements)
            return x.to_local(grad_placements=x.placements)

        return tuple(local(x) for x in args)

    def wrap(module: nn.Module, args: Any, output: Any) -> Any:
        from torch.distributed.tensor import DTensor

        found = placed_as.pop(id(module), None)
        if found is None or not isinstance(output, torch.Tensor) or isinstance(output, DTensor):
            return output
        placements, shape = found
        whole = torch.Size((*shape[:-1], output.shape[-1]))
        return DTensor.from_local(
            output, split.mesh, placements, run_check=False, shape=whole, stride=contiguous_strides(whole)
        )

    for module in modules:
        module.register_forward_pre_hook(unwrap, prepend=True)
        module.register_forward_hook(wrap)


__all__ = [
    "Context",
    "ContextSplit",
    "Mirrored",
    "Placements",
    "SequenceShards",
    "around_sharded",
    "around_tokens",
    "boundary_chunks",
    "chunk_flagged",
    "chunk_weighted_loss",
    "install",
    "placements_on",
    "sequence_chunk",
]
