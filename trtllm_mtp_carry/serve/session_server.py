"""Serve turns of many sessions through one engine, from one stepping thread.

What it is for: the Triton model hands every request here (`enqueue`) and
returns at once (decoupled); one thread owns the engine, submits what can
run, steps it, and streams each request's new tokens to its `ResponseSink`.
Requests of several sessions run concurrently through the same engine.

Ownership and invariants:
- Only the stepping thread touches the engine and the session table; `call`
  runs a function there between steps (once stopped, in the caller's thread).
- A session (the correlation id) has at most one turn in the engine; a
  session's later requests wait in arrival order (the next turn's prompt is
  built from the previous turn's output).
- A session's chat history is the last turn's prompt and output; a
  `text_input` turn extends it with the tokenizer's `next_prompt`, an
  `input_ids` turn replaces it.
- `END`, a new `START` on a known session, and the idle timeout free the
  session's carried rows (`runtime.forget_session`); a request that fails
  with `END` (or `START`) still ends its (previous) session.
- A bad request gets exactly one error response and changes nothing else;
  an engine failure fails the requests in flight and cancels them.
- Every request ends with exactly one final response: its last tokens, or an
  error (a cancelled request, or one whose client went away mid-stream, gets
  an error too, so the server never waits on it). Each error counts once in
  `on_error(reason)`, `reason` one of `ERROR_REASONS`.
- A request whose client cancelled it before the engine admitted it (still
  queued here or in the engine) is never started: it gets its error and counts
  once in `on_unadmitted("cancelled")`; one admitted, once in `on_turn`. So
  each cancelled request is counted exactly once, by one of the two.
- Idle means no request in flight: a session ends `idle_timeout_s` after its
  last turn finished, never while a turn runs. A turn still unfinished
  `options.max_turn_s` after it arrived is cancelled with an error, so a
  front end whose own sequence timer starts at arrival (Triton's) and runs
  `idle_timeout_s + max_turn_s` never ends a session before this server does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from ..core.session import session_hash
from .engines import ServingEngine
from .options import POLICIES, ServeOptions

logger = logging.getLogger("trtllm_mtp_carry.serve")

T = TypeVar("T")

ERROR_REASONS = (
    "invalid_request",  # a malformed input, or a value the engine refuses (out-of-vocabulary ids)
    "string_corrid",  # a string correlation id where sessions are numbered (Triton front end)
    "unknown_session",  # a continuation of a session this server does not hold (never started, ended)
    "cancelled",  # the client cancelled the request or went away while it streamed
    "turn_timeout",  # the turn ran past options.max_turn_s
    "engine_failure",  # an engine step raised: every request in flight failed
    "shutdown",  # the server stopped with the request queued or running
)
"""Why an error response was sent (the label of the error counter)."""


class RequestError(ValueError):
    """A refused request: the message names the problem, `reason` is one of ERROR_REASONS."""

    def __init__(self, message: str, reason: str = "invalid_request") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class TurnRequest:
    """One request as the model parsed it: the session, its control flags and inputs."""

    corrid: int
    start: bool = False
    end: bool = False
    text_input: str | None = None
    input_ids: list[int] | None = None
    max_tokens: int | None = None
    drafter_policy: str | None = None
    cache_salt: bytes | str | None = None  # the turn's prefix-cache namespace (None: shared)
    start_if_new: bool = False  # open the session if it is unknown, else continue it (Dynamo)

    def check(self) -> None:
        """ValueError naming what is wrong with the inputs (session state aside)."""
        if self.text_input is None and self.input_ids is None:
            raise ValueError("request needs text_input (the new user message) or input_ids (the full prompt)")
        if self.text_input is not None and self.input_ids is not None:
            raise ValueError("request has both text_input and input_ids; send one")
        if self.text_input is not None and not self.text_input.strip():
            raise ValueError(f"text_input is empty ({self.text_input!r}); send the user's message")
        if self.input_ids is not None and len(self.input_ids) == 0:
            raise ValueError("input_ids is empty")
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.drafter_policy is not None and self.drafter_policy not in POLICIES:
            raise ValueError(f"drafter_policy must be one of {', '.join(POLICIES)}, got {self.drafter_policy!r}")
        if self.cache_salt is not None and len(self.cache_salt) == 0:
            raise ValueError("cache_salt is empty; send a non-empty salt or none")
        if self.corrid == 0:
            raise ValueError("CORRID 0 is not a session; send a non-zero correlation id")


class ResponseSink(Protocol):
    """Where one request's responses go (Triton's response sender, or a test's list)."""

    def partial(self, ids: list[int], text: str) -> None: ...

    def final(self, ids: list[int], text: str, result: Any) -> None: ...

    def error(self, message: str) -> None: ...

    def cancelled(self) -> bool: ...


