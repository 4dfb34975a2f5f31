"""The QSA hybrid's draft pool (`QSAMambaHybridCacheManagerV2`, stand-in profile `main+19303:qsa`):
the carry restores every row of `[0, R)` of the MTP layer, its K, V, index key and position
coordinates, bit for bit on warm turns (no TensorRT-LLM is run; issue 41 item 3)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from arena_carry import ArenaCarry
from standin_helpers import CHUNK, make_llm, model, padded, user_tokens

from trtllm_mtp_carry.dataplane.row_codec import (
    CompositeCodec,
    CompositeRows,
    SideRows,
    SlotPages,
    codec_for,
)
from trtllm_mtp_carry.trtllm import CARRY_MANAGER_KEY, worker
from trtllm_mtp_carry.trtllm.draft_pages import QsaDraftPages, pages_of
from trtllm_mtp_carry.trtllm.options import RECOMMENDED_KV_CACHE_CONFIG
from trtllm_mtp_carry.trtllm.standin import ConversationParams, LlmRequest, StandinLLM
from trtllm_mtp_carry.trtllm.standin.qsa_cache_manager import COMPRESS_RATIO

QSA = "main+19303:qsa"
QSA_TREES = ("main+19303:qsa", "main:qsa")
"""The QSA hybrid as PR #19303's tree builds it (`QSAMambaHybridCacheManagerV2`) and as newer trees
do (`Qwen4ExpHybridCacheManagerV2`, re-exported under the old name): carried alike."""
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


@pytest.mark.parametrize("tree", QSA_TREES)
def test_warm_turn_restores_k_v_index_keys_and_positions_bit_for_bit(tree: str) -> None:
    conv = ConversationParams(conversation_id="q")
    rows = {}
    for policy in ("carry", "rebuild", "blind"):
        llm, carry = make_llm(policy, version=tree)
        first = llm.generate_async(user_tokens(0, 6 * CHUNK), MAX_NEW, conversation_params=conv)
        llm.run_until_done()
        second = llm.generate_async(padded(first.get_tokens(0), 500), MAX_NEW, conversation_params=conv)
        r = 6 * CHUNK
        while second.context_current_position < r + (CHUNK if policy != "rebuild" else 0):
            llm.executor.step()  # warm: one chunk past R; rebuild: its prefill reached R
        rows[policy] = _rows(llm, second, r)
        assert second.reused == (0 if policy == "rebuild" else r)
        if carry is not None:
            layout = (type(carry.manager.pages), carry.stats().row_dtype)
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



def _capture_at_free(llm: StandinLLM, into: dict[int, tuple[torch.Tensor, ...]]) -> None:
    """Record each freed request's MTP rows of keys `[0, N - 1)` just before its pages go back."""
    rm = llm.executor.resource_manager
    free = rm.free_resources

    def capture(request: LlmRequest) -> None:
        if request.py_request_id in llm.executor.draft.pool.tables:  # type: ignore[union-attr]
            into[request.py_request_id] = tuple(
                t.clone() for t in _rows(llm, request, len(request.get_tokens(0)) - 1))
        free(request)

    rm.free_resources = capture  # type: ignore[method-assign]


