"""TensorRT plugins for the two data-plane kernels (deployment layer), as AOT Quickly Deployable Plugins.

What it is for: an engine that stores hidden rows (`trtllm_mtp_carry::hidden_row_copy`)
and appends drafter rows (`trtllm_mtp_carry::drafter_row_append`) without Python
at run time: the plugins are `tensorrt.plugin` AOT plugins (TensorRT >= 10.9;
GB10 from 10.14.1) whose `aot_impl` hands TensorRT the prebuilt, ABI-fixed PTX
of `builders/build_abi_kernels.py`; the serialized engine carries the kernel,
so `trtexec` or Triton Inference Server's C++ runtime run it as is.

    import trtllm_mtp_carry.plugins as p
    p.register_plugins(kernel_dir="builders/out", target="sm_121a")   # needs tensorrt
    layer = p.add_hidden_row_copy(network, src, dst_row, store)        # aot=True

In-place writes: the caches and the hidden store are aliased outputs
(`TensorDesc.aliased()`, TensorRT's `IPluginV3OneBuildV2::getAliasedInput`;
enable `trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03` on the builder config). An
aliased output is the only scheme TensorRT offers for a plugin that writes a
few rows of a large persistent buffer: a fresh output would force a copy of the
whole cache per call. The kernel ABI, inputs and launch rules: `kernels/abi.py`.

Importing this package does not import `tensorrt`; any call that needs it
raises RuntimeError naming the extra (`pip install 'trtllm-mtp-carry[tensorrt]'`).
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

__all__ = [
    "APPEND_PLUGIN",
    "COPY_PLUGIN",
    "NAMESPACE",
    "TENSORRT_EXTRA",
    "add_drafter_row_append",
    "add_hidden_row_copy",
    "register_plugins",
    "require_tensorrt",
]

NAMESPACE = "trtllm_mtp_carry"
COPY_PLUGIN = f"{NAMESPACE}::hidden_row_copy"
APPEND_PLUGIN = f"{NAMESPACE}::drafter_row_append"
TENSORRT_EXTRA = "pip install 'trtllm-mtp-carry[tensorrt]' (TensorRT >= 10.9 with tensorrt.plugin)"

_registered: dict[str, Any] = {}


def require_tensorrt() -> tuple[Any, Any]:
    """`(tensorrt, tensorrt.plugin)`, or RuntimeError naming the extra when they cannot load."""
    try:
        trt = importlib.import_module("tensorrt")
        trtp = importlib.import_module("tensorrt.plugin")
    except (ImportError, OSError) as e:  # OSError: the sdist's stub without libnvinfer
        raise RuntimeError(
            f"the TensorRT plugins need TensorRT: {TENSORRT_EXTRA}; import failed: {e}"
        ) from e
    if not hasattr(trtp, "aot_impl"):
        raise RuntimeError(
            f"tensorrt {getattr(trt, '__version__', '?')} has no tensorrt.plugin.aot_impl: "
            f"{TENSORRT_EXTRA}"
        )
    return trt, trtp


def register_plugins(kernel_dir: str | Path | None = None, target: str | None = None) -> dict:
    """Register both plugins with TensorRT (once per process); return `{"kernel_dir", "target"}`.

    `kernel_dir` holds a `builders/build_abi_kernels.py` build (default
    `$TRTLLM_MTP_CARRY_KERNEL_DIR`); `target` is the engine's GPU (`sm_121a` on GB10; default
    `$TRTLLM_MTP_CARRY_TARGET`, else the current device's). A second call must agree.
    """
    _, trtp = require_tensorrt()
    from . import definitions

    given = kernel_dir or os.environ.get("TRTLLM_MTP_CARRY_KERNEL_DIR")
    if not given or not (Path(given) / "manifest.json").exists():
        raise ValueError(
            f"kernel_dir must be a build directory with manifest.json, got {given!r}: "
            "run builders/build_abi_kernels.py --out DIR"
        )
    directory = Path(given)
    chosen = target or os.environ.get("TRTLLM_MTP_CARRY_TARGET") or definitions.device_target()
    config = {"kernel_dir": directory.resolve(), "target": chosen}
    if _registered:
        if _registered != config:
            raise ValueError(f"plugins already registered with {_registered}, not {config}")
        return dict(_registered)
    definitions.define(trtp, config)
    _registered.update(config)
    return dict(config)


def add_hidden_row_copy(network: Any, src: Any, dst_row: Any, dst: Any) -> Any:
    """Add the copy plugin (AOT) to `network`: `dst[dst_row + r] = src[r]`; output 0 aliases `dst`.

    `src` [n, H], `dst_row` [1] int32, `dst` [C, H] same dtype (bf16/fp16/fp32), H % 16 == 0.
    """
    _, trtp = require_tensorrt()
    if not _registered:
        raise RuntimeError("call trtllm_mtp_carry.plugins.register_plugins(...) first")
    return network.add_plugin(trtp.op.trtllm_mtp_carry.hidden_row_copy(src, dst_row, dst), aot=True)


def add_drafter_row_append(network: Any, k_new: Any, v_new: Any, keys: Any, block_table: Any,
                           inv_freq: Any, start_row: Any, k_cache: Any, v_cache: Any) -> Any:
    """Add the append plugin (AOT): RoPE'd `k_new`, `v_new` into rows `start_row..`; outputs alias the caches.

    `k_new`/`v_new` [n, Hkv, D] (Hkv, D static), `keys` [n] int32, `block_table` [max_blocks]
    int32, `inv_freq` [rotary_dim // 2] float32 (`dataplane.rope.rope_inv_freq`), `start_row` [1]
    int32, caches [num_blocks, page_size, Hkv, D] bf16/fp16.
    """
    _, trtp = require_tensorrt()
    if not _registered:
        raise RuntimeError("call trtllm_mtp_carry.plugins.register_plugins(...) first")
    op = trtp.op.trtllm_mtp_carry.drafter_row_append(
        k_new, v_new, keys, block_table, inv_freq, start_row, k_cache, v_cache)
    return network.add_plugin(op, aot=True)
