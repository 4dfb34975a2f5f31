"""What the adapter needs from a TensorRT-LLM executor, probed once before anything is installed.

What it is for: the adapter reaches into TensorRT-LLM's `PyExecutor` (in
process through `attach`, or in the worker through `trtllm.worker`'s hook at
`create_py_executor_instance`). Every name it relies on is in
docs/TRTLLM-CONFORMANCE.md with the file and commit it was read from, and is
checked here first: a build that lacks one is refused with one line naming
what is missing, never guessed around.

- `probe_executor(llm)`: the in-process path (`llm._executor.engine`, only with
  `TLLM_WORKER_USE_SINGLE_PROCESS=1`); `probe_managers(resources, llm_args=...)`: the checks
  themselves, over the executor's resource managers and its `TorchLlmArgs`.
- The executor's `llm_args` (`TorchLlmArgs`, the `llm_args=` keyword `create_py_executor_instance`
  takes, `_util.py` @ 0004396720054fd8e205cbf616f21f0b57c6b412; `LLM.args` in process):
  `speculative_config.decoding_type` (none, or not `MTP`: no drafter the carry serves),
  `cache_transceiver_config` (set: disaggregated, the MTP layer folded into the target pool),
  `kv_cache_compression_config.algorithm`. These are the checks `info --llm-config` makes on the
  file (`trtllm/verdict.py`), in the same order, with the same sentences; without `llm_args` (an
  older creator's call) they are judged from the managers alone.
- The draft manager (`KVCacheManagerV2`): `is_draft`, `tokens_per_block`, `dtype` (with its
  class and the executor's KV-cache compression: `kv_formats.kv_verdict`, the verdict
  `info --llm-config` gives too),
  `layer_offsets` (the one layer is the MTP layer, `num_hidden_layers`),
  `mapping`, `get_buffers(layer_idx, kv_layout)`, `get_batch_cache_indices(request_ids,
  layer_idx, ...)` (and, for a QSA pool, `raw_indices`: its slot-major views are addressed by
  base slot ids, `kv_cache_manager_v2.py` @ 38198e34582cf777ecc72062f477987284ba9999; absent @
  0004396, so probed), `_stream`, `_fresh_page_fill`, and the pairing markers
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
  hybrids paired, the QSA hybrid and `DeepseekV4CacheManager` not (their draft pools are judged
  by `kv_formats.kv_verdict`: a QSA pool is carried with its index-key and position rows,
  `draft_pages.py`; DeepSeek-V4's sliding window of latent rows through its own accessors,
  `get_buffers(mtp, attn_type)` and `get_cache_indices`, which the probe checks instead of
  `get_buffers(mtp, kv_layout)` and `get_batch_cache_indices`).
- `folded`: no separate draft pool (the `DRAFT_KV_CACHE_MANAGER` entry absent or None):
  the MTP layer's KV lives in the target pool and is reused with it. Stands aside.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from .kv_formats import DEEPSEEK_V4, V1_HYBRID_MANAGERS, is_qsa_pool, v1_line, verdict_of_draft
from .options import MAMBA_STATE_FIELDS, TrtllmAdapterError, reuse_stand_aside
from .verdict import disaggregation_verdict, speculation_verdict

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
    reason: str  # one sentence: the verdict `info --llm-config` gives for the same deployment
    version: str
    details: tuple[str, ...] = ()  # what was read where (pairing markers, sources): logged after it


def manager_name(key: object) -> str:
    """The `ResourceManagerType` member name of a `resource_managers` key (an Enum, or a str)."""
    name = getattr(key, "name", key)
    return name if isinstance(name, str) else str(key)


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
    """Probe `llm`'s in-process executor (see `probe_managers`, with `LLM.args` as its
    `llm_args`), after checking that `LLM.generate_async` takes `conversation_params` and that it
    is the one rank (`attach` holds one process's executor: tensor parallelism is the worker
    install's)."""
    executor, version = reach_executor(llm)
    _require_conversation_params(llm)
    rm = _attr(executor, "resource_manager", "PyExecutor")
    managers = _attr(rm, "resource_managers", "ResourceManager")
    found = _find(managers, DRAFT_KV) or _find(managers, TARGET_KV)
    mapping = _attr(found[1], "mapping", "KV cache manager") if found is not None and found[1] is not None else None
    tp = 1 if mapping is None else _attr(mapping, "tp_size", "Mapping")
    if tp != 1:
        raise TrtllmAdapterError(attach_tp_refusal(tp))
    return probe_managers(managers, version, executor, rm, llm_args=getattr(llm, "args", None))


_UNKNOWN = object()  # a fact the caller could not see (no llm_args): judged from the managers alone


def llm_args_facts(llm_args: Any) -> tuple[Any, Any, str | None]:
    """`(decoding type, disaggregated, compression algorithm)` of the executor's `TorchLlmArgs`
    (None: not given, the first two unknown): `speculative_config.decoding_type` (None: no
    speculative decoding), `cache_transceiver_config is not None` (what the creator's rule
    reads, `verdict.py`), `kv_cache_compression_config.algorithm` (None: off)."""
    if llm_args is None:
        return _UNKNOWN, _UNKNOWN, None
    spec_config = getattr(llm_args, "speculative_config", None)
    decoding_type = None if spec_config is None else str(getattr(spec_config, "decoding_type", ""))
    disaggregated = getattr(llm_args, "cache_transceiver_config", None) is not None
    compression = getattr(getattr(llm_args, "kv_cache_compression_config", None), "algorithm", None)
    return decoding_type, disaggregated, None if compression is None else str(compression)


def probe_managers(managers: Any, version: str, executor: Any = None,
                   resource_manager: Any = None, compression: str | None = None,
                   llm_args: Any = None) -> ExecutorProbe:
    """Probe an executor's resource managers (the `resources` dict the worker hook sees, or
    `ResourceManager.resource_managers`) and its `llm_args`; refuse what the carry cannot run on,
    detect the topology. The checks run in `trtllm/verdict.py`'s order, so the reason is the one
    `info --llm-config` gives for the same deployment.

    Refused (TrtllmAdapterError, one line each): a missing attribute or signature (for a QSA pool
    also `raw_indices`), attention data parallelism, pipeline parallelism (`parallel_refusal`), a V1 hybrid target manager, a draft
    manager other than KVCacheManagerV2, the fresh-page fill, and pairing markers that are
    missing or disagree (`_pairing`). Not refused but not runnable (the carry stands aside,
    `reason` says why): no speculative decoding or another decoding type than MTP, a
    disaggregated worker (`llm_args`), folded (no draft pool, or its entry None), a draft pool
    whose KV format, manager or compression the carry does not move (`kv_formats.kv_verdict`;
    `compression`, else `llm_args.kv_cache_compression_config.algorithm`), a target that never
    reuses a prefix (block reuse off, or a hybrid without snapshot placement), paired.
    """
    decoding_type, disaggregated, args_compression = llm_args_facts(llm_args)
    compression = compression or args_compression
    rm = resource_manager
    found_target = _find(managers, TARGET_KV)
    if found_target is None:
        raise TrtllmAdapterError(f"the executor has no {TARGET_KV} resource manager")
    target = found_target[1]
    found_draft = _find(managers, DRAFT_KV)
    if found_draft is not None and found_draft[1] is None:
        found_draft = None  # no separate draft pool: TensorRT-LLM leaves the entry None
    draft = None if found_draft is None else found_draft[1]

    def aside(reason: str, details: tuple[str, ...] = (), topology: str = "unpaired") -> ExecutorProbe:
        return ExecutorProbe(executor, rm, target, draft, None, None, topology, False, reason, version, details)

    spec = None if decoding_type is _UNKNOWN else speculation_verdict(decoding_type)
    if spec is not None:
        return aside(spec.reason, spec.details, "folded" if draft is None else "unpaired")
    mapping = _attr(draft if draft is not None else target, "mapping", "KV cache manager")
    tp = _attr(mapping, "tp_size", "Mapping")
    parallel = parallel_refusal(tp, bool(_attr(mapping, "enable_attention_dp", "Mapping")),
                                _attr(mapping, "pp_size", "Mapping"))
    if parallel is not None:
        raise TrtllmAdapterError(parallel)
    disagg = None if disaggregated is _UNKNOWN else disaggregation_verdict(bool(disaggregated))
    if disagg is not None:
        return aside(disagg.reason, disagg.details, "folded" if draft is None else "unpaired")
    reuse = bool(_attr(target, "enable_block_reuse", "target KV cache manager"))
    if type(target).__name__ in V1_HYBRID_MANAGERS:
        raise TrtllmAdapterError(v1_line(type(target).__name__))  # the line info gives too
    if draft is None:
        return aside("folded: no separate draft KV cache manager, the MTP layer's KV (if the model "
                     "speculates at all) lives in the target pool and is reused with it", (), "folded")
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
                             "paired" if shares else "unpaired", False, verdict.line, version, verdict.details)
    _check_buffer(draft, mtp_layer, tpb, verdict.kv_format)
    never = _never_reuses(target, reuse)
    if never is not None:
        return ExecutorProbe(executor, rm, target, draft, mtp_layer, tpb, "unpaired", False,
                             never, version)
    paired, found = _pairing(draft, target)
    if paired:
        return ExecutorProbe(executor, rm, target, draft, mtp_layer, tpb, "paired", False,
                             "paired: the draft pool publishes and reuses its own blocks, so TensorRT-LLM "
                             "restores the drafter's prefix itself and the carry stands aside", version,
                             (found,))
    return ExecutorProbe(executor, rm, target, draft, mtp_layer, tpb, "unpaired", True, verdict.line, version,
                         (f"unpaired draft pool with block reuse ({found}): the carry restores the "
                          "drafter's rows over the reused prefix", *verdict.details))


