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
  iterated in reverse), so the pages are still live: a finished request's
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
- Rows move as TensorRT-LLM wrote them (roped at k): gather and scatter, no re-rope.
- A data-plane failure (a page missing at scatter or gather) is logged and
  counted (`errors`), never raised into the executor: the turn runs blind
  and deposits nothing; outputs never depend on the drafter's rows.
- Nothing is written outside the request's own fresh pages for keys `[0, R)`;
  the manager is installed only on the unpaired topology (never on paired or
  folded pools, whose pages below R are shared tree blocks).
"""

from __future__ import annotations

import logging
import threading
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from ..core import OUTCOME_KINDS, carry_eviction, carry_idle_s, carry_slots
from ..core.outcome import Adopted, NoCarry
from ..core.session import TicketCounter
from ..core.store_range import StoreRange
from .carried import CarriedRows
from .identity import conversation_session, request_session, request_session_key
from .layout import gather_packed_rows, gather_rows, scatter_packed_rows, scatter_rows
from .options import CarryOptions

logger = logging.getLogger("trtllm_mtp_carry")

SKIP_REASONS: tuple[str, ...] = (
    "dummy",  # warm-up or padding requests
    "no_conversation",  # no py_conversation_params.conversation_id
    "context_unfinished",  # freed before its context finished (cancelled, failed, never scheduled)
    "gap",  # a blind warm turn: keys [0, R) hold no valid rows
    "session_end",  # its conversation was forgotten (the session ended) while it ran
)
"""Why a freed request deposited nothing, in the order `stats()` lists them."""


TURN_LOG = 4096
"""How many recent requests' turn records `turn()` and `pop_turn()` each keep (oldest dropped first)."""


@dataclass
class _Live:
    key: int | None  # the carry key (None: no conversation, never carried)
    conversation: int | None  # the conversation's session, before the salt
    reused: int  # R at first sight
    complete: bool  # keys [0, R) hold valid rows (cold turn, or fully restored)
    record: dict[str, object]  # the turn record `turn()` returns
    prompt_len: int  # LlmRequest.prompt_len
    last_chunk: bool = False  # its last context chunk was scheduled (seen at prepare)
    forgotten: bool = False  # its conversation ended while it ran: it deposits nothing


