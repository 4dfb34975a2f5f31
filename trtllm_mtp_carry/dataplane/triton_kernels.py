"""Triton kernels for the data plane: hidden-row copy, drafter-row append, FP8 row pack/unpack.

What it is for: the CUDA implementation behind the custom ops, and the source
the ahead-of-time builder (`builders/build_kernels.py`) compiles to PTX/cubin
for the TensorRT plugins. Each kernel computes the same function as its
plain-torch twin in `reference.py`.

Invariants:
- Address arithmetic is int64 inside the kernels; scalar arguments may be i32.
- Launchers validate with `checks.py` before launching; a refused call writes nothing.
- With `TRITON_INTERPRET=1` set before this module is imported, the kernels run
  on CPU tensors (Triton reads the knob when `@triton.jit` decorates).
  The interpreter rounds float32 -> bf16 toward zero; GPUs round to nearest.

Launch-grid rules (also written to `builders/build_kernels.py`'s manifest):
- `hidden_row_copy_kernel`: grid `(cdiv(n, ROWS), cdiv(hidden_size, BLOCK))`; a program
  copies a ROWS x BLOCK tile (`copy_rows_for`, `copy_block_for`).
- `drafter_row_append_kernel`: grid `(cdiv(n, ROWS),)`; a program writes ROWS rows, all
  heads and columns (`append_blocks_for`); the RoPE angle is computed once per
  (row, frequency), not per element, and a row whose block id is outside
  `[0, num_blocks)` is skipped (no stray write even with `check_data=False`).
(The TensorRT plugins' kernels are `kernels/abi_kernels.py`, with their own rules in `kernels/abi.py`.)

The FP8 row-format kernels (`row_format.py` defines the format; JIT only, not in
the AOT manifest) compute each `head_dim` vector's address in the kernel from a
few strides (`row_layout.VectorLayout`: plain rows, TensorRT-LLM's HND pages
through a page table, the pool's separate K and V caches through a block table),
so a call is one launch with no per-vector offsets built on the host:
- `fp8_pack_kernel` / `fp8_unpack_kernel`: grid `(cdiv(num_vectors, BLOCK_V),)`.
- They round to e4m3 (and bf16) in float32 arithmetic, round to nearest even,
  before the cast, so the cast only meets representable values: the bits equal
  torch's casts on a GPU and under the interpreter (whose float8 cast carries
  wrongly across exponents and whose bf16 cast truncates).
"""

from __future__ import annotations

from typing import Protocol

import torch
import triton
import triton.language as tl

from .checks import check_drafter_row_append, check_hidden_row_copy
from .rope import rope_kernel_table

__all__ = [
    "drafter_row_append_kernel",
    "fp8_pack_kernel",
    "fp8_pack_triton",
    "fp8_unpack_kernel",
    "fp8_unpack_triton",
    "drafter_row_append_triton",
    "hidden_row_copy_kernel",
    "hidden_row_copy_triton",
]

#: Columns per program of the copy kernel (upper bound; small rows use next_pow2).
COPY_BLOCK = 1024
#: Elements one program of the copy / append kernel moves per tensor (rows x columns tile):
#: several rows per program, so big copies run as few, fat programs (bandwidth), small ones
#: as one program per row group (latency).
TILE_ELEMS = 4096


