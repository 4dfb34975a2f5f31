"""One fixed allocation carved into byte ranges by key: the carry's device arena and its host tier.

What it is for: carried rows wait between turns in memory the carry reserves once,
never one allocation per entry. On the device that is bytes taken before TensorRT-LLM
sizes its KV cache, so the cache is sized around them (`trtllm/reservation.py`); on the
host it is the host tier's budget, page-locked once where a GPU reads it (torch's
pinned allocator would round each copy up to a power of two and keep freed blocks
page-locked; registering costs per call and per page, far more than a copy, so it stays
off the turn's path). An `Arena` hands out ranges of its storage by key: first fit over
the free spans (`core.FreeSpans`), merged on release; `compact` slides every range down
when the free bytes suffice but no free span is long enough::

    storage (uint8, capacity bytes):
    | key a: n_a bytes | free | key b: n_b bytes | released after event e | free |

Ranges start on `ALIGN` (4) bytes, so a codec's float32 scales viewed after its payload
stay aligned, and take their bytes rounded up to 4. Every carried row is a multiple of 4
bytes (bf16, fp8 and nvfp4 rows, a pool's whole blocks), so the ranges of whole entries
tile with no padding and whatever the carry store admits under a budget of `capacity`
bytes fits, after a compaction at worst.

Asynchronous users: a range released `after` an event (a copy or a scatter on another
stream still reading it) is reused only once the event completed (queried; waited for
when nothing else fits). `compact` first calls `sync` (the owner's: all device work that
may read or write the storage is done). Host storage moves with the CPU (`memmove`:
nothing is allocated, so a compaction never fails half way); device storage moves one
range at a time, staging a range through a clone only when its source and destination
overlap: an allocation failure there (`torch.OutOfMemoryError`) stops the compaction
with every range where its bytes are, and is raised. The owner hears each moved key
(`on_move`) and views it again.

Invariants:
- `nbytes` is the storage's size, never more: what is reserved (page-locked with `pinned`).
- Held, pending and free ranges tile `[0, capacity)` exactly once (`check`).
- A key holds at most one range; `view(key)` is exactly the bytes taken.
- Nothing is held once every key was released and every event completed (`held_bytes`
  and `pending_bytes` are 0): the owner's `check` proves a detached carry holds nothing.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import torch

from ..core.free_spans import FreeSpans
from .pinned import pinned_empty

__all__ = ["ALIGN", "Allocate", "Arena", "torch_allocate"]

ALIGN = 4

Allocate = Callable[[int, torch.device, bool], torch.Tensor]
"""`allocate(nbytes, device, pinned)`: a 1-D uint8 tensor of `nbytes` (raises `torch.OutOfMemoryError`)."""


def torch_allocate(nbytes: int, device: torch.device, pinned: bool) -> torch.Tensor:
    """An arena's storage: device memory from torch's allocator; host memory plain, page-locked
    for exactly `nbytes` where CUDA runs (`pinned.pinned_empty`)."""
    if device.type == "cpu":
        if pinned and torch.cuda.is_available():
            return pinned_empty(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Arena:
    """Byte ranges by key out of one 1-D uint8 `storage` (device or host) reserved once; `pinned`
    says the storage is page-locked host memory (what `reserve` was asked for)."""

    def __init__(self, storage: torch.Tensor, pinned: bool = False, sync: Callable[[], None] = lambda: None,
                 on_move: Callable[[Hashable], None] = lambda key: None) -> None:
        if storage.dtype != torch.uint8 or storage.dim() != 1:
            raise TypeError(f"storage must be a 1-D uint8 tensor, got {storage.dtype} {tuple(storage.shape)}")
        self.storage = storage
        self.pinned = pinned
        self.capacity = storage.numel() // ALIGN * ALIGN
        self.sync = sync
        self.on_move = on_move
        self._free = FreeSpans(self.capacity)
        self._held: dict[Hashable, tuple[int, int]] = {}  # key -> (start, bytes asked)
        self._pending: list[tuple[Any, int, int]] = []  # (event, start, length): reused once it completed
        self.compactions = 0

    @classmethod
    def reserve(cls, nbytes: int, device: torch.device | str, pinned: bool = False,
                allocate: Allocate = torch_allocate, sync: Callable[[], None] = lambda: None) -> Arena:
        """An arena of `nbytes` on `device` (host memory page-locked with `pinned`), from `allocate`.
        ValueError for a negative size; raises what `allocate` raises (`torch.OutOfMemoryError`)."""
        if type(nbytes) is not int or nbytes < 0:
            raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
        return cls(allocate(nbytes, torch.device(device), pinned), pinned, sync)

    @property
    def nbytes(self) -> int:
        """The bytes reserved (the storage's size)."""
        return self.storage.numel()

    @property
    def device(self) -> torch.device:
        return self.storage.device

    @property
    def held_bytes(self) -> int:
        """Bytes the held ranges were asked for."""
        return sum(n for _, n in self._held.values())

    @property
    def pending_bytes(self) -> int:
        """Bytes released after an event that has not been seen completed yet."""
        return sum(n for _, _, n in self._pending)

    @property
    def room(self) -> int:
        """Bytes a `take` may use without releasing anything: free, and released after an event."""
        return self._free.total() + self.pending_bytes

    def __contains__(self, key: object) -> bool:
        return key in self._held

    def keys(self) -> list[Hashable]:
        """The keys holding a range, in the order they took it."""
        return list(self._held)

    def take(self, key: Hashable, nbytes: int, spare: Iterable[Hashable] = (),
             wait: bool = True) -> torch.Tensor | None:
        """A range of exactly `nbytes` held under `key` (a 1-D uint8 view), or None when the arena
        cannot hold it (after reusing released ranges and compacting; without `wait`, only a free
        span or one whose event completed: the CPU never blocks). `spare`: held keys whose ranges
        may be released for it (a tier's victims, dropped if this copy is made): all of them are
        released when the room without them is short and with them suffices (a caller sees which
        by `in`), none otherwise. ValueError if `key` holds a range already. A device compaction's
        `torch.OutOfMemoryError` is raised with nothing taken."""
        if key in self._held:
            raise ValueError(f"{key!r} holds a range already")
        need = _up(nbytes)
        start = self._find(need) if not wait else self._make_room(need, spare)
        if start is None:
            return None
        self._free.cut(start, need)
        self._held[key] = (start, nbytes)
        return self.storage[start:start + nbytes]

    def view(self, key: Hashable) -> torch.Tensor:
        """`key`'s bytes (valid until it is released or the arena compacts: `on_move`)."""
        start, n = self._held[key]
        return self.storage[start:start + n]

    def rename(self, key: Hashable, new: Hashable) -> None:
        """`key`'s range is held under `new` from now on (ValueError if `new` holds one)."""
        if new in self._held:
            raise ValueError(f"{new!r} holds a range already")
        self._held[new] = self._held.pop(key)

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

    def clear(self) -> None:
        """Free every range at once (the storage stays reserved): its owner dropped everything."""
        self.settle()
        self._held.clear()
        self._free.reset_around([])

    def settle(self) -> None:
        """Wait for every event a released range waits on; their ranges are free afterwards."""
        for event, _, _ in self._pending:
            event.synchronize()
        self._reclaim()

    def compact(self) -> None:
        """Slide every held range down to the storage's start, in address order (after `sync`
        and `settle`), leaving one free span; `on_move` hears each key moved."""
        self.sync()
        self.settle()
        cursor = 0
        moved = []
        try:
            for key, (start, n) in sorted(self._held.items(), key=lambda kv: kv[1][0]):
                if start != cursor:
                    self._move(cursor, start, n)
                    self._held[key] = (cursor, n)
                    moved.append(key)
                cursor += _up(n)
        finally:
            self._free.reset_around([(s, _up(n)) for s, n in self._held.values()])
            self.compactions += 1
            for key in moved:
                self.on_move(key)

    def check(self) -> None:
        """RuntimeError unless the held, pending and free ranges tile the storage exactly once."""
        self._free.check_tiles([(s, _up(n)) for s, n in self._held.values()]
                               + [(s, n) for _, s, n in self._pending], "arena ranges (bytes)")

    # ---- ranges -------------------------------------------------------------------

    def _move(self, dst: int, src: int, n: int) -> None:
        """Copy `n` bytes from `src` down to `dst` (`dst < src`; they may overlap)."""
        if self.storage.device.type == "cpu":  # memmove: overlap-safe, allocates nothing
            base = self.storage.data_ptr()
            ctypes.memmove(base + dst, base + src, n)
            return
        source = self.storage[src:src + n]
        if src < dst + n:  # overlapping: stage this range (may raise torch.OutOfMemoryError)
            source = source.clone()
        self.storage[dst:dst + n].copy_(source)

    def _make_room(self, need: int, spare: Iterable[Hashable]) -> int | None:
        """Where `need` bytes fit once the spare keys, the completed events and a compaction made
        room (the CPU may wait for events), or None."""
        if self.room < need:
            spare = [k for k in spare if k in self._held]
            if self.room + sum(_up(self._held[k][1]) for k in spare) < need:
                return None
            for k in spare:
                self.release(k)
        start = self._find(need)
        if start is None and self._pending:  # ranges still read by queued work: wait for it
            self.settle()
            start = self._find(need)
        if start is None and self._free.total() >= need:
            self.compact()
            start = self._find(need)
        return start

    def _find(self, need: int) -> int | None:
        if self._pending:  # ranges whose events completed are free again
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
