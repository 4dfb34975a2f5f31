"""The reference engine's carry: its events translated into calls on the carry service.

What it is for: the reference engine admits a sequence, runs its prefill chunk by chunk,
decodes, and finishes, cancels or drops it; `CarryRuntime` turns each of those events into
calls on the one carry service (`service.CarryService`, which TensorRT-LLM's resource
manager uses too) and keeps what only this engine has: the sequence tickets of the hidden
store, the drafter policies (`carry`, `rebuild`, `blind`, `off`), and the rows this engine
builds itself, right after each prefill chunk's target forward (`build_chunk`), from that
chunk's hidden rows while the ticket still owns them. It decides; the backend computes.

A warm turn under `carry`, in pair-key space (the appended rows are built chunk by chunk as
the prefill of `[prefill_from, L)` runs):

```
  | carried rows (kept) | skipped keys | appended rows |
  0              last_pair_key   prefill_from     L - 2
```

What each policy builds on a warm turn (the prefix cache serves `[0, prefill_from)`):
- `carry`: adopted rows + the new span's rows; refused -> as `blind`;
- `blind` (TensorRT-LLM's): the new span's rows only (keys `prefill_from..L-2`);
- `rebuild`: the engine ignores the prefix cache, so the prefill runs once from position 0
  and every key's row is built (full context, full cost);
- cold turn, every policy but `off`: every key's row (the drafter prompt prefill).

Where rows live between turns is the service's home: with `bf16` they stay in the drafter
pool's blocks (`PoolHome`: zero copy, common-prefix blocks shared between entries, pool
pressure may reclaim them); with a packed format (fp8, nvfp4) they are gathered into the
carry's device arena in that form at the turn's end and scattered into fresh blocks on
adoption (`ArenaHome`, as TensorRT-LLM's draft pages are). A host tier, if configured, is
the service's.

Invariants:
- Every drafter block is free or referenced by its owners (live sequences, carried entries),
  and only a block one owner alone holds is written (`DrafterKVPool.check()`).
- Live sequences always win: a pool grow that runs short evicts carried entries in the
  store's victim order (`pool_pressure`) before any sequence loses its drafter.
- A turn that finds no entry of its own gets `NoCarry(reason)`. A turn that adopted
  nothing (a miss) deposits the rows it built: keys from its reused depth on, a
  known-invalid prefix below them (the compacted pool simply holds no row there).
- A cancelled turn deposits what it holds: every row was adopted or built from this
  ticket's hidden rows and is valid for the tokens it consumed.
- Rows are adopted only by the entry's own non-zero carry key, at most once, and hidden rows
  are read only under the reading sequence's own ticket. The adopt decision is taken at
  admission against the rows this ticket's prefill will write, so it never depends on timing.
- No exception leaves `prepare`, `build_chunk`, `finish`, `cancel` or `release` (the service's
  `ledger.guarded`; a pool-exhaustion `PoolExhaustedError` from `build_chunk` aside, the
  engine's own fallback, and a caller's bad argument, its ValueError): a fault costs that turn
  its carry, is counted and logged once per (step, class) by the service's fault ledger, and
  the service repairs; the engine serves the next step. Output never depends on the carry.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..core import (
    NO_CARRY_REASONS,
    CarriedDrafter,
    CarryMemory,
    CarryOutcome,
    DrafterContext,
    carry_armed_with,
    carry_eviction,
    carry_host_memory,
    carry_idle_s,
    carry_memory,
    carry_row_dtype,
    carry_share,
    carry_slots,
    log_adopt,
    mtp_max_seqs,
    parse_carry_host_memory,
    parse_carry_memory,
    plan_append,
)
from ..core.outcome import Adopted, Fault
from ..core.plan import chunk_keys
from ..core.row_format import check_row_dtype
from ..core.session import TicketCounter
from ..core.store_range import StoreRange
from ..dataplane.arena import Arena, torch_allocate
from ..dataplane.device_ints import device_tensor
from ..dataplane.kv_pool import BlockKeys, CarriedBlocks, DrafterKVPool, PoolExhaustedError
from ..dataplane.row_codec import RowCodec, Rows, codec_for
from ..service import CarryService, CarryStats, guarded, host_tier
from ..service.homes import ArenaHome, PoolHome, RowHome, Runs
from .backend import CarryBackend
from .policy import DrafterPolicy

logger = logging.getLogger("trtllm_mtp_carry")

__all__ = ["CarryRuntime", "CarryStats", "DrafterBuild", "DrafterPrep", "SequenceRows"]


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


class SequenceRows:
    """A drafter pool sequence as the carry's device arena reads and writes it (`RowPages`)."""

    def __init__(self, pool: DrafterKVPool, seq_id: int) -> None:
        self.pool = pool
        self.seq_id = seq_id

    def gather_into(self, codec: RowCodec, out: Rows, runs: Runs) -> None:
        """The sequence's rows, in row order, into `out` (its keys are `runs`)."""
        held = self.pool.sequence(self.seq_id)
        codec.gather_blocks(self.pool.k_cache, self.pool.v_cache, held.block_table, held.rows, out=out)

    def scatter(self, codec: RowCodec, rows: Rows, runs: Runs, key: int) -> CarriedBlocks:
        """`rows` (keys `runs`) into fresh blocks carried under `key`, adopted by the sequence."""
        if codec.pool_dtype != self.pool.k_cache.dtype:
            raise ValueError(f"a {codec!r} cannot write this pool's {self.pool.k_cache.dtype} blocks")
        codec.check_fits(rows, self.pool.num_kv_heads, self.pool.head_dim)
        ids = self.pool.carry_in(key, int(rows.shape[0]), runs)
        try:
            codec.scatter_blocks(rows, self.pool.k_cache, self.pool.v_cache, ids)
        except BaseException:  # the fresh blocks go back; nothing half written stays carried
            self.pool.free_carried(key)
            raise
        return self.pool.adopt_carried(key, self.seq_id)


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1e3


