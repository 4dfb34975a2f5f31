"""SnapshotCache, restore_decision, plan_resume and the shared prefix keys: exact values,
LRU under a byte budget, the marconi threshold boundary, and a brute-force oracle."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trtllm_mtp_carry.engine.block_manager import TargetBlockManager
from trtllm_mtp_carry.engine.prefix_hash import (
    ROOT_HASH,
    PrefixKeys,
    chain_hash,
    encode_tokens,
    salt_root,
)
from trtllm_mtp_carry.engine.snapshot_cache import (
    ResumePlan,
    SnapshotCache,
    SnapshotStats,
    plan_resume,
    restore_decision,
)


def toks(n, start=100):
    return list(range(start, start + n))


# ---- prefix keys ----------------------------------------------------------


def test_prefix_keys_are_pinned_and_chained():
    keys = PrefixKeys(toks(10), 4)
    h1 = chain_hash(ROOT_HASH, encode_tokens(toks(4)))
    h2 = chain_hash(h1, encode_tokens(toks(4, 104)))
    assert (keys.full(0), keys.full(1), keys.full(2)) == (ROOT_HASH, h1, h2)
    assert keys.key(8) == h2
    assert keys.key(10) == chain_hash(h2, encode_tokens([108, 109]))
    assert keys.key(9) != keys.key(10)
    assert PrefixKeys(toks(8) + [0, 0], 4).key(10) != keys.key(10)
    assert encode_tokens([1, 2]) == b"\x01" + b"\x00" * 7 + b"\x02" + b"\x00" * 7


def test_prefix_key_values_are_pinned():
    # keys must agree across processes, machines and releases: values pinned
    assert chain_hash(ROOT_HASH, encode_tokens([1, 2, 3])) == 0xF1088CAE4CCFC552
    assert PrefixKeys(list(range(10)), 4).key(10) == 0xC1AEB09B1FDE161D
    assert PrefixKeys([1, 2, 3, 4, 5], 2).key(5) == PrefixKeys([1, 2, 3, 4, 5, 6], 2).key(5)


def test_salted_keys_chain_from_the_salt_root_and_no_salt_is_unchanged():
    root = salt_root("carry/replay0")
    assert root == 0x3596025B7B3DCFBE == salt_root(b"carry/replay0")  # str == its UTF-8 bytes
    assert salt_root(None) == ROOT_HASH
    assert PrefixKeys(list(range(10)), 4, salt_root(None)).key(10) == 0xC1AEB09B1FDE161D
    salted = PrefixKeys(list(range(10)), 4, root)
    assert (salted.root, salted.full(0)) == (root, root)
    assert salted.full(1) == chain_hash(root, encode_tokens([0, 1, 2, 3]))
    assert salted.key(10) == 0xC107A634CD71B1AF
    assert PrefixKeys(list(range(10)), 4, salt_root("off/replay0")).key(10) not in (
        salted.key(10), 0xC1AEB09B1FDE161D)


@pytest.mark.parametrize(
    "salt, error, match",
    [
        (5, TypeError, "cache_salt must be a str or bytes, got int 5"),
        (["a"], TypeError, r"got list \['a'\]"),
        ("", ValueError, "cache_salt must be non-empty, got ''"),
        (b"", ValueError, "cache_salt must be non-empty, got b''"),
        ("\ud800", ValueError, "cache_salt must be valid UTF-8"),
    ],
)
def test_bad_cache_salt_is_named(salt, error, match):
    with pytest.raises(error, match=match):
        salt_root(salt)


def test_prefix_keys_reject_bad_input():
    with pytest.raises(ValueError, match="int64"):
        encode_tokens([1 << 63])
    with pytest.raises(ValueError, match="block_size"):
        PrefixKeys([1], 0)
    with pytest.raises(ValueError, match="depth=4 outside"):
        PrefixKeys([1, 2, 3], 2).key(4)
    with pytest.raises(ValueError, match="num_blocks=2"):
        PrefixKeys([1, 2, 3], 2).full(2)


# ---- SnapshotCache --------------------------------------------------------


def test_deepest_matching_snapshot_wins():
    c = SnapshotCache(100, 4)
    turn = toks(10)
    assert c.put(turn, 4, "s4", 10)  # a block boundary
    assert c.put(turn, 10, "s10", 10)  # the end of a turn
    assert c.best_for(turn + [1, 2], 11) == (10, "s10")
    assert c.best_for(turn + [1, 2], 9) == (4, "s4")
    assert c.best_for(toks(8) + [0, 0, 0], 10) == (4, "s4")  # differs inside the tail
    assert c.best_for(turn, 3) is None
    assert c.best_for([1] + turn, 11) is None
    assert c.best_for(turn + [1], 11, min_depth=11) is None
    assert c.best_for(turn + [1], 11, min_depth=5) == (10, "s10")
    assert c.stats() == SnapshotStats(2, 20, 100, 2, 4, 3, 0, 0)


def test_lru_eviction_under_the_budget():
    c = SnapshotCache(30, 4)
    for i, name in enumerate("abc"):
        c.put([i] * 4, 4, name, 10)
    assert c.best_for([0] * 5, 4) == (4, "a")  # a becomes most recent
    c.put([3] * 4, 4, "d", 10)  # evicts b, the least recently used
    assert c.best_for([1] * 5, 4) is None
    assert [c.best_for([i] * 5, 4) for i in (0, 2, 3)] == [(4, "a"), (4, "c"), (4, "d")]
    c.put([4] * 4, 4, "e", 25)  # needs 25 of 30: evicts a, c, d
    assert c.stats().num_entries == 1 and c.stats().num_bytes == 25
    assert c.stats().num_evictions == 4
    assert not c.put([5] * 4, 4, "f", 31)  # larger than the budget: refused, nothing evicted
    assert c.stats().num_rejected == 1 and c.best_for([4] * 5, 4) == (4, "e")


def test_put_replaces_the_same_prefix():
    c = SnapshotCache(100, 4)
    c.put(toks(6), 6, "old", 30)
    c.put(toks(7), 6, "new", 20)  # same prefix toks(6), depth 6
    assert c.stats().num_entries == 1 and c.stats().num_bytes == 20
    assert c.best_for(toks(7), 6) == (6, "new")


def test_shared_prefix_keys_must_use_the_same_block_size():
    c = SnapshotCache(100, 4)
    keys = PrefixKeys(toks(9), 4)
    c.put(keys, 8, "s8", 1)
    assert c.best_for(keys, 8) == (8, "s8")
    with pytest.raises(ValueError, match="block_size 2 != 4"):
        c.best_for(PrefixKeys(toks(9), 2), 8)


def test_snapshot_cache_rejects_bad_input():
    with pytest.raises(ValueError, match="budget_bytes"):
        SnapshotCache(-1, 4)
    with pytest.raises(ValueError, match="block_size"):
        SnapshotCache(1, 0)
    c = SnapshotCache(100, 4)
    with pytest.raises(ValueError, match="depth=0"):
        c.put(toks(3), 0, "x", 1)
    with pytest.raises(ValueError, match="depth=4"):
        c.put(toks(3), 4, "x", 1)
    with pytest.raises(ValueError, match="nbytes"):
        c.put(toks(3), 3, "x", -1)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=12), min_size=1, max_size=6),
    st.lists(st.tuples(st.integers(0, 5), st.integers(1, 12)), max_size=12),
    st.lists(st.integers(0, 2), max_size=14),
    st.integers(0, 14),
)
def test_best_for_agrees_with_brute_force(seqs, puts, prompt, max_depth):
    c = SnapshotCache(10**9, 3)
    held = {}
    for pick, depth in puts:
        seq = seqs[pick % len(seqs)]
        depth = min(depth, len(seq))
        c.put(seq, depth, tuple(seq[:depth]), 1)
        held[tuple(seq[:depth])] = depth
    want = max(
        (
            d
            for p, d in held.items()
            if d <= max_depth and tuple(prompt[:d]) == p and d <= len(prompt)
        ),
        default=None,
    )
    got = c.best_for(prompt, max_depth)
    assert (got and got[0]) == want
    if got:
        assert got[1] == tuple(prompt[: got[0]])


# ---- restore_decision and plan_resume -------------------------------------


def test_restore_decision_threshold_boundary():
    assert not restore_decision(255, 256)
    assert restore_decision(256, 256)
    assert restore_decision(1, 0)  # 0 removes the floor
    assert not restore_decision(0, 0)  # nothing matched: nothing to restore
    with pytest.raises(ValueError, match="matched_depth"):
        restore_decision(-1, 0)
    with pytest.raises(ValueError, match="min_tokens"):
        restore_decision(3, True)


def cache_with(depths, tokens, block_size=4):
    c = SnapshotCache(10**6, block_size)
    for d in depths:
        c.put(tokens, d, f"s{d}", 1)
    return c


@pytest.mark.parametrize(
    "min_tokens, want",
    [
        (
            11,
            ResumePlan(
                0, False, "no SSM snapshot at depth in [11, 12] (KV match 12): recompute from 0"
            ),
        ),
        (10, ResumePlan(10, True, "restore SSM snapshot at depth 10 (KV match 12)", "s10")),
        (0, ResumePlan(10, True, "restore SSM snapshot at depth 10 (KV match 12)", "s10")),
        (13, ResumePlan(0, False, "KV match 12 < marconi_min_tokens 13: recompute from 0")),
    ],
)
def test_plan_resume_threshold(min_tokens, want):
    prompt = toks(14)
    c = cache_with([4, 10], prompt)
    assert plan_resume(prompt, 12, c.best_for, min_tokens) == want


def test_plan_resume_floor_removed_restores_a_shallow_snapshot():
    prompt = toks(14)
    c = cache_with([4], prompt)
    assert plan_resume(prompt, 12, c.best_for, 0).depth == 4
    assert plan_resume(prompt, 12, c.best_for, 4).depth == 4
    assert plan_resume(prompt, 12, c.best_for, 5).depth == 0


def test_plan_resume_never_goes_past_the_kv_match():
    prompt = toks(14)
    c = cache_with([8, 13], prompt)  # 13 is deeper than the KV
    assert plan_resume(prompt, 12, c.best_for, 0) == ResumePlan(
        8, True, "restore SSM snapshot at depth 8 (KV match 12)", "s8"
    )


def test_plan_resume_without_kv_or_with_a_bad_kv():
    prompt = toks(14)
    c = cache_with([8], prompt)
    assert plan_resume(prompt, 0, c.best_for, 0) == ResumePlan(
        0, False, "no cached KV prefix: recompute from 0"
    )
    with pytest.raises(ValueError, match="KV match of 14 tokens"):
        plan_resume(prompt, 14, c.best_for, 0)
    with pytest.raises(ValueError, match="KV match of 1 tokens"):
        plan_resume([5], 1, c.best_for, 0)


def test_plan_resume_asks_lookup_only_above_the_floor():
    calls = []

    def lookup(prompt, max_depth, min_depth):
        calls.append((max_depth, min_depth))
        return None

    assert plan_resume(toks(300), 280, lookup, 256).depth == 0
    assert plan_resume(toks(300), 200, lookup, 256).depth == 0  # not even asked
    assert calls == [(280, 256)]


def test_plan_resume_refuses_a_lookup_outside_its_range():
    with pytest.raises(RuntimeError, match="depth 3 outside"):
        plan_resume(toks(10), 8, lambda p, hi, lo: (3, "x"), 4)


def test_multi_turn_hybrid_resume_with_block_manager():
    """Turn 1 computes 10 tokens and snapshots the state after them; turn 2 resumes there."""
    bm, cache, min_tokens = TargetBlockManager(8, 4), SnapshotCache(10**6, 4), 8
    seq = toks(11)  # 6 prompt + 5 sampled; the last sampled token is not computed
    bm.allocate(1, seq[:6])
    bm.append_slots(1, 4)
    cache.put(seq, 4, "boundary-4", 100)  # a block boundary snapshot during prefill
    cache.put(seq, 10, "turn-end", 100)  # state after token 9
    bm.free(1, seq[:10])

    prompt = seq + [7, 8, 9]
    match = bm.match_prefix(prompt)
    plan = plan_resume(prompt, match, cache.best_for, min_tokens)
    assert plan == ResumePlan(
        10, True, "restore SSM snapshot at depth 10 (KV match 10)", "turn-end"
    )
    alloc = bm.allocate(2, prompt, match.trimmed(plan.depth))
    assert (alloc.num_cached_tokens, alloc.copies) == (10, ((2, 3),))
    bm.free(2)

    # the same prompt with a floor above the turn-end depth: recompute from 0
    plan = plan_resume(prompt, bm.match_prefix(prompt), cache.best_for, 11)
    assert (plan.depth, plan.restore) == (0, False)
    assert bm.allocate(3, prompt, bm.match_prefix(prompt).trimmed(0)).num_cached_tokens == 0
    bm.check()


def test_one_prefix_keys_serves_both_caches():
    bm, cache = TargetBlockManager(8, 4), SnapshotCache(10**6, 4)
    seq = toks(11)
    bm.allocate(1, seq[:10])
    cache.put(seq, 10, "turn-end", 1)
    bm.free(1, seq[:10])
    keys = PrefixKeys(seq + [7], 4)  # the prompt hashed once
    match = bm.match_prefix(keys)
    assert match == bm.match_prefix(seq + [7])
    plan = plan_resume(keys, match, cache.best_for, 8)
    assert (plan.depth, plan.snapshot) == (10, "turn-end")
    with pytest.raises(ValueError, match="block_size 2 != 4"):
        bm.match_prefix(PrefixKeys(seq, 2))
