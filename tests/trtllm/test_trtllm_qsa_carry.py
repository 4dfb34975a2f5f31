"""The QSA hybrid's draft pool (`QSAMambaHybridCacheManagerV2`, stand-in profile `main+19303:qsa`):
the carry restores every row of `[0, R)` of the MTP layer, its K, V, index key and position
coordinates, bit for bit on warm turns (no TensorRT-LLM is run; issue 41 item 3)."""

from __future__ import annotations

import torch
from standin_helpers import CHUNK, make_llm, padded, user_tokens

from trtllm_mtp_carry.trtllm.draft_pages import QsaDraftPages, pages_of
from trtllm_mtp_carry.trtllm.standin import ConversationParams, LlmRequest, StandinLLM
from trtllm_mtp_carry.trtllm.standin.qsa_cache_manager import COMPRESS_RATIO

QSA = "main+19303:qsa"
MAX_NEW = 24


def _rows(llm: StandinLLM, req: LlmRequest, hi: int) -> tuple[torch.Tensor, ...]:
    """K, V, index keys and positions of keys `[0, hi)` of `req`'s MTP layer, as the pool holds them."""
    draft = llm.executor.draft
    assert draft is not None
    table = torch.tensor(draft.pool.tables[req.py_request_id], dtype=torch.int64)
    keys = torch.arange(hi)
    page, slot = table[keys // draft.pool.tpb], keys % draft.pool.tpb
    k, v = llm.executor.paged.read(req.py_request_id, 0, hi)
    index = draft.get_index_k_buffer(draft.mtp_layer)[page, slot]
    position = draft.get_qsa_position_buffer()[page, slot]
    return k, v, index, position


def test_warm_turn_restores_k_v_index_keys_and_positions_bit_for_bit() -> None:
    conv = ConversationParams(conversation_id="q")
    rows = {}
    for policy in ("carry", "rebuild", "blind"):
        llm, carry = make_llm(policy, version=QSA)
        first = llm.generate_async(user_tokens(0, 6 * CHUNK), MAX_NEW, conversation_params=conv)
        llm.run_until_done()
        second = llm.generate_async(padded(first.get_tokens(0), 500), MAX_NEW, conversation_params=conv)
        r = 6 * CHUNK
        while second.context_current_position < r + (CHUNK if policy != "rebuild" else 0):
            llm.executor.step()  # warm: one chunk past R; rebuild: its prefill reached R
        rows[policy] = _rows(llm, second, r)
        assert second.reused == (0 if policy == "rebuild" else r)
        if carry is not None:
            layout = (type(carry.manager.pages), carry.stats()["row_dtype"])
        llm.run_until_done()
        llm.executor.check()
    for carried, rebuilt in zip(rows["carry"], rows["rebuild"], strict=True):
        assert torch.equal(carried, rebuilt)  # K, V, index keys, positions: bit for bit
    assert layout == (QsaDraftPages, "bf16+position+index_k")
    k, _, index, position = rows["carry"]
    assert position[:, 0].tolist() == list(range(6 * CHUNK))
    assert bool(index.abs().sum() > 0) and bool(k.abs().sum() > 0)
    # blind: none of the four is restored (fresh pages hold their last user's or poison bytes)
    for blind, rebuilt in zip(rows["blind"], rows["rebuild"], strict=True):
        assert not torch.equal(blind, rebuilt)
    # anchors: every COMPRESS_RATIO-th key holds its group's anchor, not its raw key
    assert (6 * CHUNK) % COMPRESS_RATIO == 0


def test_a_qsa_pool_is_addressed_by_raw_slot_ids_not_the_scaled_k_v_page_ids() -> None:
    llm, carry = make_llm("carry", version=QSA)
    draft = llm.executor.draft
    assert draft is not None and carry is not None
    conv = ConversationParams(conversation_id="ids")
    req = llm.generate_async(user_tokens(3, 5 * CHUNK), 4, conversation_params=conv)
    while req.context_current_position < 4 * CHUNK:
        llm.executor.step()
    raw = draft.get_batch_cache_indices([req.py_request_id], layer_idx=draft.mtp_layer, raw_indices=True)[0]
    scaled = draft.get_batch_cache_indices([req.py_request_id], layer_idx=draft.mtp_layer)[0]
    # the stand-in's BF16 index key is a K page's size: coalesced, a slot holds 3 pages
    assert draft.pool.store.shape[1] == 3 and scaled == [s * 3 // 2 for s in raw] != raw
    pages = pages_of(draft, draft.mtp_layer)
    assert pages.page_ids(req.py_request_id) == raw
    llm.run_until_done()
