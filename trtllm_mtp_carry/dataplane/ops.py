"""torch custom ops over the two data-plane kernels (namespace `trtllm_mtp_carry`).

What it is for: one entry point per kernel that `torch.compile` can trace
(fake implementations give the shapes: both ops mutate their destination and
return nothing) and that picks the implementation by device:

- CUDA tensors: the Triton kernel (`triton_kernels.py`; the copy: see below), or with
  `TRTLLM_MTP_CARRY_KERNELS=aot` the TensorRT plugins' ahead-of-time PTX run
  through the CUDA driver (`kernels/aot_launcher.py`, no Triton JIT);
- CPU tensors: the plain-torch reference (`reference.py`).

- `hidden_row_copy` on CUDA with the default backend is torch's strided copy of
  the two row ranges (`hidden_row_copy_reference`): exactly the same function
  (a bitwise copy of n rows of one dtype; overlap is refused), at the copy
  engine's bandwidth and with one launch of fixed cost. The Triton copy kernel
  stays as the twin the tests check and the AOT sources' model; with
  `TRTLLM_MTP_CARRY_KERNELS=aot` the copy runs the plugin PTX.

Invariants: both implementations run the same argument checks first, so a
refused call raises ValueError and writes nothing, whatever the device. The
fake implementations run the metadata part of those checks (shapes, dtypes,
devices, bounds), so tracing refuses what eager would.

Per-call cost: `hidden_row_copy_direct` / `drafter_row_append_direct` are the
functions the custom ops register (called without the dispatcher round trip); eager
callers on the hot path (the hidden store, the drafter pools) use them,
`torch.compile`d code uses `torch.ops.trtllm_mtp_carry.*`. With
`check_data=False` an append neither syncs nor allocates (the AOT backend's one
allocation: int64 keys copied to the int32 its ABI takes).

    torch.ops.trtllm_mtp_carry.hidden_row_copy(src, src_row, dst, dst_row, n)
    torch.ops.trtllm_mtp_carry.drafter_row_append(
        k_new, v_new, keys, k_cache, v_cache, block_table, start_row, rotary_dim, rope_theta,
        check_data=True)
"""

from __future__ import annotations

import os

import torch

from .checks import check_drafter_row_append, check_hidden_row_copy
from .reference import drafter_row_append_reference, hidden_row_copy_reference

__all__ = [
    "KERNELS_ENV", "cuda_kernels", "drafter_row_append", "drafter_row_append_direct",
    "hidden_row_copy", "hidden_row_copy_direct",
]

KERNELS_ENV = "TRTLLM_MTP_CARRY_KERNELS"


def cuda_kernels() -> str:
    """The CUDA backend `$TRTLLM_MTP_CARRY_KERNELS` picks: `triton` (default) or `aot`."""
    choice = os.environ.get(KERNELS_ENV, "triton").strip() or "triton"
    if choice not in ("triton", "aot"):
        raise ValueError(f"{KERNELS_ENV} must be 'triton' or 'aot', got {choice!r}")
    return choice


def hidden_row_copy_direct(
    src: torch.Tensor,  # [S, H] unit column stride
    src_row: int,
    dst: torch.Tensor,  # [D, H] same dtype/device as src
    dst_row: int,
    n: int,
) -> None:
    """Copy `src[src_row:src_row+n]` into `dst[dst_row:dst_row+n]` bit for bit.

    The body of the op `hidden_row_copy`, called without the dispatcher by eager callers.
    CPU, and CUDA with the default backend: the checks, then one strided torch copy;
    CUDA with `TRTLLM_MTP_CARRY_KERNELS=aot`: the plugin PTX.
    """
    if src.device.type == "cuda" and cuda_kernels() == "aot":
        from ..kernels.aot_launcher import hidden_row_copy_aot

        hidden_row_copy_aot(src, src_row, dst, dst_row, n)
    else:
        hidden_row_copy_reference(src, src_row, dst, dst_row, n)


def drafter_row_append_direct(
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
    """Write RoPE(k_new at keys+1) and v_new into rows `[start_row, start_row+n)`.

    The body of the op `drafter_row_append`, called without the dispatcher by eager callers.
    CPU: the reference; CUDA: the Triton kernel, or the plugin PTX with
    `TRTLLM_MTP_CARRY_KERNELS=aot`. `check_data=False` skips the checks that read keys and
    block ids (a device sync on CUDA).
    """
    if k_cache.device.type != "cuda":
        impl = drafter_row_append_reference
    elif cuda_kernels() == "aot":
        from ..kernels.aot_launcher import drafter_row_append_aot as impl
    else:
        from .triton_kernels import drafter_row_append_triton as impl
    impl(
        k_new, v_new, keys, k_cache, v_cache, block_table, start_row, rotary_dim, rope_theta,
        check_data,
    )


# The ops run the `_direct` functions themselves (one implementation, picked by device inside).
hidden_row_copy = torch.library.custom_op(
    "trtllm_mtp_carry::hidden_row_copy", hidden_row_copy_direct, mutates_args=("dst",)
)


@hidden_row_copy.register_fake
def _hidden_row_copy_fake(src, src_row, dst, dst_row, n):  # type: ignore[no-untyped-def]
    check_hidden_row_copy(src, src_row, dst, dst_row, n, check_data=False)
    return None


drafter_row_append = torch.library.custom_op(
    "trtllm_mtp_carry::drafter_row_append", drafter_row_append_direct, mutates_args=("k_cache", "v_cache")
)


@drafter_row_append.register_fake
def _drafter_row_append_fake(k_new, v_new, keys, k_cache, v_cache, block_table, start_row, rotary_dim, rope_theta, check_data=True):  # type: ignore[no-untyped-def]
    check_drafter_row_append(
        k_new, v_new, keys, k_cache, v_cache, block_table, start_row, rotary_dim, rope_theta,
        check_data=False,
    )
    return None
