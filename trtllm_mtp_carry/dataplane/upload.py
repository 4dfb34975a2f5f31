"""Small host tensors (page and slot ids, keys) to the device without a host-device sync.

What it is for: a warm turn's drafter prep hands the device a few kilobytes
of ints per prefill chunk. `torch.tensor(list, device="cuda")` and a plain
`host_tensor.to("cuda")` copy from pageable memory, which makes the host wait
until the device's stream has drained: every such call stalls the executor
loop behind whatever the GPU still has queued (the target's forward).
`upload` stages the values in pinned memory and copies them asynchronously on
the current stream, so kernels queued after it read them and the host goes on.

Invariants:
- The device tensor holds exactly the host values (same dtype, same order).
- On CUDA the copy is ordered on the current stream; PyTorch's caching host
  allocator keeps the pinned staging buffer alive until that copy has run, so
  the caller may drop or reuse its host tensor at once.
- Off CUDA nothing is pinned (pinning needs a CUDA driver) and a CPU device
  gets the host tensor itself, no copy.

`dataplane.kv_pool.device_tensor` is the same for a list of ints.
"""

from __future__ import annotations

import torch

__all__ = ["upload"]


def upload(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`host` (a CPU tensor, any shape) on `device`, copied without waiting for the device.

    CUDA: one pinned staging copy, then an asynchronous copy on the current stream.
    CPU: `host` itself. ValueError if `host` is not on the CPU.
    """
    if host.device.type != "cpu":
        raise ValueError(f"upload takes a CPU tensor, got one on {host.device}")
    device = torch.device(device)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)  # another accelerator: its own copy semantics
