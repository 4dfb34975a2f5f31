"""Target attention KV block ids: per-sequence block tables and a prefix cache.

What it is for: the reference engine's scheduler-side bookkeeping of the
target's paged attention KV. The engine owns the tensors
`[num_blocks, block_size, ...]` per layer; this module hands out block ids and
never touches a tensor. Only block tables (plain ints) cross to the data plane.

Every block is in exactly one state:
- live: ref count > 0, equal to the number of block tables holding it;
- cached-free: ref 0 with a cache key, kept for reuse, evicted least recently
  used first and only when the free pool is empty;
- free: ref 0, no key.

Cache keys (see `prefix_hash`):
- full block `i` of a sequence: the chained hash of blocks `0..i`, registered
  by `commit_full_blocks` (call it with verified tokens only);
- the final partial block of a finished sequence: `(parent hash, exact token
  bytes)`, registered by `free(owner, tokens)`. A turn ends mid-block and the
  next turn of the session continues from exactly that token.
- a sequence's chain starts at its `root` (`allocate(..., root=)`): `ROOT_HASH`,
  or a cache salt's root, so salted sequences share blocks only with their salt.

Write rule: a sequence writes only into its blocks at index >= its number of
committed blocks; those are private (ref 1, no key). Shared blocks are
read-only. A match ending inside a block is served by copy-on-write: the plan
says "copy block X into new block Y" and the sequence writes on into Y.

```
  | shared full blocks (read-only) | copied tail Y | new blocks          |
  0                          n * B      num_cached_tokens        len(tokens)
```

Speculative rejection is bookkeeping only: writes are indexed by position, so
`truncate` moves the token count and releases whole trailing blocks.

Prefix-cache events: `listener` (None by default), when set, hears every
full block the cache gains (`stored(root, parent, hashes, tokens)`: a run of
newly registered chained hashes, the key before the run, and the run's
tokens) and every full block it loses (`removed(hashes)` on eviction), from
the owning thread, as a distributed router needs them (serve/dynamo publishes
them as KV events). A block whose hash was already cached is not new.

Not thread-safe: one scheduler thread owns a manager. Keys are 64-bit, so a
false prefix hit needs a hash collision (odds ~ blocks**2 / 2**65). A cached
block whose parent was evicted is unreachable until it is evicted in turn;
releasing tables tail first makes children go before their parents.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn, Protocol

from trtllm_mtp_carry.engine.prefix_hash import ROOT_HASH, PrefixKeys, chain_hash, encode_tokens

BlockKey = int | tuple[int, bytes]
"""A full block's chained hash, or `(parent hash, token bytes)` for a partial block."""


