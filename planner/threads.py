"""``torch_threads(n)``: run a block of code with n intra-op threads, then restore the setting.

Profiling, the CPU micro-benchmarks and the in-process runner all time code at the thread count a
rank will have (cores / ranks), and must leave the caller's setting as it was.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Set torch's intra-op thread count to ``n`` inside the block, restore it afterwards.

    Args:
        n: threads; None (or 0) keeps the current setting.

    Yields:
        Nothing; the body runs with ``n`` threads.
    """
    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
