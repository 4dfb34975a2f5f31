"""Stand-in for `tensorrt_llm/_torch/pyexecutor/py_executor.py`: `PyExecutor`'s loop, on the reference model.

Read (nothing ran): `py_executor.py`, several index versions (docs/TRTLLM-CONFORMANCE.md):
`prepare_resources` before every forward, `update_resources` after, `free_resources`
from `_terminate_request` only for a finished request; `_handle_canceled_requests`
(`finish_by_reason(CANCELLED)`, older versions terminate first); `_handle_errors` (the
state set to GENERATION_COMPLETE directly); the overlap scheduler's one-step lag;
`prepare_expect_snapshot_points` before scheduling; `start_worker()`.

What the loop computes is the package's reference model (`engine/model.py`), so outputs
and acceptance are real: the MTP layer's rows for the new span computed by the context
phase, roped at position k as TensorRT-LLM's MTP rows are, the golden token at the last
slot; generation runs MTP-Eagle steps: verify, then rows for all 1 + D positions (those
past the accepted tokens are junk), then draft steps that write rows past the accepted
tokens too.

Tensor parallelism (`tp_size` > 1; `py_executor.py` @ 0004396720054fd8e205cbf616f21f0b57c6b412):
each rank is its own process with its own executor, resource managers and draft pool, which
holds the rank's KV-head shard (`kv_cache_manager_v2.shard_heads`). Only rank 0 takes requests
(`submit`; the source's request queue takes work on rank 0 only); every iteration starts with
`_fetch_and_enqueue_requests`, where rank 0 drains its queue and `RequestBroadcaster.broadcast`
sends the new requests (and cancellations, `is_canceled_request` items) to every rank
(`dist.broadcast(payloads, root=0)`, `request_utils.py` @ 05a226428c22314134409e8f074d69de184fd19e;
`py_conversation_params` rides along as a Python object, as in the trees that collect it).
Each rank then schedules by itself: identical inputs and capacities give identical batches, so
prepare and free run in the same order on every rank. The model runs replicated on every rank
(the stand-in computes every head and writes the rank's shard); the MTP attention reads the
rank's own pages and gathers the other ranks' heads (`TorchDist.tp_allgather`), which is where
the real attention all-reduces its heads: so a draft depends on every shard's rows.

Invariants:
- Greedy decoding: the target verifies every draft, so outputs never depend on the
  drafter's rows.
- `check()` raises if a page or a target cache is held with nothing running (a leak).
- Every rank makes the same collective calls in the same order (`run_until_done` fetches on
  every iteration, exactly as often on every rank).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...dataplane.rope import apply_rope_reference
from .conformant import Conformant
from .conversation_params import ConversationParams
from .kv_cache_manager_v2 import DraftKVManager, shard_heads
from .llm_request import FinishReason, LlmRequest, LlmRequestState
from .mamba_cache_manager_v2 import MambaHybridCacheManagerV2
from .qsa_cache_manager import QsaIndexer, _QsaDraftPool
from .resource_manager import ResourceManager, ResourceManagerType
from .scheduler import ScheduledRequests


@dataclass(frozen=True)
class _QueueItem:
    """What rank 0 broadcasts of a request (`RequestQueueItem`: its id, the executor request, the
    Python-only objects beside it) or of a cancellation (`is_canceled_request`)."""

    id: int
    prompt: tuple[int, ...] = ()
    max_new_tokens: int = 0
    conversation_id: str | None = None
    cache_salt: str | None = None
    lora_task_id: int | None = None
    dummy: bool = False
    client_id: int | None = None
    is_canceled_request: bool = False


class StandinPyExecutor(Conformant):
    """A stand-in `PyExecutor`: chunked prefill, MTP-Eagle greedy speculation, TensorRT-LLM's managers.

    Built only by `create_py_executor_instance` (see `py_executor_creator.create_py_executor`
    for the options). `overlap_scheduler=True`
    keeps a request that finished in one step in the next step's batch (its
    forward runs, writing draft rows past its last token), then frees it, as
    PyExecutor's overlap loop does. Each `step()` runs one chunk of every
    context request and one speculative step of every generation request, at
    most `max_batch` requests. Requests move through `LlmRequestState` as in
    PyExecutor: `finish_by_reason` (END_ID, STOP_WORDS, LENGTH; CANCELLED by
    `cancel`) or the error path (`fail`: GENERATION_COMPLETE set directly),
    then `free_resources`.
    """

    TRTLLM_CLASS = "PyExecutor"

    def __init__(self, resource_manager: ResourceManager, model_engine: Any, llm_args: Any,  # _util.StandinLlmArgs
                 *, max_batch_size: int, dist: Any = None) -> None:
        a = llm_args
        self.dist = dist  # communicator.TorchDist of a multi-rank world, else None
        self.tp_rank = a.rank if dist is not None else 0
        self.heads = a.kv_heads()  # the model's KV heads this rank's draft pool holds
        if a.topology not in ("unpaired", "paired", "folded"):
            raise ValueError(f"topology must be unpaired, paired or folded, got {a.topology!r}")
        self.resource_manager = resource_manager
        self.model_engine = model_engine
        self.llm_args = a
        self.version = a.version
        self.overlap_scheduler = a.overlap_scheduler
        self.stop_token_ids = frozenset(int(t) for t in a.stop_token_ids)
        self._lagging: list[tuple[LlmRequest, FinishReason]] = []
        self.model = model_engine.model
        self.cfg = self.model.cfg
        self.topology = a.topology
        self.draft_len = a.max_draft_len
        self.chunk_size = a.chunk_size
        self.max_batch = max_batch_size
        self.mtp_layer = self.cfg.num_layers  # the MTP layer's global index is num_hidden_layers
        managers = resource_manager.resource_managers
        self.draft: DraftKVManager | None = managers.get(ResourceManagerType.DRAFT_KV_CACHE_MANAGER)
        self.target: MambaHybridCacheManagerV2 = managers[ResourceManagerType.KV_CACHE_MANAGER]
        assert a.pool is not None
        self.paged = a.pool
        # a QSA draft pool's MTP layer runs the sparse indexer, which writes its side rows
        self.indexer = (QsaIndexer(self.draft, self.cfg.hidden_size, self.cfg.rotary_dim, self.cfg.rope_theta)
                        if isinstance(self.draft, _QsaDraftPool) else None)
        self.started = False
        self._queue: list[tuple[_QueueItem, LlmRequest | None]] = []  # rank 0's request queue
        self.waiting: deque[LlmRequest] = deque()
        self.active: list[LlmRequest] = []
        self.finished: dict[int, LlmRequest] = {}
        self._next_id = 1
        from ...engine.tokenizer import ChatTokenizer

        self._eos_id = ChatTokenizer().eos_id

    def start_worker(self) -> None:
        """PyExecutor.start_worker: the executor loop may run from now on (the stand-in steps
        it from `step`; a request submitted before is refused)."""
        self.started = True

    # ---- requests ------------------------------------------------------------------------

    def submit(self, prompt: Sequence[int], max_new_tokens: int, *,
               conversation_id: str | None = None, cache_salt: str | None = None,
               lora_task_id: int | None = None, dummy: bool = False,
               client_id: int | None = None) -> LlmRequest:
        """Queue a request (the executor request queue); returns its `LlmRequest`."""
        if not self.started:
            raise RuntimeError("the stand-in PyExecutor was not started (start_worker)")
        if self.tp_rank != 0:
            raise RuntimeError(f"rank {self.tp_rank} takes no requests: rank 0 takes them and broadcasts them")
        if len(prompt) < 2:
            raise ValueError(f"the stand-in needs a prompt of at least 2 tokens, got {len(prompt)}")
        item = _QueueItem(self._next_id, tuple(prompt), max_new_tokens, conversation_id, cache_salt,
                          lora_task_id, dummy, client_id)
        req = _request(item)
        self._next_id += 1
        self._queue.append((item, req))  # active from the next iteration's fetch
        return req

    def cancel(self, rid: int, *, failed: bool = False, free_first: bool = False) -> None:
        """Cancel a request (queued or running, mid-context too) between two steps.

        As `PyExecutor._handle_canceled_requests`: `finish_by_reason(CANCELLED)`, then
        `_terminate_request` (free); `free_first=True` is older PyExecutors' order
        (`_terminate_request`, then `finish_by_reason`: at free the request is still
        in its running state). `failed=True` is `_handle_errors` instead: the state is
        set to GENERATION_COMPLETE directly (no finish reason), then freed. A queued
        request is dropped before it got resources.

        With several ranks only rank 0 cancels: the cancellation is queued and broadcast, and
        every rank applies it at the next iteration's fetch (`_handle_special_queue_items`
        puts the id in `canceled_req_ids` on every rank); `failed` (an error on one rank) and
        `free_first` are single-rank paths.
        """
        if self.dist is not None and not failed and not free_first:
            if self.tp_rank != 0:
                raise RuntimeError(f"rank {self.tp_rank} takes no cancellations: rank 0 broadcasts them")
            self._queue.append((_QueueItem(rid, is_canceled_request=True), None))
            return
        self._cancel(rid, failed=failed, free_first=free_first)

    def _cancel(self, rid: int, *, failed: bool = False, free_first: bool = False) -> None:
        for item, req in list(self._queue):
            if item.id == rid and req is not None:
                self._queue.remove((item, req))
                return
        for req in list(self.waiting):
            if req.py_request_id == rid:
                self.waiting.remove(req)
                return
        for req in self.active:
            if req.py_request_id == rid:
                if failed:
                    req.failed = True
                    req.state = LlmRequestState.GENERATION_COMPLETE
                elif free_first:
                    self._terminate(req)
                    req.finish_by_reason(FinishReason.CANCELLED)
                    return
                else:
                    req.finish_by_reason(FinishReason.CANCELLED)
                self._terminate(req)
                return

    def fail(self, rid: int) -> None:
        """An error mid-flight for request `rid` (`_handle_errors`): see `cancel(failed=True)`."""
        self.cancel(rid, failed=True)

    def preempt(self, rid: int) -> None:
        """The V2 scheduler preempts running request `rid` for pages, between two steps
        (scheduler_v2.py @ 38198e34582cf777ecc72062f477987284ba9999, `_preempt_or_defer`, from
        `_try_preempt_for_pages` for a context request and `_try_recompute_pause_for_gen` for a
        generation one): `kv_cache_manager.preempt_request(req)` (its own `free_resources`), then
        `draft_kv_cache_manager.free_resources(req)` called directly, and the victim joins
        `recompute_paused`. The executor then tears it down through every resource manager, the
        carry's included (`_terminate_recompute_paused_requests` -> `_free_request_resources` ->
        `resource_manager.free_resources(request)`, `py_executor.py` @
        0004396720054fd8e205cbf616f21f0b57c6b412; the V2 managers' free is a no-op for a request
        they no longer hold) and resets it (`_pause_recompute_paused_requests` ->
        `reset_for_recompute`): it is scheduled again as a context request under the same id, and
        its draft pages are fresh."""
        req = next(r for r in self.active if r.py_request_id == rid)
        self.target.preempt_request(req)
        if self.draft is not None:
            self.draft.free_resources(req)
        self.resource_manager.free_resources(req)  # _terminate_recompute_paused_requests
        req.reset_for_recompute()  # _pause_recompute_paused_requests
        self.active.remove(req)
        self.waiting.appendleft(req)

    def _terminate(self, req: LlmRequest) -> None:
        self.active.remove(req)
        self.resource_manager.free_resources(req)  # _terminate_request
        self.finished[req.py_request_id] = req

    def has_work(self) -> bool:
        return bool(self._queue or self.waiting or self.active)

    def run_until_done(self) -> None:
        """Iterate until no rank has work: every rank fetches on every iteration (its
        broadcast pairs with rank 0's), so all ranks stop after the same fetch."""
        while True:
            self._fetch_and_enqueue_requests()
            if not (self.waiting or self.active):
                return
            self._iteration()

    def _fetch_and_enqueue_requests(self) -> None:
        """Rank 0 drains its request queue; with several ranks `dist.broadcast` hands every rank
        the same items (`RequestBroadcaster._broadcast_requests`); new requests join the waiting
        queue and cancellations are applied, in queue order, on every rank."""
        mine, self._queue = self._queue, []
        items = [item for item, _ in mine]
        if self.dist is not None:
            items = self.dist.broadcast(items, root=0)
        local = {item.id: req for item, req in mine if req is not None}
        for item in items:
            if item.is_canceled_request:
                self._cancel(item.id)
            else:
                req = local.get(item.id)
                self.waiting.append(_request(item) if req is None else req)

    def check(self) -> None:
        """RuntimeError if pages or target caches are held with nothing running (a leak)."""
        if self.active:
            return
        tree = 0 if self.draft is None else sum(len(e.pages) for e in self.draft.tree.values())
        if self.paged.pages_in_use() != tree or self.paged.tables:
            raise RuntimeError(f"stand-in leaked pages: {self.paged.pages_in_use()} in use, "
                               f"{tree} held by the draft tree, tables {list(self.paged.tables)}")
        if self.target.caches:
            raise RuntimeError(f"stand-in leaked target caches {list(self.target.caches)}")

    # ---- the executor loop -----------------------------------------------------------------

    def step(self) -> list[LlmRequest]:
        """One iteration: fetch new requests, schedule, prepare resources, forward, update, free
        the finished."""
        self._fetch_and_enqueue_requests()
        return self._iteration()

    @torch.no_grad()
    def _iteration(self) -> list[LlmRequest]:
        while self.waiting and len(self.active) < self.max_batch:
            self._admit(self.waiting.popleft())
        batch = ScheduledRequests()
        for req in self.active:
            if req.state is LlmRequestState.CONTEXT_INIT:
                pos, c = req.context_current_position, self.chunk_size
                req.context_chunk_size = min(len(req.prompt), (pos // c + 1) * c) - pos
                batch.context_requests.append(req)
            else:
                batch.generation_requests.append(req)
        lagging, self._lagging = self._lagging, []
        self.resource_manager.prepare_resources(batch)
        for req in batch.context_requests:
            self._context_chunk(req)
        for req in batch.generation_requests:
            if any(req is r for r, _ in lagging):
                self._lag_step(req)
            else:
                self._generation_step(req)
        self.resource_manager.update_resources(batch)
        for req, reason in lagging:  # the overlap loop learns of the finish one step late
            req.finish_by_reason(reason)
        done = [r for r in self.active if r.is_finished]
        for req in done:
            self._terminate(req)
        return done

    def _admit(self, req: LlmRequest) -> None:
        self.target.prepare_expect_snapshot_points([req])  # before scheduling, as PyExecutor
        limit, tree = None, None
        if self.draft is not None and self.draft.paired:
            limit, tree = self.draft.match_depth(req)  # the target's reuse is capped at it
        entry = self.target.match(req, limit)
        if entry is not None and tree is not None:
            assert self.draft is not None
            self.draft.adopt_tree(req, tree, len(entry.tokens))
        self.target.prepare_context(req, entry)
        self.active.append(req)

    def _context_chunk(self, req: LlmRequest) -> None:
        s = req.context_current_position
        e = s + req.context_chunk_size
        cache = self.target.caches[req.py_request_id]
        ids = torch.tensor(req.prompt[s:e], dtype=torch.int64)
        hidden, logits = self.model.forward_target(ids, s, cache)
        last = e == len(req.prompt)
        golden = int(logits[-1].argmax()) if last else None
        nxt = req.prompt[s + 1:e] + ([golden] if last else [req.prompt[e]])
        if self.draft_len:
            self._write_rows(req, s, torch.tensor(nxt), hidden)  # keys [s, e), roped at k
        req.context_current_position = e
        self.target.try_commit_blocks(req)  # a snapshot point reached: commit up to it
        if not last:
            return
        assert golden is not None
        req.tokens.append(golden)
        req.state = LlmRequestState.GENERATION_IN_PROGRESS  # the sampler's first token
        if self.draft is not None:
            self.draft.commit_context(req)
        self._maybe_finish(req)
        if self.draft_len and not req.is_finished:
            req.py_draft_tokens = self._draft(req, hidden[-1:], torch.tensor([golden]), e - 1)

    def _generation_step(self, req: LlmRequest) -> None:
        n = len(req.tokens)
        cache = self.target.caches[req.py_request_id]
        drafts = req.py_draft_tokens
        ids = torch.tensor([req.tokens[-1], *drafts], dtype=torch.int64)
        hidden, logits = self.model.forward_target(ids, n - 1, cache, ssm_trace=bool(drafts))
        target = logits.argmax(-1).tolist()
        a = 0
        while a < len(drafts) and drafts[a] == target[a]:
            a += 1
        new = [*drafts[:a], target[a]]
        room = req.max_new_tokens - len(req.output)
        for j, token in enumerate(new):  # the first end id or stop token ends the turn
            if token == self._eos() or token in self.stop_token_ids:
                new = new[: j + 1]
                break
        new = new[:room]
        kept = len(new)
        if drafts:
            req.accepted += a
            req.verify_steps += 1
            req.drafted += len(drafts)
            cache.truncate(n - 1 + kept)  # positions n-1 .. n-2+kept computed and accepted
            for i, kind in enumerate(self.cfg.layer_types):
                if kind == "linear":
                    cache.set_ssm_state(i, cache.ssm_traces[i][kept - 1])
        req.tokens.extend(new)
        self._maybe_finish(req)
        if not self.draft_len:
            return
        # MTP-Eagle draft step 1 writes rows for every verified position (keys n-1 .. n-1+D),
        # those past the accepted tokens from rejected hiddens: junk a deposit must not keep
        pad = [target[j] for j in range(kept, len(ids))]
        nxt = (req.tokens[n:n + kept] + pad)[: len(ids)]
        self._write_rows(req, n - 1, torch.tensor(nxt), hidden)
        if not req.is_finished:
            last = len(req.tokens) - 2  # the last accepted pair key
            req.py_draft_tokens = self._draft(req, hidden[kept - 1:kept],
                                              torch.tensor([req.tokens[-1]]), last)

    def _write_rows(self, req: LlmRequest, lo: int, nxt: torch.Tensor, hidden: torch.Tensor) -> None:
        # nxt: [n] t_{k+1}; hidden: [n, H] hidden_k for keys lo .. lo + n - 1
        x, _, k, v = self._mtp_qkv(nxt, hidden, torch.arange(lo, lo + nxt.shape[0]))
        self.paged.write(req.py_request_id, lo, k[:, self.heads], v[:, self.heads])  # this rank's heads
        self._index(req, lo, x)

    def _index(self, req: LlmRequest, lo: int, x: torch.Tensor) -> None:
        # the QSA indexer's projection reads the attention's input (the layer norm of x), as qkv
        if self.indexer is not None:
            self.indexer.update(req.py_request_id, lo, self.model.drafter.input_layernorm(x))

    def _mtp_qkv(self, nxt: torch.Tensor, hidden: torch.Tensor, keys: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        d = self.model.drafter
        c = self.cfg
        x = d.project(nxt, hidden)
        q, k, v = d.self_attn.qkv(d.input_layernorm(x)[None])
        q = apply_rope_reference(q[0], keys, c.rotary_dim, c.rope_theta)  # roped at k, as TRT-LLM
        k = apply_rope_reference(k[0], keys, c.rotary_dim, c.rope_theta)
        return x, q, k, v[0]

    def _draft(self, req: LlmRequest, hidden: torch.Tensor, token: torch.Tensor, key: int) -> list[int]:
        """Draft `draft_len` tokens from pair key `key` = (token, hidden), attending pages [0, key]."""
        d = self.model.drafter
        out: list[int] = []
        h = hidden
        for j in range(self.draft_len):
            kk = key + j
            x, q, k, v = self._mtp_qkv(token, h, torch.tensor([kk]))
            if j:  # later draft steps write their own rows (over drafted tokens) at key + j
                self.paged.write(req.py_request_id, kk, k[:, self.heads], v[:, self.heads])
                self._index(req, kk, x)
            # a sliding-window pool's MTP layer reads keys [kk - window + 1, kk] (DeepSeek-V4's), else all
            lo = 0 if self.paged.window is None else max(0, kk + 1 - self.paged.window)
            rows_k, rows_v = self._all_heads(*self.paged.read(req.py_request_id, lo, kk + 1))
            dt = x.dtype
            h, logits = d.finish(x, q, rows_k.to(x.device, dt), rows_v.to(x.device, dt), torch.arange(lo, kk + 1),
                                 torch.tensor([kk]))
            token = logits.argmax(-1)
            out.append(int(token))
        return out

    def _all_heads(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every KV head's rows `[n, Hkv, D]` from this rank's shard `k`, `v` `[n, h, D]`: one rank
        holds them all; several gather the others' (`tp_allgather`), each head from the first
        rank holding it. The attention reads each head's rows from the rank that wrote them."""
        if self.dist is None:
            return k, v
        parts = self.dist.tp_allgather(torch.stack((k, v)).contiguous())  # per rank [2, n, h, D]
        cfg = self.cfg
        owners = [shard_heads(cfg.num_kv_heads, self.dist.tp_size, r) for r in range(self.dist.tp_size)]
        full = [next(p[:, :, hs.index(h)] for p, hs in zip(parts, owners, strict=True) if h in hs)
                for h in range(cfg.num_kv_heads)]
        rows = torch.stack(full, dim=2)  # [2, n, Hkv, D]
        return rows[0], rows[1]

    def _maybe_finish(self, req: LlmRequest) -> None:
        last = req.tokens[-1]
        reason = (FinishReason.END_ID if last == self._eos() else
                  FinishReason.STOP_WORDS if last in self.stop_token_ids else
                  FinishReason.LENGTH if len(req.output) >= req.max_new_tokens else None)
        if reason is None:
            return
        if self.overlap_scheduler:  # still GENERATION_IN_PROGRESS in the next step's batch
            self._lagging.append((req, reason))
        else:
            req.finish_by_reason(reason)  # the sampler's finish_by

    def _lag_step(self, req: LlmRequest) -> None:
        """The overlap scheduler's extra step of a request that already finished: its forward
        runs on its last token and stale drafts (draft rows of keys N - 1 .. N - 1 + D are
        written), and the sampler discards its tokens."""
        if not self.draft_len:
            return
        n = len(req.tokens)
        cache = self.target.caches[req.py_request_id]
        ids = torch.tensor([req.tokens[-1], *req.py_draft_tokens], dtype=torch.int64)
        # the request's target cache is dropped when it is freed after this step
        hidden, logits = self.model.forward_target(ids, n - 1, cache)
        self._write_rows(req, n - 1, logits.argmax(-1), hidden)

    def _eos(self) -> int:
        return self._eos_id


def _request(item: _QueueItem) -> LlmRequest:
    """The `LlmRequest` of a queue item (`executor_request_to_llm_request`): the same on every rank."""
    params = None if item.conversation_id is None else ConversationParams(conversation_id=item.conversation_id)
    return LlmRequest(item.id, list(item.prompt), item.max_new_tokens, params, item.cache_salt,
                      item.lora_task_id, is_dummy=item.dummy, py_client_id=item.client_id)
