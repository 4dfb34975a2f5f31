"""The stand-in is no kinder than TensorRT-LLM's newest source read (issue 37), and the package
judges a configuration as the worker's executor will hold it.

Pinned against what `_util.py` and `kv_cache_manager_v2.py` @ 0004396, `llm_args.py` @ 0004396
and `mamba_cache_manager_v2.py` @ 28295084 do (docs/TRTLLM-CONFORMANCE.md): the reuse policy's
validator and the hybrid manager's policy rewrite, `get_batch_cache_indices`' KeyError,
`BAD_PAGE_INDEX` entries and parameters, fresh pages that are never cleared, and the creator's
and `create_py_executor_instance`'s keywords and resources. On the STAND-IN: no TensorRT-LLM ran.
"""

from __future__ import annotations

import inspect
import json
import logging
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from standin_helpers import model

from trtllm_mtp_carry.cli import main
from trtllm_mtp_carry.trtllm import attach
from trtllm_mtp_carry.trtllm.options import kv_cache_config_of, reuse_stand_aside
from trtllm_mtp_carry.trtllm.standin import (
    BAD_PAGE_INDEX,
    BlockReuseConfig,
    KvCacheConfig,
    PagedRows,
    ResourceManagerType,
    StandinLLM,
    create_py_executor_instance,
    poison_page,
)
from trtllm_mtp_carry.trtllm.standin._util import KvCacheCreator, StandinLlmArgs

PERIODIC_ONLY = {"enable_block_reuse": True, "mamba_state_config": {"periodic_snapshot_interval": 64},
                 "block_reuse_config": {"policy": "per_conversation", "max_num_turns": 2}}


def _llm(kv_cache_config: Any, **options: Any) -> StandinLLM:
    return StandinLLM(model(), kv_cache_config=kv_cache_config, chunk_size=32, num_pages=64,
                      single_process=True, **options)


# ---- 3. block_reuse_config.policy --------------------------------------------------------------


