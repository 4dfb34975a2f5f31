"""Triton sources of the two plugin kernels, written in TensorRT's parameter order.

What it is for: the source `builders/build_abi_kernels.py` compiles ahead of
time to PTX for the TensorRT plugins and the AOT launcher. The parameters are
in the order `abi.COPY_ABI` / `abi.APPEND_ABI` declare (inputs, int32 extras,
outputs); the builder drops the two scratch-pointer parameters Triton (>= 3.3)
appends, so the `.entry` matches the ABI exactly (`kernels/ptx.py`).

Each kernel computes the same function as its plain-torch twin in
`dataplane/reference.py` and its JIT twin in `dataplane/triton_kernels.py`
(same RoPE formula, float32 math, one rounding to the cache dtype); row
offsets come from one-element device tensors, and out-of-range destinations
are skipped (see `abi.py`). The append computes each RoPE angle once per
(row, frequency) and shares it across heads and both rotate-half halves (the
trigonometry, not the bytes, used to bound it: an angle per element). Under `TRITON_INTERPRET=1` they run on CPU tensors,
which is how the CPU tests check their math.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["drafter_row_append_abi", "hidden_row_copy_abi"]


@triton.jit
def hidden_row_copy_abi(
    src,  # [n, H] row stride src_stride
    dst_row,  # [1] i32 first destination row
    dst_in,  # [C, H] aliased by dst (TensorRT passes it; unused)
    src_stride,  # i32 elements between source rows
    dst_stride,  # i32 elements between destination rows
    hidden_size,  # i32 columns per row
    dst_capacity,  # i32 rows of dst
    dst,  # [C, H] row stride dst_stride
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    # the destination row as a block: scalar & block masks trip Triton's interpreter
    d_row = tl.load(dst_row).to(tl.int64) + r + tl.zeros([BLOCK], dtype=tl.int64)
    mask = (cols < hidden_size) & (d_row >= r) & (d_row < dst_capacity)
    x = tl.load(src + r * src_stride + cols, mask=mask)
    tl.store(dst + d_row * dst_stride + cols, x, mask=mask)


@triton.jit
def drafter_row_append_abi(
    k_new,  # [n, Hkv, D] strides (k_s0, k_s1, 1)
    v_new,  # [n, Hkv, D] strides (v_s0, v_s1, 1)
    keys,  # [n] i32 pair keys; RoPE position is key + 1
    block_table,  # [max_blocks] i32
    inv_freq,  # [rotary_dim // 2] f32
    start_row,  # [1] i32 compacted row of k_new[0]
    k_cache_in,  # aliased by k_cache (unused)
    v_cache_in,  # aliased by v_cache (unused)
    num_kv_heads, head_dim, page_size, rotary_dim,  # i32
    k_s0, k_s1, v_s0, v_s1,  # i32 element strides
    max_blocks, num_blocks,  # i32 block-table length, cache blocks
    k_cache,  # [num_blocks, page_size, Hkv, D] contiguous
    v_cache,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]

    first = tl.load(start_row).to(tl.int64)
    row = first + i
    t = row // page_size
    in_table = (first >= 0) & (t < max_blocks)
    blk = tl.load(block_table + tl.where(in_table, t, 0)).to(tl.int64)  # max_blocks >= 1
    blk = tl.where(in_table, blk, -1)  # a row past the table has no block
    # the row's validity as a [BLOCK_H, BLOCK_D] block (scalar & block masks trip the interpreter)
    b = blk + tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.int64)
    ok = (b >= 0) & (b < num_blocks)
    m = (h < num_kv_heads) & (d < head_dim) & ok
    slot = blk * page_size + row % page_size
    dst = slot * (num_kv_heads * head_dim) + h * head_dim + d

    v = tl.load(v_new + i * v_s0 + h * v_s1 + d, mask=m)
    tl.store(v_cache + dst, v, mask=m)

    # K's pass-through columns [rotary_dim, head_dim): copied as they are.
    k_row = k_new + i * k_s0 + h * k_s1
    mp = m & (d >= rotary_dim)
    x = tl.load(k_row + d, mask=mp)
    tl.store(k_cache + dst, x, mask=mp)

    # K's rotary columns, as halves: the angle once per frequency (lanes j < rotary_dim / 2 of
    # a [1, BLOCK_D] vector, shared by the heads and both halves), not once per element;
    # out1 = x1 cos - x2 sin, out2 = x2 cos + x1 sin in float32 (rotate-half).
    half = rotary_dim // 2
    j = tl.arange(0, BLOCK_D)[None, :]
    mr = m & (j < half)
    x1 = tl.load(k_row + j, mask=mr, other=0.0).to(tl.float32)
    x2 = tl.load(k_row + j + half, mask=mr, other=0.0).to(tl.float32)
    inv = tl.load(inv_freq + j, mask=j < half, other=0.0)
    pos = (tl.load(keys + i).to(tl.int64) + 1).to(tl.float32)
    angle = pos * inv  # [1, BLOCK_D]
    c = tl.cos(angle)
    sn = tl.sin(angle)
    o1 = x1 * c + (-x2) * sn
    o2 = x2 * c + x1 * sn
    k_dst = k_cache + slot * (num_kv_heads * head_dim) + h * head_dim
    tl.store(k_dst + j, o1.to(k_cache.dtype.element_ty), mask=mr)
    tl.store(k_dst + j + half, o2.to(k_cache.dtype.element_ty), mask=mr)
