"""An NVFP4 KV pool's own rows: payload and block-scale bytes, addressed as TensorRT-LLM writes them.

What it is for: where a draft pool stores NVFP4 KV (`kv_cache_config.dtype: nvfp4`,
Blackwell), a carried row is the pool's own bytes, moved bit for bit (`row_codec`
`nvfp4_kv`): never dequantized, never re-scaled. This module holds the two page views
and the addressing of one key's bytes in them.

What the source shows (nothing ran here):
- Pages. `KVCacheManagerV2._build_cache_config` adds `Role.KEY_BLOCK_SCALE` and
  `Role.VALUE_BLOCK_SCALE` buffers beside K/V when `kv_cache_config.dtype == "nvfp4"`,
  `get_layer_bytes_per_token(layer, KEY_BLOCK_SCALE)` being `Hkv * D / 16` (one e4m3 byte
  per 16 elements); `get_buffers` re-types the payload pages to int8, `head_dim // 2` a
  row (`[pages, kv_factor, Hkv, tpb, D // 2]` HND); `_build_pool_mapping_tensors` pairs
  each pool's K base with its `KEY_BLOCK_SCALE` base (`kv_cache_pool_pointers[..., 1]`)
  and asserts "Block scale offset and offset should be the same", the scale offset being
  measured in `bytes_per_token(KEY_BLOCK_SCALE) * kv_factor * tokens_per_block` units: the
  scale pages are addressed by the same page index as the data, K's then V's scale page
  side by side as K's then V's data page
  (`tensorrt_llm/_torch/pyexecutor/kv_cache_manager_v2.py` @
  00be09f78ecf0691f2b8e15dea518d1d6468679e, main-line, and the index's earlier versions).
  The attention op builds the scale `KVBlockArray` with `sizePerToken / 8` bytes a token,
  the scale pool pointers and the SAME `block_offsets` as the data (the thop QKV
  preprocessing op, index version read in this pass).
- Bytes in a page. `KVBlockArray::getKVLocalIdx(token, head, dimsPerHead, channel) =
  head * tokensPerBlock * dimsPerHead + (token % tokensPerBlock) * dimsPerHead + channel`
  (`cpp/tensorrt_llm/kernels/kvCacheUtils.h` @ deaae40bd795f9cea7238fafcff038b1de1ac83f):
  HND. `quantizeAndWriteFP4KVCache`
  (`cpp/tensorrt_llm/kernels/unfusedAttentionKernels/unfusedAttentionKernels_2_template.h`
  @ 0097566bd62be830bcbb29fb4782de9564020cda) writes K's scale of block `s` of (token,
  head) at `row * S + s` of the K scale page, `row = head * tpb + token % tpb`, `S = D/16`
  (vector order, as the payload), and V's at `(row // 4) * 4 * S + s * 4 + row % 4` of the V
  scale page ("A interleaved layout (num_tokens / 4, num_sfs_per_head, 4) ... only used
  by trtllm-gen kernels"). The per-layer second-level scales (`qkv_scale_orig_quant[1]`,
  `[2]`, float32) are the checkpoint's, constant across requests: no carried row needs
  them.

So key `k` of a request is, for role `r` (0 K, 1 V) and head `h`: payload
`payload[page, r, h, k % tpb]` (`D/2` bytes) and scale bytes `scale_offsets(Hkv, tpb, S, k % tpb)[r, h, s]`
of scale page `(page, r)`, `page = pages[k // tpb]`. A gather reads them in vector order
(V's de-interleaved), a scatter writes each byte back at the address it came from: the
page's bytes for keys `[lo, hi)` are the source page's, whatever kernel reads them.

Invariants:
- One indexed copy per tensor per call, no Python loop over keys, heads or blocks; a
  gather given `out` (e.g. a view of an arena extent) writes those copies straight there;
- `Nvfp4KvRows.nbytes == core.row_format.rows_nbytes("nvfp4_kv", n * 2 * Hkv, D)`;
- a scatter checks the rows against the pages before its first write.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .hnd_pages import index_into, key_slots
from .row_layout import PackedRowsBase, check_out

__all__ = ["FP4_BLOCK", "NVFP4_KV_DTYPE", "Nvfp4KvPages", "Nvfp4KvRows", "gather_kv_pages", "scale_offsets",
           "scatter_kv_pages"]

NVFP4_KV_DTYPE: torch.dtype = getattr(torch, "float4_e2m1fn_x2", torch.quint4x2)
"""The pool dtype naming an NVFP4 KV pool to `row_codec.codec_for` (its pages are int8 or uint8
views of e2m1 pairs: TensorRT-LLM's `get_buffers` gives int8, which an INT8 KV pool would give
too): torch's e2m1 pair dtype (torch >= 2.7), else its other two-4-bit-values-a-byte dtype. A
marker only: no tensor of it is made."""

FP4_BLOCK = 16
"""Elements per e4m3 block scale (`SF_VEC_SIZE = 16` in `quantizeAndWriteFP4KVCache`)."""

V_SCALE_GROUP = 4
"""Tokens whose V scales `quantizeAndWriteFP4KVCache` interleaves (`(num_tokens / 4, num_sfs_per_head, 4)`)."""


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


@dataclass(frozen=True, slots=True)
class Nvfp4KvPages:
    """An NVFP4 draft pool's MTP-layer pages: `payload` `[pages, 2, Hkv, tpb, D/2]` (int8 or
    uint8: e2m1 pairs) and `scales` `[pages, 2, Hkv, tpb, D/16]` uint8 (the K and V scale
    pages of each page index, each page's bytes as `scale_offsets` addresses them). `shape` is
    the logical `[pages, 2, Hkv, tpb, D]`."""

    payload: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self) -> None:
        p, s = self.payload, self.scales
        if p.dim() != 5 or s.dim() != 5 or p.shape[:4] != s.shape[:4] or p.shape[1] != 2:
            raise ValueError(f"NVFP4 pages need payload [pages, 2, Hkv, tpb, D/2] and scales "
                             f"[pages, 2, Hkv, tpb, D/16], got {tuple(p.shape)} and {tuple(s.shape)}")
        if p.dtype not in (torch.int8, torch.uint8) or s.dtype != torch.uint8:
            raise ValueError(f"NVFP4 pages are int8/uint8 payload and uint8 scales, got {p.dtype}, {s.dtype}")
        if p.shape[4] * 2 != s.shape[4] * FP4_BLOCK:
            raise ValueError(f"payload {p.shape[4]} bytes and {s.shape[4]} scales a vector: not one "
                             f"e4m3 scale per {FP4_BLOCK} elements")
        if not s.is_contiguous() or p.device != s.device:
            raise ValueError("NVFP4 scale pages must be one contiguous view on the payload's device")

    @property
    def shape(self) -> torch.Size:
        n, two, h, tpb, half = self.payload.shape
        return torch.Size((n, two, h, tpb, half * 2))

    @property
    def dtype(self) -> torch.dtype:
        return NVFP4_KV_DTYPE

    @property
    def device(self) -> torch.device:
        return self.payload.device

    def dim(self) -> int:
        return 5


@dataclass(frozen=True, slots=True)
class Nvfp4KvRows(PackedRowsBase):
    """Held rows of an NVFP4 pool: `payload` `[n, 2, Hkv, D/2]` and `scales` `[n, 2, Hkv, D/16]`
    uint8, every (row, K/V, head) vector's bytes in vector order. `shape` is `[n, 2, Hkv, D]`."""

    payload: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self) -> None:
        p, s = self.payload, self.scales
        if (p.dtype != torch.uint8 or s.dtype != torch.uint8 or p.dim() != 4 or s.dim() != 4
                or p.shape[:3] != s.shape[:3] or p.shape[3] * 2 != s.shape[3] * FP4_BLOCK):
            raise ValueError(f"NVFP4 KV rows are uint8 payload [n, 2, Hkv, D/2] and scales [n, 2, Hkv, "
                             f"D/16], got {p.dtype} {tuple(p.shape)} and {s.dtype} {tuple(s.shape)}")

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.payload.shape[:3], self.payload.shape[3] * 2))

    @property
    def dtype(self) -> torch.dtype:
        return NVFP4_KV_DTYPE

    @property
    def nbytes(self) -> int:
        return int(self.payload.nbytes + self.scales.nbytes)


