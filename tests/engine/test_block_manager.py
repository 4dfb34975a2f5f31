"""TargetBlockManager: exact block ids in small scenarios, the multi-turn copy-on-write
path, LRU eviction, ownership errors, and a property test over random interleavings
that replays every plan on a fake KV and checks the reused rows hold the prompt."""

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trtllm_mtp_carry.engine.block_manager import (
    AllocationPlan,
    BlockStats,
    PrefixMatch,
    TargetBlockManager,
)


def toks(n, start=100):
    return list(range(start, start + n))


def committed(bm, owner, tokens):
    """Allocate `tokens` fresh for `owner` and commit its full blocks."""
    plan = bm.allocate(owner, tokens)
    bm.commit_full_blocks(owner, tokens)
    return plan


# ---- basics ---------------------------------------------------------------


def test_fresh_allocation_takes_blocks_in_order():
    bm = TargetBlockManager(8, 4)
    assert bm.can_allocate(10) == 3
    plan = bm.allocate(1, toks(10))
    assert plan == AllocationPlan((0, 1, 2), 0, (0, 1, 2), ())
    assert bm.block_table(1) == [0, 1, 2]
    assert bm.num_tokens(1) == 10
    assert bm.stats() == BlockStats(8, 3, 0, 5, 10, 0, 0, 0)
    bm.check()


def test_empty_cache_and_short_prompts_match_nothing():
    bm = TargetBlockManager(8, 4)
    assert bm.match_prefix(toks(9)) == PrefixMatch.empty(4)
    assert bm.match_prefix([5]).num_tokens == 0
    assert bm.match_prefix([]).num_tokens == 0


def test_full_blocks_are_shared_after_commit():
    bm = TargetBlockManager(8, 4)
    committed(bm, 1, toks(10))  # blocks 0, 1 full, 2 partial
    prompt = toks(8) + [7, 7, 7]
    m = bm.match_prefix(prompt)
    assert (m.num_tokens, m.block_ids, m.cow_src) == (8, (0, 1), None)
    assert bm.can_allocate(len(prompt), m) == 1
    plan = bm.allocate(2, prompt, m)
    assert plan == AllocationPlan((0, 1, 3), 8, (3,), ())
    assert bm.stats().num_hit_tokens == 8
    bm.check()


def test_match_never_covers_the_last_prompt_token():
    bm = TargetBlockManager(8, 4)
    committed(bm, 1, toks(8))
    # the same 8 tokens again: only the first block matches (cap is 7 tokens)
    m = bm.match_prefix(toks(8))
    assert (m.num_tokens, m.block_ids) == (4, (0,))
    assert bm.match_prefix(toks(9)).num_tokens == 8


def test_divergent_block_stops_the_chain():
    bm = TargetBlockManager(8, 4)
    committed(bm, 1, toks(12))
    prompt = toks(4) + [0] + toks(8, start=105)
    m = bm.match_prefix(prompt)
    assert (m.num_tokens, m.block_ids) == (4, (0,))  # block 2 has a different parent


# ---- multi-turn: the partial tail block --------------------------------------


def turn_one(bm):
    """Turn 1: prompt of 6, five tokens sampled, 10 computed (the last sampled is not fed)."""
    prompt = toks(6)
    assert bm.allocate(1, prompt).block_table == (0, 1)
    bm.commit_full_blocks(1, prompt)
    for _ in range(4):  # decode feeds 4 more tokens
        bm.append_slots(1, 1)
    assert bm.block_table(1) == [0, 1, 2]
    seq = toks(11)
    bm.free(1, seq[:10])  # blocks 0, 1 full (hashed), block 2 partial (2 tokens)
    return seq


