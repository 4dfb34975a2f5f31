"""Stand-in for `tensorrt_llm/_torch/pyexecutor/_util.py`: `create_py_executor_instance` and the KV managers' build.

Read (nothing ran): `_util.py` @ 0004396720054fd8e205cbf616f21f0b57c6b412, the newest version
read; each name below is as that commit has it:

- `create_py_executor_instance(*, dist, resources, mapping, llm_args, ctx_chunk_config,
  model_engine, start_worker, sampler, drafter, guided_decoder=None, lora_config=None,
  garbage_collection_gen0_threshold=None, kv_connector_manager=None,
  resource_governor_queue=None, max_seq_len=None, max_batch_size=None, max_beam_width=None,
  max_num_tokens=None, peft_cache_config=None, scheduler_config=None,
  cache_transceiver_config=None, virtual_memory_pools=None, execution_stream=None,
  dwdp_manager=None, max_num_sequences=None)`, keyword-only (older builds passed
  `pytorch_backend_config=`; this one has no such parameter). `max_num_sequences` None is
  `compute_max_num_sequences(mapping, max_batch_size, disable_overlap_scheduler)`: `max_batch_size`
  without pipeline parallelism. Each `llm_args.extra_resource_managers` entry is added to
  `resources` ("Cannot overwrite existing resource manager"), then
  `resources[SEQ_SLOT_MANAGER] = SeqSlotManager(max_num_sequences)`, the KV-cache compression
  manager (when `resources` has one) bound to the KV managers, `ResourceManager(resources)`, and
  the KV cache manager moved last, then the cross KV cache manager (when not None), then the
  compression manager ("the final reconciler").
- `KvCacheCreator.__init__(*, model_engine, draft_model_engine, mapping, net_max_seq_len,
  kv_connector_manager, max_num_tokens, max_beam_width, tokens_per_block, max_seq_len,
  max_batch_size, kv_cache_config, llm_args, speculative_config, sparse_attention_config,
  profiling_stage_data, is_disagg, execution_stream=None, draft_config=None, skip_est=False)`:
  `is_disagg` is required.
- `KvCacheCreator.build_managers(resources, estimating_kv_cache=False)`: the pairing decision
  `_joint_kv_cache_reuse = has_separate_one_model_draft and enable_block_reuse and
  _joint_reuse_supported()`, where `_joint_reuse_supported()` is V2, `getattr(
  self._kv_cache_manager_cls, "_supports_reuse_match_backoff", False)` and a known draft
  lookahead (one for MTP), passed as `joint_kv_cache_reuse=` to both managers; the
  KV-cache compression manager from `llm_args.kv_cache_compression_config`
  (`create_kv_cache_compression_manager`: None without a config); then
  `resources[KV_CACHE_MANAGER]`, `resources[DRAFT_KV_CACHE_MANAGER]` (None without a separate
  draft pool), `resources[CROSS_KV_CACHE_MANAGER]` (always set: None for a decoder-only model)
  and, when it runs per iteration, `resources[KV_CACHE_COMPRESSION_MANAGER]`.
- `KvCacheCreator.teardown_managers(resources)`: pops and shuts down the compression manager,
  shuts down and deletes the KV, draft (when not None) and cross entries.

`VERSIONS` plays what each TensorRT-LLM version's creator reads to pair a hybrid target's draft
pool (docs/TRTLLM-CONFORMANCE.md, "Versions"). `KvCacheCreator` models the estimation's memory
order on a modelled device (its docstring cites the rows).

Invariant: the executor exists only through `create_py_executor_instance`, called with
keywords only (a positional argument, or a keyword the source lacks, is a TypeError, as it
is on TensorRT-LLM's).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from ...engine.model import HybridLM
from ..options import MAMBA_STATE_FIELDS
from .conformant import Conformant
from .kv_cache_manager_v2 import DraftKVManager, Nvfp4PagedRows, PagedRows, shard_heads
from .llm_args import SEPARATE_DRAFT_POOL, CacheTransceiverConfig, DecodingBaseConfig, KvCacheConfig
from .mamba_cache_manager_v2 import MambaHybridCacheManagerV2, target_class
from .mapping import Mapping
from .qsa_cache_manager import qsa_class, qsa_roles
from .resource_manager import (
    _TORCH_DTYPES,
    DataType,
    ResourceManager,
    ResourceManagerType,
    SeqSlotManager,
)
from .torch_cuda import StandinDeviceMemory

PAIRING_READ_MAIN = "_supports_reuse_match_backoff"
"""The class attribute `KvCacheCreator._joint_reuse_supported` reads (`_util.py` @ 0004396)."""
PAIRING_READ_19303 = "_supports_draft_reuse_match_backoff"
"""What PR #19303's creator reads instead (`_util.py` @ 38198e34582cf777ecc72062f477987284ba9999:
`getattr(self._kv_cache_manager_cls, "_supports_draft_reuse_match_backoff", False)`, the target
class, with V2 and a known draft prompt lookahead); on no other tree read."""

_ALL_SNAPSHOT = MAMBA_STATE_FIELDS

_UNPAIRED_V2_HYBRID: dict[str, Any] = {
    "target_class": "MambaHybridCacheManagerV2", "draft_class": None, "markers": True,
    "pairing_reads": PAIRING_READ_MAIN, "supports": False, "class_attrs": {PAIRING_READ_MAIN: False},
    "topology": "unpaired", "snapshot_options": _ALL_SNAPSHOT, "raw_indices": False}
"""The releases with #18093 and main-line alike: the V2 hybrid class opts out of the match
backoff the creator reads (`VERSIONS` gives each tree its own copy)."""

VERSIONS: dict[str, dict[str, Any]] = {
    # what a hybrid one-model MTP model gets per TensorRT-LLM tree (docs/TRTLLM-CONFORMANCE.md
    # "Versions"): the target manager's class and the draft pool's (None: the plain stand-in
    # draft pool); whether the draft pool has the pairing markers (#18093); the class attribute
    # that tree's `_joint_reuse_supported` reads (None: no pairing) and the target class's value
    # of it; `class_attrs`, the pairing attributes the tree's classes declare (set on the stand-in
    # class only where they differ from what it inherits); the topology with block reuse on (what
    # `joint_reuse` gives, pinned by tests/trtllm/test_trtllm_versions.py); the
    # `mamba_state_config` snapshot options the tree's API reference lists (None: not read).
    # The release rows are inferred from merge dates: #18093 (2026-09-07) is in 1.3.0rc29 and
    # 1.4.0rc1, whose hybrid class opts out as main-line's does.
    "1.2.1": {"target_class": "CppMambaHybridCacheManager", "draft_class": None, "markers": False,
              "pairing_reads": None, "supports": False, "class_attrs": {}, "topology": "unpaired",
              "snapshot_options": None, "raw_indices": False},
    "1.3.0rc29": dict(_UNPAIRED_V2_HYBRID),
    "1.4.0rc1": dict(_UNPAIRED_V2_HYBRID),
    # main-line: `kv_cache/mamba_cache_manager.py` @ 003f8d08 sets
    # `MambaHybridCacheManagerV2._supports_reuse_match_backoff = False` ("keep main-like reuse
    # endpoints and the existing unpaired draft path"), the attribute `_util.py` @ 0004396 reads:
    # unpaired, the carry arms
    "main": dict(_UNPAIRED_V2_HYBRID),
    # PR #18843's layout (open): `mamba_cache_manager/mamba_cache_manager_v2.py` @ 28295084 sets
    # nothing, inheriting `KVCacheManagerV2`'s True, under the 0004396 creator: paired markers
    "pr18843": {"target_class": "MambaHybridCacheManagerV2", "draft_class": None, "markers": True,
                "pairing_reads": PAIRING_READ_MAIN, "supports": True, "class_attrs": {},
                "topology": "paired", "snapshot_options": _ALL_SNAPSHOT, "raw_indices": False},
    # PR #19303 (open), tree 38198e34: `_joint_reuse_supported` reads
    # `_supports_draft_reuse_match_backoff` on the target class; the hybrid declines the match
    # backoff itself and opts in for its draft pool (test_joint_reuse_pairing.py: pairs)
    "main+19303": {"target_class": "MambaHybridCacheManagerV2", "draft_class": None, "markers": True,
                   "pairing_reads": PAIRING_READ_19303, "supports": True,
                   "class_attrs": {PAIRING_READ_MAIN: False, PAIRING_READ_19303: True},
                   "topology": "paired", "snapshot_options": _ALL_SNAPSHOT, "raw_indices": True},
    # the QSA hybrid on the same tree: `qsa/cache_manager.py` @ 38198e34 sets
    # `_supports_draft_reuse_match_backoff = False` (test_joint_reuse_pairing.py: does not pair);
    # its draft pool is a `QSAMambaHybridCacheManagerV2` too (`standin/qsa_cache_manager.py`)
    "main+19303:qsa": {"target_class": "QSAMambaHybridCacheManagerV2",
                       "draft_class": "QSAMambaHybridCacheManagerV2", "markers": True,
                       "pairing_reads": PAIRING_READ_19303, "supports": False,
                       "class_attrs": {PAIRING_READ_MAIN: False, PAIRING_READ_19303: False},
                       "topology": "unpaired", "snapshot_options": _ALL_SNAPSHOT, "raw_indices": True},
    # the QSA hybrid on newer trees: `modules/qwen4_exp/cache_manager.py` @
    # 6ff2801f55462b926cc837a7f230fae63bc62fdc defines `Qwen4ExpHybridCacheManagerV2(
    # MambaHybridCacheManagerV2)` (the QSA side pages when `sparse_attention_config` is set) and
    # the sparse-attention `registry.py` @ 6ff2801f builds it for `qsa` on KV cache manager V2;
    # `qsa/cache_manager.py` (the index's newest version) only re-exports it as
    # `QSAMambaHybridCacheManagerV2`, so the class the executor holds is named `Qwen4Exp...`.
    # `_util.py` @ 6ff2801f reads `_supports_reuse_match_backoff`, which the class inherits (False
    # on the hybrid parent, `mamba_cache_manager.py` @ 003f8d08): unpaired. `raw_indices`: not read
    # at 6ff2801f; played as 38198e34 has it (a tree without it stands aside at the probe)
    "main:qsa": {"target_class": "Qwen4ExpHybridCacheManagerV2", "draft_class": "Qwen4ExpHybridCacheManagerV2",
                 "markers": True, "pairing_reads": PAIRING_READ_MAIN, "supports": False,
                 "class_attrs": {PAIRING_READ_MAIN: False}, "topology": "unpaired",
                 "snapshot_options": _ALL_SNAPSHOT, "raw_indices": True},
    # DeepSeek-V4 on the same tree: `deepseek_v4/cache_manager.py` @ 38198e34 sets both pairing
    # attributes False (test_joint_reuse_pairing.py: does not pair); the draft pool is a
    # `DeepseekV4CacheManager` (`standin/deepseek_v4_cache_manager.py`: its sliding-window latent
    # pages); the target is the reference hybrid model's, reusing at snapshot points
    "main+19303:dsv4": {"target_class": "DeepseekV4CacheManager",
                        "draft_class": "DeepseekV4CacheManager", "markers": True,
                        "pairing_reads": PAIRING_READ_19303, "supports": False,
                        "class_attrs": {PAIRING_READ_MAIN: False, PAIRING_READ_19303: False},
                        "topology": "unpaired", "snapshot_options": _ALL_SNAPSHOT, "raw_indices": True},
}
"""The stand-in's TensorRT-LLM version profiles (`create_py_executor(version=...)`). `raw_indices`:
the tree's `KVCacheManagerV2.get_batch_cache_indices` takes `raw_indices=` (38198e34 does;
0004396720054fd8e205cbf616f21f0b57c6b412 and 1fe0b08f23988c560890aa49894881af28479ba9 do not),
read only where the draft pool is QSA's (the plain stand-in pool's ids need no raw form)."""


def joint_reuse(profile: dict[str, Any], has_separate_one_model_draft: bool, enable_block_reuse: bool) -> bool:
    """`KvCacheCreator.build_managers`'s pairing decision (`_util.py` @ 0004396) on `profile`:
    `has_separate_one_model_draft and enable_block_reuse and _joint_reuse_supported()`, the last
    the target class's value of the attribute the version reads (V2 and MTP's known lookahead
    hold on every profile that reads one)."""
    reads = profile["pairing_reads"]
    cls = target_class(profile["target_class"], profile["class_attrs"])
    supported = reads is not None and bool(getattr(cls, reads, False))
    return has_separate_one_model_draft and enable_block_reuse and supported


@dataclass
class StandinLlmArgs:
    """The stand-in's `llm_args`: what its executor and its KV managers are built from (not a
    TensorRT-LLM class; package code never reads it)."""

    model: HybridLM
    kv_cache_config: KvCacheConfig
    topology: str | None = None  # None: as the version's creator decides; set by build_managers
    version: str = "1.3.0rc29"
    max_draft_len: int = 3
    chunk_size: int = 64
    tokens_per_block: int = 32
    num_pages: int = 4096
    prefix_entries: int = 64
    max_batch: int = 8
    kv_dtype: DataType = DataType.BF16
    tp_size: int = 1
    rank: int = 0  # this rank's place in the tensor-parallel group (the world: the stand-in has no PP)
    enable_attention_dp: bool = False
    overlap_scheduler: bool = False
    stop_token_ids: tuple[int, ...] = ()
    extra_resource_managers: dict[str, Any] = field(default_factory=dict)
    kv_cache_compression_config: Any = None  # `TorchLlmArgs.kv_cache_compression_config` (None: off)
    # `TorchLlmArgs.speculative_config` (None: no speculation; `create_py_executor` builds it from
    # `max_draft_len` and `decoding_type`) and `.cache_transceiver_config` (None: not disaggregated)
    speculative_config: DecodingBaseConfig | None = None
    cache_transceiver_config: CacheTransceiverConfig | None = None
    pool: PagedRows | None = None  # the one stand-in page pool (draft or folded MTP pages)
    device_memory: StandinDeviceMemory | None = None  # the modelled device (None: not modelled)
    device: str = "cpu"  # where the page pool lives (the model computes on the CPU)
    sm_version: int = 100  # the modelled GPU (`get_sm_version()`; DeepSeek-V4's pool checks it)

    def mapping(self) -> Mapping:
        """The executor's `Mapping`: one tensor-parallel group spanning the world."""
        return Mapping(world_size=self.tp_size, rank=self.rank, tp_size=self.tp_size,
                       enable_attention_dp=self.enable_attention_dp)

    def kv_heads(self) -> list[int]:
        """The model's KV heads this rank's draft pool holds (`shard_heads`; attention DP: all,
        as `KVCacheManagerV2.__init__` splits heads over `tp_size = 1` then)."""
        tp = 1 if self.enable_attention_dp else self.tp_size
        return shard_heads(self.model.cfg.num_kv_heads, tp, self.rank if tp > 1 else 0)


