"""The session benchmark: sessions, replay, the JSON it writes, and bad input."""

import json

import pytest

from trtllm_mtp_carry import marconi_min_tokens
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
        grown = TOK.next_prompt(prompt, [65, 66], s.followups[0])
        assert grown[: len(prompt) + 2] == prompt + [65, 66]
        assert 56 <= len(grown) - len(prompt) - 2 <= 64  # the span, within UTF-8 trimming
    assert sessions[0].history != sessions[1].history


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


SMALL = ["bench", "--sessions", "1", "--turns", "3", "--history", "300", "--new-span", "48",
         "--max-new-tokens", "8", "--repeat", "2", "--no-progress"]


def test_bench_writes_every_figure_and_outputs_match(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main([*SMALL, "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["outputs_identical"] is True and data["partial"] is False
    assert list(data["policies"]) == ["carry", "rebuild", "blind", "off"]  # off: plain greedy
    assert set(data["environment"]) == {"package", "torch", "python", "device", "threads",
                                        "load_avg_start", "load_avg_end", "timestamp"}
    assert data["config"]["marconi_min_tokens"] == marconi_min_tokens()  # resolved, not None
    assert data["config"]["mtp_max_seqs"] == 1
    carry = data["policies"]["carry"]
    fields = {"replay", "prompt_tokens", "reused_tokens", "drafter_rows_computed", "drafter_prep_ms",
              "ttft_ms", "drafted", "accepted", "outcome", "output_tokens"}
    assert all(fields <= set(t) for t in carry["turns"])
    assert [t["replay"] for t in carry["turns"]] == [0, 0, 0, 1, 1, 1]
    warm = [t for t in carry["turns"] if t["turn"] > 0]
    assert [t["outcome_kind"] for t in warm] == ["adopted"] * 4
    # a warm carry turn computes exactly the keys its prefill added
    for t in warm:
        assert t["drafter_rows_computed"] == t["prompt_tokens"] - 1 - t["reused_tokens"]
    rebuild_warm = [t for t in data["policies"]["rebuild"]["turns"] if t["turn"] > 0]
    assert all(t["drafter_rows_computed"] == t["prompt_tokens"] - 1 for t in rebuild_warm)
    # each policy's block describes that policy
    for policy, block in data["policies"].items():
        assert {r["policy"] for r in block["runtime"].values()} == {policy}
        assert {r["armed"] for r in block["runtime"].values()} == {policy == "carry"}
    summary = data["summary"]
    for policy in ("carry", "rebuild", "blind", "off"):
        s = summary[policy]
        assert s["policy"] == policy and s["turns"] == 2  # the warm-up replay is left out
        for key in ("ttft_ms_median", "ttft_ms_p25", "ttft_ms_p75", "acceptance_median",
                    "drafter_rows_computed_median"):
            assert key in s
    assert summary["off"]["acceptance_median"] is None
    assert summary["carry"]["adoption_rate"] == 1.0
    assert set(summary["ratios"]) == {"carry/rebuild", "carry/blind", "carry/off", "rebuild/blind",
                                      "rebuild/off", "blind/off"}
    cr = summary["ratios"]["carry/rebuild"]
    assert cr["pairs"] == 2 and cr["acceptance_paired_median"] == pytest.approx(1.0, abs=0.05)
    assert cr["ttft_paired_median"] > 0
    off = summary["ratios"]["carry/off"]
    assert off["acceptance_paired_median"] is None
    assert off["null_reasons"]["acceptance_paired_median"].startswith("off has acceptance at or near zero")
    printed = capsys.readouterr().out
    assert "outputs identical across policies: True" in printed
    assert "carry/blind (2 paired warm turns): ttft x" in printed
    assert printed.startswith("environment: trtllm_mtp_carry ")
    assert f"wrote {out}" in printed.splitlines()


def test_ctrl_c_prints_a_partial_summary_writes_json_and_exits_130(tmp_path, capsys, monkeypatch):
    from trtllm_mtp_carry.bench import replay as replay_module

    real = replay_module.replay_lockstep

    def interrupted(*args, **kwargs):
        for runs in real(*args, **kwargs):
            yield runs
            if sum(len(r.turns) for r in runs) == 9:  # replay 0 (4 x 2 turns) and one more
                raise KeyboardInterrupt

    monkeypatch.setattr(replay_module, "replay_lockstep", interrupted)
    out = tmp_path / "partial.json"
    rc = main([*SMALL[:4], "2", *SMALL[5:], "--json", str(out)])  # 2 turns per session
    assert rc == 130
    data = json.loads(out.read_text())
    assert data["partial"] is True
    assert [len(p["turns"]) for p in data["policies"].values()] == [3, 2, 2, 2]
    assert data["outputs_identical"] is True
    captured = capsys.readouterr()
    assert "partial: interrupted" in captured.out and "Traceback" not in captured.err
    # replay 1 ran 1 of its 8 rows (2 turns x 4 policies): the header says so, not "replays 1..1"
    assert ("warm turns, median [p25-p75] (partial: interrupted; ran 1 of the 8 rows of replay 1, "
            "warm-up replay 0 excluded)") in captured.out.splitlines()
    assert captured.err.strip().endswith("partial: interrupted by Ctrl-C")


def test_below_threshold_history_is_noted_once_naming_the_flag(capsys):
    from trtllm_mtp_carry.bench.main import _note_below_threshold
    from trtllm_mtp_carry.bench.sessions import BenchSession

    short = [BenchSession(f"s{i}", [{"role": "user", "content": "hi"}], ["more"]) for i in range(3)]
    _note_below_threshold(short, TOK)
    n = len(TOK.render_chat(short[0].history))
    assert capsys.readouterr().out == (
        f"note: session s0's history is {n} tokens (and 2 more), below the restore threshold "
        f"{marconi_min_tokens()}: its warm turns reuse nothing and run cold; lower the threshold "
        "with --restore-threshold N\n")
    _note_below_threshold([BenchSession("s0", short[0].history, [])], TOK)  # no warm turn: quiet
    assert capsys.readouterr().out == ""


def test_bench_rejects_bad_options(capsys):
    assert main(["bench", "--policies", "carry,turbo", "--no-progress"]) == 2
    assert "unknown drafter policy 'turbo'" in capsys.readouterr().err
    assert main(["bench", "--policies", "carry,carry", "--no-progress"]) == 2
    assert "--policies names a policy twice" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--turns", "0", "--no-progress"])
    assert exc.value.code == 2
    assert capsys.readouterr().err == (
        "trtllm-mtp-carry: error: argument --turns: must be at least 1, got 0 "
        "(see trtllm-mtp-carry bench --help)\n")


def test_bench_at_concurrency_reports_adoption_refusals_evictions_and_throughput(tmp_path):
    out = tmp_path / "conc.json"
    rc = main(["bench", "--sessions", "2", "--turns", "2", "--history", "200", "--new-span", "32",
               "--max-new-tokens", "6", "--repeat", "1", "--concurrency", "2", "--interleave",
               "--policies", "carry,blind", "--no-progress", "--json", str(out)])
    data = json.loads(out.read_text())
    assert rc == 0 and data["outputs_identical"] is True
    assert data["config"]["concurrency"] == 2 and data["first_measured_replay"] == 0
    carry = data["summary"]["carry"]
    assert carry["turns"] == 2  # one warm turn per session
    outcomes = sum(carry["outcomes"].values())
    assert carry["adoption_rate"] == carry["outcomes"].get("adopted", 0) / outcomes
    assert sum(carry["refusals"].values()) + carry["outcomes"].get("adopted", 0) <= outcomes
    assert isinstance(carry["evictions"], dict) and carry["output_tokens_per_s"] > 0
    assert data["summary"]["ratios"]["carry/blind"]["pairs"] == 2


def test_shared_prefix_sessions_start_with_the_same_system_prompt_of_that_many_tokens():
    sessions = builtin_sessions(3, 2, 100, 32, TOK, shared_prefix_tokens=200)
    systems = {s.history[0]["content"] for s in sessions}
    assert len(systems) == 1 and all(s.history[0]["role"] == "system" for s in sessions)
    assert len(TOK.encode(systems.pop())) == 200
    assert len({s.history[1]["content"] for s in sessions}) == 3  # each its own history after it


def test_paired_on_shared_prefix_sessions_reports_its_counters_and_outputs_match(tmp_path, capsys):
    out = tmp_path / "paired.json"
    rc = main(["bench", "--sessions", "2", "--turns", "2", "--history", "64", "--shared-prefix", "300",
               "--new-span", "32", "--max-new-tokens", "6", "--repeat", "1", "--chunk", "128",
               "--policies", "carry,paired,off", "--drafter-blocks", "160", "--no-progress",
               "--json", str(out)])
    data = json.loads(out.read_text())
    assert rc == 0 and data["outputs_identical"] is True and data["config"]["shared_prefix"] == 300
    s = data["summary"]
    assert s["paired"]["drafter_blocks"] == s["carry"]["drafter_blocks"] == 160
    p = s["paired"]["paired"]
    assert p["turns"] == 5 and p["warm_turns"] == 3  # 4 turns and the replay's warm-up request;
    # the second session's first turn is warm too
    assert p["tree_hits"] == 3 and p["pool_blocks"] == 160
    assert 0 < s["paired"]["drafter_blocks_peak"] <= 160 and s["off"]["drafter_blocks_peak"] == 0
    # the second session's first turn resumes at the chunk-end snapshot inside the shared
    # prompt: paired takes those rows from the tree, the carry has none of its own (blind)
    second = {pol: next(t for t in data["policies"][pol]["turns"] if t["session"] == "s1" and t["turn"] == 0)
              for pol in ("carry", "paired")}
    assert second["carry"]["reused_tokens"] == second["paired"]["reused_tokens"] == 256
    assert second["paired"]["drafter_rows_kept"] == 256 and second["carry"]["drafter_rows_kept"] == 0
    for t in data["policies"]["paired"]["turns"]:
        assert t["recomputed_for_cap"] == 0 and t["drafter_tree_tokens"] >= t["reused_tokens"]
    assert "carry/paired" in s["ratios"]
    printed = capsys.readouterr().out
    assert "drafter tree hits 3 of 3 warm turns" in printed and "target tokens computed" in printed


def test_shared_prefix_with_conversations_and_a_too_small_target_pool_are_refused(tmp_path, capsys):
    convs = tmp_path / "c.jsonl"
    convs.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert main(["bench", "--conversations", str(convs), "--shared-prefix", "64", "--no-progress"]) == 2
    assert "--shared-prefix applies to the built-in sessions" in capsys.readouterr().err
    assert main(["bench", "--target-blocks", "10", "--sessions", "1", "--turns", "1", "--no-progress"]) == 2
    assert "--target-blocks 10 cannot hold one sequence of up to 4096 tokens: use at least 256" in (
        capsys.readouterr().err)
    assert main(["bench", "--server", "127.0.0.1:9", "--policies", "carry,paired", "--no-progress"]) == 2
    assert "--policies paired with --server 127.0.0.1:9: paired" in capsys.readouterr().err
