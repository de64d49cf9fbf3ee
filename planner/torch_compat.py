"""Every private torch API the planner touches, in one place.

Checked against torch 2.13.0 (``pyproject.toml`` allows only the versions the suite runs on).
When torch changes one of these, this is the only file to mend; the tests that exercise each
(named below) fail first. Everything else in the planner uses torch's public API.

- ``torch.utils._pytree``: flattening nested outputs (tree_leaves, tree_map_only, tree_unflatten).
- ``torch.utils._python_dispatch.TorchDispatchMode``: the roofline estimator sees every aten op.
- ``torch.distributed.pipelining._backward``: the I/W backward split zero-bubble schedules run
  (tests/test_profile.py).
- ``Tensor._is_view`` and ``UntypedStorage._cdata``: views and storage identity.
- ``GraphModule.graph._codegen`` / ``torch.fx.graph._PyTreeCodeGen``: the output structure of an
  exported graph (tests/test_trace.py).
- ``torch.distributed.pipelining.schedules._batch_p2p`` / ``_wait_batch_p2p`` and
  ``PipelineScheduleSingle._maybe_compute_loss``: timers around the schedule's point-to-point
  operations and the loss (tests/test_run.py).
- ``torch.distributed._tools.mem_tracker.MemTracker``: memory by category (tests/test_run.py).
- ``torch.nn.functional.scaled_dot_product_attention`` swapped for the duration of an estimate, to
  charge attention as the fused kernel a GPU runs (tests/test_estimate.py).
- Python's own ``multiprocessing.forkserver._forkserver._stop``: a fresh forkserver per launch, so
  the ranks print where the launcher's stdout is now (tests/test_run.py reads their step lines).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "TorchDispatchMode",
    "exported_out_spec",
    "is_view",
    "memory_tracker",
    "pipelining_backward",
    "pytree",
    "stop_forkserver",
    "storage_id",
    "swapped_sdpa",
    "timed_schedule",
]


def is_view(t: torch.Tensor) -> bool:
    """Whether ``t`` is a view of another tensor's storage."""
    return bool(t._is_view())


def storage_id(t: torch.Tensor) -> int:
    """An id of ``t``'s storage that is the same for every view of it (works on meta tensors)."""
    return int(t.untyped_storage()._cdata)


def exported_out_spec(gm: fx.GraphModule) -> Any:
    """The pytree spec of an exported graph's output (torch.export flattens outputs), or None."""
    codegen = gm.graph._codegen
    if isinstance(codegen, fx.graph._PyTreeCodeGen):
        return codegen.pytree_info.out_spec
    return None


def pipelining_backward() -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    """torch.distributed.pipelining's ``stage_backward``, ``stage_backward_input``, ``stage_backward_weight``.

    Imported on call: torch.distributed.pipelining takes ~1 s to import and most commands never
    need it.
    """
    from torch.distributed.pipelining._backward import stage_backward, stage_backward_input, stage_backward_weight

    return stage_backward, stage_backward_input, stage_backward_weight


def memory_tracker() -> Any:
    """A new ``torch.distributed._tools.mem_tracker.MemTracker``."""
    from torch.distributed._tools.mem_tracker import MemTracker

    return MemTracker()


def forget_root_module(tracker: Any, *modules: Any) -> None:
    """Let ``MemTracker`` see ``module`` called at the top level once more in the same context.

    MemTracker refuses a second root-level forward of a module it already tracks ("multiple
    iterative calls"); pipeline microbatches are exactly that. ``reset_mod_stats`` clears every
    module's statistics, which breaks the backward hooks of *other* stages of the same rank whose
    microbatches are still in flight (their modules are looked up in backward); so only this root
    module's entry is dropped (its private ``memory_tracking`` table). Only the global categories
    are read from the tracker, never the per-module statistics.
    """
    for module in modules:
        if module is not None:
            tracker.memory_tracking.pop(module, None)


@contextlib.contextmanager
def swapped_sdpa(replacement: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
    """Replace ``F.scaled_dot_product_attention`` process-wide inside the block.

    Yields:
        The original function (the replacement calls it where it does not apply).
    """
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = replacement
    try:
        yield original
    finally:
        F.scaled_dot_product_attention = original


@contextlib.contextmanager
def timed_schedule(
    schedule: Any, on_loss: Callable[[Any, int, float], None], on_p2p: Callable[[float], None]
) -> Iterator[None]:
    """Time the schedule's loss per microbatch and its point-to-point posting and waiting.

    Wraps ``schedule._maybe_compute_loss`` (an instance attribute, so only this schedule) and the
    module functions ``_batch_p2p`` / ``_wait_batch_p2p`` of ``torch.distributed.pipelining.schedules``
    (process-wide, which is why only a worker process or a test uses this), restoring all on exit.

    Args:
        schedule: a ``torch.distributed.pipelining`` schedule instance.
        on_loss: called with (stage, microbatch index, seconds) after each loss computation.
        on_p2p: called with seconds after each post or wait.
    """
    import time

    from torch.distributed.pipelining import schedules as sched_mod

    loss = schedule._maybe_compute_loss
    batch_p2p, wait_p2p = sched_mod._batch_p2p, sched_mod._wait_batch_p2p

    def maybe_compute_loss(stage: Any, output: Any, target_mbs: Any, mb_index: int, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = loss(stage, output, target_mbs, mb_index, *args, **kwargs)
        on_loss(stage, mb_index, time.perf_counter() - t0)
        return out

    def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                on_p2p(time.perf_counter() - t0)

        return wrapper

    schedule._maybe_compute_loss = maybe_compute_loss
    sched_mod._batch_p2p, sched_mod._wait_batch_p2p = timed(batch_p2p), timed(wait_p2p)
    try:
        yield
    finally:
        schedule.__dict__.pop("_maybe_compute_loss", None)
        sched_mod._batch_p2p, sched_mod._wait_batch_p2p = batch_p2p, wait_p2p


def stop_forkserver() -> None:
    """Stop multiprocessing's forkserver (Python's private ``ForkServer._stop``), so the next launch
    starts a fresh one. Its workers inherit the server's stdout and stderr, not the launcher's: a
    server kept from an earlier launch would print to where stdout went then (a test's capture, a
    closed pipe). A Python without the method keeps its server."""
    import multiprocessing.forkserver

    stop = getattr(multiprocessing.forkserver._forkserver, "_stop", None)
    if callable(stop):
        stop()
