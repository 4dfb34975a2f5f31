"""Where carried entries' rows live on the device between turns: two homes, one interface.

What it is for: the carry service keeps the bookkeeping (the `CarryStore`) and asks its home
every question about the rows themselves, never branching on the executor or the format:

    PoolHome   the rows stay in the executor's own drafter pool blocks (the reference
               engine's `DrafterKVPool`, bf16): a deposit moves the turn's blocks to the
               pool's carried set and an adoption moves them back (zero copy); entries
               share common-prefix blocks; the store charges blocks.
    ArenaHome  the rows leave the executor's pages into the carry's own device arena (one
               `Arena` reserved once), in a row codec's held form (`dataplane/row_codec.py`:
               the pool's own rows, or packed fp8/nvfp4): a deposit gathers them straight
               into the extent its plan reserved, an adoption scatters them into the turn's
               pages; the store charges the codec's bytes. TensorRT-LLM's draft pages always
               live here (TensorRT-LLM frees every page at the end of a request), and so do
               the reference engine's packed formats.

An executor hands an `ArenaHome` its pages as `RowPages` (gather into a destination, scatter
from rows); a `PoolHome` takes the pool's sequence ids. Both give the host tier
(`host_tier.HostTier`) an entry's bytes and take them back (`export_into`, `import_from`).

Invariants (each home's `check` proves them):
- The store's device entries are exactly the rows the home holds, of their rows and the
  bytes the store charges; rows held outside the arena (restored from the host, or bound
  for the host tier) are transient and leave with their turn.
- A deposit writes only the extent its plan reserved; an adoption writes only the turn's
  own pages (its fresh blocks); nothing another owner holds is written.
- `repair` makes the home and the store agree after a fault, freeing what no entry holds,
  each once; `idle` holds once the carry detached.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..core import CarriedDrafter, CarryStore
from ..core.block_book import cdiv
from ..core.row_format import RowFormat
from ..dataplane import streams
from ..dataplane.arena import Arena
from ..dataplane.kv_pool import CarriedBlocks, DrafterKVPool, HostRows
from ..dataplane.row_codec import CompositeCodec, RowCodec, Rows, codec_for

__all__ = ["ArenaHome", "PoolHome", "RowHome", "RowPages", "Runs", "head_runs"]

Runs = tuple[tuple[int, int], ...]
"""Pair-key runs `(first_key, count)` of an entry's rows, in row order."""


def head_runs(runs: Runs, n: int) -> Runs:
    """The runs of the first `n` rows of `runs`."""
    out = []
    for first, count in runs:
        if n <= 0:
            break
        out.append((first, min(count, n)))
        n -= count
    return tuple(out)


class RowPages(Protocol):
    """A turn's own pages, as an `ArenaHome` reads and writes them (the executor's)."""

    def gather_into(self, codec: RowCodec, out: Rows, runs: Runs) -> None:
        """Write the rows of keys `runs` into `out` (`codec`'s held form), in row order."""

    def scatter(self, codec: RowCodec, rows: Rows, runs: Runs, key: int) -> CarriedBlocks | None:
        """Write `rows` (`codec`'s held form) at keys `runs` of the turn's pages (`key`: the carry
        key they were carried under); returns what the turn now holds, where the executor says."""


