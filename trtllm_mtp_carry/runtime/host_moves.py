"""The reference runtime's host tier moves: carried rows between the drafter pool and host memory.

What it is for: the carry store (`CarryStore(host_budget_bytes=...)`) decides
which entry leaves the device budget for the host tier and which comes back;
this is the executor half (`HostMoves`): `demote` copies an entry's blocks to
host tensors (`DrafterKVPool.export_carried`: pinned memory on CUDA, plain CPU
memory otherwise; on GB10's unified memory that is system memory outside any
KV pool) and frees its pool blocks; `restore` copies them back into fresh
blocks (`import_carried`) before the adopting turn reads them; `drop` frees a
host copy that left the store.

Pool pressure: a grow releases its victim's blocks before the store hears of
it, so the runtime `stage`s a copy of the victim the pool is about to release
(it names the victim, `pool.victim`) and `demote` uses that copy.

Host memory (issue 42 item 6): on CUDA every host copy is a range of one
`HostSlab` of exactly the host budget, page-locked once when the runtime is
built (`dataplane/host_slab.py`; torch's pinned allocator rounded each copy up
to a power of two and kept freed blocks pinned): the pinned bytes held
(`pinned_nbytes`) are the budget's. The store drops a demotion's host victims
only after the copy is made, so it names them first (`make_room`) and the copy
may take their ranges. A pressure victim staged while the slab is full is held
in memory registered for exactly its bytes until its demotion moves it into the
slab (a CPU copy after the device synchronized). On the CPU host copies are
plain tensors (no slab) unless one is given.

On CUDA the copy back is asynchronous: issued on a side stream (after the
current stream's work, since the fresh blocks may still be read by kernels
queued before), with an event the current stream waits on (on the GPU, the
CPU never blocks) before the adopting sequence's first pool access
(`ready`), or at once when the adoption truncates restored blocks back to the
free list (their next owner must write after the copy). Timing events give how long the current stream waited for it
(`gpu_wait`, read once both completed). On the CPU the copy is synchronous:
the store's `restore_ms` is the copy.

Invariants:
- A key has at most one host copy; `demote` holds it, `restore` and `drop` free it.
- A restored entry's rows and keys equal the demoted ones (whole blocks are copied).
- No block another owner holds is written: `import_carried` writes fresh blocks only.
- On CUDA with a host budget, every host copy is in the slab except a staged one waiting
  for room; a slab range a copy back reads is reused only after that copy's event.
- No restored block is freed while its copy back may run: a fault that frees restored rows
  `settle`s them first (the CPU waits for the copy; the in-flight record goes with it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core import CarriedDrafter
from ..dataplane.host_slab import HostSlab, host_slab_for
from ..dataplane.kv_pool import DrafterKVPool, HostRows
from ..dataplane.pinned import pinned_empty


@dataclass
class _Restore:
    """An asynchronous copy back (CUDA): its done event, and the current stream's wait point."""

    done: torch.cuda.Event
    need: torch.cuda.Event | None = None
    source: HostRows | None = None  # host rows outside the slab: kept alive until the copy read them


