"""CarryStore at scale: a memory budget, the eviction policies, leases, idle expiry,
honest miss reasons and the salt's scope."""

import pytest
from store_helpers import Clock, deposit, keys, zeros

from trtllm_mtp_carry import (
    NO_CARRY_REASONS,
    CarriedDrafter,
    CarryOutcome,
    CarryStore,
    StoreRange,
    carry_key,
    session_hash,
)


def test_lrd_budget_evicts_oldest_as_memory_and_counts_bytes():
    store = CarryStore(budget_bytes=30, policy="lrd")
    for k in (1, 2, 3):
        assert deposit(store, k) == []
    assert (store.bytes_held, len(store)) == (30, 3)
    assert deposit(store, 4, nbytes=15) == [1, 2]  # two oldest make room for 15 bytes
    assert keys(store) == [3, 4] and store.bytes_held == 25
    assert store.evictions() == zeros(memory=2)
    assert store.miss_reason(1) == "memory" and store.miss_reason(9) == "never_carried"


def test_slot_cap_evicts_as_capacity_under_a_roomy_budget():
    store = CarryStore(2, budget_bytes=1000, policy="lrd")
    deposit(store, 1)
    deposit(store, 2)
    assert deposit(store, 3) == [1]
    assert store.evictions() == zeros(capacity=1) and store.miss_reason(1) == "capacity"


def test_a_deposit_larger_than_the_budget_is_refused_as_too_large():
    store = CarryStore(budget_bytes=30, policy="lrd")
    deposit(store, 1)
    assert store.admit(2, 31) is None
    assert keys(store) == [1] and store.refusals() == {"not_admitted": 0, "too_large": 1, "oom": 0}
    assert store.miss_reason(2) == "too_large"


def test_an_admitted_deposit_the_executor_cannot_hold_is_refused_as_oom_and_its_lease_dropped():
    store = CarryStore(budget_bytes=30, policy="lrd")
    deposit(store, 1)
    deposit(store, 2)
    store.take(1)  # key 1's turn holds a lease
    assert store.leases == 1
    assert [e.session_hash for e in store.admit(1, 25)] == [2]  # admitted: key 2 made room
    store.refuse(1)  # the executor's allocation failed instead of `put`
    assert keys(store) == [] and store.leases == 0 and store.bytes_held == 0
    assert store.refusals() == {"not_admitted": 0, "too_large": 0, "oom": 1}
    assert store.miss_reason(1) == "oom" and store.miss_reason(2) == "memory"
    with pytest.raises(TypeError, match=r"key must be an int in \[0, 2\*\*64\), got 'a'"):
        store.refuse("a")  # type: ignore[arg-type]


def test_incumbent_refuses_newcomers_and_a_returning_key_evicts_the_newest():
    store = CarryStore(budget_bytes=30, policy="incumbent")
    deposit(store, 1)
    deposit(store, 2)
    deposit(store, 3)
    assert deposit(store, 4) is None  # full of incumbents: the newcomer is refused, nothing evicted
    assert keys(store) == [1, 2, 3] and store.miss_reason(4) == "not_admitted"
    store.take(1)  # a turn of key 1 holds its rows; their room is free meanwhile
    assert store.miss_reason(1) == "in_use" and store.leases == 1
    assert deposit(store, 4) == []  # a newcomer may use it
    assert deposit(store, 1, nbytes=15) == [4, 3]  # key 1 comes back larger: newest entries give way
    assert keys(store) == [2, 1] and store.bytes_held == 25
    assert store.evictions() == zeros(memory=2)
    assert store.refusals() == {"not_admitted": 1, "too_large": 0, "oom": 0}
    assert store.miss_reason(4) == "memory"


def test_incumbent_pool_pressure_victim_is_the_newest_entry():
    store = CarryStore(policy="incumbent")
    for k in (1, 2, 3):
        deposit(store, k)
    assert store.victim() == 3
    assert CarryStore(policy="lrd", budget_bytes=None).victim() is None


