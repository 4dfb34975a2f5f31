"""The adapter's per-request turn records (`pop_turn`) and its forget on session end, on the STAND-IN.

The executor is the package's CPU stand-in for TensorRT-LLM's `PyExecutor`
(no TensorRT-LLM is run). Requests carry LLM API ids of their own
(`py_client_id`, from 501), distinct from the executor's ids, as TensorRT-LLM's
worker's client ids are: the Triton model reads a turn's record by the id its
`RequestOutput.request_id` shows.
"""

from __future__ import annotations

import pytest
from standin_helpers import make_llm, user_tokens

from trtllm_mtp_carry.trtllm import manager as manager_module
from trtllm_mtp_carry.trtllm.standin import LlmRequest, StandinLLM

MAX_NEW = 6


def run(llm: StandinLLM, prompt: list[int], conv: str, client: int, salt: str | None = None) -> LlmRequest:
    req = llm.executor.submit(prompt, MAX_NEW, conversation_id=conv, cache_salt=salt, client_id=client)
    llm.run_until_done()
    return req


def test_pop_turn_returns_each_requests_record_once_by_its_llm_api_id() -> None:
    llm, carry = make_llm("carry")
    assert carry is not None
    p1 = user_tokens(0, 70)
    cold = run(llm, p1, "c", 501)
    assert cold.py_client_id == 501 != cold.py_request_id
    assert carry.pop_turn(501) == {"reused": 0, "outcome": "no_carry", "no_carry_reason": "never_carried",
                                   "rows_adopted": 0, "first_key": None,
                                   "rows_computed": 69, "rows_deposited": len(cold.get_tokens(0)) - 1,
                                   "skipped": None}
    assert carry.pop_turn(501) is None  # read once
    p2 = cold.get_tokens(0) + user_tokens(100, 20)
    warm = run(llm, p2, "c", 502)
    assert carry.pop_turn(warm.py_request_id) is None  # the executor's id is not the LLM API's
    assert carry.pop_turn(502) == {"reused": 70, "outcome": "adopted", "no_carry_reason": "",
                                   "rows_adopted": 70, "first_key": 0, "rows_computed": len(p2) - 1 - 70,
                                   "rows_deposited": len(warm.get_tokens(0)) - 1, "skipped": None}
    assert carry.turn(warm.py_request_id) is not None  # the executor-id log is separate


def test_turn_records_nobody_reads_are_bounded(monkeypatch) -> None:
    monkeypatch.setattr(manager_module, "TURN_LOG", 2)
    llm, carry = make_llm("carry")
    assert carry is not None
    reqs = [run(llm, user_tokens(10 * i, 8), f"b{i}", 601 + i) for i in range(3)]
    assert carry.pop_turn(601) is None and carry.turn(reqs[0].py_request_id) is None  # the oldest left
    assert [carry.pop_turn(c)["outcome"] for c in (602, 603)] == ["no_carry", "no_carry"]  # type: ignore[index]


def test_forget_drops_the_conversations_rows_under_every_salt_as_session_end() -> None:
    llm, carry = make_llm("carry")
    assert carry is not None
    a = run(llm, user_tokens(0, 40), "c", 701)
    b = run(llm, user_tokens(300, 40), "c", 702, salt="tenant-b")  # the same conversation, another salt
    d = run(llm, user_tokens(600, 40), "d", 703)
    held = carry.stats()
    assert (held.entries_held, held.evictions["session_end"]) == (3, 0)
    dropped = carry.forget_conversation("c")
    assert dropped == len(a.get_tokens(0)) - 1 + len(b.get_tokens(0)) - 1
    stats = carry.stats()
    assert (stats.entries_held, stats.evictions["session_end"]) == (1, 2)
    assert carry.manager.service.check() is None  # the rows left with their entries
    assert carry.forget_conversation("c") == 0  # nothing left: a no-op
    again = run(llm, a.get_tokens(0) + user_tokens(900, 20), "c", 704)
    assert (carry.pop_turn(704)["outcome"], carry.pop_turn(704)) == ("no_carry", None)  # type: ignore[index]
    assert carry.turn(again.py_request_id)["no_carry_reason"] == "session_end"  # type: ignore[index]
    run(llm, d.get_tokens(0) + user_tokens(950, 20), "d", 705)
    assert carry.pop_turn(705)["outcome"] == "adopted"  # type: ignore[index]  # another conversation keeps its rows
    llm.executor.check()


def test_a_request_running_when_its_conversation_is_forgotten_deposits_nothing() -> None:
    # TensorRT-LLM may free a request after its final response: the END comes first
    llm, carry = make_llm("carry")
    assert carry is not None
    first = run(llm, user_tokens(0, 40), "c", 801)
    warm = llm.executor.submit(first.get_tokens(0) + user_tokens(500, 20), MAX_NEW, conversation_id="c",
                               client_id=802)
    llm.executor.step()  # its first chunk: judged and adopted, the entry leased out
    assert not warm.is_finished and carry.stats().entries_held == 0
    assert carry.forget_conversation("c") == 0  # the rows are out in the live request
    llm.run_until_done()
    record = carry.pop_turn(802)
    assert record is not None and (record["outcome"], record["skipped"], record["rows_deposited"]) == (
        "adopted", "session_end", 0)
    stats = carry.stats()
    assert (stats.entries_held, stats.skipped["session_end"], stats.live_turns) == (0, 1, 0)
    run(llm, warm.get_tokens(0) + user_tokens(700, 20), "c", 803)
    last = carry.pop_turn(803)
    assert last is not None and (last["outcome"], last["no_carry_reason"]) == ("no_carry", "session_end")
    carry.manager.service.check()
    llm.executor.check()


@pytest.mark.parametrize("conversation_id, error", [("", ValueError), ("  ", ValueError), (7, TypeError)])
def test_forget_refuses_a_bad_conversation_id_naming_it(conversation_id, error) -> None:
    llm, carry = make_llm("carry")
    assert carry is not None
    with pytest.raises(error, match="conversation_id must be"):
        carry.forget_conversation(conversation_id)  # type: ignore[arg-type]
