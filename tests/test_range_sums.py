"""Pure-tier tests of planner.core.split.range_sums: range maxima against the plain max of the slice."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.core.split.range_sums import RangeMax

# byte counts past 2**62 make the solver keep its arrays as Python ints (dtype object)
VALUES = st.lists(st.integers(min_value=0, max_value=2**70), min_size=1, max_size=70)


@settings(max_examples=300, deadline=None)
@given(VALUES, st.data())
def test_range_maxima_of_many_ranges_equal_the_max_of_each_slice(values: list[int], data: st.DataObject) -> None:
    n = len(values)
    pairs = data.draw(st.lists(st.tuples(st.integers(0, n), st.integers(0, n)), min_size=1, max_size=40))
    s = np.array([a for a, _ in pairs], dtype=np.int64)
    e = np.array([b for _, b in pairs], dtype=np.int64)
    table = RangeMax(values)
    wide = any(v >= 2**62 for v in values)
    for dtype in (object,) if wide else (np.int64, object):
        got = table.arrays(dtype).many(s, e)
        # an empty range (e <= s) counts 0, as the solver's sums of no blocks do
        assert [int(x) for x in got] == [max(values[a:b]) if b > a else 0 for a, b in pairs]
    for a, b in pairs:
        if b > a:
            assert table.of(a, b) == max(values[a:b])


def test_an_empty_list_has_no_maxima() -> None:
    s = np.array([0, 0], dtype=np.int64)
    assert list(RangeMax([]).arrays(np.int64).many(s, s)) == [0, 0]
