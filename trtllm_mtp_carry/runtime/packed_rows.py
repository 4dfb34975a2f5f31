"""The reference runtime's carried entries in the packed formats (fp8, nvfp4): rows held outside the pool.

What it is for: an entry in a packed format (`carry_row_dtype` fp8 or nvfp4)
costs its rows in that format (`dataplane/row_format.py`: e4m3 payload, one
float32 scale per row, K/V and head; `dataplane/nvfp4.py`: e2m1 pairs, e4m3
block scales, a global scale), about half or under a third of its bf16 blocks,
so it cannot stay in the drafter pool's blocks. At deposit its live rows are packed out of its blocks and the blocks
are freed; on adoption they are unpacked straight into fresh pool blocks
(`DrafterKVPool.carry_in` hands out their ids, `codec.scatter_blocks` writes
them: one launch on CUDA), which the adopter then
takes as a carried entry's (zero copy). The format is the entry's codec
(`dataplane/row_codec.py`: `gather_blocks` packs, `scatter_blocks` unpacks),
so any codec's rows can be held here (`residence.PackedResidence`)::

    finish:  pool blocks --codec.gather_blocks--> PackedEntry (device)   blocks freed
    adopt:   PackedEntry --carry_in, codec.scatter_blocks--> fresh pool blocks --adopt_carried--> sequence
    host tier (HostMoves): PackedEntry device <--> host memory (pinned on CUDA), still packed

Host memory: on CUDA the host copies are ranges of one `HostSlab`
of exactly the host budget, page-locked once (`dataplane/host_slab.py`), so the pinned
bytes held (`pinned_nbytes`) are the budget's; a demotion may reuse the ranges of the
host victims the store names first (`make_room`). Every write into the slab is a
blocking copy (or follows a device sync: a compaction), and a range a copy back
read is reused only once an event recorded after that copy completed.

Invariants:
- A key has at most one packed copy, on the device or in host memory; the
  carry store's entries of each tier are exactly these copies (`CarryRuntime.check`).
- An entry's bytes are `codec.nbytes(rows)` (payload plus scales), what the
  store charges (`RowFormat.nbytes(rows)`).
- Unpacked rows and keys are the packed ones: `unpack(pack(rows))` is within
  the format's rounding of the rows, and deterministic.
- No block another owner holds is written: `carry_in` hands out fresh blocks only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..core import CarriedDrafter
from ..dataplane.host_slab import HostSlab, host_slab_for
from ..dataplane.kv_pool import CarriedBlocks, DrafterKVPool
from ..dataplane.row_codec import RowCodec, Rows


@dataclass(frozen=True)
class PackedEntry:
    """One carried entry's rows `[rows, 2, Hkv, D]` held in `codec`'s form, and its keys as runs."""

    packed: Rows
    runs: tuple[tuple[int, int], ...]
    codec: RowCodec

    @property
    def rows(self) -> int:
        return int(self.packed.shape[0])

    @property
    def nbytes(self) -> int:
        return self.codec.nbytes(self.packed)


class PackedCarry:
    """Packed entries keyed by carry key (device and host copies); the store's `HostMoves` for them.

    `pack_ms_each`/`unpack_ms_each` are the wall time of every pack and unpack (on CUDA, of
    their launch and the copies that wait on them).
    """

    def __init__(self, pool: DrafterKVPool, codec: RowCodec, host_budget_bytes: int = 0,
                 slab: HostSlab | None = None) -> None:
        self.pool = pool
        self.codec = codec
        self._device: dict[int, PackedEntry] = {}
        self._host: dict[int, PackedEntry] = {}
        self._pin = pool.device.type == "cuda"
        # the host copies' memory: the budget page-locked once on CUDA (None on the CPU)
        self.slab = slab if slab is not None else host_slab_for(host_budget_bytes, pool.device)
        if self.slab is not None:
            self.slab.on_move = self._moved
        self._room: list[int] = []  # host keys the store drops if the demotion in progress copies
        self.pack_ms_each: list[float] = []  # wall ms of every pack, in order
        self.unpack_ms_each: list[float] = []  # wall ms of every unpack, in order

    def keys(self) -> list[int]:
        """Keys of the device copies, sorted."""
        return sorted(self._device)

    def host_keys(self) -> list[int]:
        """Keys of the host copies, sorted."""
        return sorted(self._host)

    @property
    def pinned_nbytes(self) -> int:
        """Page-locked bytes the host tier holds: its slab, the host budget exactly (0 on the CPU)."""
        return self.slab.nbytes if self.slab is not None and self.slab.pinned else 0

    def nbytes(self, tier: str) -> int:
        """Bytes of the copies held in `tier` (`device` or `host`)."""
        return sum(e.nbytes for e in (self._device if tier == "device" else self._host).values())

    def get(self, key: int) -> PackedEntry | None:
        """`key`'s packed copy, on the device or the host, or None."""
        return self._device.get(key) or self._host.get(key)

    def pack(self, key: int) -> PackedEntry:
        """Pack the pool's carried entry `key` and free its blocks; the packed copy is on the device."""
        t0 = time.perf_counter()
        held = self.pool.carried(key)
        if held is None:
            raise RuntimeError(f"nothing carried under {key}: nothing to pack")
        entry = PackedEntry(self.codec.gather_blocks(self.pool.k_cache, self.pool.v_cache, held.block_table,
                                                     held.rows),
                            self.pool.carried_runs(key), self.codec)
        self.pool.free_carried(key)
        self._device[key] = entry
        self.pack_ms_each.append((time.perf_counter() - t0) * 1e3)
        return entry

    def unpack(self, key: int) -> CarriedBlocks:
        """Unpack `key`'s device copy into fresh pool blocks, carried there under `key` (the copy
        is freed); PoolExhaustedError leaves the copy in place."""
        t0 = time.perf_counter()
        entry, pool = self._device[key], self.pool
        if self.codec.pool_dtype != pool.k_cache.dtype:
            raise ValueError(f"a {self.codec!r} cannot write this pool's {pool.k_cache.dtype} blocks")
        self.codec.check_fits(entry.packed, pool.num_kv_heads, pool.head_dim)
        ids = pool.carry_in(key, entry.rows, entry.runs)  # fresh blocks, carried under `key`
        try:
            self.codec.scatter_blocks(entry.packed, pool.k_cache, pool.v_cache, ids)  # unpacked into them
        except BaseException:
            pool.free_carried(key)
            raise
        held = pool.carried(key)
        assert held is not None
        del self._device[key]
        self.unpack_ms_each.append((time.perf_counter() - t0) * 1e3)
        return held

    def discard(self, key: int) -> None:
        """Free `key`'s device copy (it left the store from the device tier)."""
        self._device.pop(key, None)

    def forget(self, key: int, tier: str) -> None:
        """Free `key`'s copy in `tier` (`device` or `host`): a fault left it without a store entry."""
        (self._device if tier == "device" else self._host).pop(key, None)
        if tier == "host" and self.slab is not None:
            self.slab.release(key)

    # ---- HostMoves: the packed form between the device and host memory ------------------

    def make_room(self, victims: list[CarriedDrafter]) -> None:
        """The store drops `victims` (host entries) if the next `demote` copies: it may use their
        slab ranges (they are dropped right after it; untouched when it returns False)."""
        self._room = [e.session_hash for e in victims]

    def demote(self, entry: CarriedDrafter) -> bool:
        key = entry.session_hash
        room, self._room = self._room, []
        packed = self._device.get(key)
        if packed is None:
            return False
        if self.slab is not None:  # one blocking pass into the pinned slab
            raw = self.slab.take(key, packed.nbytes, [k for k in room if k in self._host])
            if raw is None:  # more than the host budget holds
                return False
            for k in room:
                if k not in self.slab:
                    self._host.pop(k, None)  # its range went to this copy: the store drops it next
            host = self.codec.view(raw, tuple(packed.packed.shape))
            self.codec.copy_(host, packed.packed)
        elif self._pin:  # a GPU without a slab: memory page-locked for exactly the copy's bytes
            host = self.codec.host_copy(packed.packed)
        else:  # a CPU pool's copy is host memory already
            host = packed.packed
        del self._device[key]
        self._host[key] = PackedEntry(host, packed.runs, self.codec)
        return True

    def restore(self, entry: CarriedDrafter) -> None:
        key = entry.session_hash
        packed = self._host.pop(key)
        # from pinned memory on the current stream, without the CPU waiting, when the slab holds
        # it: the unpack that reads it (`unpack`, on the same stream) is ordered after it, and so
        # is any later write into its range (its event); a copy outside a slab is
        # freed with its last reference, so that copy waits
        self._device[key] = PackedEntry(
            self.codec.to(packed.packed, self.pool.device, non_blocking=self.slab is not None),
            packed.runs, self.codec)
        if self.slab is not None:  # reused once the copy back read it (an event on its stream)
            self.slab.release(key, _copied(self.pool.device) if self._pin else None)

    def drop(self, entry: CarriedDrafter) -> None:
        self._host.pop(entry.session_hash, None)
        if self.slab is not None:
            self.slab.release(entry.session_hash)

    def _moved(self, key: object) -> None:
        """The slab compacted: view `key`'s host copy where its bytes are now."""
        assert self.slab is not None and isinstance(key, int)
        e = self._host[key]
        self._host[key] = PackedEntry(self.codec.view(self.slab.view(key), tuple(e.packed.shape)), e.runs,
                                      self.codec)


def _copied(device: torch.device) -> torch.cuda.Event:
    """An event on `device`'s current stream after the copies queued so far (the CUDA seam)."""
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    return done
