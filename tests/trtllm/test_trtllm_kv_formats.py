"""One verdict on KV formats and cache managers: `info --llm-config` and the worker agree.

Both call `trtllm.kv_formats.kv_verdict` (issue 41: an `llm.yaml` with `kv_cache_config.dtype:
fp8` or `nvfp4` gets the worker's verdict from `info`): `info` on what the YAML (and the
checkpoint's `hf_quant_config.json`) says, the worker's probe on the live draft manager the
stand-in builds for the same deployment (its `dtype` and class). Each case pins the exact line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from standin_helpers import model  # isort: skip
from trtllm_mtp_carry.cli import main
from trtllm_mtp_carry.trtllm.kv_formats import kv_verdict, resolve_kv_format, verdict_of_draft
from trtllm_mtp_carry.trtllm.options import RECOMMENDED_KV_CACHE_CONFIG, TrtllmAdapterError
from trtllm_mtp_carry.trtllm.probe import probe_managers
from trtllm_mtp_carry.trtllm.standin import DataType, Mapping, StandinLLM

BF16 = "BF16 KV: the drafter's rows are carried as the draft pool holds them"
FP8 = "FP8 KV: the drafter's rows are carried bit for bit as the pool's own float8_e4m3fn bytes, never re-scaled"
NVFP4 = ("NVFP4 KV: the drafter's rows are carried bit for bit as their own e2m1 payload and E4M3 "
         "block-scale bytes, never re-scaled")
QSA_SIDE = ", with the QSA hybrid's index-key and position rows of each key carried beside them"
QSA_NVFP4 = ("the QSA hybrid's NVFP4 draft pool stands aside: where its block-scale pages sit in the "
             "slot-major QSA layout was not read")

# (kv_cache_config.dtype, the checkpoint's kv_cache_quant_algo) -> the stand-in's DataType, the line
CHECKPOINTS: dict[str, tuple[str, str | None, DataType, str]] = {
    "auto": ("auto", None, DataType.BF16, BF16),
    "auto+fp8-checkpoint": ("auto", "FP8", DataType.FP8, FP8),
    "auto+nvfp4-checkpoint": ("auto", "NVFP4", DataType.NVFP4, NVFP4),
    "fp8-over-nvfp4-checkpoint": ("fp8", "NVFP4", DataType.FP8, FP8),  # an explicit dtype wins
}


def _yaml(tmp_path: Path, dtype: str, extra: str) -> Path:
    path = tmp_path / "llm.yaml"
    path.write_text("speculative_config: {decoding_type: MTP, num_nextn_predict_layers: 3}\n"
                    "kv_cache_config:\n  enable_block_reuse: true\n"
                    "  mamba_state_config: {additional_snapshot_offsets_from_end: [0]}\n"
                    f"  dtype: {dtype}\n" + extra)
    return path


def _checkpoint(tmp_path: Path, algo: str | None) -> str:
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"model_type": "qwen3_next", "dtype": "bfloat16"}))
    if algo is not None:
        (root / "hf_quant_config.json").write_text(json.dumps(
            {"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": algo}}))
    return str(root)


def _info(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["info", "--json", *args]) == 0
    report: dict[str, Any] = json.loads(capsys.readouterr().out)
    return report


@pytest.mark.parametrize("qsa", [False, True])
@pytest.mark.parametrize("case", list(CHECKPOINTS))
def test_the_checkpoint_decides_dtype_auto_in_info_as_in_the_worker(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, qsa: bool) -> None:
    """`--model DIR`: its `hf_quant_config.json` decides `dtype: auto` as TensorRT-LLM's loader does;
    the worker sees the draft pool that format gives (the matrix of every case, format and tree is
    tests/trtllm/test_trtllm_one_verdict.py)."""
    dtype, algo, datatype, line = CHECKPOINTS[case]
    extra = "sparse_attention_config: {algorithm: qsa}\n" if qsa else ""
    report = _info(capsys, "--llm-config", str(_yaml(tmp_path, dtype, extra)), "--model", _checkpoint(tmp_path, algo))
    want, carries = (line + QSA_SIDE if qsa else line), True
    if qsa and datatype == DataType.NVFP4:
        want, carries = QSA_NVFP4, False
    assert (report["kv_verdict"], report["carry_armed"]) == (want, carries)
    assert "@" not in report["kv_verdict"] and all("@" in d for d in report["kv_verdict_details"])
    llm = StandinLLM(model(), kv_cache_config=RECOMMENDED_KV_CACHE_CONFIG, chunk_size=32, num_pages=64,
                     version="main:qsa" if qsa else "main", kv_dtype=datatype, single_process=True)
    managers = llm.executor.resource_manager.resource_managers
    draft = next(m for k, m in managers.items() if getattr(k, "name", k) == "DRAFT_KV_CACHE_MANAGER")
    verdict = verdict_of_draft(draft)
    assert (verdict.line, verdict.carries, list(verdict.details)) == (want, carries, report["kv_verdict_details"])


def test_an_nvfp4_yaml_is_armed_in_info_as_the_worker_arms_it(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 41's contradiction stays closed the other way round: both carry an NVFP4 pool now. The
    first line is one sentence; where it was read is on the lines below it (issue 49)."""
    path = _yaml(tmp_path, "nvfp4", "")
    assert main(["info", "--llm-config", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split(None, 3) == ["carry", "armed", "yes", f"under {path}: {NVFP4}"]
    assert lines[1].strip().startswith("get_buffers re-types an NVFP4 pool to int8")
    assert "@" not in lines[0]  # no file@commit on the verdict line (they were 500 characters of it)


def test_compression_is_one_verdict_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    want = ("KV-cache compression (quantization_for_cold_page) stands aside: when a live request's draft "
            "pages are rewritten by the compression manager was not read")
    path = _yaml(tmp_path, "auto", "kv_cache_compression_config: {algorithm: quantization_for_cold_page, "
                                   "quant: nvfp4}\n")
    assert _info(capsys, "--llm-config", str(path))["kv_verdict"] == want
    llm = StandinLLM(model(), kv_cache_config=RECOMMENDED_KV_CACHE_CONFIG, chunk_size=32, num_pages=64)
    managers = llm.executor.resource_manager.resource_managers
    probe = probe_managers(managers, "stand-in", compression="quantization_for_cold_page")
    assert (probe.runnable, probe.reason) == (False, want)


@pytest.mark.parametrize(("dtype", "quant", "model_dtype", "want"), [
    ("auto", None, "bfloat16", "bf16"),
    ("auto", "FP8", "bfloat16", "fp8"),
    ("auto", "NVFP4", "bfloat16", "nvfp4"),
    ("fp8", "NVFP4", "bfloat16", "fp8"),  # an explicit dtype wins over the checkpoint's
    ("NVFP4", None, "bfloat16", "nvfp4"),  # KvCacheConfig lowercases it
    ("auto", None, "float16", "fp16"),
])
def test_the_kv_format_resolves_as_tensorrt_llm_does(dtype: str, quant: str | None, model_dtype: str,
                                                     want: str) -> None:
    assert resolve_kv_format(dtype, quant, model_dtype) == want


def test_an_unknown_dtype_is_one_line_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="got 'int4'$"):
        resolve_kv_format("int4")
    path = _yaml(tmp_path, "int4", "")
    assert main(["info", "--llm-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == (f"trtllm-mtp-carry: error: --llm-config {path}: kv_cache_config.dtype: 'int4': "
                   'kv_cache_config.dtype must be one of "auto", "fp8", "fp8_ds_mla", "nvfp4", or valid '
                   "torch.dtype string (TensorRT-LLM's LlmArgs refuses it, llm_args.py @ 0004396)\n")


def test_a_format_the_carry_does_not_move_names_itself() -> None:
    verdict = kv_verdict("fp16")
    assert verdict.line == "FP16 KV stands aside: the carry moves BF16, FP8 or NVFP4 draft pages only"
    assert verdict.details == ("kv_cache_config.dtype auto with a BF16 model, fp8 or nvfp4",)


def test_the_configuration_page_shows_infos_real_first_lines(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """docs/CONFIGURATION.md's `info --llm-config nvfp4.yaml | sed -n 1,3p` sample is what info prints."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "CONFIGURATION.md").read_text()
    command = "trtllm-mtp-carry info --llm-config nvfp4.yaml | sed -n 1,3p\n```\n\n```text\n"
    start = text.index(command) + len(command)
    sample = text[start:text.index("\n```", start)]
    heredoc = "cat > nvfp4.yaml <<'EOF'\n"
    yaml_start = text.index(heredoc) + len(heredoc)
    path = tmp_path / "nvfp4.yaml"
    path.write_text(text[yaml_start:text.index("EOF\n", yaml_start)])
    assert main(["info", "--llm-config", str(path)]) == 0
    first = capsys.readouterr().out.splitlines()[:3]
    assert [line.replace(str(path), "nvfp4.yaml") for line in first] == sample.splitlines()


def test_a_v1_manager_is_one_line_in_info_and_the_worker(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """`use_kv_cache_manager_v2: false` gives a hybrid the V1 `CppMambaHybridCacheManager`
    (`_util.py` @ 0004396 `get_kv_cache_manager_cls`: `if not use_v2: return CppMambaHybridCacheManager`)."""
    path = _yaml(tmp_path, "auto", "")
    path.write_text(path.read_text().replace("kv_cache_config:\n", "kv_cache_config:\n  use_kv_cache_manager_v2: false\n")
                    .replace("{additional_snapshot_offsets_from_end: [0]}", "{periodic_snapshot_interval: 64}"))
    report = _info(capsys, "--llm-config", str(path))
    want = ("the target KV cache manager is CppMambaHybridCacheManager (KV cache manager V1): the carry supports "
            "KVCacheManagerV2 only, set kv_cache_config.use_kv_cache_manager_v2: true")
    assert (report["carry_armed"], report["kv_verdict"]) == (False, want)
    llm = StandinLLM(model(), kv_cache_config=RECOMMENDED_KV_CACHE_CONFIG, chunk_size=32, num_pages=64,
                     version="1.2.1")
    with pytest.raises(TrtllmAdapterError) as exc:
        probe_managers(llm.executor.resource_manager.resource_managers, "stand-in")
    assert str(exc.value) == want


@pytest.mark.parametrize(("extra", "mapping", "want"), [
    ("pipeline_parallel_size: 2\n", {"world_size": 2, "pp_size": 2},
     "pipeline parallel size 2: the carry stands aside: the MTP layer's draft pages live on the last "
     "pipeline stage only, whose PyExecutor loop keeps several micro-batches in flight (not modelled); "
     "use tensor parallelism (pipeline_parallel_size 1)"),
    ("enable_attention_dp: true\n", {"enable_attention_dp": True},
     "attention data parallelism is on: TensorRT-LLM then folds the MTP layer's KV into the target pool "
     "(no separate draft pool) and each rank serves its own requests; the carry stands aside "
     "(enable_attention_dp must be false)"),
])
def test_a_parallel_mapping_the_carry_refuses_is_one_line_in_info_and_the_worker(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: str, mapping: dict[str, Any],
        want: str) -> None:
    """Attention DP and pipeline parallelism stand aside (tensor parallelism is carried:
    test_trtllm_tensor_parallel.py). The stand-in runs one stage, so the worker's managers are
    given the mapping the file asks for."""
    path = _yaml(tmp_path, "auto", extra)
    report = _info(capsys, "--llm-config", str(path))
    assert (report["carry_armed"], report["carry_armed_reason"]) == (False, f"stands aside under {path}: {want}")
    llm = StandinLLM(model(), kv_cache_config=RECOMMENDED_KV_CACHE_CONFIG, chunk_size=32, num_pages=64)
    for manager in llm.executor.resource_manager.resource_managers.values():
        if hasattr(manager, "mapping"):
            manager.mapping = Mapping(**mapping)
    with pytest.raises(TrtllmAdapterError) as exc:
        probe_managers(llm.executor.resource_manager.resource_managers, "stand-in")
    assert str(exc.value) == want


def test_a_pool_with_qsa_position_pages_but_not_its_views_stands_aside() -> None:
    """Fail closed: a manager keeping QSA position pages (`qsa_position_layer_id` set) without the
    index-key and position views the carry reads is not carried K/V-only; the same class with QSA
    off (`qsa_position_layer_id` None: `_qsa_enabled` False, modules/qwen4_exp/cache_manager.py @
    6ff2801f) is judged as the hybrid it is."""
    class Qwen4ExpHybridCacheManagerV2:
        dtype = DataType.BF16
        qsa_position_layer_id: int | None = 3

    verdict = verdict_of_draft(Qwen4ExpHybridCacheManagerV2())
    assert (verdict.carries, verdict.manager) == (False, "Qwen4ExpHybridCacheManagerV2")
    assert verdict.line == ("Qwen4ExpHybridCacheManagerV2 stands aside: it keeps QSA position pages "
                            "(qsa_position_layer_id is set) without the index-key and position views the carry reads")
    Qwen4ExpHybridCacheManagerV2.qsa_position_layer_id = None
    assert verdict_of_draft(Qwen4ExpHybridCacheManagerV2()).carries