def test_turn_two_matches_whole_previous_sequence_with_copy_on_write():
    bm = TargetBlockManager(8, 4)
    seq = turn_one(bm)
    assert bm.stats() == BlockStats(8, 0, 3, 5, 6, 0, 0, 0)
    prompt = seq + [7, 8, 9]  # 14 tokens
    m = bm.match_prefix(prompt)
    assert m.num_tokens == 10  # the whole computed turn 1, partial block included
    assert (m.block_ids, m.cow_src) == ((0, 1), 2)
    assert bm.can_allocate(len(prompt), m) == 2
    plan = bm.allocate(2, prompt, m)
    # block 2 is shared-cached: copy it into fresh block 3 and write on from token 10
    assert plan == AllocationPlan((0, 1, 3, 4), 10, (3, 4), ((2, 3),))
    assert bm.stats() == BlockStats(8, 4, 1, 3, 20, 10, 0, 1)
    bm.check()
    # the partial block stays cached: a regenerate of turn 2 copies it again
    again = bm.match_prefix(prompt)
    assert (again.num_tokens, again.cow_src) == (10, 2)
    plan = bm.allocate(3, prompt, again)
    assert plan.copies == ((2, 5),)
    bm.check()


def test_partial_block_serves_a_shorter_tail():
    bm = TargetBlockManager(8, 4)
    seq = turn_one(bm)
    # prompt is the computed tokens plus one: cap 10 -> all 10 match
    assert bm.match_prefix(seq[:11]).num_tokens == 10
    # prompt ends one token in: cap leaves 1 of the 2 partial tokens usable
    m = bm.match_prefix(seq[:10])
    assert (m.num_tokens, m.cow_src) == (9, 2)
    # a prompt diverging inside the partial block gets full blocks only
    assert bm.match_prefix(seq[:8] + [0, 0, 0]).num_tokens == 8


def test_trimmed_match_copies_a_full_block_when_cut_inside_it():
    bm = TargetBlockManager(8, 4)
    seq = turn_one(bm)
    m = bm.match_prefix(seq + [1])
    assert m.trimmed(10) == m
    assert m.trimmed(8) == PrefixMatch(8, (0, 1), m.block_hashes, 4)
    t6 = m.trimmed(6)
    assert (t6.block_ids, t6.cow_src, t6.cow_key) == ((0,), 1, m.block_hashes[1])
    assert m.trimmed(0) == PrefixMatch.empty(4)
    plan = bm.allocate(2, seq + [1], t6)
    assert plan == AllocationPlan((0, 3, 4), 6, (3, 4), ((1, 3),))
    bm.check()
    with pytest.raises(ValueError, match="depth=11"):
        m.trimmed(11)


def test_copy_source_is_pinned_while_drawing_new_blocks():
    # the copy source (block 2) is the least recently used cached block and the
    # free pool is empty: the new block must come from evicting block 3 instead
    bm = TargetBlockManager(5, 4)
    seq = turn_one(bm)  # LRU 2, 1, 0; free 3, 4
    committed(bm, 5, [50, 51, 52, 53])  # block 3
    bm.free(5)  # LRU 2, 1, 0, 3
    bm.allocate(6, [60])  # block 4: the free pool is empty
    prompt = seq[:9] + [1]
    m = bm.match_prefix(prompt)
    assert (m.num_tokens, m.block_ids, m.cow_src) == (9, (0, 1), 2)
    assert bm.can_allocate(len(prompt), m) == 1
    plan = bm.allocate(2, prompt, m)
    assert plan == AllocationPlan((0, 1, 3), 9, (3,), ((2, 3),))
    assert bm.stats().num_evictions == 1
    assert bm.match_prefix(prompt).cow_src == 2  # still cached after the copy
    bm.check()


def test_can_allocate_does_not_count_matched_cached_blocks_as_room():
    bm = TargetBlockManager(4, 4)
    seq = turn_one(bm)  # LRU 2, 1, 0; free 3
    bm.allocate(5, [50])  # takes 3
    m = bm.match_prefix(seq[:9] + [1])  # needs 0, 1, 2 pinned and one new block
    assert bm.can_allocate(10, m) is None
    short = m.trimmed(8)  # no copy: 2 may be evicted for the new block
    assert bm.can_allocate(10, short) == 1
    assert bm.allocate(2, seq[:9] + [1], short).block_table == (0, 1, 2)
    assert bm.stats().num_evictions == 1
    bm.check()


