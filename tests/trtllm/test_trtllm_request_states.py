"""The stand-in's request state machine against TensorRT-LLM's source, and the deposit on it.

The truth tables are written out from `llmRequest.h` (commit 00e9b8a7, see
docs/TRTLLM-CONFORMANCE.md), not computed from the stand-in's own predicates.
Each finish path is pinned: what the request looks like when PyExecutor frees it
(`is_context_finished` is False every time) and what the carry keeps.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from standin_helpers import CHUNK, TOKENIZER, make_llm, user_tokens

from trtllm_mtp_carry.service import SKIP_REASONS
from trtllm_mtp_carry.trtllm import session_key_for
from trtllm_mtp_carry.trtllm.standin import (
    ConversationParams,
    FinishReason,
    LlmRequest,
    LlmRequestState,
    StandinLLM,
)
from trtllm_mtp_carry.trtllm.standin.kv_cache_manager_v2 import poison_page

S = LlmRequestState
EXPECTED_VALUES = {  # llmRequest.h: enum class LlmRequestState : int32_t
    "DISAGG_TRANS_ERROR": -1, "UNKNOWN": 0, "ENCODER_INIT": 1, "DISAGG_GENERATION_INIT": 8,
    "DISAGG_GENERATION_TRANS_IN_PROGRESS": 9, "CONTEXT_INIT": 10,
    "DISAGG_CONTEXT_INIT_AND_TRANS": 11, "DISAGG_GENERATION_TRANS_COMPLETE": 12,
    "GENERATION_IN_PROGRESS": 13, "GENERATION_TO_COMPLETE": 14, "GENERATION_COMPLETE": 20,
    "DISAGG_CONTEXT_TRANS_IN_PROGRESS": 21, "DISAGG_CONTEXT_COMPLETE": 22}
TRUE_IN = {  # the states where each bound predicate is true, as the C++ bodies read
    "is_context_init_state": {"CONTEXT_INIT", "DISAGG_CONTEXT_INIT_AND_TRANS"},
    "is_generation_in_progress_state": {"GENERATION_IN_PROGRESS", "GENERATION_TO_COMPLETE",
                                        "DISAGG_GENERATION_TRANS_COMPLETE"},
    "is_context_finished": {"GENERATION_IN_PROGRESS", "GENERATION_TO_COMPLETE",
                            "DISAGG_GENERATION_TRANS_COMPLETE", "DISAGG_CONTEXT_INIT_AND_TRANS"},
    "is_generation_complete_state": {"GENERATION_COMPLETE"},
    "is_finished": {"GENERATION_COMPLETE", "DISAGG_CONTEXT_TRANS_IN_PROGRESS"},
}


def test_request_states_carry_the_cpp_values_in_chronological_order() -> None:
    assert {s.name: s.value for s in S} == EXPECTED_VALUES


@pytest.mark.parametrize("state", list(S), ids=lambda s: s.name)
def test_every_predicate_over_every_state_matches_the_cpp_truth_table(state: LlmRequestState) -> None:
    req = LlmRequest(1, [1, 2, 3], 4)
    req.state = state
    got = {name: getattr(req, name) for name in TRUE_IN}
    assert got == {name: state.name in states for name, states in TRUE_IN.items()}


def test_finish_by_reason_sets_unfinished_beams_and_generation_complete() -> None:
    req = LlmRequest(1, [1, 2, 3], 4)
    req.state = S.GENERATION_IN_PROGRESS
    req.finish_by_reason(FinishReason.CANCELLED)
    assert (req.state, req.is_finished, req.is_context_finished) == (S.GENERATION_COMPLETE, True, False)
    assert req.is_finished_due_to_cancellation and not req.is_finished_due_to_length


def _at_free(llm: StandinLLM) -> list[dict[str, Any]]:
    """What each request looks like when the executor frees it (before any manager runs)."""
    seen: list[dict[str, Any]] = []
    rm = llm.executor.resource_manager
    free = rm.free_resources

    def capture(request: LlmRequest) -> None:
        table = list(llm.executor.paged.tables.get(request.py_request_id, []))
        seen.append({"rid": request.py_request_id, "state": request.state,
                     "context_finished": request.is_context_finished,
                     "tokens": len(request.get_tokens(0)), "table": table,
                     "buf": llm.executor.paged.buf.clone()})
        free(request)

    rm.free_resources = capture  # type: ignore[method-assign]
    return seen


def _rows(seen: dict[str, Any], tpb: int, n: int) -> torch.Tensor:
    keys = torch.arange(n)
    table = torch.tensor(seen["table"], dtype=torch.int64)
    return seen["buf"][table[keys // tpb], :, :, keys % tpb]


def _deposited(carry: Any, conv: str) -> tuple[Any, torch.Tensor]:
    """The conversation's carried entry and its rows as the carry's arena holds them (keys from 0)."""
    service = carry.manager.service
    key = session_key_for(conv)
    entry = service.store.get(key)
    assert entry is not None and service.home.runs(key) == ((0, entry.rows),)
    return entry, service.home.rows(key)


@pytest.mark.parametrize("case", ["end_id", "max_tokens", "stop_word", "overlap_lag"])
def test_a_finished_turn_deposits_keys_below_n_minus_1_and_is_context_finished_is_false_at_free(
        case: str) -> None:
    options: dict[str, Any] = {}
    llm0, _ = make_llm("blind")
    probe = llm0.generate_async(user_tokens(0, 2 * CHUNK), 24,
                                conversation_params=ConversationParams(conversation_id="z"))
    llm0.run_until_done()
    stop = probe.output[5]
    if case == "stop_word":  # the 6th generated token is a stop token (its first occurrence ends)
        options["stop_token_ids"] = [stop]
    if case == "overlap_lag":
        options["overlap_scheduler"] = True
    llm, carry = make_llm("carry", **options)
    seen = _at_free(llm)
    if case == "end_id":  # a chat turn the reference model ends itself (273 tokens)
        prompt = TOKENIZER.render_chat([{"role": "user", "content": "What is 2 + 2?"}])
        max_new = 300
    else:
        prompt, max_new = user_tokens(0, 2 * CHUNK), 24
    req = llm.generate_async(prompt, max_new,
                             conversation_params=ConversationParams(conversation_id="c"))
    llm.run_until_done()
    reasons = {"end_id": FinishReason.END_ID, "max_tokens": FinishReason.LENGTH,
               "stop_word": FinishReason.STOP_WORDS, "overlap_lag": FinishReason.LENGTH}
    assert req.finish_reasons == [reasons[case]]
    assert len(seen) == 1 and seen[0]["state"] is S.GENERATION_COMPLETE
    assert seen[0]["context_finished"] is False  # TensorRT-LLM's predicate at free
    n = seen[0]["tokens"]
    if case == "stop_word":
        assert n == len(req.prompt) + probe.output.index(stop) + 1
    entry, rows = _deposited(carry, "c")
    assert entry.rows == n - 1
    assert torch.equal(rows, _rows(seen[0], llm.executor.paged.tpb, n - 1))
    if case == "overlap_lag":  # the extra step wrote rows past the last token: not kept
        tpb = llm.executor.paged.tpb
        late = _rows(seen[0], tpb, n + 3)[n - 1:]  # [4, 2, Hkv, D]
        # those fresh pages held the pool's poison rows (never cleared); every late key was overwritten
        poison = poison_page(late.shape[2], tpb, late.shape[3], late.dtype).permute(2, 0, 1, 3)
        assert bool((late != poison[torch.arange(n - 1, n + 3) % tpb]).flatten(1).any(1).all())
    assert carry.stats().skipped == dict.fromkeys(SKIP_REASONS, 0)
    llm.executor.check()


@pytest.mark.parametrize("how", ["cancel", "cancel_freed_first", "error"])
@pytest.mark.parametrize("where", ["context", "generation"])
def test_a_turn_ended_by_cancel_or_error(how: str, where: str) -> None:
    """In context: nothing is deposited (`context_unfinished`). In generation: the rows of
    the tokens it has are valid (written by completed steps), so they are deposited. The
    same whichever order the PyExecutor version frees and finishes a cancelled request in."""
    llm, carry = make_llm("carry")
    seen = _at_free(llm)
    req = llm.generate_async(user_tokens(0, 4 * CHUNK), 64,
                             conversation_params=ConversationParams(conversation_id="k"))
    llm.executor.step()  # the first of four context chunks
    if where == "generation":
        while len(req.output) < 5:
            llm.executor.step()
    if how == "error":
        llm.executor.fail(req.py_request_id)
        assert req.finish_reasons == [FinishReason.NOT_FINISHED]  # _handle_errors sets no reason
    else:
        llm.executor.cancel(req.py_request_id, free_first=how == "cancel_freed_first")
        assert req.finish_reasons == [FinishReason.CANCELLED]
    if how == "cancel_freed_first":  # older PyExecutors: freed while still running
        running = S.CONTEXT_INIT if where == "context" else S.GENERATION_IN_PROGRESS
        assert seen[0]["state"] is running
        assert seen[0]["context_finished"] is (where == "generation")
    else:
        assert seen[0]["state"] is S.GENERATION_COMPLETE and seen[0]["context_finished"] is False
    stats = carry.stats()
    if where == "context":
        assert stats.skipped["context_unfinished"] == 1 and stats.deposits == 0
    else:
        n = seen[0]["tokens"]
        entry, rows = _deposited(carry, "k")
        assert entry.rows == n - 1
        assert torch.equal(rows, _rows(seen[0], llm.executor.paged.tpb, n - 1))
    assert stats.live_turns == 0
    llm.executor.check()


def test_a_warm_turn_starts_at_the_prepopulated_length_and_moves_by_its_chunks() -> None:
    llm, _ = make_llm("blind")
    conv = ConversationParams(conversation_id="q")
    first = llm.generate_async(user_tokens(0, 3 * CHUNK), 8, conversation_params=conv)
    llm.run_until_done()
    warm = llm.generate_async(first.get_tokens(0) + user_tokens(99, 2 * CHUNK), 8,
                              conversation_params=conv)
    seen = []
    while warm.is_context_init_state:
        llm.executor.step()
        seen.append(warm.context_current_position)
    reused = 3 * CHUNK
    assert warm.prepopulated_prompt_len == reused
    assert seen[0] == 4 * CHUNK and seen[-1] == warm.prompt_len  # one chunk past R, then the end
    assert warm.state is S.GENERATION_IN_PROGRESS and warm.is_context_finished