@dataclass
class _Session:
    prompt: list[int] | None = None  # the last finished turn's prompt and output
    output: list[int] | None = None
    last_seen: float = field(default_factory=time.monotonic)


@dataclass
class _Pending:
    request: TurnRequest
    sink: ResponseSink
    arrived: float = field(default_factory=time.monotonic)


@dataclass
class _InFlight:
    request: TurnRequest
    sink: ResponseSink
    arrived: float
    sent: int = 0  # output tokens already streamed
    text_from: int = 0  # first output token not yet rendered as text


class SessionServer:
    """The engine's one driver: queues requests, steps the engine, streams the results.

    `on_turn(result)` sees every turn the engine admitted, once, when it leaves the
    engine: finished, or stopped (cancelled, timed out, failed; `finish_reason`
    `cancelled`, its stats so far), so a turn's outcome, decided at admission, is
    counted whether or not its client stayed. `on_forget(cause, rows)` sees
    every session end (both from the stepping thread), `on_error(reason)`
    every error response (from the stepping thread, or from `enqueue`'s and
    `refuse`'s caller), `on_unadmitted("cancelled")` every request cancelled before
    its admission (from the stepping thread): metrics hook here.
    """

    def __init__(self, engine: ServingEngine, options: ServeOptions, idle_timeout_s: float | None = None,
                 on_turn: Callable[[Any], None] | None = None,
                 on_forget: Callable[[str, int], None] | None = None,
                 on_error: Callable[[str], None] | None = None,
                 on_unadmitted: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self.options = options
        self.idle_timeout_s = idle_timeout_s
        self._on_turn = on_turn or (lambda result: None)
        self._on_forget = on_forget or (lambda cause, rows: None)
        self._on_error = on_error or (lambda reason: None)
        self._on_unadmitted = on_unadmitted or (lambda reason: None)
        self._pending: deque[_Pending] = deque()
        self._inflight: dict[int, _InFlight] = {}  # engine request id -> its request
        self._busy: set[int] = set()  # sessions with a turn in the engine
        self._sessions: dict[int, _Session] = {}
        self._calls: deque[tuple[Callable[[], Any], Future[Any]]] = deque()  # `call`s waiting to run
        self._cv = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="mtp-carry-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the stepping thread; requests still queued or running get an error."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)

    def enqueue(self, request: TurnRequest, sink: ResponseSink) -> None:
        """Queue one request; malformed inputs get their error response right away."""
        try:
            request.check()
        except ValueError as exc:
            self._send_error(sink, str(exc), "invalid_request")
            if request.start or request.end:  # Triton started or ended the sequence all the same
                with self._cv:
                    self._pending.append(_Pending(request, _ENDED))  # in order with the session's turns
                    self._cv.notify()
            return
        with self._cv:
            self._pending.append(_Pending(request, sink))
            self._cv.notify()

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run `fn()` on the stepping thread between engine steps (it owns the engine and its
        carry: moving a carried entry in or out goes through here); the future holds its result
        or exception. Once the server stopped, `fn` runs at once in the caller's thread."""
        future: Future[T] = Future()
        with self._cv:
            if self._thread.is_alive() and not self._stopping:
                self._calls.append((fn, future))
                self._cv.notify()
                return future
        if self._thread.is_alive():  # stopping: the engine is the caller's once the thread ended
            self._thread.join()
        _run_call(fn, future)
        return future

    def refuse(self, sink: ResponseSink, error: ValueError) -> None:
        """Answer a request the front end could not parse: one error response, counted by
        reason (`error.reason` for a RequestError, else `invalid_request`)."""
        self._send_error(sink, str(error), getattr(error, "reason", "invalid_request"))

    # ---- the stepping thread ------------------------------------------------------

    def _run(self) -> None:
        tick = 0.5 if self.idle_timeout_s is None else min(0.5, self.idle_timeout_s / 4)
        while True:
            with self._cv:
                while not self._stopping and not self._inflight and not self._ready() and not self._calls:
                    self._cv.wait(tick)
                    self._expire_idle()
                if self._stopping:
                    break
                ready = self._take_ready()
                calls, self._calls = list(self._calls), deque()
            for fn, future in calls:
                _run_call(fn, future)
            for pending in ready:
                self._dispatch(pending)
            self._expire_idle()
            if self._inflight:
                self._step()
        self._fail_all("the model is shutting down", "shutdown")
        with self._cv:
            calls, self._calls = list(self._calls), deque()
        for fn, future in calls:  # queued before the stop: they still run, here
            _run_call(fn, future)

    def _ready(self) -> bool:
        return any(p.request.corrid not in self._busy for p in self._pending)

    def _take_ready(self) -> list[_Pending]:
        """Requests whose session has no turn in the engine, oldest first, one per session."""
        ready: list[_Pending] = []
        kept: deque[_Pending] = deque()
        taken: set[int] = set()
        for pending in self._pending:
            if pending.request.corrid in self._busy or pending.request.corrid in taken:
                kept.append(pending)
            else:
                taken.add(pending.request.corrid)
                ready.append(pending)
        self._pending = kept
        return ready

    def _dispatch(self, pending: _Pending) -> None:
        request, sink = pending.request, pending.sink
        corrid = request.corrid
        if sink is _ENDED:  # a malformed START/END request: the old session ends all the same
            if corrid in self._sessions or request.end:
                self._forget(corrid, "end" if request.end else "restart")
            return
        if sink.cancelled():  # its client went away while it waited here: never start it
            self._send_error(sink, "the request was cancelled before it started", "cancelled")
            self._on_unadmitted("cancelled")
            if request.end:
                self._forget(corrid, "end")
            return
        if request.start and corrid in self._sessions:
            self._forget(corrid, "restart")
        # a START turn opens the session only once the engine accepted it
        session = _Session() if request.start else self._sessions.get(corrid)
        if session is None and request.start_if_new:
            session = _Session()
        try:
            if session is None:
                idle = "" if self.idle_timeout_s is None else f" (a session idle {self.idle_timeout_s:g} s ends)"
                raise RequestError(f"unknown session CORRID={corrid}: its first request must set START{idle}",
                                   "unknown_session")
            if self._overdue(pending.arrived):
                raise RequestError(self._overdue_message(), "turn_timeout")
            session.last_seen = time.monotonic()
            if request.text_input is not None:
                if session.prompt is None or session.output is None:
                    prompt = self.engine.tokenizer.render_chat(
                        [{"role": "user", "content": request.text_input}])
                else:
                    prompt = self.engine.tokenizer.next_prompt(session.prompt, session.output,
                                                               request.text_input)
            else:
                assert request.input_ids is not None
                prompt = request.input_ids
            rid = self.engine.submit(
                corrid, prompt,
                max_new_tokens=request.max_tokens or self.options.max_tokens,
                policy=request.drafter_policy,
                cache_salt=request.cache_salt,
            )
        except (ValueError, TypeError) as exc:
            self._send_error(sink, str(exc), getattr(exc, "reason", "invalid_request"))
            if request.end:
                self._forget(corrid, "end")
            return
        self._sessions[corrid] = session
        self._inflight[rid] = _InFlight(request, sink, pending.arrived)
        self._busy.add(corrid)

    def _overdue(self, arrived: float) -> bool:
        limit = self.options.max_turn_s
        return limit is not None and time.monotonic() - arrived > limit

    def _overdue_message(self) -> str:
        return (f"the turn ran past max_turn_s={self.options.max_turn_s} s (counted from its arrival) "
                "and was cancelled")

    def _step(self) -> None:
        try:
            finished = {r.request_id: r for r in self.engine.step()}
        except Exception as exc:  # an engine bug: fail what is in flight, keep serving
            logger.exception("engine step failed")
            self._fail_all(f"engine step failed: {type(exc).__name__}: {exc}", "engine_failure")
            return
        for rid, flight in list(self._inflight.items()):
            result = finished.get(rid)
            if result is not None:
                self._finish(rid, flight, result)
                continue
            if flight.sink.cancelled():
                logger.warning("request %d of CORRID=%s cancelled by its client", rid, flight.request.corrid)
                self._drop(rid, flight, "the request was cancelled", "cancelled")
                continue
            if self._overdue(flight.arrived):
                self._drop(rid, flight, self._overdue_message(), "turn_timeout")
                continue
            out = self.engine.output_so_far(rid)
            if out and len(out) > flight.sent:
                ids, text = self._delta(flight, out, final=False)
                try:
                    flight.sink.partial(ids, text)
                except Exception as exc:  # the client went away: stop its turn
                    logger.warning("dropping request %d: %s", rid, exc)
                    self._drop(rid, flight, f"the response could not be sent: {exc}", "cancelled")

    def _drop(self, rid: int, flight: _InFlight, message: str, reason: str) -> None:
        """Stop a running turn; its request still gets its final response (an error), so
        the front end never waits on it (Triton's shutdown would)."""
        result = self.engine.cancel(rid)
        self._release(rid, flight)  # first, as `_finish` does: the turn leaves flight whatever the hook does
        self._stopped(result, reason)
        self._send_error(flight.sink, message, reason)

    def _stopped(self, result: Any, reason: str = "") -> None:
        """Report a stopped turn that was admitted (its outcome was decided); a request
        stopped while still queued in the engine had no outcome and is not a turn of the
        engine's: a cancelled one counts in `on_unadmitted`."""
        if result is not None and result.stats.outcome_kind:
            self._on_turn(result)
        elif result is not None and reason == "cancelled":
            self._on_unadmitted("cancelled")

    def _finish(self, rid: int, flight: _InFlight, result: Any) -> None:
        request = flight.request
        ids, text = self._delta(flight, result.output, final=True)
        session = self._sessions.get(request.corrid)
        if session is not None and result.finish_reason != "cancelled":
            session.prompt, session.output = list(result.prompt), list(result.output)
        self._release(rid, flight)
        self._on_turn(result)
        try:
            flight.sink.final(ids, text, result)
        except Exception as exc:
            logger.warning("final response of request %d not delivered: %s", rid, exc)

    def _release(self, rid: int, flight: _InFlight) -> None:
        del self._inflight[rid]
        self._busy.discard(flight.request.corrid)
        session = self._sessions.get(flight.request.corrid)
        if session is not None:  # idle from here: the session had a request in flight until now
            session.last_seen = time.monotonic()
        if flight.request.end:
            self._forget(flight.request.corrid, "end")

    def _delta(self, flight: _InFlight, out: list[int], final: bool) -> tuple[list[int], str]:
        """The tokens not yet sent, and their text; an incomplete UTF-8 tail waits."""
        ids = list(out[flight.sent:])
        flight.sent = len(out)
        tok = self.engine.tokenizer
        body = out[flight.text_from:]
        if final and body and body[-1] == tok.eos_id:
            body = body[:-1]  # the end-of-turn token is not text
        text = tok.decode(body)
        if text.endswith("\ufffd") and not final:
            return ids, ""
        flight.text_from = len(out)
        return ids, text

    def _forget(self, corrid: int, cause: str) -> None:
        self._sessions.pop(corrid, None)
        rows = self.engine.runtime.forget_session(session_hash(corrid))
        self._on_forget(cause, rows)

    def _expire_idle(self) -> None:
        if self.idle_timeout_s is None:
            return
        now = time.monotonic()
        for corrid, session in list(self._sessions.items()):
            if corrid not in self._busy and now - session.last_seen > self.idle_timeout_s:
                self._forget(corrid, "idle")

    def _fail_all(self, message: str, reason: str) -> None:
        for rid, flight in list(self._inflight.items()):
            try:
                self._stopped(self.engine.cancel(rid))
            except Exception:  # the engine already failed; the error response still goes out
                logger.exception("cancel of request %d failed", rid)
            self._release(rid, flight)
            self._send_error(flight.sink, message, reason)
        with self._cv:
            pending, self._pending = list(self._pending), deque()
        for p in pending:
            if p.sink is not _ENDED:
                self._send_error(p.sink, message, reason)

    def _send_error(self, sink: ResponseSink, message: str, reason: str) -> None:
        try:
            self._on_error(reason)
        except Exception:  # a metrics failure must not keep the error response from the client
            logger.exception("error counter for %s failed", reason)
        try:
            sink.error(message)
        except Exception as exc:
            logger.warning("error response not delivered (%s): %s", message, exc)


def _run_call(fn: Callable[[], T], future: Future[T]) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn())
    except BaseException as exc:  # the caller hears it from the future
        future.set_exception(exc)


class _Ended:
    """Stands for the sink of a malformed END request (already answered)."""

    def partial(self, ids: list[int], text: str) -> None: ...

    def final(self, ids: list[int], text: str, result: Any) -> None: ...

    def error(self, message: str) -> None: ...

    def cancelled(self) -> bool:
        return True


_ENDED = _Ended()
