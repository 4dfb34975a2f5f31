"""The carry resource manager: TensorRT-LLM's request events translated into calls on the carry service.

What it is for: inside TensorRT-LLM's `PyExecutor`, an unpaired draft pool gives a warm
turn fresh, unwritten draft pages for the reused prefix `[0, R)` (the drafter is blind
there). This manager, appended to `resource_manager.resource_managers` after the draft KV
manager, fills them from the one carry service (`service.CarryService`, which the
reference engine uses too), and hands the service the request's pages:

```
  draft pages of a warm turn:
  | carried rows (scattered here) | new span: TensorRT-LLM's context phase |
  0                               R = context_current_position          L
```

- `prepare_resources(batch)` runs after the draft manager's (the dict is iterated
  forward), so the request's pages exist. On the first sight of a context request of a
  conversation, the service judges this session's carried entry against the prompt (the
  core's decision, counted for every turn as the reference engine counts it); if adopted,
  the kept rows below `R` are scattered into the request's pages for the MTP layer, on the
  draft pool's stream (a turn with `R = 0` recomputes every row: nothing to scatter).
- `free_resources(request)` runs before the draft manager's (the dict is iterated in
  reverse), so the pages are still live: the service plans the deposit first (admitted or
  refused before any row moves) and then gathers the request's valid run of keys, straight
  into the room it reserved. The valid run is the keys whose rows the request's pages
  hold: those restored at adoption and those its context chunks and generation steps
  computed, up to key `N - 2` of its `N` tokens (later keys are draft steps' rows over
  drafted tokens: never kept). A turn that missed deposits the run its context computed,
  keys `[R, N - 1)` (a known-invalid prefix `[0, R)`), so the session's next turn adopts
  it instead of staying blind while its prefix is reused.
- `forget_conversation(conversation_id)` (the session ended) drops the conversation's
  carried rows under every salt, and marks its requests still live so they deposit nothing.
- Every request's turn record (R, the outcome, rows adopted and computed) is kept under its
  executor id (`turn`) and its LLM API id (`pop_turn`), each an LRU of `TURN_LOG` records.

Invariants:
- Dummy requests, requests without a conversation id, requests freed before their context
  finished and requests whose conversation was forgotten while they ran are never carried,
  and leave nothing behind (their bookkeeping is dropped at free).
- A request deposits only keys its own pages hold valid rows for: one run, the one that
  reaches its last key; a page below the run holds whatever the pool had and is never carried.
- Rows move as TensorRT-LLM wrote them (roped at k): gather and scatter, no re-rope, through
  the rows' codec (`dataplane/row_codec.py`): an FP8 or NVFP4 KV pool's rows are its own
  bytes, exactly; a BF16 pool's rows as they are, or packed to fp8 or nvfp4.
- The rows wait in the service's arenas reserved at install (`reservation.py`); a deposit
  the arena cannot place is refused as `oom`, never raised.
- No exception of any type leaves a method PyExecutor calls (every `BaseResourceManager`
  method, `resource_manager.py` @ d2a5560a): a fault runs that turn blind, drops that
  request's carry state (it adopts and deposits nothing more), and is recorded by the
  service's fault ledger (by class and step, logged once per pair); the other requests and
  the executor go on, and outputs never depend on the drafter's rows.
- A request's state follows its chunks (`_Live.schedule`): a chunk counts as run only once
  the next one starts past it, so a chunk undone by `revert_allocate_context` extends
  nothing; a request freed unfinished (the recompute pause) deposits like a finished turn
  and is judged afresh when it comes back (`resumed`); one the V2 scheduler preempted has
  lost its draft pages before this free (skipped `preempted`: nothing deposited), and comes
  back with fresh ones.
- Nothing is written outside the request's own fresh pages for keys below `R`; the manager
  is installed only on the unpaired topology (never on paired or folded pools).
- After `shutdown` the service holds nothing (`CarryService.detach` raises if it does).
- Tensor parallelism (`lockstep`, trtllm/lockstep.py; a no-op at TP=1): each rank's manager
  holds its head shard's rows and takes every decision as the other ranks do. Prepare agrees
  once per batch of first-seen context requests (the clock, each request's carry key and R),
  then the rows each rank can restore (every rank restores the MIN, or none does); free agrees
  on the run to deposit, then the service agrees the room and the gathered rows (kept only if
  every rank has them). Every rank reaches those agreements alike, whatever its own steps did:
  a local fault votes no and is counted in that rank's `faults`; the outcomes, skips and every
  other counter are the agreed ones. `forget_conversation` is `attach`'s (one process, TP=1).
"""

