"""Carried rows follow a session to another worker: the workers' `carry` endpoint, the pull on a
miss and the drain at a planned stop.

What it is for: Dynamo routes a session's turn to another worker when its worker
stops, restarts or is loaded. That turn would miss (`never_carried`) and build its
drafter rows again for the whole history. Instead the new worker asks its peers
who holds the session's entry, over Dynamo's own request plane: every worker
serves a second endpoint, `<namespace>.<component>.carry`, found through Dynamo's
discovery as `generate` is. The holder lends the entry (`EntryMoves.lend`: its
rows as one contiguous host range, pinned as a copy), answers with the entry's
meta and a NIXL offer of the range; the new worker checks model, drafter, format
and prefix, reads the range in one NIXL read, verifies the digest, stores the
entry (`EntryMoves.commit_receive`) and tells the holder to release it (the
entry leaves the holder: one holder per session). The turn then adopts it as
any carried entry::

    new worker W (turn of key K misses)          peers                      holder H
    pull(K) -- {"op": "lend", K} ------------->  each: held? -----------> lend(K): copy, expose
            <-- {held, meta, offer, identity} --------------------------
    checks; plan; NIXL READ (one descriptor) <============================ the exposed range
    commit (engine thread) -- {"op": "release", moved} ----------------> end_loan: K leaves H

A planned stop (SIGTERM, scale-in, restart) drains the worker: its engine stops,
then every entry is lent and pushed to the live peers (`{"op": "take"}`: the peer
reads and stores it as above), within `drain_s`; what cannot move is dropped and
counted. A peer that took a pushed entry lends it on to whichever worker the
session's next turn lands on.

Invariants:
- A pull never adopts another key's rows: the holder looks the key up exactly (the
  carry key is the session under its salt), the receiver refuses an answer for
  another key or session, and stores the rows under the key asked for.
- Any failure is the turn's honest miss (the turn runs as without the move: the core's
  `NoCarry`), with the remote reason counted (`REMOTE_MISS_REASONS`); a pull's network
  part (finding the holder, the NIXL read) never outlasts its budget (`pull_budget_s`) and
  never hangs on a dead or stuck holder. Storing the bytes read (`commit_receive`, on the
  engine's thread, local work) runs to its end past the budget: cut short, the entry would
  be stored while the holder heard the move failed, and two workers would hold it.
- A loan not released within `loan_ttl_s` is withdrawn and unpinned (the entry stays).
  At most `max_lent_bytes` are on loan at once, one loan per key (`busy` otherwise).
- Everything here runs on the worker's event loop; the engine-side calls that touch the
  pool (`lend`, `end_loan`, `commit_receive`) go through `on_engine` (the engine's
  thread). Nothing here reads the runtime's internals: `EntryMoves` is the seam.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from ...core.carry_store import remember
from ...service.moves import EntryMeta, EntryMoves, Loan, ReceivePlan, digest_tokens
from .nixl_transport import NixlTransport, Offer, TransferError

logger = logging.getLogger("trtllm_mtp_carry.serve.dynamo.moves")

T = TypeVar("T")

CARRY_ENDPOINT = "carry"
"""The second endpoint every worker serves beside `generate`."""

REMOTE_MISS_REASONS: tuple[str, ...] = (
    "no_peers",  # no other worker is registered
    "no_holder",  # every peer answered: none holds the key
    "timeout",  # the pull's budget ran out (a peer, or the read, too slow or stuck)
    "holder_gone",  # the holder went away mid-pull (its endpoint or its NIXL agent)
    "busy",  # the holder would not lend: the key is on loan already, or its loans are at their limit
    "model",  # the holder serves another model or drafter (its identity differs)
    "format",  # the entry is held in another form (row codec, block geometry, dtype) or is malformed
    "prefix_mismatch",  # the prompt does not continue the entry's tokens: no row would be kept
    "digest_mismatch",  # the bytes read differ from the holder's digest
    "no_room",  # this worker's store refused the entry (its admission policy, or the pool is full)
    "held_locally",  # an entry of the key appeared here meanwhile
    "error",  # anything else (logged once per exception class)
)
"""Why a pull on a miss brought nothing, in the order counters list them."""

PULL_RESULTS: tuple[str, ...] = ("received", *REMOTE_MISS_REASONS)
"""Every pull's result: `received`, or a remote miss reason."""

DRAIN_RESULTS: tuple[str, ...] = ("moved", "dropped")
"""What a planned stop did with each entry it held."""

