"""Stand-in for `tensorrt_llm/_torch/pyexecutor/_util.py`: `create_py_executor_instance` and the KV managers' build.

Read (nothing ran): `_util.py` @ 00043967 and the index version of
`create_py_executor_instance` (docs/TRTLLM-CONFORMANCE.md): keyword arguments
(`dist`, `resources`, `mapping`, `pytorch_backend_config` or, newer, `llm_args`,
`ctx_chunk_config`, `model_engine`, `start_worker`, `sampler`, `drafter`,
`guided_decoder`, `lora_config`, `garbage_collection_gen0_threshold`,
`kv_connector_manager`, `max_seq_len`, `max_batch_size`, `max_beam_width`,
`max_num_tokens`, `peft_cache_config`, `scheduler_config`,
`cache_transceiver_config`; newer: `virtual_memory_pools`, `execution_stream`); each
`extra_resource_managers` entry is added to `resources` ("Cannot overwrite existing
resource manager"), then the sequence slot manager, `ResourceManager(resources)`, and
the KV cache manager moved last ("always invoked last"). `KvCacheCreator.build_managers`
puts the target manager (`KV_CACHE_MANAGER`) and, for a one-model drafter with its own
pool, the draft manager (`DRAFT_KV_CACHE_MANAGER`, `_mirror_draft_kv_cache`) into
`resources`; without a separate draft pool the entry is None (notes section 0b);
`teardown_managers` removes them before the second build under KV cache estimation.
`KvCacheCreator` models the estimation's memory order on a modelled device (its docstring
cites the rows).

Invariant: the executor exists only through `create_py_executor_instance`, called with
keywords only (a positional argument is a TypeError, as it is on TensorRT-LLM's).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from ...engine.model import HybridLM
from ..options import MAMBA_STATE_FIELDS
from .conformant import Conformant
from .kv_cache_manager_v2 import DraftKVManager, PagedRows
from .llm_args import KvCacheConfig
from .mamba_cache_manager_v2 import MambaHybridCacheManagerV2, target_class
from .mapping import Mapping
from .resource_manager import (
    _TORCH_DTYPES,
    DataType,
    ResourceManager,
    ResourceManagerType,
    SeqSlotManager,
)
from .torch_cuda import StandinDeviceMemory

VERSIONS: dict[str, dict[str, Any]] = {
    # what a hybrid one-model MTP model with block reuse gets, per TensorRT-LLM version (README
    # "TensorRT-LLM versions", docs/TRTLLM-CONFORMANCE.md section 3): the target manager's class,
    # whether the pairing markers exist (#18093), the target class's
    # `_supports_draft_reuse_match_backoff` (#19303 sets it on the hybrid), the topology, and
    # the `mamba_state_config` snapshot options the version's API reference lists (None: not read)
    "1.2.1": {"target_class": "CppMambaHybridCacheManager", "markers": False,
              "draft_reuse_match_backoff": False, "topology": "unpaired", "snapshot_options": None},
    "1.3.0rc29": {"target_class": "MambaHybridCacheManagerV2", "markers": True,
                  "draft_reuse_match_backoff": False, "topology": "unpaired",
                  "snapshot_options": MAMBA_STATE_FIELDS},
    "1.4.0rc1": {"target_class": "MambaHybridCacheManagerV2", "markers": True,
                 "draft_reuse_match_backoff": False, "topology": "unpaired",
                 "snapshot_options": MAMBA_STATE_FIELDS},
    "main+19303": {"target_class": "MambaHybridCacheManagerV2", "markers": True,
                   "draft_reuse_match_backoff": True, "topology": "paired",
                   "snapshot_options": MAMBA_STATE_FIELDS},
}
"""The stand-in's TensorRT-LLM version profiles (`create_py_executor(version=...)`)."""


@dataclass
class StandinLlmArgs:
    """The stand-in's `llm_args`: what its executor and its KV managers are built from (not a
    TensorRT-LLM class; package code never reads it)."""

    model: HybridLM
    kv_cache_config: KvCacheConfig
    topology: str = "unpaired"
    version: str = "1.3.0rc29"
    max_draft_len: int = 3
    chunk_size: int = 64
    tokens_per_block: int = 32
    num_pages: int = 4096
    prefix_entries: int = 64
    max_batch: int = 8
    kv_dtype: DataType = DataType.BF16
    tp_size: int = 1
    enable_attention_dp: bool = False
    overlap_scheduler: bool = False
    stop_token_ids: tuple[int, ...] = ()
    extra_resource_managers: dict[str, Any] = field(default_factory=dict)
    pool: PagedRows | None = None  # the one stand-in page pool (draft or folded MTP pages)
    device_memory: StandinDeviceMemory | None = None  # the modelled device (None: not modelled)


