"""Serving behind Dynamo, end to end: docs/DYNAMO.md's deployment (frontend + 2 workers), real requests.

Pins: outputs through the OpenAI API equal in-process greedy decoding; a
session's turns stay on one worker and its warm turns adopt the carry; a chat
without a session id still lands on the worker holding its prefix (the KV
events are real); bad requests get OpenAI-style errors and the workers keep
serving; each worker's carry counters are on its metrics endpoint; the
Dynamo blocks of docs/DYNAMO.md and docs/BENCH.md run as written.
"""

from __future__ import annotations

import json
import re

import pytest
from dynamo_helpers import Served, expected_text, readme_blocks

from trtllm_mtp_carry.bench.sessions import builtin_sessions
from trtllm_mtp_carry.engine.tokenizer import ChatTokenizer

MAX_TOKENS = 12


def _sessions(n: int, turns: int, history: int, span: int) -> list[dict]:
    return [{"messages": s.history, "followups": s.followups}
            for s in builtin_sessions(n, turns, history, span, ChatTokenizer())]


def test_sessions_stay_on_one_worker_adopt_and_match_in_process_greedy(served: Served,
                                                                       reference_engine) -> None:
    sessions = [dict(s, id=f"sticky-{i}", max_tokens=MAX_TOKENS)
                for i, s in enumerate(_sessions(8, 3, 160, 48))]
    result = served.netns.client({"op": "sessions", "base_url": served.base_url, "model": served.model,
                                  "concurrency": 8, "sessions": sessions})
    warm = adopted = 0
    for s, turns in zip(sessions, result, strict=True):
        assert [t["error"] for t in turns] == [None, None, None], s["id"]
        assert len({t["worker_id"] for t in turns}) == 1, f"{s['id']} moved between workers"
        for t, turn in enumerate(turns):
            assert turn["text"] == expected_text(reference_engine, turn["messages"], MAX_TOKENS)
            assert turn["usage"]["prompt_tokens"] == len(
                reference_engine.tokenizer.render_chat(turn["messages"]))
            assert turn["carry"]["worker_id"] == turn["worker_id"]  # the worker's own report
            if t:
                warm += 1
                adopted += turn["carry"]["outcome_kind"] == "adopted"
            else:
                assert turn["carry"]["outcome_kind"] != "adopted"
    assert warm == 16
    assert adopted / warm >= 0.95, f"{adopted}/{warm} warm turns adopted"


def test_kv_mode_routes_a_chat_without_session_id_to_its_prefix(served: Served) -> None:
    # two growing chats, no session header: only prefix overlap (KV events) can keep them in place
    chats = [dict(s, id=None, max_tokens=8) for s in _sessions(2, 4, 400, 48)]
    result = served.netns.client({"op": "sessions", "base_url": served.base_url, "model": served.model,
                                  "concurrency": 2, "sessions": chats})
    for turns in result:
        assert [t["error"] for t in turns] == [None] * 4
        assert len({t["worker_id"] for t in turns}) == 1, [t["worker_id"] for t in turns]
        # no session id: never carried, so every turn built its drafter rows itself
        assert {t["carry"]["outcome_kind"] for t in turns} & {"adopted"} == set()
        assert all(t["carry"]["reused_tokens"] > 0 for t in turns[1:])  # the prefix was there


@pytest.mark.parametrize("body, message", [
    ({"messages": []}, "'messages' field cannot be empty"),
    ({"messages": [{"role": "narrator", "content": "x"}]}, "unknown variant `narrator`"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "Max tokens must be greater than 0"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": -2}, "invalid value: integer `-2`"),
    ({"messages": [{"role": "user", "content": "y" * 33000}], "max_tokens": 4},
     "prompt of 33006 tokens + max_new_tokens=4 + draft_len=2 exceeds max_model_len=32768"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
      "nvext": {"annotations": ["mtp_carry_policy:fastest"]}},
     "annotation mtp_carry_policy:<policy> must name one of carry, rebuild, blind, off, got 'fastest'"),
])
def test_bad_requests_get_openai_errors_and_workers_keep_serving(served: Served, body: dict,
                                                                 message: str) -> None:
    good = {"model": served.model, "max_tokens": 4, "messages": [{"role": "user", "content": "still there?"}]}
    bad, after = served.netns.client({"op": "post", "base_url": served.base_url,
                                      "bodies": [dict(body, model=served.model), good]})
    assert bad["status"] == 400
    assert message in bad["body"]
    assert '"type":"Bad Request"' in bad["body"] and '"code":400' in bad["body"]
    assert after["status"] == 200


