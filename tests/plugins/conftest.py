"""Fixtures for the plugin tests: one AOT build per session (in a subprocess), the ABI kernels.

The build runs in a fresh process because it needs Triton's compiler while the
in-process ABI kernels may be interpreted (`TRITON_INTERPRET=1`, no GPU): Triton
reads that knob when `@triton.jit` decorates, so the module is (re)loaded here.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from plugin_helpers import ROOT, TARGETS
from triton_modules import HAS_CUDA, load_kernels

_MOD = "trtllm_mtp_carry.kernels.abi_kernels"


@pytest.fixture(scope="session")
def abi_build(tmp_path_factory) -> tuple[Path, dict]:
    """`(directory, manifest)` of a bf16 build, both variants, for every default target."""
    out = tmp_path_factory.mktemp("abi")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "builders" / "build_abi_kernels.py"), "--out", str(out),
         "--targets", ",".join(TARGETS), "--dtypes", "bf16"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads((out / "manifest.json").read_text())


@pytest.fixture(scope="session")
def ak():
    """The ABI kernels module (interpreted on CPU when there is no GPU)."""
    return load_kernels(_MOD, "hidden_row_copy_abi")


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator seeded afresh every run; the seed is printed for reproduction."""
    seed = random.SystemRandom().randrange(2**31)
    print(f"{request.node.name}: seed={seed}")
    return torch.Generator().manual_seed(seed)
