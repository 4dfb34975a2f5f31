"""Stand-in for `tensorrt_llm/_torch/attention/backends/sparse/qsa/cache_manager.py`: `QSAMambaHybridCacheManagerV2`.

Read (nothing ran): `qsa/cache_manager.py` @ 38198e34582cf777ecc72062f477987284ba9999 (the tree
of PR #19303), and the main-line layout `tensorrt_llm/_torch/attention_backend/sparse/qsa/
cache_manager.py` @ 306f9922550919a8c5f6271d4586b46b093cdaca; `_util.py` @ 38198e34
(`get_kv_cache_manager_cls`, `_create_one_model_draft_kv_cache_manager`); `kv_cache_manager_v2.py`
@ 38198e34 (`get_index_k_buffer`, `get_batch_cache_indices(..., raw_indices=)`); `qsa/constants.py`
@ 242e38c0316f82603db53bb51b6b1767b53ae2eb; `qsa/indexer.py` @ 6dc94b061170d7e8ac05cce6c44f8a20309bb9d4
(what writes the side rows; the index's version nearest the tree, whose own copy is not stored):

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
- `qsa_sparse_layer_ids` (the layers the mask enables, global ids), `qsa_index_dim`,
  `qsa_index_kv_heads` (`QSASparseParams.index_head_dim`, `.index_kv_heads`),
  `qsa_position_layer_id` (the first local sparse layer: the one position page).
  `_extra_buffers_per_layer` registers per sparse layer `BufferConfig(Role.INDEX_KEY,
  index_kv_heads * index_dim * 2 * tpb)` and on the position layer `BufferConfig(
  qsa_index_position, 3 * 4 * tpb)`; V2 coalesces buffers of one (lifecycle, size) into one
  slot, so an index key as large as a K page shares the K/V slot (the slot then holds
  `scale` = 3 pages: K, V, index key), and the position page has a pool of its own.
- `get_buffers(layer, "HND")`: `[num_slots, scale, kv_heads, tpb, head_dim][:, :2]` (BF16/FP8/HALF;
  NVFP4 goes to the parent). `get_index_k_buffer(layer, kv_layout="NHD")`: the base accessor with
  the indexer's geometry, `[num_slots, tpb, index_kv_heads, index_dim]` bfloat16 (`full_view[:, 0]`
  of `[num_slots, scale, tpb, heads, dim]`, coalesced). `get_qsa_position_buffer()`:
  `[num_slots, tpb, 3]` int32. All indexed by base slot ids: `get_batch_cache_indices(...,
  raw_indices=True)`; without it each id is `slot * scale // kv_factor` (V2's K/V aggregate page).
- The indexer (`QSAIndexer.update_cache_and_compress` @ 6dc94b06) writes, per key `p` of the
  layer's input `hidden_states`: `index_cache[page, within] = k_raw` (`index_qk_proj`'s K part, no
  norm, no RoPE), `position_cache[page, within] = coordinates` (text: the position three times);
  then where `(p + 1) % compress_ratio == 0` the group's anchor replaces `p`'s key:
  `average_pool_qsa_keys` (FP32 mean, cast back), `k_layernorm` (Gemma RMSNorm), RoPE at the
  first member's coordinates. `QsaIndexer` below plays it over the stand-in's pool.

Stand-in choices (not the source's): the index head dim is `num_kv_heads * head_dim` with one
index head (`QSA_INDEX_KV_HEADS`), so on a BF16 pool the index key is exactly a K page's size
and coalesces into the K/V slot (scale 3, the case the default page ids mis-address); on an FP8
pool it has a slot of its own. `compress_ratio` is 4. The index projection is a fixed seeded
matrix (no checkpoint); the norm's weight is zero (Gemma: `x * (1 + w)`). The stand-in's
drafter attends densely: nothing reads the index keys, the test compares them.
Names the source lacks raise (`Conformant`).
"""

from __future__ import annotations