def test_slru_evicts_never_adopted_entries_before_adopted_ones():
    store = CarryStore(budget_bytes=30, policy="slru")
    deposit(store, 1)
    store.take(1)
    deposit(store, 1)  # adopted once: protected
    deposit(store, 2)
    deposit(store, 3)
    assert keys(store) == [1, 2, 3] and store.victim() == 2
    assert deposit(store, 4) == [2]
    assert deposit(store, 5, nbytes=20) == [3, 4]
    assert deposit(store, 6, nbytes=30) == [5, 1]  # protected goes last


def test_end_lease_remembers_why_the_rows_did_not_come_back():
    store = CarryStore(policy="incumbent", budget_bytes=10)
    deposit(store, 1)
    store.take(1)
    assert store.end_lease(1, "pool_pressure") and not store.end_lease(1)
    assert store.miss_reason(1) == "pool_pressure" and store.leases == 0
    assert deposit(store, 2) == []  # the reservation is gone


def test_idle_entries_and_leases_expire():
    clock = Clock()
    store = CarryStore(policy="lrd", idle_s=60, clock=clock)
    deposit(store, 1)
    clock.now += 30
    deposit(store, 2)
    deposit(store, 3)
    store.take(3)
    clock.now += 31
    assert [e.session_hash for e in store.expire()] == [1]
    clock.now += 30
    assert [e.session_hash for e in store.expire()] == [2]
    assert store.miss_reason(1) == store.miss_reason(3) == "idle" and store.leases == 0
    assert store.evictions() == zeros(idle=2)


def test_judge_names_the_miss_and_the_seeds_slot_still_says_foreign():
    store = CarryStore(budget_bytes=10, policy="lrd")
    deposit(store, 1)
    deposit(store, 2)
    prompt = list(range(100, 110))
    assert store.judge(1, prompt, 7, StoreRange.EMPTY) == CarryOutcome.NoCarry("memory")
    assert store.judge(5, prompt, 7, StoreRange.EMPTY) == CarryOutcome.NoCarry("never_carried")
    assert store.judge(2, prompt[:4], 7, StoreRange.EMPTY) == CarryOutcome.Adopted(3, 0, 3)
    seed = CarryStore(1)
    deposit(seed, 1)
    assert seed.judge(2, prompt, 7, StoreRange.EMPTY) == CarryOutcome.ForeignSession(1, 2)


def test_a_new_salt_starts_fresh_and_session_end_drops_every_salt():
    s = session_hash("conversation-1")
    a, b = carry_key(s, "tenant-a"), carry_key(s, b"tenant-b")
    assert carry_key(s) == s and len({s, a, b}) == 3 and carry_key(s, "x") == carry_key(s, b"x")
    assert carry_key(0, "x") == 0
    store = CarryStore(policy="lrd")
    deposit(store, a, session=s)
    assert store.miss_reason(b, session=s) == "new_salt"
    assert store.judge(b, list(range(100, 110)), 7, StoreRange.EMPTY, session=s) == \
        CarryOutcome.NoCarry("new_salt")
    deposit(store, b, session=s)
    deposit(store, s)
    assert [e.session_hash for e in store.evict_session(s)] == [a, b, s]
    assert len(store) == 0 and store.miss_reason(a) == "session_end"


def test_carry_key_refuses_a_bad_salt_or_session():
    with pytest.raises(ValueError, match="cache_salt must be non-empty"):
        carry_key(5, "")
    with pytest.raises(TypeError, match="cache_salt must be a str, bytes or None, got 3"):
        carry_key(5, 3)
    with pytest.raises(TypeError, match="session must be a session hash"):
        carry_key(-1, "x")


def test_no_carry_reasons_are_checked():
    assert NO_CARRY_REASONS[0] == "never_carried"
    with pytest.raises(ValueError, match="NoCarry reason must be one of"):
        CarryOutcome.NoCarry("bored")


def test_policy_and_bounds_are_checked():
    with pytest.raises(ValueError, match="policy='mru' is not an eviction policy"):
        CarryStore(policy="mru")
    with pytest.raises(ValueError, match="budget_bytes must be non-negative"):
        CarryStore(budget_bytes=-1)
    with pytest.raises(ValueError, match="idle_s must be a positive number"):
        CarryStore(idle_s=0)


