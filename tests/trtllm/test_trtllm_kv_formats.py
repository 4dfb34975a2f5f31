"""One verdict on KV formats and cache managers: `info --llm-config` and the worker agree.

Issue 41: an `llm.yaml` with `kv_cache_config.dtype: fp8` (or `nvfp4`) made `info` say `carry
armed yes` while the worker refused with "the carry supports BF16 KV only". Both now call
`trtllm.kv_formats.kv_verdict`: `info` on what the YAML (and the checkpoint's
`hf_quant_config.json`) says, the worker's probe on the live draft manager the stand-in builds
for the same deployment (its `dtype` and class). Each case pins the exact line.
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
FP8 = ("FP8 KV (float8_e4m3fn pages written with the layer's static scale): the drafter's rows are "
       "carried bit for bit, never re-scaled")
NVFP4 = ("NVFP4 KV (e2m1 pairs in the K/V pages, one E4M3 scale per 16 values in KEY_BLOCK_SCALE/"
         "VALUE_BLOCK_SCALE pages at the same page index, kv_cache_manager_v2.py @ 00be09f7; written by "
         "quantizeAndWriteFP4KVCache @ 0097566b under each layer's static global K/V scale): the "
         "drafter's rows are carried as their own payload and scale bytes, bit for bit, never re-scaled")
QSA_NVFP4 = ("QSAMambaHybridCacheManagerV2 with NVFP4 KV stands aside: its slot-major views coalesce the "
             "MTP layer's K/V with its index key (qsa/cache_manager.py @ 38198e34), and where the NVFP4 "
             "KEY_BLOCK_SCALE/VALUE_BLOCK_SCALE pages sit in those slots was not read; carrying needs that "
             "geometry (a get_buffers-like view of the scale pages at the base slot ids)")
QSA = ("QSAMambaHybridCacheManagerV2: the drafter's K/V, index-key (Role.INDEX_KEY) and position "
       "(qsa_index_position) rows share one page slot (qsa/cache_manager.py @ 38198e34) and are carried "
       "together, one composite row per key, so the sparse indexer reads restored keys over the reused "
       "prefix")

# (kv_cache_config.dtype, the checkpoint's kv_cache_quant_algo) -> the stand-in's DataType, and the
# verdict line on a manager that moves K/V pages
DTYPES: dict[str, tuple[str, str | None, DataType, str, bool]] = {
    "auto": ("auto", None, DataType.BF16, BF16, True),
    "fp8": ("fp8", None, DataType.FP8, FP8, True),
    "nvfp4": ("nvfp4", None, DataType.NVFP4, NVFP4, True),
    "auto+fp8-checkpoint": ("auto", "FP8", DataType.FP8, FP8, True),
    "auto+nvfp4-checkpoint": ("auto", "NVFP4", DataType.NVFP4, NVFP4, True),
}
# stand-in profile (a TensorRT-LLM tree and its manager) -> the YAML lines that select that manager,
# and what the manager adds before the format's line where the format is carried (QSA: its side rows)
MANAGERS: dict[str, tuple[str, str | None]] = {
    "main": ("", None),
    "pr18843": ("", None),
    "main+19303": ("", None),
    "main+19303:qsa": ("sparse_attention_config: {algorithm: qsa}\n", QSA),
}


def _yaml(tmp_path: Path, dtype: str, extra: str) -> Path:
    path = tmp_path / "llm.yaml"
    path.write_text("speculative_config: {decoding_type: MTP, num_nextn_predict_layers: 3}\n"
                    "kv_cache_config:\n  enable_block_reuse: true\n"
                    "  mamba_state_config: {additional_snapshot_offsets_from_end: [0]}\n"
                    f"  dtype: {dtype}\n" + extra)
    return path


def _checkpoint(tmp_path: Path, algo: str | None) -> str | None:
    if algo is None:
        return None
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(
        {"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": algo}}))
    return str(tmp_path)


def _info(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["info", "--json", *args]) == 0
    report: dict[str, Any] = json.loads(capsys.readouterr().out)
    return report


@pytest.mark.parametrize("profile", list(MANAGERS))
@pytest.mark.parametrize("case", list(DTYPES))
def test_info_and_the_worker_give_one_verdict(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              case: str, profile: str) -> None:
    dtype, algo, datatype, format_line, carries = DTYPES[case]
    extra, manager_line = MANAGERS[profile]
    want = f"{manager_line}; {format_line}" if manager_line and carries else format_line
    want_carries = carries
    if manager_line and datatype == DataType.NVFP4:  # QSA's NVFP4 scale slots were not read
        want, want_carries = QSA_NVFP4, False
    args = ["--llm-config", str(_yaml(tmp_path, dtype, extra))]
    checkpoint = _checkpoint(tmp_path, algo)
    if checkpoint is not None:
        args += ["--model", checkpoint]
    report = _info(capsys, *args)
    assert report["kv_verdict"] == want
    # the worker: the draft manager the stand-in's creator builds for this tree and KV format
    llm = StandinLLM(model(), kv_cache_config=RECOMMENDED_KV_CACHE_CONFIG, chunk_size=32, num_pages=64,
                     version=profile, kv_dtype=datatype)
    managers = llm.executor.resource_manager.resource_managers
    draft = next(m for k, m in managers.items() if getattr(k, "name", k) == "DRAFT_KV_CACHE_MANAGER")
    verdict = verdict_of_draft(draft)
    assert (verdict.line, verdict.carries) == (want, want_carries)
    if not want_carries:  # the probe stands aside with that line; info says armed no with it
        probe = probe_managers(managers, "stand-in")
        assert (probe.runnable, probe.reason) == (False, want)
        assert report["carry_armed"] is False
        assert report["carry_armed_reason"] == f"stands aside under {args[1]}: {want}"
    else:
        assert report["carry_armed"] is True
        assert report["carry_armed_reason"].startswith(f"under {args[1]}: {want}; ")


def test_an_nvfp4_yaml_is_armed_in_info_as_the_worker_arms_it(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 41's contradiction stays closed the other way round: both carry an NVFP4 pool now."""
    path = _yaml(tmp_path, "nvfp4", "")
    assert main(["info", "--llm-config", str(path)]) == 0
    first = capsys.readouterr().out.splitlines()[0]  # the verdict first (issue 44)
    assert first.split(None, 3) == ["carry", "armed", "yes", f"under {path}: {NVFP4}; the worker's probe "
                                    "reads pairing from the live executor at start"]


