"""`trtllm-mtp-carry chat`: each turn prints the answer and its carry status line."""

import argparse
import io

from trtllm_mtp_carry.chat import run


def test_chat_turns_show_the_carry_outcome():
    args = argparse.Namespace(policy="carry", max_new_tokens=12, draft_len=2, system=None,
                              device="cpu", weights=None)
    out = io.StringIO()
    stdin = io.StringIO("Show me a function.\n/stats\nNow the first line.\n/new\nhello\n/quit\n")
    assert run(args, stdin=stdin, stdout=out) == 0
    lines = out.getvalue().splitlines()
    status = [line for line in lines if line.startswith("  [")]
    assert len(status) == 3
    assert status[0].startswith("  [prefill (no carried state); rows computed ")
    assert status[1].startswith("  [adopted rows=")
    assert status[2].startswith("  [prefill (foreign session")  # /new: another session
    assert any(line.startswith("CarryStats(armed=True") for line in lines)
    assert "-- session 2" in lines
