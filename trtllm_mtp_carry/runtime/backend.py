"""The one small interface between the carry runtime and an engine.

The runtime is engine-agnostic: it owns the carry slot and decides, the
engine computes. An engine (the reference engine, the TensorRT-LLM adapter)
exposes its drafter KV pool and hidden store, and one model computation (a
rebuild turn's full target pass is the engine's own prefill from position 0).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from ..dataplane.hidden_store import HiddenStore
    from ..dataplane.kv_pool import DrafterKVPool


class CarryBackend(Protocol):
    """What the runtime needs from an engine."""

    @property
    def drafter_pool(self) -> DrafterKVPool:
        """The drafter's paged KV (rows, blocks, the carry slot)."""
        ...

    @property
    def hidden_store(self) -> HiddenStore:
        """The model-level BF16 hidden store, indexed by absolute position."""
        ...

    def drafter_kv(
        self,
        next_tokens: torch.Tensor,  # [n] int64: t_{k+1} for each pair key k
        hidden: torch.Tensor,  # [n, H] bf16: hidden_k from the hidden store
        keys: torch.Tensor,  # [n] int64: the pair keys
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter's K (not roped) and V for these pair keys, `[n, Hkv, D]` in the pool dtype."""
        ...
