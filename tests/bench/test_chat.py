"""`trtllm-mtp-carry chat`: streamed answers with a carry status line, commands that never
reach the model, and Ctrl-C that cancels only the answer."""

import argparse
import io
import signal

import pytest

from trtllm_mtp_carry.chat import run
from trtllm_mtp_carry.engine.engine import ReferenceEngine


def chat_args(**kw):
    base = dict(policy="carry", max_new_tokens=12, draft_len=2, system=None, device="cpu", weights=None)
    return argparse.Namespace(**{**base, **kw})


class Recorder(io.StringIO):
    """stdout that keeps every write, so streaming (several writes per answer) is visible."""

    def __init__(self, on_write=None):
        super().__init__()
        self.writes = []
        self.on_write = on_write

    def write(self, s):
        self.writes.append(s)
        if self.on_write is not None:
            self.on_write(self, s)
        return super().write(s)


@pytest.fixture
def engines(monkeypatch):
    made = []
    real = ReferenceEngine.from_pretrained.__func__

    def capture(cls, *a, **kw):
        made.append(real(cls, *a, **kw))
        return made[-1]

    monkeypatch.setattr(ReferenceEngine, "from_pretrained", classmethod(capture))
    return made


def test_chat_turns_show_the_carry_outcome_and_stats_table(engines):
    out = Recorder()
    stdin = io.StringIO("Show me a function.\n/stats\nNow the first line.\n/new\nhello\n/quit\n")
    assert run(chat_args(), stdin=stdin, stdout=out) == 0
    lines = out.getvalue().splitlines()
    status = [line for line in lines if line.startswith("  [")]
    assert len(status) == 3
    assert status[0].startswith("  [prefill (no carried state: never_carried); rows computed ")
    assert status[1].startswith("  [adopted rows=")
    assert status[2].startswith("  [prefill (foreign session")  # /new: another session
    table = lines[lines.index(next(x for x in lines if x.split()[:1] == ["armed"])):]
    assert table[0].split() == ["armed", "yes"] and table[1].split() == ["policy", "carry"]
    counts = {line.split()[0]: line.split()[-1] for line in table if len(line.split()) == 2}
    assert counts["outcomes.no_carry"] == "1" and counts["turns.cold"] == "1" and "turns.warm" not in counts
    assert "-- session 2" in lines
    [engine] = engines
    engine.check()
    assert not engine.has_unfinished()


def test_answers_stream_as_tokens_are_accepted(engines):
    out = Recorder()
    assert run(chat_args(max_new_tokens=16), stdin=io.StringIO("Show me a function.\n"), stdout=out) == 0
    start = out.writes.index("model> ")
    end = next(i for i, w in enumerate(out.writes) if w.startswith("  ["))
    chunks = [w for w in out.writes[start + 1:end] if w.strip()]
    assert len(chunks) >= 2  # more than one verify step's worth, written as they came
    streamed = "".join(out.writes[start + 1:end])
    assert out.getvalue().count(streamed) == 1 and streamed.endswith("\n")


def test_help_and_unknown_commands_never_reach_the_model(engines):
    out = Recorder()
    assert run(chat_args(), stdin=io.StringIO("/help\n/bogus\n/stats\n"), stdout=out) == 0
    text = out.getvalue()
    assert "  /new     start a new session" in text
    assert "unknown command /bogus; /help lists the commands" in text
    assert "model> " not in text
    [engine] = engines
    assert engine.runtime.stats().outcomes == {k: 0 for k in engine.runtime.stats().outcomes}
    assert "Show `name` again." in text  # the kinds of prompts the model was trained on


def test_ctrl_c_cancels_the_answer_and_the_chat_goes_on(engines):
    fired = []

    def interrupt_first_answer(rec, s):
        """Ctrl-C as the first answer's first text streams (inside the step loop)."""
        before = [w for w in rec.writes[:-1] if w]
        if s.strip() and before[-1:] == ["model> "] and not fired:
            fired.append(True)
            signal.raise_signal(signal.SIGINT)

    out = Recorder(on_write=interrupt_first_answer)
    stdin = io.StringIO("Show me a function.\nShow me a function.\n")
    assert run(chat_args(max_new_tokens=40), stdin=stdin, stdout=out) == 0
    lines = out.getvalue().splitlines()
    assert sum(" [cancelled]" in line for line in lines) == 1
    status = [line for line in lines if line.startswith("  [")]
    # the cancelled turn kept its rows (every key of its 25-token prompt), so the retry adopts them
    assert len(status) == 1 and status[0].startswith("  [adopted rows=24 appended=0 first_key=24;")
    [engine] = engines
    engine.check()
    assert not engine.has_unfinished()
