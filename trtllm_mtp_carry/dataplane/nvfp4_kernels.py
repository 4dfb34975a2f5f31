"""Triton kernels of the NVFP4 row format: pack and unpack `head_dim` vectors, one launch each.

What it is for: the Triton twin of `nvfp4.py`'s torch path (that module defines
the format and says which NVIDIA source it follows); the bits are the torch
path's, on CPU (Triton's interpreter, `TRITON_INTERPRET=1`) and on a GPU.

Invariants:
- A program holds BLOCK_V whole vectors as `[BLOCK_V, NB, 8]` element pairs (NB
  scale blocks of 16 elements, 8 pairs each), so the block and vector maxima are
  plain reductions and each payload byte is one lane's pair: no reshape.
- Every float step is one IEEE-rounded operation the torch path performs too:
  `div_rn` divisions (never a reciprocal), products that are exact (a power of two,
  or e2m1 x e4m3 x 2**k, at most 6 significant bits), comparisons; the e4m3 and e2m1
  codes are computed with integer bit operations, so no float8 or float4 conversion
  hardware is needed (any CUDA GPU Triton targets) and the interpreter's float8 cast
  (which carries wrongly) is never met.
- Vectors are addressed by `row_layout.VectorLayout` (plain rows, pages through a
  table, the pool's separate K and V caches), as the FP8 kernels do.
- Grid: `(cdiv(num_vectors, BLOCK_V),)`; `head_dim` a multiple of 16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_kernels import (
    VectorLayout,
    _fp8_vector_offsets,
    _layout_args,
    _load_vectors,
    _round_to_bf16,
    _round_to_e4m3,
    _store_vectors,
)

__all__ = ["nvfp4_pack_kernel", "nvfp4_pack_triton", "nvfp4_unpack_kernel", "nvfp4_unpack_triton"]

#: Values per program (BLOCK_V vectors of BLOCK_D values), as the FP8 kernels.
NVFP4_TILE = 4096

#: The least global scale (a power of two): keeps every block decode scale
#: `s * g` (s >= 2**-9) and every unpacked nonzero value (>= 2**-122) a normal float32.
G_FLOOR = tl.constexpr(2.0**-112)
#: e2m1's largest value times e4m3fn's: a vector's amax over it is its least global scale.
E2M1_E4M3_MAX = tl.constexpr(6.0 * 448.0)


@triton.jit
def _e4m3_code(b):
    """The e4m3fn code (int32, 0..126) of `b` (float32, 0 <= b < 464), rounded to nearest even."""
    r = _round_to_e4m3(b)
    bits = r.to(tl.int32, bitcast=True)
    normal = (((bits >> 23) - 120) << 3) | ((bits >> 20) & 7)  # exponent bias 127 -> 7
    return tl.where(r >= 0.015625, normal, (r * 512.0).to(tl.int32))  # 2**-6; subnormals: r / 2**-9


@triton.jit
def _e4m3_value(c):
    """The float32 value of e4m3fn codes `c` (int32 0..255; 0x7F/0xFF: NaN)."""
    e = (c >> 3) & 15
    m = c & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # 2**-9
    v = tl.where((c & 127) == 127, float("nan"), v)
    return tl.where((c & 128) != 0, -v, v)


@triton.jit
def _e2m1_code(x, d):
    """e2m1 codes (int32 0..15) of `x / d`, rounded to nearest even, saturated at 6; magnitude 0
    where `d` is 0 or the quotient NaN; the sign bit is `x`'s."""
    y = tl.abs(tl.math.div_rn(x, d))
    m = ((y > 0.25).to(tl.int32) + (y >= 0.75).to(tl.int32) + (y > 1.25).to(tl.int32)
         + (y >= 1.75).to(tl.int32) + (y > 2.5).to(tl.int32) + (y >= 3.5).to(tl.int32)
         + (y > 5.0).to(tl.int32))
    m = tl.where(d > 0.0, m, 0)
    sign = (x.to(tl.int32, bitcast=True) >> 28) & 8
    return m | sign


