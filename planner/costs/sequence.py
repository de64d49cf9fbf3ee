"""What sequence parallelism changes in a block, counted during the tensor-parallel share run
(``planner.costs.tensor_parallel``): its ``SequenceShare``.

The run follows sequence shards as the runner makes them (``planner.run.sequence_shard``): a
row-wise layer's output is one, and so is every tensor an operator outside the split layers makes
from one; a column-wise layer's input is gathered whole. Per block it counts the bytes autograd
saves of sequence shards (split ``tp`` ways under sequence parallelism), the work of the operators
on them, the column-wise layers' distinct inputs (a sequence shard: all-gathered in forward and
reduce-scattered in backward; a whole one: all-reduced in backward), the whole parameters read on
sequence shards (their gradients all-reduced), and, per cut, the share of the crossing bytes that
are sequence shards (gathered before they leave a stage, cut again on arrival).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from planner.schema.request import PlanRequest
from planner.schema.shares import SequenceShare, TensorParallelShare


@dataclass
class SeqTally:
    """One block's sequence-parallel counts (ids dedupe a tensor seen twice)."""

    work: float = 0.0
    saved: dict[int, int] = field(default_factory=dict)
    column: dict[int, int] = field(default_factory=dict)  # of ``saved``, the column-wise layers' inputs
    gathers: list[int] = field(default_factory=list)  # each gather's bytes
    wholes: list[int] = field(default_factory=list)  # each whole input's (wrapped once, reduced once)
    grads: dict[int, int] = field(default_factory=dict)
    regathers: list[int] = field(default_factory=list)  # each gathered shard's bytes, gathered again in backward
    last: int | None = None  # the id of the last column-wise input: the runner gathers again for another
    sums: tuple[int, ...] = (0,) * 10  # of a twin's replayed counts
    mixed: str = ""  # the first operator on shards that mixes positions (``token_wise``)

    def totals(self) -> tuple[int, ...]:
        """(saved, gather bytes, gathers, whole-input bytes, whole inputs, grad bytes, grads, regather
        bytes, regathers, column-input bytes)."""
        own = (
            sum(self.saved.values()),
            sum(self.gathers),
            len(self.gathers),
            sum(self.wholes),
            len(self.wholes),
            sum(self.grads.values()),
            len(self.grads),
            sum(self.regathers),
            len(self.regathers),
            sum(self.column.values()),
        )
        return tuple(a + b for a, b in zip(own, self.sums))

    def replayed(self) -> SeqTally:
        """A copy for a twin block: the same counts as sums."""
        return SeqTally(work=self.work, sums=self.totals(), mixed=self.mixed)

    def column_input(self, key: int, nbytes: int, is_sequence: bool) -> None:
        """A column-wise layer's input (``key``: its id) as the runner takes it: gathered if a sequence
        shard (else wrapped whole) unless the layer before read the same value (the runner holds
        only the last one); a gathered shard is gathered again once in backward, for the weight
        gradients of all the layers that read it (``planner.run.sequence_shard``: q, k and v share one)."""
        if key != self.last:
            (self.gathers if is_sequence else self.wholes).append(nbytes)
            if is_sequence:
                self.regathers.append(nbytes)
        self.last = key

    def share(self, work: float, cut_share: float) -> SequenceShare | None:
        """The block's ``SequenceShare`` (``work``: the block's whole forward work); None when
        nothing of it is a sequence shard."""
        saved, gather_b, gathers, whole_b, wholes, grad_b, grads, regather_b, regathers, column_b = self.totals()
        if not (saved or gathers or self.work or cut_share or grads or self.mixed):
            return None
        return SequenceShare(
            activation_bytes=saved,
            compute=min(1.0, self.work / work) if work > 0 else 0.0,
            gather_bytes=gather_b,
            gathers=gathers,
            whole_input_bytes=whole_b,
            whole_inputs=wholes,
            param_grad_bytes=grad_b,
            param_grads=grads,
            regather_bytes=regather_b,
            regathers=regathers,
            column_bytes=column_b,
            cut_share=min(1.0, cut_share),
            mixed=self.mixed,
        )


# operators that work token by token on a [batch, seq, features] shard besides the pointwise ones
_COPIES = ("_to_copy", "clone", "copy_", "detach", "alias", "lift_fresh", "contiguous", "_unsafe_view", "reshape")
_NORMS = ("native_layer_norm", "_fused_rms_norm", "rms_norm", "layer_norm")
_LAST_DIM = (
    "mean",
    "sum",
    "amax",
    "amin",
    "var",
    "std",
    "var_mean",
    "_softmax",
    "_log_softmax",
    "softmax",
    "log_softmax",
)
_MATMULS = ("mm", "addmm", "linear", "matmul")  # with a weight: each token's row times the weight


