"""DeepSeek-V4's draft pool on the stand-in: the MTP layer's 128-token sliding window of MLA latent
rows is restored bit for bit over `[R - 127, R)`, a short follow-up drafts with it, and nothing
outside the window is read or written (no TensorRT-LLM is run).

The stand-in plays the pool as `deepseek_v4/cache_manager.py` builds it
(`standin/deepseek_v4_cache_manager.py`): blocks below the pool's window hold no page, pages are
`[pages, 128, 512]` BF16 or FP8 latent rows or Hopper's footer-scale bytes. Its target is the
reference hybrid's, reusing at each prompt's end (`RECOMMENDED_KV_CACHE_CONFIG`): a warm turn's
`R` is the last prompt's length.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from standin_helpers import CHUNK, model, user_tokens

from trtllm_mtp_carry.trtllm import CARRY_MANAGER_KEY, CarryAttachment, attach, draft_pages
from trtllm_mtp_carry.trtllm.draft_pages import DSV4_WINDOW, DeepseekV4DraftPages, pages_of
from trtllm_mtp_carry.trtllm.kv_formats import verdict_of_draft, verdict_of_options
from trtllm_mtp_carry.trtllm.options import RECOMMENDED_KV_CACHE_CONFIG
from trtllm_mtp_carry.trtllm.standin import BAD_PAGE_INDEX, DataType, StandinLLM
from trtllm_mtp_carry.trtllm.standin import deepseek_v4_cache_manager as dsv4

DSV4 = "main+19303:dsv4"
TPB = 128
PROMPT = 288  # nine chunks: R of the follow-up, the window [161, 288)
LAYOUTS = {  # id -> (kv_cache_config.dtype, the stand-in's DataType, the GPU's SM, tokens_per_block)
    "bf16": ("auto", DataType.BF16, 100, TPB),
    "fp8": ("fp8", DataType.FP8, 100, TPB),
    "nvfp4": ("nvfp4", DataType.NVFP4, 100, TPB),  # its window is FP8 (cache_dtype = DataType.FP8)
    "fp8_ds_mla": ("fp8_ds_mla", DataType.BF16, 90, TPB),  # Hopper: footer-scale pages, whole-block writer pages
}


def dsv4_llm(layout: str = "bf16", policy: str = "carry") -> tuple[StandinLLM, CarryAttachment | None]:
    kv_dtype_name, kv_dtype, sm, tpb = LAYOUTS[layout]
    kv: dict[str, Any] = {**RECOMMENDED_KV_CACHE_CONFIG, "dtype": kv_dtype_name}
    if policy == "rebuild":  # block reuse off: every turn prefills from 0, every row computed
        kv["enable_block_reuse"] = False
    llm = StandinLLM(model(), kv_cache_config=kv, chunk_size=CHUNK, num_pages=64, tokens_per_block=tpb,
                     single_process=True, version=DSV4, max_batch=4, kv_dtype=kv_dtype, sm_version=sm)
    return llm, (attach(llm, {"carry_slots": 8}) if policy == "carry" else None)


def held_keys(rows: dsv4.SlidingLatentRows, rid: int) -> tuple[list[int], torch.Tensor]:
    """Request `rid`'s block table and every byte of the keys its held pages hold, int64 `[keys,
    bytes]` (-1 on dropped blocks)."""
    table = list(rows.tables[rid])
    keys = torch.full((len(table) * TPB, rows.key_bytes_per_key), -1)
    for b, page in enumerate(table):
        if page != BAD_PAGE_INDEX:
            keys[b * TPB:(b + 1) * TPB] = rows.key_bytes(rid, b * TPB, (b + 1) * TPB).long()
    return table, keys


def record_frees(llm: StandinLLM) -> dict[int, tuple[list[int], torch.Tensor]]:
    """At each request's free (before its pages go back): `held_keys`, by request id."""
    draft = llm.executor.draft
    seen: dict[int, tuple[list[int], torch.Tensor]] = {}
    free = draft.free_resources

    def recording(request: Any) -> None:
        seen[request.py_request_id] = held_keys(draft.latent, request.py_request_id)
        free(request)

    draft.free_resources = recording  # type: ignore[method-assign]
    return seen


def record_first_prepares(llm: StandinLLM) -> dict[int, tuple[list[int], torch.Tensor]]:
    """`held_keys` of each context request once the carry's first `prepare_resources` of it ran
    (its adoption's scatter done, nothing of the turn computed yet), by request id."""
    ex = llm.executor
    rows = ex.draft.latent
    manager = ex.resource_manager.resource_managers[CARRY_MANAGER_KEY]
    seen: dict[int, tuple[list[int], torch.Tensor]] = {}
    prepare = manager.prepare_resources

    def recording(batch: Any, *args: Any) -> None:
        prepare(batch, *args)
        for r in batch.context_requests:
            seen.setdefault(r.py_request_id, held_keys(rows, r.py_request_id))

    manager.prepare_resources = recording
    return seen


def record_drafts(llm: StandinLLM) -> dict[int, list[list[int]]]:
    """Every draft the MTP layer proposed, by request id, in order."""
    ex = llm.executor
    drafts: dict[int, list[list[int]]] = {}
    draft = ex._draft

    def recording(req: Any, *args: Any) -> list[int]:
        out = draft(req, *args)
        drafts.setdefault(req.py_request_id, []).append(out)
        return out

    ex._draft = recording  # type: ignore[method-assign]
    return drafts


def two_turns(llm: StandinLLM, answer: int = 24, follow: int = 64, more: int = 12) -> tuple[Any, Any]:
    """A cold turn of `PROMPT` tokens answering `answer`, then the follow-up adding `follow` tokens."""
    ex = llm.executor
    cold = ex.submit(user_tokens(0, PROMPT), answer, conversation_id="c", client_id=1)
    llm.run_until_done()
    warm = ex.submit(cold.get_tokens(0) + user_tokens(500, follow), more, conversation_id="c", client_id=2)
    llm.run_until_done()
    ex.check()
    return cold, warm


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_warm_turn_restores_the_window_rows_bit_for_bit(layout: str) -> None:
    llm, carry = dsv4_llm(layout)
    assert carry is not None and carry.armed, carry and carry.reason
    freed, adopted = record_frees(llm), record_first_prepares(llm)
    cold, warm = two_turns(llm)
    record = carry.pop_turn(2)
    assert record is not None
    lo = PROMPT - (DSV4_WINDOW - 1)
    assert (record["reused"], record["outcome"], record["rows_adopted"], record["first_key"]) == (
        PROMPT, "adopted", DSV4_WINDOW - 1, lo)
    # every byte of keys [R - 127, R): in the warm turn's pages as the cold turn wrote them
    cold_keys, warm_keys = freed[cold.py_request_id][1], adopted[warm.py_request_id][1]
    assert bool((warm_keys[lo:PROMPT] >= 0).all()) and bool((cold_keys[lo:PROMPT] >= 0).all())
    assert torch.equal(warm_keys[lo:PROMPT], cold_keys[lo:PROMPT])
    # not by chance: the same turns run blind hold other bytes there
    blind, _ = dsv4_llm(layout, "blind")
    blind_seen = record_frees(blind)
    blind_cold = blind.executor.submit(user_tokens(0, PROMPT), 24, conversation_id="c", client_id=1)
    blind.run_until_done()
    blind_warm = blind.executor.submit(blind_cold.get_tokens(0) + user_tokens(500, 64), 1, conversation_id="c")
    blind.executor.step()
    blind_keys = held_keys(blind.executor.draft.latent, blind_warm.py_request_id)[1]
    assert torch.equal(blind_seen[blind_cold.py_request_id][1][lo:PROMPT], cold_keys[lo:PROMPT])
    assert not torch.equal(blind_keys[lo:PROMPT], cold_keys[lo:PROMPT])
    blind.run_until_done()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_follow_up_shorter_than_the_window_drafts_with_the_restored_rows(layout: str) -> None:
    """64 new tokens: the first drafts at the prompt's end read keys [L - 128, L - 1], half of
    them below R. The carried turn drafts exactly what a turn whose every row was computed
    drafts (block reuse off); the blind turn drafts otherwise."""
    runs = {}
    for policy in ("carry", "rebuild", "blind"):
        llm, _ = dsv4_llm(layout, policy)
        drafts = record_drafts(llm)
        cold, warm = two_turns(llm)
        runs[policy] = (drafts[warm.py_request_id], list(warm.output), warm.accepted)
    assert runs["carry"] == runs["rebuild"]
    assert runs["blind"][1] == runs["carry"][1]  # greedy outputs never depend on the drafter's rows
    assert runs["blind"][0] != runs["carry"][0]  # the drafts at the prompt's end read the window below R


@pytest.mark.parametrize("layout", ["bf16", "fp8_ds_mla"])
def test_pages_outside_the_window_are_never_written(layout: str) -> None:
    """The adoption's scatter writes the warm turn's pages of keys [R - 127, R) only: every other
    byte of the pool, the rest of those pages included, is unchanged; the turn's blocks below its
    window have no page at all."""
    llm, carry = dsv4_llm(layout)
    assert carry is not None
    ex = llm.executor
    cold = ex.submit(user_tokens(0, PROMPT), 24, conversation_id="c", client_id=1)
    llm.run_until_done()
    manager = ex.resource_manager.resource_managers[CARRY_MANAGER_KEY]
    rows = ex.draft.latent
    snapshots: list[torch.Tensor] = []
    prepare = manager.prepare_resources

    def around(batch: Any, *args: Any) -> None:
        snapshots.append(rows.store.view(torch.uint8).clone())
        prepare(batch, *args)
        snapshots.append(rows.store.view(torch.uint8).clone())

    manager.prepare_resources = around
    warm = ex.submit(cold.get_tokens(0) + user_tokens(500, 64), 4, conversation_id="c", client_id=2)
    ex.step()  # the warm turn's first chunk: the draft pool's resize, then the carry's scatter
    before, after = snapshots[0], snapshots[1]
    table = rows.tables[warm.py_request_id]
    lo = PROMPT - (DSV4_WINDOW - 1)
    assert table[0] == BAD_PAGE_INDEX  # block 0 lies below the window of R = 288: no page to write
    changed = {int(p) for p in (after != before).flatten(1).any(1).nonzero().flatten()}
    assert changed == {table[lo // TPB], table[(PROMPT - 1) // TPB]}
    for page in changed:
        b = table.index(page)
        keys = torch.arange(b * TPB, (b + 1) * TPB)
        outside = keys[(keys < lo) | (keys >= PROMPT)]
        now = rows.key_bytes(warm.py_request_id, b * TPB, (b + 1) * TPB)
        rows.store.view(torch.uint8).copy_(before.view_as(rows.store.view(torch.uint8)))
        then = rows.key_bytes(warm.py_request_id, b * TPB, (b + 1) * TPB)
        rows.store.view(torch.uint8).copy_(after.view_as(rows.store.view(torch.uint8)))
        assert torch.equal(now[outside - b * TPB], then[outside - b * TPB])
        inside = keys[(keys >= lo) & (keys < PROMPT)] - b * TPB
        assert not torch.equal(now[inside], then[inside])  # and the window's keys were written
    llm.run_until_done()
    ex.check()


def test_a_deposit_keeps_only_the_keys_on_pages_still_held() -> None:
    """A 220-token answer: at the cold turn's free its pool holds blocks from 256 on (blocks 0 and 1
    went stale and were released); the deposit gathers keys [256, N - 1), never a dropped block, and
    the follow-up restores the part of its window that run covers, [256, 288), and nothing below."""
    llm, carry = dsv4_llm("bf16")
    assert carry is not None
    freed, adopted = record_frees(llm), record_first_prepares(llm)
    cold, warm = two_turns(llm, answer=220)
    n = len(cold.get_tokens(0))
    table = freed[cold.py_request_id][0]
    assert table[:2] == [BAD_PAGE_INDEX, BAD_PAGE_INDEX] and BAD_PAGE_INDEX not in table[2:]
    assert carry.turn(cold.py_request_id)["rows_deposited"] == n - 1 - 2 * TPB  # type: ignore[index]
    record = carry.pop_turn(2)
    assert record is not None and (record["rows_adopted"], record["first_key"]) == (PROMPT - 2 * TPB, 2 * TPB)
    warm_keys, cold_keys = adopted[warm.py_request_id][1], freed[cold.py_request_id][1]
    assert torch.equal(warm_keys[2 * TPB:PROMPT], cold_keys[2 * TPB:PROMPT])


def test_the_carry_reads_the_pool_through_its_own_accessors() -> None:
    """Pages by attention type (`get_buffers(mtp, SWA)`, `get_cache_indices`): the base V2 lookup
    raises on this class as the source's does, and the carry never calls it."""
    llm, carry = dsv4_llm("fp8")
    draft = llm.executor.draft
    pages = pages_of(draft, draft.mtp_layer)
    assert isinstance(pages, DeepseekV4DraftPages) and pages.swa is dsv4.DeepseekV4AttentionType.SWA
    assert tuple(pages.kv().shape) == (64, 1, 1, TPB, 512) and pages.kv().dtype == torch.float8_e4m3fn
    assert pages.codec("bf16").name == "fp8_kv"  # the pool's own bytes, whatever carry_row_dtype says
    with pytest.raises(ValueError, match="Unknown buffer id"):
        draft.get_batch_cache_indices([1], layer_idx=draft.mtp_layer)
    two_turns(llm)
    assert carry is not None and carry.pop_turn(2)["rows_adopted"] == DSV4_WINDOW - 1  # type: ignore[index]


INFO = {"speculative_config": {"decoding_type": "MTP", "num_nextn_predict_layers": 1},
        "sparse_attention_config": {"algorithm": "deepseek_v4"}}


@pytest.mark.parametrize(("kv_dtype", "stand_in", "sm", "tpb", "armed"), [
    ("auto", DataType.BF16, 100, 128, True),
    ("fp8", DataType.FP8, 100, 128, True),
    ("nvfp4", DataType.NVFP4, 100, 256, True),
    ("fp8_ds_mla", DataType.BF16, 90, 128, True),
    ("fp8_ds_mla", DataType.BF16, 100, 256, False),
])
def test_info_and_the_worker_judge_the_pool_alike(kv_dtype: str, stand_in: DataType, sm: int, tpb: int,
                                                   armed: bool) -> None:
    """Armed for the layouts carried; off Hopper `fp8_ds_mla` stands aside in one sentence naming
    what was not read (the footer-scale page size its kernels write there). The first line is one
    sentence; the file@commit details are said below it (`details`)."""
    info = verdict_of_options({**INFO, "kv_cache_config": {"dtype": kv_dtype, "tokens_per_block": tpb}})
    llm = StandinLLM(model(), kv_cache_config={**RECOMMENDED_KV_CACHE_CONFIG, "dtype": kv_dtype}, chunk_size=CHUNK,
                     num_pages=16, tokens_per_block=tpb, single_process=True, version=DSV4, kv_dtype=stand_in,
                     sm_version=sm)
    worker = verdict_of_draft(llm.executor.draft)  # what the worker's probe decides on
    carry = attach(llm)
    assert (info.carries, worker.carries, carry.armed) == (armed, armed, armed)
    for verdict in (info, worker):
        assert verdict.line.startswith("DeepseekV4CacheManager") and ". " not in verdict.line
        assert "\n" not in verdict.line
        assert any("deepseek_v4/cache_manager.py @ 0b03b6afc16c24de7556e3abf7b78e9ccae2def4" in d
                   for d in verdict.details)
    if armed:
        assert (info.line, info.details) == (worker.line, worker.details)
        assert "drafts with restored rows for the up to 127 keys below its reuse point" in info.line
    else:
        assert carry.reason == worker.line
        assert "stands aside off Hopper: which footer-scale page size its kernels write there was not read" in info.line
        assert "(this GPU is SM100)" in carry.reason and "(info cannot see the GPU, and only" in info.line
        assert CARRY_MANAGER_KEY not in llm.executor.resource_manager.resource_managers


def test_the_stand_in_refuses_what_the_source_refuses() -> None:
    def build(tpb: int, dtype: str, sm: int) -> StandinLLM:
        return StandinLLM(model(), kv_cache_config={**RECOMMENDED_KV_CACHE_CONFIG, "dtype": dtype}, num_pages=8,
                          tokens_per_block=tpb, single_process=True, version=DSV4, sm_version=sm)

    with pytest.raises(AssertionError, match="requires tokens_per_block in \\[128, 256\\], got 32"):
        build(32, "auto", 100)
    with pytest.raises(ValueError, match="on Hopper requires kv_cache_config.dtype='fp8_ds_mla'; got 'auto'"):
        build(128, "auto", 90)
    with pytest.raises(ValueError, match="fp8_ds_mla KV cache requires tokens_per_block=256 on SM100, got 128"):
        build(128, "fp8_ds_mla", 100)
    draft = build(128, "auto", 100).executor.draft
    with pytest.raises(KeyError):  # the MTP layer (compress ratio 1) has no other role
        draft.get_buffers(draft.mtp_layer, dsv4.DeepseekV4AttentionType.COMPRESS)
    with pytest.raises(AttributeError, match="DeepseekV4CacheManager has no 'compress_pool_ptrs'"):
        eval(compile("dsv4.compress_pool_ptrs", draft_pages.__file__, "eval"), vars(draft_pages), {"dsv4": draft})


def test_the_worker_install_arms_on_hoppers_footer_scale_pool(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the worker install (the executor built by TensorRT-LLM's creator, the carry installed
    by the hook): the arenas hold whole 584-byte keys, and the follow-up restores its window."""
    from trtllm_mtp_carry.trtllm import worker

    config = tmp_path / "carry.yaml"
    config.write_text("mtp_carry: {carry_slots: 8}\n")
    monkeypatch.setenv(worker.ENV, str(config))
    kv_dtype_name, kv_dtype, sm, tpb = LAYOUTS["fp8_ds_mla"]
    llm = StandinLLM(model(), kv_cache_config={**RECOMMENDED_KV_CACHE_CONFIG, "dtype": kv_dtype_name},
                     chunk_size=CHUNK, num_pages=64, tokens_per_block=tpb, max_batch=2, version=DSV4,
                     kv_dtype=kv_dtype, sm_version=sm)
    assert worker.messages()[-1].startswith(f"mtp carry: installed in the worker's PyExecutor as {CARRY_MANAGER_KEY}")
    manager = llm.executor.resource_manager.resource_managers[CARRY_MANAGER_KEY]
    assert manager.reserved.row_nbytes == 584 and manager.service.home.codec.name == "fp8_ds_mla"
    ex = llm.executor
    cold = ex.submit(user_tokens(0, PROMPT), 24, conversation_id="c")
    llm.run_until_done()
    warm = ex.submit(cold.get_tokens(0) + user_tokens(500, 64), 8, conversation_id="c")
    llm.run_until_done()
    record = manager.turn(warm.py_request_id)
    assert (record["outcome"], record["rows_adopted"], record["first_key"]) == ("adopted", DSV4_WINDOW - 1,
                                                                               PROMPT - (DSV4_WINDOW - 1))
    manager.shutdown()


def test_info_arms_on_a_deepseek_v4_target_with_block_reuse_and_no_snapshot_placement(tmp_path: Any) -> None:
    """DeepSeek-V4's target reuses blocks, not snapshot points: `info` asks it no snapshot
    placement (the worker's probe does not either: its target is no hybrid)."""
    from trtllm_mtp_carry.cli import llm_config_report

    path = tmp_path / "llm.yaml"
    path.write_text("speculative_config: {decoding_type: MTP, num_nextn_predict_layers: 1}\n"
                    "sparse_attention_config: {algorithm: deepseek_v4}\n"
                    "kv_cache_config: {enable_block_reuse: true, dtype: fp8, tokens_per_block: 128}\n")
    report = llm_config_report(str(path))
    assert report["llm_config_stands_aside"] is None and report["kv_manager"] == "DeepseekV4CacheManager"
    assert str(report["kv_verdict"]).startswith("DeepseekV4CacheManager: the MTP layer's 128-token sliding window "
                                                "of FP8 MLA latent rows")
