"""Stand-in for the reuse part of `tensorrt_llm/llmapi/llm_args.py`: `KvCacheConfig`, `MambaStateConfig`.

Read (nothing ran): `MambaStateConfig` as the 1.3.0rc27 and 1.4.0rc4 API references list it
(nvidia.github.io/TensorRT-LLM/<version>/llm-api/reference/MambaStateConfig.html):
`periodic_snapshot_interval: int >= 0 = 0`, `additional_snapshot_offsets_from_start:
List[int > 0] = []`, `additional_snapshot_offsets_from_end: List[int >= 0] = []`,
`enable_branch_snapshot: bool = False` (in 1.4.0rc4 a deprecated alias of the block reuse
config's flag); `KvCacheConfig.enable_block_reuse: bool = True`. The model default that
wins over it: Qwen3-Next's `get_model_defaults` returns
`{"kv_cache_config": {"enable_block_reuse": False}}` ("until a snapshot policy is
configured"; `_torch/models/modeling_qwen3_next.py` @ 00022b04); values the user sets win.
docs/source/features/kvcache.md @ 0076e939: periodic snapshots are "disabled by default";
an end offset of `0` "selects the final prompt boundary".

`llm_args.py` @ 0004396720054fd8e205cbf616f21f0b57c6b412: `BlockReuseConfig` (`policy`:
`Literal["all_reusable", "per_request", "per_conversation"] = "all_reusable"`, `max_num_turns:
PositiveInt = 1`; the old key `block_reuse_policy` refused as renamed), `KvCacheConfig.
block_reuse_config`, and the validator `disable_periodic_mamba_snapshots_for_conversations`
(mode "after"): with policy `per_conversation` and `mamba_state_config.periodic_snapshot_interval
!= 0`, a warning and the interval set to 0 on a copy of the state config. At that commit
`MambaStateConfig.enable_branch_snapshot` is a field of its own (no alias).

Only the fields the hybrid manager's reuse reads are modelled.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..options import BLOCK_REUSE_POLICIES, interval_after_validator
from .conformant import Conformant

logger = logging.getLogger("tensorrt_llm")  # the stand-in's TensorRT-LLM logger

# `BlockReuseConfig.policy`'s values and the validator's effect on the periodic interval are
# `options.BLOCK_REUSE_POLICIES` and `options.interval_after_validator` (llm_args.py @ 0004396;
# `BlockReusePolicy` in kv_cache_manager_v2.py @ 0004396): one reading, shared with the adapter.


@dataclass
class MambaStateConfig(Conformant):
    """`kv_cache_config.mamba_state_config`: where a hybrid target keeps reusable recurrent states."""

    TRTLLM_CLASS = "MambaStateConfig"

    periodic_snapshot_interval: int = 0
    additional_snapshot_offsets_from_start: list[int] = field(default_factory=list)
    additional_snapshot_offsets_from_end: list[int] = field(default_factory=list)
    enable_branch_snapshot: bool = False

    def __post_init__(self) -> None:
        if self.periodic_snapshot_interval < 0:
            raise ValueError(f"periodic_snapshot_interval must be >= 0, got {self.periodic_snapshot_interval}")
        if any(o <= 0 for o in self.additional_snapshot_offsets_from_start):
            raise ValueError("additional_snapshot_offsets_from_start must be > 0, got "
                             f"{self.additional_snapshot_offsets_from_start}")
        if any(o < 0 for o in self.additional_snapshot_offsets_from_end):
            raise ValueError("additional_snapshot_offsets_from_end must be >= 0, got "
                             f"{self.additional_snapshot_offsets_from_end}")


@dataclass
class BlockReuseConfig:
    """`kv_cache_config.block_reuse_config` (llm_args.py @ 0004396): KV cache manager V2's reuse policy.

    `per_request` commits reusable blocks only after the final context chunk; `per_conversation`
    does so too and keeps a conversation's last `max_num_turns` turns, with periodic Mamba
    snapshots off (`KvCacheConfig`'s validator). A bad value is a ValueError naming it."""

    policy: str = "all_reusable"
    max_num_turns: int = 1

    def __post_init__(self) -> None:
        if self.policy not in BLOCK_REUSE_POLICIES:
            raise ValueError(f"block_reuse_config.policy must be one of {', '.join(BLOCK_REUSE_POLICIES)}, "
                             f"got {self.policy!r}")
        if isinstance(self.max_num_turns, bool) or not isinstance(self.max_num_turns, int) \
                or self.max_num_turns < 1:
            raise ValueError(f"block_reuse_config.max_num_turns must be an int >= 1, got {self.max_num_turns!r}")

    @classmethod
    def from_dict(cls, value: Mapping[str, Any] | BlockReuseConfig | None) -> BlockReuseConfig:
        """The section a user's `kv_cache_config` gives (None: the defaults); the key renamed at
        0004396 (`block_reuse_policy`) is refused as the source refuses it."""
        if isinstance(value, BlockReuseConfig):
            return value
        value = dict(value or {})
        if "block_reuse_policy" in value:
            raise ValueError("'kv_cache_config.block_reuse_config.block_reuse_policy' was renamed to "
                             "'kv_cache_config.block_reuse_config.policy'.")
        return cls(**value)


@dataclass
class KvCacheConfig(Conformant):
    """`kv_cache_config`: the fields the stand-in reads (block reuse, its policy, snapshot placement,
    and the capacity knobs of KV cache estimation).

    Built, it has passed the source's validator `disable_periodic_mamba_snapshots_for_conversations`
    (llm_args.py @ 0004396): policy `per_conversation` sets `periodic_snapshot_interval` to 0 (a
    warning), so such a configuration reuses only at its offsets or branch points."""

    TRTLLM_CLASS = "KvCacheConfig"

    enable_block_reuse: bool = True
    mamba_state_config: MambaStateConfig = field(default_factory=MambaStateConfig)
    # the capacity knobs KV cache estimation reads (`llmapi/llm_args.py` KvCacheConfig, code index:
    # `free_gpu_memory_fraction` default 0.9, `max_gpu_total_bytes` default 0: not set)
    free_gpu_memory_fraction: float = 0.9
    max_gpu_total_bytes: int = 0
    block_reuse_config: BlockReuseConfig = field(default_factory=BlockReuseConfig)
    # `KvCacheConfig.dtype` ("auto", "fp8", "nvfp4", "fp8_ds_mla", ...): read by the stand-in's
    # DeepSeek-V4 pool (`use_fp8_ds_mla = kv_cache_config.dtype == "fp8_ds_mla"`, cache_manager.py @ 0b03b6af)
    dtype: str = "auto"

    def __post_init__(self) -> None:
        # disable_periodic_mamba_snapshots_for_conversations (llm_args.py @ 0004396)
        state = self.mamba_state_config
        interval = state.periodic_snapshot_interval
        kept = interval_after_validator(self.block_reuse_config.policy, interval)
        if kept != interval:
            logger.warning("'kv_cache_config.mamba_state_config.periodic_snapshot_interval=%s' is ignored "
                           "because 'kv_cache_config.block_reuse_config.policy=per_conversation' disables "
                           "periodic Mamba snapshots; setting it to 0.", interval)
            self.mamba_state_config = dataclasses.replace(state, periodic_snapshot_interval=kept)

    @classmethod
    def from_dict(cls, value: Mapping[str, Any] | KvCacheConfig | None) -> KvCacheConfig:
        """The configuration a user's `kv_cache_config` gives, over Qwen3-Next's model defaults.

        None (nothing set): `enable_block_reuse` False, the model default. `dtype` is kept (the
        DeepSeek-V4 pool reads it); other `kv_cache_config` keys (tokens_per_block, ...) are
        TensorRT-LLM's and not modelled: taken and ignored; an unknown `mamba_state_config` key is a TypeError.
        """
        if isinstance(value, KvCacheConfig):
            return value
        merged: dict[str, Any] = {**QWEN3_NEXT_MODEL_DEFAULTS["kv_cache_config"], **(value or {})}
        state = merged.get("mamba_state_config") or {}
        if not isinstance(state, MambaStateConfig):
            state = MambaStateConfig(**state)
        fraction = merged.get("free_gpu_memory_fraction")
        return cls(bool(merged["enable_block_reuse"]), state,
                   0.9 if fraction is None else float(fraction), int(merged.get("max_gpu_total_bytes") or 0),
                   BlockReuseConfig.from_dict(merged.get("block_reuse_config")), str(merged.get("dtype", "auto")))


QWEN3_NEXT_MODEL_DEFAULTS: dict[str, dict[str, Any]] = {"kv_cache_config": {"enable_block_reuse": False}}
"""Qwen3-Next's `get_model_defaults` (modeling_qwen3_next.py @ 00022b04): block reuse off."""


@dataclass
class DecodingBaseConfig(Conformant):
    """`TorchLlmArgs.speculative_config` (`llm_args.py` @ 0004396720054fd8e205cbf616f21f0b57c6b412):
    the union of decoding configs tagged by `decoding_type` (`MTP`, `Eagle3`, `NGram`,
    `Draft_Target`, ...), each a `DecodingBaseConfig` with `max_draft_len` (MTP's
    `num_nextn_predict_layers` is its deprecated alias). What the stand-in builds for each type is
    the draft pool the creator gives it (`_util.build_managers`); its drafter is the reference
    model's MTP layer whatever the type (outputs never depend on the drafter)."""

    TRTLLM_CLASS = "DecodingBaseConfig"

    decoding_type: str = "MTP"
    max_draft_len: int = 3


@dataclass
class CacheTransceiverConfig:
    """`TorchLlmArgs.cache_transceiver_config` (`llm_args.py` @ 0004396): set on a disaggregated
    worker (`backend`: `DEFAULT`, `UCX`, `NIXL`, `MOONCAKE`, `MPI`). The stand-in models what it
    does to the draft pool (none separate: `_util.build_managers`), not the KV transfer."""

    backend: str = "DEFAULT"


SEPARATE_DRAFT_POOL = frozenset({"MTP", "Eagle3"})
"""The decoding types the stand-in builds a separate draft KV pool for when the creator allows it:
`speculative/interface.py` (index versions) `should_use_separate_draft_kv_cache` is
`spec_dec_mode.use_one_engine()` and `_allow_separate_draft_kv_cache`, and one-engine modes are
one-model MTP and Eagle3, the external drafters (PARD, DFlash, one-model draft-target) and SA;
NGram is not one-engine (no draft pool). The stand-in plays MTP and Eagle3 of those."""
