"""One verdict: `info --llm-config` and the worker's probe say the same thing about one deployment.

Issue 49, item 2. For every case below, on every KV format and every TensorRT-LLM tree profile
the stand-in plays (`standin.VERSIONS`), the test writes one `llm.yaml` (its `mtp_carry` section
included), asks `trtllm-mtp-carry info --json --llm-config` for its verdict, then builds the
stand-in's default LLM for the same deployment with the worker hook on (`TRTLLM_MTP_CARRY_WORKER`,
the `mtp_carry` section as the carry file) and reads the one line the worker printed. TensorRT-LLM
builds its executor from the file as its pydantic `LlmArgs` validated it, so the stand-in gets the
values `trtllm.llm_yaml.read_llm_args` gives (`enable_block_reuse: "false"` is False there).

Both must agree on armed or not and give the same reason (the first line, one sentence). Where
only the live executor can tell (the tree's pairing: PR #18843's layout and PR #19303's tree pair
a hybrid's draft pool), `info` says armed with the note that pairing is read at start, and the
worker says paired: `TREE_DECIDED`. The 1.2.1 tree builds a V1 hybrid manager; its file says so
(`use_kv_cache_manager_v2: false`), as a 1.2.x deployment's effectively does.

On the STAND-IN: no TensorRT-LLM ran.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from standin_helpers import model  # isort: skip
from trtllm_mtp_carry.cli import main
from trtllm_mtp_carry.core import settings
from trtllm_mtp_carry.trtllm import CARRY_MANAGER_KEY, worker
from trtllm_mtp_carry.trtllm.kv_formats import resolve_kv_format
from trtllm_mtp_carry.trtllm.llm_yaml import read_llm_args
from trtllm_mtp_carry.trtllm.standin import VERSIONS, DataType, StandinLLM

KV = {"bf16": "auto", "fp8": "fp8", "nvfp4": "nvfp4"}
"""KV format -> `kv_cache_config.dtype` (BF16: `auto` over the default bfloat16 model)."""

DATATYPES = {"bf16": DataType.BF16, "fp8": DataType.FP8, "nvfp4": DataType.NVFP4}

BASE: dict[str, Any] = {
    "speculative_config": {"decoding_type": "MTP", "num_nextn_predict_layers": 3},
    "kv_cache_config": {"enable_block_reuse": True,
                        "mamba_state_config": {"additional_snapshot_offsets_from_end": [0]}},
    "mtp_carry": {"carry_slots": 8, "carry_memory": "16MiB"},
}
"""The armed deployment: one-model MTP, block reuse, a snapshot at each prompt's end."""


def _no_spec(d: dict[str, Any]) -> None:
    del d["speculative_config"]


def _spec(config: dict[str, Any]) -> Any:
    def edit(d: dict[str, Any]) -> None:
        d["speculative_config"] = config
    return edit


def _kv(**values: Any) -> Any:
    def edit(d: dict[str, Any]) -> None:
        d["kv_cache_config"].update(values)
    return edit


def _carry(**values: Any) -> Any:
    def edit(d: dict[str, Any]) -> None:
        d["mtp_carry"].update(values)
    return edit


def _no_snapshot(d: dict[str, Any]) -> None:
    del d["kv_cache_config"]["mamba_state_config"]


def _disaggregated(d: dict[str, Any]) -> None:
    d["cache_transceiver_config"] = {"backend": "DEFAULT"}


def _per_conversation(d: dict[str, Any]) -> None:
    d["kv_cache_config"]["mamba_state_config"] = {"periodic_snapshot_interval": 64}
    d["kv_cache_config"]["block_reuse_config"] = {"policy": "per_conversation"}


