"""CarryStore: several sessions' entries, least recently deposited evicted first, every leave counted."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trtllm_mtp_carry import EVICTION_CAUSES, CarriedDrafter, CarryStore


def entry(session, rows=3, blocks=(0,)):
    return CarriedDrafter(blocks, rows, rows - 1, list(range(100, 100 + rows + 1)), session)


def deposit(store, e):
    evicted = store.make_room(e.session_hash)
    store.put(e)
    return [x.session_hash for x in evicted]


def zeros(**counts):
    return {cause: counts.get(cause, 0) for cause in EVICTION_CAUSES}


def test_one_slot_is_the_seeds_slot_newest_session_wins():
    store = CarryStore(1)
    a, b = entry(0xA), entry(0xB)
    assert deposit(store, a) == []
    assert store.candidate(0xA) is a and store.candidate(0xB) is a  # b is refused as foreign
    assert deposit(store, b) == [0xA]
    assert store.entries() == (b,) and store.candidate(0xA) is b
    assert store.evictions() == zeros(capacity=1)


def test_candidate_is_own_entry_else_none_with_several_slots():
    store = CarryStore(3)
    assert store.candidate(0xA) is None
    a, b = entry(0xA), entry(0xB)
    deposit(store, a)
    deposit(store, b)
    assert store.candidate(0xA) is a and store.candidate(0xB) is b
    assert store.candidate(0xC) is None and store.candidate(0) is None  # a miss, not a foreign entry


def test_capacity_evicts_least_recently_deposited():
    store = CarryStore(2)
    for s in (0xA, 0xB):
        deposit(store, entry(s))
    assert deposit(store, entry(0xA, rows=5)) == [0xA]  # a's own older rows: replaced, a is newest now
    assert deposit(store, entry(0xC)) == [0xB]  # b is the least recently deposited
    assert [e.session_hash for e in store.entries()] == [0xA, 0xC]
    assert store.evictions() == zeros(capacity=1, replaced=1)
    assert store.deposits == 4


def test_take_removes_once_and_counts_an_adoption():
    store = CarryStore(2)
    a = entry(0xA)
    deposit(store, a)
    assert store.take(0xA) is a and 0xA not in store
    with pytest.raises(RuntimeError, match="no carried entry for session 0x000000000000000a to take"):
        store.take(0xA)
    with pytest.raises(RuntimeError, match="session 0x0000000000000000"):
        store.take(0)
    assert store.adoptions == 1 and store.evictions() == zeros()


def test_evict_counts_by_cause_and_ignores_absent_sessions():
    store = CarryStore(4)
    for s in (0xA, 0xB, 0xC):
        deposit(store, entry(s, blocks=(s, s + 16)))
    assert store.blocks_held == 6 and store.rows_held == 9
    assert store.evict(0xB, "pool_pressure").session_hash == 0xB
    assert store.evict(0xB, "session_end") is None
    assert store.evict(0xC, "session_end").session_hash == 0xC
    assert [e.session_hash for e in store.clear()] == [0xA]
    assert store.evictions() == zeros(pool_pressure=1, session_end=1, cleared=1)
    assert len(store) == 0 and store.newest() is None
    with pytest.raises(ValueError, match="cause must be one of"):
        store.evict(0xA, "tired")


def test_put_without_room_or_for_session_zero_is_refused():
    store = CarryStore(1)
    deposit(store, entry(0xA))
    with pytest.raises(RuntimeError, match="no room for session 0x000000000000000b: 1 of 1 slots"):
        store.put(entry(0xB))
    with pytest.raises(RuntimeError, match="its own entry among them"):
        store.put(entry(0xA))
    with pytest.raises(ValueError, match="session 0 never carries"):
        store.put(entry(0))
    with pytest.raises(ValueError, match=r"slots must be an int >= 1 or None \(no cap\), got 0"):
        CarryStore(0)
    with pytest.raises(TypeError, match="session_hash must be an int"):
        store.make_room("a")


ops = st.lists(
    st.tuples(st.sampled_from(["deposit", "take", "pressure", "end", "clear"]), st.integers(1, 5)),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(slots=st.integers(1, 4), ops=ops)
def test_random_interleavings_keep_every_entry_accounted(slots, ops):
    """No entry taken by another session or twice; every leave counted; order is deposit order."""
    store = CarryStore(slots)
    model = []  # session hashes, oldest first
    taken, deposited = [], 0
    counts = dict.fromkeys(EVICTION_CAUSES, 0)
    for op, s in ops:
        if op == "deposit":
            e = entry(s, rows=s + 1)
            evicted = deposit(store, e)
            expect = [s] if s in model else []
            rest = [x for x in model if x != s]
            counts["replaced"] += len(expect)
            while len(rest) >= slots:
                expect.append(rest.pop(0))
                counts["capacity"] += 1
            assert evicted == expect
            model = [*rest, s]
            deposited += 1
        elif op == "take":
            if s in model:
                got = store.take(s)
                assert got.session_hash == s and got.rows == s + 1
                model.remove(s)
                taken.append(s)
            else:
                with pytest.raises(RuntimeError):
                    store.take(s)
        elif op in ("pressure", "end"):
            cause = "pool_pressure" if op == "pressure" else "session_end"
            got = store.evict(s, cause)
            assert (got is not None) is (s in model)
            if got is not None:
                model.remove(s)
                counts[cause] += 1
        else:
            counts["cleared"] += len(model)
            assert [e.session_hash for e in store.clear()] == model
            model = []
        assert [e.session_hash for e in store.entries()] == model and len(model) <= slots
        cand = store.candidate(s)
        assert cand is (store.get(s) if s in model else store.newest() if slots == 1 else None)
    assert store.evictions() == counts and store.adoptions == len(taken)
    assert deposited == store.adoptions + sum(counts.values()) + len(store)