# ---- eviction ---------------------------------------------------------------


def test_eviction_is_least_recently_used_tail_first():
    bm = TargetBlockManager(4, 2)
    committed(bm, 1, [1, 2, 3, 4])  # blocks 0, 1
    bm.free(1)  # released tail first: LRU order 1, 0
    assert bm.stats().num_cached == 2
    plan = bm.allocate(2, [5, 6, 7, 8, 9, 10])  # free 2, 3, then evicts 1
    assert plan.block_table == (2, 3, 1)
    assert bm.stats().num_evictions == 1
    m = bm.match_prefix([1, 2, 3, 4, 99])
    assert (m.num_tokens, m.block_ids) == (2, (0,))
    bm.check()


def test_a_reused_block_becomes_most_recent():
    bm = TargetBlockManager(6, 2)
    committed(bm, 1, [1, 2])  # block 0
    committed(bm, 2, [3, 4])  # block 1
    bm.free(1)
    bm.free(2)  # LRU: 0, 1
    m = bm.match_prefix([1, 2, 0])
    bm.allocate(3, [1, 2, 0], m)  # takes 0, draws 2
    bm.free(3)  # LRU: 1, 0 (2 holds no key: back to the free pool)
    assert bm.allocate(4, toks(10)).block_table == (3, 4, 5, 2, 1)
    assert bm.match_prefix([3, 4, 0]).num_tokens == 0
    assert bm.match_prefix([1, 2, 0]).num_tokens == 2
    bm.check()


def test_stale_match_is_refused():
    bm = TargetBlockManager(2, 2)
    committed(bm, 1, [1, 2])
    bm.free(1)
    m = bm.match_prefix([1, 2, 3])
    assert m.block_ids == (0,)
    bm.allocate(2, [9, 9, 9, 9])  # evicts block 0
    bm.free(2)
    with pytest.raises(RuntimeError, match="stale match: block 0"):
        bm.allocate(3, [1, 2, 3], m)
    bm.check()


def test_duplicate_content_keeps_the_first_block():
    bm = TargetBlockManager(8, 2)
    committed(bm, 1, [1, 2, 3])
    committed(bm, 2, [1, 2, 3])  # computed concurrently, no sharing
    assert bm.match_prefix([1, 2, 3]).block_ids == (0,)
    bm.free(2)
    bm.free(1)
    assert bm.stats() == BlockStats(8, 0, 1, 7, 6, 0, 0, 0)
    bm.check()


# ---- decode growth and rejection ------------------------------------------


def test_append_and_truncate():
    bm = TargetBlockManager(8, 4)
    bm.allocate(1, toks(4))
    bm.commit_full_blocks(1, toks(4))
    assert bm.can_append_slots(1, 0) == 0
    assert bm.can_append_slots(1, 3) == 1
    assert bm.append_slots(1, 5) == (1, 2)  # 9 slots: 3 blocks
    bm.truncate(1, 5)  # rejected drafts: block 2 goes back
    assert bm.block_table(1) == [0, 1]
    assert bm.stats().num_free == 6
    with pytest.raises(RuntimeError, match="below 4 committed"):
        bm.truncate(1, 3)
    with pytest.raises(ValueError, match="num_tokens=6"):
        bm.truncate(1, 6)
    assert bm.can_append_slots(1, 27) == 6
    assert bm.can_append_slots(1, 28) is None
    with pytest.raises(RuntimeError, match="no room"):
        bm.append_slots(1, 32)
    bm.check()


# ---- ownership and input errors -------------------------------------------