def build_managers(resources: OrderedDict[Any, Any], llm_args: StandinLlmArgs) -> None:
    """`KvCacheCreator.build_managers`: the draft manager (or None) and the target manager."""
    a = llm_args
    cfg = a.model.cfg
    profile = VERSIONS[a.version]
    mapping = Mapping(a.tp_size, a.enable_attention_dp)
    if a.pool is None:
        a.pool = PagedRows(a.num_pages, cfg.num_kv_heads, a.tokens_per_block, cfg.head_dim,
                           _TORCH_DTYPES[a.kv_dtype])
    mtp_layer = cfg.num_layers  # the MTP layer's global index is num_hidden_layers
    draft: DraftKVManager | None = None
    if a.max_draft_len > 0 and a.topology != "folded":
        draft = DraftKVManager(a.pool, mtp_layer=mtp_layer, paired=a.topology == "paired",
                               entries=a.prefix_entries, draft_len=a.max_draft_len,
                               dtype=a.kv_dtype, mapping=mapping, kv_cache_config=a.kv_cache_config)
        if not profile["markers"]:  # a build from before #18093: no pairing markers at all
            del draft.enable_joint_kv_cache_reuse
            del draft._can_publish_block_reuse
    cls = target_class(profile["target_class"], profile["draft_reuse_match_backoff"])
    target: MambaHybridCacheManagerV2 = cls(
        a.model, kv_cache_config=a.kv_cache_config, entries=a.prefix_entries,
        folded_paged=a.pool if a.topology == "folded" and a.max_draft_len > 0 else None,
        mtp_layer=mtp_layer, dtype=a.kv_dtype, mapping=mapping)
    # as build_managers: the target's entry first, then the draft's (None: no separate pool)
    resources[ResourceManagerType.KV_CACHE_MANAGER] = target
    resources[ResourceManagerType.DRAFT_KV_CACHE_MANAGER] = draft


def page_nbytes(llm_args: StandinLlmArgs) -> int:
    """Bytes of one page of the stand-in's pool `[2, Hkv, tpb, D]` (the KV cache it models)."""
    cfg = llm_args.model.cfg
    elt = torch.empty((), dtype=_TORCH_DTYPES[llm_args.kv_dtype]).element_size()
    return 2 * cfg.num_kv_heads * llm_args.tokens_per_block * cfg.head_dim * elt


def configure_kv_cache_capacity(llm_args: StandinLlmArgs, allocated_bytes: int) -> int:
    """`KvCacheCreator.configure_kv_cache_capacity` (`_util.py` @ 00043967) on the modelled device:
    `end, total = torch.cuda.mem_get_info()`, `peak = total - end` (the stand-in's dummy run
    allocates nothing, so the peak is what is held), then `_cal_max_memory`:
    `(total - peak + allocated_bytes) * free_gpu_memory_fraction` (`allocated_bytes`: the
    estimation build's KV cache, counted back in), capped by a set `max_gpu_total_bytes`. Called
    after the first `create_py_executor_instance` under estimation; before the build, with
    `allocated_bytes` 0, when estimation is skipped (`py_executor` None: `peak = total_used_bytes`)."""
    memory = llm_args.device_memory
    assert memory is not None
    end, total = memory.mem_get_info()
    peak = total - end
    config = llm_args.kv_cache_config
    budget = int((total - peak + allocated_bytes) * config.free_gpu_memory_fraction)
    if config.max_gpu_total_bytes > 0:
        budget = min(budget, config.max_gpu_total_bytes)
    return budget


def size_kv_pool(llm_args: StandinLlmArgs, budget: int | None) -> int | None:
    """Charge the stand-in's pool to the modelled device: `budget // page_nbytes` pages (None: the
    `num_pages` given), releasing any pool charged before. Returns `budget`."""
    memory = llm_args.device_memory
    assert memory is not None
    memory.release(memory.charged["kv"], "kv")
    if budget is not None:
        llm_args.num_pages = budget // page_nbytes(llm_args)
        llm_args.pool = None  # built again at the new size
    memory.charge(llm_args.num_pages * page_nbytes(llm_args), "kv")
    return budget


def teardown_managers(resources: OrderedDict[Any, Any]) -> None:
    """`KvCacheCreator.teardown_managers`: the KV managers are shut down and deleted from
    `resources` (`_util.py`, index versions read in this pass), so the second build appends
    them after whatever the first build added (the sequence slot manager)."""
    for key in (ResourceManagerType.KV_CACHE_MANAGER, ResourceManagerType.DRAFT_KV_CACHE_MANAGER):
        manager = resources.pop(key, None)
        if manager is not None:
            manager.shutdown()


