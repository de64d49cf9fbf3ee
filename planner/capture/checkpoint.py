"""Activation checkpointing block by block: the regions a stage runs under ``torch.utils.checkpoint``.

A stage that recomputes (the plan's ``recompute``: "selective" or "full", or "selective:k" /
"full:k" for only its first k regions, the rest running as they are) runs as a chain of regions,
one per block (a block whose end is no legal cut shares its region with the next:
``planner.core.split.stage_model.checkpoint_units`` decides, here they are only built). Each region is
its own non-reentrant checkpoint, so backward rebuilds one region's activations at a time, as
torchtitan's and Megatron's per-layer checkpointing do (a plan's "stage" mode is one region
over the whole stage, checkpointed fully):

- full: the region keeps only its inputs; its whole forward runs again in backward;
- selective: torch's selective activation checkpointing
  (``torch.utils.checkpoint.create_selective_checkpoint_contexts``) with torchtitan's "op" policy
  (``torchtitan.distributed.activation_checkpoint.SelectiveAC``): keep the outputs of the expensive
  ops (``SAVED_OPS``: matmuls, convolutions, attention) except every second plain matmul
  (``MATMULS``: ``aten.mm`` and ``aten.linear``), and recompute the rest (norms, activations,
  element-wise ops, dropout with its RNG state restored, and those matmuls).

The profiler measures what these regions keep and cost with the same policy (``kept_bytes``,
``planner.costs.timing.time_recompute``), so what is measured is what runs.

Under FSDP block by block the same chain (mode "never" where nothing recomputes) gives FSDP its
units: each region becomes one ``fully_shard`` unit (``stage_units`` lists them; a "stage" region
holds the whole chain).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from planner.capture.blocks import TracedModel
from planner.capture.clock import BlockClock
from planner.torch_compat import TorchDispatchMode, pytree, storage_id

_aten = torch.ops.aten


def _ops(*names: str) -> frozenset[Any]:
    """The aten overload packets of ``names`` this torch has (attention kernels differ by build)."""
    return frozenset(getattr(_aten, n).default for n in names if hasattr(_aten, n))


SAVED_OPS: frozenset[Any] = _ops(
    "mm",
    "linear",
    "addmm",
    "bmm",
    "baddbmm",
    "_scaled_mm",
    "convolution",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)
"""The ops whose outputs selective checkpointing keeps (but see ``MATMULS``); every other op is
recomputed in backward. torchtitan's list: the partitioner's compute-intensive ops and attention."""

MATMULS: frozenset[Any] = _ops("mm", "linear")
"""Of ``SAVED_OPS``, those of which only every other one is kept (the first, third, ... of a region),
as torchtitan's policy keeps them: half the projections' outputs for half their recomputation."""


class KeepRule:
    """Which op outputs selective checkpointing keeps, in the order a region's forward runs them."""

    def __init__(self) -> None:
        self.matmuls = 0

    def keeps(self, op: Any) -> bool:
        """Whether the output of ``op`` (the region's next op) is kept."""
        if op in MATMULS:
            self.matmuls += 1
            return self.matmuls % 2 == 1
        return op in SAVED_OPS


def _policy() -> Any:
    """A fresh policy for one region's checkpoint: its forward and its recomputation count their
    matmuls apart, so both make the same choices."""
    from torch.utils.checkpoint import CheckpointPolicy

    rules = {False: KeepRule(), True: KeepRule()}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        keep = rules[bool(ctx.is_recompute)].keeps(op)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def selective_contexts() -> tuple[Any, Any]:
    """The forward and recompute contexts of selective checkpointing (``checkpoint``'s ``context_fn``)."""
    return torch.utils.checkpoint.create_selective_checkpoint_contexts(_policy())


def checkpointed(fn: Callable[..., Any], args: Sequence[Any], mode: str) -> Any:
    """``fn(*args)`` as one checkpoint region under ``mode`` ("full" or "selective").

    Args:
        fn: the region's forward.
        args: its inputs.
        mode: "full" keeps only the inputs; "selective" also the outputs of ``SAVED_OPS``.

    Returns:
        What ``fn`` returns.
    """
    kw: dict[str, Any] = {"use_reentrant": False}
    if mode == "selective":
        kw["context_fn"] = selective_contexts
    return torch.utils.checkpoint.checkpoint(fn, *args, **kw)


