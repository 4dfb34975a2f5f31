"""What the adapter needs from a TensorRT-LLM executor, probed once before anything is installed.

What it is for: the adapter reaches into TensorRT-LLM's `PyExecutor` (in
process through `attach`, or in the worker through `trtllm.worker`'s hook at
`create_py_executor_instance`). Every name it relies on is in
docs/TRTLLM-CONFORMANCE.md with the file and commit it was read from, and is
checked here first: a build that lacks one is refused with one line naming
what is missing, never guessed around.

- `probe_executor(llm)`: the in-process path (`llm._executor.engine`, only with
  `TLLM_WORKER_USE_SINGLE_PROCESS=1`); `probe_managers(resources)`: the checks
  themselves, over the executor's resource managers.
- The draft manager (`KVCacheManagerV2`): `is_draft`, `tokens_per_block`, `dtype` (with its
  class and the executor's KV-cache compression: `kv_formats.kv_verdict`, the verdict
  `info --llm-config` gives too),
  `layer_offsets` (the one layer is the MTP layer, `num_hidden_layers`),
  `mapping`, `get_buffers(layer_idx, kv_layout)`, `get_batch_cache_indices(request_ids,
  layer_idx, ...)`, `_stream`, `_fresh_page_fill`, and the pairing markers
  `enable_joint_kv_cache_reuse`, `_can_publish_block_reuse` (#18093); the target
  manager: `enable_block_reuse`, its class (V1 hybrid managers are refused), the
  class attribute `KvCacheCreator._joint_reuse_supported` pairs on (`_supports_reuse_match_backoff`,
  `_util.py` @ 0004396; `_supports_draft_reuse_match_backoff` on the head of PR #19303 only), and
  for a hybrid target its reuse configuration (`kv_cache_config.mamba_state_config`,
  `_supports_additional_snapshot_offsets`).

Reuse: a target that can never reuse a prefix (block reuse off, or a hybrid target
with no snapshot placement: it commits reusable blocks only at snapshot points) gives
the carry nothing to restore: the carry stands aside with one line naming what to set
(`options.reuse_stand_aside`), never "installed".

Topologies:
- `unpaired`: a separate draft pool that provably neither publishes nor reuses
  blocks (both markers present and false, the target not claiming joint reuse):
  the drafter is blind over the reused prefix, and the carry restores it.
- `paired`: the draft pool publishes or reuses its own blocks: every key below
  the reused depth may be a tree-matched (shared) page: nothing may be written.
  The carry stands aside. Markers missing or disagreeing: refused (fail closed).
  Per tree (docs/TENSORRT-LLM.md, "TensorRT-LLM versions"; the runtime decides from the
  live markers, never from a version): main-line's `MambaHybridCacheManagerV2` sets
  `_supports_reuse_match_backoff = False` (`kv_cache/mamba_cache_manager.py` @ 003f8d08), which
  `_joint_reuse_supported` reads there (`_util.py` @ 0004396): unpaired, the carry restores. The
  layout of PR #18843 (`mamba_cache_manager/mamba_cache_manager_v2.py` @ 28295084) inherits
  True: paired markers. PR #19303 (tree 38198e34) reads `_supports_draft_reuse_match_backoff`:
  hybrids paired, `QSAMambaHybridCacheManagerV2` and `DeepseekV4CacheManager` not (their draft
  pools are judged by `kv_formats.kv_verdict`: a QSA pool is carried with its index-key and
  position rows, `draft_pages.py`; DeepSeek-V4's sliding window of latent rows through its own
  accessors, `get_buffers(mtp, attn_type)` and `get_cache_indices`, which the probe checks
  instead of `get_buffers(mtp, kv_layout)` and `get_batch_cache_indices`).
- `folded`: no separate draft pool (the `DRAFT_KV_CACHE_MANAGER` entry absent or None):
  the MTP layer's KV lives in the target pool and is reused with it. Stands aside.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from .kv_formats import V1_HYBRID_MANAGERS, v1_line, verdict_of_draft
from .options import MAMBA_STATE_FIELDS, TrtllmAdapterError, reuse_stand_aside

DRAFT_KV = "DRAFT_KV_CACHE_MANAGER"
TARGET_KV = "KV_CACHE_MANAGER"
EXTRA = "pip install 'trtllm-mtp-carry[trtllm]'"


@dataclass(frozen=True)
class ExecutorProbe:
    """What attach found: the managers, the MTP layer, the topology, and whether the carry may run."""

    executor: Any
    resource_manager: Any
    target: Any
    draft: Any | None
    mtp_layer: int | None
    tokens_per_block: int | None
    topology: str  # unpaired | paired | folded
    runnable: bool  # the topology and the executor's options let the carry run
    reason: str
    version: str


def manager_name(key: object) -> str:
    """The `ResourceManagerType` member name of a `resource_managers` key (an Enum, or a str)."""
    name = getattr(key, "name", key)
    return name if isinstance(name, str) else str(key)


def find_manager(resource_manager: Any, name: str) -> tuple[object, Any] | None:
    """`(key, manager)` of the `resource_managers` entry named `name`, or None."""
    for key, manager in resource_manager.resource_managers.items():
        if manager_name(key) == name:
            return key, manager
    return None


def reach_executor(llm: Any) -> tuple[Any, str]:
    """`(llm._executor.engine, tensorrt_llm version)`; TrtllmAdapterError naming what is missing.

    The package's stand-in (`standin.StandinLLM`, told apart by its class's module)
    reports itself as a stand-in; anything else needs `tensorrt_llm` importable.
    """
    if any(c.__module__.startswith("trtllm_mtp_carry.trtllm.standin") for c in type(llm).__mro__):
        version = "stand-in"
    else:
        try:
            import tensorrt_llm
        except ImportError as exc:
            raise TrtllmAdapterError(
                f"attach needs TensorRT-LLM, which is not importable here: {EXTRA}") from exc
        version = str(getattr(tensorrt_llm, "__version__", "unknown"))
    proxy = getattr(llm, "_executor", None)
    if proxy is None:
        raise TrtllmAdapterError(
            f"{type(llm).__name__} has no _executor: attach takes a built tensorrt_llm.LLM")
    executor = getattr(proxy, "engine", None)
    if executor is None:
        raise TrtllmAdapterError(
            f"llm._executor ({type(proxy).__name__}) reaches no executor: the PyExecutor runs in "
            "a worker process; install the carry there (TRTLLM_MTP_CARRY_WORKER, trtllm_mtp_carry.trtllm."
            "worker) or set TLLM_WORKER_USE_SINGLE_PROCESS=1 before the first LLM (TP=1) for attach")
    return executor, version


def probe_executor(llm: Any) -> ExecutorProbe:
    """Probe `llm`'s in-process executor (see `probe_managers`), after checking that
    `LLM.generate_async` takes `conversation_params`."""
    executor, version = reach_executor(llm)
    _require_conversation_params(llm)
    rm = _attr(executor, "resource_manager", "PyExecutor")
    managers = _attr(rm, "resource_managers", "ResourceManager")
    # KV-cache compression: `LLM.args` (TorchLlmArgs).kv_cache_compression_config, as the worker reads it
    compression = getattr(getattr(getattr(llm, "args", None), "kv_cache_compression_config", None),
                          "algorithm", None)
    return probe_managers(managers, version, executor, rm, compression=compression)


def probe_managers(managers: Any, version: str, executor: Any = None,
                   resource_manager: Any = None, compression: str | None = None) -> ExecutorProbe:
    """Probe an executor's resource managers (the `resources` dict the worker hook sees, or
    `ResourceManager.resource_managers`); refuse what the carry cannot run on, detect the topology.

    Refused (TrtllmAdapterError, one line each): a missing attribute or signature, TP > 1,
    attention data parallelism, a V1 hybrid target manager, a draft manager other than
    KVCacheManagerV2, the fresh-page fill, and pairing markers that are missing or disagree
    (`_pairing`). Not refused but not runnable (the carry stands aside, `reason` says why and
    what to set): folded (no draft pool, or its entry None), a draft pool whose KV format,
    manager or compression the carry does not move (`kv_formats.kv_verdict`: the line `info
    --llm-config` prints for the same deployment; `compression` is
    `llm_args.kv_cache_compression_config.algorithm`, None: off), a target that never reuses a
    prefix (block reuse off, or a hybrid without snapshot placement), paired.
    """
    found_target = _find(managers, TARGET_KV)
    if found_target is None:
        raise TrtllmAdapterError(f"the executor has no {TARGET_KV} resource manager")
    target = found_target[1]
    found_draft = _find(managers, DRAFT_KV)
    if found_draft is not None and found_draft[1] is None:
        found_draft = None  # no separate draft pool: TensorRT-LLM leaves the entry None
    mapping = _attr(found_draft[1] if found_draft else target, "mapping", "KV cache manager")
    tp = _attr(mapping, "tp_size", "Mapping")
    parallel = parallel_refusal(tp, bool(_attr(mapping, "enable_attention_dp", "Mapping")))
    if parallel is not None:
        raise TrtllmAdapterError(parallel)
    reuse = bool(_attr(target, "enable_block_reuse", "target KV cache manager"))
    if type(target).__name__ in V1_HYBRID_MANAGERS:
        raise TrtllmAdapterError(v1_line(type(target).__name__))  # the line info gives too
    rm = resource_manager
    if found_draft is None:
        return ExecutorProbe(executor, rm, target, None, None, None, "folded", False,
                             "folded: no separate draft KV cache manager, the MTP layer's KV "
                             "(if the model speculates at all) lives in the target pool and is "
                             "reused with it", version)
    draft = found_draft[1]
    _check_draft(draft)
    offsets = _attr(draft, "layer_offsets", "draft KV cache manager")
    if len(offsets) != 1:
        raise TrtllmAdapterError(
            f"the draft KV cache manager holds layers {sorted(offsets)}: expected the one MTP "
            "layer (one-model MTP, num_nextn_predict_layers=1)")
    mtp_layer = int(next(iter(offsets)))
    tpb = int(_attr(draft, "tokens_per_block", "draft KV cache manager"))
    verdict = verdict_of_draft(draft, compression)
    if not verdict.carries:  # the one verdict `info --llm-config` gives too (kv_formats.py)
        shares = getattr(draft, "enable_joint_kv_cache_reuse", False) is True \
            or getattr(draft, "_can_publish_block_reuse", False) is True
        return ExecutorProbe(executor, rm, target, draft, mtp_layer, tpb,
                             "paired" if shares else "unpaired", False, verdict.line, version)
    _check_buffer(draft, mtp_layer, tpb, verdict.kv_format)
    never = _never_reuses(target, reuse)
    if never is not None:
        return ExecutorProbe(executor, rm, target, draft, mtp_layer, tpb, "unpaired", False,
                             never, version)
    paired, found = _pairing(draft, target)
    if paired:
        return ExecutorProbe(executor, rm, target, draft, mtp_layer, tpb, "paired", False,
                             f"paired: the draft pool publishes and reuses its own blocks ({found}); "
                             "TensorRT-LLM restores the drafter's prefix itself, the carry stands "
                             "aside", version)
    return ExecutorProbe(executor, rm, target, draft, mtp_layer, tpb, "unpaired", True,
                         f"unpaired draft pool with block reuse ({found}): the carry restores the "
                         "drafter's rows over the reused prefix", version)


def parallel_refusal(tp_size: object, enable_attention_dp: bool) -> str | None:
    """Why the carry refuses this parallel mapping (one line), or None: TP above one, or attention
    data parallelism. `info --llm-config` gives the same line from `tensor_parallel_size` and
    `enable_attention_dp`."""
    if tp_size != 1:
        return f"tensor parallel size {tp_size}: the carry runs in-process with TP=1 only"
    if enable_attention_dp:
        return ("attention data parallelism is on: the carry needs one executor holding every "
                "request's draft pages (enable_attention_dp must be false)")
    return None


_MISSING = object()


def _never_reuses(target: Any, reuse: bool) -> str | None:
    """`options.reuse_stand_aside` of the target manager's own reuse configuration."""
    hybrid = any("MambaHybridCacheManager" in c.__name__ for c in type(target).__mro__)
    if not reuse or not hybrid:
        return reuse_stand_aside(reuse, hybrid, None)
    kv_cache_config = _attr(target, "kv_cache_config", "target KV cache manager")
    state_config = _attr(kv_cache_config, "mamba_state_config", "KvCacheConfig")
    state = {name: getattr(state_config, name, None) for name in MAMBA_STATE_FIELDS}
    offsets = bool(getattr(target, "_supports_additional_snapshot_offsets", False))
    return reuse_stand_aside(reuse, hybrid, state, offsets)


