"""Triton kernels for the data plane: hidden-row copy and drafter-row append.

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

Launch-grid rules (also written to the AOT manifest):
- `hidden_row_copy_kernel`: grid `(n, cdiv(hidden_size, BLOCK))`.
- `drafter_row_append_kernel`: grid `(n,)`; one program writes one row (all heads).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_drafter_row_append, check_hidden_row_copy
from .rope import rope_inv_freq

__all__ = [
    "drafter_row_append_kernel",
    "drafter_row_append_triton",
    "hidden_row_copy_kernel",
    "hidden_row_copy_triton",
]

#: Columns per program of the copy kernel (upper bound; small rows use next_pow2).
COPY_BLOCK = 1024


@triton.jit(do_not_specialize=["src_row", "dst_row"])
def hidden_row_copy_kernel(
    src_ptr,  # [S, H] row-major, row stride src_stride
    dst_ptr,  # [D, H] row-major, row stride dst_stride
    src_row,  # i32 first source row
    dst_row,  # i32 first destination row
    src_stride,  # i32 elements between source rows
    dst_stride,  # i32 elements between destination rows
    hidden_size,  # i32 columns per row
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden_size
    s = (src_row + r) * src_stride
    d = (dst_row + r) * dst_stride
    x = tl.load(src_ptr + s + cols, mask=mask)
    tl.store(dst_ptr + d + cols, x, mask=mask)


@triton.jit(do_not_specialize=["start_row"])
def drafter_row_append_kernel(
    k_ptr,  # [n, Hkv, D] strides (k_s0, k_s1, k_s2)
    v_ptr,  # [n, Hkv, D] strides (v_s0, v_s1, v_s2)
    keys_ptr,  # [n] i64 pair keys; RoPE position is key + 1
    k_cache_ptr,  # [num_blocks, page_size, Hkv, D] contiguous
    v_cache_ptr,  # [num_blocks, page_size, Hkv, D] contiguous
    block_table_ptr,  # [max_blocks] i32
    inv_freq_ptr,  # [rotary_dim // 2] f32 (rope.rope_inv_freq)
    start_row,  # i32 compacted row of k_new[0]
    num_kv_heads,  # i32
    head_dim,  # i32
    page_size,  # i32 rows per block
    rotary_dim,  # i32 even, <= head_dim
    k_s0, k_s1, k_s2,  # i32 element strides of k
    v_s0, v_s1, v_s2,  # i32 element strides of v
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    m = (h < num_kv_heads) & (d < head_dim)

    row = start_row + i
    blk = tl.load(block_table_ptr + row // page_size).to(tl.int64)
    slot = blk * page_size + row % page_size
    dst = slot * (num_kv_heads * head_dim) + h * head_dim + d

    v = tl.load(v_ptr + i * v_s0 + h * v_s1 + d * v_s2, mask=m)
    tl.store(v_cache_ptr + dst, v, mask=m)

    k_row = k_ptr + i * k_s0 + h * k_s1
    x = tl.load(k_row + d * k_s2, mask=m, other=0.0)
    half = rotary_dim // 2
    is_rot = d < rotary_dim
    first = d < half
    partner = tl.where(first, d + half, d - half)
    xp = tl.load(k_row + partner * k_s2, mask=m & is_rot, other=0.0).to(tl.float32)
    inv = tl.load(inv_freq_ptr + tl.where(first, d, d - half), mask=is_rot, other=0.0)
    pos = (tl.load(keys_ptr + i) + 1).to(tl.float32)
    angle = pos * inv
    rotated = x.to(tl.float32) * tl.cos(angle) + tl.where(first, -xp, xp) * tl.sin(angle)
    out = tl.where(is_rot, rotated.to(k_cache_ptr.dtype.element_ty), x)
    tl.store(k_cache_ptr + dst, out, mask=m)


def copy_block_for(hidden_size: int) -> int:
    """BLOCK constexpr the launcher uses for rows of `hidden_size` columns."""
    return min(COPY_BLOCK, triton.next_power_of_2(max(hidden_size, 1)))


def hidden_row_copy_triton(
    src: torch.Tensor,  # [S, H] unit column stride
    src_row: int,
    dst: torch.Tensor,  # [D, H] same dtype/device, unit column stride
    dst_row: int,
    n: int,
) -> None:
    """Triton twin of `hidden_row_copy_reference`: same checks, same bits written."""
    check_hidden_row_copy(src, src_row, dst, dst_row, n)
    hidden_size = src.shape[1]
    if n == 0 or hidden_size == 0:
        return
    block = copy_block_for(hidden_size)
    grid = (n, triton.cdiv(hidden_size, block))
    hidden_row_copy_kernel[grid](
        src, dst, src_row, dst_row, src.stride(0), dst.stride(0), hidden_size, BLOCK=block
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

    `check_data=False` skips the content checks, which cost a device sync on CUDA.
    """
    check_drafter_row_append(
        k_new, v_new, keys, k_cache, v_cache, block_table, start_row, rotary_dim, rope_theta,
        check_data,
    )
    n = k_new.shape[0]
    if n == 0:
        return
    _, page_size, hkv, head_dim = k_cache.shape
    inv_freq = rope_inv_freq(rotary_dim, rope_theta, k_cache.device)
    if rotary_dim == 0:
        inv_freq = torch.zeros(1, dtype=torch.float32, device=k_cache.device)
    drafter_row_append_kernel[(n,)](
        k_new, v_new, keys.to(torch.int64), k_cache, v_cache, block_table, inv_freq,
        start_row, hkv, head_dim, page_size, rotary_dim,
        *k_new.stride(), *v_new.stride(),
        BLOCK_H=triton.next_power_of_2(hkv), BLOCK_D=triton.next_power_of_2(head_dim),
    )
