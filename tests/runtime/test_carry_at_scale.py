"""The carry at scale in a real engine: the salt scopes it, a cancel keeps it, memory bounds it,
idle entries expire, and every miss says why.

The tiny test model's drafter pool block is 16 rows x 1 KV head x 16 dims x 2 (K, V)
x 2 bytes = 1 KiB, so a 40-token first turn (45 rows, 3 blocks) costs 3 KiB.
"""

from __future__ import annotations

import pytest
import torch
from engine_factories import engine, greedy_oracle, random_prompt, tiny_model

from trtllm_mtp_carry import EVICTION_CAUSES, carry_key, session_hash
from trtllm_mtp_carry.runtime import CarryRuntime


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=21)


def zeros(**counts):
    return {cause: counts.get(cause, 0) for cause in EVICTION_CAUSES}


def next_prompt(result, gen, span=8):
    return result.prompt + result.output + random_prompt(gen, span)


def checked(eng, model, result):
    assert result.output == greedy_oracle(model, result.prompt, len(result.output))
    eng.check()
    eng.runtime.check()
    return result


def test_a_new_salt_starts_fresh_and_the_old_salt_still_adopts(model):
    eng = engine(model)
    eng.runtime = CarryRuntime(eng, "carry", slots=None, eviction="incumbent")
    gen = torch.Generator().manual_seed(1)
    a1 = checked(eng, model, eng.generate("s", random_prompt(gen, 40), 6, cache_salt="tenant-a"))
    b1 = checked(eng, model, eng.generate("s", next_prompt(a1, gen), 6, cache_salt="tenant-b"))
    assert (b1.stats.outcome_kind, b1.stats.no_carry_reason) == ("no_carry", "new_salt")
    a2 = checked(eng, model, eng.generate("s", next_prompt(a1, gen), 6, cache_salt=b"tenant-a"))
    assert a2.stats.outcome_kind == "adopted" and a2.stats.drafter_rows_kept == 45
    s = session_hash("s")
    assert {e.session_hash for e in eng.runtime.carried()} == {carry_key(s, "tenant-a"),
                                                               carry_key(s, "tenant-b")}
    rows = sum(e.rows for e in eng.runtime.carried())
    assert eng.runtime.forget_session(s) == rows  # the session ends under every salt
    assert eng.runtime.carried() == () and eng.runtime.stats().no_carry_reasons["new_salt"] == 1


def test_a_cancelled_warm_turn_keeps_the_sessions_rows(model):
    eng = engine(model)
    eng.runtime = CarryRuntime(eng, "carry", slots=None)
    gen = torch.Generator().manual_seed(2)
    t1 = checked(eng, model, eng.generate("s", random_prompt(gen, 40), 6))
    p2 = next_prompt(t1, gen)
    rid = eng.submit("s", p2, max_new_tokens=40)
    while not eng.output_so_far(rid):
        eng.step()
    for _ in range(3):
        eng.step()
    cancelled = eng.cancel(rid)
    assert cancelled.finish_reason == "cancelled" and cancelled.stats.outcome_kind == "adopted"
    eng.check()
    eng.runtime.check()
    (entry,) = eng.runtime.carried()
    assert entry.tokens == p2 + cancelled.output  # the prompt and the verified output so far
    retry = checked(eng, model, eng.generate("s", p2 + random_prompt(gen, 4), 6))  # the client retries
    assert retry.stats.outcome_kind == "adopted"
    assert retry.stats.drafter_rows_kept == len(p2) - 1  # every key of the cancelled prompt
    assert eng.runtime.stats().turns_cancelled_kept == 1


