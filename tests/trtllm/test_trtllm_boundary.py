"""Nothing crosses the boundary: no exception leaves the carry's resource manager.

PyExecutor calls every `BaseResourceManager` method of every manager in its loop
(`resource_manager.py`: `get_max_resource_count`, `get_needed_resource_to_completion`,
`add_dummy_requests`, `prepare_resources`, `update_resources`, `free_resources`,
`shutdown`); an exception out of one reaches the executor's loop. Each test injects
an exception at one call the carry makes (through what the stand-in exposes: the draft
manager's `get_batch_cache_indices` / `get_buffers`, or the carry's own store and
identity) and pins what must happen instead: the turn runs blind, that request's carry
state is dropped (skipped `fault`), the cause is counted by kind and step and logged
once per kind, nothing is written, and the executor serves the next requests with the
outputs TensorRT-LLM gives without the carry. On the STAND-IN: no TensorRT-LLM ran.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from standin_helpers import CHUNK, make_llm, padded, user_tokens

from trtllm_mtp_carry.service import FAULT_STEPS
from trtllm_mtp_carry.trtllm import attach
from trtllm_mtp_carry.trtllm import manager as manager_module
from trtllm_mtp_carry.trtllm.standin import ConversationParams, LlmRequest, StandinLLM

MAX_NEW = 12
KINDS: list[type[Exception]] = [KeyError, RuntimeError, ValueError, TypeError, IndexError,
                                torch.OutOfMemoryError, AttributeError, ZeroDivisionError,
                                AssertionError, OSError]

Inject = Callable[[StandinLLM, Any, LlmRequest, type[Exception]], Callable[[], None]]


def _raise(kind: type[Exception]) -> None:
    raise kind("injected")


def _pages_for(llm: StandinLLM, target: LlmRequest, kind: type[Exception]) -> Callable[[], None]:
    """The draft IndexMapper does not hold `target`: get_batch_cache_indices raises for it."""
    draft = llm.executor.draft
    real = draft.get_batch_cache_indices

    def get_batch_cache_indices(ids: list[int], *args: Any, **kwargs: Any) -> Any:
        if target.py_request_id in ids:
            _raise(kind)
        return real(ids, *args, **kwargs)

    draft.get_batch_cache_indices = get_batch_cache_indices
    return lambda: setattr(draft, "get_batch_cache_indices", real)


def at_scatter_pages(llm: StandinLLM, carry: Any, target: LlmRequest, kind: type[Exception]) -> Callable[[], None]:
    return _pages_for(llm, target, kind)


def at_scatter_buffers(llm: StandinLLM, carry: Any, target: LlmRequest, kind: type[Exception]) -> Callable[[], None]:
    """The draft manager's get_buffers raises once (the first warm request asks first)."""
    draft = llm.executor.draft
    real = draft.get_buffers
    calls = []

    def get_buffers(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            _raise(kind)
        return real(*args, **kwargs)

    draft.get_buffers = get_buffers
    return lambda: setattr(draft, "get_buffers", real)


def at_prepare_identity(llm: StandinLLM, carry: Any, target: LlmRequest, kind: type[Exception]) -> Callable[[], None]:
    """Reading the request's session raises (a field the build does not have as expected)."""
    real = manager_module.request_session

    def request_session(request: Any) -> Any:
        if request is target:
            _raise(kind)
        return real(request)

    manager_module.request_session = request_session  # type: ignore[assignment]
    return lambda: setattr(manager_module, "request_session", real)


def at_prepare_judge(llm: StandinLLM, carry: Any, target: LlmRequest, kind: type[Exception]) -> Callable[[], None]:
    """The service's judgement raises (the first warm request judged)."""
    service = carry.manager.service
    real = service.judge
    calls = []

    def judge(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            _raise(kind)
        return real(*args, **kwargs)

    service.judge = judge
    return lambda: delattr(service, "judge")


def at_scatter_rows(llm: StandinLLM, carry: Any, target: LlmRequest, kind: type[Exception],
                    every: bool = False) -> Callable[[], None]:
    """The scatter of the carried rows into the pages raises (the first warm request's, or with
    `every` each one): it only read the entry's rows, so the entry stays where it was."""
    codec = carry.manager.service.home.codec
    real = codec.scatter_pages
    own = "scatter_pages" in vars(codec)
    calls = []

    def scatter_pages(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if every or len(calls) == 1:
            _raise(kind)
        return real(*args, **kwargs)

    codec.scatter_pages = scatter_pages
    return lambda: setattr(codec, "scatter_pages", real) if own else delattr(codec, "scatter_pages")


POINTS: dict[str, tuple[Inject, str, str]] = {
    # name -> (injection, the step counted, session a's turn-3 outcome: a fault before any row
    # moved, or in the scatter (which only reads the entry's rows), leaves turn 1's rows where
    # they were, to adopt)
    "scatter-get_batch_cache_indices": (at_scatter_pages, "prepare", "adopted"),
    "scatter-get_buffers": (at_scatter_buffers, "prepare", "adopted"),
    "scatter-rows": (at_scatter_rows, "prepare", "adopted"),
    "prepare-identity": (at_prepare_identity, "prepare", "adopted"),
    "prepare-judge": (at_prepare_judge, "prepare", "adopted"),
}


def _turns(policy: str, inject: Inject | None = None, kind: type[Exception] = KeyError,
           targets: str = "a") -> tuple[StandinLLM, Any, dict[str, list[LlmRequest]]]:
    """Sessions a and b, three turns each; the fault (if any) injected in the warm turn 2 of
    each session in `targets`."""
    llm, carry = make_llm(policy)
    convs = {name: ConversationParams(conversation_id=name) for name in "ab"}
    done: dict[str, list[LlmRequest]] = {name: [] for name in "ab"}
    prompts = {name: user_tokens(97 * i, 2 * CHUNK) for i, name in enumerate("ab")}
    for turn in range(3):
        reqs = {name: llm.generate_async(prompts[name], MAX_NEW, conversation_params=convs[name])
                for name in "ab"}
        undo = [inject(llm, carry, reqs[name], kind) for name in targets] \
            if turn == 1 and inject is not None else []
        try:
            llm.run_until_done()
        finally:  # an injection into a shared codec must not outlive its test
            for u in reversed(undo):
                u()
        for name, req in reqs.items():
            done[name].append(req)
            prompts[name] = padded(req.get_tokens(0), 31 * turn + 7 * len(name))
    return llm, carry, done


@functools.cache
def blind() -> tuple[dict[str, list[list[int]]], torch.Tensor]:
    """TensorRT-LLM without the carry: every output, and the draft pool's bytes at the end."""
    llm, _, done = _turns("blind")
    return {n: [r.output for r in reqs] for n, reqs in done.items()}, llm.executor.paged.buf.clone()


def _fault_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "trtllm_mtp_carry" and r.levelno == logging.WARNING and " raised " in r.getMessage()]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
@pytest.mark.parametrize("point", list(POINTS))
def test_a_fault_at_adoption_runs_the_turn_blind_scatters_nothing_and_serves_on(
        point: str, kind: type[Exception], caplog: pytest.LogCaptureFixture) -> None:
    inject, step, then = POINTS[point]
    caplog.set_level(logging.WARNING, logger="trtllm_mtp_carry")
    llm, carry, done = _turns("carry", inject, kind)
    stats = carry.stats()
    assert stats.faults == {kind.__name__: 1}
    assert stats.fault_steps == {s: int(s == step) for s in FAULT_STEPS}
    lines = _fault_lines(caplog)
    assert len(lines) == 1 and lines[0].startswith(f"mtp carry: {step} raised {kind.__name__} ")
    a, b = done["a"][1], done["b"][1]
    record = carry.turn(a.py_request_id)
    assert record["rows_adopted"] == 0 and record["skipped"] == "fault"
    assert str(record["error"]).startswith(f"{step}: {kind.__name__}: ")
    assert carry.turn(b.py_request_id)["outcome"] == "adopted"  # the other session went on
    assert stats.skipped["fault"] == 1 and stats.live_turns == 0
    # a's turn 2 deposited nothing; b adopted on turns 2 and 3
    assert carry.turn(done["a"][2].py_request_id)["outcome"] == then
    assert carry.turn(done["b"][2].py_request_id)["outcome"] == "adopted"
    outputs, _ = blind()
    assert {n: [r.output for r in reqs] for n, reqs in done.items()} == outputs
    llm.executor.check()  # nothing leaked


def test_nothing_is_written_when_every_warm_turn_faults() -> None:
    """Every scatter of both sessions faults (from turn 2 on): no carried row ever reaches a
    page, so every draft page holds byte for byte what TensorRT-LLM without the carry leaves
    there; each fault left its entry where it was, so turn 3 adopts again (and faults again)."""
    injected: list[Callable[[], None]] = []

    def every_scatter(llm: StandinLLM, carry: Any, target: LlmRequest, kind: type[Exception]) -> Callable[[], None]:
        if not injected:  # one injection for the run: both sessions' scatters, turns 2 and 3
            injected.append(at_scatter_rows(llm, carry, target, kind, every=True))
        return lambda: None

    llm, carry, done = _turns("carry", every_scatter, RuntimeError, targets="ab")
    stats = carry.stats()
    assert stats.rows_adopted == 0 and stats.faults == {"RuntimeError": 4}
    assert [carry.turn(r.py_request_id)["outcome"] for r in (done["a"][2], done["b"][2])] == \
        ["adopted", "adopted"]
    outputs, buf = blind()
    assert torch.equal(llm.executor.paged.buf, buf)
    assert {n: [r.output for r in reqs] for n, reqs in done.items()} == outputs
    injected[0]()
    llm.executor.check()


def test_every_fault_is_counted_but_each_kind_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="trtllm_mtp_carry")
    llm, carry = make_llm("carry")
    draft = llm.executor.draft
    real = draft.get_batch_cache_indices
    convs = [ConversationParams(conversation_id=f"s{i}") for i in range(3)]
    firsts = [llm.generate_async(user_tokens(50 * i, 2 * CHUNK), MAX_NEW, conversation_params=c)
              for i, c in enumerate(convs)]
    llm.run_until_done()
    draft.get_batch_cache_indices = lambda ids, *a, **k: _raise(KeyError)  # the IndexMapper is full
    warm = [llm.generate_async(padded(f.get_tokens(0), 3), MAX_NEW, conversation_params=c)
            for f, c in zip(firsts, convs, strict=True)]
    llm.run_until_done()
    draft.get_batch_cache_indices = real
    stats = carry.stats()
    assert stats.faults == {"KeyError": 3} and stats.fault_steps["prepare"] == 3
    assert len(_fault_lines(caplog)) == 1
    assert [carry.turn(r.py_request_id)["skipped"] for r in warm] == ["fault"] * 3
    llm.executor.check()


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_a_fault_at_deposit_or_free_keeps_nothing_and_later_sessions_adopt(
        kind: type[Exception], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="trtllm_mtp_carry")
    llm, carry = make_llm("carry")
    store = carry.manager.service.store

    def turn(name: str, prev: LlmRequest | None, offset: int) -> LlmRequest:
        prompt = user_tokens(offset, 2 * CHUNK) if prev is None else padded(prev.get_tokens(0), offset)
        return llm.generate_async(prompt, MAX_NEW, conversation_params=ConversationParams(conversation_id=name))

    d1 = turn("d", None, 0)
    undo = _pages_for(llm, d1, kind)  # at d's first free: the gather
    llm.run_until_done()
    undo()
    e1 = turn("e", None, 200)
    llm.run_until_done()
    d2, e2 = turn("d", d1, 5), turn("e", e1, 6)
    store.admit = lambda *a, **k: _raise(kind)  # at free: the store raises (d2's plan and e2's)
    llm.run_until_done()
    del store.admit
    e3, f1 = turn("e", e2, 7), turn("f", None, 400)
    llm.run_until_done()
    f2 = turn("f", f1, 8)
    llm.run_until_done()
    stats = carry.stats()
    assert stats.faults == {kind.__name__: 3}
    assert stats.fault_steps == {"prepare": 0, "build": 0, "append": 0, "deposit": 3, "release": 0, "other": 0}
    # after a miss a turn deposits the run it computed: d2 would have (it reached the store), e3 did
    assert [carry.turn(r.py_request_id)["skipped"] for r in (d1, d2, e1, e2, e3, f1, f2)] == \
        ["fault", "fault", None, "fault", None, None, None]
    assert [carry.turn(r.py_request_id)["outcome"] for r in (d2, e2, e3, f2)] == \
        ["no_carry", "adopted", "no_carry", "adopted"]
    assert stats.deposits == 4 and stats.live_turns == 0  # e1, e3, f1, f2
    # one kind at one step (the gather, the store): three failures, one line
    assert [line.split(" raised ")[0] for line in _fault_lines(caplog)] == ["mtp carry: deposit"]
    carry.manager.service.check()
    llm.executor.check()


def test_a_second_step_faulting_with_the_same_kind_is_logged_too(caplog: pytest.LogCaptureFixture) -> None:
    """A KeyError at prepare, then a KeyError at free (another step, another cause): an operator
    reading the log sees both; a third KeyError at free is counted, not logged again."""
    caplog.set_level(logging.WARNING, logger="trtllm_mtp_carry")
    llm, carry = make_llm("carry")

    def turn(name: str, prev: LlmRequest | None, offset: int) -> LlmRequest:
        prompt = user_tokens(offset, 2 * CHUNK) if prev is None else padded(prev.get_tokens(0), offset)
        return llm.generate_async(prompt, MAX_NEW, conversation_params=ConversationParams(conversation_id=name))

    g1 = turn("g", None, 0)
    llm.run_until_done()
    g2 = turn("g", g1, 5)
    undo = at_prepare_identity(llm, carry, g2, KeyError)  # at prepare: reading the session
    llm.run_until_done()
    undo()
    store = carry.manager.service.store
    turn("h", None, 200), turn("k", None, 300)
    store.admit = lambda *a, **k: _raise(KeyError)  # at free, twice: the store raises
    llm.run_until_done()
    del store.admit
    stats = carry.stats()
    assert stats.faults == {"KeyError": 3}
    assert stats.fault_steps == {"prepare": 1, "build": 0, "append": 0, "deposit": 2, "release": 0, "other": 0}
    lines = _fault_lines(caplog)
    assert [line.split(" (")[0] for line in lines] == \
        ["mtp carry: prepare raised KeyError", "mtp carry: deposit raised KeyError"]
    assert lines[1].endswith("later KeyError faults at deposit are counted, not logged")
    llm.executor.check()


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_shutdown_and_the_stats_report_never_raise(kind: type[Exception]) -> None:
    llm, _ = make_llm("blind")  # the helper's executor options, with the carry attached here
    carry = attach(llm, {"carry_slots": 8, "stats_every": 1})
    manager = carry.manager
    manager._report = lambda line: _raise(kind)
    first = llm.generate_async(user_tokens(0, 2 * CHUNK), MAX_NEW,
                               conversation_params=ConversationParams(conversation_id="r"))
    llm.run_until_done()  # free's stats line raises: counted under "other"
    assert carry.turn(first.py_request_id)["rows_deposited"] == len(first.get_tokens(0)) - 1
    manager.service.clear = lambda: _raise(kind)
    assert manager.shutdown() is None
    assert manager.stats().faults == {kind.__name__: 2}
    assert manager.stats().fault_steps["other"] == 2
    llm.executor.check()


def test_the_protocols_other_methods_answer_their_defaults_whatever_they_are_given() -> None:
    _, carry = make_llm("carry")
    manager = carry.manager
    assert manager.get_max_resource_count() == 1
    assert manager.get_needed_resource_to_completion(object()) == 0
    assert manager.add_dummy_requests([1, 2], is_gen=True) is None
    assert manager.update_resources(object(), None, 2) is None
    assert manager.prepare_resources(object()) is None  # no context_requests: counted, not raised
    assert manager.free_resources(object()) is None  # no py_request_id
    assert manager.stats().faults == {"AttributeError": 2}
    assert manager.stats().fault_steps == {"prepare": 1, "build": 0, "append": 0, "deposit": 1, "release": 0,
                                           "other": 0}


def test_prepare_and_free_take_the_arguments_resource_manager_gives_kv_cache_managers() -> None:
    """`ResourceManager` gives KV cache managers more than the batch (`attn_metadata`, ...) and
    `free_resources(request, pin_on_release=False)`: the carry takes them and goes on."""
    llm, carry = make_llm("carry")
    manager = carry.manager
    conv = ConversationParams(conversation_id="args")
    req = llm.generate_async(user_tokens(0, 2 * CHUNK), MAX_NEW, conversation_params=conv)
    real_prepare, real_free = manager.prepare_resources, manager.free_resources
    manager.prepare_resources = lambda batch: real_prepare(batch, None, kv_cache_dtype_byte_size=2)
    manager.free_resources = lambda request: real_free(request, pin_on_release=False)
    llm.run_until_done()
    assert manager.stats().faults == {} and carry.turn(req.py_request_id)["rows_deposited"] > 0
