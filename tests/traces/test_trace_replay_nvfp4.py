"""trace-replay --carry-row-dtype nvfp4: a Qwen3-Next MTP row at 580 B (e2m1 pairs, one e4m3
scale per 16 values, one e8m0 byte per vector), and the same budget keeping more follow-ups (issue 43)."""

from __future__ import annotations

import json
from pathlib import Path

from trtllm_mtp_carry.cli import main
from trtllm_mtp_carry.core.row_format import RowFormat, rows_nbytes
from trtllm_mtp_carry.traces.cli import replay_row_bytes, row_format_from_config
from trtllm_mtp_carry.traces.reader import read_trace
from trtllm_mtp_carry.traces.replay import ReplayConfig, replay

SLICE = Path(__file__).parent / "data" / "mooncake-slice.jsonl"


def test_nvfp4_rows_of_qwen3_next_cost_pairs_block_scales_and_one_global_byte_per_vector():
    # 4 vectors of 256: 4 x 128 B of e2m1 pairs + 4 x 16 e4m3 scales + 4 e8m0 bytes
    assert replay_row_bytes("nvfp4", None, None) == 4 * (128 + 16 + 1) == 580


def test_nvfp4_rows_from_a_model_config(tmp_path):
    cfg = {"num_key_value_heads": 4, "head_dim": 128, "mtp_num_hidden_layers": 2, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert row_format_from_config(str(tmp_path), "nvfp4") == RowFormat("nvfp4", 16, 128, 2)
    assert replay_row_bytes("nvfp4", None, str(tmp_path)) == 16 * (64 + 8 + 1) == rows_nbytes("nvfp4", 16, 128)


def test_the_same_budget_keeps_more_follow_ups_with_nvfp4_rows(tmp_path):
    trace = read_trace(SLICE)
    fp8 = replay(trace, "returns", ReplayConfig(128 << 20, workers=2, row_bytes=1040))
    nvfp4 = replay(trace, "returns", ReplayConfig(128 << 20, workers=2, row_bytes=580))
    assert (fp8.adopted, nvfp4.adopted) == (12, 21)  # 128 MiB at nvfp4 holds about what 256 MiB holds at fp8
    out = tmp_path / "r.json"
    assert main(["trace-replay", str(SLICE), "--workers", "2", "--carry-memory", "128MiB",
                 "--carry-row-dtype", "nvfp4", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert (figures["config"]["row_dtype"], figures["config"]["row_bytes"]) == ("nvfp4", 580)
    assert figures["policies"]["returns"]["adopted"] == nvfp4.adopted


def test_an_nvfp4_kv_pool_charges_its_own_payload_and_scale_bytes_whatever_carry_row_dtype_says():
    # Qwen3-Next's MTP row: 2 x 2 vectors of 256, each 128 payload bytes and 16 block scales, no
    # global byte (the pool's global scale is the layer's)
    for row_dtype in ("bf16", "fp8", "nvfp4"):
        assert replay_row_bytes(row_dtype, None, None, "nvfp4") == 4 * (128 + 16) == 576
    assert rows_nbytes("nvfp4_kv", 4, 256) == 576
