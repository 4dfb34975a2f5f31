"""Stand-in for `tensorrt_llm/mapping.py`: `Mapping`, the two fields the adapter reads (notes section 0)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Mapping:
    """Stand-in for `tensorrt_llm.mapping.Mapping` (the fields the adapter reads)."""

    tp_size: int = 1
    enable_attention_dp: bool = False
