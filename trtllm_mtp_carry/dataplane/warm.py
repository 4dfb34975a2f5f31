"""Compile every Triton kernel variant a session will launch before its first timed turn.

What it is for: Triton compiles a kernel on the first launch of each variant (its
`tl.constexpr` values and the 16-byte alignment class of its pointer arguments), about a
second on a GPU. The drafter-row append's `ROWS` constexpr follows the row count (a power
of two up to its cap: `triton_kernels.append_blocks_for`), and the packing codecs' kernels
(fp8, nvfp4: `RowCodec.packs`) come in layouts (the pool's paged K and V caches,
TensorRT-LLM's HND pages) and pointer alignments (an arena extent's rows start wherever the
extent does).
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

from .arena import ALIGN

if TYPE_CHECKING:
    from .kv_pool import DrafterKVPool
    from .row_codec import RowCodec, Rows

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


EXTENT_OFFSETS = (0, ALIGN)
"""Where a scratch extent starts, in bytes: an arena range starts on any multiple of `ALIGN` (4),
and Triton specializes a pointer on whether it is 16-byte aligned; 0 and 4 give both classes
whatever a row's bytes are (one row's bytes may itself be a multiple of 16)."""


def _extent_rows(codec: RowCodec, like: Rows, offset: int) -> Rows:
    """Zeroed rows of `like`'s shape in `codec`'s held form, viewed `offset` bytes into a scratch
    extent (how an arena or slab extent holds them: its pointers' alignment class follows the
    offset)."""
    nbytes = codec.nbytes(like)
    raw = torch.zeros(offset + nbytes, dtype=torch.uint8, device=codec.tensors(like)[0].device)
    return codec.view(raw[offset:], tuple(like.shape))


def warm_pool_kernels(pool: DrafterKVPool, codec: RowCodec, force: bool = False) -> int:
    """Launch, on a scratch pool of `pool`'s block shape and dtype, the append at every `ROWS`
    (`append_rows_variants`) and, when `codec` packs (`RowCodec.packs`: fp8, nvfp4), its block
    gather into and scatter from rows at an extent's two alignment classes (`EXTENT_OFFSETS`) at
    each of those row counts; returns the launches. CUDA with the Triton backend
    only (`force`: anywhere, for tests under the interpreter)."""
    from .kv_pool import DrafterKVPool

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
        if codec.packs:
            table = scratch.sequence(0).block_table
            idx = torch.tensor(table, dtype=torch.int64).to(pool.device)
            packed = codec.gather_blocks(scratch.k_cache, scratch.v_cache, table, n)
            for offset in EXTENT_OFFSETS:
                held = codec.gather_blocks(scratch.k_cache, scratch.v_cache, table, n,
                                           out=_extent_rows(codec, packed, offset))
                codec.scatter_blocks(held, scratch.k_cache, scratch.v_cache, idx)
                launches += 2
        scratch.free_sequence(0)
    return launches


def warm_page_kernels(buf: torch.Tensor, codec: RowCodec, force: bool = False) -> int:
    """Launch, on two scratch pages shaped as `buf`'s (HND `[pages, 2, Hkv, tpb, D]`), `codec`'s
    page gather into and scatter from rows at an extent's two alignment classes
    (`EXTENT_OFFSETS`), across a page boundary; returns the launches. Nothing for a codec that
    does not pack (its gather and scatter are torch indexing)."""
    if not codec.packs or not _runs_triton(buf.device, force):
        return 0
    pages = torch.zeros((2, *buf.shape[1:]), dtype=buf.dtype, device=buf.device)
    n = int(buf.shape[3]) + 1  # both pages: a page boundary inside
    packed = codec.gather_pages(pages, [0, 1], 0, n)
    launches = 0
    for offset in EXTENT_OFFSETS:
        held = codec.gather_pages(pages, [0, 1], 0, n, out=_extent_rows(codec, packed, offset))
        codec.scatter_pages(pages, [0, 1], 0, held)
        launches += 2
    return launches


def warm_manager_kernels(manager: Any) -> int:
    """`warm_page_kernels` for an installed TensorRT-LLM carry manager: its draft pool's MTP-layer
    K/V pages and its codec (a composite's K/V codec: the side rows are copied exactly)."""
    from .row_codec import CompositeCodec

    codec = manager.service.home.codec
    if isinstance(codec, CompositeCodec):
        codec = codec.main
    if not codec.packs:  # the pages are not read at all: no gather or scatter to compile
        return 0
    return warm_page_kernels(manager.pages.kv(), codec)
