"""Runs inside the tests' network namespace: one JSON job on stdin, its JSON result on stdout.

Jobs:
- `{"op": "sessions", "base_url", "model", "concurrency", "retries", "sessions": [
   {"id": str|null, "messages": [...], "followups": [str, ...], "max_tokens": n,
    "policy": str|null}]}`: the sessions run concurrently, each one's turns in
   order; a later turn appends the answer and the next user message. A 5xx
   reply is retried up to `retries` times, 0.5 s apart (failover).
   Result: per session, per turn, the reply (and the messages sent).
- `{"op": "post", "base_url", "bodies": [...]}`: raw chat bodies; status and body of each.
- `{"op": "get", "urls": [...]}`: status and body of each.
- `{"op": "disconnect", "base_url", "model", "session", "messages", "max_tokens"}`: a
   streaming turn whose client hangs up after the first chunk with text.
"""

from __future__ import annotations

import http.client
import json
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any
from urllib.parse import urlsplit

from trtllm_mtp_carry.serve.dynamo.openai_client import SESSION_HEADER, chat, chat_body


def _session(job: dict[str, Any], s: dict[str, Any]) -> list[dict[str, Any]]:
    messages = list(s["messages"])
    turns = []
    for t in range(1 + len(s.get("followups", []))):
        for attempt in range(1 + job.get("retries", 0)):
            reply = chat(job["base_url"], job["model"], messages, s.get("max_tokens"),
                         session_id=s.get("id"), policy=s.get("policy"))
            if not (reply.status >= 500 or reply.status == 0) or attempt == job.get("retries", 0):
                break
            time.sleep(0.5)
        turns.append(dict(asdict(reply), messages=list(messages), attempts=attempt + 1))
        if reply.error is not None or t == len(s.get("followups", [])):
            break
        messages += [{"role": "assistant", "content": reply.text},
                     {"role": "user", "content": s["followups"][t]}]
    return turns


def _fetch(url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return {"status": r.status, "body": r.read().decode()}
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "body": exc.read().decode()}


def _disconnect(job: dict[str, Any]) -> dict[str, Any]:
    url = urlsplit(job["base_url"])
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    body = chat_body(job["model"], job["messages"], job["max_tokens"])
    conn.request("POST", url.path + "/chat/completions", json.dumps(body),
                 {"content-type": "application/json", SESSION_HEADER: job["session"]})
    response = conn.getresponse()
    for raw in response:
        if raw.startswith(b"data:") and b'"content"' in raw:
            break
    conn.sock.close()  # hang up mid-stream
    conn.close()
    return {"status": response.status}


def main() -> None:
    job = json.load(sys.stdin)
    if job["op"] == "sessions":
        with ThreadPoolExecutor(job.get("concurrency", 8)) as pool:
            result: Any = list(pool.map(lambda s: _session(job, s), job["sessions"]))
    elif job["op"] == "post":
        result = [_fetch(job["base_url"] + "/chat/completions", body) for body in job["bodies"]]
    elif job["op"] == "disconnect":
        result = _disconnect(job)
    elif job["op"] == "get":
        result = [_fetch(url) for url in job["urls"]]
    else:
        raise SystemExit(f"unknown op {job['op']!r}")
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
