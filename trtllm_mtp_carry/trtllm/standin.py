"""A CPU STAND-IN for TensorRT-LLM's `PyExecutor` and `LLM`: not TensorRT-LLM, never claimed as it.

What it is for: TensorRT-LLM cannot be installed here, so CI proves the
adapter's logic on this stand-in, which follows TensorRT-LLM's source row by
row (docs/TRTLLM-CONFORMANCE.md names each name, file and commit) and runs the
package's reference model (`engine/model.py`), so outputs and acceptance are real:

- the request state machine: `LlmRequestState` with the C++ values (including
  GENERATION_TO_COMPLETE and the disaggregated states) and every predicate with
  the C++ semantics (`is_context_finished` is False at GENERATION_COMPLETE, so
  at every free); finishing as PyExecutor does (`finish_by_reason` for end id,
  stop token, max tokens, cancel; the error path sets the state directly), then
  `free_resources`; the overlap scheduler's one-step lag as an option;
- resource managers assembled as `create_py_executor_instance` does (extras,
  the sequence slot manager, the KV cache manager last), `prepare_resources`
  forward and `free_resources` reversed; KV cache estimation's two builds;
- the process split: the default `StandinLLM` builds its executor "in a worker"
  (`llm._executor` has no `engine`, as TensorRT-LLM's proxy), where only the
  worker hook (`trtllm.worker`) can install the carry; `single_process=True` (or
  `TLLM_WORKER_USE_SINGLE_PROCESS=1`) is the in-process executor `attach` reaches;
- a separate draft KV manager (`is_draft`, one MTP layer at index `num_layers`)
  with HND pages, `get_buffers`, `get_batch_cache_indices` and the pairing
  markers; a target manager with a prefix cache (attention rows plus the
  recurrent state at the end of each context, like the `per_conversation`
  policy), named as each TensorRT-LLM version names it (`VERSIONS`);
- the MTP layer's rows for the new span computed by the context phase, roped
  at position k as TensorRT-LLM's MTP rows are (the reference engine ropes at
  k + 1; attention is unchanged since RoPE is relative), the golden token at
  the last slot; generation runs MTP-Eagle steps: verify, then rows for all
  1 + D positions (those past the accepted tokens are junk), then draft steps
  that write rows past the accepted tokens too;
- topologies: `unpaired` (draft pages fresh and unwritten over the reused
  prefix: the blind drafter), `paired` (the draft pool commits its context
  pages to its own tree and the target's reuse is capped at the draft's matched
  depth), `folded` (no draft manager: the MTP layer's pages belong to the target
  manager and are restored with its prefix).

Invariants:
- Package code (any `trtllm_mtp_carry.*` module but this one) reading a name
  of a stand-in TensorRT-LLM class that is not in `TRTLLM_NAMES` gets
  AttributeError (`Conformant`): it can lean on nothing TensorRT-LLM lacks.
- Every page is owned by live requests and tree entries with a reference count;
  `check()` proves none leaked once nothing runs.
- Greedy decoding: the target verifies every draft, so outputs never depend on
  the drafter's rows.
"""

from __future__ import annotations

import abc
import enum
import sys
from collections import OrderedDict, deque
from collections.abc import Mapping as Mapping_
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from ..dataplane.rope import apply_rope_reference
from ..engine.model import DenseTargetCache, HybridLM

BAD_PAGE_INDEX = -1

TRTLLM_NAMES: dict[str, frozenset[str]] = {
    # class (as docs/TRTLLM-CONFORMANCE.md names it) -> the TensorRT-LLM names the stand-in has
    "LLM": frozenset({"_executor", "generate_async", "args", "shutdown", "tokenizer"}),
    "GenerationExecutor": frozenset({"engine"}),
    "PyExecutor": frozenset({"resource_manager", "model_engine"}),
    "ResourceManager": frozenset({
        "resource_managers", "prepare_resources", "update_resources", "free_resources",
        "get_resource_manager"}),
    "ScheduledRequests": frozenset({"context_requests", "generation_requests", "all_requests"}),
    "KVCacheManagerV2": frozenset({
        "is_draft", "dtype", "mapping", "enable_block_reuse", "tokens_per_block", "layer_offsets",
        "enable_joint_kv_cache_reuse", "_can_publish_block_reuse", "_supports_joint_kv_cache_reuse",
        "_fresh_page_fill", "_stream", "get_buffers",
        "get_batch_cache_indices", "prepare_resources", "update_resources", "free_resources",
        "add_dummy_requests", "shutdown", "get_max_resource_count",
        "get_needed_resource_to_completion"}),
    "LlmRequest": frozenset({
        "py_request_id", "py_client_id", "prompt_len", "max_new_tokens", "state",
        "context_current_position", "context_chunk_size", "prepopulated_prompt_len",
        "get_tokens", "get_num_tokens", "py_conversation_params", "cache_salt", "cache_salt_id",
        "lora_task_id", "is_dummy_request", "is_context_init_state", "is_context_finished",
        "is_generation_in_progress_state", "is_generation_complete_state", "is_finished",
        "is_finished_due_to_length", "is_finished_due_to_cancellation", "is_last_context_chunk",
        "finish_by_reason"}),
}
"""Every TensorRT-LLM name a stand-in class answers to package code (the rows of
docs/TRTLLM-CONFORMANCE.md, pinned equal by tests/trtllm/test_trtllm_conformance.py)."""