@triton.jit(do_not_specialize=["src_row", "dst_row", "n"])
def hidden_row_copy_kernel(
    src_ptr,  # [S, H] row-major, row stride src_stride
    dst_ptr,  # [D, H] row-major, row stride dst_stride
    src_row,  # i32 first source row
    dst_row,  # i32 first destination row
    n,  # i32 rows to copy
    src_stride,  # i32 elements between source rows
    dst_stride,  # i32 elements between destination rows
    hidden_size,  # i32 columns per row
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = (r < n) & (cols < hidden_size)
    x = tl.load(src_ptr + (src_row + r) * src_stride + cols, mask=mask)
    tl.store(dst_ptr + (dst_row + r) * dst_stride + cols, x, mask=mask)


@triton.jit(do_not_specialize=["start_row", "n"])
def drafter_row_append_kernel(
    k_ptr,  # [n, Hkv, D] strides (k_s0, k_s1, k_s2)
    v_ptr,  # [n, Hkv, D] strides (v_s0, v_s1, v_s2)
    keys_ptr,  # [n] i32/i64 pair keys; RoPE position is key + 1
    k_cache_ptr,  # [num_blocks, page_size, Hkv, D] contiguous
    v_cache_ptr,  # [num_blocks, page_size, Hkv, D] contiguous
    block_table_ptr,  # [max_blocks] i32
    inv_freq_ptr,  # [rotary_dim // 2] f32 (rope.rope_inv_freq; one element when rotary_dim is 0)
    n,  # i32 rows
    start_row,  # i32 compacted row of k_new[0]
    num_blocks,  # i32 cache blocks: a row whose block id is outside [0, num_blocks) is skipped
    num_kv_heads,  # i32
    head_dim,  # i32
    page_size,  # i32 rows per block
    rotary_dim,  # i32 even, <= head_dim
    k_s0, k_s1, k_s2,  # i32 element strides of k
    v_s0, v_s1, v_s2,  # i32 element strides of v
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # A [ROWS, BLOCK_H, BLOCK_D] tile: ROWS rows, every head and column of each.
    i1 = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [R]
    in_n = i1 < n
    row = start_row + i1
    blk = tl.load(block_table_ptr + row // page_size, mask=in_n, other=-1).to(tl.int64)
    ok1 = in_n & (blk >= 0) & (blk < num_blocks)
    slot = blk * page_size + row % page_size
    i = i1[:, None, None]
    ok = ok1[:, None, None]
    base = slot[:, None, None] * (num_kv_heads * head_dim)
    h = tl.arange(0, BLOCK_H)[None, :, None]
    d = tl.arange(0, BLOCK_D)[None, None, :]
    m = ok & (h < num_kv_heads) & (d < head_dim)
    dst = base + h * head_dim + d

    v = tl.load(v_ptr + i * v_s0 + h * v_s1 + d * v_s2, mask=m)
    tl.store(v_cache_ptr + dst, v, mask=m)

    # K's pass-through columns [rotary_dim, head_dim): copied as they are.
    k_row = k_ptr + i * k_s0 + h * k_s1
    mp = m & (d >= rotary_dim)
    x = tl.load(k_row + d * k_s2, mask=mp)
    tl.store(k_cache_ptr + dst, x, mask=mp)

    # K's rotary columns: the angle once per (row, frequency), shared by the heads and both
    # halves (rotate-half: out1 = x1 cos - x2 sin, out2 = x2 cos + x1 sin, float32).
    half = rotary_dim // 2
    j1 = tl.arange(0, BLOCK_HALF)
    j = j1[None, None, :]
    mr = ok & (h < num_kv_heads) & (j < half)
    x1 = tl.load(k_row + j * k_s2, mask=mr, other=0.0).to(tl.float32)
    x2 = tl.load(k_row + (j + half) * k_s2, mask=mr, other=0.0).to(tl.float32)
    inv = tl.load(inv_freq_ptr + j1, mask=j1 < half, other=0.0)
    pos = (tl.load(keys_ptr + i1, mask=in_n, other=0).to(tl.int64) + 1).to(tl.float32)
    angle = pos[:, None, None] * inv[None, None, :]  # [R, 1, BLOCK_HALF]
    c = tl.cos(angle)
    s = tl.sin(angle)
    o1 = x1 * c + (-x2) * s
    o2 = x2 * c + x1 * s
    k_dst = k_cache_ptr + base + h * head_dim
    tl.store(k_dst + j, o1.to(k_cache_ptr.dtype.element_ty), mask=mr)
    tl.store(k_dst + j + half, o2.to(k_cache_ptr.dtype.element_ty), mask=mr)


def copy_block_for(hidden_size: int) -> int:
    """BLOCK constexpr the launcher uses for rows of `hidden_size` columns."""
    return min(COPY_BLOCK, triton.next_power_of_2(max(hidden_size, 1)))


def copy_rows_for(n: int, block: int) -> int:
    """ROWS constexpr of the copy kernel: rows per program (a power of two, <= next_pow2(n))."""
    return max(1, min(TILE_ELEMS // block, triton.next_power_of_2(max(n, 1))))


def append_blocks_for(n: int, num_kv_heads: int, head_dim: int, rotary_dim: int) -> dict[str, int]:
    """The append kernel's constexprs (ROWS, BLOCK_H, BLOCK_D, BLOCK_HALF) for these shapes."""
    bh = triton.next_power_of_2(num_kv_heads)
    bd = triton.next_power_of_2(head_dim)
    rows = max(1, min(TILE_ELEMS // (bh * bd), triton.next_power_of_2(max(n, 1))))
    return {"ROWS": rows, "BLOCK_H": bh, "BLOCK_D": bd,
            "BLOCK_HALF": triton.next_power_of_2(max(rotary_dim // 2, 1))}


def hidden_row_copy_triton(
    src: torch.Tensor,  # [S, H] unit column stride
    src_row: int,
    dst: torch.Tensor,  # [D, H] same dtype/device, unit column stride
    dst_row: int,
    n: int,
) -> None:
    """Triton twin of `hidden_row_copy_reference`: same checks, same bits written.

    Grid `(cdiv(n, ROWS), cdiv(hidden_size, BLOCK))`; program (p, c) copies rows
    `[p*ROWS, (p+1)*ROWS) & < n`, columns `[c*BLOCK, (c+1)*BLOCK) & < hidden_size`.
    """
    check_hidden_row_copy(src, src_row, dst, dst_row, n)
    hidden_size = src.shape[1]
    if n == 0 or hidden_size == 0:
        return
    block = copy_block_for(hidden_size)
    rows = copy_rows_for(n, block)
    grid = (triton.cdiv(n, rows), triton.cdiv(hidden_size, block))
    hidden_row_copy_kernel[grid](
        src, dst, src_row, dst_row, n, src.stride(0), dst.stride(0), hidden_size,
        ROWS=rows, BLOCK=block,
    )


def drafter_row_append_triton(
    k_new: torch.Tensor,  # [n, Hkv, D] cache dtype, any strides
    v_new: torch.Tensor,  # [n, Hkv, D] cache dtype, any strides
    keys: torch.Tensor,  # [n] int32/int64, strictly increasing
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] contiguous
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] contiguous
    block_table: torch.Tensor,  # [max_blocks] int32
    start_row: int,
    rotary_dim: int,
    rope_theta: float,
    check_data: bool = True,
) -> None:
    """Triton twin of `drafter_row_append_reference`, one launch for all rows and heads.

    `check_data=False` skips the content checks, which cost one device sync on CUDA;
    the call then neither syncs nor allocates (keys are read as they are, int32 or
    int64; the frequency table is cached), and a row whose block id is outside
    `[0, num_blocks)` is skipped by the kernel rather than written out of bounds.
    Grid `(cdiv(n, ROWS),)`; program p writes rows `[p*ROWS, (p+1)*ROWS) & < n`.
    """
    check_drafter_row_append(
        k_new, v_new, keys, k_cache, v_cache, block_table, start_row, rotary_dim, rope_theta,
        check_data,
    )
    n = k_new.shape[0]
    if n == 0:
        return
    num_blocks, page_size, hkv, head_dim = k_cache.shape
    inv_freq = rope_kernel_table(rotary_dim, rope_theta, k_cache.device)
    blocks = append_blocks_for(n, hkv, head_dim, rotary_dim)
    drafter_row_append_kernel[(triton.cdiv(n, blocks["ROWS"]),)](
        k_new, v_new, keys, k_cache, v_cache, block_table, inv_freq,
        n, start_row, num_blocks, hkv, head_dim, page_size, rotary_dim,
        *k_new.stride(), *v_new.stride(), **blocks,
    )


# ---- FP8 row format (row_format.py): pack and unpack `head_dim` vectors, addressed in-kernel ----

#: e4m3fn's largest finite value and the least scale (float32's smallest normal); row_format's.
#: (`tl.constexpr` so the compiled kernels may read them; the interpreter would take plain floats.)
FP8_MAX = tl.constexpr(448.0)
FP8_SCALE_FLOOR = tl.constexpr(2.0**-126)
#: Values per program of the FP8 kernels (BLOCK_V vectors of BLOCK_D values): 8 KiB of bf16
#: read (pack) or written (unpack) per program, so per-program overhead stays small next to it.
FP8_BLOCK = 4096


@triton.jit
def _round_to_e4m3(q):
    """`q` (float32, |q| < 464 or NaN) rounded to e4m3's grid, to nearest even, still float32.

    e4m3 spacing at |q| is 2**(max(e, -6) - 3) (3 mantissa bits; subnormals below
    2**-6). Adding M = 1.5 * 2**(k + 23) makes float32's own rounding happen at
    2**k (M's ulp), ties to even (M / 2**k is even); subtracting M is exact.
    """
    a = tl.abs(q)
    e = (a.to(tl.int32, bitcast=True) >> 23) - 127
    k = tl.maximum(e, -6) - 3
    big = (((k + 150) << 23) | (1 << 22)).to(tl.float32, bitcast=True)
    r = (a + big) - big
    sign = (q.to(tl.int32, bitcast=True) >> 31) << 31
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _round_to_bf16(x):
    """`x` (float32) rounded to bfloat16's grid, to nearest even, still float32 (exact to cast).

    A NaN stays `x` itself: adding 0x7FFF + 1 to a NaN's bits overflows int32 (a GPU's canonical
    NaN 0x7FFFFFFF became 0x80007FFF, i.e. -0.0) or carries out of the exponent (0xFFFFFFFF
    became +0.0); the cast after keeps any NaN a NaN. Infinities and the rest round exactly.
    """
    b = x.to(tl.int32, bitcast=True)
    b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
    return tl.where(x != x, x, b.to(tl.float32, bitcast=True))


@triton.jit
def _fp8_vector_offsets(v, mv, table_ptr, heads, groups, first_key, rows_per_block,
                        s_row, s_slot, s_group, s_head, PAGED: tl.constexpr, SPLIT: tl.constexpr):
    """`(offset, g)` of vectors `v` (int64, row-major over `[rows, groups, heads]`): the element
    offset of each one's first value and its group (with SPLIT, the tensor it is in: 0 or 1).

    Row `r` starts at `r * s_row`, or PAGED at `table[key // rows_per_block] * s_row +
    (key % rows_per_block) * s_slot` for key `first_key + r`; then `+ g * s_group + h * s_head`
    (SPLIT: `+ h * s_head` in tensor `g`).
    """
    h = v % heads
    t = v // heads
    g = t % groups
    r = t // groups
    if PAGED:
        key = r + first_key
        blk = tl.load(table_ptr + key // rows_per_block, mask=mv, other=0).to(tl.int64)
        off = blk * s_row + (key % rows_per_block) * s_slot
    else:
        off = r * s_row
    if SPLIT:
        off = off + h * s_head
    else:
        off = off + g * s_group + h * s_head
    return off, g


@triton.jit
def _load_vectors(src0_ptr, src1_ptr, at, m, first, SPLIT: tl.constexpr):
    """The values at element offsets `at` (mask `m`) as float32: SPLIT, a lane where `first` holds
    reads `src0`, any other `src1` (the other load is masked off); else all read `src0`."""
    if SPLIT:
        x = tl.where(first, tl.load(src0_ptr + at, mask=m & first, other=0.0),
                     tl.load(src1_ptr + at, mask=m & (first == 0), other=0.0))
    else:
        x = tl.load(src0_ptr + at, mask=m, other=0.0)
    return x.to(tl.float32)


@triton.jit
def _store_vectors(dst0_ptr, dst1_ptr, at, x, m, first, SPLIT: tl.constexpr):
    """Store `x` at element offsets `at` (mask `m`): SPLIT, a lane where `first` holds into `dst0`,
    any other into `dst1`; else all into `dst0`. Nothing else is written."""
    if SPLIT:
        tl.store(dst0_ptr + at, x, mask=m & first)
        tl.store(dst1_ptr + at, x, mask=m & (first == 0))
    else:
        tl.store(dst0_ptr + at, x, mask=m)


@triton.jit(do_not_specialize=["num_vectors", "first_key"])
def fp8_pack_kernel(
    src0_ptr,  # rows (bf16/f16/f32); the vectors as `_fp8_vector_offsets` places them
    src1_ptr,  # SPLIT: the second tensor (V of the pool's K and V caches); else src0 again
    table_ptr,  # PAGED: [blocks] i64 block (page) ids; else unused
    payload_ptr,  # [num_vectors, head_dim] float8_e4m3fn contiguous
    scales_ptr,  # [num_vectors] f32
    num_vectors,  # i32/i64 rows * groups * heads
    head_dim,  # i32
    heads,  # i32 vectors per group
    groups,  # i32 groups per row (SPLIT: 2)
    first_key,  # i32 PAGED: the key of row 0
    rows_per_block,  # i32 PAGED: keys per block
    s_row, s_slot, s_group, s_head, s_d,  # element strides (see `_fp8_vector_offsets`)
    PAGED: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    v = tl.program_id(0).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    d = tl.arange(0, BLOCK_D)[None, :]
    mv = v < num_vectors
    m = mv[:, None] & (d < head_dim)
    off, g = _fp8_vector_offsets(v, mv, table_ptr, heads, groups, first_key, rows_per_block,
                                 s_row, s_slot, s_group, s_head, PAGED, SPLIT)
    x = _load_vectors(src0_ptr, src1_ptr, off[:, None] + d * s_d, m, (g == 0)[:, None], SPLIT)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.maximum(tl.math.div_rn(amax, FP8_MAX), FP8_SCALE_FLOOR)
    # NaN for a vector holding a NaN or inf (x * 0 is NaN there, 0 elsewhere), as torch's path gives
    scale = scale + tl.sum(x * 0.0, axis=1)
    q = _round_to_e4m3(tl.math.div_rn(x, scale[:, None]))  # |q| <= 448 (1 + 2**-23): no clamp
    tl.store(payload_ptr + v[:, None] * head_dim + d, q.to(payload_ptr.dtype.element_ty), mask=m)
    tl.store(scales_ptr + v, scale, mask=mv)


@triton.jit(do_not_specialize=["num_vectors", "first_key"])
def fp8_unpack_kernel(
    payload_ptr,  # [num_vectors, head_dim] float8_e4m3fn contiguous
    scales_ptr,  # [num_vectors] f32
    dst0_ptr,  # rows (bf16/f16/f32); the vectors as `_fp8_vector_offsets` places them
    dst1_ptr,  # SPLIT: the second tensor; else dst0 again
    table_ptr,  # PAGED: [blocks] i64 block (page) ids; else unused
    num_vectors,  # i32/i64
    head_dim,  # i32
    heads,  # i32
    groups,  # i32
    first_key,  # i32
    rows_per_block,  # i32
    s_row, s_slot, s_group, s_head, s_d,
    PAGED: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    v = tl.program_id(0).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    d = tl.arange(0, BLOCK_D)[None, :]
    mv = v < num_vectors
    m = mv[:, None] & (d < head_dim)
    q = tl.load(payload_ptr + v[:, None] * head_dim + d, mask=m, other=0.0).to(tl.float32)
    scale = tl.load(scales_ptr + v, mask=mv, other=1.0)
    x = q * scale[:, None]
    if dst0_ptr.dtype.element_ty == tl.bfloat16:
        x = _round_to_bf16(x)
    x = x.to(dst0_ptr.dtype.element_ty)
    off, g = _fp8_vector_offsets(v, mv, table_ptr, heads, groups, first_key, rows_per_block,
                                 s_row, s_slot, s_group, s_head, PAGED, SPLIT)
    _store_vectors(dst0_ptr, dst1_ptr, off[:, None] + d * s_d, x, m, (g == 0)[:, None], SPLIT)


def _fp8_blocks(num_vectors: int, head_dim: int) -> tuple[int, int, tuple[int]]:
    block_d = triton.next_power_of_2(max(head_dim, 1))
    block_v = max(1, FP8_BLOCK // block_d)
    return block_v, block_d, (triton.cdiv(num_vectors, block_v),)


class VectorLayout(Protocol):
    """What the row-format launchers (FP8 here, NVFP4 in `nvfp4_kernels`) read of
    `row_layout.VectorLayout` (defined there; see it)."""

    @property
    def num_vectors(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def heads(self) -> int: ...
    @property
    def groups(self) -> int: ...
    @property
    def first_key(self) -> int: ...
    @property
    def rows_per_block(self) -> int: ...
    @property
    def s_row(self) -> int: ...
    @property
    def s_slot(self) -> int: ...
    @property
    def s_group(self) -> int: ...
    @property
    def s_head(self) -> int: ...
    @property
    def s_d(self) -> int: ...
    @property
    def table(self) -> torch.Tensor | None: ...
    @property
    def split(self) -> bool: ...


def _layout_args(layout: VectorLayout) -> tuple[int, ...]:
    return (layout.num_vectors, layout.head_dim, layout.heads, layout.groups, layout.first_key,
            layout.rows_per_block, layout.s_row, layout.s_slot, layout.s_group, layout.s_head, layout.s_d)


def fp8_pack_triton(
    src0: torch.Tensor,  # the vectors as `layout` places them
    src1: torch.Tensor | None,  # layout.split: the second tensor (same dtype), else None
    layout: VectorLayout,
    payload: torch.Tensor,  # [V, D] float8_e4m3fn contiguous, V = layout.num_vectors
    scales: torch.Tensor,  # [V] float32 contiguous
) -> None:
    """Triton twin of `row_format.pack_rows` over `layout`'s vectors, into `payload` and `scales`.

    Finite vectors give torch's bits exactly; a vector holding a NaN or inf gets a
    NaN scale. One launch; the caller guarantees every vector is inside its tensor.
    """
    n, d = layout.num_vectors, layout.head_dim
    if n and d:
        block_v, block_d, grid = _fp8_blocks(n, d)
        table = layout.table if layout.table is not None else scales
        fp8_pack_kernel[grid](src0, src0 if src1 is None else src1, table, payload, scales,
                              *_layout_args(layout), PAGED=layout.table is not None, SPLIT=layout.split,
                              BLOCK_V=block_v, BLOCK_D=block_d)
    elif n:
        scales.fill_(FP8_SCALE_FLOOR.value)


def fp8_unpack_triton(
    payload: torch.Tensor,  # [V, D] float8_e4m3fn contiguous
    scales: torch.Tensor,  # [V] float32 contiguous
    dst0: torch.Tensor,  # the vectors as `layout` places them
    dst1: torch.Tensor | None,  # layout.split: the second tensor (same dtype), else None
    layout: VectorLayout,
) -> None:
    """Triton twin of `row_format.unpack_rows`: `payload * scale`, cast to dst's dtype, written where
    `layout` places each vector. One launch; writes nothing else."""
    n, d = layout.num_vectors, layout.head_dim
    if n and d:
        block_v, block_d, grid = _fp8_blocks(n, d)
        table = layout.table if layout.table is not None else scales
        fp8_unpack_kernel[grid](payload, scales, dst0, dst0 if dst1 is None else dst1, table,
                                *_layout_args(layout), PAGED=layout.table is not None, SPLIT=layout.split,
                                BLOCK_V=block_v, BLOCK_D=block_d)
