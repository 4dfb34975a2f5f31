"""The trace replay's model defaults (numpy-free, so the command line can show them without loading
the replay)."""

from __future__ import annotations

QWEN3_NEXT_MTP_VECTORS_PER_ROW = 1 * 2 * 2
"""Head vectors in one drafter row of Qwen3-Next's MTP layer: 1 MTP layer x (K, V) x 2 KV heads."""

QWEN3_NEXT_MTP_HEAD_DIM = 256
"""Qwen3-Next's attention head_dim."""

QWEN3_NEXT_MTP_ROW_BYTES = QWEN3_NEXT_MTP_VECTORS_PER_ROW * QWEN3_NEXT_MTP_HEAD_DIM * 2
"""Bytes of one drafter row of Qwen3-Next's MTP layer: 2 KV heads x head_dim 256 x (K, V) x bf16."""

PREFILL_TOKENS_PER_S = 8000.0
"""Service model: prompt tokens prefilled per second."""

DECODE_S_PER_TOKEN = 0.030
"""Service model: seconds per output token."""

AFTER_MISS: tuple[str, ...] = ("valid-run", "nothing", "full")
"""What a follow-up that ran blind over its reused prefix deposits (`replay`'s module header), the
default first: `valid-run` (what both executors do), `nothing` (a gap: no deposit), `full` (all its
rows as if valid: an upper bound)."""

MOVE_MODELS: tuple[str, ...] = ("none", "drain", "crash", "overflow")
"""How sessions leave their worker (`replay`'s module header); `none`: never."""

__all__ = ["AFTER_MISS", "DECODE_S_PER_TOKEN", "MOVE_MODELS", "PREFILL_TOKENS_PER_S", "QWEN3_NEXT_MTP_HEAD_DIM", "QWEN3_NEXT_MTP_ROW_BYTES",
           "QWEN3_NEXT_MTP_VECTORS_PER_ROW"]
