"""The GPU data plane (layer 2): hidden store, drafter KV pool, and the two kernels.

What it is for: the tensors and kernels under the carry core. `HiddenStore` is
the model-level BF16 hidden buffer with its stamped `StoreRange`;
`DrafterKVPool` the drafter's paged KV of compacted rows plus carried entries;
`hidden_row_copy` and `drafter_row_append` the two kernels, each a torch custom
op (Triton on CUDA, plain torch on CPU). `apply_rope_reference` is the one RoPE
formula, shared with the model code. `pack_rows`/`unpack_rows` are the FP8 row
format of carried entries (`PackedRows`: e4m3 payload, a float32 scale per vector).

Names load lazily: importing this package imports torch but neither triton nor
the custom ops until a name that needs them is used.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "RopeConfig": ".rope",
    "apply_rope_reference": ".rope",
    "rope_inv_freq": ".rope",
    "hidden_row_copy_reference": ".reference",
    "drafter_row_append_reference": ".reference",
    "hidden_row_copy": ".ops",
    "drafter_row_append": ".ops",
    "HiddenStore": ".hidden_store",
    "HiddenRowsNotVisible": ".hidden_store",
    "DrafterKVPool": ".kv_pool",
    "CarriedBlocks": ".kv_pool",
    "PoolStats": ".kv_pool",
    "PoolExhaustedError": ".kv_pool",
    "PackedRows": ".row_format",
    "pack_rows": ".row_format",
    "unpack_rows": ".row_format",
    "packed_nbytes": ".row_format",
    "pack_blocks": ".row_format",
    "unpack_blocks": ".row_format",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
