"""Pair keys to TensorRT-LLM's HND pages: gather and scatter are exact copies, loop-free."""

from __future__ import annotations

import pytest
import torch

from trtllm_mtp_carry.dataplane.hnd_pages import gather_rows, key_slots, scatter_rows


def _buf() -> torch.Tensor:
    return torch.zeros(8, 2, 2, 4, 3, dtype=torch.bfloat16)  # [pages, 2, Hkv, tpb=4, D]


def test_scatter_then_gather_round_trips_unaligned_keys_over_reversed_pages() -> None:
    buf = _buf()
    pages = [7, 5, 2, 0]
    rows = torch.randn(11, 2, 2, 3).to(torch.bfloat16)
    scatter_rows(buf, pages, 3, rows)  # keys 3..13 over pages 7 (slot 3), 5, 2, 0 (slots 0, 1)
    assert torch.equal(gather_rows(buf, pages, 3, 14), rows)
    assert torch.equal(buf[7, :, :, 3], rows[0]) and torch.equal(buf[0, :, :, 1], rows[10])
    assert int(buf[7, :, :, :3].abs().sum()) == 0 and int(buf[0, :, :, 2:].abs().sum()) == 0
    untouched = [1, 3, 4, 6]
    assert int(buf[untouched].abs().sum()) == 0


def test_key_slots_maps_keys_to_page_and_slot() -> None:
    page, slot = key_slots([9, 4], 2, 7, 4, torch.device("cpu"))
    assert page.tolist() == [9, 9, 4, 4, 4] and slot.tolist() == [2, 3, 0, 1, 2]


def test_bad_page_index_and_short_tables_are_caller_errors() -> None:
    buf = _buf()
    with pytest.raises(RuntimeError, match="page 1 is BAD_PAGE_INDEX"):
        gather_rows(buf, [3, -1], 0, 6)
    with pytest.raises(RuntimeError, match="need page 2, the request holds 2 pages"):
        gather_rows(buf, [3, 4], 0, 9)
    with pytest.raises(RuntimeError, match="do not fit HND pages"):
        scatter_rows(buf, [3, 4], 0, torch.zeros(2, 2, 3, 3, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="rows are torch.float32"):
        scatter_rows(buf, [3, 4], 0, torch.zeros(2, 2, 2, 3))
