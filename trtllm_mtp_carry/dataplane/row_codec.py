"""Row codecs: one object per format of carried drafter rows.

What it is for: a carried entry's rows `[n, 2, Hkv, D]` (K and V, per KV head)
leave the drafter's KV (the adapter's HND pages, the reference runtime's K/V
block caches) and come back later. How they are held in between is the row
format, and every place that touches held rows (gather, scatter, the arena, the
host tier, the byte charge) asks the entry's codec instead of branching on the
rows' type. A codec is chosen once per pool (`codec_for`) from the configured
`carry_row_dtype` and the pool's own element dtype:

    codec      pool dtype        held form                              bytes a row (2*Hkv vectors of D)
    bf16       bf16/fp16/fp32    the pool's rows, as the pool holds them 2*Hkv*D*elem
    fp8        bf16/fp16/fp32    PackedRows: e4m3 payload + f32 scales   2*Hkv*(D + 4)
    nvfp4      bf16/fp16/fp32    Nvfp4Rows: e2m1 pairs + e4m3 per 16     2*Hkv*(D/2 + D/16 + 1)
                                 + one e8m0 byte a vector (`nvfp4.py`)
    fp8_kv     float8_e4m3fn     the pool's own bytes (static KV scale)  2*Hkv*D
    nvfp4_kv   NVFP4 (`Nvfp4KvPages`) the pool's own payload + block-scale  2*Hkv*(D/2 + D/16)
                                 bytes (`nvfp4_kv.py`; static global scale)

An MLA latent pool (DeepSeek-V4's sliding window: SELFKONLY, one head) holds one vector a key,
not K and V; its codecs are chosen by the pages (`trtllm/draft_pages.py`), not by `codec_for`:

    LatentRowsCodec  bf16 / float8_e4m3fn   the pool's rows `[n, 1, 1, D]` as held     Hkv*D*elem
    fp8_ds_mla       footer-scale pages     the key's 584 bytes (`latent_pages.py`)     584
                     (`FooterScalePages`)

An FP8 KV pool's rows are float8_e4m3fn bytes written with the layer's static
KV scale: they are carried as they are, gathered and scattered exactly, never
re-scaled, whatever `carry_row_dtype` says (a second quantization could only
lose bits; an upcast would double the bytes for nothing). An NVFP4 KV pool's rows
(`nvfp4_kv`) likewise: its e2m1 payload and e4m3 block-scale bytes, addressed as
TensorRT-LLM's writer addresses them (`dataplane/nvfp4_kv.py`), under the layer's
static global scales.

Invariants (tests/dataplane/test_dp_row_codec_contract.py runs one suite over every codec):
- `codec.nbytes(rows) == codec.row_nbytes(Hkv, D) * n`, which equals
  `core.row_format.RowFormat(codec.name, 2 * Hkv, D, elem_bytes).nbytes(n)`: the
  bytes a store charges are the bytes held (core's accounting stays torch-free).
- `exact` codecs round-trip bit for bit (gather then scatter writes the same
  bytes); `fp8` round-trips within `row_format`'s error bound, deterministically.
- Every method is vectorized (no Python loop over rows, vectors or heads) and
  checks shape and dtype before any write.
- A gather given `out` (held rows of this codec, e.g. `view` of an arena extent)
  writes there exactly the bytes it would return, once, and returns `out`.

Adding a codec: subclass `RowCodec`, give it a `name` listed in
`core.row_format.ROW_FORMATS` (with its `vector_nbytes`), register the class in
`CODECS`, let `codec_for` choose it, and add it to the contract suite's `CODECS`.

Composite rows (`CompositeCodec`): a draft pool that keeps per-token side rows in
the same page slot as K/V (the QSA hybrid's index keys and position coordinates,
`trtllm/draft_pages.py`) carries one row per key made of its K/V row, held by any
codec above, and its side rows, copied exactly. The pool is then `SlotPages` (the
K/V pages and one slot-major view per side, all addressed by the same slot ids)
and the held form `CompositeRows`; bytes a row are the K/V codec's plus the side
rows' own, laid back to back in an arena block.
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from ..core.row_format import FP8_DS_MLA_DIM, RowFormat
from . import nvfp4
from .hnd_pages import (
    gather_packed_rows,
    gather_rows,
    index_into,
    key_slots,
    scatter_packed_rows,
    scatter_rows,
)
from .latent_pages import TOKEN_BYTES, FooterScalePages, gather_footer_rows, scatter_footer_rows
from .nvfp4 import Nvfp4Rows
from .nvfp4_kv import NVFP4_KV_DTYPE, Nvfp4KvPages, Nvfp4KvRows, gather_kv_pages, scatter_kv_pages
from .pinned import host_clone
from .reference import slots_for_rows
from .row_format import (
    FP8_DTYPE,
    PACKABLE_DTYPES,
    PackedRows,
    pack_blocks,
    pack_rows,
    unpack_into_blocks,
    unpack_rows,
)
from .row_layout import blocks_of_rows, check_caches, check_out

__all__ = ["CODECS", "KV_FP8_DTYPES", "CompositeCodec", "CompositeRows", "FooterScaleCodec", "Fp8PackedCodec",
           "LatentRowsCodec", "Nvfp4Codec", "Nvfp4KvPagesCodec", "latent_codec", "PoolRowsCodec", "RowCodec", "Rows", "SideRows", "SlotPages", "codec_for", "codec_of"]


@dataclass(frozen=True, slots=True)
class SideRows:
    """One kind of per-token side row a draft pool keeps in the K/V page slot: `name` (what
    stats name it), its per-token `row_shape` and `dtype` (e.g. QSA's index key `(1, 128)`
    bfloat16, its position coordinates `(3,)` int32)."""

    name: str
    row_shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if not self.name or not self.row_shape or min(self.row_shape) < 1:
            raise ValueError(f"a side row needs a name and a non-empty positive shape, got {self!r}")
        if self.row_nbytes % 4:
            raise ValueError(f"side row {self.name!r} takes {self.row_nbytes} bytes: a multiple of 4 keeps "
                             "the arena's float32/int32 views aligned")

    @property
    def row_nbytes(self) -> int:
        """Bytes of one token's side row."""
        n = _elem_bytes(self.dtype)
        for s in self.row_shape:
            n *= s
        return n


