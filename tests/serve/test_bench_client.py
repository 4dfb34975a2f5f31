"""`bench --server`: the session replay through the real server returns the bench's records,
and the CLI reports them with the in-process bench's report code."""

from __future__ import annotations

import json
import sys

import pytest
from serve_helpers import MODEL, free_ports

from trtllm_mtp_carry.bench.driver import replay_all
from trtllm_mtp_carry.bench.report import measured, outputs_identical, paired, policy_summary
from trtllm_mtp_carry.bench.sessions import builtin_sessions
from trtllm_mtp_carry.bench.triton_driver import TritonDriver
from trtllm_mtp_carry.cli import main
from trtllm_mtp_carry.engine.engine import ReferenceEngine
from trtllm_mtp_carry.engine.tokenizer import ChatTokenizer

TOK = ChatTokenizer()
SMALL = ["--sessions", "2", "--turns", "2", "--history", "120", "--new-span", "30",
         "--max-new-tokens", "8", "--concurrency", "2", "--policies", "carry,blind", "--no-progress"]


def test_the_triton_driver_records_every_replay_with_greedy_outputs_and_outcomes(served):
    sessions = builtin_sessions(2, 2, 120, 30, TOK)
    driver = TritonDriver(served.endpoints.grpc, MODEL, max_new_tokens=16, concurrency=2, repeat=2)
    runs = replay_all(driver, sessions, ["carry", "blind"])
    assert [r.policy for r in runs] == ["carry", "blind"]
    assert outputs_identical(runs)
    greedy = ReferenceEngine.from_pretrained(policy="off")
    for run in runs:
        assert [t.key for t in run.turns] == [(r, s, t) for r in (0, 1) for t in (0, 1) for s in ("s0", "s1")]
        assert sorted(run.busy_s) == [0, 1] and all(v > 0 for v in run.busy_s.values())
        assert run.runtime == {r: {"server": served.endpoints.grpc, "model": MODEL, "policy": run.policy}
                               for r in (0, 1)}
        by = {t.key: t for t in run.turns}
        for s in sessions:
            first = TOK.render_chat(s.history)
            second = TOK.next_prompt(first, by[(0, s.name, 0)].output, s.followups[0])
            for turn, prompt in ((0, first), (1, second)):
                record = by[(0, s.name, turn)]
                assert record.output == greedy.generate(None, prompt, max_new_tokens=16, policy="off").output
                assert by[(1, s.name, turn)].output == record.output  # a replay is the same conversation
                for r in (0, 1):
                    stats = by[(r, s.name, turn)].stats
                    assert stats["prompt_tokens"] == stats["client_prompt_tokens"] == len(prompt)
                    assert stats["ttft_ms"] > 0 and stats["policy"] == run.policy
        # the in-process bench's report reads these records as they are; replay 0 is the warm-up
        summary = policy_summary(run, first_measured=1)
        assert [t.key for t in measured(run, 1)] == [t.key for t in run.turns if t.replay == 1]
        assert summary["turns"] == 2 and summary["cold"]["turns"] == 2
        expected = "adopted" if run.policy == "carry" else "blind"
        assert summary["outcomes"] == {expected: 2}
        assert summary["cold"]["output_tokens"] + summary["output_tokens"] == sum(
            t.stats["output_tokens"] for t in measured(run, 1))
        assert summary["output_tokens_per_s"] == pytest.approx(
            sum(t.stats["output_tokens"] for t in measured(run, 1)) / run.busy_s[1])
    assert paired(runs, first_measured=1)["carry/blind"]["pairs"] == 2


def test_each_policy_and_replay_has_its_own_prefix_cache_on_the_server(served):
    """Every turn carries its (run, policy, replay) cache_salt: a first turn is cold although
    identical turns ran before it (its 660-token prompt has a snapshot at the 512-token chunk
    end, so an unsalted one would reuse 512 tokens), and a warm turn reuses its own history only."""
    sessions = builtin_sessions(1, 2, 450, 30, TOK)
    assert len(TOK.render_chat(sessions[0].history)) == 660
    driver = TritonDriver(served.endpoints.grpc, MODEL, max_new_tokens=4, concurrency=1, repeat=2)
    runs = replay_all(driver, sessions, ["carry", "blind", "off"])
    for run in runs:
        assert [(t.replay, t.turn, t.stats["reused_tokens"]) for t in run.turns] == [
            (0, 0, 0), (0, 1, 660 + 4 - 1), (1, 0, 0), (1, 1, 660 + 4 - 1)], run.policy
        if run.policy == "carry":
            assert [(t.stats["outcome_kind"], t.stats["keys_skipped"]) for t in run.turns if t.turn] == [
                ("adopted", 0), ("adopted", 0)]
    assert outputs_identical(runs)


