"""The reference runtime with `carry_row_dtype` nvfp4, what is NVFP4's own: the adopted rows are the
codec's round trip of the bf16 rows bit for bit (issue 43). What nvfp4 shares with fp8 (packed bytes
charged exactly, outputs unchanged, the host tier) is `test_carry_packed.py`."""

from __future__ import annotations

import pytest
import torch
from engine_factories import engine, random_prompt, tiny_model
from packed_carry import adopted_rows, check_all, packed_engine

from trtllm_mtp_carry import session_hash
from trtllm_mtp_carry.dataplane.nvfp4 import pack_rows, unpack_rows


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=11)


def test_nvfp4_rows_come_back_as_the_codecs_round_trip_of_the_bf16_rows_bit_for_bit(model):
    gen = torch.Generator().manual_seed(21)
    prompt = random_prompt(gen, 40)
    ref = engine(model)
    ref.generate("a", prompt, max_new_tokens=6)
    a = session_hash("a")
    k0, v0, keys0 = ref.drafter_pool.gather_carried(a)
    expect = unpack_rows(pack_rows(torch.stack((k0, v0), dim=1)))
    for _ in range(2):  # deterministic: the same bits each run
        eng = packed_engine(model, "nvfp4")
        eng.generate("a", prompt, max_new_tokens=6)
        k, v, keys = adopted_rows(eng, a, k0.shape[0])
        assert torch.equal(keys, keys0)
        assert torch.equal(k, expect[:, 0]) and torch.equal(v, expect[:, 1])
        assert not torch.equal(k, k0)  # FP4 rounding moved them
        check_all(eng)
