"""CarryStore's host tier: entries leaving the device budget for room or pool pressure are
demoted, obey their own budget and the policy's victim order, come back on take, and every
move and leave is counted per tier."""

import pytest
from store_helpers import Clock, deposit, entry, keys, zeros

from trtllm_mtp_carry import (
    CarriedDrafter,
    CarryStore,
    StoreRange,
)
from trtllm_mtp_carry.core.outcome import Adopted


def host_keys(store):
    return [e.session_hash for e in store.host_entries]


class Moves:
    """Records the executor calls; `restore` returns the entry with a new block table."""

    def __init__(self, fail_restore=False):
        self.calls = []
        self.fail_restore = fail_restore
        self.gone = set()  # keys whose rows the executor no longer holds

    def demote(self, e):
        self.calls.append(("demote", e.session_hash))
        return e.session_hash not in self.gone

    def restore(self, e):
        self.calls.append(("restore", e.session_hash))
        if self.fail_restore:
            raise RuntimeError("pool exhausted")
        return CarriedDrafter((7,), e.rows, e.last_pair_key, e.tokens, e.session_hash)

    def drop(self, e):
        self.calls.append(("drop", e.session_hash))


def test_without_a_host_tier_memory_evictions_are_unchanged_and_tier_counters_stay_zero():
    store = CarryStore(budget_bytes=30, policy="lrd")
    for k in (1, 2, 3):
        deposit(store, k)
    assert deposit(store, 4, nbytes=15) == [1, 2]
    assert store.evictions() == zeros(memory=2) and store.host_entries == ()
    t = store.tier_stats()
    assert (t.host_budget_bytes, t.demotions, t.host_entries, t.host_bytes_held) == (0, 0, 0, 0)
    assert t.hits == {"device": 0, "host": 0} and t.peak_bytes == {"device": 30, "host": 0}
    store.take(3)
    assert store.tier_stats().hits == {"device": 1, "host": 0}


def test_a_memory_victim_is_demoted_not_evicted_and_the_executor_moves_its_rows():
    store = CarryStore(budget_bytes=30, policy="lrd", host_budget_bytes=20)
    store.host_moves = moves = Moves()
    for k in (1, 2, 3):
        deposit(store, k)
    assert deposit(store, 4) == []  # key 1 left the device budget, not the store
    assert keys(store) == [2, 3, 4] and host_keys(store) == [1]
    assert moves.calls == [("demote", 1)]
    assert store.tier(1) == "host" and store.tier(4) == "device" and store.tier(9) is None
    assert 1 in store and store.get(1).session_hash == 1 and store.nbytes(1) == 10
    assert store.evictions() == zeros() and (store.bytes_held, store.host_bytes_held) == (30, 10)
    t = store.tier_stats()
    assert (t.demotions, t.bytes_demoted, t.host_entries, t.host_bytes_held) == (1, 10, 1, 10)
    assert t.peak_bytes == {"device": 30, "host": 10}


def test_a_host_entry_is_judged_adopted_and_taken_back_through_restore():
    store = CarryStore(budget_bytes=20, policy="lrd", host_budget_bytes=20)
    store.host_moves = moves = Moves()
    deposit(store, 1)
    deposit(store, 2)
    deposit(store, 3)
    prompt = list(range(100, 104)) + [1, 2, 3]
    outcome = store.judge(1, prompt, 5, StoreRange(5, 4, 7))
    assert isinstance(outcome, Adopted) and outcome.rows == 3
    taken = store.take(1)
    assert taken.block_table == (7,) and taken.session_hash == 1  # the restored entry
    assert moves.calls == [("demote", 1), ("restore", 1)]
    assert store.tier(1) is None and store.leases == 1 and store.adoptions == 1
    t = store.tier_stats()
    assert t.hits == {"device": 0, "host": 1} and (t.bytes_restored, t.host_bytes_held) == (10, 0)
    assert store.miss_reason(1) == "in_use"


def test_the_host_budget_evicts_its_own_entries_in_the_policys_victim_order():
    store = CarryStore(budget_bytes=10, policy="lrd", host_budget_bytes=20)
    store.host_moves = moves = Moves()
    for k in (1, 2, 3):
        deposit(store, k)
    assert host_keys(store) == [1, 2]
    assert deposit(store, 4) == []  # 3 is demoted; the host's oldest (1) leaves the store
    assert host_keys(store) == [2, 3] and keys(store) == [4]
    assert store.evictions() == zeros(memory=1) and store.miss_reason(1) == "memory"
    assert store.tier_stats().host_evictions == zeros(memory=1)
    assert moves.calls[-2:] == [("demote", 3), ("drop", 1)]
    assert store.get(1) is None


