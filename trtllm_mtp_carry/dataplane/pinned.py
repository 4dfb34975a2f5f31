"""Page-locked host memory of exactly the bytes asked for, and the pinned bytes a process holds.

What it is for: torch's pinned (caching host) allocator rounds every request up to a power
of two and keeps freed blocks cached, so a 24 GiB host arena from
`torch.empty(..., pin_memory=True)` page-locks 32 GiB while the budget, `stats()` and
`info` say 24 GiB (on a GB10 that memory is the GPU's). `pinned_empty` allocates plain
host memory (numpy) and page-locks exactly its bytes with `cudaHostRegister`
(`torch.cuda.cudart()`); the registration ends when the memory is freed (the last tensor
viewing it is gone). `held()` reports both kinds: this module's registrations (exact)
and torch's pinned pool (`torch.cuda.host_memory_stats`, rounded, cached blocks included).

Invariants:
- A tensor from `pinned_empty(n)` has exactly `n` bytes, `is_pinned()` on CUDA (copies
  from it may be `non_blocking`), and stays registered while any view of it lives.
- `registered_bytes()` is the sum of the live registrations' sizes, never more.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np
import torch

__all__ = ["held", "host_clone", "host_empty", "pinned_empty", "registered_bytes"]

_lock = threading.Lock()
_registered = 0  # bytes page-locked by `pinned_empty` and not yet unregistered
_PAGE = 4096


def _cudart() -> Any:
    """torch's CUDA runtime bindings (the seam CPU tests replace)."""
    return torch.cuda.cudart()


def _unregister(ptr: int, nbytes: int) -> None:
    global _registered
    _cudart().cudaHostUnregister(ptr)
    with _lock:
        _registered -= nbytes


def pinned_empty(nbytes: int) -> torch.Tensor:
    """A 1-D uint8 CPU tensor of exactly `nbytes`, page-locked for exactly those bytes.

    `torch.OutOfMemoryError` when CUDA refuses the registration (the memory is released
    then); ValueError for a negative size. Zero bytes: an empty tensor, nothing registered.
    """
    if type(nbytes) is not int or nbytes < 0:
        raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    base = np.empty(nbytes + _PAGE, dtype=np.uint8)  # the registered range starts on a page
    start = -int(base.ctypes.data) % _PAGE
    array = base[start:start + nbytes]
    ptr = int(array.ctypes.data)
    cudart = _cudart()
    err = cudart.cudaHostRegister(ptr, nbytes, 0)
    if err != cudart.cudaError.success:
        raise torch.OutOfMemoryError(f"cudaHostRegister of {nbytes} bytes failed: {err}")
    global _registered
    with _lock:
        _registered += nbytes
    # the tensor's storage holds `array` (and it `base`) until its last view is gone: then unregister
    done = weakref.finalize(base, _unregister, ptr, nbytes)
    done.atexit = False  # at exit the process's page locks go with it; CUDA may be torn down
    return torch.from_numpy(array)


def host_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """An uninitialized contiguous CPU tensor of `shape` and `dtype`; with `pin`, page-locked for
    exactly its bytes (`pinned_empty`, one registration: for a host copy made once, off a hot
    loop), else plain memory. What a pinned host copy is made of instead of
    `torch.empty(..., pin_memory=True)`, which torch rounds up to a power of two."""
    if not pin:
        return torch.empty(shape, dtype=dtype)
    nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
    return pinned_empty(nbytes).view(dtype).view(shape)


def host_clone(t: torch.Tensor) -> torch.Tensor:
    """A blocking copy of `t` in host memory, page-locked for exactly its bytes when `t` is on a GPU
    (for asynchronous copies back), so `t` may be reused at once; always a copy, also of a tensor
    already on the host."""
    return host_empty(t.shape, t.dtype, t.is_cuda).copy_(t)


def registered_bytes() -> int:
    """Bytes page-locked by `pinned_empty` now (exact)."""
    with _lock:
        return _registered


def held() -> dict[str, int]:
    """The pinned host bytes this process holds: `registered` (`pinned_empty`'s, exact) and
    `torch_pool` (torch's caching host allocator: every block it pinned, rounded up to a power
    of two, cached ones included; 0 without CUDA or where torch does not report it)."""
    pool = 0
    if torch.cuda.is_available():
        try:
            pool = int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))
        except (AttributeError, RuntimeError):  # a torch without host allocator stats
            pool = 0
    return {"registered": registered_bytes(), "torch_pool": pool}
