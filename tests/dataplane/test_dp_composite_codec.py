"""Composite rows (`row_codec.CompositeCodec`): a key's K/V row, held by any K/V codec, and its side
rows from views that share the K/V pages' slot ids (the QSA hybrid's position coordinates and
index key), gathered, held in an arena block and scattered back exactly."""

from __future__ import annotations

import pytest
import torch

from trtllm_mtp_carry.dataplane.arena import Arena
from trtllm_mtp_carry.dataplane.row_codec import (
    CompositeCodec,
    CompositeRows,
    SideRows,
    SlotPages,
    codec_for,
    codec_of,
)

HKV, TPB, D, SLOTS = 2, 4, 8, 6
SIDES = (SideRows("position", (3,), torch.int32), SideRows("index_k", (1, HKV * D), torch.bfloat16))


def pool(seed: int, dtype: torch.dtype = torch.bfloat16) -> SlotPages:
    """A coalesced slot of 3 K-sized pages (K, V, index key), as V2 lays QSA's out: K/V the
    strided `[:, :2]`, the index key the third page read as `[tpb, 1, Hkv * D]`, positions apart."""
    gen = torch.Generator().manual_seed(seed)
    store = torch.randn(SLOTS, 3, HKV, TPB, D, generator=gen).to(torch.bfloat16)
    index = store[:, 2].flatten(1).unflatten(1, (TPB, 1, HKV * D))
    kv = store[:, :2] if dtype == torch.bfloat16 else torch.randn(
        SLOTS, 2, HKV, TPB, D, generator=gen).to(dtype)
    position = torch.randint(0, 1 << 20, (SLOTS, TPB, 3), generator=gen, dtype=torch.int32)
    return SlotPages(kv, (position, index))


def views(p: SlotPages) -> list[torch.Tensor]:
    return [p.kv.view(torch.uint8) if p.kv.dtype == torch.float8_e4m3fn else p.kv, *p.sides]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8_kv"])
def test_gather_then_scatter_restores_every_row_of_the_three_exactly_and_nothing_else(dtype) -> None:
    codec = CompositeCodec(codec_for("bf16", dtype), SIDES)
    assert codec.exact and codec.name == f"{codec.main.name}+position+index_k"
    src, dst = pool(1, dtype), pool(2, dtype)
    before = [t.clone() for t in views(dst)]
    rows = codec.gather_pages(src, [4, 1, 3], 2, 11)  # keys [2, 11) of pages 4, 1, 3
    assert isinstance(rows, CompositeRows) and rows.shape == (9, 2, HKV, D)
    elem = torch.empty((), dtype=dtype).element_size()
    assert codec.nbytes(rows) == 9 * codec.row_nbytes(HKV, D) == 9 * (2 * HKV * D * elem + 12 + 2 * HKV * D)
    codec.scatter_pages(dst, [0, 5, 2], 2, rows)
    again = codec.gather_pages(dst, [0, 5, 2], 2, 11)
    for a, b in zip(codec.tensors(rows), codec.tensors(again), strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    # only keys [2, 11) of pages 0, 5, 2 were written: slots 2..3 of 0, all of 5, 0..2 of 2
    written = torch.zeros(SLOTS, TPB, dtype=torch.bool)
    written[0, 2:] = written[5] = True
    written[2, :3] = True
    for old, new in zip(before, views(dst), strict=True):
        if new.dim() == 5:  # K/V pages [slots, 2, Hkv, tpb, D]: slot axis 3
            old, new = old.permute(0, 3, 1, 2, 4), new.permute(0, 3, 1, 2, 4)
        assert torch.equal(old[~written], new[~written])


def test_an_arena_range_holds_whole_composite_rows_and_gives_the_rows_back_exactly() -> None:
    codec = CompositeCodec(codec_for("fp8", torch.bfloat16), SIDES)  # packed K/V + side rows
    rows = codec.gather_pages(pool(3), [2, 0, 1], 0, 10)
    block = codec.row_nbytes(HKV, D)
    assert block == 2 * HKV * (D + 4) + 12 + 2 * HKV * D == codec.nbytes(rows) // 10
    arena = Arena(torch.zeros(4 * 10 * block, dtype=torch.uint8))
    codec.copy_(codec.view(arena.take(7, 10 * block), (10, 2, HKV, D)), rows)
    assert arena.held_bytes == 10 * block  # one row's bytes a row: the store's charge
    held = codec.view(arena.view(7), (10, 2, HKV, D))
    for a, b in zip(codec.tensors(rows), codec.tensors(held), strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert codec_of(held).name == codec.name == "fp8+position+index_k"
    host = codec.host_copy(codec.head(held, 4))
    assert codec.holds(host) and host.shape[0] == 4 and torch.equal(host.sides[1], rows.sides[1][:4])


def test_a_wrong_side_view_or_a_short_page_table_raises_before_any_write() -> None:
    codec = CompositeCodec(codec_for("bf16", torch.bfloat16), SIDES)
    rows = codec.gather_pages(pool(4), [0, 1, 2], 0, 12)
    dst = pool(5)
    before = [t.clone() for t in views(dst)]
    wrong = SlotPages(dst.kv, (dst.sides[0].float(), dst.sides[1]))
    with pytest.raises(RuntimeError, match=r"side view position is torch.float32 \(6, 4, 3\): expected "
                                           r"torch.int32 \[slots, 4, 3\]"):
        codec.scatter_pages(wrong, [0, 1, 2], 0, rows)
    with pytest.raises(RuntimeError, match=r"keys \[0, 12\) need page 2, the request holds 2 pages of 4"):
        codec.scatter_pages(dst, [3, 4], 0, rows)
    with pytest.raises(TypeError, match="a bf16\\+position\\+index_k codec holds CompositeRows"):
        codec.scatter_pages(dst, [0, 1, 2], 0, rows.kv)  # K/V alone: the side rows are missing
    assert all(torch.equal(a, b) for a, b in zip(before, views(dst), strict=True))
    with pytest.raises(ValueError, match="side row 'odd' takes 6 bytes: a multiple of 4"):
        SideRows("odd", (3,), torch.bfloat16)
