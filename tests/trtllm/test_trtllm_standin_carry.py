"""The carry on the TensorRT-LLM STAND-IN executor: the issue's checks (no TensorRT-LLM is run).

Policies: carry (attached), blind (TensorRT-LLM as is: fresh draft pages over
the reused prefix), rebuild (block reuse off: every turn prefills from 0),
off (no speculation). Sessions run interleaved, with chunked prefill.
"""

from __future__ import annotations

import pytest
import torch
from standin_helpers import (
    CHUNK,
    POLICIES,
    acceptance,
    make_llm,
    padded,
    quote_sessions,
    run_turns,
    user_tokens,
)

from trtllm_mtp_carry import EVICTION_CAUSES
from trtllm_mtp_carry.service import SKIP_REASONS
from trtllm_mtp_carry.trtllm import attach, session_key_for
from trtllm_mtp_carry.trtllm.standin import (
    ConversationParams,
    LlmRequest,
    StandinLLM,
)
from trtllm_mtp_carry.trtllm.standin.kv_cache_manager_v2 import poison_page
from trtllm_mtp_carry.trtllm.standin.resource_manager import DataType

SESSIONS = quote_sessions(4)  # the user shows code, then asks to repeat it exactly
TURNS, MAX_NEW = 2, 48


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[dict[str, list[LlmRequest]], object]]:
    out = {}
    for policy in POLICIES:
        llm, carry = make_llm(policy)  # 4 sessions interleaved, 32-token prefill chunks
        out[policy] = (run_turns(llm, SESSIONS, TURNS, MAX_NEW), carry)
        llm.executor.check()  # nothing leaked
    return out


def test_greedy_outputs_identical_across_carry_blind_rebuild_and_off(runs) -> None:
    outputs = {p: {c: [r.output for r in turns] for c, turns in runs[p][0].items()} for p in runs}
    assert outputs["carry"] == outputs["off"] == outputs["blind"] == outputs["rebuild"]
    carry_turns = runs["carry"][0][SESSIONS[0].name]
    assert [r.reused for r in carry_turns][0] == 0 and all(r.reused > CHUNK for r in carry_turns[1:])
    assert all(len(r.prompt) > 2 * CHUNK for r in carry_turns)  # every context ran in chunks


def test_acceptance_under_the_carry_equals_rebuild_and_exceeds_blind(runs) -> None:
    carry, rebuild, blind = (acceptance(runs[p][0]) for p in ("carry", "rebuild", "blind"))
    print(f"warm-turn acceptance carry {carry} rebuild {rebuild} blind {blind}")
    assert carry == rebuild
    assert carry[0] / carry[1] > blind[0] / blind[1]


def test_every_warm_turn_adopted_and_deposits_are_counted(runs) -> None:
    stats = runs["carry"][1].stats()
    warm = len(SESSIONS) * (TURNS - 1)
    # every turn of a conversation is judged: a first turn finds nothing deposited
    assert stats.outcomes["adopted"] == warm and stats.outcomes["no_carry"] == len(SESSIONS)
    assert sum(stats.outcomes.values()) == warm + len(SESSIONS)
    assert stats.no_carry_reasons["never_carried"] == len(SESSIONS)
    assert stats.turns == {"cold": len(SESSIONS), "warm": warm, "resumed": 0, "reverted": 0}
    assert stats.deposits == len(SESSIONS) * TURNS and stats.entries_held == len(SESSIONS)
    assert stats.skipped == dict.fromkeys(SKIP_REASONS, 0)
    assert stats.live_turns == 0
    reused = sum(r.reused for turns in runs["carry"][0].values() for r in turns)
    assert stats.rows_adopted == reused
    cold, warm_turn = runs["carry"][0][SESSIONS[0].name]
    carry = runs["carry"][1]
    assert carry.turn(cold.py_request_id) == {
        "reused": 0, "outcome": "no_carry", "no_carry_reason": "never_carried", "rows_adopted": 0, "first_key": None,
        "rows_computed": len(cold.prompt) - 1, "rows_deposited": len(cold.get_tokens(0)) - 1, "skipped": None}
    assert carry.turn(warm_turn.py_request_id) == {
        "reused": warm_turn.reused, "outcome": "adopted", "no_carry_reason": "",
        "rows_adopted": warm_turn.reused, "first_key": 0, "rows_computed": len(warm_turn.prompt) - 1 - warm_turn.reused,
        "rows_deposited": len(warm_turn.get_tokens(0)) - 1, "skipped": None}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A page row's bytes (bf16 and float8 pages compared bit for bit alike)."""
    return t.contiguous().view(torch.uint8)


