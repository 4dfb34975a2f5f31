"""Plain-torch reference implementations of the two data-plane kernels.

What it is for: the definition of what the Triton kernels compute, the CPU
implementation behind the custom ops, and the oracle in tests.

Invariants: each function validates its arguments first (`checks.py`) and
writes nothing when it refuses; only the named rows/slots are written.
"""

from __future__ import annotations

import torch

from .checks import check_drafter_row_append, check_hidden_row_copy
from .rope import apply_rope_reference

__all__ = ["drafter_row_append_reference", "hidden_row_copy_reference", "slots_for_rows"]


def hidden_row_copy_reference(
    src: torch.Tensor,  # [S, H] unit column stride
    src_row: int,
    dst: torch.Tensor,  # [D, H] same dtype/device as src, unit column stride
    dst_row: int,
    n: int,
) -> None:
    """Copy rows `src[src_row:src_row+n]` into `dst[dst_row:dst_row+n]`, bit for bit."""
    check_hidden_row_copy(src, src_row, dst, dst_row, n)
    if n:
        dst[dst_row : dst_row + n].copy_(src[src_row : src_row + n])


def slots_for_rows(
    block_table: torch.Tensor,  # [max_blocks] int32/int64
    rows: torch.Tensor,  # [n] int64 compacted row ids
    block_size: int,
) -> torch.Tensor:  # [n] int64 flat slot ids into a [num_blocks * block_size, ...] cache
    """Flat cache slot of each row: `block_table[r // block_size] * block_size + r % block_size`."""
    return block_table.long()[rows // block_size] * block_size + rows % block_size


def drafter_row_append_reference(
    k_new: torch.Tensor,  # [n, Hkv, D] cache dtype
    v_new: torch.Tensor,  # [n, Hkv, D] cache dtype
    keys: torch.Tensor,  # [n] int32/int64 pair keys, strictly increasing
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] bf16/fp16 contiguous
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_table: torch.Tensor,  # [max_blocks] int32
    start_row: int,
    rotary_dim: int,
    rope_theta: float,
    check_data: bool = True,
) -> None:
    """Write RoPE(k_new at keys + 1) and v_new into compacted rows `[start_row, start_row + n)`.

    `check_data=False` skips the content checks (key order, block ids) for callers that
    validated them on the host (the pool); shapes, dtypes and bounds are always checked.
    """
    check_drafter_row_append(
        k_new, v_new, keys, k_cache, v_cache, block_table, start_row, rotary_dim, rope_theta,
        check_data,
    )
    n = k_new.shape[0]
    if n == 0:
        return
    block_size, hkv, head_dim = k_cache.shape[1:]
    rows = torch.arange(start_row, start_row + n, device=k_cache.device, dtype=torch.int64)
    slots = slots_for_rows(block_table, rows, block_size)
    k_rot = apply_rope_reference(k_new, keys.long() + 1, rotary_dim, rope_theta)
    k_cache.view(-1, hkv, head_dim).index_copy_(0, slots, k_rot)
    v_cache.view(-1, hkv, head_dim).index_copy_(0, slots, v_new)