from __future__ import annotations

import logging
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

from ..core import carry_eviction, carry_idle_s, carry_row_dtype, carry_slots, merge_interval
from ..core.carry_store import remember
from ..core.outcome import Adopted, CarryOutcome
from ..core.session import TicketCounter
from ..core.store_range import StoreRange
from ..dataplane import streams
from ..service import VETO_STEPS, CarryService, CarryStats, guarded
from ..service.homes import ArenaHome
from ..service.stats import SKIP_REASONS
from .draft_pages import TurnPages, pages_of
from .identity import conversation_session, request_session, request_session_key
from .lockstep import Lockstep
from .options import CarryOptions
from .reservation import Reserved, reserve_for

logger = logging.getLogger("trtllm_mtp_carry")

PAUSED_LOG = 4096
"""How many requests freed unfinished (a recompute pause) are remembered until they come back."""

TURN_LOG = 4096
"""How many recent requests' turn records `turn()` and `pop_turn()` each keep (oldest dropped first)."""

NOTHING = 1 + len(SKIP_REASONS)
"""A freed request's deposit vote when it has no row to keep: after the skip reasons' votes
(`1 + SKIP_REASONS.index(why)`), counted as none of them."""


@dataclass(frozen=True)
class _Adoption:
    """What one rank's judge found for a first-seen request: the outcome, and the rows of the
    entry's keys below R this rank can restore (`first`: the entry's first key)."""

    outcome: CarryOutcome | None
    rows: int
    first: int
    able: bool = False  # adopted, and this rank can read the request's pages

    @property
    def vote(self) -> int:
        """What this rank says to `agree_rows`: 0 when it cannot adopt, else its rows plus one."""
        return self.rows + 1 if self.able else 0


@dataclass
class _Live:
    key: int | None  # the carry key (None: no conversation, never carried)
    conversation: int | None  # the conversation's session, before the salt
    reused: int  # R at first sight
    record: dict[str, object]  # the turn record `turn()` returns
    prompt_len: int  # LlmRequest.prompt_len
    run: tuple[int, int] = (0, 0)  # keys [lo, hi) of its draft pages hold valid rows (restored or computed)
    chunk: tuple[int, int] = (0, 0)  # the last context chunk scheduled [start, end), not yet seen run
    last_chunk: bool = False  # that chunk reaches the prompt's end
    forgotten: bool = False  # its conversation ended while it ran: it deposits nothing
    dropped: bool = False  # a fault dropped its carry state: it adopts and deposits nothing

    def schedule(self, position: int, size: int) -> bool:
        """A context chunk `[position, position + size)` was scheduled (seen in prepare);
        True iff it undid the previous chunk (see below).

        The previous chunk ran iff the position moved past its end (`moveToNextContextChunk`):
        its keys join the valid run if they overlap or abut it, else they start the run anew
        (`merge_interval`: a run of keys, never a gap claimed valid). A position before it means
        it was undone (`revert_allocate_context`: the same chunk again, or the prefill rewound
        to 0, when "the caller drops any draft pool", kv_cache_manager_v2.py @ 00043967): it
        extends nothing, and no row at or past the position is known any more.
        """
        start, end = self.chunk
        reverted = end > start and position < end
        if reverted:
            lo, hi = self.run
            self.run = (lo, min(hi, position)) if min(hi, position) > lo else (0, 0)
        elif end > start:
            self.run = merge_interval(self.run, start, end - start)
        self.chunk = (position, position + size)
        self.last_chunk = position + size >= self.prompt_len
        return reverted

    def valid_run(self, num_tokens: int) -> tuple[int, int]:
        """Keys `[lo, num_tokens - 1)` its pages hold valid rows for once its last chunk ran (the
        run that chunk extends or starts), the keys past the prompt written by generation steps."""
        start, end = self.chunk
        lo, _ = merge_interval(self.run, start, end - start)
        return lo, num_tokens - 1


def _other_default(value: object) -> Callable[..., object]:
    """A recovery answering `value` (for the protocol methods whose fault is `other`)."""
    return lambda self, *args, **kwargs: value


