"""The hybrid target's prefix reuse on the STAND-IN (no TensorRT-LLM runs here), as
`MambaHybridCacheManagerV2` does it (`mamba_cache_manager_v2.py` / `common.py` @ 28295084):
snapshot points from `kv_cache_config.mamba_state_config`, commits only at them, the warm
turn's reused depth R the deepest committed point below the prompt's last token; and the
carry standing aside in one line, naming what to set, where the target can never reuse a
prefix (block reuse off, or no snapshot placement): in `attach`, in the worker hook (the
keyword-only creator path) and in `trtllm-mtp-carry info --llm-config`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from standin_helpers import model, user_tokens

from trtllm_mtp_carry.cli import main
from trtllm_mtp_carry.trtllm import CARRY_MANAGER_KEY, attach, worker
from trtllm_mtp_carry.trtllm.options import RECOMMENDED_KV_CACHE_CONFIG
from trtllm_mtp_carry.trtllm.standin import (
    ConversationParams,
    KvCacheConfig,
    LlmRequest,
    MambaStateConfig,
    ResourceManagerType,
    StandinLLM,
    create_py_executor_instance,
)

NO_PLACEMENT = ("the hybrid target keeps no snapshot point (kv_cache_config.mamba_state_config sets "
                "none): no prefix is ever reused, so there is nothing to carry; set kv_cache_config."
                "mamba_state_config.additional_snapshot_offsets_from_end: [0] (a snapshot at each "
                "prompt's end)")
REUSE_OFF = ("block reuse is off (kv_cache_config.enable_block_reuse): no prefix is ever reused, so "
             "there is nothing to carry; set kv_cache_config.enable_block_reuse: true and "
             "kv_cache_config.mamba_state_config.additional_snapshot_offsets_from_end: [0] (a "
             "snapshot at each prompt's end)")
SOURCE_TEST_STATE = {"periodic_snapshot_interval": 64, "additional_snapshot_offsets_from_start": [128, 999],
                     "additional_snapshot_offsets_from_end": [0, 22, 999]}


def _llm(kv_cache_config: Any, **options: Any) -> StandinLLM:
    return StandinLLM(model(), kv_cache_config=kv_cache_config, chunk_size=32, num_pages=256,
                      single_process=True, **options)


@pytest.mark.parametrize(("state", "reuse", "prompt_len", "points"), [
    # the configuration TensorRT-LLM's own test_v2_hybrid_prepare_expect_snapshot_points uses
    (SOURCE_TEST_STATE, True, 150, [64, 128, 150]),
    (SOURCE_TEST_STATE, True, 128, [64, 106, 128]),
    (SOURCE_TEST_STATE, True, 32, [10, 32]),
    (SOURCE_TEST_STATE, False, 150, []),  # block reuse off: no point at all
    ({}, True, 150, []),  # no placement: nothing is ever committed
    ({"enable_branch_snapshot": True}, True, 150, [150]),  # the flag alone keeps the prompt's end
    ({"additional_snapshot_offsets_from_end": [0]}, True, 150, [150]),  # the recommended placement
])
def test_snapshot_points_follow_prepare_expect_snapshot_points(
        state: dict[str, Any], reuse: bool, prompt_len: int, points: list[int]) -> None:
    llm = _llm({"enable_block_reuse": reuse, "mamba_state_config": state})
    req = LlmRequest(1, list(range(prompt_len)), 4)
    llm.executor.target.prepare_expect_snapshot_points([req])
    assert req.expect_snapshot_points == points


def test_the_model_defaults_turn_block_reuse_off_with_no_snapshot_placement() -> None:
    """Qwen3-Next's get_model_defaults: enable_block_reuse False; MambaStateConfig's defaults."""
    target = _llm(None).executor.target
    assert target.enable_block_reuse is False
    assert target.kv_cache_config == KvCacheConfig(False, MambaStateConfig(0, [], [], False))


def _two_turns(llm: StandinLLM, first: list[int], second_tail: list[int] | None) -> tuple[int, int]:
    """R of a cold turn and of the next turn (`second_tail` None: the same prompt again)."""
    a = llm.generate_async(first, 4, conversation_params=ConversationParams(conversation_id="c"))
    llm.run_until_done()
    prompt = first if second_tail is None else a.get_tokens(0) + second_tail
    b = llm.generate_async(prompt, 4, conversation_params=ConversationParams(conversation_id="c"))
    llm.run_until_done()
    llm.executor.check()
    return a.reused, b.reused


@pytest.mark.parametrize(("config", "reused"), [
    (RECOMMENDED_KV_CACHE_CONFIG, 200),  # the previous turn's whole prompt
    ({"enable_block_reuse": True, "mamba_state_config": {"periodic_snapshot_interval": 64}}, 192),
    ({"enable_block_reuse": True, "mamba_state_config": {"additional_snapshot_offsets_from_start": [96]}}, 96),
    ({"enable_block_reuse": True}, 0),  # no placement
    ({"enable_block_reuse": False, "mamba_state_config": {"additional_snapshot_offsets_from_end": [0]}}, 0),
])
def test_a_warm_turn_reuses_the_deepest_committed_point_its_prompt_matches(
        config: dict[str, Any], reused: int) -> None:
    assert _two_turns(_llm(config), user_tokens(0, 200), user_tokens(900, 40)) == (0, reused)


@pytest.mark.parametrize(("offsets", "reused"), [([0], 0), ([0, 1], 160)])
def test_the_prefix_lookup_excludes_the_prompts_last_token(offsets: list[int], reused: int) -> None:
    """The same 161-token prompt again: a snapshot at its end (161) is past the lookup's reach
    (160 tokens); one a token earlier (160, a chunk end) is reused."""
    config = {"enable_block_reuse": True, "mamba_state_config": {"additional_snapshot_offsets_from_end": offsets}}
    assert _two_turns(_llm(config), user_tokens(0, 161), None) == (0, reused)


@pytest.mark.parametrize(("config", "reason"), [
    ({"enable_block_reuse": True}, NO_PLACEMENT),
    ({"enable_block_reuse": False, "mamba_state_config": {"additional_snapshot_offsets_from_end": [0]}},
     REUSE_OFF),
    (None, REUSE_OFF),  # Qwen3-Next's model default
])
def test_attach_stands_aside_in_one_line_naming_what_to_set(config: Any, reason: str) -> None:
    llm = _llm(config)
    carry = attach(llm)
    assert (carry.topology, carry.armed, carry.manager, carry.reason) == ("unpaired", False, None, reason)
    assert CARRY_MANAGER_KEY not in llm.executor.resource_manager.resource_managers


@pytest.fixture
def carry_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "carry.yaml"
    config.write_text("mtp_carry: {carry_slots: 8}\n")
    monkeypatch.setenv(worker.ENV, str(config))


def _session(llm: StandinLLM, turns: int) -> list[LlmRequest]:
    done, prompt = [], user_tokens(0, 96)
    for t in range(turns):
        req = llm.generate_async(prompt, 6, conversation_params=ConversationParams(conversation_id="s"))
        llm.run_until_done()
        done.append(req)
        prompt = req.get_tokens(0) + user_tokens(700 + 50 * t, 32 - (len(req.get_tokens(0)) % 32) + 32)
    return done


@pytest.mark.parametrize(("config", "reason"), [
    ({"enable_block_reuse": True}, NO_PLACEMENT),
    ({"enable_block_reuse": False, "mamba_state_config": {"additional_snapshot_offsets_from_end": [0]}},
     REUSE_OFF),
])
def test_the_worker_hook_stands_aside_in_one_line_and_nothing_is_written(
        carry_env: None, config: dict[str, Any], reason: str) -> None:
    llm = StandinLLM(model(), kv_cache_config=config, chunk_size=32, num_pages=256)  # in the "worker"
    assert worker.messages()[-1] == f"mtp carry: stands aside: {reason}"
    assert CARRY_MANAGER_KEY not in llm.executor.resource_manager.resource_managers
    turns = _session(llm, 3)
    assert [r.reused for r in turns] == [0, 0, 0]  # the target never reused a prefix
    llm.executor.check()


def test_the_worker_hook_under_the_recommended_placement_adopts_every_warm_turn_at_r_equal_the_last_prompt(
        carry_env: None) -> None:
    llm = StandinLLM(model(), kv_cache_config=RECOMMENDED_KV_CACHE_CONFIG, chunk_size=32, num_pages=256)
    assert worker.messages()[-1].startswith(f"mtp carry: installed in the worker's PyExecutor as {CARRY_MANAGER_KEY}")
    turns = _session(llm, 4)
    assert [r.reused for r in turns] == [0, *(r.prompt_len for r in turns[:-1])]
    stats = llm.executor.resource_manager.resource_managers[CARRY_MANAGER_KEY].stats()
    assert (stats.outcomes["adopted"], sum(stats.outcomes.values()), stats.deposits) == (3, 4, 4)  # the first turn misses
    llm.executor.check()


def test_the_creator_takes_keywords_only_as_tensorrt_llms_does() -> None:
    with pytest.raises(TypeError, match="positional"):
        create_py_executor_instance(None, {})  # type: ignore[misc]


def test_a_folded_executor_has_a_none_draft_entry_and_is_reported_folded() -> None:
    llm = _llm(RECOMMENDED_KV_CACHE_CONFIG, topology="folded")
    managers = llm.executor.resource_manager.resource_managers
    assert ResourceManagerType.DRAFT_KV_CACHE_MANAGER in managers
    assert managers[ResourceManagerType.DRAFT_KV_CACHE_MANAGER] is None
    carry = attach(llm)
    assert (carry.topology, carry.armed) == ("folded", False)
    assert carry.reason.startswith("folded: no separate draft KV cache manager")


MTP = "speculative_config: {decoding_type: MTP}\n"


@pytest.mark.parametrize(("yaml_text", "armed", "note"), [
    (MTP + "kv_cache_config:\n  enable_block_reuse: true\n  mamba_state_config: {additional_snapshot_offsets_from_end: [0]}\n",
     "yes", "under LLM: BF16 KV: the drafter's rows are carried as the draft pool holds them"),
    (MTP + "kv_cache_config: {enable_block_reuse: true}\n", "no", f"stands aside under LLM: {NO_PLACEMENT}"),
    (MTP, "no", f"stands aside under LLM: {REUSE_OFF}"),
])
def test_info_shows_what_an_llm_yaml_would_get(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               yaml_text: str, armed: str, note: str) -> None:
    path = tmp_path / "llm.yaml"
    path.write_text(yaml_text)
    assert main(["info", "--llm-config", str(path)]) == 0
    rows = {line.split("  ")[0]: line for line in capsys.readouterr().out.splitlines()}
    line = rows["carry armed"].split(None, 3)
    assert (line[2], line[3].replace(str(path), "LLM").startswith(note)) == (armed, True)


def test_info_refuses_an_unreadable_llm_yaml_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", "--llm-config", "/no/such/llm.yaml"]) == 2
    err = capsys.readouterr().err
    assert err == ("trtllm-mtp-carry: error: --llm-config /no/such/llm.yaml: cannot read "
                   "extra_llm_api_options /no/such/llm.yaml: No such file or directory\n")
