"""DeepSeek-V4's footer-scale MLA latent pages (`fp8_ds_mla`): where one key's bytes lie.

What it is for: a DeepSeek-V4 draft pool with `kv_cache_config.dtype: fp8_ds_mla` (what
Hopper requires) stores the MTP layer's sliding-window latent in footer-scale pages. The
carry moves a key's bytes exactly as TensorRT-LLM wrote them (`row_codec` `fp8_ds_mla`):
never dequantized, never re-scaled. This module holds the page view and the addressing.

What the source shows (nothing ran here):
- A key's latent is `DIM_NOPE + DIM_ROPE` = 512 values. `quant_scatter` quantizes the first
  448 in tiles of 64 to float8_e4m3fn, each tile's scale a power of two stored as one UE8M0
  byte (`ceil(log2(amax / 448)) + 127`), and stores the last 64 (the RoPE part) as bfloat16:
  a data row of 448 + 2 * 64 = 576 bytes and a footer row of 7 scale bytes plus one byte the
  writer never writes, 584 bytes a key (`footer_scale_kv.py` @
  d77955c52716fe6ff51d047f0eb93a443a342ef9).
- A writer page of `P` tokens is `P * 584` bytes: the `P` data rows first, then the `P`
  footer rows. Token slot `loc` lies in writer page `loc // P` at offset `loc % P`: data at
  `page * P * 584 + off * 576`, footer at `page * P * 584 + P * 576 + off * 8`
  (`quant_scatter`, `dequant_gather`, same file).
- `loc = page_index * tokens_per_block + position % tokens_per_block`, the page index from
  the layer's sliding block table (`deepseek_v4_local_to_global_indices`, `kernels.py` @
  0b03b6afc16c24de7556e3abf7b78e9ccae2def4, with the buffer's base equal to the pool's
  base), which is `DeepseekV4CacheManager.get_cache_indices(request, layer, SWA)`
  (`PageIndexMode.PER_LAYER`; `cache_manager.py` @ 0b03b6af). The pool is
  `get_buffers(layer, SWA)`: uint8 `[pages, tokens_per_block, 584]` over the same base.
- Hopper's writer (`DeepSeekV4FlashMLA._prepare_q_and_cache`, `flash_mla.py` @
  7de08c31c5c1bf627e4f7177b41ddc40fcf0ccfe) appends with `page_size = tokens_per_block`, and
  its reader (`dequant_gather(..., page_size=pool.shape[1])`) reads so: `P` is the manager's
  block there. FlashInfer's SM120 path writes with `PAGE_SIZE = 64`; what other GPUs' kernels
  use was not read, so the carry reads these pages on Hopper only (`trtllm/draft_pages.py`).

Invariants:
- One indexed copy per call, no Python loop over keys or bytes;
- a key's held row is its 576 data bytes then its 8 footer bytes, as written;
- a scatter checks the rows and the pages before its first write.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..core.row_format import FP8_DS_MLA_DIM, FP8_DS_MLA_VECTOR_BYTES
from .device_ints import device_copy
from .hnd_pages import index_into, page_table
from .row_layout import check_out

__all__ = ["DATA_ROW_BYTES", "DIM_NOPE", "DIM_ROPE", "FOOTER_ROW_BYTES", "FooterScalePages", "QUANT_TILE",
           "TOKEN_BYTES", "footer_key_offsets", "gather_footer_rows", "scatter_footer_rows"]

DIM_NOPE = 448
"""Latent values quantized to e4m3 (`footer_scale_kv.DIM_NOPE`)."""
DIM_ROPE = 64
"""RoPE values kept as bfloat16 (`footer_scale_kv.DIM_ROPE`)."""
QUANT_TILE = 64
"""Values sharing one UE8M0 scale (`footer_scale_kv.QUANT_TILE`)."""
DATA_ROW_BYTES = DIM_NOPE + DIM_ROPE * 2
"""A key's data row: 576 bytes (`footer_scale_kv.DATA_ROW_BYTES`)."""
FOOTER_ROW_BYTES = DIM_NOPE // QUANT_TILE + 1
"""A key's footer row: 7 scale bytes and one pad byte (`footer_scale_kv.FOOTER_ROW_BYTES`)."""
TOKEN_BYTES = DATA_ROW_BYTES + FOOTER_ROW_BYTES
"""584 bytes a key (`footer_scale_kv.TOKEN_BYTES`)."""

