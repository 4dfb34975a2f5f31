"""Pair keys to (page, slot) in TensorRT-LLM's paged KV (HND pages), and the row gather/scatter.

What it is for: the carry moves the MTP layer's rows between a request's draft
pages and the carry store exactly as TensorRT-LLM wrote them (its MTP row for
key k is roped at position k), so adopt and deposit are plain copies, no re-rope.

The buffer is `KVCacheManagerV2.get_buffers(layer_idx, kv_layout="HND")`
(`tensorrt_llm/_torch/pyexecutor/kv_cache_manager_v2.py`): shape
`[num_pages, kv_factor=2, num_kv_heads, tokens_per_block, head_dim]`; the page
list is `get_batch_cache_indices([request_id], layer_idx)[0]`, already in the
units of that view's first dimension (the manager divides by `kv_factor`), with
`BAD_PAGE_INDEX` (negative) for a page not held. Key `k` lives at
`buf[pages[k // tpb], :, :, k % tpb]`:

```
  page pages[0]          page pages[1]          ...
  | keys 0 .. tpb-1 |    | keys tpb .. 2tpb-1 |
```

Invariants:
- One indexed copy per call, no Python loop over keys or rows.
- `gather_packed_rows` / `scatter_packed_rows` are `pack_rows(gather_rows(...))`
  and `scatter_rows(..., unpack_rows(...))` bit for bit, in one call each; on
  CUDA one Triton launch each, addressing the (key, K/V, head) vectors in the
  pages directly through the page table (`hnd_layout`).
- A key whose page is missing or `BAD_PAGE_INDEX` is a `RuntimeError` naming
  the key and the page (a caller bug: the draft manager sized the request).
- A gather given `out` (e.g. a view of an arena extent) writes its rows there
  once, the same bytes it would return, and returns `out`: the indexed copy is
  aten's out variant, the Triton kernels write `out`'s tensors themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .device_ints import device_copy, device_tensor
from .row_format import FP8_OPS, PackedRows
from .row_layout import P, RowFormatOps, VectorLayout, check_out


def page_table(pages: Sequence[int], lo: int, hi: int, tokens_per_block: int) -> tuple[list[int], int]:
    """`(pages[first:last + 1], first)`: the pages holding keys `[lo, hi)`, checked (a key past the
    pages held or on a `BAD_PAGE_INDEX` page is a RuntimeError naming it)."""
    if not 0 <= lo <= hi:
        raise ValueError(f"key range needs 0 <= lo <= hi, got [{lo}, {hi})")
    if hi == lo:
        return [], 0
    first, last = lo // tokens_per_block, (hi - 1) // tokens_per_block
    if last >= len(pages):
        raise RuntimeError(f"keys [{lo}, {hi}) need page {last}, the request holds "
                           f"{len(pages)} pages of {tokens_per_block}")
    table = [int(p) for p in pages[first:last + 1]]
    if min(table) < 0:
        bad = next(i for i, p in enumerate(table) if p < 0) + first
        raise RuntimeError(f"keys [{lo}, {hi}): page {bad} is BAD_PAGE_INDEX ({pages[bad]})")
    return table, first


def key_slots(pages: Sequence[int], lo: int, hi: int, tokens_per_block: int,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`(page index, slot)` int64 tensors `[hi - lo]` for keys `[lo, hi)`."""
    table, first = page_table(pages, lo, hi, tokens_per_block)
    keys = torch.arange(lo, hi, dtype=torch.int64)
    page = torch.tensor(table, dtype=torch.int64)[keys // tokens_per_block - first]
    # made on the host, copied without a host-device sync (pinned staging on CUDA)
    return device_copy(page, device), device_copy(keys % tokens_per_block, device)


def index_into(src: torch.Tensor, indices: Sequence[torch.Tensor | None], out: torch.Tensor) -> torch.Tensor:
    """`src[indices]` (advanced indexing; None: a whole dimension) written straight into `out`, which
    has its shape and dtype: aten's out variant of the indexed read, one pass, no temporary. `out`."""
    result: torch.Tensor = torch.ops.aten.index.Tensor_out(src, list(indices), out=out)
    return result


def gather_rows(buf: torch.Tensor, pages: Sequence[int], lo: int, hi: int,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of keys `[lo, hi)` as a tensor `[hi - lo, 2, num_kv_heads, head_dim]`: written into `out`
    when given (the pages' dtype and device, contiguous: `row_layout.check_out`, before any
    write) and `out` returned, else a new tensor."""
    # buf: [num_pages, 2, Hkv, tpb, D] (HND)
    page, slot = key_slots(pages, lo, hi, buf.shape[3], buf.device)
    shape = (hi - lo, buf.shape[1], buf.shape[2], buf.shape[4])
    if out is None:
        out = torch.empty(shape, dtype=buf.dtype, device=buf.device)
    else:
        check_out(out, torch.Tensor, shape, buf.dtype, buf.device)
    return index_into(buf, [page, None, None, slot], out)  # indices on dims 0 and 3 -> [n, 2, Hkv, D]


def scatter_rows(buf: torch.Tensor, pages: Sequence[int], lo: int, rows: torch.Tensor) -> None:
    """Write `rows` `[n, 2, num_kv_heads, head_dim]` at keys `[lo, lo + n)` of the request's pages."""
    # buf: [num_pages, 2, Hkv, tpb, D] (HND); rows dtype and heads must match
    if rows.dim() != 4 or rows.shape[1:] != (buf.shape[1], buf.shape[2], buf.shape[4]):
        raise RuntimeError(f"rows of shape {tuple(rows.shape)} do not fit HND pages "
                           f"{tuple(buf.shape)}")
    if rows.dtype != buf.dtype:
        raise RuntimeError(f"rows are {rows.dtype}, the pages {buf.dtype}")
    page, slot = key_slots(pages, lo, lo + rows.shape[0], buf.shape[3], buf.device)
    buf[page, :, :, slot] = rows.to(buf.device)


def hnd_layout(buf: torch.Tensor, pages: Sequence[int], lo: int, hi: int) -> VectorLayout:
    """The (key, K/V, head) vectors of keys `[lo, hi)` in the HND pages `buf`, as the FP8 kernels
    address them: through the request's page table (one small host-to-device copy, no sync)."""
    # buf: [num_pages, 2, Hkv, tpb, D] (HND), any strides
    tpb = buf.shape[3]
    table, first = page_table(pages, lo, hi, tpb)
    s0, s1, s2, s3, s4 = buf.stride()
    return VectorLayout(hi - lo, buf.shape[1], buf.shape[2], buf.shape[4], s0, s1, s2, s4,
                        table=device_tensor(table, torch.int64, buf.device), first_key=lo - first * tpb,
                        rows_per_block=tpb, s_slot=s3)


def gather_packed_rows(buf: torch.Tensor, pages: Sequence[int], lo: int, hi: int,
                       kernel: str | None = None, out: PackedRows | None = None) -> PackedRows:
    """Rows of keys `[lo, hi)` packed in the FP8 row format (`dataplane.row_format`), `[hi - lo, 2, Hkv, D]`.

    Bit for bit `pack_rows(gather_rows(buf, pages, lo, hi))` (finite rows), in one
    pass: the Triton kernel reads the pages and writes the packed form in one
    launch, no bf16 copy, no per-key offsets built on the host; the torch path
    packs the indexed read. `kernel` as `row_format.row_kernel`; `out` as
    `gather_pages_packed`'s.
    """
    return gather_pages_packed(FP8_OPS, buf, pages, lo, hi, kernel, out)


def scatter_packed_rows(buf: torch.Tensor, pages: Sequence[int], lo: int, packed: PackedRows,
                        kernel: str | None = None) -> None:
    """Dequantize `packed` `[n, 2, Hkv, D]` straight into keys `[lo, lo + n)` of the request's pages.

    Bit for bit `scatter_rows(buf, pages, lo, unpack_rows(packed))`; the same checks
    (shape, dtype: the packed rows' original dtype must be the pages') before any
    write. The Triton kernel writes the pages from the packed form in one launch.
    """
    scatter_pages_packed(FP8_OPS, buf, pages, lo, packed, kernel)


def gather_pages_packed(fmt: RowFormatOps[P], buf: torch.Tensor, pages: Sequence[int], lo: int, hi: int,
                        kernel: str | None, out: P | None = None) -> P:
    """Rows of keys `[lo, hi)` of HND pages `buf` `[pages, 2, Hkv, tpb, D]`, packed by `fmt` as
    `[hi - lo, 2, Hkv, D]`: bit for bit `fmt.pack_rows(hnd_pages.gather_rows(...))`; Triton reads
    the pages through the page table in one launch, torch packs the indexed read. With `out`
    (`fmt`'s packed rows of that shape and the pages' dtype, contiguous, on their device:
    `row_layout.check_out`, before any write) the same bytes are written there and `out` is
    returned: the Triton kernel writes `out`'s tensors itself, the torch path packs in
    float32 temporaries and copies the result in."""
    shape = (hi - lo, buf.shape[1], buf.shape[2], buf.shape[4])
    if fmt.kernel(buf, kernel) == "triton":
        layout = hnd_layout(buf, pages, lo, hi)  # the pages checked
        if out is not None:
            check_out(out, fmt.packed_type, shape, buf.dtype, buf.device)
        return fmt.pack_layout(buf, None, layout, shape, out)
    page, slot = key_slots(pages, lo, hi, buf.shape[3], buf.device)
    return fmt.pack_rows(buf[page, :, :, slot], kernel="torch", out=out)  # the index makes a fresh tensor


def scatter_pages_packed(fmt: RowFormatOps[Any], buf: torch.Tensor, pages: Sequence[int], lo: int, packed: Any,
                         kernel: str | None) -> None:
    """Unpack `packed` `[n, 2, Hkv, D]` straight into keys `[lo, lo + n)` of HND pages `buf`: bit for
    bit `hnd_pages.scatter_rows(buf, pages, lo, fmt.unpack_rows(packed))`, with its checks (shape;
    the packed rows' dtype must be the pages') before any write."""
    shape = packed.shape
    if len(shape) != 4 or tuple(shape[1:]) != (buf.shape[1], buf.shape[2], buf.shape[4]):
        raise RuntimeError(f"rows of shape {tuple(shape)} do not fit HND pages {tuple(buf.shape)}")
    if packed.dtype != buf.dtype:
        raise RuntimeError(f"rows are {packed.dtype}, the pages {buf.dtype}")
    if fmt.kernel(buf, kernel) == "triton":
        layout = hnd_layout(buf, pages, lo, lo + shape[0])  # checks the pages before any write
        fmt.unpack_layout(packed.to(buf.device), buf, None, layout)
        return
    page, slot = key_slots(pages, lo, lo + shape[0], buf.shape[3], buf.device)
    buf[page, :, :, slot] = fmt.unpack_rows(packed.to(buf.device), kernel="torch")
