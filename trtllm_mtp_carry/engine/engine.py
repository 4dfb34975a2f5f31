"""The reference engine: a hybrid MTP model served with prefix caching and
greedy speculative decoding, in plain torch.

What it is for: the embedded default (runs on a laptop CPU, or a GPU through
the same code) and the oracle every faster path is checked against. It
reproduces the situation the carry exists for: a warm turn restores an SSM
snapshot and reuses attention KV, so the target never recomputes the prefix
and the MTP drafter has no hidden states for it.

A sequence's life: admission (ticket, prefix match, resume plan) -> chunked
prefill (each chunk's hidden rows go to the hidden store under the ticket;
SSM snapshots at chunk ends) -> first decode unit (drafter preparation by the
carry runtime, per policy) -> speculative steps (draft, verify in one target
forward, accept greedily) -> finish (prefix blocks and a turn-end snapshot are
cached; the drafter rows are deposited in the carry slot or freed).

Invariants:
- Greedy speculative output equals plain greedy decoding: the target verifies
  every draft, and the recurrent state follows exactly the accepted path (the
  verify forward records the state after every position; the accepted one is
  kept). Attention writes are indexed by position, so rejection needs no
  rollback there.
- The drafter pool holds only real rows (pair keys whose hidden state came from
  the target); speculative draft rows live in local tensors for one step.
  Before a step of a sequence of N tokens, its rows cover keys up to N - 3.
- Only computed tokens are cached (never the last sampled one), and an SSM
  snapshot is restored only at a depth of at least `marconi_min_tokens()`.
- Sequences are interleaved one unit of work at a time (a prefill chunk or a
  decode step), so MTP dispatches one sequence per step.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..core import marconi_min_tokens, set_mtp_max_seqs
from ..core.session import session_hash
from ..dataplane.hidden_store import HiddenStore
from ..dataplane.kv_pool import DrafterKVPool, PoolExhaustedError
from ..dataplane.rope import RopeConfig, apply_rope_reference
from ..runtime.carry_runtime import CarryRuntime, DrafterPrep
from ..runtime.policy import DrafterPolicy
from .block_manager import TargetBlockManager
from .config import DTYPES, MAX_DRAFT_LEN, EngineConfig
from .model import DenseTargetCache, HybridLM
from .prefix_hash import PrefixKeys
from .snapshot_cache import SnapshotCache, plan_resume
from .target_kv import PagedTargetKV, SequenceKV
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
    phase: str = "prefill"  # prefill -> decode
    prep: DrafterPrep | None = None
    last_hidden: torch.Tensor | None = None  # [H]: hidden of the newest computed position
    cold: bool = True
    finish_reason: str = ""
    mirror: _RowMirror | None = None  # the drafter's rows in the model dtype, for attention
    drafter_off: bool = False  # the drafter pool ran out: decode on without drafts

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.prompt)


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

    def sync(self, pool: DrafterKVPool, seq_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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


class ReferenceEngine:
    """Greedy speculative decoding of a hybrid MTP model with prefix caching and the carry."""

    def __init__(self, model: HybridLM, tokenizer: ChatTokenizer, config: EngineConfig | None = None,
                 multi_seq: bool | None = None) -> None:
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
        # mtp_prefill_hidden buffer); a span they cut short is refused with NoHiddens.
        capacity = config.hidden_capacity or self.max_model_len
        self._store = HiddenStore(capacity, cfg.hidden_size, device=self.device)
        self._pool = DrafterKVPool(
            config.num_drafter_blocks, config.drafter_block_size, cfg.num_kv_heads, cfg.head_dim,
            RopeConfig(cfg.head_dim, cfg.rotary_dim, cfg.rope_theta), device=self.device,
        )
        self.runtime = CarryRuntime(self, config.policy, multi_seq=multi_seq)
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

    @torch.no_grad()
    def recompute_hiddens(self, ticket: int, tokens: Sequence[int]) -> None:
        ids = torch.tensor(list(tokens), dtype=torch.int64, device=self.device)
        cache = DenseTargetCache(self.model.cfg)
        chunk = self.config.prefill_chunk
        for start in range(0, len(ids), chunk):
            hidden, _ = self.model.forward_target(ids[start:start + chunk], start, cache)
            self._capture_hiddens(ticket, start, hidden)

    # ---- requests -----------------------------------------------------------------

    def submit(self, session_id: str | int | None, prompt: Prompt, max_new_tokens: int = 128,
               draft_len: int | None = None, policy: DrafterPolicy | str | None = None) -> int:
        """Queue a request; returns its id. Bad input raises ValueError/TypeError naming it."""
        tokens = self._prompt_tokens(prompt)
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
        self._waiting.append(_Request(rid, session_id, h, tokens, max_new_tokens, draft_len, chosen))
        return rid

    def generate(self, session_id: str | int | None, prompt: Prompt, max_new_tokens: int = 128,
                 draft_len: int | None = None, policy: DrafterPolicy | str | None = None) -> TurnResult:
        """Run one request to completion (other queued requests advance too)."""
        rid = self.submit(session_id, prompt, max_new_tokens, draft_len, policy)
        while True:
            for result in self.step():
                if result.request_id == rid:
                    return result
                self._finished.append(result)

    def cancel(self, request_id: int) -> TurnResult | None:
        """Stop a queued or running request now and free everything it holds."""
        for i, req in enumerate(self._waiting):
            if req.request_id == request_id:
                del self._waiting[i]
                return TurnResult(request_id, req.session_id, req.prompt, [], "", "cancelled",
                                  TurnStats(prompt_tokens=len(req.prompt)))
        for seq in self._running:
            if seq.request_id == request_id:
                self._running.remove(seq)
                self.runtime.release(seq.request_id)
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
        """One unit of work for every running sequence (a prefill chunk or a decode step)."""
        self._admit()
        finished = []
        for seq in list(self._running):
            if seq.phase == "prefill":
                self._prefill_chunk(seq)
            else:
                done = self._decode_step(seq)
                if done:
                    self._running.remove(seq)
                    finished.append(self._finish(seq))
        return finished

    def check(self) -> None:
        """Prove the pools' ownership invariants; with nothing running, that nothing leaked."""
        self.blocks.check()
        self._pool.check()
        if not self._running:
            if self._pool.stats().num_sequences:
                raise RuntimeError(f"drafter pool holds sequences with nothing running: {self._pool.stats()}")
            if self.blocks.stats().num_used:
                raise RuntimeError(f"target blocks in use with nothing running: {self.blocks.stats()}")

    # ---- admission and prefill -----------------------------------------------------

    def _prompt_tokens(self, prompt: Prompt) -> list[int]:
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
                if set(m) - {"role", "content"} or not isinstance(m.get("content"), str):
                    raise ValueError(f"a message needs a role and a string content, got {m!r}")
            tokens = self.tokenizer.render_chat(messages)
        else:
            tokens = list(prompt)  # type: ignore[arg-type]
            vocab = self.model.cfg.vocab_size
            try:  # C-speed checks: array() refuses non-ints, min/max bound the ids
                ids = array("q", tokens)
                ok = min(ids) >= 0 and max(ids) < vocab
            except (TypeError, OverflowError):
                ok = False
            if not ok:  # only now look for the offending ids, to name them
                bad = [t for t in tokens if isinstance(t, bool) or not isinstance(t, int)
                       or not 0 <= t < vocab]
                raise ValueError(f"token ids must be ints in [0, {vocab}); got {bad[:5]}")
        return tokens

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.config.max_num_seqs:
            req = self._waiting[0]
            keys = PrefixKeys(req.prompt, self.config.block_size)
            match = self.blocks.match_prefix(keys)
            plan = plan_resume(keys, match, self.snapshots.best_for, marconi_min_tokens())
            trimmed = match.trimmed(plan.depth)
            # reserve the answer's slots now, so decoding never runs out of blocks
            reserve = req.max_new_tokens + req.draft_len
            if self.blocks.can_allocate(len(req.prompt) + reserve, trimmed) is None:
                if not self._running:
                    raise RuntimeError(f"request {req.request_id} cannot fit in an idle engine")
                return  # wait for running sequences to free blocks
            self._waiting.pop(0)
            alloc = self.blocks.allocate(req.request_id, req.prompt, trimmed)
            for src, dst in alloc.copies:
                self.target_kv.copy_block(src, dst)
            table = [*alloc.block_table, *self.blocks.append_slots(req.request_id, reserve)]
            kv = SequenceKV(self.target_kv, table, alloc.num_cached_tokens)
            if plan.restore:
                assert plan.snapshot is not None
                kv.restore_ssm(plan.snapshot)
            stats = TurnStats(prompt_tokens=len(req.prompt), reused_tokens=alloc.num_cached_tokens,
                              snapshot_restored=plan.restore, policy=req.policy.value)
            seq = _Sequence(
                req.request_id, req.session_id, req.session_hash, self.runtime.draw_ticket(),
                req.policy, req.draft_len, req.max_new_tokens, req.prompt, list(req.prompt), keys,
                kv, stats, time.perf_counter(), cold=alloc.num_cached_tokens == 0,
            )
            self._running.append(seq)

    @torch.no_grad()
    def _prefill_chunk(self, seq: _Sequence) -> None:
        t0 = time.perf_counter()
        chunk = self.config.prefill_chunk
        start = seq.kv.num_tokens
        end = min(len(seq.prompt), (start // chunk + 1) * chunk)  # chunk ends on chunk multiples
        ids = torch.tensor(seq.prompt[start:end], dtype=torch.int64, device=self.device)
        hidden, logits = self.model.forward_target(ids, start, seq.kv)
        seq.kv.advance(end - start)
        self._capture_hiddens(seq.ticket, start, hidden)
        self.blocks.commit_full_blocks(seq.request_id, seq.prompt[:end])
        if end < len(seq.prompt) and end % chunk == 0:
            self._put_snapshot(seq.keys, end, seq.kv)
        seq.stats.prefill_ms += (time.perf_counter() - t0) * 1e3
        if end == len(seq.prompt):
            seq.last_hidden = hidden[-1]
            seq.tokens.append(int(logits[-1].argmax()))
            seq.phase = "decode"
            seq.finish_reason = self._stop_reason(seq)

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
    def _decode_step(self, seq: _Sequence) -> bool:
        """Prepare the drafter on the first call, then one speculative step; True when done."""
        if seq.prep is None:
            t_prep = time.perf_counter()
            try:
                seq.prep = self.runtime.prepare(seq.request_id, seq.ticket, seq.session_hash,
                                                seq.prompt, seq.cold, seq.policy)
            except PoolExhaustedError as exc:
                self._drop_drafter(seq, exc)
                seq.prep = DrafterPrep("exhausted", None, 0, 0, 0,
                                       (time.perf_counter() - t_prep) * 1e3)
            s = seq.stats
            s.outcome = seq.prep.describe()
            s.outcome_kind = seq.prep.outcome.kind if seq.prep.outcome else seq.prep.mode
            s.drafter_rows_kept = seq.prep.rows_kept
            s.drafter_rows_computed = seq.prep.rows_computed
            s.keys_skipped = seq.prep.keys_skipped
            s.drafter_prep_ms = seq.prep.prep_ms
            s.ttft_ms = (time.perf_counter() - seq.t_admit) * 1e3
        if seq.finish_reason:
            return True
        t0 = time.perf_counter()
        drafts: list[int] = []
        if seq.policy.drafts and seq.draft_len > 0 and not seq.drafter_off:
            try:
                drafts = self._draft(seq)
            except PoolExhaustedError as exc:
                self._drop_drafter(seq, exc)
        seq.finish_reason = self._verify(seq, drafts)
        seq.stats.decode_ms += (time.perf_counter() - t0) * 1e3
        return bool(seq.finish_reason)

    def _draft(self, seq: _Sequence) -> list[int]:
        """Propose `draft_len` tokens; the first draft key's row is real and stays in the pool."""
        drafter = self.model.drafter
        n = len(seq.tokens)
        key0 = n - 2
        assert seq.last_hidden is not None
        hidden = seq.last_hidden.to(torch.bfloat16).to(self.dtype)[None]  # as the store rounds it
        token = torch.tensor([seq.tokens[-1]], dtype=torch.int64, device=self.device)
        keys = torch.tensor([key0], dtype=torch.int64, device=self.device)
        x = drafter.project(token, hidden)
        q, k, v = drafter.qkv(x, keys)
        self._pool.append_rows(seq.request_id, keys, k.to(torch.bfloat16), v.to(torch.bfloat16))
        cfg = self.model.cfg
        if seq.mirror is None:  # every key of the prompt and the answer fits
            capacity = len(seq.prompt) + seq.max_new_tokens + MAX_DRAFT_LEN + 1
            seq.mirror = _RowMirror(capacity, cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device)
        mirror = seq.mirror
        real = mirror.sync(self._pool, seq.request_id)[2].shape[0]
        drafts: list[int] = []
        h_out = hidden  # each later draft reads the drafter's own output hidden
        for j in range(seq.draft_len):
            if j:  # a speculative row (drafted token, drafter hidden): in the mirror's spare
                # room past the real rows, never in the pool; the next sync overwrites it
                key = key0 + j
                keys = torch.tensor([key], dtype=torch.int64, device=self.device)
                x = drafter.project(token, h_out)
                q, k, v = drafter.qkv(x, keys)
                k_roped = apply_rope_reference(k.to(torch.bfloat16), keys + 1, cfg.rotary_dim,
                                               cfg.rope_theta)
                row = real + j - 1
                mirror.k[row], mirror.v[row] = k_roped[0], v[0].to(torch.bfloat16)
                mirror.keys[row] = key
            end = real + j
            h_out, logits = drafter.finish(x, q, mirror.k[:end], mirror.v[:end], mirror.keys[:end],
                                           keys)
            drafts.append(int(logits[0].argmax()))
            token = torch.tensor([drafts[-1]], dtype=torch.int64, device=self.device)
        seq.stats.drafted += len(drafts)
        return drafts

    def _verify(self, seq: _Sequence, drafts: list[int]) -> str:
        """One target forward over the newest token and the drafts; keep the accepted path.

        Returns the finish reason ("stop", "length") or "" to go on.
        """
        n = len(seq.tokens)
        start = n - 1  # position of the newest token, not yet computed
        inp = [seq.tokens[-1], *drafts]
        ids = torch.tensor(inp, dtype=torch.int64, device=self.device)
        hidden, logits = self.model.forward_target(ids, start, seq.kv, ssm_trace=True)
        seq.kv.advance(len(inp))
        target = logits.argmax(-1).tolist()  # target's greedy token after each input
        num_accepted = 0
        while num_accepted < len(drafts) and drafts[num_accepted] == target[num_accepted]:
            num_accepted += 1
        new = [*drafts[:num_accepted], target[num_accepted]]
        finish = ""
        for i, tok in enumerate(new):  # cut at end of turn or length (at most 4 tokens)
            if tok == self.tokenizer.eos_id:
                new, finish = new[: i + 1], "stop"
                break
            if seq.num_output + i + 1 >= seq.max_new_tokens:
                new, finish = new[: i + 1], "length"
                break
        kept = len(new)
        computed = start + kept  # positions [0, start + kept) are computed; the newest is not
        seq.kv.rewind(computed, trace_index=kept - 1)
        seq.tokens.extend(new)
        seq.last_hidden = hidden[kept - 1]
        if drafts:
            seq.stats.accepted += num_accepted
            seq.stats.verify_steps += 1
            if kept > 1:  # real rows for the accepted positions (keys n-1 .. n+kept-3)
                try:
                    self._append_real_rows(seq, n - 1, hidden[: kept - 1])
                except PoolExhaustedError as exc:
                    self._drop_drafter(seq, exc)
        return finish

    def _drop_drafter(self, seq: _Sequence, why: Exception) -> None:
        """The drafter pool ran out: free this sequence's rows and decode on without drafts.

        Drafts only ever cost acceptance, so output is unchanged; the turn
        deposits nothing, and the pool is left consistent (a refused grow
        changes nothing).
        """
        logger.warning("request %d: drafter off for the rest of the turn: %s", seq.request_id, why)
        self.runtime.release(seq.request_id)
        seq.drafter_off, seq.mirror = True, None

    def _append_real_rows(self, seq: _Sequence, first_key: int, hidden: torch.Tensor) -> None:
        # hidden: [m, H] target hidden states for keys first_key .. first_key + m - 1
        m = hidden.shape[0]
        keys = torch.arange(first_key, first_key + m, dtype=torch.int64, device=self.device)
        next_tokens = torch.tensor(seq.tokens[first_key + 1:first_key + 1 + m], dtype=torch.int64,
                                   device=self.device)
        k, v = self.drafter_kv(next_tokens, hidden.to(torch.bfloat16), keys)
        self._pool.append_rows(seq.request_id, keys, k, v)

    # ---- finish --------------------------------------------------------------------

    def _finish(self, seq: _Sequence) -> TurnResult:
        computed = seq.kv.num_tokens  # every token but the newest
        if self._pool.has_sequence(seq.request_id) and seq.last_hidden is not None:
            # the newest real key (n - 2) so the carried rows cover every key of the turn
            last_key = len(seq.tokens) - 2
            rows = self._pool.sequence(seq.request_id)
            if rows.last_pair_key is None or rows.last_pair_key < last_key:
                try:
                    self._append_real_rows(seq, last_key, seq.last_hidden[None])
                except PoolExhaustedError as exc:
                    self._drop_drafter(seq, exc)
        self.runtime.finish(seq.request_id, seq.session_hash, seq.tokens, seq.policy, seq.ticket)
        done = seq.tokens[:computed]
        self._put_snapshot(PrefixKeys(done, self.config.block_size), computed, seq.kv)
        self.blocks.free(seq.request_id, done)
        return self._result(seq, seq.finish_reason)

    def _result(self, seq: _Sequence, reason: str) -> TurnResult:
        output = seq.tokens[len(seq.prompt):]
        seq.stats.output_tokens = len(output)
        text_ids = output[:-1] if output and output[-1] == self.tokenizer.eos_id else output
        return TurnResult(seq.request_id, seq.session_id, seq.prompt, output,
                          self.tokenizer.decode(text_ids), reason, replace(seq.stats))