@dataclass(frozen=True, slots=True)
class CompositeRows:
    """Held composite rows: `kv` (`[n, 2, Hkv, D]` in the K/V codec's form) and one tensor
    `[n, *row_shape]` per side of `spec`, row `r` of each the same key."""

    kv: torch.Tensor | PackedRows | Nvfp4Rows | Nvfp4KvRows
    sides: tuple[torch.Tensor, ...]
    spec: tuple[SideRows, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.kv.shape)

    @property
    def device(self) -> torch.device:
        return self.kv.device

    @property
    def dtype(self) -> torch.dtype:
        return self.kv.dtype

    @property
    def nbytes(self) -> int:
        return int(self.kv.nbytes) + sum(int(t.nbytes) for t in self.sides)


@dataclass(frozen=True, slots=True)
class SlotPages:
    """A draft pool's pages for composite rows: `kv` HND `[slots, 2, Hkv, tpb, D]` and one view
    `[slots, tpb, *row_shape]` per side, every one indexed by the same slot id."""

    kv: torch.Tensor
    sides: tuple[torch.Tensor, ...]

    @property
    def dtype(self) -> torch.dtype:
        return self.kv.dtype


Rows = torch.Tensor | PackedRows | Nvfp4Rows | Nvfp4KvRows | CompositeRows
"""Held rows: a tensor `[n, 2, Hkv, D]` in the pool's dtype, `PackedRows`, `Nvfp4Rows`,
`Nvfp4KvRows` or `CompositeRows`."""

KV_FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn,)
"""Pool element dtypes whose rows already are FP8 bytes (`fp8_kv`: carried as they are)."""


def _elem_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """`t` itself, or a uint8 view of a float8 tensor (indexed copies on raw bytes: exact, and
    independent of which float8 ops a torch build implements)."""
    return t.view(torch.uint8) if t.dtype in KV_FP8_DTYPES else t


