"""`trtllm-mtp-carry serve`: starts the real server, serves, survives its clients, and stops it all.

Each test runs `serve` as a user would (a subprocess with one instance):
a client that dies while its answer streams, then SIGTERM (serve stops in a
few seconds and leaves no process and no shared-memory region behind); a
backend stub killed with requests in flight (every client gets an error and
serve says which instance died); and the one-line errors of a bad start.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from serve_helpers import free_ports, metric, tritonserver_or_skip, wait_for
from terminal import Terminal

from trtllm_mtp_carry import OUTCOME_KINDS
from trtllm_mtp_carry.cli import main
from trtllm_mtp_carry.engine.tokenizer import ChatTokenizer
from trtllm_mtp_carry.serve.triton.client import StreamClient
from trtllm_mtp_carry.serve.triton.server import STUB

TOK = ChatTokenizer()
# the tiny model answers this with nonsense that runs to max_tokens (no end of turn)
LONG = TOK.render_chat([{"role": "user", "content": "Show me a function that adds two numbers."}])


def processes_with(needle: str) -> list[int]:
    """Pids whose command line holds `needle` (read from /proc)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    args = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if needle in args:
                pids.append(int(entry))
    return pids


def stub_regions(grpc: int) -> list[str]:
    """The shared-memory regions of the stubs of the server on `grpc` (from their argv)."""
    regions = []
    for pid in processes_with(f"--grpc-port={grpc}"):
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        pgid = int(f.read().rsplit(")", 1)[1].split()[2])
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        argv = f.read().decode(errors="replace").split("\0")
                except (OSError, ValueError, IndexError):
                    continue
                if pgid == pid and Path(argv[0]).name == STUB:
                    regions.append(argv[2])
    return regions


class Serve:
    """`trtllm-mtp-carry serve` in a subprocess on free loopback ports, always stopped."""

    def __init__(self, tmp_path: Path, *flags: str, stderr: int | None = None) -> None:
        tritonserver_or_skip()
        self.http, self.grpc, self.metrics_port = free_ports(3)
        self.log = tmp_path / "serve.log"
        cmd = [sys.executable, "-m", "trtllm_mtp_carry.cli", "serve", "--http-port", str(self.http),
               "--grpc-port", str(self.grpc), "--metrics-port", str(self.metrics_port),
               "--log-file", str(self.log), *flags]
        env = dict(os.environ, PYTHONPATH=os.getcwd() + ":" + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env,
                                     stderr=subprocess.STDOUT if stderr is None else stderr)
        self.banner = ""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.banner += line
            if "Ctrl-C stops the server" in line or "error:" in line:
                break
        assert "Ctrl-C stops the server" in self.banner, self.banner

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            return str(r.read().decode())

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/v2/health/ready", timeout=5) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def close(self) -> None:
        if self.proc.poll() is None:  # the test failed midway: let serve stop its server first
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in processes_with(f"--grpc-port={self.grpc}"):  # the server this test started, if left
            os.kill(pid, signal.SIGKILL)


CLIENT_THAT_DIES = """
import sys, time
import numpy as np
import tritonclient.grpc as g
ids = [int(t) for t in sys.argv[2].split(",")]
client = g.InferenceServerClient(sys.argv[1])
client.start_stream(callback=lambda result, error: print("streaming", flush=True))
i = g.InferInput("input_ids", [len(ids)], "INT64")
i.set_data_from_numpy(np.asarray(ids, dtype=np.int64))
m = g.InferInput("max_tokens", [1], "INT32")
m.set_data_from_numpy(np.asarray([400], dtype=np.int32))
client.async_stream_infer("mtp_carry", [i, m], sequence_id=77, sequence_start=True)
time.sleep(120)
"""