class CarryManagerCore:
    """The carry's resource-manager logic over one draft KV manager's MTP layer (see module doc)."""

    def __init__(self, draft: Any, mtp_layer: int, options: CarryOptions,
                 report: Callable[[str], None] | None = None) -> None:
        self.draft = draft
        self.mtp_layer = mtp_layer
        self.options = options
        slots = (carry_slots() or None) if options.carry_slots is None else options.carry_slots
        idle_s = carry_idle_s() or None  # 0: entries never expire
        self.carried = CarriedRows(slots, options.carry_memory, carry_eviction(), idle_s,
                                   host_budget_bytes=options.carry_host_memory,
                                   row_dtype=options.carry_row_dtype)
        self._tickets = TicketCounter()
        self._live: dict[int, _Live] = {}
        self._outcomes: Counter[str] = Counter()
        self._skips: Counter[str] = Counter()
        self._turns: Counter[str] = Counter()
        self._errors: Counter[str] = Counter()  # data-plane failures by step (scatter, deposit)
        self._turn_log: OrderedDict[int, dict[str, object]] = OrderedDict()  # by py_request_id
        self._client_log: OrderedDict[int, dict[str, object]] = OrderedDict()  # by py_client_id
        self.rows_scattered = 0
        self.rows_deposited = 0
        self._freed = 0  # requests freed, for `options.stats_every`
        self._report = report or (lambda line: logger.info("%s", line))
        self._lock = threading.RLock()

    # ---- BaseResourceManager protocol (resource_manager.py) --------------------------

    def get_max_resource_count(self) -> int:
        return 1  # holds no schedulable resource (as KVCacheManagerV2 answers)

    def get_needed_resource_to_completion(self, request: Any) -> int:
        return 0

    def add_dummy_requests(self, request_ids: Any, *args: Any, **kwargs: Any) -> None:
        return None  # dummies are never carried

    def update_resources(self, scheduled_batch: Any, *args: Any, **kwargs: Any) -> None:
        return None

    def shutdown(self) -> None:
        if self.options.stats_every:
            self._report(self.stats_line())
        self.carried.clear()

    def prepare_resources(self, scheduled_batch: Any) -> None:
        """Adopt for every context request seen for the first time (see the module doc)."""
        for request in scheduled_batch.context_requests:
            rid = int(request.py_request_id)
            # this chunk reaches the prompt's end (C++ isLastContextChunk, read in our own
            # prepare: outside the draft's request_context, after the scheduler set the chunk)
            position = int(request.context_current_position)
            prompt_len = int(request.prompt_len)  # LlmRequest.prompt_len: no token copy
            last = position + int(request.context_chunk_size) >= prompt_len
            known = self._live.get(rid)
            if known is not None:  # a later chunk of a request already judged
                known.last_chunk = known.last_chunk or last
                continue
            if request.is_dummy_request:
                continue  # never tracked: free skips it as dummy
            found = request_session(request)
            key, conversation = (None, None) if found is None else found
            reused = position  # R: the prepopulated length at first sight
            first = "no_conversation" if key is None else "pending" if reused else "cold"
            # the prompt's pair keys [R, L - 1) TensorRT-LLM's context phase computes, counted
            # as the reference engine counts `drafter_rows_computed`
            record: dict[str, object] = {
                "reused": reused, "outcome": first, "no_carry_reason": "", "rows_scattered": 0,
                "rows_computed": max(0, prompt_len - 1 - reused), "rows_deposited": 0, "skipped": None}
            live = _Live(key, conversation, reused, reused == 0, record, prompt_len, last)
            client = getattr(request, "py_client_id", None)  # the LLM API's id of the request
            with self._lock:
                self._live[rid] = live
                self._turns["warm" if reused else "cold"] += 1
                _remember(self._turn_log, rid, record)
                if client is not None:
                    _remember(self._client_log, int(client), record)
            if key is None or reused == 0:
                continue
            self._adopt(rid, request, live)

    def free_resources(self, request: Any) -> None:
        """Deposit a finished request's valid rows, before the draft pool frees its pages."""
        rid = int(request.py_request_id)
        with self._lock:
            live = self._live.get(rid)
        deposited = self._deposit(rid, request, live)
        with self._lock:
            # popped only now: a forget until here marks it (`_deposit` checks under the lock)
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

    def forget_conversation(self, conversation_id: str, lora_id: int | None = None) -> int:
        """Drop the carried rows of conversation `conversation_id` (under every salt): its
        session ended. Its requests still live deposit nothing (skipped `session_end`).
        Returns the rows dropped from the store; ValueError/TypeError name a bad id."""
        conversation = conversation_session(conversation_id, lora_id)
        with self._lock:
            for live in self._live.values():
                if live.conversation == conversation:
                    live.forgotten = True
            return self.carried.forget(conversation)

    def _deposit(self, rid: int, request: Any, live: _Live | None) -> bool:
        tokens = [] if request.is_dummy_request else list(request.get_tokens(0))
        why = self._skip_reason(request, live, len(tokens))
        if why is not None:
            self._skip(why, live)
            return False
        assert live is not None and live.key is not None
        valid = len(tokens) - 1  # key k consumed tokens[0 ..= k + 1]: keys [0, N - 1)
        if valid <= 0:
            return False
        try:
            pages = self.draft.get_batch_cache_indices([rid], layer_idx=self.mtp_layer)[0]
            buf = self.draft.get_buffers(self.mtp_layer, kv_layout="HND")
            with self._draft_stream():
                gather = gather_packed_rows if self.carried.packed else gather_rows  # fp8: packed as gathered
                rows = gather(buf, pages, 0, valid)  # [valid, 2, Hkv, D]
                self._sync()
        except RuntimeError as exc:  # the carry may cost acceptance, never the executor
            self._failed("deposit", rid, exc, live)
            return False
        with self._lock:  # against forget_conversation: either it marked us, or it sees the entry
            if live.forgotten:
                self._skip("session_end", live)
                return False
            if not self.carried.deposit(live.key, tokens, rows, live.conversation):
                return False
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
                "turns": {"cold": self._turns.get("cold", 0), "warm": self._turns.get("warm", 0)},
                "rows_scattered": self.rows_scattered,
                "rows_deposited": self.rows_deposited,
                "errors": {step: self._errors.get(step, 0) for step in ("scatter", "deposit")},
                "live_requests": len(self._live),
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
                f"errors: {nonzero(s['errors'])}; rows scattered {s['rows_scattered']}, deposited "
                f"{s['rows_deposited']}; held {s['entries']} entries, {s['bytes_held']} bytes "
                f"(host {s['host_entries']} entries, {s['host_bytes_held']} bytes); "
                f"evictions: {nonzero(s['evictions'])}")

    # ---- steps -------------------------------------------------------------------------

    def _adopt(self, rid: int, request: Any, live: _Live) -> None:
        assert live.key is not None
        # int64 buffer: decide_adopt compares it with the entry's buffer in typed memory
        prompt = array("q", request.get_tokens(0))
        ticket = self._tickets.draw()
        # TensorRT-LLM's context phase computes the MTP rows of keys [R, L) itself: that is
        # the span the core's plan may append, so it is this ticket's projected store range.
        projected = StoreRange(ticket, live.reused, max(live.reused, len(prompt)))
        outcome, taken = self.carried.judge_and_take(live.key, prompt, ticket, projected,
                                                     live.conversation)
        with self._lock:
            self._outcomes[outcome.kind] += 1
            live.record["outcome"] = outcome.kind
            if isinstance(outcome, NoCarry):
                live.record["no_carry_reason"] = outcome.reason
        if not isinstance(outcome, Adopted) or taken is None:
            return  # the turn runs blind over [0, R), as TensorRT-LLM does without the carry
        n = min(outcome.rows, live.reused)
        try:
            pages = self.draft.get_batch_cache_indices([rid], layer_idx=self.mtp_layer)[0]
            buf = self.draft.get_buffers(self.mtp_layer, kv_layout="HND")
            with self._draft_stream():
                scatter = scatter_packed_rows if self.carried.packed else scatter_rows  # fp8: unpacked as scattered
                scatter(buf, pages, 0, taken.head(n))  # type: ignore[arg-type]  # head's form is scatter's
                self._sync()
        except RuntimeError as exc:  # the turn runs blind over [0, R); it deposits nothing
            self._failed("scatter", rid, exc, live)
            return
        live.complete = n == live.reused
        with self._lock:
            self.rows_scattered += n
            live.record["rows_scattered"] = n

    def _failed(self, step: str, rid: int, exc: Exception, live: _Live) -> None:
        logger.warning("mtp carry: %s for request %d failed, the turn goes on without it: %s",
                       step, rid, exc)
        with self._lock:
            self._errors[step] += 1
            live.record["error"] = f"{step}: {exc}"

    def _skip_reason(self, request: Any, live: _Live | None, num_tokens: int) -> str | None:
        if request.is_dummy_request:
            return "dummy"
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

    def _draft_stream(self) -> AbstractContextManager[Any]:
        stream = getattr(self.draft, "_stream", None)  # KVCacheManagerV2._stream (torch stream)
        if stream is None or not torch.cuda.is_available():
            return nullcontext()
        return torch.cuda.stream(stream)

    def _sync(self) -> None:
        # The copy must land before the next forward reads the pages (scatter) or the pool
        # hands them to another request (gather).
        stream = getattr(self.draft, "_stream", None)
        if stream is not None and torch.cuda.is_available():
            stream.synchronize()


def _remember(log: OrderedDict[int, dict[str, object]], key: int, record: dict[str, object]) -> None:
    log[key] = record
    log.move_to_end(key)
    while len(log) > TURN_LOG:
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
