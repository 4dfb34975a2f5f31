"""A Dynamo worker serving the carry: the engine seam behind Dynamo's unified backend API.

What it is for: `python -m trtllm_mtp_carry.serve.dynamo.worker --model-dir D ...`
registers one engine (`serve.engines.build_engine`: the reference engine, or
any engine the seam names) with Dynamo in token mode. The worker writes the
model directory (`model_dir`: the engine's tokenizer, chat template and
context length) before it registers; Dynamo's frontend tokenizes the OpenAI
request with it and sends the prompt tokens here; the worker streams the answer back.

One request, one turn:

    frontend --token_ids, stop_conditions.max_tokens, agent_context.session_id-->  generate()
       -> SessionServer.enqueue(TurnRequest(session_hash(session_id), input_ids=token_ids))
       <- partial chunks {"token_ids": [...]} ... final chunk {finish_reason, completion_usage,
          engine_data: {"mtp_carry": the turn's TurnStats and this worker's id}}

Invariants:
- A request's session is `session_hash(agent_context.session_id)` (the
  `x-dynamo-session-id` header); the first turn of a session opens it on this
  worker and later turns continue it, so the carry decides adoption on the
  prompt alone. A request without a session id runs as a one-turn session of
  its own that ends with the turn: its rows are never adopted by anything.
- One thread (the SessionServer's) owns the engine; `generate` only queues
  and reads what that thread streams. A request already cancelled when it
  arrives (the frontend gave up on it first) is never queued; one cancelled
  while queued is never started; one cancelled while running (client gone,
  `context.is_stopped()`, Dynamo's `abort`) is cancelled in the engine and frees
  what it holds. Each counts once in `mtp_carry_outcomes_total`: by its outcome
  kind if admitted, else as `cancelled` (`WorkerMetrics`).
- Bad input (empty prompt, max_tokens <= 0, a prompt past the context, an
  unknown drafter policy) raises `InvalidArgument` naming it: the frontend
  answers an OpenAI-style 400 and the worker keeps serving.
- The engine's prefix-cache full blocks are published as KV events
  (`KvEventRelay`): a stored event for each run of newly registered blocks,
  with its chained parent, and a removed event on eviction, so the frontend's
  `--router-mode kv` sees the prefixes this worker really holds; a salted
  request's blocks (`cache_salt`) are published with their salt.
- The carry counters appear on this worker's Dynamo metrics endpoint
  (`/metrics` of its system server), labelled with the worker's id. A request
  the worker refuses (400) counts once as `kind="rejected"`.
- Carried rows follow a session to this worker (`carry_peers`, with the `nixl`
  extra): a turn whose session has no entry here and never had one first pulls
  the entry from the peer that holds it (within `--carry-pull-budget-ms`; any
  failure is the turn's honest miss, the remote reason counted), and a planned
  stop (SIGTERM) hands every entry to the peers before the worker exits
  (within `--carry-drain-s`). The final chunk's `engine_data.mtp_carry` says
  where an adopted turn's rows came from (`rows_source`), what the pull did
  (`pull`, `pull_ms`) and the receipt of a moved entry (`moved_in`: its digest).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import queue
import secrets
import threading
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any

from dynamo._core import Context
from dynamo.common.backend.agent_context import session_id_from_request
from dynamo.common.backend.engine import (
    EngineConfig,
    GenerateChunk,
    GenerateRequest,
    LLMEngine,
    LlmRegistration,
)
from dynamo.common.backend.publisher import KvEventSource, PushSource
from dynamo.common.backend.run import run
from dynamo.common.backend.worker import WorkerConfig
from dynamo.common.utils.token_ids import normalize_request_token_ids
from dynamo.llm.exceptions import EngineShutdown, InvalidArgument, Unknown

from ...argtypes import non_negative_int, positive_int
from ...core.session import carry_key, session_hash
from ..engines import build_engine
from ..options import ENGINES, POLICIES, ServeOptions
from ..session_server import SessionServer, TurnRequest
from .metrics import WorkerMetrics
from .model_dir import write_model_dir

REJECTED_REASONS = ("invalid_request", "unknown_session", "string_corrid")
"""SessionServer error reasons of a request refused before admission (a 400): `kind="rejected"`."""

logger = logging.getLogger("trtllm_mtp_carry.serve.dynamo")

POLICY_ANNOTATION = "mtp_carry_policy:"
"""The `nvext.annotations` entry naming a turn's drafter policy: `mtp_carry_policy:<name>`
(the frontend forwards annotations to the worker and rejects unknown top-level fields)."""


class KvEventRelay:
    """The block manager's listener: queues its events, a thread publishes them to Dynamo.

    Owns the set of hashes it published, so a removal is sent only for a
    block the router was told about. Events before Dynamo hands over the
    publisher wait in the queue.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._queue: queue.SimpleQueue[tuple[str, dict[str, Any]] | None] = queue.SimpleQueue()
        self._published: set[int] = set()
        self._salts: dict[int, str] = {}  # salt root -> salt, for the salted chains' events
        self._thread: threading.Thread | None = None
        self.num_stored = self.num_removed = 0

    def note_salt(self, salt: str) -> None:
        """Remember a request's cache salt (before it runs), so its blocks' events name it."""
        from ...engine.prefix_hash import salt_root

        self._salts.setdefault(salt_root(salt), salt)

    # ---- BlockListener (the engine thread) ----

    @staticmethod
    def _signed(h: int) -> int:
        """A u64 prefix key as the i64 Dynamo's event API takes (the same 64 bits)."""
        return h - (1 << 64) if h >= 1 << 63 else h

    def stored(self, root: int, parent: int, hashes: list[int], tokens: Sequence[int]) -> None:
        from ...engine.prefix_hash import ROOT_HASH

        salt = None if root == ROOT_HASH else self._salts.get(root)
        if root != ROOT_HASH and salt is None:
            return  # a salt no request here named: the router could not match it
        self._queue.put(("stored", {
            "token_ids": list(tokens), "num_block_tokens": [self.block_size] * len(hashes),
            "block_hashes": [self._signed(h) for h in hashes],
            "parent_hash": None if parent == root else self._signed(parent), "cache_salt": salt,
        }))

    def removed(self, hashes: list[int]) -> None:
        self._queue.put(("removed", {"block_hashes": [self._signed(h) for h in hashes]}))

    # ---- the publishing thread ----

    def start(self, publisher: Any) -> None:
        self._thread = threading.Thread(target=self._publish, args=(publisher,),
                                        name="mtp-carry-kv-events", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(2.0)
            self._thread = None

    def _publish(self, publisher: Any) -> None:
        while (item := self._queue.get()) is not None:
            kind, event = item
            try:
                if kind == "stored":
                    parent = event["parent_hash"]
                    if parent is not None and parent not in self._published:
                        continue  # its parent was never announced (salted or evicted): unreachable
                    publisher.publish_stored(**event)
                    self._published.update(event["block_hashes"])
                    self.num_stored += len(event["block_hashes"])
                else:
                    known = [h for h in event["block_hashes"] if h in self._published]
                    if known:
                        publisher.publish_removed(known)
                        self._published.difference_update(known)
                        self.num_removed += len(known)
            except Exception:  # a dropped event only costs routing precision
                logger.exception("KV event (%s) not published", kind)


class _StreamSink:
    """One request's ResponseSink: hands what the engine thread sends to `generate`'s loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.items: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.stopped = threading.Event()

    def _put(self, item: tuple[str, Any]) -> None:
        self._loop.call_soon_threadsafe(self.items.put_nowait, item)

    def partial(self, ids: list[int], text: str) -> None:
        self._put(("partial", ids))

    def final(self, ids: list[int], text: str, result: Any) -> None:
        self._put(("final", (ids, result)))

    def error(self, message: str) -> None:
        self._put(("error", message))

    def cancelled(self) -> bool:
        return self.stopped.is_set()


class CarryWorker(LLMEngine):
    """The Dynamo `LLMEngine` of the carry: one engine, one SessionServer, KV events, metrics."""

    def __init__(self, options: ServeOptions, model_dir: str, served_model_name: str,
                 idle_timeout_s: float | None, publish_kv_events: bool = True,
                 moves: MoveOptions | None = None) -> None:
        self.options = options
        self.model_dir = model_dir
        self.served_model_name = served_model_name
        self.idle_timeout_s = idle_timeout_s
        self.publish_kv_events = publish_kv_events
        self.move_options = moves
        self.worker_id = 0
        self.engine: Any = None
        self.server: SessionServer | None = None
        self.relay: KvEventRelay | None = None
        self.metrics: WorkerMetrics | None = None
        self.peers: Any = None  # carry_peers.CarryPeers, when entries move between workers
        self._moves: Any = None  # its service.moves.EntryMoves
        self._runtime: Any = None  # the engine's CarryRuntime, when entries move
        self._streams: dict[str, _StreamSink] = {}  # context id -> its sink, for abort()
        self._remote: dict[int, bool] = {}  # session -> its turn in the engine found moved rows

    @classmethod
    async def from_args(cls, argv: list[str] | None = None) -> tuple[CarryWorker, WorkerConfig]:
        args = build_parser().parse_args(argv)
        options = ServeOptions(
            engine=args.engine, drafter_policy=args.policy, draft_len=args.draft_len,
            marconi_min_tokens=args.marconi_min_tokens, carry_slots=args.carry_slots,
            carry_memory=args.carry_memory, carry_host_memory=args.carry_host_memory,
            carry_row_dtype=args.carry_row_dtype, carry_eviction=args.carry_eviction, carry_idle_s=args.carry_idle_s, carry_share=args.carry_share,
            max_model_len=args.max_model_len, max_tokens=args.max_tokens,
            max_num_seqs=args.max_num_seqs, device=args.device,
        )
        moves = None if args.no_carry_moves else MoveOptions(
            args.namespace, args.component, args.discovery_backend, args.request_plane, args.event_plane,
            args.transfer_host, args.carry_pull_budget_ms / 1e3, args.carry_drain_s, args.carry_digests,
            args.stopping_file)
        worker = cls(options, args.model_dir, args.served_model_name, args.idle_timeout_s,
                     publish_kv_events=not args.no_kv_events, moves=moves)
        config = WorkerConfig(
            namespace=args.namespace, component=args.component, endpoint="generate",
            model_name=args.model_dir, served_model_name=args.served_model_name,
            endpoint_types="chat,completions", discovery_backend=args.discovery_backend,
            request_plane=args.request_plane, event_plane=args.event_plane,
            enable_kv_routing=not args.no_kv_events,
        )
        return worker, config

    async def start(self, worker_id: int) -> EngineConfig:
        self.worker_id = worker_id
        self.engine = await asyncio.to_thread(self._build_engine)
        write_model_dir(self.model_dir, int(self.engine.max_model_len), self.engine.tokenizer)
        config = getattr(self.engine, "config", None)
        block_size = getattr(config, "block_size", None)
        blocks = getattr(self.engine, "blocks", None)  # engines with a prefix-cache block manager
        if self.publish_kv_events and blocks is not None and block_size is not None:
            self.relay = KvEventRelay(block_size)
            blocks.listener = self.relay
        self.metrics = WorkerMetrics(self.served_model_name, f"{worker_id:x}")
        self.server = SessionServer(self.engine, self.options, idle_timeout_s=self.idle_timeout_s,
                                    on_turn=self._on_turn, on_forget=self.metrics.record_session_end,
                                    on_unadmitted=self.metrics.record_unadmitted, on_error=self._on_error)
        self.server.start()
        if self.move_options is not None:
            await self._start_moves(self.move_options)
        logger.info("mtp-carry worker %s serving %s (engine %s)", worker_id,
                    self.served_model_name, self.options.engine)
        return EngineConfig(
            model=self.model_dir, served_model_name=self.served_model_name,
            llm=LlmRegistration(
                context_length=int(getattr(self.engine, "max_model_len", 0)) or None,
                kv_cache_block_size=block_size,
                total_kv_blocks=getattr(config, "num_target_blocks", None),
                max_num_seqs=self.options.max_num_seqs,
                max_num_batched_tokens=getattr(config, "prefill_chunk", None),
            ),
        )

    def _build_engine(self) -> Any:
        """The engine, warmed up: torch's first-call costs stay out of the first user's turn.
        The warm-up runs the drafter (policy rebuild: rows from the prompt) but makes no carry decision, so the
        runtime's outcome counters, like `mtp_carry_outcomes_total`, count client turns only."""
        engine: Any = build_engine(self.options)  # submit(None, ...): a turn of no session
        tok = engine.tokenizer
        rid = engine.submit(None, tok.render_chat([{"role": "user", "content": "warm up"}]), 4, policy="rebuild")
        while not any(r.request_id == rid for r in engine.step()):
            pass
        return engine

    async def _start_moves(self, o: MoveOptions) -> None:
        """The carry endpoint and the NIXL agent (created once, here: about 0.5 s); without NIXL, or
        for an engine without the reference runtime, entries stay where they are (one line says why)."""
        from ...runtime.carry_runtime import CarryRuntime

        runtime = getattr(self.engine, "runtime", None)
        if not isinstance(runtime, CarryRuntime):
            logger.warning("carried rows stay on their worker: engine %s has no reference carry runtime",
                           self.options.engine)
            return
        from ...service.moves import EntryMoves, model_identity
        from .carry_peers import CarryPeers
        from .nixl_transport import NixlMissing, NixlTransport, ucx_environment

        try:
            os.environ.update(ucx_environment(o.transfer_host))  # read by UCX when the agent is made
            transport = NixlTransport(f"mtp-carry-{self.worker_id:x}-{os.getpid()}")
        except (NixlMissing, ValueError) as exc:
            logger.warning("carried rows stay on their worker: %s", exc)
            return
        assert self.metrics is not None
        self._runtime = runtime
        self._moves = EntryMoves(runtime.service)
        self.peers = CarryPeers(self._moves, self._on_engine, transport, model_identity(self.engine),
                                self.worker_id, self.metrics, pull_budget_s=o.pull_budget_s, drain_s=o.drain_s)
        await self.peers.start(o.namespace, o.component, o.discovery_backend, o.request_plane, o.event_plane)

    async def _on_engine(self, fn: Any) -> Any:
        """`fn()` on the engine's thread (the SessionServer's), awaited."""
        assert self.server is not None
        return await asyncio.wrap_future(self.server.call(fn))

    def _on_turn(self, result: Any) -> None:
        assert self.metrics is not None
        self.metrics.record_turn(result.stats)
        remote = self._remote.pop(result.session_id, False) if result.session_id is not None else False
        if result.stats.outcome_kind == "adopted":
            self.metrics.record_adoption("remote" if remote else "local")
        self.metrics.refresh(self.engine.runtime.stats())

    def _on_error(self, reason: str) -> None:
        if reason in REJECTED_REASONS:  # refused before admission: the request counts once, rejected
            assert self.metrics is not None
            self.metrics.record_unadmitted("rejected")

    async def kv_event_sources(self) -> list[KvEventSource]:
        if self.relay is None:
            return []
        return [PushSource(on_ready=self.relay.start, dp_rank=0)]

    async def register_prometheus(self, metrics: Any) -> None:
        assert self.metrics is not None
        self.metrics.base_labels = dict(metrics.auto_labels or {})
        metrics.register_prometheus_expfmt_callback(self._exposition)

    def _exposition(self) -> str:
        assert self.metrics is not None
        if self.relay is not None:
            self.metrics.record_kv_events(self.relay.num_stored, self.relay.num_removed)
        return self.metrics.exposition()

    async def generate(self, request: GenerateRequest,
                       context: Context) -> AsyncGenerator[GenerateChunk, None]:
        assert self.server is not None and self.metrics is not None
        normalize_request_token_ids(request)
        try:
            turn = self._turn_request(request)
        except InvalidArgument:  # a 400 Dynamo counted as a request: counted here once too
            self.metrics.record_unadmitted("rejected")
            raise
        moved: Moved | None = None
        if not (context.is_stopped() or context.is_killed()):
            moved = await self._move_in(turn)
        if context.is_stopped() or context.is_killed():  # cancelled before it got here: never start it
            self.metrics.record_unadmitted("cancelled")
            yield {"token_ids": [], "index": 0, "finish_reason": "cancelled"}
            return
        if moved is not None and moved.receipt is not None:
            self._remote[turn.corrid] = True  # its adoption counts as remote (`_on_turn`)
        sink = _StreamSink(asyncio.get_running_loop())
        key = str(context.id())
        self._streams[key] = sink
        self.server.enqueue(turn, sink)
        stop: asyncio.Future[Any] = asyncio.ensure_future(context.async_killed_or_stopped())
        try:
            while True:
                get: asyncio.Future[Any] = asyncio.ensure_future(sink.items.get())
                done, _ = await asyncio.wait({get, stop}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    sink.stopped.set()  # the engine thread cancels the turn at its next step
                    yield {"token_ids": [], "index": 0, "finish_reason": "cancelled"}
                    return
                kind, payload = get.result()
                if kind == "error":
                    raise _error(payload)
                if kind == "partial":
                    yield {"token_ids": list(payload), "index": 0}
                    continue
                ids, result = payload
                yield await self._final_chunk(ids, result, turn, moved)
                return
        finally:
            sink.stopped.set()
            stop.cancel()
            self._streams.pop(key, None)

    def _turn_request(self, request: GenerateRequest) -> TurnRequest:
        token_ids = request.get("token_ids") or []
        max_tokens = (request.get("stop_conditions") or {}).get("max_tokens")
        policy = _policy_of(request)
        if policy is not None and policy not in POLICIES:
            raise InvalidArgument(f"annotation {POLICY_ANNOTATION}<policy> must name one of "
                                  f"{', '.join(POLICIES)}, got {policy!r}")
        salt = _cache_salt_of(request)
        if salt is not None and self.relay is not None:
            self.relay.note_salt(salt)
        session_id = session_id_from_request(request)
        if session_id is None:  # a one-turn session of its own, ended with the turn
            return TurnRequest(corrid=secrets.randbits(63) | 1, start=True, end=True,
                               input_ids=list(token_ids), max_tokens=max_tokens,
                               drafter_policy=policy, cache_salt=salt)
        return TurnRequest(corrid=session_hash(session_id), start_if_new=True,
                           input_ids=list(token_ids), max_tokens=max_tokens, drafter_policy=policy,
                           cache_salt=salt)

    async def _move_in(self, turn: TurnRequest) -> Moved | None:
        """Before a session's turn is queued: the entry a peer pushed here for it, or else, when the
        session has no entry here and never had one, the entry pulled from the peer holding it
        (None: the turn makes no carry decision, or entries do not move)."""
        if self.peers is None or turn.start or not self._runtime.carries(turn.drafter_policy):
            return None
        session = session_hash(turn.corrid)  # the engine's session of this corrid (engine.submit)
        key = carry_key(session, turn.cache_salt)
        receipt = self.peers.take_receipt(key)  # pushed here by a drain, not adopted yet
        pull = None
        if self._moves.pullable(key, session):
            pull = await self.peers.pull(key, session, turn.input_ids or [])
            receipt = self.peers.take_receipt(key) if pull.result == "received" else receipt
        return Moved(key, pull, receipt)

    async def _final_chunk(self, ids: list[int], result: Any, turn: TurnRequest,
                           moved: Moved | None) -> GenerateChunk:
        stats = result.stats
        carry = dict(stats.as_dict(), worker_id=self.worker_id)
        if self.peers is not None:
            adopted = stats.outcome_kind == "adopted"
            remote = moved is not None and moved.receipt is not None
            carry.update(rows_source=("remote" if remote else "local") if adopted else "",
                         pull=moved.pull.result if moved and moved.pull else "",
                         pull_ms=round(moved.pull.ms, 3) if moved and moved.pull else 0.0,
                         moved_in=moved.receipt.as_dict() if moved and moved.receipt else None)
            if self.move_options is not None and self.move_options.digests and not turn.start:
                key = carry_key(session_hash(turn.corrid), turn.cache_salt)
                carry["carry_digest"] = await self._on_engine(lambda: self._moves.held_digest(key))
        return {
            "token_ids": list(ids), "index": 0, "finish_reason": result.finish_reason,
            "completion_usage": {
                "prompt_tokens": len(result.prompt), "completion_tokens": len(result.output),
                "total_tokens": len(result.prompt) + len(result.output),
                "prompt_tokens_details": {"cached_tokens": stats.reused_tokens},
            },
            "engine_data": {"mtp_carry": carry},
        }

    async def abort(self, context: Context) -> None:
        sink = self._streams.get(str(context.id()))
        if sink is not None:
            sink.stopped.set()

    async def cleanup(self) -> None:
        if self.server is not None:
            self.server.stop()  # turns still running deposit their rows (cancelled) and migrate
        if self.peers is not None:  # a planned stop: the entries go to the peers first
            o = self.move_options
            whole = o is not None and o.stopping_file is not None and os.path.exists(o.stopping_file)
            try:
                await self.peers.drain(offer=not whole)
            finally:
                await self.peers.close()
                self.peers = None
        self.server = None
        if self.relay is not None:
            self.relay.stop()


@dataclass(frozen=True)
class MoveOptions:
    """Where the `carry` endpoint registers (the worker's own Dynamo settings), the address the
    transfers may use (`transfer_host`: loopback keeps NIXL on shared memory), the pull budget, the
    drain's bound, and whether each turn reports the digest of the rows it deposited."""

    namespace: str
    component: str
    discovery_backend: str
    request_plane: str
    event_plane: str | None
    transfer_host: str = "127.0.0.1"
    pull_budget_s: float = 1.0
    drain_s: float = 10.0
    digests: bool = False
    stopping_file: str | None = None  # present at a stop: the whole deployment stops (no peer to offer to)


@dataclass(frozen=True)
class Moved:
    """What the moves did before a turn: its carry `key`, the pull (None: none was needed) and the
    receipt of the entry it will find (None: none was moved here)."""

    key: int
    pull: Any
    receipt: Any


def _error(message: str) -> Exception:
    """The Dynamo error for a SessionServer error message: the engine stopping or failing
    is not the client's fault; anything else is a bad request (400)."""
    if message.startswith("the model is shutting down"):
        return EngineShutdown(message)
    if message.startswith("engine step failed"):
        return Unknown(message)
    return InvalidArgument(message)


def _policy_of(request: GenerateRequest) -> str | None:
    """The drafter policy a request names in `nvext.annotations` (None: the worker's default)."""
    for note in request.get("annotations") or []:  # type: ignore[attr-defined]
        if isinstance(note, str) and note.startswith(POLICY_ANNOTATION):
            return note[len(POLICY_ANNOTATION):]
    return None


def _cache_salt_of(request: GenerateRequest) -> str | None:
    """The request's `cache_salt` (the frontend forwards it in `extra_args.nvext`)."""
    nvext = (request.get("extra_args") or {}).get("nvext") or {}
    salt = nvext.get("cache_salt") if isinstance(nvext, dict) else None
    return salt if isinstance(salt, str) and salt else None


def build_parser() -> argparse.ArgumentParser:
    """The worker's flags: where it registers, and the served model's options."""
    d = ServeOptions()
    p = argparse.ArgumentParser(prog="python -m trtllm_mtp_carry.serve.dynamo.worker",
                                description="A Dynamo worker serving the MTP drafter carry")
    p.add_argument("--model-dir", required=True, help="model directory (serve.dynamo.model_dir)")
    p.add_argument("--served-model-name", default="mtp-carry")
    p.add_argument("--namespace", default="mtp_carry")
    p.add_argument("--component", default="backend")
    p.add_argument("--discovery-backend", default="file")
    p.add_argument("--request-plane", default="tcp")
    p.add_argument("--event-plane", default=None)
    p.add_argument("--no-kv-events", action="store_true", help="publish no KV events")
    p.add_argument("--idle-timeout-s", type=float, default=None,
                   help="a session idle this long ends and its carried rows are freed")
    p.add_argument("--engine", choices=ENGINES, default=d.engine)
    p.add_argument("--policy", choices=POLICIES, default=d.drafter_policy)
    p.add_argument("--draft-len", type=non_negative_int, default=d.draft_len)
    p.add_argument("--max-tokens", type=positive_int, default=d.max_tokens)
    p.add_argument("--max-model-len", type=positive_int, default=None)
    p.add_argument("--max-num-seqs", type=positive_int, default=d.max_num_seqs)
    p.add_argument("--restore-threshold", dest="marconi_min_tokens", type=non_negative_int, default=None)
    p.add_argument("--carry-slots", type=positive_int, default=None)
    p.add_argument("--carry-memory", default=None)
    p.add_argument("--carry-host-memory", default=None)
    p.add_argument("--carry-row-dtype", default=None)
    p.add_argument("--carry-eviction", default=None)
    p.add_argument("--carry-idle-s", type=non_negative_int, default=None)
    p.add_argument("--carry-share", default=None)
    p.add_argument("--device", default=d.device)
    g = p.add_argument_group("carried rows between workers (the nixl extra)")
    g.add_argument("--no-carry-moves", action="store_true",
                   help="never pull an entry from a peer nor hand entries over at a planned stop")
    g.add_argument("--transfer-host", default="127.0.0.1",
                   help="the address NIXL transfers may use (loopback: shared memory, no socket)")
    g.add_argument("--carry-pull-budget-ms", type=positive_int, default=1000,
                   help="how long a turn may wait for its entry from a peer (default %(default)s)")
    g.add_argument("--carry-drain-s", type=positive_int, default=10,
                   help="how long a planned stop may spend handing entries to peers (default %(default)s)")
    g.add_argument("--stopping-file", default=None,
                   help="a file whose presence at a stop means every worker stops: entries are dropped, "
                   "not offered to peers (serve --dynamo writes it before stopping the deployment)")
    g.add_argument("--carry-digests", action="store_true",
                   help="report the digest of the rows each turn deposited (engine_data carry_digest)")
    return p


def main(argv: list[str] | None = None) -> None:
    run(CarryWorker, argv)


if __name__ == "__main__":
    main()
