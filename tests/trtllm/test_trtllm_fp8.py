"""The adapter's carried rows with `carry_row_dtype` fp8, what is FP8's own: the fused gather and
scatter of the draft pages round-trip within FP8 rounding, deterministically (issue 31). What fp8
shares with nvfp4 (the store's bytes, the host tier, the stand-in's outputs, the option) is
`test_trtllm_packed.py`."""

from __future__ import annotations

import torch

from trtllm_mtp_carry.dataplane.hnd_pages import (
    gather_packed_rows,
    gather_rows,
    scatter_packed_rows,
)
from trtllm_mtp_carry.dataplane.row_format import PackedRows, pack_rows, unpack_rows


def same(a: PackedRows, b: PackedRows) -> bool:
    return (torch.equal(a.payload.view(torch.uint8), b.payload.view(torch.uint8))
            and torch.equal(a.scales, b.scales) and a.dtype == b.dtype)


def test_the_fused_gather_and_scatter_round_trip_within_fp8_rounding_and_deterministically():
    gen = torch.Generator().manual_seed(4)
    buf = torch.randn(6, 2, 2, 8, 16, generator=gen).to(torch.bfloat16)  # [pages, 2, Hkv, tpb, D] HND
    pages = [4, 1, 3]
    rows = gather_rows(buf, pages, 0, 20)
    packed = gather_packed_rows(buf, pages, 0, 20)
    assert same(packed, gather_packed_rows(buf, pages, 0, 20)) and same(packed, pack_rows(rows))
    out = torch.zeros_like(buf)
    scatter_packed_rows(out, [0, 2, 5], 0, packed)
    back = gather_rows(out, [0, 2, 5], 0, 20)
    assert torch.equal(back, unpack_rows(packed))
    x = rows.float()
    scale = x.abs().amax(-1, keepdim=True) / 448
    assert bool(((back.float() - x).abs() <= 2**-4 * x.abs() + 2**-10 * scale + 2**-8 * back.float().abs()).all())
