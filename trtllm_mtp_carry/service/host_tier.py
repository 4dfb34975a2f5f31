"""The carry's one host tier: carried entries' bytes in host memory, for whichever device home.

What it is for: the carry store (`CarryStore(host_budget_bytes=...)`) decides which entry
leaves the device budget for the host tier and which comes back; this is the half that
moves the bytes (the store's `HostMoves`). Every host copy is a range of one `Arena` of
exactly the host budget (page-locked once where the rows are on a GPU; on GB10's unified
memory that is system memory outside any KV pool). The device home says what an entry's
bytes are (`export_nbytes`, `export_into`: a pool's whole blocks, or an arena extent in its
codec's form) and takes them back (`import_from`); the tier never interprets them:

    demote:   home.export_into(key, host range) --> home.free(key)
    restore:  home.import_from(key, host range, stream) --> the home holds the rows again
    drop:     the host range is released

Pool pressure (a home whose executor can reclaim its rows, the reference engine's pool):
the pool releases a victim's blocks before the store hears, so the service `stage`s a copy
of the victim first and `demote` uses it. A staged copy taken while the arena is full is
held in memory of exactly its bytes (page-locked on a GPU) and moved in once a range frees.

On CUDA the copy back is asynchronous: issued on a side stream after the current stream's
work so far, an event recorded after it; the reader's stream waits for it on the GPU
(`ready`, the CPU never blocks), or at once when a fault frees restored rows (`settle`: the
CPU waits, so the rows' next owner writes after the copy). The host range is reused only
once that event completed. On the CPU every copy is synchronous.

Invariants:
- A key has at most one host copy; `demote` makes it, `restore` and `drop` end it.
- Restored bytes are the demoted bytes (the home's form, whole).
- The store's host entries are exactly the host copies held (`check`).
- Nothing is held once every entry left and every copy back completed (`idle`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..core import CarriedDrafter, CarryStore
from ..dataplane import streams
from ..dataplane.arena import Allocate, Arena, torch_allocate
from ..dataplane.pinned import pinned_empty
from .homes import RowHome

__all__ = ["HostTier", "host_arena"]


def host_arena(nbytes: int, device: torch.device, allocate: Allocate = torch_allocate) -> Arena | None:
    """The host tier's memory for rows of a pool on `device`: `nbytes` reserved once, page-locked
    where the pool is on a GPU (its `sync` waits for that device); None without a host budget."""
    if nbytes <= 0:
        return None
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    return Arena.reserve(nbytes, "cpu", pinned=cuda, allocate=allocate, sync=sync)


@dataclass
class _Copy:
    """One host copy: its form (the home's) and whether its bytes live outside the arena."""

    form: Any
    outside: torch.Tensor | None = None  # staged while the arena was full: exactly its bytes


@dataclass
class _Restore:
    """An asynchronous copy back (CUDA): its done event, and the reader's wait point."""

    done: torch.cuda.Event
    need: torch.cuda.Event | None = None
    source: torch.Tensor | None = None  # bytes outside the arena: kept alive until the copy read them


class HostTier:
    """Host copies of carried entries by carry key, in one `Arena`; the store's `HostMoves`."""

    def __init__(self, home: RowHome, arena: Arena) -> None:
        self.home = home
        self.arena = arena
        self._cuda = home.device.type == "cuda"
        self._held: dict[int, _Copy] = {}
        self._staged: dict[int, _Copy] = {}  # pressure victims, copied before the pool releases them
        self._room: list[int] = []  # host keys the store drops if the demotion in progress copies
        self._stream = streams.side_stream(home.device) if self._cuda else None
        self._inflight: dict[int, _Restore] = {}  # key -> its copy back, until `ready` or `settle`
        self._waiting: list[_Restore] = []  # read, their times not taken yet
        self.wait_ms = 0.0
        self.waits = 0  # copies still running when their reader first needed them

    # ---- what the service reads ------------------------------------------------------

    @property
    def host_bytes(self) -> int:
        """Bytes of the host copies held (the host tier's rows)."""
        return sum(self._nbytes(k) for k in self._held)

    @property
    def pinned_bytes(self) -> int:
        """Page-locked bytes the tier holds: its arena (the budget, exactly) and any copy held
        outside it; 0 without page-locked memory (the CPU)."""
        if not self.arena.pinned:
            return 0
        outside = [c.outside for c in (*self._held.values(), *self._staged.values()) if c.outside is not None]
        return self.arena.nbytes + sum(t.numel() for t in outside)

    def keys(self) -> list[int]:
        """Keys of the host copies held, sorted."""
        return sorted(self._held)

    def outside_keys(self) -> list[int]:
        """Keys of host copies held outside the arena (staged while it was full), sorted."""
        return sorted(k for k, c in self._held.items() if c.outside is not None)

    def in_flight(self) -> list[int]:
        """Keys whose copy back is in flight (restored; `ready` or `settle` not called yet), sorted."""
        return sorted(self._inflight)

    def idle(self) -> bool:
        """Nothing held, staged or in flight, and the arena holds no range."""
        return not (self._held or self._staged or self._inflight) and not self.arena.keys()

    # ---- HostMoves (the store calls these under the service's lock) --------------------

    def make_room(self, victims: list[CarriedDrafter]) -> None:
        """The store drops `victims` (host entries) if the next `demote` copies: it may use their
        ranges (they are dropped right after it; untouched when it returns False)."""
        self._room = [e.session_hash for e in victims]

    def demote(self, entry: CarriedDrafter) -> bool:
        """Copy `entry`'s device rows to a host range (a staged copy if the pool released them
        already) and free them on the device; False when the host budget cannot hold them."""
        key = entry.session_hash
        room, self._room = self._room, []
        staged = self._staged.pop(key, None)
        if staged is not None:  # a pressure victim: its device rows are gone already
            if ("staged", key) in self.arena:
                self.arena.rename(("staged", key), key)
            self._held[key] = staged
            return True
        spare = [k for k in room if k in self.arena]
        raw = self.arena.take(key, self.home.export_nbytes(key), spare)
        for k in spare:
            if raw is not None and k not in self.arena:
                self._held.pop(k, None)  # its range went to this copy: the store drops it next
        if raw is None:
            return False
        try:
            form = self.home.export_into(key, raw)
        except BaseException:
            self.arena.release(key)
            raise
        self._held[key] = _Copy(form)
        self.home.free(key)
        return True

    def restore(self, entry: CarriedDrafter) -> CarriedDrafter:
        """Copy `entry`'s rows back to the device (asynchronously on CUDA: `ready` orders the
        reader after it); the host range is reused once the copy read it. Returns the entry as
        the device holds it again (its fresh blocks, in a pool)."""
        key = entry.session_hash
        copy = self._held.pop(key)
        raw = copy.outside if copy.outside is not None else self.arena.view(key)
        try:
            blocks = self.home.import_from(key, raw, copy.form, self._stream)
        except BaseException:  # nothing reads the range now (a failed import waited for its copies)
            self.arena.release(key)
            raise
        if self._stream is None:
            self.arena.release(key)
        else:
            done = streams.timing_event()
            done.record(self._stream)
            restore = _Restore(done)
            self._inflight[key] = restore
            if not self.arena.release(key, done):  # bytes outside the arena: alive until read
                restore.source = copy.outside
        self._move_in()
        return entry if blocks is None else entry.with_block_table(blocks)

    def drop(self, entry: CarriedDrafter) -> None:
        """Free `entry`'s host copy (it left the store from the host tier)."""
        self.forget(entry.session_hash)

    # ---- the service's side ------------------------------------------------------------

    def stage(self, key: int) -> None:
        """Copy `key`'s device rows to host memory now: the pool is about to release them for
        pressure (into the arena when it has room; else memory of exactly their bytes)."""
        if key in self._staged:
            return
        nbytes = self.home.export_nbytes(key)
        raw = self.arena.take(("staged", key), nbytes)
        outside = None
        if raw is None:
            raw = outside = pinned_empty(nbytes) if self.arena.pinned else torch.empty(nbytes, dtype=torch.uint8)
        self._staged[key] = _Copy(self.home.export_into(key, raw), outside)

    def stage_bytes(self, key: int, raw: torch.Tensor, form: Any) -> None:
        """Stage `raw` (an entry's held bytes of `form`, received from another worker) as `key`'s
        copy: the store's next demotion of `key` (its host tier's second chance) takes it."""
        room = self.arena.take(("staged", key), raw.numel())
        outside = None
        if room is None:
            room = outside = pinned_empty(raw.numel()) if self.arena.pinned else torch.empty_like(raw)
        room.copy_(raw)
        self._staged[key] = _Copy(form, outside)

    def copy_of(self, key: int) -> tuple[torch.Tensor, Any]:
        """A fresh host copy of `key`'s held bytes, and their key runs (entry moves)."""
        copy = self._held[key]
        raw = copy.outside if copy.outside is not None else self.arena.view(key)
        return raw.clone(), self.home.runs_of(copy.form)

    def unstage(self, key: int) -> None:
        """Forget a staged copy the store did not demote (it evicted the entry instead)."""
        if self._staged.pop(key, None) is not None:
            self.arena.release(("staged", key))

    def forget(self, key: int) -> None:
        """Free `key`'s host copy and any staged copy (it left the store, or a fault lost it)."""
        if self._held.pop(key, None) is not None:
            self.arena.release(key)
        self.unstage(key)
        self._move_in()

    def ready(self, key: int) -> None:
        """The reader of `key`'s restored rows is about to use them: order the current stream
        after their copy back (a GPU-side wait; nothing to do on the CPU or when none is in flight)."""
        copy = self._inflight.pop(key, None)
        if copy is None:
            return
        stream = streams.current_stream(self.home.device)
        if not copy.done.query():
            self.waits += 1
        copy.need = streams.timing_event()
        copy.need.record(stream)
        stream.wait_event(copy.done)
        self._waiting.append(copy)

    def settle(self, key: int) -> None:
        """`key`'s restored rows are about to be freed unread (a fault): the CPU waits for their
        copy back, if one is in flight, so their next owner writes after it."""
        copy = self._inflight.pop(key, None)
        if copy is not None:
            copy.done.synchronize()

    def gpu_wait_ms(self) -> float:
        """How long readers' streams waited for copies back, over the copies whose events completed
        (CUDA; 0 on the CPU)."""
        keep = []
        for copy in self._waiting:
            assert copy.need is not None
            if copy.done.query() and copy.need.query():
                self.wait_ms += max(0.0, copy.need.elapsed_time(copy.done))
            else:
                keep.append(copy)
        self._waiting = keep
        self._move_in()
        return self.wait_ms

    def check(self, store: CarryStore) -> None:
        """RuntimeError unless the store's host entries are exactly the host copies, each of its
        rows, and the arena's ranges tile it."""
        host = {e.session_hash: e for e in store.host_entries}
        if sorted(host) != self.keys():
            raise RuntimeError(f"host tier entries {sorted(host)} differ from the host copies held {self.keys()}")
        for key, e in host.items():
            rows = self.home.rows_of(self._held[key].form)
            if rows != e.rows:
                raise RuntimeError(f"host entry 0x{key:016x} has {e.rows} rows, its host copy {rows}")
        self.arena.check()

    def repair(self, store: CarryStore, live: set[int]) -> None:
        """After a fault: copies back no live turn waits for end before their rows are freed; host
        entries without a copy leave the store (`fault`); copies without an entry are freed."""
        for k in set(self._inflight).difference(live):
            self.settle(k)
        host = {e.session_hash for e in store.host_entries}
        for k in host.difference(self._held):
            store.discard(k, "fault")
        for k in (set(self._held) - host) | set(self._staged):
            self.forget(k)

    # ---- the arena -------------------------------------------------------------------

    def _nbytes(self, key: int) -> int:
        copy = self._held[key]
        return copy.outside.numel() if copy.outside is not None else self.arena.view(key).numel()

    def _move_in(self) -> None:
        """Move host copies held outside the arena into it where a range is free now (the CPU waits
        for the device once, for the staged exports, when one moves; never for a copy back)."""
        synced = False
        for key in sorted(k for k, c in self._held.items() if c.outside is not None):
            copy = self._held[key]
            assert copy.outside is not None
            raw = self.arena.take(key, copy.outside.numel(), wait=False)
            if raw is None:
                continue
            if not synced:  # the staged export may still be writing it
                self.arena.sync()
                synced = True
            raw.copy_(copy.outside)
            self._held[key] = _Copy(copy.form)
