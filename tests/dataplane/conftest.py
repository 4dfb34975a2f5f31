"""Fixtures for the data-plane tests: fresh random inputs, the Triton kernels, devices.

Without a GPU the Triton kernels run under Triton's interpreter on CPU tensors.
Triton 3.9 reads `TRITON_INTERPRET` (knobs.runtime.interpret) when `@triton.jit`
decorates a function and again at launch, so without a GPU the variable is set
for the whole session and the kernels module is imported (or re-imported) here.
The AOT build test runs the builder in a subprocess, which clears it.
"""

from __future__ import annotations

import random

import pytest
import torch
from triton_modules import HAS_CUDA, load_kernels

DEVICE = "cuda" if HAS_CUDA else "cpu"

_TK = load_kernels("trtllm_mtp_carry.dataplane.triton_kernels", "hidden_row_copy_kernel")


@pytest.fixture(scope="session")
def tk():
    """The triton_kernels module (interpreted on CPU when there is no GPU)."""
    return _TK


@pytest.fixture
def device() -> str:
    """Where the Triton kernels run in this process: cuda if present, else cpu (interpreter)."""
    return DEVICE


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator seeded afresh every run; the seed is printed for reproduction."""
    seed = random.SystemRandom().randrange(2**31)
    print(f"{request.node.name}: seed={seed}")
    return torch.Generator().manual_seed(seed)
