"""Batched MTP steps: every decoding sequence drafts and verifies in one forward, and each
sequence's output equals plain greedy whatever the batch composition; admission never wedges.

Equality tests run in float64 (see test_engine.py): batching changes reduction order
only at the ~1e-16 level there, far below any argmax margin of these models.
"""

import random

import pytest
import torch
from engine_factories import engine, first_turn_then, greedy_oracle, random_prompt, tiny_model

from trtllm_mtp_carry.engine.model import DenseTargetCache
from trtllm_mtp_carry.engine.target_kv import BatchKV, PagedTargetKV, SequenceKV


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=7)


def run_all(eng, check=True):
    results = {}
    while eng.has_unfinished():
        for r in eng.step():
            results[r.request_id] = r
        if check:
            eng.check()
    return results


@torch.no_grad()
def test_batched_verify_forward_equals_each_sequence_alone(model):
    """Rows of different cached lengths and token counts, padded into one forward."""
    model = tiny_model(seed=7).double()
    gen = torch.Generator().manual_seed(1)
    kv = PagedTargetKV(model.cfg, 64, 16, torch.float64, "cpu")
    lens, news = [5, 37, 16, 1], [3, 1, 4, 2]
    seqs, dense, news_ids = [], [], []
    for b, (n, t) in enumerate(zip(lens, news, strict=True)):
        prompt = torch.tensor(random_prompt(gen, n + t))
        table = list(range(b * 16, b * 16 + 4))
        s = SequenceKV(kv, table, 0)
        model.forward_target(prompt[:n], 0, s)
        s.advance(n)
        d = DenseTargetCache(model.cfg)
        model.forward_target(prompt[:n], 0, d)
        seqs.append(s)
        dense.append(d)
        news_ids.append(prompt[n:])
    T = max(news)
    ids = torch.stack([torch.cat([x, x.new_zeros(T - len(x))]) for x in news_ids])
    hidden, logits = model.forward_target_batch(ids, BatchKV(seqs, news))
    for b, (n, t) in enumerate(zip(lens, news, strict=True)):
        h1, l1 = model.forward_target(news_ids[b], n, dense[b], ssm_trace=True)
        torch.testing.assert_close(logits[b, :t], l1, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(hidden[b, :t], h1, rtol=1e-10, atol=1e-10)
        for i in dense[b].ssm_traces:  # the state after every real token, for accept
            torch.testing.assert_close(seqs[b]._trace[i][:t], dense[b].ssm_traces[i],
                                       rtol=1e-10, atol=1e-10)


def test_decode_steps_dispatch_every_decoding_sequence_in_one_forward(model, monkeypatch):
    gen = torch.Generator().manual_seed(2)
    eng = engine(model, max_num_seqs=4)
    batch_sizes = []
    forward = eng.model.forward_target_batch

    def spy(tokens, cache):
        batch_sizes.append(tokens.shape[0])
        return forward(tokens, cache)

    monkeypatch.setattr(eng.model, "forward_target_batch", spy)
    prompts = [random_prompt(gen, 20) for _ in range(4)]
    for i, p in enumerate(prompts):
        eng.submit(f"s{i}", p, max_new_tokens=40)
    results = run_all(eng)
    assert max(batch_sizes) == 4
    for r in results.values():
        assert r.output == greedy_oracle(model, r.prompt, 40)


@pytest.mark.parametrize("seed", range(4))
def test_random_batch_compositions_equal_greedy(model, seed):
    """Mixed prompt lengths, answer lengths, draft lengths, policies and arrival times;
    finished sessions come back with a warm turn under a random policy."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    eng = engine(model, max_num_seqs=rng.choice([2, 3, 5]))
    policies = ["carry", "blind", "rebuild", "off"]
    pending = [(f"s{i}", random_prompt(gen, rng.randint(3, 70))) for i in range(6)]
    results, want, session_of = {}, {}, {}
    warm_turns = 0
    while pending or eng.has_unfinished():
        if pending and rng.random() < 0.5:
            session, prompt = pending.pop(rng.randrange(len(pending)))
            n = rng.randint(1, 25)
            rid = eng.submit(session, prompt, max_new_tokens=n, draft_len=rng.randint(0, 3),
                             policy=rng.choice(policies))
            want[rid], session_of[rid] = greedy_oracle(model, prompt, n), session
        for r in eng.step():
            results[r.request_id] = r
            if warm_turns < 6 and rng.random() < 0.6:  # the session's next turn
                pending.append((session_of[r.request_id],
                                r.prompt + r.output + random_prompt(gen, rng.randint(1, 40))))
                warm_turns += 1
        eng.check()
    assert {rid: r.output for rid, r in results.items()} == want
    assert any(r.stats.reused_tokens for r in results.values())  # warm turns were batched too


def test_cancel_mid_batch_leaves_the_others_exact(model):
    gen = torch.Generator().manual_seed(3)
    eng = engine(model, max_num_seqs=4)
    prompts = [random_prompt(gen, n) for n in (30, 45, 18, 60)]
    ids = [eng.submit(f"s{i}", p, max_new_tokens=30) for i, p in enumerate(prompts)]
    while not all(eng.output_so_far(rid) for rid in ids):  # everyone is decoding
        eng.step()
    for _ in range(2):
        eng.step()
    cancelled = eng.cancel(ids[1])
    assert cancelled is not None and cancelled.finish_reason == "cancelled"
    eng.check()
    results = run_all(eng)
    assert ids[1] not in results
    for rid, p in zip(ids, prompts, strict=True):
        if rid != ids[1]:
            assert results[rid].output == greedy_oracle(model, p, 30)
    eng.check()


def test_warm_turn_that_fills_the_target_pool_is_served_and_the_engine_goes_on(model):
    """Issue 8: max_model_len=1024, 64 blocks of 16, a second turn asking for every
    remaining token. Its warm plan pins the copy-on-write source and cannot fit, so it
    is admitted cold; it never wedges the queue."""
    gen = torch.Generator().manual_seed(4)
    eng = engine(model, max_model_len=1024, num_target_blocks=64, draft_len=2)
    turn1, r1, turn2 = first_turn_then(eng, gen, "s", 37, 8, 20)
    assert len(turn1 + r1.output) % 16  # the cached tail is a partial block: copy-on-write
    remaining = 1024 - len(turn2) - 2
    r2 = eng.generate("s", turn2, max_new_tokens=remaining)
    assert r2.finish_reason in ("stop", "length") and r2.stats.reused_tokens == 0
    assert r2.output[:40] == greedy_oracle(model, turn2, 40)  # (the whole answer is slow to check)
    eng.check()
    r3 = eng.generate("t", [72, 105, 33], max_new_tokens=4)
    assert r3.output == greedy_oracle(model, [72, 105, 33], 4)
    eng.check()


def test_a_request_larger_than_the_pool_is_refused_at_submit(model):
    eng = engine(model, max_model_len=2048, num_target_blocks=64)
    with pytest.raises(ValueError, match="the request needs 65 KV blocks, the engine has 64"):
        eng.submit("s", [72] * 1000, max_new_tokens=24, draft_len=2)
    assert not eng.has_unfinished()


def test_a_queued_request_waits_for_blocks_and_then_runs(model):
    gen = torch.Generator().manual_seed(5)
    eng = engine(model, max_model_len=256, num_target_blocks=16, max_num_seqs=4)
    a = random_prompt(gen, 40)
    b = random_prompt(gen, 40)
    ra = eng.submit("a", a, max_new_tokens=150)  # holds 12 of the 16 blocks
    rb = eng.submit("b", b, max_new_tokens=150)  # cannot fit beside it: waits
    eng.step()
    assert eng.output_so_far(rb) == [] and len(eng._running) == 1
    results = run_all(eng)
    assert results[ra].output == greedy_oracle(model, a, 150)
    assert results[rb].output == greedy_oracle(model, b, 150)