def test_serve_survives_a_client_dying_mid_stream_and_stops_in_seconds_leaving_nothing(tmp_path):
    serve = Serve(tmp_path, "--max-tokens", "6")
    try:
        text = serve.banner
        assert f"gRPC    127.0.0.1:{serve.grpc}" in text and f"HTTP    127.0.0.1:{serve.http}" in text, text
        assert f"metrics http://127.0.0.1:{serve.metrics_port}/metrics" in text
        assert f"log     {serve.log}" in text
        with urllib.request.urlopen(f"http://127.0.0.1:{serve.http}/v2/models/mtp_carry/ready", timeout=10) as r:
            assert r.status == 200
        assert len(processes_with(f"--grpc-port={serve.grpc}")) == 1
        # a client that dies (SIGKILL) while its answer streams: its open session stays open
        child = subprocess.Popen([sys.executable, "-c", CLIENT_THAT_DIES, f"127.0.0.1:{serve.grpc}",
                                  ",".join(map(str, LONG))], stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None and child.stdout.readline().strip() == "streaming"
        child.kill()
        child.wait()
        assert wait_for(lambda: metric(serve.metrics(), "mtp_carry_errors_total", reason="cancelled") == 1, 20)
        with StreamClient(f"127.0.0.1:{serve.grpc}") as client:
            reply = client.turn(1, start=True, end=True, input_ids=TOK.render_chat([{"role": "user", "content": "hi"}]))
        assert reply.error is None and len(reply.output) == 6
        # the cancelled turn was admitted: its outcome counts once, in both families alike
        page = serve.metrics()
        assert metric(page, "mtp_carry_outcomes_total") == 2
        assert {k: metric(page, "mtp_carry_outcomes_total", kind=k) for k in OUTCOME_KINDS} == {
            k: metric(page, "mtp_carry_runtime", field=f"outcomes.{k}") for k in OUTCOME_KINDS}
        regions = stub_regions(serve.grpc)
        assert len(regions) == 1 and os.path.exists(f"/dev/shm/{regions[0]}")
        t0 = time.monotonic()
        serve.proc.send_signal(signal.SIGTERM)
        rest, _ = serve.proc.communicate(timeout=60)
        stopped_s = time.monotonic() - t0
        assert serve.proc.returncode == 0, rest
        assert f"server stopped (log: {serve.log})" in rest and "killed" not in rest, rest
        assert stopped_s < 10, stopped_s  # the exit timeout (3 s) bounds it; it took 20-22 s
        assert wait_for(lambda: processes_with(f"--grpc-port={serve.grpc}") == [], 10)
        assert [r for r in regions if os.path.exists(f"/dev/shm/{r}")] == []
        assert serve.log.is_file() and "Signal (15) received" in serve.log.read_text()
    finally:
        serve.close()


def test_serve_shows_a_bar_while_the_server_starts_on_a_terminal_and_none_into_a_pipe(tmp_path):
    piped = Serve(tmp_path, "--max-tokens", "6")  # stderr into the stdout pipe
    try:
        assert "waiting for tritonserver" not in piped.banner, piped.banner
    finally:
        piped.close()
    terminal = Terminal()
    on_terminal = Serve(tmp_path, "--max-tokens", "6", stderr=terminal.fd)
    try:
        assert "waiting for tritonserver" not in on_terminal.banner  # the bar is on stderr only
    finally:
        on_terminal.close()
        seen = terminal.close()
    assert "waiting for tritonserver" in seen


def test_a_killed_backend_stub_fails_its_clients_and_serve_says_which_instance_died(tmp_path):
    serve = Serve(tmp_path, "--max-tokens", "6")
    try:
        regions = stub_regions(serve.grpc)
        stubs = [pid for pid in processes_with(STUB) if any(r in open(f"/proc/{pid}/cmdline").read()
                                                           for r in regions)]
        assert len(stubs) == 1
        with StreamClient(f"127.0.0.1:{serve.grpc}") as client:
            rids = [client.send(100 + i, start=True, input_ids=LONG, max_tokens=400) for i in range(3)]
            time.sleep(0.5)
            os.kill(stubs[0], signal.SIGKILL)
            replies = [client.wait(rid, timeout_s=30) for rid in rids]  # never hangs: every one fails
        assert all(r.error is not None for r in replies), [r.error for r in replies]
        rest, _ = serve.proc.communicate(timeout=60)
        assert serve.proc.returncode == 2, rest
        died = [line for line in rest.splitlines() if "died" in line]
        assert len(died) == 1 and died[0].startswith("trtllm-mtp-carry: error: model instance mtp_carry_0_0 died")
        assert "restart serve to recover" in died[0]
        assert not serve.ready()
        assert wait_for(lambda: processes_with(f"--grpc-port={serve.grpc}") == [], 10)
        assert [r for r in regions if os.path.exists(f"/dev/shm/{r}")] == []
    finally:
        serve.close()


def test_serve_of_a_missing_repository_is_one_error_line(tmp_path, capsys):
    tritonserver_or_skip()
    assert main(["serve", "--repository", str(tmp_path / "missing")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"trtllm-mtp-carry: error: --repository {tmp_path / 'missing'}: no such directory\n"


def test_a_model_that_fails_to_load_is_one_error_line_naming_the_cause_and_the_kept_log(tmp_path, capsys):
    tritonserver_or_skip()
    assert main(["triton-repo", str(tmp_path / "repo")]) == 0
    config = tmp_path / "repo" / "mtp_carry" / "config.pbtxt"
    config.write_text(config.read_text().replace('key: "draft_len" value { string_value: "2" }',
                                                 'key: "draft_len" value { string_value: "nine" }'))
    capsys.readouterr()
    http, grpc, metrics = free_ports(3)
    log = tmp_path / "triton.log"
    assert main(["serve", "--repository", str(tmp_path / "repo"), "--http-port", str(http), "--grpc-port",
                 str(grpc), "--metrics-port", str(metrics), "--log-file", str(log)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, err
    assert err.startswith("trtllm-mtp-carry: error: tritonserver exited before its models were ready: ")
    assert "parameter draft_len must be an integer, got 'nine'" in err
    assert err.endswith(f"(log: {log})\n") and log.is_file()


@pytest.mark.parametrize("argv", [["bench", "--sessions", "1", "--turns", "1", "--repeat", "1"],
                                  ["serve", "--repository", "/nonexistent"], ["info"]])
def test_a_malformed_settings_variable_is_the_only_line_printed(monkeypatch, capsys, argv):
    monkeypatch.setenv("TRTLLM_MTP_CARRY_SLOTS", "abc")
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == "trtllm-mtp-carry: error: environment variable TRTLLM_MTP_CARRY_SLOTS='abc' is not a non-negative integer\n"
