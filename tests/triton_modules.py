"""Load a module of Triton kernels for tests: compiled on a GPU, interpreted on CPU without one.

Triton reads `TRITON_INTERPRET` (knobs.runtime.interpret) when `@triton.jit`
decorates a function and again at launch, so without a GPU the variable is set
for the whole session and the module is imported, or re-imported if it was
first imported compiled.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

import torch

HAS_CUDA = torch.cuda.is_available()


def load_kernels(module: str, probe: str) -> ModuleType:
    """`module`, with its kernels interpreted when there is no GPU; `probe` names one kernel."""
    if HAS_CUDA:
        return importlib.import_module(module)
    os.environ["TRITON_INTERPRET"] = "1"
    mod = sys.modules.get(module)
    if mod is not None and not type(getattr(mod, probe)).__name__.startswith("Interpreted"):
        return importlib.reload(mod)
    return importlib.import_module(module)