class RowCodec(ABC):
    """One row format: its bytes a row, gather and scatter (HND pages, K/V blocks), encode and
    decode, host copy, arena views. `pool_dtype` is the dtype the drafter's KV holds."""

    name: str
    """The format's name in `core.row_format.ROW_FORMATS` (what stats and metrics report)."""
    exact: bool
    """Whether held rows decode to the pool's bytes exactly."""
    packs = False
    """Whether its gathers pack and its scatters unpack through Triton kernels on a GPU (compiled
    per variant on first launch: `dataplane.warm` launches them before the first timed turn)."""

    def __init__(self, pool_dtype: torch.dtype) -> None:
        self.pool_dtype = pool_dtype

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name}, pool {self.pool_dtype})"

    # ---- bytes -----------------------------------------------------------------------

    def format(self, num_kv_heads: int, head_dim: int) -> RowFormat:
        """The core's (torch-free) accounting of this format for rows `[2, Hkv, D]`."""
        return RowFormat(self.name, 2 * num_kv_heads, head_dim, _elem_bytes(self.pool_dtype))

    def row_nbytes(self, num_kv_heads: int, head_dim: int) -> int:
        """Bytes one row `[2, Hkv, D]` takes held: the arena's block, the store's charge a row."""
        return self.format(num_kv_heads, head_dim).row_nbytes

    def held_shape(self, rows: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """The held shape of `rows` rows of pages with `num_kv_heads` heads of `head_dim`: `[rows,
        2, Hkv, D]` (K and V; an MLA latent codec holds one vector a key)."""
        return (rows, 2, num_kv_heads, head_dim)

    def nbytes(self, rows: Rows) -> int:
        """Bytes `rows` hold (every tensor's bytes): what the store charges."""
        return sum(t.nbytes for t in self.tensors(rows))

    # ---- the held form ---------------------------------------------------------------

    @abstractmethod
    def holds(self, rows: object) -> bool:
        """Whether `rows` are in this codec's held form."""

    def check(self, rows: object) -> Rows:
        """`rows` if held in this form, else a TypeError naming the form and what came."""
        if not self.holds(rows):
            raise TypeError(f"a {self.name} codec holds {self._form()}, got "
                            f"{type(rows).__name__} {getattr(rows, 'dtype', '')}")
        assert isinstance(rows, (torch.Tensor, PackedRows, Nvfp4Rows, Nvfp4KvRows, CompositeRows))
        return rows

    @abstractmethod
    def _form(self) -> str: ...

    @abstractmethod
    def tensors(self, rows: Rows) -> tuple[torch.Tensor, ...]:
        """The tensors holding `rows` (for stream bookkeeping and byte counts)."""

    @abstractmethod
    def head(self, rows: Rows, n: int) -> Rows:
        """The first `n` rows, a view in the held form."""

    @abstractmethod
    def to(self, rows: Rows, device: torch.device, non_blocking: bool = False) -> Rows:
        """`rows` on `device` (the same tensors when there already)."""

    @abstractmethod
    def host_copy(self, rows: Rows) -> Rows:
        """A blocking copy in host memory (pinned when the rows are on a GPU); always a copy."""

    @abstractmethod
    def view(self, raw: torch.Tensor, shape: tuple[int, ...]) -> Rows:
        """Rows of `shape` `[n, 2, Hkv, D]` viewed in `raw` (uint8, exactly `n` rows' bytes)."""

    def copy_(self, dst: Rows, src: Rows) -> None:
        """Copy `src` into `dst` (same form and shape), tensor by tensor."""
        for d, s in zip(self.tensors(dst), self.tensors(src), strict=True):
            d.copy_(s)

    # ---- rows in and out of the drafter's KV ---------------------------------------

    @abstractmethod
    def encode(self, rows: torch.Tensor) -> Rows:
        """Pool-dtype rows `[n, 2, Hkv, D]` in the held form."""

    @abstractmethod
    def decode(self, rows: Rows) -> torch.Tensor:
        """Held rows back in the pool's dtype."""

    @abstractmethod
    def gather_pages(self, buf: torch.Tensor, pages: Sequence[int], lo: int, hi: int,
                     out: Rows | None = None) -> Rows:
        """Keys `[lo, hi)` of HND pages `buf` `[pages, 2, Hkv, tpb, D]` (a request's `pages`), held.

        With `out` (held rows of this codec `[hi - lo, 2, Hkv, D]`, contiguous, on the pages'
        device: e.g. `view` of an arena extent) the rows are written there, the bytes a gather
        without it returns, and `out` is returned; a mismatch (form, shape, dtype, device) is
        a RuntimeError naming it, before any write."""

    @abstractmethod
    def scatter_pages(self, buf: torch.Tensor, pages: Sequence[int], lo: int, rows: Rows) -> None:
        """Write held `rows` at keys `[lo, lo + n)` of HND pages `buf` (checked before any write)."""

    no_blocks = ""
    """Why this codec's rows never meet the reference runtime's K/V block caches (its pages-only
    codecs: `gather_blocks` and `scatter_blocks` raise it as a TypeError)."""

    def gather_blocks(self, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: Sequence[int],
                      rows: int, out: Rows | None = None) -> Rows:
        """The first `rows` rows of blocks `block_ids` of K/V caches `[blocks, block_size, Hkv, D]`,
        held; into `out` (`[rows, 2, Hkv, D]`, on the caches' device) when given, as `gather_pages`."""
        raise TypeError(self.no_blocks)

    def _out(self, out: Rows | None) -> Rows | None:
        """`out` (None, or rows in this codec's held form), else a RuntimeError naming the form and
        what came (a caller's bug: the extent viewed by another codec)."""
        if out is not None and not self.holds(out):
            raise RuntimeError(f"out is {type(out).__name__} {getattr(out, 'dtype', '')}: a {self.name} "
                               f"codec gathers into {self._form()}")
        return out

    def scatter_blocks(self, rows: Rows, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_ids: torch.Tensor) -> None:
        """Write held `rows` into blocks `block_ids` (int64, the caches' device), row `r` at slot
        `r % block_size` of block `block_ids[r // block_size]`; nothing else is written."""
        raise TypeError(self.no_blocks)

    def check_fits(self, rows: Rows, num_kv_heads: int, head_dim: int) -> None:
        """ValueError unless `rows` are held rows (`held_shape`: `[n, 2, Hkv, D]` for K/V) of this
        codec's pool."""
        self.check(rows)
        want = self.held_shape(int(rows.shape[0]) if len(rows.shape) else 0, num_kv_heads, head_dim)
        if tuple(rows.shape) != want:
            raise ValueError(f"{self.name} rows {tuple(rows.shape)} do not fit rows [n, "
                             f"{', '.join(map(str, want[1:]))}]")


class _TensorCodec(RowCodec):
    """A codec whose held rows are one tensor: the plumbing of that form."""

    def _tensor(self, rows: object) -> torch.Tensor:
        t = self.check(rows)
        assert isinstance(t, torch.Tensor)
        return t

    def _out_tensor(self, out: Rows | None) -> torch.Tensor | None:
        dst = self._out(out)
        assert dst is None or isinstance(dst, torch.Tensor)
        return dst

    def tensors(self, rows: Rows) -> tuple[torch.Tensor, ...]:
        return (self._tensor(rows),)

    def head(self, rows: Rows, n: int) -> Rows:
        return self._tensor(rows)[:n]

    def to(self, rows: Rows, device: torch.device, non_blocking: bool = False) -> Rows:
        return self._tensor(rows).to(device, non_blocking=non_blocking)

    def host_copy(self, rows: Rows) -> Rows:
        # blocking: the device rows may be reused as soon as they are dropped
        return host_clone(self._tensor(rows))  # pinned for exactly its bytes (torch's rounds up)


class PoolRowsCodec(_TensorCodec):
    """Rows as the pool holds them: `bf16` for a bf16/fp16/fp32 pool, `fp8_kv` for a float8_e4m3fn
    pool (its own bytes, static KV scale, never re-scaled). Exact: copies only."""

    exact = True

    def __init__(self, pool_dtype: torch.dtype) -> None:
        if pool_dtype not in PACKABLE_DTYPES + KV_FP8_DTYPES:
            raise ValueError(f"pool dtype must be one of {PACKABLE_DTYPES + KV_FP8_DTYPES}, got {pool_dtype}")
        super().__init__(pool_dtype)
        self.name = "fp8_kv" if pool_dtype in KV_FP8_DTYPES else "bf16"

    def holds(self, rows: object) -> bool:
        return isinstance(rows, torch.Tensor) and rows.dtype == self.pool_dtype

    def _form(self) -> str:
        return f"{self.pool_dtype} tensors"

    def view(self, raw: torch.Tensor, shape: tuple[int, ...]) -> Rows:
        return raw.view(self.pool_dtype).view(shape)

    def copy_(self, dst: Rows, src: Rows) -> None:
        assert isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor)
        _bytes_view(dst).copy_(_bytes_view(self._tensor(src)))

    def encode(self, rows: torch.Tensor) -> Rows:
        return self._tensor(rows).clone()

    def decode(self, rows: Rows) -> torch.Tensor:
        return self._tensor(rows)  # already the pool's rows

    def gather_pages(self, buf: torch.Tensor, pages: Sequence[int], lo: int, hi: int,
                     out: Rows | None = None) -> Rows:
        self._check_pool(buf)
        dst = self._out_tensor(out)
        rows = gather_rows(_bytes_view(buf), pages, lo, hi, out=None if dst is None else _bytes_view(dst))
        return rows.view(self.pool_dtype) if dst is None else dst

    def scatter_pages(self, buf: torch.Tensor, pages: Sequence[int], lo: int, rows: Rows) -> None:
        self._check_pool(buf)
        src = self._tensor(rows)
        scatter_rows(_bytes_view(buf), pages, lo, _bytes_view(src))

    def gather_blocks(self, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: Sequence[int],
                      rows: int, out: Rows | None = None) -> Rows:
        # k_cache, v_cache: [num_blocks, block_size, Hkv, D] of the pool's dtype, one device
        check_caches(k_cache, v_cache)
        self._check_pool(k_cache)
        idx = blocks_of_rows(block_ids, rows, k_cache)
        shape = (rows, 2, *k_cache.shape[2:])
        dst = self._out_tensor(out)
        if dst is None:
            dst = torch.empty(shape, dtype=self.pool_dtype, device=k_cache.device)
        else:
            check_out(dst, torch.Tensor, shape, k_cache.dtype, k_cache.device)
        slots = slots_for_rows(idx, torch.arange(rows, device=k_cache.device), k_cache.shape[1])  # [rows] int64
        for i, cache in enumerate((k_cache, v_cache)):  # K, then V: each row read once, into dst[:, i]
            torch.index_select(_bytes_view(cache).flatten(0, 1), 0, slots, out=_bytes_view(dst)[:, i])
        return dst

    def scatter_blocks(self, rows: Rows, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_ids: torch.Tensor) -> None:
        self._check_pool(k_cache)
        src = self._tensor(rows)
        n, _, hkv, d = src.shape
        src = _bytes_view(src.to(k_cache.device))
        slots = slots_for_rows(block_ids, torch.arange(n, device=block_ids.device), k_cache.shape[1])
        for i, cache in enumerate((k_cache, v_cache)):
            _bytes_view(cache).view(-1, hkv, d).index_copy_(0, slots, src[:, i])

    def _check_pool(self, buf: torch.Tensor) -> None:
        if buf.dtype != self.pool_dtype:
            raise RuntimeError(f"a {self.name} codec of a {self.pool_dtype} pool got {buf.dtype} pages")


