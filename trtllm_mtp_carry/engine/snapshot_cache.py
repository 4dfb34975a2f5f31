"""SSM snapshots keyed by the prefix they summarise, under a byte budget; the resume planner.

What it is for: a hybrid model resumes a prompt at depth `d` only when both
the attention KV of tokens `[0, d)` and a snapshot of the SSM state after
token `d - 1` exist. The engine takes snapshots at the end of each turn and at
block boundaries of long prompts; this cache stores them as opaque objects
(the engine's cloned state tensors; only their `nbytes` is seen here) and
finds the deepest one that summarises a prompt's prefix.

```
  | KV and SSM snapshot reused | recomputed (prefill)            |
  0                 depth <= min(KV match, L - 1)                L
```

Invariants:
- An entry is keyed `(depth, prefix_hash key of tokens[:depth])`, `depth >= 1`.
- The bytes held never exceed `budget_bytes`: a put evicts least recently
  used entries (a hit counts as a use); a snapshot larger than the budget is
  refused.
- A snapshot shallower than `min_tokens` (`marconi_min_tokens()`, passed in by
  the engine) is never restored: the prompt is recomputed from position 0.
- Pure Python: no torch, no settings import.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from trtllm_mtp_carry.engine.prefix_hash import PrefixKeys

S = TypeVar("S")


@dataclass(frozen=True, slots=True)
class SnapshotStats:
    """Frozen snapshot of the cache's contents and counters."""

    num_entries: int
    num_bytes: int
    budget_bytes: int
    num_puts: int
    num_hits: int
    num_misses: int
    num_evictions: int
    num_rejected: int


@dataclass
class _Entry(Generic[S]):
    snapshot: S
    nbytes: int


class SnapshotCache(Generic[S]):
    """Snapshots of type `S` by `(depth, prefix key)`, LRU-evicted to stay within `budget_bytes`."""

    def __init__(self, budget_bytes: int, block_size: int) -> None:
        if type(budget_bytes) is not int or budget_bytes < 0:
            raise ValueError(f"budget_bytes must be a non-negative int, got {budget_bytes!r}")
        if type(block_size) is not int or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.budget_bytes = budget_bytes
        self.block_size = block_size
        self._entries: OrderedDict[tuple[int, int], _Entry[S]] = OrderedDict()  # oldest first
        self._depths: list[int] = []  # distinct depths held, ascending
        self._per_depth: dict[int, int] = {}
        self._bytes = 0
        self._puts = self._hits = self._misses = self._evictions = self._rejected = 0

    def put(self, tokens: Sequence[int] | PrefixKeys, depth: int, snapshot: S, nbytes: int) -> bool:
        """Store `snapshot` of the state after `tokens[:depth]`; False if it exceeds the budget.

        A snapshot already held for the same prefix is replaced.
        """
        keys = PrefixKeys.of(tokens, self.block_size)
        if type(depth) is not int or not 1 <= depth <= keys.num_tokens:
            raise ValueError(f"depth={depth!r} outside [1, {keys.num_tokens}]")
        if type(nbytes) is not int or nbytes < 0:
            raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
        if nbytes > self.budget_bytes:
            self._rejected += 1
            return False
        key = (depth, keys.key(depth))
        old = self._entries.pop(key, None)
        if old is None:
            self._add_depth(depth)
        else:
            self._bytes -= old.nbytes
        self._entries[key] = _Entry(snapshot, nbytes)
        self._bytes += nbytes
        self._puts += 1
        while self._bytes > self.budget_bytes:
            (old_depth, _), entry = self._entries.popitem(last=False)
            self._bytes -= entry.nbytes
            self._drop_depth(old_depth)
            self._evictions += 1
        return True

    def best_for(
        self, tokens: Sequence[int] | PrefixKeys, max_depth: int, min_depth: int = 1
    ) -> tuple[int, S] | None:
        """Deepest `(depth, snapshot)` with `tokens[:depth]` as its prefix and
        `min_depth <= depth <= max_depth`, or None. A hit counts as a use.

        Only depths the cache holds are tried, deepest first; each block of
        `tokens` is hashed at most once.
        """
        keys = PrefixKeys.of(tokens, self.block_size)
        hi = min(max_depth, keys.num_tokens)
        lo = max(min_depth, 1)
        i = bisect.bisect_right(self._depths, hi) - 1
        while i >= 0 and self._depths[i] >= lo:
            depth = self._depths[i]
            key = (depth, keys.key(depth))
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self._hits += 1
                return depth, entry.snapshot
            i -= 1
        self._misses += 1
        return None

    def stats(self) -> SnapshotStats:
        """Frozen snapshot of entries, bytes and counters."""
        return SnapshotStats(
            len(self._entries), self._bytes, self.budget_bytes, self._puts,
            self._hits, self._misses, self._evictions, self._rejected,
        )  # fmt: skip

    def _add_depth(self, depth: int) -> None:
        if depth not in self._per_depth:
            bisect.insort(self._depths, depth)
            self._per_depth[depth] = 0
        self._per_depth[depth] += 1

    def _drop_depth(self, depth: int) -> None:
        self._per_depth[depth] -= 1
        if self._per_depth[depth] == 0:
            del self._per_depth[depth]
            del self._depths[bisect.bisect_left(self._depths, depth)]


