"""``bulk_allocation()``: build a large structure with Python's cyclic garbage collector paused.

CPython starts a full collection each time the objects that survived earlier ones grew by a quarter,
and a full collection walks every tracked object. Planning builds a few structures of hundreds of
thousands of objects that live until the plan is made and hold no garbage cycles worth freeing: an
action order or a simulator program (64 ranks x 512 microbatches: some 65k actions), a 1,000-layer
model built on the meta device and its fx graph (some 90,000 nodes), the search's candidates. Each
full collection while they grow walks all of them again: at 1,000 layers 14 such walks took about
5 s of a 30 s ``planner plan`` and freed a few MB (measured: peak memory 756 MB collecting, 782 MB
paused). Pause collection only where the objects built are meta tensors, graphs and numbers: a
measured profile's real tensors are not built under it, so a cycle never holds device memory long.
``kept_until_exit()`` is the same pause for the last work of a process, which freezes what it built
instead of collecting it (the ``planner`` console script's estimated plans).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def bulk_allocation() -> Iterator[None]:
    """No cyclic garbage collection inside the block; collection resumes as it was afterwards.

    Reference counting still frees every object without a cycle at once; only cycles wait for the
    first collection after the block (nested blocks leave it paused until the outermost ends).

    Yields:
        Nothing; the body runs with the collector paused.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextmanager
def kept_until_exit() -> Iterator[None]:
    """``bulk_allocation()`` for the last work of a process (``planner plan`` with estimated costs):
    what the block built is frozen when it ends (``gc.freeze``), so the collector never walks it
    before the process exits, which frees it anyway. At 1,000 layers that walk, the one collection
    after the plan is made, took 1.4 s of the command and would free some 300,000 small objects
    (tuples and closures of the trace and the search: a few tens of MB until exit).

    Yields:
        Nothing; the body runs with the collector paused.
    """
    with bulk_allocation():
        yield
        gc.freeze()  # only after a body that finished: after an error collection goes on as usual
