"""Host copies carved out of one host allocation of exactly the host budget (page-locked on a GPU).

What it is for: the reference runtime's host tier (`runtime/host_moves.py`,
`runtime/packed_rows.py`) held each host copy in its own `torch.empty(...,
pin_memory=True)`, which torch's caching host allocator rounds up to a power of
two and keeps page-locked after it is freed, so the pinned bytes were not the
budget's (on a GB10 that memory is the GPU's). A `HostSlab` is one
`pinned.pinned_empty(budget)` (exactly the budget, registered once, when the
runtime is built: `cudaHostRegister` costs per call and per page, far more than
the copy of an entry, so it stays off the demote path) and hands out byte
ranges of it by key: first fit over a sorted free list of `(start, length)`
ranges, merged on release; `compact` slides every range down when the free
bytes suffice but no free range is long enough.

Ranges start on `ALIGN` (4) bytes, so a codec's float32 scales viewed after
its payload stay aligned, and a range takes its bytes rounded up to 4: every
carried row is a multiple of 4 bytes (the adapter's arena's rule: bf16 and fp8
rows, an nvfp4 row for an even number of KV heads, a pool's whole blocks), so
ranges tile with no padding and whatever the store admits fits the budget.

Asynchronous users: a range released `after` an event (a copy back still
reading it) is reused only once that event completed (queried, or waited for
when nothing else fits). `compact` first calls `sync` (the owner's: all device
work that may read or write the slab is done) and then moves bytes with the
CPU (`memmove`: nothing is allocated, so a take never fails half way); the
owner hears each moved key (`on_move`) and views it again.

Invariants:
- `nbytes` is the storage's size (the budget given), never more: what is pinned.
- Held, pending and free ranges tile `[0, capacity)` exactly once (`check`).
- A key holds at most one range; `view(key)` is exactly the bytes taken.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import torch

from ..core.free_spans import FreeSpans
from .pinned import pinned_empty

__all__ = ["ALIGN", "HostSlab", "host_slab_for"]

ALIGN = 4


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class HostSlab:
    """One host allocation of `nbytes` (page-locked exactly with `pinned`), ranges by key."""

    def __init__(self, nbytes: int, pinned: bool, sync: Callable[[], None] = lambda: None,
                 on_move: Callable[[Hashable], None] = lambda key: None) -> None:
        if type(nbytes) is not int or nbytes < 0:
            raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
        self.storage = pinned_empty(nbytes) if pinned else torch.empty(nbytes, dtype=torch.uint8)
        self.pinned = pinned
        self.capacity = nbytes // ALIGN * ALIGN
        self.sync = sync
        self.on_move = on_move
        self._free = FreeSpans(self.capacity)
        self._held: dict[Hashable, tuple[int, int]] = {}  # key -> (start, bytes asked)
        self._pending: list[tuple[Any, int, int]] = []  # (event, start, length): reused once it completed
        self.compactions = 0

    @property
    def nbytes(self) -> int:
        """The bytes allocated (page-locked when `pinned`): the budget given."""
        return self.storage.numel()

    @property
    def held_bytes(self) -> int:
        """Bytes the held ranges were asked for (what their copies are)."""
        return sum(n for _, n in self._held.values())

    def __contains__(self, key: object) -> bool:
        return key in self._held

    @property
    def room(self) -> int:
        """Bytes a `take` may use without releasing anything: free, and released after an event."""
        return self._free.total() + sum(n for _, _, n in self._pending)

    def take(self, key: Hashable, nbytes: int, spare: Iterable[Hashable] = (),
             wait: bool = True) -> torch.Tensor | None:
        """A range of exactly `nbytes` held under `key` (a 1-D uint8 view), or None when the slab
        cannot hold it (after reusing released ranges and compacting; without `wait`, only a free
        range or one whose event completed: the CPU never blocks). `spare`: held keys whose
        ranges may be released for it (the host tier's victims, dropped if this copy is made): all
        of them are released when the room without them is short and with them suffices (a caller
        sees which by `in`), none otherwise. ValueError if `key` holds one already."""
        if key in self._held:
            raise ValueError(f"{key!r} holds a host range already")
        need = _up(nbytes)
        start = self._find(need) if not wait else self._make_room(need, spare)
        if start is None:
            return None
        self._free.cut(start, need)
        self._held[key] = (start, nbytes)
        return self.storage[start:start + nbytes]

    def _make_room(self, need: int, spare: Iterable[Hashable]) -> int | None:
        """Where `need` bytes fit once the spare keys, the finished copies back and a compaction
        made room (the CPU may wait for copies back), or None."""
        if self.room < need:
            spare = [k for k in spare if k in self._held]
            if self.room + sum(_up(self._held[k][1]) for k in spare) < need:
                return None
            for k in spare:
                self.release(k)
        start = self._find(need)
        if start is None and self._pending:  # copies back still reading released ranges: wait for them
            for event, _, _ in self._pending:
                event.synchronize()
            self._reclaim()
            start = self._find(need)
        if start is None and self._free.total() >= need:
            self.compact()
            start = self._find(need)
        return start

    def rename(self, key: Hashable, new: Hashable) -> None:
        """`key`'s range is held under `new` from now on (ValueError if `new` holds one)."""
        if new in self._held:
            raise ValueError(f"{new!r} holds a host range already")
        self._held[new] = self._held.pop(key)

    def view(self, key: Hashable) -> torch.Tensor:
        """`key`'s bytes (valid until it is released or the slab compacts: `on_move`)."""
        start, n = self._held[key]
        return self.storage[start:start + n]

    def release(self, key: Hashable, after: Any = None) -> bool:
        """Free `key`'s range (False if it held none): at once, or once event `after` completed
        (a copy still reading it)."""
        span = self._held.pop(key, None)
        if span is None:
            return False
        start, n = span
        if after is not None:
            self._pending.append((after, start, _up(n)))
        else:
            self._free.give(start, _up(n))
        return True

    def compact(self) -> None:
        """Slide every held range down to the slab's start, in address order (after `sync`; the
        released ranges' events waited for), leaving one free range; `on_move` hears each key moved."""
        self.sync()
        for event, _, _ in self._pending:
            event.synchronize()
        self._reclaim()
        cursor = 0
        moved = []
        for key, (start, n) in sorted(self._held.items(), key=lambda kv: kv[1][0]):
            if start != cursor:  # memmove: overlapping ranges, and no allocation that could fail
                base = self.storage.data_ptr()
                ctypes.memmove(base + cursor, base + start, n)
                self._held[key] = (cursor, n)
                moved.append(key)
            cursor += _up(n)
        self._free.reset_around([(0, cursor)])
        self.compactions += 1
        for key in moved:
            self.on_move(key)

    def check(self) -> None:
        """RuntimeError unless the held, pending and free ranges tile the slab exactly once."""
        self._free.check_tiles([(s, _up(n)) for s, n in self._held.values()]
                               + [(s, n) for _, s, n in self._pending], "host slab ranges (bytes)")

    # ---- ranges -------------------------------------------------------------------

    def _find(self, need: int) -> int | None:
        if self._pending:  # ranges whose copies back completed are free again
            self._reclaim()
        return self._free.find(need)

    def _reclaim(self) -> None:
        keep = []
        for event, start, n in self._pending:
            if event.query():
                self._free.give(start, n)
            else:
                keep.append((event, start, n))
        self._pending = keep


def host_slab_for(host_budget_bytes: int, device: torch.device) -> HostSlab | None:
    """The host tier's slab for rows of a pool on `device`: `host_budget_bytes` page-locked once
    where the pool is on a GPU (its `sync` waits for the device); None on the CPU (host copies are
    plain tensors there) or without a host budget."""
    if device.type != "cuda" or host_budget_bytes <= 0:
        return None
    return HostSlab(host_budget_bytes, True, lambda: torch.cuda.synchronize(device))
