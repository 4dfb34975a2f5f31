"""Stand-in for `MambaHybridCacheManagerV2`, the hybrid target's KV cache manager (V2).

TensorRT-LLM: `tensorrt_llm/_torch/pyexecutor/kv_cache/mamba_cache_manager/mamba_cache_manager_v2.py`
and `.../mamba_cache_manager/common.py`, both read at 28295084 (nothing ran). What the
stand-in follows, row by row:

- `prepare_expect_snapshot_points(requests)` (common.py, before scheduling): block reuse
  off, no points; else the points are `range(interval, prompt_len + 1, interval)` for
  `periodic_snapshot_interval > 0`, and, where the class sets
  `_supports_additional_snapshot_offsets` (True on the V2 hybrid manager), every
  `additional_snapshot_offsets_from_start` offset `<= prompt_len` and every
  `prompt_len - offset > 0` of `additional_snapshot_offsets_from_end`. The V2 subclass adds,
  with `mamba_state_config.enable_branch_snapshot`, `prompt_len` when no other point is
  set (`_apply_branch_snapshot_point`: "Keep the flag usable without any configured
  snapshot placement"); the branch points themselves (where a sibling request left the
  reuse tree) are not modelled.
- `try_commit_blocks(request)`: only with block reuse on, never on a draft pool or a
  dummy request; commits `[num_committed, commit_end)` only when
  `context_current_position` is exactly one of `expect_snapshot_points`
  (`commit_end = min(position, min(max(points), prompt_len))`). Each commit keeps the
  attention rows below the point and the recurrent (SSM) state at it: one snapshot
  per point. A point inside a prefill chunk is committed only where a chunk ends on it
  (the stand-in does not split chunks at points; whether TensorRT-LLM's scheduler does
  was not read).
- The prefix lookup "excludes the final prompt token because it must be recomputed by
  prefill" (`_create_kv_cache`), and the hybrid target claims no lookahead: the warm
  turn's reused depth R is the deepest committed point the new prompt still matches
  below its last token, scoped by (salt, LoRA); `context_current_position` and
  `prepopulated_prompt_len` are set to R.
- With `enable_block_reuse` and no placement at all, nothing is ever committed: every
  turn reuses 0 tokens.
- `__init__` keeps `kv_cache_config.model_copy(deep=True)` as `self.kv_cache_config` and, when
  the manager has Mamba layers and block reuse is on, rewrites that copy's
  `block_reuse_config.policy` `all_reusable` to `per_request` ("SSM reuse is valid only at
  explicit snapshot boundaries"); the caller's config is untouched. This layout's class (PR
  #18843) sets no `_supports_reuse_match_backoff`: it inherits `KVCacheManagerV2`'s True
  (`standin._util.VERSIONS`: `pr18843`, paired). Main-line's class
  (`kv_cache/mamba_cache_manager.py` @ 003f8d08) sets it False, "keep main-like reuse endpoints
  and the existing unpaired draft path" (`main`, unpaired), as the release profiles do; PR
  #19303's (38198e34) declines it too and opts its draft pool in with
  `_supports_draft_reuse_match_backoff = True` (`main+19303`, paired). `target_class` builds
  each tree's class.

Invariant: every committed entry holds exactly the rows and state a prefill of its
tokens computes (the stand-in clones them at the commit); entries are evicted oldest
first past `entries`.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from ...engine.model import DenseTargetCache, HybridLM
from .kv_cache_manager_v2 import KVCacheManagerV2, PagedRows
from .llm_args import KvCacheConfig
from .llm_request import LlmRequest
from .mapping import Mapping
from .resource_manager import DataType
from .scheduler import ScheduledRequests


@dataclass
class _Snapshot:
    tokens: list[int]  # the committed prefix [0, point)
    attn: dict[int, tuple[torch.Tensor, torch.Tensor]]
    ssm: list[torch.Tensor | None]  # the recurrent state at the point
    mtp: tuple[torch.Tensor, torch.Tensor] | None  # folded: the MTP rows of keys [0, point)


class MambaHybridCacheManagerV2(KVCacheManagerV2):
    """The hybrid target's KV (dense per request) with reusable snapshots at its snapshot points."""

    _supports_additional_snapshot_offsets = True

    def __init__(self, model: HybridLM, *, kv_cache_config: KvCacheConfig, entries: int,
                 folded_paged: PagedRows | None, mtp_layer: int, dtype: DataType,
                 mapping: Mapping) -> None:
        # as mamba_cache_manager_v2.py @ 28295084: a deep copy, its policy rewritten for SSM reuse
        kv_cache_config = copy.deepcopy(kv_cache_config)
        has_mamba_layers = any(kind != "full" for kind in model.cfg.layer_types)
        if has_mamba_layers and kv_cache_config.enable_block_reuse \
                and kv_cache_config.block_reuse_config.policy == "all_reusable":
            kv_cache_config.block_reuse_config = dataclasses.replace(
                kv_cache_config.block_reuse_config, policy="per_request")
        super().__init__(is_draft=False, mtp_layer=mtp_layer, paged=folded_paged, dtype=dtype,
                         mapping=mapping, kv_cache_config=kv_cache_config)
        self.model = model
        self.entries = entries
        self.caches: dict[int, DenseTargetCache] = {}
        self.committed: dict[int, int] = {}  # request id -> num_committed_tokens
        self.prefix: OrderedDict[tuple[Any, ...], _Snapshot] = OrderedDict()
        if folded_paged is not None:
            self.layer_offsets = {mtp_layer: model.cfg.num_layers}

    def prepare_expect_snapshot_points(self, requests: list[LlmRequest]) -> None:
        """Set each request's reusable snapshot boundaries before scheduling (common.py, V2)."""
        state = self.kv_cache_config.mamba_state_config
        for request in requests:
            if not self.enable_block_reuse:
                request.expect_snapshot_points = []
                continue
            n = request.prompt_len
            points: set[int] = set()
            if state.periodic_snapshot_interval > 0:
                points.update(range(state.periodic_snapshot_interval, n + 1,
                                    state.periodic_snapshot_interval))
            if type(self)._supports_additional_snapshot_offsets:
                points.update(o for o in state.additional_snapshot_offsets_from_start if o <= n)
                points.update(n - o for o in state.additional_snapshot_offsets_from_end if n - o > 0)
            if state.enable_branch_snapshot and not points:
                points.add(n)
            request.expect_snapshot_points = sorted(points)

    def match(self, req: LlmRequest, limit: int | None = None) -> _Snapshot | None:
        """The deepest committed snapshot the prompt matches below its last token (and at most
        `limit` deep), in the request's reuse scope."""
        if not self.enable_block_reuse:
            return None
        deepest = req.prompt_len - 1 if limit is None else min(limit, req.prompt_len - 1)
        best = None
        scope = (req.cache_salt, req.lora_task_id)
        for (s, *_), e in self.prefix.items():
            n = len(e.tokens)
            if s == scope and n <= deepest and req.prompt[:n] == e.tokens:
                if best is None or n > len(best.tokens):
                    best = e
        return best

    def prepare_context(self, req: LlmRequest, entry: _Snapshot | None) -> None:
        """Create the request's cache from `entry` (None: cold); sets context_current_position = R."""
        cache = DenseTargetCache(self.model.cfg)
        if entry is not None:
            for i, (k, v) in entry.attn.items():
                cache.attn_append(i, k.clone(), v.clone())
            cache.restore_ssm(entry.ssm)
            self.prefix.move_to_end(((req.cache_salt, req.lora_task_id), tuple(entry.tokens)))
            if self.paged is not None and entry.mtp is not None:  # folded: reused with the target
                self.paged.ensure(req.py_request_id, len(entry.tokens))
                self.paged.write(req.py_request_id, 0, *entry.mtp)
        self.caches[req.py_request_id] = cache
        reused = 0 if entry is None else len(entry.tokens)
        self.committed[req.py_request_id] = reused
        # setContextCurrentPosition and setPrepopulatedPromptLen, as V2's prepare_context does
        req.context_current_position = req.prepopulated_prompt_len = req.reused = reused

    def try_commit_blocks(self, req: LlmRequest) -> None:
        """After a context chunk: commit `[num_committed, position)` if the position is a snapshot point."""
        if not self.enable_block_reuse or self.is_draft or req.is_dummy:
            return
        points = req.expect_snapshot_points
        pos = req.context_current_position
        commit_end = min(pos, min(max(points), req.prompt_len) if points else req.prompt_len)
        if pos not in points or commit_end <= self.committed.get(req.py_request_id, 0):
            return
        cache = self.caches[req.py_request_id]
        cfg = self.model.cfg
        attn = {i: tuple(t[:commit_end].clone() for t in cache.attn_past(i))  # [S, Hkv, D]
                for i, kind in enumerate(cfg.layer_types) if kind == "full"}
        mtp = None
        if self.paged is not None:
            rows = self.paged.read(req.py_request_id, 0, commit_end)
            mtp = (rows[0].clone(), rows[1].clone())
        tokens = list(req.prompt[:commit_end])
        key = ((req.cache_salt, req.lora_task_id), tuple(tokens))
        self.prefix[key] = _Snapshot(tokens, attn, cache.snapshot_ssm(), mtp)  # type: ignore[arg-type]
        self.prefix.move_to_end(key)
        self.committed[req.py_request_id] = commit_end
        while len(self.prefix) > self.entries:
            self.prefix.popitem(last=False)

    def prepare_resources(self, scheduled_batch: ScheduledRequests) -> None:
        if self.paged is None:
            return
        for r in scheduled_batch.context_requests:  # folded: the MTP layer's pages are ours
            self.paged.ensure(r.py_request_id, r.context_current_position + r.context_chunk_size + 8)
        for r in scheduled_batch.generation_requests:
            self.paged.ensure(r.py_request_id, len(r.tokens) + 8)

    def free_resources(self, request: Any) -> None:
        self.caches.pop(request.py_request_id, None)
        self.committed.pop(request.py_request_id, None)
        if self.paged is not None:
            self.paged.release(request.py_request_id)


