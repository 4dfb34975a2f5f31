"""`paired`: a model of TensorRT-LLM's paired ("joint") draft-KV reuse, for the reference engine.

What it is for: comparing the carry with what TensorRT-LLM's PR #19303 (open, tree
38198e34) does for a hybrid MTP model with block reuse on: it pairs a plain hybrid's
separate MTP draft pool on `_supports_draft_reuse_match_backoff` (True on
`MambaHybridCacheManagerV2` there; False on the QSA hybrid and DeepSeek-V4). Main-line
does not pair hybrids (`MambaHybridCacheManagerV2._supports_reuse_match_backoff = False`,
`mamba_cache_manager.py` @ 003f8d08), nor do the releases (1.3.0rc29, 1.4.0rc1)
(docs/TENSORRT-LLM.md, "TensorRT-LLM versions"). Paired, the draft KV
cache manager publishes its own blocks to a radix tree of its own
(`_can_publish_block_reuse = joint_kv_cache_reuse or not is_draft`), and on a warm turn the scheduler
reuses only the depth *both* pools still hold. The drafter is never blind, but
the target recomputes whatever the draft pool has already evicted.

How the model works, for a prompt of L tokens under `cache_salt` root `r`:

```
  | drafter rows from the tree (shared) | COW tail | new span's rows (built per chunk) |
  0                              16 * (d // 16)     d                                L - 2
  d = deepest SSM snapshot <= min(target match M, drafter match C)
```

- Publishing: when a paired sequence finishes, each of its drafter blocks
  (keys `[16i, 16i + 16)`) is published under the target's chained key of
  tokens `[0, 16(i + 1))` (`prefix_hash`, the same keys as the target's prefix
  cache, salt included) and the final partial block under the target's partial
  key `(parent, token bytes)`. First publisher wins, as in the target's cache.
  Blocks are shared read-only among every sequence whose prompt matches them
  (ref-counted); a block no sequence holds stays cached and is evicted least
  recently used first, only when the pool needs a block.
- Matching: the drafter match `C` is the number of leading pair keys whose
  rows the tree holds for this prompt, matched by the same chained keys as
  the target's. Row `k` is computed from `(t_{k+1}, hidden_k)`, so it depends
  on one token past its block (the drafter's lookahead; TensorRT-LLM's
  `reuse_match_backoff`): every published block records that token, and when
  the match's last block has another one than the prompt, its last row is not
  used. Interior blocks are used as matched (their last row carries their
  publisher's next token, as in TensorRT-LLM's token-keyed tree).
- Reuse: the target's resume depth is `min(M, C)` rounded down to an SSM
  snapshot (`plan_resume`); the rows of keys `[0, d)` are shared (whole blocks)
  or copied (the tail block, copy on write); the new span's rows are built per
  prefill chunk exactly as `blind` builds them.

Simplifications (each one is generous to `paired`, never to the carry):
- TensorRT-LLM backs the draft match off by the lookahead unconditionally; here
  the recorded lookahead token of the match's last block is compared, so a
  session continuing its own turn loses nothing. The reference engine's SSM snapshots are sparse (chunk ends and
  turn ends), so a blanket one-token backoff would round every warm turn down to
  an earlier snapshot: an artefact of this engine, not TensorRT-LLM's behaviour.
- TensorRT-LLM commits only prompt blocks (`per_request`/`per_conversation`
  commit at the end of context); here the drafter publishes every row it has,
  generated tokens included, as the reference engine's target cache does.
- Drafter blocks are published when the sequence finishes; TensorRT-LLM
  commits draft blocks at the end of context. A turn admitted while another
  session that shares its prefix is still decoding finds that session's
  target blocks but not yet its drafter blocks (counted as depth lost). This
  one is against paired; it never cost a recomputed token in the measured runs.
- One scheduler thread, no host offload of evicted blocks, one block size for
  both pools (16 tokens), no `max_num_turns` drop plan.

Invariants (`check()` proves them):
- Every block is in exactly one state: free; private to one live sequence
  (ref 1, not published); or published (in the tree, ref = the number of live
  sequences sharing it, LRU-evictable at ref 0).
- A sequence writes only rows past its shared blocks (its tail is private), so
  shared rows are never written; a published block's rows are those of the key
  it is published under, with the recorded lookahead token.
- Greedy output never depends on this policy: the target verifies every draft.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core import plan_append
from ..core.plan import chunk_keys
from ..dataplane.device_ints import device_copy, device_tensor
from ..dataplane.kv_pool import CarriedBlocks, PoolExhaustedError, gather_rows
from ..dataplane.ops import drafter_row_append_direct as drafter_row_append
from ..dataplane.rope import RopeConfig
from ..runtime.backend import CarryBackend
from ..runtime.carry_runtime import append_computed_rows
from .block_manager import RefCountedBlocks
from .prefix_hash import PrefixKeys, encode_tokens
from .snapshot_cache import ResumePlan, plan_resume

__all__ = ["DraftMatch", "PairedBuild", "PairedDraftPool", "PairedDrafts", "PairedPlan",
           "PairedPoolExhausted", "PairedPrep", "PairedStats"]

TreeKey = int | tuple[int, bytes]
"""A full block's chained hash, or `(parent hash, token bytes)` for a final partial block."""


