"""The carry resource manager: adopt at a warm context request's first chunk, deposit at free.

What it is for: inside TensorRT-LLM's `PyExecutor`, an unpaired draft pool
gives a warm turn fresh, unwritten draft pages for the reused prefix
`[0, R)` (the drafter is blind there). This manager, appended to
`resource_manager.resource_managers` after the draft KV manager, fills them:

```
  draft pages of a warm turn:
  | carried rows (scattered here) | new span: TensorRT-LLM's context phase |
  0                               R = context_current_position          L
```

- `prepare_resources(batch)` runs after the draft manager's (the dict is
  iterated forward), so the request's pages exist. On the first sight of a
  context request with `R > 0`, the core's `decide_adopt` judges this
  session's carried entry against the prompt (the one carry decision every
  executor uses); if adopted, rows of keys `[0, min(rows, R))` are scattered
  into the request's pages for the MTP layer.
- `free_resources(request)` runs before the draft manager's (the dict is
  iterated in reverse), so the pages are still live: a freed request's
  valid rows, keys `[0, N - 1)` of its `N` tokens, are gathered into the
  carry store. Rows past `N - 2` are later draft steps' rows over drafted
  tokens: never kept.
- `forget_conversation(conversation_id)` (the session ended: the Triton
  model's END, restart or idle timeout) drops the conversation's carried rows
  under every salt (`CarryStore.evict_session`, counted `session_end`), and
  marks its requests still live so they deposit nothing when freed
  (TensorRT-LLM may free a request after its final response went out).
- Every request's turn record (R, the outcome, rows kept and computed) is kept
  under its executor id (`turn`) and under its LLM API id (`pop_turn`:
  `RequestOutput.request_id`, which is `LlmRequest.py_client_id`), each an LRU
  of `TURN_LOG` records, so a turn nobody reads never grows memory.

Invariants:
- Dummy requests, requests without a conversation id, requests freed before
  their context finished (cancelled or failed in context: see `_skip_reason`) and requests whose
  conversation was forgotten while they ran are never carried, and leave
  nothing behind (their bookkeeping is dropped at free).
- A request deposits only if every key `[0, N - 1)` is valid: a cold turn, or
  a warm turn whose `[0, R)` was fully restored. A blind warm turn's `[0, R)`
  pages hold whatever the pool had; they are never carried.
- Rows move as TensorRT-LLM wrote them (roped at k): gather and scatter, no re-rope,
  through the rows' codec (`dataplane/row_codec.py`, chosen from `carry_row_dtype`
  and the pool's dtype): a BF16 pool's rows as they are, or with `carry_row_dtype`
  fp8 packed as they are gathered and unpacked as they are scattered (within FP8's
  rounding: the target verifies every draft); an FP8 KV pool's rows are its own
  bytes, gathered and scattered exactly whatever `carry_row_dtype` says.
- The rows wait in `CarriedRows` (trtllm/carried.py), in the arenas reserved at
  install (`reserved`, trtllm/arena.py; the worker reserves them before
  TensorRT-LLM sizes its KV cache, `attach` at attach); a deposit the arena
  cannot place is refused as `oom` (counted in `refusals`), never raised.
  Without `reserved` (tests of the carry logic) entries hold the gathered tensors.
- No exception of any type leaves a method PyExecutor calls (every
  `BaseResourceManager` method, `resource_manager.py` @ d2a5560a): a fault
  (a page missing, a `KeyError` from a full draft IndexMapper, out of memory,
  a name a build lacks, ...) runs that turn blind, drops that request's carry
  state (skipped `fault`: it adopts and deposits nothing more), is counted by
  kind (`faults`, the exception's class name) and step (`errors`), and is
  logged once per (step, kind); the other requests and the executor go on, and
  outputs never depend on the drafter's rows.
- A request's state follows its chunks (`_Live.schedule`): a chunk counts as
  run only once the next one starts past it, so a chunk undone by
  `revert_allocate_context` (the same chunk again, or the prefill rewound to 0)
  extends nothing; a request freed unfinished (the recompute pause) deposits
  like a finished turn and is judged afresh when it comes back (`resumed`).
- Nothing is written outside the request's own fresh pages for keys `[0, R)`;
  the manager is installed only on the unpaired topology (never on paired or
  folded pools, whose pages below R are shared tree blocks).
- Tensor parallelism (`lockstep`, trtllm/lockstep.py; a no-op at TP=1): each rank's
  manager holds its head shard's rows and takes every decision as the other ranks do.
  Prepare agrees once per batch of first-seen context requests (the clock, and each
  request's carry key and R), then, if any may adopt, the rows each rank can restore
  (`_adopt`: every rank scatters keys `[0, MIN)`, or none does); free agrees on every
  request it tracks (`_deposit`: the same rows of the same key, then their placement).
  Every rank reaches those agreements alike, whatever its own steps did: a local fault
  votes no and is counted in that rank's `faults`/`errors`; the turn's outcome, skip and
  every other counter are the agreed ones, the same on every rank. `forget_conversation`
  is `attach`'s (one process, TP=1).
"""

