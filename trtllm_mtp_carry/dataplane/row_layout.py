"""Format-independent plumbing of the packed row formats (FP8 `row_format`, NVFP4 `nvfp4`).

What it is for: both formats pack `head_dim` vectors the same way apart from the
bytes of one vector: their Triton kernels address the vectors by the same
`VectorLayout` (plain rows, TensorRT-LLM's HND pages through a page table, the
reference pool's separate K and V caches through a block table), they choose a
kernel by the same rule, and they gather/scatter whole blocks with the same checks
and the same torch fallbacks. That is written once here; a format supplies its own
pack/unpack functions as a `RowFormatOps` (the HND page twins,
`hnd_pages.gather_pages_packed`/`scatter_pages_packed`, take one too).

A gather may write into a given `out` (rows in the held form, e.g. a view of an
arena extent): the Triton kernels write `out`'s tensors themselves, no temporary;
the torch paths compute in float32 temporaries and copy the result in. `check_out`
is the one check of such an `out`, for every held form.

Invariants:
- Nothing here reads or writes a packed byte itself: every value goes through the
  format's `pack_rows`/`unpack_rows` (torch) or its layout kernels (Triton), so the
  bits are the format's own.
- Every check runs before any write; errors name the offending value.
- Packing into `out` writes exactly the bytes packing without it returns.
- No Python loop over rows, vectors or heads (the loops below run over K and V).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

import torch

from .device_ints import device_tensor
from .ops import cuda_kernels
from .pinned import host_clone
from .reference import slots_for_rows

__all__ = [
    "PACKABLE_DTYPES",
    "PackedRowsBase",
    "check_counts",
    "check_rows",
    "host_copy",
    "map_tensors",
    "RowFormatOps",
    "VectorLayout",
    "block_layout",
    "check_caches",
    "check_out",
    "choose_kernel",
    "fill",
    "pack_blocks",
    "pack_plain_triton",
    "plain_layout",
    "unpack_blocks",
    "unpack_into_blocks",
    "unpack_plain_triton",
    "check_unpack_out",
]


#: Row dtypes the formats pack (what KV caches hold).
PACKABLE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_rows(rows: torch.Tensor) -> None:
    """`rows` is a tensor of a `PACKABLE_DTYPES` dtype with a last (head_dim) dimension."""
    if not isinstance(rows, torch.Tensor):
        raise TypeError(f"rows must be a torch.Tensor, got {type(rows).__name__}")
    if rows.dtype not in PACKABLE_DTYPES:
        raise TypeError(f"rows must be one of {PACKABLE_DTYPES}, got {rows.dtype}")
    if rows.dim() < 1:
        raise ValueError(f"rows need a last (head_dim) dimension, got shape {tuple(rows.shape)}")


def check_counts(num_vectors: int, head_dim: int) -> None:
    """`num_vectors` and `head_dim` are ints >= 0 (a byte count's arguments)."""
    for name, value in (("num_vectors", num_vectors), ("head_dim", head_dim)):
        if type(value) is not int or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")


P = TypeVar("P")


_FIELDS: dict[type, tuple[str, ...]] = {}


def _tensor_fields(cls: type) -> tuple[str, ...]:
    """A held-rows dataclass's tensor fields, in order (every field but `dtype`); made once a class."""
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls) if f.name != "dtype")
    return names


def map_tensors(packed: P, fn: Callable[[torch.Tensor], torch.Tensor]) -> P:
    """Held rows (a format's dataclass: tensor fields, and `dtype` where the format keeps one) with
    `fn` applied to each tensor, rebuilt (so checked) with the same other fields."""
    p: Any = packed
    return cast(P, dataclasses.replace(p, **{name: fn(getattr(p, name)) for name in _tensor_fields(type(p))}))


def host_copy(packed: P) -> P:
    """A copy of `packed` in host memory, page-locked when the rows are on a GPU (for asynchronous
    copies back): one blocking pass over the bytes, so the source may be reused at once; always
    a copy, also of rows already on the host."""
    return map_tensors(packed, host_clone)  # pinned for exactly its bytes (torch's rounds up)


