"""attach() on the TensorRT-LLM STAND-IN: refusals, topologies, configured vs armed, detach."""

from __future__ import annotations

from dataclasses import fields
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from standin_helpers import model

from trtllm_mtp_carry.core import OUTCOME_KINDS
from trtllm_mtp_carry.service import CarryStats
from trtllm_mtp_carry.trtllm import CARRY_MANAGER_KEY, TrtllmAdapterError, attach, detach
from trtllm_mtp_carry.trtllm.kv_formats import kv_verdict
from trtllm_mtp_carry.trtllm.options import RECOMMENDED_KV_CACHE_CONFIG
from trtllm_mtp_carry.trtllm.standin import DataType, Mapping, StandinLLM


def _llm(**options: Any) -> StandinLLM:
    return StandinLLM(model(), kv_cache_config=RECOMMENDED_KV_CACHE_CONFIG, chunk_size=32, num_pages=64, single_process=True, **options)


def gauge_names(stats: CarryStats) -> list[str]:
    """The `mtp_carry_runtime{field}` names `stats` gives (a dict field as `field.key`), in order."""
    names = []
    for f in fields(stats):
        value = getattr(stats, f.name)
        names += [f"{f.name}.{k}" for k in value] if isinstance(value, dict) else [f.name]
    return names


def _refusal(llm: Any) -> str:
    with pytest.raises(TrtllmAdapterError) as exc:
        attach(llm)
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_attach_refuses_a_tensor_parallel_executor_in_one_line_naming_the_worker_install() -> None:
    """attach holds one process's executor: at TP above 1 the carry is the worker install's
    (every rank carries its head shard, in lockstep: test_trtllm_tensor_parallel.py). A
    single-process stand-in cannot run two ranks, so rank 0's managers are given a TP=2 mapping."""
    llm = _llm()
    for manager in llm.executor.resource_manager.resource_managers.values():
        if hasattr(manager, "mapping"):
            manager.mapping = Mapping(world_size=2, rank=0, tp_size=2)
    assert _refusal(llm) == (
        "tensor parallel size 2: attach reaches one in-process executor (TP=1); at TP above 1 install the "
        "carry in TensorRT-LLM's workers (TRTLLM_MTP_CARRY_WORKER), which carry on every rank")


def test_a_kv_format_the_carry_does_not_move_stands_aside_in_the_verdict_line() -> None:
    """FP16 KV: not refused, not armed; the reason is `kv_formats`' line (info gives the same)."""
    carry = attach(_llm(kv_dtype=DataType.HALF))
    assert (carry.armed, carry.topology) == (False, "unpaired")
    assert carry.reason == kv_verdict("fp16").line and carry.reason.startswith("FP16 KV stands aside: ")


def test_an_nvfp4_draft_pool_is_armed_and_its_scale_pages_must_be_reachable() -> None:
    """NVFP4 KV is carried; a pool whose block-scale pages cannot be viewed as get_buffers views
    K/V (here: the scale roles' page stride disagrees with [pages, 2, Hkv, tpb, D/16]) is refused
    with one line naming it."""
    assert attach(_llm(kv_dtype=DataType.NVFP4)).armed
    llm = _llm(kv_dtype=DataType.NVFP4)
    paged = llm.executor.paged
    paged.page_stride = lambda role: 7  # type: ignore[method-assign]
    assert _refusal(llm).startswith("the NVFP4 draft pool's block-scale pages cannot be viewed: the NVFP4 "
                                    "draft pool's scale pages are not [pages, 2, ")


def test_an_fp8_draft_pool_is_accepted_and_pages_of_another_dtype_are_refused() -> None:
    llm = _llm(kv_dtype=DataType.FP8)
    assert llm.executor.paged.buf.dtype == torch.float8_e4m3fn
    assert attach(llm).armed
    llm = _llm(kv_dtype=DataType.FP8)
    llm.executor.paged.buf = llm.executor.paged.buf.view(torch.int8)  # pages of no KV format
    assert _refusal(llm) == "draft KV pages are torch.int8: FP8 KV pages are torch.float8_e4m3fn"


def test_attention_dp_is_refused() -> None:
    assert _refusal(_llm(enable_attention_dp=True)).startswith("attention data parallelism is on")


