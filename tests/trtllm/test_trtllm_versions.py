"""What the carry does per TensorRT-LLM version and pairing marker, on the STAND-IN.

The table of docs/TENSORRT-LLM.md, "TensorRT-LLM versions", says the same per version.

Each `standin.VERSIONS` row sets what that release gives a hybrid one-model MTP
model with block reuse (the target manager's class, the pairing markers); the
adapter's answer is pinned per row. Paired detection fails closed: a draft pool
that publishes blocks is left alone even without `enable_joint_kv_cache_reuse`,
and missing or disagreeing markers are refused with one line naming them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from standin_helpers import CHUNK, make_llm, model, padded, user_tokens

from trtllm_mtp_carry.trtllm import CARRY_MANAGER_KEY, TrtllmAdapterError, attach
from trtllm_mtp_carry.trtllm.options import RECOMMENDED_KV_CACHE_CONFIG
from trtllm_mtp_carry.trtllm.probe import probe_executor
from trtllm_mtp_carry.trtllm.standin import VERSIONS, ConversationParams, StandinLLM

MARKERS_OFF = ("draft DraftKVManager.enable_joint_kv_cache_reuse=False, _can_publish_block_reuse="
               "False; target MambaHybridCacheManagerV2._supports_draft_reuse_match_backoff=missing, "
               "_supports_reuse_match_backoff=False")
QSA_MARKERS = ("draft QSAMambaHybridCacheManagerV2.enable_joint_kv_cache_reuse=False, _can_publish_block_reuse="
               "False; target QSAMambaHybridCacheManagerV2._supports_draft_reuse_match_backoff=False, "
               "_supports_reuse_match_backoff=False")
QWEN4_MARKERS = ("draft Qwen4ExpHybridCacheManagerV2.enable_joint_kv_cache_reuse=False, _can_publish_block_reuse="
                 "False; target Qwen4ExpHybridCacheManagerV2._supports_draft_reuse_match_backoff=missing, "
                 "_supports_reuse_match_backoff=False")
DSV4_MARKERS = ("draft DeepseekV4CacheManager.enable_joint_kv_cache_reuse=False, _can_publish_block_reuse="
                "False; target DeepseekV4CacheManager._supports_draft_reuse_match_backoff=False, "
                "_supports_reuse_match_backoff=False")
PAIRED_MARKERS = "draft DraftKVManager.enable_joint_kv_cache_reuse=True, _can_publish_block_reuse=True; " \
    "target MambaHybridCacheManagerV2."
BF16 = "BF16 KV: the drafter's rows are carried as the draft pool holds them"
DSV4_BF16 = ("DeepseekV4CacheManager: the MTP layer's 128-token sliding window of BF16 MLA latent rows (one "
             "512-wide vector a key) is carried as the pool holds it, so a warm turn drafts with restored "
             "rows for the up to 127 keys below its reuse point")
QSA = BF16 + ", with the QSA hybrid's index-key and position rows of each key carried beside them"
PAIRED = ("paired: the draft pool publishes and reuses its own blocks, so TensorRT-LLM restores the "
          "drafter's prefix itself and the carry stands aside")


def _unpaired(markers: str) -> str:
    return f"unpaired draft pool with block reuse ({markers}): the carry restores the drafter's rows over the reused prefix"


ROWS: dict[str, tuple[str, bool, str, str]] = {  # version -> (topology, armed, reason or refusal, first detail)
    "1.2.1": ("refused", False,
              "the target KV cache manager is CppMambaHybridCacheManager (KV cache manager V1): the carry "
              "supports KVCacheManagerV2 only, set kv_cache_config.use_kv_cache_manager_v2: true", ""),
    "1.3.0rc29": ("unpaired", True, BF16, _unpaired(MARKERS_OFF)),
    "1.4.0rc1": ("unpaired", True, BF16, _unpaired(MARKERS_OFF)),
    # main-line: the creator reads _supports_reuse_match_backoff (_util.py @ 0004396); the hybrid
    # class declines it (False: mamba_cache_manager.py @ 38198e34, and @ 003f8d08): unpaired
    "main": ("unpaired", True, BF16, _unpaired(MARKERS_OFF)),
    # PR #18843's layout: the hybrid inherits True (mamba_cache_manager_v2.py @ 28295084): paired
    "pr18843": ("paired", False, PAIRED,
                f"{PAIRED_MARKERS}_supports_draft_reuse_match_backoff=missing, _supports_reuse_match_backoff=True"),
    # PR #19303 (38198e34): the creator reads _supports_draft_reuse_match_backoff, True on the hybrid
    "main+19303": ("paired", False, PAIRED,
                   f"{PAIRED_MARKERS}_supports_draft_reuse_match_backoff=True, _supports_reuse_match_backoff=False"),
    # ... and False on the QSA hybrid: unpaired, and the carry restores its draft pool's K/V,
    # index-key and position rows together (trtllm/draft_pages.py)
    "main+19303:qsa": ("unpaired", True, QSA, _unpaired(QSA_MARKERS)),
    # newer trees build the QSA hybrid as Qwen4ExpHybridCacheManagerV2 (modules/qwen4_exp/
    # cache_manager.py @ 6ff2801f): recognised by its side pages, carried alike
    "main:qsa": ("unpaired", True, QSA, _unpaired(QWEN4_MARKERS)),
    # ... and on DeepSeek-V4 (deepseek_v4/cache_manager.py @ 38198e34: both False): unpaired, and
    # the carry restores its MTP layer's sliding window of latent rows (trtllm/draft_pages.py)
    "main+19303:dsv4": ("unpaired", True, DSV4_BF16, _unpaired(DSV4_MARKERS)),
}


def _llm(**options: Any) -> StandinLLM:
    if options.get("version") == "main+19303:dsv4":  # DeepSeek-V4's manager needs 128 or 256
        options.setdefault("tokens_per_block", 128)
    return StandinLLM(model(), kv_cache_config=RECOMMENDED_KV_CACHE_CONFIG, chunk_size=32, num_pages=64,
                      single_process=True, **options)


def test_every_version_profile_has_a_pinned_row() -> None:
    assert set(VERSIONS) == set(ROWS)


@pytest.mark.parametrize("version", list(ROWS))
def test_the_carry_per_tensorrt_llm_version(version: str) -> None:
    topology, armed, reason, detail = ROWS[version]
    llm = _llm(version=version)
    if topology == "refused":
        with pytest.raises(TrtllmAdapterError) as exc:
            attach(llm)
        assert str(exc.value) == reason
        return
    assert probe_executor(llm).details[0] == detail  # the markers read, below the verdict
    carry = attach(llm)
    assert (carry.topology, carry.armed, carry.reason) == (topology, armed, reason)
    assert (CARRY_MANAGER_KEY in llm.executor.resource_manager.resource_managers) == armed


def test_a_publishing_draft_pool_without_the_joint_reuse_attribute_is_left_alone() -> None:
    """The done-when case: a paired pool whose build lacks `enable_joint_kv_cache_reuse`
    still publishes (`_can_publish_block_reuse`): the carry stands aside and writes into
    no page of the draft pool's tree."""
    llm, _ = make_llm("blind", topology="paired")
    draft = llm.executor.draft
    assert draft is not None
    del draft.enable_joint_kv_cache_reuse
    carry = attach(llm)
    assert (carry.topology, carry.armed, carry.manager) == ("paired", False, None)
    assert carry.reason == PAIRED
    assert "enable_joint_kv_cache_reuse=missing, _can_publish_block_reuse=True" in probe_executor(llm).details[0]
    conv = ConversationParams(conversation_id="p")
    first = llm.generate_async(user_tokens(0, 5 * CHUNK), 24, conversation_params=conv)
    llm.run_until_done()
    tree_pages = next(iter(draft.tree.values())).pages
    before = llm.executor.paged.buf[tree_pages].clone()
    second = llm.generate_async(padded(first.get_tokens(0), 77), 24, conversation_params=conv)
    llm.run_until_done()
    assert second.reused == 5 * CHUNK  # the draft tree matched
    assert torch.equal(llm.executor.paged.buf[tree_pages], before)


