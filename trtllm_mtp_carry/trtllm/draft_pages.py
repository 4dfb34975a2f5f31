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

- `DeepseekV4DraftPages` (a draft manager whose `get_buffers` and `get_cache_indices` take an
  `attn_type`: DeepSeek-V4's `DeepseekV4CacheManager`, `deepseek_v4/cache_manager.py` @
  0b03b6afc16c24de7556e3abf7b78e9ccae2def4): the MTP layer's only buffer is its sliding window
  (compress ratio 1: `metadata.py` @ 0b03b6af refuses a separate draft pool otherwise), one MLA
  latent vector a key, `get_buffers(mtp, DeepseekV4AttentionType.SWA)` `[pages, tpb, 512]`
  (BF16, or FP8: an NVFP4 deployment's window is FP8) or, with `use_fp8_ds_mla` on Hopper,
  uint8 `[pages, tpb, 584]` footer-scale pages (`dataplane/latent_pages.py`); addressed by
  `get_cache_indices(rid, mtp, SWA)` (`PageIndexMode.PER_LAYER` ids into that view's first
  dimension: the manager's own guard-page fill indexes it so). The MTP layer reads keys
  `[p - 127, p]` (`window_size == 128`, metadata.py @ 0b03b6af), and the pool releases blocks
  below its window (`BAD_PAGE_INDEX`, `_kv_cache.py` @ 00f6bd61 `_unlock_stale_blocks`): a
  turn keeps the run of keys on held pages that reaches its last key, and a warm turn is
  restored only over `[R - 127, R)` (`read_window`), never below.

Invariant: `page_ids`, `views` and `codec` agree: the codec gathers from and scatters
to exactly the views, at exactly the ids, that TensorRT-LLM's kernels index.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any

import torch

from ..dataplane.latent_pages import FooterScalePages
from ..dataplane.nvfp4_kv import FP4_BLOCK, NVFP4_KV_DTYPE, Nvfp4KvPages
from ..dataplane.row_codec import (
    CompositeCodec,
    RowCodec,
    Rows,
    SideRows,
    SlotPages,
    codec_for,
    latent_codec,
)
from ..service.homes import Runs
from .kv_formats import HOPPER_SM, is_qsa_pool, kv_format_of_datatype

__all__ = ["DSV4_WINDOW", "DeepseekV4DraftPages", "DraftPages", "Nvfp4DraftPages", "QsaDraftPages",
           "TurnPages", "WindowTurnPages", "attention_typed", "nvfp4_scale_pages", "pages_of"]

QSA_INDEX_K_DTYPE = torch.bfloat16
"""`QSA_INDEX_K_CACHE_DTYPE` (`qsa/constants.py` @ 242e38c0316f82603db53bb51b6b1767b53ae2eb)."""
QSA_POSITION_DTYPE = torch.int32
"""`QSA_POSITION_CACHE_DTYPE` (`qsa/constants.py` @ 242e38c0)."""
QSA_POSITION_AXES = 3
"""`QSA_POSITION_COORDINATE_AXES` (`qsa/constants.py` @ 242e38c0)."""


class TurnPages:
    """A request's MTP-layer draft pages, as the service's arena reads and writes them (`RowPages`):
    one run of keys at a time, at the request's page ids. The pages are looked up at the first
    read or write, inside the service's step (a fault there is the step's)."""

    def __init__(self, pages: DraftPages, rid: int) -> None:
        self.pages = pages
        self.rid = rid

    @functools.cached_property
    def buf(self) -> Any:
        return self.pages.views()

    @functools.cached_property
    def ids(self) -> list[int]:
        return self.pages.page_ids(self.rid)

    def kept(self, lo: int, hi: int) -> tuple[int, int]:
        """The keys of valid run `[lo, hi)` a deposit keeps: all of them (every page is held)."""
        return lo, hi

    def gather_into(self, codec: RowCodec, out: Rows, runs: Runs) -> None:
        (lo, n), = runs
        codec.gather_pages(self.buf, self.ids, lo, lo + n, out=out)

    def scatter(self, codec: RowCodec, rows: Rows, runs: Runs, key: int) -> None:
        if not runs:  # nothing below R to restore: the pages are not read
            return
        for lo, n in runs:  # one run: the entry's keys below R
            codec.scatter_pages(self.buf, self.ids, lo, codec.head(rows, n))


class WindowTurnPages(TurnPages):
    """A request's pages in a sliding-window pool: a deposit keeps the run of keys on held pages
    that reaches its last key (blocks below the window are `BAD_PAGE_INDEX`); a scatter writes
    its run's rows from the `skip`-th on (keys below the turn's read window are never written).
    Its codecs hold rows as one tensor (`LatentRowsCodec`, `FooterScaleCodec`)."""

    def __init__(self, pages: DraftPages, rid: int, skip: int = 0) -> None:
        super().__init__(pages, rid)
        self.skip = skip

    @functools.cached_property
    def tpb(self) -> int:
        return int(self.buf.shape[3])

    def kept(self, lo: int, hi: int) -> tuple[int, int]:
        held = [i >= 0 for i in self.ids[: -(-hi // self.tpb)]]
        first = max((b + 1 for b, ok in enumerate(held) if not ok), default=0)  # past the last dropped block
        return max(lo, first * self.tpb), hi

    def scatter(self, codec: RowCodec, rows: Rows, runs: Runs, key: int) -> None:
        if not runs:
            return
        (lo, n), = runs
        if self.skip:
            if not isinstance(rows, torch.Tensor):
                raise TypeError(f"a windowed scatter takes rows held as one tensor, got {type(rows).__name__}")
            rows, lo, n = rows[self.skip:], lo + self.skip, n - self.skip
        if n > 0:
            codec.scatter_pages(self.buf, self.ids, lo, codec.head(rows, n))


class DraftPages:
    """The MTP layer's K/V pages of draft manager `draft` (base V2 and the hybrids)."""

    ACCESSORS: tuple[tuple[str, str], ...] = (("get_buffers", "kv_layout"), ("get_batch_cache_indices", "layer_idx"))
    """The page accessors this layout calls and the parameter each must take (the probe checks them)."""

    def __init__(self, draft: Any, mtp_layer: int) -> None:
        self.draft = draft
        self.mtp_layer = mtp_layer

    def turn(self, rid: int, skip: int = 0) -> TurnPages:
        """Request `rid`'s pages as the service reads and writes them; a scatter skips its first
        `skip` rows (0 here: the MTP layer reads every key below R)."""
        if skip:
            raise ValueError(f"full-attention pages restore every key below R: no row to skip, got {skip}")
        return TurnPages(self, rid)

    def read_window(self, reused: int) -> int:
        """The lowest key a warm turn reusing `reused` tokens reads below them: 0 (full attention)."""
        return 0

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


DSV4_WINDOW = 128
"""Keys DeepSeek-V4's MTP layer reads up to a query, itself included: `[p - 127, p]`
(`DeepseekV4TrtllmAttentionMetadata`: "window_size == 128", `swa_local_indices`, metadata.py @
0b03b6afc16c24de7556e3abf7b78e9ccae2def4)."""


def attention_typed(draft: Any) -> bool:
    """Whether `draft` addresses its buffers by attention type, as DeepSeek-V4's manager does
    (`get_buffers(layer_idx, attn_type)`, `get_cache_indices(request_id, layer_idx, attn_type)`,
    cache_manager.py @ 0b03b6af) instead of the base V2's `get_buffers(layer_idx, kv_layout)`."""
    dsv4 = draft  # read as a DeepseekV4CacheManager (the conformance walk reads `dsv4` as one)
    get_buffers = getattr(dsv4, "get_buffers", None)
    if get_buffers is None or getattr(dsv4, "get_cache_indices", None) is None:
        return False
    try:
        return "attn_type" in inspect.signature(get_buffers).parameters
    except (TypeError, ValueError):
        return False


class DeepseekV4DraftPages(DraftPages):
    """DeepSeek-V4's draft pool: the MTP layer's sliding-window MLA latent pages (see the module doc)."""

    ACCESSORS = (("get_buffers", "attn_type"), ("get_cache_indices", "attn_type"))
    window = DSV4_WINDOW

    def __init__(self, draft: Any, mtp_layer: int) -> None:
        super().__init__(draft, mtp_layer)
        # the module defining the manager's accessors imports DeepseekV4AttentionType (params.py) and
        # get_sm_version (tensorrt_llm._utils), the function the manager itself asked (cache_manager.py)
        dsv4 = draft
        owner = next(c for c in type(dsv4).__mro__ if "get_cache_indices" in c.__dict__)
        module = sys.modules[owner.__module__]
        self.swa = module.DeepseekV4AttentionType.SWA
        self.footer = getattr(dsv4, "use_fp8_ds_mla", False) is True
        if self.footer and int(module.get_sm_version()) != HOPPER_SM:
            raise ValueError(f"fp8_ds_mla pages off Hopper (SM{int(module.get_sm_version())}): their writer's page "
                             "size was not read, the carry reads Hopper's only")

    def kv(self) -> Any:
        """The SWA pages as one head's HND view `[pages, 1, 1, tpb, D]` (a footer-scale pool's as
        `FooterScalePages`, written in whole-block pages on Hopper)."""
        dsv4 = self.draft
        buf: torch.Tensor = dsv4.get_buffers(self.mtp_layer, self.swa)  # [pages, tpb, D] or [pages, tpb, 584]
        if self.footer:
            return FooterScalePages(buf, page_tokens=int(buf.shape[1]))
        return buf.view(buf.shape[0], 1, 1, buf.shape[1], buf.shape[2])

    def page_ids(self, rid: int) -> list[int]:
        dsv4 = self.draft
        return list(dsv4.get_cache_indices(rid, self.mtp_layer, self.swa))

    def codec(self, row_dtype: str) -> RowCodec:
        return latent_codec(self.kv().dtype)  # the pool's own rows, whatever row_dtype says

    def turn(self, rid: int, skip: int = 0) -> TurnPages:
        return WindowTurnPages(self, rid, skip)

    def read_window(self, reused: int) -> int:
        return max(0, reused - (self.window - 1))

    def check(self, tokens_per_block: int) -> None:
        """ValueError, naming what came, unless the SWA pages are `[pages, tpb, 512]` BF16 or FP8, or
        uint8 `[pages, tpb, 584]` footer-scale pages."""
        dsv4 = self.draft
        buf = dsv4.get_buffers(self.mtp_layer, self.swa)
        width, dtypes = (584, (torch.uint8,)) if self.footer else (512, (torch.bfloat16, torch.float8_e4m3fn))
        if buf is None or buf.dim() != 3 or tuple(buf.shape[1:]) != (tokens_per_block, width) or buf.dtype not in dtypes:
            raise ValueError(f"draft get_buffers({self.mtp_layer}, SWA) is "
                             f"{None if buf is None else (buf.dtype, tuple(buf.shape))}: expected "
                             f"[pages, {tokens_per_block}, {width}] of {', '.join(map(str, dtypes))}")


def pages_of(draft: Any, mtp_layer: int) -> DraftPages:
    """The layout of draft manager `draft`'s MTP layer pages, by what its class offers (accessors
    by attention type: DeepSeek-V4's sliding-window latent pages), what the pool is (a QSA pool,
    `kv_formats.is_qsa_pool`, as `kv_formats.verdict_of_draft` judges it) and its KV format (an
    NVFP4 pool's payload and scale pages; the verdict stands aside on a QSA one)."""
    if attention_typed(draft):
        return DeepseekV4DraftPages(draft, mtp_layer)
    if is_qsa_pool(draft):
        return QsaDraftPages(draft, mtp_layer)
    if kv_format_of_datatype(getattr(draft, "dtype", None)) == "nvfp4":
        return Nvfp4DraftPages(draft, mtp_layer)
    return DraftPages(draft, mtp_layer)
