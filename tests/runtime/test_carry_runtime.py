"""The carry runtime on the reference engine: adopted rows equal a cold prefill's,
outputs never change, and every refusal path is reached and safe.

Engines run in float64 so that generated tokens compare exactly.
"""

import logging
import random

import pytest
import torch
from engine_factories import engine, first_turn_then, greedy_oracle, random_prompt, tiny_model

from trtllm_mtp_carry import CarryOutcome
from trtllm_mtp_carry.runtime import ALL_POLICIES, CarryRuntime


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=5)


def first_decode_unit(eng, session, prompt, max_new_tokens=4):
    """Submit and step until the drafter is prepared; returns the live sequence."""
    rid = eng.submit(session, prompt, max_new_tokens=max_new_tokens)
    while True:
        eng.step()
        seq = next((s for s in eng._running if s.request_id == rid), None)
        assert seq is not None, "finished before its drafter was prepared"
        if seq.prep is not None:
            return seq


def prompt_rows(eng, seq):
    """The sequence's drafter rows for the prompt's keys 0 .. L-2."""
    k, v, keys = eng.drafter_pool.gather(seq.request_id)
    keep = keys <= len(seq.prompt) - 2
    return k[keep], v[keep], keys[keep]


def test_carried_rows_equal_a_cold_prefill_and_only_the_new_span_is_computed(model):
    gen = torch.Generator().manual_seed(1)
    eng = engine(model)
    turn1, r1, turn2 = first_turn_then(eng, gen, "s", 60, 12, 25)
    warm = first_decode_unit(eng, "s", turn2)
    first_key = len(turn1) + len(r1.output) - 1  # the first key the previous turn never computed
    assert warm.prep.outcome == CarryOutcome.Adopted(
        rows=first_key, appended=len(turn2) - 1 - first_key, first_key=first_key
    )
    assert warm.stats.drafter_rows_computed == len(turn2) - 1 - first_key

    cold_eng = engine(model)
    cold = first_decode_unit(cold_eng, "s", turn2)
    assert cold.prep.mode == "prefill" and cold.stats.drafter_rows_computed == len(turn2) - 1
    wk, wv, wkeys = prompt_rows(eng, warm)
    ck, cv, ckeys = prompt_rows(cold_eng, cold)
    assert wkeys.tolist() == ckeys.tolist() == list(range(len(turn2) - 1))
    torch.testing.assert_close(wk, ck)  # bf16 tolerances: the rows are stored in bf16
    torch.testing.assert_close(wv, cv)


def session_turns(gen, turns, history, span):
    """A multi-turn session: each turn extends the previous prompt + answer."""
    return [random_prompt(gen, history)] + [random_prompt(gen, span) for _ in range(turns - 1)]


def test_generated_tokens_identical_across_policies(model):
    gen = torch.Generator().manual_seed(2)
    spans = session_turns(gen, turns=4, history=50, span=20)
    outputs = {}
    rows = {}
    for policy in ALL_POLICIES:
        eng = engine(model, policy=policy)
        prompt, outs, computed = [], [], []
        for span in spans:
            prompt = prompt + span
            r = eng.generate("chat", prompt, max_new_tokens=10)
            outs.append(r.output)
            computed.append(r.stats.drafter_rows_computed)
            prompt = prompt + r.output
            eng.check()
        outputs[policy.value], rows[policy.value] = outs, computed
    assert outputs["carry"] == outputs["rebuild"] == outputs["blind"] == outputs["off"]
    # turn 1 is cold everywhere (full drafter prefill); warm turns differ by policy
    assert rows["carry"][0] == rows["rebuild"][0] == rows["blind"][0] == 49
    assert rows["off"] == [0, 0, 0, 0] and rows["blind"][1:] == [0, 0, 0]
    assert all(c < r for c, r in zip(rows["carry"][1:], rows["rebuild"][1:], strict=True))


def test_retokenized_answer_tail_truncates_instead_of_refusing(model):
    gen = torch.Generator().manual_seed(3)
    eng = engine(model)
    turn1 = random_prompt(gen, 60)
    r1 = eng.generate("s", turn1, max_new_tokens=12)
    # the template renders the answer's last 3 tokens differently on the next turn
    common = len(turn1) + len(r1.output) - 3
    turn2 = turn1 + r1.output[:-3] + [ord("#")] * 3 + random_prompt(gen, 20)
    seq = first_decode_unit(eng, "s", turn2)
    assert isinstance(seq.prep.outcome, CarryOutcome.Adopted)
    assert seq.prep.outcome.rows == common - 1  # keys 0 .. common-2 survive
    r2_tokens = []
    while eng.has_unfinished():
        r2_tokens += [r.output for r in eng.step()]
    assert r2_tokens == [greedy_oracle(model, turn2, 4)]
    eng.check()


