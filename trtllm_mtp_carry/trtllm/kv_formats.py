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
  draft pool is built from the target's `ModelConfig` (`_get_effective_draft_config`, `_util.py`
  @ 6ff2801f55462b926cc837a7f230fae63bc62fdc: "MTP layers reuse the target model architecture"),
  so it takes the target's KV format. The worker reads `draft.dtype` (a `DataType`) through
  `kv_format_of_datatype`.
- the draft pool's manager (`manager_of_options` from the YAML, `manager_of_draft` on the
  worker): `get_kv_cache_manager_cls` resolves the draft pool's class from the target's config
  too (`_util.py` @ 6ff2801f), so a QSA hybrid's draft pool is a QSA manager and a DeepSeek-V4
  one a `DeepseekV4CacheManager`. A QSA pool is recognised by what its class makes, not by its
  name (the class was renamed: `QSAMambaHybridCacheManagerV2` @ 38198e34,
  `Qwen4ExpHybridCacheManagerV2` @ 6ff2801f, `Qwen4ExpHybridCacheManager` in the registry @
  640812f3ec6f01cb5fe9f99c1d77db74007efc79): a `qsa_position_layer_id` that is set and the
  `get_index_k_buffer` / `get_qsa_position_buffer` views (`is_qsa_pool`), as TensorRT-LLM's own
  QSA metadata decides it (`qsa_has_local_layers = kv_cache_manager.qsa_position_layer_id is not
  None`, `qsa/metadata.py` @ fb8eddd2c7d0b594037125cf1b2aa60326a4ff36).
- KV-cache compression (`kv_cache_compression_config.algorithm`).

Invariants:
- `kv_verdict` is pure (no torch, no TensorRT-LLM) and total: every input gives one
  `KvVerdict` whose `line` is one sentence naming the format or manager and, when the carry
  stands aside, why; `details` say where that was read (file @ commit) and what would be needed.
- The sentences are the contract both callers print; docs/TRTLLM-CONFORMANCE.md ("KV formats")
  lists them with the source they were read from.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

KV_DTYPES = ("auto", "fp8", "nvfp4")
"""The `kv_cache_config.dtype` values the verdict names (TensorRT-LLM accepts more: `float16`,
`bfloat16`, `fp8_ds_mla`, ...; they resolve through the same function)."""

CARRIED_FORMATS = ("bf16", "fp8", "nvfp4")
"""KV formats whose draft-pool rows the carry moves: BF16 as gathered, FP8 and NVFP4 bit for bit
(an NVFP4 pool's payload and block-scale bytes, `dataplane/nvfp4_kv.py`)."""

V2 = "kv_cache_manager_v2.py @ 38198e34582cf777ecc72062f477987284ba9999"
QWEN4 = "modules/qwen4_exp/cache_manager.py @ 6ff2801f55462b926cc837a7f230fae63bc62fdc"

_FORMATS: dict[str, tuple[str, tuple[str, ...]]] = {
    "bf16": ("BF16 KV: the drafter's rows are carried as the draft pool holds them", ()),
    "fp8": ("FP8 KV: the drafter's rows are carried bit for bit as the pool's own float8_e4m3fn bytes, "
            "never re-scaled", (
                f"KVCacheManagerV2.get_buffers hands the pool's DataType.FP8 to TensorWrapper and "
                f"convert_to_torch_tensor, which view it one byte an element ({V2}); the QSA views call "
                f"binding_to_torch_dtype(self.dtype) ({QWEN4}); the pages hold e4m3 values written with the "
                "layer's static KV scale",)),
    "nvfp4": ("NVFP4 KV: the drafter's rows are carried bit for bit as their own e2m1 payload and E4M3 "
              "block-scale bytes, never re-scaled", (
                  f"get_buffers re-types an NVFP4 pool to int8 (two e2m1 values a byte) and its block scales "
                  f"live in KEY_BLOCK_SCALE/VALUE_BLOCK_SCALE pages at the same page index ({V2}: "
                  "_build_pool_mapping_tensors asserts the scale offset equals the data's); they are written by "
                  "quantizeAndWriteFP4KVCache (unfusedAttentionKernels_2_template.h @ "
                  "0097566bd62be830bcbb29fb4782de9564020cda) under each layer's static global K/V scale",)),
}
"""KV format -> (the verdict's sentence, where it was read)."""

QSA_HYBRID = "QSA hybrid"
"""The verdict's name for a QSA hybrid's draft pool, whatever its class is called on the tree."""

