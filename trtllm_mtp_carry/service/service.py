"""The carry service: one carry beneath every executor.

What it is for: the reference engine's glue (`runtime/carry_runtime.py`) and TensorRT-LLM's
resource manager (`trtllm/manager.py`) each translate their own events (admission, a
prefill chunk, the turn's end, a cancel, a session's end, a fault) into calls on this
service, and hand it the pages to gather from and scatter to. It owns the rest: the carry
store (`core.CarryStore`: the entries, their bounds, the eviction policy, the decision),
where rows live (a device home, `homes.py`, and one host tier, `host_tier.py`), the lock,
the fault ledger (`ledger.py`) and the counters (`stats.py`). Its calls plan, then act:

    judge(key, prompt, ticket, projected)  the core's decision for a turn (expiry first)
    adopt(turn, key, rows_kept, dest)       carried out: the entry's rows into the turn's pages
    plan_deposit(key, source, rows)         admit or refuse BEFORE any row moves (None: refused,
                                            counted); room reserved, victims gone
    deposit(plan, source, runs, tokens)     carried out: the rows written once, into that room
    end_turn / drop_turn                    a turn that deposits nothing ends its lease
    forget_session, expire, clear, detach   entries leave, their rows freed

A warm turn's pair keys, and what each call moves::

    | carried rows (adopt) | skipped keys | rows the executor computes |
    0               last_pair_key     first_key                    L - 2
    deposit: the turn's valid run of keys, [first valid key, N - 2], with the run's keys

After a miss a turn deposits the valid run it computed: keys [R, N - 1) of a turn whose
prefix [0, R) had no rows (a known-invalid prefix), so the session's next turn adopts them
instead of staying blind for as long as its prefix is reused.

Invariants:
- Every call is made under `lock` (reentrant: an executor may hold it across a plan and its
  deposit, or while it reads its own state); `stats()` may be read from another thread.
- An entry is adopted only by its own non-zero carry key, at most once (it leaves the
  store); a refused deposit moved no row; an admitted one is written once.
- The store's entries are exactly the rows the home and the host tier hold (`check`);
  after a fault `repair` makes them agree again, freeing what no one holds, each once.
- After `detach` nothing is held: no entry, no arena range, no host copy, no pool block
  (`detach` raises RuntimeError naming what is left).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from ..core import NO_CARRY_REASONS, OUTCOME_KINDS, CarriedDrafter, CarryStore, log_store
from ..core.carry_store import EVICTION_CAUSES
from ..core.outcome import CarryOutcome, NoCarry
from ..core.store_range import StoreRange
from ..core.tokens import Tokens
from ..dataplane.arena import Arena
from ..dataplane.kv_pool import CarriedBlocks, PoolExhaustedError
from .homes import RowHome, Runs
from .host_tier import HostTier
from .ledger import FaultLedger
from .stats import SKIP_REASONS, TURN_KINDS, VETO_STEPS, CarryStats, TurnCounters

__all__ = ["CarryService", "DepositPlan"]

logger = logging.getLogger("trtllm_mtp_carry")


Agree = Callable[[bool], tuple[bool, bool]]
"""An executor's agreement with its peers: `agree(ok)` is `(every peer said ok, some did)`."""


def _alone(ok: bool) -> tuple[bool, bool]:
    """The agreement of an executor with no peers: its own word."""
    return ok, ok


@dataclass(frozen=True)
class DepositPlan:
    """An admitted deposit: `rows` rows of carry key `key` (charged `nbytes`), bound for `tier`
    (`device`: into room reserved for it; `host`: the device refused it, the host tier takes it)."""

    key: int
    rows: int
    nbytes: int
    session: int | None
    tier: str


