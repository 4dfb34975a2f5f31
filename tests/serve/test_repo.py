"""The generated repository and the served model's options, without a server.

`config.pbtxt` is parsed with tritonclient's `model_config_pb2` (Triton's own
schema), so a field Triton would not accept fails here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import trtllm_mtp_carry
from trtllm_mtp_carry.cli import main
from trtllm_mtp_carry.serve.engines import ENGINE_FACTORIES
from trtllm_mtp_carry.serve.options import ENGINES, ServeOptions
from trtllm_mtp_carry.serve.triton.repo import RepoSpec, render_config, write_repository

model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2",
                                       reason='tritonclient is not installed (pip install -e ".[serve]")')


def parse(text: str):
    from google.protobuf import text_format

    return text_format.Parse(text, model_config_pb2.ModelConfig())


def test_config_is_decoupled_sequence_batched_oldest_with_uint64_corrid():
    spec = RepoSpec(instances=3, idle_timeout_s=2.5, max_candidate_sequences=5,
                    options=ServeOptions(max_turn_s=30))
    cfg = parse(render_config(spec))
    assert cfg.name == "mtp_carry" and cfg.backend == "python" and cfg.max_batch_size == 0
    assert cfg.model_transaction_policy.decoupled is True
    sb = cfg.sequence_batching
    assert sb.WhichOneof("strategy_choice") == "oldest"
    assert sb.oldest.max_candidate_sequences == 5
    # Triton's timer starts at a request's arrival: it outlasts the longest turn plus the idle timeout
    assert sb.max_sequence_idle_microseconds == 32_500_000
    controls = {c.name: c.control[0] for c in sb.control_input}
    kinds = model_config_pb2.ModelSequenceBatching.Control.Kind
    assert controls["START"].kind == kinds.Value("CONTROL_SEQUENCE_START")
    assert list(controls["START"].int32_false_true) == [0, 1]
    assert controls["END"].kind == kinds.Value("CONTROL_SEQUENCE_END")
    assert list(controls["END"].int32_false_true) == [0, 1]
    assert controls["CORRID"].kind == kinds.Value("CONTROL_SEQUENCE_CORRID")
    assert controls["CORRID"].data_type == model_config_pb2.TYPE_UINT64
    assert [(g.count, g.kind) for g in cfg.instance_group] == [(3, model_config_pb2.ModelInstanceGroup.KIND_CPU)]


def test_config_declares_the_tensorrt_llm_style_inputs_and_outputs():
    cfg = parse(render_config(RepoSpec()))
    t = model_config_pb2
    assert {(i.name, i.data_type, tuple(i.dims), i.optional) for i in cfg.input} == {
        ("text_input", t.TYPE_STRING, (1,), True), ("input_ids", t.TYPE_INT64, (-1,), True),
        ("max_tokens", t.TYPE_INT32, (1,), True), ("drafter_policy", t.TYPE_STRING, (1,), True),
        ("cache_salt", t.TYPE_STRING, (1,), True)}
    assert {(o.name, o.data_type) for o in cfg.output} == {
        ("text_output", t.TYPE_STRING), ("output_ids", t.TYPE_INT64), ("carry_outcome", t.TYPE_STRING),
        ("drafter_rows_computed", t.TYPE_INT32), ("drafted", t.TYPE_INT32), ("accepted", t.TYPE_INT32),
        ("ttft_ms", t.TYPE_FP32), ("model_instance", t.TYPE_STRING), ("turn_stats", t.TYPE_STRING)}


def test_every_option_round_trips_through_the_configs_parameters():
    options = ServeOptions(drafter_policy="blind", draft_len=3, marconi_min_tokens=0, carry_slots=5,
                           carry_memory="512MiB", carry_eviction="lrd", carry_idle_s=30, carry_share="off",
                           carry_host_memory="8GiB", carry_row_dtype="fp8",
                           max_model_len=1024, max_tokens=7, max_num_seqs=2, device="cuda", max_turn_s=9)
    cfg = parse(render_config(RepoSpec(options=options)))
    params = {k: {"string_value": v.string_value} for k, v in cfg.parameters.items()}
    assert set(params) == {"engine", "drafter_policy", "draft_len", "marconi_min_tokens", "carry_slots",
                           "carry_memory", "carry_eviction", "carry_idle_s", "carry_share",
                           "carry_host_memory", "carry_row_dtype", "max_model_len", "max_tokens", "max_num_seqs", "device", "max_turn_s"}
    assert ServeOptions.from_parameters(params) == options
    defaults = parse(render_config(RepoSpec())).parameters
    assert ServeOptions.from_parameters({k: v.string_value for k, v in defaults.items()}) == ServeOptions()


def test_an_empty_parameter_means_the_engines_default():
    assert ServeOptions.from_parameters({"max_model_len": {"string_value": ""}}).max_model_len is None


@pytest.mark.parametrize("key, value, message", [
    ("draft_len", "4", "parameter draft_len must be in [0, 3], got 4"),
    ("draft_len", "two", "parameter draft_len must be an integer, got 'two'"),
    ("marconi_min_tokens", "-1", "parameter marconi_min_tokens must be >= 0, got -1"),
    ("carry_slots", "0", "parameter carry_slots must be >= 1, got 0"),
    ("max_model_len", "0", "parameter max_model_len must be >= 1, got 0"),
    ("max_tokens", "-3", "parameter max_tokens must be >= 1, got -3"),
    ("drafter_policy", "fast", "parameter drafter_policy must be one of carry, rebuild, blind, off, got 'fast'"),
    ("carry_share", "maybe", "parameter carry_share='maybe' is not on or off"),
    ("engine", "vllm", "parameter engine must be one of reference, got 'vllm'"),
    ("temperature", "0.7", "unknown parameter 'temperature'"),
])
def test_a_bad_parameter_is_a_value_error_naming_it(key, value, message):
    with pytest.raises(ValueError) as err:
        ServeOptions.from_parameters({key: {"string_value": value}})
    assert message in str(err.value)


def test_the_engine_parameters_choices_are_the_registered_engines():
    assert tuple(ENGINE_FACTORIES) == ENGINES


def test_triton_repo_writes_the_config_and_a_model_py_that_pins_this_package(tmp_path, capsys):
    assert main(["triton-repo", str(tmp_path), "--instances", "2", "--policy", "rebuild",
                 "--max-tokens", "9", "--name", "carry"]) == 0
    cfg = parse((tmp_path / "carry" / "config.pbtxt").read_text())
    assert cfg.name == "carry" and cfg.instance_group[0].count == 2
    assert cfg.parameters["drafter_policy"].string_value == "rebuild"
    assert cfg.parameters["max_tokens"].string_value == "9"
    model_py = (tmp_path / "carry" / "1" / "model.py").read_text()
    root = str(Path(trtllm_mtp_carry.__file__).resolve().parents[1])
    assert f"PACKAGE_ROOT = {root!r}" in model_py
    assert "from trtllm_mtp_carry.serve.triton.model import TritonPythonModel" in model_py
    assert "carry/config.pbtxt" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["triton-repo", "DIR", "--draft-len", "7"], "parameter draft_len must be in [0, 3], got 7"),
    (["triton-repo", "DIR", "--name", "a b"], "model name must be letters"),
    (["serve", "--tritonserver", "/nonexistent/tritonserver"],
     "--tritonserver '/nonexistent/tritonserver' is not an executable file"),
])
def test_cli_errors_are_one_line_with_exit_status_2(tmp_path, capsys, argv, message):
    argv = [str(tmp_path) if a == "DIR" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("trtllm-mtp-carry: error: ") and message in err
    assert "Traceback" not in err


def test_write_repository_overwrites_the_models_folder_only(tmp_path):
    other = tmp_path / "other_model" / "config.pbtxt"
    other.parent.mkdir()
    other.write_text("keep")
    write_repository(tmp_path, RepoSpec(instances=1))
    write_repository(tmp_path, RepoSpec(instances=4))
    assert parse((tmp_path / "mtp_carry" / "config.pbtxt").read_text()).instance_group[0].count == 4
    assert other.read_text() == "keep"


def test_serve_without_any_tritonserver_names_the_extra_to_install(tmp_path, capsys, monkeypatch):
    from trtllm_mtp_carry.serve.triton import server

    monkeypatch.setattr(server, "_pytriton_dir", lambda: None)  # as if nvidia-pytriton were absent
    monkeypatch.setenv("PATH", str(tmp_path))  # and no tritonserver on PATH
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert err == ('trtllm-mtp-carry: error: no tritonserver found; install one with '
                   'pip install -e ".[serve]" (nvidia-pytriton bundles tritonserver) '
                   "or pass --tritonserver PATH\n")