class Conformant:
    """Base of the stand-in classes that play a TensorRT-LLM class (`TRTLLM_CLASS`).

    Package code (any `trtllm_mtp_carry.*` module but this one) reading a name that is
    not in `TRTLLM_NAMES[TRTLLM_CLASS]` gets AttributeError, as it would on TensorRT-LLM:
    `getattr(obj, name, default)` gets the default, `hasattr` False. The stand-in's own
    code, tests and scripts see the stand-in's bookkeeping too.
    """

    TRTLLM_CLASS: str = ""

    def __getattribute__(self, name: str) -> Any:
        if name[:2] == "__" or name in TRTLLM_NAMES[type(self).TRTLLM_CLASS]:
            return object.__getattribute__(self, name)
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith("trtllm_mtp_carry.") and caller != __name__:
            raise AttributeError(
                f"TensorRT-LLM's {type(self).TRTLLM_CLASS} has no {name!r} in "
                "docs/TRTLLM-CONFORMANCE.md: the stand-in refuses what TensorRT-LLM lacks")
        return object.__getattribute__(self, name)



class DataType(enum.Enum):
    """Stand-in for `tensorrt_llm.bindings.DataType` (the adapter reads `.name`)."""

    BF16 = "BF16"
    HALF = "HALF"
    FLOAT = "FLOAT"
    FP8 = "FP8"


_TORCH_DTYPES = {DataType.BF16: torch.bfloat16, DataType.HALF: torch.float16,
                 DataType.FLOAT: torch.float32, DataType.FP8: torch.float16}


class ResourceManagerType(enum.Enum):
    """Stand-in for TensorRT-LLM's `ResourceManagerType` (the keys of `resource_managers`)."""

    KV_CACHE_MANAGER = "KV_CACHE_MANAGER"
    DRAFT_KV_CACHE_MANAGER = "DRAFT_KV_CACHE_MANAGER"
    SEQ_SLOT_MANAGER = "SEQ_SLOT_MANAGER"


@dataclass
class Mapping:
    """Stand-in for `tensorrt_llm.mapping.Mapping` (the fields the adapter reads)."""

    tp_size: int = 1
    enable_attention_dp: bool = False


@dataclass(slots=True, kw_only=True)
class ConversationParams:
    """Stand-in for `tensorrt_llm.conversation_params.ConversationParams` (stripped, non-empty)."""

    conversation_id: str

    def __post_init__(self) -> None:
        self.conversation_id = self.conversation_id.strip()
        if not self.conversation_id:
            raise ValueError("conversation_id must be a non-empty string")


class BaseResourceManager(abc.ABC):
    """Stand-in for TensorRT-LLM's `BaseResourceManager` protocol (resource_manager.py)."""

    @abc.abstractmethod
    def get_max_resource_count(self) -> int: ...

    @abc.abstractmethod
    def get_needed_resource_to_completion(self, request: Any) -> int: ...

    def add_dummy_requests(self, request_ids: list[int]) -> None:
        return None

    def prepare_resources(self, scheduled_batch: ScheduledRequests) -> None:
        return None

    def update_resources(self, scheduled_batch: ScheduledRequests) -> None:
        return None

    def free_resources(self, request: Any) -> None:
        return None

    def shutdown(self) -> None:
        return None


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


_REQUEST_STATE_PREDICATES = {
    "is_context_init_state": is_context_init_state,
    "is_context_finished": is_context_finished,
    "is_generation_in_progress_state": is_generation_in_progress_state,
    "is_generation_complete_state": is_generation_complete_state,
    "is_finished": is_finished,
}


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
        self.reused = 0  # tokens the target's prefix cache served

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

    @property
    def output(self) -> list[int]:
        return self.tokens[len(self.prompt):]


@dataclass
class ScheduledRequests(Conformant):
    """Stand-in for the scheduler's batch: context requests (one chunk each) and generation requests."""

    TRTLLM_CLASS = "ScheduledRequests"

    context_requests: list[LlmRequest] = field(default_factory=list)
    generation_requests: list[LlmRequest] = field(default_factory=list)

    def all_requests(self) -> list[LlmRequest]:
        return self.context_requests + self.generation_requests


class ResourceManager(Conformant):
    """Stand-in for TensorRT-LLM's `ResourceManager`: an OrderedDict, prepare forward, free reversed.

    `calls` records `(manager name, "prepare" | "free", request id)` in call order.
    """

    TRTLLM_CLASS = "ResourceManager"

    def __init__(self, managers: OrderedDict[Any, Any]) -> None:
        self.resource_managers = managers
        self.calls: list[tuple[str, str, int]] = []

    def prepare_resources(self, batch: ScheduledRequests) -> None:
        for key, manager in self.resource_managers.items():
            for r in batch.context_requests:
                self.calls.append((_name(key), "prepare", r.py_request_id))
            manager.prepare_resources(batch)

    def update_resources(self, batch: ScheduledRequests) -> None:
        for manager in self.resource_managers.values():
            manager.update_resources(batch)

    def free_resources(self, request: LlmRequest) -> None:
        for key, manager in reversed(self.resource_managers.items()):
            self.calls.append((_name(key), "free", request.py_request_id))
            manager.free_resources(request)

    def get_resource_manager(self, name: Any) -> Any:
        return self.resource_managers.get(name)


def _name(key: object) -> str:
    name = getattr(key, "name", key)
    return str(name)