def _pairing(draft: Any, target: Any) -> tuple[bool, str]:
    """`(paired, what was found)`: read every pairing marker; fail closed.

    Paired (stand aside) when the draft pool publishes (`_can_publish_block_reuse`) or
    reuses (`enable_joint_kv_cache_reuse`) blocks. Unpaired only when both markers are
    present and false and the target's class does not claim the capability its version's
    `KvCacheCreator._joint_reuse_supported` pairs on: `_supports_draft_reuse_match_backoff`
    where the class has it (the head of PR #19303), else `_supports_reuse_match_backoff`
    (`_util.py` @ 0004396; absent or false). Called with block reuse on (the creator pairs
    only then), so anything else (a marker missing, or the target class claiming pairing the
    draft does not show) is refused.
    """
    joint = getattr(draft, "enable_joint_kv_cache_reuse", _MISSING)
    publish = getattr(draft, "_can_publish_block_reuse", _MISSING)
    draft_backoff = getattr(target, "_supports_draft_reuse_match_backoff", _MISSING)
    backoff = getattr(target, "_supports_reuse_match_backoff", _MISSING)

    def show(value: object) -> str:
        return "missing" if value is _MISSING else repr(value)

    found = (f"draft {type(draft).__name__}.enable_joint_kv_cache_reuse={show(joint)}, "
             f"_can_publish_block_reuse={show(publish)}; target {type(target).__name__}."
             f"_supports_draft_reuse_match_backoff={show(draft_backoff)}, "
             f"_supports_reuse_match_backoff={show(backoff)}")
    if joint is True or publish is True:
        return True, found
    if joint is _MISSING or publish is _MISSING:
        raise TrtllmAdapterError(
            f"cannot prove the draft pool shares no blocks ({found}): a pairing marker is "
            "missing, so the carry stands aside")
    capability = draft_backoff if draft_backoff is not _MISSING else backoff  # what the creator reads
    if joint is not False or publish is not False or capability not in (_MISSING, False):
        raise TrtllmAdapterError(
            f"the pairing markers disagree ({found}): the carry cannot tell whether the draft "
            "pool shares blocks, so it stands aside")
    return False, found


