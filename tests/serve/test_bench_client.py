"""`bench --server`: the session replay through the real server returns the bench's records."""

from __future__ import annotations

from serve_helpers import MODEL

from trtllm_mtp_carry.bench.replay import next_prompt
from trtllm_mtp_carry.bench.report import outputs_identical, summaries
from trtllm_mtp_carry.bench.sessions import builtin_sessions
from trtllm_mtp_carry.core.outcome import OUTCOME_KINDS
from trtllm_mtp_carry.engine.engine import ReferenceEngine
from trtllm_mtp_carry.engine.tokenizer import ChatTokenizer
from trtllm_mtp_carry.serve.bench_client import replay_on_server

TOK = ChatTokenizer()


def test_replay_on_server_returns_one_run_per_policy_with_greedy_outputs(served):
    sessions = builtin_sessions(2, 2, 120, 30, TOK)
    runs = replay_on_server(served.endpoints.grpc, sessions, ["carry", "blind"], max_new_tokens=16,
                            concurrency=2, model=MODEL)
    assert [r.policy for r in runs] == ["carry", "blind"]
    assert outputs_identical(runs)
    greedy = ReferenceEngine.from_pretrained(policy="off")
    for run in runs:
        assert [(t.session, t.turn) for t in run.turns] == [("s0", 0), ("s1", 0), ("s0", 1), ("s1", 1)]
        by = {(t.session, t.turn): t for t in run.turns}
        for s in sessions:
            first = TOK.render_chat(s.history)
            second = next_prompt(TOK, first, by[(s.name, 0)].output, s.followups[0])
            for turn, prompt in ((0, first), (1, second)):
                record = by[(s.name, turn)]
                assert record.output == greedy.generate(None, prompt, max_new_tokens=16, policy="off").output
                assert record.stats["prompt_tokens"] == record.stats["client_prompt_tokens"] == len(prompt)
                assert record.stats["ttft_ms"] > 0 and record.stats["policy"] == run.policy
        warm = [t.stats for t in run.turns if t.turn == 1]
        if run.policy == "blind":
            assert [w["outcome_kind"] for w in warm] == ["blind", "blind"]
        else:
            assert all(w["outcome_kind"] in OUTCOME_KINDS for w in warm)
        summaries(run)  # the in-process bench's report reads these records as they are