_Held = TypeVar("_Held", PackedRows, Nvfp4Rows, Nvfp4KvRows)


class _HeldRowsCodec(RowCodec, Generic[_Held]):
    """A codec whose held rows are a `rows_type` object (its `tensors`, `head`, `to`,
    `host_copy`): the plumbing of that form."""

    rows_type: type[_Held]

    def holds(self, rows: object) -> bool:
        return isinstance(rows, self.rows_type)

    def _rows(self, rows: object) -> _Held:
        p = self.check(rows)
        assert isinstance(p, self.rows_type)
        return p

    def _out_rows(self, out: Rows | None) -> _Held | None:
        p = self._out(out)
        assert p is None or isinstance(p, self.rows_type)
        return p

    def tensors(self, rows: Rows) -> tuple[torch.Tensor, ...]:
        return self._rows(rows).tensors()

    def head(self, rows: Rows, n: int) -> Rows:
        return self._rows(rows).head(n)

    def to(self, rows: Rows, device: torch.device, non_blocking: bool = False) -> Rows:
        return self._rows(rows).to(device, non_blocking=non_blocking)

    def host_copy(self, rows: Rows) -> Rows:
        return self._rows(rows).host_copy()


_Packed = TypeVar("_Packed", PackedRows, Nvfp4Rows)


class _PackedCodec(_HeldRowsCodec[_Packed]):
    """Rows of a bf16/fp16/fp32 pool packed out of it as `rows_type` (a `PackedRowsBase`): packed
    as gathered, unpacked as scattered. What the packed formats do alike is here; each says how
    its rows lie in an arena extent (`view`) and how they are packed and unpacked."""

    exact = False
    packs = True

    def __init__(self, pool_dtype: torch.dtype) -> None:
        if pool_dtype not in PACKABLE_DTYPES:
            raise ValueError(f"{self.name} packs rows of {PACKABLE_DTYPES}, got a {pool_dtype} pool")
        super().__init__(pool_dtype)

    def holds(self, rows: object) -> bool:
        return isinstance(rows, self.rows_type) and rows.dtype == self.pool_dtype

    def _form(self) -> str:
        return f"{self.rows_type.__name__} of {self.pool_dtype}"