def _find(managers: Any, name: str) -> tuple[object, Any] | None:
    for key, manager in managers.items():
        if manager_name(key) == name:
            return key, manager
    return None


def _attr(obj: Any, name: str, owner: str) -> Any:
    if not hasattr(obj, name):
        raise TrtllmAdapterError(
            f"{owner} ({type(obj).__name__}) has no attribute {name!r}: this TensorRT-LLM build "
            "is not one the adapter was written against (see DECISIONS.md)")
    return getattr(obj, name)


def _require_conversation_params(llm: Any) -> None:
    generate = getattr(llm, "generate_async", None)
    if generate is None:
        raise TrtllmAdapterError(f"{type(llm).__name__} has no generate_async")
    try:
        params = inspect.signature(generate).parameters
    except (TypeError, ValueError):
        params = {}  # type: ignore[assignment]
    if "conversation_params" not in params:
        raise TrtllmAdapterError(
            "this TensorRT-LLM build has no conversation id support (LLM.generate_async takes "
            "no conversation_params): the carry keys sessions by ConversationParams.conversation_id")


def _check_draft(draft: Any) -> None:
    owner = "draft KV cache manager"
    if not _attr(draft, "is_draft", owner):
        raise TrtllmAdapterError(f"the {DRAFT_KV} entry is not a draft manager (is_draft is false)")
    if "KVCacheManagerV2" not in {c.__name__ for c in type(draft).__mro__}:
        raise TrtllmAdapterError(
            f"the draft KV cache manager is {type(draft).__name__}, not KVCacheManagerV2: the "
            "carry supports KV cache manager V2 only (kv_cache_config.use_kv_cache_manager_v2)")
    for method, needed in _accessors(draft):
        fn = _attr(draft, method, owner)
        if needed not in inspect.signature(fn).parameters:
            raise TrtllmAdapterError(f"{owner}.{method} takes no {needed!r} argument: an older "
                                     "KV cache manager than the adapter supports")
    _attr(draft, "dtype", owner)  # judged by `kv_formats.verdict_of_draft`, the verdict info gives too
    if getattr(draft, "_fresh_page_fill", None) is not None:  # TRTLLM_KV_FRESH_PAGE_FILL
        raise TrtllmAdapterError(
            "the fresh-page fill is on for the draft pool: it would overwrite the rows the carry "
            "scatters into fresh pages; turn it off")


