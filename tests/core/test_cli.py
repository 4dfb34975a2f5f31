"""`trtllm-mtp-carry info`: resolved settings with configured and armed side by side."""

import json
import os
import subprocess
import sys

import pytest


def run_cli(*args, **env):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TRTLLM_MTP_CARRY_")}
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-m", "trtllm_mtp_carry.cli", *args],
        capture_output=True,
        text=True,
        env=full_env,
        check=False,
    )


def test_info_defaults_configured_and_armed_at_the_default_dispatch_cap():
    out = run_cli("info", "--json")
    report = json.loads(out.stdout)
    assert report["marconi_min_tokens"] == 256
    assert report["marconi_min_tokens_source"] == "default"
    assert report["mtp_max_seqs"] == 32
    assert (report["carry_configured"], report["carry_armed"]) == (True, True)
    assert report["carry_armed_reason"] == (
        "configured; armed at any MTP dispatch cap (32 here): drafter rows are built per "
        "prefill chunk under the sequence's own ticket"
    )


def test_info_flags_pin_and_arm():
    out = run_cli("info", "--json", "--mtp-max-seqs", "1", "--restore-threshold", "128")
    report = json.loads(out.stdout)
    assert (report["marconi_min_tokens"], report["marconi_min_tokens_source"]) == (
        128,
        "--restore-threshold",
    )
    assert report["carry_armed"] is True


def test_info_env_source_and_table():
    out = run_cli("info", TRTLLM_MTP_CARRY_MARCONI_MIN_TOKENS="99")
    assert out.returncode == 0
    lines = out.stdout.splitlines()
    threshold = next(line for line in lines if line.startswith("restore threshold"))
    assert threshold.split()[-3:] == ["99", "env", "TRTLLM_MTP_CARRY_MARCONI_MIN_TOKENS"]
    assert any(line.startswith("carry configured") and "yes" in line for line in lines)
    assert any(line.startswith("carry armed") and " yes " in line for line in lines)


def test_a_bare_info_gives_its_verdict_first_and_says_what_it_is_about():
    """Issue 44: the verdict is the first line, and a bare `info` (no executor, no llm.yaml) says
    its verdict is about this process's settings, pointing at `info --llm-config`."""
    out = run_cli("info")
    first = out.stdout.splitlines()[0]
    assert first.split(None, 3) == [
        "carry", "armed", "yes",
        "configured; armed at any MTP dispatch cap (32 here): drafter rows are built per prefill "
        "chunk under the sequence's own ticket [this process's settings (the reference engine's "
        "carry); no TensorRT-LLM executor or llm.yaml is judged here: info --llm-config YAML judges "
        "a TensorRT-LLM deployment]"]
    report = json.loads(run_cli("info", "--json").stdout)
    assert report["carry_armed_scope"].startswith("this process's settings")


def test_model_without_llm_config_is_refused_in_one_line():
    out = run_cli("info", "--model", "/tmp")
    assert (out.returncode, out.stderr) == (
        2, "trtllm-mtp-carry: error: --model needs --llm-config (it decides kv_cache_config.dtype auto)\n")


def test_info_without_carry():
    report = json.loads(run_cli("info", "--json", "--no-prefill", "--mtp-max-seqs", "1").stdout)
    assert (report["drafter_prefill"], report["carry_configured"], report["carry_armed"]) == (
        False,
        False,
        False,
    )
    assert report["carry_armed_reason"] == "not configured"


def test_malformed_env_is_a_clear_error():
    out = run_cli("info", TRTLLM_MTP_CARRY_MARCONI_MIN_TOKENS="-3")
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "trtllm-mtp-carry: error: environment variable "
        "TRTLLM_MTP_CARRY_MARCONI_MIN_TOKENS='-3' is not a non-negative integer"
    )


def test_bad_flag_value_names_it():
    out = run_cli("info", "--mtp-max-seqs", "0")
    assert out.returncode == 2
    assert "--mtp-max-seqs: must be at least 1, got 0" in out.stderr


def one_error_line(out):
    """A user error: exit 2 and exactly one `trtllm-mtp-carry: error:` line, no traceback."""
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trtllm-mtp-carry: error: "), out.stderr
    return lines[0]


