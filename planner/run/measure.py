"""Measuring a stage inside the real schedule: per-microbatch compute, point-to-point waits, memory.

``StageProbe`` wraps the methods the schedule calls on *this* rank's ``PipelineStage`` and
schedule instances (nothing global but two module functions of
``torch.distributed.pipelining.schedules``, wrapped only inside a worker process and restored):

- ``stage.forward_one_chunk``: the stage module's forward on one microbatch. The schedule waits
  for the receive *before* calling it and posts the send *after*, so neither is inside; inside
  are mapping the receive buffers to inputs, the forward, and caching outputs for backward.
- the schedule's loss of one microbatch (last stage only), added to that microbatch's forward,
  because the profiler counts the loss in the last block's forward.
- ``stage.backward_one_chunk`` (+ ``backward_weight_one_chunk`` for schedules that split the
  weight gradient): autograd backward of one microbatch from the already-received output
  gradient (on the last stage from the loss); the gradient receive and send are outside.
- posting and waiting on every send/receive of the schedule. The time is transfer plus waiting for
  the neighbour (bubble). The loss and point-to-point timers wrap private torch functions, so they
  live in ``planner.torch_compat.timed_schedule``.

``MemoryProbe`` runs one step under torch's ``MemTracker`` (``planner.torch_compat.memory_tracker``), which
works on any device (CPU included): it is a TorchDispatchMode that labels every tensor storage as
parameter, buffer, gradient, activation, temp (made in backward), optimizer state or other.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from planner.capture.clock import BlockClock
from planner.schema.result import MEMORY_CATEGORIES, BlockMeasure, MemoryMeasure, StageMeasure
from planner.torch_compat import forget_root_module, memory_tracker, timed_schedule

_perf = time.perf_counter


def _wrapped(module: Any) -> list[Any]:
    """A stage module and every module it wraps (``.module`` of DDP, the boundary, recomputation):
    whichever of them the tracker saw called as its root."""
    chain = [module]
    while isinstance(getattr(chain[-1], "module", None), torch.nn.Module) and len(chain) < 8:
        chain.append(chain[-1].module)
    return chain


class StageProbe:
    """Per-step, per-microbatch timers around one stage (and, on a rank's first stage, its schedule).

    Call ``begin_step()`` before each ``schedule.step``; ``fwd_times()`` / ``bwd_times()`` then give
    ``[step][microbatch]`` seconds and ``p2p_times()`` one total per step. Every action is also kept
    as ``(kind, microbatch, start, end)`` in wall-clock seconds (``time.time``, comparable between the
    ranks of one machine) for the measured timeline.
    """

    def __init__(self, stage_index: int = 0, clock: BlockClock | None = None, block_names: Sequence[str] = ()) -> None:
        self.stage_index = stage_index
        self.clock = clock  # the stage module's block marks (None: blocks not timed)
        self.block_names = tuple(block_names)  # the clock's blocks, in order
        self._fwd: list[dict[int, float]] = []
        self._bwd: list[dict[int, float]] = []
        self._loss: list[dict[int, float]] = []
        self._p2p: list[float] = []
        self._events: list[list[tuple[str, int, float, float]]] = []
        self._step_start: list[float] = []
        self.memory: Any = None  # a MemTracker while one step is tracked (see MemoryProbe)

    def begin_step(self) -> None:
        """Start collecting a new step's figures."""
        self._fwd.append(defaultdict(float))
        self._bwd.append(defaultdict(float))
        self._loss.append(defaultdict(float))
        self._p2p.append(0.0)
        self._events.append([])
        self._step_start.append(time.time())
        if self.clock is not None:
            self.clock.step = len(self._fwd)

    def discard_step(self) -> None:
        """Drop the figures collected since the last ``begin_step`` (an evaluation between steps)."""
        if self.clock is not None:
            self.clock.discard(len(self._fwd))
        for table in (self._fwd, self._bwd, self._loss, self._p2p, self._events, self._step_start):
            if table:
                table.pop()

    def _add(self, table: list[dict[int, float]], mb: int, seconds: float) -> None:
        if table:
            table[-1][mb] += seconds

    def _event(self, kind: str, mb: int, start: float, end: float) -> None:
        if self._events:
            self._events[-1].append((kind, mb, start, end))

    def add_p2p(self, seconds: float) -> None:
        """Count ``seconds`` of point-to-point posting/waiting in the current step."""
        if self._p2p:
            self._p2p[-1] += seconds

    def events(self, step: int) -> list[tuple[str, int, float, float]]:
        """The actions of 1-based ``step``: (kind, microbatch, wall-clock start, end)."""
        return list(self._events[step - 1]) if 0 < step <= len(self._events) else []

    def step_start(self, step: int) -> float:
        """Wall-clock time at which 1-based ``step`` began on this rank."""
        return self._step_start[step - 1]

    def wrap(self, stage: Any) -> None:
        """Replace ``stage``'s per-microbatch methods (instance attributes) by timed ones."""
        probe = self
        fwd, bwd = stage.forward_one_chunk, stage.backward_one_chunk
        bwd_w = getattr(stage, "backward_weight_one_chunk", None)

        def forward_one_chunk(fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            if probe.memory is not None:
                # MemTracker refuses a second root-module forward in one context; microbatches are
                # exactly that (see forget_root_module).
                # (the runner's boundary wrapper calls the stage module without hooks, so the module
                # inside it is the root the tracker sees)
                forget_root_module(probe.memory, *_wrapped(stage.submod))
            w0, t0 = time.time(), _perf()
            with probe.action("F", fwd_chunk_id):
                out = fwd(fwd_chunk_id, *args, **kwargs)
            dt = _perf() - t0
            probe._add(probe._fwd, fwd_chunk_id, dt)
            probe._event("F", fwd_chunk_id, w0, w0 + dt)
            return out

        def timed_backward(method: Callable[..., Any], weight: bool) -> Callable[..., Any]:
            def backward(bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
                kind = "W" if weight else ("B" if kwargs.get("full_backward", True) else "I")
                w0, t0 = time.time(), _perf()
                with probe.action(kind, bwd_chunk_id):
                    out = method(bwd_chunk_id, *args, **kwargs)
                dt = _perf() - t0
                probe._add(probe._bwd, bwd_chunk_id, dt)
                probe._event(kind, bwd_chunk_id, w0, w0 + dt)
                return out

            return backward

        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = timed_backward(bwd, weight=False)
        if bwd_w is not None:
            stage.backward_weight_one_chunk = timed_backward(bwd_w, weight=True)

    @contextlib.contextmanager
    def action(self, kind: str, mb: int) -> Iterator[None]:
        """Bracket one action for the block clock (nothing without one)."""
        if self.clock is None:
            yield
            return
        self.clock.begin(kind, mb)
        try:
            yield
        finally:
            self.clock.finish()

    @staticmethod
    def unwrap(stage: Any) -> None:
        """Restore ``stage``'s own methods."""
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            stage.__dict__.pop(name, None)

    # Direct recording, for the in-process loop (no PipelineStage).
    def add_fwd(self, mb: int, seconds: float) -> None:
        """Count ``seconds`` of forward (loss included) for microbatch ``mb`` of the current step."""
        self._add(self._fwd, mb, seconds)

    def add_bwd(self, mb: int, seconds: float) -> None:
        """Count ``seconds`` of backward for microbatch ``mb`` of the current step."""
        self._add(self._bwd, mb, seconds)

    def add_loss(self, mb: int, seconds: float) -> None:
        """Count ``seconds`` of loss for microbatch ``mb`` (also add them with ``add_fwd``)."""
        self._add(self._loss, mb, seconds)

    @staticmethod
    def _rows(table: list[dict[int, float]]) -> list[list[float]]:
        return [[row[k] for k in sorted(row)] for row in table]

    def fwd_times(self) -> list[list[float]]:
        """``[step][microbatch]`` forward seconds, the loss included on the last stage."""
        return [[f + loss.get(k, 0.0) for k, f in sorted(fwd.items())] for fwd, loss in zip(self._fwd, self._loss)]

    def bwd_times(self) -> list[list[float]]:
        """``[step][microbatch]`` backward seconds."""
        return self._rows(self._bwd)

    def loss_times(self) -> list[list[float]]:
        """``[step][microbatch]`` loss seconds (empty rows off the last stage)."""
        return self._rows(self._loss)

    def p2p_times(self) -> list[float]:
        """Per step: seconds spent posting and waiting on point-to-point operations."""
        return list(self._p2p)


@contextlib.contextmanager
def probes_installed(pairs: Sequence[tuple[Any, StageProbe]], schedule: Any) -> Iterator[None]:
    """Time every stage of this rank into its own probe, and the schedule's loss (into the probe of the
    stage that computes it) and point-to-point operations (into the first probe: they are the
    rank's, shared by its stages) while inside (``planner.torch_compat.timed_schedule``).

    Args:
        pairs: (``PipelineStage``, its probe) for every stage this rank runs.
        schedule: the schedule that drives them.
    """
    by_index = {probe.stage_index: probe for _, probe in pairs}
    first = pairs[0][1]

    def on_loss(stage_: Any, mb_index: int, seconds: float) -> None:
        if stage_.is_last:
            probe = by_index.get(getattr(stage_, "stage_index", first.stage_index), first)
            probe._add(probe._loss, mb_index, seconds)

    for stage, probe in pairs:
        probe.wrap(stage)
    try:
        with timed_schedule(schedule, on_loss, first.add_p2p):
            yield
    finally:
        for stage, _ in pairs:
            StageProbe.unwrap(stage)


def _category(key: Any) -> str:
    return str(getattr(key, "value", key))


def _by_category(snapshot: dict, device: torch.device) -> dict[str, int]:
    """One device's bytes per category from a MemTracker snapshot (all categories, 0 if absent)."""
    dev = next((d for d in snapshot if torch.device(d) == device), None)
    raw = {_category(k): int(v) for k, v in snapshot[dev].items()} if dev is not None else {}
    out = {c: raw.get(c, 0) for c in MEMORY_CATEGORIES}
    out["Total"] = raw.get("Total", sum(out.values()))
    return out


def recv_buffers(stage: Any) -> list[torch.Tensor]:
    """The stage's preallocated point-to-point receive buffers (activations and gradients).

    ``PipelineStage`` allocates one per microbatch and boundary tensor at its first step and keeps
    them; the memory tracker does not see them being made (first step), so they are registered.

    Args:
        stage: a ``PipelineStage`` (after its first step).

    Returns:
        The buffers (empty before the first step).
    """
    out: list[torch.Tensor] = []
    for table in (getattr(stage, "args_recv_info", {}), getattr(stage, "grad_recv_info", {})):
        for infos in table.values():
            for info in infos if isinstance(infos, tuple) else (infos,):
                buf = getattr(info, "buffer", None)
                if isinstance(buf, torch.Tensor):
                    out.append(buf)
    return out


class MemoryProbe:
    """Track one training step's tensor memory by category with torch's MemTracker."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.result: MemoryMeasure | None = None  # set when the tracked step ends

    @contextlib.contextmanager
    def step(
        self,
        step: int,
        probes: Sequence[StageProbe],
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        extra: list[torch.Tensor],
    ) -> Iterator[Callable[[], None]]:
        """Run the body under a MemTracker; call the yielded ``done()`` right after ``optimizer.step()``.

        ``module`` and ``optimizer`` (their parameters, gradients and state, made before this step)
        are registered first; ``extra`` tensors (receive buffers) count as "Other". The result is
        in ``self.result`` once the body ends.

        Args:
            step: the 1-based step being tracked (recorded in the result).
            probes: the rank's stage timers; they clear the tracker's per-module statistics per microbatch.
            module: this rank's module.
            optimizer: its optimizer (None: the rank has no parameters).
            extra: tensors made before this step that the tracker cannot see being made.

        Yields:
            ``done``: records the end-of-step snapshot.
        """
        tracker = memory_tracker()
        tracker.track_external(module, *([optimizer] if optimizer is not None else []), *extra)
        end: dict = {}

        def done() -> None:
            end.update(tracker.get_tracker_snapshot("current"))

        for probe in probes:
            probe.memory = tracker
        try:
            with tracker:
                yield done
        finally:
            for probe in probes:
                probe.memory = None
        peak = _by_category(tracker.get_tracker_snapshot("peak"), self.device)
        self.result = MemoryMeasure(
            source="memtracker",
            step=step,
            peak_bytes=peak["Total"],
            peak_by_category=peak,
            end_by_category=_by_category(end, self.device),
        )


def summarize(
    *,
    stage: int,
    first_block: str,
    last_block: str,
    probe: StageProbe,
    steps: list[int],
    times: list[float],
    clip: list[float],
    reduce: list[float],
    opt: list[float],
    memory: MemoryMeasure | None,
    rank: int | None = None,
) -> StageMeasure:
    """One rank's ``StageMeasure``: medians of its timers over the timed steps.

    Args:
        stage: the stage index.
        first_block: FQN of its first block.
        last_block: FQN of its last block.
        probe: its microbatch timers.
        steps: the 1-based steps the medians are over (``planner.schema.result.timed_steps``).
        times: per step, the rank's step wall time.
        clip: per step, norm + all-reduce + clipping.
        reduce: per step, the all-reduce alone.
        opt: per step, ``optimizer.step()``.
        memory: ``MemoryProbe.result`` or None.
        rank: the rank that ran the stage (None: stage = rank).

    Returns:
        The stage's measurements (every step's microbatch times, medians over ``steps``).
    """

    def per_mb(rows: list[list[float]]) -> float:
        vals = [t for s in steps for t in rows[s - 1]]
        return statistics.median(vals) if vals else 0.0

    def per_step(vals: list[float]) -> float:
        return statistics.median(vals[s - 1] for s in steps) if vals and steps else 0.0

    fwd, bwd = probe.fwd_times(), probe.bwd_times()
    loss_s = per_mb(probe.loss_times())
    blocks, fwd_over, bwd_over = _block_measures(probe.clock, probe.block_names, steps, loss_s)
    shown = steps[-1] if steps else None  # the timeline shows the last timed step
    origin = probe.step_start(shown) if shown is not None and shown <= len(fwd) else None
    timeline = (
        [(k, mb, a - origin, b - origin) for k, mb, a, b in probe.events(shown)]
        if shown is not None and origin is not None
        else []
    )
    return StageMeasure(
        stage=stage,
        rank=rank,
        first_block=first_block,
        last_block=last_block,
        fwd_s=per_mb(fwd),
        bwd_s=per_mb(bwd),
        loss_s=loss_s,
        p2p_s=per_step(probe.p2p_times()),
        reduce_s=per_step(reduce),
        clip_s=per_step(clip),
        optimizer_s=per_step(opt),
        step_s=per_step(times),
        fwd_times_s=fwd,
        bwd_times_s=bwd,
        memory=memory,
        blocks=blocks,
        fwd_overhead_s=fwd_over,
        bwd_overhead_s=bwd_over,
        timeline=timeline,
        timeline_origin=origin,
    )


def _block_measures(
    clock: BlockClock | None, names: Sequence[str], steps: list[int], loss: float
) -> tuple[list[BlockMeasure], float, float]:
    """Per-block medians from the stage's clock over ``steps``, and the actions' overheads."""
    if clock is None or len(names) != clock.end - clock.start:
        return [], 0.0, 0.0
    fwd, fwd_over = clock.medians(("F",), steps)
    bwd, bwd_over = clock.medians(("B", "I"), steps)
    if not any(fwd):  # no action was marked (a compiled stage, a schedule that bypasses the module)
        return [], 0.0, 0.0
    if clock.loss_in_last:  # the loss's forward (outside forward_one_chunk), in the last block as profiled
        fwd[-1] += loss
    return [BlockMeasure(name=n, fwd_s=f, bwd_s=b) for n, f, b in zip(names, fwd, bwd)], fwd_over, bwd_over


def memory_step_of(steps: int) -> int | None:
    """The step run under the memory tracker.

    The last one, when there are at least 2: by then the optimizer state and the receive buffers
    exist (the first step sets the schedule up). It runs ~25x slower, so medians leave it out.

    Args:
        steps: the run's optimizer steps.

    Returns:
        The 1-based step, or None when the run is too short to track one.
    """
    return steps if steps >= 2 else None
