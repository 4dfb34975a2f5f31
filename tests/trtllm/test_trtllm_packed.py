"""The adapter's carried rows with each packed `carry_row_dtype` (fp8, issue 31; nvfp4, issue 43), one
suite over both formats: the store charges the packed bytes exactly and refuses unpacked rows, the
host tier holds the packed form and gives it back bit for bit, outputs on the stand-in executor equal
bf16's, the option takes the format (no TensorRT-LLM is run). A packed format joins by adding one
entry to `FORMATS`; each format's file keeps what is its own."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from arena_carry import ArenaCarry
from standin_helpers import acceptance, make_llm, quote_sessions, run_turns

from trtllm_mtp_carry.dataplane import nvfp4, row_format
from trtllm_mtp_carry.dataplane.row_layout import map_tensors
from trtllm_mtp_carry.trtllm import attach
from trtllm_mtp_carry.trtllm.options import CarryOptions, TrtllmAdapterError, parse_carry_options


@dataclass(frozen=True)
class Format:
    pack_rows: Callable[[torch.Tensor], Any]
    unpack_rows: Callable[[Any], torch.Tensor]
    packed_type: type
    nbytes: Callable[[int, int], int]  # bytes of `num_vectors` vectors of `head_dim`
    head_dim: int  # of `packed_of`'s rows (a multiple of 16 for nvfp4)
    entry_bytes: int  # `packed_of`'s bytes: 40 vectors of `head_dim`
    standin_vector_bytes: int  # bytes of one of the stand-in's vectors of 32 values
    acceptance_floor: float | None  # the least acceptance against bf16's, where pinned


FORMATS = {
    # 40 vectors of 4: 160 B payload + 160 B scales; the stand-in's 32 values: 32 + 4 bytes
    "fp8": Format(row_format.pack_rows, row_format.unpack_rows, row_format.PackedRows, row_format.packed_nbytes, 4, 320, 32 + 4, 0.99),
    # 40 vectors of 16: 320 B of pairs + 40 block + 40 global bytes; 32 values: 16 + 2 + 1 bytes
    "nvfp4": Format(nvfp4.pack_rows, nvfp4.unpack_rows, nvfp4.Nvfp4Rows, nvfp4.nvfp4_nbytes, 16, 400, 16 + 2 + 1, None),
}
ROW_DTYPES = sorted(FORMATS)


def packed_of(fmt: Format, seed: int, n: int = 10) -> Any:
    rows = torch.randn(n, 2, 2, fmt.head_dim, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    return fmt.pack_rows(rows)


def same(a: Any, b: Any) -> bool:
    """The same packed rows: every held tensor's bytes, and the rows' dtype."""
    def tensors(p: Any) -> list[torch.Tensor]:
        return [getattr(p, f.name).contiguous().view(torch.uint8) for f in dataclasses.fields(p) if f.name != "dtype"]

    return a.dtype == b.dtype and all(torch.equal(x, y) for x, y in zip(tensors(a), tensors(b), strict=True))


@pytest.mark.parametrize("row_dtype", ROW_DTYPES)
def test_a_packed_store_charges_the_packed_bytes_exactly_and_refuses_unpacked_rows(row_dtype):
    fmt = FORMATS[row_dtype]
    one = fmt.nbytes(10 * 2 * 2, fmt.head_dim)
    assert one == fmt.entry_bytes == packed_of(fmt, 1).nbytes
    carried = ArenaCarry(None, budget_bytes=2 * one, policy="lrd", row_dtype=row_dtype, head_dim=fmt.head_dim)
    assert carried.deposit(11, list(range(12)), packed_of(fmt, 1))
    assert carried.deposit(12, list(range(12)), packed_of(fmt, 2))
    stats = carried.stats()
    assert (stats.bytes_held, stats.entries_held, stats.row_dtype) == (2 * one, 2, row_dtype)
    assert carried.arena.held_bytes == 2 * one  # the arena holds the packed bytes, exactly
    taken = carried.take(11)
    assert same(taken, packed_of(fmt, 1))
    assert same(carried.take(12, rows_kept=4), map_tensors(packed_of(fmt, 2), lambda t: t[:4]))
    with pytest.raises(TypeError, match=f"a {row_dtype} codec holds {fmt.packed_type.__name__} of "
                                        "torch.bfloat16, got Tensor"):
        carried.deposit(13, list(range(12)), fmt.unpack_rows(packed_of(fmt, 3)))
    carried.service.repair()  # the executor's fault recovery: nothing of 13 is held
    assert carried.get(13) is None and carried.arena.held_bytes == 0
    carried.check()


@pytest.mark.parametrize("row_dtype", ROW_DTYPES)
def test_the_host_tier_holds_the_packed_form_and_gives_it_back_bit_for_bit(row_dtype):
    fmt = FORMATS[row_dtype]
    one = packed_of(fmt, 1).nbytes
    carried = ArenaCarry(None, budget_bytes=one, policy="lrd", host_budget_bytes=2 * one, row_dtype=row_dtype,
                         head_dim=fmt.head_dim)
    assert carried.deposit(11, list(range(12)), packed_of(fmt, 1))
    assert carried.deposit(12, list(range(12)), packed_of(fmt, 2))  # 11 is demoted, packed
    stats = carried.stats()
    assert (stats.host_entries, stats.host_bytes_held, stats.bytes_demoted) == (1, one, one)
    host = carried.host_arena.view(11)  # its host range holds the packed rows' bytes, exactly
    assert host.numel() == one and same(carried.codec.view(host, (10, 2, 2, fmt.head_dim)), packed_of(fmt, 1))
    carried.check()
    assert same(carried.take(11), packed_of(fmt, 1))
    assert carried.stats().bytes_restored == one
    carried.check()


@pytest.mark.parametrize("row_dtype", ROW_DTYPES)
def test_standin_sessions_with_packed_rows_keep_outputs_and_adopt_every_warm_turn(row_dtype):
    fmt = FORMATS[row_dtype]
    sessions = quote_sessions(4)
    runs = {}
    for dtype in ("bf16", row_dtype):
        llm, _ = make_llm("blind")
        carry = attach(llm, {"carry_slots": 8, "carry_host_memory": 0, "carry_row_dtype": dtype})
        runs[dtype] = (run_turns(llm, sessions, 2, 48), carry)
        llm.executor.check()
        carry.manager.service.check()
    outputs = {d: {c: [r.output for r in t] for c, t in runs[d][0].items()} for d in runs}
    assert outputs[row_dtype] == outputs["bf16"]
    packed, bf16 = runs[row_dtype][1].stats(), runs["bf16"][1].stats()
    assert packed.outcomes["adopted"] == bf16.outcomes["adopted"] == 4
    assert packed.row_dtype == row_dtype and packed.rows_held == bf16.rows_held
    # the stand-in's head_dim is 32: its packed bytes a vector against 2 x 32 in bf16
    assert packed.bytes_held * 2 * 32 == bf16.bytes_held * fmt.standin_vector_bytes
    if fmt.acceptance_floor is not None:
        acc = {d: acceptance(runs[d][0]) for d in runs}
        assert acc[row_dtype][0] >= fmt.acceptance_floor * acc["bf16"][0] * acc[row_dtype][1] / acc["bf16"][1]


@pytest.mark.parametrize("row_dtype", ROW_DTYPES)
def test_the_mtp_carry_option_takes_a_packed_row_dtype(row_dtype):
    assert parse_carry_options({"carry_row_dtype": row_dtype}).carry_row_dtype == row_dtype


def test_the_mtp_carry_option_defaults_to_none_and_refuses_an_unknown_row_dtype():
    assert parse_carry_options(None) == CarryOptions(True, None, None, None, 0, None)
    with pytest.raises(TrtllmAdapterError) as exc:
        parse_carry_options({"carry_row_dtype": "int8"})
    assert str(exc.value) == "mtp_carry.carry_row_dtype must be one of bf16, fp8, nvfp4, got 'int8'"
