"""The drafter pool's block book: which owner holds which block, in plain ints, no tensor.

What it is for: the bookkeeping half of the drafter's paged KV pool, kept like
nano-vllm's `engine/block_manager.py` and vLLM v1's `v1/core/block_pool.py`: a
deque of free block ids, a reference count per block, the sharing index (prefix
key -> published block) and the owners, each a block table of compacted rows
with its pair keys as runs. The tensor side (`dataplane/kv_pool.DrafterKVPool`:
the K/V caches, row writes, gathers, host copies) asks this book every
bookkeeping question and writes only the blocks it hands out.

Owners are live sequences (by sequence id) and carried entries (by carry key).
Row `r` of an owner lives at `block_table[r // block_size]`, offset
`r % block_size`; rows are dense in increasing pair-key order. When a turn ends,
its blocks move into a carried entry without a copy; the next turn adopts them
back and truncates to the rows its prompt still agrees with::

    | kept rows (adopted) | freed by truncate | appended this turn |
    0                 rows_kept           old rows            new rows

Carried entries are kept least recently carried first. Live sequences always
win: a grow the free list cannot serve evicts carried entries until it can, one
at a time, each the one `victim` names (the carry store's eviction policy; the
oldest when unset or when it names no carried key), and reports each eviction
to `on_evict` before it asks for the next victim; a grow that even every carried
block could not serve is refused and evicts nothing.

Sharing: a finished sequence's full block `i` (pair keys `[i*B, (i+1)*B)`) is
looked up under the prefix key of the tokens its rows depend on; the tensor side
compares the bytes of each candidate pair, and equal ones merge (one block,
two references); a block whose key no block holds is published under it (first
publisher wins)::

    entry A: | s0 | s1 | s2 | a3 | a4 |      s0-s2: one copy, refs = 2
    entry B: | s0 | s1 | s2 | b3 |           (bytes equal, so B's own copies went back)

Plan, then act: `num_blocks_needed` and `can_grow` say what `grow` would do,
`blocks_to_write` names the blocks a write may touch, `plan_share` names what
`share` will publish and which byte comparisons decide its merges. Ownership
calls name their owner and raise RuntimeError on a double claim or a release
without a hold (a caller bug); every reference count change is asserted.

Invariants (`check()` proves them):
- every block is free (in the free deque once, no reference) or referenced by
  its owners, each at most once; its reference count is the number of them, and
  its live count the number of them that are live sequences;
- a block with two or more owners is never written: `blocks_to_write` names only
  blocks their sequence alone holds (`grow` copies a shared tail first: copy on
  write), and a block leaves the sharing index before its bytes may change, so a
  published block's bytes never change;
- an owner with `rows` rows holds at least `cdiv(rows, block_size)` blocks (a
  carried entry exactly that many), and its keys are strictly increasing runs,
  one key per row;
- a refused call (bad input, caller bug, pool exhausted) leaves the book unchanged.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["BlockBook", "BlockKeys", "CarriedBlocks", "Growth", "PoolExhaustedError", "PoolStats", "Runs",
           "SharePlan", "ShareStats", "cdiv", "check_runs"]

Runs = tuple[tuple[int, int], ...]
"""Keys as runs `(first_key, count)` in row order."""


class PoolExhaustedError(RuntimeError):
    """Not enough free blocks for a grow; the pool was left unchanged."""


@dataclass(frozen=True)
class CarriedBlocks:
    """A snapshot of an owner's rows: its blocks, row count and newest pair key."""

    block_table: tuple[int, ...]
    rows: int
    last_pair_key: int | None


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
    """What one `share` did: blocks merged, published, and lookups whose bytes differed."""

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


@dataclass(frozen=True)
class Growth:
    """What `grow` allocated: `blocks` appended to the block table, in order, and `copy`,
    `(shared, fresh)` when the rows start in a block another owner shares: `fresh` replaced
    it in the table, and the tensor side copies `shared`'s bytes into `fresh` before any write."""

    blocks: tuple[int, ...]
    copy: tuple[int, int] | None