def test_unarmed_runtime_runs_warm_turns_blind_and_says_why(model, caplog):
    eng = engine(model)
    with caplog.at_level(logging.WARNING, logger="trtllm_mtp_carry"):
        eng.runtime = CarryRuntime(eng, "carry", multi_seq=True)
    assert [r.getMessage() for r in caplog.records] == [
        "mtp carry configured but not armed: MTP dispatches several sequences per step "
        "(multi-sequence mode, set by the engine); warm turns will run the drafter blind"
    ]
    gen = torch.Generator().manual_seed(4)
    turn1 = random_prompt(gen, 60)
    r1 = eng.generate("s", turn1, max_new_tokens=6)
    r2 = eng.generate("s", turn1 + r1.output + random_prompt(gen, 10), max_new_tokens=6)
    assert r2.stats.reused_tokens == len(turn1) + len(r1.output) - 1
    assert (r2.stats.outcome, r2.stats.drafter_rows_computed) == ("blind", 0)
    assert eng.runtime.stats().armed is False and eng.runtime.stats().deposits == 0
    eng.check()


def test_debug_log_one_line_per_store_and_adopt(model, monkeypatch, caplog):
    monkeypatch.setenv("TRTLLM_MTP_CARRY_DEBUG", "1")
    gen = torch.Generator().manual_seed(6)
    eng = engine(model)
    with caplog.at_level(logging.INFO, logger="trtllm_mtp_carry"):
        turn1 = random_prompt(gen, 40)
        r1 = eng.generate("s", turn1, max_new_tokens=6)
        eng.generate("s", turn1 + r1.output + random_prompt(gen, 10), max_new_tokens=6)
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(":")[0] for line in lines] == [
        "mtp carry adopt", "mtp carry store", "mtp carry adopt", "mtp carry store",
    ]
    assert lines[0].endswith("no carried state") and "adopted rows=" in lines[2]


def test_stats_count_every_outcome(model):
    gen = torch.Generator().manual_seed(7)
    eng = engine(model)
    turn1 = random_prompt(gen, 40)
    r1 = eng.generate("a", turn1, max_new_tokens=6)
    eng.generate("b", random_prompt(gen, 30), max_new_tokens=6)  # refuses a's rows, then replaces them
    eng.generate("a", turn1 + r1.output + random_prompt(gen, 8), max_new_tokens=6)
    stats = eng.runtime.stats()
    assert stats.outcomes == {
        "adopted": 0, "no_carry": 1, "prefix_mismatch": 0, "foreign_session": 2,
        "foreign_hiddens": 0, "no_hiddens": 0,
    }
    assert (stats.armed, stats.deposits, stats.rows_adopted) == (True, 3, 0)


class StoreSpy:
    """Wraps the hidden store: every read must be under the ticket that owns the rows."""

    def __init__(self, store):
        self.store, self.reads = store, []
        original = store.read

        def read(ticket, a, b, out=None):
            self.reads.append((ticket, store.range.owner))
            assert ticket == store.range.owner != 0
            return original(ticket, a, b, out)

        store.read = read


def watch_runtime(eng):
    """Record every carry decision, and check adopted rows against the session's own deposit."""
    seen, deposited = [], {}  # outcome kinds; session hash -> k rows it deposited
    prepare, finish = eng.runtime.prepare, eng.runtime.finish

    def checked_prepare(seq_id, ticket, session_hash, prompt, cold, policy=None):
        prep = prepare(seq_id, ticket, session_hash, prompt, cold, policy)
        if prep.outcome is not None:
            seen.append(prep.outcome.kind)
            if prep.outcome.adopted:  # the kept rows are exactly this session's own rows
                kept = prep.outcome.rows
                k, _, _ = eng.drafter_pool.gather(seq_id)
                assert torch.equal(k[:kept], deposited[session_hash][:kept])
        return prep

    def recording_finish(seq_id, session_hash, tokens, policy=None, ticket=0):
        finish(seq_id, session_hash, tokens, policy, ticket)
        entry = eng.runtime.entry
        if entry is not None and entry.session_hash == session_hash and entry.tokens == list(tokens):
            deposited[session_hash] = eng.drafter_pool.gather_slot()[0].clone()

    eng.runtime.prepare, eng.runtime.finish = checked_prepare, recording_finish
    return seen


