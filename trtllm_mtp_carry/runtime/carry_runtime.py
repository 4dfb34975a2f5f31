"""The carry runtime: the carry store, sequence tickets, the admission plan, adopt and deposit.

What it is for: it keeps the carried entries (a `CarryStore` of `carry_slots()`
`CarriedDrafter`s keyed by session hash; their rows live in the drafter pool
under the same key) between executor requests and, when a sequence is
admitted, decides how its drafter gets rows (`prepare`); the engine then calls
`build_chunk` right after each prefill chunk's target forward, and the rows of
that chunk's keys are built from its hidden rows while the ticket still owns
them. It decides; the backend computes.

A warm turn under `carry`, in pair-key space (the appended rows are built
chunk by chunk as the prefill of `[prefill_from, L)` runs):

```
  | carried rows (kept) | skipped keys | appended rows |
  0              last_pair_key   prefill_from     L - 2
```

What each policy builds on a warm turn (prefix cache serves `[0, prefill_from)`):
- `carry`: adopted rows + the new span's rows; refused -> as `blind`;
- `blind` (TensorRT-LLM's): the new span's rows only (keys `prefill_from..L-2`);
- `rebuild`: the engine ignores the prefix cache, so the prefill runs once from
  position 0 and every key's row is built (full context, full cost);
- cold turn, every policy but `off`: every key's row (the drafter prompt prefill).

Invariants:
- Every drafter block is owned by exactly one of: a live sequence, one carried
  entry, the free pool (`DrafterKVPool.check()` proves it); adoption moves
  blocks out of the entry (zero copy), so two sequences never own the same rows.
- The store and the pool carry the same keys in the same order (`check()`);
  live sequences always win: a pool grow that runs short evicts carried
  entries oldest first (counted as `pool_pressure`) before any sequence
  loses its drafter.
- Rows are adopted only by the entry's own non-zero session, at most once (the
  entry leaves the store), and hidden rows are read only under the reading
  sequence's own ticket (the store refuses any other read). The adopt
  decision is taken at admission against the rows this ticket's prefill will
  write, so it never depends on timing.
- Any refusal falls back to the no-carry path. Output never depends on the
  carry, because the target verifies every draft.
- The carry is armed whenever configured, at any MTP dispatch cap: per-chunk
  rows make the model-level hidden store safe under interleaved prefills.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..core import (
    OUTCOME_KINDS,
    CarriedDrafter,
    CarryOutcome,
    CarryStore,
    DrafterContext,
    carry_armed_with,
    carry_slots,
    decide_adopt,
    log_adopt,
    log_store,
    mtp_max_seqs,
    plan_append,
)
from ..core.outcome import Adopted
from ..core.session import TicketCounter
from ..core.store_range import StoreRange
from ..dataplane.kv_pool import CarriedBlocks
from .backend import CarryBackend
from .policy import DrafterPolicy


@dataclass(frozen=True)
class DrafterPrep:
    """How one turn's drafter was prepared.

    `mode` is `carry` (adopted), `prefill` (cold full prefill), `rebuild`,
    `blind` or `off`; `outcome` is the carry decision when one was taken.
    """

    mode: str
    outcome: CarryOutcome | None
    rows_kept: int
    rows_computed: int
    keys_skipped: int
    prep_ms: float

    def describe(self) -> str:
        """One line for logs and the per-turn table."""
        if self.outcome is None:
            return self.mode
        if self.mode == "carry":
            return str(self.outcome)
        return f"{self.mode} ({self.outcome})"


@dataclass
class DrafterBuild:
    """What admission decided for one sequence's drafter rows, filled in chunk by chunk.

    `next_key` is the next pair key to build (None: nothing left to build);
    `prep()` freezes it into the turn's `DrafterPrep` once the prefill is done.
    """

    mode: str
    outcome: CarryOutcome | None
    rows_kept: int
    next_key: int | None
    rows_computed: int
    keys_skipped: int
    prep_ms: float

    def prep(self) -> DrafterPrep:
        """The frozen record of how this turn's drafter was prepared."""
        return DrafterPrep(self.mode, self.outcome, self.rows_kept, self.rows_computed,
                           self.keys_skipped, self.prep_ms)