class PoolHostMoves:
    """`HostMoves` for a `DrafterKVPool`: host copies keyed by carry key."""

    def __init__(self, pool: DrafterKVPool, host_budget_bytes: int = 0, slab: HostSlab | None = None) -> None:
        self.pool = pool
        self._host: dict[int, HostRows] = {}
        self._staged: dict[int, HostRows] = {}  # pressure victims, copied before the pool releases them
        self._cuda = pool.device.type == "cuda"
        # the host copies' memory: the budget page-locked once on CUDA (None on the CPU: plain tensors)
        self.slab = slab if slab is not None else host_slab_for(host_budget_bytes, pool.device)
        if self.slab is not None:
            self.slab.on_move = self._moved
        self._room: list[int] = []  # host keys the store drops if the demotion in progress copies
        self._outside: set[int] = set()  # host copies outside the slab (staged while it was full)
        self._stream = _side_stream(pool.device) if self._cuda else None
        self._inflight: dict[int, _Restore] = {}  # carry key -> its copy back, until `ready`
        self._waiting: list[_Restore] = []  # ready, their times not read yet
        self.wait_gpu_ms = 0.0
        self.waits = 0  # copies still running when the adopter first needed its rows

    @property
    def host_bytes(self) -> int:
        """Bytes of host copies held (the host tier's rows)."""
        return sum(r.nbytes for r in self._host.values())

    @property
    def pinned_nbytes(self) -> int:
        """Page-locked bytes the host tier holds: its slab (the host budget, exactly) and any copy
        outside it (staged while it was full: exactly its bytes); 0 without a pinned slab (the CPU)."""
        if self.slab is None or not self.slab.pinned:
            return 0
        slab = self.slab.nbytes
        staged = [r for k, r in self._staged.items() if self.slab is None or ("staged", k) not in self.slab]
        return slab + sum(r.nbytes for r in staged) + sum(self._host[k].nbytes for k in self._outside)

    def __contains__(self, key: object) -> bool:
        return key in self._host

    def keys(self) -> list[int]:
        """Keys of the host copies held, sorted."""
        return sorted(self._host)

    # ---- HostMoves -----------------------------------------------------------

    def make_room(self, victims: list[CarriedDrafter]) -> None:
        """The store drops `victims` (host entries) if the next `demote` copies: it may use their
        host memory (they are dropped right after it; untouched when it returns False)."""
        self._room = [e.session_hash for e in victims]

    def demote(self, entry: CarriedDrafter) -> bool:
        key = entry.session_hash
        room, self._room = self._room, []
        staged = self._staged.pop(key, None)
        if staged is not None:  # a pressure victim: the pool released its blocks already
            self._host[key] = staged
            if self.slab is not None:
                if ("staged", key) in self.slab:
                    self.slab.rename(("staged", key), ("host", key))
                else:  # staged while the slab was full (a range a copy back still reads, or the
                    self._outside.add(key)  # victims'): moved in once a range is free
            return True
        if self.pool.carried(key) is None:
            return False
        out = None
        if self.slab is not None:
            out = self._take(key, self.pool.export_nbytes(key), room)
            if out is None:  # more than the host budget holds (the store's price is the same bytes)
                return False
        self._host[key] = self.pool.export_carried(key, out)
        self.pool.free_carried(key)
        return True

    def restore(self, entry: CarriedDrafter) -> CarriedDrafter:
        key = entry.session_hash
        rows = self._host.pop(key)
        try:
            held = self.pool.import_carried(key, rows, self._stream)
        except BaseException:  # nothing reads the range now (a failed import waited for its copies)
            self._release(key)
            raise
        if self._stream is not None:  # the copy runs on the side stream: `ready` orders its use
            copy = _Restore(_timing_event())
            copy.done.record(self._stream)
            self._inflight[key] = copy
            if not self._release(key, copy.done):  # host rows of their own: alive until read
                copy.source = rows
        else:
            self._release(key)
        self._move_in()
        return entry.with_block_table(held.block_table)

    def drop(self, entry: CarriedDrafter) -> None:
        self._host.pop(entry.session_hash, None)
        self._release(entry.session_hash)
        self._move_in()

    # ---- the runtime's side --------------------------------------------------

    def stage(self, key: int) -> None:
        """Copy `key`'s rows to host memory now: the pool is about to release them for pressure
        (into the slab when it has room; else memory of exactly their bytes until `demote`)."""
        if key not in self._staged and self.pool.carried(key) is not None:
            out = None
            if self.slab is not None:
                nbytes = self.pool.export_nbytes(key)
                out = self.slab.take(("staged", key), nbytes)
                if out is None and self.slab.pinned:  # full: pinned for exactly its bytes, moved in later
                    out = pinned_empty(nbytes)
            self._staged[key] = self.pool.export_carried(key, out)

    def unstage(self, key: int) -> None:
        """Forget a staged copy the store did not demote (it evicted the entry instead)."""
        self._staged.pop(key, None)
        if self.slab is not None:
            self.slab.release(("staged", key))

    def forget(self, key: int) -> None:
        """Free `key`'s host copy and any staged copy (a fault: the store no longer holds the entry)."""
        self._host.pop(key, None)
        self._release(key)
        self.unstage(key)
        self._move_in()

    def staged_keys(self) -> list[int]:
        """Keys of the staged copies, sorted (empty between pool grows)."""
        return sorted(self._staged)

    def ready(self, key: int) -> None:
        """The adopter of `key`'s restored rows is about to use them: order the current stream
        after their copy back (a GPU-side wait; nothing to do on the CPU or when none is in flight)."""
        copy = self._inflight.pop(key, None)
        if copy is None:
            return
        stream = _current_stream(self.pool.device)
        if not copy.done.query():
            self.waits += 1
        copy.need = _timing_event()
        copy.need.record(stream)
        stream.wait_event(copy.done)
        self._waiting.append(copy)

    # ---- the slab ------------------------------------------------------------

    def _take(self, key: int, nbytes: int, room: list[int]) -> torch.Tensor | None:
        """A slab range for `key`'s host copy, using the store's victims `room` if it must (their
        copies are dropped here then: the store drops their entries once the copy is made)."""
        assert self.slab is not None
        spare = [("host", k) for k in room if ("host", k) in self.slab]
        raw = self.slab.take(("host", key), nbytes, spare)
        for k in spare:
            if raw is not None and k not in self.slab:
                self._host.pop(k[1], None)
        return raw

    def _release(self, key: int, after: torch.cuda.Event | None = None) -> bool:
        """Free `key`'s slab range (after event `after`); False when it holds none."""
        self._outside.discard(key)
        return self.slab is not None and self.slab.release(("host", key), after)

    def _move_in(self) -> None:
        """Move host copies held outside the slab into it where a range is free now (the CPU never
        waits for a copy back; it waits for the device once, for their exports, when one moves)."""
        synced = False
        for key in sorted(self._outside):
            assert self.slab is not None
            rows = self._host[key]
            raw = self.slab.take(("host", key), rows.nbytes, wait=False)
            if raw is None:
                continue
            if not synced:  # the staged export may still be writing it
                self.slab.sync()
                synced = True
            half = raw.numel() // 2
            raw[:half].copy_(_bytes(rows.k))
            raw[half:].copy_(_bytes(rows.v))
            self._host[key] = _rows_in(raw, rows)
            self._outside.discard(key)

    def _moved(self, slab_key: object) -> None:
        """The slab compacted: view `slab_key`'s copy where its bytes are now."""
        assert self.slab is not None and isinstance(slab_key, tuple)
        kind, key = slab_key
        held = self._host if kind == "host" else self._staged
        held[key] = _rows_in(self.slab.view(slab_key), held[key])

    def settle(self, key: int) -> None:
        """`key`'s restored rows are about to be freed unread (a fault between the restore and
        `ready`): the CPU waits for their copy back, if one is in flight, and forgets it, so the
        blocks' next owner (on any stream) writes after it and no in-flight entry outlives them."""
        copy = self._inflight.pop(key, None)
        if copy is not None:
            copy.done.synchronize()

    def in_flight(self) -> list[int]:
        """Keys whose copy back is in flight (restored, `ready` or `settle` not called yet), sorted."""
        return sorted(self._inflight)

    def gpu_wait(self) -> tuple[float, int]:
        """(ms the current stream waited for copies back, copies still running when their adopter
        first needed them), over the restores whose events completed (CUDA; zeros on the CPU)."""
        keep = []
        for copy in self._waiting:
            assert copy.need is not None
            if copy.done.query() and copy.need.query():
                self.wait_gpu_ms += max(0.0, copy.need.elapsed_time(copy.done))
            else:
                keep.append(copy)
        self._waiting = keep
        if self._outside:
            self._move_in()
        return self.wait_gpu_ms, self.waits


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _rows_in(raw: torch.Tensor, like: HostRows) -> HostRows:
    """`like`'s rows viewed in `raw` (its K bytes, then its V bytes)."""
    half = raw.numel() // 2
    return HostRows(raw[:half].view(like.k.dtype).view(like.k.shape),
                    raw[half:].view(like.v.dtype).view(like.v.shape), like.rows, like.runs)


# ---- the copy back's CUDA calls (one seam: CPU tests put a recorder in their place) ----


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def _timing_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


def _current_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.current_stream(device)
