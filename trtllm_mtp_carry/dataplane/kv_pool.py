"""The drafter's paged KV pool: blocks of compacted rows, a free list, carried entries.

What it is for: the MTP drafter's own attention KV. Each live sequence holds a
block table of compacted rows (row `r` lives at `block_table[r // block_size]`,
offset `r % block_size`; rows are dense in increasing pair-key order, RoPE
applied at `key + 1` when written). When a turn ends its blocks can move, without
copying, into a carried entry under a caller's key (the runtime uses the session
hash); the next turn of that session adopts them back and truncates to the rows
its prompt still agrees with::

    | kept rows (adopted) | freed by truncate | appended this turn |
    0                 rows_kept           old rows            new rows

Carried entries are kept least recently carried first. Live sequences always
win: a grow the free list cannot serve evicts carried entries until it can,
one at a time, each the one `victim` names (the carry store's eviction policy;
oldest first when unset or when it names no carried key), and reports each
eviction to `on_evict` before it asks for the next victim, so however many
victims one grow needs, each is the policy's first choice among what is left;
a grow that even every carried block could not serve is refused and evicts
nothing.

Common-prefix sharing (`share_blocks`): sessions that share a prompt prefix
(a system prompt) build the same drafter rows for it. Before a finished
sequence is carried, each of its full blocks holding pair keys
`[i*B, (i+1)*B)` is looked up under the prefix key of the tokens its rows
depend on, `[0, (i+1)*B]` (the caller's chained key; a salt is part of it, so
salts never share) and, when a published block of that key holds the same
bytes, replaced by a reference to it; otherwise the block is published under
its key (first publisher wins)::

    entry A: | s0 | s1 | s2 | a3 | a4 |      s0-s2: one copy, refs = 2
    entry B: | s0 | s1 | s2 | b3 |           (bytes equal, so B's own copies went back)

Only bytes that are equal merge (K and V compared exactly), so every owner
reads exactly the rows it wrote itself; the key is only where to look (equal
tokens that gave other bytes, e.g. batch-dependent kernels, are counted as
mismatches and kept apart).

Bookkeeping is plain ints and lists (like nano-vllm's block manager), plus
numpy reference counts per block; tensors hold only the K/V data. Ownership
calls name the owner and raise RuntimeError on a double claim or a release
without a hold.

Invariants (`check()` proves them):
- every block is free (in the free pool once, no reference) or referenced by
  its owners: live sequences and carried entries, each at most once; its
  reference count is the number of them;
- a block with two or more owners is never written: rows go only into a
  block their sequence alone holds (a shared tail is copied first: copy on
  write), and a block leaves the index before its bytes change, so a
  published block's bytes never change (an owner that truncated into a
  shared block reads a prefix of the same bytes);
- an owner with `rows` rows holds at least `cdiv(rows, block_size)` blocks
  (a carried entry exactly that many);
- an owner's keys are strictly increasing, one per row;
- a refused call (bad input, caller bug, pool exhausted) leaves the pool unchanged.
"""

from __future__ import annotations

import functools
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from .checks import CACHE_DTYPES
from .device_ints import device_copy, device_tensor
from .ops import drafter_row_append_direct as drafter_row_append
from .pinned import pinned_empty
from .reference import slots_for_rows
from .rope import RopeConfig
from .row_codec import RowCodec, Rows
from .row_format import PackedRows, unpack_into_blocks

__all__ = ["BlockKeys", "CarriedBlocks", "DrafterKVPool", "HostRows", "PoolExhaustedError", "PoolStats",
           "ShareStats"]


class PoolExhaustedError(RuntimeError):
    """Not enough free blocks for a grow; the pool was left unchanged."""


@dataclass(frozen=True)
class CarriedBlocks:
    """A snapshot of an owner's rows: its blocks, row count and newest pair key."""

    block_table: tuple[int, ...]
    rows: int
    last_pair_key: int | None


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


class BlockKeys(Protocol):
    """Prefix keys of one token sequence (`engine.prefix_hash.PrefixKeys` is one).

    `key(d)` is the key of its first `d` tokens, the sharing scope (a cache
    salt) included; equal keys name equal prefixes.
    """

    @property
    def num_tokens(self) -> int: ...

    def key(self, depth: int) -> int: ...


@dataclass(frozen=True)
class ShareStats:
    """What one `share_blocks` call did: blocks merged, published, and lookups whose bytes differed."""

    merged: int
    published: int
    mismatched: int