@pytest.mark.parametrize(("drop", "found"), [
    (("enable_joint_kv_cache_reuse", "_can_publish_block_reuse"),
     "enable_joint_kv_cache_reuse=missing, _can_publish_block_reuse=missing"),
    (("_can_publish_block_reuse",), "enable_joint_kv_cache_reuse=False, _can_publish_block_reuse=missing"),
])
def test_a_missing_pairing_marker_is_refused_naming_what_was_found(drop: tuple[str, ...], found: str) -> None:
    llm = _llm()
    for name in drop:
        delattr(llm.executor.draft, name)
    with pytest.raises(TrtllmAdapterError) as exc:
        attach(llm)
    assert str(exc.value) == (
        f"cannot prove the draft pool shares no blocks (draft DraftKVManager.{found}; target "
        "MambaHybridCacheManagerV2._supports_draft_reuse_match_backoff=missing, "
        "_supports_reuse_match_backoff=False): a pairing marker is "
        "missing, so the carry stands aside")


@pytest.mark.parametrize(("version", "claimed"), [
    ("main+19303", "_supports_draft_reuse_match_backoff=True, _supports_reuse_match_backoff=False"),
    ("pr18843", "_supports_draft_reuse_match_backoff=missing, _supports_reuse_match_backoff=True"),
])
def test_markers_that_disagree_are_refused(version: str, claimed: str) -> None:
    """The target class claims the capability its version's creator pairs on (#19303's name on
    #19303's tree, `_supports_reuse_match_backoff` in #18843's layout) but the draft pool shows no pairing:
    refused, not armed (fail-closed pairing)."""
    llm = _llm(version=version, topology="unpaired")
    with pytest.raises(TrtllmAdapterError) as exc:
        attach(llm)
    assert str(exc.value).startswith("the pairing markers disagree (draft DraftKVManager."
                                     "enable_joint_kv_cache_reuse=False, _can_publish_block_reuse=False; "
                                     f"target MambaHybridCacheManagerV2.{claimed})")