class _KeptBytes(TorchDispatchMode):
    """Adds up the bytes of the outputs of ``SAVED_OPS`` run under it (what selective checkpointing keeps)."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: dict[int, int] = {}  # storage id -> bytes
        self.rule = KeepRule()
        self.alive: list[torch.Tensor] = []  # the kept outputs, held so that no storage id is reused

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.rule.keeps(func):
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter):
                    self.kept[storage_id(t)] = t.untyped_storage().nbytes()
                    self.alive.append(t)
        return out

    def total(self, besides: Any = ()) -> int:
        """Bytes kept, the storages of the tensors in ``besides`` (a block's output: the next region
        keeps it as its input) left out."""
        skip = {storage_id(t) for t in pytree.tree_leaves(besides) if isinstance(t, torch.Tensor)}
        return sum(v for k, v in self.kept.items() if k not in skip)


@contextlib.contextmanager
def kept_bytes() -> Iterator[_KeptBytes]:
    """Count what selective checkpointing would keep of the forward run inside (``.total()`` bytes).

    Only outputs that autograd needs count for backward: the caller runs the forward with grad
    enabled, as training does; the count includes every output of a kept op (attention's
    log-sum-exp too), each storage once.
    """
    mode = _KeptBytes()
    with mode:
        yield mode


class CheckpointedStage(nn.Module):
    """A stage run as a chain of checkpoint regions (see the module docstring).

    Args:
        regions: one module per region, in order: each takes what crosses the cut before it (the
            stage's inputs for the first) and returns what crosses the cut after it.
        mode: "full", "selective", or "never" (the regions run as they are: a chain for FSDP's units),
            for every region; or one of those per region (a stage that recomputes only its first
            regions: "full:k" / "selective:k" in a plan).
        clock: the stage's block clock, if any: its marks are silenced while a region is being
            recomputed, so that a block's forward is timed once (its recomputation falls inside the
            backward of that block, where the plan counts it).

    Raises:
        ValueError: an unknown mode, or not one per region.
    """

    def __init__(
        self, regions: Sequence[nn.Module], mode: str | Sequence[str], clock: BlockClock | None = None
    ) -> None:
        super().__init__()
        modes = [mode] * len(regions) if isinstance(mode, str) else list(mode)
        if len(modes) != len(regions) or any(m not in ("full", "selective", "never") for m in modes):
            raise ValueError(f"checkpoint mode {mode!r}; expected 'full', 'selective' or 'never' (one per region)")
        self.regions = nn.ModuleList(regions)
        self.modes = modes
        self.clock = clock

    def forward(self, *args: Any) -> Any:
        out: Any = args
        for region, mode in zip(self.regions, self.modes, strict=True):
            out = region(*args) if mode == "never" else checkpointed(self._once(region), args, mode)
            args = out if isinstance(out, tuple) else (out,)
        return out

    def _once(self, region: nn.Module) -> Callable[..., Any]:
        """``region`` as a function whose second and later calls (the recomputation) pass no clock mark."""
        calls = [0]

        def run(*a: Any) -> Any:
            calls[0] += 1
            if calls[0] == 1 or self.clock is None:
                return region(*a)
            with self.clock.silenced():
                return region(*a)

        return run


def checkpointed_stage(
    traced: TracedModel,
    units: Sequence[tuple[int, int]],
    mode: str | Sequence[str],
    build: Callable[[TracedModel, int, int, BlockClock | None], nn.Module],
    clock: BlockClock | None = None,
) -> CheckpointedStage:
    """The stage over ``units`` (its checkpoint regions, in order) as a ``CheckpointedStage``.

    Args:
        traced: the trace.
        units: ``(start, end)`` of each region; together one stage.
        mode: "full", "selective" or "never", for every region or one per region.
        build: builds the module of blocks ``[start, end)`` (``planner.capture.stage.stage_module``).
        clock: the stage's block clock (each region marks its own blocks on it).

    Returns:
        The stage module (parameters shared with the trace).
    """
    return CheckpointedStage([build(traced, a, z, clock) for a, z in units], mode, clock)


def stage_units(stage: nn.Module) -> list[nn.Module]:
    """The modules a stage runs one after another: a chain's regions (a region that is itself a
    chain, the "stage" mode over FSDP's units, listed unit by unit), or the stage itself.

    Args:
        stage: a stage module (``CheckpointedStage`` or any other).

    Returns:
        Its units, in order.
    """
    if isinstance(stage, CheckpointedStage):
        return [unit for region in stage.regions for unit in stage_units(region)]
    return [stage]
