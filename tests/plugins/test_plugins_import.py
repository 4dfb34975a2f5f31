"""Without TensorRT / cuda-python: imports work, and using a plugin or the launcher names the extra."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from plugin_helpers import ROOT

from trtllm_mtp_carry.dataplane import ops

HAS_TRT = importlib.util.find_spec("tensorrt") is not None
HAS_CUDA_PYTHON = importlib.util.find_spec("cuda") is not None


def _run(code: str, extra_path: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, str(ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)


def test_importing_plugins_and_kernels_loads_no_tensorrt_torch_or_triton():
    proc = _run(
        "import sys\n"
        "import trtllm_mtp_carry.plugins, trtllm_mtp_carry.kernels.abi, trtllm_mtp_carry.kernels.ptx\n"
        "print(sorted(m for m in ('tensorrt', 'torch', 'triton') if m in sys.modules))\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.skipif(HAS_TRT, reason="tensorrt is importable here")
def test_using_a_plugin_without_tensorrt_names_the_extra(tmp_path):
    from trtllm_mtp_carry import plugins

    for call in (lambda: plugins.register_plugins(tmp_path, "sm_121a"),
                 lambda: plugins.add_hidden_row_copy(None, None, None, None),
                 lambda: plugins.add_drafter_row_append(None, *[None] * 8)):
        with pytest.raises(RuntimeError, match=r"pip install 'trtllm-mtp-carry\[tensorrt\]'"):
            call()


def test_tensorrt_stub_without_libnvinfer_gives_the_same_clear_error(tmp_path):
    """The `tensorrt` sdist installs a package whose import fails without libnvinfer."""
    stub = tmp_path / "tensorrt"
    stub.mkdir()
    (stub / "__init__.py").write_text(
        "raise OSError('libnvinfer.so.10: cannot open shared object file')\n")
    proc = _run(
        "from trtllm_mtp_carry import plugins\n"
        "try:\n    plugins.register_plugins('x', 'sm_121a')\n"
        "except RuntimeError as e:\n    print(e)\n",
        extra_path=str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr
    assert "pip install 'trtllm-mtp-carry[tensorrt]'" in proc.stdout
    assert "libnvinfer.so.10" in proc.stdout


@pytest.mark.skipif(HAS_CUDA_PYTHON, reason="cuda-python is importable here")
def test_aot_launcher_without_cuda_python_names_the_extra():
    from trtllm_mtp_carry.kernels import aot_launcher

    with pytest.raises(RuntimeError, match=r"pip install 'trtllm-mtp-carry\[cuda\]'"):
        aot_launcher._driver()


def test_kernel_backend_choice_defaults_to_triton_and_refuses_other_values(monkeypatch):
    monkeypatch.delenv(ops.KERNELS_ENV, raising=False)
    assert ops.cuda_kernels() == "triton"
    monkeypatch.setenv(ops.KERNELS_ENV, "aot")
    assert ops.cuda_kernels() == "aot"
    monkeypatch.setenv(ops.KERNELS_ENV, "cutlass")
    with pytest.raises(ValueError, match="TRTLLM_MTP_CARRY_KERNELS must be 'triton' or 'aot', got 'cutlass'"):
        ops.cuda_kernels()


def test_cpu_tensors_use_the_reference_whatever_the_backend(monkeypatch):
    monkeypatch.setenv(ops.KERNELS_ENV, "aot")
    src = torch.arange(12, dtype=torch.bfloat16).view(3, 4)
    dst = torch.zeros(5, 4, dtype=torch.bfloat16)
    torch.ops.trtllm_mtp_carry.hidden_row_copy(src, 1, dst, 2, 2)
    assert torch.equal(dst[2:4], src[1:3]) and not dst[[0, 1, 4]].any()


def test_aot_kernel_dir_comes_from_the_environment(monkeypatch, tmp_path):
    from trtllm_mtp_carry.kernels import aot_launcher

    monkeypatch.setenv(aot_launcher.KERNEL_DIR_ENV, str(tmp_path))
    assert aot_launcher.kernel_dir() == (tmp_path, False)
    monkeypatch.delenv(aot_launcher.KERNEL_DIR_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert aot_launcher.kernel_dir() == (tmp_path / "trtllm_mtp_carry" / "abi-kernels", True)


def test_aot_launcher_picks_the_built_entry_and_names_a_missing_one(monkeypatch, abi_build):
    from trtllm_mtp_carry.kernels import aot_launcher

    out, _ = abi_build
    monkeypatch.setenv(aot_launcher.KERNEL_DIR_ENV, str(out))
    store = aot_launcher._Store()
    directory, e = store.entry("drafter_row_append", "bf16", "any", "sm_100a", (2, 130))
    assert directory == out and e["ptx"] == "drafter_row_append.h2d256.bf16.any.sm_100a.ptx"
    with pytest.raises(RuntimeError, match=r"no built hidden_row_copy kernel for dtype=fp16 "
                                           r"variant=a16 target=sm_121a in .*build_abi_kernels.py"):
        store.entry("hidden_row_copy", "fp16", "a16", "sm_121a", None)
