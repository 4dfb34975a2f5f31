"""Stand-in for `tensorrt_llm/_torch/pyexecutor/resource_manager.py`: the managers' protocol and their order.

Read (nothing ran): `resource_manager.py` @ 38198e34 (notes section 0): `BaseResourceManager`
(abstract `get_max_resource_count()`, `get_needed_resource_to_completion(request)`; no-op
`add_dummy_requests`, `prepare_resources`, `update_resources`, `free_resources`,
`shutdown`); `ResourceManager` over an OrderedDict: prepare and update iterate it forward,
`free_resources(request)` reversed, each only where the entry `hasattr` the method (a
None entry is skipped; `resource_manager.py`, index version read in this pass);
`ResourceManagerType` keys. `DataType` is
`tensorrt_llm.bindings.DataType` (the adapter reads `.name`).

Invariant: `ResourceManager.calls` records `(manager name, "prepare" | "free", request id)`
in call order (the stand-in's own record, for the order tests).
"""

from __future__ import annotations

import abc
import enum
from collections import OrderedDict
from typing import Any

import torch

from .conformant import Conformant
from .scheduler import ScheduledRequests


class DataType(enum.Enum):
    """Stand-in for `tensorrt_llm.bindings.DataType` (the adapter reads `.name`)."""

    BF16 = "BF16"
    HALF = "HALF"
    FLOAT = "FLOAT"
    FP8 = "FP8"
    NVFP4 = "NVFP4"  # `_create_kv_cache_manager` (_util.py @ 38198e34) for an FP4 KV cache


# the torch dtype KV pages of each DataType are viewed as: `KVCacheManagerV2.get_buffers` hands the
# pool's DataType to `convert_to_torch_tensor(TensorWrapper(...))` (only NVFP4 re-typed to int8:
# kv_cache_manager_v2.py @ 38198e34582cf777ecc72062f477987284ba9999), the QSA views map it with
# `binding_to_torch_dtype` (modules/qwen4_exp/cache_manager.py @ 6ff2801f55462b926cc837a7f230fae63bc62fdc);
# FP8 pages are float8_e4m3fn, one byte an element (what the probe checks on the live view)
_TORCH_DTYPES = {DataType.BF16: torch.bfloat16, DataType.HALF: torch.float16,
                 DataType.FLOAT: torch.float32, DataType.FP8: torch.float8_e4m3fn,
                 DataType.NVFP4: torch.int8}  # get_buffers re-types an NVFP4 pool to int8 (packed
# e2m1 pairs, head_dim // 2 a row: kv_cache_manager_v2.py @ 00be09f7); its block scales (one e4m3
# byte per 16 elements) are separate KEY_BLOCK_SCALE / VALUE_BLOCK_SCALE pages: the stand-in's NVFP4
# pool is `kv_cache_manager_v2.Nvfp4PagedRows`, not a pool of this dtype


class ResourceManagerType(enum.Enum):
    """Stand-in for TensorRT-LLM's `ResourceManagerType` (the keys of `resource_managers`): the
    keys `_util.py` @ 0004396 sets on every build (`build_managers`: KV, DRAFT_KV, CROSS_KV;
    `create_py_executor_instance`: SEQ_SLOT) or may set (KV_CACHE_COMPRESSION)."""

    KV_CACHE_MANAGER = "KV_CACHE_MANAGER"
    DRAFT_KV_CACHE_MANAGER = "DRAFT_KV_CACHE_MANAGER"
    CROSS_KV_CACHE_MANAGER = "CROSS_KV_CACHE_MANAGER"
    KV_CACHE_COMPRESSION_MANAGER = "KV_CACHE_COMPRESSION_MANAGER"
    SEQ_SLOT_MANAGER = "SEQ_SLOT_MANAGER"


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


class ResourceManager(Conformant):
    """Stand-in for TensorRT-LLM's `ResourceManager`: an OrderedDict, prepare forward, free reversed.

    `calls` records `(manager name, "prepare" | "free", request id)` in call order.
    """

    TRTLLM_CLASS = "ResourceManager"

    def __init__(self, managers: OrderedDict[Any, Any]) -> None:
        self.resource_managers = managers
        self.calls: list[tuple[str, str, int]] = []

    def prepare_resources(self, batch: ScheduledRequests) -> None:
        # as TensorRT-LLM: `if hasattr(resource_manager, "prepare_resources")`, so a None entry
        # (no separate draft pool) is skipped
        for key, manager in self.resource_managers.items():
            if hasattr(manager, "prepare_resources"):
                for r in batch.context_requests:
                    self.calls.append((_name(key), "prepare", r.py_request_id))
                manager.prepare_resources(batch)

    def update_resources(self, batch: ScheduledRequests) -> None:
        for manager in self.resource_managers.values():
            if hasattr(manager, "update_resources"):
                manager.update_resources(batch)

    def free_resources(self, request: Any) -> None:
        for key, manager in reversed(self.resource_managers.items()):
            if hasattr(manager, "free_resources"):
                self.calls.append((_name(key), "free", request.py_request_id))
                manager.free_resources(request)

    def get_resource_manager(self, name: Any) -> Any:
        return self.resource_managers.get(name)


def _name(key: object) -> str:
    name = getattr(key, "name", key)
    return str(name)


class SeqSlotManager(BaseResourceManager):
    """Stand-in for the sequence slot manager (holds nothing the carry reads), built as
    `SeqSlotManager(max_num_sequences)` (`_util.py` @ 0004396)."""

    def __init__(self, max_num_sequences: int) -> None:
        self.max_num_sequences = max_num_sequences

    def get_max_resource_count(self) -> int:
        return 1

    def get_needed_resource_to_completion(self, request: Any) -> int:
        return 0