RECEIPTS = 65536
"""How many received entries' receipts are kept until a turn reads them (oldest dropped first)."""


class OnEngine(Protocol):
    """Runs a function on the engine's thread (the pool's owner) and awaits its result."""

    def __call__(self, fn: Callable[[], T]) -> Awaitable[T]: ...


class MoveMetrics(Protocol):
    """Where the moves are counted (`serve.dynamo.metrics.WorkerMetrics`)."""

    def record_pull(self, result: str, ms: float) -> None: ...

    def record_moved(self, direction: str, rows: int, nbytes: int) -> None: ...

    def record_drain(self, result: str, entries: int) -> None: ...


@dataclass(frozen=True)
class Receipt:
    """An entry this worker received: `via` `pull` or `push`, from `holder` (its worker id), its
    rows, bytes and digest (of the bytes read, equal to the holder's)."""

    via: str
    holder: int
    rows: int
    nbytes: int
    digest: str

    def as_dict(self) -> dict[str, Any]:
        return {"via": self.via, "holder": self.holder, "rows": self.rows, "bytes": self.nbytes,
                "digest": self.digest}


@dataclass(frozen=True)
class Pull:
    """One pull's outcome: `result` (`PULL_RESULTS`), its wall ms and, when received, the receipt."""

    result: str
    ms: float
    receipt: Receipt | None = None


@dataclass
class _Lent:
    loan: Loan
    offer: Offer
    expires: float


def _hex(key: int) -> str:
    return f"{key:016x}"


def meta_to_wire(meta: EntryMeta) -> dict[str, Any]:
    """An `EntryMeta` as JSON the request plane carries (64-bit keys as hex: JSON numbers lose them)."""
    return {"key": _hex(meta.key), "session": _hex(meta.session), "tokens": list(meta.tokens),
            "tokens_digest": digest_tokens(meta.tokens), "rows": meta.rows,
            "last_pair_key": meta.last_pair_key, "runs": [list(r) for r in meta.runs],
            "layout": meta.layout, "nbytes": meta.nbytes, "digest": meta.digest}


