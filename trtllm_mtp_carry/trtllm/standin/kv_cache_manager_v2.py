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

import weakref
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


class Role:
    """`Role` (`kv_cache_manager_v2.py` @ 00be09f78ecf0691f2b8e15dea518d1d6468679e): the V2 data
    roles of a layer's buffers (`DataRole` strings); `_build_cache_config` adds the two block-scale
    roles beside K/V when `kv_cache_config.dtype == "nvfp4"`."""

    KEY = "key"
    VALUE = "value"
    KEY_BLOCK_SCALE = "key_block_scale"
    VALUE_BLOCK_SCALE = "value_block_scale"
    INDEX_KEY = "index_key"
    ALL = "all"


_MEMORY: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
"""The stand-in's addressable memory: every pool tensor by its `data_ptr()` (what V2's
`get_mem_pool_base_address` hands out and `convert_to_torch_tensor` views)."""


def _register(t: torch.Tensor) -> torch.Tensor:
    _MEMORY[t.data_ptr()] = t
    return t


@dataclass(frozen=True)
class TensorWrapper:
    """`tensorrt_llm._utils.TensorWrapper` as `kv_cache_manager_v2.py` @ 00be09f7 builds it for
    `get_buffers`: `TensorWrapper(address, dtype, shape)` (positional)."""

    data_ptr: int
    dtype: torch.dtype
    shape: Sequence[int]


def convert_to_torch_tensor(wrapper: TensorWrapper) -> torch.Tensor:
    """`tensorrt_llm._utils.convert_to_torch_tensor` (imported by `kv_cache_manager_v2.py` @
    00be09f7): a tensor of `wrapper.dtype` and `shape` over the memory at `wrapper.data_ptr`. The
    stand-in views the registered pool tensor holding those bytes; an address or extent outside
    every pool is a ValueError (on a GPU it would read foreign memory)."""
    nbytes = torch.empty((), dtype=wrapper.dtype).element_size()
    for s in wrapper.shape:
        nbytes *= int(s)
    for base, t in list(_MEMORY.items()):
        if base <= wrapper.data_ptr and wrapper.data_ptr + nbytes <= base + t.nbytes:
            off = wrapper.data_ptr - base
            raw = t.view(-1).view(torch.uint8)[off:off + nbytes]
            return raw.view(wrapper.dtype).view([int(s) for s in wrapper.shape])
    raise ValueError(f"no stand-in pool holds {nbytes} bytes at {wrapper.data_ptr:#x}")


