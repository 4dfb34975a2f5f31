"""The session benchmark: sessions, replay, the JSON it writes, and bad input."""

import json

import pytest

from trtllm_mtp_carry.bench.replay import next_prompt
from trtllm_mtp_carry.bench.sessions import (
    builtin_sessions,
    load_conversations,
    sessions_from_conversations,
)
from trtllm_mtp_carry.cli import main
from trtllm_mtp_carry.engine.tokenizer import ChatTokenizer

TOK = ChatTokenizer()


def test_builtin_sessions_reach_the_history_and_span_sizes():
    sessions = builtin_sessions(2, turns=3, history_tokens=400, new_span_tokens=64, tokenizer=TOK)
    assert [s.name for s in sessions] == ["s0", "s1"]
    for s in sessions:
        assert s.history[-1]["role"] == "user" and len(TOK.render_chat(s.history)) >= 400
        assert len(s.followups) == 2
        prompt = TOK.render_chat(s.history)
        grown = next_prompt(TOK, prompt, [65, 66], s.followups[0])
        assert grown[: len(prompt) + 2] == prompt + [65, 66]
        assert 56 <= len(grown) - len(prompt) - 2 <= 64  # the span, within UTF-8 trimming
    assert sessions[0].history != sessions[1].history


def test_next_prompt_closes_an_unfinished_answer_once():
    closed = next_prompt(TOK, [1], [65, TOK.eos_id], "hi")
    cut = next_prompt(TOK, [1], [65], "hi")
    assert closed == cut == [1, 65, TOK.eos_id, 10, *TOK.render_message("user", "hi"),
                             TOK.im_start_id, TOK.assistant_id]


def test_user_conversations(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(
        json.dumps({"messages": [{"role": "system", "content": "be brief"},
                                 {"role": "user", "content": "a"},
                                 {"role": "assistant", "content": "b"},
                                 {"role": "user", "content": "c"}]}) + "\n"
    )
    [s] = sessions_from_conversations(load_conversations(path))
    assert (s.history, s.followups) == (
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a"}], ["c"]
    )


def test_malformed_conversation_line_is_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "ok"}]}\n{"messages": 3}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a chat conversation line"):
        load_conversations(path)


def test_bench_writes_every_figure_and_outputs_match(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", "--sessions", "1", "--turns", "3", "--history", "300", "--new-span", "48",
               "--max-new-tokens", "8", "--no-progress", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["outputs_identical"] is True
    assert sorted(data["policies"]) == ["blind", "carry", "rebuild"]
    carry = data["policies"]["carry"]
    fields = {"prompt_tokens", "reused_tokens", "drafter_rows_computed", "drafter_prep_ms",
              "ttft_ms", "drafted", "accepted", "outcome", "output_tokens"}
    assert all(fields <= set(t) for t in carry["turns"])
    warm = [t for t in carry["turns"] if t["turn"] > 0]
    assert [t["outcome_kind"] for t in warm] == ["adopted", "adopted"]
    # a warm carry turn computes exactly the keys its prefill added
    for t in warm:
        assert t["drafter_rows_computed"] == t["prompt_tokens"] - 1 - t["reused_tokens"]
    rebuild_warm = [t for t in data["policies"]["rebuild"]["turns"] if t["turn"] > 0]
    assert all(t["drafter_rows_computed"] == t["prompt_tokens"] - 1 for t in rebuild_warm)
    assert set(data["ratios"]) == {"carry/rebuild", "carry/blind"}
    assert data["ratios"]["carry/rebuild"]["acceptance"] == pytest.approx(1.0, abs=0.05)
    printed = capsys.readouterr().out
    assert "outputs identical across policies: True" in printed and "carry/blind:" in printed


def test_bench_rejects_bad_options(capsys):
    assert main(["bench", "--policies", "carry,turbo", "--no-progress"]) == 2
    assert "unknown drafter policy 'turbo'" in capsys.readouterr().err
    assert main(["bench", "--turns", "0", "--no-progress"]) == 2
    assert "--turns must be at least 1, got 0" in capsys.readouterr().err