class BlockListener(Protocol):
    """Hears the prefix cache's full-block registrations and evictions (see the module doc)."""

    def stored(self, root: int, parent: int, hashes: list[int], tokens: Sequence[int]) -> None: ...

    def removed(self, hashes: list[int]) -> None: ...


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Cached KV for tokens `[0, num_tokens)`: shared full blocks plus an optional copied tail.

    `block_ids[i]` holds tokens `[i*B, (i+1)*B)` and has chained hash
    `block_hashes[i]`; when `num_tokens % B != 0` the tail rows come from block
    `cow_src` (whose key was `cow_key` at match time) by copy-on-write.
    """

    num_tokens: int
    block_ids: tuple[int, ...]
    block_hashes: tuple[int, ...]
    block_size: int
    cow_src: int | None = None
    cow_key: BlockKey | None = None

    @staticmethod
    def empty(block_size: int) -> PrefixMatch:
        """The match of nothing: every token is computed."""
        return PrefixMatch(0, (), (), block_size)

    def trimmed(self, depth: int) -> PrefixMatch:
        """The same match cut to tokens `[0, depth)`; a cut inside a full block copies it."""
        if not 0 <= depth <= self.num_tokens:
            raise ValueError(f"depth={depth} outside [0, {self.num_tokens}] of this match")
        n, r = divmod(depth, self.block_size)
        src: int | None = None
        key: BlockKey | None = None
        if r and n < len(self.block_ids):
            src, key = self.block_ids[n], self.block_hashes[n]
        elif r:
            src, key = self.cow_src, self.cow_key
        return PrefixMatch(
            depth, self.block_ids[:n], self.block_hashes[:n], self.block_size, src, key
        )


@dataclass(frozen=True, slots=True)
class AllocationPlan:
    """What `allocate` did: the owner's table, where prefill starts, and copies to run.

    The engine must execute `copies` (`(src, dst)`: copy the KV rows of block
    src into block dst, every layer) before its next `allocate` or
    `append_slots`: once `allocate` returns, src may be evicted again.
    """

    block_table: tuple[int, ...]
    num_cached_tokens: int
    new_block_ids: tuple[int, ...]
    copies: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class BlockStats:
    """Frozen snapshot of the pool and the prefix cache counters."""

    num_blocks: int
    num_used: int
    num_cached: int
    num_free: int
    num_queried_tokens: int
    num_hit_tokens: int
    num_evictions: int
    num_copies: int


class _Seq:
    __slots__ = ("table", "num_tokens", "hashes", "root")

    def __init__(self, table: list[int], num_tokens: int, hashes: list[int], root: int) -> None:
        self.table = table  # block ids, in token order
        self.num_tokens = num_tokens  # slots reserved (computed, pending and draft tokens)
        self.hashes = hashes  # chained hashes of the committed full blocks
        self.root = root  # parent of block 0 (ROOT_HASH or a cache salt's root)


def _positive(name: str, value: int) -> int:
    if type(value) is not int or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class RefCountedBlocks:
    """Ref-counted block ids with a chained-hash index and an LRU of cached free blocks.

    The bookkeeping both prefix caches share (the target's `TargetBlockManager`
    and the paired drafter tree, `paired_drafts.PairedDraftPool`): a block is
    free (ref 0, no key), held (ref >= 1), or cached (ref 0 with a key, in the
    LRU, oldest first). A key is a full block's chained hash (`_by_hash`) or
    `(parent hash, token bytes)` for a final partial block (`_partials`).
    """

    def _init_blocks(self, num_blocks: int) -> None:
        self._ref = [0] * num_blocks
        self._key: list[BlockKey | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached-free, oldest first
        self._by_hash: dict[int, int] = {}
        self._partials: dict[int, dict[bytes, int]] = {}  # parent hash -> token bytes -> block

    def _take(self, block: int) -> None:
        if self._ref[block] == 0:
            del self._lru[block]
        self._ref[block] += 1

    def _drop(self, block: int) -> None:
        if self._ref[block] < 1:
            raise RuntimeError(f"block {block} released without a hold")
        self._ref[block] -= 1
        if self._ref[block] == 0:
            if self._key[block] is None:
                self._free.append(block)
            else:
                self._lru[block] = None

    def _reclaim(self) -> tuple[int, BlockKey | None] | None:
        """A block to reuse and the key it was evicted under (None: it was free); None if none."""
        if self._free:
            return self._free.popleft(), None
        if not self._lru:
            return None
        block, _ = self._lru.popitem(last=False)
        return block, self._unindex(block)

    def _unindex(self, block: int) -> BlockKey | None:
        """Take `block` out of the hash index (its key, or None if it had none)."""
        key = self._key[block]
        if isinstance(key, tuple):
            siblings = self._partials[key[0]]
            del siblings[key[1]]
            if not siblings:
                del self._partials[key[0]]
        elif key is not None:
            del self._by_hash[key]
        self._key[block] = None
        return key


class TargetBlockManager(RefCountedBlocks):
    """Target KV block ids for sequences named by `owner` (an int), with a prefix cache."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = _positive("num_blocks", num_blocks)
        self.block_size = _positive("block_size", block_size)
        self._init_blocks(num_blocks)
        self._seqs: dict[int, _Seq] = {}
        self._queried = self._hits = self._evictions = self._copies = 0
        self.listener: BlockListener | None = None

    # ---- prediction -------------------------------------------------------

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def match_prefix(self, tokens: Sequence[int] | PrefixKeys) -> PrefixMatch:
        """Deepest cached KV prefix of `tokens`, capped at `len(tokens) - 1` tokens.

        At least the last prompt token is always left to compute. Full blocks
        match by chained hash; then the longest cached partial block under the
        same parent whose tokens agree with the prompt extends the match.
        `tokens` may be a `PrefixKeys` of this block size, to hash a prompt once;
        its `root` (a cache salt's) picks the namespace searched.
        """
        bs, cap = self.block_size, len(tokens) - 1
        if cap < 1:
            return PrefixMatch.empty(bs)
        keys = PrefixKeys.of(tokens, bs)
        ids: list[int] = []
        hashes: list[int] = []
        for n in range(1, cap // bs + 1):
            block = self._by_hash.get(keys.full(n))
            if block is None:
                break
            ids.append(block)
            hashes.append(keys.full(n))
        depth = len(ids) * bs
        best, src = 0, None
        room = min(cap - depth, bs - 1)  # tail tokens a partial block may supply
        siblings = self._partials.get(keys.full(len(ids)), {}) if room else {}
        for chunk, block in siblings.items():
            r = min(len(chunk) // 8, room)
            if r > best and chunk[: 8 * r] == keys.chunk(depth, depth + r):
                best, src = r, block
        key = None if src is None else self._key[src]
        return PrefixMatch(depth + best, tuple(ids), tuple(hashes), bs, src, key)

    def can_allocate(self, num_tokens: int, match: PrefixMatch | None = None) -> int | None:
        """Blocks `allocate` would draw from the pool (>= 1), or None when there is no room."""
        m = self._checked_match(num_tokens, match)
        needed = self.num_blocks_for(num_tokens) - len(m.block_ids)
        return needed if needed <= self._available(m) else None

    def can_append_slots(self, owner: int, n: int) -> int | None:
        """Blocks `append_slots(owner, n)` would draw (may be 0), or None when there is no room."""
        seq = self._seq(owner)
        if type(n) is not int or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        needed = self.num_blocks_for(seq.num_tokens + n) - len(seq.table)
        return needed if needed <= len(self._free) + len(self._lru) else None

    # ---- action -----------------------------------------------------------

    def allocate(
        self,
        owner: int,
        tokens: Sequence[int],
        match: PrefixMatch | None = None,
        root: int = ROOT_HASH,
    ) -> AllocationPlan:
        """Give `owner` a table for `tokens`, sharing `match` (from `match_prefix(tokens)`).

        `root` is the key chain's start for the blocks `owner` commits: the
        `root` of the `PrefixKeys` that `match` came from. Raises RuntimeError
        if `owner` already holds a table, if `match` went stale (a block was
        evicted since), or if `can_allocate` would say None.
        """
        if owner in self._seqs:
            raise RuntimeError(f"owner {owner} already holds a block table (double claim)")
        if type(root) is not int or not 0 <= root < 1 << 64:
            raise ValueError(f"root must be a u64 int, got {root!r}")
        m = self._checked_match(len(tokens), match)
        if not m.block_ids and isinstance(m.cow_key, tuple) and m.cow_key[0] != root:
            raise ValueError(f"match is under root {m.cow_key[0]}, not root={root}")
        needed = self.num_blocks_for(len(tokens)) - len(m.block_ids)
        if needed > self._available(m):
            raise RuntimeError(
                f"no room for owner {owner}: needs {needed} blocks, "
                f"{self._available(m)} available (call can_allocate first)"
            )
        for block in m.block_ids:
            self._take(block)
        if m.cow_src is not None:
            self._take(m.cow_src)  # pinned so that drawing new blocks cannot evict it
        new = [self._draw() for _ in range(needed)]
        copies: tuple[tuple[int, int], ...] = ()
        if m.cow_src is not None:
            copies = ((m.cow_src, new[0]),)
            self._drop(m.cow_src)
            self._copies += 1
        table = [*m.block_ids, *new]
        self._seqs[owner] = _Seq(table, len(tokens), list(m.block_hashes), root)
        self._queried += len(tokens)
        self._hits += m.num_tokens
        return AllocationPlan(tuple(table), m.num_tokens, tuple(new), copies)

    def append_slots(self, owner: int, n: int) -> tuple[int, ...]:
        """Grow `owner` by `n` token slots; returns the blocks added (RuntimeError if no room)."""
        needed = self.can_append_slots(owner, n)
        if needed is None:
            raise RuntimeError(f"no room to append {n} slots for owner {owner}")
        seq = self._seqs[owner]
        new = tuple(self._draw() for _ in range(needed))
        seq.table.extend(new)
        seq.num_tokens += n
        return new

    def commit_full_blocks(self, owner: int, tokens: Sequence[int]) -> int:
        """Register `owner`'s newly filled blocks of verified `tokens`; returns how many.

        A block whose hash is already cached elsewhere stays private (first one wins).
        """
        seq = self._seq(owner)
        if len(tokens) > seq.num_tokens:
            raise ValueError(
                f"owner {owner}: {len(tokens)} tokens exceed its {seq.num_tokens} slots"
            )
        bs, done = self.block_size, len(seq.hashes)
        n_full = len(tokens) // bs
        if n_full <= done:
            return 0
        buf = encode_tokens(tokens[done * bs : n_full * bs])
        parent = seq.hashes[-1] if seq.hashes else seq.root
        new: list[int] = []  # indices (into this commit) of the blocks newly registered
        for i in range(n_full - done):
            parent = chain_hash(parent, buf[i * 8 * bs : (i + 1) * 8 * bs])
            block = seq.table[done + i]
            if parent not in self._by_hash:
                self._by_hash[parent] = block
                self._key[block] = parent
                new.append(i)
            seq.hashes.append(parent)
        if self.listener is not None and new:
            self._announce(seq, done, new, tokens)
        return n_full - done

    def _announce(self, seq: _Seq, done: int, new: list[int], tokens: Sequence[int]) -> None:
        """Tell the listener about each run of consecutive new blocks, with its parent key."""
        assert self.listener is not None
        bs, lo = self.block_size, 0
        while lo < len(new):
            hi = lo + 1
            while hi < len(new) and new[hi] == new[hi - 1] + 1:
                hi += 1
            first, last = done + new[lo], done + new[hi - 1]  # block indices in the sequence
            parent = seq.hashes[first - 1] if first else seq.root
            self.listener.stored(seq.root, parent, seq.hashes[first:last + 1],
                                 tokens[first * bs:(last + 1) * bs])
            lo = hi

    def truncate(self, owner: int, num_tokens: int) -> None:
        """Shrink `owner` to `num_tokens` slots (rejected drafts), releasing trailing blocks."""
        seq = self._seq(owner)
        if type(num_tokens) is not int or not 0 <= num_tokens <= seq.num_tokens:
            raise ValueError(
                f"owner {owner}: num_tokens={num_tokens!r} outside [0, {seq.num_tokens}]"
            )
        if num_tokens < len(seq.hashes) * self.block_size:
            raise RuntimeError(
                f"owner {owner}: cannot truncate to {num_tokens} below "
                f"{len(seq.hashes) * self.block_size} committed tokens"
            )
        keep = self.num_blocks_for(num_tokens)
        for block in reversed(seq.table[keep:]):
            self._drop(block)
        del seq.table[keep:]
        seq.num_tokens = num_tokens

    def free(self, owner: int, tokens: Sequence[int] | None = None) -> None:
        """Release `owner`'s table; with `tokens` (verified), cache its full and final partial blocks.

        Blocks are released tail first, so the tail is evicted before its parents.
        """
        seq = self._seq(owner)
        if tokens is not None:
            if not len(seq.hashes) * self.block_size <= len(tokens) <= seq.num_tokens:
                raise ValueError(
                    f"owner {owner}: {len(tokens)} tokens outside "
                    f"[{len(seq.hashes) * self.block_size}, {seq.num_tokens}]"
                )
            self.commit_full_blocks(owner, tokens)
            n, r = divmod(len(tokens), self.block_size)
            if r:
                parent = seq.hashes[-1] if seq.hashes else seq.root
                chunk = encode_tokens(tokens[n * self.block_size :])
                siblings = self._partials.setdefault(parent, {})
                if chunk not in siblings:
                    siblings[chunk] = seq.table[n]
                    self._key[seq.table[n]] = (parent, chunk)
        for block in reversed(seq.table):
            self._drop(block)
        del self._seqs[owner]

    # ---- inspection -------------------------------------------------------

    def block_table(self, owner: int) -> list[int]:
        """A copy of `owner`'s block table (token order)."""
        return list(self._seq(owner).table)

    def num_tokens(self, owner: int) -> int:
        """Token slots `owner` holds."""
        return self._seq(owner).num_tokens

    def stats(self) -> BlockStats:
        """Frozen snapshot of block counts and cache counters."""
        cached, free = len(self._lru), len(self._free)
        return BlockStats(
            self.num_blocks, self.num_blocks - cached - free, cached, free,
            self._queried, self._hits, self._evictions, self._copies,
        )  # fmt: skip

    def check(self) -> None:
        """Raise RuntimeError unless every block is in exactly one state and refs match tables."""
        holders = [0] * self.num_blocks
        for owner, seq in self._seqs.items():
            if len(set(seq.table)) != len(seq.table):
                _broken(f"owner {owner} holds a block twice: {seq.table}")
            if len(seq.table) != self.num_blocks_for(seq.num_tokens):
                _broken(f"owner {owner}: {len(seq.table)} blocks for {seq.num_tokens} tokens")
            if len(seq.hashes) * self.block_size > seq.num_tokens:
                _broken(f"owner {owner}: {len(seq.hashes)} committed blocks exceed its tokens")
            for block in seq.table:
                holders[block] += 1
            for block in seq.table[len(seq.hashes) :]:
                if self._ref[block] != 1 or self._key[block] is not None:
                    _broken(f"owner {owner} may write block {block}, which is shared or cached")
        free = set(self._free)
        if len(free) != len(self._free):
            _broken("free pool holds a block twice")
        for block in range(self.num_blocks):
            live, cached, is_free = self._ref[block] > 0, block in self._lru, block in free
            if live + cached + is_free != 1:
                _broken(f"block {block}: live={live} cached={cached} free={is_free}")
            if self._ref[block] != holders[block]:
                _broken(f"block {block}: ref {self._ref[block]} but {holders[block]} tables")
            if (self._key[block] is None) != is_free and not live:
                _broken(f"block {block}: key {self._key[block]!r} disagrees with its state")
        keyed: list[tuple[BlockKey, int]] = list(self._by_hash.items())
        keyed += [((p, c), b) for p, d in self._partials.items() for c, b in d.items()]
        for key, block in keyed:
            if self._key[block] != key:
                _broken(f"cache maps {key!r} to block {block}, whose key is {self._key[block]!r}")
        if len(keyed) != sum(k is not None for k in self._key):
            _broken("a block carries a key the cache does not map")

    # ---- internals --------------------------------------------------------

    def _seq(self, owner: int) -> _Seq:
        seq = self._seqs.get(owner)
        if seq is None:
            raise RuntimeError(f"owner {owner} holds no block table")
        return seq

    def _checked_match(self, num_tokens: int, match: PrefixMatch | None) -> PrefixMatch:
        if type(num_tokens) is not int or num_tokens < 1:
            raise ValueError(f"num_tokens must be a positive int, got {num_tokens!r}")
        if match is None:
            return PrefixMatch.empty(self.block_size)
        if match.block_size != self.block_size or match.num_tokens > num_tokens - 1:
            raise ValueError(
                f"match of {match.num_tokens} tokens (block_size {match.block_size}) "
                f"does not fit {num_tokens} tokens (block_size {self.block_size})"
            )
        pairs: list[tuple[int, BlockKey | None]] = list(
            zip(match.block_ids, match.block_hashes, strict=True)
        )
        if match.cow_src is not None:
            pairs.append((match.cow_src, match.cow_key))
        for block, key in pairs:
            if self._key[block] != key or key is None:
                raise RuntimeError(f"stale match: block {block} no longer holds {key!r}")
        return match

    def _available(self, m: PrefixMatch) -> int:
        used = {*m.block_ids, *(() if m.cow_src is None else (m.cow_src,))}
        pinned = sum(1 for b in used if self._ref[b] == 0)
        return len(self._free) + len(self._lru) - pinned

    def _draw(self) -> int:
        got = self._reclaim()
        if got is None:  # callers check `can_allocate` first
            _broken("a block was drawn with none free or cached")
        block, evicted = got
        if isinstance(evicted, int) and self.listener is not None:
            self.listener.removed([evicted])  # a partial block was never announced
        if evicted is not None:
            self._evictions += 1
        self._ref[block] = 1
        return block


def _broken(what: str) -> NoReturn:
    raise RuntimeError(f"block manager invariant broken: {what}")