@triton.jit
def _e2m1_value(c):
    """The float32 value of e2m1 codes `c` (int32 0..15): 0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives."""
    m = c & 7
    normal = ((((m >> 1) + 126) << 23) | ((m & 1) << 22))
    bits = tl.where(m >= 2, normal, tl.where(m == 1, 0x3F000000, 0))
    return (bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _quiet_nan(dtype: tl.constexpr):
    """`dtype`'s quiet NaN as `float("nan")` converts (bf16 0x7FC0, fp16 0x7E00, f32 0x7FC00000)."""
    if dtype == tl.bfloat16:
        return tl.full([1], 0x7FC0, tl.int16).to(tl.bfloat16, bitcast=True)
    elif dtype == tl.float16:
        return tl.full([1], 0x7E00, tl.int16).to(tl.float16, bitcast=True)
    else:
        return tl.full([1], 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _tile(num_vectors, head_dim, BLOCK_V: tl.constexpr, NB: tl.constexpr):
    """This program's `[BLOCK_V, NB, 8]` tile of element pairs: `(v, blk2, blk, j, mv, nb, m)` with
    `v` `[BLOCK_V]` vector indices, `blk2` `[1, NB]` / `blk` `[1, NB, 1]` scale-block indices, `j`
    `[1, 1, 8]` pair indices, `mv` the live vectors, `nb = head_dim // 16` and `m` the live pairs."""
    v = tl.program_id(0).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    blk2 = tl.arange(0, NB)[None, :]
    blk = blk2[:, :, None]
    j = tl.arange(0, 8)[None, None, :]
    mv = v < num_vectors
    nb = head_dim // 16
    m = mv[:, None, None] & (blk < nb)
    return v, blk2, blk, j, mv, nb, m


@triton.jit(do_not_specialize=["num_vectors", "first_key"])
def nvfp4_pack_kernel(
    src0_ptr,  # rows (bf16/f16/f32); the vectors as `_fp8_vector_offsets` places them
    src1_ptr,  # SPLIT: the second tensor (V of the pool's K and V caches); else src0 again
    table_ptr,  # PAGED: [blocks] i64 block (page) ids; else unused
    payload_ptr,  # [num_vectors, head_dim // 2] u8 contiguous
    scales_ptr,  # [num_vectors, head_dim // 16] u8 (e4m3fn bits) contiguous
    gscales_ptr,  # [num_vectors] u8 (e8m0 bits)
    num_vectors, head_dim, heads, groups, first_key, rows_per_block,
    s_row, s_slot, s_group, s_head, s_d,
    PAGED: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_V: tl.constexpr,
    NB: tl.constexpr,  # scale blocks per program row (next power of two of head_dim // 16)
):
    v, blk2, blk, j, mv, nb, m = _tile(num_vectors, head_dim, BLOCK_V, NB)
    off, g_ = _fp8_vector_offsets(v, mv, table_ptr, heads, groups, first_key, rows_per_block,
                                  s_row, s_slot, s_group, s_head, PAGED, SPLIT)
    e = blk * 16 + 2 * j  # the pair's first (even) element
    at0 = off[:, None, None] + e * s_d
    first = (g_ == 0)[:, None, None]  # SPLIT: the lane's tensor
    x0 = _load_vectors(src0_ptr, src1_ptr, at0, m, first, SPLIT)
    x1 = _load_vectors(src0_ptr, src1_ptr, at0 + s_d, m, first, SPLIT)
    # a vector holding a NaN or inf: x * 0 is NaN there, 0 elsewhere
    bad = tl.sum(tl.sum(x0 * 0.0 + x1 * 0.0, axis=2), axis=1) != 0.0  # NaN != 0 is true
    amax_b = tl.max(tl.maximum(tl.abs(x0), tl.abs(x1)), axis=2)  # [V, NB]
    amax_v = tl.max(amax_b, axis=1)  # [V]
    y = tl.math.div_rn(amax_v, E2M1_E4M3_MAX)
    y = tl.where(y >= G_FLOOR, y, G_FLOOR)  # a NaN quotient too (its vector is `bad`)
    gbits = ((y.to(tl.int32, bitcast=True) + 0x7FFFFF) >> 23) & 255  # round up to a power of two
    gbits = tl.where(bad, 255, gbits)
    g = (gbits << 23).to(tl.float32, bitcast=True)
    b = tl.math.div_rn(amax_b, (g * 6.0)[:, None])  # <= 448 (1 + 2**-22): rounds to <= 448
    sc = tl.where(bad[:, None], 127, _e4m3_code(tl.where(bad[:, None], 0.0, b)))
    d = (_e4m3_value(sc) * g[:, None])[:, :, None]  # exact: 4 significant bits times 2**k
    c0 = _e2m1_code(x0, d)
    c1 = _e2m1_code(x1, d)
    byte = tl.where(bad[:, None, None], 0, c0 | (c1 << 4))
    tl.store(payload_ptr + v[:, None, None] * (head_dim // 2) + blk * 8 + j, byte.to(tl.uint8), mask=m)
    tl.store(scales_ptr + v[:, None] * nb + blk2, sc.to(tl.uint8), mask=mv[:, None] & (blk2 < nb))
    tl.store(gscales_ptr + v, gbits.to(tl.uint8), mask=mv)


@triton.jit(do_not_specialize=["num_vectors", "first_key"])
def nvfp4_unpack_kernel(
    payload_ptr,  # [num_vectors, head_dim // 2] u8 contiguous
    scales_ptr,  # [num_vectors, head_dim // 16] u8 contiguous
    gscales_ptr,  # [num_vectors] u8
    dst0_ptr,  # rows (bf16/f16/f32); the vectors as `_fp8_vector_offsets` places them
    dst1_ptr,  # SPLIT: the second tensor; else dst0 again
    table_ptr,  # PAGED: [blocks] i64 block (page) ids; else unused
    num_vectors, head_dim, heads, groups, first_key, rows_per_block,
    s_row, s_slot, s_group, s_head, s_d,
    PAGED: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_V: tl.constexpr,
    NB: tl.constexpr,
):
    v, blk2, blk, j, mv, nb, m = _tile(num_vectors, head_dim, BLOCK_V, NB)
    byte = tl.load(payload_ptr + v[:, None, None] * (head_dim // 2) + blk * 8 + j, mask=m, other=0).to(tl.int32)
    sc = tl.load(scales_ptr + v[:, None] * nb + blk2, mask=mv[:, None] & (blk2 < nb), other=0).to(tl.int32)
    gb = tl.load(gscales_ptr + v, mask=mv, other=127).to(tl.int32)
    g = tl.where(gb == 255, float("nan"), (gb << 23).to(tl.float32, bitcast=True))
    d = (_e4m3_value(sc) * g[:, None])[:, :, None]
    x0 = _e2m1_value(byte & 15) * d
    x1 = _e2m1_value(byte >> 4) * d
    if dst0_ptr.dtype.element_ty == tl.bfloat16:  # the interpreter's bf16 cast truncates
        x0 = _round_to_bf16(x0)
        x1 = _round_to_bf16(x1)
    # a NaN block writes the dtype's quiet NaN bits, as the torch path (casts of NaN differ by device)
    nan = _quiet_nan(dst0_ptr.dtype.element_ty)
    x0 = tl.where(d != d, nan, x0.to(dst0_ptr.dtype.element_ty))
    x1 = tl.where(d != d, nan, x1.to(dst0_ptr.dtype.element_ty))
    off, g_ = _fp8_vector_offsets(v, mv, table_ptr, heads, groups, first_key, rows_per_block,
                                  s_row, s_slot, s_group, s_head, PAGED, SPLIT)
    at0 = off[:, None, None] + (blk * 16 + 2 * j) * s_d
    first = (g_ == 0)[:, None, None]  # SPLIT: the lane's tensor
    _store_vectors(dst0_ptr, dst1_ptr, at0, x0, m, first, SPLIT)
    _store_vectors(dst0_ptr, dst1_ptr, at0 + s_d, x1, m, first, SPLIT)


def _blocks(num_vectors: int, head_dim: int) -> tuple[int, int, tuple[int]]:
    nb = triton.next_power_of_2(max(head_dim // 16, 1))
    block_v = max(1, NVFP4_TILE // (nb * 16))
    return block_v, nb, (triton.cdiv(num_vectors, block_v),)


def nvfp4_pack_triton(
    src0: torch.Tensor,  # the vectors as `layout` places them
    src1: torch.Tensor | None,  # layout.split: the second tensor (same dtype), else None
    layout: VectorLayout,
    payload: torch.Tensor,  # [V, D // 2] uint8 contiguous, V = layout.num_vectors
    scales: torch.Tensor,  # [V, D // 16] uint8 contiguous
    gscales: torch.Tensor,  # [V] uint8 contiguous
) -> None:
    """Triton twin of `nvfp4.pack_rows` over `layout`'s vectors: the torch path's bits. One launch;
    the caller guarantees every vector is inside its tensor and `head_dim` a positive multiple of 16."""
    n, d = layout.num_vectors, layout.head_dim
    if n:
        block_v, nb, grid = _blocks(n, d)
        table = layout.table if layout.table is not None else gscales
        nvfp4_pack_kernel[grid](src0, src0 if src1 is None else src1, table, payload, scales, gscales,
                                *_layout_args(layout), PAGED=layout.table is not None, SPLIT=layout.split,
                                BLOCK_V=block_v, NB=nb)


def nvfp4_unpack_triton(
    payload: torch.Tensor,  # [V, D // 2] uint8 contiguous
    scales: torch.Tensor,  # [V, D // 16] uint8 contiguous
    gscales: torch.Tensor,  # [V] uint8 contiguous
    dst0: torch.Tensor,  # the vectors as `layout` places them
    dst1: torch.Tensor | None,  # layout.split: the second tensor (same dtype), else None
    layout: VectorLayout,
) -> None:
    """Triton twin of `nvfp4.unpack_rows`: each value written where `layout` places it. One launch."""
    n, d = layout.num_vectors, layout.head_dim
    if n:
        block_v, nb, grid = _blocks(n, d)
        table = layout.table if layout.table is not None else gscales
        nvfp4_unpack_kernel[grid](payload, scales, gscales, dst0, dst0 if dst1 is None else dst1, table,
                                  *_layout_args(layout), PAGED=layout.table is not None, SPLIT=layout.split,
                                  BLOCK_V=block_v, NB=nb)
