"""Stand-in for `tensorrt_llm/_torch/attention/backends/sparse/deepseek_v4/cache_manager.py`: DeepSeek-V4's draft pool.

Read (nothing ran): `cache_manager.py` @ 0b03b6afc16c24de7556e3abf7b78e9ccae2def4 and @
38198e34582cf777ecc72062f477987284ba9999, `params.py` @ 50aec1cbae9c474f177ec905be5897abf99bc481,
`metadata.py` and `kernels.py` @ 0b03b6af, `footer_scale_kv.py` @
d77955c52716fe6ff51d047f0eb93a443a342ef9, `flash_mla.py` @ 7de08c31c5c1bf627e4f7177b41ddc40fcf0ccfe,
and the V2 runtime's `_life_cycle_registry.py` @ 1548780d8b82c1d5fb3c8052d2127179a88e18b7,
`_core/_kv_cache.py` @ 00f6bd61f297eaefd98fcabd562d3a8e3df12a96, `_core/_kv_cache_manager.py` @
0004396720054fd8e205cbf616f21f0b57c6b412. What the stand-in follows, row by row:

- `DeepseekV4AttentionType` (params.py): an `Enum`, `SWA = 0` first of the sliding roles, `.role`
  the `DataRole` `deepseek_v4_<name>`.
- `get_sm_version()`: `tensorrt_llm._utils`' as cache_manager.py imports it; here the modelled
  GPU's (`SM_VERSION`, set by the stand-in's build; 100 unless a test says otherwise).
- `DeepseekV4CacheManager(KVCacheManagerV2)`: `_supports_reuse_match_backoff = False` (both trees)
  and `_supports_draft_reuse_match_backoff = False` (@ 38198e34): never paired. Its constructor
  asserts `tokens_per_block in [128, 256]` and `num_kv_heads == 1` (SELFKONLY MLA latent); sets
  `use_fp8_ds_mla = kv_cache_config.dtype == "fp8_ds_mla"`; raises on Hopper (`sm 90`) without
  `fp8_ds_mla` and for `fp8_ds_mla` off Hopper unless `tokens_per_block == 256`; an NVFP4 `dtype`
  gives its sliding buffers `cache_dtype = DataType.FP8` (`self.dtype` is FP8).
- The draft pool holds the one MTP layer; with compress ratio 1 (`metadata.py` refuses a separate
  draft pool otherwise) `_build_cache_config` gives it only `[SWA]`, with
  `sliding_window_size = window_size + max_draft_len` (`_get_window_size`); `window_size` is
  128 (`DeepSeekV4Params`, asserted by metadata.py).
- `get_buffers(layer_idx, attn_type)`: `[pages, tokens_per_block, 512]` of `self.dtype` for SWA
  (`attn_dim = head_dim`), uint8 `[pages, tokens_per_block, 584]` with `use_fp8_ds_mla`
  ("footer-scale pages are byte-packed rather than token-major"); another role of the layer is a
  KeyError (`_layer_attn_to_layer_id[(layer_idx, attn_type)]`: the layer has none).
- `get_cache_indices(request_id, layer_idx, attn_type)`: `kv_cache_map[request_id]` (KeyError for a
  request the pool does not hold), its base page indices through the layer's
  `PageIndexConverter` in `PageIndexMode.PER_LAYER` (one layer: scale 1, layer offset 0, so the
  page; `BAD_PAGE_INDEX` kept, `_kv_cache_manager.py` @ 0004396). The base
  `get_batch_cache_indices` raises: "DSV4 allocates no generic Role.KEY buffer", so its lookup
  raises "Unknown buffer id" (`_resolve_guard_candidate` @ 38198e34).
- Blocks: `AttnLifeCycle.get_stale_range(history, tpb)` is `[0, (history + 1 - window) // tpb)`
  blocks (no sink tokens); a non-committing cache (an unpaired draft) releases a block's page as it
  goes stale (`_unlock_stale_blocks`: `beam_block[lc] = None`), and a new cache's blocks below its
  history's window get none: their page indices are `BAD_PAGE_INDEX`. `prepare_resources` resizes
  as the base draft pool does (context: capacity `position + chunk + draft_len`, history
  `position`; generation: capacity `N + 1 + 2 * draft_len`, history `N - 1`).
- What a page holds (the attention op's writes of the latent): BF16 as is; FP8 cast with the
  layer's static scale (1 here); `fp8_ds_mla` as `quant_scatter` writes it with Hopper's
  `page_size = tokens_per_block` (`flash_mla.py`): per key, 7 tiles of 64 latent values as e4m3
  under a UE8M0 power-of-two scale, the 64 RoPE values as bf16, data rows first in the page,
  then the footer rows; the footer's eighth byte is never written.

Stand-in choices (not the source's): the reference model's MTP layer is not MLA; its K and V
vectors (`num_kv_heads * head_dim` each) fill the latent row, V at the front of the quantized
part, K in the RoPE part, zeros between, and `read` takes them back out (dequantized as
`dequant_gather` does). Names the source lacks raise (`Conformant`). SWA scratch reuse
(`SwaScratchReuseConfig`) is not modelled: its scratch blocks are stale at the chunk's end and
hold no page of their own (`ScratchDesc`), which the carry never reads.
"""

