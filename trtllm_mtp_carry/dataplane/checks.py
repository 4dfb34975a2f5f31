"""Argument checks shared by every implementation of the two data-plane kernels.

What it is for: the reference kernels and the Triton launchers refuse the same
bad inputs with the same message, before anything is written, so a refused
call never leaves a half-written cache or store.

Errors: ValueError naming the offending argument and value. Checks that read
tensor contents (key order, block ids) cost one device sync on CUDA (one host
copy of a few reduced values, however many checks); they are what makes
"nothing written" hold for data-dependent faults too. Metadata checks (shapes,
dtypes, devices, bounds) never touch device memory.
"""

from __future__ import annotations

import math

import torch

__all__ = ["CACHE_DTYPES", "check_drafter_row_append", "check_hidden_row_copy"]

#: Dtypes the drafter KV cache and the hidden store may hold.
CACHE_DTYPES = (torch.bfloat16, torch.float16)
_INT_DTYPES = (torch.int32, torch.int64)


def _check_index(name: str, value: int) -> None:
    if type(value) is not int and (not isinstance(value, int) or isinstance(value, bool)):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def check_hidden_row_copy(
    src: torch.Tensor,  # [S, H] any dtype, unit column stride
    src_row: int,
    dst: torch.Tensor,  # [D, H] same dtype and device as src, unit column stride
    dst_row: int,
    n: int,
    check_data: bool = True,
) -> None:
    """Raise ValueError unless copying `src[src_row:+n]` to `dst[dst_row:+n]` is well defined.

    `check_data=False` skips the overlap test (fake tensors have no addresses). Reads no
    device memory (no sync); every value it needs is tensor metadata.
    """
    s_shape, d_shape = src.shape, dst.shape
    if len(s_shape) != 2 or len(d_shape) != 2:
        name, t = ("src", src) if len(s_shape) != 2 else ("dst", dst)
        raise ValueError(f"{name} must be 2-D [rows, hidden_size], got shape {tuple(t.shape)}")
    s_stride, d_stride = src.stride(), dst.stride()
    for name, shape, stride in (("src", s_shape, s_stride), ("dst", d_shape, d_stride)):
        if shape[1] > 1 and stride[1] != 1:
            raise ValueError(f"{name} rows must be contiguous (stride(1) == 1), got strides {stride}")
    if src.dtype != dst.dtype:
        raise ValueError(f"src dtype {src.dtype} differs from dst dtype {dst.dtype}")
    if src.device != dst.device:
        raise ValueError(f"src device {src.device} differs from dst device {dst.device}")
    if s_shape[1] != d_shape[1]:
        raise ValueError(f"src hidden_size {s_shape[1]} differs from dst hidden_size {d_shape[1]}")
    _check_index("src_row", src_row)
    _check_index("dst_row", dst_row)
    _check_index("n", n)
    if src_row + n > s_shape[0]:
        raise ValueError(f"src rows [{src_row}, {src_row + n}) run past src capacity {s_shape[0]}")
    if dst_row + n > d_shape[0]:
        raise ValueError(f"dst rows [{dst_row}, {dst_row + n}) run past dst capacity {d_shape[0]}")
    if check_data and n:
        # address ranges, whatever the storages: two views of one buffer overlap the same way
        es = src.element_size()
        a0 = src.data_ptr() + src_row * s_stride[0] * es
        a1 = src.data_ptr() + ((src_row + n - 1) * s_stride[0] + s_shape[1]) * es
        b0 = dst.data_ptr() + dst_row * d_stride[0] * es
        b1 = dst.data_ptr() + ((dst_row + n - 1) * d_stride[0] + d_shape[1]) * es
        if a0 < b1 and b0 < a1:
            raise ValueError(
                f"src rows [{src_row}, {src_row + n}) overlap dst rows [{dst_row}, {dst_row + n})"
            )