@pytest.mark.parametrize("version", ["1.3.0rc29", "1.4.0rc1", "main", "pr18843", "main+19303"])
@pytest.mark.parametrize("reuse", [True, False])
def test_each_version_pairs_on_the_name_its_creator_reads(version: str, reuse: bool) -> None:
    """The stand-in's creator decides pairing as that version's `build_managers` does:
    `has_separate_one_model_draft and enable_block_reuse and _joint_reuse_supported()`, reading
    `_supports_reuse_match_backoff` (main-line, `_util.py` @ 0004396, and the releases with #18093) or
    `_supports_draft_reuse_match_backoff` (PR #19303's tree, 38198e34). Main-line's hybrid class sets
    False (`mamba_cache_manager.py` @ 003f8d08): unpaired, the carry arms with block reuse on; in
    #18843's layout it inherits True: paired whenever block reuse is on; #19303's hybrid opts its
    draft pool in (True): paired. With reuse off every tree is unpaired and the carry stands aside."""
    llm = _llm(version=version, enable_block_reuse=reuse)
    profile = VERSIONS[version]
    target = type(llm.executor.target)
    reads = profile["pairing_reads"]
    assert getattr(target, reads) is profile["supports"]
    assert hasattr(target, "_supports_draft_reuse_match_backoff") == version.startswith("main+19303")
    paired = reuse and profile["supports"]
    draft = llm.executor.draft
    assert (draft.enable_joint_kv_cache_reuse, draft._can_publish_block_reuse) == (paired, paired)
    assert llm.executor.topology == ("paired" if paired else "unpaired")
    assert (profile["topology"] == "paired") == bool(profile["supports"])  # the table's column
    carry = attach(llm)
    assert (carry.topology, carry.armed) == ("paired" if paired else "unpaired", reuse and not paired)
    if not reuse:
        assert carry.reason.startswith("block reuse is off")