assert TOKEN_BYTES == FP8_DS_MLA_VECTOR_BYTES and DIM_NOPE + DIM_ROPE == FP8_DS_MLA_DIM


@dataclass(frozen=True, slots=True)
class FooterScalePages:
    """A DeepSeek-V4 pool's footer-scale SWA pages: `data` uint8 `[pages, tpb, 584]` (what
    `get_buffers(layer, SWA)` gives), written in pages of `page_tokens` tokens (Hopper: `tpb`).
    `shape` is the logical `[pages, 1, 1, tpb, 512]` (one latent vector a key: SELFKONLY, one head)."""

    data: torch.Tensor
    page_tokens: int

    def __post_init__(self) -> None:
        d = self.data
        if d.dim() != 3 or d.dtype != torch.uint8 or d.shape[2] != TOKEN_BYTES or not d.is_contiguous():
            raise ValueError(f"footer-scale pages are contiguous uint8 [pages, tpb, {TOKEN_BYTES}], got "
                             f"{d.dtype} {tuple(d.shape)}")
        if self.page_tokens < 1 or d.shape[1] % self.page_tokens:
            raise ValueError(f"a block of {d.shape[1]} tokens is not whole writer pages of {self.page_tokens}")

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.data.shape[0], 1, 1, self.data.shape[1], FP8_DS_MLA_DIM))

    @property
    def dtype(self) -> torch.dtype:
        return torch.uint8

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dim(self) -> int:
        return 5


def footer_key_offsets(pages: Sequence[int], lo: int, hi: int, tokens_per_block: int, page_tokens: int,
                       device: torch.device) -> torch.Tensor:
    """int64 `[hi - lo, 584]`: the flat byte offsets (into the pool's bytes) of keys `[lo, hi)`,
    each key's 576 data bytes then its 8 footer bytes. A key on a missing or `BAD_PAGE_INDEX`
    page is a RuntimeError naming it (`hnd_pages.page_table`)."""
    table, first = page_table(pages, lo, hi, tokens_per_block)
    keys = torch.arange(lo, hi, dtype=torch.int64)
    page = torch.tensor(table, dtype=torch.int64)[keys // tokens_per_block - first]
    loc = page * tokens_per_block + keys % tokens_per_block
    base = (loc // page_tokens) * (page_tokens * TOKEN_BYTES)
    off = loc % page_tokens
    data = (base + off * DATA_ROW_BYTES)[:, None] + torch.arange(DATA_ROW_BYTES)
    footer = (base + page_tokens * DATA_ROW_BYTES + off * FOOTER_ROW_BYTES)[:, None] + torch.arange(FOOTER_ROW_BYTES)
    return device_copy(torch.cat((data, footer), dim=1), device)


def gather_footer_rows(pages: FooterScalePages, ids: Sequence[int], lo: int, hi: int,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """Keys `[lo, hi)` of `pages` (a request's page ids `ids`) as uint8 `[hi - lo, 584]`: written
    into `out` when given (uint8, contiguous, the pages' device: checked before any write) and
    `out` returned, else a new tensor."""
    flat = pages.data.view(-1)
    shape = (hi - lo, TOKEN_BYTES)
    if out is None:
        out = torch.empty(shape, dtype=torch.uint8, device=flat.device)
    else:
        check_out(out, torch.Tensor, shape, torch.uint8, flat.device)
    at = footer_key_offsets(ids, lo, hi, pages.data.shape[1], pages.page_tokens, flat.device)
    return index_into(flat, [at], out)


def scatter_footer_rows(pages: FooterScalePages, ids: Sequence[int], lo: int, rows: torch.Tensor) -> None:
    """Write uint8 `rows` `[n, 584]` at keys `[lo, lo + n)`: every byte back at its address."""
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != TOKEN_BYTES:
        raise RuntimeError(f"footer-scale rows are uint8 [n, {TOKEN_BYTES}], got {rows.dtype} {tuple(rows.shape)}")
    flat = pages.data.view(-1)
    at = footer_key_offsets(ids, lo, lo + rows.shape[0], pages.data.shape[1], pages.page_tokens, flat.device)
    flat[at] = rows.to(flat.device)
