"""A STAND-IN for TensorRT-LLM's LLM API and Triton's `pb_utils`, for the trtllm model's in-process tests.

Not TensorRT-LLM and not Triton. What it is for: the Triton model's sessions,
streaming, errors and carry bookkeeping run in process without a GPU; what real
TensorRT-LLM does is checked by scripts/trtllm_smoke.py on a machine that has it.

The LLM API half follows TensorRT-LLM's source row by row: every name it offers
is a row of docs/TRTLLM-CONFORMANCE.md section 4 (file and commit read there),
with the source's semantics, and `LLMAPI_NAMES` (pinned equal to those rows by
tests/trtllm/test_trtllm_conformance.py) is what it answers to package code:
any other name raises AttributeError, as it would on TensorRT-LLM
(`LlmApiConformant`, the mechanism of `trtllm_mtp_carry/trtllm/standin/conformant.py`).
Read from the source and kept here:
- `LLM(model, ..., **kwargs)` refuses a keyword that is no LLM argument
  (`ValueError: LLM got invalid argument: <key>`); `shutdown()` drops the
  executor, after which `generate_async` raises `RuntimeError("LLM is shutting down")`;
- `generate_async(inputs, sampling_params=None, *, streaming, conversation_params,
  cache_salt)`: a `SamplingParams` without `end_id` takes the tokenizer's
  `eos_token_id` (ValueError without a tokenizer), `return_perf_metrics` is the
  request's or the LLM's; `inputs` needs `prompt_token_ids` (TypeError otherwise);
- the returned `RequestOutput` is its own async iterator: each step handles one
  executor response and yields itself; `CompletionOutput.token_ids` and `text`
  are cumulative (each response extends them), `token_ids_diff` / `text_diff`
  are what the last response added; without streaming only the final response
  comes; `finish_reason` is None until the end, then `stop` (end id, which the
  PyTorch sampler appends before finishing, so it is in `token_ids` and not in
  `text`: `skip_special_tokens`), `length` or `cancelled`; `abort()` makes the
  next response the final, cancelled one;
- `request_perf_metrics` (with `return_perf_metrics`) carries
  `speculative_decoding.total_draft_tokens` / `total_accepted_draft_tokens` and
  `kv_cache_metrics.num_reused_blocks` / `kv_cache_hit_rate`; the stand-in attaches
  it to the final response. `SPEC_DEC_FILLED = False` models the TensorRT-LLM
  versions whose PyTorch flow leaves the speculative section zeroed;
- `ConversationParams(conversation_id=...)` strips the id and refuses None or
  an empty one (ValueError "conversation_id must be non-empty");
- `update_llm_args_with_extra_dict(llm_args, llm_args_dict)` returns
  `llm_args | llm_args_dict`, each config section needing a mapping.
Not modelled (the model does not use them): text prompts, beam search, n > 1,
stop words, logprobs, LoRA, disaggregated parameters, incremental detokenization
(text is the full decode of `token_ids`, the path TensorRT-LLM takes for a
tokenizer without `decode_incrementally`).

`LLM` generates deterministic answers and records every call; `ExecutorLLM` is the
same LLM API over the package's CPU STAND-IN executor, so the real adapter
(attach, its resource manager, forget) runs under the model.

`pb_utils_module()` is a plainly named TEST DOUBLE of Triton's Python-backend
module `triton_python_backend_utils`, not held to the source row by row: the
names are Triton's, their behaviour only as far as the model's tests need it.
`get_input_tensor_by_name(request, name)` (None for an absent input) and
`TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1` are in
triton-inference-server/python_backend `src/resources/triton_python_backend_utils.py`
(read at 28aaeb7b); `Tensor`, `InferenceResponse`, `TritonError`, `MetricFamily`
(`COUNTER`, `GAUGE`, `Metric(labels)`), the request's `get_response_sender`,
`is_cancelled`, `correlation_id` and the sender's `send(response, flags)` are the
stub's C++ bindings that module is merged with (`src/pb_stub.cc`, python_backend's
README; not re-read in this pass).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import sys
import threading
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

EOS = 1001

LLMAPI_NAMES: dict[str, frozenset[str]] = {
    # class (as docs/TRTLLM-CONFORMANCE.md names it) -> the TensorRT-LLM names the stand-in answers
    "LLM": frozenset({"_executor", "generate_async", "args", "shutdown", "tokenizer"}),
    "RequestOutput": frozenset({"request_id", "outputs", "finished", "decoding_iter", "abort", "aborted"}),
    "CompletionOutput": frozenset({"token_ids", "text", "token_ids_diff", "text_diff", "finish_reason",
                                   "request_perf_metrics"}),
    "RequestPerfMetrics": frozenset({"speculative_decoding", "kv_cache_metrics"}),
    "SpeculativeDecodingMetrics": frozenset({"total_draft_tokens", "total_accepted_draft_tokens"}),
    "KvCacheMetrics": frozenset({"num_reused_blocks", "kv_cache_hit_rate"}),
    "SamplingParams": frozenset({"max_tokens", "top_k", "return_perf_metrics"}),
    "ConversationParams": frozenset({"conversation_id"}),
    "TransformersTokenizer": frozenset({"tokenizer"}),
    "PreTrainedTokenizerBase": frozenset({"eos_token_id", "apply_chat_template", "encode", "decode"}),
}
"""Every TensorRT-LLM (and Hugging Face tokenizer) name a stand-in LLM API class answers to
package code: the rows of docs/TRTLLM-CONFORMANCE.md section 4 (and section 2's `LLM` and
`ConversationParams` rows), pinned equal by tests/trtllm/test_trtllm_conformance.py."""

GENERATE_ASYNC_PARAMETERS = (
    "inputs", "sampling_params", "lora_request", "prompt_adapter_request", "streaming",
    "kv_cache_retention_config", "disaggregated_params", "trace_headers", "_postproc_params",
    "scheduling_params", "conversation_params", "cache_salt", "priority")
"""`LLM.generate_async`'s parameters, in order (`tensorrt_llm/llmapi/llm.py@814964c0`); the
stand-ins take `inputs` and `sampling_params` by position and implement `streaming`,
`conversation_params` and `cache_salt` (keyword-only: a positional third argument fails)."""

LLM_ARGUMENTS = frozenset({
    # BaseLLM.__init__'s own parameters (tensorrt_llm/llmapi/llm.py@814964c0) ...
    "tokenizer", "tokenizer_mode", "skip_tokenizer_init", "trust_remote_code", "tensor_parallel_size",
    "dtype", "revision", "tokenizer_revision", "backend",
    # ... and the TorchLlmArgs fields llm.py@814964c0 / llm_args.py@fcd3f316 read (a subset)
    "kv_cache_config", "speculative_config", "return_perf_metrics", "stream_interval",
    "enable_chunked_prefill", "max_num_tokens", "max_batch_size", "lora_config", "reasoning_parser",
    "env_overrides", "orchestrator_type", "scheduler_config", "peft_cache_config",
})
"""The `LLM(**kwargs)` keywords the stand-in accepts; any other raises ValueError as
`BaseLLM.__init__` does for a key that is no field of the LLM args (the stand-in knows a
subset of those fields: a real one missing here fails loudly, never silently)."""


class LlmApiConformant:
    """Base of the stand-in classes that play a TensorRT-LLM LLM API class (`TRTLLM_CLASS`).

    Package code (any `trtllm_mtp_carry.*` module) reading a name not in
    `LLMAPI_NAMES[TRTLLM_CLASS]` gets AttributeError, as it would on TensorRT-LLM:
    `getattr(obj, name, default)` gets the default. This module and the tests also
    see the stand-in's bookkeeping. (The mechanism of `trtllm/standin/conformant.Conformant`.)
    """

    __slots__ = ()
    TRTLLM_CLASS: str = ""

    def __getattribute__(self, name: str) -> Any:
        if name[:2] == "__" or name in LLMAPI_NAMES[type(self).TRTLLM_CLASS]:
            return object.__getattribute__(self, name)
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith("trtllm_mtp_carry."):
            raise AttributeError(
                f"TensorRT-LLM's {type(self).TRTLLM_CLASS} has no {name!r} in "
                "docs/TRTLLM-CONFORMANCE.md: the stand-in refuses what TensorRT-LLM lacks")
        return object.__getattribute__(self, name)


# ---- tokenizers ---------------------------------------------------------------------------


class ChatMLTokenizer(LlmApiConformant):
    """A byte-level stand-in for a Hugging Face ChatML tokenizer (Qwen's template): the
    `PreTrainedTokenizerBase` names the model calls, with Hugging Face's keywords."""

    TRTLLM_CLASS = "PreTrainedTokenizerBase"
    SPECIALS = {"<|im_start|>": 1000, "<|im_end|>": EOS}
    eos_token_id = EOS
    pad_token_id = None

    def __init__(self, verbatim: bool = True) -> None:
        self.verbatim = verbatim  # False: the template rewrites assistant answers

    def _message(self, role: str, content: str) -> str:
        return f"<|im_start|>{role}\n{content}<|im_end|>\n"

    def _generation_prompt(self) -> str:
        return "<|im_start|>assistant\n"

    def apply_chat_template(self, conversation, tokenize=True, add_generation_prompt=False):
        assert tokenize is False, "the stand-in renders text only"
        text = "".join(self._message(m["role"], m["content"] if self.verbatim or m["role"] != "assistant"
                                     else "...") for m in conversation)
        return text + (self._generation_prompt() if add_generation_prompt else "")

    def encode(self, text, add_special_tokens=True):
        assert add_special_tokens is False, "the stand-in adds no special tokens"
        ids, i = [], 0
        while i < len(text):
            for name, sid in self.SPECIALS.items():
                if text.startswith(name, i):
                    ids.append(sid)
                    i += len(name)
                    break
            else:
                ids += self._encode_char(text[i])
                i += 1
        return ids

    def _encode_char(self, ch: str) -> list[int]:
        return list(ch.encode())

    def decode(self, token_ids, skip_special_tokens=False, spaces_between_special_tokens=True):
        names = {v: k for k, v in self.SPECIALS.items()}
        return "".join("" if skip_special_tokens and i in names else names.get(i, chr(i)) for i in token_ids)


class ReferenceChatTokenizer(ChatMLTokenizer):
    """The same Hugging Face names over the reference engine's vocabulary
    (`engine/tokenizer.ChatTokenizer`: UTF-8 bytes, `<|im_start|><|role|>...<|im_end|>\\n`)."""

    def __init__(self) -> None:
        from trtllm_mtp_carry.engine.tokenizer import ChatTokenizer

        super().__init__()
        self.reference = ChatTokenizer()
        self.SPECIALS = {name: i for i, name in self.reference.special_names.items()}
        self.eos_token_id = self.reference.eos_id
        self.pad_token_id = self.reference.pad_id

    def _message(self, role: str, content: str) -> str:
        return f"<|im_start|><|{role}|>{content}<|im_end|>\n"

    def _generation_prompt(self) -> str:
        return "<|im_start|><|assistant|>"

    def decode(self, token_ids, skip_special_tokens=False, spaces_between_special_tokens=True):
        ids = [int(i) for i in token_ids
               if not (skip_special_tokens and int(i) in self.reference.special_names)]
        return self.reference.decode(ids)


class TransformersTokenizer(LlmApiConformant):
    """TensorRT-LLM's `TransformersTokenizer` (`tensorrt_llm/llmapi/tokenizer.py@89fd9b74`): the
    Hugging Face tokenizer as `.tokenizer`; `eos_token_id`, `pad_token_id`, `encode`, `decode`
    forward to it (the stand-in has no `decode_incrementally`)."""

    TRTLLM_CLASS = "TransformersTokenizer"

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @property
    def eos_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def pad_token_id(self) -> int | None:
        return self.tokenizer.pad_token_id

    def decode(self, token_ids, *args, **kwargs):
        return self.tokenizer.decode(token_ids, *args, **kwargs)


# ---- the LLM API's parameter and output classes ------------------------------------------


@dataclass(slots=True, kw_only=True)
class SamplingParams(LlmApiConformant):
    """`tensorrt_llm.SamplingParams` (`tensorrt_llm/sampling_params.py@a98a9061`), the fields the
    stand-in implements, with the source's defaults and `__post_init__` / `_validate` checks;
    any other keyword is a TypeError (the source's dataclass has more fields)."""

    TRTLLM_CLASS = "SamplingParams"
    end_id: int | None = None
    pad_id: int | None = None
    max_tokens: int = 32
    n: int = 1
    best_of: int | None = None
    use_beam_search: bool = False
    top_k: int | None = None
    top_p: float | None = None
    temperature: float | None = None
    return_perf_metrics: bool = False
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def __post_init__(self) -> None:
        if self.pad_id is None:
            self.pad_id = self.end_id
        self.best_of = self.best_of or self.n
        if self.top_p is not None and (self.top_p < 0 or self.top_p > 1):
            raise ValueError(f"require 0 <= top_p <= 1, got top_p={self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"require top_k >= 0, got top_k={self.top_k}")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"require temperature >= 0, got temperature={self.temperature}")
        if self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) cannot be less than n ({self.n})")
        if self.n != 1 or self.use_beam_search:
            raise NotImplementedError("the stand-in runs n=1 without beam search")

    def _setup(self, tokenizer: Any) -> None:
        """`SamplingParams._setup`: the end id (and pad id) from the tokenizer."""
        if self.end_id is None:
            self.end_id = tokenizer.eos_token_id
            self.pad_id = tokenizer.pad_token_id
            if self.pad_id is None:
                self.pad_id = self.end_id


@dataclass(slots=True, kw_only=True)
class ConversationParams(LlmApiConformant):
    """`tensorrt_llm.conversation_params.ConversationParams` (`conversation_params.py@814964c0`,
    unchanged at 30d2c50c): the id as a stripped str; None or empty is a ValueError."""

    TRTLLM_CLASS = "ConversationParams"
    conversation_id: str

    def __post_init__(self) -> None:
        if self.conversation_id is None:
            raise ValueError("conversation_id must be non-empty")
        conversation_id = str(self.conversation_id).strip()
        if not conversation_id:
            raise ValueError("conversation_id must be non-empty")
        self.conversation_id = conversation_id


@dataclass(slots=True)
class SpeculativeDecodingMetrics(LlmApiConformant):
    """The nanobind `SpeculativeDecodingMetrics` (`cpp/tensorrt_llm/nanobind/executor/request.cpp@ac456dca`)."""

    TRTLLM_CLASS = "SpeculativeDecodingMetrics"
    acceptance_rate: float = 0.0
    total_accepted_draft_tokens: int = 0
    total_draft_tokens: int = 0


@dataclass(slots=True)
class KvCacheMetrics(LlmApiConformant):
    """The nanobind `KvCacheMetrics` (`request.cpp@ac456dca`)."""

    TRTLLM_CLASS = "KvCacheMetrics"
    num_total_allocated_blocks: int = 0
    num_new_allocated_blocks: int = 0
    num_reused_blocks: int = 0
    num_missed_blocks: int = 0
    kv_cache_hit_rate: float = 0.0


@dataclass(slots=True)
class RequestPerfMetrics(LlmApiConformant):
    """The nanobind `RequestPerfMetrics` (`request.cpp@ac456dca`): the sections the model reads."""

    TRTLLM_CLASS = "RequestPerfMetrics"
    kv_cache_metrics: KvCacheMetrics = field(default_factory=KvCacheMetrics)
    speculative_decoding: SpeculativeDecodingMetrics = field(default_factory=SpeculativeDecodingMetrics)


@dataclass(slots=True)
class CompletionOutput(LlmApiConformant):
    """`tensorrt_llm.executor.result.CompletionOutput` (`executor/result.py@a678b91a`): the
    fields the stand-in fills; `token_ids` / `text` cumulative, the diffs since the last response."""

    TRTLLM_CLASS = "CompletionOutput"
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    request_perf_metrics: RequestPerfMetrics | None = None
    _last_text_len: int = field(default=0, init=False, repr=False)
    _last_token_ids_len: int = field(default=0, init=False, repr=False)

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def text_diff(self) -> str:
        return self.text[self._last_text_len:]

    @property
    def token_ids_diff(self) -> list[int]:
        return self.token_ids[self._last_token_ids_len:]


@dataclass
class Response:
    """One executor response as the LLM API receives it (the C++ `Result`'s fields the
    stand-in uses): the tokens since the last response, the finish reason (None: not
    finished; "END_ID", "LENGTH", "CANCELLED"), whether it is final, `decoding_iter`,
    the perf metrics."""

    output_token_ids: list[int]
    finish_reason: str | None
    is_final: bool
    decoding_iter: int
    request_perf_metrics: RequestPerfMetrics | None = None


_FINISH = {"END_ID": "stop", "LENGTH": "length"}


class RequestOutput(LlmApiConformant):
    """`tensorrt_llm.llmapi.llm.RequestOutput` (`llmapi/llm.py@814964c0`, its base
    `GenerationResult` in `executor/result.py@a678b91a`): an async iterator over the
    request's responses (`__anext__`: StopAsyncIteration once finished, else handle one
    response and return itself), `request_id` the LLM API's client id, `outputs[0]`,
    `finished`, `decoding_iter`, `abort()` / `aborted()`."""

    TRTLLM_CLASS = "RequestOutput"

    def __init__(self, request_id: int, sampling_params: SamplingParams, tokenizer: Any, streaming: bool,
                 responses: Iterator[Response], abort_request: Any) -> None:
        self._request_id = request_id
        self._sampling_params = sampling_params
        self._tokenizer = tokenizer
        self._streaming = streaming
        self._responses = responses
        self._abort_request = abort_request
        self._outputs = [CompletionOutput(index=0)]
        self._done = False
        self._aborted = False
        self.decoding_iter = 0

    @property
    def request_id(self) -> int:
        return self._request_id

    @property
    def outputs(self) -> list[CompletionOutput]:
        return self._outputs[: self._sampling_params.n]

    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        self._abort_request()
        self._aborted = True

    def aborted(self) -> bool:
        return self._aborted

    def __aiter__(self) -> RequestOutput:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        await asyncio.sleep(0)
        response = next(self._responses)
        if not self._streaming:  # the executor sends the final response only, with every token
            tokens = list(response.output_token_ids)
            while not response.is_final:
                response = next(self._responses)
                tokens += response.output_token_ids
            response = dataclasses.replace(response, output_token_ids=tokens)
        self._handle_response(response)
        return self

    def _handle_response(self, response: Response) -> None:
        # GenerationResultBase._handle_response / _handle_sequence, then the detokenization
        # of DetokenizedGenerationResultBase._handle_response
        self._done = response.is_final
        self.decoding_iter = response.decoding_iter
        out = self._outputs[0]
        out._last_token_ids_len = len(out.token_ids)
        out.token_ids.extend(response.output_token_ids)
        if response.finish_reason == "CANCELLED":
            out.finish_reason = "cancelled"
        if response.request_perf_metrics is not None:
            out.request_perf_metrics = response.request_perf_metrics
        if self._done and response.finish_reason in _FINISH:
            out.finish_reason = _FINISH[response.finish_reason]
        sp = self._sampling_params
        if sp.detokenize and self._tokenizer is not None:
            out._last_text_len = len(out.text)
            out.text = self._tokenizer.decode(out.token_ids, skip_special_tokens=sp.skip_special_tokens,
                                              spaces_between_special_tokens=sp.spaces_between_special_tokens)


@dataclass
class Call:
    """What one `generate_async` call asked (the stand-in's record for tests)."""

    prompt: list[int]
    conversation_id: str | None
    cache_salt: str | None
    sampling: SamplingParams  # as the caller built it, before the LLM prepared it
    streaming: bool


class _LlmApi(LlmApiConformant):
    """What both stand-in LLMs share: `BaseLLM.__init__`'s argument check and
    `generate_async`'s checks and preparation (`tensorrt_llm/llmapi/llm.py@814964c0`)."""

    TRTLLM_CLASS = "LLM"

    def __init__(self, model: Any, **kwargs: Any) -> None:
        for key in kwargs:
            if key not in LLM_ARGUMENTS:
                raise ValueError(f"{type(self).__name__} got invalid argument: {key}")
        self.kwargs = {"model": model, **kwargs}
        self.args = SimpleNamespace(model=model, return_perf_metrics=bool(kwargs.get("return_perf_metrics")))
        self.shut_down = False

    def shutdown(self) -> None:
        self._executor = None
        self.shut_down = True

    def _prepare(self, inputs: Any, sampling_params: SamplingParams | None) -> tuple[list[int], SamplingParams]:
        if self._executor is None:
            raise RuntimeError("LLM is shutting down")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"The sampling_params must be type SamplingParams or None, but got "
                            f"{type(sampling_params)}")
        sampling_params = dataclasses.replace(sampling_params)  # the caller's object stays as built
        if sampling_params.end_id is None:
            if self.tokenizer is None:
                raise ValueError("tokenizer is required to reset end_id if it is None, or you can explicitly "
                                 "specify the end_id for sampling_params")
            sampling_params._setup(self.tokenizer)
        sampling_params.return_perf_metrics = sampling_params.return_perf_metrics or self.args.return_perf_metrics
        if not isinstance(inputs, dict) or "prompt_token_ids" not in inputs:
            if isinstance(inputs, dict) and "prompt" in inputs:
                raise NotImplementedError("the stand-in takes prompt_token_ids only")
            raise TypeError(f"The inputs must be type str or list of int, but got {type(inputs)}")
        return [int(i) for i in inputs["prompt_token_ids"]], sampling_params


