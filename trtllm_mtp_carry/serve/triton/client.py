"""A small gRPC streaming client for the served model (one stream, many sessions).

What it is for: the bench's Triton driver and the tests talk to the server
through `StreamClient` (and check it with `server_unreachable` and
`model_ready`): `send` queues one turn of a session on the stream, `wait`
collects that turn's streamed responses until the final one and returns a
`TurnReply` (output, statistics, client-side time to first token) or the
server's error message. Several turns of different sessions may be in flight
on the one stream; replies are matched by request id. tritonclient hands a
stream error over without its request id, so an error reaches every turn
then waiting: send a turn that may be refused on its own.
"""

from __future__ import annotations

import itertools
import json
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TurnReply:
    """One turn as the client saw it; `error` is the server's message for a refused turn."""

    output: list[int] = field(default_factory=list)
    text: str = ""
    stats: dict[str, Any] = field(default_factory=dict)  # the final response's outputs
    instance: str = ""
    ttft_ms: float | None = None  # send to the first response with tokens, client-side
    total_ms: float = 0.0
    responses: int = 0
    error: str | None = None


class StreamClient:
    """tritonclient's gRPC stream to `url` ("host:port") for model `model`; a context manager."""

    def __init__(self, url: str, model: str = "mtp_carry") -> None:
        try:
            import tritonclient.grpc as grpcclient
        except ImportError:
            raise RuntimeError('tritonclient is not installed; pip install -e ".[serve]"') from None
        self._grpc = grpcclient
        self.model = model
        self.client = grpcclient.InferenceServerClient(url)
        self._queues: dict[str, queue.Queue[tuple[Any, Any, float]]] = {}
        self._sent_at: dict[str, float] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.client.start_stream(callback=self._on_response)

    def _on_response(self, result: Any, error: Any) -> None:
        now = time.perf_counter()
        with self._lock:
            if result is not None:
                targets = [q for q in [self._queues.get(result.get_response().id)] if q is not None]
            else:  # tritonclient drops the request id of an error: every waiting turn sees it
                targets = list(self._queues.values())
        for q in targets:
            q.put((result, error, now))

    def send(self, corrid: int | str, *, start: bool = False, end: bool = False, text: str | None = None,
             input_ids: list[int] | None = None, max_tokens: int | None = None,
             policy: str | None = None, cache_salt: str | None = None,
             raw_inputs: list[Any] | None = None, timeout_us: int | None = None) -> str:
        """Queue one turn of session `corrid`; returns its request id for `wait`.

        `cache_salt` puts the turn in that prefix-cache namespace on the server.
        `timeout_us` bounds the server-side wait of a START that finds every
        session slot taken (Triton then refuses it). A str `corrid` is sent as
        a string sequence id (the served model refuses it).

        `raw_inputs` replaces the inputs built from the other arguments (tests
        use it to send malformed requests)."""
        import numpy as np

        g = self._grpc
        inputs = raw_inputs if raw_inputs is not None else []
        if raw_inputs is None:
            if text is not None:
                inputs.append(bytes_input(g, "text_input", text))
            if input_ids is not None:
                i = g.InferInput("input_ids", [len(input_ids)], "INT64")
                i.set_data_from_numpy(np.asarray(input_ids, dtype=np.int64))
                inputs.append(i)
            if max_tokens is not None:
                m = g.InferInput("max_tokens", [1], "INT32")
                m.set_data_from_numpy(np.asarray([max_tokens], dtype=np.int32))
                inputs.append(m)
            if policy is not None:
                inputs.append(bytes_input(g, "drafter_policy", policy))
            if cache_salt is not None:
                inputs.append(bytes_input(g, "cache_salt", cache_salt))
        rid = f"{corrid}-{next(self._ids)}"
        with self._lock:
            self._queues[rid] = queue.Queue()
            self._sent_at[rid] = time.perf_counter()
        self.client.async_stream_infer(self.model, inputs, request_id=rid, sequence_id=corrid,
                                       sequence_start=start, sequence_end=end,
                                       enable_empty_final_response=True, timeout=timeout_us)
        return rid

    def wait(self, rid: str, timeout_s: float = 300.0) -> TurnReply:
        """Collect turn `rid` until its final response (or its error)."""
        reply = TurnReply()
        q = self._queues[rid]
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    result, error, at = q.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise TimeoutError(f"no final response for request {rid} in {timeout_s} s") from None
                if error is not None:
                    reply.error = error.message() if hasattr(error, "message") else str(error)
                    return reply
                reply.responses += 1
                ids = result.as_numpy("output_ids")
                if ids is not None and ids.size:
                    if reply.ttft_ms is None:
                        reply.ttft_ms = (at - self._sent_at[rid]) * 1e3
                    reply.output += [int(t) for t in ids.tolist()]
                text = result.as_numpy("text_output")
                if text is not None and text.size:
                    reply.text += text.reshape(-1)[0].decode("utf-8")
                if result.get_response().parameters["triton_final_response"].bool_param:
                    reply.total_ms = (at - self._sent_at[rid]) * 1e3
                    _final_stats(result, reply)
                    return reply
        finally:
            with self._lock:
                self._queues.pop(rid, None)
                self._sent_at.pop(rid, None)

    def turn(self, corrid: int | str, **kwargs: Any) -> TurnReply:
        """`send` then `wait`."""
        return self.wait(self.send(corrid, **kwargs))

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()

    def __enter__(self) -> StreamClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def server_unreachable(url: str, timeout_s: float = 10.0) -> str | None:
    """None when a Triton server answers at `url` ("host:port", gRPC), else the first line
    of the client's error; ImportError when tritonclient is not installed."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(url)
    try:
        client.is_server_live(client_timeout=timeout_s)
    except InferenceServerException as exc:
        return str((exc.message() or str(exc)).strip().splitlines()[0])
    finally:
        client.close()
    return None


def model_ready(url: str, model: str, timeout_s: float = 10.0) -> bool:
    """Whether the Triton server at `url` reports `model` ready (False when it cannot say);
    ImportError when tritonclient is not installed."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(url)
    try:
        return bool(client.is_model_ready(model, client_timeout=timeout_s))
    except InferenceServerException:
        return False
    finally:
        client.close()


def bytes_input(g: Any, name: str, value: str) -> Any:
    """A BYTES input of shape [1] holding `value` (UTF-8)."""
    import numpy as np

    i = g.InferInput(name, [1], "BYTES")
    i.set_data_from_numpy(np.asarray([value.encode("utf-8")], dtype=np.object_))
    return i


def _final_stats(result: Any, reply: TurnReply) -> None:
    def one(name: str) -> Any:
        a = result.as_numpy(name)
        return None if a is None or not a.size else a.reshape(-1)[0]

    outcome, instance, stats = one("carry_outcome"), one("model_instance"), one("turn_stats")
    if stats is not None:
        reply.stats.update(json.loads(stats.decode()))
    if outcome is not None:
        reply.stats["outcome_kind"] = outcome.decode()
    for name in ("drafter_rows_computed", "drafted", "accepted"):
        value = one(name)
        if value is not None:
            reply.stats[name] = int(value)
    ttft = one("ttft_ms")
    if ttft is not None:
        reply.stats["server_ttft_ms"] = float(ttft)
    reply.instance = instance.decode() if instance is not None else ""
