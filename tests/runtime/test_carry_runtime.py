"""The carry runtime on the reference engine: adopted rows equal a cold prefill's,
rows are built per prefill chunk under the sequence's own ticket, outputs never
change, each policy builds what it claims, and every refusal path is reached and safe.

Engines run in float64 so that generated tokens compare exactly.
"""

import logging
import random

import pytest
import torch
from engine_factories import engine, first_turn_then, greedy_oracle, random_prompt, tiny_model

from trtllm_mtp_carry import CarryOutcome
from trtllm_mtp_carry.runtime import ALL_POLICIES


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=5)


def first_decode_unit(eng, session, prompt, max_new_tokens=4):
    """Submit and step until the prefill (and so the drafter rows) is done; returns the sequence."""
    rid = eng.submit(session, prompt, max_new_tokens=max_new_tokens)
    while True:
        eng.step()
        seq = next((s for s in eng._running if s.request_id == rid), None)
        assert seq is not None, "finished before its prefill was done"
        if seq.phase == "decode":
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
    assert warm.build.outcome == CarryOutcome.Adopted(
        rows=first_key, appended=len(turn2) - 1 - first_key, first_key=first_key
    )
    assert warm.stats.drafter_rows_computed == len(turn2) - 1 - first_key

    cold_eng = engine(model)
    cold = first_decode_unit(cold_eng, "s", turn2)
    assert cold.build.mode == "prefill" and cold.stats.drafter_rows_computed == len(turn2) - 1
    wk, wv, wkeys = prompt_rows(eng, warm)
    ck, cv, ckeys = prompt_rows(cold_eng, cold)
    assert wkeys.tolist() == ckeys.tolist() == list(range(len(turn2) - 1))
    torch.testing.assert_close(wk, ck)  # bf16 tolerances: the rows are stored in bf16
    torch.testing.assert_close(wv, cv)