from __future__ import annotations

import enum
from typing import Any

import torch

from .kv_cache_manager_v2 import BAD_PAGE_INDEX, POISON_SEED, DraftKVManager, PagePool, _register
from .llm_args import KvCacheConfig
from .mapping import Mapping
from .resource_manager import _TORCH_DTYPES, DataType
from .scheduler import ScheduledRequests

SM_VERSION = 100
"""The modelled GPU's compute capability, what `get_sm_version()` returns (the build sets it)."""

LATENT_DIM = 512
"""`kv_lora_rank + qk_rope_head_dim`: the SWA buffer's `attn_dim` (`get_attn_dim`, SWA -> head_dim)."""
WINDOW_SIZE = 128
"""`DeepSeekV4Params.window_size`, asserted 128 by `DeepseekV4TrtllmAttentionMetadata`."""
DIM_NOPE, DIM_ROPE, QUANT_TILE = 448, 64, 64  # footer_scale_kv.py @ d77955c5
DATA_ROW_BYTES = DIM_NOPE + DIM_ROPE * 2
FOOTER_ROW_BYTES = DIM_NOPE // QUANT_TILE + 1
TOKEN_BYTES = DATA_ROW_BYTES + FOOTER_ROW_BYTES
FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max, as footer_scale_kv's _FP8_MAX


def get_sm_version() -> int:
    """`tensorrt_llm._utils.get_sm_version` on the modelled GPU."""
    return SM_VERSION


class DeepseekV4AttentionType(enum.Enum):
    """`params.py` @ 50aec1cb: DeepSeek-V4's cache roles (sliding ones first, contiguous)."""

    SWA = 0
    COMPRESSOR_KV = 1
    COMPRESSOR_SCORE = 2
    INDEXER_COMPRESSOR_KV = 3
    INDEXER_COMPRESSOR_SCORE = 4
    COMPRESS = 5
    INDEXER_COMPRESS = 6

    @property
    def role(self) -> str:
        return f"deepseek_v4_{self.name.lower()}"