def test_missing_conversations_file_is_one_line(tmp_path):
    missing = tmp_path / "nope.jsonl"
    line = one_error_line(run_cli("bench", "--conversations", str(missing), "--no-progress"))
    assert line == f"trtllm-mtp-carry: error: --conversations {missing}: no such file"


def test_unknown_device_is_one_line():
    line = one_error_line(run_cli("bench", "--device", "gpu0", "--no-progress"))
    assert line == "trtllm-mtp-carry: error: --device 'gpu0' is not a device; use cpu, cuda or cuda:N"


def test_cuda_device_without_cuda_is_one_line():
    import torch

    from trtllm_mtp_carry.bench.options import resolve_device

    if torch.cuda.is_available():  # a GPU machine: cuda resolves, an absent index does not
        assert resolve_device("cuda").type == "cuda"
        with pytest.raises(ValueError, match=r"--device 'cuda:99': this machine has \d+ CUDA device"):
            resolve_device("cuda:99")
    else:
        out = run_cli("bench", "--device", "cuda", "--no-progress")
        assert one_error_line(out).startswith(
            "trtllm-mtp-carry: error: --device 'cuda': CUDA is not available on this machine")


def test_chat_device_is_checked_the_same_way():
    line = one_error_line(run_cli("chat", "--device", "meta"))
    assert line == "trtllm-mtp-carry: error: --device 'meta': only cpu and cuda[:N] are supported"
    line = one_error_line(run_cli("chat", "--device", "tpu"))
    assert line == "trtllm-mtp-carry: error: --device 'tpu' is not a device; use cpu, cuda or cuda:N"


def test_threads_zero_names_the_flag():
    line = one_error_line(run_cli("bench", "--threads", "0"))
    assert line == ("trtllm-mtp-carry: error: argument --threads: must be at least 1, got 0 "
                    "(see trtllm-mtp-carry bench --help)")


def test_errors_name_the_flag_typed_not_engine_fields():
    line = one_error_line(run_cli("bench", "--chunk", "100"))
    assert "argument --chunk: must be a multiple of 16, got 100" in line
    assert "EngineConfig" not in line


def test_draft_len_accepts_what_its_help_says():
    from trtllm_mtp_carry.cli import build_parser

    parser = build_parser()
    assert "draft tokens per verify step, 1..3" in parser._subparsers._group_actions[0].choices[
        "bench"].format_help().replace("\n", " ").replace("  ", " ")
    for n in ("1", "2", "3"):
        assert parser.parse_args(["bench", "--draft-len", n]).draft_len == int(n)
    for bad, why in (("0", "must be at least 1, got 0"), ("4", "must be 1..3, got 4")):
        line = one_error_line(run_cli("bench", "--draft-len", bad))
        assert f"argument --draft-len: {why}" in line


def test_conflicting_dispatch_cap_names_both_flags():
    line = one_error_line(run_cli("bench", "--mtp-max-seqs", "4", "--concurrency", "2"))
    assert line == ("trtllm-mtp-carry: error: --mtp-max-seqs 4 differs from --concurrency 2: "
                    "the bench sets the MTP dispatch cap from --concurrency")


def test_missing_subcommand_is_one_line():
    line = one_error_line(run_cli())
    assert line.startswith("trtllm-mtp-carry: error: the following arguments are required: command")


def test_weights_folder_without_weights_is_one_line(tmp_path):
    line = one_error_line(run_cli("bench", "--weights", str(tmp_path)))
    assert line == f"trtllm-mtp-carry: error: --weights {tmp_path}: no reference.json there"


def test_sessions_longer_than_the_model_name_the_flags():
    line = one_error_line(run_cli("bench", "--history", "100000", "--no-progress"))
    assert "past the model's" in line and "lower --history, --turns, --new-span or --max-new-tokens" in line


def test_chat_unknown_policy_is_one_line():
    line = one_error_line(run_cli("chat", "--policy", "turbo"))
    assert line == ("trtllm-mtp-carry: error: unknown drafter policy 'turbo'; "
                    "expected one of carry, rebuild, blind, paired, off")