def test_compression_is_one_verdict_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    want = ("KV-cache compression (quantization_for_cold_page) stands aside: the compression manager "
            "rewrites pages the draft pool holds (cold pages quantized to NVFP4 by the C++ V2 backend's "
            "codec, quantization_for_cold_page, SM100 only; _util.py @ 38198e34 passes the codec to the "
            "draft manager too), and when a live request's draft pages are cold was not read: carrying "
            "needs that")
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
    assert err.startswith(f"trtllm-mtp-carry: error: --llm-config {path}: kv_cache_config.dtype must be one of")
    assert err.count("\n") == 1


def test_a_format_the_carry_does_not_move_names_itself() -> None:
    assert kv_verdict("fp16").line == ("FP16 KV stands aside: the carry moves BF16, FP8 or NVFP4 draft pages "
                                       "only (kv_cache_config.dtype auto with a BF16 model, fp8 or nvfp4)")


def test_the_configuration_page_shows_infos_real_first_line(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """docs/CONFIGURATION.md's `info --llm-config nvfp4.yaml | head -1` sample is what info prints."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "CONFIGURATION.md").read_text()
    command = "trtllm-mtp-carry info --llm-config nvfp4.yaml | head -1\n```\n\n```text\n"
    start = text.index(command) + len(command)
    sample = text[start:text.index("\n```", start)]
    path = tmp_path / "nvfp4.yaml"
    path.write_text("kv_cache_config:\n  enable_block_reuse: true\n  dtype: nvfp4\n"
                    "  mamba_state_config: {additional_snapshot_offsets_from_end: [0]}\n")
    assert main(["info", "--llm-config", str(path)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.replace(str(path), "nvfp4.yaml") == sample


def test_a_v1_manager_is_one_line_in_info_and_the_worker(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """`use_kv_cache_manager_v2: false` gives a hybrid the V1 `CppMambaHybridCacheManager`
    (`_util.py` @ 38198e34): info said `carry armed yes` for it while the worker refused."""
    path = _yaml(tmp_path, "auto", "")
    path.write_text(path.read_text().replace("kv_cache_config:\n", "kv_cache_config:\n  use_kv_cache_manager_v2: false\n"))
    report = _info(capsys, "--llm-config", str(path))
    want = ("the target KV cache manager is CppMambaHybridCacheManager (KV cache manager V1, as TensorRT-LLM "
            "1.2.x gives a hybrid model with block reuse): the carry supports KVCacheManagerV2 only "
            "(kv_cache_config.use_kv_cache_manager_v2)")
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


def test_a_draft_pool_with_qsa_buffers_under_a_class_not_read_stands_aside() -> None:
    """Fail closed: a manager keeping QSA index-key/position pages (`qsa_position_layer_id` set)
    under a class the carry does not route (Qwen4ExpHybridCacheManagerV2 keeps them behind
    `_qsa_enabled`) is not carried K/V-only at K/V-scaled ids."""
    class Qwen4ExpHybridCacheManagerV2:
        dtype = DataType.BF16
        qsa_position_layer_id = 3

    verdict = verdict_of_draft(Qwen4ExpHybridCacheManagerV2())
    assert (verdict.carries, verdict.manager) == (False, "Qwen4ExpHybridCacheManagerV2")
    assert verdict.line.startswith("Qwen4ExpHybridCacheManagerV2 stands aside: its draft pool keeps QSA "
                                   "index-key and position pages (qsa_position_layer_id is set)")
    Qwen4ExpHybridCacheManagerV2.qsa_position_layer_id = None  # QSA off: judged as the hybrid it is
    assert verdict_of_draft(Qwen4ExpHybridCacheManagerV2()).carries
