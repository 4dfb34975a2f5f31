"""A streaming `/v1/chat/completions` client for the Dynamo deployment (standard library only).

What it is for: the bench (`bench --openai URL`) and the tests send chat
turns through the OpenAI API exactly as a user would, plus what the carry
needs from Dynamo:

- the `x-dynamo-session-id` header (the router keeps the session on one
  worker; the worker turns it into the session hash);
- `nvext.annotations: ["mtp_carry_policy:<policy>"]` to pick a turn's
  drafter policy (the frontend forwards annotations to the worker);
- `nvext.extra_fields: ["engine_data", "worker_id"]`, so the last chunk
  carries the turn's carry statistics as the worker measured them
  (`nvext.engine_data.mtp_carry`: outcome kind, rows kept/computed, drafts,
  acceptance) and the id of the worker that served it.

Time to first token is the client's: request sent to the first chunk with
text. An error response becomes `ChatReply.error` with the server's message;
nothing raises for it. A streamed reply is a failed turn, never a short
success, when after HTTP 200 the stream carries an error (an SSE `event: error`,
or a `data:` object with `error` and no `choices`: Dynamo's
`{"error": {"message": ..., "code": 503}}` when a worker dies and migration
is off or spent), a `data:` line that is not JSON, or ends without a
`finish_reason` (cut). `ChatReply.status` stays the HTTP status (200).
"""

from __future__ import annotations

import http.client
import json
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

SESSION_HEADER = "x-dynamo-session-id"
POLICY_ANNOTATION = "mtp_carry_policy:"  # the worker's `worker.POLICY_ANNOTATION`


@dataclass
class ChatReply:
    """One chat turn as the client saw it."""

    status: int
    text: str = ""
    finish_reason: str | None = None
    ttft_ms: float | None = None
    total_ms: float = 0.0
    usage: dict[str, Any] = field(default_factory=dict)
    carry: dict[str, Any] = field(default_factory=dict)  # the worker's TurnStats of this turn
    worker_id: int | None = None
    error: str | None = None


def chat_body(model: str, messages: list[dict[str, Any]], max_tokens: int | None,
              policy: str | None = None, cache_salt: str | None = None,
              stream: bool = True) -> dict[str, Any]:
    """The request body: the chat, plus the nvext fields the carry reads and reports."""
    body: dict[str, Any] = {"model": model, "messages": messages, "stream": stream,
                            "nvext": {"extra_fields": ["engine_data", "worker_id"]}}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if stream:
        body["stream_options"] = {"include_usage": True}
    if policy is not None:
        body["nvext"]["annotations"] = [POLICY_ANNOTATION + policy]
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return body


def chat(base_url: str, model: str, messages: list[dict[str, Any]], max_tokens: int | None = None,
         session_id: str | None = None, policy: str | None = None, cache_salt: str | None = None,
         stream: bool = True, timeout_s: float = 600.0) -> ChatReply:
    """Send one chat turn to `base_url` (".../v1") and read the whole answer."""
    url = urlsplit(base_url)
    if url.scheme != "http" or not url.hostname:
        raise ValueError(f"base URL must look like http://HOST:PORT/v1, got {base_url!r}")
    headers = {"content-type": "application/json"}
    if session_id is not None:
        headers[SESSION_HEADER] = session_id
    payload = json.dumps(chat_body(model, messages, max_tokens, policy, cache_salt, stream))
    conn = http.client.HTTPConnection(url.hostname, url.port or 80, timeout=timeout_s)
    t0 = time.perf_counter()
    try:
        conn.request("POST", url.path.rstrip("/") + "/chat/completions", payload, headers)
        response = conn.getresponse()
        reply = ChatReply(response.status)
        if response.status != 200:
            reply.error = _error_message(response.read())
        elif stream:
            _read_stream(response, reply, t0)
        else:
            _read_whole(json.loads(response.read()), reply)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        reply = ChatReply(0, error=f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()
    reply.total_ms = (time.perf_counter() - t0) * 1e3
    return reply


def _error_message(raw: bytes) -> str:
    text = raw.decode("utf-8", "replace")
    try:
        body = json.loads(text)
    except ValueError:
        return text.strip() or "empty error response"
    error = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error)


def _nvext(reply: ChatReply, chunk: dict[str, Any]) -> None:
    nvext = chunk.get("nvext") or {}
    carry = (nvext.get("engine_data") or {}).get("mtp_carry")
    if isinstance(carry, dict):
        reply.carry = carry
    worker = nvext.get("worker_id")
    if isinstance(worker, dict) and worker.get("decode_worker_id") is not None:
        reply.worker_id = int(worker["decode_worker_id"])


def _read_stream(response: http.client.HTTPResponse, reply: ChatReply, t0: float) -> None:
    parts: list[str] = []
    event = ""  # the SSE event type of the lines being read ("" until an `event:` line)
    for raw in response:
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if not line:  # a blank line ends an SSE event
            event = ""
            continue
        if line.startswith("event:"):
            event = line[6:].strip()
            continue
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        try:
            chunk = json.loads(data)
        except ValueError:
            chunk = None
        if event == "error" or not isinstance(chunk, dict) or "choices" not in chunk:
            reply.error = f"stream error after HTTP {reply.status}: {_error_message(data.encode())}"
            break
        _nvext(reply, chunk)
        if chunk.get("usage"):
            reply.usage = chunk["usage"]
        for choice in chunk["choices"]:
            content = (choice.get("delta") or {}).get("content")
            if content:
                if reply.ttft_ms is None:
                    reply.ttft_ms = (time.perf_counter() - t0) * 1e3
                parts.append(content)
            if choice.get("finish_reason"):
                reply.finish_reason = choice["finish_reason"]
    reply.text = "".join(parts)
    if reply.error is None and reply.finish_reason is None:
        reply.error = (f"stream after HTTP {reply.status} ended without a finish_reason "
                       f"(cut after {len(reply.text)} characters)")


def _read_whole(body: dict[str, Any], reply: ChatReply) -> None:
    _nvext(reply, body)
    reply.usage = body.get("usage") or {}
    choice = (body.get("choices") or [{}])[0]
    reply.text = (choice.get("message") or {}).get("content") or ""
    reply.finish_reason = choice.get("finish_reason")
