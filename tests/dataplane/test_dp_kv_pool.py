"""DrafterKVPool: block ownership, compacted rows, zero-copy carried entries, RoPE at key + 1."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from dp_helpers import bits, rand
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from trtllm_mtp_carry.dataplane.kv_pool import (
    CarriedBlocks,
    DrafterKVPool,
    PoolExhaustedError,
)
from trtllm_mtp_carry.dataplane.rope import RopeConfig, apply_rope_reference

HKV, D = 2, 8
ROPE = RopeConfig(D, 4, 1e7)


def make_pool(num_blocks: int = 6, block_size: int = 4) -> DrafterKVPool:
    return DrafterKVPool(num_blocks, block_size, HKV, D, ROPE)


def kv(gen, n):
    return rand(gen, n, HKV, D), rand(gen, n, HKV, D)


def test_append_places_rows_through_the_block_table(gen):
    pool = make_pool()
    pool.allocate_sequence(1)
    k, v = kv(gen, 6)
    keys = [10, 11, 12, 20, 21, 30]
    assert pool.append_rows(1, keys, k, v) == CarriedBlocks((0, 1), 6, 30)
    pool.check()
    gk, gv, gkeys = pool.gather(1)
    assert gkeys.tolist() == keys
    assert torch.equal(bits(gv), bits(v))
    assert torch.equal(bits(gk), bits(apply_rope_reference(k, torch.tensor(keys) + 1, 4, 1e7)))
    # row 5 lives in block_table[1] = 1, offset 1
    assert torch.equal(bits(pool.v_cache[1, 1]), bits(v[5]))


def test_carry_round_trip_is_zero_copy_and_truncates(gen):
    pool = make_pool()
    pool.allocate_sequence(1)
    k, v = kv(gen, 7)
    pool.append_rows(1, torch.arange(7), k, v)
    carried = pool.move_to_carried(1, key=0xA)
    assert carried == CarriedBlocks((0, 1), 7, 6) and not pool.has_sequence(1)
    assert pool.carried(0xA) == carried and pool.book.slot == carried
    pool.check()
    adopted = pool.adopt_carried(0xA, 2, rows_kept=3)
    assert adopted == CarriedBlocks((0,), 3, 2) and pool.book.slot is None and pool.carried(0xA) is None
    assert pool.num_free_blocks == 5
    k2, v2 = kv(gen, 2)
    pool.append_rows(2, [3, 5], k2, v2)  # continues after the kept rows
    gk, gv, keys = pool.gather(2)
    assert keys.tolist() == [0, 1, 2, 3, 5]
    assert torch.equal(bits(gv), bits(torch.cat([v[:3], v2])))
    pool.check()


def test_ownership_errors_name_the_owner(gen):
    pool = make_pool()
    pool.allocate_sequence(1)
    with pytest.raises(RuntimeError, match="sequence 1 is already live"):
        pool.allocate_sequence(1)
    with pytest.raises(RuntimeError, match="sequence 9 is not live"):
        pool.free_sequence(9)
    with pytest.raises(RuntimeError, match="nothing carried under 5: nothing to free"):
        pool.free_carried(5)
    with pytest.raises(RuntimeError, match="nothing carried under 5 for sequence 1 to adopt"):
        pool.adopt_carried(5, 1)
    with pytest.raises(RuntimeError, match="nothing carried under 5: nothing to gather"):
        pool.gather_carried(5)
    pool.append_rows(1, [0], *kv(gen, 1))
    pool.move_to_carried(1, 5)
    pool.allocate_sequence(2)
    pool.append_rows(2, [0], *kv(gen, 1))
    with pytest.raises(RuntimeError, match="carried entry 5 already holds 1 blocks"):
        pool.move_to_carried(2, 5)
    with pytest.raises(RuntimeError, match="sequence 2 already holds 1 blocks"):
        pool.adopt_carried(5, 2)
    with pytest.raises(ValueError, match="rows_kept"):
        pool.adopt_carried(5, 3, rows_kept=2)
    assert pool.carried(5) is not None and not pool.has_sequence(3)
    pool.check()


def test_exhaustion_leaves_pool_unchanged(gen):
    pool = make_pool(num_blocks=3, block_size=2)
    pool.allocate_sequence(1)
    pool.append_rows(1, [0, 1, 2], *kv(gen, 3))
    stats, seq, kb = pool.stats(), pool.sequence(1), bits(pool.k_cache)
    assert not pool.book.can_grow(1, 4) and pool.book.num_blocks_needed(1, 4) == 2
    with pytest.raises(PoolExhaustedError, match="needs 2 more blocks.*only 1 of 3 blocks are free and 0"):
        pool.append_rows(1, [3, 4, 5, 6], *kv(gen, 4))
    assert pool.stats() == stats and pool.sequence(1) == seq
    assert torch.equal(bits(pool.k_cache), kb)
    pool.check()


def test_bad_append_leaves_pool_unchanged(gen):
    pool = make_pool()
    pool.allocate_sequence(1)
    pool.append_rows(1, [5], *kv(gen, 1))
    stats, kb, vb = pool.stats(), bits(pool.k_cache), bits(pool.v_cache)
    k, v = kv(gen, 4)
    for keys, kk, msg in [([5, 6, 7, 8], k, "must exceed .* last_pair_key 5"),
                          ([6, 7, 7, 8], k, "strictly increasing"),
                          ([6, 7, 8, 9], k.half(), "k dtype"),
                          ([6, 7, 8, 9], k[:3], "k must have shape"),
                          ([6.0, 7.0, 8.0, 9.0], k, "integer")]:
        with pytest.raises(ValueError, match=msg):
            pool.append_rows(1, torch.tensor(keys), kk, v)
    assert pool.stats() == stats
    assert torch.equal(bits(pool.k_cache), kb) and torch.equal(bits(pool.v_cache), vb)
    pool.check()


def test_range_keys_write_what_the_same_keys_as_a_tensor_write(gen):
    """The runtime's consecutive keys as a `range` (checked on the host, no copy, no sync)
    give the same blocks, rows, runs and bytes as the same keys in a tensor."""
    k0, v0 = kv(gen, 1)
    k, v = kv(gen, 6)
    pools = []
    for keys in (range(7, 13), torch.arange(7, 13)):
        pool = make_pool()
        pool.allocate_sequence(1)
        pool.append_rows(1, [5], k0, v0)
        assert pool.append_rows(1, keys, k, v) == CarriedBlocks((0, 1), 7, 12)
        pool.append_rows(1, range(13, 15), *kv(torch.Generator().manual_seed(3), 2))  # joins the run
        pool.check()
        pools.append(pool)
    a, b = pools
    assert a.gather(1)[2].tolist() == b.gather(1)[2].tolist() == [5, *range(7, 15)]
    assert a.book.sequence_runs(1) == b.book.sequence_runs(1) == ((5, 1), (7, 8))
    assert torch.equal(bits(a.k_cache), bits(b.k_cache)) and torch.equal(bits(a.v_cache), bits(b.v_cache))


def test_bad_range_append_leaves_pool_unchanged(gen):
    pool = make_pool()
    pool.allocate_sequence(1)
    pool.append_rows(1, range(5, 6), *kv(gen, 1))
    stats, kb, vb = pool.stats(), bits(pool.k_cache), bits(pool.v_cache)
    k, v = kv(gen, 4)
    for keys, kk, msg in [(range(5, 9), k, "first key 5 must exceed sequence 1's last_pair_key 5"),
                          (range(6, 10), k[:3], "k must have shape"),
                          (range(6, 10), k.half(), "k dtype")]:
        with pytest.raises(ValueError, match=msg):
            pool.append_rows(1, keys, kk, v)
    pool.allocate_sequence(2)
    with pytest.raises(ValueError, match="keys must be >= 0, got min key -1"):
        pool.append_rows(2, range(-1, 3), k, v)
    assert pool.stats().num_free_blocks == stats.num_free_blocks
    assert torch.equal(bits(pool.k_cache), kb) and torch.equal(bits(pool.v_cache), vb)
    pool.check()


def test_truncate_frees_whole_blocks_only(gen):
    pool = make_pool(block_size=4)
    pool.allocate_sequence(1)
    pool.append_rows(1, list(range(9)), *kv(gen, 9))
    assert pool.book.truncate(1, 5) == 1  # 3 blocks -> 2
    assert pool.sequence(1) == CarriedBlocks((0, 1), 5, 4)
    assert pool.book.truncate(1, 0) == 2 and pool.sequence(1).last_pair_key is None
    with pytest.raises(ValueError, match="rows_kept must be in \\[0, 0\\]"):
        pool.book.truncate(1, 1)
    pool.check()


def test_grow_reserves_and_move_to_carried_trims(gen):
    pool = make_pool(block_size=2)
    pool.allocate_sequence(1)
    assert pool.grow(1, 5) == [0, 1, 2]
    pool.append_rows(1, [0], *kv(gen, 1))  # uses the reserved blocks
    assert pool.sequence(1).block_table == (0, 1, 2)
    pool.check()
    assert pool.move_to_carried(1, 9).block_table == (0,)
    assert pool.num_free_blocks == 5 and pool.num_carried_blocks == 1
    pool.check()


def carry(pool, gen, seq_id, key, rows):
    """Give a new sequence `rows` rows and carry them under `key`."""
    pool.allocate_sequence(seq_id)
    pool.append_rows(seq_id, list(range(rows)), *kv(gen, rows))
    return pool.move_to_carried(seq_id, key)


def test_several_entries_are_carried_and_adopted_by_key(gen):
    pool = make_pool(num_blocks=6, block_size=2)
    a, b = carry(pool, gen, 1, 0xA, 3), carry(pool, gen, 2, 0xB, 2)
    assert (a.block_table, b.block_table) == ((0, 1), (2,))
    assert pool.carried_keys() == (0xA, 0xB) and pool.book.slot == b
    k_a = pool.gather_carried(0xA)[0].clone()
    assert pool.adopt_carried(0xA, 3) == a  # zero copy: the same blocks
    assert torch.equal(bits(pool.gather(3)[0]), bits(k_a))
    assert pool.carried_keys() == (0xB,) and pool.num_carried_blocks == 1
    assert pool.free_carried(0xB) == 1 and pool.carried_keys() == ()
    pool.check()


def test_pool_pressure_evicts_oldest_entries_first_and_reports_them(gen):
    pool = make_pool(num_blocks=6, block_size=2)
    evicted = []
    pool.on_evict = evicted.append
    carry(pool, gen, 1, 0xA, 2)  # block 0
    carry(pool, gen, 2, 0xB, 4)  # blocks 1, 2
    carry(pool, gen, 3, 0xC, 2)  # block 3
    pool.allocate_sequence(4)
    pool.append_rows(4, [0, 1, 2], *kv(gen, 3))  # 2 free blocks: no eviction
    assert evicted == [] and pool.num_free_blocks == 0
    pool.append_rows(4, [3, 4, 5, 6, 7], *kv(gen, 5))  # 2 more blocks: A (1) then B (2) go
    assert evicted == [0xA, 0xB] and pool.carried_keys() == (0xC,)
    assert pool.num_free_blocks == 1 and pool.stats().evictions_for_pressure == 2
    pool.check()


def test_a_grow_no_eviction_could_serve_is_refused_and_evicts_nothing(gen):
    pool = make_pool(num_blocks=3, block_size=2)
    evicted = []
    pool.on_evict = evicted.append
    carry(pool, gen, 1, 0xA, 2)
    pool.allocate_sequence(2)
    stats = pool.stats()
    assert pool.book.can_grow(2, 6) and not pool.book.can_grow(2, 7)
    with pytest.raises(PoolExhaustedError, match="only 2 of 3 blocks are free and 1 are carried"):
        pool.append_rows(2, list(range(7)), *kv(gen, 7))
    assert pool.stats() == stats and evicted == [] and pool.carried_keys() == (0xA,)
    pool.check()


def test_check_names_a_block_owned_by_a_sequence_and_an_entry(gen):
    pool = make_pool(num_blocks=4, block_size=2)
    carry(pool, gen, 1, 0xA, 2)
    pool.allocate_sequence(2)
    pool.book._seqs[2].block_table.append(0)  # corrupt: block 0 is entry 0xA's
    with pytest.raises(RuntimeError, match=r"block 0 is owned by \['sequence 2', 'carried entry 10'\]"):
        pool.check()


def test_fp16_pool(gen):
    pool = DrafterKVPool(4, 4, HKV, D, ROPE, dtype=torch.float16)
    pool.allocate_sequence(1)
    k, v = rand(gen, 5, HKV, D, dtype=torch.float16), rand(gen, 5, HKV, D, dtype=torch.float16)
    pool.append_rows(1, range(5), k, v)
    gk, gv, _ = pool.gather(1)
    assert gk.dtype == torch.float16 and torch.equal(bits(gv), bits(v))
    with pytest.raises(ValueError, match="dtype"):
        DrafterKVPool(4, 4, HKV, D, ROPE, dtype=torch.float32)
    with pytest.raises(ValueError, match="rope.head_dim"):
        DrafterKVPool(4, 4, HKV, 16, ROPE)


class PoolMachine(RuleBasedStateMachine):
    """Random grow / append / truncate / carry / adopt / free against a plain model.

    A grow the free list cannot serve must evict carried entries oldest first
    (exactly as many as needed), or be refused with nothing evicted.
    """

    def __init__(self) -> None:
        super().__init__()
        self.pool = DrafterKVPool(5, 2, HKV, D, ROPE)
        self.evicted: list[int] = []
        self.pool.on_evict = self.evicted.append
        self.gen = torch.Generator().manual_seed(0)
        Rows = tuple[list[int], list[torch.Tensor], list[torch.Tensor]]
        self.model: dict[int, Rows] = {}
        self.carried: OrderedDict[int, Rows] = OrderedDict()  # oldest first
        self.next_id = 0

    seq = st.integers(0, 3)
    key = st.integers(1, 3)

    def expect_grow(self, sid, n):
        """The keys a grow by `n` must evict, or None when it must be refused."""
        need, free = self.pool.book.num_blocks_needed(sid, n), self.pool.num_free_blocks
        sizes = [-(-len(rows[0]) // 2) for rows in self.carried.values()]
        if need > free + sum(sizes):
            return None
        victims = []
        for key, size in zip(self.carried, sizes, strict=True):
            if need <= free:
                break
            victims.append(key)
            free += size
        return victims

    def grew(self, victims):
        assert self.evicted == victims
        for key in victims:
            del self.carried[key]
        self.evicted.clear()

    @rule()
    def allocate(self):
        self.pool.allocate_sequence(self.next_id)
        self.model[self.next_id] = ([], [], [])
        self.next_id += 1

    @precondition(lambda self: self.model)
    @rule(pick=seq, n=st.integers(1, 6), gap=st.integers(1, 3))
    def append(self, pick, n, gap):
        sid = sorted(self.model)[pick % len(self.model)]
        keys, ks, vs = self.model[sid]
        first = (keys[-1] + gap) if keys else gap - 1
        new = list(range(first, first + n))
        k, v = (torch.randn(n, HKV, D, generator=self.gen).bfloat16() for _ in range(2))
        victims = self.expect_grow(sid, n)
        assert self.pool.book.can_grow(sid, n) is (victims is not None)
        if victims is None:
            before = self.pool.stats()
            with pytest.raises(PoolExhaustedError):
                self.pool.append_rows(sid, new, k, v)
            assert self.pool.stats() == before and self.evicted == []
            return
        self.pool.append_rows(sid, new, k, v)
        self.grew(victims)
        keys.extend(new)
        ks.extend(k)
        vs.extend(v)

    @precondition(lambda self: self.model)
    @rule(pick=seq, n=st.integers(0, 10))
    def grow(self, pick, n):
        sid = sorted(self.model)[pick % len(self.model)]
        victims = self.expect_grow(sid, n)
        if victims is not None:
            self.pool.grow(sid, n)
            self.grew(victims)
        else:
            with pytest.raises(PoolExhaustedError):
                self.pool.grow(sid, n)
            assert self.evicted == []

    @precondition(lambda self: self.model)
    @rule(pick=seq, frac=st.floats(0, 1))
    def truncate(self, pick, frac):
        sid = sorted(self.model)[pick % len(self.model)]
        keys, ks, vs = self.model[sid]
        kept = int(len(keys) * frac)
        self.pool.book.truncate(sid, kept)
        del keys[kept:], ks[kept:], vs[kept:]

    @precondition(lambda self: self.model)
    @rule(pick=seq, key=key)
    def move_to_carried(self, pick, key):
        sid = sorted(self.model)[pick % len(self.model)]
        if key in self.carried:
            with pytest.raises(RuntimeError, match=f"carried entry {key} already holds"):
                self.pool.move_to_carried(sid, key)
            self.pool.free_carried(key)
            del self.carried[key]
        carried = self.pool.move_to_carried(sid, key)
        self.carried[key] = self.model.pop(sid)
        assert carried.rows == len(self.carried[key][0])

    @precondition(lambda self: self.carried)
    @rule(pick=key, frac=st.floats(0, 1))
    def adopt(self, pick, frac):
        key = sorted(self.carried)[pick % len(self.carried)]
        keys, ks, vs = self.carried.pop(key)
        kept = int(len(keys) * frac)
        self.pool.adopt_carried(key, self.next_id, rows_kept=kept)
        self.model[self.next_id] = (keys[:kept], ks[:kept], vs[:kept])
        self.next_id += 1

    @precondition(lambda self: self.model)
    @rule(pick=seq)
    def free(self, pick):
        sid = sorted(self.model)[pick % len(self.model)]
        self.pool.free_sequence(sid)
        del self.model[sid]

    @precondition(lambda self: self.carried)
    @rule(pick=key)
    def free_carried(self, pick):
        key = sorted(self.carried)[pick % len(self.carried)]
        self.pool.free_carried(key)
        del self.carried[key]

    @invariant()
    def ownership_and_contents(self):
        self.pool.check()
        stats = self.pool.stats()
        assert stats.num_free_blocks + stats.num_sequence_blocks + stats.num_carried_blocks == 5
        assert stats.num_sequences == len(self.model)
        assert self.pool.carried_keys() == tuple(self.carried)
        views = [(self.pool.gather(sid), m) for sid, m in self.model.items()]
        views += [(self.pool.gather_carried(key), m) for key, m in self.carried.items()]
        for (gk, gv, gkeys), (keys, ks, vs) in views:
            assert gkeys.tolist() == keys
            if keys:
                assert torch.equal(bits(gv), bits(torch.stack(vs)))
                expect = apply_rope_reference(torch.stack(ks), torch.tensor(keys) + 1, 4, 1e7)
                torch.testing.assert_close(gk, expect, rtol=2**-7, atol=1e-3)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(
    max_examples=40, stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