_QSA_CARRIED: tuple[str, tuple[str, ...]] = (", with the QSA hybrid's index-key and position rows of each key carried beside them",
                (f"a QSA pool keeps, in the MTP layer's page slot, its index keys (Role.INDEX_KEY) and the "
                 f"request's position coordinates (qsa_index_position): qsa/cache_manager.py @ "
                 f"38198e34582cf777ecc72062f477987284ba9999, {QWEN4}; carried as one composite row a key, so the "
                 "sparse indexer reads restored keys over the reused prefix",))

_QSA_NVFP4: tuple[str, tuple[str, ...]] = ("the QSA hybrid's NVFP4 draft pool stands aside: where its block-scale pages sit in the "
              "slot-major QSA layout was not read", (
                  f"QSA's get_buffers hands NVFP4 back to the parent hybrid manager ({QWEN4}) while its index "
                  "key and positions stay slot-major; carrying needs a get_buffers-like view of the scale pages "
                  "at the base slot ids",))

_MANAGERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "DSACacheManagerV2": (
        "DSACacheManagerV2 stands aside: the MTP layer's KV is an MLA latent with an indexer K cache, not "
        "the K/V pages the carry moves", ("TensorRT-LLM pairs it itself where #19303 lands "
                                          "(test_joint_reuse_pairing.py @ 38198e34582cf777ecc72062f477987284ba9999)",)),
    "MiniMaxM3KVCacheManagerV2": (
        "MiniMaxM3KVCacheManagerV2 stands aside: its sparse layers keep an index-K buffer beside K/V that the "
        "carry does not move", ("its NVFP4 layers keep sub-paged scale pages (minimax_m3/cache_manager.py); "
                                "TensorRT-LLM pairs it itself where #19303 lands (test_joint_reuse_pairing.py @ "
                                "38198e34582cf777ecc72062f477987284ba9999)",)),
}
"""Draft-pool managers the carry stands aside on, with why (docs/TRTLLM-CONFORMANCE.md,
"Cache managers"). A manager not named here is judged by the probe's other checks (a V1
draft manager is refused there: the carry needs KVCacheManagerV2)."""

_UNREAD_QSA: tuple[str, tuple[str, ...]] = ("{manager} stands aside: it keeps QSA position pages (qsa_position_layer_id is set) "
               "without the index-key and position views the carry reads", (
                   "a QSA pool is carried through get_index_k_buffer and get_qsa_position_buffer at the base "
                   f"slot ids ({QWEN4}); carrying K/V alone would leave the sparse indexer's keys stale",))

_COMPRESSION: tuple[str, tuple[str, ...]] = ("KV-cache compression ({algorithm}) stands aside: when a live request's draft pages are "
                "rewritten by the compression manager was not read", (
                    "cold pages are quantized to NVFP4 by the C++ V2 backend's codec "
                    "(quantization_for_cold_page, SM100 only); _util.py @ 38198e34582cf777ecc72062f477987284ba9999 "
                    "passes the codec to the draft manager too",))

_DATATYPE_FORMATS = {"BF16": "bf16", "BFLOAT16": "bf16", "FP8": "fp8", "NVFP4": "nvfp4",
                     "HALF": "fp16", "FLOAT16": "fp16", "FLOAT": "fp32", "FLOAT32": "fp32"}
_DTYPE_FORMATS = {"fp8": "fp8", "fp8_ds_mla": "fp8_ds_mla", "nvfp4": "nvfp4", "bfloat16": "bf16", "bf16": "bf16",
                  "float16": "fp16", "fp16": "fp16", "half": "fp16", "float32": "fp32", "int64": "int64",
                  "int32": "int32", "int8": "int8", "bool": "bool"}
_QUANT_FORMATS = {"FP8": "fp8", "NVFP4": "nvfp4"}

_SPARSE_MANAGERS = {"qsa": QSA_HYBRID, "deepseek_v4": "DeepseekV4CacheManager",
                    "dsa": "DSACacheManagerV2", "minimax_m3": "MiniMaxM3KVCacheManagerV2"}
"""`sparse_attention_config.algorithm` -> the V2 manager `get_kv_cache_manager_cls` gives (QSA: a
hybrid target with V2, `registry.py` @ 6ff2801f55462b926cc837a7f230fae63bc62fdc; the others
`get_sparse_attn_kv_cache_manager` @ 38198e34)."""

HYBRID_V2 = "MambaHybridCacheManagerV2"
HYBRID_V1 = "CppMambaHybridCacheManager"


