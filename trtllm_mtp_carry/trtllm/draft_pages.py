"""The MTP layer's pages in a draft pool, as the carry gathers and scatters them.

What it is for: the carry moves the rows a request's MTP layer holds in the
separate draft pool. Which rows those are, and how they are addressed, depends on
the draft pool's manager class; this module decides it once per draft manager
(`pages_of`) and the manager asks the result, never the class again:

- `DraftPages` (base V2 and the hybrid managers): the K/V pages
  `get_buffers(mtp, "HND")` (`[pages, 2, Hkv, tpb, D]`) addressed by
  `get_batch_cache_indices([rid], layer_idx=mtp)`; the row codec is
  `codec_for(carry_row_dtype, pool dtype)`.
- `Nvfp4DraftPages` (an NVFP4 pool, `draft.dtype` `DataType.NVFP4`, base V2 or the
  hybrid): the payload pages `get_buffers(mtp, "HND")` (int8 `[pages, 2, Hkv, tpb, D/2]`,
  as `get_buffers` re-types NVFP4) and the block-scale pages beside them (`nvfp4_scale_pages`:
  uint8 `[pages, 2, Hkv, tpb, D/16]`, K's then V's scale page of each page index), both
  addressed by the same `get_batch_cache_indices` ids; the row codec is `nvfp4_kv` (the
  pool's own bytes, `dataplane/nvfp4_kv.py` says what the source shows) whatever
  `carry_row_dtype` says.
- `QsaDraftPages` (a QSA hybrid's draft pool, `kv_formats.is_qsa_pool`: recognised by the
  position page and views its class makes, whatever the class is called:
  `QSAMambaHybridCacheManagerV2` in `tensorrt_llm/_torch/attention/backends/sparse/qsa/
  cache_manager.py` @ 38198e34582cf777ecc72062f477987284ba9999, `Qwen4ExpHybridCacheManagerV2`
  in `tensorrt_llm/_torch/modules/qwen4_exp/cache_manager.py` @
  6ff2801f55462b926cc837a7f230fae63bc62fdc, which `qsa/cache_manager.py` re-exports under the old
  name; the same attributes and views in both): the MTP layer keeps, in the same V2
  lifecycle slot as its K/V, its index keys (`Role.INDEX_KEY`) and, being the
  draft pool's first local sparse layer (`qsa_position_layer_id`), the request's
  position coordinates (`qsa_index_position`). Its views are slot-major:
  `get_buffers(mtp, "HND")` is `[num_slots, scale, Hkv, tpb, D][:, :2]`,
  `get_index_k_buffer(mtp)` (NHD, the indexer's layout) `[num_slots, tpb,
  index_kv_heads, index_head_dim]` bfloat16 (`KVCacheManagerV2.get_index_k_buffer`,
  `kv_cache_manager_v2.py` @ 38198e34: `full_view[:, 0]` of `[num_slots, scale,
  tpb, heads, dim]` when coalesced), `get_qsa_position_buffer()` `[num_slots, tpb,
  3]` int32; all three are indexed by the base slot ids
  `get_batch_cache_indices([rid], layer_idx=mtp, raw_indices=True)` ("for
  slot-major views that need base slot IDs without page-index scaling or KV
  aggregation", kv_cache_manager_v2.py @ 38198e34; the default scales each id by
  `scale // kv_factor`, which addresses a slot-major view only when scale is 2).
  The row codec is `CompositeCodec(codec_for(...), (position, index_k))`: one row
  per key of K/V, position and index key, restored together.

Why carrying QSA's side rows restores what a cold prefill writes (the QSA
indexer, `indexer.py` @ 6dc94b061170d7e8ac05cce6c44f8a20309bb9d4,
`update_cache_and_compress`): a key's slot holds its raw index key (`index_qk_proj`
of the layer's own input, no norm, no RoPE) and its position coordinates (of its
own position id); when key `p` completes a compression group (`(p + 1) %
compress_ratio == 0`) its slot holds instead the group's anchor, the mean of the
group's raw keys normalized and roped at the group's first coordinates, all keys
`<= p`. So rows `[0, R)` depend on the tokens and positions of `[0, R)` only, as
K/V rows do; a warm turn's first group past `R` reads the raw keys and first
coordinates of its members below `R`, which the carry restores.

Invariant: `page_ids`, `views` and `codec` agree: the codec gathers from and scatters
to exactly the views, at exactly the ids, that TensorRT-LLM's kernels index.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ..dataplane.nvfp4_kv import FP4_BLOCK, NVFP4_KV_DTYPE, Nvfp4KvPages
from ..dataplane.row_codec import CompositeCodec, RowCodec, SideRows, SlotPages, codec_for
from .kv_formats import is_qsa_pool, kv_format_of_datatype

__all__ = ["DraftPages", "Nvfp4DraftPages", "QsaDraftPages", "nvfp4_scale_pages", "pages_of"]

QSA_INDEX_K_DTYPE = torch.bfloat16
"""`QSA_INDEX_K_CACHE_DTYPE` (`qsa/constants.py` @ 242e38c0316f82603db53bb51b6b1767b53ae2eb)."""
QSA_POSITION_DTYPE = torch.int32
"""`QSA_POSITION_CACHE_DTYPE` (`qsa/constants.py` @ 242e38c0)."""
QSA_POSITION_AXES = 3
"""`QSA_POSITION_COORDINATE_AXES` (`qsa/constants.py` @ 242e38c0)."""


class DraftPages:
    """The MTP layer's K/V pages of draft manager `draft` (base V2 and the hybrids)."""

    def __init__(self, draft: Any, mtp_layer: int) -> None:
        self.draft = draft
        self.mtp_layer = mtp_layer

    def kv(self) -> Any:
        """The K/V pages `[pages, 2, Hkv, tpb, D]` (HND: a tensor; an NVFP4 pool's `Nvfp4KvPages`)."""
        buf: torch.Tensor = self.draft.get_buffers(self.mtp_layer, kv_layout="HND")
        return buf

    def views(self) -> Any:
        """What the codec gathers from and scatters to (here the K/V pages)."""
        return self.kv()

    def page_ids(self, rid: int) -> list[int]:
        """Request `rid`'s page ids, in key order, as `views()` indexes them."""
        ids: list[int] = self.draft.get_batch_cache_indices([rid], layer_idx=self.mtp_layer)[0]
        return ids

    def codec(self, row_dtype: str) -> RowCodec:
        """The codec carrying these pages' rows under `carry_row_dtype` `row_dtype`."""
        return codec_for(row_dtype, self.kv().dtype)

    def row_nbytes(self, row_dtype: str) -> int:
        """Bytes one carried row takes held (the arena's block)."""
        buf = self.kv()
        return self.codec(row_dtype).row_nbytes(buf.shape[2], buf.shape[4])


