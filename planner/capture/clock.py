"""Per-block times inside a stage: marks between its blocks, read forward and backward.

A stage module runs several blocks back to back; what each of them costs there (warm caches, the
allocator's state after the block before, the runtime around it) is what the planner must predict.
``BlockClock`` times them where they run: the stage builder (``planner.capture.stage``) puts a
mark on the tensors crossing each block boundary, including the stage's inputs (mark ``start - 1``)
and its output (mark ``end - 1``). A mark is an identity autograd function:

- forward, it notes the time when the blocks before it are done; block k's forward is the time
  from mark k - 1 to mark k;
- backward, autograd calls it once the gradients of every tensor crossing that boundary are
  complete, i.e. when the blocks after it are done; block k's backward is the time from mark k to
  mark k - 1 (to the end of the action for the stage's first block when its inputs need no
  gradient, as on the first stage; from the start of the action for the model's last block, whose
  backward then includes the loss's, as the profiler counts it).

The caller brackets each action (one forward or one backward of one microbatch) with ``begin`` and
``finish``; the time inside the action but outside every block is the action's overhead (the
runtime's bookkeeping, the loss's backward on the last stage). The marks cost a few microseconds
each. Weight gradients computed apart from the input gradients (the W of zero-bubble schedules)
pass no mark; their actions count as overhead only.

With ``pause_s`` the clock sleeps at every mark, after noting it, and counts the sleep in no block:
each block then starts after a wait, as the first block of a stage's action does after a receive.
The profile uses it to time every block cold (``planner.costs.context``).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

_perf = time.perf_counter


@dataclass
class ActionMarks:
    """One action as the clock saw it: its kind ("F", "B", "I"), microbatch, bounds and marks."""

    kind: str
    microbatch: int
    step: int
    begin: float
    end: float = 0.0
    marks: list[tuple[int, float]] = field(default_factory=list)
    paused: float = 0.0  # seconds slept at the marks (``BlockClock.pause_s``), in no block


class BlockClock:
    """Marks between the blocks ``start .. end - 1`` of one stage, and the per-block times they give.

    Args:
        start: the stage's first block (its global index).
        end: one past its last block.
        loss_in_last: the stage ends the model, and the loss's backward runs inside its backward
            actions: the last block's backward then starts with the action, as the profiler counts
            the loss in the last block.
        cuda: the stage runs on a GPU: every mark synchronizes first (this serializes the
            stage's kernels at block boundaries, a small cost next to a block's work).
        pause_s: seconds to sleep at every mark (0: none), counted in no block: every block then
            runs after a wait (see the module docstring).
    """

    def __init__(
        self, start: int, end: int, loss_in_last: bool = False, cuda: bool = False, pause_s: float = 0.0
    ) -> None:
        self.start, self.end = start, end
        self.loss_in_last = loss_in_last
        self.cuda = cuda  # wait for the GPU at every mark, so a mark times work done, not work queued
        self.pause_s = pause_s
        self.actions: list[ActionMarks] = []
        self.step = 0  # the caller's step number, recorded with each action
        self._open: ActionMarks | None = None
        self._silent = 0  # > 0: marks pass their values on but note nothing (``silenced``)

    def begin(self, kind: str, microbatch: int = 0) -> None:
        """Start an action: marks until ``finish()`` belong to it."""
        if self.cuda:
            torch.cuda.synchronize()
        self._open = ActionMarks(kind, microbatch, self.step, _perf())

    def finish(self) -> None:
        """Close the current action."""
        if self._open is not None:
            if self.cuda:
                torch.cuda.synchronize()
            self._open.end = _perf()
            self.actions.append(self._open)
            self._open = None

    def discard(self, step: int) -> None:
        """Forget the actions of ``step`` (an evaluation between steps)."""
        self.actions = [a for a in self.actions if a.step != step]
        self._open = None

    @contextlib.contextmanager
    def silenced(self) -> Iterator[None]:
        """Marks run inside note nothing: a checkpoint region's recomputation passes its marks again
        inside the backward of its blocks (``planner.capture.checkpoint``), where they mean nothing."""
        self._silent += 1
        try:
            yield
        finally:
            self._silent -= 1

    def note(self, k: int) -> None:
        """Record mark ``k`` (called by the marks themselves), then pause ``pause_s``."""
        if self._open is not None and not self._silent:
            if self.cuda:
                torch.cuda.synchronize()
            # a mark's time is when the blocks before it were done; the block after it starts once
            # the pause is over, so the pause is moved out of it (every time after this shifts back)
            self._open.marks.append((k, _perf() - self._open.paused))
            if self.pause_s > 0:
                t = _perf()
                time.sleep(self.pause_s)
                self._open.paused += _perf() - t

    def mark(self, k: int, *values: Any) -> tuple[Any, ...]:
        """Pass ``values`` on unchanged, marking boundary ``k`` forward and, through the tensors among
        them that require grad, backward."""
        # only tensors that require grad pass through the mark: another would come out requiring
        # grad too (every output of a function with a differentiable input is differentiable), and
        # a stage would then send gradients its neighbour does not expect
        tensors = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor) and v.requires_grad]
        self.note(k)
        if not tensors or not torch.is_grad_enabled():
            return values
        marked = _Mark.apply(self, k, *(values[i] for i in tensors))
        out = list(values)
        for i, t in zip(tensors, marked):
            out[i] = t
        return tuple(out)

    def block_times(
        self, kinds: tuple[str, ...], steps: Collection[int] | None = None
    ) -> tuple[list[list[float]], list[float]]:
        """Per block, the seconds of every action of ``kinds``; and each action's overhead.

        Args:
            kinds: ("F",) for forwards, ("B", "I") for backwards.
            steps: only the actions of these steps (None: all).

        Returns:
            ``times[j]`` for block ``start + j`` (one entry per action), and per action the seconds
            outside every block.
        """
        n = self.end - self.start
        times: list[list[float]] = [[] for _ in range(n)]
        overhead = []
        for a in self.actions:
            if a.kind not in kinds or not a.marks or (steps is not None and a.step not in steps):
                continue
            at = dict(a.marks)  # a mark noted twice (never, in a well-formed stage) keeps its last time
            if a.kind == "F":
                per = _forward_blocks(at, self.start, n)
            else:
                per = _backward_blocks(at, a, self.start, n, self.loss_in_last)
            if per is None:
                continue
            for j, t in enumerate(per):
                times[j].append(t)
            overhead.append((a.end - a.paused - a.begin) - sum(per))
        return times, overhead

    def medians(self, kinds: tuple[str, ...], steps: Collection[int] | None = None) -> tuple[list[float], float]:
        """``block_times`` as medians: per block, and of the overhead (0.0 where nothing was seen)."""
        times, overhead = self.block_times(kinds, steps)
        return [statistics.median(t) if t else 0.0 for t in times], statistics.median(overhead) if overhead else 0.0


def _forward_blocks(at: dict[int, float], start: int, n: int) -> list[float] | None:
    """Block k's forward runs from mark k - 1 to mark k (the input mark is noted first thing)."""
    if any(start - 1 + j not in at for j in range(n + 1)):
        return None
    return [at[start + j] - at[start + j - 1] for j in range(n)]


def _backward_blocks(
    at: dict[int, float], a: ActionMarks, start: int, n: int, loss_in_last: bool
) -> list[float] | None:
    """Block k's backward runs from mark k to mark k - 1; the first block's ends with the action when
    its inputs need no gradient (no input mark fired); the last block's starts with the action when
    the loss's backward is counted in it."""
    if any(start + j not in at for j in range(n)):
        return None
    first_end = at.get(start - 1, a.end - a.paused)
    ends = [at[start + j - 1] if j > 0 else first_end for j in range(n)]
    begins = [at[start + j] for j in range(n)]
    if loss_in_last:
        begins[-1] = a.begin
    return [e - b for e, b in zip(ends, begins)]


class _Mark(torch.autograd.Function):
    """Identity on tensors; notes the clock's time forward (by the caller) and backward."""

    @staticmethod
    def forward(ctx: Any, clock: BlockClock, k: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.clock, ctx.k = clock, k
        # fresh aliases, not views: a later in-place op on them (x.add_) must stay legal
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        ctx.clock.note(ctx.k)
        return (None, None, *grads)