from typing import Any

import torch

from ...dataplane.rope import apply_rope_reference
from .kv_cache_manager_v2 import BAD_PAGE_INDEX, DraftKVManager, PagedRows

QSA_INDEX_KV_HEADS = 1
"""`qsa/constants.py` @ 242e38c0: one replicated index-K head."""
QSA_POSITION_COORDINATE_AXES = 3
"""`qsa/constants.py` @ 242e38c0."""
QSA_MAIN_KV_ROLES = 2
"""`qsa/constants.py` @ 242e38c0: K and V, the first two pages of a slot."""
COMPRESS_RATIO = 4
"""The stand-in's `QSASparseParams.compress_ratio`."""
_KV_FACTOR = 2


def qsa_roles(num_kv_heads: int, head_dim: int, kv_elem_bytes: int) -> int:
    """K-sized pages in a K/V slot of the stand-in's QSA pool: 3 when the index key
    (`QSA_INDEX_KV_HEADS * index_dim` bfloat16 a token) is as large as a K page and V2 coalesces
    it there, else 2."""
    index_bytes = QSA_INDEX_KV_HEADS * num_kv_heads * head_dim * 2
    return 3 if index_bytes == num_kv_heads * head_dim * kv_elem_bytes else 2


class _QsaDraftPool(DraftKVManager):
    """The QSA hybrid's separate one-model draft pool (is_draft): the MTP layer's K/V pages and,
    in the same slot, its index keys and the request's position coordinates. The class a tree
    builds it as is below (`qsa_class`); what makes it QSA's is what it creates (the side pages,
    `qsa_position_layer_id` set), whatever it is called."""

    _supports_reuse_match_backoff = False  # the hybrid parent's value (mamba_cache_manager.py @ 38198e34)

    def __init__(self, paged: PagedRows, *args: Any, **kwargs: Any) -> None:
        super().__init__(paged, *args, **kwargs)
        self.qsa_sparse_layer_ids = [self.mtp_layer]  # the draft mask enables the MTP layer only
        self.qsa_position_layer_id = self.mtp_layer  # the first (only) local sparse layer
        self.qsa_index_kv_heads = QSA_INDEX_KV_HEADS
        _, roles, hkv, tpb, d = paged.store.shape
        self.qsa_index_dim = hkv * d
        self._scale = roles
        sides = getattr(paged, "qsa_sides", None)  # the pool's side pages outlive a rebuild
        if sides is None:
            slots = paged.store.shape[0]
            if roles == 3:  # coalesced: the slot's third page, read in the indexer's NHD layout
                index = paged.store[:, 2].flatten(1).view(torch.bfloat16).unflatten(
                    1, (tpb, QSA_INDEX_KV_HEADS, self.qsa_index_dim))
            else:
                index = torch.zeros(slots, tpb, QSA_INDEX_KV_HEADS, self.qsa_index_dim,
                                    dtype=torch.bfloat16, device=paged.store.device)
                index.copy_(torch.randn(index.shape, generator=torch.Generator().manual_seed(1)))
            position = torch.full((slots, tpb, QSA_POSITION_COORDINATE_AXES), -7, dtype=torch.int32,
                                  device=paged.store.device)  # never-written: not a position
            sides = paged.qsa_sides = (index, position)  # type: ignore[attr-defined]
        self._index: torch.Tensor = sides[0]
        self._position: torch.Tensor = sides[1]

    def get_index_k_buffer(self, layer_idx: int, kv_layout: str = "NHD") -> torch.Tensor | None:
        """`[num_slots, tpb, index_kv_heads, index_dim]` bfloat16 (NHD; HND swaps tpb and heads)."""
        if kv_layout not in ("NHD", "HND"):
            raise ValueError(f"Unsupported kv_layout: {kv_layout}")
        if layer_idx not in self.qsa_sparse_layer_ids:
            return None
        return self._index if kv_layout == "NHD" else self._index.transpose(1, 2)

    def get_qsa_position_buffer(self) -> torch.Tensor | None:
        """`[num_slots, tpb, 3]` int32 position coordinates."""
        return self._position

    def _indices(self, request_ids: list[int], layer_idx: int | None, num_blocks_per_seq: Any,
                 raw_indices: bool) -> list[list[int]]:
        """As `KVCacheManagerV2.get_batch_cache_indices` @ 38198e34: base slot ids with
        `raw_indices`, else each `slot * scale // kv_factor` (`BAD_PAGE_INDEX` kept)."""
        slots = super().get_batch_cache_indices(request_ids, layer_idx, num_blocks_per_seq)
        if raw_indices:
            return slots
        return [[s if s == BAD_PAGE_INDEX else s * self._scale // _KV_FACTOR for s in row] for row in slots]


class _RawIndices:
    """A tree whose `KVCacheManagerV2.get_batch_cache_indices` takes `raw_indices=` (38198e34)."""

    def get_batch_cache_indices(self, request_ids: list[int], layer_idx: int | None = None,
                                num_blocks_per_seq: Any = None, *,
                                raw_indices: bool = False) -> list[list[int]]:
        return self._indices(request_ids, layer_idx, num_blocks_per_seq, raw_indices)  # type: ignore[attr-defined, no-any-return]


class _NoRawIndices:
    """A tree whose base lacks it (0004396720054fd8e205cbf616f21f0b57c6b412,
    1fe0b08f23988c560890aa49894881af28479ba9): only the scaled ids; `raw_indices=` is a TypeError."""

    def get_batch_cache_indices(self, request_ids: list[int], layer_idx: int | None = None,
                                num_blocks_per_seq: Any = None) -> list[list[int]]:
        return self._indices(request_ids, layer_idx, num_blocks_per_seq, False)  # type: ignore[attr-defined, no-any-return]


class QSAMambaHybridCacheManagerV2(_RawIndices, _QsaDraftPool):
    """The class `qsa/cache_manager.py` defines @ 38198e34582cf777ecc72062f477987284ba9999 (and
    @ 2d6d77fd467c8595c888916ecca9500dcd7cf561, 679ce67bc87a4e7dcf96a7490e1550d1bd7f4820)."""

    TRTLLM_CLASS = "QSAMambaHybridCacheManagerV2"
    _supports_draft_reuse_match_backoff = False  # qsa/cache_manager.py @ 38198e34


class Qwen4ExpHybridCacheManagerV2(_RawIndices, _QsaDraftPool):
    """The class newer trees build for `qsa` on KV cache manager V2: `modules/qwen4_exp/
    cache_manager.py` @ 6ff2801f55462b926cc837a7f230fae63bc62fdc (`Qwen4ExpHybridCacheManagerV2(
    MambaHybridCacheManagerV2)`, the QSA side pages only when `sparse_attention_config` is set:
    `qsa_position_layer_id` None otherwise), built by the sparse-attention `registry.py` @ 6ff2801f. The
    index's newest `qsa/cache_manager.py` (not named by a commit there) holds only
    `from ...qwen4_exp.cache_manager import Qwen4ExpHybridCacheManagerV2 as
    QSAMambaHybridCacheManagerV2`: `QWEN4_EXP_ALIAS` below. That tree's `_util.py` reads
    `_supports_reuse_match_backoff` (inherited False): unpaired."""

    TRTLLM_CLASS = "Qwen4ExpHybridCacheManagerV2"


QWEN4_EXP_ALIAS: dict[str, type[_QsaDraftPool]] = {"QSAMambaHybridCacheManagerV2": Qwen4ExpHybridCacheManagerV2}
"""The newest tree's `qsa/cache_manager.py`: the old name bound to the new class (a re-export), so
code importing `QSAMambaHybridCacheManagerV2` there gets a class whose `__name__` is
`Qwen4ExpHybridCacheManagerV2`."""

_QSA_CLASSES: dict[tuple[str, bool], type[_QsaDraftPool]] = {}


def qsa_class(name: str, raw_indices: bool) -> type[_QsaDraftPool]:
    """The QSA draft pool's class as a tree names it (`QSAMambaHybridCacheManagerV2` or
    `Qwen4ExpHybridCacheManagerV2`), over a base with or without `raw_indices`."""
    base = {"QSAMambaHybridCacheManagerV2": QSAMambaHybridCacheManagerV2,
            "Qwen4ExpHybridCacheManagerV2": Qwen4ExpHybridCacheManagerV2}[name]
    if raw_indices:
        return base
    key = (name, raw_indices)
    if key not in _QSA_CLASSES:
        _QSA_CLASSES[key] = type(name, (_NoRawIndices, base), {
            "__doc__": f"{name} on a tree whose KVCacheManagerV2 lacks raw_indices.",
            "get_batch_cache_indices": _NoRawIndices.get_batch_cache_indices})
    return _QSA_CLASSES[key]


class QsaIndexer:
    """The QSA indexer's cache writes (`QSAIndexer.update_cache_and_compress`, indexer.py @
    6dc94b06) over the stand-in's draft pool: raw keys and coordinates per key, group anchors."""

    def __init__(self, manager: _QsaDraftPool, hidden_size: int, rotary_dim: int,
                 rope_theta: float) -> None:
        self.manager = manager
        gen = torch.Generator().manual_seed(0x95A)
        dim = manager.qsa_index_dim
        self.proj = torch.randn(hidden_size, QSA_INDEX_KV_HEADS * dim, generator=gen) / hidden_size ** 0.5
        self.rotary_dim = min(rotary_dim, dim)
        self.rope_theta = rope_theta

    def update(self, rid: int, lo: int, x: torch.Tensor) -> None:
        """Keys `[lo, lo + n)` of request `rid`, the layer's input `x` `[n, hidden]`."""
        m = self.manager
        index, position = m.get_index_k_buffer(m.mtp_layer), m.get_qsa_position_buffer()
        assert index is not None and position is not None
        n = x.shape[0]
        keys = torch.arange(lo, lo + n)
        page, slot = self._slots(rid, keys)
        k_raw = (x.float() @ self.proj).to(torch.bfloat16).view(n, QSA_INDEX_KV_HEADS, -1)
        index[page, slot] = k_raw.to(index.device)
        position[page, slot] = keys[:, None].expand(n, QSA_POSITION_COORDINATE_AXES).to(position)
        ends = keys[(keys + 1) % COMPRESS_RATIO == 0]
        if ends.numel() == 0:
            return
        members = ends[:, None] - torch.arange(COMPRESS_RATIO - 1, -1, -1)[None, :]  # [g, ratio]
        mp, ms = self._slots(rid, members.flatten())
        groups = index[mp, ms].view(ends.numel(), COMPRESS_RATIO, QSA_INDEX_KV_HEADS, -1)
        mean = groups.float().mean(dim=1).to(torch.bfloat16)  # average_pool_qsa_keys
        normed = (mean.float() * torch.rsqrt(mean.float().pow(2).mean(-1, keepdim=True) + 1e-6)
                  ).to(torch.bfloat16)  # Gemma RMSNorm, weight 0
        first = position[mp, ms].view(ends.numel(), COMPRESS_RATIO, -1)[:, 0, 0].to(torch.int64)
        anchor = apply_rope_reference(normed, first.cpu(), self.rotary_dim, self.rope_theta)
        ep, es = self._slots(rid, ends)
        index[ep, es] = anchor.to(index)

    def _slots(self, rid: int, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pool = self.manager.pool
        table = torch.tensor(pool.tables[rid], dtype=torch.int64)
        dev = pool.store.device
        return table[keys // pool.tpb].to(dev), (keys % pool.tpb).to(dev)