class RowHome(ABC):
    """Where carried rows live on the device (see the module header): the service's one seam."""

    codec: RowCodec
    """The rows' held form while carried."""
    shares: bool
    """Whether entries may share common-prefix blocks (`carry_share`)."""
    reads_at_adoption: bool
    """Whether an adoption reads the rows at once (a scatter), or the turn's first step does."""
    device: torch.device

    # ---- what the store is told ------------------------------------------------------

    @property
    @abstractmethod
    def block_nbytes(self) -> int | None:
        """The store's per-block charge (None: charged by `row_format`)."""

    @property
    @abstractmethod
    def row_format(self) -> RowFormat | None:
        """The store's row format (None: charged by block)."""

    @property
    def reserved_bytes(self) -> int:
        """Device bytes reserved for carried rows (0: the rows stay in the executor's pool)."""
        return 0

    # ---- deposits ----------------------------------------------------------------------

    @abstractmethod
    def charge(self, source: Any, rows: int) -> tuple[Sequence[int] | None, int]:
        """`(blocks, bytes)` the store charges `rows` rows of `source` (blocks: None unless shared by block)."""

    def reserve(self, key: int, rows: int) -> bool:
        """Reserve room for `key`'s `rows` rows before any is written (False: no room)."""
        return True

    def unreserve(self, key: int) -> None:
        """Give back what `reserve` took for `key` (the deposit did not happen)."""
        return None

    @abstractmethod
    def carry_out(self, source: Any, key: int, rows: int, runs: Runs, tokens: Sequence[int],
                  loose: bool = False) -> CarriedDrafter:
        """Carry `source`'s first `rows` rows (keys `runs`) as entry `key`: into its reserved room,
        or with `loose` outside it (an entry bound for the host tier). On an exception nothing is
        held under `key` and the reservation is given back."""

    @abstractmethod
    def free(self, key: int) -> None:
        """Free `key`'s device rows (it left the store from the device tier, or went to the host)."""

    def share(self, source: Any, keys: Any) -> None:
        """Merge `source`'s full prefix blocks into equal published ones (homes that share blocks)."""
        return None

    # ---- adoption ----------------------------------------------------------------------

    @abstractmethod
    def comes_back(self, tier: str | None) -> bool:
        """Whether an entry in `tier` must be written into the executor's blocks on adoption."""

    @abstractmethod
    def carry_in(self, key: int, dest: Any, rows_kept: int) -> CarriedBlocks | None:
        """Move `key`'s first `rows_kept` rows into `dest` and free the rest; returns what `dest`
        holds where the executor says (None otherwise). When the move raises, an entry's rows stay
        held (the store keeps the entry); rows only restored for it are freed."""

    # ---- the host tier's seam (`host_tier.HostTier`) -------------------------------------

    @abstractmethod
    def export_nbytes(self, key: int) -> int:
        """Bytes of `key`'s device rows as the host tier holds them."""

    @abstractmethod
    def export_into(self, key: int, raw: torch.Tensor) -> Any:
        """Copy `key`'s device rows into `raw` (1-D uint8, host, `export_nbytes` long), on the
        current stream; returns their form (shapes and bookkeeping, no address: the arena may
        move the bytes) that `import_from` reads them back with."""

    @abstractmethod
    def import_from(self, key: int, raw: torch.Tensor, form: Any,
                    stream: torch.cuda.Stream | None) -> tuple[int, ...] | None:
        """Hold `key`'s rows on the device again, copied from `raw` (on `stream` when given);
        returns the entry's new block table where the rows live in the executor's blocks."""

    @abstractmethod
    def rows_of(self, form: Any) -> int:
        """How many rows a host copy of this form holds."""

    # ---- entry moves (`moves.py`): an entry's held bytes between workers ----------------

    @abstractmethod
    def layout(self) -> dict[str, Any]:
        """The held form of this home's entries, as plain values (a receiver's must be equal)."""

    @abstractmethod
    def held_nbytes_for(self, rows: int) -> int:
        """Bytes of the held range of an entry of `rows` rows (what `export_into` writes)."""

    def fresh_blocks(self, rows: int) -> Sequence[int] | None:
        """The block table a store charges an entry of `rows` rows arriving in fresh blocks (None:
        charged by bytes)."""
        return None

    @abstractmethod
    def form_for(self, rows: int, runs: Runs) -> Any:
        """The form (`export_into`'s) of an entry of `rows` rows with keys `runs`."""

    @abstractmethod
    def runs_of(self, form: Any) -> Runs:
        """The key runs of a held form."""

    @abstractmethod
    def receive(self, key: int, raw: torch.Tensor, rows: int, runs: Runs) -> tuple[int, ...]:
        """Hold `raw` (an entry's held bytes from another worker) as `key`'s device rows, in the room
        `reserve` took; returns its block table (empty where the store charges bytes)."""

    # ---- invariants --------------------------------------------------------------------

    @abstractmethod
    def held_nbytes(self) -> int:
        """Bytes of carried rows the home holds on the device (a shared block once)."""

    @abstractmethod
    def check(self, store: CarryStore) -> None:
        """RuntimeError unless the store's device entries are exactly the rows held."""

    @abstractmethod
    def repair(self, store: CarryStore) -> None:
        """After a fault: entries whose rows are gone or differ leave the store (`fault`); rows no
        entry holds are freed, each once."""

    @abstractmethod
    def idle(self) -> bool:
        """Nothing is held (every entry left and every reservation was given back)."""

    def held(self) -> str:
        """What the home holds, in words (what `CarryService.detach` names when it is not idle)."""
        return f"{self.held_nbytes()} bytes"

    def stats_fields(self) -> dict[str, Any]:
        """`CarryStats` fields this home fills (`packs`, `unpacks`, ...)."""
        return {}


