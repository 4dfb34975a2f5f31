"""Stand-in for the device memory TensorRT-LLM's KV cache estimation reads: `torch.cuda.mem_get_info()`.

Not a TensorRT-LLM module: one GPU's memory, modelled so the order of
`KvCacheCreator` (`_util.py` @ 0004396720054fd8e205cbf616f21f0b57c6b412) can run
on a CPU. `mem_get_info()` returns `(free, total)` bytes as torch's does; every
allocation the stand-in models (the weights, the KV pools, the carry's arena
through `allocate`) is charged to it, and one that does not fit raises
`torch.OutOfMemoryError` as torch's caching allocator does. The bytes the stand-in
charges for a KV pool are its modelled size, not the CPU tensor the stand-in
really uses (the stand-in's draft pool is one small layer).

Invariant: `used + free == total` at every moment; `release` of more than was
charged under a name is a RuntimeError.
"""

from __future__ import annotations

from collections import Counter

import torch


class StandinDeviceMemory:
    """One device's memory: `total_bytes`, `weights_bytes` of it taken by the model at start."""

    def __init__(self, total_bytes: int, weights_bytes: int = 0) -> None:
        if weights_bytes > total_bytes:
            raise ValueError(f"weights_bytes {weights_bytes} exceed total_bytes {total_bytes}")
        self.total_bytes = total_bytes
        self.charged: Counter[str] = Counter({"weights": weights_bytes})
        self.fail_next = 0  # allocations to fail from now on (a test's injected failure)

    @property
    def used(self) -> int:
        return sum(self.charged.values())

    def mem_get_info(self) -> tuple[int, int]:
        """`torch.cuda.mem_get_info()`: `(free, total)` bytes."""
        return self.total_bytes - self.used, self.total_bytes

    def charge(self, nbytes: int, what: str) -> None:
        """Take `nbytes` for `what`; `torch.OutOfMemoryError` when they are not free (or injected)."""
        free, _ = self.mem_get_info()
        if self.fail_next > 0 or nbytes > free:
            self.fail_next = max(0, self.fail_next - 1)
            raise torch.OutOfMemoryError(
                f"stand-in device: tried to allocate {nbytes} bytes for {what}; {free} of "
                f"{self.total_bytes} bytes free")
        self.charged[what] += nbytes

    def release(self, nbytes: int, what: str) -> None:
        if nbytes > self.charged[what]:
            raise RuntimeError(f"stand-in device: {what} releases {nbytes} bytes, holds {self.charged[what]}")
        self.charged[what] -= nbytes

    def allocate(self, nbytes: int, device: torch.device, pinned: bool) -> torch.Tensor:
        """The carry's allocator on this device (`trtllm.arena.Allocate`): charged as `carry`,
        a CPU `uint8` tensor of `nbytes` holds the bytes."""
        self.charge(nbytes, "carry")
        return torch.empty(nbytes, dtype=torch.uint8)

    def free(self, storage: torch.Tensor) -> None:
        """Give back what `allocate` charged for `storage` (the carry stood aside)."""
        self.release(storage.numel(), "carry")
