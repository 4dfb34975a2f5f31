"""The reference runtime's packed carried entries (`carry_row_dtype` fp8): rows held outside the pool.

What it is for: an fp8 entry costs its rows in the FP8 row format
(`dataplane/row_format.py`: e4m3 payload, one float32 scale per row, K/V and
head), about half its bf16 blocks, so it cannot stay in the drafter pool's
blocks. At deposit its live rows are packed out of its blocks and the blocks
are freed; on adoption they are unpacked straight into fresh pool blocks
(`DrafterKVPool.import_rows`, one launch on CUDA), which the adopter then
takes as a carried entry's (zero copy). The format is the entry's codec
(`dataplane/row_codec.py`: `gather_blocks` packs, `scatter_blocks` unpacks),
so any codec's rows can be held here (`residence.PackedResidence`)::

    finish:  pool blocks --codec.gather_blocks--> PackedEntry (device)   blocks freed
    adopt:   PackedEntry --import_rows (codec.scatter_blocks)--> fresh pool blocks --adopt_carried--> sequence
    host tier (HostMoves): PackedEntry device <--> host memory (pinned on CUDA), still packed

Invariants:
- A key has at most one packed copy, on the device or in host memory; the
  carry store's entries of each tier are exactly these copies (`CarryRuntime.check`).
- An entry's bytes are `codec.nbytes(rows)` (fp8: payload plus scales), what the
  store charges (`RowFormat.nbytes(rows)`).
- Unpacked rows and keys are the packed ones: `unpack(pack(rows))` is within
  FP8's rounding of the rows, and deterministic.
- No block another owner holds is written: `import_rows` writes fresh blocks only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..core import CarriedDrafter
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

    def __init__(self, pool: DrafterKVPool, codec: RowCodec) -> None:
        self.pool = pool
        self.codec = codec
        self._device: dict[int, PackedEntry] = {}
        self._host: dict[int, PackedEntry] = {}
        self._pin = pool.device.type == "cuda"
        self.pack_ms_each: list[float] = []  # wall ms of every pack, in order
        self.unpack_ms_each: list[float] = []  # wall ms of every unpack, in order

    def keys(self) -> list[int]:
        """Keys of the device copies, sorted."""
        return sorted(self._device)

    def host_keys(self) -> list[int]:
        """Keys of the host copies, sorted."""
        return sorted(self._host)

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
        entry = self._device[key]
        held = self.pool.import_rows(key, self.codec, entry.packed, entry.runs)  # unpacked into fresh blocks
        del self._device[key]
        self.unpack_ms_each.append((time.perf_counter() - t0) * 1e3)
        return held

    def discard(self, key: int) -> None:
        """Free `key`'s device copy (it left the store from the device tier)."""
        self._device.pop(key, None)

    def forget(self, key: int, tier: str) -> None:
        """Free `key`'s copy in `tier` (`device` or `host`): a fault left it without a store entry."""
        (self._device if tier == "device" else self._host).pop(key, None)

    # ---- HostMoves: the packed form between the device and host memory ------------------

    def demote(self, entry: CarriedDrafter) -> bool:
        packed = self._device.pop(entry.session_hash, None)
        if packed is None:
            return False
        # on a GPU one pass into pinned memory; a CPU pool's popped copy is host memory already
        host = self.codec.host_copy(packed.packed) if self._pin else packed.packed
        self._host[entry.session_hash] = PackedEntry(host, packed.runs, self.codec)
        return True

    def restore(self, entry: CarriedDrafter) -> None:
        packed = self._host.pop(entry.session_hash)
        # from pinned memory on the current stream, without the CPU waiting: the unpack that
        # reads it (`unpack`, on the same stream) is ordered after it; the caching host
        # allocator keeps the pinned source until the copy is done
        self._device[entry.session_hash] = PackedEntry(
            self.codec.to(packed.packed, self.pool.device, non_blocking=True), packed.runs, self.codec)

    def drop(self, entry: CarriedDrafter) -> None:
        self._host.pop(entry.session_hash, None)
