"""The Triton Python-backend model: requests in, streamed responses out.

What it is for: `TritonPythonModel` is what the generated `model.py`
exports. `initialize` validates the `parameters` (a bad value fails the load
with a message naming it), builds the engine the `engine` parameter names and
starts the `SessionServer` that owns it; `execute` only parses requests and
queues them (the transaction policy is decoupled), so several sessions run
through one engine concurrently; `finalize` stops the stepping thread.

Request contract (names follow TensorRT-LLM's Triton models):
- control: `CORRID` (uint64, the session), `START`, `END`; a string sequence
  id is refused (Triton would hand over its first 8 serialized bytes, so
  `"user-1"` and `"user-2"` would share one session);
- `text_input` (the new user message) or `input_ids` (the full prompt),
  `max_tokens` (int32), optional `drafter_policy`, optional `cache_salt`
  (BYTES: the request reuses only prefix-cache blocks of its own salt);
- streamed `text_output`, `output_ids`; with the final response
  `carry_outcome`, `drafter_rows_computed`, `drafted`, `accepted`,
  `ttft_ms`, `model_instance` (which instance served the turn) and
  `turn_stats` (JSON of every field of the turn's statistics).

Timers: the sequence batcher's `max_sequence_idle_microseconds` is the
session idle timeout plus the `max_turn_s` parameter (`repo.render_config`):
Triton's timer starts when a request arrives, this model's idle timer when
its turn finishes, and a turn is cancelled at `max_turn_s`, so Triton never
ends a sequence whose turn is running or has been idle less than the timeout.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from ..options import ServeOptions
from ..session_server import RequestError, SessionServer, TurnRequest

logger = logging.getLogger("trtllm_mtp_carry.serve")


def _scalar(request: Any, pb_utils: Any, name: str) -> Any:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    array = tensor.as_numpy().reshape(-1)
    if array.size != 1:
        raise ValueError(f"{name} must hold exactly one value, got {array.size}")
    return array[0]


def _text(request: Any, pb_utils: Any, name: str) -> str | None:
    value = _scalar(request, pb_utils, name)
    if value is None:
        return None
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{name} is not valid UTF-8") from None
    return str(value)


def _salt(request: Any, pb_utils: Any) -> bytes | str | None:
    # raw bytes: a salt is opaque, and a str salt equals its UTF-8 bytes anyway
    value = _scalar(request, pb_utils, "cache_salt")
    return value if value is None or isinstance(value, bytes) else str(value)


def parse_request(request: Any, pb_utils: Any) -> TurnRequest:
    """A TurnRequest from one Triton request; RequestError (a ValueError) naming a
    malformed input."""
    sequence_id = request.correlation_id()  # the client's id as sent: an int, or a str
    if isinstance(sequence_id, str):
        raise RequestError(f"sequence id {sequence_id!r} is a string; this model's sessions are "
                           "unsigned 64-bit integers (CORRID UINT64): send an integer sequence_id",
                           "string_corrid")
    corrid = _scalar(request, pb_utils, "CORRID")
    if corrid is None:
        raise RequestError("request has no CORRID (send a sequence id)")
    ids_tensor = pb_utils.get_input_tensor_by_name(request, "input_ids")
    max_tokens = _scalar(request, pb_utils, "max_tokens")
    start, end = _scalar(request, pb_utils, "START"), _scalar(request, pb_utils, "END")
    return TurnRequest(
        corrid=int(corrid),
        start=bool(start) if start is not None else False,
        end=bool(end) if end is not None else False,
        text_input=_text(request, pb_utils, "text_input"),
        input_ids=None if ids_tensor is None else [int(i) for i in ids_tensor.as_numpy().reshape(-1).tolist()],
        max_tokens=None if max_tokens is None else int(max_tokens),
        drafter_policy=_text(request, pb_utils, "drafter_policy"),
        cache_salt=_salt(request, pb_utils),
    )


class TritonSink:
    """One request's response sender; the final response carries the turn's statistics.

    Public so that another engine's Triton model (TensorRT-LLM's) reuses it:
    `pb` (triton_python_backend_utils), `instance` (the model instance's name),
    `stream_tensors(ids, text)` (the streamed `output_ids`/`text_output`
    tensors), `scalar(name, value, dtype)` (one statistic as a one-element
    tensor), `closing_tensors(stats)` (`model_instance` and `turn_stats`, the
    last two tensors of every final response) and `send_final(tensors)` (the
    request's last response, with the COMPLETE_FINAL flag); a subclass
    overrides `final` to send its own statistics, once, through `send_final`.
    """

    def __init__(self, pb_utils: Any, request: Any, instance: str) -> None:
        self.pb = pb_utils
        self._request = request
        self._sender = request.get_response_sender()
        self.instance = instance

    def stream_tensors(self, ids: list[int], text: str) -> list[Any]:
        import numpy as np

        return [self.pb.Tensor("output_ids", np.asarray(ids, dtype=np.int64)),
                self.pb.Tensor("text_output", np.asarray([text.encode("utf-8")], dtype=np.object_))]

    def scalar(self, name: str, value: str | int | float, dtype: str) -> Any:
        """Output tensor `name` holding one `value` as `dtype` (a str as its UTF-8 bytes, dtype "object")."""
        import numpy as np

        return self.pb.Tensor(name, np.asarray([value.encode() if isinstance(value, str) else value], dtype=dtype))

    def closing_tensors(self, stats: dict[str, Any]) -> list[Any]:
        """`model_instance` (this instance's name) and `turn_stats` (`stats` as JSON)."""
        return [self.scalar("model_instance", self.instance, "object"),
                self.scalar("turn_stats", json.dumps(stats), "object")]

    def partial(self, ids: list[int], text: str) -> None:
        self._sender.send(self.pb.InferenceResponse(output_tensors=self.stream_tensors(ids, text)))

    def final(self, ids: list[int], text: str, result: Any) -> None:
        s = result.stats
        tensors = self.stream_tensors(ids, text) + [
            self.scalar("carry_outcome", s.outcome_kind, "object"),
            self.scalar("drafter_rows_computed", s.drafter_rows_computed, "int32"),
            self.scalar("drafted", s.drafted, "int32"),
            self.scalar("accepted", s.accepted, "int32"),
            self.scalar("ttft_ms", s.ttft_ms, "float32"),
        ] + self.closing_tensors(s.as_dict())
        self.send_final(tensors)

    def send_final(self, tensors: list[Any]) -> None:
        """Send the request's last response: `tensors`, with the COMPLETE_FINAL flag."""
        self._sender.send(self.pb.InferenceResponse(output_tensors=tensors),
                          flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def error(self, message: str) -> None:
        self._sender.send(self.pb.InferenceResponse(error=self.pb.TritonError(message)),
                          flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def cancelled(self) -> bool:
        return bool(self._request.is_cancelled())


class TritonPythonModel:
    """One model instance: its own engine, carry runtime, metrics and stepping thread."""

    def initialize(self, args: dict[str, str]) -> None:
        import triton_python_backend_utils as pb_utils

        from ...metrics import CarryMetrics
        from ..engines import build_engine

        self._pb = pb_utils
        config = json.loads(args["model_config"])
        options = ServeOptions.from_parameters(config.get("parameters", {}))
        idle_us = config.get("sequence_batching", {}).get("max_sequence_idle_microseconds")
        # the session's own idle timeout: Triton's minus the turn allowance (module header)
        idle_s = int(idle_us) / 1e6 - options.max_turn_s if idle_us else None
        if idle_s is not None and idle_s <= 0:
            raise ValueError(f"sequence_batching max_sequence_idle_microseconds={idle_us} must exceed "
                             f"the max_turn_s parameter ({options.max_turn_s} s): the session idle "
                             "timeout is their difference")
        self._instance = args["model_instance_name"]
        engine = build_engine(options)
        metrics = CarryMetrics(pb_utils, args["model_name"], self._instance)
        metrics.refresh(engine.runtime.stats())

        def on_turn(result: Any) -> None:
            metrics.record_turn(result.stats)
            metrics.refresh(engine.runtime.stats())

        def on_forget(cause: str, rows: int) -> None:
            metrics.record_session_end(cause, rows)
            metrics.refresh(engine.runtime.stats())

        self._server = SessionServer(engine, options, idle_s, on_turn=on_turn, on_forget=on_forget,
                                     on_error=metrics.record_error, on_unadmitted=metrics.record_unadmitted)
        self._server.start()
        logger.info("%s ready: %s", self._instance, options)

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            sink = TritonSink(self._pb, request, self._instance)
            try:
                turn = parse_request(request, self._pb)
            except ValueError as exc:
                self._server.refuse(sink, exc)
                continue
            self._server.enqueue(turn, sink)
        return None

    def finalize(self) -> None:
        self._server.stop()
