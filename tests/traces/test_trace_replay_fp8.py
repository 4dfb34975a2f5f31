"""trace-replay --carry-row-dtype fp8: rows' bytes from the model geometry in the packed format,
and the same budget keeping more follow-ups (issue 31)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trtllm_mtp_carry.cli import main
from trtllm_mtp_carry.core.row_format import RowFormat, rows_nbytes
from trtllm_mtp_carry.traces.cli import replay_row_bytes, row_format_from_config
from trtllm_mtp_carry.traces.reader import read_trace
from trtllm_mtp_carry.traces.replay import ReplayConfig, replay

SLICE = Path(__file__).parent / "data" / "mooncake-slice.jsonl"


def test_fp8_rows_of_qwen3_next_cost_payload_plus_one_scale_per_vector():
    # 4 vectors (K, V x 2 KV heads) of 256: 4 x 256 B of e4m3 + 4 x 4 B of float32 scales
    assert replay_row_bytes("fp8", None, None) == 4 * 256 + 4 * 4 == 1040
    assert replay_row_bytes("bf16", None, None) == 2048
    assert replay_row_bytes("bf16", 100, None) == 100


def test_fp8_rows_from_a_model_config(tmp_path):
    cfg = {"num_key_value_heads": 4, "head_dim": 128, "mtp_num_hidden_layers": 2, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    fmt = row_format_from_config(str(tmp_path), "fp8")
    assert fmt == RowFormat("fp8", 2 * 2 * 4, 128, 2)
    assert replay_row_bytes("fp8", None, str(tmp_path)) == 16 * (128 + 4) == rows_nbytes("fp8", 16, 128)
    assert replay_row_bytes("bf16", None, str(tmp_path)) == 16 * 128 * 2


def test_fp8_with_raw_row_bytes_is_refused_with_one_line(capsys):
    assert main(["trace-replay", str(SLICE), "--row-bytes", "100", "--carry-row-dtype", "fp8"]) == 2
    assert capsys.readouterr().err.strip() == (
        "trtllm-mtp-carry: error: --row-bytes 100 with --carry-row-dtype fp8: packed rows' bytes depend "
        "on the head geometry; give --model-config instead")
    with pytest.raises(SystemExit):
        main(["trace-replay", str(SLICE), "--carry-row-dtype", "fp4"])
    assert "invalid choice: 'fp4'" in capsys.readouterr().err


def test_the_same_budget_keeps_more_follow_ups_with_fp8_rows(tmp_path):
    trace = read_trace(SLICE)
    # every finish deposits all its rows (--after-miss full), the model these figures were taken with
    bf16 = replay(trace, "returns", ReplayConfig(256 << 20, workers=2, row_bytes=2048, after_miss="full"))
    fp8 = replay(trace, "returns", ReplayConfig(256 << 20, workers=2, row_bytes=1040, after_miss="full"))
    # 256 MiB at fp8 holds about what 512 MiB holds at bf16 (22 of 43 there too)
    assert (bf16.adopted, fp8.adopted) == (12, 22)
    out = tmp_path / "r.json"
    assert main(["trace-replay", str(SLICE), "--workers", "2", "--carry-memory", "256MiB", "--after-miss", "full",
                 "--carry-row-dtype", "fp8", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert (figures["config"]["row_dtype"], figures["config"]["row_bytes"]) == ("fp8", 1040)
    assert figures["policies"]["returns"]["adopted"] == 22


def test_an_fp8_kv_pool_charges_its_own_one_byte_rows_whatever_carry_row_dtype_says(tmp_path):
    # Qwen3-Next's MTP layer: 4 vectors (K, V x 2 KV heads) of 256 e4m3 bytes, no scales
    for row_dtype in ("bf16", "fp8"):
        assert replay_row_bytes(row_dtype, None, None, "fp8") == 4 * 256 == 1024
        assert replay_row_bytes(row_dtype, 100, None, "fp8") == 100  # the pool's own row bytes, as given
    cfg = {"num_key_value_heads": 4, "head_dim": 128, "mtp_num_hidden_layers": 2, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert replay_row_bytes("fp8", None, str(tmp_path), "fp8") == 16 * 128 == rows_nbytes("fp8_kv", 16, 128)
    with pytest.raises(ValueError, match="kv_dtype='turboquant4' is not a KV format the carry holds"):
        replay_row_bytes("bf16", None, None, "turboquant4")  # nvfp4 is one now (its own bytes, 576 B)


def test_trace_replay_with_an_fp8_kv_pool_reports_its_rows_and_keeps_more_follow_ups(tmp_path):
    trace = read_trace(SLICE)
    fp8_kv = replay(trace, "returns", ReplayConfig(256 << 20, workers=2, row_bytes=1024))
    assert fp8_kv.adopted == 22  # 1024 B rows: here as many as packed fp8's 1040 B rows keep
    out = tmp_path / "r.json"
    assert main(["trace-replay", str(SLICE), "--workers", "2", "--carry-memory", "256MiB",
                 "--kv-dtype", "fp8", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert (figures["config"]["kv_dtype"], figures["config"]["row_format"], figures["config"]["row_bytes"]) == (
        "fp8", "fp8_kv", 1024)
    assert figures["policies"]["returns"]["adopted"] == fp8_kv.adopted
