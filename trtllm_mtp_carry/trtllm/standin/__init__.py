"""A CPU STAND-IN for TensorRT-LLM's executor and LLM: not TensorRT-LLM, never claimed as it.

What it is for: TensorRT-LLM cannot be installed here, so CI proves the adapter's logic
on this stand-in, which follows TensorRT-LLM's source row by row and runs the package's
reference model (`engine/model.py`), so outputs and acceptance are real. Real
TensorRT-LLM has not run here. Each module stands in for the TensorRT-LLM module of
its name and cites the file and commit it was read from (diff one against the other):

| stand-in module | TensorRT-LLM module |
| --- | --- |
| `llm` | `tensorrt_llm/llmapi/llm.py` (`LLM`, the process split) |
| `llm_args` | `tensorrt_llm/llmapi/llm_args.py` (`KvCacheConfig`, `MambaStateConfig`, `speculative_config`'s `DecodingBaseConfig`, `CacheTransceiverConfig`) |
| `py_executor_creator` | `_torch/pyexecutor/py_executor_creator.py` (`create_py_executor`) |
| `_util` | `_torch/pyexecutor/_util.py` (`create_py_executor_instance`, `KvCacheCreator`: the KV managers' build and KV cache estimation) |
| `py_executor` | `_torch/pyexecutor/py_executor.py` (`PyExecutor`'s loop) |
| `resource_manager` | `_torch/pyexecutor/resource_manager.py` (`ResourceManager`, `BaseResourceManager`) |
| `scheduler` | `_torch/pyexecutor/scheduler.py` (`ScheduledRequests`) |
| `kv_cache_manager_v2` | `_torch/pyexecutor/kv_cache/kv_cache_manager_v2.py` (`KVCacheManagerV2`, the draft pool) |
| `mamba_cache_manager_v2` | `_torch/pyexecutor/kv_cache/mamba_cache_manager/mamba_cache_manager_v2.py` (the hybrid target) |
| `qsa_cache_manager` | `_torch/attention/backends/sparse/qsa/cache_manager.py` (`QSAMambaHybridCacheManagerV2`, the QSA hybrid's draft pool @ 38198e34) and `_torch/modules/qwen4_exp/cache_manager.py` (`Qwen4ExpHybridCacheManagerV2`, the class newer trees build and `qsa/cache_manager.py` re-exports under the old name) |
| `llm_request` | `_torch/pyexecutor/llm_request.py` (`LlmRequest`, its states) |
| `conversation_params`, `mapping` | `tensorrt_llm/conversation_params.py`, `tensorrt_llm/mapping.py` |
| `communicator` | `_torch/distributed/communicator.py` (`Distributed`, `TorchDist`: the executor's communicator) |
| `conformant` | (the stand-in's guard: `TRTLLM_NAMES`, `Conformant`) |

Topologies: `unpaired` (draft pages fresh over the reused prefix, holding what an earlier
request left there or the pool's poison rows, never cleared: the blind drafter), `paired` (the draft pool commits its context pages to its own tree and
the target's reuse is capped at the draft's matched depth), `folded` (no draft
manager, `DRAFT_KV_CACHE_MANAGER: None`: the MTP layer's pages belong to the target
manager and are restored with its prefix).

Tensor parallelism: `create_py_executor(tp_size=N)` in each of N processes of a gloo
process group builds that rank's executor: its draft pool holds the rank's KV-head shard,
rank 0 alone takes requests and the executor broadcasts them (`py_executor`).

Invariants:
- Package code (any `trtllm_mtp_carry.*` module outside this package) reading a name of
  a stand-in TensorRT-LLM class that is not in `TRTLLM_NAMES` gets AttributeError
  (`Conformant`): it can lean on nothing TensorRT-LLM lacks.
- The hybrid target reuses a prefix only at its snapshot points
  (`kv_cache_config.mamba_state_config`); with none, or with block reuse off (Qwen3-Next's
  model default), every turn reuses 0 tokens.
- Every page is owned by live requests and tree entries with a reference count;
  `StandinPyExecutor.check()` proves none leaked once nothing runs.
"""

from __future__ import annotations

from ._util import VERSIONS, StandinLlmArgs, create_py_executor_instance, joint_reuse
from .communicator import Distributed, TorchDist
from .conformant import TRTLLM_NAMES, Conformant
from .conversation_params import ConversationParams
from .kv_cache_manager_v2 import (
    BAD_PAGE_INDEX,
    DraftKVManager,
    KVCacheManagerV2,
    PagedRows,
    poison_page,
    shard_heads,
)
from .llm import StandinLLM
from .llm_args import (
    QWEN3_NEXT_MODEL_DEFAULTS,
    BlockReuseConfig,
    CacheTransceiverConfig,
    DecodingBaseConfig,
    KvCacheConfig,
    MambaStateConfig,
)
from .llm_request import (
    FinishReason,
    LlmRequest,
    LlmRequestState,
    get_cache_salt_id,
    is_context_finished,
    is_context_init_state,
    is_finished,
    is_generation_complete_state,
    is_generation_in_progress_state,
)
from .mamba_cache_manager_v2 import MambaHybridCacheManagerV2
from .mapping import Mapping
from .py_executor import StandinPyExecutor
from .py_executor_creator import create_py_executor
from .qsa_cache_manager import QSAMambaHybridCacheManagerV2, Qwen4ExpHybridCacheManagerV2
from .resource_manager import (
    BaseResourceManager,
    DataType,
    ResourceManager,
    ResourceManagerType,
    SeqSlotManager,
)
from .scheduler import ScheduledRequests

TargetKVManager = MambaHybridCacheManagerV2
"""The target manager's earlier stand-in name (kept for importers)."""

__all__ = [
    "BAD_PAGE_INDEX", "QWEN3_NEXT_MODEL_DEFAULTS", "TRTLLM_NAMES", "VERSIONS", "BaseResourceManager",
    "BlockReuseConfig", "CacheTransceiverConfig", "DecodingBaseConfig", "joint_reuse", "poison_page", "shard_heads",
    "Conformant", "ConversationParams", "DataType", "Distributed", "DraftKVManager", "FinishReason",
    "KVCacheManagerV2", "KvCacheConfig", "LlmRequest", "LlmRequestState", "MambaHybridCacheManagerV2",
    "MambaStateConfig", "Mapping", "PagedRows", "QSAMambaHybridCacheManagerV2", "Qwen4ExpHybridCacheManagerV2", "ResourceManager", "ResourceManagerType",
    "ScheduledRequests", "SeqSlotManager", "StandinLLM", "StandinLlmArgs", "StandinPyExecutor", "TorchDist",
    "TargetKVManager", "create_py_executor", "create_py_executor_instance", "get_cache_salt_id",
    "is_context_finished", "is_context_init_state", "is_finished", "is_generation_complete_state",
    "is_generation_in_progress_state",
]
