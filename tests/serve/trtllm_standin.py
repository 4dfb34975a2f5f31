"""A STAND-IN for TensorRT-LLM's LLM API and Triton's `pb_utils`, for the trtllm model's in-process tests.

Not TensorRT-LLM: a few classes with the names and call shapes the model uses
(`LLM(**kwargs)`, `generate_async(inputs, sampling_params, streaming=,
conversation_params=, cache_salt=)` streaming `RequestOutput`-like objects,
`SamplingParams`, `ConversationParams`, `update_llm_args_with_extra_dict`),
read from TensorRT-LLM's source, that generate deterministic tokens and
record every call; and a `pb_utils` with the response sender, tensors and
metric families the model touches. They let the tests run the model's
sessions, streaming and error paths without a GPU; what real TensorRT-LLM
does is checked by scripts/trtllm_smoke.py on a machine that has it.
`ExecutorLLM` is the same LLM API over the package's CPU stand-in executor,
so the real adapter (attach, its resource manager, forget) runs under the model.
"""

from __future__ import annotations

import asyncio
import functools
import os
import sys
import threading
import types
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

EOS = 1001


class ChatMLTokenizer:
    """A byte-level stand-in for a Hugging Face ChatML tokenizer (Qwen's template)."""

    SPECIALS = {"<|im_start|>": 1000, "<|im_end|>": EOS}
    eos_token_id = EOS

    def __init__(self, verbatim: bool = True) -> None:
        self.verbatim = verbatim  # False: the template rewrites assistant answers

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert tokenize is False
        text = "".join(f"<|im_start|>{m['role']}\n"
                       f"{m['content'] if self.verbatim or m['role'] != 'assistant' else '...'}<|im_end|>\n"
                       for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    def encode(self, text, add_special_tokens=False):
        assert add_special_tokens is False
        ids, i = [], 0
        while i < len(text):
            for name, sid in self.SPECIALS.items():
                if text.startswith(name, i):
                    ids.append(sid)
                    i += len(name)
                    break
            else:
                ids += list(text[i].encode())
                i += 1
        return ids

    def decode(self, ids, skip_special_tokens=False):
        names = {v: k for k, v in self.SPECIALS.items()}
        return "".join("" if skip_special_tokens and i in names else names.get(i, chr(i)) for i in ids)


# ---- the LLM API stand-in -----------------------------------------------------------


class SamplingParams:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.max_tokens = kwargs["max_tokens"]


@dataclass(kw_only=True)
class ConversationParams:
    conversation_id: str

    def __post_init__(self) -> None:  # TensorRT-LLM strips it and refuses an empty one
        self.conversation_id = self.conversation_id.strip()
        if not self.conversation_id:
            raise ValueError("conversation_id must be non-empty")


@dataclass
class Call:
    prompt: list[int]
    conversation_id: str
    cache_salt: str | None
    sampling: dict[str, Any]
    streaming: bool


@dataclass
class _Completion:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    request_perf_metrics: Any = None
    _last_ids: int = 0
    _last_text: int = 0

    @property
    def token_ids_diff(self) -> list[int]:
        return self.token_ids[self._last_ids:]

    @property
    def text_diff(self) -> str:
        return self.text[self._last_text:]


class _Output:
    """What the model reads of a streamed `RequestOutput`: `request_id` (GenerationResult's:
    the worker's client id), `outputs[0]`, `finished`, `decoding_iter`; `abort()`."""

    def __init__(self, request_id: int) -> None:
        self.request_id = request_id
        self.outputs = [_Completion()]
        self.finished = False
        self.decoding_iter = 0
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True

    def __aiter__(self):
        return self._run()

    def _run(self):
        raise NotImplementedError


class _Result(_Output):
    """Streams the answer two tokens per step, like RequestOutput under streaming=True."""

    def __init__(self, answer: list[int], finish: str, reused_blocks: int, tok: ChatMLTokenizer,
                 request_id: int) -> None:
        super().__init__(request_id)
        self._answer, self._finish, self._reused, self._tok = answer, finish, reused_blocks, tok

    async def _run(self):
        c = self.outputs[0]
        for i in range(0, len(self._answer), 2):
            await asyncio.sleep(0)
            c._last_ids, c._last_text = len(c.token_ids), len(c.text)
            c.token_ids = self._answer[: i + 2]
            c.text = self._tok.decode(c.token_ids, skip_special_tokens=True)
            self.decoding_iter += 1
            last = i + 2 >= len(self._answer) or self.aborted
            if last:
                self.finished = True
                c.finish_reason = "cancelled" if self.aborted else self._finish
                c.request_perf_metrics = SimpleNamespace(
                    speculative_decoding=SimpleNamespace(total_draft_tokens=3 * self.decoding_iter,
                                                         total_accepted_draft_tokens=self.decoding_iter),
                    kv_cache_metrics=SimpleNamespace(num_reused_blocks=self._reused, kv_cache_hit_rate=0.25))
            yield self
            if last:
                return


class LLM:
    """The stand-in LLM: records its keywords, the environment it was built in, and every call."""

    instances: list[LLM] = []

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.single_process_env = os.environ.get("TLLM_WORKER_USE_SINGLE_PROCESS")
        self.tokenizer = SimpleNamespace(tokenizer=ChatMLTokenizer())
        self.calls: list[Call] = []
        self.results: list[_Result] = []
        self.shut_down = False
        self.events: list[str] = ["built"]
        LLM.instances.append(self)

    def generate_async(self, inputs, sampling_params, streaming=False, conversation_params=None,
                       cache_salt=None):
        prompt = list(inputs["prompt_token_ids"])
        previous = [c.prompt for c in self.calls if c.conversation_id == conversation_params.conversation_id]
        self.calls.append(Call(prompt, conversation_params.conversation_id, cache_salt, sampling_params.kwargs,
                               streaming))
        self.events.append("request")
        tok = self.tokenizer.tokenizer
        answer = tok.encode(f"answer to {len(prompt)} tokens") + [EOS]
        n = sampling_params.max_tokens
        finish = "stop" if len(answer) <= n else "length"
        reused = 0
        if previous:
            common = 0
            for a, b in zip(previous[-1], prompt, strict=False):
                if a != b:
                    break
                common += 1
            reused = common // 4
        result = _Result(answer[:n], finish, reused, tok, request_id=100 + len(self.calls))
        self.results.append(result)
        return result

    def shutdown(self) -> None:
        self.shut_down = True


@functools.cache
def reference_model() -> Any:
    """The package's reference weights (float32), loaded once for every ExecutorLLM."""
    from trtllm_mtp_carry.engine.model import load_reference

    return load_reference()[0]


class _ExecutorResult(_Output):
    """A `RequestOutput`-like stream of one request on the CPU STAND-IN executor: `request_id`
    is its LLM API id (`LlmRequest.py_client_id`); each iteration steps the executor, which
    advances every request it holds, as TensorRT-LLM's executor loop does."""

    def __init__(self, executor: Any, request: Any, tok: Any, tokens_per_block: int) -> None:
        super().__init__(request.py_client_id)
        self._executor, self._request, self._tok, self._tpb = executor, request, tok, tokens_per_block

    def abort(self) -> None:
        super().abort()
        self._executor.cancel(self._request.py_request_id)

    async def _run(self):
        c, req = self.outputs[0], self._request
        while True:
            await asyncio.sleep(0)
            if not req.is_finished:
                self._executor.step()
            c._last_ids, c._last_text = len(c.token_ids), len(c.text)
            c.token_ids = list(req.output)
            c.text = self._tok.decode([i for i in c.token_ids if i != self._tok.eos_id])
            self.decoding_iter = req.verify_steps + 1  # the context step, then one per verify
            if req.is_finished:
                self.finished = True
                c.finish_reason = ("cancelled" if self.aborted else
                                   "stop" if c.token_ids and c.token_ids[-1] == self._tok.eos_id else "length")
                c.request_perf_metrics = SimpleNamespace(
                    speculative_decoding=SimpleNamespace(total_draft_tokens=req.drafted,
                                                         total_accepted_draft_tokens=req.accepted),
                    kv_cache_metrics=SimpleNamespace(num_reused_blocks=req.reused // self._tpb,
                                                     kv_cache_hit_rate=None))
                yield self
                return
            yield self


class ExecutorLLM:
    """The LLM API (`LLM(**kwargs)`, `generate_async`, `shutdown`) over the package's CPU STAND-IN
    executor (`trtllm_mtp_carry/trtllm/standin.py`, not TensorRT-LLM), so the real adapter
    attaches to `_executor.engine` and its resource manager runs every turn. Requests get LLM
    API ids of their own (from 1001), distinct from the executor's ids, as TensorRT-LLM's
    worker's client ids are. No tokenizer: text turns are refused, tests send `input_ids`."""

    trtllm_standin = True  # the adapter's probe: a stand-in, reporting its own version
    instances: list[ExecutorLLM] = []
    CHUNK = 32  # the stand-in executor's prefill chunk and tokens per block

    def __init__(self, **kwargs: Any) -> None:
        from trtllm_mtp_carry.engine.tokenizer import ChatTokenizer
        from trtllm_mtp_carry.trtllm.standin import StandinPyExecutor

        self.kwargs = kwargs
        engine = StandinPyExecutor(reference_model(), chunk_size=self.CHUNK, tokens_per_block=self.CHUNK,
                                   max_batch=4)
        self._executor = SimpleNamespace(engine=engine)  # llm._executor.engine, as in TensorRT-LLM
        self.tokenizer = None
        self._tok = ChatTokenizer()
        self._next_id = 1000
        self.shut_down = False
        ExecutorLLM.instances.append(self)

    @property
    def executor(self) -> Any:
        return self._executor.engine

    def generate_async(self, inputs, sampling_params, streaming=False, conversation_params=None,
                       cache_salt=None):
        self._next_id += 1
        conv = None if conversation_params is None else conversation_params.conversation_id
        req = self.executor.submit(list(inputs["prompt_token_ids"]), sampling_params.max_tokens,
                                   conversation_id=conv, cache_salt=cache_salt, client_id=self._next_id)
        return _ExecutorResult(self.executor, req, self._tok, self.CHUNK)

    def shutdown(self) -> None:
        self.shut_down = True


def update_llm_args_with_extra_dict(llm_args: dict, llm_args_dict: dict, extra_llm_api_options=None) -> dict:
    return {**llm_args, **llm_args_dict}


def install_tensorrt_llm(monkeypatch: Any, llm: type = LLM) -> None:
    """Put the stand-in modules in sys.modules under TensorRT-LLM's names (for this test only);
    `llm` is the stand-in `tensorrt_llm.LLM` (`LLM`, or `ExecutorLLM` for the real adapter)."""
    root = types.ModuleType("tensorrt_llm")
    root.LLM, root.SamplingParams = llm, SamplingParams
    conv = types.ModuleType("tensorrt_llm.conversation_params")
    conv.ConversationParams = ConversationParams
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    utils = types.ModuleType("tensorrt_llm.llmapi.llm_utils")
    utils.update_llm_args_with_extra_dict = update_llm_args_with_extra_dict
    for name, module in (("tensorrt_llm", root), ("tensorrt_llm.conversation_params", conv),
                         ("tensorrt_llm.llmapi", llmapi), ("tensorrt_llm.llmapi.llm_utils", utils)):
        monkeypatch.setitem(sys.modules, name, module)
    LLM.instances.clear()
    ExecutorLLM.instances.clear()


# ---- Triton's pb_utils stand-in ---------------------------------------------------------


class _Tensor:
    def __init__(self, name: str, array: Any) -> None:
        self.name, self.array = name, np.asarray(array)

    def as_numpy(self):
        return self.array


class _Response:
    def __init__(self, output_tensors=None, error=None) -> None:
        self.tensors = {t.name: t.array for t in output_tensors or []}
        self.error = error


class _Error:
    def __init__(self, message: str) -> None:
        self.message = message


class _Metric:
    def __init__(self, labels: dict[str, str]) -> None:
        self.labels, self.value = labels, 0

    def increment(self, n: int) -> None:
        self.value += n

    def set(self, v: int) -> None:
        self.value = v


class _Family:
    COUNTER, GAUGE = "counter", "gauge"
    all: list[_Family] = []

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name, self.metrics = name, []
        _Family.all.append(self)

    def Metric(self, labels):  # noqa: N802 (Triton's name)
        m = _Metric(labels)
        self.metrics.append(m)
        return m


class Sender:
    def __init__(self) -> None:
        self.responses: list[_Response] = []
        self.done = threading.Event()

    def send(self, response, flags=0):
        self.responses.append(response)
        if flags == 1:
            self.done.set()

    def error(self) -> str | None:
        errs = [r.error.message for r in self.responses if r.error is not None]
        return errs[0] if errs else None


class Request:
    """A Triton request: named inputs, one response sender, a cancelled flag."""

    def __init__(self, corrid: int | str, start: bool = False, end: bool = False, **inputs: Any) -> None:
        self.inputs = {"CORRID": np.asarray([corrid if isinstance(corrid, int) else 0], dtype=np.uint64),
                       "START": np.asarray([int(start)], dtype=np.int32),
                       "END": np.asarray([int(end)], dtype=np.int32)}
        for name, value in inputs.items():
            if name in ("text_input", "cache_salt"):
                value = value if isinstance(value, bytes) else value.encode()
                self.inputs[name] = np.asarray([value], dtype=np.object_)
            elif name == "input_ids":
                self.inputs[name] = np.asarray(value, dtype=np.int64)
            else:
                self.inputs[name] = np.asarray([value], dtype=np.int32)
        self.sender = Sender()
        self.cancel = False
        self._corrid = corrid

    def correlation_id(self) -> int | str:
        """The sequence id as the client sent it (an int, or a str for a string id)."""
        return self._corrid

    def get_response_sender(self) -> Sender:
        return self.sender

    def is_cancelled(self) -> bool:
        return self.cancel


def pb_utils_module() -> types.ModuleType:
    pb = types.ModuleType("triton_python_backend_utils")
    pb.Tensor, pb.InferenceResponse, pb.TritonError, pb.MetricFamily = _Tensor, _Response, _Error, _Family
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    def get_input_tensor_by_name(request: Request, name: str):
        value = request.inputs.get(name)
        return None if value is None else _Tensor(name, value)

    pb.get_input_tensor_by_name = get_input_tensor_by_name
    _Family.all = []
    return pb


def metric(name: str, **labels: str) -> int:
    """Sum of the stand-in metrics of family `name` whose labels include `labels`."""
    return sum(m.value for f in _Family.all if f.name == name for m in f.metrics
               if all(m.labels.get(k) == v for k, v in labels.items()))
