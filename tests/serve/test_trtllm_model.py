"""The TensorRT-LLM Triton model (`triton-repo --engine trtllm`) on a machine without TensorRT-LLM.

What is pinned here: the request mapping with exact values (CORRID to the
conversation id, the salt, the sampling keywords, the LLM options and their
`mtp_carry` section, the next turn's prompt from a chat template, the per-turn
statistics read from TensorRT-LLM's outputs and the adapter's turn record),
the generated repository, the command line's errors, and, against the real
tritonserver, that the model fails to load with one line naming the `trtllm`
extra. Serving turns with real TensorRT-LLM needs a GPU: `scripts/trtllm_smoke.py`
and docs/TENSORRT-LLM.md say what was and was not run (test_trtllm_model_standin.py and
test_trtllm_model_carry.py serve turns in process on stand-ins).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trtllm_standin as standin
from serve_helpers import MODEL
from trtllm_standin import ChatMLTokenizer

from trtllm_mtp_carry.cli import main
from trtllm_mtp_carry.serve.trtllm.model import require_tensorrt_llm
from trtllm_mtp_carry.serve.trtllm.repo import (
    DEFAULT_LLM_OPTIONS,
    LLM_OPTIONS_FILE,
    TrtllmRepoSpec,
    render_trtllm_config,
    trtllm_spec,
    write_trtllm_repository,
)
from trtllm_mtp_carry.serve.trtllm.serving import (
    MISSING_TRTLLM,
    ChatTemplate,
    TrtllmServeOptions,
    TrtllmTurnStats,
    carry_fields,
    conversation_id_for,
    salt_text,
    sampling_kwargs,
    triton_llm_args,
    turn_stats,
)

model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2",
                                       reason='tritonclient is not installed (pip install -e ".[serve]")')

TRTLLM_MODEL = "mtp_carry_trtllm"
OPTIONS_YAML = (
    "speculative_config: {decoding_type: MTP, num_nextn_predict_layers: 3}\n"
    "kv_cache_config: {enable_block_reuse: true, dtype: auto}\n"
    "mtp_carry: {enable: true, carry_slots: 8}\n"
)


def parse(text: str):
    from google.protobuf import text_format

    return text_format.Parse(text, model_config_pb2.ModelConfig())


# ---- request mapping ---------------------------------------------------------------


def test_a_corrid_is_its_own_conversation_id():
    assert conversation_id_for(42) == "triton-corrid-42"
    assert conversation_id_for(2**64 - 1) == "triton-corrid-18446744073709551615"
    assert conversation_id_for(7) != conversation_id_for(70)


@pytest.mark.parametrize("corrid, message", [
    (0, "CORRID 0 is not a session; send a non-zero correlation id"),
    (2**64, "CORRID must be an unsigned 64-bit integer, got 18446744073709551616"),
    (True, "CORRID must be an unsigned 64-bit integer, got True"),
])
def test_a_corrid_that_is_no_session_is_refused_naming_it(corrid, message):
    with pytest.raises(ValueError) as err:
        conversation_id_for(corrid)
    assert str(err.value) == message


def test_the_salt_passes_through_as_its_utf8_text():
    assert salt_text(None) is None
    assert salt_text(b"tenant-a") == "tenant-a"
    assert salt_text(" tenant b ") == " tenant b "  # never trimmed: another salt is another scope
    assert salt_text("sel\u00e9".encode()) == "sel\u00e9"


@pytest.mark.parametrize("value, message", [
    (b"\xff\xfe", "cache_salt is not valid UTF-8 (TensorRT-LLM takes a text salt)"),
    (b"", "cache_salt is empty; send a non-empty salt or none"),
])
def test_a_bad_salt_is_refused_naming_it(value, message):
    with pytest.raises(ValueError) as err:
        salt_text(value)
    assert str(err.value) == message


def test_sampling_is_greedy_with_the_turns_max_tokens_and_perf_metrics():
    assert sampling_kwargs(None, 64) == {"max_tokens": 64, "top_k": 1, "return_perf_metrics": True}
    assert sampling_kwargs(7, 64) == {"max_tokens": 7, "top_k": 1, "return_perf_metrics": True}
    with pytest.raises(ValueError, match=r"^max_tokens must be >= 1, got 0$"):
        sampling_kwargs(0, 64)


def test_triton_llm_args_add_the_model_and_return_the_carry_section_unparsed():
    options = {"speculative_config": {"decoding_type": "MTP", "max_draft_len": 3},
               "kv_cache_config": {"enable_block_reuse": True},
               "mtp_carry": {"enable": True, "carry_slots": 8},
               "triton_config": {"decoupled": True}}
    llm_args, carry = triton_llm_args(options, "/ckpt/qwen3-next")
    assert llm_args == {"speculative_config": {"decoding_type": "MTP", "max_draft_len": 3},
                        "kv_cache_config": {"enable_block_reuse": True}, "model": "/ckpt/qwen3-next"}
    assert carry == {"enable": True, "carry_slots": 8}
    assert triton_llm_args(None, "m") == ({"model": "m"}, None)


@pytest.mark.parametrize("options, message", [
    ({"model": "/other"}, "the LLM options set 'model'; give the checkpoint with --model only"),
    (["a", "b"], "the LLM options must be a YAML mapping, got list"),
    ({1: "x"}, "LLM option keys must be strings, got 1"),
])
def test_bad_llm_options_are_refused_naming_what(options, message):
    with pytest.raises(ValueError) as err:
        triton_llm_args(options, "m")
    assert str(err.value) == message


def test_the_options_parse_from_triton_parameters():
    params = {"engine": {"string_value": "trtllm"}, "model": {"string_value": "/ckpt"},
              "llm_options": {"string_value": ""}, "max_tokens": {"string_value": "9"}}
    assert TrtllmServeOptions.from_parameters(params) == TrtllmServeOptions(model="/ckpt", max_tokens=9)


@pytest.mark.parametrize("key, value, message", [
    ("max_tokens", "many", "parameter max_tokens must be an integer, got 'many'"),
    ("max_tokens", "0", "parameter max_tokens must be >= 1, got 0"),
    ("engine", "reference", "parameter engine must be trtllm, got 'reference'"),
    ("model", "", "parameter model must name a checkpoint directory or model, got ''"),
    ("llm_options", "../x.yaml", "parameter llm_options must be a file name in the model's directory"),
    ("drafter_policy", "carry", "unknown parameter 'drafter_policy'; known: engine, model, llm_options, "
                                "max_tokens"),
])
def test_a_bad_parameter_is_refused_naming_it(key, value, message):
    params = {"model": "/ckpt", key: value}
    with pytest.raises(ValueError) as err:
        TrtllmServeOptions.from_parameters(params)
    assert message in str(err.value)


# ---- the next turn's prompt --------------------------------------------------------


def test_a_first_text_turn_is_the_rendered_one_message_chat():
    tok = ChatMLTokenizer()
    assert ChatTemplate(tok).first_prompt("hi") == tok.encode(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)


def test_a_follow_up_extends_the_last_prompt_and_output_token_for_token():
    tok = ChatMLTokenizer()
    chat = ChatTemplate(tok)
    prompt = chat.first_prompt("hi")
    output = tok.encode("hello", add_special_tokens=False) + [tok.eos_token_id]
    nxt = chat.next_prompt(prompt, output, "more")
    assert nxt == [*prompt, *output, *tok.encode("\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n",
                                                 add_special_tokens=False)]
    # the same ids as rendering the whole chat at once
    whole = tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                                     {"role": "user", "content": "more"}], tokenize=False,
                                    add_generation_prompt=True)
    assert nxt == tok.encode(whole, add_special_tokens=False)


def test_a_follow_up_after_a_cut_answer_closes_it_with_the_templates_end_of_turn():
    tok = ChatMLTokenizer()
    chat = ChatTemplate(tok)
    output = tok.encode("hel", add_special_tokens=False)  # max_tokens cut it: no end-of-turn token
    assert chat.next_prompt([1, 2], output, "go") == [1, 2, *output, *tok.encode(
        "<|im_end|>\n<|im_start|>user\ngo<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)]


def test_a_template_that_rewrites_answers_refuses_text_turns():
    chat = ChatTemplate(ChatMLTokenizer(verbatim=False))
    with pytest.raises(ValueError, match="does not render an assistant turn verbatim; send input_ids"):
        chat.next_prompt([1], [2, 1001], "more")


# ---- statistics --------------------------------------------------------------------


def request_output(decoding_iter: int) -> standin.RequestOutput:
    """A finished stand-in `RequestOutput` after `decoding_iter` decoding iterations."""
    out = standin.RequestOutput(101, standin.SamplingParams(), None, True, iter(()), lambda: None)
    out.decoding_iter = decoding_iter
    return out


def test_turn_stats_read_tensorrt_llms_per_request_metrics():
    # TensorRT-LLM's classes as the LLM API stand-in plays them (docs/TRTLLM-CONFORMANCE.md section 4)
    perf = standin.RequestPerfMetrics(
        speculative_decoding=standin.SpeculativeDecodingMetrics(total_draft_tokens=9, total_accepted_draft_tokens=6),
        kv_cache_metrics=standin.KvCacheMetrics(num_reused_blocks=4, kv_cache_hit_rate=0.5))
    output = standin.CompletionOutput(index=0, token_ids=[5, 6, 7], finish_reason="stop", request_perf_metrics=perf)
    record = {"reused": 64, "outcome": "adopted", "no_carry_reason": "", "rows_adopted": 64,
              "rows_computed": 55, "rows_deposited": 0, "skipped": None}
    stats = turn_stats(120, output, request_output(decoding_iter=3), ttft_ms=12.5, total_ms=40.0,
                       topology="unpaired", carry_armed=True, carry=record)
    assert stats == TrtllmTurnStats(prompt_tokens=120, output_tokens=3, drafted=9, accepted=6, verify_steps=3,
                                    kv_cache_reused_blocks=4, kv_cache_hit_rate=0.5, ttft_ms=12.5,
                                    decode_ms=27.5, finish_reason="stop", topology="unpaired", carry_armed=True,
                                    outcome_kind="adopted", no_carry_reason="", reused_tokens=64,
                                    drafter_rows_kept=64, drafter_rows_computed=55)
    d = stats.as_dict()
    assert d["acceptance"] == 6 / 9 and d["accepted_per_step"] == 2.0
    assert json.loads(json.dumps(d)) == d


def test_a_metric_tensorrt_llm_did_not_return_stays_zero():
    stats = turn_stats(10, standin.CompletionOutput(index=0, token_ids=[1]), request_output(decoding_iter=0),
                       ttft_ms=3.0, total_ms=3.0)
    assert (stats.drafted, stats.accepted, stats.verify_steps, stats.kv_cache_reused_blocks) == (0, 0, 0, 0)
    assert stats.finish_reason == "" and stats.acceptance == 0.0


def test_a_no_carry_turn_reports_the_reason_from_the_adapters_record():
    record = {"reused": 32, "outcome": "no_carry", "no_carry_reason": "session_end", "rows_adopted": 0,
              "rows_computed": 40, "rows_deposited": 0, "skipped": None}
    assert carry_fields(record, armed=True) == {
        "outcome_kind": "no_carry", "no_carry_reason": "session_end", "reused_tokens": 32,
        "drafter_rows_kept": 0, "drafter_rows_computed": 40}


def test_what_the_adapter_does_not_know_is_left_unknown_not_guessed():
    # not armed: nothing was carried (known), R and the rows computed are not known
    assert carry_fields(None, armed=False) == {"outcome_kind": "not_armed", "drafter_rows_kept": 0}
    stats = turn_stats(10, standin.CompletionOutput(index=0, token_ids=[1]), request_output(decoding_iter=0), 1.0,
                       2.0, "unpaired", True, None)
    d = stats.as_dict()  # armed, but no record of the request: every carry field unknown
    assert (d["outcome_kind"], d["no_carry_reason"], d["reused_tokens"], d["drafter_rows_kept"],
            d["drafter_rows_computed"]) == ("", "", None, None, None)
    assert json.loads(json.dumps(d))["drafter_rows_computed"] is None


# ---- the repository and the command line -------------------------------------------


def test_the_config_keeps_the_sequence_contract_with_the_reference_outputs_and_reused_blocks(tmp_path):
    spec = trtllm_spec("m", str(tmp_path), None, 2.5, 32)
    cfg = parse(render_trtllm_config(spec))
    t = model_config_pb2
    assert cfg.backend == "python" and cfg.max_batch_size == 0 and cfg.model_transaction_policy.decoupled
    assert cfg.sequence_batching.max_sequence_idle_microseconds == 302_500_000  # idle + max_turn_s
    assert {c.name: c.control[0].data_type for c in cfg.sequence_batching.control_input}["CORRID"] == t.TYPE_UINT64
    assert {(i.name, i.data_type, tuple(i.dims), i.optional) for i in cfg.input} == {
        ("text_input", t.TYPE_STRING, (1,), True), ("input_ids", t.TYPE_INT64, (-1,), True),
        ("max_tokens", t.TYPE_INT32, (1,), True), ("cache_salt", t.TYPE_STRING, (1,), True)}
    assert {(o.name, o.data_type) for o in cfg.output} == {
        ("text_output", t.TYPE_STRING), ("output_ids", t.TYPE_INT64), ("carry_outcome", t.TYPE_STRING),
        ("drafter_rows_computed", t.TYPE_INT32), ("drafted", t.TYPE_INT32),
        ("accepted", t.TYPE_INT32), ("ttft_ms", t.TYPE_FP32), ("model_instance", t.TYPE_STRING),
        ("turn_stats", t.TYPE_STRING), ("kv_cache_reused_blocks", t.TYPE_INT32)}
    assert [g.count for g in cfg.instance_group] == [1]
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    assert params == {"engine": "trtllm", "model": str(tmp_path.resolve()), "llm_options": LLM_OPTIONS_FILE,
                      "max_tokens": "32", "max_turn_s": "300"}
    assert TrtllmServeOptions.from_parameters(params) == spec.options


def test_triton_repo_engine_trtllm_writes_a_self_contained_repository(tmp_path, capsys):
    ckpt, yaml_file = tmp_path / "ckpt", tmp_path / "opts.yaml"
    ckpt.mkdir()
    yaml_file.write_text(OPTIONS_YAML)
    repo = tmp_path / "repo"
    assert main(["triton-repo", str(repo), "--engine", "trtllm", "--model", str(ckpt),
                 "--llm-options", str(yaml_file), "--max-tokens", "48"]) == 0
    model_dir = repo / "mtp_carry"
    assert (model_dir / LLM_OPTIONS_FILE).read_text() == OPTIONS_YAML
    assert "from trtllm_mtp_carry.serve.trtllm.model import TritonPythonModel" in \
        (model_dir / "1" / "model.py").read_text()
    params = {k: v.string_value for k, v in parse((model_dir / "config.pbtxt").read_text()).parameters.items()}
    assert params == {"engine": "trtllm", "model": str(ckpt.resolve()), "llm_options": LLM_OPTIONS_FILE,
                      "max_tokens": "48", "max_turn_s": "300"}
    # rewritten without options: the recommended configuration, no stale copy for the model to load
    write_trtllm_repository(repo, trtllm_spec("mtp_carry", str(ckpt), None, 600.0, 48))
    assert (model_dir / LLM_OPTIONS_FILE).read_text() == DEFAULT_LLM_OPTIONS


def test_a_repository_without_llm_options_gets_the_recommended_snapshot_placement(tmp_path):
    import yaml

    from trtllm_mtp_carry.trtllm.options import RECOMMENDED_KV_CACHE_CONFIG

    model_dir = write_trtllm_repository(tmp_path, trtllm_spec("m", "/ckpt/q", None, 600.0, 48))
    written = yaml.safe_load((model_dir / LLM_OPTIONS_FILE).read_text())
    assert written["kv_cache_config"] == RECOMMENDED_KV_CACHE_CONFIG
    assert written["kv_cache_config"]["mamba_state_config"] == {"additional_snapshot_offsets_from_end": [0]}
    # three drafts a step in every TensorRT-LLM version read (a lone max_draft_len is 1 in older ones)
    assert written["speculative_config"] == {"decoding_type": "MTP", "num_nextn_predict_layers": 3}


@pytest.mark.parametrize("args, message", [
    (["--engine", "trtllm"], "--engine trtllm needs --model PATH"),
    (["--model", "/ckpt"], "--model and --llm-options are options of --engine trtllm"),
    (["--engine", "trtllm", "--model", "/ckpt", "--llm-options", "/no/such.yaml"],
     "--llm-options /no/such.yaml: not a file"),
    (["--engine", "trtllm", "--model", "/ckpt", "--instances", "2"],
     "--engine trtllm serves one instance (one LLM, TP=1, in process), got --instances 2"),
    (["--engine", "trtllm", "--model", "/ckpt", "--carry-slots", "4"],
     "--carry-slots is a reference-engine option; with --engine trtllm set carry_slots in the mtp_carry section"),
])
def test_triton_repo_engine_trtllm_refuses_bad_flags_in_one_line(tmp_path, capsys, args, message):
    assert main(["triton-repo", str(tmp_path / "repo"), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trtllm-mtp-carry: error: ") and message in err and err.count("\n") == 1


def test_the_spec_checks_its_options_file_goes_with_its_parameter(tmp_path):
    with pytest.raises(ValueError, match="llm_options_source and options.llm_options go together"):
        TrtllmRepoSpec(options=TrtllmServeOptions(model="m", llm_options=""), llm_options_source=tmp_path)


# ---- without TensorRT-LLM -----------------------------------------------------------


def test_without_tensorrt_llm_the_model_names_the_trtllm_extra():
    try:
        import tensorrt_llm  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("tensorrt_llm is installed here")
    with pytest.raises(RuntimeError) as err:
        require_tensorrt_llm()
    assert str(err.value) == MISSING_TRTLLM
    assert 'pip install "trtllm-mtp-carry[trtllm]"' in MISSING_TRTLLM


def test_the_served_trtllm_model_fails_to_load_with_one_line_naming_the_extra(served, tmp_path):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    ckpt, yaml_file = tmp_path / "ckpt", tmp_path / "opts.yaml"
    ckpt.mkdir()
    yaml_file.write_text(OPTIONS_YAML)
    write_trtllm_repository(served.repository, trtllm_spec(TRTLLM_MODEL, str(ckpt), str(yaml_file), 600.0, 16))
    client = grpcclient.InferenceServerClient(served.endpoints.grpc)
    with pytest.raises(InferenceServerException) as err:
        client.load_model(TRTLLM_MODEL)
    first, *rest = str(err.value).splitlines()
    # the options file was found in the model's directory, so the load got as far as TensorRT-LLM;
    # the error is one line, then only the Python backend's own "At:" frames
    assert first.endswith(f"UNAVAILABLE state: Internal: RuntimeError: {MISSING_TRTLLM}")
    frames = [line for line in rest if line]
    assert frames[0] == "At:" and all(line.startswith("  /") or line == ";" for line in frames[1:])
    assert not client.is_model_ready(TRTLLM_MODEL)
    assert client.is_model_ready(MODEL)


def test_the_served_trtllm_model_names_a_missing_options_file(served, tmp_path):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    yaml_file = tmp_path / "opts.yaml"
    yaml_file.write_text(OPTIONS_YAML)
    model_dir = write_trtllm_repository(served.repository,
                                        trtllm_spec(TRTLLM_MODEL, "/ckpt", str(yaml_file), 600.0, 16))
    Path(model_dir / LLM_OPTIONS_FILE).unlink()
    client = grpcclient.InferenceServerClient(served.endpoints.grpc)
    with pytest.raises(InferenceServerException) as err:
        client.load_model(TRTLLM_MODEL)
    assert f"parameter llm_options names {model_dir / LLM_OPTIONS_FILE}, which is not a file" in str(err.value)


def test_importing_the_trtllm_model_loads_no_torch_and_no_tensorrt_llm():
    import subprocess
    import sys

    code = ("import sys, trtllm_mtp_carry.serve.trtllm.model, trtllm_mtp_carry.serve.trtllm.repo\n"
            "print(sorted(m for m in ('torch', 'tensorrt_llm', 'yaml') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]"