def test_warm_turn_rows_are_built_chunk_by_chunk_beside_a_rival(model):
    """After each prefill step the adopted sequence holds exactly the keys its chunks
    computed so far, while a rival's chunks land in the same steps."""
    gen = torch.Generator().manual_seed(13)
    eng = engine(model, max_num_seqs=2, prefill_chunk=16)
    turn1, r1, turn2 = first_turn_then(eng, gen, "a", 60, 6, 56)
    rid = eng.submit("a", turn2, max_new_tokens=4)
    eng.submit("b", random_prompt(gen, 80), max_new_tokens=4)
    eng.step()  # admission: the adopt decision and the kept rows, then the first chunk
    seq = next(s for s in eng._running if s.request_id == rid)
    assert seq.build.mode == "carry" and seq.build.rows_kept == seq.stats.reused_tokens
    last_keys = []
    while seq.phase == "prefill":
        last_keys.append(eng.drafter_pool.sequence(rid).last_pair_key)
        eng.step()
    last_keys.append(eng.drafter_pool.sequence(rid).last_pair_key)
    L = len(turn2)
    ends = [min(e - 1, L - 2) for e in range(16 * (seq.stats.reused_tokens // 16 + 1), L + 16, 16)]
    assert last_keys == ends and len(ends) >= 4  # each step adds exactly that chunk's keys
    while eng.has_unfinished():
        eng.step()
        eng.check()


def session_turns(gen, turns, history, span):
    """A multi-turn session: each turn extends the previous prompt + answer."""
    return [random_prompt(gen, history)] + [random_prompt(gen, span) for _ in range(turns - 1)]


def test_generated_tokens_identical_across_policies(model):
    gen = torch.Generator().manual_seed(2)
    spans = session_turns(gen, turns=4, history=50, span=20)
    outputs, rows, reused = {}, {}, {}
    for policy in ALL_POLICIES:
        eng = engine(model, policy=policy)
        prompt, outs, computed, cached = [], [], [], []
        for span in spans:
            prompt = prompt + span
            r = eng.generate("chat", prompt, max_new_tokens=10)
            outs.append(r.output)
            computed.append(r.stats.drafter_rows_computed)
            cached.append(r.stats.reused_tokens)
            prompt = prompt + r.output
            eng.check()
        outputs[policy.value], rows[policy.value], reused[policy.value] = outs, computed, cached
    assert outputs["carry"] == outputs["rebuild"] == outputs["blind"] == outputs["off"]
    # turn 1 is cold everywhere (full drafter prefill); warm turns differ by policy
    assert rows["carry"][0] == rows["rebuild"][0] == rows["blind"][0] == 49
    assert rows["off"] == [0, 0, 0, 0]
    # faithful blind builds exactly the new span's rows, as the carry appends them
    assert rows["blind"][1:] == rows["carry"][1:]
    assert rows["blind"][1:] == [20, 20, 20]  # keys from the first uncached position to L - 2
    # rebuild runs one target pass from position 0: no reuse, a row for every key
    assert reused["rebuild"] == [0, 0, 0, 0] and reused["blind"][1:] == reused["carry"][1:]
    prompt_lens = [len(r) for r in _prompts(spans, outputs["carry"])]
    assert rows["rebuild"] == [n - 1 for n in prompt_lens]


def _prompts(spans, outputs):
    prompt, out = [], []
    for span, answer in zip(spans, outputs, strict=True):
        prompt = prompt + span
        out.append(prompt)
        prompt = prompt + answer
    return out


def test_blind_warm_turn_builds_rows_for_the_new_span_only(model):
    gen = torch.Generator().manual_seed(11)
    eng = engine(model, policy="blind")
    turn1, r1, turn2 = first_turn_then(eng, gen, "s", 64, 8, 40)
    seq = first_decode_unit(eng, "s", turn2)
    start = seq.stats.reused_tokens
    assert start == len(turn1) + len(r1.output) - 1
    _, _, keys = eng.drafter_pool.gather(seq.request_id)
    assert keys.tolist() == list(range(start, len(turn2) - 1))
    assert seq.build.mode == "blind" and eng.runtime.stats().turns_blind == 1


def test_rebuild_warm_turn_computes_the_prompt_once_from_position_zero(model, monkeypatch):
    gen = torch.Generator().manual_seed(12)
    eng = engine(model, policy="rebuild")
    turn1, r1, turn2 = first_turn_then(eng, gen, "s", 64, 8, 40)
    computed = []
    forward = eng.model.forward_target

    def counting(tokens, start_pos, cache, ssm_trace=False):
        computed.append((start_pos, start_pos + tokens.shape[0]))
        return forward(tokens, start_pos, cache, ssm_trace)

    monkeypatch.setattr(eng.model, "forward_target", counting)
    seq = first_decode_unit(eng, "s", turn2)
    # every prompt position computed exactly once, from 0, in chunks
    assert [p for a, b in computed for p in range(a, b)] == list(range(len(turn2)))
    assert seq.build.mode == "rebuild" and seq.stats.reused_tokens == 0
    _, _, keys = eng.drafter_pool.gather(seq.request_id)
    assert keys.tolist() == list(range(len(turn2) - 1))
    assert eng.runtime.stats().rows_rebuilt == len(turn2) - 1


def test_retokenized_answer_tail_truncates_instead_of_refusing(model):
    gen = torch.Generator().manual_seed(3)
    eng = engine(model)
    turn1 = random_prompt(gen, 60)
    r1 = eng.generate("s", turn1, max_new_tokens=12)
    # the template renders the answer's last 3 tokens differently on the next turn
    common = len(turn1) + len(r1.output) - 3
    turn2 = turn1 + r1.output[:-3] + [ord("#")] * 3 + random_prompt(gen, 20)
    seq = first_decode_unit(eng, "s", turn2)
    assert isinstance(seq.build.outcome, CarryOutcome.Adopted)
    assert seq.build.outcome.rows == common - 1  # keys 0 .. common-2 survive
    r2_tokens = []
    while eng.has_unfinished():
        r2_tokens += [r.output for r in eng.step()]
    assert r2_tokens == [greedy_oracle(model, turn2, 4)]
    eng.check()


def test_carry_is_armed_at_any_dispatch_cap_and_adopts_beside_other_sequences(model):
    from trtllm_mtp_carry.core import DrafterContext, carry_armed_with

    assert carry_armed_with(DrafterContext(prefill=True, carry=True), multi_seq=True) is True
    gen = torch.Generator().manual_seed(4)
    eng = engine(model, max_num_seqs=4)
    turn1 = random_prompt(gen, 60)
    r1 = eng.generate("s", turn1, max_new_tokens=6)
    rid = eng.submit("s", turn1 + r1.output + random_prompt(gen, 40), max_new_tokens=6)
    for name in ("x", "y", "z"):  # rivals prefill in the same steps, chunk for chunk
        eng.submit(name, random_prompt(gen, 70), max_new_tokens=6)
    results = {}
    while eng.has_unfinished():
        results.update((r.request_id, r) for r in eng.step())
        eng.check()
    assert results[rid].stats.outcome_kind == "adopted"
    assert eng.runtime.stats().armed is True


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
    assert lines[0].endswith("no carried state: never_carried") and "adopted rows=" in lines[2]


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
        "foreign_hiddens": 0, "no_hiddens": 0, "fault": 0,
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

    def checked_prepare(seq_id, ticket, session_hash, prompt, prefill_from, policy=None, warm=None,
                        session=None):
        prep = prepare(seq_id, ticket, session_hash, prompt, prefill_from, policy, warm, session)
        if prep.outcome is not None:
            seen.append(prep.outcome.kind)
            if prep.outcome.adopted:  # the kept rows are exactly this session's own rows
                kept = prep.outcome.rows
                k, _, _ = eng.drafter_pool.gather(seq_id)
                assert torch.equal(k[:kept], deposited[session_hash][:kept])
        return prep

    def recording_finish(seq_id, session_hash, tokens, policy=None, ticket=0, session=None, share=None):
        finish(seq_id, session_hash, tokens, policy, ticket, session, share)
        entry = eng.runtime.entry
        if entry is not None and entry.session_hash == session_hash and entry.tokens == list(tokens):
            deposited[session_hash] = eng.drafter_pool.gather_slot()[0].clone()

    eng.runtime.prepare, eng.runtime.finish = checked_prepare, recording_finish
    return seen


def test_isolation_under_random_interleavings(model):
    """Seeded interleavings of sessions and concurrent sequences (submit, step, cancel,
    finish) reach every refusal; outputs equal greedy, nothing leaks, every decision counted."""
    rng = random.Random(1234)
    gen = torch.Generator().manual_seed(1234)
    # conversations outgrow the 200-row hidden store: their warm spans are not captured
    eng = engine(model, max_num_seqs=3, prefill_chunk=16, hidden_capacity=200)
    spy = StoreSpy(eng.hidden_store)
    seen = watch_runtime(eng)
    sessions = {name: [] for name in ("a", "b", "c")}  # session -> its conversation so far
    inflight = {}  # request id -> session
    last = "a"
    cancelled = 0
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
        if inflight and rng.random() < 0.05:  # a user hangs up mid-turn
            rid = rng.choice(sorted(inflight))
            assert eng.cancel(rid).finish_reason == "cancelled"
            del inflight[rid]
            cancelled += 1
            eng.check()
        for result in eng.step():
            last = inflight.pop(result.request_id)
            sessions[last] = result.prompt + result.output
            n = len(result.output) if result.finish_reason == "stop" else 6
            assert result.output == greedy_oracle(model, result.prompt, n)[: len(result.output)]
        eng.check()
    while eng.has_unfinished():
        eng.step()
        eng.check()
    assert cancelled > 0
    assert {"adopted", "foreign_session", "prefix_mismatch", "no_hiddens"} <= set(seen)
    assert "foreign_hiddens" not in seen  # rows are built per chunk under the ticket
    assert sum(eng.runtime.stats().outcomes.values()) == len(seen)  # every decision counted
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


@pytest.mark.parametrize("steps_before_rival", [0, 1, 2, 3])
def test_rival_prefill_chunks_anywhere_never_refuse_or_skip_keys(model, steps_before_rival):
    # b's chunks land between a's chunks (or right after a's last one): the decision
    # was taken at admission and each chunk's rows are built before b can write
    seen, eng = warm_turn_with_a_rival(model, rival_prompt_len=64,
                                       steps_before_rival=steps_before_rival)
    assert seen == ["no_carry", "adopted", "no_carry"]
    assert eng.runtime.stats().keys_skipped == 0 and eng.runtime.stats().turns_blind == 0


def test_span_past_the_hidden_store_capacity_is_no_hiddens(model):
    # refused at admission: a's entry stays carried, so b's turn is judged against it
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
    assert eng.runtime.entry is None and eng.drafter_pool.book.slot is None
    eng.check()
