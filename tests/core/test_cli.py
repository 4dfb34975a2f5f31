"""`trtllm-mtp-carry info`: resolved settings with configured and armed side by side."""

import json
import os
import subprocess
import sys


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
    out = run_cli("info", "--json", "--mtp-max-seqs", "1", "--marconi-min-tokens", "128")
    report = json.loads(out.stdout)
    assert (report["marconi_min_tokens"], report["marconi_min_tokens_source"]) == (
        128,
        "--marconi-min-tokens",
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
