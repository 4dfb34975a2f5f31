"""Where the reference runtime's carried rows reside between turns: one object, two kinds.

What it is for: `CarryRuntime` keeps the bookkeeping (the `CarryStore`) and asks
its residence every question about the rows themselves, instead of branching on
the row format at each site (issue 41 item 7):

    PoolResidence    rows stay in the drafter pool's blocks (zero copy), common-prefix
                     blocks shared between entries; charged by block; the host tier
                     (`PoolHostMoves`) copies whole blocks out and back.
    PackedResidence  rows leave the pool in a codec's held form (`dataplane/row_codec.py`:
                     fp8 packed today), their blocks freed; charged the codec's bytes
                     (`RowFormat`); unpacked into fresh blocks on adoption; the host tier
                     holds the same form (`PackedCarry`).

`residence_for(row_dtype, pool, host_budget)` picks one: `bf16` keeps rows in the
pool, any other format packs them out with `row_codec.codec_for(row_dtype, pool dtype)`.

Invariants (each kind's `check` proves them; tests/runtime/test_residence_contract.py
runs one suite over both):
- The store's entries of each tier are exactly the rows the residence holds there,
  of their rows and the bytes the store charges (`check`).
- `repair` makes them agree again after a fault, freeing what no entry holds, each once.
- A take moves the entry's rows into the adopting sequence (zero copy in the pool,
  one unpack out of it); a failed unpack loses the rows and ends the lease
  (`pool_pressure`), as a host restore that failed.
- Every call is made under the runtime's lock.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence, Set
from typing import Any

from ..core import CarriedDrafter, CarryStore
from ..core.row_format import RowFormat
from ..dataplane.kv_pool import CarriedBlocks, DrafterKVPool
from ..dataplane.row_codec import RowCodec, codec_for
from .host_moves import PoolHostMoves
from .packed_rows import PackedCarry

__all__ = ["PackedResidence", "PoolResidence", "Residence", "residence_for"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Residence(ABC):
    """Where carried rows live (see the module header): the runtime's one seam with them."""

    codec: RowCodec
    """The rows' format while carried."""
    shares: bool
    """Whether common-prefix blocks may be shared between entries (`carry_share`)."""

    def __init__(self, pool: DrafterKVPool) -> None:
        self.pool = pool

    # ---- what the store is told --------------------------------------------------

    @property
    @abstractmethod
    def block_nbytes(self) -> int | None:
        """The store's per-block charge (None: charged by `row_format`)."""

    @property
    @abstractmethod
    def row_format(self) -> RowFormat | None:
        """The store's row format (None: charged by block)."""

    @property
    @abstractmethod
    def host_moves(self) -> Any:
        """The store's `HostMoves` (None: no host tier)."""

    # ---- deposits ----------------------------------------------------------------

    @abstractmethod
    def charge(self, seq_id: int, rows: int) -> tuple[Sequence[int] | None, int]:
        """`(blocks, bytes)` the store charges `seq_id`'s `rows` rows (blocks: None when not in the pool)."""

    @abstractmethod
    def carry_out(self, seq_id: int, key: int, tokens: Sequence[int]) -> CarriedDrafter:
        """End `seq_id` as carried entry `key`: its rows move to where this residence holds them."""

    @abstractmethod
    def free(self, entry: CarriedDrafter) -> None:
        """Free the device rows of `entry`, which left the store from the device tier."""

    # ---- adoption -----------------------------------------------------------------

    @abstractmethod
    def comes_back(self, tier: str | None) -> bool:
        """Whether an entry in `tier` must come back into the pool's blocks on adoption."""

    @abstractmethod
    def blocks_needed(self, entry: CarriedDrafter) -> int:
        """Pool blocks `entry`'s rows take once back in the pool."""

    @abstractmethod
    def take(self, store: CarryStore, key: int, seq_id: int, rows_kept: int) -> CarriedBlocks:
        """Take `key` out of `store` and move its first `rows_kept` rows into sequence `seq_id`."""

    def ready(self, key: int) -> None:
        """The adopter of `key`'s rows is about to use them (a copy back may be in flight)."""
        return None  # by default nothing is in flight or staged

    def stage(self, key: int) -> None:
        """The pool is about to release `key`'s blocks for pressure (copy them first if needed)."""
        return None  # by default nothing is in flight or staged

    def unstage(self, key: int) -> None:
        """The store evicted `key` instead of demoting it: drop any staged copy."""
        return None  # by default nothing is in flight or staged

    def gpu_wait_ms(self) -> float:
        """How long the GPU waited for copies back (CUDA host tier; 0 elsewhere)."""
        return 0.0

    @property
    def pinned_nbytes(self) -> int:
        """Page-locked host bytes the host tier holds (its slab: the host budget exactly; 0 without
        one or on the CPU)."""
        moves = self.host_moves
        return 0 if moves is None else int(getattr(moves, "pinned_nbytes", 0))

    def pack_times(self) -> tuple[list[float], list[float]]:
        """Wall ms of every pack (deposit) and unpack (adoption); both empty when rows stay in the pool."""
        return [], []

    def stats_fields(self) -> dict[str, Any]:
        """`CarryStats` fields this residence fills (`packs`, `unpacks`, ...)."""
        return {}

    # ---- invariants ----------------------------------------------------------------

    @abstractmethod
    def held_nbytes(self) -> tuple[int, int]:
        """`(device, host)` bytes of carried rows this residence really holds (a shared block once):
        what the store charges each tier (`CarryStore.bytes_held`, `host_bytes_held`)."""

    @abstractmethod
    def check(self, store: CarryStore) -> None:
        """RuntimeError unless each tier's entries are exactly the rows held there."""

    def settle(self, key: int) -> None:
        """`key`'s restored rows are about to be freed unread (a fault): wait for a copy back still
        writing them, so their blocks' next owner writes after it (nothing in flight by default)."""
        return None

    @abstractmethod
    def repair(self, store: CarryStore, live: Set[int] = frozenset()) -> None:
        """After a fault: entries whose rows are gone or differ leave the store (`fault`); rows no
        entry holds are freed, each once, after any copy back into them ends (`live`: the keys live
        turns adopted, whose copies their turns still wait for)."""