def scale_offsets(n_heads: int, tpb: int, nblocks: int, slot: torch.Tensor) -> torch.Tensor:
    """`[n, 2, Hkv, S]` byte offsets, within a page index's scale bytes `[2 * Hkv * tpb * S]`,
    of the scales of keys at in-page `slot` `[n]` (int64): role `r` at `r * Hkv * tpb * S`,
    then K's `row * S + s` and V's `(row // 4) * 4 * S + s * 4 + row % 4`,
    `row = head * tpb + slot`."""
    dev = slot.device
    head = torch.arange(n_heads, dtype=torch.int64, device=dev)
    blk = torch.arange(nblocks, dtype=torch.int64, device=dev)
    row = head[None, :, None] * tpb + slot[:, None, None]  # [n, Hkv, 1]
    k_off = row * nblocks + blk  # [n, Hkv, S]
    v_off = (row // V_SCALE_GROUP) * V_SCALE_GROUP * nblocks + blk * V_SCALE_GROUP + row % V_SCALE_GROUP
    page_bytes = n_heads * tpb * nblocks
    return torch.stack((k_off, v_off + page_bytes), dim=1)  # [n, 2, Hkv, S]


def _flat_scale_index(pages: Nvfp4KvPages, page: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    _, _, h, tpb, nblocks = pages.scales.shape
    per_index = 2 * h * tpb * nblocks
    return page[:, None, None, None] * per_index + scale_offsets(h, tpb, nblocks, slot)


def gather_kv_pages(pages: Nvfp4KvPages, page_ids: Sequence[int], lo: int, hi: int,
                    out: Nvfp4KvRows | None = None) -> Nvfp4KvRows:
    """Keys `[lo, hi)` of request pages `page_ids`: their payload and scale bytes, vector order;
    written into `out` when given (rows `[hi - lo, 2, Hkv, D]` on the pages' device, contiguous:
    `row_layout.check_out`, before any write) and `out` returned, else into new tensors."""
    page, slot = key_slots(page_ids, lo, hi, pages.scales.shape[3], pages.device)
    _, two, h, _, half = pages.payload.shape
    if out is None:
        out = Nvfp4KvRows(torch.empty((hi - lo, two, h, half), dtype=torch.uint8, device=pages.device),
                          torch.empty((hi - lo, two, h, pages.scales.shape[4]), dtype=torch.uint8,
                                      device=pages.device))
    else:
        check_out(out, Nvfp4KvRows, (hi - lo, two, h, 2 * half), NVFP4_KV_DTYPE, pages.device)
    index_into(_u8(pages.payload), [page, None, None, slot], out.payload)  # [n, 2, Hkv, D/2]
    index_into(pages.scales.view(-1), [_flat_scale_index(pages, page, slot)], out.scales)  # [n, 2, Hkv, S]
    return out


def scatter_kv_pages(pages: Nvfp4KvPages, page_ids: Sequence[int], lo: int, rows: Nvfp4KvRows) -> None:
    """Write `rows` at keys `[lo, lo + n)` of request pages `page_ids`, each byte at the address a
    gather read it from (checked before any write)."""
    n, two, h, half = rows.payload.shape
    if (two, h, half, rows.scales.shape[3]) != (2, pages.payload.shape[2], pages.payload.shape[4],
                                                 pages.scales.shape[4]):
        raise RuntimeError(f"NVFP4 rows {tuple(rows.shape)} do not fit NVFP4 pages {tuple(pages.shape)}")
    page, slot = key_slots(page_ids, lo, lo + n, pages.scales.shape[3], pages.device)
    idx = _flat_scale_index(pages, page, slot)
    _u8(pages.payload)[page, :, :, slot] = rows.payload.to(pages.device)
    pages.scales.view(-1)[idx] = rows.scales.to(pages.device)