class PagePool:
    """`num_pages` reference-counted pages of `tpb` tokens and each request's block table (`tables`:
    page ids, `BAD_PAGE_INDEX` for a block that holds none): the allocator `PagedRows` and
    DeepSeek-V4's `SlidingLatentRows` share. A fresh page is never cleared."""

    def __init__(self, num_pages: int, tpb: int) -> None:
        self.tpb = tpb
        self._free: deque[int] = deque(range(num_pages))
        self._refs = [0] * num_pages
        self.tables: dict[int, list[int]] = {}

    def new_page(self) -> int:
        if not self._free:
            raise RuntimeError("stand-in draft pool: out of pages")
        page = self._free.popleft()
        self._refs[page] = 1
        # not cleared: TensorRT-LLM leaves a fresh page as its last user left it
        return page

    def unref(self, page: int) -> None:
        self._refs[page] -= 1
        if self._refs[page] == 0:
            self._free.append(page)

    def release(self, rid: int) -> None:
        for page in self.tables.pop(rid, []):
            if page != BAD_PAGE_INDEX:  # a dropped or stale block holds no page any more
                self.unref(page)

    def pages_in_use(self) -> int:
        return sum(1 for r in self._refs if r)

    def _pages(self, rid: int, keys: torch.Tensor) -> torch.Tensor:
        table = torch.tensor(self.tables[rid], dtype=torch.int64)
        page = table[keys // self.tpb]
        if bool((page == BAD_PAGE_INDEX).any()):  # never index the pool with -1 (its last page)
            raise RuntimeError(f"request {rid}: keys on a BAD_PAGE_INDEX block (dropped or stale: no page)")
        return page


class PagedRows(PagePool):
    """One layer's paged HND KV `[pages, 2, kv_heads, tpb, head_dim]`, pages reference-counted.

    A fresh page is never cleared, as TensorRT-LLM never clears one (`_fresh_page_fill` off): it
    holds what the request that last used it left there, or, never used, a poison pattern (random
    rows of the scale of real ones, seeded by `POISON_SEED`). A restore that is short or missed
    therefore leaves wrong rows a test can see, never convenient zeros.

    The pages live on `device` (a GPU's, to time the adapter's copies there); the model may
    compute elsewhere: `write` takes rows from any device, `read` gives them on the pages'.
    `window` (None) says the MTP layer attends every key up to a query.
    """

    window: int | None = None

    def __init__(self, num_pages: int, num_kv_heads: int, tpb: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", roles: int = 2,
                 heads: Sequence[int] | None = None) -> None:
        # `roles` K-sized pages a slot (V2 coalesces buffers of one size and lifecycle into one
        # slot: a QSA pool's index key joins K and V when it is as large, qsa_cache_manager.py);
        # `buf` is the slot's K/V, `[slots, roles, ...][:, :2]`, strided when roles > 2.
        # `heads`: the model's KV heads this pool holds (a tensor-parallel rank's shard,
        # `shard_heads`), None: all `num_kv_heads`; the poison is the whole model's, sliced, so a
        # rank's never-written page is the single-rank page's shard.
        self.heads = list(range(num_kv_heads)) if heads is None else list(heads)
        self.store = _register(torch.empty(num_pages, roles, len(self.heads), tpb, head_dim, dtype=dtype,
                                           device=device))
        poison = poison_page(num_kv_heads, tpb, head_dim, dtype)[:, self.heads]
        self.store.copy_(poison[torch.arange(roles) % 2].expand_as(self.store))
        self.buf = self.store[:, :2]
        super().__init__(num_pages, tpb)

    def copy_page(self, dst: int, src: int) -> None:
        """Page `dst` gets page `src`'s K/V bytes (a paired pool's copy on write)."""
        self.buf[dst] = self.buf[src]

    def page_stride(self, role: str) -> int:
        """Bytes of one page of `role` (`get_page_stride`): K and V pages alike."""
        if role not in (Role.KEY, Role.VALUE):
            raise ValueError(f"a {self.store.dtype} pool has no {role!r} buffer")
        return self.store[0, 0].nbytes

    def base_address(self, role: str) -> int:
        """`get_mem_pool_base_address`: K's pages at the pool's start, V's one page on (V2
        coalesces K and V, one page each, into a slot)."""
        return self.store.data_ptr() + (self.page_stride(role) if role == Role.VALUE else 0)

    def ensure(self, rid: int, num_tokens: int) -> None:
        table = self.tables.setdefault(rid, [])
        while len(table) * self.tpb < num_tokens:
            table.append(self.new_page())

    def share(self, page: int) -> int:
        self._refs[page] += 1
        return page

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

    def key_bytes(self, rid: int, lo: int, hi: int) -> torch.Tensor:
        """Every byte keys `[lo, hi)` hold, uint8 `[hi - lo, 2, Hkv, bytes]` (the stand-in's own
        bookkeeping, for tests: rows compared bit for bit)."""
        page, slot = self._slots(rid, lo, hi)
        return self.buf[page, :, :, slot].contiguous().view(torch.uint8)

    def _slots(self, rid: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(page, slot)` int64 `[hi - lo]` of keys `[lo, hi)`, on the pages' device."""
        keys = torch.arange(lo, hi)
        dev = self.buf.device
        return device_copy(self._pages(rid, keys), dev), device_copy(keys % self.tpb, dev)


def shard_heads(num_kv_heads: int, tp_size: int, tp_rank: int) -> list[int]:
    """The KV heads a tensor-parallel rank holds: `ceil(num_kv_heads / tp_size)` of them
    (`KVCacheManagerV2.__init__`, `kv_cache_manager_v2.py` @ 0004396720054fd8e205cbf616f21f0b57c6b412:
    `(num_kv_heads + tp_size - 1) // tp_size`, `tp_size` 1 under attention DP). Rank `r` holds heads
    `[r * k, (r + 1) * k)` when `k = num_kv_heads / tp_size` is whole; with fewer heads than ranks
    each head is repeated `tp_size / num_kv_heads` times in rank order, so rank `r` holds head
    `r // (tp_size / num_kv_heads)` (`duplicate_kv_weight`, `modeling_utils.py` @
    000a01de66f0eab4ab05640711f0253f50f5209c, which asserts either division is exact)."""
    if num_kv_heads >= tp_size:
        assert num_kv_heads % tp_size == 0, f"{num_kv_heads} KV heads do not split over TP {tp_size}"
        k = num_kv_heads // tp_size
        return list(range(tp_rank * k, (tp_rank + 1) * k))
    assert tp_size % num_kv_heads == 0, f"TP {tp_size} is not a multiple of {num_kv_heads} KV heads"
    return [tp_rank // (tp_size // num_kv_heads)]


def poison_page(num_kv_heads: int, tpb: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """The rows `[2, kv_heads, tpb, head_dim]` every never-written page holds: standard normal
    (the scale of real K/V rows), from `POISON_SEED`, so the same in every pool and run."""
    gen = torch.Generator().manual_seed(POISON_SEED)
    return torch.randn(2, num_kv_heads, tpb, head_dim, generator=gen).to(dtype)


E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""e2m1 magnitudes by code (sign in bit 3), as `cvt.rn.satfinite.e2m1x2.f32` rounds to them."""

NVFP4_GLOBAL_SCALE = 1.0
"""The stand-in layer's second-level K and V scales (`qkv_scale_orig_quant[1]`, `[2]`): the
reference checkpoint has none, so 1, one per layer, constant across requests as TensorRT-LLM's."""


class Nvfp4PagedRows(PagedRows):
    """An NVFP4 draft pool (`DataType.NVFP4`): `store` int8 `[pages, 2, Hkv, tpb, D / 2]` of e2m1
    pairs (as `get_buffers` re-types it, `kv_cache_manager_v2.py` @ 00be09f7) and `scales` uint8
    `[pages, 2, Hkv, tpb, D / 16]`, the K then V block-scale page of each page index (Role
    KEY_BLOCK_SCALE / VALUE_BLOCK_SCALE, addressed by the data's page index:
    `_build_pool_mapping_tensors`' "Block scale offset and offset should be the same").

    `write` is `quantizeAndWriteFP4KVCache`
    (`unfusedAttentionKernels_2_template.h` @ 0097566bd62be830bcbb29fb4782de9564020cda): per
    (token, head) vector, per 16 elements, scale `e4m3(amax / 6 * g)` and values `e2m1(x / (s /
    g))` two to a byte, the even element in the low nibble; K's scales at `row * S + s` of its
    page, V's at `(row // 4) * 4 * S + s * 4 + row % 4` (`row = head * tpb + slot`, `S = D/16`:
    the interleave "only used by trtllm-gen kernels"); `g` is `NVFP4_GLOBAL_SCALE`. `read`
    dequantizes (`e2m1 * s / g`), what the attention kernel computes with. Poison: random bytes
    (finite scale codes), so a missed restore reads wrong rows."""

    def __init__(self, num_pages: int, num_kv_heads: int, tpb: int, head_dim: int,
                 device: torch.device | str = "cpu") -> None:
        if head_dim % 16:
            raise ValueError(f"NVFP4 KV needs head_dim a multiple of 16, got {head_dim}")
        self.heads = list(range(num_kv_heads))  # every head: the stand-in shards BF16 and FP8 pools only
        self.store = _register(torch.empty(num_pages, 2, num_kv_heads, tpb, head_dim // 2, dtype=torch.int8,
                                           device=device))
        self.scales = _register(torch.empty(num_pages, 2, num_kv_heads, tpb, head_dim // 16,
                                            dtype=torch.uint8, device=device))
        gen = torch.Generator().manual_seed(POISON_SEED)
        payload = torch.randint(-128, 128, (2, num_kv_heads, tpb, head_dim // 2), generator=gen, dtype=torch.int8)
        scales = torch.randint(0x08, 0x50, (2, num_kv_heads, tpb, head_dim // 16), generator=gen, dtype=torch.uint8)
        self.store.copy_(payload.expand_as(self.store))
        self.scales.copy_(scales.expand_as(self.scales))
        self.buf = self.store
        self.tpb = tpb
        self.head_dim = head_dim
        self._free = deque(range(num_pages))
        self._refs = [0] * num_pages
        self.tables = {}

    def copy_page(self, dst: int, src: int) -> None:
        self.store[dst] = self.store[src]
        self.scales[dst] = self.scales[src]

    def page_stride(self, role: str) -> int:
        if role in (Role.KEY_BLOCK_SCALE, Role.VALUE_BLOCK_SCALE):
            return self.scales[0, 0].nbytes
        return super().page_stride(role)

    def base_address(self, role: str) -> int:
        if role in (Role.KEY_BLOCK_SCALE, Role.VALUE_BLOCK_SCALE):
            return self.scales.data_ptr() + (self.page_stride(role) if role == Role.VALUE_BLOCK_SCALE else 0)
        return super().base_address(role)

    def _scale_at(self, page: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """`[n, 2, Hkv, S]` flat offsets into `scales` of keys at (`page`, `slot`)."""
        _, _, h, tpb, nb = self.scales.shape
        row = torch.arange(h, device=slot.device)[None, :, None] * tpb + slot[:, None, None]
        blk = torch.arange(nb, device=slot.device)
        k_at = row * nb + blk
        v_at = (row // 4) * 4 * nb + blk * 4 + row % 4
        base = page[:, None, None, None] * (2 * h * tpb * nb)
        return base + torch.stack((k_at, v_at + h * tpb * nb), dim=1)

    def key_bytes(self, rid: int, lo: int, hi: int) -> torch.Tensor:
        """Each key's payload bytes, then its scale bytes in block order (read at the writer's
        addresses), uint8 `[hi - lo, 2, Hkv, D/2 + D/16]`."""
        page, slot = self._slots(rid, lo, hi)
        payload = self.store[page, :, :, slot].view(torch.uint8)
        return torch.cat((payload, self.scales.view(-1)[self._scale_at(page, slot)]), dim=-1)

    def write(self, rid: int, lo: int, k: torch.Tensor, v: torch.Tensor) -> None:
        page, slot = self._slots(rid, lo, lo + k.shape[0])
        rows = torch.stack((k, v), dim=1).float().to(self.store.device)  # [n, 2, Hkv, D]
        blocks = rows.unflatten(-1, (-1, 16))  # [n, 2, Hkv, S, 16]
        amax = blocks.abs().amax(-1)
        sf = (amax / 6.0 * NVFP4_GLOBAL_SCALE).to(torch.float8_e4m3fn)
        dec = sf.float() / NVFP4_GLOBAL_SCALE
        grid = torch.tensor(E2M1_GRID, device=rows.device)
        x = torch.where(dec[..., None] > 0, blocks / dec[..., None].clamp_min(1e-30), 0.0)
        mag = x.abs().clamp_max(6.0)
        mid = (grid[1:] + grid[:-1]) / 2
        code = torch.bucketize(mag, mid)  # ties go to the lower code ...
        tie = (code < 7) & (mag == mid[code.clamp_max(6)]) & (code % 2 == 1)
        code = code + tie.long()  # ... then to the even one (round to nearest even)
        nib = (code | ((x < 0).long() << 3)).to(torch.uint8).flatten(-2)  # [n, 2, Hkv, D]
        packed = (nib[..., 0::2] | (nib[..., 1::2] << 4)).view(torch.int8)
        self.store[page, :, :, slot] = packed
        self.scales.view(-1)[self._scale_at(page, slot)] = sf.view(torch.uint8)

    def read(self, rid: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        page, slot = self._slots(rid, lo, hi)
        packed = self.store[page, :, :, slot].view(torch.uint8)  # [n, 2, Hkv, D/2]
        nib = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).long()  # [n, 2, Hkv, D]
        grid = torch.tensor(E2M1_GRID, device=packed.device)
        val = grid[nib & 7] * torch.where(nib & 8 > 0, -1.0, 1.0)
        sf = self.scales.view(-1)[self._scale_at(page, slot)].view(torch.float8_e4m3fn).float()
        rows = (val.unflatten(-1, (-1, 16)) * (sf / NVFP4_GLOBAL_SCALE)[..., None]).flatten(-2)
        return rows[:, 0], rows[:, 1]


def _manager_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The manager's `_stream` for pages on `device`: a fresh CUDA stream there, None on the CPU."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None


class KVCacheManager(Conformant):
    """Stand-in for `tensorrt_llm.runtime.kv_cache_manager_v2.KVCacheManager`, a V2 manager's
    `impl`: the two calls the carry makes to reach an NVFP4 pool's block-scale pages, as
    `KVCacheManagerV2._build_pool_mapping_tensors` and `get_buffers` make them
    (`kv_cache_manager_v2.py` @ 00be09f7; `_storage.get_mem_pool_base_address`: the role's pool
    at slot 0, "for one layer, multiple buffers of the same size have the same base address" and
    follow each other; `get_page_stride`: "Currently always equals to page size"). The draft
    pool's one local layer is 0; another layer, or a role the pool lacks, is a ValueError (V2's
    `get_buffer_attr` raises for an unknown buffer)."""

    TRTLLM_CLASS = "KVCacheManagerPy"  # as kv_cache_manager_v2.py imports it (`KVCacheManager as KVCacheManagerPy`)

    def __init__(self, paged: PagedRows) -> None:
        self._paged = paged

    def _check(self, layer_id: int) -> None:
        if layer_id != 0:
            raise ValueError(f"the stand-in draft pool holds local layer 0, not {layer_id}")

    def get_mem_pool_base_address(self, layer_id: int, data_role: str, index_mode: object = None) -> int:
        self._check(layer_id)
        return self._paged.base_address(data_role)

    def get_page_stride(self, layer_id: int, data_role: str) -> int:
        self._check(layer_id)
        return self._paged.page_stride(data_role)


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
        # the V2 runtime manager (`self.impl = KVCacheManagerPy(config)`, kv_cache_manager_v2.py @
        # 00be09f7): its pool addresses
        self.impl = KVCacheManager(paged) if paged is not None else None

    def preempt_request(self, req: Any) -> None:
        """`KVCacheManagerV2.preempt_request` (kv_cache_manager_v2.py @
        38198e34582cf777ecc72062f477987284ba9999; absent @ 0004396720054fd8e205cbf616f21f0b57c6b412):
        without a KV connector, a draft mirror or a capacity-only release, `_release_preempted`,
        which calls this manager's own `free_resources(req)` ("The caller resets the request to
        context state"): the pages go at once, not through `ResourceManager.free_resources`."""
        self.free_resources(req)

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
            self.pool.copy_page(page, entry.pages[full])  # copy on write
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
            self.pool.copy_page(page, table[n // tpb])
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
