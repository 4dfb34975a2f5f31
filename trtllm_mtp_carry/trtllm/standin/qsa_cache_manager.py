"""Stand-in for `tensorrt_llm/_torch/attention/backends/sparse/qsa/cache_manager.py`: `QSAMambaHybridCacheManagerV2`.

Read (nothing ran): `qsa/cache_manager.py` @ 38198e34582cf777ecc72062f477987284ba9999 (the tree
of PR #19303), and the main-line layout `tensorrt_llm/_torch/attention_backend/sparse/qsa/
cache_manager.py` @ 306f9922550919a8c5f6271d4586b46b093cdaca; `_util.py` @ 38198e34
(`get_kv_cache_manager_cls`, `_create_one_model_draft_kv_cache_manager`):

- A hybrid (GDN) model with `sparse_attention_config.algorithm: qsa` and KV cache manager V2
  gets `QSAMambaHybridCacheManagerV2(MambaHybridCacheManagerV2)` for its target pool, and, the
  one-model MTP draft pool's class being resolved from the target's config
  (`_get_effective_draft_config`), for its separate draft pool too (`is_draft=True`, the layer
  mask marking the MTP layer).
- `_supports_draft_reuse_match_backoff = False` @ 38198e34: "The parent opts in because its draft
  pool is attention-only. QSA's is not: each draft layer adds a Role.INDEX_KEY buffer and a
  QSA_INDEX_POSITION page, unvalidated for cross-request reuse." So #19303 leaves its draft
  pool unpaired (`test_joint_reuse_pairing.py` @ 38198e34: `qsa` -> False); main-line's creator
  reads `_supports_reuse_match_backoff`, which the hybrid parent sets False: unpaired too.
- `qsa_sparse_layer_ids`: the layers the mask enables (global ids); each gets an index-K
  buffer (`Role.INDEX_KEY`, `index_kv_heads * index_head_dim` BF16 per token) in the same V2
  slot as its K/V, and the first local one a position page (three int32 coordinates per
  token, `qsa_index_position`). `get_buffers` returns the K/V roles of that slot as a strided
  view `[num_slots, scale, *page_shape][:, :2]` (for BF16/FP8 pools; NVFP4 goes to the parent).

What the stand-in models: the class, its pairing attribute and its sparse layer ids, over the
stand-in draft pool (`DraftKVManager`: its K/V pages). It does not model the index-K and position
pages (the stand-in's drafter attends densely); the carry stands aside on this manager
(`kv_formats.kv_verdict`), so nothing reads them. Names the source lacks raise (`Conformant`).
"""

from __future__ import annotations

from typing import Any

from .kv_cache_manager_v2 import DraftKVManager


class QSAMambaHybridCacheManagerV2(DraftKVManager):
    """The QSA hybrid's separate one-model draft pool (is_draft): K/V pages of the MTP layer."""

    _supports_reuse_match_backoff = False  # the hybrid parent's value (mamba_cache_manager.py @ 38198e34)
    _supports_draft_reuse_match_backoff = False  # qsa/cache_manager.py @ 38198e34

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.qsa_sparse_layer_ids = [self.mtp_layer]  # the draft mask enables the MTP layer only