@pytest.mark.parametrize("eviction, b_reason, a_kind", [
    ("incumbent", "not_admitted", "adopted"),  # a keeps its place; b is refused
    ("lrd", None, "no_carry"),  # b evicts a for memory
])
def test_a_memory_budget_bounds_the_store_and_misses_name_their_reason(model, eviction, b_reason,
                                                                         a_kind):
    eng = engine(model)
    eng.runtime = CarryRuntime(eng, "carry", slots=None, memory="4KiB", eviction=eviction)
    gen = torch.Generator().manual_seed(3)
    a1 = checked(eng, model, eng.generate("a", random_prompt(gen, 40), 6))
    b1 = checked(eng, model, eng.generate("b", random_prompt(gen, 40), 6))
    stats = eng.runtime.stats()
    assert (stats.carry_memory_bytes, stats.bytes_held, stats.entries_held) == (4096, 3072, 1)
    a2 = checked(eng, model, eng.generate("a", next_prompt(a1, gen), 6))
    b2 = checked(eng, model, eng.generate("b", next_prompt(b1, gen), 6))
    assert a2.stats.outcome_kind == a_kind
    stats = eng.runtime.stats()
    if eviction == "incumbent":
        assert (b2.stats.no_carry_reason, stats.refusals["not_admitted"]) == (b_reason, 2)
        assert stats.evictions == zeros()
    else:
        assert (a2.stats.no_carry_reason, b2.stats.no_carry_reason) == ("memory", "memory")
        assert stats.evictions == zeros(memory=3)
    assert stats.outcomes["foreign_session"] == 0


def test_idle_entries_expire_and_the_miss_says_idle(model):
    now = [0.0]
    eng = engine(model)
    eng.runtime = CarryRuntime(eng, "carry", slots=None, idle_s=60, clock=lambda: now[0])
    gen = torch.Generator().manual_seed(4)
    t1 = checked(eng, model, eng.generate("s", random_prompt(gen, 40), 6))
    now[0] += 61
    t2 = checked(eng, model, eng.generate("s", next_prompt(t1, gen), 6))
    assert (t2.stats.outcome_kind, t2.stats.no_carry_reason) == ("no_carry", "idle")
    stats = eng.runtime.stats()
    assert stats.evictions == zeros(idle=1) and stats.idle_s == 60 and stats.entries_held == 1


def test_the_default_budget_is_the_whole_drafter_pool(model):
    eng = engine(model)
    rt = CarryRuntime(eng, "carry", slots=None)
    stats = rt.stats()
    assert stats.carry_memory_bytes == eng.drafter_pool.nbytes == 256 * 1024
    assert (stats.carry_slots, stats.eviction_policy, stats.idle_s) == (None, "returns", 600)


def test_no_slot_cap_is_none_in_the_stats_and_no_carry_slots_gauge_in_the_metrics(model):
    from trtllm_mtp_carry.metrics import CarryMetrics, MetricRegistry

    pages = {}
    for slots in (None, 3):
        registry = MetricRegistry()
        CarryMetrics(registry, "m", "0").refresh(CarryRuntime(engine(model), "carry", slots=slots).stats())
        pages[slots] = registry.exposition()
    assert 'mtp_carry_runtime{model="m",instance="0",field="carry_slots"} 3\n' in pages[3]
    assert 'field="carry_slots"' not in pages[None]  # no cap: no gauge (a gauge holds a number)


def test_incumbent_pool_pressure_takes_the_newest_entry_and_the_live_sequence_keeps_drafting(model):
    # 3 blocks a 40-token turn; 7 blocks hold two carried turns and one block more
    eng = engine(model, num_drafter_blocks=7)
    eng.runtime = CarryRuntime(eng, "carry", slots=None, eviction="incumbent")
    gen = torch.Generator().manual_seed(5)
    first = {s: checked(eng, model, eng.generate(s, random_prompt(gen, 40), 6)) for s in ("a", "b")}
    c = checked(eng, model, eng.generate("c", random_prompt(gen, 40), 6))
    assert c.stats.drafted > 0 and c.stats.drafter_rows_computed == 39  # c never lost its drafter
    assert [e.session_hash for e in eng.runtime.carried()] == [session_hash("a"), session_hash("c")]
    assert eng.runtime.stats().evictions == zeros(pool_pressure=1)
    b2 = checked(eng, model, eng.generate("b", next_prompt(first["b"], gen), 6))
    assert (b2.stats.outcome_kind, b2.stats.no_carry_reason) == ("no_carry", "pool_pressure")
