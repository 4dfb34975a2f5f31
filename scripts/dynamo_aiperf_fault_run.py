"""The issue-45 fault run under NVIDIA AIPerf: `serve --dynamo --workers 2` as a user starts it,
AIPerf's multi-turn load with a quarter of the requests cancelled, one worker SIGKILLed mid-run,
then a Ctrl-C stop; and a second, clean start and Ctrl-C stop. Prints what happened as JSON
(counts only, no timing figure).

Needs AIPerf (`--aiperf`: its command, default `aiperf` on PATH; `pip install aiperf==0.13.0`,
its own environment is simplest) and the `dynamo` extra here. Everything binds and talks to
127.0.0.1; every wait is bounded. The deployment's logs are hard-linked into `--out` once it is
ready, so they survive the stop (which removes its work directory).

Reports: AIPerf's summary counts (requests, errors, cancelled; its `profile_export_aiperf.json`);
the worker killed and the launcher's supervision lines; `serve`'s exit status at Ctrl-C; every
listening socket of the deployment's processes; per live worker, `sum mtp_carry_outcomes_total`
against `dynamo_component_requests_total` (generate) and the adopted-row counter against the
runtime's `rows_adopted` (`serve.dynamo.metrics.tally`); the frontend's request counters; the
ERROR lines of each run's logs (Dynamo's known shutdown lines and migration lines apart).

    python scripts/dynamo_aiperf_fault_run.py [--out DIR] [--aiperf PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trtllm_mtp_carry.serve.dynamo.launcher import (  # noqa: E402
    KNOWN_SHUTDOWN_ERRORS,
    SHUTDOWN_MARK,
    _get,
    _strip_ansi,
    free_port,
)
from trtllm_mtp_carry.serve.dynamo.metrics import tally  # noqa: E402
from trtllm_mtp_carry.serve.dynamo.model_dir import write_model_dir  # noqa: E402

READY_LINE = "Ctrl-C stops every process."
MIGRATION_LINE = "Conflicting request tracker write"


class Serve:
    """One `serve --dynamo` process started here, its stdout in `out/serve.log`."""

    def __init__(self, out: Path, workers: int) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.out = out
        self.http_port, self.status_port = free_port(), free_port()
        self.command = [sys.executable, "-m", "trtllm_mtp_carry.cli", "serve", "--dynamo",
                        "--workers", str(workers), "--http-port", str(self.http_port),
                        "--metrics-port", str(self.status_port)]
        self.log = out / "serve.log"
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        self.process = subprocess.Popen(self.command, stdout=self.log.open("wb"), stderr=subprocess.STDOUT,
                                        env=env, cwd=str(ROOT), start_new_session=True)
        self.logs_dir: Path | None = None

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout_s: float) -> float:
        t0 = time.monotonic()
        while READY_LINE not in self.text():
            if self.process.poll() is not None:
                raise SystemExit(f"serve exited {self.process.returncode}:\n{self.text()[-3000:]}")
            if time.monotonic() - t0 > timeout_s:
                self.interrupt(60)
                raise SystemExit(f"serve not ready in {timeout_s} s:\n{self.text()[-3000:]}")
            time.sleep(0.5)
        self.logs_dir = Path(re.search(r"^\s+logs\s+(\S+)", self.text(), re.M).group(1))  # type: ignore[union-attr]
        keep = self.out / "logs"
        keep.mkdir(exist_ok=True)
        for path in self.logs_dir.glob("*.log"):  # hard links outlive the stop's rmtree
            os.link(path, keep / path.name)
        return time.monotonic() - t0

    def workers(self) -> dict[int, tuple[int, str]]:
        """worker index -> (pid, metrics URL), the restarted ones replacing the first."""
        found: dict[int, tuple[int, str]] = {}
        text = self.text()
        for m in re.finditer(r"worker (\d+)  pid (\d+)  metrics (\S+)", text):
            found[int(m.group(1))] = (int(m.group(2)), m.group(3))
        for m in re.finditer(r"worker (\d+) restarted: pid (\d+), metrics (\S+)", text):
            found[int(m.group(1))] = (int(m.group(2)), m.group(3))
        return found

    def pids(self) -> list[int]:
        ps = subprocess.run(["ps", "-o", "pid=", "--ppid", str(self.process.pid)], capture_output=True, text=True)
        return [self.process.pid] + [int(p) for p in ps.stdout.split()]

    def listeners(self) -> list[str]:
        pids = self.pids()
        lines = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout.splitlines()
        name = re.compile(r'users:\(\("([^"]+)')
        return sorted(f"{ln.split()[3]} {m.group(1) if (m := name.search(ln)) else '?'}"
                      for ln in lines if any(f"pid={pid}," in ln for pid in pids))

    def health(self) -> dict:
        return json.loads(_get(f"http://127.0.0.1:{self.status_port}/health", timeout=5)[1])

    def interrupt(self, timeout_s: float) -> int | None:
        """Ctrl-C: SIGINT to `serve` (its children are in their own sessions, as under a terminal
        they are not in the foreground group either); SIGKILL its group past `timeout_s`."""
        self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
            return None

    def error_lines(self) -> dict[str, list[str]]:
        """ERROR lines of every kept log: Dynamo's known shutdown lines (after its shutdown mark),
        its migration lines, and the rest."""
        kinds: dict[str, list[str]] = {"other": [], "known_shutdown": [], "migration": []}
        for path in sorted((self.out / "logs").glob("*.log")) + [self.log]:
            shutting = False
            for line in path.read_text(errors="replace").splitlines():
                plain = _strip_ansi(line)
                shutting = shutting or SHUTDOWN_MARK in plain
                if " ERROR " not in f" {plain} " and "ERROR:" not in plain:
                    continue
                kind = ("known_shutdown" if shutting and any(k in plain for k in KNOWN_SHUTDOWN_ERRORS)
                        else "migration" if MIGRATION_LINE in plain else "other")
                kinds[kind].append(f"{path.name}: {plain[:300]}")
        return kinds


def inflight(url: str) -> tuple[float, float]:
    """(generate requests in flight, generate requests so far) of one worker's /metrics."""
    page = _get(url, timeout=5)[1]
    now = re.search(r'dynamo_component_inflight_requests\{[^}]*dynamo_endpoint="generate"[^}]*\} (\S+)', page)
    return (float(now.group(1)) if now else 0.0), tally(page)[1]["requests"]


