"""The Triton Python-backend model that serves TensorRT-LLM with the carry (`triton-repo --engine trtllm`).

What it is for: `TritonPythonModel` is what the generated `model.py` of a
`--engine trtllm` repository exports. It runs TensorRT-LLM the way
TensorRT-LLM's own Triton `llmapi` model does (`triton_backend/all_models/
llmapi/tensorrt_llm/1/model.py`): the YAML options become `LLM(**options)`
keywords (through TensorRT-LLM's `update_llm_args_with_extra_dict`), the LLM
is built in an executor of an asyncio loop that runs in its own thread, and
every request is a coroutine on that loop streaming `generate_async`. What it
adds: `TLLM_WORKER_USE_SINGLE_PROCESS=1` is set before the LLM is built (the
adapter needs the in-process executor), the YAML's `mtp_carry` section goes
to `attach` before the first request, `CORRID` becomes
`ConversationParams(conversation_id=...)`, the `cache_salt` input becomes
`cache_salt`, the sessions follow the reference model's contract, and the
adapter's turn record of each request gives the turn's carry outcome.

Request contract (the reference model's, `serve/triton/model.py`):
- control `CORRID` (uint64, the session), `START`, `END`;
- `text_input` (the new user message: the model extends the session's last
  prompt and output with the chat template's closing and the message) or
  `input_ids` (the full prompt), `max_tokens`, optional `cache_salt`;
- streamed `text_output`, `output_ids`; with the final response
  `carry_outcome`, `drafter_rows_computed`, `drafted`, `accepted`, `ttft_ms`,
  `kv_cache_reused_blocks`, `model_instance` and `turn_stats` (JSON of
  `TrtllmTurnStats`).
- The carry fields come from the adapter, which takes the carry decision of
  every request: `CarryAttachment.pop_turn(RequestOutput.request_id)` (the
  executor's `LlmRequest.py_client_id`; each record is read once, at most
  `TURN_LOG` are kept). `carry_outcome` is the core's outcome kind (`adopted`,
  `no_carry`, `prefix_mismatch`, ...; a conversation's first turn is judged
  too and finds nothing, `no_carry` for `never_carried`), `not_armed` when
  the carry is not installed; `turn_stats` adds `no_carry_reason`,
  `reused_tokens` (R), `drafter_rows_kept`. `drafter_rows_computed` counts the
  prompt's pair keys `[R, L - 1)` TensorRT-LLM's context phase computes, as
  the reference counts them; TensorRT-LLM itself reports none of these. Not
  known, and left out of the response (null in `turn_stats`) rather than
  guessed: `drafter_rows_computed` (and R) when the carry is not armed, and
  every carry field of a request the adapter has no record of.
- END, a START on an open session and the idle timeout end the session:
  `CarryAttachment.forget_conversation` drops its carried rows (`session_end`
  evictions, the freed rows counted in `mtp_carry_rows_freed_total`), as the
  reference model's `forget_session` does.

Invariants: a session's turns run one at a time in arrival order (one
asyncio lock per CORRID); START on a known session, END and the idle timeout
end it; a bad request gets exactly one error response; a load failure is one
line (a bad parameter, a missing options file, TensorRT-LLM not installed:
the line names the `trtllm` extra, a bad `mtp_carry` key, the adapter's
refusal, an LLM without a tokenizer: TensorRT-LLM sets each request's end id from
it). The LLM API names used are those of docs/TRTLLM-CONFORMANCE.md section 4. Only the loop thread touches the LLM and the session table.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...metrics import CarryMetrics
from ..session_server import TurnRequest
from ..triton.model import TritonSink, parse_request
from .serving import (
    MISSING_TRTLLM,
    ChatTemplate,
    TrtllmServeOptions,
    TrtllmTurnStats,
    conversation_id_for,
    salt_text,
    sampling_kwargs,
    triton_llm_args,
    turn_stats,
)

logger = logging.getLogger("trtllm_mtp_carry.serve")

SINGLE_PROCESS_ENV = "TLLM_WORKER_USE_SINGLE_PROCESS"
NO_TOKENIZER = ("the LLM has no tokenizer (skip_tokenizer_init): TensorRT-LLM takes each request's end id "
                "from it and refuses every request without one; remove skip_tokenizer_init from the LLM options")


def require_tensorrt_llm() -> Any:
    """The `tensorrt_llm` module; RuntimeError naming the `trtllm` extra when it is absent."""
    try:
        import tensorrt_llm
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == "tensorrt_llm":
            raise RuntimeError(MISSING_TRTLLM) from None
        raise RuntimeError(f"tensorrt_llm failed to import: {exc}") from None
    except ImportError as exc:  # installed but broken (a CUDA library missing, ...)
        raise RuntimeError(f"tensorrt_llm failed to import: {exc}") from None
    return tensorrt_llm


def _adapter() -> Any:
    """The adapter (`attach`, `detach`, `parse_carry_options`: this package's public surface),
    imported when the model loads, so this module imports without it."""
    return importlib.import_module("trtllm_mtp_carry.trtllm")


def read_options_yaml(path: Path) -> Any:
    """The parsed YAML of the model's LLM options file (PyYAML comes with TensorRT-LLM)."""
    try:
        import yaml
    except ImportError:
        raise RuntimeError("reading the LLM options needs PyYAML (TensorRT-LLM installs it)") from None
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"{path}: not valid YAML: {first}") from None


