"""StoreRange, merge_interval and stamped_merge: exact values and the isolation invariant."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trtllm_mtp_carry import StoreRange, merge_interval, stamped_merge


def test_empty_is_unclaimed_and_zero():
    assert StoreRange.EMPTY == StoreRange(0, 0, 0)
    assert StoreRange.EMPTY.visible_to(1) == (0, 0)


def test_visible_only_to_owner():
    r = StoreRange(5, 10, 20)
    assert r.visible_to(5) == (10, 20)
    assert r.visible_to(6) == (0, 0)
    assert r.visible_to(0) == (0, 0)


def test_ticket_zero_never_matches_unclaimed_range():
    assert StoreRange(0, 3, 9).visible_to(0) == (0, 0)


@pytest.mark.parametrize(
    "cur, start, count, expected",
    [
        ((10, 20), 15, 10, (10, 25)),  # overlap extends
        ((10, 20), 20, 5, (10, 25)),  # abutting at hi extends
        ((10, 20), 5, 5, (5, 20)),  # abutting at lo extends
        ((10, 20), 12, 3, (10, 20)),  # inside
        ((10, 20), 0, 40, (0, 40)),  # covering
        ((10, 20), 21, 4, (21, 25)),  # gap of one row: replaced
        ((10, 20), 0, 9, (0, 9)),  # gap below: replaced
        ((0, 0), 30, 2, (30, 32)),  # empty current: replaced
        ((7, 7), 7, 1, (7, 8)),  # empty current at same position: replaced
        ((10, 20), 50, 0, (10, 20)),  # zero-length write: unchanged
    ],
)
def test_merge_interval(cur, start, count, expected):
    assert merge_interval(cur, start, count) == expected


def test_same_owner_merges():
    assert stamped_merge(StoreRange(3, 0, 100), 3, 100, 28) == StoreRange(3, 0, 128)


def test_other_owner_replaces():
    assert stamped_merge(StoreRange(3, 0, 100), 4, 50, 10) == StoreRange(4, 50, 60)


def test_unclaimed_range_is_replaced_even_when_abutting():
    assert stamped_merge(StoreRange(0, 0, 100), 4, 100, 10) == StoreRange(4, 100, 110)


def test_ticket_zero_write_leaves_range_unclaimed():
    out = stamped_merge(StoreRange(3, 0, 100), 0, 0, 10)
    assert out == StoreRange(0, 0, 10)
    assert out.visible_to(0) == (0, 0)
    assert stamped_merge(out, 0, 10, 10) == StoreRange(0, 10, 20)  # never merges under 0


def test_zero_length_write_changes_nothing():
    cur = StoreRange(3, 0, 100)
    assert stamped_merge(cur, 9, 40, 0) is cur


def test_bad_values_are_named():
    with pytest.raises(ValueError, match="owner"):
        StoreRange(-1, 0, 0)
    with pytest.raises(ValueError, match="owner"):
        StoreRange(2**64, 0, 0)
    with pytest.raises(ValueError, match="lo=5 hi=3"):
        StoreRange(1, 5, 3)
    with pytest.raises(ValueError, match="writer"):
        stamped_merge(StoreRange.EMPTY, 2**64, 0, 1)
    with pytest.raises(ValueError, match="count"):
        stamped_merge(StoreRange.EMPTY, 1, 0, -1)
    with pytest.raises(ValueError, match="start"):
        merge_interval((0, 0), -2, 1)


writes = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 60), st.integers(0, 20)), max_size=25)


@given(writes)
def test_reader_never_sees_a_row_another_ticket_wrote_after_it(ops):
    """Model the store row by row: a visible row was last written by the reader."""
    last_writer: dict[int, int] = {}
    rng = StoreRange.EMPTY
    for writer, start, count in ops:
        rng = stamped_merge(rng, writer, start, count)
        for row in range(start, start + count):
            last_writer[row] = writer
        for reader in range(4):
            lo, hi = rng.visible_to(reader)
            assert all(last_writer.get(row) == reader for row in range(lo, hi))
            if reader == 0:
                assert (lo, hi) == (0, 0)


@given(st.integers(0, 50), st.integers(0, 50), st.integers(0, 50), st.integers(0, 30))
def test_merge_interval_marks_only_written_rows(lo, width, start, count):
    """Every row of the result was in the old interval or in the write, and the write is kept."""
    hi = lo + width
    new_lo, new_hi = merge_interval((lo, hi), start, count)
    for row in range(new_lo, new_hi):
        assert lo <= row < hi or start <= row < start + count
    if count:
        assert new_lo <= start and start + count <= new_hi
