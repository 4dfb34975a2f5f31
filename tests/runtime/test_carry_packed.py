"""The reference runtime with each packed `carry_row_dtype` (fp8, issue 31; nvfp4, issue 43), one
suite over both formats: an entry leaves the drafter pool at deposit and the store is charged its
packed bytes exactly, the adopted rows are the codec's round trip of the bf16 rows bit for bit and
deterministic, outputs never change and warm turns adopt, the host tier holds the packed
form and gives the same rows back. A packed format joins by adding one entry to `FORMATS`."""

from __future__ import annotations

import pytest
import torch
from engine_factories import engine, greedy_oracle, random_prompt, tiny_model
from packed_carry import adopted_rows, check_all, packed_engine

from trtllm_mtp_carry import EVICTION_CAUSES, session_hash
from trtllm_mtp_carry.dataplane import nvfp4, row_format


def within_fp8_rounding(expect: torch.Tensor, rows: torch.Tensor) -> bool:
    """`expect` is within FP8's error bound of `rows` (`row_format`'s header)."""
    scale = rows.abs().amax(-1, keepdim=True) / 448
    return bool(((expect - rows).abs() <= 2**-4 * rows.abs() + 2**-10 * scale + 1e-6).all())


FORMATS = {  # row_dtype -> (packed type, its byte count, its bytes a vector of head_dim d,
    #                        its pack and unpack, its error bound where pinned here)
    "fp8": (row_format.PackedRows, row_format.packed_nbytes, lambda d: d + 4,
            row_format.pack_rows, row_format.unpack_rows, within_fp8_rounding),
    "nvfp4": (nvfp4.Nvfp4Rows, nvfp4.nvfp4_nbytes, lambda d: d // 2 + d // 16 + 1,
              nvfp4.pack_rows, nvfp4.unpack_rows, None),
}


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=11)


@pytest.mark.parametrize("row_dtype", sorted(FORMATS))
def test_a_packed_entry_leaves_the_pool_and_is_charged_its_packed_bytes_exactly(model, row_dtype):
    packed_type, nbytes, vector_bytes = FORMATS[row_dtype][:3]
    eng = packed_engine(model, row_dtype)
    eng.generate("a", random_prompt(torch.Generator().manual_seed(5), 40), max_new_tokens=6)
    pool, stats = eng.drafter_pool, eng.runtime.stats()
    assert pool.carried_keys() == () and pool.num_free_blocks == pool.num_blocks  # blocks freed at deposit
    vectors = stats.rows_held * 2 * pool.num_kv_heads
    assert stats.bytes_held == nbytes(vectors, pool.head_dim) == vectors * vector_bytes(pool.head_dim)
    assert (stats.row_dtype, stats.packs, stats.unpacks, stats.entries_held) == (row_dtype, 1, 0, 1)
    assert isinstance(eng.runtime.service.home.rows(session_hash("a")), packed_type)
    check_all(eng)


@pytest.mark.parametrize("row_dtype", sorted(FORMATS))
def test_packed_rows_come_back_as_the_codecs_round_trip_of_the_bf16_rows_bit_for_bit(model, row_dtype):
    pack_rows, unpack_rows, within_bound = FORMATS[row_dtype][3:]
    gen = torch.Generator().manual_seed(21)
    prompt = random_prompt(gen, 40)
    ref = engine(model)  # the same turn, carried as the pool holds it
    ref.generate("a", prompt, max_new_tokens=6)
    a = session_hash("a")
    k0, v0, keys0 = ref.drafter_pool.gather_carried(a)
    both = torch.stack((k0, v0), dim=1)  # [rows, 2, Hkv, D], the packed layout
    expect = unpack_rows(pack_rows(both))
    if within_bound is not None:
        assert within_bound(expect, both)
    runs = []
    for _ in range(2):
        eng = packed_engine(model, row_dtype)
        eng.generate("a", prompt, max_new_tokens=6)
        k, v, keys = adopted_rows(eng, a, k0.shape[0])
        runs.append((k, v))
        assert torch.equal(keys, keys0)
        assert torch.equal(k, expect[:, 0]) and torch.equal(v, expect[:, 1])
        assert not torch.equal(k, k0)  # the format's rounding moved them
        assert eng.runtime.stats().unpacks == 1
        check_all(eng)
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])  # deterministic


@pytest.mark.parametrize("row_dtype", sorted(FORMATS))
def test_outputs_under_a_packed_format_equal_plain_greedy_and_warm_turns_adopt(model, row_dtype):
    gen = torch.Generator().manual_seed(8)
    eng = packed_engine(model, row_dtype)
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


@pytest.mark.parametrize("row_dtype", sorted(FORMATS))
def test_the_host_tier_holds_the_packed_form_and_gives_the_same_rows_back(model, row_dtype):
    packed_type = FORMATS[row_dtype][0]
    gen = torch.Generator().manual_seed(21)
    pa, pb = random_prompt(gen, 40), random_prompt(gen, 40)
    a, b = session_hash("a"), session_hash("b")
    device_only = packed_engine(model, row_dtype)
    device_only.generate("a", pa, max_new_tokens=6)
    rows, one = device_only.runtime.stats().rows_held, device_only.runtime.stats().bytes_held
    codec = device_only.runtime.service.home.codec
    packed = [t.clone() for t in codec.tensors(device_only.runtime.service.home.rows(a))]  # a's packed bytes
    expect = adopted_rows(device_only, a, rows)
    # a device budget of exactly a's packed bytes: b's deposit demotes a to the host tier
    eng = packed_engine(model, row_dtype, memory=one, host_memory="1MiB")
    eng.generate("a", pa, max_new_tokens=6)
    assert eng.runtime.stats().bytes_held == one
    eng.generate("b", pb, max_new_tokens=6)
    stats = eng.runtime.stats()
    assert eng.runtime.service.store.tier(a) == "host" and eng.runtime.service.store.tier(b) == "device"
    assert (stats.demotions, stats.host_bytes_held, stats.bytes_demoted) == (1, one, one)
    assert stats.evictions == dict.fromkeys(EVICTION_CAUSES, 0)
    host = eng.runtime.service.host
    assert host.keys() == [a] and host.host_bytes == one and host.arena.device.type == "cpu"
    held = codec.view(host.arena.view(a), eng.runtime.service.home.shape(rows))  # the host range, in the packed form
    assert isinstance(held, packed_type) and all(
        torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(codec.tensors(held), packed, strict=True))
    check_all(eng)
    got = adopted_rows(eng, a, rows)
    assert all(torch.equal(x, y) for x, y in zip(got, expect, strict=True))
    stats = eng.runtime.stats()
    assert (stats.hits_host, stats.bytes_restored, stats.host_entries) == (1, one, 0)
    check_all(eng)
