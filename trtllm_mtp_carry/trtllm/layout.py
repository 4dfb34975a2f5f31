"""Pair keys to (page, slot) in TensorRT-LLM's paged KV, and the row gather/scatter (re-exported).

The HND page addressing and copies live in the data plane
(`dataplane/hnd_pages.py`), where the row codecs (`dataplane/row_codec.py`)
use them; this module keeps the adapter's names for them.
"""

from __future__ import annotations

from ..dataplane.hnd_pages import (
    gather_packed_rows,
    gather_rows,
    hnd_layout,
    key_slots,
    page_table,
    scatter_packed_rows,
    scatter_rows,
)

__all__ = ["gather_packed_rows", "gather_rows", "hnd_layout", "key_slots", "page_table", "scatter_packed_rows",
           "scatter_rows"]
