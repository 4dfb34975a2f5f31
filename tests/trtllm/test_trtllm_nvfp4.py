"""The adapter's carried rows with `carry_row_dtype` nvfp4: the manager gathers a finished request's
rows packed in NVFP4 and scatters them unpacked into the draft pages; the store charges the packed
bytes exactly, the host tier holds the packed form, outputs on the stand-in executor equal bf16's
(no TensorRT-LLM is run; issue 43)."""

from __future__ import annotations

import pytest
import torch
from standin_helpers import make_llm, quote_sessions, run_turns

from trtllm_mtp_carry.dataplane.nvfp4 import Nvfp4Rows, nvfp4_nbytes, pack_rows, unpack_rows
from trtllm_mtp_carry.trtllm.carried import CarriedRows
from trtllm_mtp_carry.trtllm.options import parse_carry_options


def packed_of(seed: int, n: int = 10) -> Nvfp4Rows:
    rows = torch.randn(n, 2, 2, 16, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    return pack_rows(rows)


def same(a: Nvfp4Rows, b: Nvfp4Rows) -> bool:
    return all(torch.equal(x, y) for x, y in ((a.payload, b.payload), (a.scales, b.scales), (a.gscales, b.gscales)))


def test_an_nvfp4_store_charges_the_packed_bytes_exactly_and_refuses_unpacked_rows():
    one = nvfp4_nbytes(10 * 2 * 2, 16)  # 40 vectors of 16: 320 B of pairs + 40 block + 40 global bytes
    assert one == 400 == packed_of(1).nbytes
    carried = CarriedRows(None, budget_bytes=2 * one, policy="lrd", host_budget_bytes=0, row_dtype="nvfp4")
    assert carried.deposit(11, list(range(12)), packed_of(1))
    assert carried.deposit(12, list(range(12)), packed_of(2))
    stats = carried.stats()
    assert (stats["bytes_held"], stats["entries"], stats["row_dtype"]) == (2 * one, 2, "nvfp4")
    with pytest.raises(TypeError, match="a nvfp4 codec holds Nvfp4Rows of torch.bfloat16, got Tensor"):
        carried.deposit(13, list(range(12)), unpack_rows(packed_of(3)))
    assert same(carried.take(11).rows, packed_of(1))
    carried.check()


def test_the_host_tier_holds_the_nvfp4_form_and_gives_it_back_bit_for_bit():
    one = packed_of(1).nbytes
    carried = CarriedRows(None, budget_bytes=one, policy="lrd", host_budget_bytes=2 * one, row_dtype="nvfp4")
    assert carried.deposit(11, list(range(12)), packed_of(1))
    assert carried.deposit(12, list(range(12)), packed_of(2))  # 11 is demoted, packed
    assert (carried.stats()["host_entries"], carried.stats()["host_bytes_held"]) == (1, one)
    assert isinstance(carried._host[11], Nvfp4Rows)
    carried.check()
    assert same(carried.take(11).rows, packed_of(1))
    carried.check()


def test_standin_sessions_with_nvfp4_rows_keep_outputs_and_adopt_every_warm_turn():
    sessions = quote_sessions(4)
    runs = {}
    for dtype in ("bf16", "nvfp4"):
        llm, carry = make_llm("carry")
        carry.manager.carried = CarriedRows(8, 1 << 30, "lrd", None, host_budget_bytes=0, row_dtype=dtype)
        runs[dtype] = (run_turns(llm, sessions, 2, 48), carry)
        llm.executor.check()
        carry.manager.carried.check()
    outputs = {d: {c: [r.output for r in t] for c, t in runs[d][0].items()} for d in runs}
    assert outputs["nvfp4"] == outputs["bf16"]
    nv, bf16 = runs["nvfp4"][1].stats(), runs["bf16"][1].stats()
    assert nv["outcomes"]["adopted"] == bf16["outcomes"]["adopted"] == 4
    assert nv["row_dtype"] == "nvfp4" and nv["rows_held"] == bf16["rows_held"]
    # the stand-in's head_dim is 32: 16 + 2 + 1 bytes a vector against 2 x 32
    assert nv["bytes_held"] * 2 * 32 == bf16["bytes_held"] * (16 + 2 + 1)


def test_the_mtp_carry_option_takes_nvfp4():
    assert parse_carry_options({"carry_row_dtype": "nvfp4"}).carry_row_dtype == "nvfp4"
