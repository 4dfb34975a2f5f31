"""The contract suite's executors: the same scripted turns through each executor's real carry glue.

Each executor here is the package's own translation of an engine's events into calls on the
carry service, driven by the events its engine would send, with the model replaced by one
deterministic row function (`synthetic_rows`), so every executor writes the same bytes for the
same pair keys and the suite can compare what each one carried, bit for bit:

- `reference`: `CarryRuntime` (the reference engine's glue) over a `DrafterKVPool` whose rows
  are not roped (rotary_dim 0: its rows are the synthetic rows as written). A turn is what the
  engine does: draw a ticket, `prepare` at the reused depth R, write the chunk's hidden rows
  and `build_chunk`, append the decode steps' rows, then `finish`, `cancel` or `release`.
- `trtllm-standin`: TensorRT-LLM's carry resource manager (`trtllm/manager.py`) behind the
  stand-in's `ResourceManager`, after the stand-in's separate draft KV manager (fresh pages
  hold a poison pattern, never zeros). A turn is what PyExecutor does: `prepare_resources` for
  the context request at `context_current_position = R`, the context phase writing keys
  `[R, L)` (the first sampled token paired with the last prompt position), generation steps
  writing one key each and a draft step's junk row past the last key, then `free_resources`.

Both take the store's bounds in entries' rows (`room_rows`, `host_rows`), converted to each
executor's own charge (the reference pool charges whole blocks, an arena its rows' bytes),
so the same scripted turns meet the same bounds. A new executor joins by adding a class here
and one entry to `EXECUTORS`.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from trtllm_mtp_carry.core import carry_key, session_hash
from trtllm_mtp_carry.core.row_format import RowFormat
from trtllm_mtp_carry.dataplane.hidden_store import HiddenStore
from trtllm_mtp_carry.dataplane.kv_pool import DrafterKVPool
from trtllm_mtp_carry.dataplane.rope import RopeConfig
from trtllm_mtp_carry.runtime import CarryRuntime
from trtllm_mtp_carry.service import CarryService, CarryStats
from trtllm_mtp_carry.trtllm.manager import carry_manager_class
from trtllm_mtp_carry.trtllm.options import CarryOptions
from trtllm_mtp_carry.trtllm.standin import (
    ConversationParams,
    DataType,
    DraftKVManager,
    FinishReason,
    KvCacheConfig,
    LlmRequest,
    LlmRequestState,
    Mapping,
)
from trtllm_mtp_carry.trtllm.standin.kv_cache_manager_v2 import Nvfp4PagedRows, PagedRows
from trtllm_mtp_carry.trtllm.standin.resource_manager import BaseResourceManager, ResourceManager
from trtllm_mtp_carry.trtllm.standin.scheduler import ScheduledRequests

HKV, D, TPB = 2, 32, 4  # KV heads, head dim, rows a block (a page)
MTP_LAYER = 1


def synthetic_rows(tokens: list[int], lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's K and V `[hi - lo, HKV, D]` bf16 of pair keys `[lo, hi)` of `tokens` (key k
    pairs position k with token k + 1): exact in bf16, different for every (token, key, head, dim)."""
    t = torch.tensor(tokens[lo + 1:hi + 1], dtype=torch.int64)
    keys = torch.arange(lo, hi, dtype=torch.int64)
    base = (t * 37 + keys * 11)[:, None, None]
    grid = torch.arange(HKV * D, dtype=torch.int64).view(1, HKV, D)
    k = ((base + grid * 5) % 97 - 48).float() / 16
    v = ((base + grid * 3 + 1) % 89 - 44).float() / 16
    return k.to(torch.bfloat16), v.to(torch.bfloat16)


@dataclass
class Turn:
    """What one turn's carry did: its decision, the keys it adopted and their bytes as its drafter
    holds them after adoption, and whether it deposited."""

    kind: str
    reason: str
    rows_adopted: int
    first_key: int | None  # the adopted rows' first pair key (None: nothing adopted)
    adopted: torch.Tensor  # uint8 [rows_adopted, 2, HKV, D * 2]: K and V bytes, key by key
    deposited: bool