class Fp8PackedCodec(_PackedCodec[PackedRows]):
    """`fp8`: a bf16/fp16/fp32 pool's rows packed as `PackedRows` (e4m3 payload, one float32 scale
    a vector: `dataplane/row_format.py`), packed as gathered and unpacked as scattered."""

    name = "fp8"
    rows_type = PackedRows

    def view(self, raw: torch.Tensor, shape: tuple[int, ...]) -> Rows:
        payload_nbytes = 1
        for s in shape:
            payload_nbytes *= s  # one e4m3 byte an element, then the float32 scales
        payload = raw[:payload_nbytes].view(FP8_DTYPE).view(shape)
        scales = raw[payload_nbytes:].view(torch.float32).view(shape[:-1])
        return PackedRows(payload, scales, self.pool_dtype)

    def encode(self, rows: torch.Tensor) -> Rows:
        return pack_rows(rows)

    def decode(self, rows: Rows) -> torch.Tensor:
        return unpack_rows(self._rows(rows))

    def gather_pages(self, buf: torch.Tensor, pages: Sequence[int], lo: int, hi: int,
                     out: Rows | None = None) -> Rows:
        return gather_packed_rows(buf, pages, lo, hi, out=self._out_rows(out))

    def scatter_pages(self, buf: torch.Tensor, pages: Sequence[int], lo: int, rows: Rows) -> None:
        scatter_packed_rows(buf, pages, lo, self._rows(rows))

    def gather_blocks(self, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: Sequence[int],
                      rows: int, out: Rows | None = None) -> Rows:
        return pack_blocks(k_cache, v_cache, block_ids, rows, out=self._out_rows(out))

    def scatter_blocks(self, rows: Rows, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_ids: torch.Tensor) -> None:
        unpack_into_blocks(self._rows(rows), k_cache, v_cache, block_ids)


class CompositeCodec(RowCodec):
    """One row per key of K/V (held by `main`, any codec above) and the side rows `sides` kept in
    the same page slot, copied exactly: the pool is `SlotPages`, the held form `CompositeRows`.
    Exact iff `main` is. Its name is `main`'s and the sides', e.g. `bf16+index_k+position`."""

    def __init__(self, main: RowCodec, sides: Sequence[SideRows]) -> None:
        if isinstance(main, CompositeCodec) or not sides:
            raise ValueError(f"a composite codec takes a K/V codec and at least one side, got {main!r}, {sides!r}")
        super().__init__(main.pool_dtype)
        self.main = main
        self.sides = tuple(sides)
        self.name = "+".join((main.name, *(s.name for s in self.sides)))
        self.exact = main.exact
        self.no_blocks = (f"{self.name} rows live in a draft pool's slots; the reference runtime's K/V "
                          "block caches hold no side rows")

    def row_nbytes(self, num_kv_heads: int, head_dim: int) -> int:
        return self.main.row_nbytes(num_kv_heads, head_dim) + sum(s.row_nbytes for s in self.sides)

    def format(self, num_kv_heads: int, head_dim: int) -> RowFormat:
        raise TypeError(f"{self.name} rows carry side rows: the core's RowFormat counts K/V vectors only "
                        "(charge codec.nbytes / row_nbytes)")

    def holds(self, rows: object) -> bool:
        return (isinstance(rows, CompositeRows) and rows.spec == self.sides and self.main.holds(rows.kv)
                and all(t.dtype == s.dtype and tuple(t.shape[1:]) == s.row_shape
                        and t.shape[0] == rows.kv.shape[0] for t, s in zip(rows.sides, self.sides, strict=True)))

    def _rows(self, rows: object) -> CompositeRows:
        c = self.check(rows)
        assert isinstance(c, CompositeRows)
        return c

    def _form(self) -> str:
        return f"CompositeRows of {self.main._form()} and {', '.join(s.name for s in self.sides)}"

    def tensors(self, rows: Rows) -> tuple[torch.Tensor, ...]:
        c = self._rows(rows)
        return (*self.main.tensors(c.kv), *c.sides)

    def head(self, rows: Rows, n: int) -> Rows:
        c = self._rows(rows)
        return CompositeRows(self.main.head(c.kv, n), tuple(t[:n] for t in c.sides), self.sides)  # type: ignore[arg-type]

    def to(self, rows: Rows, device: torch.device, non_blocking: bool = False) -> Rows:
        c = self._rows(rows)
        return CompositeRows(self.main.to(c.kv, device, non_blocking),  # type: ignore[arg-type]
                             tuple(t.to(device, non_blocking=non_blocking) for t in c.sides), self.sides)

    def host_copy(self, rows: Rows) -> Rows:
        c = self._rows(rows)  # the sides pinned exactly and copied blocking, as the K/V codec's rows
        return CompositeRows(self.main.host_copy(c.kv), tuple(host_clone(t) for t in c.sides),  # type: ignore[arg-type]
                             self.sides)

    def view(self, raw: torch.Tensor, shape: tuple[int, ...]) -> Rows:
        n = shape[0]
        offset = n * self.main.row_nbytes(shape[2], shape[3])
        if offset % 4:
            raise ValueError(f"{self.main.name} rows {shape} take {offset} bytes: the side rows after "
                             "them need a multiple of 4")
        kv = self.main.view(raw[:offset], shape)
        sides = []
        for s in self.sides:
            nbytes = n * s.row_nbytes
            sides.append(raw[offset:offset + nbytes].view(s.dtype).view(n, *s.row_shape))
            offset += nbytes
        return CompositeRows(kv, tuple(sides), self.sides)  # type: ignore[arg-type]

    def encode(self, rows: torch.Tensor) -> Rows:
        raise TypeError(f"{self.name} rows are gathered from their pages with their side rows "
                        "(gather_pages), not encoded from K/V rows alone")

    def decode(self, rows: Rows) -> torch.Tensor:
        return self.main.decode(self._rows(rows).kv)

    def _check_pages(self, buf: object) -> SlotPages:
        if not isinstance(buf, SlotPages) or len(buf.sides) != len(self.sides):
            raise RuntimeError(f"a {self.name} codec reads SlotPages with {len(self.sides)} side views, "
                               f"got {type(buf).__name__}")
        tpb = buf.kv.shape[3]
        for view, s in zip(buf.sides, self.sides, strict=True):
            if view.dtype != s.dtype or tuple(view.shape[2:]) != s.row_shape or view.shape[1] != tpb:
                raise RuntimeError(f"side view {s.name} is {view.dtype} {tuple(view.shape)}: expected "
                                   f"{s.dtype} [slots, {tpb}, {', '.join(map(str, s.row_shape))}]")
        return buf

    def gather_pages(self, buf: torch.Tensor, pages: Sequence[int], lo: int, hi: int,
                     out: Rows | None = None) -> Rows:
        p = self._check_pages(buf)
        c = self._out(out)
        assert c is None or isinstance(c, CompositeRows)
        page, slot = key_slots(pages, lo, hi, p.kv.shape[3], p.kv.device)  # the pages checked
        if c is None:
            sides = tuple(torch.empty((hi - lo, *s.row_shape), dtype=s.dtype, device=p.kv.device)
                          for s in self.sides)
        else:  # every side checked before the K/V rows' first write
            for t, s in zip(c.sides, self.sides, strict=True):
                check_out(t, torch.Tensor, (hi - lo, *s.row_shape), s.dtype, p.kv.device)
            sides = c.sides
        kv = self.main.gather_pages(p.kv, pages, lo, hi, out=None if c is None else c.kv)
        for view, t in zip(p.sides, sides, strict=True):  # [n, *row_shape] each
            index_into(view, [page, slot], t)
        return CompositeRows(kv, sides, self.sides) if c is None else c  # type: ignore[arg-type]

    def scatter_pages(self, buf: torch.Tensor, pages: Sequence[int], lo: int, rows: Rows) -> None:
        p = self._check_pages(buf)
        c = self._rows(rows)
        # everything checked before the first write: the K/V rows' fit, and the pages held
        self.main.check_fits(c.kv, p.kv.shape[2], p.kv.shape[4])
        page, slot = key_slots(pages, lo, lo + c.kv.shape[0], p.kv.shape[3], p.kv.device)
        self.main.scatter_pages(p.kv, pages, lo, c.kv)
        for view, t in zip(p.sides, c.sides, strict=True):
            view[page, slot] = t.to(view.device)

    def check_fits(self, rows: Rows, num_kv_heads: int, head_dim: int) -> None:
        self.main.check_fits(self._rows(rows).kv, num_kv_heads, head_dim)