def _accessors(draft: Any) -> tuple[tuple[str, str], ...]:
    """The page accessors the carry will call on `draft` and the parameter each must take: the
    layout's (`draft_pages`: DeepSeek-V4's by attention type, every other V2 manager's by layout)."""
    from .draft_pages import DeepseekV4DraftPages, DraftPages, attention_typed

    return DeepseekV4DraftPages.ACCESSORS if attention_typed(draft) else DraftPages.ACCESSORS


def _check_latent_buffer(draft: Any, mtp_layer: int, tpb: int) -> None:
    """DeepSeek-V4's sliding-window pages, as `draft_pages.DeepseekV4DraftPages` reads them."""
    from .draft_pages import DeepseekV4DraftPages

    try:
        DeepseekV4DraftPages(draft, mtp_layer).check(tpb)
    except (AttributeError, KeyError, StopIteration, ValueError) as exc:
        raise TrtllmAdapterError(f"the DeepSeek-V4 draft pool's sliding-window pages cannot be read: {exc}") from exc


def _check_buffer(draft: Any, mtp_layer: int, tpb: int, kv_format: str = "bf16") -> None:
    import torch

    from .draft_pages import attention_typed

    if attention_typed(draft):
        _check_latent_buffer(draft, mtp_layer, tpb)
        return
    buf = draft.get_buffers(mtp_layer, kv_layout="HND")
    if buf is None or buf.dim() != 5 or buf.shape[1] != 2 or buf.shape[3] != tpb:
        raise TrtllmAdapterError(
            f"draft get_buffers({mtp_layer}, 'HND') is {None if buf is None else tuple(buf.shape)}: "
            f"expected [pages, 2, kv_heads, {tpb}, head_dim]")
    # KVCacheManagerV2.get_buffers views the pool as its DataType (kv_cache_manager_v2.py @ 0004396:
    # `TensorWrapper(addr_key, self.dtype, shape)`; FP8 is torch.float8_e4m3fn, one byte an element,
    # `_utils.py` @ 000a01de; only NVFP4 is re-typed, to int8 of head_dim // 2)
    expected = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "nvfp4": torch.int8}[kv_format]
    if buf.dtype != expected:
        raise TrtllmAdapterError(f"draft KV pages are {buf.dtype}: {kv_format.upper()} KV pages are "
                                 f"{expected}")
    if kv_format == "nvfp4":  # the block-scale pages beside the payload, viewed as get_buffers views K/V
        from .draft_pages import nvfp4_scale_pages

        try:
            nvfp4_scale_pages(draft, mtp_layer, buf)
        except (AttributeError, KeyError, StopIteration, RuntimeError, ValueError) as exc:
            raise TrtllmAdapterError(f"the NVFP4 draft pool's block-scale pages cannot be viewed: {exc}") from exc
