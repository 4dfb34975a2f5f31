"""`info --llm-config` reads every value as TensorRT-LLM's pydantic `LlmArgs` would (issue 49, item 2).

`trtllm/llm_yaml.py` validates the file with pydantic over models mirrored from `llm_args.py` @
0004396720054fd8e205cbf616f21f0b57c6b412 (`extra="forbid"` everywhere, tagged unions, the
validators the verdict depends on). A value TensorRT-LLM would refuse is one line naming the key
and the value, exit 2; `--model` must name a checkpoint directory with a readable `config.json`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from trtllm_mtp_carry.cli import main
from trtllm_mtp_carry.trtllm.llm_yaml import read_llm_args
from trtllm_mtp_carry.trtllm.options import TrtllmAdapterError

SAID = "(TensorRT-LLM's LlmArgs refuses it, llm_args.py @ 0004396)"


@pytest.mark.parametrize(("value", "want"), [
    ("false", False), ("False", False), ("no", False), ("off", False), ("0", False), (0, False),
    ("true", True), ("yes", True), ("on", True), ("1", True), (1, True), (True, True),
])
def test_booleans_follow_pydantics_rules(value: Any, want: bool) -> None:
    args = read_llm_args({"kv_cache_config": {"enable_block_reuse": value}})
    assert args.kv_cache_config.enable_block_reuse is want


@pytest.mark.parametrize(("mapping", "line"), [
    ({"kv_cache_config": {"enable_block_reuse": "maybe"}},
     f"kv_cache_config.enable_block_reuse: 'maybe': Input should be a valid boolean, unable to interpret input {SAID}"),
    ({"kv_cache_config": {"enable_block_reuse": 2}},
     f"kv_cache_config.enable_block_reuse: 2: Input should be a valid boolean, unable to interpret input {SAID}"),
    ({"kv_cache_config": {"enable_block_resue": True}},
     f"kv_cache_config.enable_block_resue: unknown key (Extra inputs are not permitted: {SAID[1:-1]})"),
    ({"enable_block_reuse": True},
     f"enable_block_reuse: unknown key (Extra inputs are not permitted: {SAID[1:-1]})"),
    ({"speculative_config": {"decoding_type": "Medusa"}},
     "speculative_config.decoding_type: 'Medusa': Input tag 'Medusa' found using 'decoding_type' does not "
     "match any of the expected tags: 'Draft_Target', 'Eagle3', 'Eagle', 'MTP', 'NGram', 'SA', 'User_Provided', "
     f"'SaveState', 'PARD', 'DFlash', 'DSpark', 'AUTO' {SAID}"),
    ({"speculative_config": {"decoding_type": "MTP", "num_nextn_predict_layers": 0}},
     f"speculative_config: {{'decoding_type': 'MTP', 'num_nextn_predict_layers': 0}}: max_draft_len must be > 0 "
     f"for MTP {SAID}"),
    ({"kv_cache_config": {"block_reuse_config": {"policy": "per_turn"}}},
     "kv_cache_config.block_reuse_config.policy: 'per_turn': Input should be 'all_reusable', 'per_request' or "
     f"'per_conversation' {SAID}"),
    ({"kv_cache_config": {"mamba_state_config": {"additional_snapshot_offsets_from_end": [-1]}}},
     "kv_cache_config.mamba_state_config.additional_snapshot_offsets_from_end[0]: -1: Input should be greater "
     f"than or equal to 0 {SAID}"),
    ({"cache_transceiver_config": {"backend": "TCP"}},
     f"cache_transceiver_config.backend: 'TCP': Input should be 'DEFAULT', 'UCX', 'NIXL', 'MOONCAKE' or 'MPI' {SAID}"),
    ({"sampler_type": "TRTLLMSampler"},
     "sampler_type: 'TRTLLMSampler': 'sampler_type' was removed and 'TRTLLMSampler' is no longer available; "
     f"TorchSampler is the only sampler {SAID}"),
])
def test_a_value_tensorrt_llm_refuses_is_one_line_naming_key_and_value(mapping: dict[str, Any], line: str) -> None:
    with pytest.raises(TrtllmAdapterError) as exc:
        read_llm_args(mapping)
    assert str(exc.value) == line


def test_known_fields_the_verdict_does_not_read_are_accepted_and_tags_pick_the_model() -> None:
    args = read_llm_args({
        "max_batch_size": 8, "enable_chunked_prefill": True, "cuda_graph_config": {"max_batch_size": 8},
        "kv_cache_config": {"free_gpu_memory_fraction": "0.8", "tokens_per_block": 32, "mamba_state_cache_interval": 64},
        "speculative_config": {"decoding_type": "MTP", "num_nextn_predict_layers": 3},
        "sparse_attention_config": {"algorithm": "qsa"}})
    assert args.kv_cache_config.free_gpu_memory_fraction == 0.8  # a numeric string is a float to pydantic
    assert args.kv_cache_config.mamba_state_config.periodic_snapshot_interval == 64  # the legacy key migrated
    assert (args.speculative_config.decoding_type, args.speculative_config.max_draft_len) == ("MTP", 3)
    assert args.sparse_attention_config.algorithm == "qsa"


def _info(*args: str) -> int:
    return main(["info", "--llm-config", *args])


def test_a_bad_value_is_one_error_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "llm.yaml"
    path.write_text(yaml.safe_dump({"kv_cache_config": {"enable_block_reuse": "maybe"}}))
    assert _info(str(path)) == 2
    err = capsys.readouterr().err
    assert err == (f"trtllm-mtp-carry: error: --llm-config {path}: kv_cache_config.enable_block_reuse: 'maybe': "
                   f"Input should be a valid boolean, unable to interpret input {SAID}\n")


@pytest.mark.parametrize(("setup", "why"), [
    (None, "no such checkpoint directory"),
    ({}, "no config.json in it: not a Hugging Face checkpoint"),
    ({"config.json": "{not json"}, "is not JSON"),
    ({"config.json": "[1, 2]"}, "is not a JSON object"),
    ({"config.json": "{}", "hf_quant_config.json": "{"}, "is not JSON"),
])
def test_a_missing_or_unreadable_checkpoint_is_an_error_not_a_bf16_verdict(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], setup: dict[str, str] | None, why: str) -> None:
    path = tmp_path / "llm.yaml"
    path.write_text("speculative_config: {decoding_type: MTP}\n")
    model = tmp_path / "ckpt"
    if setup is not None:
        model.mkdir()
        for name, text in setup.items():
            (model / name).write_text(text)
    assert _info(str(path), "--model", str(model)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"trtllm-mtp-carry: error: --llm-config {path}: --model {model}: ")
    assert why in err and err.count("\n") == 1


def test_the_checkpoints_dtype_and_kv_quantization_decide_auto(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "llm.yaml"
    path.write_text("speculative_config: {decoding_type: MTP}\n"
                    "kv_cache_config: {enable_block_reuse: true, mamba_state_config: "
                    "{additional_snapshot_offsets_from_end: [0]}}\n")
    model = tmp_path / "ckpt"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))  # the deprecated key
    assert main(["info", "--json", "--llm-config", str(path), "--model", str(model)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["kv_format"], report["carry_armed"]) == ("fp16", False)  # an FP16 model's KV stands aside
    (model / "hf_quant_config.json").write_text(json.dumps({"quantization": {"kv_cache_quant_algo": "FP8"}}))
    assert main(["info", "--json", "--llm-config", str(path), "--model", str(model)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["kv_format"], report["carry_armed"]) == ("fp8", True)
