"""A request's carry state follows what PyExecutor does to it between prepare and free.

TensorRT-LLM undoes an allocation without a free in two ways, and the carry's
per-request state must follow both (issue 30, item 4):

- `KVCacheManagerV2.revert_allocate_context(req)` (kv_cache_manager_v2.py @ 00043967;
  called from PyExecutor when a request the scheduler admitted is dropped again:
  attention DP's `can_queue` false, disaggregated admission): it shrinks the target's
  capacity back to before this iteration's context resize and suspends the cache, so
  the chunk did not run and comes again at the same position (returns True); when the
  history already passed that capacity it frees the target's cache and rewinds the
  prefill (`set_prepopulated_prompt_len(0, ...)`, `context_current_position = 0`,
  `context_chunk_size = prompt_len`) and returns False: "the caller drops any draft
  pool", so the draft pages come fresh (TensorRT-LLM's test
  `test_context_revert_drops_unshrinkable_cache_and_rewinds_progress`).
- The recompute pause (`py_executor.py` @ 00043967, `_UNBOUNDED_PAUSE_MAX_INPUT_LEN`:
  "Recompute pause should replay all generated tokens"): `_terminate_recompute_paused_requests`
  calls `resource_manager.free_resources(request)` on a request that is not finished,
  then `_pause_recompute_paused_requests` calls `request.reset_for_recompute(...)`: the
  request comes back as a context request under the same id, its prompt now every
  token it had (TensorRT-LLM's tests `test_recompute_pause_*`).

The tests drive the carry and the stand-in's draft manager in the order PyExecutor
calls them (prepare: draft then carry; free: carry then draft), moving the request as
the executor would; the model's forward is not run (the decisions are under test,
not the rows: the end-to-end row checks are in test_trtllm_standin_carry.py).
On the STAND-IN: no TensorRT-LLM ran.
"""

from __future__ import annotations

from typing import Any

import pytest
from standin_helpers import CHUNK, make_llm, user_tokens

from trtllm_mtp_carry.trtllm.standin import (
    ConversationParams,
    FinishReason,
    LlmRequest,
    LlmRequestState,
    ScheduledRequests,
)

FIRST, NEW = 4 * CHUNK - 8, 8  # the first turn's prompt and answer: N = 4 * CHUNK tokens, N - 1 rows
L = 6 * CHUNK  # the warm prompt
R = FIRST  # what the target reuses of it: its snapshot at the previous prompt's end
           # (`additional_snapshot_offsets_from_end: [0]`, notes 0b)


class Executor:
    """PyExecutor's calls into the draft manager and the carry, one request at a time."""

    def __init__(self, conversation: str = "c", carried: bool = True) -> None:
        self.llm, attachment = make_llm("carry")
        self.carry = attachment
        self.draft = self.llm.executor.draft
        self.manager = attachment.manager
        self.conv = ConversationParams(conversation_id=conversation)
        history = user_tokens(0, FIRST + NEW)
        if carried:  # a real first turn through the stand-in: the session's rows are carried
            first = self.llm.generate_async(history[:FIRST], NEW, conversation_params=self.conv)
            self.llm.run_until_done()
            history = first.get_tokens(0)
        self.prompt = list(history) + user_tokens(500, L - len(history))

    def request(self, rid: int = 1000) -> LlmRequest:
        return LlmRequest(rid, self.prompt, 8, self.conv)

    def prepare(self, req: LlmRequest, position: int, size: int) -> None:
        req.context_current_position, req.context_chunk_size = position, size
        batch = ScheduledRequests(context_requests=[req])
        self.draft.prepare_resources(batch)
        self.manager.prepare_resources(batch)

    def ran(self, req: LlmRequest) -> None:
        """The scheduled chunk's forward ran (`moveToNextContextChunk`); after the last one the
        sampler appends the first token."""
        req.context_current_position += req.context_chunk_size
        if req.context_current_position >= req.prompt_len:
            req.state = LlmRequestState.GENERATION_IN_PROGRESS
            req.tokens.append(7)

    def context(self, req: LlmRequest, start: int) -> None:
        """Every chunk from `start` to the prompt's end, each run."""
        position = start
        while position < req.prompt_len:
            self.prepare(req, position, min(CHUNK, req.prompt_len - position))
            self.ran(req)
            position = req.context_current_position

    def finish(self, req: LlmRequest) -> None:
        req.tokens.extend([8, 9])
        req.finish_by_reason(FinishReason.END_ID)
        self.free(req)

    def free(self, req: LlmRequest) -> None:
        self.manager.free_resources(req)
        self.draft.free_resources(req)

    def record(self, req: LlmRequest) -> dict[str, Any]:
        found = self.carry.turn(req.py_request_id)
        assert found is not None
        return found