class CarryRuntime:
    """The reference engine's carry: tickets, drafter policies and chunk builds over the one
    carry service (`service`), whose store, homes, lock, fault ledger and counters it uses.

    The carry is armed whenever configured (`carry_armed_with`), at any MTP dispatch cap:
    rows are built right after each prefill chunk from that chunk's hidden rows, read under
    the sequence's own ticket, so another sequence's chunk can never overwrite them first.
    `slots` (None: no cap), `memory` (a `carry_memory` value), `eviction` and `idle_s` (None:
    never) override the process settings `carry_slots()`, `carry_memory()`,
    `carry_eviction()` and `carry_idle_s()`; `clock` is the idle TTL's clock; `share`
    overrides `carry_share()`; `host_memory` overrides `carry_host_memory()` (the host tier);
    `row_dtype` overrides `carry_row_dtype()`: `bf16` keeps entries in the pool's blocks, a
    packed format (fp8, nvfp4) holds them in the carry's device arena of `memory` bytes.
    One runtime per pool: with rows in the pool it listens to the pool's evictions
    (`pool.on_evict`) and names their victims (`pool.victim`), and it refuses a pool that
    already carries another runtime's entries.
    """

    _UNSET: Any = object()

    def __init__(
        self,
        backend: CarryBackend,
        policy: DrafterPolicy | str = DrafterPolicy.CARRY,
        slots: int | None = _UNSET,
        memory: CarryMemory | str | int | float | None = None,
        eviction: str | None = None,
        idle_s: float | None = _UNSET,
        clock: Callable[[], float] = time.monotonic,
        share: bool | None = None,
        host_memory: str | int | None = None,
        row_dtype: str | None = None,
        allocate: Callable[[int, torch.device, bool], torch.Tensor] = torch_allocate,
    ) -> None:
        self.backend = backend
        self.policy = DrafterPolicy.parse(policy)
        self.config = DrafterContext(prefill=True, carry=self.policy is DrafterPolicy.CARRY)
        self.armed = carry_armed_with(self.config, mtp_max_seqs() > 1)
        pool = backend.drafter_pool
        if pool.carried_keys():
            raise RuntimeError(
                f"the drafter pool already carries {len(pool.carried_keys())} entries "
                "of another runtime: one runtime per pool (clear_slot() the old one first)"
            )
        self._tickets = TicketCounter()
        if slots is CarryRuntime._UNSET:
            slots = carry_slots()
        if idle_s is CarryRuntime._UNSET:
            idle_s = carry_idle_s() or None
        self.memory = carry_memory() if memory is None else parse_carry_memory(memory)
        self.row_dtype = carry_row_dtype() if row_dtype is None else check_row_dtype(row_dtype, "row_dtype")
        host_budget = (carry_host_memory() if host_memory is None
                       else parse_carry_host_memory(host_memory, "host_memory"))
        budget = self.memory.resolve(pool.nbytes)
        codec = codec_for(self.row_dtype, pool.k_cache.dtype)
        home: RowHome = (PoolHome(pool) if codec.name == "bf16" else
                         ArenaHome(codec, Arena.reserve(budget, pool.device, allocate=allocate),
                                   pool.num_kv_heads, pool.head_dim))
        self.service = CarryService(
            home, slots=slots, budget_bytes=budget, eviction=carry_eviction() if eviction is None else eviction,
            idle_s=idle_s, clock=clock, host_arena=host_tier.host_arena(host_budget, pool.device, allocate),
            share=carry_share() if share is None else bool(share), armed=self.armed, policy=self.policy.value,
            room_for=lambda entry: -(-entry.rows // pool.block_size) <= pool.num_free_blocks + pool.num_carried_blocks)
        self.ledger = self.service.ledger
        self.share = self.service.share
        if isinstance(home, PoolHome):  # live sequences reclaim carried blocks under pressure
            pool.on_evict = self.service.pressure_evict
            pool.victim = self.service.pressure_victim

    @property
    def _lock(self) -> Any:
        return self.service.lock

    # ---- per sequence ----------------------------------------------------------

    def draw_ticket(self) -> int:
        """A fresh non-zero ticket for an admitted sequence (the runtime's own counter)."""
        return self._tickets.draw()

    def carries(self, policy: DrafterPolicy | str | None = None) -> bool:
        """Whether a turn of drafter policy `policy` (None: the runtime's) makes a carry decision."""
        return self.armed and self._policy_of(policy) is DrafterPolicy.CARRY

    def _policy_of(self, policy: DrafterPolicy | str | None) -> DrafterPolicy:
        """`policy` parsed (None: the runtime's), before any guard: a bad one is the caller's
        ValueError, never a fault that costs a turn its carry."""
        return self.policy if policy is None else DrafterPolicy.parse(policy)

    def prepare(
        self,
        seq_id: int,
        ticket: int,
        session_hash: int,
        prompt: Sequence[int],
        prefill_from: int,
        policy: DrafterPolicy | str | None = None,
        warm: bool | None = None,
        session: int | None = None,
    ) -> DrafterBuild:
        """Decide, at admission, how sequence `seq_id` gets its drafter rows for `prompt`.

        `session_hash` is the carry key (`carry_key(session, cache_salt)`; the session hash
        itself when unsalted); `session` is the unsalted session hash, so a miss under a new
        salt is told apart (`new_salt`). `prefill_from` is the first position the target
        prefill will compute (the prefix cache serves `[0, prefill_from)`); the rows of every
        key the plan needs are then built by `build_chunk` right after each prefill chunk, from
        that chunk's hidden rows. `warm` (default `prefill_from > 0`) says the prefix cache held
        part of the prompt (a rebuild turn ignores it: `prefill_from == 0`).
        """
        return self._prepare(seq_id, ticket, session_hash, prompt, prefill_from, self._policy_of(policy),
                             warm, session)

    def _prepare_fault(self, seq_id: int, ticket: int, session_hash: int, prompt: Sequence[int],
                       prefill_from: int, policy: DrafterPolicy, warm: bool | None,
                       session: int | None) -> DrafterBuild:
        """`prepare` faulted: what it took is dropped (the rows it adopted are lost, the lease ends
        as `fault`) and the turn runs blind, in a fresh drafter sequence: rows for the span its
        prefill computes, as TensorRT-LLM's blind turn (none at all if even that faults)."""
        fault = self.ledger.faulted(seq_id) or Fault("prepare", "Exception")
        pool = self.backend.drafter_pool
        with self._lock:
            if policy is DrafterPolicy.CARRY and self.armed:
                self.service.counters.outcomes[fault.kind] += 1  # the decision, never carried out
            self._drop(seq_id, session_hash, "prepare")
            try:
                pool.allocate_sequence(seq_id)
            except Exception as exc:  # the drafter is off: the engine's first append drops it
                self.ledger.record("prepare", exc, seq_id)
                return DrafterBuild("off", fault, 0, None, 0, 0, 0.0)
        hi = max(prefill_from, min(len(prompt), self.backend.hidden_store.capacity))
        return self._unadopted(prefill_from, hi, len(prompt), policy,
                               prefill_from > 0 if warm is None else warm, fault, None)

    @guarded("prepare", _prepare_fault)
    def _prepare(self, seq_id: int, ticket: int, session_hash: int, prompt: Sequence[int],
                 prefill_from: int, policy: DrafterPolicy, warm: bool | None, session: int | None,
                 ) -> DrafterBuild:
        start = time.perf_counter()
        warm = prefill_from > 0 if warm is None else warm
        with self._lock:
            self.service.counters.turns["warm" if warm else "cold"] += 1
        if policy is DrafterPolicy.OFF:
            return DrafterBuild("off", None, 0, None, 0, 0, 0.0)
        pool = self.backend.drafter_pool
        # the hidden rows this ticket's prefill will write: [prefill_from, min(L, capacity))
        hi = max(prefill_from, min(len(prompt), self.backend.hidden_store.capacity))
        outcome: CarryOutcome | None = None
        if policy is DrafterPolicy.CARRY and self.armed:
            outcome = self.service.judge(session_hash, prompt, ticket, StoreRange(ticket, prefill_from, hi), session)
            log_adopt(outcome, session_hash, ticket, len(prompt))
        if isinstance(outcome, Adopted):
            build = self._adopt(seq_id, session_hash, outcome, start)
        else:
            pool.allocate_sequence(seq_id)
            build = self._unadopted(prefill_from, hi, len(prompt), policy, warm, outcome, start)
        if outcome is not None:  # counted once carried out, last (a fault before counts as `fault` only)
            self.service.count_outcome(outcome)
        return build

    def _take(self, seq_id: int, key: int, rows_kept: int) -> CarriedBlocks:
        """Adopt carry key `key`'s entry's first `rows_kept` rows into sequence `seq_id` (zero copy
        in the pool, or scattered into fresh blocks from the arena); the sequence holds a lease on
        `key` until it ends. RuntimeError if `key` has no entry."""
        if key == 0 or self.service.store.get(key) is None:
            raise RuntimeError(f"no carried entry of session 0x{key:016x} for sequence {seq_id} to take")
        pool = self.backend.drafter_pool
        dest: Any = seq_id if isinstance(self.service.home, PoolHome) else SequenceRows(pool, seq_id)
        held = self.service.adopt(seq_id, key, rows_kept, dest)
        assert held is not None
        return held

    def _adopt(self, seq_id: int, session_hash: int, outcome: Adopted, start: float) -> DrafterBuild:
        """Move the kept rows to the sequence; the planned span is built per chunk."""
        held = self._take(seq_id, session_hash, outcome.rows)
        kept_key = held.last_pair_key
        assert kept_key is not None and kept_key < outcome.first_key
        skipped = outcome.first_key - (kept_key + 1) if outcome.appended else 0
        with self._lock:
            self.service.counters.rows_adopted += outcome.rows
            self.service.counters.keys_skipped += skipped
        first = outcome.first_key if outcome.appended else None
        return DrafterBuild("carry", outcome, outcome.rows, first, 0, skipped, _ms(start))

    def _unadopted(self, prefill_from: int, hi: int, prompt_len: int, policy: DrafterPolicy, warm: bool,
                   outcome: CarryOutcome | None, start: float | None) -> DrafterBuild:
        """The build of a turn that adopts nothing (its drafter sequence allocated): the prefill's
        rows for every key when it runs from position 0 (`prefill`, `rebuild`), else blind's;
        `start` is when its prep began (None: a fault's, timed 0)."""
        plan = plan_append(None, prompt_len, prefill_from, hi)
        first = None if plan is None else plan.first_key
        prep_ms = 0.0 if start is None else _ms(start)
        if prefill_from == 0 and first is not None:  # the prefill runs from position 0
            mode = "rebuild" if policy is DrafterPolicy.REBUILD and warm else "prefill"
            return DrafterBuild(mode, outcome, 0, first, 0, 0, prep_ms)
        # faithful blind (TensorRT-LLM's): no rows over the reused prefix, rows for the
        # new span the prefill computes (its context phase runs the MTP layer over it)
        with self._lock:
            self.service.counters.turns_blind += 1
        return DrafterBuild("blind", outcome, 0, first, 0, 0, prep_ms)

    def _build_fault(self, seq_id: int, ticket: int, build: DrafterBuild, prompt: Sequence[int],
                     start: int, end: int) -> int:
        """`build_chunk` faulted: the chunk's keys get no rows (a gap the drafter reads around),
        the next chunk's are built as planned, and the turn deposits nothing."""
        self.service.repair()
        build.outcome = self.ledger.faulted(seq_id) or build.outcome
        try:
            span = chunk_keys(seq_id, build.next_key, start, end, len(prompt))
        except Exception:  # the plan itself is broken: build nothing more
            build.next_key = None
            return 0
        if span is not None:
            build.next_key = None if span[1] >= len(prompt) - 2 else span[1] + 1
        return 0

    @guarded("build", _build_fault, passthrough=(PoolExhaustedError,))
    def build_chunk(
        self, seq_id: int, ticket: int, build: DrafterBuild, prompt: Sequence[int],
        start: int, end: int,
    ) -> int:
        """Build the rows `build` still needs among keys `[start, end)`; returns how many.

        Call right after the target forward of prompt positions `[start, end)` wrote their
        hidden rows under `ticket`: the rows are read back under the ticket (the guard), so
        another sequence's rows can never be read.
        """
        span = chunk_keys(seq_id, build.next_key, start, end, len(prompt))
        if span is None:
            return 0
        t0 = time.perf_counter()
        a, b = span
        self.wait_restored(seq_id)
        append_computed_rows(self.backend, self.backend.drafter_pool, seq_id, ticket, prompt, a, b + 1)
        rows = b - a + 1
        build.next_key = None if b >= len(prompt) - 2 else b + 1
        build.rows_computed += rows
        build.prep_ms += _ms(t0)
        with self._lock:
            c = self.service.counters
            if build.mode == "carry":
                c.rows_appended += rows
            elif build.mode == "rebuild":
                c.rows_rebuilt += rows
            else:  # cold prefill, or a blind turn's new span
                c.rows_prefilled += rows
        return rows

    def finish(
        self,
        seq_id: int,
        session_hash: int,
        tokens: Sequence[int],
        policy: DrafterPolicy | str | None = None,
        ticket: int = 0,
        session: int | None = None,
        share: BlockKeys | None = None,
    ) -> bool:
        """End `seq_id`: deposit its rows under carry key `session_hash` (carry armed, non-zero
        key, the store admits them) or free them; returns whether they were deposited.

        The store's policy decides what leaves to make room, before any row moves; the key's
        older entry is replaced. `tokens` are the finished sequence's tokens (prompt plus
        output); its rows must cover pair keys up to at most `len(tokens) - 2`. `session` is
        the unsalted session (default: the key). `share` is the prefix keys of `tokens` in the
        request's sharing scope (its cache salt): with it (and sharing on, rows in the pool),
        full prefix blocks whose bytes equal a published block's are merged into it first.
        """
        return self._finish(seq_id, session_hash, tokens, self._policy_of(policy), ticket, session, share)

    def _finish_fault(self, seq_id: int, session_hash: int, tokens: Sequence[int], policy: DrafterPolicy,
                      ticket: int, session: int | None, share: BlockKeys | None) -> bool:
        """`finish` faulted, or the turn had: nothing is deposited, the rows are freed."""
        with self._lock:
            self.service.counters.skipped["fault"] += 1
            self._drop(seq_id, session_hash, "deposit")
        return False

    @guarded("deposit", _finish_fault, ends=True)
    def _finish(self, seq_id: int, session_hash: int, tokens: Sequence[int], policy: DrafterPolicy,
                ticket: int, session: int | None, share: BlockKeys | None) -> bool:
        pool = self.backend.drafter_pool
        self.wait_restored(seq_id)
        if not pool.has_sequence(seq_id):  # policy off, or the drafter was dropped already
            self._not_deposited(seq_id, "not_carried")
            return False
        held = pool.sequence(seq_id)
        why = ("not_carried" if policy is not DrafterPolicy.CARRY or not self.armed else
               "no_conversation" if session_hash == 0 else "no_rows" if held.rows == 0 else None)
        if why is not None:
            self._not_deposited(seq_id, why)
            pool.free_sequence(seq_id)
            return False
        pool_home = isinstance(self.service.home, PoolHome)
        source: Any = seq_id if pool_home else SequenceRows(pool, seq_id)
        with self._lock:
            plan = self.service.plan_deposit(session_hash, source, held.rows, session, share)
            kept = plan is not None and self.service.deposit(
                plan, source, pool.sequence_runs(seq_id), tokens, ticket)
            if kept:
                self.service.deposited(seq_id)
            else:
                self.service.end_turn(seq_id)
        if pool.has_sequence(seq_id):  # refused, or gathered out of the pool's blocks
            pool.free_sequence(seq_id)
        return kept

    def _not_deposited(self, seq_id: int, why: str) -> None:
        with self._lock:
            self.service.counters.skipped[why] += 1
            self.service.end_turn(seq_id)

    def cancel(
        self,
        seq_id: int,
        session_hash: int,
        tokens: Sequence[int],
        policy: DrafterPolicy | str | None = None,
        ticket: int = 0,
        session: int | None = None,
        share: BlockKeys | None = None,
    ) -> bool:
        """A cancelled turn keeps its session's carry: deposit the rows `seq_id` holds, as `finish`.

        Every row in the pool was adopted or built from this ticket's hidden rows for the
        tokens the turn has consumed (`tokens`: the prompt and the verified output so far),
        so each is valid for the session's next turn, which keeps what its prompt still
        agrees with. Returns whether deposited.
        """
        kept = self.finish(seq_id, session_hash, tokens, policy, ticket, session, share)
        if kept:
            with self._lock:
                self.service.counters.turns_cancelled_kept += 1
        return kept

    def release(self, seq_id: int, reason: str = "not_deposited") -> None:
        """Free a sequence's drafter rows without depositing them (its drafter was dropped).

        If it had adopted a carried entry, the store remembers `reason` (a `NO_CARRY_REASONS`
        name) as why that key's next turn finds nothing (`fault` when a fault cost the turn
        its carry).
        """
        if reason not in NO_CARRY_REASONS:
            raise ValueError(f"reason must be one of {NO_CARRY_REASONS}, got {reason!r}")
        self._release(seq_id, reason)

    def _release_fault(self, seq_id: int, reason: str) -> None:
        """`release` faulted, or the turn had: its rows are freed, its lease ends as `fault`."""
        with self._lock:
            self._drop(seq_id, None, "release")

    @guarded("release", _release_fault, ends=True)
    def _release(self, seq_id: int, reason: str) -> None:
        self.wait_restored(seq_id)
        self.service.end_turn(seq_id, reason)
        pool = self.backend.drafter_pool
        if pool.has_sequence(seq_id):
            pool.free_sequence(seq_id)

    # ---- faults ------------------------------------------------------------------

    def note_fault(self, seq_id: int, step: str, exc: Exception) -> None:
        """The engine's own call into the data plane for `seq_id`'s drafter rows (a decode step's
        append, and the pressure evictions it runs) raised `exc`: count it as the turn's fault at
        `step` (`FAULT_STEPS`) and make the store and the pool agree again. The engine then
        drops the drafter (`release`): the turn deposits nothing."""
        self.ledger.record(step, exc, seq_id)
        self.service.repair()

    def take_fault(self, seq_id: int) -> Fault | None:
        """The fault that cost `seq_id`'s turn its carry (None: none), removed: each is read once."""
        return self.ledger.take(seq_id)

    def _drop(self, seq_id: int, key: int | None, step: str) -> None:
        """A faulted turn's carry state goes (caller holds the lock): its lease ends as `fault`,
        its drafter rows are freed (after any copy back into them), and the service repairs."""
        self.service.drop_turn(seq_id, key)
        pool = self.backend.drafter_pool
        try:
            if pool.has_sequence(seq_id):
                pool.free_sequence(seq_id)
        except Exception as exc:  # counted; the rows stay with the sequence (a later release frees them)
            self.ledger.record(step, exc, seq_id)
        self.service.repair()

    # ---- carried entries ------------------------------------------------------------

    def clear_slot(self) -> None:
        """Drop every carried entry and free its rows (counted as `cleared`)."""
        self.service.clear()

    def forget_session(self, session_hash: int) -> int:
        """Drop the rows carried for session `session_hash` under every salt (the session
        ended); returns the rows freed (0 when it held none)."""
        return self.service.forget_session(session_hash)

    def expire(self) -> int:
        """Drop entries idle past the time-to-live now (admission does it too); returns how many."""
        return self.service.expire()

    @property
    def entry(self) -> CarriedDrafter | None:
        """The most recently deposited entry (with one slot: what the slot holds)."""
        with self._lock:
            return self.service.store.newest()

    def carried(self) -> tuple[CarriedDrafter, ...]:
        """Every carried entry, least recently deposited first (bookkeeping only)."""
        return self.service.carried()

    def check(self) -> None:
        """Raise RuntimeError unless the store's entries are exactly the rows held (the pool's
        carried entries in order, or the arena's extents) and the host tier's copies."""
        self.service.check()

    def stats(self) -> CarryStats:
        """A frozen snapshot of every counter (zeros listed for names never seen)."""
        pool = self.backend.drafter_pool
        with self._lock:
            ps = pool.stats()
            return self.service.stats(pool_blocks=pool.num_blocks, pool_block_size=pool.block_size,
                                      share_merges=ps.shared_merges, share_mismatches=ps.share_mismatches,
                                      live_turns=ps.num_sequences)

    def pack_times(self) -> tuple[list[float], list[float]]:
        """Wall ms of every carry out of the pool (deposit) and back (adoption) into the carry's
        arena (packed formats; both empty when rows stay in the pool)."""
        home = self.service.home
        if isinstance(home, ArenaHome):
            return list(home.pack_ms_each), list(home.unpack_ms_each)
        return [], []

    def wait_restored(self, seq_id: int) -> None:
        """Order the device's next use of `seq_id`'s pool rows after their copy back from the host
        tier, if one is in flight (CUDA: a GPU-side wait; otherwise nothing to do). The runtime
        calls it before it touches the sequence's rows; an engine calls it before its first
        draft step reads or writes them."""
        self.service.wait_restored(seq_id)


# ---- steps (the reference engine's policies' shared row build) ------------------------


def append_computed_rows(backend: CarryBackend, pool: Any, seq_id: int, ticket: int, tokens: Sequence[int],
                         first_key: int, end: int) -> None:
    """Compute `seq_id`'s drafter rows for pair keys `[first_key, end)` from ticket `ticket`'s hidden
    rows and append them to `pool` (the drafter pool, or the paired policy's: `append_rows`)."""
    hidden = backend.hidden_store.read(ticket, first_key, end)  # [rows, H] bf16, refused unless visible
    device = hidden.device
    # pinned and non-blocking: a pageable upload would make the host wait for the chunk's
    # target forward (tests/runtime/test_prep_syncs.py pins the prep's syncs at 0)
    next_tokens = device_tensor(tokens[first_key + 1 : end + 1], torch.int64, device)
    keys = torch.arange(first_key, end, dtype=torch.int64, device=device)
    k, v = backend.drafter_kv(next_tokens, hidden, keys)
    pool.append_rows(seq_id, range(first_key, end), k, v)  # host-known keys: no sync