class PagedRows:
    """One layer's paged HND KV `[pages, 2, kv_heads, tpb, head_dim]`, pages reference-counted."""

    def __init__(self, num_pages: int, num_kv_heads: int, tpb: int, head_dim: int,
                 dtype: torch.dtype) -> None:
        self.buf = torch.zeros(num_pages, 2, num_kv_heads, tpb, head_dim, dtype=dtype)
        self.tpb = tpb
        self._free: deque[int] = deque(range(num_pages))
        self._refs = [0] * num_pages
        self.tables: dict[int, list[int]] = {}

    def ensure(self, rid: int, num_tokens: int) -> None:
        table = self.tables.setdefault(rid, [])
        while len(table) * self.tpb < num_tokens:
            table.append(self.new_page())

    def new_page(self) -> int:
        if not self._free:
            raise RuntimeError("stand-in draft pool: out of pages")
        page = self._free.popleft()
        self._refs[page] = 1
        # zeroed at allocation, before any manager's prepare, so a blind drafter reads zeros
        # (as trtllm_smoke.py's blind run does); TensorRT-LLM leaves fresh pages unwritten
        self.buf[page].zero_()
        return page

    def share(self, page: int) -> int:
        self._refs[page] += 1
        return page

    def unref(self, page: int) -> None:
        self._refs[page] -= 1
        if self._refs[page] == 0:
            self._free.append(page)

    def release(self, rid: int) -> None:
        for page in self.tables.pop(rid, []):
            self.unref(page)

    def write(self, rid: int, lo: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keys `[lo, lo + n)` get `k` (roped), `v` `[n, Hkv, D]` (the attention kernel's write)."""
        keys = torch.arange(lo, lo + k.shape[0])
        table = torch.tensor(self.tables[rid], dtype=torch.int64)
        page, slot = table[keys // self.tpb], keys % self.tpb
        self.buf[page, 0, :, slot] = k.to(self.buf.dtype)
        self.buf[page, 1, :, slot] = v.to(self.buf.dtype)

    def read(self, rid: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(k, v)` `[hi - lo, Hkv, D]` of keys `[lo, hi)` (what the attention kernel reads)."""
        keys = torch.arange(lo, hi)
        table = torch.tensor(self.tables[rid], dtype=torch.int64)
        page, slot = table[keys // self.tpb], keys % self.tpb
        return self.buf[page, 0, :, slot], self.buf[page, 1, :, slot]

    def pages_in_use(self) -> int:
        return sum(1 for r in self._refs if r)


class KVCacheManagerV2(Conformant, BaseResourceManager):
    """Stand-in for `KVCacheManagerV2`: the attributes the adapter probes, over `PagedRows`.

    Pairing markers as #18093 has them: `enable_joint_kv_cache_reuse` (the manager
    was built with `joint_kv_cache_reuse=`) and `_can_publish_block_reuse`
    (`joint_kv_cache_reuse or not is_draft`); a build without them is modelled by
    deleting them (`del manager.enable_joint_kv_cache_reuse`).
    """

    TRTLLM_CLASS = "KVCacheManagerV2"

    def __init__(self, *, is_draft: bool, mtp_layer: int, paged: PagedRows | None,
                 dtype: DataType, mapping: Mapping, enable_block_reuse: bool) -> None:
        self.is_draft = is_draft
        self.dtype = dtype
        self.mapping = mapping
        self.enable_block_reuse = enable_block_reuse
        self.paged = paged
        self.mtp_layer = mtp_layer
        self.tokens_per_block = paged.tpb if paged is not None else 0
        self.layer_offsets = {mtp_layer: 0} if is_draft else {}
        self.enable_joint_kv_cache_reuse = False
        self._can_publish_block_reuse = not is_draft
        self._fresh_page_fill: object | None = None  # TRTLLM_KV_FRESH_PAGE_FILL unset: off
        self._stream = None  # CPU: no stream

    def get_max_resource_count(self) -> int:
        return 1

    def get_needed_resource_to_completion(self, request: Any) -> int:
        return 0

    def get_buffers(self, layer_idx: int, kv_layout: str = "NHD") -> torch.Tensor | None:
        if self.paged is None or layer_idx != self.mtp_layer:
            return None
        buf = self.paged.buf
        if kv_layout == "HND":
            return buf
        return buf.reshape(buf.shape[0], 2, buf.shape[3], buf.shape[2], buf.shape[4])  # as V2 does

    def get_batch_cache_indices(self, request_ids: list[int], layer_idx: int | None = None,
                                num_blocks_per_seq: Sequence[int] | None = None) -> list[list[int]]:
        assert self.paged is not None
        rows = [list(self.paged.tables.get(rid, [])) for rid in request_ids]
        if num_blocks_per_seq is not None:
            rows = [r[:n] for r, n in zip(rows, num_blocks_per_seq, strict=True)]
        return rows


@dataclass
class _TargetEntry:
    tokens: list[int]
    attn: dict[int, tuple[torch.Tensor, torch.Tensor]]
    ssm: list[torch.Tensor | None]
    mtp: tuple[torch.Tensor, torch.Tensor] | None  # folded: the MTP rows of keys [0, P)


class TargetKVManager(KVCacheManagerV2):
    """The target's KV (dense per request) with a prefix cache of context ends, per reuse scope."""

    def __init__(self, model: HybridLM, *, enable_block_reuse: bool, entries: int,
                 folded_paged: PagedRows | None, mtp_layer: int, dtype: DataType,
                 mapping: Mapping) -> None:
        super().__init__(is_draft=False, mtp_layer=mtp_layer, paged=folded_paged, dtype=dtype,
                         mapping=mapping, enable_block_reuse=enable_block_reuse)
        self.model = model
        self.entries = entries
        self.caches: dict[int, DenseTargetCache] = {}
        self.prefix: OrderedDict[tuple[Any, ...], _TargetEntry] = OrderedDict()
        if folded_paged is not None:
            self.layer_offsets = {mtp_layer: model.cfg.num_layers}

    def match(self, req: LlmRequest) -> _TargetEntry | None:
        """The longest cached context end that is a proper prefix of the prompt, in its scope."""
        if not self.enable_block_reuse:
            return None
        best = None
        scope = (req.cache_salt, req.lora_task_id)
        for (s, *_), e in self.prefix.items():
            n = len(e.tokens)
            if s == scope and n < len(req.prompt) and req.prompt[:n] == e.tokens:
                if best is None or n > len(best.tokens):
                    best = e
        return best

    def prepare_context(self, req: LlmRequest, entry: _TargetEntry | None) -> None:
        """Create the request's cache from `entry` (None: cold); sets context_current_position."""
        cache = DenseTargetCache(self.model.cfg)
        if entry is not None:
            for i, (k, v) in entry.attn.items():
                cache.attn_append(i, k.clone(), v.clone())
            cache.restore_ssm(entry.ssm)
            self.prefix.move_to_end(((req.cache_salt, req.lora_task_id), tuple(entry.tokens)))
            if self.paged is not None and entry.mtp is not None:  # folded: reused with the target
                self.paged.ensure(req.py_request_id, len(entry.tokens))
                self.paged.write(req.py_request_id, 0, *entry.mtp)
        self.caches[req.py_request_id] = cache
        reused = 0 if entry is None else len(entry.tokens)
        # setContextCurrentPosition and setPrepopulatedPromptLen, as V2's prepare_context does
        req.context_current_position = req.prepopulated_prompt_len = req.reused = reused

    def commit_context(self, req: LlmRequest) -> None:
        """Cache the finished context (attention rows, recurrent state, folded MTP rows)."""
        if not self.enable_block_reuse or req.is_dummy:
            return
        cache = self.caches[req.py_request_id]
        cfg = self.model.cfg
        attn = {i: tuple(t.clone() for t in cache.attn_past(i))
                for i, kind in enumerate(cfg.layer_types) if kind == "full"}
        mtp = None
        if self.paged is not None:
            mtp = self.paged.read(req.py_request_id, 0, len(req.prompt))
            mtp = (mtp[0].clone(), mtp[1].clone())
        key = ((req.cache_salt, req.lora_task_id), tuple(req.prompt))
        self.prefix[key] = _TargetEntry(list(req.prompt), attn, cache.snapshot_ssm(), mtp)  # type: ignore[arg-type]
        self.prefix.move_to_end(key)
        while len(self.prefix) > self.entries:
            self.prefix.popitem(last=False)

    def prepare_resources(self, scheduled_batch: ScheduledRequests) -> None:
        if self.paged is None:
            return
        for r in scheduled_batch.context_requests:  # folded: the MTP layer's pages are ours
            self.paged.ensure(r.py_request_id, r.context_current_position + r.context_chunk_size + 8)
        for r in scheduled_batch.generation_requests:
            self.paged.ensure(r.py_request_id, len(r.tokens) + 8)

    def free_resources(self, request: Any) -> None:
        self.caches.pop(request.py_request_id, None)
        if self.paged is not None:
            self.paged.release(request.py_request_id)


@dataclass
class _DraftEntry:
    tokens: list[int]  # keys [0, depth) consumed tokens[0 ..= depth]
    pages: list[int]


class DraftKVManager(KVCacheManagerV2):
    """The separate one-model draft pool (is_draft): fresh pages, or its own tree when paired."""

    def __init__(self, paged: PagedRows, *, mtp_layer: int, paired: bool, entries: int,
                 draft_len: int, dtype: DataType, mapping: Mapping, enable_block_reuse: bool) -> None:
        super().__init__(is_draft=True, mtp_layer=mtp_layer, paged=paged, dtype=dtype,
                         mapping=mapping, enable_block_reuse=enable_block_reuse)
        self.pool = paged  # the same PagedRows as self.paged, typed as present
        self.paired = paired  # what the pool does (the markers below say it; a build may lack them)
        self.enable_joint_kv_cache_reuse = paired
        self._can_publish_block_reuse = paired or not self.is_draft
        self.entries = entries
        self.draft_len = draft_len
        self.tree: OrderedDict[tuple[Any, ...], _DraftEntry] = OrderedDict()

    def rebuilt(self) -> DraftKVManager:
        """A fresh manager over the same pool and settings (after a teardown), markers kept."""
        fresh = DraftKVManager(self.pool, mtp_layer=self.mtp_layer, paired=self.paired,
                               entries=self.entries, draft_len=self.draft_len, dtype=self.dtype,
                               mapping=self.mapping, enable_block_reuse=self.enable_block_reuse)
        for name in ("enable_joint_kv_cache_reuse", "_can_publish_block_reuse"):
            if name not in vars(self):
                delattr(fresh, name)
        return fresh

    def match_depth(self, req: LlmRequest) -> tuple[int, _DraftEntry | None]:
        """Paired: the depth the draft tree serves for this prompt (0 unpaired)."""
        if not self.paired:
            return 0, None
        scope = (req.cache_salt, req.lora_task_id)
        best: _DraftEntry | None = None
        for (s, *_), e in self.tree.items():
            n = len(e.tokens)
            if s == scope and n <= len(req.prompt) and req.prompt[:n] == e.tokens:
                if best is None or n > len(best.tokens):
                    best = e
        return (0, None) if best is None else (len(best.tokens) - 1, best)

    def adopt_tree(self, req: LlmRequest, entry: _DraftEntry, depth: int) -> None:
        """Paired: full pages below `depth` are shared tree pages; a partial one is copied."""
        tpb = self.pool.tpb
        full = depth // tpb
        table = [self.pool.share(p) for p in entry.pages[:full]]
        if depth % tpb:
            page = self.pool.new_page()
            self.pool.buf[page] = self.pool.buf[entry.pages[full]]  # copy on write
            table.append(page)
        self.pool.tables[req.py_request_id] = table

    def commit_context(self, req: LlmRequest) -> None:
        """Paired: publish the context's pages (keys [0, L)) to the tree; a partial page is copied."""
        if not self.paired or req.is_dummy:
            return
        tpb, n = self.pool.tpb, len(req.prompt)
        table = self.pool.tables[req.py_request_id]
        pages = [self.pool.share(p) for p in table[: n // tpb]]
        if n % tpb:
            page = self.pool.new_page()
            self.pool.buf[page] = self.pool.buf[table[n // tpb]]
            pages.append(page)
        key = ((req.cache_salt, req.lora_task_id), tuple(req.tokens[: n + 1]))
        old = self.tree.pop(key, None)
        if old is not None:
            for p in old.pages:
                self.pool.unref(p)
        self.tree[key] = _DraftEntry(list(req.tokens[: n + 1]), pages)
        while len(self.tree) > self.entries:
            for p in self.tree.popitem(last=False)[1].pages:
                self.pool.unref(p)

    def prepare_resources(self, scheduled_batch: ScheduledRequests) -> None:
        # as _prepare_draft_resources: context_current_position + chunk + draft_len; generation
        # + 1 + D, plus D for the draft steps past the accepted tokens (the extra KV tokens)
        for r in scheduled_batch.context_requests:
            self.pool.ensure(r.py_request_id, r.context_current_position + r.context_chunk_size
                              + self.draft_len)
        for r in scheduled_batch.generation_requests:
            self.pool.ensure(r.py_request_id, len(r.tokens) + 1 + 2 * self.draft_len)

    def free_resources(self, request: Any) -> None:
        self.pool.release(request.py_request_id)


class SeqSlotManager(BaseResourceManager):
    """Stand-in for the sequence slot manager (holds nothing the carry reads)."""

    def get_max_resource_count(self) -> int:
        return 1

    def get_needed_resource_to_completion(self, request: Any) -> int:
        return 0


VERSIONS: dict[str, dict[str, Any]] = {
    # what a hybrid one-model MTP model with block reuse gets, per TensorRT-LLM version (README
    # "TensorRT-LLM versions"): the target manager's class, the pairing markers, the topology
    "1.2.1": {"target_class": "CppMambaHybridCacheManager", "markers": False,
              "supports_joint": None, "topology": "unpaired"},
    "1.3.0rc29": {"target_class": "MambaHybridCacheManagerV2", "markers": True,
                  "supports_joint": False, "topology": "unpaired"},
    "1.4.0rc1": {"target_class": "MambaHybridCacheManagerV2", "markers": True,
                 "supports_joint": False, "topology": "unpaired"},
    "main+19303": {"target_class": "MambaHybridCacheManagerV2", "markers": True,
                   "supports_joint": True, "topology": "paired"},
}
"""The stand-in's TensorRT-LLM version profiles (`StandinPyExecutor(version=...)`)."""


class StandinPyExecutor(Conformant):
    """A stand-in `PyExecutor`: chunked prefill, MTP-Eagle greedy speculation, TensorRT-LLM's managers.

    `topology` is `unpaired`, `paired` or `folded`; `enable_block_reuse=False`
    is the rebuild baseline (every turn prefills from 0); `max_draft_len=0` runs
    without speculation (no draft pool). `version` (a `VERSIONS` key) sets the
    target manager's class and the pairing markers as that release has them
    (and its topology, unless `topology` is given). `overlap_scheduler=True`
    keeps a request that finished in one step in the next step's batch (its
    forward runs, writing draft rows past its last token), then frees it, as
    PyExecutor's overlap loop does. Each `step()` runs one chunk of every
    context request and one speculative step of every generation request, at
    most `max_batch` requests. Requests move through `LlmRequestState` as in
    PyExecutor: `finish_by_reason` (END_ID, STOP_WORDS, LENGTH; CANCELLED by
    `cancel`) or the error path (`fail`: GENERATION_COMPLETE set directly),
    then `free_resources`. `estimate_kv_cache=True` builds the executor twice over one
    `resources` dict, the draft manager rebuilt in between, as `create_py_executor`
    does when it estimates the KV cache size.
    """

    TRTLLM_CLASS = "PyExecutor"

    def __init__(self, model: HybridLM, *, topology: str | None = None, enable_block_reuse: bool = True,
                 max_draft_len: int = 3, chunk_size: int = 64, tokens_per_block: int = 32,
                 num_pages: int = 4096, prefix_entries: int = 64, max_batch: int = 8,
                 kv_dtype: DataType = DataType.BF16, tp_size: int = 1,
                 enable_attention_dp: bool = False, version: str = "1.3.0rc29",
                 overlap_scheduler: bool = False, stop_token_ids: Sequence[int] = (),
                 extra_resource_managers: Mapping_[str, Any] | None = None,
                 estimate_kv_cache: bool = False) -> None:
        if version not in VERSIONS:
            raise ValueError(f"version must be one of {', '.join(VERSIONS)}, got {version!r}")
        profile = VERSIONS[version]
        topology = profile["topology"] if topology is None else topology
        if topology not in ("unpaired", "paired", "folded"):
            raise ValueError(f"topology must be unpaired, paired or folded, got {topology!r}")
        self.version = version
        self.resource_manager: ResourceManager  # built by create_py_executor_instance below
        self.overlap_scheduler = overlap_scheduler
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self._lagging: list[tuple[LlmRequest, FinishReason]] = []
        self.model = model.eval()
        self.cfg = cfg = model.cfg
        self.topology = topology
        self.draft_len = max_draft_len
        self.chunk_size = chunk_size
        self.max_batch = max_batch
        self.mtp_layer = cfg.num_layers  # the MTP layer's global index is num_hidden_layers
        mapping = Mapping(tp_size, enable_attention_dp)
        dtype = _TORCH_DTYPES[kv_dtype]
        self.model_engine = SimpleNamespace(model=model)
        self.paged = PagedRows(num_pages, cfg.num_kv_heads, tokens_per_block, cfg.head_dim, dtype)
        managers: OrderedDict[Any, Any] = OrderedDict()
        self.draft: DraftKVManager | None = None
        if max_draft_len > 0 and topology != "folded":
            self.draft = DraftKVManager(self.paged, mtp_layer=self.mtp_layer,
                                        paired=topology == "paired", entries=prefix_entries,
                                        draft_len=max_draft_len, dtype=kv_dtype, mapping=mapping,
                                        enable_block_reuse=enable_block_reuse)
            if not profile["markers"]:  # a build from before #18093: no pairing markers at all
                del self.draft.enable_joint_kv_cache_reuse
                del self.draft._can_publish_block_reuse
            managers[ResourceManagerType.DRAFT_KV_CACHE_MANAGER] = self.draft
        target_cls = _target_class(profile["target_class"], profile["supports_joint"])
        self.target = target_cls(
            model, enable_block_reuse=enable_block_reuse, entries=prefix_entries,
            folded_paged=self.paged if topology == "folded" and max_draft_len > 0 else None,
            mtp_layer=self.mtp_layer, dtype=kv_dtype, mapping=mapping)
        managers[ResourceManagerType.KV_CACHE_MANAGER] = self.target
        extra = extra_resource_managers or {}
        if estimate_kv_cache:  # as create_py_executor with KV cache estimation: build, tear the
            # KV managers down, build them again into the same dict, build the executor again
            create_py_executor_instance(self, managers, extra)
            self.estimation_draft = self.draft
            if self.draft is not None:
                self.draft = self.draft.rebuilt()
                managers[ResourceManagerType.DRAFT_KV_CACHE_MANAGER] = self.draft
            extra = {}  # already in `managers`: TensorRT-LLM would refuse to overwrite them
        create_py_executor_instance(self, managers, extra)
        self.waiting: deque[LlmRequest] = deque()
        self.active: list[LlmRequest] = []
        self.finished: dict[int, LlmRequest] = {}
        self._next_id = 1
        from ..engine.tokenizer import ChatTokenizer

        self._eos_id = ChatTokenizer().eos_id

    # ---- requests ------------------------------------------------------------------------

    def submit(self, prompt: Sequence[int], max_new_tokens: int, *,
               conversation_id: str | None = None, cache_salt: str | None = None,
               lora_task_id: int | None = None, dummy: bool = False,
               client_id: int | None = None) -> LlmRequest:
        """Queue a request (the executor request queue); returns its `LlmRequest`."""
        if len(prompt) < 2:
            raise ValueError(f"the stand-in needs a prompt of at least 2 tokens, got {len(prompt)}")
        params = None if conversation_id is None else ConversationParams(conversation_id=conversation_id)
        req = LlmRequest(self._next_id, list(prompt), max_new_tokens, params, cache_salt,
                         lora_task_id, is_dummy=dummy, py_client_id=client_id)
        self._next_id += 1
        self.waiting.append(req)
        return req

    def cancel(self, rid: int, *, failed: bool = False, free_first: bool = False) -> None:
        """Cancel a request (queued or running, mid-context too) between two steps.

        As `PyExecutor._handle_canceled_requests`: `finish_by_reason(CANCELLED)`, then
        `_terminate_request` (free); `free_first=True` is older PyExecutors' order
        (`_terminate_request`, then `finish_by_reason`: at free the request is still
        in its running state). `failed=True` is `_handle_errors` instead: the state is
        set to GENERATION_COMPLETE directly (no finish reason), then freed. A queued
        request is dropped before it got resources.
        """
        for req in list(self.waiting):
            if req.py_request_id == rid:
                self.waiting.remove(req)
                return
        for req in self.active:
            if req.py_request_id == rid:
                if failed:
                    req.failed = True
                    req.state = LlmRequestState.GENERATION_COMPLETE
                elif free_first:
                    self._terminate(req)
                    req.finish_by_reason(FinishReason.CANCELLED)
                    return
                else:
                    req.finish_by_reason(FinishReason.CANCELLED)
                self._terminate(req)
                return

    def fail(self, rid: int) -> None:
        """An error mid-flight for request `rid` (`_handle_errors`): see `cancel(failed=True)`."""
        self.cancel(rid, failed=True)

    def _terminate(self, req: LlmRequest) -> None:
        self.active.remove(req)
        self.resource_manager.free_resources(req)  # _terminate_request
        self.finished[req.py_request_id] = req

    def has_work(self) -> bool:
        return bool(self.waiting or self.active)

    def run_until_done(self) -> None:
        while self.has_work():
            self.step()

    def check(self) -> None:
        """RuntimeError if pages or target caches are held with nothing running (a leak)."""
        if self.active:
            return
        tree = 0 if self.draft is None else sum(len(e.pages) for e in self.draft.tree.values())
        if self.paged.pages_in_use() != tree or self.paged.tables:
            raise RuntimeError(f"stand-in leaked pages: {self.paged.pages_in_use()} in use, "
                               f"{tree} held by the draft tree, tables {list(self.paged.tables)}")
        if self.target.caches:
            raise RuntimeError(f"stand-in leaked target caches {list(self.target.caches)}")

    # ---- the executor loop -----------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> list[LlmRequest]:
        """One iteration: schedule, prepare resources, forward, update, free the finished."""
        while self.waiting and len(self.active) < self.max_batch:
            self._admit(self.waiting.popleft())
        batch = ScheduledRequests()
        for req in self.active:
            if req.state is LlmRequestState.CONTEXT_INIT:
                pos, c = req.context_current_position, self.chunk_size
                req.context_chunk_size = min(len(req.prompt), (pos // c + 1) * c) - pos
                batch.context_requests.append(req)
            else:
                batch.generation_requests.append(req)
        lagging, self._lagging = self._lagging, []
        self.resource_manager.prepare_resources(batch)
        for req in batch.context_requests:
            self._context_chunk(req)
        for req in batch.generation_requests:
            if any(req is r for r, _ in lagging):
                self._lag_step(req)
            else:
                self._generation_step(req)
        self.resource_manager.update_resources(batch)
        for req, reason in lagging:  # the overlap loop learns of the finish one step late
            req.finish_by_reason(reason)
        done = [r for r in self.active if r.is_finished]
        for req in done:
            self._terminate(req)
        return done

    def _admit(self, req: LlmRequest) -> None:
        entry = self.target.match(req)
        if self.draft is not None and self.draft.paired:
            depth, tree = self.draft.match_depth(req)  # the target's reuse is capped at it
            if entry is not None and (tree is None or depth < len(entry.tokens)):
                entry = None  # no recurrent state below the cap: prefill from 0
            if entry is not None and tree is not None:
                self.draft.adopt_tree(req, tree, len(entry.tokens))
        self.target.prepare_context(req, entry)
        self.active.append(req)

    def _context_chunk(self, req: LlmRequest) -> None:
        s = req.context_current_position
        e = s + req.context_chunk_size
        cache = self.target.caches[req.py_request_id]
        ids = torch.tensor(req.prompt[s:e], dtype=torch.int64)
        hidden, logits = self.model.forward_target(ids, s, cache)
        last = e == len(req.prompt)
        golden = int(logits[-1].argmax()) if last else None
        nxt = req.prompt[s + 1:e] + ([golden] if last else [req.prompt[e]])
        if self.draft_len:
            self._write_rows(req, s, torch.tensor(nxt), hidden)  # keys [s, e), roped at k
        req.context_current_position = e
        if not last:
            return
        assert golden is not None
        req.tokens.append(golden)
        req.state = LlmRequestState.GENERATION_IN_PROGRESS  # the sampler's first token
        self.target.commit_context(req)
        if self.draft is not None:
            self.draft.commit_context(req)
        self._maybe_finish(req)
        if self.draft_len and not req.is_finished:
            req.py_draft_tokens = self._draft(req, hidden[-1:], torch.tensor([golden]), e - 1)

    def _generation_step(self, req: LlmRequest) -> None:
        n = len(req.tokens)
        cache = self.target.caches[req.py_request_id]
        drafts = req.py_draft_tokens
        ids = torch.tensor([req.tokens[-1], *drafts], dtype=torch.int64)
        hidden, logits = self.model.forward_target(ids, n - 1, cache, ssm_trace=bool(drafts))
        target = logits.argmax(-1).tolist()
        a = 0
        while a < len(drafts) and drafts[a] == target[a]:
            a += 1
        new = [*drafts[:a], target[a]]
        room = req.max_new_tokens - len(req.output)
        for j, token in enumerate(new):  # the first end id or stop token ends the turn
            if token == self._eos() or token in self.stop_token_ids:
                new = new[: j + 1]
                break
        new = new[:room]
        kept = len(new)
        if drafts:
            req.accepted += a
            req.verify_steps += 1
            req.drafted += len(drafts)
            cache.truncate(n - 1 + kept)  # positions n-1 .. n-2+kept computed and accepted
            for i, kind in enumerate(self.cfg.layer_types):
                if kind == "linear":
                    cache.set_ssm_state(i, cache.ssm_traces[i][kept - 1])
        req.tokens.extend(new)
        self._maybe_finish(req)
        if not self.draft_len:
            return
        # MTP-Eagle draft step 1 writes rows for every verified position (keys n-1 .. n-1+D),
        # those past the accepted tokens from rejected hiddens: junk a deposit must not keep
        pad = [target[j] for j in range(kept, len(ids))]
        nxt = (req.tokens[n:n + kept] + pad)[: len(ids)]
        self._write_rows(req, n - 1, torch.tensor(nxt), hidden)
        if not req.is_finished:
            last = len(req.tokens) - 2  # the last accepted pair key
            req.py_draft_tokens = self._draft(req, hidden[kept - 1:kept],
                                              torch.tensor([req.tokens[-1]]), last)

    def _write_rows(self, req: LlmRequest, lo: int, nxt: torch.Tensor, hidden: torch.Tensor) -> None:
        # nxt: [n] t_{k+1}; hidden: [n, H] hidden_k for keys lo .. lo + n - 1
        _, _, k, v = self._mtp_qkv(nxt, hidden, torch.arange(lo, lo + nxt.shape[0]))
        self.paged.write(req.py_request_id, lo, k, v)

    def _mtp_qkv(self, nxt: torch.Tensor, hidden: torch.Tensor, keys: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        d = self.model.drafter
        c = self.cfg
        x = d.project(nxt, hidden)
        q, k, v = d.self_attn.qkv(d.input_layernorm(x)[None])
        q = apply_rope_reference(q[0], keys, c.rotary_dim, c.rope_theta)  # roped at k, as TRT-LLM
        k = apply_rope_reference(k[0], keys, c.rotary_dim, c.rope_theta)
        return x, q, k, v[0]

    def _draft(self, req: LlmRequest, hidden: torch.Tensor, token: torch.Tensor, key: int) -> list[int]:
        """Draft `draft_len` tokens from pair key `key` = (token, hidden), attending pages [0, key]."""
        d = self.model.drafter
        out: list[int] = []
        h = hidden
        for j in range(self.draft_len):
            kk = key + j
            x, q, k, v = self._mtp_qkv(token, h, torch.tensor([kk]))
            if j:  # later draft steps write their own rows (over drafted tokens) at key + j
                self.paged.write(req.py_request_id, kk, k, v)
            rows_k, rows_v = self.paged.read(req.py_request_id, 0, kk + 1)
            dt = x.dtype
            h, logits = d.finish(x, q, rows_k.to(dt), rows_v.to(dt), torch.arange(kk + 1),
                                 torch.tensor([kk]))
            token = logits.argmax(-1)
            out.append(int(token))
        return out

    def _maybe_finish(self, req: LlmRequest) -> None:
        last = req.tokens[-1]
        reason = (FinishReason.END_ID if last == self._eos() else
                  FinishReason.STOP_WORDS if last in self.stop_token_ids else
                  FinishReason.LENGTH if len(req.output) >= req.max_new_tokens else None)
        if reason is None:
            return
        if self.overlap_scheduler:  # still GENERATION_IN_PROGRESS in the next step's batch
            self._lagging.append((req, reason))
        else:
            req.finish_by_reason(reason)  # the sampler's finish_by

    def _lag_step(self, req: LlmRequest) -> None:
        """The overlap scheduler's extra step of a request that already finished: its forward
        runs on its last token and stale drafts (draft rows of keys N - 1 .. N - 1 + D are
        written), and the sampler discards its tokens."""
        if not self.draft_len:
            return
        n = len(req.tokens)
        cache = self.target.caches[req.py_request_id]
        ids = torch.tensor([req.tokens[-1], *req.py_draft_tokens], dtype=torch.int64)
        # the request's target cache is dropped when it is freed after this step
        hidden, logits = self.model.forward_target(ids, n - 1, cache)
        self._write_rows(req, n - 1, logits.argmax(-1), hidden)

    def _eos(self) -> int:
        return self._eos_id


_TARGET_CLASSES: dict[tuple[str, bool | None], type] = {}


def _target_class(name: str, supports_joint: bool | None) -> type:
    """The target manager's class as a release names it, with its joint-reuse opt-out marker."""
    key = (name, supports_joint)
    if key not in _TARGET_CLASSES:
        body: dict[str, Any] = {"__doc__": f"Stand-in for TensorRT-LLM's {name} (target pool)."}
        if supports_joint is not None:
            body["_supports_joint_kv_cache_reuse"] = supports_joint
        _TARGET_CLASSES[key] = type(name, (TargetKVManager,), body)
    return _TARGET_CLASSES[key]


def create_py_executor_instance(executor: StandinPyExecutor, resources: OrderedDict[Any, Any],
                                extra_resource_managers: Mapping_[str, Any]) -> None:
    """Stand-in for `_util.create_py_executor_instance`'s resource-manager assembly.

    As TensorRT-LLM: each `extra_resource_managers` entry is added to `resources`
    (ValueError on an existing key: "Cannot overwrite existing resource manager"),
    then the sequence slot manager, then `ResourceManager(resources)` is built and the KV cache manager is moved to
    the end ("always invoked last"). The worker-side hook (`trtllm.worker`) wraps
    this function, as it wraps TensorRT-LLM's, to add the carry before the
    executor exists.
    """
    for key, value in extra_resource_managers.items():
        if key in resources:
            raise ValueError(f"Cannot overwrite existing resource manager {key}.")
        resources[key] = value
    if ResourceManagerType.SEQ_SLOT_MANAGER not in resources:  # added after the extras
        resources[ResourceManagerType.SEQ_SLOT_MANAGER] = SeqSlotManager()
    rm = ResourceManager(resources)
    if ResourceManagerType.KV_CACHE_MANAGER in resources:
        resources.move_to_end(ResourceManagerType.KV_CACHE_MANAGER)
    executor.resource_manager = rm


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
    every TensorRT-LLM worker). `single_process=True`, or
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
            self._executor: _Proxy | _WorkerProxy = _Proxy(StandinPyExecutor(model, **executor_options))
            return
        from . import worker

        worker.boot()  # the worker process's interpreter start (the .pth line)
        self._executor = _WorkerProxy(StandinPyExecutor(model, **executor_options))

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