class SlidingLatentRows(PagePool):
    """The MTP layer's SWA pages of a DeepSeek-V4 pool (see the module doc): `store` `[pages, tpb,
    512]` (BF16 or float8_e4m3fn) or uint8 `[pages, tpb, 584]` (`fp8_ds_mla`), per request a block
    table whose stale blocks hold `BAD_PAGE_INDEX`. Pages are reference counted as `PagedRows`'s;
    a fresh page is never cleared (poison until first written). `window` is what the MTP layer
    reads (`[k - 127, k]`), `retention` the pool's sliding window (`window + max_draft_len`)."""

    def __init__(self, num_pages: int, tpb: int, *, dtype: torch.dtype, footer: bool, retention: int,
                 device: torch.device | str = "cpu") -> None:
        width = TOKEN_BYTES if footer else LATENT_DIM
        self.footer = footer
        self.store = _register(torch.empty(num_pages, tpb, width, dtype=torch.uint8 if footer else dtype,
                                           device=device))
        gen = torch.Generator().manual_seed(POISON_SEED)
        if footer or dtype == torch.float8_e4m3fn:
            codes = torch.randint(0, 256, (tpb, width), generator=gen, dtype=torch.uint8)
            if not footer:
                codes[(codes & 0x7F) == 0x7F] = 0x3C  # e4m3fn NaN codes: finite poison
            self.store.view(torch.uint8).copy_(codes.expand(num_pages, tpb, width))
        else:
            self.store.copy_(torch.randn(tpb, width, generator=gen).to(dtype).expand(num_pages, tpb, width))
        self.buf = self.store  # what the base manager's bookkeeping reads
        super().__init__(num_pages, tpb)
        self.window = WINDOW_SIZE
        self.retention = retention
        self.history: dict[int, int] = {}

    # ---- blocks ---------------------------------------------------------------------------

    def stale_end(self, history: int) -> int:
        """`AttnLifeCycle.get_stale_range(history, tpb).end` (no sink blocks)."""
        return max(0, (history + 1 - self.retention) // self.tpb)

    def resize(self, rid: int, capacity: int, history: int) -> None:
        """`_KVCache.resize(capacity, history)` of a non-committing cache: blocks up to `capacity`
        exist, those gone stale at `history` hold no page (released now, or never given)."""
        table = self.tables.setdefault(rid, [])
        stale = self.stale_end(history)
        while len(table) * self.tpb < capacity:
            table.append(BAD_PAGE_INDEX if len(table) < stale else self.new_page())
        for b in range(min(stale, len(table))):
            if table[b] != BAD_PAGE_INDEX:
                self.unref(table[b])
                table[b] = BAD_PAGE_INDEX
        self.history[rid] = history

    def ensure(self, rid: int, num_tokens: int) -> None:
        """Capacity for `num_tokens` at the request's current history (`PagedRows.ensure`'s role)."""
        self.resize(rid, num_tokens, self.history.get(rid, 0))

    def release(self, rid: int) -> None:
        super().release(rid)
        self.history.pop(rid, None)

    # ---- what the attention op writes and reads ----------------------------------------------

    @staticmethod
    def latent(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The stand-in's latent row of K and V `[n, Hkv, D]`: `[v | 0 | k]`, k in the RoPE part."""
        n = k.shape[0]
        kf, vf = k.reshape(n, -1).float(), v.reshape(n, -1).float()
        if kf.shape[1] > DIM_ROPE or vf.shape[1] > DIM_NOPE:
            raise ValueError(f"K ({kf.shape[1]}) or V ({vf.shape[1]}) values do not fit the latent row")
        row = torch.zeros(n, LATENT_DIM)
        row[:, : vf.shape[1]] = vf
        row[:, LATENT_DIM - kf.shape[1]:] = kf
        return row

    def _byte_offsets(self, page: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """`quant_scatter`'s addresses of each key's data row then footer row, `page_size = tpb`:
        slot `loc = page * tpb + slot`, writer page `loc // tpb`, offset `loc % tpb`."""
        p = self.tpb
        loc = page * self.tpb + slot
        base = (loc // p) * (p * TOKEN_BYTES)
        off = loc % p
        data = (base + off * DATA_ROW_BYTES)[:, None] + torch.arange(DATA_ROW_BYTES)
        foot = (base + p * DATA_ROW_BYTES + off * FOOTER_ROW_BYTES)[:, None] + torch.arange(DIM_NOPE // QUANT_TILE)
        return torch.cat((data, foot), dim=1)  # [n, 576 + 7]: the pad byte is never written

    def write(self, rid: int, lo: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keys `[lo, lo + n)` get the latent row of `k` (roped) and `v` `[n, Hkv, D]`."""
        keys = torch.arange(lo, lo + k.shape[0])
        page, slot = self._pages(rid, keys), keys % self.tpb
        row = self.latent(k, v)
        if not self.footer:
            self.store[page, slot] = row.to(self.store.dtype)
            return
        tiles = row[:, :DIM_NOPE].unflatten(1, (-1, QUANT_TILE))  # [n, 7, 64]
        max_abs = tiles.abs().amax(-1).clamp_min(1e-8)
        ceil_log2 = torch.ceil(torch.log2(max_abs / FP8_MAX))
        q = (tiles * torch.exp2(-ceil_log2)[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        scale = (ceil_log2.to(torch.int32) + 127).to(torch.uint8)
        rope = row[:, DIM_NOPE:].to(torch.bfloat16).contiguous().view(torch.uint8)  # [n, 128]
        written = torch.cat((q.flatten(1).view(torch.uint8), rope, scale), dim=1)
        self.store.view(-1)[self._byte_offsets(page, slot)] = written

    def read(self, rid: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(k, v)` of keys `[lo, hi)` as the attention kernel reads them (dequantized), float32."""
        keys = torch.arange(lo, hi)
        page, slot = self._pages(rid, keys), keys % self.tpb
        if self.footer:
            raw = self.store.view(-1)[self._byte_offsets(page, slot)]
            nope = raw[:, :DIM_NOPE].contiguous().view(torch.float8_e4m3fn).float()
            scales = torch.exp2(raw[:, DATA_ROW_BYTES:].float() - 127.0).repeat_interleave(QUANT_TILE, dim=1)
            rope = raw[:, DIM_NOPE:DATA_ROW_BYTES].contiguous().view(torch.bfloat16).float()
            row = torch.cat((nope * scales, rope), dim=1)
        else:
            row = self.store[page, slot].float()
        return row, row  # split by the caller's geometry (`DeepseekV4CacheManager.read_kv`)

    @property
    def key_bytes_per_key(self) -> int:
        """Bytes one key holds (`key_bytes`' second dimension)."""
        return TOKEN_BYTES if self.footer else self.store[0, 0].view(torch.uint8).numel()

    def key_bytes(self, rid: int, lo: int, hi: int) -> torch.Tensor:
        """Every byte keys `[lo, hi)` hold (the footer's pad byte included), uint8 `[hi - lo, bytes]`
        (the stand-in's bookkeeping, for tests)."""
        keys = torch.arange(lo, hi)
        page, slot = self._pages(rid, keys), keys % self.tpb
        if self.footer:
            at = self._byte_offsets(page, slot)
            return self.store.view(-1)[torch.cat((at, at[:, -1:] + 1), dim=1)]
        return self.store[page, slot].contiguous().view(torch.uint8)


class LatentPool:
    """The executor's view of the pool (`StandinPyExecutor.paged`): K/V rows in, K/V rows out, read
    over the MTP layer's window; the pages and tables are `rows`'."""

    def __init__(self, rows: SlidingLatentRows, num_kv_heads: int, head_dim: int) -> None:
        self.rows = rows
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.window = rows.window
        self.tpb = rows.tpb
        self.buf = rows.store

    @property
    def tables(self) -> dict[int, list[int]]:
        return self.rows.tables

    def write(self, rid: int, lo: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.rows.write(rid, lo, k, v)

    def read(self, rid: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        row, _ = self.rows.read(rid, lo, hi)
        width = self.num_kv_heads * self.head_dim
        v = row[:, :width].view(-1, self.num_kv_heads, self.head_dim)
        k = row[:, LATENT_DIM - width:].reshape(-1, self.num_kv_heads, self.head_dim)
        return k, v

    def key_bytes(self, rid: int, lo: int, hi: int) -> torch.Tensor:
        return self.rows.key_bytes(rid, lo, hi)

    def release(self, rid: int) -> None:
        self.rows.release(rid)

    def ensure(self, rid: int, num_tokens: int) -> None:
        self.rows.ensure(rid, num_tokens)

    def pages_in_use(self) -> int:
        return self.rows.pages_in_use()


class DeepseekV4CacheManager(DraftKVManager):
    """DeepSeek-V4's separate draft pool (see the module doc): the MTP layer's sliding-window latent."""

    TRTLLM_CLASS = "DeepseekV4CacheManager"
    _supports_reuse_match_backoff = False
    _supports_draft_reuse_match_backoff = False

    def __init__(self, pool: LatentPool, *, mtp_layer: int, kv_cache_config: KvCacheConfig, dtype: DataType,
                 draft_len: int, mapping: Mapping, entries: int = 0, paired: bool = False,
                 num_kv_heads: int = 1) -> None:
        tpb = pool.tpb
        if tpb not in (128, 256):
            raise AssertionError(f"DeepseekV4CacheManager requires tokens_per_block in [128, 256], got {tpb}. "
                                 "Set kv_cache_config.tokens_per_block to 128 or 256.")
        if num_kv_heads != 1:
            raise AssertionError("DeepSeek-V4 only supports num_kv_heads == 1")
        if dtype not in (DataType.BF16, DataType.FP8, DataType.NVFP4):
            raise AssertionError(f"Unsupported dtype: {dtype}, only support BF16, FP8 and NVFP4")
        self.use_fp8_ds_mla = kv_cache_config.dtype == "fp8_ds_mla"
        sm_version = get_sm_version()
        if sm_version == 90 and not self.use_fp8_ds_mla:
            raise ValueError("DeepSeek-V4 on Hopper requires kv_cache_config.dtype='fp8_ds_mla'; "
                             f"got {kv_cache_config.dtype!r}.")
        if self.use_fp8_ds_mla and sm_version != 90 and tpb != 256:
            raise ValueError("DeepSeek-V4 fp8_ds_mla KV cache requires tokens_per_block=256 "
                             f"on SM{sm_version}, got {tpb}.")
        cache_dtype = DataType.FP8 if dtype == DataType.NVFP4 else dtype
        super().__init__(pool, mtp_layer=mtp_layer, paired=paired, entries=entries, draft_len=draft_len,  # type: ignore[arg-type]
                         dtype=cache_dtype, mapping=mapping, kv_cache_config=kv_cache_config)
        self.latent = pool.rows

    def get_buffers(self, layer_idx: int, attn_type: DeepseekV4AttentionType) -> torch.Tensor:  # type: ignore[override]
        if (layer_idx, attn_type) != (self.mtp_layer, DeepseekV4AttentionType.SWA):
            raise KeyError((layer_idx, attn_type))  # _layer_attn_to_layer_id: the layer has SWA only
        return self.latent.store

    def get_cache_indices(self, request_id: int, layer_idx: int, attn_type: DeepseekV4AttentionType) -> list[int]:
        if (layer_idx, attn_type) != (self.mtp_layer, DeepseekV4AttentionType.SWA):
            raise KeyError((layer_idx, attn_type))
        return list(self.latent.tables[request_id])  # kv_cache_map[request_id]: KeyError when not held

    def get_batch_cache_indices(self, request_ids: list[int], layer_idx: int | None = None,
                                num_blocks_per_seq: Any = None) -> list[list[int]]:
        raise ValueError("Unknown buffer id: DeepSeek-V4 allocates no generic Role.KEY buffer "
                         "(use get_cache_indices with an attn_type)")

    def prepare_resources(self, scheduled_batch: ScheduledRequests) -> None:
        for r in scheduled_batch.context_requests:
            pos = r.context_current_position
            self.latent.resize(r.py_request_id, pos + r.context_chunk_size + self.draft_len, pos)
        for r in scheduled_batch.generation_requests:
            n = len(r.tokens)
            self.latent.resize(r.py_request_id, n + 1 + 2 * self.draft_len, n - 1)

    def free_resources(self, request: Any) -> None:
        self.latent.release(request.py_request_id)


def latent_pool(num_pages: int, tpb: int, *, kv_dtype: DataType, fp8_ds_mla: bool, max_draft_len: int,
                num_kv_heads: int, head_dim: int, device: torch.device | str = "cpu") -> LatentPool:
    """The draft pool's SWA pages for `kv_dtype` (NVFP4: FP8 pages) or footer-scale ones."""
    dtype = _TORCH_DTYPES[DataType.FP8 if kv_dtype == DataType.NVFP4 else kv_dtype]
    rows = SlidingLatentRows(num_pages, tpb, dtype=dtype, footer=fp8_ds_mla,
                             retention=WINDOW_SIZE + max_draft_len, device=device)
    return LatentPool(rows, num_kv_heads, head_dim)
