"""One verdict on what the carry does with a deployment's KV format and cache manager.

What it is for: `trtllm-mtp-carry info --llm-config X.yaml` (before anything runs) and the
worker's probe (`probe.py`, on the live draft manager) must say the same thing about the same
deployment. Both resolve what they can see to the same three inputs and call `kv_verdict`:

- the KV format of the MTP layer's draft pool (`resolve_kv_format`): `kv_cache_config.dtype`
  wins when explicit (`fp8`, `nvfp4`, ...); `auto` takes the checkpoint's KV quantization
  (`hf_quant_config.json` `quantization.kv_cache_quant_algo`, or `quant_config.kv_cache_quant_algo`
  in the YAML), else the model's dtype. TensorRT-LLM: `_create_kv_cache_manager` (`_util.py` @
  38198e34582cf777ecc72062f477987284ba9999) sets `DataType.FP8` when the quant mode has an FP8
  KV cache, `DataType.NVFP4` when it has an FP4 one, else the model dtype; the one-model MTP
  draft pool is built from the target's `ModelConfig` (`_get_effective_draft_config`), so it
  takes the target's KV format. The worker reads `draft.dtype` (a `DataType`) through
  `kv_format_of_datatype`.
- the cache manager class the draft pool gets (`manager_of_options` from the YAML, the live
  class name on the worker): `get_kv_cache_manager_cls` @ 38198e34 resolves the draft pool's
  class from the target's config too, so a QSA hybrid's draft pool is a
  `QSAMambaHybridCacheManagerV2` and a DeepSeek-V4 one a `DeepseekV4CacheManager`.
- KV-cache compression (`kv_cache_compression_config.algorithm`).

Invariants:
- `kv_verdict` is pure (no torch, no TensorRT-LLM) and total: every input gives one
  `KvVerdict` whose `line` is one line naming the format or manager and, when the carry
  stands aside, what would be needed.
- The lines are the contract both callers print; docs/TRTLLM-CONFORMANCE.md ("KV formats")
  lists them with the source they were read from.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

KV_DTYPES = ("auto", "fp8", "nvfp4")
"""The `kv_cache_config.dtype` values the verdict names (TensorRT-LLM accepts more: `float16`,
`bfloat16`, `turboquant4`, `fp8_ds_mla`; they resolve through the same function)."""

CARRIED_FORMATS = ("bf16", "fp8", "nvfp4")
"""KV formats whose draft-pool rows the carry moves: BF16 as gathered, FP8 and NVFP4 bit for bit
(an NVFP4 pool's payload and block-scale bytes, `dataplane/nvfp4_kv.py`)."""

_FORMAT_LINES: dict[str, str] = {
    "bf16": "BF16 KV: the drafter's rows are carried as the draft pool holds them",
    "fp8": ("FP8 KV (float8_e4m3fn pages written with the layer's static scale): the drafter's "
            "rows are carried bit for bit, never re-scaled"),
    "nvfp4": ("NVFP4 KV (e2m1 pairs in the K/V pages, one E4M3 scale per 16 values in KEY_BLOCK_SCALE/"
              "VALUE_BLOCK_SCALE pages at the same page index, kv_cache_manager_v2.py @ 00be09f7; "
              "written by quantizeAndWriteFP4KVCache @ 0097566b under each layer's static global "
              "K/V scale): the drafter's rows are carried as their own payload and scale bytes, bit "
              "for bit, never re-scaled"),
}

_CARRIED_MANAGER_LINES: dict[str, str] = {
    "QSAMambaHybridCacheManagerV2": (
        "QSAMambaHybridCacheManagerV2: the drafter's K/V, index-key (Role.INDEX_KEY) and position "
        "(qsa_index_position) rows share one page slot (qsa/cache_manager.py @ 38198e34) and are "
        "carried together, one composite row per key, so the sparse indexer reads restored keys "
        "over the reused prefix"),
}
"""Draft-pool managers whose side rows the carry moves with K/V (`trtllm/draft_pages.py`);
the KV format is then judged as for any other manager, but an NVFP4 one stands aside
(`_NVFP4_SLOT_LINES`)."""

_NVFP4_SLOT_LINES: dict[str, str] = {
    "QSAMambaHybridCacheManagerV2": (
        "QSAMambaHybridCacheManagerV2 with NVFP4 KV stands aside: its slot-major views coalesce the "
        "MTP layer's K/V with its index key (qsa/cache_manager.py @ 38198e34), and where the NVFP4 "
        "KEY_BLOCK_SCALE/VALUE_BLOCK_SCALE pages sit in those slots was not read; carrying needs "
        "that geometry (a get_buffers-like view of the scale pages at the base slot ids)"),
}
"""Carried managers whose NVFP4 block-scale page geometry was not read: their NVFP4 pools stand aside."""

_MANAGER_LINES: dict[str, str] = {
    "DSACacheManagerV2": (
        "DSACacheManagerV2 stands aside: the MTP layer's KV is MLA latent (SELFKONLY) with an "
        "indexer K cache, not the K/V pages the carry moves; TensorRT-LLM pairs it itself where "
        "#19303 lands (test_joint_reuse_pairing.py @ 38198e34)"),
    "MiniMaxM3KVCacheManagerV2": (
        "MiniMaxM3KVCacheManagerV2 stands aside: its sparse layers keep an index-K buffer beside "
        "K/V and its NVFP4 layers sub-paged scale pages (minimax_m3/cache_manager.py); "
        "TensorRT-LLM pairs it itself where #19303 lands (test_joint_reuse_pairing.py @ 38198e34)"),
}
"""Draft-pool managers the carry stands aside on, with why (docs/TRTLLM-CONFORMANCE.md,
"Cache managers"). A manager not named here is judged by the probe's other checks (a V1
draft manager is refused there: the carry needs KVCacheManagerV2)."""

_UNREAD_QSA_LINE = (
    "{manager} stands aside: its draft pool keeps QSA index-key and position pages "
    "(qsa_position_layer_id is set) under a class whose layout the carry has not read; carrying "
    "K/V alone would leave the sparse indexer's keys over the reused prefix stale (the carry "
    "restores QSAMambaHybridCacheManagerV2's, qsa/cache_manager.py @ 38198e34)")
"""A draft manager with QSA buffers the carry does not route (`verdict_of_draft`)."""

_COMPRESSION_LINE = (
    "KV-cache compression ({algorithm}) stands aside: the compression manager rewrites pages the "
    "draft pool holds (cold pages quantized to NVFP4 by the C++ V2 backend's codec, "
    "quantization_for_cold_page, SM100 only; _util.py @ 38198e34 passes the codec to the draft "
    "manager too), and when a live request's draft pages are cold was not read: carrying needs that")

_DATATYPE_FORMATS = {"BF16": "bf16", "BFLOAT16": "bf16", "FP8": "fp8", "NVFP4": "nvfp4",
                     "HALF": "fp16", "FLOAT16": "fp16", "FLOAT": "fp32", "FLOAT32": "fp32"}
_DTYPE_FORMATS = {"fp8": "fp8", "nvfp4": "nvfp4", "bfloat16": "bf16", "bf16": "bf16",
                  "float16": "fp16", "fp16": "fp16", "half": "fp16", "float32": "fp32",
                  "turboquant4": "turboquant4", "fp8_ds_mla": "fp8_ds_mla"}
_QUANT_FORMATS = {"FP8": "fp8", "NVFP4": "nvfp4", "TURBOQUANT4": "turboquant4"}

_SPARSE_MANAGERS = {"qsa": "QSAMambaHybridCacheManagerV2", "deepseek_v4": "DeepseekV4CacheManager",
                    "dsa": "DSACacheManagerV2", "minimax_m3": "MiniMaxM3KVCacheManagerV2"}
"""`sparse_attention_config.algorithm` -> the V2 manager `get_kv_cache_manager_cls` @ 38198e34
gives (for QSA: a hybrid target with V2; `get_sparse_attn_kv_cache_manager` for the others)."""

HYBRID_V2 = "MambaHybridCacheManagerV2"
HYBRID_V1 = "CppMambaHybridCacheManager"


@dataclass(frozen=True, slots=True)
class KvVerdict:
    """What the carry does with a draft pool: `carries` (rows are moved) and `line`, the one line
    both `info` and the worker print (the reason; where the carry stands aside, what is needed)."""

    carries: bool
    kv_format: str
    manager: str
    line: str


def resolve_kv_format(kv_dtype: object, checkpoint_kv_quant: object = None,
                      model_dtype: str = "bfloat16") -> str:
    """The draft pool's KV format (`bf16`, `fp8`, `nvfp4`, `fp16`, ...) from `kv_cache_config.dtype`,
    the checkpoint's `kv_cache_quant_algo` (None: none) and the model's dtype, as TensorRT-LLM
    resolves it: an explicit dtype wins, `auto` takes the checkpoint's KV quantization, else the
    model dtype. ValueError (one line naming the value) for a dtype it does not know."""
    name = "auto" if kv_dtype is None else str(kv_dtype).strip().lower()
    if name == "auto":
        if checkpoint_kv_quant is not None and str(checkpoint_kv_quant).upper() in _QUANT_FORMATS:
            return _QUANT_FORMATS[str(checkpoint_kv_quant).upper()]
        name = str(model_dtype).lower()
    if name not in _DTYPE_FORMATS:
        raise ValueError(f"kv_cache_config.dtype must be one of auto, "
                         f"{', '.join(sorted(_DTYPE_FORMATS))}, got {kv_dtype!r}")
    return _DTYPE_FORMATS[name]


def kv_format_of_datatype(dtype: object) -> str:
    """The KV format of a live manager's `dtype` (`tensorrt_llm.bindings.DataType`, read by `.name`)."""
    name = str(getattr(dtype, "name", dtype)).upper()
    return _DATATYPE_FORMATS.get(name, name.lower())


V1_HYBRID_MANAGERS = frozenset({"CppMambaHybridCacheManager", "MixedMambaHybridCacheManager"})
"""Target manager classes of KV cache manager V1 for hybrid models (`_util.py` @ 38198e34 routes a
hybrid to them where `use_kv_cache_manager_v2` is false, as 1.2.x does with block reuse)."""

V1_MANAGERS = V1_HYBRID_MANAGERS | {"KVCacheManager"}
"""KV cache manager V1 classes: the hybrid ones and the plain one. The carry needs V2, and V1
never pairs."""


def v1_line(manager: str) -> str:
    """The one line for a V1 target manager (the probe refuses it; `info` says the same)."""
    return (f"the target KV cache manager is {manager} (KV cache manager V1, as TensorRT-LLM 1.2.x gives "
            "a hybrid model with block reuse): the carry supports KVCacheManagerV2 only "
            "(kv_cache_config.use_kv_cache_manager_v2)")


def kv_verdict(kv_format: str, manager: str = HYBRID_V2, compression: str | None = None) -> KvVerdict:
    """The one verdict: a V1 manager first, then compression, then the draft pool's manager,
    then the KV format."""
    if manager in V1_MANAGERS:
        return KvVerdict(False, kv_format, manager, v1_line(manager))
    if compression:
        return KvVerdict(False, kv_format, manager, _COMPRESSION_LINE.format(algorithm=compression))
    if manager == DEEPSEEK_V4:
        return deepseek_v4_verdict(kv_format)
    if manager in _MANAGER_LINES:
        return KvVerdict(False, kv_format, manager, _MANAGER_LINES[manager])
    if kv_format == "nvfp4" and manager in _NVFP4_SLOT_LINES:
        return KvVerdict(False, kv_format, manager, _NVFP4_SLOT_LINES[manager])
    if kv_format in _FORMAT_LINES:
        carries = kv_format in CARRIED_FORMATS
        line = _FORMAT_LINES[kv_format]
        if carries and manager in _CARRIED_MANAGER_LINES:
            line = f"{_CARRIED_MANAGER_LINES[manager]}; {line}"
        return KvVerdict(carries, kv_format, manager, line)
    return KvVerdict(False, kv_format, manager,
                     f"{kv_format.upper()} KV stands aside: the carry moves BF16, FP8 or NVFP4 draft pages "
                     "only (kv_cache_config.dtype auto with a BF16 model, fp8 or nvfp4)")


def manager_of_options(options: Mapping[str, Any]) -> str:
    """The draft pool's manager class an `llm.yaml` gives a hybrid MTP model (`get_kv_cache_manager_cls`
    @ 38198e34): the sparse algorithm's manager, the V1 `CppMambaHybridCacheManager` where
    `use_kv_cache_manager_v2` is false, else `MambaHybridCacheManagerV2`."""
    sparse = options.get("sparse_attention_config") or {}
    algorithm = sparse.get("algorithm") if isinstance(sparse, Mapping) else None
    if algorithm in _SPARSE_MANAGERS:
        return _SPARSE_MANAGERS[str(algorithm)]
    kv = options.get("kv_cache_config") or {}
    if isinstance(kv, Mapping) and kv.get("use_kv_cache_manager_v2") is False:
        return HYBRID_V1
    return HYBRID_V2


def verdict_of_options(options: Mapping[str, Any], checkpoint_kv_quant: object = None) -> KvVerdict:
    """`kv_verdict` of an `llm.yaml` (what `info --llm-config` prints): its `kv_cache_config.dtype`,
    the checkpoint's KV quantization (`checkpoint_kv_quant`, else the YAML's
    `quant_config.kv_cache_quant_algo`), its manager and its `kv_cache_compression_config`."""
    kv = options.get("kv_cache_config") or {}
    kv_dtype = kv.get("dtype", "auto") if isinstance(kv, Mapping) else "auto"
    if checkpoint_kv_quant is None:
        quant = options.get("quant_config") or {}
        checkpoint_kv_quant = quant.get("kv_cache_quant_algo") if isinstance(quant, Mapping) else None
    compression = options.get("kv_cache_compression_config") or {}
    algorithm = compression.get("algorithm") if isinstance(compression, Mapping) else None
    kv_format, manager = resolve_kv_format(kv_dtype, checkpoint_kv_quant), manager_of_options(options)
    if manager == DEEPSEEK_V4 and not algorithm:
        return deepseek_v4_verdict(kv_format, deepseek_v4_sm_of_options(kv_format, kv))
    return kv_verdict(kv_format, manager, str(algorithm) if algorithm else None)


def verdict_of_draft(draft: Any, compression: str | None = None) -> KvVerdict:
    """`kv_verdict` of a live draft manager (what the worker's probe decides on): its `dtype` and
    the most derived class of its hierarchy the verdict names (a subclass of a named manager is
    judged as that manager)."""
    names = [c.__name__ for c in type(draft).__mro__]
    if DEEPSEEK_V4 in names and not compression:
        return deepseek_v4_verdict(*deepseek_v4_pool_of(draft))
    manager = next((n for n in names if n in _MANAGER_LINES or n in _CARRIED_MANAGER_LINES), names[0])
    kv_format = kv_format_of_datatype(getattr(draft, "dtype", None))
    if manager not in _CARRIED_MANAGER_LINES and getattr(draft, "qsa_position_layer_id", None) is not None:
        # QSA buffers under a class not read (Qwen4ExpHybridCacheManagerV2 keeps them behind
        # `_qsa_enabled`): carrying K/V alone, at ids scaled for K/V only, would be wrong: fail closed
        return KvVerdict(False, kv_format, manager, _UNREAD_QSA_LINE.format(manager=manager))
    return kv_verdict(kv_format, manager, compression)


# ---- DeepSeek-V4's draft pool ---------------------------------------------------------------

DEEPSEEK_V4 = "DeepseekV4CacheManager"
"""DeepSeek-V4's cache manager class (`deepseek_v4/cache_manager.py`): its draft pool's too."""

HOPPER_SM = 90
"""`get_sm_version()` on Hopper, where DeepSeek-V4 requires `fp8_ds_mla` (`cache_manager.py` @
0b03b6afc16c24de7556e3abf7b78e9ccae2def4) and FlashMLA writes whole blocks (`flash_mla.py` @ 7de08c31)."""

_DSV4_POOL = (
    "deepseek_v4/cache_manager.py @ 0b03b6afc16c24de7556e3abf7b78e9ccae2def4: DeepseekV4CacheManager is "
    "unpaired on every tree read (_supports_reuse_match_backoff False there, and "
    "_supports_draft_reuse_match_backoff False @ 38198e34582cf777ecc72062f477987284ba9999); a compress-ratio-1 "
    "layer has only the SWA buffer (PageIndexMode.PER_LAYER, get_buffers(layer, SWA), get_cache_indices); "
    "metadata.py @ 0b03b6af refuses a separate draft pool unless the MTP layer's ratio is 1 and asserts "
    "window_size == 128; the pool drops blocks below the window (_kv_cache.py @ 00f6bd61 "
    "_unlock_stale_blocks), so the carry keeps the run of keys on held pages up to key N-2 and restores "
    "keys [R-127, R)")

_DSV4_LINES: dict[str, str] = {
    "bf16": ("DeepseekV4CacheManager: the MTP layer's 128-token sliding window of BF16 MLA latent rows (one "
             "512-wide vector a key) is carried as the pool holds it, so a warm turn drafts with restored "
             "rows for the up to 127 keys below its reuse point"),
    "fp8": ("DeepseekV4CacheManager: the MTP layer's 128-token sliding window of FP8 MLA latent rows (one "
            "512-byte e4m3 vector a key, written with the layer's static scale; NVFP4 KV keeps this window "
            "in FP8) is carried bit for bit, so a warm turn drafts with restored rows for the up to 127 keys "
            "below its reuse point"),
    "fp8_ds_mla": ("DeepseekV4CacheManager on Hopper: the MTP layer's 128-token sliding window of fp8_ds_mla "
                   "latent rows (per key 448 e4m3 values, 64 bf16 RoPE values and 7 UE8M0 tile scales, 584 "
                   "bytes) is carried bit for bit, so a warm turn drafts with restored rows for the up to 127 "
                   "keys below its reuse point"),
}
_DSV4_DETAILS: dict[str, str] = {
    "fp8": "NVFP4 KV: cache_dtype = DataType.FP8 for the SWA buffers (cache_manager.py @ 0b03b6af)",
    "fp8_ds_mla": ("footer-scale pages: data rows then footer rows a page, FlashMLA appending with "
                   "page_size=tokens_per_block (footer_scale_kv.py @ d77955c52716fe6ff51d047f0eb93a443a342ef9, "
                   "flash_mla.py @ 7de08c31c5c1bf627e4f7177b41ddc40fcf0ccfe)"),
}


def deepseek_v4_verdict(kv_format: str, sm_version: int | None = None) -> KvVerdict:
    """The verdict on a DeepSeek-V4 draft pool: its MTP layer's sliding-window MLA latent rows are
    carried for BF16, FP8 (and NVFP4, whose window is FP8) and, on Hopper (`sm_version` 90), for
    `fp8_ds_mla`; elsewhere the carry stands aside naming what it did not read. The first line is one
    sentence, the file@commit details follow on the next."""
    fmt = "fp8" if kv_format == "nvfp4" else kv_format
    if fmt == "fp8_ds_mla" and sm_version != HOPPER_SM:
        where = ("info cannot see the GPU, and only tokens_per_block 128 proves Hopper" if sm_version is None
                 else f"this GPU is SM{sm_version}")
        line = ("DeepseekV4CacheManager with fp8_ds_mla KV stands aside off Hopper: which footer-scale page "
                f"size its kernels write there was not read ({where}); the worker carries it on Hopper (SM90)")
        details = ("FlashMLA (Hopper) appends whole blocks, FlashInfer's SM120 path 64-token pages "
                   "(footer_scale_kv.py @ d77955c5, flash_mla.py @ 7de08c31)")
        return KvVerdict(False, kv_format, DEEPSEEK_V4, f"{line}\n{details}; {_DSV4_POOL}")
    if fmt in _DSV4_LINES:
        details = "; ".join(d for d in (_DSV4_DETAILS.get(fmt if kv_format != "nvfp4" else "fp8"), _DSV4_POOL) if d)
        return KvVerdict(True, kv_format, DEEPSEEK_V4, f"{_DSV4_LINES[fmt]}\n{details}")
    return KvVerdict(False, kv_format, DEEPSEEK_V4,
                     f"DeepseekV4CacheManager with {kv_format.upper()} KV stands aside: the carry reads BF16, FP8, "
                     f"NVFP4 (FP8 window) or Hopper's fp8_ds_mla sliding-window pages only\n{_DSV4_POOL}")


def deepseek_v4_sm_of_options(kv_format: str, kv_cache_config: Any) -> int | None:
    """The GPU an `llm.yaml` proves for a DeepSeek-V4 pool, or None: `fp8_ds_mla` with
    `tokens_per_block` 128 runs only on Hopper (off Hopper the manager requires 256,
    `cache_manager.py` @ 0b03b6af)."""
    tpb = kv_cache_config.get("tokens_per_block") if isinstance(kv_cache_config, Mapping) else None
    return HOPPER_SM if kv_format == "fp8_ds_mla" and tpb is not None and int(tpb) == 128 else None


def deepseek_v4_pool_of(draft: Any) -> tuple[str, int | None]:
    """`(kv_format, sm_version)` of a live DeepSeek-V4 draft manager: `fp8_ds_mla` where it says
    `use_fp8_ds_mla` (with the GPU its module's `get_sm_version` reports, what the manager itself
    asked), else its `dtype`'s format (FP8 for an NVFP4 deployment: its SWA pages are FP8)."""
    import sys

    dsv4 = draft
    if getattr(dsv4, "use_fp8_ds_mla", False) is True:
        owner = next(c for c in type(dsv4).__mro__ if c.__name__ == DEEPSEEK_V4)
        get_sm_version = getattr(sys.modules[owner.__module__], "get_sm_version", None)
        return "fp8_ds_mla", None if get_sm_version is None else int(get_sm_version())
    return kv_format_of_datatype(getattr(draft, "dtype", None)), None