def test_slru_host_tier_evicts_never_adopted_entries_before_protected_ones():
    store = CarryStore(budget_bytes=10, policy="slru", host_budget_bytes=20)
    deposit(store, 1)
    store.take(1)
    deposit(store, 1)  # adopted once: protected
    deposit(store, 2)  # 1 demoted
    deposit(store, 3)  # 2 demoted
    assert host_keys(store) == [1, 2]
    deposit(store, 4)  # 3 demoted: the never-adopted 2 leaves first
    assert host_keys(store) == [1, 3]


def test_incumbent_host_tier_keeps_its_incumbents_and_evicts_the_demoted_newcomer():
    store = CarryStore(budget_bytes=20, policy="incumbent", host_budget_bytes=10)
    store.host_moves = moves = Moves()
    for k in (1, 2):
        deposit(store, k)
    store.take(1)
    deposit(store, 3)  # into 1's room
    assert deposit(store, 1) == []  # returning: the newest (3) makes room, demoted
    assert host_keys(store) == [3]
    store.take(2)
    deposit(store, 4)
    assert deposit(store, 2) == [4]  # the host is full of incumbents: 4 is evicted, not demoted
    assert host_keys(store) == [3] and store.evictions() == zeros(memory=1)
    t = store.tier_stats()
    assert (t.demotions, t.demotions_refused) == (1, 1)
    assert ("demote", 4) not in moves.calls


def test_an_entry_larger_than_the_host_budget_is_evicted_and_returned_to_free():
    store = CarryStore(budget_bytes=30, policy="lrd", host_budget_bytes=5)
    deposit(store, 1)
    deposit(store, 2)
    deposit(store, 3)
    assert deposit(store, 4) == [1]
    assert host_keys(store) == [] and store.tier_stats().demotions_refused == 1


def test_a_slot_cap_victim_is_demoted_as_capacity_room():
    store = CarryStore(2, budget_bytes=1000, policy="lrd", host_budget_bytes=100)
    deposit(store, 1)
    deposit(store, 2)
    assert deposit(store, 3) == [] and host_keys(store) == [1] and keys(store) == [2, 3]


def test_pool_pressure_demotes_and_evict_returns_none():
    store = CarryStore(budget_bytes=100, policy="lrd", host_budget_bytes=100)
    store.host_moves = moves = Moves()
    deposit(store, 1)
    deposit(store, 2)
    assert store.victim() == 1
    assert store.evict(1, "pool_pressure") is None
    assert host_keys(store) == [1] and keys(store) == [2] and moves.calls == [("demote", 1)]
    assert store.victim() == 2  # the victim order is the device tier's
    assert store.evictions() == zeros()
    # a session end is no demotion: the entry leaves with its rows
    assert store.evict(2, "session_end").session_hash == 2


def test_a_host_entry_leaves_by_eviction_with_its_cause_and_its_copy_dropped():
    clock = Clock()
    store = CarryStore(budget_bytes=10, policy="lrd", idle_s=60, clock=clock, host_budget_bytes=100)
    store.host_moves = moves = Moves()
    deposit(store, 1, session=50)
    clock.now += 30
    deposit(store, 2, session=60)
    clock.now += 30
    deposit(store, 3, session=70)
    assert host_keys(store) == [1, 2]
    assert store.expire() == []  # 1 expired in the host tier: no device rows to free
    assert host_keys(store) == [2] and store.miss_reason(1) == "idle"
    assert store.evict_session(60) == [] and store.miss_reason(2) == "session_end"
    deposit(store, 4)
    assert host_keys(store) == [3]
    assert [e.session_hash for e in store.clear()] == [4]
    assert host_keys(store) == [] and store.host_bytes_held == 0
    assert store.evictions() == zeros(idle=1, session_end=1, cleared=2)
    assert store.tier_stats().host_evictions == zeros(idle=1, session_end=1, cleared=1)
    assert [c for c in moves.calls if c[0] == "drop"] == [("drop", 1), ("drop", 2), ("drop", 3)]


def test_a_host_entry_is_replaced_by_its_own_keys_new_deposit():
    store = CarryStore(budget_bytes=10, policy="incumbent", host_budget_bytes=100)
    deposit(store, 1)
    store.take(1)
    deposit(store, 2)
    deposit(store, 1)  # returning: 2 demoted
    assert host_keys(store) == [2]
    assert deposit(store, 2) == []  # 2 returns while its entry waits in the host tier: 1 is demoted
    assert store.tier(2) == "device" and host_keys(store) == [1]
    assert store.evictions() == zeros(replaced=1)


