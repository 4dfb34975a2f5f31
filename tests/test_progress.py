"""Progress bars: drawn on a terminal, never into a pipe or a file; an error is its one line
with nothing printed before it (issue 32)."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

from terminal import Terminal

from trtllm_mtp_carry.progress import progress, shows_progress

ROOT = Path(__file__).resolve().parents[1]
TINY_BENCH = ["bench", "--sessions", "1", "--turns", "2", "--history", "64", "--new-span", "16",
              "--max-new-tokens", "4", "--repeat", "1", "--policies", "carry"]
TRACE = ('{"timestamp": 0, "input_length": 1500, "output_length": 100, "hash_ids": [0, 1, 2]}\n'
         '{"timestamp": 60000, "input_length": 2100, "output_length": 80, "hash_ids": [0, 1, 2, 3, 4]}\n')


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRTLLM_MTP_CARRY_")}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "trtllm_mtp_carry.cli", *args]


def test_a_bar_is_shown_on_a_terminal_only_and_when_not_turned_off():
    assert shows_progress(_Terminal()) is True
    assert shows_progress(_Terminal(), off=True) is False
    assert shows_progress(io.StringIO()) is False
    pipe = io.StringIO()
    with progress(3, "bench", "turn", stream=pipe) as bar:
        bar.update(3)
    assert pipe.getvalue() == ""
    tty = _Terminal()
    with progress(3, "bench", "turn", stream=tty) as bar:
        bar.update(3)
    assert "bench: 100%" in tty.getvalue() and "3/3" in tty.getvalue()


def _stderr_on_a_terminal(argv: list[str], cwd: Path) -> tuple[int, str]:
    """Run `argv` with stderr on a pseudo-terminal (stdout a pipe); its exit status and stderr."""
    terminal = Terminal()
    try:
        done = subprocess.run(argv, env=_env(), cwd=cwd, stdout=subprocess.PIPE, stderr=terminal.fd, timeout=300)
    finally:
        text = terminal.close()
    return done.returncode, text


def test_bench_draws_its_bar_on_a_terminal_and_none_into_a_pipe(tmp_path):
    piped = subprocess.run(_cli(*TINY_BENCH), env=_env(), cwd=tmp_path, capture_output=True, text=True,
                           timeout=300)
    assert piped.returncode == 0, piped.stderr
    assert piped.stderr == ""
    assert "turn/s" not in piped.stdout and "bench:" not in piped.stdout
    code, stderr = _stderr_on_a_terminal(_cli(*TINY_BENCH), tmp_path)
    assert code == 0
    assert "bench: 100%" in stderr and "2/2" in stderr


def test_trace_replay_draws_its_bar_on_a_terminal_and_none_into_a_file(tmp_path):
    trace = tmp_path / "chat.jsonl"
    trace.write_text(TRACE)
    with open(tmp_path / "log.txt", "w") as log:
        done = subprocess.run(_cli("trace-replay", str(trace), "--carry-eviction", "returns,lrd"), env=_env(),
                              cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, timeout=120)
    assert done.returncode == 0
    assert "trace-replay:" not in (tmp_path / "log.txt").read_text()
    code, stderr = _stderr_on_a_terminal(_cli("trace-replay", str(trace), "--carry-eviction", "returns,lrd"),
                                         tmp_path)
    assert code == 0
    # one step for the clairvoyant bound, then one per policy, each named while it runs
    assert "trace-replay: 100%" in stderr and "3/3" in stderr
    frames = [f for f in stderr.replace("\r", "\n").splitlines() if f.startswith("trace-replay:")]
    steps = [(re.search(r" (\d/3) \[", f).group(1), f.rsplit(", ", 1)[1].rstrip("]")) for f in frames if "/s, " in f]
    assert steps == [("0/3", "clairvoyant bound"), ("1/3", "returns"), ("2/3", "lrd"), ("3/3", "lrd")], frames


def test_a_refused_bench_prints_its_one_line_and_nothing_before_it(tmp_path):
    done = subprocess.run(_cli("bench", "--sessions", "1", "--turns", "30", "--history", "60000",
                               "--policies", "carry", "--repeat", "1"),
                          env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == ("trtllm-mtp-carry: error: sessions reach 64946 tokens (history 60074 + turns x "
                           "(--new-span + --max-new-tokens)), past the model's 32768; lower --history, "
                           "--turns, --new-span or --max-new-tokens\n")
