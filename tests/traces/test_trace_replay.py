"""trace-replay: both trace formats, conversations rebuilt from hash prefixes, the replay through
CarryStore, the clairvoyant bound, and the command line (figures, JSON, one error line)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from trtllm_mtp_carry.cli import main
from trtllm_mtp_carry.traces.cli import DEFAULT_REPLAY_MEMORY, row_bytes_from_config
from trtllm_mtp_carry.traces.defaults import QWEN3_NEXT_MTP_ROW_BYTES
from trtllm_mtp_carry.traces.reader import read_trace
from trtllm_mtp_carry.traces.replay import (
    ReplayConfig,
    ServiceModel,
    clairvoyant_bound,
    next_use,
    replay,
    worker_of,
)

SLICE = Path(__file__).parent / "data" / "mooncake-slice.jsonl"


def write(tmp_path: Path, rows: list[dict[str, object]], name: str = "t.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def mc(t_ms: int, ids: list[int], inp: int = 1000, out: int = 10) -> dict[str, object]:
    return {"timestamp": t_ms, "input_length": inp, "output_length": out, "hash_ids": ids}


MOONCAKE = [
    mc(0, [0, 1, 2]),  # A turn 1
    mc(0, [0, 5], inp=500),  # B turn 1
    mc(100_000, [0, 1, 2, 3]),  # extends A: A turn 2
    mc(200_000, [0, 5, 6], inp=600),  # extends B: B turn 2
    mc(300_000, [0, 9]),  # shares only the system prompt: C turn 1
    mc(400_000, [0, 1, 2, 7]),  # shares [0 1 2] with A's turns 1 and 2: A turn 3
]


def test_mooncake_conversations_are_rebuilt_from_shared_prefixes(tmp_path):
    trace = read_trace(write(tmp_path, MOONCAKE))
    assert trace.format == "mooncake"
    assert trace.conversation.tolist() == [0, 1, 0, 1, 2, 0]
    assert trace.turn.tolist() == [1, 1, 2, 2, 1, 3]
    assert (trace.conversations, trace.follow_ups) == (3, 3)
    assert trace.arrival_s.tolist() == [0.0, 0.0, 100.0, 200.0, 300.0, 400.0]


def test_explicit_conversation_ids_are_followed_and_sorted_by_arrival(tmp_path):
    rows = [
        {"chat_id": 10, "parent_chat_id": -1, "timestamp": 5.0, "turn": 1, "hash_ids": [1, 2]},
        {"chat_id": 11, "parent_chat_id": -1, "timestamp": 1.0, "turn": 1, "hash_ids": [3],
         "input_length": 20, "output_length": 7},
        {"chat_id": 12, "parent_chat_id": 10, "timestamp": 9.5, "turn": 2, "hash_ids": [1, 2, 4]},
        {"chat_id": 13, "parent_chat_id": 12, "timestamp": 20.0, "turn": 3, "hash_ids": [1, 2, 4, 5]},
    ]
    trace = read_trace(write(tmp_path, rows))
    assert trace.format == "conversation"
    assert trace.arrival_s.tolist() == [1.0, 5.0, 9.5, 20.0]
    assert trace.conversation.tolist() == [0, 1, 1, 1]  # dense ids in order of first arrival
    assert trace.turn.tolist() == [1, 1, 2, 3]
    assert trace.input_tokens.tolist() == [20, 32, 48, 64]  # 16 tokens a hash id unless given
    assert trace.output_tokens.tolist() == [7, 0, 0, 0]


@pytest.mark.parametrize(("lines", "message"), [
    ([json.dumps(mc(0, [0, 1])), "{not json"], "trace line 2: not JSON"),
    ([json.dumps(mc(0, [0, 1])), "", json.dumps({"timestamp": 5, "input_length": -1, "output_length": 1,
                                                 "hash_ids": [0]})],
     "trace line 3: 'input_length' must be an int >= 0, got -1"),
    ([json.dumps(mc(0, [0, 1])), json.dumps({"timestamp": 5, "input_length": 1, "output_length": 1})],
     "trace line 2: missing 'hash_ids'"),
    ([json.dumps({"prompt": "hi"})], "trace line 1: neither a mooncake trace"),
    ([json.dumps(mc(0, [0, "x"]))], "trace line 1: 'hash_ids' must be a list of ints"),
    (["[1, 2]"], "trace line 1: expected a JSON object, got list"),
])
def test_a_malformed_line_is_one_error_naming_its_line_number(tmp_path, capsys, lines, message):
    p = tmp_path / "bad.jsonl"
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_trace(p)
    assert main(["trace-replay", str(p)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"trtllm-mtp-carry: error: {message}")


def test_a_missing_trace_and_a_pool_fraction_are_one_error_each(tmp_path, capsys):
    assert main(["trace-replay", str(tmp_path / "none.jsonl")]) == 2
    assert "is not a file" in capsys.readouterr().err
    p = write(tmp_path, MOONCAKE)
    assert main(["trace-replay", str(p), "--carry-memory", "0.5"]) == 2
    assert "a replay has no drafter pool" in capsys.readouterr().err
    assert main(["trace-replay", str(p), "--carry-eviction", "incumbent,fifo"]) == 2
    assert "--carry-eviction='fifo' is not an eviction policy" in capsys.readouterr().err


def test_replay_adopts_what_fits_and_counts_every_miss_under_its_reason(tmp_path):
    # after_miss="full": every finish deposits all its rows (the replay's first model; a missed
    # turn's smaller deposit is pinned in test_trace_replay_after_miss.py)
    trace = read_trace(write(tmp_path, MOONCAKE))
    row = 100
    big = ReplayConfig(10**9, row_bytes=row, after_miss="full")
    r = replay(trace, "incumbent", big)
    assert (r.follow_ups, r.adopted, r.misses) == (3, 3, {})
    assert r.adopted_by_tier == {"device": 3, "host": 0}
    assert r.deposits == 6 and r.peak_bytes["device"] == (1010 + 610 + 1010) * row  # A3, B2, C1 at the end
    small = replay(trace, "incumbent", ReplayConfig(800 * row, row_bytes=row, after_miss="full"))  # B's 510 rows fit
    assert small.adopted == 1 and small.misses == {"too_large": 2}
    idle = replay(trace, "lrd", ReplayConfig(10**9, idle_s=50.0, row_bytes=row, after_miss="full"))
    assert idle.adopted == 0 and idle.misses == {"idle": 3}


def test_the_bound_stores_only_what_comes_back_within_the_ttl(tmp_path):
    trace = read_trace(write(tmp_path, MOONCAKE))
    cfg = ReplayConfig(10**9, row_bytes=100)
    finish = ServiceModel().finish_s(trace)
    use = next_use(trace, cfg)
    assert use[0] == 100.0 and use[1] == 200.0 and use[2] == 400.0
    assert np.isnan(use[[3, 4, 5]]).all()
    assert finish[0] == pytest.approx(1000 / 8000 + 10 * 0.03)
    assert clairvoyant_bound(trace, cfg).adopted == 3
    assert clairvoyant_bound(trace, ReplayConfig(10**9, idle_s=50.0)).adopted == 0
    # room for 1100 rows: B's first turn (510 rows, reused at 200 s) finishes first, then A's
    # (1010 rows, reused at 100 s) needs its room: the bound evicts B, reused furthest ahead
    tight = ReplayConfig(1100 * 100, row_bytes=100, after_miss="full")
    assert clairvoyant_bound(trace, tight).adopted == 2
    lrd, incumbent = replay(trace, "lrd", tight), replay(trace, "incumbent", tight)
    assert (lrd.adopted, lrd.misses) == (1, {"memory": 2})  # B's second deposit pushes out A's second
    assert (incumbent.adopted, incumbent.misses) == (1, {"not_admitted": 2})  # keeps B, refuses A


def test_workers_split_by_conversation_and_sum_the_figures():
    trace = read_trace(SLICE)
    w = worker_of(trace.conversation, 8)
    assert w.min() >= 0 and w.max() <= 7
    assert (worker_of(trace.conversation, 8) == w).all()  # deterministic
    one = replay(trace, "lrd", ReplayConfig(None, workers=1))
    eight = replay(trace, "lrd", ReplayConfig(None, workers=8))
    assert one.follow_ups == eight.follow_ups == trace.follow_ups == 43
    assert one.adopted == eight.adopted  # unbounded: the split changes nothing


def test_the_slice_replays_every_policy_with_the_figures_it_gave(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["trace-replay", str(SLICE), "--workers", "2", "--carry-memory", "256MiB", "--after-miss", "full",
                 "--carry-eviction", "returns,incumbent,lrd,slru", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "trace " in text and "(mooncake): 400 requests, 357 conversations, 43 follow-up turns" in text
    assert "clairvoyant bound: 32 of 43 follow-ups adopted (74.4%)" in text
    # byte figures by the one unit rule (core.settings.format_bytes)
    assert "2 worker(s), each: carry memory 256MiB, host 0B, idle TTL 600 s; 2048 B a row (bf16)" in text
    assert "returns    adopted 12 (27.9%; device 12, host 0), 20 below the bound; peak device 255.94MiB, host 0B" in text
    assert "lrd        adopted 1 (2.3%; device 1, host 0), 31 below the bound; peak device 255.91MiB, host 0B" in text
    figures = json.loads(out.read_text())
    assert figures["bound"]["follow_ups"] == 43 and figures["bound"]["adopted"] == 32
    adopted = {name: p["adopted"] for name, p in figures["policies"].items()}
    # 141 s of trace: no deposit is past the 600 s TTL yet, so returns has seen no stays and
    # keeps what it holds much as incumbent does
    assert adopted == {"returns": 12, "incumbent": 7, "lrd": 1, "slru": 1}
    for p in figures["policies"].values():
        assert p["follow_ups"] == 43
        assert p["adopted"] + sum(p["misses"].values()) == 43  # every follow-up counted once
        assert p["distance_to_bound"] == 32 - p["adopted"]
    assert figures["config"]["row_bytes"] == QWEN3_NEXT_MTP_ROW_BYTES == 2048


def test_a_host_tier_keeps_what_the_device_budget_drops(tmp_path):
    trace = read_trace(SLICE)
    device = replay(trace, "returns", ReplayConfig(256 << 20, workers=2))
    both = replay(trace, "returns", ReplayConfig(256 << 20, workers=2, host_budget_bytes=2 << 30))
    assert both.adopted > device.adopted
    assert both.adopted == both.adopted_by_tier["device"] + both.adopted_by_tier["host"]
    assert both.adopted_by_tier["host"] > 0 and both.bytes_restored > 0 and both.peak_bytes["host"] > 0


def test_row_bytes_from_a_model_config(tmp_path):
    cfg = {"num_key_value_heads": 2, "head_dim": 256, "num_attention_heads": 16, "hidden_size": 2048,
           "mtp_num_hidden_layers": 1, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert row_bytes_from_config(str(tmp_path)) == QWEN3_NEXT_MTP_ROW_BYTES
    cfg["head_dim"] = 0
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="head_dim must be a positive int, got 0"):
        row_bytes_from_config(str(tmp_path))


def test_the_default_budget_is_the_adapters():
    from trtllm_mtp_carry.core.settings import parse_carry_memory
    from trtllm_mtp_carry.trtllm.options import DEFAULT_CARRY_MEMORY

    assert parse_carry_memory(DEFAULT_REPLAY_MEMORY).nbytes == DEFAULT_CARRY_MEMORY


def test_the_command_line_parses_without_loading_numpy_or_torch():
    import subprocess
    import sys

    code = ("import sys; from trtllm_mtp_carry.cli import build_parser; build_parser()\n"
            "print([m for m in ('numpy', 'torch') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