class Nvfp4Codec(_PackedCodec[Nvfp4Rows]):
    """`nvfp4`: a bf16/fp16/fp32 pool's rows packed as `Nvfp4Rows` (e2m1 pairs, one e4m3 scale per
    16 values, one e8m0 global scale a vector: `dataplane/nvfp4.py`), packed as gathered and
    unpacked as scattered."""

    name = "nvfp4"
    rows_type = Nvfp4Rows

    def view(self, raw: torch.Tensor, shape: tuple[int, ...]) -> Rows:
        # payload (D/2 bytes a vector), then the block scales (D/16), then the global scales (1):
        # all bytes, so no alignment within the extent
        lead, d = tuple(shape[:-1]), shape[-1]
        vectors = math.prod(lead)
        a, b = vectors * (d // 2), vectors * (d // 2 + d // 16)
        return Nvfp4Rows(raw[:a].view(*lead, d // 2), raw[a:b].view(*lead, d // 16),
                         raw[b:b + vectors].view(lead), self.pool_dtype)

    def encode(self, rows: torch.Tensor) -> Rows:
        return nvfp4.pack_rows(rows)

    def decode(self, rows: Rows) -> torch.Tensor:
        return nvfp4.unpack_rows(self._rows(rows))

    def gather_pages(self, buf: torch.Tensor, pages: Sequence[int], lo: int, hi: int,
                     out: Rows | None = None) -> Rows:
        return nvfp4.gather_pages(buf, pages, lo, hi, out=self._out_rows(out))

    def scatter_pages(self, buf: torch.Tensor, pages: Sequence[int], lo: int, rows: Rows) -> None:
        nvfp4.scatter_pages(buf, pages, lo, self._rows(rows))

    def gather_blocks(self, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: Sequence[int],
                      rows: int, out: Rows | None = None) -> Rows:
        return nvfp4.pack_blocks(k_cache, v_cache, block_ids, rows, out=self._out_rows(out))

    def scatter_blocks(self, rows: Rows, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_ids: torch.Tensor) -> None:
        nvfp4.unpack_into_blocks(self._rows(rows), k_cache, v_cache, block_ids)


class Nvfp4KvPagesCodec(_HeldRowsCodec[Nvfp4KvRows]):
    """`nvfp4_kv`: an NVFP4 KV pool's own rows, its e2m1 payload and e4m3 block-scale bytes
    (`Nvfp4KvRows`), gathered from and scattered to `Nvfp4KvPages` at the addresses
    TensorRT-LLM's writer gives each byte (`dataplane/nvfp4_kv.py`). Exact: copies only, never
    dequantized or re-scaled (the layer's global scales are static). Its rows live in a
    draft pool's pages only: the reference runtime's K/V block caches are never NVFP4."""

    name = "nvfp4_kv"
    exact = True
    rows_type = Nvfp4KvRows
    no_blocks = ("nvfp4_kv rows live in an NVFP4 draft pool's pages; the reference runtime's K/V block "
                 "caches are never NVFP4")

    def __init__(self, pool_dtype: torch.dtype) -> None:
        if pool_dtype != NVFP4_KV_DTYPE:
            raise ValueError(f"nvfp4_kv carries an NVFP4 pool ({NVFP4_KV_DTYPE}), got a {pool_dtype} pool")
        super().__init__(pool_dtype)

    def format(self, num_kv_heads: int, head_dim: int) -> RowFormat:
        return RowFormat(self.name, 2 * num_kv_heads, head_dim, 1)  # bytes: no element of the marker dtype

    def _form(self) -> str:
        return "Nvfp4KvRows (an NVFP4 pool's payload and block-scale bytes)"

    def view(self, raw: torch.Tensor, shape: tuple[int, ...]) -> Rows:
        # the payload (D/2 bytes a vector), then the block scales (D/16): bytes, no alignment
        lead, d = tuple(shape[:-1]), shape[-1]
        a = math.prod(lead) * (d // 2)
        return Nvfp4KvRows(raw[:a].view(*lead, d // 2), raw[a:a + math.prod(lead) * (d // 16)].view(*lead, d // 16))

    def encode(self, rows: torch.Tensor) -> Rows:
        raise TypeError("nvfp4_kv rows are an NVFP4 pool's own bytes, gathered from its pages "
                        "(gather_pages), never encoded from other rows")

    def decode(self, rows: Rows) -> torch.Tensor:
        raise TypeError("nvfp4_kv rows are scattered back as the pool's own bytes; decoding them "
                        "needs the layer's global K/V scales, which the carry never reads")

    def _pages(self, buf: object) -> Nvfp4KvPages:
        if not isinstance(buf, Nvfp4KvPages):
            raise RuntimeError(f"a nvfp4_kv codec reads Nvfp4KvPages (payload and scale pages), got "
                               f"{type(buf).__name__} {getattr(buf, 'dtype', '')}")
        return buf

    def gather_pages(self, buf: torch.Tensor, pages: Sequence[int], lo: int, hi: int,
                     out: Rows | None = None) -> Rows:
        return gather_kv_pages(self._pages(buf), pages, lo, hi, out=self._out_rows(out))

    def scatter_pages(self, buf: torch.Tensor, pages: Sequence[int], lo: int, rows: Rows) -> None:
        scatter_kv_pages(self._pages(buf), pages, lo, self._rows(rows))


class LatentRowsCodec(PoolRowsCodec):
    """An MLA latent pool's rows as the pool holds them (`bf16`: BF16 pages; `fp8_kv`: float8_e4m3fn
    pages, their own bytes, never re-scaled): one vector a key (SELFKONLY, kv_factor 1), held
    `[n, 1, Hkv, D]` and gathered from / scattered to the pool's HND view `[pages, 1, Hkv, tpb, D]`
    (DeepSeek-V4's `get_buffers(layer, SWA)` `[pages, tpb, D]` with its one head). Exact. Its rows
    live in a draft pool's pages only: the reference runtime's K/V block caches hold K and V."""

    no_blocks = ("latent rows live in an MLA draft pool's pages; the reference runtime's K/V block caches "
                 "hold K and V")

    def format(self, num_kv_heads: int, head_dim: int) -> RowFormat:
        return RowFormat(self.name, num_kv_heads, head_dim, _elem_bytes(self.pool_dtype))  # one vector a head

    def held_shape(self, rows: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (rows, 1, num_kv_heads, head_dim)

    def gather_pages(self, buf: torch.Tensor, pages: Sequence[int], lo: int, hi: int,
                     out: Rows | None = None) -> Rows:
        self._check_latent(buf)
        return super().gather_pages(buf, pages, lo, hi, out=out)

    def scatter_pages(self, buf: torch.Tensor, pages: Sequence[int], lo: int, rows: Rows) -> None:
        self._check_latent(buf)
        super().scatter_pages(buf, pages, lo, rows)

    gather_blocks = RowCodec.gather_blocks  # pages only: PoolRowsCodec's K/V block methods do not apply
    scatter_blocks = RowCodec.scatter_blocks

    def _check_latent(self, buf: torch.Tensor) -> None:
        if buf.dim() != 5 or buf.shape[1] != 1:
            raise RuntimeError(f"latent pages are HND [pages, 1, Hkv, tpb, D], got {tuple(buf.shape)}")


class FooterScaleCodec(_TensorCodec):
    """`fp8_ds_mla`: DeepSeek-V4's footer-scale latent pages' own bytes, a key's 576 data bytes
    (448 e4m3 latent values, 64 bf16 RoPE values) then its 8 footer bytes (7 UE8M0 tile scales and
    the pad byte), held uint8 `[n, 584]`, gathered from and scattered to `FooterScalePages` at the
    addresses TensorRT-LLM's writer gives them (`latent_pages.py`). Exact: copies only, never
    dequantized. One latent vector a key of width 512, one head."""

    name = "fp8_ds_mla"
    exact = True
    no_blocks = ("fp8_ds_mla rows live in a DeepSeek-V4 draft pool's pages; the reference runtime's K/V block "
                 "caches are never footer-scale")

    def __init__(self, pool_dtype: torch.dtype = torch.uint8) -> None:
        if pool_dtype != torch.uint8:
            raise ValueError(f"fp8_ds_mla carries footer-scale pages' bytes (uint8), got a {pool_dtype} pool")
        super().__init__(pool_dtype)

    def format(self, num_kv_heads: int, head_dim: int) -> RowFormat:
        return RowFormat(self.name, num_kv_heads, head_dim, 1)  # 584 bytes a 512-wide vector

    def held_shape(self, rows: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        if (num_kv_heads, head_dim) != (1, FP8_DS_MLA_DIM):
            raise ValueError(f"fp8_ds_mla pages hold one {FP8_DS_MLA_DIM}-wide latent vector a key, not "
                             f"{num_kv_heads} heads of {head_dim}")
        return (rows, TOKEN_BYTES)

    def holds(self, rows: object) -> bool:
        return (isinstance(rows, torch.Tensor) and rows.dtype == torch.uint8 and rows.dim() == 2
                and rows.shape[1] == TOKEN_BYTES)

    def _form(self) -> str:
        return f"uint8 [n, {TOKEN_BYTES}] tensors (a footer-scale key's bytes)"

    def view(self, raw: torch.Tensor, shape: tuple[int, ...]) -> Rows:
        return raw.view(torch.uint8).view(shape)

    def encode(self, rows: torch.Tensor) -> Rows:
        raise TypeError("fp8_ds_mla rows are a footer-scale pool's own bytes, gathered from its pages "
                        "(gather_pages), never encoded from other rows")

    def decode(self, rows: Rows) -> torch.Tensor:
        raise TypeError("fp8_ds_mla rows are scattered back as the pool's own bytes; the carry never "
                        "dequantizes them")

    def _pages(self, buf: object) -> FooterScalePages:
        if not isinstance(buf, FooterScalePages):
            raise RuntimeError(f"a fp8_ds_mla codec reads FooterScalePages, got {type(buf).__name__} "
                               f"{getattr(buf, 'dtype', '')}")
        return buf

    def gather_pages(self, buf: torch.Tensor, pages: Sequence[int], lo: int, hi: int,
                     out: Rows | None = None) -> Rows:
        return gather_footer_rows(self._pages(buf), pages, lo, hi, out=self._out_tensor(out))

    def scatter_pages(self, buf: torch.Tensor, pages: Sequence[int], lo: int, rows: Rows) -> None:
        scatter_footer_rows(self._pages(buf), pages, lo, self._tensor(rows))



CODECS: dict[str, type[RowCodec]] = {"bf16": PoolRowsCodec, "fp8": Fp8PackedCodec, "nvfp4": Nvfp4Codec,
                                     "fp8_kv": PoolRowsCodec, "nvfp4_kv": Nvfp4KvPagesCodec,
                                     "fp8_ds_mla": FooterScaleCodec}
"""Codec classes by format name (`core.row_format.ROW_FORMATS`)."""


@functools.cache
def _codec(cls: type[RowCodec], pool_dtype: torch.dtype) -> RowCodec:
    return cls(pool_dtype)  # one instance per (format, pool dtype): codecs hold no state


def codec_of(rows: object) -> RowCodec:
    """The codec whose held form `rows` are (`CompositeRows`: a composite of its K/V rows' codec;
    `PackedRows`: fp8; `Nvfp4Rows`: nvfp4; a tensor: its dtype's pool rows); TypeError for anything
    else."""
    if isinstance(rows, CompositeRows):
        return CompositeCodec(codec_of(rows.kv), rows.spec)
    if isinstance(rows, PackedRows):
        return _codec(Fp8PackedCodec, rows.dtype)
    if isinstance(rows, Nvfp4Rows):
        return _codec(Nvfp4Codec, rows.dtype)
    if isinstance(rows, Nvfp4KvRows):
        return _codec(Nvfp4KvPagesCodec, NVFP4_KV_DTYPE)
    if isinstance(rows, torch.Tensor):
        return _codec(PoolRowsCodec, rows.dtype)
    raise TypeError(f"carried rows are a tensor, PackedRows, Nvfp4Rows or Nvfp4KvRows, got {type(rows).__name__}")


def latent_codec(pool_dtype: torch.dtype) -> RowCodec:
    """The codec of an MLA latent pool's own rows: `fp8_ds_mla` for footer-scale pages (uint8 bytes),
    else `LatentRowsCodec` (a BF16 or float8_e4m3fn pool's rows as held). ValueError names another dtype."""
    if pool_dtype == torch.uint8:
        return _codec(FooterScaleCodec, pool_dtype)
    return _codec(LatentRowsCodec, pool_dtype)


def codec_for(row_dtype: str, pool_dtype: torch.dtype) -> RowCodec:
    """The codec carrying a `pool_dtype` pool's rows under `carry_row_dtype` `row_dtype`: an FP8 KV
    pool carries its own bytes (`fp8_kv`), an NVFP4 one (`NVFP4_KV_DTYPE`) its own payload and
    block-scale bytes (`nvfp4_kv`), whatever `row_dtype` says; otherwise `row_dtype`'s codec
    (`bf16`: the pool's rows as held; `fp8`, `nvfp4`: packed). ValueError names a bad pair."""
    from ..core.row_format import check_row_dtype

    check_row_dtype(row_dtype)
    if pool_dtype == NVFP4_KV_DTYPE:
        return _codec(Nvfp4KvPagesCodec, pool_dtype)
    if pool_dtype in KV_FP8_DTYPES:
        return _codec(PoolRowsCodec, pool_dtype)
    return _codec(CODECS[row_dtype], pool_dtype)