@dataclass(frozen=True)
class PoolStats:
    """A frozen snapshot of the pool's block accounting.

    Blocks are counted once however many owners share them: `num_sequence_blocks`
    are those a live sequence holds, `num_carried_blocks` those only carried
    entries hold, and the three counts add up to `num_blocks`. `num_shared_blocks`
    have two or more owners; `blocks_saved` is the copies sharing avoids (owners'
    block references minus distinct blocks held); `shared_merges`,
    `share_mismatches` and `cow_copies` count since the pool was made.
    """

    num_blocks: int
    block_size: int
    num_free_blocks: int
    num_sequence_blocks: int
    num_carried_blocks: int
    num_sequences: int
    num_carried: int
    carried_rows: int
    evictions_for_pressure: int
    num_shared_blocks: int = 0
    blocks_saved: int = 0
    shared_merges: int = 0
    share_mismatches: int = 0
    cow_copies: int = 0
    blocks_published: int = 0


@dataclass
class _Rows:
    """One owner's rows: blocks, row count, keys as runs `[first_key, count]` in row order."""

    block_table: list[int] = field(default_factory=list)
    rows: int = 0
    runs: list[list[int]] = field(default_factory=list)

    @property
    def last_pair_key(self) -> int | None:
        return self.runs[-1][0] + self.runs[-1][1] - 1 if self.runs else None

    def snapshot(self) -> CarriedBlocks:
        return CarriedBlocks(tuple(self.block_table), self.rows, self.last_pair_key)


