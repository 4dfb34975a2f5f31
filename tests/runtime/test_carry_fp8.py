"""The reference runtime with `carry_row_dtype` fp8, what is FP8's own: an entry the pool cannot take
back leaves as pool pressure; the row dtype is checked; the core's bytes equal the codec's (issue 31).
What fp8 shares with nvfp4 (packed bytes charged exactly, the codec's round trip, outputs unchanged,
the host tier) is `test_carry_packed.py`."""

from __future__ import annotations

import pytest
import torch
from engine_factories import engine, random_prompt, tiny_model
from packed_carry import packed_engine

from trtllm_mtp_carry import session_hash
from trtllm_mtp_carry.dataplane.row_format import pack_rows, packed_nbytes
from trtllm_mtp_carry.runtime import CarryRuntime


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=11)


def test_a_bad_row_dtype_is_one_error_naming_it(model):
    eng = engine(model)
    with pytest.raises(ValueError) as exc:
        CarryRuntime(eng, row_dtype="fp4")
    assert str(exc.value) == "row_dtype='fp4' is not a row format; expected one of bf16, fp8, nvfp4"
    with pytest.raises(ValueError) as exc:
        engine(model, carry_row_dtype="e5m2")
    assert str(exc.value) == "EngineConfig.carry_row_dtype='e5m2' is not a row format; expected one of bf16, fp8, nvfp4"


def test_the_cores_pure_python_bytes_equal_the_codecs():
    from trtllm_mtp_carry.core.row_format import rows_nbytes

    for vectors in (0, 1, 4, 37, 4096):
        for head_dim in (1, 64, 128, 256):
            assert rows_nbytes("fp8", vectors, head_dim) == packed_nbytes(vectors, head_dim)
            rows = torch.zeros(vectors, head_dim, dtype=torch.bfloat16)
            assert pack_rows(rows).nbytes == packed_nbytes(vectors, head_dim)


@pytest.mark.parametrize("host_memory", [0, "1MiB"])
def test_an_fp8_entry_the_pool_cannot_take_back_leaves_as_pool_pressure(model, host_memory):
    gen = torch.Generator().manual_seed(9)
    eng = packed_engine(model, "fp8", host_memory=host_memory, num_drafter_blocks=8)
    prompt = random_prompt(gen, 40)
    result = eng.generate("a", prompt, max_new_tokens=6)
    a, pool = session_hash("a"), eng.drafter_pool
    pool.allocate_sequence(500)  # a live sequence holds all but one block: a's 3 blocks cannot come back
    pool.grow(500, (pool.num_free_blocks - 1) * pool.block_size)
    turn2 = prompt + result.output + random_prompt(gen, 8)
    build = eng.runtime.prepare(77, eng.runtime.draw_ticket(), a, turn2, len(prompt))
    assert build.mode == "blind" and build.outcome.reason == "pool_pressure"
    stats = eng.runtime.stats()
    assert stats.evictions["pool_pressure"] == 1 and stats.entries_held == stats.host_entries == 0
    host = eng.runtime.service.host
    assert eng.runtime.service.home.idle() and (host is None or host.idle())
    eng.runtime.release(77)
    pool.free_sequence(500)
    eng.runtime.check()
    pool.check()
