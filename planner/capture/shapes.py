"""Running a module on fake tensors: the shapes, dtypes, strides and ``requires_grad`` of what it
computes, without computing it and without touching its weights.

``planner run`` needs, before training, what the model computes on one example microbatch: the values
each graph node produces (the trace's cut liveness), each stage's example inputs and outputs (the
receive buffers of ``PipelineStage``), the model's output width (the vocabulary). Computed with real
weights on the CPU, each is a whole forward at full size, in the launcher and again in every rank: for
a model 8B parameters wide (two layers, 8,192 tokens) more than five minutes on one thread, before
the first step on a GPU. Under torch's ``FakeTensorMode`` every operator computes metadata only, on
the tensors' own device, so autocast applies as it will in training and tensors the model makes of
its own (``torch.arange(n)``) are fake too.

Code that reads data (``.item()``, data-dependent shapes) cannot run on fake tensors; ``shapes_or_real``
then runs the real thing, as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn
from torch.func import functional_call

from planner.torch_compat import FakeTensorMode, pytree

T = TypeVar("T")


class _Call(nn.Module):
    """``fn(*args)`` as the forward of a module holding ``inner``, so ``functional_call`` can swap
    ``inner``'s parameters and buffers around any function of it (an fx Interpreter run, a stage)."""

    def __init__(self, inner: nn.Module, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.inner = inner
        # a tuple, so that ``fn`` being the module itself does not register it a second time (the
        # swap would then restore one name's weights and leave the other's swapped)
        self.fn = (fn,)

    def forward(self, *args: Any) -> Any:
        return self.fn[0](*args)


def _as_meta(t: torch.Tensor) -> torch.Tensor:
    """A plain meta tensor with ``t``'s shape, strides, dtype and ``requires_grad`` (``t`` may be fake)."""
    out = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="meta")
    return out.requires_grad_(t.requires_grad) if t.requires_grad else out


def shapes_of(module: nn.Module, fn: Callable[..., T], *args: Any, device: torch.device | None = None) -> T:
    """``fn(*args)`` on fake copies of ``module``'s parameters and buffers (tied ones stay tied) and of
    every tensor argument; every tensor of the result is returned as a plain meta tensor of the same
    shape, strides, dtype and ``requires_grad`` (``PipelineStage`` reads nothing else of its examples).

    Args:
        module: the module ``fn`` computes with (unchanged: its weights are never read or written).
        fn: a function of the module, e.g. ``module`` itself or an ``fx.Interpreter`` run of it.
        *args: its arguments.
        device: run as if the weights and arguments were there (the runner's GPU, so that autocast
            for it applies as in training); None: where they are.

    Returns:
        What ``fn`` returns, its tensors as meta tensors.

    Raises:
        Exception: whatever the fake run raises (an operator that reads data, ...).
    """
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:

        def fake(t: torch.Tensor) -> torch.Tensor:
            f = mode.from_tensor(t)
            return f if device is None or f.device == device else f.to(device)

        state = {f"inner.{name}": fake(t) for name, t in module.named_parameters()}
        state.update({f"inner.{name}": fake(t) for name, t in module.named_buffers()})
        out = functional_call(
            _Call(module, fn), state, pytree.tree_map_only(torch.Tensor, fake, args), tie_weights=True, strict=False
        )
        return pytree.tree_map_only(torch.Tensor, _as_meta, out)


def shapes_or_real(module: nn.Module, fn: Callable[..., T], *args: Any, device: torch.device | None = None) -> T:
    """``shapes_of(module, fn, *args, device=device)``, or ``fn(*args)`` itself where fake tensors cannot
    run it.

    Args:
        module: as ``shapes_of``.
        fn: as ``shapes_of``.
        *args: as ``shapes_of``.
        device: as ``shapes_of``.

    Returns:
        ``fn``'s result: meta tensors, or (the fallback) real ones.
    """
    try:
        return shapes_of(module, fn, *args, device=device)
    except Exception:  # noqa: BLE001 - any failure of the fake run: the real run says what is wrong, if anything
        return fn(*args)
