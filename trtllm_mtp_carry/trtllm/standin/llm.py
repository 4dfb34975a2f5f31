"""Stand-in for `tensorrt_llm/llmapi/llm.py`: `LLM`, with TensorRT-LLM's process split.

Read (nothing ran): `llm.py` @ 814964c0 (`generate_async(..., conversation_params=,
cache_salt=)`, `shutdown`, `tokenizer`), notes sections 0 and 0a: the default `LLM(...)`
builds the PyExecutor in a worker process (`llm._executor` is a proxy without
`engine`); with `TLLM_WORKER_USE_SINGLE_PROCESS=1` set before the first LLM,
`llm._executor.engine` is the in-process executor (TP=1).

Invariant: the executor is built by `py_executor_creator.create_py_executor`, the
worker hook applied where `TRTLLM_MTP_CARRY_WORKER` is set.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...engine.model import HybridLM
from . import py_executor_creator
from .conformant import Conformant
from .conversation_params import ConversationParams
from .llm_request import LlmRequest
from .py_executor import StandinPyExecutor


class _Proxy(Conformant):
    """The LLM's `_executor` (a `GenerationExecutor`): in-process, `engine` is the PyExecutor."""

    TRTLLM_CLASS = "GenerationExecutor"

    def __init__(self, engine: StandinPyExecutor) -> None:
        self.engine = engine


class _WorkerProxy(Conformant):
    """The LLM's `_executor` when the PyExecutor lives in a worker process (the default):
    `GenerationExecutorProxy` has no `engine`; the stand-in keeps the worker's executor
    where package code cannot reach it (`worker_executor`, for tests only)."""

    TRTLLM_CLASS = "GenerationExecutor"

    def __init__(self, engine: StandinPyExecutor) -> None:
        self.worker_executor = engine


class StandinLLM(Conformant):
    """A stand-in `tensorrt_llm.LLM`, with TensorRT-LLM's process split.

    By default (as TensorRT-LLM) the PyExecutor is built "in a worker process":
    `_executor` is a proxy without `engine`, and the executor is created through
    `create_py_executor_instance` with the `TRTLLM_MTP_CARRY_WORKER` worker hook applied
    when that variable is set (`trtllm.worker.boot`, what the `.pth` line runs in
    every TensorRT-LLM worker). `executor_options` are `create_py_executor`'s
    (`kv_cache_config`, as in `llm.yaml`; none: Qwen3-Next's defaults, block reuse off). `single_process=True`, or
    `TLLM_WORKER_USE_SINGLE_PROCESS=1` in the environment, builds it in process:
    `llm._executor.engine` is the executor and `attach(llm)` reaches it.
    `generate_async` takes `conversation_params` and `cache_salt` as TensorRT-LLM's
    does; it queues the request and returns it (drive it with `run_until_done`).
    """

    TRTLLM_CLASS = "LLM"

    def __init__(self, model: HybridLM, *, single_process: bool | None = None,
                 **executor_options: Any) -> None:
        import os

        if single_process is None:
            single_process = os.environ.get("TLLM_WORKER_USE_SINGLE_PROCESS") == "1"
        if single_process:
            self._executor: _Proxy | _WorkerProxy = _Proxy(
                py_executor_creator.create_py_executor(model, **executor_options))
            return
        from .. import worker

        worker.boot()  # the worker process's interpreter start (the .pth line)
        self._executor = _WorkerProxy(py_executor_creator.create_py_executor(model, **executor_options))

    @property
    def args(self) -> Any:
        """`LLM.args`: the `TorchLlmArgs` the executor was built from (the stand-in's
        `_util.StandinLlmArgs`: `speculative_config`, `cache_transceiver_config`,
        `kv_cache_compression_config` are TensorRT-LLM's names)."""
        return self.executor.llm_args

    @property
    def executor(self) -> StandinPyExecutor:
        """The PyExecutor, wherever it runs (the stand-in's handle for tests and scripts)."""
        proxy = self._executor
        return proxy.engine if isinstance(proxy, _Proxy) else proxy.worker_executor

    def generate_async(self, prompt_token_ids: Sequence[int], max_new_tokens: int = 32, *,
                       conversation_params: ConversationParams | None = None,
                       cache_salt: str | None = None, lora_task_id: int | None = None,
                       dummy: bool = False) -> LlmRequest:
        conv = None if conversation_params is None else conversation_params.conversation_id
        return self.executor.submit(prompt_token_ids, max_new_tokens, conversation_id=conv,
                                    cache_salt=cache_salt, lora_task_id=lora_task_id, dummy=dummy)

    def run_until_done(self) -> None:
        self.executor.run_until_done()

    def shutdown(self) -> None:
        return None