def _pages(llm: StandinLLM, req: LlmRequest, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    return llm.executor.paged.read(req.py_request_id, 0, hi)


@pytest.mark.parametrize("kv_dtype", [DataType.BF16, DataType.FP8])
def test_warm_turn_draft_pages_hold_exactly_the_rows_a_rebuild_computes(kv_dtype: DataType) -> None:
    conv = ConversationParams(conversation_id="s")
    rows = {}
    for policy in ("carry", "rebuild", "blind"):
        llm, _ = make_llm(policy, kv_dtype=kv_dtype)
        first = llm.generate_async(user_tokens(0, 6 * CHUNK), MAX_NEW, conversation_params=conv)
        llm.run_until_done()
        second = llm.generate_async(padded(first.get_tokens(0), 500), MAX_NEW, conversation_params=conv)
        reused = 6 * CHUNK
        while second.context_current_position < reused + (CHUNK if policy != "rebuild" else 0):
            llm.executor.step()  # warm: one chunk past R; rebuild: its prefill reached R
        rows[policy] = tuple(_bits(t) for t in _pages(llm, second, reused))
        assert second.reused == (0 if policy == "rebuild" else reused)
        llm.run_until_done()
    pool_dtype = llm.executor.paged.buf.dtype
    assert pool_dtype == {DataType.BF16: torch.bfloat16, DataType.FP8: torch.float8_e4m3fn}[kv_dtype]
    assert torch.equal(rows["carry"][0], rows["rebuild"][0])  # the pool's rows, bit for bit
    assert torch.equal(rows["carry"][1], rows["rebuild"][1])
    assert bool(rows["carry"][0].ne(0).any())
    # TensorRT-LLM's fresh pages are never cleared: these were never used, so they hold the
    # pool's poison rows (key k at slot k % tpb), not one row of what the prefill computes
    tpb = llm.executor.paged.tpb
    buf = llm.executor.paged.buf  # [pages, 2, Hkv, tpb, D]
    poison = poison_page(buf.shape[2], tpb, buf.shape[4], pool_dtype)
    slots = torch.arange(reused) % tpb
    assert torch.equal(rows["blind"][0], _bits(poison[0].transpose(0, 1)[slots]))
    assert torch.equal(rows["blind"][1], _bits(poison[1].transpose(0, 1)[slots]))
    assert bool((rows["blind"][0] != rows["rebuild"][0]).flatten(1).any(1).all())


def test_paired_topology_never_writes_into_tree_matched_pages() -> None:
    llm, _ = make_llm("blind", topology="paired")
    from trtllm_mtp_carry.trtllm import attach

    carry = attach(llm)
    assert (carry.topology, carry.armed) == ("paired", False)
    conv = ConversationParams(conversation_id="p")
    first = llm.generate_async(user_tokens(0, 5 * CHUNK), MAX_NEW, conversation_params=conv)
    llm.run_until_done()
    draft = llm.executor.draft
    assert draft is not None and len(draft.tree) == 1
    tree_pages = next(iter(draft.tree.values())).pages
    before = llm.executor.paged.buf[tree_pages].clone()
    second = llm.generate_async(padded(first.get_tokens(0), 77), MAX_NEW, conversation_params=conv)
    llm.run_until_done()
    assert second.reused == 5 * CHUNK  # the draft tree matched: the target reused that deep
    assert torch.equal(llm.executor.paged.buf[tree_pages], before)
    assert carry.stats().rows_adopted == 0


def test_folded_topology_stands_aside_and_outputs_match() -> None:
    llm, _ = make_llm("blind", topology="folded")
    from trtllm_mtp_carry.trtllm import attach

    carry = attach(llm)
    assert (carry.topology, carry.armed, carry.manager) == ("folded", False, None)
    folded = run_turns(llm, SESSIONS[:1], 2, MAX_NEW)
    plain, _ = make_llm("off")
    reference = run_turns(plain, SESSIONS[:1], 2, MAX_NEW)
    name = SESSIONS[0].name
    assert [r.output for r in folded[name]] == [r.output for r in reference[name]]
    assert folded[name][1].reused == len(folded[name][0].prompt)
    llm.executor.check()


def test_carry_prepares_after_the_draft_manager_and_frees_before_it() -> None:
    llm, _ = make_llm("carry")
    req = llm.generate_async(user_tokens(0, 2 * CHUNK), 4,
                             conversation_params=ConversationParams(conversation_id="o"))
    llm.run_until_done()
    calls = [(m, op) for m, op, rid in llm.executor.resource_manager.calls if rid == req.py_request_id]
    prepare = [m for m, op in calls if op == "prepare"][:4]
    free = [m for m, op in calls if op == "free"]
    assert prepare == ["DRAFT_KV_CACHE_MANAGER", "SEQ_SLOT_MANAGER", "KV_CACHE_MANAGER", "MTP_CARRY"]
    assert free == ["MTP_CARRY", "KV_CACHE_MANAGER", "SEQ_SLOT_MANAGER", "DRAFT_KV_CACHE_MANAGER"]


@pytest.mark.parametrize("failed", [False, True])
def test_a_request_aborted_mid_context_deposits_nothing_and_leaks_nothing(failed: bool) -> None:
    llm, carry = make_llm("carry")
    assert carry is not None
    conv = ConversationParams(conversation_id="a")
    first = llm.generate_async(user_tokens(0, 4 * CHUNK), MAX_NEW, conversation_params=conv)
    llm.run_until_done()
    warm = llm.generate_async(padded(first.get_tokens(0), 9) + user_tokens(20, 3 * CHUNK), MAX_NEW,
                              conversation_params=conv)
    llm.executor.step()  # the first chunk: the carried rows were adopted and scattered
    assert carry.stats().outcomes["adopted"] == 1 and not warm.is_context_finished
    llm.executor.cancel(warm.py_request_id, failed=failed)
    cold = llm.generate_async(user_tokens(50, 4 * CHUNK), MAX_NEW,
                              conversation_params=ConversationParams(conversation_id="b"))
    llm.executor.step()
    llm.executor.cancel(cold.py_request_id, failed=failed)
    stats = carry.stats()
    why = "context_unfinished"  # cancelled or failed: its context never finished
    assert stats.skipped[why] == 2 and stats.deposits == 1  # the first turn's only
    assert carry.turn(warm.py_request_id)["skipped"] == why  # type: ignore[index]
    assert stats.entries_held == 0 and stats.live_turns == 0  # the adopted entry left once
    llm.executor.check()
    carry.manager.service.check()


def test_dummy_requests_and_requests_without_a_conversation_are_never_carried() -> None:
    llm, carry = make_llm("carry")
    assert carry is not None
    conv = ConversationParams(conversation_id="d")
    llm.generate_async(user_tokens(0, 2 * CHUNK), 4, conversation_params=conv, dummy=True)
    llm.generate_async(user_tokens(0, 2 * CHUNK), 4)
    llm.run_until_done()
    stats = carry.stats()
    assert (stats.skipped["dummy"], stats.skipped["no_conversation"]) == (1, 1)
    assert stats.deposits == 0 and stats.live_turns == 0
    llm.executor.check()


def test_two_conversations_with_identical_tokens_never_adopt_each_others_rows() -> None:
    llm, carry = make_llm("carry")
    assert carry is not None
    prompt = user_tokens(0, 4 * CHUNK)
    a = llm.generate_async(prompt, MAX_NEW, conversation_params=ConversationParams(conversation_id="a"))
    llm.run_until_done()
    b = llm.generate_async(padded(a.get_tokens(0), 5), MAX_NEW,
                           conversation_params=ConversationParams(conversation_id="b"))
    llm.run_until_done()
    assert b.reused == 4 * CHUNK  # the target's prefix cache is shared: R > 0 for "b"
    stats = carry.stats()
    # with several slots "b" has no entry of its own: an honest miss, never "a"'s rows
    # (a's first turn is the other miss)
    assert stats.outcomes["no_carry"] == 2 and stats.outcomes["adopted"] == 0
    assert stats.no_carry_reasons["never_carried"] == 2
    assert stats.outcomes["foreign_session"] == 0
    # b ran blind over [0, R) and deposited the run its context computed, keys [R, N - 1)
    assert stats.rows_adopted == 0 and stats.skipped == dict.fromkeys(SKIP_REASONS, 0)
    assert carry.turn(b.py_request_id)["rows_deposited"] == len(b.get_tokens(0)) - 1 - 4 * CHUNK  # type: ignore[index]
    assert carry.manager.service.home.runs(session_key_for("b")) == ((4 * CHUNK, len(b.get_tokens(0)) - 1 - 4 * CHUNK),)


def test_one_conversation_under_two_salts_keeps_two_sessions() -> None:
    llm, carry = make_llm("carry")
    assert carry is not None
    conv = ConversationParams(conversation_id="same")
    prompt = user_tokens(0, 4 * CHUNK)
    firsts = {}
    for salt in ("x", "y"):
        firsts[salt] = llm.generate_async(prompt, MAX_NEW, conversation_params=conv, cache_salt=salt)
        llm.run_until_done()
    assert firsts["y"].reused == 0  # the salt scopes TensorRT-LLM's reuse too
    manager = carry.manager
    x_key, y_key = (session_key_for("same", s) for s in "xy")  # keyed by the salt string
    warm = llm.generate_async(padded(firsts["y"].get_tokens(0), 3), MAX_NEW, conversation_params=conv,
                              cache_salt="y")
    llm.executor.step()
    assert warm.reused == 4 * CHUNK and carry.stats().outcomes["adopted"] == 1
    assert manager.service.store.get(x_key).session_hash == x_key  # x's entry untouched
    assert manager.service.store.get(y_key) is None  # y's was taken, not x's
    llm.run_until_done()


@pytest.mark.parametrize("slots", [3, 2])  # 3: the byte budget is what is full; 2: the slot cap
def test_memory_budget_and_slots_bound_the_store_and_a_newcomer_that_does_not_fit_is_refused(
        slots: int) -> None:
    row_bytes = 2 * 2 * 32 * 2  # K and V, 2 KV heads of 32, bf16
    llm, _ = make_llm("blind", max_batch=1)
    from trtllm_mtp_carry.trtllm import attach

    carry = attach(llm, {"carry_slots": slots, "carry_memory": 300 * row_bytes})
    for i, conv in enumerate(("m1", "m2", "m3")):
        llm.generate_async(user_tokens(100 * i, 4 * CHUNK), 16,
                           conversation_params=ConversationParams(conversation_id=conv))
    llm.run_until_done()
    stats = carry.stats()
    # each turn deposits 128 + 16 - 1 = 143 rows: two fit in 300 rows (and in 2 slots); the
    # store's default policy (incumbent) keeps them and refuses the third, as the runtime's does
    assert stats.deposits == 2 and stats.entries_held == 2 and stats.rows_held == 2 * 143
    assert stats.evictions == dict.fromkeys(EVICTION_CAUSES, 0)
    assert stats.refusals == {"not_admitted": 1, "too_large": 0, "oom": 0}
    assert stats.bytes_held == 2 * 143 * row_bytes
    service = carry.manager.service
    assert service.store.get(session_key_for("m1")) is not None and service.store.get(session_key_for("m3")) is None
    service.check()


@pytest.mark.parametrize(("slots", "cause"), [(3, "memory"), (2, "capacity")])
def test_least_recently_deposited_evicts_the_oldest_rows_with_their_cause(slots: int, cause: str) -> None:
    from arena_carry import ArenaCarry

    rows = torch.zeros(10, 2, 2, 4, dtype=torch.bfloat16)  # 320 bytes an entry
    carried = ArenaCarry(slots, budget_bytes=700, policy="lrd")
    for key in (11, 12, 13):
        assert carried.deposit(key, list(range(12)), rows.clone())
    stats = carried.stats()
    assert stats.entries_held == 2 and stats.bytes_held == 640
    assert stats.evictions == {**dict.fromkeys(EVICTION_CAUSES, 0), cause: 1}
    assert carried.get(11) is None and carried.get(13).rows == 10
    carried.check()


def test_a_deposit_keeps_keys_below_n_minus_1_never_the_later_draft_steps_rows() -> None:
    llm, carry = make_llm("carry")
    assert carry is not None
    executor = llm.executor
    seen: dict[str, object] = {}
    free = executor.resource_manager.free_resources

    def capture(request: LlmRequest) -> None:  # the pages as the carry manager sees them at free
        seen["table"] = list(executor.paged.tables[request.py_request_id])
        seen["buf"] = executor.paged.buf.clone()
        free(request)

    executor.resource_manager.free_resources = capture  # type: ignore[method-assign]
    req = llm.generate_async(user_tokens(0, 2 * CHUNK), 12,
                             conversation_params=ConversationParams(conversation_id="v"))
    llm.run_until_done()
    n = len(req.get_tokens(0))
    key = session_key_for("v")
    entry = carry.manager.service.store.get(key)
    assert (entry.rows, entry.last_pair_key) == (n - 1, n - 2)
    assert carry.manager.service.home.runs(key) == ((0, n - 1),)
    table = torch.tensor(seen["table"])
    keys = torch.arange(n + 2)
    tpb = executor.paged.tpb
    rows = seen["buf"][table[keys // tpb], :, :, keys % tpb]  # [n + 2, 2, Hkv, D]
    assert torch.equal(carry.manager.service.home.rows(key), rows[: n - 1])
    # later draft steps wrote past the accepted tokens: key n - 1 (the first one not kept) no
    # longer holds the poison row its fresh page started with (pages are never cleared)
    poison = poison_page(rows.shape[2], tpb, rows.shape[3], rows.dtype).permute(2, 0, 1, 3)
    assert not torch.equal(rows[n - 1], poison[(n - 1) % tpb])


def test_the_scatter_writes_only_the_warm_requests_own_pages_for_keys_below_r() -> None:
    llm, carry = make_llm("carry")
    assert carry is not None and carry.manager is not None
    executor = llm.executor
    conv = ConversationParams(conversation_id="w")
    first = llm.generate_async(user_tokens(0, 4 * CHUNK), MAX_NEW, conversation_params=conv)
    llm.run_until_done()
    other = llm.generate_async(user_tokens(900, 3 * CHUNK), 64,
                               conversation_params=ConversationParams(conversation_id="x"))
    while not other.is_context_finished:
        executor.step()  # "x" is decoding, its pages live, when "w"'s warm turn arrives
    changed: list[torch.Tensor] = []
    prepare = carry.manager.prepare_resources

    def spy(batch: object) -> None:
        before = executor.paged.buf.clone()
        prepare(batch)
        changed.append((executor.paged.buf != before).flatten(1).any(1).nonzero()[:, 0])

    carry.manager.prepare_resources = spy  # type: ignore[method-assign]
    warm = llm.generate_async(padded(first.get_tokens(0), 11), MAX_NEW, conversation_params=conv)
    executor.step()
    reused = 4 * CHUNK
    own = executor.paged.tables[warm.py_request_id][: reused // executor.paged.tpb]
    assert carry.turn(warm.py_request_id)["rows_adopted"] == reused  # type: ignore[index]
    assert sorted(changed[0].tolist()) == sorted(own)  # no page of "x", none past R
    assert not set(own) & set(executor.paged.tables[other.py_request_id])
    llm.run_until_done()


def test_a_page_missing_at_scatter_is_counted_and_the_turn_runs_blind() -> None:
    outputs = {}
    for policy in ("carry", "blind"):
        llm, carry = make_llm(policy)
        conv = ConversationParams(conversation_id="e")
        first = llm.generate_async(user_tokens(0, 4 * CHUNK), MAX_NEW, conversation_params=conv)
        llm.run_until_done()
        draft = llm.executor.draft
        assert draft is not None
        if carry is not None:  # an older page table than the request needs: BAD_PAGE_INDEX
            real = draft.get_batch_cache_indices
            draft.get_batch_cache_indices = (  # type: ignore[method-assign]
                lambda ids, layer_idx=None, num_blocks_per_seq=None: [[-1] * 64 for _ in ids])
        warm = llm.generate_async(padded(first.get_tokens(0), 13), MAX_NEW, conversation_params=conv)
        llm.executor.step()
        if carry is not None:
            draft.get_batch_cache_indices = real  # type: ignore[method-assign]
        llm.run_until_done()
        outputs[policy] = (warm.output, warm.accepted, warm.verify_steps)
        if carry is not None:
            stats = carry.stats()
            assert stats.fault_steps == {"prepare": 1, "build": 0, "append": 0, "deposit": 0, "release": 0,
                                         "other": 0}
            assert stats.faults == {"RuntimeError": 1}
            assert stats.skipped["fault"] == 1 and stats.deposits == 1
            assert str(carry.turn(warm.py_request_id)["error"]).startswith("prepare: RuntimeError: ")  # type: ignore[index]
            # the page check is the scatter's own, inside the adoption's move: a scatter that
            # raises leaves the entry's rows where they were, and the faulted turn deposits nothing
            assert (stats.entries_held, stats.leases) == (1, 0)
        llm.executor.check()
    assert outputs["carry"] == outputs["blind"]  # exactly TensorRT-LLM without the carry


@pytest.mark.parametrize("build", ["string_only", "string_and_id"])
def test_another_salt_never_adopts_the_other_salts_rows(build: str) -> None:
    """One conversation under salts x and y, one carry slot: y's deposit takes the slot from
    x's entry. x's warm turn (the target reuses x's prefix) finds the slot held by another
    session and writes nothing: never y's rows; it deposits the run its context computed, which
    takes the slot back, so y's warm turn finds x's entry and writes nothing either; y's next
    turn then adopts y's own run, at its own keys.
    `string_only`: newer LlmRequests carry only `cache_salt` (`cache_salt_id` unset), the
    case that adopted 269 foreign rows before (issue 30)."""
    llm, _ = make_llm("blind")  # the helper's executor options, with a one-slot carry attached here
    carry = attach(llm, {"carry_slots": 1})
    conv = ConversationParams(conversation_id="same")

    def run(prompt: list[int], salt: str) -> LlmRequest:
        req = llm.generate_async(prompt, MAX_NEW, conversation_params=conv, cache_salt=salt)
        if build == "string_only":
            req.cache_salt_id = None
        llm.run_until_done()
        return req

    x1 = run(user_tokens(0, 4 * CHUNK), "x")
    y1 = run(user_tokens(0, 4 * CHUNK), "y")
    assert y1.reused == 0  # the salt scopes TensorRT-LLM's own reuse
    x2 = run(padded(x1.get_tokens(0), 3), "x")
    assert x2.reused == 4 * CHUNK
    record = carry.turn(x2.py_request_id)
    assert (record["outcome"], record["rows_adopted"], record["skipped"]) == ("foreign_session", 0, None)
    y2 = run(padded(y1.get_tokens(0), 5), "y")
    y_record = carry.turn(y2.py_request_id)
    assert (y_record["outcome"], y_record["rows_adopted"], y_record["skipped"]) == ("foreign_session", 0, None)
    y3 = run(padded(y2.get_tokens(0), 7), "y")
    assert y3.reused == len(y2.prompt)
    y_record = carry.turn(y3.py_request_id)
    # y2's run: keys [4 * CHUNK, ...), the ones below y3's R restored
    assert (y_record["outcome"], y_record["rows_adopted"]) == ("adopted", len(y2.prompt) - 4 * CHUNK)
    stats = carry.stats()
    assert stats.rows_adopted == len(y2.prompt) - 4 * CHUNK and stats.outcomes["adopted"] == 1
    llm.executor.check()


def test_a_salt_keys_the_session_as_session_key_for_does() -> None:
    llm, carry = make_llm("carry")
    conv = ConversationParams(conversation_id="k")
    first = llm.generate_async(user_tokens(0, 2 * CHUNK), MAX_NEW, conversation_params=conv, cache_salt="s")
    first.cache_salt_id = None
    llm.run_until_done()
    assert carry.manager.service.store.get(session_key_for("k", "s")) is not None
    warm = llm.generate_async(padded(first.get_tokens(0), 3), MAX_NEW, conversation_params=conv, cache_salt="s")
    warm.cache_salt_id = None
    llm.run_until_done()
    assert carry.turn(warm.py_request_id)["outcome"] == "adopted"
