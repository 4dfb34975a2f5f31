"""Helpers shared by the data-plane tests (random inputs, poison, bit views)."""

from __future__ import annotations

import torch

from trtllm_mtp_carry.dataplane.reference import (
    drafter_row_append_reference,
    hidden_row_copy_reference,
)

IMPLS = ["reference", "triton", "op", "direct"]
"""Every implementation of a kernel: the torch reference, the Triton kernel, the custom op,
and what the op runs called without the dispatcher (`ops.*_direct`, the pools' and store's path)."""


def copy_impl(name: str, tk):  # tk: the triton_kernels module (fixture)
    """The `hidden_row_copy` implementation called `name`."""
    from trtllm_mtp_carry.dataplane import ops

    return {"reference": hidden_row_copy_reference, "triton": tk.hidden_row_copy_triton,
            "op": torch.ops.trtllm_mtp_carry.hidden_row_copy,
            "direct": ops.hidden_row_copy_direct}[name]


def append_impl(name: str, tk):
    """The `drafter_row_append` implementation called `name`."""
    from trtllm_mtp_carry.dataplane import ops

    return {"reference": drafter_row_append_reference, "triton": tk.drafter_row_append_triton,
            "op": torch.ops.trtllm_mtp_carry.drafter_row_append,
            "direct": ops.drafter_row_append_direct}[name]


def rand(gen: torch.Generator, *shape: int, dtype=torch.bfloat16, device: str = "cpu") -> torch.Tensor:
    """Random normal values, never all zeros, made on CPU then moved."""
    x = torch.randn(*shape, generator=gen).to(dtype)
    x[x == 0] = 0.5
    return x.to(device)


def poison(gen: torch.Generator, *shape: int, dtype=torch.bfloat16, device: str = "cpu") -> torch.Tensor:
    """Random bit patterns (NaNs included) for outputs that must be overwritten or left alone."""
    bits = torch.randint(-(2**15), 2**15, shape, generator=gen, dtype=torch.int16)
    return bits.view(dtype).to(device)


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's raw bytes (NaN poison compares exactly), on CPU."""
    return t.contiguous().cpu().view(torch.uint8)


def increasing_keys(gen: torch.Generator, n: int, start_max: int = 3000) -> torch.Tensor:
    """`n` strictly increasing non-negative int64 keys with random gaps."""
    start = int(torch.randint(0, start_max, (1,), generator=gen))
    return start + torch.cumsum(torch.randint(1, 4, (n,), generator=gen), 0) - 1