_TARGET_CLASSES: dict[tuple[str, tuple[tuple[str, bool], ...]], type[MambaHybridCacheManagerV2]] = {}


def target_class(name: str, class_attrs: dict[str, bool]) -> type[MambaHybridCacheManagerV2]:
    """The target manager's class as a tree names it, with the pairing attributes that tree's
    class declares (`class_attrs`, `standin._util.VERSIONS`): `_supports_reuse_match_backoff`
    (False on main-line's hybrid, `kv_cache/mamba_cache_manager.py` @ 003f8d08, and on #19303's;
    inherited True in PR #18843's layout, `mamba_cache_manager_v2.py` @ 28295084),
    `_supports_draft_reuse_match_backoff` (only on PR #19303's tree, 38198e34: True on the hybrid,
    False on `QSAMambaHybridCacheManagerV2`). An attribute is set only where it differs from what
    the class inherits, so a name the tree lacks stays absent."""
    key = (name, tuple(sorted(class_attrs.items())))
    if key not in _TARGET_CLASSES:
        body: dict[str, Any] = {"__doc__": f"Stand-in for TensorRT-LLM's {name} (target pool)."}
        for attribute, value in class_attrs.items():
            if getattr(MambaHybridCacheManagerV2, attribute, None) is not value:
                body[attribute] = value
        _TARGET_CLASSES[key] = type(name, (MambaHybridCacheManagerV2,), body)
    return _TARGET_CLASSES[key]
