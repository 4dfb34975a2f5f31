"""The reference runtime's host tier: entries leaving a tiny device budget wait in host memory
and come back, bit for bit, before the adopting turn's first draft step; outputs never change."""

from __future__ import annotations

import pytest
import torch
from engine_factories import engine, greedy_oracle, random_prompt, tiny_model

from trtllm_mtp_carry import EVICTION_CAUSES, session_hash
from trtllm_mtp_carry.dataplane.kv_pool import HostRows
from trtllm_mtp_carry.runtime import CarryRuntime


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=11)


def with_host(eng, blocks, host_memory="1MiB", eviction="lrd"):
    """A device budget of `blocks` drafter blocks and a host tier of `host_memory`."""
    memory = blocks * eng.drafter_pool.block_nbytes
    eng.runtime = CarryRuntime(eng, eng.config.policy, slots=None, memory=memory, eviction=eviction,
                               host_memory=host_memory, share=False)
    return eng


def zeros(**counts):
    return {cause: counts.get(cause, 0) for cause in EVICTION_CAUSES}


def check_all(eng):
    eng.check()
    eng.runtime.check()
    eng.drafter_pool.check()


def test_a_demoted_entry_is_restored_with_the_rows_and_keys_it_was_deposited_with(model):
    eng = with_host(engine(model), blocks=3)  # one 45-row entry (3 blocks of 16)
    gen = torch.Generator().manual_seed(21)
    eng.generate("a", random_prompt(gen, 40), max_new_tokens=6)
    a = session_hash("a")
    k, v, keys = (t.clone() for t in eng.drafter_pool.gather_carried(a))
    eng.generate("b", random_prompt(gen, 40), max_new_tokens=6)  # a leaves the device budget
    assert eng.drafter_pool.carried_keys() == (session_hash("b"),)
    assert [e.session_hash for e in eng.runtime.service.store.host_entries] == [a]
    stats = eng.runtime.stats()
    assert (stats.demotions, stats.host_entries, stats.host_bytes_held) == (1, 1, 3 * eng.drafter_pool.block_nbytes)
    assert stats.evictions == zeros() and stats.bytes_demoted == 3 * eng.drafter_pool.block_nbytes
    check_all(eng)
    held = eng.runtime._take(99, a, rows_kept=k.shape[0])
    assert held.rows == k.shape[0]
    k2, v2, keys2 = eng.drafter_pool.gather(99)
    assert torch.equal(k2, k) and torch.equal(v2, v) and torch.equal(keys2, keys)
    stats = eng.runtime.stats()
    assert (stats.hits_host, stats.hits_device, stats.host_entries) == (1, 0, 0)
    assert stats.bytes_restored == 3 * eng.drafter_pool.block_nbytes and stats.restore_ms > 0
    eng.runtime.release(99)
    check_all(eng)


def test_sessions_round_robin_under_a_tiny_device_budget_adopt_from_host_and_keep_greedy_outputs(model):
    eng = with_host(engine(model), blocks=5)  # an entry of each turn fits alone (3, 4, 5 blocks)
    gen = torch.Generator().manual_seed(22)
    sessions = ("a", "b", "c")
    prompts = {s: random_prompt(gen, 40) for s in sessions}
    kinds = []
    for _ in range(3):
        for s in sessions:
            r = eng.generate(s, prompts[s], max_new_tokens=6)
            assert r.output == greedy_oracle(model, prompts[s], 6)  # the carry never changes tokens
            kinds.append(r.stats.outcome_kind)
            prompts[s] = prompts[s] + r.output + random_prompt(gen, 4)
            check_all(eng)
    assert kinds == ["no_carry"] * 3 + ["adopted"] * 6
    stats = eng.runtime.stats()
    assert (stats.hits_host, stats.hits_device) == (6, 0)  # each session's entry waited in host memory
    assert stats.evictions == zeros() and stats.adoptions == 6
    assert stats.peak_device_bytes == 5 * eng.drafter_pool.block_nbytes
    assert stats.peak_host_bytes == 2 * 5 * eng.drafter_pool.block_nbytes  # two third-turn entries
    assert stats.demotions == 8 and stats.refusals == {"not_admitted": 0, "too_large": 0, "oom": 0}


def test_without_a_host_tier_the_same_turns_miss_for_memory(model):
    eng = engine(model)
    eng.runtime = CarryRuntime(eng, eng.config.policy, slots=None, memory=4 * eng.drafter_pool.block_nbytes,
                               eviction="lrd", host_memory=0, share=False)
    gen = torch.Generator().manual_seed(22)
    prompts = {s: random_prompt(gen, 40) for s in "abc"}
    for s in "abc":
        eng.generate(s, prompts[s], max_new_tokens=6)
    stats = eng.runtime.stats()
    assert stats.evictions == zeros(memory=2) and stats.carry_host_memory_bytes == 0
    assert (stats.demotions, stats.hits_host, stats.peak_host_bytes) == (0, 0, 0)