@pytest.mark.parametrize("tree", QSA_TREES)
def test_the_worker_install_arms_on_a_qsa_pool_and_every_warm_turn_matches_a_rebuild(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tree: str) -> None:
    """Through the worker install (the executor built by TensorRT-LLM's creator, the carry
    installed by the hook): the arena's block is one composite row, every warm turn adopts, and
    at each turn's free the MTP layer's K, V, index keys and positions of every deposited key
    equal a rebuild's (block reuse off: every turn prefilled from 0)."""
    config = tmp_path / "carry.yaml"
    config.write_text("mtp_carry: {carry_slots: 8}\n")
    monkeypatch.setenv(worker.ENV, str(config))
    kw: dict[str, Any] = {"kv_cache_config": RECOMMENDED_KV_CACHE_CONFIG, "chunk_size": CHUNK,
                          "max_batch": 2, "num_pages": 512, "version": tree}
    carry = StandinLLM(model(), **kw)
    assert worker.messages()[-1].startswith(f"mtp carry: installed in the worker's PyExecutor as {CARRY_MANAGER_KEY}")
    manager = carry.executor.resource_manager.resource_managers[CARRY_MANAGER_KEY]
    hkv_d = model().cfg.num_kv_heads * model().cfg.head_dim
    # one block: K and V in bf16 (2 x 2 B), the positions (3 x 4 B), one bf16 index key of Hkv * D
    assert manager.reserved.row_nbytes == manager.service.home.row_nbytes == 2 * 2 * hkv_d + 3 * 4 + 2 * hkv_d
    assert manager.reserved.device.capacity % manager.reserved.row_nbytes == 0
    monkeypatch.delenv(worker.ENV)
    rebuild = StandinLLM(model(), **{**kw, "enable_block_reuse": False})
    rows: dict[str, list[tuple[torch.Tensor, ...]]] = {}
    for name, llm in (("carry", carry), ("rebuild", rebuild)):
        freed: dict[int, tuple[torch.Tensor, ...]] = {}
        _capture_at_free(llm, freed)
        prompt = user_tokens(11, 5 * CHUNK)
        turns = []
        for t in range(3):
            req = llm.generate_async(prompt, MAX_NEW, conversation_params=ConversationParams(conversation_id="w"))
            llm.run_until_done()
            turns.append(req)
            prompt = padded(req.get_tokens(0), 300 + t)
        reused = [r.reused for r in turns]
        assert reused[0] == 0 and (name == "rebuild" or min(reused[1:]) > 0)
        if name == "carry":
            warm = sum(reused)
        rows[name] = [freed[r.py_request_id] for r in turns]
        llm.executor.check()
    for got, want in zip(rows["carry"], rows["rebuild"], strict=True):
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)  # K, V, index keys, positions of [0, N - 1): bit for bit
    stats = manager.stats()
    assert (stats.outcomes["adopted"], stats.row_dtype) == (2, "bf16+position+index_k")
    assert stats.rows_adopted == warm


SIDES = (SideRows("position", (3,), torch.int32), SideRows("index_k", (1, 16), torch.bfloat16))


def _composite(seed: int, n: int = 10) -> CompositeRows:
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(4, 2, 2, 4, 8, generator=gen).to(torch.bfloat16)
    index = torch.randn(4, 4, 1, 16, generator=gen).to(torch.bfloat16)
    position = torch.randint(0, 99, (4, 4, 3), generator=gen, dtype=torch.int32)
    rows = CompositeCodec(codec_for("bf16", torch.bfloat16), SIDES).gather_pages(
        SlotPages(kv, (position, index)), [2, 0, 3], 0, n)
    assert isinstance(rows, CompositeRows)
    return rows