class CarryManagerCore:
    """The carry's resource-manager logic over one draft KV manager's MTP layer (see module doc).

    `reserved` is the carry's memory (`reservation.Reserved`, reserved before TensorRT-LLM
    sized its KV cache); without it the arenas are reserved here from `options`. `slots`
    (None: no cap), `eviction`, `idle_s` (None: never) and `clock` override the process
    settings `options` does not carry (`carry_slots()` unless `options.carry_slots`,
    `carry_eviction()`, `carry_idle_s()`, the lockstep's clock), as `CarryRuntime`'s do.
    `lockstep` is the agreement with the other tensor-parallel ranks (`trtllm/lockstep.py`;
    None: one rank, no collective)."""

    _UNSET: Any = object()

    def __init__(self, draft: Any, mtp_layer: int, options: CarryOptions,
                 report: Callable[[str], None] | None = None, reserved: Reserved | None = None,
                 *, lockstep: Lockstep | None = None, slots: int | None = _UNSET, eviction: str | None = None,
                 idle_s: float | None = _UNSET, clock: Callable[[], float] | None = None) -> None:
        self.draft = draft
        self.mtp_layer = mtp_layer
        self.options = options
        # the agreements with the other tensor-parallel ranks, and the clock the store reads
        self.lockstep = Lockstep.single() if lockstep is None else lockstep
        self.reserved = reserved if reserved is not None else reserve_for(draft, mtp_layer, options)
        # the MTP layer's pages and the codec of their rows (K/V, or K/V with QSA's side rows)
        self.pages = pages_of(draft, mtp_layer)
        kv = self.pages.kv()
        codec = self.pages.codec(options.carry_row_dtype or carry_row_dtype())
        home = ArenaHome(codec, self.reserved.device, int(kv.shape[2]), int(kv.shape[4]))
        if slots is CarryManagerCore._UNSET:
            slots = carry_slots() if options.carry_slots is None else options.carry_slots
        if idle_s is CarryManagerCore._UNSET:
            idle_s = carry_idle_s() or None  # 0: entries never expire
        self.service = CarryService(home, slots=slots, budget_bytes=self.reserved.device.capacity,
                                    eviction=carry_eviction() if eviction is None else eviction,
                                    idle_s=idle_s, clock=self.lockstep.now if clock is None else clock,
                                    host_arena=self.reserved.host)
        self.ledger = self.service.ledger
        self._tickets = TicketCounter()
        self._live: dict[int, _Live] = {}
        self._paused: OrderedDict[int, None] = OrderedDict()  # freed unfinished: may come back
        self._turn_log: OrderedDict[int, dict[str, object]] = OrderedDict()  # by py_request_id
        self._client_log: OrderedDict[int, dict[str, object]] = OrderedDict()  # by py_client_id
        self._freed = 0  # requests freed, for `options.stats_every`
        self._vetoed: Counter[str] = Counter()  # steps the ranks did not agree on (VETO_STEPS)
        self._vetoed_logged = False
        self._vetoed_now = False  # the last agreement: some rank could, another could not
        self._report = report or (lambda line: logger.info("%s", line))

    @property
    def _lock(self) -> Any:
        return self.service.lock

    # ---- BaseResourceManager protocol (resource_manager.py) --------------------------
    # Every method PyExecutor calls is guarded: no exception leaves it.

    @guarded("other", _other_default(1), turn=False)
    def get_max_resource_count(self) -> int:
        return 1  # holds no schedulable resource (as KVCacheManagerV2 answers)

    @guarded("other", _other_default(0), turn=False)
    def get_needed_resource_to_completion(self, request: Any) -> int:
        return 0

    @guarded("other", turn=False)
    def add_dummy_requests(self, request_ids: Any, *args: Any, **kwargs: Any) -> None:
        return None  # dummies are never carried

    @guarded("other", turn=False)
    def update_resources(self, scheduled_batch: Any, *args: Any, **kwargs: Any) -> None:
        return None

    @guarded("other", turn=False)
    def shutdown(self) -> None:
        try:
            if self.options.stats_every:
                self._report(self.stats_line())
        finally:
            self.service.detach()

    @guarded("prepare", turn=False)
    def prepare_resources(self, scheduled_batch: Any, *args: Any, **kwargs: Any) -> None:
        """Adopt for every context request seen for the first time (see the module doc).

        One request's fault drops that request's carry state only: the others go on.
        Arguments past the batch (what `ResourceManager` gives KV cache managers, e.g.
        `attn_metadata`) are accepted and not read.

        Under tensor parallelism the first-seen requests are judged in lockstep (`_adopt`):
        every rank reaches the same agreements here, whatever its own steps did."""
        firsts: list[tuple[int, Any]] = []  # every first-seen request votes, its own fault or not
        for request in scheduled_batch.context_requests:
            rid = None
            try:
                rid = int(request.py_request_id)
                if not request.is_dummy_request and rid not in self._live:
                    firsts.append((rid, request))
                self._prepare_one(rid, request)
            except Exception as exc:  # the turn runs blind; nothing more is written for it
                self._fault("prepare", exc, rid)
        if firsts:
            self._adopt_firsts(firsts)

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
                    self.service.counters.turns["reverted"] += 1  # the last chunk seen never ran
                    known.record["reverted"] = int(known.record.get("reverted", 0)) + 1  # type: ignore[call-overload]
            return
        if request.is_dummy_request:
            return  # never tracked: free skips it as dummy
        found = request_session(request)
        key, conversation = (None, None) if found is None else found
        reused = position  # R: the prepopulated length at first sight
        first = "no_conversation" if key is None else "pending"
        # the prompt's pair keys [R, L - 1) TensorRT-LLM's context phase computes, counted
        # as the reference engine counts the rows its prefill builds
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
            self.service.counters.turns["resumed" if resumed else "warm" if reused else "cold"] += 1
            remember(self._turn_log, rid, record, TURN_LOG)
            if client is not None:
                remember(self._client_log, int(client), record, TURN_LOG)

    def _free_fault(self, request: Any, *args: Any, **kwargs: Any) -> None:
        return None  # `free_resources` records its own faults; this answers one outside them

    @guarded("deposit", _free_fault, turn=False)
    def free_resources(self, request: Any, *args: Any, **kwargs: Any) -> None:
        """Deposit a freed request's valid rows, before the draft pool frees its pages.

        PyExecutor frees a finished request, and also one it pauses for recompute
        (`_terminate_recompute_paused_requests`, then `reset_for_recompute`): that one comes
        back as a context request under the same id; its rows are deposited like a finished
        turn's and it is judged again when it comes back. Arguments past the request (a KV
        cache manager's `pin_on_release`) are accepted and not read."""
        rid = None
        live = None
        try:
            rid = int(request.py_request_id)
            with self._lock:
                live = self._live.get(rid)
            deposited = self._deposit(rid, request, live)
            if not request.is_dummy_request and not request.is_finished:  # a recompute pause
                with self._lock:
                    remember(self._paused, rid, None, PAUSED_LOG)
        except Exception as exc:  # nothing is deposited; the lease ends below
            deposited = False
            self._fault("deposit", exc, rid)
            self._skip("fault", live)
        finally:
            self._release(rid, live, deposited)

    def _release(self, rid: int | None, live: _Live | None, deposited: bool) -> None:
        try:
            with self._lock:
                # popped only now: a forget until here marks it (`_deposit` checks under the lock)
                if rid is not None:
                    self._live.pop(rid, None)
                if rid is not None and not deposited:  # rows it adopted are gone with its pages
                    self.service.end_turn(rid, "fault" if live is not None and live.dropped else "not_deposited")
                self._freed += 1
                every = self.options.stats_every
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
            return self.service.forget_session(conversation)

    def _deposit(self, rid: int, request: Any, live: _Live | None) -> bool:
        """Deposit a freed request's valid run. A request the carry tracks (`live`, seen in
        prepare: the same requests on every tensor-parallel rank) deposits in lockstep: every rank
        agrees on the key, the run and whether to deposit (`agree_deposit`: else every rank skips
        for the same reason), then the service plans (the same admission everywhere, the room
        agreed) and gathers (kept only if every rank carried its shard out)."""
        if live is None:  # never tracked (a dummy, or freed before it was scheduled): no vote
            tokens = [] if request.is_dummy_request else list(request.get_tokens(0))
            why = self._skip_reason(request, live, len(tokens))
            if why is not None:
                self._skip(why, live)
            return False
        turn: TurnPages | None = None
        lo = hi = 0
        try:  # whatever this rank's request looks like, it reaches the vote below
            tokens = list(request.get_tokens(0))
            why = self._skip_reason(request, live, len(tokens))
            if why is None:
                lo, hi = live.valid_run(len(tokens))  # keys < N - 1
                turn = self.pages.turn(rid)
                if hi > lo:  # of those, the run on pages the pool still holds (a sliding window's)
                    lo, hi = turn.kept(lo, hi)
        except Exception as exc:
            self._fault("deposit", exc, rid)
            tokens, why, lo, hi = [], "fault", 0, 0
        status = 1 + SKIP_REASONS.index(why) if why is not None else 0 if hi > lo else NOTHING
        agreed = self.lockstep.agree_deposit(live.key or 0, status, hi - lo)
        if agreed != 0:
            self._skip(SKIP_REASONS[agreed - 1] if 0 < agreed < NOTHING else
                       "no_rows" if agreed == NOTHING else "fault", live)
            return False
        assert live.key is not None and turn is not None
        with self._lock:  # against forget_conversation: either it marked us, or it sees the entry
            if live.forgotten:  # (attach's: one rank)
                self._skip("session_end", live)
                return False
            self._vetoed_now = False
            try:  # a fault in the plan too (a demotion making room) leaves what `repair` mends
                plan = self.service.plan_deposit(live.key, None, hi - lo, live.conversation, agree=self._agree)
                if plan is None:  # refused before any row moved (the store counts why)
                    return False
                with self._draft_stream():
                    kept = self.service.deposit(plan, turn, ((lo, hi - lo),), tokens, agree=self._agree)
                    self._sync()
            except Exception as exc:  # the carry may cost acceptance, never the executor
                self._fault("deposit", exc, rid)
                self._skip("fault", live)
                self.service.repair()
                return False
            if not kept and self._vetoed_now:  # a peer could not gather its shard: the turn's deposit faulted
                self._skip("fault", live)
            if kept:
                self.service.deposited(rid)
                live.record["rows_deposited"] = hi - lo
                # a cancelled turn keeps its session's carry, counted as the reference engine counts it
                self.service.counters.turns_cancelled_kept += bool(
                    getattr(request, "is_finished_due_to_cancellation", False))
            return kept

    def _agree(self, ok: bool) -> tuple[bool, bool]:
        """The service's agreement with the other tensor-parallel ranks (`Lockstep.agree_all`);
        a rank that could not (while another could) is a vetoed deposit on every rank."""
        every, some = self.lockstep.agree_all(ok)
        self._vetoed_now = some and not every
        if self._vetoed_now:
            with self._lock:
                self._vetoed["deposit"] += 1
        return every, some

    def _skip(self, why: str, live: _Live | None) -> None:
        with self._lock:
            self.service.counters.skipped[why] += 1
            if live is not None:
                live.record["skipped"] = why

    # ---- reporting ---------------------------------------------------------------------

    def turn(self, request_id: int) -> dict[str, object] | None:
        """One request's turn record, or None (unknown, dummy, or older than `TURN_LOG` requests).

        Keys: `reused` (R), `outcome` (`no_conversation`, or the core's outcome kind:
        `adopted`, `no_carry`, `prefix_mismatch`, ...),
        `no_carry_reason` (a `no_carry` outcome's reason, else ""), `rows_adopted` (the
        carried rows restored into its pages) and `first_key` (their keys are `[first_key,
        first_key + rows_adopted)`; None until rows were adopted),
        `rows_computed` (the prompt's pair keys `[R, L - 1)` TensorRT-LLM's context phase
        computes), `rows_deposited` (0 until it was freed), `skipped` (why nothing was
        deposited, `SKIP_REASONS`, or None).
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

    def stats(self) -> CarryStats:
        """The carry's statistics, as every executor reports them (`service.CarryStats`)."""
        with self._lock:
            return self.service.stats(live_turns=len(self._live), tp_size=self.lockstep.tp_size,
                                      agreements=self.lockstep.agreements,
                                      vetoed={k: self._vetoed.get(k, 0) for k in VETO_STEPS})

    def stats_line(self) -> str:
        """`stats()` as one line (zero counters left out): what `stats_every` prints."""
        s = self.stats()

        def nonzero(d: dict[str, int]) -> str:
            return ", ".join(f"{k} {v}" for k, v in d.items() if v) or "none"

        with self._lock:
            freed = self._freed
        return (f"mtp carry: after {freed} freed requests: turns cold {s.turns['cold']}, warm {s.turns['warm']}; "
                f"outcomes: {nonzero(s.outcomes)}; skipped: {nonzero(s.skipped)}; "
                f"fault steps: {nonzero(s.fault_steps)}; faults: {nonzero(s.faults)}; rows adopted "
                f"{s.rows_adopted}, deposited {s.rows_deposited}; held {s.entries_held} entries, "
                f"{s.bytes_held} bytes (host {s.host_entries} entries, {s.host_bytes_held} bytes); "
                f"evictions: {nonzero(s.evictions)}")

    # ---- steps -------------------------------------------------------------------------

    def _adopt_firsts(self, firsts: list[tuple[int, Any]]) -> None:
        """Judge this batch's first-seen context requests and restore what they adopt, in lockstep.

        Every rank agrees which requests it judges (the same carry key and reused depth R on every
        rank: `agree_first_sights`, which also fixes the clock the judges read), judges them (the
        same store, the same decisions), then agrees the rows each can restore (`agree_rows`, the
        MIN over ranks: a rank whose pages cannot be read says 0) before any rank restores: rows
        land on every rank, or on none (counted in `vetoed`; the entry stays for a later turn)."""
        wants = []
        for rid, _ in firsts:
            live = self._live.get(rid)
            judged = live is not None and live.key is not None and not live.dropped
            wants.append((live.key, live.reused) if judged and live is not None and live.key is not None
                         else (0, 0))
        eligible = self.lockstep.agree_first_sights(wants)
        plans: list[tuple[int, _Live, _Adoption]] = []
        for (rid, request), ok in zip(firsts, eligible, strict=True):
            live = self._live.get(rid)
            if ok == 1 and live is not None:
                plans.append((rid, live, self._judge(rid, request, live)))
            elif ok == -1:  # the ranks would not judge it alike: none does
                self._disagreement(rid)
        agreed, best = self.lockstep.agree_rows([p.vote for _, _, p in plans]) if plans else ([], [])
        for (rid, live, plan), m, top in zip(plans, agreed, best, strict=True):
            adopted = isinstance(plan.outcome, Adopted) and self._restore(rid, live, plan, m, top)
            with self._lock:
                c = self.service.counters
                computed = int(live.record["rows_computed"])  # type: ignore[call-overload]
                if adopted:
                    c.rows_appended += computed
                else:
                    c.rows_prefilled += computed
                    c.turns_blind += live.reused > 0

    def _judge(self, rid: int, request: Any, live: _Live) -> _Adoption:
        """The core's decision for request `rid` (counted), and the rows of the entry's keys below
        R this rank can restore (0: a miss, a fault, or pages this rank cannot read)."""
        try:
            assert live.key is not None
            # int64 buffer: decide_adopt compares it with the entry's buffer in typed memory
            prompt = array("q", request.get_tokens(0))
            ticket = self._tickets.draw()
            # TensorRT-LLM's context phase computes the MTP rows of keys [R, L) itself: that is
            # the span the core's plan may append, so it is this ticket's projected store range.
            projected = StoreRange(ticket, live.reused, max(live.reused, len(prompt)))
            with self._lock:
                outcome = self.service.judge(live.key, prompt, ticket, projected, live.conversation)
                self._decided(live, outcome)
                if not isinstance(outcome, Adopted):
                    return _Adoption(outcome, 0, 0)  # blind over [0, R), as TensorRT-LLM without the carry
                entry = self.service.store.get(live.key)
                assert entry is not None and entry.last_pair_key is not None
            first = entry.last_pair_key - entry.rows + 1  # the entry's keys: one run from here
            n = max(0, min(outcome.rows, live.reused - first))  # keys below R only
        except Exception as exc:  # the turn runs blind over [0, R); it deposits nothing
            self._fault("prepare", exc, rid)
            return _Adoption(None, 0, 0)
        try:
            self.pages.views(), self.pages.page_ids(rid)  # this rank's pages for the request
        except Exception as exc:  # this rank cannot restore: it votes no (no rank then adopts)
            self._fault("prepare", exc, rid)
            return _Adoption(outcome, 0, first)
        return _Adoption(outcome, n, first, able=True)

    def _restore(self, rid: int, live: _Live, plan: _Adoption, agreed: int, best: int) -> bool:
        """Adopt the entry: its rows of keys `[first, first + m)` (`agreed` is the MIN of the ranks'
        votes, m + 1) into request `rid`'s pages on the draft stream. True when the turn adopted
        (rows restored or not); False when a rank could not (`agreed` 0): no rank takes the entry,
        which stays for a later turn (a veto when another rank could), or a fault dropped the turn."""
        if agreed == 0:
            if best > 0:  # some rank could adopt and another could not: no rank does
                with self._lock:
                    self._vetoed["adopt"] += 1
            return False
        m = agreed - 1
        assert live.key is not None
        try:
            # keys below the turn's read window (a sliding-window pool's) are never written
            skip = min(m, max(0, self.pages.read_window(live.reused) - plan.first))
            with self._lock:
                with self._draft_stream():
                    self.service.adopt(rid, live.key, m, self.pages.turn(rid, skip))
                self._forward_waits_for_draft_stream()
        except Exception as exc:  # the turn runs blind over [0, R); it deposits nothing
            self._fault("prepare", exc, rid)
            self.service.drop_turn(rid)
            self.service.repair()
            return False
        first, n = plan.first + skip, m - skip  # the keys restored
        with self._lock:
            live.run = (first, first + n) if n else (0, 0)
            self.service.counters.rows_adopted += n
            self.service.counters.keys_skipped += max(0, live.reused - (first + n)) if n else 0
            live.record["rows_adopted"] = n
            live.record["first_key"] = first
        return True

    def _decided(self, live: _Live, outcome: CarryOutcome) -> None:
        self.service.count_outcome(outcome)
        live.record["outcome"] = outcome.kind
        reason = getattr(outcome, "reason", None)
        if reason is not None:
            live.record["no_carry_reason"] = reason

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
        """An exception inside the carry: recorded by the service's ledger (by class and step,
        logged once per pair), and request `rid`'s carry state dropped (it adopts and deposits
        nothing more); never raised."""
        self.ledger.record(step, exc, rid)
        with self._lock:
            live = None if rid is None else self._live.get(rid)
            if live is None and rid is not None and step == "prepare":
                # seen now and dropped: a later chunk of it must not be judged as a first sight
                live = self._live[rid] = _Live(None, None, 0, _turn_record(0, "fault", 0), 0)
                remember(self._turn_log, rid, live.record, TURN_LOG)
            if live is not None:
                live.dropped = True
                live.record["error"] = f"{step}: {type(exc).__name__}: {exc}"

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
        # get_tokens at the prompt). Rows [lo, N - 1) were then written by the adoption, the
        # context phase and the completed generation steps; the overlap scheduler's extra
        # step writes only keys >= N - 1.
        if live is None or not live.last_chunk or num_tokens <= live.prompt_len:
            return "context_unfinished"  # never scheduled, or freed before its context finished
        if live.forgotten:
            return "session_end"
        if not request.is_finished and not self._draft_holds(int(request.py_request_id)):
            # KVCacheManagerV2.preempt_request's caller frees the draft pool itself before the
            # executor frees the request (`_preempt_or_defer`, scheduler_v2.py @
            # 38198e34582cf777ecc72062f477987284ba9999): its rows went with its pages
            return "preempted"
        return None

    def _draft_holds(self, rid: int) -> bool:
        """The draft pool still holds request `rid` (`kv_cache_map[rid]`: KeyError once freed)."""
        try:
            self.pages.page_ids(rid)
        except KeyError:
            return False
        return True

    def _cuda_draft_stream(self) -> Any | None:
        """KVCacheManagerV2._stream (a torch stream) where CUDA runs, else None."""
        stream = getattr(self.draft, "_stream", None)
        return stream if stream is not None and streams.cuda_available() else None

    def _draft_stream(self) -> AbstractContextManager[Any]:
        stream = self._cuda_draft_stream()
        if stream is None:
            return nullcontext()
        # What runs there reads what the executor's stream wrote (the forward's pages for a
        # gather, a host-tier copy back for a scatter): the GPU orders it after.
        stream.wait_stream(streams.current_stream(stream.device))
        return streams.on_stream(stream)

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
            streams.current_stream(stream.device).wait_stream(stream)


def _turn_record(reused: int, outcome: str, rows_computed: int) -> dict[str, object]:
    """A request's turn record (`turn()`'s keys) at first sight: nothing adopted or deposited yet."""
    return {"reused": reused, "outcome": outcome, "no_carry_reason": "", "rows_adopted": 0,
            "first_key": None, "rows_computed": rows_computed, "rows_deposited": 0, "skipped": None}


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


__all__ = ["PAUSED_LOG", "TURN_LOG", "CarryManagerCore", "TurnPages", "carry_manager_class"]
