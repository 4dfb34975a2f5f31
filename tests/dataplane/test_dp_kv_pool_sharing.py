"""DrafterKVPool's common-prefix sharing: equal blocks merge, different bytes never do, a shared
block is copied before anyone writes into it, and evicting one sharer frees only its own blocks."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from dp_helpers import bits
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from trtllm_mtp_carry.dataplane.kv_pool import DrafterKVPool, PoolExhaustedError, ShareStats
from trtllm_mtp_carry.dataplane.rope import RopeConfig
from trtllm_mtp_carry.engine.prefix_hash import PrefixKeys, salt_root

HKV, D, B = 2, 8, 4
ROPE = RopeConfig(D, 4, 1e7)


def make_pool(num_blocks: int = 12) -> DrafterKVPool:
    return DrafterKVPool(num_blocks, B, HKV, D, ROPE)


def rows_for(variant: int, keys: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V rows that depend only on (variant, key): equal prefixes give equal bytes."""
    k = torch.stack([torch.randn(HKV, D, generator=torch.Generator().manual_seed(1000 * variant + key))
                     for key in keys]).bfloat16()
    return k, -k


def finished(pool, seq_id, n, variant=0, first=0):
    """A sequence with rows for keys `first .. first + n - 1`, as a finished turn leaves it."""
    pool.allocate_sequence(seq_id)
    keys = list(range(first, first + n))
    pool.append_rows(seq_id, keys, *rows_for(variant, keys))


def tokens_of(variant: int, n: int) -> list[int]:
    """Prompt tokens: a 20-token common prefix, then tokens of the variant."""
    return list(range(20)) + [100 * (variant + 1) + i for i in range(max(0, n - 20))]


def deposit(pool, seq_id, key, n, variant=0, root=0, tokens=None):
    finished(pool, seq_id, n, variant)
    share = pool.share_blocks(seq_id, PrefixKeys(tokens or tokens_of(0, n + 1), B, root))
    pool.move_to_carried(seq_id, key)
    return share


def test_equal_prefix_blocks_merge_into_one_copy_and_every_owner_reads_its_own_rows():
    pool = make_pool()
    assert deposit(pool, 1, 0xA, 10) == ShareStats(merged=0, published=2, mismatched=0)
    assert deposit(pool, 2, 0xB, 11) == ShareStats(merged=2, published=0, mismatched=0)
    a, b = pool.carried(0xA), pool.carried(0xB)
    assert a.block_table[:2] == b.block_table[:2] and a.block_table[2] != b.block_table[2]
    stats = pool.stats()
    assert (stats.num_free_blocks, stats.num_carried_blocks, stats.num_shared_blocks, stats.blocks_saved) == (
        8, 4, 2, 2)
    for key, n in ((0xA, 10), (0xB, 11)):
        gk, gv, keys = pool.gather_carried(key)
        assert keys.tolist() == list(range(n))
        assert torch.equal(bits(gv), bits(rows_for(0, list(range(n)))[1]))
    pool.check()


def test_blocks_whose_bytes_differ_are_kept_apart_and_the_first_publisher_keeps_the_key():
    pool = make_pool()
    deposit(pool, 1, 0xA, 10, variant=0)
    assert deposit(pool, 2, 0xB, 10, variant=1) == ShareStats(merged=0, published=0, mismatched=2)
    assert set(pool.carried(0xA).block_table).isdisjoint(pool.carried(0xB).block_table)
    assert pool.stats().share_mismatches == 2 and pool.stats().num_shared_blocks == 0
    assert deposit(pool, 3, 0xC, 10, variant=0).merged == 2  # still found under A's blocks
    pool.check()


def test_salted_keys_never_find_each_others_blocks():
    pool = make_pool()
    deposit(pool, 1, 0xA, 10, root=salt_root("tenant-a"))
    assert deposit(pool, 2, 0xB, 10, root=salt_root("tenant-b")) == ShareStats(0, 2, 0)
    assert pool.stats().num_shared_blocks == 0
    pool.check()