def test_each_worker_reports_its_carry_counters_labelled_by_worker(served: Served) -> None:
    pages = served.netns.client({"op": "get", "urls": served.metrics_urls})
    adopted, instances = 0, set()
    for page in pages:
        assert page["status"] == 200
        lines = [ln for ln in page["body"].splitlines() if ln.startswith("mtp_carry_outcomes_total{")]
        stored = [ln for ln in page["body"].splitlines()
                  if ln.startswith("mtp_carry_kv_events_total{") and 'kind="stored"' in ln]
        assert len(stored) == 1 and int(stored[0].rsplit(" ", 1)[1]) > 0  # its prefixes, announced
        for line in lines:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            assert labels["instance"] == labels["worker_id"]
            instances.add(labels["worker_id"])
            if labels["kind"] == "adopted":
                adopted += int(line.rsplit(" ", 1)[1])
    assert len(instances) == 2  # both workers served turns and report them apart
    assert adopted >= 16  # at least the sticky sessions' warm turns


def test_readme_dynamo_blocks_run_as_written(served: Served, tmp_path) -> None:
    blocks = [(lang, code) for lang, code in readme_blocks("dynamo")
              if not code.startswith("trtllm-mtp-carry serve --dynamo")]
    assert [(lang, code.split()[0]) for lang, code in blocks] == [
        ("bash", "trtllm-mtp-carry"), ("bash", "curl"), ("python", "from")]
    home = tmp_path / ".home"
    home.mkdir()
    env = served.netns.clean_env(home)
    for lang, code in blocks:
        done = served.netns.run("bash", "-e", "-o", "pipefail", "-c", code, cwd=tmp_path, env=env) \
            if lang == "bash" else served.netns.run("python", "-c", code, cwd=tmp_path, env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        if code.startswith("trtllm-mtp-carry bench --openai"):
            assert "outputs identical across policies: True" in done.stdout
            assert "carry: sessions on one worker 4/4" in done.stdout  # 2 sessions x 2 replays
            summary = json.loads((tmp_path / "dynamo-bench.json").read_text())["summary"]
            assert summary["carry"]["outcomes"] == {"adopted": 2}  # the workers' own reports
            assert summary["blind"]["adoption_rate"] == 0
        elif lang == "bash":
            assert '"object":"chat.completion"' in done.stdout
        else:
            (first, second) = done.stdout.splitlines()
            assert first.split()[0] == second.split()[0]  # the same worker
            assert first.split()[1] in ("no_carry", "foreign_session")  # nothing of this session yet
            assert second.split()[1] == "adopted"



def _outcomes(served: Served) -> tuple[int, int]:
    """Turns in `mtp_carry_outcomes_total`, and carry decisions in the runtime's own
    `mtp_carry_runtime{field="outcomes.*"}`, summed over the workers."""
    total, runtime = 0, 0
    for page in served.netns.client({"op": "get", "urls": served.metrics_urls}):
        for ln in page["body"].splitlines():
            if ln.startswith("mtp_carry_outcomes_total{"):
                total += int(ln.rsplit(" ", 1)[1])
            elif ln.startswith("mtp_carry_runtime{") and 'field="outcomes.' in ln:
                runtime += int(ln.rsplit(" ", 1)[1])
    return total, runtime


def test_a_client_that_hangs_up_cancels_its_turn_in_the_engine(served: Served) -> None:
    chat = [{"role": "user", "content": "Write a long Python module with many functions."}]
    before = _outcomes(served)
    hung = served.netns.client({"op": "disconnect", "base_url": served.base_url, "model": served.model,
                                "session": "hang-up", "messages": chat, "max_tokens": 3000})
    assert hung["status"] == 200
    (turns,) = served.netns.client({"op": "sessions", "base_url": served.base_url, "model": served.model,
                                    "sessions": [{"id": "hang-up", "messages": chat, "max_tokens": 4}]})
    assert turns[0]["error"] is None
    # a session's turns run one at a time: had the 3000-token turn run on, it would have finished
    # before this one. Cancelled, it never finishes, yet its outcome was decided at admission:
    # both families count it, once
    after = _outcomes(served)
    assert (after[0] - before[0], after[1] - before[1]) == (2, 2)
