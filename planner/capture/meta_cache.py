"""Run a model's operators on the meta device once per distinct call: the 80 (or 1,000) identical
layers of a transformer ask the meta kernels the same questions, layer after layer.

Planning runs the traced model on the meta device several times (recording every node's value,
checking forward and loss, counting the tensor-parallel shares, again at other microbatch sizes). A
meta kernel computes no data, only the output's shape, strides and dtype, but many of them are
Python decompositions (elementwise broadcasting, softmax, attention) costing a few hundred
microseconds a call: at 1,000 layers most of the planning time. ``meta_op_cache`` remembers, for
each functional aten operator, the outputs' metadata per distinct input metadata and answers a
repeated call with fresh empty meta tensors of that metadata, as the kernel would have
(``planner.capture.signature.spec`` / ``rebuild``, as twin blocks are replayed).

Only calls whose answer is a function of what the key holds are cached: every tensor argument a
plain meta tensor (shape, strides, storage offset and dtype in the key), every other argument a
plain constant; operators that mutate or alias their inputs (in-place, views, ``out=``) always run,
as do calls whose outputs are not all fresh meta tensors (a CPU tensor made by ``torch.arange``
holds values). Autograd sits above the dispatch modes, so gradients, saved-tensor hooks and any
dispatch mode entered after this one (the tensor-parallel tally, the roofline) see every call as
before.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from planner.capture.signature import rebuild, spec
from planner.torch_compat import TorchDispatchMode, op_schema

_META = torch.device("meta")
_CONSTANTS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_UNTRIED = object()  # a key not seen yet (an answer of None: seen, not replayable, not tried again)


class _NoKey(Exception):
    """An argument the key cannot hold (a real tensor, a tensor subclass, a symbolic size)."""


def _key(value: Any) -> Any:
    """A hashable description of an argument: tensors by their metadata, containers by their items."""
    if type(value) is torch.Tensor or type(value) is torch.nn.Parameter:
        if value.device != _META:
            raise _NoKey
        return ("T", tuple(value.shape), value.stride(), value.storage_offset(), value.dtype)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, *(_key(v) for v in value))
    if isinstance(value, _CONSTANTS):
        return (type(value).__name__, value)
    raise _NoKey


# Allocations are cheap C++ meta kernels, and what a replayed value is made of: keying them would
# cost more than running them.
_ALLOCATIONS = (torch.ops.aten.empty_strided.default, torch.ops.aten.empty.memory_format)


def _functional(func: Any) -> bool:
    """Whether an operator neither writes nor aliases its arguments (its schema has no alias
    annotations and it is no view), and is worth a key (no bare allocation)."""
    if func in _ALLOCATIONS:
        return False
    schema = op_schema(func)
    if schema.is_mutable or getattr(func, "is_view", False):
        return False
    return all(a.alias_info is None for a in (*schema.arguments, *schema.returns))


class MetaOpCache(TorchDispatchMode):
    """Answers repeated functional meta calls from their first answer (see the module docstring).

    Attributes:
        hits: calls answered from the cache.
        misses: calls run (and remembered where they could be).
    """

    def __init__(self) -> None:
        super().__init__()
        self.answers: dict[Any, Any] = {}
        self.functional: dict[Any, bool] = {}
        self.hits = 0
        self.misses = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        ok = self.functional.get(func)
        if ok is None:
            ok = self.functional[func] = _functional(func)
        if not ok:
            return func(*args, **kwargs)
        try:
            key = (func, _key(args), _key(tuple(sorted(kwargs.items()))))
        except _NoKey:
            return func(*args, **kwargs)
        known = self.answers.get(key, _UNTRIED)
        if known is not _UNTRIED and known is not None:
            self.hits += 1
            return rebuild(known)
        self.misses += 1
        out = func(*args, **kwargs)
        if known is _UNTRIED:
            self.answers[key] = spec(out)  # None for a real or subclass tensor: never replayed
        return out


def on_meta(module: torch.nn.Module, inputs: Any = ()) -> bool:
    """Whether ``module``'s parameters or any tensor of ``inputs`` live on the meta device."""
    first = next(module.parameters(), None)
    if first is not None and first.device == _META:
        return True
    return any(isinstance(t, torch.Tensor) and t.device == _META for t in inputs)


@contextlib.contextmanager
def meta_op_cache(enabled: bool = True) -> Iterator[MetaOpCache | None]:
    """Cache meta operator calls inside the block (nothing changes for real tensors).

    Enter it before any dispatch mode that must see every call (a mode entered later handles each
    call first and passes it down to this one).

    Args:
        enabled: False makes it a no-op (a run on real tensors gains nothing from the Python
            dispatch every call would then go through).

    Yields:
        The cache (its ``hits`` and ``misses``), None when not enabled.
    """
    if not enabled:
        yield None
        return
    cache = MetaOpCache()
    with cache:
        yield cache


def _skipping_meta(original: Any) -> Any:
    """``original`` (a ``torch.nn.init.*_`` function) that returns a meta tensor untouched.

    Only meta tensors are skipped, never by a flag of the build: a library imported during the
    build may keep the function it finds on ``torch.nn.init`` (transformers' ``initialization``
    module does, on first import, and restores torch's initialisers from that copy ever after), so
    what it keeps must go on initialising real tensors once the build is over. Skipping a meta
    tensor changes nothing a caller can see: it holds no values, and a meta random op draws nothing
    from the generator.
    """

    @functools.wraps(original)
    def init(*args: Any, **kwargs: Any) -> Any:
        tensor = args[0] if args else kwargs.get("tensor")
        if isinstance(tensor, torch.Tensor) and tensor.is_meta:
            return tensor
        return original(*args, **kwargs)

    return init


@contextlib.contextmanager
def meta_build() -> Iterator[None]:
    """Build a model on the meta device with ``torch.nn.init``'s in-place initialisers skipped.

    A meta tensor holds no values, so initialising one changes nothing but costs a dispatch through
    the device context and a Python decomposition per call: half of building a 1,000-layer Llama
    (7,000 ``kaiming_uniform_``). Inside, every public ``torch.nn.init.*_`` function returns a meta
    tensor untouched (and initialises any other tensor as before); restored on exit.
    """
    init = torch.nn.init
    names = [n for n in dir(init) if n.endswith("_") and not n.startswith("_") and callable(getattr(init, n))]
    saved = {n: getattr(init, n) for n in names}
    try:
        for n in names:
            setattr(init, n, _skipping_meta(saved[n]))
        with torch.device("meta"):
            yield
    finally:
        for n, f in saved.items():
            setattr(init, n, f)


__all__ = ["MetaOpCache", "meta_build", "meta_op_cache", "on_meta"]
