"""Stand-in for `tensorrt_llm/_torch/pyexecutor/py_executor_creator.py`: `create_py_executor`.

Read (nothing ran): `py_executor_creator.py` @ bab0f2e6eea19bcce16c805101420ef7d9d62d75
(and 000429d5): `from ._util import create_py_executor_instance`, called through that
module-global name with keyword arguments only, `start_worker=False`; under KV cache
estimation twice (the KV managers torn down and built again in between, over one
`resources` dict: `kv_cache_creator.teardown_managers(resources)`, `del py_executor`,
`kv_cache_creator.build_managers(resources, False)`); then `py_executor.start_worker()`.
Newer versions pass `llm_args=` instead of `pytorch_backend_config=` and add
`virtual_memory_pools=` and `execution_stream=` (notes section 0b); the stand-in passes
the set 000429d5 passes (the `_util.py` @ 0004396 it calls has no `pytorch_backend_config`).
`py_executor_creator.py` @ 000429d5 is the only version of this file the index holds and it
builds `KvCacheCreator(...)` without `is_disagg`, which `_util.py` @ 0004396 requires: the
stand-in passes `is_disagg=` whether `cache_transceiver_config` is set, with the other keywords
000429d5 passes. The KV managers come from `KvCacheCreator`, imported by name from
`._util` and built through this module's global name (@ 000429d57d42ecc8d481e5cdf653fff238be5974):
`kv_cache_creator = KvCacheCreator(...)`, `estimating_kv_cache =
kv_cache_creator.try_prepare_estimation()`, `kv_cache_creator.build_managers(resources,
estimating_kv_cache)`, the first `create_py_executor_instance`, then under estimation
`configure_kv_cache_capacity(py_executor)`, `teardown_managers(resources)`, the second build.

Invariant: the worker hook (`trtllm.worker`) wraps this module's
`create_py_executor_instance` and its `KvCacheCreator.try_prepare_estimation`, exactly as
on TensorRT-LLM: one path, the keyword one.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

from ...engine.model import HybridLM
from ._util import (
    VERSIONS,
    KvCacheCreator,
    StandinLlmArgs,
    create_py_executor_instance,
)
from .communicator import Distributed
from .llm_args import CacheTransceiverConfig, DecodingBaseConfig, KvCacheConfig
from .resource_manager import DataType
from .torch_cuda import StandinDeviceMemory


def create_py_executor(model: HybridLM, *, kv_cache_config: Mapping[str, Any] | KvCacheConfig | None = None,
                       enable_block_reuse: bool | None = None, topology: str | None = None,
                       version: str = "1.3.0rc29", max_draft_len: int = 3, chunk_size: int = 64,
                       tokens_per_block: int = 32, num_pages: int = 4096, prefix_entries: int = 64,
                       max_batch: int = 8, kv_dtype: DataType = DataType.BF16, tp_size: int = 1,
                       decoding_type: str = "MTP",
                       cache_transceiver_config: Mapping[str, Any] | CacheTransceiverConfig | None = None,
                       enable_attention_dp: bool = False, overlap_scheduler: bool = False,
                       stop_token_ids: Sequence[int] = (),
                       extra_resource_managers: Mapping[str, Any] | None = None,
                       estimate_kv_cache: bool = False,
                       device_memory: StandinDeviceMemory | None = None, device: str = "cpu",
                       sm_version: int = 100) -> Any:
    """Build and start a stand-in PyExecutor as TensorRT-LLM's `create_py_executor` does.

    `kv_cache_config` is the user's `kv_cache_config` (a dict as in `llm.yaml`, or a
    `KvCacheConfig`) over Qwen3-Next's model defaults: None gets block reuse off;
    `enable_block_reuse` (the stand-in's shorthand) overrides its `enable_block_reuse`
    (False: the rebuild baseline, every turn prefills from 0). `topology` is `unpaired`,
    `paired` or `folded` (default None: what the `version`'s creator decides, `_util.joint_reuse`:
    paired on `main` and `main+19303` with block reuse on, else unpaired); `max_draft_len=0` runs
    without speculation (no draft pool). `estimate_kv_cache=True` builds the executor
    twice over one `resources` dict (an `extra_resource_managers` entry then raises on
    the second build, as on TensorRT-LLM).

    `device_memory` models the device (`torch_cuda.StandinDeviceMemory`): the draft pool is
    then charged to it and sized as `_util.KvCacheCreator` sizes the KV cache: with
    `estimate_kv_cache`, the estimation build's pool is V2's quota, `min(free_gpu_memory_fraction
    x the memory free at try_prepare_estimation, num_pages pages)`, and the served pool gets the
    budget measured after the first `create_py_executor_instance`; without, the budget is
    measured before the build (the `TRTLLM_SKIP_KV_CACHE_ESTIMATION` order: `build_managers`
    calls it first). The worker hook reserves the carry's memory in its wrap of
    `try_prepare_estimation`, before either. The executor's `kv_cache_budget_bytes` records
    the budget. `device` is where the page pool (the draft KV pages) lives, `cpu` or a GPU's
    (the adapter's gathers and scatters then run there, into arenas reserved there; the
    model computes on the CPU). `sm_version` is the modelled GPU's compute capability (what
    DeepSeek-V4's pool asks `get_sm_version()`, version `main+19303:dsv4`).

    `decoding_type` is `speculative_config.decoding_type` (`MTP`; `Eagle3` gets a separate draft
    pool too, other types none: `_util.build_managers`; the stand-in drafts with the MTP layer
    whatever the type); `max_draft_len=0` is no `speculative_config` at all.
    `cache_transceiver_config` (a dict as in `llm.yaml`, or a `CacheTransceiverConfig`) makes a
    disaggregated worker: `_allow_separate_draft_kv_cache = False` (PR #11689), so no separate draft
    pool, and `KvCacheCreator(is_disagg=True)`.
    """
    if version not in VERSIONS:
        raise ValueError(f"version must be one of {', '.join(VERSIONS)}, got {version!r}")
    config = KvCacheConfig.from_dict(kv_cache_config)
    if enable_block_reuse is not None:
        config = dataclasses.replace(config, enable_block_reuse=enable_block_reuse)
    transceiver = (CacheTransceiverConfig(**cache_transceiver_config)
                   if isinstance(cache_transceiver_config, Mapping) else cache_transceiver_config)
    args = StandinLlmArgs(
        model=model.eval(), kv_cache_config=config,
        speculative_config=DecodingBaseConfig(decoding_type, max_draft_len) if max_draft_len else None,
        cache_transceiver_config=transceiver,
        topology=topology, version=version,
        max_draft_len=max_draft_len, chunk_size=chunk_size, tokens_per_block=tokens_per_block,
        num_pages=num_pages, prefix_entries=prefix_entries, max_batch=max_batch, kv_dtype=kv_dtype,
        tp_size=tp_size, enable_attention_dp=enable_attention_dp, overlap_scheduler=overlap_scheduler,
        stop_token_ids=tuple(stop_token_ids), extra_resource_managers=dict(extra_resource_managers or {}),
        device_memory=device_memory, device=device, sm_version=sm_version)
    if args.topology not in (None, "unpaired", "paired", "folded"):
        raise ValueError(f"topology must be unpaired, paired or folded, got {args.topology!r}")
    model_engine = SimpleNamespace(model=args.model)  # PyTorchModelEngine (.model)
    resources: OrderedDict[Any, Any] = OrderedDict()
    dist = _rank_of(args)
    mapping = args.mapping()
    # as create_py_executor: the creator through this module's global name, then
    # try_prepare_estimation (the worker hook reserves the carry's memory first, in its wrap)
    kv_cache_creator = KvCacheCreator(
        model_engine=model_engine, draft_model_engine=None, mapping=mapping, net_max_seq_len=1 << 20,
        kv_connector_manager=None, max_num_tokens=args.chunk_size, max_beam_width=1,
        tokens_per_block=args.tokens_per_block, max_seq_len=1 << 20, max_batch_size=args.max_batch,
        kv_cache_config=args.kv_cache_config, llm_args=args,
        speculative_config=args.speculative_config,
        sparse_attention_config=None, profiling_stage_data=None,
        is_disagg=args.cache_transceiver_config is not None, execution_stream=None,
        skip_est=not estimate_kv_cache)
    estimating_kv_cache = kv_cache_creator.try_prepare_estimation()
    kv_cache_creator.build_managers(resources, estimating_kv_cache)
    py_executor = _instance(resources, args, model_engine, dist)
    if estimating_kv_cache:
        first_draft = py_executor.draft
        kv_cache_creator.configure_kv_cache_capacity(py_executor)
        kv_cache_creator.teardown_managers(resources)
        del py_executor  # free before constructing new
        kv_cache_creator.build_managers(resources, False)
        py_executor = _instance(resources, args, model_engine, dist)
        py_executor.estimation_draft = first_draft  # the stand-in's record, for tests
    py_executor.kv_cache_budget_bytes = kv_cache_creator.budget  # the stand-in's record, for tests
    py_executor.start_worker()
    return py_executor


def _rank_of(args: StandinLlmArgs) -> Distributed | None:
    """`dist = Distributed.get(mapping)` (py_executor_creator.py @ 000429d5), for a multi-rank
    world: this process is one rank of a torch.distributed (gloo) group of `tp_size` processes,
    each building its own executor; `args.rank` becomes its rank. None for one rank."""
    if args.tp_size == 1:
        return None
    import torch.distributed as torch_dist

    if not torch_dist.is_initialized() or torch_dist.get_world_size() != args.tp_size:
        raise RuntimeError(f"a tp_size={args.tp_size} stand-in executor runs one process per rank: "
                           f"initialize torch.distributed (gloo) with world_size {args.tp_size} in each first")
    args.rank = torch_dist.get_rank()
    return Distributed.get(args.mapping())


def _instance(resources: OrderedDict[Any, Any], args: StandinLlmArgs, model_engine: Any,
              dist: Distributed | None) -> Any:
    # through this module's global name, as py_executor_creator calls it (the hook wraps it)
    return create_py_executor_instance(
        dist=dist, resources=resources, mapping=args.mapping(),
        llm_args=args, ctx_chunk_config=None, model_engine=model_engine, start_worker=False,
        sampler=None, drafter=None, guided_decoder=None, lora_config=None,
        garbage_collection_gen0_threshold=None, kv_connector_manager=None,
        max_seq_len=1 << 20, max_batch_size=args.max_batch, max_beam_width=1,
        max_num_tokens=args.chunk_size, peft_cache_config=None, scheduler_config=None,
        cache_transceiver_config=args.cache_transceiver_config, virtual_memory_pools=None, execution_stream=None)