@dataclass(frozen=True)
class SharePlan:
    """What `share` will do to `seq_id`: publish each `(block, prefix key)` of `publish`, and
    merge each `(block index, own block, published block)` of `compare` whose bytes are equal."""

    seq_id: int
    publish: tuple[tuple[int, int], ...]
    compare: tuple[tuple[int, int, int], ...]


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


def cdiv(a: int, b: int) -> int:
    """`ceil(a / b)` for ints: the blocks `a` rows fill."""
    return -(-a // b)


def check_runs(runs: Sequence[Sequence[int]], rows: int) -> None:
    """ValueError unless `runs` are key runs `(first_key, count)` of `rows` rows: counts positive,
    keys >= 0 and strictly increasing."""
    if sum(c for _, c in runs) != rows or any(c <= 0 for _, c in runs):
        raise ValueError(f"key runs {[tuple(r) for r in runs]} do not count the {rows} rows")
    if runs and runs[0][0] < 0:
        raise ValueError(f"keys must be >= 0, got min key {runs[0][0]}")
    for (k0, c0), (k1, _) in zip(runs, runs[1:], strict=False):
        if k1 <= k0 + c0 - 1:
            raise ValueError(f"keys must be strictly increasing, got key runs {[tuple(r) for r in runs]}")


class BlockBook:
    """`num_blocks` blocks of `block_size` rows, their owners and the sharing index; no tensor."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._seqs: dict[int, _Rows] = {}
        self._carried: OrderedDict[int, _Rows] = OrderedDict()  # first = least recently carried
        # per block: owners referencing it (0: free), and how many of them are live sequences
        self._refs = [0] * num_blocks
        self._live_refs = [0] * num_blocks
        # blocks with a reference, with a live one, with two or more; references in all
        self._num_held = self._num_live = self._num_shared = self._num_refs = 0
        self._published: dict[int, int] = {}  # prefix key -> the block published under it
        self._key_of: dict[int, int] = {}  # published block -> its prefix key
        self._pressure_evictions = 0
        self._merges = self._mismatches = self._cow = self._publications = 0
        self.on_evict: Callable[[int], None] | None = None
        """Called with each carried key a grow evicted, right after its blocks went back (the book is
        consistent; the grow's own blocks are not taken yet) and before the next victim is named."""
        self.victim: Callable[[], int | None] | None = None
        """Names the carried key a grow evicts next (None, unset, or a key not carried: the oldest).
        Asked again after `on_evict` heard the previous victim."""

    # ---- queries -------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_carried_blocks(self) -> int:
        """Blocks only carried entries hold: what evicting every carried entry would free."""
        return self._num_held - self._num_live

    def carried(self, key: int) -> CarriedBlocks | None:
        """What the entry carried under `key` holds, or None."""
        state = self._carried.get(key)
        return state.snapshot() if state is not None else None

    def carried_runs(self, key: int) -> Runs:
        """Entry `key`'s keys as runs in row order; RuntimeError if nothing is carried under `key`."""
        state = self._carried.get(key)
        if state is None:
            raise RuntimeError(f"nothing carried under {key}: no keys")
        return tuple((k0, c) for k0, c in state.runs)

    def carried_keys(self) -> tuple[int, ...]:
        """Keys of the carried entries, least recently carried first (the eviction order)."""
        return tuple(self._carried)

    @property
    def slot_key(self) -> int | None:
        """The key of the most recently carried entry, or None when nothing is carried."""
        return next(reversed(self._carried)) if self._carried else None

    @property
    def slot(self) -> CarriedBlocks | None:
        """The most recently carried entry, or None when nothing is carried."""
        key = self.slot_key
        return None if key is None else self._carried[key].snapshot()

    def has_sequence(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def sequence(self, seq_id: int) -> CarriedBlocks:
        """Snapshot of a live sequence's blocks, rows and newest key; RuntimeError if it is not live."""
        return self._live(seq_id).snapshot()

    def sequence_runs(self, seq_id: int) -> Runs:
        """A live sequence's keys as runs in row order; RuntimeError if it is not live."""
        return tuple((k0, c) for k0, c in self._live(seq_id).runs)

    def num_blocks_needed(self, seq_id: int, num_new_rows: int) -> int:
        """Blocks a grow by `num_new_rows` rows would allocate (0 when capacity suffices).

        One more when the rows start inside a block another owner shares (its copy).
        """
        if num_new_rows < 0:
            raise ValueError(f"num_new_rows must be >= 0, got {num_new_rows}")
        state = self._live(seq_id)
        grow = max(0, cdiv(state.rows + num_new_rows, self.block_size) - len(state.block_table))
        return grow + (1 if num_new_rows and self._shared_tail(state) is not None else 0)

    def can_grow(self, seq_id: int, num_new_rows: int) -> bool:
        """Whether a grow by `num_new_rows` rows would succeed (evicting carried entries if need be)."""
        return self.num_blocks_needed(seq_id, num_new_rows) <= len(self._free) + self.num_carried_blocks

    def blocks_to_write(self, seq_id: int, num_new_rows: int) -> tuple[list[int], int]:
        """The blocks rows `[rows, rows + num_new_rows)` of `seq_id` go into, in order, and the
        offset of its next row in the first; RuntimeError unless the sequence holds them (grow
        first), alone, none published: the only blocks a write may touch."""
        state = self._live(seq_id)
        first = state.rows // self.block_size
        blocks = state.block_table[first:cdiv(state.rows + num_new_rows, self.block_size)] if num_new_rows else []
        if num_new_rows < 0 or state.rows + num_new_rows > len(state.block_table) * self.block_size:
            raise RuntimeError(f"sequence {seq_id} holds {len(state.block_table)} blocks for {state.rows} rows: "
                               f"grow it before writing {num_new_rows} more")
        for b in blocks:
            if self._refs[b] != 1 or b in self._key_of:
                raise RuntimeError(f"block {b} of sequence {seq_id} has {self._refs[b]} owners"
                                   f"{' and is published' if b in self._key_of else ''}: it cannot be written")
        return blocks, state.rows - first * self.block_size

    def check_next_keys(self, seq_id: int, runs: Sequence[Sequence[int]]) -> None:
        """ValueError unless key runs `runs` may follow `seq_id`'s rows (`append` takes them)."""
        check_runs(runs, sum(c for _, c in runs))
        last = self._live(seq_id).last_pair_key
        if runs and last is not None and runs[0][0] <= last:
            raise ValueError(f"first key {runs[0][0]} must exceed sequence {seq_id}'s last_pair_key {last}")

    def stats(self) -> PoolStats:
        """A frozen snapshot of the block accounting."""
        return PoolStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            num_free_blocks=len(self._free),
            num_sequence_blocks=self._num_live,
            num_carried_blocks=self._num_held - self._num_live,
            num_sequences=len(self._seqs),
            num_carried=len(self._carried),
            carried_rows=sum(s.rows for s in self._carried.values()),
            evictions_for_pressure=self._pressure_evictions,
            num_shared_blocks=self._num_shared,
            blocks_saved=self._num_refs - self._num_held,
            shared_merges=self._merges,
            share_mismatches=self._mismatches,
            cow_copies=self._cow,
            blocks_published=self._publications,
        )

    # ---- live sequences ------------------------------------------------------

    def allocate_sequence(self, seq_id: int) -> None:
        """Register `seq_id` with no rows; RuntimeError if it is already live."""
        if seq_id in self._seqs:
            raise RuntimeError(f"sequence {seq_id} is already live in the drafter pool")
        self._seqs[seq_id] = _Rows()

    def grow(self, seq_id: int, num_new_rows: int) -> Growth:
        """Allocate blocks so `seq_id` can hold `num_new_rows` more rows.

        When the free list is short, carried entries are evicted one at a time, each the
        one `victim` names (else the least recently carried), until it is not; `on_evict`
        hears each key before the next is named. A shared block the new rows would start
        in is replaced by a fresh one (`Growth.copy`: the caller copies its bytes before
        writing); a tail this sequence alone holds leaves the sharing index, since its
        bytes will change. All or nothing: PoolExhaustedError (nothing changed, nothing
        evicted) when even every carried block would not be enough.
        """
        need = self.num_blocks_needed(seq_id, num_new_rows)
        state = self._seqs[seq_id]
        if need > len(self._free) + self.num_carried_blocks:
            raise PoolExhaustedError(
                f"sequence {seq_id} needs {need} more blocks for {num_new_rows} new rows "
                f"(has {state.rows} rows in {len(state.block_table)} blocks), "
                f"only {len(self._free)} of {self.num_blocks} blocks are free "
                f"and {self.num_carried_blocks} are carried"
            )
        evicted = 0
        while need > len(self._free):
            named = self.victim() if self.victim is not None else None
            key = named if named in self._carried else next(iter(self._carried))
            assert key is not None
            self._release_carried(key)
            if self.on_evict is not None:  # the store hears now, so the next victim is its next choice
                self.on_evict(key)
            evicted += 1
            need = self.num_blocks_needed(seq_id, num_new_rows)  # an eviction may unshare the tail
        self._pressure_evictions += evicted
        new = [self._free.popleft() for _ in range(need)]
        self._hold(new, live=True)
        copy = None
        if num_new_rows and state.rows % self.block_size:  # the rows start in a written block
            at = state.rows // self.block_size
            tail = state.block_table[at]
            if self._refs[tail] > 1:  # shared: this sequence gets its own copy (copy on write)
                fresh = new.pop(0)
                state.block_table[at] = fresh
                self._release([tail], live=True)  # another owner still holds it: its bytes stay
                self._cow += 1
                copy = (tail, fresh)
            else:  # this sequence alone holds it: its bytes change, so no one may find it
                self._unpublish(tail)
        state.block_table.extend(new)
        return Growth(tuple(new), copy)

    def ungrow(self, seq_id: int, blocks: Sequence[int]) -> None:
        """Give back `blocks`, the last blocks of `seq_id`'s table that a grow just appended and
        nothing wrote (a refused write): to the front of the free list, as if never taken."""
        state = self._live(seq_id)
        n = len(blocks)
        if not n:
            return
        if state.block_table[-n:] != list(blocks) or len(state.block_table) - n < cdiv(state.rows, self.block_size):
            raise RuntimeError(f"blocks {list(blocks)} are not sequence {seq_id}'s unwritten last blocks "
                               f"{state.block_table[-n:]}")
        del state.block_table[-n:]
        self._release(blocks, live=True, front=True)

    def append(self, seq_id: int, runs: Sequence[Sequence[int]]) -> CarriedBlocks:
        """Record rows with key runs `runs` written after `seq_id`'s last row (`blocks_to_write`
        named their blocks); ValueError for keys `check_next_keys` refuses, RuntimeError when the
        sequence's blocks do not hold them. Returns what the sequence now holds."""
        state = self._live(seq_id)
        self.check_next_keys(seq_id, runs)
        n = sum(c for _, c in runs)
        if state.rows + n > len(state.block_table) * self.block_size:
            raise RuntimeError(f"sequence {seq_id}'s {len(state.block_table)} blocks cannot hold "
                               f"{state.rows} + {n} rows")
        rest = [[k0, c] for k0, c in runs]
        if rest and state.runs and rest[0][0] == state.runs[-1][0] + state.runs[-1][1]:
            state.runs[-1][1] += rest.pop(0)[1]
        state.runs.extend(rest)
        state.rows += n
        return state.snapshot()

    def truncate(self, seq_id: int, rows_kept: int) -> int:
        """Keep the first `rows_kept` rows of `seq_id`, drop whole blocks past them; return #dropped."""
        return self._truncate(self._live(seq_id), rows_kept, f"sequence {seq_id}")

    def free_sequence(self, seq_id: int) -> int:
        """Release `seq_id`; its blocks no other owner holds return to the free list; return #held."""
        state = self._live(seq_id)
        del self._seqs[seq_id]
        self._release(state.block_table, live=True)
        return len(state.block_table)

    # ---- sharing -------------------------------------------------------------

    def plan_share(self, seq_id: int, keys: BlockKeys) -> SharePlan:
        """What `share` would publish and compare for `seq_id`; changes nothing.

        Block `i` qualifies when it holds pair keys `[i*B, (i+1)*B)`, exactly (the
        sequence's first key run starts at 0 and covers it), and is not published yet.
        Its rows depend on tokens `[0, (i+1)*B]` (row `k` on `t_{k+1}` too), so its key
        is `keys.key((i + 1) * B + 1)`: published when no block holds that key, else
        paired with the block that does, for the caller to compare their bytes.
        """
        state = self._live(seq_id)
        dense = state.runs[0][1] if state.runs and state.runs[0][0] == 0 else 0
        n_full = min(dense // self.block_size, (keys.num_tokens - 1) // self.block_size)
        table = state.block_table
        planned: dict[int, int] = {}  # prefix key -> the block this plan publishes under it
        compare: list[tuple[int, int, int]] = []
        for i in range(n_full):  # a loop over blocks: one dict lookup (and one hash) each
            own = table[i]
            if own in self._key_of:
                continue  # published already (or merged on an earlier turn)
            key = keys.key((i + 1) * self.block_size + 1)
            found = self._published.get(key)
            if found is None:
                found = planned.get(key)
            if found is None:
                planned[key] = own
            elif found != own:
                compare.append((i, own, found))
        return SharePlan(seq_id, tuple((b, k) for k, b in planned.items()), tuple(compare))

    def share(self, plan: SharePlan, equal: Sequence[bool]) -> ShareStats:
        """Carry out `plan`: publish its blocks, then merge each compared pair whose bytes the
        caller found `equal` (the sequence takes a reference to the published block and drops
        its own). RuntimeError for a plan the book no longer matches (it acts only on the plan
        `plan_share` just returned); ValueError unless `equal` answers every comparison."""
        state = self._live(plan.seq_id)
        if len(equal) != len(plan.compare):
            raise ValueError(f"{len(equal)} byte comparisons for a plan of {len(plan.compare)}")
        table = state.block_table
        publishing = {block for block, _ in plan.publish}
        for i, own, found in plan.compare:
            if table[i] != own or not (found in self._key_of or found in publishing):
                raise RuntimeError(f"a stale share plan for sequence {plan.seq_id}: block index {i}")
        taken = [key for block, key in plan.publish if key in self._published or block in self._key_of]
        if taken:
            raise RuntimeError(f"a stale share plan for sequence {plan.seq_id}: prefix key {taken[0]:#x}")
        self._key_of.update(plan.publish)
        self._published.update((key, block) for block, key in plan.publish)
        self._publications += len(plan.publish)
        merged = 0
        for (i, own, found), same in zip(plan.compare, equal, strict=True):
            if same:
                table[i] = found
                self._hold([found], live=True)
                self._release([own], live=True)
                merged += 1
        self._merges += merged
        self._mismatches += len(plan.compare) - merged
        return ShareStats(merged, len(plan.publish), len(plan.compare) - merged)

    # ---- carried entries -----------------------------------------------------

    def move_to_carried(self, seq_id: int, key: int) -> CarriedBlocks:
        """Move `seq_id`'s rows into a new carried entry under `key` (no copy); end the sequence.

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
        keep = cdiv(state.rows, self.block_size)
        self._release(state.block_table[keep:], live=True)
        del state.block_table[keep:]
        self._set_live(state.block_table, -1)  # the owner stays, carried
        self._carried[key] = state
        return state.snapshot()

    def adopt_carried(self, key: int, seq_id: int, rows_kept: int | None = None) -> CarriedBlocks:
        """Give entry `key`'s blocks to `seq_id` (no copy), keeping `rows_kept` rows (all if None).

        The entry leaves the carried set. `seq_id` must be new or live with no blocks;
        RuntimeError otherwise or if nothing is carried under `key`. Returns what the
        sequence now holds. Blocks the entry shares stay shared (read only).
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
        self._set_live(slot.block_table, +1)
        self._seqs[seq_id] = slot
        if rows_kept is not None:
            self._truncate(slot, rows_kept, f"sequence {seq_id}")
        return slot.snapshot()

    def free_carried(self, key: int) -> int:
        """Drop entry `key`; its blocks no other owner holds return to the free list; return #held.

        RuntimeError if nothing is carried under `key`.
        """
        if key not in self._carried:
            raise RuntimeError(f"nothing carried under {key}: nothing to free")
        return self._release_carried(key)

    # ---- invariants ----------------------------------------------------------

    def check(self) -> None:
        """Raise RuntimeError unless every block's references match its owners and rows fit their blocks."""
        owners: list[list[str]] = [[] for _ in range(self.num_blocks)]
        live = [0] * self.num_blocks
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
            need = cdiv(state.rows, self.block_size)
            if len(state.block_table) < need or (carried and len(state.block_table) != need):
                raise RuntimeError(f"{name} has {state.rows} rows in {len(state.block_table)} blocks")
            try:
                check_runs(state.runs, state.rows)
            except ValueError as exc:  # what a caller's run would be refused for, broken inside the book
                raise RuntimeError(f"{name}: {exc}") from None
        free = set(self._free)
        if len(free) != len(self._free):
            raise RuntimeError("the free pool lists a block twice")
        for b in self._free:
            if owners[b]:
                raise RuntimeError(f"block {b} is in the free pool and owned by {owners[b]}")
        for b, who in enumerate(owners):
            if not who and b not in free:
                raise RuntimeError(f"block {b} is owned by nobody and not in the free pool")
            if len(who) != self._refs[b] or live[b] != self._live_refs[b]:
                raise RuntimeError(
                    f"block {b} is owned by {who} but counted {self._refs[b]} references "
                    f"({self._live_refs[b]} live)"
                )
        counts = (sum(r > 0 for r in self._refs), sum(r > 0 for r in self._live_refs),
                  sum(r > 1 for r in self._refs), sum(self._refs))
        if counts != (self._num_held, self._num_live, self._num_shared, self._num_refs):
            raise RuntimeError(f"block counts (held, live, shared, references) {counts} differ from the "
                               f"running ones {(self._num_held, self._num_live, self._num_shared, self._num_refs)}")
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

    def _hold(self, blocks: Sequence[int], live: bool) -> None:
        """One more owner (a live sequence if `live`) references each of `blocks`."""
        refs = self._refs
        held = shared = 0
        for b in blocks:
            r = refs[b]
            assert r >= 0, f"block {b} has {r} references"
            refs[b] = r + 1
            if r == 0:
                held += 1
            elif r == 1:
                shared += 1
        self._num_held += held
        self._num_shared += shared
        self._num_refs += len(blocks)
        if live:
            self._set_live(blocks, +1)

    def _release(self, blocks: Sequence[int], live: bool, front: bool = False) -> None:
        """One owner fewer (a live sequence if `live`) references each of `blocks`; the unreferenced
        ones leave the sharing index and go back to the free list (its end, or its front)."""
        if live:
            self._set_live(blocks, -1)
        refs, live_refs = self._refs, self._live_refs
        gone = []
        shared = 0
        for b in blocks:
            r = refs[b] - 1
            assert 0 <= r and live_refs[b] <= r, f"block {b} released without a hold ({r + 1} references)"
            refs[b] = r
            if r == 0:
                gone.append(b)
            elif r == 1:
                shared += 1
        self._num_held -= len(gone)
        self._num_shared -= shared
        self._num_refs -= len(blocks)
        if self._key_of:
            for b in gone:
                self._unpublish(b)
        if front:
            self._free.extendleft(reversed(gone))
        else:
            self._free.extend(gone)

    def _set_live(self, blocks: Sequence[int], delta: int) -> None:
        """Each of `blocks` has one live owner more (`delta` +1) or fewer (-1); its owners stay."""
        refs, live_refs = self._refs, self._live_refs
        flipped = 0  # blocks whose live owners went from none to one (+1), or from one to none (-1)
        if delta > 0:
            for b in blocks:
                n = live_refs[b] + 1
                assert n <= refs[b], f"block {b}: {n} live owners of {refs[b]}"
                live_refs[b] = n
                if n == 1:
                    flipped += 1
            self._num_live += flipped
        else:
            for b in blocks:
                n = live_refs[b] - 1
                assert n >= 0, f"block {b} has no live owner to lose"
                live_refs[b] = n
                if n == 0:
                    flipped += 1
            self._num_live -= flipped

    def _release_carried(self, key: int) -> int:
        state = self._carried.pop(key)
        self._release(state.block_table, live=False)
        return len(state.block_table)

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
        keep = cdiv(rows_kept, self.block_size)
        dropped = state.block_table[keep:]
        del state.block_table[keep:]
        self._release(dropped, live=True)
        if rows_kept % self.block_size:  # the tail's rows past `rows_kept` will be overwritten
            self._unpublish(state.block_table[-1])
        return len(dropped)
