"""The adapter's carried rows: the core's `CarryStore` for bookkeeping, tensors for the rows.

What it is for: between two turns of a session the MTP layer's rows leave
TensorRT-LLM's draft pool (which frees every page at the end of a request)
and wait here. This module is the adapter's only use of `CarryStore`, so a
change of the store's API is absorbed in one place.

Entries hold TensorRT-LLM-native rows: row `k` is pair key `k` roped at
position `k` (the core's own pool ropes at `k + 1`; the store does not care,
it keeps bookkeeping only). Every entry covers keys `0 ..= last_pair_key`
with no gap (`rows == last_pair_key + 1`), so an adopted prefix is rows
`[0, n)`.

Invariants:
- The store's own bounds hold: at most `slots` entries (None: no cap), at
  most `budget_bytes` of rows, the idle time-to-live, and the eviction policy
  (`carry_eviction()`), exactly as in the reference runtime: a deposit is
  admitted (evicting by policy, counted `capacity`/`memory`) or refused
  (`not_admitted`/`too_large`), and a miss says why (`CarryStore.judge`).
- An entry leaves exactly once (taken, or evicted with a cause), and its
  tensor leaves with it; `check()` proves the store and the tensors agree.
- Every entry names its conversation's session (the key before the salt), so
  `forget(session)` drops the conversation's rows under every salt, counted
  `session_end` (`CarryStore.evict_session`), as the reference runtime's
  `forget_session` does.
- Thread-safe: `stats()` may be read while the executor thread deposits.
- Plan, then act: `stage` admits a deposit (evicting what the policy names) and places its
  rows; `commit` makes it an entry, `abort` refuses it (`oom`: the executor could not hold it,
  on this or another tensor-parallel rank) and frees its rows; `deposit` is the two at once.
  The store reads `clock` (the lockstep's agreed clock under tensor parallelism) for its idle
  TTL and the `returns` policy's ages.
- Host tier (`host_budget_bytes` > 0; the store decides, `CarryStore`): an entry
  leaving the device budget has its rows copied to host memory (pinned when they
  are on a GPU: on GB10's unified memory that is system memory outside
  TensorRT-LLM's KV pool) and its device tensor dropped; a take copies them back
  to the device they came from. On CUDA that copy is asynchronous, as the
  reference runtime's (`runtime/host_moves.py`): issued on a side stream, with an
  event recorded after it, so it overlaps whatever the GPU is doing; the taken
  rows carry the event and `TakenRows.ready()` (which `head` calls) makes the
  reading stream wait for it on the GPU before the rows are read (the CPU never
  blocks). A later host-arena write first waits for the copies back still
  reading host rows. On the CPU the copy is a plain synchronous one. The store
  counts the copy's issue time as `restore_ms`. Each entry's rows are in exactly
  one tier.
- Row format: one codec (`codec`, `dataplane/row_codec.py`, chosen from
  `carry_row_dtype()` and the draft pool's dtype) holds every entry: `bf16` the
  rows as gathered, `fp8` their `PackedRows` (the manager gathers packed and
  scatters unpacked, fused with the page copy), `fp8_kv` an FP8 KV pool's own
  bytes (gathered and scattered exactly, never re-scaled); the store charges
  what is held (`codec.nbytes`), and the host tier holds the same form.
- Memory (`arena`, `host_arena`: `trtllm/arena.py`, reserved when the carry is
  installed): a deposit copies its rows into the device arena and a demotion into
  the host arena, one block per row, so the store's budget is the arena's size; an
  entry's rows are views of its extent. A demotion into a full host arena takes the blocks
  of the host victims the store names first (`make_room`), which it drops after the copy. A deposit whose rows cannot be placed (an
  allocation failure) is refused as `oom` (`CarryStore.refuse`: counted, logged
  once), never raised; what the store holds stays adoptable. Without arenas the
  entries hold the tensors given (as before; tests of the store logic).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from ..core import CarriedDrafter, CarryStore, carry_host_memory, carry_row_dtype
from ..core.outcome import Adopted, CarryOutcome
from ..core.row_format import check_row_dtype
from ..core.store_range import StoreRange
from ..core.tokens import Tokens
from ..dataplane.pinned import held as pinned_held
from ..dataplane.row_codec import CompositeCodec, RowCodec, codec_for, codec_of
from .arena import HeldRows, RowArena, Rows

logger = logging.getLogger("trtllm_mtp_carry")


# ---- the CUDA calls of the copy back (one seam: CPU tests put a recorder in their place) ----


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def _new_event() -> torch.cuda.Event:
    return torch.cuda.Event()


def _current_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.current_stream(device)


def _on_stream(stream: torch.cuda.Stream) -> AbstractContextManager[object]:
    return torch.cuda.stream(stream)


def _copy_to(rows: Rows, device: torch.device) -> Rows:
    """`rows` (pinned host memory) copied to `device` without the CPU waiting."""
    return codec_of(rows).to(rows, device, non_blocking=True)


def _record_stream(rows: Rows, stream: torch.cuda.Stream) -> None:
    """Tell the caching allocator `stream` reads `rows` (not freed for reuse before it did)."""
    for t in codec_of(rows).tensors(rows):
        t.record_stream(stream)


@dataclass(frozen=True, slots=True)
class TakenRows:
    """An adopted entry: its bookkeeping and its rows `[n, 2, Hkv, D]`, held in `codec`'s form.

    `copied`: for rows just copied back from the host tier on CUDA, the event recorded
    after that copy (on a side stream); None for rows served from the device, or on the CPU.
    Read the rows only after `ready()` on the reading stream (`head` calls it).
    """

    entry: CarriedDrafter
    rows: Rows
    codec: RowCodec
    copied: torch.cuda.Event | None = None

    def ready(self) -> None:
        """Order the current stream after the rows' copy back (a GPU-side wait: the CPU never
        blocks), and mark the rows as read there; nothing to do when `copied` is None."""
        if self.copied is None:
            return
        stream = _current_stream(self.rows.device)
        stream.wait_event(self.copied)
        _record_stream(self.rows, stream)

    def head(self, n: int) -> Rows:
        """The first `n` rows, in the form they are held (a view, no copy), once the current
        stream waits for their copy back (`ready`)."""
        self.ready()
        return self.codec.head(self.rows, n)


@dataclass(frozen=True, slots=True)
class StagedDeposit:
    """A deposit `stage` admitted and placed, not yet an entry: `commit` or `abort` it.

    `tier` is where its rows are: `device` (in the device rows, the store not yet told) or
    `host` (the device tier refused it and the host tier took it: already an entry there)."""

    key: int
    tokens: Sequence[int]
    rows: int
    nbytes: int
    session: int | None
    tier: str


class CarriedRows:
    """Carried MTP rows keyed by carry key, bounded as the core's `CarryStore` bounds them."""

    def __init__(self, slots: int | None, budget_bytes: int, policy: str = "incumbent",
                 idle_s: float | None = None, host_budget_bytes: int | None = None,
                 row_dtype: str | None = None, arena: RowArena | None = None,
                 host_arena: RowArena | None = None, pool_dtype: torch.dtype | None = None,
                 codec: RowCodec | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        host = carry_host_memory() if host_budget_bytes is None else host_budget_bytes
        self.row_dtype = carry_row_dtype() if row_dtype is None else check_row_dtype(row_dtype, "row_dtype")
        # the rows' one format: `codec` (the manager's, from its draft pages: K/V, or K/V with a QSA
        # pool's side rows), else from the draft pool's dtype, else bound at the first deposit
        # from its rows (tests of the store logic)
        self.codec: RowCodec | None = (codec if codec is not None else
                                       None if pool_dtype is None else codec_for(self.row_dtype, pool_dtype))
        self._store = CarryStore(slots, budget_bytes=budget_bytes, policy=policy, idle_s=idle_s,
                                 host_budget_bytes=host, clock=clock)
        self._rows = HeldRows(arena, self.codec)  # device rows: in the arena when one is reserved
        self._host = HeldRows(host_arena, self.codec)  # host tier rows: in the pinned arena when one is reserved
        self._host_device: dict[int, torch.device] = {}  # host entry -> the device its rows came from
        self._streams: dict[torch.device, torch.cuda.Stream] = {}  # CUDA: the side stream copies back run on
        self._copied: dict[int, torch.cuda.Event] = {}  # restored key -> its copy's event, until taken
        # copies back that may still read host rows, with those rows: a host copy outside the arena
        # (memory registered for exactly its bytes, freed with its last reference) lives until read
        self._reading_host: list[tuple[torch.cuda.Event, Rows]] = []
        self._oom_logged = False
        self._host_rows_dropped = 0  # rows of host entries that left the store (forget counts them)
        self._room: list[int] = []  # host keys the store drops if the demotion in progress copies
        if host:
            self._store.host_moves = self
        self.budget_bytes = budget_bytes
        self._lock = threading.RLock()

    def judge(self, key: int, prompt: Tokens, ticket: int, projected: StoreRange,
              session: int | None = None) -> CarryOutcome:
        """The core's carry decision for `key`'s turn (`CarryStore.judge`: a miss names its reason)."""
        with self._lock:
            self._expire()
            return self._store.judge(key, prompt, ticket, projected, session)

    def judge_and_take(self, key: int, prompt: Tokens, ticket: int, projected: StoreRange,
                       session: int | None = None) -> tuple[CarryOutcome, TakenRows | None]:
        """`judge`, and on `Adopted` take the entry, in one step: a `forget` of the session
        in between cannot leave an adopted outcome without its rows."""
        with self._lock:
            outcome = self.judge(key, prompt, ticket, projected, session)
            return outcome, self.take(key) if isinstance(outcome, Adopted) else None

    def get(self, key: int) -> CarriedDrafter | None:
        """The entry carried under `key`, or None."""
        with self._lock:
            return self._store.get(key)

    def take(self, key: int) -> TakenRows:
        """Remove `key`'s entry for adoption; RuntimeError if it has none."""
        with self._lock:
            entry = self._store.take(key)  # a host entry is copied back here (`restore`)
            rows = self._rows.pop(key)
            assert rows is not None and self.codec is not None
            return TakenRows(entry, rows, self.codec, self._copied.pop(key, None))

    def end_lease(self, key: int, reason: str = "not_deposited") -> None:
        """The request that adopted `key`'s rows ended without depositing them."""
        with self._lock:
            self._store.end_lease(key, reason)

    @property
    def row_format(self) -> str:
        """The held rows' format name (`core.row_format.ROW_FORMATS`): the codec's, else `row_dtype`
        until the first deposit binds one."""
        return self.row_dtype if self.codec is None else self.codec.name

    def deposit(self, key: int, tokens: Sequence[int], rows: Rows,
                session: int | None = None) -> bool:
        """Keep `rows` (keys `0 .. n-1`, `n <= len(tokens) - 1`, held in `codec`'s form) under
        `key`, an entry of conversation `session` (None: `key` itself), charged the bytes held;
        False if refused. TypeError for rows in another form. (`stage`, then `commit`.)"""
        with self._lock:
            staged = self.stage(key, tokens, rows, session)
            if staged is not None:
                self.commit(staged)
            return staged is not None

    def stage(self, key: int, tokens: Sequence[int], rows: Rows,
              session: int | None = None) -> StagedDeposit | None:
        """Admit `deposit`'s rows and place them (evicting what the policy names), without making
        them an entry yet; None when refused (counted: `not_admitted`, `too_large`, `oom`).
        TypeError for rows in another form."""
        # rows: [n, 2, Hkv, D], a copy owned by the store from now on
        codec = self._bind(rows)
        n = rows.shape[0]
        nbytes = codec.nbytes(rows)  # the bytes held: elements x element size; fp8: payload plus scales
        with self._lock:
            self._expire()
            evicted = self._store.admit(key, nbytes, session) if n > 0 else None
            if evicted is None:  # refused (the store counts why); older rows of `key` are stale
                self._evict(key, "replaced")
                if n > 0 and self._deposit_host(key, tokens, rows, nbytes, session):
                    return StagedDeposit(key, tokens, n, nbytes, session, "host")
                return None
            for old in evicted:
                del self._rows[old.session_hash]
            try:
                self._rows.put(key, rows)  # into the arena: the one allocation a deposit makes
            except torch.OutOfMemoryError as exc:
                self._refuse_oom(key, exc)
                return None
            return StagedDeposit(key, tokens, n, nbytes, session, "device")

    def commit(self, staged: StagedDeposit) -> None:
        """Make `staged` an entry (a host-tier deposit already is one)."""
        with self._lock:
            if staged.tier == "device":
                n = staged.rows
                self._store.put(CarriedDrafter((), n, n - 1, staged.tokens, staged.key), staged.nbytes,
                                staged.session)

    def abort(self, staged: StagedDeposit) -> None:
        """Refuse `staged` after all: its rows are freed and the refusal counted `oom` (the
        executor could not hold the rows: on this rank, or on another tensor-parallel rank, so
        none keeps them); a host-tier entry leaves as `fault`. What admitting it evicted stays
        evicted (as on every rank)."""
        with self._lock:
            if staged.tier == "device":
                del self._rows[staged.key]
                self._store.refuse(staged.key)
            else:
                self._store.evict(staged.key, "fault")

    def _bind(self, rows: Rows) -> RowCodec:
        """The codec `rows` must be held in (bound here from the first rows when no pool dtype was
        given: `fp8` takes `PackedRows`, `bf16` tensors); TypeError for rows in another form."""
        if self.codec is None:
            codec = codec_of(rows)
            kv_name = codec.main.name if isinstance(codec, CompositeCodec) else codec.name  # K/V's format
            if kv_name != self.row_dtype and kv_name not in ("fp8_kv", "nvfp4_kv"):  # a pool's own bytes
                raise TypeError(f"a {self.row_dtype} store keeps "
                                f"{'PackedRows' if self.row_dtype == 'fp8' else 'tensors'}, got {type(rows).__name__}")
            self.codec = self._rows.codec = self._host.codec = codec
        self.codec.check(rows)
        return self.codec

    def _refuse_oom(self, key: int, exc: BaseException) -> None:
        """An allocation for `key`'s deposit failed: refused as `oom` (counted; logged once), the
        carry goes on with what it holds."""
        self._store.refuse(key)
        if not self._oom_logged:
            self._oom_logged = True
            logger.warning("mtp carry: a deposit was refused as oom (%s); the carry keeps serving with "
                           "what it holds; later ones are counted in refusals.oom, not logged", exc)

    def forget(self, session: int) -> int:
        """Drop conversation `session`'s rows under every salt, and its leases (the session
        ended: `session_end`); returns the rows dropped (0 when it held none)."""
        with self._lock:
            before = self._host_rows_dropped
            entries = self._store.evict_session(session, "session_end")
            for entry in entries:
                del self._rows[entry.session_hash]
            return sum(entry.rows for entry in entries) + self._host_rows_dropped - before

    def clear(self) -> None:
        """Drop every entry (`cleared`)."""
        with self._lock:
            for entry in self._store.clear():
                del self._rows[entry.session_hash]

    def stats(self) -> dict[str, object]:
        """Entries, rows and bytes held, deposits, adoptions, evictions by cause; the host tier's
        budget, hits per tier, entries and bytes it holds, bytes moved each way, peaks per tier
        and copy time (`CarryStore.tier_stats`)."""
        with self._lock:
            t = self._store.tier_stats()
            return {
                "carry_slots": self._store.slots,
                "entries": len(self._store),
                "rows_held": self._store.rows_held,
                "bytes_held": self._store.bytes_held,
                "budget_bytes": self.budget_bytes,
                "deposits": self._store.deposits,
                "adoptions": self._store.adoptions,
                "evictions": self._store.evictions(),
                "row_dtype": self.row_format,
                "refusals": self._store.refusals(),
                "reserved_bytes": 0 if self._rows.arena is None else self._rows.arena.nbytes,
                "host_reserved_bytes": 0 if self._host.arena is None else self._host.arena.nbytes,
                "pinned_bytes_held": pinned_held(),  # page-locked now: the arena's exactly, torch's pool
                "carry_host_memory": t.host_budget_bytes,
                "hits": t.hits,
                "demotions": t.demotions,
                "host_deposits": t.host_deposits,
                "host_entries": t.host_entries,
                "host_bytes_held": t.host_bytes_held,
                "bytes_demoted": t.bytes_demoted,
                "bytes_restored": t.bytes_restored,
                "peak_bytes": t.peak_bytes,
                "demote_ms": t.demote_ms,
                "restore_ms": t.restore_ms,
            }

    def check(self) -> None:
        """RuntimeError unless every entry has exactly its rows and nothing else is held."""
        with self._lock:
            keys = [e.session_hash for e in self._store.entries()]
            if sorted(keys) != sorted(self._rows):
                raise RuntimeError(f"carried entries {keys} differ from the rows held {list(self._rows)}")
            for e in self._store.entries():
                if self._rows[e.session_hash].shape[0] != e.rows:
                    raise RuntimeError(f"entry 0x{e.session_hash:016x} has {e.rows} rows, "
                                       f"holds {self._rows[e.session_hash].shape[0]}")
            host = sorted(e.session_hash for e in self._store.host_entries)
            if host != sorted(self._host):
                raise RuntimeError(f"host tier entries {host} differ from the host rows held {sorted(self._host)}")
            for e in self._store.host_entries:
                if self._host[e.session_hash].shape[0] != e.rows:
                    raise RuntimeError(f"host entry 0x{e.session_hash:016x} has {e.rows} rows, "
                                       f"holds {self._host[e.session_hash].shape[0]}")
            for arena in (self._rows.arena, self._host.arena):
                if arena is not None:
                    arena.check()

    # ---- HostMoves (the store calls these under our lock) --------------------------------

    def make_room(self, victims: list[CarriedDrafter]) -> None:
        """The store drops `victims` (host entries) if the next `demote` copies: it may reuse their
        host arena blocks (the arena is the host budget exactly; untouched when it returns False)."""
        self._room = [e.session_hash for e in victims]

    def demote(self, entry: CarriedDrafter) -> bool:
        """Copy `entry`'s rows to host memory (pinned when they are on a GPU); drop the device tensor."""
        key = entry.session_hash
        room, self._room = self._room, []
        rows = self._rows[key] if key in self._rows else None
        if rows is None:
            return False
        self._settle_copies_back()  # host rows popped by a restore may be overwritten from here
        released: list[int] = []
        try:
            if self._host.arena is not None:
                released = self._host_room(rows, room)
                self._host.put(key, rows)  # a blocking copy into the pinned arena
            else:
                assert self.codec is not None  # rows are held: the first deposit bound it
                self._host.keep(key, self.codec.host_copy(rows))
        except torch.OutOfMemoryError:  # no pinned memory for it: the store evicts it instead
            for k in released:  # (a compaction could not stage) their blocks are free: gone as a fault
                self._store.discard(k, "fault")
            return False
        self._host_device[key] = rows.device
        del self._rows[key]  # the device blocks go only once the rows are on the host
        return True

    def _host_room(self, rows: Rows, room: list[int]) -> list[int]:
        """Free the store's victims' host blocks (`make_room`) when the host arena holds `rows` only
        with them (the store drops those entries once the copy is made); returns the keys freed."""
        arena = self._host.arena
        assert arena is not None
        need, free = arena.blocks_for(rows), self._host.free_blocks()
        victims = [k for k in room if k in self._host]
        if not free < need <= free + sum(arena.blocks_for(self._host[k]) for k in victims):
            return []
        for k in victims:
            del self._host[k]
            self._host_device.pop(k, None)
        return victims

    def restore(self, entry: CarriedDrafter) -> None:
        """Copy `entry`'s rows back to their device: on CUDA asynchronously on a side stream, an
        event recorded after the copy (the take hands it on: `TakenRows.ready`); on the CPU a
        plain copy. The device rows are a transient copy the take hands to the scatter (not in
        the arena: the entry is leaving the store)."""
        key = entry.session_hash
        host = self._host.pop(key)
        assert host is not None
        device = self._host_device.pop(key)
        assert self.codec is not None
        if device.type != "cuda":
            self._rows.keep(key, self.codec.to(host, device))
            return
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = _side_stream(device)
        # allocated and written on the side stream: the pinned source is complete (the demote's
        # copy was blocking) and the fresh memory is the side stream's, so no wait before it
        with _on_stream(stream):
            rows = _copy_to(host, device)
            done = _new_event()
            done.record(stream)
        self._copied[key] = done
        self._reading_host = [(e, h) for e, h in self._reading_host if not e.query()] + [(done, host)]
        self._rows.keep(key, rows)

    def _settle_copies_back(self) -> None:
        """Wait (CPU) for copies back that may still read host rows about to be overwritten."""
        for done, _ in self._reading_host:
            done.synchronize()
        self._reading_host.clear()

    def drop(self, entry: CarriedDrafter) -> None:
        """Free `entry`'s host rows (it left the store from the host tier)."""
        self._host_device.pop(entry.session_hash, None)
        self._copied.pop(entry.session_hash, None)
        if self._host.pop(entry.session_hash, None) is not None:
            self._host_rows_dropped += entry.rows

    def _deposit_host(self, key: int, tokens: Sequence[int], rows: Rows, nbytes: int,
                      session: int | None) -> bool:
        """A deposit the device tier refused as `not_admitted` goes to the host tier if it takes it."""
        if self._store.host_moves is None or self._store.miss_reason(key) != "not_admitted":
            return False
        self._rows.keep(key, rows)  # as a device entry's (not in the arena), for `demote` to copy out
        if self._store.deposit_host(CarriedDrafter((), rows.shape[0], rows.shape[0] - 1, tokens, key),
                                    nbytes, session):
            return True
        del self._rows[key]
        return False

    def _evict(self, session: int, cause: str) -> CarriedDrafter | None:
        entry = self._store.evict(session, cause)
        if entry is not None:
            del self._rows[session]
        return entry

    def _expire(self) -> None:
        for entry in self._store.expire():  # idle entries leave with their rows
            del self._rows[entry.session_hash]