class PoolResidence(Residence):
    """Rows stay in the drafter pool's blocks (`bf16`: as the pool holds them), shared by prefix;
    with a host budget, `PoolHostMoves` copies whole blocks to host memory and back."""

    shares = True

    def __init__(self, pool: DrafterKVPool, host_budget_bytes: int = 0) -> None:
        super().__init__(pool)
        self.codec = codec_for("bf16", pool.k_cache.dtype)
        self.moves = PoolHostMoves(pool, host_budget_bytes) if host_budget_bytes else None

    @property
    def block_nbytes(self) -> int | None:
        return self.pool.block_nbytes

    @property
    def row_format(self) -> RowFormat | None:
        return None

    @property
    def host_moves(self) -> Any:
        return self.moves

    def charge(self, seq_id: int, rows: int) -> tuple[Sequence[int] | None, int]:
        blocks = self.pool.sequence(seq_id).block_table[: _cdiv(rows, self.pool.block_size)]
        return blocks, len(blocks) * self.pool.block_nbytes

    def carry_out(self, seq_id: int, key: int, tokens: Sequence[int]) -> CarriedDrafter:
        carried = self.pool.move_to_carried(seq_id, key)  # zero copy
        return CarriedDrafter(carried.block_table, carried.rows, carried.last_pair_key, tokens, key)

    def free(self, entry: CarriedDrafter) -> None:
        self.pool.free_carried(entry.session_hash)

    def comes_back(self, tier: str | None) -> bool:
        return tier == "host"

    def blocks_needed(self, entry: CarriedDrafter) -> int:
        return len(entry.block_table)

    def take(self, store: CarryStore, key: int, seq_id: int, rows_kept: int) -> CarriedBlocks:
        if store.tier(key) == "host":  # the take copies its rows back first
            restored = store.take(key)
            held = self.pool.adopt_carried(key, seq_id, rows_kept=rows_kept)
            if self.moves is not None and len(held.block_table) < len(restored.block_table):
                # the truncation freed restored blocks: their next owner writes after the copy
                self.moves.ready(key)
            return held
        held = self.pool.adopt_carried(key, seq_id, rows_kept=rows_kept)
        store.take(key)
        return held

    def ready(self, key: int) -> None:
        if self.moves is not None:
            self.moves.ready(key)

    def stage(self, key: int) -> None:
        if self.moves is not None:
            self.moves.stage(key)

    def unstage(self, key: int) -> None:
        if self.moves is not None:
            self.moves.unstage(key)

    def gpu_wait_ms(self) -> float:
        return self.moves.gpu_wait()[0] if self.moves is not None else 0.0

    def held_nbytes(self) -> tuple[int, int]:
        blocks: set[int] = set()  # a shared block is held once
        for k in self.pool.carried_keys():
            held = self.pool.carried(k)
            assert held is not None
            blocks.update(held.block_table)
        return len(blocks) * self.pool.block_nbytes, 0 if self.moves is None else self.moves.host_bytes

    def check(self, store: CarryStore) -> None:
        entries = store.entries()
        keys = tuple(e.session_hash for e in entries)
        if keys != self.pool.carried_keys():
            raise RuntimeError(f"carry store keys {keys} differ from the pool's {self.pool.carried_keys()}")
        for e in entries:
            held = self.pool.carried(e.session_hash)
            if held is None or (held.block_table, held.rows, held.last_pair_key) != (
                e.block_table, e.rows, e.last_pair_key
            ):
                raise RuntimeError(f"carried entry 0x{e.session_hash:016x} differs from the pool's {held}")
        if self.moves is not None:  # the host tier: one host copy per host entry, nothing else
            host = sorted(e.session_hash for e in store.host_entries)
            copies = self.moves.keys()
            if host != copies:
                raise RuntimeError(f"host tier entries {host} differ from the host copies held {copies}")

    def settle(self, key: int) -> None:
        if self.moves is not None:
            self.moves.settle(key)

    def repair(self, store: CarryStore, live: Set[int] = frozenset()) -> None:
        if self.moves is not None:  # a fault between a restore and `ready`: the copy back ends
            for k in set(self.moves.in_flight()).difference(live):  # before its blocks are freed
                self.moves.settle(k)
        pool = self.pool
        entries = {e.session_hash: e for e in store.entries()}
        for k, e in entries.items():
            held = pool.carried(k)
            if held is None or (held.block_table, held.rows, held.last_pair_key) != (
                    e.block_table, e.rows, e.last_pair_key):
                store.discard(k, "fault")
                if held is not None:
                    pool.free_carried(k)
        for k in set(pool.carried_keys()).difference(entries):
            pool.free_carried(k)
        if self.moves is not None:
            host = {e.session_hash for e in store.host_entries}
            host_copies = set(self.moves.keys())
            for k in host.difference(host_copies):
                store.discard(k, "fault")
            for k in host_copies.difference(host) | set(self.moves.staged_keys()):
                self.moves.forget(k)


