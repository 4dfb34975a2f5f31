"""The carry runtime: the carry store, sequence tickets, the admission plan, adopt and deposit.

What it is for: it keeps the carried entries (a `CarryStore` of
`CarriedDrafter`s keyed by carry key, `carry_key(session, cache_salt)`, bounded
by `carry_memory()` bytes, an optional `carry_slots()` cap and a
`carry_idle_s()` time-to-live, evicted under `carry_eviction()`; their rows live
in the drafter pool under the same key) between executor requests and, when a sequence is
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
- Every drafter block is free or referenced by its owners (live sequences,
  carried entries), and only a block one owner alone holds is written
  (`DrafterKVPool.check()` proves the counts); adoption moves blocks out of the
  entry (zero copy), so two sequences never write the same rows.
- Entries share blocks only where their bytes are equal (`share`, on by
  default: a finished sequence's full prefix blocks merge into equal blocks
  published under the same prefix key, salt included, before it is carried);
  the store charges a shared block once. Sharing changes no row anyone reads,
  so adoption and its ownership checks are unchanged: an entry is adopted only
  by its own key, and a shared block is copied before anyone writes into it.
- Row format (`carry_row_dtype`): the rows' residence (`residence.py`, one
  object asked every question about the rows) decides where they live: with
  `bf16` entries stay in the pool's blocks (`PoolResidence`, below); with `fp8`
  each is packed out of the pool at deposit by its codec, its blocks freed, and
  unpacked into fresh blocks on adoption (`PackedResidence`): the store is
  charged the packed bytes, the pool carries nothing, and `check()` proves each
  tier's entries are exactly the packed copies.
- The store and the pool carry the same keys in the same order (`check()`);
  live sequences always win: a pool grow that runs short evicts carried
  entries in the store's victim order (counted as `pool_pressure`) before any
  sequence loses its drafter. The memory budget bounds carried rows only,
  never a live sequence's.
- A turn that finds no entry of its own gets `NoCarry(reason)`, counted by
  reason (`no_carry_reasons`); `ForeignSession` only ever means the seed's one
  slot holds another session's (or salt's) rows.
- A cancelled turn deposits what it holds (`cancel`): every row in the pool
  was built from this ticket's hidden rows or adopted, and is valid for the
  tokens it consumed, so the session's next turn adopts them as after a finish.
- Rows are adopted only by the entry's own non-zero session, at most once (the
  entry leaves the store), and hidden rows are read only under the reading
  sequence's own ticket (the store refuses any other read). The adopt
  decision is taken at admission against the rows this ticket's prefill will
  write, so it never depends on timing.
- Any refusal falls back to the no-carry path. Output never depends on the
  carry, because the target verifies every draft.
- No exception leaves `prepare`, `build_chunk`, `finish`, `cancel` or `release`
  (`_guarded`; a pool-exhaustion `PoolExhaustedError` from `build_chunk` aside, the
  engine's own fallback, and a caller's bad argument, its ValueError): a fault inside the carry store, the data plane or the host
  moves costs that turn its carry (`Fault(step, error)`: it adopts and deposits
  nothing more, a prepare fault runs the turn blind), is counted by exception class
  (`faults`) and step (`fault_steps`, `FAULT_STEPS`), logged once per (step, class),
  and `_repair` makes the store, the pool and the host or packed copies agree again,
  freeing what no one holds any more exactly once; the engine serves the next step.
- The carry is armed whenever configured, at any MTP dispatch cap: per-chunk
  rows make the model-level hidden store safe under interleaved prefills.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import torch

from ..core import (
    NO_CARRY_REASONS,
    OUTCOME_KINDS,
    CarriedDrafter,
    CarryMemory,
    CarryOutcome,
    CarryStore,
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
    log_store,
    mtp_max_seqs,
    parse_carry_host_memory,
    parse_carry_memory,
    plan_append,
)
from ..core.outcome import Adopted, Fault, NoCarry
from ..core.plan import chunk_keys
from ..core.row_format import check_row_dtype
from ..core.session import TicketCounter
from ..core.store_range import StoreRange
from ..dataplane.device_ints import device_tensor
from ..dataplane.kv_pool import BlockKeys, CarriedBlocks, PoolExhaustedError
from .backend import CarryBackend
from .policy import DrafterPolicy
from .residence import residence_for

logger = logging.getLogger("trtllm_mtp_carry")

FAULT_STEPS: tuple[str, ...] = (
    "prepare",  # admission: expiry, the adopt decision, the take (host restore, fp8 unpack), the adoption
    "build",  # a prefill chunk's drafter rows: the hidden-row read, the rows, their append (and pressure evictions)
    "append",  # the engine's decode-step drafter-row appends (`note_fault`), and their pressure evictions
    "deposit",  # finish/cancel: sharing, admission (eviction ranking), host demotion, the move, the put
    "release",  # a dropped drafter's rows freed and its lease ended
)
"""Where the runtime caught a fault, in the order `CarryStats.fault_steps` lists them."""

F = TypeVar("F", bound=Callable[..., Any])

FAULT_LOG = 4096
"""How many ended turns' faults `take_fault` keeps until the engine reads them (oldest dropped first)."""


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

    `outcomes` counts each carry decision by kind (`adopted` and every refusal),
    `no_carry_reasons` breaks `no_carry` down by why the session's own entry was
    absent (`NO_CARRY_REASONS`); `evictions` counts carried entries that left
    unadopted, by cause (`EVICTION_CAUSES`), `refusals` deposits the store
    refused (`REFUSAL_CAUSES`); `entries_held`/`bytes_held`/`blocks_held`/
    `slot_rows` describe what the store holds now (`blocks_held` counts a
    shared block once; `shared_blocks` are held by two or more entries; with
    `carry_share`, `share_merges` blocks merged into equal published ones and
    `share_mismatches` lookups found different bytes, taking `share_ms` in all),
    out of `carry_memory_bytes`
    (the budget), `carry_slots` (None: no cap) and a pool of `pool_blocks` blocks of
    `pool_block_size` rows; `turns_cancelled_kept` counts cancelled turns whose
    rows were deposited. `slots_held` is `entries_held` (its older name).
    Host tier (`carry_host_memory_bytes` > 0; all zero without one): `hits_device`/
    `hits_host` are adoptions by the tier their rows came from, `demotions` entries
    moved to host memory and `host_deposits` deposits the device refused that went
    there (`bytes_demoted`, `demote_ms` copying both), `bytes_restored`
    and `restore_ms` the copies back, `host_entries`/`host_bytes_held` what the host
    tier holds, `peak_device_bytes`/`peak_host_bytes` the most each tier held;
    `restore_wait_ms` is how long the GPU stream waited for an asynchronous copy
    back (CUDA; 0 on the CPU, where `restore_ms` is the copy itself). `pinned_pool_bytes`
    is the page-locked host memory the host tier really holds: its slab of exactly
    `carry_host_memory_bytes` (registered once; 0 on the CPU), plus a pressure victim's
    copy waiting for room, if any (exactly its bytes).
    `row_dtype` is the carried rows' format (`carry_row_dtype`); with `fp8`, `packs`/
    `pack_ms` are the deposits packed out of the pool and `unpacks`/`unpack_ms` the
    adoptions unpacked into fresh blocks (`packed_rows.PackedCarry`).
    Faults (exceptions inside the carry store, the data plane or the host moves, each
    costing one turn its carry): `faults` by exception class name (as the TensorRT-LLM
    adapter's `stats()["faults"]`), `fault_steps` by where they were caught (`FAULT_STEPS`),
    `turns_faulted` the turns they cost their carry (each once, at any step); `outcomes["fault"]`
    (and a front end's `mtp_carry_outcomes_total{kind="fault"}`) are the admissions
    whose carry decision faulted before it was carried out (instead of its kind).
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
    carry_slots: int | None = 1
    slots_held: int = 0
    blocks_held: int = 0
    carry_share: bool = False
    shared_blocks: int = 0
    share_merges: int = 0
    share_mismatches: int = 0
    share_ms: float = 0.0
    pool_blocks: int = 0
    pool_block_size: int = 0
    no_carry_reasons: dict[str, int] = field(default_factory=dict)
    refusals: dict[str, int] = field(default_factory=dict)
    entries_held: int = 0
    bytes_held: int = 0
    carry_memory_bytes: int = 0
    leases: int = 0
    turns_cancelled_kept: int = 0
    eviction_policy: str = ""
    idle_s: int = 0
    carry_host_memory_bytes: int = 0
    hits_device: int = 0
    hits_host: int = 0
    demotions: int = 0
    host_deposits: int = 0
    host_entries: int = 0
    host_bytes_held: int = 0
    bytes_demoted: int = 0
    bytes_restored: int = 0
    peak_device_bytes: int = 0
    peak_host_bytes: int = 0
    demote_ms: float = 0.0
    restore_ms: float = 0.0
    restore_wait_ms: float = 0.0
    pinned_pool_bytes: int = 0  # page-locked by the host tier: its slab (the budget, exactly)
    row_dtype: str = "bf16"
    packs: int = 0
    unpacks: int = 0
    pack_ms: float = 0.0
    unpack_ms: float = 0.0
    faults: dict[str, int] = field(default_factory=dict)
    fault_steps: dict[str, int] = field(default_factory=dict)
    turns_faulted: int = 0


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
    no_carry: Counter[str] = field(default_factory=Counter)
    cancelled_kept: int = 0
    share_ms: float = 0.0
    faults: Counter[str] = field(default_factory=Counter)  # by exception class name
    fault_steps: Counter[str] = field(default_factory=Counter)  # by FAULT_STEPS
    turns_faulted: int = 0


def _guarded(step: str, recover: str, ends: bool = False,
             passthrough: tuple[type[Exception], ...] = ()) -> Callable[[F], F]:
    """Wrap a runtime method called per sequence (`seq_id` first) so no fault leaves it: an
    exception (other than `passthrough`) is counted and logged as `step` (`_fault`) and
    the method named `recover`, called with the same arguments, answers instead. With `ends` (the turn's end:
    finish, release), a turn that faulted earlier goes straight to `recover` (it deposits
    nothing), and its fault is kept for `take_fault` afterwards. The wrapped method is private:
    its public caller checks the arguments first (`_policy_of`, `release`'s reason), so a
    caller's bad argument raises its ValueError and is never counted as a fault."""
    def wrap(method: F) -> F:
        @functools.wraps(method)
        def guarded(self: CarryRuntime, seq_id: int, *args: Any, **kwargs: Any) -> Any:
            try:
                if ends and seq_id in self._faulted:
                    return getattr(self, recover)(seq_id, *args, **kwargs)
                return method(self, seq_id, *args, **kwargs)
            except passthrough:
                raise
            except Exception as exc:
                self._fault(step, exc, seq_id)
                return getattr(self, recover)(seq_id, *args, **kwargs)
            finally:
                if ends:
                    self._end_turn(seq_id)
        return cast(F, guarded)
    return wrap


class CarryRuntime:
    """Owns the carry store and the tickets; plans and deposits each sequence's drafter rows.

    The carry is armed whenever configured (`carry_armed_with`), at any MTP
    dispatch cap: rows are built right after each prefill chunk from that
    chunk's hidden rows, read under the sequence's own ticket, so another
    sequence's chunk can never overwrite them first. `slots` (None: no cap),
    `memory` (a `carry_memory` value), `eviction` and `idle_s` (None: never)
    override the process settings `carry_slots()`, `carry_memory()`,
    `carry_eviction()` and `carry_idle_s()` (tests, engines that size the store
    themselves); `clock` is the idle TTL's clock; `share` overrides
    `carry_share()` (common-prefix blocks shared between entries);
    `host_memory` overrides `carry_host_memory()` (the store's host tier:
    entries leaving the device budget wait in host memory, `PoolHostMoves`);
    `row_dtype` overrides `carry_row_dtype()`: with `fp8` each entry is packed out
    of the pool at deposit (its blocks freed, `PackedCarry`) and unpacked into fresh
    blocks on adoption; common-prefix sharing then does not apply to carried entries.
    One runtime per pool: it listens to the pool's evictions (`pool.on_evict`),
    names their victims (`pool.victim`, asked again after each eviction), and refuses a pool that already
    carries another runtime's entries.
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
        pool = backend.drafter_pool
        if slots is CarryRuntime._UNSET:
            slots = carry_slots()
        if idle_s is CarryRuntime._UNSET:
            idle_s = carry_idle_s() or None
        self.memory = carry_memory() if memory is None else parse_carry_memory(memory)
        self.share = carry_share() if share is None else bool(share)
        self.row_dtype = carry_row_dtype() if row_dtype is None else check_row_dtype(row_dtype, "row_dtype")
        host_budget = (carry_host_memory() if host_memory is None
                       else parse_carry_host_memory(host_memory, "host_memory"))
        # where carried rows live (in the pool's blocks, or packed out of them): every question
        # about the rows goes to it, never a branch on the row format here
        self._residence = residence_for(self.row_dtype, pool, host_budget)
        self._store = CarryStore(slots, self.memory.resolve(pool.nbytes),
                                 carry_eviction() if eviction is None else eviction, idle_s, clock,
                                 block_nbytes=self._residence.block_nbytes, host_budget_bytes=host_budget,
                                 row_format=self._residence.row_format)
        self._store.host_moves = self._residence.host_moves
        self._counters = _Counters()
        self._adopted: dict[int, int] = {}  # seq_id -> carry key whose rows it adopted (a lease)
        self._lock = threading.RLock()  # stats() may be read from another thread; pool evictions re-enter
        self._faulted: dict[int, Fault] = {}  # seq_id -> its turn's first fault (live turns)
        self._turn_faults: OrderedDict[int, Fault] = OrderedDict()  # ended turns' faults, for take_fault
        self._logged: set[tuple[str, str]] = set()  # (step, exception class) already logged
        pool.on_evict = self._on_pool_evict
        pool.victim = self._pressure_victim

    # ---- per sequence ----------------------------------------------------------

    def draw_ticket(self) -> int:
        """A fresh non-zero ticket for an admitted sequence (the runtime's own counter)."""
        return self._tickets.draw()

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

        `session_hash` is the carry key (`carry_key(session, cache_salt)`; the
        session hash itself when unsalted); `session` is the unsalted session
        hash, so a miss under a new salt is told apart (`new_salt`).
        `prefill_from` is the first position the target prefill will compute (the
        prefix cache serves `[0, prefill_from)`); the rows of every key the plan
        needs are then built by `build_chunk` right after each prefill chunk, from
        that chunk's hidden rows. `warm` (default `prefill_from > 0`) says the prefix
        cache held part of the prompt (a rebuild turn ignores it: `prefill_from == 0`).
        """
        return self._prepare(seq_id, ticket, session_hash, prompt, prefill_from, self._policy_of(policy),
                             warm, session)

    @_guarded("prepare", "_prepare_fault")
    def _prepare(self, seq_id: int, ticket: int, session_hash: int, prompt: Sequence[int],
                 prefill_from: int, policy: DrafterPolicy, warm: bool | None, session: int | None,
                 ) -> DrafterBuild:
        start = time.perf_counter()
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
            with self._lock:
                self._expire()
                self._unreachable_host_entry(session_hash)
                outcome = self._store.judge(session_hash, tokens, ticket, projected, session)
            log_adopt(outcome, session_hash, ticket, len(tokens))
        if isinstance(outcome, Adopted):
            build = self._adopt(seq_id, session_hash, outcome, start)
        else:
            pool.allocate_sequence(seq_id)
            build = self._unadopted(prefill_from, hi, len(tokens), policy, warm, outcome, start)
        if outcome is not None:
            with self._lock:  # counted once carried out, last (a fault before counts as `fault` only)
                self._counters.outcomes[outcome.kind] += 1
                if isinstance(outcome, NoCarry):
                    self._counters.no_carry[outcome.reason] += 1
        return build

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
            self._counters.turns_blind += 1
        return DrafterBuild("blind", outcome, 0, first, 0, 0, prep_ms)

    @_guarded("build", "_build_fault", passthrough=(PoolExhaustedError,))
    def build_chunk(
        self, seq_id: int, ticket: int, build: DrafterBuild, prompt: Sequence[int],
        start: int, end: int,
    ) -> int:
        """Build the rows `build` still needs among keys `[start, end)`; returns how many.

        Call right after the target forward of prompt positions `[start, end)`
        wrote their hidden rows under `ticket`: the rows are read back under the
        ticket (the guard), so another sequence's rows can never be read.
        """
        span = chunk_keys(seq_id, build.next_key, start, end, len(prompt))
        if span is None:
            return 0
        t0 = time.perf_counter()
        a, b = span
        self.wait_restored(seq_id)
        self._append(seq_id, ticket, prompt, a, b - a + 1)
        rows = b - a + 1
        build.next_key = None if b >= len(prompt) - 2 else b + 1
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
        session: int | None = None,
        share: BlockKeys | None = None,
    ) -> bool:
        """End `seq_id`: deposit its rows under carry key `session_hash` (carry armed, non-zero
        key, the store admits them) or free them; returns whether they were deposited.

        The store's policy decides what leaves to make room (`admit`); the key's
        older entry is replaced. `tokens` are the finished sequence's tokens
        (prompt plus output); its rows must cover pair keys up to at most
        `len(tokens) - 2`. `session` is the unsalted session (default: the key).
        `share` is the prefix keys of `tokens` in the request's sharing scope
        (its cache salt; `PrefixKeys(tokens, pool.block_size, root)`): with it
        (and sharing on), full prefix blocks whose bytes equal a published
        block's are merged into it before the deposit (`DrafterKVPool.share_blocks`).
        """
        return self._finish(seq_id, session_hash, tokens, self._policy_of(policy), ticket, session, share)

    @_guarded("deposit", "_finish_fault", ends=True)
    def _finish(self, seq_id: int, session_hash: int, tokens: Sequence[int], policy: DrafterPolicy,
                ticket: int, session: int | None, share: BlockKeys | None) -> bool:
        pool = self.backend.drafter_pool
        self.wait_restored(seq_id)
        lease = self._adopted.pop(seq_id, None)
        if not pool.has_sequence(seq_id):  # policy off, or the drafter was dropped already
            self._end_lease(lease, "not_deposited")
            return False
        rows = pool.sequence(seq_id)
        if policy is DrafterPolicy.CARRY and self.armed and session_hash != 0 and rows.rows > 0:
            with self._lock:
                if share is not None and self.share and self._residence.shares:
                    t0 = time.perf_counter()
                    pool.share_blocks(seq_id, share)
                    self._counters.share_ms += _ms(t0)
                table, nbytes = self._residence.charge(seq_id, rows.rows)
                evicted = self._store.admit(session_hash, nbytes, session, blocks=table)
                offered = None if evicted is not None else self._deposit_host(
                    seq_id, session_hash, tokens, ticket, session, nbytes)
                if offered is not None:  # the sequence's rows went to the host tier, or are freed
                    return offered
                if evicted is not None:
                    for old in evicted:
                        self._free(old)
                    entry = self._carry_out(seq_id, session_hash, tokens)
                    self._store.put(entry, nbytes, session)
                    self._counters.deposits += 1
            if evicted is not None:
                log_store(entry, ticket)
                return True
        else:
            self._end_lease(lease, "not_deposited")
        pool.free_sequence(seq_id)
        return False

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

        Every row in the pool was adopted or built from this ticket's hidden rows
        for the tokens the turn has consumed (`tokens`: the prompt and the
        verified output so far), so each is valid for the session's next turn,
        which keeps what its prompt still agrees with. Returns whether deposited.
        """
        kept = self.finish(seq_id, session_hash, tokens, policy, ticket, session, share)
        if kept:
            with self._lock:
                self._counters.cancelled_kept += 1
        return kept

    def release(self, seq_id: int, reason: str = "not_deposited") -> None:
        """Free a sequence's drafter rows without depositing them (its drafter was dropped).

        If it had adopted a carried entry, the store remembers `reason`
        (a `NO_CARRY_REASONS` name) as why that key's next turn finds nothing
        (`fault` when a fault cost the turn its carry).
        """
        if reason not in NO_CARRY_REASONS:
            raise ValueError(f"reason must be one of {NO_CARRY_REASONS}, got {reason!r}")
        self._release(seq_id, reason)

    @_guarded("release", "_release_fault", ends=True)
    def _release(self, seq_id: int, reason: str) -> None:
        self.wait_restored(seq_id)
        self._end_lease(self._adopted.pop(seq_id, None), reason)
        pool = self.backend.drafter_pool
        if pool.has_sequence(seq_id):
            pool.free_sequence(seq_id)

    # ---- faults ------------------------------------------------------------------

    def note_fault(self, seq_id: int, step: str, exc: Exception) -> None:
        """The engine's own call into the data plane for `seq_id`'s drafter rows (a decode
        step's append, and the pressure evictions it runs) raised `exc`: count it as the
        turn's fault at `step` (`FAULT_STEPS`) and make the store and the pool agree again.
        The engine then drops the drafter (`release`): the turn deposits nothing."""
        self._fault(step, exc, seq_id)
        with self._lock:
            self._repair()

    def take_fault(self, seq_id: int) -> Fault | None:
        """The fault that cost `seq_id`'s turn its carry (None: none), removed: each is read once.
        Kept from the fault until read, for the last `FAULT_LOG` ended turns."""
        with self._lock:
            fault = self._turn_faults.pop(seq_id, None)
            return self._faulted.get(seq_id) if fault is None else fault

    def _fault(self, step: str, exc: Exception, seq_id: int | None) -> None:
        """An exception inside the carry at `step`: counted by class and step, logged once per
        (step, class), and `seq_id`'s turn marked (it adopts and deposits nothing more)."""
        error = type(exc).__name__
        with self._lock:
            c = self._counters
            c.faults[error] += 1
            c.fault_steps[step] += 1
            first = (step, error) not in self._logged
            self._logged.add((step, error))
            if seq_id is not None and seq_id not in self._faulted:
                self._faulted[seq_id] = Fault(step, error)
                c.turns_faulted += 1
        if first:
            logger.warning("mtp carry: %s raised %s (%s): that turn runs without the carry and the "
                           "engine goes on; later %s faults at %s are counted, not logged",
                           step, error, exc, error, step)

    def _end_turn(self, seq_id: int) -> None:
        """`seq_id`'s turn ended: its fault, if any, waits for `take_fault`."""
        with self._lock:
            fault = self._faulted.pop(seq_id, None)
            if fault is not None:
                self._turn_faults[seq_id] = fault
                while len(self._turn_faults) > FAULT_LOG:
                    self._turn_faults.popitem(last=False)

    def _prepare_fault(self, seq_id: int, ticket: int, session_hash: int, prompt: Sequence[int],
                       prefill_from: int, policy: DrafterPolicy, warm: bool | None,
                       session: int | None) -> DrafterBuild:
        """`prepare` faulted: what it took is dropped (the rows it adopted are lost, the lease ends
        as `fault`) and the turn runs blind, in a fresh drafter sequence: rows for the span its
        prefill computes, as TensorRT-LLM's blind turn (none at all if even that faults)."""
        fault = self._faulted.get(seq_id, Fault("prepare", "Exception"))
        pool = self.backend.drafter_pool
        with self._lock:
            if policy is DrafterPolicy.CARRY and self.armed:
                self._counters.outcomes[fault.kind] += 1  # the decision, never carried out
            self._drop(seq_id, session_hash, "prepare")
            try:
                pool.allocate_sequence(seq_id)
            except Exception as exc:  # the drafter is off: the engine's first append drops it
                self._fault("prepare", exc, seq_id)
                return DrafterBuild("off", fault, 0, None, 0, 0, 0.0)
        hi = max(prefill_from, min(len(prompt), self.backend.hidden_store.capacity))
        return self._unadopted(prefill_from, hi, len(prompt), policy,
                               prefill_from > 0 if warm is None else warm, fault, None)

    def _build_fault(self, seq_id: int, ticket: int, build: DrafterBuild, prompt: Sequence[int],
                     start: int, end: int) -> int:
        """`build_chunk` faulted: the chunk's keys get no rows (a gap the drafter reads around),
        the next chunk's are built as planned, and the turn deposits nothing."""
        with self._lock:
            self._repair()
            build.outcome = self._faulted.get(seq_id, build.outcome)
        try:
            span = chunk_keys(seq_id, build.next_key, start, end, len(prompt))
        except Exception:  # the plan itself is broken: build nothing more
            build.next_key = None
            return 0
        if span is not None:
            build.next_key = None if span[1] >= len(prompt) - 2 else span[1] + 1
        return 0

    def _finish_fault(self, seq_id: int, session_hash: int, tokens: Sequence[int], policy: DrafterPolicy,
                      ticket: int, session: int | None, share: BlockKeys | None) -> bool:
        """`finish` faulted, or the turn had: nothing is deposited, the rows are freed."""
        with self._lock:
            self._drop(seq_id, session_hash, "deposit")
        return False

    def _release_fault(self, seq_id: int, reason: str) -> None:
        """`release` faulted, or the turn had: its rows are freed, its lease ends as `fault`."""
        with self._lock:
            self._drop(seq_id, None, "release")

    def _drop(self, seq_id: int, key: int | None, step: str) -> None:
        """A faulted turn's carry state goes (caller holds the lock): its lease ends as `fault`
        (the one it holds, or `key`'s if no live turn holds it: taken just before the fault),
        its drafter rows are freed, and `_repair` frees what no one holds any more."""
        lease = self._adopted.pop(seq_id, None)
        if lease is None and key and self._store.leased(key) and key not in self._adopted.values():
            lease = key
        if lease is not None:
            self._store.end_lease(lease, "fault")
            self._residence.settle(lease)  # rows restored for it may still be in flight: wait first
        pool = self.backend.drafter_pool
        try:
            if pool.has_sequence(seq_id):
                pool.free_sequence(seq_id)
        except Exception as exc:  # counted; the rows stay with the sequence (a later release frees them)
            self._fault(step, exc, seq_id)
        self._repair()

    def _repair(self) -> None:
        """Make the store, the pool's carried entries and the host (or packed) copies agree after a
        fault (caller holds the lock): an entry whose rows are gone or differ leaves the store
        (`discard`, counted as evicted for `fault`); rows no entry holds are freed, each once."""
        self._residence.repair(self._store, live=set(self._adopted.values()))

    def clear_slot(self) -> None:
        """Drop every carried entry and free its blocks (counted as `cleared`)."""
        with self._lock:
            for old in self._store.clear():
                self._free(old)

    def forget_session(self, session_hash: int) -> int:
        """Drop the rows carried for session `session_hash` under every salt (the session
        ended); returns the rows freed. A session that holds no carried rows is a no-op returning 0.
        """
        if session_hash == 0:
            return 0
        with self._lock:
            entries = self._store.evict_session(session_hash, "session_end")
            for e in entries:
                self._free(e)
        return sum(e.rows for e in entries)

    def expire(self) -> int:
        """Drop entries idle past the time-to-live now (admission does it too); returns how many."""
        with self._lock:
            return self._expire()

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
        """Raise RuntimeError unless the store and the pool carry the same entries, in order (and
        the host tier's entries have exactly their host copies)."""
        with self._lock:
            self._residence.check(self._store)

    def stats(self) -> CarryStats:
        """A frozen snapshot of every counter (zeros listed for outcomes never seen)."""
        with self._lock:
            c = self._counters
            pool_stats = self.backend.drafter_pool.stats()
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
                carry_share=self.share,
                shared_blocks=self._store.shared_blocks,
                share_merges=pool_stats.shared_merges,
                share_mismatches=pool_stats.share_mismatches,
                share_ms=c.share_ms,
                pool_blocks=self.backend.drafter_pool.num_blocks,
                pool_block_size=self.backend.drafter_pool.block_size,
                no_carry_reasons={r: c.no_carry.get(r, 0) for r in NO_CARRY_REASONS},
                refusals=self._store.refusals(),
                entries_held=len(self._store),
                bytes_held=self._store.bytes_held,
                carry_memory_bytes=self._store.budget_bytes or 0,
                leases=self._store.leases,
                turns_cancelled_kept=c.cancelled_kept,
                eviction_policy=self._store.policy,
                idle_s=int(self._store.idle_s or 0),
                faults=dict(sorted(c.faults.items())),
                fault_steps={step: c.fault_steps.get(step, 0) for step in FAULT_STEPS},
                turns_faulted=c.turns_faulted,
                **self._tier_fields(),
            )

    def pack_times(self) -> tuple[list[float], list[float]]:
        """Wall ms of every pack (deposit) and unpack (adoption) so far (fp8; both empty with bf16)."""
        with self._lock:
            return self._residence.pack_times()

    def wait_restored(self, seq_id: int) -> None:
        """Order the device's next use of `seq_id`'s pool rows after their copy back from the host
        tier, if one is in flight (CUDA: a GPU-side wait, counted; otherwise nothing to do). The
        runtime calls it before it touches the sequence's rows; an engine calls it before its
        first draft step reads or writes them."""
        key = self._adopted.get(seq_id)
        if key is not None:
            with self._lock:
                self._residence.ready(key)

    def _tier_fields(self) -> dict[str, Any]:
        """CarryStats' host tier fields (caller holds the lock)."""
        t = self._store.tier_stats()
        wait_ms = self._residence.gpu_wait_ms()
        return dict(
            carry_host_memory_bytes=t.host_budget_bytes, hits_device=t.hits["device"],
            hits_host=t.hits["host"], demotions=t.demotions, host_deposits=t.host_deposits,
            host_entries=t.host_entries,
            host_bytes_held=t.host_bytes_held, bytes_demoted=t.bytes_demoted,
            bytes_restored=t.bytes_restored, peak_device_bytes=t.peak_bytes["device"],
            peak_host_bytes=t.peak_bytes["host"], demote_ms=t.demote_ms, restore_ms=t.restore_ms,
            restore_wait_ms=wait_ms, row_dtype=self.row_dtype, pinned_pool_bytes=self._residence.pinned_nbytes,
            **self._residence.stats_fields(),
        )

    def _deposit_host(self, seq_id: int, key: int, tokens: Sequence[int], ticket: int,
                      session: int | None, nbytes: int) -> bool | None:
        """The store refused the deposit as `not_admitted`: offer it to the host tier (its rows
        become a carried entry, which `demote` copies out and frees). True: deposited there;
        False: refused, and its rows are freed; None: not offered (no host tier, or refused for
        another reason), the sequence is untouched. Caller holds the lock."""
        if not self._store.host_budget_bytes or self._store.miss_reason(key) != "not_admitted":
            return None
        entry = self._carry_out(seq_id, key, tokens)
        if not self._store.deposit_host(entry, nbytes, session):
            self._free(entry)
            return False
        self._counters.deposits += 1
        log_store(entry, ticket)
        return True

    def _carry_out(self, seq_id: int, key: int, tokens: Sequence[int]) -> CarriedDrafter:
        """End `seq_id` as carried entry `key`: its blocks move to the pool's carried set (zero copy),
        or its rows are packed out of them and the blocks freed (the residence; caller holds the lock)."""
        return self._residence.carry_out(seq_id, key, tokens)

    def _free(self, entry: CarriedDrafter) -> None:
        """Free the device rows of an entry that left the store (its pool blocks, or its packed copy)."""
        self._residence.free(entry)

    def _unreachable_host_entry(self, key: int) -> None:
        """Drop `key`'s entry (`pool_pressure`) when it must come back into the pool (a host entry, or
        any fp8 entry) and even every carried block could not take its rows: live sequences hold
        the pool (caller holds the lock)."""
        if not self._residence.comes_back(self._store.tier(key)):
            return
        entry = self._store.get(key)
        pool = self.backend.drafter_pool
        assert entry is not None
        if self._residence.blocks_needed(entry) > pool.num_free_blocks + pool.num_carried_blocks:
            gone = self._store.evict(key, "pool_pressure")
            if gone is not None:  # an fp8 device entry: its packed copy goes with it
                self._free(gone)
            if self._store.tier(key) == "host":  # demoted instead: it could not come back either
                self._store.evict(key, "pool_pressure")

    # ---- carried entries (the seam with the engine: signatures are stable) -----

    def _candidate(self, session_hash: int) -> CarriedDrafter | None:
        """The carried entry `decide_adopt` must judge for `session_hash` (None: nothing carried).

        The key's own entry when there is one; with one slot, else the slot's
        entry (refused as ForeignSession: the seed's slot); else None.
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
            held = self._residence.take(self._store, session_hash, seq_id, rows_kept)
            self._adopted[seq_id] = session_hash
        return held

    def _on_pool_evict(self, session_hash: int) -> None:
        """The pool evicted `session_hash`'s rows for a live sequence: drop the entry too (a fault
        meanwhile: the store forgets it, `_repair`, and the grow's caller hears the fault)."""
        with self._lock:
            try:
                self._store.evict(session_hash, "pool_pressure")  # with a host tier: demoted
                self._residence.unstage(session_hash)
            except Exception:
                self._repair()
                raise

    def _pressure_victim(self) -> int | None:
        """The carried key a pool grow evicts next: the store policy's first victim (with a host
        tier its rows are copied out first: the pool releases them before the store hears)."""
        with self._lock:
            key = self._store.victim()
            if key is not None:
                self._residence.stage(key)
            return key

    def _expire(self) -> int:
        """Evict idle entries and free their rows (caller holds the lock)."""
        expired = self._store.expire()
        for e in expired:
            self._free(e)
        return len(expired)

    def _end_lease(self, key: int | None, reason: str) -> None:
        if key is not None:
            with self._lock:
                self._store.end_lease(key, reason)

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
        # pinned and non-blocking: a pageable upload would make the host wait for the chunk's
        # target forward (tests/runtime/test_prep_syncs.py pins the prep's syncs at 0)
        next_tokens = device_tensor(tokens[first_key + 1 : end + 1], torch.int64, device)
        keys = torch.arange(first_key, end, dtype=torch.int64, device=device)
        k, v = self.backend.drafter_kv(next_tokens, hidden, keys)
        pool.append_rows(seq_id, range(first_key, end), k, v)  # host-known keys: no sync


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1e3