def check_drafter_row_append(
    k_new: torch.Tensor,  # [n, Hkv, D] cache dtype, any strides
    v_new: torch.Tensor,  # [n, Hkv, D] cache dtype, any strides
    keys: torch.Tensor,  # [n] int32/int64, strictly increasing, >= 0
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] bf16/fp16, contiguous
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] same as k_cache
    block_table: torch.Tensor,  # [max_blocks] int32, ids in [0, num_blocks)
    start_row: int,
    rotary_dim: int,
    rope_theta: float,
    check_data: bool = True,
    key_limit: int | None = None,
    key_limit_why: str = "",
) -> None:
    """Raise ValueError unless appending rows `[start_row, start_row + n)` is well defined.

    `check_data=False` skips the checks that read tensor contents (key order, key sign,
    block ids, `key_limit`): fake tensors have none, and on CUDA they cost one device sync
    (all of them are read with one host copy). Callers on a hot path validate keys where
    they are made (on the host) and pass `check_data=False`: no sync at all.
    `key_limit` (with `key_limit_why` for the message) refuses a key >= it.
    """
    if not _append_metadata_ok(k_new, v_new, keys, k_cache, v_cache, block_table, start_row,
                               rotary_dim, rope_theta):
        _explain_append_metadata(k_new, v_new, keys, k_cache, v_cache, block_table, start_row,
                                 rotary_dim, rope_theta)
    n = k_new.shape[0]
    if n == 0 or not check_data:
        return
    block_size = k_cache.shape[1]
    num_blocks = k_cache.shape[0]
    end_row = start_row + n
    # The content checks read five device values with ONE host copy (one sync on CUDA).
    used = block_table[start_row // block_size : (end_row + block_size - 1) // block_size]
    k64 = keys.long()
    if n > 1:
        bad_order = (k64[1:] <= k64[:-1]).any().long()
    else:
        bad_order = torch.zeros((), dtype=torch.int64, device=keys.device)
    lo, hi, kmin, kmax, unordered = torch.stack([
        used.min().long(), used.max().long(), k64.min(), k64.max(), bad_order,
    ]).tolist()
    if lo < 0 or hi >= num_blocks:
        bad = lo if lo < 0 else hi
        raise ValueError(f"block_table holds block id {bad} outside [0, num_blocks={num_blocks})")
    if kmin < 0:
        raise ValueError(f"keys must be >= 0, got min key {kmin}")
    if unordered:
        raise ValueError(f"keys must be strictly increasing, got {keys.tolist()[:16]}")
    if key_limit is not None and kmax >= key_limit:
        raise ValueError(f"keys must be < {key_limit} for {key_limit_why}, got max key {kmax}")


def _append_metadata_ok(
    k_new: torch.Tensor, v_new: torch.Tensor, keys: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, block_table: torch.Tensor, start_row: int, rotary_dim: int,
    rope_theta: float,
) -> bool:
    """True when every metadata check of `_explain_append_metadata` passes (the warm path:
    one pass over the metadata, no messages built). False sends the call to that function,
    which raises the first failing check's error."""
    shape = k_cache.shape
    if len(shape) != 4 or v_cache.shape != shape:
        return False
    dt, dev = k_cache.dtype, k_cache.device
    if dt not in CACHE_DTYPES or v_cache.dtype != dt or v_cache.device != dev:
        return False
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return False
    _, block_size, hkv, head_dim = shape
    ks = k_new.shape
    if len(ks) != 3 or ks[1] != hkv or ks[2] != head_dim or v_new.shape != ks:
        return False
    n = ks[0]
    if k_new.dtype != dt or v_new.dtype != dt or k_new.device != dev or v_new.device != dev:
        return False
    if keys.dim() != 1 or keys.shape[0] != n or keys.dtype not in _INT_DTYPES or keys.device != dev:
        return False
    if block_table.dim() != 1 or block_table.dtype != torch.int32 or block_table.device != dev:
        return False
    if head_dim <= 0 or type(rotary_dim) is not int or not (0 <= rotary_dim <= head_dim) or rotary_dim % 2:
        return False
    if type(rope_theta) is not float or not (math.isfinite(rope_theta) and rope_theta > 1.0):
        return False
    if type(start_row) is not int or start_row < 0:
        return False
    return start_row + n <= block_table.shape[0] * block_size


def _explain_append_metadata(
    k_new: torch.Tensor, v_new: torch.Tensor, keys: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, block_table: torch.Tensor, start_row: int, rotary_dim: int,
    rope_theta: float,
) -> None:
    """Raise the ValueError of the first failing metadata check, in a fixed order."""
    from .rope import check_rope_args

    if k_cache.dim() != 4:
        raise ValueError(
            f"k_cache must be 4-D [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} differs from k_cache {tuple(k_cache.shape)}")
    if k_cache.dtype not in CACHE_DTYPES:
        raise ValueError(f"k_cache dtype must be one of {CACHE_DTYPES}, got {k_cache.dtype}")
    num_blocks, block_size, hkv, head_dim = k_cache.shape
    device = k_cache.device
    for name, t in (("v_cache", v_cache),):
        if t.dtype != k_cache.dtype:
            raise ValueError(f"{name} dtype {t.dtype} differs from k_cache dtype {k_cache.dtype}")
        if t.device != device:
            raise ValueError(f"{name} device {t.device} differs from k_cache device {device}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    n = k_new.shape[0] if k_new.dim() == 3 else -1
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        if tuple(t.shape) != (n, hkv, head_dim):
            raise ValueError(
                f"{name} must have shape [n, num_kv_heads={hkv}, head_dim={head_dim}], got {tuple(t.shape)}"
            )
        if t.dtype != k_cache.dtype:
            raise ValueError(f"{name} dtype {t.dtype} differs from cache dtype {k_cache.dtype}")
        if t.device != device:
            raise ValueError(f"{name} device {t.device} differs from cache device {device}")
    if keys.dim() != 1 or keys.shape[0] != n:
        raise ValueError(f"keys must have shape [n={n}], got {tuple(keys.shape)}")
    if keys.dtype not in _INT_DTYPES:
        raise ValueError(f"keys dtype must be int32 or int64, got {keys.dtype}")
    if keys.device != device:
        raise ValueError(f"keys device {keys.device} differs from cache device {device}")
    if block_table.dim() != 1 or block_table.dtype != torch.int32:
        raise ValueError(
            f"block_table must be 1-D int32, got shape {tuple(block_table.shape)} dtype {block_table.dtype}"
        )
    if block_table.device != device:
        raise ValueError(f"block_table device {block_table.device} differs from cache device {device}")
    check_rope_args(head_dim, rotary_dim, rope_theta)
    _check_index("start_row", start_row)
    end_row = start_row + n
    if end_row > block_table.shape[0] * block_size:
        raise ValueError(
            f"rows [{start_row}, {end_row}) run past the block table "
            f"({block_table.shape[0]} blocks x {block_size} = {block_table.shape[0] * block_size} rows)"
        )
