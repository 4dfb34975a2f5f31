"""A short fault run of `serve --dynamo`: multi-turn load, a quarter of the turns cancelled, one
worker SIGKILLed mid-run; prints what the deployment did (no timing figures).

The deployment is the launcher's (`DynamoDeployment`, supervised: a dead worker is restarted;
request migration on), on plain loopback. Load: `--conversations` sessions of `--turns` turns,
`--concurrency` at once, with the package's own OpenAI client; every 4th turn is cancelled by its
client (alternately right after the request is sent and after the first token). Once a third of
the turns are done, the worker with a request in flight is SIGKILLed.

Prints, as JSON: turns sent / completed / failed (with the errors) / cancelled; completed turns
whose stream was cut and finished on another worker (migrated); the supervisor's lines; the
status server's `/health`; per worker, `sum mtp_carry_outcomes_total` versus Dynamo's
`dynamo_component_requests_total` (generate) and the adopted-row counters versus the runtime's
`rows_adopted`; every listening socket's address; the ERROR lines of the logs after the stop.

    python scripts/dynamo_fault_run.py [--conversations 24] [--turns 4] [--concurrency 6]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trtllm_mtp_carry.serve.dynamo.launcher import DynamoDeployment, DynamoSpec, _get, free_port  # noqa: E402
from trtllm_mtp_carry.serve.dynamo.metrics import tally  # noqa: E402
from trtllm_mtp_carry.serve.dynamo.openai_client import SESSION_HEADER, chat, chat_body  # noqa: E402
from trtllm_mtp_carry.serve.options import ServeOptions  # noqa: E402


def hang_up(spec: DynamoSpec, session: str, messages: list, after_first_token: bool) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", spec.http_port, timeout=120)
    conn.request("POST", "/v1/chat/completions", json.dumps(chat_body(spec.name, messages, 200)),
                 {"content-type": "application/json", SESSION_HEADER: session})
    if after_first_token:
        for raw in conn.getresponse():
            if raw.startswith(b"data:") and b'"content"' in raw:
                break
    conn.sock.close()
    conn.close()


def worker_counts(d: DynamoDeployment) -> dict[str, dict[str, float]]:
    return {f"worker{w.index}": tally(_get(w.metrics_url, timeout=10)[1])[1] for w in d.live_workers()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=24)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args()
    events: list[str] = []
    spec = DynamoSpec(workers=2, http_port=free_port(), status_port=0, options=ServeOptions(max_tokens=64))
    d = DynamoDeployment(spec, on_event=events.append)
    total = args.conversations * args.turns
    done_turns = [0]
    lock = threading.Lock()
    killed: list[str] = []
    results: dict[str, list] = {"completed": [], "failed": [], "cancelled": []}

    def conversation(c: int) -> None:
        session = f"fault-{c}"
        messages = [{"role": "user", "content": f"Write a Python function number {c} that sums a list."}]
        for t in range(args.turns):
            n = c * args.turns + t
            if n % 4 == 3:  # a quarter of the turns: the client hangs up
                hang_up(spec, session, messages, after_first_token=bool(n % 8 == 3))
                results["cancelled"].append(n)
                reply_text = ""
            else:
                reply = chat(spec.base_url, spec.name, messages, args.max_tokens, session_id=session)
                if reply.error is None:
                    migrated = reply.carry.get("worker_id") not in (None, reply.worker_id)
                    results["completed"].append({"turn": n, "migrated": migrated})
                else:
                    results["failed"].append({"turn": n, "status": reply.status, "error": reply.error})
                reply_text = reply.text
            messages = messages + [{"role": "assistant", "content": reply_text or "(no answer)"},
                                   {"role": "user", "content": f"Now change it, step {t + 1}."}]
            with lock:
                done_turns[0] += 1
                if done_turns[0] >= total // 3 and not killed:
                    victim = max(d.live_workers(), key=lambda w: _inflight(w))
                    killed.append(f"worker {victim.index} (pid {victim.pid})")
                    victim.process.send_signal(signal.SIGKILL)

    def _inflight(w) -> int:  # noqa: ANN001
        page = _get(w.metrics_url, timeout=5)[1]
        m = re.search(r'dynamo_component_inflight_requests\{[^}]*dynamo_endpoint="generate"[^}]*\} (\d+)', page)
        return int(m.group(1)) if m else 0

    t0 = time.monotonic()
    d.start()
    d.supervise()
    d.wait_ready(600)
    ready_s = time.monotonic() - t0
    pids = [d.frontend.pid, d.broker.pid] + [w.pid for w in d.workers]  # type: ignore[union-attr]
    listeners = sorted({ln.split()[3].rsplit(":", 1)[0]
                        for ln in subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout.splitlines()
                        if any(f"pid={pid}," in ln for pid in pids)})
    with ThreadPoolExecutor(args.concurrency) as pool:
        list(pool.map(conversation, range(args.conversations)))
    deadline = time.monotonic() + 120
    while len(d.live_workers()) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    d.wait_ready(300)
    time.sleep(2)  # cancellations reach the workers asynchronously
    counts = worker_counts(d)
    health = json.loads(_get(f"http://127.0.0.1:{d._status.port}/health")[1])  # type: ignore[union-attr]
    d.stop(remove=False)
    errors = d.error_lines()
    known = [e for e in d.error_lines(include_known=True) if e not in errors]
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.processor() or
        platform.machine(), "cpus": os.cpu_count(), "load_average": os.getloadavg(),
        "turns": total, "completed": len(results["completed"]), "failed": results["failed"],
        "cancelled_by_client": len(results["cancelled"]),
        "migrated_completed": sum(r["migrated"] for r in results["completed"]),
        "killed": killed, "supervisor": events, "health_after": health, "workers": counts,
        "listening_on": listeners, "ready_s": round(ready_s, 1),
        "error_lines_after_stop": errors, "known_dynamo_shutdown_lines": len(known),
    }
    import shutil

    shutil.rmtree(d.workdir, ignore_errors=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
