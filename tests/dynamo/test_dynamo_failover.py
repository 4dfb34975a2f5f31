"""Failover behind Dynamo: the session's worker dies (SIGKILL) or stops (SIGTERM) mid-conversation.

Pins: the next turn is served by another worker with the right output (the
in-process greedy answer); after the SIGKILL the carry is refused there (the rows
died with the worker) and the drafter built the slow way, after the SIGTERM the
stopping worker handed its rows over (the drain) and that turn adopts them; the
turn after adopts again on the new worker. Under hard affinity (set explicitly; the default is soft) a SIGKILL costs retryable
503s until the binding is dropped, and a SIGTERM hands over without a single failed request.
"""

from __future__ import annotations

import json
import sys

from dynamo_helpers import HERE, Netns, expected_text

from trtllm_mtp_carry.bench.sessions import builtin_sessions
from trtllm_mtp_carry.engine.tokenizer import ChatTokenizer

MAX_TOKENS = 12


def test_a_session_survives_sigkill_and_sigterm_of_its_worker(netns: Netns, reference_engine) -> None:
    (s,) = builtin_sessions(1, 6, 160, 48, ChatTokenizer())
    done = netns.run(sys.executable, str(HERE / "failover_scenario.py"), timeout=240,
                     input=json.dumps({"messages": s.history, "followups": s.followups,
                                       "max_tokens": MAX_TOKENS}))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    a, b, c = result["workers"]
    turns = result["turns"]
    assert len({a, b, c}) == 3
    assert [t["worker_index"] for t in turns] == [a, a, b, b, c, c]
    for turn in turns:
        assert turn["error"] is None
        assert turn["text"] == expected_text(reference_engine, turn["messages"], MAX_TOKENS)
    kinds = [t["carry"]["outcome_kind"] for t in turns]
    assert kinds[1] == kinds[3] == kinds[5] == "adopted"
    killed = turns[2]["carry"]  # the first turn after the SIGKILL: the rows died with the worker
    assert (killed["outcome_kind"], killed["no_carry_reason"], killed["drafter_rows_kept"]) == (
        "no_carry", "never_carried", 0)
    assert killed["drafter_rows_computed"] >= killed["prompt_tokens"] - 2
    stopped = turns[4]["carry"]  # after the SIGTERM: the stopping worker handed the rows over
    assert (stopped["outcome_kind"], stopped["rows_source"]) == ("adopted", "remote"), stopped
    assert stopped["drafter_rows_kept"] > 0 and stopped["moved_in"]["via"] in ("push", "pull")
    # SIGTERM under hard affinity (the default): the worker unregisters and the session moves
    # with no failed request (under soft affinity its next turn got one 503 first, measured)
    assert turns[4]["attempts"] == 1, turns[4]["failures"]
    assert all(f[:1] == "5" for f in turns[2]["failures"]), turns[2]["failures"]  # SIGKILL: retryable 5xx
    print(f"turns after the SIGKILL needed {turns[2]['attempts']} attempt(s), after the SIGTERM {turns[4]['attempts']}")
