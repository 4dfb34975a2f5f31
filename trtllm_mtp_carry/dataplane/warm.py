"""Compile every Triton kernel variant a session will launch before its first timed turn.

What it is for: Triton compiles a kernel on the first launch of each variant (its
`tl.constexpr` values and the 16-byte alignment class of its pointer arguments), about a
second on a GPU. The drafter-row append's `ROWS` constexpr follows the row count (a power
of two up to its cap: `triton_kernels.append_blocks_for`), and the FP8 codec's kernels come
in layouts (plain rows, the pool's paged K and V caches, TensorRT-LLM's HND pages) and
pointer alignments (an arena extent's payload and scales start wherever the extent does).
Without warming, the first turn with a new row count or extent offset pays a compile inside
its timed prep. `warm_pool_kernels` (the reference runtime: at engine start) and
`warm_page_kernels` (the TensorRT-LLM adapter: at install) launch each variant once on
scratch tensors of the session's shapes, dtypes and strides.

Invariants: the scratch tensors are the session's own shapes per block/page (so the
strides, which Triton also specializes on, are the session's), nothing the session holds
is written, and off CUDA (or without Triton) nothing is launched (0 returned). The
copy kernel is not warmed: on CUDA the hidden-row copy is torch's (`ops.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .kv_pool import DrafterKVPool

__all__ = ["append_rows_variants", "warm_manager_kernels", "warm_page_kernels", "warm_pool_kernels"]


def append_rows_variants(num_kv_heads: int, head_dim: int, rotary_dim: int) -> list[int]:
    """Every `ROWS` the append launcher picks, over all row counts: the powers of two up to
    its cap (`append_blocks_for` at an unbounded count)."""
    from .triton_kernels import append_blocks_for  # Triton only where the kernels are asked for

    cap = append_blocks_for(1 << 40, num_kv_heads, head_dim, rotary_dim)["ROWS"]
    return [1 << i for i in range(cap.bit_length())]


def _runs_triton(device: torch.device, force: bool) -> bool:
    if force:
        return True
    from .ops import cuda_kernels

    return device.type == "cuda" and cuda_kernels() == "triton"


def warm_pool_kernels(pool: DrafterKVPool, fp8: bool, force: bool = False) -> int:
    """Launch, on a scratch pool of `pool`'s block shape and dtype, the append at every `ROWS`
    (`append_rows_variants`) and, with `fp8`, the pool's pack (`pack_blocks`) and unpack
    (`unpack_into_blocks`); returns the launches. CUDA with the Triton backend only (`force`:
    anywhere, for tests under the interpreter)."""
    from .kv_pool import DrafterKVPool
    from .row_format import pack_blocks, unpack_into_blocks

    if not _runs_triton(pool.device, force):
        return 0
    rows = append_rows_variants(pool.num_kv_heads, pool.head_dim, pool.rope.rotary_dim)
    blocks = -(-max(rows) // pool.block_size) + 1
    scratch = DrafterKVPool(2 * blocks, pool.block_size, pool.num_kv_heads, pool.head_dim, pool.rope,
                            device=pool.device, dtype=pool.k_cache.dtype)
    launches = 0
    for n in rows:
        scratch.allocate_sequence(0)
        k = torch.zeros(n, pool.num_kv_heads, pool.head_dim, dtype=pool.k_cache.dtype, device=pool.device)
        scratch.append_rows(0, range(n), k, k)
        launches += 1
        if fp8:
            table = scratch.sequence(0).block_table
            packed = pack_blocks(scratch.k_cache, scratch.v_cache, table, n)
            idx = torch.tensor(table, dtype=torch.int64).to(pool.device)
            unpack_into_blocks(packed, scratch.k_cache, scratch.v_cache, idx)
            launches += 2
        scratch.free_sequence(0)
    return launches


def warm_page_kernels(buf: torch.Tensor, row_dtype: str, block_nbytes: int, force: bool = False) -> int:
    """Launch, on two scratch pages shaped as `buf`'s (HND `[pages, 2, Hkv, tpb, D]`), the FP8
    gather (pack) and scatter (unpack) of TensorRT-LLM's pages, the scatter from packed rows at
    an arena extent's two alignment classes (offset 0 and one block of `block_nbytes`); returns
    the launches. Nothing for bf16 rows (their gather and scatter are torch indexing)."""
    from ..trtllm.layout import gather_packed_rows, scatter_packed_rows
    from .row_format import PackedRows

    if row_dtype != "fp8" or not _runs_triton(buf.device, force):
        return 0
    pages = torch.zeros((2, *buf.shape[1:]), dtype=buf.dtype, device=buf.device)
    tpb = int(buf.shape[3])
    n = tpb + 1  # both pages: a page boundary inside
    packed = gather_packed_rows(pages, [0, 1], 0, n)
    launches = 1
    payload_nbytes = packed.payload.numel()
    for offset in (0, block_nbytes):  # an extent at an even and an odd block
        raw = torch.zeros(offset + payload_nbytes + 4 * packed.scales.numel(), dtype=torch.uint8,
                          device=buf.device)
        payload = raw[offset:offset + payload_nbytes].view(packed.payload.dtype).view(packed.payload.shape)
        scales = raw[offset + payload_nbytes:].view(torch.float32).view(packed.scales.shape)
        payload.copy_(packed.payload)
        scales.copy_(packed.scales)
        scatter_packed_rows(pages, [0, 1], 0, PackedRows(payload, scales, packed.dtype))
        launches += 1
    return launches


def warm_manager_kernels(manager: Any, reserved: Any) -> int:
    """`warm_page_kernels` for an installed TensorRT-LLM carry manager: its draft pool's MTP-layer
    pages, its row format, one carried row's bytes (`reserved`: `reservation.Reserved`)."""
    buf = manager.pages.kv()  # the pages its codec moves (`trtllm.draft_pages`)
    return warm_page_kernels(buf, manager.service.home.codec.name, reserved.row_nbytes)
