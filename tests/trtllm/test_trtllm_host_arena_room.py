"""The adapter's host tier is one arena of exactly the host budget, so a demotion into a full host
tier takes its victims' ranges: the store names them first (`make_room`) and drops them after the
copy. A full arena that refused the copy would make the store evict the entry instead, and the
host tier would keep its oldest entries for good."""

from __future__ import annotations

import pytest
import torch
from arena_carry import ArenaCarry

ROW = 2 * 2 * 8 * 2  # one [2, Hkv=2, D=8] bf16 row: 64 bytes
N = 4  # rows an entry


def carried(entries: int = 1) -> ArenaCarry:
    """Device and host arenas of `entries` entries each, budgets equal to them."""
    nbytes = entries * N * ROW
    return ArenaCarry(None, nbytes, "lrd", host_budget_bytes=nbytes, head_dim=8)


def rows_of(seed: int) -> torch.Tensor:
    return torch.randn(N, 2, 2, 8, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_a_demotion_into_a_full_host_arena_replaces_its_victim_and_comes_back_bit_for_bit():
    c = carried()
    for key in (1, 2, 3):
        assert c.deposit(key, list(range(N + 1)), rows_of(key))
    s = c.stats()
    assert (s.demotions, s.host_entries, s.entries_held) == (2, 1, 1)
    assert s.evictions["memory"] == 1 and s.refusals["oom"] == 0  # 1 left the host tier for 2
    assert c.service.host.keys() == [2] and c.host_arena.held_bytes == N * ROW == c.host_arena.capacity
    c.check()
    taken = c.take(2)  # from the host arena
    assert torch.equal(taken, rows_of(2))
    s = c.stats()
    assert (s.hits_device, s.hits_host) == (0, 1)


def test_host_entries_keep_rotating_through_a_full_host_arena():
    c = carried(entries=2)
    for key in range(1, 9):
        assert c.deposit(key, list(range(N + 1)), rows_of(key))
        c.check()
    s = c.stats()
    assert (s.demotions, s.host_entries, s.evictions["memory"]) == (6, 2, 4)
    for key in (5, 6):  # the two newest demoted: in the host arena, rows intact
        assert torch.equal(c.take(key), rows_of(key))


def test_a_copy_that_fails_after_its_victims_range_was_freed_loses_it_as_a_fault(monkeypatch):
    c = carried()
    for key in (1, 2):
        assert c.deposit(key, list(range(N + 1)), rows_of(key))

    def no_copy(key, raw):  # the copy into the victim's range fails (a device copy out of memory)
        raise torch.OutOfMemoryError("copy")

    monkeypatch.setattr(c.home, "export_into", no_copy)
    with pytest.raises(torch.OutOfMemoryError):  # the executor's fault recovery catches it and repairs
        c.deposit(3, list(range(N + 1)), rows_of(3))
    monkeypatch.undo()
    c.service.repair()
    s = c.stats()
    # 2 could not be copied: it stays on the device, where it was; 1's range was freed for it:
    # gone, counted a fault; 3's deposit was not kept
    assert (s.host_entries, s.entries_held, s.evictions["memory"], s.evictions["fault"]) == (0, 1, 0, 1)
    assert c.get(1) is None and c.get(2) is not None and c.get(3) is None
    assert c.host_arena.held_bytes == 0 and c.service.host.keys() == []
    c.check()  # the store holds exactly the rows held
    assert torch.equal(c.take(2), rows_of(2))


def test_on_the_stand_in_a_demotion_that_fails_in_the_deposits_plan_is_repaired(monkeypatch):
    """One slot, a host tier of one entry: `c`'s deposit demotes `b`, whose copy takes `a`'s host
    range and then fails. The fault is the turn's (`deposit`); the store and the host tier agree
    again at once (`a` lost as `fault`, `b` where it was), and `a`'s next turn is served."""
    from standin_helpers import CHUNK, make_llm, padded, user_tokens

    from trtllm_mtp_carry.trtllm import attach, session_key_for
    from trtllm_mtp_carry.trtllm.standin import ConversationParams

    llm, _ = make_llm("blind")
    rows = 4 * CHUNK + 16 - 1  # a first turn's rows
    carry = attach(llm, {"carry_slots": 1, "carry_memory": rows * 256, "carry_host_memory": rows * 256})
    service = carry.manager.service

    def run(conv: str, prompt: list[int]):
        req = llm.generate_async(prompt, 16, conversation_params=ConversationParams(conversation_id=conv))
        llm.run_until_done()
        return req

    a = run("a", user_tokens(0, 4 * CHUNK))
    run("b", user_tokens(300, 4 * CHUNK))  # a demoted: the host tier is full
    assert (service.store.tier(session_key_for("a")), service.store.tier(session_key_for("b"))) == ("host", "device")

    def no_copy(key, raw):
        raise RuntimeError("export")

    monkeypatch.setattr(service.home, "export_into", no_copy)
    c = run("c", user_tokens(600, 4 * CHUNK))
    monkeypatch.undo()
    stats = carry.stats()
    assert stats.fault_steps["deposit"] == 1 and carry.turn(c.py_request_id)["skipped"] == "fault"
    assert (stats.entries_held, stats.host_entries, stats.evictions["fault"]) == (1, 0, 1)
    assert service.store.tier(session_key_for("b")) == "device" and service.host.keys() == []
    service.check()
    a2 = run("a", padded(a.get_tokens(0), 3))
    record = carry.turn(a2.py_request_id)
    assert (record["outcome"], record["skipped"]) == ("foreign_session", None)  # b holds the one slot
    service.check()
    llm.executor.check()
