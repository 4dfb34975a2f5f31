"""Free ranges of one address space: first fit at the lowest address, neighbours merged.

What it is for: the adapter's row arena (units: arena blocks) and the runtime's pinned
host slab (units: bytes) both carve extents out of one fixed allocation; this is the
bookkeeping they share, plain ints and no torch (who moves the bytes is theirs)::

    | held | free (s0, n0) | held | held | free (s1, n1) |
    0                                               capacity

Invariants:
- `spans` are sorted by start, each of positive length, no two adjacent (`give` merges);
  with the owner's held extents they tile `[0, capacity)` exactly once (the owners'
  `check` pins it).
- `cut(start, n)` takes the first `n` units of the free span starting at `start` (the
  one `find` returned); `give` returns a range no span covers. Neither loops over units.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable


class FreeSpans:
    """The free `(start, length)` spans of an address space of `capacity` units."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.spans: list[tuple[int, int]] = [(0, capacity)] if capacity else []

    def total(self) -> int:
        """Free units, in all spans."""
        return sum(n for _, n in self.spans)

    def find(self, n: int) -> int | None:
        """The start of the lowest span of at least `n` units (first fit), else None."""
        for start, length in self.spans:
            if length >= n:
                return start
        return None

    def cut(self, start: int, n: int) -> None:
        """Take the first `n` units of the free span starting at `start` (`find`'s answer)."""
        i = bisect.bisect_left(self.spans, (start, 0))
        s, length = self.spans[i]
        if s != start or length < n:
            raise RuntimeError(f"no free span of {n} at {start}: {self.spans[i]}")
        if length == n:
            del self.spans[i]
        else:
            self.spans[i] = (s + n, length - n)

    def give(self, start: int, n: int) -> None:
        """Return `[start, start + n)` to the free spans, merged with its free neighbours."""
        i = bisect.bisect_left(self.spans, (start, 0))
        self.spans.insert(i, (start, n))
        if i + 1 < len(self.spans) and start + n == self.spans[i + 1][0]:  # merge with the next
            self.spans[i] = (start, n + self.spans[i + 1][1])
            del self.spans[i + 1]
        if i > 0 and self.spans[i - 1][0] + self.spans[i - 1][1] == start:  # and the previous
            ps, pn = self.spans[i - 1]
            self.spans[i - 1] = (ps, pn + self.spans[i][1])
            del self.spans[i]

    def reset_around(self, held: Iterable[tuple[int, int]]) -> None:
        """Make the free spans the gaps between the `(start, length)` extents `held` (after a
        compaction, or `held` empty: all free)."""
        self.spans = []
        at = 0
        for start, n in sorted(held) + [(self.capacity, 0)]:
            if start > at:
                self.spans.append((at, start - at))
            at = start + n

    def check_tiles(self, held: Iterable[tuple[int, int]], what: str) -> None:
        """RuntimeError (naming `what`, e.g. "arena extents") unless the `(start, length)` extents
        `held` and the free spans tile `[0, capacity)` exactly once."""
        spans = sorted([*held, *self.spans])
        at = 0
        for start, n in spans:
            if start != at or n <= 0:
                raise RuntimeError(f"{what} do not tile its {self.capacity} units: {spans}")
            at += n
        if at != self.capacity:
            raise RuntimeError(f"{what} cover {at} of {self.capacity} units")