def test_only_blocks_of_keys_from_zero_and_covered_by_tokens_are_shared():
    pool = make_pool()
    finished(pool, 1, 8, first=4)  # a blind turn's rows: keys 4..11, no block holds keys [4i, 4i+4)
    assert pool.share_blocks(1, PrefixKeys(tokens_of(0, 13), B)) == ShareStats(0, 0, 0)
    finished(pool, 2, 8)  # keys 0..7, but tokens for block 0 only (its rows need t_0..t_4)
    assert pool.share_blocks(2, PrefixKeys(list(range(5)), B)) == ShareStats(0, 1, 0)
    pool.check()


def test_a_block_is_keyed_by_the_token_after_it_so_other_next_tokens_never_collide():
    pool = make_pool()
    deposit(pool, 1, 0xA, 4, tokens=[1, 2, 3, 4, 5])
    # same first block of tokens, another next token: another key, so B publishes its own
    assert deposit(pool, 2, 0xB, 4, variant=1, tokens=[1, 2, 3, 4, 9]) == ShareStats(0, 1, 0)
    assert deposit(pool, 3, 0xC, 4, variant=1, tokens=[1, 2, 3, 4, 9]) == ShareStats(1, 0, 0)
    assert pool.carried(0xC).block_table == pool.carried(0xB).block_table
    pool.check()


def test_writing_into_a_shared_tail_copies_it_first_and_the_other_entry_keeps_its_bytes():
    pool = make_pool()
    deposit(pool, 1, 0xA, 10)
    deposit(pool, 2, 0xB, 10)
    shared = pool.carried(0xB).block_table[1]
    before = bits(pool.gather_carried(0xB)[0]).clone()
    pool.adopt_carried(0xA, 3, rows_kept=6)  # keeps keys 0..5: its tail is shared block 1
    assert pool.sequence(3).block_table[1] == shared and pool.book.num_blocks_needed(3, 1) == 1
    k, v = rows_for(7, [6, 7])
    pool.append_rows(3, [6, 7], k, v)
    table = pool.sequence(3).block_table
    assert table[1] != shared and pool.stats().cow_copies == 1
    assert torch.equal(bits(pool.gather_carried(0xB)[0]), before)  # B's rows untouched
    gk, gv, keys = pool.gather(3)
    assert keys.tolist() == list(range(8))
    assert torch.equal(bits(gv), bits(torch.cat([rows_for(0, list(range(6)))[1], v])))
    pool.check()


def test_a_block_one_owner_alone_writes_leaves_the_index_first():
    pool = make_pool()
    deposit(pool, 1, 0xA, 8)
    pool.adopt_carried(0xA, 2, rows_kept=6)
    pool.append_rows(2, [6, 7], *rows_for(7, [6, 7]))  # block 1 now holds other bytes
    assert pool.stats().cow_copies == 0
    assert deposit(pool, 3, 0xB, 8) == ShareStats(merged=1, published=1, mismatched=0)
    assert pool.carried(0xB).block_table[1] != pool.sequence(2).block_table[1]
    pool.check()


def test_evicting_one_sharer_frees_only_the_blocks_no_other_owner_holds():
    pool = make_pool(num_blocks=6)
    evicted = []
    pool.on_evict = evicted.append
    deposit(pool, 1, 0xA, 12)  # blocks 0, 1, 2
    deposit(pool, 2, 0xB, 12)  # shares 0, 1, 2 (its own copies went back)
    assert pool.num_free_blocks == 3 and pool.num_carried_blocks == 3
    assert pool.free_carried(0xA) == 3 and pool.num_free_blocks == 3  # B still holds all three
    pool.allocate_sequence(3)
    assert pool.book.can_grow(3, 24) and not pool.book.can_grow(3, 25)
    pool.append_rows(3, list(range(16)), *rows_for(5, list(range(16))))  # 4 blocks: B must go
    assert evicted == [0xB] and pool.num_free_blocks == 2
    pool.check()


def test_a_grow_the_shared_blocks_cannot_serve_is_refused_and_changes_nothing():
    pool = make_pool(num_blocks=4)
    deposit(pool, 1, 0xA, 8)
    deposit(pool, 2, 0xB, 8)
    pool.adopt_carried(0xB, 3)  # B's live sequence holds the shared blocks: not reclaimable
    pool.allocate_sequence(4)
    stats = pool.stats()
    assert pool.num_carried_blocks == 0 and not pool.book.can_grow(4, 9)
    with pytest.raises(PoolExhaustedError, match="only 2 of 4 blocks are free and 0 are carried"):
        pool.append_rows(4, list(range(9)), *rows_for(0, list(range(9))))
    assert pool.stats() == stats and pool.carried_keys() == (0xA,)
    pool.check()