CASES: dict[str, tuple[Any, str | None]] = {
    # case -> (the file's edit, the reason's start when it stands aside; None: armed)
    "mtp": (lambda d: None, None),
    "no_speculative_config": (_no_spec, "no speculative decoding is configured (speculative_config is not set)"),
    "eagle3": (_spec({"decoding_type": "Eagle3", "max_draft_len": 3, "speculative_model": "eagle3"}),
               "speculative_config.decoding_type is Eagle3, and the carry restores a one-model MTP drafter's"),
    "ngram": (_spec({"decoding_type": "NGram", "max_draft_len": 3, "max_matching_ngram_size": 2}),
              "speculative_config.decoding_type is NGram"),
    "disaggregated": (_disaggregated, "disaggregated serving (cache_transceiver_config is set) folds the MTP"),
    "carry_memory_0": (_carry(carry_memory=0), "the carry's device memory is 0 bytes"),
    "carry_memory_flag_0": (_carry(carry_memory=None), "the carry's device memory is 0 bytes"),
    "disabled": (_carry(enable=False), "not configured (mtp_carry.enable is false)"),
    "reuse_string_false": (_kv(enable_block_reuse="false"), "block reuse is off"),
    "reuse_string_0": (_kv(enable_block_reuse="0"), "block reuse is off"),
    "reuse_string_yes": (_kv(enable_block_reuse="yes"), None),
    "no_snapshot": (_no_snapshot, "the hybrid target keeps no snapshot point (kv_cache_config.mamba_state_config"),
    "per_conversation_periodic": (_per_conversation, "the hybrid target keeps no snapshot point "
                                  "(kv_cache_config.block_reuse_config.policy per_conversation"),
}

TREE_DECIDED = {name for name, p in VERSIONS.items() if p["topology"] == "paired"}
"""Profiles whose draft pool pairs with block reuse on: only the live executor shows it."""

V1_TREE = "1.2.1"

SNAPSHOT_CASES = {"no_snapshot", "per_conversation_periodic"}
REUSE_CASES = {"reuse_string_false", "reuse_string_0", "no_snapshot", "per_conversation_periodic"}
"""Cases decided at the last step (reuse): a KV format or manager the carry does not move wins."""


DSV4_CLASS = "DeepseekV4CacheManager"


def _kv_step(kv: str, profile: str) -> str | None:
    """The reason the KV step stands aside for on this tree and format, or None."""
    if profile == V1_TREE:
        return "the target KV cache manager is CppMambaHybridCacheManager (KV cache manager V1)"
    if VERSIONS[profile]["draft_class"] not in (None, DSV4_CLASS) and kv == "nvfp4":
        return "the QSA hybrid's NVFP4 draft pool stands aside"
    return None


def _deployment(case: str, kv: str, profile: str) -> dict[str, Any]:
    d = copy.deepcopy(BASE)
    CASES[case][0](d)
    d["kv_cache_config"]["dtype"] = KV[kv]
    if VERSIONS[profile]["draft_class"] == DSV4_CLASS:  # DeepSeek-V4: 128 or 256 tokens a block
        d["sparse_attention_config"] = {"algorithm": "deepseek_v4"}
        d["kv_cache_config"]["tokens_per_block"] = 128
    elif VERSIONS[profile]["draft_class"] is not None:  # the QSA hybrid's trees
        d["sparse_attention_config"] = {"algorithm": "qsa"}
    if profile == V1_TREE:  # 1.2.x gives a hybrid the V1 manager; offsets need V2 (LlmArgs refuses them)
        d["kv_cache_config"]["use_kv_cache_manager_v2"] = False
        if "mamba_state_config" in d["kv_cache_config"]:
            d["kv_cache_config"]["mamba_state_config"] = {"periodic_snapshot_interval": 64}
    d["mtp_carry"] = {k: v for k, v in d["mtp_carry"].items() if v is not None}
    return d


def _standin_options(rest: dict[str, Any], profile: str) -> dict[str, Any]:
    """What TensorRT-LLM's executor is built from: the file as `LlmArgs` validated it."""
    args = read_llm_args(rest)
    kv = args.kv_cache_config
    kv_cache_config: dict[str, Any] = {
        "mamba_state_config": kv.mamba_state_config.model_dump(),
        "block_reuse_config": kv.block_reuse_config.model_dump()}
    if "enable_block_reuse" in kv.model_fields_set:  # else Qwen3-Next's model default (off)
        kv_cache_config["enable_block_reuse"] = kv.enable_block_reuse
    spec = args.speculative_config
    options: dict[str, Any] = {
        "kv_cache_config": kv_cache_config, "version": profile,
        "kv_dtype": DATATYPES[resolve_kv_format(kv.dtype)],
        "max_draft_len": 0 if spec is None else spec.max_draft_len or 3,
        "decoding_type": "MTP" if spec is None else str(spec.decoding_type)}
    if "tokens_per_block" in (rest.get("kv_cache_config") or {}):
        options["tokens_per_block"] = rest["kv_cache_config"]["tokens_per_block"]
    if args.cache_transceiver_config is not None:
        options["cache_transceiver_config"] = {"backend": args.cache_transceiver_config.backend}
    return options