def build_managers(resources: OrderedDict[Any, Any], llm_args: StandinLlmArgs) -> None:
    """`KvCacheCreator.build_managers` (`_util.py` @ 0004396): the pairing decision, then the
    target manager, the draft manager (or None), the cross manager (None: decoder-only) into
    `resources`, in that order. `llm_args.topology`, when None, becomes what the version's
    creator decides (`joint_reuse`); a topology given is played as given (a test's override)."""
    a = llm_args
    cfg = a.model.cfg
    profile = VERSIONS[a.version]
    mapping = a.mapping()
    heads = a.kv_heads()
    if len(heads) != cfg.num_kv_heads and (a.kv_dtype == DataType.NVFP4 or profile["draft_class"] is not None):
        raise NotImplementedError("the stand-in shards BF16 and FP8 draft pools over tensor-parallel "
                                  "ranks only (not NVFP4, not QSA)")
    if a.kv_cache_compression_config is not None:
        # create_kv_cache_compression_manager: the stand-in models no compression algorithm
        raise NotImplementedError("the stand-in models no KV-cache compression "
                                  f"(kv_cache_compression_config={a.kv_cache_compression_config!r})")
    if profile["draft_class"] == "DeepseekV4CacheManager":
        _build_deepseek_v4(resources, a, profile)
        return
    if a.pool is None and a.kv_dtype == DataType.NVFP4:
        # a QSA draft pool over it keeps its index key apart (a BF16 key page is not the size of an
        # e2m1 K page, qsa_roles); the carry stands aside on NVFP4 QSA pools (kv_formats.py)
        a.pool = Nvfp4PagedRows(a.num_pages, cfg.num_kv_heads, a.tokens_per_block, cfg.head_dim, device=a.device)
    if a.pool is None:
        dtype = _TORCH_DTYPES[a.kv_dtype]
        # a QSA draft pool's slot holds its index key too where V2 coalesces it (qsa_cache_manager.py)
        roles = 2 if profile["draft_class"] is None else qsa_roles(
            cfg.num_kv_heads, cfg.head_dim, torch.empty((), dtype=dtype).element_size())
        a.pool = PagedRows(a.num_pages, cfg.num_kv_heads, a.tokens_per_block, cfg.head_dim,
                           dtype, device=a.device, roles=roles, heads=heads)
    mtp_layer = cfg.num_layers  # the MTP layer's global index is num_hidden_layers
    # `should_use_separate_draft_kv_cache` (one-engine and `_allow_separate_draft_kv_cache`), which
    # `create_py_executor` sets False on a disaggregated worker (PR #11689: "disabled for disaggregated
    # mode (cache_transceiver_config is not None)"); without one the MTP layer's KV is folded into
    # the target pool. A decoding type without a separate pool is played folded too (the stand-in
    # drafts with the MTP layer whatever the type; outputs never depend on the drafter)
    spec = a.speculative_config
    has_separate = (a.max_draft_len > 0 and a.topology != "folded" and spec is not None
                    and spec.decoding_type in SEPARATE_DRAFT_POOL and a.cache_transceiver_config is None)
    if a.max_draft_len > 0 and not has_separate:
        a.topology = "folded"
    if a.topology is None:
        a.topology = "paired" if joint_reuse(profile, has_separate, a.kv_cache_config.enable_block_reuse) \
            else "unpaired"
    draft: DraftKVManager | None = None
    if has_separate:
        draft_cls = DraftKVManager if profile["draft_class"] is None else qsa_class(
            profile["draft_class"], profile["raw_indices"])
        draft = draft_cls(a.pool, mtp_layer=mtp_layer, paired=a.topology == "paired",
                               entries=a.prefix_entries, draft_len=a.max_draft_len,
                               dtype=a.kv_dtype, mapping=mapping, kv_cache_config=a.kv_cache_config)
        if not profile["markers"]:  # a build from before #18093: no pairing markers at all
            del draft.enable_joint_kv_cache_reuse
            del draft._can_publish_block_reuse
    cls = target_class(profile["target_class"], profile["class_attrs"])
    target: MambaHybridCacheManagerV2 = cls(
        a.model, kv_cache_config=a.kv_cache_config, entries=a.prefix_entries,
        folded_paged=a.pool if a.topology == "folded" and a.max_draft_len > 0 else None,
        mtp_layer=mtp_layer, dtype=a.kv_dtype, mapping=mapping)
    # as build_managers: the target's entry first, then the draft's (None: no separate pool),
    # then the cross pool's (None: not an encoder-decoder model); no compression manager
    resources[ResourceManagerType.KV_CACHE_MANAGER] = target
    resources[ResourceManagerType.DRAFT_KV_CACHE_MANAGER] = draft
    resources[ResourceManagerType.CROSS_KV_CACHE_MANAGER] = None