def test_pool_pressure_demotes_its_victim_and_the_victims_next_turn_adopts_from_host(model):
    # 45 rows a turn: 3 blocks of 16; 7 blocks hold two carried turns and one live one
    eng = with_host(engine(model, num_drafter_blocks=7), blocks=7)
    gen = torch.Generator().manual_seed(9)
    first = {s: eng.generate(s, random_prompt(gen, 40), max_new_tokens=6) for s in ("a", "b")}
    a = session_hash("a")
    k, v, keys = (t.clone() for t in eng.drafter_pool.gather_carried(a))
    c = eng.generate("c", random_prompt(gen, 40), max_new_tokens=6)
    assert c.stats.drafted > 0 and c.stats.outcome_kind == "no_carry"
    assert eng.drafter_pool.stats().evictions_for_pressure == 1
    assert [e.session_hash for e in eng.runtime.service.store.host_entries] == [a]
    assert eng.runtime.stats().evictions == zeros()
    check_all(eng)
    a2_prompt = first["a"].prompt + first["a"].output + random_prompt(gen, 4)
    a2 = eng.generate("a", a2_prompt, max_new_tokens=6)
    assert a2.stats.outcome_kind == "adopted" and a2.stats.drafter_rows_kept == k.shape[0]
    assert a2.output == greedy_oracle(model, a2_prompt, 6)
    stats = eng.runtime.stats()
    assert (stats.hits_host, stats.demotions) == (1, 2)  # a's copy back pressed b, the oldest, out to host
    assert [e.session_hash for e in eng.runtime.service.store.host_entries] == [session_hash("b")]
    assert stats.evictions == zeros() and eng.drafter_pool.stats().evictions_for_pressure == 2
    check_all(eng)
    # a's deposited rows start with exactly the rows it had before its trip to host memory
    k2, v2, keys2 = eng.drafter_pool.gather_carried(a)
    assert torch.equal(k2[: k.shape[0]], k) and torch.equal(v2[: k.shape[0]], v)
    assert torch.equal(keys2[: k.shape[0]], keys)


def test_the_host_budget_evicts_host_entries_with_their_cause_and_frees_their_copies(model):
    eng = engine(model)
    nb = eng.drafter_pool.block_nbytes
    eng = with_host(eng, blocks=3, host_memory=3 * nb)  # one entry on the device, one in host memory
    gen = torch.Generator().manual_seed(23)
    for s in ("a", "b", "c"):
        eng.generate(s, random_prompt(gen, 40), max_new_tokens=6)
        check_all(eng)
    assert [e.session_hash for e in eng.runtime.service.store.host_entries] == [session_hash("b")]
    stats = eng.runtime.stats()
    assert stats.evictions == zeros(memory=1) and stats.demotions == 2
    assert eng.runtime.service.host.keys() == [session_hash("b")]
    b_rows = next(e.rows for e in eng.runtime.service.store.host_entries)
    assert eng.runtime.forget_session(session_hash("b")) == b_rows  # its rows were in host memory only
    assert eng.runtime.service.host.keys() == [] and eng.runtime.stats().evictions == zeros(memory=1, session_end=1)
    eng.runtime.clear_slot()
    assert eng.drafter_pool.num_free_blocks == eng.drafter_pool.num_blocks
    check_all(eng)


def test_export_and_import_of_a_carried_entry_round_trip_its_blocks(model):
    eng = engine(model)
    eng.runtime = CarryRuntime(eng, eng.config.policy, slots=4, share=False)
    gen = torch.Generator().manual_seed(24)
    eng.generate("a", random_prompt(gen, 40), max_new_tokens=6)
    pool, a = eng.drafter_pool, session_hash("a")
    before = [t.clone() for t in pool.gather_carried(a)]
    rows = pool.export_carried(a)
    assert isinstance(rows, HostRows) and rows.k.device.type == "cpu"
    assert rows.nbytes == len(pool.carried(a).block_table) * pool.block_nbytes
    pool.free_carried(a)
    pool.k_cache.fill_(7)  # whatever the blocks held since
    held = pool.import_carried(a, rows)
    assert held.rows == before[0].shape[0]
    assert all(torch.equal(x, y) for x, y in zip(pool.gather_carried(a), before, strict=True))
    with pytest.raises(RuntimeError, match="exists already"):
        pool.import_carried(a, rows)
    bad = HostRows(rows.k[:1], rows.v[:1], rows.rows, rows.runs)
    with pytest.raises(ValueError, match="do not fit"):
        pool.import_carried(a + 1, bad)
    pool.check()


def test_a_malformed_host_memory_is_one_error_naming_it(model):
    eng = engine(model)
    with pytest.raises(ValueError, match="host_memory='0.5'"):
        CarryRuntime(eng, eng.config.policy, host_memory="0.5")


def test_a_newcomer_the_device_budget_refuses_waits_in_host_memory_and_adopts_from_there(model):
    eng = with_host(engine(model), blocks=3, eviction="incumbent")  # one 45-row entry on the device
    gen = torch.Generator().manual_seed(25)
    eng.generate("a", random_prompt(gen, 40), max_new_tokens=6)
    b1 = eng.generate("b", random_prompt(gen, 40), max_new_tokens=6)  # incumbent a keeps the device
    b = session_hash("b")
    assert [e.session_hash for e in eng.runtime.service.store.host_entries] == [b]
    stats = eng.runtime.stats()
    assert stats.refusals == {"not_admitted": 1, "too_large": 0, "oom": 0} and stats.host_deposits == 1
    assert stats.deposits == 2 and eng.drafter_pool.carried_keys() == (session_hash("a"),)
    check_all(eng)
    b2_prompt = b1.prompt + b1.output + random_prompt(gen, 4)
    b2 = eng.generate("b", b2_prompt, max_new_tokens=6)
    assert b2.stats.outcome_kind == "adopted" and b2.output == greedy_oracle(model, b2_prompt, 6)
    assert eng.runtime.stats().hits_host == 1
    check_all(eng)