class PoolHome(RowHome):
    """Rows stay in a `DrafterKVPool`'s blocks (zero copy), shared by prefix; sources and
    destinations are the pool's sequence ids."""

    shares = True
    reads_at_adoption = False

    def __init__(self, pool: DrafterKVPool) -> None:
        self.pool = pool
        self.device = pool.device
        self.codec = codec_for("bf16", pool.k_cache.dtype)

    @property
    def block_nbytes(self) -> int | None:
        return self.pool.block_nbytes

    @property
    def row_format(self) -> RowFormat | None:
        return None

    def charge(self, source: Any, rows: int) -> tuple[Sequence[int] | None, int]:
        blocks = self.pool.sequence(source).block_table[: cdiv(rows, self.pool.block_size)]
        return blocks, len(blocks) * self.pool.block_nbytes

    def carry_out(self, source: Any, key: int, rows: int, runs: Runs, tokens: Sequence[int],
                  loose: bool = False) -> CarriedDrafter:
        carried = self.pool.move_to_carried(source, key)  # zero copy
        return CarriedDrafter(carried.block_table, carried.rows, carried.last_pair_key, tokens, key)

    def share(self, source: Any, keys: Any) -> None:
        self.pool.share_blocks(source, keys)

    def free(self, key: int) -> None:
        self.pool.free_carried(key)

    def comes_back(self, tier: str | None) -> bool:
        return tier == "host"

    def carry_in(self, key: int, dest: Any, rows_kept: int) -> CarriedBlocks | None:
        return self.pool.adopt_carried(key, dest, rows_kept=rows_kept)

    def export_nbytes(self, key: int) -> int:
        return self.pool.export_nbytes(key)

    def export_into(self, key: int, raw: torch.Tensor) -> Any:
        rows = self.pool.export_carried(key, raw)
        return _BlockForm(tuple(rows.k.shape), rows.k.dtype, rows.rows, rows.runs)

    def import_from(self, key: int, raw: torch.Tensor, form: Any,
                    stream: torch.cuda.Stream | None) -> tuple[int, ...] | None:
        assert isinstance(form, _BlockForm)
        half = raw.numel() // 2
        rows = HostRows(raw[:half].view(form.dtype).view(form.shape), raw[half:].view(form.dtype).view(form.shape),
                        form.rows, form.runs)
        return self.pool.import_carried(key, rows, stream).block_table

    def rows_of(self, form: Any) -> int:
        return int(form.rows)

    def layout(self) -> dict[str, Any]:
        pool = self.pool
        return {"home": "pool", "codec": self.codec.name, "block_size": pool.block_size,
                "num_kv_heads": pool.num_kv_heads, "head_dim": pool.head_dim,
                "dtype": str(pool.k_cache.dtype).removeprefix("torch.")}

    def held_nbytes_for(self, rows: int) -> int:
        return cdiv(rows, self.pool.block_size) * self.pool.block_nbytes

    def fresh_blocks(self, rows: int) -> Sequence[int] | None:
        return range(-1, -cdiv(rows, self.pool.block_size) - 1, -1)  # no entry holds a negative id

    def form_for(self, rows: int, runs: Runs) -> Any:
        pool = self.pool
        shape = (cdiv(rows, pool.block_size), pool.block_size, pool.num_kv_heads, pool.head_dim)
        return _BlockForm(shape, pool.k_cache.dtype, rows, runs)

    def runs_of(self, form: Any) -> Runs:
        return tuple(form.runs)

    def receive(self, key: int, raw: torch.Tensor, rows: int, runs: Runs) -> tuple[int, ...]:
        blocks = self.import_from(key, raw, self.form_for(rows, runs), None)
        assert blocks is not None
        return blocks

    def held_nbytes(self) -> int:
        blocks: set[int] = set()  # a shared block is held once
        for k in self.pool.carried_keys():
            held = self.pool.carried(k)
            assert held is not None
            blocks.update(held.block_table)
        return len(blocks) * self.pool.block_nbytes

    def check(self, store: CarryStore) -> None:
        entries = store.entries()
        keys = tuple(e.session_hash for e in entries)
        if keys != self.pool.carried_keys():
            raise RuntimeError(f"carry store keys {keys} differ from the pool's {self.pool.carried_keys()}")
        for e in entries:
            held = self.pool.carried(e.session_hash)
            if held is None or (held.block_table, held.rows, held.last_pair_key) != (
                    e.block_table, e.rows, e.last_pair_key):
                raise RuntimeError(f"carried entry 0x{e.session_hash:016x} differs from the pool's {held}")

    def repair(self, store: CarryStore) -> None:
        entries = {e.session_hash: e for e in store.entries()}
        for k, e in entries.items():
            held = self.pool.carried(k)
            if held is None or (held.block_table, held.rows, held.last_pair_key) != (
                    e.block_table, e.rows, e.last_pair_key):
                store.discard(k, "fault")
                if held is not None:
                    self.pool.free_carried(k)
        for k in set(self.pool.carried_keys()).difference(entries):
            self.pool.free_carried(k)

    def idle(self) -> bool:
        return not self.pool.carried_keys()


