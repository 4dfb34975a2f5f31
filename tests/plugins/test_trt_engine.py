"""Where TensorRT and a GPU exist: build an engine with both AOT plugins and run it without them."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from plugin_helpers import ROOT


def _tensorrt_plugin_importable() -> bool:
    if importlib.util.find_spec("tensorrt") is None:
        return False
    proc = subprocess.run([sys.executable, "-c", "import tensorrt.plugin"], capture_output=True)
    return proc.returncode == 0


pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(torch.cuda.is_available() and not _tensorrt_plugin_importable(),
                       reason="needs tensorrt with tensorrt.plugin (the 'tensorrt' extra) and libnvinfer"),
]


def test_engine_with_both_plugins_runs_on_the_plain_runtime(tmp_path):
    major, minor = torch.cuda.get_device_capability()
    target = f"sm_{major}{minor}a"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    kdir, engine = tmp_path / "k", tmp_path / "carry.engine"
    for cmd in (
        [sys.executable, "builders/build_abi_kernels.py", "--out", str(kdir), "--targets", target,
         "--dtypes", "bf16", "--variants", "a16"],
        [sys.executable, "builders/build_engine.py", "--kernel-dir", str(kdir), "--target", target,
         "--out", str(engine), "--capacity", "1024", "--max-rows", "256"],
    ):
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    proc = subprocess.run([sys.executable, "scripts/run_trt_engine.py", str(engine), "--rows", "77"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 6 and all(line.startswith("PASS") for line in lines)