class Executor(ABC):
    """One executor's carry driven by scripted turns (see the module header)."""

    name: str

    def __init__(self, *, row_dtype: str = "bf16", kv_format: str = "bf16", slots: int | None = None,
                 room_rows: int = 1024, host_rows: int = 0, idle_s: float | None = None,
                 eviction: str = "lrd") -> None:
        self.row_dtype, self.kv_format = row_dtype, kv_format
        self.now = 0.0  # the logical clock every executor's store reads
        self._ids = itertools.count(1)

    def clock(self) -> float:
        return self.now

    @property
    @abstractmethod
    def service(self) -> CarryService: ...

    @abstractmethod
    def turn(self, session: str, prompt: list[int], reused: int, output: list[int], *,
             salt: str | None = None, end: str = "finish") -> Turn:
        """One turn of `session`: `prompt` with its first `reused` positions served by the
        target's prefix cache, answered with `output`; `end` is `finish`, `cancel` (stopped
        after its output so far) or `fail` (ended before its prefill finished)."""

    @abstractmethod
    def forget(self, session: str) -> int:
        """The session ended: its carried rows go (returns the rows dropped)."""

    @abstractmethod
    def stats(self) -> CarryStats:
        """The executor's own `stats()`: what its front ends export (the service's snapshot with
        the fields only the executor knows filled in)."""

    @abstractmethod
    def check(self) -> None:
        """The executor's own invariants and the service's (nothing leaked, nothing held twice)."""