_IMPORTING = -1
"""The sequence id `import_carried` allocates under while it copies (never a caller's)."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


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


class DrafterKVPool:
    """Paged K/V caches `[num_blocks, block_size, num_kv_heads, head_dim]` with row bookkeeping."""

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
        # k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] dtype
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self._free: deque[int] = deque(range(num_blocks))
        self._seqs: dict[int, _Rows] = {}
        self._carried: OrderedDict[int, _Rows] = OrderedDict()  # first = least recently carried
        # per block: owners referencing it (0: free), and how many of them are live sequences
        self._refs = np.zeros(num_blocks, dtype=np.int64)
        self._live_refs = np.zeros(num_blocks, dtype=np.int64)
        self._published: dict[int, int] = {}  # prefix key -> the block published under it
        self._key_of: dict[int, int] = {}  # published block -> its prefix key
        self._pressure_evictions = 0
        self._merges = self._mismatches = self._cow = self._publications = 0
        self.on_evict: Callable[[int], None] | None = None
        """Called with each carried key a grow evicted, right after its blocks went back (the pool is
        consistent; the grow's own blocks are not taken yet) and before the next victim is named."""
        self.victim: Callable[[], int | None] | None = None
        """Names the carried key a grow evicts next (None, unset, or a key not carried: the oldest).
        Asked again after `on_evict` heard the previous victim."""

    # ---- queries -------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.k_cache.device

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

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
        return int(np.count_nonzero((self._refs > 0) & (self._live_refs == 0)))

    def carried(self, key: int) -> CarriedBlocks | None:
        """What the entry carried under `key` holds, or None."""
        state = self._carried.get(key)
        return state.snapshot() if state is not None else None

    def carried_runs(self, key: int) -> tuple[tuple[int, int], ...]:
        """Entry `key`'s keys as runs `(first_key, count)` in row order (what `import_carried` takes
        back with its rows); RuntimeError if nothing is carried under `key`."""
        state = self._carried.get(key)
        if state is None:
            raise RuntimeError(f"nothing carried under {key}: no keys")
        return tuple((k0, c) for k0, c in state.runs)

    def carried_keys(self) -> tuple[int, ...]:
        """Keys of the carried entries, least recently carried first (the eviction order)."""
        return tuple(self._carried)

    @property
    def slot(self) -> CarriedBlocks | None:
        """The most recently carried entry, or None when nothing is carried."""
        if not self._carried:
            return None
        return next(reversed(self._carried.values())).snapshot()

    def has_sequence(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def sequence(self, seq_id: int) -> CarriedBlocks:
        """Snapshot of a live sequence's blocks, rows and newest key."""
        return self._live(seq_id).snapshot()

    def sequence_runs(self, seq_id: int) -> tuple[tuple[int, int], ...]:
        """A live sequence's keys as runs `(first_key, count)` in row order."""
        return tuple((k0, c) for k0, c in self._live(seq_id).runs)

    def block_table_tensor(self, seq_id: int) -> torch.Tensor:  # [num_seq_blocks] int32
        """The sequence's block table on the pool's device, for attention kernels (no stream sync)."""
        return device_tensor(self._live(seq_id).block_table, torch.int32, self.device)

    def num_blocks_needed(self, seq_id: int, num_new_rows: int) -> int:
        """Blocks a grow by `num_new_rows` rows would allocate (0 when capacity suffices).

        One more when the rows start inside a block another owner shares (its copy).
        """
        if num_new_rows < 0:
            raise ValueError(f"num_new_rows must be >= 0, got {num_new_rows}")
        state = self._live(seq_id)
        grow = max(0, _cdiv(state.rows + num_new_rows, self.block_size) - len(state.block_table))
        return grow + (1 if num_new_rows and self._shared_tail(state) is not None else 0)

    def can_grow(self, seq_id: int, num_new_rows: int) -> bool:
        """Whether a grow by `num_new_rows` rows would succeed (evicting carried entries if need be)."""
        need = self.num_blocks_needed(seq_id, num_new_rows)
        return need <= len(self._free) or need <= len(self._free) + self.num_carried_blocks

    def stats(self) -> PoolStats:
        """A frozen snapshot of the block accounting."""
        held = self._refs > 0
        live = self._live_refs > 0
        return PoolStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            num_free_blocks=len(self._free),
            num_sequence_blocks=int(np.count_nonzero(live)),
            num_carried_blocks=int(np.count_nonzero(held & ~live)),
            num_sequences=len(self._seqs),
            num_carried=len(self._carried),
            carried_rows=sum(s.rows for s in self._carried.values()),
            evictions_for_pressure=self._pressure_evictions,
            num_shared_blocks=int(np.count_nonzero(self._refs > 1)),
            blocks_saved=int(self._refs.sum()) - int(np.count_nonzero(held)),
            shared_merges=self._merges,
            share_mismatches=self._mismatches,
            cow_copies=self._cow,
            blocks_published=self._publications,
        )

    # ---- ownership -----------------------------------------------------------

    def allocate_sequence(self, seq_id: int) -> None:
        """Register `seq_id` with no rows; RuntimeError if it is already live."""
        if seq_id in self._seqs:
            raise RuntimeError(f"sequence {seq_id} is already live in the drafter pool")
        self._seqs[seq_id] = _Rows()

    def grow(self, seq_id: int, num_new_rows: int) -> list[int]:
        """Allocate blocks so `seq_id` can hold `num_new_rows` more rows; return the new ids.

        Live sequences win: when the free list is short, carried entries are evicted
        one at a time, each the one `victim` names (else the least recently carried),
        until it is not; `on_evict` hears each key before the next is named.
        A shared block the new rows would start in is copied first (copy on write;
        the copy replaces it in the table and is not among the returned ids). All or nothing: PoolExhaustedError
        (pool unchanged, nothing evicted) when even every carried block would not be enough.
        """
        need = self.num_blocks_needed(seq_id, num_new_rows)
        carried_blocks = self.num_carried_blocks if need > len(self._free) else 0  # O(blocks): only if short
        if need > len(self._free) + carried_blocks:
            state = self._seqs[seq_id]
            raise PoolExhaustedError(
                f"sequence {seq_id} needs {need} more blocks for {num_new_rows} new rows "
                f"(has {state.rows} rows in {len(state.block_table)} blocks), "
                f"only {len(self._free)} of {self.num_blocks} blocks are free "
                f"and {carried_blocks} are carried"
            )
        evicted: list[int] = []
        while need > len(self._free):
            named = self.victim() if self.victim is not None else None
            key = named if named in self._carried else next(iter(self._carried))
            assert key is not None
            self._release_carried(key)
            if self.on_evict is not None:  # the store hears now, so the next victim is its next choice
                self.on_evict(key)
            evicted.append(key)
            need = self.num_blocks_needed(seq_id, num_new_rows)  # an eviction may unshare the tail
        self._pressure_evictions += len(evicted)
        state = self._seqs[seq_id]
        new = [self._free.popleft() for _ in range(need)]
        self._hold(new, live=True)
        if num_new_rows and state.rows % self.block_size:  # the rows start in a written block
            if self._shared_tail(state) is not None:
                self._copy_on_write(state, new.pop(0))
            else:  # this sequence alone holds it: its bytes change, so no one may find it
                self._unpublish(state.block_table[state.rows // self.block_size])
        state.block_table.extend(new)
        return new

    def truncate(self, seq_id: int, rows_kept: int) -> int:
        """Keep the first `rows_kept` rows of `seq_id`, drop whole blocks past them; return #dropped."""
        return self._truncate(self._live(seq_id), rows_kept, f"sequence {seq_id}")

    def free_sequence(self, seq_id: int) -> int:
        """Release `seq_id`; its blocks no other owner holds return to the free pool; return #held."""
        state = self._live(seq_id)
        del self._seqs[seq_id]
        self._release(state.block_table, live=True)
        return len(state.block_table)

    def share_blocks(self, seq_id: int, keys: BlockKeys) -> ShareStats:
        """Merge `seq_id`'s full prefix blocks into equal published ones; publish the rest.

        Call when the sequence has stopped writing (before `move_to_carried`).
        Block `i` qualifies when it holds pair keys `[i*B, (i+1)*B)`, exactly (the
        sequence's first key run starts at 0 and covers it). Its rows depend on
        tokens `[0, (i+1)*B]` (row `k` on `t_{k+1}` too), so its key is
        `keys.key((i + 1) * B + 1)`. It is replaced by the block published under
        that key when their K and V bytes are equal (`merged`), kept and counted
        `mismatched` when they differ (the same tokens gave other bytes), and
        published itself when no block holds the key (`published`). Rows never
        change: only blocks whose bytes are equal merge.
        """
        state = self._live(seq_id)
        dense = state.runs[0][1] if state.runs and state.runs[0][0] == 0 else 0
        n_full = min(dense // self.block_size, (keys.num_tokens - 1) // self.block_size)
        table = state.block_table
        pairs: list[tuple[int, int, int]] = []  # (block index, its block, the one published under its key)
        published = 0
        for i in range(n_full):  # a loop over blocks: one dict lookup (and one hash) each
            own = table[i]
            if own in self._key_of:
                continue  # published already (or merged on an earlier turn)
            key = keys.key((i + 1) * self.block_size + 1)
            found = self._published.get(key)
            if found is None:
                self._publish(own, key)
                published += 1
            elif found != own:
                pairs.append((i, own, found))
        merged = 0
        if pairs:  # one comparison of every candidate pair's K and V bytes
            own_ids = torch.tensor([o for _, o, _ in pairs], dtype=torch.int64, device=self.device)
            found_ids = torch.tensor([f for _, _, f in pairs], dtype=torch.int64, device=self.device)
            same = ((self.k_cache[own_ids] == self.k_cache[found_ids]).flatten(1).all(1)
                    & (self.v_cache[own_ids] == self.v_cache[found_ids]).flatten(1).all(1)).tolist()
            for (i, own, found), equal in zip(pairs, same, strict=True):
                if equal:
                    table[i] = found
                    self._hold([found], live=True)
                    self._release([own], live=True)
                    merged += 1
        self._merges += merged
        self._mismatches += len(pairs) - merged
        return ShareStats(merged, published, len(pairs) - merged)

    def move_to_carried(self, seq_id: int, key: int) -> CarriedBlocks:
        """Move `seq_id`'s rows into a new carried entry under `key` (zero copy); end the sequence.

        Reserved blocks past its rows are freed; the entry becomes the most recently
        carried. RuntimeError if `key` is already carried (free it first) or the
        sequence is not live.
        """
        state = self._live(seq_id)
        if key in self._carried:
            raise RuntimeError(
                f"carried entry {key} already holds {len(self._carried[key].block_table)} blocks; "
                f"free_carried({key}) before moving sequence {seq_id} in"
            )
        del self._seqs[seq_id]
        keep = _cdiv(state.rows, self.block_size)
        self._release(state.block_table[keep:], live=True)
        del state.block_table[keep:]
        self._live_refs[np.asarray(state.block_table, dtype=np.int64)] -= 1  # the owner stays, carried
        self._carried[key] = state
        return state.snapshot()

    def adopt_carried(self, key: int, seq_id: int, rows_kept: int | None = None) -> CarriedBlocks:
        """Give entry `key`'s blocks to `seq_id` (zero copy), keeping `rows_kept` rows (all if None).

        The entry leaves the pool's carried set. `seq_id` must be new or live with no
        blocks; RuntimeError otherwise or if nothing is carried under `key`. Returns
        what the sequence now holds. Blocks the entry shares stay shared (read only).
        """
        slot = self._carried.get(key)
        if slot is None:
            raise RuntimeError(f"nothing carried under {key} for sequence {seq_id} to adopt")
        existing = self._seqs.get(seq_id)
        if existing is not None and (existing.block_table or existing.rows):
            raise RuntimeError(
                f"sequence {seq_id} already holds {len(existing.block_table)} blocks; "
                f"it cannot adopt carried entry {key}"
            )
        if rows_kept is not None and not 0 <= rows_kept <= slot.rows:
            raise ValueError(f"rows_kept must be in [0, {slot.rows}], got {rows_kept}")
        del self._carried[key]
        # an int64 index built once (a list index converts twice: 3x slower at 1,750 blocks)
        self._live_refs[np.asarray(slot.block_table, dtype=np.int64)] += 1
        self._seqs[seq_id] = slot
        if rows_kept is not None:
            self._truncate(slot, rows_kept, f"sequence {seq_id}")
        return slot.snapshot()

    def free_carried(self, key: int) -> int:
        """Drop entry `key`; its blocks no other owner holds return to the free pool; return #held.

        RuntimeError if nothing is carried under `key`.
        """
        if key not in self._carried:
            raise RuntimeError(f"nothing carried under {key}: nothing to free")
        return self._release_carried(key)

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
        state = self._live(seq_id)
        if isinstance(keys, range) and keys.step == 1:  # checked in O(1) on the host: one run, no copy
            n = len(keys)
            self._check_rows(k, v, n)
            if n == 0:
                return state.snapshot()
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
                return state.snapshot()
            runs = _key_runs(keys_cpu)
            upload = functools.partial(device_copy, keys_cpu, self.device)
        last = state.last_pair_key
        if last is not None and runs[0][0] <= last:
            raise ValueError(f"first key {runs[0][0]} must exceed sequence {seq_id}'s last_pair_key {last}")
        self._write_rows(seq_id, state, upload(), k, v)  # keys on the device once they are checked
        if state.runs and runs[0][0] == last + 1:  # type: ignore[operator]
            state.runs[-1][1] += runs.pop(0)[1]
        state.runs.extend(runs)
        state.rows += n
        return state.snapshot()

    def _check_rows(self, k: torch.Tensor, v: torch.Tensor, n: int) -> None:
        expect = (n, self.num_kv_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != expect:
                raise ValueError(f"{name} must have shape {list(expect)}, got {tuple(t.shape)}")
            if t.dtype != self.k_cache.dtype:
                raise ValueError(f"{name} dtype {t.dtype} differs from cache dtype {self.k_cache.dtype}")
            if t.device != self.device:
                raise ValueError(f"{name} device {t.device} differs from pool device {self.device}")

    def _write_rows(self, seq_id: int, state: _Rows, keys_dev: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor) -> None:
        """Grow by the rows and write them; a refused write gives the new blocks back."""
        new_blocks = self.grow(seq_id, keys_dev.shape[0])
        # Only the blocks the new rows land in go to the kernel (row r of the slice is row
        # r + first * block_size of the sequence): a warm turn's append copies as many block
        # ids as its new rows need, however many rows it adopted.
        first = state.rows // self.block_size
        try:
            drafter_row_append(
                k, v, keys_dev, self.k_cache, self.v_cache,
                device_tensor(state.block_table[first:], torch.int32, self.device),
                state.rows - first * self.block_size,
                self.rope.rotary_dim, self.rope.rope_theta,
                False,  # keys checked on the host; block ids are the pool's own
            )
        except BaseException:
            del state.block_table[len(state.block_table) - len(new_blocks):]
            self._refs[new_blocks] -= 1
            self._live_refs[new_blocks] -= 1
            self._free.extendleft(reversed(new_blocks))
            raise

    def gather(self, seq_id: int, start_row: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(k [R', Hkv, D], v [R', Hkv, D], keys [R'] int64)` of rows `start_row ..`, in row order."""
        return self._gather(self._live(seq_id), start_row)

    def gather_carried(self, key: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Like `gather`, for the entry carried under `key`; RuntimeError if there is none."""
        state = self._carried.get(key)
        if state is None:
            raise RuntimeError(f"nothing carried under {key}: nothing to gather")
        return self._gather(state)

    def gather_slot(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Like `gather`, for the most recently carried entry; RuntimeError if nothing is carried."""
        if not self._carried:
            raise RuntimeError("nothing is carried: nothing to gather")
        return self._gather(next(reversed(self._carried.values())))

    # ---- host tier (the carry store's second tier) ----------------------------

    def export_nbytes(self, key: int) -> int:
        """Bytes `export_carried(key)` copies out (K and V of its whole blocks); RuntimeError if
        nothing is carried under `key`."""
        state = self._carried.get(key)
        if state is None:
            raise RuntimeError(f"nothing carried under {key}: nothing to export")
        return len(state.block_table) * self.block_nbytes

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
        state = self._carried[key]
        pin = self.device.type == "cuda"
        if out is None:
            out = pinned_empty(nbytes) if pin else torch.empty(nbytes, dtype=torch.uint8)
        elif out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != nbytes or out.device.type != "cpu":
            raise ValueError(f"out must be a 1-D uint8 CPU tensor of {nbytes} bytes, got "
                             f"{out.dtype} {tuple(out.shape)} on {out.device}")
        idx = device_tensor(state.block_table, torch.int64, self.device)  # no sync (torch.tensor(device=) would wait)
        shape = (len(state.block_table), *self.k_cache.shape[1:])
        k = out[:nbytes // 2].view(self.k_cache.dtype).view(shape)
        v = out[nbytes // 2:].view(self.v_cache.dtype).view(shape)
        if pin:  # gathered on the device, then one copy each into pinned memory
            k.copy_(self.k_cache.index_select(0, idx), non_blocking=True)
            v.copy_(self.v_cache.index_select(0, idx), non_blocking=True)
        else:  # gathered straight into the host tensors: one pass over the bytes
            torch.index_select(self.k_cache, 0, idx, out=k)
            torch.index_select(self.v_cache, 0, idx, out=v)
        return HostRows(k, v, state.rows, tuple((k0, c) for k0, c in state.runs))

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
        if key in self._carried:
            raise RuntimeError(f"carried entry {key} exists already: free_carried({key}) before importing")
        nblocks = _cdiv(rows.rows, self.block_size)
        for name, t in (("k", rows.k), ("v", rows.v)):
            if tuple(t.shape) != (nblocks, *self.k_cache.shape[1:]) or t.dtype != self.k_cache.dtype:
                raise ValueError(f"host rows' {name} {t.dtype} {tuple(t.shape)} do not fit {rows.rows} rows "
                                 f"of this pool's blocks {tuple(self.k_cache.shape[1:])} {self.k_cache.dtype}")
        return self._import(key, rows.rows, rows.runs, lambda idx: self._copy_blocks_in(idx, rows), stream)

    def import_packed(self, key: int, packed: PackedRows, runs: tuple[tuple[int, int], ...],
                      stream: torch.cuda.Stream | None = None) -> CarriedBlocks:
        """Carry `pack_blocks`' rows `[rows, 2, Hkv, D]` (keys `runs`) under `key`, unpacked straight
        into fresh blocks: `import_carried(key, HostRows(*unpack_blocks(packed), rows, runs))` row for
        row, in one pass (on CUDA one launch; no whole-block temporaries, no block copy).

        Blocks, eviction, `stream` and refusals as `import_carried`; the last block's tail past
        the rows keeps whatever bytes the fresh block held (no owner reads past its rows).
        """
        if key in self._carried:
            raise RuntimeError(f"carried entry {key} exists already: free_carried({key}) before importing")
        if not isinstance(packed, PackedRows):
            raise TypeError(f"packed must be PackedRows, got {type(packed).__name__}")
        if (packed.payload.dim() != 4 or tuple(packed.shape[1:]) != (2, self.num_kv_heads, self.head_dim)
                or packed.dtype != self.k_cache.dtype):
            raise ValueError(f"packed rows {packed.dtype} {tuple(packed.shape)} do not fit this pool's rows "
                             f"[rows, 2, {self.num_kv_heads}, {self.head_dim}] {self.k_cache.dtype}")
        rows = int(packed.shape[0])
        if sum(c for _, c in runs) != rows:
            raise ValueError(f"key runs {list(runs)} do not count the {rows} packed rows")
        return self._import(key, rows, runs,
                            lambda idx: unpack_into_blocks(packed, self.k_cache, self.v_cache, idx), stream)

    def import_rows(self, key: int, codec: RowCodec, held: Rows, runs: tuple[tuple[int, int], ...],
                    stream: torch.cuda.Stream | None = None) -> CarriedBlocks:
        """Carry `codec.gather_blocks`' rows `held` `[rows, 2, Hkv, D]` (keys `runs`) under `key`,
        written straight into fresh blocks by `codec.scatter_blocks` (fp8: unpacked there, one
        launch on CUDA; a pool-rows codec: copied exactly). Blocks, eviction, `stream` and
        refusals as `import_carried`; the last block's tail keeps its bytes."""
        if key in self._carried:
            raise RuntimeError(f"carried entry {key} exists already: free_carried({key}) before importing")
        if codec.pool_dtype != self.k_cache.dtype:
            raise ValueError(f"a {codec!r} cannot write this pool's {self.k_cache.dtype} blocks")
        codec.check_fits(held, self.num_kv_heads, self.head_dim)
        rows = int(held.shape[0])
        if sum(c for _, c in runs) != rows:
            raise ValueError(f"key runs {list(runs)} do not count the {rows} held rows")
        return self._import(key, rows, runs,
                            lambda idx: codec.scatter_blocks(held, self.k_cache, self.v_cache, idx), stream)

    def _import(self, key: int, rows: int, runs: tuple[tuple[int, int], ...],
                write: Callable[[torch.Tensor], None], stream: torch.cuda.Stream | None) -> CarriedBlocks:
        """Fresh blocks for `rows` rows under `_IMPORTING`, `write(block ids)` into them (on `stream`
        after the current stream's work, when given), then carried under `key`."""
        if _IMPORTING in self._seqs:
            raise RuntimeError("an import is in progress already")
        self.allocate_sequence(_IMPORTING)
        try:
            self.grow(_IMPORTING, rows)
        except BaseException:
            del self._seqs[_IMPORTING]
            raise
        state = self._seqs[_IMPORTING]
        idx = device_tensor(state.block_table, torch.int64, self.device)  # no sync: ordered on the current stream
        try:
            if stream is None:
                write(idx)
            else:
                stream.wait_stream(_current_stream(self.device))
                _record_stream(idx, stream)  # made on the current stream, read on `stream`
                with _on_stream(stream):
                    write(idx)
        except BaseException:  # the fresh blocks go back; entries a grow evicted stay evicted
            try:
                if stream is not None:  # K's copy may be queued already: the blocks' next owner,
                    stream.synchronize()  # on any stream, must write after it (a fault: the CPU waits)
            finally:
                self.free_sequence(_IMPORTING)
            raise
        state.rows = rows
        state.runs = [[k0, c] for k0, c in runs]
        return self.move_to_carried(_IMPORTING, key)

    def _copy_blocks_in(self, idx: torch.Tensor, rows: HostRows) -> None:
        self.k_cache.index_copy_(0, idx, rows.k.to(self.device, non_blocking=True))
        self.v_cache.index_copy_(0, idx, rows.v.to(self.device, non_blocking=True))

    # ---- invariants ----------------------------------------------------------

    def check(self) -> None:
        """Raise RuntimeError unless every block's references match its owners and rows fit their blocks."""
        owners: list[list[str]] = [[] for _ in range(self.num_blocks)]
        live = np.zeros(self.num_blocks, dtype=np.int64)
        named = [(f"sequence {sid}", s, False) for sid, s in self._seqs.items()]
        named += [(f"carried entry {key}", s, True) for key, s in self._carried.items()]
        for name, state, carried in named:
            if len(set(state.block_table)) != len(state.block_table):
                raise RuntimeError(f"{name} holds a block twice: {state.block_table}")
            for b in state.block_table:
                if not 0 <= b < self.num_blocks:
                    raise RuntimeError(f"{name} holds block id {b} outside [0, {self.num_blocks})")
                owners[b].append(name)
                live[b] += not carried
            need = _cdiv(state.rows, self.block_size)
            if len(state.block_table) < need or (carried and len(state.block_table) != need):
                raise RuntimeError(f"{name} has {state.rows} rows in {len(state.block_table)} blocks")
            if sum(c for _, c in state.runs) != state.rows:
                raise RuntimeError(f"{name} has {state.rows} rows but key runs {state.runs}")
            if any(c <= 0 for _, c in state.runs):
                raise RuntimeError(f"{name} has an empty key run: {state.runs}")
            for (k0, c0), (k1, _) in zip(state.runs, state.runs[1:], strict=False):
                if k1 <= k0 + c0 - 1:
                    raise RuntimeError(f"{name} keys are not strictly increasing: runs {state.runs}")
        free = list(self._free)
        if len(set(free)) != len(free):
            raise RuntimeError("the free pool lists a block twice")
        for b in free:
            if owners[b]:
                raise RuntimeError(f"block {b} is in the free pool and owned by {owners[b]}")
        for b, who in enumerate(owners):
            if not who and b not in self._free:
                raise RuntimeError(f"block {b} is owned by nobody and not in the free pool")
            if len(who) != self._refs[b] or live[b] != self._live_refs[b]:
                raise RuntimeError(
                    f"block {b} is owned by {who} but counted {int(self._refs[b])} references "
                    f"({int(self._live_refs[b])} live)"
                )
        for key, b in self._published.items():
            if self._key_of.get(b) != key or not owners[b]:
                raise RuntimeError(f"prefix key {key:#x} names block {b}, which is not published or not held")
        if len(self._key_of) != len(self._published):
            raise RuntimeError("published blocks and prefix keys differ")

    # ---- internals -----------------------------------------------------------

    def _live(self, seq_id: int) -> _Rows:
        state = self._seqs.get(seq_id)
        if state is None:
            raise RuntimeError(f"sequence {seq_id} is not live in the drafter pool")
        return state

    def _hold(self, blocks: list[int], live: bool) -> None:
        """One more owner (a live sequence if `live`) references each of `blocks`."""
        self._refs[blocks] += 1
        if live:
            self._live_refs[blocks] += 1

    def _release(self, blocks: list[int], live: bool) -> None:
        """One owner fewer references each of `blocks`; the unreferenced ones go back to the free pool."""
        if not blocks:
            return
        arr = np.asarray(blocks, dtype=np.int64)
        self._refs[arr] -= 1
        if live:
            self._live_refs[arr] -= 1
        gone = arr[self._refs[arr] == 0].tolist()
        if self._key_of:
            for b in gone:
                self._unpublish(b)
        self._free.extend(gone)

    def _release_carried(self, key: int) -> int:
        state = self._carried.pop(key)
        self._release(state.block_table, live=False)
        return len(state.block_table)

    def _publish(self, block: int, key: int) -> None:
        self._published[key] = block
        self._key_of[block] = key
        self._publications += 1

    def _unpublish(self, block: int) -> None:
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._published[key]

    def _shared_tail(self, state: _Rows) -> int | None:
        """The partial block the next row of `state` goes into, when another owner shares it."""
        if state.rows % self.block_size == 0:
            return None
        tail = state.block_table[state.rows // self.block_size]
        return tail if self._refs[tail] > 1 else None

    def _copy_on_write(self, state: _Rows, fresh: int) -> None:
        """Give `state` its own copy (`fresh`, held already) of the shared block its next row goes into."""
        at = state.rows // self.block_size
        shared = state.block_table[at]
        self.k_cache[fresh].copy_(self.k_cache[shared])
        self.v_cache[fresh].copy_(self.v_cache[shared])
        state.block_table[at] = fresh
        self._release([shared], live=True)
        self._cow += 1

    def _truncate(self, state: _Rows, rows_kept: int, name: str) -> int:
        """Keep `state`'s first `rows_kept` rows (a live sequence's); drop whole blocks past them."""
        if not 0 <= rows_kept <= state.rows:
            raise ValueError(f"rows_kept must be in [0, {state.rows}] for {name}, got {rows_kept}")
        drop = state.rows - rows_kept
        while drop:
            run = state.runs[-1]
            cut = min(drop, run[1])
            run[1] -= cut
            drop -= cut
            if run[1] == 0:
                state.runs.pop()
        state.rows = rows_kept
        keep = _cdiv(rows_kept, self.block_size)
        dropped = state.block_table[keep:]
        del state.block_table[keep:]
        self._release(dropped, live=True)
        if rows_kept % self.block_size:  # the tail's rows past `rows_kept` will be overwritten
            self._unpublish(state.block_table[-1])
        return len(dropped)

    def _gather(self, state: _Rows, start_row: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not 0 <= start_row <= state.rows:
            raise ValueError(f"start_row must be in [0, {state.rows}], got {start_row}")
        dev = self.device
        rows = torch.arange(start_row, state.rows, dtype=torch.int64, device=dev)
        table = torch.tensor(state.block_table, dtype=torch.int64, device=dev)
        slots = slots_for_rows(table, rows, self.block_size)
        k = self.k_cache.view(-1, self.num_kv_heads, self.head_dim).index_select(0, slots)
        v = self.v_cache.view(-1, self.num_kv_heads, self.head_dim).index_select(0, slots)
        keys = torch.cat(
            [torch.arange(k0, k0 + c, dtype=torch.int64) for k0, c in state.runs]
            or [torch.empty(0, dtype=torch.int64)]
        )[start_row:].to(dev)
        return k, v, keys


# ---- the side-stream import's CUDA calls (one seam: CPU tests put a recorder in their place) ----


def _current_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.current_stream(device)


def _on_stream(stream: torch.cuda.Stream) -> torch.cuda.StreamContext:
    return torch.cuda.stream(stream)


def _record_stream(t: torch.Tensor, stream: torch.cuda.Stream) -> None:
    t.record_stream(stream)