def _info_reason(capsys: pytest.CaptureFixture[str], path: Path, flags: list[str]) -> tuple[bool, str, list[str]]:
    assert main(["info", *flags, "--json", "--llm-config", str(path)]) == 0
    report = json.loads(capsys.readouterr().out)
    reason = str(report["carry_armed_reason"])
    prefix = f"under {path}: " if report["carry_armed"] else f"stands aside under {path}: "
    assert reason.startswith(prefix), reason
    return bool(report["carry_armed"]), reason[len(prefix):], list(report["carry_armed_details"])


def _worker_reason(line: str) -> tuple[bool, str]:
    aside = "mtp carry: stands aside: "
    if line.startswith(aside):
        return False, line[len(aside):]
    installed = f"mtp carry: installed in the worker's PyExecutor as {CARRY_MANAGER_KEY} (TensorRT-LLM stand-in, "
    assert line.startswith(installed), line
    reason = line.split("): ", 1)[1]
    return True, reason[:reason.index("; carried rows hold")]


@pytest.mark.parametrize("profile", list(VERSIONS))
@pytest.mark.parametrize("kv", list(KV))
@pytest.mark.parametrize("case", list(CASES))
def test_info_and_the_worker_give_one_verdict(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch, case: str, kv: str,
                                              profile: str) -> None:
    deployment = _deployment(case, kv, profile)
    path = tmp_path / "llm.yaml"
    path.write_text(yaml.safe_dump(deployment))
    flags = []
    if case == "carry_memory_flag_0":  # the process setting: `--carry-memory 0`, a 0 of any pool
        monkeypatch.setattr(settings.CARRY_MEMORY, "_value", None)
        monkeypatch.setattr(settings.CARRY_MEMORY, "_source", "")
        flags = ["--carry-memory", "0"]
    info_armed, info_reason, details = _info_reason(capsys, path, flags)
    assert "@" not in info_reason and "\n" not in info_reason  # one sentence; sources go below it

    expected = CASES[case][1]
    dsv4 = VERSIONS[profile]["draft_class"] == DSV4_CLASS
    if dsv4 and case in SNAPSHOT_CASES:  # DeepSeek-V4 is no hybrid: reuse needs no snapshot point
        expected = None
    if dsv4 and case == "no_speculative_config":
        # the stand-in models DeepSeek-V4's pool only as MTP's separate draft pool (none without
        # speculation); the worker's probe reads speculative_config first on every other tree
        assert not info_armed and info_reason.startswith(expected), info_reason
        return

    carry = tmp_path / "carry.yaml"
    carry.write_text(yaml.safe_dump({"mtp_carry": deployment.pop("mtp_carry")}))
    monkeypatch.setenv(worker.ENV, str(carry))
    StandinLLM(model(), chunk_size=32, num_pages=64, **_standin_options(deployment, profile))
    worker_armed, worker_reason = _worker_reason(worker.messages()[-1])

    if expected is None or case in REUSE_CASES:  # the KV step comes first (trtllm/verdict.py's order)
        expected = _kv_step(kv, profile) or expected
    assert info_armed == (expected is None), info_reason  # an armed case arms: no pass by both refusing alike
    if expected is not None:
        assert info_reason.startswith(expected), info_reason
    if info_armed and profile in TREE_DECIDED:
        assert not worker_armed and worker_reason.startswith("paired: the draft pool publishes")
        assert any("pairing markers" in d for d in details)  # info says the worker decides it
        return
    assert (worker_armed, worker_reason) == (info_armed, info_reason)


def test_the_matrix_is_not_vacuous() -> None:
    """Every case stands aside or arms as named; every KV format and profile is in it."""
    assert {c for c, (_, why) in CASES.items() if why is None} == {"mtp", "reuse_string_yes"}
    assert set(KV) == {"bf16", "fp8", "nvfp4"} and "main:qsa" in VERSIONS and V1_TREE in VERSIONS
    assert TREE_DECIDED == {"pr18843", "main+19303"}