@dataclass(frozen=True)
class CarryStats:
    """A frozen snapshot of the runtime's counters.

    `outcomes` counts each carry decision by kind (`adopted` and every refusal);
    `evictions` counts carried entries that left unadopted, by cause
    (`EVICTION_CAUSES`); `slots_held`/`blocks_held`/`slot_rows` describe what the
    store holds now, out of `carry_slots` slots and a pool of `pool_blocks`
    blocks of `pool_block_size` rows.
    """

    armed: bool
    policy: str
    outcomes: dict[str, int]
    rows_adopted: int
    rows_appended: int
    keys_skipped: int
    rows_prefilled: int
    rows_rebuilt: int
    turns_blind: int
    deposits: int
    slot_rows: int
    adoptions: int = 0
    evictions: dict[str, int] = field(default_factory=dict)
    carry_slots: int = 1
    slots_held: int = 0
    blocks_held: int = 0
    pool_blocks: int = 0
    pool_block_size: int = 0


@dataclass
class _Counters:
    outcomes: Counter[str] = field(default_factory=Counter)
    rows_adopted: int = 0
    rows_appended: int = 0
    keys_skipped: int = 0
    rows_prefilled: int = 0
    rows_rebuilt: int = 0
    turns_blind: int = 0
    deposits: int = 0


