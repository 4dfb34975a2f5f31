"""Stand-in for `tensorrt_llm/_torch/pyexecutor/llm_request.py`: `LlmRequest` and its state machine.

Read (nothing ran): `llm_request.py` @ 002f3cc3 (`LlmRequestState =
tensorrt_llm.bindings.LlmRequestState`, `FinishReason`, `executor_request_to_llm_request`:
only `cache_salt=executor_request.cache_salt` (no `cache_salt_id`; older builds passed that
id, which this stand-in's requests also carry for the package's fallback), the client id
else the request id);
`cpp/include/tensorrt_llm/batch_manager/llmRequest.h` @ 00e9b8a7 (the state values,
every `is*State` predicate, `finishByReason`, `isLastContextChunk`); the nanobind names
@ cc8cd5af. `expect_snapshot_points` is the list `prepare_expect_snapshot_points`
fills before scheduling (`mamba_cache_manager/common.py` @ 28295084); the package never
reads it (not in `TRTLLM_NAMES`).

Invariant: `state` moves as PyExecutor moves it (see `LlmRequest`); every predicate has
the C++ semantics (docs/TRTLLM-CONFORMANCE.md section 1, the truth table).
"""

from __future__ import annotations

import enum

from .conformant import Conformant
from .conversation_params import ConversationParams


class LlmRequestState(enum.IntEnum):
    """`tensorrt_llm.bindings.LlmRequestState`: the C++ `LlmRequestState` values and order.

    Read in `cpp/include/tensorrt_llm/batch_manager/llmRequest.h` (commit 00e9b8a7):
    "Enum order must follow chronological order" (`hasReachedState` compares values).
    """

    DISAGG_TRANS_ERROR = -1
    UNKNOWN = 0
    ENCODER_INIT = 1
    DISAGG_GENERATION_INIT = 8
    DISAGG_GENERATION_TRANS_IN_PROGRESS = 9
    CONTEXT_INIT = 10
    DISAGG_CONTEXT_INIT_AND_TRANS = 11
    DISAGG_GENERATION_TRANS_COMPLETE = 12
    GENERATION_IN_PROGRESS = 13
    GENERATION_TO_COMPLETE = 14
    GENERATION_COMPLETE = 20
    DISAGG_CONTEXT_TRANS_IN_PROGRESS = 21
    DISAGG_CONTEXT_COMPLETE = 22


class FinishReason(enum.Enum):
    """`tensorrt_llm.bindings.executor.FinishReason` (the members the stand-in's executor sets)."""

    NOT_FINISHED = 0
    END_ID = 1
    STOP_WORDS = 2
    LENGTH = 3
    TIMED_OUT = 4
    CANCELLED = 5


_S = LlmRequestState


def is_context_init_state(state: LlmRequestState) -> bool:
    """C++ `isContextInitState`: CONTEXT_INIT or DISAGG_CONTEXT_INIT_AND_TRANS."""
    return state in (_S.CONTEXT_INIT, _S.DISAGG_CONTEXT_INIT_AND_TRANS)


def is_generation_in_progress_state(state: LlmRequestState) -> bool:
    """C++ `isGenerationInProgressState`: GENERATION_IN_PROGRESS, GENERATION_TO_COMPLETE or
    DISAGG_GENERATION_TRANS_COMPLETE."""
    return state in (_S.GENERATION_IN_PROGRESS, _S.GENERATION_TO_COMPLETE,
                     _S.DISAGG_GENERATION_TRANS_COMPLETE)


def is_context_finished(state: LlmRequestState) -> bool:
    """C++ `isContextFinished`: generation in progress, or DISAGG_CONTEXT_INIT_AND_TRANS.
    False at GENERATION_COMPLETE: every request the executor frees has this False."""
    return is_generation_in_progress_state(state) or state is _S.DISAGG_CONTEXT_INIT_AND_TRANS


def is_generation_complete_state(state: LlmRequestState) -> bool:
    """C++ `isGenerationCompleteState`: GENERATION_COMPLETE only."""
    return state is _S.GENERATION_COMPLETE


def is_finished(state: LlmRequestState) -> bool:
    """C++ `isFinished`: GENERATION_COMPLETE or DISAGG_CONTEXT_TRANS_IN_PROGRESS."""
    return state in (_S.GENERATION_COMPLETE, _S.DISAGG_CONTEXT_TRANS_IN_PROGRESS)


def get_cache_salt_id(cache_salt: str) -> int:
    """The stand-in's `tensorrt_llm.inputs.utils.get_cache_salt_id`: a 64-bit id of the salt text.

    TensorRT-LLM hashes the UTF-8 salt to 8 bytes (blake3, little-endian); the stand-in
    uses blake2b (blake3 is not installed here): the same contract, one id per salt text.
    """
    import hashlib

    return int.from_bytes(hashlib.blake2b(cache_salt.encode("utf-8"), digest_size=8).digest(), "little")


