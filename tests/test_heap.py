"""Tier 1 (pure): ``bulk_allocation`` pauses the cyclic collector and restores it as it was;
``kept_until_exit`` also freezes what it built."""

from __future__ import annotations

import gc

import pytest

from planner.core.heap import bulk_allocation


def test_paused_inside_and_restored_after() -> None:
    assert gc.isenabled()
    with bulk_allocation():
        assert not gc.isenabled()
        with bulk_allocation():  # nested: still paused, and not resumed by the inner block's end
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_restored_after_an_error() -> None:
    with pytest.raises(ValueError), bulk_allocation():
        raise ValueError("inside")
    assert gc.isenabled()


def test_left_disabled_when_it_was() -> None:
    gc.disable()
    try:
        with bulk_allocation():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the caller had paused it: not resumed behind its back
    finally:
        gc.enable()


def test_cycles_made_inside_are_freed_by_the_next_collection() -> None:
    """Only cycles wait: the first collection after the block frees them."""

    class Node:
        pass

    with bulk_allocation():
        a, b = Node(), Node()
        a.other, b.other = b, a  # type: ignore[attr-defined]
        ids = {id(a), id(b)}
        del a, b
        assert any(id(o) in ids for o in gc.get_objects())
    gc.collect()
    assert not any(id(o) in ids and type(o).__name__ == "Node" for o in gc.get_objects())


def test_kept_until_exit_freezes_what_the_block_built() -> None:
    """The last work of a process: collection resumes after it, but what it built is frozen (never
    walked again before exit); after an error nothing is frozen and collection goes on as usual."""
    from planner.core.heap import kept_until_exit

    assert gc.get_freeze_count() == 0
    try:
        with pytest.raises(ValueError), kept_until_exit():
            raise ValueError("inside")
        assert gc.isenabled() and gc.get_freeze_count() == 0
        with kept_until_exit():
            built = [[i] for i in range(1000)]
            assert not gc.isenabled()
        assert gc.isenabled()
        assert gc.get_freeze_count() >= len(built)
        assert not any(o is built for o in gc.get_objects())  # frozen objects are out of the collector's generations
    finally:
        gc.unfreeze()