class PackedResidence(Residence):
    """Rows held out of the pool in `codec`'s form (`PackedCarry`, device and host copies): packed at
    deposit (blocks freed), unpacked into fresh blocks on adoption; no block sharing."""

    shares = False

    def __init__(self, pool: DrafterKVPool, codec: RowCodec, host_budget_bytes: int = 0) -> None:
        super().__init__(pool)
        self.codec = codec
        self.moves = PackedCarry(pool, codec, host_budget_bytes)

    @property
    def block_nbytes(self) -> int | None:
        return None

    @property
    def row_format(self) -> RowFormat | None:
        return self.codec.format(self.pool.num_kv_heads, self.pool.head_dim)

    @property
    def host_moves(self) -> Any:
        return self.moves

    def charge(self, seq_id: int, rows: int) -> tuple[Sequence[int] | None, int]:
        fmt = self.row_format
        assert fmt is not None
        return None, fmt.nbytes(rows)  # the held rows, which share no blocks

    def carry_out(self, seq_id: int, key: int, tokens: Sequence[int]) -> CarriedDrafter:
        carried = self.pool.move_to_carried(seq_id, key)
        self.moves.pack(key)  # out of the blocks, which are freed
        return CarriedDrafter((), carried.rows, carried.last_pair_key, tokens, key)

    def free(self, entry: CarriedDrafter) -> None:
        self.moves.discard(entry.session_hash)

    def comes_back(self, tier: str | None) -> bool:
        return tier is not None

    def blocks_needed(self, entry: CarriedDrafter) -> int:
        return _cdiv(entry.rows, self.pool.block_size)

    def take(self, store: CarryStore, key: int, seq_id: int, rows_kept: int) -> CarriedBlocks:
        store.take(key)  # a host entry comes back in the held form first (`restore`)
        try:
            self.moves.unpack(key)
        except BaseException:  # the rows never came back: gone, as a host restore that failed
            self.moves.discard(key)
            store.end_lease(key, "pool_pressure")
            raise
        return self.pool.adopt_carried(key, seq_id, rows_kept=rows_kept)

    def pack_times(self) -> tuple[list[float], list[float]]:
        return list(self.moves.pack_ms_each), list(self.moves.unpack_ms_each)

    def stats_fields(self) -> dict[str, Any]:
        m = self.moves
        return dict(packs=len(m.pack_ms_each), unpacks=len(m.unpack_ms_each),
                    pack_ms=sum(m.pack_ms_each), unpack_ms=sum(m.unpack_ms_each))

    def held_nbytes(self) -> tuple[int, int]:
        return self.moves.nbytes("device"), self.moves.nbytes("host")

    def check(self, store: CarryStore) -> None:
        if self.pool.carried_keys():
            raise RuntimeError(f"{self.codec.name} entries are packed, yet the pool carries "
                               f"{self.pool.carried_keys()}")
        for tier, held, copies in (("device", store.entries(), self.moves.keys()),
                                   ("host", store.host_entries, self.moves.host_keys())):
            if sorted(e.session_hash for e in held) != copies:
                raise RuntimeError(f"{tier} entries {sorted(e.session_hash for e in held)} differ from "
                                   f"the packed copies held {copies}")
            for e in held:
                copy = self.moves.get(e.session_hash)
                assert copy is not None
                if copy.rows != e.rows or copy.nbytes != store.nbytes(e.session_hash):
                    raise RuntimeError(f"entry 0x{e.session_hash:016x} of {e.rows} rows charged "
                                       f"{store.nbytes(e.session_hash)} B holds {copy.rows} rows, "
                                       f"{copy.nbytes} B")

    def repair(self, store: CarryStore, live: Set[int] = frozenset()) -> None:
        m = self.moves
        for tier, tier_entries, copies in (("device", store.entries(), m.keys()),
                                           ("host", store.host_entries, m.host_keys())):
            keys = {e.session_hash for e in tier_entries}
            for k in keys.difference(copies):
                store.discard(k, "fault")
            for k in set(copies).difference(keys):
                m.forget(k, tier)
        for k in self.pool.carried_keys():  # packed entries leave nothing carried in the pool
            self.pool.free_carried(k)


def residence_for(row_dtype: str, pool: DrafterKVPool, host_budget_bytes: int) -> Residence:
    """`bf16`: rows stay in `pool` (with a host tier when `host_budget_bytes` > 0); any other
    `carry_row_dtype`: packed out of it with `codec_for(row_dtype, pool dtype)` (its host tier
    holds the packed form)."""
    codec = codec_for(row_dtype, pool.k_cache.dtype)
    if codec.name == "bf16":
        return PoolResidence(pool, host_budget_bytes)
    return PackedResidence(pool, codec, host_budget_bytes)