from __future__ import annotations

import functools
import logging
import threading
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from ..core import (
    NO_CARRY_REASONS,
    OUTCOME_KINDS,
    carry_eviction,
    carry_idle_s,
    carry_row_dtype,
    carry_slots,
)
from ..core.outcome import Adopted, NoCarry
from ..core.session import TicketCounter
from ..core.store_range import StoreRange
from .arena import Reserved
from .carried import CarriedRows, _current_stream, _on_stream
from .draft_pages import pages_of
from .identity import conversation_session, request_session, request_session_key
from .lockstep import Lockstep
from .options import CarryOptions

logger = logging.getLogger("trtllm_mtp_carry")

V = TypeVar("V")

SKIP_REASONS: tuple[str, ...] = (
    "dummy",  # warm-up or padding requests
    "no_conversation",  # no py_conversation_params.conversation_id
    "context_unfinished",  # freed before its context finished (cancelled, failed, never scheduled)
    "gap",  # a blind warm turn: keys [0, R) hold no valid rows
    "session_end",  # its conversation was forgotten (the session ended) while it ran
    "fault",  # an exception inside the carry dropped its carry state (counted in `faults`)
)
"""Why a freed request deposited nothing, in the order `stats()` lists them."""


ERROR_STEPS: tuple[str, ...] = ("prepare", "scatter", "deposit", "free", "other")
"""Where a fault was caught, in the order `stats()["errors"]` lists them (`other`: update,
dummy requests, resource counts, shutdown, reporting)."""

TURN_KINDS: tuple[str, ...] = ("cold", "warm", "resumed", "reverted")
"""`stats()["turns"]`: requests first seen cold (R = 0) or warm (R > 0); requests seen again
after a recompute pause (`resumed`); context chunks seen that never ran (`reverted`:
`revert_allocate_context` undid their allocation and the chunk came again)."""

PAUSED_LOG = 4096
"""How many requests freed unfinished (a recompute pause) are remembered until they come back."""

TURN_LOG = 4096
"""How many recent requests' turn records `turn()` and `pop_turn()` each keep (oldest dropped first)."""

VETO_STEPS: tuple[str, ...] = ("key", "adopt", "deposit")
"""`stats()["vetoed"]`: carry steps the tensor-parallel ranks did not take because
they did not agree, counted alike on every rank: `key` (a first-seen request the ranks would
not judge with the same carry key and reused depth), `adopt` (an adoption some rank could not
make: no rank restores), `deposit` (rows some rank could not hold: no rank keeps them). A
step vetoed by a rank's own gather or skip is a skip (`skipped`), not a veto."""

NOTHING = 1 + len(SKIP_REASONS)
"""A freed request's deposit vote when it has no row to keep (fewer than two tokens): after
the skip reasons' votes (`1 + SKIP_REASONS.index(why)`), counted as none of them."""


@dataclass(frozen=True)
class _Adoption:
    """An adoption one rank prepared: its rows `[0, rows)`, the entry taken, the request's pages."""

    rows: int
    taken: Any  # carried.TakenRows
    pages: Any  # the request's page ids for the MTP layer
    buf: Any  # the MTP layer's page views


@dataclass
class _Live:
    key: int | None  # the carry key (None: no conversation, never carried)
    conversation: int | None  # the conversation's session, before the salt
    reused: int  # R at first sight
    record: dict[str, object]  # the turn record `turn()` returns
    prompt_len: int  # LlmRequest.prompt_len
    valid: int = 0  # keys [0, valid) of its draft pages hold valid rows (restored or computed)
    chunk: tuple[int, int] = (0, 0)  # the last context chunk scheduled [start, end), not yet seen run
    last_chunk: bool = False  # that chunk reaches the prompt's end
    forgotten: bool = False  # its conversation ended while it ran: it deposits nothing
    dropped: bool = False  # a fault dropped its carry state: it adopts and deposits nothing

    def schedule(self, position: int, size: int) -> bool:
        """A context chunk `[position, position + size)` was scheduled (seen in prepare);
        True iff it undid the previous chunk (see below).

        The previous chunk ran iff the position moved past its end (`moveToNextContextChunk`);
        a position before it means it was undone (`revert_allocate_context`: the same chunk
        again, or the prefill rewound to 0, when "the caller drops any draft pool",
        kv_cache_manager_v2.py @ 00043967): it extends nothing, and no row at or past the
        position is known any more. A chunk starting past `valid` leaves keys
        `[valid, position)` unwritten: the request can no longer deposit.
        """
        start, end = self.chunk
        reverted = end > start and position < end
        if reverted:
            self.valid = min(self.valid, position)
        elif end > start and start <= self.valid:
            self.valid = max(self.valid, end)
        self.chunk = (position, position + size)
        self.last_chunk = position + size >= self.prompt_len
        return reverted

    @property
    def complete(self) -> bool:
        """Its last scheduled chunk starts inside the valid prefix: once it ran, keys
        `[0, prompt_len)` hold valid rows (a cold turn, or a warm one fully restored)."""
        return self.chunk[0] <= self.valid


