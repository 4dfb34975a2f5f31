"""The reference engine: a hybrid MTP model served with prefix caching and
greedy speculative decoding, in plain torch, with in-flight batching.

What it is for: the embedded default (runs on a laptop CPU, or a GPU through
the same code) and the oracle every faster path is checked against. It
reproduces the situation the carry exists for: a warm turn restores an SSM
snapshot and reuses attention KV, so the target never recomputes the prefix
and the MTP drafter has no hidden states for it.

A sequence's life: admission (ticket, prefix match, resume plan, the carry
runtime's drafter plan: adopt or not, which keys to build) -> chunked prefill
(each chunk's hidden rows go to the hidden store under the ticket and that
chunk's drafter rows are built right away; SSM snapshots at chunk ends) ->
speculative steps (draft, verify in one target forward, accept greedily),
batched over every decoding sequence -> finish (prefix blocks and a turn-end
snapshot are cached; the drafter rows are deposited in the carry store or freed).

One `step()`:

```
  prefill seqs:  [chunk fwd -> rows]  [chunk fwd -> rows]  ...   one sequence per forward
  decode seqs:   [draft k, B rows per forward] -> [verify B x (1 + k) in one forward]
```

Invariants:
- Greedy speculative output equals plain greedy decoding per sequence, whatever
  the batch: the target verifies every draft; padding comes after each row's
  real tokens and is masked out of attention and never written, so a row sees
  only its own sequence; the recurrent state follows exactly the accepted path
  (the verify forward records the state after every position; the accepted
  one is kept). Attention writes are indexed by position, so rejection needs
  no rollback there.
- The drafter pool holds only real rows (pair keys whose hidden state came from
  the target); speculative draft rows live in each sequence's mirror for one
  step. After a verify of a drafting sequence of N tokens, its rows cover keys
  up to N - 2 (the next draft's first key included, built in the same batch).
- Drafter rows of a prefill chunk are read from the hidden store under the
  sequence's ticket in the same step that wrote them, so the carry is safe
  (armed) at any MTP dispatch cap.
- Only computed tokens are cached (never the last sampled one), and an SSM
  snapshot is restored only at a depth of at least `marconi_min_tokens()`.
- Admission reserves every target block a request will hold; anything `submit`
  accepts fits an idle engine, so the queue never wedges.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ..core import marconi_min_tokens, set_mtp_max_seqs
from ..core.session import carry_key, session_hash
from ..dataplane.device_ints import device_tensor
from ..dataplane.hidden_store import HiddenStore
from ..dataplane.kv_pool import DrafterKVPool, PoolExhaustedError
from ..dataplane.rope import RopeConfig, apply_rope_reference
from ..dataplane.warm import warm_pool_kernels
from ..runtime.carry_runtime import CarryRuntime, DrafterBuild
from ..runtime.policy import DrafterPolicy
from .block_manager import PrefixMatch, TargetBlockManager
from .config import DTYPES, MAX_DRAFT_LEN, EngineConfig
from .model import HybridLM
from .paired_drafts import PairedBuild, PairedDraftPool, PairedDrafts, PairedPlan
from .prefix_hash import ROOT_HASH, CacheSalt, PrefixKeys, salt_root
from .snapshot_cache import ResumePlan, SnapshotCache, plan_resume
from .target_kv import BatchKV, PagedTargetKV, SequenceKV
from .tokenizer import ChatTokenizer
from .turn import TurnResult, TurnStats

__all__ = ["EngineConfig", "ReferenceEngine", "TurnResult", "TurnStats"]

logger = logging.getLogger("trtllm_mtp_carry")

Prompt = Sequence[int] | Sequence[dict[str, str]] | str


@dataclass
class _Sequence:
    request_id: int
    session_id: str | int | None
    session_hash: int
    carry_key: int  # carry_key(session_hash, cache_salt): the carry store's key
    ticket: int
    policy: DrafterPolicy
    draft_len: int
    max_new_tokens: int
    prompt: list[int]
    tokens: list[int]
    keys: PrefixKeys
    kv: SequenceKV
    stats: TurnStats
    t_admit: float
    build: DrafterBuild | PairedBuild  # the admission plan for the drafter rows, filled per chunk
    phase: str = "prefill"  # prefill -> decode
    last_hidden: torch.Tensor | None = None  # [H]: hidden of the newest computed position
    finish_reason: str = ""
    mirror: _RowMirror | None = None  # the drafter's rows in the model dtype, for attention
    drafter_off: bool = False  # the drafter pool ran out: decode on without drafts
    prep_clock: _PrepClock = field(default_factory=lambda: _PrepClock(torch.device("cpu")))  # prep's GPU time

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.prompt)


class _PrepClock:
    """A turn's drafter prep time as the GPU spends it (CUDA): timing events recorded on the
    current stream around each prep call (admission, each chunk's rows), where the prep's
    kernels and its waits (a host restore's copy back, `HostTier.ready`) are queued, so
    a span is what the prep adds to the stream, not the CPU's enqueue time. On the CPU there
    is no stream: `ms` gives the caller's CPU wall time back."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def span(self) -> Iterator[None]:
        if not self._cuda:
            yield
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            yield
        finally:
            end.record()
            self._events.append((start, end))

    def ms(self, cpu_ms: float) -> float:
        """The spans' GPU milliseconds (CUDA: waits for their last event, a no-op once the
        stream was synchronized), else `cpu_ms`."""
        if not self._cuda:
            return cpu_ms
        if self._events:
            self._events[-1][1].synchronize()
        return sum(a.elapsed_time(b) for a, b in self._events)


class _RowMirror:
    """A sequence's drafter rows as dense model-dtype tensors, grown in place.

    The drafter attends to every row at every draft step; reading them back
    from the paged bf16 pool each step would copy all rows each time, so only
    rows the pool gained since the last step are read (the pool stays the
    owner; this is a cache of its contents for one live sequence).
    """

    def __init__(self, capacity: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.k = torch.empty(capacity, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.empty(capacity, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.keys = torch.empty(capacity, dtype=torch.int64, device=device)
        self.rows = 0

    def sync(self, pool: DrafterKVPool | PairedDraftPool, seq_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Read the rows the pool gained; return views `(k, v, keys)` of every row."""
        k, v, keys = pool.gather(seq_id, start_row=self.rows)
        end = self.rows + keys.shape[0]
        self.k[self.rows:end], self.v[self.rows:end], self.keys[self.rows:end] = k, v, keys
        self.rows = end
        return self.k[:end], self.v[:end], self.keys[:end]


@dataclass
class _Request:
    request_id: int
    session_id: str | int | None
    session_hash: int
    prompt: list[int]
    max_new_tokens: int
    draft_len: int
    policy: DrafterPolicy
    root: int = ROOT_HASH  # prefix key root: ROOT_HASH, or salt_root(cache_salt)
    carry_key: int = 0  # carry_key(session_hash, cache_salt): rows carry only within the salt
    # the prompt as int64 when submit built it to check the ids: the carry decision compares it
    # with the entry's tokens in typed memory (a list compare of fresh ints is ~80x slower)
    buffer: array[int] | None = None


class ReferenceEngine:
    """Greedy speculative decoding of a hybrid MTP model with prefix caching and the carry."""

    def __init__(self, model: HybridLM, tokenizer: ChatTokenizer, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        cfg = model.cfg
        self.max_model_len = config.max_model_len or cfg.max_position
        if self.max_model_len > cfg.max_position:
            raise ValueError(
                f"EngineConfig.max_model_len={self.max_model_len} exceeds the model's "
                f"max_position={cfg.max_position}"
            )
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self.tokenizer = tokenizer
        if not set_mtp_max_seqs(config.mtp_max_seqs):
            from ..core import mtp_max_seqs

            if mtp_max_seqs() != config.mtp_max_seqs:
                logger.warning(
                    "mtp_max_seqs already pinned to %d for this process; engine asked for %d",
                    mtp_max_seqs(), config.mtp_max_seqs,
                )
        self.target_kv = PagedTargetKV(cfg, config.num_target_blocks, config.block_size,
                                       self.dtype, self.device)
        self.blocks = TargetBlockManager(config.num_target_blocks, config.block_size)
        self.snapshots: SnapshotCache[list[torch.Tensor | None]] = SnapshotCache(
            int(config.snapshot_budget_mb * 2**20), config.block_size)
        # Positions past the store's capacity are not captured (as with a fixed-size
        # mtp_prefill_hidden buffer); a span they cut short gets no drafter rows.
        capacity = config.hidden_capacity or self.max_model_len
        self._store = HiddenStore(capacity, cfg.hidden_size, device=self.device)
        self._pool = DrafterKVPool(
            config.num_drafter_blocks, config.drafter_block_size, cfg.num_kv_heads, cfg.head_dim,
            RopeConfig(cfg.head_dim, cfg.rotary_dim, cfg.rope_theta), device=self.device,
        )
        if config.carry_host_only:  # one device slot; the host tier holds what the pool could
            self.runtime = CarryRuntime(self, config.policy, slots=1, host_memory=self._pool.nbytes,
                                        row_dtype=config.carry_row_dtype)
        else:
            self.runtime = CarryRuntime(self, config.policy, row_dtype=config.carry_row_dtype)
        # every Triton variant this engine's appends (and fp8/nvfp4 packs and unpacks) will
        # launch, compiled now, never inside a timed turn (CUDA with Triton; 0 launches elsewhere)
        warm_pool_kernels(self._pool, self.runtime.service.home.codec)
        self._paired: PairedDrafts | None = None  # built on the first `paired` request
        self.drafter_blocks_peak = 0  # most drafter blocks held after any step, every pool
        self._waiting: list[_Request] = []
        self._running: list[_Sequence] = []
        self._finished: list[TurnResult] = []
        self._next_request_id = 1

    @classmethod
    def from_pretrained(cls, path: str | Path | None = None, **config: Any) -> ReferenceEngine:
        """An engine over the shipped reference weights (or the weights in `path`)."""
        from .model import load_reference

        model, tokenizer = load_reference(path=path)
        return cls(model, tokenizer, EngineConfig(**config))

    # ---- the backend interface the carry runtime uses -----------------------------

    @property
    def drafter_pool(self) -> DrafterKVPool:
        return self._pool

    @property
    def hidden_store(self) -> HiddenStore:
        return self._store

    @torch.no_grad()
    def drafter_kv(self, next_tokens: torch.Tensor, hidden: torch.Tensor,
                   keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # next_tokens: [n] int64; hidden: [n, H] bf16; keys: [n] -> k, v [n, Hkv, D] bf16
        drafter = self.model.drafter
        x = drafter.project(next_tokens, hidden.to(self.dtype))
        _, k, v = drafter.qkv(x, keys)
        return k.to(self._pool.k_cache.dtype), v.to(self._pool.v_cache.dtype)

    @property
    def paired(self) -> PairedDrafts:
        """The `paired` policy's drafter pool and tree (`paired_drafts`), created on first use
        with `num_drafter_blocks` blocks of its own: the draft pool TensorRT-LLM pairs."""
        if self._paired is None:
            cfg, c = self.model.cfg, self.config
            pool = PairedDraftPool(c.num_drafter_blocks, c.block_size, cfg.num_kv_heads, cfg.head_dim,
                                   RopeConfig(cfg.head_dim, cfg.rotary_dim, cfg.rope_theta),
                                   device=self.device)
            self._paired = PairedDrafts(self, pool)
        return self._paired

    def drafter_blocks_held(self) -> int:
        """Drafter blocks not free now: live rows, carried entries and the paired tree."""
        held = self._pool.num_blocks - self._pool.num_free_blocks
        return held + (self._paired.pool.blocks_held() if self._paired is not None else 0)

    def _rows_of(self, seq: _Sequence) -> DrafterKVPool | PairedDraftPool:
        """The pool that holds `seq`'s drafter rows."""
        return self.paired.pool if seq.policy is DrafterPolicy.PAIRED else self._pool

    def _planner(self, seq: _Sequence) -> CarryRuntime | PairedDrafts:
        """Who builds and releases `seq`'s drafter rows."""
        return self.paired if seq.policy is DrafterPolicy.PAIRED else self.runtime

    # ---- requests -----------------------------------------------------------------

    def submit(self, session_id: str | int | None, prompt: Prompt, max_new_tokens: int = 128,
               draft_len: int | None = None, policy: DrafterPolicy | str | None = None,
               cache_salt: CacheSalt | None = None) -> int:
        """Queue a request; returns its id. Bad input raises ValueError/TypeError naming it.

        `cache_salt` (a non-empty str or bytes, as vLLM's and TensorRT-LLM's
        `cache_salt`) puts the request's KV blocks and SSM snapshots in that
        salt's namespace: it reuses only what requests with the same salt cached,
        and its carried drafter rows too (`carry_key`): a session under a new salt
        starts fresh. None is the shared unsalted namespace.

        A request is refused here when it can never fit: its prompt, answer and
        drafts past `max_model_len`, or more target KV blocks than the engine has.
        Anything accepted fits in an idle engine, so nothing queued waits forever.
        """
        tokens, buffer = self._prompt_tokens(prompt)
        root = salt_root(cache_salt)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        draft_len = self.config.draft_len if draft_len is None else draft_len
        if isinstance(draft_len, bool) or not isinstance(draft_len, int) or not 0 <= draft_len <= MAX_DRAFT_LEN:
            raise ValueError(f"draft_len must be an int in [0, {MAX_DRAFT_LEN}], got {draft_len!r}")
        total = len(tokens) + max_new_tokens + draft_len
        if total > self.max_model_len:
            raise ValueError(
                f"prompt of {len(tokens)} tokens + max_new_tokens={max_new_tokens} + "
                f"draft_len={draft_len} exceeds max_model_len={self.max_model_len}"
            )
        needed = self.blocks.num_blocks_for(total)
        if needed > self.config.num_target_blocks:
            raise ValueError(
                f"the request needs {needed} KV blocks, the engine has {self.config.num_target_blocks}"
            )
        h = 0 if session_id is None else session_hash(session_id)
        chosen = self.config.policy if policy is None else DrafterPolicy.parse(policy)
        assert isinstance(chosen, DrafterPolicy)
        rid = self._next_request_id
        self._next_request_id += 1
        self._waiting.append(_Request(rid, session_id, h, tokens, max_new_tokens, draft_len, chosen,
                                      root, carry_key(h, cache_salt), buffer))
        return rid

    def generate(self, session_id: str | int | None, prompt: Prompt, max_new_tokens: int = 128,
                 draft_len: int | None = None, policy: DrafterPolicy | str | None = None,
                 cache_salt: CacheSalt | None = None) -> TurnResult:
        """Run one request to completion (other queued requests advance too); see `submit`."""
        rid = self.submit(session_id, prompt, max_new_tokens, draft_len, policy, cache_salt)
        while True:
            for result in self.step():
                if result.request_id == rid:
                    return result
                self._finished.append(result)

    def cancel(self, request_id: int) -> TurnResult | None:
        """Stop a queued or running request now and free everything it holds.

        Its drafter rows are not lost: they go back to the carry store
        (`CarryRuntime.cancel`), so the session's next turn still adopts them.
        The other running sequences are untouched: each owns its own blocks,
        drafter rows and states, and the next batched step simply leaves this one out.
        """
        for i, req in enumerate(self._waiting):
            if req.request_id == request_id:
                del self._waiting[i]
                return TurnResult(request_id, req.session_id, req.prompt, [], "", "cancelled",
                                  TurnStats(prompt_tokens=len(req.prompt)))
        for seq in self._running:
            if seq.request_id == request_id:
                self._running.remove(seq)
                if seq.policy is DrafterPolicy.PAIRED:
                    self.paired.release(seq.request_id)
                else:  # a cancelled turn keeps the session's carry (its rows are valid)
                    self.runtime.cancel(seq.request_id, seq.carry_key, seq.tokens, seq.policy,
                                        seq.ticket, seq.session_hash, self._share_keys(seq))
                self.blocks.free(seq.request_id)
                return self._result(seq, "cancelled")
        return None

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def output_so_far(self, request_id: int) -> list[int] | None:
        """The tokens a running request has produced so far (`[]` while queued or in
        prefill), or None for an id that is neither queued nor running. For streaming:
        call after each `step()` and send what is new; only verified tokens appear."""
        for seq in self._running:
            if seq.request_id == request_id:
                return seq.tokens[len(seq.prompt):]
        if any(req.request_id == request_id for req in self._waiting):
            return []
        return None

    def drain_finished(self) -> list[TurnResult]:
        """Results that finished while `generate` waited for another request."""
        out, self._finished = self._finished, []
        return out

    def step(self) -> list[TurnResult]:
        """One unit of work for every running sequence.

        Each sequence in prefill runs one chunk (its drafter rows for that chunk
        are built right after); every sequence already decoding takes one
        speculative step, all of them in one batched draft and one batched verify.
        """
        self._admit()
        finished = []
        decoding = [seq for seq in self._running if seq.phase == "decode"]
        for seq in [seq for seq in self._running if seq.phase == "prefill"]:
            self._prefill_chunk(seq)
            if seq.phase == "decode" and seq.finish_reason:  # the first token ended the turn
                self._running.remove(seq)
                finished.append(self._finish(seq))
        if decoding:
            for seq in self._decode_batch(decoding):
                self._running.remove(seq)
                finished.append(self._finish(seq))
        self.drafter_blocks_peak = max(self.drafter_blocks_peak, self.drafter_blocks_held())
        return finished

    def check(self) -> None:
        """Prove the pools' ownership invariants; with nothing running, that nothing leaked."""
        self.blocks.check()
        self._pool.check()
        if self._paired is not None:
            self._paired.check()
        if not self._running:
            if self._paired is not None and self._paired.pool.num_live:
                raise RuntimeError(f"paired draft pool holds {self._paired.pool.num_live} sequences "
                                   "with nothing running")
            if self._pool.stats().num_sequences:
                raise RuntimeError(f"drafter pool holds sequences with nothing running: {self._pool.stats()}")
            if self.blocks.stats().num_used:
                raise RuntimeError(f"target blocks in use with nothing running: {self.blocks.stats()}")

    # ---- admission and prefill -----------------------------------------------------

    def _prompt_tokens(self, prompt: Prompt) -> tuple[list[int], array[int] | None]:
        """The prompt's token ids, and as int64 when given as ids (built to check them)."""
        buffer = None
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if not isinstance(prompt, Sequence) or isinstance(prompt, (bytes, bytearray)):
            raise TypeError(f"prompt must be messages, token ids or a string, got {type(prompt).__name__}")
        if len(prompt) == 0:
            raise ValueError("prompt is empty")
        if all(isinstance(m, dict) for m in prompt):
            messages: list[dict[str, str]] = list(prompt)  # type: ignore[arg-type]
            for m in messages:
                if (set(m) != {"role", "content"} or not isinstance(m["role"], str)
                        or not isinstance(m["content"], str)):
                    raise ValueError(f"a message needs a string role and a string content, got {m!r}")
            tokens = self.tokenizer.render_chat(messages)
        else:
            tokens = list(prompt)  # type: ignore[arg-type]
            vocab = self.model.cfg.vocab_size
            try:  # C-speed checks: array() refuses non-ints (not bools), min/max bound the ids
                ids = array("q", tokens)
                ok = bool not in map(type, tokens) and min(ids) >= 0 and max(ids) < vocab
            except (TypeError, OverflowError):
                ok = False
            if not ok:  # only now look for the offending ids, to name them
                bad = [t for t in tokens if isinstance(t, bool) or not isinstance(t, int)
                       or not 0 <= t < vocab]
                raise ValueError(f"token ids must be ints in [0, {vocab}); got {bad[:5]}")
            buffer = ids  # the same ids as `tokens`, as int64
        return tokens, buffer

    def _admit(self) -> None:
        """Admit queued requests in order while a sequence slot and their blocks are free.

        A warm plan pins its shared blocks and the copy-on-write source while it
        draws new ones, so it may not fit even in an idle engine; then the request
        is admitted cold (no reuse), which always fits an idle engine (`submit`
        refused anything larger). With sequences running it waits for them.
        """
        bs = self.config.block_size
        while self._waiting and len(self._running) < self.config.max_num_seqs:
            req = self._waiting[0]
            keys = PrefixKeys(req.prompt, bs, req.root)
            match = self.blocks.match_prefix(keys)
            plan = plan_resume(keys, match, self.snapshots.best_for, marconi_min_tokens())
            warm = plan.restore  # the other policies would resume at plan.depth
            paired: PairedPlan | None = None
            if req.policy is DrafterPolicy.PAIRED:  # resume no deeper than the drafter tree holds
                paired = self.paired.plan(keys, req.prompt, match.num_tokens, plan,
                                          self.snapshots.best_for, marconi_min_tokens())
                plan = paired.resume
            trimmed = match.trimmed(plan.depth)
            if req.policy is DrafterPolicy.REBUILD and warm:  # one target pass from position 0
                plan, trimmed = ResumePlan(0, False, "rebuild: recompute from 0"), PrefixMatch.empty(bs)
            # reserve the answer's slots now, so decoding never runs out of blocks
            reserve = req.max_new_tokens + req.draft_len
            total = len(req.prompt) + reserve
            if self.blocks.can_allocate(total, trimmed) is None:
                if self._running:
                    return  # wait for running sequences to free blocks
                plan = ResumePlan(0, False, "the warm plan cannot fit: admitted cold")
                trimmed = PrefixMatch.empty(bs)
                if self.blocks.can_allocate(total, trimmed) is None:  # submit's check prevents it
                    raise RuntimeError(f"request {req.request_id} cannot fit in an idle engine")
            self._waiting.pop(0)
            alloc = self.blocks.allocate(req.request_id, req.prompt, trimmed, keys.root)
            for src, dst in alloc.copies:
                self.target_kv.copy_block(src, dst)
            table = [*alloc.block_table, *self.blocks.append_slots(req.request_id, reserve)]
            kv = SequenceKV(self.target_kv, table, alloc.num_cached_tokens)
            if plan.restore:
                assert plan.snapshot is not None
                kv.restore_ssm(plan.snapshot)
            stats = TurnStats(prompt_tokens=len(req.prompt), reused_tokens=alloc.num_cached_tokens,
                              snapshot_restored=plan.restore, policy=req.policy.value)
            ticket = self.runtime.draw_ticket()
            build: DrafterBuild | PairedBuild
            prep_clock = _PrepClock(self.device)
            with prep_clock.span():
                if paired is not None:
                    build = self.paired.prepare(req.request_id, ticket, req.prompt,
                                                alloc.num_cached_tokens, paired, warm)
                    stats.drafter_tree_tokens = paired.found.tokens
                    stats.drafter_depth_lost = paired.depth_lost if warm else 0
                    stats.recomputed_for_cap = paired.recomputed_for_cap if warm else 0
                else:
                    build = self.runtime.prepare(req.request_id, ticket, req.carry_key,
                                                 req.prompt if req.buffer is None else req.buffer,
                                                 alloc.num_cached_tokens, req.policy, warm=warm,
                                                 session=req.session_hash)
            # the turn's outcome is decided here, at admission (the runtime counts it here too):
            # a turn cancelled later, or whose drafter is dropped, keeps it
            stats.outcome_kind = build.outcome.kind if build.outcome else build.mode
            stats.no_carry_reason = getattr(build.outcome, "reason", "")  # NoCarry's, else ""
            # the rows it adopted are its from here (the runtime counted them in rows_adopted):
            # a turn stopped mid-prefill reports them too, not 0
            stats.drafter_rows_kept = build.rows_kept
            seq = _Sequence(
                req.request_id, req.session_id, req.session_hash, req.carry_key, ticket,
                req.policy, req.draft_len, req.max_new_tokens, req.prompt, list(req.prompt), keys,
                kv, stats, time.perf_counter(), build=build, prep_clock=prep_clock,
            )
            self._running.append(seq)

    @torch.no_grad()
    def _prefill_chunk(self, seq: _Sequence) -> None:
        t0 = time.perf_counter()
        chunk = self.config.prefill_chunk
        start = seq.kv.num_tokens
        end = min(len(seq.prompt), (start // chunk + 1) * chunk)  # chunk ends on chunk multiples
        # pinned and non-blocking: a pageable upload waits for the stream (the previous chunk's
        # drafter rows), billing their GPU time to this chunk's target forward
        ids = device_tensor(seq.prompt[start:end], torch.int64, self.device)
        hidden, logits = self.model.forward_target(ids, start, seq.kv)
        seq.kv.advance(end - start)
        self._capture_hiddens(seq.ticket, start, hidden)
        t_rows = time.perf_counter()
        build = seq.build
        if build.next_key is not None and not seq.drafter_off:
            # this chunk's drafter rows, while the store rows are still this ticket's
            try:
                with seq.prep_clock.span():
                    self._planner(seq).build_chunk(seq.request_id, seq.ticket, build,  # type: ignore[arg-type]
                                                   seq.prompt, start, end)
            except PoolExhaustedError as exc:
                self._drop_drafter(seq, exc)
                build.mode, build.outcome, build.next_key = "exhausted", None, None
        t_done = time.perf_counter()
        self.blocks.commit_full_blocks(seq.request_id, seq.prompt[:end])
        if end < len(seq.prompt) and end % chunk == 0:
            self._put_snapshot(seq.keys, end, seq.kv)
        seq.stats.prefill_ms += (t_rows - t0 + time.perf_counter() - t_done) * 1e3
        if end == len(seq.prompt):
            seq.last_hidden = hidden[-1]
            seq.tokens.append(int(logits[-1].argmax()))
            seq.phase = "decode"
            seq.finish_reason = self._stop_reason(seq)
            prep = build.prep()
            s = seq.stats
            s.outcome = prep.describe()  # an exhausted pool shows here; outcome_kind stays admission's
            s.drafter_rows_kept = prep.rows_kept
            s.drafter_rows_computed = prep.rows_computed
            s.keys_skipped = prep.keys_skipped
            s.drafter_prep_ms = seq.prep_clock.ms(prep.prep_ms)  # the first token's read synced the stream
            s.ttft_ms = (time.perf_counter() - seq.t_admit) * 1e3

    def _capture_hiddens(self, ticket: int, start: int, hidden: torch.Tensor) -> None:
        # hidden: [T, H] at positions start ..; rows past the store's capacity are dropped
        fit = min(hidden.shape[0], self._store.capacity - start)
        if fit > 0:
            self._store.write(ticket, start, hidden[:fit].to(torch.bfloat16))

    def _put_snapshot(self, keys: PrefixKeys, depth: int, kv: SequenceKV) -> None:
        self.snapshots.put(keys, depth, kv.snapshot_ssm(), kv.ssm_nbytes())

    # ---- decoding ------------------------------------------------------------------

    def _stop_reason(self, seq: _Sequence) -> str:
        if seq.tokens[-1] == self.tokenizer.eos_id:
            return "stop"
        if seq.num_output >= seq.max_new_tokens:
            return "length"
        return ""

    @torch.no_grad()
    def _decode_batch(self, seqs: list[_Sequence]) -> list[_Sequence]:
        """One speculative step for every sequence in `seqs`, batched; returns those done.

        Each sequence's decode time counts the whole batched step (it waited that long).
        """
        t0 = time.perf_counter()
        drafting = [s for s in seqs if s.policy.drafts and s.draft_len > 0 and not s.drafter_off]
        drafts = self._draft_batch(drafting) if drafting else {}
        self._verify_batch(seqs, drafts)
        ms = (time.perf_counter() - t0) * 1e3
        for s in seqs:
            s.stats.decode_ms += ms
        return [s for s in seqs if s.finish_reason]

    def _draft_batch(self, seqs: list[_Sequence]) -> dict[int, list[int]]:
        """Propose up to `draft_len` tokens per sequence, all sequences in one forward per draft.

        Each sequence's first draft key (n - 2) gets a real row in the pool; later
        draft keys get speculative rows in its mirror's spare room, never in the pool.
        """
        drafter = self.model.drafter
        cfg = self.model.cfg
        dev = self.device
        key0 = torch.tensor([len(s.tokens) - 2 for s in seqs], dtype=torch.int64, device=dev)
        hidden = torch.stack([s.last_hidden for s in seqs if s.last_hidden is not None])
        hidden = hidden.to(torch.bfloat16).to(self.dtype)  # as the store rounds it
        token = torch.tensor([s.tokens[-1] for s in seqs], dtype=torch.int64, device=dev)
        x = drafter.project(token, hidden)
        q, k, v = drafter.qkv(x, key0)
        k16, v16 = k.to(torch.bfloat16), v.to(torch.bfloat16)
        live: list[int] = []
        for b, s in enumerate(seqs):  # bookkeeping per sequence: its own pool rows
            try:
                self.runtime.wait_restored(s.request_id)  # rows copied back from the host tier
                last = self._rows_of(s).sequence(s.request_id).last_pair_key
                if last is None or last < len(s.tokens) - 2:  # first step: key0's row (later
                    # steps got it from the previous verify)
                    self._rows_of(s).append_rows(s.request_id, range(len(s.tokens) - 2, len(s.tokens) - 1),
                                                 k16[b:b + 1], v16[b:b + 1])  # key0[b], known on the host
            except Exception as exc:  # the pool ran out, or a fault inside the carry
                self._drop_drafter(s, exc)
                continue
            live.append(b)
        if not live:
            return {}
        if len(live) < len(seqs):
            idx = torch.tensor(live, device=dev)
            seqs = [seqs[b] for b in live]
            key0, hidden, token, x, q = (t.index_select(0, idx) for t in (key0, hidden, token, x, q))
        mirrors, real = [], []
        for s in seqs:
            if s.mirror is None:  # every key of the prompt and the answer fits
                capacity = len(s.prompt) + s.max_new_tokens + MAX_DRAFT_LEN + 1
                s.mirror = _RowMirror(capacity, cfg.num_kv_heads, cfg.head_dim, self.dtype, dev)
            real.append(s.mirror.sync(self._rows_of(s), s.request_id)[2].shape[0])
            mirrors.append(s.mirror)
        out: list[list[int]] = []
        h_out, keys = hidden, key0  # each later draft reads the drafter's own output hidden
        for j in range(max(s.draft_len for s in seqs)):
            if j:  # speculative rows (drafted token, drafter hidden) past each mirror's real rows
                keys = key0 + j
                x = drafter.project(token, h_out)
                q, k, v = drafter.qkv(x, keys)
                k_roped = apply_rope_reference(k.to(torch.bfloat16), keys + 1, cfg.rotary_dim,
                                               cfg.rope_theta)
                v16 = v.to(torch.bfloat16)
                for b, m in enumerate(mirrors):
                    row = real[b] + j - 1
                    m.k[row], m.v[row], m.keys[row] = k_roped[b], v16[b], keys[b]
            rows = [(m.k[:real[b] + j], m.v[:real[b] + j], m.keys[:real[b] + j])
                    for b, m in enumerate(mirrors)]
            h_out, logits = drafter.finish_batch(x, q, rows, keys)
            token = logits.argmax(-1)
            out.append(token.tolist())
        drafts: dict[int, list[int]] = {}
        for b, s in enumerate(seqs):
            drafts[s.request_id] = [step[b] for step in out[: s.draft_len]]
            s.stats.drafted += s.draft_len
        return drafts

    def _verify_batch(self, seqs: list[_Sequence], drafts: dict[int, list[int]]) -> None:
        """One target forward over each sequence's newest token and drafts; keep each accepted path.

        Sets each sequence's `finish_reason` ("stop", "length") or leaves it "".
        """
        inputs = [[s.tokens[-1], *drafts.get(s.request_id, ())] for s in seqs]
        lengths = [len(i) for i in inputs]
        T = max(lengths)
        ids = torch.tensor([i + [0] * (T - len(i)) for i in inputs], dtype=torch.int64,
                           device=self.device)
        hidden, logits = self.model.forward_target_batch(ids, BatchKV([s.kv for s in seqs], lengths))
        target = logits.argmax(-1)  # [B, T]: the target's greedy token after each input
        if T > 1:  # accepted drafts: the leading run where draft j equals target j
            real = torch.arange(1, T, device=self.device)[None, :] < torch.tensor(
                lengths, device=self.device)[:, None]
            match = (ids[:, 1:] == target[:, :-1]) & real
            accepted = match.long().cumprod(1).sum(1).tolist()
        else:
            accepted = [0] * len(seqs)
        target_ids = target.tolist()
        eos = self.tokenizer.eos_id
        row_seqs: list[tuple[_Sequence, int, int, int]] = []  # (seq, batch row, first key, rows)
        for b, s in enumerate(seqs):  # bookkeeping per sequence (at most 4 tokens each)
            d = inputs[b][1:]
            a = accepted[b]
            new = [*d[:a], target_ids[b][a]]
            room = s.max_new_tokens - s.num_output
            stop = new.index(eos) if eos in new else len(new)
            if stop < room:
                new, s.finish_reason = new[:stop + 1], "stop" if stop < len(new) else ""
            else:
                new, s.finish_reason = new[:room], "length" if room <= len(new) else ""
            n = len(s.tokens)
            kept = len(new)
            s.kv.advance(lengths[b])
            s.kv.rewind(n - 1 + kept, trace_index=kept - 1)  # [0, n - 1 + kept) computed
            s.tokens.extend(new)
            s.last_hidden = hidden[b, kept - 1]
            if d:
                s.stats.accepted += a
                s.stats.verify_steps += 1
            if d and not s.drafter_off:  # real rows for keys n-1 .. n+kept-2: the accepted
                row_seqs.append((s, b, n - 1, kept))  # positions and the next draft's key0
        if row_seqs:
            self._append_real_rows_batch(row_seqs, hidden)

    def _append_real_rows_batch(self, row_seqs: list[tuple[_Sequence, int, int, int]],
                                hidden: torch.Tensor) -> None:
        """Real drafter rows for accepted positions of several sequences, in one forward."""
        # hidden: [B, T, H]; row_seqs: (seq, batch row, first key, number of rows)
        dev = self.device
        h = torch.cat([hidden[b, :m] for _, b, _, m in row_seqs])
        keys = torch.cat([torch.arange(k0, k0 + m, device=dev) for _, _, k0, m in row_seqs])
        nxt = torch.tensor([t for s, _, k0, m in row_seqs for t in s.tokens[k0 + 1:k0 + 1 + m]],
                           dtype=torch.int64, device=dev)
        k, v = self.drafter_kv(nxt, h.to(torch.bfloat16), keys)
        at = 0
        for s, _, k0, m in row_seqs:
            try:
                self._rows_of(s).append_rows(s.request_id, range(k0, k0 + m), k[at:at + m], v[at:at + m])
            except Exception as exc:  # the pool ran out, or a fault inside the carry
                self._drop_drafter(s, exc)
            at += m

    def _drop_drafter(self, seq: _Sequence, why: Exception) -> None:
        """The drafter pool ran out, or a drafter-row append faulted inside the carry (the store's
        eviction ranking, the data plane, the host moves): free this sequence's rows and decode
        on without drafts.

        Drafts only ever cost acceptance, so output is unchanged; the turn
        deposits nothing, and the pool is left consistent (a refused grow
        changes nothing; after a fault the carry service's `repair` frees what no
        one holds). A fault is the turn's (`CarryRuntime.note_fault`: counted by step
        and class, logged once per (step, class)), never the step's; the paired pool's is raised.
        """
        exhausted = isinstance(why, PoolExhaustedError)
        if not exhausted:
            if seq.policy is DrafterPolicy.PAIRED:
                raise why
            self.runtime.note_fault(seq.request_id, "append", why)
        else:
            logger.warning("request %d: drafter off for the rest of the turn: %s", seq.request_id, why)
        if seq.policy is DrafterPolicy.PAIRED:
            self.paired.release(seq.request_id)
        else:
            self.runtime.release(seq.request_id, "pool_pressure")
        seq.drafter_off, seq.mirror = True, None

    def _append_real_rows(self, seq: _Sequence, first_key: int, hidden: torch.Tensor) -> None:
        # hidden: [m, H] target hidden states for keys first_key .. first_key + m - 1
        m = hidden.shape[0]
        keys = torch.arange(first_key, first_key + m, dtype=torch.int64, device=self.device)
        next_tokens = torch.tensor(seq.tokens[first_key + 1:first_key + 1 + m], dtype=torch.int64,
                                   device=self.device)
        k, v = self.drafter_kv(next_tokens, hidden.to(torch.bfloat16), keys)
        self._rows_of(seq).append_rows(seq.request_id, range(first_key, first_key + m), k, v)

    # ---- finish --------------------------------------------------------------------

    def _finish(self, seq: _Sequence) -> TurnResult:
        computed = seq.kv.num_tokens  # every token but the newest
        if self._rows_of(seq).has_sequence(seq.request_id) and seq.last_hidden is not None:
            # the newest real key (n - 2) so the carried rows cover every key of the turn
            last_key = len(seq.tokens) - 2
            rows = self._rows_of(seq).sequence(seq.request_id)
            if rows.last_pair_key is None or rows.last_pair_key < last_key:
                try:
                    self._append_real_rows(seq, last_key, seq.last_hidden[None])
                except Exception as exc:  # the pool ran out, or a fault inside the carry
                    self._drop_drafter(seq, exc)
        if seq.policy is DrafterPolicy.PAIRED:  # publish the rows to the drafter tree
            self.paired.finish(seq.request_id, seq.tokens, seq.keys.root)
        else:
            self.runtime.finish(seq.request_id, seq.carry_key, seq.tokens, seq.policy, seq.ticket,
                                seq.session_hash, self._share_keys(seq))
        done = seq.tokens[:computed]
        self._put_snapshot(PrefixKeys(done, self.config.block_size, seq.keys.root), computed, seq.kv)
        self.blocks.free(seq.request_id, done)
        return self._result(seq, seq.finish_reason)

    def _share_keys(self, seq: _Sequence) -> PrefixKeys:
        """Prefix keys of `seq`'s tokens at the drafter's block size, in its salt's namespace:
        where its carried blocks may be shared with other entries' equal ones (lazy: the
        runtime hashes only blocks it shares, and only when it carries and shares)."""
        return PrefixKeys(seq.tokens, self.config.drafter_block_size, seq.keys.root)

    def _result(self, seq: _Sequence, reason: str) -> TurnResult:
        fault = self.runtime.take_fault(seq.request_id) if seq.policy is not DrafterPolicy.PAIRED else None
        if fault is not None:  # a fault cost the turn its carry, at whatever step; its kind stays
            # admission's (`fault` where the admission itself faulted), as the runtime counted it
            seq.stats.outcome = f"{seq.build.mode} ({fault})"
            seq.stats.fault_step = fault.step
        output = seq.tokens[len(seq.prompt):]
        seq.stats.output_tokens = len(output)
        text_ids = output[:-1] if output and output[-1] == self.tokenizer.eos_id else output
        return TurnResult(seq.request_id, seq.session_id, seq.prompt, output,
                          self.tokenizer.decode(text_ids), reason, replace(seq.stats))