class KvCacheCreator(Conformant):
    """Stand-in for `_util.KvCacheCreator` (`_util.py` @ 0004396720054fd8e205cbf616f21f0b57c6b412):
    the KV managers' build around KV cache estimation, on the modelled device (`llm_args.device_memory`;
    None: nothing is sized, the pool is `num_pages` as given).

    Row by row as the source: `__init__` keeps `self._llm_args` and the user's
    `max_gpu_total_bytes` (`_max_gpu_total_bytes_in`); `try_prepare_estimation()` returns False
    at once when estimation is skipped (`_skip_est`: `TRTLLM_SKIP_KV_CACHE_ESTIMATION`), else, on
    KV cache manager V2, measures `free_mem, _ = torch.cuda.mem_get_info()` and gives the
    estimation build `max_gpu_total_bytes = int(free_gpu_memory_fraction * free_mem)` (capped by
    the user's) and `max_tokens` = the dummy workload; `build_managers(resources, estimating)`
    calls `configure_kv_cache_capacity()` first when `_skip_est`; a V2 manager's device quota is
    `min(max_gpu_total_bytes, quota from max_tokens / max_util_for_resume)`
    (`kv_cache/kv_cache_manager_v2.py` @ 00043967), mapped in full at construction (the GPU
    pool's slot count comes from the tier quota, `runtime/kv_cache_manager_v2/_storage_manager.py`
    @ 00f6bd61 `_compute_slot_count_for_level`; `GpuSlotPool.resize` maps physical memory,
    `_cuda_virt_mem.py` @ 0c84bd31). Here `num_pages` pages stand for the quota the dummy
    workload asks for, so the estimation pool is `min(cap, num_pages * page_nbytes)` bytes.
    """

    TRTLLM_CLASS = "KvCacheCreator"

    def __init__(self, *, llm_args: StandinLlmArgs, skip_est: bool = False) -> None:
        self._llm_args = llm_args
        self._max_gpu_total_bytes_in = llm_args.kv_cache_config.max_gpu_total_bytes
        self._skip_est = skip_est
        self._estimation_bytes: int | None = None  # try_prepare_estimation's max_gpu_total_bytes
        self.budget: int | None = None  # what configure_kv_cache_capacity gave (the stand-in's record)

    def try_prepare_estimation(self) -> bool:
        if self._skip_est:
            return False
        memory = self._llm_args.device_memory
        if memory is not None:
            free_mem, _ = memory.mem_get_info()
            cap = int(self._llm_args.kv_cache_config.free_gpu_memory_fraction * free_mem)
            if self._max_gpu_total_bytes_in > 0:
                cap = min(cap, self._max_gpu_total_bytes_in)
            self._estimation_bytes = cap
        return True

    def build_managers(self, resources: OrderedDict[Any, Any], estimating_kv_cache: bool = False) -> None:
        if self._skip_est:
            self.configure_kv_cache_capacity()
        args = self._llm_args
        if args.device_memory is not None:
            if estimating_kv_cache:
                assert self._estimation_bytes is not None
                size_kv_pool(args, min(self._estimation_bytes, args.num_pages * page_nbytes(args)))
            else:
                size_kv_pool(args, self.budget)
        build_managers(resources, args)

    def configure_kv_cache_capacity(self, py_executor: Any = None) -> None:
        args = self._llm_args
        if args.device_memory is None:
            return
        estimated = py_executor is not None and not self._skip_est
        allocated = args.device_memory.charged["kv"] if estimated else 0  # the estimation KV's bytes
        self.budget = configure_kv_cache_capacity(args, allocated)

    def teardown_managers(self, resources: OrderedDict[Any, Any]) -> None:
        teardown_managers(resources)
        if self._llm_args.device_memory is not None:  # shut down: its memory is free again
            self._llm_args.device_memory.release(self._llm_args.device_memory.charged["kv"], "kv")


def create_py_executor_instance(
        *, dist: Any, resources: OrderedDict[Any, Any], mapping: Any, pytorch_backend_config: Any = None,
        ctx_chunk_config: Any, model_engine: Any, start_worker: bool, sampler: Any, drafter: Any,
        guided_decoder: Any, lora_config: Any, garbage_collection_gen0_threshold: Any,
        kv_connector_manager: Any, max_seq_len: int, max_batch_size: int, max_beam_width: int,
        max_num_tokens: int, peft_cache_config: Any, scheduler_config: Any,
        cache_transceiver_config: Any, llm_args: StandinLlmArgs | None = None,
        virtual_memory_pools: Any = None, execution_stream: Any = None) -> Any:
    """Stand-in for `_util.create_py_executor_instance`: assemble the resource managers, build
    the PyExecutor (started only with `start_worker=True`).

    As TensorRT-LLM: each `extra_resource_managers` entry is added to `resources`
    (ValueError on an existing key), then the sequence slot manager, then
    `ResourceManager(resources)` with the KV cache manager moved to the end. The worker
    hook (`trtllm.worker`) wraps this function, as it wraps TensorRT-LLM's, to add the
    carry before the executor exists.
    """
    from .py_executor import StandinPyExecutor

    args = llm_args if llm_args is not None else pytorch_backend_config
    assert isinstance(args, StandinLlmArgs)
    for key, value in args.extra_resource_managers.items():
        if key in resources:
            raise ValueError(f"Cannot overwrite existing resource manager {key}.")
        resources[key] = value
    if ResourceManagerType.SEQ_SLOT_MANAGER not in resources:  # added after the extras
        resources[ResourceManagerType.SEQ_SLOT_MANAGER] = SeqSlotManager()
    rm = ResourceManager(resources)
    if ResourceManagerType.KV_CACHE_MANAGER in resources:
        resources.move_to_end(ResourceManagerType.KV_CACHE_MANAGER)
    executor = StandinPyExecutor(rm, model_engine, args, max_batch_size=max_batch_size)
    if start_worker:
        executor.start_worker()
    return executor