def _guarded(default: object, step: str = "other") -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Wrap a method PyExecutor calls so no exception leaves it: a fault is counted and
    logged (`_fault` at `step`, one of `ERROR_STEPS`) and `default` returned."""
    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def guarded(self: CarryManagerCore, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except Exception as exc:
                self._fault(step, exc, None)
                return default
        return guarded
    return wrap


class CarryManagerCore:
    """The carry's resource-manager logic over one draft KV manager's MTP layer (see module doc)."""

    def __init__(self, draft: Any, mtp_layer: int, options: CarryOptions,
                 report: Callable[[str], None] | None = None, reserved: Reserved | None = None,
                 lockstep: Lockstep | None = None) -> None:
        self.draft = draft
        self.mtp_layer = mtp_layer
        self.options = options
        # the agreements with the other tensor-parallel ranks, and the clock the store reads
        self.lockstep = Lockstep.single() if lockstep is None else lockstep
        slots = carry_slots() if options.carry_slots is None else options.carry_slots
        idle_s = carry_idle_s() or None  # 0: entries never expire
        # issue 33: the rows live in the arenas reserved at install (trtllm/arena.py)
        self.reserved = reserved
        # the MTP layer's pages and the codec of their rows (K/V, or K/V with QSA's side rows)
        self.pages = pages_of(draft, mtp_layer)
        self.carried = CarriedRows(slots, options.device_bytes(), carry_eviction(), idle_s,
                                   host_budget_bytes=options.host_bytes(),
                                   row_dtype=options.carry_row_dtype, pool_dtype=self._pool_dtype(),
                                   codec=self.pages.codec(options.carry_row_dtype or carry_row_dtype()),
                                   arena=None if reserved is None else reserved.device,
                                   host_arena=None if reserved is None else reserved.host,
                                   clock=self.lockstep.now)
        self._tickets = TicketCounter()
        self._live: dict[int, _Live] = {}
        self._outcomes: Counter[str] = Counter()
        self._skips: Counter[str] = Counter()
        self._turns: Counter[str] = Counter()
        self._errors: Counter[str] = Counter()  # faults by step (ERROR_STEPS)
        self._faults: Counter[str] = Counter()  # faults by kind: the exception's class name
        self._logged: set[tuple[str, str]] = set()  # (step, kind) already logged (each once)
        self._paused: OrderedDict[int, None] = OrderedDict()  # freed unfinished: may come back
        self._turn_log: OrderedDict[int, dict[str, object]] = OrderedDict()  # by py_request_id
        self._client_log: OrderedDict[int, dict[str, object]] = OrderedDict()  # by py_client_id
        self._no_carry: Counter[str] = Counter()  # no_carry outcomes by reason
        self._vetoed: Counter[str] = Counter()  # steps the ranks did not agree on (VETO_STEPS)
        self._vetoed_logged = False
        self.rows_scattered = 0
        self.rows_deposited = 0
        self.rows_computed = 0  # the prompts' pair keys [R, L - 1) TensorRT-LLM's context computed
        self.sessions_ended = 0  # forget_conversation calls
        self.rows_freed = 0  # carried rows they dropped
        self._freed = 0  # requests freed, for `options.stats_every`
        self._report = report or (lambda line: logger.info("%s", line))
        self._lock = threading.RLock()

    # ---- BaseResourceManager protocol (resource_manager.py) --------------------------
    # Every method PyExecutor calls is guarded (`_guarded`): no exception leaves it.

    @_guarded(1)
    def get_max_resource_count(self) -> int:
        return 1  # holds no schedulable resource (as KVCacheManagerV2 answers)

    @_guarded(0)
    def get_needed_resource_to_completion(self, request: Any) -> int:
        return 0

    @_guarded(None)
    def add_dummy_requests(self, request_ids: Any, *args: Any, **kwargs: Any) -> None:
        return None  # dummies are never carried

    @_guarded(None)
    def update_resources(self, scheduled_batch: Any, *args: Any, **kwargs: Any) -> None:
        return None

    @_guarded(None)
    def shutdown(self) -> None:
        try:
            if self.options.stats_every:
                self._report(self.stats_line())
        finally:
            self.carried.clear()

    @_guarded(None, "prepare")
    def prepare_resources(self, scheduled_batch: Any, *args: Any, **kwargs: Any) -> None:
        """Adopt for every context request seen for the first time (see the module doc).

        One request's fault drops that request's carry state only: the others go on.
        Arguments past the batch (what `ResourceManager` gives KV cache managers, e.g.
        `attn_metadata`) are accepted and not read.

        Under tensor parallelism the first-seen requests are judged in lockstep (`_adopt`):
        every rank reaches the same agreements here, whatever its own steps did."""
        firsts = [(int(r.py_request_id), r) for r in scheduled_batch.context_requests
                  if not r.is_dummy_request and int(r.py_request_id) not in self._live]
        for request in scheduled_batch.context_requests:
            rid = None
            try:
                rid = int(request.py_request_id)
                self._prepare_one(rid, request)
            except Exception as exc:  # the turn runs blind; nothing more is written for it
                self._fault("prepare", exc, rid)
        if firsts:
            self._adopt(firsts)

    def _prepare_one(self, rid: int, request: Any) -> None:
        # this chunk reaches the prompt's end (C++ isLastContextChunk, read in our own
        # prepare: outside the draft's request_context, after the scheduler set the chunk)
        position = int(request.context_current_position)
        prompt_len = int(request.prompt_len)  # LlmRequest.prompt_len: no token copy
        size = int(request.context_chunk_size)
        known = self._live.get(rid)
        if known is not None:  # a later chunk, or a chunk again after revert_allocate_context
            with self._lock:
                if known.schedule(position, size):
                    self._turns["reverted"] += 1  # the last chunk seen never ran
                    known.record["reverted"] = int(known.record.get("reverted", 0)) + 1  # type: ignore[call-overload]
            return
        if request.is_dummy_request:
            return  # never tracked: free skips it as dummy
        found = request_session(request)
        key, conversation = (None, None) if found is None else found
        reused = position  # R: the prepopulated length at first sight
        first = "no_conversation" if key is None else "pending" if reused else "cold"
        # the prompt's pair keys [R, L - 1) TensorRT-LLM's context phase computes, counted
        # as the reference engine counts `drafter_rows_computed`
        computed = max(0, prompt_len - 1 - reused)
        record = _turn_record(reused, first, computed)
        live = _Live(key, conversation, reused, record, prompt_len)
        live.schedule(position, size)
        client = getattr(request, "py_client_id", None)  # the LLM API's id of the request
        with self._lock:
            self._live[rid] = live
            resumed = self._paused.pop(rid, 0) is None  # back after a recompute pause
            if resumed:
                record["resumed"] = True
            self._turns["resumed" if resumed else "warm" if reused else "cold"] += 1
            self.rows_computed += computed
            _remember(self._turn_log, rid, record, TURN_LOG)
            if client is not None:
                _remember(self._client_log, int(client), record, TURN_LOG)

    @_guarded(None, "free")
    def free_resources(self, request: Any, *args: Any, **kwargs: Any) -> None:
        """Deposit a freed request's valid rows, before the draft pool frees its pages.

        PyExecutor frees a finished request, and also one it pauses for recompute
        (`_terminate_recompute_paused_requests`, then `reset_for_recompute`): that one
        comes back as a context request under the same id; its rows are deposited
        like a finished turn's and it is judged again when it comes back. Arguments past
        the request (a KV cache manager's `pin_on_release`) are accepted and not read."""
        rid = None
        live = None
        try:
            rid = int(request.py_request_id)
            with self._lock:
                live = self._live.get(rid)
            deposited = self._deposit(rid, request, live)
            if not request.is_dummy_request and not request.is_finished:  # a recompute pause
                with self._lock:
                    _remember(self._paused, rid, None, PAUSED_LOG)
        except Exception as exc:  # nothing is deposited; the lease ends below
            deposited = False
            self._fault("free", exc, rid)
            self._skip("fault", live)
        finally:
            self._release(rid, live, deposited)

    def _release(self, rid: int | None, live: _Live | None, deposited: bool) -> None:
        try:
            with self._lock:
                # popped only now: a forget until here marks it (`_deposit` checks under the lock)
                if rid is not None:
                    self._live.pop(rid, None)
                ended = live is not None and live.forgotten
            if not deposited and live is not None and live.key is not None and not ended:
                self.carried.end_lease(live.key)  # rows it adopted are gone with its pages
            every = self.options.stats_every
            with self._lock:
                self._freed += 1
                due = bool(every) and self._freed % every == 0
            if due:
                self._report(self.stats_line())
        except Exception as exc:
            self._fault("other", exc, None)

    def forget_conversation(self, conversation_id: str, lora_id: int | None = None) -> int:
        """Drop the carried rows of conversation `conversation_id` (under every salt): its
        session ended. Its requests still live deposit nothing (skipped `session_end`).
        Returns the rows dropped from the store; ValueError/TypeError name a bad id."""
        conversation = conversation_session(conversation_id, lora_id)
        with self._lock:
            for live in self._live.values():
                if live.conversation == conversation:
                    live.forgotten = True
            freed = self.carried.forget(conversation)
            self.sessions_ended += 1
            self.rows_freed += freed
            return freed

    def _deposit(self, rid: int, request: Any, live: _Live | None) -> bool:
        """Deposit a freed request's valid rows. A request the carry tracks (`live`, seen in
        prepare: the same requests on every rank) deposits in lockstep: every rank gathers, then
        `agree_deposit` (deposit only if every rank gathered the same rows of the same key, else
        every rank skips for the same reason), then every rank stages, then `agree_all` (commit
        only if every rank placed the rows, else every rank refuses them as `oom`)."""
        if live is None:  # never tracked (a dummy, or freed before it was scheduled): no vote
            tokens = [] if request.is_dummy_request else list(request.get_tokens(0))
            why = self._skip_reason(request, live, len(tokens))
            if why is not None:
                self._skip(why, live)
            return False
        try:  # whatever this rank's request looks like, it reaches the vote below
            tokens = list(request.get_tokens(0))
            why = self._skip_reason(request, live, len(tokens))
        except Exception as exc:
            self._fault("free", exc, rid)
            tokens, why = [], "fault"
        valid = len(tokens) - 1  # key k consumed tokens[0 ..= k + 1]: keys [0, N - 1)
        rows = None
        if why is None and valid > 0:
            try:
                pages = self.pages.page_ids(rid)
                buf = self.pages.views()
                with self._draft_stream():
                    codec = self.carried.codec or self.pages.codec(self.carried.row_dtype)
                    rows = codec.gather_pages(buf, pages, 0, valid)  # [valid, 2, Hkv, D], held form
                    self._sync()
            except Exception as exc:  # the carry may cost acceptance, never the executor
                self._fault("deposit", exc, rid)
                why = "fault"
        status = 1 + SKIP_REASONS.index(why) if why is not None else 0 if valid > 0 else NOTHING
        agreed = self.lockstep.agree_deposit(live.key or 0, status, valid)
        if agreed != 0:
            if 0 < agreed < NOTHING:
                self._skip(SKIP_REASONS[agreed - 1], live)
            elif agreed == -1:  # every rank would deposit, but not the same key or rows
                self._skip("fault", live)
            return False
        assert rows is not None and live.key is not None
        with self._lock:  # against forget_conversation: either it marked us, or it sees the entry
            staged = None
            if live.forgotten:
                self._skip("session_end", live)
            else:
                try:
                    staged = self.carried.stage(live.key, tokens, rows, live.conversation)
                except Exception as exc:  # the store itself: a fault of the free, not of the gather
                    self._fault("free", exc, rid)
                    self._skip("fault", live)
            every, some = self.lockstep.agree_all(staged is not None)
            if not every:
                if some:  # a rank could not hold the rows: no rank keeps them
                    self._vetoed["deposit"] += 1
                if staged is not None:
                    self.carried.abort(staged)
                return False
            assert staged is not None
            self.carried.commit(staged)
            self.rows_deposited += valid
            live.record["rows_deposited"] = valid
        return True

    def _skip(self, why: str, live: _Live | None) -> None:
        with self._lock:
            self._skips[why] += 1
            if live is not None:
                live.record["skipped"] = why

    # ---- reporting ---------------------------------------------------------------------

    def turn(self, request_id: int) -> dict[str, object] | None:
        """One request's turn record, or None (unknown, dummy, or older than `TURN_LOG` requests).

        Keys: `reused` (R), `outcome` (`cold`: R = 0, nothing to judge; `no_conversation`;
        or the core's outcome kind: `adopted`, `no_carry`, `prefix_mismatch`, ...),
        `no_carry_reason` (a `no_carry` outcome's reason, else ""), `rows_scattered` (the
        carried rows kept, keys `[0, n)`), `rows_computed` (the prompt's pair keys
        `[R, L - 1)` TensorRT-LLM's context phase computes), `rows_deposited` (0 until it was
        freed), `skipped` (why nothing was deposited, `SKIP_REASONS`, or None).
        """
        with self._lock:
            record = self._turn_log.get(int(request_id))
            return None if record is None else dict(record)

    def pop_turn(self, client_id: int) -> dict[str, object] | None:
        """The turn record (as `turn`) of the request the LLM API calls `client_id`
        (`RequestOutput.request_id`, the executor's `LlmRequest.py_client_id`), removed: each
        is read once. None if unknown, dummy, already read or older than `TURN_LOG` requests.
        Complete once the request's context started, so by its first token; `rows_deposited`
        may still be 0 then (TensorRT-LLM frees a request after its final response)."""
        with self._lock:
            record = self._client_log.pop(int(client_id), None)
            return None if record is None else dict(record)

    def stats(self) -> dict[str, object]:
        """Counters by outcome and skip reason, turns seen, rows moved, and what the store holds."""
        with self._lock:
            return {
                "outcomes": {kind: self._outcomes.get(kind, 0) for kind in OUTCOME_KINDS},
                "skipped": {why: self._skips.get(why, 0) for why in SKIP_REASONS},
                "turns": {kind: self._turns.get(kind, 0) for kind in TURN_KINDS},
                "rows_scattered": self.rows_scattered,
                "rows_deposited": self.rows_deposited,
                "rows_computed": self.rows_computed,
                "no_carry_reasons": {r: self._no_carry.get(r, 0) for r in NO_CARRY_REASONS},
                "sessions_ended": self.sessions_ended,
                "rows_freed": self.rows_freed,
                "errors": {step: self._errors.get(step, 0) for step in ERROR_STEPS},
                "faults": dict(sorted(self._faults.items())),
                "live_requests": len(self._live),
                "lockstep": {"tp_size": self.lockstep.tp_size, "agreements": self.lockstep.agreements},
                "vetoed": {step: self._vetoed.get(step, 0) for step in VETO_STEPS},
                **self.carried.stats(),
            }

    def stats_line(self) -> str:
        """`stats()` as one line (zero counters left out): what `stats_every` prints."""
        s = self.stats()

        def nonzero(d: object) -> str:
            assert isinstance(d, dict)
            return ", ".join(f"{k} {v}" for k, v in d.items() if v) or "none"

        turns = s["turns"]
        assert isinstance(turns, dict)
        with self._lock:
            freed = self._freed
        return (f"mtp carry: after {freed} freed requests: turns cold {turns['cold']}, warm {turns['warm']}; "
                f"outcomes: {nonzero(s['outcomes'])}; skipped: {nonzero(s['skipped'])}; "
                f"errors: {nonzero(s['errors'])}; faults: {nonzero(s['faults'])}; rows scattered {s['rows_scattered']}, deposited "
                f"{s['rows_deposited']}; held {s['entries']} entries, {s['bytes_held']} bytes "
                f"(host {s['host_entries']} entries, {s['host_bytes_held']} bytes); "
                f"evictions: {nonzero(s['evictions'])}")

    # ---- steps -------------------------------------------------------------------------

    def _adopt(self, firsts: list[tuple[int, Any]]) -> None:
        """Judge and restore this batch's first-seen context requests, in lockstep.

        Every rank agrees which requests it would judge (the same carry key and reused depth R
        on every rank: `agree_first_sights`, which also fixes the clock the judges read),
        judges and takes them, resolves their pages, then agrees the rows each can restore
        (`agree_rows`, the MIN over ranks) before any rank scatters: rows of keys `[0, m)`
        land on every rank, or on none (a rank that could not adopt cancels every rank's
        adoption; that turn's carry is dropped on every rank, counted in `vetoed`)."""
        wants: list[tuple[int, int]] = []
        for rid, _ in firsts:
            live = self._live.get(rid)
            judged = live is not None and live.key is not None and live.reused > 0 and not live.dropped
            wants.append((live.key, live.reused) if judged and live is not None and live.key is not None
                         else (0, 0))
        eligible = self.lockstep.agree_first_sights(wants)
        plans: list[tuple[int, _Live | None, _Adoption | None]] = []
        for (rid, request), ok in zip(firsts, eligible, strict=True):
            if ok == 1:
                live = self._live.get(rid)
                plans.append((rid, live, self._plan_adoption(rid, request, live)))
            elif ok == -1:  # the ranks would not judge it alike: none does
                self._disagreement(rid)
        if not plans:
            return
        agreed, best = self.lockstep.agree_rows([0 if p is None else p.rows for _, _, p in plans])
        for (rid, live, plan), m, top in zip(plans, agreed, best, strict=True):
            if m > 0 and plan is not None and live is not None:
                self._scatter(rid, live, plan, m)
            elif top > 0:  # some rank could adopt and another could not: none does
                with self._lock:
                    self._vetoed["adopt"] += 1
                    if live is not None:
                        live.dropped = True  # it adopts and deposits nothing, on every rank

    def _plan_adoption(self, rid: int, request: Any, live: _Live | None) -> _Adoption | None:
        """Judge request `rid` (the core's `decide_adopt`), take its entry and resolve its pages:
        the rows this rank can restore, or None (a miss, or a fault: counted, the turn blind)."""
        try:
            assert live is not None and live.key is not None
            # int64 buffer: decide_adopt compares it with the entry's buffer in typed memory
            prompt = array("q", request.get_tokens(0))
            ticket = self._tickets.draw()
            # TensorRT-LLM's context phase computes the MTP rows of keys [R, L) itself: that is
            # the span the core's plan may append, so it is this ticket's projected store range.
            projected = StoreRange(ticket, live.reused, max(live.reused, len(prompt)))
            outcome, taken = self.carried.judge_and_take(live.key, prompt, ticket, projected,
                                                         live.conversation)
        except Exception as exc:  # the turn runs blind over [0, R); it deposits nothing
            self._fault("prepare", exc, rid)
            return None
        with self._lock:
            self._outcomes[outcome.kind] += 1
            live.record["outcome"] = outcome.kind
            if isinstance(outcome, NoCarry):
                live.record["no_carry_reason"] = outcome.reason
                self._no_carry[outcome.reason] += 1
        if not isinstance(outcome, Adopted) or taken is None:
            return None  # the turn runs blind over [0, R), as TensorRT-LLM does without the carry
        try:
            pages = self.pages.page_ids(rid)
            buf = self.pages.views()
        except Exception as exc:  # the turn runs blind over [0, R); it deposits nothing
            self._fault("scatter", exc, rid)
            return None
        return _Adoption(min(outcome.rows, live.reused), taken, pages, buf)

    def _scatter(self, rid: int, live: _Live, plan: _Adoption, n: int) -> None:
        """Rows of keys `[0, n)` (the agreed range) into request `rid`'s pages."""
        try:
            with self._draft_stream():
                # head: host-tier rows make the draft stream wait for their copy back (GPU side)
                plan.taken.codec.scatter_pages(plan.buf, plan.pages, 0, plan.taken.head(n))
            self._forward_waits_for_draft_stream()
        except Exception as exc:  # the turn runs blind over [0, R); it deposits nothing
            self._fault("scatter", exc, rid)
            return
        with self._lock:
            live.valid = n
            self.rows_scattered += n
            live.record["rows_scattered"] = n

    def _disagreement(self, rid: int) -> None:
        """Ranks disagreed on whether (or with which key or depth) to judge request `rid`: it
        runs blind on every rank. Logged once: a TensorRT-LLM build that does not broadcast
        `py_conversation_params` to every rank carries nothing under tensor parallelism."""
        with self._lock:
            self._vetoed["key"] += 1
            first = not self._vetoed_logged
            self._vetoed_logged = True
        if first:
            logger.warning("mtp carry: the tensor-parallel ranks disagree on request %s's carry key or "
                           "reused depth (does every rank receive its conversation id?): no rank "
                           "carries it; later disagreements are counted in vetoed.key", rid)

    def _fault(self, step: str, exc: Exception, rid: int | None) -> None:
        """An exception inside the carry: counted by kind and step, logged once per (step, kind),
        and request `rid`'s carry state dropped (it adopts and deposits nothing more); never raised.

        The log key is the pair, not the kind alone: a `KeyError` at prepare and one at free are
        two different failures, and an operator must see both."""
        kind = type(exc).__name__
        with self._lock:
            self._faults[kind] += 1
            self._errors[step] += 1
            first = (step, kind) not in self._logged
            self._logged.add((step, kind))
            live = None if rid is None else self._live.get(rid)
            if live is None and rid is not None and step == "prepare":
                # seen now and dropped: a later chunk of it must not be judged as a first sight
                live = self._live[rid] = _Live(None, None, 0, _turn_record(0, "fault", 0), 0)
                _remember(self._turn_log, rid, live.record, TURN_LOG)
            if live is not None:
                live.dropped = True
                live.record["error"] = f"{step}: {kind}: {exc}"
        if first:
            logger.warning("mtp carry: %s raised %s (%s): that turn runs without the carry and "
                           "the executor goes on; later %s faults at %s are counted, not logged",
                           step, kind, exc, kind, step)

    def _skip_reason(self, request: Any, live: _Live | None, num_tokens: int) -> str | None:
        if request.is_dummy_request:
            return "dummy"
        if live is not None and live.dropped:
            return "fault"
        if (live.key if live is not None else request_session_key(request)) is None:
            return "no_conversation"
        # At free TensorRT-LLM's is_context_finished is False for every request (the state
        # is GENERATION_COMPLETE): the context finished iff its last chunk was scheduled here
        # and the sampler then appended a token (an error or a cancel before that leaves
        # get_tokens at the prompt). Rows [0, N - 1) were then written by the context phase
        # and the completed generation steps; the overlap scheduler's extra step writes
        # only keys >= N - 1.
        if live is None or not live.last_chunk or num_tokens <= live.prompt_len:
            return "context_unfinished"  # never scheduled, or freed before its context finished
        if not live.complete:
            return "gap"
        if live.forgotten:
            return "session_end"
        return None

    def _cuda_draft_stream(self) -> Any | None:
        """KVCacheManagerV2._stream (a torch stream) where CUDA runs, else None."""
        stream = getattr(self.draft, "_stream", None)
        return stream if stream is not None and _cuda_available() else None

    def _pool_dtype(self) -> torch.dtype:
        """The draft pool's element dtype (the MTP layer's HND pages): with `carry_row_dtype` it
        chooses the carried rows' codec (`row_codec.codec_for`: an FP8 pool carries its own bytes)."""
        dtype: torch.dtype = self.pages.kv().dtype  # an NVFP4 pool: its marker dtype (not int8)
        return dtype

    def _draft_stream(self) -> AbstractContextManager[Any]:
        stream = self._cuda_draft_stream()
        if stream is None:
            return nullcontext()
        # What runs there reads what the executor's stream wrote (the forward's pages for a
        # gather, rows a deposit put into the arena for a scatter): the GPU orders it after.
        stream.wait_stream(_current_stream(stream.device))
        return _on_stream(stream)

    def _sync(self) -> None:
        # A gather's rows must be complete before free_resources hands the pages back to the
        # pool (another request may then write them): the CPU waits here, at the end of a turn.
        stream = self._cuda_draft_stream()
        if stream is not None:
            stream.synchronize()

    def _forward_waits_for_draft_stream(self) -> None:
        # The scattered pages are first read by the next forward, queued on the executor's
        # stream (current here, in prepare_resources): that stream waits for the draft stream
        # on the GPU and the CPU goes on, so a host-tier copy back and the scatter overlap what
        # the executor queues next (the prefill) instead of blocking prepare_resources.
        stream = self._cuda_draft_stream()
        if stream is not None:
            _current_stream(stream.device).wait_stream(stream)


# ---- the draft stream's CUDA calls (one seam: CPU tests put a recorder in their place; the
# stream calls are carried.py's, the same functions under this module's names) ----


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _turn_record(reused: int, outcome: str, rows_computed: int) -> dict[str, object]:
    """A request's turn record (`turn()`'s keys) at first sight: nothing scattered or deposited yet."""
    return {"reused": reused, "outcome": outcome, "no_carry_reason": "", "rows_scattered": 0,
            "rows_computed": rows_computed, "rows_deposited": 0, "skipped": None}


def _remember(log: OrderedDict[int, V], key: int, value: V, limit: int) -> None:
    """`log[key] = value` as the newest of an LRU of at most `limit` keys (the oldest dropped)."""
    log[key] = value
    log.move_to_end(key)
    while len(log) > limit:
        log.popitem(last=False)


_CLASSES: dict[type, type] = {}


def carry_manager_class(base: type) -> type[CarryManagerCore]:
    """`CarryResourceManager`: the core logic as a subclass of the executor's `BaseResourceManager`.

    `base` is taken from the draft manager's own class hierarchy, so the same
    code runs on TensorRT-LLM and on the stand-in without importing either.
    """
    cls = _CLASSES.get(base)
    if cls is None:
        cls = type("CarryResourceManager", (CarryManagerCore, base), {
            "__doc__": "The carry's resource manager (`CarryManagerCore`) as a "
                       f"`{base.__module__}.{base.__name__}`.",
            "__init__": CarryManagerCore.__init__,
        })
        _CLASSES[base] = cls
    return cls
