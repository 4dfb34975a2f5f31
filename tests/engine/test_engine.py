"""The reference engine: speculative output equals greedy, prefix reuse, the restore
threshold, bad input and cancellation.

Equality tests run in float64: verifying several tokens in one forward changes
the order of float32 reductions and could flip a near-tie, while in float64 the
verify path and single-token decoding agree to ~1e-12.
"""

import pytest
import torch
from engine_factories import TOK, engine, first_turn_then, greedy_oracle, random_prompt, tiny_model

from trtllm_mtp_carry import marconi_min_tokens
from trtllm_mtp_carry.engine.engine import EngineConfig


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


@pytest.mark.parametrize("draft_len", [1, 2, 3])
def test_speculative_equals_greedy_cold_and_warm(model, draft_len):
    gen = torch.Generator().manual_seed(draft_len)
    eng = engine(model, draft_len=draft_len)
    turn1 = random_prompt(gen, 70)
    r1 = eng.generate("s", turn1, max_new_tokens=24)
    assert r1.output == greedy_oracle(model, turn1, 24)
    assert r1.stats.drafted > 0 and r1.stats.verify_steps > 0
    turn2 = turn1 + r1.output + random_prompt(gen, 30)
    r2 = eng.generate("s", turn2, max_new_tokens=24)
    assert r2.stats.reused_tokens > 0 and r2.stats.snapshot_restored
    assert r2.output == greedy_oracle(model, turn2, 24)
    eng.check()


def test_policy_off_is_plain_greedy(model):
    gen = torch.Generator().manual_seed(7)
    prompt = random_prompt(gen, 40)
    r = engine(model, policy="off").generate(None, prompt, max_new_tokens=16)
    assert r.output == greedy_oracle(model, prompt, 16)
    assert (r.stats.drafted, r.stats.drafter_rows_computed, r.stats.outcome) == (0, 0, "off")


def test_cold_turn_builds_a_row_for_every_prompt_key(model):
    gen = torch.Generator().manual_seed(8)
    prompt = random_prompt(gen, 50)
    eng = engine(model)
    r = eng.generate("s", prompt, max_new_tokens=8)
    assert (r.stats.outcome, r.stats.drafter_rows_computed) == ("prefill (no carried state: never_carried)", 49)


def test_warm_turn_restored_snapshot_equals_from_scratch(model):
    gen = torch.Generator().manual_seed(9)
    eng = engine(model)
    turn1, r1, turn2 = first_turn_then(eng, gen, "a", 64, 10, 20)
    warm = eng.generate("a", turn2, max_new_tokens=12)
    cold = engine(model).generate("a", turn2, max_new_tokens=12)
    assert warm.stats.snapshot_restored
    assert warm.stats.reused_tokens == len(turn1) + len(r1.output) - 1
    assert not cold.stats.snapshot_restored and cold.stats.reused_tokens == 0
    assert warm.output == cold.output


def test_restored_logits_match_recomputed_logits(model):
    """The state restored from a snapshot continues exactly as a full recompute does."""
    from trtllm_mtp_carry.engine.model import DenseTargetCache

    gen = torch.Generator().manual_seed(10)
    eng = engine(model)
    turn1, r1, turn2 = first_turn_then(eng, gen, "a", 48, 6, 10)
    rid = eng.submit("a", turn2, max_new_tokens=3)
    eng._admit()
    seq = eng._running[0]
    assert seq.kv.num_tokens == len(turn1) + len(r1.output) - 1
    rest = torch.tensor(turn2[seq.kv.num_tokens:])
    with torch.no_grad():
        _, warm_logits = model.forward_target(rest, seq.kv.num_tokens, seq.kv)
        _, full_logits = model.forward_target(torch.tensor(turn2), 0, DenseTargetCache(model.cfg))
    torch.testing.assert_close(warm_logits, full_logits[-len(rest):], rtol=1e-9, atol=1e-9)
    eng.cancel(rid)
    eng.check()


