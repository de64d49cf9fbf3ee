"""What a profile runs on and how: the records the measured profilers take instead of long lists.

``Sample`` is the microbatch every block is timed on, with its target and loss; ``ProfileSettings``
is how the timing is done (warm-up, repeats, threads, progress bar) and under which speed levers
(``planner.costs.levers``: autocast, compile). ``planner.costs.measure.profile_model`` takes both
and hands them on to the graph profiler, the module-boundary profiler and the in-context timing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from planner.schema.plan_parts import Float8Linears

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]
"""``loss_fn(output, target) -> scalar``: the model file's loss (a mean over the microbatch)."""


@dataclass(frozen=True)
class Sample:
    """One microbatch to profile on.

    Attributes:
        inputs: the microbatch's positional inputs (a keyword batch is bound to positions by
            ``ModelFile.batch``); the model was traced on a microbatch of the same shape.
        target: the microbatch's target (the last block includes the loss).
        loss_fn: ``loss_fn(output, target) -> scalar``.
    """

    inputs: tuple[Any, ...]
    target: torch.Tensor
    loss_fn: LossFn


@dataclass(frozen=True)
class ProfileSettings:
    """How the blocks are timed, and under which speed levers.

    Attributes:
        warmup: untimed runs (per block, or of the whole model) before measuring. With
            ``compile`` ``profile_model`` runs at least 1: the compiling run is never timed.
        repeats: timed runs; the median is kept (robust to the noise of shared CPUs).
        threads: intra-op threads while measuring (match the threads a rank will have); None
            keeps the current setting.
        progress: show a progress bar.
        autocast: "bf16" or "fp16": forwards (and the last block's loss) run under
            ``torch.autocast`` on the model's device (check it with
            ``planner.costs.levers.check_autocast`` first); None: no autocast, as the model is.
        compile: time each block as ``torch.compile`` of it (the block module in a graph trace,
            the block module's forward in a module-boundary trace).
        float8: ``--dtype fp8``: each block's linear layers converted to torchao's float8 ones first
            (``planner.capture.float8.convert_stage``; emulated on a CPU), as the run converts its stages.
    """

    warmup: int = 2
    repeats: int = 5
    threads: int | None = None
    progress: bool = True
    autocast: str | None = None
    compile: bool = False
    float8: Float8Linears | None = None
