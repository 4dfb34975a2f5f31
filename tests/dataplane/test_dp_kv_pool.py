"""DrafterKVPool: block ownership, compacted rows, zero-copy carry slot, RoPE at key + 1."""

from __future__ import annotations

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
    carried = pool.move_to_slot(1)
    assert carried == CarriedBlocks((0, 1), 7, 6) and not pool.has_sequence(1)
    pool.check()
    adopted = pool.adopt_from_slot(2, rows_kept=3)
    assert adopted == CarriedBlocks((0,), 3, 2) and pool.slot is None
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
    with pytest.raises(RuntimeError, match="carry slot is empty"):
        pool.free_slot()
    with pytest.raises(RuntimeError, match="carry slot is empty"):
        pool.adopt_from_slot(1)
    pool.append_rows(1, [0], *kv(gen, 1))
    pool.move_to_slot(1)
    pool.allocate_sequence(2)
    pool.append_rows(2, [0], *kv(gen, 1))
    with pytest.raises(RuntimeError, match="carry slot already holds 1 blocks"):
        pool.move_to_slot(2)
    with pytest.raises(RuntimeError, match="sequence 2 already holds 1 blocks"):
        pool.adopt_from_slot(2)
    with pytest.raises(ValueError, match="rows_kept"):
        pool.adopt_from_slot(3, rows_kept=2)
    assert pool.slot is not None and not pool.has_sequence(3)
    pool.check()


def test_exhaustion_leaves_pool_unchanged(gen):
    pool = make_pool(num_blocks=3, block_size=2)
    pool.allocate_sequence(1)
    pool.append_rows(1, [0, 1, 2], *kv(gen, 3))
    stats, seq, kb = pool.stats(), pool.sequence(1), bits(pool.k_cache)
    assert not pool.can_grow(1, 4) and pool.num_blocks_needed(1, 4) == 2
    with pytest.raises(PoolExhaustedError, match="needs 2 more blocks.*only 1 of 3"):
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


def test_truncate_frees_whole_blocks_only(gen):
    pool = make_pool(block_size=4)
    pool.allocate_sequence(1)
    pool.append_rows(1, list(range(9)), *kv(gen, 9))
    assert pool.truncate(1, 5) == 1  # 3 blocks -> 2
    assert pool.sequence(1) == CarriedBlocks((0, 1), 5, 4)
    assert pool.truncate(1, 0) == 2 and pool.sequence(1).last_pair_key is None
    with pytest.raises(ValueError, match="rows_kept must be in \\[0, 0\\]"):
        pool.truncate(1, 1)
    pool.check()


def test_grow_reserves_and_move_to_slot_trims(gen):
    pool = make_pool(block_size=2)
    pool.allocate_sequence(1)
    assert pool.grow(1, 5) == [0, 1, 2]
    pool.append_rows(1, [0], *kv(gen, 1))  # uses the reserved blocks
    assert pool.sequence(1).block_table == (0, 1, 2)
    pool.check()
    assert pool.move_to_slot(1).block_table == (0,)
    assert pool.num_free_blocks == 5
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
    """Random grow / append / truncate / move-to-slot / adopt / free against a plain model."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = DrafterKVPool(7, 2, HKV, D, ROPE)
        self.gen = torch.Generator().manual_seed(0)
        self.model: dict[int, tuple[list[int], list[torch.Tensor], list[torch.Tensor]]] = {}
        self.slot: tuple[list[int], list[torch.Tensor], list[torch.Tensor]] | None = None
        self.next_id = 0

    seq = st.integers(0, 3)

    @rule()
    def allocate(self):
        self.pool.allocate_sequence(self.next_id)
        self.model[self.next_id] = ([], [], [])
        self.next_id += 1

    @precondition(lambda self: self.model)
    @rule(pick=seq, n=st.integers(1, 5), gap=st.integers(1, 3))
    def append(self, pick, n, gap):
        sid = sorted(self.model)[pick % len(self.model)]
        keys, ks, vs = self.model[sid]
        first = (keys[-1] + gap) if keys else gap - 1
        new = list(range(first, first + n))
        k, v = (torch.randn(n, HKV, D, generator=self.gen).bfloat16() for _ in range(2))
        if not self.pool.can_grow(sid, n):
            before = self.pool.stats()
            with pytest.raises(PoolExhaustedError):
                self.pool.append_rows(sid, new, k, v)
            assert self.pool.stats() == before
            return
        self.pool.append_rows(sid, new, k, v)
        keys.extend(new)
        ks.extend(k)
        vs.extend(v)

    @precondition(lambda self: self.model)
    @rule(pick=seq, n=st.integers(0, 6))
    def grow(self, pick, n):
        sid = sorted(self.model)[pick % len(self.model)]
        if self.pool.can_grow(sid, n):
            self.pool.grow(sid, n)
        else:
            with pytest.raises(PoolExhaustedError):
                self.pool.grow(sid, n)

    @precondition(lambda self: self.model)
    @rule(pick=seq, frac=st.floats(0, 1))
    def truncate(self, pick, frac):
        sid = sorted(self.model)[pick % len(self.model)]
        keys, ks, vs = self.model[sid]
        kept = int(len(keys) * frac)
        self.pool.truncate(sid, kept)
        del keys[kept:], ks[kept:], vs[kept:]

    @precondition(lambda self: self.model)
    @rule(pick=seq)
    def move_to_slot(self, pick):
        sid = sorted(self.model)[pick % len(self.model)]
        if self.slot is not None:
            with pytest.raises(RuntimeError, match="carry slot already holds"):
                self.pool.move_to_slot(sid)
            self.pool.free_slot()
            self.slot = None
        carried = self.pool.move_to_slot(sid)
        self.slot = self.model.pop(sid)
        assert carried.rows == len(self.slot[0])

    @precondition(lambda self: self.slot is not None)
    @rule(frac=st.floats(0, 1))
    def adopt(self, frac):
        keys, ks, vs = self.slot  # type: ignore[misc]
        kept = int(len(keys) * frac)
        self.pool.adopt_from_slot(self.next_id, rows_kept=kept)
        self.model[self.next_id] = (keys[:kept], ks[:kept], vs[:kept])
        self.slot = None
        self.next_id += 1

    @precondition(lambda self: self.model)
    @rule(pick=seq)
    def free(self, pick):
        sid = sorted(self.model)[pick % len(self.model)]
        self.pool.free_sequence(sid)
        del self.model[sid]

    @precondition(lambda self: self.slot is not None)
    @rule()
    def free_slot(self):
        self.pool.free_slot()
        self.slot = None

    @invariant()
    def ownership_and_contents(self):
        self.pool.check()
        stats = self.pool.stats()
        assert stats.num_free_blocks + stats.num_sequence_blocks + stats.num_slot_blocks == 7
        assert stats.num_sequences == len(self.model)
        views = [(self.pool.gather(sid), m) for sid, m in self.model.items()]
        if self.slot is not None:
            views.append((self.pool.gather_slot(), self.slot))
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