@dataclass(frozen=True)
class _BlockForm:
    """A pool entry's host copy: K's whole blocks then V's, and the entry's rows and key runs."""

    shape: tuple[int, ...]  # [blocks, block_size, Hkv, D]
    dtype: torch.dtype
    rows: int
    runs: Runs


@dataclass(frozen=True)
class _Held:
    """An entry's rows in the arena (`shape` of its held form) or loose (`rows`), and its keys."""

    shape: tuple[int, ...]  # the codec's held shape of n rows ([n, 2, Hkv, D] for K/V)
    runs: Runs
    loose: Rows | None = None  # held outside the arena: restored from the host, or bound for it


class ArenaHome(RowHome):
    """Rows in `codec`'s held form in one device `Arena`, one extent an entry (see the module header)."""

    shares = False
    reads_at_adoption = True

    def __init__(self, codec: RowCodec, arena: Arena, num_kv_heads: int, head_dim: int) -> None:
        self.codec = codec
        self.arena = arena
        self.device = arena.device
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.row_nbytes = codec.row_nbytes(num_kv_heads, head_dim)
        self._held: dict[int, _Held] = {}
        # rows with side rows (a QSA pool's: `CompositeCodec`) have no K/V-only RowFormat: the store
        # charges what each deposit states, its rows at `row_nbytes` each
        self._format = None if isinstance(codec, CompositeCodec) else codec.format(num_kv_heads, head_dim)
        self.pack_ms_each: list[float] = []  # wall ms of every carry out of the pages, in order
        self.unpack_ms_each: list[float] = []  # wall ms of every carry back into them, in order

    @property
    def block_nbytes(self) -> int | None:
        return None

    @property
    def row_format(self) -> RowFormat | None:
        return self._format

    @property
    def reserved_bytes(self) -> int:
        return self.arena.nbytes

    def shape(self, rows: int) -> tuple[int, ...]:
        """The held shape of `rows` rows, as the codec holds them (`[rows, 2, Hkv, D]`: K and V; an MLA
        latent codec's one vector a key)."""
        return self.codec.held_shape(rows, self.num_kv_heads, self.head_dim)

    def charge(self, source: Any, rows: int) -> tuple[Sequence[int] | None, int]:
        return None, rows * self.row_nbytes

    def reserve(self, key: int, rows: int) -> bool:
        try:
            return self.arena.take(("deposit", key), rows * self.row_nbytes) is not None
        except torch.OutOfMemoryError:  # a device compaction could not stage a range: nothing taken
            return False

    def unreserve(self, key: int) -> None:
        self.arena.release(("deposit", key))

    def carry_out(self, source: Any, key: int, rows: int, runs: Runs, tokens: Sequence[int],
                  loose: bool = False) -> CarriedDrafter:
        shape = self.shape(rows)
        t0 = time.perf_counter()
        try:
            if loose:  # bound for the host tier: gathered once, copied out by the demotion
                out = self.codec.view(torch.empty(rows * self.row_nbytes, dtype=torch.uint8, device=self.device),
                                      shape)
            else:
                out = self.codec.view(self.arena.view(("deposit", key)), shape)
            source.gather_into(self.codec, out, runs)
        except BaseException:
            self.unreserve(key)
            raise
        if loose:
            self._held[key] = _Held(shape, runs, out)
        else:
            self.arena.rename(("deposit", key), key)
            self._held[key] = _Held(shape, runs)
        self.pack_ms_each.append((time.perf_counter() - t0) * 1e3)
        last = runs[-1][0] + runs[-1][1] - 1 if runs else None
        return CarriedDrafter((), rows, last, tokens, key)

    def rows(self, key: int) -> Rows:
        """`key`'s rows in their held form (views of its extent, or its loose rows)."""
        held = self._held[key]
        if held.loose is not None:
            return held.loose
        return self.codec.view(self.arena.view(key), held.shape)

    def runs(self, key: int) -> Runs:
        """`key`'s pair-key runs."""
        return self._held[key].runs

    def free(self, key: int, after: Any = None) -> None:
        held = self._held.pop(key)
        if held.loose is None:
            self.arena.release(key, after)
        elif after is not None and self.device.type == "cuda":
            for t in self.codec.tensors(held.loose):  # the caching allocator waits for the reader
                streams.record_stream(t, streams.current_stream(self.device))

    def comes_back(self, tier: str | None) -> bool:
        return tier is not None

    def carry_in(self, key: int, dest: Any, rows_kept: int) -> CarriedBlocks | None:
        held = self._held[key]
        rows = self.codec.head(self.rows(key), rows_kept)
        t0 = time.perf_counter()
        try:
            got = dest.scatter(self.codec, rows, head_runs(held.runs, rows_kept), key)
        except BaseException:  # the scatter only read the rows: an entry's stay where they were
            if held.loose is not None:  # a copy back from the host tier: its entry left the store
                self.free(key, streams.after_current(self.device))
            raise
        self.free(key, streams.after_current(self.device))  # read on the current stream: reused after it
        self.unpack_ms_each.append((time.perf_counter() - t0) * 1e3)
        return got  # type: ignore[no-any-return]

    def export_nbytes(self, key: int) -> int:
        return self._held[key].shape[0] * self.row_nbytes

    def export_into(self, key: int, raw: torch.Tensor) -> Any:
        held = self._held[key]
        self.codec.copy_(self.codec.view(raw, held.shape), self.rows(key))  # blocking into host memory
        return held.shape, held.runs

    def import_from(self, key: int, raw: torch.Tensor, form: Any,
                    stream: torch.cuda.Stream | None) -> tuple[int, ...] | None:
        shape, runs = form
        host = self.codec.view(raw, shape)
        rows: Rows
        if stream is None:  # the CPU: a copy of its own (the host range is reused at once)
            rows = self.codec.view(raw.clone() if self.device.type == "cpu" else raw, shape)
            if self.device.type != "cpu":
                rows = self.codec.to(host, self.device)
        else:
            stream.wait_stream(streams.current_stream(self.device))  # fresh memory may be read by queued work
            with streams.on_stream(stream):
                rows = self.codec.to(host, self.device, non_blocking=True)
        self._held[key] = _Held(shape, runs, rows)
        return None

    def rows_of(self, form: Any) -> int:
        return int(form[0][0])

    def layout(self) -> dict[str, Any]:
        return {"home": "arena", "codec": self.codec.name, "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim}

    def held_nbytes_for(self, rows: int) -> int:
        return rows * self.row_nbytes

    def form_for(self, rows: int, runs: Runs) -> Any:
        return self.shape(rows), runs

    def runs_of(self, form: Any) -> Runs:
        return tuple(form[1])

    def receive(self, key: int, raw: torch.Tensor, rows: int, runs: Runs) -> tuple[int, ...]:
        room = self.arena.view(("deposit", key))
        room.copy_(raw.to(room.device))  # blocking: the bytes are the entry's once this returns
        self.arena.rename(("deposit", key), key)
        self._held[key] = _Held(self.shape(rows), runs)
        return ()

    def held_nbytes(self) -> int:
        return sum(h.shape[0] for h in self._held.values() if h.loose is None) * self.row_nbytes

    def check(self, store: CarryStore) -> None:
        held = sorted(k for k, h in self._held.items() if h.loose is None)
        keys = sorted(e.session_hash for e in store.entries())
        if keys != held:
            raise RuntimeError(f"carried entries {keys} differ from the rows held {held}")
        for e in store.entries():
            h = self._held[e.session_hash]
            nbytes = h.shape[0] * self.row_nbytes
            if h.shape[0] != e.rows or nbytes != store.nbytes(e.session_hash):
                raise RuntimeError(f"entry 0x{e.session_hash:016x} of {e.rows} rows charged "
                                   f"{store.nbytes(e.session_hash)} B holds {h.shape[0]} rows, {nbytes} B")
        self.arena.check()

    def repair(self, store: CarryStore) -> None:
        kept = set()
        for e in store.entries():
            h = self._held.get(e.session_hash)
            if h is None or h.loose is not None or h.shape[0] != e.rows:
                store.discard(e.session_hash, "fault")
            else:
                kept.add(e.session_hash)
        for k in set(self._held).difference(kept):  # rows no entry holds (loose ones: a turn's, lost)
            self.free(k)
        for reservation in [k for k in self.arena.keys() if isinstance(k, tuple)]:  # a deposit's room
            self.arena.release(reservation)

    def idle(self) -> bool:
        return not self._held and not self.arena.keys()

    def held(self) -> str:
        return f"{self.held_nbytes()} bytes of entries, arena ranges {self.arena.keys()}"

    def stats_fields(self) -> dict[str, Any]:
        return dict(packs=len(self.pack_ms_each), unpacks=len(self.unpack_ms_each),
                    pack_ms=sum(self.pack_ms_each), unpack_ms=sum(self.unpack_ms_each))