class CarryService:
    """The carry store, the rows' homes, the lock, the fault ledger and the counters (see the module doc).

    `home` holds the device rows; `slots` (None: no cap), `budget_bytes`, `eviction`, `idle_s`
    (None: never) and `clock` bound the store; `host_arena` (None: no host tier) is the host
    tier's memory, its size the host budget; `share` lets entries share common-prefix blocks
    where the home can; `room_for(entry)` says whether an entry that must come back into the
    executor's blocks can (None: always; the reference pool's live sequences win over it).
    `armed` and `policy` are reported as they are."""

    def __init__(self, home: RowHome, *, slots: int | None, budget_bytes: int, eviction: str,
                 idle_s: float | None, clock: Callable[[], float] = time.monotonic,
                 host_arena: Arena | None = None, share: bool = False, armed: bool = True,
                 policy: str = "carry", room_for: Callable[[CarriedDrafter], bool] | None = None) -> None:
        self.home = home
        self.host = None if host_arena is None or host_arena.capacity == 0 else HostTier(home, host_arena)
        self.host_arena = host_arena
        self.store = CarryStore(slots, budget_bytes, eviction, idle_s, clock, block_nbytes=home.block_nbytes,
                                host_budget_bytes=0 if self.host is None else self.host.arena.capacity,
                                row_format=home.row_format)
        self.store.host_moves = self.host
        self.lock = threading.RLock()
        self.ledger = FaultLedger()
        self.counters = TurnCounters()
        self.share = share and home.shares
        self.armed = armed
        self.policy = policy
        self.room_for = room_for
        self._leases: dict[Hashable, int] = {}  # turn -> the carry key whose rows it adopted
        self._host_rows_dropped = 0
        self._oom_logged = False  # the first `oom` refusal is logged, later ones only counted

    # ---- admission ---------------------------------------------------------------------

    def judge(self, key: int, prompt: Tokens, ticket: int, projected: StoreRange,
              session: int | None = None) -> CarryOutcome:
        """The core's carry decision for a turn of carry key `key` (`CarryStore.judge`; a miss
        names its reason), after idle entries expired and an entry that could not come back into
        the executor's blocks left (`pool_pressure`). `projected` is the hidden-store range the
        turn's own prefill will write under `ticket`."""
        with self.lock:
            self.expire()
            self._unreachable(key)
            return self.store.judge(key, prompt, ticket, projected, session)

    def adopt(self, turn: Hashable, key: int, rows_kept: int, dest: Any) -> CarriedBlocks | None:
        """Take `key`'s entry (it leaves the store: never adopted twice) and move its first
        `rows_kept` rows into `dest`, the turn's own pages; the turn holds a lease on `key` until
        it ends. RuntimeError if `key` has no entry. On an exception the rows are lost: the
        executor drops the turn (`drop_turn`) and its fault recovery repairs."""
        with self.lock:
            if key == 0 or self.store.get(key) is None:
                raise RuntimeError(f"no carried entry 0x{key:016x} for turn {turn!r} to adopt")
            from_host = self.store.tier(key) == "host"
            restored = None
            if from_host:  # its rows come back to the device first (the store's restore)
                restored = self.store.take(key)
                self._leases[turn] = key
                if self.host is not None and self.home.reads_at_adoption:
                    self.host.ready(key)  # the adoption itself reads them: order it after the copy back
            try:
                held = self.home.carry_in(key, dest, rows_kept)
            except PoolExhaustedError:  # the rows never came back: gone, as a host restore that failed
                if from_host:
                    self._leases.pop(turn, None)
                    self.store.end_lease(key, "pool_pressure")
                raise
            if restored is None:  # a device entry leaves the store once its rows moved (a failed
                self.store.take(key)  # move leaves it where it was, if the home still holds it)
                self._leases[turn] = key
            elif self.host is not None and held is not None and len(held.block_table) < len(restored.block_table):
                self.host.ready(key)  # restored blocks went back free: their next owner writes after the copy
            return held

    def wait_restored(self, turn: Hashable) -> None:
        """Order the device's next use of `turn`'s adopted rows after their copy back from the host
        tier, if one is in flight (CUDA: a GPU-side wait; otherwise nothing to do)."""
        key = self._leases.get(turn)
        if key is not None and self.host is not None:
            with self.lock:
                self.host.ready(key)

    # ---- deposits ----------------------------------------------------------------------

    def plan_deposit(self, key: int, source: Any, rows: int, session: int | None = None,
                     share: Any = None, agree: Agree | None = None) -> DepositPlan | None:
        """Admit `rows` rows of `source` under carry key `key`, or refuse them, before any row
        moves: None when refused (the store counts why: `not_admitted`, also when the host tier
        would not take it either, `too_large`, or `oom` when the home has no room). Admitted: the entries the store chose left (their rows
        freed, or demoted to the host tier) and the home reserved the room. `share` (the prefix
        keys of the turn's tokens) first merges full prefix blocks into equal published ones,
        where the home shares blocks. `agree(ok)` is the executor's agreement with its peers
        (tensor-parallel ranks): `(every, some)` said ok; the room counts only if every one has it."""
        with self.lock:
            self.expire()
            if share is not None and self.share:
                t0 = time.perf_counter()
                self.home.share(source, share)
                self.counters.share_ms += (time.perf_counter() - t0) * 1e3
            blocks, nbytes = self.home.charge(source, rows)
            evicted = self.store.admit(key, nbytes, session, blocks=blocks)
            if evicted is None:  # the host tier's second chance, asked before any row moves
                if (self.host is None or self.store.miss_reason(key) != "not_admitted"
                        or not self.store.host_admits(key, rows, nbytes, blocks)):
                    return None
                return DepositPlan(key, rows, nbytes, session, "host")
            for old in evicted:
                self.home.free(old.session_hash)
            reserved = self.home.reserve(key, rows)
            if not (agree or _alone)(reserved)[0]:  # no room here, or at a peer: refused everywhere
                if reserved:
                    self.home.unreserve(key)
                self.store.refuse(key)
                if not self._oom_logged:
                    self._oom_logged = True
                    logger.warning("mtp carry: a deposit was refused as oom (no room for %d bytes where the "
                                   "rows live); the carry keeps serving with what it holds; later ones are "
                                   "counted in refusals.oom, not logged", nbytes)
                return None
            return DepositPlan(key, rows, nbytes, session, "device")

    def deposit(self, plan: DepositPlan, source: Any, runs: Runs, tokens: Sequence[int], ticket: int = 0,
                agree: Agree | None = None) -> bool:
        """Carry `plan`'s rows out of `source` (keys `runs`) as the entry of `tokens` (the turn's
        tokens: prompt and output). Returns whether an entry was kept (the host tier may refuse
        a host-bound plan). On an exception nothing is kept and the room is given back. With
        `agree` (the executor's peers, as `plan_deposit`), the entry is kept only if every peer
        carried its rows out: where some did and others did not, every one refuses it (`oom`)."""
        with self.lock:
            error: Exception | None = None
            try:
                entry = self.home.carry_out(source, plan.key, plan.rows, runs, tokens, loose=plan.tier == "host")
            except Exception as exc:  # the home gave the room back
                error = exc
            every, some = (agree or _alone)(error is None)
            if not every and some:  # a peer could not hold them (or this one): none keeps them
                if error is None:
                    self.home.free(plan.key)
                self.store.refuse(plan.key)
            if error is not None:
                raise error
            if not every:
                return False
            if plan.tier == "host":
                if not self.store.deposit_host(entry, plan.nbytes, plan.session):
                    self.home.free(plan.key)
                    return False
            else:
                self.store.put(entry, plan.nbytes, plan.session)
            self.counters.rows_deposited += plan.rows
        log_store(entry, ticket)
        return True

    # ---- turns that deposit nothing ----------------------------------------------------

    def end_turn(self, turn: Hashable, reason: str = "not_deposited") -> None:
        """`turn` ended without depositing: the lease on the rows it adopted ends (`reason`, a
        `NO_CARRY_REASONS` name, is why that key's next turn finds nothing)."""
        with self.lock:
            key = self._leases.pop(turn, None)
            if key is not None:
                self.store.end_lease(key, reason)

    def deposited(self, turn: Hashable) -> None:
        """`turn` deposited its rows: its lease became the new entry."""
        with self.lock:
            self._leases.pop(turn, None)

    def drop_turn(self, turn: Hashable, key: int | None = None) -> None:
        """A faulted turn's carry state goes: its lease ends as `fault` (the one it holds, or
        `key`'s if no live turn holds it: taken just before the fault), and a copy back into its
        rows ends first (they are about to be freed). The executor then frees the turn's own rows
        and calls `repair`, which frees what no one holds any more."""
        with self.lock:
            lease = self._leases.pop(turn, None)
            if lease is None and key and self.store.leased(key) and key not in self._leases.values():
                lease = key
            if lease is not None:
                self.store.end_lease(lease, "fault")
                if self.host is not None:
                    self.host.settle(lease)

    def repair(self) -> None:
        """Make the store, the home and the host tier agree after a fault: an entry whose rows are
        gone or differ leaves the store (counted as evicted for `fault`); rows no entry holds are
        freed, each once, after any copy back into them ends."""
        with self.lock:
            if self.host is not None:
                self.host.repair(self.store, set(self._leases.values()))
            self.home.repair(self.store)

    # ---- entries leaving -----------------------------------------------------------------

    def forget_session(self, session: int) -> int:
        """Drop the rows carried for `session` under every salt (its session ended: `session_end`);
        returns the rows freed (0 when it held none)."""
        if session == 0:
            return 0
        with self.lock:
            before = self._host_rows_dropped
            host_rows = {e.session_hash: e.rows for e in self.store.host_entries}
            gone = self.store.evict_session(session, "session_end")
            for e in gone:
                self.home.free(e.session_hash)
            still = {e.session_hash for e in self.store.host_entries}
            dropped = sum(rows for k, rows in host_rows.items() if k not in still)
            rows = sum(e.rows for e in gone) + dropped
            self._host_rows_dropped = before + dropped
            self.counters.sessions_ended += 1
            self.counters.rows_freed += rows
            return rows

    def expire(self) -> int:
        """Drop entries idle past the time-to-live now; returns how many."""
        with self.lock:
            gone = self.store.expire()
            for e in gone:
                self.home.free(e.session_hash)
            return len(gone)

    def clear(self) -> None:
        """Drop every carried entry and free its rows (counted as `cleared`)."""
        with self.lock:
            for e in self.store.clear():
                self.home.free(e.session_hash)

    def detach(self) -> None:
        """Drop every entry and end every lease; RuntimeError naming what is still held when any
        row, arena range or host copy is (a leak)."""
        with self.lock:
            self.clear()
            for turn in list(self._leases):
                self.end_turn(turn, "cleared")
            self.repair()
            left = []
            if not self.home.idle():
                left.append(f"device home: {self.home.held()}")
            if self.host is not None and not self.host.idle():
                left.append(f"host tier: {self.host.keys()} {self.host.arena.keys()}")
            if left:
                raise RuntimeError(f"the carry holds rows after detaching: {'; '.join(left)}")

    # ---- pool pressure (a home whose executor reclaims blocks for live sequences) -----------

    def pressure_victim(self) -> int | None:
        """The carried key a pool grow takes next: the store policy's first victim (with a host
        tier its rows are staged to host memory first: the pool releases them before the store hears)."""
        with self.lock:
            key = self.store.victim()
            if key is not None and self.host is not None:
                self.host.stage(key)
            return key

    def pressure_evict(self, key: int) -> None:
        """The pool took `key`'s rows for a live sequence: its entry leaves (`pool_pressure`;
        with a host tier it is demoted from its staged copy)."""
        with self.lock:
            try:
                self.store.evict(key, "pool_pressure")
                if self.host is not None:
                    self.host.unstage(key)
            except Exception:
                self.repair()
                raise

    def _unreachable(self, key: int) -> None:
        """Drop `key`'s entry (`pool_pressure`) when it must come back into the executor's blocks
        and cannot (live sequences hold them)."""
        entry = self.store.get(key)
        if entry is None or self.room_for is None or not self.home.comes_back(self.store.tier(key)):
            return
        if not self.room_for(entry):
            if self.store.evict(key, "pool_pressure") is not None:  # left from the device tier
                self.home.free(key)
            if self.store.tier(key) == "host":  # demoted instead: it could not come back either
                self.store.evict(key, "pool_pressure")

    # ---- invariants and numbers --------------------------------------------------------

    def check(self) -> None:
        """RuntimeError unless the store's entries are exactly the rows the home and the host tier
        hold, and every allocation tiles."""
        with self.lock:
            self.home.check(self.store)
            if self.host is not None:
                self.host.check(self.store)

    def carried(self) -> tuple[CarriedDrafter, ...]:
        """Every device-tier entry, least recently deposited first (bookkeeping only)."""
        with self.lock:
            return self.store.entries()

    def stats(self, **executor: Any) -> CarryStats:
        """A frozen snapshot of every counter (zeros listed for names never seen); `executor`
        fills the fields only the executor knows (`pool_blocks`, `live_turns`, ...)."""
        with self.lock:
            c = self.counters
            s = self.store
            t = s.tier_stats()
            faults, steps, turns_faulted = self.ledger.counts()
            home_fields = self.home.stats_fields()
            executor.setdefault("vetoed", dict.fromkeys(VETO_STEPS, 0))
            return CarryStats(
                armed=self.armed, policy=self.policy, row_dtype=self.home.codec.name,
                eviction_policy=s.policy, carry_slots=s.slots, carry_memory_bytes=s.budget_bytes or 0,
                carry_host_memory_bytes=t.host_budget_bytes, idle_s=int(s.idle_s or 0),
                reserved_bytes=self.home.reserved_bytes,
                host_reserved_bytes=0 if self.host_arena is None else self.host_arena.nbytes,
                pinned_bytes=0 if self.host is None else self.host.pinned_bytes,
                turns={k: c.turns.get(k, 0) for k in TURN_KINDS},
                outcomes={k: c.outcomes.get(k, 0) for k in OUTCOME_KINDS},
                no_carry_reasons={r: c.no_carry.get(r, 0) for r in NO_CARRY_REASONS},
                skipped={r: c.skipped.get(r, 0) for r in SKIP_REASONS},
                turns_blind=c.turns_blind, turns_cancelled_kept=c.turns_cancelled_kept,
                rows_adopted=c.rows_adopted, rows_appended=c.rows_appended, rows_prefilled=c.rows_prefilled,
                rows_rebuilt=c.rows_rebuilt, keys_skipped=c.keys_skipped, rows_deposited=c.rows_deposited,
                deposits=s.deposits, adoptions=s.adoptions, leases=s.leases,
                evictions={k: s.evictions().get(k, 0) for k in EVICTION_CAUSES}, refusals=s.refusals(),
                entries_held=len(s), rows_held=s.rows_held, bytes_held=s.bytes_held, blocks_held=s.blocks_held,
                carry_share=self.share, shared_blocks=s.shared_blocks, share_ms=c.share_ms,
                hits_device=t.hits["device"], hits_host=t.hits["host"], demotions=t.demotions,
                host_deposits=t.host_deposits, host_entries=t.host_entries, host_bytes_held=t.host_bytes_held,
                bytes_demoted=t.bytes_demoted, bytes_restored=t.bytes_restored,
                peak_device_bytes=t.peak_bytes["device"], peak_host_bytes=t.peak_bytes["host"],
                demote_ms=t.demote_ms, restore_ms=t.restore_ms,
                restore_wait_ms=0.0 if self.host is None else self.host.gpu_wait_ms(),
                faults=faults, fault_steps=steps, turns_faulted=turns_faulted,
                sessions_ended=c.sessions_ended, rows_freed=c.rows_freed,
                **home_fields, **executor,
            )

    def count_outcome(self, outcome: CarryOutcome) -> None:
        """Count a carry decision carried out (by kind; a `no_carry` by its reason too)."""
        with self.lock:
            self.counters.outcomes[outcome.kind] += 1
            if isinstance(outcome, NoCarry):
                self.counters.no_carry[outcome.reason] += 1
