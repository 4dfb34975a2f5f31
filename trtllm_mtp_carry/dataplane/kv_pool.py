"""The drafter's paged KV pool, tensor side: K/V blocks, written and read through a block book.

What it is for: the MTP drafter's own attention KV. The caches are
`[num_blocks, block_size, num_kv_heads, head_dim]`; which owner (a live sequence,
a carried entry) holds which block, the free list, reference counts, the
sharing index and eviction are the block book's (`core.block_book.BlockBook`,
`pool.book`, no torch), and this side asks it every bookkeeping question. Here
are the bytes: rows appended (RoPE applied at `key + 1`, one kernel), a shared
tail copied before a write (copy on write), candidate blocks' bytes compared
for sharing, rows gathered in row order, and whole blocks copied to host
memory and back (`HostRows`, the carry store's host tier; on a side stream
when asked)::

    append_rows:  book.grow -> copy on write -> book.blocks_to_write -> kernel -> book.append
    share_blocks: book.plan_share -> compare bytes -> book.share
    carry_in:     fresh blocks carried under a key -> ids for the caller's codec to write

The pool sits below the row codecs: it knows one form of rows, its own (the
cache dtype, whole blocks). An entry held in another form (the packed formats
(fp8, nvfp4)) comes back through `carry_in`, whose block ids the entry's codec
writes (`codec.scatter_blocks(held, pool.k_cache, pool.v_cache, ids)`).

Only bytes that are equal merge (K and V compared exactly), so every owner
reads exactly the rows it wrote itself; the prefix key is only where to look
(equal tokens that gave other bytes, e.g. batch-dependent kernels, are counted
as mismatches and kept apart).

Invariants:
- the book's (`check()` proves them): every block free or held by its owners
  exactly, reference counts, rows fitting their blocks, increasing keys;
- bytes are written only into blocks the book names for the write (a grow's
  fresh blocks or a tail the writer alone holds, `blocks_to_write`; an import's
  fresh blocks), so a block with two owners and a published block never change;
- a refused call (bad input, caller bug, pool exhausted) leaves the pool and its
  caches unchanged; a write that raises gives its fresh blocks back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..core.block_book import (
    BlockBook,
    BlockKeys,
    CarriedBlocks,
    PoolExhaustedError,
    PoolStats,
    Runs,
    ShareStats,
    cdiv,
    check_runs,
)
from . import streams
from .checks import CACHE_DTYPES
from .device_ints import device_copy, device_tensor
from .ops import drafter_row_append_direct as drafter_row_append
from .pinned import pinned_empty
from .reference import slots_for_rows
from .rope import RopeConfig

__all__ = ["BlockKeys", "CarriedBlocks", "DrafterKVPool", "HostRows", "PoolExhaustedError", "PoolStats",
           "ShareStats", "gather_rows"]


@dataclass(frozen=True)
class HostRows:
    """A carried entry's rows in host memory (the carry store's host tier): whole blocks.

    `k`, `v`: `[blocks, block_size, num_kv_heads, head_dim]` on the CPU (pinned when
    the pool is on CUDA); `rows` and `runs` (key runs `(first_key, count)`, row
    order) are the entry's bookkeeping, so the copy back is the same rows and keys.
    """

    k: torch.Tensor
    v: torch.Tensor
    rows: int
    runs: tuple[tuple[int, int], ...]

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


_IMPORTING = -1
"""The sequence id an import allocates under while its blocks are written (never a caller's)."""


def _key_runs(keys: torch.Tensor) -> list[list[int]]:  # keys: [n >= 1] int64 on the CPU
    """`[[first key, count], ...]` of the runs of consecutive keys; ValueError unless the keys
    are >= 0 and strictly increasing. Tensor ops; the Python loop is over runs only."""
    if int(keys.min()) < 0:
        raise ValueError(f"keys must be >= 0, got min key {int(keys.min())}")
    diffs = keys[1:] - keys[:-1]
    if keys.shape[0] > 1 and int(diffs.min()) <= 0:
        raise ValueError(f"keys must be strictly increasing, got {keys.tolist()[:16]}")
    starts = [0] + (torch.nonzero(diffs != 1).flatten() + 1).tolist()
    ends = starts[1:] + [keys.shape[0]]
    return [[fk, e - s] for fk, s, e in zip(keys[starts].tolist(), starts, ends, strict=True)]


def gather_rows(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: Sequence[int], rows: int,
                runs: Sequence[Sequence[int]], start_row: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(k [R', Hkv, D], v [R', Hkv, D], keys [R'] int64)` of rows `start_row ..` of an owner's `rows`
    rows in `block_table` of K/V caches `[blocks, block_size, Hkv, D]` (its keys: `runs`), in row order."""
    if not 0 <= start_row <= rows:
        raise ValueError(f"start_row must be in [0, {rows}], got {start_row}")
    dev, (_, block_size, hkv, head_dim) = k_cache.device, k_cache.shape
    table = device_tensor(block_table, torch.int64, dev)  # no sync (torch.tensor(device=) would wait)
    slots = slots_for_rows(table, torch.arange(start_row, rows, dtype=torch.int64, device=dev), block_size)
    keys = device_copy(torch.cat([torch.arange(k0, k0 + c, dtype=torch.int64) for k0, c in runs]
                                 or [torch.empty(0, dtype=torch.int64)])[start_row:], dev)
    return (k_cache.view(-1, hkv, head_dim).index_select(0, slots),
            v_cache.view(-1, hkv, head_dim).index_select(0, slots), keys)


class DrafterKVPool:
    """Paged K/V caches `[num_blocks, block_size, num_kv_heads, head_dim]` over a `BlockBook` (`book`)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        rope: RopeConfig,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if dtype not in CACHE_DTYPES:
            raise ValueError(f"dtype must be one of {CACHE_DTYPES}, got {dtype}")
        if rope.head_dim != head_dim:
            raise ValueError(f"rope.head_dim {rope.head_dim} differs from head_dim {head_dim}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.rope = rope
        self.book = BlockBook(num_blocks, block_size)
        """Every bookkeeping answer: owners, free list, reference counts, sharing index, eviction."""
        # k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] dtype
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)

    # ---- the book's hooks and answers ------------------------------------------

    @property
    def on_evict(self) -> Callable[[int], None] | None:
        """`BlockBook.on_evict`: hears each carried key a grow evicted, before the next is named."""
        return self.book.on_evict

    @on_evict.setter
    def on_evict(self, hook: Callable[[int], None] | None) -> None:
        self.book.on_evict = hook

    @property
    def victim(self) -> Callable[[], int | None] | None:
        """`BlockBook.victim`: names the carried key a grow evicts next (else the oldest)."""
        return self.book.victim

    @victim.setter
    def victim(self, hook: Callable[[], int | None] | None) -> None:
        self.book.victim = hook

    @property
    def device(self) -> torch.device:
        return self.k_cache.device

    @property
    def num_free_blocks(self) -> int:
        return self.book.num_free_blocks

    @property
    def block_nbytes(self) -> int:
        """Bytes one block holds, K and V together (what a carried block costs)."""
        return 2 * self.k_cache[0].numel() * self.k_cache.element_size()

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool's K and V (what a carry budget fraction is a fraction of)."""
        return self.num_blocks * self.block_nbytes

    @property
    def num_carried_blocks(self) -> int:
        """Blocks only carried entries hold: what evicting every carried entry would free."""
        return self.book.num_carried_blocks

    def carried(self, key: int) -> CarriedBlocks | None:
        """What the entry carried under `key` holds, or None."""
        return self.book.carried(key)

    def carried_keys(self) -> tuple[int, ...]:
        """Keys of the carried entries, least recently carried first (the eviction order)."""
        return self.book.carried_keys()

    def has_sequence(self, seq_id: int) -> bool:
        return self.book.has_sequence(seq_id)

    def sequence(self, seq_id: int) -> CarriedBlocks:
        """Snapshot of a live sequence's blocks, rows and newest key."""
        return self.book.sequence(seq_id)

    def sequence_runs(self, seq_id: int) -> tuple[tuple[int, int], ...]:
        """A live sequence's keys as runs `(first_key, count)` in row order."""
        return self.book.sequence_runs(seq_id)

    def stats(self) -> PoolStats:
        """A frozen snapshot of the block accounting."""
        return self.book.stats()

    def check(self) -> None:
        """Raise RuntimeError unless every block's references match its owners and rows fit their blocks."""
        self.book.check()

    # ---- ownership -----------------------------------------------------------

    def allocate_sequence(self, seq_id: int) -> None:
        """Register `seq_id` with no rows; RuntimeError if it is already live."""
        self.book.allocate_sequence(seq_id)

    def grow(self, seq_id: int, num_new_rows: int) -> list[int]:
        """Allocate blocks so `seq_id` can hold `num_new_rows` more rows; return the new ids.

        As `BlockBook.grow` (carried entries evicted in `victim` order when the free list
        is short; PoolExhaustedError changes nothing). A shared block the new rows would
        start in is copied first (copy on write; the copy replaces it in the table and is
        not among the returned ids).
        """
        growth = self.book.grow(seq_id, num_new_rows)
        if growth.copy is not None:
            shared, fresh = growth.copy
            self.k_cache[fresh].copy_(self.k_cache[shared])
            self.v_cache[fresh].copy_(self.v_cache[shared])
        return list(growth.blocks)

    def free_sequence(self, seq_id: int) -> int:
        """Release `seq_id`; its blocks no other owner holds return to the free pool; return #held."""
        return self.book.free_sequence(seq_id)

    def share_blocks(self, seq_id: int, keys: BlockKeys) -> ShareStats:
        """Merge `seq_id`'s full prefix blocks into equal published ones; publish the rest.

        Call when the sequence has stopped writing (before `move_to_carried`). The book
        plans (`BlockBook.plan_share`: block `i`'s key is `keys.key((i + 1) * B + 1)`);
        here each candidate pair's K and V bytes are compared, in one pass, and only
        equal ones merge (`merged`); the others are kept and counted `mismatched`.
        """
        plan = self.book.plan_share(seq_id, keys)
        equal: list[bool] = []
        if plan.compare:
            own = torch.tensor([o for _, o, _ in plan.compare], dtype=torch.int64, device=self.device)
            found = torch.tensor([f for _, _, f in plan.compare], dtype=torch.int64, device=self.device)
            equal = ((self.k_cache[own] == self.k_cache[found]).flatten(1).all(1)
                     & (self.v_cache[own] == self.v_cache[found]).flatten(1).all(1)).tolist()
        return self.book.share(plan, equal)

    def move_to_carried(self, seq_id: int, key: int) -> CarriedBlocks:
        """Move `seq_id`'s rows into a new carried entry under `key` (zero copy); end the sequence.

        Reserved blocks past its rows are freed; the entry becomes the most recently
        carried. RuntimeError if `key` is already carried (free it first) or the
        sequence is not live.
        """
        return self.book.move_to_carried(seq_id, key)

    def adopt_carried(self, key: int, seq_id: int, rows_kept: int | None = None) -> CarriedBlocks:
        """Give entry `key`'s blocks to `seq_id` (zero copy), keeping `rows_kept` rows (all if None).

        As `BlockBook.adopt_carried`: `seq_id` must be new or live with no blocks. Blocks the
        entry shares stay shared (read only).
        """
        return self.book.adopt_carried(key, seq_id, rows_kept)

    def free_carried(self, key: int) -> int:
        """Drop entry `key`; its blocks no other owner holds return to the free pool; return #held.

        RuntimeError if nothing is carried under `key`.
        """
        return self.book.free_carried(key)

    # ---- data ----------------------------------------------------------------

    def append_rows(
        self,
        seq_id: int,
        keys: torch.Tensor | Sequence[int],  # [n] integer pair keys, strictly increasing
        k: torch.Tensor,  # [n, num_kv_heads, head_dim] cache dtype, pool device (pre-RoPE)
        v: torch.Tensor,  # [n, num_kv_heads, head_dim] cache dtype, pool device
    ) -> CarriedBlocks:
        """Append `n` rows after the sequence's last row: grow, then RoPE(k at key+1) and v in one kernel.

        Keys must exceed the sequence's `last_pair_key`. Refusals (ValueError, RuntimeError,
        PoolExhaustedError) leave the pool and caches unchanged. The rows are written
        only into blocks this sequence alone holds (`grow` copies a shared tail first).

        The keys are checked on the host, where the caller made them; the kernel then runs
        without its data checks. A `range` (step 1: the runtime's consecutive keys) costs no
        copy and no device sync (the kernel's keys are an `arange` on the device); a host
        tensor or list costs one pinned, non-blocking copy; a device tensor costs one
        device-to-host copy (a sync) to be checked.
        """
        state = self.book.sequence(seq_id)
        if isinstance(keys, range) and keys.step == 1:  # checked in O(1) on the host: one run, no copy
            n = len(keys)
            self._check_rows(k, v, n)
            if n == 0:
                return state
            if keys.start < 0:
                raise ValueError(f"keys must be >= 0, got min key {keys.start}")
            runs = [[keys.start, n]]
            upload = functools.partial(torch.arange, keys.start, keys.stop, dtype=torch.int64, device=self.device)
        else:
            keys_cpu = (keys.detach().to("cpu") if isinstance(keys, torch.Tensor)
                        else torch.tensor(list(keys), dtype=torch.int64))
            if keys_cpu.is_floating_point() or keys_cpu.dim() != 1:
                raise ValueError(f"keys must be a 1-D integer sequence, got {keys_cpu.dtype} "
                                 f"{tuple(keys_cpu.shape)}")
            keys_cpu = keys_cpu.long()
            n = keys_cpu.shape[0]
            self._check_rows(k, v, n)
            if n == 0:
                return state
            runs = _key_runs(keys_cpu)
            upload = functools.partial(device_copy, keys_cpu, self.device)
        self.book.check_next_keys(seq_id, runs)
        self._write_rows(seq_id, upload(), k, v)  # keys on the device once they are checked
        return self.book.append(seq_id, runs)

    def _check_rows(self, k: torch.Tensor, v: torch.Tensor, n: int) -> None:
        expect = (n, self.num_kv_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != expect:
                raise ValueError(f"{name} must have shape {list(expect)}, got {tuple(t.shape)}")
            if t.dtype != self.k_cache.dtype:
                raise ValueError(f"{name} dtype {t.dtype} differs from cache dtype {self.k_cache.dtype}")
            if t.device != self.device:
                raise ValueError(f"{name} device {t.device} differs from pool device {self.device}")

    def _write_rows(self, seq_id: int, keys_dev: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Grow by the rows and write them; a refused write gives the new blocks back."""
        n = keys_dev.shape[0]
        new_blocks = self.grow(seq_id, n)
        try:
            # Only the blocks the new rows land in go to the kernel: a warm turn's append copies
            # as many block ids as its new rows need, however many rows it adopted.
            blocks, start_row = self.book.blocks_to_write(seq_id, n)
            drafter_row_append(
                k, v, keys_dev, self.k_cache, self.v_cache,
                device_tensor(blocks, torch.int32, self.device), start_row,
                self.rope.rotary_dim, self.rope.rope_theta,
                False,  # keys checked on the host; block ids are the pool's own
            )
        except BaseException:
            self.book.ungrow(seq_id, new_blocks)
            raise

    def gather(self, seq_id: int, start_row: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(k [R', Hkv, D], v [R', Hkv, D], keys [R'] int64)` of rows `start_row ..`, in row order."""
        held = self.book.sequence(seq_id)
        return gather_rows(self.k_cache, self.v_cache, held.block_table, held.rows, self.book.sequence_runs(seq_id),
                           start_row)

    def gather_carried(self, key: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Like `gather`, for the entry carried under `key`; RuntimeError if there is none."""
        held = self.book.carried(key)
        if held is None:
            raise RuntimeError(f"nothing carried under {key}: nothing to gather")
        return gather_rows(self.k_cache, self.v_cache, held.block_table, held.rows, self.book.carried_runs(key))

    def gather_slot(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Like `gather`, for the most recently carried entry; RuntimeError if nothing is carried."""
        key = self.book.slot_key
        if key is None:
            raise RuntimeError("nothing is carried: nothing to gather")
        return self.gather_carried(key)

    # ---- host tier (the carry store's second tier) and carrying rows in ----------

    def export_nbytes(self, key: int) -> int:
        """Bytes `export_carried(key)` copies out (K and V of its whole blocks); RuntimeError if
        nothing is carried under `key`."""
        held = self.book.carried(key)
        if held is None:
            raise RuntimeError(f"nothing carried under {key}: nothing to export")
        return len(held.block_table) * self.block_nbytes

    def export_carried(self, key: int, out: torch.Tensor | None = None) -> HostRows:
        """A host-memory copy of entry `key`'s blocks and bookkeeping; the entry stays carried.

        `out`: a 1-D uint8 CPU tensor of exactly `export_nbytes(key)` to copy into (K's blocks
        then V's: a host slab's range, pinned on CUDA), else fresh host memory, page-locked for
        exactly its bytes on CUDA (`pinned.pinned_empty`). On CUDA the copy is issued on the
        current stream without waiting: kernels queued after it (a later write into the blocks,
        once freed) run after it, and the copy back (`import_carried`) is ordered after it too.
        RuntimeError if nothing is carried under `key`, ValueError for an `out` of another size.
        """
        nbytes = self.export_nbytes(key)
        held = self.book.carried(key)
        assert held is not None
        pin = self.device.type == "cuda"
        if out is None:
            out = pinned_empty(nbytes) if pin else torch.empty(nbytes, dtype=torch.uint8)
        elif out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != nbytes or out.device.type != "cpu":
            raise ValueError(f"out must be a 1-D uint8 CPU tensor of {nbytes} bytes, got "
                             f"{out.dtype} {tuple(out.shape)} on {out.device}")
        idx = device_tensor(held.block_table, torch.int64, self.device)  # no sync (torch.tensor(device=) would wait)
        shape = (len(held.block_table), *self.k_cache.shape[1:])
        k = out[:nbytes // 2].view(self.k_cache.dtype).view(shape)
        v = out[nbytes // 2:].view(self.v_cache.dtype).view(shape)
        if pin:  # gathered on the device, then one copy each into pinned memory
            k.copy_(self.k_cache.index_select(0, idx), non_blocking=True)
            v.copy_(self.v_cache.index_select(0, idx), non_blocking=True)
        else:  # gathered straight into the host tensors: one pass over the bytes
            torch.index_select(self.k_cache, 0, idx, out=k)
            torch.index_select(self.v_cache, 0, idx, out=v)
        return HostRows(k, v, held.rows, self.book.carried_runs(key))

    def import_carried(self, key: int, rows: HostRows,
                       stream: torch.cuda.Stream | None = None) -> CarriedBlocks:
        """Carry `rows` under `key` again, in fresh blocks: the same rows and keys, copied back.

        Blocks are allocated as a grow allocates them (a short free list evicts carried
        entries in `victim` order, `on_evict` hears each); the copy is issued on the
        current stream, or on `stream` (CUDA) after the current stream's work so far
        (fresh blocks may still be read by kernels queued before): asynchronous from
        pinned memory, and the caller orders the blocks' next use after it (an event).
        The entry becomes the most recently carried. RuntimeError if `key` is carried
        already, ValueError if `rows` do not fit this pool's blocks; PoolExhaustedError
        leaves the pool unchanged.
        """
        nblocks = cdiv(rows.rows, self.block_size)
        for name, t in (("k", rows.k), ("v", rows.v)):
            if tuple(t.shape) != (nblocks, *self.k_cache.shape[1:]) or t.dtype != self.k_cache.dtype:
                raise ValueError(f"host rows' {name} {t.dtype} {tuple(t.shape)} do not fit {rows.rows} rows "
                                 f"of this pool's blocks {tuple(self.k_cache.shape[1:])} {self.k_cache.dtype}")
        return self._import(key, rows.rows, rows.runs, lambda idx: self._copy_blocks_in(idx, rows), stream)

    def carry_in(self, key: int, rows: int, runs: Runs) -> torch.Tensor:  # -> [cdiv(rows, B)] int64
        """Fresh blocks carried under `key` for `rows` rows with key runs `runs`: their ids, in row
        order, on the pool's device (made on the current stream, no sync), for the caller to write
        the rows into before anything reads them: a row codec's `scatter_blocks(held, pool.k_cache,
        pool.v_cache, ids)` on the current stream. The entry alone holds them; a write that fails
        is the caller's to undo (`free_carried(key)`).

        Blocks and eviction as `import_carried`; the entry becomes the most recently carried.
        RuntimeError if `key` is carried already, ValueError unless `runs` are increasing key runs
        counting `rows`; PoolExhaustedError leaves the pool unchanged.
        """
        ids: list[torch.Tensor] = []
        self._import(key, rows, runs, ids.append, None)
        return ids[0]

    def _import(self, key: int, rows: int, runs: Runs, write: Callable[[torch.Tensor], None],
                stream: torch.cuda.Stream | None) -> CarriedBlocks:
        """Fresh blocks for `rows` rows under `_IMPORTING`, `write(block ids)` into them (on `stream`
        after the current stream's work, when given), then carried under `key`; RuntimeError if `key`
        is carried already, ValueError unless `runs` are increasing key runs counting `rows`."""
        if self.book.carried(key) is not None:
            raise RuntimeError(f"carried entry {key} exists already: free_carried({key}) before importing")
        check_runs(runs, rows)
        if self.book.has_sequence(_IMPORTING):
            raise RuntimeError("an import is in progress already")
        self.allocate_sequence(_IMPORTING)
        try:
            self.grow(_IMPORTING, rows)
        except BaseException:
            self.free_sequence(_IMPORTING)
            raise
        try:
            blocks, _ = self.book.blocks_to_write(_IMPORTING, rows)
            idx = device_tensor(blocks, torch.int64, self.device)  # no sync: ordered on the current stream
            if stream is None:
                write(idx)
            else:
                stream.wait_stream(streams.current_stream(self.device))
                streams.record_stream(idx, stream)  # made on the current stream, read on `stream`
                with streams.on_stream(stream):
                    write(idx)
        except BaseException:  # the fresh blocks go back; entries a grow evicted stay evicted
            try:
                if stream is not None:  # K's copy may be queued already: the blocks' next owner,
                    stream.synchronize()  # on any stream, must write after it (a fault: the CPU waits)
            finally:
                self.free_sequence(_IMPORTING)
            raise
        self.book.append(_IMPORTING, runs)
        return self.book.move_to_carried(_IMPORTING, key)

    def _copy_blocks_in(self, idx: torch.Tensor, rows: HostRows) -> None:
        self.k_cache.index_copy_(0, idx, rows.k.to(self.device, non_blocking=True))
        self.v_cache.index_copy_(0, idx, rows.v.to(self.device, non_blocking=True))