@dataclass(frozen=True, slots=True)
class KvVerdict:
    """What the carry does with a draft pool: `carries` (rows are moved), `line` (one sentence
    both `info` and the worker print: the reason, or why the carry stands aside) and `details`
    (where that was read, what would be needed: lines said below it)."""

    carries: bool
    kv_format: str
    manager: str
    line: str
    details: tuple[str, ...] = ()


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
    """The one sentence for a V1 target manager (the probe refuses it; `info` says the same)."""
    return (f"the target KV cache manager is {manager} (KV cache manager V1): the carry supports "
            "KVCacheManagerV2 only, set kv_cache_config.use_kv_cache_manager_v2: true")


def kv_verdict(kv_format: str, manager: str = HYBRID_V2, compression: str | None = None) -> KvVerdict:
    """The one verdict: a V1 manager first, then compression, then the draft pool's manager,
    then the KV format."""
    if manager in V1_MANAGERS:
        return KvVerdict(False, kv_format, manager, v1_line(manager), (
            "TensorRT-LLM 1.2.x gives a hybrid model with block reuse the V1 manager "
            "(_util.py @ 38198e34582cf777ecc72062f477987284ba9999, get_kv_cache_manager_cls)",))
    if compression:
        line, details = _COMPRESSION
        return KvVerdict(False, kv_format, manager, line.format(algorithm=compression), details)
    if manager == DEEPSEEK_V4:
        return deepseek_v4_verdict(kv_format)
    if manager in _MANAGERS:
        return KvVerdict(False, kv_format, manager, *_MANAGERS[manager])
    if manager == QSA_HYBRID and kv_format == "nvfp4":
        return KvVerdict(False, kv_format, manager, *_QSA_NVFP4)
    if kv_format in CARRIED_FORMATS:
        line, details = _FORMATS[kv_format]
        if manager == QSA_HYBRID:
            line, details = line + _QSA_CARRIED[0], (*details, *_QSA_CARRIED[1])
        return KvVerdict(True, kv_format, manager, line, tuple(details))
    return KvVerdict(False, kv_format, manager,
                     f"{kv_format.upper()} KV stands aside: the carry moves BF16, FP8 or NVFP4 draft pages only",
                     ("kv_cache_config.dtype auto with a BF16 model, fp8 or nvfp4",))


def manager_of_options(options: Mapping[str, Any]) -> str:
    """The draft pool's manager an `llm.yaml` gives a hybrid MTP model (`get_kv_cache_manager_cls`
    @ 6ff2801f): the sparse algorithm's manager (`QSA_HYBRID` for QSA), the V1
    `CppMambaHybridCacheManager` where `use_kv_cache_manager_v2` is false, else
    `MambaHybridCacheManagerV2` (newer trees name a model's own subclass of it)."""
    sparse = options.get("sparse_attention_config") or {}
    algorithm = sparse.get("algorithm") if isinstance(sparse, Mapping) else None
    if algorithm in _SPARSE_MANAGERS:
        return _SPARSE_MANAGERS[str(algorithm)]
    kv = options.get("kv_cache_config") or {}
    if isinstance(kv, Mapping) and kv.get("use_kv_cache_manager_v2") is False:
        return HYBRID_V1
    return HYBRID_V2


def verdict_of_options(options: Mapping[str, Any], checkpoint_kv_quant: object = None,
                       model_dtype: str = "bfloat16") -> KvVerdict:
    """`kv_verdict` of an `llm.yaml` (what `info --llm-config` prints): its `kv_cache_config.dtype`,
    the checkpoint's KV quantization (`checkpoint_kv_quant`, else the YAML's
    `quant_config.kv_cache_quant_algo`), the model's dtype, its manager and its
    `kv_cache_compression_config`."""
    kv = options.get("kv_cache_config") or {}
    kv_dtype = kv.get("dtype", "auto") if isinstance(kv, Mapping) else "auto"
    if checkpoint_kv_quant is None:
        quant = options.get("quant_config") or {}
        checkpoint_kv_quant = quant.get("kv_cache_quant_algo") if isinstance(quant, Mapping) else None
    compression = options.get("kv_cache_compression_config") or {}
    algorithm = compression.get("algorithm") if isinstance(compression, Mapping) else None
    kv_format, manager = resolve_kv_format(kv_dtype, checkpoint_kv_quant, model_dtype), manager_of_options(options)
    if manager == DEEPSEEK_V4 and not algorithm:
        return deepseek_v4_verdict(kv_format, deepseek_v4_sm_of_options(kv_format, kv))
    return kv_verdict(kv_format, manager, str(algorithm) if algorithm else None)