def test_a_missing_executor_attribute_is_named() -> None:
    llm = _llm()
    del llm.executor.draft.layer_offsets  # an older build without it
    assert _refusal(llm).startswith(
        "draft KV cache manager (DraftKVManager) has no attribute 'layer_offsets'")
    llm = _llm()
    del llm.executor.resource_manager
    assert _refusal(llm).startswith("PyExecutor (StandinPyExecutor) has no attribute 'resource_manager'")


def test_an_older_page_index_signature_is_refused() -> None:
    llm = _llm()
    draft = llm.executor.draft
    assert draft is not None
    draft.get_batch_cache_indices = lambda request_ids: [[]]  # type: ignore[method-assign]
    assert _refusal(llm) == ("draft KV cache manager.get_batch_cache_indices takes no 'layer_idx' "
                             "argument: an older KV cache manager than the adapter supports")


def test_no_conversation_id_support_is_refused() -> None:
    class OldLLM(StandinLLM):
        def generate_async(self, prompt_token_ids: Any, max_new_tokens: int = 32) -> Any:  # type: ignore[override]
            return super().generate_async(prompt_token_ids, max_new_tokens)

    msg = _refusal(OldLLM(model(), chunk_size=32, num_pages=64, single_process=True))
    assert msg.startswith("this TensorRT-LLM build has no conversation id support")


def test_the_fresh_page_fill_is_refused() -> None:
    llm = _llm()
    assert llm.executor.draft is not None
    llm.executor.draft._fresh_page_fill = object()
    assert _refusal(llm).startswith("the fresh-page fill is on for the draft pool")


def test_a_parent_process_attach_reaches_no_executor_and_says_so_in_one_line() -> None:
    llm = StandinLLM(model(), kv_cache_config=RECOMMENDED_KV_CACHE_CONFIG, chunk_size=32, num_pages=64)  # default: a worker-process executor
    assert _refusal(llm) == (
        "llm._executor (_WorkerProxy) reaches no executor: the PyExecutor runs in a worker "
        "process; install the carry there (TRTLLM_MTP_CARRY_WORKER, trtllm_mtp_carry.trtllm.worker) "
        "or set TLLM_WORKER_USE_SINGLE_PROCESS=1 before the first LLM (TP=1) for attach")
    assert CARRY_MANAGER_KEY not in llm.executor.resource_manager.resource_managers


def test_a_missing_tensorrt_llm_names_the_extra() -> None:
    # not a stand-in and tensorrt_llm cannot be imported here: the extra is named
    assert _refusal(SimpleNamespace()) == (
        "attach needs TensorRT-LLM, which is not importable here: "
        "pip install 'trtllm-mtp-carry[trtllm]'")


def test_unpaired_arms_and_installs_after_the_draft_manager() -> None:
    llm = _llm()
    carry = attach(llm)
    assert (carry.topology, carry.armed) == ("unpaired", True)
    names = [getattr(k, "name", k) for k in llm.executor.resource_manager.resource_managers]
    # CROSS_KV_CACHE_MANAGER: build_managers always sets it (None for a decoder-only model, _util.py @ 0004396)
    assert names == ["DRAFT_KV_CACHE_MANAGER", "CROSS_KV_CACHE_MANAGER", "SEQ_SLOT_MANAGER", "KV_CACHE_MANAGER",
                     CARRY_MANAGER_KEY]
    assert carry.info()[3] == ("carry armed", "yes", carry.reason)
    assert carry.info()[4] == ("carry slots (carry_slots)", "1", "carry_slots()")  # pinned by conftest
    assert carry.stats().carry_slots == 1
    with pytest.raises(TrtllmAdapterError, match="already attached"):
        attach(llm)
    detach(llm)
    assert CARRY_MANAGER_KEY not in llm.executor.resource_manager.resource_managers
    assert attach(llm, {"carry_slots": 2}).options.carry_slots == 2


@pytest.mark.parametrize(("options", "topology", "reason"), [
    ({"topology": "paired"}, "paired", "paired: the draft pool publishes and reuses its own blocks"),
    ({"topology": "folded"}, "folded", "folded: no separate draft KV cache manager"),
    ({"enable_block_reuse": False}, "unpaired", "block reuse is off"),
])
def test_paired_folded_and_reuse_off_stand_aside_installing_nothing(
        options: dict[str, Any], topology: str, reason: str) -> None:
    llm = _llm(**options)
    carry = attach(llm)
    assert (carry.topology, carry.armed, carry.manager) == (topology, False, None)
    assert carry.reason.startswith(reason)
    assert CARRY_MANAGER_KEY not in llm.executor.resource_manager.resource_managers
    assert carry.stats().outcomes == dict.fromkeys(OUTCOME_KINDS, 0)