def test_restore_threshold_boundary(model):
    """Snapshots lie every 16 tokens; a match of depth T-1 restores none, depth T does."""
    threshold = marconi_min_tokens()
    assert threshold % 16 == 0 and threshold >= 32
    gen = torch.Generator().manual_seed(11)
    base = random_prompt(gen, threshold + 40)

    def second_turn_after_sharing(shared):
        eng = engine(model)
        eng.generate("x", base, max_new_tokens=2)
        other = base[:shared] + [ord("~")] + random_prompt(gen, 30)
        return eng.generate("y", other, max_new_tokens=2).stats

    below = second_turn_after_sharing(threshold - 1)
    at = second_turn_after_sharing(threshold)
    assert (below.snapshot_restored, below.reused_tokens) == (False, 0)
    assert (at.snapshot_restored, at.reused_tokens) == (True, threshold)


def test_cache_salt_isolates_prefix_reuse(model):
    """A different salt admits the same prompt cold; the same salt reuses; output is unchanged."""
    gen = torch.Generator().manual_seed(12)
    eng = engine(model)
    turn1, r1, turn2 = first_turn_then(eng, gen, "a", 64, 10, 20)  # unsalted
    first = eng.generate("b", turn2, max_new_tokens=12, cache_salt="carry/replay0")
    other = eng.generate("c", turn2, max_new_tokens=12, cache_salt=b"rebuild/replay0")
    same = eng.generate("d", turn2, max_new_tokens=12, cache_salt=b"carry/replay0")
    unsalted = eng.generate("e", turn2, max_new_tokens=12)
    assert (first.stats.reused_tokens, first.stats.snapshot_restored) == (0, False)
    assert (other.stats.reused_tokens, other.stats.snapshot_restored) == (0, False)
    # resumes at its salt's deepest snapshot: the last prefill chunk end below the prompt end
    assert same.stats.reused_tokens == (len(turn2) - 1) // 16 * 16 and same.stats.snapshot_restored
    assert unsalted.stats.reused_tokens == len(turn1) + len(r1.output) - 1  # session a's turn
    assert first.output == other.output == same.output == unsalted.output
    assert first.output == greedy_oracle(model, turn2, 12)
    eng.check()


@pytest.mark.parametrize(
    "prompt, kwargs, error, match",
    [
        ([], {}, ValueError, "prompt is empty"),
        ([1, 2, 999], {}, ValueError, r"token ids must be ints in \[0, 264\); got \[999\]"),
        ([1, -2], {}, ValueError, r"got \[-2\]"),
        ([1, 2.5], {}, ValueError, r"got \[2.5\]"),
        (list(range(100)) * 30, {}, ValueError, "exceeds max_model_len=2048"),
        ([1, 2], {"max_new_tokens": 0}, ValueError, "max_new_tokens must be a positive int, got 0"),
        ([1, 2], {"max_new_tokens": -3}, ValueError, "got -3"),
        ([1, 2], {"draft_len": 4}, ValueError, r"draft_len must be an int in \[0, 3\], got 4"),
        ([1, 2], {"session_id": ""}, ValueError, "session"),
        ([1, 2], {"session_id": -1}, ValueError, "-1"),
        ([1, 2], {"session_id": 2.5}, TypeError, "2.5"),
        ([1, 2], {"policy": "fast"}, ValueError, "unknown drafter policy 'fast'"),
        ([1, 2], {"cache_salt": 7}, TypeError, "cache_salt must be a str or bytes, got int 7"),
        ([1, 2], {"cache_salt": ""}, ValueError, "cache_salt must be non-empty, got ''"),
        ([{"role": "robot", "content": "hi"}], {}, ValueError, "unknown role 'robot'"),
        ([72, True, 33], {}, ValueError, r"token ids must be ints in \[0, 264\); got \[True\]"),
        ([False, 1], {}, ValueError, r"got \[False\]"),
        ([{"content": "hi"}], {}, ValueError,
         r"a message needs a string role and a string content, got \{'content': 'hi'\}"),
        ([{"role": "user"}], {}, ValueError,
         r"a message needs a string role and a string content, got \{'role': 'user'\}"),
        ([{"role": 3, "content": "hi"}], {}, ValueError, "a message needs a string role"),
    ],
)
def test_bad_requests_fail_clearly_and_the_engine_serves_the_next(model, prompt, kwargs, error, match):
    eng = engine(model)
    session = kwargs.pop("session_id", "s")
    with pytest.raises(error, match=match):
        eng.generate(session, prompt, **{"max_new_tokens": 4, **kwargs})
    r = eng.generate("s", [72, 105, 33, 10], max_new_tokens=4)
    assert r.output == greedy_oracle(model, [72, 105, 33, 10], 4)
    eng.check()