def test_a_reverted_chunk_that_comes_again_is_judged_once_and_the_turn_deposits() -> None:
    ex = Executor()
    req = ex.request()
    ex.prepare(req, R, CHUNK)  # adopted: rows [0, R) scattered
    ex.context(req, R)  # revert_allocate_context: the chunk never ran, it comes again
    ex.finish(req)
    record = ex.record(req)
    assert (record["outcome"], record["rows_adopted"], record["reverted"], record["skipped"]) == \
        ("adopted", R, 1, None)
    stats = ex.carry.stats()
    assert stats.turns == {"cold": 1, "warm": 1, "resumed": 0, "reverted": 1}
    assert stats.outcomes["adopted"] == 1 and stats.deposits == 2
    assert record["rows_deposited"] == L + 3 - 1
    assert stats.live_turns == 0


def test_a_revert_that_rewinds_the_prefill_to_zero_keeps_the_turn_whole() -> None:
    ex = Executor()
    req = ex.request()
    ex.prepare(req, R, CHUNK)
    ex.ran(req)
    ex.prepare(req, R + CHUNK, CHUNK)  # then reverted with the target's cache dropped,
    ex.draft.free_resources(req)  # and the caller drops the draft pool's: fresh pages
    ex.context(req, 0)  # the prefill restarts at 0
    ex.finish(req)
    record = ex.record(req)
    assert (record["outcome"], record["reverted"], record["skipped"]) == ("adopted", 1, None)
    assert record["rows_deposited"] == L + 3 - 1


def test_a_blind_warm_turn_rewound_to_zero_recomputes_every_key_and_deposits() -> None:
    """No rows carried (a fresh conversation): the warm turn is blind over [0, R) and deposits the
    run its context computed, keys [R, N - 1); once the rewind makes TensorRT-LLM's context phase
    compute every key, it deposits them all."""
    ex = Executor("fresh", carried=False)
    blind = ex.request(1001)
    ex.context(blind, R)
    ex.finish(blind)
    record = ex.record(blind)  # not rewound: keys [0, R) never written, a known-invalid prefix
    assert (record["outcome"], record["skipped"], record["rows_deposited"]) == ("no_carry", None, L + 3 - 1 - R)
    ex = Executor("fresh-rewound", carried=False)  # a conversation of its own: nothing carried
    rewound = ex.request(1002)
    ex.prepare(rewound, R, CHUNK)
    ex.ran(rewound)
    ex.prepare(rewound, R + CHUNK, CHUNK)
    ex.draft.free_resources(rewound)  # revert_allocate_context returned False: draft dropped
    ex.context(rewound, 0)  # the prefill rewound
    ex.finish(rewound)
    record = ex.record(rewound)
    assert (record["outcome"], record["skipped"], record["rows_deposited"]) == ("no_carry", None, L + 3 - 1)


@pytest.mark.parametrize("generated", [1, 5])
def test_a_recompute_paused_request_deposits_and_comes_back_as_a_resumed_turn(generated: int) -> None:
    ex = Executor()
    req = ex.request()
    ex.context(req, R)
    req.tokens.extend(range(20, 20 + generated - 1))  # generation steps before the pause
    # _terminate_recompute_paused_requests: free_resources on an unfinished request
    assert not req.is_finished
    ex.free(req)
    paused = ex.record(req)
    assert (paused["outcome"], paused["rows_deposited"], paused["skipped"]) == ("adopted", L + generated - 1, None)
    # reset_for_recompute: every token is now the prompt; the target's lookup reuses R again
    req.prompt = list(req.tokens)
    req.state = LlmRequestState.CONTEXT_INIT
    ex.prepare(req, R, CHUNK)
    resumed = ex.record(req)
    assert (resumed["outcome"], resumed["resumed"], resumed["rows_adopted"]) == ("adopted", True, R)
    ex.ran(req)
    ex.context(req, R + CHUNK)
    ex.finish(req)
    assert ex.record(req)["rows_deposited"] == L + generated + 3 - 1
    stats = ex.carry.stats()
    assert stats.turns == {"cold": 1, "warm": 1, "resumed": 1, "reverted": 0}
    assert stats.outcomes["adopted"] == 2 and stats.deposits == 3 and stats.live_turns == 0


def test_a_request_freed_unfinished_that_never_comes_back_leaves_only_a_bounded_note() -> None:
    from trtllm_mtp_carry.trtllm import manager as manager_module

    ex = Executor()
    for rid in range(2000, 2000 + manager_module.PAUSED_LOG + 5):
        req = LlmRequest(rid, ex.prompt[:CHUNK], 8, None)
        ex.prepare(req, 0, CHUNK)
        ex.free(req)  # an older PyExecutor's cancel: freed before finish_by_reason
    assert len(ex.manager._paused) == manager_module.PAUSED_LOG
    assert ex.carry.stats().live_turns == 0