def test_the_store_charges_composite_bytes_and_its_host_tier_gives_them_back_bit_for_bit() -> None:
    one = _composite(1).nbytes
    assert one == 10 * (2 * 2 * 8 * 2 + 3 * 4 + 16 * 2)
    codec = CompositeCodec(codec_for("bf16", torch.bfloat16), SIDES)  # the manager's, from its draft pages
    carried = ArenaCarry(None, budget_bytes=one, policy="lrd", host_budget_bytes=2 * one, codec=codec,
                         num_kv_heads=2, head_dim=8)
    assert carried.home.row_nbytes * 10 == one  # the arena's row: K/V and the side rows
    assert carried.deposit(11, list(range(12)), _composite(1))
    assert carried.deposit(12, list(range(12)), _composite(2))  # 11 is demoted to the host tier
    stats = carried.stats()
    assert (stats.row_dtype, stats.bytes_held, stats.host_bytes_held) == (
        "bf16+position+index_k", one, one)
    carried.check()
    taken = carried.take(11)
    for a, b in zip(codec.tensors(taken), codec.tensors(_composite(1)), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(TypeError, match=r"a bf16\+position\+index_k codec holds CompositeRows"):
        carried.deposit(13, list(range(12)), _composite(3).kv)
    carried.service.repair()  # the executor's fault recovery: nothing of 13 is held
    assert carried.get(13) is None
    carried.check()


def test_package_code_reading_a_name_the_qsa_source_lacks_gets_attribute_error() -> None:
    """The QSA stand-in answers its rows and its parent's; `qsa_index_storage_dim` (main-line's
    padded layout @ 306f9922, gone @ 38198e34) is refused, as TensorRT-LLM would."""
    from trtllm_mtp_carry.trtllm import draft_pages

    llm, _ = make_llm("blind", version=QSA)
    draft = llm.executor.draft
    scope = vars(draft_pages)
    read = compile("qsa.qsa_index_kv_heads, qsa.tokens_per_block", draft_pages.__file__, "eval")
    assert eval(read, scope, {"qsa": draft}) == (1, CHUNK)
    with pytest.raises(AttributeError, match=r"TensorRT-LLM's QSAMambaHybridCacheManagerV2 has no "
                                             r"'qsa_index_storage_dim'"):
        eval(compile("qsa.qsa_index_storage_dim", draft_pages.__file__, "eval"), scope, {"qsa": draft})


def test_the_qsa_pool_is_recognised_by_what_it_makes_not_by_its_class_name() -> None:
    """Newer trees build `Qwen4ExpHybridCacheManagerV2`; `qsa/cache_manager.py` re-exports it as
    `QSAMambaHybridCacheManagerV2` (`QWEN4_EXP_ALIAS`). The package matched the old `__name__`
    and stood aside on such a tree while `info` said carried: now both classes are QSA pools by the
    side pages they make, and a class with QSA's name but no side pages (QSA off) is not."""
    from trtllm_mtp_carry.trtllm.kv_formats import QSA_HYBRID, is_qsa_pool, manager_of_draft
    from trtllm_mtp_carry.trtllm.standin.qsa_cache_manager import (
        QWEN4_EXP_ALIAS,
        Qwen4ExpHybridCacheManagerV2,
    )

    assert QWEN4_EXP_ALIAS["QSAMambaHybridCacheManagerV2"] is Qwen4ExpHybridCacheManagerV2
    for tree, name in (("main+19303:qsa", "QSAMambaHybridCacheManagerV2"), ("main:qsa", "Qwen4ExpHybridCacheManagerV2")):
        llm, _ = make_llm("blind", version=tree)
        draft = llm.executor.draft
        assert type(draft).__name__ == name
        assert is_qsa_pool(draft) and manager_of_draft(draft) == QSA_HYBRID
        assert isinstance(pages_of(draft, draft.mtp_layer), QsaDraftPages)
        draft.qsa_position_layer_id = None  # `_qsa_enabled` False: no side pages, a plain hybrid pool
        assert not is_qsa_pool(draft) and manager_of_draft(draft) != QSA_HYBRID


def test_a_qsa_pool_on_a_tree_without_raw_indices_stands_aside_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The QSA views are slot-major and need base slot ids (`get_batch_cache_indices(...,
    raw_indices=True)`, kv_cache_manager_v2.py @ 38198e34); 0004396's and 1fe0b08f's base lack it.
    The probe checks the signature at attach and the worker stands aside in one line."""
    from trtllm_mtp_carry.trtllm.standin import VERSIONS

    monkeypatch.setitem(VERSIONS, "main:qsa", {**VERSIONS["main:qsa"], "raw_indices": False})
    config = tmp_path / "carry.yaml"
    config.write_text("mtp_carry: {carry_slots: 8}\n")
    monkeypatch.setenv(worker.ENV, str(config))
    llm = StandinLLM(model(), kv_cache_config=RECOMMENDED_KV_CACHE_CONFIG, chunk_size=CHUNK, num_pages=64,
                     version="main:qsa")
    line = worker.messages()[-1]
    assert line == ("mtp carry: stands aside: the QSA hybrid's draft pool (Qwen4ExpHybridCacheManagerV2) has "
                    "no get_batch_cache_indices(raw_indices=) on this TensorRT-LLM tree, so its index-key and "
                    "position pages cannot be addressed and the carry stands aside")
    assert llm.executor.resource_manager.resource_managers.get(CARRY_MANAGER_KEY) is None
