"""The two speed levers of the PyTorch tutorials, as the profilers apply them: autocast and compile.

- **Autocast** (``--dtype bf16|fp16`` on measured costs): every block's forward, and the last
  block's loss, run under ``torch.autocast(device_type, dtype)``; backward runs outside it, as
  torch's AMP recipe has it. Parameters, gradients and optimizer state stay in the model's own
  dtype (fp32: autocast's master weights); activations, and the tensors crossing a cut, are
  whatever autocast produces (bf16 out of a matmul, fp32 out of a residual add of fp32 and bf16),
  so they are measured, never assumed. Autocast's copies of the weights in the low-precision
  dtype, which the matmuls save for backward, count with the activations and apart
  (``is_weight_cast``; ``BlockCost.weight_cast_bytes``): the runner keeps one autocast cache
  through a step (``planner.run.wrappers.weight_cast_cache``), so a stage with many microbatches
  live may hold one set of them per step, not one per microbatch in flight
  (``planner.core.levers.casts.shared_casts``). A compiled block casts inside its graph, so its copies are plain saved
  tensors, counted per microbatch, as the compiled stage holds them.
- **Compile** (``--compile``): each block is profiled as ``torch.compile(block_module)``, the way
  the runner compiles each stage module whole (per-block compiled time estimates the stage's). The
  first, untimed run compiles. Compiled code is built without donated buffers
  (``planner.torch_compat.retain_graph_compile``): torch.distributed.pipelining's split
  backward (``stage_backward_input``) retains the graph, which a backward with donated buffers
  refuses ("requires create_graph=False and retain_graph=False"); the runner compiles the same way.
  A compiled block's backward is one autograd node, so that split runs it whole twice (I, then W):
  I + W is about 2 B, which the zero-bubble schedules' predictions then carry.

fp16 training usually scales the loss (``torch.amp.GradScaler``) so small gradients do not flush to
zero; the profile does not time the scaler's multiply and unscale (a pass over the gradients, next
to the optimizer step).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from planner.errors import PlannerError
from planner.torch_compat import pytree, retain_graph_compile, view_base

AUTOCAST_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""``--dtype`` name -> the dtype ``torch.autocast`` computes in."""


def autocast_context(device_type: str, autocast: str | None) -> contextlib.AbstractContextManager[Any]:
    """A fresh ``torch.autocast`` region for ``autocast``, or a region that changes nothing.

    Args:
        device_type: the profiling device's type ("cpu", "cuda").
        autocast: "bf16", "fp16", or None (fp32: no autocast).

    Returns:
        The context manager (a new one per call: autocast regions are not reentrant objects).
    """
    if autocast is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=AUTOCAST_DTYPES[autocast])


def is_weight_cast(t: torch.Tensor, params: set[int]) -> bool:
    """Whether ``t``, a tensor autograd saves, is (a view of) autocast's lower-precision copy of a parameter.

    Autocast casts a weight with ``aten._to_copy``, whose autograd node leads straight to the
    parameter's gradient accumulator; the matmul saves that copy or a view of it (``F.linear`` saves
    the transpose).

    Args:
        t: the saved tensor (as a ``saved_tensors_hooks`` pack function receives it).
        params: ``id`` of every parameter of the model.

    Returns:
        True for such a copy.
    """
    base = view_base(t)
    base = t if base is None else base
    fn = base.grad_fn
    if fn is None or fn.name() != "ToCopyBackward0" or not fn.next_functions:
        return False
    source = fn.next_functions[0][0]
    return source is not None and id(getattr(source, "variable", None)) in params


def device_type_of(model: torch.nn.Module, inputs: Any) -> str:
    """The device type a model runs on: its first tensor input's, else its first parameter's, else "cpu".

    Args:
        model: the model.
        inputs: its inputs (any nesting).

    Returns:
        e.g. "cpu" or "cuda".
    """
    for value in pytree.tree_leaves(inputs):
        if isinstance(value, torch.Tensor):
            return value.device.type
    for p in model.parameters():
        return p.device.type
    return "cpu"


def tensor_bytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (any nesting), each distinct storage region counted once.

    Args:
        value: a block's output (a tensor, a tuple of them, a dict...).

    Returns:
        The bytes, in the dtypes the tensors have (bf16 out of an autocast matmul: 2 per element).
    """
    seen: dict[tuple[int, int, tuple[int, ...]], int] = {}
    for t in pytree.tree_leaves(value):
        if isinstance(t, torch.Tensor):
            seen[(t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape))] = (
                t.numel() * t.element_size()
            )
    return sum(seen.values())


def check_autocast(device: torch.device, autocast: str) -> None:
    """Refuse an autocast dtype the device cannot run, before any model is built.

    torch only warns and turns autocast off for a dtype a device lacks, which would profile fp32
    under an "autocast" label: a matmul is run under autocast and its result dtype checked.

    Args:
        device: the profiling device.
        autocast: "bf16" or "fp16".

    Raises:
        PlannerError: the device has no autocast, or not in this dtype.
    """
    dtype = AUTOCAST_DTYPES[autocast]
    if not torch.amp.is_autocast_available(device.type):
        raise PlannerError(f"--dtype {autocast}: torch has no autocast for {device.type}; plan without --dtype")
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        name = torch.cuda.get_device_name(device)
        raise PlannerError(f"--dtype bf16: {name} does not support bfloat16; use --dtype fp16")
    x = torch.ones(2, 2, device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the "disabling autocast" warning: the result says it
        with torch.autocast(device.type, dtype=dtype):
            got = torch.mm(x, x).dtype
    if got != dtype:
        raise PlannerError(
            f"--dtype {autocast}: torch {torch.__version__}'s {device.type} autocast does not compute in {dtype} "
            f"(it ran in {got}); use {' or '.join(f'--dtype {n}' for n in AUTOCAST_DTYPES if n != autocast)}, "
            "or plan without --dtype"
        )


@contextlib.contextmanager
def compile_settings() -> Iterator[None]:
    """Compile as the runner does: without donated buffers (see the module docstring).

    Yields:
        Nothing; ``torch.compile`` inside the block builds code that allows ``retain_graph``.
    """
    # compile_threads=1: inductor compiles in this process. Its default pool of compile workers
    # starts (each importing torch) while the first blocks are timed, and on a few cores that
    # slowed the timed runs after a cold compile 3x (6 ms instead of 2 ms per encoder layer here).
    with retain_graph_compile(compile_threads=1):
        yield


def compile_module(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile(fn)`` with the default (inductor) backend; compiled lazily, on the first call.

    Args:
        fn: a block's module, or its bound ``forward``.

    Returns:
        The compiled callable (the module's parameters are shared, not copied).
    """
    return torch.compile(fn)


def failure_reason(error: BaseException) -> str:
    """The first line of a compile error, short enough for a one-line note.

    Args:
        error: what ``torch.compile``'s first call raised.

    Returns:
        ``ErrorType: first line`` (at most 200 characters).
    """
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = f"{type(error).__name__}: {lines[0] if lines else 'no message'}"
    return text if len(text) <= 200 else text[:197] + "..."