def test_a_carry_standing_aside_reports_every_stats_key_an_armed_one_does_at_zero() -> None:
    armed = attach(_llm()).stats()
    aside = attach(_llm(topology="paired")).stats()
    assert gauge_names(aside) == gauge_names(armed)  # a scraper reads the same keys either way
    assert (aside.armed, aside.entries_held, aside.bytes_held, aside.reserved_bytes) == (False, 0, 0, 0)
    assert (aside.hits_device, aside.hits_host) == (0, 0) and aside.refusals == {
        "not_admitted": 0, "too_large": 0, "oom": 0}


def test_a_disabled_carry_is_configured_off_and_says_so() -> None:
    carry = attach(_llm(), {"enable": False})
    assert (carry.armed, carry.reason) == (False, "not configured (mtp_carry.enable is false)")
    assert carry.info()[2] == ("carry configured", "no", "mtp_carry.enable")


def _two_turns_with_a_host_entry() -> tuple[StandinLLM, Any]:
    """Sessions a and b, two turns each, on a device arena of one first turn's rows and a host tier:
    entries in both arenas when the turns end."""
    from standin_helpers import CHUNK, make_llm, padded, user_tokens

    from trtllm_mtp_carry.trtllm.standin import ConversationParams

    llm, _ = make_llm("blind")
    rows = 4 * CHUNK + 8 - 1
    carry = attach(llm, {"carry_slots": 8, "carry_memory": 2 * rows * 256, "carry_host_memory": 8 * rows * 256})
    firsts = {}
    for name in "ab":
        firsts[name] = llm.generate_async(user_tokens(100 * len(firsts), 4 * CHUNK), 8,
                                          conversation_params=ConversationParams(conversation_id=name))
        llm.run_until_done()
    for name in "ab":
        llm.generate_async(padded(firsts[name].get_tokens(0), 3), 8,
                           conversation_params=ConversationParams(conversation_id=name))
    llm.run_until_done()
    return llm, carry


def test_detach_leaves_no_arena_range_no_host_copy_and_no_entry_held() -> None:
    llm, carry = _two_turns_with_a_host_entry()
    manager, reserved = carry.manager, carry.manager.reserved
    stats = carry.stats()
    assert stats.entries_held >= 1 and stats.host_entries >= 1  # both arenas hold rows before
    assert reserved.device.keys() and reserved.host.keys()
    detach(llm)
    assert reserved.device.keys() == [] == reserved.host.keys()
    assert reserved.device.held_bytes == reserved.host.held_bytes == 0
    assert (reserved.device.pending_bytes, reserved.host.pending_bytes) == (0, 0)
    stats = manager.stats()
    assert (stats.entries_held, stats.host_entries, stats.leases, stats.faults) == (0, 0, 0, {})
    llm.executor.check()


@pytest.mark.parametrize("tier", ["device", "host"])
def test_a_range_held_behind_the_services_back_makes_detach_raise_naming_it(tier: str) -> None:
    """The leak a check must catch: a range of an arena that no entry holds (here taken behind
    the service's back). `detach` raises naming it; the resource manager's `shutdown` (what
    PyExecutor calls) counts it as a fault at `other` and never raises."""
    llm, carry = _two_turns_with_a_host_entry()
    manager = carry.manager
    arena = manager.reserved.device if tier == "device" else manager.reserved.host
    assert arena.take("leaked", 256) is not None
    expected = (r"device home: 0 bytes of entries, arena ranges \['leaked'\]" if tier == "device" else
                r"host tier: \[\] \['leaked'\]")
    with pytest.raises(RuntimeError, match=rf"^the carry holds rows after detaching: {expected}$"):
        manager.service.detach()
    assert manager.shutdown() is None  # PyExecutor's call: counted, logged, not raised
    stats = manager.stats()
    assert stats.faults == {"RuntimeError": 1} and stats.fault_steps["other"] == 1
    arena.release("leaked")
    manager.service.detach()  # nothing else was held