@dataclass
class _Owner:
    keys: list[int]
    variant: int


class SharingMachine(RuleBasedStateMachine):
    """Random finish / share / carry / adopt / append / evict with two row variants under one
    key chain: same-variant blocks merge, different ones mismatch; every owner must read back
    exactly its own rows, and a grow succeeds exactly when `can_grow` says so."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = DrafterKVPool(10, B, HKV, D, ROPE)
        self.evicted: list[int] = []
        self.pool.on_evict = self.evicted.append
        self.live: dict[int, _Owner] = {}
        self.carried: dict[int, _Owner] = {}
        self.next_id = 0

    def grown(self):
        for key in self.evicted:
            del self.carried[key]
        self.evicted.clear()

    @rule(n=st.integers(1, 14), variant=st.integers(0, 1))
    def start(self, n, variant):
        sid, self.next_id = self.next_id, self.next_id + 1
        self.pool.allocate_sequence(sid)
        self.live[sid] = _Owner([], variant)
        self._append(sid, n)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 9), n=st.integers(1, 6))
    def append(self, pick, n):
        self._append(sorted(self.live)[pick % len(self.live)], n)

    def _append(self, sid, n):
        owner = self.live[sid]
        first = owner.keys[-1] + 1 if owner.keys else 0
        keys = list(range(first, first + n))
        ok = self.pool.book.can_grow(sid, n)
        before = self.pool.stats()
        try:
            self.pool.append_rows(sid, keys, *rows_for(owner.variant, keys))
        except PoolExhaustedError:
            assert not ok and self.pool.stats() == before and self.evicted == []
            return
        assert ok
        self.grown()
        owner.keys.extend(keys)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 9), key=st.integers(1, 4))
    def share_and_carry(self, pick, key):
        sid = sorted(self.live)[pick % len(self.live)]
        owner = self.live.pop(sid)
        self.pool.share_blocks(sid, PrefixKeys(tokens_of(0, len(owner.keys) + 1), B))
        if key in self.carried:
            self.pool.free_carried(key)
            del self.carried[key]
        self.pool.move_to_carried(sid, key)
        self.carried[key] = owner

    @precondition(lambda self: self.carried)
    @rule(pick=st.integers(0, 9), frac=st.floats(0, 1))
    def adopt(self, pick, frac):
        key = sorted(self.carried)[pick % len(self.carried)]
        owner = self.carried.pop(key)
        kept = int(len(owner.keys) * frac)
        sid, self.next_id = self.next_id, self.next_id + 1
        self.pool.adopt_carried(key, sid, rows_kept=kept)
        self.live[sid] = _Owner(owner.keys[:kept], owner.variant)

    @precondition(lambda self: self.carried)
    @rule(pick=st.integers(0, 9))
    def free_carried(self, pick):
        key = sorted(self.carried)[pick % len(self.carried)]
        self.pool.free_carried(key)
        del self.carried[key]

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 9))
    def free(self, pick):
        sid = sorted(self.live)[pick % len(self.live)]
        self.pool.free_sequence(sid)
        del self.live[sid]

    @invariant()
    def every_owner_reads_its_own_rows(self):
        self.pool.check()
        stats = self.pool.stats()
        assert stats.num_free_blocks + stats.num_sequence_blocks + stats.num_carried_blocks == 10
        assert set(self.pool.carried_keys()) == set(self.carried)
        views = [(self.pool.gather(sid), o) for sid, o in self.live.items()]
        views += [(self.pool.gather_carried(key), o) for key, o in self.carried.items()]
        for (_, gv, gkeys), owner in views:
            assert gkeys.tolist() == owner.keys
            if owner.keys:
                assert torch.equal(bits(gv), bits(rows_for(owner.variant, owner.keys)[1]))


TestSharingMachine = SharingMachine.TestCase
TestSharingMachine.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