def test_a_failed_restore_drops_the_entry_as_pool_pressure_and_reraises():
    store = CarryStore(budget_bytes=10, policy="lrd", host_budget_bytes=100)
    store.host_moves = moves = Moves(fail_restore=True)
    deposit(store, 1)
    deposit(store, 2)
    with pytest.raises(RuntimeError, match="pool exhausted"):
        store.take(1)
    assert store.get(1) is None and store.leases == 0 and store.miss_reason(1) == "pool_pressure"
    assert store.evictions() == zeros(pool_pressure=1) and moves.calls[-1] == ("drop", 1)


def test_charged_by_block_the_host_copy_costs_every_block_even_shared_ones():
    store = CarryStore(budget_bytes=3 * 8, policy="lrd", block_nbytes=8, host_budget_bytes=100)
    store.admit(1, blocks=[0, 1])
    store.put(entry(1, rows=3, blocks=(0, 1)))
    store.admit(2, blocks=[0, 2])
    store.put(entry(2, rows=3, blocks=(0, 2)))  # block 0 shared: 3 distinct blocks held
    assert store.bytes_held == 24
    assert store.admit(3, blocks=[3]) == []  # 1 leaves: frees block 1 only
    store.put(entry(3, rows=3, blocks=(3,)))
    assert host_keys(store) == [1] and store.host_bytes_held == 16 and store.bytes_held == 24
    assert store.blocks_held == 3


def test_host_budget_must_be_a_non_negative_int():
    for bad in (-1, 1.5, "1GiB", True):
        with pytest.raises(ValueError, match="host_budget_bytes"):
            CarryStore(budget_bytes=10, host_budget_bytes=bad)


def test_a_demotion_whose_rows_are_gone_is_a_plain_eviction_that_keeps_the_host_tier():
    store = CarryStore(budget_bytes=100, policy="lrd", host_budget_bytes=10)
    store.host_moves = moves = Moves()
    deposit(store, 1)
    deposit(store, 2)
    store.evict(1, "pool_pressure")
    moves.gone.add(2)
    assert store.evict(2, "pool_pressure").session_hash == 2  # nothing to copy: evicted
    assert host_keys(store) == [1] and store.evictions() == zeros(pool_pressure=1)
    assert store.tier_stats().demotions == 1


def test_an_entry_moved_to_other_blocks_keeps_its_rows_keys_and_tokens():
    e = entry(5, rows=3, blocks=(0, 1))
    moved = e.with_block_table([7, 8])
    assert moved.block_table == (7, 8) and moved == CarriedDrafter((7, 8), 3, 2, e.tokens, 5)
    assert moved.tokens is e.tokens and moved.token_buffer is e.token_buffer and e.block_table == (0, 1)


def test_a_newcomer_the_device_refuses_goes_straight_to_the_host_tier_and_is_adopted_from_there():
    store = CarryStore(budget_bytes=20, policy="incumbent", host_budget_bytes=20)
    store.host_moves = moves = Moves()
    deposit(store, 1)
    deposit(store, 2)
    assert store.admit(3, 10) is None and store.miss_reason(3) == "not_admitted"
    assert store.deposit_host(entry(3), 10, session=30)
    assert moves.calls == [("demote", 3)] and host_keys(store) == [3] and keys(store) == [1, 2]
    assert store.tier(3) == "host" and store.deposits == 3
    assert store.refusals() == {"not_admitted": 1, "too_large": 0, "oom": 0}  # the device's refusal stays counted
    t = store.tier_stats()
    assert (t.host_deposits, t.demotions, t.bytes_demoted, t.host_bytes_held) == (1, 0, 10, 10)
    prompt = list(range(100, 104)) + [1, 2, 3]
    assert isinstance(store.judge(3, prompt, 5, StoreRange(5, 4, 7)), Adopted)
    store.take(3)
    assert store.tier_stats().hits == {"device": 0, "host": 1}
    assert not store.deposit_host(entry(1), 10)  # key 1 holds an entry already
    assert store.admit(4, 30) is None and not store.deposit_host(entry(4), 30)  # larger than the host
    for k in (5, 6):
        assert deposit(store, k) is None and store.deposit_host(entry(k), 10)
    assert host_keys(store) == [5, 6]
    assert store.admit(7, 10) is None and not store.deposit_host(entry(7), 10)  # incumbents kept
    assert host_keys(store) == [5, 6] and store.evictions() == zeros()


def test_without_a_host_tier_deposit_host_changes_nothing():
    store = CarryStore(budget_bytes=10, policy="incumbent")
    deposit(store, 1)
    assert store.admit(2, 10) is None and not store.deposit_host(entry(2), 10)
    assert store.miss_reason(2) == "not_admitted" and store.deposits == 1
