"""The `returns` policy: learned return chances by turn class and age, per byte (core/eviction.py)."""

from __future__ import annotations

import pytest
from store_helpers import Clock

from trtllm_mtp_carry import CarriedDrafter, CarryStore
from trtllm_mtp_carry.core.eviction import (
    BINS_PER_DOUBLING,
    PRIOR_WEIGHT,
    TURN_CLASSES,
    ReturnOdds,
    age_edges,
)
from trtllm_mtp_carry.core.settings import DEFAULT_CARRY_EVICTION, EVICTION_POLICIES


def entry(key: int) -> CarriedDrafter:
    return CarriedDrafter((), 0, None, (), key)


def deposit(store: CarryStore, key: int, nbytes: int) -> list[int] | None:
    evicted = store.admit(key, nbytes, key)
    if evicted is None:
        return None
    store.put(entry(key), nbytes, key)
    return [e.session_hash for e in evicted]


def test_returns_is_the_default_policy():
    assert DEFAULT_CARRY_EVICTION == "returns" == EVICTION_POLICIES[0]


def test_age_edges_are_four_a_doubling_up_to_the_horizon():
    assert BINS_PER_DOUBLING == 4
    assert age_edges(3.0) == [0.0, 1.0, 2 ** 0.25, 2 ** 0.5, 2 ** 0.75, 2.0, 2 ** 1.25, 2 ** 1.5, 3.0]
    assert age_edges(600.0)[-3:] == [2 ** 8.75, 2 ** 9, 600.0]  # the next, 2 ** 9.25 = 608.9, is past it


def test_prior_alone_gives_every_class_half_and_a_chance_flat_in_age():
    odds = ReturnOdds(600.0, 100)
    assert [odds.return_rate(c) for c in range(TURN_CLASSES)] == [0.5] * TURN_CLASSES
    assert odds.worth(0, 0.0, 10) == odds.worth(0, 500.0, 10) == 0.5 / 10
    assert odds.worth(0, 600.0, 10) == 0.0  # as old as the horizon: the TTL takes it anyway


def test_returns_and_stays_are_counted_by_turn_class_and_the_ghost_list_keeps_the_turn():
    odds = ReturnOdds(100.0, 100)
    assert odds.deposited(7, 0.0) == 0  # first turn of key 7
    odds.adopted(7, 30.0)  # came back after 30 s
    assert odds.deposited(7, 40.0) == 1  # second turn
    assert odds.deposited(8, 40.0) == 0
    odds.sweep(141.0)  # both pending deposits are past the 100 s horizon: stays
    assert odds.resolved == 3
    assert odds.turn_class(7) == 1 and odds.turn_class(8) == 0 and odds.turn_class(9) == 0
    w = odds._grow  # counts are weighted 1, w, w^2 in resolution order (lazy decay)
    prior = PRIOR_WEIGHT * w**3  # the prior weighs as much as the latest deposits do
    rate0 = (1 + prior / 2) / (1 + w * w + prior)  # class 0: one return, one stay, a coin flip
    first = (1 + prior * rate0) / (1 + w * w + prior)  # at age 0 the return is still ahead
    assert odds.return_rate(0) == pytest.approx(first)
    rate1 = prior * rate0 / (w + prior)  # class 1: one stay, backing off to class 0
    assert odds.return_rate(1) == pytest.approx(prior * rate1 / (w + prior))
    # the return at 30 s sits in age bin [16, 32): a class-0 entry 20 s old may still be it,
    # one 40 s old has only the stay and the class rate's pseudo-deposits ahead of it
    assert odds.worth(0, 20.0, 1) == pytest.approx(first)
    assert odds.worth(0, 40.0, 1) == pytest.approx(prior * rate0 / (w * w + prior))
    assert odds.worth(0, 40.0, 4) == pytest.approx(odds.worth(0, 40.0, 1) / 4)  # per unit of cost


def test_a_deposit_that_returns_after_the_horizon_is_a_stay():
    odds = ReturnOdds(100.0, 100)
    odds.deposited(7, 0.0)
    odds.deposited(7, 150.0)  # came back, but after the horizon (the sweep in deposited resolves it)
    prior = PRIOR_WEIGHT * odds._grow
    rate0 = (prior / 2) / (1 + prior)
    assert odds.return_rate(0) == pytest.approx(prior * rate0 / (1 + prior))


def test_ghost_list_and_pending_are_bounded():
    odds = ReturnOdds(100.0, 2)
    for k in (1, 2, 3):
        odds.deposited(k, 0.0)
        odds.deposited(k, 1.0)
    assert list(odds._turns) == [2, 3] and list(odds._pending) == [2, 3]
    assert odds.turn_class(1) == 0  # forgotten: a first turn again


