"""The reference runtime with `carry_row_dtype` fp8: entries packed outside the drafter pool at
deposit (blocks freed), unpacked into fresh blocks on adoption; outputs never change, the store is
charged the packed bytes exactly, the round trip is FP8 rounding and deterministic, the host tier
holds the packed form (issue 31)."""

from __future__ import annotations

import pytest
import torch
from engine_factories import engine, greedy_oracle, random_prompt, tiny_model

from trtllm_mtp_carry import EVICTION_CAUSES, session_hash
from trtllm_mtp_carry.dataplane.row_format import pack_rows, packed_nbytes, unpack_rows
from trtllm_mtp_carry.runtime import CarryRuntime


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=11)


def fp8_engine(model, row_dtype="fp8", memory=None, host_memory=0, **overrides):
    """An engine whose runtime stores carried rows as `row_dtype` (the pool holds bf16), with a
    device budget of `memory` bytes (None: the process setting)."""
    eng = engine(model, **overrides)
    eng.runtime = CarryRuntime(eng, eng.config.policy, slots=None, memory=memory, eviction="lrd",
                               host_memory=host_memory, share=False, row_dtype=row_dtype)
    return eng


def check_all(eng):
    eng.check()
    eng.runtime.check()
    eng.drafter_pool.check()


def adopted_rows(eng, key, rows):
    """Adopt `key`'s entry into a scratch sequence and return its rows and keys (then release it)."""
    eng.runtime._take(99, key, rows_kept=rows)
    k, v, keys = (t.clone() for t in eng.drafter_pool.gather(99))
    eng.runtime.release(99)
    return k, v, keys


def test_an_fp8_entry_leaves_the_pool_and_is_charged_its_packed_bytes_exactly(model):
    eng = fp8_engine(model)
    gen = torch.Generator().manual_seed(5)
    eng.generate("a", random_prompt(gen, 40), max_new_tokens=6)
    pool, stats = eng.drafter_pool, eng.runtime.stats()
    rows = stats.slot_rows
    assert pool.carried_keys() == () and pool.num_free_blocks == pool.num_blocks  # blocks freed at deposit
    vectors = rows * 2 * pool.num_kv_heads
    assert stats.bytes_held == packed_nbytes(vectors, pool.head_dim) == vectors * (pool.head_dim + 4)
    assert (stats.row_dtype, stats.packs, stats.unpacks, stats.entries_held) == ("fp8", 1, 0, 1)
    check_all(eng)


def test_fp8_rows_come_back_as_the_codecs_round_trip_of_the_bf16_rows_bit_for_bit(model):
    gen = torch.Generator().manual_seed(21)
    prompt = random_prompt(gen, 40)
    ref = engine(model)  # the same turn, carried as the pool holds it
    ref.generate("a", prompt, max_new_tokens=6)
    a = session_hash("a")
    k0, v0, keys0 = ref.drafter_pool.gather_carried(a)
    runs = []
    for _ in range(2):
        eng = fp8_engine(model)
        eng.generate("a", prompt, max_new_tokens=6)
        k, v, keys = adopted_rows(eng, a, k0.shape[0])
        runs.append((k, v))
        assert torch.equal(keys, keys0)
        both = torch.stack((k0, v0), dim=1)  # [rows, 2, Hkv, D], the packed layout
        expect = unpack_rows(pack_rows(both))
        assert torch.equal(k, expect[:, 0]) and torch.equal(v, expect[:, 1])
        scale = both.abs().amax(-1, keepdim=True) / 448
        assert bool(((expect - both).abs() <= 2**-4 * both.abs() + 2**-10 * scale + 1e-6).all())
        assert eng.runtime.stats().unpacks == 1
        check_all(eng)
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])  # deterministic


def test_outputs_under_fp8_equal_plain_greedy_and_warm_turns_adopt(model):
    gen = torch.Generator().manual_seed(8)
    eng = fp8_engine(model)
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


def test_the_host_tier_holds_the_packed_form_and_gives_the_same_rows_back(model):
    gen = torch.Generator().manual_seed(21)
    pa, pb = random_prompt(gen, 40), random_prompt(gen, 40)
    a, b = session_hash("a"), session_hash("b")
    device_only = fp8_engine(model)
    device_only.generate("a", pa, max_new_tokens=6)
    rows, one = device_only.runtime.stats().slot_rows, device_only.runtime.stats().bytes_held
    expect = adopted_rows(device_only, a, rows)
    # a device budget of exactly a's packed bytes: b's deposit demotes a to the host tier
    eng = fp8_engine(model, memory=one, host_memory="1MiB")
    eng.generate("a", pa, max_new_tokens=6)
    assert eng.runtime.stats().bytes_held == one
    eng.generate("b", pb, max_new_tokens=6)
    stats = eng.runtime.stats()
    assert eng.runtime._store.tier(a) == "host" and eng.runtime._store.tier(b) == "device"
    assert (stats.demotions, stats.host_bytes_held, stats.bytes_demoted) == (1, one, one)
    assert stats.evictions == dict.fromkeys(EVICTION_CAUSES, 0)
    assert eng.runtime._residence.moves.host_keys() == [a] and eng.runtime._residence.moves.get(a).packed.device.type == "cpu"
    check_all(eng)
    got = adopted_rows(eng, a, rows)
    assert all(torch.equal(x, y) for x, y in zip(got, expect, strict=True))
    stats = eng.runtime.stats()
    assert (stats.hits_host, stats.bytes_restored, stats.host_entries) == (1, one, 0)
    check_all(eng)


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
    eng = fp8_engine(model, host_memory=host_memory, num_drafter_blocks=8)
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
    assert eng.runtime._residence.moves.keys() == [] and eng.runtime._residence.moves.host_keys() == []
    eng.runtime.release(77)
    pool.free_sequence(500)
    eng.runtime.check()
    pool.check()
