"""Runs inside the tests' network namespace: a session across a SIGKILL and a SIGTERM of its worker.

Two workers behind the frontend (kv router, hard session affinity, set explicitly: the default is soft). One
session's turns: 2 turns on its worker A; SIGKILL A; turn 3 (retried on 5xx)
and turn 4 on worker B; a third worker C joins; SIGTERM B; turns 5 and 6 on C.
Prints every turn's reply (and the messages sent) and the worker of each step as JSON.
"""

from __future__ import annotations

import json
import re
import signal
import sys
import time
import urllib.request
from dataclasses import asdict

from trtllm_mtp_carry.serve.dynamo.launcher import DynamoDeployment, DynamoSpec
from trtllm_mtp_carry.serve.dynamo.openai_client import chat
from trtllm_mtp_carry.serve.options import ServeOptions


def worker_ids(deployment: DynamoDeployment) -> dict[int, int]:
    """Dynamo worker id -> the deployment's worker index, from each live worker's metrics."""
    ids = {}
    for w in deployment.live_workers():
        with urllib.request.urlopen(w.metrics_url, timeout=10) as r:
            found = re.search(r'worker_id="([0-9a-f]+)"', r.read().decode())
        if found:
            ids[int(found.group(1), 16)] = w.index
    return ids


def main() -> None:
    job = json.load(sys.stdin)
    spec = DynamoSpec(workers=2, http_port=8000, affinity_mode="hard",
                      options=ServeOptions(max_tokens=job["max_tokens"]))
    messages = list(job["messages"])
    followups = list(job["followups"])
    turns: list[dict] = []
    events: list[str] = []

    def turn() -> dict:
        attempts = 0
        failures = []
        while True:  # a 5xx after the SIGKILL is retried, 0.5 s apart, up to 40 attempts
            attempts += 1
            reply = chat(spec.base_url, spec.name, messages, job["max_tokens"], session_id="failover-1")
            if (reply.status == 200 and reply.error is None) or attempts == 40:
                break
            failures.append(f"{reply.status}: {reply.error}")
            time.sleep(0.5)
        record = dict(asdict(reply), messages=list(messages), attempts=attempts, failures=failures,
                      worker_index=worker_ids(deployment).get(reply.worker_id or -1))
        turns.append(record)
        if followups:
            messages.extend([{"role": "assistant", "content": reply.text},
                             {"role": "user", "content": followups.pop(0)}])
        return record

    with DynamoDeployment(spec) as deployment:
        turn()
        a = turn()["worker_index"]
        deployment.signal_worker(a, signal.SIGKILL)
        events.append(f"SIGKILL worker {a}")
        turn()
        b = turn()["worker_index"]
        c = deployment.add_worker().index
        deployment.wait_ready()
        events.append(f"worker {c} joined")
        deployment.signal_worker(b, signal.SIGTERM)
        deployment.workers[b].process.wait(30)
        events.append(f"SIGTERM worker {b}")
        turn()
        turn()
    json.dump({"turns": turns, "events": events, "workers": [a, b, c]}, sys.stdout)


if __name__ == "__main__":
    main()
