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
then runs the real thing, as it does for a model small enough that its real run is the cheaper one
(``cheap_to_run``: the fake run costs milliseconds per operator, whatever the sizes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar, cast

import torch
from torch import nn

from planner.torch_compat import FakeTensorMode, own_tensor_tables, pytree

T = TypeVar("T")


def keeps_fp32_weights(module: nn.Module) -> bool:
    """Whether FSDP's mixed precision leaves ``module``'s own parameters in fp32: a module that keeps
    floating buffers beside them (batch norm's running statistics), whose kernel wants its weights in
    their dtype (``planner.run.wrappers.fsdp_policy``; with bf16 weights and fp32 statistics it refuses)."""
    own = [p for p in module.parameters(recurse=False) if p.is_floating_point()]
    return bool(own) and any(b.is_floating_point() for b in module.buffers(recurse=False))


@contextlib.contextmanager
def _weights_replaced(
    module: nn.Module, replace: Callable[[torch.Tensor], torch.Tensor], param_dtype: torch.dtype | None = None
) -> Iterator[None]:
    """Every parameter and buffer of ``module`` replaced by ``replace(t)`` inside the block, put back
    after it, whatever happens; floating parameters (not buffers) in ``param_dtype`` where given, as
    FSDP's mixed precision gathers them (``planner.run.wrappers.fsdp_policy``; not those of a module
    that ``keeps_fp32_weights``).

    Each (module, attribute) is replaced once, however many paths reach the module: a stage and the
    prefix that makes its example can hold the very same layer (ALBERT's one layer, applied on both
    sides of a cut), and ``torch.func.functional_call`` swapped such a layer's weights once per path,
    so its restore left fake tensors in the real model. ``replace`` is called once per tensor, so
    tied weights stay tied.
    """
    done: dict[int, torch.Tensor] = {}
    saved: list[tuple[dict[str, Any], str, torch.Tensor, torch.dtype | None]] = []
    for m in module.modules():  # each module object once
        # the dtype this module's own parameters run in (None: theirs); buffers always keep theirs
        own = None if keeps_fp32_weights(m) else param_dtype
        parameters, buffers = own_tensor_tables(m)
        for table, dtype in ((parameters, own), (buffers, None)):
            for name, t in table.items():
                if t is not None:
                    saved.append((cast(dict[str, Any], table), name, t, dtype))
    try:
        for slots, name, t, dtype in saved:
            if id(t) not in done:
                new = replace(t)
                if dtype is not None and t.is_floating_point():
                    new = new.detach().to(dtype).requires_grad_(t.requires_grad)
                done[id(t)] = new
            slots[name] = done[id(t)]
        yield
    finally:
        for slots, name, t, _ in saved:
            slots[name] = t


def _as_meta(t: torch.Tensor) -> torch.Tensor:
    """A plain meta tensor with ``t``'s shape, strides, dtype and ``requires_grad`` (``t`` may be fake)."""
    out = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="meta")
    return out.requires_grad_(t.requires_grad) if t.requires_grad else out


def shapes_of(
    module: nn.Module,
    fn: Callable[..., T],
    *args: Any,
    device: torch.device | None = None,
    param_dtype: torch.dtype | None = None,
) -> T:
    """``fn(*args)`` on fake copies of ``module``'s parameters and buffers (tied ones stay tied) and of
    every tensor argument; every tensor of the result is returned as a plain meta tensor of the same
    shape, strides, dtype and ``requires_grad`` (``PipelineStage`` reads nothing else of its examples).

    Args:
        module: the module ``fn`` computes with (unchanged: its weights are never read or written).
        fn: a function of the module, e.g. ``module`` itself or an ``fx.Interpreter`` run of it.
        *args: its arguments.
        device: run as if the weights and arguments were there (the runner's GPU, so that autocast
            for it applies as in training); None: where they are.
        param_dtype: run with the floating parameters in this dtype (None: their own).

    Returns:
        What ``fn`` returns, its tensors as meta tensors.

    Raises:
        Exception: whatever the fake run raises (an operator that reads data, ...).
    """
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:

        def fake(t: torch.Tensor) -> torch.Tensor:
            f = mode.from_tensor(t)
            return f if device is None or f.device == device else f.to(device)

        with _weights_replaced(module, fake, param_dtype):
            out = fn(*pytree.tree_map_only(torch.Tensor, fake, args))
        return pytree.tree_map_only(torch.Tensor, _as_meta, out)


# A real run of at most this many parameters x input elements (about half its multiply-adds for a
# transformer; more than that for a convolution) takes a few milliseconds on one CPU thread, while the
# fake run's overhead is per operator: ~2.5 s of CPU for each rank's trace and stage examples of the
# tiny GPT (profiled). Above it, a real run grows with the model and the fake one does not.
REAL_RUN_LIMIT = 10**9


def cheap_to_run(module: nn.Module, args: Sequence[Any], device: torch.device | None = None) -> bool:
    """Whether running ``module`` for real on ``args`` costs less than a fake run, and gives what it
    would: weights and tensor arguments all on one real device (``device``, when given), and
    parameters x input elements at most ``REAL_RUN_LIMIT``.

    Args:
        module: the module the run computes with.
        args: the run's arguments.
        device: the device the run is meant to be as if on (None: where the weights are).

    Returns:
        True when a real run is the cheaper way to its shapes.
    """
    tensors = [*module.parameters(), *module.buffers()]
    inputs = [t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)]
    devices = {t.device for t in (*tensors, *inputs)}
    if len(devices) != 1 or next(iter(devices)).type == "meta" or (device is not None and devices != {device}):
        return False
    n_params = sum(t.numel() for t in tensors)
    return n_params * sum(t.numel() for t in inputs) <= REAL_RUN_LIMIT


def shapes_or_real(
    module: nn.Module,
    fn: Callable[..., T],
    *args: Any,
    device: torch.device | None = None,
    param_dtype: torch.dtype | None = None,
) -> T:
    """``fn(*args)`` itself (on copies of the parameters in ``param_dtype`` where given) where that is
    cheap (``cheap_to_run``) or fake tensors cannot run it; otherwise ``shapes_of(module, fn, *args,
    device=device, param_dtype=param_dtype)``. A real run leaves the RNG as it was; the caller keeps
    the weights' buffers as they were (batch norm's statistics move in a real run).

    Args:
        module: as ``shapes_of``.
        fn: as ``shapes_of``.
        *args: as ``shapes_of``.
        device: as ``shapes_of``.
        param_dtype: as ``shapes_of``.

    Returns:
        ``fn``'s result: meta tensors, or (a real run) real ones.
    """
    if not cheap_to_run(module, args, device):
        try:
            return shapes_of(module, fn, *args, device=device, param_dtype=param_dtype)
        except Exception:  # noqa: BLE001 - any failure of the fake run: the real run says what is wrong, if anything
            pass
    # a real run draws from the RNG (dropout): training must start where it would have
    gpus = sorted({t.device.index or 0 for t in (*module.parameters(), *pytree.tree_leaves(args)) if _on_gpu(t)})
    with torch.random.fork_rng(devices=gpus), contextlib.ExitStack() as stack:
        if param_dtype is not None:
            stack.enter_context(_weights_replaced(module, lambda t: t, param_dtype))
        return fn(*args)


def _on_gpu(t: Any) -> bool:
    """Whether ``t`` is a tensor on a CUDA device (whose RNG a real run may draw from)."""
    return isinstance(t, torch.Tensor) and t.device.type == "cuda"
