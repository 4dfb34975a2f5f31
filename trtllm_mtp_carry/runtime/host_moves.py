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
- No restored block is freed while its copy back may run: a fault that frees restored rows
  `settle`s them first (the CPU waits for the copy; the in-flight record goes with it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core import CarriedDrafter
from ..dataplane.kv_pool import DrafterKVPool, HostRows


@dataclass
class _Restore:
    """An asynchronous copy back (CUDA): its done event, and the current stream's wait point."""

    done: torch.cuda.Event
    need: torch.cuda.Event | None = None


class PoolHostMoves:
    """`HostMoves` for a `DrafterKVPool`: host copies keyed by carry key."""

    def __init__(self, pool: DrafterKVPool) -> None:
        self.pool = pool
        self._host: dict[int, HostRows] = {}
        self._staged: dict[int, HostRows] = {}  # pressure victims, copied before the pool releases them
        self._cuda = pool.device.type == "cuda"
        self._stream = _side_stream(pool.device) if self._cuda else None
        self._inflight: dict[int, _Restore] = {}  # carry key -> its copy back, until `ready`
        self._waiting: list[_Restore] = []  # ready, their times not read yet
        self.wait_gpu_ms = 0.0
        self.waits = 0  # copies still running when the adopter first needed its rows

    @property
    def host_bytes(self) -> int:
        """Bytes of host copies held (the host tier's rows)."""
        return sum(r.nbytes for r in self._host.values())

    def __contains__(self, key: object) -> bool:
        return key in self._host

    def keys(self) -> list[int]:
        """Keys of the host copies held, sorted."""
        return sorted(self._host)

    # ---- HostMoves -----------------------------------------------------------

    def demote(self, entry: CarriedDrafter) -> bool:
        key = entry.session_hash
        staged = self._staged.pop(key, None)
        if staged is not None:  # a pressure victim: the pool released its blocks already
            self._host[key] = staged
            return True
        if self.pool.carried(key) is None:
            return False
        self._host[key] = self.pool.export_carried(key)
        self.pool.free_carried(key)
        return True

    def restore(self, entry: CarriedDrafter) -> CarriedDrafter:
        key = entry.session_hash
        rows = self._host.pop(key)
        held = self.pool.import_carried(key, rows, self._stream)
        if self._stream is not None:  # the copy runs on the side stream: `ready` orders its use
            copy = _Restore(_timing_event())
            copy.done.record(self._stream)
            self._inflight[key] = copy
        return entry.with_block_table(held.block_table)

    def drop(self, entry: CarriedDrafter) -> None:
        self._host.pop(entry.session_hash, None)

    # ---- the runtime's side --------------------------------------------------

    def stage(self, key: int) -> None:
        """Copy `key`'s rows to host memory now: the pool is about to release them for pressure."""
        if key not in self._staged and self.pool.carried(key) is not None:
            self._staged[key] = self.pool.export_carried(key)

    def unstage(self, key: int) -> None:
        """Forget a staged copy the store did not demote (it evicted the entry instead)."""
        self._staged.pop(key, None)

    def forget(self, key: int) -> None:
        """Free `key`'s host copy and any staged copy (a fault: the store no longer holds the entry)."""
        self._host.pop(key, None)
        self._staged.pop(key, None)

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
        return self.wait_gpu_ms, self.waits


# ---- the copy back's CUDA calls (one seam: CPU tests put a recorder in their place) ----


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def _timing_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


def _current_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.current_stream(device)