def restore_decision(matched_depth: int, min_tokens: int) -> bool:
    """Whether a snapshot at `matched_depth` is restored: `matched_depth >= min_tokens`
    and `matched_depth > 0` (`min_tokens == 0` removes the floor)."""
    for name, value in (("matched_depth", matched_depth), ("min_tokens", min_tokens)):
        if type(value) is not int or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return matched_depth > 0 and matched_depth >= min_tokens


class HasNumTokens(Protocol):
    """Anything that says how many prompt tokens it covers (e.g. `PrefixMatch`)."""

    @property
    def num_tokens(self) -> int: ...


@dataclass(frozen=True)
class ResumePlan(Generic[S]):
    """Where a prompt resumes: restore `snapshot` and the KV of `[0, depth)`, or recompute from 0.

    `restore` is True exactly when `depth > 0`; `reason` says why, for logs.
    The engine trims its KV match to `depth` (`PrefixMatch.trimmed(depth)`).
    """

    depth: int
    restore: bool
    reason: str
    snapshot: S | None = None


def plan_resume(
    prompt: Sequence[int] | PrefixKeys,
    block_match: int | HasNumTokens,
    snapshot_lookup: Callable[[Sequence[int] | PrefixKeys, int, int], tuple[int, S] | None],
    min_tokens: int,
) -> ResumePlan[S]:
    """Deepest `d <= len(prompt) - 1` with both KV (`block_match` tokens) and a snapshot.

    Restores only when `restore_decision(d, min_tokens)`; otherwise depth 0.
    `snapshot_lookup(prompt, max_depth, min_depth) -> (depth, snapshot) | None` is
    `SnapshotCache.best_for`; it is asked only for depths in `[max(min_tokens, 1), kv]`.
    """
    kv = block_match if isinstance(block_match, int) else block_match.num_tokens
    cap = len(prompt) - 1
    if type(kv) is not int or not 0 <= kv <= max(cap, 0):
        raise ValueError(f"KV match of {kv!r} tokens outside [0, {max(cap, 0)}] for this prompt")
    if kv == 0:
        return ResumePlan(0, False, "no cached KV prefix: recompute from 0")
    if not restore_decision(kv, min_tokens):
        return ResumePlan(
            0, False, f"KV match {kv} < marconi_min_tokens {min_tokens}: recompute from 0"
        )
    lo = max(min_tokens, 1)
    found = snapshot_lookup(prompt, kv, lo)
    if found is None:
        return ResumePlan(
            0, False, f"no SSM snapshot at depth in [{lo}, {kv}] (KV match {kv}): recompute from 0"
        )
    depth, snapshot = found
    if not lo <= depth <= kv or not restore_decision(depth, min_tokens):
        raise RuntimeError(f"snapshot_lookup returned depth {depth} outside [{lo}, {kv}]")
    return ResumePlan(
        depth, True, f"restore SSM snapshot at depth {depth} (KV match {kv})", snapshot
    )
