"""The adapter's carried rows with the service's host tier: entries leaving the device arena wait
in host memory and come back bit for bit; on the stand-in executor outputs and acceptance
equal a roomy store's while every warm turn adopts from host memory (no TensorRT-LLM is run)."""

from __future__ import annotations

import torch
from arena_carry import ArenaCarry
from standin_helpers import acceptance, make_llm, quote_sessions, run_turns

from trtllm_mtp_carry import EVICTION_CAUSES
from trtllm_mtp_carry.trtllm import attach
from trtllm_mtp_carry.trtllm.options import CarryOptions, TrtllmAdapterError, parse_carry_options


def zeros(**counts):
    return {cause: counts.get(cause, 0) for cause in EVICTION_CAUSES}


def rows_of(seed: int) -> torch.Tensor:
    return torch.randn(10, 2, 2, 4, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_an_entry_leaving_the_device_budget_waits_in_host_memory_and_comes_back_bit_for_bit():
    carried = ArenaCarry(None, budget_bytes=320, policy="lrd", host_budget_bytes=640)  # 320 bytes an entry
    assert carried.deposit(11, list(range(12)), rows_of(1))
    assert carried.deposit(12, list(range(12)), rows_of(2))  # 11 is demoted, not evicted
    stats = carried.stats()
    assert (stats.entries_held, stats.host_entries, stats.host_bytes_held) == (1, 1, 320)
    assert stats.evictions == zeros() and stats.demotions == 1 and stats.bytes_demoted == 320
    assert carried.service.host.keys() == [11] and 11 in carried.host_arena  # a range of the host arena
    carried.check()
    taken = carried.take(11)
    assert carried.get(11) is None and torch.equal(taken, rows_of(1))
    stats = carried.stats()
    assert (stats.hits_device, stats.hits_host) == (0, 1) and stats.bytes_restored == 320
    assert (stats.peak_device_bytes, stats.peak_host_bytes) == (320, 320)
    carried.check()


def test_host_entries_leave_with_their_cause_and_forget_counts_their_rows():
    carried = ArenaCarry(None, budget_bytes=320, policy="lrd", host_budget_bytes=320)
    for key in (11, 12, 13):
        assert carried.deposit(key, list(range(12)), rows_of(key), session=key)
    stats = carried.stats()
    assert stats.evictions == zeros(memory=1) and stats.host_entries == 1  # 11 left the host tier
    assert carried.get(11) is None and carried.get(12).rows == 10
    carried.check()
    assert carried.forget(12) == 10  # its rows were in host memory only
    assert carried.stats().evictions == zeros(memory=1, session_end=1)
    carried.clear()
    assert carried.stats().host_entries == 0 and carried.stats().entries_held == 0
    carried.check()


def test_without_a_host_tier_the_same_deposits_evict():
    carried = ArenaCarry(None, budget_bytes=320, policy="lrd", host_budget_bytes=0)
    for key in (11, 12):
        carried.deposit(key, list(range(12)), rows_of(key))
    stats = carried.stats()
    assert stats.evictions == zeros(memory=1) and stats.carry_host_memory_bytes == 0
    assert (stats.demotions, stats.host_entries) == (0, 0)


def test_the_mtp_carry_option_takes_a_host_memory_size():
    assert parse_carry_options({"carry_host_memory": "8GiB"}).carry_host_memory == 8 << 30
    assert parse_carry_options({"carry_host_memory": None}).carry_host_memory is None
    assert parse_carry_options(None) == CarryOptions(True, None, None, None)
    for bad, message in (("lots", "mtp_carry.carry_host_memory: 'lots' is not a size"),
                         (-1, "mtp_carry.carry_host_memory must be >= 0, got -1")):
        try:
            parse_carry_options({"carry_host_memory": bad})
        except TrtllmAdapterError as exc:
            assert str(exc).startswith(message)
        else:
            raise AssertionError(f"carry_host_memory={bad!r} was accepted")


def test_standin_sessions_under_one_slot_adopt_from_host_with_unchanged_outputs():
    sessions = quote_sessions(4)
    runs = {}
    for name, host in (("roomy", None), ("host", 64 << 20)):
        if host is None:
            llm, carry = make_llm("carry")
        else:  # one slot: each deposit pushes the previous entry out to host memory
            llm, _ = make_llm("blind")
            carry = attach(llm, {"carry_slots": 1, "carry_host_memory": host})  # one slot: the newest wins
        runs[name] = (run_turns(llm, sessions, 2, 48), carry)
        llm.executor.check()
    outputs = {n: {c: [r.output for r in t] for c, t in runs[n][0].items()} for n in runs}
    assert outputs["host"] == outputs["roomy"]
    assert acceptance(runs["host"][0]) == acceptance(runs["roomy"][0])
    stats = runs["host"][1].stats()
    assert stats.outcomes["adopted"] == 4
    assert (stats.hits_device, stats.hits_host) == (1, 3)  # the slot holds the last first turn's entry
    assert stats.demotions == 3 + 3 and stats.evictions == zeros()  # every turn but the last pushes one out
    runs["host"][1].manager.service.check()


def test_a_deposit_the_incumbents_refuse_waits_in_host_memory():
    carried = ArenaCarry(None, budget_bytes=320, policy="incumbent", host_budget_bytes=320)
    assert carried.deposit(11, list(range(12)), rows_of(1))
    assert carried.deposit(12, list(range(12)), rows_of(2))  # refused on the device, kept in host memory
    stats = carried.stats()
    assert stats.refusals == {"not_admitted": 1, "too_large": 0, "oom": 0} and stats.host_deposits == 1
    assert (stats.entries_held, stats.host_entries, stats.deposits) == (1, 1, 2)
    carried.check()
    assert torch.equal(carried.take(12), rows_of(2))
    assert carried.deposit(13, list(range(12)), rows_of(3))  # 12 is out: its host room is free again
    assert carried.deposit(14, list(range(12)), rows_of(4)) is False  # the host keeps its incumbent 13
    stats = carried.stats()
    assert (stats.host_entries, stats.host_deposits) == (1, 2) and carried.get(13) is not None
    carried.check()
