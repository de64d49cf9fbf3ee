"""How a model's step time scales with the microbatch size: the fixed part, fitted from two sizes.

The joint search tries microbatch counts other than the one the blocks were profiled at
(``planner.core.levers.microbatch.blocks_at``). Halving a microbatch rarely halves its time: kernel launches,
per-operator dispatch and weight reads do not shrink with it. This module measures (or estimates)
the whole model's forward + backward at the profiled microbatch size and at half of it (twice it
for a microbatch of one sample), fits ``t(s) = a + b * s`` through the two points and returns
``a / t(size0)``, the fraction of a microbatch's time that does not scale with its size.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from planner.capture.load import ModelFile
from planner.costs.levers import autocast_context


def second_size(size0: int) -> int:
    """The microbatch size ``fixed_fraction`` times first beside ``size0``: half of it, or twice
    one sample.

    Args:
        size0: the profiled microbatch size.

    Returns:
        The size.
    """
    return size0 // 2 if size0 >= 2 else 2 * size0


def fixed_fraction(time_at: Callable[[int], float], size0: int) -> tuple[float, int]:
    """Fit ``t(s) = a + b * s`` through ``time_at(size0)`` and a second size.

    The second size is half of ``size0``; when the model cannot run a microbatch that small (batch
    norm needs two samples per channel in training, say: ``time_at`` raises) it is twice ``size0``.

    Args:
        time_at: seconds of one forward + backward of a microbatch of the given size.
        size0: the microbatch size the block costs were profiled at.

    Returns:
        ``a / t(size0)`` clamped to [0, 1] (noise can make the fit's intercept negative, or larger
        than the time itself when the smaller microbatch was measured slower), and the smallest
        microbatch size that ran (the search never goes below it).
    """
    t0 = time_at(size0)
    smallest = size0
    size1 = size0 * 2
    if size0 >= 2:
        try:
            t1 = time_at(second_size(size0))
            size1 = second_size(size0)
            smallest = size1
        except Exception:  # noqa: BLE001 - any failure at the smaller size means "cannot run that small"
            t1 = time_at(size1)
    else:
        t1 = time_at(size1)
    if t0 <= 0:
        return 0.0, smallest
    a = (t0 * size1 - t1 * size0) / (size1 - size0)
    return min(1.0, max(0.0, a / t0)), smallest


def measured_time_at(
    mf: ModelFile,
    model: torch.nn.Module,
    seed: int,
    device: torch.device,
    repeats: int,
    warmup: int,
    autocast: str | None = None,
) -> Callable[[int], float]:
    """A ``time_at`` that runs the model's forward, loss and backward on this machine.

    The model runs eagerly even for a compiled plan: compiling the whole model twice more (once per
    microbatch size) would cost more than the blocks' own compilation, and only the ratio of the
    two times is used.

    Args:
        mf: the model file (its batch and loss functions).
        model: the built model, on ``device``.
        seed: seed of the example batch.
        device: where the model lives.
        repeats: timed runs (median kept).
        warmup: untimed runs first.
        autocast: "bf16" or "fp16": forward and loss under ``torch.autocast``, as the blocks were
            profiled; None: none.

    Returns:
        seconds of one forward + backward of a microbatch of the given size.
    """

    def time_at(size: int) -> float:
        inputs, target = mf.batch(size, seed=seed)
        args: tuple[Any, ...] = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs)
        tgt = target.to(device)
        times = []
        for i in range(warmup + repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            with autocast_context(device.type, autocast):
                loss = mf.loss_fn(model(*args), tgt)
            loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
        return statistics.median(times)

    return time_at
