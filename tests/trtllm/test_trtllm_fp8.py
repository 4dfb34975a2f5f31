"""The adapter's carried rows with `carry_row_dtype` fp8: the manager gathers a finished request's
rows packed and scatters them unpacked into the draft pages; the store charges the packed bytes
exactly, the host tier holds the packed form, outputs on the stand-in executor equal bf16's (no
TensorRT-LLM is run; issue 31)."""

from __future__ import annotations

import pytest
import torch
from standin_helpers import acceptance, make_llm, quote_sessions, run_turns

from trtllm_mtp_carry.dataplane.row_format import PackedRows, pack_rows, packed_nbytes, unpack_rows
from trtllm_mtp_carry.trtllm.carried import CarriedRows
from trtllm_mtp_carry.trtllm.layout import gather_packed_rows, gather_rows, scatter_packed_rows
from trtllm_mtp_carry.trtllm.options import CarryOptions, TrtllmAdapterError, parse_carry_options


def packed_of(seed: int, n: int = 10) -> PackedRows:
    rows = torch.randn(n, 2, 2, 4, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    return pack_rows(rows)


def same(a: PackedRows, b: PackedRows) -> bool:
    return (torch.equal(a.payload.view(torch.uint8), b.payload.view(torch.uint8))
            and torch.equal(a.scales, b.scales) and a.dtype == b.dtype)


def test_an_fp8_store_charges_the_packed_bytes_exactly_and_refuses_unpacked_rows():
    one = packed_nbytes(10 * 2 * 2, 4)  # 40 vectors of 4: 160 B payload + 160 B scales
    assert one == 320 == packed_of(1).nbytes
    carried = CarriedRows(None, budget_bytes=2 * one, policy="lrd", host_budget_bytes=0, row_dtype="fp8")
    assert carried.deposit(11, list(range(12)), packed_of(1))
    assert carried.deposit(12, list(range(12)), packed_of(2))
    stats = carried.stats()
    assert (stats["bytes_held"], stats["entries"], stats["row_dtype"]) == (2 * one, 2, "fp8")
    with pytest.raises(TypeError, match="a fp8 codec holds PackedRows of torch.bfloat16, got Tensor"):
        carried.deposit(13, list(range(12)), unpack_rows(packed_of(3)))
    taken = carried.take(11)
    assert same(taken.rows, packed_of(1)) and same(taken.head(4), PackedRows(
        packed_of(1).payload[:4], packed_of(1).scales[:4], torch.bfloat16))
    carried.check()


def test_the_host_tier_holds_the_packed_form_and_gives_it_back_bit_for_bit():
    one = packed_of(1).nbytes
    carried = CarriedRows(None, budget_bytes=one, policy="lrd", host_budget_bytes=2 * one, row_dtype="fp8")
    assert carried.deposit(11, list(range(12)), packed_of(1))
    assert carried.deposit(12, list(range(12)), packed_of(2))  # 11 is demoted, packed
    stats = carried.stats()
    assert (stats["host_entries"], stats["host_bytes_held"], stats["bytes_demoted"]) == (1, one, one)
    assert isinstance(carried._host[11], PackedRows)
    carried.check()
    assert same(carried.take(11).rows, packed_of(1))
    assert carried.stats()["bytes_restored"] == one
    carried.check()


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


def test_standin_sessions_with_fp8_rows_keep_outputs_and_adopt_every_warm_turn():
    sessions = quote_sessions(4)
    runs = {}
    for dtype in ("bf16", "fp8"):
        llm, carry = make_llm("carry")
        carry.manager.carried = CarriedRows(8, 1 << 30, "lrd", None, host_budget_bytes=0, row_dtype=dtype)
        runs[dtype] = (run_turns(llm, sessions, 2, 48), carry)
        llm.executor.check()
        carry.manager.carried.check()
    outputs = {d: {c: [r.output for r in t] for c, t in runs[d][0].items()} for d in runs}
    assert outputs["fp8"] == outputs["bf16"]
    fp8, bf16 = runs["fp8"][1].stats(), runs["bf16"][1].stats()
    assert fp8["outcomes"]["adopted"] == bf16["outcomes"]["adopted"] == 4
    assert fp8["row_dtype"] == "fp8" and fp8["rows_held"] == bf16["rows_held"]
    # the stand-in's head_dim is 32: (32 + 4) bytes a vector for 2 x 32 (Qwen3-Next's 256: 0.508)
    assert fp8["bytes_held"] * 2 * 32 == bf16["bytes_held"] * (32 + 4)
    acc = {d: acceptance(runs[d][0]) for d in runs}
    assert acc["fp8"][0] >= 0.99 * acc["bf16"][0] * acc["fp8"][1] / acc["bf16"][1]


def test_the_mtp_carry_option_takes_a_row_dtype():
    assert parse_carry_options({"carry_row_dtype": "fp8"}).carry_row_dtype == "fp8"
    assert parse_carry_options(None) == CarryOptions(True, None, None, None, 0, None)
    with pytest.raises(TrtllmAdapterError) as exc:
        parse_carry_options({"carry_row_dtype": "int8"})
    assert str(exc.value) == "mtp_carry.carry_row_dtype must be one of bf16, fp8, nvfp4, got 'int8'"