class CarryRuntime:
    """Owns the carry store and the tickets; plans and deposits each sequence's drafter rows.

    The carry is armed whenever configured (`carry_armed_with`), at any MTP
    dispatch cap: rows are built right after each prefill chunk from that
    chunk's hidden rows, read under the sequence's own ticket, so another
    sequence's chunk can never overwrite them first. `slots` overrides
    `carry_slots()` (tests, engines that size the store themselves).
    One runtime per pool: it listens to the pool's evictions (`pool.on_evict`),
    and refuses a pool that already carries another runtime's entries.
    """

    def __init__(
        self,
        backend: CarryBackend,
        policy: DrafterPolicy | str = DrafterPolicy.CARRY,
        slots: int | None = None,
    ) -> None:
        self.backend = backend
        self.policy = DrafterPolicy.parse(policy)
        self.config = DrafterContext(prefill=True, carry=self.policy is DrafterPolicy.CARRY)
        self.armed = carry_armed_with(self.config, mtp_max_seqs() > 1)
        if backend.drafter_pool.carried_keys():
            raise RuntimeError(
                f"the drafter pool already carries {len(backend.drafter_pool.carried_keys())} entries "
                "of another runtime: one runtime per pool (clear_slot() the old one first)"
            )
        self._tickets = TicketCounter()
        self._store = CarryStore(carry_slots() if slots is None else slots)
        self._counters = _Counters()
        self._lock = threading.RLock()  # stats() may be read from another thread; pool evictions re-enter
        backend.drafter_pool.on_evict = self._on_pool_evict

    # ---- per sequence ----------------------------------------------------------

    def draw_ticket(self) -> int:
        """A fresh non-zero ticket for an admitted sequence (the runtime's own counter)."""
        return self._tickets.draw()

    def prepare(
        self,
        seq_id: int,
        ticket: int,
        session_hash: int,
        prompt: Sequence[int],
        prefill_from: int,
        policy: DrafterPolicy | str | None = None,
        warm: bool | None = None,
    ) -> DrafterBuild:
        """Decide, at admission, how sequence `seq_id` gets its drafter rows for `prompt`.

        `prefill_from` is the first position the target prefill will compute (the
        prefix cache serves `[0, prefill_from)`); the rows of every key the plan
        needs are then built by `build_chunk` right after each prefill chunk, from
        that chunk's hidden rows. `warm` (default `prefill_from > 0`) says the prefix
        cache held part of the prompt (a rebuild turn ignores it: `prefill_from == 0`).
        """
        start = time.perf_counter()
        policy = self.policy if policy is None else DrafterPolicy.parse(policy)
        warm = prefill_from > 0 if warm is None else warm
        if policy is DrafterPolicy.OFF:
            return DrafterBuild("off", None, 0, None, 0, 0, 0.0)
        pool = self.backend.drafter_pool
        tokens = prompt  # decide_adopt compares without copying; nothing here mutates it
        # the hidden rows this ticket's prefill will write: [prefill_from, min(L, capacity))
        hi = max(prefill_from, min(len(tokens), self.backend.hidden_store.capacity))
        projected = StoreRange(ticket, prefill_from, hi)
        outcome: CarryOutcome | None = None
        if policy is DrafterPolicy.CARRY and self.armed:
            outcome = decide_adopt(self._candidate(session_hash), tokens, session_hash, ticket,
                                   projected)
            log_adopt(outcome, session_hash, ticket, len(tokens))
            with self._lock:
                self._counters.outcomes[outcome.kind] += 1
            if isinstance(outcome, Adopted):
                return self._adopt(seq_id, session_hash, outcome, start)
        pool.allocate_sequence(seq_id)
        plan = plan_append(None, len(tokens), prefill_from, hi)
        first = None if plan is None else plan.first_key
        if prefill_from == 0 and first is not None:  # the prefill runs from position 0
            mode = "rebuild" if policy is DrafterPolicy.REBUILD and warm else "prefill"
            return DrafterBuild(mode, outcome, 0, first, 0, 0, _ms(start))
        # faithful blind (TensorRT-LLM's): no rows over the reused prefix, rows for the
        # new span the prefill computes (its context phase runs the MTP layer over it)
        with self._lock:
            self._counters.turns_blind += 1
        return DrafterBuild("blind", outcome, 0, first, 0, 0, _ms(start))

    def build_chunk(
        self, seq_id: int, ticket: int, build: DrafterBuild, prompt: Sequence[int],
        start: int, end: int,
    ) -> int:
        """Build the rows `build` still needs among keys `[start, end)`; returns how many.

        Call right after the target forward of prompt positions `[start, end)`
        wrote their hidden rows under `ticket`: the rows are read back under the
        ticket (the guard), so another sequence's rows can never be read.
        """
        if build.next_key is None:
            return 0
        t0 = time.perf_counter()
        last_needed = len(prompt) - 2
        a, b = max(build.next_key, start), min(end - 1, last_needed)
        if a > b:
            return 0
        if a != build.next_key:
            raise RuntimeError(f"sequence {seq_id}: chunk [{start}, {end}) skips key "
                               f"{build.next_key} (chunks must run in order)")
        self._append(seq_id, ticket, prompt, a, b - a + 1)
        rows = b - a + 1
        build.next_key = None if b >= last_needed else b + 1
        build.rows_computed += rows
        build.prep_ms += _ms(t0)
        with self._lock:
            if build.mode == "carry":
                self._counters.rows_appended += rows
            elif build.mode == "rebuild":
                self._counters.rows_rebuilt += rows
            else:  # cold prefill, or a blind turn's new span
                self._counters.rows_prefilled += rows
        return rows

    def finish(
        self,
        seq_id: int,
        session_hash: int,
        tokens: Sequence[int],
        policy: DrafterPolicy | str | None = None,
        ticket: int = 0,
    ) -> None:
        """End `seq_id`: deposit its rows in the store (carry armed, non-zero session) or free them.

        The deposit is the newest entry; the session's older entry and, when every
        slot is held, the least recently deposited entries are evicted first.
        `tokens` are the finished sequence's tokens (prompt plus output); its
        rows must cover pair keys up to at most `len(tokens) - 2`.
        """
        policy = self.policy if policy is None else DrafterPolicy.parse(policy)
        pool = self.backend.drafter_pool
        if not pool.has_sequence(seq_id):
            return  # policy off: the sequence never held drafter rows
        rows = pool.sequence(seq_id)
        if policy is DrafterPolicy.CARRY and self.armed and session_hash != 0 and rows.rows > 0:
            with self._lock:
                for old in self._store.make_room(session_hash):  # one slot: the newest wins
                    pool.free_carried(old.session_hash)
                carried = pool.move_to_carried(seq_id, session_hash)
                entry = CarriedDrafter(
                    carried.block_table, carried.rows, carried.last_pair_key, tokens, session_hash
                )
                self._store.put(entry)
                self._counters.deposits += 1
            log_store(entry, ticket)
            return
        pool.free_sequence(seq_id)

    def release(self, seq_id: int) -> None:
        """Free a cancelled sequence's drafter rows (never deposited: its turn did not finish)."""
        pool = self.backend.drafter_pool
        if pool.has_sequence(seq_id):
            pool.free_sequence(seq_id)

    def clear_slot(self) -> None:
        """Drop every carried entry and free its blocks (counted as `cleared`)."""
        with self._lock:
            for old in self._store.clear():
                self.backend.drafter_pool.free_carried(old.session_hash)

    def forget_session(self, session_hash: int) -> int:
        """Drop the rows carried for `session_hash` (the session ended); returns the rows freed.

        A session that holds no carried rows is a no-op returning 0.
        """
        if session_hash == 0:
            return 0
        with self._lock:
            entry = self._store.evict(session_hash, "session_end")
            if entry is None:
                return 0
            self.backend.drafter_pool.free_carried(session_hash)
        return entry.rows

    @property
    def entry(self) -> CarriedDrafter | None:
        """The most recently deposited entry (with one slot: what the slot holds)."""
        with self._lock:
            return self._store.newest()

    def carried(self) -> tuple[CarriedDrafter, ...]:
        """Every carried entry, least recently deposited first (bookkeeping only)."""
        with self._lock:
            return self._store.entries()

    def check(self) -> None:
        """Raise RuntimeError unless the store and the pool carry the same entries, in order."""
        pool = self.backend.drafter_pool
        with self._lock:
            entries = self._store.entries()
        keys = tuple(e.session_hash for e in entries)
        if keys != pool.carried_keys():
            raise RuntimeError(f"carry store keys {keys} differ from the pool's {pool.carried_keys()}")
        for e in entries:
            held = pool.carried(e.session_hash)
            if held is None or (held.block_table, held.rows, held.last_pair_key) != (
                e.block_table, e.rows, e.last_pair_key
            ):
                raise RuntimeError(f"carried entry 0x{e.session_hash:016x} differs from the pool's {held}")

    def stats(self) -> CarryStats:
        """A frozen snapshot of every counter (zeros listed for outcomes never seen)."""
        with self._lock:
            c = self._counters
            return CarryStats(
                armed=self.armed,
                policy=self.policy.value,
                outcomes={kind: c.outcomes.get(kind, 0) for kind in OUTCOME_KINDS},
                rows_adopted=c.rows_adopted,
                rows_appended=c.rows_appended,
                keys_skipped=c.keys_skipped,
                rows_prefilled=c.rows_prefilled,
                rows_rebuilt=c.rows_rebuilt,
                turns_blind=c.turns_blind,
                deposits=c.deposits,
                slot_rows=self._store.rows_held,
                adoptions=self._store.adoptions,
                evictions=self._store.evictions(),
                carry_slots=self._store.slots,
                slots_held=len(self._store),
                blocks_held=self._store.blocks_held,
                pool_blocks=self.backend.drafter_pool.num_blocks,
                pool_block_size=self.backend.drafter_pool.block_size,
            )

    # ---- carried entries (the seam with the engine: signatures are stable) -----

    def _candidate(self, session_hash: int) -> CarriedDrafter | None:
        """The carried entry `decide_adopt` must judge for `session_hash` (None: nothing carried).

        The session's own entry when there is one; else the newest entry of another
        session, which `decide_adopt` refuses as ForeignSession (with one slot:
        exactly the seed's slot).
        """
        with self._lock:
            return self._store.candidate(session_hash)

    def _take(self, seq_id: int, session_hash: int, rows_kept: int) -> CarriedBlocks:
        """Move `session_hash`'s entry's first `rows_kept` rows to `seq_id` (zero copy).

        The entry leaves the store (never adopted twice); `seq_id` must not be live
        in the pool (or be live with no blocks). Returns what the sequence now holds.
        RuntimeError if the session has no entry.
        """
        with self._lock:
            if self._store.get(session_hash) is None or session_hash == 0:
                raise RuntimeError(
                    f"no carried entry of session 0x{session_hash:016x} for sequence {seq_id} to take"
                )
            held = self.backend.drafter_pool.adopt_carried(session_hash, seq_id, rows_kept=rows_kept)
            self._store.take(session_hash)
        return held

    def _on_pool_evict(self, session_hash: int) -> None:
        """The pool evicted `session_hash`'s rows for a live sequence: drop the entry too."""
        with self._lock:
            self._store.evict(session_hash, "pool_pressure")

    # ---- steps -----------------------------------------------------------------

    def _adopt(self, seq_id: int, session_hash: int, outcome: Adopted, start: float) -> DrafterBuild:
        """Move the kept rows to the sequence (zero copy); the planned span is built per chunk."""
        held = self._take(seq_id, session_hash, outcome.rows)
        kept_key = held.last_pair_key
        assert kept_key is not None and kept_key < outcome.first_key
        skipped = outcome.first_key - (kept_key + 1) if outcome.appended else 0
        with self._lock:
            self._counters.rows_adopted += outcome.rows
            self._counters.keys_skipped += skipped
        first = outcome.first_key if outcome.appended else None
        return DrafterBuild("carry", outcome, outcome.rows, first, 0, skipped, _ms(start))

    def _append(self, seq_id: int, ticket: int, tokens: Sequence[int], first_key: int, rows: int) -> None:
        """Compute and write drafter rows for keys `first_key .. first_key + rows - 1`."""
        store = self.backend.hidden_store
        pool = self.backend.drafter_pool
        end = first_key + rows
        hidden = store.read(ticket, first_key, end)  # [rows, H] bf16, refused unless visible
        device = hidden.device
        next_tokens = torch.tensor(tokens[first_key + 1 : end + 1], dtype=torch.int64, device=device)
        keys = torch.arange(first_key, end, dtype=torch.int64, device=device)
        k, v = self.backend.drafter_kv(next_tokens, hidden, keys)
        pool.append_rows(seq_id, keys, k, v)


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1e3
