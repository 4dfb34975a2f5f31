"""FreeSpans: the free-range bookkeeping the row arena and the pinned host slab share."""

from __future__ import annotations

import pytest

from trtllm_mtp_carry.core.free_spans import FreeSpans


def test_first_fit_takes_the_lowest_span_that_holds_the_request_and_give_merges_neighbours() -> None:
    free = FreeSpans(10)
    for start, n in ((0, 3), (3, 2), (5, 4)):
        assert free.find(n) == start
        free.cut(start, n)
    assert free.spans == [(9, 1)] and free.total() == 1
    free.give(3, 2)
    assert free.find(2) == 3 and free.find(3) is None
    free.give(0, 3)  # merges with [3, 5)
    free.give(5, 4)  # merges with [0, 5) and [9, 10)
    assert free.spans == [(0, 10)]


def test_cut_refuses_a_range_that_is_not_the_start_of_a_free_span() -> None:
    free = FreeSpans(8)
    free.cut(0, 4)
    with pytest.raises(RuntimeError, match=r"no free span of 5 at 4: \(4, 4\)"):
        free.cut(4, 5)


def test_reset_around_leaves_the_gaps_between_held_extents_free() -> None:
    free = FreeSpans(12)
    free.reset_around([(7, 2), (0, 3)])
    assert free.spans == [(3, 4), (9, 3)]
    free.reset_around([])
    assert free.spans == [(0, 12)]
    assert FreeSpans(0).spans == [] and FreeSpans(0).find(1) is None


def test_check_tiles_names_a_gap_an_overlap_and_a_short_cover() -> None:
    free = FreeSpans(10)
    free.cut(0, 6)
    free.check_tiles([(0, 6)], "extents")  # held and free tile [0, 10)
    with pytest.raises(RuntimeError, match=r"^extents do not tile its 10 units: \[\(0, 4\), \(6, 4\)\]$"):
        free.check_tiles([(0, 4)], "extents")
    with pytest.raises(RuntimeError, match=r"^extents do not tile its 10 units: \[\(0, 6\), \(5, 1\), \(6, 4\)\]$"):
        free.check_tiles([(0, 6), (5, 1)], "extents")
    free.cut(6, 4)
    with pytest.raises(RuntimeError, match=r"^extents cover 6 of 10 units$"):
        free.check_tiles([(0, 6)], "extents")