QSA_VIEWS = ("get_index_k_buffer", "get_qsa_position_buffer")
"""The views a QSA pool is carried through (both QSA classes define them)."""


def is_qsa_pool(draft: Any) -> bool:
    """A draft pool the QSA hybrid's manager built with its side pages: its
    `qsa_position_layer_id` is set (the first local sparse layer, set where the class registered
    the `qsa_index_position` page) and it has the index-key and position views. What TensorRT-LLM's
    QSA metadata reads (`qsa_has_local_layers`); whatever the class is called."""
    return getattr(draft, "qsa_position_layer_id", None) is not None and all(
        callable(getattr(draft, name, None)) for name in QSA_VIEWS)


def manager_of_draft(draft: Any) -> str:
    """The verdict's name for a live draft manager: `QSA_HYBRID` for a QSA pool (`is_qsa_pool`),
    else the most derived class of its hierarchy the verdict names (a subclass of a named manager
    is judged as it), else its class name."""
    if is_qsa_pool(draft):
        return QSA_HYBRID
    names = [c.__name__ for c in type(draft).__mro__]
    return next((n for n in names if n in _MANAGERS or n in V1_MANAGERS or n == DEEPSEEK_V4), names[0])


def verdict_of_draft(draft: Any, compression: str | None = None) -> KvVerdict:
    """`kv_verdict` of a live draft manager (what the worker's probe decides on): its `dtype` and
    its manager (`manager_of_draft`). A pool that keeps QSA position pages without the views the
    carry reads stands aside (carrying K/V alone would be wrong: fail closed)."""
    if DEEPSEEK_V4 in {c.__name__ for c in type(draft).__mro__} and not compression:
        return deepseek_v4_verdict(*deepseek_v4_pool_of(draft))
    kv_format = kv_format_of_datatype(getattr(draft, "dtype", None))
    manager = manager_of_draft(draft)
    if manager != QSA_HYBRID and getattr(draft, "qsa_position_layer_id", None) is not None:
        line, details = _UNREAD_QSA
        return KvVerdict(False, kv_format, manager, line.format(manager=manager), details)
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
    "fp8": "an NVFP4 deployment's SWA buffers are FP8 too (cache_dtype = DataType.FP8, cache_manager.py @ 0b03b6af)",
    "fp8_ds_mla": ("footer-scale pages: data rows then footer rows a page, FlashMLA appending with "
                   "page_size=tokens_per_block (footer_scale_kv.py @ d77955c52716fe6ff51d047f0eb93a443a342ef9, "
                   "flash_mla.py @ 7de08c31c5c1bf627e4f7177b41ddc40fcf0ccfe)"),
}


def deepseek_v4_verdict(kv_format: str, sm_version: int | None = None) -> KvVerdict:
    """The verdict on a DeepSeek-V4 draft pool: its MTP layer's sliding-window MLA latent rows are
    carried for BF16, FP8 (and NVFP4, whose window is FP8) and, on Hopper (`sm_version` 90), for
    `fp8_ds_mla`; elsewhere the carry stands aside naming what it did not read. The first line is one
    sentence; `details` say where each fact was read."""
    fmt = "fp8" if kv_format == "nvfp4" else kv_format
    if fmt == "fp8_ds_mla" and sm_version != HOPPER_SM:
        where = ("info cannot see the GPU, and only tokens_per_block 128 proves Hopper" if sm_version is None
                 else f"this GPU is SM{sm_version}")
        line = ("DeepseekV4CacheManager with fp8_ds_mla KV stands aside off Hopper: which footer-scale page "
                f"size its kernels write there was not read ({where}); the worker carries it on Hopper (SM90)")
        writers = ("FlashMLA (Hopper) appends whole blocks, FlashInfer's SM120 path 64-token pages "
                   "(footer_scale_kv.py @ d77955c5, flash_mla.py @ 7de08c31)")
        return KvVerdict(False, kv_format, DEEPSEEK_V4, line, (writers, _DSV4_POOL))
    if fmt in _DSV4_LINES:
        read = tuple(d for d in (_DSV4_DETAILS.get(fmt), _DSV4_POOL) if d)
        return KvVerdict(True, kv_format, DEEPSEEK_V4, _DSV4_LINES[fmt], read)
    return KvVerdict(False, kv_format, DEEPSEEK_V4,
                     f"DeepseekV4CacheManager with {kv_format.upper()} KV stands aside: the carry reads BF16, FP8, "
                     f"NVFP4 (FP8 window) or Hopper's fp8_ds_mla sliding-window pages only", (_DSV4_POOL,))


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