class TrtllmMetrics(CarryMetrics):
    """The reference model's metric families, fed from TensorRT-LLM's per-request metrics
    (drafts), the adapter's turn records (outcomes, no-carry reasons, rows) and its
    counters (`mtp_carry_runtime{field}` gauges)."""

    def record_trtllm_turn(self, stats: TrtllmTurnStats) -> None:
        if stats.outcome_kind:  # the reference's families; an unknown outcome is not counted
            self.record_turn(stats)
            return
        for result, value in (("proposed", stats.drafted), ("accepted", stats.accepted)):
            if value:
                self.metric("drafts", "result", result).increment(value)


class _TrtllmSink(TritonSink):
    """The reference model's response sender; the final response carries TensorRT-LLM's statistics."""

    def final(self, ids: list[int], text: str, result: Any) -> None:
        s: TrtllmTurnStats = result
        carry = []  # what the adapter knows of this turn; an unknown value is left out
        if s.outcome_kind:
            carry.append(self.scalar("carry_outcome", s.outcome_kind, "object"))
        if s.drafter_rows_computed is not None:
            carry.append(self.scalar("drafter_rows_computed", s.drafter_rows_computed, "int32"))
        tensors = self.stream_tensors(ids, text) + carry + [
            self.scalar("drafted", s.drafted, "int32"),
            self.scalar("accepted", s.accepted, "int32"),
            self.scalar("ttft_ms", s.ttft_ms, "float32"),
            self.scalar("kv_cache_reused_blocks", s.kv_cache_reused_blocks, "int32"),
        ] + self.closing_tensors(s.as_dict())
        self.send_final(tensors)


@dataclass
class _Conversation:
    prompt: list[int] | None = None  # the last finished turn's prompt and output
    output: list[int] | None = None
    last_seen: float = field(default_factory=time.monotonic)


class _Engine:
    """The LLM on its asyncio loop thread: built, attached, served, detached, shut down."""

    def __init__(self, llm_args: dict[str, Any], carry_options: Any) -> None:
        self._llm_args = llm_args
        self._carry_options = carry_options
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.llm: Any = None
        self.attachment: Any = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=asyncio.run, args=(self._main(),), name="mtp-carry-trtllm",
                                        daemon=True)

    def start(self) -> None:
        """Build the LLM and attach the carry; re-raise what failed."""
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error

    def stop(self, timeout: float = 60.0) -> None:
        """Finish the requests in flight, detach, shut the LLM down (idempotent)."""
        if not self._thread.is_alive():
            return
        if self.loop is not None and self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)

    async def _main(self) -> None:
        from tensorrt_llm import LLM

        adapter = _adapter()
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            self.llm = await loop.run_in_executor(None, lambda: LLM(**self._llm_args))
            self.attachment = await loop.run_in_executor(None, adapter.attach, self.llm, self._carry_options)
        except BaseException as exc:  # handed to start(), which raises it in initialize
            self._error = exc
            if self.llm is not None:
                await loop.run_in_executor(None, self.llm.shutdown)
            self._ready.set()
            return
        self.loop = loop
        self._ready.set()
        await self._stop.wait()
        pending = [t for t in asyncio.all_tasks(loop) if t is not asyncio.current_task()]
        await asyncio.gather(*pending, return_exceptions=True)
        await loop.run_in_executor(None, adapter.detach, self.llm)
        await loop.run_in_executor(None, self.llm.shutdown)