class ReferenceExecutor(Executor):
    name = "reference"

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        if self.kv_format != "bf16":
            raise ValueError(f"the reference pool holds bf16 rows, not {self.kv_format}")
        self.pool = DrafterKVPool(512, TPB, HKV, D, RopeConfig(D, 0, 1e4))  # rows as written
        self.store = HiddenStore(4096, 8)
        backend = SimpleNamespace(drafter_pool=self.pool, hidden_store=self.store, drafter_kv=self._rows)
        pooled = self.row_dtype == "bf16"
        charge = self.pool.block_nbytes // TPB if pooled else _row_nbytes(self.row_dtype)
        self.runtime = CarryRuntime(backend, "carry", slots=kw.get("slots"), memory=kw.get("room_rows", 1024) * charge,
                                    eviction=kw.get("eviction", "lrd"), idle_s=kw.get("idle_s"), clock=self.clock, share=False,
                                    host_memory=kw.get("host_rows", 0) * charge, row_dtype=self.row_dtype)

    @property
    def service(self) -> CarryService:
        return self.runtime.service

    def _rows(self, next_tokens: torch.Tensor, hidden: torch.Tensor, keys: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.zeros(int(keys.max()) + 2, dtype=torch.int64)
        tokens[keys + 1] = next_tokens
        return synthetic_rows(tokens.tolist(), int(keys[0]), int(keys[-1]) + 1)

    def turn(self, session: str, prompt: list[int], reused: int, output: list[int], *,
             salt: str | None = None, end: str = "finish") -> Turn:
        rt, seq = self.runtime, next(self._ids)
        h = session_hash(session)
        key = carry_key(h, salt)
        ticket = rt.draw_ticket()
        build = rt.prepare(seq, ticket, key, prompt, reused, session=h)
        adopted = self._held_bytes(seq, build.rows_kept)
        first = None
        if build.rows_kept:
            first = int(self.pool.gather(seq)[2][0])
        if end == "fail":  # the prefill never finished: the engine drops the turn's drafter
            rt.release(seq, "not_deposited")
            return Turn(build.outcome.kind if build.outcome else build.mode, _reason(build.outcome),
                        build.rows_kept, first, adopted, False)
        n = len(prompt)
        self.store.write(ticket, reused, torch.zeros(n - reused, 8, dtype=torch.bfloat16))
        rt.build_chunk(seq, ticket, build, prompt, reused, n)
        tokens = prompt + output
        if self.pool.has_sequence(seq) and len(tokens) - 1 > n - 1:  # decode steps: keys L-1 .. N-2
            rt.wait_restored(seq)
            last = self.pool.sequence(seq).last_pair_key
            lo = max(n - 1, -1 if last is None else last + 1)
            self.pool.append_rows(seq, range(lo, len(tokens) - 1), *synthetic_rows(tokens, lo, len(tokens) - 1))
        ends = rt.cancel if end == "cancel" else rt.finish
        deposited = ends(seq, key, tokens, ticket=ticket, session=h)
        return Turn(build.outcome.kind if build.outcome else build.mode, _reason(build.outcome),
                    build.rows_kept, first, adopted, deposited)

    def _held_bytes(self, seq: int, n: int) -> torch.Tensor:
        if not self.pool.has_sequence(seq) or n == 0:
            return torch.empty(0, 2, HKV, 2 * D, dtype=torch.uint8)
        k, v, _ = self.pool.gather(seq)
        return _kv_bytes(k[:n], v[:n])

    def forget(self, session: str) -> int:
        return self.runtime.forget_session(session_hash(session))

    def stats(self) -> CarryStats:
        return self.runtime.stats()

    def check(self) -> None:
        self.runtime.check()
        self.pool.check()
        assert self.pool.stats().num_sequences == 0


class TrtllmStandinExecutor(Executor):
    name = "trtllm-standin"

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        dtype = {"bf16": DataType.BF16, "fp8_kv": DataType.FP8, "nvfp4_kv": DataType.NVFP4}[self.kv_format]
        if dtype is DataType.NVFP4:
            self.paged: PagedRows = Nvfp4PagedRows(512, HKV, TPB, D)
        else:
            torch_dtype = torch.float8_e4m3fn if dtype is DataType.FP8 else torch.bfloat16
            self.paged = PagedRows(512, HKV, TPB, D, torch_dtype)
        self.draft = DraftKVManager(self.paged, mtp_layer=MTP_LAYER, paired=False, entries=0, draft_len=1,
                                    dtype=dtype, mapping=Mapping(), kv_cache_config=KvCacheConfig())
        row = _row_nbytes(self.row_dtype if self.kv_format == "bf16" else self.kv_format)
        options = CarryOptions(carry_memory=kw.get("room_rows", 1024) * row,
                               carry_host_memory=kw.get("host_rows", 0) * row, carry_row_dtype=self.row_dtype)
        self.manager = carry_manager_class(BaseResourceManager)(
            self.draft, MTP_LAYER, options, slots=kw.get("slots"), eviction=kw.get("eviction", "lrd"), idle_s=kw.get("idle_s"),
            clock=self.clock)
        self.resources = ResourceManager(OrderedDict([("draft", self.draft), ("carry", self.manager)]))

    @property
    def service(self) -> CarryService:
        return self.manager.service

    def turn(self, session: str, prompt: list[int], reused: int, output: list[int], *,
             salt: str | None = None, end: str = "finish") -> Turn:
        rid = next(self._ids)
        req = LlmRequest(rid, prompt, len(output), ConversationParams(conversation_id=session), cache_salt=salt)
        n = len(prompt)
        req.context_current_position = req.prepopulated_prompt_len = reused
        req.context_chunk_size = n - reused
        self.resources.prepare_resources(ScheduledRequests(context_requests=[req]))
        record = self.manager.turn(rid) or {}
        rows = int(record.get("rows_adopted", 0))
        first = record.get("first_key") if rows else None
        adopted = (self.paged.key_bytes(rid, first, first + rows) if first is not None
                   else torch.empty(0, 2, HKV, 2 * D, dtype=torch.uint8))
        if end == "fail":  # freed before its context finished
            req.finish_by_reason(FinishReason.CANCELLED)
            self.resources.free_resources(req)
            return Turn(str(record.get("outcome", "")), str(record.get("no_carry_reason", "")), rows, first,
                        adopted, bool(record.get("rows_deposited")))
        tokens = prompt + output
        self.paged.write(rid, reused, *synthetic_rows(tokens, reused, n))  # the context phase: keys [R, L)
        req.context_current_position = n
        req.tokens.append(output[0])
        req.state = LlmRequestState.GENERATION_IN_PROGRESS
        for i in range(1, len(output)):  # a generation step: key len(tokens) - 1 of the verified token
            self.resources.prepare_resources(ScheduledRequests(generation_requests=[req]))
            key = len(req.tokens) - 1
            self.paged.write(rid, key, *synthetic_rows(tokens, key, key + 1))
            req.tokens.append(output[i])
        junk = len(req.tokens) - 1  # the draft step's row past the last key: never carried
        self.resources.prepare_resources(ScheduledRequests(generation_requests=[req]))
        k, v = synthetic_rows([0] * (junk + 2), junk, junk + 1)
        self.paged.write(rid, junk, -k, -v)
        req.finish_by_reason(FinishReason.CANCELLED if end == "cancel" else FinishReason.LENGTH)
        self.resources.free_resources(req)
        record = self.manager.turn(rid) or {}
        return Turn(str(record.get("outcome", "")), str(record.get("no_carry_reason", "")), rows, first,
                    adopted, bool(record.get("rows_deposited")))

    def forget(self, session: str) -> int:
        return self.manager.forget_conversation(session)

    def stats(self) -> CarryStats:
        return self.manager.stats()

    def check(self) -> None:
        self.manager.service.check()
        assert not self.manager._live, f"requests still live: {list(self.manager._live)}"
        assert not self.paged.tables, f"draft pages still held: {list(self.paged.tables)}"


def _reason(outcome: Any) -> str:
    return getattr(outcome, "reason", "") or ""


def _kv_bytes(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K and V `[n, HKV, D]` as the bytes a page holds them, `[n, 2, HKV, bytes]`."""
    return torch.stack((k, v), dim=1).contiguous().view(torch.uint8)


def _row_nbytes(fmt: str) -> int:
    """Bytes one carried row `[2, HKV, D]` takes in format `fmt` (a bf16 pool's, or a KV pool's own)."""
    elem = 1 if fmt == "fp8_kv" else 2
    return RowFormat(fmt, 2 * HKV, D, elem).row_nbytes


EXECUTORS: dict[str, type[Executor]] = {
    "reference": ReferenceExecutor,
    "trtllm-standin": TrtllmStandinExecutor,
}
"""Every executor the contract suite runs; a new one joins here."""
