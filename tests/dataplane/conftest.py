"""Fixtures for the data-plane tests: fresh random inputs, the Triton kernels, devices.

Without a GPU the Triton kernels run under Triton's interpreter on CPU tensors.
Triton 3.9 reads `TRITON_INTERPRET` (knobs.runtime.interpret) when `@triton.jit`
decorates a function and again at launch, so without a GPU the variable is set
for the whole session and the kernels module is imported (or re-imported) here.
The AOT build test runs the builder in a subprocess, which clears it.
"""

from __future__ import annotations

import importlib
import os
import random
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
_MOD = "trtllm_mtp_carry.dataplane.triton_kernels"


def _load_triton_kernels():  # -> module
    if HAS_CUDA:
        return importlib.import_module(_MOD)
    # No GPU: Triton can only run interpreted, so the knob stays set for the session
    # (the interpreter also reads it at launch time).
    os.environ["TRITON_INTERPRET"] = "1"
    mod = sys.modules.get(_MOD)
    if mod is not None and not type(mod.hidden_row_copy_kernel).__name__.startswith("Interpreted"):
        return importlib.reload(mod)
    return importlib.import_module(_MOD)


_TK = _load_triton_kernels()


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