def test_per_conversation_turns_a_periodic_only_placement_off_in_the_worker_and_in_info(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    """`disable_periodic_mamba_snapshots_for_conversations` (llm_args.py @ 0004396) sets the
    interval to 0 under `per_conversation`: a configuration whose only placement is periodic
    reuses nothing. The worker's executor stands aside, and `info --llm-config` says so too."""
    caplog.set_level(logging.WARNING, logger="tensorrt_llm")
    llm = _llm(PERIODIC_ONLY)
    config = llm.executor.target.kv_cache_config
    assert config.mamba_state_config.periodic_snapshot_interval == 0
    assert (config.block_reuse_config.policy, config.block_reuse_config.max_num_turns) == ("per_conversation", 2)
    assert [r.getMessage() for r in caplog.records] == [
        "'kv_cache_config.mamba_state_config.periodic_snapshot_interval=64' is ignored because "
        "'kv_cache_config.block_reuse_config.policy=per_conversation' disables periodic Mamba "
        "snapshots; setting it to 0."]
    carry = attach(llm)
    assert (carry.topology, carry.armed) == ("unpaired", False)
    assert carry.reason.startswith("the hybrid target keeps no snapshot point")
    kv = kv_cache_config_of({"kv_cache_config": PERIODIC_ONLY})
    assert kv["mamba_state_config"] == {"periodic_snapshot_interval": 0}
    assert kv["ignored"] == {"periodic_snapshot_interval": 64}
    assert kv["block_reuse_config"] == {"policy": "per_conversation", "max_num_turns": 2}
    path = tmp_path / "llm.yaml"
    path.write_text(json.dumps({"speculative_config": {"decoding_type": "MTP"},
                                "kv_cache_config": PERIODIC_ONLY}))  # JSON is YAML
    assert main(["info", "--json", "--llm-config", str(path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["llm_config_snapshot_placement"] == "none"  # the validator set the interval to 0
    want = ("the hybrid target keeps no snapshot point (kv_cache_config.block_reuse_config.policy "
            "per_conversation turns mamba_state_config.periodic_snapshot_interval off, and no other "
            "placement is set): no prefix is ever reused, so there is nothing to carry; set "
            "kv_cache_config.mamba_state_config.additional_snapshot_offsets_from_end: [0] (a snapshot "
            "at each prompt's end)")
    assert report["llm_config_stands_aside"] == carry.reason == want  # the worker's executor says it too


@pytest.mark.parametrize(("policy", "placement", "armed"), [
    ("all_reusable", {"periodic_snapshot_interval": 64}, True),
    ("per_request", {"periodic_snapshot_interval": 64}, True),
    ("per_conversation", {"periodic_snapshot_interval": 64}, False),
    ("per_conversation", {"periodic_snapshot_interval": 64, "additional_snapshot_offsets_from_end": [0]}, True),
])
def test_info_and_the_worker_agree_on_every_policy(policy: str, placement: dict[str, Any], armed: bool) -> None:
    kv_cache_config = {"enable_block_reuse": True, "mamba_state_config": placement,
                       "block_reuse_config": {"policy": policy}}
    carry = attach(_llm(kv_cache_config))
    kv = kv_cache_config_of({"kv_cache_config": kv_cache_config})
    verdict = reuse_stand_aside(True, True, {**kv["mamba_state_config"], **kv["ignored"]},
                                policy=kv["block_reuse_config"]["policy"])
    assert carry.armed is armed and (verdict is None) is armed


def test_a_bad_policy_is_one_line_naming_it() -> None:
    with pytest.raises(ValueError, match=r"^kv_cache_config.block_reuse_config.policy must be one of "
                                         r"all_reusable, per_request, per_conversation, got 'per_turn'$"):
        kv_cache_config_of({"kv_cache_config": {"block_reuse_config": {"policy": "per_turn"}}})
    with pytest.raises(ValueError, match=r"^block_reuse_config.policy must be one of"):
        KvCacheConfig.from_dict({"block_reuse_config": {"policy": "per_turn"}})
    with pytest.raises(ValueError, match="was renamed to 'kv_cache_config.block_reuse_config.policy'"):
        BlockReuseConfig.from_dict({"block_reuse_policy": "per_request"})
    assert (BlockReuseConfig().policy, BlockReuseConfig().max_num_turns) == ("all_reusable", 1)


@pytest.mark.parametrize(("reuse", "policy", "held"), [
    (True, "all_reusable", "per_request"),  # SSM reuse only at explicit snapshot boundaries
    (True, "per_conversation", "per_conversation"),
    (False, "all_reusable", "all_reusable"),
])
def test_the_hybrid_manager_rewrites_all_reusable_on_its_own_deep_copy(reuse: bool, policy: str, held: str) -> None:
    """`MambaHybridCacheManagerV2.__init__` (@ 28295084): `kv_cache_config.model_copy(deep=True)`,
    and with Mamba layers and block reuse on, `all_reusable` becomes `per_request` on that copy."""
    llm = _llm({"enable_block_reuse": reuse, "mamba_state_config": {"additional_snapshot_offsets_from_end": [0]},
                "block_reuse_config": {"policy": policy}})
    given = llm.executor.llm_args.kv_cache_config
    held_config = llm.executor.target.kv_cache_config
    assert held_config.block_reuse_config.policy == held
    assert given.block_reuse_config.policy == policy  # the caller's config is untouched
    assert held_config is not given and held_config.mamba_state_config is not given.mamba_state_config


# ---- 5. get_batch_cache_indices ---------------------------------------------------------------


def test_batch_cache_indices_follow_v2() -> None:
    """`get_batch_cache_indices` @ 0004396: `kv_cache_map[req_id]` (KeyError for a request the
    pool does not hold), `num_blocks` entries capped by `num_blocks_per_seq`, `BAD_PAGE_INDEX`
    kept, and no `raw_indices` parameter at that commit."""
    llm = _llm({"enable_block_reuse": True, "mamba_state_config": {"additional_snapshot_offsets_from_end": [0]}})
    draft = llm.executor.draft
    assert draft is not None
    with pytest.raises(KeyError):
        draft.get_batch_cache_indices([12345], layer_idx=draft.mtp_layer)
    draft.paged.ensure(7, 3 * draft.paged.tpb)
    pages = list(draft.paged.tables[7])
    assert draft.get_batch_cache_indices([7], layer_idx=draft.mtp_layer) == [pages]
    assert draft.get_batch_cache_indices([7], num_blocks_per_seq=[2]) == [pages[:2]]
    assert draft.get_batch_cache_indices([7], num_blocks_per_seq=[9]) == [pages]
    draft.paged.drop_blocks(7, [0])  # an out-of-window block: its page given back
    assert draft.get_batch_cache_indices([7]) == [[BAD_PAGE_INDEX, *pages[1:]]]
    with pytest.raises(RuntimeError, match="BAD_PAGE_INDEX"):
        draft.paged.read(7, 0, 1)  # never the pool's last page through index -1
    with pytest.raises(TypeError):
        draft.get_batch_cache_indices([7], layer_idx=draft.mtp_layer, raw_indices=True)  # type: ignore[call-arg]
    draft.paged.release(7)
    llm.executor.check()  # the dropped block's page went back once, the others at release


# ---- 6. fresh pages are never cleared ---------------------------------------------------------


def test_a_fresh_page_holds_what_its_last_user_left_or_the_poison() -> None:
    pool = PagedRows(2, 2, 4, 8, torch.bfloat16)
    k, v = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    pool.ensure(1, 4)  # page 0
    pool.write(1, 0, k, v)
    pool.release(1)
    pool.ensure(2, 8)  # page 1 (never used), then page 0 (request 1's)
    assert pool.tables[2] == [1, 0]
    poison = poison_page(2, 4, 8, torch.bfloat16)
    got_k, got_v = pool.read(2, 0, 8)
    assert torch.equal(got_k[:4], poison[0].transpose(0, 1)) and torch.equal(got_v[:4], poison[1].transpose(0, 1))
    assert torch.equal(got_k[4:], k.to(torch.bfloat16)) and torch.equal(got_v[4:], v.to(torch.bfloat16))
    assert bool(poison.abs().sum() > 0)


# ---- 7. the creator and create_py_executor_instance -------------------------------------------


def _creator_keywords(args: StandinLlmArgs) -> dict[str, Any]:
    return dict(model_engine=None, draft_model_engine=None, mapping=None, net_max_seq_len=1024,
                kv_connector_manager=None, max_num_tokens=32, max_beam_width=1, tokens_per_block=32,
                max_seq_len=1024, max_batch_size=4, kv_cache_config=args.kv_cache_config, llm_args=args,
                speculative_config=None, sparse_attention_config=None, profiling_stage_data=None)


def test_the_creator_takes_the_sources_keywords_and_requires_is_disagg() -> None:
    args = StandinLlmArgs(model=model(), kv_cache_config=KvCacheConfig())
    with pytest.raises(TypeError, match="is_disagg"):
        KvCacheCreator(**_creator_keywords(args))  # type: ignore[call-arg]
    creator = KvCacheCreator(**_creator_keywords(args), is_disagg=False, draft_config=None, skip_est=True,
                             execution_stream=None)
    assert creator.try_prepare_estimation() is False  # skip_est


SOURCE_INSTANCE_PARAMETERS = [  # create_py_executor_instance @ 0004396, in order; True: required
    ("dist", True), ("resources", True), ("mapping", True), ("llm_args", True), ("ctx_chunk_config", True),
    ("model_engine", True), ("start_worker", True), ("sampler", True), ("drafter", True),
    ("guided_decoder", False), ("lora_config", False), ("garbage_collection_gen0_threshold", False),
    ("kv_connector_manager", False), ("resource_governor_queue", False), ("max_seq_len", False),
    ("max_batch_size", False), ("max_beam_width", False), ("max_num_tokens", False),
    ("peft_cache_config", False), ("scheduler_config", False), ("cache_transceiver_config", False),
    ("virtual_memory_pools", False), ("execution_stream", False), ("dwdp_manager", False),
    ("max_num_sequences", False),
]


def test_create_py_executor_instance_has_the_sources_keyword_only_parameters() -> None:
    params = inspect.signature(create_py_executor_instance).parameters
    assert [(n, p.default is inspect.Parameter.empty) for n, p in params.items()] == SOURCE_INSTANCE_PARAMETERS
    assert {p.kind for p in params.values()} == {inspect.Parameter.KEYWORD_ONLY}


def test_every_build_sets_the_cross_entry_and_sizes_the_slot_manager() -> None:
    """`build_managers` always sets CROSS_KV_CACHE_MANAGER (None for a decoder-only model), which
    a None entry leaves out of every call; `create_py_executor_instance` builds the sequence
    slot manager with `max_num_sequences` (None: `max_batch_size` without pipeline parallelism)
    and moves the KV cache manager last; teardown removes all three KV entries."""
    llm = _llm({"enable_block_reuse": True, "mamba_state_config": {"additional_snapshot_offsets_from_end": [0]}},
               max_batch=3, estimate_kv_cache=False)
    managers = llm.executor.resource_manager.resource_managers
    assert [k.name for k in managers] == ["DRAFT_KV_CACHE_MANAGER", "CROSS_KV_CACHE_MANAGER",
                                          "SEQ_SLOT_MANAGER", "KV_CACHE_MANAGER"]
    assert managers[ResourceManagerType.CROSS_KV_CACHE_MANAGER] is None
    assert managers[ResourceManagerType.SEQ_SLOT_MANAGER].max_num_sequences == 3
    from trtllm_mtp_carry.trtllm.standin._util import teardown_managers

    resources: OrderedDict[Any, Any] = OrderedDict(managers)
    teardown_managers(resources)
    assert [k.name for k in resources] == ["SEQ_SLOT_MANAGER"]


def test_an_estimated_build_appends_the_rebuilt_kv_entries_after_the_slot_manager() -> None:
    """Under KV cache estimation the second build appends the torn-down entries again after the
    sequence slot manager the first `create_py_executor_instance` added (teardown deletes them)."""
    llm = _llm({"enable_block_reuse": True, "mamba_state_config": {"additional_snapshot_offsets_from_end": [0]}},
               estimate_kv_cache=True)
    names = [getattr(k, "name", k) for k in llm.executor.resource_manager.resource_managers]
    assert names == ["SEQ_SLOT_MANAGER", "DRAFT_KV_CACHE_MANAGER", "CROSS_KV_CACHE_MANAGER", "KV_CACHE_MANAGER"]


def test_a_compression_config_is_not_modelled_and_says_so() -> None:
    with pytest.raises(NotImplementedError, match="the stand-in models no KV-cache compression"):
        args = StandinLlmArgs(model=model(), kv_cache_config=KvCacheConfig(), kv_cache_compression_config={"x": 1})
        from trtllm_mtp_carry.trtllm.standin._util import build_managers

        build_managers(OrderedDict(), args)