def _build_deepseek_v4(resources: OrderedDict[Any, Any], a: StandinLlmArgs, profile: dict[str, Any]) -> None:
    """`build_managers` for a DeepSeek-V4 deployment: the separate draft pool is a
    `DeepseekV4CacheManager` over the MTP layer's sliding-window latent pages (built as the target's
    class, `get_kv_cache_manager_cls` @ 38198e34), on the modelled GPU (`sm_version`)."""
    from . import deepseek_v4_cache_manager as dsv4

    cfg = a.model.cfg
    dsv4.SM_VERSION = a.sm_version
    if a.pool is None:
        a.pool = dsv4.latent_pool(a.num_pages, a.tokens_per_block, kv_dtype=a.kv_dtype,  # type: ignore[assignment]
                                  fp8_ds_mla=a.kv_cache_config.dtype == "fp8_ds_mla",
                                  max_draft_len=a.max_draft_len, num_kv_heads=cfg.num_kv_heads,
                                  head_dim=cfg.head_dim, device=a.device)
    mapping = Mapping(a.tp_size, a.enable_attention_dp)
    if a.topology is None:
        a.topology = "paired" if joint_reuse(profile, a.max_draft_len > 0, a.kv_cache_config.enable_block_reuse) \
            else "unpaired"
    if a.topology != "unpaired" or not a.max_draft_len:
        raise NotImplementedError("the stand-in's DeepSeek-V4 pool is the unpaired separate draft pool only")
    draft = dsv4.DeepseekV4CacheManager(a.pool, mtp_layer=cfg.num_layers, kv_cache_config=a.kv_cache_config,  # type: ignore[arg-type]
                                        dtype=a.kv_dtype, draft_len=a.max_draft_len, mapping=mapping)
    cls = target_class(profile["target_class"], profile["class_attrs"])
    target = cls(a.model, kv_cache_config=a.kv_cache_config, entries=a.prefix_entries, folded_paged=None,
                 mtp_layer=cfg.num_layers, dtype=a.kv_dtype, mapping=mapping)
    resources[ResourceManagerType.KV_CACHE_MANAGER] = target
    resources[ResourceManagerType.DRAFT_KV_CACHE_MANAGER] = draft
    resources[ResourceManagerType.CROSS_KV_CACHE_MANAGER] = None


