"""Pool pressure follows the carry store's victim order, however many victims one grow needs.

The pool is wired to a `CarryStore` the way `CarryRuntime` wires it
(`pool.victim = store.victim`, each eviction reported to the store as
`pool_pressure` before the next victim is named). A grow that needs k victims
must evict exactly the first entries of the policy's order, taken when the grow
starts, that free enough blocks: the store hears of each eviction before the
next victim is named, so no victim is named from a stale order (issue 25).
"""

from __future__ import annotations

import pytest
import torch
from dp_helpers import rand
from hypothesis import given, settings
from hypothesis import strategies as st

from trtllm_mtp_carry.core.carry_store import CarryStore
from trtllm_mtp_carry.core.drafter import CarriedDrafter
from trtllm_mtp_carry.core.settings import EVICTION_POLICIES
from trtllm_mtp_carry.dataplane.kv_pool import DrafterKVPool
from trtllm_mtp_carry.dataplane.rope import RopeConfig

HKV, D, BS = 2, 8, 2
ROPE = RopeConfig(D, 4, 1e7)


class Wired:
    """A pool and a store charged by its blocks, evictions reported like the runtime does."""

    def __init__(self, num_blocks: int, policy: str) -> None:
        self.pool = DrafterKVPool(num_blocks, BS, HKV, D, ROPE)
        self.store = CarryStore(policy=policy, budget_bytes=None, block_nbytes=self.pool.block_nbytes)
        self.evicted: list[int] = []
        self.pool.victim = self.store.victim
        self.pool.on_evict = self._on_evict
        self.gen = torch.Generator().manual_seed(0)
        self.next_seq = 1

    def _on_evict(self, key: int) -> None:
        self.evicted.append(key)
        assert self.store.evict(key, "pool_pressure") is not None

    def _deposit(self, seq: int, key: int) -> None:
        snap = self.pool.move_to_carried(seq, key)
        assert self.store.admit(key, blocks=snap.block_table) == []
        rows = snap.rows
        self.store.put(CarriedDrafter(snap.block_table, rows, snap.last_pair_key, list(range(rows + 1)), key))

    def carry(self, key: int, rows: int) -> None:
        """A new sequence of `rows` rows, carried under `key`."""
        seq = self.live(rows)
        self._deposit(seq, key)

    def readopt(self, key: int) -> None:
        """`key`'s next turn adopts its rows and deposits them back unchanged (slru protects it)."""
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        self.pool.adopt_carried(key, seq)
        self.store.take(key)
        self._deposit(seq, key)

    def live(self, rows: int) -> int:
        """A new live sequence holding `rows` rows (growing for them); its id."""
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        self.pool.allocate_sequence(seq)
        if rows:
            self.pool.append_rows(seq, list(range(rows)), rand(self.gen, rows, HKV, D),
                                  rand(self.gen, rows, HKV, D))
        return seq


A, B, C, E = 0xA, 0xB, 0xC, 0xE

# A carried and adopted once (slru protects it), then B, C, E deposited: deposit order A, B, C, E
EXPECTED_ORDER = {
    "incumbent": [E, C, B, A],  # newest first
    "lrd": [A, B, C, E],  # oldest first
    "slru": [B, C, E, A],  # never-adopted first (oldest first), then the protected A
    # A's return taught first turns a rate of 3/4 (one return, the coin-flip prior); A's second
    # turn has none seen and backs off to it, while B, C and E, young first turns, may still be
    # the return seen (7/8): A goes first, then the equal ones newest first
    "returns": [A, E, C, B],
}


def four_entries(policy: str) -> Wired:
    w = Wired(6, policy)  # 4 carried blocks, 2 free
    w.carry(A, BS)
    w.readopt(A)
    for key in (B, C, E):
        w.carry(key, BS)
    assert w.store.victims() == tuple(EXPECTED_ORDER[policy])
    return w


@pytest.mark.parametrize("policy", sorted(EXPECTED_ORDER))
@pytest.mark.parametrize("victims", [2, 3])
def test_a_grow_needing_several_victims_takes_them_in_the_policy_order(policy, victims):
    w = four_entries(policy)
    w.live(BS * (2 + victims))  # 2 free blocks, then one block per victim
    assert w.evicted == EXPECTED_ORDER[policy][:victims]
    assert [e.session_hash for e in w.store.entries()] == [
        k for k in (A, B, C, E) if k not in w.evicted]
    assert set(w.pool.carried_keys()) == {e.session_hash for e in w.store.entries()}
    assert w.store.evictions()["pool_pressure"] == victims
    w.pool.check()


def test_every_policy_has_an_expected_order_here():
    assert set(EXPECTED_ORDER) == set(EVICTION_POLICIES)


def test_an_unwired_pool_evicts_least_recently_carried_first():
    w = four_entries("incumbent")
    w.pool.victim = None
    w.live(BS * 4)
    assert w.evicted == [A, B]  # least recently carried: A was carried back before B, C, E


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("carry"), st.integers(1, 6), st.integers(1, 7)),  # key, rows
        st.tuples(st.just("readopt"), st.integers(1, 6), st.just(0)),
        st.tuples(st.just("grow"), st.integers(0, 3), st.integers(1, 9)),  # live sequence, rows
        st.tuples(st.just("end"), st.integers(0, 3), st.just(0)),  # a live sequence ends
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(policy=st.sampled_from(EVICTION_POLICIES), num_blocks=st.integers(4, 12), ops=OPS)
def test_every_pressure_eviction_follows_the_policy_order(policy, num_blocks, ops):
    """Random pools and grows: each grow evicts the shortest prefix of the policy's order that
    frees enough blocks (or is refused, evicting nothing); pool and store always agree."""
    w = Wired(num_blocks, policy)
    pool, store = w.pool, w.store
    live: dict[int, int] = {}  # slot -> live sequence id
    for op, a, b in ops:
        if op == "carry" and a not in store and store.leases == 0:
            seq = w.live(0)
            need = -(-b // BS)
            if need > pool.num_free_blocks:  # a deposit only carries rows a sequence already held
                pool.free_sequence(seq)
                continue
            pool.append_rows(seq, list(range(b)), rand(w.gen, b, HKV, D), rand(w.gen, b, HKV, D))
            w._deposit(seq, a)
        elif op == "readopt" and a in store:
            w.readopt(a)
        elif op == "grow":
            seq = live.get(a)
            if seq is None:
                seq = live[a] = w.live(0)
            need, free = pool.book.num_blocks_needed(seq, b), pool.num_free_blocks
            order = store.victims()
            sizes = {k: len(store.get(k).block_table) for k in order}
            expected = []
            for k in order:
                if need <= free:
                    break
                expected.append(k)
                free += sizes[k]
            w.evicted.clear()
            if need > free:
                with pytest.raises(RuntimeError, match="needs"):
                    pool.grow(seq, b)
                assert w.evicted == []
            else:
                pool.grow(seq, b)
                assert w.evicted == expected
        elif op == "end" and a in live:
            pool.free_sequence(live.pop(a))
        assert set(pool.carried_keys()) == {e.session_hash for e in store.entries()}
        pool.check()