def meta_from_wire(d: dict[str, Any]) -> EntryMeta:
    """The `EntryMeta` a peer sent; ValueError naming what is malformed (a token digest that does
    not match the tokens included)."""
    try:
        meta = EntryMeta(int(d["key"], 16), int(d["session"], 16), tuple(int(t) for t in d["tokens"]),
                         int(d["rows"]), int(d["last_pair_key"]),
                         tuple((int(a), int(b)) for a, b in d["runs"]), dict(d["layout"]),
                         int(d["nbytes"]), str(d["digest"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed entry meta: {exc!r}") from None
    if digest_tokens(meta.tokens) != d.get("tokens_digest"):
        raise ValueError("the entry's tokens differ from their digest")
    meta.check()
    return meta


class CarryPeers:
    """This worker's side of the moves: serves the `carry` endpoint, pulls on a miss, drains at a
    planned stop (see the module header).

    `moves` is the runtime's seam, `on_engine(fn)` runs `fn` on the engine's thread and awaits
    it, `identity` names the model and drafter (`model_identity`), `worker_id` is this worker's
    Dynamo id (reported to peers), `metrics` counts (`MoveMetrics`)."""

    def __init__(self, moves: EntryMoves, on_engine: OnEngine,
                 transport: NixlTransport, identity: str, worker_id: int, metrics: MoveMetrics,
                 pull_budget_s: float = 1.0, drain_s: float = 10.0, loan_ttl_s: float = 30.0,
                 max_lent_bytes: int = 1 << 30) -> None:
        self.moves = moves
        self.on_engine = on_engine
        self.transport = transport
        self.identity = identity
        self.worker_id = worker_id
        self.metrics = metrics
        self.pull_budget_s = pull_budget_s
        self.drain_s = drain_s
        self.loan_ttl_s = loan_ttl_s
        self.max_lent_bytes = max_lent_bytes
        self.self_id = 0  # this worker's `carry` instance id (its second runtime's connection id)
        self._runtime: Any = None
        self._endpoint: Any = None
        self._client: Any = None
        self._serving: asyncio.Future[Any] | None = None
        self._lent: dict[str, _Lent] = {}  # loan id -> the loan
        self._lent_keys: dict[int, str] = {}  # key -> its loan id (one loan per key)
        self._receipts: OrderedDict[int, Receipt] = OrderedDict()  # key -> how it came here
        self._pump: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._logged: set[str] = set()
        self._draining = False  # a planned stop began: pushes to this worker are refused

    # ---- lifecycle ------------------------------------------------------------

    async def start(self, namespace: str, component: str, discovery_backend: str, request_plane: str,
                    event_plane: str | None) -> None:
        """Serve `<namespace>.<component>.carry` on a runtime of its own (the Rust worker's runtime
        has no Python event loop to run a handler on) and watch the peers that serve it."""
        from dynamo._core import DistributedRuntime

        loop = asyncio.get_running_loop()
        # the worker's runtime serves the system port (/metrics, /health): this one must not bind it again
        saved = {k: os.environ.pop(k) for k in ("DYN_SYSTEM_PORT", "DYN_SYSTEM_ENABLED") if k in os.environ}
        try:
            self._runtime = DistributedRuntime(loop, discovery_backend, request_plane, event_plane=event_plane)
        finally:
            os.environ.update(saved)
        self._endpoint = self._runtime.endpoint(f"{namespace}.{component}.{CARRY_ENDPOINT}")
        self._serving = asyncio.ensure_future(self._endpoint.serve_endpoint(self._handle, graceful_shutdown=False))
        self._serving.add_done_callback(self._served)
        self._client = await self._endpoint.client()
        self.self_id = int(self._endpoint.connection_id())
        self._pump = asyncio.ensure_future(self._pump_loop())

    def _served(self, serving: asyncio.Future[Any]) -> None:
        """The endpoint stopped serving: said once if it failed (peers then miss with `holder_gone`)."""
        failure = None if serving.cancelled() else serving.exception()
        if failure is not None:
            self._log_once("serve_endpoint", failure)

    async def close(self) -> None:
        """Withdraw every loan, leave discovery, stop pumping."""
        for loan_id in list(self._lent):
            await self._release(loan_id, moved=False)
        await self._leave()
        if self._pump is not None:
            self._pump.cancel()
            self._pump = None
        self.transport.close()

    async def _leave(self) -> None:
        """Leave discovery (once): peers stop asking this worker."""
        endpoint, self._endpoint = self._endpoint, None
        if endpoint is not None:
            try:
                await endpoint.unregister_endpoint_instance()
            except Exception as exc:  # the process is leaving anyway: its discovery entries go with it
                logger.debug("carry endpoint not unregistered: %s", exc)

    def peers(self) -> list[int]:
        """The other workers' `carry` instance ids, as discovery lists them now."""
        if self._client is None:
            return []
        return [i for i in self._client.instance_ids() if i != self.self_id]

    def take_receipt(self, key: int) -> Receipt | None:
        """How `key`'s entry came here, if it was received (forgotten once read: a turn asks once)."""
        return self._receipts.pop(key, None)

    # ---- the pull on a miss ------------------------------------------------------

    async def pull(self, key: int, session: int, prompt: Sequence[int]) -> Pull:
        """Bring `key`'s entry here from whichever peer holds it, for a turn of `prompt`, within
        the pull budget: `Pull("received", ...)` with its receipt, or the remote miss reason."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.pull_budget_s
        try:
            result, receipt = await self._pull(key, session, prompt, deadline)
        except Exception as exc:  # a bug or an unexpected answer: the turn misses, the worker goes on
            self._log_once("pull", exc)
            result, receipt = "error", None
        ms = (time.perf_counter() - t0) * 1e3
        self.metrics.record_pull(result, ms)
        if receipt is not None:
            self.metrics.record_moved("in", receipt.rows, receipt.nbytes)
            remember(self._receipts, key, receipt, RECEIPTS)
            logger.info("pulled entry %s from worker %x: %d rows, %d bytes, digest %s, %.1f ms",
                        _hex(key), receipt.holder, receipt.rows, receipt.nbytes, receipt.digest, ms)
        else:
            logger.debug("pull of entry %s: %s (%.1f ms)", _hex(key), result, ms)
        return Pull(result, ms, receipt)

    async def _pull(self, key: int, session: int, prompt: Sequence[int],
                    deadline: float) -> tuple[str, Receipt | None]:
        peers = self.peers()
        if not peers:
            return "no_peers", None
        found = await self._find_holder(peers, key, deadline)
        if isinstance(found, str):
            return found, None
        peer, answer = found
        try:
            result, receipt = await self._receive(answer, "pull", deadline, key, session, prompt)
        except BaseException:
            self._spawn(self._ask(peer, {"op": "release", "loan_id": answer.get("loan_id"), "moved": False},
                                  time.monotonic() + 5.0))
            raise
        self._spawn(self._ask(peer, {"op": "release", "loan_id": answer["loan_id"],
                                     "moved": result == "received"}, time.monotonic() + 5.0))
        return result, receipt

    async def _find_holder(self, peers: list[int], key: int,
                           deadline: float) -> tuple[int, dict[str, Any]] | str:
        """Ask every peer to lend `key`; the first that holds it (others' loans released), or why none."""
        request = {"op": "lend", "key": _hex(key), "identity": self.identity}
        tasks = {asyncio.ensure_future(self._ask(p, request, deadline)): p for p in peers}
        found: tuple[int, dict[str, Any]] | None = None
        reasons: list[str] = []
        pending = set(tasks)
        while pending and found is None:
            left = deadline - time.monotonic()
            done, pending = await asyncio.wait(pending, timeout=max(0.0, left),
                                               return_when=asyncio.FIRST_COMPLETED)
            if not done:
                break
            for task in done:
                answer = task.result()
                if isinstance(answer, str):
                    reasons.append(answer)
                elif answer.get("held"):
                    if found is None:
                        found = (tasks[task], answer)
                    else:  # a second holder (never by design): it keeps its entry
                        self._spawn(self._ask(tasks[task], {"op": "release", "loan_id": answer["loan_id"],
                                                            "moved": False}, time.monotonic() + 5.0))
                else:
                    reasons.append(str(answer.get("reason", "no_holder")))
        for task in pending:  # a late answer's loan is released, never left pinned
            task.add_done_callback(functools.partial(self._release_late, tasks[task]))
        if found is not None:
            return found
        if pending:
            return "timeout"
        for reason in ("busy", "model", "holder_gone", "error"):
            if reason in reasons:
                return reason
        return "no_holder"

    def _release_late(self, peer: int, task: asyncio.Future[Any]) -> None:
        if not task.cancelled() and task.exception() is None:
            answer = task.result()
            if isinstance(answer, dict) and answer.get("held"):
                self._spawn(self._ask(peer, {"op": "release", "loan_id": answer["loan_id"], "moved": False},
                                      time.monotonic() + 5.0))

    async def _receive(self, answer: dict[str, Any], via: str, deadline: float, key: int | None = None,
                       session: int | None = None,
                       prompt: Sequence[int] | None = None) -> tuple[str, Receipt | None]:
        """Check a holder's answer, read its range, store it: (`received`, receipt) or (reason, None)."""
        if answer.get("identity") != self.identity:
            return "model", None
        try:
            meta = meta_from_wire(answer["meta"])
            offer = Offer.from_dict(answer["offer"])
        except (KeyError, TypeError, ValueError):
            return "format", None
        if (key is not None and meta.key != key) or (session is not None and meta.session != session) \
                or offer.nbytes != meta.nbytes:
            return "format", None  # never another key's rows, whatever a peer says
        if prompt is not None and meta.entry().usable_by(prompt, meta.key) is None:
            return "prefix_mismatch", None  # decide_adopt would keep no row of it
        plan = self.moves.plan_receive(meta)
        if isinstance(plan, str):
            return plan, None
        try:
            await self.transport.read(offer, plan.landing, deadline)
        except TransferError as exc:
            return exc.reason, None
        result = await self.on_engine(functools.partial(self.moves.commit_receive, plan))
        if result != "received":
            return result, None
        return "received", Receipt(via, int(answer.get("worker", 0)), meta.rows, meta.nbytes, meta.digest)

    # ---- the drain at a planned stop --------------------------------------------------

    async def drain(self, offer: bool = True) -> dict[str, int]:
        """Offer every entry to the live peers (pushed: each peer reads and stores its share), within
        `drain_s`; entries not taken are dropped (all of them without `offer`: the whole deployment
        stops). Call once the engine stopped. Returns the counts by `DRAIN_RESULTS`."""
        deadline = time.monotonic() + self.drain_s
        self._draining = True
        await self._leave()  # peers stop choosing this worker
        keys = self.moves.keys()
        counts = dict.fromkeys(DRAIN_RESULTS, 0)
        peers = self.peers() if offer else []
        t0 = time.perf_counter()
        if keys and peers:
            try:
                counts["moved"] = await self._push(keys, peers, deadline)
            except Exception as exc:
                self._log_once("drain", exc)
        counts["dropped"] = len(keys) - counts["moved"]
        for result, n in counts.items():
            if n:
                self.metrics.record_drain(result, n)
        if keys:
            logger.info("drained %d carried entries to %d peers in %.0f ms: %d moved, %d dropped", len(keys),
                        len(peers), (time.perf_counter() - t0) * 1e3, counts["moved"], counts["dropped"])
        return counts

    async def _push(self, keys: list[int], peers: list[int], deadline: float) -> int:
        moved = 0
        batch_bytes = max(1, self.max_lent_bytes // 2)
        share = itertools.cycle(peers)
        todo = list(keys)
        while todo and time.monotonic() < deadline:
            batch: list[tuple[str, _Lent]] = []
            size = 0
            while todo and size < batch_bytes:
                loan = await self._lend_once(todo.pop(0))  # None: gone, or on loan to a puller already
                if loan is not None:
                    batch.append(self._expose(loan))
                    size += loan.meta.nbytes
            per_peer: dict[int, list[dict[str, Any]]] = {}
            for loan_id, lent in batch:
                per_peer.setdefault(next(share), []).append(self._answer(loan_id, lent))
            left = deadline - time.monotonic()
            replies = await asyncio.gather(*[self._ask(p, {"op": "take", "entries": entries, "budget_s": left},
                                                       deadline) for p, entries in per_peer.items()])
            taken: set[str] = set()
            for reply in replies:
                if isinstance(reply, dict):
                    taken.update(str(i) for i in reply.get("taken", []))
            for loan_id, _ in batch:
                if await self._release(loan_id, moved=loan_id in taken):
                    moved += 1
        return moved

    # ---- the endpoint ----------------------------------------------------------------

    async def _handle(self, request: Any, context: Any = None) -> Any:
        """The `carry` endpoint: one JSON answer per request (`lend`, `release`, `take`)."""
        try:
            op = request.get("op") if isinstance(request, dict) else None
            if op == "lend":
                answer = await self._lend(int(request["key"], 16), request.get("identity"))
            elif op == "release":
                answer = {"ok": await self._release(str(request["loan_id"]), bool(request["moved"]))}
            elif op == "take":
                answer = await self._take(request["entries"], float(request.get("budget_s", self.drain_s)))
            else:
                answer = {"error": f"unknown op {op!r}"}
        except Exception as exc:
            self._log_once(f"endpoint {request.get('op') if isinstance(request, dict) else '?'}", exc)
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        yield answer

    async def _lend(self, key: int, identity: Any) -> dict[str, Any]:
        if identity != self.identity:
            return {"held": False, "reason": "model"}
        if key in self._lent_keys:
            return {"held": False, "reason": "busy"}
        if not self.moves.holds(key):
            return {"held": False, "reason": "no_holder"}
        if sum(lent.loan.meta.nbytes for lent in self._lent.values()) >= self.max_lent_bytes:
            return {"held": False, "reason": "busy"}
        loan = await self._lend_once(key)
        if loan is None:
            return {"held": False, "reason": "no_holder"}
        loan_id, lent = self._expose(loan)
        logger.info("lent entry %s: %d rows, %d bytes, digest %s", _hex(key), loan.meta.rows,
                    loan.meta.nbytes, loan.meta.digest)
        return self._answer(loan_id, lent)

    async def _take(self, entries: list[dict[str, Any]], budget_s: float) -> dict[str, Any]:
        if self._draining:  # this worker is leaving too: the entries would only bounce
            return {"taken": [], "refused": {str(a.get("loan_id")): "busy" for a in entries}}
        deadline = time.monotonic() + max(0.0, budget_s)
        taken, refused = [], {}
        for answer in entries:
            try:
                result, receipt = await self._receive(answer, "push", deadline)
            except Exception as exc:
                self._log_once("take", exc)
                result, receipt = "error", None
            if receipt is not None:
                taken.append(answer["loan_id"])
                key = int(answer["meta"]["key"], 16)
                remember(self._receipts, key, receipt, RECEIPTS)
                self.metrics.record_moved("in", receipt.rows, receipt.nbytes)
                logger.info("took entry %s from worker %x: %d rows, %d bytes, digest %s", _hex(key),
                            receipt.holder, receipt.rows, receipt.nbytes, receipt.digest)
            else:
                refused[str(answer.get("loan_id"))] = result
        return {"taken": taken, "refused": refused}

    # ---- loans -------------------------------------------------------------------------

    async def _lend_once(self, key: int) -> Loan | None:
        """`moves.lend(key)` on the engine's thread, unless `key` is on loan already (None then, as
        when it is not held): the key is claimed across the await, so two lends of one key never
        overlap (two loans could both be released `moved`, leaving two holders)."""
        if key in self._lent_keys:
            return None
        self._lent_keys[key] = ""  # claimed; `_expose` names the loan
        try:
            return await self.on_engine(functools.partial(self.moves.lend, key))
        finally:
            if self._lent_keys.get(key) == "":
                del self._lent_keys[key]

    def _expose(self, loan: Loan) -> tuple[str, _Lent]:
        loan_id = secrets.token_hex(8)
        lent = _Lent(loan, self.transport.expose(loan.raw), time.monotonic() + self.loan_ttl_s)
        self._lent[loan_id] = lent
        self._lent_keys[loan.meta.key] = loan_id
        self._wake.set()
        return loan_id, lent

    def _answer(self, loan_id: str, lent: _Lent) -> dict[str, Any]:
        return {"held": True, "loan_id": loan_id, "meta": meta_to_wire(lent.loan.meta),
                "offer": lent.offer.as_dict(), "identity": self.identity, "worker": self.worker_id}

    async def _release(self, loan_id: str, moved: bool) -> bool:
        """End a loan: withdraw its range; `moved`: the entry leaves this worker (counted)."""
        lent = self._lent.pop(loan_id, None)
        if lent is None:
            return False
        if self._lent_keys.get(lent.loan.meta.key) == loan_id:
            del self._lent_keys[lent.loan.meta.key]
        self.transport.withdraw(lent.offer)
        await self.on_engine(functools.partial(self.moves.end_loan, lent.loan, moved))
        if moved:
            self.metrics.record_moved("out", lent.loan.meta.rows, lent.loan.meta.nbytes)
        return moved

    async def _pump_loop(self) -> None:
        """Progress the NIXL agent while ranges are exposed (peers' reads need it); expire loans."""
        while True:
            if not self._lent:
                self._wake.clear()
                await self._wake.wait()
            self.transport.pump()
            now = time.monotonic()
            for loan_id in [i for i, lent in self._lent.items() if lent.expires < now]:
                logger.warning("loan %s of entry %s expired unreleased: withdrawn, the entry stays", loan_id,
                               _hex(self._lent[loan_id].loan.meta.key))
                await self._release(loan_id, moved=False)
            await asyncio.sleep(0.002)

    # ---- the request plane --------------------------------------------------------------

    async def _ask(self, peer: int, request: dict[str, Any], deadline: float) -> dict[str, Any] | str:
        """One request to `peer`'s `carry` endpoint, its one answer by `deadline`; else `timeout`,
        `holder_gone` (the peer cannot be reached) or `error`."""
        left = deadline - time.monotonic()
        if left <= 0:
            return "timeout"
        try:
            return await asyncio.wait_for(self._call(peer, request), left)
        except asyncio.TimeoutError:
            return "timeout"
        except Exception as exc:
            text = str(exc)
            if "Unavailable" in text or "connection" in text.lower() or "not found" in text.lower():
                return "holder_gone"
            self._log_once("request", exc)
            return "error"

    async def _call(self, peer: int, request: dict[str, Any]) -> dict[str, Any]:
        stream = await self._client.direct(request, peer, annotated=False)
        answer = None
        async for item in stream:
            answer = item
            break
        if not isinstance(answer, dict):
            raise RuntimeError(f"carry endpoint of {peer:x} answered {answer!r}")
        if "error" in answer:
            raise RuntimeError(f"carry endpoint of {peer:x}: {answer['error']}")
        return answer

    # ---- small helpers ----------------------------------------------------------------

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    def _log_once(self, where: str, exc: BaseException) -> None:
        mark = f"{where}:{type(exc).__name__}"
        if mark not in self._logged:
            self._logged.add(mark)
            logger.warning("carry moves: %s raised %s: %s (later ones are counted, not logged)", where,
                           type(exc).__name__, exc)


__all__ = ["CARRY_ENDPOINT", "DRAIN_RESULTS", "PULL_RESULTS", "REMOTE_MISS_REASONS", "CarryPeers", "Pull",
           "Receipt", "ReceivePlan", "meta_from_wire", "meta_to_wire"]
