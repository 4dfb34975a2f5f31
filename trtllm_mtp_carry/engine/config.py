"""The reference engine's configuration: sizes and policies, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.row_format import check_row_dtype
from ..runtime.policy import DrafterPolicy

MAX_DRAFT_LEN = 3


@dataclass(frozen=True)
class EngineConfig:
    """Engine sizes and policies; every field is validated on construction."""

    block_size: int = 16
    num_target_blocks: int = 4096
    drafter_block_size: int = 16
    num_drafter_blocks: int = 4096
    max_model_len: int | None = None  # None: the model's max_position
    hidden_capacity: int | None = None  # hidden-store rows; None: max_model_len
    prefill_chunk: int = 512
    snapshot_budget_mb: float = 64.0
    draft_len: int = 2
    policy: DrafterPolicy | str = DrafterPolicy.CARRY
    max_num_seqs: int = 8  # sequences running at once; every decoding one joins each batched step
    mtp_max_seqs: int = 1  # the dispatch cap pinned for reporting (`info`); the carry is armed at any
    device: str = "cpu"
    dtype: str = "float32"
    carry_row_dtype: str | None = None  # carried rows' format (bf16, fp8, nvfp4); None: `carry_row_dtype()`
    # the carry store with one device slot and a host tier as large as the drafter pool: every
    # entry but the newest waits in host memory (the bench's `carry-host`: host-tier hits)
    carry_host_only: bool = False

    def __post_init__(self) -> None:
        for name in ("block_size", "num_target_blocks", "drafter_block_size",
                     "num_drafter_blocks", "prefill_chunk",
                     "max_num_seqs", "mtp_max_seqs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {value!r}")
        if self.max_model_len is not None and (
                isinstance(self.max_model_len, bool) or not isinstance(self.max_model_len, int)
                or self.max_model_len <= 0):
            raise ValueError(
                f"EngineConfig.max_model_len must be a positive int or None, got {self.max_model_len!r}"
            )
        if self.hidden_capacity is not None and (
                isinstance(self.hidden_capacity, bool) or not isinstance(self.hidden_capacity, int)
                or self.hidden_capacity <= 0):
            raise ValueError(
                f"EngineConfig.hidden_capacity must be a positive int or None, got {self.hidden_capacity!r}"
            )
        if self.prefill_chunk % self.block_size:
            raise ValueError(
                f"EngineConfig.prefill_chunk={self.prefill_chunk} must be a multiple of "
                f"block_size={self.block_size} (snapshots land on block boundaries)"
            )
        if not 0 <= self.draft_len <= MAX_DRAFT_LEN:
            raise ValueError(f"EngineConfig.draft_len must be in [0, {MAX_DRAFT_LEN}], got {self.draft_len}")
        if not self.snapshot_budget_mb >= 0:
            raise ValueError(f"EngineConfig.snapshot_budget_mb must be >= 0, got {self.snapshot_budget_mb}")
        if self.dtype not in DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.carry_row_dtype is not None:
            check_row_dtype(self.carry_row_dtype, "EngineConfig.carry_row_dtype")
        object.__setattr__(self, "policy", DrafterPolicy.parse(self.policy))


DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
           "float16": torch.float16}