class PairedPoolExhausted(PoolExhaustedError):
    """No free block and no evictable published block: the grow was refused, nothing changed."""


@dataclass(frozen=True)
class DraftMatch:
    """What the drafter tree holds for a prompt: rows of keys `[0, tokens)`.

    `chain[i]` is the block holding keys `[16i, 16i + 16)` (the last one may
    be partial or usable only in part); `tokens` counts the usable leading keys.
    """

    tokens: int
    chain: tuple[int, ...]

    @staticmethod
    def empty() -> DraftMatch:
        return DraftMatch(0, ())


@dataclass
class _Live:
    table: list[int]
    shared: int  # leading blocks of `table` that are published (read-only)
    rows: int = 0
    runs: list[list[int]] = field(default_factory=list)  # [first key, count] in row order

    @property
    def last_pair_key(self) -> int | None:
        return self.runs[-1][0] + self.runs[-1][1] - 1 if self.runs else None

    @property
    def dense_rows(self) -> int:
        """Leading rows whose key equals their row index (the publishable ones)."""
        return self.runs[0][1] if self.runs and self.runs[0][0] == 0 else 0


class PairedDraftPool(RefCountedBlocks):
    """The draft pool under paired reuse: paged rows `[num_blocks, block_size, Hkv, D]`,
    live sequences' block tables, and the published blocks' tree, ref-counted.

    Ownership calls name the sequence and raise RuntimeError on a double claim
    or a release without a hold; `PairedPoolExhausted` leaves the pool unchanged.
    """

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 rope: RopeConfig, device: torch.device | str = "cpu") -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if type(value) is not int or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_blocks, self.block_size, self.rope = num_blocks, block_size, rope
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        # k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] bf16
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.zeros(shape, dtype=torch.bfloat16, device=device)
        self.v_cache = torch.zeros(shape, dtype=torch.bfloat16, device=device)
        self._init_blocks(num_blocks)  # the LRU holds published blocks of ref 0
        self._next: list[int] = [-1] * num_blocks  # the lookahead token of a published block
        self._seqs: dict[int, _Live] = {}
        self.num_evictions = self.num_published = self.num_copies = 0
        self.peak_blocks_held = 0

    @property
    def device(self) -> torch.device:
        return self.k_cache.device

    @property
    def num_free_blocks(self) -> int:
        """Blocks neither live nor published (what a grow takes before evicting)."""
        return len(self._free)

    @property
    def num_tree_blocks(self) -> int:
        """Published blocks (shared or cached)."""
        return len(self._by_hash) + sum(len(s) for s in self._partials.values())

    def blocks_held(self) -> int:
        """Blocks not free: live sequences' private blocks plus every published block."""
        return self.num_blocks - len(self._free)

    # ---- the tree -------------------------------------------------------------

    def match(self, keys: PrefixKeys, prompt: Sequence[int]) -> DraftMatch:
        """The leading pair keys of `prompt` whose rows the tree holds (at most `len - 1`).

        Full blocks match by chained key, then the longest partial block under
        the same parent whose tokens agree. The last block of the match must
        have the prompt's token after it as its lookahead, else its last row is
        unusable. An interior block is used whatever its lookahead, as
        TensorRT-LLM's token-keyed draft tree does: its last row was built with
        its publisher's next token (a drafting inexactness, never an output one).
        """
        bs, cap = self.block_size, len(prompt) - 1
        chain: list[int] = []
        n = 0
        while (n + 1) * bs <= cap:
            block = self._by_hash.get(keys.full(n + 1))
            if block is None:
                break
            chain.append(block)
            n += 1
        depth = n * bs
        best, src = 0, None
        room = min(cap - depth, bs - 1)
        for chunk, block in (self._partials.get(keys.full(n), {}) if room > 0 else {}).items():
            r = min(len(chunk) // 8, room)
            if r <= best or chunk[: 8 * r] != keys.chunk(depth, depth + r):
                continue
            after = self._next[block] if r == len(chunk) // 8 else _token_at(chunk, r)
            usable = r if after == prompt[depth + r] else r - 1
            if usable > best:
                best, src = usable, block
        if src is not None:
            chain.append(src)
        elif chain and self._next[chain[-1]] != prompt[depth]:  # the lookahead the next key needs
            return DraftMatch(depth - 1, tuple(chain))
        return DraftMatch(depth + best, tuple(chain))

    def adopt(self, seq_id: int, found: DraftMatch, depth: int) -> CarriedBlocks:
        """Start `seq_id` with the rows of keys `[0, depth)` of `found` (`depth <= found.tokens`).

        Whole blocks are shared (ref +1); a tail inside a block is copied into a
        private block (the source is pinned while the copy's block is drawn).
        PairedPoolExhausted (nothing changed) if no block can be had for the copy.
        """
        if seq_id in self._seqs:
            raise RuntimeError(f"sequence {seq_id} is already live in the paired draft pool")
        if not 0 <= depth <= found.tokens:
            raise ValueError(f"depth={depth} outside [0, {found.tokens}] of this drafter match")
        n, r = divmod(depth, self.block_size)
        shared = list(found.chain[:n])
        for b in shared:
            self._take(b)
        table = list(shared)
        if r:
            src = found.chain[n]
            self._take(src)
            try:
                dst = self._draw()
            except PairedPoolExhausted:
                for b in [*shared, src]:
                    self._drop(b)
                raise
            self.k_cache[dst, :r] = self.k_cache[src, :r]
            self.v_cache[dst, :r] = self.v_cache[src, :r]
            self._ref[dst] = 1
            self._drop(src)
            self.num_copies += 1
            table.append(dst)
        self._seqs[seq_id] = _Live(table, n, depth, [[0, depth]] if depth else [])
        return self.sequence(seq_id)

    def publish_and_free(self, seq_id: int, tokens: Sequence[int], root: int) -> int:
        """End `seq_id`: publish its dense rows' blocks under `tokens`' keys, release the rest.

        `tokens` are the sequence's verified tokens (prompt and output); rows of
        keys up to `len(tokens) - 2` are publishable. Returns the blocks published.
        """
        seq = self._live(seq_id)
        bs = self.block_size
        rows = min(seq.dense_rows, len(tokens) - 1)
        keys = PrefixKeys(tokens, bs, root)
        published = 0
        full = rows // bs
        for i in range(seq.shared, full):  # private full blocks (shared ones are published)
            key = keys.full(i + 1)
            if key not in self._by_hash:
                self._publish(seq.table[i], key, tokens[(i + 1) * bs])
                self._by_hash[key] = seq.table[i]
                published += 1
        tail = rows - full * bs
        if tail and full >= seq.shared and full < len(seq.table):
            parent = keys.full(full)
            chunk = encode_tokens(tokens[full * bs: rows])
            siblings = self._partials.setdefault(parent, {})
            if chunk not in siblings:
                self._publish(seq.table[full], (parent, chunk), tokens[rows])
                siblings[chunk] = seq.table[full]
                published += 1
        self.free_sequence(seq_id)
        return published

    # ---- live sequences (the subset of DrafterKVPool the engine calls) ----------

    @property
    def num_live(self) -> int:
        """Live sequences holding rows."""
        return len(self._seqs)

    def has_sequence(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def sequence(self, seq_id: int) -> CarriedBlocks:
        """Snapshot of a live sequence's blocks, rows and newest key."""
        s = self._live(seq_id)
        return CarriedBlocks(tuple(s.table), s.rows, s.last_pair_key)

    def allocate_sequence(self, seq_id: int) -> None:
        """Register `seq_id` with no rows; RuntimeError if it is already live."""
        self.adopt(seq_id, DraftMatch.empty(), 0)

    def append_rows(self, seq_id: int, keys: torch.Tensor | range, k: torch.Tensor,
                    v: torch.Tensor) -> CarriedBlocks:
        """Append rows after the sequence's last (keys `[n]` int64 increasing, past its last key;
        k, v `[n, Hkv, D]` bf16 pre-RoPE); the rows land in private blocks only.

        A `range` of keys (step 1) is checked on the host in O(1) and costs no copy and no
        device sync; a tensor is copied to the host to be checked (a sync if on the device)."""
        # keys: [n] int64 or range; k, v: [n, Hkv, D] bf16 on the pool's device
        s = self._live(seq_id)
        consecutive = isinstance(keys, range) and keys.step == 1
        n = len(keys) if isinstance(keys, range) else int(keys.shape[0])
        if n == 0:
            return self.sequence(seq_id)
        last = s.last_pair_key
        if isinstance(keys, range) and consecutive:
            if last is not None and keys.start <= last:
                raise ValueError(f"first key {keys.start} must exceed sequence {seq_id}'s last key {last}")
            keys_dev = torch.arange(keys.start, keys.stop, dtype=torch.int64, device=self.device)
            runs = [[keys.start, n]]
        else:
            keys_cpu = (torch.tensor(list(keys), dtype=torch.int64) if isinstance(keys, range)
                        else keys.detach().to("cpu").long())
            if last is not None and int(keys_cpu[0]) <= last:
                raise ValueError(f"first key {int(keys_cpu[0])} must exceed sequence {seq_id}'s last key {last}")
            diffs = keys_cpu[1:] - keys_cpu[:-1]
            if n > 1 and int(diffs.min()) <= 0:
                raise ValueError(f"keys must be strictly increasing, got {keys_cpu.tolist()[:16]}")
            keys_dev = device_copy(keys_cpu, self.device)
            starts = [0] + (torch.nonzero(diffs != 1).flatten() + 1).tolist()
            runs = [[int(keys_cpu[a]), b - a] for a, b in zip(starts, [*starts[1:], n], strict=True)]
        need = -(-(s.rows + n) // self.block_size) - len(s.table)
        if need > len(self._free) + len(self._lru):
            raise PairedPoolExhausted(
                f"sequence {seq_id} needs {need} more drafter blocks, {len(self._free)} free and "
                f"{len(self._lru)} evictable of {self.num_blocks}")
        for _ in range(need):
            b = self._draw()
            self._ref[b] = 1
            s.table.append(b)
        table = device_tensor(s.table, torch.int32, self.device)
        drafter_row_append(k, v, keys_dev, self.k_cache, self.v_cache, table, s.rows,
                           self.rope.rotary_dim, self.rope.rope_theta, False)
        if s.runs and last is not None and runs[0][0] == last + 1:
            s.runs[-1][1] += runs.pop(0)[1]
        s.runs.extend(runs)
        s.rows += n
        return self.sequence(seq_id)

    def gather(self, seq_id: int, start_row: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(k [R', Hkv, D], v [R', Hkv, D], keys [R'] int64)` of rows `start_row ..`, in row order."""
        s = self._live(seq_id)
        return gather_rows(self.k_cache, self.v_cache, s.table, s.rows, s.runs, start_row)

    def free_sequence(self, seq_id: int) -> int:
        """Release `seq_id`'s blocks (tail first, so children age out before parents)."""
        s = self._live(seq_id)
        del self._seqs[seq_id]
        for b in reversed(s.table):
            self._drop(b)
        return len(s.table)

    def check(self) -> None:
        """Raise RuntimeError unless every block is in exactly one state with a true ref count."""
        refs = [0] * self.num_blocks
        for sid, s in self._seqs.items():
            if len(s.table) < -(-s.rows // self.block_size):
                raise RuntimeError(f"sequence {sid} has {s.rows} rows in {len(s.table)} blocks")
            for i, b in enumerate(s.table):
                refs[b] += 1
                if (i < s.shared) != (self._key[b] is not None):
                    raise RuntimeError(f"sequence {sid} block {b} at {i}: shared={i < s.shared}, "
                                       f"published={self._key[b] is not None}")
        free = set(self._free)
        if len(free) != len(self._free):
            raise RuntimeError("a block is on the free list twice")
        tree = set(self._by_hash.values()) | {b for s in self._partials.values() for b in s.values()}
        for b in range(self.num_blocks):
            if refs[b] != self._ref[b]:
                raise RuntimeError(f"block {b}: ref count {self._ref[b]}, held by {refs[b]} sequences")
            states = [b in free, b in tree, refs[b] > 0 and self._key[b] is None]
            if sum(states) != 1 or (b in tree) != (self._key[b] is not None):
                raise RuntimeError(f"block {b}: free={states[0]} published={states[1]} refs={refs[b]}")
            if refs[b] > 1 and self._key[b] is None:
                raise RuntimeError(f"private block {b} held by {refs[b]} sequences")
            if (b in self._lru) != (b in tree and refs[b] == 0):
                raise RuntimeError(f"block {b}: in LRU={b in self._lru}, refs={refs[b]}")

    # ---- internals ------------------------------------------------------------

    def _live(self, seq_id: int) -> _Live:
        s = self._seqs.get(seq_id)
        if s is None:
            raise RuntimeError(f"sequence {seq_id} is not live in the paired draft pool")
        return s

    def _publish(self, block: int, key: TreeKey, lookahead: int) -> None:
        self._key[block], self._next[block] = key, lookahead
        self.num_published += 1

    def _take(self, block: int) -> None:
        if self._key[block] is None:
            raise RuntimeError(f"block {block} is not published: it cannot be shared")
        super()._take(block)

    def _draw(self) -> int:
        """A free block (ref 0, no key): from the free list, else by evicting the LRU published one."""
        got = self._reclaim()
        if got is None:
            raise PairedPoolExhausted(f"no free or evictable drafter block of {self.num_blocks}")
        block, evicted = got
        if evicted is not None:
            self._next[block] = -1
            self.num_evictions += 1
        self.peak_blocks_held = max(self.peak_blocks_held, self.num_blocks - len(self._free))
        return block


def _token_at(chunk: bytes, i: int) -> int:
    """Token `i` of encoded tokens (little-endian int64)."""
    return int.from_bytes(chunk[8 * i: 8 * i + 8], "little", signed=True)


# ---- the policy: plan, prepare, build per chunk, publish -----------------------------------


@dataclass(frozen=True)
class PairedPlan:
    """Admission under `paired`: the target's match `M`, the drafter's `C`, and where it resumes.

    `resume` is the deepest SSM snapshot at or below `min(M, C)`; `uncapped_depth`
    is where the target alone would resume (what `blind` and `carry` get).
    """

    found: DraftMatch
    target_match: int
    uncapped_depth: int
    resume: ResumePlan[Any]

    @property
    def depth_lost(self) -> int:
        """Target-held depth the drafter tree lacks (evicted blocks, or the lookahead at a divergence)."""
        return max(0, self.target_match - self.found.tokens)

    @property
    def recomputed_for_cap(self) -> int:
        """Target tokens recomputed because of the cap (snapshot rounding included)."""
        return self.uncapped_depth - self.resume.depth


@dataclass(frozen=True)
class PairedPrep:
    """How one `paired` turn's drafter was prepared (the engine reads it like `DrafterPrep`)."""

    mode: str  # "paired" (rows from the tree), "prefill" (from position 0)
    outcome: None
    rows_kept: int
    rows_computed: int
    keys_skipped: int
    prep_ms: float
    note: str = ""

    def describe(self) -> str:
        """One line for logs and the per-turn table."""
        return f"{self.mode} ({self.note})" if self.note else self.mode


@dataclass
class PairedBuild:
    """What admission decided for a `paired` sequence's rows, filled in chunk by chunk."""

    mode: str
    rows_kept: int
    next_key: int | None
    note: str = ""
    outcome: None = None
    rows_computed: int = 0
    keys_skipped: int = 0
    prep_ms: float = 0.0

    def prep(self) -> PairedPrep:
        """The frozen record of how this turn's drafter was prepared."""
        return PairedPrep(self.mode, None, self.rows_kept, self.rows_computed, self.keys_skipped,
                          self.prep_ms, self.note)


@dataclass(frozen=True)
class PairedStats:
    """Counters of the `paired` policy since the engine started.

    `tree_hits` counts turns that reused drafter rows from the tree
    (`rows_from_tree` rows in all); `depth_lost` sums `PairedPlan.depth_lost`
    over warm turns and `tokens_recomputed_for_cap` their
    `recomputed_for_cap`; `blocks_held` is what the pool holds now (private
    and published), `blocks_peak` the most it ever held.
    """

    turns: int
    warm_turns: int
    tree_hits: int
    rows_from_tree: int
    depth_lost: int
    tokens_recomputed_for_cap: int
    rows_built: int
    blocks_published: int
    tree_evictions: int
    tail_copies: int
    tree_blocks: int
    blocks_held: int
    blocks_peak: int
    pool_blocks: int


class PairedDrafts:
    """The `paired` drafter policy of the reference engine over its own `PairedDraftPool`.

    The engine calls `plan` at admission (it caps the resume depth), `prepare`
    once the target blocks are allocated, `build_chunk` after each prefill
    chunk, `finish` (publish) or `release` (cancel) at the end.
    """

    def __init__(self, builder: CarryBackend, pool: PairedDraftPool) -> None:
        self.builder, self.pool = builder, pool
        self._turns = self._warm = self._hits = self._rows_tree = 0
        self._lost = self._recomputed = self._built = 0

    def plan(self, keys: PrefixKeys, prompt: Sequence[int], target_match: int,
             uncapped: ResumePlan[Any], lookup: Callable[..., Any], min_tokens: int) -> PairedPlan:
        """Cap the target's resume plan `uncapped` at what the drafter tree holds for `prompt`."""
        found = self.pool.match(keys, prompt)
        resume = uncapped
        if found.tokens < uncapped.depth:
            resume = plan_resume(keys, min(target_match, found.tokens), lookup, min_tokens)
        return PairedPlan(found, target_match, uncapped.depth, resume)

    def prepare(self, seq_id: int, ticket: int, prompt: Sequence[int], prefill_from: int,
                plan: PairedPlan, warm: bool) -> PairedBuild:
        """Give `seq_id` the tree's rows of keys `[0, prefill_from)` and plan the new span's rows.

        `prefill_from` is where the target prefill starts (`plan.resume.depth`, or 0
        when the engine admitted the turn cold); `warm` says the target cache held
        part of the prompt.
        """
        t0 = time.perf_counter()
        note = ""
        try:
            self.pool.adopt(seq_id, plan.found, prefill_from)
        except PoolExhaustedError:  # no block for the tail copy: the span's rows only, as blind
            self.pool.allocate_sequence(seq_id)
            note = "no block for the tail copy: tree rows not reused"
        kept = self.pool.sequence(seq_id).rows
        hi = max(prefill_from, min(len(prompt), self.builder.hidden_store.capacity))
        step = plan_append(kept - 1 if kept else None, len(prompt), prefill_from, hi)
        self._turns += 1
        if warm:
            self._warm += 1
            self._lost += plan.depth_lost
            self._recomputed += plan.recomputed_for_cap
        if kept:
            self._hits += 1
            self._rows_tree += kept
        if not note and warm:
            note = (f"tree {plan.found.tokens} of target {plan.target_match}, "
                    f"resume {prefill_from} of {plan.uncapped_depth}")
        mode = "paired" if prefill_from else "prefill"
        build = PairedBuild(mode, kept, None if step is None else step.first_key, note)
        build.prep_ms = (time.perf_counter() - t0) * 1e3
        return build

    def build_chunk(self, seq_id: int, ticket: int, build: PairedBuild, prompt: Sequence[int],
                    start: int, end: int) -> int:
        """Build the rows `build` still needs among keys `[start, end)` (as `CarryRuntime.build_chunk`)."""
        span = chunk_keys(seq_id, build.next_key, start, end, len(prompt))
        if span is None:
            return 0
        t0 = time.perf_counter()
        a, b = span
        append_computed_rows(self.builder, self.pool, seq_id, ticket, prompt, a, b + 1)
        rows = b - a + 1
        build.next_key = None if b >= len(prompt) - 2 else b + 1
        build.rows_computed += rows
        build.prep_ms += (time.perf_counter() - t0) * 1e3
        self._built += rows
        return rows

    def finish(self, seq_id: int, tokens: Sequence[int], root: int) -> None:
        """End `seq_id`: publish its rows' blocks under `tokens`' keys (salt `root`), free the rest."""
        if self.pool.has_sequence(seq_id):
            self.pool.publish_and_free(seq_id, tokens, root)

    def release(self, seq_id: int) -> None:
        """Free a cancelled (or drafter-off) sequence's rows without publishing them."""
        if self.pool.has_sequence(seq_id):
            self.pool.free_sequence(seq_id)

    def check(self) -> None:
        """The pool's invariants (`PairedDraftPool.check`)."""
        self.pool.check()

    def stats(self) -> PairedStats:
        """A frozen snapshot of the counters."""
        p = self.pool
        return PairedStats(self._turns, self._warm, self._hits, self._rows_tree, self._lost,
                           self._recomputed, self._built, p.num_published, p.num_evictions,
                           p.num_copies, p.num_tree_blocks, p.blocks_held(), p.peak_blocks_held,
                           p.num_blocks)