def test_salted_sequences_share_blocks_only_under_the_same_salt():
    from trtllm_mtp_carry.engine.prefix_hash import PrefixKeys, chain_hash, encode_tokens, salt_root

    a, b = salt_root("a"), salt_root("b")
    bm = TargetBlockManager(num_blocks=16, block_size=4)
    tokens = toks(10)
    bm.allocate(1, tokens, bm.match_prefix(PrefixKeys(tokens, 4, a)), root=a)
    bm.commit_full_blocks(1, tokens)
    bm.free(1, tokens)  # blocks 0, 1 full; block 2 holds the partial [108, 109]
    assert bm.match_prefix(PrefixKeys(tokens, 4, a)).num_tokens == 9  # the same salt reuses
    assert bm.match_prefix(PrefixKeys(tokens, 4, b)) == PrefixMatch.empty(4)
    assert bm.match_prefix(tokens) == PrefixMatch.empty(4)  # no salt is a namespace too
    h1 = chain_hash(a, encode_tokens(toks(4)))
    assert bm.match_prefix(PrefixKeys(tokens, 4, a)).block_hashes == (
        h1, chain_hash(h1, encode_tokens(toks(4, 104))))
    bm.allocate(2, toks(3), root=a)
    bm.free(2, toks(3))  # a partial block right under root a
    m = bm.match_prefix(PrefixKeys(toks(3), 4, a))
    assert (m.num_tokens, m.block_ids, m.cow_key) == (2, (), (a, encode_tokens(toks(3))))
    with pytest.raises(ValueError, match=f"match is under root {a}, not root=0"):
        bm.allocate(3, toks(3), m)  # a match under one root, committed under another
    with pytest.raises(ValueError, match="root must be a u64 int, got -1"):
        bm.allocate(2, toks(3), root=-1)
    bm.check()


def test_ownership_errors_name_the_owner():
    bm = TargetBlockManager(8, 4)
    bm.allocate(7, toks(3))
    with pytest.raises(RuntimeError, match="owner 7 already holds"):
        bm.allocate(7, toks(3))
    bm.free(7)
    for call in (bm.free, bm.block_table, bm.num_tokens):
        with pytest.raises(RuntimeError, match="owner 7 holds no block table"):
            call(7)
    with pytest.raises(RuntimeError, match="owner 7 holds no"):
        bm.append_slots(7, 1)


def test_bad_input_raises_value_error():
    with pytest.raises(ValueError, match="num_blocks"):
        TargetBlockManager(0, 4)
    with pytest.raises(ValueError, match="block_size"):
        TargetBlockManager(4, True)
    bm = TargetBlockManager(8, 4)
    with pytest.raises(ValueError, match="num_tokens"):
        bm.can_allocate(0)
    with pytest.raises(ValueError, match="does not fit"):
        bm.allocate(1, toks(4), PrefixMatch(4, (0,), (1,), 4))
    bm.allocate(1, toks(4))
    with pytest.raises(ValueError, match="5 tokens exceed"):
        bm.commit_full_blocks(1, toks(5))
    with pytest.raises(ValueError, match="5 tokens outside"):
        bm.free(1, toks(5))


def test_no_room_allocate_raises():
    bm = TargetBlockManager(2, 4)
    assert bm.can_allocate(9) is None
    with pytest.raises(RuntimeError, match="no room for owner 1"):
        bm.allocate(1, toks(9))
    bm.check()


# ---- property: random interleavings ---------------------------------------

B, N = 3, 12


