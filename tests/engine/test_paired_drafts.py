"""`paired`, the model of TensorRT-LLM's paired draft reuse: outputs equal `off`, rows come
from a drafter tree shared within a salt, a warm turn resumes no deeper than the drafter
tree holds, eviction is LRU over unheld published blocks, and ownership is checked.

Engines run in float64 so that generated tokens compare exactly.
"""

import pytest
import torch
from engine_factories import engine, greedy_oracle, random_prompt, tiny_model

from trtllm_mtp_carry.dataplane.rope import RopeConfig
from trtllm_mtp_carry.engine.paired_drafts import PairedDraftPool, PairedPoolExhausted
from trtllm_mtp_carry.engine.prefix_hash import PrefixKeys, salt_root


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=5)


def shared_prompt_sessions(seed=2):
    """Two sessions `a`, `b` sharing a 70-token system prompt, then 40 tokens each and 3 x 20."""
    gen = torch.Generator().manual_seed(seed)
    system = random_prompt(gen, 70)
    spans = {s: [random_prompt(gen, 40)] + [random_prompt(gen, 20) for _ in range(3)] for s in "ab"}
    return system, spans


def replay(eng, system, spans, salts=None):
    """Turns of `a` and `b` alternately; returns the results in order (check() after each)."""
    prompts = {s: list(system) for s in spans}
    results = []
    for t in range(4):
        for s in spans:
            prompts[s] += spans[s][t]
            r = eng.generate(s, prompts[s], max_new_tokens=10, cache_salt=(salts or {}).get(s))
            eng.check()
            results.append(r)
            prompts[s] += r.output
    return results


def test_paired_outputs_equal_off_and_greedy_and_rows_are_shared_across_sessions(model):
    system, spans = shared_prompt_sessions()
    off = replay(engine(model, policy="off"), system, spans)
    eng = engine(model, policy="paired")
    paired = replay(eng, system, spans)
    assert [r.output for r in paired] == [r.output for r in off]
    assert paired[0].output == greedy_oracle(model, paired[0].prompt, 10)
    # b's first turn reuses a's system-prompt rows: 4 whole blocks, nothing copied or lost
    s = paired[1].stats
    assert (s.reused_tokens, s.drafter_rows_kept, s.drafter_rows_computed) == (64, 64, 45)
    assert (s.drafter_tree_tokens, s.drafter_depth_lost, s.recomputed_for_cap) == (64, 0, 0)
    # with a generous pool every warm turn resumes where the target alone would
    assert [r.stats.reused_tokens for r in paired[2:]] == [119, 119, 149, 149, 179, 179]
    assert [r.stats.drafter_rows_kept for r in paired[2:]] == [119, 119, 149, 149, 179, 179]
    st = eng.paired.stats()
    assert (st.turns, st.warm_turns, st.tree_hits, st.depth_lost, st.tokens_recomputed_for_cap) == (
        8, 7, 7, 0, 0)
    assert st.blocks_held == st.tree_blocks == 30 and eng.drafter_blocks_peak == 30


def until_decode(eng, prompt):
    """Submit and step until the prefill is done; returns the id and the live sequence."""
    rid = eng.submit("a", prompt, max_new_tokens=4)
    while True:
        eng.step()
        seq = next(s for s in eng._running if s.request_id == rid)
        if seq.phase == "decode":
            return rid, seq


def test_rows_taken_from_the_tree_equal_a_cold_prefill(model):
    system, spans = shared_prompt_sessions()
    eng = engine(model, policy="paired")
    first = eng.generate("a", system + spans["a"][0], max_new_tokens=10)
    prompt = first.prompt + first.output + spans["a"][1]
    rid, warm = until_decode(eng, prompt)
    assert warm.stats.drafter_rows_kept == warm.stats.reused_tokens == len(first.prompt) + 9
    cold_eng = engine(model, policy="paired")
    cold_id, _ = until_decode(cold_eng, prompt)
    kept = warm.stats.drafter_rows_kept
    wk, wv, wkeys = eng.paired.pool.gather(rid)
    ck, cv, ckeys = cold_eng.paired.pool.gather(cold_id)
    assert wkeys[:kept].tolist() == ckeys[:kept].tolist() == list(range(kept))
    torch.testing.assert_close(wk[:kept], ck[:kept])  # bf16 rows: the same tolerance as the carry's
    torch.testing.assert_close(wv[:kept], cv[:kept])