def test_bench_cli_through_server_reports_policies_side_by_side(served, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", "--server", served.endpoints.grpc, *SMALL, "--repeat", "2", "--json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0
    lines = printed.splitlines()
    assert lines[0].startswith("environment: ") and f"Triton server {served.endpoints.grpc}" in lines[0]
    rows = [ln.split() for ln in lines if ln.split()[:1] in (["0w"], ["1"])]
    # per-turn table: 2 replays x 2 sessions x 2 turns x 2 policies; the outcome starts at column 10
    assert [(r[0], r[1], r[2], r[3], r[10]) for r in rows] == [
        (rep, s, t, p, {"carry": "adopted", "blind": "blind"}[p] if t == "1" else "prefill")
        for rep in ("0w", "1") for s in ("s0", "s1") for t in ("0", "1") for p in ("carry", "blind")]
    assert all(int(r[5]) > 0 for r in rows if r[2] == "1")  # warm turns reuse the session's prefix
    assert "(replays 1..1, warm-up replay 0 excluded)" in printed
    assert "carry/blind (2 paired warm turns): ttft x" in printed
    assert "outputs identical across policies: True" in printed
    data = json.loads(out.read_text())
    assert data["first_measured_replay"] == 1 and data["outputs_identical"] is True
    assert data["config"]["server"] == served.endpoints.grpc and data["config"]["repeat"] == 2
    # the engine's sizes are the server's: none of this client's defaults is reported as if in effect
    assert not {"draft_len", "chunk", "device", "dtype", "threads", "restore_threshold",
                "carry_slots"} & set(data["config"])
    assert list(data["policies"]) == ["carry", "blind"]
    assert data["summary"]["carry"]["outcomes"] == {"adopted": 2}
    assert data["summary"]["blind"]["outcomes"] == {"blind": 2}
    assert data["summary"]["ratios"]["carry/blind"]["pairs"] == 2
    for policy in ("carry", "blind"):
        assert sorted(data["policies"][policy]["busy_s"]) == ["0", "1"]
        assert [(t["replay"], t["session"], t["turn"]) for t in data["policies"][policy]["turns"]] == [
            (r, s, t) for r in (0, 1) for t in (0, 1) for s in ("s0", "s1")]


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trtllm-mtp-carry: error: "), err
    return err[0]


def test_bench_server_unreachable_is_one_error_line_naming_the_address(capsys):
    pytest.importorskip("tritonclient.grpc")
    address = f"127.0.0.1:{free_ports(1)[0]}"  # nothing listens there
    assert main(["bench", "--server", address, *SMALL]) == 2
    assert f"--server {address}: no Triton server answers there" in _one_error_line(capsys)


@pytest.mark.parametrize("flags, named", [
    (["--draft-len", "2"], "--draft-len"),  # the default value typed is still a choice
    (["--chunk", "256", "--carry-slots", "3"], "--chunk, --carry-slots"),
    (["--restore-threshold", "0"], "--restore-threshold"),
    (["--device", "cpu", "--dtype", "float64", "--threads", "2", "--weights", "w"],
     "--device, --dtype, --threads, --weights"),
])
def test_bench_server_refuses_server_side_flags(capsys, flags, named):
    assert main(["bench", "--server", "127.0.0.1:1", *flags]) == 2
    line = _one_error_line(capsys)
    assert line == (f"trtllm-mtp-carry: error: {named} with --server 127.0.0.1:1: the engine is the "
                    f"server's (set it with `trtllm-mtp-carry serve` or `triton-repo` options); "
                    f"drop {'it' if ',' not in named else 'them'} here")


def test_bench_server_names_a_model_it_does_not_serve(served, capsys):
    assert main(["bench", "--server", served.endpoints.grpc, "--model", "nosuch", *SMALL]) == 2
    assert _one_error_line(capsys) == (f"trtllm-mtp-carry: error: --server {served.endpoints.grpc}: "
                                       "model 'nosuch' is not ready there (see --model)")


def test_bench_server_without_tritonclient_names_the_extra(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tritonclient.grpc", None)  # import fails as if not installed
    assert main(["bench", "--server", "127.0.0.1:1", *SMALL]) == 2
    assert _one_error_line(capsys) == ('trtllm-mtp-carry: error: --server needs tritonclient: '
                                       'pip install -e ".[serve]"')


def test_bench_server_address_must_be_host_port(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--server", "localhost"])
    assert exc.value.code == 2
    assert "argument --server: expected HOST:PORT (the server's gRPC port), got 'localhost'" in (
        _one_error_line(capsys))


def _requests_succeeded(metrics_url: str) -> float:
    """Triton's `nv_inference_request_success` summed over the model's versions (a decoupled
    model's request counts once, whatever it streamed)."""
    import urllib.request

    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("nv_inference_request_success{") and f'model="{MODEL}"' in line)


def test_bench_through_the_server_sends_each_turn_and_one_warm_up_turn_per_policy(served, capsys):
    """docs/BENCH.md's arithmetic: sessions x turns x policies x replays, plus one warm-up turn per
    policy before replay 0 (its own session, START and END in one request)."""
    before = _requests_succeeded(served.endpoints.metrics)
    assert main(["bench", "--server", served.endpoints.grpc, *SMALL, "--repeat", "2"]) == 0
    capsys.readouterr()
    assert _requests_succeeded(served.endpoints.metrics) - before == 2 * 2 * 2 * 2 + 2
