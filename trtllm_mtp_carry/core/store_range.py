"""The hidden store's written interval and the ticket that owns it.

The hidden store (`mtp_prefill_hidden`) is model-level and indexed by absolute
position, so an interval alone cannot say whose rows it holds: every range is
stamped with the ticket of the sequence that wrote it.

Invariants:
- `lo <= hi`; `(lo, hi)` is half-open. An empty range has `lo == hi`.
- A reader sees rows only under its own non-zero ticket (`visible_to`).
- A write by another ticket replaces the range, never merges into it, so a
  reader can never see rows another ticket wrote after it.
- Ticket `0` never matches anything: a write under it leaves the range unclaimed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ._checks import check_non_negative, check_u64


@dataclass(frozen=True, slots=True)
class StoreRange:
    """Rows `[lo, hi)` of the hidden store, written by sequence ticket `owner`."""

    owner: int
    lo: int
    hi: int

    EMPTY: ClassVar[StoreRange]

    def __post_init__(self) -> None:
        check_u64("owner", self.owner)
        check_non_negative("lo", self.lo)
        check_non_negative("hi", self.hi)
        if self.lo > self.hi:
            raise ValueError(f"StoreRange needs lo <= hi, got lo={self.lo} hi={self.hi}")

    def visible_to(self, reader: int) -> tuple[int, int]:
        """`(lo, hi)` if `reader` is the non-zero owner, else `(0, 0)`."""
        if reader != 0 and reader == self.owner:
            return (self.lo, self.hi)
        return (0, 0)

    def __len__(self) -> int:
        return self.hi - self.lo


StoreRange.EMPTY = StoreRange(0, 0, 0)


def merge_interval(current: tuple[int, int], start: int, count: int) -> tuple[int, int]:
    """Merge a write of `[start, start + count)` into `current = (lo, hi)`.

    An overlapping or abutting write extends the interval; a disjoint write
    replaces it (one interval cannot describe two runs, and claiming the gap
    would mark unwritten rows valid). An empty current interval is replaced; a
    zero-length write changes nothing.
    """
    lo, hi = current
    check_non_negative("lo", lo)
    check_non_negative("hi", hi)
    check_non_negative("start", start)
    check_non_negative("count", count)
    if lo > hi:
        raise ValueError(f"interval needs lo <= hi, got ({lo}, {hi})")
    if count == 0:
        return (lo, hi)
    end = start + count
    if lo == hi or start > hi or end < lo:
        return (start, end)
    return (min(lo, start), max(hi, end))


def stamped_merge(current: StoreRange, writer: int, start: int, count: int) -> StoreRange:
    """Record a write of `[start, start + count)` by ticket `writer`.

    The same non-zero owner merges with `merge_interval`; any other owner, or
    an unclaimed range, is replaced by the write and stamped with `writer`
    (merging across owners would leave another sequence's rows inside the
    interval). A write under ticket `0` leaves the range unclaimed. A
    zero-length write changes nothing: it overwrote no rows.
    """
    check_u64("writer", writer)
    check_non_negative("start", start)
    check_non_negative("count", count)
    if count == 0:
        return current
    if writer != 0 and writer == current.owner:
        return StoreRange(writer, *merge_interval((current.lo, current.hi), start, count))
    return StoreRange(writer, start, start + count)