_R = TypeVar("_R", bound="PackedRowsBase")


class PackedRowsBase:
    """What every format's held rows do alike (a frozen dataclass: tensor fields, `payload`
    first, and `dtype`): where they are, and moving or copying all their tensors together."""

    payload: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.payload.device

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors holding the rows, in field order (`payload` first)."""
        return tuple(getattr(self, name) for name in _tensor_fields(type(self)))

    def head(self: _R, n: int) -> _R:
        """The first `n` rows, views of the same tensors."""
        return map_tensors(self, lambda t: t[:n])

    def to(self: _R, device: torch.device | str, non_blocking: bool = False) -> _R:
        """The same packed rows on `device` (sharing the tensors when they are there already)."""
        return map_tensors(self, lambda t: t.to(device, non_blocking=non_blocking))

    def host_copy(self: _R) -> _R:
        """A copy in host memory, page-locked when the rows are on a GPU (for asynchronous
        copies back): one blocking pass over the bytes, so the source may be reused at once;
        always a copy, also of rows already on the host."""
        return host_copy(self)


def check_out(out: Any, form: type[Any], shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> None:
    """`out` can take a gather's rows `shape` of `dtype` on `device` in place: a `form` (a tensor, or
    held rows with `shape`, `dtype` and `tensors()`) of that shape and dtype, every tensor on `device`
    and contiguous (as `RowCodec.view` lays rows in an extent: the kernels write flat arrays).
    Otherwise a RuntimeError naming what differs (a caller's bug), before any write."""
    if not isinstance(out, form):
        raise RuntimeError(f"out is {type(out).__name__}, the gather writes {form.__name__}")
    if tuple(out.shape) != tuple(shape):
        raise RuntimeError(f"out holds rows {list(out.shape)}, the gather gives rows {list(shape)}")
    if out.dtype != dtype:
        raise RuntimeError(f"out holds {out.dtype} rows, the gather gives {dtype} rows")
    for t in (out,) if isinstance(out, torch.Tensor) else out.tensors():
        if t.device != device:
            raise RuntimeError(f"out is on {t.device}, the gather writes on {device}")
        if not t.is_contiguous():
            raise RuntimeError(f"out's tensor {list(t.shape)} has strides {list(t.stride())}: a gather writes "
                               "contiguous tensors (as RowCodec.view lays an extent)")


def fill(out: P, packed: P) -> P:
    """`out` with `packed`'s bytes copied in, tensor by tensor (a torch path's last step when it
    packs into a given `out`); `out` returned."""
    a: Any = out
    b: Any = packed
    for dst, src in zip(a.tensors(), b.tensors(), strict=True):
        dst.copy_(src)
    return out


@dataclass(frozen=True)
class VectorLayout:
    """Where `rows * groups * heads` vectors of `head_dim` values lie: the row-format kernels' addressing.

    Vector `(r, g, h)` (index `(r * groups + g) * heads + h`, the packed form's
    order) starts at element `row(r) + g * s_group + h * s_head` of its tensor, its
    values `s_d` apart; `row(r)` is `r * s_row`, or, with a `table` (paged), key
    `k = first_key + r` at block `table[k // rows_per_block]`, slot
    `k % rows_per_block`: `block * s_row + slot * s_slot`. With `split` (the
    pool's separate K and V caches, `groups == 2`), group `g` is tensor `g` and
    `s_group` is unused. The kernels compute these addresses per vector, so a
    call builds no per-vector offsets on the host.
    """

    rows: int
    groups: int
    heads: int
    head_dim: int
    s_row: int
    s_group: int
    s_head: int
    s_d: int
    table: torch.Tensor | None = None  # [blocks] int64 on the tensors' device
    first_key: int = 0
    rows_per_block: int = 1
    s_slot: int = 0
    split: bool = False

    @property
    def num_vectors(self) -> int:
        return self.rows * self.groups * self.heads


def plain_layout(t: torch.Tensor) -> VectorLayout | None:
    """`t` `[..., D]`'s vectors as a `VectorLayout`, row-major; None when its leading
    dimensions do not merge into three strided ones (the caller copies such a tensor)."""
    dims = [(n, st) for n, st in zip(t.shape[:-1], t.stride()[:-1], strict=True) if n != 1]
    merged: list[tuple[int, int]] = []
    for n, st in dims:  # merge a dimension into the one before when it continues it
        if merged and merged[-1][1] == n * st:
            merged[-1] = (merged[-1][0] * n, st)
        else:
            merged.append((n, st))
    if len(merged) > 3:
        return None
    (rows, s_row), (groups, s_group), (heads, s_head) = merged + [(1, 0)] * (3 - len(merged))
    return VectorLayout(rows, groups, heads, t.shape[-1], s_row, s_group, s_head, t.stride(-1))


def block_layout(cache: torch.Tensor, table: torch.Tensor, rows: int) -> VectorLayout:
    """The first `rows` rows of blocks `table` of a pool cache `[num_blocks, block_size, Hkv, D]`
    and of its twin (split: K, then V), as `[rows, 2, Hkv, D]` vectors."""
    s0, s1, s2, s3 = cache.stride()
    return VectorLayout(rows, 2, cache.shape[2], cache.shape[3], s0, 0, s2, s3, table=table,
                        rows_per_block=cache.shape[1], s_slot=s1, split=True)


def choose_kernel(t: torch.Tensor, kernel: str | None, triton_ok: Callable[[torch.device], bool]) -> str:
    """`kernel` when given (checked: 'torch' or 'triton'), else 'triton' for a CUDA tensor when the
    Triton kernels are selected (`ops.cuda_kernels`) and `triton_ok(t.device)`, 'torch' elsewhere."""
    if kernel is None:
        return "triton" if t.is_cuda and cuda_kernels() == "triton" and triton_ok(t.device) else "torch"
    if kernel not in ("torch", "triton"):
        raise ValueError(f"kernel must be 'torch', 'triton' or None, got {kernel!r}")
    return kernel


@dataclass(frozen=True)
class RowFormatOps(Generic[P]):
    """One packed row format as the plumbing here calls it.

    `packed_type` is its packed dataclass: tensor fields whose leading dimensions are
    the rows' (`[..., ...]` per vector) and a `dtype` field last. `kernel(t, kernel)`
    is its kernel choice; `pack_rows(rows, kernel=)` / `unpack_rows(packed, out=,
    kernel=)` its public row functions (`pack_rows(rows, kernel=, out=)` packs into `out` when
    given); `pack_layout(src0, src1, layout, shape, out)` / `unpack_layout(packed, dst0, dst1,
    layout)` its Triton layout calls (one launch; `pack_layout` writes `out`'s tensors when given,
    else fresh ones);
    `check_head_dim` refuses a `head_dim` the format cannot pack (before any work).
    """

    packed_type: type[P]
    kernel: Callable[[torch.Tensor, str | None], str]
    pack_rows: Callable[..., P]
    unpack_rows: Callable[..., torch.Tensor]
    pack_layout: Callable[[torch.Tensor, torch.Tensor | None, VectorLayout, Sequence[int], P | None], P]
    unpack_layout: Callable[[P, torch.Tensor, torch.Tensor | None, VectorLayout], None]
    check_head_dim: Callable[[int], None] | None = None

    def half(self, packed: P, i: int) -> P:
        """K's (`i == 0`) or V's vectors of `[rows, 2, Hkv, D]` packed rows."""
        return map_tensors(packed, lambda t: t[:, i])

    def stack(self, k: P, v: P) -> P:
        """`[rows, 2, Hkv, D]` packed rows from K's and V's halves (exact: vectors pack independently)."""
        a: Any = k
        b: Any = v
        return cast(P, type(a)(*(torch.stack((getattr(a, name), getattr(b, name)), dim=1)
                                 for name in _tensor_fields(type(a))), a.dtype))


def pack_plain_triton(fmt: RowFormatOps[P], rows: torch.Tensor, out: P | None = None) -> P:
    """`rows` `[..., D]` packed by `fmt`'s Triton kernel in one launch, straight into `out` when given
    (checked by the caller: `check_out`), else into fresh tensors (a compact copy is read when more
    than three leading dimensions do not merge)."""
    layout = plain_layout(rows)
    if layout is None:  # more than three unmergeable leading dims: read a compact copy
        rows = rows.contiguous()
        layout = plain_layout(rows)
        assert layout is not None
    return fmt.pack_layout(rows, None, layout, rows.shape, out)


def check_unpack_out(fmt: RowFormatOps[Any], packed: Any, out: torch.Tensor | None) -> None:
    """`packed` is `fmt`'s packed type and `out`, when given, has the rows' shape and dtype."""
    if not isinstance(packed, fmt.packed_type):
        raise TypeError(f"packed must be {fmt.packed_type.__name__}, got {type(packed).__name__}")
    if out is not None and (out.shape != packed.shape or out.dtype != packed.dtype):
        raise ValueError(f"out is {out.dtype} {tuple(out.shape)}, the packed rows "
                         f"{packed.dtype} {tuple(packed.shape)}")


def unpack_plain_triton(fmt: RowFormatOps[Any], packed: Any, out: torch.Tensor | None) -> torch.Tensor:
    """`packed` unpacked by `fmt`'s Triton kernel in one launch: straight into `out` when it is on
    the packed rows' device and addressable, else into a fresh compact tensor (copied into `out`)."""
    dst = out if out is not None and out.device == packed.device else None
    layout = plain_layout(dst) if dst is not None else None
    if dst is None or layout is None:  # a fresh compact tensor, copied into `out` after
        dst = torch.empty(packed.shape, dtype=packed.dtype, device=packed.device)
        layout = plain_layout(dst)
        assert layout is not None
    fmt.unpack_layout(packed, dst, None, layout)
    if out is None or out is dst:
        return dst
    out.copy_(dst)
    return out


# ---- the reference runtime's pool: whole blocks of separate K and V caches ----------------


def check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """`k_cache` and `v_cache` are both `[num_blocks, block_size, Hkv, D]`, one dtype, device and strides."""
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4 or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache {k_cache.dtype} {tuple(k_cache.shape)} and v_cache {v_cache.dtype} "
                         f"{tuple(v_cache.shape)} must both be [num_blocks, block_size, Hkv, D], one dtype")
    if k_cache.device != v_cache.device or k_cache.stride() != v_cache.stride():
        raise ValueError(f"k_cache and v_cache must share device and strides, got {k_cache.device} "
                         f"{k_cache.stride()} and {v_cache.device} {v_cache.stride()}")


