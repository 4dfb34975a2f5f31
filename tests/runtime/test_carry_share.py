"""Carried entries share common-prefix drafter blocks: sessions whose first turns computed the same
system prompt hold one copy of its rows, every session still adopts only its own entry and reads
exactly the rows it wrote, salts never share, and outputs never change.

Engines run in float64 so that generated tokens compare exactly.
"""

from __future__ import annotations

import pytest
import torch
from engine_factories import engine, greedy_oracle, random_prompt, tiny_model

from trtllm_mtp_carry.runtime import CarryRuntime

SYSTEM, OWN, SPAN, NEW = 70, 40, 20, 6


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=5)


def carry_engine(model, share):
    eng = engine(model, policy="carry")
    eng.runtime = CarryRuntime(eng, "carry", slots=None, share=share)
    return eng


def together(eng, prompts, salts=None):
    """Submit every session's turn at once (cold first turns side by side); results by session."""
    rids = {eng.submit(s, p, max_new_tokens=NEW, cache_salt=(salts or {}).get(s)): s
            for s, p in prompts.items()}
    out = {}
    while len(out) < len(rids):
        for r in eng.step():
            out[rids[r.request_id]] = r
    eng.check()
    eng.runtime.check()
    return out


def two_sessions(seed=3):
    gen = torch.Generator().manual_seed(seed)
    system = random_prompt(gen, SYSTEM)
    first = {s: system + random_prompt(gen, OWN) for s in "ab"}
    spans = {s: random_prompt(gen, SPAN) for s in "ab"}
    return first, spans


def test_two_cold_sessions_sharing_a_prompt_hold_one_copy_of_its_blocks(model):
    first, spans = two_sessions()
    runs, held = {}, {}
    for share in (True, False):
        eng = carry_engine(model, share)
        r1 = together(eng, first)
        stats = eng.runtime.stats()
        held[share] = stats.blocks_held
        if share:  # keys 0..63 need tokens 0..64, all in the 70-token prompt: 4 whole blocks
            assert (stats.share_merges, stats.share_mismatches, stats.shared_blocks) == (4, 0, 4)
            a, b = (eng.drafter_pool.carried(e.session_hash) for e in eng.runtime.carried())
            assert a.block_table[:4] == b.block_table[:4] and a.block_table[4] != b.block_table[4]
        else:
            assert (stats.share_merges, stats.shared_blocks) == (0, 0)
        rows = {s: eng.drafter_pool.gather_carried(e.session_hash)
                for s, e in zip("ab", eng.runtime.carried(), strict=True)}
        second = {s: r1[s].prompt + r1[s].output + spans[s] for s in "ab"}
        r2 = together(eng, second)
        assert [r2[s].stats.outcome_kind for s in "ab"] == ["adopted", "adopted"]
        runs[share] = (r1, r2, rows)
    assert held[False] - held[True] == 4  # the copy sharing saved
    for s in "ab":  # the same tokens, and bit for bit the same carried rows, shared or not
        assert [r.output for r in (runs[True][0][s], runs[True][1][s])] == [
            r.output for r in (runs[False][0][s], runs[False][1][s])]
        assert runs[True][0][s].output == greedy_oracle(model, first[s], NEW)
        for x, y in zip(runs[True][2][s], runs[False][2][s], strict=True):
            assert torch.equal(x, y)


def test_salted_sessions_never_share_blocks(model):
    first, _ = two_sessions()
    eng = carry_engine(model, True)
    together(eng, first, salts={"a": "tenant-a", "b": "tenant-b"})
    stats = eng.runtime.stats()
    assert (stats.share_merges, stats.shared_blocks) == (0, 0)
    # every full block of rows (keys 0..114 of 116 tokens: 7 blocks) is published under its own salt
    assert eng.drafter_pool.stats().blocks_published == 2 * 7 == 2 * ((SYSTEM + OWN + NEW - 1) // 16)


def test_a_session_that_diverges_inside_a_shared_block_copies_it_and_the_other_keeps_its_rows(model):
    first, spans = two_sessions()
    eng = carry_engine(model, True)
    r1 = together(eng, first)
    b_key = next(e.session_hash for e in eng.runtime.carried() if e.tokens[:len(first["b"])] == first["b"])
    b_rows = eng.drafter_pool.gather_carried(b_key)
    edited = list(first["a"])
    edited[56] = 32 if edited[56] != 32 else 33  # inside shared block 3 (keys 48..63)
    r = eng.generate("a", edited + r1["a"].output + spans["a"], max_new_tokens=NEW)
    eng.check()
    eng.runtime.check()
    assert r.stats.outcome_kind == "adopted" and r.stats.drafter_rows_kept == 55
    assert eng.drafter_pool.stats().cow_copies == 1
    for x, y in zip(eng.drafter_pool.gather_carried(b_key), b_rows, strict=True):
        assert torch.equal(x, y)  # b's entry, which shares blocks 0-3, is untouched
    assert r.output == plain_output(model, edited + r1["a"].output + spans["a"])


def plain_output(model, prompt):
    """What an engine that drafts nothing (`off`) generates for `prompt`."""
    return engine(model, policy="off").generate("a", prompt, max_new_tokens=NEW).output