def parallel_refusal(tp_size: object, enable_attention_dp: bool, pp_size: object = 1) -> str | None:
    """Why the worker's carry stands aside under this parallel mapping (one line), or None.
    Tensor parallelism is carried: every rank's carry holds its head shard and every decision
    is agreed (`trtllm/lockstep.py`). Attention data parallelism and pipeline parallelism stand
    aside. `info --llm-config` gives the same line from `tensor_parallel_size`,
    `pipeline_parallel_size` and `enable_attention_dp`."""
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        return f"tensor parallel size {tp_size!r}: not a positive int"
    if enable_attention_dp:
        return ("attention data parallelism is on: TensorRT-LLM then folds the MTP layer's KV into the "
                "target pool (no separate draft pool) and each rank serves its own requests; the carry "
                "stands aside (enable_attention_dp must be false)")
    if pp_size != 1:
        return (f"pipeline parallel size {pp_size}: the carry stands aside: the MTP layer's draft pages "
                "live on the last pipeline stage only, whose PyExecutor loop keeps several micro-batches "
                "in flight (not modelled); use tensor parallelism (pipeline_parallel_size 1)")
    return None


def tensor_parallel_note(tp_size: object) -> str:
    """What the worker's carry does at this tensor-parallel size (one line, for `info`)."""
    if tp_size == 1:
        return "TP=1: one rank carries every KV head"
    return (f"TP={tp_size}: every rank carries its own shard of the MTP layer's KV heads (ceil(heads / "
            f"{tp_size}) each); each carry decision is agreed across the ranks (two small all-gathers "
            "when requests start, three when one ends): trtllm/lockstep.py")