class TritonPythonModel:
    """One model instance: one LLM with the carry attached, its sessions and metrics."""

    def initialize(self, args: dict[str, str]) -> None:
        import triton_python_backend_utils as pb_utils

        self._pb = pb_utils
        config = json.loads(args["model_config"])
        self._options = TrtllmServeOptions.from_parameters(config.get("parameters", {}))
        idle_us = config.get("sequence_batching", {}).get("max_sequence_idle_microseconds")
        # the session's own idle timeout: Triton's value less the turn bound it adds (serve/trtllm/repo.py)
        self._idle_s = int(idle_us) / 1e6 - self._options.max_turn_s if idle_us else None
        self._instance = args["model_instance_name"]
        options_path = None
        if self._options.llm_options:
            options_path = Path(args["model_repository"]) / self._options.llm_options
            if not options_path.is_file():
                raise ValueError(f"parameter llm_options names {options_path}, which is not a file")
        require_tensorrt_llm()
        # before the first LLM: TensorRT-LLM caches this check, and the adapter needs the in-process executor
        os.environ[SINGLE_PROCESS_ENV] = "1"
        from tensorrt_llm.llmapi.llm_utils import update_llm_args_with_extra_dict

        raw = read_options_yaml(options_path) if options_path is not None else None
        llm_args, carry_section = triton_llm_args(raw, self._options.model)
        carry_options = _adapter().parse_carry_options(carry_section)  # a bad key fails before the LLM is built
        model = llm_args.pop("model")
        llm_args = update_llm_args_with_extra_dict({"model": model}, llm_args)
        self._metrics = TrtllmMetrics(pb_utils, args["model_name"], self._instance)
        self._conversations: dict[int, _Conversation] = {}
        self._locks: dict[int, asyncio.Lock] = {}  # one per session with a turn queued or a history
        self._waiting: dict[int, int] = {}  # requests queued or running per session
        self._engine = _Engine(llm_args, carry_options)
        self._engine.start()
        attachment = self._engine.attachment
        self._chat: ChatTemplate | None = None
        tokenizer = getattr(self._engine.llm, "tokenizer", None)
        if tokenizer is None:
            # LLM.generate_async sets SamplingParams.end_id from the tokenizer and raises
            # ValueError without one (llm.py _prepare_sampling_params): every turn would fail
            self._engine.stop()
            raise ValueError(NO_TOKENIZER)
        try:  # TensorRT-LLM's TransformersTokenizer wraps the Hugging Face one
            self._chat = ChatTemplate(getattr(tokenizer, "tokenizer", tokenizer))
        except ValueError as exc:
            logger.warning("%s: text_input turns are refused: %s", self._instance, exc)
        self._metrics.refresh(attachment.stats())
        logger.info("%s ready: %s; carry %s (%s): %s", self._instance, self._options, attachment.topology,
                    "armed" if attachment.armed else "not armed", attachment.reason)

    def execute(self, requests: list[Any]) -> None:
        loop = self._engine.loop
        assert loop is not None
        for request in requests:
            sink = _TrtllmSink(self._pb, request, self._instance)
            try:
                turn = parse_request(request, self._pb)
            except ValueError as exc:
                sink.error(str(exc))
                continue
            asyncio.run_coroutine_threadsafe(self._serve(turn, sink), loop)
        return None

    def finalize(self) -> None:
        self._engine.stop()

    # ---- the loop thread ----------------------------------------------------------

    async def _serve(self, turn: TurnRequest, sink: _TrtllmSink) -> None:
        corrid = turn.corrid
        self._waiting[corrid] = self._waiting.get(corrid, 0) + 1
        lock = self._locks.setdefault(corrid, asyncio.Lock())
        try:
            async with lock:
                try:
                    await self._turn(turn, sink)
                except (ValueError, TypeError) as exc:
                    sink.error(str(exc))
                except Exception as exc:  # a TensorRT-LLM failure: this turn fails, the model keeps serving
                    logger.exception("turn of CORRID=%d failed", corrid)
                    sink.error(f"generation failed: {type(exc).__name__}: {exc}")
                finally:
                    if turn.end:
                        self._end(corrid, "end")
                    self._metrics.refresh(self._engine.attachment.stats())
        finally:
            self._waiting[corrid] -= 1
            if not self._waiting[corrid]:  # nobody queued on this session: its lock may go
                del self._waiting[corrid]
                if corrid not in self._conversations:
                    self._locks.pop(corrid, None)

    async def _turn(self, turn: TurnRequest, sink: _TrtllmSink) -> None:
        from tensorrt_llm import SamplingParams
        from tensorrt_llm.conversation_params import ConversationParams

        self._expire_idle()
        if turn.start and turn.corrid in self._conversations:
            self._end(turn.corrid, "restart")  # the sequence restarted, even if this request is refused
        turn.check()
        conversation_id = conversation_id_for(turn.corrid)
        salt = salt_text(turn.cache_salt)
        found = self._conversations.get(turn.corrid)
        if turn.start:
            conv = _Conversation()
        elif found is None:
            raise ValueError(f"unknown session CORRID={turn.corrid}: its first request must set START")
        else:
            conv = found
        conv.last_seen = time.monotonic()
        prompt = self._prompt(turn, conv)
        params = SamplingParams(**sampling_kwargs(turn.max_tokens, self._options.max_tokens))
        start = time.perf_counter()
        ttft_ms: float | None = None
        result = self._engine.llm.generate_async(
            {"prompt_token_ids": prompt}, params, streaming=True,
            conversation_params=ConversationParams(conversation_id=conversation_id), cache_salt=salt)
        self._conversations[turn.corrid] = conv  # a START opens the session once TensorRT-LLM took the turn
        async for out in result:
            completion = out.outputs[0]
            ids, text = list(completion.token_ids_diff), completion.text_diff
            if ids and ttft_ms is None:
                ttft_ms = (time.perf_counter() - start) * 1e3
            if out.finished:
                total_ms = (time.perf_counter() - start) * 1e3
                attachment = self._engine.attachment
                # RequestOutput.request_id is the executor request's py_client_id (the
                # worker's client id), under which the adapter recorded the turn
                stats = turn_stats(len(prompt), completion, out, ttft_ms or total_ms, total_ms,
                                   attachment.topology, bool(attachment.armed),
                                   attachment.pop_turn(out.request_id))
                if completion.finish_reason != "cancelled":
                    conv.prompt, conv.output = list(prompt), list(completion.token_ids)
                conv.last_seen = time.monotonic()
                self._metrics.record_trtllm_turn(stats)
                sink.final(ids, text, stats)
                return
            if sink.cancelled():
                result.abort()
                # admitted (the adapter holds its turn record): its outcome, decided at admission,
                # counts as the adapter's own `outcomes` counted it, whether or not the client stayed
                attachment = self._engine.attachment
                record = attachment.pop_turn(out.request_id) if attachment.armed else None
                if record is not None:
                    total_ms = (time.perf_counter() - start) * 1e3
                    self._metrics.record_trtllm_turn(turn_stats(
                        len(prompt), completion, out, ttft_ms or total_ms, total_ms,
                        attachment.topology, True, record))
                sink.error("request cancelled by the client")
                return
            if ids:
                sink.partial(ids, text)

    def _prompt(self, turn: TurnRequest, conv: _Conversation) -> list[int]:
        if turn.input_ids is not None:
            return list(turn.input_ids)
        assert turn.text_input is not None
        if self._chat is None:
            raise ValueError("this model's tokenizer has no chat template; send input_ids")
        if conv.prompt is None or conv.output is None:
            return self._chat.first_prompt(turn.text_input)
        return self._chat.next_prompt(conv.prompt, conv.output, turn.text_input)

    def _end(self, corrid: int, cause: str) -> None:
        # as the reference model's forget_session: the ended session's carried rows go now
        # (a session TensorRT-LLM never took a turn of carries nothing)
        known = self._conversations.pop(corrid, None) is not None
        rows = self._engine.attachment.forget_conversation(conversation_id_for(corrid)) if known else 0
        if known or cause == "end":
            self._metrics.record_session_end(cause, rows)

    def _expire_idle(self) -> None:
        if self._idle_s is None:
            return
        now = time.monotonic()
        for corrid, conv in list(self._conversations.items()):
            if corrid not in self._waiting and now - conv.last_seen > self._idle_s:
                self._end(corrid, "idle")
                self._locks.pop(corrid, None)
