"""FP8 row format for carried drafter KV rows: e4m3 payload, one float32 scale per vector.

What it is for: a carried entry held packed costs about half the bytes of its
bf16 rows, so the same carry budget holds about twice the sessions.
The rows are a cache of a drafter's KV: the target verifies every draft, so the
rounding here can cost accepted tokens, never correctness.

A "vector" is one last-dim slice of the rows: for the rows `[n, 2, Hkv, D]`
both executors gather, one (row, K/V, head) vector of `D` values::

    rows    [n, 2, Hkv, D] bf16      ->  payload [n, 2, Hkv, D] float8_e4m3fn
                                         scales  [n, 2, Hkv]    float32
    bytes   n*2*Hkv*D*2              ->  n*2*Hkv*D*1 + n*2*Hkv*4   (D=256: 0.508x, D=128: 0.516x)

Format (what `pack_rows` writes, bit for bit):
- `scale = max(amax(|v|) / 448, 2**-126)` in float32, where 448 is e4m3fn's
  largest finite value and 2**-126 float32's smallest normal: the floor keeps
  the scale normal (no subnormal-scale precision loss, no division by zero),
  so a zero vector gets scale 2**-126 and packs to exact zeros (signs kept).
  `amax / 448` is the correctly rounded quotient on every device (never
  `amax * (1/448)`, which CUDA's `tensor / python_float` computes: the torch
  path divides by a tensor on the rows' device, the Triton kernel by `div_rn`).
- `payload = v / scale` (float32) cast to float8_e4m3fn (torch's cast: round
  to nearest even). No clamp is needed: `scale` is `amax / 448` correctly
  rounded, so `|v| / scale <= 448 * (1 + 2**-23)`, below 464, the midpoint to
  the next code (not finite in e4m3fn): the largest value rounds to 448 exactly.
- unpack: `payload.float() * scale` in float32, cast to the rows' dtype.

Error bound (what the tests pin): with `x = v / scale`, e4m3 has 3 mantissa
bits, so a normal `x` (|x| >= 2**-6) rounds within 2**-4 of |x| and a subnormal
one within half its spacing, 2**-10. Per value, before the final cast,
`|unpack - v| <= 2**-4 * |v| + 2**-10 * scale` (plus float32 rounding, ~2**-23
relative); the cast to bf16 adds at most 2**-8 of the result.

Invariants:
- vectorized: no Python loop over rows, vectors or heads; deterministic (every
  step is elementwise or an exact max, so two runs give the same bits);
- finite inputs only carry meaning: a vector holding a NaN or inf packs to a
  NaN scale and unpacks to all NaN, never to a finite wrong value (its payload
  bits are unspecified);
- `PackedRows.nbytes == packed_nbytes(vectors, head_dim)`: the bytes a carry
  store charges are the bytes held.

Kernels: `kernel="torch"` is plain torch (CPU, and anywhere); `kernel="triton"`
runs `triton_kernels.fp8_pack_kernel`/`fp8_unpack_kernel`, one pass over the
bytes. The default (`None`) is Triton for CUDA tensors on a GPU with float8
conversions (compute capability 8.9 or later: Ada, Hopper, Blackwell, GB10),
unless `$TRTLLM_MTP_CARRY_KERNELS=aot` (the plugins' AOT kernels have no FP8
twin), and torch elsewhere (CPU, an A100: Triton cannot convert to float8
below 8.9). Both give the same bits for finite vectors.

The Triton kernels address every vector themselves (`VectorLayout`: plain
rows, pages or blocks through a block table, the pool's K and V caches
together), so each call is one launch and builds no per-vector offsets on the
host; block ids reach the device without a stream sync (`device_ints.device_tensor`).
`VectorLayout`, the layouts and the block/page plumbing are `row_layout`'s, shared
with the NVFP4 format (`FP8_OPS` is this format as that plumbing calls it).

The reference runtime's pool keeps K and V in separate caches of whole blocks
(`[num_blocks, block_size, Hkv, D]`); `pack_blocks` gathers an entry's live
rows from them into the same `[rows, 2, Hkv, D]` packed form,
`unpack_into_blocks` writes them back into fresh blocks
(the ids `DrafterKVPool.carry_in` hands out), and `unpack_blocks` rebuilds whole blocks
(`HostRows`' shape).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..core.row_format import rows_nbytes
from . import row_layout as _rl
from .row_layout import PACKABLE_DTYPES, VectorLayout, block_layout, plain_layout

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "FP8_OPS",
    "FP8_TRITON_MIN_CAPABILITY",
    "PACKABLE_DTYPES",
    "PackedRows",
    "SCALE_FLOOR",
    "VectorLayout",
    "block_layout",
    "pack_blocks",
    "pack_layout_triton",
    "pack_rows",
    "packed_nbytes",
    "plain_layout",
    "row_kernel",
    "unpack_blocks",
    "unpack_into_blocks",
    "unpack_layout_triton",
    "unpack_rows",
]

FP8_DTYPE = torch.float8_e4m3fn
#: e4m3fn's largest finite value.
FP8_MAX = 448.0
#: float32's smallest normal value: the least scale (keeps zeros exact, scales normal).
SCALE_FLOOR = 2.0**-126


def packed_nbytes(num_vectors: int, head_dim: int) -> int:
    """Bytes of `num_vectors` packed vectors of `head_dim` values: payload plus scales, exact."""
    _rl.check_counts(num_vectors, head_dim)
    return rows_nbytes("fp8", num_vectors, head_dim)


@dataclass(frozen=True)
class PackedRows(_rl.PackedRowsBase):
    """Rows in the FP8 row format: `payload` `[..., D]` e4m3fn, `scales` `[...]` float32.

    `dtype` is the rows' dtype before packing, the dtype `unpack_rows` returns.
    Construction checks dtypes, shapes and devices (metadata only, no sync).
    """

    payload: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.payload.dtype != FP8_DTYPE:
            raise TypeError(f"payload must be {FP8_DTYPE}, got {self.payload.dtype}")
        if self.scales.dtype != torch.float32:
            raise TypeError(f"scales must be torch.float32, got {self.scales.dtype}")
        if self.payload.dim() < 1 or self.scales.shape != self.payload.shape[:-1]:
            raise ValueError(f"scales {tuple(self.scales.shape)} must be payload "
                             f"{tuple(self.payload.shape)} without its last dimension")
        if self.payload.device != self.scales.device:
            raise ValueError(f"payload on {self.payload.device}, scales on {self.scales.device}")
        if self.dtype not in PACKABLE_DTYPES:
            raise TypeError(f"dtype must be one of {PACKABLE_DTYPES}, got {self.dtype}")

    @property
    def shape(self) -> torch.Size:
        """The rows' shape (the payload's)."""
        return self.payload.shape

    @property
    def num_vectors(self) -> int:
        """Vectors held: one scale each."""
        return self.scales.numel()

    @property
    def nbytes(self) -> int:
        """Payload plus scale bytes; equals `packed_nbytes(num_vectors, head_dim)`."""
        return self.payload.nbytes + self.scales.nbytes


# Every e4m3fn code's float32 value (NaNs included): on CPU, indexing this table is ~10x
# faster than torch's float8 -> float32 cast, with the same bits.
_E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()


def _payload_float(payload: torch.Tensor) -> torch.Tensor:
    """`payload.float()`, a fresh contiguous float32 tensor (a table lookup on CPU)."""
    if not payload.is_cpu:
        return payload.float().contiguous()
    codes = payload.contiguous().view(torch.uint8).reshape(-1).int()
    return _E4M3_VALUES.index_select(0, codes).view(payload.shape)


@functools.cache
def _fp8_max(device: torch.device) -> torch.Tensor:
    """`FP8_MAX` as a 1-element float32 tensor on `device` (made once per device, read only).

    The torch path divides by this, not by the Python float: aten's CUDA division
    computes `t / b` as `t * (1 / b)` (the reciprocal rounded first) whenever `b`
    is a CPU scalar (a Python number or a 0-dim CPU tensor), which differs from
    the correctly rounded `amax / 448` in the last bit for about half of all
    values; by a tensor on the same device it is IEEE division, `a / b` rounded
    once, on CPU and CUDA alike (what the Triton kernel's `div_rn` gives).
    """
    return torch.full((1,), FP8_MAX, dtype=torch.float32, device=device)


#: The least compute capability whose Triton converts float32 to float8 e4m3 (`cvt...e4m3x2`).
FP8_TRITON_MIN_CAPABILITY = (8, 9)


@functools.cache
def _has_fp8_cvt(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= FP8_TRITON_MIN_CAPABILITY


def row_kernel(t: torch.Tensor, kernel: str | None = None) -> str:
    """The implementation that packs/unpacks `t`: `kernel` when given, else by device (see the header)."""
    return _rl.choose_kernel(t, kernel, lambda device: _has_fp8_cvt(device.index or 0))


def pack_layout_triton(src0: torch.Tensor, src1: torch.Tensor | None, layout: VectorLayout,
                       shape: Sequence[int], out: PackedRows | None = None) -> PackedRows:
    """Pack `layout`'s vectors of `src0` (and `src1`, split) with the Triton kernel, as `shape`.

    `prod(shape) == layout.num_vectors * layout.head_dim`; every vector must lie
    inside its tensor (the caller's duty). One launch; the kernel writes `out`'s
    payload and scales when given (`shape`, contiguous: `row_layout.check_out`,
    the caller's duty), else fresh ones.
    """
    from . import triton_kernels as tk

    _rl.check_rows(src0)
    v, d = layout.num_vectors, layout.head_dim
    if out is None:
        out = PackedRows(torch.empty(tuple(shape), dtype=FP8_DTYPE, device=src0.device),
                         torch.empty(tuple(shape[:-1]), dtype=torch.float32, device=src0.device), src0.dtype)
    # the kernel's flat views of out's own storage: [V, D] e4m3 and [V] float32
    tk.fp8_pack_triton(src0, src1, layout, out.payload.view(v, d), out.scales.view(v))
    return out


def unpack_layout_triton(packed: PackedRows, dst0: torch.Tensor, dst1: torch.Tensor | None,
                         layout: VectorLayout) -> None:
    """Write `packed`'s vectors where `layout` places them in `dst0` (and `dst1`), cast to their dtype.

    `packed` holds `layout.num_vectors` vectors of `layout.head_dim` (row-major). One launch.
    """
    from . import triton_kernels as tk

    d = layout.head_dim
    tk.fp8_unpack_triton(packed.payload.reshape(-1, d).contiguous(), packed.scales.reshape(-1).contiguous(),
                         dst0, dst1, layout)


def pack_rows(rows: torch.Tensor, kernel: str | None = None, out: PackedRows | None = None) -> PackedRows:
    """`rows` `[..., D]` in the FP8 row format, one scale per last-dim vector (see the header).

    Deterministic and loop-free; the result is on `rows`' device; `kernel` as `row_kernel`.
    With `out` (PackedRows of `rows`' shape and dtype, contiguous, on its device:
    `row_layout.check_out`) the same bytes are written there and `out` is returned:
    the Triton kernel writes them itself; the torch path divides in a float32
    temporary and casts it into `out`'s payload as it copies.
    """
    _rl.check_rows(rows)
    if out is not None:
        _rl.check_out(out, PackedRows, rows.shape, rows.dtype, rows.device)
    if row_kernel(rows, kernel) == "triton":
        return _rl.pack_plain_triton(FP8_OPS, rows, out)
    x = rows.to(torch.float32, memory_format=torch.contiguous_format, copy=True)  # divided in place
    if rows.shape[-1] == 0:  # no values: amax of nothing is the floor
        scales = torch.full(rows.shape[:-1], SCALE_FLOOR, dtype=torch.float32, device=rows.device)
    else:  # |v| and max are exact in the rows' own dtype: half the bytes of doing it on x
        # divided by a tensor on the rows' device, never by a Python float: CUDA computes
        # `t / python_float` as `t * (1 / b)`, off by an ulp from `amax / 448` (see `_fp8_max`)
        amax = rows.abs().amax(dim=-1, keepdim=True).float()  # [..., 1]: divides in place by [1]
        scales = amax.div_(_fp8_max(rows.device)).clamp_(min=SCALE_FLOOR).squeeze(-1)
        scales += scales - scales  # inf - inf: an inf vector's scale becomes NaN, as a NaN vector's is
    x.div_(scales.unsqueeze(-1))  # |x| <= 448 (1 + 2**-23): rounds to at most 448 (see the header)
    if out is None:
        return PackedRows(x.to(FP8_DTYPE), scales, rows.dtype)
    out.payload.copy_(x)  # the same cast as x.to(FP8_DTYPE) (round to nearest even), one pass fewer
    out.scales.copy_(scales)
    return out


def unpack_rows(packed: PackedRows, out: torch.Tensor | None = None, kernel: str | None = None) -> torch.Tensor:
    """`payload * scale` in float32, cast to `packed.dtype`; written into `out` when given.

    `out` must have the rows' shape and dtype (any device: the values are copied
    there; the Triton path writes straight into an `out` on the packed rows' device).
    """
    _rl.check_unpack_out(FP8_OPS, packed, out)
    if row_kernel(packed.payload, kernel) == "triton":
        return _rl.unpack_plain_triton(FP8_OPS, packed, out)
    values = _payload_float(packed.payload).mul_(packed.scales.unsqueeze(-1))
    if out is None:
        return values.to(packed.dtype)
    out.copy_(values)  # converts while it copies: the same cast, one pass fewer
    return out


# ---- the reference runtime's pool: whole blocks of separate K and V caches ----------------


def pack_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: Sequence[int],
                rows: int, kernel: str | None = None, out: PackedRows | None = None) -> PackedRows:
    """The first `rows` rows held in blocks `block_ids` of the pool's caches, packed as `[rows, 2, Hkv, D]`.

    `k_cache`, `v_cache`: `[num_blocks, block_size, Hkv, D]` (a `DrafterKVPool`'s
    caches, or a `HostRows`' `k`/`v` with `block_ids = range(len)`), one dtype,
    device and strides; row `r` is slot `r % block_size` of block
    `block_ids[r // block_size]`. Only live rows are packed (the tail of the last
    block is not), so `nbytes` charges rows. Bit for bit `pack_rows` of those rows
    stacked `[rows, 2, Hkv, D]`; the Triton path reads K and V in place in one
    launch (no bf16 copy, no device sync), the torch path gathers them first.
    With `out` (PackedRows `[rows, 2, Hkv, D]` of the caches' dtype, contiguous, on
    their device) the same bytes are written there (Triton: by the kernel itself;
    torch: packed, then copied in) and `out` is returned.
    """
    return _rl.pack_blocks(FP8_OPS, k_cache, v_cache, block_ids, rows, kernel, out)


def unpack_blocks(packed: PackedRows, block_size: int,
                  kernel: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole blocks `(k, v)`, each `[cdiv(rows, block_size), block_size, Hkv, D]`, from `pack_blocks`' rows.

    Row `r` lands at block `r // block_size`, slot `r % block_size`; the last
    block's tail past the rows is zeros. Shapes fit `HostRows`. K and V are
    unpacked straight into their blocks (no stacked bf16 copy; Triton: one launch).
    """
    return _rl.unpack_blocks(FP8_OPS, packed, block_size, kernel)


def unpack_into_blocks(packed: PackedRows, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_ids: torch.Tensor, kernel: str | None = None) -> None:
    """Write `pack_blocks`' rows `[rows, 2, Hkv, D]` into blocks `block_ids` of the pool's caches.

    `block_ids`: `[cdiv(rows, block_size)]` int64 on the caches' device (blocks the
    caller alone holds). Row `r` goes to slot `r % block_size` of block
    `block_ids[r // block_size]`; nothing else is written (the last block's tail
    keeps its bytes). Bit for bit `unpack_blocks` copied into those blocks, but
    one pass (Triton: one launch), no whole-block temporaries.
    """
    _rl.unpack_into_blocks(FP8_OPS, packed, k_cache, v_cache, block_ids, kernel)


#: This format as `row_layout`'s shared block/page plumbing calls it.
FP8_OPS: _rl.RowFormatOps[PackedRows] = _rl.RowFormatOps(
    PackedRows, row_kernel, pack_rows, unpack_rows, pack_layout_triton, unpack_layout_triton)