class LLM(_LlmApi):
    """The stand-in LLM: deterministic answers ("answer to <L> tokens" and the end id, two
    tokens per decoding iteration); records its keywords, the environment it was built in,
    and every call."""

    instances: list[LLM] = []
    SPEC_DEC_FILLED = True  # False: the speculative section arrives zeroed (older PyTorch flows)

    def __init__(self, model: Any, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self.single_process_env = os.environ.get("TLLM_WORKER_USE_SINGLE_PROCESS")
        self.tokenizer = None if kwargs.get("skip_tokenizer_init") else TransformersTokenizer(ChatMLTokenizer())
        self._executor = SimpleNamespace()  # a multi-process proxy: no `engine` (the adapter is recorded)
        self.calls: list[Call] = []
        self.results: list[RequestOutput] = []
        self.events: list[str] = ["built"]
        LLM.instances.append(self)

    def generate_async(self, inputs, sampling_params=None, *, streaming=False, conversation_params=None,
                       cache_salt=None):
        caller_params = sampling_params
        prompt, sp = self._prepare(inputs, sampling_params)
        conv = None if conversation_params is None else conversation_params.conversation_id
        previous = [c.prompt for c in self.calls if conv is not None and c.conversation_id == conv]
        self.calls.append(Call(prompt, conv, cache_salt, caller_params, streaming))
        self.events.append("request")
        answer = ChatMLTokenizer().encode(f"answer to {len(prompt)} tokens", add_special_tokens=False)
        answer.append(sp.end_id)
        reused = 0
        if previous:  # "reuse" the common prefix with the conversation's last prompt, in blocks of 4
            common = 0
            for a, b in zip(previous[-1], prompt, strict=False):
                if a != b:
                    break
                common += 1
            reused = common // 4
        abort = threading.Event()
        result = RequestOutput(100 + len(self.calls), sp, self.tokenizer, streaming,
                               self._responses(answer, sp, reused, abort), abort.set)
        self.results.append(result)
        return result

    def _responses(self, answer: list[int], sp: SamplingParams, reused: int,
                   abort: threading.Event) -> Iterator[Response]:
        sent: list[int] = []
        steps = 0
        while True:
            steps += 1
            if abort.is_set():
                yield Response([], "CANCELLED", True, steps, self._perf(sp, steps, reused))
                return
            new = []
            for token in answer[len(sent): len(sent) + 2]:  # the sampler stops at the end id or the budget
                new.append(token)
                if token == sp.end_id or len(sent) + len(new) >= sp.max_tokens:
                    break
            sent += new
            finish = ("END_ID" if sent[-1] == sp.end_id else
                      "LENGTH" if len(sent) >= sp.max_tokens else None)
            yield Response(new, finish, finish is not None, steps,
                           self._perf(sp, steps, reused) if finish else None)
            if finish:
                return

    def _perf(self, sp: SamplingParams, steps: int, reused: int) -> RequestPerfMetrics | None:
        if not sp.return_perf_metrics:
            return None
        drafted, accepted = (3 * steps, steps) if self.SPEC_DEC_FILLED else (0, 0)
        return RequestPerfMetrics(
            kv_cache_metrics=KvCacheMetrics(num_reused_blocks=reused, kv_cache_hit_rate=0.25),
            speculative_decoding=SpeculativeDecodingMetrics(
                acceptance_rate=accepted / drafted if drafted else 0.0,
                total_accepted_draft_tokens=accepted, total_draft_tokens=drafted))


@functools.cache
def reference_model() -> Any:
    """The package's reference weights (float32), loaded once for every ExecutorLLM."""
    from trtllm_mtp_carry.engine.model import load_reference

    return load_reference()[0]


class ExecutorLLM(_LlmApi):
    """The LLM API over the package's CPU STAND-IN executor (`trtllm_mtp_carry/trtllm/standin/`,
    not TensorRT-LLM), built in process (`llm._executor.engine`, as with
    `TLLM_WORKER_USE_SINGLE_PROCESS=1`), so the real adapter attaches and its resource
    manager runs every turn. Requests get LLM API ids of their own (from 1001), distinct
    from the executor's ids, as TensorRT-LLM's worker's client ids are; each response
    steps the executor, which advances every request it holds. Its tokenizer is the
    ChatML stand-in over the reference's vocabulary."""

    instances: list[ExecutorLLM] = []
    CHUNK = 32  # the stand-in executor's prefill chunk and tokens per block

    def __init__(self, model: Any, **kwargs: Any) -> None:
        from trtllm_mtp_carry.trtllm.standin import create_py_executor

        super().__init__(model, **kwargs)
        # the package's stand-in executor, built as TensorRT-LLM's creator builds it, from the
        # kv_cache_config the model's LLM keywords give (over Qwen3-Next's defaults: reuse off)
        # and its speculative_config (none: no drafter; MTP's `num_nextn_predict_layers` is the
        # deprecated alias of `max_draft_len`, as in TorchLlmArgs)
        spec = kwargs.get("speculative_config") or {}
        draft_len = int(spec.get("max_draft_len", spec.get("num_nextn_predict_layers", 1))) if spec else 0
        engine = create_py_executor(reference_model(), kv_cache_config=kwargs.get("kv_cache_config"),
                                    decoding_type=str(spec.get("decoding_type", "MTP")), max_draft_len=draft_len,
                                    chunk_size=self.CHUNK, tokens_per_block=self.CHUNK, max_batch=4)
        self._executor = SimpleNamespace(engine=engine)  # llm._executor.engine, as in TensorRT-LLM
        # llm.args: the TorchLlmArgs the executor was built from (what `attach` reads)
        for name in ("speculative_config", "kv_cache_config", "cache_transceiver_config"):
            setattr(self.args, name, getattr(engine.llm_args, name))
        self.tokenizer = None if kwargs.get("skip_tokenizer_init") else TransformersTokenizer(ReferenceChatTokenizer())
        self._next_id = 1000
        ExecutorLLM.instances.append(self)

    @property
    def executor(self) -> Any:
        return self._executor.engine

    def generate_async(self, inputs, sampling_params=None, *, streaming=False, conversation_params=None,
                       cache_salt=None):
        prompt, sp = self._prepare(inputs, sampling_params)
        self._next_id += 1
        conv = None if conversation_params is None else conversation_params.conversation_id
        executor = self.executor
        req = executor.submit(prompt, sp.max_tokens, conversation_id=conv, cache_salt=cache_salt,
                              client_id=self._next_id)
        return RequestOutput(req.py_client_id, sp, self.tokenizer, streaming,
                             self._responses(executor, req, sp),
                             lambda: executor.cancel(req.py_request_id))

    def _responses(self, executor: Any, req: Any, sp: SamplingParams) -> Iterator[Response]:
        sent = 0
        while True:
            if not req.is_finished:
                executor.step()
            output = list(req.output)
            new, sent = output[sent:], len(output)
            steps = req.verify_steps + 1  # the context step, then one per verify
            if not req.is_finished:
                if new:  # the executor responds only when the request has new tokens
                    yield Response(new, None, False, steps)
                continue
            finish = ("CANCELLED" if req.is_finished_due_to_cancellation else
                      "END_ID" if output and output[-1] == sp.end_id else "LENGTH")
            perf = RequestPerfMetrics(
                kv_cache_metrics=KvCacheMetrics(num_reused_blocks=req.reused // self.CHUNK),
                speculative_decoding=SpeculativeDecodingMetrics(
                    acceptance_rate=req.accepted / req.drafted if req.drafted else 0.0,
                    total_accepted_draft_tokens=req.accepted, total_draft_tokens=req.drafted),
            ) if sp.return_perf_metrics else None
            yield Response(new, finish, True, steps, perf)
            return


_CONFIG_SECTIONS = ("quant_config", "calib_config", "build_config", "kv_cache_config", "decoding_config",
                    "enable_build_cache", "peft_cache_config", "scheduler_config", "speculative_config",
                    "batching_type", "extended_runtime_perf_knob_config", "cache_transceiver_config",
                    "lora_config")


def update_llm_args_with_extra_dict(llm_args: dict, llm_args_dict: dict,
                                    extra_llm_api_options: str | None = None) -> dict:
    """`update_llm_args_with_extra_dict` (`tensorrt_llm/llmapi/llm_args.py@fcd3f316`, re-exported
    by `llm_utils`): each config section present is built into its config class (the stand-in
    has none: it requires the mapping `Config(**section)` needs), then `llm_args | llm_args_dict`."""
    for name in _CONFIG_SECTIONS:
        if name in llm_args_dict and not isinstance(llm_args_dict[name], Mapping):
            raise TypeError(f"{name}: argument after ** must be a mapping, not "
                            f"{type(llm_args_dict[name]).__name__}")
    return llm_args | llm_args_dict


def install_tensorrt_llm(monkeypatch: Any, llm: type = LLM) -> None:
    """Put the stand-in modules in sys.modules under TensorRT-LLM's names (for this test only);
    `llm` is the stand-in `tensorrt_llm.LLM` (`LLM`, or `ExecutorLLM` for the real adapter)."""
    root = types.ModuleType("tensorrt_llm")
    root.LLM, root.SamplingParams = llm, SamplingParams  # type: ignore[attr-defined]
    conv = types.ModuleType("tensorrt_llm.conversation_params")
    conv.ConversationParams = ConversationParams  # type: ignore[attr-defined]
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    utils = types.ModuleType("tensorrt_llm.llmapi.llm_utils")
    utils.update_llm_args_with_extra_dict = update_llm_args_with_extra_dict  # type: ignore[attr-defined]
    for name, module in (("tensorrt_llm", root), ("tensorrt_llm.conversation_params", conv),
                         ("tensorrt_llm.llmapi", llmapi), ("tensorrt_llm.llmapi.llm_utils", utils)):
        monkeypatch.setitem(sys.modules, name, module)
    LLM.instances.clear()
    ExecutorLLM.instances.clear()


# ---- Triton's pb_utils test double ---------------------------------------------------------


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
