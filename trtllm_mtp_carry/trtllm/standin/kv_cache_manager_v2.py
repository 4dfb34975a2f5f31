"""Stand-in for `tensorrt_llm/_torch/pyexecutor/kv_cache/kv_cache_manager_v2.py`: `KVCacheManagerV2`.

Read (nothing ran): `kv_cache_manager_v2.py` @ 0004396720054fd8e205cbf616f21f0b57c6b412
and 38198e34 (notes sections 0, 0b):
`get_buffers(layer_idx, kv_layout="NHD")` (HND `[pages, kv_factor, kv_heads, tpb,
head_dim]`), `get_batch_cache_indices(request_ids, layer_idx=None,
num_blocks_per_seq=None)` (@ 0004396: each request's cache is `self.kv_cache_map[req_id]`,
a `KeyError` for a request the manager does not hold; its `num_blocks` entries, capped by
`num_blocks_per_seq`, `BAD_PAGE_INDEX` kept as is, e.g. "evicted out-of-window SWA
blocks"; no `raw_indices` parameter at that commit, so passing one is a TypeError here),
`free_resources(request)`, `layer_offsets` (global layer ->
local; the draft pool's one layer is the MTP layer, `num_hidden_layers`), the pairing
markers of #18093 (`enable_joint_kv_cache_reuse`: built with `joint_kv_cache_reuse=`;
`_can_publish_block_reuse = joint_kv_cache_reuse or not is_draft`), `kv_cache_config`
(the manager keeps its config), `_fresh_page_fill` (None: off). The class attribute
`_supports_reuse_match_backoff = True` is what `KvCacheCreator._joint_reuse_supported` reads
(`_util.py` @ 0004396); `_supports_draft_reuse_match_backoff` exists only on the head of PR
#19303 (notes section 0, 38198e34), so this class has no such name.

The draft pool (`DraftKVManager`, `is_draft`) is a `KVCacheManagerV2` built by
`_mirror_draft_kv_cache`: unpaired, it has fresh pages and no lookup (the blind
drafter); paired, it commits its context pages to its own tree.

Invariant: every page is owned by live requests and tree entries with a reference count
(`PagedRows`); `StandinPyExecutor.check()` proves none leaked once nothing runs.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...dataplane.device_ints import device_copy
from .conformant import Conformant
from .llm_args import KvCacheConfig
from .llm_request import LlmRequest
from .mapping import Mapping
from .resource_manager import BaseResourceManager, DataType
from .scheduler import ScheduledRequests

BAD_PAGE_INDEX = -1
"""`tensorrt_llm.runtime.kv_cache_manager_v2.BAD_PAGE_INDEX`: a block the request's cache does not
hold in the pool (kv_cache_manager_v2.py @ 0004396 passes such entries through untouched)."""

POISON_SEED = 0x5EED
"""Seed of the pattern a page holds before any request wrote it (see `PagedRows`)."""


class PagedRows:
    """One layer's paged HND KV `[pages, 2, kv_heads, tpb, head_dim]`, pages reference-counted.

    A fresh page is never cleared, as TensorRT-LLM never clears one (`_fresh_page_fill` off): it
    holds what the request that last used it left there, or, never used, a poison pattern (random
    rows of the scale of real ones, seeded by `POISON_SEED`). A restore that is short or missed
    therefore leaves wrong rows a test can see, never convenient zeros.

    The pages live on `device` (a GPU's, to time the adapter's copies there); the model may
    compute elsewhere: `write` takes rows from any device, `read` gives them on the pages'.
    """

    def __init__(self, num_pages: int, num_kv_heads: int, tpb: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", roles: int = 2) -> None:
        # `roles` K-sized pages a slot (V2 coalesces buffers of one size and lifecycle into one
        # slot: a QSA pool's index key joins K and V when it is as large, qsa_cache_manager.py);
        # `buf` is the slot's K/V, `[slots, roles, ...][:, :2]`, strided when roles > 2
        self.store = torch.empty(num_pages, roles, num_kv_heads, tpb, head_dim, dtype=dtype, device=device)
        poison = poison_page(num_kv_heads, tpb, head_dim, dtype)
        self.store.copy_(poison[torch.arange(roles) % 2].expand_as(self.store))
        self.buf = self.store[:, :2]
        self.tpb = tpb
        self._free: deque[int] = deque(range(num_pages))
        self._refs = [0] * num_pages
        self.tables: dict[int, list[int]] = {}

    def ensure(self, rid: int, num_tokens: int) -> None:
        table = self.tables.setdefault(rid, [])
        while len(table) * self.tpb < num_tokens:
            table.append(self.new_page())

    def new_page(self) -> int:
        if not self._free:
            raise RuntimeError("stand-in draft pool: out of pages")
        page = self._free.popleft()
        self._refs[page] = 1
        # not cleared: TensorRT-LLM leaves a fresh page as its last user left it (the class doc)
        return page

    def share(self, page: int) -> int:
        self._refs[page] += 1
        return page

    def unref(self, page: int) -> None:
        self._refs[page] -= 1
        if self._refs[page] == 0:
            self._free.append(page)

    def release(self, rid: int) -> None:
        for page in self.tables.pop(rid, []):
            if page != BAD_PAGE_INDEX:  # a dropped block holds no page any more
                self.unref(page)

    def drop_blocks(self, rid: int, blocks: Sequence[int]) -> None:
        """Give back the pages of request `rid`'s blocks `blocks`, leaving `BAD_PAGE_INDEX` in
        their table entries: what V2 does to out-of-window SWA blocks (kv_cache_manager_v2.py @
        0004396, `get_batch_cache_indices_flat`: "BAD_PAGE_INDEX entries (e.g. evicted
        out-of-window SWA blocks)"). The stand-in's way to produce such entries."""
        table = self.tables[rid]
        for block in blocks:
            if table[block] != BAD_PAGE_INDEX:
                self.unref(table[block])
                table[block] = BAD_PAGE_INDEX

    def _pages(self, rid: int, keys: torch.Tensor) -> torch.Tensor:
        table = torch.tensor(self.tables[rid], dtype=torch.int64)
        page = table[keys // self.tpb]
        if bool((page == BAD_PAGE_INDEX).any()):  # never index the pool with -1 (its last page)
            raise RuntimeError(f"request {rid}: keys on a BAD_PAGE_INDEX block (dropped)")
        return page

    def write(self, rid: int, lo: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keys `[lo, lo + n)` get `k` (roped), `v` `[n, Hkv, D]` (the attention kernel's write).

        FP8 pages (`DataType.FP8`: float8_e4m3fn) get the rows cast with a static KV scale of 1
        (the reference checkpoint has none): the carry never reads the scale, it moves bytes."""
        page, slot = self._slots(rid, lo, lo + k.shape[0])
        self.buf[page, 0, :, slot] = k.to(self.buf.device, self.buf.dtype)
        self.buf[page, 1, :, slot] = v.to(self.buf.device, self.buf.dtype)

    def read(self, rid: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(k, v)` `[hi - lo, Hkv, D]` of keys `[lo, hi)` (what the attention kernel reads)."""
        page, slot = self._slots(rid, lo, hi)
        return self.buf[page, 0, :, slot], self.buf[page, 1, :, slot]

    def _slots(self, rid: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(page, slot)` int64 `[hi - lo]` of keys `[lo, hi)`, on the pages' device."""
        keys = torch.arange(lo, hi)
        dev = self.buf.device
        return device_copy(self._pages(rid, keys), dev), device_copy(keys % self.tpb, dev)

    def pages_in_use(self) -> int:
        return sum(1 for r in self._refs if r)


def poison_page(num_kv_heads: int, tpb: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """The rows `[2, kv_heads, tpb, head_dim]` every never-written page holds: standard normal
    (the scale of real K/V rows), from `POISON_SEED`, so the same in every pool and run."""
    gen = torch.Generator().manual_seed(POISON_SEED)
    return torch.randn(2, num_kv_heads, tpb, head_dim, generator=gen).to(dtype)


def _manager_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The manager's `_stream` for pages on `device`: a fresh CUDA stream there, None on the CPU."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None


class KVCacheManagerV2(Conformant, BaseResourceManager):
    """Stand-in for `KVCacheManagerV2`: the attributes the adapter probes, over `PagedRows`.

    Pairing markers as #18093 has them: `enable_joint_kv_cache_reuse` (the manager
    was built with `joint_kv_cache_reuse=`) and `_can_publish_block_reuse`
    (`joint_kv_cache_reuse or not is_draft`); a build without them is modelled by
    deleting them (`del manager.enable_joint_kv_cache_reuse`).
    """

    TRTLLM_CLASS = "KVCacheManagerV2"
    # "Read by KvCacheCreator: a subclass that overrides the context commit/history protocol opts
    # out of generic reuse-match backoff" (kv_cache_manager_v2.py @ 0004396): the one pairing
    # capability `KvCacheCreator._joint_reuse_supported` reads there (`_util.py` @ 0004396).
    # `_supports_draft_reuse_match_backoff` exists only on the head of PR #19303: not here.
    _supports_reuse_match_backoff = True

    def __init__(self, *, is_draft: bool, mtp_layer: int, paged: PagedRows | None,
                 dtype: DataType, mapping: Mapping, kv_cache_config: KvCacheConfig) -> None:
        self.is_draft = is_draft
        self.dtype = dtype
        self.mapping = mapping
        self.kv_cache_config = kv_cache_config
        self.enable_block_reuse = kv_cache_config.enable_block_reuse
        self.paged = paged
        self.mtp_layer = mtp_layer
        self.tokens_per_block = paged.tpb if paged is not None else 0
        self.layer_offsets = {mtp_layer: 0} if is_draft else {}
        self.enable_joint_kv_cache_reuse = False
        self._can_publish_block_reuse = not is_draft
        self._fresh_page_fill: object | None = None  # TRTLLM_KV_FRESH_PAGE_FILL unset: off
        # kv_cache_manager_v2.py @ 0004396: `self._stream = execution_stream if execution_stream is
        # not None else torch.cuda.current_stream()`; the creator passes its execution stream, on
        # which PyExecutor runs the forward (`with torch.cuda.stream(self.execution_stream)`), not
        # the stream prepare_resources runs on. With no executor stream to share, CUDA pages get a
        # stream of their own (so the adapter's stream ordering runs); CPU pages: None (no CUDA).
        self._stream = _manager_stream(paged.buf.device) if paged is not None else None

    def get_max_resource_count(self) -> int:
        return 1

    def get_needed_resource_to_completion(self, request: Any) -> int:
        return 0

    def get_buffers(self, layer_idx: int, kv_layout: str = "NHD") -> torch.Tensor | None:
        if self.paged is None or layer_idx != self.mtp_layer:
            return None
        buf = self.paged.buf
        if kv_layout == "HND":
            return buf
        return buf.reshape(buf.shape[0], 2, buf.shape[3], buf.shape[2], buf.shape[4])  # as V2 does

    def get_batch_cache_indices(self, request_ids: list[int], layer_idx: int | None = None,
                                num_blocks_per_seq: Sequence[int] | None = None) -> list[list[int]]:
        """As `KVCacheManagerV2.get_batch_cache_indices` @ 0004396: per request, its cache
        (`kv_cache_map[req_id]`: KeyError for a request this manager does not hold, e.g. one a
        full draft IndexMapper skipped), its `num_blocks` page indices, capped at
        `num_blocks_per_seq[i]`, `BAD_PAGE_INDEX` entries kept. The pool's page index needs no
        scaling here (one layer, HND pages `[pages, 2, ...]`: `index * scale // kv_factor` is the
        page)."""
        assert self.paged is not None
        res = []
        for i, rid in enumerate(request_ids):
            table = self.paged.tables[rid]  # kv_cache_map[req_id]: KeyError when not held
            num_blocks = len(table)
            if num_blocks_per_seq is not None:
                num_blocks = min(num_blocks, num_blocks_per_seq[i])
            res.append(list(table[:num_blocks]))
        return res


@dataclass
class _DraftEntry:
    tokens: list[int]  # keys [0, depth) consumed tokens[0 ..= depth]
    pages: list[int]


class DraftKVManager(KVCacheManagerV2):
    """The separate one-model draft pool (is_draft): fresh pages, or its own tree when paired."""

    def __init__(self, paged: PagedRows, *, mtp_layer: int, paired: bool, entries: int,
                 draft_len: int, dtype: DataType, mapping: Mapping,
                 kv_cache_config: KvCacheConfig) -> None:
        super().__init__(is_draft=True, mtp_layer=mtp_layer, paged=paged, dtype=dtype,
                         mapping=mapping, kv_cache_config=kv_cache_config)
        self.pool = paged  # the same PagedRows as self.paged, typed as present
        self.paired = paired  # what the pool does (the markers below say it; a build may lack them)
        self.enable_joint_kv_cache_reuse = paired
        self._can_publish_block_reuse = paired or not self.is_draft
        self.entries = entries
        self.draft_len = draft_len
        self.tree: OrderedDict[tuple[Any, ...], _DraftEntry] = OrderedDict()

    def rebuilt(self) -> DraftKVManager:
        """A fresh manager over the same pool and settings (after a teardown), markers kept."""
        fresh = type(self)(self.pool, mtp_layer=self.mtp_layer, paired=self.paired,
                               entries=self.entries, draft_len=self.draft_len, dtype=self.dtype,
                               mapping=self.mapping, kv_cache_config=self.kv_cache_config)
        for name in ("enable_joint_kv_cache_reuse", "_can_publish_block_reuse"):
            if name not in vars(self):
                delattr(fresh, name)
        return fresh

    def match_depth(self, req: LlmRequest) -> tuple[int, _DraftEntry | None]:
        """Paired: the depth the draft tree serves for this prompt (0 unpaired)."""
        if not self.paired:
            return 0, None
        scope = (req.cache_salt, req.lora_task_id)
        best: _DraftEntry | None = None
        for (s, *_), e in self.tree.items():
            n = len(e.tokens)
            if s == scope and n <= len(req.prompt) and req.prompt[:n] == e.tokens:
                if best is None or n > len(best.tokens):
                    best = e
        return (0, None) if best is None else (len(best.tokens) - 1, best)

    def adopt_tree(self, req: LlmRequest, entry: _DraftEntry, depth: int) -> None:
        """Paired: full pages below `depth` are shared tree pages; a partial one is copied."""
        tpb = self.pool.tpb
        full = depth // tpb
        table = [self.pool.share(p) for p in entry.pages[:full]]
        if depth % tpb:
            page = self.pool.new_page()
            self.pool.buf[page] = self.pool.buf[entry.pages[full]]  # copy on write
            table.append(page)
        self.pool.tables[req.py_request_id] = table

    def commit_context(self, req: LlmRequest) -> None:
        """Paired: publish the context's pages (keys [0, L)) to the tree; a partial page is copied."""
        if not self.paired or req.is_dummy:
            return
        tpb, n = self.pool.tpb, len(req.prompt)
        table = self.pool.tables[req.py_request_id]
        pages = [self.pool.share(p) for p in table[: n // tpb]]
        if n % tpb:
            page = self.pool.new_page()
            self.pool.buf[page] = self.pool.buf[table[n // tpb]]
            pages.append(page)
        key = ((req.cache_salt, req.lora_task_id), tuple(req.tokens[: n + 1]))
        old = self.tree.pop(key, None)
        if old is not None:
            for p in old.pages:
                self.pool.unref(p)
        self.tree[key] = _DraftEntry(list(req.tokens[: n + 1]), pages)
        while len(self.tree) > self.entries:
            for p in self.tree.popitem(last=False)[1].pages:
                self.pool.unref(p)

    def prepare_resources(self, scheduled_batch: ScheduledRequests) -> None:
        # as _prepare_draft_resources: context_current_position + chunk + draft_len; generation
        # + 1 + D, plus D for the draft steps past the accepted tokens (the extra KV tokens)
        for r in scheduled_batch.context_requests:
            self.pool.ensure(r.py_request_id, r.context_current_position + r.context_chunk_size
                              + self.draft_len)
        for r in scheduled_batch.generation_requests:
            self.pool.ensure(r.py_request_id, len(r.tokens) + 1 + 2 * self.draft_len)

    def free_resources(self, request: Any) -> None:
        self.pool.release(request.py_request_id)
