"""The reference runtime with `carry_row_dtype` nvfp4: entries packed outside the drafter pool at
deposit, unpacked into fresh blocks on adoption (the nvfp4 codec through `PackedResidence`);
outputs never change, the store is charged the packed bytes exactly, the adopted rows are the
codec's round trip bit for bit, the host tier holds the packed form (issue 43)."""

from __future__ import annotations

import pytest
import torch
from engine_factories import engine, greedy_oracle, random_prompt, tiny_model

from trtllm_mtp_carry import session_hash
from trtllm_mtp_carry.dataplane.nvfp4 import Nvfp4Rows, nvfp4_nbytes, pack_rows, unpack_rows
from trtllm_mtp_carry.runtime import CarryRuntime


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=11)


def nvfp4_engine(model, memory=None, host_memory=0):
    eng = engine(model)
    eng.runtime = CarryRuntime(eng, eng.config.policy, slots=None, memory=memory, eviction="lrd",
                               host_memory=host_memory, share=False, row_dtype="nvfp4")
    return eng


def check_all(eng):
    eng.check()
    eng.runtime.check()
    eng.drafter_pool.check()


def adopted_rows(eng, key, rows):
    eng.runtime._take(99, key, rows_kept=rows)
    k, v, keys = (t.clone() for t in eng.drafter_pool.gather(99))
    eng.runtime.release(99)
    return k, v, keys


def test_an_nvfp4_entry_leaves_the_pool_and_is_charged_its_packed_bytes_exactly(model):
    eng = nvfp4_engine(model)
    eng.generate("a", random_prompt(torch.Generator().manual_seed(5), 40), max_new_tokens=6)
    pool, stats = eng.drafter_pool, eng.runtime.stats()
    assert pool.carried_keys() == () and pool.num_free_blocks == pool.num_blocks
    vectors = stats.slot_rows * 2 * pool.num_kv_heads
    d = pool.head_dim
    assert stats.bytes_held == nvfp4_nbytes(vectors, d) == vectors * (d // 2 + d // 16 + 1)
    assert (stats.row_dtype, stats.packs, stats.unpacks, stats.entries_held) == ("nvfp4", 1, 0, 1)
    assert isinstance(eng.runtime._residence.moves.get(session_hash("a")).packed, Nvfp4Rows)
    check_all(eng)


def test_nvfp4_rows_come_back_as_the_codecs_round_trip_of_the_bf16_rows_bit_for_bit(model):
    gen = torch.Generator().manual_seed(21)
    prompt = random_prompt(gen, 40)
    ref = engine(model)
    ref.generate("a", prompt, max_new_tokens=6)
    a = session_hash("a")
    k0, v0, keys0 = ref.drafter_pool.gather_carried(a)
    expect = unpack_rows(pack_rows(torch.stack((k0, v0), dim=1)))
    for _ in range(2):  # deterministic: the same bits each run
        eng = nvfp4_engine(model)
        eng.generate("a", prompt, max_new_tokens=6)
        k, v, keys = adopted_rows(eng, a, k0.shape[0])
        assert torch.equal(keys, keys0)
        assert torch.equal(k, expect[:, 0]) and torch.equal(v, expect[:, 1])
        assert not torch.equal(k, k0)  # FP4 rounding moved them
        check_all(eng)


def test_outputs_under_nvfp4_equal_plain_greedy_and_warm_turns_adopt(model):
    gen = torch.Generator().manual_seed(8)
    eng = nvfp4_engine(model)
    prompt = random_prompt(gen, 48)
    for turn in range(3):
        result = eng.generate("s", prompt, max_new_tokens=8)
        assert result.output == greedy_oracle(model, prompt, 8)[: len(result.output)]
        if turn:
            assert result.stats.outcome_kind == "adopted"
        prompt = prompt + result.output + random_prompt(gen, 20)
        check_all(eng)
    stats = eng.runtime.stats()
    assert (stats.packs, stats.unpacks, stats.outcomes["adopted"]) == (3, 2, 2)


def test_the_host_tier_holds_the_nvfp4_form_and_gives_the_same_rows_back(model):
    gen = torch.Generator().manual_seed(21)
    pa, pb = random_prompt(gen, 40), random_prompt(gen, 40)
    a, b = session_hash("a"), session_hash("b")
    device_only = nvfp4_engine(model)
    device_only.generate("a", pa, max_new_tokens=6)
    rows, one = device_only.runtime.stats().slot_rows, device_only.runtime.stats().bytes_held
    expect = adopted_rows(device_only, a, rows)
    eng = nvfp4_engine(model, memory=one, host_memory="1MiB")  # b's deposit demotes a
    eng.generate("a", pa, max_new_tokens=6)
    eng.generate("b", pb, max_new_tokens=6)
    stats = eng.runtime.stats()
    assert eng.runtime._store.tier(a) == "host" and eng.runtime._store.tier(b) == "device"
    assert (stats.demotions, stats.host_bytes_held) == (1, one)
    held = eng.runtime._residence.moves.get(a).packed
    assert isinstance(held, Nvfp4Rows) and held.device.type == "cpu"
    check_all(eng)
    got = adopted_rows(eng, a, rows)
    assert all(torch.equal(x, y) for x, y in zip(got, expect, strict=True))
    assert eng.runtime.stats().hits_host == 1
    check_all(eng)