class LlmRequest(Conformant):
    """Stand-in for the executor's `LlmRequest` (`_torch/pyexecutor/llm_request.py` over the
    nanobind `LlmRequest`): the names of docs/TRTLLM-CONFORMANCE.md, with their semantics.

    `state` moves as PyExecutor moves it: CONTEXT_INIT while context chunks run
    (`context_current_position` advances by `context_chunk_size` after each forward),
    GENERATION_IN_PROGRESS after the last chunk (the sampler appended the first token),
    GENERATION_COMPLETE when finished (`finish_by_reason`, or `_handle_errors` setting it
    directly). The stand-in's own bookkeeping (`prompt`, `tokens`, `output`, acceptance
    counters) is not in `TRTLLM_NAMES`: package code outside the stand-in reading one of
    those gets AttributeError, as it would on TensorRT-LLM.
    """

    TRTLLM_CLASS = "LlmRequest"

    def __init__(self, py_request_id: int, prompt: list[int], max_new_tokens: int,
                 py_conversation_params: ConversationParams | None = None,
                 cache_salt: str | None = None, lora_task_id: int | None = None,
                 is_dummy: bool = False, py_client_id: int | None = None) -> None:
        self.py_request_id = py_request_id
        self.prompt = list(prompt)
        self.original_prompt_len = len(prompt)  # the client's prompt (a recompute pause grows `prompt`)
        self.max_new_tokens = max_new_tokens
        self.py_conversation_params = py_conversation_params
        self.cache_salt = cache_salt  # what the client sent (the executor sees only the id)
        self.cache_salt_id = None if cache_salt is None else get_cache_salt_id(cache_salt)
        self.lora_task_id = lora_task_id
        self.is_dummy = is_dummy
        # TensorRT-LLM: the client id, else the request id (executor_request_to_llm_request)
        self.py_client_id = py_request_id if py_client_id is None else py_client_id
        self.state = LlmRequestState.CONTEXT_INIT
        self.context_current_position = 0
        self.prepopulated_prompt_len = 0
        self.context_chunk_size = 0
        self.finish_reasons = [FinishReason.NOT_FINISHED]
        self.failed = False
        self.py_draft_tokens: list[int] = []
        self.tokens = list(prompt)
        self.accepted = 0
        self.verify_steps = 0
        self.drafted = 0
        self.reused = 0  # tokens the target's prefix cache served (R)
        self.expect_snapshot_points: list[int] = []  # prepare_expect_snapshot_points fills it

    @property
    def is_dummy_request(self) -> bool:
        return self.is_dummy

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    def get_tokens(self, beam: int) -> list[int]:
        if beam != 0:
            raise ValueError(f"beam {beam}: the stand-in runs beam width 1")
        return self.tokens

    def get_num_tokens(self, beam: int) -> int:
        if beam != 0:
            raise ValueError(f"beam {beam}: the stand-in runs beam width 1")
        return len(self.tokens)

    @property
    def is_context_init_state(self) -> bool:
        return is_context_init_state(self.state)

    @property
    def is_context_finished(self) -> bool:
        return is_context_finished(self.state)

    @property
    def is_generation_in_progress_state(self) -> bool:
        return is_generation_in_progress_state(self.state)

    @property
    def is_generation_complete_state(self) -> bool:
        return is_generation_complete_state(self.state)

    @property
    def is_finished(self) -> bool:
        return is_finished(self.state)

    @property
    def is_finished_due_to_length(self) -> bool:
        """C++ `isFinishedDueToLength`: every beam's finish reason is LENGTH."""
        return all(r is FinishReason.LENGTH for r in self.finish_reasons)

    @property
    def is_finished_due_to_cancellation(self) -> bool:
        """Every beam's finish reason is CANCELLED (the name PyExecutor's code reads)."""
        return all(r is FinishReason.CANCELLED for r in self.finish_reasons)

    @property
    def is_last_context_chunk(self) -> bool:
        """C++ `isLastContextChunk` (non-disaggregated): this chunk reaches the prompt's end."""
        return self.context_current_position + self.context_chunk_size == self.prompt_len

    def finish_by_reason(self, reason: FinishReason) -> None:
        """C++ `finishByReason`: unfinished beams get `reason`; the state is GENERATION_COMPLETE."""
        self.finish_reasons = [reason if r is FinishReason.NOT_FINISHED else r
                               for r in self.finish_reasons]
        self.state = LlmRequestState.GENERATION_COMPLETE

    def reset_for_recompute(self, max_input_len: int = 0x7FFFFFFF) -> None:
        """`LlmRequest.reset_for_recompute` as `_pause_recompute_paused_requests` calls it
        (`py_executor.py` @ 0004396720054fd8e205cbf616f21f0b57c6b412, with
        `_UNBOUNDED_PAUSE_MAX_INPUT_LEN`: "Recompute pause should replay all generated tokens"):
        every token it had is now its prompt, and it is a context request again from position 0
        (the KV manager's lookup sets the reused position when it is admitted again)."""
        self.prompt = list(self.tokens[:max_input_len])
        self.state = LlmRequestState.CONTEXT_INIT
        self.context_current_position = self.prepopulated_prompt_len = self.context_chunk_size = 0
        self.py_draft_tokens = []

    @property
    def output(self) -> list[int]:
        """The tokens generated after the client's prompt (across recompute pauses)."""
        return self.tokens[self.original_prompt_len:]