def _v2_module(draft: Any) -> Any:
    """The module defining `draft`'s `KVCacheManagerV2` class: it has `Role` and the
    `TensorWrapper` / `convert_to_torch_tensor` its `get_buffers` views the pool with
    (kv_cache_manager_v2.py @ 00be09f7 defines the one and imports the others)."""
    cls = next(c for c in type(draft).__mro__ if c.__name__ == "KVCacheManagerV2")
    return sys.modules[cls.__module__]


def nvfp4_scale_pages(draft: Any, mtp_layer: int, payload: torch.Tensor) -> torch.Tensor:
    """The MTP layer's block-scale pages of NVFP4 draft pool `draft`: uint8 `[pages, 2, Hkv, tpb,
    D/16]` over the `KEY_BLOCK_SCALE` pool, K's then V's scale page of each page index.

    Viewed as `get_buffers` views K/V (kv_cache_manager_v2.py @ 00be09f7): the role's base address
    (`impl.get_mem_pool_base_address(layer_offset, role)`), V's one page on from K's and pages
    of `get_page_stride` bytes (the checks `get_buffers` makes of K/V, made of the scale roles),
    the page count and geometry of the payload view `payload` (`_build_pool_mapping_tensors`
    asserts the scale pages' offset equals the data's: one page index for both). RuntimeError,
    naming the numbers, where the pool does not look so."""
    v2 = _v2_module(draft)
    role = v2.Role
    impl = draft.impl
    layer = draft.layer_offsets[mtp_layer]
    k_addr = impl.get_mem_pool_base_address(layer, role.KEY_BLOCK_SCALE)
    v_addr = impl.get_mem_pool_base_address(layer, role.VALUE_BLOCK_SCALE)
    stride = impl.get_page_stride(layer, role.KEY_BLOCK_SCALE)
    pages, _, heads, tpb, half = payload.shape
    blocks = half * 2 // FP4_BLOCK
    if (stride != heads * tpb * blocks or impl.get_page_stride(layer, role.VALUE_BLOCK_SCALE) != stride
            or v_addr != k_addr + stride):
        raise RuntimeError(f"the NVFP4 draft pool's scale pages are not [pages, 2, {heads}, {tpb}, {blocks}] "
                           f"bytes: K at {k_addr:#x}, V at {v_addr:#x}, page stride {stride}")
    scales: torch.Tensor = v2.convert_to_torch_tensor(
        v2.TensorWrapper(k_addr, torch.uint8, [pages, 2, heads, tpb, blocks]))
    return scales