def page_nbytes(llm_args: StandinLlmArgs) -> int:
    """Bytes of one page of the stand-in's pool `[2, Hkv, tpb, D]` (the KV cache it models)."""
    cfg = llm_args.model.cfg
    heads = len(llm_args.kv_heads())  # this rank's shard
    if llm_args.kv_dtype == DataType.NVFP4:  # D/2 payload bytes and D/16 block scales a vector
        return 2 * heads * llm_args.tokens_per_block * (cfg.head_dim // 2 + cfg.head_dim // 16)
    elt = torch.empty((), dtype=_TORCH_DTYPES[llm_args.kv_dtype]).element_size()
    return 2 * heads * llm_args.tokens_per_block * cfg.head_dim * elt


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
    """`KvCacheCreator.teardown_managers` (`_util.py` @ 0004396): the compression manager popped
    and shut down; the KV manager shut down and deleted; the draft one shut down when not None
    and deleted; the cross one shut down when not None and deleted when present. The second
    build then appends them after whatever the first build added (the sequence slot manager)."""
    compression = resources.pop(ResourceManagerType.KV_CACHE_COMPRESSION_MANAGER, None)
    if compression is not None:
        compression.shutdown()
    resources[ResourceManagerType.KV_CACHE_MANAGER].shutdown()
    del resources[ResourceManagerType.KV_CACHE_MANAGER]
    draft = resources[ResourceManagerType.DRAFT_KV_CACHE_MANAGER]
    if draft:
        draft.shutdown()
    del resources[ResourceManagerType.DRAFT_KV_CACHE_MANAGER]
    cross = resources.get(ResourceManagerType.CROSS_KV_CACHE_MANAGER)
    if cross is not None:
        cross.shutdown()
    resources.pop(ResourceManagerType.CROSS_KV_CACHE_MANAGER, None)


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

    def __init__(self, *, model_engine: Any, draft_model_engine: Any, mapping: Any, net_max_seq_len: int,
                 kv_connector_manager: Any, max_num_tokens: int, max_beam_width: int, tokens_per_block: int,
                 max_seq_len: int, max_batch_size: int, kv_cache_config: KvCacheConfig,
                 llm_args: StandinLlmArgs, speculative_config: Any, sparse_attention_config: Any,
                 profiling_stage_data: dict[str, Any] | None, is_disagg: bool, execution_stream: Any = None,
                 draft_config: Any = None, skip_est: bool = False) -> None:
        # the source's keywords (`_util.py` @ 0004396), `is_disagg` required; kept, and read only
        # where the stand-in models what they do (llm_args, kv_cache_config, skip_est)
        self._model_engine = model_engine
        self._draft_model_engine = draft_model_engine
        self._mapping = mapping
        self._net_max_seq_len = net_max_seq_len
        self._kv_connector_manager = kv_connector_manager
        self._max_num_tokens = max_num_tokens
        self._max_beam_width = max_beam_width
        self._tokens_per_block = tokens_per_block
        self._max_seq_len = max_seq_len
        self._max_batch_size = max_batch_size
        self._kv_cache_config = kv_cache_config
        self._speculative_config = speculative_config
        self._sparse_attention_config = sparse_attention_config
        self._profiling_stage_data = profiling_stage_data
        self._is_disagg = is_disagg
        self._execution_stream = execution_stream
        self._draft_config = draft_config
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


def compute_max_num_sequences(mapping: Any, max_batch_size: int, disable_overlap_scheduler: bool,
                              enable_overlap_headroom: bool = False) -> int:
    """`_util.compute_max_num_sequences` (@ 0004396) without pipeline parallelism (the stand-in
    has none): `max_batch_size`, twice that only with the opt-in overlap headroom."""
    return max_batch_size * (2 if enable_overlap_headroom and not disable_overlap_scheduler else 1)


def create_py_executor_instance(
        *, dist: Any, resources: OrderedDict[Any, Any], mapping: Any, llm_args: StandinLlmArgs,
        ctx_chunk_config: Any, model_engine: Any, start_worker: bool, sampler: Any, drafter: Any,
        guided_decoder: Any = None, lora_config: Any = None, garbage_collection_gen0_threshold: Any = None,
        kv_connector_manager: Any = None, resource_governor_queue: Any = None, max_seq_len: int | None = None,
        max_batch_size: int | None = None, max_beam_width: int | None = None, max_num_tokens: int | None = None,
        peft_cache_config: Any = None, scheduler_config: Any = None, cache_transceiver_config: Any = None,
        virtual_memory_pools: Any = None, execution_stream: Any = None, dwdp_manager: Any = None,
        max_num_sequences: int | None = None) -> Any:
    """Stand-in for `_util.create_py_executor_instance` (@ 0004396): assemble the resource
    managers, build the PyExecutor (started only with `start_worker=True`).

    As TensorRT-LLM: each `extra_resource_managers` entry is added to `resources`
    (ValueError on an existing key), then the sequence slot manager (sized `max_num_sequences`),
    the compression manager bound to the KV managers (when present), `ResourceManager(resources)`
    with the KV cache manager moved to the end, then the cross manager (when not None), then the
    compression manager. The worker hook (`trtllm.worker`) wraps this function, as it wraps
    TensorRT-LLM's, to add the carry before the executor exists. The stand-in models no LoRA
    (`lora_config` must be None); `cache_transceiver_config` (a disaggregated worker) is kept,
    what it does to the draft pool played by `build_managers` (no KV transfer is modelled).
    """
    from .py_executor import StandinPyExecutor

    args = llm_args
    assert isinstance(args, StandinLlmArgs)
    assert max_batch_size is not None
    if lora_config is not None:
        raise NotImplementedError("the stand-in models no LoRA")
    if (cache_transceiver_config is None) != (args.cache_transceiver_config is None):
        raise ValueError("cache_transceiver_config must be llm_args.cache_transceiver_config, as "
                         "py_executor_creator passes it")
    if max_num_sequences is None:
        # llm_args.disable_overlap_scheduler is the stand-in's `not overlap_scheduler`
        max_num_sequences = compute_max_num_sequences(mapping, max_batch_size, not args.overlap_scheduler)
    for key, value in args.extra_resource_managers.items():
        if key in resources:
            raise ValueError(f"Cannot overwrite existing resource manager {key}.")
        resources[key] = value
    resources[ResourceManagerType.SEQ_SLOT_MANAGER] = SeqSlotManager(max_num_sequences)
    compression = resources.get(ResourceManagerType.KV_CACHE_COMPRESSION_MANAGER)
    if compression is not None:
        compression.bind_kv_cache_managers(resources[ResourceManagerType.KV_CACHE_MANAGER],
                                           resources.get(ResourceManagerType.DRAFT_KV_CACHE_MANAGER))
    rm = ResourceManager(resources)
    if resources.get(ResourceManagerType.KV_CACHE_MANAGER) is not None:
        rm.resource_managers.move_to_end(ResourceManagerType.KV_CACHE_MANAGER, last=True)
    if resources.get(ResourceManagerType.CROSS_KV_CACHE_MANAGER) is not None:
        rm.resource_managers.move_to_end(ResourceManagerType.CROSS_KV_CACHE_MANAGER, last=True)
    if ResourceManagerType.KV_CACHE_COMPRESSION_MANAGER in rm.resource_managers:
        rm.resource_managers.move_to_end(ResourceManagerType.KV_CACHE_COMPRESSION_MANAGER, last=True)
    executor = StandinPyExecutor(rm, model_engine, args, max_batch_size=max_batch_size, dist=dist)
    if start_worker:
        executor.start_worker()
    return executor