def killer(serve: Serve, after: int, deadline_s: float, killed: list[dict]) -> None:
    """SIGKILL the worker with the most requests in flight once `after` requests were routed."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end and serve.process.poll() is None:
        try:
            seen = {i: (pid, *inflight(url)) for i, (pid, url) in serve.workers().items()}
        except OSError:
            time.sleep(0.2)
            continue
        if sum(s[2] for s in seen.values()) >= after:
            index, (pid, now, _) = max(seen.items(), key=lambda kv: kv[1][1])
            if now > 0:
                url = serve.workers()[index][1]
                worker_id, last = tally(_get(url, timeout=5)[1])  # its counters die with it: read them first
                os.kill(pid, signal.SIGKILL)
                killed.append({"worker": index, "pid": pid, "worker_id": worker_id, "in_flight": now,
                               "routed_before": sum(s[2] for s in seen.values()), "its_last_counts": last})
                return
        time.sleep(0.2)


def aiperf_summary(folder: Path) -> dict:
    found = list(folder.rglob("profile_export_aiperf.json"))
    if not found:
        return {"missing": str(folder)}
    data = json.loads(found[0].read_text())
    keep: dict = {"file": str(found[0])}
    for key, value in data.items():
        if isinstance(value, dict) and "avg" in value and re.search(r"count|error|cancel", key):
            keep[key] = value["avg"]
        elif re.search(r"count|error|cancel", key):
            keep[key] = value
    return keep


def routes(out: Path) -> dict[str, dict[str, int]]:
    """The frontend's routed requests by worker id and outcome (its `route request <outcome>`
    lines): what the router started on each worker, a migrated request once per worker."""
    log = _strip_ansi((out / "fault" / "logs" / "frontend.log").read_text(errors="replace"))
    found: dict[str, dict[str, int]] = {}
    for m in re.finditer(r"route request (\w+) .*?worker_id=(\d+)", log):
        per = found.setdefault(m.group(2), {})
        per[m.group(1)] = per.get(m.group(1), 0) + 1
    return found


def migrated(out: Path) -> list[dict]:
    """The requests Dynamo's frontend migrated (its `migration retry scheduled` lines), each with
    what AIPerf recorded for it (output tokens, error)."""
    log = _strip_ansi((out / "fault" / "logs" / "frontend.log").read_text(errors="replace"))
    ids = sorted(set(re.findall(r'migration retry scheduled.*?x_request_id="([0-9a-f-]{36})"', log)))
    records = {}
    for path in (out / "aiperf").rglob("profile_export.jsonl"):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            records[rec["metadata"]["x_request_id"]] = rec
    found = []
    for rid in ids:
        rec = records.get(rid, {})
        usage = rec.get("metrics", {}).get("usage_completion_tokens", {}).get("value")
        found.append({"x_request_id": rid, "completion_tokens": usage, "error": rec.get("error")})
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/aiperf-fault-run"))
    p.add_argument("--aiperf", default="aiperf", help="the aiperf command (default: aiperf on PATH)")
    p.add_argument("--conversations", type=int, default=24)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=6)
    args = p.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = out / "tokenizer"
    if not tokenizer.exists():
        write_model_dir(str(tokenizer), 32768)
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                    "load_average_before": os.getloadavg()}

    # ---- run 1: AIPerf load, a quarter cancelled, one worker SIGKILLed, then Ctrl-C ----
    serve = Serve(out / "fault", 2)
    report["serve_command"] = " ".join(serve.command[1:])
    report["ready_s"] = round(serve.wait_ready(600), 1)
    report["listening_before"] = serve.listeners()
    total = args.conversations * args.turns
    killed: list[dict] = []
    kill_thread = threading.Thread(target=killer, args=(serve, total // 3, 900, killed), daemon=True)
    kill_thread.start()
    aiperf = [args.aiperf, "profile", "-m", "mtp_carry", "--url", f"http://127.0.0.1:{serve.http_port}",
              "--endpoint-type", "chat", "--streaming", "--tokenizer", str(tokenizer),
              "--session-header", "x-dynamo-session-id",
              "--conversation-num", str(args.conversations), "--conversation-turn-mean", str(args.turns),
              "--conversation-turn-stddev", "0",
              "--prompt-input-tokens-mean", "300", "--prompt-input-tokens-stddev", "0",
              "--prompt-output-tokens-mean", "32", "--prompt-output-tokens-stddev", "0",
              "--concurrency", str(args.concurrency),
              "--request-cancellation-rate", "25", "--request-cancellation-delay", "0.05",
              "--random-seed", "45", "--ui-type", "none", "--no-gpu-telemetry",
              "--output-artifact-dir", str(out / "aiperf"), "--no-auto-plot"]
    report["aiperf_command"] = " ".join(aiperf[1:])
    with (out / "aiperf.log").open("wb") as log:
        # no HF_HUB_OFFLINE: with it, AIPerf 0.13 looks a local --tokenizer path up in the hub's
        # cache and fails (HFValidationError); a local path needs no network without it
        env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
        run = subprocess.run(aiperf, stdout=log, stderr=subprocess.STDOUT, timeout=1200, env=env)
    report["aiperf_rc"] = run.returncode
    report["aiperf"] = aiperf_summary(out / "aiperf")
    report["killed"] = killed
    end = time.monotonic() + 180
    while time.monotonic() < end and serve.health().get("status") != "healthy":
        time.sleep(0.5)
    time.sleep(3)  # cancellations reach the workers asynchronously
    report["health_after"] = serve.health()
    report["workers_after"] = {}
    for i, (pid, url) in sorted(serve.workers().items()):
        worker_id, counts = tally(_get(url, timeout=10)[1])
        report["workers_after"][f"worker{i} (pid {pid})"] = {"worker_id": worker_id, **counts}
    front = _get(f"http://127.0.0.1:{serve.http_port}/metrics", timeout=10)[1]
    (out / "frontend-metrics.txt").write_text(front)
    report["frontend_requests"] = [ln for ln in front.splitlines()
                                   if ln.startswith("dynamo_frontend_requests_total")]
    report["listening_after"] = serve.listeners()
    report["load_average_after_load"] = os.getloadavg()
    report["fault_stop_rc"] = serve.interrupt(60)
    report["fault_serve_stdout"] = serve.text().splitlines()
    report["fault_error_lines"] = serve.error_lines()
    report["migrated"] = migrated(out)
    report["frontend_routes_by_worker_id"] = routes(out)

    # ---- run 2: a clean start and a Ctrl-C stop ----
    clean = Serve(out / "clean", 2)
    report["clean_ready_s"] = round(clean.wait_ready(600), 1)
    report["clean_listening"] = clean.listeners()
    time.sleep(3)
    report["clean_stop_rc"] = clean.interrupt(60)
    report["clean_serve_stdout_tail"] = clean.text().splitlines()[-3:]
    report["clean_error_lines"] = clean.error_lines()
    report["load_average_end"] = os.getloadavg()
    text = json.dumps(report, indent=1)
    (out / "report.json").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
