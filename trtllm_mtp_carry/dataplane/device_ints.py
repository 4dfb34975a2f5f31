"""Host ints (block ids, keys, block tables) onto a device without a stream sync.

What it is for: every per-turn upload of bookkeeping ids in the data plane goes
through `device_tensor`. `torch.tensor(values, device=cuda)` copies from pageable
memory with `non_blocking=False`, which waits for all the stream's queued work
(aten's `memcpy_and_sync`): on a warm turn that stalls the executor behind the
GPU. Staging the values in pinned memory and copying with `non_blocking=True`
orders the copy on the current stream like any kernel, so stream-ordered readers
see the same values and the host never waits.

Invariant: torch's pinned host allocator keeps the staging block alive until the
copy it feeds has run, so the values may be dropped on return.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["device_copy", "device_tensor"]


def device_tensor(values: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a 1-D tensor of `dtype` on `device`; on CUDA, no stream sync."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def device_copy(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The CPU tensor `host` (ids computed on the host: page and slot indices) on `device`; on
    CUDA, no stream sync (pinned staging, a non-blocking copy); on the CPU, `host` itself.

    The staging block is always fresh, so the caller may change `host` at once: a `host` that
    is pinned already would be read by the copy whenever it runs (`pin_memory()` returns it)."""
    if host.device.type != "cpu":
        raise ValueError(f"device_copy takes a CPU tensor, got one on {host.device}")
    if device.type != "cuda":
        return host.to(device)
    staged = torch.empty(host.shape, dtype=host.dtype, pin_memory=True).copy_(host)
    return staged.to(device, non_blocking=True)