def test_chat_messages_render_through_the_template(model):
    eng = engine(model)
    r = eng.generate("s", [{"role": "user", "content": "hi"}], max_new_tokens=3)
    assert r.prompt == TOK.render_chat([{"role": "user", "content": "hi"}])


def test_cancel_mid_decode_frees_every_block_but_the_carried_rows(model):
    gen = torch.Generator().manual_seed(12)
    eng = engine(model)
    rid = eng.submit("c", random_prompt(gen, 40), max_new_tokens=50)
    for _ in range(8):
        assert eng.step() == []
    assert eng.blocks.stats().num_used > 0 and eng.drafter_pool.stats().num_sequences == 1
    result = eng.cancel(rid)
    assert result.finish_reason == "cancelled" and 0 < len(result.output) < 50
    eng.check()
    pool = eng.drafter_pool.stats()  # the session keeps its rows (CarryRuntime.cancel)
    assert (pool.num_sequences, pool.num_carried) == (0, 1)
    assert pool.num_free_blocks + pool.num_carried_blocks == eng.drafter_pool.num_blocks
    eng.runtime.clear_slot()
    assert eng.drafter_pool.stats().num_free_blocks == eng.drafter_pool.num_blocks
    assert eng.cancel(rid) is None


def test_concurrent_sequences_match_greedy(model):
    gen = torch.Generator().manual_seed(13)
    eng = engine(model, max_num_seqs=3)
    prompts = [random_prompt(gen, n) for n in (35, 50, 20, 41)]
    ids = [eng.submit(f"s{i}", p, max_new_tokens=12) for i, p in enumerate(prompts)]
    results = {}
    while eng.has_unfinished():
        for r in eng.step():
            results[r.request_id] = r
        eng.check()
    for rid, p in zip(ids, prompts, strict=True):
        assert results[rid].output == greedy_oracle(model, p, 12)
    eng.check()


def test_engine_config_rejects_bad_values():
    with pytest.raises(ValueError, match="prefill_chunk=24 must be a multiple of block_size=16"):
        EngineConfig(prefill_chunk=24, block_size=16)
    with pytest.raises(ValueError, match="EngineConfig.block_size must be a positive int, got 0"):
        EngineConfig(block_size=0)
    with pytest.raises(ValueError, match="draft_len"):
        EngineConfig(draft_len=5)
    with pytest.raises(ValueError, match="unknown drafter policy 'x'"):
        EngineConfig(policy="x")


@pytest.fixture(scope="module")
def shipped():
    from trtllm_mtp_carry.engine.model import load_reference

    model, _ = load_reference(dtype=torch.float64)
    return model


@pytest.mark.parametrize("draft_len", [1, 2, 3])
def test_shipped_weights_speculative_equals_greedy(shipped, draft_len):
    eng = engine(shipped, draft_len=draft_len)
    messages = [{"role": "user", "content": "Here is some code:\n\n```python\ndef add(a, b):\n"
                 "    return a + b\n```"}]
    turn1 = TOK.render_chat(messages)
    r1 = eng.generate("s", turn1, max_new_tokens=40)
    assert r1.output == greedy_oracle(shipped, turn1, 40)
    turn2 = (turn1 + r1.output + ([] if r1.output[-1] == TOK.eos_id else [TOK.eos_id])
             + TOK.encode("\n") + TOK.render_message("user", "Show the first 1 line of `add`.")
             + [TOK.im_start_id, TOK.assistant_id])
    r2 = eng.generate("s", turn2, max_new_tokens=40)
    assert r2.output == greedy_oracle(shipped, turn2, 40)
    assert r1.stats.accepted > 0 and r2.stats.accepted > 0
    eng.check()