def attach_tp_refusal(tp_size: object) -> str:
    """Why `attach` refuses a tensor-parallel executor (one line)."""
    return (f"tensor parallel size {tp_size}: attach reaches one in-process executor (TP=1); at TP above 1 "
            "install the carry in TensorRT-LLM's workers (TRTLLM_MTP_CARRY_WORKER), which carry on every rank")


_MISSING = object()


def _never_reuses(target: Any, reuse: bool) -> str | None:
    """`options.reuse_stand_aside` of the target manager's own reuse configuration."""
    names = [c.__name__ for c in type(target).__mro__]
    # a DeepSeek-V4 target reuses without recurrent-state snapshots, as `info` judges it
    hybrid = DEEPSEEK_V4 not in names and any("MambaHybridCacheManager" in n for n in names)
    if not reuse or not hybrid:
        return reuse_stand_aside(reuse, hybrid, None)
    kv_cache_config = _attr(target, "kv_cache_config", "target KV cache manager")
    state_config = _attr(kv_cache_config, "mamba_state_config", "KvCacheConfig")
    state = {name: getattr(state_config, name, None) for name in MAMBA_STATE_FIELDS}
    offsets = bool(getattr(target, "_supports_additional_snapshot_offsets", False))
    # `KvCacheConfig.block_reuse_config.policy` (llm_args.py @ 0004396; absent before: all_reusable)
    policy = getattr(getattr(kv_cache_config, "block_reuse_config", None), "policy", "all_reusable")
    return reuse_stand_aside(reuse, hybrid, state, offsets, policy=str(policy))


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
    # a QSA pool's slot-major views are addressed by base slot ids (draft_pages.py), which only a
    # tree whose get_batch_cache_indices takes raw_indices gives (kv_cache_manager_v2.py @
    # 38198e34582cf777ecc72062f477987284ba9999; absent @ 0004396720054fd8e205cbf616f21f0b57c6b412
    # and @ 1fe0b08f23988c560890aa49894881af28479ba9)
    if is_qsa_pool(draft) and "raw_indices" not in inspect.signature(draft.get_batch_cache_indices).parameters:
        raise TrtllmAdapterError(
            f"the QSA hybrid's draft pool ({type(draft).__name__}) has no get_batch_cache_indices("
            "raw_indices=) on this TensorRT-LLM tree, so its index-key and position pages cannot be "
            "addressed and the carry stands aside")
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
    # KVCacheManagerV2.get_buffers views the pool as its DataType: `convert_to_torch_tensor(
    # TensorWrapper(addr_key, dtype, shape))` with `dtype = self.dtype`, NVFP4 alone re-typed to
    # torch.int8 of head_dim // 2 (kv_cache_manager_v2.py @ 38198e34582cf777ecc72062f477987284ba9999);
    # the QSA views map the DataType with `binding_to_torch_dtype(self.dtype)`
    # (modules/qwen4_exp/cache_manager.py @ 6ff2801f55462b926cc837a7f230fae63bc62fdc): FP8 pages are
    # torch.float8_e4m3fn, one byte an element
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
