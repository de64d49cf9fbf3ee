"""Stage boundaries scattered over the tensor-parallel ranks (Megatron-LM's scatter-gather).

Under tensor parallelism the hidden state at a stage boundary is the same on every tensor-parallel
rank of a pipeline rank (each layer ends in a row-wise all-reduce). Sending it whole from each of
them to its peer on the next pipeline rank would move ``tp`` copies over the slower link between
nodes; instead each rank sends a ``1/tp`` piece (the tensor flattened, piece ``tp_rank``) and the
receiving ranks all-gather the pieces over the node's link (Narayanan et al., "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC 2021, section 4.1). The
gradient goes back the same way: each receiving rank returns its piece of its input's gradient
(also the same on every tensor-parallel rank: the column-wise layers all-reduce it), the sender
all-gathers it.

Only boundaries between two pipeline ranks are scattered (a boundary inside one rank, the turn of
a V, hands its tensors over in memory), and only where the plan's block says so
(``BlockCost.cut_share``: plans made before this scatter nothing), and of their tensors only those
whose element count the degree divides (the rest cross whole). The plan's cost model charges the
same: ``planner.core.levers.tensor_parallel``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from planner.core.levers.links import boundary_crosses
from planner.schema.plan import Plan, StagePlan


def _gathered(piece: torch.Tensor, group: Any, tp: int) -> torch.Tensor:
    """The ``tp`` ranks' pieces of ``group``, concatenated in rank order (flat)."""
    pieces = [torch.empty_like(piece) for _ in range(tp)]
    dist.all_gather(pieces, piece.contiguous(), group=group)
    return torch.cat(pieces)


def _piece(flat: torch.Tensor, tp: int, index: int) -> torch.Tensor:
    """Piece ``index`` of ``tp`` of a flat tensor, in its own storage (``PipelineStage`` sends it)."""
    size = flat.numel() // tp
    return flat[index * size : (index + 1) * size].clone()


class _Scatter(torch.autograd.Function):
    """Forward: this rank's piece of a tensor every rank holds whole. Backward: the pieces of the
    gradient gathered into the whole."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, tp: int, index: int) -> torch.Tensor:
        ctx.group, ctx.tp, ctx.shape = group, tp, x.shape
        return _piece(x.reshape(-1), tp, index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _gathered(grad, ctx.group, ctx.tp).view(ctx.shape), None, None, None


class _Gather(torch.autograd.Function):
    """Forward: the ranks' pieces gathered into the whole tensor. Backward: this rank's piece of
    the gradient (the same on every rank, so nothing is summed)."""

    @staticmethod
    def forward(ctx: Any, piece: torch.Tensor, group: Any, tp: int, index: int, shape: torch.Size) -> torch.Tensor:
        ctx.tp, ctx.index = tp, index
        return _gathered(piece, group, tp).view(shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        return _piece(grad.reshape(-1), ctx.tp, ctx.index), None, None, None, None


@dataclass(frozen=True)
class BoundaryScatter:
    """How one stage's inputs and outputs cross its two boundaries.

    Attributes:
        group: the tensor-parallel process group of this rank.
        tp: its size.
        index: this rank's place in it.
        gather_in: per input, the whole shape to gather it into (None: it arrives whole).
        scatter_out: per output, whether only this rank's piece is sent.
    """

    group: Any
    tp: int
    index: int
    gather_in: tuple[torch.Size | None, ...]
    scatter_out: tuple[bool, ...]

    def gather(self, args: Sequence[object]) -> tuple[object, ...]:
        """The stage's inputs made whole (those that arrived as pieces)."""
        return tuple(
            a
            if shape is None or not isinstance(a, torch.Tensor)
            else _Gather.apply(a, self.group, self.tp, self.index, shape)
            for a, shape in zip(args, self.gather_in)
        )

    def scatter(self, out: object) -> object:
        """The stage's output as it is sent: the scattered tensors as this rank's pieces."""
        if isinstance(out, torch.Tensor):
            return self._one(out, self.scatter_out[0]) if self.scatter_out else out
        if isinstance(out, tuple) and len(out) == len(self.scatter_out):
            return tuple(self._one(o, flag) for o, flag in zip(out, self.scatter_out))
        return out

    def _one(self, t: object, flag: bool) -> object:
        return _Scatter.apply(t, self.group, self.tp, self.index) if flag and isinstance(t, torch.Tensor) else t


def boundary_scatter(
    plan: Plan, stage: StagePlan, example_in: tuple, example_out: tuple, group: Any, index: int
) -> BoundaryScatter | None:
    """How ``stage`` scatters its boundaries under ``plan`` (None: it sends and receives everything whole).

    Args:
        plan: the plan (``tp``, the schedule's placement, each block's ``cut_share``).
        stage: the stage.
        example_in: its example inputs, whole (as the unscattered stage takes them).
        example_out: its example outputs, whole.
        group: this rank's tensor-parallel process group.
        index: this rank's place in it.

    Returns:
        The stage's ``BoundaryScatter``, or None.
    """
    if plan.tp <= 1:
        return None
    crosses = boundary_crosses(plan.n_stages, plan.schedule, plan.stages_per_rank)

    def scattered(t: object, cut: int) -> bool:  # the boundary after block ``cut``
        return isinstance(t, torch.Tensor) and t.numel() % plan.tp == 0 and plan.blocks[cut].cut_share == plan.tp

    into = stage.index > 0 and crosses[stage.index - 1]
    out = stage.index < plan.n_stages - 1 and crosses[stage.index]
    gather_in = tuple(t.shape if into and scattered(t, stage.start - 1) else None for t in example_in)
    scatter_out = tuple(out and scattered(t, stage.end - 1) for t in example_out)
    if not any(s is not None for s in gather_in) and not any(scatter_out):
        return None
    return BoundaryScatter(group, plan.tp, index, gather_in, scatter_out)


def sent_examples(scatter: BoundaryScatter | None, example_in: tuple, example_out: tuple) -> tuple[tuple, tuple]:
    """The examples ``PipelineStage`` sizes its buffers by: the scattered tensors as one rank's pieces.

    Args:
        scatter: the stage's scatter (None: the examples as they are).
        example_in: its example inputs, whole.
        example_out: its example outputs, whole.

    Returns:
        (inputs, outputs), with the same dtypes, devices and ``requires_grad``.
    """
    if scatter is None:
        return example_in, example_out

    def piece(t: torch.Tensor) -> torch.Tensor:
        return t.new_empty(t.numel() // scatter.tp).requires_grad_(t.requires_grad)

    ins = tuple(t if shape is None else piece(t) for t, shape in zip(example_in, scatter.gather_in))
    outs = tuple(piece(t) if flag else t for t, flag in zip(example_out, scatter.scatter_out))
    return ins, outs


__all__ = ["BoundaryScatter", "boundary_scatter", "sent_examples"]