class FakeEngine:
    """Replays plans on a fake KV (block -> rows of token ids) and tracks owners."""

    def __init__(self):
        self.bm = TargetBlockManager(N, B)
        self.kv = [[None] * B for _ in range(N)]
        self.tokens = {}  # owner -> verified tokens (their KV is written)
        self.locked = {}  # owner -> number of leading blocks it must not write
        self.history = [[1, 2, 3, 1, 2]]

    def writable(self, owner):
        return self.bm.block_table(owner)[self.locked[owner] :]

    def write(self, owner, lo, values):
        table = self.bm.block_table(owner)
        mine = set(self.writable(owner))
        others = {b for o in self.tokens if o != owner for b in self.bm.block_table(o)}
        for p, t in enumerate(values, start=lo):
            block = table[p // B]
            assert block in mine and block not in others, (owner, p, block)
            self.kv[block][p % B] = t

    def assert_kv_holds(self, owner, tokens):
        table = self.bm.block_table(owner)
        assert [self.kv[table[p // B]][p % B] for p in range(len(tokens))] == tokens

    def allocate(self, owner, prompt, depth_frac):
        m = self.bm.match_prefix(prompt)
        m = m.trimmed(int(m.num_tokens * depth_frac))
        if self.bm.can_allocate(len(prompt), m) is None:
            return
        plan = self.bm.allocate(owner, prompt, m)
        for src, dst in plan.copies:
            self.kv[dst] = list(self.kv[src])
        self.tokens[owner] = list(prompt)
        self.locked[owner] = len(m.block_ids)
        self.assert_kv_holds(owner, prompt[: plan.num_cached_tokens])
        self.write(owner, plan.num_cached_tokens, prompt[plan.num_cached_tokens :])
        self.commit(owner)

    def commit(self, owner):
        self.bm.commit_full_blocks(owner, self.tokens[owner])
        self.locked[owner] = max(self.locked[owner], len(self.tokens[owner]) // B)

    def decode(self, owner, drafts, accept):
        n = len(self.tokens[owner])
        if self.bm.can_append_slots(owner, len(drafts)) is None:
            return
        self.bm.append_slots(owner, len(drafts))
        self.write(owner, n, drafts)  # draft rows; rejected ones are overwritten later
        self.bm.truncate(owner, n + accept)
        self.tokens[owner] += drafts[:accept]
        self.commit(owner)

    def free(self, owner, cache):
        seq = self.tokens.pop(owner)
        del self.locked[owner]
        self.bm.free(owner, seq if cache else None)
        self.history.append(seq + [9])  # the next turn also holds the last sampled token


ops = st.one_of(
    st.tuples(st.just("alloc"), st.integers(0, 20), st.none() | st.integers(0, 20),
              st.lists(st.integers(1, 3), max_size=7), st.sampled_from([0.0, 0.5, 1.0, 1.0])),
    st.tuples(st.just("decode"), st.integers(0, 20),
              st.lists(st.integers(1, 3), min_size=1, max_size=4), st.integers(0, 4)),
    st.tuples(st.just("free"), st.integers(0, 20), st.booleans()),
)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(st.lists(ops, min_size=5, max_size=60))
def test_random_interleavings_keep_invariants(script):
    eng = FakeEngine()
    next_owner = 0
    for op in script:
        live = sorted(eng.tokens)
        if op[0] == "alloc":
            _, pick, cut, suffix, frac = op  # cut None: a next turn of that sequence
            base = eng.history[-1 - pick % len(eng.history)]
            prompt = base[: len(base) if cut is None else cut % (len(base) + 1)] + suffix
            if prompt:
                eng.allocate(next_owner, prompt, frac)
                next_owner += 1
        elif live and op[0] == "decode":
            _, pick, drafts, accept = op
            eng.decode(live[pick % len(live)], drafts, min(accept, len(drafts)))
        elif live and op[0] == "free":
            eng.free(live[op[1] % len(live)], op[2])
        eng.bm.check()
        for owner in eng.tokens:
            eng.assert_kv_holds(owner, eng.tokens[owner])
    for owner in sorted(eng.tokens):
        eng.free(owner, True)
    eng.bm.check()
    st_ = eng.bm.stats()
    assert st_.num_used == 0 and st_.num_cached + st_.num_free == N


def test_bookkeeping_modules_import_no_torch():
    code = (
        "import sys\n"
        "import trtllm_mtp_carry.engine.block_manager, trtllm_mtp_carry.engine.snapshot_cache\n"
        "import trtllm_mtp_carry.core.session, trtllm_mtp_carry.engine.prefix_hash\n"
        "print(sorted(m for m in ('torch', 'numpy', 'triton') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
