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
    second = TOK.next_prompt(first, a.result.output, "and then?")
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


class CancelledAfterFirstPartial(ListSink):
    """A client that cancels once its first tokens arrived."""

    def cancelled(self):
        return bool(self.partials)


class SlowClient(ListSink):
    """A client whose every partial response takes 0.4 s to deliver."""

    def partial(self, ids, text):
        time.sleep(0.4)
        super().partial(ids, text)


def test_a_cancelled_turn_gets_one_final_error_and_is_counted_and_its_session_serves_on(model):
    gen = torch.Generator().manual_seed(7)
    prompt = random_prompt(gen, 40)
    reasons = []
    server = serve(model, on_error=reasons.append)
    try:
        cancelled, after = CancelledAfterFirstPartial(), ListSink()
        server.enqueue(TurnRequest(corrid=11, start=True, input_ids=prompt), cancelled)
        assert cancelled.done.wait(120)
        server.enqueue(TurnRequest(corrid=11, end=True, input_ids=prompt), after)
        assert after.done.wait(120)
    finally:
        server.stop()
    assert cancelled.errors == ["the request was cancelled"] and cancelled.result is None
    assert reasons == ["cancelled"]
    assert not after.errors and after.result.output == greedy_oracle(model, prompt, 12)
    server.engine.check()


def test_a_turn_running_past_max_turn_s_is_cancelled_with_an_error_naming_the_limit(model):
    gen = torch.Generator().manual_seed(8)
    prompt = random_prompt(gen, 40)
    reasons = []
    server = SessionServer(engine(model), ServeOptions(max_tokens=12, max_turn_s=1), on_error=reasons.append)
    server.start()
    try:
        slow = SlowClient()
        server.enqueue(TurnRequest(corrid=12, start=True, end=True, input_ids=prompt), slow)
        assert slow.done.wait(120)
    finally:
        server.stop()
    assert slow.errors == ["the turn ran past max_turn_s=1 s (counted from its arrival) and was cancelled"]
    assert reasons == ["turn_timeout"]
    server.engine.check()


def test_every_error_response_is_counted_once_by_its_reason(model):
    reasons = []
    server = serve(model, on_error=reasons.append)
    try:
        sinks = [ListSink() for _ in range(3)]
        server.enqueue(TurnRequest(corrid=13, start=True, text_input=""), sinks[0])
        server.enqueue(TurnRequest(corrid=14, start=True, input_ids=[1, 264]), sinks[1])
        server.enqueue(TurnRequest(corrid=15, text_input="more"), sinks[2])
        assert all(s.done.wait(60) for s in sinks)
    finally:
        server.stop()
    assert [len(s.errors) for s in sinks] == [1, 1, 1]
    assert sinks[0].errors == ["text_input is empty (''); send the user's message"]
    assert reasons == ["invalid_request", "invalid_request", "unknown_session"]



class CancelledAtOnce(ListSink):
    """A client that cancelled before its request ran."""

    def cancelled(self):
        return True


class CancelledWhen(ListSink):
    """A client that cancels once `other` has streamed tokens."""

    def __init__(self, other):
        super().__init__()
        self.other = other

    def cancelled(self):
        return bool(self.other.partials)


def test_a_request_cancelled_while_queued_is_never_started_and_counts_once_as_unadmitted(model):
    # issue 45: a request cancelled while it waited (here behind its session's running turn;
    # and in the engine's queue behind another session) still ran, or left with no count at all
    gen = torch.Generator().manual_seed(9)
    prompt = random_prompt(gen, 40)
    turns, unadmitted, reasons = [], [], []
    server = SessionServer(engine(model, max_num_seqs=1), ServeOptions(max_tokens=12), None,
                           on_turn=turns.append, on_unadmitted=unadmitted.append, on_error=reasons.append)
    server.start()
    try:
        first = ListSink()
        queued, in_engine = CancelledAtOnce(), CancelledWhen(first)
        server.enqueue(TurnRequest(corrid=21, start=True, input_ids=prompt), first)
        server.enqueue(TurnRequest(corrid=21, input_ids=prompt), queued)  # waits for turn 1 here
        server.enqueue(TurnRequest(corrid=22, start=True, input_ids=prompt), in_engine)  # in the engine's queue
        for sink in (first, queued, in_engine):
            assert sink.done.wait(120)
    finally:
        server.stop()
    assert first.result is not None and not first.errors
    assert queued.errors == ["the request was cancelled before it started"] and queued.partials == []
    assert in_engine.errors == ["the request was cancelled"] and in_engine.partials == []
    assert [t.request_id for t in turns] == [first.result.request_id]  # the one admitted turn
    assert unadmitted == ["cancelled", "cancelled"]
    assert reasons == ["cancelled", "cancelled"]


def test_a_call_runs_on_the_stepping_thread_between_steps_and_inline_once_stopped(model):
    gen = torch.Generator().manual_seed(9)
    server = serve(model)
    seen: list[tuple[str, bool]] = []
    try:
        sink = ListSink()
        server.enqueue(TurnRequest(corrid=77, start=True, end=True, input_ids=random_prompt(gen, 40)), sink)
        ran = server.call(lambda: seen.append((threading.current_thread().name, sink.done.is_set())) or 7)
        assert ran.result(120) == 7
        failed = server.call(lambda: 1 // 0)
        with pytest.raises(ZeroDivisionError):
            failed.result(120)
        assert sink.done.wait(120) and not sink.errors
    finally:
        server.stop()
    assert seen == [("mtp-carry-engine", False)]  # the engine's own thread, before the turn finished
    after = server.call(lambda: threading.current_thread().name)
    assert after.result(0) == threading.current_thread().name  # stopped: at once, in the caller's thread
