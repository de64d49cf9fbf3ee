"""The temporaries a backward pass holds at its peak: bytes it allocates and frees again before it ends.

A stage's memory peaks while a backward runs, and besides the saved activations that backward holds
gradients of the block's intermediate values for a while: a transformer layer two FFN-wide
activation gradients at once; a language model's loss the gradient of its log-probabilities and of
the logits, each the size of the logits in fp32 (on an H100, docs/gpu_recompute.md: 2 x 7.83 GiB for
two 8,192-token sequences of Llama 3's 128,256-word vocabulary). ``BackwardTemps`` watches every
operator the backward runs (a ``TorchDispatchMode``, so the same code counts real tensors on the CPU
or a GPU and ``meta`` tensors in the estimate), notes each new storage and, through a weak
reference, when it is freed, and reports the most bytes alive at once among the storages that are
gone again by the end. What survives the backward (the parameters' gradients, the gradients of the
block's inputs) is left out: the memory model counts those apart. Tensors that existed before the
backward (the saved activations, the incoming gradient) are not counted, and what they free is not
credited: the model counts them apart too.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from planner.costs.timing import backward_roots
from planner.torch_compat import TorchDispatchMode, pytree, storage_id


class BackwardTemps(TorchDispatchMode):
    """Peak bytes of the temporaries of what runs inside it (``peak`` after it exits).

    Args:
        float_bytes: count floating tensors at this many bytes per element (the estimate's fallback
            runs a block in fp32 for a 16-bit plan); None: as they are.
    """

    def __init__(self, float_bytes: int | None = None) -> None:
        super().__init__()
        self.float_bytes = float_bytes
        self._live: dict[int, tuple[int, weakref.ref[Any]]] = {}  # storage id -> (serial, weak reference)
        self._events: list[tuple[int, int] | None] = []  # (serial, +bytes / -bytes); None: a peak is read
        self._serial = 0
        self._survivors: set[int] = set()
        self._end = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        # views and in-place results share a storage that exists already
        inputs = {_storage_key(t) for t in pytree.tree_leaves((args, kwargs))}
        for t in pytree.tree_leaves(out):
            key = _storage_key(t)
            if key is None or key in inputs or key in self._live:  # (a sparse gradient has no storage)
                continue
            storage = t.untyped_storage()
            nbytes = storage_bytes(t, self.float_bytes)
            self._serial += 1
            self._events.append((self._serial, nbytes))
            self._live[key] = (self._serial, weakref.ref(storage, self._on_free(key, self._serial, nbytes)))
        self._events.append(None)
        return out

    def __exit__(self, *exc: Any) -> None:
        # what is alive now survives the backward; what is freed later (the caller's zero_grad) is not a temporary
        self._survivors = {serial for serial, _ in self._live.values()}
        self._end = len(self._events)
        super().__exit__(*exc)

    def _on_free(self, key: int, serial: int, nbytes: int) -> Callable[[Any], None]:
        def gone(_ref: Any) -> None:
            self._events.append((serial, -nbytes))
            if self._live.get(key, (0,))[0] == serial:
                del self._live[key]

        return gone

    def peak(self) -> int:
        """The most bytes alive at once, after any operator run inside the mode, of the storages that
        were freed again before it exited.

        Returns:
            Bytes (0 when nothing ran).
        """
        now = most = 0
        for event in self._events[: self._end]:
            if event is None:
                most = max(most, now)
            elif event[0] not in self._survivors:
                now += event[1]
        return most


def storage_bytes(t: torch.Tensor, float_bytes: int | None) -> int:
    """Bytes of ``t``'s storage, floating elements counted at ``float_bytes`` when given.

    Args:
        t: a tensor (views count their whole storage).
        float_bytes: bytes per floating element to count instead of its own (None: as it is).

    Returns:
        The bytes.
    """
    nbytes = t.untyped_storage().nbytes()
    if float_bytes is not None and t.is_floating_point():
        nbytes = nbytes // t.element_size() * float_bytes
    return nbytes


def _storage_key(t: Any) -> int | None:
    """``storage_id`` of a tensor with a storage of its own to watch; None for anything else (not a
    tensor, a sparse tensor, a wrapper subclass without a storage)."""
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
        return None
    try:
        return storage_id(t)
    except (RuntimeError, NotImplementedError):
        return None


def forward_backward_temps(
    forward: Callable[[tuple[Any, ...]], Any],
    args: tuple[Any, ...],
    params: Iterable[torch.Tensor],
    float_bytes: int | None = None,
) -> int:
    """One forward of ``forward(args)``, then the peak temporaries of its backward from a gradient of
    ones for each output, the ``params``' gradients new as in a step's first backward (accumulating
    into existing ones would count each new gradient as a temporary).

    Args:
        forward: the block's forward (or its loss, to measure from the loss on).
        args: its inputs.
        params: the parameters it reads (their gradients are reset first).
        float_bytes: as ``BackwardTemps``.

    Returns:
        Bytes (0 when no output needs a gradient).
    """
    for p in params:
        p.grad = None
    with torch.enable_grad():
        roots, grads = backward_roots(forward(args))
    if not roots:
        return 0
    return backward_temp_bytes(lambda: torch.autograd.backward(roots, grads), float_bytes)


def backward_temp_bytes(run: Callable[[], Any], float_bytes: int | None = None) -> int:
    """Peak temporaries of ``run()`` (a backward pass), as ``BackwardTemps`` counts them.

    Args:
        run: the backward, e.g. ``lambda: torch.autograd.backward(roots, grads)``.
        float_bytes: as ``BackwardTemps``.

    Returns:
        Bytes.
    """
    with BackwardTemps(float_bytes) as temps:
        run()
    return temps.peak()