def test_a_small_drafter_pool_caps_the_target_resume_and_outputs_stay_equal(model):
    system, spans = shared_prompt_sessions()
    blind = replay(engine(model, policy="blind", num_drafter_blocks=14), system, spans)
    eng = engine(model, policy="paired", num_drafter_blocks=14)
    paired = replay(eng, system, spans)
    assert [r.output for r in paired] == [r.output for r in blind]
    assert [r.stats.reused_tokens for r in blind[2:]] == [119, 119, 149, 149, 179, 179]
    assert [r.stats.reused_tokens for r in paired[2:]] == [119, 96, 128, 96, 96, 64]
    assert [r.stats.drafter_tree_tokens for r in paired[2:]] == [119, 112, 128, 96, 96, 64]
    assert [r.stats.recomputed_for_cap for r in paired[2:]] == [0, 23, 21, 53, 83, 115]
    for p, b in zip(paired[2:], blind[2:], strict=True):  # the cap is exactly the reuse lost
        assert b.stats.reused_tokens - p.stats.reused_tokens == p.stats.recomputed_for_cap
    st = eng.paired.stats()
    assert (st.tree_evictions, st.blocks_peak, st.depth_lost, st.tokens_recomputed_for_cap) == (
        33, 14, 279, 295)


def test_salted_sessions_never_share_drafter_blocks(model):
    system, spans = shared_prompt_sessions()
    eng = engine(model, policy="paired")
    results = replay(eng, system, spans, salts={"a": "tenant-a", "b": "tenant-b"})
    assert results[1].stats.reused_tokens == results[1].stats.drafter_rows_kept == 0
    assert results[1].stats.drafter_tree_tokens == 0


# ---- the pool on its own ----------------------------------------------------------------


def pool(num_blocks=6):
    return PairedDraftPool(num_blocks, 16, 1, 16, RopeConfig(16, 4, 1e7))


def fill(p, seq_id, tokens):
    """Give `seq_id` rows for keys 0 .. len(tokens) - 2 (random K/V), as a finished turn has."""
    n = len(tokens) - 1
    gen = torch.Generator().manual_seed(seq_id)
    k = torch.randn(n, 1, 16, generator=gen).to(torch.bfloat16)
    p.allocate_sequence(seq_id)
    p.append_rows(seq_id, torch.arange(n), k, k)
    return p.publish_and_free(seq_id, tokens, 0)


def test_lookahead_token_decides_the_last_row_of_a_matched_block():
    p = pool()
    tokens = list(range(40))  # rows of keys 0..38: two full blocks and a 7-row tail
    assert fill(p, 1, tokens) == 3
    keys = PrefixKeys(tokens, 16)
    assert p.match(keys, tokens).tokens == 39
    other = tokens[:16] + [999] + tokens[17:]  # differs at token 16: block 0's lookahead
    assert p.match(PrefixKeys(other, 16), other).tokens == 15
    assert p.match(PrefixKeys(tokens, 16, salt_root("s")), tokens).tokens == 0
    p.check()


def test_eviction_takes_unheld_published_blocks_oldest_first_and_never_shared_ones():
    p = pool(num_blocks=4)
    fill(p, 1, list(range(33)))  # two full blocks published, no tail (rows 0..31)
    keys = PrefixKeys(list(range(40)), 16)
    found = p.match(keys, list(range(40)))
    assert found.tokens == 32
    p.adopt(2, found, 32)  # both blocks shared by sequence 2: not evictable
    p.allocate_sequence(3)
    k = torch.zeros(32, 1, 16, dtype=torch.bfloat16)
    p.append_rows(3, torch.arange(32), k, k)  # the two free blocks
    with pytest.raises(PairedPoolExhausted):
        p.append_rows(3, torch.tensor([32]), k[:1], k[:1])
    assert p.sequence(3).rows == 32 and p.num_evictions == 0
    p.free_sequence(2)  # the shared blocks become evictable, tail first
    p.append_rows(3, torch.tensor([32]), k[:1], k[:1])
    assert p.num_evictions == 1 and p.match(keys, list(range(40))).tokens == 16
    p.check()
    with pytest.raises(RuntimeError, match="not live"):
        p.free_sequence(2)
    with pytest.raises(RuntimeError, match="already live"):
        p.allocate_sequence(3)


def test_cancel_mid_prefill_releases_shared_tree_blocks_and_publishes_nothing(model):
    system, spans = shared_prompt_sessions()
    eng = engine(model, policy="paired")
    eng.generate("a", system + spans["a"][0], max_new_tokens=10)
    published = eng.paired.stats().blocks_published
    rid = eng.submit("b", system + spans["b"][0], max_new_tokens=10)
    eng.step()  # admitted (4 tree blocks shared) and one 16-token chunk prefilled
    assert eng.paired.pool.sequence(rid).rows == 64 + 16
    assert eng.cancel(rid).finish_reason == "cancelled"
    eng.check()  # every shared block back to ref 0, nothing live
    assert eng.paired.pool.num_live == 0 and eng.paired.stats().blocks_published == published


def test_a_block_shared_with_another_prompt_is_used_inside_the_chain_whatever_its_lookahead():
    p = pool(num_blocks=8)
    a = list(range(40))
    b = a[:16] + [900 + i for i in range(24)]  # the same block 0, then b's own tokens
    fill(p, 1, a)
    assert fill(p, 2, b) == 2  # b's block 0 key is a's (first wins): b publishes block 1 and its tail
    assert p.match(PrefixKeys(b, 16), b).tokens == 39  # a's block 0 (its lookahead is a's), then b's
    p.check()