# ---- charged by block: entries sharing common-prefix blocks ------------------------------


def block_entry(key, blocks):
    rows = 4 * len(blocks)
    return CarriedDrafter(tuple(blocks), rows, rows - 1, list(range(rows + 1)), key)


def deposit_blocks(store, key, blocks):
    evicted = store.admit(key, session=None, blocks=blocks)
    if evicted is None:
        return None
    store.put(block_entry(key, blocks))
    return [e.session_hash for e in evicted]


def test_a_block_two_entries_share_is_charged_once():
    store = CarryStore(budget_bytes=100, policy="lrd", block_nbytes=10)
    assert deposit_blocks(store, 1, [0, 1, 2]) == []
    assert deposit_blocks(store, 2, [0, 1, 3]) == []
    assert (store.bytes_held, store.blocks_held, store.shared_blocks) == (40, 4, 2)
    assert (store.nbytes(1), store.nbytes(2)) == (30, 30)  # each entry's whole footprint
    store.take(1)  # adopted: blocks 0 and 1 stay charged for entry 2
    assert (store.bytes_held, store.blocks_held, store.shared_blocks) == (30, 3, 0)


def test_taking_one_of_three_sharers_leaves_each_shared_block_held_by_the_other_two():
    store = CarryStore(budget_bytes=100, policy="lrd", block_nbytes=10)
    deposit_blocks(store, 1, [0, 1, 2])
    deposit_blocks(store, 2, [0, 1, 3])
    deposit_blocks(store, 3, [0, 4])
    assert (store.bytes_held, store.blocks_held, store.shared_blocks) == (50, 5, 2)
    store.take(1)  # block 0: three holders -> two; block 1: two -> one; block 2 leaves
    assert (store.bytes_held, store.blocks_held, store.shared_blocks) == (40, 4, 1)
    store.take(3)  # block 0: two -> one; block 4 leaves
    assert (store.bytes_held, store.blocks_held, store.shared_blocks) == (30, 3, 0)
    store.take(2)
    assert (store.bytes_held, store.blocks_held, store.shared_blocks) == (0, 0, 0)


def test_evicting_a_sharer_frees_only_the_blocks_no_other_entry_nor_the_deposit_holds():
    store = CarryStore(budget_bytes=40, policy="lrd", block_nbytes=10)
    deposit_blocks(store, 1, [0, 1, 2])
    deposit_blocks(store, 2, [0, 1, 3])  # 40 bytes: full
    # entry 3 shares blocks 0 and 1 and brings block 4: evicting entry 1 frees block 2 only,
    # which makes exactly the room block 4 needs; entry 2 stays
    assert deposit_blocks(store, 3, [0, 1, 4]) == [1]
    assert keys(store) == [2, 3] and store.bytes_held == 40
    assert store.evictions() == zeros(memory=1)
    # a deposit of blocks every entry already holds costs nothing
    assert deposit_blocks(store, 4, [0, 1]) == [] and store.bytes_held == 40


def test_charged_by_block_the_incumbent_admits_a_newcomer_whose_new_blocks_fit():
    store = CarryStore(budget_bytes=40, policy="incumbent", block_nbytes=10)
    deposit_blocks(store, 1, [0, 1, 2, 3])
    assert deposit_blocks(store, 2, [0, 1, 2, 3]) == []  # all shared: nothing new to charge
    assert deposit_blocks(store, 3, [0, 1, 2, 5]) is None  # block 5 does not fit
    assert store.miss_reason(3) == "not_admitted"
    assert deposit_blocks(store, 4, list(range(10, 15))) is None  # 50 bytes alone: too large
    assert store.refusals() == {"not_admitted": 1, "too_large": 1, "oom": 0}


def test_a_store_charged_by_block_needs_the_deposits_blocks():
    store = CarryStore(budget_bytes=40, block_nbytes=10)
    with pytest.raises(ValueError, match="needs the deposit's blocks"):
        store.admit(1, 10)
    with pytest.raises(ValueError, match="block_nbytes must be an int >= 1 or None, got 0"):
        CarryStore(block_nbytes=0)