def test_drafter_pool_exhaustion_falls_back_to_plain_decoding(model, caplog):
    """Two 16-row blocks cannot hold a 60-token prompt's rows: no drafts, same tokens."""
    gen = torch.Generator().manual_seed(14)
    eng = engine(model, num_drafter_blocks=2)
    prompt = random_prompt(gen, 60)
    r = eng.generate("s", prompt, max_new_tokens=12)
    assert r.output == greedy_oracle(model, prompt, 12)
    assert (r.stats.outcome, r.stats.drafted) == ("exhausted", 0)
    assert "drafter off for the rest of the turn" in caplog.text
    eng.check()
    assert eng.drafter_pool.stats().num_free_blocks == 2 and eng.runtime.entry is None
    short = random_prompt(gen, 10)  # fits: the next request drafts again
    r2 = eng.generate("t", short, max_new_tokens=6)
    assert r2.output == greedy_oracle(model, short, 6) and r2.stats.drafted > 0


def test_admission_reserves_answer_slots_so_decoding_never_runs_out(model):
    """12 blocks of 16 hold one 60+60-token request at a time: the second waits, none fails."""
    gen = torch.Generator().manual_seed(15)
    eng = engine(model, num_target_blocks=12, max_num_seqs=2)
    prompts = [random_prompt(gen, 60), random_prompt(gen, 60)]
    ids = [eng.submit(f"s{i}", p, max_new_tokens=60) for i, p in enumerate(prompts)]
    eng.step()
    assert [s.request_id for s in eng._running] == ids[:1]  # 8 blocks reserved, 4 left
    results = {}
    while eng.has_unfinished():
        for r in eng.step():
            results[r.request_id] = r
        eng.check()
    for rid, p in zip(ids, prompts, strict=True):
        assert results[rid].output == greedy_oracle(model, p, 60)


def test_output_so_far_streams_exactly_the_final_output(model):
    eng = engine(model)
    prompt = random_prompt(torch.Generator().manual_seed(7), 40)
    rid = eng.submit("s", prompt, max_new_tokens=9)
    assert eng.output_so_far(rid) == []
    seen: list[list[int]] = []
    while True:
        results = eng.step()
        if results:
            break
        seen.append(list(eng.output_so_far(rid)))
    final = results[0].output
    assert all(final[: len(s)] == s for s in seen)  # every partial is a prefix of the answer
    assert eng.output_so_far(rid) is None  # finished: no longer known


def test_a_turn_cancelled_mid_prefill_reports_the_rows_it_adopted_as_the_runtime_counts_them(model):
    # issue 45: such a turn said drafter_rows_kept 0 while the runtime's rows_adopted grew,
    # so mtp_carry_drafter_rows_total{source="adopted"} fell behind rows_adopted under cancellations
    gen = torch.Generator().manual_seed(45)
    eng = engine(model)
    _, _, prompt2 = first_turn_then(eng, gen, "c", 40, 6, 60)  # 60 new tokens: 4+ prefill chunks
    adopted_before = eng.runtime.stats().rows_adopted
    rid = eng.submit("c", prompt2, max_new_tokens=8)
    assert eng.step() == []  # admitted (the carry adopted), one chunk of its prefill done
    result = eng.cancel(rid)
    assert result.finish_reason == "cancelled" and result.output == []
    adopted = eng.runtime.stats().rows_adopted - adopted_before
    assert result.stats.outcome_kind == "adopted" and adopted > 0
    assert result.stats.drafter_rows_kept == adopted
    eng.check()
