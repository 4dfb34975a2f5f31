"""A request the V2 scheduler preempts deposits nothing its fresh draft pages never held.

Issue 49, item 3. `scheduler_v2.py` @ 38198e34582cf777ecc72062f477987284ba9999 (`_preempt_or_defer`,
from `_try_preempt_for_pages` for a context request and `_try_recompute_pause_for_gen` for a
generation one) calls `kv_cache_manager.preempt_request(req)` (`kv_cache_manager_v2.py` @ 38198e34:
`_release_preempted` -> the manager's own `free_resources`, "The caller resets the request to
context state") and then `draft_kv_cache_manager.free_resources(req)` directly. The victim joins
`recompute_paused`; the executor then frees it through `ResourceManager.free_resources` (the
carry's manager included: the path does not bypass it) and resets it for recompute. So when the
carry's free runs, the draft pool no longer holds the request: its rows went with its pages. The
carry skips it (`preempted`, no fault), and the request comes back as a context request with fresh
draft pages, judged afresh (`resumed`).

The stand-in's `StandinPyExecutor.preempt` plays that path; the carry is the worker's real
manager. Every deposit's rows are compared with the rows a rebuild (block reuse off: every key
computed) holds for the same tokens. On the STAND-IN: no TensorRT-LLM ran.
"""

from __future__ import annotations

import pytest
import torch
from standin_helpers import CHUNK, make_llm, padded, user_tokens

from trtllm_mtp_carry.trtllm.standin import (
    ConversationParams,
    LlmRequest,
    LlmRequestState,
    StandinLLM,
)

MAX_NEW = 24


def _capture(llm: StandinLLM, into: dict[tuple[int, int], torch.Tensor]) -> None:
    """Record, at each free the draft pool still holds, the MTP rows of keys [0, N - 1) (every
    byte), keyed by (request id, N): what a deposit there would gather."""
    rm = llm.executor.resource_manager
    free = rm.free_resources
    paged = llm.executor.paged

    def capture(request: LlmRequest) -> None:
        n = len(request.get_tokens(0)) - 1
        if request.py_request_id in paged.tables:
            into[(request.py_request_id, n + 1)] = paged.key_bytes(request.py_request_id, 0, n).clone()
        free(request)

    rm.free_resources = capture  # type: ignore[method-assign]


def _turns(llm: StandinLLM, preempt_at: str | None) -> tuple[list[LlmRequest], int | None]:
    """Three turns of one conversation; the second preempted once (`preempt_at`: `context`,
    after its first chunk; `generation`, after a few generation steps; None: never)."""
    conv = ConversationParams(conversation_id="p")
    prompt = user_tokens(0, 4 * CHUNK)
    turns, preempted = [], None
    for t in range(3):
        req = llm.generate_async(prompt, MAX_NEW, conversation_params=conv)
        if t == 1 and preempt_at is not None:
            ex = llm.executor
            if preempt_at == "context":
                ex.step()  # its first chunk ran
                assert req.state is LlmRequestState.CONTEXT_INIT
            else:
                while len(req.output) < 6:
                    ex.step()
                assert req.state is LlmRequestState.GENERATION_IN_PROGRESS
            ex.preempt(req.py_request_id)
            preempted = req.py_request_id
            assert req.state is LlmRequestState.CONTEXT_INIT and req.context_current_position == 0
        llm.run_until_done()
        turns.append(req)
        prompt = padded(req.get_tokens(0), 700 + t)
    return turns, preempted


@pytest.mark.parametrize("preempt_at", ["context", "generation"])
def test_a_preempted_request_deposits_only_rows_its_pages_held(preempt_at: str) -> None:
    carry_llm, carry = make_llm("carry")
    rebuild_llm, _ = make_llm("rebuild")
    plain_llm, _ = make_llm("blind")
    assert carry is not None
    got: dict[tuple[int, int], torch.Tensor] = {}
    want: dict[tuple[int, int], torch.Tensor] = {}
    _capture(carry_llm, got)
    _capture(rebuild_llm, want)
    turns, preempted = _turns(carry_llm, preempt_at)
    rebuilt, _ = _turns(rebuild_llm, preempt_at)
    plain, _ = _turns(plain_llm, None)
    # greedy: the target verifies every draft, so preemption and the carry change no output
    assert [r.output for r in turns] == [r.output for r in rebuilt] == [r.output for r in plain]
    stats = carry.stats()
    assert stats.faults == {} and sum(stats.fault_steps.values()) == 0
    paused = "context_unfinished" if preempt_at == "context" else "preempted"
    assert stats.skipped[paused] == 1  # the free after the draft pool let the pages go
    assert stats.turns["resumed"] == 1
    resumed = carry.manager.turn(preempted)
    assert resumed is not None and resumed["resumed"] is True
    # every deposit is the rows the pages held for its run of keys (after a turn that adopted
    # nothing, the run its context computed: keys [R, N - 1)), and those are the rows a rebuild
    # computes for the same keys
    deposited = [(r.py_request_id, len(r.get_tokens(0)), carry.manager.turn(r.py_request_id)["rows_deposited"])
                 for r in turns if carry.manager.turn(r.py_request_id)["rows_deposited"]]
    assert deposited  # the cold turn's at least
    by_turn = {r.py_request_id: w.py_request_id for r, w in zip(turns, rebuilt, strict=True)}
    for rid, n, rows in deposited:
        mine, rebuilt_rows = got[(rid, n)][n - 1 - rows:], want[(by_turn[rid], n)][n - 1 - rows:]
        if carry.manager.turn(rid)["reused"] % CHUNK == 0:  # its context ran in the rebuild's chunks: the same bits
            assert torch.equal(mine, rebuilt_rows)
        else:  # other chunk boundaries round a few rows differently (one bf16 ulp); a row the
            # pages never held (the pool's poison, another request's rows) is off by its scale
            assert torch.allclose(mine.view(torch.bfloat16).float(), rebuilt_rows.view(torch.bfloat16).float(),
                                  rtol=2**-7, atol=2**-7)
    for llm in (carry_llm, rebuild_llm, plain_llm):
        llm.executor.check()


def test_the_stand_ins_preemption_frees_the_draft_pool_before_the_resource_manager() -> None:
    """The order the source has: the target's own free (`preempt_request`), the draft pool's
    (direct), then `ResourceManager.free_resources` (the carry first, in reverse order)."""
    llm, carry = make_llm("carry")
    assert carry is not None
    ex = llm.executor
    req = llm.generate_async(user_tokens(5, 3 * CHUNK), 8, conversation_params=ConversationParams(conversation_id="o"))
    ex.step()
    calls: list[str] = []
    target_free, draft_free = ex.target.free_resources, ex.draft.free_resources  # type: ignore[union-attr]
    ex.target.free_resources = lambda r: (calls.append("target"), target_free(r))[1]  # type: ignore[method-assign]
    ex.draft.free_resources = lambda r: (calls.append("draft"), draft_free(r))[1]  # type: ignore[method-assign, union-attr]
    before = len(ex.resource_manager.calls)
    ex.preempt(req.py_request_id)
    assert calls[:2] == ["target", "draft"]  # preempt_request, then the direct draft free
    frees = [name for name, what, _ in ex.resource_manager.calls[before:] if what == "free"]
    assert frees[0] == "MTP_CARRY" and frees.index("MTP_CARRY") < frees.index("DRAFT_KV_CACHE_MANAGER")
    assert ex.waiting[0] is req and req.prompt_len == req.original_prompt_len
    llm.run_until_done()
    ex.check()
