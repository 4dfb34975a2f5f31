"""Rotary embedding of the drafter's K and Q: one formula for every kernel.

What it is for: the drafter writes K rows with RoPE at position ``key + 1``
(SPEC.md conventions) and the model code rotates the drafter's Q with the same
function, so both sides must agree to the bit on the frequency table.

The convention (HF rotate-half, partial; fixed, other code depends on it)::

    rd = rotary_dim                       # even, 0 <= rd <= head_dim
    inv_freq[i] = rope_theta ** (-(2*i)/rd)      i in [0, rd/2)
    angle = pos * inv_freq                # float32
    cos = cat([cos(angle), cos(angle)])   # length rd, same for sin
    out[..., :rd] = x_rot * cos + rotate_half(x_rot) * sin
    out[..., rd:] = x[..., rd:]

Invariants: the frequency table is computed once in float64 on the host and
rounded to float32 (`rope_inv_freq`); the reference and the Triton kernel both
read that table, and both compute in float32 and store in the tensor's dtype.
The table is cached per (rotary_dim, rope_theta, device), so a kernel call
neither allocates nor copies it; the cached tensor is shared and read-only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

__all__ = ["RopeConfig", "apply_rope_reference", "rope_inv_freq", "rope_kernel_table"]

#: Qwen3-Next: partial rotary factor 0.25, theta 1e7.
QWEN3_NEXT_PARTIAL_ROTARY_FACTOR = 0.25
QWEN3_NEXT_ROPE_THETA = 1.0e7


@dataclass(frozen=True)
class RopeConfig:
    """Rotary settings of one attention layer; construction validates them.

    `rotary_dim` is even and in `[0, head_dim]`; `rope_theta` is finite and > 1.
    """

    head_dim: int
    rotary_dim: int
    rope_theta: float

    def __post_init__(self) -> None:
        check_rope_args(self.head_dim, self.rotary_dim, self.rope_theta)

    @classmethod
    def for_qwen3_next(cls, head_dim: int = 256) -> RopeConfig:
        """Qwen3-Next's drafter rotary: `rotary_dim = head_dim * 0.25`, theta 1e7."""
        return cls(head_dim, int(head_dim * QWEN3_NEXT_PARTIAL_ROTARY_FACTOR), QWEN3_NEXT_ROPE_THETA)


def check_rope_args(head_dim: int, rotary_dim: int, rope_theta: float) -> None:
    """Raise ValueError naming the bad value unless the rotary settings are usable."""
    if head_dim <= 0:
        raise ValueError(f"head_dim must be positive, got {head_dim}")
    if rotary_dim < 0 or rotary_dim > head_dim or rotary_dim % 2:
        raise ValueError(
            f"rotary_dim must be even and in [0, head_dim={head_dim}], got {rotary_dim}"
        )
    if not (math.isfinite(rope_theta) and rope_theta > 1.0):
        raise ValueError(f"rope_theta must be finite and > 1, got {rope_theta}")


@lru_cache(maxsize=64)
def _inv_freq_cpu(rotary_dim: int, rope_theta: float) -> torch.Tensor:
    i = torch.arange(rotary_dim // 2, dtype=torch.float64)
    return torch.pow(torch.tensor(rope_theta, dtype=torch.float64), -(2.0 * i) / rotary_dim).float()


def _device_key(device: torch.device | str) -> torch.device:
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


@lru_cache(maxsize=128)
def _inv_freq_on(rotary_dim: int, rope_theta: float, device: torch.device) -> torch.Tensor:
    return _inv_freq_cpu(rotary_dim, rope_theta).to(device)


def rope_inv_freq(rotary_dim: int, rope_theta: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """The float32 frequency table `[rotary_dim // 2]` on `device`: shared, read-only.

    Computed in float64 and rounded once, so every device and kernel gets the same bits.
    One table is kept per (rotary_dim, rope_theta, device) and returned on every call
    (no allocation, no host-to-device copy after the first): callers must not modify it.
    """
    check_rope_args(max(rotary_dim, 1), rotary_dim, rope_theta)
    return _inv_freq_on(int(rotary_dim), float(rope_theta), _device_key(device))


_KERNEL_TABLES: dict[tuple[int, float, torch.device | str], torch.Tensor] = {}


def rope_kernel_table(rotary_dim: int, rope_theta: float, device: torch.device | str) -> torch.Tensor:
    """`rope_inv_freq`, or one float32 zero when `rotary_dim == 0`: a kernel's valid pointer.

    Shared and read-only like `rope_inv_freq` (the kernels never read it at rotary_dim 0).
    A warm call is one dict lookup (the kernels' launchers call it on every launch).
    """
    key = (rotary_dim, rope_theta, device)
    table = _KERNEL_TABLES.get(key)
    if table is None:
        if rotary_dim == 0:
            table = _zero_table(_device_key(device))
        else:
            table = rope_inv_freq(rotary_dim, rope_theta, device)
        # a bare "cuda" names whichever device is current: kept only under the table's own device
        if len(_KERNEL_TABLES) < 256 and table.device == torch.device(device):
            _KERNEL_TABLES[key] = table
    return table


@lru_cache(maxsize=16)
def _zero_table(device: torch.device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.float32, device=device)


def apply_rope_reference(
    x: torch.Tensor,  # [..., num_heads, head_dim] or [..., head_dim]: float dtype
    positions: torch.Tensor,  # [...] integer, broadcast against x's leading dims
    rotary_dim: int,
    rope_theta: float,
) -> torch.Tensor:
    """Return `x` rotated at `positions` (the module's formula), in `x`'s dtype.

    `positions` has `x.dim() - 2` dims (per-token, shared by heads) or `x.dim() - 1`
    dims (per-token-and-head). Pure: `x` is not modified.
    """
    head_dim = x.shape[-1]
    check_rope_args(head_dim, rotary_dim, rope_theta)
    if positions.is_floating_point() or positions.is_complex():
        raise ValueError(f"positions must be an integer tensor, got {positions.dtype}")
    if rotary_dim == 0:
        return x.clone()
    pos = positions
    while pos.dim() < x.dim() - 1:
        pos = pos.unsqueeze(-1)
    inv_freq = rope_inv_freq(rotary_dim, rope_theta, x.device)  # [rd/2]
    angle = pos.to(torch.float32).unsqueeze(-1) * inv_freq  # [..., 1|H, rd/2]
    c, s = angle.cos(), angle.sin()
    cos, sin = torch.cat([c, c], dim=-1), torch.cat([s, s], dim=-1)
    x_rot = x[..., :rotary_dim].float()
    half = rotary_dim // 2
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    out = x.clone()
    out[..., :rotary_dim] = (x_rot * cos + rotated * sin).to(x.dtype)
    return out