class Nvfp4DraftPages(DraftPages):
    """An NVFP4 draft pool's MTP-layer pages: payload and block-scale pages, one page index."""

    def kv(self) -> Nvfp4KvPages:
        payload: torch.Tensor = self.draft.get_buffers(self.mtp_layer, kv_layout="HND")
        return Nvfp4KvPages(payload, nvfp4_scale_pages(self.draft, self.mtp_layer, payload))

    def codec(self, row_dtype: str) -> RowCodec:
        return codec_for(row_dtype, NVFP4_KV_DTYPE)  # the pool's own bytes, whatever row_dtype says


class QsaDraftPages(DraftPages):
    """The QSA hybrid's draft pool: K/V, position and index-key rows of the MTP layer, one slot."""

    def __init__(self, draft: Any, mtp_layer: int) -> None:
        super().__init__(draft, mtp_layer)
        qsa = draft  # a QSA hybrid's pool (the conformance walk reads `qsa` as one)
        if qsa.qsa_position_layer_id != mtp_layer:
            # the coordinates live on the pool's first local sparse layer; a draft pool whose MTP
            # layer is not it shares them with another layer, which the carry does not restore
            raise ValueError(f"the QSA draft pool keeps its position coordinates on layer "
                             f"{qsa.qsa_position_layer_id!r}, not on the MTP layer {mtp_layer}")
        self.sides = (SideRows("position", (QSA_POSITION_AXES,), QSA_POSITION_DTYPE),
                      SideRows("index_k", (int(qsa.qsa_index_kv_heads), int(qsa.qsa_index_dim)),
                               QSA_INDEX_K_DTYPE))

    def views(self) -> Any:
        qsa = self.draft
        return SlotPages(self.kv(), (qsa.get_qsa_position_buffer(), qsa.get_index_k_buffer(self.mtp_layer)))

    def page_ids(self, rid: int) -> list[int]:
        qsa = self.draft
        ids: list[int] = qsa.get_batch_cache_indices([rid], layer_idx=self.mtp_layer, raw_indices=True)[0]
        return ids

    def codec(self, row_dtype: str) -> RowCodec:
        return CompositeCodec(super().codec(row_dtype), self.sides)


def pages_of(draft: Any, mtp_layer: int) -> DraftPages:
    """The layout of draft manager `draft`'s MTP layer pages, by what the pool is (a QSA pool,
    `kv_formats.is_qsa_pool`, as `kv_formats.verdict_of_draft` judges it) and its KV format (an
    NVFP4 pool's payload and scale pages; the verdict stands aside on a QSA one)."""
    if is_qsa_pool(draft):
        return QsaDraftPages(draft, mtp_layer)
    if kv_format_of_datatype(getattr(draft, "dtype", None)) == "nvfp4":
        return Nvfp4DraftPages(draft, mtp_layer)
    return DraftPages(draft, mtp_layer)