def token_wise(
    func: Any, args: Sequence[Any], is_shard: Callable[[Any], bool], is_state: Callable[[Any], bool]
) -> bool:
    """Whether an aten operator that reads a sequence shard works token by token, so that each
    tensor-parallel rank can run it on its slice of the sequence (DTensor then needs no traffic).

    Pointwise operators, views and copies, norms over the features, reductions and softmax over the
    last dimension, and a matrix product of a shard with a weight do; anything else (attention over
    the sequence, a reduction over it, a concatenation) is counted as mixing positions: conservative,
    a plan then refuses sequence parallelism instead of failing at run time.

    Args:
        func: the aten operator (an ``OpOverload``).
        args: its positional arguments.
        is_shard: whether a tensor is a sequence shard.
        is_state: whether a tensor is a parameter or buffer (or made of them alone).
    """
    name = func.overloadpacket.__name__
    if torch.Tag.pointwise in func.tags or func.is_view or name in _COPIES or name in _NORMS:
        return True
    if name in _LAST_DIM:
        x = args[0] if args else None
        dims = args[1] if len(args) > 1 else None
        dims = [dims] if isinstance(dims, int) else dims
        if not isinstance(x, torch.Tensor) or not dims:
            return False
        return all(d in (-1, x.dim() - 1) for d in dims)
    if name in _MATMULS:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        return sum(map(is_shard, tensors)) == 1 and all(is_shard(t) or is_state(t) for t in tensors)
    return False


def sequence_refusal(shares: Mapping[str, TensorParallelShare]) -> str | None:
    """Why sequence parallelism cannot split the model (the first block whose ``SequenceShare.mixed``
    says so), or None."""
    for name, share in shares.items():
        if share.sequence is not None and share.sequence.mixed:
            return (
                f"block {name} {share.sequence.mixed}, so its activations between a row-wise and the next "
                "column-wise layer cannot be split along the sequence (attention the tp_plan leaves whole, a "
                "reduction over the sequence and random operators such as dropout cannot)"
            )
    return None


def sequence_note(request: PlanRequest, tp: int, tp_note: str, refused: str) -> str:
    """The plan's note on sequence parallelism, where the plan is split or the option was asked for.

    A split plan says why it runs without it (``refused``: ``sequence_refusal`` as a note). Asked for
    with ``--tp auto`` (``--tp 1`` with it is refused by the request) and planned at tp 1, the option
    is said to be unused, and why, rather than dropped without a word: it splits along the sequence
    what tensor parallelism keeps whole, so at tp 1 it has nothing to split.

    Args:
        request: the plan request (``sequence_parallel``, and the degrees ``--tp auto`` tried).
        tp: the plan's tensor-parallel degree.
        tp_note: the plan's note on why the model stays whole ("" when there is none).
        refused: the note on why the model's shards cannot run it ("" when they can).

    Returns:
        The note, or "".
    """
    if tp == 1 and request.sequence_parallel is not True:  # neither split nor asked for: nothing to say
        return ""
    if tp > 1 or refused:
        return refused
    if tp_note:  # the note before this one says why the model stays whole
        return "sequence parallelism: none, it needs tensor parallelism"
    if request.tp_options == [1] and request.gpu_type in (None, "cpu"):
        why = "--tp auto keeps tp 1 on a plan measured here or for --gpu-type cpu (it searches degrees for GPUs)"
    elif request.tp_options == [1]:
        why = "no tensor-parallel degree over 1 divides both --gpus and a node's ranks (--gpus-per-node)"
    else:
        why = "the chosen layout has tp 1 (the fastest that fits, of the degrees the model's tp plan allows)"
    return f"sequence parallelism: none, {why}; give --tp N (N > 1) to split the model with it"


def cut_shares(cuts: Iterable[Iterable[str]], sequence_nodes: set[str], nbytes: Callable[[str], int]) -> list[float]:
    """For each cut (the names of the values crossing it), the share of its bytes that are sequence shards.

    Args:
        cuts: the values crossing each cut, in order.
        sequence_nodes: the names of the values the run found to be sequence shards.
        nbytes: a value's bytes as traced.

    Returns:
        One share per cut (0 where nothing crosses).
    """
    out = []
    for names in cuts:
        sizes = [(nbytes(n), n in sequence_nodes) for n in names]
        total = sum(b for b, _ in sizes)
        out.append(sum(b for b, s in sizes if s) / total if total else 0.0)
    return out


def sequence_only(seq: SequenceShare) -> TensorParallelShare:
    """The share of a block that holds no split layer but computes on sequence shards."""
    return TensorParallelShare(
        sharded_params=0,
        sharded_param_bytes=0,
        sharded_compute=0.0,
        sharded_activation_bytes=0,
        unsplit_activation_bytes=seq.activation_bytes,
        fwd_allreduce_bytes=0,
        bwd_allreduce_bytes=0,
        fwd_allreduces=0,
        bwd_allreduces=0,
        divisor=0,
        sequence=seq,
    )


__all__ = ["SeqTally", "cut_shares", "sequence_only", "sequence_refusal", "sequence_note", "token_wise"]
