"""`trtllm-mtp-carry serve`: starts the real server, serves, and stops it all on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

from conftest import free_ports, tritonserver_or_skip

from trtllm_mtp_carry.engine.tokenizer import ChatTokenizer
from trtllm_mtp_carry.serve.triton.client import StreamClient


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


def test_serve_prints_the_endpoints_serves_and_stops_the_server_on_sigterm(tmp_path):
    tritonserver_or_skip()
    http, grpc, metrics = free_ports(3)
    cmd = [sys.executable, "-m", "trtllm_mtp_carry.cli", "serve", "--http-port", str(http),
           "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--max-tokens", "6"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONPATH=os.getcwd() + ":" + os.environ.get("PYTHONPATH", "")))
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "Ctrl-C stops the server" in line:
                break
        text = "".join(lines)
        assert f"gRPC    127.0.0.1:{grpc}" in text and f"HTTP    127.0.0.1:{http}" in text, text
        assert f"metrics http://127.0.0.1:{metrics}/metrics" in text
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/models/mtp_carry/ready", timeout=10) as r:
            assert r.status == 200
        tok = ChatTokenizer()
        with StreamClient(f"127.0.0.1:{grpc}") as client:
            reply = client.turn(1, start=True, end=True, input_ids=tok.render_chat([{"role": "user", "content": "hi"}]))
        assert reply.error is None and len(reply.output) == 6
        assert len(processes_with(f"--grpc-port={grpc}")) == 1
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=90)
        assert proc.returncode == 0, rest
        assert "server stopped" in rest
        deadline = time.monotonic() + 10
        while processes_with(f"--grpc-port={grpc}") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert processes_with(f"--grpc-port={grpc}") == []
    finally:
        if proc.poll() is None:  # the test failed midway: let serve stop its server first
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pid in processes_with(f"--grpc-port={grpc}"):  # the server this test started, if left
            os.kill(pid, signal.SIGKILL)