def _check_fmt_caches(fmt: RowFormatOps[Any], k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    check_caches(k_cache, v_cache)
    if fmt.check_head_dim is not None:
        fmt.check_head_dim(k_cache.shape[3])


def _check_packed_blocks(fmt: RowFormatOps[Any], packed: Any) -> None:
    if not isinstance(packed, fmt.packed_type):
        raise TypeError(f"packed must be {fmt.packed_type.__name__}, got {type(packed).__name__}")
    if packed.payload.dim() != 4 or packed.shape[1] != 2:
        raise ValueError(f"packed rows must be [rows, 2, Hkv, D], got {tuple(packed.shape)}")


def blocks_of_rows(block_ids: Sequence[int], rows: int, k_cache: torch.Tensor) -> torch.Tensor:
    """The ids of the blocks (of `k_cache` `[num_blocks, block_size, ...]`) holding the first `rows`
    rows of `block_ids`, `[cdiv(rows, block_size)]` int64 on its device (no stream sync);
    ValueError unless `rows` is an int the blocks can hold."""
    block_size = k_cache.shape[1]
    if type(rows) is not int or not 0 <= rows <= len(block_ids) * block_size:
        raise ValueError(f"rows must be an int in [0, {len(block_ids) * block_size}] "
                         f"for {len(block_ids)} blocks of {block_size}, got {rows!r}")
    return device_tensor(block_ids[:-(-rows // block_size)], torch.int64, k_cache.device)


def pack_blocks(fmt: RowFormatOps[P], k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: Sequence[int],
                rows: int, kernel: str | None, out: P | None = None) -> P:
    """The first `rows` rows held in blocks `block_ids` of the pool's caches, packed by `fmt` as
    `[rows, 2, Hkv, D]` (see `row_format.pack_blocks`), into `out` when given (`check_out`):
    Triton reads K and V in place and writes the packed rows (`out`'s tensors) in one launch;
    torch gathers them, packs each half and stacks the halves (copies them into `out`)."""
    # k_cache, v_cache: [num_blocks, block_size, Hkv, D], one dtype, device and strides
    _check_fmt_caches(fmt, k_cache, v_cache)
    idx = blocks_of_rows(block_ids, rows, k_cache)
    shape = (rows, 2, *k_cache.shape[2:])
    if out is not None:
        check_out(out, fmt.packed_type, shape, k_cache.dtype, k_cache.device)
    if fmt.kernel(k_cache, kernel) == "triton":
        return fmt.pack_layout(k_cache, v_cache, block_layout(k_cache, idx, rows), shape, out)
    k, v = (fmt.pack_rows(c.index_select(0, idx).flatten(0, 1)[:rows], kernel="torch") for c in (k_cache, v_cache))
    if out is None:
        return fmt.stack(k, v)  # K and V vectors pack independently: stacking the packed halves is exact
    for i, half in enumerate((k, v)):  # the same halves, copied into out's K and V vectors
        fill(fmt.half(out, i), half)
    return out


def unpack_blocks(fmt: RowFormatOps[Any], packed: Any, block_size: int,
                  kernel: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole blocks `(k, v)` from `pack_blocks`' rows (see `row_format.unpack_blocks`): the last
    block's tail past the rows is zeros; K and V are unpacked straight into their blocks."""
    _check_packed_blocks(fmt, packed)
    if type(block_size) is not int or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    rows, _, hkv, d = packed.shape
    nblocks = -(-rows // block_size)
    k, v = (torch.empty((nblocks, block_size, hkv, d), dtype=packed.dtype, device=packed.device)
            for _ in range(2))
    if rows % block_size:
        for blocks in (k, v):
            blocks.view(-1, hkv, d)[rows:].zero_()
    if fmt.kernel(packed.payload, kernel) == "triton":
        fmt.unpack_layout(packed, k, v, VectorLayout(rows, 2, hkv, d, hkv * d, 0, d, 1, split=True))
    else:
        for i, blocks in enumerate((k, v)):  # K, then V
            fmt.unpack_rows(fmt.half(packed, i), out=blocks.view(-1, hkv, d)[:rows], kernel="torch")
    return k, v


def unpack_into_blocks(fmt: RowFormatOps[Any], packed: Any, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_ids: torch.Tensor, kernel: str | None) -> None:
    """Write `pack_blocks`' rows into blocks `block_ids` of the pool's caches (see
    `row_format.unpack_into_blocks`); every check before any write."""
    _check_fmt_caches(fmt, k_cache, v_cache)
    _check_packed_blocks(fmt, packed)
    rows, _, hkv, d = packed.shape
    if packed.dtype != k_cache.dtype or (hkv, d) != tuple(k_cache.shape[2:]):
        raise ValueError(f"packed rows {packed.dtype} {tuple(packed.shape)} do not fit blocks "
                         f"{k_cache.dtype} {tuple(k_cache.shape)}")
    if block_ids.shape != (-(-rows // k_cache.shape[1]),):
        raise ValueError(f"{rows} rows need {-(-rows // k_cache.shape[1])} blocks, got {tuple(block_ids.shape)}")
    packed = packed.to(k_cache.device)
    if fmt.kernel(k_cache, kernel) == "triton":
        fmt.unpack_layout(packed, k_cache, v_cache, block_layout(k_cache, block_ids, rows))
        return
    slots = slots_for_rows(block_ids, torch.arange(rows, device=block_ids.device), k_cache.shape[1])
    for i, cache in enumerate((k_cache, v_cache)):
        cache.view(-1, hkv, d).index_copy_(0, slots, fmt.unpack_rows(fmt.half(packed, i), kernel="torch"))