def test_isolation_under_random_interleavings(model):
    """Seeded interleavings of sessions and concurrent sequences reach every refusal."""
    rng = random.Random(1234)
    gen = torch.Generator().manual_seed(1234)
    # conversations outgrow the 200-row hidden store: their warm spans are not captured
    eng = engine(model, max_num_seqs=3, prefill_chunk=16, hidden_capacity=200)
    spy = StoreSpy(eng.hidden_store)
    seen = watch_runtime(eng)
    sessions = {name: [] for name in ("a", "b", "c")}  # session -> its conversation so far
    inflight = {}  # request id -> session
    last = "a"
    for _ in range(300):
        if len(inflight) < 3 and rng.random() < 0.6:
            name = last if rng.random() < 0.7 else rng.choice(sorted(sessions))
            if name not in inflight.values():
                history = sessions[name]
                if len(history) > 60 and rng.random() < 0.2:  # the user edits turn 1
                    prompt = random_prompt(gen, 3) + history[3:] + random_prompt(gen, 10)
                else:  # 56 new tokens span four 16-token prefill chunks
                    prompt = history + random_prompt(gen, rng.choice([8, 20, 56]))
                rid = eng.submit(name, prompt, max_new_tokens=rng.choice([3, 6]))
                inflight[rid] = name
        for result in eng.step():
            last = inflight.pop(result.request_id)
            sessions[last] = result.prompt + result.output
        eng.check()
    while eng.has_unfinished():
        eng.step()
        eng.check()
    assert {"adopted", "foreign_session", "foreign_hiddens", "prefix_mismatch", "no_hiddens"} <= set(seen)
    assert spy.reads and all(t == o for t, o in spy.reads)
    eng.runtime.clear_slot()
    eng.check()
    assert eng.drafter_pool.stats().num_free_blocks == eng.drafter_pool.num_blocks


def warm_turn_with_a_rival(model, rival_prompt_len, steps_before_rival, **config):
    """Session a's warm turn (56 new tokens, four 16-token chunks) beside session b's prefill."""
    gen = torch.Generator().manual_seed(21)
    eng = engine(model, max_num_seqs=2, prefill_chunk=16, **config)
    seen = watch_runtime(eng)
    turn1, r1, warm = first_turn_then(eng, gen, "a", 60, 6, 56)
    eng.submit("a", warm, max_new_tokens=4)
    for _ in range(steps_before_rival):
        eng.step()
    eng.submit("b", random_prompt(gen, rival_prompt_len), max_new_tokens=30)
    while eng.has_unfinished():
        eng.step()
        eng.check()
    return seen, eng


def test_rival_chunks_before_the_last_chunk_skip_keys_below_the_store_floor(model):
    # b's chunks land between a's first chunks; a's later chunks replace b's stamp,
    # so the store's floor rises and the keys below it are skipped (no hole)
    seen, eng = warm_turn_with_a_rival(model, rival_prompt_len=32, steps_before_rival=0)
    assert seen == ["no_carry", "foreign_session", "adopted"]
    assert eng.runtime.stats().keys_skipped == 96 - 65  # floor at a's third chunk (96)


def test_rival_prefill_between_last_chunk_and_adopt_is_foreign_hiddens(model):
    # b's first chunk lands right after a's last chunk, before a's drafter is prepared
    seen, eng = warm_turn_with_a_rival(model, rival_prompt_len=64, steps_before_rival=3)
    assert seen == ["no_carry", "foreign_hiddens", "foreign_session"]
    assert eng.runtime.stats().turns_blind == 1  # a's warm turn fell back to blind


def test_span_past_the_hidden_store_capacity_is_no_hiddens(model):
    seen, eng = warm_turn_with_a_rival(model, rival_prompt_len=8, steps_before_rival=6,
                                       hidden_capacity=100)
    assert seen == ["no_carry", "no_hiddens", "foreign_session"]


def test_forget_session_frees_only_that_sessions_carried_rows(model):
    gen = torch.Generator().manual_seed(3)
    eng = engine(model)
    eng.generate("a", random_prompt(gen, 40), max_new_tokens=6)
    rows = eng.runtime.entry.rows
    assert eng.runtime.forget_session(eng.runtime.entry.session_hash ^ 1) == 0  # another session
    assert eng.runtime.forget_session(eng.runtime.entry.session_hash) == rows
    assert eng.runtime.entry is None and eng.drafter_pool.slot is None
    eng.check()