def test_a_first_turn_is_refused_rather_than_pushing_out_a_conversation_that_returns():
    clock = Clock(0.0)
    store = CarryStore(None, 100, "returns", 600, clock)
    for t in range(20):  # key 1 comes back every 10 s; first turns of others never do
        clock.now = 10.0 * t
        if store.tier(1) is not None:
            store.take(1)
        deposit(store, 1, 60)
        clock.now += 1
        deposit(store, 1000 + t, 30)
    clock.now = 1000.0  # everything resolved (key 1 kept returning; first turns stayed)
    store.expire()
    assert len(store) == 0
    deposit(store, 1, 60)
    assert deposit(store, 5000, 30) == []  # fits beside it
    assert deposit(store, 5001, 30) is None  # would push out key 1 (worth more): refused
    assert store.miss_reason(5001) == "not_admitted"
    assert [e.session_hash for e in store.entries()] == [1, 5000]


def test_a_cyclic_workload_larger_than_the_store_keeps_a_fixed_set():
    """64 sessions round-robin over 16 slots, 3 turns: lrd evicts exactly the entry needed next
    (0 adopted); returns, like incumbent, keeps a set and adopts it every round (a second turn
    backs off to the first turns' chance, and near ties keep the incumbent)."""

    def run(policy: str) -> int:
        clock = Clock(0.0)
        store = CarryStore(16, None, policy, 600, clock)
        hits = 0
        inflight: list[tuple[int, int]] = []
        for t in range(3):
            for s in range(64):
                clock.now += 0.05
                key = s + 1
                if t and store.tier(key) is not None:
                    store.take(key)
                    hits += 1
                inflight.append((key, 1000 + 100 * t))
                if len(inflight) >= 32:  # 32 in flight: a turn deposits 32 arrivals later
                    k, n = inflight.pop(0)
                    deposit(store, k, n)
        return hits

    assert run("lrd") == 0
    assert run("incumbent") == 61
    assert run("returns") == 61


def test_pool_pressure_victims_are_the_lowest_worth_first():
    clock = Clock(0.0)
    store = CarryStore(None, None, "returns", 600, clock)
    for key, nbytes in ((1, 10), (2, 40), (3, 20)):  # no returns seen: equal chance, so by size
        deposit(store, key, nbytes)
    assert store.victims() == (2, 3, 1)
    assert store.victim() == 2


def test_equal_worth_evicts_the_newest_first():
    clock = Clock(0.0)
    store = CarryStore(None, None, "returns", 600, clock)
    for key in (1, 2, 3):
        deposit(store, key, 10)
    assert store.victims() == (3, 2, 1)


def test_the_host_tier_ranks_by_what_the_device_tier_learned():
    clock = Clock(0.0)
    store = CarryStore(None, 10, "returns", 600, clock, host_budget_bytes=20)
    assert store._host is not None and store._host.name == "host"  # one estimate ranks both tiers (`_victims`)
    assert deposit(store, 1, 10) == []
    assert deposit(store, 2, 10) is None  # a tie keeps the incumbent on the device
    assert store.deposit_host(entry(2), 10, 2)  # the refused newcomer's second chance
    assert store.tier(1) == "device" and store.tier(2) == "host"
    assert deposit(store, 3, 4) == []  # 2.5x the worth of 1 (per byte): 1 is demoted, not lost
    assert store.tier(1) == "host" and store.tier(3) == "device"


def test_a_later_class_with_no_turns_seen_backs_off_to_the_class_below():
    odds = ReturnOdds(100.0, 100)
    for k in range(4):  # first turns: three come back after 10 s, one stays
        odds.deposited(k, 0.0)
    for k in range(3):
        odds.adopted(k, 10.0)
    odds.sweep(101.0)
    w = odds._grow
    returned, stayed, prior = 1 + w + w * w, w**3, PRIOR_WEIGHT * w**4
    rate0 = (returned + prior / 2) / (returned + stayed + prior)  # first turns' rate: 3 of 4
    assert odds.return_rate(0) == pytest.approx((returned + prior * rate0) / (returned + stayed + prior))
    assert [odds.return_rate(c) for c in range(1, TURN_CLASSES)] == pytest.approx([rate0] * (TURN_CLASSES - 1))


def test_near_ties_keep_the_incumbent():
    clock = Clock(0.0)
    store = CarryStore(None, 100, "returns", 600, clock)
    assert deposit(store, 1, 50) == [] and deposit(store, 2, 50) == []
    assert deposit(store, 3, 48) is None  # 4% smaller is not worth a swap (ADMIT_MARGIN)
    assert deposit(store, 4, 30) == [2]  # 40% smaller is: the newest of the equal ones goes
    assert [e.session_hash for e in store.entries()] == [1, 4]
