"""The session server in process (no Triton): streaming, ordering, session end, errors.

It drives a real engine (the tiny float64 test model); the sink records what
a response sender would have sent.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from engine_factories import TOK, engine, greedy_oracle, random_prompt, tiny_model

from trtllm_mtp_carry.bench.replay import next_prompt
from trtllm_mtp_carry.serve.options import ServeOptions
from trtllm_mtp_carry.serve.session_server import SessionServer, TurnRequest


class ListSink:
    """Records partial/final/error responses; `done` is set by the final one."""

    def __init__(self) -> None:
        self.partials: list[list[int]] = []
        self.texts: list[str] = []
        self.result = None
        self.errors: list[str] = []
        self.done = threading.Event()

    def partial(self, ids, text):
        self.partials.append(ids)
        self.texts.append(text)

    def final(self, ids, text, result):
        self.partials.append(ids)
        self.texts.append(text)
        self.result = result
        self.done.set()

    def error(self, message):
        self.errors.append(message)
        self.done.set()

    def cancelled(self):
        return False


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def serve(model, idle_timeout_s=None, **hooks):
    server = SessionServer(engine(model), ServeOptions(max_tokens=12), idle_timeout_s, **hooks)
    server.start()
    return server


def test_concurrent_sessions_stream_partials_that_add_up_to_the_greedy_output(model):
    gen = torch.Generator().manual_seed(3)
    prompts = [random_prompt(gen, 40 + 9 * i) for i in range(3)]
    server = serve(model)
    try:
        sinks = [ListSink() for _ in prompts]
        for i, (p, sink) in enumerate(zip(prompts, sinks, strict=True)):
            server.enqueue(TurnRequest(corrid=10 + i, start=True, end=True, input_ids=p), sink)
        for sink in sinks:
            assert sink.done.wait(120) and not sink.errors
    finally:
        server.stop()
    for p, sink in zip(prompts, sinks, strict=True):
        out = greedy_oracle(model, p, 12)
        assert sink.result.output == out
        assert [t for ids in sink.partials for t in ids] == out
        assert len(sink.partials) > 1  # streamed, not one final blob
        body = out[:-1] if out[-1:] == [TOK.eos_id] else out
        assert "".join(sink.texts) == TOK.decode(body)


def test_a_text_turn_queued_behind_its_sessions_running_turn_extends_that_turns_answer(model):
    gen = torch.Generator().manual_seed(4)
    first = random_prompt(gen, 50)
    server = serve(model)
    try:
        a, b = ListSink(), ListSink()
        server.enqueue(TurnRequest(corrid=7, start=True, input_ids=first), a)
        server.enqueue(TurnRequest(corrid=7, start=False, end=True, text_input="and then?"), b)
        assert a.done.wait(120) and b.done.wait(120) and not a.errors and not b.errors
    finally:
        server.stop()
    second = next_prompt(TOK, first, a.result.output, "and then?")
    assert b.result.prompt == second
    assert b.result.output == greedy_oracle(model, second, 12)
    assert b.result.stats.outcome_kind == "adopted"


def test_an_idle_session_is_ended_and_its_carried_rows_freed(model):
    gen = torch.Generator().manual_seed(5)
    prompt = random_prompt(gen, 40)
    ended = []
    server = serve(model, idle_timeout_s=0.3, on_forget=lambda cause, rows: ended.append((cause, rows)))
    try:
        sink = ListSink()
        server.enqueue(TurnRequest(corrid=9, start=True, input_ids=prompt), sink)
        assert sink.done.wait(120) and not sink.errors
        deadline = time.monotonic() + 30
        while not ended and time.monotonic() < deadline:
            time.sleep(0.05)
        late = ListSink()
        server.enqueue(TurnRequest(corrid=9, start=False, text_input="more"), late)
        assert late.done.wait(30)
    finally:
        server.stop()
    assert ended == [("idle", len(prompt) + len(sink.result.output) - 1)]
    assert server.engine.runtime.entry is None
    assert late.errors == ["unknown session CORRID=9: its first request must set START "
                           "(a session idle 0.3 s ends)"]


@pytest.mark.parametrize("request_, message", [
    (TurnRequest(corrid=1, start=True), "needs text_input"),
    (TurnRequest(corrid=1, start=True, text_input="a", input_ids=[1]), "both text_input and input_ids"),
    (TurnRequest(corrid=1, start=True, input_ids=[]), "input_ids is empty"),
    (TurnRequest(corrid=1, start=True, input_ids=[1], max_tokens=0), "max_tokens must be >= 1, got 0"),
    (TurnRequest(corrid=1, start=True, input_ids=[1], drafter_policy="x"), "drafter_policy must be one of"),
    (TurnRequest(corrid=0, start=True, input_ids=[1]), "CORRID 0 is not a session"),
    (TurnRequest(corrid=1, start=True, input_ids=[1, 264]), "token ids must be ints in [0, 264); got [264]"),
    (TurnRequest(corrid=1, start=False, input_ids=[1]), "unknown session CORRID=1"),
])
def test_a_bad_request_gets_one_error_and_the_next_request_is_served(model, request_, message):
    server = serve(model)
    try:
        bad, good = ListSink(), ListSink()
        server.enqueue(request_, bad)
        server.enqueue(TurnRequest(corrid=2, start=True, end=True, input_ids=[72, 105, 33]), good)
        assert bad.done.wait(60) and good.done.wait(120)
    finally:
        server.stop()
    assert len(bad.errors) == 1 and message in bad.errors[0] and bad.result is None
    assert not good.errors and good.result.output == greedy_oracle(model, [72, 105, 33], 12)
    server.engine.check()


def test_a_malformed_start_still_ends_the_sessions_previous_conversation(model):
    gen = torch.Generator().manual_seed(6)
    prompt = random_prompt(gen, 40)
    ended = []
    server = serve(model, on_forget=lambda cause, rows: ended.append((cause, rows)))
    try:
        first, bad, cont = ListSink(), ListSink(), ListSink()
        server.enqueue(TurnRequest(corrid=5, start=True, input_ids=prompt), first)
        assert first.done.wait(120) and not first.errors
        server.enqueue(TurnRequest(corrid=5, start=True, input_ids=[]), bad)
        server.enqueue(TurnRequest(corrid=5, text_input="go on"), cont)
        assert bad.done.wait(30) and cont.done.wait(30)
    finally:
        server.stop()
    assert bad.errors == ["input_ids is empty"]
    assert ended == [("restart", len(prompt) + len(first.result.output) - 1)]
    assert cont.errors == ["unknown session CORRID=5: its first request must set START"]
